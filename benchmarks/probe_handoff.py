"""What handing many small items to the shard writer costs: N byte-range copies (a ct-mxfp4 rename
copies ~10,000 tensors) or N computed buffers (a ct output has ~800 tensors per MoE layer) of SIZE
bytes streamed into one shard, handed over in batches (the default) or one per hand-off
(BATCH_SLICES=1), against the same bytes as one item. In RAM (/dev/shm) so that the disk does not
hide the per-item cost. Rounds alternate the cases.

    python benchmarks/probe_handoff.py [--n 10000] [--size 49152] [--rounds 3] [--work /dev/shm/...]

One JSON line per case: sorted seconds over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

import mxfp4conv.io.safetensors_io as sio


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--size", type=int, default=48 * 1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/mxfp4conv-handoff"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    src = args.work / "src.bin"
    src.write_bytes(os.urandom(args.n * args.size))
    batch = sio.BATCH_SLICES
    cases = {"one slice": (1, batch, "copy"), f"{args.n} slices, batched (default)": (args.n, batch, "copy"),
             f"{args.n} slices, one hand-off each": (args.n, 1, "copy"),
             "one computed buffer": (1, batch, "computed"),
             f"{args.n} computed buffers, batched (default)": (args.n, batch, "computed"),
             f"{args.n} computed buffers, one hand-off each": (args.n, 1, "computed")}
    whole = torch.frombuffer(bytearray(src.read_bytes()), dtype=torch.uint8)
    res: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, (n, b, kind) in cases.items():
            sio.BATCH_SLICES = b
            size = args.n * args.size // n
            items: list[object] = ([sio.FileSlice(src, i * size, size, f"t{i}") for i in range(n)] if kind == "copy"
                                   else [whole[i * size:(i + 1) * size] for i in range(n)])
            out = args.work / "out.safetensors"
            out.unlink(missing_ok=True)
            t = time.perf_counter()
            sio.stream_safetensors(out, [(f"t{i}", "U8", (size,)) for i in range(n)], iter(items)).result()  # type: ignore[arg-type]
            res[k].append(round(time.perf_counter() - t, 3))
    sio.BATCH_SLICES = batch
    shutil.rmtree(args.work)
    for k, v in res.items():
        print(json.dumps({"case": k, "bytes": args.n * args.size, "seconds": sorted(v), "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
