"""``quark``: AMD Quark MXFP4 (FORMATS.md §5): ``P.weight`` uint8 + ``P.weight_scale`` uint8 (E8M0).

For gpt_oss, experts use the per-expert fused names vLLM's ``_load_weights_quark`` expects
(``mlp.experts.E.w13_weight`` with INTERLEAVED gate/up rows, ``w13_weight_scale``, ``w13_bias``,
``w2_*``); other architectures use their split expert names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from mxfp4conv.layouts.gpt_oss import deinterleave_rows, interleave_rows
from mxfp4conv.model.canonical import Canonical, FP4Weight, MoELayer, UnitSpec
from mxfp4conv.targets.base import Getter, OutTensor, SplitTarget, WriterContext
from mxfp4conv.targets.layers import attention_layers, precision_refusal, unquantized_entries

QUARK_VERSION = "0.10"
# vLLM's Quark loader takes the KV-cache scheme from the layer_quant_config entries these patterns match
KV_CACHE_GROUP = ["*k_proj", "*v_proj"]


def _fp8_spec(dynamic: bool) -> dict[str, Any]:
    return {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "ch_axis": None, "group_size": None, "is_dynamic": dynamic,
            "symmetric": True, "round_method": "half_even", "scale_type": "float", "scale_format": None,
            "observer_cls": "PerTensorMinMaxObserver", "mx_element_dtype": None}


def _fp8_block_spec(e8m0: bool) -> dict[str, Any]:
    """128x128 block FP8 weights (vLLM QuarkW8A8Fp8PerBlock; ``scale_type`` float8_e8m0fnu for E8M0 scales)."""
    return {"dtype": "fp8_e4m3", "qscheme": "per_block", "block_size": [128, 128], "ch_axis": None, "group_size": None,
            "is_dynamic": False, "symmetric": True, "round_method": "half_even",
            "scale_type": "float8_e8m0fnu" if e8m0 else "float", "scale_format": None, "mx_element_dtype": None}


# activations of a block FP8 layer: dynamic, one scale per 128 input features of each token
_FP8_GROUP_ACTS = {"dtype": "fp8_e4m3", "qscheme": "per_group", "group_size": 128, "ch_axis": -1, "is_dynamic": True,
                   "symmetric": True, "round_method": "half_even", "scale_type": "float", "scale_format": None,
                   "mx_element_dtype": None}


def _layer(weight: dict[str, Any] | None, acts: dict[str, Any] | None, outputs: dict[str, Any] | None = None
           ) -> dict[str, Any]:
    return {"weight": weight, "input_tensors": acts, "output_tensors": outputs, "bias": None, "target_device": None}


def quantization_config(ctx: WriterContext) -> dict[str, Any]:
    weight = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1, "scale_format": "e8m0",
              "scale_type": "float", "is_dynamic": False, "symmetric": None, "round_method": "half_even",
              "observer_cls": "PerBlockMXObserver", "scale_calculation_mode": "even", "mx_element_dtype": None}
    acts = None
    # Activations follow the source scheme (a W4A16 source must not be declared W4A4: runtimes
    # would then QDQ every activation); the "quark_activations" option ("mxfp4" | "none") overrides.
    if (ctx.target_options.quark_activations or ("mxfp4" if ctx.facts.scheme == "w4a4" else "none")) == "mxfp4":
        acts = {**weight, "is_dynamic": True}
    layers: dict[str, Any] = {}
    for lin in ctx.precision.fp8.values():
        if lin.kind == "fp8-block":
            layers[_quark_key(lin.module, ctx)] = _layer(_fp8_block_spec(lin.scale_dtype == "F8_E8M0"), dict(_FP8_GROUP_ACTS))
        else:
            layers[_quark_key(lin.module, ctx)] = _layer(_fp8_spec(False), _fp8_spec(False) if lin.input_scale else None)
    kv_group: list[str] = []
    if ctx.precision.kv_cache == "fp8":
        kv_group = KV_CACHE_GROUP
        for pat in KV_CACHE_GROUP:  # k/v projections not excluded are FP4 (precision_refusal checked)
            layers[pat] = _layer(weight, acts, _fp8_spec(False))
    return {
        "quant_method": "quark",
        "version": QUARK_VERSION,
        "global_quant_config": _layer(weight, acts),
        "layer_quant_config": layers,
        "layer_type_quant_config": {},
        # vLLM's Quark loader asks `exclude` about Attention layers too: an excluded one loses its FP8 KV cache
        "exclude": unquantized_entries(ctx, keep_matching=attention_layers(ctx) if kv_group else ()),
        "export": {"weight_format": "real_quantized", "pack_method": "reorder", "kv_cache_group": kv_group,
                   "min_kv_scale": 0.0, "weight_merge_groups": None},
        "algo_config": None,
        "quant_mode": "eager_mode",
    }


def _quark_key(module: str, ctx: WriterContext) -> str:
    """A layer_quant_config key for one module: vLLM matches a key without ``*`` as a substring of the layer
    name and one with ``*`` by fnmatch; MTP layers (past num_hidden_layers) also answer to ``.mtp_block.``."""
    from mxfp4conv.model.precision import mtp_split

    parts = mtp_split(module, ctx.facts.num_layers)
    return module if parts is None else f"{parts[0]}*{parts[1]}"


def _kv_refusal(ctx: WriterContext) -> str | None:
    """The KV-cache entries (``*k_proj`` / ``*v_proj``) carry the FP4 weight scheme: an FP8 or unexcluded
    BF16 k/v projection would be mis-declared."""
    if ctx.precision.kv_cache != "fp8":
        return None
    for lin in ctx.precision.fp8.values():
        if lin.module.endswith(("k_proj", "v_proj")):
            return f"{lin.module}: an FP8 k/v projection beside an FP8 KV cache has no Quark layer_quant_config"
    return None


class QuarkTarget(SplitTarget):
    NAME = "quark"
    DECODES_EXPERT_GROUPS = True
    PACKED = "weight"

    def refuse(self, ctx: WriterContext) -> str | None:
        return precision_refusal(ctx, "Quark", fp8_block=True, e8m0_block=True) or _kv_refusal(ctx)

    def passthrough_name(self, name: str, ctx: WriterContext) -> str:
        """Block FP8 scales are ``weight_scale`` in Quark (a multiplier, as DeepSeek's ``weight_scale_inv``
        and DeepSeek-V4's ``scale``): same bytes, the name vLLM's Quark loader reads."""
        module, _, suffix = name.rpartition(".")
        lin = ctx.precision.fp8.get(module)
        if lin is not None and lin.kind == "fp8-block" and suffix == lin.scale and suffix != "weight_scale":
            return f"{module}.weight_scale"
        return name

    def _fused(self, ctx: WriterContext) -> bool:
        return ctx.facts.model_type == "gpt_oss"

    def direct_sources(self, spec: UnitSpec, ctx: WriterContext) -> list[str] | None:
        if spec.kind == "moe" and self._fused(ctx):
            return None  # gpt_oss per-expert fused names interleave gate/up rows: not a rename
        return super().direct_sources(spec, ctx)

    def out_specs(self, spec: UnitSpec, ctx: WriterContext) -> list[OutTensor]:
        if spec.kind == "moe" and self._fused(ctx):
            _, h, i = spec.dims
            bias = spec.extra.get("bias_dtype", "BF16")
            out: list[OutTensor] = []
            for e in spec.experts:
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
            def stack(s: str) -> torch.Tensor:
                import torch

                return torch.stack([get(f"{spec.key}.{e}.{s}") for e in spec.experts])

            w13 = FP4Weight("mxfp4", deinterleave_rows(stack("w13_weight")), deinterleave_rows(stack("w13_weight_scale")))
            w2 = FP4Weight("mxfp4", stack("w2_weight"), stack("w2_weight_scale"))
            b13 = deinterleave_rows(stack("w13_bias")) if spec.has_bias else None
            return MoELayer(spec.key, w13, w2, b13, stack("w2_bias") if spec.has_bias else None)
        return super().decode(spec, ctx, get)

    def config(self, src_config: dict[str, object], ctx: WriterContext) -> dict[str, object]:
        return {**src_config, "quantization_config": quantization_config(ctx)}
