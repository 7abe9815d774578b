"""Session set-up of the MLX runtime tests: sources, ``--to mlx`` conversions, one MLX process for all.

MLX's python: ``MXFP4CONV_MLX_PYTHON`` (``make test`` sets it to ``.venv-mlx``'s), else this checkout's
``.venv-mlx/bin/python`` when present. Without one the tests are skipped, unless ``MXFP4CONV_REQUIRE_MLX``
is set, which makes its absence an error. Every case goes to ONE process (``mlx_run.py``): mlx and
mlx-lm import in ~2 s, each tiny case then takes ~0.1 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.measured import REPORT
from tests.mlx_runtime import mlx_cases as C

HERE = Path(__file__).resolve().parent
RUN = HERE / "mlx_run.py"
NEGATIVE = "qwen3_moe-ct-mxfp4--gate-up-swapped"
SHARDED = "qwen3_moe-ct-mxfp4--sharded"


def mlx_python() -> str | None:
    env = os.environ.get("MXFP4CONV_MLX_PYTHON")
    if env:
        return env
    cand = HERE.parents[1] / ".venv-mlx" / "bin" / "python"
    return str(cand) if cand.exists() else None


@dataclass
class Ran:
    cases: dict[str, C.Case]
    results: dict[str, dict[str, Any]]
    convert_errors: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def _run_mlx(py: str, todo: list[dict[str, Any]], root: Path) -> dict[str, Any]:
    (root / "cases.json").write_text(json.dumps(todo))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([py, str(RUN), str(root / "cases.json")], capture_output=True, text=True, env=env,
                          cwd=str(root), timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(mlx_run_mark())), None)
    if line is None:
        pytest.fail(f"MLX process rc={proc.returncode} printed no result:\n{proc.stderr[-3000:]}{proc.stdout[-2000:]}")
    return dict(json.loads(line[len(mlx_run_mark()):]))


def mlx_run_mark() -> str:
    return "MXFP4CONV-MLX-RESULT"  # mlx_run.MARK (that module imports mlx: not importable here)


@pytest.fixture(scope="session")
def mlx_ran(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    py = mlx_python()
    if py is None:
        if os.environ.get("MXFP4CONV_REQUIRE_MLX"):
            pytest.fail("MXFP4CONV_REQUIRE_MLX is set but no MLX python was found (MXFP4CONV_MLX_PYTHON, .venv-mlx)")
        pytest.skip("no MLX venv: set MXFP4CONV_MLX_PYTHON or run `make env-mlx` (or `make test`)")
    t0 = time.perf_counter()
    root = tmp_path_factory.mktemp("mlx")
    ran = Ran({}, {})
    todo: list[dict[str, Any]] = []
    for case in C.sources(root / "src"):
        err = C.convert(case)
        if err:
            ran.convert_errors[case.name] = err
            continue
        C.write_expectations(case)
        ran.cases[case.name] = case
        todo.append({"name": case.name, "model": str(case.dst), "expect": str(C.expect_dir(case)), "prompt": C.PROMPT})
    base = ran.cases.get("qwen3_moe-ct-mxfp4")
    if base is not None:
        neg = C.swap_gate_up(base.dst, root / "out" / NEGATIVE)
        todo.append({"name": NEGATIVE, "model": str(neg), "expect": str(C.expect_dir(base)), "prompt": C.PROMPT})
        sharded = C.Case(SHARDED, base.src, root / "out" / SHARDED, base.model_type, base.nvfp4)
        err = C.convert(sharded, "--max-shard-size", "20KB")
        if err:
            ran.convert_errors[SHARDED] = err
        else:
            ran.cases[SHARDED] = sharded
            todo.append({"name": SHARDED, "model": str(sharded.dst), "expect": str(C.expect_dir(base)),
                         "prompt": C.PROMPT})
    t1 = time.perf_counter()
    doc = _run_mlx(py, todo, root)
    ran.info = doc["info"]
    ran.results = {r["name"]: r for r in doc["results"]}
    REPORT.append(f"mlx: {len(todo)} cases, build+convert {t1 - t0:.1f}s, MLX process {time.perf_counter() - t1:.1f}s "
                  f"({ran.info})")
    return ran
