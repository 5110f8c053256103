/* The CPU's decode attention, read in place off the KV pages through each row's block table (no gathered copy
 * of the pages): one query per row and head over the row's first lens[b] positions, softmax(scale * q.k) @ v,
 * kept online page by page (a running maximum and sum, the accumulator rescaled when the maximum grows).
 *
 * q[B, H, D] with rows q_row_stride floats apart (a view into the fused QKV projection), heads D apart;
 * k, v: one layer's [pages, page_size, kv_heads, D]; tables: int32 [B, table_stride] page ids;
 * out: [B, H, D] contiguous. Query head h reads KV head h / (H / kv_heads) (grouped-query attention).
 *
 * On AVX-512 head dims 64 and 128 (SmolLM2's, Qwen's) take head_fixed: the query and the accumulator held in
 * registers, the exps sixteen at a time; the loop after it serves every other head dim and machine. The same
 * sums, rounded in another order.
 *
 * Included by models/dense_cpu.c, whose decode layers share the tasks out in their own parallel region.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp(x) of 16 lanes of x <= 0: Cephes' expf (a degree-6 polynomial of the remainder after n = round(x log2 e),
 * scaled by 2^n), within 2 ulp of expf. Below -87.3 it gives exp(-87.3) ~ 1e-38 instead of a subnormal or 0:
 * nothing a softmax's sum of at least 1 can tell apart. A NaN stays NaN (max returns its second operand then),
 * as expf's did, so a broken query or key shows in the output. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* score[t] = exp(score[t] - shift) for t < n, sixteen at a time (a scalar expf a position took a quarter of
 * head_fixed's time over 540 positions). */
static void exp_shifted(float *score, int64_t n, float shift) {
    const __m512 by = _mm512_set1_ps(shift);
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 lanes = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, score + t), by);
        _mm512_mask_storeu_ps(score + t, lanes, exp16(x));
    }
}
#else
static void exp_shifted(float *score, int64_t n, float shift) {
    for (int64_t t = 0; t < n; t++) score[t] = expf(score[t] - shift);
}
#endif

#if defined(__AVX512F__)
/* One query head qh[16 * DV] over `length` positions of its KV head (k, v point at the head's first position
 * of page 0) into out: the query and the accumulator held in registers across the positions. DV is a
 * constant at each call (head_dim 64 or 128). */
static inline __attribute__((always_inline)) void head_fixed(const int DV, const float *qh, const float *k,
                                                             const float *v, const int32_t *table, int64_t length,
                                                             int64_t position_stride, int64_t page_size,
                                                             float scale, float *out) {
    const int64_t page_stride = page_size * position_stride;
    __m512 q[DV], acc[DV];
    for (int i = 0; i < DV; i++) q[i] = _mm512_loadu_ps(qh + 16 * i), acc[i] = _mm512_setzero_ps();
    float score[page_size];
    float running_max = -INFINITY, sum = 0;
    for (int64_t start = 0; start < length; start += page_size) {
        const int64_t n = length - start < page_size ? length - start : page_size;
        const float *kp = k + table[start / page_size] * page_stride, *vp = v + table[start / page_size] * page_stride;
        float page_max = -INFINITY;
        for (int64_t t = 0; t < n; t++) {
            const float *kt = kp + t * position_stride;
            __m512 dot = _mm512_mul_ps(q[0], _mm512_loadu_ps(kt));
            for (int i = 1; i < DV; i++) dot = _mm512_fmadd_ps(q[i], _mm512_loadu_ps(kt + 16 * i), dot);
            score[t] = _mm512_reduce_add_ps(dot) * scale;
            page_max = score[t] > page_max ? score[t] : page_max;
        }
        if (page_max > running_max) { /* rescale what was summed under the old maximum */
            const float correction = expf(running_max - page_max);
            sum *= correction;
            for (int i = 0; i < DV; i++) acc[i] = _mm512_mul_ps(acc[i], _mm512_set1_ps(correction));
            running_max = page_max;
        }
        exp_shifted(score, n, running_max);
        for (int64_t t = 0; t < n; t++) {
            const __m512 p = _mm512_set1_ps(score[t]);
            const float *vt = vp + t * position_stride;
            sum += score[t];
            for (int i = 0; i < DV; i++) acc[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 16 * i), acc[i]);
        }
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / sum);
    for (int i = 0; i < DV; i++) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(acc[i], inverse));
}
#endif

/* Query head `task % heads` of row `task / heads` into out[task * D ..]. */
static void paged_decode_task(int64_t task, const float *q, int64_t q_row_stride, const float *k, const float *v,
                              const int32_t *tables, int64_t table_stride, const int32_t *lens, int64_t heads,
                              int64_t kv_heads, int64_t head_dim, int64_t page_size, float scale, float *out) {
    const int64_t group = heads / kv_heads, position_stride = kv_heads * head_dim;
    const int64_t page_stride = page_size * position_stride;
    const int64_t b = task / heads, h = task % heads, length = lens[b];
    const float *qh = q + b * q_row_stride + h * head_dim;
    const int64_t head_offset = (h / group) * head_dim;
    float *acc = out + task * head_dim;
#if defined(__AVX512F__)
    if (head_dim == 64 || head_dim == 128) { /* SmolLM2's and Qwen's */
        const int32_t *table = tables + b * table_stride;
        if (head_dim == 64)
            head_fixed(4, qh, k + head_offset, v + head_offset, table, length, position_stride, page_size, scale, acc);
        else
            head_fixed(8, qh, k + head_offset, v + head_offset, table, length, position_stride, page_size, scale, acc);
        return;
    }
#endif
    float score[page_size];
    float running_max = -INFINITY, sum = 0;
    for (int64_t j = 0; j < head_dim; j++) acc[j] = 0;
    for (int64_t start = 0; start < length; start += page_size) {
        const int64_t n = length - start < page_size ? length - start : page_size;
        const int64_t page = tables[b * table_stride + start / page_size];
        const float *kp = k + page * page_stride + head_offset, *vp = v + page * page_stride + head_offset;
        float page_max = -INFINITY;
        for (int64_t t = 0; t < n; t++) {
            const float *kt = kp + t * position_stride;
            float dot = 0;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < head_dim; j++) dot += qh[j] * kt[j];
            score[t] = dot * scale;
            page_max = score[t] > page_max ? score[t] : page_max;
        }
        if (page_max > running_max) { /* rescale what was summed under the old maximum */
            const float correction = expf(running_max - page_max);
            sum *= correction;
            for (int64_t j = 0; j < head_dim; j++) acc[j] *= correction;
            running_max = page_max;
        }
        exp_shifted(score, n, running_max);
        for (int64_t t = 0; t < n; t++) {
            const float p = score[t], *vt = vp + t * position_stride;
            sum += p;
#pragma omp simd
            for (int64_t j = 0; j < head_dim; j++) acc[j] += p * vt[j];
        }
    }
    const float inverse = 1.0f / sum;
    for (int64_t j = 0; j < head_dim; j++) acc[j] *= inverse;
}

void paged_decode_attention(const float *q, int64_t q_row_stride, const float *k, const float *v,
                            const int32_t *tables, int64_t table_stride, const int32_t *lens, int64_t batch,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t page_size, float scale,
                            float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < batch * heads; task++)
        paged_decode_task(task, q, q_row_stride, k, v, tables, table_stride, lens, heads, kv_heads, head_dim,
                          page_size, scale, out);
}
