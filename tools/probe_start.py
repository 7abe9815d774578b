"""Where a fresh GPU conversion's start goes: Python, torch's import, CUDA's start, the kernel's load.

    PYTHONPATH=. python3 tools/probe_start.py [--rounds 3] [--importtime]

Each case runs in a fresh interpreter, the cases alternating within each round. ``key`` times Triton's import and its
cache key (a hash of its install) alone; ``kernel``
times the GPU kernel's module import, Triton's cache key and the first and second launch (the first
round's first launch may compile; later ones find Triton's disk cache). ``warm_driver``
starts the CUDA driver and the device's primary context through the driver API (ctypes) on a helper
thread while the main thread imports torch, as ``convert`` does when a GPU is named. One JSON line
per run, then the medians. ``--importtime`` also prints torch's 15 slowest imports
(``python -X importtime``), cumulative.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CASES = {
    "bare": "",
    "cli": "import mxfp4conv.cli",
    "torch": "import torch",
    "torch_cuda": "import torch\nmark('import')\ntorch.cuda.init()\nmark('init')\n"
                  "torch.empty(1, device='cuda')\ntorch.cuda.synchronize()\nmark('context')",
    "warm_driver": "from mxfp4conv.device.cuda_driver import start_driver\nwarm = start_driver(0)\n"
                   "import torch\nmark('import')\nwarm.join()\nmark('driver_joined')\ntorch.cuda.init()\nmark('init')\n"
                   "torch.empty(1, device='cuda')\ntorch.cuda.synchronize()\nmark('context')",
    "key": "import torch\nimport triton\nmark('triton')\nfrom triton.runtime.cache import triton_key\ntriton_key()\n"
           "mark('triton_key')",
    "kernel": "import torch\ntorch.cuda.init()\ntorch.empty(1, device='cuda')\nmark('context')\n"
              "from mxfp4conv.kernels.requant_triton import _jit, requant_rows\n_jit()\nmark('kernel_module')\n"
              "import time as _t\nfrom triton.runtime.cache import triton_key\n_k = _t.perf_counter()\ntriton_key()\n"
              "MARKS['triton_key_again_s'] = round(_t.perf_counter() - _k, 3)\nmark('triton_key')\n"
              "p = torch.zeros(64, 1024, dtype=torch.uint8, device='cuda')\n"
              "s = torch.zeros(64, 128, dtype=torch.uint8, device='cuda')\ng = torch.ones(64, device='cuda')\n"
              "requant_rows(p, s, g, False, 'mse')\ntorch.cuda.synchronize()\nmark('first_launch')\n"
              "requant_rows(p[:32], s[:32], g[:32], False, 'mse')\ntorch.cuda.synchronize()\nmark('second_launch')",
}

_PRELUDE = ("import time, json\nT0 = time.perf_counter()\nMARKS = {}\n"
            "def mark(name):\n    MARKS[name] = round(time.perf_counter() - T0, 3)\n")


def run_case(code: str) -> dict[str, float]:
    prog = _PRELUDE + code + "\nmark('end')\nprint(json.dumps(MARKS))"
    out = subprocess.run([sys.executable, "-c", "import time; T=time.perf_counter()\n"
                          "import subprocess, sys, json\n"
                          "r = subprocess.run([sys.executable, '-c', sys.argv[1]], capture_output=True, text=True)\n"
                          "print(json.dumps([time.perf_counter() - T, r.returncode, r.stdout, r.stderr[-800:]]))", prog],
                         capture_output=True, text=True, check=True)
    wall, rc, stdout, stderr = json.loads(out.stdout)
    if rc:
        raise SystemExit(f"case failed: {stderr}")
    marks = json.loads(stdout.strip().splitlines()[-1])
    return {"wall_s": round(wall, 3), **marks}


def importtime(top: int = 15) -> list[tuple[int, str]]:
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch"], capture_output=True, text=True, check=True)
    rows = []
    for line in r.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=",".join(_CASES))
    ap.add_argument("--importtime", action="store_true")
    args = ap.parse_args()
    cases = args.cases.split(",")
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for c in cases:
            row = run_case(_CASES[c])
            runs[c].append(row)
            print(json.dumps({"round": r + 1, "case": c, **row}), flush=True)
    for c in cases:
        keys = runs[c][0].keys()
        print(json.dumps({"case": c, "median": {k: round(statistics.median(x[k] for x in runs[c]), 3) for k in keys}}))
    if args.importtime:
        for us, name in importtime():
            print(f"{us / 1e6:8.3f} s  {name}")


if __name__ == "__main__":
    main()
