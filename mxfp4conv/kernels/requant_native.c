/* NVFP4 -> MXFP4 requantization of rows on the CPU: the row-level contract of docs/NUMERICS.md,
 * byte for byte and bit for bit the same as mxfp4conv.numerics.requant.requant_rows_cpu's torch path and the
 * GPU kernel. Built and loaded by mxfp4conv/kernels/requant_native.py (ctypes; it releases the GIL,
 * so Python threads run slabs of rows in parallel).
 *
 * Compiled with -ffp-contract=off and without -ffast-math: every float operation below is one IEEE
 * operation, rounded to its own type (x86-64 SSE2 / AArch64: FLT_EVAL_METHOD 0).
 *
 * Per 32-block (two 16-element NVFP4 halves h, scale s_h; second-level scale g of the row): only 16
 * values occur, |x|[h*8 + m] = RN(RN(e2m1[m] * |s_h|) (*|/) |g|) for magnitude code m, so the float
 * work runs on that 16-entry table; per element only its group h*8 + m is counted and its new code
 * looked up. Statistics are float32 block sums in the scaled domain, in group order t = 0..15, times
 * 4^e in float64; MSE compares its two candidates exactly (float64 terms that are all exact). The
 * block's output bytes are 16-lane table lookups where the CPU has them (encode16_lanes).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* With MXFP4CONV_MULTIVERSION (the build tries it first), the row function is compiled once per x86-64
 * level and the loader picks the CPU's (function multi-versioning, an ifunc): the same IEEE operations
 * at any vector width (no contraction, no reassociation), so the same bytes; the 16-lane table loops
 * run 1.3x (AVX2) to 1.4x (AVX-512) faster than the baseline SSE2 build (BENCHMARKS.md). */
#if defined(MXFP4CONV_MULTIVERSION) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(MXFP4CONV_MULTIVERSION) && defined(__x86_64__) && defined(__clang__) && __clang_major__ >= 14
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

#if defined(__GNUC__)
typedef uint64_t u64x2 __attribute__((vector_size(16)));
#endif

static const float POS8[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* E2M1 grid value (0, 0.5, 1, 1.5, 2, 3, 4, 6) -> magnitude code, by its float32 bits >> 22
 * (0, 252, 254..259). Sized for every 32-bit pattern (>> 22: 0..1023), so that rows of invalid
 * input (NaN scales, which are refused only once the rows are back) never read past the table. */
static const uint8_t CODE_LUT[1024] = {[252] = 1, [254] = 2, [255] = 3, [256] = 4,
                                       [257] = 5, [258] = 6, [259] = 7};

/* 2^k as float32 for k in [-127, 127] (2^-127 is the subnormal 0x00400000). */
static inline float pow2f(int k) { return u2f(k >= -126 ? (uint32_t)(k + 127) << 23 : 0x00400000u); }

/* 2^k as float64 for k in [-1022, 1023]. */
static inline double pow2d(int k) {
    uint64_t b = (uint64_t)(k + 1023) << 52;
    double d;
    memcpy(&d, &b, 8);
    return d;
}

/* 6 * 2^e as float32 for e in [-127, 127]: 1.5 * 2^(e + 2); +inf for e >= 126 (above FLT_MAX). */
static inline float six_pow2f(int e) {
    return e >= 126 ? u2f(0x7F800000u) : u2f(((uint32_t)(e + 129) << 23) | 0x400000u);
}

/* frexp of a finite amax > 0: amax = m * 2^x, m in [0.5, 1); returns x, sets *above = (m > 0.75). */
static inline int frexp_pos(float amax, int *above) {
    uint32_t b = f2u(amax);
    if (b >= 0x800000u) {
        *above = (b & 0x7FFFFFu) > 0x400000u;
        return (int)(b >> 23) - 126;
    }
    int x;
    float m = frexpf(amax, &x); /* subnormal amax: rare, exact */
    *above = m > 0.75f;
    return x;
}

/* Smallest integer e with amax <= 6 * 2^e (amax > 0, finite). Unclamped. */
static inline int rceil_exp(float amax) {
    int above;
    int x = frexp_pos(amax, &above);
    return x - 3 + above;
}

static inline int clamp_e(int e) { return e < -127 ? -127 : (e > 127 ? 127 : e); }

/* FLOOR (0) / EVEN (1) / RCEIL (2) exponent, clamped; 0 for an all-zero block. */
static int scale_exp(float amax, int rule) {
    int e, above;
    if (amax == 0.0f) return 0;
    if (rule == 0) {
        e = frexp_pos(amax, &above) - 3;
    } else if (rule == 1) {
        uint32_t ef = ((f2u(amax) + 0x200000u) & 0x7F800000u) >> 23;
        e = ef == 0 ? -127 : (ef == 0xFF ? 127 : (int)ef - 129);
    } else {
        e = rceil_exp(amax);
    }
    return clamp_e(e);
}

/* One candidate exponent e over the 16-entry table (|x| values at, their bits ab): q = |x| * 2^-e,
 * its grid magnitude r and d = q - r (float32, the scaled domain), rounding q to the E2M1 grid by
 * adding and subtracting c = 2^(max(floor(log2 q), 0) + 22) (ties to even), saturated at 6. The same
 * operations as requant._cand_tab; flat loops over 16 lanes so that the compiler vectorizes them. */
static inline void cand(const float *at, const uint32_t *ab, int e, float *q, float *r, float *d) {
    const float inv = pow2f(-e);
    const int32_t coff = (22 - e) * (1 << 23), cmin = (127 + 22) * (1 << 23);
    float cf[16];
    int32_t c[16];
    for (int t = 0; t < 16; t++) q[t] = at[t] * inv;
    for (int t = 0; t < 16; t++) {
        const int32_t x = (int32_t)(ab[t] & 0x7F800000u) + coff;
        c[t] = x < cmin ? cmin : x;
    }
    memcpy(cf, c, sizeof cf);
    for (int t = 0; t < 16; t++) {
        float y = (q[t] + cf[t]) - cf[t];
        y = y > 6.0f ? 6.0f : y;
        r[t] = y;
        d[t] = q[t] - y;
    }
}

/* The float32 block sums of the statistics, of d (error) and q (signal) at once (two independent
 * chains): acc = RN(acc + RN(n_t * RN(v_t * v_t))) in group order t = 0..15 over the entries that
 * occur (NUMERICS.md "Block statistics"; -ffp-contract=off keeps every operation rounded). Entries
 * that do not occur are skipped: their v^2 can overflow (an all-zero block of a huge second-level
 * scale keeps e = 0). */
static inline void fold32(const float *d, const float *q, const float *n, float *err, float *sig) {
    float td[16], tq[16];
    for (int t = 0; t < 16; t++) {
        const float dd = d[t] * d[t], qq = q[t] * q[t];
        td[t] = n[t] != 0.0f ? n[t] * dd : 0.0f;
        tq[t] = n[t] != 0.0f ? n[t] * qq : 0.0f;
    }
    float ae = 0.0f, as = 0.0f;
    for (int t = 0; t < 16; t++) {
        ae += td[t];
        as += tq[t];
    }
    *err = ae;
    *sig = as;
}

/* MSE's exact decision (NUMERICS.md): sum_t n_t (A - B)(2u - A - B) < 0 with u = q_b, A = 2 r_a,
 * B = r_b; every term and partial sum is exact in float64. */
static inline int mse_lower(const float *qb, const float *ra, const float *rb, const float *n) {
    double v[16];
    for (int t = 0; t < 16; t++) {
        const double a = 2.0 * (double)ra[t], b = (double)rb[t], u = (double)qb[t];
        v[t] = (double)n[t] * ((a - b) * ((u + u) - (a + b)));
    }
    /* exact, so a tree (vectorized) gives the same sum; a new array per level, not in place: the
     * in-place form compiles to narrow stores read back by wide loads, which stall */
    double v8[8], v4[4], v2[2];
    for (int t = 0; t < 8; t++) v8[t] = v[t] + v[t + 8];
    for (int t = 0; t < 4; t++) v4[t] = v8[t] + v8[t + 4];
    for (int t = 0; t < 2; t++) v2[t] = v4[t] + v4[t + 2];
    return v2[0] + v2[1] < 0.0;
}

/* max |d| over the entries that occur (pm[t] = 1, else 0; the products are exact). */
static inline float present_max(const float *d, const float *pm) {
    float v[16];
    for (int t = 0; t < 16; t++) v[t] = fabsf(d[t]) * pm[t];
    float v8[8], v4[4], v2[2]; /* max is exact: a tree (vectorized), a new array per level as above */
    for (int t = 0; t < 8; t++) v8[t] = v[t] > v[t + 8] ? v[t] : v[t + 8];
    for (int t = 0; t < 4; t++) v4[t] = v8[t] > v8[t + 4] ? v8[t] : v8[t + 4];
    for (int t = 0; t < 2; t++) v2[t] = v4[t] > v4[t + 2] ? v4[t] : v4[t + 2];
    return v2[0] > v2[1] ? v2[0] : v2[1];
}

/* The 16 output bytes of a block: each nibble's magnitude (bits 0-2) replaced by its new code from
 * the half's table (code[h * 8 + m]), its sign bit kept, both sign bits flipped where the half's
 * scale sign differs from the row's (flip = 0x88). */
static void encode16_bytes(const uint8_t *pb, const uint8_t *code, uint8_t flip0, uint8_t flip1, uint8_t *ob) {
    for (int i = 0; i < 16; i++) {
        const uint8_t *ch = code + (i >> 3) * 8;
        const uint8_t b = pb[i];
        ob[i] = (uint8_t)((ch[b & 7] | (ch[(b >> 4) & 7] << 4) | (b & 0x88)) ^ (i < 8 ? flip0 : flip1));
    }
}

/* The same integer operations on 16 lanes at once: two table lookups (one pshufb each on x86-64 with
 * SSSE3, one tbl on AArch64), with GCC's vector extensions; chosen at run time where the CPU has them. */
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__aarch64__))
#define ENCODE16_VECTOR 1
typedef uint8_t u8x16 __attribute__((vector_size(16)));
#if defined(__x86_64__)
__attribute__((target("ssse3")))
#endif
static void encode16_lanes(const uint8_t *pb, const uint8_t *code, uint8_t flip0, uint8_t flip1, uint8_t *ob) {
    u8x16 x, t, f, half = {0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8};
    memcpy(&x, pb, 16);
    memcpy(&t, code, 16);
    for (int i = 0; i < 16; i++) f[i] = i < 8 ? flip0 : flip1;
    const u8x16 lo = __builtin_shuffle(t, (x & 7) | half), hi = __builtin_shuffle(t, ((x >> 4) & 7) | half);
    const u8x16 o = (lo | (hi << 4) | (x & 0x88)) ^ f;
    memcpy(ob, &o, 16);
}
#endif

typedef void (*encode16_fn)(const uint8_t *, const uint8_t *, uint8_t, uint8_t, uint8_t *);

static encode16_fn pick_encode16(void) {
#if defined(ENCODE16_VECTOR) && defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("ssse3") ? encode16_lanes : encode16_bytes;
#elif defined(ENCODE16_VECTOR)
    return encode16_lanes;
#else
    return encode16_bytes;
#endif
}

/* Tests: blocks [0, n) (16 input bytes, 16 codes and two flips each) through both encoders; the first
 * block whose bytes differ, -1 if none (-2 where there is no lane encoder). */
int64_t mxfp4conv_encode16_agree(int64_t n, const uint8_t *packed, const uint8_t *codes, const uint8_t *flips) {
#if defined(ENCODE16_VECTOR)
    if (pick_encode16() != encode16_lanes) return -2;
    for (int64_t j = 0; j < n; j++) {
        uint8_t a[16], b[16];
        encode16_bytes(packed + 16 * j, codes + 16 * j, flips[2 * j], flips[2 * j + 1], a);
        encode16_lanes(packed + 16 * j, codes + 16 * j, flips[2 * j], flips[2 * j + 1], b);
        if (memcmp(a, b, 16)) return j;
    }
    return -1;
#else
    (void)n; (void)packed; (void)codes; (void)flips;
    return -2;
#endif
}

/* rows [r0, r1): packed u8 [R, kh], s u8 [R, kh/8] (E4M3 bit patterns, decoded through e4m3, the
 * 256 values as f32: the decode runs here, in the worker threads, not serially before them), g f32 [R];
 * out u8 [R, kh], scales_out u8 [R, kh/16], row_stats f64 [R, 5]. rule: 0 FLOOR 1 EVEN 2 RCEIL 3 MSE. */
MULTIVERSION int mxfp4conv_requant_rows(const uint8_t *packed, const uint8_t *s, const float *e4m3, const float *g,
                           int64_t r0, int64_t r1, int64_t kh, int divisor, int rule, uint8_t *out,
                           uint8_t *scales_out, double *row_stats) {
    const int64_t nb = kh / 16;
    const encode16_fn encode16 = pick_encode16();
    for (int64_t row = r0; row < r1; row++) {
        const float gv = g[row];
        const float ga = fabsf(gv);
        const int gneg = signbit(gv) != 0;
        /* Row sums in 8 lanes: block j into lane j % 8, the lanes added in order at the end. */
        double lsq[8] = {0, 0, 0, 0, 0, 0, 0, 0}, lsig[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        double rmx = 0.0, rclip = 0.0, rexact = 0.0;
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *pb = packed + row * kh + j * 16;
            uint8_t *ob = out + row * kh + j * 16;
            const uint8_t *sb = s + row * (kh / 8) + 2 * j;
            const float sv[2] = {e4m3[sb[0]], e4m3[sb[1]]};
            /* The table: |x| of magnitude m in half h at t = h * 8 + m (non-decreasing in m). */
            float at[16], p[16];
            for (int t = 0; t < 16; t++) p[t] = POS8[t & 7] * fabsf(sv[t >> 3]);
            if (divisor)
                for (int t = 0; t < 16; t++) at[t] = p[t] / ga;
            else
                for (int t = 0; t < 16; t++) at[t] = p[t] * ga;
            uint32_t ab[16];
            memcpy(ab, at, sizeof ab);
            /* Element counts per entry: 8 counters of 8 bits per half (at most 16 each). */
            uint64_t c8[2] = {0, 0};
            for (int i = 0; i < 16; i++) {
                const unsigned b = pb[i];
                c8[i >> 3] += (1ull << ((b & 7) * 8)) + (1ull << (((b >> 4) & 7) * 8));
            }
            uint8_t cnt[16];
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            /* byte m of c8[h] is the count of magnitude m; joined in a register: two 8-byte stores
             * read back by one 16-byte load would stall */
            const u64x2 cv = {c8[0], c8[1]};
            memcpy(cnt, &cv, sizeof cnt);
#elif defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            memcpy(cnt, c8, sizeof cnt);
#else
            for (int t = 0; t < 16; t++) cnt[t] = (uint8_t)(c8[t >> 3] >> (8 * (t & 7)));
#endif
            float n[16], pm[16];
            for (int t = 0; t < 16; t++) n[t] = (float)cnt[t];
            for (int t = 0; t < 16; t++) pm[t] = cnt[t] ? 1.0f : 0.0f;
            /* amax: the top occurring magnitude of each half (c8 != 0: 16 elements per half). */
            const float top0 = at[(63 - __builtin_clzll(c8[0])) >> 3];
            const float top1 = at[8 + ((63 - __builtin_clzll(c8[1])) >> 3)];
            const float amax = top0 > top1 ? top0 : top1;
            float qa[16], ra[16], da[16], qb[16], rb[16], db[16];
            const float *qt = qa, *rt = ra, *dt = da; /* the chosen candidate's tables */
            int e;
            if (rule == 3) {
                const int zero = amax == 0.0f;
                const int er = zero ? 0 : rceil_exp(amax);
                const int ea = zero ? 0 : clamp_e(er), eb = zero ? 0 : clamp_e(er - 1);
                cand(at, ab, ea, qa, ra, da);
                cand(at, ab, eb, qb, rb, db);
                const int pick = eb != ea && mse_lower(qb, ra, rb, n);
                e = pick ? eb : ea;
                if (pick) {
                    qt = qb;
                    rt = rb;
                    dt = db;
                }
            } else {
                e = scale_exp(amax, rule);
                cand(at, ab, e, qa, ra, da);
            }
            float err, sig;
            fold32(dt, qt, n, &err, &sig);
            const float mx = present_max(dt, pm);
            const double s4 = pow2d(2 * e);
            uint32_t rbits[16];
            memcpy(rbits, rt, sizeof rbits);
            uint8_t code[16];
            for (int t = 0; t < 16; t++) code[t] = CODE_LUT[rbits[t] >> 22];
            const uint8_t flip0 = ((signbit(sv[0]) != 0) ^ gneg) ? 0x88 : 0;
            const uint8_t flip1 = ((signbit(sv[1]) != 0) ^ gneg) ? 0x88 : 0;
            encode16(pb, code, flip0, flip1, ob);
            scales_out[row * nb + j] = (uint8_t)(e + 127);
            rclip += amax > six_pow2f(e);
            rexact += mx == 0.0f;
            lsq[j & 7] += (double)err * s4;
            lsig[j & 7] += (double)sig * s4;
            const double mxd = (double)mx * pow2d(e);
            rmx = mxd > rmx ? mxd : rmx;
        }
        double rsq = 0.0, rsig = 0.0;
        for (int t = 0; t < 8; t++) {
            rsq += lsq[t];
            rsig += lsig[t];
        }
        double *st = row_stats + row * 5;
        st[0] = rsq;
        st[1] = rsig;
        st[2] = rmx;
        st[3] = rclip;
        st[4] = rexact;
    }
    return 0;
}
