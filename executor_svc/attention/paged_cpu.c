/* The CPU's decode attention, read in place off the KV pages through each row's block table (no gathered copy
 * of the pages): one query per row and head over the row's first lens[b] positions, softmax(scale * q.k) @ v,
 * kept online page by page (a running maximum and sum, the accumulator rescaled when the maximum grows).
 *
 * q[B, H, D] with rows q_row_stride floats apart (a view into the fused QKV projection), heads D apart;
 * k, v: one layer's [pages, page_size, kv_heads, D]; tables: int32 [B, table_stride] page ids;
 * out: [B, H, D] contiguous. Query head h reads KV head h / (H / kv_heads) (grouped-query attention).
 *
 * Included by models/dense_cpu.c, whose decode layers share the tasks out in their own parallel region.
 */
#include <math.h>
#include <stdint.h>

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
        for (int64_t t = 0; t < n; t++) {
            const float p = expf(score[t] - running_max), *vt = vp + t * position_stride;
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
