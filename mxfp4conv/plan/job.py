"""A conversion job as planned from SRC's headers: what both ``convert`` and ``verify`` start from.

``prepare(src, opts)`` opens the checkpoint, detects its layout, plans its units, resolves the
target, builds the writer context and the conversion plan (``plan/shards.py``: every output rank, shard
and unit); the ``Job`` it returns carries them with the options. The helpers here decide where units
are transformed. Nothing here imports torch unless a GPU has to be looked for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxfp4conv.errors import InputError, UsageError
from mxfp4conv.layouts.base import Layout, Plan
from mxfp4conv.plan.inspect import analyze, writer_context
from mxfp4conv.plan.shards import ConversionPlan, plan_conversion
from mxfp4conv.sources.checkpoint import Checkpoint, open_checkpoint
from mxfp4conv.targets import Target, WriterContext, get_target, resolve_auto
from mxfp4conv.targets.base import TargetOptions

__all__ = ["GB", "ConvertOptions", "Job", "cpu_kernel", "devices", "needs_device", "prepare", "resolve_device"]

GB = 1000**3


@dataclass(frozen=True)
class ConvertOptions:
    target: str = "auto"
    scale_rule: str = "mse"
    device: str = "cpu"
    max_shard_size: int = 5 * GB
    overwrite: bool = False
    dry_run: bool = False
    verify: bool = True
    skip_if_current: bool = False
    revision: str | None = None
    target_options: TargetOptions = field(default_factory=TargetOptions)
    resume: bool = False  # reuse finished shards of an interrupted run's staging folder
    partition: tuple[int, int] | None = None  # (i, n): write only shards j with j % n == i, publish nothing
    finish: bool = False  # publish once every partition's shards are in the staging folder
    devices: tuple[str, ...] = ()  # explicit devices for unit transforms, e.g. ("cuda:0", "cuda:1")
    stream: bool = False  # a Hub repo's shards read by range, not downloaded (sources/hub.py)
    base_model: str | None = None  # the card's base_model, ORG/NAME (run/card.py; a repo id SRC names its own)

    def fingerprint_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"target": self.target, "scale_rule": self.scale_rule,
                               "max_shard_size": self.max_shard_size,
                               "extra": dict(sorted(self.target_options.as_strings().items()))}
        if self.base_model is not None:  # it changes the card; absent otherwise, as in manifests made before it
            out["base_model"] = self.base_model
        return out


@dataclass(frozen=True)
class Job:
    """SRC planned for one target: checkpoint, layout, unit plan, target, writer context, the
    conversion plan (what is written, rank by rank), options."""

    ckpt: Checkpoint
    layout: Layout
    plan: Plan
    target: Target
    ctx: WriterContext
    output: ConversionPlan
    opts: ConvertOptions

    @property
    def needs_device(self) -> bool:
        return needs_device(self.ctx)

    def with_options(self, opts: ConvertOptions) -> Job:
        return dataclasses.replace(self, opts=opts)


def prepare(src: str | Path, opts: ConvertOptions) -> Job:
    """Open, detect, validate and plan SRC for ``opts.target``; ``InputError`` (the source, or a target it cannot
    be written to) / ``UsageError`` (an option) when it cannot be."""
    ckpt = open_checkpoint(src, opts.revision, stream=opts.stream)
    layout, plan, _ = analyze(ckpt)
    if plan.problems:
        p = plan.problems[0]
        more = f" (and {len(plan.problems) - 1} more; run mxfp4conv inspect)" if len(plan.problems) > 1 else ""
        raise InputError(p.message + more, file=p.file, tensor=p.tensor or None,
                         hint="run `mxfp4conv inspect SRC` for every problem; fix or re-download the checkpoint")
    name = resolve_auto(plan.facts.model_type) if opts.target == "auto" else opts.target
    target = get_target(name)
    ctx = writer_context(plan, ckpt, opts.target_options)
    why = target.refuse(ctx)
    if why and opts.target == "auto" and name == "gpt-oss":
        # gpt_oss with FP4 attention (llm-compressor) has no native layout: Quark is the served one
        name = "quark"
        target = get_target(name)
        why = target.refuse(ctx)
    if why:
        raise InputError(f"cannot convert {plan.layout} ({plan.facts.model_type}) to --to {name}: {why}")
    return Job(ckpt, layout, plan, target, ctx, plan_conversion(plan, ckpt, target, ctx, opts.max_shard_size), opts)


def needs_device(ctx: WriterContext) -> bool:
    """Whether any unit is requantized (the only work that runs on ``--device``)."""
    return ctx.facts.source_quant == "nvfp4" and not ctx.target_options.keep_nvfp4


def resolve_device(name: str, needed: bool = True) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; other names unchanged. With
    ``needed=False`` (nothing will be requantized: renames, Marlin repacks of MXFP4) ``auto`` is
    ``cpu`` without importing torch, so such conversions and ``inspect`` start in a fraction of a second."""
    if name != "auto" and not (needed and name.startswith("cuda")):
        return name
    if not needed:
        return "cpu"
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA device is visible", hint="use --device cpu (same bytes) or auto")
    return name


def cpu_kernel(device: str, needed: bool) -> str | None:
    """Which CPU requant path runs (``native`` or ``torch``), None when nothing is requantized on the
    CPU. Builds the compiled kernel now, so that ``MXFP4CONV_CPU_KERNEL=native`` without a C compiler
    (or a bad mode) fails before any output is written, as a ``UsageError``."""
    if not needed or device != "cpu":
        return None
    from mxfp4conv.kernels import requant_native

    try:
        return "native" if requant_native.load() is not None else "torch"
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc), hint="unset MXFP4CONV_CPU_KERNEL, or install a C compiler (cc / gcc / clang)") from exc


def whole_units(opts: ConvertOptions) -> bool:
    """Whether a remote source's units are converted whole rather than by expert groups: a GPU converts
    a whole layer in a fraction of the time its bytes take to arrive (one call per group cost it more
    than the link), and several devices take a unit each."""
    devs = devices(opts)
    return len(devs) > 1 or devs[0].startswith("cuda")


def devices(opts: ConvertOptions) -> list[str]:
    """Where units are transformed: every visible GPU for ``--device cuda``, the listed ones, or one device."""
    if opts.devices:
        return list(opts.devices)
    if opts.device == "cuda":
        import torch

        if torch.cuda.is_available():
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [opts.device]
