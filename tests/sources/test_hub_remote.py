"""``inspect org/model[@revision]`` against a Hub on loopback (tests/hub_server.py): huggingface_hub's
own client in a child process (HF_ENDPOINT is read at import), headers read by range, faults
recovered, errors in one line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mxfp4conv.errors import InputError, UsageError
from mxfp4conv.files.safetensors import TensorRef, parse_header, read_header
from mxfp4conv.sources.hub import HEAD_PROBE, HubPath, split_revision
from tests.builders import build
from tests.hub_server import HubServer, Request, fresh, hub

REPO = "tiny-org/tiny-gpt-oss"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> Iterator[HubServer]:
    with hub() as h:
        yield h


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shards of ~1 MB each, far more than the header range, so a download would show in the log."""
    src = build("gpt-oss", tmp_path_factory.mktemp("src") / "gpt", shards=2, hidden=256, inter=128, experts=8)
    (src / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    return src


@pytest.fixture(scope="module")
def commit(server: HubServer, local: Path) -> str:
    return server.add_repo(REPO, local)


_fresh = pytest.fixture(autouse=True)(fresh)  # an empty log and no faults for each test


def env(server: HubServer, cache: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith(("HF_", "HUGGING"))}
    out.update(HF_ENDPOINT=server.url, HF_HUB_CACHE=str(cache / "hub"), HF_HOME=str(cache / "home"),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               NO_PROXY="127.0.0.1,localhost", PYTHONPATH=str(ROOT))
    return out


def cli(server: HubServer, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mxfp4conv", *args], capture_output=True, text=True,
                          env=env(server, cache), timeout=120)


def inspect_json(server: HubServer, cache: Path, src: str, *args: str) -> dict[str, Any]:
    res = cli(server, cache, "inspect", src, "--json", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def comparable(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in ("source", "hub")}


def header_bytes(shard: Path) -> int:
    with open(shard, "rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def cdn_range(r: Request) -> bool:
    return r.host == "cdn" and r.method == "GET"


def test_the_server_answers_huggingface_hub_itself(server: HubServer, local: Path, commit: str, tmp_path: Path) -> None:
    """repo_info, list_repo_tree, get_paths_info, hf_hub_download and snapshot_download (huggingface_hub's
    own code, in a child process), a 206 / 416 on the CDN link, EntryNotFound for a missing file."""
    script = textwrap.dedent(f"""
        import hashlib, json, sys
        from huggingface_hub import HfApi, get_hf_file_metadata, get_session, hf_hub_download, hf_hub_url, snapshot_download
        from huggingface_hub.errors import RemoteEntryNotFoundError, RevisionNotFoundError, RepositoryNotFoundError
        api = HfApi()
        out = {{}}
        info = api.repo_info({REPO!r}, revision="main", files_metadata=True)
        out["sha"] = info.sha
        out["siblings"] = {{s.rfilename: [s.size, s.lfs.sha256 if s.lfs else None] for s in info.siblings}}
        tree = api.list_repo_tree({REPO!r}, revision=info.sha, recursive=True, expand=True)
        out["tree"] = {{f.path: [f.size, f.lfs.sha256 if f.lfs else None, f.last_commit.oid] for f in tree}}
        paths = api.get_paths_info({REPO!r}, ["config.json", "model-00001-of-00002.safetensors", "nope"], revision=info.sha)
        out["paths"] = [[p.path, p.size, p.lfs.sha256 if p.lfs else None] for p in paths]
        small = hf_hub_download({REPO!r}, "config.json", revision=info.sha)
        big = hf_hub_download({REPO!r}, "model-00002-of-00002.safetensors", revision="main")
        out["downloads"] = [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in (small, big)]
        snap = snapshot_download({REPO!r})
        import os
        out["snapshot"] = sorted(os.listdir(snap))
        meta = get_hf_file_metadata(hf_hub_url({REPO!r}, "model-00001-of-00002.safetensors", revision=info.sha))
        out["meta"] = [meta.commit_hash, meta.etag, meta.size, meta.location.split("?")[0].split("/")[2]]
        r = get_session().get(meta.location, headers={{"Range": "bytes=8-15"}})
        out["range"] = [r.status_code, r.headers["Content-Range"], len(r.content)]
        r = get_session().get(meta.location, headers={{"Range": "bytes=%d-" % meta.size}})
        out["past_end"] = r.status_code
        errors = []
        for call in (lambda: hf_hub_download({REPO!r}, "missing.json", revision=info.sha),
                     lambda: api.repo_info({REPO!r}, revision="no-such-branch"),
                     lambda: api.repo_info("nobody/nothing")):
            try:
                call()
            except (RemoteEntryNotFoundError, RevisionNotFoundError, RepositoryNotFoundError) as exc:
                errors.append(type(exc).__name__)
        out["errors"] = errors
        print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env(server, tmp_path), timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    files = sorted(p.name for p in local.iterdir())
    sha = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in local.iterdir()}
    size = {p.name: p.stat().st_size for p in local.iterdir()}
    lfs = {n: (sha[n] if n.endswith(".safetensors") else None) for n in files}
    assert out["sha"] == commit
    assert out["siblings"] == {n: [size[n], lfs[n]] for n in files}
    assert out["tree"] == {n: [size[n], lfs[n], commit] for n in files}
    assert out["paths"] == [["config.json", size["config.json"], None],
                            ["model-00001-of-00002.safetensors", size["model-00001-of-00002.safetensors"],
                             sha["model-00001-of-00002.safetensors"]]]
    assert out["downloads"] == [sha["config.json"], sha["model-00002-of-00002.safetensors"]]
    assert out["snapshot"] == files
    assert out["meta"] == [commit, sha["model-00001-of-00002.safetensors"], size["model-00001-of-00002.safetensors"],
                           f"localhost:{server.port}"]
    assert out["range"] == [206, f"bytes 8-15/{size['model-00001-of-00002.safetensors']}", 8]
    assert out["past_end"] == 416
    assert out["errors"] == ["RemoteEntryNotFoundError", "RevisionNotFoundError", "RepositoryNotFoundError"]
    assert not any(r.host == "cdn" and r.status == 403 for r in server.log)


def test_remote_inspect_reads_headers_only_and_matches_the_local_folder(
        server: HubServer, local: Path, commit: str, tmp_path: Path, record: Any) -> None:
    local_doc = inspect_json(server, tmp_path, str(local))
    server.clear_log()
    doc = inspect_json(server, tmp_path, REPO)
    assert comparable(doc) == comparable(local_doc) and local_doc["hub"] is None
    assert doc["source"] == REPO
    shards = sorted(local.glob("*.safetensors"))
    assert doc["hub"] == {
        "repo_id": REPO, "revision": None, "commit": commit, "read_from": "hub",
        "header_bytes_fetched": HEAD_PROBE * len(shards),
        "files": {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                  for p in shards}}
    small = sum(p.stat().st_size for p in local.iterdir() if p.suffix == ".json")
    headers = sum(header_bytes(p) for p in shards)
    sent = server.sent()
    record("bytes_fetched", sent)
    record("repo_bytes", sum(p.stat().st_size for p in local.iterdir()))
    assert sent <= 2 * (headers + small) + 128_000 * len(shards), (sent, headers, small)
    ranges = server.requests(cdn_range)
    assert [r.range for r in ranges] == [f"bytes=0-{HEAD_PROBE - 1}"] * len(shards)
    assert all(r.status == 206 for r in ranges)
    assert not server.requests(lambda r: r.path.endswith(".safetensors") and r.method == "GET")


def test_a_header_larger_than_the_first_range_takes_a_second_one(server: HubServer, tmp_path: Path) -> None:
    src = build("ct-mxfp4", tmp_path / "ct", shards=1, experts=128, layers=2)
    shard = next(src.glob("*.safetensors"))
    n = header_bytes(shard)
    assert n > HEAD_PROBE, n  # the fixture exercises the second range
    server.add_repo("tiny-org/many-tensors", src)
    server.clear_log()
    doc = inspect_json(server, tmp_path, "tiny-org/many-tensors")
    assert comparable(doc) == comparable(inspect_json(server, tmp_path, str(src)))
    assert [r.range for r in server.requests(cdn_range)] == [f"bytes=0-{HEAD_PROBE - 1}", f"bytes={HEAD_PROBE}-{n - 1}"]
    assert doc["hub"]["header_bytes_fetched"] == n


def test_a_pinned_revision_is_honoured(server: HubServer, tmp_path: Path) -> None:
    v1 = build("gpt-oss", tmp_path / "v1", shards=1, experts=4)
    v2 = build("gpt-oss", tmp_path / "v2", shards=2, experts=8)
    sha1 = server.add_repo("tiny-org/moving", v1)
    server.add_repo("tiny-org/moving", v1, branch="v1")
    sha2 = server.add_repo("tiny-org/moving", v2)
    latest = inspect_json(server, tmp_path, "tiny-org/moving")
    assert latest["num_experts"] == 8 and latest["hub"]["commit"] == sha2
    for src, args in ((f"tiny-org/moving@{sha1}", ()), ("tiny-org/moving", ("--revision", sha1))):
        doc = inspect_json(server, tmp_path, src, *args)
        assert doc["num_experts"] == 4 and doc["hub"]["commit"] == sha1 and doc["hub"]["revision"] == sha1
    doc = inspect_json(server, tmp_path, "tiny-org/moving@v1")
    assert doc["num_experts"] == 4 and doc["hub"]["revision"] == "v1"
    res = cli(server, tmp_path, "inspect", f"tiny-org/moving@{sha1}", "--revision", "main")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_a_branch_that_moves_during_the_run_does_not_mix_commits(
        server: HubServer, local: Path, commit: str, tmp_path: Path) -> None:
    other = build("gpt-oss", tmp_path / "other", shards=2, experts=4, seed=1)
    moved: list[str] = []
    server.fault("call", cdn_range, call=lambda: moved.append(server.add_repo(REPO, other)))
    try:
        doc = inspect_json(server, tmp_path, REPO)
        assert moved and server.repos[REPO].refs["main"] == moved[0] != commit
        assert doc["hub"]["commit"] == commit and doc["num_experts"] == 8
        assert comparable(doc) == comparable(inspect_json(server, tmp_path, str(local)))
    finally:
        server.repos[REPO].refs["main"] = commit


FAULTS = {
    "429 on a header range": ("429", cdn_range),
    "503 on a header range": ("503", cdn_range),
    "503 on repo_info": ("503", lambda r: r.path.startswith("/api/")),
    "503 on a small file": ("503", lambda r: r.method == "GET" and r.path.endswith("config.json")),
    "429 on the file list": ("429", lambda r: "/tree/" in r.path),
    "connection dropped mid-range": ("drop", cdn_range),
    "short 206 body": ("short", cdn_range),
    "expired link": ("expire", cdn_range),
}


@pytest.fixture(scope="module")
def clean(server: HubServer, commit: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return inspect_json(server, tmp_path_factory.mktemp("clean"), REPO)


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_faults_recover_with_the_same_result(server: HubServer, clean: dict[str, Any], tmp_path: Path,
                                              name: str) -> None:
    kind, match = FAULTS[name]
    server.clear_log()
    fault = server.fault(kind, match)
    doc = inspect_json(server, tmp_path / "faulty", REPO)
    assert fault.hits == 1  # the fault happened
    assert {k: v for k, v in doc.items() if k != "hub"} == {k: v for k, v in clean.items() if k != "hub"}
    assert doc["hub"]["commit"] == clean["hub"]["commit"] and doc["hub"]["files"] == clean["hub"]["files"]
    if kind == "expire":
        assert [r.status for r in server.requests(cdn_range)][:2] == [403, 206]
    elif match is cdn_range:
        assert len(server.requests(cdn_range)) == 3  # the faulty range again, then the other shard's


def test_missing_repo_revision_or_file_is_one_line_exit_1(server: HubServer, local: Path, commit: str,
                                                           tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in local.iterdir():
        if p.name != "model-00002-of-00002.safetensors":
            (broken / p.name).write_bytes(p.read_bytes())
    server.add_repo("tiny-org/broken", broken)
    noconfig = tmp_path / "noconfig"
    noconfig.mkdir()
    (noconfig / "model.safetensors").write_bytes((local / "model-00001-of-00002.safetensors").read_bytes())
    server.add_repo("tiny-org/noconfig", noconfig)
    cases = {"nobody/nothing": "no such repo", f"{REPO}@no-such-branch": "no such revision",
             "tiny-org/broken": "does not exist", "tiny-org/noconfig": "config.json is missing"}
    for src, words in cases.items():
        res = cli(server, tmp_path, "inspect", src)
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        assert res.returncode == 1, (src, res.stderr)
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in res.stderr, (src, res.stderr)
        assert src.split("@")[0] in lines[0]


def test_convert_of_a_repo_id_carries_the_extra_files_a_local_copy_does(
        server: HubServer, local: Path, commit: str, tmp_path: Path) -> None:
    res = cli(server, tmp_path, "convert", REPO, str(tmp_path / "remote"), "--to", "quark", "--json")
    assert res.returncode == 0, res.stderr
    res = cli(server, tmp_path, "convert", str(local), str(tmp_path / "local"), "--to", "quark", "--json")
    assert res.returncode == 0, res.stderr
    names = sorted(p.name for p in (tmp_path / "local").iterdir() if p.name != "mxfp4conv.json")
    assert ".gitattributes" in names
    assert sorted(p.name for p in (tmp_path / "remote").iterdir() if p.name != "mxfp4conv.json") == names
    for n in names:
        if n != "README.md":  # the card names its source: the repo and its commit, or the folder
            assert (tmp_path / "remote" / n).read_bytes() == (tmp_path / "local" / n).read_bytes(), n
    assert f"base_model: {REPO}\n" in (tmp_path / "remote" / "README.md").read_text()
    manifest = json.loads((tmp_path / "remote" / "mxfp4conv.json").read_text())
    assert manifest["source"]["repo_id"] == REPO and manifest["source"]["revision"] == commit


def test_a_remote_file_holds_no_local_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ref read from the Hub never reads a local file of the same relative name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "m@abc").mkdir(parents=True)
    (tmp_path / "org" / "m@abc" / "x.safetensors").write_bytes(b"\0" * 64)  # a decoy under the same name
    ref = TensorRef(HubPath("org/m@abc/x.safetensors"), "w", "U8", (8,), 8, 16)
    assert str(ref.file) == "org/m@abc/x.safetensors" and ref.file.name == "x.safetensors"
    with pytest.raises(InputError, match=r"org/m@abc/x\.safetensors: is a file of a Hugging Face repo"):
        ref.read_bytes()
    with pytest.raises(InputError):
        open(ref.file, "rb")  # noqa: SIM115 - must raise before anything is opened


def test_parse_header_is_read_header_from_bytes(local: Path) -> None:
    shard = next(local.glob("*.safetensors"))
    data = shard.read_bytes()
    size = len(data)
    assert parse_header(data[:header_bytes(shard)], size, shard) == read_header(shard)
    assert parse_header(data[:HEAD_PROBE], size, shard) == read_header(shard)  # more bytes than the header
    with pytest.raises(InputError, match="bytes given for a header that ends at byte"):
        parse_header(data[:100], size, shard)
    with pytest.raises(InputError, match="too short for a safetensors header"):
        parse_header(data[:4], size, shard)
    with pytest.raises(InputError, match="larger than the file"):
        parse_header(data[:header_bytes(shard)], header_bytes(shard) - 1, shard)


def test_split_revision() -> None:
    assert split_revision("org/m@v1", None) == ("org/m", "v1")
    assert split_revision("org/m@v1", "v1") == ("org/m", "v1")
    assert split_revision("org/m", "v2") == ("org/m", "v2")
    assert split_revision("./dir@x", None) == ("./dir@x", None)
    with pytest.raises(UsageError, match="names revision 'v1' but --revision says 'v2'"):
        split_revision("org/m@v1", "v2")
