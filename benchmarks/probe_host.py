"""What a host gives a conversion before any conversion work: start-up and I/O floors.

    PYTHONPATH=. python3 benchmarks/probe_host.py [--gb 2] [--work /tmp/probe_host]

One JSON line: seconds of `python -c pass`, of importing torch, of importing torch and starting
CUDA (every visible GPU), of `python -m mxfp4conv --version`; sha256 (hashlib, one thread) and
memcpy GB/s; writing --gb of fresh data with a final fsync, and `cp` + `sync` of that file (GB/s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable


def _wall(code: str, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([PY, "-c", code], check=True, capture_output=True)
        best = min(best, time.perf_counter() - t)
    return round(best, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/probe_host"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    doc: dict[str, object] = {"cpus": os.cpu_count()}
    doc["python_s"] = _wall("pass")
    doc["import_torch_s"] = _wall("import torch")
    doc["torch_cuda_init_s"] = _wall(
        "import torch\nfor i in range(torch.cuda.device_count()): torch.zeros(1, device=f'cuda:{i}')\n"
        "if torch.cuda.is_available(): torch.cuda.synchronize()")
    doc["mxfp4conv_version_s"] = _wall("import sys; sys.argv=['mxfp4conv','--version']\n"
                                       "from mxfp4conv.cli import main\ntry: main()\nexcept SystemExit: pass")
    n = int(args.gb * 1e9) // (64 << 20) * (64 << 20)
    buf = os.urandom(64 << 20)
    t = time.perf_counter()
    h = hashlib.sha256()
    for _ in range(n // len(buf)):
        h.update(buf)
    doc["sha256_GBps"] = round(n / (time.perf_counter() - t) / 1e9, 2)
    ba = memoryview(bytearray(len(buf)))  # memoryview slice assignment is a plain memcpy (bytearray's is not)
    t = time.perf_counter()
    for _ in range(n // len(buf)):
        ba[:] = buf
    doc["memcpy_GBps"] = round(n / (time.perf_counter() - t) / 1e9, 2)
    src = args.work / "a.bin"
    t = time.perf_counter()
    with open(src, "wb", buffering=0) as fh:
        for _ in range(n // len(buf)):
            fh.write(buf)
        os.fsync(fh.fileno())
    doc["write_fsync_GBps"] = round(n / (time.perf_counter() - t) / 1e9, 2)
    t = time.perf_counter()
    subprocess.run(["cp", str(src), str(args.work / "b.bin")], check=True)
    subprocess.run(["sync"], check=True)
    doc["cp_sync_GBps"] = round(n / (time.perf_counter() - t) / 1e9, 2)
    for p in ("a.bin", "b.bin"):
        (args.work / p).unlink()
    doc["gb"] = round(n / 1e9, 2)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
