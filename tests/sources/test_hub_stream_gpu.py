"""``--stream --device cuda`` against the loopback Hub: a GPU converts each MoE layer whole as its bytes
arrive (no expert groups), and the output is the CPU's local conversion, byte for byte."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from mxfp4conv.cli import cli as mxfp4conv_cli
from tests.builders import build
from tests.hub_server import HubServer, hub
from tests.sources.test_hub_remote import cli

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def server() -> Iterator[HubServer]:
    with hub() as h:
        yield h


def _files(root: Path) -> dict[str, str]:
    """Every output file but the manifest and the card, which name the source (a repo, or a folder)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in ("mxfp4conv.json", "README.md")}


@pytest.mark.parametrize("layout", ["modelopt-nvfp4", "ct-nvfp4"])
def test_gpu_stream_converts_whole_layers_into_the_local_output(server: HubServer, tmp_path: Path, layout: str) -> None:
    """Twelve experts over two shards (expert 10 lies before expert 2 in a file): streamed to the GPU, the
    files, the requant statistics and the proof's counts are the CPU's local conversion's; each byte is
    fetched once."""
    src = build(layout, tmp_path / "src", shards=2, hidden=128, inter=64, experts=12)
    repo = f"org/gpu-{layout}"
    server.add_repo(repo, src)
    local = CliRunner().invoke(mxfp4conv_cli, ["convert", str(src), str(tmp_path / "local"), "--to", "ct",
                                               "--device", "cpu", "--json"])
    assert local.exit_code == 0, local.stderr
    got = cli(server, tmp_path / "cache", "convert", repo, str(tmp_path / "streamed"), "--to", "ct", "--device",
              "cuda", "--stream", "--json")
    assert got.returncode == 0, got.stderr
    assert _files(tmp_path / "streamed") == _files(tmp_path / "local")
    doc, want = json.loads(got.stdout), json.loads(local.stdout)
    assert doc["requant_stats"] == want["requant_stats"] and doc["requant_stats"]
    assert doc["verify"]["units"] == want["verify"]["units"] and doc["verify"]["ok"]
    assert doc["compute"]["devices"][0].startswith("cuda")
    assert doc["hub"]["bytes_fetched_again"] == 0
