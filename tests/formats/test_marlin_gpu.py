"""Marlin FP4 encoders give identical bytes on CPU and CUDA (random + golden inputs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mxfp4conv.formats import marlin as M
from mxfp4conv.formats import marlin_scales as MS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = Path(__file__).resolve().parents[2]


def _golden_dir() -> Path | None:
    env = os.environ.get("MXFP4CONV_GOLDEN_MARLIN")
    cands = [Path(env)] if env else []
    cands += [REPO / "tests" / "data" / "golden_marlin"]
    return next((c for c in cands if (c / "index.json").is_file()), None)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same_on_both(name: str, cpu: torch.Tensor, gpu: torch.Tensor) -> None:
    assert gpu.device.type == "cuda", name
    assert cpu.dtype == gpu.dtype and cpu.shape == gpu.shape, name
    assert torch.equal(_bytes(cpu), _bytes(gpu)), f"{name}: CPU and CUDA bytes differ"


def run_all(dev: torch.device, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every encoder / decoder of the module on one set of random inputs, on ``dev``."""
    t = {k: v.to(dev) for k, v in t.items()}
    out: dict[str, torch.Tensor] = {}
    for a8 in (False, True):
        w = M.repack_fp4_weight(t["w"], a8=a8)
        out[f"repack{a8}"] = w
        out[f"unrepack{a8}"] = M.unrepack_fp4_weight(w, 256, 512, a8=a8)
        s = MS.mxfp4_scales_to_marlin(t["mx"], a8=a8)
        out[f"mx{a8}"], out[f"unmx{a8}"] = s, MS.mxfp4_scales_from_marlin(s, a8=a8)
    for pd in (torch.bfloat16, torch.float16):
        sf = MS.nvfp4_rescale_factor(t["nv"], pd)
        s = MS.nvfp4_scales_to_marlin(t["nv"], params_dtype=pd, sf=sf)
        out[f"nv{pd}"] = s
        out[f"unnv{pd}"] = MS.nvfp4_scales_from_marlin(s, params_dtype=pd, sf=sf)
        out[f"gs{pd}"] = MS.nvfp4_global_to_marlin(t["gs"], params_dtype=pd, sf=sf)
    out["nv_lifted"] = MS.nvfp4_scales_to_marlin(t["nv_small"], params_dtype=torch.bfloat16, sf=2.0**9)
    out["bias"] = MS.permute_bias(t["bias"], dtype=torch.bfloat16)
    out["unbias"] = MS.unpermute_bias(out["bias"])
    p = M.pad_dense_fp4(t["w_odd"], t["mx_odd"], t["bias_odd"], group=32)
    dense = M.prepare_dense_fp4(p.packed, p.scales, quant="mxfp4", bias=p.bias)
    out.update({f"dense.{k}": v for k, v in dense.items()})
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_inputs_identical(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8)

    nv = u8(3, 256, 32, lo=0, hi=0xFF)
    nv[(nv & 0x7F) == 0x7F] = 0x38  # no NaN scales (refused)
    inputs = {
        "w": u8(3, 256, 256),
        "mx": u8(3, 256, 16, hi=250),
        "nv": nv,  # includes negatives, zeros and subnormals
        "nv_small": u8(3, 256, 32, lo=0, hi=0x10),
        "gs": torch.rand(3, generator=g) * 1e-3,
        "bias": torch.randn(3, 256, generator=g),
        "w_odd": u8(96, 96),
        "mx_odd": u8(96, 6, hi=250),
        "bias_odd": torch.randn(96, generator=g).to(torch.bfloat16),
    }
    cpu = run_all(torch.device("cpu"), inputs)
    gpu = run_all(torch.device("cuda"), inputs)
    assert sorted(cpu) == sorted(gpu)
    for name in cpu:
        assert_same_on_both(name, cpu[name], gpu[name])


def test_golden_inputs_identical() -> None:
    root = _golden_dir()
    if root is None:
        pytest.skip("no Marlin golden folder found")
    dtypes = {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}
    for case in json.loads((root / "index.json").read_text()):
        meta = case["meta"]
        t = load_file(str(root / case["file"]))
        results = []
        for dev in ("cpu", "cuda"):
            i = {k.removeprefix("in."): v.to(dev) for k, v in t.items() if k.startswith("in.")}
            kw = {"quant": meta["quant"], "params_dtype": dtypes[meta["params_dtype"]]}
            if meta["layer"] == "dense":
                res = M.prepare_dense_fp4(
                    i["weight"], i["weight_scale"], global_scale=i.get("weight_global_scale"),
                    bias=i.get("bias"), a8=meta["input_dtype"] != "None", **kw,
                )  # fmt: skip
            else:
                res = M.prepare_moe_fp4(
                    i["w13_weight"], i["w13_weight_scale"], i["w2_weight"], i["w2_weight_scale"],
                    w13_global=i.get("w13_weight_scale_2"), w2_global=i.get("w2_weight_scale_2"),
                    w13_bias=i.get("w13_bias"), w2_bias=i.get("w2_bias"), **kw,
                )  # fmt: skip
            results.append(res)
        cpu, gpu = results
        assert sorted(cpu) == sorted(gpu)
        for name in cpu:
            assert_same_on_both(f"{case['file']}:{name}", cpu[name], gpu[name])
            assert torch.equal(_bytes(cpu[name]), _bytes(t[f"out.{name}"])), f"{case['file']}:{name}"
