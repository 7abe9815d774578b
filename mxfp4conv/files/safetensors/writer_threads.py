"""The three threads behind each ``ShardStream`` (write, hash, check): one unit of behaviour that its
tests exercise together."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mxfp4conv.device import device_write
from mxfp4conv.device.device_write import DeviceBytes
from mxfp4conv.errors import InputError, OutputError
from mxfp4conv.files import hash_native
from mxfp4conv.files.safetensors.items import (
    BATCH_SLICES,
    Ahead,
    CheckRange,
    FileSlice,
    InflightBudget,
    Written,
    copy_runs,
)

__all__ = ["CHECK_HOOK", "BackgroundWriter"]

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


def _shrank(src: FileSlice, pos: int | None = None, parts: tuple[FileSlice, ...] = ()) -> InputError:
    """The error for a source that ended before ``src`` (at file offset ``pos``, inside one of ``parts``)."""
    src = next((p for p in parts if pos is not None and p.begin <= pos < p.begin + p.length), src)
    return InputError("file ended inside the tensor's data (truncated while being converted?)", file=str(src.file),
                      tensor=src.name or None, hint="the source changed during the conversion; download it again")


def _bad_scale(src: FileSlice) -> InputError:
    """The error for a copied E8M0 scale range of ``src`` holding the byte 0xFF (NaN)."""
    return InputError("E8M0 scale byte 0xFF (NaN) is not a valid MXFP4 scale", file=str(src.file),
                      tensor=src.name or None, hint="the checkpoint is corrupt; re-export it")


class BackgroundWriter:
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
                              | Written | Ahead | None] = queue.Queue()
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
            ahead = isinstance(raw, Ahead)
            size = _size(raw)
            held = 0 if isinstance(raw, tuple | DeviceBytes | Written) else size  # those hold no host memory
            wrote = False
            try:
                if self._error is None:
                    t0 = time.perf_counter()
                    if isinstance(raw, tuple):
                        for run, parts in copy_runs(raw):
                            self._copy(run, parts)
                    elif isinstance(raw, DeviceBytes):
                        device_write.write_device(raw, self._write)
                    elif isinstance(raw, Written):
                        os.lseek(self._fh.fileno(), raw.length, os.SEEK_CUR)
                        self._wb.advance(raw.length)
                    elif isinstance(raw, Ahead):
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
                raise _bad_scale(src)
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
                raise _bad_scale(src)
            self._digest.update(view[:n])
            pos += n
            left -= n

    def _hash_chunk(self, chunk: memoryview) -> None:
        self._digest.update(chunk)

    def _hash_range_native(self, fd: int, pos: int, left: int, src: FileSlice | None) -> None:
        """``_hash_range`` in one GIL-free call (reads, the E8M0 0xFF check and the sha256 in C)."""
        if self._nbuf is None:
            self._nbuf = hash_native.buffer()
        if src is None:  # the shard's own bytes: hashed in place (its pages were just written)
            done, status = self._digest.hash_mapped(fd, pos, left, self._nbuf)
        else:  # a source another program may change: read, so a shrunk file reads short, never faults
            done, status = self._digest.hash_range(fd, pos, left, self._nbuf, src.e8m0)
        if status == -1:
            assert src is not None
            raise _bad_scale(src)
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

    def _reserve(self, size: int) -> None:
        """Wait until ``size`` more bytes fit in the budget (or the shard failed), then count them."""
        b = self._budget
        with b.cond:
            while b.used and b.used + size > b.limit and self._error is None:
                b.cond.wait()
            b.used += size

    def put(self, raw: bytes | memoryview | list[bytes | memoryview] | tuple[FileSlice, ...] | DeviceBytes | Written
            ) -> None:
        """Queue one buffer, a batch of buffers (a list), a batch of byte-range copies (a tuple), bytes
        on a GPU (``DeviceBytes``) or bytes written ahead (``Written``)."""
        self._raise()
        size = 0 if isinstance(raw, tuple | DeviceBytes | Written) else _size(raw)  # host memory held while queued
        self._reserve(size)
        self._wq.put(raw)
        self._hq.put(raw if isinstance(raw, tuple) else _size(raw))  # computed bytes: read back once written

    def wait_written(self, pos: int) -> None:
        """Wait until the writer has written the file's first ``pos`` bytes; raise its error if any."""
        with self._cond:
            while self._written < pos and self._error is None:
                self._cond.wait()
        self._raise()

    def put_ahead(self, item: Ahead) -> None:
        """Queue buffers to be written at their offset, and then their check (``Ahead``): the buffers
        and the check's held bytes count against the budget until written and checked."""
        self._raise()
        size = _size(item) + (item.check.hold if item.check is not None else 0)
        self._reserve(size)
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
        self._reserve(chk.hold)
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


def _size(raw: bytes | memoryview | list[bytes | memoryview] | tuple[FileSlice, ...] | DeviceBytes | Written
          | Ahead) -> int:
    """Bytes of a queued item: a buffer, a batch of buffers, a batch of copies, bytes on a GPU, bytes
    written ahead, or buffers to write ahead."""
    if isinstance(raw, tuple):
        return sum(s.length for s in raw)
    if isinstance(raw, Written):
        return raw.length
    if isinstance(raw, Ahead):
        return sum(len(b) for b in raw.bufs)
    if isinstance(raw, list):
        return sum(len(b) for b in raw)
    return len(raw)
