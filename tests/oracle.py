"""An independent reading of every input layout and of the MXFP4 outputs, for tests.

The inline proof and ``verify`` compare an output with what the source yields through mxfp4conv's
own layout code, so a misread source (a global scale applied the wrong way, rows taken from the
wrong half) passes them. This module reads the same files a second way and shares no code with
mxfp4conv: safetensors files are parsed from their header, and every number is decoded from the
format's definition with numpy:

* E2M1 codes (OCP MX v1.0): 0..7 = +{0, 0.5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign; two per byte,
  element 2i in the low nibble.
* E8M0 (MXFP4 block scale): byte b = 2^(b - 127).
* E4M3 (NVFP4 block scale, OCP FP8 E4M3FN): bias 7, no infinities, 0x7F / 0xFF NaN.
* ModelOpt and Quark NVFP4: ``(e2m1 * e4m3) * weight_scale_2`` (a multiplier); compressed-tensors
  NVFP4: ``(e2m1 * e4m3) / weight_global_scale`` (a divisor), float32, in that order.
* GPT-OSS: ``*_blocks [E, R, K/32, 16]`` + ``*_scales [E, R, K/32]``, gate and up rows interleaved
  (gate on even rows); the Quark output of GPT-OSS keeps that interleave in ``w13_weight``.
* DeepSeek-V4 native MXFP4: ``weight`` I8 packed E2M1 + ``scale`` F8_E8M0.

``requantize`` is a float64 model of NUMERICS.md's default MSE scale rule, written from the rule
(not from the kernels): the output of an NVFP4 source must equal it bit for bit, and must in any
case lie within one MXFP4 rounding of the source's values (``compare``).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["MX", "NV", "compare", "output_fp4", "read_tensors", "requantize", "source_fp4"]

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                dtype=np.float32)
_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_ODD = (np.arange(7) % 2 == 1)  # a tie at midpoint j (between codes j and j+1) goes to the even code


def _e4m3_table() -> np.ndarray:
    out = np.empty(256, dtype=np.float32)
    for b in range(256):
        sign, exp, man = b >> 7, (b >> 3) & 0xF, b & 0x7
        if exp == 0xF and man == 0x7:
            v = float("nan")
        elif exp == 0:
            v = man / 8 * 2.0**-6
        else:
            v = (1 + man / 8) * 2.0 ** (exp - 7)
        out[b] = -v if sign else v
    return out


E4M3 = _e4m3_table()


# safetensors, from the header ---------------------------------------------------------------------
@dataclass(frozen=True)
class Raw:
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def array(self) -> np.ndarray:
        """uint8 for U8 / I8 / F8_* (the bytes, decoded by the caller); float32 for F32 / BF16 / F16."""
        if self.dtype in ("U8", "I8", "F8_E4M3", "F8_E8M0"):
            a = np.frombuffer(self.data, dtype=np.uint8)
        elif self.dtype == "F32":
            a = np.frombuffer(self.data, dtype="<f4")
        elif self.dtype == "BF16":
            a = (np.frombuffer(self.data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif self.dtype == "F16":
            a = np.frombuffer(self.data, dtype="<f2").astype(np.float32)
        else:
            raise ValueError(f"oracle: no decoding for dtype {self.dtype}")
        return a.reshape(self.shape)


def read_tensors(folder: Path) -> dict[str, Raw]:
    """Every tensor of a folder's safetensors files: name -> (dtype, shape, bytes)."""
    out: dict[str, Raw] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        blob = f.read_bytes()
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8:8 + n])
        for name, meta in header.items():
            if name != "__metadata__":
                b, e = meta["data_offsets"]
                out[name] = Raw(meta["dtype"], tuple(meta["shape"]), blob[8 + n + b:8 + n + e])
    return out


def _codes(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., K/2] -> E2M1 codes uint8 [..., K] (element 2i in the low nibble)."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


# the two kinds of FP4 matrix ---------------------------------------------------------------------
@dataclass
class MX:
    """An MXFP4 matrix: E2M1 codes [N, K] and E8M0 bytes [N, K/32]."""

    codes: np.ndarray
    exps: np.ndarray

    def values(self) -> np.ndarray:
        s = np.exp2(self.exps.astype(np.float64) - 127)
        return E2M1[self.codes].astype(np.float64) * np.repeat(s, 32, axis=-1)


@dataclass
class NV:
    """An NVFP4 matrix, dequantized: float32 [N, K], exactly as the format defines it."""

    values: np.ndarray


def _scalar(raw: Raw) -> np.float32:
    a = raw.array().reshape(-1)
    assert a.size == 1 or bool((a == a[0]).all()), f"oracle: a second-level scale with {a.size} different values"
    return np.float32(a[0])


def _nvfp4(packed: np.ndarray, scale: np.ndarray, global_scale: np.float32, divisor: bool) -> NV:
    codes = _codes(packed)
    block = np.repeat(E4M3[scale], 16, axis=-1)
    assert not np.isnan(block).any(), "oracle: a NaN E4M3 block scale"
    x = E2M1[codes] * block  # exact in float32: 2 + 4 significant bits
    x = x / global_scale if divisor else x * global_scale
    return NV(x.astype(np.float32))


def source_fp4(folder: Path) -> dict[str, MX | NV]:
    """Every FP4 Linear of a source checkpoint, by module name; GPT-OSS's fused experts split into
    ``{experts}.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` from their interleaved rows."""
    t = read_tensors(folder)
    out: dict[str, MX | NV] = {}
    for name, raw in t.items():
        if name.endswith("_proj_blocks"):  # GPT-OSS
            out.update(_gpt_oss(name, raw, t))
            continue
        module, _, suffix = name.rpartition(".")
        if suffix not in ("weight_packed", "weight") or raw.dtype not in ("U8", "I8") or len(raw.shape) != 2:
            continue
        packed = raw.array()
        if f"{module}.scale" in t and t[f"{module}.scale"].dtype == "F8_E8M0":  # DeepSeek-V4 native
            out[module] = MX(_codes(packed), t[f"{module}.scale"].array())
            continue
        scale = t.get(f"{module}.weight_scale")
        if scale is None:
            continue
        if scale.dtype == "U8":  # compressed-tensors / AutoRound / Quark MXFP4
            out[module] = MX(_codes(packed), scale.array())
        elif scale.dtype == "F8_E4M3" and f"{module}.weight_global_scale" in t:  # compressed-tensors NVFP4
            out[module] = _nvfp4(packed, scale.array(), _scalar(t[f"{module}.weight_global_scale"]), divisor=True)
        elif scale.dtype == "F8_E4M3" and f"{module}.weight_scale_2" in t:  # ModelOpt / Quark NVFP4
            out[module] = _nvfp4(packed, scale.array(), _scalar(t[f"{module}.weight_scale_2"]), divisor=False)
    return out


_W13 = re.compile(r"^(?P<p>.+)\.(?P<e>\d+)\.(?P<w>w13|w2)_weight$")


def output_fp4(folder: Path) -> dict[str, MX]:
    """Every MXFP4 Linear of a ``--to ct`` / ``--to quark`` / ``--to gpt-oss`` output, by the source's
    module names (a Quark GPT-OSS expert's interleaved ``w13_weight`` split into gate and up)."""
    t = read_tensors(folder)
    out: dict[str, MX] = {}
    for name, raw in t.items():
        if name.endswith("_proj_blocks"):
            out.update(_gpt_oss(name, raw, t))
            continue
        m = _W13.match(name)
        if m and raw.dtype == "U8":
            codes, exps = _codes(raw.array()), t[f"{name}_scale"].array()
            head = f"{m['p']}.{m['e']}"
            if m["w"] == "w13":
                out[f"{head}.gate_proj"] = MX(codes[0::2], exps[0::2])
                out[f"{head}.up_proj"] = MX(codes[1::2], exps[1::2])
            else:
                out[f"{head}.down_proj"] = MX(codes, exps)
            continue
        module, _, suffix = name.rpartition(".")
        scale = t.get(f"{module}.weight_scale")
        if suffix in ("weight_packed", "weight") and raw.dtype == "U8" and scale is not None and scale.dtype == "U8":
            out[module] = MX(_codes(raw.array()), scale.array())
    return out


def _gpt_oss(name: str, raw: Raw, t: dict[str, Raw]) -> dict[str, MX]:
    """One fused GPT-OSS expert tensor, split per expert; gate on the even rows, up on the odd."""
    base = name[: -len("_blocks")]
    blocks, scales = raw.array(), t[f"{base}_scales"].array()
    e, rows = blocks.shape[:2]
    codes = _codes(blocks.reshape(e, rows, -1))
    prefix, _, proj = base.rpartition(".")
    out: dict[str, MX] = {}
    for x in range(e):
        if proj == "gate_up_proj":
            out[f"{prefix}.{x}.gate_proj"] = MX(codes[x, 0::2], scales[x, 0::2])
            out[f"{prefix}.{x}.up_proj"] = MX(codes[x, 1::2], scales[x, 1::2])
        else:
            out[f"{prefix}.{x}.down_proj"] = MX(codes[x], scales[x])
    return out


# MXFP4 quantization, from NUMERICS.md's definitions ----------------------------------------------
def _encode_magnitude(m: np.ndarray) -> np.ndarray:
    """|x| (scaled, float64) -> E2M1 magnitude code 0..7: nearest, ties to the even code, saturating."""
    above = (m[..., None] > _MIDS).sum(-1)
    tie_up = ((m[..., None] == _MIDS) & _ODD).sum(-1)
    return (above + tie_up).astype(np.uint8)


def _encode(q: np.ndarray) -> np.ndarray:
    return _encode_magnitude(np.abs(q)) | (np.signbit(q).astype(np.uint8) << 3)


def rceil(amax: np.ndarray) -> np.ndarray:
    """The smallest integer e with amax <= 6 * 2^e (exact comparisons; amax > 0)."""
    e = np.ceil(np.log2(amax / 6.0))
    for _ in range(2):
        e = np.where(amax > np.ldexp(6.0, e.astype(np.int64)), e + 1, e)
        e = np.where(amax <= np.ldexp(6.0, (e - 1).astype(np.int64)), e - 1, e)
    return e


def requantize(x: np.ndarray) -> MX:
    """MXFP4 of float32 ``x [N, K]`` under the MSE rule: per 32-block, RCEIL or one binade lower,
    the lower only where its squared error is strictly smaller (computed exactly: each term is a
    multiple of 2^-26 below 2^9, so float64 sums are exact); elements nearest, ties to even."""
    xb = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(xb).max(-1)
    zero = amax == 0
    er = np.clip(rceil(np.where(zero, 1.0, amax)), -127, 127)
    el = np.clip(er - 1, -127, 127)
    qb = np.abs(xb) * np.exp2(-el)[..., None]
    a = 2 * E2M1[_encode_magnitude(np.abs(xb) * np.exp2(-er)[..., None])].astype(np.float64)
    b = E2M1[_encode_magnitude(qb)].astype(np.float64)
    d = ((a - b) * (2 * qb - a - b)).sum(-1)  # err(el) - err(er), in el's scaled domain
    e = np.where(zero, 0.0, np.where((d < 0) & (el != er), el, er))
    codes = _encode(xb * np.exp2(-e)[..., None]).reshape(x.shape)
    return MX(codes, (e + 127).astype(np.uint8))


# the comparison ----------------------------------------------------------------------------------
def compare(src: dict[str, MX | NV], out: dict[str, MX], *, limit: int = 12) -> list[str]:
    """What differs between the oracle's reading of a source and an output's MXFP4 Linears.

    MXFP4 source: codes and scales bit for bit. NVFP4 source: (1) within one MXFP4 rounding: every
    block's scale is RCEIL or RCEIL - 1 of the source block's maximum and every code is the nearest
    E2M1 value (ties to even) of the source value at that scale; (2) bit for bit with ``requantize``.
    """
    problems: list[str] = []
    problems += [f"{m}: an FP4 Linear of the source, missing from the output" for m in sorted(set(src) - set(out))]
    problems += [f"{m}: an MXFP4 Linear of the output the source has no FP4 Linear for"
                 for m in sorted(set(out) - set(src))]
    for m in sorted(set(src) & set(out)):
        s, o = src[m], out[m]
        if isinstance(s, MX):
            if s.codes.shape != o.codes.shape or s.exps.shape != o.exps.shape:
                problems.append(f"{m}: shape {o.codes.shape} in the output, {s.codes.shape} in the source")
            elif not (np.array_equal(s.codes, o.codes) and np.array_equal(s.exps, o.exps)):
                problems.append(f"{m}: MXFP4 source not bit-exact: {int((s.codes != o.codes).sum())} codes, "
                                f"{int((s.exps != o.exps).sum())} scales differ")
            continue
        x = s.values
        if x.shape != o.codes.shape:
            problems.append(f"{m}: shape {o.codes.shape} in the output, {x.shape} in the source")
            continue
        xb = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
        amax = np.abs(xb).max(-1)
        e_out = o.exps.astype(np.float64) - 127
        er = np.clip(rceil(np.where(amax == 0, 1.0, amax)), -127, 127)
        off = (amax > 0) & (e_out != er) & (e_out != np.clip(er - 1, -127, 127))
        if off.any():
            shift = np.median((e_out - er)[off])
            problems.append(f"{m}: {int(off.sum())} of {off.size} block scales not within one MXFP4 rounding of the "
                            f"source (median {shift:+.0f} binades from RCEIL of the source block's maximum)")
            continue
        rounded = _encode(xb * np.exp2(-e_out)[..., None]).reshape(x.shape)
        if not np.array_equal(rounded, o.codes):
            bad = int((rounded != o.codes).sum())
            problems.append(f"{m}: {bad} of {x.size} codes are not the nearest E2M1 value of the source at their scale")
            continue
        want = requantize(x)
        if not (np.array_equal(want.exps, o.exps) and np.array_equal(want.codes, o.codes)):
            problems.append(f"{m}: not the MSE rule's choice: {int((want.exps != o.exps).sum())} of {o.exps.size} "
                            "block scales differ from the float64 model")
    if len(problems) > limit:
        problems = [*problems[:limit], f"... and {len(problems) - limit} more"]
    return problems
