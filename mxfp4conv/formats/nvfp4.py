"""NVFP4 (ModelOpt / compressed-tensors): exact dequantization and scale validation.

NUMERICS.md "NVFP4 dequantization": per 16-element block,

* ModelOpt:           ``w = (e2m1(code) * float32(e4m3 scale)) * weight_scale_2``      (multiplier)
* compressed-tensors: ``w = (e2m1(code) * float32(e4m3 scale)) / weight_global_scale`` (IEEE division)

The second-level scale is given per row (float32 ``[..., N]``) so fused gate/up halves keep their own.
``e2m1 * e4m3`` is exact in float32, so each value is rounded exactly once.
"""

from __future__ import annotations

import torch

from mxfp4conv.formats.fp4 import (
    F4_E2M1_MAX,
    e2m1_decode,
    e4m3_bits,
    e4m3_decode,
    e4m3_nan_mask,
    unpack_nibbles,
)

__all__ = ["MAX_REQUANT_MAGNITUDE", "NV_BLOCK", "dequantize_nvfp4", "validate_nvfp4_scales"]

NV_BLOCK = 16  # NVFP4 block size (ModelOpt / compressed-tensors group_size 16)
# Largest dequantized magnitude whose MXFP4 requant stays finite in float32 under every rule: at
# 1.75 * 2^127 EVEN picks 2^127 and RCEIL rounds the block max up to 4 * 2^126 = 2^128 (= inf).
MAX_REQUANT_MAGNITUDE = 1.75 * 2.0**127


def _check_shapes(packed: torch.Tensor, scales: torch.Tensor, global_rows: torch.Tensor) -> None:
    k = packed.shape[-1] * 2
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * NV_BLOCK != k:
        raise ValueError(f"NVFP4 scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)}")
    if tuple(global_rows.shape) != tuple(packed.shape[:-1]):
        raise ValueError(f"global_rows {tuple(global_rows.shape)} must be {tuple(packed.shape[:-1])}")


def dequantize_nvfp4(
    packed: torch.Tensor,
    scales_e4m3: torch.Tensor,
    global_rows: torch.Tensor,
    *,
    divisor: bool,
) -> torch.Tensor:
    """NVFP4 -> float32.

    Shapes: ``packed`` uint8 ``[..., N, K/2]``; ``scales_e4m3`` float8_e4m3fn (or its uint8 bit
    patterns) ``[..., N, K/16]``; ``global_rows`` float32 ``[..., N]``; returns float32
    ``[..., N, K]``. ``divisor=True`` divides by the global scale (compressed-tensors), False multiplies
    (ModelOpt). Inputs are not validated here (see ``validate_nvfp4_scales``).
    """
    _check_shapes(packed, scales_e4m3, global_rows)
    if global_rows.dtype != torch.float32:
        raise TypeError(f"global_rows must be float32, got {global_rows.dtype}")
    k = packed.shape[-1] * 2
    lead = packed.shape[:-1]
    v = e2m1_decode(unpack_nibbles(packed)).reshape(*lead, k // NV_BLOCK, NV_BLOCK)
    v = v * e4m3_decode(scales_e4m3)[..., None]  # exact
    g = global_rows[..., None, None]
    w = v / g if divisor else v * g
    return w.reshape(*lead, k)


def _first(mask: torch.Tensor) -> tuple[int, ...] | None:
    if not bool(mask.any()):
        return None
    return tuple(int(i) for i in torch.nonzero(mask)[0])


def validate_nvfp4_scales(
    scales: torch.Tensor, global_rows: torch.Tensor, *, divisor: bool | None = None,
    row_max: torch.Tensor | None = None,
) -> str | None:
    """Describe the first problem in NVFP4 scales, or return None when they are valid.

    ``scales`` float8_e4m3fn / uint8 bits ``[..., N, K/16]``; ``global_rows`` float32 ``[..., N]``.
    Checks, in order: NaN E4M3 block scales (0x7F / 0xFF), non-finite and zero second-level scales,
    and, when ``divisor`` is given, a block whose largest representable value (6 * scale, then * or /
    the global scale) reaches ``MAX_REQUANT_MAGNITUDE`` (overflows, or would make the MXFP4 values
    overflow float32). ``row_max``: the rows' ``(bits & 0x7F).amax(-1)`` when the caller has it
    already (the GPU requant computes it on the device), so that the scales are read only to name a
    bad element.
    """
    if tuple(global_rows.shape) != tuple(scales.shape[:-1]):
        return (
            f"global scale shape {tuple(global_rows.shape)} does not match block scales {tuple(scales.shape)}"
        )
    # One pass over the block scales: each row's largest magnitude byte. E4M3 magnitudes order as
    # their bytes (sign cleared), the NaN pattern 0x7F is the largest, and multiplying or dividing
    # by one positive row scale is monotonic under rounding, so the row maxima decide every check
    # exactly; the full tensors are looked at only to name the first bad element.
    if row_max is None:
        bits = e4m3_bits(scales)
        row_max = (bits & 0x7F).amax(dim=-1) if bits.shape[-1] else torch.zeros(bits.shape[:-1], dtype=torch.uint8)
    elif tuple(row_max.shape) != tuple(scales.shape[:-1]) or row_max.dtype != torch.uint8:
        raise ValueError(f"row_max must be uint8 {tuple(scales.shape[:-1])}, got {row_max.dtype} {tuple(row_max.shape)}")
    if bool((row_max == 0x7F).any()):
        return f"NaN e4m3 block scale at index {_first(e4m3_nan_mask(scales))}"
    g = global_rows.float()
    idx = _first(~torch.isfinite(g))
    if idx is not None:
        return f"non-finite global scale {float(g[idx])} at row {idx}"
    idx = _first(g == 0)
    if idx is not None:
        return f"zero global scale at row {idx}"
    if divisor is not None:
        top = e4m3_decode(row_max) * F4_E2M1_MAX  # exact
        top = (top / g if divisor else top * g).abs()
        if bool((top >= MAX_REQUANT_MAGNITUDE).any()):  # error path: the first block, in element order
            full = e4m3_decode(scales) * F4_E2M1_MAX
            gb = g.to(full.device)[..., None]
            full = (full / gb if divisor else full * gb).abs()
            return f"dequantized value out of range (>= 1.75 * 2^127) at block {_first(full >= MAX_REQUANT_MAGNITUDE)}"
    return None
