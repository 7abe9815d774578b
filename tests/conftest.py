"""Shared test setup: the checkpoint builders (tests/builders.py, which loads examples/tiny.py once), GPU auto-skip."""

from __future__ import annotations

import pytest
import torch

from tests import builders

# Loaded before any test module: examples/tiny.py is importable as ``tiny`` without a sys.path entry.
tiny = builders.tiny


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CUDA not available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
