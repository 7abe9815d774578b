"""The streaming shard writer: ``ShardStream`` writes a new file as its tensors are produced, in a
``Container`` (safetensors here; GGUF's header and alignment come from ``sources/gguf.py``)."""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

from mxfp4conv.device import device_write
from mxfp4conv.files.safetensors.dtypes import ITEMSIZE
from mxfp4conv.files.safetensors.items import (
    BATCH_BYTES,
    BATCH_SLICES,
    Ahead,
    CheckRange,
    FileSlice,
    InflightBudget,
    Written,
)
from mxfp4conv.files.safetensors.writer_threads import BackgroundWriter

__all__ = ["SAFETENSORS", "Container", "ShardStream", "stream_safetensors"]

def _header_bytes(entries: list[tuple[str, str, tuple[int, ...], int]],
                  metadata: dict[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    off = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


class Container(Protocol):
    """The file format ``ShardStream`` writes: its header, and the padding after each tensor's bytes."""

    def header(self, sized: list[tuple[str, str, tuple[int, ...], int]], metadata: Any) -> bytes: ...

    def pad(self, nbytes: int) -> int:
        """Zero bytes written after a tensor of ``nbytes`` (each tensor's data starts aligned)."""
        ...


class _Safetensors:
    @staticmethod
    def header(sized: list[tuple[str, str, tuple[int, ...], int]], metadata: Any) -> bytes:
        return _header_bytes(sized, metadata)

    @staticmethod
    def pad(nbytes: int) -> int:
        return 0


SAFETENSORS: Container = _Safetensors()


class ShardStream:
    """A new safetensors file, written as its tensors are produced: the header at once (``entries``
    declares (name, dtype, shape) in file order), then ``feed`` each tensor's bytes in that order,
    then ``finish``. Writing and hashing run on background threads (both release the GIL),
    overlapping with the producer's reading and transforming; bytes queued for writing count against
    ``budget`` (1 GiB by default; the hasher reads computed bytes back from the file once written and
    holds none). A ``CheckRange`` fed between tensors queues a check of the bytes since the previous
    one, run on a third thread once they are written. Several streams can be open at once, fed by one
    producer in any interleaving: each file has its own threads, so their sha256s run in parallel.
    Tensors on a GPU are written from there: consecutive ones are gathered into one device buffer,
    which the writer thread copies back a few MB at a time (``device_write``; no host budget held)."""

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: Any = None, budget: InflightBudget | None = None,
                 container: Container | None = None) -> None:
        container = container or SAFETENSORS
        self._sized = [(n, d, s, math.prod(s) * ITEMSIZE[d]) for n, d, s in entries]
        self._pads = [container.pad(s[3]) for s in self._sized]  # zero bytes after each tensor (GGUF alignment)
        self._writer = BackgroundWriter(path, budget or InflightBudget())
        # Consecutive byte-range copies travel together, and so do consecutive computed buffers (one
        # hand-off, one writev and one read-back per batch: a ct output has ~800 tensors per MoE layer).
        self._slices: list[FileSlice] = []
        self._bufs: list[bytes | memoryview] = []
        self._held = 0  # bytes of the batch being gathered
        self._dev: list[torch.Tensor] = []  # consecutive tensors on a GPU: written through device_write
        self._count = 0
        try:
            head = container.header(self._sized, metadata)
            self._writer.put(head)
        except BaseException:
            self._writer.abort()
            raise
        self._pos = self._checked = len(head)  # file offset of the next byte; end of the last checked range
        self._starts = list(itertools.accumulate((s[3] + p for s, p in zip(self._sized, self._pads, strict=True)),
                                                 initial=len(head)))  # tensor offsets
        self._ahead: dict[int, tuple[int, int]] = {}  # written ahead: first tensor -> (tensors, end offset)

    def _flush(self) -> None:
        if self._slices:
            self._writer.put(tuple(self._slices))
        if self._bufs:
            self._writer.put(self._bufs)
        self._put_device()
        self._slices, self._bufs, self._held = [], [], 0

    def _put_device(self) -> None:
        if self._dev:
            span = device_write.gather(self._dev)
            self._dev = []
            self._writer.put(span)

    def flush(self) -> int:
        """Hand the batch being gathered to the writer now (at the end of a unit, so that no part of
        it waits here while other files are fed); returns the file offset every fed byte ends at."""
        self._flush()
        return self._pos

    def wait_written(self, pos: int) -> None:
        """Block until the file's bytes up to ``pos`` are written (their buffers released), or raise
        the error the shard's threads met."""
        self._writer.wait_written(pos)

    def feed(self, item: bytes | torch.Tensor | FileSlice | tuple[FileSlice, ...] | CheckRange) -> None:
        """The next tensor's bytes (a buffer, a tensor on the host or a GPU, a source byte range, or source
        byte ranges one after the other), or a check marker."""
        w = self._writer
        if isinstance(item, CheckRange):
            self._flush()
            w.put_check(item, self._checked, self._pos)
            self._checked = self._pos
            return
        if self._count >= len(self._sized):
            raise AssertionError(f"planned {len(self._sized)} tensors, produced more")
        pad = self._pads[self._count]
        self._feed_tensor(item, *self._sized[self._count])
        if pad:
            self._put_device()
            self._feed_bytes(b"\0" * pad)

    def _feed_tensor(self, item: bytes | torch.Tensor | FileSlice | tuple[FileSlice, ...], name: str, dtype: str,
                     shape: tuple[int, ...], nbytes: int) -> None:
        w = self._writer
        self._count += 1
        if isinstance(item, tuple):  # a tensor stacked from several source tensors (--to mlx experts)
            if (size := sum(s.length for s in item)) != nbytes:
                raise AssertionError(f"{name}: produced {size} bytes, planned {nbytes} ({dtype}{list(shape)})")
            self._put_device()
            for s in item:
                self._slice(s)
            return
        if device_write.is_device_tensor(item):
            assert not isinstance(item, bytes | FileSlice)
            size = item.numel() * item.element_size()
            if size != nbytes:
                raise AssertionError(f"{name}: produced {size} bytes, planned {nbytes} ({dtype}{list(shape)})")
            if self._slices:
                w.put(tuple(self._slices))
            if self._bufs:
                w.put(self._bufs)
            self._slices, self._bufs, self._held = [], [], 0
            self._pos += size
            self._dev.append(item)
            return
        self._put_device()
        raw = item if isinstance(item, FileSlice) else _as_bytes(item)
        size = raw.length if isinstance(raw, FileSlice) else len(raw)
        if size != nbytes:
            raise AssertionError(f"{name}: produced {size} bytes, planned {nbytes} ({dtype}{list(shape)})")
        if isinstance(raw, FileSlice):
            self._slice(raw)
            return
        self._feed_bytes(raw)

    def _feed_bytes(self, raw: bytes | memoryview) -> None:
        w = self._writer
        size = len(raw)
        self._pos += size
        if self._slices:
            w.put(tuple(self._slices))
            self._slices, self._held = [], 0
        if size:
            self._bufs.append(raw)
            self._held += size
        if len(self._bufs) >= BATCH_SLICES or self._held >= BATCH_BYTES:
            w.put(self._bufs)
            self._bufs, self._held = [], 0

    def _slice(self, raw: FileSlice) -> None:
        w = self._writer
        self._pos += raw.length
        if self._bufs:
            w.put(self._bufs)
            self._bufs, self._held = [], 0
        self._slices.append(raw)
        self._held += raw.length
        if len(self._slices) >= BATCH_SLICES or self._held >= BATCH_BYTES:
            w.put(tuple(self._slices))
            self._slices, self._held = [], 0

    def write_ahead(self, index: int, tensors: list[torch.Tensor], check: CheckRange | None) -> None:
        """Queue host tensors ``index, index + 1, ...`` to be written at their place in the file, ahead
        of tensors before them still to come, and ``check`` of their bytes once they are there (the
        writer thread's, so the caller goes on converting); ``feed_written`` then takes their turn in
        the file's order, and the hasher reads them back."""
        bufs: list[bytes | memoryview] = []
        for k, t in enumerate(tensors):
            name, dtype, shape, nbytes = self._sized[index + k]
            raw = _as_bytes(t)
            if len(raw) != nbytes:
                raise AssertionError(f"{name}: produced {len(raw)} bytes, planned {nbytes} ({dtype}{list(shape)})")
            bufs.append(raw)
            if pad := self._pads[index + k]:
                bufs.append(b"\0" * pad)
        end = self._starts[index + len(tensors)]
        self._writer.put_ahead(Ahead(bufs, self._starts[index], end, check))
        self._ahead[index] = (len(tensors), end)

    def feed_written(self, count: int) -> None:
        """The next ``count`` tensors, written ahead by ``write_ahead``."""
        if self._ahead.pop(self._count, None) != (count, self._starts[self._count + count]):
            raise AssertionError(f"tensors {self._count}..{self._count + count - 1} were not written ahead")
        self._flush()
        begin, end = self._pos, self._starts[self._count + count]
        self._count += count
        self._pos = end
        if self._checked == begin:  # checked when written
            self._checked = end
        self._writer.put(Written(end - begin))

    def finish(self) -> Future[str]:
        """Queue the last batch; the future resolves to the file's sha256 once its writer, hasher and
        check threads are done and it is fsynced, or to the error they met (``OutputError`` for the
        destination; ``InputError`` for a source that changed while copied or a copied E8M0 scale byte
        0xFF; whatever a check raised). The caller must wait for it before using or removing the file."""
        try:
            if self._count != len(self._sized):
                raise AssertionError(f"planned {len(self._sized)} tensors, produced {self._count}")
            self._flush()
        except BaseException:
            self._writer.abort()
            raise
        done: Future[str] = Future()
        writer = self._writer

        def close() -> None:
            try:
                done.set_result(writer.close())
            except BaseException as exc:
                done.set_exception(exc)

        threading.Thread(target=close, name="mxfp4conv-finish", daemon=True).start()
        return done

    def abort(self) -> None:
        """Stop the file's threads (after an error elsewhere); the caller removes the file."""
        self._writer.abort()


def stream_safetensors(path: Path, entries: list[tuple[str, str, tuple[int, ...]]],
                       data: Iterable[bytes | torch.Tensor | FileSlice | CheckRange],
                       metadata: dict[str, str] | None = None,
                       budget: InflightBudget | None = None) -> Future[str]:
    """Stream ``data`` (one item per entry, in file order, ``CheckRange`` markers between them) into a
    new safetensors file; returns ``ShardStream.finish``'s future as soon as every item is queued."""
    stream = ShardStream(path, entries, metadata, budget)
    try:
        for item in data:
            stream.feed(item)
    except BaseException:
        stream.abort()
        raise
    return stream.finish()


def _as_bytes(item: bytes | torch.Tensor) -> bytes | memoryview:
    """A computed item's bytes without a copy when it is a contiguous CPU byte tensor (every FP4
    output: ~800 per MoE layer, so the ~30 us of the general path's calls add up on the producer)."""
    if isinstance(item, bytes):
        return item
    import torch

    if (item.dtype == torch.uint8 and item.device.type == "cpu" and item.is_contiguous() and item.numel()
            and not item.requires_grad):
        return memoryview(item.numpy()).cast("B")  # type: ignore[arg-type]
    t = item.detach().contiguous().cpu()
    if t.numel() == 0:
        return b""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
