"""Every source file of a repo id is checked against the Hub's sha256 on every path, not only with
``--stream``: ``convert org/model DST`` downloads into huggingface_hub's cache (which checks sizes, not
digests) and then reads the cached files through the stream's one in-order pass, hashing them as the
conversion reads them (mxfp4conv/sources/hub_cache.py). A loopback Hub (tests/hub_server.py) flips one byte
inside an expert's ``weight_packed`` on the wire while its LFS sha256 stays the true one."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from mxfp4conv.cli import cli as mxfp4conv_cli
from mxfp4conv.files.safetensors import read_header
from tests.builders import build
from tests.hub_server import HubServer, fresh, hub
from tests.sources.test_hub_remote import cli, env

REPO = "org/ct-mxfp4"
SMALL = ("--to", "ct", "--device", "cpu", "--max-shard-size", "200KB")


@pytest.fixture(scope="module")
def server() -> Iterator[HubServer]:
    with hub() as h:
        yield h


@pytest.fixture(scope="module")
def src(server: HubServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build("ct-mxfp4", tmp_path_factory.mktemp("integrity") / "src", shards=3, hidden=128, inter=64,
                   experts=4)
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    server.add_repo(REPO, folder)
    return folder


@pytest.fixture(scope="module")
def local(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The conversion of the local folder: what every path from the Hub must publish, byte for byte."""
    out = tmp_path_factory.mktemp("local") / "out"
    res = CliRunner().invoke(mxfp4conv_cli, ["convert", str(src), str(out), *SMALL])
    assert res.exit_code == 0, res.stderr
    return out


_fresh = pytest.fixture(autouse=True)(fresh)


def shards(src: Path) -> list[Path]:
    return sorted(src.glob("*.safetensors"))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files(folder: Path) -> dict[str, str]:
    """Every output file but the manifest and the card, which name the source (a repo, or a folder)."""
    return {str(p.relative_to(folder)): sha(p) for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name not in ("mxfp4conv.json", "README.md")}


def tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (huggingface_hub's cache: blobs, links, refs) and its bytes' digest."""
    return {str(p.relative_to(folder)): sha(p) if p.is_file() else os.readlink(p)
            for p in sorted(folder.rglob("*")) if p.is_file() or p.is_symlink()}


def corrupt_download(server: HubServer, shard: Path) -> None:
    """One byte flipped inside an expert's FP4 codes in the shard's whole-file download (not a Range read)."""
    blob = sha(shard)
    packed = sorted((t.begin, n) for n, t in read_header(shard)[0].items()
                    if ".experts." in n and n.endswith("weight_packed"))
    assert packed, f"{shard.name} holds no expert's weight_packed"
    server.fault("corrupt", lambda r: r.host == "cdn" and r.method == "GET" and blob in r.path and r.range is None,
                 at=packed[len(packed) // 2][0] + 3)


def error_lines(res: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]


def assert_refused(res: subprocess.CompletedProcess[str], shard: Path, dst: Path, *, recorded_by: str) -> None:
    """Exit 1, one line naming the file, the expected and the computed digest and the fix; nothing published."""
    assert res.returncode == 1, res.stderr
    lines = error_lines(res)
    assert len(lines) == 1 and len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 1, res.stderr
    good = sha(shard)
    line = lines[0]
    assert shard.name in line and f"{recorded_by} records {good}" in line, line
    computed = line.split("have sha256 ")[1].split(",")[0]
    assert len(computed) == 64 and computed != good, line
    assert "hf download" in line and "--force-download" in line and "--stream" in line, line
    assert "Traceback" not in res.stderr
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}.mxfp4conv-staging*"))


def test_a_clean_repo_converts_from_the_cache_checked_with_no_second_read(server: HubServer, src: Path, local: Path,
                                                                           tmp_path: Path) -> None:
    """The download path publishes the local conversion; each shard's sha256 is recorded in --json, and
    the cached files are read once: the bytes read are the files' sizes plus the headers' first ranges."""
    dst = tmp_path / "out"
    res = cli(server, tmp_path / "cache", "convert", REPO, str(dst), *SMALL, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    hub_doc = doc["hub"]
    assert hub_doc["read_from"] == "cache" and hub_doc["checked_against"] == "hub"
    assert hub_doc["files"] == {p.name: sha(p) for p in shards(src)}
    total = sum(p.stat().st_size for p in shards(src))
    headers = sum(min(p.stat().st_size, 64 << 10) for p in shards(src))
    assert total <= hub_doc["bytes_fetched"] <= total + headers, hub_doc
    assert hub_doc["bytes_fetched_again"] == 0
    assert files(dst) == files(local) and doc["verify"]["ok"]
    # the download went through huggingface_hub (whole files from the CDN), once
    assert server.sent(lambda r: r.host == "cdn" and r.range is None) == total


def test_a_corrupted_download_is_refused_and_the_cache_left_as_it_was(server: HubServer, src: Path, local: Path,
                                                                       tmp_path: Path) -> None:
    """The default command, then the same offline: refused both times (the Hub's sha256, then the cache's
    record); the cache is not touched; --stream, as the fix says, converts."""
    shard = shards(src)[1]
    corrupt_download(server, shard)
    cache, dst = tmp_path / "cache", tmp_path / "out"
    res = cli(server, cache, "convert", REPO, str(dst), *SMALL)
    assert_refused(res, shard, dst, recorded_by="the Hub")
    before = tree(cache / "hub")
    assert any(sha(p) != p.name for p in (cache / "hub").rglob("blobs/*") if len(p.name) == 64), "nothing corrupted"
    res = cli(server, cache, "convert", REPO, str(dst), *SMALL)  # the cache is reused: still refused
    assert_refused(res, shard, dst, recorded_by="the Hub")
    offline = subprocess.run([sys.executable, "-m", "mxfp4conv", "convert", REPO, str(dst), *SMALL], text=True,
                             capture_output=True, env={**env(server, cache), "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert_refused(offline, shard, dst, recorded_by="huggingface_hub's cache")
    assert tree(cache / "hub") == before
    res = cli(server, cache, "convert", REPO, str(dst), *SMALL, "--stream")
    assert res.returncode == 0, res.stderr
    assert files(dst) == files(local)


def test_a_cached_file_changed_on_disk_is_refused_offline(server: HubServer, src: Path, local: Path,
                                                          tmp_path: Path) -> None:
    """Downloaded clean, then one byte of a cached blob changed: the offline run checks the file against
    the name huggingface_hub gave its blob (the sha256 the Hub answered with) and refuses it."""
    cache = tmp_path / "cache"
    res = cli(server, cache, "convert", REPO, str(tmp_path / "first"), *SMALL)
    assert res.returncode == 0, res.stderr
    shard = shards(src)[2]
    blob = next((cache / "hub").rglob(f"blobs/{sha(shard)}"))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x10
    blob.write_bytes(bytes(data))
    dst = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "mxfp4conv", "convert", REPO, str(dst), *SMALL], text=True,
                         capture_output=True, env={**env(server, cache), "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert_refused(res, shard, dst, recorded_by="huggingface_hub's cache")
    assert blob.read_bytes() == bytes(data)  # the cache left as it was


def test_a_corrupted_config_is_refused(server: HubServer, src: Path, tmp_path: Path) -> None:
    """config.json decides how every tensor is read: its bytes are checked against its git blob id."""
    server.fault("corrupt", lambda r: r.host == "hub" and r.method == "GET" and r.path.endswith("/config.json"))
    dst = tmp_path / "out"
    res = cli(server, tmp_path / "cache", "convert", REPO, str(dst), *SMALL)
    assert res.returncode == 1, res.stderr
    lines = error_lines(res)
    assert len(lines) == 1 and "config.json" in lines[0] and "git blob id" in lines[0], res.stderr
    assert not dst.exists()


def test_resume_from_the_cache_rebuilds_the_shards_of_a_corrupted_file(server: HubServer, src: Path, local: Path,
                                                                       tmp_path: Path) -> None:
    """--resume on the download path: the stopped run records only shards whose sources were checked;
    once the cached file is downloaded again, the resumed run takes those and rebuilds the rest."""
    shard = shards(src)[2]
    corrupt_download(server, shard)
    cache, dst = tmp_path / "cache", tmp_path / "out"
    res = cli(server, cache, "convert", REPO, str(dst), *SMALL, "--resume")
    assert res.returncode == 1 and shard.name in res.stderr, res.stderr
    progress = tmp_path / ".out.mxfp4conv-staging" / ".mxfp4conv-progress.json"
    record = json.loads(progress.read_text())
    assert shard.name not in record.get("checked", {})
    assert all(shard.name not in rec["sources"] for rec in record["shards"].values()), record
    # the fix: the file downloaded again (what `hf download --force-download` leaves in the cache)
    blob = next((cache / "hub").rglob(f"blobs/{sha(shard)}"))
    blob.write_bytes(shard.read_bytes())
    res = cli(server, cache, "convert", REPO, str(dst), *SMALL, "--resume", "--json")
    assert res.returncode == 0, res.stderr
    assert files(dst) == files(local)
    assert sorted(json.loads(res.stdout)["hub"]["files"]) == [p.name for p in shards(src)]


def test_partitions_from_the_cache_check_their_files_and_finish_refuses_a_corrupted_one(
        server: HubServer, src: Path, local: Path, tmp_path: Path) -> None:
    """--partition I/N on the download path checks the files its shards read; a partition whose file
    was corrupted fails and records nothing of it, so --finish refuses to publish; once that partition
    runs on a good copy, --finish publishes the local conversion."""
    cache, dst = tmp_path / "cache", tmp_path / "out"
    n = 2
    corrupt_download(server, shards(src)[0])
    results = [cli(server, cache, "convert", REPO, str(dst), *SMALL, "--partition", f"{i}/{n}", "--json")
               for i in range(n)]
    failed = [r for r in results if r.returncode != 0]
    assert len(failed) >= 1 and all(shards(src)[0].name in r.stderr for r in failed), [r.stderr for r in results]
    res = cli(server, cache, "convert", REPO, str(dst), *SMALL, "--finish")
    assert res.returncode == 1 and len(error_lines(res)) == 1 and not dst.exists(), res.stderr
    blob = next((cache / "hub").rglob(f"blobs/{sha(shards(src)[0])}"))
    blob.write_bytes(shards(src)[0].read_bytes())
    for i, r in enumerate(results):
        if r.returncode != 0:
            again = cli(server, cache, "convert", REPO, str(dst), *SMALL, "--partition", f"{i}/{n}")
            assert again.returncode == 0, again.stderr
    res = cli(server, cache, "convert", REPO, str(dst), *SMALL, "--finish", "--json")
    assert res.returncode == 0, res.stderr
    assert files(dst) == files(local) and json.loads(res.stdout)["verify"]["ok"]


def test_inspect_of_a_repo_id_names_the_stream(server: HubServer, src: Path, tmp_path: Path) -> None:
    res = cli(server, tmp_path / "cache", "inspect", REPO)
    assert res.returncode == 0, res.stderr
    notes = [ln for ln in res.stderr.splitlines() if "--stream" in ln]
    assert len(notes) == 1 and "without a local copy" in notes[0], res.stderr


def test_ray_tasks_check_the_cached_files_they_read(server: HubServer, src: Path, local: Path, tmp_path: Path) -> None:
    """``--ray`` without --stream, the driver and the workers sharing one huggingface_hub cache (a shared
    filesystem): each task reads the commit the plan was made from out of the cache and checks the files
    its shards read; a corrupted one fails the run in one line with nothing published; downloaded again,
    the run publishes the local conversion."""
    from tests.ray_cluster import ray_head

    cache, dst = tmp_path / "cache", tmp_path / "out"
    shard = shards(src)[1]
    corrupt_download(server, shard)
    with ray_head(env(server, cache)) as address:
        res = cli(server, cache, "convert", REPO, str(dst), *SMALL, "--ray", address)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]  # the whole of stderr, not only its error line
        assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("error:"), res.stderr
        assert shard.name in lines[0] and "records" in lines[0], res.stderr
        assert not dst.exists()
        next((cache / "hub").rglob(f"blobs/{sha(shard)}")).write_bytes(shard.read_bytes())
        res = cli(server, cache, "convert", REPO, str(dst), *SMALL, "--ray", address, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ray"]["tasks"] == 2 and doc["verify"]["ok"] and files(dst) == files(local)
