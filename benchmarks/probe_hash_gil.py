"""Does a hasher thread slow down while another thread runs Python code (the GIL hand-off)?

    python benchmarks/probe_hash_gil.py [--mb 1024] [--chunks 1,4,16] [--rounds 3]
        [--hasher hashlib,native] [--cases alone,python_busy]

A thread reads a cached file back with ``os.preadv`` into a reused buffer and hashes it with
sha256 in chunks of N MiB, as the shard hasher does; each read and each update releases the GIL and
must take it back. Measured alone, and while the main thread runs pure-Python work (what the
producer does between tensors). A thread that gives the GIL back must wait for the holder to
release it, up to ``sys.getswitchinterval()`` (5 ms) when the holder never blocks, so small chunks
can lose most of their speed under contention. Also measured: the same with the switch interval at
0.5 ms, and against a producer that alternates ~1 ms of Python with ~1 ms blocked. One JSON line per (chunk, case): GB/s of the hasher, and the busy thread's loop count.

``--hasher native`` hashes the file with the shard hasher's native path instead
(mxfp4conv/io/hash_native.py: pread + OpenSSL sha256 in C, the whole file in one ctypes call that
holds no GIL; the chunk is then its read size). With several hashers the (hasher, case) runs
alternate within each round, and a last line per (hasher, chunk, case) gives the median over rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = ("alone", "python_busy", "python_busy_0.5ms", "python_half", "python_half_0.5ms")


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


def hash_file_native(path: str, chunk: int) -> float:
    from mxfp4conv.io import hash_native

    native = hash_native.load()
    assert native is not None, hash_native.build_error()
    fd = os.open(path, os.O_RDONLY)
    buf = hash_native.buffer(chunk)
    h = hash_native.NativeSha256(native)
    size = os.fstat(fd).st_size
    t0 = time.perf_counter()
    done, status = h.hash_range(fd, 0, size, buf)  # one call: no GIL taken back per chunk
    h.hexdigest()
    dt = time.perf_counter() - t0
    os.close(fd)
    assert (done, status) == (size, 0), (done, status)
    return dt


HASHERS: dict[str, Callable[[str, int], float]] = {"hashlib": hash_file, "native": hash_file_native}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--chunks", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hasher", default="hashlib", help="comma-separated: hashlib, native")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    args = ap.parse_args()
    hashers = args.hasher.split(",")
    cases = [c for c in args.cases.split(",") if c]
    assert set(hashers) <= set(HASHERS) and set(cases) <= set(CASES), (hashers, cases)
    if "native" in hashers:
        os.environ.setdefault("MXFP4CONV_HASHER", "native")  # no silent fallback while measuring it
    with tempfile.NamedTemporaryFile(dir="/tmp", delete=False) as f:
        block = os.urandom(1 << 20)
        for _ in range(args.mb):
            f.write(block)
        path = f.name
    hash_file(path, 1 << 20)  # cached
    if "native" in hashers:  # build, load, and check the digest once before timing
        from mxfp4conv.io import hash_native

        native = hash_native.load()
        assert native is not None, hash_native.build_error()
        h = hash_native.NativeSha256(native)
        fd = os.open(path, os.O_RDONLY)
        h.hash_range(fd, 0, os.fstat(fd).st_size, hash_native.buffer())
        os.close(fd)
        want = hashlib.sha256()
        with open(path, "rb") as fh:
            while block := fh.read(16 << 20):
                want.update(block)
        assert h.hexdigest() == want.hexdigest()
    gb = args.mb * (1 << 20) / 1e9
    rates: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    try:
        for rnd in range(args.rounds):
            for chunk_mib in (int(c) for c in args.chunks.split(",")):
                for case, hasher in ((c, h) for c in cases for h in hashers):
                    interval = 0.0005 if case.endswith("0.5ms") else None
                    fn = HASHERS[hasher]
                    old = sys.getswitchinterval()
                    if interval:
                        sys.setswitchinterval(interval)
                    res: dict[str, float] = {}
                    th = threading.Thread(target=lambda c=chunk_mib, r=res, f=fn: r.__setitem__("s", f(path, c << 20)))
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
                    rates[(hasher, chunk_mib, case)].append(gb / res["s"])
                    print(json.dumps({"round": rnd, "hasher": hasher, "chunk_mib": chunk_mib, "case": case,
                                      "gb": round(gb, 2), "hash_gb_s": round(gb / res["s"], 3),
                                      "busy_loops": loops, "cpus": os.cpu_count()}), flush=True)
        for (hasher, chunk_mib, case), r in rates.items():
            print(json.dumps({"median_of_rounds": len(r), "hasher": hasher, "chunk_mib": chunk_mib, "case": case,
                              "hash_gb_s": round(statistics.median(r), 3),
                              "min": round(min(r), 3), "max": round(max(r), 3)}), flush=True)
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
