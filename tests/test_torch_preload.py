"""torch's libraries loaded ahead of its import (``torch_preload.py``): that they are loaded, without
the GIL, that torch imports and works after them, and when a conversion preloads them (the config's
guess of an NVFP4 source, checked against the plan on every builder and replica)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mxfp4conv import pipeline
from mxfp4conv.errors import ConvertError
from mxfp4conv.job import ConvertOptions, needs_device, prepare
from mxfp4conv.pipeline import _names_nvfp4
from mxfp4conv.torch_preload import LIBRARIES, libraries
from tests.builders import build, quark_mxfp4, quark_nvfp4
from tests.replicas import BUILDERS


def _python(script: str) -> dict[str, Any]:
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_preload_loads_torchs_libraries_and_torch_imports_after_them() -> None:
    out = _python("""
import json, sys
from mxfp4conv.torch_preload import libraries, preload_torch
paths = libraries()
t = preload_torch()
t.join()
maps = open("/proc/self/maps").read()
loaded = [p.name for p in paths if str(p.resolve()) in maps]
before = "torch" in sys.modules
import torch
x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
print(json.dumps({"paths": [p.name for p in paths], "loaded": loaded, "torch_before": before,
                  "sum": float((x @ x.T).sum()), "again": [p.name for p in libraries()]}))
""")
    assert "libtorch_cpu.so" in out["paths"] and set(out["paths"]) <= set(LIBRARIES)
    assert out["loaded"] == out["paths"]  # every one mapped by the preload alone
    assert out["torch_before"] is False  # nothing of torch's Python was imported
    assert out["sum"] == 83.0  # [[0, 1, 2], [3, 4, 5]] times its transpose: 5 + 14 + 14 + 50
    assert out["again"] == []  # once torch is imported there is nothing to preload


def test_the_preload_lets_the_gil_go() -> None:
    """A Python thread keeps running while the libraries load: ``dlopen`` through ctypes releases the
    GIL (Python's own import of an extension module holds it for the whole load)."""
    out = _python("""
import json, threading, time
from mxfp4conv.torch_preload import preload_torch
count, stop = [0], [False]
def spin():
    while not stop[0]:
        count[0] += 1
s = threading.Thread(target=spin); s.start(); time.sleep(0.05)
c0, t0 = count[0], time.perf_counter()
t = preload_torch(); t.join()
c1, t1 = count[0], time.perf_counter()
time.sleep(0.3)  # the spinner alone, for its rate
c2, t2 = count[0], time.perf_counter()
stop[0] = True; s.join()
print(json.dumps({"during": (c1 - c0) / (t1 - t0), "alone": (c2 - c1) / (t2 - t1), "seconds": t1 - t0}))
""")
    # held by the loader, the GIL would leave the spinner a few percent of its rate
    assert out["during"] > 0.3 * out["alone"], out


def test_nothing_is_preloaded_once_torch_is_imported() -> None:
    import torch  # noqa: F401 - imported on purpose

    assert libraries() == []
    assert pipeline.preload_torch() is None


def _source(name: str, root: Path) -> Path:
    if name.startswith("builder-"):
        kind = name.removeprefix("builder-")
        made = {"quark-nvfp4": quark_nvfp4, "quark-mxfp4": quark_mxfp4}.get(kind)
        return made(root) if made else build(kind, root)
    return BUILDERS[name](root).path


SOURCES = [*(f"builder-{k}" for k in ("ct-mxfp4", "gpt-oss", "modelopt-nvfp4", "ct-nvfp4", "quark-nvfp4", "quark-mxfp4")),
           *sorted(BUILDERS)]


@pytest.mark.parametrize("name", SOURCES)
def test_the_guess_matches_the_plan(tmp_path: Path, name: str) -> None:
    """A conversion preloads torch's libraries when the config names NVFP4: on every builder and
    replica of a published family the guess is what the plan decides (``needs_device``), for the
    ``ct`` target and with ``--keep-nvfp4`` (never a requant)."""
    root = _source(name, tmp_path / "src")
    opts = ConvertOptions(target="ct", device="auto")
    try:
        planned = needs_device(prepare(root, opts).ctx)
    except ConvertError:  # a source the ct target refuses: the guess of another target's plan
        planned = needs_device(prepare(root, ConvertOptions(target="quark", device="auto")).ctx)
    assert _names_nvfp4(root, opts) == planned
    assert not _names_nvfp4(root, ConvertOptions(target="marlin", device="auto", extra={"keep_nvfp4": "1"}))


def test_the_guess_reads_no_fifo_and_no_repo_id(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "config.json")  # opening it would block until a writer came
    assert not _names_nvfp4(tmp_path, ConvertOptions(device="auto"))
    assert not _names_nvfp4("nvidia/DeepSeek-R1-FP4", ConvertOptions(device="auto"))
    (tmp_path / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "NVFP4"')  # cut short
    assert not _names_nvfp4(tmp_path, ConvertOptions(device="auto"))


@pytest.mark.parametrize(("layout", "device", "dry_run", "preloads"), [
    ("modelopt-nvfp4", "auto", False, True),
    ("modelopt-nvfp4", "cpu", False, True),  # the CPU's requant imports torch too
    ("modelopt-nvfp4", "auto", True, False),  # a dry run imports nothing
    ("ct-mxfp4", "auto", False, False),  # a rename never loads torch's libraries
])
def test_when_a_conversion_preloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, device: str,
                                    dry_run: bool, preloads: bool) -> None:
    src = build(layout, tmp_path / "src")
    calls: list[str] = []
    monkeypatch.setattr(pipeline, "preload_torch", lambda: calls.append("preload"))
    report = pipeline.convert(src, tmp_path / "out", ConvertOptions(target="ct" if layout != "ct-mxfp4" else "quark",
                                                                    device=device, dry_run=dry_run))
    assert report.status == ("dry-run" if dry_run else "converted")
    assert calls == (["preload"] if preloads else [])
