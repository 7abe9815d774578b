"""The writer tests' shared sources: built once per session (never modify them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import builders
from tests.targets.helpers import mixed_nvfp4


@pytest.fixture(scope="session")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FP4 experts + FP8 per-tensor + FP8 block + BF16 + an MTP layer + an FP8 KV cache (helpers.mixed_nvfp4)."""
    return mixed_nvfp4(tmp_path_factory.mktemp("writers") / "mixed")


@pytest.fixture(scope="session")
def deepseek_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return builders.deepseek_v4(tmp_path_factory.mktemp("writers") / "v4")


@pytest.fixture(scope="session")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return builders.build("gpt-oss", tmp_path_factory.mktemp("writers") / "gpt-oss", shards=1)


@pytest.fixture(scope="session")
def ct_mxfp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return builders.build("ct-mxfp4", tmp_path_factory.mktemp("writers") / "ct-mxfp4", shards=1)
