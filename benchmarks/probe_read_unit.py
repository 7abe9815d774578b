"""How long reading a unit's tensors takes (the read stage alone): this checkout against another
source tree, alternating, on the same cached checkpoint.

    python benchmarks/probe_read_unit.py [--layers 4] [--rounds 5] [--other DIR] [--busy]

Each run is a new process with ``PYTHONPATH`` set to this checkout or to ``--other`` (a source tree
of an earlier commit: ``git worktree add /tmp/old REV``) that reads every MoE unit of a generated
Qwen3-30B-like ModelOpt NVFP4 checkpoint (128 experts: 1,536 weights, 1,536 block scales and 768
per-tensor scales per layer) into memory, as the pipeline's read stage does. ``--busy``: a second
thread runs Python meanwhile, as the pipeline's producer does, so every GIL hand-off of the read
costs what it costs in a conversion. One JSON line per run: seconds per layer and GB/s.
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
from gen_checkpoint import generate, warm

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, threading, time
from mxfp4conv.pipeline import ConvertOptions, prepare
src, busy = sys.argv[1], sys.argv[2] == "1"
job = prepare(src, ConvertOptions(target="ct", device="cpu"))
ckpt, layout, plan, target, ctx = job.ckpt, job.layout, job.plan, job.target, job.ctx
units = [u for u in plan.units if u.kind == "moe"]
stop = False
def spin():
    n = 0
    while not stop:
        n += sum(i * i for i in range(200))
th = threading.Thread(target=spin, daemon=True)
if busy:
    th.start()
t = time.perf_counter()
nbytes = 0
for u in units:
    c = layout.read(ckpt, u, pin=False)
    nbytes += sum(x.packed.numel() + x.scales.numel() for x in (c.w13, c.w2))
stop = True
s = time.perf_counter() - t
print(json.dumps({"layers": len(units), "s": round(s, 3), "s_per_layer": round(s / len(units), 4),
                  "gb_s": round(nbytes / s / 1e9, 3)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--other", type=Path, help="an earlier source tree to compare against")
    ap.add_argument("--busy", action="store_true", help="a Python-busy thread runs beside the reads")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="read_unit_"))
    try:
        src = generate(work / "src", "modelopt-nvfp4", args.layers)
        warm(src)
        trees = [("this", ROOT)] + ([("other", args.other.resolve())] if args.other else [])
        for rnd in range(args.rounds):
            for label, tree in trees:
                env = {**os.environ, "PYTHONPATH": str(tree)}
                out = subprocess.run([sys.executable, "-c", CHILD, str(src), "1" if args.busy else "0"], env=env,
                                     check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
                doc = {"date": time.strftime("%Y-%m-%d"), "round": rnd, "tree": label, "busy": args.busy,
                       **json.loads(out)}
                print(json.dumps(doc), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
