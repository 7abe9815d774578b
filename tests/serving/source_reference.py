"""What vLLM must load from a ``--to quark`` output, made from the SOURCE by tests/oracle.py (no mxfp4conv code).

The serving tests compare every parameter vLLM's loader filled with a folder's tensors
(vllm_params.py). Compared with the output itself, that check cannot see a source misread by the
conversion: the output is wrong and vLLM loads it faithfully. Compared with this reference, it can,
on every host, forward pass or not.

``write_reference(src, dst)`` writes one safetensors file holding, for every FP4 Linear the oracle
reads in ``src``, the Quark MXFP4 pair under the source's module name: ``{module}.weight`` (E2M1
codes packed two per byte, element 2i in the low nibble) and ``{module}.weight_scale`` (E8M0
bytes). An MXFP4 source gives its own codes and scales (a lossless conversion); an NVFP4 source
gives ``oracle.requantize`` of its float32 values (the default MSE rule, modelled in float64). Every
other tensor of the source (BF16 attention, router, norms, embeddings) is copied byte for byte; the
FP4 modules' other tensors (global scales, activation scales) are not, as a W4A16 Quark output has
none.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.oracle import MX, read_tensors, requantize, source_fp4


def _pack(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _save(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file from (dtype, shape, bytes), written from the format's definition."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def write_reference(src: Path, dst: Path) -> dict[str, int]:
    """Write ``dst/reference.safetensors`` (see the module docstring); {"mxfp4", "requantized", "copied"} counts."""
    raw = read_tensors(src)
    fp4 = source_fp4(src)
    out: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    counts = {"mxfp4": 0, "requantized": 0, "copied": 0}
    for module, m in fp4.items():
        mx = m if isinstance(m, MX) else requantize(m.values)
        counts["mxfp4" if isinstance(m, MX) else "requantized"] += 1
        packed = _pack(mx.codes)
        out[f"{module}.weight"] = ("U8", packed.shape, packed.tobytes())
        out[f"{module}.weight_scale"] = ("U8", mx.exps.shape, np.ascontiguousarray(mx.exps, dtype=np.uint8).tobytes())
    owned = tuple(f"{module}." for module in fp4)
    for name, r in raw.items():
        if not name.startswith(owned):
            out[name] = (r.dtype, r.shape, r.data)
            counts["copied"] += 1
    dst.mkdir(parents=True, exist_ok=True)
    _save(dst / "reference.safetensors", out)
    return counts
