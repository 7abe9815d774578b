"""Header-only safetensors reading, lazy per-tensor loads, and a streaming shard writer.

One package, a module per concern: ``dtypes`` (dtype tables, JSON files), ``reader`` (``TensorRef``,
header parsing, reads), ``items`` (what a shard stream is fed and queues, its batches and budget),
``writer`` (``ShardStream``) and ``writer_threads`` (its write, hash and check threads, one unit of
behaviour that its tests exercise together). The names the rest of mxfp4conv uses are imported here.

A checkpoint is enumerated from the 8-byte length + JSON header of each shard; tensor data is read
only when ``TensorRef.load()`` is called, with ``os.pread`` on the exact byte range. Every header
is validated before use (size limits, JSON object without duplicate keys, known dtypes, offsets
inside the data area and not overlapping, byte length equal to shape x dtype size), so a hostile
file produces an ``InputError`` naming the file and tensor, never a crash or a huge allocation.
"""

from __future__ import annotations

from typing import Any

from mxfp4conv.files.safetensors import dtypes
from mxfp4conv.files.safetensors.dtypes import ITEMSIZE, MAX_JSON_BYTES, load_json, st_dtype, torch_dtype
from mxfp4conv.files.safetensors.items import BATCH_BYTES, CheckRange, FileSlice, InflightBudget, copy_runs
from mxfp4conv.files.safetensors.reader import (
    MAX_HEADER_BYTES,
    TensorRef,
    header_length,
    parse_header,
    read_full,
    read_header,
    read_many,
    read_parts,
    runs,
    tensor_view,
)
from mxfp4conv.files.safetensors.writer import SAFETENSORS, Container, ShardStream, stream_safetensors

__all__ = [  # and DTYPES, built lazily by the package __getattr__
    "BATCH_BYTES",
    "ITEMSIZE",
    "MAX_HEADER_BYTES",
    "MAX_JSON_BYTES",
    "SAFETENSORS",
    "CheckRange",
    "Container",
    "FileSlice",
    "InflightBudget",
    "ShardStream",
    "TensorRef",
    "copy_runs",
    "header_length",
    "load_json",
    "parse_header",
    "read_full",
    "read_header",
    "read_many",
    "read_parts",
    "runs",
    "st_dtype",
    "stream_safetensors",
    "tensor_view",
    "torch_dtype",
]


def __getattr__(name: str) -> Any:
    """``DTYPES`` (``dtypes.DTYPES``), built on first use so that importing this package does not import torch."""
    if name == "DTYPES":
        return dtypes.DTYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
