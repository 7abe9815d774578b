"""A Hub repo converted three ways, against a loopback Hub throttled to a fixed rate (tests/hub_server.py):

* ``snapshot_download`` of the repo alone (the download a user waits for today);
* download then convert: that download, then ``mxfp4conv convert`` of the downloaded folder;
* ``mxfp4conv convert org/model DST --stream`` (no local copy of the source).

Alternating rounds, each in fresh processes with an empty huggingface_hub cache; wall seconds, the
bytes the server sent, and the disk each left behind (cache + output). One JSON line per run, then
the medians and their ratios.

    PYTHONPATH=. python3 benchmarks/bench_hub_stream.py [--layers 2] [--rate-mb 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from gen_checkpoint import generate  # noqa: E402

from tests.hub_server import hub  # noqa: E402

REPO = "bench/qwen3-nvfp4"


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) if path.exists() else 0


def env(url: str, cache: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith(("HF_", "HUGGING"))}
    out.update(HF_ENDPOINT=url, HF_HUB_CACHE=str(cache), HF_HOME=str(cache / "home"), HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", NO_PROXY="127.0.0.1,localhost",
               PYTHONPATH=str(ROOT))
    return out


def run(cmd: list[str], e: dict[str, str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rate-mb", type=float, default=100.0, help="the Hub's rate, MB/s (all connections)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_hub_stream"))
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    src = a.work / "src"
    generate(src, "ct-nvfp4", a.layers)
    size = du(src)
    py = sys.executable
    rows: dict[str, list[dict[str, float]]] = {"download": [], "download+convert": [], "stream": []}
    with hub() as h:
        h.add_repo(REPO, src)
        h.rate = a.rate_mb * 1e6
        for r in range(a.rounds):
            for case in rows:
                cache, out = a.work / f"cache-{case}", a.work / f"out-{case}"
                shutil.rmtree(cache, ignore_errors=True)
                shutil.rmtree(out, ignore_errors=True)
                e = env(h.url, cache)
                h.clear_log()
                if case == "stream":
                    wall = run([py, "-m", "mxfp4conv", "convert", REPO, str(out), "--to", "ct", "--device", "cpu",
                                "--stream"], e)
                else:
                    code = f"from huggingface_hub import snapshot_download; print(snapshot_download({REPO!r}))"
                    t = time.perf_counter()
                    folder = subprocess.run([py, "-c", code], check=True, env=e, capture_output=True,
                                            text=True).stdout.strip().splitlines()[-1]
                    wall = time.perf_counter() - t
                    if case == "download+convert":
                        wall += run([py, "-m", "mxfp4conv", "convert", folder, str(out), "--to", "ct", "--device",
                                     "cpu"], e)
                doc = {"wall_s": round(wall, 2), "sent_gb": round(h.sent() / 1e9, 3),
                       "disk_gb": round((du(cache) + du(out)) / 1e9, 3)}
                rows[case].append(doc)
                print(json.dumps({"date": time.strftime("%Y-%m-%d"), "case": case, "round": r + 1,
                                  "source_gb": round(size / 1e9, 3), "rate_mb_s": a.rate_mb, **doc}), flush=True)
    med = {case: statistics.median(d["wall_s"] for d in v) for case, v in rows.items()}
    print(json.dumps({"case": "median", "source_gb": round(size / 1e9, 3), "rate_mb_s": a.rate_mb, "wall_s": med,
                      "stream_vs_download": round(med["stream"] / med["download"], 2),
                      "download_then_convert_vs_stream": round(med["download+convert"] / med["stream"], 2)}))


if __name__ == "__main__":
    main()
