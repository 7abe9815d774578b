"""What the NVFP4 scale validation costs the producer thread, per MoE unit.

    python benchmarks/probe_validate_scales.py [--rounds 30] [--shape 128,1536,128]

`validate_nvfp4_scales` runs on the main thread before every NVFP4 unit is requantized (a 48-layer
profile on the H200 host attributed ~1.4 s of a ~18 s conversion to it, i.e. ~0.7 GB/s of scales).
This probe times it alone on a Qwen3-30B-A3B-like w13 unit's scales ([E, 2I, H/16] = [128, 1536,
128] bytes, positive, no NaN) and prints the median and the rate, to tell its compute from what a
busy process adds (GIL waits, intra-op threads competing with the pipeline's threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mxfp4conv.formats.nvfp4 import validate_nvfp4_scales


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--shape", default="128,1536,128")
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.uint8)  # positive, no NaN
    scales = bits.view(torch.float8_e4m3fn)
    g = torch.rand(shape[:-1], generator=gen) + 0.5
    times = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        assert validate_nvfp4_scales(scales, g, divisor=False) is None
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    print(json.dumps({"shape": list(shape), "MB": round(bits.numel() / 1e6, 1), "rounds": args.rounds,
                      "torch_threads": torch.get_num_threads(), "validate_ms_median": round(med * 1e3, 2),
                      "GBps": round(bits.numel() / med / 1e9, 2)}))


if __name__ == "__main__":
    main()
