"""Remote files read once, in file order, while a conversion reads them in its own order.

A conversion reads a shard's tensors unit by unit (the plan's order), the writer and the proof read
some ranges again, and every byte of every shard must be hashed in file order to be checked against
the publisher's sha256. ``OrderedFetch`` serves all of them from one pass: each file is fetched in
``block``-sized ranges, in file order, by several connections at once; each block is hashed into its
file's sha256 as soon as the blocks before it are, and kept while the conversion still has planned
reads of it (``expect``: the reads a run will make, in the order it makes them, with how many times).
The fetch runs ahead of the reads within ``budget`` bytes of kept blocks, beyond those the planned
order itself keeps (``hold``: blocks fetched for a later read before an earlier one's are read); a
read of a block not yet fetched fetches up to it at once. Each file is checked as soon as its last block is hashed
(``on_checked``), so that what was made of it can be trusted before the run ends; with
``every_file`` False only the files the reads touch are fetched (each still whole, to be checked).

A block let go while planned reads remained (memory ran short) and then read again is fetched again
and must continue the file's sha256 from the state before it to the state after it, as the pass
recorded (two state copies per block, no second hash of the data); a read nothing planned, of a
block already let go, is fetched alone and checked the same way; a block handed to a reader before
the pass reached it must be the bytes the pass hashes; bytes read before the pass began (``claims``:
the headers the plan was made from) must equal the pass's. So every byte handed to a reader is a byte of the one in-order
pass whose sha256 is compared with the publisher's (``finish``).

No HTTP here: ``get(name, begin, end)`` fetches a range (``sources/hub.py`` gives huggingface_hub's).
"""

from __future__ import annotations

import bisect
import hashlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mxfp4conv.errors import InputError

__all__ = ["BLOCK", "BUDGET", "CONNECTIONS", "PATIENCE", "Corrupted", "OrderedFetch"]

# 16 MiB ranges: a 700 GB release in ~45k requests, and small enough that a unit's neighbours in its
# shard are not held long; four connections keep a throttled or distant link busy between them.
BLOCK = 16 << 20
CONNECTIONS = 4
BUDGET = 192 << 20  # bytes of fetched blocks kept ahead of the reads, beyond what their order keeps
PATIENCE = 1.0  # seconds a fetch over the budget waits for lagging readers before letting blocks go

Key = tuple[str, int]
Data = bytes | bytearray  # a fetched block


class Corrupted(InputError):
    """A file's bytes differ from its recorded sha256, or a range fetched twice differs."""


@dataclass
class _File:
    size: int
    sha256: str | None  # as its publisher records it
    hasher: hashlib._Hash = field(default_factory=hashlib.sha256)
    hashed: int = 0  # blocks hashed, in order
    lock: threading.Lock = field(default_factory=threading.Lock)  # one hasher at a time
    # per hashed block: the file's sha256 state before it, and the digest of the state after it
    marks: dict[int, tuple[Any, bytes]] = field(default_factory=dict)


class OrderedFetch:
    """Files ``name -> (size, sha256)`` read through ``get``; see the module docstring. With
    ``order_hold`` False, ``budget`` bounds every kept block: what an out-of-order read needs beyond it
    is let go and fetched again."""

    def __init__(self, files: dict[str, tuple[int, str | None]], get: Callable[[str, int, int], Data], *,
                 claims: dict[str, list[tuple[int, bytes]]] | None = None, label: Callable[[str], str] = str,
                 block: int = BLOCK, budget: int = BUDGET, connections: int = CONNECTIONS,
                 on_fetch: Callable[[int], None] | None = None,
                 on_checked: Callable[[str, str], None] | None = None, every_file: bool = True,
                 order_hold: bool = True, patience: float = PATIENCE, recorded_by: str = "the Hub",
                 mismatch_hint: str = "nothing was published; the download was corrupted or the repo changed: "
                                      "run the command again") -> None:
        self._files = {n: _File(s, h) for n, (s, h) in files.items()}
        self._claims = {n: list(c) for n, c in (claims or {}).items() if n in self._files}
        self._get, self._label, self._block, self._ahead = get, label, block, budget
        self._budget = budget  # ``budget`` ahead of the reads, and what their order keeps (``expect``)
        self._order_hold_on, self._patience = order_hold, patience
        self._connections, self._on_fetch, self._on_checked = connections, on_fetch, on_checked
        self._every_file = every_file
        self._recorded_by, self._mismatch_hint = recorded_by, mismatch_hint  # for ``Corrupted``'s line
        self._checked: dict[str, str] = {}  # files whose every byte is hashed and matched: their sha256
        self._cv = threading.Condition()
        self._kept: dict[Key, Data] = {}
        self._inflight: set[Key] = set()
        self._gone: set[Key] = set()  # hashed and let go
        self._need: dict[Key, int] = {}  # planned bytes still to be read from the block
        self._first: dict[Key, int] = {}  # the first planned read of the block (its rank in ``expect``)
        self._seen: set[Key] = set()  # blocks fetched at least once
        self._early: dict[Key, bytes] = {}  # sha256 of blocks a reader got before the pass reached them
        self._seq: list[Key] = []  # the fetch order
        self._pos: dict[Key, int] = {}
        self._nxt = 0
        self._urgent = -1  # a reader waits for the block at this place of ``_seq``
        self._wait_rank = -1  # the first planned read of the block it waits for
        self._frontier: dict[str, int] = {}  # per file: blocks put in ``_seq`` so far
        self._held = 0  # bytes kept or in flight
        self._reads = 0  # planned reads so far (ranks ``_first``)
        self._error: BaseException | None = None
        self._closed = False
        self._threads: list[threading.Thread] = []
        self.fetched = 0  # bytes fetched (each block once, unless fetched again)
        self.refetched = 0
        self.peak = 0  # most bytes kept or in flight at once
        self.hold = 0  # most bytes the planned reads' order keeps at once (``_order_hold``)
        self._planned = True  # False from ``prefetch`` to ``expect``: every block is kept

    def has(self, name: str) -> bool:
        return name in self._files

    # planning ----------------------------------------------------------------------------------
    def expect(self, reads: Iterable[tuple[str, int, int, int]]) -> None:
        """Planned reads ``(name, begin, end, times)`` in the order they will come; blocks are fetched in
        file order as far as each read needs, every file to its end after the last read."""
        with self._cv:
            reach: list[int] = []  # per read: the furthest place in the fetch order it or one before needs
            last: dict[Key, int] = {}  # per block: its last read (an index of ``reach``)
            for name, begin, end, times in reads:
                if end <= begin or name not in self._files:
                    continue
                rank = self._reads
                self._reads += 1
                for k in range(begin // self._block, -(-end // self._block)):
                    key = (name, k)
                    lo, hi = max(begin, k * self._block), min(end, (k + 1) * self._block)
                    self._need[key] = self._need.get(key, 0) + (hi - lo) * times
                    self._first.setdefault(key, rank)
                    last[key] = len(reach)
                self._extend(name, -(-end // self._block))
                reach.append(max(reach[-1] if reach else -1, self._pos[(name, -(-end // self._block) - 1)]))
            if self._order_hold_on:
                self.hold = max(self.hold, self._order_hold(reach, last))
                self._budget = self._ahead + self.hold
            if not self._planned:  # blocks fetched before the plan: kept only if read
                self._planned = True
                for key in list(self._kept):
                    self._drop_if_done(key)
            early = {n for n, _ in self._early}  # files a reader took bytes of before the plan came
            for name in self._files:
                if self._every_file or name in self._frontier or name in early:
                    self._extend(name, self._blocks(name))
            self._cv.notify_all()
        for name, f in self._files.items():  # an empty file has no block to finish its hash
            if f.size == 0 and (self._every_file or name in self._frontier) and name not in self._checked:
                self._check_file(name, f)
        self._start()

    def prefetch(self, names: list[str], upto: int) -> None:
        """Start fetching files ``names`` in order from the first one's first byte, at most ``upto``
        bytes of them (a later call fetches further), before the reads are known, keeping every block
        until ``expect`` says which are read: the link is busy while the process that reads them is
        still setting up."""
        with self._cv:
            if self._reads:  # the reads are known: their order says what is fetched
                return
            self._planned = False
            left = max(1, upto // self._block)
            for name in names:
                take = min(self._blocks(name), left)
                self._extend(name, take)
                left -= take
                if left <= 0:
                    break
            self._cv.notify_all()  # a second call: connections that ran out of blocks go on
        self._start()

    def allow_ahead(self, budget: int) -> None:
        """Fetch up to ``budget`` bytes ahead of the reads from now on (never fewer than before): a run
        that reads whole units needs the next one fetched while the current one is converted."""
        with self._cv:
            if budget > self._ahead:
                self._budget += budget - self._ahead
                self._ahead = budget
                self._cv.notify_all()

    def checked_to(self, on_checked: Callable[[str, str], None] | None) -> None:
        """Report each file checked from now on to ``on_checked``, and those checked already."""
        with self._cv:
            self._on_checked = on_checked
            done = dict(self._checked)
        if on_checked is not None:
            for name, digest in done.items():
                on_checked(name, digest)

    def _start(self) -> None:
        while len(self._threads) < self._connections:
            t = threading.Thread(target=self._work, name=f"mxfp4conv-fetch-{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()

    def _order_hold(self, reach: list[int], last: dict[Key, int]) -> int:
        """The most bytes of blocks that reads in this order keep at once when the fetch goes no further
        than they need: a block is kept from the first read that needs the fetch to reach it (its own,
        or a later block's) to its own last read. Reads in file order keep at most the blocks of one
        read; a unit read out of file order (a rename's experts 0, 1, 2 against the file's 0, 1, 10,
        100) keeps what lies between."""
        steps: list[tuple[int, int]] = []
        for key, end in last.items():
            start = bisect.bisect_left(reach, self._pos[key])
            if start <= end:
                b, e = self._range(key)
                steps += [(start, e - b), (end + 1, b - e)]
        most = now = 0
        for _, n in sorted(steps):
            now += n
            most = max(most, now)
        return most

    def _blocks(self, name: str) -> int:
        return -(-self._files[name].size // self._block)

    def _extend(self, name: str, upto: int) -> None:
        for k in range(self._frontier.get(name, 0), min(upto, self._blocks(name))):
            self._pos[(name, k)] = len(self._seq)
            self._seq.append((name, k))
        self._frontier[name] = max(self._frontier.get(name, 0), upto)

    def _range(self, key: Key) -> tuple[int, int]:
        name, k = key
        return k * self._block, min(self._files[name].size, (k + 1) * self._block)

    # reading -----------------------------------------------------------------------------------
    def read_into(self, name: str, offset: int, bufs: list[memoryview]) -> int:
        """Fill ``bufs`` with the file's bytes from ``offset`` (fewer only where the file ends)."""
        want = min(sum(len(b) for b in bufs), max(0, self._files[name].size - offset))
        at, i, into = 0, 0, 0
        for k in range(offset // self._block, -(-(offset + want) // self._block)):
            key = (name, k)
            lo = max(offset, k * self._block) - k * self._block
            hi = min(offset + want, (k + 1) * self._block) - k * self._block
            data = memoryview(self._take(key, hi - lo))
            piece = data[lo:hi]
            while piece:
                n = min(len(piece), len(bufs[i]) - into)
                bufs[i][into:into + n] = piece[:n]
                piece, into, at = piece[n:], into + n, at + n
                if into == len(bufs[i]):
                    i, into = i + 1, 0
            del data
            self._release(key, hi - lo)
        return at

    def _take(self, key: Key, n: int) -> Data:
        """The block's bytes, ``n`` of which the caller reads: kept, being fetched (wait), ahead in the
        fetch order (fetched up to it at once), or fetched alone and checked against the pass."""
        with self._cv:
            while True:
                self._raise()
                got = self._kept.get(key)
                if got is not None:
                    return got
                if key in self._inflight:
                    self._cv.wait()
                    continue
                p = self._pos.get(key)
                if p is None and self._threads and key[0] not in self._frontier:
                    # a file only an unplanned read touches joins the pass: every byte handed out is checked
                    self._extend(key[0], self._blocks(key[0]))
                    self._cv.notify_all()
                    p = self._pos.get(key)
                if key not in self._gone and p is not None and p >= self._nxt:
                    if self._need.get(key, 0) <= 0:  # an unplanned read: kept for it once fetched
                        self._need[key] = n
                    if p > self._urgent:  # the fetch goes on to it whatever it keeps (see _make_room)
                        self._urgent = p
                        self._wait_rank = self._first.get(key, -1)
                        self._cv.notify_all()
                    self._cv.wait()
                    continue
                break
        data = self._fetch(key, reader=True)
        with self._cv:
            kept = self._need.get(key, 0) > 0 and key not in self._kept and key not in self._gone
            if kept:
                self._keep(key, data)
        if kept:
            self._hash(key[0])  # it may be the next block in order
        return data

    def _release(self, key: Key, n: int) -> None:
        with self._cv:
            if key in self._need:
                self._need[key] -= n
            self._drop_if_done(key)

    def _drop_if_done(self, key: Key) -> None:
        name, k = key
        if self._planned and key in self._kept and k < self._files[name].hashed and self._need.get(key, 0) <= 0:
            b, e = self._range(key)
            del self._kept[key]
            self._held -= e - b
            self._gone.add(key)
            self._cv.notify_all()

    def _keep(self, key: Key, data: Data) -> None:
        self._kept[key] = data
        self._held += len(data)
        self.peak = max(self.peak, self._held)
        self._cv.notify_all()

    # fetching ----------------------------------------------------------------------------------
    def _fetch(self, key: Key, *, reader: bool = False) -> Data:
        """Fetch a block (``reader``: for a reader, outside the in-order pass). One the pass has hashed
        must continue its sha256 as it did there; one a reader got before the pass must be what the
        pass fetches."""
        name, k = key
        f = self._files[name]
        b, e = self._range(key)
        data = self._get(name, b, e)
        with self._cv:
            self.fetched += len(data)
            if key in self._seen:
                self.refetched += len(data)
            self._seen.add(key)
            mark, early = f.marks.get(k), self._early.get(key)
        if self._on_fetch is not None:
            self._on_fetch(len(data))
        same = True
        if mark is not None:
            h = mark[0].copy()
            h.update(data)
            same = h.digest() == mark[1]
        elif early is not None:
            same = hashlib.sha256(data).digest() == early
        elif reader:
            with self._cv:
                self._early[key] = hashlib.sha256(data).digest()
        if not same:
            exc = Corrupted(f"bytes {b}-{e - 1} differ between two fetches", file=self._label(name),
                            hint=self._mismatch_hint)
            self._fail(exc)
            raise exc
        return data

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._closed and self._error is None and not self._can_start():
                    self._cv.wait()
                if self._closed or self._error is not None:
                    return
                key = self._seq[self._nxt]
                self._nxt += 1
                taken = key in self._kept or key in self._gone  # by a reader's own fetch meanwhile
                if not taken:
                    b, e = self._range(key)
                    self._inflight.add(key)
                    self._held += e - b
                    self._make_room()
            if not taken:
                try:
                    data = self._fetch(key)
                except BaseException as exc:  # reported to every reader and to finish()
                    self._fail(exc)
                    return
                with self._cv:
                    self._inflight.discard(key)
                    self._held -= len(data)
                    if key not in self._kept:
                        self._keep(key, data)
            try:
                self._hash(key[0])
            except BaseException as exc:
                self._fail(exc)
                return

    def _can_start(self) -> bool:
        if self._nxt >= len(self._seq):
            return False
        return self._nxt <= self._urgent or self._held + self._block <= self._budget

    def _make_room(self) -> None:
        """Over the budget (a reader waits for this block): first wait up to ``patience`` seconds for
        readers that lag the one waiting (the writer, the hasher and the proof each read a copied
        range, one after the other) to let go of what they hold; then let go of kept, hashed blocks
        whose first planned read comes after that of the block the reader waits for, latest first:
        they are fetched again when read."""
        deadline = time.monotonic() + self._patience
        while self._held > self._budget and self._error is None and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cv.wait(left)
        while self._held > self._budget:
            cands = [c for c in self._kept
                     if c[1] < self._files[c[0]].hashed and self._first.get(c, -1) > self._wait_rank]
            if not cands:
                return
            victim = max(cands, key=lambda c: self._first[c])
            b, e = self._range(victim)
            del self._kept[victim]
            self._held -= e - b

    def _hash(self, name: str) -> None:
        """Hash the file's blocks that are next in order and kept (one thread per file at a time)."""
        f = self._files[name]
        with f.lock:
            while True:
                key = (name, f.hashed)
                with self._cv:
                    data = self._kept.get(key)
                if data is None:
                    return
                before = f.hasher.copy()
                f.hasher.update(data)
                f.marks[f.hashed] = (before, f.hasher.copy().digest())
                self._check_claims(key, data)
                last = f.hashed + 1 == self._blocks(name)
                if last:
                    self._check_file(name, f)
                with self._cv:
                    f.hashed += 1
                    self._drop_if_done(key)
                    self._cv.notify_all()

    def _check_claims(self, key: Key, data: Data) -> None:
        name, _ = key
        b, e = self._range(key)
        for cb, cbytes in self._claims.get(name, ()):
            lo, hi = max(b, cb), min(e, cb + len(cbytes))
            if lo < hi and data[lo - b:hi - b] != cbytes[lo - cb:hi - cb]:
                raise Corrupted(f"bytes {cb}-{cb + len(cbytes) - 1} as first read differ from a second read",
                                file=self._label(name), hint=self._mismatch_hint)

    def _check_file(self, name: str, f: _File) -> None:
        got = f.hasher.hexdigest()
        if f.sha256 is not None and got != f.sha256:
            raise Corrupted(f"the bytes read have sha256 {got}, {self._recorded_by} records {f.sha256}",
                            file=self._label(name), hint=self._mismatch_hint)
        with self._cv:
            self._checked[name] = got
            report = self._on_checked
        if report is not None:
            report(name, got)

    # the end -----------------------------------------------------------------------------------
    def finish(self) -> dict[str, str]:
        """Wait for the rest of every file to be fetched and checked against its recorded sha256: each
        checked file's sha256 (every file, or with ``every_file`` False those the reads touched);
        ``Corrupted`` naming the first that differs."""
        with self._cv:
            self._urgent = len(self._seq)  # nothing reads any more: fetch the rest regardless of the budget
            self._patience = 0.0
            self._cv.notify_all()
            wanted = [n for n in self._files if self._every_file or n in self._frontier]
            while self._error is None and any(n not in self._checked for n in wanted):
                self._cv.wait()
            self._raise()
            return {n: self._checked[n] for n in wanted}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._kept.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join()

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = self._error or exc
            self._cv.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error
