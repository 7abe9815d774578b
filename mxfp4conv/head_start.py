"""The head start: a conversion's first requantized unit, made while torch is still being imported.

A fresh process spends seconds importing torch (1.5 s on 2 cores, ~4 s on a GPU host), and nothing
that needs torch runs before it ends. Meanwhile this module reads the first NVFP4 unit's stacks into
plain buffers (``preadv``, the same layout as ``layouts/split.py``) and requantizes them with the
compiled CPU kernel (``kernels/requant_native``: ctypes, which releases the GIL) on worker threads.
The source codes are let go as soon as they are requantized (the unit's validation needs only its
scales). Once torch is there, the pipeline (``units.py``) takes the bytes in place (``torch.frombuffer``),
validates the source as for any unit (an invalid one is refused with the same error; the kernel is
memory-safe on any input) and folds the statistics from the kernel's row statistics: the unit's bytes
and statistics are the ones the CPU path makes, which the GPU's kernel matches byte for byte.

Nothing here imports torch. ``MXFP4CONV_HEAD_START``: ``off`` (default), ``auto`` (when torch is not
imported yet), ``on``. Off by default: on the H200 hosts measured its work beside torch's import
delayed the import more than the unit it made saved, and on 2 cores it moved work between cores
without a gain beyond the noise (BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import sys
import threading
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mxfp4conv.canonical import UnitSpec
from mxfp4conv.formats.tables import E4M3_VALUES
from mxfp4conv.io.checkpoint import Checkpoint
from mxfp4conv.io.safetensors_io import read_many
from mxfp4conv.kernels import requant_native
from mxfp4conv.layouts.split import LinearRoles, RawBytes, stack_plan, unit_groups, weight_refs

__all__ = ["HeadStart", "RawWeight", "first_unit", "make", "mode", "torch_pending", "wanted"]

ENV = "MXFP4CONV_HEAD_START"
_MX_BLOCK = 32  # formats.mxfp4.MX_BLOCK (that module imports torch)
_ROW_STATS = 5  # float64 columns of the kernel's row statistics (requant.ROW_STATS)


@dataclass
class RawWeight:
    """One weight's stacks as read (uint8 ``[E, N, K/2]`` codes, ``[E, N, K/16]`` E4M3 scale bits) and
    its rows requantized: codes ``[E*N, K/2]``, E8M0 scales ``[E*N, K/32]``, float64 row statistics
    ``[E*N, 5]``, as raw bytes."""

    shape: tuple[int, int, int]  # (E, N, K/2) of the packed stack
    packed: RawBytes | None  # None once requantized: only the scales are validated afterwards
    scales: RawBytes
    out: RawBytes
    scales_out: RawBytes
    row_stats: RawBytes

    @property
    def rows(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass
class HeadStart:
    """The head-start unit: its weights by ``unit_groups`` name, and busy seconds."""

    weights: dict[str, RawWeight]
    t_read: float
    t_transform: float

    def stacks(self) -> dict[str, tuple[RawBytes | None, RawBytes]]:
        """The source stacks, as ``read_split_unit(raw=...)`` takes them (the codes let go: None)."""
        return {k: (w.packed, w.scales) for k, w in self.weights.items()}


def mode() -> str:
    """``MXFP4CONV_HEAD_START``: off (default) | auto | on."""
    value = os.environ.get(ENV, "off").strip().lower() or "off"
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{ENV}={value!r}: use auto, on or off")
    return value


def torch_pending() -> bool:
    """Whether torch is not imported yet, or still being imported on another thread."""
    mod = sys.modules.get("torch")
    return mod is None or bool(getattr(getattr(mod, "__spec__", None), "_initializing", False))


def wanted() -> bool:
    """Whether a conversion starting now takes a head start (see the module docstring)."""
    m = mode()
    return m == "on" or (m == "auto" and torch_pending())


def first_unit(units: list[UnitSpec], direct: list[Any], layout: Any) -> tuple[int, LinearRoles] | None:
    """The first unit a head start can make: read (not copied), a moe or dense unit of NVFP4 weights in
    a split layout, with float32 global scales; and the roles it is read by. None when there is none."""
    roles_of = getattr(layout, "nvfp4_roles", None)
    if roles_of is None:
        return None
    for i, (spec, d) in enumerate(zip(units, direct, strict=True)):
        if d is not None or spec.kind not in ("moe", "dense"):
            continue
        roles = roles_of(spec)
        return (i, roles) if roles is not None and roles.global_scale and roles.scale_dtype == "F8_E4M3" else None
    return None


def _global(ckpt: Checkpoint, name: str) -> float | None:
    ref = ckpt.tensors.get(name)
    if ref is None or ref.dtype != "F32" or ref.nbytes != 4:
        return None
    return float(struct.unpack("<f", ref.read_bytes())[0])


def _buffer(n: int) -> RawBytes:
    """``n`` bytes for a stack or a result: an anonymous mapping, whose pages are zeroed as the reader
    and kernel threads first write them (GIL released), where a bytearray would be zeroed here, all
    at once, holding the GIL the import of torch needs."""
    return mmap.mmap(-1, n) if n else bytearray()


def _addr(buf: RawBytes | array) -> int:
    if isinstance(buf, array):
        return int(buf.buffer_info()[0])
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) if len(buf) else 0


def make(spec: UnitSpec, ckpt: Checkpoint, roles: LinearRoles, rule: str,
         threads: int | None = None, stop: threading.Event | None = None) -> HeadStart | None:
    """Read and requantize the unit ``spec`` without torch. None when it cannot be made here
    (no compiled kernel; a global scale that is not one float32) or ``stop`` was set meanwhile (the
    conversion ended): the pipeline then reads and requantizes it as any other unit. Read errors (a
    truncated file) propagate as ``InputError``."""
    try:
        kern = requant_native.load()
    except OSError:
        return None
    if kern is None or (stop is not None and stop.is_set()):
        return None
    t0 = time.perf_counter()
    weights: dict[str, RawWeight] = {}
    grows: dict[str, array] = {}
    reads: list[tuple[Any, memoryview]] = []  # the whole unit in one call: its tensors lie together in a shard
    for label, groups in unit_groups(spec).items():
        prefs, srefs, num, rows = weight_refs(ckpt, groups, roles)
        shape, at = stack_plan(ckpt, prefs, num, rows)
        sshape, sat = stack_plan(ckpt, srefs, num, rows)
        g = array("f")
        gs = [[_global(ckpt, f"{m}.{roles.global_scale}") for m in mods] for mods in groups]
        for e in range(num):
            for j, n in enumerate(rows):
                v = gs[j][e]
                if v is None:
                    return None
                g.extend(array("f", [v]) * n)  # gate rows of expert e, then its up rows
        r, kh = shape[0] * shape[1], shape[2]
        if kh * 2 % _MX_BLOCK or sshape[2] * 8 != kh:
            return None
        packed, scales = _buffer(r * kh), _buffer(r * kh // 8)
        reads += [(ref, memoryview(packed)[off:off + ref.nbytes]) for ref, off in at]
        reads += [(ref, memoryview(scales)[off:off + ref.nbytes]) for ref, off in sat]
        weights[label] = RawWeight(shape, packed, scales, _buffer(r * kh), _buffer(r * kh // 16),
                                   _buffer(r * _ROW_STATS * 8))
        grows[label] = g
    read_many(reads)
    del reads
    t1 = time.perf_counter()
    lut = array("f", E4M3_VALUES)
    n = threads or int(os.environ.get("MXFP4CONV_CPU_THREADS", "0")) or len(os.sched_getaffinity(0))
    calls = []
    for label, w in weights.items():
        kh = w.shape[2]
        step = max(1, -(-w.rows // (4 * n)))  # few, large calls: each takes the GIL the import holds
        assert w.packed is not None
        addrs = (_addr(w.packed), _addr(w.scales), _addr(lut), _addr(grows[label]))
        outs = (_addr(w.out), _addr(w.scales_out), _addr(w.row_stats))
        calls += [(addrs, r0, min(w.rows, r0 + step), kh, outs) for r0 in range(0, w.rows, step)]

    def run(c: tuple[tuple[int, int, int, int], int, int, int, tuple[int, int, int]]) -> None:
        addrs, r0, r1, kh, outs = c
        if not halted():
            kern.rows(*addrs, r0, r1, kh, roles.global_is_divisor, rule, *outs)

    def halted() -> bool:
        return stop is not None and stop.is_set()

    if halted():
        return None
    with ThreadPoolExecutor(max(1, min(n, len(calls))), thread_name_prefix="mxfp4conv-head") as pool:
        list(pool.map(run, calls))
    for w in weights.values():
        w.packed = None  # the codes are requantized: their memory (most of the unit's) goes now, not once it is taken
    return None if halted() else HeadStart(weights, t1 - t0, time.perf_counter() - t1)
