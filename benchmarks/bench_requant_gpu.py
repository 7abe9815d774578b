"""GPU requant throughput: the fused Triton kernel vs plain torch (eager and torch.compile).

Run on a CUDA machine (numbers in the report come from one NVIDIA H200)::

    PYTHONPATH=. python benchmarks/bench_requant_gpu.py --out results.jsonl

Cases, one JSON line each (stdout, and appended to ``--out``):

* ``hbm_copy``: device-to-device copy bandwidth (bytes read + written) and the requant roofline it
  implies at 1.09375 B/weight (0.5625 in + 0.53125 out).
* ``pcie``: pinned H2D / D2H copy bandwidth.
* ``kernel_config``: the fused kernel (EVEN, multiplier) per launch shape; the best is used next.
* ``kernel``: the fused kernel per scale rule and convention on an NVFP4 slab ``[rows, K]`` resident
  on the GPU, with G weights/s and the fraction of the roofline; ``kernel_nostats_diagnostic``: the
  same without the signal sums (what they cost).
* ``torch_eager`` / ``torch_compile``: a plain torch requant (EVEN, multiplier, no statistics:
  LUT-gather unpack, fp32 dequant, amax, EVEN exponent from the bits, 7-compare RNE encode, pack),
  with whether its bytes equal the kernel's.
* ``e2e_layer``: host -> device -> host for one MoE layer ``[E, 2I, H]`` in pinned memory through
  ``requant_nvfp4_gpu_chunks`` (bounded device memory, three streams).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from mxfp4conv.kernels.requant_triton import (
    KernelConfig,
    default_config,
    requant_nvfp4_gpu_chunks,
    requant_rows_into,
)

BYTES_PER_WEIGHT = 0.5625 + 0.53125  # NVFP4 in + MXFP4 out


def emit(rec: dict[str, Any], out: str | None) -> None:
    """Print one JSON line and append it to ``out``."""
    line = json.dumps(rec, sort_keys=False)
    print(line, flush=True)
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def bench_ms(fn: Callable[[], object], rep_ms: int = 400) -> tuple[float, float, float]:
    """(median, min, max) ms of ``fn`` over CUDA-event-timed repetitions (triton's do_bench)."""
    import triton.testing

    res = triton.testing.do_bench(fn, warmup=50, rep=rep_ms, quantiles=[0.5, 0.0, 1.0])
    return float(res[0]), float(res[1]), float(res[2])


def make_slab(r: int, k: int, divisor: bool, dev: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random NVFP4 slab on the device: codes, positive E4M3 scales, random-mantissa global."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    packed = torch.randint(0, 256, (r, k // 2), generator=gen, device=dev, dtype=torch.uint8)
    sc = torch.randint(0x20, 0x7F, (r, k // 16), generator=gen, device=dev, dtype=torch.uint8)
    g = torch.rand(r, generator=gen, device=dev) * 7.0 + 0.5
    g = g * 400.0 if divisor else g / 2688.0
    return packed, sc.view(torch.float8_e4m3fn), g.float()


def plain_requant_even(packed: torch.Tensor, scales: torch.Tensor, g: torch.Tensor,
                       lut: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch NVFP4 -> MXFP4 (EVEN, ModelOpt multiplier), no statistics."""
    r, hk = packed.shape
    k = 2 * hk
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(r, k)
    v = lut[codes.long()]
    x = (v.reshape(r, k // 16, 16) * scales.float()[..., None]).reshape(r, k) * g[:, None]
    xb = x.reshape(r, k // 32, 32)
    amax = xb.abs().amax(-1)
    field = ((amax.view(torch.int32) + 0x200000) >> 23) & 0xFF
    e = torch.where(field == 255, 127, field - 129).clamp(-127, 127)
    e = torch.where(amax == 0, torch.zeros_like(e), e)
    inv = ((127 - e) << 23).view(torch.float32)
    q = xb * inv[..., None]
    a = q.abs()
    c = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
         + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    c = (c | (torch.signbit(q).int() << 3)).reshape(r, k)
    out = (c[:, 0::2] | (c[:, 1::2] << 4)).to(torch.uint8)
    return out, (e + 127).to(torch.uint8)


def bench_hbm(dev: torch.device) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), 1 GiB buffers."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms, _, _ = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def bench_pcie(dev: torch.device) -> tuple[float, float]:
    """Pinned H2D and D2H bandwidth in GB/s, 1 GiB."""
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    devb = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    ms_h2d, _, _ = bench_ms(lambda: devb.copy_(host, non_blocking=True), rep_ms=300)
    ms_d2h, _, _ = bench_ms(lambda: host.copy_(devb, non_blocking=True), rep_ms=300)
    return (1 << 30) / ms_h2d / 1e6, (1 << 30) / ms_d2h / 1e6


def _outs(r: int, k: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty((r, k // 2), dtype=torch.uint8, device=dev),
            torch.empty((r, k // 32), dtype=torch.uint8, device=dev),
            torch.empty((r, 5), dtype=torch.float64, device=dev))


# (num_warps, rows per program, prefetch): the launch shapes swept (8 blocks per row per step).
CONFIG_SWEEP = ((4, 16, True), (4, 32, True), (4, 8, True), (2, 8, True), (2, 16, True), (8, 32, True),
                (1, 4, True), (1, 8, True), (2, 4, True), (4, 16, False), (2, 8, False), (1, 4, False))


def bench_configs(r: int, k: int, dev: torch.device, base: dict[str, Any], out: str | None) -> dict[str, KernelConfig]:
    """Time the launch shapes (multiplier) for EVEN (the single-candidate rules) and MSE; the best per rule."""
    slab, outs = make_slab(r, k, False, dev), _outs(r, k, dev)
    best: dict[str, KernelConfig] = {}
    for rule in ("even", "mse"):
        top: tuple[float, KernelConfig] = (float("inf"), KernelConfig())
        for nw, rows, pf in CONFIG_SWEEP:
            cfg = KernelConfig(num_warps=nw, prefetch=pf, rows=rows)
            ms, _, _ = bench_ms(lambda cfg=cfg, rule=rule: requant_rows_into(*slab, False, rule, *outs, config=cfg), 300)
            emit({**base, "case": "kernel_config", "rule": rule, "num_warps": nw,
                  "rows": rows, "prefetch": pf, "ms": round(ms, 4), "Gweights_s": round(r * k / ms / 1e6, 1)}, out)
            if ms < top[0]:
                top = (ms, cfg)
        best[rule] = top[1]
    return best


def bench_kernel(r: int, k: int, dev: torch.device, cfgs: dict[str, KernelConfig], roof: float, base: dict[str, Any],
                 out: str | None) -> dict[tuple[str, bool], float]:
    """The fused kernel per rule and convention on the resident slab (each rule at its best launch:
    MSE's own, EVEN's for the others); returns ms per case."""
    outs = _outs(r, k, dev)
    kernel_ms: dict[tuple[str, bool], float] = {}
    for divisor in (False, True):
        slab = make_slab(r, k, divisor, dev)
        for rule in ("floor", "even", "rceil", "mse"):
            cfg = cfgs.get(rule, cfgs["even"])
            ms, lo, hi = bench_ms(lambda rule=rule, divisor=divisor, slab=slab, cfg=cfg: requant_rows_into(
                *slab, divisor, rule, *outs, config=cfg))
            kernel_ms[(rule, divisor)] = ms
            gw = r * k / ms / 1e6
            emit({**base, "case": "kernel", "rule": rule, "convention": "ct_divisor" if divisor else "modelopt",
                  "shape": [r, k], "num_warps": cfg.num_warps,
                  "rows": cfg.rows, "prefetch": cfg.prefetch,
                  "ms": round(ms, 4), "ms_min": round(lo, 4), "ms_max": round(hi, 4),
                  "Gweights_s": round(gw, 1), "HBM_GBps": round(gw * BYTES_PER_WEIGHT, 1),
                  "of_roofline": round(gw / roof, 3)}, out)
    # Diagnostic: the divisor convention through PTX div.rn.f32 instead of Markstein's correction.
    cfg = cfgs["even"]
    slab = make_slab(r, k, True, dev)
    plain = KernelConfig(cfg.num_warps, fast_div=False, prefetch=cfg.prefetch, rows=cfg.rows)
    ms, _, _ = bench_ms(lambda: requant_rows_into(*slab, True, "even", *outs, config=plain))
    emit({**base, "case": "kernel_divrn_diagnostic", "rule": "even", "convention": "ct_divisor",
          "shape": [r, k], "ms": round(ms, 4), "Gweights_s": round(r * k / ms / 1e6, 1),
          "fast_div_speedup": round(ms / kernel_ms[("even", True)], 2)}, out)
    # Diagnostic: the same kernel without the float64 statistics (not a contract mode).
    slab = make_slab(r, k, False, dev)
    for rule in ("even", "mse"):
        ms, _, _ = bench_ms(lambda rule=rule: requant_rows_into(*slab, False, rule, *outs, config=cfgs[rule], stats=False))
        emit({**base, "case": "kernel_nostats_diagnostic", "rule": rule, "convention": "modelopt",
              "shape": [r, k], "ms": round(ms, 4), "Gweights_s": round(r * k / ms / 1e6, 1),
              "stats_cost": round(kernel_ms[(rule, False)] / ms, 2)}, out)
    return kernel_ms


def bench_torch(r: int, k: int, dev: torch.device, cfg: KernelConfig, k_ms: float, base: dict[str, Any],
                out: str | None, eager: bool, compiled: bool) -> None:
    """Plain torch requant (EVEN, multiplier), eager and torch.compile'd, vs the kernel's bytes."""
    n = r * k
    slab, outs = make_slab(r, k, False, dev), _outs(r, k, dev)
    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], device=dev)
    requant_rows_into(*slab, False, "even", *outs, config=cfg)
    ref_p, ref_s = outs[0], outs[1]
    if eager:
        torch.cuda.reset_peak_memory_stats(dev)
        base_mem = torch.cuda.memory_allocated(dev)
        p, s = plain_requant_even(*slab, lut)
        same = bool(torch.equal(p, ref_p) and torch.equal(s, ref_s))
        peak = (torch.cuda.max_memory_allocated(dev) - base_mem) / n
        p = s = None
        ms, _, _ = bench_ms(lambda: plain_requant_even(*slab, lut), 1500)
        emit({**base, "case": "torch_eager", "rule": "even", "convention": "modelopt", "shape": [r, k],
              "ms": round(ms, 3), "Gweights_s": round(n / ms / 1e6, 1), "kernel_speedup": round(ms / k_ms, 1),
              "bytes_identical_to_kernel": same, "peak_temp_bytes_per_weight": round(peak, 1),
              "note": "no statistics computed"}, out)
    if compiled:
        t0 = time.perf_counter()
        comp = torch.compile(plain_requant_even, fullgraph=True, dynamic=False)
        p, s = comp(*slab, lut)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        same = bool(torch.equal(p, ref_p) and torch.equal(s, ref_s))
        p = s = None
        ms, _, _ = bench_ms(lambda: comp(*slab, lut), 1000)
        emit({**base, "case": "torch_compile", "rule": "even", "convention": "modelopt", "shape": [r, k],
              "ms": round(ms, 3), "Gweights_s": round(n / ms / 1e6, 1), "kernel_speedup": round(ms / k_ms, 2),
              "bytes_identical_to_kernel": same, "compile_s": round(compile_s, 1),
              "note": "no statistics computed"}, out)


def bench_e2e(e_: int, n_: int, h_: int, dev: torch.device, cfg: KernelConfig, base: dict[str, Any],
              out: str | None) -> None:
    """Host -> device -> host for one MoE layer [E, 2I, H] in pinned memory (chunked driver)."""
    hp = torch.empty((e_, n_, h_ // 2), dtype=torch.uint8, pin_memory=True)
    hs = torch.empty((e_, n_, h_ // 16), dtype=torch.uint8, pin_memory=True)
    hg = torch.empty((e_, n_), dtype=torch.float32, pin_memory=True)
    for i in range(e_):  # fill through the device (fast), one expert at a time
        p, s, g = make_slab(n_, h_, False, dev, seed=100 + i)
        hp[i].copy_(p)
        hs[i].copy_(s.view(torch.uint8))
        hg[i].copy_(g)
    res = (torch.empty((e_, n_, h_ // 2), dtype=torch.uint8, pin_memory=True),
           torch.empty((e_, n_, h_ // 32), dtype=torch.uint8, pin_memory=True),
           torch.empty((e_, n_, 5), dtype=torch.float64, pin_memory=True))
    w = e_ * n_ * h_
    for rule in ("even", "mse"):
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            requant_nvfp4_gpu_chunks(hp, hs.view(torch.float8_e4m3fn), hg, False, rule, out=res, config=None)
            times.append(time.perf_counter() - t0)
        t = sorted(times)[len(times) // 2]
        emit({**base, "case": "e2e_layer", "rule": rule, "layer": [e_, n_, h_], "weights": w,
              "s_median": round(t, 4), "s_all": [round(x, 4) for x in times],
              "Gweights_s": round(w / t / 1e9, 1), "in_GBps": round(w * 0.5625 / t / 1e9, 1),
              "out_GBps": round(w * 0.53125 / t / 1e9, 1), "pinned": True}, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rows", type=int, default=32 * 4096)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=64, help="E of the end-to-end [E, 2I, H] layer")
    ap.add_argument("--two-i", type=int, default=4096)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-configs", action="store_true")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--skip-eager", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args()

    dev = torch.device("cuda")
    base: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
    }
    import triton

    base["triton"] = triton.__version__
    r, k = args.rows, args.k

    hbm = bench_hbm(dev)
    roof = hbm / BYTES_PER_WEIGHT
    emit({**base, "case": "hbm_copy", "GBps": round(hbm, 1), "roofline_Gweights_s": round(roof, 1),
          "bytes_per_weight": BYTES_PER_WEIGHT}, args.out)
    h2d, d2h = bench_pcie(dev)
    emit({**base, "case": "pcie", "h2d_pinned_GBps": round(h2d, 1), "d2h_pinned_GBps": round(d2h, 1)}, args.out)

    cfgs = ({"even": default_config("even"), "mse": default_config("mse")} if args.skip_configs
            else bench_configs(r, k, dev, base, args.out))
    cfg = cfgs["even"]
    torch.cuda.empty_cache()
    kernel_ms = bench_kernel(r, k, dev, cfgs, roof, base, args.out)
    torch.cuda.empty_cache()
    bench_torch(r, k, dev, cfg, kernel_ms[("even", False)], base, args.out,
                eager=not args.skip_eager, compiled=not args.skip_compile)
    torch.cuda.empty_cache()
    if not args.skip_e2e:
        bench_e2e(args.experts, args.two_i, k, dev, cfg, base, args.out)


if __name__ == "__main__":
    main()
