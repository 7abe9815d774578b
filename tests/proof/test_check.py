"""convert's post-write proof, run unit by unit while the conversion writes: a byte changed in the
staged output between its write and its check fails the conversion with exit 3, nothing published."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mxfp4conv.cli import cli
from mxfp4conv.errors import VerificationFailed
from mxfp4conv.files.safetensors import writer_threads
from mxfp4conv.plan.job import prepare
from mxfp4conv.proof import check
from mxfp4conv.proof.verify import verify_output
from mxfp4conv.run.pipeline import ConvertOptions, convert
from tests.builders import build

CASES = [  # (source layout, target): a rename (byte ranges), CPU requants, MXFP4 decoded and re-encoded
    ("ct-mxfp4", "quark"),
    ("modelopt-nvfp4", "ct"),
    ("ct-nvfp4", "quark"),
    ("gpt-oss", "quark"),
    ("gpt-oss", "marlin"),
]


@pytest.fixture(scope="module")
def srcs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inline")
    return {k: build(k, root / k, experts=8) for k in {c[0] for c in CASES}}


def _flip_nth(n: int) -> tuple[list[int], object]:
    """A check hook that flips one byte in the middle of the n-th checked range of sizable length."""
    seen = [0]

    def hook(path: Path, begin: int, end: int) -> None:
        if end - begin < 64:
            return
        seen[0] += 1
        if seen[0] == n:
            with open(path, "r+b") as fh:
                at = (begin + end) // 2
                fh.seek(at)
                b = fh.read(1)
                fh.seek(at)
                fh.write(bytes([b[0] ^ 0x20]))

    return seen, hook


@pytest.mark.parametrize(("layout", "target"), CASES)
def test_a_byte_flipped_between_write_and_check_fails_with_nothing_published(
        srcs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, target: str) -> None:
    seen, hook = _flip_nth(2)
    monkeypatch.setattr(writer_threads, "CHECK_HOOK", hook)
    out = tmp_path / "o"
    res = CliRunner().invoke(cli, ["convert", str(srcs[layout]), str(out), "--to", target, "--device", "cpu", "--json"])
    assert seen[0] >= 2, "the hook never reached a second unit"
    assert res.exit_code == 3, res.output
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging folder left either


@pytest.mark.parametrize(("layout", "target"), CASES)
def test_inline_proof_passes_and_matches_the_standalone_verify(srcs: dict[str, Path], tmp_path: Path, layout: str,
                                                               target: str) -> None:
    out = tmp_path / "o"
    rep = convert(srcs[layout], out, ConvertOptions(target=target, device="cpu"))
    assert rep.verify is not None and rep.verify["ok"] and rep.verify["mode"] == "inline"
    full = verify_output(srcs[layout], out)
    assert full.ok and (full.units, full.tensors) == (rep.verify["units"], rep.verify["tensors"])
    assert json.loads((out / "mxfp4conv.json").read_text())["verified"] is True
    assert rep.seconds["verify"] > 0


def test_expert_groups_cover_every_byte(srcs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MoE units are decoded a few experts at a time: with one expert per group the outputs are the
    same, and a flipped byte in any expert of a unit is still found."""
    ref = tmp_path / "ref"
    convert(srcs["ct-nvfp4"], ref, ConvertOptions(target="ct", device="cpu", verify=False))
    monkeypatch.setattr(check, "GROUP_BYTES", 1)
    for layout, target in (("ct-nvfp4", "ct"), ("gpt-oss", "quark"), ("modelopt-nvfp4", "quark")):
        rep = convert(srcs[layout], tmp_path / f"g-{layout}-{target}", ConvertOptions(target=target, device="cpu"))
        assert rep.verify is not None and rep.verify["ok"]
    # the manifest and the card record whether the output was proven: every other byte is the same
    kept = ("mxfp4conv.json", "README.md")
    assert _tree(ref) == {k: v for k, v in _tree(tmp_path / "g-ct-nvfp4-ct").items() if k not in kept} | {
        k: _tree(ref)[k] for k in kept}

    job = prepare(srcs["ct-nvfp4"], ConvertOptions(target="ct"))
    moe = {sum(o.nbytes for o in job.target.out_specs(u, job.ctx)) for u in job.plan.units if u.kind == "moe"}

    def last_expert_hook(path: Path, begin: int, end: int) -> None:
        if end - begin in moe:
            with open(path, "r+b") as fh:  # the unit's last byte: the last expert's down_proj scales
                fh.seek(end - 1)
                b = fh.read(1)
                fh.seek(end - 1)
                fh.write(bytes([b[0] ^ 0x01]))

    monkeypatch.setattr(writer_threads, "CHECK_HOOK", last_expert_hook)
    with pytest.raises(VerificationFailed) as err:
        convert(srcs["ct-nvfp4"], tmp_path / "bad", ConvertOptions(target="ct", device="cpu"))
    assert ".experts" in (err.value.tensor or "")
    assert not (tmp_path / "bad").exists()


def test_no_verify_runs_no_checks(srcs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(writer_threads, "CHECK_HOOK", lambda p, b, e: calls.append(e - b))
    rep = convert(srcs["modelopt-nvfp4"], tmp_path / "o", ConvertOptions(target="ct", device="cpu", verify=False))
    assert calls == [] and rep.verify is None and "verify" not in rep.seconds


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_verify_and_the_pipeline_do_not_import_each_other() -> None:
    """Both start from the planned job (mxfp4conv/plan/job.py); the standalone verify never loads the pipeline."""
    import subprocess
    import sys

    code = ("import sys, mxfp4conv.proof.verify, mxfp4conv.proof.check, mxfp4conv.plan.job, mxfp4conv.numerics.units; "
            "print('mxfp4conv.run.pipeline' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("at", [0, 4095, 4096, 4097, 10_000, 10_239])
def test_range_difference_finds_the_first_differing_byte_across_pieces(tmp_path: Path, at: int) -> None:
    """The lossless check compares two files piece by piece (reused buffers): a byte changed in any
    piece, the short last one included, is reported at its offset; equal ranges give None."""
    import os

    from mxfp4conv.files.safetensors import FileSlice
    from mxfp4conv.proof.verify import first_range_difference

    data = bytes(range(256)) * 41  # 10,496 bytes
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"xx" + data)
    changed = bytearray(data)
    changed[at] ^= 0x10
    b.write_bytes(b"yyy" + bytes(changed))
    fd = os.open(b, os.O_RDONLY)
    try:
        assert first_range_difference(FileSlice(a, 2, 10_240), fd, 3, chunk=4096) == at
        assert first_range_difference(FileSlice(a, 2, at), fd, 3, chunk=4096) is None  # the range before it is equal
        b.write_bytes(b"yyy" + data[:9_000])  # the output ends early: a difference where it ends
        assert first_range_difference(FileSlice(a, 2, 10_240), fd, 3, chunk=4096) == 9_000
    finally:
        os.close(fd)


@pytest.mark.parametrize(("length", "offset"), [(4096, 0), (4096, 1), (4094, 2), (4092, 4), (4095, 0)])
def test_tensor_comparison_finds_one_differing_byte_whatever_the_word_width(length: int, offset: int) -> None:
    """The unit comparison reads bytes as the widest words their length and offset allow: one byte
    changed anywhere, the last included, is still found and reported at its offset."""
    import torch

    from mxfp4conv.proof.verify import _diff

    base = torch.randint(0, 256, (offset + length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(length))
    want = base[offset:]
    assert _diff("t", want, want.clone()) is None
    for at in (0, length // 2, length - 1):
        got = want.clone()
        got[at] ^= 1
        found = _diff("t", want, got)
        assert found is not None and found["differing_bytes"] == 1 and found["message"].endswith(f"first at byte {at}")
