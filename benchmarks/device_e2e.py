"""NVFP4 -> MXFP4 end to end on a CUDA machine: throughput against `cp` of the same files, and
byte-identity of the output across CPU, one GPU and every GPU.

    PYTHONPATH=. python3 benchmarks/device_e2e.py OUT_DIR [--layers 12]

Each round times `cp -r` + `sync` of the source, then the default command
(`mxfp4conv convert SRC DST --to ct`: ``--device auto``, the GPU here, and the proof) and the same
with `--no-verify`, each in a fresh process with its peak RSS; every ratio is against the copy just before it
(``throughput_vs_cp``). With ``--variants`` each variant's conversions get a copy of their own, and
the summary also sets each conversion against the median of its round's copies
(``throughput_vs_round_cp``), so that one slow copy does not flatter one variant. One JSON line per
case (also written to OUT_DIR/device_e2e.jsonl), then the medians per variant and command. On a
machine without CUDA, variants with ``DEVICE=cpu`` run the same protocol.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from gen_checkpoint import generate

PY = sys.executable


def torch_bytecode_cached(env: dict[str, str] | None = None) -> bool:
    """Whether a process started with this one's environment updated by ``env`` finds torch's modules
    compiled (the bytecode of its ``__init__``, under ``PYTHONPYCACHEPREFIX`` when set). Without it
    every fresh process compiles them: ~2 s more of torch's import on the H200 hosts
    (``tools/import_bytecode.sh``)."""
    prefix = {**os.environ, **(env or {})}.get("PYTHONPYCACHEPREFIX") or None
    old, sys.pycache_prefix = sys.pycache_prefix, prefix
    try:
        return Path(importlib.util.cache_from_source(torch.__file__)).is_file()
    finally:
        sys.pycache_prefix = old


def run(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


STAGES: dict[str, dict[str, float]] = {}


ON: dict[str, dict[str, int]] = {}  # units requantized per device, of the last conversion into each name
RSS: dict[str, int] = {}  # peak RSS (bytes) of the last conversion into each destination name
_TIMED = ("import json,resource,subprocess,sys,time;t=time.perf_counter();"
          "r=subprocess.run(sys.argv[1:],stdout=subprocess.PIPE,text=True);w=time.perf_counter()-t;"
          "print(json.dumps([w,resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,r.returncode,r.stdout]))")


def conv(src: Path, dst: Path, *flags: str, env: dict[str, str] | None = None) -> float:
    """Wall seconds of one CLI conversion, timed inside a wrapper process of its own (so its peak RSS,
    RSS[dst.name], is this conversion's alone); its --json per-stage seconds go to STAGES[dst.name]."""
    env = dict(env or {})
    cwd = env.pop("CWD", None)  # `python -m mxfp4conv` runs the package found there first: another checkout
    res = subprocess.run([PY, "-c", _TIMED, PY, "-m", "mxfp4conv", "convert", str(src.resolve()), str(dst.resolve()), "--to",
                          "ct", "--json", *flags], check=True, capture_output=True, text=True, env={**os.environ, **env},
                         cwd=cwd)
    wall, rss_kib, rc, out = json.loads(res.stdout.strip().splitlines()[-1])
    if rc:
        raise SystemExit(f"convert failed ({rc}): {res.stderr[-2000:]}")
    doc = json.loads(out)
    STAGES[dst.name] = {k: round(v, 2) for k, v in doc.get("seconds", {}).items()}
    ON[dst.name] = doc.get("requantized_on") or {}
    RSS[dst.name] = rss_kib * 1024
    return float(wall)


def unit_budget(src: Path) -> tuple[int, int]:
    """(the largest unit's bytes, source or output, whichever is larger; 1 GiB + 2x that)."""
    from mxfp4conv.plan.job import ConvertOptions, prepare

    job = prepare(src, ConvertOptions(target="ct"))
    largest = 0
    for _, shard in job.output.shards():
        for u in shard.units:
            if u.direct is None:
                largest = max(largest, u.read_bytes, u.nbytes)
    return largest, (1 << 30) + 2 * largest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", default="12", help="layer count, or a comma list: each size measured in turn, then "
                                                   "wall = start + GB / rate fitted for cp and convert (least squares "
                                                   "over every pair) and the ratio projected to 400 and 700 GB")
    ap.add_argument("--work", type=Path, default=Path("/tmp/e2e"))
    ap.add_argument("--skip-identity", action="store_true", help="skip case 1 (tests/run/test_pipeline_gpu.py covers it)")
    ap.add_argument("--rounds", type=int, default=1, help="cp / convert pairs, alternating (each its own ratio)")
    ap.add_argument("--skip-verify", action="store_true", help="time only `--no-verify` conversions")
    ap.add_argument("--warmup", action="store_true",
                    help="convert a one-layer checkpoint on the GPU first (untimed): Triton's disk cache is warm for every size")
    ap.add_argument("--src", type=Path, help="convert this NVFP4 checkpoint (kept) instead of generating one")
    ap.add_argument("--bytecode-cache", type=Path,
                    help="first write the bytecode of every module a conversion of this checkout imports (torch's and "
                         "Triton's included) under this folder, in one untimed conversion; variants read it with "
                         "PYTHONPYCACHEPREFIX=<folder> (torch's import with and without bytecode, "
                         "tools/import_bytecode.sh)")
    ap.add_argument("--hashers", default="", help="comma list of MXFP4CONV_HASHER values, alternated within each round")
    ap.add_argument("--shard-sizes", default="", help="comma list of --max-shard-size values, alternated within each round")
    ap.add_argument("--variants", default="",
                    help="';'-separated NAME:VAR=V,VAR=V environments for the conversion, alternated within each "
                         "round (e.g. 'base:CWD=/tmp/base;omp1:OMP_NUM_THREADS=1'; 'new:' = as is). CWD is not an "
                         "environment variable: the conversion runs in that folder, so `python -m mxfp4conv` runs "
                         "the checkout there (a same-run A/B of two versions); DEVICE is the "
                         "conversion's --device (default: none given, i.e. auto)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "device_e2e.jsonl", "w")  # noqa: SIM115

    cached = torch_bytecode_cached()

    def emit(**kw: object) -> None:
        line = json.dumps({"date": time.strftime("%Y-%m-%d"), "gpus": torch.cuda.device_count(),
                           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                           "torch_bytecode_cached": cached, **kw})
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()  # a call cut off by the device's time limit keeps every line it printed

    w = args.work
    shutil.rmtree(w, ignore_errors=True)
    w.mkdir(parents=True)
    # 1. byte-identity: CPU vs one GPU vs every GPU, on a one-layer Qwen3-30B-A3B-like NVFP4 checkpoint
    if not args.skip_identity:
        identity(w, emit)
    if args.warmup:
        conv(generate(w / "warm", "modelopt-nvfp4", 1), w / "warm-out", "--device", "cuda", "--no-verify")
        shutil.rmtree(w / "warm", ignore_errors=True)
        shutil.rmtree(w / "warm-out", ignore_errors=True)
    if args.bytecode_cache:  # an empty PYTHONDONTWRITEBYTECODE lets this one process write bytecode
        conv(generate(w / "bc", "modelopt-nvfp4", 1), w / "bc-out",
             env={"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(args.bytecode_cache.resolve())})
        shutil.rmtree(w / "bc", ignore_errors=True)
        shutil.rmtree(w / "bc-out", ignore_errors=True)
    hashers = [h for h in args.hashers.split(",") if h] or [""]
    sizes = [v for v in args.shard_sizes.split(",") if v] or [""]
    points: list[tuple[float, float, float]] = []
    for n in (int(v) for v in str(args.layers).split(",")):
        points += big(w, n, emit, args.rounds, not args.skip_verify, args.src, hashers, sizes, parse_variants(args.variants))
        for d in ("big", "cp", "out"):
            shutil.rmtree(w / d, ignore_errors=True)
    if len({gb for gb, _, _ in points}) > 1:
        emit(case="scaling: wall = start + GB / rate, least squares over every cp / convert pair", **scaling(points))
    shutil.rmtree(w, ignore_errors=True)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b x: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def scaling(points: list[tuple[float, float, float]]) -> dict[str, Any]:
    """From (GB, cp s, convert s) pairs of several sizes: each tool's fixed start (s) and streaming rate
    (GB/s), their ratio (the steady-state throughput against cp's), and the wall ratio projected to the
    sizes of the checkpoints this tool is for."""
    gbs = [p[0] for p in points]
    a_cp, b_cp = _fit(gbs, [p[1] for p in points])
    a_cv, b_cv = _fit(gbs, [p[2] for p in points])
    proj = {f"throughput_vs_cp_at_{g}gb": round((a_cp + b_cp * g) / (a_cv + b_cv * g), 3) for g in (400, 700)}
    return {"pairs": len(points), "sizes_gb": sorted(set(gbs)), "cp_start_s": round(a_cp, 2), "cp_gb_per_s": round(1 / b_cp, 3),
            "convert_start_s": round(a_cv, 2), "convert_gb_per_s": round(1 / b_cv, 3),
            "streaming_rate_vs_cp": round(b_cp / b_cv, 3), **proj}


def parse_variants(text: str) -> list[tuple[str, dict[str, str]]]:
    """'a:X=1,Y=2;b:' -> [("a", {"X": "1", "Y": "2"}), ("b", {})]; empty -> [("default", {})]."""
    out = []
    for item in (v for v in text.split(";") if v.strip()):
        name, _, assigns = item.partition(":")
        out.append((name.strip(), dict(a.split("=", 1) for a in assigns.split(",") if a.strip())))
    return out or [("default", {})]


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
        hashers: list[str] | None = None, shard_sizes: list[str] | None = None,
        variants: list[tuple[str, dict[str, str]]] | None = None) -> list[tuple[float, float, float]]:
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
    startup = run([PY, "-c", "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"]) \
        if torch.cuda.is_available() else None  # a CPU machine runs DEVICE=cpu variants only
    points: list[tuple[float, float, float]] = []
    largest, budget = unit_budget(src)
    cases = [(r, h, z, v) for r in range(rounds) for h in (hashers or [""]) for z in (shard_sizes or [""])
             for v in (variants or [("default", {})])]
    rows: list[dict[str, Any]] = []
    for r, hasher, shard, (variant, venv) in cases:
        shutil.rmtree(w / "cp", ignore_errors=True)
        shutil.rmtree(w / "out", ignore_errors=True)
        run(["sync"])
        t_cp = run(["cp", "-r", str(src), str(w / "cp")]) + run(["sync"])
        shutil.rmtree(w / "cp", ignore_errors=True)  # the disk holds the source, one copy and one output
        env = {**venv, **({"MXFP4CONV_HASHER": hasher} if hasher else {})}
        device = env.pop("DEVICE", "")
        extra = ["--max-shard-size", shard] if shard else []
        for mode, flags in (("default", []), ("no-verify", ["--no-verify"])) if verify else (("no-verify", ["--no-verify"]),):
            shutil.rmtree(w / "out", ignore_errors=True)
            run(["sync"])
            t_conv = conv(src, w / "out", *(["--device", device] if device else []), *flags, *extra, env=env)
            stages = STAGES.get("out", {})
            row = {"round": r + 1, "variant": variant, "command": mode, "cp_s": round(t_cp, 2), "convert_s": round(t_conv, 2),
                   "throughput_vs_cp": round(t_cp / t_conv, 3), "peak_rss_gb": round(RSS["out"] / 1e9, 3),
                   "rss_budget_gb": round(budget / 1e9, 3), "rss_within_budget": RSS["out"] <= budget}
            rows.append(row)
            emit(case="nvfp4 -> mxfp4 end to end, all GPUs", env=venv, torch_bytecode_cached=torch_bytecode_cached(env),
                 hasher=hasher or "default",
                 max_shard_size=shard or "default", shards=len(list((w / "out").glob("*.safetensors"))), layers=layers,
                 gb=round(size / 1e9, 2), gweights=round(weights / 1e9, 2), **row, in_process_s=stages.get("total"),
                 in_process_vs_cp=round(t_cp / stages["total"], 3) if stages.get("total") else None,
                 python_torch_cuda_startup_s=None if startup is None else round(startup, 2), gweights_per_s=round(weights / t_conv / 1e9, 3),
                 largest_unit_gb=round(largest / 1e9, 3), stages=stages, requantized_on=ON.get("out"))
            if mode == "no-verify":
                points.append((size / 1e9, t_cp, t_conv))
    emit(case="summary", layers=layers, gb=round(size / 1e9, 2), rss_budget_gb=round(budget / 1e9, 3),
         **summarize(rows))
    return points


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant and command: the throughput ratios against each conversion's own copy and against
    the median of all copies of its round (with several variants each has a copy of its own, and a
    slow copy alone would flatter the conversion after it), with their medians and the peak RSS."""
    by_round: dict[int, list[float]] = {}
    for x in rows:
        by_round.setdefault(x["round"], []).append(x["cp_s"])
    out: dict[str, Any] = {}
    for key in dict.fromkeys((x["variant"], x["command"]) for x in rows):
        mine = [x for x in rows if (x["variant"], x["command"]) == key]
        own = [x["throughput_vs_cp"] for x in mine]
        vs_round = [round(statistics.median(by_round[x["round"]]) / x["convert_s"], 3) for x in mine]
        out[f"{key[0]}/{key[1]}"] = {
            "rounds": len(mine), "convert_s": [x["convert_s"] for x in mine],
            "throughput_vs_cp": own, "median": round(statistics.median(own), 3),
            "throughput_vs_round_cp": vs_round, "median_vs_round_cp": round(statistics.median(vs_round), 3),
            "peak_rss_gb": max(x["peak_rss_gb"] for x in mine),
            "rss_within_budget": all(x["rss_within_budget"] for x in mine)}
    return out


if __name__ == "__main__":
    main()
