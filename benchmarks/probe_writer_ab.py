"""The shard writer of this checkout against the one of an earlier commit, on the same conversion:
in-process, alternating rounds (this machine's disk swings single runs by +-30%).

    python benchmarks/probe_writer_ab.py --rev b51c321 [--layout ct-mxfp4] [--target quark] [--layers 13] [--rounds 3]
        [--device cuda]   # NVFP4 sources on the GPU (round 0 includes the kernel's compilation)
        [--cold]          # drop the page cache before every run (root only)

The earlier ``mxfp4conv/io/safetensors_io.py`` is taken from ``git show REV:...`` and its
``stream_safetensors`` swapped into the pipeline for the "rev" runs; everything else is this
checkout's. One JSON line per run (also benchmarks/results/ with ``--save``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_checkpoint import generate, warm

import mxfp4conv.pipeline as pl
from mxfp4conv.io import safetensors_io as sio
from mxfp4conv.pipeline import ConvertOptions, convert

ROOT = Path(__file__).resolve().parent.parent


def _old_writer(rev: str):  # type: ignore[no-untyped-def]
    """``rev``: a commit, or a file holding that commit's safetensors_io.py (for machines without the
    git history, e.g. ``git show REV:mxfp4conv/io/safetensors_io.py > old.py`` carried along)."""
    if Path(rev).is_file():
        code = Path(rev).read_text()
    else:
        code = subprocess.run(["git", "show", f"{rev}:mxfp4conv/io/safetensors_io.py"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_safetensors_io.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("old_safetensors_io", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_safetensors_io"] = mod
    spec.loader.exec_module(mod)
    mod.FileSlice = sio.FileSlice  # the pipeline builds this checkout's slices
    return mod.stream_safetensors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True)
    ap.add_argument("--layout", default="ct-mxfp4")
    ap.add_argument("--target", default="quark")
    ap.add_argument("--layers", type=int, default=13)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mxfp4conv-writer-ab"))
    ap.add_argument("--device", default="cpu", help="where NVFP4 sources are requantized (cpu, cuda)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every run (needs root)")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON lines to this file")
    args = ap.parse_args()
    writers = {"this": pl.stream_safetensors, "rev": _old_writer(args.rev)}
    shutil.rmtree(args.work, ignore_errors=True)
    src = generate(args.work / "src", args.layout, args.layers)
    warm(src)
    lines = []
    for rnd in range(args.rounds):
        for name in ("rev", "this"):
            out = args.work / "out"
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            if args.cold:
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
            pl.stream_safetensors = writers[name]  # type: ignore[assignment]
            t = time.perf_counter()
            rep = convert(src, out, ConvertOptions(target=args.target, verify=False, device=args.device))
            doc = {"round": rnd, "writer": name if name == "this" else f"rev {args.rev}", "layout": args.layout,
                   "target": args.target, "layers": args.layers, "device": args.device, "cache": "cold" if args.cold else "warm",
                   "wall_s": round(time.perf_counter() - t, 2),
                   "seconds": {k: round(v, 2) for k, v in rep.seconds.items()}}
            print(json.dumps(doc), flush=True)
            lines.append(json.dumps(doc))
    pl.stream_safetensors = writers["this"]  # type: ignore[assignment]
    shutil.rmtree(args.work, ignore_errors=True)
    if args.save:
        args.save.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
