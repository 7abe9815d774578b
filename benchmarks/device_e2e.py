"""NVFP4 -> MXFP4 end to end on a CUDA machine: throughput against `cp` of the same files, and
byte-identity of the output across CPU, one GPU and every GPU.

    PYTHONPATH=. python3 benchmarks/device_e2e.py OUT_DIR [--layers 12]

One JSON line per case (also written to OUT_DIR/device_e2e.jsonl).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_checkpoint import generate

PY = sys.executable


def run(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


STAGES: dict[str, dict[str, float]] = {}


def conv(src: Path, dst: Path, *flags: str, env: dict[str, str] | None = None) -> float:
    """Wall seconds of one CLI conversion; its --json per-stage seconds go to STAGES[dst.name]."""
    t = time.perf_counter()
    out = subprocess.run([PY, "-m", "mxfp4conv", "convert", str(src), str(dst), "--to", "ct", "--json", *flags],
                         check=True, capture_output=True, text=True,
                         env={**os.environ, **(env or {})}).stdout
    wall = time.perf_counter() - t
    STAGES[dst.name] = {k: round(v, 2) for k, v in json.loads(out).get("seconds", {}).items()}
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--work", type=Path, default=Path("/tmp/e2e"))
    ap.add_argument("--skip-identity", action="store_true", help="skip case 1 (tests/test_pipeline_gpu.py covers it)")
    ap.add_argument("--rounds", type=int, default=1, help="cp / convert pairs, alternating (each its own ratio)")
    ap.add_argument("--skip-verify", action="store_true", help="do not time `mxfp4conv verify` afterwards")
    ap.add_argument("--src", type=Path, help="convert this NVFP4 checkpoint (kept) instead of generating one")
    ap.add_argument("--hashers", default="", help="comma list of MXFP4CONV_HASHER values, alternated within each round")
    ap.add_argument("--shard-sizes", default="", help="comma list of --max-shard-size values, alternated within each round")
    args = ap.parse_args()
    log = open(args.out / "device_e2e.jsonl", "w")  # noqa: SIM115

    def emit(**kw: object) -> None:
        line = json.dumps({"date": time.strftime("%Y-%m-%d"), "gpus": torch.cuda.device_count(),
                           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, **kw})
        print(line, flush=True)
        log.write(line + "\n")

    w = args.work
    shutil.rmtree(w, ignore_errors=True)
    w.mkdir(parents=True)
    # 1. byte-identity: CPU vs one GPU vs every GPU, on a one-layer Qwen3-30B-A3B-like NVFP4 checkpoint
    if not args.skip_identity:
        identity(w, emit)
    hashers = [h for h in args.hashers.split(",") if h] or [""]
    sizes = [v for v in args.shard_sizes.split(",") if v] or [""]
    big(w, args.layers, emit, args.rounds, not args.skip_verify, args.src, hashers, sizes)
    shutil.rmtree(w, ignore_errors=True)


def identity(w: Path, emit: Any) -> None:
    small = generate(w / "small", "modelopt-nvfp4", 1)
    t_cpu = conv(small, w / "s-cpu", "--device", "cpu")
    t_g1 = conv(small, w / "s-g1", "--devices", "0")
    t_gall = conv(small, w / "s-gall", "--device", "cuda")
    h = [tree(w / n) for n in ("s-cpu", "s-g1", "s-gall")]
    emit(case="byte identity cpu / 1 gpu / all gpus (with verify)", identical=h[0] == h[1] == h[2],
         files=len(h[0]), cpu_s=round(t_cpu, 1), gpu1_s=round(t_g1, 1), gpus_s=round(t_gall, 1))
    shutil.rmtree(w / "small")


def big(w: Path, layers: int, emit: Any, rounds: int = 1, verify: bool = True, src: Path | None = None,
        hashers: list[str] | None = None, shard_sizes: list[str] | None = None) -> None:
    """2. throughput against cp of the same files (warm page cache), >= 4 GB; ``rounds`` alternating
    cp / convert pairs, each reported with its own ratio (these hosts' disks are noisy); with
    ``hashers``, one pair per MXFP4CONV_HASHER value in each round ("" = the default), and likewise
    per ``--max-shard-size`` value of ``shard_sizes``."""
    if src is None:
        src = generate(w / "big", "modelopt-nvfp4", layers)
    else:
        layers = len({p.split(".mlp.experts")[0] for p in json.loads((src / "model.safetensors.index.json").read_text())["weight_map"] if ".mlp.experts." in p})
    size = sum(p.stat().st_size for p in src.rglob("*.safetensors"))
    for p in src.rglob("*.safetensors"):
        p.read_bytes()
    run(["cp", "-r", str(src), str(w / "cp0")])
    shutil.rmtree(w / "cp0")
    weights = layers * 128 * 3 * 2048 * 768
    startup = run([PY, "-c", "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"])
    for r, hasher, shard in ((r, h, z) for r in range(rounds) for h in (hashers or [""]) for z in (shard_sizes or [""])):
        shutil.rmtree(w / "cp", ignore_errors=True)
        shutil.rmtree(w / "out", ignore_errors=True)
        run(["sync"])
        t_cp = run(["cp", "-r", str(src), str(w / "cp")]) + run(["sync"])
        t_conv = conv(src, w / "out", "--device", "cuda", "--no-verify", *(["--max-shard-size", shard] if shard else []),
                      env={"MXFP4CONV_HASHER": hasher} if hasher else None)
        t_ver = run([PY, "-m", "mxfp4conv", "verify", str(src), str(w / "out"), "--device", "cuda", "--json"]) if verify else None
        stages = STAGES.get("out", {})
        emit(case="nvfp4 -> mxfp4 end to end, all GPUs", round=r + 1, hasher=hasher or "default",
             max_shard_size=shard or "default", shards=len(list((w / "out").glob("*.safetensors"))), layers=layers, gb=round(size / 1e9, 2),
             gweights=round(weights / 1e9, 2), cp_s=round(t_cp, 2), convert_s=round(t_conv, 2),
             throughput_vs_cp=round(t_cp / t_conv, 3), in_process_s=stages.get("total"),
             in_process_vs_cp=round(t_cp / stages["total"], 3) if stages.get("total") else None,
             python_torch_cuda_startup_s=round(startup, 2), gweights_per_s=round(weights / t_conv / 1e9, 3),
             verify_s=round(t_ver, 2) if t_ver else None, stages=stages)


if __name__ == "__main__":
    main()
