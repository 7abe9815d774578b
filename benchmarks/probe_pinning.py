"""How fast a fresh process can page-lock host memory, from one thread or several at once.

    PYTHONPATH=. python3 benchmarks/probe_pinning.py [--gib 4] [--block-mib 256] [--threads 1,4,8] [--conf S]

Each case runs in a new Python process (CUDA initialized first, not timed) and allocates
``--gib`` GiB of pinned host memory in ``--block-mib`` MiB tensors (torch's caching host allocator,
what the pipeline uses), split across N threads; then frees it and allocates the same blocks again
(served from the allocator's cache). One JSON line per case: seconds and GB/s of the first and the
second allocation. A conversion in a fresh process pays the first figure for every pinned byte it
holds at once; a warm process pays the second.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r"""
import json, sys, time, threading
import torch
gib, block_mib, threads = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if sys.argv[4]:
    torch.cuda.memory._set_allocator_settings(sys.argv[4])
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
n = int(gib * 1024 / block_mib)
def alloc():
    out = [None] * n
    def work(i0):
        for i in range(i0, n, threads):
            t = torch.empty(block_mib << 20, dtype=torch.uint8, pin_memory=True)
            t[:: 4096].fill_(1)  # touch every page, as a D2H copy or a read would
            out[i] = t
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts: t.start()
    for t in ts: t.join()
    return out, time.perf_counter() - t0
bufs, first = alloc()
del bufs
bufs, second = alloc()
gb = n * block_mib * (1 << 20) / 1e9
print(json.dumps({"conf": sys.argv[4], "threads": threads, "block_mib": block_mib, "gb": round(gb, 2), "first_s": round(first, 3),
                  "first_gb_s": round(gb / first, 2), "second_s": round(second, 4)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--block-mib", type=int, default=256)
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--conf", default="", help="torch allocator settings, e.g. "
                    "pinned_use_cuda_host_register:True,pinned_num_register_threads:8")
    args = ap.parse_args()
    for th in args.threads.split(","):
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.gib), str(args.block_mib), th, args.conf],
                             check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        print(out, flush=True)


if __name__ == "__main__":
    main()
