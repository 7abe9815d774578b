"""Checkpoint builders shared by the tests.

``tiny`` is examples/tiny.py (the builders ``make demo`` runs as a script), loaded once by path; it is
also registered as the module ``tiny`` so every importer shares one module object. The functions below
write the small checkpoints tiny.py does not: AMD Quark MXFP4 / NVFP4, DeepSeek-V4's native MXFP4,
AutoRound's llm-compressor MXFP4 export, and layers in FP8 (per-tensor, 128x128 blocks) beside the FP4
experts (facts: docs/FORMATS.md and the published checkpoints' names, dtypes and configs).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY_PATH = ROOT / "examples" / "tiny.py"


def _load_tiny() -> ModuleType:
    loaded = sys.modules.get("tiny")
    if loaded is not None and Path(str(getattr(loaded, "__file__", ""))).resolve() == TINY_PATH:
        return loaded
    spec = importlib.util.spec_from_file_location("tiny", TINY_PATH)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {TINY_PATH}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tiny"] = mod
    spec.loader.exec_module(mod)
    return mod


if TYPE_CHECKING:
    from examples import tiny
else:
    tiny = _load_tiny()

build = tiny.build
quant_mxfp4 = tiny.quant_mxfp4
quant_nvfp4 = tiny.quant_nvfp4
TINY_LAYOUTS: tuple[str, ...] = tiny.LAYOUTS

__all__ = [
    "TINY_LAYOUTS",
    "Tensors",
    "autoround_mxfp4",
    "build",
    "deepseek_v4",
    "moe_checkpoint",
    "quant_mxfp4",
    "quant_nvfp4",
    "quark_mxfp4",
    "quark_nvfp4",
    "save_checkpoint",
    "tiny",
]

QWEN3_NAMES = ("gate_proj", "up_proj", "down_proj")


class Tensors(dict[str, torch.Tensor]):
    """A checkpoint's tensors under construction, drawn from one seeded generator."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen) * 0.05

    def bf16(self, module: str, n: int, k: int) -> None:
        self[f"{module}.weight"] = self.randn(n, k).to(torch.bfloat16)

    def mxfp4(self, module: str, n: int, k: int, *, packed: str = "weight_packed", scale: str = "weight_scale",
              packed_dtype: torch.dtype = torch.uint8, scale_dtype: torch.dtype = torch.uint8) -> None:
        pk, sc = quant_mxfp4(self.randn(n, k))
        self[f"{module}.{packed}"] = pk.view(packed_dtype)
        self[f"{module}.{scale}"] = sc.view(scale_dtype)

    def nvfp4(self, module: str, n: int, k: int, *, packed: str, global_scale: str, divisor: bool,
              input_scale: str | None) -> None:
        pk, sc, ws2 = quant_nvfp4(self.randn(n, k))
        self[f"{module}.{packed}"] = pk
        self[f"{module}.weight_scale"] = sc
        self[f"{module}.{global_scale}"] = (1.0 / ws2).reshape(1) if divisor else ws2
        if input_scale:
            self[f"{module}.{input_scale}"] = torch.tensor(0.01, dtype=torch.float32)

    def fp8_tensor(self, module: str, n: int, k: int, *, input_scale: bool = True) -> None:
        self[f"{module}.weight"] = self.randn(n, k).to(torch.float8_e4m3fn)
        self[f"{module}.weight_scale"] = torch.tensor(0.002, dtype=torch.float32)
        if input_scale:
            self[f"{module}.input_scale"] = torch.tensor(0.01, dtype=torch.float32)

    def fp8_block(self, module: str, n: int, k: int, *, scale: str = "weight_scale_inv",
                  dtype: torch.dtype = torch.float32) -> None:
        """128x128 blocks: a [ceil(N/128), ceil(K/128)] scale (DeepSeek ``weight_scale_inv`` F32,
        compressed-tensors ``weight_scale`` BF16, DeepSeek-V4 ``scale`` F8_E8M0)."""
        self[f"{module}.weight"] = self.randn(n, k).to(torch.float8_e4m3fn)
        self[f"{module}.{scale}"] = torch.full((-(-n // 128), -(-k // 128)), 0.5).to(dtype)


def save_checkpoint(root: Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *, shards: int = 1,
                    hf_quant_config: Mapping[str, Any] | None = None) -> Path:
    """config.json (+ hf_quant_config.json) and the tensors, over ``shards`` files with an index."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if hf_quant_config is not None:
        (root / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2))
    tiny._save_sharded(root, dict(tensors), shards)
    return root


ExpertLinear = Callable[[Tensors, str, int, int], None]


def moe_checkpoint(root: Path, expert: ExpertLinear, quantization_config: Mapping[str, Any] | None, *,
                   layers: int = 2, experts: int = 4, hidden: int = 64, inter: int = 32, shards: int = 2,
                   names: tuple[str, str, str] = QWEN3_NAMES, seed: int = 0,
                   extra: Callable[[Tensors], None] | None = None,
                   hf_quant_config: Mapping[str, Any] | None = None) -> Path:
    """A Qwen3-MoE checkpoint (BF16 attention, router, embeddings) whose routed experts ``expert`` writes;
    ``extra`` adds or replaces tensors before saving."""
    cfg: dict[str, Any] = tiny.qwen3_config(layers, experts, hidden, inter)
    t = Tensors(seed)
    t.update(tiny._common(cfg, t.gen, False))
    for layer in range(layers):
        for e in range(experts):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            expert(t, f"{p}.{names[0]}", inter, hidden)
            expert(t, f"{p}.{names[1]}", inter, hidden)
            expert(t, f"{p}.{names[2]}", hidden, inter)
    if extra is not None:
        extra(t)
    if quantization_config is not None:
        cfg["quantization_config"] = dict(quantization_config)
    return save_checkpoint(root, cfg, t, shards=shards, hf_quant_config=hf_quant_config)


def _quark_fp4(group: int, *, dynamic: bool = False) -> dict[str, Any]:
    return {"dtype": "fp4", "qscheme": "per_group", "group_size": group, "ch_axis": -1, "is_dynamic": dynamic,
            "scale_format": "e8m0" if group == 32 else None, "scale_type": "float", "symmetric": None,
            "round_method": "half_even", "observer_cls": "PerBlockMXObserver", "mx_element_dtype": None}


def quark_config(group: int, *, w4a4: bool, exclude: list[str],
                 layer_quant_config: Mapping[str, Any] | None = None,
                 kv_cache_group: list[str] | None = None) -> dict[str, Any]:
    """An AMD Quark ``quantization_config``: global fp4 per_group weights (+ fp4 inputs for W4A4)."""
    weight: Any = _quark_fp4(group)
    acts: Any = _quark_fp4(group, dynamic=True) if w4a4 else None
    if group == 16:  # NVFP4: two-level specs, fp4 codes then the fp8 block scale
        fp8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}
        weight = [weight, fp8]
        acts = [acts, fp8] if acts else None
    return {"quant_method": "quark", "version": "0.10",
            "global_quant_config": {"weight": weight, "input_tensors": acts, "output_tensors": None, "bias": None},
            "layer_quant_config": dict(layer_quant_config or {}), "layer_type_quant_config": {}, "exclude": exclude,
            "export": {"weight_format": "real_quantized", "pack_method": "reorder",
                       "kv_cache_group": kv_cache_group or []}}


QUARK_EXCLUDE = ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]


def quark_mxfp4(root: Path, *, w4a4: bool = False, exclude: list[str] | None = None,
                layer_quant_config: Mapping[str, Any] | None = None, kv_cache_group: list[str] | None = None,
                extra: Callable[[Tensors], None] | None = None, **kw: Any) -> Path:
    """AMD Quark MXFP4: ``weight`` U8 [N, K/2] + ``weight_scale`` U8 (E8M0) [N, K/32] per expert."""

    def expert(t: Tensors, module: str, n: int, k: int) -> None:
        t.mxfp4(module, n, k, packed="weight")

    q = quark_config(32, w4a4=w4a4, exclude=QUARK_EXCLUDE if exclude is None else exclude,
                     layer_quant_config=layer_quant_config, kv_cache_group=kv_cache_group)
    return moe_checkpoint(root, expert, q, extra=extra, **kw)


def quark_nvfp4(root: Path, *, config: bool = True, **kw: Any) -> Path:
    """AMD Quark NVFP4: ``weight`` U8, ``weight_scale`` F8_E4M3 [N, K/16], ``weight_scale_2`` (a multiplier)
    and ``input_scale_2`` scalars; ``config=False`` drops the quantization config."""

    def expert(t: Tensors, module: str, n: int, k: int) -> None:
        t.nvfp4(module, n, k, packed="weight", global_scale="weight_scale_2", divisor=False,
                input_scale="input_scale_2")

    q = quark_config(16, w4a4=True, exclude=QUARK_EXCLUDE) if config else None
    return moe_checkpoint(root, expert, q, **kw)


def autoround_mxfp4(root: Path, *, act_bits: int = 16, extra_config: Mapping[str, Any] | None = None,
                    **kw: Any) -> Path:
    """AutoRound's ``auto_round:llm_compressor`` MXFP4 export: compressed-tensors MXFP4 tensors under an
    ``auto-round`` config (``data_type: mx_fp``, bits 4, group_size 32, ``act_bits``)."""
    out = build("ct-mxfp4", root, **kw)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "auto-round", "packing_format": "auto_round:llm_compressor",
                                  "data_type": "mx_fp", "bits": 4, "group_size": 32, "sym": True,
                                  "act_bits": act_bits, "act_data_type": "mx_fp" if act_bits <= 8 else "float",
                                  "extra_config": dict(extra_config or {}), "autoround_version": "0.8.0"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out


V4 = {"hidden": 128, "inter": 64, "experts": 4, "layers": 2, "heads": 2, "head_dim": 64, "q_lora": 64}


def deepseek_v4(root: Path, *, config: bool = True, weight_scale_2: bool = False, nvfp4: bool = False,
                mtp: bool = False, shards: int = 2) -> Path:
    """DeepSeek-V4 native: experts ``layers.N.ffn.experts.E.w{1,2,3}.weight`` packed E2M1 as I8 [N, K/2] +
    ``.scale`` F8_E8M0 [N, K/32]; attention and shared experts FP8 with E8M0 128x128 ``.scale`` blocks;
    config.json ``quant_method: fp8``. ``weight_scale_2`` adds one NVFP4-style global scale; ``nvfp4``: the
    routed experts of ``layers.N`` in ModelOpt NVFP4 (NVIDIA's release, ``moe_quant_algo: NVFP4``);
    ``mtp``: an MTP layer ``mtp.0`` whose experts stay native MXFP4 (as in NVIDIA's release too)."""
    h, i, ne = V4["hidden"], V4["inter"], V4["experts"]
    e8m0 = torch.float8_e8m0fnu
    t = Tensors(1)
    t["embed.weight"] = t.randn(256, h).to(torch.bfloat16)
    t["norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    t.bf16("head", 256, h)
    blocks = [f"layers.{n}" for n in range(V4["layers"])] + (["mtp.0"] if mtp else [])
    for p in blocks:
        t[f"{p}.attn_norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t.fp8_block(f"{p}.attn.wq_a", V4["q_lora"], h, scale="scale", dtype=e8m0)
        t.fp8_block(f"{p}.attn.wo_b", h, V4["heads"] * V4["head_dim"], scale="scale", dtype=e8m0)
        t.bf16(f"{p}.ffn.gate", ne, h)
        for e in range(ne):
            for w, (rows, cols) in {"w1": (i, h), "w3": (i, h), "w2": (h, i)}.items():
                if nvfp4 and not p.startswith("mtp."):
                    t.nvfp4(f"{p}.ffn.experts.{e}.{w}", rows, cols, packed="weight", global_scale="weight_scale_2",
                            divisor=False, input_scale="input_scale")
                else:
                    t.mxfp4(f"{p}.ffn.experts.{e}.{w}", rows, cols, packed="weight", scale="scale",
                            packed_dtype=torch.int8, scale_dtype=e8m0)
        for w, (rows, cols) in {"w1": (i, h), "w3": (i, h), "w2": (h, i)}.items():
            t.fp8_block(f"{p}.ffn.shared_experts.{w}", rows, cols, scale="scale", dtype=e8m0)
    if weight_scale_2:
        t["layers.0.ffn.experts.0.w1.weight_scale_2"] = torch.tensor(1.0)
    cfg: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": h,
                           "moe_intermediate_size": i, "n_routed_experts": ne, "num_hidden_layers": V4["layers"],
                           "num_attention_heads": V4["heads"], "head_dim": V4["head_dim"], "vocab_size": 256,
                           "expert_dtype": "fp4"}
    if config:
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                      "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
                                      **({"moe_quant_algo": "NVFP4"} if nvfp4 else {})}
    return save_checkpoint(root, cfg, t, shards=shards)
