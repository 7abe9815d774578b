"""A Hub repo whose files are in huggingface_hub's cache: read there, checked as a stream is.

``convert org/model DST`` without ``--stream`` downloads the repo (``snapshot_download``) and then
reads the cached files through the same one in-order pass as a stream (``sources/fetch.py``): each file is
hashed as the conversion reads it and must match the sha256 the Hub lists for the pinned commit before
anything is published. huggingface_hub checks a download's size, not its digest, so a byte corrupted on
the wire (or a cached file changed since) is caught here, at no second read of the source.

Offline (``HF_HUB_OFFLINE=1``) the reference is the cache's own record: huggingface_hub stores each
LFS file under ``blobs/<sha256>`` (a small file under ``blobs/<git blob id>``), named from the Hub's
answer when it was downloaded, so a file whose bytes changed since is refused.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from mxfp4conv.errors import InputError
from mxfp4conv.files.source import preadv_full
from mxfp4conv.sources.hub import HubFile, RemoteRepo, offline, open_repo, retrying

__all__ = ["PICKLE_SUFFIXES", "SKIPPED", "CachedRepo", "cached_repo"]

# what a local copy of the repo holds: top-level files, no pickle weights (never unpickled)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SKIPPED = ["*/*", *(f"*{s}" for s in PICKLE_SUFFIXES)]
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_GIT_OID = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class CachedRepo(RemoteRepo):
    """A ``RemoteRepo`` whose ranges are read from the cached snapshot ``folder`` instead of the Hub;
    ``reference`` says whose sha256 the files are checked against ("hub" or "cache")."""

    folder: Path = field(default_factory=Path)
    reference: str = "hub"
    paced: ClassVar[bool] = False  # a local disk: whole units, several shards at once, as for a local folder
    read_from: ClassVar[str] = "cache"

    @property
    def checked_against(self) -> str:
        return self.reference

    @property
    def mismatch_hint(self) -> str:
        return (f"nothing was published and the cache is as it was; the cached copy is corrupted or changed since "
                f"its download: download it again with `hf download {self.repo_id} --revision {self.commit} "
                "--force-download`, or convert with --stream (no local copy)")

    def download(self, name: str) -> Path:
        path = self.folder / name
        if not path.is_file():
            raise InputError("is not in huggingface_hub's cache", file=str(self.path(name)),
                             hint=f"hf download {self.repo_id} --revision {self.commit}, or unset HF_HUB_OFFLINE")
        return self.checked_small(name, path)

    def read_range(self, name: str, begin: int, end: int) -> bytes | bytearray:
        if end <= begin:
            return b""
        buf = bytearray(end - begin)
        try:
            fd = os.open(self.folder / name, os.O_RDONLY)  # per range: 16 MiB each, no descriptor outlives a run
        except OSError as exc:
            raise InputError(f"cannot read the cached file: {exc.strerror}", file=str(self.path(name)),
                             hint=self.mismatch_hint) from exc
        try:
            got = preadv_full(fd, [memoryview(buf)], begin)
        finally:
            os.close(fd)
        with self._count:
            self.fetched += got
        if got != end - begin:
            raise InputError(f"the cached file ends at byte {begin + got}, {self.recorded_by} lists "
                             f"{self.files[name].size} bytes", file=str(self.path(name)), hint=self.mismatch_hint)
        return buf


def cached_repo(repo_id: str, revision: str | None) -> CachedRepo:
    """``repo_id`` at ``revision`` in huggingface_hub's cache, downloaded there first unless offline;
    online the file list (and each file's sha256) is the Hub's for the pinned commit."""
    if offline():
        folder = _snapshot(repo_id, revision)
        cached = CachedRepo(repo_id, revision, folder.name, _cache_records(folder), folder=folder, reference="cache")
        for name, info in cached.files.items():
            if name.endswith(".safetensors") and info.sha256 is None:  # nothing to check its bytes against
                raise InputError("huggingface_hub's cache holds no sha256 of this shard (it is not a link to "
                                 "blobs/<sha256>)", file=str(cached.path(name)),
                                 hint=f"hf download {repo_id} --force-download while online, or pass the folder "
                                      "itself as SRC to convert it unchecked")
        return cached
    folder = _snapshot(repo_id, revision)  # as huggingface_hub names it (a branch's ref too, for offline runs)
    repo = open_repo(repo_id, folder.name)  # the Hub's file list at the commit the snapshot holds
    cached = CachedRepo(repo_id, revision, repo.commit, repo.files, repo.token, folder=folder)
    for name in (n for n in repo.files if "/" not in n and n.endswith(".safetensors")):
        have = (folder / name).stat().st_size if (folder / name).is_file() else None
        if have is not None and have != repo.files[name].size:
            raise InputError(f"the cached file is {have} bytes, the Hub lists {repo.files[name].size}",
                             file=str(cached.path(name)), hint=cached.mismatch_hint)
    return cached


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = repo_id + (f"@{revision}" if revision else "")

    def get() -> Path:
        return Path(snapshot_download(repo_id=repo_id, revision=revision, ignore_patterns=SKIPPED))

    if not offline():
        return retrying(get, where)
    try:
        return get()
    except (LocalEntryNotFoundError, OSError, ValueError) as exc:  # offline, and the cache has no snapshot of it
        raise InputError("is not in huggingface_hub's cache (HF_HUB_OFFLINE=1)", file=where,
                         hint=f"hf download {repo_id} while online, or unset HF_HUB_OFFLINE") from exc


def _cache_records(folder: Path) -> dict[str, HubFile]:
    """The snapshot's files as the cache records them: each links to ``blobs/<id>``, the id the Hub gave
    when it was downloaded (an LFS file's sha256, else its git blob id)."""
    out = {}
    for p in sorted(folder.iterdir()):
        if not p.is_file():
            continue
        blob = Path(os.readlink(p)).name if p.is_symlink() else ""
        size = p.stat().st_size
        if _SHA256.match(blob):
            out[p.name] = HubFile(p.name, size, "", blob)
        else:
            out[p.name] = HubFile(p.name, size, blob if _GIT_OID.match(blob) else "", None)
    return out
