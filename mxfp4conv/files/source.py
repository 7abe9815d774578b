"""Where a checkpoint's bytes come from: one small interface, ``ByteSource``.

Every read of SRC's tensor data goes through the source its ``TensorRef`` (or ``FileSlice``) names:
the units' reads and the GPU reader (``read_parts``), the writer's copies and the hasher's reads of
carried ranges, and the proof's second read of them. ``LOCAL`` reads local files (``preadv``) and
lends a descriptor for the kernel's own copies (``copy_file_range``, ``posix_fadvise``); a source
whose bytes are not a local file (a Hub repo, ``sources/hub.py``) lends none, and its bytes are read
into buffers instead. A conversion says beforehand which ranges it will read, in order (``expect``),
so that a remote source can fetch each byte once, ahead of the reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

__all__ = ["LOCAL", "ByteSource", "LocalFiles"]


class ByteSource(Protocol):
    def read_into(self, file: Path, offset: int, bufs: list[memoryview]) -> int:
        """Fill ``bufs`` in order with the file's bytes from ``offset``: how many there were (fewer
        than asked only where the file ends)."""

    def expect(self, reads: Iterable[tuple[Path, int, int, int]]) -> None:
        """The reads ``(file, begin, end, times)`` about to come, in their order (a hint)."""

    def descriptor(self, file: Path) -> int | None:
        """A read-only descriptor of the file for the kernel's own copies and reads (the caller closes
        it), or None where the bytes are not a local file."""

    def size(self, file: Path) -> int:
        """The file's size in bytes."""

    def sha256(self, file: Path) -> str | None:
        """The sha256 the file's publisher records for it, when there is one."""


class LocalFiles:
    """Files on this machine's filesystems."""

    def read_into(self, file: Path, offset: int, bufs: list[memoryview]) -> int:
        fd = os.open(file, os.O_RDONLY)
        try:
            return preadv_full(fd, bufs, offset)
        finally:
            os.close(fd)

    def expect(self, reads: Iterable[tuple[Path, int, int, int]]) -> None:
        pass  # the kernel's readahead and page cache serve local reads

    def descriptor(self, file: Path) -> int | None:
        return os.open(file, os.O_RDONLY)

    def size(self, file: Path) -> int:
        return os.stat(file).st_size

    def sha256(self, file: Path) -> str | None:
        return None


def preadv_full(fd: int, bufs: list[memoryview], offset: int) -> int:
    """``preadv`` looped over short reads (legal, and common for large requests) until ``bufs`` are
    full or the file ends: the bytes read."""
    want = sum(len(b) for b in bufs)
    done = 0
    i, into = 0, 0  # the buffer being filled, and how far
    while done < want:
        got = os.preadv(fd, [bufs[i][into:], *bufs[i + 1:]], offset + done)
        if got <= 0:
            break
        done += got
        while i < len(bufs) and got >= len(bufs[i]) - into:
            got -= len(bufs[i]) - into
            i, into = i + 1, 0
        into += got
    return done


LOCAL = LocalFiles()
