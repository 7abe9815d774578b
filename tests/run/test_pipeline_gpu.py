"""End to end on CUDA: NVFP4 sources converted on the GPU(s) give the CPU's bytes, file for file.

Covers what the kernel tests cannot: pinned read buffers, the chunked driver inside convert, the
read-ahead thread, several GPUs in flight, and verify recomputing on the GPU.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from mxfp4conv.proof.verify import verify_output
from mxfp4conv.run.pipeline import ConvertOptions, convert
from tests.builders import build

pytestmark = pytest.mark.gpu


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("layout", ["modelopt-nvfp4", "ct-nvfp4"])
@pytest.mark.parametrize("rule", ["mse", "even"])
def test_gpu_convert_matches_cpu(tmp_path: Path, layout: str, rule: str) -> None:
    src = build(layout, tmp_path / "src", layers=3, experts=8, hidden=256, inter=128, shards=2)
    runs = {"cpu": ConvertOptions(target="ct", scale_rule=rule, device="cpu", max_shard_size=400_000),
            "cuda0": ConvertOptions(target="ct", scale_rule=rule, device="cuda:0", max_shard_size=400_000)}
    if torch.cuda.device_count() >= 2:
        runs["cuda01"] = ConvertOptions(target="ct", scale_rule=rule, device="cuda", devices=("cuda:0", "cuda:1"),
                                        max_shard_size=400_000)
    trees = {}
    for name, opts in runs.items():
        report = convert(src, tmp_path / name, opts)
        assert report.verify and report.verify["ok"], report.verify
        trees[name] = tree_hashes(tmp_path / name)
    assert len(trees["cpu"]) >= 4  # several shards + index + config + manifest
    for name, tree in trees.items():
        assert tree == trees["cpu"], f"{name} differs from the CPU output"
    assert verify_output(src, tmp_path / "cpu", device="cuda:0").ok


@pytest.mark.parametrize("target", ["quark", "ct"])
def test_gpu_targets_match_cpu_with_mixed_units(tmp_path: Path, target: str) -> None:
    """Targets whose encode runs on the device (``Target.ENCODES_ON_DEVICE``), on a DeepSeek-R1 NVFP4
    replica: MoE, shared-expert and dense NVFP4 Linears, BF16 and pass-through tensors between them.
    The CPU's bytes, verified."""
    from tests.replicas.deepseek import modelopt_nvfp4_r1

    src = modelopt_nvfp4_r1(tmp_path / "src").path
    trees = {}
    for name, dev in (("cpu", "cpu"), ("cuda0", "cuda:0")):
        report = convert(src, tmp_path / name, ConvertOptions(target=target, device=dev, max_shard_size=300_000))
        assert report.verify and report.verify["ok"], report.verify
        trees[name] = tree_hashes(tmp_path / name)
    assert trees["cuda0"] == trees["cpu"]


def test_gpu_inline_proof_catches_a_flipped_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU the check compares each requantized unit's written bytes with a second,
    device-resident requantization: a byte flipped between write and check fails with nothing published."""
    from mxfp4conv.errors import VerificationFailed
    from mxfp4conv.files.safetensors import writer_threads

    src = build("modelopt-nvfp4", tmp_path / "src", layers=3, experts=8, hidden=256, inter=128, shards=2)
    ok = convert(src, tmp_path / "ok", ConvertOptions(target="ct", device="cuda:0"))
    assert ok.verify is not None and ok.verify["ok"] and ok.verify["units"] > 0

    def flip(path: Path, begin: int, end: int) -> None:
        if end - begin > 100_000:  # a MoE unit
            with open(path, "r+b") as fh:
                fh.seek(begin + 12345)
                b = fh.read(1)
                fh.seek(begin + 12345)
                fh.write(bytes([b[0] ^ 0x04]))

    monkeypatch.setattr(writer_threads, "CHECK_HOOK", flip)
    with pytest.raises(VerificationFailed):
        convert(src, tmp_path / "bad", ConvertOptions(target="ct", device="cuda:0"))
    assert not (tmp_path / "bad").exists()


def test_the_report_says_which_device_requantized_each_unit(tmp_path: Path) -> None:
    src = build("modelopt-nvfp4", tmp_path / "src", layers=4, experts=8, hidden=256, inter=128, shards=2)
    one = convert(src, tmp_path / "one", ConvertOptions(target="ct", device="cuda:0"))
    assert one.requantized_on == {"cuda:0": 4}
    if torch.cuda.device_count() >= 2:
        two = convert(src, tmp_path / "two", ConvertOptions(target="ct", device="cuda", devices=("cuda:0", "cuda:1")))
        assert two.requantized_on == {"cuda:0": 2, "cuda:1": 2}
