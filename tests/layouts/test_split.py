"""mxfp4conv/layouts/split.py: grouping split-expert tensors into units, the problems found from headers, and the
checks made while reading."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mxfp4conv.errors import InputError
from mxfp4conv.layouts import ct_mxfp4, ct_nvfp4
from mxfp4conv.layouts.base import Plan
from mxfp4conv.model.canonical import DenseFP4
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests import builders

CT_MX = builders.tiny._ct_qconfig("mxfp4-pack-quantized", ["lm_head"])
E = "model.layers.0.mlp.experts"


def _mx(t: builders.Tensors, module: str, n: int, k: int) -> None:
    t.mxfp4(module, n, k)


def _plan(tmp_path: Path, extra: Callable[[builders.Tensors], None], **kw: Any) -> Plan:
    src = builders.moe_checkpoint(tmp_path / "m", _mx, CT_MX, layers=1, shards=1, extra=extra, **kw)
    return ct_mxfp4.plan(open_checkpoint(src))


def _messages(plan: Plan) -> list[tuple[str, str]]:
    return [(p.tensor, p.message) for p in plan.problems]


def test_an_expert_id_that_is_not_a_plain_number(tmp_path: Path) -> None:
    def zero_padded(t: builders.Tensors) -> None:
        for s in ("weight_packed", "weight_scale"):
            t[f"{E}.01.up_proj.{s}"] = t[f"{E}.1.up_proj.{s}"].clone()

    plan = _plan(tmp_path, zero_padded)
    assert _messages(plan) == [(f"{E}.01.up_proj.weight_packed", "expert id '01' is not a plain decimal number")]


def test_a_second_projection_for_one_role(tmp_path: Path) -> None:
    def both(t: builders.Tensors) -> None:
        t.mxfp4(f"{E}.2.w1", 32, 64)

    plan = _plan(tmp_path, both)
    assert _messages(plan) == [(f"{E}.2.w1.weight_packed", f"expert 2 has a second gate projection (also {E}.2.gate_proj)")]


def test_an_expert_beyond_num_experts(tmp_path: Path) -> None:
    def fifth(t: builders.Tensors) -> None:
        for p, (n, k) in {"gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32)}.items():
            t.mxfp4(f"{E}.4.{p}", n, k)

    plan = _plan(tmp_path, fifth)
    assert _messages(plan) == [(f"{E}.4", "expert id 4 is beyond num_experts=4 (experts must be 0..3, found 5)")]


def test_a_missing_projection(tmp_path: Path) -> None:
    def drop(t: builders.Tensors) -> None:
        del t[f"{E}.3.down_proj.weight_packed"], t[f"{E}.3.down_proj.weight_scale"]

    assert _messages(_plan(tmp_path, drop)) == [(f"{E}.3.down", "expert 3 has no down projection")]


def test_biases_on_some_experts_only(tmp_path: Path) -> None:
    def bias(t: builders.Tensors) -> None:
        t[f"{E}.2.up_proj.bias"] = torch.zeros(32, dtype=torch.bfloat16)

    problems = _messages(_plan(tmp_path, bias))
    assert problems and all(m == "some expert projections have a bias and some do not" for _, m in problems)


def test_an_expert_of_the_wrong_size(tmp_path: Path) -> None:
    def wide(t: builders.Tensors) -> None:
        t.mxfp4(f"{E}.1.gate_proj", 64, 64)

    assert _messages(_plan(tmp_path, wide)) == [(f"{E}.1.gate_proj.weight_packed", "has 64 output rows, expected 32")]


def test_a_dense_fp4_module_with_a_bias(tmp_path: Path) -> None:
    o = "model.layers.0.self_attn.o_proj"

    def dense(t: builders.Tensors) -> None:
        del t[f"{o}.weight"]
        t.mxfp4(o, 64, 64)
        t[f"{o}.bias"] = torch.arange(64, dtype=torch.float32)

    src = builders.moe_checkpoint(tmp_path / "m", _mx, CT_MX, layers=1, shards=1, extra=dense)
    ckpt = open_checkpoint(src)
    plan = ct_mxfp4.plan(ckpt)
    assert plan.problems == []
    (spec,) = [u for u in plan.units if u.kind == "dense"]
    assert (spec.key, spec.dims, spec.has_bias, spec.extra) == (o, (64, 64), True, {"bias_dtype": "F32"})
    assert spec.sources == (f"{o}.weight_packed", f"{o}.weight_scale", f"{o}.bias")
    unit = ct_mxfp4.read(ckpt, spec)
    assert isinstance(unit, DenseFP4) and unit.bias is not None
    assert torch.equal(unit.bias, torch.arange(64, dtype=torch.float32))
    assert unit.weight.packed.shape == (64, 32) and unit.weight.scales.shape == (64, 2)


@pytest.mark.parametrize("value", [0.0, float("inf"), float("nan")])
def test_a_global_scale_must_be_finite_and_non_zero(tmp_path: Path, value: float) -> None:
    name = f"{E}.1.down_proj.weight_global_scale"

    def expert(t: builders.Tensors, module: str, n: int, k: int) -> None:
        t.nvfp4(module, n, k, packed="weight_packed", global_scale="weight_global_scale", divisor=True, input_scale=None)

    def bad(t: builders.Tensors) -> None:
        t[name] = torch.tensor([value])

    q = builders.tiny._ct_qconfig("nvfp4-pack-quantized", ["lm_head"])
    ckpt = open_checkpoint(builders.moe_checkpoint(tmp_path / "n", expert, q, layers=1, shards=1, extra=bad))
    plan = ct_nvfp4.plan(ckpt)
    assert plan.problems == []  # a value, not a header fact: found when read
    with pytest.raises(InputError, match=r"global scale is .*; it must be finite and non-zero") as exc:
        ct_nvfp4.read(ckpt, next(u for u in plan.units if u.kind == "moe"))
    assert exc.value.tensor == name
