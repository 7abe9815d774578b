"""The CPU requant of rows (``requant_rows_cpu``): byte for byte the row-level contract of
``requant_stats`` (``requant_rows_reference``) and of the GPU kernel.

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

import functools
import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from mxfp4conv.formats.fp4 import E2M1_POS_VALUES, F4_E2M1_MAX, e4m3_bits, e4m3_decode
from mxfp4conv.formats.mxfp4 import MX_BLOCK, ScaleRule, rceil_exponent, scale_exponent
from mxfp4conv.kernels import requant_native
from mxfp4conv.numerics.requant_stats import check_rows, row_stats

__all__ = ["requant_rows_cpu"]

_SLAB_WEIGHTS = 1 << 17  # weights per work item of the torch path: keeps its tables cache-resident
# weights per call of the compiled kernel at most (~10 ms of one core): each call takes the GIL to
# start and to return, and many cores handing it over every fraction of a millisecond leave it idle
_NATIVE_SLAB_WEIGHTS = 1 << 22


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
    f32, i32, u8 = torch.float32, torch.int32, torch.uint8
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
    ebits = torch.bitwise_and(at.view(i32), 0x7F800000, out=ws("ebits", (nb, 16), i32))
    idx = ws("idx", (nb16, 8, 2), i32)  # flat table index of every element, in element order
    base = _base_index(nb16)
    torch.add(base, lo, out=idx[..., 0])
    torch.add(base, hi, out=idx[..., 1])
    flat = idx.view(-1)
    counts = torch.bincount(flat, minlength=nb * 16).view(nb, 16)  # elements per (block, group)
    cnt = ws("cnt", (nb, 16), f32).copy_(counts)
    e, qtab, rtab, dtab = _choose(at, ebits, amax, cnt, rule, ws)
    _write_codes(p16, lo, rtab, flat, s, g, ws, out[0].view(nb16, 8))
    out[1].copy_(e.view(r, -1))
    _write_stats(e, qtab, dtab, cnt, counts != 0, amax, r, ws, out[2])


def _choose(at: torch.Tensor, ebits: torch.Tensor, amax: torch.Tensor, cnt: torch.Tensor, rule: ScaleRule,
            ws: _Workspace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each block's scale byte and its candidate's tables (q, r, d), by ``rule``."""
    if rule is not ScaleRule.MSE:
        e = scale_exponent(amax, rule) + 127
        return (e, *_cand_tab(at, ebits, e, ws, "a"))
    nb = at.shape[0]
    zero = amax == 0
    er = rceil_exponent(amax) + 127  # scale bytes of the two candidates, clamped; zero blocks 127
    ea = torch.where(zero, 127, er.clamp(0, 254))
    eb = torch.where(zero, 127, (er - 1).clamp_(0, 254))
    qa, ra, da = _cand_tab(at, ebits, ea, ws, "a")
    qb, rb, db = _cand_tab(at, ebits, eb, ws, "b")
    pick = _mse_pick(qb, ra, rb, ws("cn64", (nb, 16), torch.float64).copy_(cnt), ws) & (eb != ea)
    p2 = pick[:, None]
    return (torch.where(pick, eb, ea), torch.where(p2, qb, qa), torch.where(p2, rb, ra, out=ws("rt", (nb, 16), torch.float32)),
            torch.where(p2, db, da))


def _write_codes(p16: torch.Tensor, lo: torch.Tensor, rtab: torch.Tensor, flat: torch.Tensor, s: torch.Tensor,
                 g: torch.Tensor, ws: _Workspace, o: torch.Tensor) -> None:
    """The packed codes into ``o`` [nb16, 8]: each element's magnitude from its group's rounded value,
    its sign from the source (flipped by negative block / global scales)."""
    u8 = torch.uint8
    nb, nb16 = rtab.shape[0], p16.shape[0]
    key = torch.bitwise_right_shift(rtab.view(torch.int32), 22, out=ws("c", (nb, 16), torch.int32))
    ctab = torch.index_select(_CODE_LUT, 0, key.view(-1), out=ws("ct", (nb * 16,), u8))
    codes = torch.index_select(ctab, 0, flat, out=ws("co", (nb * 32,), u8)).view(nb16, 8, 2)
    torch.bitwise_left_shift(codes[..., 1], 4, out=o)
    o |= codes[..., 0]
    o |= lo.copy_(p16).bitwise_and_(0x88)  # the sign bits
    neg = torch.signbit(s) ^ torch.signbit(g)[:, None]
    if bool(neg.any()):
        o ^= neg.view(nb16, 1).to(u8) * 0x88


def _write_stats(e: torch.Tensor, qtab: torch.Tensor, dtab: torch.Tensor, cnt: torch.Tensor, present: torch.Tensor,
                 amax: torch.Tensor, r: int, ws: _Workspace, out: torch.Tensor) -> None:
    """The rows' statistics (the chosen candidate's error and signal, max error, clipped and exact
    blocks) into ``out`` [r, 5]."""
    err = _fold32(dtab, cnt, ws, "e")
    sig = _fold32(qtab, cnt, ws, "s")
    mx = _present_max(dtab.abs(), present)
    s4 = _SQ64.index_select(0, e)
    clipped = amax > _SIX32.index_select(0, e)  # amax * 2^-e > 6, exactly
    nbr = e.shape[0] // r
    out.copy_(
        row_stats(
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
    k = check_rows(packed, scales_e4m3, global_rows)
    r = packed.shape[0]
    out, scales_out, row_stats = results = _results(into, r, k)
    if r == 0 or k == 0:
        return out, scales_out, row_stats
    g = global_rows.float().contiguous()
    n_threads = threads or int(os.environ.get("MXFP4CONV_CPU_THREADS", "0")) or torch.get_num_threads()
    kern = requant_native.load()
    if kern is not None:
        # large calls, yet at least eight per worker so that the workers finish together
        step = max(1, min(_NATIVE_SLAB_WEIGHTS // k, -(-r // (8 * max(1, n_threads)))))
        work = _native_work(kern, packed, scales_e4m3, g, divisor, rule, results, step)
    else:
        step = max(1, _SLAB_WEIGHTS // k)
        work = _torch_work(packed, scales_e4m3, g, divisor, rule, results, step)
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


def _results(into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, r: int,
             k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three result tensors: ``into``, checked, or new ones (row-major, whatever the input's strides)."""
    if into is None:
        return (torch.empty(r, k // 2, dtype=torch.uint8), torch.empty(r, k // MX_BLOCK, dtype=torch.uint8),
                torch.zeros(r, 5, dtype=torch.float64))
    if tuple(tuple(t.shape) for t in into) != ((r, k // 2), (r, k // MX_BLOCK), (r, 5)) \
            or not all(t.is_contiguous() for t in into):
        raise ValueError("into: tensors must be contiguous and of the result shapes")
    return into


def _native_work(kern: Any, packed: torch.Tensor, scales_e4m3: torch.Tensor, g: torch.Tensor, divisor: bool,
                 rule: ScaleRule, results: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 step: int) -> Callable[[int], None]:
    """The slab starting at a row, by the compiled kernel (which decodes the E4M3 bits itself)."""
    r, kh = packed.shape[0], packed.shape[1]
    packed = packed.contiguous()
    bits = e4m3_bits(scales_e4m3).contiguous()
    lut = _e4m3_values()
    keep = (packed, bits, lut)  # alive while the workers read their addresses
    addrs = (packed.data_ptr(), bits.data_ptr(), lut.data_ptr(), g.data_ptr())
    outs = tuple(t.data_ptr() for t in results)

    def work(r0: int) -> None:
        assert keep
        kern.rows(*addrs, r0, min(r, r0 + step), kh, divisor, rule.value, *outs)

    return work


def _torch_work(packed: torch.Tensor, scales_e4m3: torch.Tensor, g: torch.Tensor, divisor: bool, rule: ScaleRule,
                results: tuple[torch.Tensor, torch.Tensor, torch.Tensor], step: int) -> Callable[[int], None]:
    """The slab starting at a row, with single-threaded torch ops (one workspace per worker thread)."""
    r = packed.shape[0]
    local = threading.local()

    def work(r0: int) -> None:
        ws = getattr(local, "ws", None)
        if ws is None:
            ws = local.ws = _Workspace()
        r1 = min(r, r0 + step)
        out, scales_out, row_stats = results
        _slab(packed[r0:r1].contiguous(), e4m3_decode(scales_e4m3[r0:r1]).contiguous(), g[r0:r1], divisor, rule,
              ws, (out[r0:r1], scales_out[r0:r1], row_stats[r0:r1]))

    return work
