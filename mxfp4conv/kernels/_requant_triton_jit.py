# mypy: ignore-errors
"""Triton JIT code of the fused NVFP4 -> MXFP4 requant (docs/NUMERICS.md). Needs ``triton``.

Imported lazily by :mod:`mxfp4conv.kernels.requant_triton` only; nothing else imports this module,
so a CPU-only install without triton never touches it.

Design (one program = ``ROWS`` rows, one row per thread, blocks walked in order):

* The contract's statistics (float64) are block sums over 16 groups (half h, magnitude m) in group
  order, ``sum n_hm * t_hm`` with exact products, then row sums sequential over blocks; a thread
  owns whole rows and walks its row's 32-blocks in order, and the group terms are separate registers
  (the code is unrolled), so the float64 accumulation order is exactly the contract's.
* Per block only 14 nonzero values occur: ``|x|[h, m] = RN(e2m1[m] * |s_h| (*|/) |g|)``, m = 1..7
  (m = 0 is 0, exactly reproduced, and contributes +0). All float work (both MSE candidates,
  statistics) runs on those 14 table entries; per element the kernel only counts its magnitude (a
  histogram of 4-bit fields per packed word) and looks up its new code (the table's codes packed as
  4-bit fields of one int32 per half, shifted by 4 * magnitude).
* Signs never enter the float work: ``|x| = RN(|e2m1| * |s| (*|/) |g|)`` (RN is sign-symmetric) and
  the output sign bit is ``signbit(x) = nibble sign ^ signbit(s) ^ signbit(g)`` (IEEE sign rule,
  zeros included), applied to 8 codes at once with one XOR per packed word.
* Dequantization: the e4m3 * e2m1 product is exact; one rounding by the second-level scale:
  multiply, or a true IEEE division (Triton's ``/`` is approximate and libdevice's ``div_rn`` is
  linked with flush-to-zero): PTX ``div.rn.f32``, or, when every |g| of the program is in
  [2^-100, 2^100], Markstein's exact correction from the per-row ``RN(1/|g|)`` (3 instructions
  instead of ~10).
* E2M1 rounding is one fp32 FMA: ``y = RN(|x| * 2^-e + M)`` with M = 2^(22 + floor(log2 q)) (grid step
  0.5, 1, 2 for |q| < 2, [2, 4), [4, 8); larger q, possible for a magnitude that does not occur,
  saturates to code 7 / value 6) rounds |q| to the grid, ties to even; the low bits of y give the
  code. ``|x| * 2^-e`` is exact except when it underflows, and then it is far below half an ulp of
  M, so the fused and unfused forms agree.
* ``d = |x| - dq = fma(r, -2^e, |x|)``: one rounding of the exact difference (exact for values that
  occur: Sterbenz), |d| <= |x| (no overflow, even for e = 127 where dq = 2^128 does not fit fp32). d
  and |x| have 24-bit significands, so d^2 and x^2 are exact in float64, and so are ``n * d^2`` and
  ``n * x^2`` (n <= 16): ``fma(n, d*d, s) == RN(s + n*d*d)``, the contract's group term.
* Launch with ``enable_fp_fusion=False`` so that no other mul/add pair is contracted.
"""

import triton
import triton.language as tl

__all__ = ["requant_rows_kernel"]

# Rules, as constexpr ids (the host maps ScaleRule onto these).
# 0 FLOOR, 1 EVEN, 2 RCEIL, 3 MSE


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
def _fma32(a, b, c, USE_ASM: tl.constexpr):
    """fp32 ``RN(a * b + c)``, fused. The interpreter's fma rounds the product first, so there it is
    emulated in float64 (exact for the operands used here: power-of-two ``b``)."""
    if USE_ASM:
        return tl.fma(a, b, c)
    else:
        return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)


@triton.jit
def _div_fast(p, g_abs, inv_g, USE_ASM: tl.constexpr):
    """RN(p / g) by Markstein's correction from the correctly rounded reciprocal ``inv_g``.

    q0 = RN(p * y) is within 1 ulp of p/g, the residual p - g*q0 is exact (fma), and
    RN(q0 + r*y) = RN(p/g) when y = RN(1/g) (Markstein's theorem), barring underflow / overflow:
    the caller uses it only for 2^-100 <= |g| <= 2^100 with p in [0, 6*448] (all normal).
    """
    if USE_ASM:
        q0 = p * inv_g
        r = tl.fma(-g_abs, q0, p)
        return tl.fma(r, inv_g, q0)
    else:
        return tl.math.div_rn(p, g_abs)  # the interpreter's fma is not fused


@triton.jit
def _x(M: tl.constexpr, s_abs, g_abs, inv_g, safe,
       DIVISOR: tl.constexpr, FAST_DIV: tl.constexpr, USE_ASM: tl.constexpr):
    """|x| of E2M1 magnitude ``M`` (1..7) in a half with block scale |s|: RN(e2m1[M] * |s| (*|/) |g|)."""
    if M == 1:
        p = s_abs * 0.5  # exact (an E4M3 times an E2M1 value)
    elif M == 2:
        p = s_abs
    elif M == 3:
        p = s_abs * 1.5
    elif M == 4:
        p = s_abs * 2.0
    elif M == 5:
        p = s_abs * 3.0
    elif M == 6:
        p = s_abs * 4.0
    else:
        p = s_abs * 6.0
    if DIVISOR:
        if FAST_DIV:
            if safe:  # noqa: SIM108 (uniform over the program: a branch, not a select)
                x = _div_fast(p, g_abs, inv_g, USE_ASM)
            else:
                x = _div_rn(p, g_abs, USE_ASM)
        else:
            x = _div_rn(p, g_abs, USE_ASM)
    else:
        x = p * g_abs
    return x


@triton.jit
def _hist(w):
    """Counts of the 8 magnitudes among the 8 nibbles of word ``w``: 8 fields of 4 bits (at most 8)."""
    one = tl.full(w.shape, 1, tl.int32)
    h = one << ((w << 2) & 28)
    h += one << ((w >> 2) & 28)
    h += one << ((w >> 6) & 28)
    h += one << ((w >> 10) & 28)
    h += one << ((w >> 14) & 28)
    h += one << ((w >> 18) & 28)
    h += one << ((w >> 22) & 28)
    h += one << ((w >> 26) & 28)
    return h


@triton.jit
def _n(ha, hb, M: tl.constexpr):
    """Elements of magnitude ``M`` in a half (its two words' histograms)."""
    return ((ha >> (4 * M)) & 15) + ((hb >> (4 * M)) & 15)


@triton.jit
def _top(x1, x2, x3, x4, x5, x6, x7, n1, n2, n3, n4, n5, n6, n7):
    """max |x| over the magnitudes that occur in a half (0 if none but zeros)."""
    m = tl.where(n1 > 0, x1, 0.0)
    m = tl.maximum(m, tl.where(n2 > 0, x2, 0.0))
    m = tl.maximum(m, tl.where(n3 > 0, x3, 0.0))
    m = tl.maximum(m, tl.where(n4 > 0, x4, 0.0))
    m = tl.maximum(m, tl.where(n5 > 0, x5, 0.0))
    m = tl.maximum(m, tl.where(n6 > 0, x6, 0.0))
    return tl.maximum(m, tl.where(n7 > 0, x7, 0.0))


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
def _q(ax, inv, npe, ce, USE_ASM: tl.constexpr):
    """E2M1 magnitude code (0..7) of ``|x| * 2^-e`` (RNE, saturating at 6) and ``d = |x| - dq``.

    inv = 2^-e, npe = -2^e, ce = 127 + e (all per block).
    """
    # Binade of q = |x| * 2^-e above 1 (0 below): q < 12 for the values that occur (reg <= 3), more
    # for a table entry whose magnitude does not occur; any reg >= 3 (q >= 8, step 2^(reg-1)) gives
    # y - M in [8, 2^(reg+1)] and a code >= 8: both saturate to code 7 / value 6, as on the CPU.
    reg = tl.maximum((ax.to(tl.int32, bitcast=True) >> 23) - ce, 0)
    mb = (reg << 23) + (149 << 23)  # bits of M = 2^(22 + reg)
    m = mb.to(tl.float32, bitcast=True)
    y = _fma32(ax, inv, m, USE_ASM)
    code = tl.minimum(y.to(tl.int32, bitcast=True) - (mb - 2 * reg), 7)
    r = tl.minimum(y - m, 6.0)
    return code, _fma32(r, npe, ax, USE_ASM)


@triton.jit
def _ent(x, n, M: tl.constexpr, inv, npe, ce, cw, sq, mx,
         SQ: tl.constexpr, STATS: tl.constexpr, USE_ASM: tl.constexpr):
    """Table entry ``M`` of a half under one exponent: its code goes to field M of ``cw``; ``sq``
    (float64) gets ``n * d^2`` (exact product, one rounding: fma), ``mx`` max |d| over entries that
    occur."""
    code, d = _q(x, inv, npe, ce, USE_ASM)
    cw += code << (4 * M)
    if SQ:
        d64 = d.to(tl.float64)
        sq = tl.fma(n.to(tl.float64), d64 * d64, sq)
    if STATS:
        mx = tl.maximum(mx, tl.where(n > 0, tl.abs(d), 0.0))
    return cw, sq, mx


@triton.jit
def _half(x1, x2, x3, x4, x5, x6, x7, n1, n2, n3, n4, n5, n6, n7, inv, npe, ce, sq, mx,
          SQ: tl.constexpr, STATS: tl.constexpr, USE_ASM: tl.constexpr):
    """One half's 7 nonzero magnitudes in order under one exponent -> (code word: field m holds the new
    code of magnitude m, field 0 is 0), the running squared error and max |d|."""
    cw = tl.zeros(inv.shape, tl.int32)
    cw, sq, mx = _ent(x1, n1, 1, inv, npe, ce, cw, sq, mx, SQ, STATS, USE_ASM)
    cw, sq, mx = _ent(x2, n2, 2, inv, npe, ce, cw, sq, mx, SQ, STATS, USE_ASM)
    cw, sq, mx = _ent(x3, n3, 3, inv, npe, ce, cw, sq, mx, SQ, STATS, USE_ASM)
    cw, sq, mx = _ent(x4, n4, 4, inv, npe, ce, cw, sq, mx, SQ, STATS, USE_ASM)
    cw, sq, mx = _ent(x5, n5, 5, inv, npe, ce, cw, sq, mx, SQ, STATS, USE_ASM)
    cw, sq, mx = _ent(x6, n6, 6, inv, npe, ce, cw, sq, mx, SQ, STATS, USE_ASM)
    cw, sq, mx = _ent(x7, n7, 7, inv, npe, ce, cw, sq, mx, SQ, STATS, USE_ASM)
    return cw, sq, mx


@triton.jit
def _sig(x, n, acc):
    """acc + n * x^2 in float64 (x^2 and n * x^2 exact)."""
    x64 = x.to(tl.float64)
    return tl.fma(n.to(tl.float64), x64 * x64, acc)


@triton.jit
def _map_word(w, cw):
    """New magnitude codes of the 8 nibbles of ``w``: nibble P gets field ``mag(P)`` of ``cw``."""
    o = (cw >> ((w << 2) & 28)) & 7
    o += ((cw >> ((w >> 2) & 28)) & 7) << 4
    o += ((cw >> ((w >> 6) & 28)) & 7) << 8
    o += ((cw >> ((w >> 10) & 28)) & 7) << 12
    o += ((cw >> ((w >> 14) & 28)) & 7) << 16
    o += ((cw >> ((w >> 18) & 28)) & 7) << 20
    o += ((cw >> ((w >> 22) & 28)) & 7) << 24
    o += ((cw >> ((w >> 26) & 28)) & 7) << 28
    return o


@triton.jit
def _cand(a1, a2, a3, a4, a5, a6, a7, na1, na2, na3, na4, na5, na6, na7,
          b1, b2, b3, b4, b5, b6, b7, nb1, nb2, nb3, nb4, nb5, nb6, nb7, e,
          SQ: tl.constexpr, STATS: tl.constexpr, USE_ASM: tl.constexpr):
    """One candidate exponent ``e`` over both halves' tables (a: half 0, b: half 1), in group order."""
    inv = _pow2(-e)
    npe = -_pow2(e)
    ce = e + 127
    sq = tl.zeros(inv.shape, tl.float64)
    mx = tl.zeros(inv.shape, tl.float32)
    cwa, sq, mx = _half(a1, a2, a3, a4, a5, a6, a7, na1, na2, na3, na4, na5, na6, na7,
                        inv, npe, ce, sq, mx, SQ, STATS, USE_ASM)
    cwb, sq, mx = _half(b1, b2, b3, b4, b5, b6, b7, nb1, nb2, nb3, nb4, nb5, nb6, nb7,
                        inv, npe, ce, sq, mx, SQ, STATS, USE_ASM)
    return cwa, cwb, sq, mx


@triton.jit
def _block(w0, w1, w2, w3, sb0, sb1, g, g_abs, inv_g, safe,
           RULE: tl.constexpr, DIVISOR: tl.constexpr, FAST_DIV: tl.constexpr, USE_ASM: tl.constexpr,
           STATS: tl.constexpr):
    """One 32-block per row: output words, E8M0 byte and the block's statistics."""
    s_a = _e4m3_f32(sb0)
    s_b = _e4m3_f32(sb1)
    sa = tl.abs(s_a)
    sb = tl.abs(s_b)
    a1 = _x(1, sa, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    a2 = _x(2, sa, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    a3 = _x(3, sa, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    a4 = _x(4, sa, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    a5 = _x(5, sa, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    a6 = _x(6, sa, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    a7 = _x(7, sa, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    b1 = _x(1, sb, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    b2 = _x(2, sb, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    b3 = _x(3, sb, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    b4 = _x(4, sb, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    b5 = _x(5, sb, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    b6 = _x(6, sb, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    b7 = _x(7, sb, g_abs, inv_g, safe, DIVISOR, FAST_DIV, USE_ASM)
    h0 = _hist(w0)
    h1 = _hist(w1)
    h2 = _hist(w2)
    h3 = _hist(w3)
    na1 = _n(h0, h1, 1)
    na2 = _n(h0, h1, 2)
    na3 = _n(h0, h1, 3)
    na4 = _n(h0, h1, 4)
    na5 = _n(h0, h1, 5)
    na6 = _n(h0, h1, 6)
    na7 = _n(h0, h1, 7)
    nb1 = _n(h2, h3, 1)
    nb2 = _n(h2, h3, 2)
    nb3 = _n(h2, h3, 3)
    nb4 = _n(h2, h3, 4)
    nb5 = _n(h2, h3, 5)
    nb6 = _n(h2, h3, 6)
    nb7 = _n(h2, h3, 7)
    amax = tl.maximum(_top(a1, a2, a3, a4, a5, a6, a7, na1, na2, na3, na4, na5, na6, na7),
                      _top(b1, b2, b3, b4, b5, b6, b7, nb1, nb2, nb3, nb4, nb5, nb6, nb7))
    if RULE == 3:  # noqa: SIM108 (constexpr branches)
        e = _scale_exp(amax, 2)
    else:
        e = _scale_exp(amax, RULE)
    cwa, cwb, sq, mx = _cand(a1, a2, a3, a4, a5, a6, a7, na1, na2, na3, na4, na5, na6, na7,
                             b1, b2, b3, b4, b5, b6, b7, nb1, nb2, nb3, nb4, nb5, nb6, nb7, e,
                             STATS or RULE == 3, STATS, USE_ASM)
    if RULE == 3:
        # MSE: RCEIL - 1 only if its error is strictly lower (ties go to RCEIL).
        e1 = tl.where(amax == 0.0, 0, tl.maximum(e - 1, -127))
        cwa1, cwb1, sq1, mx1 = _cand(a1, a2, a3, a4, a5, a6, a7, na1, na2, na3, na4, na5, na6, na7,
                                     b1, b2, b3, b4, b5, b6, b7, nb1, nb2, nb3, nb4, nb5, nb6, nb7, e1,
                                     True, STATS, USE_ASM)
        pick = sq1 < sq
        cwa = tl.where(pick, cwa1, cwa)
        cwb = tl.where(pick, cwb1, cwb)
        sq = tl.where(pick, sq1, sq)
        mx = tl.where(pick, mx1, mx)
        e = tl.where(pick, e1, e)
    # Sign bits: nibble sign ^ sign(s_half) ^ sign(g), 8 nibbles per XOR.
    gs = g.to(tl.int32, bitcast=True)
    n_a = ((s_a.to(tl.int32, bitcast=True) ^ gs) >> 31) & -2004318072  # 0x88888888 or 0
    n_b = ((s_b.to(tl.int32, bitcast=True) ^ gs) >> 31) & -2004318072
    o0 = _map_word(w0, cwa) ^ ((w0 & -2004318072) ^ n_a)
    o1 = _map_word(w1, cwa) ^ ((w1 & -2004318072) ^ n_a)
    o2 = _map_word(w2, cwb) ^ ((w2 & -2004318072) ^ n_b)
    o3 = _map_word(w3, cwb) ^ ((w3 & -2004318072) ^ n_b)
    sig = tl.zeros(g.shape, tl.float64)
    if STATS:
        sig = _sig(a1, na1, sig)
        sig = _sig(a2, na2, sig)
        sig = _sig(a3, na3, sig)
        sig = _sig(a4, na4, sig)
        sig = _sig(a5, na5, sig)
        sig = _sig(a6, na6, sig)
        sig = _sig(a7, na7, sig)
        sig = _sig(b1, nb1, sig)
        sig = _sig(b2, nb2, sig)
        sig = _sig(b3, nb3, sig)
        sig = _sig(b4, nb4, sig)
        sig = _sig(b5, nb5, sig)
        sig = _sig(b6, nb6, sig)
        sig = _sig(b7, nb7, sig)
    clipped = (amax * _pow2(-e) > 6.0).to(tl.int32)
    exact = (sq == 0.0).to(tl.int32)
    return o0, o1, o2, o3, e + 127, sq, sig, mx, clipped, exact


@triton.jit
def _ld(in_row, sc_row, j, c4, c2, m):
    """Block ``j`` of every row: its 4 packed words [ROWS, 4] and 2 E4M3 bytes [ROWS, 2]."""
    wt = tl.load(in_row[:, None] + (j * 4 + c4)[None, :], mask=m, other=0)
    st = tl.load(sc_row[:, None] + (j * 2 + c2)[None, :], mask=m, other=0)
    return wt, st


@triton.jit
def _ld_tile(in_row, sc_row, j0, c4, c2, m, TILE: tl.constexpr):
    """Blocks ``j0 .. j0 + TILE - 1`` of every row, all loads issued together (unused slots repeat
    block j0 and are never computed)."""
    w0, s0 = _ld(in_row, sc_row, j0, c4, c2, m)
    w1, s1 = w0, s0
    w2, s2 = w0, s0
    w3, s3 = w0, s0
    if TILE >= 2:
        w1, s1 = _ld(in_row, sc_row, j0 + 1, c4, c2, m)
    if TILE == 4:
        w2, s2 = _ld(in_row, sc_row, j0 + 2, c4, c2, m)
        w3, s3 = _ld(in_row, sc_row, j0 + 3, c4, c2, m)
    return w0, s0, w1, s1, w2, s2, w3, s3


@triton.jit
def _tile(w0, s0, w1, s1, w2, s2, w3, s3, j0, g, g_abs, inv_g, safe, out_row, osc_row, c4, m2, rmask,
          rsq, rsig, rmx, rclip, rexact,
          ROWS: tl.constexpr, RULE: tl.constexpr, DIVISOR: tl.constexpr, FAST_DIV: tl.constexpr,
          USE_ASM: tl.constexpr, STATS: tl.constexpr, TILE: tl.constexpr):
    """The TILE loaded blocks, in order (the row sums stay sequential over blocks)."""
    rsq, rsig, rmx, rclip, rexact = _step(w0, s0, j0, g, g_abs, inv_g, safe, out_row, osc_row, c4, m2, rmask,
                                          rsq, rsig, rmx, rclip, rexact, ROWS, RULE, DIVISOR, FAST_DIV, USE_ASM, STATS)
    if TILE >= 2:
        rsq, rsig, rmx, rclip, rexact = _step(w1, s1, j0 + 1, g, g_abs, inv_g, safe, out_row, osc_row, c4, m2, rmask,
                                              rsq, rsig, rmx, rclip, rexact, ROWS, RULE, DIVISOR, FAST_DIV, USE_ASM,
                                              STATS)
    if TILE == 4:
        rsq, rsig, rmx, rclip, rexact = _step(w2, s2, j0 + 2, g, g_abs, inv_g, safe, out_row, osc_row, c4, m2, rmask,
                                              rsq, rsig, rmx, rclip, rexact, ROWS, RULE, DIVISOR, FAST_DIV, USE_ASM,
                                              STATS)
        rsq, rsig, rmx, rclip, rexact = _step(w3, s3, j0 + 3, g, g_abs, inv_g, safe, out_row, osc_row, c4, m2, rmask,
                                              rsq, rsig, rmx, rclip, rexact, ROWS, RULE, DIVISOR, FAST_DIV, USE_ASM,
                                              STATS)
    return rsq, rsig, rmx, rclip, rexact


@triton.jit
def _step(wt, st, j, g, g_abs, inv_g, safe, out_row, osc_row, c4, m2, rmask,
          rsq, rsig, rmx, rclip, rexact,
          ROWS: tl.constexpr, RULE: tl.constexpr, DIVISOR: tl.constexpr, FAST_DIV: tl.constexpr,
          USE_ASM: tl.constexpr, STATS: tl.constexpr):
    """Block ``j`` of every row, from its loaded words ``wt`` [ROWS, 4] and scale bytes ``st``
    [ROWS, 2]: store the codes and the E8M0 byte, fold the block statistics into the row sums."""
    w02, w13 = tl.split(tl.reshape(wt, [ROWS, 2, 2]))
    w0, w2 = tl.split(w02)
    w1, w3 = tl.split(w13)
    sb0, sb1 = tl.split(st.to(tl.int32))
    o0, o1, o2, o3, ebyte, sq, sig, mx, clipped, exact = _block(
        w0, w1, w2, w3, sb0, sb1, g, g_abs, inv_g, safe, RULE, DIVISOR, FAST_DIV, USE_ASM, STATS)
    ot = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), [ROWS, 4])
    tl.store(out_row[:, None] + (j * 4 + c4)[None, :], ot, mask=m2)
    tl.store(osc_row + j, ebyte.to(tl.uint8), mask=rmask)
    if STATS:
        # Row sums, sequential over blocks.
        rsq = rsq + sq
        rsig = rsig + sig
        rmx = tl.maximum(rmx, mx)
        rclip = rclip + clipped
        rexact = rexact + exact
    return rsq, rsig, rmx, rclip, rexact


@triton.jit
def requant_rows_kernel(in_ptr, sc_ptr, g_ptr, out_ptr, osc_ptr, st_ptr, R, NB,
                        s_in, s_sc, s_out, s_osc,
                        RULE: tl.constexpr, DIVISOR: tl.constexpr, TILE: tl.constexpr,
                        ROWS: tl.constexpr, USE_ASM: tl.constexpr, STATS: tl.constexpr = True,
                        FAST_DIV: tl.constexpr = True, PREFETCH: tl.constexpr = False):
    """Requantize rows ``[pid*ROWS, pid*ROWS + ROWS)``; see the module docstring.

    in_ptr:  int32 [R, NB*4] packed NVFP4 words (row stride ``s_in`` words)
    sc_ptr:  uint8 [R, NB*2] E4M3 bytes (row stride ``s_sc``)
    g_ptr:   fp32  [R] second-level scale per row
    out_ptr: int32 [R, NB*4] packed MXFP4 words (row stride ``s_out``)
    osc_ptr: uint8 [R, NB] E8M0 bytes (row stride ``s_osc``)
    st_ptr:  fp64  [R, 5] (sq_err, signal, max_abs_err, clipped_blocks, exact_blocks)
    NB must be a multiple of TILE (1, 2 or 4 blocks per row loaded at once, then computed in order).
    PREFETCH loads tile t+1 while tile t is computed. STATS=False (a benchmark diagnostic) skips the statistics
    and leaves st_ptr untouched. FAST_DIV=False always uses ``div.rn.f32`` for the divisor.
    """
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    g = tl.load(g_ptr + rows, mask=rmask, other=1.0)
    g_abs = tl.abs(g)
    inv_g = g_abs
    safe = False
    if DIVISOR and FAST_DIV:
        inv_g = _div_rn(tl.full(g.shape, 1.0, tl.float32), g_abs, USE_ASM)  # RN(1/|g|) per row
        ok = (g_abs >= 7.888609052210118e-31) & (g_abs <= 1.2676506002282294e30)  # 2^-100, 2^100
        safe = tl.min(tl.where(rmask, ok, True).to(tl.int32), axis=0) == 1
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
    # Loads of a tile (TILE blocks per row) are issued before any store of the tile (the output may
    # alias the input as far as the compiler knows, so a load after a store cannot be hoisted);
    # PREFETCH also issues the next tile's loads before the current tile is computed.
    if PREFETCH:
        w0, s0, w1, s1, w2, s2, w3, s3 = _ld_tile(in_row, sc_row, 0, c4, c2, m2, TILE)
        for j0 in range(0, NB, TILE):
            n0, t0, n1, t1, n2, t2, n3, t3 = _ld_tile(in_row, sc_row, j0 + TILE, c4, c2, m2 & (j0 + TILE < NB), TILE)
            rsq, rsig, rmx, rclip, rexact = _tile(
                w0, s0, w1, s1, w2, s2, w3, s3, j0, g, g_abs, inv_g, safe, out_row, osc_row, c4, m2, rmask,
                rsq, rsig, rmx, rclip, rexact, ROWS, RULE, DIVISOR, FAST_DIV, USE_ASM, STATS, TILE)
            w0, s0, w1, s1, w2, s2, w3, s3 = n0, t0, n1, t1, n2, t2, n3, t3
    else:
        for j0 in range(0, NB, TILE):
            w0, s0, w1, s1, w2, s2, w3, s3 = _ld_tile(in_row, sc_row, j0, c4, c2, m2, TILE)
            rsq, rsig, rmx, rclip, rexact = _tile(
                w0, s0, w1, s1, w2, s2, w3, s3, j0, g, g_abs, inv_g, safe, out_row, osc_row, c4, m2, rmask,
                rsq, rsig, rmx, rclip, rexact, ROWS, RULE, DIVISOR, FAST_DIV, USE_ASM, STATS, TILE)
    if STATS:
        st_row = st_ptr + r64 * 5
        tl.store(st_row, rsq, mask=rmask)
        tl.store(st_row + 1, rsig, mask=rmask)
        tl.store(st_row + 2, rmx.to(tl.float64), mask=rmask)
        tl.store(st_row + 3, rclip.to(tl.float64), mask=rmask)
        tl.store(st_row + 4, rexact.to(tl.float64), mask=rmask)
