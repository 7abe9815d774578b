"""``mxfp4conv.convert`` does what ``mxfp4conv convert`` does, from Python alone (no CLI): it pushes the
verified output to a Hub on loopback (tests/hub_server.py, huggingface_hub's own upload code, in a child
process that has ``HF_ENDPOINT`` from its start) and runs the conversion on a real local Ray cluster."""

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

import mxfp4conv
from mxfp4conv import ConvertOptions, PushOptions, UsageError
from mxfp4conv.publish.ray_runner import RayConvertReport
from tests.builders import build
from tests.hub_server import GITATTRIBUTES, HubServer, fresh, hub
from tests.ray_cluster import ray_head

TOKEN = "hf_apiTOKENmarker0123456789"  # given as PushOptions.token only (no HF_TOKEN): never printed
ROOT = Path(__file__).resolve().parents[2]
OPTIONS: dict[str, Any] = {"target": "ct", "max_shard_size": 30_000, "device": "cpu"}  # 5 output shards
OPTS = ConvertOptions(**OPTIONS)


@pytest.fixture(scope="module")
def server() -> Iterator[HubServer]:
    with hub() as h:
        h.write_token = TOKEN
        yield h


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    with ray_head() as address:
        yield address


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("ct-mxfp4", tmp_path_factory.mktemp("src") / "ct", shards=3)


_fresh = pytest.fixture(autouse=True)(fresh)


def env(server: HubServer, home: Path) -> dict[str, str]:
    """The child's environment: the loopback Hub, and no token of huggingface_hub's own."""
    out = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith(("HF_", "HUGGING"))}
    out.update(HF_ENDPOINT=server.url, HF_HUB_CACHE=str(home / "hub"), HF_HOME=str(home / "home"),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               NO_PROXY="127.0.0.1,localhost", PYTHONPATH=str(ROOT))
    return out


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def tree_hashes(root: Path) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in files(root).items()}


def api(server: HubServer, home: Path, src: Path, dst: Path, *, ray: str | None = None, runs: int = 1,
        **push: Any) -> list[dict[str, Any]]:
    """``mxfp4conv.convert(src, dst, OPTS, push=PushOptions(...), ray=ray)`` ``runs`` times in a child
    process: each run's report and the (done, total) its callbacks were given."""
    script = textwrap.dedent(f"""
        import json
        import mxfp4conv
        from mxfp4conv import ConvertOptions, PushOptions
        out = []
        for _ in range({runs}):
            calls = {{"progress": [], "push": []}}
            report = mxfp4conv.convert({str(src)!r}, {str(dst)!r}, ConvertOptions(**{OPTIONS!r}),
                                       push=PushOptions(token={TOKEN!r}, **{push!r}), ray={ray!r},
                                       on_progress=lambda d, t: calls["progress"].append([d, t]),
                                       on_push=lambda d, t: calls["push"].append([d, t]))
            out.append({{"report": report.to_dict(), "calls": calls}})
        print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env(server, home), timeout=240)
    assert TOKEN not in res.stdout + res.stderr
    assert res.returncode == 0, res.stderr
    runs_out: list[dict[str, Any]] = json.loads(res.stdout)
    return runs_out


def assert_hub_holds(server: HubServer, repo: str, dst: Path, commit: str) -> None:
    """The repo's head is ``commit`` and holds exactly DST's files (and the Hub's own .gitattributes)."""
    assert server.repos[repo].refs["main"] == commit
    held = {name: blob.data for name, blob in server.files(repo).items()}
    assert held.pop(".gitattributes") == GITATTRIBUTES
    assert held == files(dst)


def test_the_api_converts_and_pushes_exactly_the_verified_output(server: HubServer, src: Path,
                                                                 tmp_path: Path) -> None:
    """Pushed with the options' token, the shards uploaded while the conversion runs; run again, DST is
    not converted again and nothing new is committed."""
    dst = tmp_path / "dst"
    first, again = api(server, tmp_path, src, dst, runs=2, repo_id="tiny-org/api", commit_message="from Python")
    doc = first["report"]
    assert doc["status"] == "converted" and doc["verify"]["ok"] and len(doc["shards"]) >= 3
    commit = doc["push"]["commit"]
    assert doc["push"]["repo_id"] == "tiny-org/api" and doc["push"]["files"] == len(files(dst))
    assert_hub_holds(server, "tiny-org/api", dst, commit)
    assert server.repos["tiny-org/api"].messages[commit] == "from Python"
    assert len(server.repos["tiny-org/api"].commits) == 2  # the repo's first, then the one push
    total = sum(s["bytes"] for s in doc["shards"])
    assert first["calls"]["progress"][-2:] == [[total, total], [-1, -1]]
    shard_bytes = sum(len(b) for n, b in files(dst).items() if n.endswith(".safetensors"))
    assert first["calls"]["push"][-2:] == [[shard_bytes, shard_bytes], [-1, -1]]
    # the same call again: DST holds this conversion, so it is pushed as it is (no new commit)
    assert again["report"]["status"] == "skipped" and again["report"]["push"]["commit"] == commit
    assert again["calls"]["progress"] == [] and len(server.repos["tiny-org/api"].commits) == 2


def test_the_api_runs_on_ray_byte_identical_to_a_local_run(ray_address: str, src: Path, tmp_path: Path) -> None:
    local = mxfp4conv.convert(src, tmp_path / "local", OPTS)
    calls: list[tuple[int, int]] = []
    report = mxfp4conv.convert(src, tmp_path / "ray", OPTS, ray=ray_address,
                               on_progress=lambda done, total: calls.append((done, total)))
    assert isinstance(report, RayConvertReport)
    assert report.ray == {"address": ray_address, "tasks": 2, "nodes": 1, "resource": "CPU"}
    assert report.status == local.status == "converted" and report.verify and report.verify["ok"]
    assert report.shards == local.shards and "push" not in report.to_dict()
    total = sum(int(s["bytes"]) for s in report.shards)
    assert calls[0] == (0, total) and calls[-2:] == [(total, total), (-1, -1)]
    assert tree_hashes(tmp_path / "ray") == tree_hashes(tmp_path / "local")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local", "ray"]  # no staging folder left


def test_the_api_runs_on_ray_then_pushes(server: HubServer, ray_address: str, src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    (run,) = api(server, tmp_path, src, dst, ray=ray_address, repo_id="tiny-org/ray", revision="mxfp4")
    doc = run["report"]
    assert doc["status"] == "converted" and doc["ray"]["tasks"] == 2 and doc["push"]["revision"] == "mxfp4"
    assert server.repos["tiny-org/ray"].refs["mxfp4"] == doc["push"]["commit"]
    held = {name: blob.data for name, blob in server.files("tiny-org/ray", "mxfp4").items()}
    assert held.pop(".gitattributes") == GITATTRIBUTES and held == files(dst)
    mxfp4conv.convert(src, tmp_path / "local", OPTS)
    assert tree_hashes(dst) == tree_hashes(tmp_path / "local")


@pytest.mark.parametrize(("push", "opts", "message"), [
    (PushOptions("not a repo"), OPTS, "--push-to-hub 'not a repo' is not a repo id"),
    (PushOptions("org/name"), ConvertOptions(target="ct", dry_run=True), "cannot be combined with --dry-run"),
    (PushOptions("org/name", revision="0" * 40), OPTS, "is not a branch name"),
])
def test_the_api_refuses_push_options_as_the_cli_does(src: Path, tmp_path: Path, push: PushOptions,
                                                     opts: ConvertOptions, message: str) -> None:
    with pytest.raises(UsageError, match=message) as err:
        mxfp4conv.convert(src, tmp_path / "o", opts, push=push)
    assert err.value.exit_code == 2
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing sent
