"""Units in plan order: read from SRC, requantized where needed, encoded for the target.

One device: units ahead are read on a helper thread while the current one is transformed
(``read_ahead``: at most about two of the largest units in memory). Several devices: one unit per
device in flight, each read and transformed on its device's thread. Each result also carries what
the post-write check compares the unit's written bytes with (``UnitResult.want``, see ``proof/check.py``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mxfp4conv.numerics.requant_stats import RequantStats

from mxfp4conv.errors import InputError
from mxfp4conv.model.canonical import Canonical, FP4Weight
from mxfp4conv.numerics.canonicalize import to_mxfp4
from mxfp4conv.plan.job import Job, devices, needs_device
from mxfp4conv.plan.shards import PlannedUnit
from mxfp4conv.sources.checkpoint import Checkpoint
from mxfp4conv.targets import WriterContext
from mxfp4conv.targets.base import UnitSpec

__all__ = ["UnitResult", "read_ahead", "read_onto", "requant_on_device", "unit_results"]


@dataclass
class UnitResult:
    outs: list[Any]  # encoded tensors, or the FileSlices of a pure rename
    stats: dict[str, Any]
    t_read: float
    t_transform: float
    # the canonical unit SRC yields, for the post-write check (None for a rename, or without checking)
    want: Canonical | None = None
    device: str = ""  # where the unit was requantized ("" when it was not)
    # ``stats`` as computed; a later expert group's keep their rows, to continue the earlier groups' fold
    requant: dict[str, RequantStats] = field(default_factory=dict)


def _read(unit: PlannedUnit, job: Job, ctx: WriterContext, device: str = "cpu") -> tuple[Any, float]:
    """A unit's source: the byte ranges of a pure rename (never decoded), or its canonical form
    (NVFP4 stacks bound for a GPU requant are read onto the device, when they fit there)."""
    t0 = time.perf_counter()
    if unit.direct is not None:
        return list(unit.direct), 0.0
    onto = read_onto(unit, device) if needs_device(ctx) else None
    return job.layout.read(job.ckpt, unit.spec, device=onto), time.perf_counter() - t0


def read_onto(unit: PlannedUnit, device: str) -> str | None:
    """The CUDA device a unit bound for a GPU requant is read onto: ``device`` once CUDA has started
    there and the unit fits (``requant.fits_on_device``), else None (host memory: the requant moves
    it, the same bytes). Before CUDA has started (on a helper thread meanwhile) the first units are
    read into host memory, so that their reads overlap the start."""
    if not device.startswith("cuda"):
        return None
    import torch

    from mxfp4conv.numerics.requant import fits_on_device

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return device if fits_on_device(unit.read_bytes, device) else None


def _transform(planned: PlannedUnit, job: Job, ctx: WriterContext, device: str, check: bool,
               source: tuple[Any, float] | None = None) -> UnitResult:
    """Read one unit (unless ``source`` holds it already), requantize it if needed, encode it."""
    unit, t_read = source if source is not None else _read(planned, job, ctx, device)
    spec = planned.spec
    if isinstance(unit, list):  # a pure rename: bytes are copied by the writer
        return UnitResult(unit, {}, t_read, 0.0)
    if device.startswith("cuda"):
        import torch

        with torch.cuda.device(torch.device(device)):  # kernels launch on the thread's current device
            return _transform_on(unit, spec, job, ctx, device, t_read, check)
    return _transform_on(unit, spec, job, ctx, device, t_read, check)


def _transform_on(unit: Any, spec: UnitSpec, job: Job, ctx: WriterContext, device: str, t_read: float,
                  check: bool) -> UnitResult:
    t1 = time.perf_counter()
    opts, ckpt = job.opts, job.ckpt
    stats: dict[str, RequantStats] = {}
    source = unit
    if not ctx.target_options.keep_nvfp4:
        try:
            unit, stats = to_mxfp4(unit, rule=opts.scale_rule, device=device, keep_rows=spec.first > 0,
                                   keep_on_device=device.startswith("cuda") and job.target.ENCODES_ON_DEVICE)
        except ValueError as exc:  # invalid NVFP4 scales: name the unit and the first source file
            ref = ckpt.tensors[spec.sources[0]]
            raise InputError(str(exc), file=ckpt.rel(ckpt.tensors[bad].file) if (bad := _scale_tensor(ckpt, spec)) in ckpt.tensors else ckpt.rel(ref.file), tensor=bad,
                             hint="the checkpoint's scales are corrupt; re-export it") from exc
    if not stats:  # requantized scales are made here, bytes 0..254 (NUMERICS.md): only a source's are checked
        _validate_mx(unit, spec, ckpt)
    want = None
    if check:
        # on a GPU the check compares with a second, device-resident requantization of the source
        want = requant_on_device(source, opts.scale_rule, device) if stats and device.startswith("cuda") else unit
    outs = job.target.encode(unit, spec, ctx)
    return UnitResult(outs, {k: v.to_dict() for k, v in stats.items()}, t_read, time.perf_counter() - t1, want,
                      device if stats else "", stats)


def requant_on_device(unit: Canonical, rule: str, device: str) -> Canonical:
    """The unit's NVFP4 weights requantized to MXFP4 on ``device``, results left there (no host
    staging): the reference the post-write check compares the written bytes with. The same bytes
    as ``to_mxfp4`` (the kernel is byte-identical to the CPU's for any chunking)."""
    import dataclasses

    from mxfp4conv.kernels.requant_triton import requant_rows

    def one(w: FP4Weight) -> FP4Weight:
        assert w.global_rows is not None
        kh = int(w.packed.shape[-1])
        lead = tuple(w.packed.shape[:-1])
        p = w.packed.reshape(-1, kh).to(device, non_blocking=True)
        s = w.scales.reshape(-1, kh // 8).to(device, non_blocking=True)
        g = w.global_rows.reshape(-1).float().to(device, non_blocking=True)
        po, so, _ = requant_rows(p, s, g, w.global_is_divisor, rule)
        return FP4Weight("mxfp4", po.view(*lead, kh), so.view(*lead, kh // 16))

    changes: dict[str, Any] = {f.name: one(v) for f in dataclasses.fields(unit)
                               if isinstance(v := getattr(unit, f.name), FP4Weight) and v.quant == "nvfp4"}
    return dataclasses.replace(unit, **changes)


def read_ahead(sizes: list[int], limit: int) -> list[int]:
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


def unit_results(units: list[PlannedUnit], job: Job, ctx: WriterContext, check: bool) -> Iterator[UnitResult]:
    """The units' results in order (see the module docstring)."""
    devs = devices(job.opts)
    if len(devs) == 1:
        sizes = [u.read_bytes for u in units]
        upto = read_ahead(sizes, max(sizes, default=0))
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxfp4conv-read") as reader:
            ahead: dict[int, Future[tuple[Any, float]]] = {}
            nxt = 0
            for i, unit in enumerate(units):
                while nxt < upto[i]:
                    if units[nxt].direct is None:
                        ahead[nxt] = reader.submit(_read, units[nxt], job, ctx, devs[0])
                    nxt += 1
                source = ahead.pop(i).result() if unit.direct is None else (list(unit.direct), 0.0)
                yield _transform(unit, job, ctx, devs[0], check, source)
        return
    with ThreadPoolExecutor(max_workers=len(devs), thread_name_prefix="mxfp4conv-unit") as pool:
        window: deque[Future[UnitResult]] = deque()
        for i, unit in enumerate(units):
            window.append(pool.submit(_transform, unit, job, ctx, devs[i % len(devs)], check))
            if len(window) >= len(devs):
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


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
    from mxfp4conv.formats.fp4 import e8m0_has_nan
    from mxfp4conv.model.canonical import DenseFP4, MoELayer

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

