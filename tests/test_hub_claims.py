"""Claims of the Hub read path that tests elsewhere could not fail on, each made falsifiable here against
the loopback Hub (tests/hub_server.py): partitions of a ``--stream`` fetch only the source files their
own shards read (three files, each partition a strict subset), and a token goes to the Hub's
``/resolve/`` requests and never to the CDN host a file's download is redirected to."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from mxfp4conv.cli import cli as mxfp4conv_cli
from tests.builders import build
from tests.hub_server import HubServer, fresh, hub
from tests.test_hub_remote import cli, env

FLAGS = ("--to", "ct", "--device", "cpu", "--max-shard-size", "200KB")
LAYERS = 3
PARTS = 3


@pytest.fixture(scope="module")
def server() -> Iterator[HubServer]:
    with hub() as h:
        yield h


_fresh = pytest.fixture(autouse=True)(fresh)


def by_partition(flat: Path, dst: Path, partitions: int) -> Path:
    """``flat`` re-saved so that source file p + 1 holds every module that output shards of partition p
    hold (``--partition`` deals output shards round-robin): each partition then reads one source file."""
    plan = dst.parent / "plan"
    assert CliRunner().invoke(mxfp4conv_cli, ["convert", str(flat), str(plan), *FLAGS]).exit_code == 0
    owner: dict[str, int] = {}
    for i, shard in enumerate(sorted(plan.glob("*.safetensors"))):
        with safe_open(str(shard), "pt") as fh:
            for k in fh.keys():  # noqa: SIM118
                owner.setdefault(k.rpartition(".")[0], i % partitions)
    tensors = {}
    for f in sorted(flat.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118
    groups: list[dict[str, object]] = [{} for _ in range(partitions)]
    for name, t in tensors.items():
        groups[owner[name.rpartition(".")[0]]][name] = t
    dst.mkdir(parents=True)
    wmap = {}
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{partitions:05d}.safetensors"
        save_file(g, str(dst / fname), metadata={"format": "pt"})  # type: ignore[arg-type]
        wmap.update(dict.fromkeys(g, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    for f in flat.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())
    (dst / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    return dst


@pytest.fixture(scope="module")
def source(server: HubServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("claims-src")
    flat = build("modelopt-nvfp4", root / "flat", layers=LAYERS, shards=2, hidden=256, inter=128, experts=4)
    src = by_partition(flat, root / "three", PARTS)
    server.add_repo("org/three", src)
    return src


def files(folder: Path) -> dict[str, str]:
    """Every output file but the manifest and the card, which name the source (a repo, or a folder)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in ("mxfp4conv.json", "README.md")}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sent_per_file(server: HubServer, src: Path) -> dict[str, int]:
    """Body bytes the CDN host sent for each source file."""
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        h = sha(f)
        out[f.name] = server.sent(lambda r: r.host == "cdn" and r.method == "GET" and h in r.path)  # noqa: B023
    return out


def sources_of(out: Path, shard: str, src: Path) -> set[str]:
    """The source files holding the tensors of the modules an output shard holds."""
    wmap = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    by_module: dict[str, set[str]] = {}
    for name, f in wmap.items():
        by_module.setdefault(name.rpartition(".")[0], set()).add(f)
    with safe_open(str(out / shard), "pt") as fh:
        modules = {k.rpartition(".")[0] for k in fh.keys()}  # noqa: SIM118
    return set().union(*(by_module[m] for m in modules))


def test_each_partition_streams_only_its_own_source_files(server: HubServer, source: Path, tmp_path: Path) -> None:
    """Three source files, three partitions: each fetches whole exactly the files its shards read (a strict
    subset: one file) and of the others at most their header ranges; together they fetch each file."""
    local = tmp_path / "local"
    assert CliRunner().invoke(mxfp4conv_cli, ["convert", str(source), str(local), *FLAGS]).exit_code == 0
    sizes = {f.name: f.stat().st_size for f in source.glob("*.safetensors")}
    assert len(sizes) == PARTS and min(sizes.values()) > 4 * (64 << 10)  # a whole file is more than its header
    dst = tmp_path / "out"
    staging = tmp_path / ".out.mxfp4conv-staging"
    union: set[str] = set()
    for i in range(PARTS):
        server.clear_log()
        got = cli(server, tmp_path / "cache", "convert", "org/three", str(dst), *FLAGS, "--stream",
                  "--partition", f"{i}/{PARTS}", "--json")
        assert got.returncode == 0, got.stderr
        doc = json.loads(got.stdout)
        mine = set(json.loads((staging / f".mxfp4conv-progress-{i}of{PARTS}.json").read_text())["shards"])
        want = set().union(*(sources_of(local, s, source) for s in mine))
        assert want and want < set(sizes), (i, mine, want)  # a strict subset: the claim can fail
        sent = sent_per_file(server, source)
        whole = {f for f, n in sent.items() if n >= sizes[f]}
        assert whole == want, f"partition {i}/{PARTS} fetched {sent}, its shards read {sorted(want)}"
        assert all(sent[f] <= 2 * (64 << 10) for f in set(sizes) - want), sent
        assert want <= set(doc["hub"]["files"])  # checked against the Hub's sha256 (this run or an earlier one)
        union |= want
    assert union == set(sizes)
    server.clear_log()
    got = cli(server, tmp_path / "cache", "convert", "org/three", str(dst), *FLAGS, "--stream", "--finish", "--json")
    assert got.returncode == 0, got.stderr
    assert files(dst) == files(local)


@pytest.mark.parametrize("how", ["inspect", "stream", "download"])
def test_a_token_goes_to_the_hub_and_never_to_the_cdn(server: HubServer, source: Path, tmp_path: Path,
                                                      how: str) -> None:
    """A private repo read with HF_TOKEN: every /resolve/ and API request carries the token (the private
    repo answers nothing without it), and no request to the CDN host a file is redirected to does."""
    token = "hf_claims_token_0123456789"
    server.write_token = token
    try:
        server.add_repo("org/private-three", source)
        server.repos["org/private-three"].private = True
        args = {"inspect": ("inspect", "org/private-three", "--json"),
                "stream": ("convert", "org/private-three", str(tmp_path / "out"), *FLAGS, "--stream"),
                "download": ("convert", "org/private-three", str(tmp_path / "out"), *FLAGS)}[how]
        e = {**env(server, tmp_path / "cache"), "HF_TOKEN": token}
        got = subprocess.run([sys.executable, "-m", "mxfp4conv", *args], capture_output=True, text=True, env=e,
                             timeout=120)
        assert got.returncode == 0, got.stderr
        resolve = server.requests(lambda r: r.host == "hub" and "/resolve/" in r.path)
        cdn = server.requests(lambda r: r.host == "cdn")
        assert resolve and cdn, "the run read no file through a redirect: nothing to check"
        assert all(r.authorized for r in resolve), [r.path for r in resolve if not r.authorized]
        assert not any(r.authorized for r in cdn), [r.path for r in cdn if r.authorized]
        hub_api = server.requests(lambda r: r.host == "hub")
        assert all(r.authorized for r in hub_api), [r.path for r in hub_api if not r.authorized]
    finally:
        server.write_token = None
