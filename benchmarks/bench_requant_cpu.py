"""CPU NVFP4 -> MXFP4 requant throughput: the compiled kernel vs the eager-torch path vs the plain
composition.

Prints one JSON line per (rule, convention) case. All paths run in the same process on the same
data: ``requant_rows_cpu`` with the compiled kernel (``MXFP4CONV_CPU_KERNEL=native``, the default
when it builds) and with its eager-torch table path (``torch``; the ratio is native / torch path),
and ``requant_rows_reference`` (dequantize the rows to float32, then quantize them elementwise with
the same statistics), run on a row subset in row chunks so that its memory stays bounded.
Throughput is weights per second, best of ``--repeat`` runs; outputs are compared byte for byte
(statistics as bits).

    .venv/bin/python benchmarks/bench_requant_cpu.py --rows 4096 --k 7168 --rules mse,even
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch

from mxfp4conv.formats.mxfp4 import ScaleRule
from mxfp4conv.kernels import requant_native
from mxfp4conv.numerics.requant_cpu import requant_rows_cpu
from mxfp4conv.numerics.requant_stats import requant_rows_reference


def make_rows(
    r: int, k: int, divisor: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random NVFP4 rows: uniform codes, positive non-NaN e4m3 block scales, realistic global scale."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (r, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0x20, 0x7F, (r, k // 16), generator=gen, dtype=torch.uint8)
    g = torch.rand(r, generator=gen, dtype=torch.float64) * 7.0 + 0.5
    g = (g * 400.0 if divisor else g / 2688.0).float()
    return packed, scales.view(torch.float8_e4m3fn), g


@contextmanager
def kernel(mode: str) -> Iterator[None]:
    """Run with ``MXFP4CONV_CPU_KERNEL=mode`` (native: the compiled kernel; torch: the eager path)."""
    old = os.environ.get("MXFP4CONV_CPU_KERNEL")
    os.environ["MXFP4CONV_CPU_KERNEL"] = mode
    try:
        yield
    finally:
        os.environ.pop("MXFP4CONV_CPU_KERNEL")
        if old is not None:
            os.environ["MXFP4CONV_CPU_KERNEL"] = old


def identical(a: tuple[torch.Tensor, ...] | list[torch.Tensor], b: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> bool:
    """Packed bytes, scale bytes and statistics (as bits) equal."""
    return all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
               for x, y in zip(a, b, strict=True))  # fmt: skip


def best_time(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def baseline(
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor], divisor: bool, rule: ScaleRule, chunk: int
) -> list[torch.Tensor]:
    p, s, g = data
    outs = [requant_rows_reference(p[i : i + chunk], s[i : i + chunk], g[i : i + chunk], divisor, rule)
            for i in range(0, p.shape[0], chunk)]  # fmt: skip
    return [torch.cat([o[j] for o in outs]) for j in range(3)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--rules", default="mse,even,floor,rceil")
    ap.add_argument("--conventions", default="modelopt", help="modelopt (multiply), ct (divide), or both")
    ap.add_argument("--threads", type=int, default=0, help="worker threads for the fast path (0: torch's)")
    ap.add_argument("--baseline-rows", type=int, default=256, help="rows the baseline is timed on")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    threads = args.threads or torch.get_num_threads()
    if requant_native.load() is None:
        raise SystemExit(f"the compiled CPU kernel did not build: {requant_native.build_error()}")
    for conv in args.conventions.split(","):
        divisor = conv == "ct"
        p, s, g = make_rows(args.rows, args.k, divisor)
        sp, ss, sg = p[: args.baseline_rows], s[: args.baseline_rows], g[: args.baseline_rows]
        for name in args.rules.split(","):
            rule = ScaleRule(name)
            run = partial(requant_rows_cpu, p, s, g, divisor, rule, threads=threads)
            with kernel("native"):
                native_t = best_time(run, args.repeat)
                cpu0 = time.process_time()
                got = run()
                native_cpu = time.process_time() - cpu0
            with kernel("torch"):
                torch_t = best_time(run, max(1, args.repeat - 1))
                same_torch = identical(run(), got)
            base_t = best_time(partial(baseline, (sp, ss, sg), divisor, rule, 64), 1)
            sub = tuple(t[: args.baseline_rows] for t in got)
            same_ref = identical(sub, baseline((sp, ss, sg), divisor, rule, 64))
            n, n_base = args.rows * args.k, sp.shape[0] * args.k
            nat_mw, tor_mw, base_mw = n / native_t / 1e6, n / torch_t / 1e6, n_base / base_t / 1e6
            print(json.dumps({
                "bench": "requant_cpu", "date": datetime.date.today().isoformat(), "rule": rule.value,
                "convention": conv, "shape": [args.rows, args.k], "threads": threads,
                "native_mweights_s": round(nat_mw, 2), "torch_path_mweights_s": round(tor_mw, 2),
                "ratio_native_vs_torch_path": round(nat_mw / tor_mw, 2),
                "composition_mweights_s": round(base_mw, 2),
                "native_cpu_mweights_s_per_core": round(n / native_cpu / 1e6, 2),
                "identical_torch_path": same_torch, "identical_composition": same_ref,
                "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
