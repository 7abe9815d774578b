"""Seconds to read the headers and plan a checkpoint with a Qwen3-30B-A3B's tensor count (48 layers x
128 experts x 3 projections x 4 tensors: ~74K), whatever their sizes: generated with tiny shapes (64 x
64 experts), so only the per-tensor work is timed: ``open_checkpoint`` (every shard header parsed and
checked), ``analyze`` (layout detection and the unit plan) and the source fingerprint — what every
``inspect``, ``convert`` (before its first byte is written) and ``verify`` pays.

    python benchmarks/probe_plan.py [--layers 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_checkpoint

from mxfp4conv.inspect import analyze
from mxfp4conv.io.checkpoint import open_checkpoint
from mxfp4conv.pipeline import source_fingerprint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layout", default="modelopt-nvfp4")
    ap.add_argument("--torch", action="store_true", help="import torch first (a larger process, as after a conversion's start)")
    args = ap.parse_args()
    if args.torch:
        import torch  # noqa: F401
    gen_checkpoint.SHAPES["qwen3"] = {"experts": 128, "hidden": 64, "inter": 64}
    work = Path(tempfile.mkdtemp(prefix="probe_plan_"))
    try:
        src = gen_checkpoint.generate(work / "src", args.layout, args.layers, device="cpu")
        for r in range(args.rounds):
            t0 = time.perf_counter()
            ckpt = open_checkpoint(src)
            t1 = time.perf_counter()
            _, plan, _ = analyze(ckpt)
            t2 = time.perf_counter()
            source_fingerprint(ckpt)
            t3 = time.perf_counter()
            print(json.dumps({"round": r + 1, "torch_imported": args.torch, "layout": args.layout, "tensors": len(ckpt.tensors), "units": len(plan.units),
                              "open_s": round(t1 - t0, 3), "analyze_s": round(t2 - t1, 3),
                              "fingerprint_s": round(t3 - t2, 3), "total_s": round(t3 - t0, 3)}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
