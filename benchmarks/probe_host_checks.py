"""The host-side checks of one Qwen3-30B-A3B-like MoE layer on the GPU conversion path, before and after
the tenth session (milliseconds per layer, this machine's CPU, torch's default thread count):

- the reader's NaN check of the E4M3 block scales (w13 and w2): ``((s & 0x7F) == 0x7F).any()`` against
  ``e4m3_has_nan`` (one reduction of the raw bytes; the mask only when a byte reaches 0x7F);
- the scale validation: on the host (``validate_nvfp4_scales``) against none there (the GPU computes
  the row maxima it needs: ``requant_nvfp4_gpu_chunks(scale_row_max=...)``; not timed here);
- the output's E8M0 0xFF check: ``(s == 0xFF).any()`` against none for requantized outputs (their bytes
  are 0..254 by construction) and ``e8m0_has_nan`` for MXFP4 sources;
- the writer's view of the 768 output tensors: the general ``_as_bytes`` path against its zero-copy
  path for contiguous CPU byte tensors.

    python benchmarks/probe_host_checks.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from mxfp4conv.canonical import FP4Weight, MoELayer
from mxfp4conv.formats.fp4 import e4m3_has_nan, e8m0_has_nan
from mxfp4conv.formats.nvfp4 import validate_nvfp4_scales
from mxfp4conv.io.safetensors_io import _as_bytes
from mxfp4conv.writers.base import moe_split_encode

E, INTER, HIDDEN = 128, 768, 2048


def ms(fn: Callable[[], object], rounds: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
    return round((time.perf_counter() - t0) / rounds * 1e3, 2)


def general_as_bytes(t: torch.Tensor) -> memoryview:
    """``_as_bytes`` before the zero-copy path (its general branch)."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    sc13 = torch.randint(0x30, 0x70, (E, 2 * INTER, HIDDEN // 16), dtype=torch.uint8, generator=gen)
    sc2 = torch.randint(0x30, 0x70, (E, HIDDEN, INTER // 16), dtype=torch.uint8, generator=gen)
    g13 = torch.rand(E, 2 * INTER, generator=gen) + 0.5
    g2 = torch.rand(E, HIDDEN, generator=gen) + 0.5
    w13 = FP4Weight("mxfp4", torch.zeros(E, 2 * INTER, HIDDEN // 2, dtype=torch.uint8),
                    torch.full((E, 2 * INTER, HIDDEN // 32), 120, dtype=torch.uint8))
    w2 = FP4Weight("mxfp4", torch.zeros(E, HIDDEN, INTER // 2, dtype=torch.uint8),
                   torch.full((E, HIDDEN, INTER // 32), 120, dtype=torch.uint8))
    outs = moe_split_encode(MoELayer("x", w13, w2, None, None))
    r = args.rounds
    doc = {
        "threads": torch.get_num_threads(),
        "reader_nan_check_ms": {
            "before": ms(lambda: [bool(((s & 0x7F) == 0x7F).any()) for s in (sc13, sc2)], r),
            "after": ms(lambda: [e4m3_has_nan(s) for s in (sc13, sc2)], r)},
        "scale_validation_ms": {
            "before_host": ms(lambda: [validate_nvfp4_scales(s, g, divisor=False) for s, g in ((sc13, g13), (sc2, g2))], r),
            "after_host": 0.0},
        "output_e8m0_check_ms": {
            "before": ms(lambda: [bool((w.scales == 0xFF).any()) for w in (w13, w2)], r),
            "after_requantized": 0.0,
            "after_mxfp4_source": ms(lambda: [e8m0_has_nan(w.scales) for w in (w13, w2)], r)},
        "as_bytes_ms": {
            "tensors": len(outs),
            "before": ms(lambda: [general_as_bytes(o) for o in outs], r),
            "after": ms(lambda: [_as_bytes(o) for o in outs], r)},
    }
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
