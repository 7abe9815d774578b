"""How often MSE's two candidates (nearly) tie: the blocks the GPU kernel's float32 decision hands to
its exact float64 fallback (docs/NUMERICS.md "MSE decision").

For each data family, the exact difference D = sum (A - B)(2u - A - B) of every 32-block and
T = sum |terms|: blocks with T == 0 (all terms zero: an exact tie the float32 sums decide too),
blocks with D == 0 and T > 0 (exact ties with nonzero terms), blocks with |D| < 2^-18 T (the
kernel's fallback margin), and the share of blocks where RCEIL - 1 wins. One JSON line per family.

    .venv/bin/python benchmarks/probe_mse_ties.py [--rows 2048] [--k 2048]
"""

from __future__ import annotations

import argparse
import json

import torch

from mxfp4conv.formats.fp4 import e2m1_encode
from mxfp4conv.formats.mxfp4 import _candidate, _clamp, rceil_exponent
from mxfp4conv.formats.nvfp4 import dequantize_nvfp4


def margins(packed: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> dict[str, float]:
    x = dequantize_nvfp4(packed, scales, g, divisor=False)
    a = x.reshape(x.shape[0], -1, 32).abs()
    amax = a.amax(-1)
    er = rceil_exponent(amax)
    zero = amax == 0
    ea = torch.where(zero, 0, _clamp(er))
    eb = torch.where(zero, 0, _clamp(er - 1))
    _, _, ra, _, _ = _candidate(a, ea, None)
    _, qb, rb, _, _ = _candidate(a, eb, None)
    u, aa, bb = qb.double(), 2.0 * ra.double(), rb.double()
    t = (aa - bb) * ((u + u) - (aa + bb))
    d, tot = t.sum(-1), t.abs().sum(-1)
    ok = ~zero & (ea != eb)
    d, tot = d[ok], tot[ok]
    return {"blocks": int(ok.sum()), "all_terms_zero": int((tot == 0).sum()),
            "tie_nonzero_terms": int(((d == 0) & (tot > 0)).sum()),
            "within_2^-18": int(((d.abs() < tot * 2.0**-18) & (tot > 0)).sum()),
            "rceil_minus_1_wins": round(float((d < 0).double().mean()), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    args = ap.parse_args()
    r, k = args.rows, args.k
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (r, k // 2), generator=gen, dtype=torch.uint8)
    sc = torch.randint(0x20, 0x7F, (r, k // 16), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    g = ((torch.rand(r, generator=gen) * 7 + 0.5) / 2688).float()
    fams = {"uniform codes and scales": (packed, sc, g)}
    w = torch.randn(r, k, generator=gen)  # Gaussian weights quantized to NVFP4 (amax / 6 block scales)
    gs = w.abs().amax() / (6 * 448)
    blk = w.view(r, k // 16, 16)
    s = (blk.abs().amax(-1) / 6 / gs).to(torch.float8_e4m3fn)
    codes = e2m1_encode((blk / (s.float() * gs)[..., None].clamp(min=1e-30)).float().reshape(r, k))
    fams["gaussian -> nvfp4"] = (codes[:, 0::2] | (codes[:, 1::2] << 4), s, torch.full((r,), float(gs)))
    fams["constant scales"] = (packed, torch.full((r, k // 16), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn),
                               torch.ones(r))
    small = torch.randint(0, 3, (r, k // 2), generator=gen, dtype=torch.uint8)
    small = small | (torch.randint(0, 3, (r, k // 2), generator=gen, dtype=torch.uint8) << 4)
    small[:, ::8] |= 0x07
    fams["small codes and one 6 per half"] = (small, sc, g)
    for name, (p, sv, gv) in fams.items():
        print(json.dumps({"family": name, **margins(p, sv, gv)}))


if __name__ == "__main__":
    main()
