"""Shards fed with tensors on a GPU: the writer copies them back a stage at a time (``device.device_write``).

The file and its sha256 must be those of the same tensors fed from host memory, whatever the mix of
items around them, the stage size and the tensors' dtypes; a GPU conversion must not copy a unit's
results back to the host whole.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from mxfp4conv.device import device_write
from mxfp4conv.files.safetensors import CheckRange, FileSlice, ShardStream, st_dtype

pytestmark = pytest.mark.gpu


def _items(tmp_path: Path) -> tuple[list[tuple[str, object]], Path]:
    g = torch.Generator().manual_seed(0)
    src = tmp_path / "src.bin"
    src.write_bytes(torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g).numpy().tobytes())
    items: list[tuple[str, object]] = [
        ("a", torch.randint(0, 256, (3, 1000), dtype=torch.uint8, generator=g)),
        ("b", torch.randn(17, 33, generator=g).to(torch.bfloat16)),
        ("c", FileSlice(src, 100, 4000, "c")),
        ("d", torch.randint(0, 256, (70_001,), dtype=torch.uint8, generator=g)),
        ("e", torch.empty(0, dtype=torch.uint8)),
        ("f", torch.randn(9, 5, generator=g)),
        ("g", torch.randint(0, 256, (4, 8, 16), dtype=torch.uint8, generator=g)[:, 2:6]),  # rows of a larger buffer
    ]
    return items, src


def _write(path: Path, items: list[tuple[str, object]], on_gpu: set[str]) -> str:
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    for name, it in items:
        if isinstance(it, FileSlice):
            entries.append((name, "U8", (it.length,)))
        else:
            assert isinstance(it, torch.Tensor)
            entries.append((name, st_dtype(it.dtype), tuple(it.shape)))
    stream = ShardStream(path, entries)
    for k, (name, it) in enumerate(items):
        if name in on_gpu:
            assert isinstance(it, torch.Tensor)
            it = it.to("cuda:0")
        stream.feed(it)  # type: ignore[arg-type]
        if k == 3:
            stream.feed(CheckRange(lambda fd, b, e: None, hold=0))
    return stream.finish().result()


@pytest.mark.parametrize("stage", [4096, 1 << 20])
def test_device_tensors_write_the_host_tensors_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: int) -> None:
    device_write.STAGES.clear(stage)  # stages of this size from here on
    items, _ = _items(tmp_path)
    want = _write(tmp_path / "host.safetensors", items, set())
    for k, on_gpu in enumerate(({"a", "b", "d", "e", "f", "g"}, {"a", "b"}, {"d"}, {"e"}, {"b", "f", "g"})):
        path = tmp_path / f"gpu{k}.safetensors"
        got = _write(path, items, on_gpu)
        assert got == want, on_gpu
        assert path.read_bytes() == (tmp_path / "host.safetensors").read_bytes()
        assert hashlib.sha256(path.read_bytes()).hexdigest() == want
    device_write.STAGES.clear(device_write.STAGE_BYTES)


def test_a_gpu_conversion_copies_no_unit_back_whole(tmp_path: Path) -> None:
    """ct outputs of a GPU requant stay on the device until written: the pool of unit-sized
    page-locked result buffers is never used, and the bytes are the CPU's."""
    from mxfp4conv.device import pinned
    from mxfp4conv.run.pipeline import ConvertOptions, convert
    from tests.builders import build

    src = build("modelopt-nvfp4", tmp_path / "src", layers=2, experts=8, hidden=256, inter=128)
    before = pinned.host_slabs().allocated
    convert(src, tmp_path / "gpu", ConvertOptions(target="ct", device="cuda:0"))
    assert pinned.host_slabs().allocated == before
    convert(src, tmp_path / "cpu", ConvertOptions(target="ct", device="cpu"))
    for p in sorted((tmp_path / "cpu").glob("*.safetensors")):
        assert (tmp_path / "gpu" / p.name).read_bytes() == p.read_bytes()


def test_a_write_error_leaves_the_stages_reusable(tmp_path: Path) -> None:
    """A shard whose write fails mid-way reports the error; the stages go back to the pool idle."""
    span = device_write.gather([torch.arange(50_000, dtype=torch.int32, device="cuda:0")])
    seen: list[int] = []

    def write(chunk: memoryview) -> None:
        seen.append(len(chunk))
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        device_write.write_device(span, write)
    assert seen and device_write.STAGES.free_sets
    got = bytearray()
    device_write.write_device(span, got.extend)
    assert bytes(got) == torch.arange(50_000, dtype=torch.int32).numpy().tobytes()
