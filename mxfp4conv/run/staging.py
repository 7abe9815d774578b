"""The staging folder of a conversion: finished shards recorded for ``--resume`` / ``--partition`` /
``--finish``, and the shards whose hash, checks and fsync finish while the next ones are produced."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from mxfp4conv.errors import StagingError
from mxfp4conv.files.safetensors import InflightBudget
from mxfp4conv.plan.job import ConvertOptions
from mxfp4conv.run.atomic import remove_tree

__all__ = ["PROGRESS_GLOB", "SHARD_WINDOW", "ShardFinisher", "json_bytes", "prepare_staging", "progress_file",
           "reuse", "sha256_file"]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


PROGRESS_GLOB = ".mxfp4conv-progress*.json"


def progress_file(staging: Path, opts: ConvertOptions) -> Path:
    if opts.partition is not None:
        return staging / f".mxfp4conv-progress-{opts.partition[0]}of{opts.partition[1]}.json"
    return staging / ".mxfp4conv-progress.json"


def prepare_staging(staging: Path, fingerprint: dict[str, Any], opts: ConvertOptions
                    ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The finished shards recorded in an existing staging folder (resume / partitions), else a fresh
    folder; and the remote source files recorded as checked against their publisher's sha256."""
    resuming = opts.resume or opts.partition is not None or opts.finish
    finished: dict[str, dict[str, Any]] = {}
    checked: dict[str, str] = {}
    if resuming and staging.is_dir():
        for p in sorted(staging.glob(PROGRESS_GLOB)):
            try:
                rec = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if rec.get("fingerprint") != fingerprint:
                if opts.partition is not None or opts.finish:
                    raise StagingError(f"staging folder {staging} belongs to a conversion with other inputs or options",
                                     hint="rerun every partition with the same SRC and options, or delete it")
                continue
            finished.update(rec.get("shards", {}))
            checked.update(rec.get("checked", {}))
        if not finished and opts.resume and opts.partition is None:  # partitions may run at once: never
            remove_tree(staging)  # delete a staging folder that another partition is writing into
    elif not resuming:
        remove_tree(staging)
    if opts.finish and not staging.is_dir():
        raise StagingError(f"nothing to finish: no staging folder {staging}",
                         hint="run the --partition i/n conversions first")
    staging.mkdir(parents=True, exist_ok=True)  # partitions starting together may race to create it
    return finished, checked


def reuse(path: Path, rec: dict[str, Any] | None) -> bool:
    """A finished shard is reused only if its bytes still hash to what was recorded."""
    return bool(rec) and path.is_file() and sha256_file(path) == rec["sha256"]  # type: ignore[index]


# Shards produced at once, their units interleaved so that they grow together (conversion.interleave).
# A shard's sha256 runs on one core (~1-1.3 GB/s on an H200 host), slower than that host's disk takes
# the output: one shard at a time, its hash fell behind and the last shard's finished seconds after
# the last byte was written. Four files hashed in parallel keep up with a disk of ~4 GB/s, and their hashers
# hold no queued memory (computed bytes are read back from the page cache once written). The shards
# of the previous window finish their hash and fsync while the next window is produced.
SHARD_WINDOW = 4


class ShardFinisher:
    """Shards whose last hashing and fsync run on helper threads while the next window is produced
    (``pending``), their queued bytes under one budget. A shard is recorded as finished
    (in the progress file that --resume reads) only once its digest is known; with a remote source,
    with the source files it was made from (``sources``), and each source file once it is checked
    against its publisher's sha256 (``checked``): a later run takes a shard only if all of its
    sources were checked."""

    def __init__(self, progress_path: Path, fingerprint: dict[str, Any], outputs: dict[str, str],
                 on_finished: Callable[[str, str], None] | None = None, *, proven: bool = False) -> None:
        self.progress_path = progress_path
        self.proven = proven  # each unit is proven as it is written (convert's inline check)
        self.on_finished = on_finished  # (shard, sha256) once recorded
        self.fingerprint = fingerprint
        self.outputs = outputs
        self.mine: dict[str, dict[str, Any]] = {}
        self.sources: dict[str, list[str]] = {}  # shard -> the remote source files its units read
        self.checked: dict[str, str] = {}  # remote source file -> its sha256, checked
        self.budget = InflightBudget()
        self.pending: list[tuple[str, Future[str], dict[str, Any]]] = []
        self._lock = threading.Lock()  # sources are checked on the fetch's threads

    def settle(self, keep: int = 0) -> None:
        """Wait for the oldest pending shards until at most ``keep`` remain."""
        while len(self.pending) > keep:
            rel, fut, stats = self.pending.pop(0)
            digest = fut.result()
            self.outputs[rel] = digest
            rec: dict[str, Any] = {"sha256": digest, "stats": stats, "proven": self.proven}
            if rel in self.sources:
                rec["sources"] = self.sources[rel]
            with self._lock:
                self.mine[rel] = rec
                self._record()
            if self.on_finished is not None:
                self.on_finished(rel, digest)

    def check_source(self, name: str, sha256: str) -> None:
        """A remote source file was read whole and matched its publisher's sha256."""
        with self._lock:
            self.checked[name] = sha256
            self._record()

    def _record(self) -> None:
        tmp = self.progress_path.with_suffix(".tmp")
        doc: dict[str, Any] = {"fingerprint": self.fingerprint, "shards": self.mine}
        if self.checked:
            doc["checked"] = dict(sorted(self.checked.items()))
        tmp.write_bytes(json_bytes(doc))
        os.replace(tmp, self.progress_path)

    def drain(self) -> None:
        for _, fut, _ in self.pending:
            with contextlib.suppress(BaseException):
                fut.result()
        self.pending.clear()
