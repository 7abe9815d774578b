"""``--to mlx`` or ``--to gguf`` of a lossless source against ``cp -r`` + ``sync`` of the same files (target: at
most 1.15x).

A generated Qwen3-30B-A3B-shaped ct-mxfp4 checkpoint (``gen_checkpoint.py``: 128 experts of hidden 2048,
intermediate 768; 13 layers = 4.2 GB; for ``gguf`` a byte-level BPE tokenizer of the embedding's 1024 rows is
added, as llama.cpp needs one), warm page cache. Each round runs, one after the other: the copy, the target
(the default command, which verifies), the target with ``--no-verify``, and ``--to quark`` (the lossless
rename, as a yardstick measured under the same load); each convert is a ratio to its round's copy and the
medians are the figures. The MLX output stacks each projection's experts by copying their source ranges one
after the other, so no tensor is decoded; the GGUF output re-lays every MXFP4 block out (17 bytes: scale,
then the codes in GGML's nibble order) and its proof decodes them back. Prints one JSON line per case.

    python benchmarks/bench_targets.py --to mlx --work /tmp/mxbench-mlx --layers 13 --rounds 5
    python benchmarks/bench_targets.py --to gguf --layers 13 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests.gguf_runtime (the GGUF case's tokenizer)
import bench_convert


def _round(src: Path, work: Path, target: str) -> dict[str, float]:
    subprocess.run(["sync"], check=True)
    t_cp, _ = bench_convert.timed(["cp", "-r", str(src), str(work / "cp")])
    t_sync, _ = bench_convert.timed(["sync"])
    shutil.rmtree(work / "cp")
    out = {"cp_s": t_cp + t_sync}
    for case, flags in ((target, ["--to", target]), (f"{target}_no_verify", ["--to", target, "--no-verify"]),
                        ("quark", ["--to", "quark"])):
        shutil.rmtree(work / "out", ignore_errors=True)
        subprocess.run(["sync"], check=True)
        t, rss = bench_convert.timed([bench_convert.PY, "-m", "mxfp4conv", "convert", str(src), str(work / "out"), *flags])
        out |= {f"{case}_s": t, f"{case}_ratio": t / out["cp_s"], f"{case}_rss_mib": rss / 1024}
    shutil.rmtree(work / "out")
    return out


def _add_tokenizer(src: Path, copy_from: Path | None = None) -> None:
    """A byte-level BPE tokenizer with one token per embedding row (the generated config says 256);
    ``copy_from``: a folder holding such a tokenizer's two files (where the tokenizers library is not
    installed)."""
    import json

    cfg = json.loads((src / "config.json").read_text())
    cfg["vocab_size"] = 1024  # gen_checkpoint.py's embedding rows
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    if copy_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(copy_from / name, src / name)
        return
    from tests.gguf_runtime.gguf_cases import add_bpe_tokenizer

    add_bpe_tokenizer(src, 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--to", dest="target", choices=["mlx", "gguf"], default="mlx")
    ap.add_argument("--work", type=Path, default=Path("/tmp/mxfp4conv-bench-targets"))
    ap.add_argument("--layers", type=int, default=13, help="qwen3-like layers (13 = 4.2 GB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokenizer", type=Path, help="for gguf: copy tokenizer.json and tokenizer_config.json from this "
                                                   "folder (a 1024-token one this script made) instead of building it")
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    bench_convert.emit("machine", host=platform.node(), cpus=os.cpu_count(), python=platform.python_version(),
                       date=time.strftime("%Y-%m-%d"), load_avg=os.getloadavg())
    src = bench_convert.generate(args.work / "src", "ct-mxfp4", args.layers)
    if args.target == "gguf":
        _add_tokenizer(src, args.tokenizer)
    bench_convert.warm(src)
    subprocess.run([bench_convert.PY, "-m", "mxfp4conv", "convert", str(src), str(args.work / "out"), "--to", args.target],
                   check=True, capture_output=True)  # untimed: both tools then start warm
    shutil.rmtree(args.work / "out")
    runs = [_round(src, args.work, args.target) for _ in range(args.rounds)]

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in runs), 2)

    t = args.target
    bench_convert.emit(f"lossless ct-mxfp4 -> {t}", gb=round(bench_convert.size(src) / 1e9, 2), rounds=args.rounds,
                       ratio_vs_cp=med(f"{t}_ratio"), no_verify_ratio_vs_cp=med(f"{t}_no_verify_ratio"),
                       quark_ratio_vs_cp=med("quark_ratio"),
                       rounds_detail=[{k: round(v, 2) for k, v in r.items()} for r in runs],
                       load_avg_after=os.getloadavg())
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
