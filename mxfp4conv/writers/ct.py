"""``ct``: compressed-tensors ``mxfp4-pack-quantized``, split experts (FORMATS.md §1.4, §6).

Experts are written per expert under the names the architecture's vLLM/SGLang loader maps
(``experts.E.{gate,up,down}_proj``; Mixtral/MiniMax ``w1/w3/w2``), with ``targets: ["Linear"]``.
"""

from __future__ import annotations

from typing import Any

import torch

from mxfp4conv.canonical import Canonical, DenseFP4, MoELayer, UnitSpec
from mxfp4conv.writers.base import (
    Getter,
    OutTensor,
    Target,
    WriterContext,
    dense_decode,
    dense_encode,
    dense_specs,
    exact_ignore_list,
    moe_split_decode,
    moe_split_encode,
    moe_split_specs,
    split_direct_sources,
)

CT_VERSION = "0.19.0"  # the compressed-tensors release whose config format this mirrors


def _args(w4a4: bool) -> dict[str, Any]:
    weights: dict[str, Any] = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
               "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
               "symmetric": True, "type": "float", "zp_dtype": None}
    acts = None
    if w4a4:
        acts = {**weights, "dynamic": True, "observer": None}
    return {"format": "mxfp4-pack-quantized", "input_activations": acts, "output_activations": None,
            "targets": ["Linear"], "weights": weights}


def quantization_config(ctx: WriterContext) -> dict[str, Any]:
    return {
        "config_groups": {"group_0": _args(ctx.facts.scheme == "w4a4")},
        "format": "mxfp4-pack-quantized",
        "global_compression_ratio": None,
        "ignore": exact_ignore_list(ctx),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


class CtTarget(Target):
    NAME = "ct"

    def refuse(self, ctx: WriterContext) -> str | None:
        if ctx.facts.model_type == "gpt_oss":
            return ("vLLM's GPT-OSS loader reads only its native mxfp4 and the quark layouts; "
                    "use --to gpt-oss or --to quark")
        return None

    def direct_sources(self, spec: UnitSpec, ctx: WriterContext) -> list[str] | None:
        if spec.kind == "passthrough":
            return super().direct_sources(spec, ctx)
        return split_direct_sources(spec, ctx)

    def out_specs(self, spec: UnitSpec, ctx: WriterContext) -> list[OutTensor]:
        if spec.kind == "moe":
            return moe_split_specs(spec, ctx, "weight_packed", "weight_scale")
        if spec.kind == "dense":
            return dense_specs(spec, "weight_packed", "weight_scale")
        return super().out_specs(spec, ctx)

    def encode(self, unit: Canonical, spec: UnitSpec, ctx: WriterContext) -> list[torch.Tensor]:
        if isinstance(unit, MoELayer):
            return moe_split_encode(unit)
        if isinstance(unit, DenseFP4):
            return dense_encode(unit)
        return super().encode(unit, spec, ctx)

    def decode(self, spec: UnitSpec, ctx: WriterContext, get: Getter) -> Canonical:
        if spec.kind == "moe":
            return moe_split_decode(spec, ctx, get, "weight_packed", "weight_scale")
        if spec.kind == "dense":
            return dense_decode(spec, get, "weight_packed", "weight_scale")
        return super().decode(spec, ctx, get)

    def config(self, src_config: dict[str, object], ctx: WriterContext) -> dict[str, object]:
        out = dict(src_config)
        src_q = src_config.get("quantization_config")
        if ctx.layout == "ct-mxfp4" and isinstance(src_q, dict):
            out["quantization_config"] = src_q  # already exactly what compressed-tensors wrote
        else:
            out["quantization_config"] = quantization_config(ctx)
        return out
