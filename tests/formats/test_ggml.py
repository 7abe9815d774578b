"""mxfp4conv/formats/ggml.py (and kernels/ggml_native.py, the C re-layout ``--to gguf`` runs): OCP MXFP4 codes +
E8M0 scales <-> GGML's MXFP4 blocks (``GGML_TYPE_MXFP4``).

The rule, written here from the two formats' definitions and not from the module's formulas:

* OCP (compressed-tensors, GPT-OSS, Quark): byte ``k`` = element ``2k`` in the low nibble | element ``2k + 1``
  in the high nibble; the E8M0 scales are a separate tensor.
* GGML: a block of 32 elements is 17 bytes, the scale byte first, then byte ``1 + j`` = element ``j`` in the
  low nibble | element ``j + 16`` in the high nibble.

The golden blocks below are written out literally; ``ref_to_ggml`` applies the rule element by element for
random tensors. The ``gguf`` package (llama.cpp's own Python quantizer and dequantizer) is the independent
check of the values: its dequantization of the GGML blocks is the plain float decoding of the OCP codes
(E2M1 x 2^(e - 127), as tests/oracle.py reads a source), and its quantizer writes the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from mxfp4conv.formats import ggml
from mxfp4conv.formats.ggml import BLOCK, BLOCK_BYTES
from mxfp4conv.kernels import ggml_native

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


@dataclass(frozen=True)
class Impl:
    to: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    back: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(params=["torch", "native"])
def impl(request: pytest.FixtureRequest) -> Impl:
    """The definition (formats/ggml.py) and the C re-layout --to gguf encodes and decodes with."""
    if request.param == "torch":
        return Impl(ggml.to_ggml_mxfp4, ggml.from_ggml_mxfp4)
    if ggml_native.native() is None:
        pytest.skip("no C compiler: the torch path is the only one")
    return Impl(ggml_native.to_ggml_mxfp4, ggml_native.from_ggml_mxfp4)


def _u8(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.uint8)


# ------------------------------------------------------------------ golden blocks
# (element codes of one 32-element block, its scale byte, the 16 OCP bytes, the 17 GGML bytes)
ASCENDING_DESCENDING = [*range(16), *range(15, -1, -1)]  # elements 0..15 = codes 0..15, 16..31 = codes 15..0
GOLDEN: list[tuple[str, list[int], int, list[int], list[int]]] = [
    ("ascending-descending", ASCENDING_DESCENDING, 0x7F,
     # OCP byte k: element 2k | element 2k+1 << 4; k < 8: (2k, 2k+1), k >= 8: (15 - 2m, 14 - 2m) with m = k - 8
     [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE, 0xEF, 0xCD, 0xAB, 0x89, 0x67, 0x45, 0x23, 0x01],
     # scale, then GGML byte j: element j (= j) | element j+16 (= 15 - j) << 4
     [0x7F, 0xF0, 0xE1, 0xD2, 0xC3, 0xB4, 0xA5, 0x96, 0x87, 0x78, 0x69, 0x5A, 0x4B, 0x3C, 0x2D, 0x1E, 0x0F]),
    ("element-1-and-17", [0, 3, *[0] * 15, 5, *[0] * 14], 0x80,
     # element 1 -> OCP byte 0 high nibble, element 17 -> OCP byte 8 high nibble
     [0x30, 0, 0, 0, 0, 0, 0, 0, 0x50, 0, 0, 0, 0, 0, 0, 0],
     # element 1 -> GGML byte 1 low nibble, element 17 -> GGML byte 1 high nibble
     [0x80, 0x00, 0x53, *[0] * 14]),
    ("element-16-and-31", [*[0] * 16, 0xA, *[0] * 14, 0x7], 0x01,
     # element 16 -> OCP byte 8 low, element 31 -> OCP byte 15 high
     [0, 0, 0, 0, 0, 0, 0, 0, 0x0A, 0, 0, 0, 0, 0, 0, 0x70],
     # element 16 -> GGML byte 0 high, element 31 -> GGML byte 15 high
     [0x01, 0xA0, *[0] * 14, 0x70]),
    ("negative-zero", [8] * 32, 0xFE, [0x88] * 16, [0xFE, *[0x88] * 16]),
]


@pytest.mark.parametrize(("codes", "scale", "ocp", "blocks"), [g[1:] for g in GOLDEN], ids=[g[0] for g in GOLDEN])
def test_golden_block(codes: list[int], scale: int, ocp: list[int], blocks: list[int], impl: Impl) -> None:
    assert len(codes) == BLOCK and len(ocp) == 16 and len(blocks) == BLOCK_BYTES
    assert [c for k in range(16) for c in (ocp[k] & 0xF, ocp[k] >> 4)] == codes, "the OCP bytes are the codes"
    assert ref_to_ggml(np.array([ocp], np.uint8), np.array([[scale]], np.uint8)).tolist() == [blocks]
    got = impl.to(_u8([ocp]), _u8([[scale]]))
    assert got.dtype == torch.uint8 and got.tolist() == [blocks]
    packed, scales = impl.back(_u8([blocks]))
    assert packed.tolist() == [ocp] and scales.tolist() == [[scale]]


def test_two_blocks_in_a_row_stay_in_order(impl: Impl) -> None:
    """A row of two blocks is two 17-byte blocks side by side, each with its own scale first."""
    a, b = GOLDEN[0], GOLDEN[1]
    got = impl.to(_u8([a[3] + b[3]]), _u8([[a[2], b[2]]]))
    assert got.tolist() == [a[4] + b[4]]
    packed, scales = impl.back(got)
    assert packed.tolist() == [a[3] + b[3]] and scales.tolist() == [[a[2], b[2]]]


# ------------------------------------------------------------------ element-by-element reference
def ref_to_ggml(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The rule applied one element at a time: unpack the OCP codes, repack 32 at a time as GGML blocks."""
    lead, nb = packed.shape[:-1], scales.shape[-1]
    flat_p, flat_s = packed.reshape(-1, packed.shape[-1]), scales.reshape(-1, nb)
    out = np.zeros((flat_p.shape[0], nb * 17), np.uint8)
    for r in range(flat_p.shape[0]):
        codes = [int(flat_p[r, i // 2]) >> (4 * (i % 2)) & 0xF for i in range(32 * nb)]
        for blk in range(nb):
            out[r, 17 * blk] = flat_s[r, blk]
            for j in range(16):
                out[r, 17 * blk + 1 + j] = codes[32 * blk + j] | codes[32 * blk + j + 16] << 4
    return out.reshape(*lead, nb * 17)


@pytest.mark.parametrize("lead", [(), (3,), (2, 5), (2, 3, 4)])
def test_random_tensors_with_leading_dims(lead: tuple[int, ...], impl: Impl) -> None:
    g = torch.Generator().manual_seed(len(lead))
    nb = 3
    packed = torch.randint(0, 256, (*lead, nb * 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (*lead, nb), generator=g, dtype=torch.uint8)
    blocks = impl.to(packed, scales)
    assert blocks.shape == (*lead, nb * BLOCK_BYTES) and blocks.dtype == torch.uint8
    assert np.array_equal(blocks.numpy(), ref_to_ggml(packed.numpy(), scales.numpy())), "not the element rule"
    back_p, back_s = impl.back(blocks)
    assert torch.equal(back_p, packed) and torch.equal(back_s, scales), "OCP -> GGML -> OCP is not the identity"
    gg = torch.randint(0, 256, (*lead, nb * BLOCK_BYTES), generator=g, dtype=torch.uint8)
    assert torch.equal(impl.to(*impl.back(gg)), gg), "GGML -> OCP -> GGML is not the identity"


def test_a_non_contiguous_slice_converts_as_its_copy(impl: Impl) -> None:
    """The writer converts row slices of a stacked w13 (gate rows, then up rows)."""
    g = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (4, 8, 32), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (4, 8, 2), generator=g, dtype=torch.uint8)
    got = impl.to(packed[:, 4:], scales[:, 4:])
    assert torch.equal(got, impl.to(packed[:, 4:].contiguous(), scales[:, 4:].contiguous()))


def test_negative_zero_keeps_its_code(impl: Impl) -> None:
    """Code 8 (-0) stays code 8 both ways (ggml decodes it as +0: the same value)."""
    packed = _u8([[0x88, 0x08, 0x80, *[0x11] * 13]])
    blocks = impl.to(packed, _u8([[127]]))
    nibbles = [n for b in blocks[0, 1:].tolist() for n in (b & 0xF, b >> 4)]
    assert nibbles.count(8) == 4, nibbles
    assert torch.equal(impl.back(blocks)[0], packed)
    values = dequantize(blocks.numpy(), GGMLQuantizationType.MXFP4)
    assert values.shape == (1, 32) and np.count_nonzero(values == 0) == 6  # four codes 8, two codes 0
    assert not np.signbit(values).any(), "ggml's table holds no -0"


# ------------------------------------------------------------------ shape errors
def test_a_row_that_is_not_whole_blocks_is_refused(impl: Impl) -> None:
    for width in (16, 18, 33):
        with pytest.raises(ValueError, match=f"a row of {width} bytes is not a whole number of 17-byte"):
            impl.back(torch.zeros((2, width), dtype=torch.uint8))


@pytest.mark.parametrize(("packed", "scales"), [
    ((2, 15), (2, 1)),  # half a block of codes short
    ((2, 32), (2, 1)),  # two blocks of codes, one scale
    ((2, 16), (2, 2)),  # one block of codes, two scales
    ((3, 16), (2, 1)),  # rows disagree
    ((2, 2, 16), (2, 1)),  # leading dims disagree
])
def test_codes_and_scales_that_disagree_are_refused(packed: tuple[int, ...], scales: tuple[int, ...],
                                                    impl: Impl) -> None:
    with pytest.raises(ValueError, match=r"are not one MXFP4 tensor"):
        impl.to(torch.zeros(packed, dtype=torch.uint8), torch.zeros(scales, dtype=torch.uint8))


# ------------------------------------------------------------------ the gguf package
def ocp_values(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """tests/oracle.py's reading of OCP MXFP4: E2M1[code] x 2^(e - 127), element 2i in the low nibble."""
    codes = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = packed & 0x0F, packed >> 4
    return E2M1[codes] * np.repeat(np.exp2(scales.astype(np.float64) - 127), 32, axis=-1)


def test_gguf_dequantizes_the_blocks_to_the_ocp_values(impl: Impl) -> None:
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (4, 6, 64), generator=g, dtype=torch.uint8)
    # every E8M0 byte whose values float32 holds: 6 x 2^(252 - 127) is under float32's largest; 0 and 1 are
    # ggml's subnormal halves of the scale
    scales = torch.randint(0, 253, (4, 6, 4), generator=g, dtype=torch.uint8)
    scales[0, 0] = torch.tensor([0, 1, 127, 252], dtype=torch.uint8)
    got = dequantize(impl.to(packed, scales).numpy(), GGMLQuantizationType.MXFP4)
    want = ocp_values(packed.numpy(), scales.numpy())
    assert got.shape == want.shape == (4, 6, 128)
    assert np.array_equal(got.astype(np.float64), want), f"{int((got != want).sum())} values differ"
    swapped = impl.to(packed, scales).numpy().reshape(4, 6, 4, 17)[..., [0, *range(9, 17), *range(1, 9)]]
    assert not np.array_equal(dequantize(swapped.reshape(4, 6, 68), GGMLQuantizationType.MXFP4), want)


def test_gguf_quantizes_exact_values_to_the_same_bytes(impl: Impl) -> None:
    """Values an MXFP4 block holds exactly, each block with a +-6 x 2^k element (so ggml's scale rule picks k),
    no -0: llama.cpp's quantizer writes the bytes ``to_ggml_mxfp4`` makes from their OCP codes."""
    rng = np.random.default_rng(5)
    rows, nb = 8, 4
    codes = rng.choice([c for c in range(16) if c != 8], size=(rows, nb, 32)).astype(np.uint8)
    codes[..., rng.integers(0, 32)] = rng.choice([7, 15], size=(rows, nb))
    exps = rng.integers(117, 137, size=(rows, nb)).astype(np.uint8)
    flat = codes.reshape(rows, nb * 32)
    packed = (flat[:, 0::2] | flat[:, 1::2] << 4).astype(np.uint8)
    values = ocp_values(packed, exps).astype(np.float32)
    want = quantize(values, GGMLQuantizationType.MXFP4)
    got = impl.to(torch.from_numpy(packed), torch.from_numpy(exps)).numpy()
    assert got.shape == want.shape == (rows, nb * 17)
    assert np.array_equal(got, want), f"{int((got != want).sum())} bytes differ from gguf's quantizer"
