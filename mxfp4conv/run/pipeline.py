"""``convert``: resolve -> detect -> validate -> plan -> (dry run) -> stream units -> verify -> publish.

No click, no rich, no print: progress goes through the ``on_progress(bytes_done, bytes_total)``
callback and the result is a ``ConvertReport``. The shards are written by a ``Conversion``
(``run/conversion.py``) from the plan ``job.prepare`` made (``plan/shards.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxfp4conv import __version__
from mxfp4conv.errors import OutputError, StagingError, UsageError
from mxfp4conv.plan.inspect import SCHEMA_VERSION
from mxfp4conv.plan.job import (  # re-exported: the options and helpers callers know from here
    GB,
    ConvertOptions,
    Job,
    cpu_kernel,
    devices,
    needs_device,
    prepare,
    resolve_device,
    whole_units,
)
from mxfp4conv.proof.check import InlineVerifier, check_structure
from mxfp4conv.proof.manifest import MANIFEST, Manifest
from mxfp4conv.run.atomic import check_destination, publish, remove_tree, staging_path
from mxfp4conv.run.card import CARD, build_card, card_facts, check_base_model
from mxfp4conv.run.conversion import Conversion, Progress, ShardDone, extra_files
from mxfp4conv.run.staging import PROGRESS_GLOB, json_bytes, prepare_staging, sha256_file
from mxfp4conv.sources.checkpoint import Checkpoint

__all__ = ["GB", "MANIFEST", "ConvertOptions", "ConvertReport", "Job", "Progress", "convert", "cpu_kernel", "devices",
           "prepare", "resolve_device"]


@dataclass
class ConvertReport:
    source: str
    destination: str
    layout: str
    target: str
    status: str  # "converted" | "dry-run" | "skipped"
    shards: list[dict[str, Any]] = field(default_factory=list)
    renamed: int = 0
    fused_layers: int = 0
    requantized: int = 0
    passthrough: int = 0
    bytes_written: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    verify: dict[str, Any] | None = None
    requant_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    # where NVFP4 -> MXFP4 ran: {"devices": [...], "cpu_kernel": "native" | "torch" | None}; None if
    # nothing is requantized
    compute: dict[str, Any] | None = None
    # units requantized by this run, per device (several GPUs share a conversion's units)
    requantized_on: dict[str, int] = field(default_factory=dict)
    # a Hub repo read by range (--stream): repo id, revision, commit, bytes fetched, each shard's sha256
    hub: dict[str, Any] | None = None
    # what a push after the conversion did (``publish.release.convert`` with a push); no --json key without one
    push: dict[str, Any] | None = None
    # not a field (no --json key): what a Ray task of the conversion reads (``Source.task_source``)
    task_source = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["push"] is None:
            del d["push"]
        d["schema_version"] = SCHEMA_VERSION
        return d


def source_fingerprint(ckpt: Checkpoint) -> dict[str, Any]:
    """Hashes identifying the source: full sha256 of JSON files, header sha256 + size of shards (the same
    for a Hub repo read remotely as for a local copy of it)."""
    return ckpt.source.fingerprint(ckpt)


def check_hasher() -> None:
    """Load the shard hasher now (``mxfp4conv/files/hash_native.py``), so that ``MXFP4CONV_HASHER=native``
    where it cannot be built (or a bad mode) fails before any output is written, as a ``UsageError``."""
    from mxfp4conv.files import hash_native

    try:
        hash_native.load()
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc), hint="unset MXFP4CONV_HASHER, or install a C compiler (cc / gcc / clang)") from exc


# The NVFP4 -> MXFP4 numerics contract (docs/NUMERICS.md) that requantized outputs are made under;
# part of their fingerprint, so `--skip-if-current`, `--resume` and `--finish` never take bytes or
# statistics of another contract for current. 2: the exact MSE decision, float32 block statistics and
# 8-lane row sums (docs/NUMERICS.md, "Contract version"); outputs of earlier builds carry no "numerics" key.
REQUANT_NUMERICS = 2


def convert(src: str | Path, dst: str | Path, opts: ConvertOptions, on_progress: Progress | None = None,
            on_fetch: Progress | None = None, on_shard: ShardDone | None = None) -> ConvertReport:
    """Convert SRC into DST (see module docstring). Raises ``ConvertError`` subclasses. ``on_fetch``:
    a Hub repo's shard bytes fetched so far and in all (``--stream``); ``on_shard``: each output shard
    once it is written, hashed and checked (``--push-to-hub`` uploads it then)."""
    t_start = time.perf_counter()
    check_base_model(opts.base_model)
    # a GPU named outright starts (torch's import, CUDA) beside the planning; ``auto`` only once
    # the plan shows a requant, so renames never import torch
    early = not opts.dry_run and (opts.device.startswith("cuda") or any(d.startswith("cuda") for d in opts.devices))
    if early:
        _start_device(opts)
    job = prepare(src, opts)
    if needs_device(job.ctx) and not early:
        _start_device(opts)
    try:
        return _convert(src, Path(dst), job, t_start, on_progress, on_fetch, on_shard)
    finally:
        job.ckpt.source.end()  # a fetch started early and not taken over (the run stopped before)


def _convert(src: str | Path, dst: Path, job: Job, t_start: float, on_progress: Progress | None,
             on_fetch: Progress | None = None, on_shard: ShardDone | None = None) -> ConvertReport:
    """``convert`` once SRC is planned: options resolved, then skip / dry run / write, prove, publish."""
    ctx, source = job.ctx, job.ckpt.source
    # a whole stream starts now, before the device is resolved (which waits for torch's import): its
    # first blocks come in while torch is imported and the run is set up (a partition or a resumed
    # run knows which files it reads only once its shards are planned)
    first = job.opts
    every_file = not (first.partition is not None or first.finish or first.resume)
    source.begin(job.ckpt, on_fetch, every_file=every_file, prefetch=every_file and not first.dry_run
                 and not (first.skip_if_current and (dst / MANIFEST).exists()))
    opts = dataclasses.replace(first, device=resolve_device(first.device, needs_device(ctx)))
    job = job.with_options(opts)
    if whole_units(opts):
        source.widen(job.output.largest_read())
    report = ConvertReport(str(src), str(dst), job.plan.layout, job.target.NAME,
                           "dry-run" if opts.dry_run else "converted")
    if needs_device(ctx):
        report.compute = {"devices": devices(opts), "cpu_kernel": cpu_kernel(opts.device, not opts.dry_run)}
    fingerprint = _fingerprint(job)
    if opts.skip_if_current and (dst / MANIFEST).exists() and _is_current(dst, fingerprint):
        report.status = "skipped"
        report.seconds["total"] = time.perf_counter() - t_start
        return report
    if not opts.dry_run:
        check_hasher()
    check_destination(source.folder, dst, overwrite=opts.overwrite or opts.skip_if_current)
    _fill_plan_report(report, job)
    report.hub, report.task_source = source.pinned(), source.task_source(src)
    if opts.dry_run:
        report.seconds["total"] = time.perf_counter() - t_start
        return report
    return _write(src, dst, job, report, fingerprint, t_start, on_progress, on_shard)


def _write(src: str | Path, dst: Path, job: Job, report: ConvertReport, fingerprint: dict[str, Any], t_start: float,
           on_progress: Progress | None, on_shard: ShardDone | None) -> ConvertReport:
    """Write, prove and publish a planned conversion (its partition's shards alone, with ``--partition``);
    the staging folder removed on failure unless a later run resumes it."""
    opts, source = job.opts, job.ckpt.source
    staging = staging_path(dst)
    finished, checked = prepare_staging(staging, fingerprint, opts)
    keep_staging = opts.resume or opts.partition is not None or opts.finish
    verifier = InlineVerifier(job.target, str(src), str(dst)) if opts.verify else None
    try:
        run = Conversion(job, staging, report, fingerprint, verifier, on_progress, on_shard)
        # a Hub repo's shards fetched once, in order, while the conversion reads them
        with source.streaming(run.fin.check_source, extra_files(job.ckpt)):
            outputs = run.write(finished, source.trusted(checked))
        report.hub = source.run_report(run.fin.checked)
        if opts.partition is not None:
            report.status = "partial"
            report.seconds["total"] = time.perf_counter() - t_start
            return report
        for p in staging.glob(PROGRESS_GLOB):
            p.unlink()
        outputs = _write_card(job, src, staging, outputs, report)
        if verifier is not None:
            t0 = time.perf_counter()
            report.verify = _prove(run, verifier, job, staging)
            report.seconds["verify"] = report.seconds.get("verify", 0.0) + time.perf_counter() - t0
        (staging / MANIFEST).write_bytes(json_bytes(_manifest(job, src, fingerprint, outputs, report)))
        publish(staging, dst)
    except OutputError:
        if opts.partition is None:  # e.g. a full disk: nothing worth resuming; other partitions' shards are kept
            remove_tree(staging)
        raise
    except OSError as exc:  # JSON files, copied extras, manifest, publish
        if opts.partition is None:
            remove_tree(staging)
        raise OutputError(f"cannot write the output: {exc.strerror or exc}", file=str(getattr(exc, "filename", None) or dst),
                          hint="free disk space or choose another destination") from exc
    except BaseException:
        if not keep_staging:
            remove_tree(staging)
        raise
    report.seconds["total"] = time.perf_counter() - t_start
    return report


def _fingerprint(job: Job) -> dict[str, Any]:
    """What makes an output current: the tool, the source's fingerprint, the options (and, where units are
    requantized, the numerics contract)."""
    fingerprint: dict[str, Any] = {"tool": __version__, "source": source_fingerprint(job.ckpt),
                                   "options": job.opts.fingerprint_dict()}
    if needs_device(job.ctx):
        fingerprint["numerics"] = REQUANT_NUMERICS  # outputs of another requant contract are not current
    return fingerprint


def _is_current(dst: Path, fingerprint: dict[str, Any]) -> bool:
    """DST's manifest records ``fingerprint`` (``--skip-if-current``)."""
    try:
        old = json.loads((dst / MANIFEST).read_text())
    except (OSError, ValueError):
        old = {}
    return bool(old.get("fingerprint") == fingerprint)


def _prove(run: Conversion, verifier: InlineVerifier, job: Job, staging: Path) -> dict[str, Any]:
    """The proof's report: inline as the shards were written, or, for shards of an earlier run (--resume,
    --finish), recorded (a source that is not read again) or proven again, in full."""
    if run.reused and not job.ckpt.source.READ_AGAIN:
        return _recorded_proof(run, verifier, job, staging)
    if run.reused:
        from mxfp4conv.proof.verify import verify_output

        return verify_output(job.ckpt.root, staging, job=job).to_dict()
    check_structure(verifier, job, staging)
    return verifier.report()


def _manifest(job: Job, src: str | Path, fingerprint: dict[str, Any], outputs: dict[str, str],
              report: ConvertReport) -> Manifest:
    source = job.ckpt.source
    return {
        "schema_version": SCHEMA_VERSION, "tool": "mxfp4conv", "version": __version__,
        "source": {"name": Path(str(src)).name, "repo_id": source.repo_id, "revision": source.commit,
                   "layout": job.plan.layout, "files": fingerprint["source"]},
        "target": job.target.NAME, "options": job.opts.fingerprint_dict() | {"device_independent": True},
        "fingerprint": fingerprint, "outputs": outputs, "requant_stats": report.requant_stats,
        "verified": bool(report.verify and report.verify.get("ok"))}


def _write_card(job: Job, src: str | Path, staging: Path, outputs: dict[str, str], report: ConvertReport
                ) -> dict[str, str]:
    """DST's own card into the staging folder (never the source's README.md): the outputs with it."""
    path = staging / CARD
    path.write_bytes(build_card(card_facts(job, src, report.requant_stats)).encode("utf-8"))
    return dict(sorted((outputs | {CARD: sha256_file(path)}).items()))


def _recorded_proof(run: Conversion, verifier: InlineVerifier, job: Job, staging: Path) -> dict[str, Any]:
    """The proof of a conversion from a remote source that took shards of earlier runs (--resume,
    --finish): the source is not read again; each such shard must have been proven unit by unit as it
    was written, from source files checked against the Hub's sha256 (``Conversion._reuse`` takes no
    other). Headers are checked here as always."""
    unproven = sorted(rel for rel, rec in run.fin.mine.items() if not rec.get("proven"))
    if unproven:
        raise StagingError(f"shard {unproven[0]} was written without its proof (--no-verify), and a remote "
                           "source is not read again to prove it", hint="convert it again without --no-verify "
                           "(its --partition i/n), or with --no-verify here")
    check_structure(verifier, job, staging)
    doc = verifier.report()
    doc.update(units=sum(len(s.units) for _, s in job.output.shards()),
               tensors=sum(len(s.tensors) for _, s in job.output.shards()), mode="inline, as each shard was written")
    return doc


def _start_device(opts: ConvertOptions) -> threading.Thread | None:
    """For a GPU conversion, import torch and start CUDA on a helper thread while SRC is planned and
    its first units are read (a fresh process spends seconds there); None when no GPU is asked for."""
    wanted = opts.device in ("cuda", "auto") or opts.device.startswith("cuda:") or any(d.startswith("cuda") for d in opts.devices)
    if not wanted or opts.dry_run:
        return None

    def start() -> None:
        from mxfp4conv.device.cuda_driver import start_driver

        start_driver(_ordinals(opts))  # CUDA's start needs no torch: beside its import, not after it
        with contextlib.suppress(Exception):
            import torch

            if torch.cuda.is_available():
                from mxfp4conv.device.pinned import use_fast_pinning

                use_fast_pinning()  # before the first pinned allocation
                torch.cuda.init()
                from mxfp4conv.kernels.requant_triton import _jit

                _jit()  # triton and the kernel module, imported before the first unit needs them

    t = threading.Thread(target=start, name="mxfp4conv-device-start", daemon=True)
    t.start()
    return t


def _ordinals(opts: ConvertOptions) -> list[int] | None:
    """The CUDA devices a conversion will use, by ordinal; None for every visible one."""
    names = list(opts.devices) or [opts.device]
    if any(not n.startswith("cuda:") for n in names):
        return None
    return [int(n[5:]) for n in names if n[5:].isdigit()]


def _fill_plan_report(report: ConvertReport, job: Job) -> None:
    """What the plan says the conversion writes (a dry run reports this alone)."""
    kinds = [u.kind for u in job.plan.units]
    report.fused_layers = kinds.count("moe")
    report.passthrough = kinds.count("passthrough")
    report.requantized = (kinds.count("moe") + kinds.count("dense")) if needs_device(job.ctx) else 0
    first = job.output.ranks[0]
    report.renamed = sum(len(u.outs) for s in first.shards for u in s.units if u.spec.kind != "passthrough")
    for _, s in job.output.shards():
        report.shards.append({"file": s.rel, "bytes": s.nbytes, "tensors": len(s.tensors), "units": len(s.units)})
