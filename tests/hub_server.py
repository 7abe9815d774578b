"""A Hugging Face Hub on loopback: a real HTTP server (stdlib ``ThreadingHTTPServer``) serving repos
from local folders, with the requests huggingface_hub makes and the answers it expects.

- ``GET /api/models/{id}[/revision/{rev}]``: id, sha, siblings (sizes, blob ids, LFS with ``blobs=true``)
- ``GET /api/models/{id}/tree/{rev}[/{path}]`` (``recursive``, ``expand``) and ``POST
  /api/models/{id}/paths-info/{rev}`` (form ``paths``): type, path, size, oid, lfs{oid, size, pointerSize}
- ``HEAD/GET /{id}/resolve/{rev}/{file}``: X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size; an LFS
  file answers 302 to ``http://localhost:{port}/cdn/{sha256}?token=...``, a second loopback host name
  (huggingface_hub follows a redirect to the same host and stops at another one, as with the Hub's
  CDN, and sends no token there), whose token the server can expire (403 afterwards); Range requests
  answer 206 + Content-Range, a range starting past the end 416; a missing repo, revision or file 404
  with ``X-Error-Code`` RepoNotFound / RevisionNotFound / EntryNotFound.

Uploads, as huggingface_hub sends them with ``HF_HUB_DISABLE_XET=1`` (each needs ``Authorization: Bearer``,
the :attr:`HubServer.write_token` when set; 401 otherwise):

- ``POST /api/repos/create`` (name, organization, visibility): a new repo whose first commit holds a
  ``.gitattributes``, as on the Hub; 409 for a repo that exists. A private repo answers reads without
  the write token as a missing one (404 RepoNotFound).
- ``POST /api/models/{id}/branch/{branch}`` (startingPoint): a branch at the default branch's head; 409 if it exists.
- ``POST /api/models/{id}/preupload/{rev}`` (files: path, sample, size): each file's uploadMode (lfs for a
  weight suffix, 10 MiB or more, or a sample holding a NUL byte) and the oid the revision holds for it.
- ``POST /{id}.git/info/lfs/objects/batch``: an upload action (a PUT to the second host name, no token
  there, and a verify action) per object the repo lacks; an object it has gets no actions ("already exists").
- ``PUT /lfs-upload/{id}/{sha256}`` on the second host: the body (Content-Length or chunked), stored
  only if its size and sha256 match; ``POST /{id}.git/info/lfs/objects/verify``: 200 once stored, 404 before.
- ``POST /api/models/{id}/commit/{rev}`` (NDJSON: header, file with base64 content, lfsFile by oid,
  deletedFile): one new commit on the branch, all or nothing (an lfsFile the repo lacks: 422, nothing
  committed); answers commitOid and commitUrl. A later GET of the repo serves what was committed.

Faults are injected per test with :meth:`HubServer.fault` (429 with RateLimit headers, 503, 403 as an
expired presigned link, a short 206 body, a connection dropped mid-body (for a PUT: after half the
upload is read), one corrupted byte, an expired link, any callback such as a branch that moves), each
on the requests a predicate picks, ``times`` times. :attr:`HubServer.log` records every request with
the body bytes sent and received, so a test can count what a client fetched and uploaded.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["Blob", "Fault", "HubServer", "Request", "hub"]

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".model", ".gguf")
_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree|paths-info)/([^/]+)(/.*)?)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_CDN = re.compile(r"^/cdn/([0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_SHA = re.compile(r"^[0-9a-f]{40}$")
_WRITE = re.compile(r"^/api/models/([^/]+/[^/]+)/(preupload|commit|branch)/([^/]+)$")
_LFS_API = re.compile(r"^/([^/]+/[^/]+)\.git/info/lfs/objects/(batch|verify)$")
_LFS_PUT = re.compile(r"^/lfs-upload/([^/]+/[^/]+)/([0-9a-f]{64})$")
LFS_THRESHOLD = 10 << 20  # the Hub stores larger files in LFS whatever their name
GITATTRIBUTES = b"".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n".encode() for s in LFS_SUFFIXES)


@dataclass(frozen=True)
class Blob:
    data: bytes
    lfs: bool

    @functools.cached_property  # the Hub answers from its records: never hashed per request
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @functools.cached_property
    def git_oid(self) -> str:
        """The git blob id of the file (an LFS file's blob is its pointer file, as on the Hub)."""
        body = self.pointer if self.lfs else self.data
        return hashlib.sha1(b"blob %d\x00" % len(body) + body).hexdigest()

    @property
    def pointer(self) -> bytes:
        return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
                f"size {len(self.data)}\n").encode()

    def entry(self, path: str) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "file", "path": path, "size": len(self.data), "oid": self.git_oid}
        if self.lfs:
            out["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": len(self.pointer)}
        return out


@dataclass
class Request:
    """One request as the server saw it: ``sent`` counts the body bytes written (headers excluded)."""

    method: str
    path: str
    host: str  # "hub" or "cdn"
    range: str | None
    status: int = 0
    sent: int = 0
    received: int = 0  # request body bytes read (a PUT's upload)
    authorized: bool = False  # whether it carried an Authorization header
    at: float = field(default_factory=time.monotonic)  # when it arrived (time.monotonic)


@dataclass
class Fault:
    """``kind`` on the next ``times`` requests ``match`` accepts (``match(request)``, after the
    request line and headers are read)."""

    kind: str  # "429", "503", "403", "short", "drop", "corrupt", "expire", "call"
    match: Callable[[Request], bool]
    times: int = 1
    call: Callable[[], None] | None = None
    hits: int = 0
    at: int | None = None  # "corrupt": the file offset of the byte flipped (default: the body's middle)


@dataclass
class _Repo:
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    private: bool = False
    lfs: set[str] = field(default_factory=set)  # sha256 of the LFS objects the repo holds (uploaded or committed)
    messages: dict[str, str] = field(default_factory=dict)  # commit -> its summary


class HubServer:
    """The server. ``url`` is what ``HF_ENDPOINT`` takes; start with :func:`hub` or :meth:`start`."""

    def __init__(self) -> None:
        self.repos: dict[str, _Repo] = {}
        self.blobs: dict[str, Blob] = {}
        self.log: list[Request] = []
        self.faults: list[Fault] = []
        self.tokens: dict[str, str] = {}  # live CDN token -> sha256
        self.write_token: str | None = None  # when set, the only token uploads and private reads accept
        self.creates: list[dict[str, Any]] = []  # the bodies of POST /api/repos/create
        self._lock = threading.Lock()
        self.rate: float | None = None  # bytes per second of file bodies, all connections together (None: as fast as it can)
        self._next_free = 0.0  # when the shared link is next free (time.monotonic)
        self._idle = 0.0  # seconds the throttled link sat idle between bodies, since ``clear_log``
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- repos
    def add_repo(self, repo_id: str, folder: Path, *, branch: str = "main") -> str:
        """Serve ``folder``'s files (recursively) as a new commit of ``repo_id`` on ``branch``; its sha."""
        files: dict[str, Blob] = {}
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                rel = p.relative_to(folder).as_posix()
                data = p.read_bytes()
                files[rel] = Blob(data, rel.endswith(LFS_SUFFIXES) or len(data) >= 10 << 20)
        return self.add_commit(repo_id, files, branch=branch)

    def add_commit(self, repo_id: str, files: dict[str, Blob], *, branch: str = "main", message: str = "upload") -> str:
        with self._lock:
            repo = self.repos.setdefault(repo_id, _Repo())
            parent = repo.refs.get(branch, "")
            digest = hashlib.sha1(parent.encode() + json.dumps(
                {k: v.git_oid for k, v in sorted(files.items())}).encode() + repo_id.encode() + message.encode())
            sha = digest.hexdigest()
            repo.commits[sha] = dict(files)
            repo.refs[branch] = sha
            repo.messages[sha] = message
            for b in files.values():
                self.blobs[b.sha256] = b
                if b.lfs:
                    repo.lfs.add(b.sha256)
            return sha

    def files(self, repo_id: str, rev: str = "main") -> dict[str, Blob]:
        repo = self.repos[repo_id]
        return repo.commits[repo.refs.get(rev, rev)]

    # -- faults and the log
    def fault(self, kind: str, match: Callable[[Request], bool] | None = None, *, times: int = 1,
              call: Callable[[], None] | None = None, at: int | None = None) -> Fault:
        f = Fault(kind, match or (lambda r: True), times, call, at=at)
        with self._lock:
            self.faults.append(f)
        return f

    def expire_links(self) -> None:
        """Every CDN link handed out so far stops working (403), as a presigned URL past its expiry."""
        with self._lock:
            self.tokens.clear()

    def received(self, match: Callable[[Request], bool] | None = None) -> int:
        with self._lock:
            return sum(r.received for r in self.log if match is None or match(r))

    @property
    def link_free_at(self) -> float:
        """When the throttled link sent, or will have sent, the last body byte queued on it (time.monotonic)."""
        with self._lock:
            return self._next_free

    def sent(self, match: Callable[[Request], bool] | None = None) -> int:
        with self._lock:
            return sum(r.sent for r in self.log if match is None or match(r))

    def requests(self, match: Callable[[Request], bool] | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.log if match is None or match(r)]

    @property
    def link_idle(self) -> float:
        """Seconds the throttled link had nothing to send between its first and its last body byte since
        ``clear_log``: time a client did not ask for bytes it could have had."""
        with self._lock:
            return self._idle

    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()
            self._next_free, self._idle = 0.0, 0.0

    def _take_fault(self, req: Request) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.hits < f.times and f.match(req):
                    f.hits += 1
                    return f
        return None

    # -- lifecycle
    @property
    def port(self) -> int:
        assert self._httpd is not None, "not started"
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn_url(self) -> str:
        return f"http://localhost:{self.port}"

    def start(self) -> HubServer:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


def fresh(server: HubServer) -> Iterator[None]:
    """Each test starts with an empty log and no faults, and leaves none behind (a test module makes it
    its autouse fixture: ``_fresh = pytest.fixture(autouse=True)(fresh)``, beside its ``server`` fixture)."""
    server.clear_log()
    server.faults.clear()
    yield
    server.faults.clear()


@contextmanager
def hub() -> Iterator[HubServer]:
    server = HubServer().start()
    try:
        yield server
    finally:
        server.stop()


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    # -- plumbing
    def _serve(self) -> None:
        split = urlsplit(self.path)
        host = (self.headers.get("Host") or "").split(":")[0]
        req = Request(self.command, split.path, "cdn" if host == "localhost" else "hub", self.headers.get("Range"),
                      authorized=bool(self.headers.get("Authorization")))
        with self.hub._lock:
            self.hub.log.append(req)
        self._req = req
        fault = self.hub._take_fault(req)
        if fault is not None and fault.kind == "drop" and self.command == "PUT":
            return self._drop_upload()
        body = self._body() if self.command in ("POST", "PUT") else b""
        if fault is not None and fault.kind == "call":
            assert fault.call is not None
            fault.call()
            fault = None
        if fault is not None and fault.kind == "429":
            return self._send(429, b'{"error":"rate limited"}', {
                "RateLimit": '"resolvers";r=0;t=0', "RateLimit-Policy": '"fixed window";"resolvers";q=3000;w=300'})
        if fault is not None and fault.kind == "503":
            return self._send(503, b'{"error":"unavailable"}')
        if fault is not None and fault.kind == "403":
            return self._send(403, b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>",
                              content_type="application/xml")
        if fault is not None and fault.kind == "expire":
            self.hub.expire_links()
            fault = None
        self._fault = fault
        try:
            query = parse_qs(split.query)
            if (m := _CDN.match(split.path)) and req.host == "cdn":
                return self._cdn(m.group(1), query)
            if (m := _LFS_PUT.match(split.path)) and req.host == "cdn" and self.command == "PUT":
                return self._lfs_put(unquote(m.group(1)), m.group(2), body)
            if self.command == "POST" and split.path == "/api/repos/create":
                return self._create(body)
            if self.command == "POST" and split.path == "/api/validate-yaml":
                return self._validate_yaml(body)
            if self.command == "POST" and (m := _WRITE.match(split.path)):
                return self._write(unquote(m.group(1)), m.group(2), unquote(m.group(3)), body)
            if self.command == "POST" and (m := _LFS_API.match(split.path)):
                return self._lfs_api(unquote(m.group(1)), m.group(2), body)
            if m := _API.match(split.path):
                form = parse_qs(body.decode()) if body else {}
                return self._api(unquote(m.group(1)), m.group(2), unquote(m.group(3) or ""),
                                 unquote(m.group(4) or "").lstrip("/"), query, form)
            if m := _RESOLVE.match(split.path):
                return self._resolve(unquote(m.group(1)), unquote(m.group(2)), unquote(m.group(3)))
            return self._send(404, b"not found")
        except (BrokenPipeError, ConnectionResetError):
            return None

    def _validate_yaml(self, body: bytes) -> None:
        """A README.md's metadata, checked before a commit that adds one (huggingface_hub's create_commit
        asks): it must parse as a mapping, and ``base_model_relation`` needs a ``base_model``."""
        import yaml  # type: ignore[import-untyped]

        content = json.loads(body or b"{}").get("content", "")
        m = re.match(r"\A---\n(.*?)\n---\n", content, re.DOTALL)
        try:
            meta = yaml.safe_load(m.group(1)) if m else {}
        except yaml.YAMLError as exc:
            return self._send(400, json.dumps({"errors": [{"message": f"invalid YAML: {exc}"}]}).encode())
        if not isinstance(meta, dict) or ("base_model_relation" in meta and not meta.get("base_model")):
            return self._send(400, json.dumps({"errors": [{"message": "invalid metadata"}]}).encode())
        return self._json({"errors": [], "warnings": []})

    def _body(self) -> bytes:
        """The request body: Content-Length bytes, or the chunks of ``Transfer-Encoding: chunked``."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            parts = []
            while True:
                n = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if n == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                parts.append(self.rfile.read(n))
                self.rfile.readline()
            data = b"".join(parts)
        else:
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._req.received = len(data)
        return data

    def _drop_upload(self) -> None:
        """A connection lost mid-upload: half the announced body read, then closed without an answer."""
        want = int(self.headers.get("Content-Length") or 0)
        got = self.rfile.read(want // 2) if want else self.rfile.read1(1 << 16)
        self._req.received = len(got)
        self.close_connection = True
        self.connection.shutdown(2)

    def _send(self, status: int, body: bytes | memoryview = b"", headers: dict[str, str] | None = None, *,
              content_type: str = "application/json") -> None:
        self._req.status = status
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            if self.hub.rate and content_type == "application/octet-stream":
                self._paced(body)
            else:
                self.wfile.write(body)
            self._req.sent += len(body)

    def _paced(self, body: bytes | memoryview, piece: int = 1 << 20) -> None:
        """Write ``body`` at the server's ``rate``, shared with every other connection (a throttled link)."""
        hub = self.hub
        assert hub.rate
        view = memoryview(body)
        for at in range(0, len(body), piece):
            chunk = view[at:at + piece]
            with hub._lock:
                now = time.monotonic()
                if hub._next_free and now > hub._next_free:
                    hub._idle += now - hub._next_free
                start = max(now, hub._next_free)
                hub._next_free = start + len(chunk) / hub.rate
                until = hub._next_free
            self.wfile.write(chunk)
            time.sleep(max(0.0, until - time.monotonic()))

    def _json(self, doc: Any, headers: dict[str, str] | None = None) -> None:
        self._send(200, json.dumps(doc).encode(), headers)

    def _error(self, code: str, headers: dict[str, str] | None = None) -> None:
        self._send(404, json.dumps({"error": code}).encode(),
                   {"X-Error-Code": code, "X-Error-Message": code, **(headers or {})})

    def _authorized(self) -> bool:
        auth = self.headers.get("Authorization") or ""
        want = self.hub.write_token
        return auth.startswith("Bearer ") and len(auth) > 7 and (want is None or auth == f"Bearer {want}")

    def _unauthorized(self) -> None:
        self._send(401, b'{"error":"Invalid credentials in Authorization header"}',
                   {"X-Error-Message": "Invalid credentials in Authorization header"})

    def _commit(self, repo_id: str, rev: str) -> tuple[str, dict[str, Blob]] | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and not self._authorized()):
            self._error("RepoNotFound")
            return None
        sha = repo.refs.get(rev) or (rev if _SHA.match(rev) and rev in repo.commits else None)
        if sha is None:
            self._error("RevisionNotFound")
            return None
        return sha, repo.commits[sha]

    # -- /api
    def _api(self, repo_id: str, kind: str | None, rev: str, sub: str, query: dict[str, list[str]],
             form: dict[str, list[str]]) -> None:
        got = self._commit(repo_id, rev or "main")
        if got is None:
            return None
        sha, files = got
        expand = (query.get("expand") or form.get("expand") or ["false"])[0].lower() == "true"

        def entry(path: str) -> dict[str, Any]:
            if path in files:
                out = files[path].entry(path)
            else:
                out = {"type": "directory", "path": path, "size": 0,
                       "oid": hashlib.sha1(f"{sha}/{path}".encode()).hexdigest()}
            if expand:
                out["lastCommit"] = {"id": sha, "title": "upload", "date": "2025-01-01T00:00:00.000Z"}
            return out

        dirs = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}
        if kind is None or kind == "revision":
            sib: list[dict[str, Any]] = []
            for path, b in sorted(files.items()):
                s: dict[str, Any] = {"rfilename": path}
                if (query.get("blobs") or ["false"])[0].lower() == "true":
                    s.update(size=len(b.data), blobId=b.git_oid)
                    if b.lfs:
                        s["lfs"] = {"size": len(b.data), "sha256": b.sha256, "pointerSize": len(b.pointer)}
                sib.append(s)
            return self._json({"id": repo_id, "modelId": repo_id, "sha": sha,
                               "private": self.hub.repos[repo_id].private,
                               "siblings": sib, "tags": [], "downloads": 0, "likes": 0})
        if kind == "tree":
            recursive = (query.get("recursive") or ["false"])[0].lower() == "true"
            if sub and sub not in dirs:
                return self._error("EntryNotFound")
            prefix = sub + "/" if sub else ""
            names = sorted({p for p in [*files, *dirs] if p.startswith(prefix)
                            and (recursive or "/" not in p[len(prefix):])})
            return self._json([entry(p) for p in names])
        # paths-info: the entries that exist, in the order asked
        return self._json([entry(p) for p in form.get("paths", []) if p in files or p in dirs])

    # -- uploads
    def _create(self, body: bytes) -> None:
        if not self._authorized():
            return self._unauthorized()
        doc = json.loads(body or b"{}")
        with self.hub._lock:
            self.hub.creates.append(doc)
        repo_id = f"{doc.get('organization')}/{doc['name']}" if doc.get("organization") else f"user/{doc['name']}"
        url = f"{self.hub.url}/{repo_id}"
        if repo_id in self.hub.repos:
            return self._send(409, json.dumps({"error": "You already created this model repo", "url": url}).encode(),
                              {"X-Error-Message": "You already created this model repo"})
        self.hub.add_commit(repo_id, {".gitattributes": Blob(GITATTRIBUTES, False)}, message="initial commit")
        self.hub.repos[repo_id].private = doc.get("visibility") == "private"
        return self._json({"url": url, "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]})

    def _write(self, repo_id: str, kind: str, rev: str, body: bytes) -> None:
        if not self._authorized():
            return self._unauthorized()
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error("RepoNotFound")
        doc: Any = json.loads(body or b"{}") if kind != "commit" else None
        if kind == "branch":
            if rev in repo.refs:
                return self._send(409, b'{"error":"Reference already exists"}',
                                  {"X-Error-Message": "Reference already exists"})
            start = doc.get("startingPoint") or "main"
            sha = repo.refs.get(start) or (start if start in repo.commits else None)
            if sha is None:
                return self._error("RevisionNotFound")
            repo.refs[rev] = sha
            return self._json({})
        got = self._commit(repo_id, rev)
        if got is None:
            return None
        _, files = got
        if kind == "preupload":
            out = []
            for f in doc["files"]:
                sample = base64.b64decode(f["sample"])
                lfs = f["path"].endswith(LFS_SUFFIXES) or int(f["size"]) >= LFS_THRESHOLD or b"\0" in sample
                have = files.get(f["path"])
                oid = None if have is None else (have.sha256 if have.lfs else hashlib.sha1(
                    b"blob %d\x00" % len(have.data) + have.data).hexdigest())
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": oid})
            return self._json({"files": out, "commitOid": got[0]})
        return self._commit_ndjson(repo_id, rev, repo, files, body)

    def _commit_ndjson(self, repo_id: str, rev: str, repo: _Repo, files: dict[str, Blob], body: bytes) -> None:
        if rev not in repo.refs:
            return self._send(400, b'{"error":"Can only commit to a branch"}',
                              {"X-Error-Message": "Can only commit to a branch"})
        tree = dict(files)
        header: dict[str, Any] = {}
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                tree[value["path"]] = Blob(base64.b64decode(value["content"]), False)
            elif key == "lfsFile":
                blob = self.hub.blobs.get(value["oid"])
                if value["oid"] not in repo.lfs or blob is None or ("size" in value and value["size"] != len(blob.data)):
                    msg = f"Your push was rejected because an LFS pointer pointed to a file that does not exist: {value['path']}"
                    return self._send(422, json.dumps({"error": msg}).encode(), {"X-Error-Message": msg})
                tree[value["path"]] = blob
            elif key == "deletedFile":
                tree.pop(value["path"], None)
            elif key == "deletedFolder":
                tree = {k: v for k, v in tree.items() if not k.startswith(value["path"].rstrip("/") + "/")}
        parent = header.get("parentCommit")
        if parent is not None and parent != repo.refs[rev]:
            return self._send(412, b'{"error":"A commit has happened since"}',
                              {"X-Error-Message": "A commit has happened since. Please refresh and try again."})
        sha = self.hub.add_commit(repo_id, tree, branch=rev, message=header.get("summary", ""))
        return self._json({"success": True, "commitOid": sha, "commitUrl": f"{self.hub.url}/{repo_id}/commit/{sha}",
                           "pullRequestUrl": None})

    def _lfs_api(self, repo_id: str, kind: str, body: bytes) -> None:
        if not self._authorized():
            return self._unauthorized()
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error("RepoNotFound")
        doc = json.loads(body or b"{}")
        if kind == "verify":
            blob = self.hub.blobs.get(doc["oid"])
            if doc["oid"] not in repo.lfs or blob is None or len(blob.data) != doc["size"]:
                return self._send(404, b'{"message":"object not found"}')
            return self._json({"message": "ok"})
        objects = []
        for o in doc["objects"]:
            entry: dict[str, Any] = {"oid": o["oid"], "size": o["size"], "authenticated": True}
            if o["oid"] not in repo.lfs:  # objects the repo has get no actions: already exists
                entry["actions"] = {
                    "upload": {"href": f"{self.hub.cdn_url}/lfs-upload/{repo_id}/{o['oid']}", "header": {}},
                    "verify": {"href": f"{self.hub.url}/{repo_id}.git/info/lfs/objects/verify", "header": {}}}
            objects.append(entry)
        return self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                          content_type="application/vnd.git-lfs+json")

    def _lfs_put(self, repo_id: str, oid: str, body: bytes) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._send(404, b"<Error><Code>NoSuchBucket</Code></Error>", content_type="application/xml")
        if hashlib.sha256(body).hexdigest() != oid:
            return self._send(400, b"<Error><Code>BadDigest</Code></Error>", content_type="application/xml")
        blob = Blob(body, True)
        with self.hub._lock:
            self.hub.blobs[oid] = blob
            repo.lfs.add(oid)
        return self._send(200, b"", {"ETag": f'"{oid}"'})

    # -- /resolve and the CDN
    def _resolve(self, repo_id: str, rev: str, path: str) -> None:
        got = self._commit(repo_id, rev)
        if got is None:
            return None
        sha, files = got
        blob = files.get(path)
        if blob is None:
            return self._error("EntryNotFound", {"X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if blob.lfs:
            token = secrets.token_hex(8)
            with self.hub._lock:
                self.hub.tokens[token] = blob.sha256
            exp = int(time.time()) + 3600
            headers.update({"Location": f"{self.hub.cdn_url}/cdn/{blob.sha256}?token={token}&Expires={exp}",
                            "X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(len(blob.data)),
                            "ETag": f'"{blob.git_oid}"'})
            return self._send(302, b"Found. Redirecting", headers, content_type="text/plain")
        headers["ETag"] = f'"{blob.git_oid}"'
        return self._bytes(blob.data, headers)

    def _cdn(self, sha256: str, query: dict[str, list[str]]) -> None:
        token = (query.get("token") or [""])[0]
        with self.hub._lock:
            ok = self.hub.tokens.get(token) == sha256
        if not ok:
            return self._send(403, b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>",
                              content_type="application/xml")
        blob = self.hub.blobs[sha256]
        return self._bytes(blob.data, {"ETag": f'"{sha256}"', "Accept-Ranges": "bytes"})

    def _bytes(self, data: bytes, headers: dict[str, str]) -> None:
        """The file, or the one range asked for (multi-range requests are answered in full, 200)."""
        size = len(data)
        rng = self.headers.get("Range")
        status, begin, end = 200, 0, size
        if rng is not None and (m := _RANGE.match(rng.strip())) and (m.group(1) or m.group(2)):
            if m.group(1):
                begin = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:
                begin, end = max(0, size - int(m.group(2))), size
            if begin >= size or end <= begin:
                return self._send(416, b"", {**headers, "Content-Range": f"bytes */{size}"})
            status = 206
            headers = {**headers, "Content-Range": f"bytes {begin}-{end - 1}/{size}"}
        fault, self._fault = self._fault, None
        if fault is None or self.command == "HEAD":  # a view, not a copy: the server shares the client's cores
            return self._send(status, memoryview(data)[begin:end], headers, content_type="application/octet-stream")
        body = data[begin:end]
        if fault.kind == "corrupt":
            mid = fault.at - begin if fault.at is not None and begin <= fault.at < end else len(body) // 2
            return self._send(status, body[:mid] + bytes([body[mid] ^ 0x01]) + body[mid + 1:], headers,
                              content_type="application/octet-stream")
        if fault.kind == "short":  # a well-formed response that holds fewer bytes than its Content-Range says
            return self._send(status, body[: len(body) // 2], headers, content_type="application/octet-stream")
        if fault.kind == "drop":  # Content-Length promises the range; the connection closes halfway
            self._req.status = status
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            half = body[: len(body) // 2]
            self.wfile.write(half)
            self.wfile.flush()
            self._req.sent += len(half)
            self.close_connection = True
            self.connection.shutdown(2)
            return None
        raise AssertionError(f"unknown fault {fault.kind!r}")
