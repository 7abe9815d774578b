"""``convert org/model DST --to gguf`` from a Hub on loopback (tests/hub_server.py): the GGUF embeds the
repo's tokenizer, read through ``Checkpoint.read_extra`` (``RemoteRepo.download``, checked against the
git blob id the Hub lists), on both Hub paths: ``--stream`` (ranges, small files through
``hf_hub_download``) and the default (``snapshot_download``, then checked reads of the cache).

Proven, reading every output with the third-party ``gguf.GGUFReader``:

* the two Hub paths write the same ``model.gguf``, byte for byte;
* each is the local folder's conversion byte for byte but for the provenance the GGUF records by design
  (mxfp4conv/writers/gguf.py ``provenance_kvs``: a repo id source adds ``general.base_model.0.organization``
  and ``general.base_model.0.repo_url``, a folder has none, so the files cannot be identical): every other
  metadata entry's bytes, every tensor info's bytes and the whole tensor data section are the local file's;
* ``general.base_model.0.repo_url`` is ``https://huggingface.co/<org>/<model>`` and ``general.name`` the
  model's name; the tokenizer's tokens are the local conversion's, one per embedding row;
* a tokenizer.json whose bytes on the wire differ from what the Hub lists (one byte flipped, same size,
  so huggingface_hub's own size check passes) is refused on either path: exit 1, one error line naming
  tokenizer.json and its git blob id, no DST and no staging folder.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from gguf import GGUFReader

from mxfp4conv.cli import cli as mxfp4conv_cli
from tests.builders import build
from tests.gguf_runtime.gguf_cases import add_bpe_tokenizer
from tests.hub_server import HubServer, Request, fresh, hub
from tests.test_hub_remote import cli

ORG, MODEL = "org", "tiny-moe"
REPO = f"{ORG}/{MODEL}"
GGUF = ("--to", "gguf", "--device", "cpu")
PROVENANCE = ("general.base_model.0.organization", "general.base_model.0.repo_url")
PATHS = [("stream", ("--stream",)), ("cache", ())]


@pytest.fixture(scope="module")
def server() -> Iterator[HubServer]:
    with hub() as h:
        yield h


@pytest.fixture(scope="module")
def src(server: HubServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny ct-mxfp4 Qwen3-MoE with a byte-level BPE tokenizer, in a folder named as the model."""
    folder = build("ct-mxfp4", tmp_path_factory.mktemp("hub-gguf") / MODEL)
    add_bpe_tokenizer(folder, int(json.loads((folder / "config.json").read_text())["vocab_size"]))
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    server.add_repo(REPO, folder)
    return folder


@pytest.fixture(scope="module")
def local(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The local folder's ``--to gguf`` conversion: its model.gguf."""
    out = tmp_path_factory.mktemp("local") / "out"
    res = CliRunner().invoke(mxfp4conv_cli, ["convert", str(src), str(out), *GGUF])
    assert res.exit_code == 0, res.stderr
    return out / "model.gguf"


@pytest.fixture(scope="module")
def hub_outputs(server: HubServer, src: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``convert org/model DST --to gguf`` with ``--stream`` and through the cache, each in its own cache."""
    root = tmp_path_factory.mktemp("hub-out")
    out = {}
    for name, flags in PATHS:
        res = cli(server, root / f"cache-{name}", "convert", REPO, str(root / name), *GGUF, *flags)
        assert res.returncode == 0, res.stderr
        out[name] = root / name / "model.gguf"
    return out


_fresh = pytest.fixture(autouse=True)(fresh)


def raw(reader: GGUFReader) -> dict[str, bytes]:
    """Each metadata entry's bytes as stored (key, type, value), by key."""
    return {k: b"".join(p.tobytes() for p in f.parts) for k, f in reader.fields.items()}


def tensor_infos(reader: GGUFReader) -> list[bytes]:
    """Each tensor info's bytes as stored (name, dims, type, offset into the data section), in file order."""
    return [b"".join(p.tobytes() for p in t.field.parts) for t in reader.tensors]


def tokens(reader: GGUFReader) -> list[str]:
    got = reader.fields["tokenizer.ggml.tokens"].contents()
    assert isinstance(got, list), type(got)
    return [str(t) for t in got]


def test_the_stream_and_the_cache_write_the_same_gguf(hub_outputs: dict[str, Path]) -> None:
    assert hub_outputs["stream"].read_bytes() == hub_outputs["cache"].read_bytes()


@pytest.mark.parametrize("path", [p for p, _ in PATHS])
def test_a_hub_gguf_is_the_local_one_but_for_its_provenance(hub_outputs: dict[str, Path], local: Path,
                                                            path: str) -> None:
    got, want = GGUFReader(str(hub_outputs[path])), GGUFReader(str(local))
    have, base = raw(got), raw(want)
    assert sorted(set(have) - set(base)) == sorted(PROVENANCE) and not set(base) - set(have)
    assert got.fields["GGUF.kv_count"].contents() == want.fields["GGUF.kv_count"].contents() + len(PROVENANCE)
    common = {k: v for k, v in have.items() if k not in (*PROVENANCE, "GGUF.kv_count")}
    assert common == {k: v for k, v in base.items() if k != "GGUF.kv_count"}
    assert tensor_infos(got) == tensor_infos(want) and len(got.tensors) == len(want.tensors) > 0
    assert got.alignment == want.alignment
    assert hub_outputs[path].read_bytes()[got.data_offset:] == local.read_bytes()[want.data_offset:]


@pytest.mark.parametrize("path", [p for p, _ in PATHS])
def test_a_hub_gguf_names_the_repo_and_embeds_its_tokenizer(hub_outputs: dict[str, Path], local: Path, src: Path,
                                                            path: str) -> None:
    r = GGUFReader(str(hub_outputs[path]))
    assert r.fields["general.base_model.0.repo_url"].contents() == f"https://huggingface.co/{REPO}"
    assert r.fields["general.base_model.0.organization"].contents() == ORG
    assert r.fields["general.name"].contents() == MODEL and r.fields["general.base_model.0.name"].contents() == MODEL
    assert tokens(r) == tokens(GGUFReader(str(local)))
    assert len(tokens(r)) == int(json.loads((src / "config.json").read_text())["vocab_size"])
    assert "general.base_model.0.repo_url" not in GGUFReader(str(local)).fields


def tokenizer_get(r: Request) -> bool:
    """The whole-file GET of tokenizer.json (a small file: answered by /resolve itself, not the CDN)."""
    return r.host == "hub" and r.method == "GET" and r.path.endswith("/tokenizer.json")


@pytest.mark.parametrize(("path", "flags"), PATHS)
def test_a_corrupted_tokenizer_is_refused(server: HubServer, src: Path, tmp_path: Path, path: str,
                                          flags: tuple[str, ...]) -> None:
    fault = server.fault("corrupt", tokenizer_get)
    dst = tmp_path / "out"
    res: subprocess.CompletedProcess[str] = cli(server, tmp_path / "cache", "convert", REPO, str(dst), *GGUF, *flags)
    assert fault.hits == 1, "the fault never fired"
    assert res.returncode == 1, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert "tokenizer.json" in lines[0] and "git blob id" in lines[0] and "the Hub records" in lines[0], lines[0]
    assert "Traceback" not in res.stderr
    assert not dst.exists() and not list(tmp_path.glob(".out.mxfp4conv-staging*"))
