"""How the writers describe the layers they do not convert: FP8 Linears, unquantized Linears, the KV cache.

The plan's precision model (``mxfp4conv.model.precision``) says what each layer is; this module turns it into
what a runtime config needs (docs/FORMATS.md §9): the entries of unquantized modules (the source's own
wildcards kept as ``re:`` patterns, and every module by exact name), the FP8 modules grouped by scheme,
the runtime's Attention layers, and the reason a target cannot express a source at all (checked before
any work).
"""

from __future__ import annotations

from collections.abc import Iterable

from mxfp4conv.layouts.base import natural_key
from mxfp4conv.model.precision import Fp8Linear, expert_container, matches, runtime_pattern
from mxfp4conv.targets.base import WriterContext, split_names

__all__ = ["attention_layers", "fp8_groups", "precision_refusal", "unquantized_entries"]


def _fp8_label(lin: Fp8Linear) -> str:
    return f"{lin.kind} ({lin.scale} {lin.scale_dtype})"


def precision_refusal(ctx: WriterContext, target: str, *, fp8_block: bool, e8m0_block: bool = False,
                      fp8: bool = True) -> str | None:
    """Why ``target`` cannot describe every layer of the source, naming the first layer, or None.

    ``fp8``: the target has a per-tensor FP8 scheme; ``fp8_block``: a 128x128 block FP8 scheme;
    ``e8m0_block``: block scales stored as E8M0 (DeepSeek-V4) load as they are.
    """
    p = ctx.precision
    for lin in p.fp8.values():
        if not fp8:
            return (f"{lin.module}: {_fp8_label(lin)} has no {target} scheme (the layout holds FP4 and BF16 only); "
                    "--to quark or --to ct describe FP8 layers")
        if lin.kind == "fp8-block" and not fp8_block:
            return f"{lin.module}: {_fp8_label(lin)} 128x128 block FP8 has no {target} scheme; --to quark describes it"
        if lin.scale_dtype == "F8_E8M0" and not e8m0_block:
            return (f"{lin.module}: FP8 with E8M0 block scales ({lin.scale}) has no {target} scheme (its FP8_BLOCK "
                    "scales are float tensors); --to quark carries them as they are (per_block FP8, E8M0 scales)")
    if p.foreign_fp4:
        return (f"{p.foreign_fp4[0]}: FP4 weights in a naming the {ctx.layout} layout does not convert "
                "(they cannot be carried as unquantized)")
    return None


def unquantized_entries(ctx: WriterContext, *, keep_matching: Iterable[str] = ()) -> list[str]:
    """Exact names and ``re:`` patterns that leave exactly the unquantized Linears unquantized.

    The source's own exclusions come first, as patterns (a wildcard stays a wildcard, so the runtime's
    renamed MTP modules still match); then every unquantized Linear by exact name as well, because vLLM
    maps exact names to its own module names (GPT-OSS ``self_attn`` -> ``attn``) but not patterns; a
    module of an MTP layer also gets a pattern that accepts its ``mtp_block`` name. A source pattern
    that would also cover an FP4 or FP8 module, or a name in ``keep_matching`` (layers the entries must
    not reach, such as the Attention layers of an FP8 KV cache in Quark), is dropped: it would
    mis-declare that layer.
    """
    p = ctx.precision
    n = ctx.facts.num_layers
    quantized = [u.key for u in ctx.units if u.kind == "dense"] + list(p.fp8) + list(keep_matching)
    for u in ctx.units:  # the runtime checks expert 0's projections of a MoE layer (vLLM get_moe_method)
        if u.kind == "moe":
            quantized += [f"{u.key}.0.{proj}" for proj in {*split_names(ctx), *ctx.facts.expert_names}]
    out = [pat for pat in p.unquantized_patterns if not any(matches(pat, m) for m in quantized)]
    # Unquantized routed experts (an MTP layer kept BF16): the container and a pattern for its projections,
    # since vLLM asks about the FusedMoE layer itself (Quark) or about expert 0's projections (compressed-tensors).
    fp4_moe = {u.key for u in ctx.units if u.kind == "moe"}
    containers = sorted({c for m in p.bf16 if (c := expert_container(m)) and c not in fp4_moe
                         and not any(f.startswith(c + ".") for f in p.fp8)}, key=natural_key)
    for c in containers:
        out += [c, runtime_pattern(c, n, children=True)]
    for m in p.bf16:
        if expert_container(m) not in containers:
            out += [m] if runtime_pattern(m, n) == m else [m, runtime_pattern(m, n)]
    return list(dict.fromkeys(out))


_ATTN_PROJ = ("k_proj", "v_proj", "o_proj", "kv_b_proj", "kv_a_proj_with_mqa", "qkv_proj", "wkv", "wo_a")


def attention_layers(ctx: WriterContext) -> list[str]:
    """vLLM's Attention layer names (``<attention module>.attn``), derived from the attention projections."""
    mods = [*ctx.precision.bf16, *ctx.precision.fp8, *(u.key for u in ctx.units if u.kind == "dense")]
    return sorted({m.rsplit(".", 1)[0] + ".attn" for m in mods if m.rsplit(".", 1)[-1] in _ATTN_PROJ})


def fp8_groups(ctx: WriterContext) -> dict[tuple[str, bool], list[str]]:
    """FP8 modules by (kind, has a static input scale), each as the name or pattern the runtime matches."""
    out: dict[tuple[str, bool], list[str]] = {}
    for lin in ctx.precision.fp8.values():
        out.setdefault((lin.kind, lin.input_scale), []).append(runtime_pattern(lin.module, ctx.facts.num_layers))
    return out
