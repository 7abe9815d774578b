"""FP4 (E2M1) element codes and the E8M0 / E4M3 scale formats: decode, encode, nibble packing.

Pure functions on torch tensors (no I/O, no names). The numerics follow docs/NUMERICS.md exactly:

* E2M1 codes 0..7 = +{0, 0.5, 1, 1.5, 2, 3, 4, 6}; codes 8..15 = the same with the sign bit (bit 3).
  Encode is round-to-nearest, ties to the even code, saturating at 6; the sign bit is ``signbit(x)``
  (so -0.0 and negatives that round to zero give 0x8).
* Two codes per byte along the last axis, element ``2i`` in the LOW nibble.
* E8M0 byte ``b`` -> ``2^(b-127)``; 0xFF is invalid (NaN) and never produced.
* E4M3 (float8_e4m3fn) bit patterns decode exactly to float32; 0x7F / 0xFF are NaN.
"""

from __future__ import annotations

import torch

from mxfp4conv.formats.tables import E4M3_BIAS, E4M3_VALUES

__all__ = [
    "E2M1_MAG_MASK",
    "E2M1_POS_VALUES",
    "E2M1_SIGN_BIT",
    "E2M1_VALUES",
    "E4M3_BIAS",
    "E4M3_NAN_BITS",
    "E8M0_BIAS",
    "E8M0_MAX_EXP",
    "E8M0_MIN_EXP",
    "E8M0_NAN",
    "F4_E2M1_MAX",
    "F8_E4M3_MAX",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_bits",
    "e4m3_decode",
    "e4m3_has_nan",
    "e4m3_nan_mask",
    "e8m0_decode",
    "e8m0_encode",
    "e8m0_has_nan",
    "pack_nibbles",
    "pow2_float32",
    "pow2_float64",
    "unpack_nibbles",
]

# --- E2M1 (OCP Microscaling Formats (MX) v1.0, sec. 5.3.3 "FP4": 1 sign, 2 exponent (bias 1),
# 1 mantissa bit; no Inf/NaN; max normal 6.0, min subnormal 0.5).
F4_E2M1_MAX = 6.0
E2M1_SIGN_BIT = 0x8  # bit 3 of a code (OCP MX v1.0 sec. 5.3.3; compressed-tensors kE2M1ToFloat: 0x08)
E2M1_MAG_MASK = 0x7  # bits 2..0: magnitude index
E2M1_POS_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES: tuple[float, ...] = E2M1_POS_VALUES + tuple(-v for v in E2M1_POS_VALUES)  # 8 -> -0.0

# RNE decision points between consecutive magnitudes (NUMERICS.md "E2M1"). A magnitude that equals a
# midpoint goes to the neighbour with the even code: ties at 0.25, 1.25, 2.5, 5 round down (codes 0, 2,
# 4, 6), ties at 0.75, 1.75, 3.5 round up (codes 2, 4, 6).
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)  # code += 1 when |x| >  t
_TIES_UP = (0.75, 1.75, 3.5)  # code += 1 when |x| >= t

# --- E8M0 (OCP MX v1.0 sec. 5.4.1 "E8M0": unsigned 8-bit exponent, bias 127, 0xFF = NaN, no zero).
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MIN_EXP = -127  # byte 0
E8M0_MAX_EXP = 127  # byte 254 (the largest non-NaN byte)

# --- E4M3 (OCP 8-bit Floating Point Specification (OFP8) rev. 1.0, "E4M3": bias 7, no Inf,
# S.1111.111 = NaN, max normal 448, min subnormal 2^-9; torch.float8_e4m3fn).
F8_E4M3_MAX = 448.0
E4M3_NAN_BITS = (0x7F, 0xFF)


def pow2_float32(k: torch.Tensor) -> torch.Tensor:
    """Exact ``2^k`` as float32 for integer ``k`` in [-149, 127] (any shape), built from the bits.

    ``k`` below -126 gives the subnormal power of two (still exact).
    """
    k = k.to(torch.int32)
    normal = (k + 127).clamp(min=1) << 23
    sub = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, sub).view(torch.float32)


def pow2_float64(k: torch.Tensor) -> torch.Tensor:
    """Exact ``2^k`` as float64 for integer ``k`` in [-1022, 1023] (any shape)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def _lut(values: tuple[float, ...] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, values 0..15, any shape) -> float32 of the same shape (exact)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"e2m1_decode expects uint8 codes, got {codes.dtype}")
    lut = _lut(E2M1_VALUES, torch.float32, codes.device)
    return lut[(codes & 0xF).to(torch.int32)]


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 [any] -> E2M1 codes uint8 [same shape].

    Round to nearest, ties to the even code; magnitudes above 6 saturate to code 7; sign bit =
    ``signbit(x)`` (-0.0 -> 0x8, a negative value that rounds to zero -> 0x8). NaN is not allowed
    (the caller validates); it encodes as a zero magnitude.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"e2m1_encode expects float32, got {x.dtype}")
    a = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _TIES_DOWN:
        mag += a > t
    for t in _TIES_UP:
        mag += a >= t
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (0..15, K even) -> uint8 [..., K/2]; element 2i in the LOW nibble."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_nibbles expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dim, got {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 0xF:
        raise ValueError("pack_nibbles: codes must be in 0..15")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes uint8 [..., K]; the low nibble of byte i is element 2i."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_nibbles expects uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def e8m0_decode(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8, any shape) -> float32 ``2^(b-127)`` (exact; byte 0 is the subnormal 2^-127).

    Raises ``ValueError`` if any byte is 0xFF (NaN in OCP MX).
    """
    if scales.dtype != torch.uint8:
        raise TypeError(f"e8m0_decode expects uint8, got {scales.dtype}")
    if e8m0_has_nan(scales):
        raise ValueError("E8M0 scale byte 0xFF (NaN) is not a valid scale")
    return pow2_float32(scales.to(torch.int32) - E8M0_BIAS)


def e8m0_encode(exp: torch.Tensor) -> torch.Tensor:
    """Integer exponents (any int dtype/shape) -> E8M0 bytes uint8, clamped to [-127, 127] (0..254)."""
    if exp.is_floating_point() or exp.is_complex():
        raise TypeError(f"e8m0_encode expects an integer tensor, got {exp.dtype}")
    e = exp.to(torch.int32).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    return (e + E8M0_BIAS).to(torch.uint8)


_E4M3_VALUES: tuple[float, ...] = E4M3_VALUES


def e4m3_bits(t: torch.Tensor) -> torch.Tensor:
    """The uint8 bit patterns of E4M3 scales (float8_e4m3fn viewed as bytes, or uint8 as is; no copy)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    if t.dtype == torch.uint8:
        return t
    raise TypeError(f"expected float8_e4m3fn or uint8 bit patterns, got {t.dtype}")


def e4m3_decode(t: torch.Tensor) -> torch.Tensor:
    """E4M3 scales (float8_e4m3fn, or uint8 holding the bit patterns; any shape) -> float32 (exact).

    The NaN patterns 0x7F / 0xFF decode to NaN (see ``e4m3_nan_mask``).
    """
    bits = e4m3_bits(t)
    lut = _lut(_E4M3_VALUES, torch.float32, bits.device)
    return lut[bits.to(torch.int32)]


def e4m3_nan_mask(t: torch.Tensor) -> torch.Tensor:
    """Bool mask (same shape) of the E4M3 NaN bit patterns S.1111.111 (0x7F, 0xFF)."""
    return (e4m3_bits(t) & 0x7F) == 0x7F


def e4m3_has_nan(t: torch.Tensor) -> bool:
    """Whether any E4M3 bit pattern is NaN (0x7F / 0xFF). One reduction of the raw bytes when none
    reaches 0x7F (positive finite scales are all below it: the usual case), the mask otherwise;
    ~50x faster than ``e4m3_nan_mask(t).any()`` on a layer's scales."""
    b = e4m3_bits(t)
    if b.numel() == 0 or int(b.amax()) < 0x7F:
        return False
    return bool(e4m3_nan_mask(b).any())


def e8m0_has_nan(t: torch.Tensor) -> bool:
    """Whether any E8M0 scale byte (uint8) is 0xFF (NaN): one reduction."""
    return t.numel() > 0 and int(t.amax()) == E8M0_NAN
