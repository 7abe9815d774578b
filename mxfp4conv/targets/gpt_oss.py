"""``gpt-oss``: the native GPT-OSS MXFP4 layout (FORMATS.md §3), for model_type gpt_oss only.

Re-interleaves gate/up rows (weights, scales, biases) and writes fused
``experts.{gate_up,down}_proj_{blocks,scales,bias}``; also re-fuses a GPT-OSS checkpoint that
llm-compressor linearized into per-expert names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from mxfp4conv.layouts.gpt_oss import deinterleave_rows, interleave_rows
from mxfp4conv.model.canonical import Canonical, FP4Weight, MoELayer, UnitSpec
from mxfp4conv.targets.base import Getter, OutTensor, Target, WriterContext
from mxfp4conv.targets.layers import precision_refusal

MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


class GptOssTarget(Target):
    NAME = "gpt-oss"
    DECODES_EXPERT_GROUPS = True
    ENCODES_ON_DEVICE = True  # row views and an interleave on the weights' device

    def refuse(self, ctx: WriterContext) -> str | None:
        if ctx.facts.model_type != "gpt_oss":
            return (f"the gpt-oss layout is only served for model_type gpt_oss (this is {ctx.facts.model_type!r}); "
                    "use --to ct or --to quark")
        dense = [u.key for u in ctx.units if u.kind == "dense"]
        if dense:
            return f"the gpt-oss layout has no FP4 dense layers, but {dense[0]} is FP4; use --to quark"
        return precision_refusal(ctx, "gpt-oss", fp8_block=False, fp8=False)

    def direct_sources(self, spec: UnitSpec, ctx: WriterContext) -> list[str] | None:
        if spec.kind == "moe" and ctx.layout == "gpt-oss":
            return [t.name for t in self.out_specs(spec, ctx)]  # same names, same interleaved bytes
        return super().direct_sources(spec, ctx)

    def out_specs(self, spec: UnitSpec, ctx: WriterContext) -> list[OutTensor]:
        if spec.kind != "moe":
            return super().out_specs(spec, ctx)
        e, h, i = spec.dims
        b = spec.extra.get("bias_dtype", "BF16")
        p = spec.key
        return [OutTensor(f"{p}.down_proj_bias", b, (e, h)),
                OutTensor(f"{p}.down_proj_blocks", "U8", (e, h, i // 32, 16)),
                OutTensor(f"{p}.down_proj_scales", "U8", (e, h, i // 32)),
                OutTensor(f"{p}.gate_up_proj_bias", b, (e, 2 * i)),
                OutTensor(f"{p}.gate_up_proj_blocks", "U8", (e, 2 * i, h // 32, 16)),
                OutTensor(f"{p}.gate_up_proj_scales", "U8", (e, 2 * i, h // 32))]

    def encode(self, unit: Canonical, spec: UnitSpec, ctx: WriterContext) -> list[torch.Tensor]:
        import torch

        if not isinstance(unit, MoELayer):
            return super().encode(unit, spec, ctx)
        e, h, i = spec.dims
        dt = spec.extra.get("bias_dtype", "BF16")
        zeros13 = torch.zeros(e, 2 * i, dtype=torch.bfloat16 if dt == "BF16" else torch.float32)
        zeros2 = torch.zeros(e, h, dtype=zeros13.dtype)
        b13 = unit.w13_bias if unit.w13_bias is not None else zeros13
        b2 = unit.w2_bias if unit.w2_bias is not None else zeros2
        return [b2, unit.w2.packed.reshape(e, h, i // 32, 16), unit.w2.scales,
                interleave_rows(b13), interleave_rows(unit.w13.packed).reshape(e, 2 * i, h // 32, 16),
                interleave_rows(unit.w13.scales)]

    def decode(self, spec: UnitSpec, ctx: WriterContext, get: Getter) -> Canonical:
        if spec.kind != "moe":
            return super().decode(spec, ctx, get)
        e, h, i = spec.dims
        p = spec.key
        w13 = FP4Weight("mxfp4", deinterleave_rows(get(f"{p}.gate_up_proj_blocks").reshape(e, 2 * i, h // 2)),
                        deinterleave_rows(get(f"{p}.gate_up_proj_scales")))
        w2 = FP4Weight("mxfp4", get(f"{p}.down_proj_blocks").reshape(e, h, i // 2), get(f"{p}.down_proj_scales"))
        b13 = deinterleave_rows(get(f"{p}.gate_up_proj_bias"))
        b2 = get(f"{p}.down_proj_bias")
        return MoELayer(p, w13, w2, b13 if spec.has_bias else None, b2 if spec.has_bias else None)

    def config(self, src_config: dict[str, object], ctx: WriterContext) -> dict[str, object]:
        q = src_config.get("quantization_config")
        keep = q.get("modules_to_not_convert") if isinstance(q, dict) and q.get("quant_method") == "mxfp4" else None
        return {**src_config, "quantization_config": {"modules_to_not_convert": keep or MODULES_TO_NOT_CONVERT,
                                                       "quant_method": "mxfp4"}}
