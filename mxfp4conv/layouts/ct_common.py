"""What the two compressed-tensors layouts share: config evidence, scheme, ignore list."""

from __future__ import annotations

from typing import Any

from mxfp4conv.canonical import ModelFacts
from mxfp4conv.io.checkpoint import Checkpoint
from mxfp4conv.layouts.base import EXPERT_RE, Plan, config_facts

FMT_KEY = "quantization_config.format"


def qconfig(ckpt: Checkpoint) -> dict[str, Any]:
    q = ckpt.config.get("quantization_config") or ckpt.config.get("compression_config")
    return q if isinstance(q, dict) else {}


def formats(q: dict[str, Any]) -> set[str]:
    out = {q["format"]} if isinstance(q.get("format"), str) else set()
    groups = q.get("config_groups")
    if isinstance(groups, dict):
        out |= {g["format"] for g in groups.values() if isinstance(g, dict) and isinstance(g.get("format"), str)}
    return out


def config_evidence(ckpt: Checkpoint, fmt: str) -> list[str]:
    q = qconfig(ckpt)
    if q.get("quant_method") != "compressed-tensors":
        return []
    ev = ["config.json quantization_config.quant_method = compressed-tensors"]
    if fmt in formats(q):
        ev.append(f"config.json {FMT_KEY} = {fmt}")
        return ev
    return []


def scheme(q: dict[str, Any]) -> str:
    groups = q.get("config_groups")
    if isinstance(groups, dict):
        for g in groups.values():
            if isinstance(g, dict) and g.get("input_activations"):
                return "w4a4"
    return "w4a16"


def facts(ckpt: Checkpoint, quant: str) -> ModelFacts:
    q = qconfig(ckpt)
    ignore = q.get("ignore") if isinstance(q.get("ignore"), list) else []
    names = ("gate_proj", "up_proj", "down_proj")
    for n in ckpt.tensors:
        m = EXPERT_RE.match(n)
        if m and m["proj"] in ("w1", "w2", "w3"):
            names = ("w1", "w3", "w2")
            break
    return config_facts(ckpt.config, scheme=scheme(q), quant=quant, expert_names=names,
                        ignore=tuple(str(x) for x in ignore or ()))


def finish_plan(ckpt: Checkpoint, plan: Plan) -> Plan:
    return plan
