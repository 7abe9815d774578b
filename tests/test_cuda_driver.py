"""The device's start beside torch's import: which devices the CUDA driver's start
(``io/cuda_driver.py``) starts, that it never fails a conversion (no driver, a driver error), and
when a conversion starts the device (``pipeline._start_device``)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import pytest

from mxfp4conv import pipeline
from mxfp4conv.errors import ConvertError
from mxfp4conv.io import cuda_driver
from mxfp4conv.job import ConvertOptions, needs_device, prepare
from mxfp4conv.pipeline import _names_nvfp4, _ordinals
from tests.builders import build, quark_mxfp4, quark_nvfp4
from tests.replicas import BUILDERS


class FakeDriver:
    """The five driver calls ``warm`` makes, on ``count`` devices; records the contexts retained."""

    def __init__(self, count: int, init: int = 0) -> None:
        self.count, self.init = count, init
        self.retained: list[int] = []

    def cuInit(self, flags: int) -> int:  # the driver API's names
        return self.init

    def cuDeviceGetCount(self, out: Any) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = self.count
        return 0

    def cuDeviceGet(self, out: Any, ordinal: int) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx: object, dev: ctypes.c_int) -> int:
        self.retained.append(dev.value)
        return 0


@pytest.mark.parametrize(("ordinals", "retained"), [(None, [0, 1, 2]), ([1], [1]), ([2, 0], [2, 0]), ([5], [])])
def test_warm_starts_the_devices_asked_for_and_only_visible_ones(monkeypatch: pytest.MonkeyPatch,
                                                                  ordinals: list[int] | None, retained: list[int]) -> None:
    fake = FakeDriver(3)
    monkeypatch.setattr(cuda_driver, "_driver", lambda: fake)
    assert cuda_driver.warm(ordinals) == len(retained)
    assert fake.retained == retained


def test_warm_does_nothing_without_a_driver_or_when_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_driver, "_driver", lambda: None)
    assert cuda_driver.warm(None) == 0
    failing = FakeDriver(2, init=100)  # CUDA_ERROR_NO_DEVICE
    monkeypatch.setattr(cuda_driver, "_driver", lambda: failing)
    assert cuda_driver.warm(None) == 0 and failing.retained == []


def test_the_helper_thread_swallows_any_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("a driver that breaks")

    monkeypatch.setattr(cuda_driver, "_driver", broken)
    t = cuda_driver.start_driver(0)
    t.join(5)
    assert not t.is_alive()


@pytest.mark.parametrize(("device", "devices", "want"), [
    ("cuda", (), None), ("auto", (), None), ("cuda:1", (), [1]), ("cpu", ("cuda:0", "cuda:2"), [0, 2]),
])
def test_a_conversion_starts_the_devices_it_will_use(device: str, devices: tuple[str, ...], want: list[int] | None) -> None:
    assert _ordinals(ConvertOptions(device=device, devices=devices)) == want


def _source(name: str, root: Path) -> Path:
    if name.startswith("builder-"):
        kind = name.removeprefix("builder-")
        made = {"quark-nvfp4": quark_nvfp4, "quark-mxfp4": quark_mxfp4}.get(kind)
        return made(root) if made else build(kind, root)
    return BUILDERS[name](root).path


SOURCES = [*(f"builder-{k}" for k in ("ct-mxfp4", "gpt-oss", "modelopt-nvfp4", "ct-nvfp4", "quark-nvfp4", "quark-mxfp4")),
           *sorted(BUILDERS)]


@pytest.mark.parametrize("name", SOURCES)
def test_the_early_guess_matches_the_plan(tmp_path: Path, name: str) -> None:
    """``--device auto`` starts the device before planning when the config names NVFP4: on every
    builder and replica of a published family the guess is what the plan decides (``needs_device``),
    for the ``ct`` target and with ``--keep-nvfp4`` (never a requant)."""
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


@pytest.mark.parametrize(("layout", "device", "driver", "calls"), [
    ("modelopt-nvfp4", "auto", True, ["start", "prepare"]),  # guessed: beside the planning
    ("modelopt-nvfp4", "auto", False, ["prepare", "start"]),  # no CUDA driver: once the plan shows a requant
    ("modelopt-nvfp4", "cpu", True, ["prepare"]),
    ("ct-mxfp4", "auto", True, ["prepare"]),  # a rename never starts the device (nor imports torch)
])
def test_when_a_conversion_starts_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, device: str,
                                             driver: bool, calls: list[str]) -> None:
    """On any machine: the driver's presence is simulated; without a GPU the device's start ends
    with torch finding none, and the conversion runs on the CPU."""
    src = build(layout, tmp_path / "src")
    if not driver or not cuda_driver.has_driver():
        monkeypatch.setattr(cuda_driver, "has_driver", lambda: driver)
    seen: list[str] = []
    real_prepare, real_start = pipeline.prepare, pipeline._start_device

    def plan(*args: Any, **kw: Any) -> Any:
        seen.append("prepare")
        return real_prepare(*args, **kw)

    monkeypatch.setattr(pipeline, "prepare", plan)

    def start(opts: ConvertOptions) -> object:
        thread = real_start(opts)
        if thread is not None:  # None: no device asked for
            seen.append("start")
        return thread

    monkeypatch.setattr(pipeline, "_start_device", start)
    report = pipeline.convert(src, tmp_path / "out", ConvertOptions(target="ct" if layout != "ct-mxfp4" else "quark",
                                                                    device=device))
    assert report.verify and report.verify["ok"]
    assert seen == calls
