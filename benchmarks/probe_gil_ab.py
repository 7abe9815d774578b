"""The same conversion under different GIL settings: Python's thread switch interval and the shard
hasher's chunk size, in-process, alternating rounds.

    python benchmarks/probe_gil_ab.py [--layout gpt-oss] [--target gpt-oss] [--layers 10] [--rounds 3]
        [--cases "5ms/1MiB,0.5ms/1MiB"] [--device cpu]

A case ``I/C`` converts with ``sys.setswitchinterval(I)`` and ``safetensors_io.HASH_CHUNK = C``
("default" keeps what the code sets). A helper thread that releases the GIL for each ``pread`` or
sha256 call must wait up to the switch interval to get it back while the producer runs Python
(``benchmarks/probe_hash_gil.py``), so both settings change how fast the writer, the hasher and
the readers go. One JSON line per run: wall seconds and the busy seconds per stage.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_checkpoint import generate, warm

from mxfp4conv.io import safetensors_io as sio
from mxfp4conv.pipeline import ConvertOptions, convert


def _seconds(text: str) -> float | None:
    if text == "default":
        return None
    return float(text.removesuffix("ms")) / 1000


def _bytes(text: str) -> int | None:
    if text == "default":
        return None
    return int(text.removesuffix("MiB")) << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="gpt-oss")
    ap.add_argument("--target", default="gpt-oss")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="5ms/1MiB,0.5ms/1MiB")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="gil_ab_"))
    src = generate(work / "src", args.layout, args.layers)
    gb = warm(src) / 1e9
    default_interval, default_chunk = sys.getswitchinterval(), sio.HASH_CHUNK
    cases = [c.split("/") for c in args.cases.split(",")]
    try:
        convert(src, work / "out", ConvertOptions(target=args.target, device=args.device, verify=False))  # untimed
        for rnd in range(args.rounds):
            for interval, chunk in cases:
                shutil.rmtree(work / "out", ignore_errors=True)
                sys.setswitchinterval(_seconds(interval) or default_interval)
                sio.HASH_CHUNK = _bytes(chunk) or default_chunk
                t = time.perf_counter()
                rep = convert(src, work / "out", ConvertOptions(target=args.target, device=args.device, verify=False))
                wall = time.perf_counter() - t
                sys.setswitchinterval(default_interval)
                sio.HASH_CHUNK = default_chunk
                print(json.dumps({"date": time.strftime("%Y-%m-%d"), "round": rnd, "layout": args.layout,
                                  "target": args.target, "layers": args.layers, "gb": round(gb, 2),
                                  "interval": interval, "hash_chunk": chunk, "wall_s": round(wall, 2),
                                  "seconds": {k: round(v, 2) for k, v in rep.seconds.items()}}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
