"""``verify``: re-read DST and prove it against SRC (the standalone command; ``convert`` runs the
same comparisons unit by unit while it writes: ``mxfp4conv/proof/check.py``).

Every output unit is decoded back to the canonical model with the target's ``decode`` and
compared byte for byte with what SRC yields: for MXFP4 sources the source codes and scales
themselves; for NVFP4 sources the chosen scale rule recomputed from SRC (so DST must hold exactly
those bytes). Passthrough tensors must be byte-identical. The tensor set, dtypes and shapes must
match the plan exactly (nothing missing, nothing extra).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from mxfp4conv.errors import InputError, VerificationFailed
from mxfp4conv.files.safetensors import FileSlice, TensorRef, read_full
from mxfp4conv.model.canonical import Canonical, DenseFP4, MoELayer, Passthrough
from mxfp4conv.numerics.canonicalize import to_mxfp4
from mxfp4conv.plan.job import (
    ConvertOptions,
    Job,
    cpu_kernel,
    needs_device,
    prepare,
    resolve_device,
)
from mxfp4conv.plan.shards import direct_runs
from mxfp4conv.proof.manifest import MANIFEST
from mxfp4conv.sources.checkpoint import Checkpoint, open_checkpoint
from mxfp4conv.targets.base import TargetOptions

if TYPE_CHECKING:
    from collections.abc import Callable

    from mxfp4conv.plan.shards import RankPlan
    from mxfp4conv.targets import Target, WriterContext
    from mxfp4conv.targets.base import UnitSpec

__all__ = ["VerifyReport", "compare_units", "first_difference", "first_parts_difference", "first_range_difference", "open_output", "planned_mismatches",
           "prove_unit", "verify_output"]

MAX_SHOWN = 5


@dataclass
class VerifyReport:
    source: str
    destination: str
    target: str
    units: int = 0
    tensors: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 3

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        d["schema_version"] = 1
        return d


def _diff(name: str, want: torch.Tensor | None, got: torch.Tensor | None) -> dict[str, Any] | None:
    import torch

    if want is None and got is None:
        return None
    if want is None or got is None:
        return {"tensor": name, "message": "present in one side only"}
    if want.dtype != got.dtype or tuple(want.shape) != tuple(got.shape):
        return {"tensor": name, "message": f"expected {want.dtype}{list(want.shape)}, found {got.dtype}{list(got.shape)}"}
    if got.device != want.device:
        got = got.to(want.device)
    a = want.contiguous().reshape(-1).view(torch.uint8)
    b = got.contiguous().reshape(-1).view(torch.uint8)
    if torch.equal(*_words(a, b)):
        return None
    bad = (a != b).nonzero()
    return {"tensor": name, "message": f"{bad.numel()} of {a.numel()} bytes differ, first at byte {int(bad[0])}",
            "differing_bytes": int(bad.numel())}


def _words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two flat byte tensors of one length, viewed as the widest integer type that both their length
    and their offsets allow (the same bytes are equal exactly when the words are): torch.equal walks
    uint8 a byte at a time, ~1 GB/s on one core, and int64 ~7x faster."""
    import torch

    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if a.numel() % width == 0 and a.storage_offset() % width == 0 and b.storage_offset() % width == 0:
            return a.view(dtype), b.view(dtype)
    return a, b


def compare_units(want: Canonical, got: Canonical) -> list[dict[str, Any]]:
    """Byte-level differences between two canonical units (empty when identical)."""
    pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = []
    if isinstance(want, MoELayer) and isinstance(got, MoELayer):
        k = want.prefix
        for label, a, b in (("w13", want.w13, got.w13), ("w2", want.w2, got.w2)):
            pairs += [(f"{k}.{label} codes", a.packed, b.packed), (f"{k}.{label} scales", a.scales, b.scales)]
            if a.global_rows is not None or b.global_rows is not None:
                pairs.append((f"{k}.{label} global scale", a.global_rows, b.global_rows))
        pairs += [(f"{k}.w13 bias", want.w13_bias, got.w13_bias), (f"{k}.w2 bias", want.w2_bias, got.w2_bias)]
    elif isinstance(want, DenseFP4) and isinstance(got, DenseFP4):
        k = want.module
        pairs += [(f"{k} codes", want.weight.packed, got.weight.packed), (f"{k} scales", want.weight.scales, got.weight.scales),
                  (f"{k} bias", want.bias, got.bias)]
        if want.weight.global_rows is not None or got.weight.global_rows is not None:
            pairs.append((f"{k} global scale", want.weight.global_rows, got.weight.global_rows))
    elif isinstance(want, Passthrough) and isinstance(got, Passthrough):
        pairs.append((want.name, want.tensor, got.tensor))
    else:
        return [{"tensor": getattr(want, "prefix", getattr(want, "name", "?")), "message": "unit kinds differ"}]
    return [d for n, a, b in pairs if (d := _diff(n, a, b))]


def first_difference(a: FileSlice, b: TensorRef, chunk: int = 2 << 20) -> int | None:
    """Offset of the first byte where a source range and an output tensor differ (None if equal)."""
    if a.length != b.nbytes:
        return 0
    fb = os.open(b.file, os.O_RDONLY)
    try:
        return first_range_difference(a, fb, b.begin, chunk)
    finally:
        os.close(fb)


def first_parts_difference(parts: tuple[FileSlice, ...], b: TensorRef) -> int | None:
    """Offset of the first byte where source ranges, one after the other, and an output tensor differ."""
    if len(parts) == 1:
        return first_difference(parts[0], b)
    if sum(p.length for p in parts) != b.nbytes:
        return 0
    fb = os.open(b.file, os.O_RDONLY)
    try:
        off = 0
        for p in parts:
            at = first_range_difference(p, fb, b.begin + off)
            if at is not None:
                return off + at
            off += p.length
        return None
    finally:
        os.close(fb)


def first_range_difference(src: FileSlice, fd: int, pos: int, chunk: int = 2 << 20) -> int | None:
    """Offset of the first byte where the source range ``src`` (read through its byte source) and the
    open file ``fd`` from ``pos`` differ (None if equal; a short file differs where it ends). Two
    buffers of ``chunk`` bytes, reused: a conversion runs one such check per open shard at once."""
    length = src.length
    x, y = bytearray(min(chunk, length)), bytearray(min(chunk, length))
    off = 0
    while off < length:
        n = min(chunk, length - off)
        if n < len(x):  # the last piece
            x, y = bytearray(n), bytearray(n)
        gx = src.source.read_into(src.file, src.begin + off, [memoryview(x)])
        gy = read_full(fd, memoryview(y), pos + off)
        if gx != n or gy != n or x != y:  # bytearray == bytearray is one memcmp
            m = min(gx, gy)
            return off + next((i for i in range(m) if x[i] != y[i]), m)
        off += n
    return None


def prove_unit(target: Target, want: Canonical, spec: UnitSpec, rctx: WriterContext,
               get: Callable[[str], torch.Tensor]) -> list[dict[str, Any]]:
    """How the written unit (its tensors by name through ``get``) differs from ``want``, what SRC yields:
    the target's own proof where its bytes do not decode uniquely, else its ``decode`` compared byte for
    byte. The one proof of a decoded unit, for ``convert``'s inline check and for ``verify``."""
    found = target.verify_unit(want, spec, rctx, get)
    return found if found is not None else compare_units(want, target.decode(spec, rctx, get))


def open_output(folder: Path, target: Target) -> Checkpoint:
    """A rank's output folder, read as the target wrote it (safetensors shards, or GGUF files)."""
    if target.HF_FOLDER:
        return open_checkpoint(folder)
    from mxfp4conv.sources.gguf import open_gguf

    return open_gguf(folder)


def planned_mismatches(out: Checkpoint, rank: RankPlan, target: Target) -> list[dict[str, Any]]:
    """How an output folder differs from the rank's plan: unexpected, missing, other dtype or shape of a
    tensor, and any module its config.json would make the runtime build otherwise than the source meant it
    (a GGUF's metadata: anything but what the target writes)."""
    from mxfp4conv.targets.resolve import config_proof

    if target.HF_FOLDER:
        found: list[dict[str, Any]] = list(config_proof(out.config, rank.ctx))
    else:
        want = target.config(dict(rank.ctx.src_config), rank.ctx)
        found = [{"tensor": k, "message": f"metadata {k} is {out.config.get(k)!r}, expected {v!r}"}
                 for k, v in want.items() if out.config.get(k) != v][:MAX_SHOWN]
    planned = {t.name: t for s in rank.shards for t in s.tensors}
    for name in sorted(set(out.tensors) - set(planned))[:MAX_SHOWN]:
        found.append({"tensor": name, "message": "unexpected tensor in output"})
    for name, t in planned.items():
        ref = out.tensors.get(name)
        if ref is None:
            found.append({"tensor": name, "message": "missing from output"})
        elif ref.dtype != t.dtype or ref.shape != t.shape:
            found.append({"tensor": name, "message": f"output is {ref.dtype}{list(ref.shape)}, "
                                                     f"expected {t.dtype}{list(t.shape)}"})
    return found


def _manifest(dst: Path) -> dict[str, Any]:
    path = dst / MANIFEST
    if not path.exists():
        raise InputError(f"no {MANIFEST} manifest: DST was not written by mxfp4conv convert", file=str(path),
                         hint="run mxfp4conv convert first, or pass the folder it wrote")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise InputError(f"manifest is not valid JSON ({exc})", file=str(path)) from exc
    return data if isinstance(data, dict) else {}


def verify_output(src: str | Path, dst: str | Path, *, manifest_opts: ConvertOptions | None = None,
                  job: Job | None = None, raise_on_failure: bool = True, device: str = "cpu") -> VerifyReport:
    """Compare DST with SRC; raises ``VerificationFailed`` (exit 3) on any difference. ``job``: SRC
    already planned (its options are used); else ``manifest_opts``, else the options DST's manifest records."""
    dst = Path(dst)
    if job is None:
        if manifest_opts is None:
            m = _manifest(dst)
            o = m.get("options", {})
            manifest_opts = ConvertOptions(target=m.get("target", "auto"), scale_rule=o.get("scale_rule", "mse"),
                                           target_options=TargetOptions.parse(dict(o.get("extra", {}))), device=device)
        job = prepare(src, manifest_opts)
    ckpt, layout, target, ctx = job.ckpt, job.layout, job.target, job.ctx
    opts = dataclasses.replace(job.opts, device=resolve_device(job.opts.device, needs_device(ctx)))
    cpu_kernel(opts.device, needs_device(ctx))  # a bad MXFP4CONV_CPU_KERNEL fails here, in one line
    report = VerifyReport(str(src), str(dst), target.NAME)
    for rank in job.output.ranks:
        out = open_output(dst / rank.folder if rank.folder else dst, target)
        report.mismatches += planned_mismatches(out, rank, target)
        if report.mismatches:
            break
        rctx = rank.ctx
        for unit in (u for shard in rank.shards for u in shard.units):
            report.units += 1
            report.tensors += len(unit.outs)
            if unit.direct is not None:  # a rename: compare raw byte ranges, no decoding
                for o, parts in direct_runs(unit.outs, unit.direct):
                    at = first_parts_difference(parts, out.tensors[o.name])
                    if at is not None:
                        report.mismatches.append({"tensor": o.name, "message": f"bytes differ from the source, "
                                                  f"first at byte {at}"})
                continue
            onto = None
            if needs_device(ctx):
                from mxfp4conv.numerics.units import read_onto

                onto = read_onto(unit, opts.device)  # NVFP4 stacks read onto the GPU that requantizes them
            want = layout.read(ckpt, unit.spec, device=onto)
            if not ctx.target_options.keep_nvfp4:
                want, _ = to_mxfp4(want, rule=opts.scale_rule, device=opts.device)
            want = target.slice_for_rank(want, unit.spec, rctx)

            def getter(n: str, out: Any = out) -> torch.Tensor:
                return out.tensors[n].load()

            report.mismatches.extend(prove_unit(target, want, unit.spec, rctx, getter))
            if len(report.mismatches) >= MAX_SHOWN:
                break
    if not report.ok and raise_on_failure:
        first = report.mismatches[0]
        raise VerificationFailed(f"output differs from source: {first['message']} ({len(report.mismatches)} "
                                 "mismatching tensors shown in --json)", file=str(dst), tensor=first["tensor"],
                                 hint="nothing was published; report this with the --json output")
    return report
