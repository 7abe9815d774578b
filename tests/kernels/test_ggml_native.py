"""mxfp4conv/kernels/ggml_native.py: the C re-layout gives the bytes of formats/ggml.py's definition."""

from __future__ import annotations

import pytest
import torch

from mxfp4conv.formats import ggml
from mxfp4conv.kernels import ggml_native


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if ggml_native.native() is None:
        pytest.skip("no C compiler: the torch path is the only one (tests/formats/test_ggml.py)")


@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (4, 6, 64), (2, 1, 5)])
def test_both_directions_match_the_torch_definition(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    *lead, nb = shape
    packed = torch.randint(0, 256, (*lead, nb * 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (*lead, nb), dtype=torch.uint8, generator=g)
    blocks = ggml_native.to_ggml_mxfp4(packed, scales)
    assert torch.equal(blocks, ggml.to_ggml_mxfp4(packed, scales))
    back = ggml_native.from_ggml_mxfp4(blocks)
    assert torch.equal(back[0], packed) and torch.equal(back[1], scales)


def test_row_slices_of_a_stack_are_read_through_their_strides() -> None:
    """The gate rows of a fused w13 stack ``[E, 2I, K/2]`` are a strided view: no copy is needed or made."""
    g = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (5, 12, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (5, 12, 4), dtype=torch.uint8, generator=g)
    for rows in (slice(0, 6), slice(6, 12)):
        got = ggml_native.to_ggml_mxfp4(packed[:, rows], scales[:, rows])
        assert torch.equal(got, ggml.to_ggml_mxfp4(packed[:, rows].contiguous(), scales[:, rows].contiguous()))


def test_mismatched_codes_and_scales_are_refused() -> None:
    with pytest.raises(ValueError, match="not one MXFP4 tensor"):
        ggml_native.to_ggml_mxfp4(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="17-byte"):
        ggml_native.from_ggml_mxfp4(torch.zeros(2, 18, dtype=torch.uint8))


def test_differs_finds_the_first_row_that_does_not_decode_to_the_source() -> None:
    """The proof's one-pass comparison: None for the encoding of the source; the row of one changed code
    nibble or scale byte; the same answers from the decode-then-compare path."""
    g = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (3, 8, 32), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 8, 2), dtype=torch.uint8, generator=g)
    rows = (slice(None), slice(0, 4))
    blocks = ggml.to_ggml_mxfp4(packed[rows], scales[rows])
    assert ggml_native.differs(blocks, packed[rows], scales[rows]) is None
    for at in (1 + 17 + 5, 0, 2 * 4 * 34 + 17):  # a code byte of row 0's second block, a scale, row 8's first block
        bad = blocks.clone().view(-1)
        bad[at] ^= 0x10
        row = at // 34
        assert ggml_native.differs(bad.view_as(blocks), packed[rows], scales[rows]) == row
        got_p, got_s = ggml.from_ggml_mxfp4(bad.view_as(blocks))
        assert not (torch.equal(got_p, packed[rows].contiguous()) and torch.equal(got_s, scales[rows].contiguous()))
