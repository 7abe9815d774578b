"""Session fixtures for the producer tests: checkpoints written by the real producers, built once.

``producer_root`` runs ``build_fixtures.py`` in a subprocess (llm-compressor patches transformers'
global conversion-mapping registry while loading MoE models; the tests must read with stock
transformers) into a session tmp dir. Set ``MXFP4CONV_PRODUCERS_CACHE=/some/dir`` to keep the
fixtures across sessions: they are rebuilt when the builder script or a producer version changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from tests.measured import REPORT

HERE = Path(__file__).resolve().parent
BUILDER = HERE / "build_fixtures.py"


def _stamp() -> dict[str, str]:
    vers = {p: metadata.version(p) for p in ("torch", "transformers", "compressed-tensors", "llmcompressor")}
    return {"builder_sha256": hashlib.sha256(BUILDER.read_bytes()).hexdigest(), **vers}


def _build(root: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(BUILDER), str(root)], capture_output=True, text=True, env=env,
                          timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"building producer fixtures failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="session")
def producer_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = os.environ.get("MXFP4CONV_PRODUCERS_CACHE")
    stamp = _stamp()
    if cache:
        root = Path(cache)
        stamp_file = root / "stamp.json"
        if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp and (root / "manifest.json").exists():
            return root
        shutil.rmtree(root, ignore_errors=True)
    else:
        root = tmp_path_factory.mktemp("producers")
    _build(root)
    (root / "stamp.json").write_text(json.dumps(stamp, indent=2) + "\n")
    manifest = json.loads((root / "manifest.json").read_text())
    secs = manifest.get("seconds", {})
    REPORT.append(f"fixtures built in {secs.get('total', 0):.1f}s (wall, in a subprocess) with "
                  + ", ".join(f"{k} {v}" for k, v in manifest["versions"].items()))
    return root


@pytest.fixture(scope="session")
def manifest(producer_root: Path) -> dict[str, Any]:
    return json.loads((producer_root / "manifest.json").read_text())


@pytest.fixture(scope="session")
def fixture_path(producer_root: Path, manifest: dict[str, Any]) -> Callable[[str], Path]:
    def get(name: str) -> Path:
        if name in manifest["fixtures"]:
            return producer_root / manifest["fixtures"][name]["dir"]
        return producer_root / name  # the bf16 originals: "<arch>-bf16"

    return get


@pytest.fixture(scope="session")
def session_cache() -> dict[Any, Any]:
    """Memo for expensive reads shared between tests (source models, conversions)."""
    return {}


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory, fixture_path: Callable[[str], Path],
              session_cache: dict[Any, Any]) -> Callable[..., tuple[Path, Any]]:
    """convert(fixture, target) once per session -> (output dir, ConvertReport)."""
    from mxfp4conv.run.pipeline import ConvertOptions, convert

    def run(name: str, target: str, **opts: Any) -> tuple[Path, Any]:
        key = ("convert", name, target, tuple(sorted(opts.items())))
        if key not in session_cache:
            dst = tmp_path_factory.mktemp("out") / f"{name}--{target}"
            report = convert(fixture_path(name), dst, ConvertOptions(target=target, **opts))
            session_cache[key] = (dst, report)
        return session_cache[key]

    return run


