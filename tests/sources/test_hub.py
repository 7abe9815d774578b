"""SRC given as a Hugging Face repo id resolves through huggingface_hub into a pre-filled local cache (offline)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.builders import build

REV = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache: Path, repo: str, src: Path) -> Path:
    """Lay ``src`` out as huggingface_hub does: blobs/<sha256>, snapshots/<rev>/<file> -> ../../blobs/<sha256>."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(REV)
    snap = repo_dir / "snapshots" / REV
    snap.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        (repo_dir / "blobs" / digest).write_bytes(f.read_bytes())
        os.symlink(Path("..") / ".." / "blobs" / digest, snap / f.name)
    return snap


def run(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache.parent / "hf-home")}
    return subprocess.run([sys.executable, "-m", "mxfp4conv", *args], capture_output=True, text=True, env=env)


def test_inspect_and_convert_a_repo_id_from_the_offline_cache(tmp_path: Path) -> None:
    src = build("gpt-oss", tmp_path / "src", shards=2)
    cache = tmp_path / "hub"
    fill_cache(cache, "tiny-org/tiny-gpt-oss", src)
    res = run(["inspect", "tiny-org/tiny-gpt-oss", "--json"], cache)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["layout"] == "gpt-oss" and doc["problems"] == [] and doc["num_experts"] == 4
    res = run(["convert", "tiny-org/tiny-gpt-oss", str(tmp_path / "out"), "--to", "quark", "--json"], cache)
    assert res.returncode == 0, res.stderr
    manifest = json.loads((tmp_path / "out" / "mxfp4conv.json").read_text())
    assert manifest["source"]["repo_id"] == "tiny-org/tiny-gpt-oss"
    assert manifest["source"]["revision"] == REV  # the pinned snapshot is recorded


def test_unknown_repo_id_offline_is_one_line(tmp_path: Path) -> None:
    res = run(["inspect", "nobody/nothing"], tmp_path / "empty-hub")
    assert res.returncode == 1
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "nobody/nothing" in lines[0] and "Traceback" not in res.stderr
