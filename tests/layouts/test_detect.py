"""mxfp4conv/layouts/__init__.py: one layout per checkpoint, chosen from evidence; none or several is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mxfp4conv.errors import InputError
from mxfp4conv.layouts import LAYOUTS, detect_layout, get_layout, is_config_evidence
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests import builders
from tests.layouts.helpers import ALL_SOURCES, Source, edit_config

WANT = {"ct-mxfp4": "ct-mxfp4", "ct-mxfp4-mixtral": "ct-mxfp4", "autoround-w4a16": "ct-mxfp4",
        "autoround-w4a4": "ct-mxfp4", "gpt-oss": "gpt-oss", "modelopt-nvfp4": "modelopt-nvfp4", "ct-nvfp4": "ct-nvfp4",
        "quark-mxfp4": "quark-mxfp4", "quark-mxfp4-w4a4": "quark-mxfp4", "quark-nvfp4": "quark-nvfp4",
        "deepseek-v4": "deepseek-v4-mxfp4"}


def test_every_layout_is_registered_in_detection_order() -> None:
    assert list(LAYOUTS) == ["gpt-oss", "modelopt-nvfp4", "quark-nvfp4", "ct-nvfp4", "ct-mxfp4", "quark-mxfp4",
                             "deepseek-v4-mxfp4"]
    assert all(name == get_layout(name).NAME for name in LAYOUTS)
    assert set(WANT) == set(ALL_SOURCES)


@pytest.mark.parametrize("name", ALL_SOURCES)
def test_each_source_is_in_one_layout(source: Source, name: str) -> None:
    ckpt = open_checkpoint(source(name))
    layout, evidence = detect_layout(ckpt)
    assert WANT[name] == layout.NAME
    assert evidence == layout.detect(ckpt)
    assert any(is_config_evidence(e) for e in evidence)  # every builder writes its quantization config


@pytest.mark.parametrize(("item", "want"), [
    ("config.json quantization_config.quant_method = quark", True),
    ("hf_quant_config.json quantization.quant_algo = NVFP4", True),
    ("tensor model.layers.0.mlp.experts.0.up_proj.weight_packed", False),
    ("config.jsonx", False),
])
def test_is_config_evidence(item: str, want: bool) -> None:
    assert is_config_evidence(item) is want


def test_no_fp4_layout_is_refused_with_the_quant_method(tmp_path: Path) -> None:
    cfg: dict[str, Any] = builders.tiny.qwen3_config(1, 2, 64, 32)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    t = builders.Tensors()
    t.fp8_block("model.layers.0.self_attn.o_proj", 64, 64)
    t.bf16("lm_head", 256, 64)
    src = builders.save_checkpoint(tmp_path / "fp8", cfg, t)
    with pytest.raises(InputError, match=r"not an FP4 checkpoint mxfp4conv reads \(quant_method='fp8'\)") as exc:
        detect_layout(open_checkpoint(src))
    assert exc.value.file == str(src / "config.json")
    assert all(name in str(exc.value) for name in LAYOUTS)


def test_a_folder_matching_several_layouts_is_refused(tmp_path: Path) -> None:
    ckpt = edit_config(builders.build("ct-mxfp4", tmp_path / "c", shards=1),
                       lambda c: c.update(quantization_config={"quant_method": "mxfp4"}))
    with pytest.raises(InputError, match="the checkpoint matches several layouts") as exc:
        detect_layout(ckpt)
    msg = str(exc.value)
    assert "gpt-oss: config.json quantization_config.quant_method = mxfp4" in msg
    assert "ct-mxfp4: tensor model.layers." in msg
