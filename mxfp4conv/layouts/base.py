"""What every input layout provides: the ``Layout`` protocol, the ``Plan`` it makes, model facts.

A layout turns a ``Checkpoint`` (headers only) into a ``Plan``: model facts, units of work
(``UnitSpec``) and the problems found, then reads one unit at a time into the canonical model.
The machinery the split-expert layouts share is in ``layouts/split.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    pass

from mxfp4conv.model.canonical import Canonical, ModelFacts, UnitSpec
from mxfp4conv.model.precision import Declared, PrecisionModel
from mxfp4conv.sources.checkpoint import Checkpoint

__all__ = ["EXPERT_RE", "Layout", "Plan", "Problem", "config_facts", "expert_names", "natural_key", "text_config"]


@dataclass(frozen=True)
class Problem:
    tensor: str
    file: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"tensor": self.tensor, "file": self.file, "message": self.message}


@dataclass
class Plan:
    layout: str
    facts: ModelFacts
    units: list[UnitSpec]
    problems: list[Problem] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    precision: PrecisionModel = field(default_factory=PrecisionModel)


class Layout(Protocol):
    """An input layout: a module of ``mxfp4conv.layouts`` registered in ``LAYOUTS``."""

    NAME: str
    CONFIG_FILES: tuple[str, ...]  # quantization config files it reads beside config.json
    READS_EXPERT_GROUPS: bool  # ``read`` takes a group of a split MoE unit's experts (``split.expert_group``)

    def detect(self, ckpt: Checkpoint) -> list[str] | None:
        """Evidence (config keys, tensor names) if the checkpoint is in this layout, else None."""

    def plan(self, ckpt: Checkpoint) -> Plan:
        """Facts, units and problems, from headers alone."""

    def read(self, ckpt: Checkpoint, spec: UnitSpec, *, device: str | None = None) -> Canonical:
        """Load one unit into the canonical model."""

    def declared(self, ckpt: Checkpoint) -> Declared:
        """What the source's quantization config says about its layers (exclusions, listed modules, KV cache)."""


def text_config(config: dict[str, object]) -> dict[str, object]:
    """The language model's config (multimodal configs nest it under text_config)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and "hidden_size" in inner else config


def _int(cfg: dict[str, object], *keys: str) -> int:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def config_facts(config: dict[str, object], *, scheme: str, quant: str, expert_names: tuple[str, str, str],
                 ignore: tuple[str, ...] = ()) -> ModelFacts:
    cfg = text_config(config)
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    model_type = str(config.get("model_type", ""))
    return ModelFacts(
        model_type=model_type,
        architecture=arch,
        scheme=scheme,
        source_quant=quant,  # type: ignore[arg-type]
        num_layers=_int(cfg, "num_hidden_layers", "n_layer"),
        num_experts=_int(cfg, "num_local_experts", "num_experts", "n_routed_experts"),
        hidden_size=_int(cfg, "hidden_size"),
        intermediate_size=_int(cfg, "moe_intermediate_size", "intermediate_size"),
        expert_names=expert_names,
        activation="swigluoai" if model_type == "gpt_oss" else "silu",
        ignore=ignore,
    )


def expert_names(ckpt: Checkpoint) -> tuple[str, str, str]:
    """The source's (gate, up, down) expert projection names: Mixtral-style ``w1/w3/w2`` or ``*_proj``."""
    for n in ckpt.tensors:
        m = EXPERT_RE.match(n)
        if m and m["proj"] in ("w1", "w2", "w3"):
            return ("w1", "w3", "w2")
    return ("gate_proj", "up_proj", "down_proj")


# Per-expert split names: "<prefix>.experts.<e>.<proj>.<suffix>"
EXPERT_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<suffix>[A-Za-z0-9_]+)$")


def natural_key(name: str) -> list[object]:
    """Sort key that orders ``layers.10`` after ``layers.9``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
