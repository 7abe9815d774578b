"""How fast the head start makes successive NVFP4 units, and what it costs torch's import beside it.

    PYTHONPATH=. python3 benchmarks/probe_head_start.py MODE SRC [N]

MODE ``alone``: the first N MoE units of SRC made one after another by ``head_start.make`` (no torch
in the process); ``concurrent``: the same while a helper thread imports torch, starts CUDA and loads the
GPU kernel's module, as a fresh ``convert`` on a GPU does; ``after``: torch imported and CUDA started first. Prints one JSON
line: torch's import and ready times, and per unit its start, seconds, read and kernel seconds.
"""

from __future__ import annotations

import json
import sys
import threading
import time

T0 = time.perf_counter()

from mxfp4conv import head_start  # noqa: E402
from mxfp4conv.job import ConvertOptions, prepare  # noqa: E402
from mxfp4conv.kernels import requant_native  # noqa: E402


def main() -> None:
    mode, src = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    requant_native.load()  # built before the clock matters (cached per user)
    imported: dict[str, float] = {}

    def start_torch() -> None:
        t = time.perf_counter()
        import torch

        imported["torch_s"] = round(time.perf_counter() - t, 3)
        if torch.cuda.is_available():
            torch.cuda.init()
            from mxfp4conv.kernels.requant_triton import _jit

            _jit()  # triton and the GPU kernel's module, as convert's device start loads them
        imported["ready_at_s"] = round(time.perf_counter() - T0, 3)

    if mode == "after":
        start_torch()
    job = prepare(src, ConvertOptions(target="ct", device="cuda"))
    units = [u for u in job.plan.units if u.kind == "moe"][:n]
    first = head_start.first_unit(units, [None] * len(units), job.layout)
    if first is None:
        raise SystemExit("no unit the head start can make in SRC")
    helper = threading.Thread(target=start_torch) if mode == "concurrent" else None
    if helper is not None:
        helper.start()
    rows = []
    for u in units:
        t = time.perf_counter()
        hs = head_start.make(u, job.ckpt, first[1], "mse")
        if hs is None:
            raise SystemExit("the head start could not make a unit (no compiled kernel?)")
        rows.append({"start_s": round(t - T0, 3), "s": round(time.perf_counter() - t, 3),
                     "read_s": round(hs.t_read, 3), "kernel_s": round(hs.t_transform, 3)})
        del hs
    if helper is not None:
        helper.join()
    print(json.dumps({"mode": mode, **imported, "units": rows}))


if __name__ == "__main__":
    main()
