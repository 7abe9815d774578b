"""CUDA's start, overlapped with the conversion's first units.

A fresh process spends seconds importing torch, starting CUDA and loading the Triton kernel.
``begin`` does all three on a helper thread while SRC is planned and its first units are read. Until it is
done (``ready``), a unit bound for a GPU may be requantized by the CPU kernel instead
(``cpu_stands_in``): the bytes, statistics and errors are the same by contract (docs/REQUANT.md), so
the GPU's start costs the CPU's throughput rather than idle seconds. The CPU stands in for one
unit at a time, and only on a host with the cores for it (``STAND_IN_CORES``;
``MXFP4CONV_CPU_STAND_IN=0`` never, ``=1`` on any host).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["STAND_IN_CORES", "begin", "cpu_stands_in", "ready"]

# a host with fewer cores requantizes a MoE layer in about as long as CUDA takes to start: waiting
# for the GPU is then the better bet
STAND_IN_CORES = 8

_started: threading.Event | None = None
_stand_in = threading.Lock()


def begin() -> None:
    """Import torch, start CUDA and load the requant kernel on a helper thread (once per process)."""
    global _started
    if _started is not None:
        return
    done = _started = threading.Event()

    def start() -> None:
        try:
            with contextlib.suppress(Exception):
                import torch

                if torch.cuda.is_available():
                    from mxfp4conv.io.pinned import use_fast_pinning

                    use_fast_pinning()  # before the first pinned allocation
                    torch.cuda.init()
                    from mxfp4conv.kernels.requant_triton import requant_rows

                    # one row through the kernel: Triton's import, its cache key (a hash of its own
                    # sources, ~0.4 s) and the kernel's load happen here, not on the first unit
                    dev = torch.device("cuda", torch.cuda.current_device())
                    requant_rows(torch.zeros(1, 16, dtype=torch.uint8, device=dev),
                                 torch.full((1, 2), 0x38, dtype=torch.uint8, device=dev),
                                 torch.ones(1, device=dev), False, "mse")
                    torch.cuda.synchronize(dev)
        finally:
            done.set()

    threading.Thread(target=start, name="mxfp4conv-device-start", daemon=True).start()


def ready() -> bool:
    """Whether the GPU's start is over (or was never begun in this process)."""
    return _started is None or _started.is_set()


def _may_stand_in() -> bool:
    """``MXFP4CONV_CPU_STAND_IN``: ``auto`` (default: on a host of at least ``STAND_IN_CORES`` cores),
    ``1`` (any host) or ``0`` (never: units wait for the GPU)."""
    mode = os.environ.get("MXFP4CONV_CPU_STAND_IN", "auto").strip().lower()
    if mode in ("0", "off", "no", "false"):
        return False
    return mode in ("1", "on", "yes", "true") or (os.cpu_count() or 1) >= STAND_IN_CORES


@contextlib.contextmanager
def cpu_stands_in(device: str) -> Iterator[str]:
    """The device a unit bound for ``device`` is requantized on: ``cpu`` while the GPU is starting
    and the CPU is free to stand in, else ``device``."""
    if not device.startswith("cuda") or ready() or not _may_stand_in() or not _stand_in.acquire(blocking=False):
        yield device
        return
    try:
        from mxfp4conv.kernels import requant_native

        # only the compiled kernel keeps up; torch's CPU path would hold the unit longer than CUDA's start
        try:
            native = requant_native.load() is not None
        except (OSError, ValueError):  # a bad MXFP4CONV_CPU_KERNEL: the GPU reports nothing of it
            native = False
        yield "cpu" if native else device
    finally:
        _stand_in.release()
