"""mxfp4conv/proof/verify.py: the one proof of a decoded unit (``prove_unit``, shared with convert's inline
check) and the plan's check of an output folder (``planned_mismatches``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mxfp4conv.cli import cli
from mxfp4conv.plan.job import ConvertOptions, prepare
from mxfp4conv.proof.verify import planned_mismatches, prove_unit
from mxfp4conv.sources.checkpoint import open_checkpoint
from tests.builders import build


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("verify")
    src = build("modelopt-nvfp4", root / "src", shards=1)
    res = CliRunner().invoke(cli, ["convert", str(src), str(root / "out"), "--to", "ct", "--device", "cpu"])
    assert res.exit_code == 0, res.stderr
    return src, root / "out"


def test_a_written_unit_is_proven_and_one_flipped_code_is_named(converted: tuple[Path, Path]) -> None:
    from mxfp4conv.numerics.canonicalize import to_mxfp4

    src, out = converted
    job = prepare(src, ConvertOptions(target="ct"))
    rank = job.output.ranks[0]
    unit = next(u for s in rank.shards for u in s.units if u.spec.kind == "moe")
    want, _ = to_mxfp4(job.layout.read(job.ckpt, unit.spec), rule="mse", device="cpu")
    written = open_checkpoint(out)
    tensors = {o.name: written.tensors[o.name].load() for o in unit.outs}
    assert prove_unit(job.target, want, unit.spec, rank.ctx, tensors.__getitem__) == []
    packed = next(o.name for o in unit.outs if o.name.endswith("weight_packed"))
    tensors[packed] = tensors[packed].clone()
    tensors[packed].view(-1)[7] ^= 0x01
    found = prove_unit(job.target, want, unit.spec, rank.ctx, tensors.__getitem__)
    assert found and "codes" in found[0]["tensor"]


def test_an_output_folder_is_checked_against_the_plan(converted: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    src, out = converted
    job = prepare(src, ConvertOptions(target="ct"))
    rank = job.output.ranks[0]
    assert planned_mismatches(open_checkpoint(out), rank, job.target) == []
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    t = load_file(str(bad / "model.safetensors"))
    gone = next(n for n in t if n.endswith("weight_packed"))
    del t[gone]
    t["model.extra.weight"] = torch.zeros(2, dtype=torch.bfloat16)
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    found = {(m["tensor"], m["message"]) for m in planned_mismatches(open_checkpoint(bad), rank, job.target)}
    assert (gone, "missing from output") in found and ("model.extra.weight", "unexpected tensor in output") in found
