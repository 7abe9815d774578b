"""The conversion plan: what a conversion writes, rank by rank, shard by shard, unit by unit.

Each unit carries its output tensors (names, dtypes, shapes, bytes), the source byte ranges that
become those tensors unchanged when the unit is a lossless rename, and the host bytes its read holds
otherwise. ``job.prepare`` makes the plan once, from headers alone; the writer, the inline proof,
``verify``, the dry run and the manifest read it and never ask the target again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from mxfp4conv.files.safetensors import FileSlice
from mxfp4conv.layouts.base import Layout, Plan
from mxfp4conv.layouts.split import expert_group
from mxfp4conv.model.canonical import UnitSpec
from mxfp4conv.sources.checkpoint import Checkpoint
from mxfp4conv.targets.base import OutTensor, Target, WriterContext

__all__ = ["GROUP_READ_BYTES", "MIN_GROUPS", "ConversionPlan", "PlannedShard", "PlannedUnit", "RankPlan",
           "direct_runs", "direct_slices", "expert_groups", "plan_conversion"]

# A MoE unit produced in expert groups reads at most this much per group, and is at least MIN_GROUPS
# groups (where it has that many experts)
GROUP_READ_BYTES = 32 << 20
MIN_GROUPS = 8


@dataclass(frozen=True)
class PlannedUnit:
    """One unit of one rank: its output tensors in write order and where their bytes come from."""

    spec: UnitSpec
    outs: tuple[OutTensor, ...]
    nbytes: int  # output bytes
    direct: tuple[FileSlice, ...] | None  # source ranges copied as they are (a lossless unit), else None
    read_bytes: int  # host bytes the unit's read holds (0 when its bytes are copied)

    @property
    def key(self) -> str:
        return self.spec.key


@dataclass(frozen=True)
class PlannedShard:
    """One output file: whole units in plan order."""

    folder: str  # "" or "rank-N"
    file: str
    units: tuple[PlannedUnit, ...]
    nbytes: int

    @property
    def rel(self) -> str:
        """The file's path in the output folder."""
        return f"{self.folder}/{self.file}" if self.folder else self.file

    @property
    def tensors(self) -> list[OutTensor]:
        return [o for u in self.units for o in u.outs]


@dataclass(frozen=True)
class RankPlan:
    """One tensor-parallel rank's output folder (the only one for runtime-native targets)."""

    rank: int
    folder: str
    ctx: WriterContext  # the writer context with this rank's options
    shards: tuple[PlannedShard, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def weight_map(self) -> dict[str, str]:
        """Output tensor -> shard file, as the index records it."""
        return {o.name: s.file for s in self.shards for u in s.units for o in u.outs}


@dataclass(frozen=True)
class ConversionPlan:
    ranks: tuple[RankPlan, ...]

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)

    def shards(self) -> Iterator[tuple[RankPlan, PlannedShard]]:
        """Every shard with its rank, in write order (the order ``--partition`` indexes them by)."""
        for r in self.ranks:
            for s in r.shards:
                yield r, s

    def largest_unit(self) -> int:
        """The output bytes of the largest unit of any rank."""
        return max((u.nbytes for _, s in self.shards() for u in s.units), default=0)

    def largest_read(self) -> int:
        """The host bytes the largest read of any unit holds (0 when every unit is copied)."""
        return max((u.read_bytes for _, s in self.shards() for u in s.units), default=0)


# (source dtype, output dtype) pairs of the same bytes: OCP packed E2M1 codes as MLX's uint32 words
_SAME_BYTES = {("U8", "U32")}


def direct_slices(spec: UnitSpec, outs: list[OutTensor], ckpt: Checkpoint, target: Target,
                  ctx: WriterContext) -> tuple[FileSlice, ...] | None:
    """Source byte ranges that become the unit's output tensors unchanged, in output order (several for
    an output stacked from them), or None (needs decoding)."""
    if ctx.facts.source_quant != "mxfp4" and spec.kind != "passthrough":
        return None
    parts = target.direct_parts(spec, ctx)
    if parts is None or len(parts) != len(outs):
        return None
    refs = []
    for names, o in zip(parts, outs, strict=True):
        mine = [ckpt.tensors[n] for n in names]
        if sum(r.nbytes for r in mine) != o.nbytes or any(
                r.dtype != o.dtype and (r.dtype, o.dtype) not in _SAME_BYTES for r in mine):
            return None
        refs += mine
    # E8M0 0xFF (NaN) is invalid input even when only copied: the writer's hasher, which reads every
    # copied byte anyway, checks these slices (no separate pass over the scales)
    return tuple(FileSlice(r.file, r.begin, r.nbytes, r.name,
                           e8m0=spec.kind != "passthrough" and r.dtype == "U8" and r.name.endswith(("weight_scale", "_scales")),
                           source=r.source)
                 for r in refs)


def direct_runs(outs: tuple[OutTensor, ...] | list[OutTensor], slices: tuple[FileSlice, ...] | list[FileSlice]
                ) -> list[tuple[OutTensor, tuple[FileSlice, ...]]]:
    """Each output tensor of a lossless unit with the source ranges that, one after the other, are its bytes."""
    if len(slices) == len(outs):
        return [(o, (s,)) for o, s in zip(outs, slices, strict=True)]
    runs, at = [], 0
    for o in outs:
        parts, size = [], 0
        while size < o.nbytes and at < len(slices):
            parts.append(slices[at])
            size += slices[at].length
            at += 1
        if size != o.nbytes:
            raise AssertionError(f"{o.name}: source ranges of {size} bytes, planned {o.nbytes}")
        runs.append((o, tuple(parts)))
    return runs


def _unit(spec: UnitSpec, ckpt: Checkpoint, target: Target, ctx: WriterContext) -> PlannedUnit:
    outs = target.out_specs(spec, ctx)
    direct = direct_slices(spec, outs, ckpt, target, ctx)
    read = 0 if direct is not None else sum(ckpt.tensors[n].nbytes for n in spec.sources if n in ckpt.tensors)
    return PlannedUnit(spec, tuple(outs), sum(o.nbytes for o in outs), direct, read)


def expert_groups(unit: PlannedUnit, ckpt: Checkpoint, layout: Layout, target: Target, ctx: WriterContext,
                  most: int = GROUP_READ_BYTES, least: int = MIN_GROUPS) -> tuple[PlannedUnit, ...]:
    """A decoded MoE unit as consecutive groups of its experts, units of their own whose outputs, one
    after the other, are the unit's. The unit alone where the layout reads it whole, the target does
    not write expert after expert, or it is one group.

    A group reads at most ``most`` bytes and holds at most 1/``least`` of the experts (one at the
    least). It is also cut where the next expert's last byte lies more than ``most`` bytes from the
    group's in the source shard, or in another shard: a file in safetensors' order lists experts by
    name (0, 1, 10, 100, ..., 2, 20, ...), and a group is converted once its last byte is in, so a
    group of experts whose bytes lie far apart would keep the early ones waiting, and leave the work
    of all of them for the end of the stream."""
    spec = unit.spec
    if (spec.kind != "moe" or unit.direct is not None or spec.extra.get("fused") or not layout.READS_EXPERT_GROUPS
            or not target.EXPERT_MAJOR or not spec.dims):
        return (unit,)
    step = -(-spec.dims[0] // least)
    order = {f: n for n, f in enumerate(ckpt.shard_files)}
    runs: list[list[int]] = []  # [first, stop, bytes, file, lowest last byte, highest last byte]
    for e in range(spec.first, spec.experts.stop):
        try:
            one = expert_group(spec, e, e + 1)
        except ValueError:  # a source shared by the layer's experts: read whole
            return (unit,)
        refs = [ckpt.tensors[name] for name in one.sources if name in ckpt.tensors]
        size = sum(r.nbytes for r in refs)
        file, last = max(((order.get(r.file, -1), r.end) for r in refs), default=(-1, 0))
        run = runs[-1] if runs else None
        if (run is not None and run[3] == file and e - run[0] < step and run[2] + size <= most
                and max(run[5], last) - min(run[4], last) <= most):
            run[1], run[2], run[4], run[5] = e + 1, run[2] + size, min(run[4], last), max(run[5], last)
        else:
            runs.append([e, e + 1, size, file, last, last])
    if len(runs) < 2:
        return (unit,)
    groups: list[PlannedUnit] = []
    at = 0
    for e0, e1, *_ in runs:
        sub = expert_group(spec, e0, e1)
        outs = tuple(target.out_specs(sub, ctx))
        if outs != unit.outs[at:at + len(outs)]:  # not a run of the unit's outputs: produced whole
            return (unit,)
        at += len(outs)
        read = sum(ckpt.tensors[name].nbytes for name in sub.sources if name in ckpt.tensors)
        groups.append(PlannedUnit(sub, outs, sum(o.nbytes for o in outs), None, read))
    whole = at == len(unit.outs) and sum(len(g.spec.sources) for g in groups) == len(spec.sources)
    return tuple(groups) if whole else (unit,)


def _shards(units: list[PlannedUnit], max_bytes: int, folder: str, target: Target) -> tuple[PlannedShard, ...]:
    """Whole units per shard, in plan order; a new shard starts when the next unit would overflow."""
    groups: list[list[PlannedUnit]] = []
    size = 0
    for u in units:
        if not groups or (groups[-1] and size + u.nbytes > max_bytes):
            groups.append([])
            size = 0
        groups[-1].append(u)
        size += u.nbytes
    names = target.shard_names(len(groups))
    return tuple(PlannedShard(folder, names[i], tuple(g), sum(u.nbytes for u in g)) for i, g in enumerate(groups))


def plan_conversion(plan: Plan, ckpt: Checkpoint, target: Target, ctx: WriterContext, max_bytes: int) -> ConversionPlan:
    """The conversion plan of ``plan``'s units for ``target``: every rank the target writes, its units
    split into shards of at most ``max_bytes`` (a unit larger than that gets a shard of its own)."""
    ranks = []
    for r in target.ranks(ctx):
        rctx = ctx.for_rank(r)
        folder = target.rank_folder(r, rctx)
        units = [_unit(spec, ckpt, target, rctx) for spec in plan.units]
        ranks.append(RankPlan(r, folder, rctx, _shards(units, max_bytes, folder, target)))
    return ConversionPlan(tuple(ranks))
