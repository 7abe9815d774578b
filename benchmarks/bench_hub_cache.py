"""What checking a downloaded repo costs: ``convert org/model DST`` from huggingface_hub's cache
(every file hashed as it is read and checked against the cache's record of its sha256) against the
same default command on the snapshot folder itself (a local SRC, nothing checked), alternated.

    python benchmarks/bench_hub_cache.py [--layout ct-mxfp4] [--layers 2] [--rounds 4] [--to ct] [--work DIR]

The checkpoint is generated (``gen_checkpoint.py``) and laid out as huggingface_hub's cache lays a
download out (``blobs/<sha256>``, ``snapshots/<commit>/<file>`` links); the repo id is read with
``HF_HUB_OFFLINE=1``, so the two commands differ only in the check. Each run: wall seconds, peak RSS,
and, from ``--json``, the bytes read from the cache. One JSON line per run, then the medians and their ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ab_cli import _TIMED  # noqa: E402 - the wrapper that measures one run's own peak RSS

REPO = "bench-org/bench-model"
COMMIT = "0" * 40


def fill_cache(src: Path, cache: Path) -> Path:
    repo = cache / ("models--" + REPO.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in sorted(src.iterdir()):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
        os.replace(f, repo / "blobs" / h.hexdigest())
        os.symlink(Path("..") / ".." / "blobs" / h.hexdigest(), snap / f.name)
    return snap


def timed(name: str, src: str, dst: Path, to: str, env: dict[str, str]) -> dict[str, object]:
    """One conversion in a wrapper process of its own (``ab_cli``'s), so its peak RSS is its alone."""
    shutil.rmtree(dst, ignore_errors=True)
    cmd = [sys.executable, "-c", _TIMED, str(HERE.parent), sys.executable, "-m", "mxfp4conv", "convert", src, str(dst),
           "--to", to, "--device", "cpu", "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    wall, _, _, rss_kib, rc, stdout, stderr = json.loads(out.stdout.strip().splitlines()[-1])
    if rc:
        raise SystemExit(f"{name}: exit {rc}: {stderr}")
    doc = json.loads(stdout)
    return {"run": name, "wall_s": round(wall, 3), "peak_rss_gb": round(rss_kib * 1024 / 1e9, 3),
            "bytes_read_from_cache": (doc.get("hub") or {}).get("bytes_fetched"),
            "seconds": {k: round(v, 2) for k, v in doc["seconds"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="ct-mxfp4")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--to", default="ct")
    ap.add_argument("--work", type=Path, default=Path(".bench/hub_cache"))
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    gen = args.work / "gen"
    subprocess.run([sys.executable, str(HERE.parent / "tools" / "gen_checkpoint.py"), str(gen), "--layout", args.layout,
                    "--layers", str(args.layers)], check=True, stdout=subprocess.DEVNULL)
    cache = args.work / "hf"
    snap = fill_cache(gen, cache)
    size = sum(p.stat().st_size for p in snap.iterdir() if p.suffix == ".safetensors")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_HOME=str(args.work / "home"))
    runs: dict[str, list[float]] = {"folder": [], "repo_id": []}
    for i in range(args.rounds):
        order = [("folder", str(snap)), ("repo_id", REPO)]
        for name, src in order if i % 2 == 0 else order[::-1]:
            rec = timed(name, src, args.work / f"out-{name}", args.to, env)
            rec["round"] = i
            print(json.dumps(rec), flush=True)
            runs[name].append(float(rec["wall_s"]))  # type: ignore[arg-type]
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(json.dumps({"layout": args.layout, "layers": args.layers, "to": args.to, "source_bytes": size,
                      "median_wall_s": med, "ratio_repo_id_over_folder": round(med["repo_id"] / med["folder"], 3)}))


if __name__ == "__main__":
    main()
