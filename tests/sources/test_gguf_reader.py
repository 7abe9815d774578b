"""``read_gguf`` (mxfp4conv/sources/gguf.py) reads a header of several MB in growing pieces: the same result as
the gguf package's reader of the whole file, and every cut of the file a one-line ``InputError`` naming it."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from mxfp4conv.errors import InputError
from mxfp4conv.sources.gguf import KV, VType, header_bytes, read_gguf

ROWS, COLS = 8, 64


def _file(path: Path, tokens: int) -> Path:
    texts = [f"token-{i:07d}-" + "x" * (i % 13) for i in range(tokens)]
    kvs = [KV("general.architecture", VType.STRING, "qwen3moe"),
           KV("tokenizer.ggml.tokens", VType.ARRAY, texts, VType.STRING),
           KV("tokenizer.ggml.scores", VType.ARRAY, [float(i % 7) for i in range(tokens)], VType.FLOAT32),
           KV("qwen3moe.block_count", VType.UINT32, 2)]
    sized = [("a.weight", "F32", (ROWS, COLS), ROWS * COLS * 4), ("b.weight", "F32", (COLS,), COLS * 4)]
    data = b"".join(bytes(range(256)) * (n // 256) + bytes(n % 256) + b"\0" * (-n % 32) for _, _, _, n in sized)
    path.write_bytes(header_bytes(sized, kvs) + data)
    return path


@pytest.mark.parametrize("tokens", [10, 150_000])  # a header of well under and of several MB
def test_reads_what_the_gguf_package_reads(tokens: int, tmp_path: Path) -> None:
    path = _file(tmp_path / "m.gguf", tokens)
    meta, tensors = read_gguf(path)
    theirs = gguf.GGUFReader(path)
    assert meta["tokenizer.ggml.tokens"] == theirs.fields["tokenizer.ggml.tokens"].contents()
    assert meta["qwen3moe.block_count"] == 2 and len(meta["tokenizer.ggml.scores"]) == tokens
    for t in theirs.tensors:
        ref = tensors[t.name]
        assert (ref.begin, ref.end - ref.begin) == (int(t.data_offset), int(t.n_bytes))


def test_every_cut_is_an_input_error_naming_the_file(tmp_path: Path) -> None:
    whole = _file(tmp_path / "whole.gguf", 150_000).read_bytes()
    cut = tmp_path / "cut.gguf"
    for at in (3, 20, 1 << 20, (1 << 20) + 7, len(whole) // 2, len(whole) - 1):
        cut.write_bytes(whole[:at])
        with pytest.raises(InputError) as err:
            read_gguf(cut)
        assert err.value.file == str(cut), at
        assert "\n" not in str(err.value)
