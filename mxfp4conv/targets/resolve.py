"""Prove an output's config: resolve every module the way the runtime will, and compare with the plan.

The writers build configs from the precision model; this module reads a written ``config.json`` back
with the runtime's matching rules (vLLM 0.32, docs/FORMATS.md §1.4, §5, §9) and checks that each
module gets the precision the source gave it, under the names the runtime uses (MTP layers also as
``layers.N.mtp_block.*``), and that an FP8 KV cache is still declared. It is part of ``verify`` (and
of ``convert``'s proof), so a config that would make a runtime build a layer wrongly is never published.

compressed-tensors: ``ignore`` first (exact or ``re:``), then a group whose targets name the module
(exact or ``re:``), then a group targeting the class ``Linear``; a MoE layer is asked about as expert
0's projections. Quark: ``exclude`` first (exact or ``re:``; for a MoE layer also any plain entry under
it), then ``layer_quant_config`` (fnmatch keys with ``*``, else "the layer name occurs in the key"), then
the global config; an excluded Attention layer has no KV-cache scheme.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

from mxfp4conv.model.precision import (
    Precision,
    ct_group_precision,
    expert_container,
    matches,
    mtp_runtime_name,
    quark_spec_precision,
)

__all__ = ["config_mismatches", "expected", "resolve_ct", "resolve_quark"]

def resolve_ct(q: Mapping[str, Any], name: str) -> Precision | None:
    """The precision compressed-tensors gives the Linear ``name`` ("bf16" when ignored or unmatched)."""
    if any(matches(p, name) for p in q.get("ignore") or ()):
        return "bf16"
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    for by_class in (False, True):
        for g in groups:
            for t in g.get("targets") or ():
                hit = t == "Linear" if by_class else (t != "Linear" and matches(t, name))
                if hit:
                    return ct_group_precision(g)
    return "bf16"


def resolve_quark(q: Mapping[str, Any], name: str, *, moe: bool = False) -> Precision | None:
    """The precision Quark gives ``name`` (a Linear, or a MoE layer's prefix with ``moe``)."""
    exclude = [str(e) for e in q.get("exclude") or ()]
    if any(matches(e, name) for e in exclude) or (
            moe and any(not e.startswith("re:") and e.startswith(name + ".") for e in exclude)):
        return "bf16"
    for key, cfg in (q.get("layer_quant_config") or {}).items():
        if (fnmatch.fnmatch(name, key) if "*" in key else name in key):
            return quark_spec_precision(cfg)
    return quark_spec_precision(q.get("global_quant_config"))


def _names(module: str, num_layers: int) -> list[str]:
    """The module's name, and the runtime's MTP name when it sits past ``num_hidden_layers``."""
    mtp = mtp_runtime_name(module, num_layers)
    return [module] if mtp is None else [module, mtp]


def _expect(got: Precision | None, want: str) -> bool:
    return got == want or (want in ("mxfp4", "nvfp4") and got in ("mxfp4", "nvfp4"))


def config_mismatches(config: Mapping[str, Any], modules: Mapping[str, str],
                      moe: Iterable[tuple[str, tuple[str, ...], str]], *, num_layers: int, kv_cache: str | None,
                      attention: Iterable[str] = ()) -> list[dict[str, str]]:
    """Differences between what ``config`` makes of each module and what it should be (at most five).

    ``modules``: Linear module (not a routed expert) -> expected precision ("mxfp4" for FP4, FP8 kinds,
    "bf16"); ``moe``: (experts container, its projection names in the output, "mxfp4" or "bf16") per MoE
    layer; ``attention``: the runtime's Attention layer names (they must keep an FP8 KV cache).
    """
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return [{"tensor": "config.json", "message": "no quantization_config"}]
    method = q.get("quant_method")
    if method not in ("compressed-tensors", "quark"):
        return []  # GPT-OSS's own config names no per-module schemes beyond its experts
    out: list[dict[str, str]] = []

    def check(name: str, want: str, got: Precision | None) -> None:
        if not _expect(got, want) and len(out) < 5:
            out.append({"tensor": name, "message": f"config.json gives it {got or 'no known scheme'}, the source {want}"})

    for module, want in modules.items():
        for name in _names(module, num_layers):
            check(name, want, resolve_ct(q, name) if method == "compressed-tensors" else resolve_quark(q, name))
    for container, projs, want in moe:
        for name in _names(container, num_layers):
            if method == "compressed-tensors":
                for proj in projs:
                    check(f"{name}.0.{proj}", want, resolve_ct(q, f"{name}.0.{proj}"))
            else:
                check(name, want, resolve_quark(q, name, moe=True))
    out += _kv_mismatches(q, method, kv_cache, attention)
    return out


def _kv_mismatches(q: Mapping[str, Any], method: str, kv_cache: str | None, attention: Iterable[str]
                   ) -> list[dict[str, str]]:
    if method == "compressed-tensors":
        s = q.get("kv_cache_scheme")
        got = "fp8" if isinstance(s, dict) and s.get("num_bits") == 8 and s.get("type") == "float" else None
    else:
        export = q.get("export")
        group = list(export.get("kv_cache_group") or ()) if isinstance(export, dict) else []
        outs = [(c or {}).get("output_tensors") for k, c in (q.get("layer_quant_config") or {}).items()
                if any(fnmatch.fnmatchcase(k, g) for g in group)]
        got = "fp8" if group and outs and all(isinstance(o, dict) and o.get("dtype") == "fp8_e4m3" for o in outs) else None
        if got:
            lost = [a for a in attention if any(matches(e, a) for e in q.get("exclude") or ())]
            if lost:
                return [{"tensor": lost[0], "message": "config.json excludes this Attention layer: its FP8 KV cache is lost"}]
    if got != kv_cache:
        return [{"tensor": "config.json", "message": f"KV cache declared {got or 'unquantized'}, the source's is "
                 f"{kv_cache or 'unquantized'}"}]
    return []


def expected(units: Iterable[Any], fp8: Mapping[str, Any], bf16: Iterable[str], projs: tuple[str, ...]
             ) -> tuple[dict[str, str], list[tuple[str, tuple[str, ...], str]]]:
    """(Linear module -> expected precision, MoE layers as (container, projections, precision)) from a plan's
    units and precision model; ``projs``: the output's expert projection names."""
    modules: dict[str, str] = {u.key: "mxfp4" for u in units if u.kind == "dense"}
    modules.update({m: lin.kind for m, lin in fp8.items()})
    moe = [(u.key, projs, "mxfp4") for u in units if u.kind == "moe"]
    containers: set[str] = set()
    for m in bf16:
        c = expert_container(m)
        if c is None:
            modules[m] = "bf16"
        elif c not in containers:
            containers.add(c)
            moe.append((c, tuple(sorted({n.rsplit(".", 1)[1] for n in bf16 if n.startswith(c + ".0.")})), "bf16"))
    return modules, moe


def config_proof(config: Mapping[str, Any], ctx: Any) -> list[dict[str, str]]:
    """``config_mismatches`` for an output written from the writer context ``ctx`` (a ``WriterContext``)."""
    from mxfp4conv.targets.base import split_names
    from mxfp4conv.targets.layers import attention_layers

    p = ctx.precision
    modules, moe = expected(ctx.units, p.fp8, p.bf16, split_names(ctx))
    return config_mismatches(config, modules, moe, num_layers=ctx.facts.num_layers, kv_cache=p.kv_cache,
                             attention=attention_layers(ctx))
