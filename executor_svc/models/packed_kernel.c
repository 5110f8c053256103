/* Weight-only quantized matmul for the CPU: out[M, N] = x[M, K] @ w[N, K]^T with x and out float32 and w kept
 * packed, de-quantized in registers one group of 32 weights at a time.
 *
 * A weight is w = (float)(q - offset) * scale + minv, scale and minv per group of 32 along K, computed with
 * two roundings (no FMA: built with -ffp-contract=off) so every weight equals gguf's de-quantized float32
 * value bit for bit; only the order of the dot products' sums differs from a de-quantized matmul.
 * bits 4: q[N, K/2] bytes, per group 16 bytes, the low nibble of byte j is element j, the high one j + 16
 *         (ggml's Q4_0 / Q4_1 block layout).
 * bits 8: q[N, K] int8.
 */
#include <stdint.h>

#define GROUP 32
#define MAX_ROWS 8

static inline void decode_group(int bits, const uint8_t *q, int offset, float scale, float minv, float *w) {
    if (bits == 4) {
        for (int j = 0; j < GROUP / 2; j++) {
            w[j] = (float)((int)(q[j] & 15) - offset) * scale + minv;
            w[j + GROUP / 2] = (float)((int)(q[j] >> 4) - offset) * scale + minv;
        }
    } else {
        const int8_t *s = (const int8_t *)q;
        for (int j = 0; j < GROUP; j++) w[j] = (float)((int)s[j] - offset) * scale + minv;
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* One group's 32 weights as two vectors of 16 (elements 0..15 and 16..31). */
static inline void decode_group_avx512(int bits, const uint8_t *q, __m512i offset, __m512 scale, __m512 minv,
                                       __m512 *w0, __m512 *w1) {
    __m512i lo, hi;
    if (bits == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(15);
        lo = _mm512_cvtepu8_epi32(_mm_and_si128(b, mask));
        hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
    } else {
        lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
        hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
    }
    *w0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, offset)), scale), minv);
    *w1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, offset)), scale), minv);
}

/* M <= MAX_ROWS rows of x; the caller de-quantizes into a scratch matrix for more. */
void packed_matmul(int bits, int offset, const uint8_t *q, const float *scale, const float *minv, int64_t n_out,
                   int64_t k, const float *x, int64_t m, float *out, int threads) {
    const int64_t groups = k / GROUP, row_bytes = k * bits / 8, group_bytes = GROUP * bits / 8;
    const __m512i voffset = _mm512_set1_epi32(offset);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < n_out; n++) {
        __m512 acc0[MAX_ROWS], acc1[MAX_ROWS], w0, w1;
        for (int64_t r = 0; r < m; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
        const uint8_t *qn = q + n * row_bytes;
        const float *sn = scale + n * groups, *mn = minv + n * groups;
        for (int64_t g = 0; g < groups; g++) {
            decode_group_avx512(bits, qn + g * group_bytes, voffset, _mm512_set1_ps(sn[g]), _mm512_set1_ps(mn[g]),
                                &w0, &w1);
            for (int64_t r = 0; r < m; r++) {
                const float *xg = x + r * k + g * GROUP;
                acc0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xg), w0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xg + 16), w1, acc1[r]);
            }
        }
        for (int64_t r = 0; r < m; r++) out[r * n_out + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
    }
}
#else
/* M <= MAX_ROWS rows of x; the caller de-quantizes into a scratch matrix for more. */
void packed_matmul(int bits, int offset, const uint8_t *q, const float *scale, const float *minv, int64_t n_out,
                   int64_t k, const float *x, int64_t m, float *out, int threads) {
    const int64_t groups = k / GROUP, row_bytes = k * bits / 8, group_bytes = GROUP * bits / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < n_out; n++) {
        /* acc[r][j]: lane j of row r's dot product; lanes are independent, so the loops vectorize. */
        float acc[MAX_ROWS][GROUP], w[GROUP];
        for (int64_t r = 0; r < m; r++)
            for (int j = 0; j < GROUP; j++) acc[r][j] = 0;
        const uint8_t *qn = q + n * row_bytes;
        for (int64_t g = 0; g < groups; g++) {
            decode_group(bits, qn + g * group_bytes, offset, scale[n * groups + g], minv[n * groups + g], w);
            for (int64_t r = 0; r < m; r++) {
                const float *xg = x + r * k + g * GROUP;
                for (int j = 0; j < GROUP; j++) acc[r][j] = __builtin_fmaf(xg[j], w[j], acc[r][j]);
            }
        }
        for (int64_t r = 0; r < m; r++) {
            float sum = 0;
            for (int j = 0; j < GROUP; j++) sum += acc[r][j];
            out[r * n_out + n] = sum;
        }
    }
}
#endif

/* Rows `rows[i]` (all N rows when rows is NULL) de-quantized into out[count, K]. */
void packed_dequantize(int bits, int offset, const uint8_t *q, const float *scale, const float *minv, int64_t k,
                       const int64_t *rows, int64_t count, float *out, int threads) {
    const int64_t groups = k / GROUP, row_bytes = k * bits / 8, group_bytes = GROUP * bits / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = rows ? rows[i] : i;
        for (int64_t g = 0; g < groups; g++)
            decode_group(bits, q + n * row_bytes + g * group_bytes, offset, scale[n * groups + g],
                         minv[n * groups + g], out + i * k + g * GROUP);
    }
}
