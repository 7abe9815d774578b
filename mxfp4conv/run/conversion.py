"""One conversion being written: every planned shard of ``job.output`` streamed into the staging folder.

``Conversion`` owns what the run accumulates: the report it fills, the progress, the finisher of the
shards whose hash and fsync are still running, and the stream of the last unit with computed
outputs. Shards are produced a window at a time (``windows``), their units interleaved
(``interleave``) so that the window's files grow, and are hashed, together. From a remote source, a
MoE unit converted on the CPU is produced in groups of its experts (``plan.expert_groups``), so that a layer is converted
while its bytes arrive and the run ends soon after the last one.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import torch

    from mxfp4conv.numerics.requant_stats import RequantStats
    from mxfp4conv.run.pipeline import ConvertReport

from mxfp4conv.errors import StagingError
from mxfp4conv.files.safetensors import BATCH_BYTES, CheckRange, FileSlice, ShardStream, st_dtype
from mxfp4conv.files.source import ByteSource
from mxfp4conv.numerics.units import UnitResult, unit_results
from mxfp4conv.plan.job import Job, devices, whole_units
from mxfp4conv.plan.shards import PlannedShard, PlannedUnit, RankPlan, direct_runs, expert_groups
from mxfp4conv.proof.check import InlineVerifier
from mxfp4conv.proof.manifest import MANIFEST
from mxfp4conv.run.atomic import remove_tree
from mxfp4conv.run.card import CARD
from mxfp4conv.run.staging import SHARD_WINDOW, ShardFinisher, json_bytes, progress_file, reuse, sha256_file
from mxfp4conv.sources.checkpoint import PICKLE_SUFFIXES, Checkpoint
from mxfp4conv.targets import WriterContext
from mxfp4conv.targets.base import Split

__all__ = ["Conversion", "Progress", "ShardDone", "arrival_order", "extra_files", "interleave", "windows"]

Progress = Callable[[int, int], None]
ShardDone = Callable[[str, Path, str], None]  # a shard finished: its path in DST, where it is now, its sha256
# files of SRC that the writer makes itself, never copies (the card is DST's own: run/card.py)
_SKIP_FILES = {"config.json", "model.safetensors.index.json", "hf_quant_config.json", MANIFEST, CARD}


def interleave(sizes: list[list[int]]) -> list[tuple[int, int]]:
    """The production order of shards written at once, as (shard, unit) pairs: each shard's units in
    their order, and next always the shard with the smallest share of its bytes produced (ties: the
    lower index), so that the shards grow together and finish together. ``sizes``: each shard's
    units' output bytes."""
    totals = [max(1, sum(s)) for s in sizes]
    heap = [(0.0, i) for i, s in enumerate(sizes) if s]
    heapq.heapify(heap)
    made = [0] * len(sizes)
    nxt = [0] * len(sizes)
    order: list[tuple[int, int]] = []
    while heap:
        _, i = heapq.heappop(heap)
        k = nxt[i]
        order.append((i, k))
        made[i] += sizes[i][k]
        nxt[i] += 1
        if nxt[i] < len(sizes[i]):
            heapq.heappush(heap, (made[i] / totals[i], i))
    return order


def _window_order(todo: list[tuple[PlannedShard, Path]]) -> list[tuple[int, int]]:
    return interleave([[u.nbytes for u in shard.units] for shard, _ in todo])


def windows(n: int, most: int) -> list[range]:
    """``n`` shards in consecutive groups of at most ``most``, as even as possible (7 by 4: 4 + 3), so
    that the last group also has several shards whose sha256s run in parallel."""
    if n <= 0:
        return []
    count = -(-n // most)
    base, extra = divmod(n, count)
    out: list[range] = []
    start = 0
    for g in range(count):
        size = base + (1 if g < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass
class _OpenShard:
    """A shard of the window being produced: its plan, where it is written, its stream, the requant
    statistics of its units and how many of its units are fed."""

    plan: PlannedShard
    path: Path
    stream: ShardStream
    stats: dict[str, Any] = field(default_factory=dict)
    fed: int = 0


# what a shard's stream is fed: a tensor, a source range, source ranges one after the other (a tensor
# stacked from several), a check
Fed: TypeAlias = "torch.Tensor | FileSlice | tuple[FileSlice, ...] | CheckRange"


@dataclass
class _Window:
    """Shards written at once: each with its path; what they are made of, in the order it is fed: (shard,
    unit or expert group, whether it ends a planned unit); and the order those are converted in
    (indices into ``made``), in which expert groups come as their bytes arrive."""

    todo: list[tuple[PlannedShard, Path]]
    made: list[tuple[int, PlannedUnit, bool]]
    turns: list[int]


def extra_files(ckpt: Checkpoint) -> list[str]:
    """SRC's other top-level files (tokenizer, generation config, ...) that the output carries as they
    are, and ``hf_quant_config.json`` where there is one (kept only where layers stay NVFP4)."""
    names = ckpt.source.top_files()
    return [n for n in names if n == "hf_quant_config.json" or not (
        n in _SKIP_FILES or n.endswith(".safetensors") or Path(n).suffix in PICKLE_SUFFIXES)]


def _copy_extras(ckpt: Checkpoint, dst: Path, drop_hqc: bool) -> list[str]:
    """SRC's other top-level files into ``dst``; a Hub repo's are downloaded (they are small), its
    weights never."""
    copied = []
    for name in extra_files(ckpt):
        if name == "hf_quant_config.json" and drop_hqc:
            continue
        ckpt.source.copy(name, dst / name)
        copied.append(name)
    return copied


def arrival_order(units: list[PlannedUnit], ckpt: Checkpoint) -> list[int]:
    """The order ``units`` (planned units and expert groups, in plan order) are converted in, as indices:
    the expert groups of a unit in the order their last source byte comes in a fetch of the shards in
    order (safetensors files list tensors by name: expert 10 lies before expert 2); the rest as planned."""
    files = {f: n for n, f in enumerate(ckpt.shard_files)}

    def arrives(j: int) -> tuple[int, int]:
        refs = [ckpt.tensors[n] for n in units[j].spec.sources if n in ckpt.tensors]
        return max(((files.get(r.file, -1), r.end) for r in refs), default=(-1, 0))

    turns: list[int] = []
    j = 0
    while j < len(units):
        k = j + 1
        while k < len(units) and units[k].spec.first > 0:  # the groups of one unit follow each other
            k += 1
        turns += sorted(range(j, k), key=arrives)
        j = k
    return turns


class Conversion:
    """The shards of ``job.output`` written into ``staging`` (this partition's, with ``--partition``),
    each proven by ``verifier`` as it is written when there is one; ``finished``: shards an earlier
    run recorded (``--resume``, ``--finish``), reused where their bytes still hash as recorded."""

    def __init__(self, job: Job, staging: Path, report: ConvertReport, fingerprint: dict[str, Any],
                 verifier: InlineVerifier | None, on_progress: Progress | None = None,
                 on_shard: ShardDone | None = None) -> None:
        self.job, self.staging, self.report = job, staging, report
        self.verifier, self.on_progress = verifier, on_progress
        self.outputs: dict[str, str] = {}  # sha256 per output file
        self.reused = False  # a finished shard of an earlier run was taken
        self.done = 0  # output bytes produced (or reused)
        self.on_shard = on_shard
        self.fin = ShardFinisher(progress_file(staging, job.opts), fingerprint, self.outputs,
                                 None if on_shard is None else lambda rel, sha: on_shard(rel, staging / rel, sha),
                                 proven=verifier is not None)
        # the stream and end of the last unit with computed outputs (see ``_feed``)
        self._last: tuple[ShardStream, int] | None = None
        self._fold: dict[str, RequantStats] = {}  # the requant statistics of the unit being fed, so far
        # what each planned unit is produced as (by id: the plan's units live as long as the run)
        self._parts = {id(u): self._produced(u, rank.ctx) for rank, shard in job.output.shards() for u in shard.units}
        if job.needs_device and devices(job.opts)[0].startswith("cuda"):
            # GPU outputs are produced far faster than the disk takes them: a unit's worth queued keeps
            # the writer busy; outputs written from the GPU (device/device_write) hold none of this budget
            self.fin.budget.limit = max(BATCH_BYTES, job.output.largest_unit())

    def write(self, finished: dict[str, dict[str, Any]], checked: dict[str, str] | None = None) -> dict[str, str]:
        """Write every shard this run owns and each rank's config, index and extras: the sha256 of
        every output file, sorted. ``checked``: remote source files an earlier run checked against
        their publisher's sha256 (a shard of such a run is taken only if all of its sources were)."""
        opts = self.job.opts
        self.fin.checked.update(checked or {})
        try:
            work = self._todo(finished)
            self._expect(work)
            for rank, out_dir, groups in work:
                for group in groups:
                    self._write_window(group, rank.ctx)
                    self.fin.settle(len(group.todo))  # the previous window's shards, whose hash and fsync overlapped this one
                self.fin.settle()
                if opts.partition is None:
                    self._finish_rank(rank, out_dir)
        except BaseException:
            self.fin.drain()  # never leave a writer running into a folder that is about to be removed
            raise
        for key, secs in self.fin.budget.seconds.items():
            self.report.seconds[key] = self.report.seconds.get(key, 0.0) + secs
        self.report.bytes_written = self.done
        return dict(sorted(self.outputs.items()))

    def _todo(self, finished: dict[str, dict[str, Any]]) -> list[tuple[RankPlan, Path, list[_Window]]]:
        """Per rank, its folder and the windows of shards this run writes (those of its partition that
        no earlier run finished), in the order they are written."""
        opts = self.job.opts
        # a remote source's shards are read at the link's rate, far below what one shard's hasher takes:
        # one shard at a time, so that the conversion reads one source shard at a time, in order
        most = 1 if self.job.ckpt.source.at_link_rate else SHARD_WINDOW
        work = []
        j = -1
        for rank in self.job.output.ranks:
            out_dir = self.staging / rank.folder if rank.folder else self.staging
            out_dir.mkdir(exist_ok=True)
            todo: list[tuple[PlannedShard, Path]] = []
            for shard in rank.shards:
                j += 1
                if opts.partition is not None and j % opts.partition[1] != opts.partition[0]:
                    continue
                if not self._reuse(shard, out_dir / shard.file, finished.get(shard.rel)):
                    todo.append((shard, out_dir / shard.file))
            work.append((rank, out_dir, [self._window([todo[g] for g in group]) for group in windows(len(todo), most)]))
        return work

    def _window(self, todo: list[tuple[PlannedShard, Path]]) -> _Window:
        made = [(i, g, g is groups[-1]) for i, k in _window_order(todo)
                for groups in (self._parts[id(todo[i][0].units[k])],) for g in groups]
        return _Window(todo, made, arrival_order([g for _, g, _ in made], self.job.ckpt))

    def _expect(self, work: list[tuple[RankPlan, Path, list[_Window]]]) -> None:
        """Tell each byte source the reads this run will make of it, in the order it makes them: a
        unit's source tensors once, a copied range once by the writer, once by the hasher and once by
        the proof."""
        copies = 3 if self.verifier is not None else 2
        ckpt = self.job.ckpt
        reads: dict[int, tuple[ByteSource, list[tuple[Path, int, int, int]]]] = {}

        def add(source: ByteSource, file: Path, begin: int, end: int, times: int) -> None:
            reads.setdefault(id(source), (source, []))[1].append((file, begin, end, times))

        for _, _, groups in work:
            for w in groups:
                for unit in (w.made[j][1] for j in w.turns):
                    if unit.direct is not None:
                        for s in unit.direct:
                            add(s.source, s.file, s.begin, s.begin + s.length, copies)
                        continue
                    for name in unit.spec.sources:
                        if (ref := ckpt.tensors.get(name)) is not None:
                            add(ref.source, ref.file, ref.begin, ref.end, 1)
        for source, planned in reads.values():
            source.expect(planned)

    def _produced(self, unit: PlannedUnit, ctx: WriterContext) -> tuple[PlannedUnit, ...]:
        """What a unit is produced as: its expert groups from a remote source on the CPU (a unit read from
        local disk is there whole at once; see ``whole_units`` for the devices), else the unit."""
        job = self.job
        if not job.ckpt.source.at_link_rate or whole_units(job.opts):
            return (unit,)
        return expert_groups(unit, job.ckpt, job.layout, job.target, ctx)

    def _reuse(self, shard: PlannedShard, path: Path, rec: dict[str, Any] | None) -> bool:
        """Take a shard an earlier run finished, if its bytes still hash as recorded (and, from a
        remote source, every source file it was made from was checked against the Hub's sha256)."""
        if reuse(path, rec) and self.job.ckpt.source.trusts(rec, self.fin.checked):
            assert rec is not None
            self.outputs[shard.rel] = rec["sha256"]
            self.report.requant_stats.update(rec.get("stats", {}))
            self.done += shard.nbytes
            self.fin.mine[shard.rel] = rec
            self.reused = True
            if self.on_shard is not None:
                self.on_shard(shard.rel, path, rec["sha256"])
            return True
        if self.job.opts.finish:
            if reuse(path, rec):  # its bytes are as recorded, but not all of its sources were checked
                raise StagingError(f"shard {shard.rel} was made from source files not checked against the Hub's "
                                   "sha256 (a run without --stream, or one stopped before reading them whole)",
                                   hint="rerun the --partition i/n conversion that owns it with --stream")
            raise StagingError(f"shard {shard.rel} is missing or damaged in the staging folder",
                               hint="rerun the --partition i/n conversion that owns it (shard index mod n)")
        return False

    def _sources(self, shard: PlannedShard) -> dict[str, list[str]]:
        """The source files the shard's units read, as its record keeps them (``Source.sources_of``)."""
        ckpt = self.job.ckpt
        files = {s.file for u in shard.units for s in (u.direct or ())}
        files |= {ckpt.tensors[n].file for u in shard.units if u.direct is None for n in u.spec.sources
                  if n in ckpt.tensors}
        return ckpt.source.sources_of(shard.rel, files)

    def _split(self, shard: PlannedShard) -> Split:
        """Which file of its rank's output ``shard`` is."""
        rank = next(r for r in self.job.output.ranks if r.folder == shard.folder)
        return Split(rank.shards.index(shard), len(rank.shards), sum(len(s.tensors) for s in rank.shards))

    def _finish_rank(self, rank: RankPlan, out_dir: Path) -> None:
        """The rank's index, config and the source's other files (a Hugging Face folder); every file's sha256."""
        job = self.job
        if job.target.HF_FOLDER:
            if len(rank.shards) > 1 or job.target.ALWAYS_INDEX:
                index = {"metadata": {"total_size": rank.nbytes}, "weight_map": dict(sorted(rank.weight_map().items()))}
                (out_dir / "model.safetensors.index.json").write_bytes(json_bytes(index))
            (out_dir / "config.json").write_bytes(json_bytes(job.target.config(job.ckpt.config, rank.ctx)))
            # hf_quant_config.json describes NVFP4 layers: kept only where they stay NVFP4 (--keep-nvfp4)
            keep_hqc = rank.ctx.target_options.keep_nvfp4 and "hf_quant_config.json" in job.layout.CONFIG_FILES
            _copy_extras(job.ckpt, out_dir, drop_hqc=not keep_hqc)
        for p in sorted(out_dir.iterdir()):
            rel = f"{rank.folder}/{p.name}" if rank.folder else p.name
            if p.is_file() and rel not in self.outputs and not p.name.startswith(".mxfp4conv-progress"):
                self.outputs[rel] = sha256_file(p)

    def _write_window(self, window: _Window, ctx: WriterContext) -> None:
        """Produce a window of shards at once, their units interleaved; each shard is handed to the
        finisher (hash, checks and fsync finishing on its threads) once its last unit is queued."""
        opened: list[_OpenShard] = []
        todo, made, turns = window.todo, window.made, window.turns
        try:
            for shard, path in todo:
                remove_tree(path)
                self.fin.sources.update(self._sources(shard))
                target = self.job.target
                stream = ShardStream(path, [(t.name, t.dtype, t.shape) for t in shard.tensors],
                                     target.shard_metadata(ctx, self._split(shard)), self.fin.budget, target.CONTAINER)
                opened.append(_OpenShard(shard, path, stream))
            at, count = [], [0] * len(todo)  # the index of each one's first tensor in its shard
            for i, unit, _ in made:
                at.append(count[i])
                count[i] += len(unit.outs)
            held: dict[int, UnitResult] = {}
            ahead: set[int] = set()  # converted before their turn, and written (and checked) already
            fed = 0
            for j, res in zip(turns, unit_results([made[j][1] for j in turns], self.job, ctx, self.verifier is not None),
                              strict=True):
                if j != fed and self._write_ahead(opened[made[j][0]], at[j], made[j][1], res, ctx, made[j][2]):
                    ahead.add(j)
                held[j] = res
                del res
                while fed in held:
                    i, unit, last = made[fed]
                    self._feed(opened[i], unit, held.pop(fed), ctx, last, fed in ahead)
                    fed += 1
            for sh in opened:
                if not sh.plan.units:  # a shard of no units (never planned today): header only
                    self.fin.pending.append((sh.plan.rel, sh.stream.finish(), sh.stats))
        except BaseException:
            finished = {rel for rel, _, _ in self.fin.pending}
            for sh in opened:
                if sh.plan.rel not in finished:
                    sh.stream.abort()
            raise

    def _write_ahead(self, sh: _OpenShard, index: int, unit: PlannedUnit, res: UnitResult, ctx: WriterContext,
                     last: bool) -> bool:
        """Write an expert group converted before its turn at its place in the shard now (from tensor
        ``index`` on) and queue its check, letting its outputs go; False (held until its turn) where
        its outputs are not all in host memory."""
        if not res.outs or not all(getattr(t, "device", None) is not None and t.device.type == "cpu" for t in res.outs):
            return False
        items, _ = self._items(unit, res, ctx, sh.path, last)  # the outputs, checked against the plan, and the check
        sh.stream.write_ahead(index, list(res.outs), items[-1] if isinstance(items[-1], CheckRange) else None)
        res.outs, res.want = [], None
        return True

    def _feed(self, sh: _OpenShard, unit: PlannedUnit, res: UnitResult, ctx: WriterContext, last: bool,
              written: bool = False) -> None:
        """Hand one unit's outputs (and its check) to its shard's stream; ``last``: the unit is a planned
        unit, or its last expert group (an expert group's statistics continue its predecessors');
        ``written``: an expert group converted before its turn, whose outputs are in the file and
        checked already. A unit's outputs may be views of one buffer (the GPU path's requant results),
        which lives until its last byte is written: so units are handed over whole, and a unit with
        computed outputs is fed only once the one before the previous is written."""
        report = self.report
        if unit.spec.first:
            self._fold = {k: self._fold[k].then(v) for k, v in res.requant.items()}
        else:
            self._fold = res.requant
        stats = {k: v.to_dict() for k, v in self._fold.items()}
        report.requant_stats.update(stats)
        sh.stats.update(stats)
        if res.device and last:
            report.requantized_on[res.device] = report.requantized_on.get(res.device, 0) + 1
        report.seconds["read"] = report.seconds.get("read", 0.0) + res.t_read
        report.seconds["transform"] = report.seconds.get("transform", 0.0) + res.t_transform
        if written:
            sh.stream.feed_written(len(unit.outs))
            items: list[Fed] = []
            nbytes, computed = unit.nbytes, False
        else:
            items, nbytes = self._items(unit, res, ctx, sh.path, last)
            computed = any(not isinstance(t, FileSlice) for t in res.outs)
        del res
        for item in items:
            sh.stream.feed(item)
        del items
        end = sh.stream.flush()
        if computed:
            # at most two units' computed outputs alive (in host memory, or on the GPU until written),
            # however many files are written at once: the previous one is written before the next is produced
            if self._last is not None:
                self._last[0].wait_written(self._last[1])
            self._last = (sh.stream, end)
        if last:
            sh.fed += 1
        if last and sh.fed == len(sh.plan.units):
            self.fin.pending.append((sh.plan.rel, sh.stream.finish(), sh.stats))
        self.done += nbytes
        if self.on_progress:
            self.on_progress(self.done, self.job.output.total_bytes)

    def _items(self, unit: PlannedUnit, res: UnitResult, ctx: WriterContext, path: Path, last: bool
               ) -> tuple[list[Fed], int]:
        """A unit's items for its shard's stream (its outputs, then, with a verifier, the check of their
        bytes, run once they are written) and its output bytes."""
        items: list[Fed] = []
        nbytes = 0
        stacked = unit.direct is not None and len(res.outs) != len(unit.outs)  # an output from several ranges
        if stacked:
            items = [parts for _, parts in direct_runs(unit.outs, res.outs)]
            nbytes = sum(s.length for s in res.outs)
        for o, t in zip(unit.outs, [] if stacked else res.outs, strict=not stacked):
            if isinstance(t, FileSlice):
                nbytes += t.length
                items.append(t)
                continue
            if st_dtype(t.dtype) != o.dtype or tuple(t.shape) != o.shape:
                raise AssertionError(f"{o.name}: encoded {st_dtype(t.dtype)}{list(t.shape)}, planned {o.dtype}{list(o.shape)}")
            nbytes += t.numel() * t.element_size()
            items.append(t)
        if self.verifier is not None:
            if res.want is None:
                items.append(self.verifier.copied(list(unit.outs), res.outs, path, nbytes))
            else:
                items.append(self.verifier.decoded(self.job.target.slice_for_rank(res.want, unit.spec, ctx), unit, ctx,
                                                   path, units=int(last)))
        return items, nbytes
