"""mxfp4conv/layouts/ct_nvfp4.py (+ ct_common.py): compressed-tensors NVFP4 and what its config declares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxfp4conv.errors import InputError
from mxfp4conv.layouts import ct_nvfp4
from mxfp4conv.model.canonical import MoELayer
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests import builders
from tests.layouts.helpers import ALL_SOURCES, Source, detections, edit_config


@pytest.mark.parametrize("name", ALL_SOURCES)
def test_detect_claims_only_its_own_checkpoints(source: Source, name: str) -> None:
    found = detections(open_checkpoint(source(name)))
    assert ("ct-nvfp4" in found) == (name == "ct-nvfp4"), found


def test_detect_evidence(source: Source) -> None:
    ev = ct_nvfp4.detect(open_checkpoint(source("ct-nvfp4")))
    assert ev is not None
    assert ev[:2] == ["config.json quantization_config.quant_method = compressed-tensors",
                      "config.json quantization_config.format = nvfp4-pack-quantized"]
    assert len(ev) == 3 and ev[2].endswith(".weight_global_scale")


def test_plan(source: Source) -> None:
    plan = ct_nvfp4.plan(open_checkpoint(source("ct-nvfp4")))
    assert plan.problems == []
    f = plan.facts
    assert (f.scheme, f.source_quant, f.num_experts, f.hidden_size, f.intermediate_size) == ("w4a16", "nvfp4", 4, 64, 32)
    moe = [u for u in plan.units if u.kind == "moe"]
    assert [u.dims for u in moe] == [(4, 64, 32), (4, 64, 32)]
    assert len(moe[0].sources) == 4 * 3 * 3  # packed, block scale, global scale


def test_w4a4_when_an_fp4_group_quantizes_inputs(tmp_path: Path) -> None:
    def w4a4(cfg: dict[str, Any]) -> None:
        cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 4, "type": "float"}

    ckpt = edit_config(builders.build("ct-nvfp4", tmp_path / "c", shards=1), w4a4)
    assert ct_nvfp4.plan(ckpt).facts.scheme == "w4a4"


def test_read_keeps_the_global_scale_as_a_divisor_per_row(source: Source) -> None:
    src = source("ct-nvfp4")
    ckpt = open_checkpoint(src)
    spec = next(u for u in ct_nvfp4.plan(ckpt).units if u.kind == "moe")
    unit = ct_nvfp4.read(ckpt, spec)
    assert isinstance(unit, MoELayer)
    raw: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        raw.update(load_file(str(f)))
    w13 = unit.w13
    assert w13.quant == "nvfp4" and w13.global_is_divisor is True
    assert w13.scales.dtype == torch.float8_e4m3fn and w13.scales.shape == (4, 64, 4)
    assert w13.global_rows is not None and w13.global_rows.shape == (4, 64)
    p = spec.key
    for e in range(4):
        gate = raw[f"{p}.{e}.gate_proj.weight_global_scale"].item()
        up = raw[f"{p}.{e}.up_proj.weight_global_scale"].item()
        assert torch.all(w13.global_rows[e, :32] == gate) and torch.all(w13.global_rows[e, 32:] == up)


def test_a_nan_block_scale_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    src = builders.build("ct-nvfp4", tmp_path / "c", shards=1, layers=1)
    name = "model.layers.0.mlp.experts.2.down_proj.weight_scale"
    t = load_file(str(src / "model.safetensors"))
    scale = t[name].view(torch.uint8).clone()
    scale[3, 1] = 0x7F
    t[name] = scale.view(torch.float8_e4m3fn)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    ckpt = open_checkpoint(src)
    spec = next(u for u in ct_nvfp4.plan(ckpt).units if u.kind == "moe")
    with pytest.raises(InputError, match=r"E4M3 block scale is NaN at index \(3, 1\)") as exc:
        ct_nvfp4.read(ckpt, spec)
    assert exc.value.tensor == name
