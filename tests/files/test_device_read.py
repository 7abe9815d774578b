"""Source tensors read onto a CUDA device through two small pinned buffers (``files/device_read``):
the window plan (pure, on the CPU) and, on a GPU, the bytes against the host read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mxfp4conv.files.device_read import plan_windows
from mxfp4conv.files.safetensors import TensorRef

_CUDA = torch.cuda.is_available()


def _ref(name: str, nbytes: int, begin: int = 0) -> TensorRef:
    return TensorRef(Path("/x"), name, "U8", (nbytes,), begin, begin + nbytes)


def test_windows_split_tensors_at_their_edges() -> None:
    a, b, c = _ref("a", 5), _ref("b", 7, 100), _ref("c", 4, 50)
    # out = a | c | b; given in another order: the plan sorts by destination
    got = plan_windows([(b, 9), (a, 0), (c, 5)], 16, 6)
    assert got == [
        (0, 6, [(a, 0, 0, 5), (c, 0, 5, 1)]),
        (6, 12, [(c, 1, 0, 3), (b, 0, 3, 3)]),
        (12, 16, [(b, 3, 0, 4)]),
    ]


def test_one_tensor_over_several_windows_and_empty_tensors() -> None:
    big, empty = _ref("big", 10), _ref("e", 0)
    assert plan_windows([(empty, 0), (big, 0)], 10, 4) == [
        (0, 4, [(big, 0, 0, 4)]), (4, 8, [(big, 4, 0, 4)]), (8, 10, [(big, 8, 0, 2)])]
    assert plan_windows([], 0, 4) == []


@pytest.mark.parametrize(("items", "total", "match"), [
    ([("a", 4, 0), ("b", 4, 5)], 9, "expected 4 .gap or overlap"),
    ([("a", 4, 0), ("b", 4, 3)], 7, "expected 4 .gap or overlap"),
    ([("a", 4, 0)], 6, "fill 4 bytes of a 6-byte"),
])
def test_a_destination_not_tiled_exactly_is_refused(items: list[tuple[str, int, int]], total: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_windows([(_ref(n, size), at) for n, size, at in items], total, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
@pytest.mark.parametrize("stage", [4096, 64 << 20])
def test_a_unit_read_onto_the_device_equals_the_host_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          stage: int) -> None:
    """Every layout reading NVFP4 stacks: the device copy equals the host copy byte for byte, with
    buffers smaller than one tensor (many windows, tensors split between them) and larger than the unit."""
    from mxfp4conv.files import device_read
    from mxfp4conv.layouts import detect_layout
    from mxfp4conv.model.canonical import MoELayer
    from mxfp4conv.sources.checkpoint import open_checkpoint
    from tests.builders import build

    device_read.STAGES.clear(stage)  # stages of this size from here on
    try:
        for layout in ("modelopt-nvfp4", "ct-nvfp4"):
            src = build(layout, tmp_path / layout, layers=2, experts=8, hidden=256, inter=128, shards=2)
            ckpt = open_checkpoint(src)
            lay, _ = detect_layout(ckpt)
            plan = lay.plan(ckpt)
            units = [u for u in plan.units if u.kind == "moe"]
            assert units
            for spec in units:
                host = lay.read(ckpt, spec)
                dev = lay.read(ckpt, spec, device="cuda:0")
                assert isinstance(host, MoELayer) and isinstance(dev, MoELayer)
                for hw, dw in ((host.w13, dev.w13), (host.w2, dev.w2)):
                    assert dw.packed.is_cuda and dw.scales.is_cuda
                    assert torch.equal(hw.packed, dw.packed.cpu())
                    assert torch.equal(hw.scales.view(torch.uint8), dw.scales.view(torch.uint8).cpu())
                    assert hw.global_rows is not None and dw.global_rows is not None
                    assert torch.equal(hw.global_rows, dw.global_rows)
    finally:
        device_read.STAGES.clear(device_read.STAGE_BYTES)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
@pytest.mark.parametrize("divisor", [False, True])
def test_a_device_resident_weight_requantizes_to_the_cpu_bytes(divisor: bool) -> None:
    """NVFP4 already on the device: the same bytes and statistics as the CPU path, and invalid scales
    (NaN block scale, zero global scale, a block out of range) raise the CPU path's words."""
    from mxfp4conv.formats.mxfp4 import ScaleRule
    from mxfp4conv.model.canonical import FP4Weight
    from mxfp4conv.numerics.requant import requant_nvfp4_to_mxfp4

    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (4, 96, 128), dtype=torch.uint8, generator=gen)
    sc = torch.randint(0x30, 0x50, (4, 96, 16), dtype=torch.uint8, generator=gen)
    g = torch.rand((4, 96), generator=gen) + 0.5
    w = FP4Weight("nvfp4", packed, sc.view(torch.float8_e4m3fn), g, divisor)
    on = FP4Weight("nvfp4", packed.cuda(), sc.view(torch.float8_e4m3fn).cuda(), g, divisor)
    for rule in (ScaleRule.MSE, ScaleRule.EVEN):
        cpu, cs = requant_nvfp4_to_mxfp4(w, rule, device="cpu")
        gpu, gs = requant_nvfp4_to_mxfp4(on, rule, device="cuda:0")
        assert not gpu.packed.is_cuda
        assert torch.equal(cpu.packed, gpu.packed) and torch.equal(cpu.scales, gpu.scales)
        assert cs.to_dict() == gs.to_dict()
    nan = sc.clone()
    nan[1, 7, 3] = 0x7F
    zero = g.clone()
    zero[2, 5] = 0.0
    huge = sc.clone()
    huge[3, 1, 2] = 0x7E  # 448 * 6 * g
    big = g * (2.0 ** 120) if not divisor else g / (2.0 ** 120)
    for s_, g_ in ((nan, g), (sc, zero), (huge, big)):
        msgs = []
        for dev in ("cpu", "cuda:0"):
            s_on = s_.view(torch.float8_e4m3fn) if dev == "cpu" else s_.view(torch.float8_e4m3fn).cuda()
            p_on = packed if dev == "cpu" else packed.cuda()
            with pytest.raises(ValueError) as info:
                requant_nvfp4_to_mxfp4(FP4Weight("nvfp4", p_on, s_on, g_, divisor), ScaleRule.MSE, device=dev)
            msgs.append(str(info.value))
        assert msgs[0] == msgs[1] and msgs[0].startswith("invalid NVFP4 input"), msgs
