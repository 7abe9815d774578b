"""FP4 Marlin scale and bias permutations (vLLM's, MARLIN.md §2 and §3), MXFP4's E8M0 bytes moved and
NVFP4's E4M3 bytes re-encoded as S0E5M3, pure torch; the weight repack and the whole-layer helpers are
in ``formats/marlin.py``.

Device-agnostic like the rest of the layout (reshapes, permutes, small cached tables, integer / bit ops):
CPU and CUDA produce identical bytes; leading dims are batch dims. Each permutation sits beside its
inverse (verify decodes with them), so a change to one is never made without the other.
"""

from __future__ import annotations

import math
import sys
from functools import lru_cache

import torch

__all__ = [
    "as_u8",
    "mxfp4_scales_from_marlin",
    "mxfp4_scales_to_marlin",
    "nvfp4_global_to_marlin",
    "nvfp4_rescale_factor",
    "nvfp4_scales_encoding_lossless",
    "nvfp4_scales_from_marlin",
    "nvfp4_scales_match",
    "nvfp4_scales_to_marlin",
    "permute_bias",
    "unpermute_bias",
]

if sys.byteorder != "little":  # pragma: no cover - uint8 <-> int32 views assume little-endian words
    raise ImportError("mxfp4conv.formats.marlin requires a little-endian host")


def as_u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


# ---- §2 / §3 scale and bias permutations -------------------------------------------------------


@lru_cache(maxsize=32)
def _col_perm(kind: str, device: torch.device) -> torch.Tensor:
    """Per-block column permutation (int64): ``out[..., p] = in[..., perm[p]]`` within each block.

    ``grouped``: 8x8 transpose per 64 columns (Step A); ``single``: the 32-column "single" perm;
    ``+swap``: then positions 1/2 swapped in every run of 4 (Step B).
    """
    if kind.startswith("grouped"):
        perm = torch.arange(64, device=device).reshape(8, 8).t().reshape(64)
    else:
        i = torch.arange(4, device=device).unsqueeze(1)
        m = torch.tensor([0, 1, 8, 9, 16, 17, 24, 25], device=device)
        perm = (2 * i + m).reshape(32)
    if kind.endswith("+swap"):
        perm = perm.reshape(-1, 2, 2).transpose(1, 2).reshape(-1)
    return perm


def _permute_cols(t: torch.Tensor, kind: str, *, inverse: bool = False) -> torch.Tensor:
    perm = _col_perm(kind, t.device)
    blk = perm.numel()
    if t.shape[-1] % blk:
        raise ValueError(f"last dim {t.shape[-1]} is not a multiple of {blk} ({kind} permutation)")
    if inverse:
        perm = torch.argsort(perm)
    rows = t.reshape(-1, blk)
    return torch.gather(rows, 1, perm.expand(rows.shape[0], blk)).reshape(t.shape)


def _scale_kind(groups: int, a8: bool) -> str:
    """Step A choice (grouped unless a8 or one group spans K) and Step B (16-bit activations)."""
    return ("single" if a8 or groups == 1 else "grouped") + ("" if a8 else "+swap")


def _to_marlin_order(scales_u8: torch.Tensor, a8: bool) -> torch.Tensor:
    """``[..., N, G]`` -> transposed ``[..., G, N]`` and permuted (Steps A, B), bytes unchanged."""
    s = scales_u8.transpose(-1, -2).contiguous()
    return _permute_cols(s, _scale_kind(s.shape[-2], a8))


def _from_marlin_order(m_u8: torch.Tensor, a8: bool) -> torch.Tensor:
    s = _permute_cols(m_u8.contiguous(), _scale_kind(m_u8.shape[-2], a8), inverse=True)
    return s.transpose(-1, -2).contiguous()


def mxfp4_scales_to_marlin(scales: torch.Tensor, *, a8: bool = False) -> torch.Tensor:
    """MXFP4 E8M0 scales uint8 ``[..., N, K/32]`` -> Marlin uint8 ``[..., K/32, N]`` (MARLIN.md §2).

    Same exponent bytes, moved; store with ``.view(torch.float8_e8m0fnu)``. ``a8`` (FP8
    activations): single permutation, no 1/2 swap, every byte +6 (bytes > 249 are refused).
    """
    out = _to_marlin_order(as_u8(scales), a8)
    if a8:
        if out.numel() and int(out.max()) > 249:
            raise ValueError("E8M0 scale byte > 249 cannot take the FP8-activation +6 bias")
        out = out + 6
    return out


def mxfp4_scales_from_marlin(marlin: torch.Tensor, *, a8: bool = False) -> torch.Tensor:
    """Inverse of :func:`mxfp4_scales_to_marlin`: ``[..., K/32, N]`` -> uint8 ``[..., N, K/32]``."""
    m = as_u8(marlin)
    if a8:
        if m.numel() and int(m.min()) < 6:
            raise ValueError("FP8-activation Marlin scale byte < 6 is not a +6-biased E8M0 byte")
        m = m - 6
    return _from_marlin_order(m, a8)


def permute_bias(bias: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``marlin_permute_bias`` (MARLIN.md §3): single perm over blocks of 32; ``[..., N]`` -> ``[..., N]``.

    ``dtype`` casts first (MoE biases become the params dtype; dense biases keep theirs).
    """
    b = bias.to(dtype) if dtype is not None else bias
    return _permute_cols(b.contiguous(), "single")


def unpermute_bias(bias: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute_bias` (without the cast)."""
    return _permute_cols(bias.contiguous(), "single", inverse=True)


# ---- §2 NVFP4: E4M3 -> S0E5M3 --------------------------------------------------------------------

_E4M3_MAX = 448.0
_INF_BYTE = 0xF8  # bits 14..7 of fp16 +inf: what vLLM emits if a forced sf overflows fp16


def _e4m3_value(code: int) -> float:
    e, m = (code >> 3) & 0xF, code & 7
    return m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


def _sf_log2(params_dtype: torch.dtype, sf: float) -> int:
    if params_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype must be bfloat16 or float16, got {params_dtype}")
    k = int(math.log2(sf)) if sf >= 1 else -1
    if sf < 1 or 2.0**k != sf:
        raise ValueError(f"rescale factor must be a power of two >= 1, got {sf}")
    if params_dtype == torch.float16 and k:
        raise ValueError("fp16 params use no rescale (sf must be 1)")
    return k


def nvfp4_rescale_factor(scales: torch.Tensor, params_dtype: torch.dtype) -> float:
    """NVFP4 rescale factor ``sf`` (MARLIN.md §2 step 2; vLLM >= 0.20).

    ``scales``: E4M3 (float8_e4m3fn or its uint8 view), any shape; for MoE pass all experts of w13
    (resp. w2) together. bf16: ``sf = 2^floor(log2(448/m))`` for the largest positive scale
    ``m < 448``, else 1; fp16: 1.
    """
    _sf_log2(params_dtype, 1.0)
    if params_dtype == torch.float16:
        return 1.0
    b = as_u8(scales)
    # as int8 the positive codes 0x00..0x7F are the non-negative values: their max is one reduction
    top = int(b.view(torch.int8).amax()) if b.numel() else 0
    if top == 0x7F:  # +NaN present: take the largest finite positive code instead
        top = int(torch.where(b < 0x7F, b, torch.zeros_like(b)).amax())
    if top <= 0:  # no positive scale (all zero / negative)
        return 1.0
    m, k = _e4m3_value(top), 0
    while m * 2.0 ** (k + 1) <= _E4M3_MAX:
        k += 1
    return 2.0**k


def _pair_lut(lut: torch.Tensor) -> torch.Tensor:
    """int16[65536]: a byte LUT applied to both bytes of a little-endian int16 (index = value mod 2^16)."""
    i = torch.arange(65536, device=lut.device)
    pair = lut.long()[i & 0xFF] | (lut.long()[i >> 8] << 8)
    return pair.to(torch.int16)  # wraps to the int16 bit pattern


def _apply_lut(x: torch.Tensor, lut: torch.Tensor, pair_lut: torch.Tensor) -> torch.Tensor:
    """``lut[x]`` for uint8 ``x``; two bytes per lookup (``pair_lut``) when the layout allows."""
    x = x.contiguous()
    if x.shape[-1] % 2 or x.storage_offset() % 2:
        return lut[x.long()]
    pairs = x.view(torch.int16).long()  # negative int16 values index from the end: mod 2^16
    return pair_lut[pairs].view(torch.uint8).reshape(x.shape)


@lru_cache(maxsize=64)
def _s0e5m3_lut(k: int, device: torch.device) -> torch.Tensor:
    """uint8[256]: E4M3 byte -> S0E5M3 byte of ``h = fp16(v * 2^k) * 128`` (bits 14..7; 0 if h < 2)."""
    c = torch.arange(256, dtype=torch.int64, device=device)
    e, m = (c >> 3) & 0xF, c & 7
    # normal: h = 2^(e+k) (1 + m/8) -> fp16 exponent field e + k + 15, top mantissa bits m
    exp16, mant = e + k + 15, m
    # subnormal: h = m * 2^(k-2), normalised on m's leading bit p; flushed when h < 2 (m * 2^k < 8)
    p = (m >= 2).long() + (m >= 4).long()
    sub = e == 0
    exp16 = torch.where(sub, k - 2 + p + 15, exp16)
    mant = torch.where(sub, (m << (3 - p)) & 7, mant)
    out = torch.where(exp16 > 30, torch.full_like(c, _INF_BYTE), (exp16 << 3) | mant)  # fp16 overflow
    flush = (c >= 0x80) | (sub & (m < (8 >> k if k < 4 else 1)))  # negative, +-0, small subnormal
    return torch.where(flush, torch.zeros_like(c), out).to(torch.uint8)


@lru_cache(maxsize=64)
def _s0e5m3_pair_lut(k: int, device: torch.device) -> torch.Tensor:
    return _pair_lut(_s0e5m3_lut(k, device))


def nvfp4_scales_to_marlin(scales: torch.Tensor, *, params_dtype: torch.dtype, sf: float) -> torch.Tensor:
    """NVFP4 E4M3 scales ``[..., N, K/16]`` -> Marlin S0E5M3 bytes uint8 ``[..., K/16, N]`` (§2).

    Steps A/B, then ``h = fp16(s * sf) * 128``, ``h < 2 -> 0``, byte = bits 14..7 of h. Store with
    ``.view(torch.float8_e4m3fn)`` (a reinterpretation). NaN scales are refused.
    """
    k = _sf_log2(params_dtype, sf)
    b = as_u8(scales)
    if b.numel() and int((b | 0x80).amax()) == 0xFF:  # low 7 bits all set: 0x7F / 0xFF
        raise ValueError("NaN E4M3 block scale")
    return _apply_lut(_to_marlin_order(b, False), _s0e5m3_lut(k, b.device), _s0e5m3_pair_lut(k, b.device))


@lru_cache(maxsize=64)
def _s0e5m3_inverse_lut(k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode uint8[256], valid bool[256]): S0E5M3 byte -> the positive E4M3 byte that encodes to it."""
    fwd = _s0e5m3_lut(k, device).long()
    src = torch.arange(1, 0x7F, device=device)  # the positive finite E4M3 codes
    src = src[(fwd[src] != 0) & (fwd[src] != _INF_BYTE)]  # the encoder is injective on these
    dec = torch.zeros(256, dtype=torch.long, device=device)
    valid = torch.zeros(256, dtype=torch.bool, device=device)
    dec[fwd[src]] = src
    valid[fwd[src]] = True
    valid[0] = True  # +0 (also what flushed / negative scales became)
    return dec.to(torch.uint8), valid


def nvfp4_scales_from_marlin(marlin: torch.Tensor, *, params_dtype: torch.dtype, sf: float) -> torch.Tensor:
    """Decode S0E5M3 bytes ``[..., K/16, N]`` back to E4M3 bytes uint8 ``[..., N, K/16]`` (for verify).

    Lossy where the encoder is not injective: byte 0 decodes to +0, but came from +0, -0, any
    negative scale, or an E4M3 subnormal flushed because ``v * sf * 128 < 2``. Use
    :func:`nvfp4_scales_match` to verify by re-encoding instead. Bytes no E4M3 scale can produce
    (e.g. the fp16-inf pattern) raise ValueError.
    """
    k = _sf_log2(params_dtype, sf)
    m = as_u8(marlin)
    dec, valid = _s0e5m3_inverse_lut(k, m.device)
    idx = m.long()
    if m.numel() and not bool(valid[idx].all()):
        raise ValueError("byte is not an S0E5M3 encoding of an E4M3 scale at this sf")
    return _from_marlin_order(dec[idx], False)


def nvfp4_scales_encoding_lossless(scales: torch.Tensor, *, params_dtype: torch.dtype, sf: float) -> bool:
    """True when :func:`nvfp4_scales_from_marlin` recovers ``scales`` exactly (no flush / sign loss)."""
    b = as_u8(scales)
    lut = _s0e5m3_lut(_sf_log2(params_dtype, sf), b.device)
    enc = lut[b.long()]
    return bool(((b == 0) | ((enc != 0) & (enc != _INF_BYTE))).all())


def nvfp4_scales_match(
    scales: torch.Tensor, marlin: torch.Tensor, *, params_dtype: torch.dtype, sf: float
) -> bool:
    """Verify Marlin S0E5M3 bytes ``[..., K/16, N]`` against source E4M3 ``[..., N, K/16]`` by re-encoding."""
    enc = nvfp4_scales_to_marlin(scales, params_dtype=params_dtype, sf=sf)
    return enc.shape == marlin.shape and bool(torch.equal(enc, as_u8(marlin).to(enc.device)))


def nvfp4_global_to_marlin(
    global_scale: torch.Tensor | float, *, params_dtype: torch.dtype, sf: float
) -> torch.Tensor:
    """NVFP4 global (dequant multiplier, ``weight_scale_2``) -> Marlin float32 (MARLIN.md §2).

    ``gs * 2^(B - 7) / sf`` with B = 126 (bf16) or 14 (fp16): exact power-of-two scaling. Dense:
    0-dim; MoE: ``[E]``.
    """
    _sf_log2(params_dtype, sf)
    gs = torch.as_tensor(global_scale).to(torch.float32)
    bias = 126 if params_dtype == torch.bfloat16 else 14
    return gs * (2.0 ** (bias - 7)) / sf
