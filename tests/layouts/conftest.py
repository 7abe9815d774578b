"""The layout tests' shared checkpoints: built on first use, once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.layouts.helpers import BUILDERS, Source


@pytest.fixture(scope="session")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    """``source(name)``: the folder of a checkpoint of ``helpers.BUILDERS`` (shared: never modify it)."""
    root = tmp_path_factory.mktemp("layouts")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = BUILDERS[name](root / name)
        return built[name]

    return get
