"""The GGML MXFP4 re-layout in C (``ggml_native.c``), built on first use; the torch path where it cannot be.

``to_ggml_mxfp4`` / ``from_ggml_mxfp4`` give the bytes of ``mxfp4conv.formats.ggml`` (its definition; tests
compare both) about ten times faster: the torch path makes several passes and writes 17-byte blocks through
strided views, the C one reads and writes each byte once (SSE2 on x86-64). ctypes releases the GIL during
the call, so the conversion's worker threads re-lay out units in parallel. The build is the other native
kernels' (``mxfp4conv.files.cbuild``); ``MXFP4CONV_CPU_KERNEL=torch`` selects the torch path, as for requantization.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from mxfp4conv.files.cbuild import build_shared_library

if TYPE_CHECKING:
    import torch

__all__ = ["differs", "from_ggml_mxfp4", "native", "to_ggml_mxfp4"]

CFLAGS = ("-O2", "-std=c99", "-shared", "-fPIC")
_SOURCE = Path(__file__).with_name("ggml_native.c")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def native() -> ctypes.CDLL | None:
    """The built library, or None (no C compiler, a failed build, or ``MXFP4CONV_CPU_KERNEL=torch``)."""
    global _lib, _tried
    if os.environ.get("MXFP4CONV_CPU_KERNEL", "auto").strip().lower() == "torch":
        return None
    with _lock:
        if not _tried:
            _tried = True
            try:
                lib, _ = build_shared_library(_SOURCE, "ggml_native", CFLAGS)
            except OSError:
                return None
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            lib.mxfp4conv_ocp_to_ggml.argtypes = [p, i64, i64, p, i64, i64, p, i64, i64, i64]
            lib.mxfp4conv_ocp_to_ggml.restype = None
            lib.mxfp4conv_ggml_to_ocp.argtypes = [p, p, p, i64]
            lib.mxfp4conv_ggml_to_ocp.restype = None
            lib.mxfp4conv_ggml_differs.argtypes = [p, p, i64, i64, p, i64, i64, i64, i64, i64]
            lib.mxfp4conv_ggml_differs.restype = i64
            _lib = lib
    return _lib


def _rows(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(outer count, outer stride, inner count, inner stride) in bytes of a uint8 tensor whose rows are
    contiguous and whose rows lie on at most two strides (a row slice of a stack of matrices); None otherwise."""
    if t.stride(-1) != 1 or t.dim() > 3:
        return None
    if t.dim() == 1:
        return 1, 0, 1, 0
    if t.dim() == 2:
        return 1, 0, t.shape[0], t.stride(0)
    return t.shape[0], t.stride(0), t.shape[1], t.stride(1)


def to_ggml_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``formats.ggml.to_ggml_mxfp4``, in C when it is built and the tensors are on the CPU."""
    import torch

    from mxfp4conv.formats import ggml

    lib = native()
    pr, sr = _rows(packed), _rows(scales)
    if lib is None or packed.device.type != "cpu" or pr is None or sr is None or packed.dtype != torch.uint8 or (
            scales.dtype != torch.uint8):
        return ggml.to_ggml_mxfp4(packed, scales)
    nb = scales.shape[-1]
    if packed.shape[-1] != nb * 16 or packed.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"codes {list(packed.shape)} and scales {list(scales.shape)} are not one MXFP4 tensor")
    out = torch.empty((*packed.shape[:-1], nb * ggml.BLOCK_BYTES), dtype=torch.uint8)
    lib.mxfp4conv_ocp_to_ggml(packed.data_ptr(), pr[1], pr[3], scales.data_ptr(), sr[1], sr[3], out.data_ptr(),
                              pr[0], pr[2], nb)
    return out


def from_ggml_mxfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``formats.ggml.from_ggml_mxfp4``, in C when it is built and the tensor is contiguous on the CPU."""
    import torch

    from mxfp4conv.formats import ggml

    lib = native()
    if lib is None or blocks.device.type != "cpu" or not blocks.is_contiguous() or blocks.dtype != torch.uint8:
        return ggml.from_ggml_mxfp4(blocks)
    if blocks.shape[-1] % ggml.BLOCK_BYTES:
        raise ValueError(f"a row of {blocks.shape[-1]} bytes is not a whole number of {ggml.BLOCK_BYTES}-byte MXFP4 "
                         "blocks")
    nb = blocks.shape[-1] // ggml.BLOCK_BYTES
    lead = blocks.shape[:-1]
    packed = torch.empty((*lead, nb * 16), dtype=torch.uint8)
    scales = torch.empty((*lead, nb), dtype=torch.uint8)
    lib.mxfp4conv_ggml_to_ocp(blocks.data_ptr(), packed.data_ptr(), scales.data_ptr(), blocks.numel() // ggml.BLOCK_BYTES)
    return packed, scales


def differs(blocks: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> int | None:
    """The first row whose GGML blocks do not decode to ``packed`` / ``scales`` (the OCP form), or None: the
    decode of ``from_ggml_mxfp4`` and a comparison, in one pass without a buffer (torch's path: decoded, then
    compared)."""
    lib = native()
    pr, sr = _rows(packed), _rows(scales)
    nb = scales.shape[-1]
    if blocks.shape[:-1] != packed.shape[:-1] or blocks.shape[-1] != nb * 17 or packed.shape[-1] != nb * 16:
        return 0
    if lib is None or pr is None or sr is None or not blocks.is_contiguous() or blocks.device.type != "cpu" or (
            packed.device.type != "cpu"):
        got_p, got_s = from_ggml_mxfp4(blocks)
        rows = ((got_p != packed).any(-1) | (got_s != scales).any(-1)).reshape(-1).nonzero()
        return int(rows[0]) if len(rows) else None
    at = lib.mxfp4conv_ggml_differs(blocks.data_ptr(), packed.data_ptr(), pr[1], pr[3], scales.data_ptr(), sr[1],
                                    sr[3], pr[0], pr[2], nb)
    return None if at < 0 else int(at)
