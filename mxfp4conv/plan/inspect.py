"""``inspect``: what a checkpoint is, whether it is complete and consistent, what it converts to.

Header-only: never reads tensor data.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxfp4conv.layouts import Layout, Plan, Problem, detect_layout, is_config_evidence
from mxfp4conv.model.precision import build_precision
from mxfp4conv.sources.checkpoint import Checkpoint, open_checkpoint
from mxfp4conv.targets import WriterContext, refusals, valid_targets
from mxfp4conv.targets.base import TargetOptions

__all__ = ["SCHEMA_VERSION", "InspectReport", "analyze", "inspect_checkpoint", "writer_context"]

SCHEMA_VERSION = 1


@dataclass
class InspectReport:
    source: str
    layout: str
    evidence: list[str]
    plan: Plan
    tensors: int
    total_bytes: int
    files: list[str]
    targets: list[str]
    problems: list[Problem] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    hub: dict[str, Any] | None = None  # a repo read on the Hub: repo id, commit, files' sizes and sha256
    # not in the --json report: SRC's bytes come at a link's rate (a Hub repo read by range), so that
    # `convert --stream` converts it without a local copy
    at_link_rate: bool = False

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0

    def to_dict(self) -> dict[str, Any]:
        f = self.plan.facts
        kinds = [u.kind for u in self.plan.units]
        return {
            "schema_version": SCHEMA_VERSION,
            "source": self.source,
            "layout": self.layout,
            "evidence": self.evidence,
            "model_type": f.model_type,
            "architecture": f.architecture,
            "scheme": f.scheme,
            "quant": f.source_quant,
            "num_layers": f.num_layers,
            "num_moe_layers": kinds.count("moe"),
            "num_experts": f.num_experts,
            "hidden_size": f.hidden_size,
            "intermediate_size": f.intermediate_size,
            "num_dense_fp4_layers": kinds.count("dense"),
            "num_passthrough_tensors": kinds.count("passthrough"),
            "precision": self.plan.precision.counts(fp4_experts(self.plan), kinds.count("dense")),
            "kv_cache": self.plan.precision.kv_cache,
            "inferred_layout": self.plan.precision.inferred,
            "expert_names": list(f.expert_names),
            "ignore": list(f.ignore),
            "tensors": self.tensors,
            "total_bytes": self.total_bytes,
            "files": self.files,
            "problems": [p.to_dict() for p in self.problems],
            "targets": self.targets,
            "refused": self.refused,
            "hub": self.hub,
        }


def fp4_experts(plan: Plan) -> int:
    """Routed-expert projections held in FP4 (three per expert: gate, up, down)."""
    return sum(3 * u.dims[0] for u in plan.units if u.kind == "moe")


def writer_context(plan: Plan, ckpt: Checkpoint, options: TargetOptions | Mapping[str, str] | None = None) -> WriterContext:
    """The writer context of ``plan``; ``options`` typed, or in their string form (a manifest's)."""
    pt = {u.key: (ckpt.tensors[u.key].dtype, ckpt.tensors[u.key].shape) for u in plan.units if u.kind == "passthrough"}
    typed = options if isinstance(options, TargetOptions) else TargetOptions.parse(options or {})
    return WriterContext(plan.facts, plan.layout, plan.units, pt, typed, plan.precision, src_config=ckpt.config,
                         **ckpt.source.writer_facts(),
                         read_file=ckpt.read_extra)


def _fp4_modules(plan: Plan) -> list[str]:
    out = []
    for u in plan.units:
        if u.kind == "dense":
            out.append(u.key)
        elif u.kind == "moe" and not u.extra.get("fused") and "gate" in u.extra:
            out += [f"{u.key}.{e}.{u.extra[r]}" for e in range(u.dims[0]) for r in ("gate", "up", "down")]
    return out


def _precision(ckpt: Checkpoint, layout: Layout, plan: Plan, evidence: list[str]) -> list[Problem]:
    """The plan's precision model (every non-FP4 Linear, the KV cache), cross-checked with the config."""
    pt = {u.key: (ckpt.tensors[u.key].dtype, ckpt.tensors[u.key].shape) for u in plan.units if u.kind == "passthrough"}
    linears = {n[: -len(".weight")]: v for n, v in pt.items() if n.endswith(".weight") and len(v[1]) == 2}
    declared = layout.declared(ckpt)
    inferred = not any(is_config_evidence(e) for e in evidence)
    plan.precision, found = build_precision(linears, pt, _fp4_modules(plan), declared, inferred=inferred,
                                           architecture=plan.facts.architecture)
    where = str(ckpt.root / declared.source)
    return [Problem(module, where, message) for module, message in found]


def _ignore_problems(ckpt: Checkpoint, plan: Plan) -> list[Problem]:
    cfg = str(ckpt.root / "config.json")
    out = []
    for pat in plan.facts.ignore:
        if pat.startswith("re:"):
            try:
                re.compile(pat[3:])
            except re.error as exc:
                out.append(Problem(pat, cfg, f"ignore entry is not a valid regular expression ({exc})"))
    # A module the source says it left unquantized must not hold FP4 tensors.
    fp4 = [u.key for u in plan.units if u.kind == "dense"]
    for module in fp4:
        for pat in plan.facts.ignore:
            hit = (re.match(pat[3:], module) if pat.startswith("re:") and _valid(pat[3:])
                   else (plan.layout == "modelopt-nvfp4" and fnmatch.fnmatchcase(module, pat)) or module == pat)
            if hit:
                out.append(Problem(module, cfg, f"FP4 tensors present but the ignore/exclude list entry {pat!r} covers the module"))
                break
    return out


def _valid(rx: str) -> bool:
    try:
        re.compile(rx)
    except re.error:
        return False
    return True


def analyze(ckpt: Checkpoint) -> tuple[Layout, Plan, list[str]]:
    """(layout module, plan, evidence) of an opened checkpoint."""
    layout, evidence = detect_layout(ckpt)
    plan = layout.plan(ckpt)
    plan.evidence = evidence
    plan.problems.extend(_ignore_problems(ckpt, plan))
    plan.problems.extend(_precision(ckpt, layout, plan, evidence))
    if plan.facts.num_experts == 0 and not any(u.kind == "moe" for u in plan.units):
        plan.problems.append(Problem("", str(ckpt.root / "config.json"),
                                     "no MoE experts found (config has no num_experts and no expert tensors matched)"))
    return layout, plan, evidence


def inspect_checkpoint(src: str | Path, revision: str | None = None) -> InspectReport:
    """A folder, or a Hugging Face repo id (``org/model[@revision]``) read on the Hub: its headers by
    range and its small files, nothing downloaded that ``inspect`` does not read."""
    ckpt = open_checkpoint(src, revision, stream=True)
    _, plan, evidence = analyze(ckpt)
    ctx = writer_context(plan, ckpt)
    return InspectReport(
        source=str(src), layout=plan.layout, evidence=evidence, plan=plan, tensors=len(ckpt.tensors),
        total_bytes=ckpt.total_bytes, files=[ckpt.rel(f) for f in ckpt.shard_files],
        targets=valid_targets(ctx) if not plan.problems else [], problems=plan.problems,
        refused=refusals(ctx) if not plan.problems else {}, hub=ckpt.source.inspect_facts(ckpt),
        at_link_rate=ckpt.source.at_link_rate)
