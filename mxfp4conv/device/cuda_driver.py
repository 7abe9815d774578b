"""Start the CUDA driver and the GPUs' primary contexts while torch is being imported.

A fresh ``convert`` on a GPU spends seconds in torch's import, then more in CUDA's start (the
driver's initialization and each device's primary context). The second needs no torch: the driver
API, called through ctypes (which lets go of the GIL during each call), does it on a helper thread
beside the import. torch then finds the driver started and the primary context made, and takes it
(the runtime uses each device's primary context). Best effort: anything missing or failing here
leaves the work to torch, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Sequence

_LIBS = ("libcuda.so.1", "libcuda.so")


def _driver() -> ctypes.CDLL | None:
    for name in _LIBS:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def warm(ordinals: Sequence[int] | None) -> int:
    """Initialize the driver and retain the primary context of each device in ``ordinals`` (every
    visible one for None). Returns how many contexts were made ready; 0 when there is no driver or
    no device. The contexts stay retained for the process's life, as torch keeps its own."""
    lib = _driver()
    if lib is None or lib.cuInit(0) != 0:
        return 0
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    ready = 0
    for i in range(count.value) if ordinals is None else ordinals:
        dev, ctx = ctypes.c_int(0), ctypes.c_void_p(0)
        if 0 <= i < count.value and lib.cuDeviceGet(ctypes.byref(dev), i) == 0 \
                and lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0:
            ready += 1
    return ready


def start_driver(ordinals: Sequence[int] | int | None = None) -> threading.Thread:
    """``warm(ordinals)`` on a daemon thread, started; join it to wait (it never raises)."""
    wanted = [ordinals] if isinstance(ordinals, int) else ordinals

    def run() -> None:
        with contextlib.suppress(Exception):  # a warm-up only: torch starts CUDA itself either way
            warm(wanted)

    t = threading.Thread(target=run, name="mxfp4conv-cuda-driver", daemon=True)
    t.start()
    return t
