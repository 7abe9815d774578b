"""``quark-mxfp4``: AMD Quark MXFP4 (docs/FORMATS.md §5), W4A16 or W4A4 (fp4 input tensors).

Per quantized Linear: ``weight`` uint8 [N, K/2] and ``weight_scale`` uint8 (E8M0) [N, K/32]: the bytes of
compressed-tensors MXFP4 under other names. Experts use the model's split names.
"""

from __future__ import annotations

from mxfp4conv.layouts import quark_common
from mxfp4conv.layouts.base import Plan, Problem, config_facts, expert_names
from mxfp4conv.layouts.split import LinearRoles, plan_split_layout, read_split_unit
from mxfp4conv.model.canonical import Canonical, UnitSpec
from mxfp4conv.sources.checkpoint import Checkpoint

NAME = "quark-mxfp4"
CONFIG_FILES: tuple[str, ...] = ()
READS_EXPERT_GROUPS = True  # split MoE units read a group of experts at a time (split.expert_group)
ROLES = LinearRoles(packed="weight", scale="weight_scale", scale_dtype="U8", group=32, quant="mxfp4")

declared = quark_common.declared


def detect(ckpt: Checkpoint) -> list[str] | None:
    ev = quark_common.config_evidence(ckpt, "mxfp4")
    t = ckpt.tensors
    marker = next((n for n, r in t.items() if n.endswith(".weight_scale") and r.dtype == "U8"
                   and t.get(n[: -len("_scale")], r).dtype == "U8"), None)
    if marker and (ev or not any(n.endswith(".weight_packed") for n in t)):
        ev.append(f"tensor {marker}")
    return ev or None


def plan(ckpt: Checkpoint) -> Plan:
    acts = quark_common.input_dtype(ckpt)
    facts = config_facts(ckpt.config, scheme="w4a4" if acts == "fp4" else "w4a16", quant="mxfp4",
                         expert_names=expert_names(ckpt), ignore=declared(ckpt).unquantized)
    p = plan_split_layout(ckpt, NAME, ROLES, facts)
    if acts not in (None, "fp4"):
        p.problems.append(Problem("", str(ckpt.root / "config.json"), f"input tensors quantized as {acts}: "
                                  "only weight-only and fp4 activations are read"))
    return p


def read(ckpt: Checkpoint, spec: UnitSpec, *, device: str | None = None) -> Canonical:
    return read_split_unit(ckpt, spec, ROLES, device=device)
