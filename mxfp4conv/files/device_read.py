"""Source tensors read straight into a CUDA tensor, through two small reused pinned buffers.

A unit bound for a GPU requant lives on the device from its read to its requant, so the host holds
only these buffers, not the unit: page-locked host memory sized by the unit (and rounded up to a
power of two by torch's caching host allocator) was most of the GPU path's peak RSS. The next
buffer is read from the files (``preadv`` on the shared read pool, GIL released) while the previous
one is copied to the device.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from mxfp4conv.device.pinned import StagePool
from mxfp4conv.files.safetensors import TensorRef, read_parts, tensor_view

if TYPE_CHECKING:
    import torch

__all__ = ["STAGE_BYTES", "read_to_device"]

STAGE_BYTES = 64 << 20  # each of the two pinned buffers (a power of two: the allocator rounds to one)
# pairs of read stages, one pair per read in flight (a reader thread per device)
STAGES = StagePool(STAGE_BYTES, count=2)

_local = threading.local()  # each reading thread has its own stream and events


def _stream(device: torch.device) -> tuple[torch.cuda.Stream, list[torch.cuda.Event]]:
    import torch

    got = getattr(_local, "by_device", None)
    if got is None:
        got = _local.by_device = {}
    if device not in got:
        with torch.cuda.device(device):
            got[device] = (torch.cuda.Stream(device), [torch.cuda.Event(), torch.cuda.Event()])
    return got[device]


def plan_windows(items: list[tuple[TensorRef, int]], total: int,
                 stage: int) -> list[tuple[int, int, list[tuple[TensorRef, int, int, int]]]]:
    """Split the destination ``[0, total)`` into windows of at most ``stage`` bytes: for each, ``(begin,
    end, parts)`` with parts ``(tensor, offset in the tensor, offset in the window, length)``. ``items``
    are ``(tensor, byte offset in the destination)`` and must tile the destination exactly."""
    spans = sorted(((at, ref) for ref, at in items if ref.nbytes), key=lambda x: x[0])
    pos = 0
    for at, ref in spans:
        if at != pos:
            raise ValueError(f"{ref.name}: lands at byte {at} of the destination, expected {pos} (gap or overlap)")
        pos += ref.nbytes
    if pos != total:
        raise ValueError(f"the tensors fill {pos} bytes of a {total}-byte destination")
    out: list[tuple[int, int, list[tuple[TensorRef, int, int, int]]]] = []
    i = 0
    for w0 in range(0, total, stage):
        w1 = min(total, w0 + stage)
        parts = []
        while i < len(spans) and spans[i][0] < w1:
            at, ref = spans[i]
            a, b = max(at, w0), min(at + ref.nbytes, w1)
            parts.append((ref, a - at, a - w0, b - a))
            if at + ref.nbytes <= w1:
                i += 1
            else:
                break  # the tensor goes on into the next window
        out.append((w0, w1, parts))
    return out


def read_to_device(items: list[tuple[TensorRef, int]], out: torch.Tensor) -> None:
    """Fill ``out``, a contiguous uint8 CUDA tensor, with the tensors' bytes, each at its byte offset
    (together they cover ``out`` exactly). Returns once every byte is on the device."""
    import torch

    if out.dtype != torch.uint8 or not out.is_cuda or not out.is_contiguous():
        raise ValueError("read_to_device needs a contiguous uint8 CUDA tensor")
    flat = out.view(-1)
    stream, done = _stream(out.device)
    with STAGES.take(out.device) as bufs:
        used = [False, False]
        try:
            for n, (w0, w1, parts) in enumerate(plan_windows(items, flat.numel(), int(bufs[0].numel()))):
                k = n % 2
                if used[k]:
                    done[k].synchronize()  # this buffer's last copy to the device has finished
                view = tensor_view(bufs[k])
                read_parts([(ref, view[w:w + length], off) for ref, off, w, length in parts])
                with torch.cuda.stream(stream):
                    flat[w0:w1].copy_(bufs[k][:w1 - w0], non_blocking=True)
                    done[k].record(stream)
                used[k] = True
        finally:
            stream.synchronize()  # no copy may still read a stage that another read takes next
