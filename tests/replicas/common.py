"""What every replica builder shares: the ``Replica`` record, a tensor sink that quantizes the way
each producer does and records every Linear-like module's precision, and the sharded writer.

Shapes are scaled down but kept where the format cares: FP4 K is a multiple of 32, FP8 block
scales are ``[ceil(N/128), ceil(K/128)]`` (some N/K deliberately not multiples of 128), expert
sizes pass Marlin's tile rules (H=128, I=64) so ``--to marlin`` can convert what ``--to ct`` does.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import save_file

TINY_PATH = Path(__file__).resolve().parents[2] / "examples" / "tiny.py"


def _tiny() -> ModuleType:
    """examples/tiny.py (the FP4 formulas the other builders use), one module object for every importer."""
    loaded = sys.modules.get("tiny")
    if loaded is not None and Path(str(getattr(loaded, "__file__", ""))).resolve() == TINY_PATH:
        return loaded
    spec = importlib.util.spec_from_file_location("tiny", TINY_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiny"] = module
    spec.loader.exec_module(module)
    return module


quant_mxfp4: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = _tiny().quant_mxfp4
quant_nvfp4: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = _tiny().quant_nvfp4

PRECISIONS = ("mxfp4", "nvfp4", "fp8-tensor", "fp8-block", "bf16")
ROUTED_EXPERT_RE = re.compile(r"\.experts\.\d+\.[A-Za-z0-9_]+$")


def identity_names(name: str) -> list[str]:
    return [name]


@dataclass
class Replica:
    """A tiny replica of a published checkpoint and what a correct conversion of it must keep.

    ``modules``: every Linear-like module of the source (2-D weight; embeddings excluded) -> its
    precision; routed experts one entry per expert projection. ``runtime_names``: the module
    prefixes vLLM's model for the architecture passes to its quantization config for that module
    (fused modules such as ``qkv_proj`` included; ``fused`` is that model's
    ``packed_modules_mapping``, ``config_prefix_map`` the prefix renames of its
    ``hf_to_vllm_mapper`` that vLLM applies to the config's exact names). ``expected_targets``:
    per target, None when it must convert, else text the one-line refusal must contain
    (case-insensitive; ``|`` separates accepted alternatives).
    """

    path: Path
    family: str
    layout: str
    scheme: str
    modules: dict[str, str]
    runtime_names: Callable[[str], list[str]]
    kv_cache: str | None
    expected_targets: dict[str, str | None]
    inferred_layout: bool = False
    fused: dict[str, list[str]] = field(default_factory=dict)
    config_prefix_map: dict[str, str] = field(default_factory=dict)
    expert_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    attention_layers: list[str] = field(default_factory=list)  # runtime attention prefixes (KV cache)
    mla: bool = False  # those are MLAAttention layers (DeepSeek), not Attention
    renames: dict[str, dict[str, str]] = field(default_factory=dict)  # target -> {source suffix: output suffix}

    def precision_counts(self) -> dict[str, int]:
        """What ``inspect --json`` must report under ``"precision"``."""
        out = {"fp4_experts": 0, "fp4_dense": 0, "fp8_tensor": 0, "fp8_block": 0, "bf16": 0}
        for name, p in self.modules.items():
            if p in ("mxfp4", "nvfp4"):
                out["fp4_experts" if ROUTED_EXPERT_RE.search(name) else "fp4_dense"] += 1
            else:
                out[p.replace("-", "_")] += 1
        return out

    def fp4_modules(self) -> list[str]:
        return [m for m, p in self.modules.items() if p in ("mxfp4", "nvfp4")]

    def source_quant(self) -> str:
        """"mxfp4" or "nvfp4": what the routed experts hold."""
        return next(p for m, p in self.modules.items() if ROUTED_EXPERT_RE.search(m) and p in ("mxfp4", "nvfp4"))


def e8m0_exponent(x: torch.Tensor) -> torch.Tensor:
    """Biased exponent (uint8) of the smallest power of two >= x; never 0xFF."""
    e = torch.ceil(torch.log2(x.float().clamp_min(2.0**-126)))
    return (e.clamp(-127, 127) + 127).to(torch.uint8)


class Sink:
    """Tensors of one checkpoint plus the precision of every Linear-like module written."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}
        self.modules: dict[str, str] = {}

    def _w(self, n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=self.gen) * 0.05

    def put(self, name: str, t: torch.Tensor) -> None:
        assert name not in self.tensors, name
        self.tensors[name] = t.contiguous()

    def norm(self, name: str, n: int) -> None:
        self.put(f"{name}.weight", torch.ones(n, dtype=torch.bfloat16))

    def raw(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> None:
        self.put(name, (torch.randn(shape, generator=self.gen) * 0.05).to(dtype))

    def embedding(self, name: str, n: int, k: int) -> None:
        self.put(f"{name}.weight", self._w(n, k).to(torch.bfloat16))

    def bf16(self, name: str, n: int, k: int, *, bias: bool = False) -> None:
        self.put(f"{name}.weight", self._w(n, k).to(torch.bfloat16))
        if bias:
            self.raw(f"{name}.bias", (n,))
        self.modules[name] = "bf16"

    # FP4 ------------------------------------------------------------------------------------
    def nvfp4_modelopt(self, name: str, n: int, k: int, *, input_scale: bool = True, amax: float | None = None) -> None:
        """ModelOpt / Quark-NVFP4 tensors: weight U8, weight_scale E4M3, weight_scale_2 F32 (a multiplier)."""
        w = self._w(n, k)
        packed, scale, ws2 = quant_nvfp4(w, None if amax is None else torch.tensor(amax))
        _check_e4m3(name, scale)
        self.put(f"{name}.weight", packed)
        self.put(f"{name}.weight_scale", scale)
        self.put(f"{name}.weight_scale_2", ws2.reshape(()).float())
        if input_scale:
            self.put(f"{name}.input_scale", torch.tensor(0.02 / (6 * 448), dtype=torch.float32))
        self.modules[name] = "nvfp4"

    def nvfp4_quark(self, name: str, n: int, k: int) -> None:
        """Quark NVFP4 (vLLM QuarkNVFP4): like ModelOpt, the activation scale named ``input_scale_2``."""
        self.nvfp4_modelopt(name, n, k, input_scale=False)
        self.put(f"{name}.input_scale_2", torch.tensor(0.02 / (6 * 448), dtype=torch.float32))

    def nvfp4_ct(self, name: str, n: int, k: int, *, w4a4: bool, gscale_shape: tuple[int, ...] = (1,)) -> None:
        """compressed-tensors NVFP4: weight_packed, weight_scale E4M3, weight_global_scale = 1 / ws2 (a divisor)."""
        packed, scale, ws2 = quant_nvfp4(self._w(n, k))
        _check_e4m3(name, scale)
        self.put(f"{name}.weight_packed", packed)
        self.put(f"{name}.weight_scale", scale)
        self.put(f"{name}.weight_global_scale", (1.0 / ws2).float().reshape(gscale_shape))
        if w4a4:
            self.put(f"{name}.input_global_scale", torch.tensor(6 * 448 / 0.02, dtype=torch.float32).reshape(gscale_shape))
        self.modules[name] = "nvfp4"

    def mxfp4_ct(self, name: str, n: int, k: int) -> None:
        """compressed-tensors / AutoRound MXFP4: weight_packed U8 + weight_scale U8 (E8M0)."""
        packed, scale = quant_mxfp4(self._w(n, k))
        _check_e8m0(name, scale)
        self.put(f"{name}.weight_packed", packed)
        self.put(f"{name}.weight_scale", scale)
        self.modules[name] = "mxfp4"

    def mxfp4_quark(self, name: str, n: int, k: int) -> None:
        """Quark MXFP4: weight U8 [N, K/2] + weight_scale U8 [N, K/32]."""
        packed, scale = quant_mxfp4(self._w(n, k))
        _check_e8m0(name, scale)
        self.put(f"{name}.weight", packed)
        self.put(f"{name}.weight_scale", scale)
        self.modules[name] = "mxfp4"

    def mxfp4_v4(self, name: str, n: int, k: int) -> None:
        """DeepSeek-V4 native MXFP4: weight I8 [N, K/2] (packed E2M1) + scale F8_E8M0 [N, K/32]."""
        packed, scale = quant_mxfp4(self._w(n, k))
        _check_e8m0(name, scale)
        self.put(f"{name}.weight", packed.view(torch.int8))
        self.put(f"{name}.scale", scale.view(torch.float8_e8m0fnu))
        self.modules[name] = "mxfp4"

    # FP8 ------------------------------------------------------------------------------------
    def fp8_tensor(self, name: str, n: int, k: int, *, input_scale: bool = True) -> None:
        """Per-tensor FP8: weight F8_E4M3, weight_scale F32 scalar, input_scale F32 scalar."""
        w = self._w(n, k)
        s = w.abs().amax() / 448
        self.put(f"{name}.weight", (w / s).to(torch.float8_e4m3fn))
        self.put(f"{name}.weight_scale", s.reshape(()).float())
        if input_scale:
            self.put(f"{name}.input_scale", torch.tensor(0.03 / 448, dtype=torch.float32))
        self.modules[name] = "fp8-tensor"

    def fp8_block(self, name: str, n: int, k: int, *, scale_name: str, scale_dtype: torch.dtype) -> None:
        """128x128 block FP8: weight F8_E4M3 + a [ceil(N/128), ceil(K/128)] scale (F32 / BF16, or
        F8_E8M0 powers of two for DeepSeek-V4)."""
        w = self._w(n, k)
        bn, bk = math.ceil(n / 128), math.ceil(k / 128)
        pad = torch.zeros(bn * 128, bk * 128)
        pad[:n, :k] = w
        amax = pad.reshape(bn, 128, bk, 128).abs().amax(dim=(1, 3)).clamp_min(1e-6)
        if scale_dtype == torch.float8_e8m0fnu:
            exp = e8m0_exponent(amax / 448)
            scale = torch.exp2(exp.float() - 127)
            stored = exp.view(torch.float8_e8m0fnu)
        else:
            scale = (amax / 448).to(scale_dtype).float()
            stored = scale.to(scale_dtype)
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert not torch.isnan(q.float()).any(), name
        self.put(f"{name}.weight", q)
        self.put(f"{name}.{scale_name}", stored)
        self.modules[name] = "fp8-block"

    # writing --------------------------------------------------------------------------------
    def save(self, root: Path, shards: int, *, name: str = "model") -> None:
        """``shards`` files (round-robin over sorted names: partners land in different files) + index."""
        assert shards >= 2
        names = sorted(self.tensors)
        groups: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
        for i, n in enumerate(names):
            groups[i % shards][n] = self.tensors[n]
        wmap: dict[str, str] = {}
        for i, g in enumerate(groups):
            fname = f"{name}-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file(g, str(root / fname), metadata={"format": "pt"})
            wmap.update(dict.fromkeys(g, fname))
        total = sum(t.numel() * t.element_size() for t in self.tensors.values())
        (root / f"{name}.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}, indent=2))


def _check_e4m3(name: str, scale: torch.Tensor) -> None:
    f = scale.float()
    assert bool(torch.isfinite(f).all()) and bool((f > 0).all()), f"{name}: E4M3 scale not finite and positive"


def _check_e8m0(name: str, scale: torch.Tensor) -> None:
    assert not bool((scale == 0xFF).any()), f"{name}: E8M0 scale 0xFF (NaN)"


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True))


def write_side_files(root: Path) -> None:
    write_json(root / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1})
    write_json(root / "tokenizer_config.json", {"model_max_length": 512})


def ct_weights(fmt: str) -> dict[str, Any]:
    """QuantizationArgs of the FP4 presets as compressed-tensors 0.19 serializes them (FORMATS.md §1.3)."""
    mx = fmt == "mxfp4"
    return {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32 if mx else 16,
            "num_bits": 4, "observer": "minmax" if mx else "static_minmax", "observer_kwargs": {},
            "scale_dtype": "torch.uint8" if mx else "torch.float8_e4m3fn",
            "strategy": "group" if mx else "tensor_group", "symmetric": True, "type": "float", "zp_dtype": None}


def ct_group(fmt: str, targets: list[str], *, w4a4: bool) -> dict[str, Any]:
    w = ct_weights(fmt)
    acts = None
    if w4a4:
        acts = {**w, "dynamic": True if fmt == "mxfp4" else "local", "observer": None if fmt == "mxfp4" else "static_minmax"}
    return {"format": f"{fmt}-pack-quantized", "input_activations": acts, "output_activations": None,
            "targets": targets, "weights": w}


def ct_config(groups: dict[str, dict[str, Any]], ignore: list[str], *, fmt: str,
              kv_cache_scheme: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"config_groups": groups, "format": fmt, "global_compression_ratio": None, "ignore": ignore,
            "kv_cache_scheme": kv_cache_scheme, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}, "version": "0.19.0"}
