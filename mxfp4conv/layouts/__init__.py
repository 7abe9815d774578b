"""Input layouts, one module each, and layout detection with evidence.

Detection order is explicit data (specific before general). A checkpoint must match exactly one
layout: zero or several matches is an ``InputError`` that shows the evidence.
"""

from __future__ import annotations

from types import ModuleType

from mxfp4conv.errors import InputError
from mxfp4conv.io.checkpoint import Checkpoint
from mxfp4conv.layouts import ct_mxfp4, ct_nvfp4, gpt_oss, modelopt_nvfp4
from mxfp4conv.layouts.base import Plan, Problem

__all__ = ["LAYOUTS", "Plan", "Problem", "detect_layout", "get_layout"]

LAYOUTS: dict[str, ModuleType] = {
    gpt_oss.NAME: gpt_oss,
    modelopt_nvfp4.NAME: modelopt_nvfp4,
    ct_nvfp4.NAME: ct_nvfp4,
    ct_mxfp4.NAME: ct_mxfp4,
}


def get_layout(name: str) -> ModuleType:
    return LAYOUTS[name]


def detect_layout(ckpt: Checkpoint) -> tuple[ModuleType, list[str]]:
    """The one layout the checkpoint is in, with the evidence that matched."""
    matches = [(mod, ev) for mod in LAYOUTS.values() if (ev := mod.detect(ckpt))]
    cfg = str(ckpt.root / "config.json")
    if not matches:
        q = ckpt.config.get("quantization_config")
        qm = q.get("quant_method") if isinstance(q, dict) else None
        raise InputError(f"not an FP4 checkpoint mxfp4conv reads (quant_method={qm!r}); supported layouts: "
                         + ", ".join(LAYOUTS), file=cfg,
                         hint="mxfp4conv reads ct-mxfp4, gpt-oss, modelopt-nvfp4 and ct-nvfp4 checkpoints")
    if len(matches) > 1:
        shown = "; ".join(f"{m.NAME}: {', '.join(ev)}" for m, ev in matches)
        raise InputError(f"the checkpoint matches several layouts ({shown})", file=cfg,
                         hint="the folder mixes shards or configs of different releases; keep one")
    return matches[0]
