"""mxfp4conv/layouts/ct_common.py: what the compressed-tensors configs (and AutoRound's export of the same tensors)
declare: ignore lists, groups that name modules, the FP8 KV cache, AutoRound's 16-bit modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mxfp4conv.layouts import ct_common, ct_mxfp4
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests import builders
from tests.layouts.helpers import edit_config

FP8_TENSOR_GROUP = {"format": "float-quantized", "targets": ["re:.*o_proj$"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}


FP8_BLOCK_GROUP = {"format": "float-quantized", "targets": ["model.layers.0.self_attn.q_proj"],
                   "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}


def test_declared_from_ignore_groups_and_kv_cache(tmp_path: Path) -> None:
    def mixed(cfg: dict[str, Any]) -> None:
        q = cfg["quantization_config"]
        q["config_groups"]["group_1"] = FP8_TENSOR_GROUP
        q["config_groups"]["group_2"] = FP8_BLOCK_GROUP
        q["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}

    ckpt = edit_config(builders.build("ct-nvfp4", tmp_path / "c", shards=1), mixed)
    d = ct_common.declared(ckpt)
    assert d.unquantized == ("lm_head", "re:.*mlp.gate$", "re:.*self_attn.*")
    assert d.listed == {"re:.*o_proj$": "fp8-tensor", "model.layers.0.self_attn.q_proj": "fp8-block"}
    assert d.exhaustive is False  # group_0 targets the class "Linear": every other Linear is FP4
    assert d.kv_cache == "fp8"


def test_declared_by_name_only_is_exhaustive(tmp_path: Path) -> None:
    def by_name(cfg: dict[str, Any]) -> None:
        q = cfg["quantization_config"]
        q["config_groups"]["group_0"]["targets"] = ["re:.*experts.*"]
        q["config_groups"]["group_1"] = FP8_TENSOR_GROUP
        q["kv_cache_scheme"] = {"num_bits": 4, "type": "int"}

    d = ct_common.declared(edit_config(builders.build("ct-nvfp4", tmp_path / "c", shards=1), by_name))
    assert d.listed == {"re:.*experts.*": "nvfp4", "re:.*o_proj$": "fp8-tensor"}
    assert d.exhaustive is True
    assert d.kv_cache is None  # only an 8-bit float KV cache is FP8


@pytest.mark.parametrize(("change", "autoround"), [
    ({}, True),
    ({"quant_method": "auto_round"}, True),
    ({"bits": 8}, False),
    ({"group_size": 16}, False),
    ({"data_type": "nv_fp"}, False),
    ({"packing_format": "auto_round:auto_gptq"}, False),
])
def test_is_autoround_mxfp4(change: dict[str, Any], autoround: bool) -> None:
    q = {"quant_method": "auto-round", "packing_format": "auto_round:llm_compressor", "data_type": "mx_fp",
         "bits": 4, "group_size": 32, "act_bits": 16}
    assert ct_common.is_autoround_mxfp4({**q, **change}) is autoround


def test_autoround_extra_config_declares_16_bit_modules_unquantized(tmp_path: Path) -> None:
    src = builders.autoround_mxfp4(tmp_path / "a", extra_config={
        "lm_head": {"bits": 16}, "model.layers.0.self_attn.q_proj": {"bits": 16, "data_type": "float"},
        "model.layers.1.self_attn.o_proj": {"bits": 4}, "model.layers.1.mlp.gate": {"act_bits": 16}})
    ckpt = open_checkpoint(src)
    declared = ct_common.declared(ckpt)
    assert declared.unquantized == ("lm_head", "model.layers.0.self_attn.q_proj")
    assert declared.listed == {} and declared.kv_cache is None
    assert ct_mxfp4.plan(ckpt).facts.ignore == ("lm_head", "model.layers.0.self_attn.q_proj")


def test_autoround_that_is_not_mxfp4_is_not_config_evidence(tmp_path: Path) -> None:
    ckpt = edit_config(builders.autoround_mxfp4(tmp_path / "a"),
                       lambda c: c["quantization_config"].update(group_size=16))
    ev = ct_mxfp4.detect(ckpt)
    assert ev is not None and len(ev) == 1 and ev[0].startswith("tensor ")  # inferred from tensors only
