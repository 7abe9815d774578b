"""The head start (mxfp4conv/head_start.py): the first NVFP4 unit, read and requantized without torch
while torch is imported, gives the bytes, statistics and errors of the ordinary path."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mxfp4conv import head_start, pipeline, units
from mxfp4conv.errors import InputError, OutputError, UsageError
from mxfp4conv.formats.tables import E4M3_VALUES
from mxfp4conv.job import direct_slices, prepare
from tests.builders import Tensors, build, moe_checkpoint, quark_config


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_e4m3_table_is_torchs_decode_bit_for_bit() -> None:
    ref = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    mine = torch.tensor(E4M3_VALUES, dtype=torch.float32)
    nan = torch.isnan(ref)
    assert torch.equal(nan, torch.isnan(mine)) and int(nan.sum()) == 2
    assert torch.equal(ref[~nan].view(torch.int32), mine[~nan].view(torch.int32))  # -0.0 and subnormals too


def test_the_head_start_imports_no_torch() -> None:
    probe = "import sys, mxfp4conv.head_start; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False", res.stderr


@pytest.mark.parametrize(("layout", "target", "shard"), [("ct-nvfp4", "ct", 0), ("modelopt-nvfp4", "ct", 0),
                                                      ("modelopt-nvfp4", "quark", 0), ("ct-nvfp4", "ct", 300_000)])
def test_a_head_start_gives_the_ordinary_bytes_and_statistics(layout: str, target: str, shard: int, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With one shard the head start makes layer 0's experts; with a shard per layer (written at once,
    their units interleaved) the first MoE unit of that order, whichever it is."""
    src = build(layout, tmp_path / "src", layers=3, experts=4, hidden=128, inter=64)
    reports = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(head_start.ENV, mode)
        opts = pipeline.ConvertOptions(target=target, device="cpu")
        if shard:
            opts = dataclasses.replace(opts, max_shard_size=shard)
        reports[mode] = pipeline.convert(src, tmp_path / mode, opts)
    on, off = reports["on"], reports["off"]
    assert on.compute is not None and off.compute is not None
    assert (len(on.shards) > 2) == bool(shard)
    made = on.compute["head_start"]
    assert made == "model.layers.0.mlp.experts" if not shard else made.endswith(".mlp.experts")
    assert "head_start" not in off.compute
    assert on.requant_stats == off.requant_stats and on.requant_stats
    assert on.requantized_on == off.requantized_on == {"cpu": 3}
    assert on.verify is not None and on.verify["ok"]
    assert _tree(tmp_path / "on") == _tree(tmp_path / "off")  # shards, config, manifest


def test_a_head_start_unit_written_for_two_ranks_is_taken_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Marlin with --tp-size 2 writes each unit once per rank folder: the first rank takes the head
    start's unit, the second makes it as usual; both ranks' bytes equal a run without a head start."""
    src = build("modelopt-nvfp4", tmp_path / "src", layers=2, experts=4, hidden=256, inter=256)
    opts = pipeline.ConvertOptions(target="marlin", extra={"tp_size": "2", "engine": "vllm"})
    reports = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(head_start.ENV, mode)
        reports[mode] = pipeline.convert(src, tmp_path / mode, opts)
    assert reports["on"].compute is not None and reports["on"].compute["head_start"] == "model.layers.0.mlp.experts"
    assert reports["on"].requantized_on == reports["off"].requantized_on == {"cpu": 4}
    assert (tmp_path / "on" / "rank-1").is_dir()
    assert _tree(tmp_path / "on") == _tree(tmp_path / "off")


def _with_dense(t: Tensors) -> None:
    """Layer 0's q_proj in NVFP4 too: a dense unit."""
    n, k = t.pop("model.layers.0.self_attn.q_proj.weight").shape
    t.nvfp4("model.layers.0.self_attn.q_proj", n, k, packed="weight", global_scale="weight_scale_2", divisor=False,
            input_scale="input_scale_2")


def test_every_unit_kind_made_ahead_equals_the_ordinary_result(tmp_path: Path) -> None:
    """Each NVFP4 unit of a checkpoint (moe and dense), made by the head start and taken by the pipeline,
    equals the unit read and requantized as usual: outputs, statistics, and what the check compares."""
    exclude = ["lm_head", "re:.*self_attn.(k|v|o)_proj.*", "re:.*mlp.gate$", "re:model.layers.1.self_attn.*"]

    def expert(t: Tensors, module: str, n: int, k: int) -> None:
        t.nvfp4(module, n, k, packed="weight", global_scale="weight_scale_2", divisor=False, input_scale="input_scale_2")

    src = moe_checkpoint(tmp_path / "src", expert, quark_config(16, w4a4=True, exclude=exclude), experts=4, hidden=64,
                         inter=32, extra=_with_dense)
    job = prepare(src, pipeline.ConvertOptions(target="ct", device="cpu"))
    specs = job.plan.units
    kinds = set()
    for spec in specs:
        roles = job.layout.nvfp4_roles(spec)
        if spec.kind not in ("moe", "dense") or direct_slices(spec, job.ckpt, job.target, job.ctx) is not None:
            continue
        hs = head_start.make(spec, job.ckpt, roles, job.opts.scale_rule, threads=3)
        assert hs is not None
        ahead = units._adopt(hs, spec, job, job.ctx, check=True)
        usual = units._transform(spec, job, job.ctx, "cpu", True)
        assert ahead.head_start and not usual.head_start
        assert ahead.stats == usual.stats and ahead.device == usual.device == "cpu"
        assert len(ahead.outs) == len(usual.outs)
        for a, b in zip(ahead.outs, usual.outs, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
        kinds.add(spec.kind)
    assert kinds == {"moe", "dense"}


def _nan_scale(src: Path, tensor: str) -> None:
    """Set the first E4M3 block scale of ``tensor`` to 0x7F (NaN), in place in its shard."""
    for shard in sorted(src.glob("*.safetensors")):
        raw = shard.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        head: dict[str, Any] = json.loads(raw[8:8 + n])
        if tensor in head:
            at = 8 + n + head[tensor]["data_offsets"][0]
            shard.write_bytes(raw[:at] + b"\x7f" + raw[at + 1:])
            return
    raise AssertionError(tensor)


def test_an_invalid_first_unit_is_refused_with_the_ordinary_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel runs on a NaN scale (it is memory-safe on any input), yet nothing of it is taken: the
    unit is validated once torch is there, and the error names the same tensor and file."""
    src = build("ct-nvfp4", tmp_path / "src", layers=2, experts=4, hidden=128, inter=64)
    bad = "model.layers.0.mlp.experts.2.up_proj.weight_scale"
    _nan_scale(src, bad)
    errors = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(head_start.ENV, mode)
        with pytest.raises(InputError) as exc:
            pipeline.convert(src, tmp_path / mode, pipeline.ConvertOptions(target="ct", device="cpu"))
        errors[mode] = str(exc.value)
        assert not (tmp_path / mode).exists()
    assert errors["on"] == errors["off"] and bad in errors["on"]


def test_no_head_start_where_nothing_is_requantized_or_torch_is_there(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    mx = build("ct-mxfp4", tmp_path / "mx", layers=1, experts=4, hidden=128, inter=64)
    monkeypatch.setenv(head_start.ENV, "on")
    renamed = pipeline.convert(mx, tmp_path / "a", pipeline.ConvertOptions(target="quark"))
    assert renamed.compute is None  # MXFP4: no requant, no head start
    nv = build("modelopt-nvfp4", tmp_path / "nv", layers=1, experts=4, hidden=128, inter=64)
    keep = pipeline.ConvertOptions(target="marlin", extra={"tp_size": "1", "engine": "vllm", "keep_nvfp4": "1"})
    kept = pipeline.convert(nv, tmp_path / "b", keep)  # NVFP4 kept as is: nothing to make ahead
    assert kept.compute is None or "head_start" not in kept.compute
    monkeypatch.setenv(head_start.ENV, "auto")  # torch is imported in this process: auto takes none
    assert not head_start.wanted()
    report = pipeline.convert(nv, tmp_path / "c", pipeline.ConvertOptions(target="ct", device="cpu"))
    assert report.compute is not None and "head_start" not in report.compute


def test_a_bad_mode_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nv = build("modelopt-nvfp4", tmp_path / "nv", layers=1, experts=4, hidden=128, inter=64)
    monkeypatch.setenv(head_start.ENV, "sometimes")
    with pytest.raises(UsageError, match="MXFP4CONV_HEAD_START"):
        pipeline.convert(nv, tmp_path / "o", pipeline.ConvertOptions(target="ct", device="cpu"))
    assert not (tmp_path / "o").exists()


def test_the_command_as_typed_takes_a_head_start_when_asked(tmp_path: Path) -> None:
    """A fresh process (torch not imported) with MXFP4CONV_HEAD_START=auto: the first NVFP4 unit is made
    while torch imports, and says so; without the variable (off, the default) none is taken."""
    import os

    src = build("modelopt-nvfp4", tmp_path / "src", layers=2, experts=4, hidden=128, inter=64)
    reports = {}
    for mode in ("auto", None):
        env = {k: v for k, v in os.environ.items() if k != head_start.ENV} | ({head_start.ENV: mode} if mode else {})
        res = subprocess.run([sys.executable, "-m", "mxfp4conv", "convert", str(src), str(tmp_path / str(mode)), "--to",
                              "ct", "--device", "cpu", "--json"], capture_output=True, text=True, check=True, env=env)
        reports[mode] = json.loads(res.stdout)
        assert reports[mode]["verify"]["ok"]
    assert reports["auto"]["compute"]["head_start"] == "model.layers.0.mlp.experts"
    assert "head_start" not in reports[None]["compute"]
    assert _tree(tmp_path / "auto") == _tree(tmp_path / "None")


def test_a_conversion_that_ends_early_stops_its_head_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing DST (an output error) or a current output (skipped) ends the conversion after the head
    start began: it stops between kernel calls and its thread ends; nothing is written."""
    import threading

    src = build("ct-nvfp4", tmp_path / "src", layers=2, experts=8, hidden=256, inter=128)
    monkeypatch.setenv(head_start.ENV, "on")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep").write_text("x")
    with pytest.raises(OutputError, match="already exists"):
        pipeline.convert(src, tmp_path / "taken", pipeline.ConvertOptions(target="ct", device="cpu"))
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep"]
    first = pipeline.convert(src, tmp_path / "out", pipeline.ConvertOptions(target="ct", device="cpu"))
    assert first.compute is not None and first.compute["head_start"]
    again = pipeline.convert(src, tmp_path / "out", pipeline.ConvertOptions(target="ct", device="cpu", skip_if_current=True))
    assert again.status == "skipped"
    for t in threading.enumerate():
        if t.name.startswith("mxfp4conv-head"):
            t.join(timeout=30)
            assert not t.is_alive()


def test_runs_that_write_only_some_shards_take_no_head_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--partition, --finish and --resume may never write the head start's unit: none is made, and
    the partitions still add up to one run's bytes."""
    src = build("ct-nvfp4", tmp_path / "src", layers=3, experts=4, hidden=128, inter=64)
    monkeypatch.setenv(head_start.ENV, "on")
    base = pipeline.ConvertOptions(target="ct", device="cpu", max_shard_size=300_000)
    one = pipeline.convert(src, tmp_path / "one", base)
    assert one.compute is not None and one.compute["head_start"]
    for i in range(2):
        part = pipeline.convert(src, tmp_path / "multi", dataclasses.replace(base, partition=(i, 2)))
        assert part.status == "partial" and part.compute is not None and "head_start" not in part.compute
    done = pipeline.convert(src, tmp_path / "multi", dataclasses.replace(base, finish=True))
    assert done.compute is not None and "head_start" not in done.compute
    assert _tree(tmp_path / "one") == _tree(tmp_path / "multi")


@pytest.mark.gpu
def test_on_a_gpu_the_head_start_unit_is_checked_against_the_device_and_not_held(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """In a GPU run the head-start unit's check compares with a second requantization on the device
    (its host results are not kept for the check): what it compares is the usual GPU unit's, and a
    run with the head start gives the bytes of one without."""
    src = build("modelopt-nvfp4", tmp_path / "src", layers=2, experts=4, hidden=256, inter=128)
    job = prepare(src, pipeline.ConvertOptions(target="ct", device="cuda:0"))
    spec = next(u for u in job.plan.units if u.kind == "moe")
    hs = head_start.make(spec, job.ckpt, job.layout.nvfp4_roles(spec), job.opts.scale_rule, threads=2)
    assert hs is not None
    ahead = units._adopt(hs, spec, job, job.ctx, check=True, device="cuda:0")
    usual = units._transform(spec, job, job.ctx, "cuda:0", True)
    assert ahead.device == "cpu" and usual.device == "cuda:0" and ahead.stats == usual.stats
    assert ahead.want is not None and usual.want is not None
    for name in ("w13", "w2"):
        a, b = getattr(ahead.want, name), getattr(usual.want, name)
        assert a.packed.is_cuda and torch.equal(a.packed, b.packed) and torch.equal(a.scales, b.scales)
    for a, b in zip(ahead.outs, usual.outs, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    reports = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(head_start.ENV, mode)
        reports[mode] = pipeline.convert(src, tmp_path / mode, pipeline.ConvertOptions(target="ct", device="cuda:0"))
    assert reports["on"].compute is not None and reports["on"].compute["head_start"] == spec.key
    assert reports["on"].verify is not None and reports["on"].verify["ok"]
    assert _tree(tmp_path / "on") == _tree(tmp_path / "off")
