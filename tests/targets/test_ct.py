"""mxfp4conv/targets/ct.py: compressed-tensors MXFP4 output, config groups per scheme, names and refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mxfp4conv.model.canonical import FP4Weight, MoELayer
from mxfp4conv.model.precision import matches
from mxfp4conv.targets import get_target
from mxfp4conv.targets.ct import KV_CACHE_FP8
from mxfp4conv.targets.resolve import resolve_ct
from tests import builders
from tests.targets.helpers import A0, A1, BF16, MTP, context, mixed_nvfp4

CT = get_target("ct")


def _q(src: Path) -> dict[str, Any]:
    ctx, cfg = context(src)
    out = CT.config(cfg, ctx)
    assert {k: v for k, v in out.items() if k != "quantization_config"} == {
        k: v for k, v in cfg.items() if k != "quantization_config"}  # the rest of config.json as it was
    q = out["quantization_config"]
    assert isinstance(q, dict)
    return q


def test_config_groups_by_scheme(mixed: Path) -> None:
    q = _q(mixed)
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mixed-precision"
    groups = q["config_groups"]
    assert list(groups) == ["group_0", "group_1", "group_2", "group_3"]
    fp4 = groups["group_0"]
    assert (fp4["format"], fp4["targets"]) == ("mxfp4-pack-quantized", ["Linear"])
    assert (fp4["weights"]["num_bits"], fp4["weights"]["group_size"], fp4["weights"]["type"]) == (4, 32, "float")
    assert fp4["input_activations"]["dynamic"] is True  # a W4A4 source stays W4A4
    tensor, block, mtp = groups["group_1"], groups["group_2"], groups["group_3"]
    assert tensor["targets"] == [f"{A0}.o_proj"]
    assert tensor["weights"]["strategy"] == "tensor" and tensor["weights"]["num_bits"] == 8
    assert tensor["input_activations"]["strategy"] == "tensor" and tensor["input_activations"]["dynamic"] is False
    assert block["targets"] == [f"{A0}.q_proj"]
    assert (block["weights"]["strategy"], block["weights"]["block_structure"]) == ("block", [128, 128])
    assert block["input_activations"]["dynamic"] is True and block["input_activations"]["group_size"] == 128
    assert mtp["targets"] == [r"re:model\.layers\.2\.(mtp_block\.)?self_attn\.o_proj$"]
    assert mtp["input_activations"] is None  # no input scale in the source
    assert all(g["format"] == "float-quantized" for g in (tensor, block, mtp))


def test_ignore_keeps_the_source_wildcards_as_patterns(mixed: Path) -> None:
    """The source's exclusions as patterns, then every unquantized Linear by its exact name (vLLM maps exact names
    to its own module names, not patterns), an MTP module also by a pattern accepting its ``mtp_block`` name."""
    q = _q(mixed)
    assert q["ignore"] == ["lm_head", r"re:model\.layers\..*\.mlp\.gate$", r"re:model\.layers\.1\.self_attn.*$",
                           r"re:model\.layers\..*\.self_attn\.k_proj$", r"re:model\.layers\..*\.self_attn\.v_proj$",
                           *BF16[1:], r"re:model\.layers\.2\.(mtp_block\.)?eh_proj$"]
    # a wildcard keeps matching names that are not in today's checkpoint (vLLM's MTP renames, more layers)
    assert any(matches(p, "model.layers.61.mtp_block.mlp.gate") for p in q["ignore"])
    assert any(matches(p, f"{MTP}.mtp_block.eh_proj") for p in q["ignore"])


def test_kv_cache_scheme(mixed: Path, tmp_path: Path) -> None:
    assert _q(mixed)["kv_cache_scheme"] == KV_CACHE_FP8
    assert _q(mixed_nvfp4(tmp_path / "m", kv_cache=False))["kv_cache_scheme"] is None


def test_every_layer_resolves_to_its_precision(mixed: Path) -> None:
    """What vLLM's compressed-tensors matching gives each module of the output (mxfp4conv.targets.resolve)."""
    q = _q(mixed)
    want = {f"{A0}.o_proj": "fp8-tensor", f"{A0}.q_proj": "fp8-block", f"{A0}.k_proj": "bf16", f"{A1}.q_proj": "bf16",
            f"{A1}.o_proj": "bf16", "model.layers.0.mlp.gate": "bf16", "lm_head": "bf16",
            "model.layers.0.mlp.shared_expert_gate": "bf16", "model.layers.1.mlp.experts.0.gate_proj": "mxfp4",
            f"{MTP}.mtp_block.self_attn.o_proj": "fp8-tensor", f"{MTP}.mtp_block.eh_proj": "bf16"}
    assert {m: resolve_ct(q, m) for m in want} == want


def test_block_fp8_scales_take_the_name_compressed_tensors_reads(mixed: Path) -> None:
    ctx, _ = context(mixed)
    assert CT.passthrough_name(f"{A0}.q_proj.weight_scale_inv", ctx) == f"{A0}.q_proj.weight_scale"
    assert CT.passthrough_name(f"{A0}.o_proj.weight_scale", ctx) == f"{A0}.o_proj.weight_scale"
    assert CT.passthrough_name("lm_head.weight", ctx) == "lm_head.weight"
    spec = next(u for u in ctx.units if u.key == f"{A0}.q_proj.weight_scale_inv")
    assert [t.name for t in CT.out_specs(spec, ctx)] == [f"{A0}.q_proj.weight_scale"]


def test_mxfp4_source_keeps_its_own_config(ct_mxfp4: Path) -> None:
    ctx, cfg = context(ct_mxfp4)
    assert CT.config(cfg, ctx)["quantization_config"] == cfg["quantization_config"]


def test_nvfp4_ct_source_groups_become_mxfp4(tmp_path: Path) -> None:
    ctx, cfg = context(builders.build("ct-nvfp4", tmp_path / "nv", shards=1))
    q = CT.config(cfg, ctx)["quantization_config"]
    assert isinstance(q, dict)
    assert q["format"] == "mxfp4-pack-quantized"
    g = q["config_groups"]["group_0"]
    assert g["format"] == "mxfp4-pack-quantized" and g["targets"] == ["Linear"]
    assert g["weights"]["group_size"] == 32 and g["weights"]["scale_dtype"] == "torch.uint8"
    assert q["ignore"] == cfg["quantization_config"]["ignore"]


def test_split_names_and_roundtrip(mixed: Path) -> None:
    ctx, _ = context(mixed)
    spec = next(u for u in ctx.units if u.kind == "moe")
    names = [t.name for t in CT.out_specs(spec, ctx)]
    assert names[:6] == [f"{spec.key}.0.{p}.{s}" for p in ("gate_proj", "up_proj", "down_proj")
                         for s in ("weight_packed", "weight_scale")]
    assert len(names) == 4 * 3 * 2
    gen = torch.Generator().manual_seed(0)
    unit = MoELayer(spec.key, FP4Weight("mxfp4", torch.randint(0, 255, (4, 64, 32), generator=gen, dtype=torch.uint8),
                                        torch.randint(0, 255, (4, 64, 2), generator=gen, dtype=torch.uint8)),
                    FP4Weight("mxfp4", torch.randint(0, 255, (4, 64, 16), generator=gen, dtype=torch.uint8),
                              torch.randint(0, 255, (4, 64, 1), generator=gen, dtype=torch.uint8)))
    written = dict(zip(names, CT.encode(unit, spec, ctx), strict=True))
    assert [tuple(t.shape) for t in written.values()] == [t.shape for t in CT.out_specs(spec, ctx)]
    back = CT.decode(spec, ctx, written.__getitem__)
    assert isinstance(back, MoELayer)
    assert torch.equal(back.w13.packed, unit.w13.packed) and torch.equal(back.w2.scales, unit.w2.scales)


def test_deepseek_v4_names_and_e8m0_refusal(deepseek_v4: Path) -> None:
    ctx, _ = context(deepseek_v4)
    assert CT.refuse(ctx) == ("layers.0.attn.wo_b: FP8 with E8M0 block scales (scale) has no compressed-tensors "
                              "scheme (its FP8_BLOCK scales are float tensors); --to quark carries them as they are "
                              "(per_block FP8, E8M0 scales)")
    spec = next(u for u in ctx.units if u.kind == "moe")
    assert [t.name for t in CT.out_specs(spec, ctx)][:2] == [f"{spec.key}.0.w1.weight_packed", f"{spec.key}.0.w1.weight_scale"]


def test_gpt_oss_models_are_refused(gpt_oss: Path) -> None:
    ctx, _ = context(gpt_oss)
    assert CT.refuse(ctx) == ("vLLM's GPT-OSS loader reads only its native mxfp4 and the quark layouts; "
                              "use --to gpt-oss or --to quark")


def test_an_autoround_source_gets_a_compressed_tensors_config(tmp_path: Path) -> None:
    src = builders.autoround_mxfp4(tmp_path / "ar", act_bits=4, shards=1,
                                   extra_config={"model.layers.0.self_attn.q_proj": {"bits": 16}})
    q = _q(src)
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mxfp4-pack-quantized"
    assert list(q["config_groups"]) == ["group_0"]
    assert q["config_groups"]["group_0"]["input_activations"]["num_bits"] == 4  # act_bits 4: W4A4
    assert q["ignore"][0] == "model.layers.0.self_attn.q_proj"  # the source's own 16-bit module first
    bf16 = [f"model.layers.{n}.self_attn.{p}" for n in range(2) for p in ("k_proj", "o_proj", "q_proj", "v_proj")]
    assert set(q["ignore"]) == {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate", *bf16}
    assert resolve_ct(q, "model.layers.1.mlp.experts.0.up_proj") == "mxfp4"
