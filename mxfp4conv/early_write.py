"""The early writer: a conversion's first requantized units, written while torch is imported.

A fresh process spends seconds importing torch and starting CUDA before its first write (2-4 s on
the GPU hosts measured, BENCHMARKS.md), while a copy of the same files writes from its first
millisecond. The early writer is a child process, started as soon as the plan is made and the first
shards are open. It reads the NVFP4 units the conversion produces first, requantizes them with the
compiled CPU kernel (``kernels/requant_native``: the CPU path's bytes, which the GPU's match byte
for byte) on the host's cores, and writes their bytes into the staged shards at their planned
offsets. A process of its own: it shares no GIL with torch's import (the head start, a thread
beside the import, slowed the import more than it gained).

Once the conversion can produce units itself it claims the rest (``EarlyWriter.claim``): the child
finishes the units it has begun and takes no more. The conversion takes each of the child's units
as written (``safetensors_io.Written``): the shard's hasher reads them from the file; their source
is validated as any unit's; their statistics are folded from the kernel's row statistics, which
the child leaves in shared memory; and the proof re-derives them from SRC on the conversion's own
device and compares with the file, as for every unit. Units a failed child did not finish are
made by the conversion, which writes them over whatever is there.

The protocol: the job as one JSON line on the child's stdin; a shared memory file (``memfd``) whose
first 16 bytes are the count of units the child has begun and the stop flag, changed only under a
record lock, followed by each unit's row statistics; one line ``done I`` on the child's stdout per
unit fully written. Nothing here imports torch. ``MXFP4CONV_EARLY_WRITE``: ``auto`` (a fresh
process converting on a GPU), ``on``, ``off``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import queue
import struct
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mxfp4conv.canonical import UnitSpec
from mxfp4conv.formats.tables import E4M3_VALUES
from mxfp4conv.head_start import address, buffer, global_scale
from mxfp4conv.io.checkpoint import Checkpoint
from mxfp4conv.io.safetensors_io import read_full
from mxfp4conv.layouts.split import LinearRoles, stack_plan, unit_groups, weight_refs

__all__ = ["ENV", "EarlyWriter", "Piece", "Read", "Unit", "Weight", "mode", "plan_unit", "start"]

ENV = "MXFP4CONV_EARLY_WRITE"
_HEAD = 16  # the shared memory's first bytes: units begun (int64), stop (int64)
_ROW_STATS = 5  # float64 columns of the kernel's row statistics (requant.ROW_STATS)
_MX_BLOCK = 32
# output bytes offered to the child at most: more than a start of several seconds writes, and its
# row statistics (40 bytes per row) stay a few hundred MB of address space, touched only when made
MAX_BYTES = 8 << 30
_SYNC_FILE_RANGE_WRITE = 2

# Called as (writer) in ``EarlyWriter.claim`` before the child is stopped: a test hook (tests let the
# child make some units first, e.g. ``lambda w: w.wait_made(2)``). None in normal use.
CLAIM_HOOK: Callable[[EarlyWriter], None] | None = None


@dataclass(frozen=True)
class Read:
    """A source tensor's bytes: ``length`` bytes at ``offset`` of ``file``, to ``at`` in a stack."""

    file: str
    offset: int
    length: int
    at: int


@dataclass(frozen=True)
class Weight:
    """One NVFP4 weight of a unit as ``layouts/split.py`` stacks it: ``rows`` rows of ``kh`` packed
    bytes, its codes' and block scales' reads, its per-row global scale as (value, rows) runs, and
    where its row statistics go in the shared memory."""

    label: str
    rows: int
    kh: int
    divisor: bool
    codes: tuple[Read, ...]
    scales: tuple[Read, ...]
    globals: tuple[tuple[float, int], ...]
    stats_at: int


@dataclass(frozen=True)
class Piece:
    """An output tensor: ``length`` bytes from ``at`` of a weight's requantized codes (``p``) or
    scales (``s``), written at ``offset`` of shard ``shard``."""

    shard: int
    offset: int
    label: str
    part: str
    at: int
    length: int


@dataclass(frozen=True)
class Unit:
    key: str
    weights: tuple[Weight, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.length for p in self.pieces)


def mode() -> str:
    """``MXFP4CONV_EARLY_WRITE``: auto (default) | on | off."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{ENV}={value!r}: use auto, on or off")
    return value


def plan_unit(ckpt: Checkpoint, spec: UnitSpec, roles: LinearRoles, pieces: list[tuple[str, str, int, int]],
              shard: int, offsets: list[int], stats_at: int) -> Unit | None:
    """The child's work for one unit: its weights' reads (``stack_plan``'s layout) and its output
    tensors' pieces (``pieces``: the target's ``raw_pieces``, as (weight, part, first row, rows);
    ``offsets``: each output tensor's file offset in shard ``shard``). None when the unit's global
    scales are not one float32 each, or its shapes are not the kernel's."""
    weights: list[Weight] = []
    kh_of: dict[str, int] = {}
    at = stats_at
    for label, groups in unit_groups(spec).items():
        prefs, srefs, num, rows = weight_refs(ckpt, groups, roles)
        shape, places = stack_plan(ckpt, prefs, num, rows)
        sshape, splaces = stack_plan(ckpt, srefs, num, rows)
        r, kh = shape[0] * shape[1], shape[2]
        if kh * 2 % _MX_BLOCK or sshape[2] * 8 != kh or sshape[0] * sshape[1] != r:
            return None
        runs: list[tuple[float, int]] = []
        for e in range(num):
            for j, n in enumerate(rows):
                v = global_scale(ckpt, f"{groups[j][e]}.{roles.global_scale}")
                if v is None:
                    return None
                runs.append((v, n))  # gate rows of expert e, then its up rows
        weights.append(Weight(label, r, kh, roles.global_is_divisor,
                              tuple(Read(str(ref.file), ref.begin, ref.nbytes, o) for ref, o in places),
                              tuple(Read(str(ref.file), ref.begin, ref.nbytes, o) for ref, o in splaces),
                              tuple(runs), at))
        kh_of[label] = kh
        at += r * _ROW_STATS * 8
    out: list[Piece] = []
    for (label, part, row0, nrows), offset in zip(pieces, offsets, strict=True):
        if label not in kh_of:
            return None
        width = kh_of[label] if part == "p" else kh_of[label] // 16
        out.append(Piece(shard, offset, label, part, row0 * width, nrows * width))
    return Unit(spec.key, tuple(weights), tuple(out))


def stats_bytes(unit: Unit) -> int:
    return sum(w.rows * _ROW_STATS * 8 for w in unit.weights)


class EarlyWriter:
    """The parent's side: the child process, the shared memory, and which units the child made."""

    def __init__(self, proc: subprocess.Popen[bytes], fd: int, shm: mmap.mmap, units: list[Unit],
                 ready: Callable[[], None] | None = None) -> None:
        self._proc = proc
        self._fd = fd
        self._shm = shm
        self.units = {u.key: u for u in units}
        self._order = [u.key for u in units]
        self._ready = ready
        self._claimed: set[str] | None = None
        self._done: set[str] = set()
        self._ended = False
        self._cond = threading.Condition()
        self.t_start = time.perf_counter()
        self._reader = threading.Thread(target=self._read_loop, name="mxfp4conv-early", daemon=True)
        self._reader.start()

    def _read_loop(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            word, _, key = line.decode().strip().partition(" ")
            if word == "done":
                with self._cond:
                    self._done.add(key)
                    self._cond.notify_all()
        self._proc.wait()
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def claim(self) -> set[str]:
        """Stop the child after the units it has begun; those units' keys (once only: later calls
        return the same set). Waits first for ``ready`` (the conversion's device, started meanwhile)."""
        if self._claimed is None:
            if self._ready is not None:
                self._ready()
            if CLAIM_HOOK is not None:
                CLAIM_HOOK(self)
            fcntl.lockf(self._fd, fcntl.LOCK_EX, _HEAD, 0)
            try:
                begun = struct.unpack_from("<q", self._shm, 0)[0]
                struct.pack_into("<q", self._shm, 8, 1)
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, _HEAD, 0)
            self._claimed = set(self._order[:begun])
        return self._claimed

    def owns(self, spec: UnitSpec) -> bool:
        return spec.key in self.claim()

    def wait(self, spec: UnitSpec) -> bool:
        """Whether the child wrote the unit whole (waiting for it); False when the child ended first."""
        with self._cond:
            while spec.key not in self._done and not self._ended:
                self._cond.wait()
            return spec.key in self._done

    def row_stats(self, spec: UnitSpec, label: str) -> memoryview:
        """A weight's ``[rows, 5]`` float64 row statistics, as the child's kernel wrote them."""
        w = next(w for w in self.units[spec.key].weights if w.label == label)
        return memoryview(self._shm)[w.stats_at:w.stats_at + w.rows * _ROW_STATS * 8]

    def release(self, spec: UnitSpec) -> None:
        """Give a taken unit's row statistics' memory back (best effort)."""
        u = self.units[spec.key]
        if not u.weights:
            return
        begin = u.weights[0].stats_at
        end = u.weights[-1].stats_at + u.weights[-1].rows * _ROW_STATS * 8
        page = mmap.PAGESIZE
        lo, hi = -(-begin // page) * page, end // page * page
        if hi > lo and hasattr(mmap, "MADV_REMOVE"):
            with contextlib.suppress(OSError, ValueError):
                self._shm.madvise(mmap.MADV_REMOVE, lo, hi - lo)

    def made(self) -> int:
        """Units written whole so far."""
        with self._cond:
            return len(self._done)

    def wait_made(self, n: int) -> int:
        """Wait until ``n`` units are written whole, or the child has ended; the count then."""
        with self._cond:
            while len(self._done) < n and not self._ended:
                self._cond.wait()
            return len(self._done)

    def close(self) -> None:
        """End the child (killed when still running: the conversion ended early) and let go of the
        shared memory; after this no byte of the output is written by the child."""
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.kill()
        self._proc.wait()
        self._reader.join()
        with contextlib.suppress(BufferError, ValueError):
            self._shm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


def start(units: list[Unit], shards: list[Path], rule: str, ready: Callable[[], None] | None = None,
          threads: int | None = None) -> EarlyWriter | None:
    """Start the child on ``units`` (in the order the conversion produces them) writing into the
    open ``shards``; None where it cannot run (no ``memfd``: not Linux)."""
    if not units or not hasattr(os, "memfd_create"):
        return None
    size = _HEAD + sum(stats_bytes(u) for u in units)
    fd = os.memfd_create("mxfp4conv-early", 0)
    try:
        os.ftruncate(fd, size)
        shm = mmap.mmap(fd, size)
    except OSError:
        os.close(fd)
        return None
    n = threads or max(1, len(os.sched_getaffinity(0)) - 1)  # one core left to torch's import
    job = {"fd": fd, "size": size, "shards": [str(p) for p in shards], "rule": rule, "threads": n,
           "units": [asdict(u) for u in units]}
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "mxfp4conv.early_write"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, pass_fds=(fd,), env=env)
    except OSError:
        shm.close()
        os.close(fd)
        return None
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps(job).encode() + b"\n")
        proc.stdin.close()
    except OSError:  # the child is gone already: it made nothing
        pass
    return EarlyWriter(proc, fd, shm, units, ready)


# The child's side.


def _unit(d: dict[str, Any]) -> Unit:
    def reads(xs: list[Any]) -> tuple[Read, ...]:
        return tuple(Read(*x) if isinstance(x, list) else Read(**x) for x in xs)

    ws = tuple(Weight(w["label"], w["rows"], w["kh"], w["divisor"], reads(w["codes"]), reads(w["scales"]),
                      tuple((float(v), int(n)) for v, n in w["globals"]), w["stats_at"]) for w in d["weights"])
    return Unit(d["key"], ws, tuple(Piece(**p) for p in d["pieces"]))


def _take(fd: int, shm: mmap.mmap) -> int | None:
    """Begin the next unit: its index, or None once the parent has claimed the rest."""
    fcntl.lockf(fd, fcntl.LOCK_EX, _HEAD, 0)
    try:
        begun, stop = struct.unpack_from("<qq", shm, 0)
        if stop:
            return None
        struct.pack_into("<q", shm, 0, begun + 1)
        return int(begun)
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN, _HEAD, 0)


def _read(pool: ThreadPoolExecutor, reads: list[tuple[Read, memoryview]], fds: dict[str, int]) -> None:
    def one(item: tuple[Read, memoryview]) -> None:
        r, view = item
        if read_full(fds[r.file], view, r.offset) != r.length:
            raise OSError(f"{r.file}: ended inside a tensor at {r.offset}")

    for r, _ in reads:
        if r.file not in fds:
            fds[r.file] = os.open(r.file, os.O_RDONLY)
    list(pool.map(one, reads))


def _make(u: Unit, kern: Any, rule: str, shm: mmap.mmap, pool: ThreadPoolExecutor, n: int,
          fds: dict[str, int]) -> dict[str, tuple[Any, Any]]:
    """Read and requantize one unit: each weight's (codes, scales) results."""
    srcs: dict[str, tuple[Any, Any]] = {}
    reads: list[tuple[Read, memoryview]] = []
    for w in u.weights:
        packed, scales = buffer(w.rows * w.kh), buffer(w.rows * w.kh // 8)
        reads += [(r, memoryview(packed)[r.at:r.at + r.length]) for r in w.codes]
        reads += [(r, memoryview(scales)[r.at:r.at + r.length]) for r in w.scales]
        srcs[w.label] = (packed, scales)
    _read(pool, reads, fds)
    del reads
    lut = array("f", E4M3_VALUES)
    base = ctypes.addressof(ctypes.c_char.from_buffer(shm))
    outs: dict[str, tuple[Any, Any]] = {}
    calls = []
    grows: list[array] = []
    for w in u.weights:
        g = array("f")
        for v, rows in w.globals:
            g.extend(array("f", [v]) * rows)
        grows.append(g)
        out, sout = buffer(w.rows * w.kh), buffer(w.rows * w.kh // 16)
        outs[w.label] = (out, sout)
        packed, scales = srcs[w.label]
        step = max(1, -(-w.rows // (4 * n)))
        addrs = (address(packed), address(scales), address(lut), address(g))
        res = (address(out), address(sout), base + w.stats_at)
        calls += [(addrs, r0, min(w.rows, r0 + step), w.kh, w.divisor, res) for r0 in range(0, w.rows, step)]

    def run(c: Any) -> None:
        addrs, r0, r1, kh, divisor, res = c
        kern.rows(*addrs, r0, r1, kh, divisor, rule, *res)

    list(pool.map(run, calls))
    srcs.clear()  # the source stacks (most of the unit's memory) go before the results are written
    return outs


def _write(u: Unit, outs: dict[str, tuple[Any, Any]], shards: list[int], sync: Any) -> None:
    """Write a unit's pieces (one ``pwritev`` per run of adjacent pieces) and start their writeback."""
    spans: dict[int, list[int]] = {}
    runs: list[tuple[int, int, list[memoryview]]] = []
    for p in u.pieces:
        view = memoryview(outs[p.label][0 if p.part == "p" else 1])[p.at:p.at + p.length]
        if runs and runs[-1][0] == p.shard and runs[-1][1] + sum(len(v) for v in runs[-1][2]) == p.offset \
                and len(runs[-1][2]) < 512:
            runs[-1][2].append(view)
        else:
            runs.append((p.shard, p.offset, [view]))
        lo_hi = spans.setdefault(p.shard, [p.offset, p.offset + p.length])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], p.offset), max(lo_hi[1], p.offset + p.length)
    for shard, offset, views in runs:
        fd = shards[shard]
        while views:
            wrote = os.pwritev(fd, views, offset)
            if wrote <= 0:
                raise OSError(28, "No space left on device")
            offset += wrote
            while views and wrote >= len(views[0]):
                wrote -= len(views[0])
                views.pop(0)
            if wrote:
                views[0] = views[0][wrote:]
    if sync:
        for shard, (lo, hi) in spans.items():
            sync(shards[shard], lo, hi - lo, _SYNC_FILE_RANGE_WRITE)


def main() -> int:
    """The child: make units until the parent claims the rest; exit 0, or 1 after an error (the
    parent makes what is left)."""
    from mxfp4conv.kernels import requant_native

    job = json.loads(sys.stdin.readline())
    fd = int(job["fd"])
    shm = mmap.mmap(fd, int(job["size"]))
    kern = requant_native.load()
    if kern is None:
        return 1
    units = [_unit(d) for d in job["units"]]
    n = int(job["threads"])
    shards = [os.open(p, os.O_WRONLY) for p in job["shards"]]
    sync = None
    with contextlib.suppress(OSError, AttributeError):
        sync = ctypes.CDLL(None, use_errno=True).sync_file_range
        sync.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fds: dict[str, int] = {}
    todo: queue.Queue[tuple[Unit, dict[str, tuple[Any, Any]]] | None] = queue.Queue(maxsize=1)
    failed: list[BaseException] = []

    def writer() -> None:
        while (item := todo.get()) is not None:
            if failed:
                continue
            u, outs = item
            try:
                _write(u, outs, shards, sync)
            except BaseException as exc:
                failed.append(exc)
                continue
            del outs, item
            sys.stdout.write(f"done {u.key}\n")
            sys.stdout.flush()

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        with ThreadPoolExecutor(n) as pool:
            while not failed and (i := _take(fd, shm)) is not None and i < len(units):
                todo.put((units[i], _make(units[i], kern, job["rule"], shm, pool, n, fds)))
    finally:
        todo.put(None)
        t.join()
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException as exc:  # the parent makes the units not reported done
        sys.stderr.write(f"mxfp4conv early writer: {exc}\n")
        code = 1
    sys.stdout.flush()
    os._exit(code)
