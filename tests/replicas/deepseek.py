"""DeepSeek-V3/R1-architecture replicas (also Kimi-K2 and DeepSeek-V3.2): MLA attention, dense
FP4 MLPs in the ``first_k_dense_replace`` layers, shared experts, a ``noaux_tc`` router and the
MTP layer ``model.layers.{num_hidden_layers}`` (BF16, a whole decoder block with BF16 experts).

KV-cache scales: ``model.layers.N.self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` (F32 scalars),
ModelOpt's naming, although MLA has no k_proj / v_proj module: vLLM 0.32's
``maybe_remap_kv_scale_name`` maps exactly ``.self_attn.{k,v}_proj.{k,v}_scale`` onto the MLA
layer's ``mla_attn.mla_attn.{k,v}_scale`` ("ModelOpt format"), and SGLang's
``maybe_remap_deepseek_mla_kv_scale`` accepts it (and ``kv_a_proj_with_mqa.{k,v}_scale``). They are
passthrough tensors: whatever the target, they must arrive byte-identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .common import Replica, Sink, ct_config, ct_group, write_json, write_side_files

H, Q_LORA, KV_LORA, HEADS, NOPE, ROPE, V_DIM = 128, 64, 64, 2, 32, 32, 32
DENSE_I, MOE_I, EXPERTS, VOCAB = 128, 64, 4, 256
LAYERS, FIRST_DENSE = 3, 1  # layers 0 (dense), 1-2 (MoE); layer 3 = MTP
MTP = LAYERS
ATTN = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
FUSED = {"gate_up_proj": ["gate_proj", "up_proj"], "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}
_FUSE_LEAF = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
              "q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj"}
_MTP_OWN = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


def config(variant: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
        "intermediate_size": DENSE_I, "moe_intermediate_size": MOE_I, "n_routed_experts": EXPERTS,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": FIRST_DENSE, "moe_layer_freq": 1,
        "num_hidden_layers": LAYERS, "num_nextn_predict_layers": 1, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE, "v_head_dim": V_DIM, "vocab_size": VOCAB, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0,
        "eos_token_id": 1, "attention_bias": False, "ep_size": 1,
    }
    if variant == "kimi_k2":
        cfg["model_type"] = "kimi_k2"
        cfg["routed_scaling_factor"] = 2.827
    elif variant == "deepseek_v32":
        cfg.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_topk=64,
                   index_n_heads=2, index_head_dim=64)
    return cfg


def runtime_names(name: str) -> list[str]:
    """vLLM's DeepseekV2/V3 module prefixes: fused ``fused_qkv_a_proj`` / ``gate_up_proj``, routed
    experts as one ``mlp.experts`` layer. The MTP layer's decoder block is built with prefix
    ``model.layers.L`` (deepseek_mtp.py passes the layer prefix to DeepseekV2DecoderLayer) while its
    weights load under ``model.layers.L.mtp_block.*``: both spellings must resolve. Its head is
    built as ``model.layers.L.head`` and loaded from ``shared_head.head``."""
    parts = name.split(".")
    leaf = parts[-1]
    if len(parts) > 2 and parts[-3] == "experts" and parts[-2].isdigit():
        base = ".".join(parts[:-2])
    elif leaf in _FUSE_LEAF and not name.endswith("indexer." + leaf):
        base = ".".join([*parts[:-1], _FUSE_LEAF[leaf]])
    else:
        base = name
    if not name.startswith(f"model.layers.{MTP}."):
        return [base]
    rest = base[len(f"model.layers.{MTP}."):]
    if rest == "shared_head.head":
        return [base, f"model.layers.{MTP}.head"]
    if rest.split(".")[0] in _MTP_OWN:
        return [base]
    return [base, f"model.layers.{MTP}.mtp_block.{rest}"]


def _layer(s: Sink, p: str, *, attn: str, mlp: str, dense: bool, experts: str, shared: str, indexer: bool,
           fmt: dict[str, Any]) -> None:
    s.norm(f"{p}.input_layernorm", H)
    s.norm(f"{p}.post_attention_layernorm", H)
    a = f"{p}.self_attn"
    shapes = {"q_a_proj": (Q_LORA, H), "q_b_proj": (HEADS * (NOPE + ROPE), Q_LORA),
              "kv_a_proj_with_mqa": (KV_LORA + ROPE, H), "kv_b_proj": (HEADS * (NOPE + V_DIM), KV_LORA),
              "o_proj": (H, HEADS * V_DIM)}
    for m, (n, k) in shapes.items():
        _linear(s, f"{a}.{m}", n, k, attn, fmt)
    s.norm(f"{a}.q_a_layernorm", Q_LORA)
    s.norm(f"{a}.kv_a_layernorm", KV_LORA)
    if indexer:  # DeepSeek-V3.2 lightning indexer: BF16 in every release
        s.bf16(f"{a}.indexer.wq_b", 2 * 64, Q_LORA)
        s.bf16(f"{a}.indexer.wk", 64, H)
        s.bf16(f"{a}.indexer.weights_proj", 2, H)
        s.norm(f"{a}.indexer.k_norm", 64)
        s.raw(f"{a}.indexer.k_norm.bias", (64,))
    if dense:
        for m, (n, k) in {"gate_proj": (DENSE_I, H), "up_proj": (DENSE_I, H), "down_proj": (H, DENSE_I)}.items():
            _linear(s, f"{p}.mlp.{m}", n, k, mlp, fmt)
        return
    s.bf16(f"{p}.mlp.gate", EXPERTS, H)
    s.put(f"{p}.mlp.gate.e_score_correction_bias", torch.randn(EXPERTS, generator=s.gen).float())
    proj = {"gate_proj": (MOE_I, H), "up_proj": (MOE_I, H), "down_proj": (H, MOE_I)}
    for e in range(EXPERTS):
        for m, (n, k) in proj.items():
            _linear(s, f"{p}.mlp.experts.{e}.{m}", n, k, experts, fmt)
    for m, (n, k) in proj.items():
        _linear(s, f"{p}.mlp.shared_experts.{m}", n, k, shared, fmt)


def _linear(s: Sink, name: str, n: int, k: int, prec: str, fmt: dict[str, Any]) -> None:
    if prec == "bf16":
        s.bf16(name, n, k)
    elif prec == "fp8-tensor":
        s.fp8_tensor(name, n, k)
    elif prec == "fp8-block":
        s.fp8_block(name, n, k, scale_name=fmt["block_scale"], scale_dtype=fmt["block_dtype"])
    elif fmt["fp4"] == "modelopt":
        s.nvfp4_modelopt(name, n, k)
    elif fmt["fp4"] == "ct-nvfp4":
        s.nvfp4_ct(name, n, k, w4a4=True, gscale_shape=())
    elif fmt["fp4"] == "quark-mxfp4":
        s.mxfp4_quark(name, n, k)
    elif fmt["fp4"] == "quark-nvfp4":
        s.nvfp4_quark(name, n, k)
    else:
        raise AssertionError(fmt)


def _model(s: Sink, *, attn: str, dense_mlp: str, shared: str, fmt: dict[str, Any], variant: str,
           kv_scales: bool) -> None:
    s.embedding("model.embed_tokens", VOCAB, H)
    s.norm("model.norm", H)
    s.bf16("lm_head", VOCAB, H)
    v32 = variant == "deepseek_v32"
    for n in range(LAYERS):
        p = f"model.layers.{n}"
        _layer(s, p, attn=attn, mlp=dense_mlp, dense=n < FIRST_DENSE, experts="fp4", shared=shared,
               indexer=v32, fmt=fmt)
        if kv_scales:
            for kv in ("k", "v"):
                s.put(f"{p}.self_attn.{kv}_proj.{kv}_scale", torch.tensor(0.05 + 0.01 * n, dtype=torch.float32))
    p = f"model.layers.{MTP}"  # MTP: BF16 throughout, experts included
    _layer(s, p, attn="bf16", mlp="bf16", dense=False, experts="bf16", shared="bf16", indexer=v32, fmt=fmt)
    s.embedding(f"{p}.embed_tokens", VOCAB, H)
    s.norm(f"{p}.enorm", H)
    s.norm(f"{p}.hnorm", H)
    s.bf16(f"{p}.eh_proj", H, 2 * H)
    s.norm(f"{p}.shared_head.norm", H)
    s.bf16(f"{p}.shared_head.head", VOCAB, H)


def _replica(root: Path, s: Sink, family: str, layout: str, scheme: str, kv: bool,
             targets: dict[str, str | None]) -> Replica:
    s.save(root, 3)
    write_side_files(root)
    return Replica(path=root, family=family, layout=layout, scheme=scheme, modules=dict(s.modules),
                   runtime_names=runtime_names, kv_cache="fp8" if kv else None, expected_targets=targets,
                   fused=FUSED,
                   attention_layers=[f"model.layers.{n}.self_attn.attn" for n in range(LAYERS)], mla=True,
                   renames={"ct": CT_RENAMES, "quark": CT_RENAMES, "marlin": CT_RENAMES})


CT_RENAMES = {"weight_scale_inv": "weight_scale"}  # FP8 block scales: the name compressed-tensors and Quark read
ALL_CONVERT: dict[str, str | None] = {"ct": None, "quark": None, "marlin": None}


def modelopt_nvfp4_r1(root: Path) -> Replica:
    """nvidia/DeepSeek-R1-FP4: hf_quant_config.json only, NVFP4 W4A4 experts / shared / dense MLPs,
    BF16 MLA attention excluded as ``model.layers.N.self_attn*``, MTP excluded as ``model.layers.L*``,
    FP8 KV cache."""
    root.mkdir(parents=True)
    s = Sink(seed=11)
    fmt = {"fp4": "modelopt"}
    _model(s, attn="bf16", dense_mlp="fp4", shared="fp4", fmt=fmt, variant="deepseek_v3", kv_scales=True)
    write_json(root / "config.json", config("deepseek_v3"))
    exclude = ["lm_head", *[f"model.layers.{n}.self_attn*" for n in range(LAYERS)], f"model.layers.{MTP}*"]
    write_json(root / "hf_quant_config.json", {
        "producer": {"name": "modelopt", "version": "0.23.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                         "exclude_modules": exclude}})
    return _replica(root, s, "modelopt-nvfp4-deepseek-r1", "modelopt-nvfp4", "w4a4", True, ALL_CONVERT)


MIXED_VARIANTS = {
    # variant: (attention, dense MLPs, KV cache FP8)
    "deepseek_v3": ("fp8-tensor", "fp4", True),
    "kimi_k2": ("fp8-block", "fp8-block", False),
    "deepseek_v32": ("fp8-tensor", "fp8-block", False),
}


def modelopt_mixed(root: Path, variant: str) -> Replica:
    """ModelOpt ``quant_algo: MIXED_PRECISION``: ``quantized_layers`` names every quantized module
    (NVFP4 group 16, FP8 per-tensor, FP8_PB_WO 128x128 blocks with ``weight_scale_inv`` F32); modules
    not listed are BF16; no exclude list. config.json carries the same quantization_config (vLLM
    prefers it over hf_quant_config.json)."""
    root.mkdir(parents=True)
    attn, dense, kv = MIXED_VARIANTS[variant]
    s = Sink(seed=23)
    fmt = {"fp4": "modelopt", "block_scale": "weight_scale_inv", "block_dtype": torch.float32}
    _model(s, attn=attn, dense_mlp=dense, shared="fp4", fmt=fmt, variant=variant, kv_scales=kv)
    algo = {"nvfp4": {"quant_algo": "NVFP4", "group_size": 16}, "fp8-tensor": {"quant_algo": "FP8"},
            "fp8-block": {"quant_algo": "FP8_PB_WO"}}
    layers = {m: algo[p] for m, p in sorted(s.modules.items()) if p != "bf16"}
    quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8" if kv else None, "quantized_layers": layers}
    producer = {"name": "modelopt", "version": "0.37.0"}
    write_json(root / "config.json", {**config(variant), "quantization_config": {
        **quant, "producer": producer, "quant_method": "modelopt"}})
    write_json(root / "hf_quant_config.json", {"producer": producer, "quantization": quant})
    return _replica(root, s, f"modelopt-mixed-{variant}", "modelopt-nvfp4", "w4a4", kv,
                    ALL_CONVERT)


def ct_mixed_nvfp4_fp8block(root: Path) -> Replica:
    """llm-compressor ``model_free_ptq`` of DeepSeek-R1 NVFP4: NVFP4 (converted from ModelOpt: 0-d
    global scales) + FP8_BLOCK attention (``weight_scale`` BF16 [N/128, K/128]), two config groups,
    ``format: mixed-precision``; q_a_proj / kv_a_proj_with_mqa, routers, lm_head and MTP ignored."""
    root.mkdir(parents=True)
    s = Sink(seed=31)
    fmt = {"fp4": "ct-nvfp4", "block_scale": "weight_scale", "block_dtype": torch.bfloat16}
    _model(s, attn="fp8-block", dense_mlp="fp4", shared="fp4", fmt=fmt, variant="deepseek_v3", kv_scales=False)
    for n in range(LAYERS):  # the latent projections stay BF16 in that recipe
        for m in ("q_a_proj", "kv_a_proj_with_mqa"):
            name = f"model.layers.{n}.self_attn.{m}"
            del s.tensors[f"{name}.weight"], s.tensors[f"{name}.weight_scale"]
            s.modules.pop(name)
            s.bf16(name, Q_LORA if m == "q_a_proj" else KV_LORA + ROPE, H)
    block: dict[str, Any] = {"actorder": None, "block_structure": [128, 128], "dynamic": False, "group_size": None, "num_bits": 8,
             "observer": "static_minmax", "observer_kwargs": {}, "scale_dtype": None, "strategy": "block",
             "symmetric": True, "type": "float", "zp_dtype": None}
    block_acts = {**block, "block_structure": None, "dynamic": True, "group_size": 128, "observer": None,
                  "strategy": "group"}
    groups = {
        "config_group_0": ct_group("nvfp4", [r"re:.*mlp\..*(gate|up|down)_proj$"], w4a4=True),
        "config_group_1": {"format": "float-quantized", "input_activations": block_acts, "output_activations": None,
                           "targets": [r"re:.*self_attn\.(q_b_proj|kv_b_proj|o_proj)$"], "weights": block},
    }
    ignore = ["lm_head", r"re:.*mlp\.gate$", r"re:.*self_attn\.(q_a_proj|kv_a_proj_with_mqa)$",
              rf"re:model\.layers\.{MTP}\..*"]
    write_json(root / "config.json", {**config("deepseek_v3"),
                                      "quantization_config": ct_config(groups, ignore, fmt="mixed-precision")})
    return _replica(root, s, "ct-mixed-nvfp4-fp8block-deepseek-r1", "ct-nvfp4", "w4a4", False, ALL_CONVERT)


def _quark_weight_mx() -> dict[str, Any]:
    return {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1, "scale_format": "e8m0",
            "scale_type": "float", "is_dynamic": False, "symmetric": None, "round_method": "half_even",
            "observer_cls": "PerBlockMXObserver", "scale_calculation_mode": "even", "mx_element_dtype": None}


def _quark_config(global_cfg: dict[str, Any], exclude: list[str]) -> dict[str, Any]:
    return {"quant_method": "quark", "version": "0.9", "global_quant_config": global_cfg, "layer_quant_config": {},
            "layer_type_quant_config": {}, "exclude": exclude,
            "export": {"weight_format": "real_quantized", "pack_method": "reorder", "kv_cache_group": [],
                       "min_kv_scale": 0.0, "weight_merge_groups": None},
            "algo_config": None, "quant_mode": "eager_mode"}


def quark_mxfp4_r1(root: Path) -> Replica:
    """amd/DeepSeek-R1-MXFP4-Preview: W4A4 MXFP4 (``weight`` / ``weight_scale`` uint8) experts,
    shared experts and dense MLPs; MLA attention and the MTP layer BF16, excluded with ``re:``
    patterns (vLLM matches Quark excludes exactly or as ``re:`` regexes, never as globs)."""
    root.mkdir(parents=True)
    s = Sink(seed=41)
    _model(s, attn="bf16", dense_mlp="fp4", shared="fp4", fmt={"fp4": "quark-mxfp4"}, variant="deepseek_v3",
           kv_scales=False)
    w = _quark_weight_mx()
    global_cfg = {"weight": w, "input_tensors": {**w, "is_dynamic": True}, "output_tensors": None, "bias": None,
                  "target_device": None}
    exclude = ["lm_head", r"re:model\.layers\.\d+\.self_attn\..*", r"re:.*mlp\.gate$", rf"re:model\.layers\.{MTP}\..*"]
    write_json(root / "config.json", {**config("deepseek_v3"), "quantization_config": _quark_config(global_cfg, exclude)})
    return _replica(root, s, "quark-mxfp4-deepseek-r1", "quark-mxfp4", "w4a4", False, ALL_CONVERT)


def quark_nvfp4_r1(root: Path) -> Replica:
    """AMD Quark NVFP4 (vLLM QuarkNVFP4): ``weight`` U8, ``weight_scale`` E4M3 [N, K/16],
    ``weight_scale_2`` / ``input_scale_2`` F32 scalars (multipliers); the config's weight and
    input_tensors are two-entry lists (fp4 per_group 16, then fp8_e4m3 per_tensor), W4A4 only.
    BF16 modules excluded by exact name, the MTP layer by a ``re:`` pattern."""
    root.mkdir(parents=True)
    s = Sink(seed=43)
    _model(s, attn="bf16", dense_mlp="fp4", shared="fp4", fmt={"fp4": "quark-nvfp4"}, variant="deepseek_v3",
           kv_scales=False)
    fp4 = {"dtype": "fp4", "qscheme": "per_group", "group_size": 16, "ch_axis": -1, "scale_format": "fp8_e4m3",
           "is_dynamic": False, "symmetric": None, "round_method": "half_even"}
    fp8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "ch_axis": None, "is_dynamic": False, "symmetric": True,
           "round_method": "half_even"}
    global_cfg = {"weight": [fp4, fp8], "input_tensors": [{**fp4, "is_dynamic": True}, fp8], "output_tensors": None,
                  "bias": None, "target_device": None}
    mtp = f"model.layers.{MTP}."
    exclude = ["lm_head", rf"re:model\.layers\.{MTP}\..*"] + [
        m for m in sorted(s.modules) if s.modules[m] == "bf16" and m != "lm_head" and not m.startswith(mtp)]
    write_json(root / "config.json", {**config("deepseek_v3"), "quantization_config": _quark_config(global_cfg, exclude)})
    return _replica(root, s, "quark-nvfp4-deepseek-r1", "quark-nvfp4", "w4a4", False, ALL_CONVERT)
