"""``modelopt-nvfp4``: NVIDIA ModelOpt NVFP4 unified HF export (FORMATS.md §4).

Per quantized Linear: ``weight`` uint8 [N, K/2], ``weight_scale`` float8_e4m3fn [N, K/16],
``weight_scale_2`` float32 scalar (a multiplier), ``input_scale`` (W4A4). The config lives in
``hf_quant_config.json`` and/or ``config.json`` (``quant_method: modelopt``); ``exclude_modules``
are fnmatch wildcards.
"""

from __future__ import annotations

from typing import Any

from mxfp4conv.canonical import Canonical, UnitSpec
from mxfp4conv.errors import InputError
from mxfp4conv.io.checkpoint import Checkpoint
from mxfp4conv.layouts.base import (
    EXPERT_RE,
    LinearRoles,
    Plan,
    config_facts,
    plan_split_layout,
    read_split_unit,
)

NAME = "modelopt-nvfp4"
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
    hq = ckpt.hf_quant_config
    if isinstance(hq, dict) and isinstance(hq.get("quantization"), dict):
        ev.append("hf_quant_config.json quantization.quant_algo = " + str(hq["quantization"].get("quant_algo")))
        info.update(hq["quantization"])
    if ev and str(info.get("quant_algo", "")).upper() not in ("NVFP4", "FP4"):
        return info, []
    return info, ev


def detect(ckpt: Checkpoint) -> list[str] | None:
    _, ev = quant_info(ckpt)
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
    names = ("gate_proj", "up_proj", "down_proj")
    w4a4 = False
    for n in ckpt.tensors:
        m = EXPERT_RE.match(n)
        if m and m["proj"] in ("w1", "w2", "w3"):
            names = ("w1", "w3", "w2")
        w4a4 = w4a4 or n.endswith(".input_scale")
    facts = config_facts(ckpt.config, scheme="w4a4" if w4a4 else "w4a16", quant="nvfp4", expert_names=names,
                         ignore=tuple(str(x) for x in exclude if isinstance(x, str)))
    return plan_split_layout(ckpt, NAME, ROLES, facts)


def read(ckpt: Checkpoint, spec: UnitSpec, *, pin: bool = False) -> Canonical:
    return read_split_unit(ckpt, spec, ROLES, pin=pin)
