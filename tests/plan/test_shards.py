"""mxfp4conv/plan/shards.py: the conversion plan ``job.prepare`` makes once, and what everything else reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mxfp4conv.plan.job import ConvertOptions, prepare
from mxfp4conv.plan.shards import MIN_GROUPS, expert_groups
from mxfp4conv.run.conversion import arrival_order
from mxfp4conv.targets.base import TargetOptions
from tests.builders import build

PKG = Path(__file__).resolve().parents[2] / "mxfp4conv"


@pytest.fixture(scope="module")
def srcs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan")
    return {layout: build(layout, root / layout, shards=2) for layout in ("ct-mxfp4", "modelopt-nvfp4", "gpt-oss")}


@pytest.mark.parametrize(("layout", "target"), [("ct-mxfp4", "quark"), ("modelopt-nvfp4", "ct"), ("gpt-oss", "marlin")])
def test_every_unit_once_in_whole_shards_of_at_most_the_limit(srcs: dict[str, Path], layout: str, target: str) -> None:
    limit = 20_000
    job = prepare(srcs[layout], ConvertOptions(target=target, max_shard_size=limit))
    for rank in job.output.ranks:
        units = [u for s in rank.shards for u in s.units]
        assert [u.spec for u in units] == list(job.plan.units)  # plan order, each unit once
        for s in rank.shards:
            assert s.nbytes == sum(u.nbytes for u in s.units) == sum(t.nbytes for t in s.tensors)
            assert s.nbytes <= limit or len(s.units) == 1  # only a unit larger than the limit overflows
        n = len(rank.shards)
        assert [s.file for s in rank.shards] == (["model.safetensors"] if n == 1 else
                                                 [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        wmap = rank.weight_map()
        assert len(wmap) == sum(len(u.outs) for u in units)  # output names are unique within a rank
        assert {wmap[o.name] for s in rank.shards for o in s.tensors} == {s.file for s in rank.shards}
    assert job.output.total_bytes == sum(s.nbytes for _, s in job.output.shards())


def test_lossless_units_carry_their_source_ranges(srcs: dict[str, Path]) -> None:
    job = prepare(srcs["ct-mxfp4"], ConvertOptions(target="quark"))
    for _, shard in job.output.shards():
        for u in shard.units:
            assert u.direct is not None and u.read_bytes == 0
            assert [d.length for d in u.direct] == [o.nbytes for o in u.outs]
            assert all(job.ckpt.tensors[d.name].begin == d.begin for d in u.direct)


def test_decoded_units_carry_the_bytes_their_read_holds(srcs: dict[str, Path]) -> None:
    job = prepare(srcs["modelopt-nvfp4"], ConvertOptions(target="ct"))
    moe = [u for _, s in job.output.shards() for u in s.units if u.spec.kind == "moe"]
    assert moe
    for u in moe:
        assert u.direct is None
        assert u.read_bytes == sum(job.ckpt.tensors[n].nbytes for n in u.spec.sources)


def test_each_rank_has_its_own_context_and_folder(tmp_path: Path) -> None:
    src = build("gpt-oss", tmp_path / "g", hidden=128, inter=128, shards=1)  # I/tp a multiple of 32
    job = prepare(src, ConvertOptions(target="marlin", target_options=TargetOptions(tp_size=2)))
    assert [(r.rank, r.folder, r.ctx.target_options.tp_rank) for r in job.output.ranks] == [(0, "rank-0", 0),
                                                                                              (1, "rank-1", 1)]
    a, b = (r.shards[0].units for r in job.output.ranks)
    moe = next(i for i, u in enumerate(a) if u.spec.kind == "moe")
    assert a[moe].nbytes == b[moe].nbytes and [o.name for o in a[moe].outs] == [o.name for o in b[moe].outs]


def test_a_moe_unit_in_expert_groups_is_the_unit_in_consecutive_runs(tmp_path: Path) -> None:
    src = build("modelopt-nvfp4", tmp_path / "m", shards=1, hidden=128, inter=64, experts=12)
    job = prepare(src, ConvertOptions(target="ct"))
    rank = job.output.ranks[0]
    moe = [u for s in rank.shards for u in s.units if u.spec.kind == "moe"]
    assert moe
    for u in moe:
        groups = expert_groups(u, job.ckpt, job.layout, job.target, rank.ctx)
        assert len(groups) == 12 // -(-12 // MIN_GROUPS)  # at least MIN_GROUPS groups: two experts each
        assert [o for g in groups for o in g.outs] == list(u.outs)  # the unit's outputs, in order
        assert [e for g in groups for e in g.spec.experts] == list(range(12))
        assert sorted(n for g in groups for n in g.spec.sources) == sorted(u.spec.sources)
        assert sum(g.read_bytes for g in groups) == u.read_bytes and sum(g.nbytes for g in groups) == u.nbytes
        # at most ``most`` bytes read per group: one expert each here
        assert [g.spec.experts for g in expert_groups(u, job.ckpt, job.layout, job.target, rank.ctx,
                                                     most=u.read_bytes // 12)] == [range(e, e + 1) for e in range(12)]
        # cut where the next expert's last byte lies more than ``most`` from the group's: the file lists
        # experts 0, 1, 10, 11, 2, ..., 9, so 2 does not join 0-1 (10 and 11 lie between), nor 10 8-9
        per = u.read_bytes // 12
        assert [g.spec.experts for g in expert_groups(u, job.ckpt, job.layout, job.target, rank.ctx,
                                                     most=3 * per + per // 2, least=1)] == [
            range(0, 2), range(2, 5), range(5, 8), range(8, 10), range(10, 12)]
        # the groups, read and encoded on their own, are the unit's bytes
        whole = job.target.encode(job.layout.read(job.ckpt, u.spec), u.spec, rank.ctx)
        parts = [t for g in groups for t in job.target.encode(job.layout.read(job.ckpt, g.spec), g.spec, rank.ctx)]
        assert len(parts) == len(whole) and all(a.equal(b) for a, b in zip(parts, whole, strict=True))


@pytest.mark.parametrize(("layout", "target"), [("gpt-oss", "marlin"), ("ct-mxfp4", "quark"), ("modelopt-nvfp4", "marlin")])
def test_units_read_fused_copied_or_written_fused_are_made_whole(tmp_path: Path, layout: str, target: str) -> None:
    src = build(layout, tmp_path / layout, shards=1, hidden=128, inter=128, experts=12)  # Marlin's shape rule
    job = prepare(src, ConvertOptions(target=target))
    for rank, shard in job.output.shards():
        for u in shard.units:
            assert expert_groups(u, job.ckpt, job.layout, job.target, rank.ctx) == (u,)


def test_expert_groups_are_converted_in_the_order_their_bytes_arrive(tmp_path: Path) -> None:
    """safetensors files list tensors by name: expert 10 lies before expert 2. A unit's groups are
    converted as soon as their last byte is in (the output keeps the plan's order); other units, and
    the units themselves, stay in plan order."""
    src = build("modelopt-nvfp4", tmp_path / "m", shards=1, hidden=128, inter=64, experts=12)
    job = prepare(src, ConvertOptions(target="ct"))
    rank = job.output.ranks[0]
    made = [g for s in rank.shards for u in s.units for g in expert_groups(u, job.ckpt, job.layout, job.target, rank.ctx)]
    turns = arrival_order(made, job.ckpt)
    assert sorted(turns) == list(range(len(made)))
    firsts = [j for j, g in enumerate(made) if g.spec.first == 0]
    for a, b in zip(firsts, [*firsts[1:], len(made)], strict=True):
        got = turns[a:b]
        assert sorted(got) == list(range(a, b))  # a unit's groups among themselves
        if b - a > 1:
            assert [made[j].spec.first for j in got] == [0, 10, 2, 4, 6, 8]  # experts 0-1, 10-11, 2-3, ...


def test_only_the_plan_asks_a_target_for_its_outputs() -> None:
    """``out_specs`` is computed in one place: outside the targets, only plan/shards.py calls it."""
    calls = [f"{p.relative_to(PKG)}:{i + 1}" for p in sorted(PKG.rglob("*.py"))
             if p.parent.name != "targets" and p.relative_to(PKG).as_posix() != "plan/shards.py"
             for i, line in enumerate(p.read_text().splitlines()) if re.search(r"\.out_specs\(", line)]
    assert not calls, calls
