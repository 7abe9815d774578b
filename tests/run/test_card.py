"""DST/README.md is the output's own model card (mxfp4conv/run/card.py): metadata read back with
huggingface_hub's ``ModelCard.load``, from a repo id on a loopback Hub (tests/hub_server.py; its client
in a child process, HF_ENDPOINT read at import) and from local folders; the source's card kept under
its own heading, never published as the output's; the card in the pushed commit."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from huggingface_hub import ModelCard

from mxfp4conv.cli import cli as mxfp4conv_cli
from mxfp4conv.errors import UsageError
from mxfp4conv.proof.manifest import MANIFEST
from mxfp4conv.run.card import ORIGINAL_HEADING, SourceCard, base_model_of, read_source_card, requant_summary
from mxfp4conv.run.pipeline import ConvertOptions, convert
from tests.builders import build
from tests.hub_server import HubServer, Request, fresh, hub
from tests.publish.test_push import TOKEN, cli

SOURCE_CARD = """---
license: other
license_name: nvidia-open-model-license
license_link: https://example.com/nvidia-open-model-license
base_model: deepseek-ai/DeepSeek-R1
pipeline_tag: text-generation
language:
- en
tags:
- nvfp4
- modelopt
---

# DeepSeek-R1-NVFP4

The source release's own words: quantized by NVIDIA with ModelOpt, for TensorRT-LLM.
"""
TEXT = "The source release's own words: quantized by NVIDIA with ModelOpt, for TensorRT-LLM."


@pytest.fixture(scope="module")
def server() -> Iterator[HubServer]:
    with hub() as h:
        h.write_token = TOKEN
        yield h


@pytest.fixture(scope="module")
def carded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An NVFP4 source with a card of its own (a license, its own base_model, a pipeline tag)."""
    src = build("modelopt-nvfp4", tmp_path_factory.mktemp("carded") / "R1-NVFP4", shards=2, hidden=128, inter=64,
                experts=4)
    (src / "README.md").write_text(SOURCE_CARD)
    return src


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MXFP4 source without a card."""
    return build("ct-mxfp4", tmp_path_factory.mktemp("bare") / "qwen", shards=1, hidden=128, inter=64, experts=4)


_fresh = pytest.fixture(autouse=True)(fresh)  # an empty log and no faults for each test


def run(*args: str) -> dict[str, object]:
    res = CliRunner().invoke(mxfp4conv_cli, [*args, "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.stderr
    doc: dict[str, object] = json.loads(res.stdout)
    return doc


def test_a_repo_id_source_names_itself_the_base_model(server: HubServer, carded: Path, tmp_path: Path) -> None:
    commit = server.add_repo("nvidia-like/R1-NVFP4", carded)
    got = cli(server, tmp_path, "convert", "nvidia-like/R1-NVFP4", str(tmp_path / "out"), "--to", "ct", "--device",
              "cpu")
    assert got.returncode == 0, got.stderr
    card = ModelCard.load(tmp_path / "out" / "README.md")
    data = card.data.to_dict()
    # the repo read, not the source card's own base model; the license as the source has it
    assert data["base_model"] == "nvidia-like/R1-NVFP4" and data["base_model_relation"] == "quantized"
    assert (data["license"], data["license_name"], data["license_link"]) == (
        "other", "nvidia-open-model-license", "https://example.com/nvidia-open-model-license")
    assert data["pipeline_tag"] == "text-generation" and data["language"] == ["en"]
    assert data["library_name"] == "transformers"
    assert data["tags"] == ["compressed-tensors", "mxfp4", "vllm", "sglang", "mxfp4conv"]  # not the source's tags
    assert f"at commit `{commit}`" in card.text and "mxfp4conv convert nvidia-like/R1-NVFP4 DST --to ct" in card.text
    before, after = card.text.split(ORIGINAL_HEADING)
    assert TEXT in after and TEXT not in before  # the source's words only under the original card's heading
    assert "--scale-rule mse" in before and "worst" in before and "vllm serve DST" in before
    written = (tmp_path / "out" / "README.md").read_bytes()
    assert written != SOURCE_CARD.encode()
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["source"]["repo_id"] == "nvidia-like/R1-NVFP4"
    assert "README.md" in manifest["outputs"] and "README.md" in manifest["fingerprint"]["source"]
    # read by range (--stream), the same repo makes the same card
    got = cli(server, tmp_path, "convert", "nvidia-like/R1-NVFP4", str(tmp_path / "streamed"), "--to", "ct",
              "--device", "cpu", "--stream")
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "streamed" / "README.md").read_bytes() == written


def test_a_local_source_takes_its_cards_base_model_and_no_license_is_invented(carded: Path, bare: Path,
                                                                              tmp_path: Path) -> None:
    run("convert", str(carded), str(tmp_path / "carded"), "--to", "quark")
    data = ModelCard.load(tmp_path / "carded" / "README.md").data.to_dict()
    assert data["base_model"] == "deepseek-ai/DeepSeek-R1" and data["license"] == "other"
    assert data["tags"] == ["quark", "mxfp4", "vllm", "sglang", "mxfp4conv"]

    run("convert", str(bare), str(tmp_path / "bare"), "--to", "ct")
    card = ModelCard.load(tmp_path / "bare" / "README.md")
    data = card.data.to_dict()
    assert "base_model" not in data and "base_model_relation" not in data and "license" not in data
    assert "the local folder `qwen`" in card.text and "## Requantization" not in card.text  # MXFP4: kept as it is
    assert card.text.split(ORIGINAL_HEADING)[1].strip().endswith("The source release has no model card.")


def test_base_model_named_through_the_api_makes_the_output_not_current(bare: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    opts = ConvertOptions(target="ct", base_model="Qwen/Qwen3-30B-A3B")
    convert(bare, dst, opts)
    data = ModelCard.load(dst / "README.md").data.to_dict()
    assert data["base_model"] == "Qwen/Qwen3-30B-A3B" and data["base_model_relation"] == "quantized"
    assert "--base-model Qwen/Qwen3-30B-A3B" in (dst / "README.md").read_text()
    first = (dst / "README.md").read_bytes()
    again = dataclasses.replace(opts, skip_if_current=True)
    assert convert(bare, dst, again).status == "skipped"
    # another base model changes the card: the output is not current, and is written again
    assert convert(bare, dst, dataclasses.replace(again, base_model="Qwen/Other")).status == "converted"
    assert ModelCard.load(dst / "README.md").data.to_dict()["base_model"] == "Qwen/Other"
    convert(bare, dst, dataclasses.replace(opts, overwrite=True))
    assert (dst / "README.md").read_bytes() == first  # the same conversion, the same bytes: no time in it
    with pytest.raises(UsageError, match="ORG/NAME"):
        convert(bare, tmp_path / "bad", dataclasses.replace(opts, base_model="not a repo"))


def test_an_earlier_conversion_names_the_repo_it_was_made_from() -> None:
    earlier = {"source": {"repo_id": "openai/gpt-oss-20b"}}
    assert base_model_of(None, None, SourceCard(), earlier) == "openai/gpt-oss-20b"
    assert base_model_of(None, None, SourceCard(base_model="a/b"), earlier) == "a/b"
    assert base_model_of("c/d", "e/f", SourceCard(), earlier) == "c/d"
    assert base_model_of(None, None, SourceCard(), {"source": {"repo_id": None}}) is None
    card = read_source_card("---\nlicense: [unclosed\n---\n# text\n")  # metadata that does not parse: text kept
    assert card.metadata == {} and "# text" in (card.text or "")


def test_the_terminal_shows_a_summary_and_json_every_tensor(carded: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(mxfp4conv_cli, ["convert", str(carded), str(tmp_path / "o"), "--to", "ct", "--device",
                                             "cpu"])
    assert res.exit_code == 0, res.stderr
    lines = [x for x in res.stderr.splitlines() if "SQNR" in x]
    assert len(lines) == 1 and "worst" in lines[0] and "median" in lines[0] and "clipped any block" in lines[0]
    stats = json.loads((tmp_path / "o" / MANIFEST).read_text())["requant_stats"]
    summary = requant_summary(stats)
    assert summary is not None and summary.tensors == len(stats) == 4
    assert all(name in (tmp_path / "o" / "README.md").read_text() for name in stats)  # every tensor in the card


def commits(r: Request) -> bool:
    return "/commit/" in r.path


def test_the_pushed_commit_holds_the_card(server: HubServer, carded: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    args = ("convert", str(carded), str(dst), "--to", "ct", "--device", "cpu", "--push-to-hub", "tiny-org/carded",
            "--json")
    res = cli(server, tmp_path, *args)
    assert res.returncode == 0, res.stderr
    pushed = server.files("tiny-org/carded")["README.md"].data
    assert pushed == (dst / "README.md").read_bytes() and pushed != SOURCE_CARD.encode()
    assert b"base_model_relation: quantized" in pushed
    server.clear_log()  # the same command again: the same content, nothing sent, no commit
    res = cli(server, tmp_path, *args)
    assert res.returncode == 0, res.stderr
    assert not server.requests(lambda r: r.method == "PUT") and not server.requests(commits)


def test_partitions_finish_with_the_card_and_verify_takes_it(carded: Path, tmp_path: Path) -> None:
    """--partition writes no card (the statistics are not all in yet); --finish writes the one a single run
    writes, lists it among the outputs, and verify proves that output."""
    dst, whole = tmp_path / "parts", tmp_path / "whole"
    args = ("--to", "ct", "--max-shard-size", "150KB")
    run("convert", str(carded), str(whole), *args)
    for i in range(2):
        assert run("convert", str(carded), str(dst), *args, "--partition", f"{i}/2")["status"] == "partial"
    run("convert", str(carded), str(dst), *args, "--finish")
    assert (dst / "README.md").read_bytes() == (whole / "README.md").read_bytes()
    manifest = json.loads((dst / MANIFEST).read_text())
    assert len([n for n in manifest["outputs"] if n.endswith(".safetensors")]) >= 2 and "README.md" in manifest["outputs"]
    res = CliRunner().invoke(mxfp4conv_cli, ["verify", str(carded), str(dst), "--device", "cpu"])
    assert res.exit_code == 0, res.stderr
