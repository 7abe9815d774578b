"""The CUDA driver's start beside torch's import (``device/cuda_driver.py``): which devices it starts, and
that it never fails a conversion (no driver, a driver error)."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from mxfp4conv.device import cuda_driver
from mxfp4conv.plan.job import ConvertOptions
from mxfp4conv.run.pipeline import _ordinals


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
