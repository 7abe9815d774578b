"""NVIDIA's ModelOpt NVFP4 Qwen3.5-MoE releases (nvidia/Qwen3.5-397B-A17B-NVFP4, the Qwen3.6 NVFP4
exports) in miniature: the layout whose BF16 ``mtp.fc`` the ModelOpt config's main scheme claims.

Sources: the model card of nvidia/Qwen3.5-397B-A17B-NVFP4 (``Qwen3_5MoeForConditionalGeneration``;
3x Gated DeltaNet + 1x Gated Attention per block, each followed by a MoE with one shared expert; one
MTP layer); the ``exclude_modules`` ModelOpt's ``hf_ptq.py`` writes for these models (per layer
``linear_attn*``, ``mlp.shared_expert*``, ``mlp.shared_expert_gate``; ``model.visual*``; and for the
MTP block only ``mtp.layers.0*``, because ``_extract_layer_prefixes`` saw only ``*.layers.<n>``
prefixes until NVIDIA/Model-Optimizer PR 1124, so ``mtp.fc`` stayed BF16 but unlisted); vLLM
``vllm/model_executor/models/qwen3_5.py`` (names, ``hf_to_vllm_mapper`` of Qwen3-VL, the fused
``in_proj_qkvz`` / ``in_proj_ba`` / ``qkv_proj`` / ``gate_up_proj``) and ``qwen3_5_mtp.py`` (the
``mtp.*`` module names; ``fc`` built unquantized for ``modelopt_fp4``, vLLM PR 38650). The routers
``mlp.gate`` are not nn.Linear in transformers' Qwen3.5-MoE, so ModelOpt lists none of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .common import Replica, Sink, write_json
from .ct_families import (
    ALL_CONVERT,
    EXPERTS,
    FUSED_QKV_GU,
    GATE_UP,
    HEAD_DIM,
    MOE_I,
    QKV,
    QWEN3_VL_PREFIXES,
    VOCAB,
    H,
    _attn,
    _experts,
    _finish,
    _mlp3,
    _runtime,
)

TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
LINEAR_ATTN = {"in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz", "in_proj_b": "in_proj_ba",
               "in_proj_a": "in_proj_ba"}
FUSED = {**FUSED_QKV_GU, "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"]}


def _linear_attn(s: Sink, a: str) -> None:
    """Qwen3.5's Gated DeltaNet: key dim 32 (1 head), value dim 64 (2 heads), conv over q, k and v."""
    s.bf16(f"{a}.in_proj_qkv", 2 * 32 + 64, H)
    s.bf16(f"{a}.in_proj_z", 64, H)
    s.bf16(f"{a}.in_proj_b", 2, H)
    s.bf16(f"{a}.in_proj_a", 2, H)
    s.raw(f"{a}.conv1d.weight", (2 * 32 + 64, 1, 4))
    s.raw(f"{a}.A_log", (2,), torch.float32)
    s.raw(f"{a}.dt_bias", (2,))
    s.norm(f"{a}.norm", 32)
    s.bf16(f"{a}.out_proj", H, 64)


def _moe(s: Sink, p: str, fp4: Any) -> None:
    s.bf16(f"{p}.gate", EXPERTS, H)
    _experts(s, f"{p}.experts", fp4)
    _mlp3(s, f"{p}.shared_expert", MOE_I, s.bf16)
    s.bf16(f"{p}.shared_expert_gate", 1, H)


def _vision(s: Sink, v: str, vh: int) -> None:
    s.raw(f"{v}.patch_embed.proj.weight", (vh, 3, 2, 4, 4))
    s.raw(f"{v}.patch_embed.proj.bias", (vh,))
    s.embedding(f"{v}.pos_embed", 16, vh)
    b = f"{v}.blocks.0"
    for ln in ("norm1", "norm2"):
        s.norm(f"{b}.{ln}", vh)
        s.raw(f"{b}.{ln}.bias", (vh,))
    s.bf16(f"{b}.attn.qkv", 3 * vh, vh, bias=True)
    s.bf16(f"{b}.attn.proj", vh, vh, bias=True)
    s.bf16(f"{b}.mlp.linear_fc1", 2 * vh, vh, bias=True)
    s.bf16(f"{b}.mlp.linear_fc2", vh, 2 * vh, bias=True)
    s.norm(f"{v}.merger.norm", vh)
    s.raw(f"{v}.merger.norm.bias", (vh,))
    s.bf16(f"{v}.merger.linear_fc1", 4 * vh, 4 * vh, bias=True)
    s.bf16(f"{v}.merger.linear_fc2", H, 4 * vh, bias=True)


def _mtp(s: Sink) -> None:
    """The MTP block as published: BF16 throughout, ``fc`` [H, 2H] over [embedding; hidden]."""
    s.bf16("mtp.fc", H, 2 * H)
    for n in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm"):
        s.norm(f"mtp.{n}", H)
    p = "mtp.layers.0"
    s.norm(f"{p}.input_layernorm", H)
    s.norm(f"{p}.post_attention_layernorm", H)
    _attn(s, f"{p}.self_attn", s.bf16, q_rows=4 * HEAD_DIM)
    _moe(s, f"{p}.mlp", s.bf16)


def _config(exclude: list[str], producer: dict[str, str]) -> dict[str, Any]:
    text = {"model_type": "qwen3_5_moe_text", "hidden_size": H, "moe_intermediate_size": MOE_I,
            "shared_expert_intermediate_size": MOE_I, "num_experts": EXPERTS, "num_experts_per_tok": 2,
            "num_hidden_layers": len(TYPES), "layer_types": TYPES, "full_attention_interval": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HEAD_DIM, "attn_output_gate": True,
            "linear_num_value_heads": 2, "linear_num_key_heads": 1, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1,
            "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "hidden_act": "silu",
            "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [4, 6, 6], "mrope_interleaved": True}}
    vision = {"model_type": "qwen3_5_moe", "depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
              "out_hidden_size": H, "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2,
              "in_channels": 3, "num_position_embeddings": 16, "deepstack_visual_indexes": []}
    four = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text, "vision_config": vision, "tie_word_embeddings": False, "image_token_id": 250,
            "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253,
            "quantization_config": {
                "config_groups": {"group_0": {"input_activations": four, "weights": four, "targets": ["Linear"]}},
                "ignore": exclude, "quant_algo": "NVFP4", "producer": producer, "quant_method": "modelopt"}}


def modelopt_nvfp4_qwen35(root: Path) -> Replica:
    """nvidia/Qwen3.5-397B-A17B-NVFP4's layout: NVFP4 (W4A4) routed experts and full-attention
    projections; Gated DeltaNet ``linear_attn``, shared experts + ``shared_expert_gate``, routers, the
    vision tower, lm_head and the whole MTP block BF16; ``exclude_modules`` lists ``mtp.layers.0*`` but
    not ``mtp.fc``, in hf_quant_config.json and config.json's ``quantization_config.ignore`` alike."""
    root.mkdir(parents=True)
    s = Sink(97)

    def fp4(name: str, n: int, k: int) -> None:
        s.nvfp4_modelopt(name, n, k)

    lm = "model.language_model"
    s.embedding(f"{lm}.embed_tokens", VOCAB, H)
    s.norm(f"{lm}.norm", H)
    s.bf16("lm_head", VOCAB, H)
    exclude = ["lm_head"]
    for n, kind in enumerate(TYPES):
        p = f"{lm}.layers.{n}"
        s.norm(f"{p}.input_layernorm", H)
        s.norm(f"{p}.post_attention_layernorm", H)
        if kind == "full_attention":
            _attn(s, f"{p}.self_attn", fp4, q_rows=4 * HEAD_DIM)  # q_proj carries the output gate
        else:
            _linear_attn(s, f"{p}.linear_attn")
            exclude.append(f"{p}.linear_attn*")
        _moe(s, f"{p}.mlp", fp4)
        exclude += [f"{p}.mlp.shared_expert*", f"{p}.mlp.shared_expert_gate"]
    _vision(s, "model.visual", 64)
    _mtp(s)
    exclude += ["model.visual*", "mtp.layers.0*"]
    producer = {"name": "modelopt", "version": "0.42.0"}
    write_json(root / "hf_quant_config.json", {"producer": producer, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude}})
    _finish(root, s, _config(exclude, producer), shards=3)
    return Replica(path=root, family="modelopt-nvfp4-qwen35-moe", layout="modelopt-nvfp4", scheme="w4a4",
                   modules=dict(s.modules), runtime_names=_runtime({**QKV, **GATE_UP, **LINEAR_ATTN}, QWEN3_VL_PREFIXES),
                   kv_cache=None, expected_targets=ALL_CONVERT, fused=FUSED,
                   config_prefix_map={k: v for k, v in QWEN3_VL_PREFIXES.items() if k.endswith(".")})
