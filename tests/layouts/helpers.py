"""Tiny checkpoints of every input layout and helpers to look at them (the ``source`` fixture is in conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mxfp4conv.layouts import LAYOUTS
from mxfp4conv.sources.checkpoint import Checkpoint, open_checkpoint
from tests import builders

Source = Callable[[str], Path]



def _tiny(layout: str, **kw: Any) -> Callable[[Path], Path]:
    return lambda root: builders.build(layout, root, **kw)


BUILDERS: dict[str, Callable[[Path], Path]] = {
    **{name: _tiny(name) for name in builders.TINY_LAYOUTS},
    "ct-mxfp4-mixtral": _tiny("ct-mxfp4", mixtral_names=True),
    "quark-mxfp4": builders.quark_mxfp4,
    "quark-mxfp4-w4a4": lambda root: builders.quark_mxfp4(root, w4a4=True),
    "quark-nvfp4": builders.quark_nvfp4,
    "deepseek-v4": builders.deepseek_v4,
    "autoround-w4a16": builders.autoround_mxfp4,
    "autoround-w4a4": lambda root: builders.autoround_mxfp4(root, act_bits=4),
}
ALL_SOURCES = tuple(BUILDERS)


def detections(ckpt: Checkpoint) -> dict[str, list[str]]:
    """Layout name -> evidence, for every layout whose ``detect`` claims the checkpoint."""
    return {name: ev for name, mod in LAYOUTS.items() if (ev := mod.detect(ckpt))}


def edit_config(folder: Path, edit: Callable[[dict[str, Any]], None]) -> Checkpoint:
    """Apply ``edit`` to the folder's config.json and open the checkpoint again."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))
    return open_checkpoint(folder)
