"""How the GPU path asks torch to pin host memory (mxfp4conv/io/pinned.py)."""

from __future__ import annotations

import pytest
import torch

from mxfp4conv.io import pinned


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
