"""The compiled CPU requant kernel (``requant_native.c``), built on first use and loaded with ctypes.

``load()`` returns the kernel, or None when it cannot be built (no C compiler, a read-only cache that
holds no build, a compiler error); ``requant_rows_cpu`` then runs its torch path, which gives the same
bytes and statistics (tests compare both). ``MXFP4CONV_CPU_KERNEL`` chooses: ``auto`` (default: the
compiled kernel when it builds), ``native`` (it must build: failing to is an error), ``torch``.

The build runs the C compiler (``$CC``, else ``cc`` / ``gcc`` / ``clang``) with ``-O2 -funroll-loops
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
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

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


def _cache_dir() -> Path:
    env = os.environ.get("MXFP4CONV_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mxfp4conv"


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return cc
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def _build(cc: str, source: Path, cflags: tuple[str, ...], libs: tuple[str, ...], dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *cflags, str(source), "-o", tmp, *libs],
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        if proc.returncode != 0:
            raise OSError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_shared_library(
    source: Path, stem: str, cflags: tuple[str, ...], libs: tuple[str, ...] = ()
) -> tuple[ctypes.CDLL, Path]:
    """Build ``source`` (once per source and flags) into the per-user cache and load it: the file is
    named ``stem-<hash of source and flags>-<os>-<machine>.so``, written to a temporary name and
    renamed into place; an unwritable cache builds into a private temporary folder, a damaged cached
    build is built again once. Raises ``OSError`` (no C compiler, a failed build). Shared by the CPU
    requant kernel and the shard hasher (mxfp4conv/io/hash_native.py)."""
    cc = _compiler()
    key = hashlib.sha256(source.read_bytes() + "\0".join(cflags).encode()).hexdigest()[:16]
    name = f"{stem}-{key}-{platform.system().lower()}-{platform.machine()}.so"
    dest = _cache_dir() / name
    if not dest.exists():
        if cc is None:
            raise OSError("no C compiler found (set CC, or install cc / gcc / clang)")
        try:
            _build(cc, source, cflags, libs, dest)
        except OSError:
            if not os.access(dest.parent, os.W_OK) or not dest.parent.is_dir():
                # an unwritable cache (read-only home): build into a private temporary folder
                dest = Path(tempfile.mkdtemp(prefix="mxfp4conv-")) / name
                _build(cc, source, cflags, libs, dest)
            else:
                raise
    try:
        lib = ctypes.CDLL(str(dest))
    except OSError:  # a damaged cached build (e.g. a disk that filled up): build it again, once
        if cc is None:
            raise
        dest.unlink(missing_ok=True)
        _build(cc, source, cflags, libs, dest)
        lib = ctypes.CDLL(str(dest))
    return lib, dest


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
