"""Builders of tiny FP4 MoE checkpoints in every input layout (the ones the tests and `make demo` use).

Each builder writes a real checkpoint folder: config.json (+ hf_quant_config.json for ModelOpt),
safetensors shards with an index (partner tensors deliberately split across shards), a tokenizer
stand-in. Weights come from a seeded Gaussian, quantized the way each producer does (MXFP4: EVEN
scale like compressed-tensors; NVFP4: ModelOpt's per-tensor amax/(6*448) and E4M3 block scales).

    python examples/tiny.py OUT_DIR [--layout ct-mxfp4|gpt-oss|modelopt-nvfp4|ct-nvfp4|all]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
LAYOUTS = ("ct-mxfp4", "gpt-oss", "modelopt-nvfp4", "ct-nvfp4")


def _codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (ties to the lower magnitude; good enough for fixtures)."""
    mag = torch.bucketize(x.abs().contiguous(), _MIDPOINTS).to(torch.uint8)
    return mag | ((x < 0).to(torch.uint8) << 3)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (packed uint8 [N, K/2], E8M0 uint8 [N, K/32]); EVEN scale rule."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1).clamp_min(2.0**-120)
    bits = amax.view(torch.int32)
    rounded = ((bits + 0x200000) & 0x7F800000).view(torch.float32)
    e = torch.floor(torch.log2(rounded)) - 2
    e = e.clamp(-127, 127)
    q = blocks / torch.exp2(e).unsqueeze(-1)
    return _pack(_codes(q.clamp(-6, 6)).reshape(w.shape)), (e + 127).to(torch.uint8)


def quant_nvfp4(w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (packed [N, K/2], e4m3 scales [N, K/16], weight_scale_2 float32 scalar), like ModelOpt.

    ``amax`` ties the second-level scale across modules (ModelOpt and llm-compressor tie gate and up).
    """
    w = w.float()
    ws2 = ((w.abs().amax() if amax is None else amax) / (6 * 448)).clamp_min(1e-12)
    blocks = w.reshape(*w.shape[:-1], -1, 16)
    scale = (blocks.abs().amax(-1) / (6 * ws2)).clamp(max=448).to(torch.float8_e4m3fn)
    s = scale.float().clamp_min(2.0**-9) * ws2
    q = blocks / s.unsqueeze(-1)
    return _pack(_codes(q.clamp(-6, 6)).reshape(w.shape)), scale, ws2.reshape(())


def qwen3_config(layers: int, experts: int, hidden: int, inter: int) -> dict[str, object]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
        "intermediate_size": inter * 2, "moe_intermediate_size": inter, "num_experts": experts,
        "num_experts_per_tok": 2, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": hidden // 4, "vocab_size": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    }


def gpt_oss_config(layers: int, experts: int, hidden: int, inter: int) -> dict[str, object]:
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": hidden,
        "intermediate_size": inter, "num_local_experts": experts, "num_experts_per_tok": 2, "experts_per_token": 2,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4,
        "vocab_size": 256, "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
        "swiglu_limit": 7.0, "rope_theta": 150000.0, "attention_bias": True, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "router_aux_loss_coef": 0.9, "output_router_logits": False,
        "initializer_range": 0.02, "pad_token_id": 0, "eos_token_id": 2,
    }


def _dense(shape: tuple[int, ...], gen: torch.Generator, std: float = 0.05) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)


def _common(cfg: dict[str, object], gen: torch.Generator, gpt_oss: bool) -> dict[str, torch.Tensor]:
    h, v, L = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["num_hidden_layers"])  # type: ignore[call-overload]
    hd, nh, nkv = int(cfg["head_dim"]), int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])  # type: ignore[call-overload]
    e = int(cfg.get("num_experts") or cfg.get("num_local_experts"))  # type: ignore[call-overload]
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _dense((v, h), gen), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                                  "lm_head.weight": _dense((v, h), gen)}
    for layer in range(L):
        p = f"model.layers.{layer}"
        t[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        for name, rows, cols in (("q_proj", nh * hd, h), ("k_proj", nkv * hd, h), ("v_proj", nkv * hd, h), ("o_proj", h, nh * hd)):
            t[f"{p}.self_attn.{name}.weight"] = _dense((rows, cols), gen)
            if gpt_oss:
                t[f"{p}.self_attn.{name}.bias"] = _dense((rows,), gen)
        if gpt_oss:
            t[f"{p}.self_attn.sinks"] = _dense((nh,), gen)
            t[f"{p}.mlp.router.weight"] = _dense((e, h), gen)
            t[f"{p}.mlp.router.bias"] = _dense((e,), gen)
        else:
            t[f"{p}.self_attn.q_norm.weight"] = torch.ones(hd, dtype=torch.bfloat16)
            t[f"{p}.self_attn.k_norm.weight"] = torch.ones(hd, dtype=torch.bfloat16)
            t[f"{p}.mlp.gate.weight"] = _dense((e, h), gen)
    return t


def _save_sharded(root: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """Round-robin over sorted names, so a weight and its scale usually land in different shards."""
    names = sorted(tensors)
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    for i, n in enumerate(names):
        groups[i % shards][n] = tensors[n].contiguous()
    if shards == 1:
        save_file(groups[0], str(root / "model.safetensors"), metadata={"format": "pt"})
        return
    wmap = {}
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(g, str(root / fname), metadata={"format": "pt"})
        wmap.update(dict.fromkeys(g, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": dict(sorted(wmap.items()))}, indent=2))


def _ct_qconfig(fmt: str, ignore: list[str]) -> dict[str, object]:
    mx = fmt.startswith("mxfp4")
    w = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32 if mx else 16, "num_bits": 4,
         "observer": "minmax" if mx else "static_minmax", "observer_kwargs": {},
         "scale_dtype": "torch.uint8" if mx else "torch.float8_e4m3fn", "strategy": "group" if mx else "tensor_group",
         "symmetric": True, "type": "float", "zp_dtype": None}
    return {"config_groups": {"group_0": {"format": fmt, "input_activations": None, "output_activations": None,
                                          "targets": ["Linear"], "weights": w}},
            "format": fmt, "global_compression_ratio": None, "ignore": ignore, "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
            "transform_config": {}, "version": "0.19.0"}


def build(layout: str, root: Path, *, layers: int = 2, experts: int = 4, hidden: int = 64, inter: int = 32,
          shards: int = 2, seed: int = 0, mixtral_names: bool = False) -> Path:
    """Write a tiny checkpoint of ``layout`` into ``root`` (created) and return it."""
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    gpt = layout == "gpt-oss"
    cfg = gpt_oss_config(layers, experts, hidden, inter) if gpt else qwen3_config(layers, experts, hidden, inter)
    t = _common(cfg, gen, gpt)
    names = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts"
        w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05
        w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.05
        if gpt:
            b13 = _dense((experts, 2 * inter), gen)
            pk, sc = quant_mxfp4(w13.reshape(-1, hidden))
            t[f"{p}.gate_up_proj_blocks"] = pk.reshape(experts, 2 * inter, hidden // 32, 16)
            t[f"{p}.gate_up_proj_scales"] = sc.reshape(experts, 2 * inter, hidden // 32)
            t[f"{p}.gate_up_proj_bias"] = b13
            pk, sc = quant_mxfp4(w2.reshape(-1, inter))
            t[f"{p}.down_proj_blocks"] = pk.reshape(experts, hidden, inter // 32, 16)
            t[f"{p}.down_proj_scales"] = sc.reshape(experts, hidden, inter // 32)
            t[f"{p}.down_proj_bias"] = _dense((experts, hidden), gen)
            continue
        for e in range(experts):
            for name, w in ((names[0], w13[e, :inter]), (names[1], w13[e, inter:]), (names[2], w2[e])):
                m = f"{p}.{e}.{name}"
                if layout == "ct-mxfp4":
                    t[f"{m}.weight_packed"], t[f"{m}.weight_scale"] = quant_mxfp4(w)
                else:
                    tied = w13[e].abs().amax() if name != names[2] else None  # gate and up share weight_scale_2
                    pk, sc, ws2 = quant_nvfp4(w, tied)
                    if layout == "modelopt-nvfp4":
                        t[f"{m}.weight"], t[f"{m}.weight_scale"], t[f"{m}.weight_scale_2"] = pk, sc, ws2
                        t[f"{m}.input_scale"] = torch.tensor(0.01 / 6 / 448, dtype=torch.float32)
                    else:
                        t[f"{m}.weight_packed"], t[f"{m}.weight_scale"] = pk, sc
                        t[f"{m}.weight_global_scale"] = (1.0 / ws2).reshape(1)
    if gpt:
        cfg["quantization_config"] = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
    elif layout == "ct-mxfp4":
        cfg["quantization_config"] = _ct_qconfig("mxfp4-pack-quantized", ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"])
    elif layout == "ct-nvfp4":
        cfg["quantization_config"] = _ct_qconfig("nvfp4-pack-quantized", ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"])
    else:
        excl = ["lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn*"]
        cfg["quantization_config"] = {
            "config_groups": {"group_0": {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                                          "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                                          "targets": ["Linear"]}},
            "ignore": excl, "quant_algo": "NVFP4", "producer": {"name": "modelopt", "version": "0.47.0"},
            "quant_method": "modelopt"}
        (root / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.47.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                             "exclude_modules": excl}}, indent=2))
    (root / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}, indent=2))
    _save_sharded(root, t, shards)
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layout", default="all", choices=[*LAYOUTS, "all"])
    ap.add_argument("--shards", type=int, default=2)
    args = ap.parse_args()
    for layout in LAYOUTS if args.layout == "all" else (args.layout,):
        print(build(layout, args.out / layout, shards=args.shards))


if __name__ == "__main__":
    main()
