/* Weight-only quantized matmul for the CPU: out[M, N] = x[M, K] @ w[N, K]^T (+ bias) with x and out float32 and w
 * kept packed, de-quantized in registers one group of 32 weights at a time.
 *
 * A weight is w = (float)(q - offset) * scale + minv, scale and minv per group of 32 along K, computed with
 * two roundings (no FMA: built with -ffp-contract=off) so every weight equals gguf's de-quantized float32
 * value bit for bit; only the order of the dot products' sums differs from a de-quantized matmul.
 * bits 4: q[N, K/2] bytes, per group 16 bytes, the low nibble of byte j is element j, the high one j + 16
 *         (ggml's Q4_0 / Q4_1 block layout).
 * bits 8: q[N, K] int8.
 *
 * Included by dense_cpu.c, whose decode layers call packed_block inside their own parallel region.
 */
#include <stdint.h>

#define GROUP 32
#define MAX_ROWS 8

typedef struct {
    int32_t bits, offset, half;
    const uint8_t *q;
    const void *scale, *minv; /* [N, K / GROUP], float32 or (half) float16; minv NULL: all zero */
    const float *bias;        /* [N] or NULL */
    int64_t n, k;
} packed_t;

#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, mantissa = h & 1023;
    union {
        uint32_t u;
        float f;
    } out;
    if (exponent == 31) /* infinity, NaN */
        out.u = sign | 0x7f800000u | (mantissa << 13);
    else if (exponent) /* normal */
        out.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else { /* zero, subnormal: mantissa * 2^-24, exact in float32 */
        out.f = (float)mantissa * 0x1p-24f;
        out.u |= sign;
    }
    return out.f;
}
#endif

/* Element i of a float32 or (half) float16 array. */
static inline float scalar_at(const void *p, int half, int64_t i) {
    return half ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Group g of row n's 32 weights into w. */
static inline void decode_group(const packed_t *p, int64_t n, int64_t g, float *w) {
    const int64_t at = n * (p->k / GROUP) + g;
    const uint8_t *q = p->q + (n * p->k + g * GROUP) * p->bits / 8;
    const float scale = scalar_at(p->scale, p->half, at);
    float v[GROUP];
    if (p->bits == 4) {
        for (int j = 0; j < GROUP / 2; j++) {
            v[j] = (float)((int)(q[j] & 15) - p->offset);
            v[j + GROUP / 2] = (float)((int)(q[j] >> 4) - p->offset);
        }
    } else {
        for (int j = 0; j < GROUP; j++) v[j] = (float)((int)((const int8_t *)q)[j] - p->offset);
    }
    if (p->minv) {
        const float minv = scalar_at(p->minv, p->half, at);
        for (int j = 0; j < GROUP; j++) w[j] = v[j] * scale + minv;
    } else {
        for (int j = 0; j < GROUP; j++) w[j] = v[j] * scale;
    }
}

/* Output rows come in blocks of this many: a block shares every load of x. */
#define BLOCK 4

#if defined(__AVX512F__)
#include <immintrin.h>

/* One group's 32 weights as two vectors of 16 (elements 0..15 and 16..31). 4 bits: the 16 values a weight of
 * the group can take, rounded as above, are made once and looked up by the nibble (vpermps reads the low 4 bits
 * of each index lane, so the bytes need no mask). minv NULL: no minimums. */
static inline __attribute__((always_inline)) void group_weights(const int bits, const uint8_t *q, __m512 levels,
                                                                __m512i offset, const float *scale,
                                                                const float *minv, __m512 *w0, __m512 *w1) {
    const __m512 vscale = _mm512_set1_ps(*scale);
    if (bits == 4) {
        __m512 table = _mm512_mul_ps(levels, vscale);
        if (minv) table = _mm512_add_ps(table, _mm512_set1_ps(*minv));
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        *w0 = _mm512_permutexvar_ps(bytes, table);
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    } else {
        const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
        const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, offset)), vscale);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, offset)), vscale);
        if (minv) {
            const __m512 vminv = _mm512_set1_ps(*minv);
            *w0 = _mm512_add_ps(*w0, vminv), *w1 = _mm512_add_ps(*w1, vminv);
        }
    }
}

/* Row n's scales (or minimums) as float32: the array's own row, or its float16 row converted into buf. */
static inline const float *row_floats(const void *p, int half, int64_t n, int64_t groups, float *buf) {
    if (!half) return (const float *)p + n * groups;
    const uint16_t *h = (const uint16_t *)p + n * groups;
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16) _mm512_storeu_ps(buf + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + g))));
    for (; g < groups; g++) buf[g] = half_to_float(h[g]);
    return buf;
}

/* Output rows [n0, n0 + NB) for M rows of x (stride k) into out[r * out_stride + j], j < NB (out points at column
 * n0), added to what out holds where `add` (a residual). BITS, M and NB are constants at every call, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_fixed(const int BITS, const int M, const int NB,
                                                              const packed_t *w, int64_t n0, const float *x,
                                                              float *out, int64_t out_stride, int add) {
    const int64_t k = w->k, groups = k / GROUP, row_bytes = k * BITS / 8, group_bytes = GROUP * BITS / 8;
    const __m512i offset = _mm512_set1_epi32(w->offset);
    const __m512 levels = _mm512_sub_ps(
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps((float)w->offset));
    float scale_buf[NB][groups], minv_buf[NB][groups];
    const float *scale[NB], *minv[NB];
    for (int j = 0; j < NB; j++) {
        scale[j] = row_floats(w->scale, w->half, n0 + j, groups, scale_buf[j]);
        minv[j] = w->minv ? row_floats(w->minv, w->half, n0 + j, groups, minv_buf[j]) : 0;
    }
    __m512 acc[NB][M], w0[NB], w1[NB];
    for (int j = 0; j < NB; j++)
        for (int r = 0; r < M; r++) acc[j][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        /* 8 bits: the rows two blocks on, a cache line at a time (the head's 576-byte rows, step 1.7 ms with it, 2.3
         * without). Not for 4 bits: the hardware's stream prefetch keeps up with the layers' 288-byte rows, and
         * these instructions in its way cost the 30 layers' matmuls a fifth (bench/cpu_decode_step.py). */
        if (BITS == 8 && g * group_bytes % 64 == 0)
            for (int j = 0; j < NB; j++) {
                const int64_t ahead = n0 + j + 2 * NB < w->n ? n0 + j + 2 * NB : w->n - 1; /* inside the array */
                __builtin_prefetch(w->q + ahead * row_bytes + g * group_bytes);
            }
        for (int j = 0; j < NB; j++)
            group_weights(BITS, w->q + (n0 + j) * row_bytes + g * group_bytes, levels, offset, scale[j] + g,
                          minv[j] ? minv[j] + g : 0, &w0[j], &w1[j]);
        for (int r = 0; r < M; r++) {
            const __m512 x0 = _mm512_loadu_ps(x + r * k + g * GROUP), x1 = _mm512_loadu_ps(x + r * k + g * GROUP + 16);
            for (int j = 0; j < NB; j++) acc[j][r] = _mm512_fmadd_ps(x1, w1[j], _mm512_fmadd_ps(x0, w0[j], acc[j][r]));
        }
    }
    for (int j = 0; j < NB; j++) {
        const float bias = w->bias ? w->bias[n0 + j] : 0.0f;
        for (int r = 0; r < M; r++) {
            const float sum = _mm512_reduce_add_ps(acc[j][r]), value = w->bias ? sum + bias : sum;
            out[r * out_stride + j] = add ? out[r * out_stride + j] + value : value;
        }
    }
}

#define ROWS_CASES(BITS, NB, START)                                                                              \
    switch (m) {                                                                                                 \
    case 1: block_fixed(BITS, 1, NB, w, START, x, out + START - n0, out_stride, add); break;                                \
    case 2: block_fixed(BITS, 2, NB, w, START, x, out + START - n0, out_stride, add); break;                                \
    case 3: block_fixed(BITS, 3, NB, w, START, x, out + START - n0, out_stride, add); break;                                \
    case 4: block_fixed(BITS, 4, NB, w, START, x, out + START - n0, out_stride, add); break;                                \
    case 5: block_fixed(BITS, 5, NB, w, START, x, out + START - n0, out_stride, add); break;                                \
    case 6: block_fixed(BITS, 6, NB, w, START, x, out + START - n0, out_stride, add); break;                                \
    case 7: block_fixed(BITS, 7, NB, w, START, x, out + START - n0, out_stride, add); break;                                \
    case 8: block_fixed(BITS, 8, NB, w, START, x, out + START - n0, out_stride, add); break;                                \
    default: __builtin_trap(); /* packed_block takes 1 <= m <= MAX_ROWS */                                        \
    }

/* Output rows [n0, n0 + count) with count <= BLOCK, for m <= MAX_ROWS rows of x, into out[r * out_stride + j]
 * (out points at column n0), added to what it holds where `add`. */
static void packed_block(const packed_t *w, int64_t n0, int64_t count, const float *x, int64_t m, float *out,
                         int64_t out_stride, int add) {
    if (m <= 0) return;
    if (count == BLOCK && m <= 4) {
        if (w->bits == 4) { ROWS_CASES(4, BLOCK, n0) } else { ROWS_CASES(8, BLOCK, n0) }
        return;
    }
    /* More rows of x than the registers hold for a whole block, or the last rows of N: two or one at a time. */
    int64_t n = n0;
    for (; n + 2 <= n0 + count; n += 2)
        if (w->bits == 4) { ROWS_CASES(4, 2, n) } else { ROWS_CASES(8, 2, n) }
    if (n < n0 + count) {
        if (w->bits == 4) { ROWS_CASES(4, 1, n) } else { ROWS_CASES(8, 1, n) }
    }
}
#else
/* Output rows [n0, n0 + count) for m <= MAX_ROWS rows of x, as the AVX-512 packed_block. */
static void packed_block(const packed_t *w, int64_t n0, int64_t count, const float *x, int64_t m, float *out,
                         int64_t out_stride, int add) {
    const int64_t k = w->k, groups = k / GROUP;
    for (int64_t n = n0; n < n0 + count; n++) {
        /* acc[r][j]: lane j of row r's dot product; lanes are independent, so the loops vectorize. */
        float acc[MAX_ROWS][GROUP], wg[GROUP];
        for (int64_t r = 0; r < m; r++)
            for (int j = 0; j < GROUP; j++) acc[r][j] = 0;
        for (int64_t g = 0; g < groups; g++) {
            decode_group(w, n, g, wg);
            for (int64_t r = 0; r < m; r++) {
                const float *xg = x + r * k + g * GROUP;
                /* a multiply and an add: without hardware FMA, fmaf would be a libm call an element */
                for (int j = 0; j < GROUP; j++) acc[r][j] += xg[j] * wg[j];
            }
        }
        for (int64_t r = 0; r < m; r++) {
            float sum = 0;
            for (int j = 0; j < GROUP; j++) sum += acc[r][j];
            const float value = w->bias ? sum + w->bias[n] : sum;
            out[r * out_stride + n - n0] = add ? out[r * out_stride + n - n0] + value : value;
        }
    }
}
#endif

/* out[m, N] (= or += where `add`) x @ w^T, the blocks of N shared out among the threads of the enclosing parallel
 * region (an orphaned `omp for`, no barrier after it: the caller's): call it from every thread of a region. */
static void packed_rows_for(const packed_t *w, const float *x, int64_t m, float *out, int add) {
#pragma omp for schedule(static) nowait
    for (int64_t n0 = 0; n0 < w->n; n0 += BLOCK)
        packed_block(w, n0, w->n - n0 < BLOCK ? w->n - n0 : BLOCK, x, m, out + n0, w->n, add);
}

/* M <= MAX_ROWS rows of x; the caller de-quantizes into a scratch matrix for more. */
void packed_matmul(int bits, int offset, int half, const uint8_t *q, const void *scale, const void *minv,
                   int64_t n_out, int64_t k, const float *x, int64_t m, float *out, int threads) {
    const packed_t w = {bits, offset, half, q, scale, minv, 0, n_out, k};
#pragma omp parallel num_threads(threads)
    packed_rows_for(&w, x, m, out, 0);
}

/* Rows `rows[i]` (all N rows when rows is NULL) de-quantized into out[count, K]. */
void packed_dequantize(int bits, int offset, int half, const uint8_t *q, const void *scale, const void *minv,
                       int64_t k, const int64_t *rows, int64_t count, float *out, int threads) {
    const packed_t w = {bits, offset, half, q, scale, minv, 0, 0, k};
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < count; i++)
        for (int64_t g = 0; g < k / GROUP; g++) decode_group(&w, rows ? rows[i] : i, g, out + i * k + g * GROUP);
}
