"""``quark-nvfp4``: AMD Quark NVFP4 (docs/FORMATS.md §4.5, §5), requantized to MXFP4 like the other NVFP4 layouts.

Per quantized Linear: ``weight`` uint8 [N, K/2], ``weight_scale`` float8_e4m3fn [N, K/16],
``weight_scale_2`` scalar (a multiplier, as ModelOpt's) and ``input_scale_2`` scalar (the static global
scale of the fp4 activations: vLLM serves Quark NVFP4 as W4A4 only).
"""

from __future__ import annotations

from mxfp4conv.layouts import quark_common
from mxfp4conv.layouts.base import Plan, config_facts, expert_names
from mxfp4conv.layouts.split import LinearRoles, plan_split_layout, read_split_unit
from mxfp4conv.model.canonical import Canonical, UnitSpec
from mxfp4conv.sources.checkpoint import Checkpoint

NAME = "quark-nvfp4"
CONFIG_FILES: tuple[str, ...] = ()
READS_EXPERT_GROUPS = True  # split MoE units read a group of experts at a time (split.expert_group)
ROLES = LinearRoles(packed="weight", scale="weight_scale", scale_dtype="F8_E4M3", group=16, quant="nvfp4",
                    global_scale="weight_scale_2", global_is_divisor=False, input_scale="input_scale_2",
                    global_dtypes=("F32", "BF16"))

declared = quark_common.declared


def detect(ckpt: Checkpoint) -> list[str] | None:
    ev = quark_common.config_evidence(ckpt, "nvfp4")
    marker = next((n for n in ckpt.tensors if n.endswith(".input_scale_2")), None)
    if marker:
        ev.append(f"tensor {marker}")
    return ev or None


def plan(ckpt: Checkpoint) -> Plan:
    w4a4 = quark_common.input_dtype(ckpt) == "fp4" or any(n.endswith(".input_scale_2") for n in ckpt.tensors)
    facts = config_facts(ckpt.config, scheme="w4a4" if w4a4 else "w4a16", quant="nvfp4",
                         expert_names=expert_names(ckpt), ignore=declared(ckpt).unquantized)
    return plan_split_layout(ckpt, NAME, ROLES, facts)


def read(ckpt: Checkpoint, spec: UnitSpec, *, device: str | None = None) -> Canonical:
    return read_split_unit(ckpt, spec, ROLES, device=device)

