"""Build a C source into a shared library once per user and load it (the CPU requant kernel, the hasher).

Below both ``files/hash_native.py`` and ``kernels/``: it imports nothing of the package. The compiler is ``$CC``, else
``cc`` / ``gcc`` / ``clang``; builds go into ``$MXFP4CONV_CACHE_DIR``, else
``$XDG_CACHE_HOME/mxfp4conv``, else ``~/.cache/mxfp4conv``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["build_shared_library", "cache_dir", "compiler"]


def cache_dir() -> Path:
    env = os.environ.get("MXFP4CONV_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mxfp4conv"


def compiler() -> str | None:
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
    requant kernel (kernels/requant_native.py) and the shard hasher (files/hash_native.py)."""
    cc = compiler()
    key = hashlib.sha256(source.read_bytes() + "\0".join(cflags).encode()).hexdigest()[:16]
    name = f"{stem}-{key}-{platform.system().lower()}-{platform.machine()}.so"
    dest = cache_dir() / name
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
