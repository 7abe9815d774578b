"""mxfp4conv/layouts/gpt_oss.py: native GPT-OSS MXFP4 (interleaved gate/up rows) and modules_to_not_convert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxfp4conv.errors import InputError
from mxfp4conv.layouts import gpt_oss
from mxfp4conv.model.canonical import MoELayer
from mxfp4conv.model.precision import matches
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests import builders
from tests.layouts.helpers import ALL_SOURCES, Source, detections, edit_config

P = "model.layers.0.mlp.experts"


@pytest.mark.parametrize("name", ALL_SOURCES)
def test_detect_claims_only_its_own_checkpoints(source: Source, name: str) -> None:
    found = detections(open_checkpoint(source(name)))
    assert ("gpt-oss" in found) == (name == "gpt-oss"), found


def test_detect_evidence(source: Source) -> None:
    ev = gpt_oss.detect(open_checkpoint(source("gpt-oss")))
    assert ev is not None
    assert ev[0] == "config.json quantization_config.quant_method = mxfp4"
    assert len(ev) == 2 and ev[1].endswith(".gate_up_proj_blocks")


def test_plan(source: Source) -> None:
    plan = gpt_oss.plan(open_checkpoint(source("gpt-oss")))
    assert plan.problems == []
    f = plan.facts
    assert (f.model_type, f.scheme, f.source_quant, f.activation) == ("gpt_oss", "w4a16", "mxfp4", "swigluoai")
    assert f.expert_names == ("gate_up_proj", "gate_up_proj", "down_proj")
    moe = [u for u in plan.units if u.kind == "moe"]
    assert [(u.key, u.dims, u.has_bias, u.extra) for u in moe] == [
        (f"model.layers.{n}.mlp.experts", (4, 64, 32), True, {"bias_dtype": "BF16"}) for n in range(2)]
    assert moe[0].sources == tuple(f"{P}.{s}" for s in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                                                         "down_proj_blocks", "down_proj_scales", "down_proj_bias"))


def test_interleave_and_deinterleave_are_inverse() -> None:
    x = torch.arange(2 * 6 * 3).reshape(2, 6, 3)
    d = gpt_oss.deinterleave_rows(x)
    assert d[0, :, 0].tolist() == [0, 6, 12, 3, 9, 15]  # rows 0, 2, 4 (gate) then 1, 3, 5 (up)
    assert torch.equal(gpt_oss.interleave_rows(d), x)
    assert torch.equal(gpt_oss.deinterleave_rows(torch.arange(6), dim=0), torch.tensor([0, 2, 4, 1, 3, 5]))


def test_read_deinterleaves_weights_scales_and_biases(source: Source) -> None:
    src = source("gpt-oss")
    ckpt = open_checkpoint(src)
    spec = next(u for u in gpt_oss.plan(ckpt).units if u.kind == "moe" and u.key == P)
    unit = gpt_oss.read(ckpt, spec)
    assert isinstance(unit, MoELayer)
    raw: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        raw.update(load_file(str(f)))
    blocks = raw[f"{P}.gate_up_proj_blocks"].reshape(4, 64, 32)
    assert unit.w13.packed.shape == (4, 64, 32)
    assert torch.equal(unit.w13.packed[:, :32], blocks[:, 0::2]) and torch.equal(unit.w13.packed[:, 32:], blocks[:, 1::2])
    assert torch.equal(unit.w13.scales[:, 5], raw[f"{P}.gate_up_proj_scales"][:, 10])
    assert unit.w13_bias is not None and torch.equal(unit.w13_bias[:, 32], raw[f"{P}.gate_up_proj_bias"][:, 1])
    assert torch.equal(unit.w2.packed, raw[f"{P}.down_proj_blocks"].reshape(4, 64, 16))
    assert unit.w2_bias is not None and torch.equal(unit.w2_bias, raw[f"{P}.down_proj_bias"])


def test_declared_names_cover_their_children(source: Source) -> None:
    d = gpt_oss.declared(open_checkpoint(source("gpt-oss")))
    assert d.unquantized == (r"re:model\.layers\..*\.self_attn(\..*)?$", r"re:model\.layers\..*\.mlp\.router(\..*)?$",
                             r"re:model\.embed_tokens(\..*)?$", r"re:lm_head(\..*)?$")
    assert matches(d.unquantized[0], "model.layers.3.self_attn.q_proj")
    assert not matches(d.unquantized[0], "model.layers.3.mlp.experts")


def test_modules_to_not_convert_must_be_a_list(tmp_path: Path) -> None:
    ckpt = edit_config(builders.build("gpt-oss", tmp_path / "g", shards=1),
                       lambda c: c["quantization_config"].update(modules_to_not_convert="lm_head"))
    with pytest.raises(InputError, match="modules_to_not_convert must be a list of module patterns, got str"):
        gpt_oss.plan(ckpt)


def test_experts_disagreeing_with_config_are_a_problem(tmp_path: Path) -> None:
    def more(cfg: dict[str, Any]) -> None:
        cfg["num_local_experts"] = 8

    plan = gpt_oss.plan(edit_config(builders.build("gpt-oss", tmp_path / "g", shards=1), more))
    assert len(plan.problems) == 2
    assert plan.problems[0].tensor == f"{P}.down_proj_blocks"  # the first name of the layer, sorted
    assert plan.problems[0].message == ("experts [E=4, H=64, I=32] disagree with config.json (num_local_experts=8, "
                                        "hidden_size=64, intermediate_size=32)")
    assert not [u for u in plan.units if u.kind == "moe"]


@pytest.mark.parametrize(("tensor", "change", "message"), [
    ("down_proj_bias", lambda t: t[:, :-1].contiguous(), "has shape [4, 63], expected [4, 64]"),
    ("gate_up_proj_scales", lambda t: t.view(torch.int8), "has dtype I8, expected U8"),
    ("down_proj_bias", lambda t: t.float(), "expert biases must share one float dtype (BF16)"),
])
def test_inconsistent_parts_are_a_problem(tmp_path: Path, tensor: str, change: Any, message: str) -> None:
    src = builders.build("gpt-oss", tmp_path / "g", shards=1, layers=1)
    t = load_file(str(src / "model.safetensors"))
    t[f"{P}.{tensor}"] = change(t[f"{P}.{tensor}"])
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    plan = gpt_oss.plan(open_checkpoint(src))
    assert len(plan.problems) == 1 and message in plan.problems[0].message, plan.problems


def test_a_missing_part_is_named(tmp_path: Path) -> None:
    src = builders.build("gpt-oss", tmp_path / "g", shards=1, layers=1)
    t = load_file(str(src / "model.safetensors"))
    del t[f"{P}.down_proj_scales"]
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    plan = gpt_oss.plan(open_checkpoint(src))
    assert [(p.tensor, p.message) for p in plan.problems] == [
        (f"{P}.down_proj_scales", f"missing partner tensor of {P}.down_proj_blocks")]
