"""``ct-nvfp4``: compressed-tensors ``nvfp4-pack-quantized`` (FORMATS.md §1).

``weight_global_scale`` is a divisor (= 1 / ModelOpt's weight_scale_2); gate and up keep their
own values (canonical ``global_rows``).
"""

from __future__ import annotations

from mxfp4conv.layouts import ct_common
from mxfp4conv.layouts.base import Plan
from mxfp4conv.layouts.split import LinearRoles, plan_split_layout, read_split_unit
from mxfp4conv.model.canonical import Canonical, UnitSpec
from mxfp4conv.sources.checkpoint import Checkpoint

NAME = "ct-nvfp4"
CONFIG_FILES: tuple[str, ...] = ()
READS_EXPERT_GROUPS = True  # split MoE units read a group of experts at a time (split.expert_group)
FORMAT = "nvfp4-pack-quantized"
ROLES = LinearRoles(packed="weight_packed", scale="weight_scale", scale_dtype="F8_E4M3", group=16, quant="nvfp4",
                    global_scale="weight_global_scale", global_is_divisor=True, input_scale="input_global_scale")

declared = ct_common.declared


def detect(ckpt: Checkpoint) -> list[str] | None:
    ev = ct_common.config_evidence(ckpt, FORMAT)
    marker = next((n for n in ckpt.tensors if n.endswith(".weight_global_scale")), None)
    if marker:
        ev.append(f"tensor {marker}")
    return ev or None


def plan(ckpt: Checkpoint) -> Plan:
    return plan_split_layout(ckpt, NAME, ROLES, ct_common.facts(ckpt, "nvfp4"))


def read(ckpt: Checkpoint, spec: UnitSpec, *, device: str | None = None) -> Canonical:
    return read_split_unit(ckpt, spec, ROLES, device=device)

