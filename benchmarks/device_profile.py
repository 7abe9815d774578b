"""Where the time of an NVFP4 -> MXFP4 conversion goes on a CUDA machine (host-side profile).

    PYTHONPATH=. python3 benchmarks/device_profile.py OUT_DIR [--layers 4] [--device cuda:0]

Generates a Qwen3-30B-A3B-like ModelOpt NVFP4 checkpoint, converts it once in-process under cProfile
(``--no-verify``), and writes OUT_DIR/profile.txt (top functions by total and cumulative time) and
OUT_DIR/profile.json (the convert report: per-stage seconds, wall, GB/s).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_checkpoint import generate

from mxfp4conv.pipeline import ConvertOptions, convert


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--to", default="ct")
    ap.add_argument("--work", type=Path, default=Path("/tmp/prof"))
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    src = generate(args.work / "src", "modelopt-nvfp4", args.layers)
    size = sum(p.stat().st_size for p in src.rglob("*.safetensors"))
    for p in src.rglob("*.safetensors"):
        p.read_bytes()  # warm page cache
    opts = ConvertOptions(target=args.to, device=args.device, verify=False)
    # warm-up on a copy of one layer's worth is not possible cheaply: JIT time is part of the first unit
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    report = convert(src, args.work / "out", opts)
    prof.disable()
    wall = time.perf_counter() - t0
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(45)
    (args.out / "profile.txt").write_text(buf.getvalue())
    doc = {"layers": args.layers, "bytes": size, "wall_s": round(wall, 3), "GBps": round(size / wall / 1e9, 3),
           "seconds": report.to_dict().get("seconds")}
    (args.out / "profile.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
