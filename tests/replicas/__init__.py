"""Tiny replicas of the published FP4 MoE checkpoint families and a test-side resolver of what a
runtime builds from a converted config.

Each builder's docstring names the public sources of its structure (producer scripts and sources
on GitHub: NVIDIA/Model-Optimizer, vllm-project/llm-compressor, vllm-project/vllm, huggingface/
transformers; model cards on Hugging Face). One family is written by its real producer
(``granitemoe``: llm-compressor run in a subprocess)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from . import ct_families, deepseek, deepseek_v4, granitemoe, qwen35
from .common import Replica

__all__ = ["BUILDERS", "PURE_NVFP4", "Replica"]

BUILDERS: dict[str, Callable[[Path], Replica]] = {
    "modelopt-nvfp4-deepseek-r1": deepseek.modelopt_nvfp4_r1,
    "modelopt-mixed-deepseek_v3": partial(deepseek.modelopt_mixed, variant="deepseek_v3"),
    "modelopt-mixed-kimi_k2": partial(deepseek.modelopt_mixed, variant="kimi_k2"),
    "modelopt-mixed-deepseek_v32": partial(deepseek.modelopt_mixed, variant="deepseek_v32"),
    "modelopt-nvfp4-deepseek-v4": deepseek_v4.modelopt_nvfp4_v4,
    "modelopt-nvfp4-deepseek-v4-two-configs": deepseek_v4.modelopt_nvfp4_v4_two_configs,
    "deepseek-v4-native-mxfp4": deepseek_v4.native_mxfp4_v4,
    "ct-nvfp4-qwen3-next": ct_families.qwen3_next,
    "ct-nvfp4-qwen3-vl-moe": ct_families.qwen3_vl_moe,
    "ct-nvfp4-llama4": ct_families.llama4,
    "ct-nvfp4-glm45": ct_families.glm45,
    "ct-mixed-nvfp4-fp8block-deepseek-r1": deepseek.ct_mixed_nvfp4_fp8block,
    "quark-mxfp4-deepseek-r1": deepseek.quark_mxfp4_r1,
    "quark-nvfp4-deepseek-r1": deepseek.quark_nvfp4_r1,
    "autoround-mxfp4-qwen3-moe": ct_families.autoround_mxfp4,
    "modelopt-nvfp4-qwen3-moe": ct_families.modelopt_nvfp4_qwen3,
    "modelopt-nvfp4-minimax-m2": ct_families.modelopt_nvfp4_minimax_m2,
    "modelopt-nvfp4-qwen35-moe": qwen35.modelopt_nvfp4_qwen35,
    "llmcompressor-mxfp4-granitemoe": granitemoe.llmcompressor_mxfp4,
}

# The NVFP4 + BF16 compressed-tensors families the converter already handled before FP8 support.
PURE_NVFP4 = ("ct-nvfp4-qwen3-next", "ct-nvfp4-qwen3-vl-moe", "ct-nvfp4-glm45")
