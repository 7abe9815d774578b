"""Diagnostic: the compiled CPU requant kernel built with different compiler flags, one thread.

Builds ``mxfp4conv/kernels/requant_native.c`` with each flag set (always with the contract's
``-ffp-contract=off``) into a temporary folder, runs it on the same [rows, K] NVFP4 slab, checks
the bytes and statistics equal the shipped build's, and prints one JSON line per (flags, rule) with
single-thread M weights/s (best of ``--repeat``). Flag sets run in alternation, ``--rounds`` times,
since this VM is noisy.

    .venv/bin/python benchmarks/probe_cflags.py --flags "-O2 -funroll-loops" "-O2" "-O3"
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from bench_requant_cpu import make_rows

from mxfp4conv.formats.fp4 import e4m3_decode
from mxfp4conv.kernels import requant_native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flags", nargs="+", default=["-O2 -funroll-loops", "-O2", "-O3"])
    ap.add_argument("--rules", default="mse,even")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    shipped = requant_native.load()
    cc = requant_native._compiler()
    if shipped is None or cc is None:
        raise SystemExit(f"no C compiler / kernel: {requant_native.build_error()}")
    p, s, g = make_rows(args.rows, args.k, False)
    sd = e4m3_decode(s).contiguous()
    kh = args.k // 2
    tmp = Path(tempfile.mkdtemp(prefix="mxfp4conv-cflags-"))
    try:
        kernels = {}
        for i, flags in enumerate(args.flags):
            so = tmp / f"k{i}.so"
            subprocess.run([cc, *flags.split(), "-std=c99", "-shared", "-fPIC", "-ffp-contract=off",
                            str(requant_native._SOURCE), "-o", str(so), "-lm"], check=True)  # fmt: skip
            kernels[flags] = requant_native.NativeKernel(ctypes.CDLL(str(so)), so)
        for rnd in range(args.rounds):
            for flags, kern in kernels.items():
                for rule in args.rules.split(","):
                    outs = [(torch.empty_like(p), torch.empty(args.rows, args.k // 32, dtype=torch.uint8),
                             torch.empty(args.rows, 5, dtype=torch.float64)) for _ in range(2)]  # fmt: skip
                    best = float("inf")
                    for _ in range(args.repeat):
                        t0 = time.perf_counter()
                        kern.rows(p.data_ptr(), sd.data_ptr(), g.data_ptr(), 0, args.rows, kh, False, rule,
                                  *(t.data_ptr() for t in outs[0]))  # fmt: skip
                        best = min(best, time.perf_counter() - t0)
                    shipped.rows(p.data_ptr(), sd.data_ptr(), g.data_ptr(), 0, args.rows, kh, False, rule,
                                 *(t.data_ptr() for t in outs[1]))  # fmt: skip
                    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                               for a, b in zip(outs[0], outs[1], strict=True))  # fmt: skip
                    print(json.dumps({
                        "probe": "cflags", "date": datetime.date.today().isoformat(), "round": rnd,
                        "flags": flags, "rule": rule, "shape": [args.rows, args.k], "threads": 1,
                        "mweights_s": round(args.rows * args.k / best / 1e6, 1), "identical_to_shipped": same,
                        "cc": cc, "loadavg_1m": round(os.getloadavg()[0], 2),
                    }), flush=True)  # fmt: skip
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
