"""Marlin-ready tensors, as the plugin holds them, through vLLM's own Marlin MoE GEMM on a GPU.

The CPU tests prove the plugin's parameters are the shard bytes; here those bytes run through
``_moe_C.moe_wna16_marlin_gemm`` of vLLM 0.33's wheel (its stable-ABI library, loaded with
``torch.ops.load_library``; ``MXFP4CONV_VLLM_MOE_C`` names the .so). Every expert of w13 and w2, and
every dense FP4 Linear run as a one-expert MoE, must give ``x @ W.T (+ b)`` of the source's
dequantized weights (this rank's slice, zero-padded as vLLM pads) within bf16 error; the same bytes
in a wrong layout must not.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FLOAT4_E2M1F_ID = 562949953487106  # vllm.scalar_type.scalar_types.float4_e2m1f.id (vLLM 0.33)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
BLOCK = 16
REPORT: dict[str, float] = {}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module", autouse=True)
def moe_c() -> Iterator[None]:
    lib = os.environ.get("MXFP4CONV_VLLM_MOE_C")
    if not lib or not Path(lib).exists():
        pytest.skip("set MXFP4CONV_VLLM_MOE_C to vLLM 0.33's _moe_C_stable_libtorch.abi3.so")
    torch.ops.load_library(lib)
    yield
    if out := os.environ.get("MXFP4CONV_GPU_REPORT"):
        Path(out).write_text(json.dumps(REPORT, indent=1, sort_keys=True))


def dequant(packed: torch.Tensor, scales: torch.Tensor, group: int, global_mul: torch.Tensor | None = None
            ) -> torch.Tensor:
    """[..., N, K/2] codes + [..., N, K/group] scales (E8M0 bytes, or E4M3 with a multiplier) -> float32."""
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).long()
    vals = E2M1[codes]
    if scales.dtype == torch.uint8:
        s = torch.exp2(scales.float() - 127)
    else:
        s = scales.float() * (global_mul.float().reshape(*global_mul.shape, 1, 1) if global_mul is not None else 1)
    return (vals.reshape(*vals.shape[:-1], -1, group) * s.unsqueeze(-1)).flatten(-2)


def pad2(w: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return torch.nn.functional.pad(w, (0, k - w.shape[-1], 0, n - w.shape[-2]))


def marlin_moe(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None,
               gscale: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
    """Token t goes to expert t % E (top-1, weight 1): one Marlin MoE GEMM over every expert."""
    e, m = w.shape[0], x.shape[0]
    ids, experts = [], []
    for i in range(e):
        t = list(range(i, m, e))
        t += [m] * (-len(t) % BLOCK)
        ids += t
        experts += [i] * (len(t) // BLOCK)
    dev = x.device
    sorted_ids = torch.tensor(ids, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    return torch.ops._moe_C.moe_wna16_marlin_gemm(
        x, None, w, bias, s, None, gscale, None, torch.zeros(sms * 4, dtype=torch.int32, device=dev), sorted_ids,
        torch.tensor(experts, dtype=torch.int32, device=dev), torch.tensor([len(ids)], dtype=torch.int32, device=dev),
        torch.ones(m, 1, dtype=torch.float32, device=dev), BLOCK, 1, False, FLOAT4_E2M1F_ID, m, n, k, False, True,
        False, -1, -1, -1)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())


def check(name: str, x: torch.Tensor, marlin: dict[str, torch.Tensor], prefix: str, ref_w: torch.Tensor,
          ref_b: torch.Tensor | None, wrong: bool = False) -> None:
    """``ref_w`` [E, Np, Kp] float32 (padded as the shards are); x [M, Kp]."""
    dev = torch.device("cuda")
    e, n, k = ref_w.shape
    w = marlin[f"{prefix}weight"].to(dev)
    if w.dim() == 2:
        w = w.unsqueeze(0)
    s = marlin[f"{prefix}weight_scale"].to(dev)
    s = s.unsqueeze(0) if s.dim() == 2 else s
    b = marlin.get(f"{prefix}bias")
    b = b.to(dev).reshape(e, -1) if b is not None else None
    g = marlin.get(f"{prefix}weight_scale_2", marlin.get(f"{prefix}weight_global_scale"))
    g = g.to(dev).reshape(e) if g is not None else None
    if wrong:  # the same bytes, words shifted inside each Marlin tile: a layout the kernel does not expect
        w = w.reshape(-1, 128).roll(1, -1).reshape(w.shape)
    out = marlin_moe(x.to(dev, torch.bfloat16), w, s, b, g, n, k).float().cpu()
    xs = x.float()
    ref = torch.cat([xs[t::e] @ ref_w[t].T + (ref_b[t] if ref_b is not None else 0) for t in range(e)])
    got = torch.cat([out[t::e] for t in range(e)])
    err = rel_err(got, ref)
    REPORT[name + (" (wrong layout)" if wrong else "")] = err
    if wrong:
        assert err > 0.5, f"{name}: a wrong layout gave a relative error of {err:.3g}"
    else:
        assert err < 1e-2, f"{name}: relative error {err:.3g}"


@pytest.fixture(scope="module")
def outputs(marlin_outputs: dict[str, Path]) -> dict[str, Path]:
    return marlin_outputs


def shards(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_qwen3_experts_and_attention(outputs: dict[str, Path], tp: int, rank: int) -> None:
    src, out = shards(outputs["q3src"]), shards(outputs[f"q3tp{tp}"] / f"rank-{rank}")
    gen = torch.Generator().manual_seed(rank)
    e, h, i = 4, 256, 128
    ir = i // tp
    rows = slice(rank * ir, (rank + 1) * ir)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        deq = {(x, proj): dequant(src[f"{p}.{x}.{proj}.weight_packed"], src[f"{p}.{x}.{proj}.weight_scale"], 32)
               for x in range(e) for proj in ("gate_proj", "up_proj", "down_proj")}
        w13 = torch.stack([torch.cat([deq[x, "gate_proj"][rows], deq[x, "up_proj"][rows]]) for x in range(e)])
        w2 = torch.stack([deq[x, "down_proj"][:, rows] for x in range(e)])
        mar = {k.removeprefix(p + "."): v for k, v in out.items() if k.startswith(p + ".")}
        x13, x2 = torch.randn(16 * e, h, generator=gen), torch.randn(16 * e, ir, generator=gen)
        check(f"qwen3 tp{tp} r{rank} L{layer} w13", x13, mar, "w13_", w13, None)
        check(f"qwen3 tp{tp} r{rank} L{layer} w2", x2, mar, "w2_", w2, None)
        if layer == 0 and rank == tp - 1:
            check(f"qwen3 tp{tp} r{rank} w13", x13, mar, "w13_", w13, None, wrong=True)
        a = f"model.layers.{layer}.self_attn"
        for proj in ATTN:
            w = dequant(src[f"{a}.{proj}.weight_packed"], src[f"{a}.{proj}.weight_scale"], 32)
            n, k = w.shape
            w = w[:, rank * k // tp:(rank + 1) * k // tp] if proj == "o_proj" else w[rank * n // tp:(rank + 1) * n // tp]
            mar = {k_.removeprefix(f"{a}.{proj}."): v for k_, v in out.items() if k_.startswith(f"{a}.{proj}.")}
            check(f"qwen3 tp{tp} r{rank} L{layer} {proj} (dense)", torch.randn(16, w.shape[1], generator=gen), mar, "",
                  w.unsqueeze(0), None)


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_gpt_oss_padded_interleaved_with_bias(outputs: dict[str, Path], tp: int, rank: int) -> None:
    src, out = shards(outputs["gosrc"]), shards(outputs[f"gotp{tp}"] / f"rank-{rank}")
    gen = torch.Generator().manual_seed(10 + rank)
    e, h, i = 4, 128, 192
    hp, ip = 256, (256 if tp == 1 else 128)  # vLLM's Marlin sizes: round_up(H, 256), round_up(I/tp, 128)
    chunk = -(-i // 32 // tp) * 32
    start, end = rank * chunk, min(i, (rank + 1) * chunk)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        w13 = dequant(src[f"{p}.gate_up_proj_blocks"].flatten(-2), src[f"{p}.gate_up_proj_scales"], 32)
        w2 = dequant(src[f"{p}.down_proj_blocks"].flatten(-2), src[f"{p}.down_proj_scales"], 32)
        w13 = pad2(w13[:, 2 * start:2 * end], 2 * ip, hp)  # interleaved rows, padding after them
        w2 = pad2(w2[:, :, start:end], hp, ip)
        b13 = torch.nn.functional.pad(src[f"{p}.gate_up_proj_bias"].float()[:, 2 * start:2 * end], (0, 2 * ip - 2 * (end - start)))
        b2 = torch.nn.functional.pad(src[f"{p}.down_proj_bias"].float() * (rank == 0), (0, hp - h))
        mar = {k.removeprefix(p + "."): v for k, v in out.items() if k.startswith(p + ".")}
        check(f"gpt-oss tp{tp} r{rank} L{layer} w13", torch.randn(16 * e, hp, generator=gen), mar, "w13_", w13, b13)
        check(f"gpt-oss tp{tp} r{rank} L{layer} w2", torch.randn(16 * e, ip, generator=gen), mar, "w2_", w2, b2)
        if layer == 0:
            check(f"gpt-oss tp{tp} r{rank} w2", torch.randn(16 * e, ip, generator=gen), mar, "w2_", w2, b2, wrong=True)


def test_nvfp4_kept_with_global_scales(outputs: dict[str, Path]) -> None:
    src, out = shards(outputs["nvsrc"]), shards(outputs["nv"] / "rank-0")
    gen = torch.Generator().manual_seed(20)
    e, h, i = 4, 256, 128
    p = "model.layers.0.mlp.experts"

    def deq(x: int, proj: str) -> torch.Tensor:
        m = f"{p}.{x}.{proj}"
        return dequant(src[f"{m}.weight"], src[f"{m}.weight_scale"], 16, src[f"{m}.weight_scale_2"])

    w13 = torch.stack([torch.cat([deq(x, "gate_proj"), deq(x, "up_proj")]) for x in range(e)])
    w2 = torch.stack([deq(x, "down_proj") for x in range(e)])
    mar = {k.removeprefix(p + "."): v for k, v in out.items() if k.startswith(p + ".")}
    check("nvfp4-kept w13", torch.randn(16 * e, h, generator=gen), mar, "w13_", w13, None)
    check("nvfp4-kept w2", torch.randn(16 * e, i, generator=gen), mar, "w2_", w2, None)
    check("nvfp4-kept w13", torch.randn(16 * e, h, generator=gen), mar, "w13_", w13, None, wrong=True)
