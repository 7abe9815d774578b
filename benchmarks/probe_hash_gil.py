"""Does a hasher thread slow down while another thread runs Python code (the GIL hand-off)?

    python benchmarks/probe_hash_gil.py [--mb 1024] [--chunks 1,4,16] [--rounds 3]

A thread reads a cached file back with ``os.preadv`` into a reused buffer and hashes it with
sha256 in chunks of N MiB, as the shard hasher does; each read and each update releases the GIL and
must take it back. Measured alone, and while the main thread runs pure-Python work (what the
producer does between tensors). A thread that gives the GIL back must wait for the holder to
release it, up to ``sys.getswitchinterval()`` (5 ms) when the holder never blocks, so small chunks
can lose most of their speed under contention. Also measured: the same with the switch interval at
0.5 ms, and against a producer that alternates ~1 ms of Python with ~1 ms blocked. One JSON line per (chunk, case): GB/s of the hasher, and the busy thread's loop count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import threading
import time


def hash_file(path: str, chunk: int) -> float:
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(chunk)
    view = memoryview(buf)
    h = hashlib.sha256()
    pos = 0
    t0 = time.perf_counter()
    while (got := os.preadv(fd, [view], pos)) > 0:
        h.update(view[:got])
        pos += got
    os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--chunks", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile(dir="/tmp", delete=False) as f:
        block = os.urandom(1 << 20)
        for _ in range(args.mb):
            f.write(block)
        path = f.name
    hash_file(path, 1 << 20)  # cached
    gb = args.mb * (1 << 20) / 1e9
    try:
        for rnd in range(args.rounds):
            for chunk_mib in (int(c) for c in args.chunks.split(",")):
                for case, interval in (("alone", None), ("python_busy", None), ("python_busy_0.5ms", 0.0005),
                                       ("python_half", None), ("python_half_0.5ms", 0.0005)):
                    old = sys.getswitchinterval()
                    if interval:
                        sys.setswitchinterval(interval)
                    res: dict[str, float] = {}
                    th = threading.Thread(target=lambda c=chunk_mib, r=res: r.__setitem__("s", hash_file(path, c << 20)))
                    th.start()
                    loops = 0
                    if case.startswith("python_busy"):
                        while th.is_alive():  # the producer's pure-Python work, never blocking
                            loops += sum(i * i for i in range(200))
                    elif case.startswith("python_half"):
                        while th.is_alive():  # ~1 ms of Python, then ~1 ms blocked (I/O, a GPU event)
                            t_end = time.perf_counter() + 0.001
                            while time.perf_counter() < t_end:
                                loops += sum(i * i for i in range(200))
                            time.sleep(0.001)
                    th.join()
                    sys.setswitchinterval(old)
                    print(json.dumps({"round": rnd, "chunk_mib": chunk_mib, "case": case, "gb": round(gb, 2),
                                      "hash_gb_s": round(gb / res["s"], 3), "busy_loops": loops,
                                      "cpus": os.cpu_count()}), flush=True)
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
