"""``deepseek-v4-mxfp4``: DeepSeek-V4's native checkpoint (docs/FORMATS.md §10).

Routed experts ``layers.N.ffn.experts.E.w{1,2,3}.weight`` (and the MTP layers' ``mtp.N.ffn.experts...``)
hold MXFP4 under other names and dtypes: packed E2M1 as I8 ``[N, K/2]`` (low nibble first, as every
MXFP4 layout) and the E8M0 block scales as ``.scale`` F8_E8M0 ``[N, K/32]``. The other Linears are FP8
with E8M0 128x128 block scales (also ``.scale``); ``config.json`` says ``quant_method: fp8``.
"""

from __future__ import annotations

import re

from mxfp4conv.layouts.base import Plan, config_facts
from mxfp4conv.layouts.split import DEEPSEEK_V4_MXFP4, plan_split_layout, read_split_unit
from mxfp4conv.model.canonical import Canonical, UnitSpec
from mxfp4conv.model.precision import Declared
from mxfp4conv.sources.checkpoint import Checkpoint

NAME = "deepseek-v4-mxfp4"
CONFIG_FILES: tuple[str, ...] = ()
READS_EXPERT_GROUPS = True  # split MoE units read a group of experts at a time (split.expert_group)
ROLES = DEEPSEEK_V4_MXFP4
_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def detect(ckpt: Checkpoint) -> list[str] | None:
    t = ckpt.tensors
    if any(n.endswith(".weight_scale_2") for n in t):
        return None  # NVIDIA's NVFP4 release of V4 keeps MXFP4 only in its MTP experts: modelopt-nvfp4
    marker = next((n for n, r in t.items() if r.dtype == "I8" and _EXPERT.search(n)
                   and t.get(n[: -len("weight")] + "scale", r).dtype == "F8_E8M0"), None)
    if marker is None:
        return None
    q = ckpt.config.get("quantization_config")
    ev = ["config.json quantization_config.quant_method = fp8"] if isinstance(q, dict) and q.get("quant_method") == "fp8" else []
    return [*ev, f"tensor {marker} (I8 E2M1 + F8_E8M0 scale)"]


def declared(ckpt: Checkpoint) -> Declared:
    return Declared()  # the fp8 config names no modules: the tensors say which Linears are FP8


def plan(ckpt: Checkpoint) -> Plan:
    facts = config_facts(ckpt.config, scheme="w4a16", quant="mxfp4", expert_names=("w1", "w3", "w2"))
    return plan_split_layout(ckpt, NAME, ROLES, facts)


def read(ckpt: Checkpoint, spec: UnitSpec, *, device: str | None = None) -> Canonical:
    return read_split_unit(ckpt, spec, ROLES, device=device)
