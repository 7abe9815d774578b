"""The default command from two (or more) checkouts, alternated on one checkpoint: a same-run A/B.

    python benchmarks/ab_cli.py --checkout new=. --checkout base=/tmp/base [--layers 2] [--rounds 4]
        [--device cpu] [--src SRC] [--env NAME:VAR=VALUE ...] [-- EXTRA CONVERT FLAGS]

Each round runs ``python -m mxfp4conv convert SRC DST --to ct --device DEVICE --json`` once in each
checkout's folder (so ``python -m`` runs that checkout's package), in turn, each in a fresh process:
wall seconds, user and sys CPU seconds and peak RSS of the process, and its ``--json`` per-stage
seconds. ``--env`` sets an environment variable for one checkout's runs (two names for one folder,
one with ``--env``, compare a setting). SRC is a generated compressed-tensors NVFP4 checkpoint (``gen_checkpoint.py``) unless given.
One JSON line per run, then the medians per checkout.
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


_TIMED = ("import json,resource,subprocess,sys,time;t=time.perf_counter();"
          "r=subprocess.run(sys.argv[2:],cwd=sys.argv[1],stdout=subprocess.PIPE,stderr=subprocess.PIPE,text=True);"
          "w=time.perf_counter()-t;u=resource.getrusage(resource.RUSAGE_CHILDREN);"
          "print(json.dumps([w,u.ru_utime,u.ru_stime,u.ru_maxrss,r.returncode,r.stdout,r.stderr[-2000:]]))")


def timed(checkout: Path, src: Path, dst: Path, device: str, extra: list[str],
          env: dict[str, str] | None = None) -> dict[str, object]:
    """One conversion in a wrapper process of its own, so its CPU times and peak RSS are its alone."""
    cmd = [sys.executable, "-c", _TIMED, str(checkout), sys.executable, "-m", "mxfp4conv", "convert", str(src),
           str(dst), "--to", "ct", "--device", device, "--json", *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall, user, sys_s, rss_kib, rc, stdout, stderr = json.loads(out.stdout.strip().splitlines()[-1])
    if rc:
        raise SystemExit(f"convert failed in {checkout} ({rc}): {stderr}")
    doc = json.loads(stdout)
    return {"wall_s": round(wall, 3), "user_s": round(user, 2), "sys_s": round(sys_s, 2),
            "peak_rss_gb": round(rss_kib * 1024 / 1e9, 3),
            "seconds": {k: round(v, 2) for k, v in doc.get("seconds", {}).items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--checkout", action="append", required=True, help="NAME=FOLDER (repeat; two or more)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--env", action="append", default=[], help="NAME:VAR=VALUE, for that checkout's runs (repeat)")
    ap.add_argument("--src", type=Path, help="an NVFP4 checkpoint to convert instead of a generated one")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ab_cli"))
    ap.add_argument("--out", type=Path, help="also write the JSON lines here")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="-- then more convert flags")
    args = ap.parse_args()
    checkouts = [(n, Path(f).resolve()) for n, _, f in (c.partition("=") for c in args.checkout)]
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    envs: dict[str, dict[str, str]] = {n: {} for n, _ in checkouts}
    for item in args.env:
        name, _, assign = item.partition(":")
        var, _, value = assign.partition("=")
        envs[name][var] = value
    log = open(args.out, "w") if args.out else None  # noqa: SIM115

    def emit(**kw: object) -> None:
        line = json.dumps({"date": time.strftime("%Y-%m-%d"), **kw})
        print(line, flush=True)
        if log:
            log.write(line + "\n")

    shutil.rmtree(args.work / "out", ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)  # DST's parent, also when SRC is given
    src = args.src
    if src is None:
        sys.path.insert(0, str(HERE.parent / "tools"))
        from gen_checkpoint import generate, warm

        shutil.rmtree(args.work, ignore_errors=True)
        src = generate(args.work / "src", "ct-nvfp4", args.layers, device="cpu")
        warm(src)
    emit(case="machine", cpus=os.cpu_count(), loadavg=os.getloadavg()[0], src=str(src))
    for name, folder in checkouts:  # untimed: each checkout builds its compiled helpers once
        timed(folder, src, args.work / "out", args.device, ["--no-verify"], envs[name])
        shutil.rmtree(args.work / "out", ignore_errors=True)
    rows: dict[str, list[dict[str, object]]] = {n: [] for n, _ in checkouts}
    for r in range(args.rounds):
        for name, folder in checkouts:
            row = timed(folder, src, args.work / "out", args.device, extra, envs[name])
            shutil.rmtree(args.work / "out", ignore_errors=True)
            rows[name].append(row)
            emit(case="run", round=r + 1, checkout=name, env=envs[name], **row)
    for name, mine in rows.items():
        emit(case="median", checkout=name, rounds=len(mine),
             **{k: round(statistics.median(float(x[k]) for x in mine), 3)  # type: ignore[arg-type]
                for k in ("wall_s", "user_s", "sys_s", "peak_rss_gb")},
             verify_busy_s=[x["seconds"].get("verify") for x in mine])  # type: ignore[union-attr]
    if log:
        log.close()


if __name__ == "__main__":
    main()
