"""The post-write proof of ``convert``, run unit by unit while the conversion goes on.

Each unit's output bytes are checked on the shard writer's check thread once they are in the file
(``files/safetensors.CheckRange``): the unit's byte range is read back from the staged shard (the page
cache) and compared with what SRC yields, through a path that shares nothing with the encoder's
output buffers:

* a lossless unit (output tensors that are byte ranges of SRC): every written byte is compared with
  its source range, read from SRC again;
* a decoded unit: the written tensors are decoded with the target's ``decode`` (its own inverse of
  ``encode``) and compared byte for byte with the canonical unit SRC yields. In a run on a GPU that
  is a second, device-resident requantization of the source bytes the reader holds (the written
  bytes are compared on the GPU). In a run on the CPU it is the requantization's own result;
  otherwise the canonical unit as read from SRC.

A MoE unit of a split or fused-expert target is decoded and compared a group of experts at a time
(``GROUP_BYTES``), so the check holds a few tens of MB beyond the unit itself. The first unit that
differs raises ``VerificationFailed`` (exit 3) from its shard; nothing is then published. Headers
(the tensor set, dtypes and shapes) are checked once every shard is written (``check_structure``).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mxfp4conv.plan.job import Job

from mxfp4conv.device.pinned import StagePool
from mxfp4conv.errors import VerificationFailed
from mxfp4conv.files.safetensors import CheckRange, FileSlice, torch_dtype
from mxfp4conv.model.canonical import Canonical, FP4Weight, MoELayer
from mxfp4conv.plan.shards import PlannedUnit, direct_runs
from mxfp4conv.proof.verify import (
    MAX_SHOWN,
    first_range_difference,
    open_output,
    planned_mismatches,
    prove_unit,
)
from mxfp4conv.targets.base import OutTensor, Target, UnitSpec, WriterContext

__all__ = ["GROUP_BYTES", "InlineVerifier"]

GROUP_BYTES = 48 << 20  # bytes of output decoded and compared at once for a MoE unit


class InlineVerifier:
    """Builds the per-unit checks of one conversion and gathers their counts and mismatches."""

    def __init__(self, target: Target, source: str, destination: str) -> None:
        self.target = target
        self.source, self.destination = source, destination
        self.units = 0
        self.tensors = 0
        self.mismatches: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def report(self) -> dict[str, Any]:
        return {"source": self.source, "destination": self.destination, "target": self.target.NAME,
                "units": self.units, "tensors": self.tensors, "mismatches": list(self.mismatches),
                "ok": not self.mismatches, "schema_version": 1, "mode": "inline"}

    def _done(self, n_tensors: int, found: list[dict[str, Any]], shard: Path, units: int = 1) -> None:
        with self._lock:
            self.units += units
            self.tensors += n_tensors
            if not found:
                return
            self.mismatches.extend(found[:MAX_SHOWN - len(self.mismatches)] if len(self.mismatches) < MAX_SHOWN else [])
        first = found[0]
        raise VerificationFailed(f"output differs from source: {first['message']} ({len(found)} mismatching tensors "
                                 "shown in --json)", file=str(shard), tensor=first["tensor"],
                                 hint="nothing was published; report this with the --json output")

    def copied(self, outs: list[OutTensor], slices: list[FileSlice], shard: Path, nbytes: int) -> CheckRange:
        """The check of a lossless unit: every written byte against its source range."""

        pad = self.target.CONTAINER.pad

        def run(fd: int, begin: int, end: int) -> None:
            found = []
            pos = begin
            for o, parts in direct_runs(outs, slices):
                start = pos
                for s in parts:
                    at = first_range_difference(s, fd, pos)
                    pos += s.length
                    if at is not None:
                        found.append({"tensor": o.name, "message": "bytes differ from the source, first at byte "
                                                                   f"{pos - s.length - start + at}"})
                        break
                pos = start + o.nbytes + pad(o.nbytes)
            if pos != end:
                found.append({"tensor": outs[0].name if outs else "?", "message": "unit bytes misplaced in the shard"})
            self._done(len(outs), found, shard)

        return CheckRange(run, hold=0)

    def decoded(self, want: Canonical, unit: PlannedUnit, rctx: WriterContext, shard: Path, units: int = 1) -> CheckRange:
        """The check of a decoded unit against ``want`` (the canonical unit SRC yields); ``units``: the
        planned units it completes (0 for an expert group but the last: ``plan.expert_groups``)."""
        spec, outs = unit.spec, unit.outs
        hold = _canonical_host_bytes(want)

        def run(fd: int, begin: int, end: int) -> None:
            where: dict[str, tuple[int, OutTensor]] = {}
            pos = begin
            for o in outs:
                where[o.name] = (pos, o)
                pos += o.nbytes + self.target.CONTAINER.pad(o.nbytes)
            if pos != end:
                self._done(len(outs), [{"tensor": spec.key, "message": "unit bytes misplaced in the shard"}], shard, units)
            found: list[dict[str, Any]] = []
            target = self.target
            dev = _device_of(want)
            if dev is not None:  # the whole unit to the device through a small pinned buffer; compared there
                buf = _to_device(fd, begin, end, dev)
                get = _device_getter(buf, begin, where)
                found = prove_unit(target, want, spec, rctx, get)
                del buf
                self._done(len(outs), found, shard, units)
                return
            for e0, e1 in _groups(spec, target, unit.nbytes):
                if e1 - e0 == (spec.dims[0] if spec.kind == "moe" else 1) and e0 == 0:
                    sub, part, get = spec, want, _getter(fd, where, spec, 0, 0)
                else:
                    sub = dataclasses.replace(spec, dims=(e1 - e0, *spec.dims[1:]))
                    part, get = _experts(want, e0, e1), _getter(fd, where, spec, e0, e1)
                found += prove_unit(target, part, sub, rctx, get)
                if found:
                    break
            self._done(len(outs), found, shard, units)

        return CheckRange(run, hold=hold)


def check_structure(verifier: InlineVerifier, job: Job, staging: Path) -> None:
    """The written headers hold exactly the planned tensors, dtypes and shapes (every rank folder)."""
    found: list[dict[str, Any]] = []
    for rank in job.output.ranks:
        out = open_output(staging / rank.folder if rank.folder else staging, job.target)
        found += planned_mismatches(out, rank, job.target)
    if found:
        verifier.mismatches.extend(found[:MAX_SHOWN])
        first = found[0]
        raise VerificationFailed(f"output differs from source: {first['message']}", file=str(staging),
                                 tensor=first["tensor"], hint="nothing was published; report this with the --json output")


def _canonical_host_bytes(unit: Canonical) -> int:
    """Host bytes a canonical unit holds (device tensors count 0)."""
    total = 0
    for v in vars(unit).values():
        for t in (vars(v).values() if isinstance(v, FP4Weight) else (v,)):
            if hasattr(t, "device") and getattr(t.device, "type", "cpu") == "cpu":
                total += t.numel() * t.element_size()
    return total


def _groups(spec: UnitSpec, target: Target, nbytes: int) -> list[tuple[int, int]]:
    """Expert ranges decoded at once: groups of about GROUP_BYTES for a MoE unit of a target whose
    decode can be narrowed, else the whole unit."""
    if spec.kind != "moe" or not target.DECODES_EXPERT_GROUPS or not spec.dims:
        return [(0, spec.dims[0] if spec.kind == "moe" and spec.dims else 1)]
    experts = spec.dims[0]
    per = max(1, nbytes // max(experts, 1))
    step = max(1, GROUP_BYTES // per)
    return [(e, min(experts, e + step)) for e in range(0, experts, step)]


def _experts(want: Canonical, e0: int, e1: int) -> Canonical:
    assert isinstance(want, MoELayer)

    def w(x: FP4Weight) -> FP4Weight:
        return dataclasses.replace(x, packed=x.packed[e0:e1], scales=x.scales[e0:e1],
                                   global_rows=None if x.global_rows is None else x.global_rows[e0:e1])

    return MoELayer(want.prefix, w(want.w13), w(want.w2),
                    None if want.w13_bias is None else want.w13_bias[e0:e1],
                    None if want.w2_bias is None else want.w2_bias[e0:e1])


def _getter(fd: int, where: dict[str, tuple[int, OutTensor]], spec: UnitSpec, e0: int,
            e1: int) -> Callable[[str], torch.Tensor]:
    """Written tensors by name, read from the shard. With ``e1 > 0``: for experts ``e0:e1`` of the
    unit, asked for as experts ``0:e1-e0`` (per-expert names shifted, fused ``[E, ...]`` tensors sliced)."""
    per_expert = re.compile(re.escape(spec.key) + r"\.(\d+)\.(.+)") if e1 else None
    experts = spec.dims[0] if spec.dims else 0

    def get(name: str) -> torch.Tensor:
        if per_expert is not None and (m := per_expert.fullmatch(name)):
            name = f"{spec.key}.{int(m[1]) + e0}.{m[2]}"
        if name not in where:
            raise KeyError(name)
        pos, o = where[name]
        shape = o.shape
        if e1 and (per_expert is None or not per_expert.fullmatch(name)) and shape and shape[0] == experts:
            row = o.nbytes // experts
            pos, shape = pos + e0 * row, (e1 - e0, *shape[1:])
        return _read(fd, pos, o.dtype, shape)

    return get


# The pinned buffer a unit's bytes pass through on their way to the device: page-locked memory counts
# in the peak RSS (BENCHMARKS.md, "Peak RSS with the proof"). Shared by every shard's check thread (the
# shards of a window and the previous window's check at once): at most STAGES such buffers, taken in
# turn, whatever the number of threads.
STAGE_BYTES = 8 << 20
STAGES = 2
_STAGES = StagePool(STAGE_BYTES, limit=STAGES)


def _device_of(unit: Canonical) -> torch.device | None:
    """The CUDA device a canonical unit's FP4 weights live on (None: on the host)."""
    for v in vars(unit).values():
        if isinstance(v, FP4Weight) and v.packed.device.type == "cuda":
            return v.packed.device
    return None


def _to_device(fd: int, begin: int, end: int, dev: torch.device) -> torch.Tensor:
    """The shard's bytes ``[begin, end)`` as a uint8 tensor on ``dev``, read through a reused pinned buffer."""
    import torch

    from mxfp4conv.files.safetensors import read_full, tensor_view

    out = torch.empty(end - begin, dtype=torch.uint8, device=dev)
    with _STAGES.take() as (stage,):
        view = tensor_view(stage)
        pos = begin
        while pos < end:
            n = min(STAGE_BYTES, end - pos)
            if read_full(fd, view[:n], pos) < n:
                raise OSError(5, "the staged shard is shorter than its header says")
            out[pos - begin:pos - begin + n].copy_(stage[:n])  # synchronous: the buffer is reused next
            pos += n
    return out


def _device_getter(buf: torch.Tensor, begin: int, where: dict[str, tuple[int, OutTensor]]) -> Callable[[str], torch.Tensor]:
    import math

    from mxfp4conv.files.safetensors import ITEMSIZE

    def get(name: str) -> torch.Tensor:
        pos, o = where[name]
        a = pos - begin
        t = buf[a:a + math.prod(o.shape) * ITEMSIZE[o.dtype]]
        if a % ITEMSIZE[o.dtype]:
            t = t.clone()  # a wider dtype needs an aligned start
        return t.view(torch_dtype(o.dtype)).reshape(o.shape)

    return get


# Tensors at least this large are read in place: a private mapping of the staged shard's pages (the
# page cache the writer just filled), not a copy into fresh memory, which was a third of the proof's time
MAP_BYTES = 1 << 20


def _read(fd: int, pos: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    import math
    import mmap
    import os

    import torch

    from mxfp4conv.files.safetensors import ITEMSIZE, read_full, tensor_view

    n = math.prod(shape) * ITEMSIZE[dtype]
    if n >= MAP_BYTES and pos % ITEMSIZE[dtype] == 0:
        if os.fstat(fd).st_size < pos + n:  # a mapping past the end would fault (SIGBUS), not read short
            raise OSError(5, "the staged shard is shorter than its header says")
        start = pos - pos % mmap.ALLOCATIONGRANULARITY
        # private and writable: torch takes it without a read-only warning; nothing writes, so no page is copied
        mm = mmap.mmap(fd, pos + n - start, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                       offset=start)
        return torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=pos - start).view(
            torch_dtype(dtype)).reshape(shape)
    raw = torch.empty(n, dtype=torch.uint8)
    if n and read_full(fd, tensor_view(raw), pos) < n:
        raise OSError(5, "the staged shard is shorter than its header says")
    return raw.view(torch_dtype(dtype)).reshape(shape)
