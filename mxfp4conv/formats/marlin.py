"""FP4 Marlin layout (vLLM ``gptq_marlin_repack`` + scale / bias permutations), pure torch: the weight
repack (§1), padding (§4) and the whole-layer helpers here, the scale and bias permutations (§2, §3) in
``formats/marlin_scales.py``.

Spec: ``docs/MARLIN.md``; byte reference: ``tests/data/golden_marlin`` (vLLM 0.33.0). Every function is
device-agnostic and uses only reshapes, permutes, small cached index tables and integer / bit ops,
so CPU and CUDA produce identical bytes. Leading dims (e.g. the expert dim E) are batch dims: a
``[E, N, K/2]`` input is transformed per expert exactly like a dense ``[N, K/2]`` one.

Sizes: N = out features, K = in features, g = group (32 MXFP4, 16 NVFP4).

Each permutation sits beside its inverse (verify decodes with them), so a change to one is never made
without the other. The little-endian check is ``marlin_scales``', imported first.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import torch

from mxfp4conv.formats.marlin_scales import (
    as_u8,
    mxfp4_scales_to_marlin,
    nvfp4_global_to_marlin,
    nvfp4_rescale_factor,
    nvfp4_scales_to_marlin,
    permute_bias,
)
from mxfp4conv.formats.marlin_shapes import (  # the tile rules, torch-free (planning)
    check_marlin_shape,
    gptoss_marlin_padded_sizes,
    marlin_padded_nk,
)

__all__ = [
    "PaddedFP4",
    "check_marlin_shape",
    "gptoss_marlin_padded_sizes",
    "marlin_padded_nk",
    "pad_dense_fp4",
    "prepare_dense_fp4",
    "prepare_moe_fp4",
    "repack_fp4_weight",
    "unrepack_fp4_weight",
]

# §1 in three passes: (1) cut the input into tiles (16 k x 64 n, or 32 x 32 for a8) with a permute
# of 8-byte units; (2) exchange nibbles between byte pairs (bit ops on int64) so that every output
# byte exists somewhere in the tile; (3) gather each tile's 512 bytes into its 128 words.
# 16-bit tile: row r = 16j + 8nh + ta (64 rows), byte c = 4kh + tb (8 bytes). Pass 2 turns bytes
# (c, c + 4) into (lo|lo<<4, hi|hi<<4); word 4(4ta + tb) + j then takes bytes (nh, kh) = (p % 2, p // 2).
# a8 tile: row 8j + ta (32 rows), 16 bytes; pass 2 pairs bytes (c, c + 8); word bytes 2tb + (0, 8, 1, 9).
_LO_NIBBLES = 0x0F0F0F0F0F0F0F0F


@lru_cache(maxsize=8)
def _tile_gather(a8: bool, inverse: bool, device: torch.device) -> torch.Tensor:
    """int64[512]: tile byte feeding output byte ``p`` (word ``p // 4``, byte ``p % 4``), or its inverse."""
    ta, tb, j, b = (torch.arange(n, device=device) for n in (8, 4, 4, 4))
    ta, tb, j = ta[:, None, None, None], tb[:, None, None], j[:, None]
    if a8:
        idx = (8 * j + ta) * 16 + 2 * tb + torch.tensor([0, 8, 1, 9], device=device)[b]
    else:
        idx = (16 * j + 8 * (b % 2) + ta) * 8 + 4 * (b // 2) + tb
    idx = idx.reshape(512)
    return torch.argsort(idx) if inverse else idx


def _pair_nibbles_(tiles: torch.Tensor, a8: bool) -> None:
    """In place on uint8 ``[T, 512]`` tiles: bytes (x, y) -> (lo x | lo y << 4, hi x | hi y << 4).

    An exchange of nibbles (a delta swap), hence its own inverse. Pairs are (c, c + 4) within each
    8-byte row (16-bit tiles) or (c, c + 8) within each 16-byte row (a8 tiles).
    """
    if a8:
        u = tiles.view(torch.int64).view(-1, 2)
        lo, hi = u[:, 0], u[:, 1]
        t = torch.bitwise_right_shift(lo, 4)
        t ^= hi
        t &= _LO_NIBBLES
        hi ^= t
        t <<= 4  # may reach the sign bit: torch shifts as unsigned (wraps) on CPU and CUDA
        lo ^= t
        return
    x = tiles.view(torch.int64)
    t = torch.bitwise_right_shift(x, 28)
    t ^= x
    t &= 0xF0F0F0F0
    x ^= t
    t <<= 28
    x ^= t


def _tile_shape(n: int, k: int, a8: bool) -> tuple[int, int, int, int]:
    """(n tiles, rows per tile, k tiles, int64 units per tile row) of a ``[N, K/2]`` byte matrix."""
    if a8:
        if n % 32 or k % 32:
            raise ValueError(f"a8 repack needs N % 32 == 0 and K % 32 == 0, got N={n}, K={k}")
        return n // 32, 32, k // 32, 2
    if n % 64 or k % 16:
        raise ValueError(f"repack needs N % 64 == 0 and K % 16 == 0, got N={n}, K={k}")
    return n // 64, 64, k // 16, 1


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.storage_offset() % 8 == 0 else t.clone()


def repack_fp4_weight(packed: torch.Tensor, *, a8: bool = False) -> torch.Tensor:
    """``gptq_marlin_repack(num_bits=4)`` of a checkpoint FP4 weight (MARLIN.md §1).

    ``packed``: uint8 ``[..., N, K/2]`` (low nibble = even k). Returns int32 ``[..., K/16, 2N]``:
    16x64 tiles (``a8=False``) or the FP8-activation 32x32 tiles (``a8=True``).
    """
    *lead, n, k2 = packed.shape
    nt, rows, kt, units = _tile_shape(n, 2 * k2, a8)
    x = _aligned(as_u8(packed)).view(torch.int64).reshape(math.prod(lead), nt, rows, kt, units)
    tiles = x.permute(0, 3, 1, 2, 4).clone(memory_format=torch.contiguous_format)  # never the input
    tiles = tiles.view(torch.uint8).reshape(-1, 512)
    _pair_nibbles_(tiles, a8)
    idx = _tile_gather(a8, False, tiles.device)
    words = torch.gather(tiles, 1, idx.expand(tiles.shape[0], 512)).view(torch.int32)
    return words.reshape(*lead, k2 // 8, 2 * n)


def unrepack_fp4_weight(marlin: torch.Tensor, n: int, k: int, *, a8: bool = False) -> torch.Tensor:
    """Exact inverse of :func:`repack_fp4_weight`: int32 ``[..., K/16, 2N]`` -> uint8 ``[..., N, K/2]``."""
    *lead, rows_, cols = marlin.shape
    if (rows_, cols) != (k // 16, 2 * n) or marlin.dtype != torch.int32:
        raise ValueError(
            f"expected int32 [..., {k // 16}, {2 * n}], got {marlin.dtype} {tuple(marlin.shape)}"
        )
    nt, rows, kt, units = _tile_shape(n, k, a8)
    words = marlin.contiguous().view(torch.uint8).reshape(-1, 512)
    idx = _tile_gather(a8, True, words.device)
    tiles = torch.gather(words, 1, idx.expand(words.shape[0], 512))
    _pair_nibbles_(tiles, a8)
    x = tiles.view(torch.int64).reshape(math.prod(lead), kt, nt, rows, units).permute(0, 2, 3, 1, 4)
    return x.contiguous().view(torch.uint8).reshape(*lead, n, k // 2)


# ---- §4 shapes and padding -----------------------------------------------------------------------


class PaddedFP4(NamedTuple):
    packed: torch.Tensor  # uint8 [..., Np, Kp/2]
    scales: torch.Tensor  # [..., Np, Kp/g], input dtype
    bias: torch.Tensor | None  # [..., Np]
    n: int
    k: int
    np: int
    kp: int


def pad_dense_fp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: int,
    to: tuple[int, int] | None = None,
) -> PaddedFP4:
    """Zero-pad an FP4 weight ``[..., N, K/2]``, scales ``[..., N, K/g]`` and bias ``[..., N]`` (§4).

    Padded sizes: ``to`` = (Np, Kp) if given (GPT-OSS: (2Ip, Hp) / (Hp, Ip)), else
    :func:`marlin_padded_nk`. Zeros at the end of each dim (scale byte 0x00, bias 0).
    """
    n, k = packed.shape[-2], packed.shape[-1] * 2
    if k % group or scales.shape[-2:] != (n, k // group):
        raise ValueError(f"scales {tuple(scales.shape)} do not match N={n}, K={k}, group={group}")
    np_, kp = to if to is not None else marlin_padded_nk(n, k, group)
    if np_ < n or kp < k or kp % group or kp % 2:
        raise ValueError(f"cannot pad N={n}, K={k} to ({np_}, {kp})")
    fp = torch.nn.functional.pad
    p = fp(as_u8(packed), (0, (kp - k) // 2, 0, np_ - n))
    s = fp(as_u8(scales), (0, (kp - k) // group, 0, np_ - n)).view(scales.dtype)
    b = fp(bias, (0, np_ - n)) if bias is not None else None
    return PaddedFP4(p, s, b, n, k, np_, kp)


# ---- whole-layer helpers (what vLLM's prepare_* functions hold afterwards, §4) ------------------


def _scales_out(
    scales: torch.Tensor, quant: str, params_dtype: torch.dtype, sf: float, a8: bool
) -> torch.Tensor:
    if quant == "mxfp4":
        return mxfp4_scales_to_marlin(scales, a8=a8).view(torch.float8_e8m0fnu)
    if a8:
        raise ValueError("NVFP4 weights with FP8 activations are not supported by Marlin")
    return nvfp4_scales_to_marlin(scales, params_dtype=params_dtype, sf=sf).view(torch.float8_e4m3fn)


def prepare_dense_fp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    *,
    quant: str,
    params_dtype: torch.dtype = torch.bfloat16,
    global_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    a8: bool = False,
    pad: bool = True,
) -> dict[str, torch.Tensor]:
    """``prepare_fp4_layer_for_marlin`` of one Linear: ``{weight, weight_scale[, weight_global_scale][, bias]}``.

    ``packed`` uint8 ``[N, K/2]``; ``scales`` MXFP4 uint8/e8m0 ``[N, K/32]`` or NVFP4 e4m3
    ``[N, K/16]``; NVFP4 ``global_scale`` = float32 dequant multiplier ``[]``; ``bias`` ``[N]`` keeps its
    dtype. Unaligned shapes are zero-padded (vLLM >= 0.24) unless ``pad=False`` (then refused).
    """
    group = 32 if quant == "mxfp4" else 16
    n, k = packed.shape[-2], packed.shape[-1] * 2
    if not pad and (why := check_marlin_shape(n, k, group)):
        raise ValueError(f"unsupported Marlin shape: {why}")
    p = pad_dense_fp4(packed, scales, bias, group=group)
    sf = nvfp4_rescale_factor(p.scales, params_dtype) if quant == "nvfp4" else 1.0
    out = {
        "weight": repack_fp4_weight(p.packed, a8=a8),
        "weight_scale": _scales_out(p.scales, quant, params_dtype, sf, a8),
    }
    if quant == "nvfp4":
        if global_scale is None:
            raise ValueError("NVFP4 needs the global scale")
        out["weight_global_scale"] = nvfp4_global_to_marlin(global_scale, params_dtype=params_dtype, sf=sf)
    if p.bias is not None:
        out["bias"] = permute_bias(p.bias)
    return out


def prepare_moe_fp4(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    quant: str,
    params_dtype: torch.dtype = torch.bfloat16,
    w13_global: torch.Tensor | None = None,
    w2_global: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    a8: bool = False,
) -> dict[str, torch.Tensor]:
    """FusedMoE Marlin preparation: each expert transformed like a dense layer (MARLIN.md §4).

    ``w13`` uint8 ``[E, 2I, H/2]`` (row order kept: halves or GPT-OSS interleaved), ``w2``
    ``[E, H, I/2]``, scales ``[E, N, K/g]``, NVFP4 globals float32 ``[E]`` (dequant multipliers),
    biases ``[E, N]`` (cast to ``params_dtype``). NVFP4 ``sf`` is computed once over all experts of
    w13 and once for w2. No padding: pre-pad GPT-OSS with :func:`pad_dense_fp4` (``to=``).
    """
    group = 32 if quant == "mxfp4" else 16
    out: dict[str, torch.Tensor] = {}
    for name, w, s, gs, b in (
        ("w13", w13, w13_scale, w13_global, w13_bias),
        ("w2", w2, w2_scale, w2_global, w2_bias),
    ):
        if why := check_marlin_shape(w.shape[-2], w.shape[-1] * 2, group):
            raise ValueError(f"unsupported Marlin MoE shape for {name}: {why}")
        sf = nvfp4_rescale_factor(s, params_dtype) if quant == "nvfp4" else 1.0
        out[f"{name}_weight"] = repack_fp4_weight(w, a8=a8)
        out[f"{name}_weight_scale"] = _scales_out(s, quant, params_dtype, sf, a8)
        if quant == "nvfp4":
            if gs is None:
                raise ValueError(f"NVFP4 needs {name}_global")
            out[f"{name}_weight_scale_2"] = nvfp4_global_to_marlin(gs, params_dtype=params_dtype, sf=sf)
        if b is not None:
            out[f"{name}_bias"] = permute_bias(b, dtype=params_dtype)
    return out
