"""NVFP4 -> MXFP4 requantization (docs/NUMERICS.md), chunked, with per-tensor statistics.

Row-level contract shared by the CPU path (``requant_rows_cpu``) and the GPU kernel
(``mxfp4conv.kernels.requant_triton.requant_rows``), which must agree byte for byte::

    requant_rows(packed [R, K/2] uint8, scales_e4m3 [R, K/16] float8_e4m3fn (or uint8 bits),
                 global_rows [R] float32, divisor: bool, rule: ScaleRule)
        -> (packed_out [R, K/2] uint8, scales_out [R, K/32] uint8 (E8M0),
            row_stats [R, 5] float64 = (sq_err, signal, max_abs_err, clipped_blocks, exact_blocks))

i.e. ``quantize_mxfp4_with_stats(dequantize_nvfp4(...), rule, requant_groups(packed))`` with the block
statistics folded per row: float32 block sums in group order (NUMERICS.md "Block statistics"), sq_err /
signal summed in the 8 lanes of "Row sums", max_abs_err the max, the two counts; MSE's choice is exact
("MSE decision").

Longer than the project's ~400-line guide on purpose: the CPU reference, its chunking and the statistics
fold are one contract that the GPU kernel is tested against; split, they would drift apart.

The CPU paths never expand a tensor to fp32: within a 16-element NVFP4 block every value is one of 8
magnitudes ``round(e2m1[m] * s * g)`` (sign-symmetric), so all float work (scale choice, E2M1 rounding,
errors) runs on per-block tables of 8 entries per 16 weights; per weight only its magnitude
is counted and its new code looked up. Two implementations, bit-identical: the compiled kernel
(``mxfp4conv.kernels.requant_native``, C through ctypes, the default when a C compiler is found) and
the eager-torch path (``bincount`` for the counts, explicit float32 loops for the block sums, ``cumsum``,
a sequential scan on the CPU, for the float64 row sums). Rows are processed in slabs of ~128K weights (cache-resident) on worker threads; while
they run, torch's intra-op thread count is set to 1 (process-wide), so do not run other torch work
concurrently.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from mxfp4conv.formats.fp4 import E2M1_POS_VALUES, F4_E2M1_MAX, e4m3_bits, e4m3_decode, unpack_nibbles
from mxfp4conv.formats.mxfp4 import (
    MX_BLOCK,
    ScaleRule,
    quantize_mxfp4_with_stats,
    rceil_exponent,
    scale_exponent,
)
from mxfp4conv.formats.nvfp4 import dequantize_nvfp4, validate_nvfp4_scales
from mxfp4conv.kernels import requant_native
from mxfp4conv.model.canonical import FP4Weight

__all__ = [
    "ROW_LANES",
    "ROW_STATS",
    "RequantStats",
    "requant_groups",
    "requant_nvfp4_to_mxfp4",
    "requant_rows_cpu",
    "requant_rows_reference",
]

ROW_STATS = ("sq_err", "signal", "max_abs_err", "clipped_blocks", "exact_blocks")  # row_stats columns
# rows per chunk of a weight: the CPU's workers meet once per chunk (the statistics are folded
# there), the GPU's chunked driver streams at least GPU_MIN_CHUNK_ROWS at a time
DEFAULT_CHUNK_ROWS = 1 << 17
_SLAB_WEIGHTS = 1 << 17  # weights per work item of the torch path: keeps its tables cache-resident
# weights per call of the compiled kernel at most (~10 ms of one core): each call takes the GIL to
# start and to return, and many cores handing it over every fraction of a millisecond leave it idle
_NATIVE_SLAB_WEIGHTS = 1 << 22


def _seq_fold(acc: float, vals: torch.Tensor) -> float:
    """``acc + v0 + v1 + ...`` in float64, strictly in order (CPU cumsum is a sequential scan)."""
    if vals.numel() == 0:
        return acc
    return float(torch.cat((vals.new_tensor([acc]), vals.double().cpu())).cumsum(0)[-1])


@dataclass
class RequantStats:
    """Requantization statistics of one tensor (or several, merged). See NUMERICS.md."""

    blocks: int = 0
    clipped_blocks: int = 0
    exact_blocks: int = 0
    sq_err: float = 0.0
    signal: float = 0.0
    max_abs_err: float = 0.0
    # with ``keep_rows``, the row statistics added, with their blocks per row: what ``then`` folds on
    keep_rows: bool = field(default=False, repr=False, compare=False)
    rows: list[tuple[torch.Tensor, int]] = field(default_factory=list, repr=False, compare=False)

    @property
    def sqnr_db(self) -> float | None:
        """``10 log10(signal / sq_err)``; None when sq_err == 0 (exact)."""
        if self.sq_err == 0:
            return None
        if self.signal == 0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.sq_err)

    @classmethod
    def from_row_stats(cls, row_stats: torch.Tensor, blocks_per_row: int, keep_rows: bool = False) -> RequantStats:
        """Fold ``[R, 5]`` row statistics in row order."""
        out = cls(keep_rows=keep_rows)
        out.add_rows(row_stats, blocks_per_row)
        return out

    def add_rows(self, row_stats: torch.Tensor, blocks_per_row: int) -> None:
        """Continue the fold with more rows ``[R, 5]`` (in row order, after those already added)."""
        rs = row_stats.double().cpu()
        if self.keep_rows:
            self.rows.append((rs.clone(), blocks_per_row))  # ``row_stats`` may be a reused buffer's view
        self.blocks += int(rs.shape[0]) * blocks_per_row
        self.sq_err = _seq_fold(self.sq_err, rs[:, 0])
        self.signal = _seq_fold(self.signal, rs[:, 1])
        if rs.shape[0]:
            self.max_abs_err = max(self.max_abs_err, float(rs[:, 2].max()))
        self.clipped_blocks += int(rs[:, 3].sum())
        self.exact_blocks += int(rs[:, 4].sum())

    def then(self, later: RequantStats) -> RequantStats:
        """These statistics continued with the rows of ``later`` (made with ``keep_rows``), the next rows
        of the same weight: bit for bit the fold of all of them in order (``merge`` adds two totals)."""
        out = dataclasses.replace(self, keep_rows=False, rows=[])
        for rs, per in later.rows:
            out.add_rows(rs, per)
        return out

    def merge(self, other: RequantStats) -> RequantStats:
        """Statistics of self followed by other (sums in that order)."""
        return RequantStats(
            blocks=self.blocks + other.blocks,
            clipped_blocks=self.clipped_blocks + other.clipped_blocks,
            exact_blocks=self.exact_blocks + other.exact_blocks,
            sq_err=self.sq_err + other.sq_err,
            signal=self.signal + other.signal,
            max_abs_err=max(self.max_abs_err, other.max_abs_err),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (non-finite floats become None)."""

        def fin(v: float | None) -> float | None:
            return v if v is not None and math.isfinite(v) else None

        return {
            "blocks": self.blocks,
            "clipped_blocks": self.clipped_blocks,
            "exact_blocks": self.exact_blocks,
            "sq_err": fin(self.sq_err),
            "signal": fin(self.signal),
            "max_abs_err": fin(self.max_abs_err),
            "sqnr_db": fin(self.sqnr_db),
        }


def _check_rows(packed: torch.Tensor, scales: torch.Tensor, global_rows: torch.Tensor) -> int:
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8 [R, K/2], got {packed.dtype} {tuple(packed.shape)}")
    r, kh = packed.shape
    k = 2 * kh
    if k % MX_BLOCK:
        raise ValueError(f"K={k} is not a multiple of {MX_BLOCK}")
    if tuple(scales.shape) != (r, k // 16) or tuple(global_rows.shape) != (r,):
        raise ValueError(
            f"scales {tuple(scales.shape)} / global_rows {tuple(global_rows.shape)} do not match "
            f"packed {tuple(packed.shape)}"
        )
    return k


ROW_LANES = 8  # row sums: block j of a row is summed in lane j % 8 (NUMERICS.md "Row sums")


def _lane_sum(v: torch.Tensor) -> torch.Tensor:
    """[r, NB] float64 -> [r]: lane t (blocks t, t + 8, t + 16, ...) summed in block order from 0,
    then the 8 lane sums added in lane order from 0 (CPU cumsum of float64 is a sequential scan)."""
    r, nb = v.shape
    pad = -nb % ROW_LANES
    if pad:
        v = torch.cat((v, v.new_zeros(r, pad)), 1)  # adding +0 to a lane sum changes nothing
    lanes = torch.cat((v.new_zeros(r, 1, ROW_LANES), v.view(r, -1, ROW_LANES)), 1).cumsum(1)[:, -1]
    return torch.cat((v.new_zeros(r, 1), lanes), 1).cumsum(1)[:, -1]


def _row_stats(
    err: torch.Tensor, sig: torch.Tensor, mx: torch.Tensor, clipped: torch.Tensor, exact: torch.Tensor
) -> torch.Tensor:
    """Per-block [r, NB] -> [r, 5] float64: sq_err and signal by ``_lane_sum``, the max, the counts."""
    return torch.stack(
        (
            _lane_sum(err),
            _lane_sum(sig),
            mx.amax(1),
            clipped.sum(1, dtype=torch.float64),
            exact.sum(1, dtype=torch.float64),
        ),
        dim=1,
    )


def requant_rows_reference(
    packed: torch.Tensor,
    scales_e4m3: torch.Tensor,
    global_rows: torch.Tensor,
    divisor: bool,
    rule: ScaleRule,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row-level contract written as the plain composition (slow; CPU tensors): dequantize the
    whole ``[R, K]`` slab to float32, quantize it elementwise. Same signature and results as
    ``requant_rows_cpu``; the tests and the benchmark use it as the reference."""
    k = _check_rows(packed, scales_e4m3, global_rows)
    x = dequantize_nvfp4(packed, scales_e4m3, global_rows, divisor=divisor)
    out, scales, st = quantize_mxfp4_with_stats(x, rule, requant_groups(packed))
    if k == 0:
        return out, scales, torch.zeros(packed.shape[0], 5, dtype=torch.float64)
    return out, scales, _row_stats(st.sq_err, st.signal, st.max_abs_err, st.clipped, st.exact)


def requant_groups(packed: torch.Tensor) -> torch.Tensor:
    """Group id of every element of NVFP4 rows ``[R, K/2]`` -> uint8 ``[R, K]``: ``half * 8 +
    magnitude code``, half = which 16-element NVFP4 block of its 32-block (``block_sum``)."""
    mag = unpack_nibbles(packed) & 7
    half = (torch.arange(mag.shape[-1]) % MX_BLOCK >= 16).to(torch.uint8) * 8
    return mag | half


# ----------------------------------------------------------------------------- CPU fast path
_POS8 = torch.tensor(E2M1_POS_VALUES, dtype=torch.float32)
_base_cache: dict[int, torch.Tensor] = {}


def _base_index(nb16: int) -> torch.Tensor:
    """int32 [nb16, 8]: offset of 16-block j's 8 table entries (j * 8) for each of its bytes.

    Tables are [nb, 16] = (32-block, half * 8 + magnitude), i.e. 8 entries per 16-block; cached."""
    t = _base_cache.get(nb16)
    if t is None:
        t = (torch.arange(nb16, dtype=torch.int32) * 8)[:, None].expand(nb16, 8).contiguous()
        if len(_base_cache) > 16:
            _base_cache.clear()
        _base_cache[nb16] = t
    return t


# E2M1 grid magnitude -> code, indexed by its float32 bits >> 22 (0, 252 for 0.5, 254..259 for 1..6).
_CODE_LUT = torch.zeros(260, dtype=torch.uint8)
_CODE_LUT[[252, 254, 255, 256, 257, 258, 259]] = torch.arange(1, 8, dtype=torch.uint8)


# Per-exponent constants, indexed by the scale byte e + 127 (e in [-127, 127]); all exact.
_EXPS = range(-127, 128)
_INV32 = torch.tensor([2.0**-e for e in _EXPS], dtype=torch.float32)  # 2^-e (2^-127: subnormal)
_SQ64 = torch.tensor([4.0**e for e in _EXPS], dtype=torch.float64)  # 4^e
_POW64 = torch.tensor([2.0**e for e in _EXPS], dtype=torch.float64)  # 2^e
_SIX32 = torch.tensor([6.0 * 2.0**e for e in _EXPS], dtype=torch.float32)  # 6 * 2^e; inf above 2^128
_COFF = torch.tensor([(22 - e) << 23 for e in _EXPS], dtype=torch.int32)  # c's exponent offset


class _Workspace:
    """Reusable buffers of one worker thread. The hot loop must not allocate its large temporaries:
    malloc serves them with fresh (mmap'd or trimmed) pages, and every page fault costs time and
    serializes the worker threads on the kernel's memory-map lock."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        t = self._bufs.get(name)
        if t is None or t.dtype != dtype or t.numel() < n:
            t = self._bufs[name] = torch.empty(n, dtype=dtype)
        return t[:n].view(shape)


def _cand_tab(
    at: torch.Tensor, ebits: torch.Tensor, eb: torch.Tensor, ws: _Workspace, tag: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tables [nb, 16] for scale bytes eb = e + 127 [nb] (int32), float32: q = |x| * 2^-e, its grid
    magnitude r and d = q - r (the scaled domain: an entry's error is 2^e * d).

    Rounding: adding and subtracting ``c = 2^(max(floor(log2 q), 0) + 22)``, whose ulp is the E2M1
    step of q's binade, rounds q to the grid with ties to even (then saturate at 6). ``ebits`` is
    |x|'s exponent field (bits & 0x7F800000), so c's bits are ``ebits + (22 - e) << 23``, floored
    at 2^22. Exactness: q is exact (a power-of-two scaling; every nonzero |x| of an NVFP4 32-block is
    >= amax * 2^-22, so q never drops into float32's subnormal range with bits lost), and q - r is
    exact (Sterbenz: r is 0 or in [q/2, 2q]).
    """
    shape = tuple(at.shape)
    q = torch.mul(at, _INV32.index_select(0, eb)[:, None], out=ws("q" + tag, shape, torch.float32))
    c = torch.add(ebits, _COFF.index_select(0, eb)[:, None], out=ws("c", shape, torch.int32))
    cf = c.clamp_(min=(127 + 22) << 23).view(torch.float32)
    r = torch.add(q, cf, out=ws("r" + tag, shape, torch.float32)).sub_(cf).clamp_(max=F4_E2M1_MAX)
    d = torch.sub(q, r, out=ws("d" + tag, shape, torch.float32))
    return q, r, d


def _fold32(tab: torch.Tensor, cnt: torch.Tensor, ws: _Workspace, tag: str) -> torch.Tensor:
    """Float32 block sums of a float32 table [nb, 16] (squared, then weighted by its element counts
    [nb, 16], float32): ``acc = RN(acc + RN(n * RN(t * t)))`` in group order 0..15 over the entries
    that occur (NUMERICS.md "Block statistics"; the others' t * t can overflow). Not cumsum: torch's
    CPU cumsum of float32 accumulates in float64."""
    terms = torch.mul(tab, tab, out=ws("t" + tag, tuple(tab.shape), torch.float32))
    terms.masked_fill_(cnt == 0, 0.0).mul_(cnt)
    acc = terms[:, 0].clone()
    for t in range(1, terms.shape[1]):
        acc += terms[:, t]
    return acc


def _present_max(tab: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Per block, the max of the table entries [nb, 16] that occur (tab >= 0)."""
    return torch.where(present, tab, 0.0).amax(1)


def _mse_pick(
    qb: torch.Tensor, ra: torch.Tensor, rb: torch.Tensor, cnt: torch.Tensor, ws: _Workspace
) -> torch.Tensor:
    """``mse_prefers_lower`` on [nb, 16] tables with element counts: the exact float64 difference
    ``sum n (A - B)(2u - A - B)`` (u = qb, A = 2 ra, B = rb) is < 0. Every term and partial sum is
    exact, so the order of the sum is free."""
    shape = tuple(qb.shape)
    f64 = torch.float64
    a = ws("ma", shape, f64).copy_(ra).mul_(2.0)
    b = ws("mb", shape, f64).copy_(rb)
    v = ws("mv", shape, f64).copy_(qb).mul_(2.0).sub_(a).sub_(b)  # 2u - A - B, exact
    return a.sub_(b).mul_(v).mul_(cnt).sum(1) < 0


def _slab(
    packed: torch.Tensor,
    s: torch.Tensor,
    g: torch.Tensor,
    divisor: bool,
    rule: ScaleRule,
    ws: _Workspace,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """One work item: packed [r, K/2], decoded block scales s [r, K/16] f32, g [r] f32; writes the
    row slices ``out`` = (packed [r, K/2], scales [r, K/32], row stats [r, 5])."""
    f32, f64, i32, u8 = torch.float32, torch.float64, torch.int32, torch.uint8
    r, kh = packed.shape
    nb, nb16 = r * kh // 16, r * kh // 8
    xt = torch.mul(_POS8, s.abs()[..., None], out=ws("xt", (r, kh // 8, 8), f32))  # exact
    at = ws("at", (nb, 16), f32)  # |x| by (32-block, half * 8 + magnitude)
    (torch.div if divisor else torch.mul)(xt, g.abs()[:, None, None], out=at.view(r, kh // 8, 8))
    p16 = packed.view(nb16, 8)
    lo = torch.bitwise_and(p16, 7, out=ws("lo", (nb16, 8), u8))
    hi = torch.bitwise_right_shift(p16, 4, out=ws("hi", (nb16, 8), u8)).bitwise_and_(7)
    mm = torch.maximum(lo.amax(1), hi.amax(1))
    amax = at.view(nb16, 8).gather(1, mm.long()[:, None]).view(nb, 2).amax(1)
    zero = amax == 0
    ebits = torch.bitwise_and(at.view(i32), 0x7F800000, out=ws("ebits", (nb, 16), i32))
    idx = ws("idx", (nb16, 8, 2), i32)  # flat table index of every element, in element order
    base = _base_index(nb16)
    torch.add(base, lo, out=idx[..., 0])
    torch.add(base, hi, out=idx[..., 1])
    flat = idx.view(-1)
    counts = torch.bincount(flat, minlength=nb * 16).view(nb, 16)  # elements per (block, group)
    cnt = ws("cnt", (nb, 16), f32).copy_(counts)
    present = counts != 0
    if rule is ScaleRule.MSE:
        er = rceil_exponent(amax) + 127  # scale bytes of the two candidates, clamped; zero blocks 127
        ea = torch.where(zero, 127, er.clamp(0, 254))
        eb = torch.where(zero, 127, (er - 1).clamp_(0, 254))
        qa, ra, da = _cand_tab(at, ebits, ea, ws, "a")
        qb, rb, db = _cand_tab(at, ebits, eb, ws, "b")
        pick = _mse_pick(qb, ra, rb, ws("cn64", (nb, 16), f64).copy_(cnt), ws) & (eb != ea)
        e = torch.where(pick, eb, ea)
        p2 = pick[:, None]
        dtab = torch.where(p2, db, da)
        qtab = torch.where(p2, qb, qa)
        rtab = torch.where(p2, rb, ra, out=ws("rt", (nb, 16), f32))
    else:
        e = scale_exponent(amax, rule) + 127
        qtab, rtab, dtab = _cand_tab(at, ebits, e, ws, "a")
    err = _fold32(dtab, cnt, ws, "e")  # the chosen candidate's only
    sig = _fold32(qtab, cnt, ws, "s")
    mx = _present_max(dtab.abs(), present)
    s4 = _SQ64.index_select(0, e)
    key = torch.bitwise_right_shift(rtab.view(i32), 22, out=ws("c", (nb, 16), i32))
    ctab = torch.index_select(_CODE_LUT, 0, key.view(-1), out=ws("ct", (nb * 16,), u8))
    codes = torch.index_select(ctab, 0, flat, out=ws("co", (nb * 32,), u8)).view(nb16, 8, 2)
    o = out[0].view(nb16, 8)
    torch.bitwise_left_shift(codes[..., 1], 4, out=o)
    o |= codes[..., 0]
    o |= lo.copy_(p16).bitwise_and_(0x88)  # the sign bits
    neg = torch.signbit(s) ^ torch.signbit(g)[:, None]
    if bool(neg.any()):  # negative block / global scales flip the sign bits
        o ^= neg.view(nb16, 1).to(u8) * 0x88
    out[1].copy_(e.view(r, -1))
    clipped = amax > _SIX32.index_select(0, e)  # amax * 2^-e > 6, exactly
    nbr = nb // r
    out[2].copy_(
        _row_stats(
            err.double().mul_(s4).view(r, nbr),
            sig.double().mul_(s4).view(r, nbr),
            mx.double().mul_(_POW64.index_select(0, e)).view(r, nbr),
            clipped.view(r, nbr),
            (mx == 0).view(r, nbr),
        )
    )


@contextmanager
def _intra_op_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@functools.cache
def _e4m3_values() -> torch.Tensor:
    """float32 [256]: the value of each E4M3 bit pattern (the compiled kernel's decode table)."""
    return e4m3_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8)).contiguous()


def requant_rows_cpu(
    packed: torch.Tensor,
    scales_e4m3: torch.Tensor,
    global_rows: torch.Tensor,
    divisor: bool,
    rule: ScaleRule,
    *,
    threads: int | None = None,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU requant of rows; byte-identical to ``requant_rows_reference`` and the GPU kernel.

    ``packed`` uint8 ``[R, K/2]``, ``scales_e4m3`` float8_e4m3fn / uint8 bits ``[R, K/16]``,
    ``global_rows`` float32 ``[R]`` -> (``packed_out`` uint8 ``[R, K/2]``, ``scales_out`` uint8
    ``[R, K/32]``, ``row_stats`` float64 ``[R, 5]`` = (sq_err, signal, max_abs_err, clipped_blocks,
    exact_blocks)). Inputs must be valid (``validate_nvfp4_scales``). Work is split into row slabs run
    on ``threads`` worker threads (default: torch's intra-op thread count), by the compiled kernel
    (``requant_native.load()``; slabs of up to 4M weights, at least eight per thread) or else with
    single-threaded torch ops (slabs of ~128K weights). ``into``: the
    three results' tensors to write into (contiguous, of those shapes; row_stats zeroed), e.g. slices
    of a whole weight's outputs; ``pool``: the worker threads to use (a caller running many chunks
    keeps one pool rather than one per call).
    """
    rule = ScaleRule(rule)
    k = _check_rows(packed, scales_e4m3, global_rows)
    r = packed.shape[0]
    if into is not None:
        out, scales_out, row_stats = into
        if (tuple(out.shape), tuple(scales_out.shape), tuple(row_stats.shape)) != ((r, k // 2), (r, k // MX_BLOCK), (r, 5)) \
                or not (out.is_contiguous() and scales_out.is_contiguous() and row_stats.is_contiguous()):
            raise ValueError("into: tensors must be contiguous and of the result shapes")
    else:
        out = torch.empty(r, k // 2, dtype=torch.uint8)  # row-major, whatever the input's strides
        scales_out = torch.empty(r, k // MX_BLOCK, dtype=torch.uint8)
        row_stats = torch.zeros(r, 5, dtype=torch.float64)
    if r == 0 or k == 0:
        return out, scales_out, row_stats
    g = global_rows.float().contiguous()
    n_threads = threads or int(os.environ.get("MXFP4CONV_CPU_THREADS", "0")) or torch.get_num_threads()
    step = max(1, _SLAB_WEIGHTS // k)
    kern = requant_native.load()
    if kern is not None:
        # large calls, yet at least eight per worker so that the workers finish together
        step = max(1, min(_NATIVE_SLAB_WEIGHTS // k, -(-r // (8 * max(1, n_threads)))))
        packed = packed.contiguous()
        bits = e4m3_bits(scales_e4m3).contiguous()  # decoded by the kernel, in the workers
        lut = _e4m3_values()
        addrs = (packed.data_ptr(), bits.data_ptr(), lut.data_ptr(), g.data_ptr())
        outs = (out.data_ptr(), scales_out.data_ptr(), row_stats.data_ptr())
        kh = k // 2

        def work(r0: int) -> None:
            assert kern is not None
            kern.rows(*addrs, r0, min(r, r0 + step), kh, divisor, rule.value, *outs)

    else:
        local = threading.local()

        def work(r0: int) -> None:
            ws = getattr(local, "ws", None)
            if ws is None:
                ws = local.ws = _Workspace()
            r1 = min(r, r0 + step)
            dest = (out[r0:r1], scales_out[r0:r1], row_stats[r0:r1])
            _slab(packed[r0:r1].contiguous(), e4m3_decode(scales_e4m3[r0:r1]).contiguous(), g[r0:r1], divisor, rule,
                  ws, dest)

    starts = range(0, r, step)
    with _intra_op_threads(1):  # parallelism comes from the slabs, never from OpenMP inside an op
        if n_threads <= 1 or len(starts) == 1:
            for r0 in starts:
                work(r0)
        elif pool is not None:
            list(pool.map(work, starts))
        else:
            with ThreadPoolExecutor(min(n_threads, len(starts))) as own:
                list(own.map(work, starts))
    return out, scales_out, row_stats


GPU_MIN_CHUNK_ROWS = 1 << 17


# A weight is requantized whole on the GPU when its bytes are at most 1/RESIDENT_SHARE of the device's
# memory: its input, its output, the output's copy gathered for the writer, the post-write check's
# second requantization, the next unit's read and the previous unit's output still being written
# (device/device_write) take six such shares at most; a larger one streams through in bounded row chunks.
RESIDENT_SHARE = 8


def fits_on_device(nbytes: int, device: str) -> bool:
    """Whether a weight of ``nbytes`` (packed codes and block scales) is requantized whole on ``device``."""
    if not torch.cuda.is_available():
        return False
    return nbytes * RESIDENT_SHARE <= torch.cuda.get_device_properties(torch.device(device)).total_memory


def _requant_resident(w: FP4Weight, rule: ScaleRule, device: str, keep: bool = False,
                      keep_rows: bool = False) -> tuple[FP4Weight, RequantStats]:
    """The GPU path for a weight that fits on the device: moved there unless read there already,
    requantized in one launch. With ``keep`` the results stay on the device (the shard writer copies
    them back a few MB at a time: ``device.device_write``); else they are copied back into one exact-size
    page-locked buffer of the pool (``device.pinned.HostSlabs``). The scales are validated from the row
    maxima computed on the device, before anything is returned."""
    from mxfp4conv.device.pinned import host_slabs
    from mxfp4conv.kernels.requant_triton import requant_rows

    assert w.global_rows is not None
    lead, kh = tuple(w.packed.shape[:-1]), int(w.packed.shape[-1])
    k = 2 * kh
    dev = torch.device(device)
    with torch.cuda.device(dev):
        p = w.packed.reshape(-1, kh).to(dev)
        sc = e4m3_bits(w.scales).reshape(-1, k // 16).to(dev)
        g = w.global_rows.reshape(-1).float().to(dev)
        po, so, st = requant_rows(p, sc, g, w.global_is_divisor, rule)
        row_max = torch.amax(torch.bitwise_and(sc, 0x7F), dim=1).cpu().view(lead)
        if keep:
            host_st = st.cpu()
            problem = validate_nvfp4_scales(w.scales, w.global_rows, divisor=w.global_is_divisor, row_max=row_max)
            if problem is not None:
                raise ValueError(f"invalid NVFP4 input: {problem}")
            stats = RequantStats.from_row_stats(host_st, k // MX_BLOCK, keep_rows)
            return FP4Weight("mxfp4", po.view(*lead, kh), so.view(*lead, k // MX_BLOCK)), stats
        # one buffer: row statistics first (8-byte aligned), then codes, then scales
        n_st, n_p, n_s = st.numel() * 8, po.numel(), so.numel()
        slab = host_slabs().take(n_st + n_p + n_s)
        host_st = slab[:n_st].view(torch.float64).view(st.shape)
        host_p = slab[n_st:n_st + n_p].view(po.shape)
        host_s = slab[n_st + n_p:].view(so.shape)
        for dst, src in ((host_st, st), (host_p, po), (host_s, so)):
            dst.copy_(src)
    problem = validate_nvfp4_scales(w.scales, w.global_rows, divisor=w.global_is_divisor, row_max=row_max)
    if problem is not None:
        raise ValueError(f"invalid NVFP4 input: {problem}")
    stats = RequantStats.from_row_stats(host_st, k // MX_BLOCK, keep_rows)
    return FP4Weight("mxfp4", host_p.view(*lead, kh), host_s.view(*lead, k // MX_BLOCK)), stats


def requant_nvfp4_to_mxfp4(
    w: FP4Weight,
    rule: ScaleRule = ScaleRule.MSE,
    device: str = "cpu",
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    keep_on_device: bool = False,
    keep_rows: bool = False,
) -> tuple[FP4Weight, RequantStats]:
    """Requantize an NVFP4 weight ``[..., N, K]`` to MXFP4, ``chunk_rows`` rows at a time.

    Leading dims and N are flattened into rows; each chunk goes through ``requant_rows_cpu`` or, when
    ``device`` starts with "cuda", on the GPU: whole when it fits there (``fits_on_device``; the input
    may already be on the device), else ``mxfp4conv.kernels.requant_triton.requant_nvfp4_gpu_chunks``
    (chunks of at least ``GPU_MIN_CHUNK_ROWS`` rows stream through the device; results in pinned host memory). Raises ``ValueError`` on invalid input. Returns the MXFP4 weight
    (uint8 packed ``[..., N, K/2]``, E8M0 scales ``[..., N, K/32]``, on the CPU) and the statistics.
    ``keep_on_device``: a
    weight requantized whole on a GPU returns its results there (the same bytes, not copied back).
    ``keep_rows``: the statistics keep their rows, so that an earlier group of the same weight's experts
    can be continued with them (``RequantStats.then``).
    """
    if w.quant != "nvfp4" or w.global_rows is None:
        raise ValueError("requant_nvfp4_to_mxfp4 needs an NVFP4 weight with global_rows")
    if chunk_rows < 1:
        raise ValueError("chunk_rows must be >= 1")
    rule = ScaleRule(rule)
    lead, kh = tuple(w.packed.shape[:-1]), int(w.packed.shape[-1])
    k = 2 * kh
    if k % MX_BLOCK:
        raise ValueError(f"K={k} is not a multiple of {MX_BLOCK}")
    if device.startswith("cuda"):
        if w.packed.numel() and fits_on_device(w.packed.numel() + w.scales.numel(), device):
            return _requant_resident(w, rule, device, keep_on_device, keep_rows)
        from mxfp4conv.kernels.requant_triton import requant_nvfp4_gpu_chunks

        # H2D, kernel and D2H of row chunks overlap on three streams; outputs land in pinned memory.
        # The scales are validated after the run from the row maxima the device computed (the
        # kernel is harmless on invalid input; nothing is returned before the check)
        row_max = torch.empty(tuple(w.scales.shape[:-1]), dtype=torch.uint8)
        p, sc, st = requant_nvfp4_gpu_chunks(w.packed.contiguous(), w.scales.contiguous(),
                                             w.global_rows.float().contiguous(), w.global_is_divisor, rule,
                                             device=device, chunk_rows=max(chunk_rows, GPU_MIN_CHUNK_ROWS),
                                             scale_row_max=row_max)
        problem = validate_nvfp4_scales(w.scales, w.global_rows, divisor=w.global_is_divisor, row_max=row_max)
        if problem is not None:
            raise ValueError(f"invalid NVFP4 input: {problem}")
        stats = RequantStats.from_row_stats(st.reshape(-1, st.shape[-1]), k // MX_BLOCK, keep_rows)
        return FP4Weight("mxfp4", p, sc), stats
    problem = validate_nvfp4_scales(w.scales, w.global_rows, divisor=w.global_is_divisor)
    if problem is not None:
        raise ValueError(f"invalid NVFP4 input: {problem}")
    packed = w.packed.reshape(-1, kh)
    scales = w.scales.reshape(-1, k // 16)
    grows = w.global_rows.reshape(-1).float()
    r = packed.shape[0]
    stats = RequantStats(keep_rows=keep_rows)
    out = torch.empty(r, kh, dtype=torch.uint8)
    scales_out = torch.empty(r, k // MX_BLOCK, dtype=torch.uint8)
    n_threads = int(os.environ.get("MXFP4CONV_CPU_THREADS", "0")) or torch.get_num_threads()
    # chunks write straight into the weight's outputs, on one pool of workers for all of them
    with ThreadPoolExecutor(max(1, n_threads)) as pool:
        for r0 in range(0, r, chunk_rows):
            r1 = min(r, r0 + chunk_rows)
            st = torch.zeros(r1 - r0, 5, dtype=torch.float64)
            requant_rows_cpu(packed[r0:r1], scales[r0:r1], grows[r0:r1], w.global_is_divisor, rule,
                             threads=n_threads, into=(out[r0:r1], scales_out[r0:r1], st), pool=pool)
            stats.add_rows(st, k // MX_BLOCK)
    mx = FP4Weight("mxfp4", out.view(*lead, kh), scales_out.view(*lead, k // MX_BLOCK))
    return mx, stats
