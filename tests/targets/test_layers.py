"""mxfp4conv/targets/layers.py: how targets describe the layers they do not convert, from the precision model."""

from __future__ import annotations

from typing import Literal

import pytest

from mxfp4conv.model.canonical import ModelFacts, UnitSpec
from mxfp4conv.model.precision import Fp8Linear, PrecisionModel, matches
from mxfp4conv.targets import WriterContext
from mxfp4conv.targets.base import TargetOptions
from mxfp4conv.targets.layers import attention_layers, fp8_groups, precision_refusal, unquantized_entries

EXPERTS = "model.layers.0.mlp.experts"
NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def ctx(precision: PrecisionModel, *, dense: tuple[str, ...] = (), model_type: str = "qwen3_moe",
        layers: int = 2, layout: str = "ct-mxfp4") -> WriterContext:
    facts = ModelFacts(model_type, "X", "w4a16", "mxfp4", layers, 4, 64, 32)
    units = [UnitSpec("moe", EXPERTS, (), (4, 64, 32), extra=dict(NAMES)),
             *(UnitSpec("dense", d, (), (64, 64)) for d in dense)]
    return WriterContext(facts, layout, units, {}, TargetOptions(), precision)


def fp8(module: str, kind: Literal["fp8-tensor", "fp8-block"] = "fp8-tensor", scale: str = "weight_scale",
        dtype: str = "F32", input_scale: bool = False) -> Fp8Linear:
    return Fp8Linear(module, kind, scale, dtype, input_scale)


O0, Q0, K0 = "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"


# ---------------------------------------------------------------------------------------------- precision_refusal


def test_nothing_to_refuse() -> None:
    c = ctx(PrecisionModel(fp8={O0: fp8(O0)}, bf16=(K0,)))
    assert precision_refusal(c, "T", fp8_block=False) is None


@pytest.mark.parametrize(("lin", "kw", "want"), [
    (fp8(O0), {"fp8": False, "fp8_block": False},
     f"{O0}: fp8-tensor (weight_scale F32) has no T scheme (the layout holds FP4 and BF16 only); "
     "--to quark or --to ct describe FP8 layers"),
    (fp8(Q0, "fp8-block", "weight_scale_inv"), {"fp8_block": False},
     f"{Q0}: fp8-block (weight_scale_inv F32) 128x128 block FP8 has no T scheme; --to quark describes it"),
    (fp8(Q0, "fp8-block", "scale", "F8_E8M0"), {"fp8_block": True},
     f"{Q0}: FP8 with E8M0 block scales (scale) has no T scheme (its FP8_BLOCK scales are float tensors); "
     "--to quark carries them as they are (per_block FP8, E8M0 scales)"),
])
def test_refusals_name_the_layer(lin: Fp8Linear, kw: dict[str, bool], want: str) -> None:
    assert precision_refusal(ctx(PrecisionModel(fp8={lin.module: lin})), "T", **kw) == want


def test_e8m0_blocks_load_where_the_target_reads_them() -> None:
    c = ctx(PrecisionModel(fp8={Q0: fp8(Q0, "fp8-block", "scale", "F8_E8M0")}))
    assert precision_refusal(c, "T", fp8_block=True, e8m0_block=True) is None


def test_foreign_fp4_is_refused() -> None:
    c = ctx(PrecisionModel(foreign_fp4=("model.layers.0.mlp.shared.w1", "z")), layout="deepseek-v4-mxfp4")
    assert precision_refusal(c, "T", fp8_block=True) == (
        "model.layers.0.mlp.shared.w1: FP4 weights in a naming the deepseek-v4-mxfp4 layout does not convert "
        "(they cannot be carried as unquantized)")


# ---------------------------------------------------------------------------------------------- unquantized_entries


def test_source_patterns_first_then_every_name() -> None:
    """The source's own patterns, then each unquantized Linear by exact name (once: ``lm_head`` is both)."""
    p = PrecisionModel(bf16=("lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate",
                             "model.layers.1.mlp.gate"),
                       unquantized_patterns=("lm_head", r"re:model\.layers\..*\.mlp\.gate$"))
    assert unquantized_entries(ctx(p)) == ["lm_head", r"re:model\.layers\..*\.mlp\.gate$", "model.layers.0.mlp.gate",
                                           "model.layers.0.mlp.shared_expert_gate", "model.layers.1.mlp.gate"]


def test_a_pattern_that_would_cover_a_quantized_layer_is_replaced_by_names() -> None:
    """``re:.*self_attn.*`` would declare the FP8 o_proj and the FP4 dense q_proj unquantized: their BF16
    siblings are named instead."""
    p = PrecisionModel(fp8={O0: fp8(O0)}, bf16=(K0, "model.layers.0.self_attn.v_proj"),
                       unquantized_patterns=("re:.*self_attn.*",))
    got = unquantized_entries(ctx(p, dense=(Q0,)))
    assert got == [K0, "model.layers.0.self_attn.v_proj"]
    assert not any(matches(e, m) for e in got for m in (O0, Q0))


def test_a_pattern_that_would_cover_the_fp4_experts_is_dropped() -> None:
    p = PrecisionModel(bf16=("model.layers.0.mlp.gate",), unquantized_patterns=("re:model\\.layers\\.0\\.mlp.*",))
    assert unquantized_entries(ctx(p)) == ["model.layers.0.mlp.gate"]


def test_keep_matching_drops_patterns_reaching_those_layers() -> None:
    p = PrecisionModel(bf16=(K0,), unquantized_patterns=(r"re:model\.layers\.0\.self_attn.*$",))
    c = ctx(p)
    assert unquantized_entries(c) == [r"re:model\.layers\.0\.self_attn.*$", K0]
    assert unquantized_entries(c, keep_matching=["model.layers.0.self_attn.attn"]) == [K0]


def test_mtp_layers_get_patterns_that_accept_the_runtime_name() -> None:
    p = PrecisionModel(bf16=("model.layers.2.eh_proj",))
    got = unquantized_entries(ctx(p, layers=2))
    assert got == ["model.layers.2.eh_proj", r"re:model\.layers\.2\.(mtp_block\.)?eh_proj$"]
    assert matches(got[1], "model.layers.2.mtp_block.eh_proj")


def test_unquantized_experts_are_declared_by_their_container() -> None:
    """A BF16 MoE layer (an MTP layer kept unquantized): the container by name and one pattern for it and its
    projections, instead of every projection."""
    mtp = [f"model.layers.2.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    p = PrecisionModel(bf16=tuple(sorted([*mtp, "model.layers.2.eh_proj"])))
    got = unquantized_entries(ctx(p, layers=2))
    assert got == ["model.layers.2.mlp.experts", r"re:model\.layers\.2\.(mtp_block\.)?mlp\.experts(\..*)?$",
                   "model.layers.2.eh_proj", r"re:model\.layers\.2\.(mtp_block\.)?eh_proj$"]
    assert all(matches(got[1], m) for m in [*mtp, "model.layers.2.mlp.experts", "model.layers.2.mtp_block.mlp.experts"])


# ---------------------------------------------------------------------------------------------- fp8_groups, attention


def test_fp8_groups_by_kind_and_static_input() -> None:
    lins = [fp8(O0, input_scale=True), fp8("model.layers.1.self_attn.o_proj", input_scale=True),
            fp8(Q0, "fp8-block", "weight_scale_inv"), fp8("model.layers.2.self_attn.o_proj")]
    got = fp8_groups(ctx(PrecisionModel(fp8={lin.module: lin for lin in lins}), layers=2))
    assert got == {("fp8-tensor", True): [O0, "model.layers.1.self_attn.o_proj"],
                   ("fp8-block", False): [Q0],
                   ("fp8-tensor", False): [r"re:model\.layers\.2\.(mtp_block\.)?self_attn\.o_proj$"]}


def test_attention_layers_from_the_attention_projections() -> None:
    p = PrecisionModel(fp8={O0: fp8(O0)}, bf16=(K0, "model.layers.0.mlp.gate", "layers.3.attn.wkv"))
    assert attention_layers(ctx(p, dense=("model.layers.1.self_attn.qkv_proj",))) == [
        "layers.3.attn.attn", "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
