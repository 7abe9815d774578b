"""Throughput of the Marlin FP4 encoder (mxfp4conv.formats.marlin) on realistic MoE layers.

For each case and device, one JSON line:
  * ``repack_s``: ``repack_fp4_weight`` of w13 + w2 (all experts), median of ``--repeat`` runs;
  * ``layer_s``: ``prepare_moe_fp4`` (weights, scales, NVFP4 globals, biases) of the whole layer;
  * ``ref_*``: a plain per-word Python loop of the MARLIN.md §1 formula (below), timed on a small
    slice of expert 0's w13 and EXTRAPOLATED linearly to the layer's word count (it would take
    hours to run in full); ``speedup_*`` = extrapolated reference time / measured time, same run.
The slice is also checked for identical bytes between the loop and the vectorized encoder.

    .venv/bin/python benchmarks/bench_marlin.py [--cases gptoss,qwen3] [--device cpu,cuda] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mxfp4conv.formats import marlin as M

# name -> (quant, E, H, I, with bias). GPT-OSS-20B-style layers are run at the Marlin padded sizes.
CASES = {
    "gptoss": ("mxfp4", 32, 2880, 2880, True),
    "qwen3": ("nvfp4", 128, 2048, 768, False),
}
REF_SLICE = (128, 256)  # (N, K) of the slice the loop reference is timed on


def reference_repack(packed: torch.Tensor) -> list[int]:
    """MARLIN.md §1 (16-bit activations), one int32 word at a time: the plain per-element baseline."""
    rows = packed.tolist()
    n, k = len(rows), 2 * len(rows[0])
    out = [0] * (k // 16 * 2 * n)
    for kt in range(k // 16):
        for nt in range(n // 64):
            for t in range(32):
                for j in range(4):
                    k0, n0 = 16 * kt + 2 * (t % 4), 64 * nt + 16 * j + t // 4
                    word = 0
                    for s, (dn, dk) in enumerate(
                        ((0, 0), (0, 8), (8, 0), (8, 8), (0, 1), (0, 9), (8, 1), (8, 9))
                    ):
                        kk = k0 + dk
                        word |= ((rows[n0 + dn][kk // 2] >> (4 * (kk % 2))) & 0xF) << (4 * s)
                    out[kt * 2 * n + 128 * nt + 4 * t + j] = word - (1 << 32) if word >= 1 << 31 else word
    return out


def make_layer(quant: str, e: int, h: int, i: int, bias: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors; GPT-OSS (bias) shapes are zero-padded to the Marlin sizes first."""
    g = torch.Generator().manual_seed(seed)
    grp = 32 if quant == "mxfp4" else 16

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8)

    sc = (lambda *s: u8(*s, lo=110, hi=140)) if quant == "mxfp4" else (lambda *s: u8(*s, lo=8, hi=0x7F))
    t = {
        "w13": u8(e, 2 * i, h // 2),
        "s13": sc(e, 2 * i, h // grp),
        "w2": u8(e, h, i // 2),
        "s2": sc(e, h, i // grp),
    }
    if bias:
        hp, ip = M.gptoss_marlin_padded_sizes(h, i)
        b13, b2 = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)
        p13 = M.pad_dense_fp4(t["w13"], t["s13"], b13, group=grp, to=(2 * ip, hp))
        p2 = M.pad_dense_fp4(t["w2"], t["s2"], b2, group=grp, to=(hp, ip))
        t = {"w13": p13.packed, "s13": p13.scales, "w2": p2.packed, "s2": p2.scales}
        assert p13.bias is not None and p2.bias is not None
        t.update(b13=p13.bias, b2=p2.bias)
    if quant == "nvfp4":
        t["s13"], t["s2"] = t["s13"].view(torch.float8_e4m3fn), t["s2"].view(torch.float8_e4m3fn)
        t.update(g13=torch.rand(e, generator=g) * 1e-3, g2=torch.rand(e, generator=g) * 1e-3)
    return t


def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> tuple[float, object]:
    fn()  # warm-up (caches, CUDA context, allocator)
    times, out = [], None
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run_case(name: str, device: torch.device, repeat: int, ref_words_per_s: float) -> dict[str, object]:
    quant, e, h, i, bias = CASES[name]
    t = {k: v.to(device) for k, v in make_layer(quant, e, h, i, bias).items()}
    wbytes = t["w13"].numel() + t["w2"].numel()
    words = wbytes // 4

    def repack() -> object:
        return M.repack_fp4_weight(t["w13"]), M.repack_fp4_weight(t["w2"])

    def layer() -> object:
        return M.prepare_moe_fp4(
            t["w13"], t["s13"], t["w2"], t["s2"], quant=quant, w13_global=t.get("g13"),
            w2_global=t.get("g2"), w13_bias=t.get("b13"), w2_bias=t.get("b2"),
        )  # fmt: skip

    repack_s, _ = timed(repack, device, repeat)
    layer_s, _ = timed(layer, device, repeat)
    ref_layer_s = words / ref_words_per_s
    return {
        "bench": "marlin_encoder",
        "case": name,
        "device": device.type if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "quant": quant,
        "E": e,
        "H": h,
        "I": i,
        "w13_shape": list(t["w13"].shape),
        "w2_shape": list(t["w2"].shape),
        "weight_MB": round(wbytes / 1e6, 1),
        "repack_s": round(repack_s, 4),
        "repack_MB_per_s": round(wbytes / repack_s / 1e6, 1),
        "layer_s": round(layer_s, 4),
        "layer_MB_per_s": round(wbytes / layer_s / 1e6, 1),
        "ref_kind": f"python loop of MARLIN.md §1, timed on a {REF_SLICE[0]}x{REF_SLICE[1]} slice, extrapolated",
        "ref_words_per_s": round(ref_words_per_s),
        "ref_layer_s_extrapolated": round(ref_layer_s, 1),
        "speedup_repack_vs_ref": round(ref_layer_s / repack_s, 1),
        "speedup_layer_vs_ref": round(ref_layer_s / layer_s, 1),
        "torch": torch.__version__,
    }


def time_reference() -> float:
    """Words per second of the loop reference on a slice, after checking it against the encoder."""
    n, k = REF_SLICE
    packed = torch.randint(0, 256, (n, k // 2), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    t0 = time.perf_counter()
    ref = reference_repack(packed)
    dt = time.perf_counter() - t0
    if ref != M.repack_fp4_weight(packed).flatten().tolist():
        raise SystemExit("vectorized encoder disagrees with the loop reference")
    return len(ref) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--device", default="cpu,cuda", help="comma list; cuda is skipped when unavailable")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    ref_wps = time_reference()
    for dev in args.device.split(","):
        if dev == "cuda" and not torch.cuda.is_available():
            continue
        for name in args.cases.split(","):
            print(json.dumps(run_case(name, torch.device(dev), args.repeat, ref_wps)), flush=True)


if __name__ == "__main__":
    main()
