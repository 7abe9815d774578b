"""The shard reader's parallel pieces and the streamed shard writer (deferred finish, shared budget)."""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxfp4conv.errors import InputError, OutputError
from mxfp4conv.files import safetensors as sio
from mxfp4conv.files.safetensors import dtypes, reader, writer, writer_threads


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randint(0, 256, (1000, 1037), generator=g, dtype=torch.uint8),  # 1,037,000 bytes
        "odd": torch.randn(7, 13, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "small": torch.randint(0, 256, (33,), generator=g, dtype=torch.uint8),
    }


@pytest.mark.parametrize("threads", [1, 4])
def test_read_many_in_pieces_matches_safetensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """Tensors split into many pieces (uneven last piece), read on a pool or inline, are the bytes
    the safetensors library reads; load / read_into / read_bytes all go through it."""
    path = tmp_path / "a.safetensors"
    want = _tensors()
    save_file(want, str(path))
    monkeypatch.setattr(reader, "READ_PIECE", 4099)  # 253 pieces for "big", the last one short
    monkeypatch.setattr(reader, "READ_THREADS", threads)
    refs, _ = sio.read_header(path)
    bufs = {n: torch.empty(r.nbytes, dtype=torch.uint8) for n, r in refs.items()}
    sio.read_many([(refs[n], sio.tensor_view(bufs[n])) for n in refs])
    ref_lib = load_file(str(path))
    for n, r in refs.items():
        assert bufs[n].numpy().tobytes() == ref_lib[n].contiguous().view(-1).view(torch.uint8).numpy().tobytes(), n
        assert torch.equal(r.load(), ref_lib[n]), n
        assert r.read_bytes() == bufs[n].numpy().tobytes()
    out = torch.empty_like(ref_lib["big"])
    refs["big"].read_into(out)
    assert torch.equal(out, ref_lib["big"])
    with pytest.raises(ValueError, match="destination"):
        sio.read_many([(refs["big"], memoryview(bytearray(5)))])


def test_read_many_short_file_names_file_and_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.safetensors"
    save_file(_tensors(), str(path))
    refs, _ = sio.read_header(path)
    monkeypatch.setattr(reader, "READ_PIECE", 1 << 12)
    with open(path, "r+b") as fh:  # the file shrinks after its header was read
        fh.truncate(refs["big"].begin + 10_000)
    buf = torch.empty(refs["big"].nbytes, dtype=torch.uint8)
    with pytest.raises(InputError) as exc:
        sio.read_many([(refs["big"], sio.tensor_view(buf))])
    assert exc.value.tensor == "big" and str(path) in str(exc.value.file)


def _many(n: int, size: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i:03d}": torch.randint(0, 256, (size + i,), generator=g, dtype=torch.uint8) for i in range(n)}


@pytest.mark.parametrize("threads", [1, 4])
def test_neighbouring_tensors_are_read_in_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """Tensors that follow each other in a file go in one scatter read (capped by READ_PIECE and
    MAX_IOV; a tensor longer than READ_PIECE is cut), into destinations in any order: the bytes
    are the safetensors library's."""
    path = tmp_path / "a.safetensors"
    want = _many(40, 1000)
    save_file(want, str(path))
    monkeypatch.setattr(reader, "READ_PIECE", 5000)
    monkeypatch.setattr(reader, "MAX_IOV", 3)
    monkeypatch.setattr(reader, "READ_THREADS", threads)
    refs, _ = sio.read_header(path)
    order = sorted(refs, key=lambda n: -refs[n].begin)  # destinations asked for back to front
    items = [(refs[n], memoryview(bytearray(refs[n].nbytes)), 0) for n in order]
    runs = sio.runs(items)
    spans = [(r[0][0].begin + r[0][2], sum(len(p[1]) for p in r)) for r in runs]
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans))  # file order
    assert all(len(r) <= 3 and sum(len(p[1]) for p in r) <= 5000 for r in runs)
    assert len(runs) < len(items) and max(len(r) for r in runs) > 1
    for r in runs:  # each run is contiguous in the file
        assert all(a[0].begin + a[2] + len(a[1]) == b[0].begin + b[2] for a, b in itertools.pairwise(r))
    sio.read_parts(items)
    for n, (_, buf, _) in zip(order, items, strict=True):
        assert bytes(buf) == want[n].numpy().tobytes(), n
    big = torch.randint(0, 256, (12_345,), dtype=torch.uint8)
    save_file({"big": big}, str(tmp_path / "b.safetensors"))
    ref = sio.read_header(tmp_path / "b.safetensors")[0]["big"]
    assert [len(p[1]) for r in sio.runs([(ref, memoryview(bytearray(ref.nbytes)), 0)]) for p in r] == [5000, 5000, 2345]


def test_a_run_that_ends_early_names_the_tensor_it_ended_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.safetensors"
    save_file(_many(10, 1000), str(path))
    refs, _ = sio.read_header(path)
    monkeypatch.setattr(reader, "READ_PIECE", 1 << 20)
    names = sorted(refs, key=lambda n: refs[n].begin)
    cut = refs[names[6]]
    with open(path, "r+b") as fh:  # the file shrinks after its header was read, inside the 7th tensor
        fh.truncate(cut.begin + 10)
    items = [(refs[n], memoryview(bytearray(refs[n].nbytes))) for n in names]
    assert len(sio.runs([(r, b, 0) for r, b in items])) == 1
    with pytest.raises(InputError) as exc:
        sio.read_many(items)
    assert exc.value.tensor == cut.name and str(path) in str(exc.value.file)


def test_tensors_that_read_themselves_are_read_one_by_one(tmp_path: Path) -> None:
    """A TensorRef subclass with a read of its own is never folded into another's scatter read."""
    path = tmp_path / "a.safetensors"
    save_file(_many(4, 100), str(path))
    refs, _ = sio.read_header(path)

    class Own(sio.TensorRef):
        def read_part(self, buf: memoryview, offset: int) -> None:
            buf[:] = b"\x07" * len(buf)

    names = sorted(refs, key=lambda n: refs[n].begin)
    mine = [Own(**{k: getattr(refs[n], k) for k in ("file", "name", "dtype", "shape", "begin", "end")}) if i % 2 else refs[n]
            for i, n in enumerate(names)]
    items = [(r, memoryview(bytearray(r.nbytes))) for r in mine]
    assert all(len(run) == 1 for run in sio.runs([(r, b, 0) for r, b in items]))
    sio.read_many(items)
    assert all((bytes(b) == b"\x07" * len(b)) == isinstance(r, Own) for r, b in items)


def test_stream_returns_before_the_hash_and_fsync_and_resolves_to_the_sha256(tmp_path: Path) -> None:
    """Two shards under one tiny budget (items larger than it pass one at a time): both futures
    resolve to their files' sha256 and the files load in the safetensors library."""
    budget = sio.InflightBudget(1 << 10)
    futs = []
    for i in range(2):
        t = _tensors(i)
        entries = [(n, sio.st_dtype(v.dtype), tuple(v.shape)) for n, v in t.items()]
        futs.append((tmp_path / f"{i}.safetensors", t,
                     sio.stream_safetensors(tmp_path / f"{i}.safetensors", entries, iter(t.values()), None, budget)))
    for path, t, fut in futs:
        assert fut.result(timeout=60) == hashlib.sha256(path.read_bytes()).hexdigest()
        back = load_file(str(path))
        assert all(torch.equal(back[n], v) for n, v in t.items())
    assert budget.used == 0
    assert not [th for th in threading.enumerate() if th.name.startswith(("mxfp4conv-writer", "mxfp4conv-hasher"))]


def test_tensors_written_ahead_take_their_place_in_the_file_and_are_checked_at_once(tmp_path: Path) -> None:
    """Tensors written ahead of earlier ones (an expert group converted before its turn) land at their
    planned offsets, are checked as soon as they are written, and the finished file is the one written
    in order: same bytes, same sha256, the same checks over the same ranges."""
    t = _tensors(3)
    entries = [(n, sio.st_dtype(v.dtype), tuple(v.shape)) for n, v in t.items()]
    ranges: dict[str, list[tuple[int, int]]] = {"order": [], "ahead": []}

    def write(path: Path, how: str) -> str:
        seen = ranges[how]

        def check(fd: int, begin: int, end: int) -> None:
            seen.append((begin, end))

        s = sio.ShardStream(path, entries)
        if how == "ahead":
            s.write_ahead(3, [t["small"]], sio.CheckRange(check))
            s.write_ahead(2, [t["empty"]], None)  # nothing to write, still its turn to take
            s.write_ahead(1, [t["odd"]], sio.CheckRange(check))
            deadline = time.monotonic() + 30
            while len(seen) < 2 and time.monotonic() < deadline:  # checked before tensor 0 is even fed
                time.sleep(0.01)
            assert len(seen) == 2
            with pytest.raises(AssertionError, match="not written ahead"):
                s.feed_written(1)  # tensor 0 was not
            s.feed(t["big"])
            s.feed(sio.CheckRange(check))
            s.feed_written(1)
            s.feed_written(1)
            s.feed_written(1)
        else:
            s.feed(t["big"])
            s.feed(sio.CheckRange(check))
            s.feed(t["odd"])
            s.feed(sio.CheckRange(check))
            s.feed(t["empty"])
            s.feed(t["small"])
            s.feed(sio.CheckRange(check))
        return s.finish().result(timeout=60)

    a, b = tmp_path / "order.safetensors", tmp_path / "ahead.safetensors"
    assert write(a, "order") == write(b, "ahead") == hashlib.sha256(a.read_bytes()).hexdigest()
    assert a.read_bytes() == b.read_bytes()
    assert sorted(ranges["ahead"]) == sorted(ranges["order"]) and len(ranges["order"]) == 3
    back = load_file(str(b))
    assert all(torch.equal(back[n], v) for n, v in t.items())


def test_stream_write_error_surfaces_from_the_future_or_the_put(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write failure (here: a full disk) reaches the caller as an OutputError naming the shard."""

    def full(self: object, raw: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_threads.BackgroundWriter, "_write", full)
    t = _tensors()
    entries = [(n, sio.st_dtype(v.dtype), tuple(v.shape)) for n, v in t.items()]
    path = tmp_path / "x.safetensors"
    with pytest.raises(OutputError, match="No space left") as exc:
        sio.stream_safetensors(path, entries, iter(t.values())).result(timeout=60)
    assert exc.value.file == str(path)


def _copy_job(tmp_path: Path) -> tuple[Path, list[tuple[str, str, tuple[int, ...]]], list[sio.FileSlice], bytes]:
    """A source shard and the FileSlices that rename its tensors into a new shard."""
    src = tmp_path / "src.safetensors"
    t = _tensors()
    save_file(t, str(src))
    refs, _ = sio.read_header(src)
    entries = [(f"renamed.{n}", r.dtype, r.shape) for n, r in refs.items()]
    slices = [sio.FileSlice(r.file, r.begin, r.nbytes, r.name) for r in refs.values()]
    return src, entries, slices, b"".join(r.read_bytes() for r in refs.values())


@pytest.mark.parametrize("fail_after", [0, 1])
def test_copy_falls_back_to_read_write_when_copy_file_range_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_after: int) -> None:
    """A filesystem pair that refuses copy_file_range (EXDEV here), at once or after a first piece,
    still gets every byte, through read/write, and the digest of the file as written."""
    import errno
    import os

    _, entries, slices, data = _copy_job(tmp_path)
    real = os.copy_file_range
    calls = [0]

    def cfr(*a: int) -> int:
        calls[0] += 1
        if calls[0] > fail_after:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(a[0], a[1], min(1000, a[2]), a[3])  # a short copy: the rest must follow from the right offset

    monkeypatch.setattr(writer_threads, "COPY_MODE", "copy_file_range")
    monkeypatch.setattr(writer_threads.os, "copy_file_range", cfr)
    out = tmp_path / "out.safetensors"
    digest = sio.stream_safetensors(out, entries, iter(slices)).result(timeout=60)
    assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
    back = load_file(str(out))
    assert b"".join(back[n].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, _, _ in entries) == data
    assert calls[0] == fail_after + 1  # refused once, then read/write for the rest of the shard


def test_copy_file_range_errors_other_than_refusal_fail_the_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    _, entries, slices, _ = _copy_job(tmp_path)

    def full(*a: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_threads, "COPY_MODE", "copy_file_range")
    monkeypatch.setattr(writer_threads.os, "copy_file_range", full)
    with pytest.raises(OutputError, match="No space left"):
        sio.stream_safetensors(tmp_path / "out.safetensors", entries, iter(slices)).result(timeout=60)


@pytest.mark.parametrize("mode", ["copy_file_range", "readwrite"])
def test_copy_of_a_source_truncated_meanwhile_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    src, entries, slices, _ = _copy_job(tmp_path)
    monkeypatch.setattr(writer_threads, "COPY_MODE", mode)
    cut = min((s for s in slices if s.length > 100), key=lambda s: s.begin)  # the first tensor the cut lands in
    with open(src, "r+b") as fh:
        fh.truncate(cut.begin + 100)
    with pytest.raises(InputError, match="ended inside the tensor") as exc:
        sio.stream_safetensors(tmp_path / "out.safetensors", entries, iter(slices)).result(timeout=60)
    assert exc.value.file == str(src) and exc.value.tensor == cut.name


def test_e8m0_slices_are_checked_for_0xff_while_hashed(tmp_path: Path) -> None:
    """A copied slice marked as E8M0 scales fails the shard on a 0xFF byte (naming file and tensor);
    the same bytes in an unmarked slice (e.g. bf16 data) are copied as they are."""
    src = tmp_path / "src.safetensors"
    scales = torch.full((4, 40), 127, dtype=torch.uint8)
    scales[2, 33] = 0xFF
    save_file({"w.weight_scale": scales}, str(src))
    ref = sio.read_header(src)[0]["w.weight_scale"]
    entries: list[tuple[str, str, tuple[int, ...]]] = [("w.weight_scale", "U8", (4, 40))]
    ok = sio.stream_safetensors(tmp_path / "a.safetensors", entries, iter([sio.FileSlice(ref.file, ref.begin, ref.nbytes, ref.name)]))
    assert ok.result(timeout=60) == hashlib.sha256((tmp_path / "a.safetensors").read_bytes()).hexdigest()
    marked = sio.FileSlice(ref.file, ref.begin, ref.nbytes, ref.name, e8m0=True)
    with pytest.raises(InputError, match="0xFF") as exc:
        sio.stream_safetensors(tmp_path / "b.safetensors", entries, iter([marked])).result(timeout=60)
    assert exc.value.tensor == "w.weight_scale" and exc.value.file == str(src)


@pytest.mark.parametrize(("slices", "nbytes"), [(3, 1 << 30), (256, 2000), (1, 1)])
def test_copies_batched_between_computed_tensors_keep_file_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slices: int, nbytes: int) -> None:
    """Byte-range copies are handed over in batches (by count or bytes); interleaved with computed
    tensors, every tensor still lands at its place: the shard loads back equal, element for element."""
    _, _, copies, _ = _copy_job(tmp_path)
    src_refs = sio.read_header(tmp_path / "src.safetensors")[0]
    monkeypatch.setattr(writer, "BATCH_SLICES", slices)
    monkeypatch.setattr(writer, "BATCH_BYTES", nbytes)
    computed = _tensors(3)
    items: list[object] = []
    entries = []
    want = {}
    for i in range(3):  # copy, copy, computed, copy, copy, computed, ... with the same 4 source tensors
        for c in copies:
            name = f"r{i}.{c.name}"
            items.append(c)
            entries.append((name, src_refs[c.name].dtype, src_refs[c.name].shape))
            want[name] = src_refs[c.name].load()
        name, t = f"c{i}", computed["odd"] * (i + 1)
        items.append(t)
        entries.append((name, sio.st_dtype(t.dtype), tuple(t.shape)))
        want[name] = t
    out = tmp_path / "mixed.safetensors"
    digest = sio.stream_safetensors(out, entries, iter(items)).result(timeout=60)  # type: ignore[arg-type]
    assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
    back = load_file(str(out))
    assert set(back) == set(want)
    for name, t in want.items():
        assert torch.equal(back[name], t), name


def test_copy_runs_merge_only_adjacent_ranges_of_one_file() -> None:
    a, b = Path("/a"), Path("/b")
    sl = (sio.FileSlice(a, 0, 10, "x"), sio.FileSlice(a, 10, 0, "e"), sio.FileSlice(a, 10, 5, "y"),
          sio.FileSlice(a, 16, 4, "z"), sio.FileSlice(b, 20, 4, "u"), sio.FileSlice(a, 20, 3, "v"),
          sio.FileSlice(a, 0, 2, "w"))
    runs = sio.copy_runs(sl)
    assert [(r.file, r.begin, r.length, [p.name for p in parts]) for r, parts in runs] == [
        (a, 0, 15, ["x", "y"]), (a, 16, 4, ["z"]), (b, 20, 4, ["u"]), (a, 20, 3, ["v"]), (a, 0, 2, ["w"])]


def test_a_lagging_hasher_never_holds_back_the_producer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hasher reads the written bytes back from the file, so with its sha256 stalled and a tiny
    budget every item is still queued and written; the digest, once released, is the file's."""
    monkeypatch.setenv("MXFP4CONV_HASHER", "hashlib")  # the path that hashes chunk by chunk in Python
    release = threading.Event()
    real = writer_threads.BackgroundWriter._hash_chunk

    def stalled(self: writer_threads.BackgroundWriter, chunk: memoryview) -> None:
        release.wait(60)
        real(self, chunk)

    monkeypatch.setattr(writer_threads.BackgroundWriter, "_hash_chunk", stalled)
    monkeypatch.setattr(writer_threads, "HASH_CHUNK", 4096)  # the hasher reads the 1 MB shard in many chunks
    t = _tensors(5)
    entries = [(n, sio.st_dtype(v.dtype), tuple(v.shape)) for n, v in t.items()]
    path = tmp_path / "x.safetensors"
    got: list[object] = []
    th = threading.Thread(target=lambda: got.append(
        sio.stream_safetensors(path, entries, iter(t.values()), None, sio.InflightBudget(1))))
    th.start()
    th.join(30)
    try:
        assert not th.is_alive(), "the producer waited for the stalled hasher"
        want = sum(v.numel() * v.element_size() for v in t.values())
        deadline = time.monotonic() + 30
        while path.stat().st_size < want and time.monotonic() < deadline:
            time.sleep(0.01)
        assert path.stat().st_size > want  # the writer got everything out while the hasher was stalled
    finally:
        release.set()
        th.join(60)
    assert got[0].result(timeout=60) == hashlib.sha256(path.read_bytes()).hexdigest()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("items", "nbytes"), [(256, 1 << 30), (3, 1 << 30), (256, 700)])
def test_computed_buffers_batched_into_writev_survive_short_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, items: int, nbytes: int) -> None:
    """Consecutive computed tensors are written in batches (one writev each); the kernel may write
    less than asked at any point, even inside a buffer: every byte still lands in order (the shard
    loads back equal, and the digest is the file's)."""
    monkeypatch.setattr(writer, "BATCH_SLICES", items)
    monkeypatch.setattr(writer, "BATCH_BYTES", nbytes)
    real = os.writev
    calls: list[int] = []

    def short(fd: int, bufs: list[memoryview]) -> int:
        calls.append(len(bufs))
        first = memoryview(bufs[0])
        return real(fd, [first[: max(1, len(first) // 2)]] if len(calls) % 2 else bufs)

    monkeypatch.setattr(writer_threads.os, "writev", short)
    want = {f"t{i}.{k}": v * (i + 1) for i in range(4) for k, v in _tensors(3 + i).items()}
    want["empty"] = torch.zeros(0, dtype=torch.uint8)
    entries = [(n, sio.st_dtype(v.dtype), tuple(v.shape)) for n, v in want.items()]
    out = tmp_path / "batched.safetensors"
    digest = sio.stream_safetensors(out, entries, iter(want.values())).result(timeout=60)
    assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
    assert calls and (max(calls) > 1) == (items > 1)
    back = load_file(str(out))
    assert set(back) == set(want)
    for name, t in want.items():
        assert torch.equal(back[name], t), name


def test_header_entry_fast_path_agrees_with_the_checks(tmp_path: Path) -> None:
    """The header parser's fast path (exact types, a few C-level calls) returns what the full checks
    return for valid entries, and hands every invalid one to them (same error, same message)."""
    from mxfp4conv.errors import InputError

    p = tmp_path / "x.safetensors"
    entries: list[object] = [
        {"dtype": "U8", "shape": [4, 8], "data_offsets": [0, 32]},
        {"dtype": "BF16", "shape": [], "data_offsets": [32, 34]},
        {"dtype": "F32", "shape": [0, 5], "data_offsets": [34, 34]},
        {"dtype": "U8", "shape": [True, 8], "data_offsets": [0, 8]},  # bool is not a dimension
        {"dtype": "U8", "shape": [2.0, 8], "data_offsets": [0, 16]},
        {"dtype": "U8", "shape": [-1, 8], "data_offsets": [0, 8]},
        {"dtype": "U8", "shape": [2**48], "data_offsets": [0, 8]},
        {"dtype": "U8", "shape": [1] * 9, "data_offsets": [0, 1]},
        {"dtype": "U8", "shape": [4], "data_offsets": [0, True]},
        {"dtype": "U8", "shape": [4], "data_offsets": [0, 4, 8]},
        {"dtype": "U8", "shape": [4], "data_offsets": [4, 0]},
        {"dtype": "U8", "shape": [4], "data_offsets": [0, 5]},
        {"dtype": "U8", "shape": [4], "data_offsets": [96, 100]},  # beyond the data area
        {"dtype": ["U8"], "shape": [4], "data_offsets": [0, 4]},
        {"dtype": "Q9", "shape": [4], "data_offsets": [0, 4]},
        {"dtype": "U8", "shape": "4", "data_offsets": [0, 4]},
        {"shape": [4], "data_offsets": [0, 4]},
        [1, 2],
        "entry",
    ]
    for entry in entries:
        results: list[object] = []
        for parse in (reader._parse_entry, reader._checked_entry):
            try:
                results.append(parse(str(p), p, "t", entry, 8, 64))
            except InputError as exc:
                results.append(str(exc))
        assert results[0] == results[1], entry
    assert isinstance(reader._parse_entry(str(p), p, "t", entries[0], 8, 64), sio.TensorRef)


def test_header_json_duplicate_keys_at_any_depth() -> None:
    import json

    assert dtypes.no_duplicates([("a", 1), ("b", 2)]) == {"a": 1, "b": 2}
    for text, key in (('{"t":{"dtype":"U8","dtype":"F32"}}', "dtype"), ('{"t":{},"u":{},"t":{}}', "t")):
        with pytest.raises(ValueError, match=f"duplicate key '{key}'"):
            json.loads(text, object_pairs_hook=dtypes.no_duplicates)


def test_as_bytes_every_shape_and_dtype() -> None:
    """The writer's view of a computed tensor: the tensor's bytes in row-major order, for the zero-copy
    path (contiguous CPU uint8) and the general one (empty, 0-d, strided, other dtypes)."""
    base = torch.arange(24, dtype=torch.uint8).view(4, 6)
    cases = [base, base[1:3], base[:, :4], base.t(), torch.zeros(0, 5, dtype=torch.uint8),
             torch.tensor(7, dtype=torch.uint8), torch.arange(6, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.float32)]
    for t in cases:
        want = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert bytes(writer._as_bytes(t)) == want, (t.dtype, tuple(t.shape))
    assert bytes(writer._as_bytes(b"abc")) == b"abc"


def _raw_shard(path: Path, header: dict[str, object], data: bytes) -> Path:
    import json

    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def test_header_offsets_out_of_order_and_overlapping(tmp_path: Path) -> None:
    """Tensors listed out of file order are fine when they do not overlap (the sorted check runs only
    then); overlaps are found whatever the order, naming the later tensor of the pair in file order."""
    def e(b: int, n: int) -> dict[str, object]:
        return {"dtype": "U8", "shape": [n], "data_offsets": [b, b + n]}

    refs, _ = sio.read_header(_raw_shard(tmp_path / "a.safetensors", {"b": e(4, 4), "a": e(0, 4), "z": e(8, 0)}, bytes(8)))
    assert (refs["a"].nbytes, refs["b"].nbytes, refs["z"].nbytes) == (4, 4, 0)
    for order in (("a", "b"), ("b", "a")):
        spans = {"a": e(0, 6), "b": e(4, 4)}
        path = _raw_shard(tmp_path / f"o{order[0]}.safetensors", {k: spans[k] for k in order}, bytes(8))
        with pytest.raises(InputError, match="data of tensors a and b overlap") as info:
            sio.read_header(path)
        assert info.value.tensor == "b"


def test_open_checkpoint_restores_the_collector(tmp_path: Path) -> None:
    """The cyclic GC is paused while headers are parsed, and back on afterwards, after an error too
    (and left off when the caller had it off)."""
    import gc
    import json

    from mxfp4conv.sources.checkpoint import open_checkpoint

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    assert gc.isenabled()
    assert set(open_checkpoint(tmp_path).tensors) == {"w"}
    assert gc.isenabled()
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(InputError):
        open_checkpoint(tmp_path)
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(InputError):
            open_checkpoint(tmp_path)
        assert not gc.isenabled()
    finally:
        gc.enable()


class _OnGpu(torch.Tensor):
    """A host tensor the stream takes for one on a GPU (``device_write.is_device_tensor``)."""

    is_cuda = True


@pytest.mark.parametrize("seed", range(6))
def test_gpu_items_interleaved_with_host_items_and_copies_keep_file_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Tensors on a GPU are gathered per run of consecutive ones and written by the writer thread
    (``device.device_write``; its copy back is covered on the GPU by tests/device/test_device_write.py). Mixed in
    any order with host tensors, byte-range copies and check markers, every tensor lands at its place,
    each check sees its own range, the digest is the file's, and no host budget is held for them."""
    from mxfp4conv.device import device_write

    gathered: list[int] = []

    def gather(ts: list[torch.Tensor]) -> device_write.DeviceBytes:
        gathered.append(len(ts))
        flat = [t.as_subclass(torch.Tensor).reshape(-1).view(torch.uint8) for t in ts if t.numel()]
        return device_write.DeviceBytes(torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8), None)  # type: ignore[arg-type]

    def write_device(span: device_write.DeviceBytes, write: object) -> None:
        raw = span.data.numpy().tobytes()
        for i in range(0, len(raw), 4099):  # in pieces, as through the stages
            write(memoryview(raw)[i:i + 4099])  # type: ignore[operator]

    monkeypatch.setattr(device_write, "gather", gather)
    monkeypatch.setattr(device_write, "write_device", write_device)
    _, _, copies, _ = _copy_job(tmp_path)
    src_refs = sio.read_header(tmp_path / "src.safetensors")[0]
    g = torch.Generator().manual_seed(seed)
    kinds = torch.randint(0, 3, (24,), generator=g).tolist()
    items: list[object] = []
    entries = []
    want: dict[str, torch.Tensor] = {}
    for i, kind in enumerate(kinds):
        if kind == 0:
            c = copies[i % len(copies)]
            name = f"t{i}.{c.name}"
            items.append(c)
            entries.append((name, src_refs[c.name].dtype, src_refs[c.name].shape))
            want[name] = src_refs[c.name].load()
        else:
            t = _tensors(seed * 100 + i)[["big", "odd", "empty", "small"][i % 4]]
            name = f"t{i}"
            items.append(t.as_subclass(_OnGpu) if kind == 2 else t)
            entries.append((name, sio.st_dtype(t.dtype), tuple(t.shape)))
            want[name] = t
        if i % 5 == 4:
            items.append("check")
    checked: list[tuple[int, int]] = []
    budget = sio.InflightBudget(limit=1 << 40)
    seen: list[int] = []
    out = tmp_path / "mixed.safetensors"
    stream = sio.ShardStream(out, entries, budget=budget)
    for item in items:
        if item == "check":
            stream.feed(sio.CheckRange(lambda fd, b, e: checked.append((b, e)), hold=0))
        else:
            stream.feed(item)  # type: ignore[arg-type]
            seen.append(budget.used)
    digest = stream.finish().result(timeout=60)
    assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
    back = load_file(str(out))
    assert set(back) == set(want)
    for name, t in want.items():
        assert torch.equal(back[name], t), name
    header = 8 + int.from_bytes(out.read_bytes()[:8], "little")
    assert checked and checked[0][0] == header and all(a[1] == b[0] for a, b in itertools.pairwise(checked))
    assert sum(gathered) == kinds.count(2)
    host = sum(want[f"t{i}"].numel() * want[f"t{i}"].element_size() for i, k in enumerate(kinds) if k == 1)
    assert max(seen) <= header + host  # bytes on the GPU hold none of the host budget


def test_a_shards_check_lets_go_of_what_it_held_once_run(tmp_path: Path) -> None:
    """A shard's check thread keeps nothing of a check it has run while it waits for the shard's next
    one: what the check's function holds (a canonical unit, hundreds of MB in a conversion) is freed
    before its bytes leave the budget, not kept alive once per open shard."""

    class Unit:
        pass

    unit = Unit()
    alive = weakref.ref(unit)
    ran = threading.Event()

    def check(fd: int, begin: int, end: int, held: Unit = unit) -> None:
        ran.set()

    budget = sio.InflightBudget()
    stream = sio.ShardStream(tmp_path / "s.safetensors", [("t", "U8", (64,))], budget=budget)
    stream.feed(torch.arange(64, dtype=torch.uint8))
    stream.feed(sio.CheckRange(check, hold=1000))
    del check, unit
    assert ran.wait(30)
    deadline = time.monotonic() + 30
    while budget.used and time.monotonic() < deadline:  # the hold is returned once the check is let go
        time.sleep(0.01)
    assert budget.used == 0
    assert alive() is None  # the shard is still open: its check thread is waiting for the next check
    stream.finish().result(timeout=60)
