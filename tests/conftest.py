"""Shared test setup: the checkpoint builders (tests/builders.py, which loads examples/tiny.py once), GPU auto-skip."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import builders
from tests.measured import REPORT

# Loaded before any test module: examples/tiny.py is importable as ``tiny`` without a sys.path entry.
tiny = builders.tiny


@pytest.fixture
def record(request: pytest.FixtureRequest, record_property: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    """Record a measured number: printed now (visible with -s), in the junit XML, and in the summary."""

    def rec(key: str, value: Any) -> None:
        line = f"{request.node.name}: {key} = {value}"
        print(line)
        record_property(key, value)
        REPORT.append(line)

    return rec


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORT:
        terminalreporter.section("measured numbers")
        for line in REPORT:
            terminalreporter.write_line(line)


_GPU_MARK = re.compile(r"mark\.gpu|\"gpu\"")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m gpu`` (``make test-gpu``, often on a GPU machine without the CPU suites' test dependencies,
    such as gguf or ray), a test file that marks nothing ``gpu`` is not imported at all."""
    if config.getoption("markexpr") != "gpu" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return _GPU_MARK.search(collection_path.read_text()) is None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CUDA not available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
