"""The milestones of a conversion's start, as users run it: when torch is imported, SRC planned, the
first unit read and requantized, the first bytes written, and when the process ends.

    PYTHONPATH=. python3 tools/trace_start.py OUT_DIR --src SRC [--rounds 3]
        [--variants "new:;base:CWD=/path/to/checkout"] [-- EXTRA CONVERT FLAGS]

Each round runs ``python -m mxfp4conv convert SRC DST --to ct --json`` (the default command; EXTRA
flags such as ``--no-verify`` or ``--device cuda`` are added) once per variant, in turn, each in a
fresh process. The process runs the CLI as ``python -m mxfp4conv`` does, with timestamps (seconds
since the launcher started it) taken by wrappers around a few functions and around the imports of
torch, numpy, triton and the package's modules, and by a thread that watches the staged shards'
size every 5 ms; nothing else of the command changes. A variant's ``CWD`` runs the checkout found
there (a same-run A/B of two versions); its other variables are set in the conversion's environment
(``pyc:PYTHONPYCACHEPREFIX=/tmp/pyc``: torch's bytecode from a cache, ``tools/import_bytecode.sh``).
The first line says whether torch's bytecode is cached for a process started as this one; every
event goes to OUT_DIR/trace_<variant>_r<round>.txt; one JSON line per run gives the milestones, then
the medians per variant.
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

# milestone -> its event's text (the first such event's time is the milestone's)
MILESTONES = {
    "torch_imported": "import torch end",
    "planned": "prepare end#0",
    "writing_starts": "_write_all start#0",
    "first_unit_read": "unit_read end#0",
    "kernel_module": "_jit end#0",
    "first_requant": "kernel end#0",
    "first_device_write": "write_device start#0",
    "staged_1gib": "staged >= 1.000 GiB",
    "exit": "exit",
}

# module -> functions wrapped (attribute, event label) once the module is imported
_PATCH = {
    "mxfp4conv.kernels.requant_triton": [("_jit", "_jit"), ("requant_rows_into", "kernel")],
    "mxfp4conv.run.pipeline": [("_write_all", "_write_all"), ("prepare", "prepare"), ("resolve_device", "resolve_device")],
    "mxfp4conv.numerics.units": [("_read", "unit_read"), ("_transform_on", "transform_on")],
    "mxfp4conv.device.device_write": [("write_device", "write_device"), ("gather", "gather")],
    "mxfp4conv.files.device_read": [("read_to_device", "read_to_device")],
}
_IMPORTS = {"torch", "numpy", "triton", "mxfp4conv.cli", "mxfp4conv.numerics.requant", "mxfp4conv.kernels._requant_triton_jit"}


def child(trace: str, t0: float, argv: list[str]) -> None:
    """Run the CLI (``argv``: convert SRC DST ...) with the wrappers above; never returns."""
    import importlib.abc
    import threading

    out = open(trace, "a", buffering=1)  # noqa: SIM115 - open until the process ends

    def mark(name: str) -> None:
        out.write(f"{time.time() - t0:8.3f} {threading.current_thread().name:24s} {name}\n")

    mark("python_up")

    def wrap(mod: object, attr: str, label: str) -> None:
        fn = getattr(mod, attr, None)
        if fn is None:
            return
        calls = [0]

        def timed(*a: object, **k: object) -> object:
            n = calls[0]
            calls[0] += 1
            if n < 2:
                mark(f"{label} start#{n}")
            try:
                return fn(*a, **k)
            finally:
                if n < 2:
                    mark(f"{label} end#{n}")
        setattr(mod, attr, timed)

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name not in _IMPORTS and name not in _PATCH:
                return None
            for f in sys.meta_path:
                if f is not self and (spec := getattr(f, "find_spec", lambda *a: None)(name, path, target)):
                    break
            else:
                return None
            run = spec.loader.exec_module

            def exec_module(module):  # type: ignore[no-untyped-def]
                mark(f"import {name} start")
                run(module)
                mark(f"import {name} end")
                for attr, label in _PATCH.get(name, []):
                    wrap(module, attr, label)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())
    dst = os.path.abspath(argv[2])
    staging = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.mxfp4conv-staging")

    def watch() -> None:
        marks = [1 << 20, 1 << 30, 4 << 30, 8 << 30, 16 << 30]
        while marks:
            try:
                size = sum(e.stat().st_size for e in os.scandir(staging) if e.name.endswith(".safetensors"))
            except OSError:
                size = 0
            while marks and size >= marks[0]:
                mark(f"staged >= {marks.pop(0) / 2**30:.3f} GiB")
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True, name="watch").start()
    exit_now = os._exit

    def end(code: int) -> None:
        mark("exit")
        exit_now(code)

    os._exit = end  # type: ignore[assignment]  # the CLI ends through os._exit
    sys.argv = ["mxfp4conv", *argv]
    from mxfp4conv.cli import main

    main()


def milestones(trace: Path) -> dict[str, float | None]:
    events = [(float(t), text) for t, _, text in (line.split(None, 2) for line in trace.read_text().splitlines())]
    return {k: next((t for t, text in events if text == want), None) for k, want in MILESTONES.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="new:",
                    help="';'-separated NAME:VAR=V,... ('new:' = this checkout as is); CWD=FOLDER runs the checkout "
                         "there, any other VAR is set in the conversion's environment")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = ap.parse_args(argv[:cut]), argv[cut + 1:]  # after "--": more convert flags
    args.out.mkdir(parents=True, exist_ok=True)
    from device_e2e import parse_variants, torch_bytecode_cached  # the same NAME:VAR=V;... syntax

    variants = parse_variants(args.variants)
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "torch_bytecode_cached": torch_bytecode_cached()}), flush=True)
    dst = args.out / "dst"
    rows: dict[str, list[dict[str, float | None]]] = {name: [] for name, _ in variants}
    for r in range(args.rounds):
        for name, env in variants:
            shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            trace = args.out / f"trace_{name}_r{r + 1}.txt"
            trace.unlink(missing_ok=True)
            cwd = Path(env.get("CWD", ".")).resolve()
            t0 = time.time()
            res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(trace), str(t0), "convert",
                                  str(args.src.resolve()), str(dst.resolve()), "--to", "ct", "--json", *extra],
                                 cwd=cwd, env={**os.environ, **{k: v for k, v in env.items() if k != "CWD"},
                                               "PYTHONPATH": str(cwd)}, capture_output=True, text=True)
            wall = time.time() - t0
            if res.returncode:
                raise SystemExit(f"{name}: convert failed ({res.returncode}): {res.stderr[-2000:]}")
            row = {"wall_s": round(wall, 3), **milestones(trace)}
            rows[name].append(row)
            print(json.dumps({"round": r + 1, "variant": name, **row}), flush=True)
    for name, runs in rows.items():
        med: dict[str, float | None] = {}
        for k in runs[0]:
            got = [x for x in (run[k] for run in runs) if x is not None]
            med[k] = round(statistics.median(got), 3) if got else None
        print(json.dumps({"variant": name, "rounds": len(runs), "median": med}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], float(sys.argv[3]), sys.argv[4:])
    else:
        main()
