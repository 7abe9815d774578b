"""The sha256 of a cached file read with ``pread`` in chunks of different sizes (the shard hasher's
loop): a chunk that stays in a core's L2 cache between the read and the hash saves a trip to memory.

    python benchmarks/probe_hash_chunk.py [--mb 2048] [--rounds 4] [--chunks 16384,4096,1024,256]

Writes a random file of MB megabytes (read once, so it is cached), then hashes it with each chunk
size (KiB), alternating, ROUNDS times. One JSON line per chunk size: GB/s per round.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--chunks", default="16384,4096,1024,256", help="chunk sizes in KiB")
    args = ap.parse_args()
    chunks = [int(c) << 10 for c in args.chunks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.bin"
        with open(path, "wb") as f:
            for _ in range(args.mb // 64):
                f.write(os.urandom(64 << 20))
        path.read_bytes()
        fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        res: dict[int, list[float]] = {c: [] for c in chunks}
        for _ in range(args.rounds):
            for c in chunks:
                view = memoryview(bytearray(c))
                h = hashlib.sha256()
                pos = 0
                t = time.perf_counter()
                while pos < size:
                    n = os.preadv(fd, [view], pos)
                    h.update(view[:n])
                    pos += n
                res[c].append(round(size / (time.perf_counter() - t) / 1e9, 3))
        os.close(fd)
    for c, v in res.items():
        print(json.dumps({"chunk_kib": c >> 10, "GBps": v, "bytes": size, "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
