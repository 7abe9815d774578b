# mypy: ignore-errors
"""Triton JIT code of the fused NVFP4 -> MXFP4 requant (docs/NUMERICS.md). Needs ``triton``.

Imported lazily by :mod:`mxfp4conv.kernels.requant_triton` only; nothing else imports this module,
so a CPU-only install without triton never touches it.

Design (one program = ``ROWS`` rows, one row per thread, blocks walked in order):

* The contract sums float64 statistics SEQUENTIALLY (per block over i = 0..31, per row over
  blocks), so a thread owns whole rows and walks its row's 32-blocks in order; every element of a
  block is a separate register (``tl.static_range`` unrolls the 32 positions), which makes the
  float64 accumulation order exactly the contract's.
* Pass 1 of a block needs no float work per element: ``amax = RN(max_i |e2m1_i| * |s_half|  (*|/) |g|)``
  because RN and the positive scalings are monotonic, so the max code magnitude per 16-half (an
  integer max over nibbles) gives amax exactly.
* Pass 2 dequantizes each element (exact e2m1 * e4m3 product, then one rounding by the
  second-level scale: multiply, or a true IEEE division via PTX ``div.rn.f32``), quantizes with the
  block's power of two (exact), rounds to E2M1 with one fp32 add of a magic number (RNE at the
  grid's step: 0.5 below 2, 1 in [2, 4), 2 above), and accumulates ``(x - dq)^2`` and ``x^2`` in
  float64 with an FMA. Both squares are exact in float64 (24-bit operands; ``|x| - dq`` is exact
  in fp32 by Sterbenz because dq is |x|'s nearest grid point or 0), so ``fma(d, d, s) == s + d*d``
  rounded once, as the contract's sequential sum.
* Launch with ``enable_fp_fusion=False`` so that no other mul/add pair is contracted.
"""

import triton
import triton.language as tl

__all__ = ["requant_rows_kernel"]

# Rules, as constexpr ids (the host maps ScaleRule onto these).
# 0 FLOOR, 1 EVEN, 2 RCEIL, 3 MSE


@triton.jit
def _nib_f32(w, P: tl.constexpr):
    """The exact fp32 value of E2M1 nibble ``P`` (0..7, low first) of int32 word ``w``.

    The 3 magnitude bits go to fp32 bits 22..24 (exponent field ee, mantissa top bit m), which
    reads as ``e2m1 * 2^-126`` (code 1 = 0.5 becomes the subnormal 2^-127); one exact multiply by
    2^126 gives the value. The nibble's bit 3 becomes the sign bit (so code 8 is -0.0).
    """
    if 4 * P <= 22:  # noqa: SIM108 (constexpr branches)
        mag = (w << (22 - 4 * P)) & 0x01C00000
    else:
        mag = (w >> (4 * P - 22)) & 0x01C00000
    sgn = (w << (28 - 4 * P)) & -2147483648
    return (mag | sgn).to(tl.float32, bitcast=True) * 8.507059173023462e37


@triton.jit
def _mag_f32(m):
    """The fp32 value of an E2M1 magnitude code ``m`` (int32 0..7), exact."""
    return (m << 22).to(tl.float32, bitcast=True) * 8.507059173023462e37


@triton.jit
def _e4m3_f32(b):
    """Exact fp32 value of an E4M3 byte ``b`` (int32 0..255; NaN patterns are invalid input).

    The 7 magnitude bits go to fp32 bits 20..26 (exponent field eeee, mantissa mmm): that reads as
    ``e4m3 * 2^-120`` for normals and subnormals alike; one exact multiply by 2^120 gives the value.
    """
    bits = ((b & 0x7F) << 20) | ((b & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36


@triton.jit
def _div_rn(x, y, USE_ASM: tl.constexpr):
    """IEEE fp32 division, correctly rounded, subnormals kept (PTX ``div.rn.f32``, no ftz)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "div.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.math.div_rn(x, y)  # the interpreter (numpy) divides exactly


@triton.jit
def _second_level(p, g, DIVISOR: tl.constexpr, USE_ASM: tl.constexpr):
    """``p * g`` (ModelOpt multiplier) or ``p / g`` (compressed-tensors divisor), one rounding."""
    if DIVISOR:
        return _div_rn(p, g, USE_ASM)
    else:
        return p * g


@triton.jit
def _scale_exp(amax, RULE: tl.constexpr):
    """The block's scale exponent e (int32, clamped to [-127, 127]; 0 for an all-zero block).

    RULE: 0 FLOOR, 1 EVEN, 2 RCEIL (MSE's first candidate). ``amax`` is fp32 >= 0, exact.
    """
    ab = amax.to(tl.int32, bitcast=True)
    if RULE == 1:
        # EVEN: floor(log2(a)) - 2 with a = bitcast((bits + 0x200000) & 0xFF800000); a is 0 (field
        # 0: -inf, clamped to -127), a power of two, or +inf (field 255, amax >= 1.75 * 2^127:
        # +inf, clamped to 127).
        field = (ab + 0x200000) >> 23
        e = tl.where(field == 255, 127, field - 129)
    else:
        # Normalize: amax = (1 + mb/2^23) * 2^E exactly, subnormal amax included (its integer
        # mantissa converts exactly to fp32, whose fields give floor(log2) and the mantissa).
        is_norm = ab >= 0x800000
        fb = tl.where(is_norm, ab, ab.to(tl.float32).to(tl.int32, bitcast=True))
        big_e = (fb >> 23) - tl.where(is_norm, 127, 276)
        if RULE == 0:  # noqa: SIM108 (constexpr branches)
            e = big_e - 2  # FLOOR
        else:
            # RCEIL: smallest e with amax <= 6 * 2^e = 1.5 * 2^(e+2).
            e = tl.where((fb & 0x7FFFFF) <= 0x400000, big_e - 2, big_e - 1)
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where(ab == 0, 0, e)


@triton.jit
def _pow2(e):
    """2^e as fp32 for int32 e in [-127, 127] (2^-127 is the subnormal 0x00400000)."""
    return tl.where(e >= -126, (e + 127) << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def _quant_elem(ax, inv, pe):
    """RNE E2M1 magnitude code of ``ax * inv`` (saturating at 6) and ``|x| - dq`` (exact, fp32).

    ``ax`` = |x| (fp32), ``inv`` = 2^-e, ``pe`` = 2^e. Rounding: one fp32 add of M = 2^22, 2^23 or
    2^24 (grid step 0.5, 1, 2 for |q| < 2, [2, 4), >= 4) rounds |q| to the grid, ties to even
    (the even grid multiple is the even code); the low bits of the sum give the code.
    """
    a = ax * inv
    ab = a.to(tl.int32, bitcast=True)
    reg = tl.minimum(tl.maximum((ab >> 23) - 127, 0), 2)
    mb = (reg + 149) << 23
    m = mb.to(tl.float32, bitcast=True)
    y = a + m
    code = tl.minimum(y.to(tl.int32, bitcast=True) - mb + 2 * reg, 7)
    r = tl.minimum(y - m, 6.0)
    # |x| - dq, exact: a = |x| * 2^-e is exact whenever r != 0 (a > 0.25), a - r is exact
    # (Sterbenz: r/2 <= a <= 2r), and (a - r) * 2^e neither overflows nor loses bits. Computing
    # ax - r * 2^e instead would overflow for e = 127 (dq = 2^128), where the contract's value is
    # finite (EVEN on amax >= 1.75 * 2^127).
    d = tl.where(r == 0.0, ax, (a - r) * pe)
    return code, d


@triton.jit
def _word(w, s, g, inv0, pe0, inv1, pe1, sq0, sq1, sig, mx0, mx1,
          TWO: tl.constexpr, DIVISOR: tl.constexpr, USE_ASM: tl.constexpr, STATS: tl.constexpr):
    """Requantize the 8 elements of one int32 word in order, for one or two candidate scales.

    Returns the packed output word(s) and the updated float64 sums (squared error per candidate,
    signal) and fp32 max |x - dq| per candidate.
    """
    o0 = tl.zeros_like(w)
    o1 = tl.zeros_like(w)
    for P in tl.static_range(8):
        x = _second_level(_nib_f32(w, P) * s, g, DIVISOR, USE_ASM)
        xb = x.to(tl.int32, bitcast=True)
        sbit = (xb >> 28) & 8
        ax = (xb & 0x7FFFFFFF).to(tl.float32, bitcast=True)
        c0, d0 = _quant_elem(ax, inv0, pe0)
        o0 = o0 | ((c0 | sbit) << (4 * P))
        if STATS or TWO:
            d0d = d0.to(tl.float64)
            sq0 = tl.fma(d0d, d0d, sq0)
        if STATS:
            x64 = x.to(tl.float64)
            sig = tl.fma(x64, x64, sig)
            mx0 = tl.maximum(mx0, tl.abs(d0))
        if TWO:
            c1, d1 = _quant_elem(ax, inv1, pe1)
            o1 = o1 | ((c1 | sbit) << (4 * P))
            d1d = d1.to(tl.float64)
            sq1 = tl.fma(d1d, d1d, sq1)
            if STATS:
                mx1 = tl.maximum(mx1, tl.abs(d1))
    return o0, o1, sq0, sq1, sig, mx0, mx1


@triton.jit
def _half_max_mag(wa, wb):
    """Max E2M1 magnitude code (int32 0..7) over the 16 nibbles of two words."""
    m = tl.zeros_like(wa)
    for P in tl.static_range(8):
        m = tl.maximum(m, (wa >> (4 * P)) & 7)
        m = tl.maximum(m, (wb >> (4 * P)) & 7)
    return m


@triton.jit
def _block(w0, w1, w2, w3, sb0, sb1, g,
           RULE: tl.constexpr, DIVISOR: tl.constexpr, USE_ASM: tl.constexpr, STATS: tl.constexpr):
    """One 32-block per row: output words, E8M0 byte and the block's statistics."""
    s_a = _e4m3_f32(sb0)
    s_b = _e4m3_f32(sb1)
    # Pass 1: amax, exact, with no per-element float work.
    p_a = _mag_f32(_half_max_mag(w0, w1)) * tl.abs(s_a)
    p_b = _mag_f32(_half_max_mag(w2, w3)) * tl.abs(s_b)
    amax = _second_level(tl.maximum(p_a, p_b), tl.abs(g), DIVISOR, USE_ASM)
    if RULE == 3:
        e0 = _scale_exp(amax, 2)
        e1 = tl.where(amax == 0.0, 0, tl.maximum(e0 - 1, -127))
    else:
        e0 = _scale_exp(amax, RULE)
        e1 = e0
    inv0 = _pow2(-e0)
    pe0 = _pow2(e0)
    inv1 = _pow2(-e1)
    pe1 = _pow2(e1)
    zero64 = tl.zeros(g.shape, tl.float64)
    zero32 = tl.zeros(g.shape, tl.float32)
    sq0 = zero64
    sq1 = zero64
    sig = zero64
    mx0 = zero32
    mx1 = zero32
    # Pass 2, elements 0..31 in order: words 0, 1 use the first e4m3 scale, words 2, 3 the second.
    o0a, o0b, sq0, sq1, sig, mx0, mx1 = _word(w0, s_a, g, inv0, pe0, inv1, pe1, sq0, sq1, sig, mx0, mx1,
                                               RULE == 3, DIVISOR, USE_ASM, STATS)
    o1a, o1b, sq0, sq1, sig, mx0, mx1 = _word(w1, s_a, g, inv0, pe0, inv1, pe1, sq0, sq1, sig, mx0, mx1,
                                               RULE == 3, DIVISOR, USE_ASM, STATS)
    o2a, o2b, sq0, sq1, sig, mx0, mx1 = _word(w2, s_b, g, inv0, pe0, inv1, pe1, sq0, sq1, sig, mx0, mx1,
                                               RULE == 3, DIVISOR, USE_ASM, STATS)
    o3a, o3b, sq0, sq1, sig, mx0, mx1 = _word(w3, s_b, g, inv0, pe0, inv1, pe1, sq0, sq1, sig, mx0, mx1,
                                               RULE == 3, DIVISOR, USE_ASM, STATS)
    if RULE == 3:
        # MSE: RCEIL - 1 only if strictly better (ties go to RCEIL).
        pick = sq1 < sq0
        o0a = tl.where(pick, o0b, o0a)
        o1a = tl.where(pick, o1b, o1a)
        o2a = tl.where(pick, o2b, o2a)
        o3a = tl.where(pick, o3b, o3a)
        sq0 = tl.where(pick, sq1, sq0)
        mx0 = tl.where(pick, mx1, mx0)
        e0 = tl.where(pick, e1, e0)
        inv0 = tl.where(pick, inv1, inv0)
    clipped = (amax * inv0 > 6.0).to(tl.int32)
    exact = (mx0 == 0.0).to(tl.int32)
    return o0a, o1a, o2a, o3a, e0 + 127, sq0, sig, mx0, clipped, exact


@triton.jit
def requant_rows_kernel(in_ptr, sc_ptr, g_ptr, out_ptr, osc_ptr, st_ptr, R, NB,
                        s_in, s_sc, s_out, s_osc,
                        RULE: tl.constexpr, DIVISOR: tl.constexpr, CB: tl.constexpr,
                        ROWS: tl.constexpr, USE_ASM: tl.constexpr, STATS: tl.constexpr = True):
    """Requantize rows ``[pid*ROWS, pid*ROWS + ROWS)``; see the module docstring.

    in_ptr:  int32 [R, NB*4] packed NVFP4 words (row stride ``s_in`` words)
    sc_ptr:  uint8 [R, NB*2] E4M3 bytes (row stride ``s_sc``)
    g_ptr:   fp32  [R] second-level scale per row
    out_ptr: int32 [R, NB*4] packed MXFP4 words (row stride ``s_out``)
    osc_ptr: uint8 [R, NB] E8M0 bytes (row stride ``s_osc``)
    st_ptr:  fp64  [R, 5] (sq_err, signal, max_abs_err, clipped_blocks, exact_blocks)
    NB must be a multiple of CB. STATS=False (a benchmark diagnostic) skips the statistics and
    leaves st_ptr untouched.
    """
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    g = tl.load(g_ptr + rows, mask=rmask, other=1.0)
    in_row = in_ptr + r64 * s_in
    sc_row = sc_ptr + r64 * s_sc
    out_row = out_ptr + r64 * s_out
    osc_row = osc_ptr + r64 * s_osc
    c4 = tl.arange(0, 4)
    c2 = tl.arange(0, 2)
    m2 = rmask[:, None]
    rsq = tl.zeros([ROWS], tl.float64)
    rsig = tl.zeros([ROWS], tl.float64)
    rmx = tl.zeros([ROWS], tl.float32)
    rclip = tl.zeros([ROWS], tl.int32)
    rexact = tl.zeros([ROWS], tl.int32)
    for j0 in range(0, NB, CB):
        for b in tl.static_range(CB):
            j = j0 + b
            wt = tl.load(in_row[:, None] + (j * 4 + c4)[None, :], mask=m2, other=0)  # [ROWS, 4] int32
            w02, w13 = tl.split(tl.reshape(wt, [ROWS, 2, 2]))
            w0, w2 = tl.split(w02)
            w1, w3 = tl.split(w13)
            st = tl.load(sc_row[:, None] + (j * 2 + c2)[None, :], mask=m2, other=0).to(tl.int32)  # [ROWS, 2]
            sb0, sb1 = tl.split(st)
            o0, o1, o2, o3, ebyte, sq, sig, mx, clipped, exact = _block(
                w0, w1, w2, w3, sb0, sb1, g, RULE, DIVISOR, USE_ASM, STATS)
            ot = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), [ROWS, 4])
            tl.store(out_row[:, None] + (j * 4 + c4)[None, :], ot, mask=m2)
            tl.store(osc_row + j, ebyte.to(tl.uint8), mask=rmask)
            # Row sums, sequential over blocks.
            rsq = rsq + sq
            rsig = rsig + sig
            rmx = tl.maximum(rmx, mx)
            rclip = rclip + clipped
            rexact = rexact + exact
    if STATS:
        st_row = st_ptr + r64 * 5
        tl.store(st_row, rsq, mask=rmask)
        tl.store(st_row + 1, rsig, mask=rmask)
        tl.store(st_row + 2, rmx.to(tl.float64), mask=rmask)
        tl.store(st_row + 3, rclip.to(tl.float64), mask=rmask)
        tl.store(st_row + 4, rexact.to(tl.float64), mask=rmask)
