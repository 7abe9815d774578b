"""``convert --ray ADDRESS``: the work units of one conversion as Ray tasks on an existing cluster.

The only module importing ``ray`` (lazily: it is the optional extra ``mxfp4conv[ray]``). Built on the
scheduler-agnostic partition path of ``pipeline.convert``: the driver plans the shards locally, runs
``--partition i/N`` of the same conversion as N Ray tasks (one CPU, or one GPU with ``--device cuda``,
each), then ``--finish`` locally: verify and publish. Every node must see SRC and DST at the same paths
(a shared filesystem), or, with ``--stream``, DST and the Hub (each task streams its own shards'
source files at the commit the plan was made from); the output is byte-identical to a local run (shard bytes do not depend on the
device or on which process wrote them, and the manifest only records device-independent options).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mxfp4conv.errors import ConvertError, EnvironmentProblem, UsageError
from mxfp4conv.run.atomic import remove_tree, staging_path
from mxfp4conv.run.pipeline import ConvertOptions, ConvertReport, Progress, convert

__all__ = ["RayConvertReport", "convert_on_ray"]

_INSTALL_HINT = "pip install 'mxfp4conv[ray]' (on every node of the cluster)"
_CANCEL_WAIT_S = 30.0
_PROGRESS_TICK_S = 1.0


@dataclass
class RayConvertReport(ConvertReport):
    """A ``ConvertReport`` plus where the work ran: ``{"address", "tasks", "nodes", "resource"}``."""

    ray: dict[str, Any] = dataclasses.field(default_factory=dict)


def _run_partition(src: str, dst: str, opts: ConvertOptions) -> dict[str, Any]:
    """Body of one Ray task (runs in a worker process): one partition of the conversion."""
    import ray

    report = convert(src, dst, opts).to_dict()
    report["node_id"] = ray.get_runtime_context().get_node_id()
    return report


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise EnvironmentProblem("--ray needs the Ray package, which is not installed", hint=_INSTALL_HINT) from exc
    return ray


def _probe(address: str) -> None:
    """Fail fast on an unreachable HOST:PORT (ray.init retries a dead address for minutes)."""
    if address in ("auto", "local") or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"--ray {address!r} is not a Ray address", hint="use HOST:PORT of the head node, e.g. 10.0.0.1:6379")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as exc:
        raise EnvironmentProblem(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}",
                         hint="start it with `ray start --head` or check the head node's address and port") from exc


def _check_options(opts: ConvertOptions) -> None:
    clash = [flag for flag, on in (("--partition", opts.partition is not None), ("--finish", opts.finish),
                                   ("--dry-run", opts.dry_run), ("--devices", bool(opts.devices))) if on]
    if clash:
        raise UsageError(f"--ray cannot be combined with {', '.join(clash)}",
                         hint="--ray plans the partitions and the devices itself; drop those options")


def _task_error(exc: BaseException, part: tuple[int, int]) -> BaseException:
    """The task's own exception when there is one (same message and exit code as a local run)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, Exception):
        return cause
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return ConvertError(f"Ray task for partition {part[0]}/{part[1]} failed: {type(exc).__name__}: {first}",
                        hint="check the node's memory, disk and logs (`ray logs`), then rerun")


def convert_on_ray(src: str | Path, dst: str | Path, opts: ConvertOptions, address: str,
                   on_progress: Progress | None = None) -> RayConvertReport:
    """Convert SRC into DST with the shards written by Ray tasks on the cluster at ADDRESS.

    Without ``opts.resume`` the staging folder starts fresh and is removed on failure (as a local run);
    with it, finished shards of an earlier (local, partitioned or --ray) run are re-hashed and reused.
    """
    t_start = time.perf_counter()
    _check_options(opts)
    ray = _import_ray()
    from mxfp4conv.run.pipeline import resolve_device

    if opts.device == "auto":  # the driver's GPUs decide; an explicit device is the tasks' (their nodes have it)
        opts = dataclasses.replace(opts, device=resolve_device(opts.device))
    plan = convert(src, dst, dataclasses.replace(opts, dry_run=True))  # input and DST checks, shard list
    if plan.status == "skipped":
        return RayConvertReport(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(ConvertReport)})
    gpu = opts.device.startswith("cuda")
    owned = not ray.is_initialized()  # a library caller already connected keeps its connection
    if owned:
        _connect(ray, address)
    try:
        resource = "GPU" if gpu else "CPU"
        slots = int(ray.cluster_resources().get(resource, 0))
        if slots < 1:
            raise EnvironmentProblem(f"the Ray cluster at {address} has no {resource}s",
                             hint="use --device cpu" if gpu else "start the nodes with --num-cpus >= 1")
        n = max(1, min(len(plan.shards), slots))
        dst_abs = os.path.abspath(dst)
        staging = staging_path(Path(dst_abs))
        if not opts.resume:
            remove_tree(staging)  # a fresh run, as locally; the partitions then share this folder
        # DST exists only if --overwrite or --skip-if-current allowed it (checked by the plan above)
        overwrite = opts.overwrite or opts.skip_if_current
        task_opts = dataclasses.replace(opts, device="cuda" if gpu else opts.device, revision=None, resume=False,
                                        skip_if_current=False, overwrite=overwrite)
        t_tasks = time.perf_counter()
        refs = _submit(ray, n, gpu, plan.task_source, dst_abs, task_opts)
        sizes = [sum(int(sh["bytes"]) for sh in plan.shards[i::n]) for i in range(n)]
        shard_bytes = {str(sh["file"]): int(sh["bytes"]) for sh in plan.shards}
        results = _wait_all(ray, refs, n, sizes, on_progress, staging if not opts.resume else None,
                            (staging, shard_bytes))
        t_tasks = time.perf_counter() - t_tasks
        finish_device = opts.device if not gpu or torch.cuda.is_available() else "cpu"  # same bytes on any device
        try:
            report = convert(src, dst, dataclasses.replace(opts, finish=True, resume=False, skip_if_current=False,
                                                           overwrite=overwrite, device=finish_device))
        except BaseException:
            if not opts.resume:
                remove_tree(staging)
            raise
    finally:
        if owned:
            ray.shutdown()  # never leave the driver connected
    out = _merged(report, results)
    out.seconds["tasks"] = t_tasks
    out.seconds["total"] = time.perf_counter() - t_start
    out.ray = {"address": address, "tasks": n, "nodes": len({r.get("node_id") for r in results}),
               "resource": resource}
    return out


def _submit(ray: Any, n: int, gpu: bool, src: str, dst: str, opts: ConvertOptions) -> dict[Any, int]:
    """Start the ``n`` partitions' tasks: each task's ref, with its partition. ``src``: the source as a
    task reads it (a Hub repo at the commit the plan was made from, whatever the branch does meanwhile)."""
    task = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(_run_partition)
    return {task.options(name=f"mxfp4conv-partition-{i}of{n}")
            .remote(src, dst, dataclasses.replace(opts, partition=(i, n))): i for i in range(n)}


def _connect(ray: Any, address: str) -> None:
    """Connect the driver to the cluster at ``address``."""
    _probe(address)
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR, configure_logging=True)
    except Exception as exc:  # ConnectionError, ValueError (bad address), RuntimeError, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise EnvironmentProblem(f"cannot connect to the Ray cluster at {address}: {first}",
                                 hint="check the address (HOST:PORT of `ray start --head`) and that Ray versions "
                                      "match") from exc


def _merged(report: ConvertReport, results: list[dict[str, Any]]) -> RayConvertReport:
    """The finishing run's report, with the tasks' busy seconds (summed over tasks, not wall time)."""
    out = RayConvertReport(**{f.name: getattr(report, f.name) for f in dataclasses.fields(ConvertReport)})
    for key in ("read", "transform", "write", "hash"):
        out.seconds[key] = out.seconds.get(key, 0.0) + sum(r["seconds"].get(key, 0.0) for r in results)
    return out


def _finished_bytes(staging: Path, shard_bytes: dict[str, int]) -> int:
    """Bytes of the shards the partitions have recorded as finished so far (their progress files)."""
    done: set[str] = set()
    for p in staging.glob(".mxfp4conv-progress*.json"):
        try:
            done.update(json.loads(p.read_text()).get("shards", {}))
        except (OSError, ValueError):
            continue  # being replaced right now: read it at the next tick
    return sum(shard_bytes.get(name, 0) for name in done)


def _wait_all(ray: Any, refs: dict[Any, int], n: int, sizes: list[int], on_progress: Progress | None,
              staging: Path | None, watch: tuple[Path, dict[str, int]]) -> list[dict[str, Any]]:
    """Results of every task; on the first failure cancel the rest, clean up (if asked) and raise.
    Progress (bytes of finished shards across every worker) is read from the shared staging folder
    once a second, so the bar's rate and ETA cover the whole cluster."""
    pending = list(refs)
    results: list[dict[str, Any]] = []
    total, done = sum(sizes), 0
    if on_progress:
        on_progress(0, total)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=_PROGRESS_TICK_S)
            if ready:
                i = refs[ready[0]]
                try:
                    results.append(ray.get(ready[0]))
                except Exception as exc:
                    raise _task_error(exc, (i, n)) from None
            seen = _finished_bytes(*watch)
            if on_progress and seen > done:
                done = seen
                on_progress(done, total)
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)  # kills the worker: nothing writes into staging afterwards
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=_CANCEL_WAIT_S)
        if staging is not None:
            remove_tree(staging)
        raise
    return results
