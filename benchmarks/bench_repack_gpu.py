"""Start-up cost a Marlin-ready checkpoint avoids: vLLM's MXFP4 Marlin repack of one MoE layer vs loading
the prepared bytes, side by side on one GPU.

    python benchmarks/bench_repack_gpu.py --lib _C_stable_libtorch.abi3.so [--experts 128 --hidden 2880
        --inter 2880 --tp 1 --repeats 3 --out results.jsonl]

Default sizes: one GPT-OSS-120B MoE layer on vLLM's Marlin path (E=128, H=I=2880 padded to Hp=3072,
Ip=2944 at TP 1). "repack" does what vLLM 0.33's ``prepare_moe_mxfp4_layer_for_marlin`` does after the
checkpoint's uint8 tensors are on the GPU: ``_C.gptq_marlin_repack`` (vLLM's own op, from the wheel's
stable-ABI library) per expert into a preallocated [E, ...] output, the E8M0 scales through bf16 and
Marlin's permutation per expert (mxfp4conv's byte-identical GPU implementation of it); the uint8
originals stay allocated until every tensor is prepared, as the layer's parameters are replaced only then. "prepared" copies the Marlin-ready tensors into parameters of their final
shapes. Both start from pinned host memory, so both include the host-to-device copy. Reported: wall
time (CUDA-synchronized) and peak GPU memory above the layer's final size, per variant and as ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from mxfp4conv.formats import marlin as fm
from mxfp4conv.formats import marlin_scales as fms


def sizes(hidden: int, inter: int, tp: int) -> tuple[int, int]:
    return -(-hidden // 256) * 256, -(-(inter // tp) // 128) * 128


def repack_path(host: dict[str, torch.Tensor], e: int, hp: int, ip: int) -> dict[str, torch.Tensor]:
    dev = torch.device("cuda")
    w = {k: v.to(dev, non_blocking=True) for k, v in host.items()}  # the checkpoint's uint8 tensors
    out: dict[str, torch.Tensor] = {}
    for name, n, k in (("w13", 2 * ip, hp), ("w2", hp, ip)):
        packed = w[f"{name}_weight"]
        dst = None
        for i in range(e):
            q = packed[i].view(torch.int32).T.contiguous()
            m = torch.ops._C.gptq_marlin_repack(q, k, n, 4, False)
            if dst is None:
                dst = torch.empty((e, *m.shape), dtype=m.dtype, device=dev)
            dst[i] = m
        out[f"{name}_weight"] = dst  # type: ignore[assignment]
        scales = w[f"{name}_weight_scale"]
        per_expert = []
        for i in range(e):
            _ = scales[i].view(torch.float8_e8m0fnu).to(torch.bfloat16)  # vLLM goes through the params dtype
            per_expert.append(fms.mxfp4_scales_to_marlin(scales[i]).view(torch.float8_e8m0fnu))
        out[f"{name}_weight_scale"] = torch.cat([x.unsqueeze(0) for x in per_expert])
    torch.cuda.synchronize()
    del w  # the layer's uint8 parameters are replaced only once every tensor is prepared
    return out


def prepared_path(host: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    dev = torch.device("cuda")
    params = {k: torch.empty(v.shape, dtype=v.dtype, device=dev) for k, v in host.items()}
    for k, v in host.items():
        params[k].copy_(v, non_blocking=True)
    torch.cuda.synchronize()
    return params


def measure(fn, *args: object) -> tuple[float, int, int]:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    res = fn(*args)
    dt = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() - base
    final = sum(v.numel() * v.element_size() for v in res.values())
    del res
    return dt, peak, final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", required=True, help="vLLM's _C_stable_libtorch.abi3.so (gptq_marlin_repack)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--inter", type=int, default=2880)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.ops.load_library(a.lib)
    e = a.experts
    hp, ip = sizes(a.hidden, a.inter, a.tp)
    g = torch.Generator().manual_seed(0)
    ckpt = {"w13_weight": torch.randint(0, 256, (e, 2 * ip, hp // 2), dtype=torch.uint8, generator=g),
            "w13_weight_scale": torch.randint(118, 130, (e, 2 * ip, hp // 32), dtype=torch.uint8, generator=g),
            "w2_weight": torch.randint(0, 256, (e, hp, ip // 2), dtype=torch.uint8, generator=g),
            "w2_weight_scale": torch.randint(118, 130, (e, hp, ip // 32), dtype=torch.uint8, generator=g)}
    ready = {"w13_weight": fm.repack_fp4_weight(ckpt["w13_weight"].cuda()).cpu(),
             "w13_weight_scale": fms.mxfp4_scales_to_marlin(ckpt["w13_weight_scale"].cuda()).cpu().view(torch.float8_e8m0fnu),
             "w2_weight": fm.repack_fp4_weight(ckpt["w2_weight"].cuda()).cpu(),
             "w2_weight_scale": fms.mxfp4_scales_to_marlin(ckpt["w2_weight_scale"].cuda()).cpu().view(torch.float8_e8m0fnu)}
    ckpt = {k: v.pin_memory() for k, v in ckpt.items()}
    ready = {k: v.pin_memory() for k, v in ready.items()}
    # the prepared bytes are what vLLM's own repack produces
    got = repack_path(ckpt, e, hp, ip)
    same = all(torch.equal(got[k].cpu().view(torch.uint8), ready[k].view(torch.uint8)) for k in ready)
    del got
    rows = []
    for r in range(a.repeats + 1):  # the first round warms both paths up and is not reported
        t_r, p_r, _ = measure(repack_path, ckpt, e, hp, ip)
        t_p, p_p, f_p = measure(prepared_path, ready)
        if r:
            rows.append({"round": r, "repack_s": t_r, "prepared_s": t_p, "repack_peak_bytes": p_r,
                         "prepared_peak_bytes": p_p, "layer_bytes": f_p})
    res = {"bench": "repack_vs_prepared", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "host": platform.node(), "date": time.strftime("%Y-%m-%d"), "experts": e, "hidden": a.hidden,
           "inter": a.inter, "tp": a.tp, "Hp": hp, "Ip": ip, "bytes_identical_to_vllm_repack": same,
           "repack_s_min": min(x["repack_s"] for x in rows), "prepared_s_min": min(x["prepared_s"] for x in rows),
           "repack_peak_bytes": max(x["repack_peak_bytes"] for x in rows),
           "prepared_peak_bytes": max(x["prepared_peak_bytes"] for x in rows), "layer_bytes": rows[0]["layer_bytes"],
           "rounds": rows}
    res["time_ratio"] = res["repack_s_min"] / res["prepared_s_min"]
    res["peak_ratio"] = res["repack_peak_bytes"] / res["prepared_peak_bytes"]
    line = json.dumps(res)
    print(line)
    if a.out:
        with a.out.open("a") as fh:
            fh.write(line + "\n")


if __name__ == "__main__":
    main()
