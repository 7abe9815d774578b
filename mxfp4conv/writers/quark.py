"""``quark``: AMD Quark MXFP4 (FORMATS.md §5): ``P.weight`` uint8 + ``P.weight_scale`` uint8 (E8M0).

For gpt_oss, experts use the per-expert fused names vLLM's ``_load_weights_quark`` expects
(``mlp.experts.E.w13_weight`` with INTERLEAVED gate/up rows, ``w13_weight_scale``, ``w13_bias``,
``w2_*``); other architectures use their split expert names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from mxfp4conv.canonical import Canonical, FP4Weight, MoELayer, UnitSpec
from mxfp4conv.layouts.gpt_oss import deinterleave_rows, interleave_rows
from mxfp4conv.writers.base import (
    Getter,
    OutTensor,
    SplitTarget,
    WriterContext,
    exact_ignore_list,
)

QUARK_VERSION = "0.10"


def quantization_config(ctx: WriterContext) -> dict[str, Any]:
    weight = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1, "scale_format": "e8m0",
              "scale_type": "float", "is_dynamic": False, "symmetric": None, "round_method": "half_even",
              "observer_cls": "PerBlockMXObserver", "scale_calculation_mode": "even", "mx_element_dtype": None}
    acts = None
    # Activations follow the source scheme (a W4A16 source must not be declared W4A4: runtimes
    # would then QDQ every activation); the "quark_activations" option ("mxfp4" | "none") overrides.
    if ctx.options.get("quark_activations", "mxfp4" if ctx.facts.scheme == "w4a4" else "none") == "mxfp4":
        acts = {**weight, "is_dynamic": True}
    return {
        "quant_method": "quark",
        "version": QUARK_VERSION,
        "global_quant_config": {"weight": weight, "input_tensors": acts, "output_tensors": None, "bias": None,
                                "target_device": None},
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "exclude": exact_ignore_list(ctx),
        "export": {"weight_format": "real_quantized", "pack_method": "reorder", "kv_cache_group": [],
                   "min_kv_scale": 0.0, "weight_merge_groups": None},
        "algo_config": None,
        "quant_mode": "eager_mode",
    }


class QuarkTarget(SplitTarget):
    NAME = "quark"
    PACKED = "weight"

    def _fused(self, ctx: WriterContext) -> bool:
        return ctx.facts.model_type == "gpt_oss"

    def direct_sources(self, spec: UnitSpec, ctx: WriterContext) -> list[str] | None:
        if spec.kind == "moe" and self._fused(ctx):
            return None  # gpt_oss per-expert fused names interleave gate/up rows: not a rename
        return super().direct_sources(spec, ctx)

    def out_specs(self, spec: UnitSpec, ctx: WriterContext) -> list[OutTensor]:
        if spec.kind == "moe" and self._fused(ctx):
            e_num, h, i = spec.dims
            bias = spec.extra.get("bias_dtype", "BF16")
            out: list[OutTensor] = []
            for e in range(e_num):
                p = f"{spec.key}.{e}"
                out += [OutTensor(f"{p}.w13_weight", "U8", (2 * i, h // 2)),
                        OutTensor(f"{p}.w13_weight_scale", "U8", (2 * i, h // 32))]
                if spec.has_bias:
                    out.append(OutTensor(f"{p}.w13_bias", bias, (2 * i,)))
                out += [OutTensor(f"{p}.w2_weight", "U8", (h, i // 2)), OutTensor(f"{p}.w2_weight_scale", "U8", (h, i // 32))]
                if spec.has_bias:
                    out.append(OutTensor(f"{p}.w2_bias", bias, (h,)))
            return out
        return super().out_specs(spec, ctx)

    def encode(self, unit: Canonical, spec: UnitSpec, ctx: WriterContext) -> list[torch.Tensor]:
        if isinstance(unit, MoELayer) and self._fused(ctx):
            w13p, w13s = interleave_rows(unit.w13.packed), interleave_rows(unit.w13.scales)
            b13 = interleave_rows(unit.w13_bias) if unit.w13_bias is not None else None
            out: list[torch.Tensor] = []
            for e in range(w13p.shape[0]):
                out += [w13p[e], w13s[e]] + ([b13[e]] if b13 is not None else [])
                out += [unit.w2.packed[e], unit.w2.scales[e]] + ([unit.w2_bias[e]] if unit.w2_bias is not None else [])
            return out
        return super().encode(unit, spec, ctx)

    def decode(self, spec: UnitSpec, ctx: WriterContext, get: Getter) -> Canonical:
        if spec.kind == "moe" and self._fused(ctx):
            e_num = spec.dims[0]

            def stack(s: str) -> torch.Tensor:
                import torch

                return torch.stack([get(f"{spec.key}.{e}.{s}") for e in range(e_num)])

            w13 = FP4Weight("mxfp4", deinterleave_rows(stack("w13_weight")), deinterleave_rows(stack("w13_weight_scale")))
            w2 = FP4Weight("mxfp4", stack("w2_weight"), stack("w2_weight_scale"))
            b13 = deinterleave_rows(stack("w13_bias")) if spec.has_bias else None
            return MoELayer(spec.key, w13, w2, b13, stack("w2_bias") if spec.has_bias else None)
        return super().decode(spec, ctx, get)

    def config(self, src_config: dict[str, object], ctx: WriterContext) -> dict[str, object]:
        return {**src_config, "quantization_config": quantization_config(ctx)}
