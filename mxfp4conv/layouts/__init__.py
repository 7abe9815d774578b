"""Input layouts, one module each, and layout detection with evidence.

Detection order is explicit data (specific before general). A checkpoint must match exactly one
layout: zero or several matches is an ``InputError`` that shows the evidence (a folder that mixes
layouts is refused, never half converted). A layout found from tensor names alone, without a
quantization config, is reported as inferred.
"""

from __future__ import annotations

from mxfp4conv.errors import InputError
from mxfp4conv.layouts import (
    ct_mxfp4,
    ct_nvfp4,
    deepseek_v4,
    gpt_oss,
    modelopt_nvfp4,
    quark_mxfp4,
    quark_nvfp4,
)
from mxfp4conv.layouts.base import Layout, Plan, Problem
from mxfp4conv.sources.checkpoint import Checkpoint

__all__ = ["LAYOUTS", "Layout", "Plan", "Problem", "detect_layout", "get_layout", "is_config_evidence"]

# Detection tries every layout; the order is the order of `inspect`'s listing (specific before general).
_ORDER: tuple[Layout, ...] = (gpt_oss, modelopt_nvfp4, quark_nvfp4, ct_nvfp4, ct_mxfp4, quark_mxfp4, deepseek_v4)
LAYOUTS: dict[str, Layout] = {mod.NAME: mod for mod in _ORDER}


def get_layout(name: str) -> Layout:
    return LAYOUTS[name]


def is_config_evidence(item: str) -> bool:
    return item.startswith(("config.json ", "hf_quant_config.json "))


def detect_layout(ckpt: Checkpoint) -> tuple[Layout, list[str]]:
    """The one layout the checkpoint is in, with the evidence that matched."""
    matches = [(mod, ev) for mod in LAYOUTS.values() if (ev := mod.detect(ckpt))]
    cfg = str(ckpt.root / "config.json")
    if not matches:
        q = ckpt.config.get("quantization_config")
        qm = q.get("quant_method") if isinstance(q, dict) else None
        raise InputError(f"not an FP4 checkpoint mxfp4conv reads (quant_method={qm!r}); supported layouts: "
                         + ", ".join(LAYOUTS), file=cfg,
                         hint="mxfp4conv reads " + ", ".join(LAYOUTS) + " checkpoints")
    if len(matches) > 1:
        shown = "; ".join(f"{m.NAME}: {', '.join(ev)}" for m, ev in matches)
        raise InputError(f"the checkpoint matches several layouts ({shown})", file=cfg,
                         hint="the folder mixes shards or configs of different releases; keep one")
    return matches[0]
