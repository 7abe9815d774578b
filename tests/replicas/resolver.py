"""Which precision a runtime gives a module, read from an OUTPUT config.json the way vLLM 0.32 does.

Independent of mxfp4conv: the rules below restate vLLM's matching code (file names relative to
``vllm/model_executor/layers/quantization/``) so a test can ask "what will the runtime build for
this module" without importing vLLM.

compressed-tensors (``compressed_tensors/compressed_tensors.py``, ``compressed_tensors/utils.py``,
``utils/config_utils.py``):
  * the model's ``hf_to_vllm_mapper`` renames exact-name targets and ignore entries (those with a
    "." that are not ``re:``); regexes and class names are left alone (``apply_vllm_mapper``);
  * config groups whose only target ends with "Attention" are dropped (``from_config``);
  * ``ignore`` first: exact name or ``re:`` + ``re.match``; a fused module (``qkv_proj``) matched
    directly wins, otherwise every shard must agree (else vLLM raises);
  * targets: exact name / ``re:`` on the module name, then the fused shards (all must match; the
    first shard's target wins), then the layer's class name by case-insensitive substring
    ("Linear" is in every ``*Linear`` class, not in ``ParallelLMHead``);
  * routed experts: "RoutedExperts" gets the "Linear" scheme when "Linear" is a target; the probes
    are ``<prefix>.0.<gate>``, ``.0.<up>``, ``.0.<down>`` with the checkpoint's projection names,
    and all three must resolve to the same scheme dict (else vLLM raises).

Quark (``quark/quark.py``, ``quark/utils.py``, ``quark/quark_moe.py``):
  * ``exclude`` (mapper applied to every string) first: exact or ``re:`` only (no globs); for routed
    experts also any non-regex entry equal to the prefix or under ``<prefix>.``;
  * then ``layer_quant_config``: a pattern without "*" matches when the layer name is a SUBSTRING
    of the pattern, a pattern with "*" by ``fnmatch``; fused modules take each shard's config (or
    the fallback) and all must be equal;
  * then ``layer_type_quant_config`` keyed by the layer's class: vLLM looks it up with the class
    object, so a JSON (string-keyed) entry never matches; then ``global_quant_config``;
  * ``ParallelLMHead`` is neither a LinearBase nor experts: always unquantized.

The KV cache: compressed-tensors ``kv_cache_scheme`` (num_bits 8, float, strategy tensor or
attn_head, symmetric) applies to every Attention layer; Quark's ``export.kv_cache_group`` patterns
must fnmatch ``layer_quant_config`` keys whose ``output_tensors`` (fp8_e4m3, per_tensor) become
the KV config, and an Attention layer that ``exclude`` matches gets no KV-cache method. Neither
config gives one to DeepSeek's ``MLAAttention`` (not an ``Attention`` subclass; only ModelOpt's
config handles it).
"""

from __future__ import annotations

import copy
import fnmatch
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["ResolveError", "kv_cache", "kv_cache_declared", "layer_class", "resolve"]


class ResolveError(AssertionError):
    """A configuration vLLM refuses to build (it raises at load time)."""


def layer_class(name: str) -> str:
    """The vLLM layer class a runtime module prefix stands for."""
    if name.endswith(".experts"):
        return "RoutedExperts"
    if name == "lm_head" or name.endswith((".lm_head", ".head")):
        return "ParallelLMHead"
    return "Linear"


def resolve(config: Mapping[str, Any], name: str, *, fused: Mapping[str, list[str]] | None = None,
            prefix_map: Mapping[str, str] | None = None,
            expert_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> str:
    """Precision ("mxfp4", "nvfp4", "fp8-tensor", "fp8-block", "bf16" or "other:...") that the
    runtime module ``name`` gets from ``config`` (a whole config.json). "fp8-tensor" means FP8
    per-tensor weights with a static per-tensor input scale (what ModelOpt's FP8 layers carry);
    dynamic or weight-only activations come back as "fp8-tensor/dynamic" or "fp8-tensor/w8a16"."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return "bf16"
    method = q.get("quant_method")
    fused = dict(fused or {})
    pmap = dict(prefix_map or {})
    if method == "compressed-tensors":
        return _ct(q, name, fused, pmap, expert_projs)
    if method == "quark":
        return _quark(q, name, fused, pmap)
    raise ResolveError(f"resolver knows compressed-tensors and quark configs, not {method!r}")


# compressed-tensors --------------------------------------------------------------------------
def _map_name(name: str, pmap: Mapping[str, str]) -> str:
    for old, new in pmap.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _ct_map_target(t: str, pmap: Mapping[str, str]) -> str:
    return _map_name(t, pmap) if "." in t and not t.startswith("re:") else t


def _eq_or_re(value: str, target: str, *, contains: bool = False) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    if contains:
        return target.lower() in value.lower()
    return target == value


def _matching_patterns(name: str, patterns: list[str], fused: Mapping[str, list[str]]) -> list[set[str]]:
    direct = {p for p in patterns if _eq_or_re(name, p)}
    if direct:
        return [direct]
    leaf = name.split(".")[-1]
    if leaf not in fused:
        return [set()]
    return [{p for p in patterns if _eq_or_re(name.replace(leaf, s), p)} for s in fused[leaf]]


def _ignored(name: str, patterns: list[str], fused: Mapping[str, list[str]]) -> bool:
    hits = [bool(m) for m in _matching_patterns(name, patterns, fused)]
    if any(hits) and not all(hits):
        raise ResolveError(f"{name}: some but not all shards are ignored ({patterns})")
    return all(hits)


def _ct_target(name: str, cls: str, targets: list[str], fused: Mapping[str, list[str]]) -> str | None:
    hit = next((t for t in targets if _eq_or_re(name, t)), None)
    if hit:
        return hit
    key = next((k for k in fused if name.endswith(k)), None)
    if key is not None:
        shard_hits = [next((t for t in targets if _eq_or_re(name.replace(key, s), t)), None) for s in fused[key]]
        if all(shard_hits):
            return shard_hits[0]
    return next((t for t in targets if _eq_or_re(cls, t, contains=True)), None)


def _ct_scheme_map(q: Mapping[str, Any], pmap: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for group in (q.get("config_groups") or {}).values():
        targets = list(group.get("targets") or [])
        if len(targets) == 1 and targets[0].endswith("Attention"):
            continue
        for t in targets:
            out[_ct_map_target(t, pmap)] = {"weights": group.get("weights"),
                                             "input_activations": group.get("input_activations"),
                                             "format": group.get("format") or q.get("format")}
    return out


def _ct_scheme(name: str, cls: str, q: Mapping[str, Any], schemes: dict[str, dict[str, Any]],
               fused: Mapping[str, list[str]], pmap: Mapping[str, str]) -> dict[str, Any] | None:
    ignore = [_ct_map_target(t, pmap) for t in q.get("ignore") or []]
    if _ignored(name, ignore, fused):
        return None
    t = _ct_target(name, cls, list(schemes), fused)
    return schemes[t] if t is not None else None


def _ct(q: Mapping[str, Any], name: str, fused: Mapping[str, list[str]], pmap: Mapping[str, str],
        projs: tuple[str, str, str]) -> str:
    schemes = _ct_scheme_map(q, pmap)
    cls = layer_class(name)
    if cls == "RoutedExperts":
        if "Linear" in schemes and "RoutedExperts" not in schemes:
            schemes["RoutedExperts"] = schemes["Linear"]
        found = [_ct_scheme(f"{name}.0.{p}", cls, q, schemes, fused, pmap) for p in projs]
        if any(f != found[0] for f in found):
            raise ResolveError(f"{name}: MoE projections {projs} resolve to different schemes")
        scheme = found[0]
    else:
        scheme = _ct_scheme(name, cls, q, schemes, fused, pmap)
    if scheme is None or scheme.get("weights") is None:
        return "bf16"
    return _ct_precision(scheme["weights"], scheme.get("input_activations"))


def _ct_precision(w: Mapping[str, Any], acts: Mapping[str, Any] | None) -> str:
    kind, bits, strategy, group = w.get("type"), w.get("num_bits"), w.get("strategy"), w.get("group_size")
    if kind == "float" and bits == 4 and w.get("symmetric"):
        if strategy == "group" and group == 32:
            return "mxfp4"
        if strategy == "tensor_group" and group == 16:
            return "nvfp4"
    if kind == "float" and bits == 8:
        if strategy == "tensor":
            if acts is None:
                return "fp8-tensor/w8a16"  # the checkpoint's input_scale would have no parameter
            if acts.get("dynamic"):
                return "fp8-tensor/dynamic"
            return "fp8-tensor" if acts.get("strategy") == "tensor" else f"fp8-tensor/{acts.get('strategy')}"
        if strategy == "block" and list(w.get("block_structure") or []) == [128, 128]:
            return "fp8-block"
    return f"other:{kind}/{bits}/{strategy}/{group}"


# Quark ----------------------------------------------------------------------------------------
def _quark_excluded(name: str, exclude: list[str], fused: Mapping[str, list[str]], *, experts: bool) -> bool:
    if experts and any(t == name or t.startswith(name + ".") for t in exclude if not t.startswith("re:")):
        return True
    return _ignored(name, exclude, fused)


def _layer_cfg_by_name(name: str, layer_cfg: Mapping[str, Any], fused: Mapping[str, list[str]]) -> Any:
    leaf = name.split(".")[-1]
    if leaf in fused:
        found = [_layer_cfg_by_name(name.replace(leaf, s), layer_cfg, fused) if name.replace(leaf, s) != name else None
                 for s in fused[leaf]]
        hits = [f for f in found if f is not None]
        if hits and any(h != hits[0] for h in hits):
            raise ResolveError(f"{name}: shards {fused[leaf]} have different layer_quant_config entries")
        return hits[0] if hits else None
    for pattern, cfg in layer_cfg.items():
        if (name in pattern) if "*" not in pattern else fnmatch.fnmatch(name, pattern):
            return cfg
    return None


def _quark_matched(name: str, q: Mapping[str, Any], fused: Mapping[str, list[str]]) -> Any:
    layer_cfg = q.get("layer_quant_config") or {}
    fallback = q.get("global_quant_config")  # layer_type_quant_config: keyed by class objects in vLLM
    leaf = name.split(".")[-1]
    if leaf in fused:
        cfgs = []
        for s in fused[leaf]:
            shard = name.replace(leaf, s)
            c = fallback if shard == name else _layer_cfg_by_name(shard, layer_cfg, fused)
            cfgs.append(fallback if c is None else c)
        if any(c != cfgs[0] for c in cfgs):
            raise ResolveError(f"{name}: shards {fused[leaf]} resolve to different Quark configs")
        return cfgs[0]
    c = _layer_cfg_by_name(name, layer_cfg, fused)
    return fallback if c is None else c


def _quark_prepared(q: Mapping[str, Any], pmap: Mapping[str, str]) -> dict[str, Any]:
    """The Quark config as vLLM holds it when layers are built: ``from_config`` clears the
    ``output_tensors`` of the kv_cache_group entries (and of ``*q_proj``), then the model's mapper
    renames ``exclude`` entries and ``layer_quant_config`` keys."""
    groups = list((q.get("export") or {}).get("kv_cache_group") or [])
    layer_cfg: dict[str, Any] = {}
    for key, cfg in (q.get("layer_quant_config") or {}).items():
        cfg = copy.deepcopy(cfg)
        if isinstance(cfg, dict) and groups and (any(fnmatch.fnmatchcase(key, g) for g in groups) or key == "*q_proj"):
            cfg["output_tensors"] = None
        layer_cfg[_map_name(key, pmap)] = cfg
    return {**q, "layer_quant_config": layer_cfg, "exclude": [_map_name(t, pmap) for t in q.get("exclude") or []]}


def _quark(q: Mapping[str, Any], name: str, fused: Mapping[str, list[str]], pmap: Mapping[str, str]) -> str:
    cls = layer_class(name)
    if cls == "ParallelLMHead":
        return "bf16"
    q = _quark_prepared(q, pmap)
    if _quark_excluded(name, q["exclude"], fused, experts=cls == "RoutedExperts"):
        return "bf16"
    cfg = _quark_matched(name, q, fused)
    if not isinstance(cfg, dict):
        raise ResolveError(f"{name}: no Quark config applies")
    if cfg.get("output_tensors") or cfg.get("bias"):
        raise ResolveError(f"{name}: Quark output_tensors / bias quantization is not supported by vLLM")
    return _quark_precision(cfg.get("weight"), cfg.get("input_tensors"), name)


def _quark_precision(weight: Any, inputs: Any, name: str) -> str:
    if isinstance(weight, list) and len(weight) == 1:
        weight = weight[0]
    if isinstance(inputs, list) and len(inputs) == 1:
        inputs = inputs[0]
    if isinstance(weight, list):
        ok = (len(weight) == 2 and isinstance(inputs, list) and len(inputs) == 2
              and weight[0].get("dtype") == "fp4" and weight[0].get("qscheme") == "per_group"
              and weight[0].get("group_size") == 16 and not weight[0].get("is_dynamic")
              and inputs[0].get("dtype") == "fp4" and inputs[0].get("group_size") == 16 and inputs[0].get("is_dynamic")
              and weight[1].get("dtype") == "fp8_e4m3" and weight[1].get("qscheme") == "per_tensor"
              and inputs[1].get("dtype") == "fp8_e4m3" and inputs[1].get("qscheme") == "per_tensor")
        if not ok:
            raise ResolveError(f"{name}: multi-entry Quark config that is not NVFP4")
        return "nvfp4"
    if not isinstance(weight, dict):
        raise ResolveError(f"{name}: Quark config without a weight scheme")
    dtype, qscheme = weight.get("dtype"), weight.get("qscheme")
    if dtype == "fp8_e4m3":
        if not isinstance(inputs, dict) or inputs.get("dtype") != "fp8_e4m3" or weight.get("is_dynamic"):
            raise ResolveError(f"{name}: FP8 weights need FP8 input_tensors in vLLM's Quark schemes")
        if qscheme == "per_tensor":
            if inputs.get("is_dynamic"):
                return "fp8-tensor/dynamic"
            return "fp8-tensor" if inputs.get("qscheme") == "per_tensor" else f"fp8-tensor/{inputs.get('qscheme')}"
        if qscheme == "per_block" and list(weight.get("block_size") or []) == [128, 128] and weight.get("symmetric") is True:
            return "fp8-block"
        return f"other:fp8/{qscheme}"
    if dtype == "fp4" and qscheme == "per_group" and weight.get("group_size") == 32 and not weight.get("is_dynamic"):
        if inputs is not None and not inputs.get("is_dynamic"):
            raise ResolveError(f"{name}: Quark OCP MX with static input scales is not supported")
        return "mxfp4"
    return f"other:{dtype}/{qscheme}"


# KV cache --------------------------------------------------------------------------------------
def kv_cache_declared(config: Mapping[str, Any]) -> str | None:
    """"fp8" when the config declares an FP8 KV cache vLLM accepts, else None."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    if q.get("quant_method") == "compressed-tensors":
        s = q.get("kv_cache_scheme")
        if not isinstance(s, dict):
            return None
        if s.get("type") != "float" or s.get("num_bits") != 8 or s.get("strategy") not in ("tensor", "attn_head") \
                or not s.get("symmetric"):
            raise ResolveError(f"kv_cache_scheme vLLM does not support: {s}")
        return "fp8"
    if q.get("quant_method") == "quark":
        groups = list((q.get("export") or {}).get("kv_cache_group") or [])
        if not groups:
            return None
        layer_cfg = q.get("layer_quant_config") or {}
        matched = [c for k, c in layer_cfg.items() if any(fnmatch.fnmatchcase(k, g) for g in groups)]
        if not matched:
            raise ResolveError(f"kv_cache_group {groups} matches no layer_quant_config entry")
        outs = [c.get("output_tensors") for c in matched]
        if any(o != outs[0] for o in outs) or not isinstance(outs[0], dict):
            raise ResolveError(f"kv_cache_group entries disagree or are empty: {outs}")
        if outs[0].get("dtype") != "fp8_e4m3" or outs[0].get("qscheme") != "per_tensor":
            raise ResolveError(f"Quark KV cache config vLLM does not support: {outs[0]}")
        return "fp8"
    return None


def kv_cache(config: Mapping[str, Any], attention_layer: str, *, fused: Mapping[str, list[str]] | None = None,
             prefix_map: Mapping[str, str] | None = None, mla: bool = False) -> str | None:
    """"fp8" when the runtime quantizes ``attention_layer``'s KV cache from the config, else None.

    Both configs attach their KV-cache method only to ``Attention`` layers: DeepSeek's
    ``MLAAttention`` is not one (``mla``), and a Quark ``exclude`` entry matching the Attention
    layer's prefix leaves it without one."""
    declared = kv_cache_declared(config)
    if declared is None or mla:
        return None
    q = config.get("quantization_config") or {}
    if q.get("quant_method") == "quark":
        exclude = [_map_name(t, dict(prefix_map or {})) for t in q.get("exclude") or []]
        if _ignored(attention_layer, exclude, dict(fused or {})):
            return None
    return declared
