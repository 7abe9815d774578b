"""``--to gguf`` on every replica of a published family (tests/replicas), each given a byte-level BPE
tokenizer: the families llama.cpp has the architecture for convert and ``verify`` proves the output again;
the others are refused at planning in one line that names the layer or architecture (exit 1, nothing left).
llama.cpp itself runs the outputs of the converting families in tests/gguf_runtime."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from mxfp4conv.cli import cli
from mxfp4conv.errors import EXIT_INVALID, EXIT_OK
from tests.gguf_runtime.gguf_cases import add_bpe_tokenizer
from tests.replicas import BUILDERS

CONVERTS = "converts"
# family -> CONVERTS, or what its one-line refusal names
EXPECTED = {
    "modelopt-nvfp4-deepseek-r1": CONVERTS,
    "modelopt-mixed-deepseek_v3": "model.layers.0.self_attn.kv_a_proj_with_mqa: fp8-tensor",
    "modelopt-mixed-kimi_k2": "model.layers.0.mlp.down_proj: fp8-block",
    "modelopt-mixed-deepseek_v32": "not 'deepseek_v32'",
    "modelopt-nvfp4-deepseek-v4": "not 'deepseek_v4'",
    "modelopt-nvfp4-deepseek-v4-two-configs": "not 'deepseek_v4'",
    "deepseek-v4-native-mxfp4": "not 'deepseek_v4'",
    "ct-nvfp4-qwen3-next": CONVERTS,
    "ct-nvfp4-qwen3-vl-moe": CONVERTS,
    "ct-nvfp4-llama4": CONVERTS,
    "ct-nvfp4-glm45": CONVERTS,
    "ct-mixed-nvfp4-fp8block-deepseek-r1": "model.layers.0.self_attn.kv_b_proj: fp8-block",
    "quark-mxfp4-deepseek-r1": CONVERTS,
    "quark-nvfp4-deepseek-r1": CONVERTS,
    "autoround-mxfp4-qwen3-moe": CONVERTS,
    "modelopt-nvfp4-qwen3-moe": CONVERTS,
    "modelopt-nvfp4-minimax-m2": CONVERTS,
    "modelopt-nvfp4-qwen35-moe": CONVERTS,
    "llmcompressor-mxfp4-granitemoe": CONVERTS,
}


def test_every_family_has_an_expected_outcome() -> None:
    assert sorted(EXPECTED) == sorted(BUILDERS)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("gguf-families")

    def build(family: str) -> Path:
        path = BUILDERS[family](root / family).path
        cfg = json.loads((path / "config.json").read_text())
        add_bpe_tokenizer(path, int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]))
        return path

    return build


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_family(source: Callable[[str], Path], tmp_path: Path, family: str) -> None:
    src, dst = source(family), tmp_path / "out" / "dst"
    dst.parent.mkdir()
    res = CliRunner().invoke(cli, ["convert", str(src), str(dst), "--to", "gguf", "--device", "cpu"])
    want = EXPECTED[family]
    if want == CONVERTS:
        assert res.exit_code == EXIT_OK, res.stderr
        again = CliRunner().invoke(cli, ["verify", str(src), str(dst)])
        assert again.exit_code == EXIT_OK, again.stderr
        assert sorted(p.name for p in dst.glob("*.gguf")) == ["model.gguf"]
        return
    msg = res.stderr.strip()
    assert res.exit_code == EXIT_INVALID and "\n" not in msg and want in msg and "to gguf" in msg, (res.exit_code, msg)
    assert list(dst.parent.iterdir()) == [], "a refusal left files behind"
