"""``convert ... --push-to-hub ORG/NAME``: the converted DST uploaded to a Hugging Face repo in one commit.

What is committed is exactly the verified output: the files DST's manifest lists (with the sha256 the
conversion recorded for each) and the manifest itself, after ``convert`` has published DST. The repo is
made if missing (``create_repo(exist_ok=True)``, private with ``--private``), a branch with
``--push-revision`` (``create_branch(exist_ok=True)``, from the default branch). Each shard is uploaded
on its own (``preupload_lfs_files``: huggingface_hub asks the LFS batch endpoint first, which gives no
upload action for an object the repo already holds, so an interrupted push sends again only the
shards the Hub lacks): while the conversion runs, as each shard is finished (``ShardUploader``, on
threads of its own), and after it for any that is not up yet. Then one ``create_commit`` adds every
file: the shards as uploaded LFS objects, the config files, index and manifest inline. Nothing is
visible on the Hub before that commit, and the commit is all or nothing: shards uploaded by a
conversion that then fails are referenced by no commit.

With ``--partition I/N`` a run uploads its own shards as it finishes them and commits nothing
(``partition_push``); the ``--finish --push-to-hub`` run makes the one commit, and sends only the
shards the Hub lacks (those a partition could not upload).

Re-running the same command resumes: a DST that already holds this conversion (its manifest matches
this input and these options, as ``--skip-if-current`` checks) is not converted again; its files are
hashed again and compared with the manifest before anything is sent. Tokens come from
``PushOptions.token`` (the Python API), else huggingface_hub's usual places (``HF_TOKEN``, ``hf auth
login``'s token file), and never appear in a message. Failures are ``OutputError`` (exit 1), one line; bad options ``UsageError`` (exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mxfp4conv import __version__
from mxfp4conv.errors import OutputError, UsageError
from mxfp4conv.proof.manifest import MANIFEST
from mxfp4conv.run.pipeline import ConvertOptions, ConvertReport, convert
from mxfp4conv.run.staging import sha256_file
from mxfp4conv.sources.hub_client import inner, retried, status_of, why

__all__ = ["PushOptions", "PushReport", "ShardUploader", "current_output", "partition_push", "push_output"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
UPLOADS = 4  # shards going up at once while the conversion runs: one connection rarely fills a link
T = TypeVar("T")


@dataclass(frozen=True)
class PushOptions:
    """Where ``convert`` pushes the published DST (``--push-to-hub`` and the options beside it)."""

    repo_id: str  # ORG/NAME
    private: bool = False  # for a repo made by this push; an existing public repo is refused
    revision: str | None = None  # the branch to commit to (None: the default branch)
    commit_message: str | None = None
    token: str | None = dataclasses.field(default=None, repr=False)  # None: huggingface_hub's own (HF_TOKEN, ...)

    @classmethod
    def from_cli(cls, repo_id: str | None, private: bool, revision: str | None, commit_message: str | None,
                 opts: ConvertOptions) -> PushOptions | None:
        """The options of ``--push-to-hub`` (None without it), checked against the conversion's."""
        if repo_id is None:
            given = [f for f, on in (("--private", private), ("--push-revision", revision is not None),
                                     ("--commit-message", commit_message is not None)) if on]
            if given:
                raise UsageError(f"{', '.join(given)} only apply with --push-to-hub", hint="add --push-to-hub ORG/NAME")
            return None
        return cls(repo_id, private, revision, commit_message).check(opts)

    def check(self, opts: ConvertOptions) -> PushOptions:
        """These options, refused (``UsageError``) where they are malformed or clash with the conversion's."""
        repo_id, revision, commit_message = self.repo_id, self.revision, self.commit_message
        if not _REPO_ID.match(repo_id) or ".." in repo_id or repo_id.endswith((".git", ".")):
            raise UsageError(f"--push-to-hub {repo_id!r} is not a repo id", hint="use ORG/NAME, e.g. my-org/gpt-oss-20b-quark")
        if opts.dry_run:
            raise UsageError("--push-to-hub cannot be combined with --dry-run (it pushes the published DST)",
                             hint="leave out --dry-run")
        if revision is not None and (not revision.strip() or revision != revision.strip() or _is_commit(revision)):
            raise UsageError(f"--push-revision {revision!r} is not a branch name", hint="name a branch, e.g. mxfp4")
        if commit_message is not None and not commit_message.strip():
            raise UsageError("--commit-message is empty", hint="leave it out for the default message")
        return self


@dataclass
class PushReport:
    repo_id: str
    revision: str  # the branch committed to
    commit: str  # the commit oid on the Hub
    commit_url: str
    private: bool  # the repo's visibility after the push
    files: int  # files in the commit
    shards: int  # of them, uploaded one by one as LFS objects before the commit
    bytes: int  # the size of every file pushed
    seconds: float
    uploaded_during_conversion: int = 0  # shards sent while the conversion ran (ShardUploader)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def current_output(src: str | Path, dst: str | Path, opts: ConvertOptions) -> ConvertReport | None:
    """With ``--push-to-hub``: the report of a conversion that is already in DST (a push that failed
    after DST was published, run again), or None when ``convert`` must run. Found as
    ``--skip-if-current`` finds it, in a dry run, so a DST of another input or options is never
    replaced: ``convert`` then refuses it as it always does (or replaces it with ``--overwrite``)."""
    if (opts.overwrite or opts.skip_if_current or opts.finish or opts.partition is not None
            or not (Path(dst) / MANIFEST).is_file()):
        return None
    probe = convert(src, dst, dataclasses.replace(opts, skip_if_current=True, dry_run=True))
    return probe if probe.status == "skipped" else None


class ShardUploader:
    """Shards uploaded as the conversion finishes them (``add``, from the conversion's thread; the
    uploads run on ``UPLOADS`` threads of their own, in the order the shards finish). An upload that
    fails is left for ``push_output`` to send again; ``uploaded`` holds those that are on the Hub."""

    def __init__(self, opts: PushOptions, progress: Callable[[int, int], None] | None = None) -> None:
        self.opts = opts
        self.progress = progress  # (bytes uploaded, bytes of the shards handed over so far)
        self.sent = self.queued = 0
        self._counts = threading.Lock()  # sent, queued and the progress calls, from every thread
        self.uploaded: dict[str, Any] = {}  # path in the repo -> its CommitOperationAdd, uploaded
        self.added: list[str] = []  # every shard handed to ``add``
        self.prepared: tuple[Any, str] | None = None  # the repo's info and the branch, once made
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._stop = False
        self._fault: BaseException | None = None
        self._ready = threading.Lock()  # the repo is made once, by the first upload

    def start(self) -> ShardUploader:
        from huggingface_hub import HfApi

        api = HfApi(token=self.opts.token)
        self._threads = [threading.Thread(target=self._run, args=(api,), name=f"mxfp4conv-upload-{i}", daemon=True)
                         for i in range(UPLOADS)]
        for t in self._threads:
            t.start()
        return self

    def add(self, rel: str, path: Path, sha256: str) -> None:
        """A finished shard (its path in the output, where it is now, its sha256). Its file is opened
        here, while it is in the staging folder: the upload reads it even once DST is published (the
        folder renamed) while shards are still going up."""
        if not rel.endswith(".safetensors") or self._stop:
            return
        from huggingface_hub import CommitOperationAdd

        try:
            op = CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path))
            op.path_or_fileobj = open(path, "rb")  # noqa: SIM115 - closed once uploaded
        except OSError:
            return  # push_output sends it from DST
        op.upload_info.sha256 = bytes.fromhex(sha256)  # hashed as written: not read again here
        self.added.append(rel)
        self._count(0, op.upload_info.size)
        self._queue.put((rel, op))

    def _count(self, sent: int, queued: int) -> None:
        with self._counts:
            self.sent += sent
            self.queued += queued
            if self.progress is not None:
                self.progress(self.sent, self.queued)

    def finish(self) -> ShardUploader:
        """Wait for the uploads queued so far."""
        self._join()
        if self._fault is not None:
            raise self._fault
        return self

    def close(self) -> None:
        """Stop after the uploads in progress (the conversion failed)."""
        self._stop = True
        self._join()

    def _join(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._threads = []

    def _run(self, api: Any) -> None:
        branch = self.opts.revision or "main"
        while (job := self._queue.get()) is not None:
            rel, op = job
            try:
                if self._stop:
                    continue
                with self._ready:  # the repo (and branch) made at the first finished shard: none for a failed plan
                    if self.prepared is None:
                        try:
                            self.prepared = _prepare_repo(api, self.opts)
                        except BaseException:
                            self._stop = True  # no repo: push_output makes it again and says what failed
                            raise
                api.preupload_lfs_files(self.opts.repo_id, additions=[op], repo_type="model", revision=branch,
                                        free_memory=False)
                self.uploaded[rel] = op
                self._count(op.upload_info.size, 0)
            except Exception as exc:
                if not (_is_hub_error(exc) or isinstance(exc, OutputError | OSError)):
                    self._fault = self._fault or exc  # not the Hub's or the disk's: raised by finish()
                # otherwise push_output sends the shard again
            finally:
                op.path_or_fileobj.close()


def partition_push(opts: PushOptions, uploader: ShardUploader) -> dict[str, Any]:
    """What a ``--partition`` run's push did: its shards on the Hub as LFS objects that no commit names
    yet (``--finish --push-to-hub`` commits them; it sends any the Hub lacks)."""
    return {"repo_id": opts.repo_id, "revision": opts.revision or "main", "commit": None,
            "shards": len(uploader.added), "uploaded": sorted(uploader.uploaded)}


def push_output(dst: str | Path, opts: PushOptions, *, written_now: bool,
                on_file: Callable[[str, int, int], None] | None = None,
                uploader: ShardUploader | None = None,
                progress: Callable[[int, int], None] | None = None) -> PushReport:
    """Push DST (published by ``convert``) to ``opts.repo_id``. ``written_now``: this run wrote DST, so
    the manifest's sha256 are those of the bytes just written and verified; otherwise every file is
    hashed again and must match them. ``uploader``: what the conversion's ``ShardUploader`` already
    did (shards it sent are taken where their sha256 is the manifest's). ``on_file(path, i, n)`` is
    called before each shard's upload; ``progress(done, total)`` after each, in bytes of all shards
    (those the uploader sent counted done)."""
    t0 = time.perf_counter()
    dst = Path(dst)
    files = _files(dst, check=not written_now)
    return _guarded(opts, lambda: _push(dst, files, opts, on_file, t0, uploader, progress))


def _guarded(opts: PushOptions, fn: Callable[[], T]) -> T:
    """``fn``, with huggingface_hub's and httpx's errors (and ValueError on a malformed answer) as one
    ``OutputError`` line."""
    try:
        return fn()
    except OutputError:
        raise
    except Exception as exc:
        if not _is_hub_error(exc):
            raise
        raise OutputError(f"cannot push to the Hub: {why(exc, opts.token)}", file=opts.repo_id, hint=_hint(exc)) from exc


def _files(dst: Path, *, check: bool) -> dict[str, str | None]:
    """DST's files to push: relative path -> sha256 (None for the manifest, which huggingface_hub sends
    inline), the manifest's outputs first."""
    try:
        manifest = json.loads((dst / MANIFEST).read_text())
        outputs: dict[str, str] = dict(manifest["outputs"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OutputError(f"has no readable manifest ({MANIFEST}) to push from", file=str(dst),
                          hint="push a DST written by mxfp4conv convert") from exc
    for rel, sha in outputs.items():
        path = dst / rel
        if not path.is_file():
            raise OutputError("is listed in the manifest but missing", file=str(path),
                              hint="convert again with --overwrite")
        if check and sha256_file(path) != sha:
            raise OutputError("changed since it was converted (its sha256 is not the manifest's)", file=str(path),
                              hint="convert again with --overwrite")
    return {**dict(sorted(outputs.items())), MANIFEST: None}


def _prepare_repo(api: Any, opts: PushOptions) -> tuple[Any, str]:
    """The repo made if missing (private with --private), the branch made if named: (repo info, branch)."""
    repo = opts.repo_id
    retried(lambda: api.create_repo(repo, repo_type="model", private=True if opts.private else None, exist_ok=True))
    info = retried(lambda: api.repo_info(repo, repo_type="model"))
    if opts.private and not info.private:
        raise OutputError("the repo exists and is public: --private applies to a repo this push creates", file=repo,
                          hint="make the repo private on the Hub first, or push to a new repo")
    branch = opts.revision or "main"
    if opts.revision is not None and opts.revision != "main":
        retried(lambda: api.create_branch(repo, branch=branch, repo_type="model", exist_ok=True))
    return info, branch


def _push(dst: Path, files: dict[str, str | None], opts: PushOptions, on_file: Callable[[str, int, int], None] | None,
          t0: float, uploader: ShardUploader | None, progress: Callable[[int, int], None] | None) -> PushReport:
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=opts.token)
    repo = opts.repo_id
    uploaded = uploader.uploaded if uploader is not None else {}
    info, branch = uploader.prepared if uploader is not None and uploader.prepared else _prepare_repo(api, opts)
    ops = []
    for rel, sha in files.items():
        up = uploaded.get(rel)
        if up is not None and sha is not None and up.upload_info.sha256 == bytes.fromhex(sha):
            ops.append(up)  # sent while the conversion ran: the commit names it by its sha256 and size
            continue
        op = CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(dst / rel))
        if sha is not None:
            op.upload_info.sha256 = bytes.fromhex(sha)  # hashed as written: not read again here
        ops.append(op)
    shards = [op for op in ops if op.path_in_repo.endswith(".safetensors")]
    early = {id(op) for op in uploaded.values()}  # sent while the conversion ran
    total = sum(op.upload_info.size for op in shards)
    done = sum(op.upload_info.size for op in shards if id(op) in early)
    for i, op in enumerate(shards):
        if op.path_in_repo in uploaded and op is uploaded[op.path_in_repo]:
            continue
        if on_file is not None:
            on_file(op.path_in_repo, i, len(shards))
        try:
            api.preupload_lfs_files(repo, additions=[op], repo_type="model", revision=branch, free_memory=False)
        except Exception as exc:
            if not _is_hub_error(exc):
                raise
            raise OutputError(f"cannot upload {op.path_in_repo} ({i + 1} of {len(shards)} shards): {why(exc, opts.token)}",
                              file=repo, hint="run the same command again: shards already on the Hub are not sent "
                                              "again") from exc
        done += op.upload_info.size
        if progress is not None:
            progress(done, total)
    message = opts.commit_message or _default_message(dst)
    commit = api.create_commit(repo, operations=ops, commit_message=message, repo_type="model", revision=branch)
    return PushReport(repo_id=repo, revision=branch, commit=commit.oid, commit_url=str(commit.commit_url),
                      private=bool(info.private), files=len(ops), shards=len(shards),
                      bytes=sum(op.upload_info.size for op in ops), seconds=round(time.perf_counter() - t0, 3),
                      uploaded_during_conversion=sum(1 for op in shards if uploaded.get(op.path_in_repo) is op))


def _default_message(dst: Path) -> str:
    try:
        m = json.loads((dst / MANIFEST).read_text())
        src = m["source"]
        name = f"{src['repo_id']}@{src['revision']}" if src.get("repo_id") else src["name"]
        return f"{src['layout']} -> {m['target']} of {name} (mxfp4conv {m.get('version', __version__)})"
    except (OSError, ValueError, KeyError, TypeError):
        return f"Upload converted checkpoint (mxfp4conv {__version__})"


def _is_commit(rev: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{40}", rev) is not None


def _is_hub_error(exc: BaseException) -> bool:
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    chain: BaseException | None = exc
    while chain is not None:  # huggingface_hub wraps upload failures in RuntimeError("Error while uploading ...")
        if isinstance(chain, HfHubHTTPError | httpx.HTTPError | ValueError | OSError):
            return True
        chain = chain.__cause__
    return False


def _hint(exc: BaseException) -> str:
    if status_of(exc) in (401, 403) or type(inner(exc)).__name__ == "RepositoryNotFoundError":
        return "log in with a token that can write to the repo's namespace (hf auth login or HF_TOKEN)"
    return "run the same command again: DST is kept and shards already on the Hub are not sent again"
