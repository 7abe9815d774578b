"""Bring a unit read from any layout to the form a writer encodes: MXFP4 (or NVFP4 kept as is).

NVFP4 weights are dequantized exactly and requantized to MXFP4 with the chosen scale rule
(``requant``); MXFP4 weights pass unchanged. Returns per-tensor requant statistics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mxfp4conv.numerics.requant_stats import RequantStats

from mxfp4conv.model.canonical import Canonical, DenseFP4, FP4Weight, MoELayer

__all__ = ["to_mxfp4"]


def _requant(w: FP4Weight, rule: str, device: str, keep: bool, rows: bool) -> tuple[FP4Weight, RequantStats]:
    from mxfp4conv.formats.mxfp4 import ScaleRule
    from mxfp4conv.numerics.requant import requant_nvfp4_to_mxfp4

    return requant_nvfp4_to_mxfp4(w, ScaleRule(rule), device=device, keep_on_device=keep, keep_rows=rows)


def to_mxfp4(unit: Canonical, *, rule: str, device: str, keep_on_device: bool = False,
             keep_rows: bool = False) -> tuple[Canonical, dict[str, RequantStats]]:
    """The unit with every FP4 weight in MXFP4, and {"<key>.w13" | "<key>.w2" | "<module>": stats}.
    ``keep_on_device``: weights requantized whole on a GPU keep their results there. ``keep_rows``:
    the statistics keep their rows (a later expert group's, to continue an earlier one's)."""
    stats: dict[str, RequantStats] = {}
    keep = keep_on_device
    if isinstance(unit, MoELayer) and unit.w13.quant == "nvfp4":
        w13, stats[f"{unit.prefix}.w13"] = _requant(unit.w13, rule, device, keep, keep_rows)
        w2, stats[f"{unit.prefix}.w2"] = _requant(unit.w2, rule, device, keep, keep_rows)
        return MoELayer(unit.prefix, w13, w2, unit.w13_bias, unit.w2_bias), stats
    if isinstance(unit, DenseFP4) and unit.weight.quant == "nvfp4":
        w, stats[unit.module] = _requant(unit.weight, rule, device, keep, keep_rows)
        return DenseFP4(unit.module, w, unit.bias), stats
    return unit, stats
