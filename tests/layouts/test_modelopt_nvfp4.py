"""mxfp4conv/layouts/modelopt_nvfp4.py: ModelOpt NVFP4 (hf_quant_config.json and/or config.json), MIXED_PRECISION
lists and the FP8 KV cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from mxfp4conv.errors import InputError
from mxfp4conv.layouts import modelopt_nvfp4
from mxfp4conv.model.canonical import MoELayer
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests import builders
from tests.layouts.helpers import ALL_SOURCES, Source, detections, edit_config


def _hf_quant(folder: Path, quantization: dict[str, Any]) -> None:
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                             "quantization": quantization}))


@pytest.mark.parametrize("name", ALL_SOURCES)
def test_detect_claims_only_its_own_checkpoints(source: Source, name: str) -> None:
    found = detections(open_checkpoint(source(name)))
    assert ("modelopt-nvfp4" in found) == (name == "modelopt-nvfp4"), found


def test_detect_evidence(source: Source) -> None:
    ev = modelopt_nvfp4.detect(open_checkpoint(source("modelopt-nvfp4")))
    assert ev is not None
    assert ev[:2] == ["config.json quantization_config.quant_method = modelopt",
                      "hf_quant_config.json quantization.quant_algo = NVFP4"]
    assert len(ev) == 3 and ev[2].endswith(".weight_scale_2")


def test_hf_quant_config_alone_is_config_evidence(tmp_path: Path) -> None:
    ckpt = edit_config(builders.build("modelopt-nvfp4", tmp_path / "m", shards=1), lambda c: c.pop("quantization_config"))
    ev = modelopt_nvfp4.detect(ckpt)
    assert ev is not None and ev[0] == "hf_quant_config.json quantization.quant_algo = NVFP4"


def test_a_quark_config_is_never_modelopt(source: Source) -> None:
    assert modelopt_nvfp4.detect(open_checkpoint(source("quark-nvfp4"))) is None


def test_plan_is_w4a4_from_the_fp4_input_scales(source: Source) -> None:
    plan = modelopt_nvfp4.plan(open_checkpoint(source("modelopt-nvfp4")))
    assert plan.problems == []
    assert (plan.facts.scheme, plan.facts.source_quant) == ("w4a4", "nvfp4")
    assert plan.facts.ignore == ("lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn*")
    moe = [u for u in plan.units if u.kind == "moe"]
    assert [u.dims for u in moe] == [(4, 64, 32), (4, 64, 32)]
    assert len(moe[0].sources) == 4 * 3 * 4  # weight, weight_scale, weight_scale_2, input_scale


def test_fp8_input_scales_do_not_make_it_w4a4(tmp_path: Path) -> None:
    def expert(t: builders.Tensors, module: str, n: int, k: int) -> None:
        t.nvfp4(module, n, k, packed="weight", global_scale="weight_scale_2", divisor=False, input_scale=None)

    def fp8(t: builders.Tensors) -> None:
        t.fp8_tensor("model.layers.0.self_attn.o_proj", 64, 64, input_scale=True)

    q = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]}
    plan = modelopt_nvfp4.plan(open_checkpoint(builders.moe_checkpoint(tmp_path / "m", expert, q, extra=fp8)))
    assert plan.facts.scheme == "w4a16"


def test_declared(tmp_path: Path) -> None:
    src = builders.build("modelopt-nvfp4", tmp_path / "m", shards=1)
    _hf_quant(src, {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head", "*.gate"]})
    d = modelopt_nvfp4.declared(open_checkpoint(src))
    assert d.unquantized == ("lm_head", "*.gate")  # hf_quant_config.json wins over config.json
    assert d.kv_cache == "fp8" and d.listed == {} and d.exhaustive is False
    assert d.source == "hf_quant_config.json"


def test_config_json_ignore_is_the_exclude_list(tmp_path: Path) -> None:
    src = builders.build("modelopt-nvfp4", tmp_path / "m", shards=1)
    (src / "hf_quant_config.json").unlink()
    d = modelopt_nvfp4.declared(open_checkpoint(src))
    assert d.unquantized == ("lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn*")
    assert d.source == "config.json" and d.kv_cache is None


def test_mixed_precision_lists_every_quantized_module(tmp_path: Path) -> None:
    src = builders.build("modelopt-nvfp4", tmp_path / "m", shards=1)
    layers = {"model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4", "group_size": 16},
              "model.layers.0.self_attn.o_proj": {"quant_algo": "FP8"},
              "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8_PB_WO"},
              "model.layers.0.self_attn.k_proj": {"quant_algo": "W4A8_AWQ"}}  # not a precision carried: left out
    _hf_quant(src, {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers, "kv_cache_quant_algo": "FP8"})
    ckpt = open_checkpoint(src)
    d = modelopt_nvfp4.declared(ckpt)
    assert d.exhaustive is True
    assert d.listed == {"model.layers.0.mlp.experts.0.gate_proj": "nvfp4", "model.layers.0.self_attn.o_proj": "fp8-tensor",
                        "model.layers.0.self_attn.q_proj": "fp8-block"}
    assert modelopt_nvfp4.detect(ckpt) is not None


def test_mixed_precision_without_nvfp4_is_not_config_evidence(tmp_path: Path) -> None:
    src = builders.build("modelopt-nvfp4", tmp_path / "m", shards=1)
    _hf_quant(src, {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"x": {"quant_algo": "FP8"}}})
    ckpt = edit_config(src, lambda c: c.pop("quantization_config"))
    ev = modelopt_nvfp4.detect(ckpt)
    assert ev is not None and len(ev) == 1 and ev[0].startswith("tensor ")


def test_exclude_modules_must_be_a_list(tmp_path: Path) -> None:
    src = builders.build("modelopt-nvfp4", tmp_path / "m", shards=1)
    _hf_quant(src, {"quant_algo": "NVFP4", "exclude_modules": "lm_head"})
    with pytest.raises(InputError, match="exclude_modules must be a list of fnmatch patterns, got str") as exc:
        modelopt_nvfp4.plan(open_checkpoint(src))
    assert exc.value.file is not None and exc.value.file.endswith("hf_quant_config.json")


def test_plan_reports_a_non_scalar_global_scale(tmp_path: Path) -> None:
    name = "model.layers.0.mlp.experts.0.down_proj.weight_scale_2"

    def expert(t: builders.Tensors, module: str, n: int, k: int) -> None:
        t.nvfp4(module, n, k, packed="weight", global_scale="weight_scale_2", divisor=False, input_scale="input_scale")

    def bad(t: builders.Tensors) -> None:
        t[name] = t[name].reshape(1).repeat(2)

    q = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    plan = modelopt_nvfp4.plan(open_checkpoint(builders.moe_checkpoint(tmp_path / "m", expert, q, extra=bad)))
    assert [(p.tensor, p.message) for p in plan.problems] == [(name, "global scale must be one F32 value, got F32[2]")]


def test_deepseek_v4_nvfp4_release_keeps_its_mxfp4_mtp_experts(tmp_path: Path) -> None:
    """NVIDIA's NVFP4 DeepSeek-V4: NVFP4 routed experts, V4-native MXFP4 (I8 + F8_E8M0) experts in the MTP layer."""
    src = builders.deepseek_v4(tmp_path / "v4", nvfp4=True, mtp=True)
    ckpt = open_checkpoint(src)
    assert list(detections(ckpt)) == ["modelopt-nvfp4"]
    plan = modelopt_nvfp4.plan(ckpt)
    assert plan.problems == []
    assert plan.facts.expert_names == ("w1", "w3", "w2")
    moe = {u.key: u for u in plan.units if u.kind == "moe"}
    assert list(moe) == ["layers.0.ffn.experts", "layers.1.ffn.experts", "mtp.0.ffn.experts"]
    assert "roles" not in moe["layers.0.ffn.experts"].extra and moe["mtp.0.ffn.experts"].extra["roles"] == "1"
    routed = modelopt_nvfp4.read(ckpt, moe["layers.1.ffn.experts"])
    mtp = modelopt_nvfp4.read(ckpt, moe["mtp.0.ffn.experts"])
    assert isinstance(routed, MoELayer) and isinstance(mtp, MoELayer)
    assert routed.w13.quant == "nvfp4" and routed.w13.global_rows is not None
    assert mtp.w13.quant == "mxfp4" and mtp.w13.global_rows is None and mtp.w13.scales.dtype == torch.uint8
    raw: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        raw.update(load_file(str(f)))
    assert torch.equal(mtp.w13.packed[1, 64:], raw["mtp.0.ffn.experts.1.w3.weight"].view(torch.uint8))
