"""End-to-end conversion benchmarks on generated checkpoints with real shapes (issue: throughput).

Every figure is a ratio against a baseline measured in the same run, on the same files:
  * lossless convert (ct-mxfp4 -> quark, gpt-oss -> gpt-oss) wall time / `cp -r` + `sync` (warm page
    cache; cold too when the page cache can be dropped): the default command (which verifies) and
    `--no-verify`, alternating in each round;
  * NVFP4 -> MXFP4 (modelopt-nvfp4 -> ct) on the CPU: weights per second, against a plain
    "load_file, convert, save_file per shard" script with eager-torch requant;
  * peak RSS at 1x, 2x and 4x model size (flat is the goal);
  * compressed-tensors' convert_checkpoint with its ModelOpt NVFP4 converter on the same input
    (the closest file-to-file peer; it renames NVFP4 -> ct-nvfp4, no requant).
Prints one JSON line per case.

    python benchmarks/bench_convert.py --work /tmp/mxbench --layers 13
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from gen_checkpoint import generate  # noqa: E402

PY = sys.executable


LAST_STDOUT: list[str] = [""]


def timed(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS KiB) of a command run in a child process (its stdout: LAST_STDOUT[0])."""
    wrapper = [PY, "-c", "import resource,subprocess,sys,json,time;t=time.perf_counter();"
               "r=subprocess.run(sys.argv[1:],stdout=open('/tmp/mxfp4conv-bench-stdout','w'));"
               "print(json.dumps([time.perf_counter()-t,resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,r.returncode]))",
               *cmd]
    res = subprocess.run(wrapper, check=True, capture_output=True, text=True)
    secs, rss, rc = json.loads(res.stdout.strip().splitlines()[-1])
    LAST_STDOUT[0] = Path("/tmp/mxfp4conv-bench-stdout").read_text()
    if rc != 0:
        raise SystemExit(f"command failed ({rc}): {' '.join(cmd)}\n{res.stderr[-3000:]}")
    return secs, rss


def warm(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def emit(case: str, **kw: object) -> None:
    print(json.dumps({"case": case, **kw}), flush=True)


def bench_lossless(work: Path, layout: str, target: str, layers: int, rounds: int = 1) -> None:
    """Warm page cache: ``rounds`` alternating (cp -r + sync, default convert, --no-verify convert)
    triples, each convert its own ratio to the round's copy (this VM's disk swings single runs by
    +-30%); the median ratios are the figures. Then the standalone verify once."""
    src = generate(work / f"{layout}-src", layout, layers)
    gb = size(src) / 1e9
    warm(src)
    shutil.rmtree(work / "cp", ignore_errors=True)
    # one untimed run of each first (both tools then run from warm caches: the page cache, and the
    # Python bytecode and C extensions of the converter; before, only cp had one, and the first
    # timed convert was the slowest of its rounds in 5 of the last 10 runs, where chance gives 2)
    subprocess.run(["cp", "-r", str(src), str(work / "cp")], check=True)
    shutil.rmtree(work / "cp")
    subprocess.run([PY, "-m", "mxfp4conv", "convert", str(src), str(work / "out"), "--to", target, "--no-verify"],
                   check=True, capture_output=True)
    shutil.rmtree(work / "out")
    runs = []
    for _ in range(rounds):
        subprocess.run(["sync"], check=True)
        t_cp, _ = timed(["cp", "-r", str(src), str(work / "cp")])
        t_sync, _ = timed(["sync"])
        shutil.rmtree(work / "cp")
        run: dict[str, object] = {"cp_s": round(t_cp + t_sync, 2)}
        for mode, flags in (("default", []), ("no_verify", ["--no-verify"])):
            shutil.rmtree(work / "out", ignore_errors=True)
            subprocess.run(["sync"], check=True)
            t_conv, rss = timed([PY, "-m", "mxfp4conv", "convert", str(src), str(work / "out"), "--to", target, "--json", *flags])
            stages = {k: round(v, 2) for k, v in json.loads(LAST_STDOUT[0]).get("seconds", {}).items()}
            run |= {f"{mode}_s": round(t_conv, 2), f"{mode}_ratio_vs_cp": round(t_conv / (t_cp + t_sync), 2),
                    f"{mode}_in_process_ratio_vs_cp": round(stages.get("total", 0.0) / (t_cp + t_sync), 2),
                    f"{mode}_peak_rss_mib": rss // 1024, f"{mode}_stages": stages}
        runs.append(run)
    t_ver, _ = timed([PY, "-m", "mxfp4conv", "verify", str(src), str(work / "out"), "--json"])
    shutil.rmtree(work / "out")

    def med(key: str) -> float:
        xs = sorted(float(r[key]) for r in runs)  # type: ignore[arg-type]
        return xs[len(xs) // 2]

    last = runs[-1]
    emit(f"lossless {layout} -> {target}", gb=round(gb, 2), rounds=rounds,
         ratio_vs_cp=med("default_ratio_vs_cp"), ratios_vs_cp=[r["default_ratio_vs_cp"] for r in runs],
         no_verify_ratio_vs_cp=med("no_verify_ratio_vs_cp"), no_verify_ratios_vs_cp=[r["no_verify_ratio_vs_cp"] for r in runs],
         cp_s=[r["cp_s"] for r in runs], convert_s=[r["default_s"] for r in runs], no_verify_s=[r["no_verify_s"] for r in runs],
         standalone_verify_s=round(t_ver, 2),
         peak_rss_mib=max(int(r["default_peak_rss_mib"]) for r in runs),  # type: ignore[call-overload]
         in_process_ratios_vs_cp=[r["default_in_process_ratio_vs_cp"] for r in runs],
         stages=last["default_stages"], copy_mode=os.environ.get("MXFP4CONV_COPY", "default"),
         note="cp timed with a following sync (convert fsyncs every shard); ratio_vs_cp: the default command "
              "(verifies), median of the rounds; no_verify_*: the same with --no-verify; in_process: convert's own "
              "clock (without the Python start-up)")
    if drop_caches():
        t_cp_c, _ = timed(["cp", "-r", str(src), str(work / "cp")])
        t_sync, _ = timed(["sync"])
        shutil.rmtree(work / "cp")
        drop_caches()
        t_conv_c, _ = timed([PY, "-m", "mxfp4conv", "convert", str(src), str(work / "out"), "--to", target, "--no-verify"])
        shutil.rmtree(work / "out")
        emit(f"lossless {layout} -> {target} (cold)", cp_s=round(t_cp_c + t_sync, 2), convert_s=round(t_conv_c, 2),
             ratio_vs_cp=round(t_conv_c / (t_cp_c + t_sync), 2))
    else:
        emit(f"lossless {layout} -> {target} (cold)", skipped="cannot drop the page cache here (not permitted)")
    shutil.rmtree(src)


PLAIN_SCRIPT = '''
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir()
for shard in sorted(src.glob("*.safetensors")):
    t = load_file(str(shard))
    out = {}
    for name, w in t.items():
        if name.endswith(".weight") and w.dtype == torch.uint8:
            m = name[:-7]
            codes = torch.stack([w & 15, w >> 4], -1).reshape(w.shape[0], -1).long()
            s = t[m + ".weight_scale"].float().repeat_interleave(16, -1) * t[m + ".weight_scale_2"].float()
            x = E2M1[codes] * s
            b = x.reshape(x.shape[0], -1, 32)
            amax = b.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
            e = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
            q = (b / torch.exp2(e)).clamp(-6, 6)
            idx = (q.unsqueeze(-1) - E2M1[:8].abs().mul(torch.sign(q).unsqueeze(-1) + (q == 0).unsqueeze(-1))).abs().argmin(-1)
            out[m + ".weight_packed"] = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8).reshape(w.shape)
            out[m + ".weight_scale"] = (e.squeeze(-1) + 127).to(torch.uint8)
        elif not name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            out[name] = w
    save_file(out, str(dst / shard.name))
'''


def bench_nvfp4_cpu(work: Path, layers: int) -> None:
    src = generate(work / "nv-src", "modelopt-nvfp4", layers)
    warm(src)
    weights = layers * 128 * 3 * 2048 * 768
    t_conv, rss = timed([PY, "-m", "mxfp4conv", "convert", str(src), str(work / "nv-out"), "--to", "ct", "--device", "cpu",
                         "--no-verify", "--json"])
    shutil.rmtree(work / "nv-out")
    t_default, rss_default = timed([PY, "-m", "mxfp4conv", "convert", str(src), str(work / "nv-out"), "--to", "ct",
                                    "--device", "cpu", "--json"])
    script = work / "plain_requant.py"
    script.write_text(PLAIN_SCRIPT)
    t_plain, rss_plain = timed([PY, str(script), str(src), str(work / "nv-plain")])
    emit("nvfp4 -> mxfp4 end to end, CPU", weights=weights, default_convert_s=round(t_default, 2),
         default_peak_rss_mib=rss_default // 1024, convert_s=round(t_conv, 2),
         mweights_per_s=round(weights / t_conv / 1e6, 1), peak_rss_mib=rss // 1024,
         plain_script_s=round(t_plain, 2), plain_peak_rss_mib=rss_plain // 1024,
         speedup_vs_plain=round(t_plain / t_conv, 2), rss_ratio_vs_plain=round(rss / max(rss_plain, 1), 2))
    try:
        import compressed_tensors.entrypoints.convert  # noqa: F401

        peer = ("import sys;from compressed_tensors.entrypoints.convert.convert_checkpoint import convert_checkpoint;"
                "from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter;"
                "convert_checkpoint(sys.argv[1],sys.argv[2],ModelOptNvfp4Converter(ignore=['lm_head','re:.*mlp.gate$',"
                "'re:.*self_attn.*'],targets=['re:.*experts.*']),device='cpu')")
        t_peer, rss_peer = timed([PY, "-c", peer, str(src), str(work / "nv-peer")])
        emit("peer: compressed-tensors convert_checkpoint (ModelOpt NVFP4 -> ct-nvfp4, rename only)",
             peer_s=round(t_peer, 2), peer_peak_rss_mib=rss_peer // 1024, mxfp4conv_s=round(t_conv, 2),
             time_ratio_mxfp4conv_over_peer=round(t_conv / t_peer, 2), rss_ratio=round(rss / max(rss_peer, 1), 2))
    except ImportError:
        emit("peer: compressed-tensors convert_checkpoint", skipped="compressed-tensors not installed")
    except SystemExit as exc:
        emit("peer: compressed-tensors convert_checkpoint", failed=str(exc))
    for p in ("nv-out", "nv-plain", "nv-peer", "nv-src"):
        shutil.rmtree(work / p, ignore_errors=True)


def bench_rss_flat(work: Path, base_layers: int) -> None:
    rows = []
    for mult in (1, 2, 4):
        src = generate(work / f"rss-{mult}", "ct-mxfp4", base_layers * mult)
        _, rss = timed([PY, "-m", "mxfp4conv", "convert", str(src), str(work / f"rss-out-{mult}"), "--to", "quark", "--json"])
        rows.append({"x": mult, "model_gb": round(size(src) / 1e9, 2), "peak_rss_mib": rss // 1024})
        shutil.rmtree(src)
        shutil.rmtree(work / f"rss-out-{mult}")
    layer_mib = 128 * 3 * 2048 * 768 * (0.5 + 1 / 32) / 2**20
    emit("peak RSS vs model size (ct-mxfp4 -> quark, with verify)", rows=rows, largest_layer_mib=round(layer_mib, 1),
         budget_mib=round(1024 + 2 * layer_mib, 1), flat=max(r["peak_rss_mib"] for r in rows) <= 1024 + 2 * layer_mib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/mxfp4conv-bench"))
    ap.add_argument("--layers", type=int, default=13, help="qwen3-like layers for the lossless case (13 = 4.2 GB)")
    ap.add_argument("--gpt-oss-layers", type=int, default=10, help="gpt-oss-like layers (10 = 4.0 GB)")
    ap.add_argument("--nvfp4-layers", type=int, default=2)
    ap.add_argument("--rss-layers", type=int, default=2)
    ap.add_argument("--only", default="lossless,nvfp4,rss")
    ap.add_argument("--rounds", type=int, default=3, help="alternating cp / convert pairs per lossless case")
    ap.add_argument("--lossless", default="ct-mxfp4,gpt-oss", help="which lossless cases (source layouts)")
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    emit("machine", host=platform.node(), cpus=os.cpu_count(), python=platform.python_version(),
         date=time.strftime("%Y-%m-%d"))
    only = set(args.only.split(","))
    if "lossless" in only:
        if "ct-mxfp4" in args.lossless:
            bench_lossless(args.work, "ct-mxfp4", "quark", args.layers, args.rounds)
        if "gpt-oss" in args.lossless:
            bench_lossless(args.work, "gpt-oss", "gpt-oss", args.gpt_oss_layers, args.rounds)
    if "nvfp4" in only:
        bench_nvfp4_cpu(args.work, args.nvfp4_layers)
    if "rss" in only:
        bench_rss_flat(args.work, args.rss_layers)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
