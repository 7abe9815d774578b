"""Claims of the Hub read path that tests elsewhere could not fail on, each made falsifiable here against
the loopback Hub (tests/hub_server.py): partitions of a ``--stream`` fetch only the source files their
own shards read (three files, each partition a strict subset), a token goes to the Hub's
``/resolve/`` requests and never to the CDN host a file's download is redirected to, and --resume
makes again the recorded shards of a source file that was never checked."""

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
from tests.sources.test_hub_remote import cli, env

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


def flip_a_weight_byte(src: Path, dst: Path, name: str) -> None:
    """A copy of ``src`` whose file ``name`` has the lowest bit of one byte in its largest tensor flipped
    (an even byte: of a BF16 value, the low mantissa byte, so the value stays finite)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    data = bytearray((dst / name).read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    begin, end = max((m["data_offsets"] for k, m in header.items() if k != "__metadata__"), key=lambda o: o[1] - o[0])
    data[8 + n + begin + ((end - begin) // 2 & ~1)] ^= 1
    (dst / name).write_bytes(bytes(data))


def test_a_resumed_stream_rebuilds_a_recorded_shard_of_an_unchecked_source(server: HubServer, source: Path,
                                                                            tmp_path: Path) -> None:
    """The staging folder a stopped ``--stream`` run leaves when it had made shards from a source file
    whose bytes then failed (or never reached) the Hub's sha256 check: those shards are recorded (their
    own sha256 is right), the file is not in ``checked``. --resume must make them again from the file
    read and checked anew (every shard made from it, not only the damaged ones), and take the others
    as they are. The recorded shards here are what a corrupted copy of the file converts to, so taking
    them would publish wrong weights."""
    local, damaged = tmp_path / "local", tmp_path / "damaged-out"
    second = "model-00002-of-00003.safetensors"
    flip_a_weight_byte(source, tmp_path / "damaged", second)
    for src, out in ((source, local), (tmp_path / "damaged", damaged)):
        assert CliRunner().invoke(mxfp4conv_cli, ["convert", str(src), str(out), *FLAGS]).exit_code == 0
    bad = sorted(rel for rel, h in files(damaged).items() if rel.endswith(".safetensors") and files(local)[rel] != h)
    assert bad and all(sources_of(local, rel, source) == {second} for rel in bad), bad
    # every shard staged and recorded by a stream run (one partition of one: nothing is published)
    dst = tmp_path / "out"
    staging = tmp_path / ".out.mxfp4conv-staging"
    got = cli(server, tmp_path / "cache", "convert", "org/three", str(dst), *FLAGS, "--stream", "--partition", "0/1")
    assert got.returncode == 0, got.stderr
    (part,) = staging.glob(".mxfp4conv-progress*.json")
    record = json.loads(part.read_text())
    assert second in record["checked"] and all(second in record["shards"][rel]["sources"] for rel in bad), record
    # ... as the stopped run left it: the shards made from the corrupted file recorded, that file unchecked
    for rel in bad:
        (staging / rel).write_bytes((damaged / rel).read_bytes())
        record["shards"][rel]["sha256"] = sha(staging / rel)
    del record["checked"][second]
    part.unlink()
    (staging / ".mxfp4conv-progress.json").write_text(json.dumps(record))
    kept = sorted(rel for rel, rec in record["shards"].items() if second not in rec["sources"])
    assert kept and not set(bad) & set(kept)
    before = {rel: ((staging / rel).stat().st_ino, (staging / rel).stat().st_mtime_ns) for rel in record["shards"]}
    server.clear_log()
    got = cli(server, tmp_path / "cache", "convert", "org/three", str(dst), *FLAGS, "--stream", "--resume", "--json")
    assert got.returncode == 0, got.stderr
    assert files(dst) == files(local)
    after = {rel: ((dst / rel).stat().st_ino, (dst / rel).stat().st_mtime_ns) for rel in before}
    assert sorted(rel for rel in before if before[rel] == after[rel]) == kept
    sizes = {f.name: f.stat().st_size for f in source.glob("*.safetensors")}
    sent = sent_per_file(server, source)
    assert sent[second] >= sizes[second] and all(sent[f] < sizes[f] for f in sizes if f != second), sent
