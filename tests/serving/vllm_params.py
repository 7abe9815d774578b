"""Every parameter vLLM's loader filled, compared with the checkpoint bytes it must have come from.

Runs inside vLLM's venv (torch and safetensors only, no vLLM import). vLLM's model classes load a
checkpoint tensor into a parameter of their own name and shape: attention's q/k/v into ``qkv_proj``
(rows in that order), a dense MLP's gate/up into ``gate_up_proj``, each routed expert into one slice
of a stacked ``experts.w13_*`` (gate rows, then up rows) or ``experts.w2_*``, GPT-OSS's native
``*_blocks`` / ``*_scales`` / ``*_bias`` into the same stacked parameters (``self_attn`` -> ``attn``,
``embed_tokens`` -> ``embedding``). ``expected(param name, shape)`` rebuilds what each parameter
must hold from the checkpoint by those rules alone; a parameter no rule explains, a checkpoint tensor
no parameter consumed, or a single byte that differs is reported.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

_GATE, _UP, _DOWN = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_STACKED = re.compile(r"^(?P<c>.+\.experts)(?:\.routed_experts)?\.(?P<w>w13|w2)_(?P<s>weight|weight_scale|bias)$")
# Attention's quantization scales that vLLM creates with its own initial values when the checkpoint has none
_DEFAULTS = re.compile(r"\.attn\.(q_scale|k_scale|v_scale|prob_scale)$")
_NATIVE = {"w13": "gate_up_proj", "w2": "down_proj"}
_NATIVE_SUFFIX = {"weight": "blocks", "weight_scale": "scales", "bias": "bias"}


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118
    return out


def _aliases(name: str) -> list[str]:
    """The checkpoint names vLLM's loaders read into ``name`` (GPT-OSS renames two modules)."""
    out = [name]
    if ".attn." in name:
        out.append(name.replace(".attn.", ".self_attn."))
    if name.startswith("model.embedding."):
        out.append(name.replace("model.embedding.", "model.embed_tokens."))
    return out


class _Source:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors, self.used = tensors, set[str]()

    def get(self, name: str) -> torch.Tensor | None:
        for n in _aliases(name):
            if n in self.tensors:
                self.used.add(n)
                return self.tensors[n]
        return None

    def first(self, names: list[str]) -> torch.Tensor | None:
        return next((t for n in names if (t := self.get(n)) is not None), None)


def _expert(src: _Source, c: str, e: int, w: str, s: str) -> torch.Tensor | None:
    """Expert ``e``'s slice of ``c.{w13,w2}_{s}``: per-expert fused names, or gate/up rows concatenated."""
    fused = src.get(f"{c}.{e}.{w}_{s}")
    if fused is not None:
        return fused
    if w == "w2":
        return src.first([f"{c}.{e}.{p}.{s}" for p in _DOWN])
    gate = src.first([f"{c}.{e}.{p}.{s}" for p in _GATE])
    up = src.first([f"{c}.{e}.{p}.{s}" for p in _UP])
    return None if gate is None or up is None else torch.cat([gate, up])


def expected(src: _Source, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """What parameter ``name`` must hold, from the checkpoint alone; None when no rule explains it."""
    m = _STACKED.match(name)
    if m:
        c, w, s = m["c"], m["w"], m["s"]
        native = src.get(f"{c}.{_NATIVE[w]}_{_NATIVE_SUFFIX[s]}")
        if native is not None:  # GPT-OSS: [E, rows, K/32, 16] blocks are the [E, rows, K/2] packed weight
            return native.reshape(shape) if native.numel() == torch.Size(shape).numel() else native
        parts = [_expert(src, c, e, w, s) for e in range(shape[0])]
        return None if any(p is None for p in parts) else torch.stack(parts)  # type: ignore[arg-type]
    direct = src.get(name)
    if direct is not None:
        return direct
    module, _, suffix = name.rpartition(".")
    head, _, fused = module.rpartition(".")
    if fused in _FUSED:
        parts = [src.get(f"{head}.{p}.{suffix}") for p in _FUSED[fused]]
        if all(p is not None for p in parts):
            return torch.cat(parts)  # type: ignore[arg-type]
    return None


def compare_params(params: dict[str, torch.Tensor], folder: Path) -> dict[str, object]:
    """{"compared", "differ", "unexplained", "defaults", "unconsumed"} for vLLM's loaded parameters against
    ``folder``; "defaults": attention scales vLLM initialises itself (the checkpoint has none to load)."""
    src = _Source(read_checkpoint(folder))
    out: dict[str, list[str]] = {"differ": [], "unexplained": [], "defaults": []}
    compared = 0
    for name, p in params.items():
        want = expected(src, name, tuple(p.shape))
        if want is None:
            out["defaults" if _DEFAULTS.search(name) else "unexplained"].append(name)
            continue
        compared += 1
        got = p.detach().cpu().contiguous()
        if got.dtype != want.dtype:  # the loader's copy_ casts: compare with the same cast
            want = want.to(got.dtype)
        if tuple(want.shape) != tuple(got.shape) or not torch.equal(
                got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)):
            out["differ"].append(name)
    unconsumed = sorted(set(src.tensors) - src.used)
    return {"compared": compared, **out, "unconsumed": unconsumed}
