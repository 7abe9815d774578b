"""``convert org/model DST --stream`` against a Hub on loopback (tests/hub_server.py): the shards are read
by range through the repo's ByteSource (mxfp4conv/files/source.py), never downloaded; the output is the
local conversion's, byte for byte; every shard's sha256 is checked against the Hub's before DST
appears. huggingface_hub's own client runs in a child process (HF_ENDPOINT is read at import)."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from tqdm import tqdm

from mxfp4conv.cli import cli as mxfp4conv_cli
from tests.builders import build
from tests.hub_server import Blob, HubServer, Request, fresh, hub
from tests.ray_cluster import ray_head
from tests.sources.test_hub_remote import cli, env
from tests.terminal import on_terminal

CASES = [("ct-mxfp4", "quark"), ("modelopt-nvfp4", "ct"), ("gpt-oss", "marlin")]


@pytest.fixture(scope="module")
def server() -> Iterator[HubServer]:
    with hub() as h:
        yield h


@pytest.fixture(scope="module")
def repos(server: HubServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stream-src")
    out = {}
    for layout, _ in CASES:
        src = build(layout, root / layout, shards=2, hidden=128, inter=64, experts=4)
        (src / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
        server.add_repo(f"org/{layout}", src)
        out[layout] = src
    return out


_fresh = pytest.fixture(autouse=True)(fresh)  # an empty log and no faults for each test


def files(folder: Path) -> dict[str, str]:
    """Every output file but the manifest and the card, which name the source: a repo and its commit, or a
    folder (tests/run/test_card.py compares the cards of a repo read with and without --stream)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in ("mxfp4conv.json", "README.md")}


def shard_get(r: Request) -> bool:
    return r.host == "cdn" and r.method == "GET"


@pytest.mark.parametrize(("layout", "target"), CASES)
def test_a_streamed_conversion_is_the_local_conversion(server: HubServer, repos: dict[str, Path], tmp_path: Path,
                                                       layout: str, target: str) -> None:
    res = CliRunner().invoke(mxfp4conv_cli, ["convert", str(repos[layout]), str(tmp_path / "local"), "--to", target,
                                             "--device", "cpu"])
    assert res.exit_code == 0, res.stderr
    got = cli(server, tmp_path / "cache", "convert", f"org/{layout}", str(tmp_path / "streamed"), "--to", target,
              "--device", "cpu", "--stream", "--json")
    assert got.returncode == 0, got.stderr
    assert files(tmp_path / "streamed") == files(tmp_path / "local")  # every file, .gitattributes too
    doc = json.loads(got.stdout)
    manifest = json.loads(next((tmp_path / "streamed").rglob("mxfp4conv.json")).read_text())
    local = json.loads(next((tmp_path / "local").rglob("mxfp4conv.json")).read_text())
    assert manifest["source"]["repo_id"] == f"org/{layout}" and manifest["source"]["revision"] == doc["hub"]["commit"]
    assert manifest["fingerprint"] == local["fingerprint"]  # the same source, read remotely or locally
    assert manifest["requant_stats"] == local["requant_stats"]  # float for float, though made in expert groups
    shards = sorted(p.name for p in repos[layout].glob("*.safetensors"))
    assert sorted(doc["hub"]["files"]) == shards
    assert all(doc["hub"]["files"][n] == hashlib.sha256((repos[layout] / n).read_bytes()).hexdigest() for n in shards)
    # no shard was downloaded: every shard request was a range, and nothing of them is in the cache
    assert all(r.range for r in server.requests(shard_get))
    assert not list((tmp_path / "cache").rglob("*.safetensors"))
    # each shard's bytes crossed the wire once, in order, plus its header's first range
    size = sum((repos[layout] / n).stat().st_size for n in shards)
    assert size <= doc["hub"]["bytes_fetched"] <= size + len(shards) * (64 << 10), doc["hub"]
    assert doc["hub"]["bytes_fetched_again"] == 0


@pytest.mark.parametrize(("target", "flags"), [("ct", ()), ("quark", ()), ("ct", ("--no-verify",))])
def test_expert_groups_converted_as_their_bytes_arrive_make_the_local_output(server: HubServer, tmp_path: Path,
                                                                             target: str, flags: tuple[str, ...]) -> None:
    """Twelve experts: the file lists expert 10 before expert 2, so a layer's expert groups are converted
    out of the plan's order, each written at its place; the output, its proof (or none, with
    --no-verify) and its statistics are the local run's."""
    src = build("modelopt-nvfp4", tmp_path / "src", shards=2, hidden=128, inter=64, experts=12)
    server.add_repo("org/twelve", src)
    local = CliRunner().invoke(mxfp4conv_cli, ["convert", str(src), str(tmp_path / "local"), "--to", target,
                                               "--device", "cpu", "--json", *flags])
    assert local.exit_code == 0, local.stderr
    got = cli(server, tmp_path / "cache", "convert", "org/twelve", str(tmp_path / "streamed"), "--to", target,
              "--device", "cpu", "--stream", "--json", *flags)
    assert got.returncode == 0, got.stderr
    assert files(tmp_path / "streamed") == files(tmp_path / "local")
    doc, want = json.loads(got.stdout), json.loads(local.stdout)
    assert doc["requant_stats"] == want["requant_stats"] and doc["requant_stats"]
    if flags:
        assert not doc.get("verify") and not want.get("verify")
    else:
        assert doc["verify"]["units"] == want["verify"]["units"] and doc["verify"]["tensors"] == want["verify"]["tensors"]
    assert doc["hub"]["bytes_fetched_again"] == 0


@pytest.mark.parametrize("where", ["the stream", "the header's first range"])
def test_a_corrupted_byte_is_never_published(server: HubServer, repos: dict[str, Path], tmp_path: Path,
                                             where: str) -> None:
    """One byte of one answer flipped: in the in-order fetch of the (one-block) shard, its sha256 is not
    the Hub's; in the header's range (its middle byte lies in tensor data, so the plan is made), those
    bytes differ from the stream's. Either way one line, exit 1, no DST, even with --no-verify."""
    shard = repos["ct-mxfp4"] / "model-00001-of-00002.safetensors"
    asked = f"bytes=0-{shard.stat().st_size - 1}" if where == "the stream" else f"bytes=0-{(64 << 10) - 1}"
    blob = hashlib.sha256(shard.read_bytes()).hexdigest()  # the CDN serves a blob by its sha256
    fault = server.fault("corrupt", lambda r: shard_get(r) and blob in r.path and r.range == asked)
    got = cli(server, tmp_path / "cache", "convert", "org/ct-mxfp4", str(tmp_path / "out"), "--to", "quark",
              "--device", "cpu", "--stream", "--no-verify")
    assert fault.hits == 1, "the fault never fired"
    assert got.returncode == 1, got.stderr
    lines = [ln for ln in got.stderr.splitlines() if ln.strip()]  # the whole of stderr, not only its error line
    assert len(lines) == 1 and lines[0].startswith("error:"), got.stderr
    assert "corrupted" in lines[0] and shard.name in lines[0], got.stderr
    assert "Traceback" not in got.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.mxfp4conv-staging*"))


def test_reads_recover_from_transient_faults(server: HubServer, repos: dict[str, Path], tmp_path: Path) -> None:
    """On the shards' own ranges (not the header's): a 429 with RateLimit, a 503, a connection dropped
    mid-body, a short 206 body, an expired link (403: resolved again), and the branch moving to another
    commit meanwhile (the run reads the commit it pinned): each recovered, the output the local one."""
    def tensors(r: Request) -> bool:
        return shard_get(r) and r.range is not None and not r.range.endswith("-65535")

    for kind in ("429", "503", "drop", "short", "expire"):
        server.fault(kind, tensors)
    pinned = server.repos["org/modelopt-nvfp4"].refs["main"]
    moved: list[str] = []
    server.fault("call", tensors, call=lambda: moved.append(server.add_repo("org/modelopt-nvfp4", repos["ct-mxfp4"])))
    try:
        got = cli(server, tmp_path / "cache", "convert", "org/modelopt-nvfp4", str(tmp_path / "out"), "--to", "ct",
                  "--device", "cpu", "--stream")
    finally:
        server.repos["org/modelopt-nvfp4"].refs["main"] = pinned
    assert got.returncode == 0, got.stderr
    assert all(f.hits == 1 for f in server.faults), [(f.kind, f.hits) for f in server.faults]
    assert moved and moved[0] != pinned
    res = CliRunner().invoke(mxfp4conv_cli, ["convert", str(repos["modelopt-nvfp4"]), str(tmp_path / "local"),
                                             "--to", "ct", "--device", "cpu"])
    assert res.exit_code == 0
    assert files(tmp_path / "out") == files(tmp_path / "local")


def test_ray_tasks_stream_their_own_shards_at_the_planned_commit(server: HubServer, repos: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    """``--ray --stream`` on a real local Ray cluster whose workers reach the loopback Hub (HF_ENDPOINT in
    the head's environment): each task streams its own shards' source files of the commit the plan was
    made from; the driver's --finish reads no tensor bytes. The output is the local conversion's."""
    src = repos["modelopt-nvfp4"]
    res = CliRunner().invoke(mxfp4conv_cli, ["convert", str(src), str(tmp_path / "local"), *SMALL])
    assert res.exit_code == 0, res.stderr
    with ray_head(env(server, tmp_path / "worker-cache")) as address:
        server.clear_log()
        got = cli(server, tmp_path / "cache", "convert", "org/modelopt-nvfp4", str(tmp_path / "out"), *SMALL,
                  "--stream", "--ray", address, "--json")
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert doc["ray"]["tasks"] == 2 and doc["verify"]["ok"]
    assert files(tmp_path / "out") == files(tmp_path / "local")
    commit = server.repos["org/modelopt-nvfp4"].refs["main"]
    assert all(commit in r.path for r in server.requests(lambda r: "/resolve/" in r.path and r.method == "HEAD"
                                                          and r.path.endswith(".safetensors")))
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert server.sent(shard_get) <= 2 * size + 8 * (64 << 10)  # at most each file once per task, and headers


SMALL = ("--to", "ct", "--device", "cpu", "--max-shard-size", "60KB")  # 8 output shards from 2 source shards


def test_partitions_stream_only_the_files_their_shards_read(server: HubServer, repos: dict[str, Path],
                                                            tmp_path: Path) -> None:
    """Two partitions, each fetching whole only the source files its own shards read, then --finish, which
    reads no tensor bytes: each shard was proven as it was written, from checked sources."""
    src = repos["modelopt-nvfp4"]
    res = CliRunner().invoke(mxfp4conv_cli, ["convert", str(src), str(tmp_path / "local"), *SMALL])
    assert res.exit_code == 0, res.stderr
    dst = tmp_path / "out"
    fetched = []
    for i in range(2):
        server.clear_log()
        got = cli(server, tmp_path / "cache", "convert", "org/modelopt-nvfp4", str(dst), *SMALL, "--stream",
                  "--partition", f"{i}/2", "--json")
        assert got.returncode == 0, got.stderr
        doc = json.loads(got.stdout)
        assert doc["status"] == "partial"
        checked = doc["hub"]["files"]
        assert checked and all(checked[n] == hashlib.sha256((src / n).read_bytes()).hexdigest() for n in checked)
        assert doc["hub"]["bytes_fetched"] <= sum((src / n).stat().st_size for n in checked) + 2 * (64 << 10)
        fetched.append(doc["hub"]["bytes_fetched"])
    server.clear_log()
    got = cli(server, tmp_path / "cache", "convert", "org/modelopt-nvfp4", str(dst), *SMALL, "--stream", "--finish",
              "--json")
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert doc["verify"]["ok"] and doc["verify"]["units"] == sum(s["units"] for s in doc["shards"])
    assert doc["hub"]["bytes_fetched"] <= 2 * (64 << 10)  # the headers the plan is made from, nothing else
    assert files(dst) == files(tmp_path / "local")
    assert len(list((tmp_path / "local").glob("*.safetensors"))) == 8


def test_finish_from_the_hub_refuses_shards_of_unchecked_sources(server: HubServer, repos: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    """Partitions run on a local copy record no checked sources: a --finish --stream of the same
    conversion (same fingerprint) refuses their shards in one line, and publishes nothing."""
    src, dst = repos["modelopt-nvfp4"], tmp_path / "out"
    for i in range(2):
        res = CliRunner().invoke(mxfp4conv_cli, ["convert", str(src), str(dst), *SMALL, "--partition", f"{i}/2"])
        assert res.exit_code == 0, res.stderr
    got = cli(server, tmp_path / "cache", "convert", "org/modelopt-nvfp4", str(dst), *SMALL, "--stream", "--finish")
    lines = [ln for ln in got.stderr.splitlines() if ln.strip()]  # the whole of stderr, not only its error line
    assert got.returncode not in (0, 3) and len(lines) == 1 and lines[0].startswith("error:"), got.stderr
    assert "not checked against the Hub's sha256" in lines[0] and "Traceback" not in got.stderr
    assert not dst.exists()


def test_a_resumed_stream_takes_only_shards_made_from_checked_sources(server: HubServer, repos: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    """A run that stops on a corrupted second source shard keeps (with --resume) the shards it had made
    from the first, whose sha256 was checked; --resume takes those, makes the others again from the
    second file alone, and the result is the local conversion. A shard made from the corrupted file is
    never taken. The second file's answer is held until a shard is recorded, then one byte flipped."""
    src = repos["modelopt-nvfp4"]
    res = CliRunner().invoke(mxfp4conv_cli, ["convert", str(src), str(tmp_path / "local"), *SMALL])
    assert res.exit_code == 0, res.stderr
    second = src / "model-00002-of-00002.safetensors"
    blob = hashlib.sha256(second.read_bytes()).hexdigest()
    progress = tmp_path / ".out.mxfp4conv-staging" / ".mxfp4conv-progress.json"
    original = server.blobs[blob]

    def corrupt_once_a_shard_is_recorded() -> None:
        t = time.monotonic()
        while time.monotonic() - t < 30 and not (progress.exists() and json.loads(progress.read_text())["shards"]):
            time.sleep(0.02)
        data = bytearray(original.data)
        data[len(data) // 2] ^= 1
        server.blobs[blob] = Blob(bytes(data), original.lfs)

    server.fault("call", lambda r: shard_get(r) and blob in r.path and r.range == f"bytes=0-{second.stat().st_size - 1}",
                 call=corrupt_once_a_shard_is_recorded)
    dst = tmp_path / "out"
    try:
        got = cli(server, tmp_path / "cache", "convert", "org/modelopt-nvfp4", str(dst), *SMALL, "--stream", "--resume")
    finally:
        server.blobs[blob] = original
    assert got.returncode == 1, got.stderr
    assert "corrupted" in got.stderr and second.name in got.stderr and not dst.exists()
    record = json.loads(progress.read_text())
    assert second.name not in record.get("checked", {})
    kept = {rel for rel, rec in record["shards"].items() if second.name not in rec["sources"]}
    assert kept, record
    staged = progress.parent
    before = {rel: ((staged / rel).stat().st_ino, (staged / rel).stat().st_mtime_ns) for rel in record["shards"]}
    got = cli(server, tmp_path / "cache", "convert", "org/modelopt-nvfp4", str(dst), *SMALL, "--stream", "--resume",
              "--json")
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert files(dst) == files(tmp_path / "local")
    assert doc["verify"]["ok"] and sorted(doc["hub"]["files"]) == sorted(p.name for p in src.glob("*.safetensors"))
    # the shards of checked sources were taken as they were (the same files), those of the corrupted one made again
    after = {rel: ((dst / rel).stat().st_ino, (dst / rel).stat().st_mtime_ns) for rel in before}
    assert {rel for rel in before if before[rel] == after[rel]} == kept


def test_a_terminal_sees_the_bytes_streamed_their_rate_and_the_time_left(server: HubServer, repos: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """On a terminal (a pseudo-terminal of 120 columns here) ``--stream`` shows a bar of the source's bytes
    beside the output's: done of all, MB/s and the time left."""
    rc, text = on_terminal([sys.executable, "-m", "mxfp4conv", "convert", "org/modelopt-nvfp4", str(tmp_path / "out"),
                            "--to", "ct", "--device", "cpu", "--stream"], env(server, tmp_path / "cache"))
    assert rc == 0, text
    lines = text.replace("\r", "\n").splitlines()
    size = sum(p.stat().st_size for p in repos["modelopt-nvfp4"].glob("*.safetensors"))
    done = [ln for ln in lines if ln.startswith("streaming: 100%")]
    shown = tqdm.format_sizeof(size, divisor=1000)
    assert done and f"{shown}/{shown}" in done[-1], lines
    assert "B/s]" in done[-1] and any(ln.startswith("converting: 100%") for ln in lines)
