"""``ct``: compressed-tensors ``mxfp4-pack-quantized``, split experts (docs/FORMATS.md §1.4, §6, §9).

Experts are written per expert under the names the architecture's vLLM/SGLang loader maps
(``experts.E.{gate,up,down}_proj``; Mixtral/MiniMax ``w1/w3/w2``; DeepSeek-V4 ``w1/w3/w2``). The FP4
modules form one config group targeting ``Linear``; FP8 Linears get groups of their own that name
them (vLLM matches names before class names), 128x128 block scales under the name compressed-tensors
reads (``weight_scale``); unquantized Linears are ``ignore``d; an FP8 KV cache is ``kv_cache_scheme``.
A compressed-tensors source keeps its own config: its NVFP4 groups become MXFP4 groups, targets kept,
and ``ignore`` gains every unquantized Linear its entries do not reach by the runtime's matching.
"""

from __future__ import annotations

import copy
from typing import Any

from mxfp4conv.model.precision import mtp_runtime_name, runtime_pattern
from mxfp4conv.targets.base import SplitTarget, WriterContext
from mxfp4conv.targets.layers import fp8_groups, precision_refusal, unquantized_entries
from mxfp4conv.targets.resolve import resolve_ct

CT_VERSION = "0.19.0"  # the compressed-tensors release whose config format this mirrors
FP8_BLOCK = [128, 128]
KV_CACHE_FP8 = {"dynamic": False, "num_bits": 8, "strategy": "tensor", "symmetric": True, "type": "float"}


def _args(w4a4: bool) -> dict[str, Any]:
    weights: dict[str, Any] = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
               "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
               "symmetric": True, "type": "float", "zp_dtype": None}
    acts = None
    if w4a4:
        acts = {**weights, "dynamic": True, "observer": None}
    return {"format": "mxfp4-pack-quantized", "input_activations": acts, "output_activations": None,
            "targets": ["Linear"], "weights": weights}


def _fp8_args(kind: str, static_input: bool, targets: list[str]) -> dict[str, Any]:
    """FP8 per-tensor (static input scale when the source has one) or 128x128 blocks (dynamic activations
    per token group of 128, as DeepSeek's FP8 and llm-compressor's FP8_BLOCK preset)."""
    block = kind == "fp8-block"
    weights: dict[str, Any] = {"actorder": None, "block_structure": FP8_BLOCK if block else None, "dynamic": False,
                               "group_size": None, "num_bits": 8, "observer": "minmax", "observer_kwargs": {},
                               "scale_dtype": None, "strategy": "block" if block else "tensor", "symmetric": True,
                               "type": "float", "zp_dtype": None}
    acts: dict[str, Any] | None = None
    if block:
        acts = {**weights, "block_structure": None, "dynamic": True, "group_size": 128, "observer": None,
                "strategy": "group"}
    elif static_input:
        acts = {**weights, "strategy": "tensor"}
    return {"format": "float-quantized", "input_activations": acts, "output_activations": None,
            "targets": targets, "weights": weights}


def quantization_config(ctx: WriterContext) -> dict[str, Any]:
    groups: dict[str, Any] = {"group_0": _args(ctx.facts.scheme == "w4a4")}
    for (kind, static_input), targets in fp8_groups(ctx).items():
        groups[f"group_{len(groups)}"] = _fp8_args(kind, static_input, targets)
    return {
        "config_groups": groups,
        "format": "mxfp4-pack-quantized" if len(groups) == 1 else "mixed-precision",
        "global_compression_ratio": None,
        "ignore": unquantized_entries(ctx),
        "kv_cache_scheme": dict(KV_CACHE_FP8) if ctx.precision.kv_cache == "fp8" else None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def _from_ct_source(src_q: dict[str, Any], ctx: WriterContext) -> dict[str, Any]:
    """A compressed-tensors NVFP4 source's own config with its NVFP4 groups made MXFP4 (targets, ignore,
    other groups and the KV-cache scheme as the source wrote them)."""
    q = copy.deepcopy(src_q)
    formats = set()
    for name, g in q.get("config_groups", {}).items():
        if isinstance(g, dict) and g.get("format", q.get("format")) == "nvfp4-pack-quantized":
            q["config_groups"][name] = {**_args(ctx.facts.scheme == "w4a4"), "targets": g.get("targets", ["Linear"])}
        formats.add(q["config_groups"][name].get("format", q.get("format")))
    q["format"] = formats.pop() if len(formats) == 1 else "mixed-precision"
    return q


def _complete_ignore(q: dict[str, Any], ctx: WriterContext) -> dict[str, Any]:
    """The source's ``ignore`` plus, by exact name (and its MTP runtime pattern), every unquantized Linear
    that the source's entries miss under the runtime's matching: producers name the module they were
    told to skip (llm-compressor's GraniteMoE ``block_sparse_moe.router``), not always the Linear on disk
    (``router.layer``), which a ``Linear`` target would then claim."""
    ignore = list(q.get("ignore") or [])
    n = ctx.facts.num_layers
    for m in ctx.precision.bf16:
        names = [m] + [r for r in (mtp_runtime_name(m, n),) if r]
        if any(resolve_ct({**q, "ignore": ignore}, name) != "bf16" for name in names):
            ignore += [m] if runtime_pattern(m, n) == m else [m, runtime_pattern(m, n)]
    return {**q, "ignore": ignore}


class CtTarget(SplitTarget):
    NAME = "ct"
    DECODES_EXPERT_GROUPS = True
    PACKED = "weight_packed"

    def refuse(self, ctx: WriterContext) -> str | None:
        if ctx.facts.model_type == "gpt_oss":
            return ("vLLM's GPT-OSS loader reads only its native mxfp4 and the quark layouts; "
                    "use --to gpt-oss or --to quark")
        return precision_refusal(ctx, "compressed-tensors", fp8_block=True)

    def passthrough_name(self, name: str, ctx: WriterContext) -> str:
        """DeepSeek's block FP8 scale ``weight_scale_inv`` (a multiplier, despite the name) is what
        compressed-tensors FP8_BLOCK calls ``weight_scale``: same bytes, the name the runtime reads."""
        if name.endswith(".weight_scale_inv") and name[: -len(".weight_scale_inv")] in ctx.precision.fp8:
            return name[: -len("_inv")]
        return name

    def config(self, src_config: dict[str, object], ctx: WriterContext) -> dict[str, object]:
        out = dict(src_config)
        src_q = src_config.get("quantization_config")
        if isinstance(src_q, dict) and src_q.get("quant_method") == "compressed-tensors":
            # already a compressed-tensors description of every layer
            out["quantization_config"] = _complete_ignore(src_q if ctx.layout == "ct-mxfp4" else _from_ct_source(src_q, ctx), ctx)
        else:
            out["quantization_config"] = quantization_config(ctx)
        return out
