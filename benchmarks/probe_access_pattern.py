"""Diagnostic (CUDA): how fast can the requant kernel's memory access pattern go, without its math?

Two Triton copy kernels move exactly the requant's bytes (per 32-block: 16 packed bytes and 2 E4M3
bytes in, 16 packed bytes and 1 E8M0 byte out) on a slab ``[rows, K]``:

* ``rowwise``: the requant kernel's pattern: one thread per row, its blocks walked in tiles of 2
  with the next tile prefetched (a warp's load touches 32 rows, K/2 bytes apart);
* ``blockwise``: a coalesced pattern: one thread per (row, 32-block), adjacent threads on adjacent
  blocks of a row.

Next to them, in the same run, the requant kernel itself (EVEN and MSE, default launch). If the
row-wise copy is no faster than the kernel, the access pattern, not the arithmetic, bounds it.

    PYTHONPATH=. python3 benchmarks/probe_access_pattern.py --out results.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import triton
import triton.language as tl
import triton.testing

from mxfp4conv.kernels.requant_triton import requant_rows_into


@triton.jit
def _rowwise_copy(in_ptr, sc_ptr, out_ptr, osc_ptr, R, NB, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    c4 = tl.arange(0, 4)
    c2 = tl.arange(0, 2)
    m2 = rmask[:, None]
    in_row = in_ptr + r64 * NB * 4
    sc_row = sc_ptr + r64 * NB * 2
    out_row = out_ptr + r64 * NB * 4
    osc_row = osc_ptr + r64 * NB
    w0 = tl.load(in_row[:, None] + c4[None, :], mask=m2, other=0)
    s0 = tl.load(sc_row[:, None] + c2[None, :], mask=m2, other=0)
    w1 = tl.load(in_row[:, None] + (4 + c4)[None, :], mask=m2, other=0)
    s1 = tl.load(sc_row[:, None] + (2 + c2)[None, :], mask=m2, other=0)
    for j in range(0, NB, 2):
        nm = m2 & (j + 2 < NB)
        n0 = tl.load(in_row[:, None] + ((j + 2) * 4 + c4)[None, :], mask=nm, other=0)
        t0 = tl.load(sc_row[:, None] + ((j + 2) * 2 + c2)[None, :], mask=nm, other=0)
        n1 = tl.load(in_row[:, None] + ((j + 3) * 4 + c4)[None, :], mask=nm, other=0)
        t1 = tl.load(sc_row[:, None] + ((j + 3) * 2 + c2)[None, :], mask=nm, other=0)
        tl.store(out_row[:, None] + (j * 4 + c4)[None, :], w0 ^ 0x11111111, mask=m2)
        tl.store(osc_row + j, tl.max(s0.to(tl.int32), axis=1).to(tl.uint8), mask=rmask)
        tl.store(out_row[:, None] + ((j + 1) * 4 + c4)[None, :], w1 ^ 0x11111111, mask=m2)
        tl.store(osc_row + j + 1, tl.max(s1.to(tl.int32), axis=1).to(tl.uint8), mask=rmask)
        w0, s0, w1, s1 = n0, t0, n1, t1


@triton.jit
def _blockwise_copy(in_ptr, sc_ptr, out_ptr, osc_ptr, NBLK, BLOCKS: tl.constexpr):
    blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    m = blk < NBLK
    b64 = blk.to(tl.int64)
    c4 = tl.arange(0, 4)
    c2 = tl.arange(0, 2)
    w = tl.load(in_ptr + b64[:, None] * 4 + c4[None, :], mask=m[:, None], other=0)
    s = tl.load(sc_ptr + b64[:, None] * 2 + c2[None, :], mask=m[:, None], other=0)
    tl.store(out_ptr + b64[:, None] * 4 + c4[None, :], w ^ 0x11111111, mask=m[:, None])
    tl.store(osc_ptr + b64, tl.max(s.to(tl.int32), axis=1).to(tl.uint8), mask=m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32 * 4096)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    r, k = args.rows, args.k
    nb = k // 32
    gen = torch.Generator(device=dev).manual_seed(0)
    packed = torch.randint(0, 256, (r, k // 2), generator=gen, device=dev, dtype=torch.uint8)
    sc = torch.randint(0x20, 0x7F, (r, k // 16), generator=gen, device=dev, dtype=torch.uint8)
    g = (torch.rand(r, generator=gen, device=dev) * 7.0 + 0.5) / 2688.0
    out = torch.empty_like(packed)
    osc = torch.empty((r, nb), dtype=torch.uint8, device=dev)
    st = torch.empty((r, 5), dtype=torch.float64, device=dev)
    base = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(dev),
            "triton": triton.__version__, "shape": [r, k]}
    cases = {}
    for nw in (4, 8):
        rows = 32 * nw
        cases[f"rowwise_copy_w{nw}"] = lambda rows=rows, nw=nw: _rowwise_copy[(triton.cdiv(r, rows),)](
            packed.view(torch.int32), sc, out.view(torch.int32), osc, r, nb, ROWS=rows, num_warps=nw)
    for bl in (256, 1024):
        cases[f"blockwise_copy_b{bl}"] = lambda bl=bl: _blockwise_copy[(triton.cdiv(r * nb, bl),)](
            packed.view(torch.int32), sc, out.view(torch.int32), osc, r * nb, BLOCKS=bl, num_warps=8)
    for rule in ("even", "mse"):
        cases[f"requant_{rule}"] = lambda rule=rule: requant_rows_into(
            packed, sc.view(torch.float8_e4m3fn), g, False, rule, out, osc, st)
    for name, fn in cases.items():
        ms = float(triton.testing.do_bench(fn, warmup=50, rep=300))
        rec = {**base, "case": name, "ms": round(ms, 4), "Gweights_s": round(r * k / ms / 1e6, 1),
               "GBps": round(r * k * (0.5625 + 0.53125) / ms / 1e6, 1)}
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
