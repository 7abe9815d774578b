"""Shards produced in windows, their units interleaved (``conversion.interleave`` / ``windows``): the
order is a production schedule only, so every output byte equals the one-shard-at-a-time order's."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from mxfp4conv.cli import cli
from mxfp4conv.files import safetensors as sio
from mxfp4conv.files.safetensors import writer, writer_threads
from mxfp4conv.run import conversion, staging
from mxfp4conv.run.conversion import interleave, windows
from tests.builders import build


@pytest.mark.parametrize(("n", "most", "want"), [
    (0, 4, []),
    (1, 4, [[0]]),
    (4, 4, [[0, 1, 2, 3]]),
    (5, 4, [[0, 1, 2], [3, 4]]),  # never a lone last shard hashing by itself
    (7, 4, [[0, 1, 2, 3], [4, 5, 6]]),
    (9, 4, [[0, 1, 2], [3, 4, 5], [6, 7, 8]]),
    (140, 4, [list(range(i, i + 4)) for i in range(0, 140, 4)]),
    (3, 1, [[0], [1], [2]]),
])
def test_windows_are_even_groups_in_order(n: int, most: int, want: list[list[int]]) -> None:
    assert [list(r) for r in windows(n, most)] == want


@pytest.mark.parametrize(("sizes", "want"), [
    ([[5, 5], [5, 5]], [(0, 0), (1, 0), (0, 1), (1, 1)]),
    # a shard half the size of the other gets a unit every other turn: both finish together
    ([[1, 1, 1, 1], [1, 1]], [(0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (0, 3)]),
    # bytes, not unit counts, set the pace: the big unit's shard waits while the small units catch up
    ([[8, 2], [2, 2, 2, 2, 2]], [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3), (0, 1), (1, 4)]),
    ([[3, 3, 3]], [(0, 0), (0, 1), (0, 2)]),
    ([[], [1]], [(1, 0)]),
    ([[0, 0], [4]], [(0, 0), (0, 1), (1, 0)]),  # units of no bytes go first: they hold the disk up for nothing
])
def test_interleave_golden(sizes: list[list[int]], want: list[tuple[int, int]]) -> None:
    assert interleave(sizes) == want


def test_interleave_keeps_each_shards_order_and_every_unit() -> None:
    sizes = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3]]
    order = interleave(sizes)
    assert sorted(order) == [(i, k) for i, s in enumerate(sizes) for k in range(len(s))]
    for i in range(len(sizes)):
        assert [k for j, k in order if j == i] == list(range(len(sizes[i])))


def _run(*args: str) -> None:
    res = CliRunner().invoke(cli, list(args))
    assert res.exit_code == 0, res.output


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("layout", "target"), [("modelopt-nvfp4", "ct"), ("ct-mxfp4", "quark"), ("gpt-oss", "marlin")])
def test_windows_write_the_bytes_of_one_shard_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        layout: str, target: str) -> None:
    """Eight shards (two windows of 4) are written interleaved, and every output file, the manifest's
    digests included, equals the bytes of a conversion that writes one shard at a time."""
    src = build(layout, tmp_path / "src", shards=3)
    args = ["--to", target, "--max-shard-size", "16KB", "--device", "cpu"]
    feeds: list[str] = []
    real_feed = sio.ShardStream.feed

    def feed(self: sio.ShardStream, item: object) -> None:
        feeds.append(self._writer._path.name)
        real_feed(self, item)  # type: ignore[arg-type]

    with monkeypatch.context() as m:
        m.setattr(sio.ShardStream, "feed", feed)
        _run("convert", str(src), str(tmp_path / "window"), *args)
    with monkeypatch.context() as m:
        m.setattr(conversion, "SHARD_WINDOW", 1)
        _run("convert", str(src), str(tmp_path / "single"), *args)
    got, want = _hashes(tmp_path / "window"), _hashes(tmp_path / "single")
    assert got == want
    names = sorted(p.name for p in (tmp_path / "window").rglob("model-*.safetensors"))
    assert len(names) >= 5, names  # the case needs at least two windows
    assert feeds != sorted(feeds)  # shards were fed turn about, not one after the other
    assert set(feeds) == set(names)
    assert staging.SHARD_WINDOW == 4


def test_at_most_two_units_of_computed_outputs_are_alive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However many files are written at once and however slow the disk, a unit with computed
    outputs is produced only once the one before the previous is written and let go: the GPU path's
    result buffers (one per unit, reused) and the CPU path's memory stay at two units."""
    import time
    import weakref

    import numpy as np

    from mxfp4conv.run import pipeline as pl

    src = build("modelopt-nvfp4", tmp_path / "src", layers=6, shards=3)
    real_units, real_write, real_bytes = conversion.unit_results, writer_threads.BackgroundWriter._write, writer._as_bytes
    held: list[list[weakref.ref[np.ndarray]]] = []  # per unit produced: its buffers handed to the writers
    most = [0]

    def units(*a: object, **k: object) -> object:
        for res in real_units(*a, **k):  # type: ignore[arg-type]
            most[0] = max(most[0], sum(any(r() is not None for r in u) for u in held))
            held.append([])
            yield res

    def as_bytes(item: object) -> object:
        arr = np.frombuffer(real_bytes(item), dtype=np.uint8)  # type: ignore[arg-type]
        held[-1].append(weakref.ref(arr))
        return arr

    def slow_write(self: object, raw: object) -> None:
        time.sleep(0.02)  # a disk slower than the producer
        real_write(self, raw)  # type: ignore[arg-type]

    monkeypatch.setattr(conversion, "unit_results", units)
    monkeypatch.setattr(writer, "_as_bytes", as_bytes)
    monkeypatch.setattr(writer_threads.BackgroundWriter, "_write", slow_write)
    report = pl.convert(src, tmp_path / "out", pl.ConvertOptions(target="ct", device="cpu", max_shard_size=20_000))
    assert report.verify and report.verify["ok"]
    assert len(report.shards) >= 4 and sum(1 for u in held if u) >= 6
    assert most[0] == 1, most  # when a unit is produced, only the previous one's outputs are still held
