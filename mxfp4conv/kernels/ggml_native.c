/* GGML MXFP4 blocks <-> OCP MXFP4 rows (mxfp4conv/formats/ggml.py has the definition and the torch path).
 *
 * A GGML block is the E8M0 byte, then 16 bytes: byte j = element j (low nibble) | element j + 16 (high).
 * An OCP row holds element 2k in the low nibble of byte k, 2k + 1 in the high one, scales apart.
 * With SSE2 (every x86-64) a block is one 16-byte load, two unpacks and one store; elsewhere a scalar loop.
 */
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* Rows (o, i) for o < n_outer, i < n_inner: the source row starts at packed + o * p_outer + i * p_inner
 * (16 * nb bytes) and scales + o * s_outer + i * s_inner (nb bytes); output rows are contiguous. */
void mxfp4conv_ocp_to_ggml(const uint8_t *packed, int64_t p_outer, int64_t p_inner, const uint8_t *scales,
                           int64_t s_outer, int64_t s_inner, uint8_t *out, int64_t n_outer, int64_t n_inner,
                           int64_t nb) {
    for (int64_t o = 0; o < n_outer; o++) {
        for (int64_t i = 0; i < n_inner; i++) {
            const uint8_t *p = packed + o * p_outer + i * p_inner;
            const uint8_t *s = scales + o * s_outer + i * s_inner;
            uint8_t *d = out + (o * n_inner + i) * nb * 17;
            for (int64_t b = 0; b < nb; b++, p += 16, d += 17) {
                d[0] = s[b];
#ifdef __SSE2__
                const __m128i m = _mm_set1_epi8(0x0F);
                __m128i v = _mm_loadu_si128((const __m128i *)p);
                __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
                __m128i e0 = _mm_unpacklo_epi8(lo, hi); /* elements 0..15 */
                __m128i e1 = _mm_unpackhi_epi8(lo, hi); /* elements 16..31 */
                _mm_storeu_si128((__m128i *)(d + 1), _mm_or_si128(e0, _mm_slli_epi16(e1, 4)));
#else
                for (int k = 0; k < 8; k++) {
                    d[1 + 2 * k] = (uint8_t)((p[k] & 0x0F) | ((p[8 + k] & 0x0F) << 4));
                    d[2 + 2 * k] = (uint8_t)((p[k] >> 4) | (p[8 + k] & 0xF0));
                }
#endif
            }
        }
    }
}

/* One block's 16 code bytes (after its scale byte) -> its 16 OCP bytes. */
static inline void decode_block(const uint8_t *q, uint8_t *packed) {
#ifdef __SSE2__
    const __m128i m = _mm_set1_epi8(0x0F), low = _mm_set1_epi16(0x00FF);
    __m128i g = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_and_si128(g, m), hi = _mm_and_si128(_mm_srli_epi16(g, 4), m); /* elements j, j + 16 */
    /* 16-bit lane k holds elements 2k (low byte) and 2k + 1 (high byte): pack them into one byte */
    __m128i a = _mm_and_si128(_mm_or_si128(lo, _mm_srli_epi16(lo, 4)), low);
    __m128i c = _mm_and_si128(_mm_or_si128(hi, _mm_srli_epi16(hi, 4)), low);
    _mm_storeu_si128((__m128i *)packed, _mm_packus_epi16(a, c));
#else
    for (int k = 0; k < 8; k++) {
        packed[k] = (uint8_t)((q[2 * k] & 0x0F) | ((q[2 * k + 1] & 0x0F) << 4));
        packed[8 + k] = (uint8_t)((q[2 * k] >> 4) | (q[2 * k + 1] & 0xF0));
    }
#endif
}

/* n_blocks contiguous blocks -> contiguous OCP codes (16 bytes a block) and scales (one byte a block). */
void mxfp4conv_ggml_to_ocp(const uint8_t *blocks, uint8_t *packed, uint8_t *scales, int64_t n_blocks) {
    for (int64_t b = 0; b < n_blocks; b++, blocks += 17, packed += 16) {
        scales[b] = blocks[0];
        decode_block(blocks + 1, packed);
    }
}

/* The first row (o * n_inner + i) whose GGML blocks do not decode to the OCP row (codes and scales, strided
 * as in mxfp4conv_ocp_to_ggml), or -1: the proof's decode and comparison in one pass, with no buffer. */
int64_t mxfp4conv_ggml_differs(const uint8_t *blocks, const uint8_t *packed, int64_t p_outer, int64_t p_inner,
                               const uint8_t *scales, int64_t s_outer, int64_t s_inner, int64_t n_outer,
                               int64_t n_inner, int64_t nb) {
    uint8_t row[16];
    for (int64_t o = 0; o < n_outer; o++) {
        for (int64_t i = 0; i < n_inner; i++) {
            const uint8_t *p = packed + o * p_outer + i * p_inner;
            const uint8_t *s = scales + o * s_outer + i * s_inner;
            const uint8_t *g = blocks + (o * n_inner + i) * nb * 17;
            for (int64_t b = 0; b < nb; b++, p += 16, g += 17) {
                decode_block(g + 1, row);
                if (g[0] != s[b] || memcmp(row, p, 16) != 0) {
                    return o * n_inner + i;
                }
            }
        }
    }
    return -1;
}
