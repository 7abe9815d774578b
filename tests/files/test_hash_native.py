"""The native shard hasher (mxfp4conv/files/hash_native.py): digests equal hashlib's, the fallback, the contract."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mxfp4conv.errors import InputError
from mxfp4conv.files import hash_native as hn
from mxfp4conv.files import safetensors as sio
from mxfp4conv.files.cbuild import compiler
from tests.builders import build


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> hn._Native:
    """The native helper, which must load wherever a C compiler and a libcrypto exist."""
    if compiler() is None or hn._libcrypto_path() is None:
        pytest.skip("no C compiler or no libcrypto: only the hashlib path can run here")
    monkeypatch.setenv("MXFP4CONV_HASHER", "native")
    lib = hn.load()
    assert lib is not None
    return lib


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("h") / "data.bin"
    data = os.urandom(3 * hn.CHUNK + 12_345)
    path.write_bytes(data)
    return path, data


RANGES = [(0, 0), (17, 0), (0, 1), (3, 100), (4095, 4097), (4096, 8192), (1, 3 * (1 << 20) + 12_344),
          (0, 3 * (1 << 20) + 12_345), (1 << 20, 1 << 20), ((1 << 20) - 1, 2 * (1 << 20) + 3)]


@pytest.mark.parametrize("how", ["hash_range", "hash_mapped"])
@pytest.mark.parametrize("bufsize", [4096, 65_537, hn.CHUNK])
@pytest.mark.parametrize(("pos", "length"), RANGES)
def test_native_range_digest_equals_hashlib(native: hn._Native, data_file: tuple[Path, bytes], bufsize: int,
                                            pos: int, length: int, how: str) -> None:
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        h = hn.NativeSha256(native)
        assert getattr(h, how)(fd, pos, length, hn.buffer(bufsize)) == (length, 0)
        assert h.hexdigest() == hashlib.sha256(data[pos:pos + length]).hexdigest()
        assert h.hexdigest() == hashlib.sha256(data[pos:pos + length]).hexdigest()  # repeatable
    finally:
        os.close(fd)


def test_native_ranges_and_updates_accumulate_like_hashlib(native: hn._Native, data_file: tuple[Path, bytes]) -> None:
    """Several ranges (in any order, overlapping) and Python updates in between feed one digest."""
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    h, want = hn.NativeSha256(native), hashlib.sha256()
    buf = hn.buffer(10_000)
    try:
        for pos, length in [(5, 70_000), (0, 3), (1 << 20, 2 << 20), (4, 70_000)]:
            assert h.hash_range(fd, pos, length, buf) == (length, 0)
            want.update(data[pos:pos + length])
            h.update(b"header")
            h.update(memoryview(bytearray(b"computed")))
            h.update(b"")
            want.update(b"headercomputed")
    finally:
        os.close(fd)
    assert h.hexdigest() == want.hexdigest()
    with pytest.raises(ValueError, match="after hexdigest"):
        h.update(b"x")


def test_native_short_file_bad_fd_and_0xff(native: hn._Native, tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    path.write_bytes(b"\x01" * 5000 + b"\xff" + b"\x02" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        h = hn.NativeSha256(native)
        assert h.hash_range(fd, 5000, 10_000, hn.buffer(64)) == (101, 0)  # the file ends first
        assert h.hexdigest() == hashlib.sha256(b"\xff" + b"\x02" * 100).hexdigest()
        # a chunk with 0xFF stops before it is hashed; earlier chunks are in
        assert hn.NativeSha256(native).hash_range(fd, 0, 5101, hn.buffer(1000), check_ff=True) == (5000, -1)
        assert hn.NativeSha256(native).hash_range(fd, 0, 5000, hn.buffer(1000), check_ff=True) == (5000, 0)
    finally:
        os.close(fd)
    done, status = hn.NativeSha256(native).hash_range(fd, 0, 10, hn.buffer(64))  # closed descriptor
    assert (done, status) == (0, 9)  # EBADF


def test_mapped_hash_over_windows_short_file_and_bad_fd(native: hn._Native, tmp_path: Path) -> None:
    """The in-place hash maps 16 MiB at a time: a range across windows (of a sparse file) is hashed as
    read; a range past the end hashes what there is, as the pread loop does; a closed descriptor is its errno."""
    path = tmp_path / "big.bin"
    with path.open("wb") as fh:
        fh.write(b"head")
        fh.seek(64 << 20)
        fh.write(bytes(range(256)) * 40)
        fh.seek((129 << 20) + 7)
        fh.write(b"tail")
    data = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        for pos, length in ((0, len(data)), (4093, (64 << 20) + 100), ((64 << 20) - 5, 20), (3, len(data))):
            h = hn.NativeSha256(native)
            want = min(length, len(data) - pos)
            assert h.hash_mapped(fd, pos, length, hn.buffer(4096)) == (want, 0)
            assert h.hexdigest() == hashlib.sha256(data[pos:pos + want]).hexdigest()
    finally:
        os.close(fd)
    assert hn.NativeSha256(native).hash_mapped(fd, 0, 10, hn.buffer(64)) == (0, 9)  # EBADF


def _writer_job(tmp_path: Path) -> tuple[list[tuple[str, str, tuple[int, ...]]], list[object]]:
    """A shard of computed tensors and byte-range copies (several MiB, unaligned sizes)."""
    g = torch.Generator().manual_seed(7)
    src = {"a": torch.randint(0, 256, (3001, 1037), generator=g, dtype=torch.uint8),
           "b": torch.randn(5, 3).to(torch.bfloat16), "c": torch.zeros(0, 2)}
    save_file(src, str(tmp_path / "src.safetensors"))
    refs = sio.read_header(tmp_path / "src.safetensors")[0]
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    items: list[object] = []
    for i in range(3):
        for n, r in refs.items():
            entries.append((f"copy{i}.{n}", r.dtype, r.shape))
            items.append(sio.FileSlice(r.file, r.begin, r.nbytes, r.name))
        t = torch.randint(0, 256, ((2 << 20) + i * 7,), generator=g, dtype=torch.uint8)
        entries.append((f"computed{i}", "U8", tuple(t.shape)))
        items.append(t)
    return entries, items


@pytest.mark.parametrize("mode", ["native", "hashlib"])
def test_stream_digest_is_the_files_sha256_in_both_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          mode: str) -> None:
    if mode == "native" and compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("MXFP4CONV_HASHER", mode)
    entries, items = _writer_job(tmp_path)
    out = tmp_path / "out.safetensors"
    fut = sio.stream_safetensors(out, entries, iter(items))  # type: ignore[arg-type]
    assert fut.result(timeout=60) == hashlib.sha256(out.read_bytes()).hexdigest()
    assert isinstance(hn.sha256(), hn.NativeSha256) == (mode == "native")


@pytest.mark.parametrize("mode", ["native", "hashlib"])
def test_e8m0_0xff_is_caught_in_both_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    if mode == "native" and compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("MXFP4CONV_HASHER", mode)
    src = tmp_path / "src.safetensors"
    scales = torch.full((300, 4000), 127, dtype=torch.uint8)  # 1.2 MB: the 0xFF lies in the second chunk
    scales[290, 33] = 0xFF
    save_file({"w.weight_scale": scales}, str(src))
    ref = sio.read_header(src)[0]["w.weight_scale"]
    entries: list[tuple[str, str, tuple[int, ...]]] = [("w.weight_scale", "U8", (300, 4000))]
    plain = sio.FileSlice(ref.file, ref.begin, ref.nbytes, ref.name)
    ok = sio.stream_safetensors(tmp_path / "a.safetensors", entries, iter([plain]))
    assert ok.result(timeout=60) == hashlib.sha256((tmp_path / "a.safetensors").read_bytes()).hexdigest()
    marked = sio.FileSlice(ref.file, ref.begin, ref.nbytes, ref.name, e8m0=True)
    with pytest.raises(InputError, match="0xFF") as exc:
        sio.stream_safetensors(tmp_path / "b.safetensors", entries, iter([marked])).result(timeout=60)
    assert exc.value.tensor == "w.weight_scale" and exc.value.file == str(src)


def test_a_source_that_shrinks_names_file_and_tensor_natively(native: hn._Native, tmp_path: Path) -> None:
    src = tmp_path / "src.safetensors"
    save_file({"t": torch.zeros(100_000, dtype=torch.uint8)}, str(src))
    ref = sio.read_header(src)[0]["t"]
    with open(src, "r+b") as fh:
        fh.truncate(ref.begin + 50_000)
    cut = sio.FileSlice(ref.file, ref.begin, ref.nbytes, ref.name)
    with pytest.raises(InputError, match="file ended") as exc:
        sio.stream_safetensors(tmp_path / "o.safetensors", [("t", "U8", (100_000,))], iter([cut])).result(timeout=60)
    assert exc.value.tensor == "t"


def _no_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A fresh process's state, with an empty cache and no C compiler on PATH."""
    monkeypatch.setattr(hn, "_lib", None)
    monkeypatch.setattr(hn, "_error", None)
    monkeypatch.setenv("MXFP4CONV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.delenv("CC", raising=False)


def test_no_compiler_falls_back_to_hashlib_silently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_build(monkeypatch, tmp_path)
    monkeypatch.setenv("MXFP4CONV_HASHER", "auto")
    assert hn.load() is None and "no C compiler" in (hn.build_error() or "")
    h = hn.sha256()
    assert not isinstance(h, hn.NativeSha256)
    entries, items = _writer_job(tmp_path)
    out = tmp_path / "out.safetensors"
    assert sio.stream_safetensors(out, entries, iter(items)).result(timeout=60) == hashlib.sha256(  # type: ignore[arg-type]
        out.read_bytes()).hexdigest()
    monkeypatch.setenv("MXFP4CONV_HASHER", "native")
    with pytest.raises(OSError, match="MXFP4CONV_HASHER=native"):
        hn.sha256()


def test_hashlib_mode_never_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_build(monkeypatch, tmp_path)
    monkeypatch.setenv("MXFP4CONV_HASHER", "hashlib")
    assert not isinstance(hn.sha256(), hn.NativeSha256)
    assert hn.build_error() is None and not (tmp_path / "cache").exists()
    monkeypatch.setenv("MXFP4CONV_HASHER", "fast")
    with pytest.raises(ValueError, match="auto, native or hashlib"):
        hn.sha256()


def test_no_libcrypto_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hn, "_lib", None)
    monkeypatch.setattr(hn, "_error", None)
    monkeypatch.setattr(hn, "_libcrypto_path", lambda: None)
    monkeypatch.setenv("MXFP4CONV_HASHER", "auto")
    assert not isinstance(hn.sha256(), hn.NativeSha256) and "libcrypto" in (hn.build_error() or "")


@pytest.mark.parametrize("right,wrong", [
    ("update(ctx, buf, (size_t)got)", "update(ctx, buf, (size_t)got - 1)"),  # the pread loop
    ("update(ctx, m + (at - start), (size_t)n)", "update(ctx, m + (at - start), (size_t)n - 1)"),  # in place
])
def test_a_wrong_native_digest_is_refused_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, right: str,
                                                  wrong: str) -> None:
    """A helper that hashes the wrong bytes (here: one byte short per chunk, read or mapped) fails the
    self-check on load: auto falls back to hashlib, native is an error."""
    if compiler() is None:
        pytest.skip("no C compiler")
    bad = tmp_path / "hash_native.c"
    assert hn._SOURCE.read_text().count(right) == 1
    bad.write_text(hn._SOURCE.read_text().replace(right, wrong))
    assert bad.read_text() != hn._SOURCE.read_text()
    monkeypatch.setattr(hn, "_SOURCE", bad)
    monkeypatch.setattr(hn, "_lib", None)
    monkeypatch.setattr(hn, "_error", None)
    monkeypatch.setenv("MXFP4CONV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MXFP4CONV_HASHER", "auto")
    assert not isinstance(hn.sha256(), hn.NativeSha256)
    assert "self-check failed" in (hn.build_error() or "")
    monkeypatch.setenv("MXFP4CONV_HASHER", "native")
    with pytest.raises(OSError, match="self-check failed"):
        hn.sha256()


@pytest.fixture(scope="module")
def srcs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    return {layout: build(layout, root / layout, shards=2) for layout in ("ct-mxfp4", "modelopt-nvfp4")}


@pytest.mark.parametrize(("layout", "args"), [("ct-mxfp4", ("--to", "quark")),
                                              ("modelopt-nvfp4", ("--to", "ct", "--device", "cpu"))])
def test_conversion_manifests_identical_native_and_hashlib(srcs: dict[str, Path], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch, layout: str,
                                                           args: tuple[str, ...]) -> None:
    """A whole conversion (byte-range copies, or requantized computed tensors) records the same
    per-file sha256 with either hasher, and each is the file's."""
    from click.testing import CliRunner

    from mxfp4conv.cli import cli

    if compiler() is None:
        pytest.skip("no C compiler")
    outputs = {}
    for mode in ("native", "hashlib"):
        monkeypatch.setenv("MXFP4CONV_HASHER", mode)
        out = tmp_path / mode
        res = CliRunner().invoke(cli, ["convert", str(srcs[layout]), str(out), "--max-shard-size", "40KB", *args])
        assert res.exit_code == 0, res.output
        outputs[mode] = json.loads((out / "mxfp4conv.json").read_text())["outputs"]
        for name, digest in outputs[mode].items():
            assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, (mode, name)
    assert len(outputs["native"]) > 2
    assert outputs["native"] == outputs["hashlib"]


def test_native_mode_without_a_build_is_a_usage_error(srcs: dict[str, Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from mxfp4conv.cli import cli

    _no_build(monkeypatch, tmp_path)
    monkeypatch.setenv("MXFP4CONV_HASHER", "native")
    res = CliRunner().invoke(cli, ["convert", str(srcs["ct-mxfp4"]), str(tmp_path / "o"), "--to", "quark"])
    assert res.exit_code == 2 and not (tmp_path / "o").exists()
    assert "MXFP4CONV_HASHER=native" in res.stderr and "Traceback" not in res.stderr
