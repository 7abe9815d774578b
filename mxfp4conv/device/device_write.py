"""Computed bytes that live on a GPU, written to a shard through small reused page-locked stages.

A unit requantized on a GPU stays there until its shard's writer thread takes it: the writer copies
it to the host ``STAGE_BYTES`` at a time, on a stream of its own (the next chunk's copy overlapping the
write of the one before), and writes each chunk. So the host holds a few stages instead of the
unit's results, which were most of the GPU path's peak RSS, and the producer never waits for a copy
back. The bytes written are the device buffer's, in order: the same file as from host buffers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mxfp4conv.device.pinned import StagePool

if TYPE_CHECKING:
    import torch

__all__ = ["STAGE_BYTES", "DeviceBytes", "gather", "is_device_tensor", "write_device"]

STAGE_BYTES = 8 << 20  # each of a write's two page-locked stages (a power of two: torch's allocator rounds to one)


@dataclass
class DeviceBytes:
    """A shard's next bytes, on a CUDA device: ``data`` (flat, contiguous uint8) is complete once
    ``ready`` (recorded on the stream that made it) has passed."""

    data: torch.Tensor
    ready: torch.cuda.Event

    def __len__(self) -> int:
        return int(self.data.numel())


def is_device_tensor(item: object) -> bool:
    """Whether ``item`` is a torch tensor on a CUDA device (without importing torch for other items)."""
    return getattr(item, "is_cuda", False) is True


def gather(tensors: list[torch.Tensor]) -> DeviceBytes:
    """The bytes of ``tensors`` (all on one CUDA device), in order, as one flat device buffer: one
    copy on the device instead of one copy back per tensor (a ct MoE unit has ~800)."""
    import torch

    dev = tensors[0].device
    with torch.cuda.device(dev):
        flat = [t.detach().reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
        data = flat[0] if len(flat) == 1 else torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=dev)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(dev))
    return DeviceBytes(data, ready)


# pairs of stages, shared by every shard's writer thread (one pair per write in flight)
STAGES = StagePool(STAGE_BYTES, count=2)
_local = threading.local()  # each writer thread's stream and events, per device


def _stream(dev: torch.device) -> tuple[torch.cuda.Stream, list[torch.cuda.Event]]:
    import torch

    got = getattr(_local, "by_device", None)
    if got is None:
        got = _local.by_device = {}
    if dev not in got:
        with torch.cuda.device(dev):
            got[dev] = (torch.cuda.Stream(dev), [torch.cuda.Event(), torch.cuda.Event()])
    return got[dev]


def write_device(span: DeviceBytes, write: Callable[[memoryview], None]) -> None:
    """Copy ``span`` to the host a stage at a time and hand each chunk to ``write`` (which writes it
    whole before returning), in order."""
    import torch

    dev = span.data.device
    stream, events = _stream(dev)
    with STAGES.take() as stages:
        views = [memoryview(s.numpy()) for s in stages]  # type: ignore[arg-type]
        step = int(stages[0].numel())
        try:
            with torch.cuda.device(dev):
                stream.wait_event(span.ready)
                pending: tuple[torch.cuda.Event, memoryview] | None = None
                n = len(span)
                for i, pos in enumerate(range(0, n, step)):
                    m = min(step, n - pos)
                    # stage i % 2 held chunk i - 2, written already: free to fill
                    with torch.cuda.stream(stream):
                        stages[i % 2][:m].copy_(span.data[pos:pos + m], non_blocking=True)
                    events[i % 2].record(stream)
                    if pending is not None:
                        pending[0].synchronize()
                        write(pending[1])
                    pending = (events[i % 2], views[i % 2][:m])
                if pending is not None:
                    pending[0].synchronize()
                    write(pending[1])
        finally:
            stream.synchronize()  # no copy may still land in a stage that another write takes next
