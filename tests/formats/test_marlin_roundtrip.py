"""Marlin FP4 layout: round trips on random shapes and checks against plain-loop MARLIN.md formulas."""

from __future__ import annotations

import math

import pytest
import torch

from mxfp4conv.formats import marlin as M
from mxfp4conv.formats import marlin_scales as MS

OFF = (0, 1, 8, 9, 16, 17, 24, 25)


def rand_u8(*shape: int, seed: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8)


# ---- plain-loop references, written from MARLIN.md (independent of the module) ------------------


def ref_repack(packed: torch.Tensor, a8: bool) -> torch.Tensor:
    """§1, one word at a time."""
    rows = packed.tolist()
    n, k = len(rows), 2 * len(rows[0])

    def q(r: int, c: int) -> int:
        return (rows[r][c // 2] >> (4 * (c % 2))) & 0xF

    flat = [0] * (n * k // 8)
    for w in range(len(flat)):
        if a8:
            tile, t, j = divmod(w, 128)[0], (w % 128) // 4, w % 4
            kt, nt = divmod(tile, n // 32)
            k0, col = 32 * kt + 4 * (t % 4), 32 * nt + 16 * (j // 2) + 8 * (j % 2) + t // 4
            codes = [q(col, k0 + d) for d in (0, 16, 1, 17, 2, 18, 3, 19)]
        else:
            kt, c = divmod(w, 2 * n)
            nt, t, j = c // 128, (c % 128) // 4, c % 4
            k0, n0 = 16 * kt + 2 * (t % 4), 64 * nt + 16 * j + t // 4
            at = ((0, 0), (0, 8), (8, 0), (8, 8), (0, 1), (0, 9), (8, 1), (8, 9))
            codes = [q(n0 + dn, k0 + dk) for dn, dk in at]
        word = sum(code << (4 * s) for s, code in enumerate(codes))
        flat[w] = word - (1 << 32) if word >= 1 << 31 else word
    return torch.tensor(flat, dtype=torch.int32).reshape(k // 16, 2 * n)


def ref_scale_perm(s_kn: list[list[int]], grouped: bool, swap: bool) -> list[list[int]]:
    """§2 Step A (8x8 transpose per 64 columns, or the single perm per 32) then Step B."""
    out = []
    for row in s_kn:
        a = list(row)
        if grouped:
            for b in range(len(row) // 64):
                for i in range(8):
                    for j in range(8):
                        a[64 * b + 8 * i + j] = row[64 * b + 8 * j + i]
        else:
            for c in range(len(row) // 32):
                for i in range(4):
                    for m in range(8):
                        a[32 * c + 8 * i + m] = row[32 * c + 2 * i + OFF[m]]
        if swap:
            a = [a[4 * (x // 4) + (0, 2, 1, 3)[x % 4]] for x in range(len(a))]
        out.append(a)
    return out


# ---- weights -----------------------------------------------------------------------------------


@pytest.mark.parametrize("a8", [False, True])
@pytest.mark.parametrize("n,k", [(64, 16), (64, 32), (128, 64), (192, 96), (64, 256), (32, 64), (96, 160)])
def test_repack_matches_loop_reference(n: int, k: int, a8: bool) -> None:
    if (n % 32 or k % 32) if a8 else (n % 64 or k % 16):
        with pytest.raises(ValueError):
            M.repack_fp4_weight(rand_u8(n, k // 2, seed=0), a8=a8)
        return
    packed = rand_u8(n, k // 2, seed=n * 1000 + k)
    got = M.repack_fp4_weight(packed, a8=a8)
    assert torch.equal(got, ref_repack(packed, a8))
    assert torch.equal(M.unrepack_fp4_weight(got, n, k, a8=a8), packed)


@pytest.mark.parametrize("a8", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_repack_roundtrip_random_shapes(a8: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    e = int(torch.randint(1, 4, (1,), generator=g))
    n = 64 * int(torch.randint(1, 6, (1,), generator=g))
    k = 32 * int(torch.randint(1, 12, (1,), generator=g))
    packed = rand_u8(e, n, k // 2, seed=seed + 100)
    m = M.repack_fp4_weight(packed, a8=a8)
    assert m.shape == (e, k // 16, 2 * n) and m.dtype == torch.int32
    assert torch.equal(M.unrepack_fp4_weight(m, n, k, a8=a8), packed)
    # leading dim = independent experts
    assert torch.equal(m[e - 1], M.repack_fp4_weight(packed[e - 1], a8=a8))
    # a permutation of nibbles: the multiset of codes is preserved, and the layout is not the identity
    codes = lambda t: torch.stack((t & 15, t >> 4)).flatten().bincount(minlength=16)  # noqa: E731
    assert torch.equal(codes(m.view(torch.uint8)), codes(packed))
    assert not torch.equal(m.view(torch.uint8).flatten(), packed.flatten())


def test_16bit_and_a8_tilings_differ() -> None:
    packed = rand_u8(128, 128, seed=7)
    assert not torch.equal(M.repack_fp4_weight(packed), M.repack_fp4_weight(packed, a8=True))


def test_unrepack_rejects_wrong_shape() -> None:
    m = M.repack_fp4_weight(rand_u8(64, 64, seed=1))
    with pytest.raises(ValueError):
        M.unrepack_fp4_weight(m, 128, 64)


# ---- scales and bias ---------------------------------------------------------------------------


@pytest.mark.parametrize("a8", [False, True])
@pytest.mark.parametrize("n,groups", [(64, 1), (64, 4), (128, 8), (192, 3), (256, 16)])
def test_mxfp4_scales_match_loop_reference(n: int, groups: int, a8: bool) -> None:
    s = rand_u8(n, groups, seed=n + groups, lo=0, hi=250)
    got = MS.mxfp4_scales_to_marlin(s, a8=a8)
    kn = s.t().tolist()
    want = ref_scale_perm(kn, grouped=not a8 and groups > 1, swap=not a8)
    want_t = torch.tensor(want, dtype=torch.uint8) + (6 if a8 else 0)
    assert torch.equal(got, want_t)
    assert torch.equal(MS.mxfp4_scales_from_marlin(got, a8=a8), s)
    # as e8m0 it is the same exponent bytes
    assert torch.equal(got.view(torch.float8_e8m0fnu).view(torch.uint8), got)


@pytest.mark.parametrize("a8", [False, True])
def test_mxfp4_scales_roundtrip_batched(a8: bool) -> None:
    s = rand_u8(3, 320, 12, seed=11, hi=250)
    m = MS.mxfp4_scales_to_marlin(s.view(torch.float8_e8m0fnu), a8=a8)
    assert m.shape == (3, 12, 320)
    assert torch.equal(m[1], MS.mxfp4_scales_to_marlin(s[1], a8=a8))
    assert torch.equal(MS.mxfp4_scales_from_marlin(m, a8=a8), s)


def test_mxfp4_a8_refuses_large_bytes() -> None:
    s = torch.full((64, 4), 249, dtype=torch.uint8)
    assert int(MS.mxfp4_scales_to_marlin(s, a8=True).max()) == 255
    s[3, 2] = 250
    with pytest.raises(ValueError):
        MS.mxfp4_scales_to_marlin(s, a8=True)
    assert int(MS.mxfp4_scales_to_marlin(s).max()) == 250  # 16-bit path moves bytes unchanged


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bias_permutation(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    b = torch.randn(2, 192, generator=g).to(dtype)
    p = MS.permute_bias(b)
    want = torch.tensor(ref_scale_perm(b.view(-1, 192).tolist(), grouped=False, swap=False), dtype=dtype)
    assert torch.equal(p, want) and not torch.equal(p, b)
    assert torch.equal(MS.unpermute_bias(p), b)
    assert MS.permute_bias(b.float(), dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        MS.permute_bias(torch.zeros(48))


# ---- NVFP4 -------------------------------------------------------------------------------------


def vllm_style_s0e5m3(codes: torch.Tensor, pd: torch.dtype, sf: float) -> torch.Tensor:
    """The float path of MARLIN.md §2 NVFP4 steps 1-4 (as vLLM computes it), element-wise."""
    s = codes.view(torch.float8_e4m3fn).to(pd).to(torch.half)
    if sf > 1:
        s = (s.float() * sf).to(torch.half)
    h = s * 128
    h[h < 2] = 0
    return (h.view(torch.int16) << 1).view(torch.uint8).reshape(-1, 2)[:, 1]


@pytest.mark.parametrize("log2sf", [*range(0, 21), 30])
def test_s0e5m3_all_codes_match_float_path(log2sf: int) -> None:
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    for pd in (torch.bfloat16, torch.float16):
        if pd == torch.float16 and log2sf:
            continue
        sf = 2.0**log2sf
        # every row n holds the same codes, so each output row is constant whatever the permutation
        s = codes.view(1, -1).expand(64, -1).contiguous()
        got = MS.nvfp4_scales_to_marlin(s, params_dtype=pd, sf=sf)
        assert bool((got == got[:, :1]).all())
        assert torch.equal(got[:, 0], vllm_style_s0e5m3(codes, pd, sf)), (pd, sf)


def test_rescale_factor_rule() -> None:
    pos = torch.arange(1, 0x7F, dtype=torch.uint8)
    for c in pos.tolist():
        m = float(torch.tensor([c], dtype=torch.uint8).view(torch.float8_e4m3fn).float())
        want = 2.0 ** math.floor(math.log2(448 / m)) if m < 448 else 1.0
        s = torch.tensor([c // 2, c, 0xFE, 0x80], dtype=torch.uint8)  # smaller, max, negative, -0
        assert MS.nvfp4_rescale_factor(s.view(torch.float8_e4m3fn), torch.bfloat16) == max(want, 1.0), c
        assert MS.nvfp4_rescale_factor(s, torch.float16) == 1.0
    assert MS.nvfp4_rescale_factor(torch.zeros(4, dtype=torch.uint8), torch.bfloat16) == 1.0
    assert MS.nvfp4_rescale_factor(torch.tensor([0xC8], dtype=torch.uint8), torch.bfloat16) == 1.0
    # NaN codes (0x7F, 0xFF) are not "positive scales" (vLLM: NaN > 0 is False): max is 4.0 -> 64
    nan = torch.tensor([0x48, 0x7F, 0xFF, 0x30], dtype=torch.uint8)
    assert MS.nvfp4_rescale_factor(nan, torch.bfloat16) == 64.0


@pytest.mark.parametrize("seed", range(4))
def test_nvfp4_scales_roundtrip(seed: int) -> None:
    s = rand_u8(2, 128, 16, seed=seed, lo=0x08, hi=0x7F)  # positive normal scales
    for pd in (torch.bfloat16, torch.float16):
        sf = MS.nvfp4_rescale_factor(s, pd)
        m = MS.nvfp4_scales_to_marlin(s.view(torch.float8_e4m3fn), params_dtype=pd, sf=sf)
        assert m.shape == (2, 16, 128)
        assert MS.nvfp4_scales_encoding_lossless(s, params_dtype=pd, sf=sf)
        assert torch.equal(MS.nvfp4_scales_from_marlin(m, params_dtype=pd, sf=sf), s)
        assert MS.nvfp4_scales_match(s, m, params_dtype=pd, sf=sf)
        assert not MS.nvfp4_scales_match(s, m ^ 8, params_dtype=pd, sf=sf)


def test_nvfp4_lossy_cases_verify_by_reencoding() -> None:
    s = rand_u8(64, 4, seed=5, lo=0x30, hi=0x50)
    s[0, 0], s[1, 1], s[2, 2] = 0x01, 0xB0, 0x80  # subnormal (flushed at sf=1), negative, -0
    s[3, 3] = 0x7E  # reaches 448 -> sf = 1
    sf = MS.nvfp4_rescale_factor(s, torch.bfloat16)
    assert sf == 1.0
    m = MS.nvfp4_scales_to_marlin(s, params_dtype=torch.bfloat16, sf=sf)
    assert not MS.nvfp4_scales_encoding_lossless(s, params_dtype=torch.bfloat16, sf=sf)
    dec = MS.nvfp4_scales_from_marlin(m, params_dtype=torch.bfloat16, sf=sf)
    assert int(dec[0, 0]) == int(dec[1, 1]) == int(dec[2, 2]) == 0
    keep = torch.ones_like(s, dtype=torch.bool)
    keep[0, 0] = keep[1, 1] = keep[2, 2] = False
    assert torch.equal(dec[keep], s[keep])
    assert MS.nvfp4_scales_match(s, m, params_dtype=torch.bfloat16, sf=sf)
    # the subnormal survives when sf lifts it (m * sf >= 8)
    assert MS.nvfp4_scales_to_marlin(s, params_dtype=torch.bfloat16, sf=8.0)[0, 0] != 0


def test_nvfp4_refusals() -> None:
    s = rand_u8(64, 4, seed=6, lo=0x08, hi=0x7F)
    with pytest.raises(ValueError):
        MS.nvfp4_scales_to_marlin(s, params_dtype=torch.float16, sf=2.0)
    with pytest.raises(ValueError):
        MS.nvfp4_scales_to_marlin(s, params_dtype=torch.bfloat16, sf=3.0)
    with pytest.raises(ValueError):
        MS.nvfp4_scales_to_marlin(s, params_dtype=torch.float32, sf=1.0)
    s[5, 1] = 0xFF
    with pytest.raises(ValueError):
        MS.nvfp4_scales_to_marlin(s, params_dtype=torch.bfloat16, sf=1.0)
    with pytest.raises(ValueError):
        MS.nvfp4_scales_from_marlin(
            torch.full((4, 64), 0xF8, dtype=torch.uint8), params_dtype=torch.bfloat16, sf=1.0
        )


def test_nvfp4_global_scale() -> None:
    gs = torch.tensor([1e-4, 3.5e-4, 1.1e-3], dtype=torch.float32)
    bf = MS.nvfp4_global_to_marlin(gs, params_dtype=torch.bfloat16, sf=4.0)
    assert bf.dtype == torch.float32 and torch.equal(bf, gs * 2.0**117)
    assert torch.equal(MS.nvfp4_global_to_marlin(gs, params_dtype=torch.float16, sf=1.0), gs * 128)
    assert (
        MS.nvfp4_global_to_marlin(torch.tensor(2.0**-119), params_dtype=torch.bfloat16, sf=1.0).item() == 1.0
    )


def test_moe_nvfp4_sf_is_shared_by_experts() -> None:
    """Expert 0 reaches 448 (sf 1 on its own), expert 1 does not (sf > 1 on its own): combined sf = 1."""
    w = rand_u8(2, 128, 64, seed=9)
    s = rand_u8(2, 128, 8, seed=10, lo=0x20, hi=0x48)
    s[0, 0, 0] = 0x7E
    gs = torch.tensor([1e-3, 2e-3])
    out = M.prepare_moe_fp4(w, s, w, s, quant="nvfp4", w13_global=gs, w2_global=gs)
    assert MS.nvfp4_rescale_factor(s[1], torch.bfloat16) > 1
    want1 = MS.nvfp4_scales_to_marlin(s[1], params_dtype=torch.bfloat16, sf=1.0)
    assert torch.equal(out["w13_weight_scale"][1].view(torch.uint8), want1)
    assert torch.equal(out["w13_weight_scale_2"], gs * 2.0**119)


# ---- shapes and padding ------------------------------------------------------------------------


def test_padded_sizes() -> None:
    assert M.marlin_padded_nk(96, 192, 32) == (128, 192)
    assert M.marlin_padded_nk(200, 288, 32) == (256, 320)
    assert M.marlin_padded_nk(256, 208, 16) == (256, 256)
    assert M.marlin_padded_nk(64, 192, 32) == (64, 256)
    assert M.marlin_padded_nk(128, 64, 16) == (128, 64)
    assert M.gptoss_marlin_padded_sizes(2880, 2880) == (3072, 2944)
    assert [M.gptoss_marlin_padded_sizes(2880, 2880 // tp)[1] for tp in (2, 4, 8)] == [1536, 768, 384]
    assert M.gptoss_marlin_padded_sizes(128, 192) == (256, 256)
    assert M.gptoss_marlin_padded_sizes(384, 320) == (512, 384)
    assert M.gptoss_marlin_padded_sizes(256, 128) == (256, 128)


def test_check_marlin_shape() -> None:
    assert M.check_marlin_shape(64, 128, 32) is None
    assert M.check_marlin_shape(128, 64, 16) is None
    assert "K % group" in str(M.check_marlin_shape(128, 80, 32))
    assert "N % 64" in str(M.check_marlin_shape(96, 192, 32))
    assert "N % 64" in str(M.check_marlin_shape(64, 192, 32))
    assert M.check_marlin_shape(0, 128, 32) is not None
    for n, k in ((96, 192), (200, 288), (64, 192)):
        assert M.check_marlin_shape(*M.marlin_padded_nk(n, k, 32), 32) is None


def test_pad_dense_fp4() -> None:
    w, s = rand_u8(96, 96, seed=1), rand_u8(96, 6, seed=2).view(torch.float8_e8m0fnu)
    b = torch.randn(96).to(torch.bfloat16)
    p = M.pad_dense_fp4(w, s, b, group=32)
    assert (p.np, p.kp) == (128, 192) and p.scales.dtype == torch.float8_e8m0fnu
    assert torch.equal(p.packed[:96], w) and not p.packed[96:].any()
    assert torch.equal(p.scales.view(torch.uint8)[:96], s.view(torch.uint8))
    assert not p.scales.view(torch.uint8)[96:].any()
    assert p.bias is not None and torch.equal(p.bias[:96], b) and not p.bias[96:].any()
    q = M.pad_dense_fp4(w, s, None, group=32, to=(256, 256))  # GPT-OSS style explicit sizes
    assert q.packed.shape == (256, 128) and q.scales.shape == (256, 8) and not q.packed[:, 96:].any()
    with pytest.raises(ValueError):
        M.pad_dense_fp4(w, s, None, group=32, to=(64, 192))
    with pytest.raises(ValueError):
        M.prepare_dense_fp4(w, s, quant="mxfp4", pad=False)


@pytest.mark.parametrize("a8", [False, True])
@pytest.mark.parametrize("n,k", [(64, 16), (32, 32), (128, 64)])
def test_inputs_are_not_modified(n: int, k: int, a8: bool) -> None:
    if (k % 32) if a8 else (n % 64):
        return
    packed = rand_u8(n, k // 2, seed=4)
    before = packed.clone()
    m = M.repack_fp4_weight(packed, a8=a8)
    assert torch.equal(packed, before)
    m_before = m.clone()
    M.unrepack_fp4_weight(m, n, k, a8=a8)
    assert torch.equal(m, m_before)
    # a view with an odd storage offset still works (and is left alone)
    buf = rand_u8(1 + n * k // 2, seed=5)
    view = buf[1:].view(n, k // 2)
    assert torch.equal(M.repack_fp4_weight(view, a8=a8), M.repack_fp4_weight(view.clone(), a8=a8))


@pytest.mark.parametrize("log2sf", [0, 3, 9])
def test_two_byte_lookup_equals_byte_lookup(log2sf: int) -> None:
    """The S0E5M3 encoder looks bytes up in pairs: every (lo, hi) pair must match two single lookups."""
    lut = MS._s0e5m3_lut(log2sf, torch.device("cpu"))
    pair = MS._s0e5m3_pair_lut(log2sf, torch.device("cpu"))
    x = torch.stack(torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij"), -1).to(torch.uint8)
    x = x.reshape(-1, 2).contiguous()  # all 65536 (lo, hi) pairs
    assert torch.equal(MS._apply_lut(x, lut, pair), lut[x.long()])
    odd = x.reshape(-1)[1:4].reshape(1, 3)  # odd length and odd offset: the byte-wise fallback
    assert torch.equal(MS._apply_lut(odd, lut, pair), lut[odd.long()])


def test_empty_expert_dim() -> None:
    m = M.repack_fp4_weight(torch.zeros(0, 64, 64, dtype=torch.uint8))
    assert m.shape == (0, 8, 128)
    assert M.unrepack_fp4_weight(m, 64, 128).shape == (0, 64, 64)
