"""What a cold Triton cache costs a GPU conversion (a fresh CI container has one).

    PYTHONPATH=. python3 benchmarks/probe_jit_cold.py OUT_DIR [--layers 2] [--label NAME] [--rounds 2]

Generates a small Qwen3-30B-A3B-like ModelOpt NVFP4 checkpoint (w13 and w2 have different K, so
shapes of two kinds reach the kernel), then converts it with ``--device cuda`` ``rounds`` times with
an empty TRITON_CACHE_DIR and once more with that cache warm. Reports wall seconds and how many
kernels were compiled (cubin files in the cache). One JSON line per case (also appended to
OUT_DIR/probe_jit_cold.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_checkpoint import generate


def convert(src: Path, dst: Path, cache: Path) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mxfp4conv", "convert", str(src), str(dst), "--to", "ct",
                    "--device", "cuda", "--no-verify"], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "TRITON_CACHE_DIR": str(cache)})
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--label", default="")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="jit_cold_"))
    try:
        src = generate(work / "src", "modelopt-nvfp4", args.layers)
        for r in range(args.rounds + 1):
            cold = r < args.rounds
            cache = work / f"cache{min(r, args.rounds - 1)}"
            if cold:
                shutil.rmtree(cache, ignore_errors=True)
                cache.mkdir()
            wall = convert(src, work / "out", cache)
            line = json.dumps({"date": time.strftime("%Y-%m-%d"), "label": args.label, "layers": args.layers,
                               "cache": "cold" if cold else "warm", "wall_s": round(wall, 2),
                               "kernels_compiled": len(list(cache.rglob("*.cubin")))})
            print(line, flush=True)
            with open(args.out / "probe_jit_cold.jsonl", "a") as f:
                f.write(line + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
