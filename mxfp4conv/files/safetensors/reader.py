"""Header-only safetensors reading and lazy per-tensor loads.

A checkpoint is enumerated from the 8-byte length + JSON header of each shard; tensor data is read
only when ``TensorRef.load()`` is called, with ``os.pread`` on the exact byte range. Every header
is validated before use (size limits, JSON object without duplicate keys, known dtypes, offsets
inside the data area and not overlapping, byte length equal to shape x dtype size), so a hostile
file produces an ``InputError`` naming the file and tensor, never a crash or a huge allocation.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from mxfp4conv.errors import InputError
from mxfp4conv.files.safetensors.dtypes import ITEMSIZE, no_duplicates, torch_dtype
from mxfp4conv.files.source import LOCAL, ByteSource

__all__ = [
    "MAX_HEADER_BYTES",
    "TensorRef",
    "header_length",
    "parse_header",
    "read_full",
    "read_header",
    "read_many",
    "read_parts",
    "runs",
    "tensor_view",
]

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

@dataclass(frozen=True)
class TensorRef:
    """A tensor in a safetensors file, known from the header only."""

    file: Path
    name: str
    dtype: str  # safetensors dtype string, e.g. "U8", "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte
    source: ByteSource = field(default=LOCAL, compare=False, repr=False)  # where the file's bytes are

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    def _read_into(self, buf: memoryview) -> None:
        read_many([(self, buf)])

    def read_part(self, buf: memoryview, offset: int) -> None:
        """Read the tensor's bytes ``[offset, offset + len(buf))`` into ``buf``; a short read (the
        file shrank under us) raises ``InputError`` naming the file and the tensor."""
        if self.source.read_into(self.file, self.begin + offset, [buf]) < len(buf):
            raise InputError("file ended inside the tensor's data (truncated shard?)",
                             file=str(self.file), tensor=self.name, hint="download the shard again")

    def read_bytes(self) -> bytes:
        """The raw bytes of the tensor (exactly ``nbytes``)."""
        buf = bytearray(self.nbytes)
        self._read_into(memoryview(buf))
        return bytes(buf)

    def read_into(self, out: torch.Tensor) -> None:
        """Read the tensor's bytes into ``out`` (a contiguous CPU tensor of exactly ``nbytes``)."""
        if not out.is_contiguous() or out.numel() * out.element_size() != self.nbytes:
            raise ValueError(f"{self.name}: destination of {out.numel() * out.element_size()} bytes, need {self.nbytes}")
        if self.nbytes:
            self._read_into(tensor_view(out))

    def load(self) -> torch.Tensor:
        """Read the tensor (CPU, own memory), with one copy from the page cache into the tensor."""
        import torch

        dtype = torch_dtype(self.dtype)
        raw = torch.empty(self.nbytes, dtype=torch.uint8)
        if self.nbytes:
            self._read_into(tensor_view(raw))
        return raw.view(dtype).reshape(self.shape)


def tensor_view(out: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    import torch

    return memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def read_full(fd: int, buf: memoryview, pos: int) -> int:
    """Read ``len(buf)`` bytes of ``fd`` from ``pos`` into ``buf`` (a short read is legal: loop); how
    many there were, fewer only where the file ends."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], pos + done)
        if got <= 0:
            break
        done += got
    return done


# Reads are split into pieces of at most READ_PIECE bytes that run on a shared pool of
# READ_THREADS threads (``preadv`` releases the GIL): one thread copies from the page cache at a
# fraction of the memory bandwidth, and a unit is made of many tensors (a Qwen3-30B-A3B layer: 1,536).
READ_PIECE = 16 << 20
READ_THREADS = max(1, min(8, os.cpu_count() or 1))
_pool_lock = threading.Lock()
_read_pool: Any = None


def _pool() -> Any:
    global _read_pool
    with _pool_lock:
        if _read_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _read_pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="mxfp4conv-io")
        return _read_pool


def read_many(items: list[tuple[TensorRef, memoryview]]) -> None:
    """Read each tensor's bytes into its buffer (exactly ``nbytes`` long), in parallel pieces."""
    for ref, buf in items:
        if len(buf) != ref.nbytes:
            raise ValueError(f"{ref.name}: destination of {len(buf)} bytes, need {ref.nbytes}")
    read_parts([(ref, buf, 0) for ref, buf in items])


def read_parts(items: list[tuple[TensorRef, memoryview, int]]) -> None:
    """Read each ``(tensor, buffer, offset)``: the tensor's bytes ``[offset, offset + len(buffer))``.
    Ranges that follow each other in a file are read by one scatter ``preadv`` (``runs``): a unit's
    tensors lie next to each other in its shard, and one call per tensor was ~3 syscalls and several
    GIL hand-offs each, 1,536 times per Qwen3-30B-A3B layer. Runs of at most READ_PIECE bytes go to
    the shared pool."""
    todo = runs(items)
    if len(todo) <= 1 or READ_THREADS == 1:
        for run in todo:
            _read_run(run)
    else:
        list(_pool().map(_read_run, todo))


# At most this many buffers per preadv (Linux's IOV_MAX is 1024).
MAX_IOV = 512


def runs(items: list[tuple[TensorRef, memoryview, int]]) -> list[list[tuple[TensorRef, memoryview, int]]]:
    """``items`` (see ``read_parts``) as runs: each run's parts follow one another in one file, with
    at most READ_PIECE bytes and MAX_IOV parts per run (a part longer than READ_PIECE is cut)."""
    parts = sorted(((ref, buf[o:o + READ_PIECE], at + o) for ref, buf, at in items if len(buf)
                    for o in range(0, len(buf), READ_PIECE)), key=lambda p: (str(p[0].file), p[0].begin + p[2]))
    out: list[list[tuple[TensorRef, memoryview, int]]] = []
    size = 0
    for p in parts:
        if out:
            last = out[-1][-1]
            if (last[0].file == p[0].file and last[0].begin + last[2] + len(last[1]) == p[0].begin + p[2]
                    and size + len(p[1]) <= READ_PIECE and len(out[-1]) < MAX_IOV
                    and _plain(last[0]) and _plain(p[0])):
                out[-1].append(p)
                size += len(p[1])
                continue
        out.append([p])
        size = len(p[1])
    return out


def _plain(ref: TensorRef) -> bool:
    """Whether the tensor is read from its file as ``TensorRef`` reads (not by a subclass of its own)."""
    return type(ref).read_part is TensorRef.read_part


def _read_run(run: list[tuple[TensorRef, memoryview, int]]) -> None:
    """One run (``runs``): a scatter read from its file, looped over short reads; a read that ends
    early (the file shrank under us) raises ``InputError`` naming the file and the tensor it ended in."""
    first = run[0][0]
    if len(run) == 1:
        first.read_part(run[0][1], run[0][2])
        return
    bufs = [p[1] for p in run]
    got = first.source.read_into(first.file, first.begin + run[0][2], bufs)
    if got < sum(len(b) for b in bufs):
        at = 0
        for ref, buf, _ in run:  # the tensor the file ended in
            if got < at + len(buf):
                raise InputError("file ended inside the tensor's data (truncated shard?)",
                                 file=str(first.file), tensor=ref.name, hint="download the shard again")
            at += len(buf)


def read_header(path: Path) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """Parse and validate one shard's header. Returns (tensors by name, ``__metadata__``)."""
    fname = str(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise InputError("not a regular file", file=fname, hint="replace it with the real shard file")
        size = st.st_size
        with open(path, "rb") as fh:
            n = header_length(fh.read(8), size, fname)
            raw = fh.read(n)
    except OSError as exc:
        raise InputError(f"cannot read shard: {exc.strerror}", file=fname) from exc
    return _decode_header(raw, 8 + n, size, path)


def header_length(head: bytes, size: int, fname: str) -> int:
    """The header length a shard's first 8 bytes give, checked against the limit and the file's
    ``size``: the JSON header is the ``n`` bytes after those 8."""
    if len(head) < 8:
        raise InputError(f"file is {size} bytes, too short for a safetensors header",
                         file=fname, hint="the shard is truncated; download it again")
    n = int.from_bytes(head[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise InputError(f"header length {n} is over the {MAX_HEADER_BYTES} byte limit",
                         file=fname, hint="the file is corrupt or not a safetensors file")
    if 8 + n > size:
        raise InputError(f"header length {n} is larger than the file ({size} bytes)",
                         file=fname, hint="the shard is truncated or corrupt; download it again")
    return n


def parse_header(data: bytes, size: int, path: Path,
                 source: ByteSource = LOCAL) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """:func:`read_header` from bytes: ``data`` holds the shard's first bytes (at least the 8-byte
    length and the header, perhaps more), ``size`` is the whole file's size, ``path`` names the file
    in the refs and in errors (a remote file's name, say), ``source`` where its bytes are."""
    fname = str(path)
    n = header_length(data[:8], size, fname)
    if len(data) < 8 + n:
        raise InputError(f"{len(data)} bytes given for a header that ends at byte {8 + n}", file=fname,
                         hint="the shard is truncated; download it again")
    return _decode_header(data[8:8 + n], 8 + n, size, path, source)


def _decode_header(raw: bytes, data_start: int, size: int, path: Path,
                   source: ByteSource = LOCAL) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """The JSON header ``raw`` of a file of ``size`` bytes whose data area starts at ``data_start``."""
    fname = str(path)
    try:
        header = json.loads(raw, object_pairs_hook=no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise InputError(f"header is not valid JSON ({exc})", file=fname,
                         hint="the shard is corrupt; download it again") from exc
    if not isinstance(header, dict):
        raise InputError("header is not a JSON object", file=fname, hint="the shard is corrupt")
    data_len = size - data_start
    meta_raw = header.pop("__metadata__", None)
    if meta_raw is None:
        meta_raw = {}
    if not isinstance(meta_raw, dict) or not all(isinstance(v, str) for v in meta_raw.values()):
        raise InputError("__metadata__ must map strings to strings", file=fname)
    tensors: dict[str, TensorRef] = {}
    for name, entry in header.items():
        tensors[name] = _parse_entry(fname, path, name, entry, data_start, data_len, source)
    if not _in_order(tensors.values()):  # headers list their tensors in file order: the sort is rare
        spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.nbytes)
        for (_, e0, n0), (b1, _, n1) in itertools.pairwise(spans):
            if b1 < e0:
                raise InputError(f"data of tensors {n0} and {n1} overlap", file=fname, tensor=n1,
                                 hint="the shard is corrupt; download it again")
    return tensors, dict(meta_raw)


def _in_order(refs: Iterable[TensorRef]) -> bool:
    """Whether the non-empty tensors, in this order, start where or after the previous one ends: then
    none overlap (and the sorted check would find nothing)."""
    end = 0
    for t in refs:
        if t.end > t.begin:
            if t.begin < end:
                return False
            end = t.end
    return True


_MAX_DIM = 2**48


def _parse_entry(fname: str, path: Path, name: str, entry: Any, data_start: int,
                 data_len: int, source: ByteSource = LOCAL) -> TensorRef:
    # Fast path (every entry of a valid header; ~75K per Qwen3-30B-A3B): the checks below by exact
    # types (JSON ints are int, never bool) in a few C-level calls; anything else takes the checks
    # that name the problem.
    if type(entry) is dict:
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if (type(dtype) is str and dtype in ITEMSIZE and type(shape) is list and len(shape) <= 8
                and type(offs) is list and len(offs) == 2 and type(offs[0]) is int and type(offs[1]) is int
                and (not shape or ({*map(type, shape)} == {int} and min(shape) >= 0 and max(shape) < _MAX_DIM))):
            b, e = offs
            if 0 <= b <= e <= data_len and e - b == math.prod(shape) * ITEMSIZE[dtype]:
                return TensorRef(path, name, dtype, tuple(shape), data_start + b, data_start + e, source)
    return _checked_entry(fname, path, name, entry, data_start, data_len, source)


def _checked_entry(fname: str, path: Path, name: str, entry: Any, data_start: int,
                   data_len: int, source: ByteSource = LOCAL) -> TensorRef:
    if not isinstance(entry, dict):
        raise InputError("header entry is not an object", file=fname, tensor=name)
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise InputError(f"unknown dtype {dtype!r}", file=fname, tensor=name)
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in shape)):
        raise InputError(f"invalid shape {shape!r}", file=fname, tensor=name)
    if (not isinstance(offs, list) or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
        raise InputError(f"invalid data_offsets {offs!r}", file=fname, tensor=name)
    b, e = offs
    if not 0 <= b <= e <= data_len:
        raise InputError(f"data_offsets [{b}, {e}] lie outside the data area ({data_len} bytes)",
                         file=fname, tensor=name, hint="the shard is truncated or corrupt; download it again")
    expect = math.prod(shape) * ITEMSIZE[dtype]
    if e - b != expect:
        raise InputError(f"holds {e - b} bytes but dtype {dtype} x shape {shape} needs {expect}",
                         file=fname, tensor=name, hint="the shard is corrupt")
    return TensorRef(path, name, dtype, tuple(shape), data_start + b, data_start + e, source)
