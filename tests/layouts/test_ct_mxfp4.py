"""mxfp4conv/layouts/ct_mxfp4.py (+ ct_common.py): compressed-tensors MXFP4, split and fused experts, and
AutoRound's ``auto_round:llm_compressor`` export of the same tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from mxfp4conv.layouts import ct_mxfp4
from mxfp4conv.model.canonical import MoELayer
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests import builders
from tests.layouts.helpers import ALL_SOURCES, Source, detections, edit_config

OWN = {"ct-mxfp4", "ct-mxfp4-mixtral", "autoround-w4a16", "autoround-w4a4"}


@pytest.mark.parametrize("name", ALL_SOURCES)
def test_detect_claims_only_its_own_checkpoints(source: Source, name: str) -> None:
    found = detections(open_checkpoint(source(name)))
    assert ("ct-mxfp4" in found) == (name in OWN), found
    if name in OWN:
        assert list(found) == ["ct-mxfp4"]


def test_detect_evidence(source: Source) -> None:
    ev = ct_mxfp4.detect(open_checkpoint(source("ct-mxfp4")))
    assert ev is not None
    assert ev[:2] == ["config.json quantization_config.quant_method = compressed-tensors",
                      "config.json quantization_config.format = mxfp4-pack-quantized"]
    assert len(ev) == 3 and ev[2].startswith("tensor model.layers.") and ev[2].endswith(".weight_packed")


def test_detect_without_a_config_is_tensor_evidence_only(tmp_path: Path) -> None:
    ckpt = edit_config(builders.build("ct-mxfp4", tmp_path / "c", shards=1), lambda c: c.pop("quantization_config"))
    ev = ct_mxfp4.detect(ckpt)
    assert ev is not None and len(ev) == 1 and ev[0].startswith("tensor ")


def test_detect_evidence_autoround(source: Source) -> None:
    ev = ct_mxfp4.detect(open_checkpoint(source("autoround-w4a4")))
    assert ev is not None
    assert ev[:3] == ["config.json quantization_config.quant_method = auto-round",
                      "config.json quantization_config.packing_format = auto_round:llm_compressor",
                      "config.json quantization_config.data_type = mx_fp"]


def test_plan_split_experts(source: Source) -> None:
    plan = ct_mxfp4.plan(open_checkpoint(source("ct-mxfp4")))
    assert plan.problems == []
    assert plan.layout == "ct-mxfp4"
    f = plan.facts
    assert (f.model_type, f.scheme, f.source_quant, f.num_layers, f.num_experts, f.hidden_size, f.intermediate_size) == (
        "qwen3_moe", "w4a16", "mxfp4", 2, 4, 64, 32)
    assert f.expert_names == ("gate_proj", "up_proj", "down_proj")
    assert f.ignore == ("lm_head", "re:.*mlp.gate$", "re:.*self_attn.*")
    moe = [u for u in plan.units if u.kind == "moe"]
    assert [u.key for u in moe] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(u.dims == (4, 64, 32) and not u.has_bias for u in moe)
    assert moe[0].extra == {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    assert len(moe[0].sources) == 4 * 3 * 2  # packed + scale per projection
    assert not [u for u in plan.units if u.kind == "dense"]
    passthrough = {u.key for u in plan.units if u.kind == "passthrough"}
    assert "lm_head.weight" in passthrough and not any("experts" in k for k in passthrough)


def test_plan_mixtral_names(source: Source) -> None:
    plan = ct_mxfp4.plan(open_checkpoint(source("ct-mxfp4-mixtral")))
    assert plan.problems == []
    assert plan.facts.expert_names == ("w1", "w3", "w2")
    moe = next(u for u in plan.units if u.kind == "moe")
    assert moe.extra == {"gate": "w1", "up": "w3", "down": "w2"}


def test_plan_reports_a_missing_expert(tmp_path: Path) -> None:
    def drop(t: builders.Tensors) -> None:
        for k in [k for k in t if ".experts.3." in k and k.startswith("model.layers.1.")]:
            del t[k]

    def expert(t: builders.Tensors, module: str, n: int, k: int) -> None:
        t.mxfp4(module, n, k)

    src = builders.moe_checkpoint(tmp_path / "m", expert, builders.tiny._ct_qconfig("mxfp4-pack-quantized", []),
                                  extra=drop)
    plan = ct_mxfp4.plan(open_checkpoint(src))
    assert [(p.tensor, p.message) for p in plan.problems] == [
        ("model.layers.1.mlp.experts.3", "expert 3 is missing (experts must be 0..3, found 3)")]
    assert [u.key for u in plan.units if u.kind == "moe"] == ["model.layers.0.mlp.experts"]


def test_plan_reports_a_scale_of_the_wrong_shape(tmp_path: Path) -> None:
    name = "model.layers.0.mlp.experts.1.up_proj.weight_scale"

    def bad(t: builders.Tensors) -> None:
        t[name] = t[name][:, :1].contiguous()

    def expert(t: builders.Tensors, module: str, n: int, k: int) -> None:
        t.mxfp4(module, n, k)

    src = builders.moe_checkpoint(tmp_path / "m", expert, builders.tiny._ct_qconfig("mxfp4-pack-quantized", []),
                                  extra=bad)
    plan = ct_mxfp4.plan(open_checkpoint(src))
    assert len(plan.problems) == 1
    p = plan.problems[0]
    assert p.tensor == name and p.message.startswith("scale shape [32, 1] does not match packed weight [32, 32]")
    assert p.file.endswith(".safetensors")


def _fused(root: Path, *, bad_scale: bool = False) -> Path:
    e, h, i = 2, 64, 32
    cfg: dict[str, Any] = builders.tiny.qwen3_config(1, e, h, i)
    cfg["quantization_config"] = builders.tiny._ct_qconfig("mxfp4-pack-quantized", ["lm_head"])
    t = builders.Tensors(3)
    gu, gus = builders.quant_mxfp4(t.randn(e * 2 * i, h))
    dn, dns = builders.quant_mxfp4(t.randn(e * h, i))
    p = "model.layers.0.mlp.experts"
    t[f"{p}.gate_up_proj_packed"] = gu.reshape(e, 2 * i, h // 2)
    t[f"{p}.gate_up_proj_scale"] = gus.reshape(e, 2 * i, h // 32)[:, :, : 1 if bad_scale else None].contiguous()
    t[f"{p}.down_proj_packed"] = dn.reshape(e, h, i // 2)
    t[f"{p}.down_proj_scale"] = dns.reshape(e, h, i // 32)
    t.bf16("lm_head", 256, h)
    return builders.save_checkpoint(root, cfg, t)


def test_plan_and_read_fused_transformers_v5_experts(tmp_path: Path) -> None:
    src = _fused(tmp_path / "f")
    ckpt = open_checkpoint(src)
    assert ct_mxfp4.detect(ckpt) is not None
    plan = ct_mxfp4.plan(ckpt)
    assert plan.problems == []
    (moe,) = [u for u in plan.units if u.kind == "moe"]
    assert (moe.key, moe.dims, moe.extra) == ("model.layers.0.mlp.experts", (2, 64, 32), {"fused": "1"})
    unit = ct_mxfp4.read(ckpt, moe)
    assert isinstance(unit, MoELayer)
    raw = load_file(str(src / "model.safetensors"))
    assert torch.equal(unit.w13.packed, raw["model.layers.0.mlp.experts.gate_up_proj_packed"])
    assert torch.equal(unit.w2.scales, raw["model.layers.0.mlp.experts.down_proj_scale"])


def test_fused_shape_disagreement_is_a_problem(tmp_path: Path) -> None:
    plan = ct_mxfp4.plan(open_checkpoint(_fused(tmp_path / "f", bad_scale=True)))
    assert len(plan.problems) == 1
    assert plan.problems[0].tensor == "model.layers.0.mlp.experts.gate_up_proj_packed"
    assert plan.problems[0].message.startswith("fused expert shapes disagree: gate_up [2, 64, 32], scale [2, 64, 1]")
    assert not [u for u in plan.units if u.kind == "moe"]


def test_read_stacks_gate_then_up(source: Source) -> None:
    src = source("ct-mxfp4")
    ckpt = open_checkpoint(src)
    plan = ct_mxfp4.plan(ckpt)
    spec = next(u for u in plan.units if u.kind == "moe" and u.key == "model.layers.1.mlp.experts")
    unit = ct_mxfp4.read(ckpt, spec)
    assert isinstance(unit, MoELayer)
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        raw.update(load_file(str(f)))
    p = "model.layers.1.mlp.experts"
    assert unit.w13.packed.shape == (4, 64, 32) and unit.w2.packed.shape == (4, 64, 16)
    for e in range(4):
        assert torch.equal(unit.w13.packed[e, :32], raw[f"{p}.{e}.gate_proj.weight_packed"])
        assert torch.equal(unit.w13.packed[e, 32:], raw[f"{p}.{e}.up_proj.weight_packed"])
        assert torch.equal(unit.w13.scales[e, 32:], raw[f"{p}.{e}.up_proj.weight_scale"])
        assert torch.equal(unit.w2.packed[e], raw[f"{p}.{e}.down_proj.weight_packed"])
    assert unit.w13.quant == "mxfp4" and unit.w13.global_rows is None


# ---------------------------------------------------------------------------------------------- AutoRound


@pytest.mark.parametrize(("name", "scheme"), [("autoround-w4a16", "w4a16"), ("autoround-w4a4", "w4a4")])
def test_autoround_scheme_from_act_bits(source: Source, name: str, scheme: str) -> None:
    plan = ct_mxfp4.plan(open_checkpoint(source(name)))
    assert plan.problems == []
    assert plan.facts.scheme == scheme and plan.facts.source_quant == "mxfp4"
    assert [u.dims for u in plan.units if u.kind == "moe"] == [(4, 64, 32), (4, 64, 32)]
