"""Reference loader for Marlin-ready shards (pure PyTorch + safetensors, no vLLM dependency).

vLLM 0.32-0.33 serves these shards through mxfp4conv's vLLM plugin (``pip install 'mxfp4conv[vllm]'``,
docs/serving-marlin.md). A server integrating them its own way uses this as the spec of what to
check and how tensors map onto the prepared parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

EXPECTED = {"mxfp4conv.format": "marlin-fp4", "mxfp4conv.marlin_layout": "v2", "mxfp4conv.params_dtype": "bfloat16",
            "mxfp4conv.act_dtype": "bf16"}
MARLIN_PARAMS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "w13_bias", "w2_bias",
                 "w13_weight_bias", "w2_weight_bias", "w13_weight_scale_2", "w2_weight_scale_2")


class MarlinReadyMismatch(ValueError):
    """The shards were prepared for another layout, engine or tensor-parallel split."""


def load_marlin_ready(folder: str | Path, *, tp_size: int, tp_rank: int, engine: str = "vllm",
                      experts_param_prefix: str = "") -> dict[str, torch.Tensor]:
    """Map the rank's Marlin-ready shards onto the engine's parameter names after preparation.

    Args:
        folder: the converted checkpoint (holding ``rank-0`` ... ``rank-N-1``).
        tp_size, tp_rank: the server's tensor-parallel size and this process's rank.
        engine: "vllm" or "sglang" (w13 row order and bias names differ).
        experts_param_prefix: vLLM >= 2026 keeps routed experts under ``experts.routed_experts``;
            pass "routed_experts" to map ``mlp.experts.w13_weight`` -> ``mlp.experts.routed_experts.w13_weight``.

    Returns:
        ``{parameter name: tensor}`` to copy into the model's parameters *instead of* running
        ``process_weights_after_loading``'s Marlin repack for the FP4 layers. Non-FP4 tensors are
        returned under their checkpoint names for the normal loader.
    """
    rank_dir = Path(folder) / f"rank-{tp_rank}"
    files = sorted(rank_dir.glob("*.safetensors"))
    if not files:
        raise MarlinReadyMismatch(f"{rank_dir}: no shards (was the checkpoint converted with --tp-size {tp_size}?)")
    cfg = json.loads((rank_dir / "config.json").read_text())["quantization_config"].get("mxfp4conv_marlin", {})
    if cfg.get("tp_size") != tp_size or cfg.get("engine") != engine:
        raise MarlinReadyMismatch(f"{rank_dir}: prepared for tp_size={cfg.get('tp_size')} engine={cfg.get('engine')}, "
                                  f"server runs tp_size={tp_size} engine={engine}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            meta = fh.metadata() or {}
            want = {**EXPECTED, "mxfp4conv.tp_size": str(tp_size), "mxfp4conv.tp_rank": str(tp_rank),
                    "mxfp4conv.engine": engine}
            bad = {k: meta.get(k) for k, v in want.items() if meta.get(k) != v}
            if bad:
                raise MarlinReadyMismatch(f"{f}: metadata {bad} does not match {want}")
            for name in fh.keys():  # noqa: SIM118
                out[_param_name(name, experts_param_prefix)] = fh.get_tensor(name)
    return out


def _param_name(name: str, prefix: str) -> str:
    module, _, leaf = name.rpartition(".")
    if prefix and leaf in MARLIN_PARAMS and module.endswith(".experts"):
        return f"{module}.{prefix}.{leaf}"
    return name
