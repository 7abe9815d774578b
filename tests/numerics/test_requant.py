"""NVFP4 -> MXFP4 requant: the CPU fast path (per-block tables) vs the plain composition
``quantize_mxfp4_with_stats(dequantize_nvfp4(...))`` byte for byte, chunking / threading invariance,
statistics, the exact case, invalid input and the CUDA dispatch."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import mxfp4conv.numerics.requant as rq
import mxfp4conv.numerics.requant_cpu as rq_cpu
import mxfp4conv.numerics.requant_stats as rq_stats
from mxfp4conv.files.cbuild import compiler
from mxfp4conv.formats.mxfp4 import ScaleRule
from mxfp4conv.formats.nvfp4 import MAX_REQUANT_MAGNITUDE
from mxfp4conv.kernels import requant_native
from mxfp4conv.model.canonical import FP4Weight
from mxfp4conv.numerics.requant import requant_nvfp4_to_mxfp4
from mxfp4conv.numerics.requant_cpu import requant_rows_cpu
from mxfp4conv.numerics.requant_stats import RequantStats, requant_rows_reference

RULES = list(ScaleRule)
IDS = [r.value for r in RULES]


def random_nvfp4(r: int, k: int, divisor: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (r, k // 2), generator=gen, dtype=torch.uint8)
    sc = torch.randint(0, 0x7F, (r, k // 16), generator=gen, dtype=torch.uint8)  # incl. 0 and subnormals
    g = torch.rand(r, generator=gen, dtype=torch.float64) * 7.0 + 0.5
    g = (g * 400.0 if divisor else g / 2688.0).float()
    return packed, sc.view(torch.float8_e4m3fn), g


def adversarial_nvfp4(divisor: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows whose dequantized values land on E2M1 midpoints after MXFP4 scaling, block maxima on
    powers of two / 1.5 / 1.75 (and an ulp off), zero and negative block scales, -0 codes, subnormal
    block scales, and huge / tiny second-level scales."""
    gen = torch.Generator().manual_seed(3)
    k = 128
    nice = [0x30, 0x38, 0x3C, 0x3E, 0x40, 0x44, 0x48, 0x4C, 0x01, 0x07, 0x08, 0x00, 0x80, 0xB8, 0x7E]
    gs = [1.0, 2.0**-10, 2.0**20, 1.5, 1.75, 3.0, 7.0, float(np.nextafter(np.float32(2), np.float32(3))),
          float(np.nextafter(np.float32(1), np.float32(0))), 1e-30, 1e30, 2.0**-126, 2.0**100]  # fmt: skip
    rows_p, rows_s, rows_g = [], [], []
    for gv in gs:
        for _ in range(4):
            rows_p.append(torch.randint(0, 256, (k // 2,), generator=gen, dtype=torch.uint8))
            idx = torch.randint(0, len(nice), (k // 16,), generator=gen)
            rows_s.append(torch.tensor(nice, dtype=torch.uint8)[idx])
            rows_g.append(1.0 / gv if divisor else gv)
    packed, sc = torch.stack(rows_p), torch.stack(rows_s)
    packed[::3, :8] = 0x88  # -0 everywhere in a 16-block
    packed[1::3, ::8] |= 0x07  # a +-6 in every 16-block: amax on the top code
    packed[2::5, 8:16] = 0  # an all-zero 32-block
    g = torch.tensor(rows_g, dtype=torch.float32)
    ok = np.float32(6 * 448) * (g if not divisor else 1 / g).numpy() < MAX_REQUANT_MAGNITUDE  # keep valid
    return packed[ok], sc[ok].view(torch.float8_e4m3fn), g[ok]


def mse_near_tie_nvfp4(divisor: bool, r: int = 64, k: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """32-blocks whose two MSE candidates' exact squared errors tie with nonzero per-entry terms, or
    differ by ~2^-18 .. 2^-21 of those terms, in both directions: one half holds a single 4 * s (code
    6, s = 1) and the other sixteen 0.5 * s (code 1, s = 0.5), so under RCEIL - 1 the maximum loses
    exactly what the small values gain; the second-level scale 2^k * (1 + delta) tips the balance by
    ~24 * delta. The GPU kernel decides most blocks from float32 sums and must fall back to the exact
    comparison exactly for these."""
    gen = torch.Generator().manual_seed(11)
    nb = k // 32
    blk = torch.zeros(r, nb, 32, dtype=torch.uint8)
    blk.scatter_(2, torch.randint(0, 16, (r, nb, 1), generator=gen), 6)
    blk[..., 16:] = 1
    sc = torch.tensor([0x38, 0x30], dtype=torch.uint8).repeat(r, nb)  # 1.0, 0.5 per half
    swap = torch.rand(r, nb, generator=gen) < 0.5  # the small half first in some blocks
    blk = torch.where(swap[..., None], blk.roll(16, 2), blk)
    sc = torch.where(swap.repeat_interleave(2, 1), sc.view(r, nb, 2).flip(2).reshape(r, 2 * nb), sc)
    codes = blk.reshape(r, k) | ((torch.rand(r, k, generator=gen) < 0.5).to(torch.uint8) << 3)
    deltas = [0.0, 2.0**-20, -(2.0**-20), 2.0**-22, -(2.0**-22), 2.0**-23, -(2.0**-23), 3 * 2.0**-21]
    g64 = torch.tensor([1.0 + deltas[i % len(deltas)] for i in range(r)], dtype=torch.float64)
    g64 = g64 * 2.0 ** torch.randint(-20, 20, (r,), generator=gen).double()
    g = (1.0 / g64 if divisor else g64).float()
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, sc.view(torch.float8_e4m3fn), g


@contextmanager
def cpu_kernel(mode: str) -> Iterator[None]:
    """Run ``requant_rows_cpu`` with ``MXFP4CONV_CPU_KERNEL=mode`` (native: the compiled kernel,
    which must build here; torch: the eager-torch table path)."""
    old = os.environ.get("MXFP4CONV_CPU_KERNEL")
    os.environ["MXFP4CONV_CPU_KERNEL"] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ["MXFP4CONV_CPU_KERNEL"]
        else:
            os.environ["MXFP4CONV_CPU_KERNEL"] = old


HAS_CC = compiler() is not None  # CI and dev machines have one; then it must build


def both_cpu_paths(*args: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
    """``requant_rows_cpu(*args)`` on the compiled kernel and on the torch path: they must agree
    bit for bit; returns the result (the torch path's alone where no C compiler exists)."""
    if not HAS_CC:
        with cpu_kernel("torch"):
            return requant_rows_cpu(*args, **kw)
    with cpu_kernel("native"):
        nat = requant_rows_cpu(*args, **kw)
    with cpu_kernel("torch"):
        tor = requant_rows_cpu(*args, **kw)
    assert_same(nat, tor)
    return nat


def assert_same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    assert torch.equal(a[0], b[0]), "packed bytes differ"
    assert torch.equal(a[1], b[1]), "scale bytes differ"
    assert torch.equal(a[2].view(torch.int64), b[2].view(torch.int64)), "row stats differ (bitwise)"


@pytest.mark.parametrize("divisor", [False, True], ids=["modelopt", "ct"])
@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_cpu_fast_path_matches_composition(rule: ScaleRule, divisor: bool) -> None:
    for data in (random_nvfp4(24, 512, divisor, seed=1), adversarial_nvfp4(divisor)):
        fast = both_cpu_paths(*data, divisor, rule)
        ref = requant_rows_reference(*data, divisor, rule)
        assert_same(fast, ref)


@pytest.mark.parametrize("divisor", [False, True], ids=["modelopt", "ct"])
def test_mse_near_ties_are_decided_exactly(divisor: bool) -> None:
    """On blocks whose candidates (nearly) tie, both CPU paths pick exactly the exponent whose exact
    squared error (Fractions, independent of the library) is lower, RCEIL on a tie; the data really
    holds exact ties with nonzero terms and near-ties of both signs."""
    from fractions import Fraction

    from mxfp4conv.formats.nvfp4 import dequantize_nvfp4

    packed, sc, g = mse_near_tie_nvfp4(divisor)
    _, scales, _ = both_cpu_paths(packed, sc, g, divisor, ScaleRule.MSE)
    assert_same(both_cpu_paths(packed, sc, g, divisor, ScaleRule.MSE),
                requant_rows_reference(packed, sc, g, divisor, ScaleRule.MSE))  # fmt: skip
    x = dequantize_nvfp4(packed, sc, g, divisor=divisor).view(packed.shape[0], -1, 32)
    grid = [Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]
    kinds = {"tie": 0, "lower by < 2^-17": 0, "higher by < 2^-17": 0}

    def err(vals: list[Fraction], e: int) -> Fraction:
        s2 = Fraction(2) ** e
        total = Fraction(0)
        for v in vals:
            q = v / s2
            r = min(grid, key=lambda c: (abs(q - c), grid.index(c) % 2))  # nearest, ties to even code
            total += (v - r * s2) ** 2
        return total

    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            vals = [Fraction(abs(float(v))) for v in x[i, j]]
            amax = max(vals)
            er = int(rq_cpu.rceil_exponent(torch.tensor([float(amax)]))[0])
            ea, eb = err(vals, er), err(vals, er - 1)
            assert int(scales[i, j]) - 127 == (er - 1 if eb < ea else er), (i, j)
            terms = ea + eb
            if ea == eb:
                kinds["tie"] += 1
            elif abs(ea - eb) < terms * Fraction(1, 2**17):
                kinds["lower by < 2^-17" if eb < ea else "higher by < 2^-17"] += 1
    assert all(v > 0 for v in kinds.values()), kinds


@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_rows_near_fp32_max_match_composition(rule: ScaleRule) -> None:
    """Raw rows (no validation) with amax in [1.75 * 2^127, fp32 max]: EVEN picks 2^127 and RCEIL
    2^126, so e2m1 * 2^e overflows float32; the error uses the exact dq (float64), finite."""
    gen = torch.Generator().manual_seed(13)
    packed = torch.randint(0, 256, (8, 64), generator=gen, dtype=torch.uint8)
    packed[:, ::16] |= 0x07
    sc = torch.full((8, 8), 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 448
    g = torch.tensor([3.2e38 / 2688, 3.0e38 / 2688, 3.4e38 / 2688, 2.9e38 / 2688] * 2)
    fast = both_cpu_paths(packed, sc, g, False, rule)
    assert_same(fast, requant_rows_reference(packed, sc, g, False, rule))
    assert bool(torch.isfinite(fast[2]).all())


_G_VALUES = [1.0, 2.0**-20, 3.0e-4, 1 / 2688, 7.0, 448.0, 1e-38, 2.0**-149, 1e30, 0.1]


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 3),
    blocks=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    g_idx=st.lists(st.integers(0, len(_G_VALUES) - 1), min_size=3, max_size=3),
    divisor=st.booleans(),
    rule=st.sampled_from(RULES),
)
def test_property_fast_path_equals_composition(
    rows: int, blocks: int, seed: int, g_idx: list[int], divisor: bool, rule: ScaleRule
) -> None:
    gen = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    packed = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
    sc = torch.randint(0, 256, (rows, k // 16), generator=gen, dtype=torch.uint8)
    sc[(sc & 0x7F) == 0x7F] = 0x38  # no NaN patterns; negative and zero scales stay
    g = torch.tensor([_G_VALUES[i] for i in g_idx[:rows]], dtype=torch.float32)
    g = 1.0 / g if divisor else g
    top = np.float32(6 * 448) * (1 / g if divisor else g).abs().numpy()
    assume(bool(torch.isfinite(g).all()) and bool(np.all(top < MAX_REQUANT_MAGNITUDE)))  # valid input
    data = (packed, sc.view(torch.float8_e4m3fn), g)
    assert_same(both_cpu_paths(*data, divisor, rule), requant_rows_reference(*data, divisor, rule))


def test_cpu_path_is_sequential_where_it_matters() -> None:
    # requant_rows_cpu relies on CPU cumsum being a left-to-right scan (per block's groups, per row).
    t = torch.tensor([1.0] + [2.0**-53] * 31, dtype=torch.float64)
    assert t.cumsum(0)[-1].item() == 1.0 and t.sum().item() != 1.0


def test_row_stats_fold_blocks_in_lanes() -> None:
    """Row statistics = the block statistics folded in the contract's 8 lanes (block j into lane
    j % 8, lanes in order) by a plain Python loop."""
    from mxfp4conv.formats.mxfp4 import quantize_mxfp4_with_stats
    from mxfp4conv.formats.nvfp4 import dequantize_nvfp4

    for k in (4096, 96, 800):  # 128, 3 and 25 blocks per row
        p, s, g = random_nvfp4(6, k, False, seed=12)
        _, _, rows = both_cpu_paths(p, s, g, False, ScaleRule.MSE)
        x = dequantize_nvfp4(p, s, g, divisor=False)
        st = quantize_mxfp4_with_stats(x, ScaleRule.MSE, rq_stats.requant_groups(p))[2]
        for i in range(6):
            lsq, lsig = [0.0] * 8, [0.0] * 8
            for j in range(st.sq_err.shape[1]):
                lsq[j % 8] += float(st.sq_err[i, j])
                lsig[j % 8] += float(st.signal[i, j])
            sq = sig = 0.0
            for t in range(8):
                sq += lsq[t]
                sig += lsig[t]
            want = [sq, sig, float(st.max_abs_err[i].max()), float(st.clipped[i].sum()), float(st.exact[i].sum())]
            assert rows[i].tolist() == want


def test_lane_sum_order() -> None:
    # 1 then fifteen 2^-53: sequentially every add rounds back to 1; in 8 lanes, lanes 1..7 hold
    # 2^-52 each first, and 1 + 7 * 2^-52 is exact.
    v = torch.tensor([[1.0] + [2.0**-53] * 15], dtype=torch.float64)
    assert rq_stats._lane_sum(v).item() == 1.0 + 7 * 2.0**-52
    assert float(v.cumsum(1)[0, -1]) == 1.0


def test_threads_and_slab_sizes_do_not_change_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    data = random_nvfp4(37, 256, False, seed=2)
    base = both_cpu_paths(*data, False, ScaleRule.MSE, threads=1)
    assert_same(both_cpu_paths(*data, False, ScaleRule.MSE, threads=2), base)
    for slab in (1, 256 * 5, 1 << 20):
        monkeypatch.setattr(rq_cpu, "_SLAB_WEIGHTS", slab)
        assert_same(both_cpu_paths(*data, False, ScaleRule.MSE, threads=3), base)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("slab", [1, 256 * 5, 256 * 11, 1 << 22])
def test_the_compiled_kernels_call_sizes_do_not_change_bytes(monkeypatch: pytest.MonkeyPatch, slab: int) -> None:
    data = random_nvfp4(37, 256, False, seed=5)
    base = requant_rows_cpu(*data, False, ScaleRule.MSE, threads=1)
    monkeypatch.setattr(rq_cpu, "_NATIVE_SLAB_WEIGHTS", slab)
    for threads in (1, 3):
        got = requant_rows_cpu(*data, False, ScaleRule.MSE, threads=threads)
        for a, b in zip(got, base, strict=True):
            assert torch.equal(a, b)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_native_kernel_builds_and_is_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This machine has a C compiler: auto mode builds the kernel into the cache and runs it
    (the torch path is not called); torch mode never builds it."""
    monkeypatch.setenv("MXFP4CONV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(requant_native, "_kernel", None)
    monkeypatch.setattr(requant_native, "_error", None)
    monkeypatch.setenv("MXFP4CONV_CPU_KERNEL", "torch")
    assert requant_native.load() is None and not (tmp_path / "cache").exists()
    monkeypatch.setenv("MXFP4CONV_CPU_KERNEL", "auto")
    calls: list[int] = []
    monkeypatch.setattr(rq_cpu, "_slab", lambda *a: calls.append(1))
    out = requant_rows_cpu(*random_nvfp4(4, 64, False, seed=3), False, ScaleRule.MSE)
    kern = requant_native.load()
    assert kern is not None and kern.path.parent == tmp_path / "cache" and not calls
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [kern.path.name]  # no temporary left
    assert out[1].numel() == 8 and bool((out[2][:, 1] > 0).all())


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_unwritable_cache_builds_into_a_temporary_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A cache folder that cannot be created (here: below a regular file, which stops root too):
    the kernel is built into a private temporary folder instead."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MXFP4CONV_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setenv("MXFP4CONV_CPU_KERNEL", "native")
    monkeypatch.setattr(requant_native, "_kernel", None)
    monkeypatch.setattr(requant_native, "_error", None)
    kern = requant_native.load()
    assert kern is not None and kern.path.exists() and not str(kern.path).startswith(str(blocker))
    shutil.rmtree(kern.path.parent)


def test_no_compiler_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without a C compiler, auto mode runs the torch path (same bytes) and native mode fails in one
    line; a bad mode is refused."""
    monkeypatch.setenv("MXFP4CONV_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc / gcc / clang
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(requant_native, "_kernel", None)
    monkeypatch.setattr(requant_native, "_error", None)
    data = random_nvfp4(5, 128, True, seed=4)
    monkeypatch.setenv("MXFP4CONV_CPU_KERNEL", "auto")
    got = requant_rows_cpu(*data, True, ScaleRule.MSE)
    assert requant_native.load() is None and "no C compiler" in (requant_native.build_error() or "")
    with cpu_kernel("torch"):
        assert_same(got, requant_rows_cpu(*data, True, ScaleRule.MSE))
    monkeypatch.setenv("MXFP4CONV_CPU_KERNEL", "native")
    with pytest.raises(OSError, match="MXFP4CONV_CPU_KERNEL=native but the CPU kernel cannot be built"):
        requant_rows_cpu(*data, True, ScaleRule.MSE)
    monkeypatch.setenv("MXFP4CONV_CPU_KERNEL", "fast")
    with pytest.raises(ValueError, match="use auto, native or torch"):
        requant_native.load()


def nvfp4_weight(e: int, n: int, k: int, divisor: bool, seed: int) -> FP4Weight:
    p, s, _ = random_nvfp4(e * n, k, divisor, seed)
    g = torch.empty(e, n)
    g[:, : n // 2], g[:, n // 2 :] = 0.003, 0.0011  # gate / up halves with their own scale
    if divisor:
        g = 1.0 / g
    return FP4Weight("nvfp4", p.view(e, n, k // 2), s.view(e, n, k // 16), g, global_is_divisor=divisor)


@pytest.mark.parametrize("divisor", [False, True], ids=["modelopt", "ct"])
def test_chunk_rows_give_identical_bytes_and_stats(divisor: bool) -> None:
    w = nvfp4_weight(3, 20, 256, divisor, seed=4)
    outs = [requant_nvfp4_to_mxfp4(w, ScaleRule.MSE, chunk_rows=c) for c in (1, 7, 64, 10_000)]
    mx0, st0 = outs[0]
    assert mx0.quant == "mxfp4" and mx0.packed.shape == (3, 20, 128) and mx0.scales.shape == (3, 20, 8)
    for mx, stats in outs[1:]:
        assert torch.equal(mx.packed, mx0.packed) and torch.equal(mx.scales, mx0.scales)
        assert stats == st0
    # and both equal the plain composition on the flattened rows
    assert w.global_rows is not None
    p, s, rs = requant_rows_reference(
        w.packed.reshape(-1, 128), w.scales.reshape(-1, 16), w.global_rows.reshape(-1), divisor, ScaleRule.MSE
    )
    assert torch.equal(mx0.packed.reshape(-1, 128), p) and torch.equal(mx0.scales.reshape(-1, 8), s)
    assert st0 == RequantStats.from_row_stats(rs, 8)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu),
                                    pytest.param("cuda:0 kept", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("divisor", [False, True], ids=["modelopt", "ct"])
def test_expert_groups_continue_the_whole_weights_statistics_bit_for_bit(divisor: bool, device: str) -> None:
    """A weight requantized in groups of its experts (a streamed MoE layer), on the CPU or a GPU (results
    copied back or kept there), gives the whole weight's CPU bytes, and its statistics continued group
    after group (``then``) are the whole fold's, float for float: the sums run over the rows in order."""
    import dataclasses

    w = nvfp4_weight(7, 24, 256, divisor, seed=9)
    assert w.global_rows is not None
    whole, st = requant_nvfp4_to_mxfp4(w, ScaleRule.MSE)
    acc = None
    for e0, e1 in ((0, 3), (3, 4), (4, 7)):
        part = dataclasses.replace(w, packed=w.packed[e0:e1], scales=w.scales[e0:e1], global_rows=w.global_rows[e0:e1])
        mx, got = requant_nvfp4_to_mxfp4(part, ScaleRule.MSE, device=device.split()[0], chunk_rows=11,
                                         keep_on_device=device.endswith("kept"), keep_rows=e0 > 0)
        assert torch.equal(mx.packed.cpu(), whole.packed[e0:e1]) and torch.equal(mx.scales.cpu(), whole.scales[e0:e1])
        assert bool(got.rows) == (e0 > 0)
        acc = got if acc is None else acc.then(got)
    assert acc == st and acc.to_dict() == st.to_dict() and not acc.rows


def test_stats_fields_and_json() -> None:
    w = nvfp4_weight(2, 16, 256, False, seed=5)
    _, st_floor = requant_nvfp4_to_mxfp4(w, ScaleRule.FLOOR)
    _, st_rceil = requant_nvfp4_to_mxfp4(w, ScaleRule.RCEIL)
    _, st_mse = requant_nvfp4_to_mxfp4(w, ScaleRule.MSE)
    assert st_floor.blocks == st_rceil.blocks == 2 * 16 * 8
    assert st_floor.clipped_blocks > 0 and st_rceil.clipped_blocks == 0
    assert st_mse.sq_err <= st_floor.sq_err and st_mse.sq_err < st_rceil.sq_err
    assert st_mse.signal == st_floor.signal > 0
    sq = st_mse.sqnr_db
    assert sq is not None and sq == 10 * math.log10(st_mse.signal / st_mse.sq_err) and 10 < sq < 40
    assert 0 < st_mse.max_abs_err < 1
    d = st_mse.to_dict()
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    assert set(d) == {
        "blocks",
        "clipped_blocks",
        "exact_blocks",
        "sq_err",
        "signal",
        "max_abs_err",
        "sqnr_db",
    }
    m = st_floor.merge(st_rceil)
    assert m.blocks == 2 * st_floor.blocks and m.sq_err == st_floor.sq_err + st_rceil.sq_err
    assert m.max_abs_err == max(st_floor.max_abs_err, st_rceil.max_abs_err)
    assert RequantStats().sqnr_db is None and RequantStats().to_dict()["sqnr_db"] is None
    assert RequantStats(sq_err=1.0, signal=0.0).to_dict()["sqnr_db"] is None  # -inf is not JSON


@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_exact_case_keeps_nibbles(rule: ScaleRule) -> None:
    """Both 16-blocks with e4m3 * scale_2 == the same power of two, and a +-6 in every 32-block:
    the MXFP4 nibbles equal the NVFP4 nibbles and every block is exact."""
    gen = torch.Generator().manual_seed(6)
    packed = torch.randint(0, 256, (8, 64), generator=gen, dtype=torch.uint8)
    packed[:, ::16] = (packed[:, ::16] & 0xF0) | 0x07
    sc = torch.full((8, 8), 0x40, dtype=torch.uint8)  # 2.0
    for divisor, g in ((False, 2.0**-8), (True, 2.0**8)):
        w = FP4Weight("nvfp4", packed, sc.view(torch.float8_e4m3fn), torch.full((8,), g), divisor)
        mx, st = requant_nvfp4_to_mxfp4(w, rule)
        assert torch.equal(mx.packed, packed)
        assert bool((mx.scales == 127 - 7).all())
        assert st.exact_blocks == st.blocks == 32 and st.sq_err == 0.0 and st.sqnr_db is None


def test_invalid_input_raises() -> None:
    w = nvfp4_weight(1, 4, 64, False, seed=7)
    w.scales.view(torch.uint8)[0, 2, 1] = 0x7F
    with pytest.raises(ValueError, match=r"NaN e4m3 block scale at index \(0, 2, 1\)"):
        requant_nvfp4_to_mxfp4(w)
    w = nvfp4_weight(1, 4, 64, False, seed=7)
    assert w.global_rows is not None
    w.global_rows[0, 3] = 0.0
    with pytest.raises(ValueError, match="zero global scale"):
        requant_nvfp4_to_mxfp4(w)
    with pytest.raises(ValueError):
        requant_nvfp4_to_mxfp4(FP4Weight("mxfp4", torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1)))
    with pytest.raises(ValueError):
        requant_rows_cpu(
            torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1), torch.ones(2), False, ScaleRule.MSE
        )


def test_cpu_path_never_imports_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "mxfp4conv.kernels.requant_triton"
    monkeypatch.delitem(sys.modules, name, raising=False)
    requant_nvfp4_to_mxfp4(nvfp4_weight(1, 4, 64, False, seed=8), device="cpu")
    assert name not in sys.modules


def test_cuda_device_dispatches_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """device="cuda:N" hands the whole stack to the chunked GPU driver (same shapes, rows and
    statistics folded as on the CPU)."""
    if torch.cuda.is_available():  # "cuda:1" stands for a device this machine lacks; tests/numerics/test_requant_gpu.py runs the real one
        pytest.skip("fakes the GPU kernel for a machine without CUDA")
    calls: list[tuple[tuple[int, ...], bool, ScaleRule, str, int]] = []

    def fake_chunks(p: torch.Tensor, s: torch.Tensor, g: torch.Tensor, divisor: bool, rule: ScaleRule, *,  # type: ignore[no-untyped-def]
                    device: str, chunk_rows: int, scale_row_max: torch.Tensor):
        calls.append((tuple(p.shape), divisor, rule, device, chunk_rows))
        kh = p.shape[-1]
        scale_row_max.copy_((s.view(torch.uint8) & 0x7F).amax(-1))
        out = requant_rows_cpu(p.reshape(-1, kh), s.reshape(-1, 2 * kh // 16), g.reshape(-1), divisor, rule)
        return (out[0].reshape(*p.shape), out[1].reshape(*p.shape[:-1], 2 * kh // 32),
                out[2].reshape(*p.shape[:-1], out[2].shape[-1]))

    fake = types.ModuleType("mxfp4conv.kernels.requant_triton")
    fake.requant_nvfp4_gpu_chunks = fake_chunks  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mxfp4conv.kernels.requant_triton", fake)
    monkeypatch.setattr(rq, "GPU_MIN_CHUNK_ROWS", 1)
    w = nvfp4_weight(2, 8, 64, True, seed=9)
    mx, st = requant_nvfp4_to_mxfp4(w, ScaleRule.EVEN, device="cuda:1", chunk_rows=5)
    assert calls == [((2, 8, 32), True, ScaleRule.EVEN, "cuda:1", 5)]
    mx_cpu, st_cpu = requant_nvfp4_to_mxfp4(w, ScaleRule.EVEN)
    assert torch.equal(mx.packed, mx_cpu.packed) and st == st_cpu
    bad = FP4Weight("nvfp4", w.packed, w.scales.view(torch.uint8).clone().view(torch.float8_e4m3fn), w.global_rows, True)
    bad.scales.view(torch.uint8)[1, 3, 2] = 0x7F  # validated after the (fake) device run, same message
    msgs = []
    for device in ("cpu", "cuda:1"):
        with pytest.raises(ValueError) as info:
            requant_nvfp4_to_mxfp4(bad, ScaleRule.EVEN, device=device)
        msgs.append(str(info.value))
    assert msgs[0] == msgs[1] == "invalid NVFP4 input: NaN e4m3 block scale at index (1, 3, 2)"


def test_strided_inputs_give_row_major_outputs() -> None:
    """Dense but column-major inputs (a transposed copy viewed back): same bytes, outputs row-major."""
    p, s, g = random_nvfp4(12, 128, False, seed=10)
    pt = p.t().contiguous().t()
    st = s.view(torch.uint8).t().contiguous().t().view(torch.float8_e4m3fn)
    assert not pt.is_contiguous() and not st.is_contiguous()
    got = both_cpu_paths(pt, st, g, False, ScaleRule.MSE)
    assert all(t.is_contiguous() for t in got)
    assert_same(got, both_cpu_paths(p, s, g, False, ScaleRule.MSE))


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_concurrent_first_builds_and_a_damaged_cache(tmp_path: Path) -> None:
    """Three processes building into one empty cache at once all load a complete library (each
    builds under a temporary name, then renames); a damaged cached library is rebuilt."""
    code = ("from mxfp4conv.kernels import requant_native as n; k = n.load(); "
            "print(k.path if k else n.build_error())")  # fmt: skip
    env = {**os.environ, "MXFP4CONV_CACHE_DIR": str(tmp_path), "MXFP4CONV_CPU_KERNEL": "native"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]  # fmt: skip
    paths = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(paths) == 1
    lib = Path(paths.pop())
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]
    lib.write_bytes(b"not an ELF file")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and Path(out.stdout.strip()) == lib and lib.stat().st_size > 1000


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or compiler() is None
                    or shutil.which("nm") is None, reason="x86-64 with a C compiler and nm")
def test_x86_64_kernel_carries_one_row_function_per_vector_level() -> None:
    """The loaded build is the multi-versioned one (a fallback to the single SSE2 build would be slower
    only, never other bytes: the torch path and the kernel agree above on whichever version this CPU runs)."""
    kernel = requant_native.load()
    assert kernel is not None
    syms = subprocess.run(["nm", str(kernel.path)], capture_output=True, text=True, check=True).stdout
    assert "mxfp4conv_requant_rows.avx2" in syms and "mxfp4conv_requant_rows.default" in syms


@pytest.mark.skipif(compiler() is None, reason="needs a C compiler")
def test_the_kernels_two_block_encoders_write_the_same_bytes() -> None:
    """The output bytes of a block come from 16-lane table lookups where the CPU has them, else byte
    by byte: on any input (every code byte, any new-code table, flips on either half) both agree."""
    import ctypes

    kernel = requant_native.load()
    assert kernel is not None
    fn = ctypes.CDLL(str(kernel.path)).mxfp4conv_encode16_agree
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int64
    gen = np.random.default_rng(7)
    n = 1 << 16
    packed = gen.integers(0, 256, (n, 16), dtype=np.uint8)
    packed[:16] = np.arange(256, dtype=np.uint8).reshape(16, 16)  # every byte
    codes = gen.integers(0, 8, (n, 16), dtype=np.uint8)  # magnitude codes 0..7
    flips = gen.choice(np.array([0, 0x88], dtype=np.uint8), (n, 2))
    got = fn(n, packed.ctypes.data, codes.ctypes.data, flips.ctypes.data)
    if got == -2:
        pytest.skip("no lane encoder on this CPU / compiler")
    assert got == -1, f"block {got} differs"
