"""The early writer (mxfp4conv/early_write.py): units a child process makes and writes into the staged
shards while torch is imported give the bytes, statistics, digests, errors and proof of the ordinary path."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mxfp4conv import early_write, pipeline
from mxfp4conv.canonical import DenseFP4, FP4Weight, MoELayer, UnitSpec
from mxfp4conv.errors import InputError, UsageError, VerificationFailed
from mxfp4conv.io import safetensors_io
from mxfp4conv.io.safetensors_io import ShardStream, Written
from mxfp4conv.job import prepare
from tests.builders import Tensors, build, moe_checkpoint, quark_config
from tests.test_head_start import _nan_scale, _with_dense


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def _let_make(n: int, then: Callable[[early_write.EarlyWriter], None] | None = None) -> Callable[[early_write.EarlyWriter], None]:
    """A claim hook: the child writes ``n`` units whole before the conversion claims the rest."""

    def hook(w: early_write.EarlyWriter) -> None:
        assert w.wait_made(n) == n, "the child ended before making its units"
        if then is not None:
            then(w)

    return hook


def _runs(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, opts: pipeline.ConvertOptions,
          hook: Callable[[early_write.EarlyWriter], None] | None) -> dict[str, pipeline.ConvertReport]:
    """The same conversion without and with the early writer (``hook`` at its claim)."""
    reports = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(early_write.ENV, mode)
        monkeypatch.setattr(early_write, "CLAIM_HOOK", hook if mode == "on" else None)
        reports[mode] = pipeline.convert(src, tmp_path / mode, opts)
    return reports


def test_the_early_writer_imports_no_torch() -> None:
    probe = "import sys, mxfp4conv.early_write; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False", res.stderr


@pytest.mark.parametrize(("layout", "shard"), [("ct-nvfp4", 0), ("modelopt-nvfp4", 0), ("ct-nvfp4", 300_000)])
def test_units_written_early_are_the_ordinary_bytes_and_statistics(layout: str, shard: int, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One shard, or a shard per layer written at once (units interleaved): the child's units, taken as
    written, give the shards, digests, statistics and manifest of a run without it."""
    src = build(layout, tmp_path / "src", layers=4, experts=4, hidden=128, inter=64)
    opts = pipeline.ConvertOptions(target="ct", device="cpu", max_shard_size=shard or 5 << 30)
    reports = _runs(src, tmp_path, monkeypatch, opts, _let_make(2))
    on, off = reports["on"], reports["off"]
    assert on.compute is not None and off.compute is not None
    assert (len(on.shards) > 2) == bool(shard)
    assert on.compute["early_write"] >= 2 and "early_write" not in off.compute
    assert on.requant_stats == off.requant_stats and on.requant_stats
    assert on.verify is not None and on.verify["ok"] and on.verify["units"] == off.verify["units"]  # type: ignore[index]
    assert _tree(tmp_path / "on") == _tree(tmp_path / "off")  # shards, config, manifest (digests, statistics)


def test_dense_units_written_early_equal_the_ordinary_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exclude = ["lm_head", "re:.*self_attn.(k|v|o)_proj.*", "re:.*mlp.gate$", "re:model.layers.1.self_attn.*"]

    def expert(t: Tensors, module: str, n: int, k: int) -> None:
        t.nvfp4(module, n, k, packed="weight", global_scale="weight_scale_2", divisor=False, input_scale="input_scale_2")

    src = moe_checkpoint(tmp_path / "src", expert, quark_config(16, w4a4=True, exclude=exclude), experts=4, hidden=64,
                         inter=32, extra=_with_dense)
    job = prepare(src, pipeline.ConvertOptions(target="ct", device="cpu"))
    fp4 = [u for u in job.plan.units if u.kind in ("moe", "dense")]
    assert {u.kind for u in fp4} == {"moe", "dense"}
    reports = _runs(src, tmp_path, monkeypatch, pipeline.ConvertOptions(target="ct", device="cpu"), _let_make(len(fp4)))
    assert reports["on"].compute is not None and reports["on"].compute["early_write"] == len(fp4)
    assert _tree(tmp_path / "on") == _tree(tmp_path / "off")


def test_the_pieces_are_the_encoded_tensors(tmp_path: Path) -> None:
    """``raw_pieces`` (what the child writes, as row runs of the kernel's results) and ``encode`` (what the
    pipeline writes) give the same bytes, tensor by tensor, for a MoE and a dense unit."""
    src = build("ct-nvfp4", tmp_path / "src", layers=1, experts=3, hidden=64, inter=32)
    job = prepare(src, pipeline.ConvertOptions(target="ct", device="cpu"))
    spec = next(u for u in job.plan.units if u.kind == "moe")
    target, ctx = job.target, job.ctx
    e, h, i = spec.dims
    rows = {"w13": e * 2 * i, "w2": e * h}
    kh = {"w13": h // 2, "w2": i // 2}
    flat = {(lab, part): torch.randint(0, 256, (rows[lab], kh[lab] if part == "p" else kh[lab] // 16), dtype=torch.uint8)
            for lab in rows for part in ("p", "s")}
    unit = MoELayer(spec.key, FP4Weight("mxfp4", flat["w13", "p"].view(e, 2 * i, -1), flat["w13", "s"].view(e, 2 * i, -1)),
                    FP4Weight("mxfp4", flat["w2", "p"].view(e, h, -1), flat["w2", "s"].view(e, h, -1)))
    pieces = target.raw_pieces(spec, ctx)
    outs = target.encode(unit, spec, ctx)
    assert pieces is not None and len(pieces) == len(outs) == len(target.out_specs(spec, ctx))
    for (lab, part, r0, n), out in zip(pieces, outs, strict=True):
        assert torch.equal(flat[lab, part][r0:r0 + n], out)
    dense = UnitSpec("dense", "m.proj", (), (48, 64))
    w = FP4Weight("mxfp4", flat["w2", "p"][:48], flat["w2", "s"][:48])
    assert target.raw_pieces(dense, ctx) == [("weight", "p", 0, 48), ("weight", "s", 0, 48)]
    for a, b in zip([w.packed, w.scales], target.encode(DenseFP4("m.proj", w), dense, ctx), strict=True):
        assert torch.equal(a, b)
    assert target.raw_pieces(dataclasses.replace(spec, has_bias=True), ctx) is None  # a bias: not whole rows


def test_targets_of_their_own_tensors_are_not_written_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Quark lays its tensors out itself (no ``raw_pieces``): the child gets no unit and does not start."""
    src = build("modelopt-nvfp4", tmp_path / "src", layers=2, experts=4, hidden=128, inter=64)
    reports = _runs(src, tmp_path, monkeypatch, pipeline.ConvertOptions(target="quark", device="cpu"), None)
    assert reports["on"].compute is not None and "early_write" not in reports["on"].compute
    assert _tree(tmp_path / "on") == _tree(tmp_path / "off")


def test_units_a_dead_child_did_not_finish_are_made_by_the_conversion(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The child is killed after one unit, with another begun: the conversion takes the finished one
    and makes the begun one itself, over whatever the child left of it."""
    src = build("ct-nvfp4", tmp_path / "src", layers=4, experts=8, hidden=256, inter=128)

    def kill(w: early_write.EarlyWriter) -> None:
        w._proc.kill()
        w._proc.wait()

    reports = _runs(src, tmp_path, monkeypatch, pipeline.ConvertOptions(target="ct", device="cpu"), _let_make(1, kill))
    assert reports["on"].compute is not None and reports["on"].compute["early_write"] >= 1
    assert reports["on"].verify is not None and reports["on"].verify["ok"]
    assert _tree(tmp_path / "on") == _tree(tmp_path / "off")


def test_the_proof_catches_a_wrong_byte_in_a_unit_written_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte flipped in the first unit the child wrote, before its check: the proof (a second
    requantization of SRC, independent of the child) fails the conversion, and nothing is published."""
    src = build("ct-nvfp4", tmp_path / "src", layers=3, experts=4, hidden=128, inter=64)
    flipped: list[Path] = []

    def flip(path: Path, begin: int, end: int) -> None:
        if end - begin > 10_000 and not flipped:
            with open(path, "r+b") as fh:
                fh.seek(begin + 777)
                b = fh.read(1)
                fh.seek(begin + 777)
                fh.write(bytes([b[0] ^ 0x10]))
            flipped.append(path)

    monkeypatch.setenv(early_write.ENV, "on")
    monkeypatch.setattr(early_write, "CLAIM_HOOK", _let_make(3))
    monkeypatch.setattr(safetensors_io, "CHECK_HOOK", flip)
    with pytest.raises(VerificationFailed):
        pipeline.convert(src, tmp_path / "o", pipeline.ConvertOptions(target="ct", device="cpu"))
    assert flipped and not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no staging folder left


def test_an_invalid_unit_written_early_is_refused_with_the_ordinary_error(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel runs on a NaN scale (memory-safe on any input) and the child writes the unit; the
    conversion validates its source as any unit's, and refuses it with the same error."""
    src = build("ct-nvfp4", tmp_path / "src", layers=2, experts=4, hidden=128, inter=64)
    bad = "model.layers.0.mlp.experts.2.up_proj.weight_scale"
    _nan_scale(src, bad)
    errors = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(early_write.ENV, mode)
        monkeypatch.setattr(early_write, "CLAIM_HOOK", _let_make(2) if mode == "on" else None)
        with pytest.raises(InputError) as exc:
            pipeline.convert(src, tmp_path / mode, pipeline.ConvertOptions(target="ct", device="cpu"))
        errors[mode] = str(exc.value)
        assert not (tmp_path / mode).exists()
    assert errors["on"] == errors["off"] and bad in errors["on"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_bad_mode_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nv = build("modelopt-nvfp4", tmp_path / "nv", layers=1, experts=4, hidden=128, inter=64)
    monkeypatch.setenv(early_write.ENV, "sometimes")
    with pytest.raises(UsageError, match="MXFP4CONV_EARLY_WRITE"):
        pipeline.convert(nv, tmp_path / "o", pipeline.ConvertOptions(target="ct", device="cpu"))
    assert not (tmp_path / "o").exists()


def test_runs_that_write_only_some_shards_or_none_start_no_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--partition / --finish, a dry run, NVFP4 kept, and ``auto`` once torch is imported: no early writer."""
    src = build("ct-nvfp4", tmp_path / "src", layers=3, experts=4, hidden=128, inter=64)
    monkeypatch.setenv(early_write.ENV, "on")
    base = pipeline.ConvertOptions(target="ct", device="cpu", max_shard_size=300_000)
    for i in range(2):
        part = pipeline.convert(src, tmp_path / "multi", dataclasses.replace(base, partition=(i, 2)))
        assert part.compute is not None and "early_write" not in part.compute
    done = pipeline.convert(src, tmp_path / "multi", dataclasses.replace(base, finish=True))
    assert done.compute is not None and "early_write" not in done.compute
    dry = pipeline.convert(src, tmp_path / "dry", dataclasses.replace(base, dry_run=True))
    assert dry.compute is not None and "early_write" not in dry.compute and not (tmp_path / "dry").exists()
    monkeypatch.setenv(early_write.ENV, "auto")  # torch is imported in this process
    job = prepare(src, base)
    assert not pipeline._early_wanted(job, tmp_path / "x")


def test_a_written_range_is_hashed_and_checked_from_the_file(tmp_path: Path) -> None:
    """``Written``: the stream moves past bytes another descriptor put in the file; the digest is the file's."""
    path = tmp_path / "s.safetensors"
    stream = ShardStream(path, [("a", "U8", (5,)), ("b", "U8", (1000,)), ("c", "U8", (3,))])
    at = stream.offsets()
    assert at[1] - at[0] == 5 and at[2] - at[1] == 1000
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, bytes(range(250)) * 4, at[1])
    os.close(fd)
    seen = []
    stream.feed(b"\x01" * 5)
    stream.feed(Written(1000))
    stream.feed(safetensors_io.CheckRange(lambda fd, b, e: seen.append(os.pread(fd, e - b, b))))
    stream.feed(b"\x02" * 3)
    digest = stream.finish().result()
    raw = path.read_bytes()
    assert digest == hashlib.sha256(raw).hexdigest()
    assert raw[at[1]:at[2]] == bytes(range(250)) * 4 and raw[-3:] == b"\x02" * 3
    assert seen == [b"\x01" * 5 + bytes(range(250)) * 4]
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header["b"]["data_offsets"] == [5, 1005]


def test_the_command_as_typed_writes_early_and_gives_the_same_bytes(tmp_path: Path) -> None:
    """A fresh process with MXFP4CONV_EARLY_WRITE=on: whatever the child made by the claim, the output is
    byte for byte the run's without it, and proven."""
    src = build("ct-nvfp4", tmp_path / "src", layers=4, experts=8, hidden=256, inter=128)
    trees = {}
    for mode in ("on", "off"):
        env = {**os.environ, early_write.ENV: mode}
        res = subprocess.run([sys.executable, "-m", "mxfp4conv", "convert", str(src), str(tmp_path / mode), "--to", "ct",
                              "--device", "cpu", "--json"], capture_output=True, text=True, check=True, env=env)
        assert json.loads(res.stdout)["verify"]["ok"]
        trees[mode] = _tree(tmp_path / mode)
    assert trees["on"] == trees["off"]


@pytest.mark.gpu
def test_on_a_gpu_units_written_early_are_the_device_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a GPU run the child's units (the CPU kernel) are checked against a second requantization on the
    device: the output equals a GPU run without the early writer."""
    src = build("modelopt-nvfp4", tmp_path / "src", layers=4, experts=8, hidden=256, inter=128, shards=2)
    reports = _runs(src, tmp_path, monkeypatch, pipeline.ConvertOptions(target="ct", device="cuda:0"), _let_make(2))
    on = reports["on"]
    assert on.compute is not None and on.compute["early_write"] >= 2
    assert on.requantized_on["cpu"] == on.compute["early_write"] and on.requantized_on.get("cuda:0", 0) >= 1
    assert on.verify is not None and on.verify["ok"]
    assert _tree(tmp_path / "on") == _tree(tmp_path / "off")
