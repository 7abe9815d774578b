"""While CUDA starts, the CPU kernel stands in for the GPU (``device_start``): when it may, and that
the conversion says where each unit ran. The GPU side (the same bytes either way) is in
test_pipeline_gpu.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from mxfp4conv import device_start
from mxfp4conv.pipeline import ConvertOptions, convert
from tests.builders import build


@pytest.fixture
def starting(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """A GPU start in progress on a host with the cores to stand in."""
    ev = threading.Event()
    monkeypatch.setattr(device_start, "_started", ev)
    monkeypatch.setattr(device_start.os, "cpu_count", lambda: 16)
    return ev


def test_no_start_begun_means_ready() -> None:
    assert device_start.ready()
    with device_start.cpu_stands_in("cuda:0") as where:
        assert where == "cuda:0"


def test_the_cpu_stands_in_for_one_unit_at_a_time_while_cuda_starts(starting: threading.Event) -> None:
    assert not device_start.ready()
    # a second device's thread meanwhile waits for its GPU
    with device_start.cpu_stands_in("cuda:1") as first, device_start.cpu_stands_in("cuda:0") as second:
        assert (first, second) == ("cpu", "cuda:0")
    with device_start.cpu_stands_in("cuda:0") as again:  # the CPU is free again
        assert again == "cpu"
    with device_start.cpu_stands_in("cpu") as cpu:
        assert cpu == "cpu"
    starting.set()
    with device_start.cpu_stands_in("cuda:0") as started:
        assert started == "cuda:0"


def test_a_host_with_few_cores_waits_for_the_gpu(starting: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_start.os, "cpu_count", lambda: device_start.STAND_IN_CORES - 1)
    with device_start.cpu_stands_in("cuda:0") as where:
        assert where == "cuda:0"


def test_the_stand_in_can_be_turned_off_or_forced(starting: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MXFP4CONV_CPU_STAND_IN", "0")
    with device_start.cpu_stands_in("cuda:0") as off:
        assert off == "cuda:0"
    monkeypatch.setenv("MXFP4CONV_CPU_STAND_IN", "1")
    monkeypatch.setattr(device_start.os, "cpu_count", lambda: 2)
    with device_start.cpu_stands_in("cuda:0") as forced:
        assert forced == "cpu"


def test_only_the_compiled_kernel_stands_in(starting: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MXFP4CONV_CPU_KERNEL", "torch")
    with device_start.cpu_stands_in("cuda:0") as where:
        assert where == "cuda:0"


def test_the_report_says_where_units_were_requantized(tmp_path: Path) -> None:
    src = build("modelopt-nvfp4", tmp_path / "src", layers=2, experts=4, hidden=128, inter=64)
    report = convert(src, tmp_path / "out", ConvertOptions(target="ct", device="cpu"))
    assert report.requantized_on == {"cpu": report.requantized}
    assert report.requantized == 2
