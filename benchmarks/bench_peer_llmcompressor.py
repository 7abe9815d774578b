"""NVFP4 -> MXFP4 on the CPU against llm-compressor's route, same input, same run.

The input is a compressed-tensors NVFP4 checkpoint with Qwen3-30B-A3B shapes (``gen_checkpoint.py
--layout ct-nvfp4``; 2 layers = 0.79 GB). The peer route is llm-compressor's ``model_free_ptq``
(scheme MXFP4A16, on the CPU) with compressed-tensors' ``CompressedTensorsDequantizer`` as its
converter: the NVFP4 weights are dequantized and quantized again to MXFP4, shard by shard. Each
round runs, in turn and each in a fresh process with its wall time and peak RSS: ``mxfp4conv convert
SRC DST --to ct --device cpu`` (the default command, which verifies), the same with ``--no-verify``,
and the peer. Ratios are within a round; the summary gives their medians. One untimed conversion runs
before the first round (see ``main``).

    python benchmarks/bench_peer_llmcompressor.py --work /tmp/peer --layers 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from gen_checkpoint import generate, warm  # noqa: E402

PY = sys.executable
PEER = ("import sys\n"
        "from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer\n"
        "from llmcompressor.entrypoints.model_free import model_free_ptq\n"
        "model_free_ptq(sys.argv[1], sys.argv[2], scheme='MXFP4A16', device='cpu',\n"
        "               ignore=['lm_head', 're:.*mlp.gate$', 're:.*self_attn.*'],\n"
        "               converter=CompressedTensorsDequantizer(sys.argv[1]))\n")
TIMED = ("import json,resource,subprocess,sys,time;t=time.perf_counter();"
         "r=subprocess.run(sys.argv[1:],stdout=subprocess.DEVNULL,stderr=subprocess.PIPE,text=True);"
         "w=time.perf_counter()-t;"
         "print(json.dumps([w,resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,r.returncode,r.stderr[-2000:]]))")


def timed(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a command in a wrapper process of its own."""
    res = subprocess.run([PY, "-c", TIMED, *cmd], check=True, capture_output=True, text=True)
    wall, rss_kib, rc, err = json.loads(res.stdout.strip().splitlines()[-1])
    if rc:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}\n{err}")
    return float(wall), int(rss_kib) * 1024


def emit(log: Any, **kw: object) -> None:
    line = json.dumps(kw)
    print(line, flush=True)
    if log is not None:
        log.write(line + "\n")
        log.flush()


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/mxfp4conv-peer"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, help="also write the JSON lines here")
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    log = open(args.out, "w") if args.out else None  # noqa: SIM115
    src = generate(args.work / "src", "ct-nvfp4", args.layers, device="cpu")
    gb = warm(src) / 1e9
    script = args.work / "peer.py"
    script.write_text(PEER)
    emit(log, case="machine", host=platform.node(), cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d"),
         python=platform.python_version(), layers=args.layers, gb=round(gb, 3),
         loadavg=os.getloadavg()[0])
    cmds = {
        "default": [PY, "-m", "mxfp4conv", "convert", str(src), str(args.work / "out"), "--to", "ct", "--device", "cpu"],
        "no-verify": [PY, "-m", "mxfp4conv", "convert", str(src), str(args.work / "out"), "--to", "ct", "--device", "cpu",
                      "--no-verify"],
        "llm-compressor": [PY, str(script), str(src), str(args.work / "out")],
    }
    # One untimed conversion first. It builds the compiled CPU kernel and hasher (cached per user: a
    # machine's first conversion pays that once). And on the 2-core VM the first process to write the
    # output after the checkpoint was generated copied into the page cache ~1.4x slower than the next
    # (perf: copy_folio_from_iter_atomic 1.68 s against 1.18 s, with 14 GB free): a cost the first
    # round's first command paid and the peer, run after it, did not.
    subprocess.run([*cmds["no-verify"]], check=True, capture_output=True)
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        row: dict[str, Any] = {"round": r + 1}
        for name, cmd in cmds.items():
            shutil.rmtree(args.work / "out", ignore_errors=True)
            subprocess.run(["sync"], check=True)
            secs, rss = timed(cmd)
            row[f"{name}_s"], row[f"{name}_rss_gb"] = round(secs, 2), round(rss / 1e9, 3)
        for name in ("default", "no-verify"):
            row[f"{name}_speedup"] = round(row["llm-compressor_s"] / row[f"{name}_s"], 2)
            row[f"{name}_rss_ratio"] = round(row[f"{name}_rss_gb"] / row["llm-compressor_rss_gb"], 3)
        row["loadavg"] = os.getloadavg()[0]
        rows.append(row)
        emit(log, case="round", **row)
    summary = {f"{k}_median": median([x[k] for x in rows]) for k in rows[0] if k != "round"}
    emit(log, case="summary: medians over the rounds (speedup = llm-compressor s / mxfp4conv s, same round)",
         rounds=len(rows), **summary)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
