"""``ct``: compressed-tensors ``mxfp4-pack-quantized``, split experts (FORMATS.md §1.4, §6).

Experts are written per expert under the names the architecture's vLLM/SGLang loader maps
(``experts.E.{gate,up,down}_proj``; Mixtral/MiniMax ``w1/w3/w2``), with ``targets: ["Linear"]``.
"""

from __future__ import annotations

from typing import Any

from mxfp4conv.writers.base import SplitTarget, WriterContext, exact_ignore_list

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


class CtTarget(SplitTarget):
    NAME = "ct"
    PACKED = "weight_packed"

    def refuse(self, ctx: WriterContext) -> str | None:
        if ctx.facts.model_type == "gpt_oss":
            return ("vLLM's GPT-OSS loader reads only its native mxfp4 and the quark layouts; "
                    "use --to gpt-oss or --to quark")
        return None

    def config(self, src_config: dict[str, object], ctx: WriterContext) -> dict[str, object]:
        out = dict(src_config)
        src_q = src_config.get("quantization_config")
        if ctx.layout == "ct-mxfp4" and isinstance(src_q, dict):
            out["quantization_config"] = src_q  # already exactly what compressed-tensors wrote
        else:
            out["quantization_config"] = quantization_config(ctx)
        return out
