"""The shard hasher's sha256 over a file range in one GIL-free call (``hash_native.c``, built on first use).

The hasher thread of a shard used to ``pread`` and ``hashlib`` ``update`` chunk by chunk; each call
gives the GIL back and taking it back waits up to the switch interval (5 ms) while the producer thread
runs Python, which halved the hasher's speed beside a GPU conversion's readers and encoder.
``NativeSha256.hash_range`` loops pread + ``EVP_DigestUpdate`` over a whole range in C, in one ctypes
call (ctypes releases the GIL for the call), with the sha256 of the libcrypto that Python's own
``_hashlib`` links against: the digest is the one ``hashlib.sha256`` gives (checked once per process
on load, and by tests).

``sha256()`` returns a ``NativeSha256``, or a ``hashlib.sha256()`` when the native one cannot be had
(no C compiler, no libcrypto, a build error, a failed self-check). ``MXFP4CONV_HASHER`` chooses:
``auto`` (default: native when it loads), ``native`` (it must load: failing to is an error),
``hashlib``. The build is the CPU requant kernel's (``mxfp4conv.files.cbuild.build_shared_library``: ``$CC`` /
cc / gcc / clang, the per-user cache ``$MXFP4CONV_CACHE_DIR``, a file named by the hash of the source
and flags, written to a temporary name and renamed into place).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

__all__ = ["CHUNK", "NativeSha256", "build_error", "hasher_mode", "load", "sha256"]

CFLAGS = ("-O2", "-std=c99", "-shared", "-fPIC")
# Read size of the native loop: the GIL is not involved, so a chunk that stays in the L2 cache
# between the pread and the sha256 is as fast as any.
CHUNK = 1 << 20
_SOURCE = Path(__file__).with_name("hash_native.c")
_lock = threading.Lock()
_lib: _Native | None = None  # built, loaded and self-checked (once per process)
_error: str | None = None  # why it could not be


def hasher_mode() -> str:
    """``MXFP4CONV_HASHER``: auto | native | hashlib."""
    mode = os.environ.get("MXFP4CONV_HASHER", "auto").strip().lower() or "auto"
    if mode not in ("auto", "native", "hashlib"):
        raise ValueError(f"MXFP4CONV_HASHER={mode!r}: use auto, native or hashlib")
    return mode


def _libcrypto_path() -> str | None:
    """The libcrypto that ``_hashlib`` is linked against (as mapped into this process), else the
    system's; None when there is none (e.g. a Python with OpenSSL linked in statically and no system one)."""
    import _hashlib  # noqa: F401 - maps its libcrypto into the process

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)  # address perms offset device inode [path]
        path = parts[5].strip() if len(parts) == 6 else ""
        if os.path.basename(path).startswith("libcrypto") and os.path.exists(path):
            return path
    return ctypes.util.find_library("crypto")


class _Native:
    """The loaded helper and the libcrypto functions it uses."""

    def __init__(self, lib: ctypes.CDLL, crypto: ctypes.CDLL, path: Path, crypto_path: str) -> None:
        self.path, self.crypto_path = path, crypto_path
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn = lib.mxfp4conv_hash_range
        fn.argtypes = [ctypes.c_int, i64, i64, p, p, p, i64, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        fn.restype = i64
        self.hash_range = fn
        mapped = lib.mxfp4conv_hash_mapped
        mapped.argtypes = [ctypes.c_int, i64, i64, p, p, p, i64, ctypes.POINTER(ctypes.c_int)]
        mapped.restype = i64
        self.hash_mapped = mapped
        self.ctx_new = crypto.EVP_MD_CTX_new
        self.ctx_new.argtypes, self.ctx_new.restype = [], p
        self.ctx_free = crypto.EVP_MD_CTX_free
        self.ctx_free.argtypes, self.ctx_free.restype = [p], None
        self.md = crypto.EVP_sha256
        self.md.argtypes, self.md.restype = [], p
        self.init = crypto.EVP_DigestInit_ex
        self.init.argtypes, self.init.restype = [p, p, p], ctypes.c_int
        self.update = crypto.EVP_DigestUpdate
        self.update.argtypes, self.update.restype = [p, p, ctypes.c_size_t], ctypes.c_int
        self.final = crypto.EVP_DigestFinal_ex
        self.final.argtypes, self.final.restype = [p, p, ctypes.POINTER(ctypes.c_uint)], ctypes.c_int
        self.update_addr = ctypes.cast(self.update, ctypes.c_void_p).value


class NativeSha256:
    """A sha256 in an OpenSSL ``EVP_MD_CTX``, with ``update``/``hexdigest`` like hashlib's, and
    ``hash_range`` that reads and hashes a file range in one GIL-free call."""

    def __init__(self, native: _Native) -> None:
        self._n = native
        self._ctx = native.ctx_new()
        self._hex: str | None = None
        if not self._ctx:
            raise MemoryError("EVP_MD_CTX_new failed")
        if native.init(self._ctx, native.md(), None) != 1:
            self._free()
            raise OSError("EVP_DigestInit_ex(sha256) failed")

    def _free(self) -> None:
        if getattr(self, "_ctx", None):  # also after a failed __init__
            self._n.ctx_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        self._free()

    def _live(self) -> Any:
        if self._hex is not None:
            raise ValueError("update after hexdigest")
        return self._ctx

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if not len(view):
            return
        ctx = self._live()
        buf = (ctypes.c_char * len(view)).from_buffer_copy(view) if view.readonly else (
            ctypes.c_char * len(view)).from_buffer(view)
        if self._n.update(ctx, buf, len(view)) != 1:
            raise OSError("EVP_DigestUpdate failed")

    def hash_range(self, fd: int, pos: int, length: int, buf: ctypes.Array[ctypes.c_char],
                   check_ff: bool = False) -> tuple[int, int]:
        """Hash ``length`` bytes of ``fd`` from ``pos``, read through ``buf``: (bytes hashed, status),
        status 0 (done, or the file ended first: fewer bytes), an errno, -1 (``check_ff`` and a chunk
        holds 0xFF, not hashed), -2 (the sha256 update failed)."""
        ctx = self._live()
        status = ctypes.c_int(0)
        done = self._n.hash_range(fd, pos, length, ctx, self._n.update_addr, buf, len(buf), int(check_ff),
                                  ctypes.byref(status))
        return int(done), status.value

    def hash_mapped(self, fd: int, pos: int, length: int, buf: ctypes.Array[ctypes.c_char]) -> tuple[int, int]:
        """``hash_range`` of a file no one else writes (the shard being written), hashed in place through
        a read-only mapping of its pages: no copy into ``buf`` (the fallback where mmap fails)."""
        ctx = self._live()
        status = ctypes.c_int(0)
        done = self._n.hash_mapped(fd, pos, length, ctx, self._n.update_addr, buf, len(buf), ctypes.byref(status))
        return int(done), status.value

    def hexdigest(self) -> str:
        if self._hex is None:
            out = (ctypes.c_ubyte * 64)()
            size = ctypes.c_uint(0)
            if self._n.final(self._ctx, out, ctypes.byref(size)) != 1 or size.value != 32:
                raise OSError("EVP_DigestFinal_ex failed")
            self._hex = bytes(out[:32]).hex()
            self._free()
        return self._hex


def buffer(size: int = CHUNK) -> ctypes.Array[ctypes.c_char]:
    """A read buffer for ``NativeSha256.hash_range``."""
    return ctypes.create_string_buffer(size)


def _self_check(native: _Native) -> None:
    """Digests of ranges read in several chunks, with a short last one, and mapped, equal to hashlib's."""
    data = bytes(range(256)) * 41 + b"\xff\x01\x02"  # 10,499 bytes
    with tempfile.TemporaryFile() as fh:
        fh.write(data)
        fh.flush()
        buf = buffer(4096)
        for pos, length in ((0, len(data)), (7, 8200), (5, 0), (len(data) - 3, 3)):
            for how in ("hash_range", "hash_mapped"):
                h = NativeSha256(native)
                got = getattr(h, how)(fh.fileno(), pos, length, buf)
                if got != (length, 0) or h.hexdigest() != hashlib.sha256(data[pos:pos + length]).hexdigest():
                    raise OSError(f"the native sha256 self-check failed at ({pos}, {length}), {how}")


def _load_uncached() -> _Native:
    from mxfp4conv.files.cbuild import (
        build_shared_library,  # the same compiler and cache as the requant kernel
    )

    if not sys.platform.startswith("linux") and sys.platform != "darwin":
        raise OSError(f"no native hasher on {sys.platform}")
    crypto_path = _libcrypto_path()
    if crypto_path is None:
        raise OSError("no libcrypto found")
    crypto = ctypes.CDLL(crypto_path)
    lib, dest = build_shared_library(_SOURCE, "hash_native", CFLAGS)
    try:
        native = _Native(lib, crypto, dest, crypto_path)
    except AttributeError as exc:  # an OpenSSL without EVP_MD_CTX_new (< 1.1)
        raise OSError(f"{crypto_path}: {exc}") from exc
    _self_check(native)
    return native


def load() -> _Native | None:
    """The native helper (built once per process), or None; raises ``OSError`` when
    ``MXFP4CONV_HASHER`` is ``native`` and it cannot be had."""
    global _lib, _error
    mode = hasher_mode()
    if mode == "hashlib":
        return None
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _load_uncached()
            except (OSError, ImportError, subprocess.SubprocessError) as exc:
                _error = str(exc) or type(exc).__name__
        lib, err = _lib, _error
    if lib is None and mode == "native":
        raise OSError(f"MXFP4CONV_HASHER=native but the native hasher cannot be built: {err}")
    return lib


def sha256() -> NativeSha256 | Any:
    """A new sha256: ``NativeSha256`` per ``MXFP4CONV_HASHER``, else ``hashlib.sha256()``."""
    native = load()
    return NativeSha256(native) if native is not None else hashlib.sha256()


def build_error() -> str | None:
    """Why the native hasher could not be had in this process (None: loaded, or not tried yet)."""
    return _error
