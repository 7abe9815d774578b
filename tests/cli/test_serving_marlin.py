"""The pure-PyTorch reference loader of docs/serving-marlin.md, on a real converted checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from examples.serving.marlin_ready import MarlinReadyMismatch, load_marlin_ready
from mxfp4conv.cli import cli
from tests.builders import build


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    src = build("gpt-oss", root / "src", layers=1, experts=2, hidden=128, inter=128, shards=1)
    res = CliRunner().invoke(cli, ["convert", str(src), str(root / "dst"), "--to", "marlin", "--tp-size", "2",
                                   "--device", "cpu"])
    assert res.exit_code == 0, res.stderr
    return root / "dst"


def test_maps_onto_vllm_names(converted: Path) -> None:
    params = load_marlin_ready(converted, tp_size=2, tp_rank=1, experts_param_prefix="routed_experts")
    p = "model.layers.0.mlp.experts.routed_experts"
    assert params[f"{p}.w13_weight"].dtype == torch.int32
    # GPT-OSS on vLLM's Marlin backend: Hp = 256, Ip = round_up(128 / 2, 128) = 128
    assert tuple(params[f"{p}.w13_weight"].shape) == (2, 256 // 16, 4 * 128)
    assert tuple(params[f"{p}.w2_weight_scale"].shape) == (2, 128 // 32, 256)
    assert not params[f"{p}.w2_bias"].any()  # rank 1 holds no w2 bias
    assert "model.layers.0.self_attn.q_proj.weight" in params


@pytest.mark.parametrize(("kw", "msg"), [({"tp_size": 4, "tp_rank": 0}, "tp_size"),
                                         ({"tp_size": 2, "tp_rank": 0, "engine": "sglang"}, "engine"),
                                         ({"tp_size": 2, "tp_rank": 2}, "no shards")])
def test_refuses_mismatch(converted: Path, kw: dict[str, object], msg: str) -> None:
    with pytest.raises(MarlinReadyMismatch, match=msg):
        load_marlin_ready(converted, **kw)  # type: ignore[arg-type]
