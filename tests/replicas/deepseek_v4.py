"""DeepSeek-V4 replicas in its native names (``layers.N.attn.*``, ``layers.N.ffn.experts.E.w{1,2,3}``,
``layers.N.ffn.shared_experts.*``, ``mtp.N.*``, ``embed``, ``head``).

Config keys are the ones vLLM 0.32's DeepSeek-V4 code reads: ``expert_dtype`` ("fp4") at the top
of config.json; ``quantization_config`` = the FP8 block config (``quant_method: fp8``,
``activation_scheme``, ``fmt``, ``scale_fmt: ue8m0``, ``weight_block_size: [128, 128]``), plus
``moe_quant_algo: NVFP4`` for NVIDIA's NVFP4 release (``DeepseekV4FP8Config`` then builds
``ModelOptNvFp4FusedMoE`` for the routed experts; without it they are ``Mxfp4MoEMethod``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .common import Replica, Sink, identity_names, write_json, write_side_files

H, Q_LORA, HEADS, HEAD_DIM, MOE_I, EXPERTS, VOCAB, LAYERS = 128, 64, 2, 64, 64, 4, 256, 2
# compressed-tensors has no FP8 scheme with E8M0 block scales; Quark's per_block with scale_type float8_e8m0fnu
# is one (vLLM QuarkW8A8Fp8PerBlock).
QUARK_ONLY: dict[str, str | None] = {"ct": "e8m0", "quark": None, "marlin": "e8m0"}
W13_AMAX = 0.3  # one amax for w1 and w3 of an expert (ModelOpt fuses their weight amax)


def _config(nvfp4: bool) -> dict[str, Any]:
    q: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
                         "weight_block_size": [128, 128]}
    if nvfp4:
        q["moe_quant_algo"] = "NVFP4"
    return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": H,
            "moe_intermediate_size": MOE_I, "n_routed_experts": EXPERTS, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "num_hidden_layers": LAYERS, "num_nextn_predict_layers": 1,
            "num_attention_heads": HEADS, "head_dim": HEAD_DIM, "q_lora_rank": Q_LORA, "vocab_size": VOCAB,
            "hc_mult": 2, "hc_sinkhorn_iters": 2, "hc_eps": 1e-6, "num_hash_layers": 0, "swiglu_limit": 10.0,
            "norm_topk_prob": True, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
            "routed_scaling_factor": 1.5, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
            "hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": False, "expert_dtype": "fp4",
            "quantization_config": q}


def _block(s: Sink, p: str, experts: str, *, tie_w13: bool = False) -> None:
    e8m0 = torch.float8_e8m0fnu
    s.norm(f"{p}.attn_norm", H)
    s.norm(f"{p}.ffn_norm", H)
    for m, (n, k) in {"wq_a": (Q_LORA, H), "wq_b": (HEADS * HEAD_DIM, Q_LORA), "wkv": (HEAD_DIM + 32, H),
                      "wo_a": (Q_LORA, HEADS * HEAD_DIM), "wo_b": (H, Q_LORA)}.items():
        s.fp8_block(f"{p}.attn.{m}", n, k, scale_name="scale", scale_dtype=e8m0)
    s.norm(f"{p}.attn.q_norm", Q_LORA)
    s.norm(f"{p}.attn.kv_norm", HEAD_DIM + 32)
    s.put(f"{p}.attn.attn_sink", torch.zeros(HEADS, dtype=torch.float32))
    for hc in ("attn", "ffn"):
        s.raw(f"{p}.hc_{hc}_fn", (6, 2 * H), torch.float32)
        s.raw(f"{p}.hc_{hc}_base", (6,), torch.float32)
        s.raw(f"{p}.hc_{hc}_scale", (3,), torch.float32)
    s.bf16(f"{p}.ffn.gate", EXPERTS, H)
    s.put(f"{p}.ffn.gate.bias", torch.randn(EXPERTS, generator=s.gen).float())
    shapes = {"w1": (MOE_I, H), "w3": (MOE_I, H), "w2": (H, MOE_I)}
    for e in range(EXPERTS):
        for m, (n, k) in shapes.items():
            name = f"{p}.ffn.experts.{e}.{m}"
            if experts == "nvfp4":
                # tie_w13: w1 and w3 share one weight_scale_2 (one amax), as quantize_to_nvfp4.py writes them
                s.nvfp4_modelopt(name, n, k, amax=W13_AMAX if tie_w13 and m != "w2" else None)
            else:
                s.mxfp4_v4(name, n, k)
    for m, (n, k) in shapes.items():
        s.fp8_block(f"{p}.ffn.shared_experts.{m}", n, k, scale_name="scale", scale_dtype=e8m0)


def _build(root: Path, *, nvfp4: bool, seed: int, tie_w13: bool = False) -> Sink:
    root.mkdir(parents=True)
    s = Sink(seed)
    s.embedding("embed", VOCAB, H)
    s.norm("norm", H)
    s.bf16("head", VOCAB, H)
    s.raw("hc_head_fn", (2, 2 * H), torch.float32)
    for n in range(LAYERS):
        _block(s, f"layers.{n}", "nvfp4" if nvfp4 else "mxfp4", tie_w13=tie_w13)
    _block(s, "mtp.0", "mxfp4")  # the MTP experts stay MXFP4 in NVIDIA's release too
    s.norm("mtp.0.enorm", H)
    s.norm("mtp.0.hnorm", H)
    s.bf16("mtp.0.e_proj", H, H)
    s.bf16("mtp.0.h_proj", H, H)
    s.norm("mtp.0.norm", H)
    write_json(root / "config.json", _config(nvfp4))
    s.save(root, 2)
    write_side_files(root)
    return s


def modelopt_nvfp4_v4(root: Path) -> Replica:
    """nvidia/DeepSeek-V4-Pro-NVFP4: NVFP4 W4A4 routed experts (ModelOpt tensors), FP8 E8M0-block
    attention and shared experts, MXFP4 MTP experts."""
    s = _build(root, nvfp4=True, seed=51)
    return Replica(path=root, family="modelopt-nvfp4-deepseek-v4", layout="modelopt-nvfp4", scheme="w4a4",
                   modules=dict(s.modules), runtime_names=identity_names, kv_cache=None, expected_targets=QUARK_ONLY,
                   expert_projs=("w1", "w3", "w2"), renames={"quark": {"scale": "weight_scale"}})


def native_mxfp4_v4(root: Path) -> Replica:
    """deepseek-ai/DeepSeek-V4-Flash: MXFP4 experts as I8 + F8_E8M0 ``.scale``, FP8 E8M0-block linears."""
    s = _build(root, nvfp4=False, seed=53)
    return Replica(path=root, family="deepseek-v4-native-mxfp4", layout="deepseek-v4-mxfp4", scheme="w4a16",
                   modules=dict(s.modules), runtime_names=identity_names, kv_cache=None, expected_targets=QUARK_ONLY,
                   expert_projs=("w1", "w3", "w2"), renames={"quark": {"scale": "weight_scale"}})


MODELOPT_V4_SCRIPT = ("NVIDIA/Model-Optimizer examples/deepseek/deepseek_v4/quantize_to_nvfp4.py "
                      "(commit a2fbac7bad8ab446d3f8783dadb0c3366eb0ad73)")
MODELOPT_V4_PRODUCER = {"name": "modelopt", "version": "dsv4-nvfp4-experts"}
MODELOPT_V4_EXCLUDE = ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]


def _modelopt_v4_quantization() -> dict[str, Any]:
    """``_build_moe_quantization`` of quantize_to_nvfp4.py: one ``quantized_layers`` entry per routed-experts
    CONTAINER (``layers.N.ffn.experts``, from ``_routed_experts_prefix``), not per expert projection."""
    layers = {f"layers.{n}.ffn.experts": {"quant_algo": "NVFP4", "group_size": 16} for n in range(LAYERS)}
    return {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "group_size": 16,
            "quantized_layers": layers, "exclude_modules": list(MODELOPT_V4_EXCLUDE)}


def modelopt_nvfp4_v4_two_configs(root: Path) -> Replica:
    """nvidia/DeepSeek-V4-Pro-NVFP4 as NVIDIA's public producer writes it: TWO configs.

    Source of every structural fact: NVIDIA/Model-Optimizer
    ``examples/deepseek/deepseek_v4/quantize_to_nvfp4.py`` (commit a2fbac7):

    * tensors (module docstring, ``convert_shard``): only routed experts of the main layers
      (``_EXPERT_WEIGHT_RE`` = ``layers.N.ffn.experts.E.w[123].weight``) become NVFP4: ``weight`` U8
      ``[N, K/2]``, ``weight_scale`` E4M3 ``[N, K/16]``, ``weight_scale_2`` F32 scalar, ``input_scale``
      F32 scalar; their source ``.scale`` is dropped; w1 and w3 share one weight amax
      (``_build_w13_weight_amax_overrides``, "fused GEMM1"); the MTP experts "remain in source
      format" (MXFP4); everything else is the source's bytes (attention and shared experts FP8 with
      F8_E8M0 128x128 ``.scale``, as in deepseek-ai/DeepSeek-V4-Flash);
    * ``hf_quant_config.json`` (``_build_hf_quant_config``): producer ``{"name": "modelopt",
      "version": "dsv4-nvfp4-experts"}``, ``quant_algo: MIXED_PRECISION``, ``kv_cache_quant_algo: null``,
      ``group_size: 16``, ``quantized_layers`` keyed by the experts container ``layers.N.ffn.experts``
      (``_routed_experts_prefix``) with ``{"quant_algo": "NVFP4", "group_size": 16}``, and
      ``exclude_modules: ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]`` (commented there
      "remain in the source FP8 format" / "unconverted" / "source format": not BF16);
    * ``config.json`` (``_rewrite_config_json``): ``quantization_config`` keeps ``quant_method: fp8``
      (the source's ``fmt``, ``scale_fmt: ue8m0``, ``weight_block_size: [128, 128]``, and
      ``activation_scheme: dynamic``) and adds ``moe_quant_algo: NVFP4``, ``producer``,
      ``quant_algo``, ``kv_cache_quant_algo``, ``group_size``, an NVFP4 ``config_groups`` entry
      (targets ``["Linear"]``), the same ``quantized_layers`` and the exclusions as ``ignore``.

    vLLM (``vllm/model_executor/models/deepseek_v4.py``, ``DeepseekV4FP8Config(Fp8Config)``) reads
    config.json's ``quant_method: fp8``: linears and attention FP8 block, routed experts
    ``ModelOptNvFp4FusedMoE`` when ``moe_quant_algo == "NVFP4"``, else ``Mxfp4MoEMethod``.
    """
    s = _build(root, nvfp4=True, seed=57, tie_w13=True)
    quant = _modelopt_v4_quantization()
    cfg = _config(nvfp4=True)
    q = cfg["quantization_config"]
    q.update(producer=dict(MODELOPT_V4_PRODUCER), quant_algo=quant["quant_algo"],
             kv_cache_quant_algo=quant["kv_cache_quant_algo"], group_size=quant["group_size"],
             config_groups={"group_0": {
                 "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                 "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                 "targets": ["Linear"]}},
             quantized_layers=dict(quant["quantized_layers"]), ignore=list(quant["exclude_modules"]))
    write_json(root / "config.json", cfg)
    write_json(root / "hf_quant_config.json", {"producer": dict(MODELOPT_V4_PRODUCER), "quantization": quant})
    return Replica(path=root, family="modelopt-nvfp4-deepseek-v4-two-configs", layout="modelopt-nvfp4",
                   scheme="w4a4", modules=dict(s.modules), runtime_names=identity_names, kv_cache=None,
                   expected_targets=QUARK_ONLY, expert_projs=("w1", "w3", "w2"),
                   renames={"quark": {"scale": "weight_scale"}})
