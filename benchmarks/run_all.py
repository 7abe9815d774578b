"""`make bench`: every benchmark, one JSON line per case on stdout (also saved under benchmarks/results/)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = [["bench_requant_cpu.py"], ["bench_marlin.py"], ["bench_convert.py"], ["probe_hash_cost.py", "--runs", "2"]]


def main() -> None:
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    log = out_dir / f"bench_{time.strftime('%Y-%m-%d')}_cpu.jsonl"
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
