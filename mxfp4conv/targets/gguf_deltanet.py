"""Qwen3.5-MoE and Qwen3-Next for ``--to gguf``: llama.cpp's ``qwen35moe`` and ``qwen3next``, hybrids of Gated
DeltaNet (its ``ssm.*`` keys and tensors) and gated full attention, and the transformations llama.cpp's
converter gives their tensors (``Reshape``): A = -exp(A_log), (1 + weight) RMSNorms with 1 added, conv1d
squeezed, Qwen3.5's value heads tiled, Qwen3-Next's fused projection regrouped and split."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mxfp4conv.sources.gguf import KV, VType
from mxfp4conv.targets.gguf_common import QKVO, Arch, Reshape, common_kvs, head_dim_kvs, rope_config, u32

if TYPE_CHECKING:
    import torch

__all__ = ["QWEN3_NEXT", "QWEN35_MOE"]


def _qwen3next(cfg: Mapping[str, Any]) -> list[KV]:
    # Qwen3-Next: Gated DeltaNet layers (llama.cpp's ssm.* keys) and gated full attention every
    # ``full_attention_interval``-th layer, partial rotary, a shared expert
    rope = rope_config(cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    interval = int(cfg.get("full_attention_interval", 4))
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                       for i in range(n)]
    return [*common_kvs(cfg), u32("expert_feed_forward_length", cfg["moe_intermediate_size"]),
            u32("expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"]), *head_dim_kvs(cfg),
            u32("rope.dimension_count", int(head_dim * partial)),
            u32("ssm.conv_kernel", cfg["linear_conv_kernel_dim"]), u32("ssm.state_size", cfg["linear_key_head_dim"]),
            u32("ssm.group_count", cfg["linear_num_key_heads"]),
            u32("ssm.time_step_rank", cfg["linear_num_value_heads"]),
            u32("ssm.inner_size", cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]),
            KV("attention.recurrent_layers", VType.ARRAY, [t == "linear_attention" for t in types], VType.BOOL),
            u32("full_attention_interval", interval)]


def _qwen35moe(cfg: Mapping[str, Any]) -> list[KV]:
    # Qwen3-Next's keys, its rotary in interleaved MRoPE sections (all equal for text: one position per token)
    sections = [int(x) for x in rope_config(cfg).get("mrope_section", [11, 11, 10])][:4]
    return [*_qwen3next(cfg),
            KV("rope.dimension_sections", VType.ARRAY, sections + [0] * (4 - len(sections)), VType.INT32)]


def _v_tiled(cfg: Mapping[str, Any], head: int, before: int = 0) -> torch.Tensor:
    """Gated DeltaNet's value heads from grouped by key head (``[K0: v0..v(r-1), K1: ...]``, the checkpoint's)
    to tiled (``[v0 of K0, v0 of K1, ..., v1 of K0, ...]``, what ggml's broadcast expects), ``head`` rows per
    value head, after ``before`` rows kept in place."""
    import torch

    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    v = torch.arange(nv * head).reshape(nk, nv // nk, head).transpose(0, 1).reshape(-1)
    return torch.cat([torch.arange(before), v + before])


def _plus_one(t: torch.Tensor) -> torch.Tensor:
    return t.float() + 1.0  # Qwen3.5's RMSNorm scales by (1 + weight); llama.cpp's by its weight


def _neg_exp(t: torch.Tensor) -> torch.Tensor:
    return -t.float().exp()  # the decay A = -exp(A_log), which llama.cpp reads as ssm_a


def _qkvz_split(cfg: Mapping[str, Any]) -> Reshape:
    """Qwen3-Next's ``in_proj_qkvz`` (per key head: q, k, its value heads' v, their z) as llama.cpp's converter
    writes it: every head's q, then every k, every v (``attn_qkv``), and every z (``attn_gate``)."""
    import torch

    nk, hk = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
    vz = int(cfg["linear_num_value_heads"]) // nk * int(cfg["linear_value_head_dim"])
    sizes, per = (hk, hk, vz, vz), 2 * hk + 2 * vz
    at = [sum(sizes[:i]) for i in range(4)]
    rows = torch.cat([torch.arange(n) + h * per + a for a, n in zip(at, sizes, strict=True) for h in range(nk)])
    return Reshape(rows=rows, parts=(("attn_qkv.weight", nk * (2 * hk + vz)), ("attn_gate.weight", nk * vz)))


def _qwen3next_reshape(suffix: str, cfg: Mapping[str, Any]) -> Reshape | None:
    if suffix.endswith("norm.weight") and suffix != "linear_attn.norm.weight":  # that one is a plain gated norm
        return Reshape(values=_plus_one)
    if suffix == "linear_attn.in_proj_qkvz.weight":
        return _qkvz_split(cfg)
    if suffix == "linear_attn.A_log":
        return Reshape(values=_neg_exp)
    return Reshape(squeeze=True) if suffix == "linear_attn.conv1d.weight" else None


def _qwen35_reshape(suffix: str, cfg: Mapping[str, Any]) -> Reshape | None:
    if suffix.endswith("norm.weight") and suffix != "linear_attn.norm.weight":  # that one is a plain gated norm
        return Reshape(values=_plus_one)
    if not suffix.startswith("linear_attn."):
        return None
    tiled = int(cfg["linear_num_key_heads"]) != int(cfg["linear_num_value_heads"])
    qk = 2 * int(cfg["linear_num_key_heads"]) * int(cfg["linear_key_head_dim"])
    hv = int(cfg["linear_value_head_dim"])
    part = suffix[len("linear_attn."):]
    rows = None
    if tiled and part in ("in_proj_qkv.weight", "conv1d.weight"):
        rows = _v_tiled(cfg, hv, before=qk)
    elif tiled and part == "in_proj_z.weight":
        rows = _v_tiled(cfg, hv)
    elif tiled and part in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        rows = _v_tiled(cfg, 1)
    cols = _v_tiled(cfg, hv) if tiled and part == "out_proj.weight" else None
    squeeze = part == "conv1d.weight"  # llama.cpp's ssm_conv1d is {K, C}
    values = _neg_exp if part == "A_log" else None
    return None if rows is None and cols is None and not squeeze and values is None else Reshape(rows, cols, squeeze,
                                                                                                  values)


def _deltanet_refusal(cfg: Mapping[str, Any]) -> str | None:
    if cfg.get("linear_key_head_dim") != cfg.get("linear_value_head_dim"):
        return (f"config.json: Gated DeltaNet key heads of {cfg.get('linear_key_head_dim')} and value heads of "
                f"{cfg.get('linear_value_head_dim')}: llama.cpp sizes both from one key (ssm.state_size)")
    return None


_QWEN35 = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
           **QKVO, "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
           "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
           "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
           "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.A_log": "ssm_a",
           "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.norm.weight": "ssm_norm.weight",
           "linear_attn.out_proj.weight": "ssm_out.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
           **{f"mlp.shared_expert.{hf}_proj.weight": f"ffn_{hf}_shexp.weight" for hf in ("gate", "up", "down")},
           "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
# the text model of Qwen3.5-MoE: a multimodal release's vision tower goes to llama.cpp's separate mmproj GGUF, which
# this target does not write, and its MTP block is left out as llama.cpp's converter leaves it with --no-mtp
QWEN35_MOE = Arch("qwen35moe", _QWEN35, _qwen35moe, drop=("model.visual.", "mtp.", "model.mtp."),
                  reshape=_qwen35_reshape, refusal=_deltanet_refusal, nvfp4_scales=True)


# Qwen3-Next: Qwen3.5's names, its fused projections as its llama.cpp converter writes them (in_proj_qkvz split
# into attn_qkv / attn_gate, in_proj_ba as it is) and value heads in the checkpoint's order; its MTP block left out
_QWEN3NEXT = {**{k: v for k, v in _QWEN35.items() if not k.startswith("linear_attn.in_proj_")},
              "linear_attn.in_proj_qkvz.weight": "attn_qkv.weight", "linear_attn.in_proj_ba.weight": "ssm_ba.weight"}
QWEN3_NEXT = Arch("qwen3next", _QWEN3NEXT, _qwen3next, drop=("mtp.", "model.mtp."), reshape=_qwen3next_reshape,
                  refusal=_deltanet_refusal, nvfp4_scales=True)
