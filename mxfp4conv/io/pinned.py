"""How page-locked (pinned) host memory is allocated for GPU transfers.

The GPU path stages each unit's NVFP4 stacks and its MXFP4 outputs in pinned host memory, through
torch's caching host allocator: a warm process reuses the blocks, a fresh one (every CLI run) pins
them first, ~3 GB at 24 layers of a Qwen3-30B-like model. By default torch pins with
``cudaHostAlloc``, ~2 GB/s on the H200 host and no faster from several threads; torch can instead
``malloc`` and ``cudaHostRegister`` the pages from N threads, 5-7 GB/s there
(``benchmarks/probe_pinning.py``). A fresh 24-layer conversion spent 1.7 s pinning before and
0.6 s with 8 register threads (``benchmarks/probe_fresh_process.py``; BENCHMARKS.md, seventh session).
"""

from __future__ import annotations

import os
import threading
import warnings

_lock = threading.Lock()
_done = False

MAX_REGISTER_THREADS = 16  # torch allows powers of two up to 128; 16 measured best on a 16-core host


def register_threads(cpus: int | None) -> int:
    """Threads torch registers pinned pages with: the largest power of two <= min(16, cpus)."""
    n = max(1, min(MAX_REGISTER_THREADS, cpus or 1))
    return 1 << (n.bit_length() - 1)


def settings(cpus: int | None, env: dict[str, str]) -> str | None:
    """The torch allocator setting to apply, or None where the user's own setting decides (any
    ``pinned_use_cuda_host_register`` in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF)."""
    user = env.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + env.get("PYTORCH_ALLOC_CONF", "")
    if "pinned_use_cuda_host_register" in user:
        return None
    return f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{register_threads(cpus)}"


def use_fast_pinning() -> bool:
    """Make torch pin host memory with ``cudaHostRegister`` from several threads (once per process,
    before the first pinned allocation; the bytes pinned are the same, only faster to get). Returns
    whether the setting was applied; a torch without it, or a user's own setting, leaves torch as is."""
    global _done
    with _lock:
        if _done:
            return False
        _done = True
        conf = settings(os.cpu_count(), dict(os.environ))
        if conf is None:
            return False
        try:
            import torch

            with warnings.catch_warnings():  # torch >= 2.9 names a successor, the older name still works
                warnings.simplefilter("ignore", FutureWarning)
                torch.cuda.memory._set_allocator_settings(conf)
        except (AttributeError, RuntimeError):  # a torch that lacks the setting keeps cudaHostAlloc
            return False
        return True
