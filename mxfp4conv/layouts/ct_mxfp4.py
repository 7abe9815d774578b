"""``ct-mxfp4``: compressed-tensors ``mxfp4-pack-quantized`` (W4A16 and W4A4), FORMATS.md §1-2.

Split per-expert names (``experts.E.{gate,up,down}_proj`` or Mixtral's ``w1/w3/w2``) and the
transformers-v5 fused names (``experts.gate_up_proj_packed`` [E, 2I, H/2], gate rows first).
"""

from __future__ import annotations

from mxfp4conv.layouts import ct_common
from mxfp4conv.layouts.base import Plan, Problem
from mxfp4conv.layouts.split import LinearRoles, plan_split_layout, read_split_unit
from mxfp4conv.model.canonical import Canonical, FP4Weight, MoELayer, UnitSpec
from mxfp4conv.sources.checkpoint import Checkpoint

NAME = "ct-mxfp4"
CONFIG_FILES: tuple[str, ...] = ()
READS_EXPERT_GROUPS = True  # split MoE units read a group of experts at a time (split.expert_group)
FORMAT = "mxfp4-pack-quantized"
ROLES = LinearRoles(packed="weight_packed", scale="weight_scale", scale_dtype="U8", group=32, quant="mxfp4")
_FUSED = ("gate_up_proj_packed", "gate_up_proj_scale", "down_proj_packed", "down_proj_scale")

declared = ct_common.declared


def detect(ckpt: Checkpoint) -> list[str] | None:
    ev = ct_common.config_evidence(ckpt, FORMAT)
    marker = next((n for n, r in ckpt.tensors.items()
                   if (n.endswith(".weight_packed") and ckpt.tensors.get(n[:-7] + "_scale", r).dtype == "U8"
                       and n[:-14] + ".weight_global_scale" not in ckpt.tensors)
                   or n.endswith(".gate_up_proj_packed")), None)
    if marker:
        ev.append(f"tensor {marker}")
    return ev or None


def _fused(ckpt: Checkpoint, consumed: set[str], problems: list[Problem], units: list[UnitSpec]) -> None:
    t = ckpt.tensors
    for name in sorted(n for n in t if n.endswith(".gate_up_proj_packed")):
        prefix = name[: -len(".gate_up_proj_packed")]
        names = [f"{prefix}.{s}" for s in _FUSED]
        missing = [n for n in names if n not in t]
        file = ckpt.rel(t[name].file)
        if missing:
            problems.append(Problem(missing[0], file, f"missing partner tensor of {name}"))
            continue
        gu, gus, dn, dns = (t[n] for n in names)
        ok = (len(gu.shape) == 3 and len(dn.shape) == 3 and gu.shape[0] == dn.shape[0]
              and gu.shape[1] % 2 == 0 and list(gus.shape) == [gu.shape[0], gu.shape[1], gu.shape[2] * 2 // 32]
              and list(dns.shape) == [dn.shape[0], dn.shape[1], dn.shape[2] * 2 // 32]
              and dn.shape[1] == gu.shape[2] * 2 and dn.shape[2] * 2 == gu.shape[1] // 2
              and all(x.dtype == "U8" for x in (gu, gus, dn, dns)))
        if not ok:
            problems.append(Problem(name, file, f"fused expert shapes disagree: gate_up {list(gu.shape)}, "
                                    f"scale {list(gus.shape)}, down {list(dn.shape)}, scale {list(dns.shape)}"))
            continue
        bias = [f"{prefix}.gate_up_proj_bias", f"{prefix}.down_proj_bias"]
        has_bias = all(b in t for b in bias)
        srcs = names + (bias if has_bias else [])
        consumed.update(srcs)
        units.append(UnitSpec("moe", prefix, tuple(srcs), (gu.shape[0], gu.shape[2] * 2, gu.shape[1] // 2),
                              has_bias, {"fused": "1", **({"bias_dtype": t[bias[0]].dtype} if has_bias else {})}))


def plan(ckpt: Checkpoint) -> Plan:
    facts = ct_common.facts(ckpt, "mxfp4")
    return plan_split_layout(ckpt, NAME, ROLES, facts, fused=_fused)


def read(ckpt: Checkpoint, spec: UnitSpec, *, device: str | None = None) -> Canonical:
    """One unit in canonical form (fused transformers-v5 experts as stored; split names through the
    shared reader, which stacks them)."""
    if spec.kind == "moe" and spec.extra.get("fused"):
        t = ckpt.tensors
        gu, gus, dn, dns = (t[f"{spec.key}.{s}"].load() for s in _FUSED)
        b13 = t[f"{spec.key}.gate_up_proj_bias"].load() if spec.has_bias else None
        b2 = t[f"{spec.key}.down_proj_bias"].load() if spec.has_bias else None
        return MoELayer(spec.key, FP4Weight("mxfp4", gu, gus), FP4Weight("mxfp4", dn, dns), b13, b2)
    return read_split_unit(ckpt, spec, ROLES, device=device)
