"""``convert org/model DST --stream`` against a Hub on loopback (tests/hub_server.py): the shards are read
by range through the repo's ByteSource (mxfp4conv/io/source.py), never downloaded; the output is the
local conversion's, byte for byte; every shard's sha256 is checked against the Hub's before DST
appears. huggingface_hub's own client runs in a child process (HF_ENDPOINT is read at import)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from tqdm import tqdm

from mxfp4conv.cli import cli as mxfp4conv_cli
from tests.builders import build
from tests.hub_server import HubServer, Request, fresh, hub
from tests.test_hub_remote import cli, env

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
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "mxfp4conv.json"}


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
    lines = [ln for ln in got.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "corrupted" in lines[0] and shard.name in lines[0], got.stderr
    assert "Traceback" not in got.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.mxfp4conv-staging*"))


def test_reads_recover_from_transient_faults(server: HubServer, repos: dict[str, Path], tmp_path: Path) -> None:
    for kind in ("503", "drop", "short"):
        server.fault(kind, lambda r: shard_get(r) and r.range is not None and not r.range.endswith("-65535"))
    got = cli(server, tmp_path / "cache", "convert", "org/modelopt-nvfp4", str(tmp_path / "out"), "--to", "ct",
              "--device", "cpu", "--stream")
    assert got.returncode == 0, got.stderr
    assert all(f.hits == 1 for f in server.faults), [(f.kind, f.hits) for f in server.faults]
    res = CliRunner().invoke(mxfp4conv_cli, ["convert", str(repos["modelopt-nvfp4"]), str(tmp_path / "local"),
                                             "--to", "ct", "--device", "cpu"])
    assert res.exit_code == 0
    assert files(tmp_path / "out") == files(tmp_path / "local")


@pytest.mark.parametrize("extra", [["--partition", "0/2"], ["--finish"], ["--ray", "127.0.0.1:1"]])
def test_stream_refuses_what_it_cannot_check_yet(tmp_path: Path, extra: list[str]) -> None:
    """Partitions would each check only the ranges they read: refused before any work, exit 2."""
    res = CliRunner().invoke(mxfp4conv_cli, ["convert", "org/model", str(tmp_path / "out"), "--stream", *extra])
    assert res.exit_code == 2, res.output
    assert "--stream" in res.stderr and not (tmp_path / "out").exists()


def test_a_terminal_sees_the_bytes_streamed_their_rate_and_the_time_left(server: HubServer, repos: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """On a terminal (a pseudo-terminal of 120 columns here) ``--stream`` shows a bar of the source's bytes
    beside the output's: done of all, MB/s and the time left."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "mxfp4conv", "convert", "org/modelopt-nvfp4", str(tmp_path / "out"),
                             "--to", "ct", "--device", "cpu", "--stream"], env=env(server, tmp_path / "cache"),
                            stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, out.decode(errors="replace")
    lines = out.decode(errors="replace").replace("\r", "\n").splitlines()
    size = sum(p.stat().st_size for p in repos["modelopt-nvfp4"].glob("*.safetensors"))
    done = [ln for ln in lines if ln.startswith("streaming: 100%")]
    shown = tqdm.format_sizeof(size, divisor=1000)
    assert done and f"{shown}/{shown}" in done[-1], lines
    assert "B/s]" in done[-1] and any(ln.startswith("converting: 100%") for ln in lines)
