"""mxfp4conv/layouts/base.py: model facts from config.json and the expert projection names."""

from __future__ import annotations

from pathlib import Path

from mxfp4conv.layouts.base import config_facts, expert_names
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests import builders


def test_config_facts_read_the_text_config_of_multimodal_models() -> None:
    cfg: dict[str, object] = {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
                              "text_config": {"hidden_size": 128, "num_hidden_layers": 3, "num_experts": 8,
                                              "moe_intermediate_size": 64}, "vision_config": {"hidden_size": 32}}
    f = config_facts(cfg, scheme="w4a4", quant="nvfp4", expert_names=("gate_proj", "up_proj", "down_proj"))
    assert (f.model_type, f.architecture, f.hidden_size, f.num_layers, f.num_experts, f.intermediate_size) == (
        "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", 128, 3, 8, 64)
    assert f.activation == "silu"


def test_config_facts_ignore_non_integers() -> None:
    f = config_facts({"hidden_size": True, "num_hidden_layers": "2", "num_local_experts": 4.0, "n_routed_experts": 6},
                     scheme="w4a16", quant="mxfp4", expert_names=("w1", "w3", "w2"))
    assert (f.hidden_size, f.num_layers, f.num_experts) == (0, 0, 6)


def test_expert_names_from_the_tensors(tmp_path: Path) -> None:
    assert expert_names(open_checkpoint(builders.build("ct-mxfp4", tmp_path / "a", shards=1, layers=1))) == (
        "gate_proj", "up_proj", "down_proj")
    assert expert_names(open_checkpoint(builders.build("ct-mxfp4", tmp_path / "b", shards=1, layers=1,
                                                       mixtral_names=True))) == ("w1", "w3", "w2")
