"""The architectures ``--to gguf`` writes, as llama.cpp names and reads them (``ARCHS``): each one's tensor
names (HF suffix -> GGUF suffix), its hyper-parameters from config.json, what llama.cpp's converter does to
a tensor beyond naming it (``Reshape``: rows moved, a fused projection split, values transformed) and the
config values its llama.cpp graph has no form for (``Arch.refusal``). The Gated DeltaNet hybrids are in
``gguf_deltanet``, what all share in ``gguf_common``."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mxfp4conv.sources.gguf import KV, VType
from mxfp4conv.targets.gguf_common import (
    LAYER,
    NORMS,
    QKVO,
    Arch,
    Reshape,
    common_kvs,
    f32,
    head_dim_kvs,
    layer_of,
    rope_config,
    text_hparams,
    text_name,
    u32,
)
from mxfp4conv.targets.gguf_deltanet import QWEN3_NEXT, QWEN35_MOE

if TYPE_CHECKING:
    import torch

__all__ = ["ARCHS", "LAYER", "Arch", "Reshape", "expert_prefix", "gguf_name", "layer_of", "rope_config", "text_hparams",
           "text_name"]


def _qwen3moe(cfg: Mapping[str, Any]) -> list[KV]:
    return [*common_kvs(cfg), u32("feed_forward_length", cfg.get("intermediate_size", cfg["moe_intermediate_size"])),
            u32("expert_feed_forward_length", cfg["moe_intermediate_size"]), *head_dim_kvs(cfg)]


def _gpt_oss(cfg: Mapping[str, Any]) -> list[KV]:
    out = [*common_kvs(cfg), u32("feed_forward_length", cfg["intermediate_size"]),
           u32("expert_feed_forward_length", cfg["intermediate_size"]), *head_dim_kvs(cfg),
           u32("attention.sliding_window", cfg["sliding_window"])]
    types = cfg.get("layer_types")
    if isinstance(types, list):  # which layers use the sliding window (llama.cpp's default: the even ones)
        out.append(KV("attention.sliding_window_pattern", VType.ARRAY, [t == "sliding_attention" for t in types],
                      VType.BOOL))
    return out


def _deepseek2(cfg: Mapping[str, Any]) -> list[KV]:
    # MLA: llama.cpp caches the compressed KV (one "head" of kv_lora_rank + the rope part)
    out = [kv for kv in common_kvs(cfg) if kv.key != "attention.head_count_kv"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    out += [u32("attention.head_count_kv", 1), u32("feed_forward_length", cfg["intermediate_size"]),
            u32("leading_dense_block_count", cfg.get("first_k_dense_replace", 0)),
            u32("vocab_size", cfg["vocab_size"]),
            u32("attention.kv_lora_rank", cfg["kv_lora_rank"]),
            u32("attention.key_length", cfg["kv_lora_rank"] + rope),
            u32("attention.value_length", cfg["kv_lora_rank"]),
            u32("attention.key_length_mla", nope + rope), u32("attention.value_length_mla", v),
            u32("expert_feed_forward_length", cfg["moe_intermediate_size"]),
            u32("expert_shared_count", cfg.get("n_shared_experts", 0)),
            f32("expert_weights_scale", cfg.get("routed_scaling_factor", 1.0)),
            u32("rope.dimension_count", rope)]
    if cfg.get("q_lora_rank"):
        out.append(u32("attention.q_lora_rank", cfg["q_lora_rank"]))
    if cfg.get("n_group") is not None:
        out += [u32("expert_group_count", cfg["n_group"]), u32("expert_group_used_count", cfg["topk_group"])]
    if cfg.get("norm_topk_prob"):
        out.append(KV("expert_weights_norm", VType.BOOL, True))
    out.append(u32("expert_gating_func", {"softmax": 1, "sigmoid": 2}[cfg.get("scoring_func", "softmax")]))
    rs = rope_config(cfg)
    if rs["rope_type"] == "yarn" and "mscale_all_dim" in rs:
        out.append(f32("rope.scaling.yarn_log_multiplier", 0.1 * float(rs["mscale_all_dim"])))
    return out


def _glm4moe(cfg: Mapping[str, Any]) -> list[KV]:
    # partial rotary embedding; sigmoid routing with a correction bias; leading dense layers; one shared expert
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    out = [*common_kvs(cfg), u32("feed_forward_length", cfg["intermediate_size"]), *head_dim_kvs(cfg),
           u32("rope.dimension_count", int(head_dim * float(cfg.get("partial_rotary_factor", 0.5)))),
           u32("expert_feed_forward_length", cfg["moe_intermediate_size"]),
           u32("expert_shared_count", cfg.get("n_shared_experts", 0)),
           u32("leading_dense_block_count", cfg.get("first_k_dense_replace", 0)),
           u32("expert_gating_func", 2),
           f32("expert_weights_scale", cfg.get("routed_scaling_factor", 1.0))]
    if cfg.get("norm_topk_prob"):
        out.append(KV("expert_weights_norm", VType.BOOL, True))
    nextn = cfg.get("num_nextn_predict_layers")
    if isinstance(nextn, int):  # its MTP blocks count as layers past the trunk, as llama.cpp's converter writes them
        out = [u32("block_count", cfg["num_hidden_layers"] + nextn) if kv.key == "block_count" else kv for kv in out]
        out.append(u32("nextn_predict_layers", nextn))
    return out


_MLP = {f"mlp.{hf}_proj.weight": f"ffn_{hf}.weight" for hf in ("gate", "up", "down")}
_SHARED = {f"mlp.shared_experts.{hf}_proj.weight": f"ffn_{hf}_shexp.weight" for hf in ("gate", "up", "down")}
_MLA = {"self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
        "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.kv_b_proj.weight": "attn_k_b.weight"}  # and attn_v_b.weight (``_mla_split``)
ARCHS: dict[str, Arch] = {
    "qwen3_moe": Arch("qwen3moe", {**NORMS, **QKVO, "self_attn.q_norm.weight": "attn_q_norm.weight",
                                   "self_attn.k_norm.weight": "attn_k_norm.weight",
                                   "mlp.gate.weight": "ffn_gate_inp.weight"}, _qwen3moe, nvfp4_scales=True),
    "gpt_oss": Arch("gpt-oss", {"input_layernorm.weight": "attn_norm.weight",
                                "post_attention_layernorm.weight": "post_attention_norm.weight", **QKVO,
                                "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
                                "mlp.router.bias": "ffn_gate_inp.bias"}, _gpt_oss),
    "deepseek_v3": Arch("deepseek2", {**NORMS, **_MLA, **_MLP, **_SHARED, "mlp.gate.weight": "ffn_gate_inp.weight",
                                      "mlp.gate.e_score_correction_bias": "exp_probs_b.bias"},
                        _deepseek2, mla=True, mtp=True),
}
ARCHS["kimi_k2"] = ARCHS["deepseek_v3"]
# what an MTP (NextN) block past num_hidden_layers holds beside a layer's own tensors, as llama.cpp names it
_NEXTN = {"eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
          "hnorm.weight": "nextn.hnorm.weight", "shared_head.norm.weight": "nextn.shared_head_norm.weight",
          "shared_head.head.weight": "nextn.shared_head_head.weight", "embed_tokens.weight": "nextn.embed_tokens.weight"}
# GLM-4.5 / 4.6: its MTP block written as llama.cpp's converter writes it (llama.cpp drafts tokens with it)
ARCHS["glm4_moe"] = Arch("glm4moe", {"input_layernorm.weight": "attn_norm.weight",
                                     "post_attention_layernorm.weight": "post_attention_norm.weight", **QKVO,
                                     "self_attn.q_norm.weight": "attn_q_norm.weight",
                                     "self_attn.k_norm.weight": "attn_k_norm.weight", **_MLP, **_SHARED,
                                     "mlp.gate.weight": "ffn_gate_inp.weight",
                                     "mlp.gate.e_score_correction_bias": "exp_probs_b.bias", **_NEXTN}, _glm4moe)
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(name: str, arch: Arch) -> str | None:
    """The GGUF name of a source tensor (or of an FP4 Linear's ``<module>.weight``), None if llama.cpp has none."""
    name = text_name(name)
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = LAYER.match(name)
    if m is None or m[2] not in arch.layer_names:
        return None
    return f"blk.{m[1]}.{arch.layer_names[m[2]]}"


def expert_prefix(key: str, arch: Arch) -> str | None:
    m = layer_of(key)
    return f"blk.{m[1]}" if m is not None and m[2] == arch.experts else None


_QK = re.compile(r"^self_attn\.([qk])_proj\.(weight|bias)$")


def _rotary_pairs(suffix: str, cfg: Mapping[str, Any]) -> Reshape | None:
    """For an architecture llama.cpp runs with interleaved rotary pairs (its NORM rope), the row order its
    converter gives a Q or K projection: in each head, row j of the first half then row j of the second."""
    import torch

    m = _QK.match(suffix)
    if m is None:
        return None
    heads = int(cfg["num_attention_heads"] if m[1] == "q" else cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    half = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) // 2
    return Reshape(rows=torch.tensor([h * 2 * half + t * half + j for h in range(heads) for j in range(half)
                                      for t in range(2)]))


def _granitemoe(cfg: Mapping[str, Any]) -> list[KV]:
    # llama.cpp's llama-family keys plus Granite's four multipliers; experts use feed_forward_length
    return [*common_kvs(cfg), u32("feed_forward_length", cfg["intermediate_size"]),
            u32("vocab_size", cfg["vocab_size"]),
            u32("rope.dimension_count", cfg["hidden_size"] // cfg["num_attention_heads"]),
            f32("attention.scale", cfg.get("attention_multiplier", 1.0)),
            f32("embedding_scale", cfg.get("embedding_multiplier", 1.0)),
            f32("residual_scale", cfg.get("residual_multiplier", 1.0)),
            f32("logit_scale", cfg.get("logits_scaling", 1.0))]


ARCHS["granitemoe"] = Arch("granitemoe", {**NORMS, **QKVO, "block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight"},
                           _granitemoe, experts="block_sparse_moe.experts", reshape=_rotary_pairs)


def _llama(cfg: Mapping[str, Any]) -> list[KV]:
    # Mixtral is llama.cpp's llama with experts: the rotary width is the head's, experts use feed_forward_length
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    out = [*common_kvs(cfg), u32("feed_forward_length", cfg["intermediate_size"]), u32("vocab_size", cfg["vocab_size"]),
           u32("rope.dimension_count", head_dim)]
    return out + (head_dim_kvs(cfg) if cfg.get("head_dim") else [])


ARCHS["mixtral"] = Arch("llama", {**NORMS, **QKVO, "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}, _llama,
                        experts="block_sparse_moe.experts", reshape=_rotary_pairs, nvfp4_scales=True)


ARCHS["qwen3_5_moe"] = ARCHS["qwen3_5_moe_text"] = QWEN35_MOE
ARCHS["qwen3_next"] = QWEN3_NEXT


def _qwen3vlmoe(cfg: Mapping[str, Any]) -> list[KV]:
    # Qwen3-MoE's keys, its interleaved MRoPE sections, and how many layers add the vision tower's deepstack features
    sections = [int(x) for x in rope_config(cfg)["mrope_section"]][:4]
    deepstack = len(cfg.get("vision_config", {}).get("deepstack_visual_indexes") or [])
    return [*_qwen3moe(cfg), KV("rope.dimension_sections", VType.ARRAY, sections + [0] * (4 - len(sections)), VType.INT32),
            u32("n_deepstack_layers", deepstack)]


def _mrope_refusal(cfg: Mapping[str, Any]) -> str | None:
    if "mrope_section" in rope_config(cfg):
        return None
    return "config.json: text_config gives no mrope_section, which llama.cpp's qwen3vlmoe needs"


# Qwen3-VL-MoE: the text model (the vision tower goes to llama.cpp's separate mmproj GGUF, not written here)
ARCHS["qwen3_vl_moe"] = Arch("qwen3vlmoe", ARCHS["qwen3_moe"].layer_names, _qwen3vlmoe, drop=("model.visual.",),
                             refusal=_mrope_refusal)


def _minimax_m2(cfg: Mapping[str, Any]) -> list[KV]:
    # sigmoid routing over a selection bias (exp_probs_b), partial rotary of rotary_dim, experts of intermediate_size
    return [*common_kvs(cfg), u32("feed_forward_length", cfg["intermediate_size"]),
            u32("expert_feed_forward_length", cfg["intermediate_size"]), *head_dim_kvs(cfg),
            u32("rope.dimension_count", cfg["rotary_dim"]), u32("expert_gating_func", 2)]


ARCHS["minimax_m2"] = Arch("minimax-m2", {**NORMS, **QKVO, "self_attn.q_norm.weight": "attn_q_norm.weight",
                                          "self_attn.k_norm.weight": "attn_k_norm.weight",
                                          "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
                                          "block_sparse_moe.e_score_correction_bias": "exp_probs_b.bias"},
                           _minimax_m2, experts="block_sparse_moe.experts")


def _llama4(cfg: Mapping[str, Any]) -> list[KV]:
    # dense layers of intermediate_size_mlp between MoE layers every interleave_moe_layer_step-th; rotary pairs
    # interleaved in the checkpoint already (llama.cpp's converter moves no rows)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return [*common_kvs(cfg), u32("feed_forward_length", cfg["intermediate_size_mlp"]),
            u32("expert_feed_forward_length", cfg["intermediate_size"]),
            u32("interleave_moe_layer_step", cfg.get("interleave_moe_layer_step", 1)), u32("vocab_size", cfg["vocab_size"]),
            u32("rope.dimension_count", head_dim), *head_dim_kvs(cfg)]


def _llama4_refusal(cfg: Mapping[str, Any]) -> str | None:
    """llama.cpp's llama4 fixes what Llama-4's config sets: chunked attention of 8192 with every fourth layer
    global and without RoPE, attention temperature tuning (floor 8192, scale 0.1), Q/K L2 norms unless it has
    128 experts (Maverick)."""
    n = int(cfg["num_hidden_layers"])
    fixed = {"no_rope_layers": [int((i + 1) % 4 != 0) for i in range(n)], "attention_chunk_size": 8192,
             "floor_scale": 8192, "attn_scale": 0.1, "attn_temperature_tuning": True,
             "use_qk_norm": int(cfg.get("num_local_experts", 0)) != 128}
    for key, want in fixed.items():
        got = cfg.get(key, want)
        if (list(got) if isinstance(got, list) else got) != want:
            return f"config.json: {key} {got!r}, where llama.cpp's llama4 fixes {want!r}"
    return None


def _llama3_factors(cfg: Mapping[str, Any]) -> torch.Tensor:
    """Llama-3-style RoPE scaling as llama.cpp takes it: one divisor per rotary frequency (``rope_freqs``), computed
    as its converter computes them (float32 frequencies, the factors in Python floats)."""
    import torch

    rope = rope_config(cfg)
    base = float(rope.get("rope_theta", 10000.0))
    dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = (float(rope.get(k, d)) for k, d in (("factor", 8.0), ("low_freq_factor", 1.0),
                                                            ("high_freq_factor", 4.0)))
    old = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _llama4_reshape(suffix: str, cfg: Mapping[str, Any]) -> Reshape | None:
    # the rope_freqs tensor travels with the output norm: a global tensor every llama4 GGUF has
    if suffix == "model.norm.weight" and rope_config(cfg)["rope_type"] == "llama3":
        return Reshape(extra=(("rope_freqs.weight", _llama3_factors(cfg)),))
    return None


_FFN = {f"feed_forward.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")}
ARCHS["llama4"] = Arch("llama4", {**NORMS, **QKVO, **_FFN, "feed_forward.router.weight": "ffn_gate_inp.weight",
                                  **{f"feed_forward.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight"
                                     for p in ("gate", "up", "down")}},
                       _llama4, experts="feed_forward.experts", drop=("vision_model.", "multi_modal_projector."),
                       reshape=_llama4_reshape, refusal=_llama4_refusal, ropes=("default", "llama3"))
ARCHS["llama4_text"] = ARCHS["llama4"]
