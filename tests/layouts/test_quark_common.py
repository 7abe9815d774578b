"""mxfp4conv/layouts/quark_common.py: what an AMD Quark config declares (exclude, layer_quant_config, the FP8
KV cache through export.kv_cache_group)."""

from __future__ import annotations

from pathlib import Path

from mxfp4conv.layouts import quark_common
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests import builders
from tests.layouts.helpers import Source

FP8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}


def test_declared(tmp_path: Path) -> None:
    fp4 = builders.quark_config(32, w4a4=False, exclude=[])["global_quant_config"]["weight"]
    layers = {"model.layers.*.self_attn.o_proj": {"weight": FP8, "input_tensors": FP8},
              "*k_proj": {"weight": fp4, "output_tensors": FP8}, "*v_proj": {"weight": fp4, "output_tensors": FP8},
              "model.layers.0.mlp.gate": {"weight": {"dtype": "int8", "qscheme": "per_tensor"}}}
    src = builders.quark_mxfp4(tmp_path / "q", shards=1, layer_quant_config=layers,
                               kv_cache_group=["*k_proj", "*v_proj"])
    d = quark_common.declared(open_checkpoint(src))
    assert d.unquantized == tuple(builders.QUARK_EXCLUDE)
    assert d.listed == {"model.layers.*.self_attn.o_proj": "fp8-tensor", "*k_proj": "mxfp4", "*v_proj": "mxfp4"}
    assert d.kv_cache == "fp8" and d.exhaustive is False


def test_a_kv_cache_group_without_fp8_outputs_is_no_fp8_kv_cache(tmp_path: Path) -> None:
    fp4 = builders.quark_config(32, w4a4=False, exclude=[])["global_quant_config"]["weight"]
    layers = {"*k_proj": {"weight": fp4, "output_tensors": FP8}, "*v_proj": {"weight": fp4, "output_tensors": None}}
    src = builders.quark_mxfp4(tmp_path / "q", shards=1, layer_quant_config=layers,
                               kv_cache_group=["*k_proj", "*v_proj"])
    assert quark_common.declared(open_checkpoint(src)).kv_cache is None


def test_a_non_quark_config_is_no_quark_config(source: Source) -> None:
    ckpt = open_checkpoint(source("ct-mxfp4"))
    assert quark_common.qconfig(ckpt) == {}
    assert quark_common.config_evidence(ckpt, "mxfp4") == []
