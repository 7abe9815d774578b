"""mxfp4conv/targets/gpt_oss.py: native GPT-OSS MXFP4 output (re-interleaved gate/up rows) and refusals."""

from __future__ import annotations

from pathlib import Path

import torch

from mxfp4conv.model.canonical import FP4Weight, ModelFacts, MoELayer, UnitSpec
from mxfp4conv.model.precision import Fp8Linear, PrecisionModel
from mxfp4conv.targets import WriterContext, get_target
from mxfp4conv.targets.base import TargetOptions
from mxfp4conv.targets.gpt_oss import MODULES_TO_NOT_CONVERT
from tests.targets.helpers import context

GPT = get_target("gpt-oss")
P = "model.layers.0.mlp.experts"
FACTS = ModelFacts("gpt_oss", "GptOssForCausalLM", "w4a16", "mxfp4", 2, 4, 64, 32,
                   ("gate_up_proj", "gate_up_proj", "down_proj"), "swigluoai")


def _ctx(units: list[UnitSpec], precision: PrecisionModel | None = None, layout: str = "ct-mxfp4") -> WriterContext:
    return WriterContext(FACTS, layout, units, {}, TargetOptions(), precision or PrecisionModel())


def _u8(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8)


def test_only_gpt_oss_models(ct_mxfp4: Path) -> None:
    ctx, _ = context(ct_mxfp4)
    assert GPT.refuse(ctx) == ("the gpt-oss layout is only served for model_type gpt_oss (this is 'qwen3_moe'); "
                               "use --to ct or --to quark")


def test_fp4_dense_layers_and_fp8_layers_are_refused() -> None:
    moe = UnitSpec("moe", P, (), (4, 64, 32), True)
    dense = UnitSpec("dense", "model.layers.0.self_attn.q_proj", (), (64, 64))
    assert GPT.refuse(_ctx([moe])) is None
    assert GPT.refuse(_ctx([moe, dense])) == ("the gpt-oss layout has no FP4 dense layers, but "
                                              "model.layers.0.self_attn.q_proj is FP4; use --to quark")
    o = "model.layers.0.self_attn.o_proj"
    fp8 = PrecisionModel(fp8={o: Fp8Linear(o, "fp8-tensor", "weight_scale", "F32")})
    assert GPT.refuse(_ctx([moe], fp8)) == (f"{o}: fp8-tensor (weight_scale F32) has no gpt-oss scheme "
                                            "(the layout holds FP4 and BF16 only); --to quark or --to ct describe FP8 layers")


def test_config_keeps_a_native_source_list(gpt_oss: Path) -> None:
    ctx, cfg = context(gpt_oss)
    cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.*.self_attn"]
    q = GPT.config(cfg, ctx)["quantization_config"]
    assert q == {"modules_to_not_convert": ["lm_head", "model.layers.*.self_attn"], "quant_method": "mxfp4"}


def test_config_of_another_source_gets_the_native_list() -> None:
    q = GPT.config({"model_type": "gpt_oss", "quantization_config": {"quant_method": "compressed-tensors",
                                                                      "ignore": ["lm_head"]}}, _ctx([]))
    assert q["quantization_config"] == {"modules_to_not_convert": MODULES_TO_NOT_CONVERT, "quant_method": "mxfp4"}


def test_names_shapes_and_interleaving() -> None:
    spec = UnitSpec("moe", P, (), (4, 64, 32), True, {"bias_dtype": "BF16"})
    ctx = _ctx([spec])
    specs = GPT.out_specs(spec, ctx)
    assert [(t.name, t.dtype, t.shape) for t in specs] == [
        (f"{P}.down_proj_bias", "BF16", (4, 64)), (f"{P}.down_proj_blocks", "U8", (4, 64, 1, 16)),
        (f"{P}.down_proj_scales", "U8", (4, 64, 1)), (f"{P}.gate_up_proj_bias", "BF16", (4, 64)),
        (f"{P}.gate_up_proj_blocks", "U8", (4, 64, 2, 16)), (f"{P}.gate_up_proj_scales", "U8", (4, 64, 2))]
    gen = torch.Generator().manual_seed(2)
    unit = MoELayer(P, FP4Weight("mxfp4", _u8(gen, 4, 64, 32), _u8(gen, 4, 64, 2)),
                    FP4Weight("mxfp4", _u8(gen, 4, 64, 16), _u8(gen, 4, 64, 1)),
                    torch.randn(4, 64, generator=gen).bfloat16(), torch.randn(4, 64, generator=gen).bfloat16())
    out = GPT.encode(unit, spec, ctx)
    assert [tuple(t.shape) for t in out] == [t.shape for t in specs]
    written = dict(zip([t.name for t in specs], out, strict=True))
    blocks = written[f"{P}.gate_up_proj_blocks"].reshape(4, 64, 32)
    assert torch.equal(blocks[:, 0::2], unit.w13.packed[:, :32]) and torch.equal(blocks[:, 1::2], unit.w13.packed[:, 32:])
    assert unit.w13_bias is not None
    assert torch.equal(written[f"{P}.gate_up_proj_bias"][:, 1], unit.w13_bias[:, 32])
    back = GPT.decode(spec, ctx, written.__getitem__)
    assert isinstance(back, MoELayer) and back.w13_bias is not None and back.w2_bias is not None
    assert torch.equal(back.w13.packed, unit.w13.packed) and torch.equal(back.w13.scales, unit.w13.scales)
    assert torch.equal(back.w2.packed, unit.w2.packed) and torch.equal(back.w13_bias, unit.w13_bias)


def test_a_source_without_biases_gets_zero_biases() -> None:
    spec = UnitSpec("moe", P, (), (4, 64, 32), False)
    ctx = _ctx([spec])
    gen = torch.Generator().manual_seed(3)
    unit = MoELayer(P, FP4Weight("mxfp4", _u8(gen, 4, 64, 32), _u8(gen, 4, 64, 2)),
                    FP4Weight("mxfp4", _u8(gen, 4, 64, 16), _u8(gen, 4, 64, 1)))
    written = dict(zip([t.name for t in GPT.out_specs(spec, ctx)], GPT.encode(unit, spec, ctx), strict=True))
    for name in (f"{P}.down_proj_bias", f"{P}.gate_up_proj_bias"):
        assert written[name].dtype == torch.bfloat16 and not written[name].any()
    back = GPT.decode(spec, ctx, written.__getitem__)
    assert isinstance(back, MoELayer) and back.w13_bias is None and back.w2_bias is None


def test_a_native_source_is_renamed_byte_for_byte(gpt_oss: Path) -> None:
    ctx, _ = context(gpt_oss)
    assert GPT.refuse(ctx) is None
    spec = next(u for u in ctx.units if u.kind == "moe")
    assert GPT.direct_sources(spec, ctx) == [t.name for t in GPT.out_specs(spec, ctx)]
    assert sorted(GPT.direct_sources(spec, ctx) or []) == sorted(spec.sources)
