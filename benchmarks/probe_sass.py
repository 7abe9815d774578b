"""Instruction counts of the requant kernel's compiled code (SASS), without a GPU.

    python benchmarks/probe_sass.py [--rules even,mse] [--divisor] [--warps 1 --rows 4]

Compiles ``requant_rows_kernel`` for sm_90 (H100 / H200) with Triton's bundled ptxas, disassembles it
with the bundled nvdisasm, and reports per launch shape: registers per thread, total instructions,
the instructions of the main loop's body (one step: one block per thread when ``rows * 8 ==
warps * 32``), and the shared-memory loads / stores and barriers inside the loop (a layout
conversion between threads shows up there). Needs ``triton`` (any machine; no CUDA device). The
ninth session used it to find the shared-memory layout conversions in the loop; to see the
earlier kernel: ``git show 9cf11e8:mxfp4conv/kernels/_requant_triton_jit.py >
mxfp4conv/kernels/_requant_triton_jit.py`` (restore with ``git checkout`` afterwards), then
``--warps 4 --rows 16 --rules even``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIGNATURE = {"in_ptr": "*i32", "sc_ptr": "*u8", "g_ptr": "*fp32", "out_ptr": "*i32", "osc_ptr": "*u8",
             "st_ptr": "*fp64", "R": "i32", "NB": "i32", "s_in": "i32", "s_sc": "i32", "s_out": "i32",
             "s_osc": "i32", "osc_col": "i32"}
RULES = {"floor": 0, "even": 1, "rceil": 2, "mse": 3}
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")


def compile_sass(rule: int, divisor: bool, warps: int, rows: int, stats: bool, prefetch: bool) -> tuple[str, str]:
    """(SASS text, resource usage line) of one specialization."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mxfp4conv.kernels import _requant_triton_jit as jit

    consts = {"RULE": rule, "DIVISOR": divisor, "ROWS": rows, "USE_ASM": True, "STATS": stats,
              "FAST_DIV": True, "PREFETCH": prefetch, "MSE_EXACT": False}
    # only the arguments this version of the kernel has (an earlier one lacks osc_col), so the probe
    # also measures a checked-out older kernel
    names = jit.requant_rows_kernel.arg_names
    consts = {k: v for k, v in consts.items() if k in names}
    sig = {k: t for k, t in {**SIGNATURE, **{k: "constexpr" for k in consts}}.items() if k in names}
    kernel = triton.compile(ASTSource(jit.requant_rows_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": 1, "enable_fp_fusion": False})
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(bindir / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(bindir / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
    return sass, next((ln.strip() for ln in usage.splitlines() if "REG:" in ln), "")


def loop_body(sass: str) -> list[str]:
    """Opcodes of the main loop: from the label a backward branch returns to, up to that branch
    (the longest such range)."""
    lines = sass.splitlines()
    labels = {ln.strip()[:-1]: i for i, ln in enumerate(lines) if re.match(r"^\.L_x_\d+:$", ln.strip())}
    best: tuple[int, int] = (0, 0)
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    return [m.group(1) for ln in lines[best[0]:best[1] + 1] if (m := _INSTR.search(ln))]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rules", default="even,mse")
    ap.add_argument("--divisor", action="store_true", help="the compressed-tensors divisor convention")
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--no-stats", action="store_true")
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--top", type=int, default=12, help="most frequent opcodes listed")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="probe_sass_"))
    for name in args.rules.split(","):
        sass, usage = compile_sass(RULES[name], args.divisor, args.warps, args.rows, not args.no_stats,
                                   not args.no_prefetch)
        total = [m.group(1) for ln in sass.splitlines() if (m := _INSTR.search(ln))]
        body = loop_body(sass)
        ops = collections.Counter(o.split(".")[0] for o in body)
        print(json.dumps({"rule": name, "divisor": args.divisor, "warps": args.warps, "rows": args.rows,
                          "stats": not args.no_stats, "prefetch": not args.no_prefetch, "resources": usage,
                          "instructions": len(total), "loop_instructions": len(body),
                          "loop_shared_and_barriers": sum(ops[k] for k in ("LDS", "STS", "BAR", "STSM", "LDSM")),
                          "loop_top": ops.most_common(args.top)}))


if __name__ == "__main__":
    main()
