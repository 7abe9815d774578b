"""torch's shared libraries loaded on a helper thread, without the GIL, before torch is imported.

Most of ``import torch`` on a GPU host is the dynamic loader's work on ``libtorch_cuda.so`` and
``libtorch_cpu.so``: relocations and static initializers (the operator registry). Python's import
machinery holds the GIL all the while, so no other Python work (SRC's planning) overlaps it.
``dlopen`` called through ctypes lets the GIL go: done ahead of the import, beside the planning,
torch's import later finds these libraries loaded and only runs its Python part.

The libraries are loaded as torch's own import loads them: ``libtorch_global_deps.so`` with
``RTLD_GLOBAL`` (torch's ``_load_global_deps``), the others as ``torch._C``'s dependencies are
(``RTLD_NOW``, local), so symbol resolution is unchanged. ``libtorch_python.so`` is left to the import:
its initializers belong to the interpreter. Best effort: anything missing or failing leaves the work
to the import, as before. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import sys
import threading
from pathlib import Path

__all__ = ["LIBRARIES", "libraries", "preload_torch"]

# in load order; each is loaded only if present (CUDA builds have libtorch_cuda, ROCm libtorch_hip)
LIBRARIES = ("libtorch_global_deps.so", "libtorch_cpu.so", "libtorch_cuda.so", "libtorch_hip.so", "libtorch.so")


def libraries() -> list[Path]:
    """torch's libraries that ``preload_torch`` loads, found without importing torch; [] when torch
    is not installed or is already imported."""
    if "torch" in sys.modules:
        return []
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return []
    if spec is None or spec.origin is None:
        return []
    lib = Path(spec.origin).parent / "lib"
    return [lib / name for name in LIBRARIES if (lib / name).is_file()]


def _load(paths: list[Path]) -> None:
    libc = ctypes.CDLL(None)
    dlopen = libc.dlopen  # a ctypes call: the GIL is released while the loader works
    dlopen.restype = ctypes.c_void_p
    dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
    for path in paths:
        flags = os.RTLD_NOW | (os.RTLD_GLOBAL if path.name == "libtorch_global_deps.so" else os.RTLD_LOCAL)
        if not dlopen(os.fsencode(path), flags):
            return  # a library the loader refuses is left to torch's import, which reports it


def preload_torch() -> threading.Thread | None:
    """Start loading torch's libraries on a daemon thread; None when there is nothing to load. The
    handles are never closed: torch's import takes the same libraries, which stay for the process's life."""
    paths = libraries()
    if not paths or not hasattr(os, "RTLD_NOW"):
        return None

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):  # no dlopen in this libc: the import does the work
            _load(paths)

    t = threading.Thread(target=run, name="mxfp4conv-torch-preload", daemon=True)
    t.start()
    return t
