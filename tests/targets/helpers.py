"""Sources whose layers mix precisions, and the writer context the pipeline derives from their headers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mxfp4conv.plan.inspect import analyze, writer_context
from mxfp4conv.sources.checkpoint import open_checkpoint
from mxfp4conv.targets import WriterContext
from tests import builders

A0, A1, MTP = "model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2"
# the mixed source's unquantized Linears, sorted as the precision model lists them
BF16 = ["lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate", f"{A0}.k_proj", f"{A0}.v_proj",
        "model.layers.1.mlp.gate", f"{A1}.k_proj", f"{A1}.o_proj", f"{A1}.q_proj", f"{A1}.v_proj", f"{MTP}.eh_proj"]
EXCLUDE = ["lm_head", "model.layers.*.mlp.gate", "model.layers.1.self_attn*", "model.layers.*.self_attn.k_proj",
           "model.layers.*.self_attn.v_proj"]


def mixed_nvfp4(root: Path, *, fp8_k_proj: bool = False, kv_cache: bool = True) -> Path:
    """ModelOpt MIXED_PRECISION: NVFP4 experts (W4A4) in a 2-layer Qwen3-MoE, beside: FP8 per-tensor ``layers.0 o_proj`` (static
    input scale), FP8 128x128-block ``layers.0 q_proj`` (DeepSeek ``weight_scale_inv`` F32), BF16 attention in
    layer 1, an unlisted BF16 ``shared_expert_gate``, an MTP layer ``model.layers.2`` (past num_hidden_layers)
    with a BF16 ``eh_proj`` and an FP8 ``o_proj`` (no input scale), k/v scales and ``kv_cache_quant_algo: FP8``.
    ``fp8_k_proj``: layer 0's k_proj is FP8 per-tensor too (and not excluded)."""

    def expert(t: builders.Tensors, module: str, n: int, k: int) -> None:
        t.nvfp4(module, n, k, packed="weight", global_scale="weight_scale_2", divisor=False, input_scale="input_scale")

    def extra(t: builders.Tensors) -> None:
        t.fp8_tensor(f"{A0}.o_proj", 64, 64, input_scale=True)
        t.fp8_block(f"{A0}.q_proj", 64, 64)
        if fp8_k_proj:
            t.fp8_tensor(f"{A0}.k_proj", 32, 64, input_scale=False)
        for a in (A0, A1):
            t[f"{a}.k_proj.k_scale"] = torch.tensor(0.02)
            t[f"{a}.v_proj.v_scale"] = torch.tensor(0.02)
        t.bf16("model.layers.0.mlp.shared_expert_gate", 1, 64)
        t.bf16(f"{MTP}.eh_proj", 64, 128)
        t.fp8_tensor(f"{MTP}.self_attn.o_proj", 64, 64, input_scale=False)

    exclude = [e for e in EXCLUDE if not (fp8_k_proj and e.endswith(".k_proj"))]
    # ModelOpt writes such a mix as MIXED_PRECISION: every quantized module listed with its algorithm
    layers: dict[str, Any] = {f"model.layers.{n}.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16} for n in (0, 1)}
    layers |= {f"{A0}.o_proj": {"quant_algo": "FP8"}, f"{A0}.q_proj": {"quant_algo": "FP8_PB_WO"},
               f"{MTP}.self_attn.o_proj": {"quant_algo": "FP8"}}
    if fp8_k_proj:
        layers[f"{A0}.k_proj"] = {"quant_algo": "FP8"}
    quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8" if kv_cache else None,
             "exclude_modules": exclude, "quantized_layers": layers}
    return builders.moe_checkpoint(root, expert, {"quant_method": "modelopt", **quant}, extra=extra, shards=1,
                                   hf_quant_config={"producer": {"name": "modelopt"}, "quantization": quant})


def context(src: Path, options: dict[str, str] | None = None) -> tuple[WriterContext, dict[str, Any]]:
    """(writer context, source config.json) as convert derives them; the source must have no plan problems."""
    ckpt = open_checkpoint(src)
    _, plan, _ = analyze(ckpt)
    assert plan.problems == [], plan.problems
    return writer_context(plan, ckpt, options), json.loads((src / "config.json").read_text())
