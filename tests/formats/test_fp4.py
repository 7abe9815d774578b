"""Golden bit tables for E2M1 / E8M0 / E4M3 (mxfp4conv.formats.fp4), written by hand, plus
cross-checks against torch's and ml_dtypes' own casts where those exist."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mxfp4conv.formats.fp4 import (
    E2M1_VALUES,
    E8M0_BIAS,
    F4_E2M1_MAX,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_has_nan,
    e4m3_nan_mask,
    e8m0_decode,
    e8m0_encode,
    e8m0_has_nan,
    pack_nibbles,
    pow2_float32,
    pow2_float64,
    unpack_nibbles,
)


def f32(v: float) -> float:
    return float(np.float32(v))


def up(v: float) -> float:
    """Next float32 above v."""
    return float(np.nextafter(np.float32(v), np.float32(np.inf)))


def down(v: float) -> float:
    """Next float32 below v."""
    return float(np.nextafter(np.float32(v), np.float32(-np.inf)))


# code -> value, every code, by hand (OCP MX v1.0 FP4 E2M1 table).
DECODE_TABLE = {
    0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5,
    0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0,
    0b1000: -0.0, 0b1001: -0.5, 0b1010: -1.0, 0b1011: -1.5,
    0b1100: -2.0, 0b1101: -3.0, 0b1110: -4.0, 0b1111: -6.0,
}  # fmt: skip


def test_e2m1_decode_every_code() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    got = e2m1_decode(codes).tolist()
    for c, want in DECODE_TABLE.items():
        assert got[c] == want and math.copysign(1, got[c]) == math.copysign(1, want), c
    assert list(E2M1_VALUES) == [DECODE_TABLE[c] for c in range(16)]
    assert F4_E2M1_MAX == 6.0
    assert e2m1_decode(codes).dtype == torch.float32


# (input, code): every midpoint tie, one float32 ulp either side, grid points, saturation, signs.
ENCODE_GOLDEN = [
    (0.0, 0b0000), (-0.0, 0b1000),
    (1e-45, 0b0000), (-1e-45, 0b1000),  # smallest subnormal
    (0.25, 0b0000), (down(0.25), 0b0000), (up(0.25), 0b0001),  # tie -> 0 (even)
    (0.5, 0b0001),
    (0.75, 0b0010), (down(0.75), 0b0001), (up(0.75), 0b0010),  # tie -> 1.0 (code 2)
    (1.0, 0b0010),
    (1.25, 0b0010), (down(1.25), 0b0010), (up(1.25), 0b0011),  # tie -> 1.0
    (1.5, 0b0011),
    (1.75, 0b0100), (down(1.75), 0b0011), (up(1.75), 0b0100),  # tie -> 2.0
    (2.0, 0b0100),
    (2.5, 0b0100), (down(2.5), 0b0100), (up(2.5), 0b0101),  # tie -> 2.0
    (3.0, 0b0101),
    (3.5, 0b0110), (down(3.5), 0b0101), (up(3.5), 0b0110),  # tie -> 4.0
    (4.0, 0b0110),
    (5.0, 0b0110), (down(5.0), 0b0110), (up(5.0), 0b0111),  # tie -> 4.0
    (6.0, 0b0111), (down(6.0), 0b0111), (up(6.0), 0b0111),
    (7.0, 0b0111), (8.0, 0b0111), (1e30, 0b0111), (3.4e38, 0b0111), (math.inf, 0b0111),
    (-0.1, 0b1000), (-0.25, 0b1000), (-0.26, 0b1001),  # negative rounding to zero keeps the sign
    (-0.75, 0b1010), (-1.75, 0b1100), (-2.5, 0b1100), (-3.5, 0b1110), (-5.0, 0b1110),
    (-6.0, 0b1111), (-100.0, 0b1111), (-math.inf, 0b1111),
]  # fmt: skip


def test_e2m1_encode_golden() -> None:
    x = torch.tensor([v for v, _ in ENCODE_GOLDEN], dtype=torch.float32)
    got = e2m1_encode(x).tolist()
    for (v, want), g in zip(ENCODE_GOLDEN, got, strict=True):
        assert g == want, f"encode({v!r}) = {g:#06b}, want {want:#06b}"


def test_e2m1_roundtrip_and_dtype_checks() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1_encode(e2m1_decode(codes)), codes)
    with pytest.raises(TypeError):
        e2m1_encode(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError):
        e2m1_decode(torch.zeros(2, dtype=torch.int32))


def _dense_grid() -> np.ndarray:
    """Every float32 tie and its ulp neighbours, scaled by 2^-3..2^3, plus random values."""
    pts = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    vals = []
    for p in pts:
        for k in range(-3, 4):
            v = np.float32(p * 2.0**k)
            vals += [v, np.nextafter(v, np.float32(0)), np.nextafter(v, np.float32(np.inf))]
    rng = np.random.default_rng(0)
    vals += list(rng.uniform(0, 8, 20000).astype(np.float32))
    a = np.array(vals, dtype=np.float32)
    return np.concatenate([a, -a, np.array([0.0, -0.0], np.float32)])


def test_e2m1_encode_matches_ml_dtypes() -> None:
    ml = pytest.importorskip("ml_dtypes")
    if not hasattr(ml, "float4_e2m1fn"):
        pytest.skip("ml_dtypes has no float4_e2m1fn")
    a = _dense_grid()
    want = a.astype(ml.float4_e2m1fn).view(np.uint8) & 0xF
    got = e2m1_encode(torch.from_numpy(a)).numpy()
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(a[i]), int(got[i]), int(want[i])) for i in bad[:5]]


def test_e2m1_encode_matches_torch_float4_cast() -> None:
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("torch has no float4_e2m1fn_x2")
    a = torch.from_numpy(_dense_grid())
    a = a[: a.numel() // 2 * 2]
    try:
        packed = a.to(torch.float4_e2m1fn_x2).view(torch.uint8)
    except (NotImplementedError, RuntimeError, TypeError) as exc:
        pytest.skip(f"torch cannot cast float32 -> float4_e2m1fn_x2 here: {exc}")
    # one code per byte, or two packed per byte
    want = packed & 0xF if packed.numel() == a.numel() else unpack_nibbles(packed.reshape(-1))
    assert torch.equal(e2m1_encode(a), want)


def test_nibble_order_binary_literals() -> None:
    codes = torch.tensor([[0b0001, 0b1010, 0b0111, 0b1000]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0b1010_0001, 0b1000_0111]]  # element 2i -> LOW nibble
    assert torch.equal(unpack_nibbles(packed), codes)
    assert unpack_nibbles(torch.tensor([0b1111_0000], dtype=torch.uint8)).tolist() == [0b0000, 0b1111]


def test_pack_unpack_random_roundtrip_and_errors() -> None:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(unpack_nibbles(packed), codes)
    b = torch.randint(0, 256, (7, 9), generator=g, dtype=torch.uint8)
    assert torch.equal(pack_nibbles(unpack_nibbles(b)), b)
    with pytest.raises(ValueError):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError):
        pack_nibbles(torch.tensor([16, 0], dtype=torch.uint8))


def test_pow2_helpers_exact() -> None:
    k = torch.arange(-149, 128, dtype=torch.int32)
    assert pow2_float32(k).double().tolist() == [math.ldexp(1.0, int(i)) for i in k]
    k64 = torch.arange(-1022, 1024)
    assert pow2_float64(k64).tolist() == [math.ldexp(1.0, int(i)) for i in k64]


def test_e8m0_decode_every_byte() -> None:
    b = torch.arange(0, 255, dtype=torch.uint8)
    got = e8m0_decode(b)
    assert got.dtype == torch.float32
    assert got.double().tolist() == [math.ldexp(1.0, i - 127) for i in range(255)]
    assert e8m0_decode(torch.tensor([0, 127, 254], dtype=torch.uint8)).tolist() == [
        2.0**-127,
        1.0,
        2.0**127,
    ]
    assert E8M0_BIAS == 127
    with pytest.raises(ValueError, match="0xFF"):
        e8m0_decode(torch.tensor([3, 255], dtype=torch.uint8))


def test_e8m0_encode_clamps() -> None:
    e = torch.tensor([-300, -128, -127, -1, 0, 1, 126, 127, 128, 1000], dtype=torch.int64)
    assert e8m0_encode(e).tolist() == [0, 0, 0, 126, 127, 128, 253, 254, 254, 254]
    assert e8m0_encode(e.to(torch.int32)).dtype == torch.uint8
    with pytest.raises(TypeError):
        e8m0_encode(torch.zeros(1))


def test_e8m0_matches_torch_float8_e8m0fnu() -> None:
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("torch has no float8_e8m0fnu")
    b = torch.arange(0, 255, dtype=torch.uint8)
    assert torch.equal(e8m0_decode(b), b.view(torch.float8_e8m0fnu).float())
    assert torch.isnan(torch.tensor([255], dtype=torch.uint8).view(torch.float8_e8m0fnu).float()).all()
    # encode: exact powers of two 2^k cast by torch give the same byte
    k = torch.arange(-127, 128)
    want = torch.tensor([math.ldexp(1.0, int(i)) for i in k]).to(torch.float8_e8m0fnu).view(torch.uint8)
    assert torch.equal(e8m0_encode(k), want)


# byte -> value for E4M3 (OFP8 rev 1.0), by hand
E4M3_GOLDEN = {
    0x00: 0.0, 0x80: -0.0, 0x01: 2.0**-9, 0x07: 7 * 2.0**-9, 0x08: 2.0**-6, 0x30: 0.5, 0x38: 1.0,
    0x39: 1.125, 0x40: 2.0, 0x44: 3.0, 0x7E: 448.0, 0xFE: -448.0, 0xB8: -1.0, 0x81: -(2.0**-9),
}  # fmt: skip


def test_e4m3_decode_golden_and_nan() -> None:
    bits = torch.tensor(list(E4M3_GOLDEN), dtype=torch.uint8)
    got = e4m3_decode(bits).tolist()
    for (b, want), g in zip(E4M3_GOLDEN.items(), got, strict=True):
        assert g == want and math.copysign(1, g) == math.copysign(1, want), hex(b)
    nan = e4m3_decode(torch.tensor([0x7F, 0xFF], dtype=torch.uint8))
    assert torch.isnan(nan).all()
    mask = e4m3_nan_mask(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    assert torch.nonzero(mask).flatten().tolist() == [0x7F, 0xFF]


def test_nan_checks_every_byte_in_company() -> None:
    """e4m3_has_nan / e8m0_has_nan against the masks, for every byte beside the bytes around the fast
    path's threshold (it decides on the largest byte: 0x7E, 0x80..0xFE must not fool it)."""
    for b in range(256):
        for other in (0x00, 0x38, 0x7E, 0x7F, 0x80, 0xB8, 0xFE, 0xFF):
            t = torch.tensor([[other, b], [0x38, 0x38]], dtype=torch.uint8)
            nan = bool({b, other} & {0x7F, 0xFF})
            assert e4m3_has_nan(t) == bool(e4m3_nan_mask(t).any()) == nan, (hex(b), hex(other))
            assert e4m3_has_nan(t.view(torch.float8_e4m3fn)) == nan
            assert e8m0_has_nan(t) == (0xFF in (b, other))
    assert not e4m3_has_nan(torch.empty(0, 4, dtype=torch.uint8)) and not e8m0_has_nan(torch.empty(0, dtype=torch.uint8))


def test_e4m3_matches_torch_cast_all_256() -> None:
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    f8 = bits.view(torch.float8_e4m3fn)
    want = f8.float()
    for got in (e4m3_decode(bits), e4m3_decode(f8)):
        assert got.dtype == torch.float32
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        ok = ~torch.isnan(want)
        assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32))  # incl. -0.0
    assert torch.equal(e4m3_nan_mask(f8), torch.isnan(want))
    with pytest.raises(TypeError):
        e4m3_decode(torch.zeros(2, dtype=torch.float32))
