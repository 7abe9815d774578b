"""Which stage bounds an NVFP4 -> MXFP4 GPU conversion: the same in-process conversion with one cost
removed at a time, rounds alternating, next to `cp -r` + `sync` of the same files.

    PYTHONPATH=. python3 benchmarks/probe_e2e_bounds.py OUT_DIR [--layers 24] [--rounds 2]

Variants (each a full `convert(..., device=cuda:0, verify=False)` of one generated
Qwen3-30B-A3B-like ModelOpt checkpoint, warm page cache, Triton cache warmed by a first small run):

* ``full``: what users run;
* ``nohash``: the shard writers' sha256 replaced by nothing (the manifest then holds a wrong digest:
  a diagnostic, never a mode of the tool);
* ``shm``: the destination in /dev/shm (no disk: write and fsync cost memory copies only);
* ``nohash_shm``: both.

If removing a cost does not shorten the run, that cost is not what bounds it. One JSON line per run
(also OUT_DIR/probe_e2e_bounds.jsonl).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_checkpoint import generate, warm

from mxfp4conv.io import safetensors_io
from mxfp4conv.pipeline import ConvertOptions, convert

_REAL_HASH = safetensors_io._BackgroundWriter._hash_chunk


def _no_hash(self, chunk):  # type: ignore[no-untyped-def]
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/e2eb"))
    ap.add_argument("--variants", default="full,nohash,shm,nohash_shm")
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    src = generate(args.work / "src", "modelopt-nvfp4", args.layers)
    size = warm(src)
    opts = ConvertOptions(target="ct", device=args.device, verify=False)
    small = generate(args.work / "warm", "modelopt-nvfp4", 1)
    convert(small, args.work / "warm_out", opts)  # Triton compile + CUDA context outside the timings
    lines = []

    def emit(doc: dict) -> None:  # type: ignore[type-arg]
        doc.update(layers=args.layers, bytes=size)
        print(json.dumps(doc), flush=True)
        lines.append(json.dumps(doc))

    for rnd in range(args.rounds):
        dst = args.work / "cp"
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
        subprocess.run(["sync"], check=True)
        cp_s = time.perf_counter() - t
        shutil.rmtree(dst)
        emit({"round": rnd, "variant": "cp", "wall_s": round(cp_s, 3)})
        for v in args.variants.split(","):
            dst = (Path("/dev/shm/e2eb_out") if "shm" in v else args.work / "out")
            shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            safetensors_io._BackgroundWriter._hash_chunk = _no_hash if "nohash" in v else _REAL_HASH
            t = time.perf_counter()
            report = convert(src, dst, opts)
            wall = time.perf_counter() - t
            safetensors_io._BackgroundWriter._hash_chunk = _REAL_HASH
            shutil.rmtree(dst)
            emit({"round": rnd, "variant": v, "wall_s": round(wall, 3), "vs_cp": round(cp_s / wall, 3),
                  "seconds": {k: round(x, 2) for k, x in (report.to_dict().get("seconds") or {}).items()}})
    (args.out / "probe_e2e_bounds.jsonl").write_text("\n".join(lines) + "\n")
    shutil.rmtree(args.work, ignore_errors=True)  # ~16 GB at 24 layers, on a 64 GB disk


if __name__ == "__main__":
    main()
