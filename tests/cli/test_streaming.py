"""Peak memory stays bounded by one MoE layer: flat in model size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.builders import build

PEAK = ("import json,resource,sys;from mxfp4conv.run.pipeline import convert,ConvertOptions;"
        "convert(sys.argv[1],sys.argv[2],ConvertOptions(target=sys.argv[3],device='cpu'));"
        "print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))")


def peak_rss_kib(src: Path, dst: Path, target: str) -> int:
    return int(json.loads(subprocess.check_output([sys.executable, "-c", PEAK, str(src), str(dst), target])))


def test_peak_rss_is_flat_in_model_size(tmp_path: Path) -> None:
    small = build("ct-mxfp4", tmp_path / "small", layers=2, experts=8, hidden=512, inter=512, shards=2)
    large = build("ct-mxfp4", tmp_path / "large", layers=8, experts=8, hidden=512, inter=512, shards=2)
    layer_bytes = 8 * 3 * 512 * 512 * (1 / 2 + 1 / 32)  # one layer's expert codes + scales, ~3.3 MB
    data_small = sum(p.stat().st_size for p in small.glob("*.safetensors"))
    data_large = sum(p.stat().st_size for p in large.glob("*.safetensors"))
    assert data_large - data_small > 5 * layer_bytes
    for target in ("quark",):
        rss_small = peak_rss_kib(small, tmp_path / f"o-small-{target}", target)
        rss_large = peak_rss_kib(large, tmp_path / f"o-large-{target}", target)
        grew = (rss_large - rss_small) * 1024
        # 4x more layers (+20 MB of weights) may cost at most one extra layer's worth of memory
        assert grew < 2 * layer_bytes, (target, rss_small, rss_large, layer_bytes)
