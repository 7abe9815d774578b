"""mxfp4conv/layouts/quark_mxfp4.py (+ quark_common.py): AMD Quark MXFP4, W4A16 and W4A4, and what its
config declares (exclude, layer_quant_config, the FP8 KV cache)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from mxfp4conv.layouts import detect_layout, quark_mxfp4
from mxfp4conv.model.canonical import DenseFP4, MoELayer
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests import builders
from tests.layouts.helpers import ALL_SOURCES, Source, detections, edit_config

OWN = {"quark-mxfp4", "quark-mxfp4-w4a4"}
FP8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}
@pytest.mark.parametrize("name", ALL_SOURCES)
def test_detect_claims_only_its_own_checkpoints(source: Source, name: str) -> None:
    found = detections(open_checkpoint(source(name)))
    assert ("quark-mxfp4" in found) == (name in OWN), found
    if name in OWN:
        assert list(found) == ["quark-mxfp4"]


def test_detect_evidence(source: Source) -> None:
    ev = quark_mxfp4.detect(open_checkpoint(source("quark-mxfp4")))
    assert ev is not None
    assert ev[:2] == ["config.json quantization_config.quant_method = quark",
                      "config.json quantization_config.global_quant_config.weight = fp4 per_group 32"]
    assert len(ev) == 3 and ev[2].startswith("tensor model.layers.") and ev[2].endswith(".weight_scale")


def test_without_a_config_the_tensors_decide(tmp_path: Path) -> None:
    ckpt = edit_config(builders.quark_mxfp4(tmp_path / "q", shards=1), lambda c: c.pop("quantization_config"))
    layout, ev = detect_layout(ckpt)
    assert layout is quark_mxfp4
    assert len(ev) == 1 and ev[0].endswith(".weight_scale")


@pytest.mark.parametrize(("name", "scheme"), [("quark-mxfp4", "w4a16"), ("quark-mxfp4-w4a4", "w4a4")])
def test_plan(source: Source, name: str, scheme: str) -> None:
    plan = quark_mxfp4.plan(open_checkpoint(source(name)))
    assert plan.problems == []
    f = plan.facts
    assert (f.scheme, f.source_quant, f.num_experts, f.hidden_size, f.intermediate_size) == (scheme, "mxfp4", 4, 64, 32)
    assert f.ignore == tuple(builders.QUARK_EXCLUDE)
    moe = [u for u in plan.units if u.kind == "moe"]
    assert [(u.key, u.dims) for u in moe] == [(f"model.layers.{n}.mlp.experts", (4, 64, 32)) for n in range(2)]
    assert moe[0].extra == {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def test_fp8_activations_are_a_problem(tmp_path: Path) -> None:
    def fp8_inputs(cfg: dict[str, Any]) -> None:
        cfg["quantization_config"]["global_quant_config"]["input_tensors"] = FP8

    plan = quark_mxfp4.plan(edit_config(builders.quark_mxfp4(tmp_path / "q", shards=1), fp8_inputs))
    assert [p.message for p in plan.problems] == [
        "input tensors quantized as fp8_e4m3: only weight-only and fp4 activations are read"]
    assert plan.problems[0].file.endswith("config.json")


def test_fp4_attention_is_dense_units(tmp_path: Path) -> None:
    def fp4_attention(t: builders.Tensors) -> None:
        for proj, n, k in (("q_proj", 64, 64), ("o_proj", 64, 64)):
            t.mxfp4(f"model.layers.0.self_attn.{proj}", n, k, packed="weight")  # replaces the BF16 weight

    src = builders.quark_mxfp4(tmp_path / "q", shards=1, extra=fp4_attention, exclude=["lm_head"])
    ckpt = open_checkpoint(src)
    plan = quark_mxfp4.plan(ckpt)
    assert plan.problems == []
    dense = [u for u in plan.units if u.kind == "dense"]
    assert [(u.key, u.dims) for u in dense] == [("model.layers.0.self_attn.o_proj", (64, 64)),
                                                 ("model.layers.0.self_attn.q_proj", (64, 64))]
    unit = quark_mxfp4.read(ckpt, dense[1])
    assert isinstance(unit, DenseFP4)
    raw = load_file(str(src / "model.safetensors"))
    assert torch.equal(unit.weight.packed, raw["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(unit.weight.scales, raw["model.layers.0.self_attn.q_proj.weight_scale"])


def test_read_experts(source: Source) -> None:
    src = source("quark-mxfp4")
    ckpt = open_checkpoint(src)
    spec = next(u for u in quark_mxfp4.plan(ckpt).units if u.kind == "moe")
    unit = quark_mxfp4.read(ckpt, spec)
    assert isinstance(unit, MoELayer)
    raw: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        raw.update(load_file(str(f)))
    assert torch.equal(unit.w13.packed[2, 32:], raw[f"{spec.key}.2.up_proj.weight"])
    assert torch.equal(unit.w2.scales[3], raw[f"{spec.key}.3.down_proj.weight_scale"])
