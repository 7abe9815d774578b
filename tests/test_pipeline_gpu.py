"""End to end on CUDA: NVFP4 sources converted on the GPU(s) give the CPU's bytes, file for file.

Covers what the kernel tests cannot: pinned read buffers, the chunked driver inside convert, the
read-ahead thread, several GPUs in flight, and verify recomputing on the GPU.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from tiny import build

from mxfp4conv.pipeline import ConvertOptions, convert
from mxfp4conv.verify import verify_output

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
