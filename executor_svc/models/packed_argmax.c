/* The greedy token of a packed 8-bit head without computing every logit: argmax_n (x @ w^T)[n] for one row x, the
 * very index the argmax of packed_matmul's logits takes (ties to the lowest n), for w = q * scale with q int8
 * (gguf's Q8_0) and no minimums, offset or bias.
 *
 * A first pass takes every logit cheaply from x rounded to 8 bits per group of 32 (x_j ~ s * r_j, |r_j| <= 127,
 * s = max |x| / 127 over the group): integer dot products, with a bound on how far each can be from the float
 * logit packed_matmul computes: |sum_j q_j d (x_j - s r_j)| <= d * s / 2 * sum_j |q_j| per group, the groups'
 * sums of |q| made once (packed_group_l1). Only the rows whose interval reaches the best lower end can be the
 * argmax; those few (at most 28 of SmolLM2's 49,152 over 240 positions of its own text) are computed in full by
 * packed_block, the same arithmetic as packed_matmul, so the answer is its argmax bit for bit.
 *
 * One row only: the first pass reads the head's bytes as the float path does with fewer vector ops a weight
 * (AVX-512 VNNI; plain C elsewhere), while for more rows the float path shares each weight's de-quantization
 * among them and is the faster.
 */
#include <float.h>
#include <math.h>
#include <omp.h>

#include "packed_kernel.c"

#define MAX_THREADS 256 /* more: the caller takes the full logits */

/* Every group's sum of |q| into l1[N, K / GROUP]; -1 (nothing promised) where some q is -128, whose negation the
 * first pass cannot hold in 8 bits. */
int packed_group_l1(const int8_t *q, int64_t n, int64_t k, uint16_t *l1, int threads) {
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : bad)
    for (int64_t i = 0; i < n * (k / GROUP); i++) {
        int sum = 0;
        for (int j = 0; j < GROUP; j++) {
            bad |= q[i * GROUP + j] == -128;
            sum += abs(q[i * GROUP + j]);
        }
        l1[i] = (uint16_t)sum;
    }
    return bad ? -1 : 0;
}

/* Row r of x as magnitudes mag[K] (uint8), sign masks neg[pairs of groups] (bit j: element j of the pair is
 * negative) and per-group steps s[K / GROUP]; 0 where the row is not all finite. */
static int round_row(const float *x, int64_t k, uint8_t *mag, uint64_t *neg, float *s) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        float amax = 0;
        for (int j = 0; j < GROUP; j++) {
            if (!isfinite(x[g * GROUP + j])) return 0;
            amax = fmaxf(amax, fabsf(x[g * GROUP + j]));
        }
        s[g] = amax / 127;
        if (g % 2 == 0) neg[g / 2] = 0;
        for (int j = 0; j < GROUP; j++) {
            const float v = s[g] > 0 ? nearbyintf(x[g * GROUP + j] / s[g]) : 0;
            mag[g * GROUP + j] = (uint8_t)fminf(fabsf(v), 127);
            neg[g / 2] |= (uint64_t)(v < 0) << (g % 2 * GROUP + j);
        }
    }
    return 1;
}

/* Row n's logit from row r of x rounded (sum over groups of scale * s * the integer dot of q and the rounded x)
 * into *logit, and sum over groups of |scale| * s * l1 into *bound; scale and l1 as float32. */
static void approx_logit(const int8_t *q, const float *scale, const float *l1, const uint8_t *mag, const uint64_t *neg,
                         const float *s, int64_t k, float *logit, float *bound) {
    const int64_t groups = k / GROUP;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    /* Two groups a vector: lanes 0-7 hold the first's partial dots, 8-15 the second's. q takes x's signs, so the
     * unsigned-by-signed product of vpdpbusd sees |x|. */
    float step[groups + 1];
    __m512 bounds = _mm512_setzero_ps(), acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 in = groups - g >= 16 ? 0xffff : (__mmask16)((1u << (groups - g)) - 1);
        const __m512 vs = _mm512_maskz_loadu_ps(in, s + g), vscale = _mm512_maskz_loadu_ps(in, scale + g);
        _mm512_mask_storeu_ps(step + g, in, _mm512_mul_ps(vscale, vs));
        bounds = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_abs_ps(vscale), _mm512_maskz_loadu_ps(in, l1 + g)), vs, bounds);
    }
    step[groups] = 0; /* the second group of an odd count's last pair */
    for (int64_t g = 0; g < groups; g += 2) {
        const __mmask64 in = groups - g >= 2 ? ~0ull : 0xffffffffull;
        const __m512i qv = _mm512_maskz_loadu_epi8(in, q + g * GROUP);
        const __m512i signed_q = _mm512_mask_sub_epi8(qv, neg[g / 2], _mm512_setzero_si512(), qv);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_maskz_loadu_epi8(in, mag + g * GROUP),
                                                signed_q);
        const __m512 pair = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(step[g]), _mm512_set1_ps(step[g + 1]));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), pair, acc);
    }
    *logit = _mm512_reduce_add_ps(acc), *bound = _mm512_reduce_add_ps(bounds);
#else
    float sum = 0, bounds = 0;
    for (int64_t g = 0; g < groups; g++) {
        int32_t dot = 0;
        for (int j = 0; j < GROUP; j++) {
            const int32_t v = mag[g * GROUP + j];
            dot += q[g * GROUP + j] * ((neg[g / 2] >> (g % 2 * GROUP + j) & 1) ? -v : v);
        }
        sum += (float)dot * (scale[g] * s[g]);
        bounds += fabsf(scale[g]) * l1[g] * s[g];
    }
    *logit = sum, *bound = bounds;
#endif
}

/* The argmax for one row x[K] into *token; 0, or -1 where x is not finite or a bound is not (the caller takes the
 * full logits then). l1 from packed_group_l1; work: float32 scratch of 2 * pairs of groups + groups + N + K / 4. */
int packed_argmax(int half, const int8_t *q, const void *scale, const uint16_t *l1, int64_t n, int64_t k,
                  const float *x, float *work, int64_t *token, int threads) {
    const int64_t groups = k / GROUP, pairs = (groups + 1) / 2;
    if (threads > MAX_THREADS) return -1;
    uint64_t *neg = (uint64_t *)work;           /* [pairs]: work is 8-byte aligned */
    float *steps = (float *)(neg + pairs);      /* [groups] */
    float *high = steps + groups;               /* [N]: each logit's upper end */
    uint8_t *mag = (uint8_t *)(high + n);       /* [K] */
    if (!round_row(x, k, mag, neg, steps)) return -1;
    /* The bound's slack over d * s / 2 * sum |q|: the roundings of x / s, of both passes' float sums and of the
     * bound itself, each at most about (sums) * 2^-24 of 127 times the bound. */
    const float slack = 0.5f + 1e-4f + (float)(3 * groups + 64) * 127 * 0x1p-23f, floor_abs = (float)k * FLT_MIN;
    float lows[MAX_THREADS], best[MAX_THREADS];
    int64_t found[MAX_THREADS];
    int failed = 0;
    const packed_t w = {8, 0, half, (const uint8_t *)q, scale, 0, 0, n, k};
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        float row_scale[groups], row_l1[groups], low = -INFINITY, top = -INFINITY;
        int64_t at = -1;
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < n; i++) {
            for (int64_t g = 0; g < groups; g++)
                row_scale[g] = scalar_at(scale, half, i * groups + g), row_l1[g] = l1[i * groups + g];
            float a, bound;
            approx_logit(q + i * k, row_scale, row_l1, mag, neg, steps, k, &a, &bound);
            const float e = slack * bound + 1e-6f * fabsf(a) + floor_abs;
            failed |= !isfinite(a) || !isfinite(e);
            high[i] = a + e;
            low = a - e > low ? a - e : low;
        }
        lows[t] = low; /* once, not each row: the threads' entries share a cache line */
#pragma omp barrier
        for (int u = 0; u < team; u++) low = lows[u] > low ? lows[u] : low;
        /* Only rows whose upper end reaches the best lower end can hold the largest logit. */
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < n; i++) {
            if (high[i] < low) continue;
            float logit;
            packed_block(&w, i, 1, x, 1, &logit, 1, 0);
            if (logit > top || at < 0) top = logit, at = i;
        }
        best[t] = top, found[t] = at;
#pragma omp barrier
#pragma omp single
        {
            /* Threads hold rising ranges of n, so the first of equal bests is the lowest n. */
            *token = -1;
            for (int u = 0; u < team; u++)
                if (found[u] >= 0 && (*token < 0 || best[u] > top)) top = best[u], *token = found[u];
            failed |= *token < 0;
        }
    }
    return failed ? -1 : 0;
}
