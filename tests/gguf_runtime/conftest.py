"""Session set-up of the llama.cpp runtime tests: sources, ``--to gguf`` conversions, one llama.cpp process.

llama.cpp's python: ``MXFP4CONV_LLAMA_PYTHON`` (``make test`` sets it to ``.venv-llama``'s), else this
checkout's ``.venv-llama/bin/python`` when present. Without one the tests are skipped, unless
``MXFP4CONV_REQUIRE_LLAMA`` is set, which makes its absence an error. Every case goes to ONE process
(``llama_run.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.gguf_runtime import gguf_cases as C
from tests.measured import REPORT

HERE = Path(__file__).resolve().parent
RUN = HERE / "llama_run.py"
MARK = "MXFP4CONV-LLAMA-RESULT"  # llama_run.MARK
NEGATIVE = "qwen3_moe-ct-mxfp4--gate-up-swapped"
NEGATIVE_QK = "mixtral-ct-mxfp4--qk-unpermuted"
SHARDED = "qwen3_moe-ct-mxfp4--split"
NEGATIVE_NORMS = "qwen3_5_moe-ct-mxfp4--norms-unshifted"
NEGATIVE_V_HEADS = "qwen3_5_moe-ct-mxfp4--v-heads-grouped"
NEGATIVE_QKVZ = "qwen3_next-ct-mxfp4--qkvz-unsplit"
NEGATIVE_ROPE = "llama4-llama3-rope-ct-mxfp4--freqs-unscaled"


def llama_python() -> str | None:
    env = os.environ.get("MXFP4CONV_LLAMA_PYTHON")
    if env:
        return env
    cand = HERE.parents[1] / ".venv-llama" / "bin" / "python"
    return str(cand) if cand.exists() else None


def require_llama() -> str:
    py = llama_python()
    if py is None:
        if os.environ.get("MXFP4CONV_REQUIRE_LLAMA"):
            pytest.fail("MXFP4CONV_REQUIRE_LLAMA is set but no llama.cpp python was found "
                        "(MXFP4CONV_LLAMA_PYTHON, .venv-llama)")
        pytest.skip("no llama.cpp venv: set MXFP4CONV_LLAMA_PYTHON or run `make env-llama` (or `make test`)")
    return py


# negative control -> (the case whose output it rewrites, how: (output, copy, source config) -> copy)
_NEGATIVES: dict[str, tuple[str, Callable[[Path, Path, dict[str, Any]], Path]]] = {
    NEGATIVE: ("qwen3_moe-ct-mxfp4", lambda dst, out, cfg: C.swap_gate_up(dst, out)),
    NEGATIVE_QK: ("mixtral-ct-mxfp4", lambda dst, out, cfg: C.unpermute_qk(
        dst, out, int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]))),
    NEGATIVE_NORMS: ("qwen3_5_moe-ct-mxfp4", lambda dst, out, cfg: C.unshift_norms(dst, out)),
    NEGATIVE_V_HEADS: ("qwen3_5_moe-ct-mxfp4", C.group_v_heads),
    NEGATIVE_ROPE: ("llama4-llama3-rope-ct-mxfp4", lambda dst, out, cfg: C.unscale_rope(dst, out)),
    NEGATIVE_QKVZ: ("qwen3_next-ct-mxfp4", C.unsplit_qkvz),
}


@dataclass
class Ran:
    cases: dict[str, C.Case]
    results: dict[str, dict[str, Any]]
    references: dict[str, dict[str, Any]] = field(default_factory=dict)
    convert_errors: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def _run_llama(py: str, todo: list[dict[str, Any]], root: Path) -> dict[str, Any]:
    (root / "cases.json").write_text(json.dumps(todo))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([py, str(RUN), str(root / "cases.json")], capture_output=True, text=True, env=env,
                          cwd=str(root), timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)), None)
    if line is None:
        pytest.fail(f"llama.cpp process rc={proc.returncode} printed no result:\n{proc.stderr[-3000:]}{proc.stdout[-2000:]}")
    return dict(json.loads(line[len(MARK):]))


@pytest.fixture(scope="session")
def llama_ran(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    py = require_llama()
    t0 = time.perf_counter()
    root = tmp_path_factory.mktemp("gguf")
    ran = Ran({}, {})
    todo: list[dict[str, Any]] = []
    for case in C.sources(root / "src"):
        err = C.convert(case)
        if err:
            ran.convert_errors[case.name] = err
            continue
        ran.cases[case.name] = case
        ran.references[case.name] = {"reference": C.reference_logits(case, written=False),
                                     "reference_written": C.reference_logits(case, written=True)}
        todo.append(C.expectations(case))
    for name, (of, make) in _NEGATIVES.items():  # each a converter re-layout done wrong, on a written output
        written = ran.cases.get(of)
        if written is not None:
            cfg = json.loads((written.src / "config.json").read_text())
            neg = make(written.dst, root / "out" / name, cfg)
            todo.append({**C.expectations(written), "name": name, "model": str(neg / "model.gguf")})
            ran.references[name] = ran.references[written.name]
    base = ran.cases.get("qwen3_moe-ct-mxfp4")
    if base is not None:
        split = C.Case(SHARDED, base.src, root / "out" / SHARDED, base.model_type, base.nvfp4)
        err = C.convert(split, "--max-shard-size", "40KB")
        if err:
            ran.convert_errors[SHARDED] = err
        else:
            ran.cases[SHARDED] = split
            ran.references[SHARDED] = ran.references[base.name]
            first = sorted(split.dst.glob("*.gguf"))[0]
            todo.append({**C.expectations(split), "model": str(first)})
    t1 = time.perf_counter()
    doc = _run_llama(py, todo, root)
    ran.info = doc["info"]
    ran.results = {r["name"]: r for r in doc["results"]}
    REPORT.append(f"llama.cpp: {len(todo)} cases, build+convert {t1 - t0:.1f}s, llama.cpp process "
                  f"{time.perf_counter() - t1:.1f}s ({ran.info.get('llama_cpp_python')})")
    return ran
