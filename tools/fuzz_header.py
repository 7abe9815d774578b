"""Coverage-guided fuzzing of the safetensors header parser with atheris (libFuzzer).

``read_header`` must return a safe parse or raise ``InputError`` -- never another exception, a
hang or a huge allocation. Every input is written to a file (on /dev/shm when present) and parsed;
a parse is then checked (bounds, sizes, no overlaps) and its tensors loaded.

    pip install atheris
    python tools/fuzz_header.py --seeds /tmp/fuzz-header-corpus     # write seed shards, exit
    python tools/fuzz_header.py /tmp/fuzz-header-corpus -dict=tools/fuzz_header.dict \
        -max_total_time=300 -max_len=4096 -rss_limit_mb=4096

Findings (crash inputs) are written by libFuzzer as ``crash-*`` files in the working directory;
reproduce one with ``python tools/fuzz_header.py crash-<sha>``. ``--structured`` switches to a
mode where the fuzzer's bytes drive a JSON header's structure (names, dtypes, shapes, offsets,
damaged fields, length field) instead of raw bytes. See FUZZING.md.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import atheris
import torch  # noqa: F401  (imported before instrumentation: torch itself is not fuzzed)

with atheris.instrument_imports(include=["mxfp4conv"]):
    from mxfp4conv.errors import InputError
    from mxfp4conv.files.safetensors import DTYPES, read_header

_DIR = Path(tempfile.mkdtemp(prefix="fuzz-header-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
_PATH = _DIR / "input.safetensors"


def test_one_input(data: bytes) -> None:
    _PATH.write_bytes(data)
    try:
        tensors, meta = read_header(_PATH)
    except InputError as err:
        text = str(err)
        if "\n" in text or str(_PATH) not in text:
            raise AssertionError(f"error is not one line naming the file: {text!r}") from err
        return
    n = int.from_bytes(data[:8], "little")
    start, size = 8 + n, len(data)
    spans = []
    for name, ref in tensors.items():
        if not (start <= ref.begin <= ref.end <= size):
            raise AssertionError(f"{name}: [{ref.begin}, {ref.end}) outside the data area [{start}, {size})")
        if ref.nbytes != math.prod(ref.shape) * DTYPES[ref.dtype][1]:
            raise AssertionError(f"{name}: {ref.nbytes} bytes for {ref.dtype}{list(ref.shape)}")
        t = ref.load()
        if tuple(t.shape) != ref.shape:
            raise AssertionError(f"{name}: loaded shape {tuple(t.shape)}, header {ref.shape}")
        if ref.nbytes:
            spans.append((ref.begin, ref.end))
    spans.sort()
    for (_, e0), (b1, _) in itertools.pairwise(spans):
        if b1 < e0:
            raise AssertionError("overlapping tensors accepted")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise AssertionError("metadata is not str -> str")


_DTYPE_CHOICES = [*sorted(DTYPES), "F4", "u8", "", "BF16 "]


def structured_input(data: bytes) -> None:
    """Let the fuzzer drive a JSON header's structure (the byte-level mode mostly breaks the JSON)."""
    fdp = atheris.FuzzedDataProvider(data)
    header: dict[str, object] = {}
    if fdp.ConsumeBool():
        header["__metadata__"] = _value(fdp) if fdp.ConsumeIntInRange(0, 7) == 0 else {"format": "pt"}
    off = 0
    for i in range(fdp.ConsumeIntInRange(0, 6)):
        dtype = _DTYPE_CHOICES[fdp.ConsumeIntInRange(0, len(_DTYPE_CHOICES) - 1)]
        shape = [fdp.ConsumeIntInRange(0, 9) for _ in range(fdp.ConsumeIntInRange(0, 3))]
        nbytes = math.prod(shape) * DTYPES.get(dtype, (None, 1))[1]
        begin = off + fdp.ConsumeIntInRange(-4, 4) if fdp.ConsumeBool() else off
        entry: dict[str, object] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + nbytes]}
        if fdp.ConsumeIntInRange(0, 5) == 0:  # damage one field
            entry[["dtype", "shape", "data_offsets"][fdp.ConsumeIntInRange(0, 2)]] = _value(fdp)
        header[fdp.ConsumeUnicode(6) if fdp.ConsumeBool() else f"t{i}"] = entry
        off = max(off, begin + nbytes)
    raw = json.dumps(header).encode()
    if fdp.ConsumeIntInRange(0, 7) == 0:
        raw = raw[: fdp.ConsumeIntInRange(0, len(raw))]
    raw += b" " * (-len(raw) % 8)
    length = len(raw) + (fdp.ConsumeIntInRange(-9, 9) if fdp.ConsumeIntInRange(0, 7) == 0 else 0)
    rest = fdp.ConsumeBytes(max(0, off + fdp.ConsumeIntInRange(-3, 8)))
    test_one_input(max(length, 0).to_bytes(8, "little") + raw + rest)


def _value(fdp: atheris.FuzzedDataProvider) -> object:
    kind = fdp.ConsumeIntInRange(0, 7)
    return [None, True, fdp.ConsumeInt(9), fdp.ConsumeRegularFloat(), fdp.ConsumeUnicode(4),
            [fdp.ConsumeInt(9), fdp.ConsumeInt(2)], {"x": fdp.ConsumeInt(2)}, 2**64][kind]


def _shard(header: dict[str, object], data: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data


def write_seeds(folder: Path) -> None:
    """A handful of valid and near-valid shards to start from."""
    folder.mkdir(parents=True, exist_ok=True)
    seeds = {
        "empty": _shard({}, b""),
        "meta": _shard({"__metadata__": {"format": "pt"}}, b""),
        "one": _shard({"w": {"dtype": "U8", "shape": [2, 3], "data_offsets": [0, 6]}}, bytes(range(6))),
        "two": _shard({"__metadata__": {"format": "pt"},
                       "a.weight_packed": {"dtype": "U8", "shape": [4, 4], "data_offsets": [0, 16]},
                       "a.weight_scale": {"dtype": "F8_E4M3", "shape": [4, 2], "data_offsets": [16, 24]},
                       "a.weight_global_scale": {"dtype": "F32", "shape": [1], "data_offsets": [24, 28]}},
                      bytes(28)),
        "bf16": _shard({"n": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
                        "s": {"dtype": "F32", "shape": [], "data_offsets": [6, 10]}}, bytes(10)),
        "zero": _shard({"z": {"dtype": "I64", "shape": [0, 5], "data_offsets": [0, 0]}}, b""),
    }
    for name, blob in seeds.items():
        (folder / name).write_bytes(blob)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--seeds":
        write_seeds(Path(sys.argv[2]))
        return
    structured = "--structured" in sys.argv
    argv = [a for a in sys.argv if a != "--structured"]
    atheris.Setup(argv, structured_input if structured else test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
