"""Marlin FP4 layout: every golden case (vLLM 0.33.0) byte for byte (round trips: test_marlin_roundtrip.py).

Golden folder: ``$MXFP4CONV_GOLDEN_MARLIN`` if set, else ``tests/data/golden_marlin`` (in the repository).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mxfp4conv.formats import marlin as M
from mxfp4conv.formats import marlin_scales as MS

REPO = Path(__file__).resolve().parents[2]
COPY = REPO / "tests" / "data" / "golden_marlin"


def _resolve() -> Path | None:
    env = os.environ.get("MXFP4CONV_GOLDEN_MARLIN")
    cands = ([Path(env)] if env else []) + [COPY]
    return next((c for c in cands if (c / "index.json").is_file()), None)


def golden_dir() -> Path:
    root = _resolve()
    if root is None:
        pytest.skip("no Marlin golden folder found")
    return root


def _index() -> list[dict]:
    root = _resolve()
    return list(json.loads((root / "index.json").read_text())) if root else []


CASES = _index()
DTYPES = {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes (any dtype), so -0.0 / NaN payloads / fp8 patterns compare exactly."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (bits(got) != bits(want)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.numel()} bytes differ, first at byte {int(diff[0])}"


def load_case(case: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    path = golden_dir() / case["file"]
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata() or {})
    return load_file(str(path)), meta


def case_id(case: dict) -> str:
    return str(case["file"]).removesuffix(".safetensors")


# ---- golden ------------------------------------------------------------------------------------


def test_golden_index_matches_files() -> None:
    """index.json agrees with the tensors actually stored (guards a stale or truncated copy)."""
    assert len(CASES) >= 10
    for case in CASES:
        t, meta = load_case(case)
        assert meta == case["meta"]
        stored = {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in t.items()}
        assert stored == case["tensors"], case["file"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_golden_layer(case: dict) -> None:
    """The whole-layer helpers reproduce every ``out.*`` tensor, and nothing else."""
    t, meta = load_case(case)
    pd = DTYPES[meta["params_dtype"]]
    a8 = meta["input_dtype"] != "None"
    inp = {k.removeprefix("in."): v for k, v in t.items() if k.startswith("in.")}
    if meta["layer"] == "dense":
        got = M.prepare_dense_fp4(
            inp["weight"],
            inp["weight_scale"],
            quant=meta["quant"],
            params_dtype=pd,
            global_scale=inp.get("weight_global_scale"),
            bias=inp.get("bias"),
            a8=a8,
        )
    else:
        got = M.prepare_moe_fp4(
            inp["w13_weight"],
            inp["w13_weight_scale"],
            inp["w2_weight"],
            inp["w2_weight_scale"],
            quant=meta["quant"],
            params_dtype=pd,
            w13_global=inp.get("w13_weight_scale_2"),
            w2_global=inp.get("w2_weight_scale_2"),
            w13_bias=inp.get("w13_bias"),
            w2_bias=inp.get("w2_bias"),
            a8=a8,
        )
    want = {k.removeprefix("out."): v for k, v in t.items() if k.startswith("out.")}
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert_same(got[name], w, name)


def _dense_primitives(
    weight: torch.Tensor,
    scale: torch.Tensor,
    quant: str,
    pd: torch.dtype,
    a8: bool,
    sf: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    w = M.repack_fp4_weight(weight, a8=a8)
    if quant == "mxfp4":
        return w, MS.mxfp4_scales_to_marlin(scale, a8=a8)
    return w, MS.nvfp4_scales_to_marlin(scale, params_dtype=pd, sf=sf)


@pytest.mark.parametrize("case", [c for c in CASES if c["meta"]["layer"] == "dense"], ids=case_id)
def test_golden_dense_primitives(case: dict) -> None:
    """The same bytes through the individual functions, incl. the padding rule read off the outputs."""
    t, meta = load_case(case)
    pd = DTYPES[meta["params_dtype"]]
    a8 = meta["input_dtype"] != "None"
    quant, n, k = meta["quant"], int(meta["N"]), int(meta["K"])
    g = 32 if quant == "mxfp4" else 16
    kp, np2 = t["out.weight"].shape  # [Kp/16, 2Np]
    assert M.marlin_padded_nk(n, k, g) == (np2 // 2, kp * 16)
    assert (M.check_marlin_shape(n, k, g) is None) == ((np2 // 2, kp * 16) == (n, k))
    p = M.pad_dense_fp4(t["in.weight"], t["in.weight_scale"], t.get("in.bias"), group=g)
    assert (p.n, p.k, p.np, p.kp) == (n, k, np2 // 2, kp * 16)
    sf = MS.nvfp4_rescale_factor(t["in.weight_scale"], pd) if quant == "nvfp4" else 1.0
    w, s = _dense_primitives(p.packed, p.scales, quant, pd, a8, sf)
    assert_same(w, t["out.weight"], "weight")
    assert_same(s, t["out.weight_scale"].view(torch.uint8), "weight_scale")
    if quant == "nvfp4":
        gs = MS.nvfp4_global_to_marlin(t["in.weight_global_scale"], params_dtype=pd, sf=sf)
        assert_same(gs, t["out.weight_global_scale"], "global")
        if "rescaled" in case["file"]:
            assert sf > 1  # README: small scales -> rescale factor 2^k > 1
        assert MS.nvfp4_scales_match(p.scales, s, params_dtype=pd, sf=sf)
    if "in.bias" in t:
        assert p.bias is not None
        assert_same(MS.permute_bias(p.bias), t["out.bias"], "bias")
    # inverses recover the (padded) inputs
    assert_same(M.unrepack_fp4_weight(w, p.np, p.kp, a8=a8), p.packed, "unrepack")
    if quant == "mxfp4":
        assert_same(MS.mxfp4_scales_from_marlin(s, a8=a8), p.scales.view(torch.uint8), "unscale")
    elif MS.nvfp4_scales_encoding_lossless(p.scales, params_dtype=pd, sf=sf):
        dec = MS.nvfp4_scales_from_marlin(s, params_dtype=pd, sf=sf)
        assert_same(dec, p.scales.view(torch.uint8), "unscale")


@pytest.mark.parametrize("case", [c for c in CASES if c["meta"]["layer"] == "moe"], ids=case_id)
def test_golden_moe_per_expert(case: dict) -> None:
    """MoE = the dense transform per expert; NVFP4 sf shared by all experts of w13 (resp. w2)."""
    t, meta = load_case(case)
    pd = DTYPES[meta["params_dtype"]]
    quant = meta["quant"]
    for name in ("w13", "w2"):
        scales = t[f"in.{name}_weight_scale"]
        sf = MS.nvfp4_rescale_factor(scales, pd) if quant == "nvfp4" else 1.0
        per = [
            _dense_primitives(t[f"in.{name}_weight"][e], scales[e], quant, pd, False, sf)
            for e in range(int(meta["E"]))
        ]
        assert_same(torch.stack([w for w, _ in per]), t[f"out.{name}_weight"], f"{name}_weight")
        want_s = t[f"out.{name}_weight_scale"].view(torch.uint8)
        assert_same(torch.stack([s for _, s in per]), want_s, f"{name}_weight_scale")
        if f"in.{name}_bias" in t:
            bias = torch.stack([MS.permute_bias(b.to(pd)) for b in t[f"in.{name}_bias"]])
            assert_same(bias, t[f"out.{name}_bias"], f"{name}_bias")
        if quant == "nvfp4":
            gs = MS.nvfp4_global_to_marlin(t[f"in.{name}_weight_scale_2"], params_dtype=pd, sf=sf)
            assert_same(gs, t[f"out.{name}_weight_scale_2"], f"{name}_weight_scale_2")


def test_gptoss_rows_stay_interleaved() -> None:
    """Swapping w13's gate/up rows (de-interleaving) must change the bytes: vLLM keeps the order."""
    t, _ = load_case(next(c for c in CASES if c["file"].startswith("gptoss")))
    w = t["in.w13_weight"]
    halves = torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)
    assert not torch.equal(M.repack_fp4_weight(halves), t["out.w13_weight"])
    assert torch.equal(M.repack_fp4_weight(w), t["out.w13_weight"])
