"""``convert ... --push-to-hub ORG/NAME`` against a Hub on loopback (tests/hub_server.py): huggingface_hub's
own upload code (create_repo, preupload_lfs_files, create_commit over the LFS protocol) in a child
process, the pushed repo read back with its own snapshot_download, interrupted uploads resumed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mxfp4conv.proof.manifest import MANIFEST
from tests.builders import build
from tests.hub_server import GITATTRIBUTES, HubServer, Request, fresh, hub
from tests.terminal import on_terminal

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_pushTOKENmarker0123456789"  # a marker: it must never appear in any output
ARGS = ("--to", "quark", "--max-shard-size", "300KB")  # 7 output shards of 0.2-0.43 MB


@pytest.fixture(scope="module")
def server() -> Iterator[HubServer]:
    with hub() as h:
        h.write_token = TOKEN
        yield h


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("gpt-oss", tmp_path_factory.mktemp("src") / "gpt", shards=2, hidden=256, inter=128, experts=8)


_fresh = pytest.fixture(autouse=True)(fresh)  # an empty log and no faults for each test


def env(server: HubServer, home: Path, token: str | None = TOKEN) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith(("HF_", "HUGGING"))}
    out.update(HF_ENDPOINT=server.url, HF_HUB_CACHE=str(home / "hub"), HF_HOME=str(home / "home"),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               NO_PROXY="127.0.0.1,localhost", PYTHONPATH=str(ROOT))
    if token is not None:
        out["HF_TOKEN"] = token
    return out


def cli(server: HubServer, home: Path, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([sys.executable, "-m", "mxfp4conv", *args], capture_output=True, text=True,
                         env=env(server, home, token), timeout=180)
    assert TOKEN not in res.stdout + res.stderr  # the token is never printed, whatever happened
    return res


def one_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def snapshot(server: HubServer, home: Path, repo: str, revision: str | None = None,
             token: str | None = TOKEN) -> dict[str, Any]:
    """huggingface_hub's snapshot_download of the pushed repo, in a child process: file -> bytes (hex)."""
    script = textwrap.dedent(f"""
        import json, os, sys
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import RepositoryNotFoundError
        try:
            root = snapshot_download({repo!r}, revision={revision!r})
        except RepositoryNotFoundError:
            print(json.dumps({{"error": "RepositoryNotFoundError"}}))
            sys.exit(0)
        out = {{}}
        for d, _, names in os.walk(root):
            for n in names:
                p = os.path.join(d, n)
                out[os.path.relpath(p, root)] = open(p, "rb").read().hex()
        print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env(server, home, token), timeout=120)
    assert res.returncode == 0, res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    return doc


def dst_files(dst: Path) -> dict[str, bytes]:
    return {p.relative_to(dst).as_posix(): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()}


def puts(r: Request) -> bool:
    return r.method == "PUT"


def after_puts(n: int) -> Callable[[Request], bool]:
    """Matches the PUTs after the first ``n``."""
    seen = [0]

    def match(r: Request) -> bool:
        if r.method != "PUT":
            return False
        seen[0] += 1
        return seen[0] > n

    return match


def test_round_trip_uploads_exactly_the_verified_output(server: HubServer, src: Path, tmp_path: Path,
                                                        record: Any) -> None:
    dst = tmp_path / "dst"
    res = cli(server, tmp_path, "convert", str(src), str(dst), *ARGS, "--push-to-hub", "tiny-org/pushed", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    local = dst_files(dst)
    shards = sorted(n for n in local if n.endswith(".safetensors"))
    assert len(shards) >= 5 and doc["status"] == "converted"
    commit = server.repos["tiny-org/pushed"].refs["main"]
    # how many shards went up while this small conversion ran depends on its speed: see the next test
    assert 0 <= doc["push"]["uploaded_during_conversion"] <= len(shards)
    assert doc["push"] | {"seconds": 0, "uploaded_during_conversion": 0} == {
        "repo_id": "tiny-org/pushed", "revision": "main", "commit": commit,
        "commit_url": f"{server.url}/tiny-org/pushed/commit/{commit}", "private": False, "files": len(local),
        "shards": len(shards), "bytes": sum(len(b) for b in local.values()), "seconds": 0,
        "uploaded_during_conversion": 0}
    manifest = json.loads(local[MANIFEST])
    assert server.repos["tiny-org/pushed"].messages[commit] == f"gpt-oss -> quark of gpt (mxfp4conv {manifest['version']})"
    # one commit after the repo's first: nothing was visible before every file was in
    assert len(server.repos["tiny-org/pushed"].commits) == 2
    # each shard PUT once, whole, without the token (the upload host is not the Hub); small files inline
    sent = server.requests(puts)
    assert sorted(r.received for r in sent) == sorted(len(local[n]) for n in shards)
    assert all(r.status == 200 and not r.authorized for r in sent)
    record("bytes_put", sum(r.received for r in sent))
    got = snapshot(server, tmp_path / "reader", "tiny-org/pushed")
    assert sorted(got) == sorted([*local, ".gitattributes"])  # the Hub's own .gitattributes of a new repo
    assert bytes.fromhex(got[".gitattributes"]) == GITATTRIBUTES
    for name, data in local.items():
        assert bytes.fromhex(got[name]) == data, name


def test_an_interrupted_push_resumes_without_sending_the_uploaded_shards_again(
        server: HubServer, src: Path, tmp_path: Path, record: Any) -> None:
    dst = tmp_path / "dst"
    args = ("convert", str(src), str(dst), *ARGS, "--push-to-hub", "tiny-org/resumed", "--json")
    # every upload after the 3rd refused (an expired link), not retried: any sent while the conversion ran,
    # then the first that the push after it sends again
    refusing = [True]
    later = after_puts(3)
    fault = server.fault("403", lambda r: later(r) and refusing[0], times=100)
    res = cli(server, tmp_path, *args)
    refusing[0] = False
    assert fault.hits >= 1 and res.returncode == 1 and res.stdout == ""
    line = one_line(res)
    assert "tiny-org/resumed" in line and re.search(r"cannot upload model-\d{5}-of-00007", line), line
    assert "run the same command again" in line
    assert sorted(server.files("tiny-org/resumed")) == [".gitattributes"]  # nothing committed
    first = {r.path.rsplit("/", 1)[1]: r.received for r in server.requests(puts) if r.status == 200}
    assert len(first) == 3 and (dst / MANIFEST).is_file()  # DST was published before the push began

    server.clear_log()
    res = cli(server, tmp_path, *args)  # the same command again
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["status"] == "skipped"  # DST holds this conversion: not converted again
    local = dst_files(dst)
    shards = {n: data for n, data in local.items() if n.endswith(".safetensors")}
    second = {r.path.rsplit("/", 1)[1]: r.received for r in server.requests(puts)}
    assert len(second) == len(shards) - 3 and not set(second) & set(first)  # none of the uploaded ones again
    assert sum(second.values()) + sum(first.values()) == sum(len(b) for b in shards.values())
    record("bytes_put_first_run", sum(first.values()))
    record("bytes_put_on_resume", sum(second.values()))
    assert doc["push"]["commit"] == server.repos["tiny-org/resumed"].refs["main"]
    got = snapshot(server, tmp_path / "reader", "tiny-org/resumed")
    assert {n: bytes.fromhex(got[n]) for n in local} == local

    server.clear_log()  # once more: nothing left to send, no new commit
    res = cli(server, tmp_path, *args)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["push"]["commit"] == doc["push"]["commit"]
    assert not server.requests(puts) and not server.requests(lambda r: "/commit/" in r.path)


def test_shards_go_up_while_the_conversion_runs(server: HubServer, src: Path, tmp_path: Path) -> None:
    """Each shard is uploaded once it is finished, before DST is published: here DST's publication waits
    for the first upload to reach the Hub (a child that holds ``publish`` until then; 60 s at most)."""
    flag = tmp_path / "first-put"
    fault = server.fault("call", puts, call=flag.touch)
    script = textwrap.dedent(f"""
        import pathlib, sys, time
        import mxfp4conv.run.pipeline as pipeline
        from mxfp4conv.cli import main
        flag, publish = pathlib.Path({str(flag)!r}), pipeline.publish
        def held(staging, dst):
            t = time.monotonic()
            while not flag.exists():
                if time.monotonic() - t > 60:
                    raise SystemExit("no shard went up while the conversion ran")
                time.sleep(0.05)
            publish(staging, dst)
        pipeline.publish = held
        sys.argv = ["mxfp4conv", *sys.argv[1:]]
        main()
    """)
    res = subprocess.run([sys.executable, "-c", script, "convert", str(src), str(tmp_path / "dst"), *ARGS,
                          "--push-to-hub", "tiny-org/early", "--json"], capture_output=True, text=True,
                         env=env(server, tmp_path), timeout=180)
    assert res.returncode == 0, res.stderr
    assert fault.hits == 1
    doc = json.loads(res.stdout)["push"]
    assert doc["uploaded_during_conversion"] == doc["shards"] == 7
    assert len(server.requests(puts)) == 7  # none sent twice
    got = snapshot(server, tmp_path / "reader", "tiny-org/early")
    local = dst_files(tmp_path / "dst")
    assert {n: bytes.fromhex(got[n]) for n in local} == local


def test_a_dropped_upload_is_sent_again_and_a_changed_dst_is_refused(server: HubServer, src: Path,
                                                                     tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    args = ("convert", str(src), str(dst), *ARGS, "--push-to-hub", "tiny-org/dropped")
    fault = server.fault("drop", puts)  # the connection lost halfway through the first upload
    res = cli(server, tmp_path, *args)
    assert res.returncode == 0 and fault.hits == 1, res.stderr
    sent = server.requests(puts)
    twice = [path for path in {r.path for r in sent} if sum(r.path == path for r in sent) == 2]
    assert len(twice) == 1 and len(sent) == 8  # the dropped shard sent again, the others once (uploads overlap)
    first, again = (r for r in sent if r.path == twice[0])
    assert 0 < first.received < again.received and again.status == 200
    assert "pushed: tiny-org/dropped@main commit " + server.repos["tiny-org/dropped"].refs["main"] in res.stderr

    shard = dst / "model-00002-of-00007.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # DST changed after it was converted
    server.clear_log()
    res = cli(server, tmp_path, *args)
    assert res.returncode == 1
    assert "model-00002-of-00007.safetensors: changed since it was converted" in one_line(res)
    assert not server.requests(lambda r: r.method in ("PUT", "POST"))


def test_private_repo_on_a_branch_with_a_message(server: HubServer, src: Path, tmp_path: Path) -> None:
    """--private reaches create_repo, --push-revision makes the branch and commits there, the token comes
    from huggingface_hub's token file (no HF_TOKEN)."""
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "token").write_text(TOKEN)
    dst = tmp_path / "dst"
    server.creates.clear()
    res = cli(server, tmp_path, "convert", str(src), str(dst), *ARGS, "--push-to-hub", "tiny-org/private",
              "--private", "--push-revision", "mxfp4/quark", "--commit-message", "quark export", "--json", token=None)
    assert res.returncode == 0, res.stderr
    push = json.loads(res.stdout)["push"]
    repo = server.repos["tiny-org/private"]
    assert server.creates == [{"name": "private", "organization": "tiny-org", "visibility": "private", "type": "model"}]
    assert repo.private and push["private"] and push["revision"] == "mxfp4/quark"
    assert repo.refs["mxfp4/quark"] == push["commit"] != repo.refs["main"]
    assert repo.messages[push["commit"]] == "quark export"
    assert sorted(server.files("tiny-org/private", "main")) == [".gitattributes"]  # the default branch untouched
    assert snapshot(server, tmp_path / "anon", "tiny-org/private", "mxfp4/quark", token=None) == {
        "error": "RepositoryNotFoundError"}
    got = snapshot(server, tmp_path / "reader", "tiny-org/private", "mxfp4/quark")
    assert {n: bytes.fromhex(got[n]) for n in dst_files(dst)} == dst_files(dst)


def test_partitions_upload_their_own_shards_and_the_finish_commits_them_without_sending_them_again(
        server: HubServer, src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    args = ("convert", str(src), str(dst), *ARGS, "--push-to-hub", "tiny-org/parts", "--json")
    sent: dict[str, int] = {}
    for i in range(2):
        server.clear_log()
        res = cli(server, tmp_path, *args, "--partition", f"{i}/2")
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        assert doc["status"] == "partial" and doc["push"]["commit"] is None
        mine = sorted(doc["push"]["uploaded"])
        # shard j belongs to partition j % 2 (files are numbered from 1)
        assert mine and len(mine) == doc["push"]["shards"]
        assert all((int(re.search(r"model-(\d{5})", n)[1]) - 1) % 2 == i for n in mine), mine  # type: ignore[index]
        now = {r.path.rsplit("/", 1)[1]: r.received for r in server.requests(puts) if r.status == 200}  # by sha256
        assert len(now) == len(mine) and not set(now) & set(sent)
        sent.update(now)
    assert sorted(server.files("tiny-org/parts")) == [".gitattributes"]  # nothing committed by a partition

    server.clear_log()
    res = cli(server, tmp_path, *args, "--finish")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    local = dst_files(dst)
    shards = {n: data for n, data in local.items() if n.endswith(".safetensors")}
    assert sent == {hashlib.sha256(data).hexdigest(): len(data) for data in shards.values()}  # each once, whole
    assert not server.requests(puts)  # every shard was up: the finish sent none again
    assert doc["push"]["commit"] == server.repos["tiny-org/parts"].refs["main"] and doc["push"]["files"] == len(local)
    got = snapshot(server, tmp_path / "reader", "tiny-org/parts")
    assert {n: bytes.fromhex(got[n]) for n in local} == local


def test_a_terminal_sees_the_shards_bytes_go_up(server: HubServer, src: Path, tmp_path: Path) -> None:
    """On a terminal (a pseudo-terminal here) ``--push-to-hub`` shows a bar of the shards' bytes uploaded,
    below the output's: all of them by the end, with their rate."""
    from tqdm import tqdm

    dst = tmp_path / "dst"
    rc, text = on_terminal([sys.executable, "-m", "mxfp4conv", "convert", str(src), str(dst), *ARGS,
                            "--push-to-hub", "tiny-org/shown"], env(server, tmp_path))
    assert rc == 0, text
    assert TOKEN not in text
    lines = text.replace("\r", "\n").splitlines()
    size = sum(len(b) for n, b in dst_files(dst).items() if n.endswith(".safetensors"))
    shown = tqdm.format_sizeof(size, divisor=1000)
    done = [ln for ln in lines if ln.lstrip().startswith("uploading: 100%")]
    assert done and f"{shown}/{shown}" in done[-1] and "B/s]" in done[-1], lines
    assert any(ln.lstrip().startswith("converting: 100%") for ln in lines)
    assert server.repos["tiny-org/shown"].refs["main"]


def test_refusals_are_one_line(server: HubServer, src: Path, tmp_path: Path) -> None:
    server.add_repo("tiny-org/public", src)
    dst = tmp_path / "dst"
    res = cli(server, tmp_path, "convert", str(src), str(dst), *ARGS, "--push-to-hub", "tiny-org/public", "--private")
    assert res.returncode == 1 and "the repo exists and is public" in one_line(res)
    assert not server.requests(puts) and not server.requests(lambda r: "/commit/" in r.path)
    # a token the Hub refuses: exit 1, one line, the token not printed (cli() checks)
    res = cli(server, tmp_path, "convert", str(src), str(dst), *ARGS, "--push-to-hub", "tiny-org/denied",
              token=TOKEN[::-1])
    assert res.returncode == 1 and "hf auth login or HF_TOKEN" in one_line(res)
    assert TOKEN[::-1] not in res.stderr and "tiny-org/denied" not in server.repos
    for extra, words in ((("--private",), "--private only apply with --push-to-hub"),
                         (("--push-to-hub", "not a repo"), "is not a repo id"),
                         (("--push-to-hub", "a/b", "--dry-run"), "cannot be combined with --dry-run"),
                         (("--push-to-hub", "a/b", "--push-revision", "0" * 40), "is not a branch name")):
        res = cli(server, tmp_path, "convert", str(src), str(tmp_path / "never"), *extra)
        assert res.returncode == 2 and words in one_line(res), (extra, res.stderr)
    assert not (tmp_path / "never").exists()
