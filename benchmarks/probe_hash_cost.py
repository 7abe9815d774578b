"""What the output sha256 costs a rename conversion: in-process convert with and without the hasher,
each against `cp -r && sync` of the same files, alternating runs (a diagnostic, not a mode).

    python benchmarks/probe_hash_cost.py [--layers 6] [--runs 2]

The manifest's sha256 of every output file is a contract; the patched-out run only prices it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_checkpoint import generate

import mxfp4conv.io.safetensors_io as sio
from mxfp4conv.pipeline import ConvertOptions, convert

_HASH = sio._BackgroundWriter._hash_chunk


def one(src: Path, work: Path, hashed: bool) -> dict[str, float]:
    for p in src.rglob("*"):
        if p.is_file():
            p.read_bytes()  # warm
    for d in ("cp", "out"):
        shutil.rmtree(work / d, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(work / "cp")], check=True)
    subprocess.run(["sync"], check=True)
    cp = time.perf_counter() - t
    shutil.rmtree(work / "cp")
    subprocess.run(["sync"], check=True)
    sio._BackgroundWriter._hash_chunk = _HASH if hashed else (lambda self, chunk: None)  # type: ignore[method-assign]
    t = time.perf_counter()
    convert(src, work / "out", ConvertOptions(target="quark", verify=False))
    conv = time.perf_counter() - t
    sio._BackgroundWriter._hash_chunk = _HASH  # type: ignore[method-assign]
    shutil.rmtree(work / "out")
    return {"cp_sync_s": round(cp, 2), "convert_in_process_s": round(conv, 2), "ratio": round(conv / cp, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mxfp4conv-hashprobe"))
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    src = generate(args.work / "src", "ct-mxfp4", args.layers)
    gb = sum(p.stat().st_size for p in src.rglob("*.safetensors")) / 1e9
    for _ in range(args.runs):
        for hashed in (True, False):
            print(json.dumps({"case": "rename ct-mxfp4 -> quark", "gb": round(gb, 2), "sha256": hashed,
                              **one(src, args.work, hashed)}), flush=True)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
