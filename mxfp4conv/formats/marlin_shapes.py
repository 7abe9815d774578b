"""Marlin's tile rules on sizes alone (MARLIN.md §4): torch-free, so planning and ``inspect``
can decide whether a checkpoint fits Marlin without importing torch. Re-exported by
:mod:`mxfp4conv.formats.marlin`."""

from __future__ import annotations

import math

__all__ = ["check_marlin_shape", "gptoss_marlin_padded_sizes", "marlin_padded_nk"]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def check_marlin_shape(n: int, k: int, group: int) -> str | None:
    """None if an ``[N, K]`` FP4 weight with group ``g`` fits Marlin unpadded, else the failed rule (§4)."""
    if n <= 0 or k <= 0 or group <= 0:
        return f"sizes must be positive (N={n}, K={k}, group={group})"
    if k % group:
        return f"K % group == 0 (K={k}, group={group})"
    if not ((n % 64 == 0 and k % 128 == 0) or (n % 128 == 0 and k % 64 == 0)):
        return f"(N % 64 == 0 and K % 128 == 0) or (N % 128 == 0 and K % 64 == 0) (N={n}, K={k})"
    return None


def marlin_padded_nk(n: int, k: int, group: int) -> tuple[int, int]:
    """vLLM >= 0.24 tile padding: the cheaper of (N→x64, K→x lcm(128,g)) and (N→x128, K→x lcm(64,g))."""
    cands = (
        (_round_up(n, 64), _round_up(k, math.lcm(128, group))),
        (_round_up(n, 128), _round_up(k, math.lcm(64, group))),
    )
    return min(cands, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def gptoss_marlin_padded_sizes(hidden: int, intermediate_per_rank: int) -> tuple[int, int]:
    """GPT-OSS Marlin MoE sizes (§4): ``(Hp, Ip) = (round_up(H, 256), round_up(I, 128))``."""
    return _round_up(hidden, 256), _round_up(intermediate_per_rank, 128)
