"""Header-only safetensors reading, lazy per-tensor loads, and a streaming shard writer.

One module: the reader and the writer share the FileSlice / TensorRef types, the dtype tables and
the short-read handling, and the writer's three threads (write, hash, check) and their batching are
one unit of behaviour that its tests exercise together.

A checkpoint is enumerated from the 8-byte length + JSON header of each shard; tensor data is read
only when ``TensorRef.load()`` is called, with ``os.pread`` on the exact byte range. Every header
is validated before use (size limits, JSON object without duplicate keys, known dtypes, offsets
inside the data area and not overlapping, byte length equal to shape x dtype size), so a hostile
file produces an ``InputError`` naming the file and tensor, never a crash or a huge allocation.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import json
import math
import os
import queue
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

from mxfp4conv.device import device_write
from mxfp4conv.device.device_write import DeviceBytes
from mxfp4conv.errors import InputError, OutputError
from mxfp4conv.files import hash_native
from mxfp4conv.files.source import LOCAL, ByteSource

__all__ = [  # and DTYPES, built lazily by the module __getattr__
    "CHECK_HOOK",
    "ITEMSIZE",
    "MAX_HEADER_BYTES",
    "MAX_JSON_BYTES",
    "SAFETENSORS",
    "CheckRange",
    "Container",
    "FileSlice",
    "InflightBudget",
    "ShardStream",
    "TensorRef",
    "header_length",
    "load_json",
    "parse_header",
    "read_full",
    "read_header",
    "read_many",
    "read_parts",
    "runs",
    "stream_safetensors",
    "tensor_view",
]

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json, index, hf_quant_config.json

# safetensors dtype string -> bytes per element (torch is not needed to read headers or copy bytes)
ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8,
    "F16": 2, "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}
_TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}


@lru_cache(maxsize=1)
def _dtypes() -> dict[str, tuple[torch.dtype, int]]:
    import torch

    return {k: (getattr(torch, _TORCH_NAMES[k]), n) for k, n in ITEMSIZE.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string (imports torch)."""
    return _dtypes()[name][0]


def __getattr__(name: str) -> Any:
    """``DTYPES`` (safetensors dtype -> (torch dtype, bytes per element)), built on first use so that
    importing this module does not import torch."""
    if name == "DTYPES":
        return _dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype."""
    return {v[0]: k for k, v in _dtypes().items()}[dtype]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # called for every JSON object of a header (~75K in a Qwen3-30B-A3B): C speed
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return out


def load_json(path: Path, *, what: str = "JSON file") -> dict[str, Any]:
    """Read a JSON object with a size limit and no duplicate keys."""
    try:
        st = path.stat()
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror}", file=str(path)) from exc
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} is not a regular file", file=str(path), hint="replace it with the real file")
    size = st.st_size
    if size > MAX_JSON_BYTES:
        raise InputError(f"{what} is {size} bytes, over the {MAX_JSON_BYTES} byte limit", file=str(path))
    try:
        data = json.loads(path.read_bytes(), object_pairs_hook=_no_duplicates)
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror}", file=str(path)) from exc
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise InputError(f"{what} is not valid JSON ({exc})", file=str(path),
                         hint="restore the file from the original release") from exc
    if not isinstance(data, dict):
        raise InputError(f"{what} is not a JSON object", file=str(path))
    return data


@dataclass(frozen=True)
class FileSlice:
    """Bytes to copy unchanged from a source file into an output shard (lossless fast path)."""

    file: Path
    begin: int
    length: int
    name: str = ""  # the source tensor (for error messages)
    # MXFP4 E8M0 scales: the byte 0xFF (NaN) is invalid input. Checked by the hasher thread, which
    # reads every copied byte from its source anyway (an InputError naming file and tensor fails the shard).
    e8m0: bool = False
    source: ByteSource = field(default=LOCAL, compare=False, repr=False)  # where the file's bytes are


@dataclass(frozen=True)
class CheckRange:
    """A marker in a shard's data stream (not a tensor): once every byte before it is in the file, the
    shard's check thread calls ``fn(fd, begin, end)`` with a read-only descriptor of the shard and the
    byte range since the previous marker (or the end of the header). ``hold``: host bytes the check
    keeps alive until it has run (they count against the writer's in-flight budget meanwhile). An
    exception from ``fn`` fails the shard."""

    fn: Callable[[int, int, int], None]
    hold: int = 0


@dataclass(frozen=True)
class _Written:
    """Bytes already at their place in the file (``ShardStream.write_ahead``): the writer moves past them."""

    length: int


@dataclass(frozen=True)
class _Ahead:
    """Buffers the writer thread writes at file offset ``begin`` (``ShardStream.write_ahead``), ahead of
    bytes before them; then it queues ``check`` of ``[begin, end)``."""

    bufs: list[bytes | memoryview]
    begin: int
    end: int
    check: CheckRange | None


# Called on the check thread as (shard path, begin, end) just before a range is checked: a test hook
# (tests flip a staged byte here, between the write and the check). None in normal use.
CHECK_HOOK: Callable[[Path, int, int], None] | None = None


COPY_CHUNK = 16 << 20
# The hasher's read size. Each pread and each sha256 call gives the GIL back, and taking it back waits
# up to the switch interval (5 ms) while the producer runs Python (the GPU path's readers and
# encoder), so small chunks collapse under contention: 1 MiB hashed at 1.25 GB/s alone but 0.09 GB/s
# beside a Python-busy thread, 16 MiB at 0.74-1.12 GB/s alone and 0.65 beside it. 1 MiB chunks are
# 3-6% faster alone, but in a 48-layer GPU conversion they made the hash stage 30-50% slower. This is
# the hashlib path's read size: by default (MXFP4CONV_HASHER=auto) a range is hashed in one GIL-free
# call of the native hasher instead (mxfp4conv/files/hash_native.py, reading hash_native.CHUNK at a
# time), with hashlib as the fallback.
HASH_CHUNK = 16 << 20
# How the writer thread copies a source byte range: "copy_file_range" (kernel-side, the default where
# Python has it: Linux), or "readwrite" (pread into a reused buffer, then write). A filesystem pair
# that refuses copy_file_range (EXDEV, EINVAL, EOPNOTSUPP, ENOSYS) falls back to read/write on the
# spot. Either way the hasher thread reads the same range from the source itself. Measured in BENCHMARKS.md.
COPY_MODE = os.environ.get("MXFP4CONV_COPY", "copy_file_range" if hasattr(os, "copy_file_range") else "readwrite")
_NO_CFR = {errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, errno.ENOTSUP}
# Byte-range copies, and computed buffers, are handed to the writer thread in batches of up to
# BATCH_SLICES items / BATCH_BYTES bytes: each hand-off costs ~40 us of thread switching, a ct-mxfp4
# rename copies ~10,000 small tensors, and a ct output has ~800 per MoE layer. BATCH_SLICES also
# stays under the kernel's IOV_MAX (1024 buffers per writev).
BATCH_SLICES = 256
BATCH_BYTES = 64 << 20
WRITEBACK_CHUNK = 16 << 20  # start the disk writeback of every 16 MiB written (see _Writeback)


class _Writeback:
    """Starts the kernel's asynchronous writeback of each freshly written range (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the disk flushes while we keep producing and the
    fsync at publish finds little left; without it a shard smaller than the dirty-page threshold is
    flushed only by that fsync, after all the work (measured: ~2x a ``cp && sync``). No-op elsewhere."""

    _fn: Any = None

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._done = 0
        self._pos = 0
        if _Writeback._fn is None:
            _Writeback._fn = False
            if sys.platform.startswith("linux"):
                with contextlib.suppress(OSError, AttributeError):
                    fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                    _Writeback._fn = fn

    def advance(self, n: int) -> None:
        self._pos += n
        if self._fn and self._pos - self._done >= WRITEBACK_CHUNK:
            self._fn(self._fd, self._done, self._pos - self._done, 2)  # SYNC_FILE_RANGE_WRITE; best effort
            self._done = self._pos


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
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
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


class InflightBudget:
    """Bytes queued for writing, shared by the shards being written at once (shards still finishing
    their hash while the next one is produced): the producer waits while the total
    would exceed ``limit`` (one item larger than the limit is let through when nothing is queued).
    It also sums the shards' busy seconds: ``seconds["write"]`` (writer threads writing and copying)
    and ``seconds["hash"]`` (hasher threads reading and hashing), added as each shard closes."""

    def __init__(self, limit: int = 1 << 30) -> None:
        self.limit = limit
        self.used = 0
        self.cond = threading.Condition()
        self.seconds: dict[str, float] = {"write": 0.0, "hash": 0.0}


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
        self._writer = _BackgroundWriter(path, budget or InflightBudget())
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
        self._writer.put_ahead(_Ahead(bufs, self._starts[index], end, check))
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
        self._writer.put(_Written(end - begin))

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


def copy_runs(slices: tuple[FileSlice, ...]) -> list[tuple[FileSlice, tuple[FileSlice, ...]]]:
    """Consecutive non-empty slices that are also adjacent in the same source file, merged into one
    copy (a ct-mxfp4 rename keeps an expert's packed weight and its scales together: ~3x fewer, larger
    copies): (run, the slices it is made of)."""
    runs: list[tuple[FileSlice, tuple[FileSlice, ...]]] = []
    for s in slices:
        if not s.length:
            continue
        if runs and runs[-1][0].file == s.file and runs[-1][0].begin + runs[-1][0].length == s.begin:
            last, parts = runs[-1]
            runs[-1] = (FileSlice(last.file, last.begin, last.length + s.length, last.name, source=last.source),
                        (*parts, s))
        else:
            runs.append((s, (s,)))
    return runs


def _shrank(src: FileSlice, pos: int | None = None, parts: tuple[FileSlice, ...] = ()) -> InputError:
    """The error for a source that ended before ``src`` (at file offset ``pos``, inside one of ``parts``)."""
    src = next((p for p in parts if pos is not None and p.begin <= pos < p.begin + p.length), src)
    return InputError("file ended inside the tensor's data (truncated while being converted?)", file=str(src.file),
                      tensor=src.name or None, hint="the source changed during the conversion; download it again")


class _BackgroundWriter:
    """Three threads per shard, each taking the shard's items in order (the third runs the shard's
    ``CheckRange`` items once their bytes are in the file). The writer writes computed
    buffers and copies byte ranges from source files. The hasher hashes the shard's bytes: a copied
    range from its source, at once (the same bytes; it also checks ranges marked E8M0 for 0xFF), and a
    computed buffer by reading it back from the new file (the page cache) once the writer is past it.
    So a buffer's memory is released as soon as it is written and the producer waits for the disk
    only, never for the sha256 (one core's ~1-1.4 GB/s on an H200 host, slower than that host's
    pipeline: BENCHMARKS.md), and the hashers of shards still finishing run in parallel with the next
    shard's production. Errors surface on put/close."""

    def __init__(self, path: Path, budget: InflightBudget) -> None:
        # native (one GIL-free call per range) or hashlib, per MXFP4CONV_HASHER; first, as "native"
        # raises when it cannot be had
        self._digest = hash_native.sha256()
        self._native = isinstance(self._digest, hash_native.NativeSha256)
        try:
            self._fh = open(path, "xb", buffering=0)  # noqa: SIM115 - closed by close()/abort()
            self._rfd = os.open(path, os.O_RDONLY)  # the hasher's, to read computed bytes back
        except OSError as exc:
            with contextlib.suppress(AttributeError, OSError):
                self._fh.close()
            raise OutputError(f"cannot create shard: {exc.strerror}", file=str(path),
                              hint="check the destination folder's permissions and free space") from exc
        self._path = path
        self._wb = _Writeback(self._fh.fileno())
        self._wbuf: memoryview | None = None  # copy buffer of the writer thread
        self._cfr = COPY_MODE == "copy_file_range"  # cleared when the filesystems refuse it
        self._hbuf: bytearray | None = None  # read buffer of the hasher thread (hashlib path)
        self._nbuf: ctypes.Array[ctypes.c_char] | None = None  # the same, native path
        # source files open for the writer (0) and the hasher (1) thread, one descriptor per thread and
        # file for the shard's lifetime: a ct-mxfp4 rename copies ~10,000 small tensors
        self._fds: tuple[dict[Path, int | None], dict[Path, int | None]] = ({}, {})
        self._wq: queue.Queue[bytes | memoryview | list[bytes | memoryview] | tuple[FileSlice, ...] | DeviceBytes
                              | _Written | _Ahead | None] = queue.Queue()
        self._hq: queue.Queue[int | tuple[FileSlice, ...] | None] = queue.Queue()  # buffers by size
        self._cq: queue.Queue[tuple[CheckRange, int, int, bool] | None] = queue.Queue()  # ranges to check (, written ahead)
        self._checks = 0
        self._budget = budget
        self._error: BaseException | None = None
        self._cond = threading.Condition()  # guards _written (bytes the writer has finished) and _error
        self._written = 0
        self._busy = [0.0, 0.0, 0.0]  # seconds the writer / hasher / check thread worked (not waited)
        self._threads = [threading.Thread(target=self._write_loop, name="mxfp4conv-writer", daemon=True),
                         threading.Thread(target=self._hash_loop, name="mxfp4conv-hasher", daemon=True),
                         threading.Thread(target=self._check_loop, name="mxfp4conv-check", daemon=True)]
        for t in self._threads:
            t.start()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = self._error or exc
            self._cond.notify_all()

    def _write_loop(self) -> None:
        while (raw := self._wq.get()) is not None:
            ahead = isinstance(raw, _Ahead)
            size = _size(raw)
            held = 0 if isinstance(raw, tuple | DeviceBytes | _Written) else size  # those hold no host memory
            wrote = False
            try:
                if self._error is None:
                    t0 = time.perf_counter()
                    if isinstance(raw, tuple):
                        for run, parts in copy_runs(raw):
                            self._copy(run, parts)
                    elif isinstance(raw, DeviceBytes):
                        device_write.write_device(raw, self._write)
                    elif isinstance(raw, _Written):
                        os.lseek(self._fh.fileno(), raw.length, os.SEEK_CUR)
                        self._wb.advance(raw.length)
                    elif isinstance(raw, _Ahead):
                        self._write_at(raw.bufs, raw.begin)
                        if raw.check is not None:
                            self._cq.put((raw.check, raw.begin, raw.end, True))
                    else:
                        self._write(raw)
                    self._busy[0] += time.perf_counter() - t0
                    wrote = True
            except BaseException as exc:  # reported to the producer
                self._fail(exc)
            # the buffers are let go before anyone learns they are written (``wait_written``), so
            # their memory is free by then, and not held while the next item is awaited
            del raw
            if wrote and not ahead:  # ``_written`` counts the file's bytes in order
                with self._cond:
                    self._written += size
                    self._cond.notify_all()
            with self._budget.cond:
                self._budget.used -= held
                self._budget.cond.notify_all()

    def _hash_loop(self) -> None:
        pos = 0  # shard bytes hashed so far
        try:
            while (job := self._hq.get()) is not None:
                if self._error is not None:
                    continue  # drain to the end marker
                if isinstance(job, tuple):
                    t0 = time.perf_counter()
                    self._will_need(job)
                    for src in job:
                        fd = self._source(src, 1)
                        if fd is None:
                            self._hash_read(src)
                        else:
                            self._hash_range(fd, src.begin, src.length, src)
                        pos += src.length
                    self._busy[1] += time.perf_counter() - t0
                    continue
                with self._cond:  # a computed buffer: wait until it is in the file
                    while self._written < pos + job and self._error is None:
                        self._cond.wait()
                t0 = time.perf_counter()
                self._hash_range(self._rfd, pos, job, None)
                self._busy[1] += time.perf_counter() - t0
                pos += job
        except BaseException as exc:  # reported to the producer
            self._fail(exc)
            while self._hq.get() is not None:
                pass

    def _check_loop(self) -> None:
        """Run each queued check once its range is in the file; its held bytes are released after it."""
        while (job := self._cq.get()) is not None:
            chk, begin, end, ahead = job
            hold = chk.hold
            del job
            try:
                with self._cond:
                    while not ahead and self._written < end and self._error is None:
                        self._cond.wait()
                if self._error is None:
                    if CHECK_HOOK is not None:
                        CHECK_HOOK(self._path, begin, end)
                    t0 = time.perf_counter()
                    chk.fn(self._rfd, begin, end)
                    self._busy[2] += time.perf_counter() - t0
            except BaseException as exc:  # reported to the producer
                self._fail(exc)
            finally:
                # the check, and the unit its function holds, let go before its bytes leave the budget:
                # not kept alive while this shard's next check is awaited (one unit per open shard)
                del chk
                with self._budget.cond:
                    self._budget.used -= hold
                    self._budget.cond.notify_all()

    def _will_need(self, job: tuple[FileSlice, ...]) -> None:
        """Ask the kernel to start reading a batch's source ranges now (``POSIX_FADV_WILLNEED``: an
        asynchronous readahead of up to BATCH_BYTES), so a cold source is read with many requests in
        flight rather than one chunk at a time; cheap for cached pages, skipped where unsupported."""
        if not hasattr(os, "posix_fadvise"):
            return
        for run, _ in copy_runs(job):
            fd = self._source(run, 1)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, run.begin, run.length, os.POSIX_FADV_WILLNEED)

    def _hash_range(self, fd: int, pos: int, left: int, src: FileSlice | None) -> None:
        """Hash ``left`` bytes of ``fd`` from ``pos``: a copied slice's source range (``src``), or the
        shard's own bytes (``src`` None)."""
        if self._native:
            self._hash_range_native(fd, pos, left, src)
            return
        if self._hbuf is None:
            self._hbuf = bytearray(HASH_CHUNK)  # reused: no per-chunk allocation
        buf = self._hbuf
        view = memoryview(buf)
        while left and self._error is None:
            got = os.preadv(fd, [view[:min(left, HASH_CHUNK)]], pos)
            if got <= 0:
                if src is None:
                    raise OSError(errno.EIO, "the shard got shorter while being written")
                raise _shrank(src)
            if src is not None and src.e8m0 and buf.find(b"\xff", 0, got) >= 0:
                raise InputError("E8M0 scale byte 0xFF (NaN) is not a valid MXFP4 scale", file=str(src.file),
                                 tensor=src.name or None, hint="the checkpoint is corrupt; re-export it")
            self._hash_chunk(view[:got])
            pos += got
            left -= got

    def _hash_read(self, src: FileSlice) -> None:
        """``_hash_range`` of a copied slice whose bytes are not a local file: read through its source."""
        if self._hbuf is None:
            self._hbuf = bytearray(HASH_CHUNK)
        view = memoryview(self._hbuf)
        pos, left = src.begin, src.length
        while left and self._error is None:
            n = min(left, HASH_CHUNK)
            if src.source.read_into(src.file, pos, [view[:n]]) < n:
                raise _shrank(src)
            if src.e8m0 and self._hbuf.find(b"\xff", 0, n) >= 0:
                raise InputError("E8M0 scale byte 0xFF (NaN) is not a valid MXFP4 scale", file=str(src.file),
                                 tensor=src.name or None, hint="the checkpoint is corrupt; re-export it")
            self._digest.update(view[:n])
            pos += n
            left -= n

    def _hash_chunk(self, chunk: memoryview) -> None:
        self._digest.update(chunk)

    def _hash_range_native(self, fd: int, pos: int, left: int, src: FileSlice | None) -> None:
        """``_hash_range`` in one GIL-free call (reads, the E8M0 0xFF check and the sha256 in C)."""
        if self._nbuf is None:
            self._nbuf = hash_native.buffer()
        done, status = self._digest.hash_range(fd, pos, left, self._nbuf, src is not None and src.e8m0)
        if status == -1:
            assert src is not None
            raise InputError("E8M0 scale byte 0xFF (NaN) is not a valid MXFP4 scale", file=str(src.file),
                             tensor=src.name or None, hint="the checkpoint is corrupt; re-export it")
        if status == -2:
            raise RuntimeError("the native sha256 (EVP_DigestUpdate) failed")
        if status:
            raise OSError(status, os.strerror(status))
        if done < left:
            if src is None:
                raise OSError(errno.EIO, "the shard got shorter while being written")
            raise _shrank(src)

    def _source(self, src: FileSlice, thread: int) -> int | None:
        """The open file of ``src`` for the writer (0) or the hasher (1) thread; None where its bytes
        are not a local file (they are read through its ``ByteSource``)."""
        fds = self._fds[thread]
        if src.file not in fds:
            try:
                fds[src.file] = src.source.descriptor(src.file)
            except OSError as exc:
                raise InputError(f"cannot read the source: {exc.strerror}", file=str(src.file), tensor=src.name or None,
                                 hint="the source changed during the conversion; restore it and rerun") from exc
        return fds[src.file]

    def _write(self, raw: bytes | memoryview | list[bytes | memoryview]) -> None:
        """Write one buffer, or a batch of buffers (``writev``, resumed after a short write)."""
        views = [memoryview(raw)] if not isinstance(raw, list) else [memoryview(b) for b in raw]
        fd = self._fh.fileno()
        while views:
            n = os.writev(fd, views) if len(views) > 1 else self._fh.write(views[0])
            if not n:
                raise OSError(28, "No space left on device")
            self._wb.advance(n)
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if n:
                views[0] = views[0][n:]

    def _copy(self, src: FileSlice, parts: tuple[FileSlice, ...] = ()) -> None:
        fd = self._source(src, 0)
        pos, left = src.begin, src.length
        if fd is None:  # not a local file: read through its source, then written
            if self._wbuf is None:
                self._wbuf = memoryview(bytearray(COPY_CHUNK))
            while left:
                n = min(left, COPY_CHUNK)
                if src.source.read_into(src.file, pos, [self._wbuf[:n]]) < n:
                    raise _shrank(src, pos, parts)
                self._write(self._wbuf[:n])
                pos += n
                left -= n
            return
        while left and self._cfr:
            try:
                got = os.copy_file_range(fd, self._fh.fileno(), min(left, COPY_CHUNK), pos)
            except OSError as exc:
                if exc.errno not in _NO_CFR:
                    raise
                self._cfr = False  # this filesystem pair cannot: read/write from here on
                break
            if got <= 0:
                raise _shrank(src, pos, parts)
            pos += got
            left -= got
            self._wb.advance(got)
        if left and self._wbuf is None:
            self._wbuf = memoryview(bytearray(COPY_CHUNK))
        while left:
            buf = self._wbuf
            assert buf is not None
            got = os.preadv(fd, [buf[:min(left, COPY_CHUNK)]], pos)  # a short read is legal: loop
            if got <= 0:
                raise _shrank(src, pos, parts)
            self._write(buf[:got])
            pos += got
            left -= got

    def _raise(self) -> None:
        if isinstance(self._error, OSError):
            raise OutputError(f"cannot write shard: {self._error.strerror}", file=str(self._path),
                              hint="free disk space or choose another destination") from self._error
        if self._error is not None:
            raise self._error

    def put(self, raw: bytes | memoryview | list[bytes | memoryview] | tuple[FileSlice, ...] | DeviceBytes | _Written
            ) -> None:
        """Queue one buffer, a batch of buffers (a list), a batch of byte-range copies (a tuple), bytes
        on a GPU (``DeviceBytes``) or bytes written ahead (``_Written``)."""
        self._raise()
        size = 0 if isinstance(raw, tuple | DeviceBytes | _Written) else _size(raw)  # host memory held while queued
        b = self._budget
        with b.cond:
            while b.used and b.used + size > b.limit and self._error is None:
                b.cond.wait()
            b.used += size
        self._wq.put(raw)
        self._hq.put(raw if isinstance(raw, tuple) else _size(raw))  # computed bytes: read back once written

    def wait_written(self, pos: int) -> None:
        """Wait until the writer has written the file's first ``pos`` bytes; raise its error if any."""
        with self._cond:
            while self._written < pos and self._error is None:
                self._cond.wait()
        self._raise()

    def put_ahead(self, item: _Ahead) -> None:
        """Queue buffers to be written at their offset, and then their check (``_Ahead``): the buffers
        and the check's held bytes count against the budget until written and checked."""
        self._raise()
        size = _size(item) + (item.check.hold if item.check is not None else 0)
        b = self._budget
        with b.cond:
            while b.used and b.used + size > b.limit and self._error is None:
                b.cond.wait()
            b.used += size
        if item.check is not None:
            self._checks += 1
        self._wq.put(item)

    def _write_at(self, bufs: list[bytes | memoryview], pos: int) -> None:
        """Write ``bufs`` at file offset ``pos`` (``pwritev``: the writer's own position is not moved;
        the range is one it will skip)."""
        views = [memoryview(b) for b in bufs if len(b)]  # an empty tensor writes nothing (and pwritev would return 0)
        while views:
            n = os.pwritev(self._fh.fileno(), views[:BATCH_SLICES], pos)
            if not n:
                raise OSError(28, "No space left on device")
            pos += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if n:
                views[0] = views[0][n:]

    def put_check(self, chk: CheckRange, begin: int, end: int) -> None:
        """Queue a check of the file's bytes ``[begin, end)``, all of them already ``put``."""
        self._raise()
        b = self._budget
        with b.cond:
            while b.used and b.used + chk.hold > b.limit and self._error is None:
                b.cond.wait()
            b.used += chk.hold
        self._checks += 1
        self._cq.put((chk, begin, end, False))

    def _join(self) -> None:
        self._wq.put(None)
        self._hq.put(None)
        self._cq.put(None)
        for t in self._threads:
            t.join()
        with self._budget.cond:
            self._budget.seconds["write"] += self._busy[0]
            self._budget.seconds["hash"] += self._busy[1]
            if self._checks:
                self._budget.seconds["verify"] = self._budget.seconds.get("verify", 0.0) + self._busy[2]
        for fds in self._fds:
            for fd in fds.values():
                if fd is not None:
                    os.close(fd)
            fds.clear()
        with contextlib.suppress(OSError):
            os.close(self._rfd)

    def close(self) -> str:
        self._join()
        self._raise()
        try:
            os.fsync(self._fh.fileno())
            self._fh.close()
        except OSError as exc:
            self._error = exc
            self._raise()
        return self._digest.hexdigest()

    def abort(self) -> None:
        self._fail(RuntimeError("aborted"))
        self._join()
        with contextlib.suppress(OSError):
            self._fh.close()


def _size(raw: bytes | memoryview | list[bytes | memoryview] | tuple[FileSlice, ...] | DeviceBytes | _Written
          | _Ahead) -> int:
    """Bytes of a queued item: a buffer, a batch of buffers, a batch of copies, bytes on a GPU, bytes
    written ahead, or buffers to write ahead."""
    if isinstance(raw, tuple):
        return sum(s.length for s in raw)
    if isinstance(raw, _Written):
        return raw.length
    if isinstance(raw, _Ahead):
        return sum(len(b) for b in raw.bufs)
    if isinstance(raw, list):
        return sum(len(b) for b in raw)
    return len(raw)


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


