"""``mxfp4conv.convert``: a release as ``mxfp4conv convert`` makes it, from Python.

The conversion runs here (``run/pipeline.convert``: the whole output, or one ``--partition``), or as
Ray tasks on a cluster (``ray``: ``publish/ray_runner.py``); with ``push`` the published DST is then
pushed to a Hugging Face repo in one commit (``publish/push.py``), its shards uploaded while the
conversion finishes them (a partition's shards uploaded, for ``--finish`` to commit). The CLI parses
its options into these arguments, calls ``convert`` and renders the report; nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mxfp4conv.publish.push import PushOptions, ShardUploader, current_output, partition_push, push_output
from mxfp4conv.run import pipeline
from mxfp4conv.run.conversion import ShardDone
from mxfp4conv.run.pipeline import ConvertOptions, ConvertReport, Progress

__all__ = ["PushOptions", "convert"]


def convert(src: str | Path, dst: str | Path, opts: ConvertOptions, on_progress: Progress | None = None,
            on_fetch: Progress | None = None, on_shard: ShardDone | None = None, *,
            push: PushOptions | None = None, ray: str | None = None,
            on_push: Progress | None = None) -> ConvertReport:
    """Convert SRC (a folder or a Hugging Face repo id) into DST, verified before it appears; on the
    Ray cluster at ``ray`` (HOST:PORT) when given (the report is then a ``RayConvertReport``: its
    ``ray`` says where the work ran); then, with ``push``, push DST to ``push.repo_id`` (the report's
    ``push``: the commit, or a partition's uploads). Raises the ``ConvertError`` family.

    With ``push``, a DST that already holds this conversion (its manifest matches this input and these
    options) is pushed as it is, not converted again: a push that failed, run again, resumes.

    Progress is in bytes, ``(done, total)``: ``on_progress`` the output's shards written, ``on_fetch``
    a Hub source's bytes fetched (``opts.stream``), ``on_push`` the shards uploaded; each is called
    with ``(-1, -1)`` once its part is over (the conversion's, failed or not; the push's, done).
    ``on_shard(path in DST, where it is now, sha256)``: each shard once it is written, hashed and
    checked. ``on_fetch`` and ``on_shard`` are called by a conversion run here, not on Ray.
    """
    if push is not None:
        push.check(opts)
    # a DST that already holds this conversion is pushed as it is (a push run again)
    report = current_output(src, dst, opts) if push is not None else None
    uploaded: ShardUploader | None = None
    if report is None and ray is not None:  # the units run on Ray's workers: this process only drives them
        report = _on_ray(src, dst, opts, ray, on_progress)
    elif report is None:
        report, uploaded = _here(src, dst, opts, push, on_progress, on_fetch, on_shard, on_push)
    if push is not None:
        report.push = _push(dst, opts, push, report, uploaded, on_push)
    return report


def _on_ray(src: str | Path, dst: str | Path, opts: ConvertOptions, address: str,
            on_progress: Progress | None) -> ConvertReport:
    from mxfp4conv.publish.ray_runner import convert_on_ray

    try:
        return convert_on_ray(src, dst, opts, address, on_progress=on_progress)
    finally:
        _done(on_progress)


def _here(src: str | Path, dst: str | Path, opts: ConvertOptions, push: PushOptions | None,
          on_progress: Progress | None, on_fetch: Progress | None, on_shard: ShardDone | None,
          on_push: Progress | None) -> tuple[ConvertReport, ShardUploader | None]:
    """The conversion run in this process, each shard going up to the Hub once it is finished."""
    uploader = ShardUploader(push, on_push).start() if push is not None and not opts.dry_run else None
    try:
        report = pipeline.convert(src, dst, opts, on_progress=on_progress, on_fetch=on_fetch,
                                  on_shard=_each(uploader.add if uploader is not None else None, on_shard))
    except BaseException:
        if uploader is not None:
            uploader.close()
        raise
    finally:
        _done(on_progress)
        _done(on_fetch)
    return report, uploader.finish() if uploader is not None else None


def _push(dst: str | Path, opts: ConvertOptions, push: PushOptions, report: ConvertReport,
          uploaded: ShardUploader | None, on_push: Progress | None) -> dict[str, Any]:
    """What the push did, as the report's ``push``: the commit, or what a partition uploaded (committed
    by the ``--finish`` run)."""
    if uploaded is not None and opts.partition is not None:
        doc = partition_push(push, uploaded)
    else:
        doc = push_output(dst, push, written_now=report.status == "converted", uploader=uploaded,
                          progress=on_push).to_dict()
    _done(on_push)
    return doc


def _each(*calls: ShardDone | None) -> ShardDone | None:
    """One ``on_shard`` that calls each of ``calls`` given, in order (None if none is)."""
    given = [c for c in calls if c is not None]
    if len(given) <= 1:
        return given[0] if given else None

    def each(rel: str, path: Path, sha256: str) -> None:
        for call in given:
            call(rel, path, sha256)

    return each


def _done(progress: Progress | None) -> None:
    if progress is not None:
        progress(-1, -1)
