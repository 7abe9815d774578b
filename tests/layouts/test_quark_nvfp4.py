"""mxfp4conv/layouts/quark_nvfp4.py: AMD Quark NVFP4 (``weight_scale_2`` a multiplier, ``input_scale_2``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mxfp4conv.layouts import quark_nvfp4
from mxfp4conv.model.canonical import MoELayer
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests import builders
from tests.layouts.helpers import ALL_SOURCES, Source, detections


@pytest.mark.parametrize("name", ALL_SOURCES)
def test_detect_claims_only_its_own_checkpoints(source: Source, name: str) -> None:
    found = detections(open_checkpoint(source(name)))
    assert ("quark-nvfp4" in found) == (name == "quark-nvfp4"), found
    if name == "quark-nvfp4":
        assert list(found) == ["quark-nvfp4"]  # ModelOpt's weight_scale_2 marker does not claim a Quark config


def test_detect_evidence(source: Source) -> None:
    ev = quark_nvfp4.detect(open_checkpoint(source("quark-nvfp4")))
    assert ev is not None
    assert ev[:2] == ["config.json quantization_config.quant_method = quark",
                      "config.json quantization_config.global_quant_config.weight = fp4 per_group 16"]
    assert len(ev) == 3 and ev[2].endswith(".input_scale_2")


def test_plan(source: Source) -> None:
    plan = quark_nvfp4.plan(open_checkpoint(source("quark-nvfp4")))
    assert plan.problems == []
    f = plan.facts
    assert (f.scheme, f.source_quant, f.num_experts, f.hidden_size, f.intermediate_size) == ("w4a4", "nvfp4", 4, 64, 32)
    assert f.ignore == tuple(builders.QUARK_EXCLUDE)
    moe = [u for u in plan.units if u.kind == "moe"]
    assert [u.dims for u in moe] == [(4, 64, 32), (4, 64, 32)]
    assert len(moe[0].sources) == 4 * 3 * 4  # weight, weight_scale, weight_scale_2, input_scale_2


def _with_global(root: Path, dtype: torch.dtype) -> Path:
    def expert(t: builders.Tensors, module: str, n: int, k: int) -> None:
        t.nvfp4(module, n, k, packed="weight", global_scale="weight_scale_2", divisor=False, input_scale="input_scale_2")
        t[f"{module}.weight_scale_2"] = t[f"{module}.weight_scale_2"].to(dtype)

    q = builders.quark_config(16, w4a4=True, exclude=["lm_head"])
    return builders.moe_checkpoint(root, expert, q, layers=1, shards=1)


def test_a_bf16_global_scale_is_read(tmp_path: Path) -> None:
    src = _with_global(tmp_path / "q", torch.bfloat16)
    ckpt = open_checkpoint(src)
    plan = quark_nvfp4.plan(ckpt)
    assert plan.problems == []
    unit = quark_nvfp4.read(ckpt, next(u for u in plan.units if u.kind == "moe"))
    assert isinstance(unit, MoELayer)
    raw = load_file(str(src / "model.safetensors"))
    w2 = unit.w2
    assert w2.quant == "nvfp4" and w2.global_is_divisor is False  # a multiplier, as ModelOpt's
    assert w2.global_rows is not None and w2.global_rows.dtype == torch.float32
    p = "model.layers.0.mlp.experts"
    for e in range(4):
        assert torch.all(w2.global_rows[e] == raw[f"{p}.{e}.down_proj.weight_scale_2"].float())


def test_a_half_precision_global_scale_is_a_problem(tmp_path: Path) -> None:
    plan = quark_nvfp4.plan(open_checkpoint(_with_global(tmp_path / "q", torch.float16)))
    assert len(plan.problems) == 4 * 3
    p = plan.problems[0]
    assert p.tensor.endswith(".weight_scale_2") and p.message == "global scale must be one F32 or BF16 value, got F16[]"
