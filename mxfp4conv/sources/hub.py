"""A Hugging Face Hub repo read without downloading its weights.

The revision is pinned once (``HfApi.repo_info`` gives the commit sha) and everything after names
that commit: the file list with sizes and LFS sha256 (``list_repo_tree(recursive=True)``), the small
files through huggingface_hub's cache (``hf_hub_download(revision=sha)``), and each safetensors
shard's header through Range GETs on the file's resolved location (``hf_hub_url`` +
``get_hf_file_metadata``, then huggingface_hub's own HTTP client and ``http_stream_backoff``, the
body read straight into a buffer of the range's size): one
speculative range of ``HEAD_PROBE`` bytes that holds the 8-byte length and, usually, the whole
header; a second range for the rest only when the header is larger. Every answer must be a 206 with
the asked ``Content-Range`` and exactly that many bytes (a short body is an error, not data); no
multi-range requests. 429 waits as huggingface_hub does (its RateLimit / Retry-After handling), 5xx
and dropped connections (before or during the body) are retried with backoff, a 403 from the
redirect host (an expired link) re-resolves the file; a link to another host gets no token. Requests
stay few: ``/resolve/`` (the endpoint the Hub rate-limits per five minutes) is asked once per file
and again only on an expired link; the bytes come from the resolved location in 16 MiB ranges.

A ``RemoteRepo`` is also a ``ByteSource`` (``files/source.py``): while a conversion runs
(``streaming``), its shards' bytes come from one ``OrderedFetch`` (``sources/fetch.py``): each shard
fetched once, in file order, by several connections, hashed as it arrives and compared with the
Hub's sha256 (an LFS file's oid) before anything is published; the conversion's reads are served
from the fetched blocks, never from a stored copy of the shard. The headers the plan was made from
must be the bytes of that pass too.

Errors are ``InputError`` (exit 1), one line naming ``org/model@sha/<file>``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PosixPath
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

from mxfp4conv.errors import InputError, UsageError
from mxfp4conv.sources.fetch import BUDGET, OrderedFetch
from mxfp4conv.sources.hub_client import RETRIES, pause, retried, why

__all__ = ["HEAD_PROBE", "HubFile", "HubPath", "RemoteRepo", "offline", "open_repo", "retrying", "split_revision"]

HEAD_PROBE = 64 << 10  # the first range of each shard: its 8-byte length and (usually) the whole header
_REPO_REF = re.compile(r"^([A-Za-z0-9][\w.-]*/[\w.-]+)@([^\s@]+)$")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
T = TypeVar("T")


class HubPath(PosixPath):
    """``org/model@sha/<file>``: names a file of a pinned Hub commit. It has no local bytes: opening
    it (``os.open``, ``open``, ``stat``) raises ``InputError`` instead of reading a local path of the
    same name."""

    def __fspath__(self) -> str:
        raise InputError("is a file of a Hugging Face repo, known from its header only: its data is not on "
                         "this machine", file=str(self),
                         hint="convert downloads the repo; or download it and pass the local folder")


def offline() -> bool:
    """huggingface_hub's offline mode (HF_HUB_OFFLINE=1): repo ids resolve from its cache only."""
    from huggingface_hub import constants

    check = getattr(constants, "is_offline_mode", None)
    return bool(check() if callable(check) else getattr(constants, "HF_HUB_OFFLINE", False))


def split_revision(src: str, revision: str | None) -> tuple[str, str | None]:
    """``org/model@rev`` -> (``org/model``, ``rev``); ``--revision`` may say the same, not otherwise."""
    m = _REPO_REF.match(src)
    if m is None:
        return src, revision
    if revision is not None and revision != m.group(2):
        raise UsageError(f"{src} names revision {m.group(2)!r} but --revision says {revision!r}",
                         hint="give the revision once")
    return m.group(1), m.group(2)


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    blob_id: str
    sha256: str | None  # LFS files: the sha256 of the file's bytes, as the Hub records it


@dataclass
class RemoteRepo:
    """A repo at one commit: its files, the small ones fetched on demand, headers read by range."""

    repo_id: str
    revision: str | None  # as asked (None: the default branch)
    commit: str
    files: dict[str, HubFile]
    token: str | bool | None = None
    fetched: int = 0  # body bytes read so far (header ranges and, when converting, tensor data)
    _meta: dict[str, Any] = field(default_factory=dict, repr=False)
    # bytes read outside a stream (headers, by file): the stream's bytes must be the same
    _claims: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict, repr=False)
    _headers: dict[str, bytes] = field(default_factory=dict, repr=False)
    _stream: OrderedFetch | None = field(default=None, repr=False)
    _early: tuple[list[str], OrderedFetch] | None = field(default=None, repr=False)  # ``prefetch``'s
    _count: threading.Lock = field(default_factory=threading.Lock, repr=False)  # guards ``fetched``
    _small: set[str] = field(default_factory=set, repr=False)  # small files whose digest matched
    # the bytes arrive at a link's rate, far below a disk's: the conversion reads one shard at a time and
    # converts a MoE layer in groups of experts as their bytes arrive (run/conversion.py)
    paced: ClassVar[bool] = True
    read_from: ClassVar[str] = "hub"  # where the bytes come from: "hub" (by range) or "cache" (sources/hub_cache.py)

    @property
    def root(self) -> HubPath:
        return HubPath(f"{self.repo_id}@{self.commit}")

    def path(self, name: str) -> HubPath:
        return HubPath(f"{self.repo_id}@{self.commit}/{name}")

    def download(self, name: str) -> Path:
        """A small file (config, index, tokenizer) through huggingface_hub's cache, at the pinned commit."""
        from huggingface_hub import hf_hub_download

        local = retrying(lambda: hf_hub_download(self.repo_id, name, revision=self.commit, token=self.token),
                          str(self.path(name)), self.token)
        got = Path(local)
        if name in self.files and got.stat().st_size != self.files[name].size:
            raise InputError(f"downloaded {got.stat().st_size} bytes, the Hub lists {self.files[name].size}",
                             file=str(self.path(name)), hint="run the command again")
        return self.checked_small(name, got)

    @property
    def checked_against(self) -> str:
        """Whose record of the files' digests they are checked against: "hub" or "cache"."""
        return "hub"

    @property
    def recorded_by(self) -> str:
        return "the Hub" if self.checked_against == "hub" else "huggingface_hub's cache"

    @property
    def mismatch_hint(self) -> str:
        return "nothing was published; the download was corrupted or the repo changed: run the command again"

    def checked_small(self, name: str, path: Path) -> Path:
        """``path`` (the small file ``name``: config, index, tokenizer) once its bytes match the sha256 or
        git blob id recorded for it: the config and the index decide how every tensor is read."""
        info = self.files.get(name)
        if info is None or name in self._small:
            return path
        data = path.read_bytes()
        if info.sha256 is not None:
            got, want, what = hashlib.sha256(data).hexdigest(), info.sha256, "sha256"
        elif re.fullmatch(r"[0-9a-f]{40}", info.blob_id):
            got, want, what = git_blob_id(data), info.blob_id, "git blob id"
        else:
            return path
        if got != want:
            raise InputError(f"the bytes read have {what} {got}, {self.recorded_by} records {want}",
                             file=str(self.path(name)), hint=self.mismatch_hint)
        self._small.add(name)
        return path

    def name_of(self, file: Path) -> str:
        """The repo path of ``org/model@sha/<file>``."""
        text, root = str(file), str(self.root)
        if not text.startswith(root + "/"):
            raise InputError("is not a file of this repo", file=text)
        return text[len(root) + 1:]

    @contextlib.contextmanager
    def streaming(self, names: list[str], on_fetch: Callable[[int], None] | None = None, *,
                  budget: int = BUDGET, on_checked: Callable[[str, str], None] | None = None,
                  every_file: bool = True) -> Iterator[OrderedFetch]:
        """Files ``names`` read through one in-order fetch while the block runs, keeping at most about
        ``budget`` bytes of them, each checked against the Hub's sha256 once read whole
        (``on_checked``); ``every_file`` False: only those the conversion reads (sources/fetch.py). The
        fetch ``prefetch`` started for the same files is taken over, with its ``on_fetch``."""
        early, self._early = self._early, None
        if early is not None and early[0] == names and every_file:
            stream = early[1]
            stream.checked_to(on_checked)
            stream.allow_ahead(budget)
        else:
            if early is not None:
                early[1].close()
            stream = self._fetch(names, on_fetch, budget=budget, on_checked=on_checked, every_file=every_file)
        self._stream = stream
        try:
            yield stream
        finally:
            self._stream = None
            stream.close()

    def prefetch(self, names: list[str], on_fetch: Callable[[int], None] | None = None, *,
                 upto: int = BUDGET) -> None:
        """Start the in-order fetch of ``names`` (every one whole) now, at most ``upto`` bytes of them
        before the reads are known; ``streaming`` of the same files takes it over, ``end_prefetch``
        stops it if none does."""
        self.end_prefetch()
        stream = self._fetch(names, on_fetch, budget=BUDGET, on_checked=None, every_file=True)
        self._early = (list(names), stream)
        if names:
            stream.prefetch(names, upto)

    def widen_prefetch(self, names: list[str], *, upto: int, budget: int) -> None:
        """Let the fetch ``prefetch`` started for ``names`` go on to ``upto`` bytes before the reads are
        known and ``budget`` ahead of them after (never less than it had)."""
        if self._early is not None and self._early[0] == names:
            self._early[1].allow_ahead(budget)
            self._early[1].prefetch(names, upto)

    def end_prefetch(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            early[1].close()

    def _fetch(self, names: list[str], on_fetch: Callable[[int], None] | None, *, budget: int,
               on_checked: Callable[[str, str], None] | None, every_file: bool) -> OrderedFetch:
        return OrderedFetch({n: (self.files[n].size, self.files[n].sha256) for n in names}, self.read_range,
                            claims=self._claims, label=lambda n: str(self.path(n)), on_fetch=on_fetch,
                            budget=budget, on_checked=on_checked, every_file=every_file,
                            recorded_by=self.recorded_by, mismatch_hint=self.mismatch_hint)

    # the ByteSource interface (files/source.py)
    def read_into(self, file: Path, offset: int, bufs: list[memoryview]) -> int:
        name = self.name_of(file)
        if self._stream is not None and self._stream.has(name):
            return self._stream.read_into(name, offset, bufs)
        want = min(sum(len(b) for b in bufs), max(0, self.files[name].size - offset))
        raw = bytes(self.read_range(name, offset, offset + want))
        self._claims.setdefault(name, []).append((offset, raw))
        at = 0
        for buf in bufs:
            n = min(len(buf), len(raw) - at)
            buf[:n] = raw[at:at + n]
            at += n
        return at

    def expect(self, reads: Iterable[tuple[Path, int, int, int]]) -> None:
        if self._stream is not None:
            self._stream.expect((self.name_of(f), b, e, n) for f, b, e, n in reads)

    def descriptor(self, file: Path) -> int | None:
        return None  # no local file: bytes are read into buffers

    def size(self, file: Path) -> int:
        return self.files[self.name_of(file)].size

    def sha256(self, file: Path) -> str | None:
        return self.files[self.name_of(file)].sha256

    def read_header_bytes(self, name: str) -> bytes:
        """The first ``8 + n`` bytes of a safetensors file (its length and JSON header), or fewer when
        the length is invalid (the parser names the problem), in at most two Range GETs, once."""
        if name in self._headers:
            return self._headers[name]
        size = self.files[name].size
        first = bytes(self.read_range(name, 0, min(size, HEAD_PROBE)))
        end = 8 + int.from_bytes(first[:8], "little") if len(first) >= 8 else 0
        if len(first) >= 8 and len(first) < end <= min(size, 8 + (100 << 20)):
            first += self.read_range(name, len(first), end)
        self._headers[name] = first
        self._claims.setdefault(name, []).append((0, first))  # what the plan is made from: checked by the stream
        return first

    def read_range(self, name: str, begin: int, end: int) -> bytes | bytearray:
        """Bytes ``[begin, end)`` of file ``name`` at the pinned commit, checked (206, Content-Range,
        exact length), retried on transient faults, re-resolved on an expired link."""
        if end <= begin:
            return b""
        import httpx
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.utils import build_hf_headers

        where = str(self.path(name))
        last = ""
        for attempt in range(RETRIES + 1):
            if attempt:
                time.sleep(pause(attempt))
            location, same_host = self._location(name, refresh=attempt > 0 and last == "403")
            headers = build_hf_headers(token=self.token if same_host else False)
            if not same_host:
                headers.pop("authorization", None)
            headers.update({"Range": f"bytes={begin}-{end - 1}", "Accept-Encoding": "identity"})
            try:
                status, got, body = self._answer(location, headers, end - begin)
            except _Dropped as exc:  # the connection lost while the body came: the range again
                last = str(exc)
                continue
            except (httpx.HTTPError, HfHubHTTPError) as exc:  # retries spent on 5xx/429/network errors
                raise InputError(f"cannot read bytes {begin}-{end - 1}: {why(exc, self.token)}", file=where,
                                 hint="check the network and run the command again") from exc
            if status == 403 and not same_host:
                last = "403"  # a presigned link past its expiry: resolve the file again
                continue
            if status == 416:
                raise InputError(f"the Hub refuses bytes {begin}-{end - 1} (416): the file is shorter than "
                                 f"the {self.files[name].size} bytes listed", file=where,
                                 hint="the repo changed while it was read; run the command again")
            if status != 206:
                last = f"HTTP {status} instead of 206 Partial Content"
                if status in (200, 404) or 400 <= status < 500:
                    raise InputError(f"cannot read bytes {begin}-{end - 1}: {last}", file=where,
                                     hint="a server that ignores Range requests cannot be read remotely")
                continue
            want = f"bytes {begin}-{end - 1}/{self.files[name].size}"
            if got.strip() != want:
                m = _CONTENT_RANGE.match(got.strip())
                if m and int(m.group(3)) != self.files[name].size:
                    raise InputError(f"the file is {m.group(3)} bytes on the server, the Hub lists "
                                     f"{self.files[name].size}", file=where,
                                     hint="the repo changed while it was read; run the command again")
                last = f"Content-Range {got!r} for {want!r}"
                continue
            if len(body) != end - begin:
                last = f"{len(body)} bytes for a range of {end - begin}"  # a short body is an error, not data
                continue
            return body
        raise InputError(f"cannot read bytes {begin}-{end - 1} after {RETRIES + 1} attempts: {last}", file=where,
                         hint="check the network and run the command again")

    def _answer(self, location: str, headers: dict[str, str], size: int) -> tuple[int, str, bytearray]:
        """One Range GET (huggingface_hub's http_stream_backoff retries 429, 5xx and network errors
        until an answer starts): its status, its Content-Range and, for a 206, its body read straight
        into one buffer of the range's size (one byte more shows a longer body); ``_Dropped`` when the
        connection is lost while the body comes."""
        import httpx
        from huggingface_hub.utils import http_stream_backoff

        with http_stream_backoff("GET", location, headers=headers, max_retries=RETRIES, follow_redirects=True,
                                 timeout=_timeout()) as resp:
            got = resp.headers.get("Content-Range", "")
            if resp.status_code != 206:
                return resp.status_code, got, bytearray()
            buf = bytearray(size + 1)
            view = memoryview(buf)
            pos = 0
            try:
                for chunk in resp.iter_bytes():
                    n = min(len(chunk), len(buf) - pos)
                    view[pos:pos + n] = chunk[:n]
                    pos += n
                    if pos == len(buf):
                        break
            except httpx.HTTPError as exc:
                raise _Dropped(f"the connection was lost after {pos} of {size} bytes") from exc
            finally:
                del view
                with self._count:
                    self.fetched += pos
            del buf[pos:]
            return 206, got, buf

    def _location(self, name: str, *, refresh: bool) -> tuple[str, bool]:
        """Where the file's bytes are (the ``/resolve/`` redirect's target), whether it is the Hub's own
        host (then the token may go there); checked against the pinned commit, size and sha256."""
        cached = self._meta.get(name)
        if cached is not None and not refresh:
            return cached
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(self.repo_id, name, revision=self.commit)
        where = str(self.path(name))
        meta = retrying(lambda: get_hf_file_metadata(url, token=self.token, retry_on_errors=True), where, self.token)
        info = self.files[name]
        if meta.commit_hash is not None and meta.commit_hash != self.commit:
            raise InputError(f"the Hub answers for commit {meta.commit_hash}, not the pinned {self.commit}",
                             file=where, hint="the repo changed while it was read; run the command again")
        if meta.size is not None and meta.size != info.size:
            raise InputError(f"the Hub says {meta.size} bytes, its file list {info.size}", file=where,
                             hint="the repo changed while it was read; run the command again")
        if info.sha256 is not None and meta.etag is not None and meta.etag != info.sha256:
            raise InputError(f"ETag {meta.etag} is not the file's sha256 {info.sha256}", file=where,
                             hint="the repo changed while it was read; run the command again")
        same = (urlsplit(meta.location).hostname or "").lower() == (urlsplit(url).hostname or "").lower()
        self._meta[name] = (meta.location, same)
        return meta.location, same


def open_repo(repo_id: str, revision: str | None = None, *, token: str | bool | None = None) -> RemoteRepo:
    """Pin ``revision`` (default branch when None) of ``repo_id`` to its commit and list its files."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(token=token)
    info = retrying(lambda: api.repo_info(repo_id, revision=revision), repo_id + (f"@{revision}" if revision else ""),
                    token)
    commit = info.sha
    if not commit:
        raise InputError("the Hub gave no commit sha for the repo", file=repo_id, hint="check HF_ENDPOINT")
    entries = retrying(lambda: list(api.list_repo_tree(repo_id, revision=commit, recursive=True)),
                        f"{repo_id}@{commit}", token)
    files = {e.path: HubFile(e.path, int(e.size), e.blob_id, e.lfs.sha256 if e.lfs is not None else None)
             for e in entries if isinstance(e, RepoFile)}
    return RemoteRepo(repo_id, revision, commit, files, token)


class _Dropped(Exception):
    """A connection lost while a range's body was being read."""


def retrying(fn: Callable[[], T], where: str, token: str | bool | None = None) -> T:
    """``fn`` (a huggingface_hub call) under the Hub client's retry policy (``sources/hub_client.py``);
    what still fails becomes one ``InputError`` line naming ``where``, ``token`` masked in it."""
    import httpx
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # the Hub's final answers, most specific first (a gated repo is also a RepositoryNotFoundError)
    answers: tuple[tuple[type[Exception], str, str], ...] = (
        (GatedRepoError, "the repo is gated and this account has no access",
         "accept its terms on the Hub and log in (hf auth login or HF_TOKEN)"),
        (RepositoryNotFoundError, "no such repo on the Hub (or it is private)",
         "check the repo id; for a private repo log in (hf auth login or HF_TOKEN)"),
        (RevisionNotFoundError, "no such revision in the repo", "check the branch, tag or commit after @ / --revision"),
        (RemoteEntryNotFoundError, "no such file in the repo at this revision", "check the file list on the Hub"),
    )
    try:
        return retried(fn)
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError) as exc:
        message, hint = next((m, h) for kind, m, h in answers if isinstance(exc, kind))
        raise InputError(message, file=where, hint=hint) from exc
    except (HfHubHTTPError, httpx.HTTPError, LocalEntryNotFoundError) as exc:
        # LocalEntryNotFoundError: hf_hub_download's HEAD failed and the cache has no copy
        raise InputError(f"cannot read from the Hub: {why(exc, token)}", file=where,
                         hint="check the repo id, the network and HF_ENDPOINT") from exc
    except OSError as exc:  # the local cache
        raise InputError(f"cannot write huggingface_hub's cache: {exc}", file=where,
                         hint="check HF_HUB_CACHE / HF_HOME and the free disk space") from exc


def git_blob_id(data: bytes) -> str:
    """git's id of a file's bytes, as the Hub lists a file stored outside LFS."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def _timeout() -> float:
    try:
        return float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT", "") or 10)
    except ValueError:
        return 10.0

