"""GPU requant (Triton) vs the CPU reference: byte-identical packed bytes, E8M0 bytes and stats.

Every scale rule and both second-level conventions (ModelOpt multiplier, compressed-tensors
divisor) on (a) large random NVFP4 data and (b) adversarial data: E2M1 midpoint ties after
scaling, block maxima on powers of two and on the 1.5 / 1.75 mantissa boundaries (and one ulp
either side), all-zero blocks, -0, second-level scales near the fp32 limits, subnormal E4M3 block
scales and second-level scales where a reciprocal multiply differs from the IEEE division.

Skipped without CUDA. For a CPU dry run of the kernel logic in Triton's interpreter (slow, small
sizes; ``--noconftest`` because conftest skips ``gpu`` tests without CUDA):
``TRITON_INTERPRET=1 MXFP4CONV_GPU_TEST_SIZE=64x256 pytest --noconftest tests/numerics/test_requant_gpu.py``
(Triton 3.6's interpreter calls ``int()`` on 1-element arrays, which numpy 2.x refuses; we patched a
private copy of ``triton/runtime/interpreter.py`` for that run).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not torch.cuda.is_available() and not _INTERPRET:
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from mxfp4conv.formats.mxfp4 import ScaleRule  # noqa: E402
from mxfp4conv.kernels.requant_triton import (  # noqa: E402
    KernelConfig,
    auto_num_warps,
    requant_nvfp4_gpu_chunks,
    requant_rows,
    requant_rows_into,
)
from mxfp4conv.numerics.requant_cpu import requant_rows_cpu  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = torch.device("cpu" if _INTERPRET else "cuda")
RULES = ["floor", "even", "rceil", "mse"]
CONVENTIONS = [False, True]  # divisor: False = ModelOpt multiplier, True = compressed-tensors divisor
_SIZE = os.environ.get("MXFP4CONV_GPU_TEST_SIZE", "4096x7168")
BIG_R, BIG_K = (int(v) for v in _SIZE.lower().split("x"))
F32_MIN_NORMAL = float(np.finfo(np.float32).tiny)


def _rule(name: str) -> ScaleRule:
    """The ScaleRule member for ``name``."""
    return ScaleRule[name.upper()]


# ----------------------------------------------------------------------------------------------
# data


def _e4m3(t: torch.Tensor) -> torch.Tensor:
    """uint8 bit patterns -> float8_e4m3fn (NaN patterns 0x7F / 0xFF must not occur)."""
    assert not bool(((t & 0x7F) == 0x7F).any()), "NaN e4m3 pattern in test data"
    return t.contiguous().view(torch.float8_e4m3fn)


def random_nvfp4(r: int, k: int, divisor: bool, seed: int) -> tuple[torch.Tensor, ...]:
    """Random codes, realistic positive block scales (some zero / subnormal), random-mantissa
    second-level scales of the convention's magnitude."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (r, k // 2), generator=gen, dtype=torch.uint8)
    sc = torch.randint(0, 0x7F, (r, k // 16), generator=gen, dtype=torch.uint8)  # 0x00..0x7E
    g = torch.rand(r, generator=gen, dtype=torch.float64) * 7.0 + 0.5
    g = (g * 400.0 if divisor else g / 2688.0).float()
    return packed, _e4m3(sc), g


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """int codes [R, K] -> packed uint8 [R, K/2], element 2i in the low nibble."""
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
    return c[..., 0] | (c[..., 1] << 4)


def _rand_codes(gen: torch.Generator, shape: tuple[int, ...], max_mag: int = 7) -> torch.Tensor:
    mag = torch.randint(0, max_mag + 1, shape, generator=gen)
    return mag | (torch.randint(0, 2, shape, generator=gen) << 3)


def _e4m3_of(vals: torch.Tensor) -> torch.Tensor:
    """float values (exactly representable in E4M3) -> uint8 bit patterns."""
    f8 = vals.float().to(torch.float8_e4m3fn)
    assert torch.equal(f8.float(), vals.float()), "value not representable in e4m3"
    return f8.view(torch.uint8)


def _recip_differs_g(n: int, seed: int) -> torch.Tensor:
    """Second-level divisors g for which RN(p / g) != RN(p * RN(1/g)) for many E2M1*E4M3 products p."""
    rng = np.random.default_rng(seed)
    e2m1 = np.array([0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    s = np.array([1, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875], np.float32)
    p = (e2m1[:, None] * s[None, :]).reshape(-1).astype(np.float32)
    cands = (rng.uniform(1.0, 2.0, 4096) * 2.0 ** rng.integers(-3, 12, 4096)).astype(np.float32)
    with np.errstate(all="ignore"):
        true = p[None, :] / cands[:, None]
        recip = p[None, :] * (np.float32(1.0) / cands)[:, None]
    score = (true != recip).sum(1)
    best = cands[np.argsort(-score, kind="stable")[:n]]
    assert score.max() > 0
    return torch.from_numpy(best.copy())


def adversarial_nvfp4(divisor: bool, seed: int = 7, k: int = 128) -> dict[str, tuple[torch.Tensor, ...]]:
    """Named adversarial families, each ``(packed [R, K/2], scales e4m3 [R, K/16], g [R])``."""
    gen = torch.Generator().manual_seed(seed)
    nb16 = k // 16
    fam: dict[str, tuple[torch.Tensor, ...]] = {}

    # 1. Midpoint ties: 16-halves with power-of-two scale s_a and a "nice" ratio s_b / s_a, so
    #    after the block's power-of-two scaling every product lands on a grid point or a midpoint.
    r = 2048
    codes = _rand_codes(gen, (r, k))
    ratios = torch.tensor([0.5, 0.625, 0.75, 0.875, 1.0, 1.25, 1.5, 1.75, 2.5, 3.0, 3.5])
    s_a = 2.0 ** torch.randint(-4, 4, (r, nb16 // 2), generator=gen).double()
    s_b = s_a * ratios[torch.randint(0, len(ratios), (r, nb16 // 2), generator=gen)].double()
    sc = torch.stack([s_a, s_b], -1).reshape(r, nb16)
    g = 2.0 ** torch.randint(-3, 4, (r,), generator=gen).float()
    fam["ties"] = (_pack_codes(codes), _e4m3(_e4m3_of(sc)), g)

    # 2. Block maxima on 2^k, 1.5 * 2^k, 1.75 * 2^k (and +-1 ulp with the multiplier):
    #    element 0 of each block is code 6 (4.0) with scale 1 or 1.5 or 1.75, the rest <= 4.0.
    r = 1024
    codes = _rand_codes(gen, (r, k), max_mag=6)
    codes[:, ::32] = 6 | (torch.randint(0, 2, (r, k // 32), generator=gen) << 3)
    if divisor:
        mant = torch.tensor([1.0, 1.5, 1.75])[torch.randint(0, 3, (r, nb16), generator=gen)]
        sc = _e4m3_of(mant)
        g = 2.0 ** torch.randint(-120, 126, (r,), generator=gen).float()
    else:
        sc = _e4m3_of(torch.ones(r, nb16))
        tgt_bits = torch.tensor([0x3F800000, 0x3F7FFFFF, 0x3F800001, 0x3FC00000, 0x3FBFFFFF, 0x3FC00001,
                                 0x3FE00000, 0x3FDFFFFF, 0x3FE00001, 0x3FFFFFFF], dtype=torch.int32)
        tgt = tgt_bits[torch.randint(0, len(tgt_bits), (r,), generator=gen)].view(torch.float32).double()
        tgt = tgt * 2.0 ** torch.randint(-124, 126, (r,), generator=gen).double()
        g = (tgt / 4.0).float()  # x0 = 4 * g = the target, exactly
    fam["amax_boundaries"] = (_pack_codes(codes), _e4m3(sc), g)

    # 3. All-zero blocks (+0 / -0 codes, or zero block scales with any codes), and -0 mixed in.
    r = 512
    codes = _rand_codes(gen, (r, k))
    zero_blocks = torch.rand(r, k // 32, generator=gen) < 0.5
    zmask = zero_blocks.repeat_interleave(32, 1)
    codes = torch.where(zmask, torch.randint(0, 2, (r, k), generator=gen) * 8, codes)
    neg0 = torch.rand(r, k, generator=gen) < 0.3
    codes = torch.where(neg0, torch.full_like(codes, 8), codes)
    scb = torch.randint(0x30, 0x48, (r, nb16), generator=gen, dtype=torch.uint8)
    zscale = torch.rand(r, nb16, generator=gen) < 0.2
    scb = torch.where(zscale, (torch.randint(0, 2, (r, nb16), generator=gen) * 0x80).to(torch.uint8), scb)
    g = (torch.rand(r, generator=gen) + 0.5).float()
    fam["zeros_and_neg_zero"] = (_pack_codes(codes), _e4m3(scb), g)

    # 4. Second-level scales near the fp32 limits: subnormal / min-normal results, huge results.
    r = 512
    codes = _rand_codes(gen, (r, k))
    scb = torch.randint(0, 0x7F, (r, nb16), generator=gen, dtype=torch.uint8)
    if divisor:
        choices = [3.4e38, 1e38, 2.0**126, 1.7e37, 1e-30, 1e-35]  # x = p / g: tiny ... near max
    else:
        choices = [F32_MIN_NORMAL, 1.5 * F32_MIN_NORMAL, 1e-39, 2.0**-140, 1e30, 1e34]
    g = torch.tensor(choices, dtype=torch.float32)[torch.randint(0, len(choices), (r,), generator=gen)]
    fam["extreme_global"] = (_pack_codes(codes), _e4m3(scb), g)

    # 4b. amax in [1.75 * 2^127, fp32 max]: EVEN's rounded amax overflows the exponent field.
    r = 64
    codes = _rand_codes(gen, (r, k))
    codes[:, ::32] = 7
    scb = torch.full((r, nb16), 0x7E, dtype=torch.uint8)  # 448
    top = 3.2e38 / (6.0 * 448.0)
    g = torch.full((r,), (1.0 / top) if divisor else top, dtype=torch.float32)
    fam["near_fp32_max"] = (_pack_codes(codes), _e4m3(scb), g)

    # 5. Subnormal E4M3 block scales (0x01..0x07, both signs).
    r = 512
    codes = _rand_codes(gen, (r, k))
    scb = torch.randint(1, 8, (r, nb16), generator=gen, dtype=torch.uint8)
    scb = scb | (torch.randint(0, 2, (r, nb16), generator=gen, dtype=torch.uint8) << 7)
    g = (torch.rand(r, generator=gen) * 4 + 0.25).float()
    fam["subnormal_e4m3"] = (_pack_codes(codes), _e4m3(scb), g)

    # 6. Divisors where the reciprocal multiply rounds differently from the IEEE division.
    r = 1024
    codes = _rand_codes(gen, (r, k))
    s_vals = torch.tensor([1, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875])
    sc = s_vals[torch.randint(0, len(s_vals), (r, nb16), generator=gen)]
    gs = _recip_differs_g(64, seed)
    g = gs[torch.randint(0, len(gs), (r,), generator=gen)]
    if not divisor:
        g = (1.0 / g.double()).float()
    fam["div_vs_reciprocal"] = (_pack_codes(codes), _e4m3(_e4m3_of(sc)), g)

    # 7. MSE near-ties: the two candidates' exact errors tie (with nonzero terms) or differ by
    #    ~2^-18 .. 2^-21 of them, so the kernel's float32 decision must fall back to the exact one.
    from tests.numerics.test_requant import mse_near_tie_nvfp4

    fam["mse_near_ties"] = mse_near_tie_nvfp4(divisor, r=256, k=k)
    return fam


# ----------------------------------------------------------------------------------------------
# comparison


def _dequant_cpu(packed: torch.Tensor, scales: torch.Tensor, g: torch.Tensor, divisor: bool) -> torch.Tensor:
    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    p = lut[codes] * scales.float().repeat_interleave(16, 1)
    return p / g[:, None] if divisor else p * g[:, None]


def assert_identical(gpu: tuple[torch.Tensor, ...], cpu: tuple[torch.Tensor, ...], what: str) -> None:
    """Exact equality of the three outputs; stats compared as raw float64 bits."""
    names = ("packed", "scales", "row_stats")
    for name, a, b in zip(names, gpu, cpu, strict=True):
        a = a.cpu()
        assert a.shape == b.shape and a.dtype == b.dtype, (
            f"{what}: {name} {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        if name == "row_stats":
            a, b = a.view(torch.int64), b.view(torch.int64)
        bad = (a != b).nonzero()
        if len(bad):
            i = tuple(bad[0].tolist())
            va, vb = (gpu[names.index(name)].cpu()[i], cpu[names.index(name)][i])
            pytest.fail(f"{what}: {name} differs at {len(bad)} places; first {i}: gpu {va!r} cpu {vb!r}")


def _run_both(packed: torch.Tensor, sc: torch.Tensor, g: torch.Tensor, divisor: bool, rule: str,
              what: str) -> tuple[torch.Tensor, ...]:
    cpu = requant_rows_cpu(packed, sc, g, divisor, _rule(rule))
    gpu = requant_rows(packed.to(DEV), sc.to(DEV), g.to(DEV), divisor, _rule(rule))
    assert_identical(gpu, cpu, what)
    return cpu


# ----------------------------------------------------------------------------------------------
# tests


@triton.jit
def _plain_div_kernel(p_ptr, g_ptr, o_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads the annotations
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(o_ptr + i, tl.load(p_ptr + i, mask=m) / tl.load(g_ptr + i, mask=m), mask=m)


@pytest.mark.parametrize("divisor", CONVENTIONS, ids=["modelopt", "ct"])
@pytest.mark.parametrize("rule", RULES)
def test_random_large_identical(rule: str, divisor: bool) -> None:
    packed, sc, g = random_nvfp4(BIG_R, BIG_K, divisor, seed=1000 + RULES.index(rule) * 2 + divisor)
    cpu = requant_rows_cpu(packed, sc, g, divisor, _rule(rule))
    # Poisoned, preallocated outputs: every byte must be written.
    outs = (torch.full((BIG_R, BIG_K // 2), 0xA5, dtype=torch.uint8, device=DEV),
            torch.full((BIG_R, BIG_K // 32), 0xA5, dtype=torch.uint8, device=DEV),
            torch.full((BIG_R, 5), float("nan"), dtype=torch.float64, device=DEV))
    requant_rows_into(packed.to(DEV), sc.to(DEV), g.to(DEV), divisor, _rule(rule), *outs)
    assert_identical(outs, cpu, f"random {BIG_R}x{BIG_K} {rule} divisor={divisor}")


@pytest.mark.parametrize("divisor", CONVENTIONS, ids=["modelopt", "ct"])
@pytest.mark.parametrize("rule", RULES)
def test_adversarial_identical(rule: str, divisor: bool) -> None:
    for name, (packed, sc, g) in adversarial_nvfp4(divisor).items():
        _run_both(packed, sc, g, divisor, rule, f"{name} {rule} divisor={divisor}")


@pytest.mark.parametrize("divisor", CONVENTIONS, ids=["modelopt", "ct"])
def test_adversarial_data_is_adversarial(divisor: bool) -> None:
    """The families really hit what they are named after (checked on the CPU reference)."""
    fam = adversarial_nvfp4(divisor)
    packed, sc, g = fam["ties"]
    x = _dequant_cpu(packed, sc, g, divisor)
    _, scales, _ = requant_rows_cpu(packed, sc, g, divisor, _rule("floor"))
    q = (x * torch.pow(2.0, 127.0 - scales.double()).float().repeat_interleave(32, 1)).abs()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    for m in mids:
        assert int((q == m).sum()) > 0, f"no E2M1 tie at {float(m)}"
    packed, sc, g = fam["div_vs_reciprocal"]
    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    p = lut[codes] * sc.float().repeat_interleave(16, 1)
    if divisor:
        assert int((p / g[:, None] != p * (1.0 / g)[:, None]).sum()) > 0
    packed, sc, g = fam["extreme_global"]
    x = _dequant_cpu(packed, sc, g, divisor)
    sub = (x != 0) & (x.abs() < F32_MIN_NORMAL)
    assert int(sub.sum()) > 0, "no subnormal dequantized values"
    assert bool(torch.isfinite(x).all())


@pytest.mark.parametrize("rule", RULES)
def test_odd_shapes(rule: str) -> None:
    """Row counts that are not a multiple of the program's rows; K/32 of 1, 2, 3, 5, 6 (the loop
    then walks 1 or 2 blocks per iteration). One convention per rule keeps the compiles few."""
    divisor = rule in ("even", "mse")
    for r, k in ((1, 32), (129, 64), (300, 96), (70, 160), (33, 192)):
        packed, sc, g = random_nvfp4(r, k, divisor, seed=r * 7 + k)
        _run_both(packed, sc, g, divisor, rule, f"{r}x{k} {rule} divisor={divisor}")


def test_configs_identical() -> None:
    """Every launch shape gives the same bytes (prefetch included), and so does the plain
    ``div.rn.f32`` division path."""
    cases = [(False, KernelConfig(num_warps=1)),
             (False, KernelConfig(num_warps=2, rows=32)),
             (False, KernelConfig(num_warps=8)),
             (False, KernelConfig(num_warps=4, prefetch=True)),
             (False, KernelConfig(num_warps=4, prefetch=True, rows=64)),
             (False, KernelConfig(num_warps=8, prefetch=True, rows=16)),
             (True, KernelConfig(num_warps=4, fast_div=False)),
             (True, KernelConfig(num_warps=4, fast_div=True)),
             (True, KernelConfig(num_warps=8, prefetch=True)),
             (True, KernelConfig(num_warps=4, prefetch=True, rows=32)),
             (True, KernelConfig(num_warps=4, prefetch=True, mse_exact=True)),
             (False, KernelConfig(num_warps=2, mse_exact=True))]
    for k in (512, 96, 800):  # 16 blocks per row, 3 and 25 (the last step of 8 blocks masked)
        for rule in ("even", "mse"):
            for divisor, cfg in cases:
                packed, sc, g = random_nvfp4(1000, k, divisor, seed=5)
                cpu = requant_rows_cpu(packed, sc, g, divisor, _rule(rule))
                outs = (torch.empty((1000, k // 2), dtype=torch.uint8, device=DEV),
                        torch.empty((1000, k // 32), dtype=torch.uint8, device=DEV),
                        torch.empty((1000, 5), dtype=torch.float64, device=DEV))
                requant_rows_into(packed.to(DEV), sc.to(DEV), g.to(DEV), divisor, _rule(rule), *outs, config=cfg)
                assert_identical(outs, cpu, f"{cfg} {rule} k={k} divisor={divisor}")
    packed, sc, g = random_nvfp4(600, 256, True, seed=6)
    cpu = requant_rows_cpu(packed, sc, g, True, _rule("mse"))
    outs = (torch.empty((600, 128), dtype=torch.uint8, device=DEV),
            torch.empty((600, 8), dtype=torch.uint8, device=DEV),
            torch.empty((600, 5), dtype=torch.float64, device=DEV))
    requant_rows_into(packed.to(DEV), sc.to(DEV), g.to(DEV), True, _rule("mse"), *outs,
                      config=KernelConfig(num_warps=2, prefetch=True))
    assert_identical(outs, cpu, "mse prefetch divisor")


@pytest.mark.parametrize("divisor", CONVENTIONS, ids=["modelopt", "ct"])
def test_mse_exact_path_identical(divisor: bool) -> None:
    """MSE's exact float64 decision, taken for every block (``mse_exact``), gives the same bytes as
    the float32 decision with its fallback, on random data and every adversarial family."""
    fams = dict(adversarial_nvfp4(divisor))
    fams["random"] = random_nvfp4(512, 512, divisor, seed=21)
    for name, (packed, sc, g) in fams.items():
        cpu = requant_rows_cpu(packed, sc, g, divisor, _rule("mse"))
        r, kh = packed.shape
        outs = (torch.empty((r, kh), dtype=torch.uint8, device=DEV),
                torch.empty((r, kh // 16), dtype=torch.uint8, device=DEV),
                torch.empty((r, 5), dtype=torch.float64, device=DEV))
        requant_rows_into(packed.to(DEV), sc.to(DEV), g.to(DEV), divisor, _rule("mse"), *outs,
                          config=KernelConfig(num_warps=4, prefetch=True, mse_exact=True))
        assert_identical(outs, cpu, f"mse_exact {name} divisor={divisor}")


def test_auto_num_warps() -> None:
    """The launch-shape heuristic: full waves on the benchmark slab, spread small inputs."""
    assert auto_num_warps(131072, 132) == 8
    assert auto_num_warps(4096, 132) == 1
    assert auto_num_warps(1, 132) in (1, 2, 4, 8)


def test_noncontiguous_inputs() -> None:
    packed, sc, g = random_nvfp4(64, 256, True, seed=9)
    cpu = requant_rows_cpu(packed, sc, g, True, _rule("even"))
    wide = torch.zeros((64, 256), dtype=torch.uint8, device=DEV)
    wide[:, 3:131] = packed.to(DEV)
    gpu = requant_rows(wide[:, 3:131], sc.to(DEV), g.to(DEV), True, _rule("even"))
    assert_identical(gpu, cpu, "strided packed input")


@pytest.mark.skipif(_INTERPRET, reason="streams and pinned memory need CUDA")
@pytest.mark.parametrize("pinned_in", [True, False])
def test_chunked_driver_identical(pinned_in: bool) -> None:
    e, n, k = 3, 1000, 512
    packed, sc, g = random_nvfp4(e * n, k, False, seed=11)
    ref = requant_rows(packed.cuda(), sc.cuda(), g.cuda(), False, _rule("even"))
    p3, s3, g3 = packed.reshape(e, n, k // 2), sc.reshape(e, n, k // 16), g.reshape(e, n)
    if pinned_in:
        p3, s3, g3 = p3.pin_memory(), s3.pin_memory(), g3.pin_memory()
    for pin_output in (True, False):
        out = requant_nvfp4_gpu_chunks(p3, s3, g3, False, _rule("even"), chunk_rows=700, pin_output=pin_output)
        assert out[0].shape == (e, n, k // 2) and out[1].shape == (e, n, k // 32) and out[2].shape == (e, n, 5)
        assert_identical(tuple(o.reshape(e * n, -1) for o in out), tuple(t.cpu() for t in ref),
                         f"chunked pinned_in={pinned_in} pin_output={pin_output}")


@pytest.mark.skipif(_INTERPRET, reason="streams and pinned memory need CUDA")
def test_chunked_driver_scale_row_max() -> None:
    """The row maxima the driver computes on the device are the host's ``(bits & 0x7F).amax(-1)``,
    for every byte (signs and NaN patterns included), across chunk boundaries."""
    e, n, k = 2, 900, 256
    packed, _, g = random_nvfp4(e * n, k, False, seed=12)
    bits = torch.randint(0, 256, (e * n, k // 16), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    got = torch.full((e, n), 0xAA, dtype=torch.uint8)
    requant_nvfp4_gpu_chunks(packed.reshape(e, n, -1), bits.reshape(e, n, -1), g.reshape(e, n), False, _rule("even"),
                             chunk_rows=500, scale_row_max=got)
    assert torch.equal(got.reshape(-1), (bits & 0x7F).amax(-1))


@pytest.mark.skipif(_INTERPRET, reason="needs CUDA")
@pytest.mark.parametrize("divisor", CONVENTIONS)
def test_invalid_scales_same_error_as_cpu(divisor: bool) -> None:
    """Invalid NVFP4 input through the GPU path (validated from the device's row maxima after the
    run) raises the CPU path's error, word for word."""
    from mxfp4conv.model.canonical import FP4Weight
    from mxfp4conv.numerics.requant import requant_nvfp4_to_mxfp4

    packed, sc, g = random_nvfp4(64, 256, divisor, seed=13)
    bad_sc = sc.view(torch.uint8).clone()
    bad_sc[37, 5] = 0xFF
    bad_g = g.clone()
    bad_g[50] = 0.0
    for p_, s_, g_ in ((packed, bad_sc, g), (packed, sc, bad_g)):
        w = FP4Weight("nvfp4", p_.reshape(2, 32, -1), s_.view(torch.float8_e4m3fn).reshape(2, 32, -1),
                      g_.reshape(2, 32), divisor)
        msgs = []
        for device in ("cpu", "cuda"):
            with pytest.raises(ValueError) as info:
                requant_nvfp4_to_mxfp4(w, _rule("mse"), device=device)
            msgs.append(str(info.value))
        assert msgs[0] == msgs[1] and msgs[0].startswith("invalid NVFP4 input")


@pytest.mark.skipif(_INTERPRET, reason="probes the compiled division")
def test_plain_triton_division_probe() -> None:
    """Report (not a failure) how often Triton's default fp32 ``/`` differs from IEEE division on
    the divide-vs-reciprocal data: the reason the kernel uses ``div.rn.f32``."""
    packed, sc, g = adversarial_nvfp4(True)["div_vs_reciprocal"]
    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    p = (lut[codes] * sc.float().repeat_interleave(16, 1)).reshape(-1)
    gg = g[:, None].expand(-1, codes.shape[1]).reshape(-1).contiguous()
    out = torch.empty_like(p, device="cuda")
    _plain_div_kernel[(triton.cdiv(p.numel(), 1024),)](p.cuda(), gg.cuda(), out, p.numel(), BLOCK=1024)
    ieee = p / gg
    recip = p * (1.0 / gg)
    n_plain = int((out.cpu() != ieee).sum())
    n_recip = int((recip != ieee).sum())
    print(f"\n[division probe] {p.numel()} divisions: plain triton '/' differs from IEEE in {n_plain}, "
          f"reciprocal multiply in {n_recip}")
    assert n_recip > 0
