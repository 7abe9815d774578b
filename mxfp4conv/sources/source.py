"""What a conversion asks of its source, whatever kind it is: a ``Source``.

A local folder (``LocalSource``) and a Hub repo (``HubSource``: read by range, ``sources/hub.RemoteRepo``,
or from huggingface_hub's cache, ``sources/hub_cache.CachedRepo``) answer the same questions: the
fingerprint, the other files the output carries, the session of a run (a Hub repo's in-order fetch,
started early and taken over by the stream; nothing for a folder), which source files a shard of an
earlier run must have had checked before it is reused (``--resume``, ``--finish``), what the card, the
manifest, the ``--json`` report and a Ray task say of it. ``Checkpoint.source`` is the one place that
picks the kind; nothing outside this package asks which kind it has.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from mxfp4conv.errors import ConvertError
from mxfp4conv.sources.fetch import BUDGET

if TYPE_CHECKING:
    from mxfp4conv.sources.checkpoint import Checkpoint
    from mxfp4conv.sources.fetch import OrderedFetch
    from mxfp4conv.sources.hub import RemoteRepo

__all__ = ["HubSource", "LocalSource", "Source"]

# files whose full sha256 is part of the fingerprint (the source's card too: DST's card carries its
# metadata and text)
_FINGERPRINTED = ("config.json", "hf_quant_config.json", "model.safetensors.index.json", "README.md")
Count = Callable[[int], None]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


class Source(ABC):
    """A checkpoint's source: every difference between kinds of source, behind one set of questions."""

    # its shards' bytes can be read again to prove shards an earlier run wrote (--resume, --finish)
    READ_AGAIN: ClassVar[bool] = True
    label: str  # how outputs name it: the Hub repo id, else the folder's name
    repo_id: str | None = None  # the Hub repo it is (the card's base_model, the manifest)
    commit: str | None = None  # the commit it is read at
    folder: Path | None = None  # the local folder it is (DST may not lie inside it)

    @property
    def at_link_rate(self) -> bool:
        """Its bytes arrive at a link's rate, not a disk's: one shard a window, MoE layers in expert groups."""
        return False

    @abstractmethod
    def fingerprint(self, ckpt: Checkpoint) -> dict[str, Any]:
        """Full sha256 of the JSON files and the card, header sha256 + size of every shard (the same for a
        Hub repo as for a local copy of it)."""

    @abstractmethod
    def top_files(self) -> list[str]:
        """Its top-level files' names, sorted."""

    @abstractmethod
    def file(self, name: str) -> Path | None:
        """A small top-level file on local disk (a Hub repo's downloaded and checked), None without it."""

    @abstractmethod
    def copy(self, name: str, dest: Path) -> None:
        """Copy the top-level file ``name`` to ``dest``."""

    def own_file(self, name: str) -> Path | None:
        """A file of the folder itself (an earlier mxfp4conv conversion's record); a repo's are not read."""
        return None

    def command_arg(self) -> str:
        """SRC as the card's command names it."""
        return self.label

    def revision_words(self, revision: str | None) -> list[str]:
        return []

    def writer_facts(self) -> dict[str, Any]:
        """What a target that records where its output comes from is told (``WriterContext``)."""
        return {"source": self.label, "source_is_repo": self.repo_id is not None}

    def task_source(self, src: str | Path) -> str:
        """What a Ray task of the conversion reads."""
        return os.path.abspath(src)

    # a run's session: nothing for a local folder
    def begin(self, ckpt: Checkpoint, on_fetch: Callable[[int, int], None] | None, *, every_file: bool,
              prefetch: bool) -> None:
        """Set the run up; ``prefetch``: start reading every shard now (before the reads are planned)."""
        return None

    def widen(self, unit: int) -> None:
        """Units of up to ``unit`` bytes are read whole: let the reading run a unit ahead."""
        return None

    def end(self) -> None:
        """Stop what ``begin`` started and no stream took over."""
        return None

    @contextlib.contextmanager
    def streaming(self, on_checked: Callable[[str, str], None], extras: list[str]) -> Iterator[None]:
        """The conversion's reads run inside this block; ``extras``: the small files the output carries."""
        yield

    def trusted(self, checked: dict[str, str]) -> dict[str, str] | None:
        """Of the source files earlier runs recorded as checked, those this run takes as checked."""
        return None

    def trusts(self, rec: dict[str, Any] | None, checked: dict[str, str]) -> bool:
        """A shard an earlier run recorded (``rec``) may be reused as far as its sources go."""
        return True

    def sources_of(self, rel: str, files: Iterable[Path]) -> dict[str, list[str]]:
        """The source files the shard ``rel`` reads, as its record keeps them (nothing locally)."""
        return {}

    def pinned(self) -> dict[str, Any] | None:
        """The ``--json`` report's ``hub`` section of a planned conversion."""
        return None

    def run_report(self, checked: dict[str, str]) -> dict[str, Any] | None:
        """The ``--json`` report's ``hub`` section once the shards are written."""
        return self.pinned()

    def inspect_facts(self, ckpt: Checkpoint) -> dict[str, Any] | None:
        """``inspect``'s ``hub`` section."""
        return None


class LocalSource(Source):
    """A checkpoint folder."""

    def __init__(self, root: Path) -> None:
        self.root, self.folder, self.label = root, root, root.name

    def fingerprint(self, ckpt: Checkpoint) -> dict[str, Any]:
        out: dict[str, Any] = {n: {"sha256": _sha256_file(self.root / n)} for n in _FINGERPRINTED
                               if (self.root / n).exists()}
        for f in ckpt.shard_files:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                head = fh.read(n)
            out[ckpt.rel(f)] = {"size": f.stat().st_size, "header_sha256": hashlib.sha256(head).hexdigest()}
        return out

    def top_files(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_file())

    def file(self, name: str) -> Path | None:
        path = self.root / name
        return path if path.is_file() else None

    def copy(self, name: str, dest: Path) -> None:
        shutil.copyfile(self.root / name, dest)

    def own_file(self, name: str) -> Path | None:
        return self.file(name)

    def command_arg(self) -> str:
        return f"./{self.label}"


class HubSource(Source):
    """A Hub repo at one commit, read by range (``RemoteRepo``) or from huggingface_hub's cache
    (``CachedRepo``); its shards are read in one in-order fetch, each checked against the Hub's sha256."""

    READ_AGAIN = False  # a remote source is not read again: reused shards carry their inline proof

    def __init__(self, repo: RemoteRepo) -> None:
        self.repo = repo
        self.label = self.repo_id = repo.repo_id
        self.commit = repo.commit
        self._names: list[str] = []
        self._ahead = BUDGET  # bytes the fetch runs ahead of the reads
        self._count: Count | None = None
        self._every_file = True
        self._stream: OrderedFetch | None = None
        self._digests: dict[str, str] = {}

    @property
    def at_link_rate(self) -> bool:
        return self.repo.paced

    def fingerprint(self, ckpt: Checkpoint) -> dict[str, Any]:
        repo = self.repo
        out: dict[str, Any] = {n: {"sha256": _sha256_file(repo.download(n))} for n in _FINGERPRINTED if n in repo.files}
        for f in ckpt.shard_files:
            raw = repo.read_header_bytes(repo.name_of(f))
            n = int.from_bytes(raw[:8], "little")
            out[ckpt.rel(f)] = {"size": repo.size(f), "header_sha256": hashlib.sha256(raw[8:8 + n]).hexdigest()}
        return out

    def top_files(self) -> list[str]:
        return sorted(n for n in self.repo.files if "/" not in n)

    def file(self, name: str) -> Path | None:
        return Path(self.repo.download(name)) if name in self.repo.files else None

    def copy(self, name: str, dest: Path) -> None:
        shutil.copyfile(self.repo.download(name), dest)

    def revision_words(self, revision: str | None) -> list[str]:
        return ["--revision", revision] if revision else []

    def task_source(self, src: str | Path) -> str:
        # every task reads the commit the plan was made from, whatever the branch does meanwhile
        return f"{self.repo_id}@{self.commit}"

    def begin(self, ckpt: Checkpoint, on_fetch: Callable[[int, int], None] | None, *, every_file: bool,
              prefetch: bool) -> None:
        repo = self.repo
        self._names = [repo.name_of(f) for f in ckpt.shard_files]
        self._count = _fetch_counter(sum(repo.files[n].size for n in self._names), on_fetch)
        self._every_file, self._stream, self._digests = every_file, None, {}
        self._ahead = BUDGET
        if prefetch:
            repo.prefetch(self._names, self._count)

    def widen(self, unit: int) -> None:
        # the next unit fetched while one is converted (and a unit's worth before the reads are planned)
        if unit > self._ahead:
            self._ahead = unit
            self.repo.widen_prefetch(self._names, upto=unit, budget=unit)

    def end(self) -> None:
        self.repo.end_prefetch()

    @contextlib.contextmanager
    def streaming(self, on_checked: Callable[[str, str], None], extras: list[str]) -> Iterator[None]:
        # the small files the output carries, fetched beside the shards rather than after them
        threading.Thread(target=self._download, args=(extras,), name="mxfp4conv-extras", daemon=True).start()
        # a partition or a resumed run fetches only the files its shards read (each whole, to check it)
        with self.repo.streaming(self._names, self._count, budget=self._ahead, on_checked=on_checked,
                                 every_file=self._every_file) as stream:
            self._stream = stream
            yield
            # every shard's bytes against the Hub's sha256 before anything is published
            self._digests = stream.finish()

    def _download(self, names: list[str]) -> None:
        """Bring ``names`` into huggingface_hub's cache now; a failure is met again, and said, where the
        output's copy of the file downloads it."""
        for name in names:
            with contextlib.suppress(ConvertError):
                self.repo.download(name)

    def trusted(self, checked: dict[str, str]) -> dict[str, str] | None:
        return checked

    def trusts(self, rec: dict[str, Any] | None, checked: dict[str, str]) -> bool:
        # every source file the shard was made from checked against the Hub's sha256
        if rec is None:
            return True
        names, files = rec.get("sources"), self.repo.files
        return isinstance(names, list) and all(
            isinstance(n, str) and n in files and checked.get(n) == files[n].sha256 for n in names)

    def sources_of(self, rel: str, files: Iterable[Path]) -> dict[str, list[str]]:
        return {rel: sorted(self.repo.name_of(f) for f in files)}

    def pinned(self) -> dict[str, Any] | None:
        # the commit the plan is made from (--ray pins its tasks to it)
        return {"repo_id": self.repo_id, "revision": self.repo.revision, "commit": self.commit}

    def run_report(self, checked: dict[str, str]) -> dict[str, Any] | None:
        repo, stream = self.repo, self._stream
        assert stream is not None
        # this run's checks, and those of earlier runs whose shards it took
        shown = {n: d for n, d in checked.items() if n in self._names} | self._digests
        return {"repo_id": repo.repo_id, "revision": repo.revision, "commit": repo.commit,
                "read_from": repo.read_from, "checked_against": repo.checked_against,
                "bytes_fetched": repo.fetched, "bytes_fetched_again": stream.refetched,
                "bytes_held_peak": stream.peak, "files": dict(sorted(shown.items()))}

    def inspect_facts(self, ckpt: Checkpoint) -> dict[str, Any] | None:
        repo = self.repo
        return {"repo_id": repo.repo_id, "revision": repo.revision, "commit": repo.commit,
                "read_from": repo.read_from, "header_bytes_fetched": repo.fetched,
                "files": {ckpt.rel(f): {"size": repo.files[ckpt.rel(f)].size, "sha256": repo.files[ckpt.rel(f)].sha256}
                          for f in ckpt.shard_files}}


def _fetch_counter(total: int, on_fetch: Callable[[int, int], None] | None) -> Count | None:
    """``on_fetch(done, total)`` from the fetch's threads, one call at a time."""
    if on_fetch is None:
        return None
    lock = threading.Lock()
    done = [0]

    def count(n: int) -> None:
        with lock:
            done[0] += n
            on_fetch(done[0], total)

    return count
