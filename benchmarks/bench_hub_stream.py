"""A Hub repo converted three ways, against a loopback Hub throttled to a fixed rate (tests/hub_server.py):

* ``snapshot_download`` of the repo alone (the download a user waits for today);
* download then convert: that download, then ``mxfp4conv convert`` of the downloaded folder;
* ``mxfp4conv convert org/model DST --stream`` (no local copy of the source).

Alternating rounds, each in fresh processes with an empty huggingface_hub cache; wall seconds, the
bytes the server sent, the most disk in use meanwhile (cache + output, sampled every 0.2 s) and at the
end, the peak RSS of the converting process, and how long the run went on after the link sent its
last byte (``tail_s``), when it first asked for a shard's bytes (``first_shard_byte_s``) and how long
the link had nothing to send between its first and last body byte (``link_idle_s``: time the
client did not ask for bytes it could have had). One JSON line per run, then the medians and their ratios, among them the
stream against the larger of the download and the local conversion of the downloaded folder
(``stream_vs_max_download_local``): a stream can beat neither.

    PYTHONPATH=. python3 benchmarks/bench_hub_stream.py [--layout ct-nvfp4] [--layers 2] [--rate-mb 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from gen_checkpoint import generate  # noqa: E402
from rss_watch import status  # noqa: E402

from tests.hub_server import hub  # noqa: E402

REPO = "bench/qwen3"


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) if path.exists() else 0


def env(url: str, cache: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith(("HF_", "HUGGING"))}
    out.update(HF_ENDPOINT=url, HF_HUB_CACHE=str(cache), HF_HOME=str(cache / "home"), HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", NO_PROXY="127.0.0.1,localhost",
               PYTHONPATH=str(ROOT))
    return out


def run(cmd: list[str], e: dict[str, str]) -> tuple[float, int, str]:
    """Wall seconds, the child's peak RSS in bytes, its last stdout line. The peak is the child's own
    high-water mark (``VmHWM``, read every 20 ms until it exits): ``ru_maxrss`` would count the pages of
    this process, which holds the served repo, that the child had before its exec."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, env=e, stdout=out, stderr=err, text=True)
        peak = 0
        while proc.poll() is None:
            st = status(proc.pid)
            if st is not None:
                peak = max(peak, st["VmHWM"] * 1024)
            time.sleep(0.02)
        wall = time.perf_counter() - t
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise SystemExit(f"{cmd[:4]} failed: {err.read()[-2000:]}")
        return wall, peak, (out.read().strip().splitlines() or [""])[-1]


class DiskPeak:
    """The most bytes under ``paths`` while the block runs."""

    def __init__(self, *paths: Path) -> None:
        self.paths, self.peak, self._stop = paths, 0, threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, sum(du(p) for p in self.paths))

    def __enter__(self) -> DiskPeak:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, sum(du(p) for p in self.paths))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="ct-nvfp4", help="gen_checkpoint.py's layout of the repo")
    ap.add_argument("--target", default="ct")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--shape", default="qwen3", choices=["qwen3", "deepseek"], help="gen_checkpoint.py's expert shape")
    ap.add_argument("--rate-mb", type=float, default=100.0, help="the Hub's rate, MB/s (all connections)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_hub_stream"))
    ap.add_argument("--device", default="cpu", help="the conversions' --device (auto: the GPU where there is one)")
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    src = a.work / "src"
    generate(src, a.layout, a.layers, shape=a.shape)
    size = du(src)
    py = sys.executable
    convert = [py, "-m", "mxfp4conv", "convert"]
    flags = ["--to", a.target, "--device", a.device]
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
                rss, convert_s = 0, 0.0
                began = time.monotonic()
                with DiskPeak(cache, out) as disk:
                    if case == "stream":
                        wall, rss, _ = run([*convert, REPO, str(out), *flags, "--stream"], e)
                    else:
                        code = f"from huggingface_hub import snapshot_download; print(snapshot_download({REPO!r}))"
                        wall, _, folder = run([py, "-c", code], e)
                        if case == "download+convert":
                            convert_s, rss, _ = run([*convert, folder, str(out), *flags], e)
                            wall += convert_s
                    tail = time.monotonic() - h.link_free_at  # the case's end after the link's last byte
                # when the first byte of a shard was asked for, after the case's first process started
                cdn = [r.at for r in h.requests(lambda r: r.host == "cdn" and r.method == "GET")]
                first = round(min(cdn) - began, 2) if cdn else None
                doc = {"wall_s": round(wall, 2), "convert_s": round(convert_s, 2), "tail_s": round(tail, 2), "first_shard_byte_s": first,
                       "link_idle_s": round(h.link_idle, 2), "sent_gb": round(h.sent() / 1e9, 3),
                       "disk_gb": round((du(cache) + du(out)) / 1e9, 3), "peak_disk_gb": round(disk.peak / 1e9, 3),
                       "output_gb": round(du(out) / 1e9, 3), "rss_gb": round(rss / 1e9, 3)}
                rows[case].append(doc)
                print(json.dumps({"date": time.strftime("%Y-%m-%d"), "case": case, "round": r + 1, "layout": a.layout,
                                  "shape": a.shape, "layers": a.layers, "source_gb": round(size / 1e9, 3), "rate_mb_s": a.rate_mb, **doc}),
                      flush=True)
    med = {case: statistics.median(d["wall_s"] for d in v) for case, v in rows.items()}
    # The local conversion alone: the convert step of each download+convert round. A stream can beat
    # neither it nor the download, so the bound is the larger of the two.
    local = statistics.median(d["convert_s"] for d in rows["download+convert"])
    floor = max(med["download"], local)
    print(json.dumps({"case": "median", "layout": a.layout, "shape": a.shape, "layers": a.layers,
                      "source_gb": round(size / 1e9, 3),
                      "rate_mb_s": a.rate_mb, "wall_s": med,
                      "local_convert_s": round(local, 2), "device": a.device,
                      "stream_vs_download": round(med["stream"] / med["download"], 2),
                      "stream_vs_max_download_local": round(med["stream"] / floor, 2),
                      "download_then_convert_vs_stream": round(med["download+convert"] / med["stream"], 2)}))


if __name__ == "__main__":
    main()
