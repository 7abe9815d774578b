"""When a command reaches its peak RSS, and of what kind that memory is.

    python3 tools/rss_watch.py [--period 0.002] -- COMMAND ...

Runs COMMAND and reads its ``/proc/PID/status`` every PERIOD seconds: anonymous, file-backed and
shared resident memory, and the high-water mark (``VmHWM``, what ``getrusage``'s ``ru_maxrss``
reports). Prints one JSON line: the last high-water mark seen, when it was reached (seconds from the
start), the resident memory by kind at the sample that first showed it, and the samples of the 0.5 s
around it; a peak that no sample shows (shorter than the period) says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

_KEYS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def status(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key = line.split(":", 1)[0]
        if key in _KEYS:
            out[key] = int(line.split()[1])  # kB
    return out if len(out) == len(_KEYS) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--period", type=float, default=0.002)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    samples: list[tuple[float, dict[str, int]]] = []
    while proc.poll() is None:
        s = status(proc.pid)
        if s is not None:
            samples.append((time.perf_counter() - t0, s))
        time.sleep(args.period)
    if not samples:
        raise SystemExit("no sample of the command's memory")
    hwm = samples[-1][1]["VmHWM"]
    at, first = next((t, s) for t, s in samples if s["VmHWM"] == hwm)
    shown = max(s["VmRSS"] for _, s in samples)
    near = [{"t": round(t, 3), **{k: round(v / 1e6, 3) for k, v in s.items()}} for t, s in samples if abs(t - at) <= 0.25]
    print(json.dumps({"command": " ".join(cmd[:4]), "exit_code": proc.returncode, "wall_s": round(time.perf_counter() - t0, 2),
                      "samples": len(samples), "hwm_gb": round(hwm / 1e6, 3), "hwm_reached_at_s": round(at, 3),
                      "largest_sampled_rss_gb": round(shown / 1e6, 3), "peak_between_samples": shown < hwm,
                      "at_hwm": {k: round(v / 1e6, 3) for k, v in first.items()}, "around": near[::max(1, len(near) // 25)]}))


if __name__ == "__main__":
    main()
