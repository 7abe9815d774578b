"""NVFP4 dequantization (ModelOpt multiplier vs compressed-tensors divisor) and scale validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mxfp4conv.formats.nvfp4 import MAX_REQUANT_MAGNITUDE, dequantize_nvfp4, validate_nvfp4_scales

E4M3_ONE = 0x38  # 1.0
E4M3_TWO = 0x40  # 2.0


def f8(bits: list[list[int]]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.uint8).view(torch.float8_e4m3fn)


def bits32(t: torch.Tensor) -> list[int]:
    return [int(b) & 0xFFFFFFFF for b in t.contiguous().view(torch.int32).flatten().tolist()]


def test_golden_multiplier_and_divisor() -> None:
    # one row, K=16: codes 1 (0.5), 10 (-1.0), 7 (6.0), 8 (-0.0), rest 0
    packed = torch.tensor([[0b1010_0001, 0b1000_0111, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    g = torch.tensor([4.0])
    w = dequantize_nvfp4(packed, f8([[E4M3_TWO]]), g, divisor=False)
    assert w[0, :4].tolist() == [4.0, -8.0, 48.0, -0.0] and math.copysign(1, w[0, 3].item()) < 0
    w = dequantize_nvfp4(packed, f8([[E4M3_TWO]]), g, divisor=True)
    assert w[0, :4].tolist() == [0.25, -0.5, 3.0, -0.0]
    assert w.dtype == torch.float32 and w.shape == (1, 16)


def test_division_is_true_ieee_division_not_reciprocal_multiply() -> None:
    # 6 / 7 rounds to 0x3F5B6DB7; 6 * fl(1/7) rounds to 0x3F5B6DB8.
    packed = torch.tensor([[0b0111] + [0] * 7], dtype=torch.uint8)
    g = torch.tensor([7.0])
    w = dequantize_nvfp4(packed, f8([[E4M3_ONE]]), g, divisor=True)
    assert bits32(w[0, :1]) == [0x3F5B6DB7]
    recip = dequantize_nvfp4(packed, f8([[E4M3_ONE]]), 1.0 / g, divisor=False)
    assert bits32(recip[0, :1]) == [0x3F5B6DB8]  # the classic bug would produce this


def test_per_row_global_scales_and_leading_dims() -> None:
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 4, 16), generator=g, dtype=torch.uint8)
    sc = torch.randint(0, 0x7F, (3, 4, 2), generator=g, dtype=torch.uint8)
    rows = torch.tensor([[1.0, 2.0, 0.5, 3.0]] * 3)  # e.g. gate rows then up rows with their own scale
    for divisor in (False, True):
        w = dequantize_nvfp4(packed, sc.view(torch.float8_e4m3fn), rows, divisor=divisor)
        assert w.shape == (3, 4, 32)
        # independent numpy float32 reference, element by element
        lut = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
        p = packed.numpy()
        codes = np.stack([p & 15, p >> 4], -1).reshape(3, 4, 32)
        s = sc.view(torch.float8_e4m3fn).float().numpy()
        ref = lut[codes] * np.repeat(s, 16, axis=-1)
        gg = rows.numpy()[..., None]
        ref = (ref / gg if divisor else ref * gg).astype(np.float32)
        assert np.array_equal(w.numpy().view(np.uint32), ref.view(np.uint32))


def test_uint8_scale_bits_accepted() -> None:
    packed = torch.tensor([[0x77] * 8], dtype=torch.uint8)
    a = dequantize_nvfp4(
        packed, torch.tensor([[0x01]], dtype=torch.uint8), torch.tensor([1.0]), divisor=False
    )
    assert a[0, 0].item() == 6 * 2.0**-9  # subnormal e4m3 block scale, exact


def test_shape_errors() -> None:
    packed = torch.zeros(2, 8, dtype=torch.uint8)
    with pytest.raises(ValueError):
        dequantize_nvfp4(packed, torch.zeros(2, 2, dtype=torch.uint8), torch.ones(2), divisor=False)
    with pytest.raises(ValueError):
        dequantize_nvfp4(packed, torch.zeros(2, 1, dtype=torch.uint8), torch.ones(3), divisor=False)


def test_validate_ok_and_messages() -> None:
    sc = torch.full((2, 3, 4), E4M3_ONE, dtype=torch.uint8)
    g = torch.ones(2, 3)
    assert validate_nvfp4_scales(sc.view(torch.float8_e4m3fn), g) is None
    assert validate_nvfp4_scales(sc, g, divisor=True) is None

    bad = sc.clone()
    bad[1, 2, 3] = 0x7F
    bad[1, 2, 0] = 0xFF  # first in row-major order
    assert validate_nvfp4_scales(bad, g) == "NaN e4m3 block scale at index (1, 2, 0)"

    g2 = g.clone()
    g2[0, 1] = 0.0
    assert validate_nvfp4_scales(sc, g2) == "zero global scale at row (0, 1)"
    g2[1, 0] = math.inf
    msg = validate_nvfp4_scales(sc, g2)
    assert msg is not None and msg.startswith("non-finite global scale inf at row (1, 0)")
    g3 = g.clone()
    g3[1, 1] = math.nan
    msg = validate_nvfp4_scales(sc, g3)
    assert msg is not None and "non-finite" in msg and "(1, 1)" in msg
    assert "shape" in (validate_nvfp4_scales(sc, torch.ones(3)) or "")


def test_validate_overflow_depends_on_convention() -> None:
    sc = torch.full((1, 2), 0x7E, dtype=torch.uint8)  # 448
    huge = torch.tensor([1e36])
    assert validate_nvfp4_scales(sc, huge) is None  # convention unknown: not checked
    assert validate_nvfp4_scales(sc, huge, divisor=True) is None  # 6 * 448 / 1e36 is tiny
    want = "dequantized value out of range (>= 1.75 * 2^127) at block (0, 0)"
    assert validate_nvfp4_scales(sc, huge, divisor=False) == want
    tiny = torch.tensor([1e-38])
    assert validate_nvfp4_scales(sc, tiny, divisor=True) is not None
    assert validate_nvfp4_scales(sc, tiny, divisor=False) is None
    # the edge: 6 * 448 * g just below / at 1.75 * 2^127
    edge = np.float32(MAX_REQUANT_MAGNITUDE) / np.float32(6 * 448)
    ok = torch.tensor([float(np.nextafter(edge, np.float32(0)))])
    assert float(np.float32(6 * 448) * ok.numpy()[0]) < MAX_REQUANT_MAGNITUDE
    assert validate_nvfp4_scales(sc, ok, divisor=False) is None
    bad = torch.tensor([float(np.nextafter(edge, np.float32(np.inf)))])
    assert validate_nvfp4_scales(sc, bad, divisor=False) == want


def _validate_brute(sc: torch.Tensor, g: torch.Tensor, divisor: bool) -> str | None:
    """The element-by-element checks, as the validator documents them (the reference)."""
    bits = sc.view(torch.uint8) if sc.dtype == torch.float8_e4m3fn else sc
    nan = (bits & 0x7F) == 0x7F
    if bool(nan.any()):
        return f"NaN e4m3 block scale at index {tuple(int(i) for i in nan.nonzero()[0])}"
    top = sc.view(torch.float8_e4m3fn).float() * 6.0
    top = (top / g[..., None] if divisor else top * g[..., None]).abs()
    over = top >= MAX_REQUANT_MAGNITUDE
    if bool(over.any()):
        return ("dequantized value out of range (>= 1.75 * 2^127) at block "
                f"{tuple(int(i) for i in over.nonzero()[0])}")
    return None


@pytest.mark.parametrize("divisor", [False, True])
def test_validate_row_maxima_decide_like_every_element(divisor: bool) -> None:
    """The validator reads only each row's largest magnitude byte; on random scales (every byte,
    signs, rare NaNs) and row scales placed on both sides of the overflow edge of each row's own
    maximum, it reports exactly what the element-by-element check reports."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(60):
        sc = torch.randint(0, 256, (3, 5, 8), generator=gen, dtype=torch.uint8)
        sc[(sc & 0x7F) == 0x7F] = 0x3F if trial % 7 else 0x7F  # NaNs in a few trials only
        mags = (sc & 0x7F)
        mags[mags == 0x7F] = 0
        row_top = mags.amax(-1).view(torch.float8_e4m3fn).float() * 6.0
        row_top[row_top == 0] = 1.0
        edge = (MAX_REQUANT_MAGNITUDE / row_top) if not divisor else (row_top / MAX_REQUANT_MAGNITUDE)
        edge = edge.float()
        nudge = torch.randint(-2, 3, edge.shape, generator=gen)  # a few ulps either side of the edge
        g = torch.tensor(np.nextafter(edge.numpy(), np.where(nudge.numpy() > 0, np.inf, 0)).astype(np.float32))
        g = torch.where(nudge == 0, edge, g)
        g = torch.where(torch.rand(edge.shape, generator=gen) < 0.1, g, torch.ones_like(g))
        g = g * torch.where(torch.rand(edge.shape, generator=gen) < 0.3, -1.0, 1.0)
        want = _validate_brute(sc, g, divisor)
        assert validate_nvfp4_scales(sc, g, divisor=divisor) == want, trial
        row_max = (sc & 0x7F).amax(-1)  # what the GPU requant hands over
        assert validate_nvfp4_scales(sc, g, divisor=divisor, row_max=row_max) == want, trial


def test_validate_row_max_shape_checked() -> None:
    sc = torch.full((2, 3, 4), E4M3_ONE, dtype=torch.uint8)
    with pytest.raises(ValueError, match="row_max"):
        validate_nvfp4_scales(sc, torch.ones(2, 3), row_max=torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="row_max"):
        validate_nvfp4_scales(sc, torch.ones(2, 3), row_max=torch.zeros(2, 3))
