"""How page-locked (pinned) host memory is had for GPU transfers.

Two kinds. Small fixed buffers (the read stages of ``files/device_read``, the write stages of
``device/device_write``, the check's stage), lent by ``StagePool``s, come from torch's caching host allocator, told to pin with
``malloc`` + ``cudaHostRegister`` from several threads (``use_fast_pinning``): by default it pins
with ``cudaHostAlloc``, ~2 GB/s on an H200 host and no faster from several threads, against 5-7 GB/s
registered from 8-16 threads. Unit-sized results copied back from the GPU whole (targets that do not
encode on the device: ``Target.ENCODES_ON_DEVICE``) come from ``HostSlabs``: exact-size buffers
registered once and reused, since torch's allocator rounds every block up to a power of two (a 321
MB unit takes 512 MB) and keeps every block it ever pinned.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

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


class StagePool:
    """Sets of ``count`` page-locked buffers of ``nbytes`` each, made on first need and reused by every
    thread in turn. ``limit``: at most that many sets exist, and a taker waits for a free one (None:
    a taker never waits; as many sets exist as were ever in use at once). Sets are made per CUDA
    device (``device``: pinned under that device's context; None: the current one)."""

    def __init__(self, nbytes: int, count: int = 1, limit: int | None = None) -> None:
        self.nbytes, self.count, self.limit = nbytes, count, limit
        self._free: dict[Any, list[list[torch.Tensor]]] = {}
        self._made: dict[Any, int] = {}
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def take(self, device: Any = None) -> Iterator[list[torch.Tensor]]:
        """A set of buffers, given back when the block ends (whatever copies into them must be done by then)."""
        with self._cond:
            free = self._free.setdefault(device, [])
            while not free and self.limit is not None and self._made.get(device, 0) >= self.limit:
                self._cond.wait()
            got = free.pop() if free else None
            if got is None:
                self._made[device] = self._made.get(device, 0) + 1
        if got is None:
            got = self._make(device)
        try:
            yield got
        finally:
            with self._cond:
                self._free[device].append(got)
                self._cond.notify()

    def _make(self, device: Any) -> list[torch.Tensor]:
        import torch

        use_fast_pinning()  # before the first pinned allocation
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            return [torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(self.count)]

    def clear(self, nbytes: int | None = None) -> None:
        """Let go of every set (none may be lent); ``nbytes``: the size of the sets made from now on."""
        with self._cond:
            self._free.clear()
            self._made.clear()
            if nbytes is not None:
                self.nbytes = nbytes

    @property
    def free_sets(self) -> int:
        with self._cond:
            return sum(len(v) for v in self._free.values())


class HostSlabs:
    """Exact-size page-locked host buffers for results copied back from a GPU, reused: each is
    allocated and ``cudaHostRegister``ed once, lent as a uint8 tensor, and back in the pool the moment
    nothing refers to it any more (every view of it is gone: the writer has written its bytes). A
    request takes the smallest free buffer that holds it, else a new one; at most ``keep`` free
    buffers are kept (the pipeline has at most two units' results alive, so two are reused in turn).
    Where registering fails, the buffer is ordinary memory: slower copies, the same bytes."""

    def __init__(self, keep: int = 2) -> None:
        self._keep = keep
        self._free: list[Any] = []  # numpy arrays, each a whole registered allocation
        self._lock = threading.Lock()
        self.allocated = 0  # buffers ever allocated (a measure of reuse, for tests)

    def take(self, nbytes: int) -> torch.Tensor:
        import numpy as np
        import torch

        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            base = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes)) if fits else None
        if base is None:
            base = np.empty(max(1, nbytes), dtype=np.uint8)
            _register(base)
            self.allocated += 1
        lent = base[:nbytes]  # a view: the pool's allocation lives on in ``lent.base``
        weakref.finalize(lent, self._give_back, base)
        return torch.from_numpy(lent)  # the tensor's storage holds ``lent`` until its last view is gone

    def _give_back(self, base: Any) -> None:
        with self._lock:
            self._free.append(base)
            self._free.sort(key=lambda b: b.nbytes)
            drop = self._free[:-self._keep] if len(self._free) > self._keep else []
            del self._free[:len(drop)]
        for b in drop:
            _unregister(b)


def _register(arr: Any) -> None:
    import torch

    if torch.cuda.is_available():
        rt = torch.cuda.cudart()
        # 1 = cudaHostRegisterPortable: page-locked for every device's context (a multi-GPU run shares the pool)
        if rt.cudaHostRegister(arr.ctypes.data, arr.nbytes, 1):
            _clear_error(rt)  # a refusal (e.g. a memlock limit) leaves the buffer pageable


def _unregister(arr: Any) -> None:
    import torch

    if torch.cuda.is_available():
        rt = torch.cuda.cudart()
        if rt.cudaHostUnregister(arr.ctypes.data):  # never registered: nothing to undo
            _clear_error(rt)


def _clear_error(rt: Any) -> None:
    """Leave no CUDA error pending, so that torch's next kernel-launch check does not report it
    (torch's binding lacks ``cudaGetLastError`` in some releases: then the runtime's own, already loaded)."""
    fn = getattr(rt, "cudaGetLastError", None)
    if fn is None:
        with contextlib.suppress(OSError, AttributeError):
            fn = ctypes.CDLL(None).cudaGetLastError
    if fn is not None:
        fn()


_slabs: HostSlabs | None = None


def host_slabs() -> HostSlabs:
    """The process's pool of result buffers."""
    global _slabs
    with _lock:
        if _slabs is None:
            _slabs = HostSlabs()
        return _slabs
