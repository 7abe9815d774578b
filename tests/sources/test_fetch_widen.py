"""A run that reads whole units (a GPU) widens the fetch its source started before the device was known:
``HubSource.begin`` fetches ``fetch.BUDGET`` ahead, ``widen(unit)`` lets it go on to a unit's bytes before the
reads are planned and a unit ahead of them after (sources/source.py, sources/hub.py, sources/fetch.py).
The repo reads its ranges from local files (``CachedRepo``, the repo kind a huggingface_hub cache gives)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mxfp4conv.sources import fetch
from mxfp4conv.sources.hub import HubFile
from mxfp4conv.sources.hub_cache import CachedRepo
from mxfp4conv.sources.source import HubSource

MB = 1 << 20


def _source(folder: Path, sizes: dict[str, int]) -> tuple[HubSource, CachedRepo, Any]:
    files = {}
    for name, size in sizes.items():
        data = os.urandom(size)
        (folder / name).write_bytes(data)
        files[name] = HubFile(name, size, "0" * 40, hashlib.sha256(data).hexdigest())
    repo = CachedRepo("org/model", None, "1" * 40, files, folder=folder)
    ckpt = SimpleNamespace(shard_files=[repo.path(n) for n in sizes])
    return HubSource(repo), repo, ckpt


def _settled(repo: CachedRepo, want: int) -> int:
    deadline = time.monotonic() + 30
    while repo.fetched < want and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.2)
    return repo.fetched


def test_widen_lets_the_early_fetch_run_a_unit_across_files(tmp_path: Path) -> None:
    budget = fetch.BUDGET
    source, repo, ckpt = _source(tmp_path, {"a.safetensors": budget + 3 * MB, "b.safetensors": 2 * budget})
    source.begin(ckpt, None, every_file=True, prefetch=True)
    try:
        assert _settled(repo, budget) == budget  # no further than the budget before the plan
        unit = budget + 40 * MB
        source.widen(unit)
        got = _settled(repo, budget + 3 * MB + fetch.BLOCK)
        assert budget + 3 * MB < got <= unit  # past the end of the first file, within the unit
        source.widen(budget)  # never narrower than before
        assert _settled(repo, got) == got
    finally:
        source.end()


def test_widen_without_an_early_fetch_sets_the_streams_budget(tmp_path: Path) -> None:
    source, repo, ckpt = _source(tmp_path, {"a.safetensors": 4 * MB})
    source.begin(ckpt, None, every_file=True, prefetch=False)
    source.widen(fetch.BUDGET + 5 * MB)
    assert repo.fetched == 0 and source._ahead == fetch.BUDGET + 5 * MB
    source.end()
