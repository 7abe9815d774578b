"""What a shard stream is fed and queues besides computed bytes (``FileSlice``, ``CheckRange``, bytes
written ahead), the batches they travel in, and the in-flight budget the queued bytes count against."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mxfp4conv.files.source import LOCAL, ByteSource

__all__ = ["BATCH_BYTES", "BATCH_SLICES", "Ahead", "CheckRange", "FileSlice", "InflightBudget", "Written", "copy_runs"]

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
class Written:
    """Bytes already at their place in the file (``ShardStream.write_ahead``): the writer moves past them."""

    length: int


@dataclass(frozen=True)
class Ahead:
    """Buffers the writer thread writes at file offset ``begin`` (``ShardStream.write_ahead``), ahead of
    bytes before them; then it queues ``check`` of ``[begin, end)``."""

    bufs: list[bytes | memoryview]
    begin: int
    end: int
    check: CheckRange | None


# Byte-range copies, and computed buffers, are handed to the writer thread in batches of up to
# BATCH_SLICES items / BATCH_BYTES bytes: each hand-off costs ~40 us of thread switching, a ct-mxfp4
# rename copies ~10,000 small tensors, and a ct output has ~800 per MoE layer. BATCH_SLICES also
# stays under the kernel's IOV_MAX (1024 buffers per writev).
BATCH_SLICES = 256
BATCH_BYTES = 64 << 20


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
