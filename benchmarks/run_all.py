"""`make bench`: the CPU benchmarks, one JSON line per case on stdout, also saved to
``.bench/bench_<date>_cpu.jsonl`` (an untracked folder; ``--out-dir`` to change it).

The GPU benchmarks (``bench_requant_gpu.py``, ``device_e2e.py``: the default command and
``--no-verify`` against ``cp -r`` + ``sync``) need a CUDA machine and are run by hand (BENCHMARKS.md
gives each command). The checkpoint generator, the profilers (``device_profile.py``,
``probe_start.py``, ``trace_start.py``, ``rss_watch.py``, ``import_bytecode.sh``) and the header
fuzzer live in ``tools/``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the last one times the default command and --no-verify against llm-compressor (a few minutes)
SCRIPTS = [["bench_requant_cpu.py"], ["bench_marlin.py"], ["bench_convert.py"],
           ["bench_peer_llmcompressor.py", "--layers", "2", "--rounds", "3"], ["bench_hub_stream.py"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=HERE.parent / ".bench")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log = args.out_dir / f"bench_{time.strftime('%Y-%m-%d')}_cpu.jsonl"
    with open(log, "w") as fh:
        for script in SCRIPTS:
            proc = subprocess.run([sys.executable, str(HERE / script[0]), *script[1:]],
                                  capture_output=True, text=True)
            sys.stdout.write(proc.stdout)
            fh.write(proc.stdout)
            if proc.returncode:
                sys.stderr.write(proc.stderr)
                raise SystemExit(f"{script[0]} failed with exit code {proc.returncode}")
    print(f"saved {log}", file=sys.stderr)


if __name__ == "__main__":
    main()
