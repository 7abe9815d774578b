"""How the GPU path asks torch to pin host memory (mxfp4conv/device/pinned.py)."""

from __future__ import annotations

import pytest
import torch

from mxfp4conv.device import pinned


def test_register_threads_are_powers_of_two_up_to_16() -> None:
    got = {c: pinned.register_threads(c) for c in (None, 0, 1, 2, 3, 7, 8, 12, 16, 17, 128)}
    assert got == {None: 1, 0: 1, 1: 1, 2: 2, 3: 2, 7: 4, 8: 8, 12: 8, 16: 16, 17: 16, 128: 16}


def test_settings_leave_a_users_own_choice_alone() -> None:
    assert pinned.settings(16, {}) == "pinned_use_cuda_host_register:True,pinned_num_register_threads:16"
    assert pinned.settings(6, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == (
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:4")
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        assert pinned.settings(16, {var: "pinned_use_cuda_host_register:False"}) is None


def test_applied_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.setattr(pinned, "_done", False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(pinned.os, "cpu_count", lambda: 2)
    assert pinned.use_fast_pinning() is True
    assert pinned.use_fast_pinning() is False
    assert calls == ["pinned_use_cuda_host_register:True,pinned_num_register_threads:2"]


def test_a_torch_without_the_setting_is_left_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(conf: str) -> None:
        raise RuntimeError("Unrecognized key")

    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", refuse)
    monkeypatch.setattr(pinned, "_done", False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert pinned.use_fast_pinning() is False


def test_slabs_are_exact_and_come_back_once_every_view_is_gone() -> None:
    slabs = pinned.HostSlabs(keep=2)
    a = slabs.take(1000)
    assert a.dtype == torch.uint8 and a.numel() == 1000
    view = a[10:20].view(2, 5)  # a torch view outlives the tensor it was made from
    del a
    b = slabs.take(1000)  # the first is still lent through ``view``: a second allocation
    assert slabs.allocated == 2
    view.fill_(7)
    del view, b
    c = slabs.take(600)  # both came back: the smallest that holds 600 is reused, nothing allocated
    d = slabs.take(1000)
    assert slabs.allocated == 2 and c.numel() == 600 and d.numel() == 1000
    e = slabs.take(5000)  # none large enough
    assert slabs.allocated == 3
    del c, d, e
    assert len(slabs._free) == 2 and sorted(x.nbytes for x in slabs._free) == [1000, 5000]  # keep=2: the smallest went


def test_slab_bytes_are_the_lenders_until_returned() -> None:
    """A buffer written through one loan is not handed out again while any view of it is alive."""
    slabs = pinned.HostSlabs(keep=4)
    first = slabs.take(64)
    first.fill_(0xAB)
    keep = first.view(8, 8)[3]
    del first
    other = slabs.take(64)
    other.fill_(0x00)
    assert bool((keep == 0xAB).all())


def test_the_smallest_fitting_slab_is_taken_wherever_it_is_in_the_pool() -> None:
    slabs = pinned.HostSlabs(keep=4)
    held = [slabs.take(n) for n in (4000, 100, 3000, 2000)]
    del held
    got = slabs.take(2500)  # 3000 is neither first nor last of the free buffers
    assert slabs.allocated == 4 and got.numel() == 2500
    assert sorted(b.nbytes for b in slabs._free) == [100, 2000, 4000]


class _PlainPool(pinned.StagePool):
    """The pool's bookkeeping with plain host tensors (page-locked ones need CUDA)."""

    def _make(self, device: object) -> list[torch.Tensor]:
        return [torch.empty(self.nbytes, dtype=torch.uint8) for _ in range(self.count)]


def test_a_stage_pool_reuses_its_sets_and_waits_at_its_limit() -> None:
    import threading
    import time

    pool = _PlainPool(64, count=2, limit=1)
    with pool.take() as first:
        assert len(first) == 2 and all(t.numel() == 64 for t in first)
        got: list[list[torch.Tensor]] = []
        t = threading.Thread(target=lambda: got.append(pool.take().__enter__()))
        t.start()
        time.sleep(0.2)
        assert not got  # the one set is lent: the second taker waits
    t.join(timeout=5)
    assert got and got[0] is first  # the same set, given back and taken again
    unlimited = _PlainPool(8)
    with unlimited.take() as a, unlimited.take() as b:
        assert a is not b
    with unlimited.take() as c:
        assert c is a or c is b
    assert unlimited.free_sets == 2
    unlimited.clear(16)
    with unlimited.take() as d:
        assert d[0].numel() == 16
