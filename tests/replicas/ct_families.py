"""compressed-tensors NVFP4 replicas as llm-compressor writes them (Qwen3-Next, Qwen3-VL-MoE,
Llama-4, GLM-4.5: experts linearized to ``experts.E.{gate,up,down}_proj``), an AutoRound
``auto_round:llm_compressor`` MXFP4 Qwen3-MoE (the same tensors as compressed-tensors MXFP4), and a
ModelOpt NVFP4 Qwen3-MoE whose attention is NVFP4 too, with an FP8 KV cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .common import Replica, Sink, ct_config, ct_group, write_json, write_side_files

H, MOE_I, DENSE_I, EXPERTS, VOCAB, HEAD_DIM = 128, 64, 128, 4, 256, 64
ALL_CONVERT: dict[str, str | None] = {"ct": None, "quark": None, "marlin": None}
QKV = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
GATE_UP = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
FUSED_QKV_GU = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _runtime(leaf_map: dict[str, str], prefix_map: dict[str, str], *,
             keep: tuple[str, ...] = ()) -> Callable[[str], list[str]]:
    """Source module -> vLLM module prefix: routed experts become one ``experts`` layer, shards
    become their fused module (``leaf_map``), checkpoint prefixes get the model's renames."""

    def names(name: str) -> list[str]:
        parts = name.split(".")
        if len(parts) > 2 and parts[-3] == "experts" and parts[-2].isdigit():
            parts = parts[:-2]
        elif parts[-1] in leaf_map and not any(k in name for k in keep):
            parts = [*parts[:-1], leaf_map[parts[-1]]]
        out = ".".join(parts)
        for old, new in prefix_map.items():
            if out.startswith(old):
                out = new + out[len(old):]
                break
        return [out]

    return names


def _experts(s: Sink, p: str, quant: Callable[[str, int, int], None]) -> None:
    for e in range(EXPERTS):
        quant(f"{p}.{e}.gate_proj", MOE_I, H)
        quant(f"{p}.{e}.up_proj", MOE_I, H)
        quant(f"{p}.{e}.down_proj", H, MOE_I)


def _mlp3(s: Sink, p: str, inter: int, quant: Callable[[str, int, int], None]) -> None:
    quant(f"{p}.gate_proj", inter, H)
    quant(f"{p}.up_proj", inter, H)
    quant(f"{p}.down_proj", H, inter)


def _attn(s: Sink, p: str, quant: Callable[..., None], *, q_rows: int = 2 * HEAD_DIM, norms: bool = True) -> None:
    quant(f"{p}.q_proj", q_rows, H)
    quant(f"{p}.k_proj", HEAD_DIM, H)
    quant(f"{p}.v_proj", HEAD_DIM, H)
    quant(f"{p}.o_proj", H, 2 * HEAD_DIM)
    if norms:
        s.norm(f"{p}.q_norm", HEAD_DIM)
        s.norm(f"{p}.k_norm", HEAD_DIM)


def _finish(root: Path, s: Sink, cfg: dict[str, Any], shards: int = 2) -> None:
    write_json(root / "config.json", cfg)
    s.save(root, shards)
    write_side_files(root)


def qwen3_next(root: Path) -> Replica:
    """Qwen3-Next NVFP4 (W4A4): gated-DeltaNet ``linear_attn`` layers BF16 (conv1d 3-D, A_log,
    dt_bias), one full-attention layer whose q/k/v/o are NVFP4, routed experts + ``shared_expert``
    NVFP4, ``shared_expert_gate`` [1, H] BF16."""
    root.mkdir(parents=True)
    s = Sink(61)

    def fp4(name: str, n: int, k: int) -> None:
        s.nvfp4_ct(name, n, k, w4a4=True)

    s.embedding("model.embed_tokens", VOCAB, H)
    s.norm("model.norm", H)
    s.bf16("lm_head", VOCAB, H)
    types = ["linear_attention", "linear_attention", "full_attention"]
    for n, kind in enumerate(types):
        p = f"model.layers.{n}"
        s.norm(f"{p}.input_layernorm", H)
        s.norm(f"{p}.post_attention_layernorm", H)
        if kind == "full_attention":
            _attn(s, f"{p}.self_attn", fp4, q_rows=4 * HEAD_DIM)  # q_proj also carries the output gate
        else:
            a = f"{p}.linear_attn"
            s.bf16(f"{a}.in_proj_qkvz", 192, H)
            s.bf16(f"{a}.in_proj_ba", 4, H)
            s.raw(f"{a}.conv1d.weight", (128, 1, 4))
            s.raw(f"{a}.A_log", (2,), torch.float32)
            s.raw(f"{a}.dt_bias", (2,))
            s.norm(f"{a}.norm", 32)
            s.bf16(f"{a}.out_proj", H, 64)
        s.bf16(f"{p}.mlp.gate", EXPERTS, H)
        _experts(s, f"{p}.mlp.experts", fp4)
        _mlp3(s, f"{p}.mlp.shared_expert", MOE_I, fp4)
        s.bf16(f"{p}.mlp.shared_expert_gate", 1, H)
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": H,
           "intermediate_size": DENSE_I, "moe_intermediate_size": MOE_I, "shared_expert_intermediate_size": MOE_I,
           "num_experts": EXPERTS, "num_experts_per_tok": 2, "num_hidden_layers": 3, "layer_types": types,
           "full_attention_interval": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HEAD_DIM,
           "linear_num_value_heads": 2, "linear_num_key_heads": 1, "linear_key_head_dim": 32,
           "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "norm_topk_prob": True, "partial_rotary_factor": 0.25, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
           "rope_theta": 10000000.0, "max_position_embeddings": 512, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "quantization_config": ct_config(
               {"group_0": ct_group("nvfp4", ["Linear"], w4a4=True)},
               ["lm_head", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$", "re:.*linear_attn.*"],
               fmt="nvfp4-pack-quantized")}
    _finish(root, s, cfg)
    fused = {**FUSED_QKV_GU, "in_proj_qkvz": ["in_proj_qkvz"], "in_proj_ba": ["in_proj_ba"]}
    return Replica(path=root, family="ct-nvfp4-qwen3-next", layout="ct-nvfp4", scheme="w4a4", modules=dict(s.modules),
                   runtime_names=_runtime({**QKV, **GATE_UP}, {}), kv_cache=None, expected_targets=ALL_CONVERT,
                   fused=fused)


QWEN3_VL_PREFIXES = {"model.visual.": "visual.", "lm_head": "language_model.lm_head",
                     "model.language_model.": "language_model.model."}


def _sections(head_dim: int) -> list[int]:
    """Qwen3-VL's MRoPE sections (temporal, height, width) in its releases' proportion, summing to head_dim / 2."""
    h = w = head_dim * 5 // 32
    return [head_dim // 2 - h - w, h, w]


def qwen3_vl_moe(root: Path) -> Replica:
    """Qwen3-VL-MoE NVFP4A16: ``model.language_model.layers.*`` with ``text_config``, attention BF16
    listed by exact name in ``ignore``, a BF16 vision tower (5-D patch conv) ignored by regex."""
    root.mkdir(parents=True)
    s = Sink(67)

    def fp4(name: str, n: int, k: int) -> None:
        s.nvfp4_ct(name, n, k, w4a4=False)

    lm = "model.language_model"
    s.embedding(f"{lm}.embed_tokens", VOCAB, H)
    s.norm(f"{lm}.norm", H)
    s.bf16("lm_head", VOCAB, H)
    exact = []
    for n in range(2):
        p = f"{lm}.layers.{n}"
        s.norm(f"{p}.input_layernorm", H)
        s.norm(f"{p}.post_attention_layernorm", H)
        _attn(s, f"{p}.self_attn", s.bf16)
        exact += [f"{p}.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
        s.bf16(f"{p}.mlp.gate", EXPERTS, H)
        _experts(s, f"{p}.mlp.experts", fp4)
    v, vh = "model.visual", 64
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
    text = {"model_type": "qwen3_vl_moe_text", "hidden_size": H, "intermediate_size": DENSE_I,
            "moe_intermediate_size": MOE_I, "num_experts": EXPERTS, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HEAD_DIM, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
            "rope_theta": 5000000.0, "max_position_embeddings": 512, "hidden_act": "silu", "torch_dtype": "bfloat16",
            # as the releases' text_config has it (Qwen3-VL-30B-A3B: [24, 20, 20] of head_dim 128)
            "rope_scaling": {"rope_type": "default", "mrope_section": _sections(HEAD_DIM), "mrope_interleaved": True}}
    vision = {"model_type": "qwen3_vl_moe", "depth": 1, "hidden_size": vh, "intermediate_size": 2 * vh,
              "num_heads": 2, "out_hidden_size": H, "patch_size": 4, "temporal_patch_size": 2,
              "spatial_merge_size": 2, "in_channels": 3, "num_position_embeddings": 16, "deepstack_visual_indexes": []}
    cfg = {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
           "text_config": text, "vision_config": vision, "tie_word_embeddings": False, "image_token_id": 250,
           "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253,
           "quantization_config": ct_config(
               {"group_0": ct_group("nvfp4", ["Linear"], w4a4=False)},
               ["lm_head", "re:visual.*", "re:model.visual.*", "re:.*mlp.gate$", *exact], fmt="nvfp4-pack-quantized")}
    _finish(root, s, cfg)
    return Replica(path=root, family="ct-nvfp4-qwen3-vl-moe", layout="ct-nvfp4", scheme="w4a16",
                   modules=dict(s.modules), runtime_names=_runtime(QKV, QWEN3_VL_PREFIXES), kv_cache=None,
                   expected_targets=ALL_CONVERT, fused={"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
                   config_prefix_map={k: v for k, v in QWEN3_VL_PREFIXES.items() if k.endswith(".")})


KV_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
          "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {},
          "scale_dtype": None, "zp_dtype": None}


def llama4(root: Path) -> Replica:
    """Llama-4 (Llama4ForConditionalGeneration) NVFP4 with an FP8 KV cache: ``language_model.model.layers.*``,
    layer 0 dense (``feed_forward.{gate,up,down}_proj``), layer 1 MoE (``feed_forward.router``,
    ``shared_expert``, linearized experts); attention and router BF16 by regex (``self_attn.{k,v}_scale``
    F32); the vision tower BF16, ignored by exact names (``vision_model.patch_embedding.linear`` is an
    nn.Linear)."""
    root.mkdir(parents=True)
    s = Sink(71)

    def fp4(name: str, n: int, k: int) -> None:
        s.nvfp4_ct(name, n, k, w4a4=True)

    lm = "language_model.model"
    s.embedding(f"{lm}.embed_tokens", VOCAB, H)
    s.norm(f"{lm}.norm", H)
    s.bf16("language_model.lm_head", VOCAB, H)
    for n in range(2):
        p = f"{lm}.layers.{n}"
        s.norm(f"{p}.input_layernorm", H)
        s.norm(f"{p}.post_attention_layernorm", H)
        _attn(s, f"{p}.self_attn", s.bf16, norms=False)
        for kv in ("k", "v"):  # llm-compressor's FP8 KV-cache scales
            s.put(f"{p}.self_attn.{kv}_scale", torch.tensor([0.04 + 0.01 * n], dtype=torch.float32))
        if n == 0:
            _mlp3(s, f"{p}.feed_forward", DENSE_I, fp4)
            continue
        s.bf16(f"{p}.feed_forward.router", EXPERTS, H)
        _mlp3(s, f"{p}.feed_forward.shared_expert", MOE_I, fp4)
        _experts(s, f"{p}.feed_forward.experts", fp4)
    v, vh = "vision_model", 64
    before = set(s.modules)
    s.bf16(f"{v}.patch_embedding.linear", vh, 48)
    s.raw(f"{v}.class_embedding", (vh,))
    s.raw(f"{v}.positional_embedding_vlm", (17, vh))
    for ln in ("layernorm_pre", "layernorm_post"):
        s.norm(f"{v}.{ln}", vh)
        s.raw(f"{v}.{ln}.bias", (vh,))
    b = f"{v}.model.layers.0"
    for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
        s.bf16(f"{b}.self_attn.{m}", vh, vh, bias=True)
    for ln in ("input_layernorm", "post_attention_layernorm"):
        s.norm(f"{b}.{ln}", vh)
        s.raw(f"{b}.{ln}.bias", (vh,))
    s.bf16(f"{b}.mlp.fc1", 2 * vh, vh, bias=True)
    s.bf16(f"{b}.mlp.fc2", vh, 2 * vh, bias=True)
    s.bf16(f"{v}.vision_adapter.mlp.fc1", H, 4 * vh)
    s.bf16(f"{v}.vision_adapter.mlp.fc2", H, H)
    s.bf16("multi_modal_projector.linear_1", H, H)
    vision_exact = sorted(set(s.modules) - before)
    text = {"model_type": "llama4_text", "hidden_size": H, "intermediate_size": MOE_I, "intermediate_size_mlp": DENSE_I,
            "num_local_experts": EXPERTS, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HEAD_DIM,
            "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 512,
            "no_rope_layers": [1, 1], "attention_chunk_size": 8192, "use_qk_norm": True, "hidden_act": "silu",
            "torch_dtype": "bfloat16"}
    vision = {"model_type": "llama4_vision_model", "hidden_size": vh, "intermediate_size": 2 * vh,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 16, "patch_size": 4,
              "num_channels": 3, "vision_output_dim": H, "projector_input_dim": H, "projector_output_dim": H,
              "pixel_shuffle_ratio": 0.5}
    ignore = ["re:.*lm_head", "re:.*self_attn", "re:.*router", *vision_exact]
    cfg = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
           "vision_config": vision, "tie_word_embeddings": False, "image_token_index": 200,
           "quantization_config": ct_config({"group_0": ct_group("nvfp4", ["Linear"], w4a4=True)}, ignore,
                                            fmt="nvfp4-pack-quantized", kv_cache_scheme=KV_FP8)}
    _finish(root, s, cfg, shards=3)
    return Replica(path=root, family="ct-nvfp4-llama4", layout="ct-nvfp4", scheme="w4a4", modules=dict(s.modules),
                   runtime_names=_runtime({**QKV, **GATE_UP}, {}), kv_cache="fp8", expected_targets=ALL_CONVERT,
                   fused=FUSED_QKV_GU, attention_layers=[f"{lm}.layers.{n}.self_attn.attn" for n in range(2)])


def glm45(root: Path) -> Replica:
    """GLM-4.5(-Air) NVFP4A16: layer 0 a dense NVFP4 MLP, layer 1 MoE with ``mlp.gate`` +
    ``e_score_correction_bias``, shared experts; attention (q/k/v with bias) BF16; layer 2 its MTP block
    (``num_nextn_predict_layers`` 1): a MoE layer with ``eh_proj`` [H, 2H], ``enorm``, ``hnorm`` and
    ``shared_head.norm`` BF16 beside it."""
    root.mkdir(parents=True)
    s = Sink(73)

    def fp4(name: str, n: int, k: int) -> None:
        s.nvfp4_ct(name, n, k, w4a4=False)

    s.embedding("model.embed_tokens", VOCAB, H)
    s.norm("model.norm", H)
    s.bf16("lm_head", VOCAB, H)
    for n in range(3):
        p = f"model.layers.{n}"
        s.norm(f"{p}.input_layernorm", H)
        s.norm(f"{p}.post_attention_layernorm", H)
        if n == 2:
            s.bf16(f"{p}.eh_proj", H, 2 * H)
            for ln in ("enorm", "hnorm", "shared_head.norm"):
                s.norm(f"{p}.{ln}", H)
        a = f"{p}.self_attn"
        s.bf16(f"{a}.q_proj", 2 * HEAD_DIM, H, bias=True)
        s.bf16(f"{a}.k_proj", HEAD_DIM, H, bias=True)
        s.bf16(f"{a}.v_proj", HEAD_DIM, H, bias=True)
        s.bf16(f"{a}.o_proj", H, 2 * HEAD_DIM)
        if n == 0:
            _mlp3(s, f"{p}.mlp", DENSE_I, fp4)
            continue
        s.bf16(f"{p}.mlp.gate", EXPERTS, H)
        s.put(f"{p}.mlp.gate.e_score_correction_bias", torch.randn(EXPERTS, generator=s.gen).float())
        _experts(s, f"{p}.mlp.experts", fp4)
        _mlp3(s, f"{p}.mlp.shared_experts", MOE_I, fp4)
    cfg = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": H,
           "intermediate_size": DENSE_I, "moe_intermediate_size": MOE_I, "n_routed_experts": EXPERTS,
           "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HEAD_DIM, "attention_bias": True,
           "use_qk_norm": False, "partial_rotary_factor": 0.5, "topk_method": "noaux_tc", "n_group": 1,
           "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 1,
           "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 512,
           "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "quantization_config": ct_config({"group_0": ct_group("nvfp4", ["Linear"], w4a4=False)},
                                            ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$", "re:.*eh_proj$"],
                                            fmt="nvfp4-pack-quantized")}
    _finish(root, s, cfg)
    return Replica(path=root, family="ct-nvfp4-glm45", layout="ct-nvfp4", scheme="w4a16", modules=dict(s.modules),
                   runtime_names=_runtime({**QKV, **GATE_UP}, {}), kv_cache=None, expected_targets=ALL_CONVERT,
                   fused=FUSED_QKV_GU)


def autoround_mxfp4(root: Path) -> Replica:
    """AutoRound ``auto_round:llm_compressor`` MXFP4 (W4A16, ``act_bits: 16``) of a Qwen3-MoE:
    attention and experts MXFP4 as ``weight_packed`` / ``weight_scale`` U8; the router kept at 16
    bits through ``extra_config``; lm_head outside the quantized blocks."""
    root.mkdir(parents=True)
    s = Sink(79)
    s.embedding("model.embed_tokens", VOCAB, H)
    s.norm("model.norm", H)
    s.bf16("lm_head", VOCAB, H)
    extra: dict[str, dict[str, Any]] = {}
    for n in range(2):
        p = f"model.layers.{n}"
        s.norm(f"{p}.input_layernorm", H)
        s.norm(f"{p}.post_attention_layernorm", H)
        _attn(s, f"{p}.self_attn", s.mxfp4_ct)
        s.bf16(f"{p}.mlp.gate", EXPERTS, H)
        extra[f"{p}.mlp.gate"] = {"bits": 16, "data_type": "float"}
        _experts(s, f"{p}.mlp.experts", s.mxfp4_ct)
    cfg = {**_qwen3_moe_config(),
           "quantization_config": {
               "quant_method": "auto-round", "packing_format": "auto_round:llm_compressor", "data_type": "mx_fp",
               "bits": 4, "group_size": 32, "sym": True, "act_bits": 16, "act_data_type": "float",
               "act_group_size": 32, "act_sym": True, "act_dynamic": True, "iters": 0,
               "block_name_to_quantize": "model.layers", "autoround_version": "0.9.0", "extra_config": extra}}
    _finish(root, s, cfg)
    return Replica(path=root, family="autoround-mxfp4-qwen3-moe", layout="ct-mxfp4", scheme="w4a16",
                   modules=dict(s.modules), runtime_names=_runtime(QKV, {}), kv_cache=None,
                   expected_targets=ALL_CONVERT, fused={"qkv_proj": ["q_proj", "k_proj", "v_proj"]})


def _qwen3_moe_config() -> dict[str, Any]:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
            "intermediate_size": DENSE_I, "moe_intermediate_size": MOE_I, "num_experts": EXPERTS,
            "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": HEAD_DIM, "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
            "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def modelopt_nvfp4_qwen3(root: Path) -> Replica:
    """ModelOpt NVFP4 (W4A4) Qwen3-MoE as NVIDIA's Qwen3 FP4 releases: every Linear but the routers
    and lm_head NVFP4 (attention included), FP8 KV cache with ``self_attn.{k,v}_proj.{k,v}_scale``
    beside the FP4 k_proj / v_proj tensors; config.json's quantization_config and hf_quant_config.json."""
    root.mkdir(parents=True)
    s = Sink(83)

    def fp4(name: str, n: int, k: int) -> None:
        s.nvfp4_modelopt(name, n, k)

    s.embedding("model.embed_tokens", VOCAB, H)
    s.norm("model.norm", H)
    s.bf16("lm_head", VOCAB, H)
    for n in range(2):
        p = f"model.layers.{n}"
        s.norm(f"{p}.input_layernorm", H)
        s.norm(f"{p}.post_attention_layernorm", H)
        _attn(s, f"{p}.self_attn", fp4)
        for kv in ("k", "v"):
            s.put(f"{p}.self_attn.{kv}_proj.{kv}_scale", torch.tensor(0.03 + 0.01 * n, dtype=torch.float32))
        s.bf16(f"{p}.mlp.gate", EXPERTS, H)
        _experts(s, f"{p}.mlp.experts", fp4)
    exclude = ["lm_head", "model.layers.*.mlp.gate"]
    producer = {"name": "modelopt", "version": "0.37.0"}
    four = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    cfg = {**_qwen3_moe_config(), "quantization_config": {
        "config_groups": {"group_0": {"input_activations": four, "weights": four, "targets": ["Linear"]}},
        "ignore": exclude, "quant_algo": "NVFP4", "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
        "producer": producer, "quant_method": "modelopt"}}
    write_json(root / "hf_quant_config.json", {"producer": producer, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": exclude}})
    _finish(root, s, cfg)
    return Replica(path=root, family="modelopt-nvfp4-qwen3-moe", layout="modelopt-nvfp4", scheme="w4a4",
                   modules=dict(s.modules), runtime_names=_runtime(QKV, {}), kv_cache="fp8",
                   expected_targets=ALL_CONVERT, fused={"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
                   attention_layers=[f"model.layers.{n}.self_attn.attn" for n in range(2)])


MINIMAX_EXCLUDE = ["lm_head", "model.layers.0.block_sparse_moe.gate", "model.layers.0.self_attn*",
                   "model.layers.1.block_sparse_moe.gate", "model.layers.1.self_attn*"]


def modelopt_nvfp4_minimax_m2(root: Path) -> Replica:
    """MiniMax-M2.x ModelOpt NVFP4 "experts only" with an FP8 KV cache (nvidia/MiniMax-M2.5-NVFP4's recipe).

    Sources: the Hugging Face model card of demon-zombie/MiniMax-M2.7-NVFP4 ("nvfp4_experts_only-fp8_kv
    recipe - the same recipe structure as nvidia/MiniMax-M2.5-NVFP4": only the expert w1/w2/w3 NVFP4
    W4A4 group 16; attention, router, embeddings, lm_head BF16; FP8 E4M3 KV cache with per-layer
    ``k_proj.k_scale`` / ``v_proj.v_scale`` tensors; ``exclude_modules`` in hf_quant_config.json);
    on-disk names from transformers ``models/minimax_m2`` and ``conversion_mapping.py`` (``minimax_m2``
    uses Mixtral's mapping: ``block_sparse_moe.experts.E.w{1,2,3}``, router ``block_sparse_moe.gate``,
    plus ``block_sparse_moe.e_score_correction_bias``; ``q_norm`` / ``k_norm`` over all heads); the
    exclusions are what NVIDIA/Model-Optimizer ``modelopt/torch/export/quant_utils.py``
    ``_prefix_wildcard_summarize_exclude_modules`` makes of these modules (``model.layers.N.self_attn*``,
    the routers by name, ``lm_head``). vLLM ``vllm/model_executor/models/minimax_m2.py``: ``qkv_proj``
    fused, experts one FusedMoE, ``self_attn.attn`` an ``Attention`` (the FP8 KV cache applies)."""
    root.mkdir(parents=True)
    s = Sink(89)
    s.embedding("model.embed_tokens", VOCAB, H)
    s.norm("model.norm", H)
    s.bf16("lm_head", VOCAB, H)
    for n in range(2):
        p = f"model.layers.{n}"
        s.norm(f"{p}.input_layernorm", H)
        s.norm(f"{p}.post_attention_layernorm", H)
        _attn(s, f"{p}.self_attn", s.bf16, norms=False)
        s.norm(f"{p}.self_attn.q_norm", 2 * HEAD_DIM)
        s.norm(f"{p}.self_attn.k_norm", HEAD_DIM)
        for kv in ("k", "v"):
            s.put(f"{p}.self_attn.{kv}_proj.{kv}_scale", torch.tensor(0.03 + 0.01 * n, dtype=torch.float32))
        s.bf16(f"{p}.block_sparse_moe.gate", EXPERTS, H)
        s.put(f"{p}.block_sparse_moe.e_score_correction_bias", torch.randn(EXPERTS, generator=s.gen).float())
        for e in range(EXPERTS):
            for w, (rows, cols) in {"w1": (MOE_I, H), "w3": (MOE_I, H), "w2": (H, MOE_I)}.items():
                s.nvfp4_modelopt(f"{p}.block_sparse_moe.experts.{e}.{w}", rows, cols)
    cfg = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "hidden_size": H,
           "intermediate_size": MOE_I, "num_local_experts": EXPERTS, "num_experts_per_tok": 2,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HEAD_DIM,
           "rotary_dim": HEAD_DIM // 2, "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
           "use_routing_bias": True, "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0,
           "max_position_embeddings": 512, "hidden_act": "silu", "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
    write_json(root / "hf_quant_config.json", {"producer": {"name": "modelopt", "version": "0.41.0"}, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": MINIMAX_EXCLUDE}})
    _finish(root, s, cfg, shards=3)
    return Replica(path=root, family="modelopt-nvfp4-minimax-m2", layout="modelopt-nvfp4", scheme="w4a4",
                   modules=dict(s.modules), runtime_names=_runtime(QKV, {}), kv_cache="fp8",
                   expected_targets=ALL_CONVERT, fused={"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
                   expert_projs=("w1", "w3", "w2"),
                   attention_layers=[f"model.layers.{n}.self_attn.attn" for n in range(2)])
