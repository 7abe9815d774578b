"""mxfp4conv/layouts/deepseek_v4.py: DeepSeek-V4's native MXFP4 experts (I8 codes, F8_E8M0 ``.scale``) beside
FP8 Linears with E8M0 128x128 block scales."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mxfp4conv.layouts import deepseek_v4, detect_layout
from mxfp4conv.model.canonical import MoELayer
from mxfp4conv.model.precision import Fp8Linear
from mxfp4conv.plan.inspect import analyze
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests import builders
from tests.layouts.helpers import ALL_SOURCES, Source, detections


@pytest.mark.parametrize("name", ALL_SOURCES)
def test_detect_claims_only_its_own_checkpoints(source: Source, name: str) -> None:
    found = detections(open_checkpoint(source(name)))
    assert ("deepseek-v4-mxfp4" in found) == (name == "deepseek-v4"), found
    if name == "deepseek-v4":
        assert list(found) == ["deepseek-v4-mxfp4"]


def test_detect_evidence(source: Source) -> None:
    ev = deepseek_v4.detect(open_checkpoint(source("deepseek-v4")))
    assert ev is not None
    assert ev[0] == "config.json quantization_config.quant_method = fp8"
    assert len(ev) == 2
    assert ev[1].startswith("tensor layers.") and ev[1].endswith(".weight (I8 E2M1 + F8_E8M0 scale)")
    assert ".ffn.experts." in ev[1]


def test_without_a_config_the_tensors_decide(tmp_path: Path) -> None:
    layout, ev = detect_layout(open_checkpoint(builders.deepseek_v4(tmp_path / "v4", config=False)))
    assert layout is deepseek_v4
    assert len(ev) == 1 and ev[0].endswith("(I8 E2M1 + F8_E8M0 scale)")


def test_nvidias_nvfp4_release_is_not_this_layout(tmp_path: Path) -> None:
    assert deepseek_v4.detect(open_checkpoint(builders.deepseek_v4(tmp_path / "v4", weight_scale_2=True))) is None


def test_plan(source: Source) -> None:
    ckpt = open_checkpoint(source("deepseek-v4"))
    plan = deepseek_v4.plan(ckpt)
    assert plan.problems == []
    f = plan.facts
    assert (f.model_type, f.scheme, f.source_quant) == ("deepseek_v4", "w4a16", "mxfp4")
    assert (f.num_layers, f.num_experts, f.hidden_size, f.intermediate_size) == (2, 4, 128, 64)
    assert f.expert_names == ("w1", "w3", "w2")
    moe = [u for u in plan.units if u.kind == "moe"]
    assert [(u.key, u.dims, u.extra) for u in moe] == [
        (f"layers.{n}.ffn.experts", (4, 128, 64), {"gate": "w1", "up": "w3", "down": "w2"}) for n in range(2)]
    assert not [u for u in plan.units if u.kind == "dense"]
    passthrough = {u.key for u in plan.units if u.kind == "passthrough"}
    assert {"layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale", "layers.1.ffn.shared_experts.w2.scale"} <= passthrough
    assert deepseek_v4.declared(ckpt).listed == {} and deepseek_v4.declared(ckpt).unquantized == ()


def test_read_reinterprets_the_i8_codes_and_e8m0_scales_as_bytes(source: Source) -> None:
    src = source("deepseek-v4")
    ckpt = open_checkpoint(src)
    spec = next(u for u in deepseek_v4.plan(ckpt).units if u.kind == "moe" and u.key == "layers.1.ffn.experts")
    unit = deepseek_v4.read(ckpt, spec)
    assert isinstance(unit, MoELayer)
    raw: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        raw.update(load_file(str(f)))
    assert unit.w13.quant == "mxfp4" and unit.w13.packed.dtype == torch.uint8 and unit.w13.scales.dtype == torch.uint8
    assert unit.w13.packed.shape == (4, 128, 64) and unit.w2.packed.shape == (4, 128, 32)
    p = spec.key
    for e in range(4):
        assert torch.equal(unit.w13.packed[e, :64], raw[f"{p}.{e}.w1.weight"].view(torch.uint8))
        assert torch.equal(unit.w13.packed[e, 64:], raw[f"{p}.{e}.w3.weight"].view(torch.uint8))
        assert torch.equal(unit.w13.scales[e, 64:], raw[f"{p}.{e}.w3.scale"].view(torch.uint8))
        assert torch.equal(unit.w2.packed[e], raw[f"{p}.{e}.w2.weight"].view(torch.uint8))


def test_precision_of_the_fp8_linears(source: Source) -> None:
    _, plan, _ = analyze(open_checkpoint(source("deepseek-v4")))
    assert plan.problems == []
    prec = plan.precision
    assert prec.foreign_fp4 == () and prec.inferred is False
    assert set(prec.fp8) == {f"layers.{n}.{m}" for n in range(2) for m in (
        "attn.wq_a", "attn.wo_b", "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")}
    assert prec.fp8["layers.0.attn.wo_b"] == Fp8Linear("layers.0.attn.wo_b", "fp8-block", "scale", "F8_E8M0")
    assert prec.bf16 == ("head", "layers.0.ffn.gate", "layers.1.ffn.gate")  # "embed" is an embedding


def test_the_mtp_layer_experts_are_a_unit_of_their_own(tmp_path: Path) -> None:
    plan = deepseek_v4.plan(open_checkpoint(builders.deepseek_v4(tmp_path / "v4", mtp=True)))
    assert plan.problems == []
    assert [(u.key, u.dims) for u in plan.units if u.kind == "moe"] == [
        ("layers.0.ffn.experts", (4, 128, 64)), ("layers.1.ffn.experts", (4, 128, 64)), ("mtp.0.ffn.experts", (4, 128, 64))]
