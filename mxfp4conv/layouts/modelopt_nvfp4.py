"""``modelopt-nvfp4``: NVIDIA ModelOpt NVFP4 unified HF export (FORMATS.md §4).

Per quantized Linear: ``weight`` uint8 [N, K/2], ``weight_scale`` float8_e4m3fn [N, K/16],
``weight_scale_2`` float32 scalar (a multiplier), ``input_scale`` (W4A4). The config lives in
``hf_quant_config.json`` and/or ``config.json`` (``quant_method: modelopt``); ``exclude_modules``
are fnmatch wildcards. ``quant_algo: MIXED_PRECISION`` lists every quantized module in
``quantized_layers`` (NVFP4, FP8 per-tensor, FP8_PB_WO 128x128 blocks); modules it does not list are
unquantized. ``kv_cache_quant_algo: FP8`` quantizes the KV cache (k/v scales carried as tensors).
"""

from __future__ import annotations

from typing import Any

from mxfp4conv.errors import InputError
from mxfp4conv.layouts.base import Plan, config_facts, expert_names
from mxfp4conv.layouts.split import DEEPSEEK_V4_MXFP4, LinearRoles, plan_split_layout, read_split_unit
from mxfp4conv.model.canonical import Canonical, UnitSpec
from mxfp4conv.model.precision import Declared, Precision
from mxfp4conv.sources.checkpoint import Checkpoint

NAME = "modelopt-nvfp4"
CONFIG_FILES: tuple[str, ...] = ("hf_quant_config.json",)
READS_EXPERT_GROUPS = True  # split MoE units read a group of experts at a time (split.expert_group)
ROLES = LinearRoles(packed="weight", scale="weight_scale", scale_dtype="F8_E4M3", group=16, quant="nvfp4",
                    global_scale="weight_scale_2", global_is_divisor=False, input_scale="input_scale")


def quant_info(ckpt: Checkpoint) -> tuple[dict[str, Any], list[str]]:
    """(merged quantization info, evidence). hf_quant_config.json wins over config.json."""
    ev: list[str] = []
    info: dict[str, Any] = {}
    q = ckpt.config.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") in ("modelopt", "modelopt_fp4"):
        ev.append(f"config.json quantization_config.quant_method = {q.get('quant_method')}")
        info.update(q)
        if "ignore" in q and "exclude_modules" not in info:
            info["exclude_modules"] = q["ignore"]
    elif isinstance(q, dict) and q.get("quant_method") == "fp8" and str(q.get("moe_quant_algo", "")).upper() == "NVFP4":
        # DeepSeek-V4 NVFP4: the FP8 config of the other Linears, NVFP4 routed experts (vLLM deepseek_v4 quant_config)
        ev.append("config.json quantization_config.moe_quant_algo = NVFP4")
        info["quant_algo"] = "NVFP4"
    hq = ckpt.hf_quant_config
    if isinstance(hq, dict) and isinstance(hq.get("quantization"), dict):
        ev.append("hf_quant_config.json quantization.quant_algo = " + str(hq["quantization"].get("quant_algo")))
        info.update(hq["quantization"])
    if ev and not _has_nvfp4(info):
        return info, []
    return info, ev


# ModelOpt quant_algo names (modelopt/torch/export/quant_utils.py) -> precision
_ALGOS: dict[str, Precision] = {"NVFP4": "nvfp4", "FP4": "nvfp4", "FP8": "fp8-tensor", "FP8_PB_WO": "fp8-block",
                                "FP8_BLOCK": "fp8-block", "FP8_PB": "fp8-block"}


def _listed(info: dict[str, Any]) -> dict[str, Precision]:
    layers = info.get("quantized_layers")
    out: dict[str, Precision] = {}
    for module, cfg in layers.items() if isinstance(layers, dict) else ():
        algo = str(cfg.get("quant_algo", "")).upper() if isinstance(cfg, dict) else ""
        if algo in _ALGOS:
            out[str(module)] = _ALGOS[algo]
    return out


def _has_nvfp4(info: dict[str, Any]) -> bool:
    algo = str(info.get("quant_algo", "")).upper()
    return algo in ("NVFP4", "FP4") or (algo == "MIXED_PRECISION" and "nvfp4" in _listed(info).values())


def _fp8_with_nvfp4_experts(ckpt: Checkpoint) -> bool:
    """DeepSeek-V4 NVFP4: config.json's FP8 config rules every Linear but the routed experts."""
    q = ckpt.config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "fp8" and str(q.get("moe_quant_algo", "")).upper() == "NVFP4"


def declared(ckpt: Checkpoint) -> Declared:
    """What the config the runtime reads says. vLLM reads config.json's ``quantization_config`` when there
    is one and hf_quant_config.json only otherwise; DeepSeek-V4's FP8 config names no modules (the tensors
    say which Linears are FP8), and ModelOpt's exclusions beside it mean "not NVFP4", not "unquantized"."""
    if _fp8_with_nvfp4_experts(ckpt):
        return Declared(source="config.json")
    info, _ = quant_info(ckpt)
    exclude = info.get("exclude_modules") or []
    mixed = str(info.get("quant_algo", "")).upper() == "MIXED_PRECISION"
    kv = str(info.get("kv_cache_quant_algo") or "").upper()
    main: Precision | None = "nvfp4" if str(info.get("quant_algo", "")).upper() in ("NVFP4", "FP4") else None
    return Declared(unquantized=tuple(x for x in exclude if isinstance(x, str)) if isinstance(exclude, list) else (),
                    listed=_listed(info) if mixed else {}, exhaustive=mixed, main=main, kv_cache="fp8" if kv == "FP8" else None,
                    source="hf_quant_config.json" if ckpt.hf_quant_config else "config.json",
                    method="modelopt_mixed" if mixed else "modelopt_fp4" if main else None)  # vLLM's config names


def detect(ckpt: Checkpoint) -> list[str] | None:
    _, ev = quant_info(ckpt)
    q = ckpt.config.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "quark":
        return None  # Quark NVFP4 names its global scale weight_scale_2 too
    marker = next((n for n in ckpt.tensors if n.endswith(".weight_scale_2")), None)
    if marker:
        ev.append(f"tensor {marker}")
    return ev or None


def plan(ckpt: Checkpoint) -> Plan:
    info, _ = quant_info(ckpt)
    exclude = info.get("exclude_modules") or []
    if not (isinstance(exclude, list) and all(isinstance(x, str) for x in exclude)):
        where = "hf_quant_config.json" if ckpt.hf_quant_config else "config.json"
        raise InputError(f"exclude_modules must be a list of fnmatch patterns, got {type(exclude).__name__}",
                         file=str(ckpt.root / where), hint="restore the file from the original release")
    w4a4 = False
    for n in ckpt.tensors:
        if n.endswith(".input_scale") and not w4a4:  # an FP4 module's, not an FP8 Linear's
            w = ckpt.tensors.get(n[: -len("input_scale")] + "weight")
            w4a4 = w is not None and w.dtype == "U8"
    facts = config_facts(ckpt.config, scheme="w4a4" if w4a4 else "w4a16", quant="nvfp4", expert_names=expert_names(ckpt),
                         ignore=tuple(str(x) for x in exclude if isinstance(x, str)))
    return plan_split_layout(ckpt, NAME, ROLES, facts, also=(DEEPSEEK_V4_MXFP4,))


def read(ckpt: Checkpoint, spec: UnitSpec, *, device: str | None = None) -> Canonical:
    roles = DEEPSEEK_V4_MXFP4 if spec.extra.get("roles") == "1" else ROLES  # V4's MXFP4 MTP experts
    return read_split_unit(ckpt, spec, roles, device=device)

