"""The GGUF container (version 3): header bytes for the shard writer, and a header-only reader.

A GGUF file is ``GGUF``, version, tensor and key counts, the key/value metadata, one record per tensor
(name, dims innermost first, GGML type, data offset), padding to ``general.alignment`` (32), then the
tensor data, each tensor at an aligned offset. The writer here builds only the header: the shard
writer (``files/safetensors.ShardStream``) streams the data after it, with the padding this container
declares (``GGUF.pad``), exactly as for a safetensors shard.

Output tensors are declared with safetensors dtypes (``OutTensor``); in a GGUF output ``U8`` always
means GGML MXFP4 blocks ``[..., K/32 * 17]`` and ``I8`` GGML NVFP4 blocks ``[..., K/64 * 36]``
(``formats/ggml.py``: rows of bytes, one byte per ``U8``/``I8`` element), the float dtypes are GGML's own.
The reader maps them back the same way, so a written GGUF opens as a ``Checkpoint`` whose tensors
``decode`` reads by name, like any output.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mxfp4conv.errors import InputError
from mxfp4conv.files.safetensors import TensorRef

if TYPE_CHECKING:
    from mxfp4conv.sources.checkpoint import Checkpoint

__all__ = [
    "ALIGNMENT",
    "GGUF",
    "KV",
    "GgmlType",
    "VType",
    "header_bytes",
    "kv_dict",
    "mxfp4_row_bytes",
    "open_gguf",
    "read_gguf",
]

MAGIC = b"GGUF"
VERSION = 3
ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
BLOCK, BLOCK_BYTES = 32, 17  # GGML MXFP4: 32 elements in 17 bytes (formats/ggml.py)
NV_BLOCK, NV_BLOCK_BYTES = 64, 36  # GGML NVFP4: 64 elements in 36 bytes
MAX_HEADER = 512 << 20  # a vocabulary of 256k tokens with merges is ~30 MB


class VType(IntEnum):
    """GGUF metadata value types."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR = {VType.UINT8: "B", VType.INT8: "b", VType.UINT16: "H", VType.INT16: "h", VType.UINT32: "I",
           VType.INT32: "i", VType.FLOAT32: "f", VType.BOOL: "?", VType.UINT64: "Q", VType.INT64: "q",
           VType.FLOAT64: "d"}


class GgmlType(IntEnum):
    """The GGML tensor types a GGUF output holds."""

    F32 = 0
    F16 = 1
    I32 = 26
    BF16 = 30
    MXFP4 = 39
    NVFP4 = 40


_BY_DTYPE = {"F32": GgmlType.F32, "F16": GgmlType.F16, "I32": GgmlType.I32, "BF16": GgmlType.BF16,
             "U8": GgmlType.MXFP4, "I8": GgmlType.NVFP4}
_BLOCKS = {GgmlType.MXFP4: (BLOCK, BLOCK_BYTES), GgmlType.NVFP4: (NV_BLOCK, NV_BLOCK_BYTES)}
_DTYPE_OF = {t: d for d, t in _BY_DTYPE.items()}


@dataclass(frozen=True)
class KV:
    """One metadata entry; ``item`` is the element type of an ARRAY value."""

    key: str
    type: VType
    value: Any
    item: VType | None = None


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(t: VType, v: Any, item: VType | None) -> bytes:
    if t is VType.STRING:
        return _string(v)
    if t is VType.ARRAY:
        assert item is not None
        if item is VType.STRING:
            return struct.pack("<IQ", item, len(v)) + b"".join(_string(s) for s in v)
        return struct.pack("<IQ", item, len(v)) + struct.pack(f"<{len(v)}{_SCALAR[item]}", *v)
    return struct.pack(f"<{_SCALAR[t]}", v)


def mxfp4_row_bytes(k: int) -> int:
    """Bytes of one GGML MXFP4 row of ``k`` elements."""
    if k % BLOCK:
        raise ValueError(f"row size {k} is not a multiple of the MXFP4 block size {BLOCK}")
    return k // BLOCK * BLOCK_BYTES


def nvfp4_row_bytes(k: int) -> int:
    """Bytes of one GGML NVFP4 row of ``k`` elements."""
    if k % NV_BLOCK:
        raise ValueError(f"row size {k} is not a multiple of the NVFP4 block size {NV_BLOCK}")
    return k // NV_BLOCK * NV_BLOCK_BYTES


def ggml_dims(dtype: str, shape: tuple[int, ...]) -> tuple[GgmlType, tuple[int, ...]]:
    """The GGML type and dims (``ne``, innermost first) of a declared output tensor."""
    if dtype not in _BY_DTYPE:
        raise ValueError(f"GGUF outputs hold {sorted(_BY_DTYPE)}, not {dtype}")
    t = _BY_DTYPE[dtype]
    dims = list(reversed(shape))
    if t in _BLOCKS:
        elements, nbytes = _BLOCKS[t]
        dims[0] = dims[0] // nbytes * elements
    return t, tuple(dims)


class GGUF:
    """The container ``ShardStream`` writes a GGUF shard with."""

    ALIGN = ALIGNMENT

    @staticmethod
    def pad(nbytes: int) -> int:
        """Zero bytes after a tensor so that the next one (and the file's end) is aligned."""
        return -nbytes % ALIGNMENT

    @staticmethod
    def header(sized: list[tuple[str, str, tuple[int, ...], int]], metadata: list[KV] | None) -> bytes:
        return header_bytes(sized, metadata or [])


def header_bytes(sized: list[tuple[str, str, tuple[int, ...], int]], kvs: list[KV]) -> bytes:
    """Everything before the first tensor's data, padded to the alignment."""
    parts = [MAGIC, struct.pack("<IQQ", VERSION, len(sized), len(kvs))]
    parts += [_string(kv.key) + struct.pack("<I", kv.type) + _value(kv.type, kv.value, kv.item) for kv in kvs]
    off = 0
    for name, dtype, shape, nbytes in sized:
        t, dims = ggml_dims(dtype, shape)
        parts.append(_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, t, off))
        off += nbytes + (-nbytes % ALIGNMENT)
    raw = b"".join(parts)
    return raw + b"\0" * (-len(raw) % ALIGNMENT)


class _Short(Exception):
    """The header runs past the bytes read so far (``read_gguf`` reads more)."""


class _Reader:
    def __init__(self, raw: bytes, path: Path, whole: bool = True) -> None:
        # whole: ``raw`` is all the file has (up to MAX_HEADER); else running past it asks for more
        self.raw, self.pos, self.path, self.whole = raw, 0, path, whole

    def _past(self, error: InputError) -> InputError | _Short:
        return error if self.whole else _Short()

    def many(self, fmt: str) -> tuple[Any, ...]:
        n = struct.calcsize(fmt)
        if self.pos + n > len(self.raw):
            raise self._past(InputError("GGUF header ends early (truncated file?)", file=str(self.path)))
        out = struct.unpack_from(fmt, self.raw, self.pos)
        self.pos += n
        return out

    def take(self, fmt: str) -> Any:
        return self.many(fmt)[0]

    def string(self) -> str:
        n = self.take("<Q")
        if n > len(self.raw) - self.pos:
            raise self._past(InputError("GGUF string runs past the header (truncated file?)", file=str(self.path)))
        s = self.raw[self.pos:self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return s

    def value(self, t: int) -> Any:
        if t == VType.STRING:
            return self.string()
        if t == VType.ARRAY:
            item, n = self.take("<I"), self.take("<Q")
            if item == VType.STRING:
                return [self.string() for _ in range(n)]
            if item not in _SCALAR:
                raise InputError(f"GGUF array of type {item} x {n} does not fit the header", file=str(self.path))
            if n * struct.calcsize(_SCALAR[VType(item)]) > len(self.raw) - self.pos:
                raise self._past(InputError(f"GGUF array of type {item} x {n} does not fit the header",
                                            file=str(self.path)))
            return list(self.many(f"<{n}{_SCALAR[VType(item)]}"))
        if t not in _SCALAR:
            raise InputError(f"unknown GGUF value type {t}", file=str(self.path))
        return self.take(f"<{_SCALAR[VType(t)]}")


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, TensorRef]]:
    """A GGUF file's metadata (key -> value) and its tensors as ``TensorRef`` (safetensors dtypes and torch
    order shapes; MXFP4 as ``U8`` blocks). Raises ``InputError`` naming the file for anything malformed."""
    size = os.path.getsize(path)
    limit = min(size, MAX_HEADER)
    raw = b""
    with open(path, "rb") as f:
        # the header is a few MB of a file of many GB: read it in growing pieces, not MAX_HEADER at once
        while True:
            got = f.read(min(limit, max(1 << 20, 8 * len(raw))) - len(raw))
            raw += got
            try:  # a piece that came back short or empty: the file ends there
                return _parse(raw, path, size, whole=len(raw) >= limit or not got)
            except _Short:
                continue


def _parse(raw: bytes, path: Path, size: int, whole: bool) -> tuple[dict[str, Any], dict[str, TensorRef]]:
    r = _Reader(raw, path, whole)
    if raw[:4] != MAGIC:
        raise InputError("not a GGUF file (no GGUF magic)", file=str(path))
    r.pos = 4
    version, n_tensors, n_kv = r.many("<IQQ")
    if version != VERSION:
        raise InputError(f"GGUF version {version}; this reader knows version {VERSION}", file=str(path))
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        nd = r.take("<I")
        if nd > 4:
            raise InputError(f"GGUF tensor with {nd} dims (GGML has at most 4)", file=str(path), tensor=name)
        dims = r.many(f"<{nd}Q")
        t, off = r.many("<IQ")
        infos.append((name, dims, t, off))
    align = int(meta.get("general.alignment", ALIGNMENT))
    start = r.pos + (-r.pos % align)
    tensors: dict[str, TensorRef] = {}
    for name, dims, t, off in infos:
        if t not in _DTYPE_OF:
            raise InputError(f"GGML type {t} is not one mxfp4conv writes", file=str(path), tensor=name)
        dtype = _DTYPE_OF[GgmlType(t)]
        shape = list(reversed(dims))
        if t in _BLOCKS:
            elements, block_bytes = _BLOCKS[GgmlType(t)]
            if shape[-1] % elements:
                raise InputError(f"{GgmlType(t).name} row of {shape[-1]} elements", file=str(path), tensor=name)
            shape[-1] = shape[-1] // elements * block_bytes
            nbytes = math.prod(shape)
        else:
            nbytes = math.prod(shape) * {"F32": 4, "F16": 2, "BF16": 2, "I32": 4}[dtype]
        begin = start + off
        if off % align or begin + nbytes > size:
            raise InputError(f"tensor data at offset {off} ({nbytes} bytes) lies outside the file or is unaligned",
                             file=str(path), tensor=name, hint="the file is truncated or corrupt")
        tensors[name] = TensorRef(path, name, dtype, tuple(shape), begin, begin + nbytes)
    return meta, tensors


def kv_dict(kvs: list[KV]) -> dict[str, Any]:
    """Metadata entries as the reader returns them (key -> value; a float32 rounded as stored)."""
    return {kv.key: _Reader(_value(kv.type, kv.value, kv.item), Path()).value(kv.type) for kv in kvs}


def open_gguf(folder: Path) -> Checkpoint:
    """A folder's GGUF output (one file, or the splits ``model-0000i-of-0000n.gguf``) as a checkpoint:
    its tensors by name, and the first file's metadata as its config (the ``split.*`` keys left out)."""
    from mxfp4conv.sources.checkpoint import Checkpoint

    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise InputError("no *.gguf files", file=str(folder), hint="point at the folder mxfp4conv convert --to gguf wrote")
    config: dict[str, Any] = {}
    tensors: dict[str, TensorRef] = {}
    for i, path in enumerate(files):
        meta, refs = read_gguf(path)
        if i == 0:
            config = {k: v for k, v in meta.items() if not k.startswith("split.")}
        for name, ref in refs.items():
            if name in tensors:
                raise InputError(f"tensor also stored in {tensors[name].file.name}", file=str(path), tensor=name)
            tensors[name] = ref
    return Checkpoint(root=folder, config=config, tensors=tensors, shard_files=files)
