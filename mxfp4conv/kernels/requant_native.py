"""The compiled CPU requant kernel (``requant_native.c``), built on first use and loaded with ctypes.

``load()`` returns the kernel, or None when it cannot be built (no C compiler, a read-only cache that
holds no build, a compiler error); ``requant_rows_cpu`` then runs its torch path, which gives the same
bytes and statistics (tests compare both). ``MXFP4CONV_CPU_KERNEL`` chooses: ``auto`` (default: the
compiled kernel when it builds), ``native`` (it must build: failing to is an error), ``torch``.

The build (``mxfp4conv.files.cbuild``) runs the C compiler (``$CC``, else ``cc`` / ``gcc`` / ``clang``) with ``-O2 -funroll-loops
-ffp-contract=off`` (no fused multiply-adds: every operation rounds as the contract says; no
``-march=native``, so a build in a shared home directory runs on every node; on x86-64 the row function
is built once per vector level and the CPU's is picked at load time) into a per-user cache
(``$MXFP4CONV_CACHE_DIR``, else ``$XDG_CACHE_HOME/mxfp4conv``, else ``~/.cache/mxfp4conv``), named by
the hash of the source and flags; a build is written to a temporary name and renamed into place, so
concurrent processes never load a half-written library. ctypes releases the GIL during the call, so
worker threads run slabs of rows in parallel.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from pathlib import Path

from mxfp4conv.files.cbuild import build_shared_library

__all__ = ["CFLAGS", "NativeKernel", "build_error", "kernel_mode", "load"]

CFLAGS = ("-O2", "-funroll-loops", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")
_SOURCE = Path(__file__).with_name("requant_native.c")
_RULE_IDS = {"floor": 0, "even": 1, "rceil": 2, "mse": 3}
_lock = threading.Lock()
_kernel: NativeKernel | None = None  # built and loaded (once per process)
_error: str | None = None  # why it could not be


class NativeKernel:
    """ctypes binding of ``mxfp4conv_requant_rows`` (see requant_native.c)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        fn = lib.mxfp4conv_requant_rows
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, p, p, p, i64, i64, i64, i32, i32, p, p, p]
        fn.restype = i32
        self._fn = fn

    def rows(self, packed: int, s: int, e4m3: int, g: int, r0: int, r1: int, kh: int, divisor: bool, rule: str,
             out: int, scales_out: int, row_stats: int) -> None:
        """Rows ``[r0, r1)`` of contiguous buffers given by address (``tensor.data_ptr()``):
        packed u8 ``[R, kh]``, block scales u8 ``[R, kh/8]`` (E4M3 bit patterns), ``e4m3`` f32 ``[256]``
        (each pattern's value), g f32 ``[R]`` -> out u8 ``[R, kh]``, scales_out u8 ``[R, kh/16]``,
        row_stats f64 ``[R, 5]``."""
        self._fn(packed, s, e4m3, g, r0, r1, kh, int(divisor), _RULE_IDS[rule], out, scales_out, row_stats)


def kernel_mode() -> str:
    """``MXFP4CONV_CPU_KERNEL``: auto | native | torch."""
    mode = os.environ.get("MXFP4CONV_CPU_KERNEL", "auto").strip().lower() or "auto"
    if mode not in ("auto", "native", "torch"):
        raise ValueError(f"MXFP4CONV_CPU_KERNEL={mode!r}: use auto, native or torch")
    return mode




def _load_uncached() -> NativeKernel:
    try:  # one build per x86-64 level, picked at load time; a toolchain without ifuncs builds one
        return NativeKernel(*build_shared_library(_SOURCE, "requant_native", (*CFLAGS, "-DMXFP4CONV_MULTIVERSION"), ("-lm",)))
    except OSError:
        return NativeKernel(*build_shared_library(_SOURCE, "requant_native", CFLAGS, ("-lm",)))


def load() -> NativeKernel | None:
    """The compiled kernel per ``MXFP4CONV_CPU_KERNEL`` (built once per process), or None for the
    torch path. Raises ``OSError`` when the mode is ``native`` and the kernel cannot be built."""
    global _kernel, _error
    mode = kernel_mode()
    if mode == "torch":
        return None
    with _lock:
        if _kernel is None and _error is None:
            try:
                _kernel = _load_uncached()
            except (OSError, subprocess.SubprocessError) as exc:
                _error = str(exc) or type(exc).__name__
        kern, err = _kernel, _error
    if kern is None and mode == "native":
        raise OSError(f"MXFP4CONV_CPU_KERNEL=native but the CPU kernel cannot be built: {err}")
    return kern


def build_error() -> str | None:
    """Why the kernel could not be built in this process (None: built, or not tried yet)."""
    return _error
