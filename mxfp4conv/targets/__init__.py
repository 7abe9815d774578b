"""Output targets, one module each."""

from __future__ import annotations

from mxfp4conv.errors import UsageError
from mxfp4conv.targets.base import OutTensor, Target, WriterContext
from mxfp4conv.targets.ct import CtTarget
from mxfp4conv.targets.gguf import GgufTarget
from mxfp4conv.targets.gpt_oss import GptOssTarget
from mxfp4conv.targets.mlx import MlxTarget
from mxfp4conv.targets.quark import QuarkTarget

__all__ = ["TARGETS", "OutTensor", "Target", "WriterContext", "get_target", "refusals", "resolve_auto", "valid_targets"]

TARGETS: dict[str, type[Target]] = {
    CtTarget.NAME: CtTarget,
    QuarkTarget.NAME: QuarkTarget,
    GptOssTarget.NAME: GptOssTarget,
    MlxTarget.NAME: MlxTarget,
    GgufTarget.NAME: GgufTarget,
}
try:  # the Marlin writer is optional at import time so a broken build of it never hides the others
    from mxfp4conv.targets.marlin import MarlinTarget

    TARGETS[MarlinTarget.NAME] = MarlinTarget
except ImportError:  # pragma: no cover
    pass


def resolve_auto(model_type: str) -> str:
    """``auto``: gpt-oss for gpt_oss models, ct otherwise."""
    return "gpt-oss" if model_type == "gpt_oss" else "ct"


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise UsageError(f"unknown target {name!r}; choose one of: auto, {', '.join(sorted(TARGETS))}")
    return TARGETS[name]()


def valid_targets(ctx: WriterContext) -> list[str]:
    return [name for name, cls in TARGETS.items() if cls().refuse(ctx) is None]


def refusals(ctx: WriterContext) -> dict[str, str]:
    """Target -> why it cannot express this source (targets that can are absent)."""
    return {name: why for name, cls in TARGETS.items() if (why := cls().refuse(ctx)) is not None}
