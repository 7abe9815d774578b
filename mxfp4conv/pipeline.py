"""``convert``: resolve -> detect -> validate -> plan -> (dry run) -> stream units -> verify -> publish.

No click, no rich, no print: progress goes through the ``on_progress(bytes_done, bytes_total)``
callback and the result is a ``ConvertReport``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from mxfp4conv import __version__
from mxfp4conv.canonicalize import to_mxfp4
from mxfp4conv.errors import InputError, OutputError, UsageError
from mxfp4conv.inspect import SCHEMA_VERSION, analyze, writer_context
from mxfp4conv.io.atomic import check_destination, publish, remove_tree, staging_path
from mxfp4conv.io.checkpoint import PICKLE_SUFFIXES, Checkpoint, open_checkpoint
from mxfp4conv.io.pinned import use_fast_pinning
from mxfp4conv.io.safetensors_io import FileSlice, InflightBudget, st_dtype, stream_safetensors
from mxfp4conv.layouts.base import Plan
from mxfp4conv.writers import OutTensor, Target, WriterContext, get_target, resolve_auto
from mxfp4conv.writers.base import UnitSpec

__all__ = ["MANIFEST", "ConvertOptions", "ConvertReport", "convert"]

MANIFEST = "mxfp4conv.json"
GB = 1000**3
_SKIP_FILES = {"config.json", "model.safetensors.index.json", "hf_quant_config.json", MANIFEST}

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ConvertOptions:
    target: str = "auto"
    scale_rule: str = "mse"
    device: str = "cpu"
    max_shard_size: int = 5 * GB
    overwrite: bool = False
    dry_run: bool = False
    verify: bool = True
    skip_if_current: bool = False
    revision: str | None = None
    extra: dict[str, str] = field(default_factory=dict)  # target options (tp_size, engine, ...)
    resume: bool = False  # reuse finished shards of an interrupted run's staging folder
    partition: tuple[int, int] | None = None  # (i, n): write only shards j with j % n == i, publish nothing
    finish: bool = False  # publish once every partition's shards are in the staging folder
    devices: tuple[str, ...] = ()  # explicit devices for unit transforms, e.g. ("cuda:0", "cuda:1")

    def fingerprint_dict(self) -> dict[str, Any]:
        return {"target": self.target, "scale_rule": self.scale_rule, "max_shard_size": self.max_shard_size,
                "extra": dict(sorted(self.extra.items()))}


@dataclass
class ConvertReport:
    source: str
    destination: str
    layout: str
    target: str
    status: str  # "converted" | "dry-run" | "skipped"
    shards: list[dict[str, Any]] = field(default_factory=list)
    renamed: int = 0
    fused_layers: int = 0
    requantized: int = 0
    passthrough: int = 0
    bytes_written: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    verify: dict[str, Any] | None = None
    requant_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    # where NVFP4 -> MXFP4 ran: {"devices": [...], "cpu_kernel": "native" | "torch" | None}; None if
    # nothing is requantized
    compute: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["schema_version"] = SCHEMA_VERSION
        return d


@dataclass
class _ShardPlan:
    folder: str  # "" or "rank-N"
    file: str
    units: list[UnitSpec] = field(default_factory=list)
    tensors: list[OutTensor] = field(default_factory=list)
    nbytes: int = 0


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def source_fingerprint(ckpt: Checkpoint) -> dict[str, Any]:
    """Hashes identifying the source: full sha256 of JSON files, header sha256 + size of shards."""
    out: dict[str, Any] = {}
    for name in ("config.json", "hf_quant_config.json", "model.safetensors.index.json"):
        if (ckpt.root / name).exists():
            out[name] = {"sha256": _sha256(ckpt.root / name)}
    for f in ckpt.shard_files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            head = fh.read(n)
        out[ckpt.rel(f)] = {"size": f.stat().st_size, "header_sha256": hashlib.sha256(head).hexdigest()}
    return out


def plan_shards(target: Target, ctx: WriterContext, plan: Plan, max_bytes: int, folder: str) -> list[_ShardPlan]:
    """Whole units per shard, in plan order; a new shard starts when the next unit would overflow."""
    shards: list[_ShardPlan] = []
    cur: _ShardPlan | None = None
    for spec in plan.units:
        outs = target.out_specs(spec, ctx)
        size = sum(t.nbytes for t in outs)
        if cur is None or (cur.tensors and cur.nbytes + size > max_bytes):
            cur = _ShardPlan(folder, "")
            shards.append(cur)
        cur.units.append(spec)
        cur.tensors.extend(outs)
        cur.nbytes += size
    n = len(shards)
    for i, s in enumerate(shards):
        s.file = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    return shards


def resolve_device(name: str, needed: bool = True) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; other names unchanged. With
    ``needed=False`` (nothing will be requantized: renames, Marlin repacks of MXFP4) ``auto`` is
    ``cpu`` without importing torch, so such conversions and ``inspect`` start in a fraction of a second."""
    if name != "auto":
        return name
    if not needed:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_kernel(device: str, needed: bool) -> str | None:
    """Which CPU requant path runs (``native`` or ``torch``), None when nothing is requantized on the
    CPU. Builds the compiled kernel now, so that ``MXFP4CONV_CPU_KERNEL=native`` without a C compiler
    (or a bad mode) fails before any output is written, as a ``UsageError``."""
    if not needed or device != "cpu":
        return None
    from mxfp4conv.kernels import requant_native

    try:
        return "native" if requant_native.load() is not None else "torch"
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc), hint="unset MXFP4CONV_CPU_KERNEL, or install a C compiler (cc / gcc / clang)") from exc


def check_hasher() -> None:
    """Load the shard hasher now (``mxfp4conv/io/hash_native.py``), so that ``MXFP4CONV_HASHER=native``
    where it cannot be built (or a bad mode) fails before any output is written, as a ``UsageError``."""
    from mxfp4conv.io import hash_native

    try:
        hash_native.load()
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc), hint="unset MXFP4CONV_HASHER, or install a C compiler (cc / gcc / clang)") from exc


# The NVFP4 -> MXFP4 numerics contract (docs/NUMERICS.md) that requantized outputs are made under;
# part of their fingerprint, so `--skip-if-current`, `--resume` and `--finish` never take bytes or
# statistics of another contract for current. 2: the exact MSE decision, float32 block statistics and
# 8-lane row sums (docs/NUMERICS.md, "Contract version"); outputs of earlier builds carry no "numerics" key.
REQUANT_NUMERICS = 2


def _needs_device(ctx: WriterContext) -> bool:
    """Whether any unit is requantized (the only work that runs on ``--device``)."""
    return ctx.facts.source_quant == "nvfp4" and ctx.options.get("keep_nvfp4") != "1"


def _devices(opts: ConvertOptions) -> list[str]:
    """Where units are transformed: every visible GPU for ``--device cuda``, the listed ones, or one device."""
    if opts.devices:
        return list(opts.devices)
    if opts.device == "cuda":
        import torch

        if torch.cuda.is_available():
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [opts.device]


def _read(spec: UnitSpec, ckpt: Checkpoint, layout: Any, target: Target, ctx: WriterContext,
          device: str = "cpu") -> tuple[Any, float]:
    """A unit's source: the byte ranges of a pure rename (never decoded), or its canonical form
    (NVFP4 stacks bound for a GPU requant are read into page-locked memory)."""
    t0 = time.perf_counter()
    slices = direct_slices(spec, ckpt, target, ctx)
    if slices is not None:
        return slices, time.perf_counter() - t0
    pin = device.startswith("cuda") and _needs_device(ctx)
    if pin:
        import torch

        pin = torch.cuda.is_available()
        if pin:
            use_fast_pinning()
    return layout.read(ckpt, spec, pin=pin), time.perf_counter() - t0


def _transform(spec: UnitSpec, ckpt: Checkpoint, layout: Any, target: Target, ctx: WriterContext,
               opts: ConvertOptions, device: str, source: tuple[Any, float] | None = None,
               ) -> tuple[list[torch.Tensor], dict[str, Any], float, float]:
    """Read one unit (unless ``source`` holds it already), requantize it if needed, encode it:
    (tensors, requant stats, read s, transform s)."""
    unit, t_read = source if source is not None else _read(spec, ckpt, layout, target, ctx, device)
    if isinstance(unit, list):  # a pure rename: bytes are copied by the writer
        return unit, {}, t_read, 0.0
    if device.startswith("cuda"):
        import torch

        with torch.cuda.device(torch.device(device)):  # kernels launch on the thread's current device
            return _transform_on(unit, spec, ckpt, target, ctx, opts, device, t_read)
    return _transform_on(unit, spec, ckpt, target, ctx, opts, device, t_read)


def _transform_on(unit: Any, spec: UnitSpec, ckpt: Checkpoint, target: Target, ctx: WriterContext,
                  opts: ConvertOptions, device: str, t_read: float) -> tuple[list[torch.Tensor], dict[str, Any], float, float]:
    t1 = time.perf_counter()
    stats: dict[str, Any] = {}
    if ctx.options.get("keep_nvfp4") != "1":
        try:
            unit, stats = to_mxfp4(unit, rule=opts.scale_rule, device=device)
        except ValueError as exc:  # invalid NVFP4 scales: name the unit and the first source file
            ref = ckpt.tensors[spec.sources[0]]
            raise InputError(str(exc), file=ckpt.rel(ckpt.tensors[bad].file) if (bad := _scale_tensor(ckpt, spec)) in ckpt.tensors else ckpt.rel(ref.file), tensor=bad,
                             hint="the checkpoint's scales are corrupt; re-export it") from exc
    if not stats:  # requantized scales are made here, bytes 0..254 (NUMERICS.md): only a source's are checked
        _validate_mx(unit, spec, ckpt)
    outs = target.encode(unit, spec, ctx)
    return outs, stats, t_read, time.perf_counter() - t1


def direct_slices(spec: UnitSpec, ckpt: Checkpoint, target: Target, ctx: WriterContext) -> list[FileSlice] | None:
    """Source byte ranges that become the unit's output tensors unchanged, or None (needs decoding)."""
    if ctx.facts.source_quant != "mxfp4" and spec.kind != "passthrough":
        return None
    names = target.direct_sources(spec, ctx)
    if names is None:
        return None
    outs = target.out_specs(spec, ctx)
    refs = [ckpt.tensors[n] for n in names]
    if len(refs) != len(outs) or any(r.dtype != o.dtype or r.nbytes != o.nbytes
                                     for r, o in zip(refs, outs, strict=True)):
        return None
    # E8M0 0xFF (NaN) is invalid input even when only copied: the writer's hasher, which reads every
    # copied byte anyway, checks these slices (no separate pass over the scales)
    return [FileSlice(r.file, r.begin, r.nbytes, r.name,
                      e8m0=spec.kind != "passthrough" and r.dtype == "U8" and r.name.endswith(("weight_scale", "_scales")))
            for r in refs]


def _read_sizes(units: list[UnitSpec], direct: list[list[FileSlice] | None], ckpt: Checkpoint) -> list[int]:
    """Bytes each unit's read holds in memory: its source tensors', or 0 when the writer copies them
    (``direct``: each unit's ``direct_slices``)."""
    return [0 if d is not None else sum(ckpt.tensors[n].nbytes for n in spec.sources if n in ckpt.tensors)
            for spec, d in zip(units, direct, strict=True)]


def _read_ahead(sizes: list[int], limit: int) -> list[int]:
    """The single-device read-ahead schedule: for each unit i, how many units (from the first) have
    been submitted for reading once i is the current one. Always i + 1, and more while the bytes of
    the submitted units beyond i stay within ``limit``. ``sizes`` are the bytes a unit's read holds in
    memory: 0 for units whose bytes the writer copies straight from the source (nothing is read), so
    a run of small pass-through units between two MoE layers does not keep the next layer from being
    read while this one is transformed."""
    upto: list[int] = []
    nxt = 0
    queued = 0  # bytes of the units submitted beyond the current one: sizes[i + 1:nxt]
    for i in range(len(sizes)):
        if nxt > i:
            queued -= sizes[i]
        while nxt < len(sizes) and (nxt <= i + 1 or queued + sizes[nxt] <= limit):
            queued += sizes[nxt] if nxt > i else 0
            nxt += 1
        upto.append(nxt)
    return upto


def _unit_results(shard: _ShardPlan, ckpt: Checkpoint, layout: Any, target: Target, ctx: WriterContext,
                  opts: ConvertOptions) -> Iterator[tuple[list[torch.Tensor], dict[str, Any], float, float]]:
    """Units in plan order. One device: units ahead are read on a helper thread while this one is
    transformed (``_read_ahead``: at most about two of the largest units in memory). Several devices:
    one unit per device in flight, each read and transformed on its device's thread."""
    devs = _devices(opts)
    if len(devs) == 1:
        units = shard.units
        direct = [direct_slices(spec, ckpt, target, ctx) for spec in units]
        sizes = _read_sizes(units, direct, ckpt)
        upto = _read_ahead(sizes, max(sizes, default=0))
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxfp4conv-read") as reader:
            ahead: dict[int, Future[tuple[Any, float]]] = {}
            nxt = 0
            for i, spec in enumerate(units):
                while nxt < upto[i]:
                    if direct[nxt] is None:
                        ahead[nxt] = reader.submit(_read, units[nxt], ckpt, layout, target, ctx, devs[0])
                    nxt += 1
                source = ahead.pop(i).result() if direct[i] is None else (direct[i], 0.0)
                yield _transform(spec, ckpt, layout, target, ctx, opts, devs[0], source)
        return
    with ThreadPoolExecutor(max_workers=len(devs), thread_name_prefix="mxfp4conv-unit") as pool:
        window: deque[Future[tuple[list[torch.Tensor], dict[str, Any], float, float]]] = deque()
        for i, spec in enumerate(shard.units):
            window.append(pool.submit(_transform, spec, ckpt, layout, target, ctx, opts, devs[i % len(devs)]))
            if len(window) >= len(devs):
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


def _encode_shard(shard: _ShardPlan, ckpt: Checkpoint, layout: Any, target: Target, ctx: WriterContext,
                  opts: ConvertOptions, report: ConvertReport, on_progress: Progress | None,
                  done: list[int], total: int) -> Iterator[torch.Tensor | FileSlice]:
    results = _unit_results(shard, ckpt, layout, target, ctx, opts)
    for spec, (outs, stats, t_read, t_transform) in zip(shard.units, results, strict=True):
        report.requant_stats.update(stats)
        report.seconds["read"] = report.seconds.get("read", 0.0) + t_read
        report.seconds["transform"] = report.seconds.get("transform", 0.0) + t_transform
        expect = target.out_specs(spec, ctx)
        for o, t in zip(expect, outs, strict=True):
            if isinstance(t, FileSlice):
                done[0] += t.length
                yield t
                continue
            if st_dtype(t.dtype) != o.dtype or tuple(t.shape) != o.shape:
                raise AssertionError(f"{o.name}: encoded {st_dtype(t.dtype)}{list(t.shape)}, planned {o.dtype}{list(o.shape)}")
            done[0] += t.numel() * t.element_size()
            yield t
        if on_progress:
            on_progress(done[0], total)


def _scale_tensor(ckpt: Checkpoint, spec: UnitSpec) -> str:
    """The first source tensor of a unit whose NVFP4 scales are invalid (error path only)."""
    import torch

    from mxfp4conv.formats.nvfp4 import validate_nvfp4_scales

    for name in spec.sources:
        for suffix in ("weight_global_scale", "weight_scale_2"):
            if name.endswith("." + suffix):
                g = ckpt.tensors[name].load().float().reshape(1)
                if validate_nvfp4_scales(torch.zeros(1, 1, dtype=torch.float8_e4m3fn), g) is not None:
                    return name
        if name.endswith(".weight_scale") and ckpt.tensors[name].dtype == "F8_E4M3":
            sc = ckpt.tensors[name].load()
            if validate_nvfp4_scales(sc, torch.ones(sc.shape[:-1])) is not None:
                return name
    return spec.key


def _validate_mx(unit: Any, spec: UnitSpec, ckpt: Checkpoint) -> None:
    """E8M0 0xFF (NaN) scales are invalid input: name the tensor."""
    from mxfp4conv.canonical import DenseFP4, MoELayer
    from mxfp4conv.formats.fp4 import e8m0_has_nan

    weights = []
    if isinstance(unit, MoELayer):
        weights = [("w13", unit.w13), ("w2", unit.w2)]
    elif isinstance(unit, DenseFP4):
        weights = [("weight", unit.weight)]
    for label, w in weights:
        if w.quant == "mxfp4" and e8m0_has_nan(w.scales):
            bad = [s for s in spec.sources if s.endswith(("scale", "scales"))]
            name = _first_bad_scale(ckpt, bad) or f"{spec.key} ({label})"
            raise InputError("E8M0 scale byte 0xFF (NaN) is not a valid MXFP4 scale", tensor=name,
                             file=ckpt.rel(ckpt.tensors[bad[0]].file) if bad else str(ckpt.root),
                             hint="the checkpoint is corrupt; re-export it")


def _first_bad_scale(ckpt: Checkpoint, names: list[str]) -> str | None:
    from mxfp4conv.formats.fp4 import e8m0_has_nan

    for n in names:
        ref = ckpt.tensors[n]
        if ref.dtype == "U8" and e8m0_has_nan(ref.load()):
            return n
    return None


def _copy_extras(src: Path, dst: Path, drop_hqc: bool) -> list[str]:
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name in _SKIP_FILES or p.suffix == ".safetensors" or p.suffix in PICKLE_SUFFIXES:
            continue
        shutil.copyfile(p, dst / p.name)
        copied.append(p.name)
    if not drop_hqc and (src / "hf_quant_config.json").exists():
        shutil.copyfile(src / "hf_quant_config.json", dst / "hf_quant_config.json")
    return copied


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def prepare(src: str | Path, opts: ConvertOptions) -> tuple[Checkpoint, Any, Plan, Target, WriterContext]:
    ckpt = open_checkpoint(src, opts.revision)
    layout, plan, _ = analyze(ckpt)
    if plan.problems:
        p = plan.problems[0]
        more = f" (and {len(plan.problems) - 1} more; run mxfp4conv inspect)" if len(plan.problems) > 1 else ""
        raise InputError(p.message + more, file=p.file, tensor=p.tensor or None,
                         hint="run `mxfp4conv inspect SRC` for every problem; fix or re-download the checkpoint")
    name = resolve_auto(plan.facts.model_type) if opts.target == "auto" else opts.target
    target = get_target(name)
    ctx = writer_context(plan, ckpt, {**opts.extra, "target": name, "scale_rule": opts.scale_rule})
    why = target.refuse(ctx)
    if why and opts.target == "auto" and name == "gpt-oss":
        # gpt_oss with FP4 attention (llm-compressor) has no native layout: Quark is the served one
        name = "quark"
        target = get_target(name)
        ctx = writer_context(plan, ckpt, {**opts.extra, "target": name, "scale_rule": opts.scale_rule})
        why = target.refuse(ctx)
    if why:
        raise UsageError(f"cannot convert {plan.layout} ({plan.facts.model_type}) to --to {name}: {why}")
    return ckpt, layout, plan, target, ctx


def convert(src: str | Path, dst: str | Path, opts: ConvertOptions, on_progress: Progress | None = None) -> ConvertReport:
    """Convert SRC into DST (see module docstring). Raises ``ConvertError`` subclasses."""
    t_start = time.perf_counter()
    ckpt, layout, plan, target, ctx = prepare(src, opts)
    opts = dataclasses.replace(opts, device=resolve_device(opts.device, _needs_device(ctx)))
    dst = Path(dst)
    report = ConvertReport(str(src), str(dst), plan.layout, target.NAME, "dry-run" if opts.dry_run else "converted")
    if _needs_device(ctx):
        report.compute = {"devices": _devices(opts), "cpu_kernel": cpu_kernel(opts.device, not opts.dry_run)}
    fingerprint: dict[str, Any] = {"tool": __version__, "source": source_fingerprint(ckpt),
                                   "options": opts.fingerprint_dict()}
    if _needs_device(ctx):
        fingerprint["numerics"] = REQUANT_NUMERICS  # outputs of another requant contract are not current
    if opts.skip_if_current and (dst / MANIFEST).exists():
        try:
            old = json.loads((dst / MANIFEST).read_text())
        except (OSError, ValueError):
            old = {}
        if old.get("fingerprint") == fingerprint:
            report.status = "skipped"
            report.seconds["total"] = time.perf_counter() - t_start
            return report
    if not opts.dry_run:
        check_hasher()
    check_destination(ckpt.root, dst, overwrite=opts.overwrite or opts.skip_if_current)

    ranks = target.ranks(ctx)
    shard_plans: list[tuple[str, WriterContext, list[_ShardPlan]]] = []
    for r in ranks:
        rctx = dataclasses.replace(ctx, options={**ctx.options, "tp_rank": str(r)})
        folder = target.rank_folder(r, rctx)
        shard_plans.append((folder, rctx, plan_shards(target, rctx, plan, opts.max_shard_size, folder)))
    _fill_plan_report(report, plan, target, ctx, shard_plans)
    if opts.dry_run:
        report.seconds["total"] = time.perf_counter() - t_start
        return report

    staging = staging_path(dst)
    finished = _prepare_staging(staging, fingerprint, opts)
    keep_staging = opts.resume or opts.partition is not None or opts.finish
    try:
        outputs = _write_all(ckpt, layout, target, plan, shard_plans, staging, opts, report, on_progress,
                             (finished, fingerprint))
        if opts.partition is not None:
            report.status = "partial"
            report.seconds["total"] = time.perf_counter() - t_start
            return report
        for p in staging.glob(_PROGRESS_GLOB):
            p.unlink()
        if opts.verify:
            from mxfp4conv.verify import verify_output

            t0 = time.perf_counter()
            report.verify = verify_output(ckpt.root, staging, manifest_opts=opts, _prepared=(ckpt, layout, plan, target, ctx)).to_dict()
            report.seconds["verify"] = time.perf_counter() - t0
        manifest = {"schema_version": SCHEMA_VERSION, "tool": "mxfp4conv", "version": __version__,
                    "source": {"name": Path(str(src)).name, "repo_id": ckpt.repo_id, "revision": ckpt.revision,
                               "layout": plan.layout, "files": fingerprint["source"]},
                    "target": target.NAME, "options": opts.fingerprint_dict() | {"device_independent": True},
                    "fingerprint": fingerprint, "outputs": outputs, "requant_stats": report.requant_stats,
                    "verified": bool(report.verify and report.verify.get("ok"))}
        (staging / MANIFEST).write_bytes(_json_bytes(manifest))
        publish(staging, dst)
    except OutputError:
        if opts.partition is None:  # e.g. a full disk: nothing worth resuming; other partitions' shards are kept
            remove_tree(staging)
        raise
    except OSError as exc:  # JSON files, copied extras, manifest, publish
        if opts.partition is None:
            remove_tree(staging)
        raise OutputError(f"cannot write the output: {exc.strerror or exc}", file=str(getattr(exc, "filename", None) or dst),
                          hint="free disk space or choose another destination") from exc
    except BaseException:
        if not keep_staging:
            remove_tree(staging)
        raise
    report.seconds["total"] = time.perf_counter() - t_start
    return report


_PROGRESS_GLOB = ".mxfp4conv-progress*.json"


def _progress_file(staging: Path, opts: ConvertOptions) -> Path:
    if opts.partition is not None:
        return staging / f".mxfp4conv-progress-{opts.partition[0]}of{opts.partition[1]}.json"
    return staging / ".mxfp4conv-progress.json"


def _prepare_staging(staging: Path, fingerprint: dict[str, Any], opts: ConvertOptions) -> dict[str, dict[str, Any]]:
    """The finished shards recorded in an existing staging folder (resume / partitions), else a fresh folder."""
    resuming = opts.resume or opts.partition is not None or opts.finish
    finished: dict[str, dict[str, Any]] = {}
    if resuming and staging.is_dir():
        for p in sorted(staging.glob(_PROGRESS_GLOB)):
            try:
                rec = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if rec.get("fingerprint") != fingerprint:
                if opts.partition is not None or opts.finish:
                    raise UsageError(f"staging folder {staging} belongs to a conversion with other inputs or options",
                                     hint="rerun every partition with the same SRC and options, or delete it")
                continue
            finished.update(rec.get("shards", {}))
        if not finished and opts.resume and opts.partition is None:  # partitions may run at once: never
            remove_tree(staging)  # delete a staging folder that another partition is writing into
    elif not resuming:
        remove_tree(staging)
    if opts.finish and not staging.is_dir():
        raise UsageError(f"nothing to finish: no staging folder {staging}",
                         hint="run the --partition i/n conversions first")
    staging.mkdir(parents=True, exist_ok=True)  # partitions starting together may race to create it
    return finished


def _reuse(path: Path, rec: dict[str, Any] | None) -> bool:
    """A finished shard is reused only if its bytes still hash to what was recorded."""
    return bool(rec) and path.is_file() and _sha256(path) == rec["sha256"]  # type: ignore[index]


def _fill_plan_report(report: ConvertReport, plan: Plan, target: Target, ctx: WriterContext,
                      shard_plans: list[tuple[str, WriterContext, list[_ShardPlan]]]) -> None:
    kinds = [u.kind for u in plan.units]
    report.fused_layers = kinds.count("moe")
    report.passthrough = kinds.count("passthrough")
    report.requantized = 0 if plan.facts.source_quant == "mxfp4" or ctx.options.get("keep_nvfp4") == "1" else (
        kinds.count("moe") + kinds.count("dense"))
    report.renamed = sum(len(target.out_specs(u, ctx)) for u in plan.units if u.kind != "passthrough")
    for folder, _, shards in shard_plans:
        for s in shards:
            report.shards.append({"file": f"{folder}/{s.file}" if folder else s.file, "bytes": s.nbytes,
                                  "tensors": len(s.tensors), "units": len(s.units)})


def _write_all(ckpt: Checkpoint, layout: Any, target: Target, plan: Plan,
               shard_plans: list[tuple[str, WriterContext, list[_ShardPlan]]], staging: Path, opts: ConvertOptions,
               report: ConvertReport, on_progress: Progress | None,
               resume: tuple[dict[str, dict[str, Any]], dict[str, Any]]) -> dict[str, str]:
    finished, fingerprint = resume
    outputs: dict[str, str] = {}
    fin = _ShardFinisher(_progress_file(staging, opts), fingerprint, report, outputs)
    total = sum(s.nbytes for _, _, shards in shard_plans for s in shards)
    done = [0]
    try:
        j = -1
        for folder, rctx, shards in shard_plans:
            out_dir = staging / folder if folder else staging
            out_dir.mkdir(exist_ok=True)
            wmap: dict[str, str] = {}
            for shard in shards:
                j += 1
                rel = f"{folder}/{shard.file}" if folder else shard.file
                wmap.update(dict.fromkeys((t.name for t in shard.tensors), shard.file))
                if opts.partition is not None and j % opts.partition[1] != opts.partition[0]:
                    continue
                path = out_dir / shard.file
                rec = finished.get(rel)
                if _reuse(path, rec):
                    assert rec is not None
                    outputs[rel] = rec["sha256"]
                    report.requant_stats.update(rec.get("stats", {}))
                    done[0] += shard.nbytes
                    fin.mine[rel] = rec
                    continue
                if opts.finish:
                    raise UsageError(f"shard {rel} is missing or damaged in the staging folder",
                                     hint="rerun the --partition i/n conversion that owns it (shard index mod n)")
                remove_tree(path)
                before = set(report.requant_stats)
                entries = [(t.name, t.dtype, t.shape) for t in shard.tensors]
                meta = target.shard_metadata(rctx)
                fut = stream_safetensors(path, entries,
                                         _encode_shard(shard, ckpt, layout, target, rctx, opts, report, on_progress, done, total),
                                         meta, fin.budget)
                fin.settle(PENDING_SHARDS - 1)  # earlier shards, whose hash and fsync overlapped this one's production
                fin.pending.append((rel, fut, {k: report.requant_stats[k] for k in set(report.requant_stats) - before}))
            fin.settle()
            if opts.partition is not None:
                continue
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": dict(sorted(wmap.items()))}
                (out_dir / "model.safetensors.index.json").write_bytes(_json_bytes(index))
            (out_dir / "config.json").write_bytes(_json_bytes(target.config(ckpt.config, rctx)))
            _copy_extras(ckpt.root, out_dir, drop_hqc=plan.layout != "modelopt-nvfp4" or rctx.options.get("keep_nvfp4") != "1")
            for p in sorted(out_dir.iterdir()):
                rel = f"{folder}/{p.name}" if folder else p.name
                if p.is_file() and rel not in outputs and not p.name.startswith(".mxfp4conv-progress"):
                    outputs[rel] = _sha256(p)
    except BaseException:
        fin.drain()  # never leave a writer running into a folder that is about to be removed
        raise
    for key, secs in fin.budget.seconds.items():
        report.seconds[key] = report.seconds.get(key, 0.0) + secs
    report.bytes_written = done[0]
    return dict(sorted(outputs.items()))


# Shards still finishing their hash and fsync while the next one is produced. Their hashers hold no
# queued memory (computed bytes are read back from the page cache once written), so they hash in
# parallel (one core each) while the producer runs at the disk's pace (BENCHMARKS.md).
PENDING_SHARDS = 2


class _ShardFinisher:
    """Shards whose last hashing and fsync run on helper threads while the next shard is produced:
    up to PENDING_SHARDS pending, their queued bytes under one budget. A shard is recorded as finished
    (in the progress file that --resume reads) only once its digest is known."""

    def __init__(self, progress_path: Path, fingerprint: dict[str, Any], report: ConvertReport,
                 outputs: dict[str, str]) -> None:
        self.progress_path = progress_path
        self.fingerprint = fingerprint
        self.report = report
        self.outputs = outputs
        self.mine: dict[str, dict[str, Any]] = {}
        self.budget = InflightBudget()
        self.pending: list[tuple[str, Future[str], dict[str, Any]]] = []

    def settle(self, keep: int = 0) -> None:
        """Wait for the oldest pending shards until at most ``keep`` remain."""
        while len(self.pending) > keep:
            rel, fut, stats = self.pending.pop(0)
            digest = fut.result()
            self.outputs[rel] = digest
            self.mine[rel] = {"sha256": digest, "stats": stats}
            tmp = self.progress_path.with_suffix(".tmp")
            tmp.write_bytes(_json_bytes({"fingerprint": self.fingerprint, "shards": self.mine}))
            os.replace(tmp, self.progress_path)

    def drain(self) -> None:
        for _, fut, _ in self.pending:
            with contextlib.suppress(BaseException):
                fut.result()
        self.pending.clear()
