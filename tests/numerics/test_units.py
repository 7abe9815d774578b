"""The single-device read-ahead: which units are being read while one is transformed."""

from __future__ import annotations

import random
from pathlib import Path

from mxfp4conv.numerics.units import read_ahead as _read_ahead
from mxfp4conv.plan.job import ConvertOptions, prepare
from tests.builders import build


def test_the_next_moe_layer_is_read_while_this_one_is_transformed(tmp_path: Path) -> None:
    """ModelOpt NVFP4 -> ct: between two MoE layers sit pass-through units (norms, router, attention)
    whose bytes the writer copies from the source; they hold no memory, so once the first MoE layer
    is the current unit, the second one is already submitted (before, their bytes filled the budget
    and the next layer's read waited for the current layer's transform)."""
    src = build("modelopt-nvfp4", tmp_path / "src", shards=1)
    job = prepare(src, ConvertOptions(target="ct"))
    units = [u for _, shard in job.output.shards() for u in shard.units]
    sizes = [u.read_bytes for u in units]
    moe = [i for i, u in enumerate(units) if u.spec.kind == "moe"]
    assert len(moe) == 2 and moe[1] > moe[0] + 1  # pass-through units in between
    assert all(sizes[i] == 0 for i, u in enumerate(units) if u.spec.kind == "passthrough")
    assert all(sizes[i] > 0 for i in moe)
    upto = _read_ahead(sizes, max(sizes))
    assert upto[moe[0]] > moe[1]


def test_read_ahead_schedule_properties() -> None:
    """On random unit sizes: the next unit is always submitted, the bytes read ahead of the current
    unit stay within the limit (or are just the next unit), the schedule is greedy and never goes back."""
    rng = random.Random(5)
    for _ in range(3000):
        n = rng.randint(1, 30)
        sizes = [rng.choice([0, 0, rng.randint(1, 10), rng.randint(1, 1000)]) for _ in range(n)]
        limit = max(sizes)
        upto = _read_ahead(sizes, limit)
        assert upto == sorted(upto) and len(upto) == n
        for i, u in enumerate(upto):
            assert u >= min(i + 2, n)
            ahead = sum(sizes[i + 1:u])
            assert ahead <= limit or u == i + 2
            if u < n and u > i + 1:
                assert ahead + sizes[u] > limit  # greedy: the next one would not fit
