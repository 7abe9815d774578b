"""NVFP4 -> MXFP4 requantization (docs/NUMERICS.md), chunked, with per-tensor statistics.

Row-level contract shared by the CPU path (``requant_rows_cpu``) and the GPU kernel
(``mxfp4conv.kernels.requant_triton.requant_rows``), which must agree byte for byte::

    requant_rows(packed [R, K/2] uint8, scales_e4m3 [R, K/16] float8_e4m3fn (or uint8 bits),
                 global_rows [R] float32, divisor: bool, rule: ScaleRule)
        -> (packed_out [R, K/2] uint8, scales_out [R, K/32] uint8 (E8M0),
            row_stats [R, 5] float64 = (sq_err, signal, max_abs_err, clipped_blocks, exact_blocks))

i.e. ``quantize_mxfp4_with_stats(dequantize_nvfp4(...), rule)`` with the block statistics folded per
row: sq_err / signal summed sequentially over the row's blocks, max_abs_err the max, the two counts.

The CPU path never expands a tensor to fp32: within a 16-element NVFP4 block every value is one of 8
magnitudes ``round(e2m1[m] * s * g)`` (sign-symmetric), so all float work (scale choice, E2M1 rounding,
float64 errors) runs on per-block tables of 8 entries per 16 weights. Per weight it only builds an
index, gathers the float64 terms that the contract sums sequentially over the 32 positions
(``cumsum`` on CPU is a sequential scan), and gathers the new code.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from mxfp4conv.canonical import FP4Weight
from mxfp4conv.formats.fp4 import E2M1_POS_VALUES, F4_E2M1_MAX, e4m3_decode, pow2_float32, pow2_float64
from mxfp4conv.formats.mxfp4 import (
    MX_BLOCK,
    ScaleRule,
    quantize_mxfp4_with_stats,
    rceil_exponent,
    scale_exponent,
)
from mxfp4conv.formats.nvfp4 import dequantize_nvfp4, validate_nvfp4_scales

__all__ = [
    "RequantStats",
    "requant_nvfp4_to_mxfp4",
    "requant_rows_cpu",
    "requant_rows_reference",
]

ROW_STATS = ("sq_err", "signal", "max_abs_err", "clipped_blocks", "exact_blocks")
DEFAULT_CHUNK_ROWS = 4096
_SLAB_WEIGHTS = 1 << 17  # weights per CPU work item: keeps the tables and gathers cache-resident


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

    @property
    def sqnr_db(self) -> float | None:
        """``10 log10(signal / sq_err)``; None when sq_err == 0 (exact)."""
        if self.sq_err == 0:
            return None
        if self.signal == 0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.sq_err)

    @classmethod
    def from_row_stats(cls, row_stats: torch.Tensor, blocks_per_row: int) -> RequantStats:
        """Fold ``[R, 5]`` row statistics in row order."""
        out = cls()
        out.add_rows(row_stats, blocks_per_row)
        return out

    def add_rows(self, row_stats: torch.Tensor, blocks_per_row: int) -> None:
        """Continue the fold with more rows ``[R, 5]`` (in row order, after those already added)."""
        rs = row_stats.double().cpu()
        self.blocks += int(rs.shape[0]) * blocks_per_row
        self.sq_err = _seq_fold(self.sq_err, rs[:, 0])
        self.signal = _seq_fold(self.signal, rs[:, 1])
        if rs.shape[0]:
            self.max_abs_err = max(self.max_abs_err, float(rs[:, 2].max()))
        self.clipped_blocks += int(rs[:, 3].sum())
        self.exact_blocks += int(rs[:, 4].sum())

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


def _row_stats(
    err: torch.Tensor, sig: torch.Tensor, mx: torch.Tensor, clipped: torch.Tensor, exact: torch.Tensor
) -> torch.Tensor:
    """Per-block [r, NB] -> [r, 5] float64 (sequential sums over the row's blocks)."""
    return torch.stack(
        (
            err.cumsum(1)[:, -1],
            sig.cumsum(1)[:, -1],
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
    """The row-level contract written as the plain composition (slow, any device): dequantize the
    whole ``[R, K]`` slab to float32, quantize it elementwise. Same signature/results as
    ``requant_rows_cpu``."""
    k = _check_rows(packed, scales_e4m3, global_rows)
    x = dequantize_nvfp4(packed, scales_e4m3, global_rows, divisor=divisor)
    out, scales, st = quantize_mxfp4_with_stats(x, rule)
    if k == 0:
        return out, scales, torch.zeros(packed.shape[0], 5, dtype=torch.float64)
    return out, scales, _row_stats(st.sq_err, st.signal, st.max_abs_err, st.clipped, st.exact)


# ----------------------------------------------------------------------------- CPU fast path
_POS8 = torch.tensor(E2M1_POS_VALUES, dtype=torch.float32)
_base_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _base_index(nb16: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [nb16, 8] table offsets of the low / high nibble of each byte; cached per size.

    Tables are [nb, 16] = (32-block, half * 8 + magnitude), i.e. 8 entries per 16-block."""
    t = _base_cache.get(nb16)
    if t is None:
        base = (torch.arange(nb16, dtype=torch.int32) * 8)[:, None].expand(nb16, 8).contiguous()
        t = (base, base)
        if len(_base_cache) > 16:
            _base_cache.clear()
        _base_cache[nb16] = t
    return t


def _grid_round(q: torch.Tensor) -> torch.Tensor:
    """q >= 0 float32 (< 2^100) -> the E2M1 magnitude it encodes to (RNE, ties to even, saturating).

    Adds and subtracts ``c = 2^(max(floor(log2 q), 0) + 22)``, whose ulp is the E2M1 step of q's
    binade, so the float32 add rounds to the grid with ties to even; then saturates at 6.
    """
    c = ((q.view(torch.int32) & 0x7F800000).clamp_(min=0x3F800000) + (22 << 23)).view(torch.float32)
    return ((q + c) - c).clamp_(max=F4_E2M1_MAX)


def _grid_code(r: torch.Tensor) -> torch.Tensor:
    """E2M1 grid magnitude (float32 in {0, .5, 1, 1.5, 2, 3, 4, 6}) -> code 0..7 (uint8)."""
    hi = r.view(torch.int32) >> 22  # 0, 252 (0.5), 254..259 (1..6)
    return ((hi - 251).clamp_(min=0) - (hi >= 254).to(torch.int32)).to(torch.uint8)


def _cand_tab(at: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables [nb, 16] for exponents e [nb]: grid magnitudes (float32) and squared errors (float64).

    ``at - r * 2^e`` is exact in float32 (Sterbenz: r * 2^e is 0 or within a factor 2 of at, and
    never overflows for validated input), so its float64 square is exact.
    """
    r = _grid_round(at * pow2_float32(-e)[:, None])
    d = (at - r * pow2_float32(e)[:, None]).double()
    return r, d.mul_(d)


def _gather(tab: torch.Tensor, idx: torch.Tensor, nb: int) -> torch.Tensor:
    """Per-position terms [nb, 32] of a table [nb, 16] (idx: int32 [nb * 32] flat table indices)."""
    return tab.view(-1).index_select(0, idx).view(nb, 32)


def _seq_sum(terms: torch.Tensor) -> torch.Tensor:
    """[nb, 32] -> [nb]: the sum over positions 0..31 in order (CPU cumsum is a sequential scan)."""
    return terms.cumsum(1)[:, -1]


def _slab(
    packed: torch.Tensor, s: torch.Tensor, g: torch.Tensor, divisor: bool, rule: ScaleRule
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One work item: packed [r, K/2], decoded block scales s [r, K/16] f32, g [r] f32."""
    r, kh = packed.shape
    nb, nb16 = r * kh // 16, r * kh // 8
    ga = g.abs()[:, None, None]
    xt = _POS8 * s.abs()[..., None]  # [r, K/16, 8], exact
    at = (xt / ga if divisor else xt * ga).view(nb, 16)  # |x| by (block, half * 8 + magnitude)
    neg = (torch.signbit(s) ^ torch.signbit(g)[:, None]).view(nb16, 1)
    p16 = packed.view(nb16, 8)
    lo, hi = p16 & 7, (p16 >> 4) & 7
    mm = torch.maximum(lo.amax(1), hi.amax(1))
    amax = at.view(nb16, 8).gather(1, mm.long()[:, None]).view(nb, 2).amax(1)
    zero = amax == 0
    idx = torch.empty(nb16, 8, 2, dtype=torch.int32)
    b_lo, b_hi = _base_index(nb16)
    torch.add(b_lo, lo, out=idx[..., 0])
    torch.add(b_hi, hi, out=idx[..., 1])
    flat = idx.view(-1)
    if rule is ScaleRule.MSE:
        er = rceil_exponent(amax)
        ea = torch.where(zero, 0, er.clamp(-127, 127))
        eb = torch.where(zero, 0, (er - 1).clamp(-127, 127))
        ra, ta = _cand_tab(at, ea)
        rb, tb = _cand_tab(at, eb)
        ga, gb = _gather(ta, flat, nb), _gather(tb, flat, nb)
        err_a, err_b = _seq_sum(ga), _seq_sum(gb)
        pick = err_b < err_a
        e = torch.where(pick, eb, ea)
        err, mx = torch.where(pick, err_b, err_a), torch.where(pick, gb.amax(1), ga.amax(1))
        rtab = torch.where(pick[:, None], rb, ra)
    else:
        e = scale_exponent(amax, rule)
        rtab, t = _cand_tab(at, e)
        gt = _gather(t, flat, nb)
        err, mx = _seq_sum(gt), gt.amax(1)
    a64 = at.double()
    sig = _seq_sum(_gather(a64.mul_(a64), flat, nb))
    codes = _grid_code(rtab).view(-1).index_select(0, flat).view(nb16, 8, 2)
    signs = (p16 & 0x88) ^ (neg.to(torch.uint8) * 0x88)
    out = (codes[..., 0] | (codes[..., 1] << 4)) | signs
    clipped = amax.double() * pow2_float64(-e) > F4_E2M1_MAX
    nbr = nb // r
    stats = _row_stats(
        err.view(r, nbr), sig.view(r, nbr), mx.view(r, nbr), clipped.view(r, nbr), (err == 0).view(r, nbr)
    )
    stats[:, 2].sqrt_()  # sqrt(fl(d*d)) == |d| in binary floating point
    return out.view(r, kh), (e + 127).to(torch.uint8).view(r, nbr), stats


@contextmanager
def _intra_op_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def requant_rows_cpu(
    packed: torch.Tensor,
    scales_e4m3: torch.Tensor,
    global_rows: torch.Tensor,
    divisor: bool,
    rule: ScaleRule,
    *,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU requant of rows; byte-identical to ``requant_rows_reference`` and the GPU kernel.

    ``packed`` uint8 ``[R, K/2]``, ``scales_e4m3`` float8_e4m3fn / uint8 bits ``[R, K/16]``,
    ``global_rows`` float32 ``[R]`` -> (``packed_out`` uint8 ``[R, K/2]``, ``scales_out`` uint8
    ``[R, K/32]``, ``row_stats`` float64 ``[R, 5]`` = (sq_err, signal, max_abs_err, clipped_blocks,
    exact_blocks)). Inputs must be valid (``validate_nvfp4_scales``). Work is split into row slabs of
    ~128K weights run on ``threads`` worker threads (default: torch's intra-op thread count), each
    with single-threaded torch ops.
    """
    rule = ScaleRule(rule)
    k = _check_rows(packed, scales_e4m3, global_rows)
    r = packed.shape[0]
    out = torch.empty_like(packed)
    scales_out = torch.empty(r, k // MX_BLOCK, dtype=torch.uint8)
    row_stats = torch.zeros(r, 5, dtype=torch.float64)
    if r == 0 or k == 0:
        return out, scales_out, row_stats
    s = e4m3_decode(scales_e4m3)
    g = global_rows.float()
    step = max(1, _SLAB_WEIGHTS // k)

    def work(r0: int) -> None:
        r1 = min(r, r0 + step)
        o, sc, st = _slab(packed[r0:r1].contiguous(), s[r0:r1], g[r0:r1], divisor, rule)
        out[r0:r1], scales_out[r0:r1], row_stats[r0:r1] = o, sc, st

    n_threads = threads or int(os.environ.get("MXFP4CONV_CPU_THREADS", "0")) or torch.get_num_threads()
    starts = range(0, r, step)
    with _intra_op_threads(1):  # parallelism comes from the slabs, never from OpenMP inside an op
        if n_threads <= 1 or len(starts) == 1:
            for r0 in starts:
                work(r0)
        else:
            with ThreadPoolExecutor(min(n_threads, len(starts))) as pool:
                list(pool.map(work, starts))
    return out, scales_out, row_stats


def _to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    return t.to(device)


def requant_nvfp4_to_mxfp4(
    w: FP4Weight,
    rule: ScaleRule = ScaleRule.MSE,
    device: str = "cpu",
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[FP4Weight, RequantStats]:
    """Requantize an NVFP4 weight ``[..., N, K]`` to MXFP4, ``chunk_rows`` rows at a time.

    Leading dims and N are flattened into rows; each chunk goes through ``requant_rows_cpu`` or, when
    ``device`` starts with "cuda", ``mxfp4conv.kernels.requant_triton.requant_rows`` (chunks are moved
    there and the results back). Raises ``ValueError`` on invalid input. Returns the MXFP4 weight
    (uint8 packed ``[..., N, K/2]``, E8M0 scales ``[..., N, K/32]``, on the CPU) and the statistics.
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
    problem = validate_nvfp4_scales(w.scales, w.global_rows, divisor=w.global_is_divisor)
    if problem is not None:
        raise ValueError(f"invalid NVFP4 input: {problem}")
    packed = w.packed.reshape(-1, kh)
    scales = w.scales.reshape(-1, k // 16)
    grows = w.global_rows.reshape(-1).float()
    r = packed.shape[0]
    out = torch.empty(r, kh, dtype=torch.uint8)
    scales_out = torch.empty(r, k // MX_BLOCK, dtype=torch.uint8)
    stats = RequantStats()
    use_cuda = device.startswith("cuda")
    if use_cuda:
        from mxfp4conv.kernels.requant_triton import requant_rows
    for r0 in range(0, r, chunk_rows):
        r1 = min(r, r0 + chunk_rows)
        args = (packed[r0:r1], scales[r0:r1], grows[r0:r1])
        if use_cuda:
            p, sc, st = requant_rows(*(_to_device(a, device) for a in args), w.global_is_divisor, rule)
        else:
            p, sc, st = requant_rows_cpu(*args, w.global_is_divisor, rule)
        out[r0:r1], scales_out[r0:r1] = p.cpu(), sc.cpu()
        stats.add_rows(st, k // MX_BLOCK)
    mx = FP4Weight("mxfp4", out.view(*lead, kh), scales_out.view(*lead, k // MX_BLOCK))
    return mx, stats
