"""safetensors dtype strings: bytes per element, the torch dtypes (imported on first use), and the
JSON files read beside the shards (``load_json``: a size limit, no duplicate keys)."""

from __future__ import annotations

import json
import stat
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from mxfp4conv.errors import InputError

__all__ = [  # and DTYPES, built lazily by the module __getattr__
    "ITEMSIZE",
    "MAX_JSON_BYTES",
    "load_json",
    "no_duplicates",
    "st_dtype",
    "torch_dtype",
]

MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json, index, hf_quant_config.json

# safetensors dtype string -> bytes per element (torch is not needed to read headers or copy bytes)
ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8,
    "F16": 2, "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}
_TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}


@lru_cache(maxsize=1)
def _dtypes() -> dict[str, tuple[torch.dtype, int]]:
    import torch

    return {k: (getattr(torch, _TORCH_NAMES[k]), n) for k, n in ITEMSIZE.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string (imports torch)."""
    return _dtypes()[name][0]


def __getattr__(name: str) -> Any:
    """``DTYPES`` (safetensors dtype -> (torch dtype, bytes per element)), built on first use so that
    importing this module does not import torch."""
    if name == "DTYPES":
        return _dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype."""
    return {v[0]: k for k, v in _dtypes().items()}[dtype]


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # called for every JSON object of a header (~75K in a Qwen3-30B-A3B): C speed
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return out


def load_json(path: Path, *, what: str = "JSON file") -> dict[str, Any]:
    """Read a JSON object with a size limit and no duplicate keys."""
    try:
        st = path.stat()
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror}", file=str(path)) from exc
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} is not a regular file", file=str(path), hint="replace it with the real file")
    size = st.st_size
    if size > MAX_JSON_BYTES:
        raise InputError(f"{what} is {size} bytes, over the {MAX_JSON_BYTES} byte limit", file=str(path))
    try:
        data = json.loads(path.read_bytes(), object_pairs_hook=no_duplicates)
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror}", file=str(path)) from exc
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise InputError(f"{what} is not valid JSON ({exc})", file=str(path),
                         hint="restore the file from the original release") from exc
    if not isinstance(data, dict):
        raise InputError(f"{what} is not a JSON object", file=str(path))
    return data
