"""What the two AMD Quark layouts share: the config (docs/FORMATS.md §5), scheme and declared precisions.

vLLM reads ``global_quant_config`` for every layer, ``layer_quant_config`` (fnmatch keys) first where a key
matches, and ``exclude`` (exact names or ``re:``) before both; an FP8 KV cache is
``export.kv_cache_group`` plus ``layer_quant_config`` entries whose ``output_tensors`` are fp8_e4m3.
"""

from __future__ import annotations

from typing import Any

from mxfp4conv.model.precision import Declared, Precision, quark_spec_precision
from mxfp4conv.sources.checkpoint import Checkpoint


def qconfig(ckpt: Checkpoint) -> dict[str, Any]:
    q = ckpt.config.get("quantization_config")
    return q if isinstance(q, dict) and q.get("quant_method") == "quark" else {}


def _first(spec: Any) -> dict[str, Any]:
    """A Quark tensor spec is a dict, or a list of dicts for two-level schemes (NVFP4: fp4 then fp8 scale)."""
    if isinstance(spec, list) and spec and isinstance(spec[0], dict):
        return spec[0]
    return spec if isinstance(spec, dict) else {}


def global_precision(ckpt: Checkpoint) -> Precision | None:
    return quark_spec_precision(qconfig(ckpt).get("global_quant_config"))


def config_evidence(ckpt: Checkpoint, want: Precision) -> list[str]:
    if global_precision(ckpt) != want:
        return []
    group = 32 if want == "mxfp4" else 16
    return ["config.json quantization_config.quant_method = quark",
            f"config.json quantization_config.global_quant_config.weight = fp4 per_group {group}"]


def input_dtype(ckpt: Checkpoint) -> str | None:
    g = qconfig(ckpt).get("global_quant_config")
    acts = _first(g.get("input_tensors")) if isinstance(g, dict) else {}
    return str(acts["dtype"]) if acts.get("dtype") else None


def declared(ckpt: Checkpoint) -> Declared:
    q = qconfig(ckpt)
    exclude = q.get("exclude")
    layers = q.get("layer_quant_config")
    listed: dict[str, Precision] = {}
    for key, cfg in layers.items() if isinstance(layers, dict) else ():
        prec = quark_spec_precision(cfg)
        if prec is not None:
            listed[str(key)] = prec
    export = q.get("export")
    group = export.get("kv_cache_group") if isinstance(export, dict) else None
    kv = None
    if isinstance(group, list) and group and isinstance(layers, dict):
        outs = [_first(c.get("output_tensors")) for k, c in layers.items() if isinstance(c, dict)
                and any(_fnmatch(str(k), str(p)) for p in group)]
        kv = "fp8" if outs and all(o.get("dtype") == "fp8_e4m3" for o in outs) else None
    return Declared(unquantized=tuple(str(x) for x in exclude) if isinstance(exclude, list) else (), listed=listed,
                    main=quark_spec_precision(q.get("global_quant_config")), kv_cache=kv)


def _fnmatch(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)
