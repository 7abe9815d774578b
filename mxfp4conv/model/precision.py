"""Every layer's precision: what the tensors say, what the source config says, and where they disagree.

A checkpoint mixes precisions: FP4 experts (the units the layouts plan), FP8 Linears carried byte for
byte (per-tensor: ``weight`` F8_E4M3 + scalar ``weight_scale`` [+ scalar ``input_scale``]; 128x128
blocks: a 2-D scale spelled ``weight_scale_inv`` (DeepSeek), ``weight_scale`` (compressed-tensors
FP8_BLOCK) or ``scale`` F8_E8M0 (DeepSeek-V4)), unquantized Linears, and sometimes an FP8 KV cache.
Writers must describe every one of them in the target's own syntax (docs/FORMATS.md §9), so the
model is built here once, from headers alone, and cross-checked against the source's own config.

Patterns: every source syntax is normalised to the two forms compressed-tensors and Quark match
(vLLM ``is_equal_or_regex_match``): an exact module name, or ``re:<regex>`` applied with
``re.match``. fnmatch wildcards (ModelOpt ``exclude_modules``) become ``re:`` patterns so they keep
matching names the runtime renames (DeepSeek's MTP layer is ``model.layers.61.mtp_block.*`` in vLLM).

Pure: no torch, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from mxfp4conv.model.runtime_built import runtime_unquantized

__all__ = [
    "EMBEDDINGS",
    "Declared",
    "Fp8Linear",
    "Precision",
    "PrecisionModel",
    "build_precision",
    "ct_group_precision",
    "expert_container",
    "fnmatch_to_re",
    "matches",
    "mtp_runtime_name",
    "mtp_split",
    "quark_spec_precision",
    "runtime_pattern",
]

Precision = Literal["mxfp4", "nvfp4", "fp8-tensor", "fp8-block", "bf16"]
FP8_BLOCK = (128, 128)
# Embedding tables hold 2-D ``.weight`` tensors but are not Linear layers (only the last name part counts:
# ``vision_model.patch_embedding.linear`` IS a Linear).
EMBEDDINGS = frozenset({"embed_tokens", "embed", "wte", "wpe", "tok_embeddings", "word_embeddings", "embeddings",
                        "position_embeddings", "token_embedding", "position_embedding", "pos_embed"})
_FP8_SCALES = ("weight_scale_inv", "weight_scale", "scale")
_EXPERT_PROJ = re.compile(r"^(?P<container>.+\.experts)\.\d+\.[^.]+$")


@dataclass(frozen=True)
class Fp8Linear:
    """An FP8 Linear carried byte for byte: its weight, its scale tensor and whether it has an input scale."""

    module: str
    kind: Literal["fp8-tensor", "fp8-block"]
    scale: str  # suffix of the weight's scale tensor: "weight_scale", "weight_scale_inv" or "scale"
    scale_dtype: str  # safetensors dtype of that scale: "F32", "BF16" or "F8_E8M0"
    input_scale: bool = False  # a static per-tensor activation scale (``input_scale``) is present


@dataclass(frozen=True)
class Declared:
    """What a source config says about its layers, normalised.

    ``unquantized``: patterns (exact names, fnmatch wildcards or ``re:``) of modules left unquantized.
    ``listed``: module pattern -> precision, for configs that name modules per scheme (ModelOpt
    ``quantized_layers``, compressed-tensors targets by name, Quark ``layer_quant_config``).
    ``exhaustive``: a module no entry lists is unquantized (ModelOpt ``MIXED_PRECISION``); otherwise it
    falls under the config's main scheme.
    ``main``: that scheme, where the config gives one to every Linear it does not exclude or list
    (a compressed-tensors group targeting ``Linear``, ModelOpt ``quant_algo: NVFP4``, Quark's
    ``global_quant_config``); None where the config's reach is not known module by module.
    ``kv_cache``: "fp8" when the config quantizes the KV cache.
    ``method``: the vLLM quantization method the source loads as (``modelopt_fp4``), where an exemption
    of the runtime depends on it (``runtime_built.EXEMPTIONS``).
    """

    unquantized: tuple[str, ...] = ()
    listed: Mapping[str, Precision] = field(default_factory=dict)
    exhaustive: bool = False
    main: Precision | None = None
    kv_cache: str | None = None
    source: str = "config.json"  # the file the declaration came from (for problems)
    method: str | None = None


@dataclass(frozen=True)
class PrecisionModel:
    """The precision of every Linear-like module that is not an FP4 unit, and the KV cache."""

    fp8: Mapping[str, Fp8Linear] = field(default_factory=dict)
    bf16: tuple[str, ...] = ()  # unquantized Linear-like modules (2-D ``.weight``), sorted
    kv_cache: str | None = None
    unquantized_patterns: tuple[str, ...] = ()  # the source's own exclusions, normalised, in order
    foreign_fp4: tuple[str, ...] = ()  # FP4 modules in a naming the layout does not convert
    inferred: bool = False  # the layout was inferred from tensors: the source has no quantization config

    def counts(self, fp4_experts: int, fp4_dense: int) -> dict[str, int]:
        """Linear modules per precision; FP4 counts include FP4 modules the layout does not convert."""
        kinds = [f.kind for f in self.fp8.values()]
        foreign_experts = sum(1 for m in self.foreign_fp4 if expert_container(m))
        fp4_experts += foreign_experts
        fp4_dense += len(self.foreign_fp4) - foreign_experts
        return {"fp4_experts": fp4_experts, "fp4_dense": fp4_dense, "fp8_tensor": kinds.count("fp8-tensor"),
                "fp8_block": kinds.count("fp8-block"), "bf16": len(self.bf16)}


def expert_container(module: str) -> str | None:
    """``model.layers.3.mlp.experts`` for ``model.layers.3.mlp.experts.0.gate_proj``; None for other modules."""
    m = _EXPERT_PROJ.match(module)
    return m["container"] if m else None


def ct_group_precision(group: Mapping[str, Any]) -> Precision | None:
    """A compressed-tensors config group's weight scheme."""
    w = group.get("weights")
    if not isinstance(w, dict) or w.get("type") != "float":
        return None
    if w.get("num_bits") == 4:
        return "mxfp4" if w.get("group_size") == 32 else "nvfp4" if w.get("group_size") == 16 else None
    if w.get("num_bits") == 8:
        strategy = w.get("strategy")
        return "fp8-block" if strategy == "block" else "fp8-tensor" if strategy == "tensor" else None
    return None


def quark_spec_precision(cfg: Any) -> Precision | None:
    """A Quark layer config's weight scheme (a spec, or a list of specs for two-level schemes)."""
    w = cfg.get("weight") if isinstance(cfg, dict) else None
    w = w[0] if isinstance(w, list) and w else w
    if not isinstance(w, dict):
        return None
    if w.get("dtype") == "fp4" and w.get("qscheme") == "per_group":
        return "mxfp4" if w.get("group_size") == 32 else "nvfp4" if w.get("group_size") == 16 else None
    if w.get("dtype") == "fp8_e4m3" and w.get("qscheme") == "per_tensor":
        return "fp8-tensor"
    if w.get("dtype") == "fp8_e4m3" and w.get("qscheme") == "per_block" and list(w.get("block_size") or ()) == [128, 128]:
        return "fp8-block"
    return None


def fnmatch_to_re(pattern: str, *, children: bool = False) -> str:
    """An fnmatch wildcard (``*``, ``?``) as an anchored ``re:`` pattern; ``re:`` patterns pass through, and
    plain names too unless ``children`` (the pattern names a module and everything under it, as GPT-OSS's
    ``modules_to_not_convert`` does)."""
    if pattern.startswith("re:") or not (children or any(c in pattern for c in "*?")):
        return pattern
    out = [".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern]
    return "re:" + "".join(out) + (r"(\..*)?$" if children else "$")


def matches(pattern: str, name: str) -> bool:
    """vLLM's rule for compressed-tensors ``ignore`` / targets and Quark ``exclude``: exact, or ``re:`` + re.match."""
    if pattern.startswith("re:"):
        try:
            return re.match(pattern[3:], name) is not None
        except re.error:
            return False
    return pattern == name


_LAYER = re.compile(r"^(?P<head>(?:.*\.)?layers\.)(?P<idx>\d+)\.(?P<rest>.+)$")


def runtime_pattern(module: str, num_layers: int, *, children: bool = False) -> str:
    """How an output config names ``module`` so the runtime's name still matches it.

    Layers past ``num_hidden_layers`` are multi-token-prediction layers, whose decoder block vLLM loads as
    ``layers.N.mtp_block.*`` (deepseek_mtp.py, glm4_moe_mtp.py): they get a pattern that accepts both names.
    ``children``: the module and everything under it (a MoE experts container and its projections).
    """
    m = _LAYER.match(module)
    tail = r"(\..*)?$" if children else "$"
    if not m or not num_layers or int(m["idx"]) < num_layers:
        return "re:" + re.escape(module) + tail if children else module
    return "re:" + re.escape(f"{m['head']}{m['idx']}.") + r"(mtp_block\.)?" + re.escape(m["rest"]) + tail


def mtp_split(module: str, num_layers: int) -> tuple[str, str] | None:
    """(``...layers.N.``, rest) for a module of a layer past ``num_hidden_layers`` (an MTP layer), else None."""
    m = _LAYER.match(module)
    if not m or not num_layers or int(m["idx"]) < num_layers:
        return None
    return f"{m['head']}{m['idx']}.", m["rest"]


def mtp_runtime_name(module: str, num_layers: int) -> str | None:
    """vLLM's name for a module of an MTP layer (``layers.N.mtp_block.<rest>``); None below num_hidden_layers."""
    parts = mtp_split(module, num_layers)
    return None if parts is None else f"{parts[0]}mtp_block.{parts[1]}"


def _scale_kind(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> Literal["fp8-tensor", "fp8-block"] | None:
    if len(scale_shape) == 0 or (len(scale_shape) == 1 and scale_shape[0] == 1):
        return "fp8-tensor"
    n, k = weight_shape
    bn, bk = FP8_BLOCK
    if list(scale_shape) == [-(-n // bn), -(-k // bk)]:
        return "fp8-block"
    return None


def build_precision(
    linears: Mapping[str, tuple[str, tuple[int, ...]]],
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    fp4_modules: Iterable[str],
    declared: Declared,
    *,
    inferred: bool = False,
    architecture: str = "",
) -> tuple[PrecisionModel, list[tuple[str, str]]]:
    """The precision model of the non-FP4 modules, and the problems found as (module, message).

    ``linears``: module -> (dtype, shape) of every passthrough 2-D ``<module>.weight``;
    ``tensors``: every passthrough tensor name -> (dtype, shape) (for the scale partners);
    ``fp4_modules``: modules the layout converts (dense FP4 modules and every expert projection);
    ``architecture``: config.json's ``architectures[0]``, which picks the runtime's model code.
    """
    problems: list[tuple[str, str]] = []
    fp8: dict[str, Fp8Linear] = {}
    bf16: list[str] = []
    foreign: list[str] = []
    for module, (dtype, shape) in linears.items():
        if module.rsplit(".", 1)[-1] in EMBEDDINGS:
            continue
        if dtype == "F8_E4M3":
            got = _fp8_linear(module, shape, tensors, problems)
            if got is not None:
                fp8[module] = got
            continue
        if dtype in ("U8", "I8"):
            scale = tensors.get(f"{module}.scale") or tensors.get(f"{module}.weight_scale")
            if scale is not None and scale[0] in ("F8_E8M0", "U8", "F8_E4M3") and len(scale[1]) == 2:
                foreign.append(module)  # packed FP4 the layout does not read: never carry it as "unquantized"
                continue
        bf16.append(module)
    kv = declared.kv_cache
    model = PrecisionModel(fp8=dict(sorted(fp8.items())), bf16=tuple(sorted(bf16)), kv_cache=kv,
                           unquantized_patterns=tuple(fnmatch_to_re(p) for p in declared.unquantized),
                           foreign_fp4=tuple(sorted(foreign)), inferred=inferred)
    problems += _cross_check(model, list(fp4_modules), declared, architecture)
    return model, problems


def _fp8_linear(module: str, shape: tuple[int, ...], tensors: Mapping[str, tuple[str, tuple[int, ...]]],
                problems: list[tuple[str, str]]) -> Fp8Linear | None:
    for suffix in _FP8_SCALES:
        got = tensors.get(f"{module}.{suffix}")
        if got is None:
            continue
        dtype, sshape = got
        kind = _scale_kind(shape, sshape)
        if kind is None:
            problems.append((f"{module}.{suffix}", f"FP8 scale shape {list(sshape)} is neither per-tensor nor "
                             f"[{FP8_BLOCK[0]}x{FP8_BLOCK[1]}] blocks of weight {list(shape)}"))
            return None
        if dtype not in ("F32", "BF16", "F16", "F8_E8M0"):
            problems.append((f"{module}.{suffix}", f"FP8 scale dtype {dtype} is not a float scale"))
            return None
        inp = tensors.get(f"{module}.input_scale")
        return Fp8Linear(module, kind, suffix, dtype, inp is not None and _scale_kind(shape, inp[1]) == "fp8-tensor")
    problems.append((f"{module}.weight", "FP8 weight without a scale tensor (weight_scale, weight_scale_inv or scale)"))
    return None


class _Matcher:
    """Exact names by hash lookup, wildcard and ``re:`` patterns compiled once (checkpoints list thousands)."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.exact: set[str] = set()
        self.rx: list[re.Pattern[str]] = []
        for p in patterns:
            q = fnmatch_to_re(p)
            if q.startswith("re:"):
                try:
                    self.rx.append(re.compile(q[3:]))
                except re.error:
                    continue  # reported by the layout's own config check
            else:
                self.exact.add(q)

    def __call__(self, name: str) -> bool:
        return name in self.exact or any(r.match(name) for r in self.rx)


def _cross_check(model: PrecisionModel, fp4_modules: list[str], declared: Declared, architecture: str
                 ) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    where = declared.source
    unquantized = _Matcher(declared.unquantized)
    exact = {pat: prec for pat, prec in declared.listed.items() if not fnmatch_to_re(pat).startswith("re:")}
    listed = [(_Matcher([pat]), prec) for pat, prec in declared.listed.items() if pat not in exact]
    linears = {*model.fp8, *model.bf16, *fp4_modules}
    # An exact entry that names a module holding no weight of its own covers the Linears under it:
    # llm-compressor saves GraniteMoE's ignored ``block_sparse_moe.router`` while its Linear is ``router.layer``.
    parents = {p for p in declared.unquantized if not p.startswith("re:") and not any(c in p for c in "*?")
               and p not in linears}
    moe_blocks = {c.rsplit(".", 1)[0] for m in (*fp4_modules, *model.bf16, *model.fp8) if (c := expert_container(m))}

    def said(module: str) -> Precision | None:
        """What the config makes of ``module``: None when it does not say (no main scheme reaches it)."""
        if unquantized(module) or any(module.startswith(p + ".") for p in parents):
            return "bf16"
        if module in exact:
            return exact[module]
        container = expert_container(module)
        if container is not None and container in exact:  # ModelOpt lists a MoE layer's experts by their container (vLLM asks the FusedMoE prefix)
            return exact[container]
        got = next((prec for m, prec in listed if m(module)), None)
        if got is not None:
            return got
        if declared.exhaustive:
            return "bf16"
        # What the runtime builds decides: its model code keeps some modules out of the main scheme.
        built = runtime_unquantized(module, moe_blocks, architecture=architecture, method=declared.method)
        return None if built is not None else declared.main

    for module, lin in model.fp8.items():
        got = said(module)
        if got == "bf16":
            out.append((module, f"tensors are {lin.kind} but {where} declares the module unquantized"))
        elif got is not None and got != lin.kind:
            out.append((module, f"tensors are {lin.kind} but {where} declares {got}"))
    for module in model.bf16:
        got = said(module)
        if got not in (None, "bf16"):
            out.append((module, f"tensors are unquantized but {where} declares {got}"))
    for module in fp4_modules:
        got = said(module)
        if got in (None, "mxfp4", "nvfp4"):
            continue
        if got == "bf16" and not declared.listed and expert_container(module) is None:
            continue  # a dense FP4 module an exclusion covers: the plan's own ignore check names its entry
        out.append((module, f"tensors are FP4 but {where} declares {'the module unquantized' if got == 'bf16' else got}"))
    return out
