"""Why a conversion in a fresh process is slower than the same conversion repeated in a warm one.

    PYTHONPATH=. python3 benchmarks/probe_fresh_process.py OUT_DIR [--layers 24] [--device cuda]

Each case runs in its own Python process on the same generated ModelOpt NVFP4 checkpoint (warm page
cache), alternating, and reports the in-process conversion seconds:
  fresh       one conversion in a new process (what the CLI does);
  pinned      the process first allocates and frees 4 GiB of page-locked host memory (torch's caching
              host allocator keeps it), then converts: isolates the cost of pinning memory;
  cuda_init   the process first initializes CUDA (a tiny tensor on the device), then converts;
  second      the process converts twice; the second conversion's seconds;
  hostregN    torch's host allocator pins with malloc + cudaHostRegister from N threads (8 if no N).
One JSON line per run (also OUT_DIR/probe_fresh_process.jsonl), with ``steps_s``: seconds spent in
the steps of the units' read and transform (validation, the requant driver, encoding), summed over
threads, so a step that is slower in a fresh process shows up, and ``host``: torch's pinned host
allocator's peak bytes, number of blocks it pinned and microseconds it spent pinning (where torch
reports them).
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

CHILD = r"""
import functools, importlib, json, shutil, sys, time
import torch
from mxfp4conv.pipeline import ConvertOptions, convert
src, out, case, device = sys.argv[1:5]
# seconds inside the steps of a unit's read and transform (summed over threads and units)
FN = {}
def timed(mod, name):
    m = importlib.import_module(mod)
    if not hasattr(m, name):
        return
    f = getattr(m, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            FN[name] = FN.get(name, 0.0) + time.perf_counter() - t
    setattr(m, name, w)
for mod, name in [("mxfp4conv.requant", "validate_nvfp4_scales"), ("mxfp4conv.requant", "requant_rows_cpu"),
                  ("mxfp4conv.kernels.requant_triton", "requant_nvfp4_gpu_chunks"),
                  ("mxfp4conv.kernels.requant_triton", "requant_rows_into"),  # kernel launches (+ first loads)
                  ("mxfp4conv.pipeline", "_validate_mx"), ("mxfp4conv.layouts.base", "_stack_into"),
                  ("mxfp4conv.io.safetensors_io", "_as_bytes"), ("mxfp4conv.pipeline", "to_mxfp4")]:
    timed(mod, name)
pre = 0.0
t = time.perf_counter()
if case == "pinned":
    bufs = [torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True) for _ in range(16)]
    del bufs
if case == "cuda_init":
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
if case.startswith("hostreg"):  # torch's host allocator: malloc + cudaHostRegister from N threads
    torch.cuda.memory._set_allocator_settings(
        f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{case[7:] or 8}")
pre = time.perf_counter() - t
runs = 2 if case == "second" else 1
for i in range(runs):
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    FN.clear()
    rep = convert(src, out, ConvertOptions(target="ct", device=device, verify=False))
    wall = time.perf_counter() - t
def host_stats():
    try:
        st = torch.cuda.memory.host_memory_stats()
    except Exception as e:  # older torch
        return {"error": type(e).__name__}
    keys = ("allocated_bytes.peak", "allocated_bytes.current", "num_host_alloc", "host_alloc_time.total")
    return {k: st.get(k) for k in keys}
print(json.dumps({"case": case, "host": host_stats(), "before_s": round(pre, 2), "convert_s": round(wall, 2),
                  "seconds": {k: round(v, 2) for k, v in rep.seconds.items()},
                  "steps_s": {k: round(v, 2) for k, v in sorted(FN.items())}}))
"""


def main() -> None:
    from gen_checkpoint import generate, warm

    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fresh"))
    ap.add_argument("--cases", default="fresh,pinned,cuda_init,second", help="which cases (pinned, cuda_init need CUDA)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    src = generate(args.work / "src", "modelopt-nvfp4", args.layers)
    warm(src)
    log = open(args.out / "probe_fresh_process.jsonl", "w")  # noqa: SIM115
    cases = args.cases.split(",")
    # one throw-away conversion first: a machine whose Triton cache is cold compiles here
    subprocess.run([sys.executable, "-c", CHILD, str(src), str(args.work / "out"), "fresh", args.device],
                   check=True, capture_output=True)
    for rnd in range(args.rounds):
        for case in cases:
            subprocess.run(["sync"], check=True)
            res = subprocess.run([sys.executable, "-c", CHILD, str(src), str(args.work / "out"), case, args.device],
                                 check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            doc = {"round": rnd, "layers": args.layers, "date": time.strftime("%Y-%m-%d"), **json.loads(res)}
            print(json.dumps(doc), flush=True)
            log.write(json.dumps(doc) + "\n")
            log.flush()
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
