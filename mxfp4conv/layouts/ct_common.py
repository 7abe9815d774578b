"""What the compressed-tensors layouts share: config evidence, scheme, declared precisions.

AutoRound's ``auto_round:llm_compressor`` export writes the same tensors as compressed-tensors MXFP4
under its own config (``quant_method: auto-round``, ``data_type: mx_fp``, ``bits``, ``group_size``,
``act_bits``): it is read here too, with that config parsed (docs/FORMATS.md §1.5).
"""

from __future__ import annotations

from typing import Any

from mxfp4conv.layouts.base import config_facts, expert_names
from mxfp4conv.model.canonical import ModelFacts
from mxfp4conv.model.precision import Declared, Precision, ct_group_precision
from mxfp4conv.sources.checkpoint import Checkpoint

FMT_KEY = "quantization_config.format"


def qconfig(ckpt: Checkpoint) -> dict[str, Any]:
    q = ckpt.config.get("quantization_config") or ckpt.config.get("compression_config")
    return q if isinstance(q, dict) else {}


def is_autoround_mxfp4(q: dict[str, Any]) -> bool:
    """AutoRound's llm-compressor-compatible MXFP4 export (W4A16 or W4A4)."""
    return (q.get("quant_method") in ("auto-round", "auto_round") and "llm_compressor" in str(q.get("packing_format", ""))
            and str(q.get("data_type", "")).startswith("mx_fp") and q.get("bits") == 4 and q.get("group_size") == 32)


def formats(q: dict[str, Any]) -> set[str]:
    out = {q["format"]} if isinstance(q.get("format"), str) else set()
    groups = q.get("config_groups")
    if isinstance(groups, dict):
        out |= {g["format"] for g in groups.values() if isinstance(g, dict) and isinstance(g.get("format"), str)}
    return out


def config_evidence(ckpt: Checkpoint, fmt: str) -> list[str]:
    q = qconfig(ckpt)
    if fmt == "mxfp4-pack-quantized" and is_autoround_mxfp4(q):
        return [f"config.json quantization_config.quant_method = {q['quant_method']}",
                f"config.json quantization_config.packing_format = {q['packing_format']}",
                f"config.json quantization_config.data_type = {q['data_type']}"]
    if q.get("quant_method") != "compressed-tensors":
        return []
    ev = ["config.json quantization_config.quant_method = compressed-tensors"]
    if fmt in formats(q):
        ev.append(f"config.json {FMT_KEY} = {fmt}")
        return ev
    return []


def scheme(q: dict[str, Any]) -> str:
    if is_autoround_mxfp4(q):
        act = q.get("act_bits")
        return "w4a4" if isinstance(act, int) and act <= 8 else "w4a16"
    groups = q.get("config_groups")
    if isinstance(groups, dict):
        for g in groups.values():
            if isinstance(g, dict) and g.get("input_activations") and ct_group_precision(g) in ("mxfp4", "nvfp4"):
                return "w4a4"
    return "w4a16"


def _ignore(q: dict[str, Any]) -> list[str]:
    ignore = q.get("ignore")
    return [str(x) for x in ignore] if isinstance(ignore, list) else []


def declared(ckpt: Checkpoint) -> Declared:
    """compressed-tensors: ``ignore`` and the groups that target modules by name or ``re:`` (class-name
    targets such as ``Linear`` cover every other Linear); AutoRound: ``extra_config`` entries kept at 16 bits."""
    q = qconfig(ckpt)
    if is_autoround_mxfp4(q):
        extra = q.get("extra_config")
        kept = [str(m) for m, c in extra.items() if isinstance(c, dict) and isinstance(c.get("bits"), int)
                and c["bits"] >= 16] if isinstance(extra, dict) else []
        return Declared(unquantized=tuple(kept))
    listed: dict[str, Precision] = {}
    by_class = False
    main: Precision | None = None
    groups = q.get("config_groups")
    for g in groups.values() if isinstance(groups, dict) else ():
        targets = g.get("targets") if isinstance(g, dict) else None
        prec = ct_group_precision(g) if isinstance(g, dict) else None
        for t in targets if isinstance(targets, list) else ():
            if not isinstance(t, str):
                continue
            if t.startswith("re:") or "." in t:
                if prec is not None:
                    listed[t] = prec
            else:
                by_class = True  # "Linear" and other class names
                if t == "Linear" and main is None:
                    main = prec
    kv = q.get("kv_cache_scheme")
    fp8_kv = isinstance(kv, dict) and kv.get("num_bits") == 8 and kv.get("type") == "float"
    return Declared(unquantized=tuple(_ignore(q)), listed=listed, exhaustive=bool(listed) and not by_class,
                    main=main, kv_cache="fp8" if fp8_kv else None)


def facts(ckpt: Checkpoint, quant: str) -> ModelFacts:
    q = qconfig(ckpt)
    return config_facts(ckpt.config, scheme=scheme(q), quant=quant, expert_names=expert_names(ckpt),
                        ignore=tuple(declared(ckpt).unquantized))
