"""Which copy primitive moves a warm file fastest to disk on this machine (what the lossless writer
should use): `cp` + `sync` against kernel-side `copy_file_range` and user-space read/write, with and
without `sync_file_range` writeback every 16 MiB, each ending in an fsync. Rounds alternate the cases.

    python benchmarks/probe_copy.py FILE [--rounds 4] [--work DIR]

One JSON line per case: sorted wall seconds over the rounds and the median ratio to `cp` + `sync`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", type=Path)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--work", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    src, dst = str(args.file), str(args.work / "probe_copy.out")
    n = os.path.getsize(src)
    sfr = ctypes.CDLL(None, use_errno=True).sync_file_range
    sfr.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]

    with open(src, "rb") as fh:
        mem = memoryview(fh.read())  # the NVFP4 path writes results from memory

    def copy(chunk: int, writeback: int, kernel: bool, from_memory: bool = False) -> None:
        fi = os.open(src, os.O_RDONLY)
        fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        buf = memoryview(bytearray(min(chunk, n))) if not kernel else None
        pos = done = 0
        while pos < n:
            if from_memory:
                got = os.write(fo, mem[pos:pos + chunk])
            elif buf is None:
                got = os.copy_file_range(fi, fo, min(chunk, n - pos), pos)
            else:
                got = os.preadv(fi, [buf[:min(chunk, n - pos)]], pos)
                os.write(fo, buf[:got])
            pos += got
            if writeback and pos - done >= writeback:
                sfr(fo, done, pos - done, 2)  # SYNC_FILE_RANGE_WRITE
                done = pos
        os.fsync(fo)
        os.close(fi)
        os.close(fo)

    def cp() -> None:
        subprocess.run(["cp", src, dst], check=True)
        subprocess.run(["sync"], check=True)

    mib = 1 << 20
    cases: dict[str, Callable[[], None]] = {
        "cp + sync": cp,
        "copy_file_range, one call": lambda: copy(1 << 40, 0, True),
        "copy_file_range 16 MiB + writeback 16 MiB (mxfp4conv default)": lambda: copy(16 * mib, 16 * mib, True),
        "copy_file_range 16 MiB, no writeback": lambda: copy(16 * mib, 0, True),
        "read/write 16 MiB + writeback 16 MiB (MXFP4CONV_COPY=readwrite)": lambda: copy(16 * mib, 16 * mib, False),
        "read/write 16 MiB, no writeback": lambda: copy(16 * mib, 0, False),
        "write from memory 16 MiB + writeback 16 MiB (mxfp4conv, computed tensors)": lambda: copy(16 * mib, 16 * mib, False, True),
        "write from memory 16 MiB, writeback 64 MiB": lambda: copy(16 * mib, 64 * mib, False, True),
        "write from memory 16 MiB, no writeback": lambda: copy(16 * mib, 0, False, True),
    }
    res: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, f in cases.items():
            if os.path.exists(dst):
                os.unlink(dst)
            subprocess.run(["sync"], check=True)
            t = time.perf_counter()
            f()
            res[k].append(round(time.perf_counter() - t, 2))
    os.unlink(dst)
    base = sorted(res["cp + sync"])[len(res["cp + sync"]) // 2]
    for k, v in res.items():
        med = sorted(v)[len(v) // 2]
        print(json.dumps({"case": k, "gb": round(n / 1e9, 2), "seconds": sorted(v), "median_vs_cp": round(med / base, 2),
                          "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
