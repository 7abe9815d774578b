"""MXFP4 (OCP MX v1.0): float32 <-> 32-element blocks of E2M1 codes with one E8M0 scale each.

Implements the scale rules and block statistics of docs/NUMERICS.md ("MXFP4 quantization", "Requant
statistics") bit for bit. Everything is vectorized over blocks; the only Python loops run over the 32
positions (and 16 groups) of a block, for the fixed-order sums the contract prescribes.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

import torch

from mxfp4conv.formats.fp4 import (
    E8M0_BIAS,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    F4_E2M1_MAX,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    pack_nibbles,
    pow2_float32,
    pow2_float64,
    unpack_nibbles,
)

__all__ = [
    "MX_BLOCK",
    "ZERO_BLOCK_SCALE_BYTE",
    "BlockStats",
    "ScaleRule",
    "block_sum",
    "block_sum32",
    "dequantize_mxfp4",
    "mse_prefers_lower",
    "quantize_mxfp4",
    "quantize_mxfp4_with_stats",
    "rceil_exponent",
    "scale_exponent",
    "sequential_sum",
]

MX_BLOCK = 32  # OCP MX v1.0 sec. 5.2: k = 32 elements share one scale
ZERO_BLOCK_SCALE_BYTE = 127  # 2^0, written for all-zero blocks (NUMERICS.md)
_EVEN_ROUND = 0x200000  # aiter / torchao EVEN: round amax's mantissa at 1.75 (1 << (23 - 2))
_EXP_MASK = 0x7F800000  # exponent bits of a non-negative float32


class ScaleRule(str, Enum):
    """How the E8M0 exponent of a block is chosen (NUMERICS.md)."""

    MSE = "mse"  # per-block argmin of the squared error over {RCEIL, RCEIL - 1} (default)
    EVEN = "even"  # aiter dynamic_mxfp4_quant / torchao EVEN / compressed-tensors / Quark
    FLOOR = "floor"  # OCP MX v1.0 sec. 6.3, microxcaling
    RCEIL = "rceil"  # cuBLAS / TransformerEngine / triton_kernels ROUND_UP


class BlockStats(NamedTuple):
    """Per-block statistics, each ``[..., K/32]`` (NUMERICS.md "Block statistics").

    ``sq_err`` / ``signal``: float64 ``4^e * float32 block sum`` of ``d^2`` / ``q^2`` in the scaled
    domain (``q = |x| * 2^-e``, ``d = q - r``, ``r`` the E2M1 grid value), summed by ``block_sum32``;
    ``max_abs_err``: float64 ``2^e * max |d|``; ``clipped``: bool, ``amax * 2^-e > 6``; ``exact``:
    bool, every requantized value equals its source (``max |d| == 0``).
    """

    sq_err: torch.Tensor
    signal: torch.Tensor
    max_abs_err: torch.Tensor
    clipped: torch.Tensor
    exact: torch.Tensor


def sequential_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t [..., n]`` over the last axis strictly in order ``((t0 + t1) + t2) + ...`` -> ``[...]``,
    every add rounded to ``t``'s dtype."""
    acc = t[..., 0].clone()
    for i in range(1, t.shape[-1]):
        acc += t[..., i]
    return acc


GROUPS = 16  # group ids of ``block_sum``: 0..15


def block_sum(t: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    """Fixed-order float64 sum of ``t [..., 32]`` over a block -> ``[...]``.

    ``groups`` None: sequentially over positions 0..31 (``sequential_sum``). Otherwise ``groups``
    (integer ``[..., 32]``, values 0..15) splits the block: each group's terms are summed sequentially
    over positions, then the 16 group sums are added in group order 0..15.
    """
    if groups is None:
        return sequential_sum(t)
    return sequential_sum(_group_sums(t, groups))


def _group_sums(t: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``[..., 32]`` -> ``[..., 16]``: each group's terms summed sequentially over positions, in t's dtype."""
    onehot = groups[..., None] == torch.arange(GROUPS, device=t.device)  # [..., 32, 16]
    per_group = torch.where(onehot, t[..., None], 0.0)  # adding 0.0 is exact
    return sequential_sum(per_group.transpose(-1, -2))


def block_sum32(t: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    """The float32 block sum of the statistics (NUMERICS.md "Block statistics") of float32 terms
    ``t [..., 32]`` -> float32 ``[...]``.

    ``groups`` None: sequentially over positions 0..31 in float32. Otherwise each group's terms are
    summed in float64 sequentially over positions and rounded once to float32, then the 16 group
    values are added in float32 in group order 0..15. For NVFP4 sources every term of a group is the
    same float32 number t (its group is ``half * 8 + magnitude``), so a group's value is
    ``RN32(n * t)`` (the float64 sum ``n * t`` is exact): what every requant kernel computes.
    """
    if t.dtype != torch.float32:
        raise TypeError(f"block_sum32 expects float32 terms, got {t.dtype}")
    if groups is None:
        return sequential_sum(t)
    return sequential_sum(_group_sums(t.double(), groups).float())


def mse_prefers_lower(q_b: torch.Tensor, r_a: torch.Tensor, r_b: torch.Tensor) -> torch.Tensor:
    """MSE's decision, exact: True where RCEIL - 1 (grid values ``r_b`` of ``q_b = |x| * 2^-(e - 1)``)
    has a strictly lower squared error than RCEIL (grid values ``r_a``, in the domain of e), over the
    last axis (``[..., n]`` float32 -> bool ``[...]``); callers exclude blocks whose two exponents
    are equal (clamped).

    With ``u = q_b``, ``A = 2 r_a``, ``B = r_b`` (all in the RCEIL - 1 domain) the difference of the
    two errors is ``4^(e-1) * D``, ``D = sum (u - B)^2 - (u - A)^2 = sum (A - B) (2u - A - B)``. Every
    term is 0 unless u > 1/4 (below, A = B = 0), so u's ulp is >= 2^-25, every term is a multiple of
    2^-25 below 2^13 in magnitude, and D (in float64, in any order) is exact (NUMERICS.md).
    """
    u = q_b.double()
    a = 2.0 * r_a.double()
    b = r_b.double()
    return ((a - b) * ((u + u) - (a + b))).sum(-1) < 0


def _clamp(e: torch.Tensor) -> torch.Tensor:
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def rceil_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Unclamped RCEIL exponent: the smallest integer e with ``amax <= 6 * 2^e`` (amax > 0, finite).

    ``amax = m * 2^x`` with m in [0.5, 1) (frexp, exact incl. subnormals): e = x - 3 if m <= 0.75
    else x - 2. Returns int32 of amax's shape.
    """
    m, x = torch.frexp(amax)
    return x.to(torch.int32) - 3 + (m > 0.75).to(torch.int32)


def scale_exponent(amax: torch.Tensor, rule: ScaleRule) -> torch.Tensor:
    """Clamped block exponent for FLOOR / EVEN / RCEIL from the block amax (float32, finite, >= 0).

    Blocks with ``amax == 0`` get exponent 0 (scale byte ``ZERO_BLOCK_SCALE_BYTE``). MSE depends on
    the data, not only on amax: its candidates are ``rceil_exponent`` and that minus one.
    """
    rule = ScaleRule(rule)
    if rule is ScaleRule.FLOOR:
        _, x = torch.frexp(amax)  # floor(log2(amax)) = x - 1, exact for subnormal amax too
        e = x.to(torch.int32) - 3
    elif rule is ScaleRule.EVEN:
        ef = ((amax.view(torch.int32) + _EVEN_ROUND) & _EXP_MASK) >> 23  # a is 0, a power of 2, or inf
        e = torch.where(ef == 0, E8M0_MIN_EXP, torch.where(ef == 0xFF, E8M0_MAX_EXP, ef - 127 - 2))
    elif rule is ScaleRule.RCEIL:
        e = rceil_exponent(amax)
    else:
        raise ValueError("MSE has no amax-only exponent; use rceil_exponent for its candidates")
    return torch.where(amax == 0, 0, _clamp(e)).to(torch.int32)


def _candidate(
    a: torch.Tensor, e: torch.Tensor, groups: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """|x| [..., NB, 32] under exponents e [..., NB] -> (magnitude codes u8, q, r, d = q - r (float32,
    the scaled domain), the float32 block sum of d^2)."""
    q = a * pow2_float32(-e)[..., None]  # a power-of-two scaling: exact unless q is subnormal
    mag = e2m1_encode(q)  # a >= +0, so no sign bit
    r = e2m1_decode(mag)
    d = q - r
    return mag, q, r, d, block_sum32(d * d, groups)


def quantize_mxfp4_with_stats(
    x: torch.Tensor, rule: ScaleRule = ScaleRule.MSE, groups: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, BlockStats]:
    """float32 ``[..., K]`` (K % 32 == 0, finite) -> (packed u8 ``[..., K/2]``, E8M0 u8 ``[..., K/32]``,
    per-block ``BlockStats`` ``[..., K/32]``).

    Per block: amax = max |x|; exponent by ``rule`` (clamped to [-127, 127]; all-zero blocks 2^0);
    q = x * 2^-e; code = E2M1 RNE encode of q, sign = signbit(x). MSE tries RCEIL and RCEIL-1 (both
    clamped) and keeps RCEIL-1 only if its squared error is strictly lower, compared exactly
    (``mse_prefers_lower``). Statistics: ``BlockStats``; block sums are ``block_sum32(..., groups)``:
    sequential over positions without ``groups`` (integer ``[..., K]``, 0..15 within each block),
    grouped with them (the NVFP4 requant contract).
    """
    rule = ScaleRule(rule)
    if x.dtype != torch.float32:
        raise TypeError(f"quantize_mxfp4 expects float32, got {x.dtype}")
    k = x.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"last dim {k} is not a multiple of {MX_BLOCK}")
    xb = x.reshape(*x.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    gb = None if groups is None else groups.reshape(xb.shape)
    a = xb.abs()
    amax = a.amax(-1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("quantize_mxfp4: input has NaN or Inf")
    zero = amax == 0
    if rule is ScaleRule.MSE:
        er = rceil_exponent(amax)
        ea = torch.where(zero, 0, _clamp(er))
        eb = torch.where(zero, 0, _clamp(er - 1))
        mag_a, q_a, r_a, d_a, err_a = _candidate(a, ea, gb)
        mag_b, q_b, r_b, d_b, err_b = _candidate(a, eb, gb)
        pick = mse_prefers_lower(q_b, r_a, r_b) & (eb != ea)
        e = torch.where(pick, eb, ea)
        mag = torch.where(pick[..., None], mag_b, mag_a)
        q = torch.where(pick[..., None], q_b, q_a)
        d = torch.where(pick[..., None], d_b, d_a)
        err = torch.where(pick, err_b, err_a)
    else:
        e = scale_exponent(amax, rule)
        mag, q, _, d, err = _candidate(a, e, gb)
    codes = (mag | (torch.signbit(xb).to(torch.uint8) << 3)).reshape(x.shape)
    mx = d.abs().amax(-1)
    stats = BlockStats(
        sq_err=err.double() * pow2_float64(2 * e),
        signal=block_sum32(q * q, gb).double() * pow2_float64(2 * e),
        max_abs_err=mx.double() * pow2_float64(e),
        clipped=amax.double() * pow2_float64(-e) > F4_E2M1_MAX,
        exact=mx == 0,
    )
    return pack_nibbles(codes), (e + E8M0_BIAS).to(torch.uint8), stats


def quantize_mxfp4(x: torch.Tensor, rule: ScaleRule = ScaleRule.MSE) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[..., K]`` -> (packed u8 ``[..., K/2]``, E8M0 scales u8 ``[..., K/32]``); see
    ``quantize_mxfp4_with_stats`` for the exact rule."""
    packed, scales, _ = quantize_mxfp4_with_stats(x, rule)
    return packed, scales


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed u8 ``[..., K/2]`` + E8M0 u8 ``[..., K/32]`` -> float32 ``[..., K]`` = e2m1 * 2^(b-127)."""
    k = packed.shape[-1] * 2
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * MX_BLOCK != k:
        raise ValueError(f"scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)}")
    v = e2m1_decode(unpack_nibbles(packed)).reshape(*packed.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    return (v * e8m0_decode(scales)[..., None]).reshape(*packed.shape[:-1], k)
