"""Source checkpoints for the serving tests and their float32 references (project venv only).

Sizes suit vLLM's CPU build: head_dim 32 (its CPU attention supports 32..512, not the 16 of the
producer fixtures), hidden 128, expert intermediate 64 (multiples of 32 for MXFP4 blocks).

Qwen3-MoE and Mixtral: one set of seeded float weights per architecture, written four ways:
compressed-tensors MXFP4 W4A16 (``ct-mxfp4``), compressed-tensors NVFP4 W4A16 (``ct-nvfp4``), ModelOpt
NVFP4 with weights only (``modelopt-nvfp4``: ``weight_scale_2`` a multiplier, no ``input_scale``), and
kept in memory unquantized (the "bf16 original": the weights both quantized sources were made
from). Attention, router, embeddings and lm_head are BF16 in every source. Expert weights are
large enough (std 0.15 at H=128) that the MoE moves the logits: a wrong expert byte shows.

GPT-OSS: ``examples/tiny.py``'s native GPT-OSS MXFP4 builder at the same sizes.

References are float32 ``transformers`` forwards of third-party dequantizations
(tests/producers/producers_lib.py: compressed-tensors' own dequantizer for ct-mxfp4, its FP4 unpacker
in NUMERICS.md order for ct-nvfp4, transformers' ``Mxfp4Config(dequantize=True)`` for GPT-OSS).
Nothing here imports mxfp4conv.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.builders import build as tiny_build
from tests.builders import quant_mxfp4, quant_nvfp4, tiny
from tests.producers.producers_lib import exact_nvfp4_dequantize, hf_load, mx_quantize, reference_model

_ct_qconfig, _save_sharded = tiny._ct_qconfig, tiny._save_sharded

H, INTER, EXPERTS, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 128, 64, 4, 2, 4, 2, 32, 256
LLAMA4_LAYERS = 4  # its fourth layer is global attention without RoPE
LIN_K_HEADS, LIN_V_HEADS = 2, 4  # Qwen3.5's Gated DeltaNet: two value heads per key head, as in its releases
PROMPT_LEN = 24
# Router-logit gap (k-th vs (k+1)-th expert), relative to the RMS of that layer's router logits, under
# which bf16 compute may pick the other expert: bf16 keeps 8 significant bits (0.4%), and the hidden
# states reaching the router carry that error from every op before it.
ROUTING_TIE = 0.03
# the requantized case the forced AVX2 (loader-only) process also loads
FORCED_NVFP4 = "qwen3_moe-modelopt-nvfp4--quark"
IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*self_attn.*", "re:.*linear_attn.*",
          "re:.*shared_expert.*", "re:.*feed_forward.router$", "re:.*feed_forward.(gate|up|down)_proj$"]


def prompts() -> list[list[int]]:
    """Two fixed prompts (seeded), token 0 excluded."""
    g = torch.Generator().manual_seed(20261202)
    return [torch.randint(1, VOCAB, (PROMPT_LEN,), generator=g).tolist() for _ in range(2)]


def _config(arch: str) -> dict[str, object]:
    common: dict[str, object] = {
        "hidden_size": H, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "num_experts_per_tok": 2}
    if arch == "qwen3_moe":
        return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "intermediate_size": 2 * INTER, "moe_intermediate_size": INTER, "num_experts": EXPERTS,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    if arch == "mixtral":
        return {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": INTER, "num_local_experts": EXPERTS, "sliding_window": None}
    if arch == "qwen3_5_moe_text":  # one Gated DeltaNet layer, then one gated full-attention layer
        common.pop("rope_theta")
        return {**common, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
                "moe_intermediate_size": INTER, "shared_expert_intermediate_size": INTER, "num_experts": EXPERTS,
                "layer_types": ["linear_attention", "full_attention"], "full_attention_interval": 2,
                "linear_num_key_heads": LIN_K_HEADS, "linear_num_value_heads": LIN_V_HEADS,
                "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM, "linear_conv_kernel_dim": 4,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    if arch == "qwen3_next":  # Qwen3.5's text model with fused in_proj_qkvz / in_proj_ba and a plain RoPE
        q35 = _config("qwen3_5_moe_text")
        rope = q35.pop("rope_parameters")
        assert isinstance(rope, dict)
        return {**q35, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                "intermediate_size": 2 * INTER, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                "partial_rotary_factor": 0.25, "rope_theta": rope["rope_theta"]}
    if arch == "qwen3_vl_moe":  # Qwen3-MoE as the language model of a multimodal release (its vision tower not built)
        text = {k: v for k, v in _config("qwen3_moe").items() if k not in ("architectures", "rope_theta")}
        text.update(model_type="qwen3_vl_moe_text", rope_scaling={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True})
        vision = {"model_type": "qwen3_vl_moe", "depth": 1, "hidden_size": 64, "intermediate_size": 128,
                  "num_heads": 2, "out_hidden_size": H, "patch_size": 4, "temporal_patch_size": 2,
                  "spatial_merge_size": 2, "in_channels": 3, "num_position_embeddings": 16,
                  "deepstack_visual_indexes": [0]}
        return {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
                "text_config": text, "vision_config": vision, "tie_word_embeddings": False, "image_token_id": 250,
                "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253}
    if arch == "llama4_text":  # MoE every second layer, chunked attention with every fourth layer global and NoPE
        return {**common, "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
                "num_hidden_layers": LLAMA4_LAYERS, "intermediate_size": INTER, "intermediate_size_mlp": 2 * INTER,
                "num_local_experts": EXPERTS, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
                "no_rope_layers": [1, 1, 1, 0], "attention_chunk_size": 8192, "use_qk_norm": True,
                "floor_scale": 8192, "attn_scale": 0.1, "attn_temperature_tuning": True}
    if arch == "minimax_m2":  # sigmoid routing with a selection bias, Q/K norms over whole projections, partial RoPE
        return {**common, "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
                "intermediate_size": INTER, "num_local_experts": EXPERTS, "rotary_dim": HEAD_DIM // 2,
                "partial_rotary_factor": 0.5,  # as the releases' config.json: transformers reads this one
                "scoring_func": "sigmoid", "use_qk_norm": True, "qk_norm_type": "per_layer"}
    raise ValueError(arch)


@dataclass
class MoeSource:
    """The float weights of one architecture and the quantized checkpoints written from them."""

    arch: str
    original: dict[str, torch.Tensor]  # float32, per-expert names of the checkpoint (unquantized)
    paths: dict[str, Path]  # "ct-mxfp4" / "ct-nvfp4" / "modelopt-nvfp4" -> folder


def _expert_names(arch: str, layer: int, e: int) -> tuple[str, str, str, str]:
    if arch == "llama4_text":
        return f"model.layers.{layer}.feed_forward.experts.{e}", "gate_proj", "up_proj", "down_proj"
    if arch in ("mixtral", "minimax_m2"):
        p = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
        return p, "w1", "w3", "w2"
    return f"model.layers.{layer}.mlp.experts.{e}", "gate_proj", "up_proj", "down_proj"


def build_moe(arch: str, root: Path, seed: int) -> MoeSource:
    """Write ``root/<arch>-{ct-mxfp4,ct-nvfp4,modelopt-nvfp4}`` from one set of seeded weights (``qwen3_vl_moe``:
    Qwen3-MoE's under ``model.language_model.``, in the compressed-tensors layouts only)."""
    g = torch.Generator().manual_seed(seed)
    vl, arch = arch == "qwen3_vl_moe", "qwen3_moe" if arch == "qwen3_vl_moe" else arch

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16).float()

    dense: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(VOCAB, H, std=1.0),
                                      "model.norm.weight": torch.ones(H), "lm_head.weight": rnd(VOCAB, H, std=0.1)}
    experts: dict[str, torch.Tensor] = {}
    moe = {"mixtral": "block_sparse_moe", "minimax_m2": "block_sparse_moe", "llama4_text": "feed_forward"}.get(arch, "mlp")
    for layer in range(LLAMA4_LAYERS if arch == "llama4_text" else LAYERS):
        p = f"model.layers.{layer}"
        dense[f"{p}.input_layernorm.weight"] = torch.ones(H)
        dense[f"{p}.post_attention_layernorm.weight"] = torch.ones(H)
        if arch in ("qwen3_5_moe_text", "qwen3_next"):
            dense.update(_qwen35_layer(p, layer, rnd, fused=arch == "qwen3_next"))
        else:
            for name, rows, cols in (("q_proj", HEADS * HEAD_DIM, H), ("k_proj", KV_HEADS * HEAD_DIM, H),
                                     ("v_proj", KV_HEADS * HEAD_DIM, H), ("o_proj", H, HEADS * HEAD_DIM)):
                dense[f"{p}.self_attn.{name}.weight"] = rnd(rows, cols, std=0.08)
        if arch == "qwen3_moe":
            dense[f"{p}.self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
            dense[f"{p}.self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
        if arch == "minimax_m2":  # its norms span the whole Q / K projection; the bias only ranks experts
            dense[f"{p}.self_attn.q_norm.weight"] = 1.0 + rnd(HEADS * HEAD_DIM, std=0.1)
            dense[f"{p}.self_attn.k_norm.weight"] = 1.0 + rnd(KV_HEADS * HEAD_DIM, std=0.1)
            dense[f"{p}.{moe}.e_score_correction_bias"] = rnd(EXPERTS, std=0.5)
        if arch == "llama4_text" and layer % 2 == 0:  # a dense layer between MoE layers
            for name, rows, cols in (("gate_proj", 2 * INTER, H), ("up_proj", 2 * INTER, H), ("down_proj", H, 2 * INTER)):
                dense[f"{p}.feed_forward.{name}.weight"] = rnd(rows, cols, std=0.1)
            continue
        if arch == "llama4_text":  # a top-1 sigmoid router and a shared expert beside the routed ones
            dense[f"{p}.feed_forward.router.weight"] = rnd(EXPERTS, H, std=0.3)
            for name, rows, cols in (("gate_proj", INTER, H), ("up_proj", INTER, H), ("down_proj", H, INTER)):
                dense[f"{p}.feed_forward.shared_expert.{name}.weight"] = rnd(rows, cols, std=0.15)
        else:
            dense[f"{p}.{moe}.gate.weight"] = rnd(EXPERTS, H, std=0.3)
        for e in range(EXPERTS):
            m, gate, up, down = _expert_names(arch, layer, e)
            experts[f"{m}.{gate}.weight"] = rnd(INTER, H, std=0.15)
            experts[f"{m}.{up}.weight"] = rnd(INTER, H, std=0.15)
            experts[f"{m}.{down}.weight"] = rnd(H, INTER, std=0.15)
    if arch in ("qwen3_5_moe_text", "qwen3_next"):
        dense["model.norm.weight"] = rnd(H, std=0.1)
    cfg = _config("qwen3_vl_moe" if vl else arch)
    paths: dict[str, Path] = {}
    for layout in ("ct-mxfp4", "ct-nvfp4") if vl else ("ct-mxfp4", "ct-nvfp4", "modelopt-nvfp4"):
        out = root / f"{'qwen3_vl_moe' if vl else arch}-{layout}"
        out.mkdir(parents=True)
        t = {k: v if k.endswith((".A_log", ".e_score_correction_bias")) else v.to(torch.bfloat16) for k, v in dense.items()}
        for k, w in experts.items():
            m = k.removesuffix(".weight")
            if layout == "ct-mxfp4":
                t[f"{m}.weight_packed"], t[f"{m}.weight_scale"] = quant_mxfp4(w)
            elif layout == "modelopt-nvfp4":  # weight_scale_2 a multiplier; no input_scale: W4A16
                t[f"{m}.weight"], t[f"{m}.weight_scale"], t[f"{m}.weight_scale_2"] = quant_nvfp4(w, _tied(experts, m, w))
            else:
                pk, sc, ws2 = quant_nvfp4(w, _tied(experts, m, w))
                t[f"{m}.weight_packed"], t[f"{m}.weight_scale"] = pk, sc
                t[f"{m}.weight_global_scale"] = (1.0 / ws2).reshape(1).float()
        if layout == "modelopt-nvfp4":
            q = _modelopt_w4a16(out)
        else:
            q = _ct_qconfig("mxfp4-pack-quantized" if layout == "ct-mxfp4" else "nvfp4-pack-quantized", IGNORE)
        (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": q}, indent=2, sort_keys=True))
        (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
        _save_sharded(out, {_vl_name(k) if vl else k: v for k, v in t.items()}, 2)
        paths[layout] = out
    return MoeSource("qwen3_vl_moe" if vl else arch, {**dense, **experts}, paths)


def _vl_name(name: str) -> str:
    return f"model.language_model.{name[len('model.'):]}" if name.startswith("model.") else name


def _qwen35_layer(p: str, layer: int, rnd: Any, fused: bool) -> dict[str, torch.Tensor]:
    """One Qwen3.5-MoE (or Qwen3-Next: ``fused``) layer's tensors besides the routed experts: Gated DeltaNet
    (layer 0) or gated full attention (q_proj twice as wide: each head's query, then its gate), the shared
    expert and its gate. Its RMSNorms scale by (1 + weight): their weights are small offsets, which a
    converter must add 1 to. Qwen3-Next fuses the DeltaNet's input projections per key head:
    ``in_proj_qkvz`` (q, k, then the head's value heads' v and z) and ``in_proj_ba`` (their b, then a)."""
    t: dict[str, torch.Tensor] = {}
    if layer == 0:
        a, kd, vd = f"{p}.linear_attn", LIN_K_HEADS * HEAD_DIM, LIN_V_HEADS * HEAD_DIM
        if fused:
            t[f"{a}.in_proj_qkvz.weight"] = rnd(2 * kd + 2 * vd, H, std=0.08)
            t[f"{a}.in_proj_ba.weight"] = rnd(2 * LIN_V_HEADS, H, std=0.08)
        else:
            t[f"{a}.in_proj_qkv.weight"] = rnd(2 * kd + vd, H, std=0.08)
            t[f"{a}.in_proj_z.weight"] = rnd(vd, H, std=0.08)
            t[f"{a}.in_proj_b.weight"] = rnd(LIN_V_HEADS, H, std=0.08)
            t[f"{a}.in_proj_a.weight"] = rnd(LIN_V_HEADS, H, std=0.08)
        t[f"{a}.conv1d.weight"] = rnd(2 * kd + vd, 1, 4, std=0.3)
        t[f"{a}.A_log"] = torch.linspace(0.2, 2.5, LIN_V_HEADS)
        t[f"{a}.dt_bias"] = rnd(LIN_V_HEADS, std=0.5)
        t[f"{a}.norm.weight"] = 1.0 + rnd(HEAD_DIM, std=0.1)
        t[f"{a}.out_proj.weight"] = rnd(H, vd, std=0.08)
    else:
        for name, rows, cols in (("q_proj", 2 * HEADS * HEAD_DIM, H), ("k_proj", KV_HEADS * HEAD_DIM, H),
                                 ("v_proj", KV_HEADS * HEAD_DIM, H), ("o_proj", H, HEADS * HEAD_DIM)):
            t[f"{p}.self_attn.{name}.weight"] = rnd(rows, cols, std=0.08)
        t[f"{p}.self_attn.q_norm.weight"] = rnd(HEAD_DIM, std=0.1)
        t[f"{p}.self_attn.k_norm.weight"] = rnd(HEAD_DIM, std=0.1)
    for ln in ("input_layernorm", "post_attention_layernorm"):
        t[f"{p}.{ln}.weight"] = rnd(H, std=0.1)
    for name, rows, cols in (("gate_proj", INTER, H), ("up_proj", INTER, H), ("down_proj", H, INTER)):
        t[f"{p}.mlp.shared_expert.{name}.weight"] = rnd(rows, cols, std=0.1)
    t[f"{p}.mlp.shared_expert_gate.weight"] = rnd(1, H, std=0.1)
    return t


def _tied(experts: dict[str, torch.Tensor], m: str, w: torch.Tensor) -> torch.Tensor | None:
    """The amax of gate and up together for either of them (both producers tie their second-level
    scales), None for down."""
    base, proj = m.rsplit(".", 1)
    partner = {"gate_proj": "up_proj", "up_proj": "gate_proj", "w1": "w3", "w3": "w1"}.get(proj)
    return None if partner is None else torch.maximum(w.abs().amax(), experts[f"{base}.{partner}.weight"].abs().amax())


def _modelopt_w4a16(out: Path) -> dict[str, object]:
    """ModelOpt's NVFP4 config (config.json's and hf_quant_config.json), weights only: vLLM's CPU MXFP4
    MoE backend takes W4A16, and the conversion keeps a source's activation scheme."""
    excl = ["lm_head", "model.layers.*.mlp.gate", "model.layers.*.block_sparse_moe.gate", "model.layers.*.self_attn*",
            "model.layers.*.linear_attn*", "model.layers.*.mlp.shared_expert*", "model.layers.*.feed_forward.router",
            "model.layers.*.feed_forward.shared_expert*",
            *(f"model.layers.*.feed_forward.{p}_proj" for p in ("gate", "up", "down"))]
    producer = {"name": "modelopt", "version": "0.47.0"}
    (out / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": excl}}, indent=2))
    return {"config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                                          "targets": ["Linear"]}},
            "ignore": excl, "quant_algo": "NVFP4", "producer": producer, "quant_method": "modelopt"}


def build_gpt_oss(root: Path) -> Path:
    return tiny_build("gpt-oss", root / "gpt_oss-native", layers=LAYERS, experts=EXPERTS, hidden=H, inter=INTER,
                      shards=2, seed=3)


# ----------------------------------------------------------------------------- references
def log_probs(model: torch.nn.Module, prompt_list: list[list[int]]) -> torch.Tensor:
    """[prompts, positions, vocab] float64 log-softmax of the model's logits."""
    return forward(model, prompt_list)[0]


def forward(model: torch.nn.Module, prompt_list: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [prompts, positions, vocab] float64, routing gaps [prompts, positions]).

    The routing gap of a token is, over every MoE layer, the smallest difference between the router
    logits of its k-th and (k+1)-th expert (k = experts per token), divided by the RMS of that layer's
    router logits over all tokens: where it is tiny, the same weights
    computed in another precision may route the token to another expert (a near tie, not an error).
    """
    ids = torch.tensor(prompt_list)
    config: Any = model.config
    top_k = int(config.num_experts_per_tok)
    gaps: list[torch.Tensor] = []

    def hook(mod: torch.nn.Module, inp: tuple[torch.Tensor, ...], _out: object) -> None:
        x = inp[0].reshape(-1, inp[0].shape[-1]).double()
        bias = getattr(mod, "bias", None)
        weight: Any = mod.weight
        logits = torch.nn.functional.linear(x, weight.double(), None if bias is None else bias.double())
        top = logits.topk(top_k + 1, dim=-1).values
        rms = logits.pow(2).mean().sqrt()
        gaps.append(((top[:, top_k - 1] - top[:, top_k]) / rms).reshape(ids.shape))

    inner: Any = model.model
    handles = [getattr(layer.mlp, "router", None) or layer.mlp.gate for layer in inner.layers]
    hooks = [h.register_forward_hook(hook) for h in handles]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    return torch.log_softmax(logits.double(), dim=-1), torch.stack(gaps).amin(0)


def reference(kind: str, folder: Path, src: MoeSource | None = None) -> torch.nn.Module:
    """float32 transformers model of a source: ``ct-mxfp4``, ``ct-nvfp4``, ``gpt-oss`` or ``original``."""
    if kind == "ct-mxfp4":
        return reference_model(folder)
    if kind == "ct-nvfp4":
        return reference_model(folder, exact_nvfp4_dequantize(folder))
    if kind == "original":
        assert src is not None
        return reference_model(folder, dict(src.original))
    if kind == "gpt-oss":
        model, info = hf_load(folder, mxfp4_dequantize=True)
        assert not info, f"{folder}: transformers loading info {info}"
        return model
    raise ValueError(kind)


def top20_error(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor | None = None) -> float:
    """max |a - b| over ``a``'s 20 most likely tokens at every position (where ``keep`` [prompts,
    positions] is True, when given)."""
    idx = a.topk(20, dim=-1).indices
    d = (a.gather(-1, idx) - b.gather(-1, idx)).abs().amax(-1)
    return float(d[keep].max() if keep is not None else d.max())


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def copy_tensors(src: Path, dst: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Copy the checkpoint ``src`` to ``dst``; every tensor of the copy and the shard holding it."""
    from safetensors import safe_open

    shutil.copytree(src, dst)
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():  # noqa: SIM118
                tensors[k], where[k] = fh.get_tensor(k), f
    return tensors, where


def save_tensors(tensors: dict[str, torch.Tensor], where: dict[str, Path]) -> None:
    """Write ``tensors`` back into the shards ``where`` names (tensors absent from ``tensors`` are dropped)."""
    from safetensors.torch import save_file

    for f in sorted(set(where.values())):
        save_file({k: v for k, v in tensors.items() if where[k] == f}, str(f), metadata={"format": "pt"})


def quark_dense_to_bf16(src: Path, dst: Path) -> list[str]:
    """Copy of a Quark MXFP4 output whose dense (non-expert) MXFP4 Linears are dequantized to BF16 and
    excluded, and whose activations are left unquantized (W4A16): what vLLM's CPU build could run of
    it if dense MXFP4 Linears and MXFP4 activations were its only limits. Returns the modules changed."""
    import re

    tensors, where = copy_tensors(src, dst)
    changed = []
    for k in list(tensors):
        scale = tensors.get(k + "_scale")
        if (k.endswith(".weight") and tensors[k].dtype == torch.uint8 and scale is not None
                and scale.dtype == torch.uint8 and not re.search(r"\.experts\.\d+\.", k)):
            p = tensors[k]
            codes = torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1).long()
            w = _E2M1[codes] * torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)
            tensors[k] = w.to(torch.bfloat16)
            del tensors[k + "_scale"]
            changed.append(k.removesuffix(".weight"))
    save_tensors(tensors, where)
    index = dst / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if k in tensors}
        index.write_text(json.dumps(doc))
    cfg = json.loads((dst / "config.json").read_text())
    q = cfg["quantization_config"]
    q["exclude"] = [*q.get("exclude", []), *changed]
    q["global_quant_config"]["input_tensors"] = None
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return changed


def mean_top20_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The mean over positions of max |a - b| over ``a``'s 20 most likely tokens."""
    idx = a.topk(20, dim=-1).indices
    return float((a.gather(-1, idx) - b.gather(-1, idx)).abs().amax(-1).mean())


def requantized_reference(folder: Path) -> torch.nn.Module:
    """float32 model of a ct-nvfp4 source whose expert weights went through an independent model of
    NUMERICS.md's MXFP4 quantization (``mx_quantize(.., "mse")``, producers_lib), the default rule."""
    dense = exact_nvfp4_dequantize(folder)
    for k, v in dense.items():
        if ".experts." in k and k.endswith(".weight"):
            dense[k] = mx_quantize(v, "mse")[0].float()
    return reference_model(folder, dense)


@dataclass
class Served:
    """Everything the tests read: vLLM's results by case name, references, paths, timings."""

    root: Path
    results: dict[str, dict[str, Any]]
    forced: dict[str, dict[str, Any]] = field(default_factory=dict)  # the forced AVX2 (loader-only) process's results
    refs: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [prompts, positions, vocab] log-probs
    gaps: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> routing gaps [prompts, positions]
    bf16_error: dict[str, float] = field(default_factory=dict)  # source -> E(transformers bf16, float32)
    prompts: list[list[int]] = field(default_factory=list)
    convert_errors: dict[str, str] = field(default_factory=dict)
    references: dict[str, Path] = field(default_factory=dict)  # case -> the folder its loaded parameters must equal
    reference_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # source_reference.write_reference's
    seconds: dict[str, float] = field(default_factory=dict)
    stderr_tail: str = ""
