"""mxfp4conv/targets/quark.py: AMD Quark MXFP4 output (layer_quant_config, exclude, the FP8 KV cache group),
GPT-OSS's per-expert fused names, and refusals."""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import pytest
import torch

from mxfp4conv.model.canonical import FP4Weight, ModelFacts, MoELayer
from mxfp4conv.model.precision import Fp8Linear, PrecisionModel, matches
from mxfp4conv.targets import WriterContext, get_target
from mxfp4conv.targets.base import TargetOptions
from mxfp4conv.targets.quark import KV_CACHE_GROUP
from mxfp4conv.targets.resolve import resolve_quark
from tests.targets.helpers import A0, A1, BF16, MTP, context, mixed_nvfp4

QUARK = get_target("quark")


def _q(src: Path, options: dict[str, str] | None = None) -> dict[str, Any]:
    ctx, cfg = context(src, options)
    out = QUARK.config(cfg, ctx)
    q = out["quantization_config"]
    assert isinstance(q, dict)
    return q


def test_global_config_follows_the_source_scheme(mixed: Path) -> None:
    q = _q(mixed)
    assert q["quant_method"] == "quark"
    w = q["global_quant_config"]["weight"]
    assert (w["dtype"], w["qscheme"], w["group_size"], w["scale_format"]) == ("fp4", "per_group", 32, "e8m0")
    acts = q["global_quant_config"]["input_tensors"]
    assert acts is not None and acts["dtype"] == "fp4" and acts["is_dynamic"] is True  # W4A4 source
    assert _q(mixed, {"quark_activations": "none"})["global_quant_config"]["input_tensors"] is None


def test_layer_quant_config_describes_each_fp8_layer_and_the_kv_cache(mixed: Path) -> None:
    layers = _q(mixed)["layer_quant_config"]
    assert list(layers) == [f"{A0}.o_proj", f"{A0}.q_proj", "model.layers.2.*self_attn.o_proj", *KV_CACHE_GROUP]
    tensor = layers[f"{A0}.o_proj"]
    assert (tensor["weight"]["dtype"], tensor["weight"]["qscheme"]) == ("fp8_e4m3", "per_tensor")
    assert tensor["input_tensors"]["qscheme"] == "per_tensor" and tensor["input_tensors"]["is_dynamic"] is False
    block = layers[f"{A0}.q_proj"]
    assert (block["weight"]["qscheme"], block["weight"]["block_size"], block["weight"]["scale_type"]) == (
        "per_block", [128, 128], "float")
    assert block["input_tensors"]["qscheme"] == "per_group" and block["input_tensors"]["group_size"] == 128
    assert layers["model.layers.2.*self_attn.o_proj"]["input_tensors"] is None
    for key in KV_CACHE_GROUP:
        assert layers[key]["weight"]["dtype"] == "fp4"
        assert layers[key]["output_tensors"]["dtype"] == "fp8_e4m3"


def test_exclude_and_the_kv_cache_group(mixed: Path) -> None:
    q = _q(mixed)
    assert q["export"]["kv_cache_group"] == ["*k_proj", "*v_proj"]
    # "model.layers.1.self_attn*" would also exclude layer 1's Attention (and its FP8 KV cache): named instead
    assert q["exclude"] == ["lm_head", r"re:model\.layers\..*\.mlp\.gate$", r"re:model\.layers\..*\.self_attn\.k_proj$",
                            r"re:model\.layers\..*\.self_attn\.v_proj$", *BF16[1:],
                            r"re:model\.layers\.2\.(mtp_block\.)?eh_proj$"]
    assert not any(matches(e, f"{a}.attn") for e in q["exclude"] for a in (A0, A1))


def test_without_a_kv_cache_the_source_wildcards_stay(tmp_path: Path) -> None:
    q = _q(mixed_nvfp4(tmp_path / "m", kv_cache=False))
    assert q["export"]["kv_cache_group"] == []
    assert not any(k in q["layer_quant_config"] for k in KV_CACHE_GROUP)
    assert r"re:model\.layers\.1\.self_attn.*$" in q["exclude"]


def test_every_layer_resolves_to_its_precision(mixed: Path) -> None:
    q = _q(mixed)
    want = {f"{A0}.o_proj": "fp8-tensor", f"{A0}.q_proj": "fp8-block", f"{A0}.k_proj": "bf16", f"{A1}.o_proj": "bf16",
            "model.layers.0.mlp.gate": "bf16", "lm_head": "bf16", "model.layers.0.mlp.shared_expert_gate": "bf16",
            f"{MTP}.mtp_block.self_attn.o_proj": "fp8-tensor", f"{MTP}.mtp_block.eh_proj": "bf16"}
    assert {m: resolve_quark(q, m) for m in want} == want
    assert resolve_quark(q, "model.layers.1.mlp.experts", moe=True) == "mxfp4"


def test_block_fp8_scales_take_the_name_quark_reads(mixed: Path) -> None:
    ctx, _ = context(mixed)
    assert QUARK.passthrough_name(f"{A0}.q_proj.weight_scale_inv", ctx) == f"{A0}.q_proj.weight_scale"
    assert QUARK.passthrough_name(f"{A0}.o_proj.input_scale", ctx) == f"{A0}.o_proj.input_scale"


def test_deepseek_v4_e8m0_blocks(deepseek_v4: Path) -> None:
    ctx, cfg = context(deepseek_v4)
    assert QUARK.refuse(ctx) is None
    assert QUARK.passthrough_name("layers.0.attn.wo_b.scale", ctx) == "layers.0.attn.wo_b.weight_scale"
    q = QUARK.config(cfg, ctx)["quantization_config"]
    assert isinstance(q, dict)
    assert q["layer_quant_config"]["layers.0.attn.wo_b"]["weight"]["scale_type"] == "float8_e8m0fnu"


def test_an_fp8_kv_projection_beside_an_fp8_kv_cache_is_refused(tmp_path: Path) -> None:
    ctx, _ = context(mixed_nvfp4(tmp_path / "m", fp8_k_proj=True))
    assert QUARK.refuse(ctx) == (f"{A0}.k_proj: an FP8 k/v projection beside an FP8 KV cache has no Quark "
                                 "layer_quant_config")


def test_gpt_oss_experts_use_per_expert_fused_names(gpt_oss: Path) -> None:
    ctx, _ = context(gpt_oss)
    assert QUARK.refuse(ctx) is None
    spec = next(u for u in ctx.units if u.kind == "moe")
    specs = QUARK.out_specs(spec, ctx)
    assert [t.name for t in specs[:6]] == [f"{spec.key}.0.{s}" for s in (
        "w13_weight", "w13_weight_scale", "w13_bias", "w2_weight", "w2_weight_scale", "w2_bias")]
    assert QUARK.direct_sources(spec, ctx) is None  # interleaved rows: not a rename
    gen = torch.Generator().manual_seed(1)

    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8)

    unit = MoELayer(spec.key, FP4Weight("mxfp4", u8(4, 64, 32), u8(4, 64, 2)), FP4Weight("mxfp4", u8(4, 64, 16), u8(4, 64, 1)),
                    torch.randn(4, 64, generator=gen).bfloat16(), torch.randn(4, 64, generator=gen).bfloat16())
    written = dict(zip([t.name for t in specs], QUARK.encode(unit, spec, ctx), strict=True))
    w13 = written[f"{spec.key}.1.w13_weight"]
    assert torch.equal(w13[0::2], unit.w13.packed[1, :32]) and torch.equal(w13[1::2], unit.w13.packed[1, 32:])
    back = QUARK.decode(spec, ctx, written.__getitem__)
    assert isinstance(back, MoELayer) and back.w13_bias is not None and unit.w13_bias is not None
    assert torch.equal(back.w13.packed, unit.w13.packed) and torch.equal(back.w13_bias, unit.w13_bias)


@pytest.mark.parametrize("module", ["model.layers.2.self_attn.o_proj", "model.language_model.layers.2.self_attn.o_proj",
                                    "layers.2.attn.wq_a"])
def test_an_mtp_fp8_layer_key_matches_both_runtime_names(module: str) -> None:
    """Layer 2 of a 2-layer model is an MTP layer: its layer_quant_config key (fnmatch, it holds ``*``) must match
    the checkpoint's name and vLLM's ``layers.2.mtp_block.`` name, whatever precedes ``layers.``."""
    facts = ModelFacts("deepseek_v3", "X", "w4a16", "mxfp4", 2, 4, 64, 32)
    lin = Fp8Linear(module, "fp8-tensor", "weight_scale", "F32")
    ctx = WriterContext(facts, "modelopt-nvfp4", [], {}, TargetOptions(), PrecisionModel(fp8={module: lin}))
    q = QUARK.config({}, ctx)["quantization_config"]
    assert isinstance(q, dict)
    (key,) = q["layer_quant_config"]
    renamed = module.replace("layers.2.", "layers.2.mtp_block.")
    assert "*" in key and fnmatch.fnmatch(module, key) and fnmatch.fnmatch(renamed, key), key
    assert resolve_quark(q, module) == resolve_quark(q, renamed) == "fp8-tensor"
