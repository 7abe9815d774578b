"""``OrderedFetch`` (mxfp4conv/sources/fetch.py): files read once, in order, while readers read them in their
own order. ``get`` here reads a byte string, counting what it was asked for; the HTTP side of the same
object is tested against the loopback Hub (test_hub_stream.py)."""

from __future__ import annotations

import hashlib
import itertools
import random
import threading
import time
from collections.abc import Callable

import pytest

from mxfp4conv.sources.fetch import PATIENCE, Corrupted, OrderedFetch

BLOCK = 1 << 10


class Store:
    """Files as bytes; every range asked for is logged (and may be tampered with)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.asked: list[tuple[str, int, int]] = []
        self.tamper: Callable[[str, int, bytes], bytes] | None = None
        self.lock = threading.Lock()

    def get(self, name: str, begin: int, end: int) -> bytes:
        with self.lock:
            self.asked.append((name, begin, end))
        data = self.files[name][begin:end]
        return self.tamper(name, begin, data) if self.tamper else data

    def fetched(self) -> int:
        return sum(e - b for _, b, e in self.asked)


def make(store: Store, budget: int = 64 * BLOCK, connections: int = 4, order_hold: bool = True,
         patience: float = PATIENCE) -> OrderedFetch:
    return OrderedFetch({n: (len(d), hashlib.sha256(d).hexdigest()) for n, d in store.files.items()}, store.get,
                        block=BLOCK, budget=budget, connections=connections, order_hold=order_hold,
                        patience=patience)


def read(f: OrderedFetch, name: str, begin: int, end: int, pieces: int = 1) -> bytes:
    bufs = [bytearray(len(c)) for c in _split(end - begin, pieces)]
    got = f.read_into(name, begin, [memoryview(b) for b in bufs])
    assert got == end - begin
    return b"".join(bufs)


def _split(n: int, k: int) -> list[bytes]:
    cuts = sorted({0, n, *random.Random(n).sample(range(1, n), min(k - 1, n - 1))}) if n > 1 else [0, n]
    return [bytes(b - a) for a, b in itertools.pairwise(cuts)]


def layout(seed: int, n: int = 24) -> tuple[dict[str, bytes], list[tuple[str, int, int]]]:
    """Two files of tensors whose reading order is not their file order (as a safetensors shard sorted by
    dtype is read unit by unit): each unit reads one range near the start and one near the end."""
    rnd = random.Random(seed)
    files = {"a": rnd.randbytes(40 * BLOCK + 123), "b": rnd.randbytes(9 * BLOCK + 7)}
    reads = []
    for u in range(n):
        head = u * BLOCK // 2
        tail = 20 * BLOCK + u * (20 * BLOCK // n)
        reads += [("a", head, head + BLOCK // 2), ("a", tail, tail + 20 * BLOCK // n)]
    reads += [("b", 0, 3 * BLOCK + 5), ("b", 3 * BLOCK + 5, len(files["b"]))]
    return files, reads


def stream_through(f: OrderedFetch, files: dict[str, bytes], reads: list[tuple[str, int, int]], times: int = 1,
                   pieces: int = 1) -> dict[str, str]:
    """Plan ``reads`` (each made ``times`` times), make them, checking each one's bytes; ``finish``."""
    f.expect((n, b, e, times) for n, b, e in reads)
    for n, b, e in reads:
        for _ in range(times):
            assert read(f, n, b, e, pieces) == files[n][b:e]
    digests = f.finish()
    f.close()
    return digests


def test_every_byte_is_fetched_once_in_file_order_and_checked() -> None:
    files, reads = layout(1)
    store = Store(files)
    f = make(store, budget=64 * BLOCK)
    digests = stream_through(f, files, reads, pieces=3)
    assert digests == {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
    assert store.fetched() == sum(len(d) for d in files.values()) and f.refetched == 0
    assert f.peak <= 64 * BLOCK
    for name in files:  # each file's ranges asked in order, block by block
        begins = [b for n, b, _ in store.asked if n == name]
        assert sorted(begins) == list(range(0, len(files[name]), BLOCK))


def test_ranges_read_several_times_are_kept_until_their_last_read() -> None:
    """The writer, the hasher and the proof each read a copied range: fetched once."""
    files, reads = layout(2)
    store = Store(files)
    stream_through(make(store, budget=64 * BLOCK), files, reads, times=3)
    assert store.fetched() == sum(len(d) for d in files.values())


def test_a_small_budget_fetches_again_and_checks_what_it_let_go() -> None:
    """Kept blocks beyond the budget are let go and fetched again when read: more bytes, the same data;
    a second fetch that differs from the first is never handed out."""
    files, reads = layout(3)
    store = Store(files)
    f = make(store, budget=4 * BLOCK, connections=2, order_hold=False, patience=0)
    stream_through(f, files, reads)
    assert f.refetched > 0 and store.fetched() == sum(len(d) for d in files.values()) + f.refetched
    assert f.peak <= (4 + 2 + 1) * BLOCK  # the budget, the blocks in flight and the one being read

    store = Store(files)
    f = make(store, budget=4 * BLOCK, connections=2, order_hold=False, patience=0)
    seen: set[tuple[str, int]] = set()

    def second_differs(name: str, begin: int, data: bytes) -> bytes:
        key = (name, begin)
        if key in seen:
            return data[:1] + bytes([data[1] ^ 1]) + data[2:]
        seen.add(key)
        return data

    store.tamper = second_differs
    f.expect((n, b, e, 1) for n, b, e in reads)
    with pytest.raises(Corrupted, match="differ between two fetches"):
        for n, b, e in reads:
            assert read(f, n, b, e) == files[n][b:e]
        f.finish()
    f.close()


def test_the_blocks_an_out_of_order_read_needs_are_kept_beyond_the_budget() -> None:
    """What the planned order keeps (``hold``) is added to the budget: reads in file order keep one
    read's blocks, reads from the end back keep the whole file, and the reads of ``layout`` (each unit
    one range near the start, one near the end) are fetched once with a budget of four blocks."""
    data = random.Random(7).randbytes(6 * BLOCK)
    for reads, hold in (([("a", k * BLOCK, (k + 1) * BLOCK) for k in range(6)], BLOCK),
                        ([("a", 2 * k * BLOCK, (2 * k + 2) * BLOCK) for k in range(3)], 2 * BLOCK),
                        ([("a", k * BLOCK, (k + 1) * BLOCK) for k in reversed(range(6))], 6 * BLOCK),
                        ([("a", 0, 1), ("a", 5 * BLOCK, 5 * BLOCK + 1), ("a", 1, 2)], 2 * BLOCK)):
        store = Store({"a": data})
        f = make(store, budget=BLOCK, connections=2)
        stream_through(f, {"a": data}, reads)
        assert f.hold == hold and f.refetched == 0 and store.fetched() == len(data)

    files, reads = layout(3)
    store = Store(files)
    f = make(store, budget=4 * BLOCK, connections=2)
    stream_through(f, files, reads)
    assert f.refetched == 0 and store.fetched() == sum(len(d) for d in files.values())
    assert 4 * BLOCK < f.hold < len(files["a"]) and f.peak <= f.hold + (4 + 2 + 1) * BLOCK


@pytest.mark.parametrize("patience", [PATIENCE, 0.0])
def test_a_fetch_over_its_budget_waits_for_lagging_readers_before_letting_blocks_go(patience: float) -> None:
    """Each range is read twice, the second time 30 ms after the first (the writer, then the proof): the
    blocks the second reader has still to read fill the budget. A reader that must have a block beyond
    it waits for the lagging reader to let go of some rather than dropping blocks fetched ahead, which
    would be fetched again (``patience`` 0)."""
    files, reads = layout(3)
    store = Store(files)
    f = make(store, budget=2 * BLOCK, connections=2, patience=patience)
    f.expect((n, b, e, 2) for n, b, e in reads)
    done: list[float] = []

    def lagging() -> None:
        for i, (n, b, e) in enumerate(reads):
            while len(done) <= i:
                time.sleep(0.001)
            time.sleep(max(0.0, done[i] + 0.03 - time.monotonic()))
            assert read(f, n, b, e) == files[n][b:e]

    t = threading.Thread(target=lagging)
    t.start()
    for n, b, e in reads:
        assert read(f, n, b, e) == files[n][b:e]
        done.append(time.monotonic())
    t.join()
    f.finish()
    f.close()
    assert (f.refetched == 0) == (patience > 0)
    assert store.fetched() == sum(len(d) for d in files.values()) + f.refetched


def test_a_fetch_started_before_the_plan_keeps_its_blocks_until_the_reads_are_known() -> None:
    """``prefetch`` fetches the start of a file before ``expect``: every block it brings is kept (the
    reads to come may need it), those no read needs are let go once the plan is known, and nothing is
    fetched twice; a file checked before anyone asked is reported to ``checked_to`` then."""
    files, reads = layout(5)
    store = Store(files)
    f = make(store, budget=8 * BLOCK)
    f.prefetch(["a"], 6 * BLOCK)
    deadline = time.monotonic() + 30
    while store.fetched() < 6 * BLOCK and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)
    assert store.fetched() == 6 * BLOCK  # no further than asked before the plan
    assert f.peak == 6 * BLOCK  # every block kept: the plan is not known yet
    stream_through(f, files, reads)
    assert f.refetched == 0 and store.fetched() == sum(len(d) for d in files.values())

    small = {"s": random.Random(6).randbytes(2 * BLOCK + 5)}
    f = make(Store(small))
    f.prefetch(["s"], 8 * BLOCK)
    assert f.finish() == {"s": hashlib.sha256(small["s"]).hexdigest()}
    got: list[tuple[str, str]] = []
    f.checked_to(lambda name, digest: got.append((name, digest)))
    assert got == [("s", hashlib.sha256(small["s"]).hexdigest())]
    f.close()


def _settle(store: Store, want: int) -> int:
    """What ``store`` was asked for once the fetch has had time to bring ``want`` bytes (and stopped)."""
    deadline = time.monotonic() + 30
    while store.fetched() < want and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)
    return store.fetched()


def test_a_fetch_before_the_plan_runs_on_into_the_next_file() -> None:
    """``prefetch`` of several files goes past the end of a first file shorter than ``upto``, in order; a
    second call before the plan fetches further."""
    rnd = random.Random(8)
    files = {"a": rnd.randbytes(3 * BLOCK + 5), "b": rnd.randbytes(10 * BLOCK)}
    store = Store(files)
    f = make(store, budget=64 * BLOCK)
    f.prefetch(["a", "b"], 6 * BLOCK)
    assert _settle(store, 3 * BLOCK + 5 + 2 * BLOCK) == 3 * BLOCK + 5 + 2 * BLOCK  # a's four blocks, b's first two
    assert {n for n, _, _ in store.asked} == {"a", "b"}
    f.prefetch(["a", "b"], 9 * BLOCK)  # widened before the plan: the idle connections go on
    assert _settle(store, 3 * BLOCK + 5 + 5 * BLOCK) == 3 * BLOCK + 5 + 5 * BLOCK
    stream_through(f, files, [("a", 0, len(files["a"])), ("b", 0, len(files["b"]))])
    assert f.refetched == 0


def test_allow_ahead_lets_the_fetch_run_further_ahead_of_the_reads() -> None:
    """A run that reads whole units raises the budget once it knows their size: the fetch, held two
    blocks ahead of a reader that stopped, goes six blocks further."""
    files = {"a": random.Random(9).randbytes(20 * BLOCK)}
    store = Store(files)
    f = make(store, budget=2 * BLOCK)
    f.expect([("a", k * BLOCK, (k + 1) * BLOCK, 1) for k in range(20)])
    assert read(f, "a", 0, BLOCK) == files["a"][:BLOCK]
    held = _settle(store, 3 * BLOCK)  # the block read, two ahead and what the reads' order keeps
    assert held < 6 * BLOCK
    f.allow_ahead(8 * BLOCK)
    assert _settle(store, held + 6 * BLOCK) == held + 6 * BLOCK
    f.allow_ahead(4 * BLOCK)  # never fewer than before
    for k in range(1, 20):
        assert read(f, "a", k * BLOCK, (k + 1) * BLOCK) == files["a"][k * BLOCK:(k + 1) * BLOCK]
    assert f.finish() == {"a": hashlib.sha256(files["a"]).hexdigest()} and f.refetched == 0


def test_a_corrupted_block_fails_its_file() -> None:
    files, reads = layout(4)
    store = Store(files)
    store.tamper = lambda n, b, d: d[:5] + bytes([d[5] ^ 0x80]) + d[6:] if (n, b) == ("a", 7 * BLOCK) else d
    checked: list[str] = []
    f = OrderedFetch({n: (len(d), hashlib.sha256(d).hexdigest()) for n, d in files.items()}, store.get,
                     block=BLOCK, on_checked=lambda name, _: checked.append(name))
    f.expect((n, b, e, 1) for n, b, e in reads)
    with pytest.raises(Corrupted, match="sha256") as exc:  # once the file's last block is hashed
        for n, b, e in reads:
            read(f, n, b, e)
        f.finish()
    f.close()
    assert exc.value.file == "a" and "a" not in checked


def test_bytes_read_before_the_stream_must_be_the_streams() -> None:
    """A header read before the plan (a claim) is compared with the in-order pass."""
    files, reads = layout(5)
    store = Store(files)
    header = bytearray(files["a"][:100])
    f = OrderedFetch({n: (len(d), None) for n, d in files.items()}, store.get, claims={"a": [(0, bytes(header))]},
                     block=BLOCK)
    f.expect((n, b, e, 1) for n, b, e in reads)
    f.finish()
    f.close()
    header[50] ^= 1
    f = OrderedFetch({n: (len(d), None) for n, d in files.items()}, store.get, claims={"a": [(0, bytes(header))]},
                     block=BLOCK)
    f.expect((n, b, e, 1) for n, b, e in reads)
    with pytest.raises(Corrupted, match="as first read differ"):
        f.finish()
    f.close()


def test_unplanned_reads_and_reads_before_expect_are_served_and_checked() -> None:
    files, reads = layout(6)
    store = Store(files)
    f = make(store)
    assert read(f, "a", 30 * BLOCK + 3, 31 * BLOCK + 9) == files["a"][30 * BLOCK + 3:31 * BLOCK + 9]
    f.expect((n, b, e, 1) for n, b, e in reads)
    for n, b, e in reads:
        read(f, n, b, e)
    f.finish()
    assert read(f, "b", 5, 2 * BLOCK) == files["b"][5:2 * BLOCK]  # after the pass: fetched again, checked
    f.close()


def test_a_fetch_error_reaches_the_reader_and_finish() -> None:
    files, reads = layout(7)
    store = Store(files)

    def broken(name: str, begin: int, data: bytes) -> bytes:
        if begin >= 30 * BLOCK:
            raise OSError("the link went down")
        return data

    store.tamper = broken
    f = make(store)
    f.expect((n, b, e, 1) for n, b, e in reads)
    with pytest.raises(OSError, match="link went down"):
        for n, b, e in reads:
            read(f, n, b, e)
    with pytest.raises(OSError, match="link went down"):
        f.finish()
    f.close()


def test_readers_on_several_threads() -> None:
    files, reads = layout(8, n=40)
    store = Store(files)
    f = make(store, budget=16 * BLOCK)
    f.expect((n, b, e, 1) for n, b, e in reads)
    out: dict[int, bytes] = {}

    def worker(i: int) -> None:
        n, b, e = reads[i]
        out[i] = read(f, n, b, e, pieces=2)

    for start in range(0, len(reads), 4):  # four readers at a time, as read_parts' pool
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(start, min(len(reads), start + 4))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    f.finish()
    f.close()
    assert all(out[i] == files[n][b:e] for i, (n, b, e) in enumerate(reads))
    assert store.fetched() == sum(len(d) for d in files.values()) + f.refetched


def test_a_partial_fetch_reads_and_checks_only_the_files_read() -> None:
    files, reads = layout(9)
    store = Store(files)
    checked: dict[str, str] = {}
    f = OrderedFetch({n: (len(d), hashlib.sha256(d).hexdigest()) for n, d in files.items()}, store.get, block=BLOCK,
                     every_file=False, on_checked=checked.__setitem__)
    only_b = [r for r in reads if r[0] == "b"]
    f.expect((n, b, e, 1) for n, b, e in only_b)
    for n, b, e in only_b:
        assert read(f, n, b, e) == files[n][b:e]
    assert f.finish() == checked == {"b": hashlib.sha256(files["b"]).hexdigest()}
    f.close()
    assert {n for n, _, _ in store.asked} == {"b"} and store.fetched() == len(files["b"])


def test_a_block_read_before_the_pass_must_be_the_passs() -> None:
    """A reader got a block before the in-order pass reached it; the pass's own fetch of it differs:
    Corrupted, and the file is never reported checked."""
    files, reads = layout(10)
    store = Store(files)
    seen: set[int] = set()

    def second_differs(name: str, begin: int, data: bytes) -> bytes:
        if (name, begin) != ("a", 30 * BLOCK):
            return data
        if begin in seen:
            return data[:9] + bytes([data[9] ^ 4]) + data[10:]
        seen.add(begin)
        return data

    store.tamper = second_differs
    checked: list[str] = []
    f = OrderedFetch({n: (len(d), hashlib.sha256(d).hexdigest()) for n, d in files.items()}, store.get, block=BLOCK,
                     on_checked=lambda name, _: checked.append(name))
    assert read(f, "a", 30 * BLOCK + 3, 30 * BLOCK + 50) == files["a"][30 * BLOCK + 3:30 * BLOCK + 50]
    f.expect((n, b, e, 1) for n, b, e in reads)
    with pytest.raises(Corrupted, match="differ between two fetches"):
        for n, b, e in reads:
            read(f, n, b, e)
        f.finish()
    f.close()
    assert "a" not in checked


def test_a_file_only_an_unplanned_read_touches_joins_the_pass() -> None:
    """With ``every_file`` False, a read of a file no planned read names still gets bytes that are
    checked: that file is fetched whole and its sha256 compared, like the planned ones."""
    files, reads = layout(11)
    store = Store(files)
    f = OrderedFetch({n: (len(d), hashlib.sha256(d).hexdigest()) for n, d in files.items()}, store.get, block=BLOCK,
                     every_file=False)
    only_b = [r for r in reads if r[0] == "b"]
    f.expect((n, b, e, 1) for n, b, e in only_b)
    assert read(f, "a", 5 * BLOCK + 1, 5 * BLOCK + 99) == files["a"][5 * BLOCK + 1:5 * BLOCK + 99]
    for n, b, e in only_b:
        read(f, n, b, e)
    assert f.finish() == {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
    f.close()
    assert store.fetched() == sum(len(d) for d in files.values())
