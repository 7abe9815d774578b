"""``convert``: resolve -> detect -> validate -> plan -> (dry run) -> stream units -> verify -> publish.

No click, no rich, no print: progress goes through the ``on_progress(bytes_done, bytes_total)``
callback and the result is a ``ConvertReport``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import heapq
import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from mxfp4conv import __version__
from mxfp4conv.check import InlineVerifier, check_structure
from mxfp4conv.errors import OutputError, StagingError, UsageError
from mxfp4conv.inspect import SCHEMA_VERSION
from mxfp4conv.io.atomic import check_destination, publish, remove_tree, staging_path
from mxfp4conv.io.checkpoint import PICKLE_SUFFIXES, Checkpoint
from mxfp4conv.io.safetensors_io import (
    BATCH_BYTES,
    CheckRange,
    FileSlice,
    ShardStream,
    st_dtype,
)
from mxfp4conv.job import (  # re-exported: the options and helpers callers know from here
    GB,
    ConvertOptions,
    Job,
    cpu_kernel,
    devices,
    direct_slices,
    needs_device,
    prepare,
    resolve_device,
)
from mxfp4conv.layouts.base import Plan
from mxfp4conv.staging import (
    PROGRESS_GLOB,
    SHARD_WINDOW,
    ShardFinisher,
    json_bytes,
    prepare_staging,
    progress_file,
    reuse,
    sha256_file,
)
from mxfp4conv.units import UnitResult, read_ahead, read_sizes, unit_results
from mxfp4conv.writers import OutTensor, Target, WriterContext
from mxfp4conv.writers.base import UnitSpec

__all__ = ["GB", "MANIFEST", "ConvertOptions", "ConvertReport", "Job", "convert", "cpu_kernel", "devices",
           "direct_slices", "prepare", "read_ahead", "read_sizes", "resolve_device"]

MANIFEST = "mxfp4conv.json"
_SKIP_FILES = {"config.json", "model.safetensors.index.json", "hf_quant_config.json", MANIFEST}

Progress = Callable[[int, int], None]


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
    # units requantized by this run, per device (several GPUs share a conversion's units)
    requantized_on: dict[str, int] = field(default_factory=dict)

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


def source_fingerprint(ckpt: Checkpoint) -> dict[str, Any]:
    """Hashes identifying the source: full sha256 of JSON files, header sha256 + size of shards."""
    out: dict[str, Any] = {}
    for name in ("config.json", "hf_quant_config.json", "model.safetensors.index.json"):
        if (ckpt.root / name).exists():
            out[name] = {"sha256": sha256_file(ckpt.root / name)}
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


def interleave(sizes: list[list[int]]) -> list[tuple[int, int]]:
    """The production order of shards written at once, as (shard, unit) pairs: each shard's units in
    their order, and next always the shard with the smallest share of its bytes produced (ties: the
    lower index), so that the shards grow together and finish together. ``sizes``: each shard's
    units' output bytes."""
    totals = [max(1, sum(s)) for s in sizes]
    heap = [(0.0, i) for i, s in enumerate(sizes) if s]
    heapq.heapify(heap)
    made = [0] * len(sizes)
    nxt = [0] * len(sizes)
    order: list[tuple[int, int]] = []
    while heap:
        _, i = heapq.heappop(heap)
        k = nxt[i]
        order.append((i, k))
        made[i] += sizes[i][k]
        nxt[i] += 1
        if nxt[i] < len(sizes[i]):
            heapq.heappush(heap, (made[i] / totals[i], i))
    return order


def windows(n: int, most: int) -> list[range]:
    """``n`` shards in consecutive groups of at most ``most``, as even as possible (7 by 4: 4 + 3), so
    that the last group also has several shards whose sha256s run in parallel."""
    if n <= 0:
        return []
    count = -(-n // most)
    base, extra = divmod(n, count)
    out: list[range] = []
    start = 0
    for g in range(count):
        size = base + (1 if g < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass
class _OpenShard:
    """A shard of the window being produced: its plan, where it is written, its stream, the requant
    statistics of its units and how many of its units are fed."""

    plan: _ShardPlan
    rel: str
    path: Path
    stream: ShardStream
    stats: dict[str, Any] = field(default_factory=dict)
    fed: int = 0


def _unit_items(spec: UnitSpec, res: UnitResult, job: Job, ctx: WriterContext, verifier: InlineVerifier | None,
                path: Path) -> tuple[list[torch.Tensor | FileSlice | CheckRange], int]:
    """A unit's items for its shard's stream (its outputs, then, with ``verifier``, the check of their
    bytes, run once they are written) and its output bytes."""
    expect = job.target.out_specs(spec, ctx)
    items: list[torch.Tensor | FileSlice | CheckRange] = []
    nbytes = 0
    for o, t in zip(expect, res.outs, strict=True):
        if isinstance(t, FileSlice):
            nbytes += t.length
            items.append(t)
            continue
        if st_dtype(t.dtype) != o.dtype or tuple(t.shape) != o.shape:
            raise AssertionError(f"{o.name}: encoded {st_dtype(t.dtype)}{list(t.shape)}, planned {o.dtype}{list(o.shape)}")
        nbytes += t.numel() * t.element_size()
        items.append(t)
    if verifier is not None:
        if res.want is None:
            items.append(verifier.copied(expect, res.outs, path, nbytes))
        else:
            items.append(verifier.decoded(job.target.slice_for_rank(res.want, spec, ctx), spec, ctx, path))
    return items, nbytes


def _write_window(todo: list[tuple[_ShardPlan, str, Path]], job: Job, ctx: WriterContext, report: ConvertReport,
                  on_progress: Progress | None, done: list[int], total: int, verifier: InlineVerifier | None,
                  fin: ShardFinisher, last: list[tuple[ShardStream, int] | None]) -> None:
    """Produce a window of shards at once, their units interleaved (``interleave``); each shard is
    handed to ``fin`` (hash, checks and fsync finishing on its threads) once its last unit is queued.
    A unit's outputs may be views of one buffer (the GPU path's requant results), which lives until
    its last byte is written: so units are handed over whole, and a unit with computed outputs is
    produced only once the one before the previous is written (``last``: the previous one's stream
    and end, carried from window to window)."""
    target = job.target
    sizes = [[sum(t.nbytes for t in target.out_specs(u, ctx)) for u in plan.units] for plan, _, _ in todo]
    order = interleave(sizes)
    opened: list[_OpenShard] = []
    try:
        for plan, rel, path in todo:
            remove_tree(path)
            stream = ShardStream(path, [(t.name, t.dtype, t.shape) for t in plan.tensors], target.shard_metadata(ctx),
                                 fin.budget)
            opened.append(_OpenShard(plan, rel, path, stream))
        specs = [opened[i].plan.units[k] for i, k in order]
        for (i, _), spec, res in zip(order, specs, unit_results(specs, job, ctx, verifier is not None), strict=True):
            sh = opened[i]
            report.requant_stats.update(res.stats)
            sh.stats.update(res.stats)
            if res.device:
                report.requantized_on[res.device] = report.requantized_on.get(res.device, 0) + 1
            report.seconds["read"] = report.seconds.get("read", 0.0) + res.t_read
            report.seconds["transform"] = report.seconds.get("transform", 0.0) + res.t_transform
            items, nbytes = _unit_items(spec, res, job, ctx, verifier, sh.path)
            computed = any(not isinstance(t, FileSlice) for t in res.outs)
            del res
            for item in items:
                sh.stream.feed(item)
            del items
            end = sh.stream.flush()
            if computed:
                # at most two units' computed outputs alive (in host memory, or on the GPU until
                # written), however many files are written at once: the previous one is written
                # before the next is produced
                if last[0] is not None:
                    last[0][0].wait_written(last[0][1])
                last[0] = (sh.stream, end)
            sh.fed += 1
            if sh.fed == len(sh.plan.units):
                fin.pending.append((sh.rel, sh.stream.finish(), sh.stats))
            done[0] += nbytes
            if on_progress:
                on_progress(done[0], total)
        for sh in opened:
            if not sh.plan.units:  # a shard of no units (never planned today): header only
                fin.pending.append((sh.rel, sh.stream.finish(), sh.stats))
    except BaseException:
        finished = {rel for rel, _, _ in fin.pending}
        for sh in opened:
            if sh.rel not in finished:
                sh.stream.abort()
        raise


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


def convert(src: str | Path, dst: str | Path, opts: ConvertOptions, on_progress: Progress | None = None) -> ConvertReport:
    """Convert SRC into DST (see module docstring). Raises ``ConvertError`` subclasses."""
    t_start = time.perf_counter()
    # a GPU named outright starts (torch's import, CUDA) beside the planning; ``auto`` only once
    # the plan shows a requant, so renames never import torch
    early = not opts.dry_run and (opts.device.startswith("cuda") or any(d.startswith("cuda") for d in opts.devices))
    if early:
        _start_device(opts)
    job = prepare(src, opts)
    if needs_device(job.ctx) and not early:
        _start_device(opts)
    shard_plans = [(folder, rctx, plan_shards(job.target, rctx, job.plan, opts.max_shard_size, folder))
                   for _, folder, rctx in job.rank_contexts()]
    return _convert(src, Path(dst), job, shard_plans, t_start, on_progress)


def _convert(src: str | Path, dst: Path, job: Job, shard_plans: list[tuple[str, WriterContext, list[_ShardPlan]]],
             t_start: float, on_progress: Progress | None) -> ConvertReport:
    """``convert`` once SRC is planned: options resolved, then skip / dry run / write, prove, publish."""
    opts, ctx, plan, target = job.opts, job.ctx, job.plan, job.target
    opts = dataclasses.replace(opts, device=resolve_device(opts.device, needs_device(ctx)))
    job = job.with_options(opts)
    report = ConvertReport(str(src), str(dst), plan.layout, target.NAME, "dry-run" if opts.dry_run else "converted")
    if needs_device(ctx):
        report.compute = {"devices": devices(opts), "cpu_kernel": cpu_kernel(opts.device, not opts.dry_run)}
    fingerprint: dict[str, Any] = {"tool": __version__, "source": source_fingerprint(job.ckpt),
                                   "options": opts.fingerprint_dict()}
    if needs_device(ctx):
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
    check_destination(job.ckpt.root, dst, overwrite=opts.overwrite or opts.skip_if_current)
    _fill_plan_report(report, plan, target, ctx, shard_plans)
    if opts.dry_run:
        report.seconds["total"] = time.perf_counter() - t_start
        return report

    staging = staging_path(dst)
    finished = prepare_staging(staging, fingerprint, opts)
    keep_staging = opts.resume or opts.partition is not None or opts.finish
    verifier = InlineVerifier(target, str(src), str(dst)) if opts.verify else None
    try:
        outputs, reused = _write_all(job, shard_plans, staging, report, on_progress, (finished, fingerprint), verifier)
        if opts.partition is not None:
            report.status = "partial"
            report.seconds["total"] = time.perf_counter() - t_start
            return report
        for p in staging.glob(PROGRESS_GLOB):
            p.unlink()
        if verifier is not None:
            t0 = time.perf_counter()
            if reused:  # shards of an earlier run (--resume, --finish): proven again, in full
                from mxfp4conv.verify import verify_output

                report.verify = verify_output(job.ckpt.root, staging, job=job).to_dict()
            else:
                check_structure(verifier, job, staging)
                report.verify = verifier.report()
            report.seconds["verify"] = report.seconds.get("verify", 0.0) + time.perf_counter() - t0
        manifest = {"schema_version": SCHEMA_VERSION, "tool": "mxfp4conv", "version": __version__,
                    "source": {"name": Path(str(src)).name, "repo_id": job.ckpt.repo_id, "revision": job.ckpt.revision,
                               "layout": plan.layout, "files": fingerprint["source"]},
                    "target": target.NAME, "options": opts.fingerprint_dict() | {"device_independent": True},
                    "fingerprint": fingerprint, "outputs": outputs, "requant_stats": report.requant_stats,
                    "verified": bool(report.verify and report.verify.get("ok"))}
        (staging / MANIFEST).write_bytes(json_bytes(manifest))
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


def _start_device(opts: ConvertOptions) -> threading.Thread | None:
    """For a GPU conversion, import torch and start CUDA on a helper thread while SRC is planned and
    its first units are read (a fresh process spends seconds there); None when no GPU is asked for."""
    wanted = opts.device in ("cuda", "auto") or opts.device.startswith("cuda:") or any(d.startswith("cuda") for d in opts.devices)
    if not wanted or opts.dry_run:
        return None

    def start() -> None:
        from mxfp4conv.io.cuda_driver import start_driver

        start_driver(_ordinals(opts))  # CUDA's start needs no torch: beside its import, not after it
        with contextlib.suppress(Exception):
            import torch

            if torch.cuda.is_available():
                from mxfp4conv.io.pinned import use_fast_pinning

                use_fast_pinning()  # before the first pinned allocation
                torch.cuda.init()
                from mxfp4conv.kernels.requant_triton import _jit

                _jit()  # triton and the kernel module, imported before the first unit needs them

    t = threading.Thread(target=start, name="mxfp4conv-device-start", daemon=True)
    t.start()
    return t


def _ordinals(opts: ConvertOptions) -> list[int] | None:
    """The CUDA devices a conversion will use, by ordinal; None for every visible one."""
    names = list(opts.devices) or [opts.device]
    if any(not n.startswith("cuda:") for n in names):
        return None
    return [int(n[5:]) for n in names if n[5:].isdigit()]


def _fill_plan_report(report: ConvertReport, plan: Plan, target: Target, ctx: WriterContext,
                      shard_plans: list[tuple[str, WriterContext, list[_ShardPlan]]]) -> None:
    kinds = [u.kind for u in plan.units]
    report.fused_layers = kinds.count("moe")
    report.passthrough = kinds.count("passthrough")
    report.requantized = 0 if plan.facts.source_quant == "mxfp4" or ctx.target_options.keep_nvfp4 else (
        kinds.count("moe") + kinds.count("dense"))
    report.renamed = sum(len(target.out_specs(u, ctx)) for u in plan.units if u.kind != "passthrough")
    for folder, _, shards in shard_plans:
        for s in shards:
            report.shards.append({"file": f"{folder}/{s.file}" if folder else s.file, "bytes": s.nbytes,
                                  "tensors": len(s.tensors), "units": len(s.units)})


def _write_all(job: Job, shard_plans: list[tuple[str, WriterContext, list[_ShardPlan]]], staging: Path,
               report: ConvertReport, on_progress: Progress | None,
               resume: tuple[dict[str, dict[str, Any]], dict[str, Any]],
               verifier: InlineVerifier | None) -> tuple[dict[str, str], bool]:
    """Write every shard (or this partition's) into ``staging``: (sha256 per output file, whether a
    finished shard of an earlier run was reused)."""
    finished, fingerprint = resume
    opts, ckpt, target = job.opts, job.ckpt, job.target
    outputs: dict[str, str] = {}
    fin = ShardFinisher(progress_file(staging, opts), fingerprint, report, outputs)
    total = sum(s.nbytes for _, _, shards in shard_plans for s in shards)
    if job.needs_device and devices(opts)[0].startswith("cuda"):
        # GPU outputs are produced far faster than the disk takes them: a unit's worth queued keeps
        # the writer busy; outputs written from the GPU (io/device_write) hold none of this budget
        fin.budget.limit = max(BATCH_BYTES, max((sum(t.nbytes for t in target.out_specs(u, rctx)) for _, rctx, shards
                                                 in shard_plans for sh in shards for u in sh.units), default=0))
    done = [0]
    reused = False
    last: list[tuple[ShardStream, int] | None] = [None]
    try:
        j = -1
        for folder, rctx, shards in shard_plans:
            out_dir = staging / folder if folder else staging
            out_dir.mkdir(exist_ok=True)
            wmap: dict[str, str] = {}
            todo: list[tuple[_ShardPlan, str, Path]] = []  # shards this run writes, in order
            for shard in shards:
                j += 1
                rel = f"{folder}/{shard.file}" if folder else shard.file
                wmap.update(dict.fromkeys((t.name for t in shard.tensors), shard.file))
                if opts.partition is not None and j % opts.partition[1] != opts.partition[0]:
                    continue
                path = out_dir / shard.file
                rec = finished.get(rel)
                if reuse(path, rec):
                    assert rec is not None
                    outputs[rel] = rec["sha256"]
                    report.requant_stats.update(rec.get("stats", {}))
                    done[0] += shard.nbytes
                    fin.mine[rel] = rec
                    reused = True
                    continue
                if opts.finish:
                    raise StagingError(f"shard {rel} is missing or damaged in the staging folder",
                                     hint="rerun the --partition i/n conversion that owns it (shard index mod n)")
                todo.append((shard, rel, path))
            for group in windows(len(todo), SHARD_WINDOW):
                _write_window([todo[g] for g in group], job, rctx, report, on_progress, done, total, verifier, fin, last)
                fin.settle(len(group))  # the previous window's shards, whose hash and fsync overlapped this one
            fin.settle()
            if opts.partition is not None:
                continue
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": dict(sorted(wmap.items()))}
                (out_dir / "model.safetensors.index.json").write_bytes(json_bytes(index))
            (out_dir / "config.json").write_bytes(json_bytes(target.config(ckpt.config, rctx)))
            _copy_extras(ckpt.root, out_dir, drop_hqc=job.plan.layout != "modelopt-nvfp4" or not rctx.target_options.keep_nvfp4)
            for p in sorted(out_dir.iterdir()):
                rel = f"{folder}/{p.name}" if folder else p.name
                if p.is_file() and rel not in outputs and not p.name.startswith(".mxfp4conv-progress"):
                    outputs[rel] = sha256_file(p)
    except BaseException:
        fin.drain()  # never leave a writer running into a folder that is about to be removed
        raise
    for key, secs in fin.budget.seconds.items():
        report.seconds[key] = report.seconds.get(key, 0.0) + secs
    report.bytes_written = done[0]
    return dict(sorted(outputs.items())), reused
