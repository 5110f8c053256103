/* The dense decoder's layers for a CPU decode step of up to MAX_ROWS rows with packed weights, all in one call:
 * no torch op, no allocation, one parallel region for every layer (each phase an `omp for`, its barrier the
 * hand-over to the next). The same arithmetic as the torch layers (dense.py, layers.py), each op rounded as
 * torch rounds it (built with -ffp-contract=off): only the order of sums differs.
 */
#include <math.h>

#include "../attention/paged_cpu.c"
#include "packed_kernel.c"

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim], NULL without q/k head norms (Qwen3 has them) */
    packed_t qkv, o, gate_up, down;      /* qkv rows: q heads, k heads, v heads; gate_up rows: gate, up */
    float *k_pages, *v_pages;            /* the layer's [pages, page_size, kv_heads, head_dim] */
} dense_layer_t;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, page_size;
    float eps, scale;
    const float *rope_cos, *rope_sin; /* [max_seq_len, head_dim] */
} dense_shape_t;

/* out = w * (x * rsqrt(mean(x^2) + eps)), as layers.RMSNorm: the mean a sum divided by n, rsqrt 1 / sqrt. */
static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float inverse = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inverse);
}

/* x[D] rotated in place, as layers.apply_rope: x * cos + rotate_half(x) * sin. */
static void rope(float *x, const float *cos, const float *sin, int64_t d) {
    const int64_t half = d / 2;
    float rotated[d];
    for (int64_t j = 0; j < half; j++) rotated[j] = -x[j + half], rotated[j + half] = x[j];
    for (int64_t j = 0; j < d; j++) x[j] = x[j] * cos[j] + rotated[j] * sin[j];
}

/* The q and k heads of row b normed (where the model has head norms) and rotated; its k and v heads written to
 * their page. Task: one head of one row, q heads first, then the kv heads. */
static void qkv_heads(const dense_shape_t *s, const dense_layer_t *layer, float *qkv, int64_t qkv_size, int64_t task,
                      const int64_t *positions, const int64_t *write_page, const int64_t *write_offset) {
    const int64_t d = s->head_dim, heads = s->heads + s->kv_heads, b = task / heads, h = task % heads;
    float *row = qkv + b * qkv_size;
    const float *cos = s->rope_cos + positions[b] * d, *sin = s->rope_sin + positions[b] * d;
    float *head = row + h * d;
    const float *norm = h < s->heads ? layer->q_norm : layer->k_norm;
    if (norm) rms_norm(head, norm, d, s->eps, head);
    rope(head, cos, sin, d);
    if (h >= s->heads) {
        const int64_t kv_head = h - s->heads, position_stride = s->kv_heads * d;
        const int64_t at = (write_page[b] * s->page_size + write_offset[b]) * position_stride + kv_head * d;
        const float *v = row + (s->heads + s->kv_heads + kv_head) * d;
        for (int64_t j = 0; j < d; j++) layer->k_pages[at + j] = head[j], layer->v_pages[at + j] = v[j];
    }
}

/* x[batch, hidden] through `count` layers in place. scratch: dense_scratch_floats(shape, batch) floats. */
void dense_decode_layers(const dense_shape_t *s, const dense_layer_t *layers, int64_t count, float *x, int64_t batch,
                         const int64_t *positions, const int64_t *write_page, const int64_t *write_offset,
                         const int32_t *tables, int64_t table_stride, const int32_t *lens, float *scratch,
                         int threads) {
    const int64_t hidden = s->hidden, d = s->head_dim, inter = s->intermediate;
    const int64_t qkv_size = (s->heads + 2 * s->kv_heads) * d;
    float *h = scratch;                     /* h: [B, hidden], the normed input of a projection */
    float *qkv = h + batch * hidden;        /* qkv: [B, (H + 2 KVH) D] */
    float *attn = qkv + batch * qkv_size;   /* attn: [B, H D] */
    float *gate_up = attn + batch * s->heads * d; /* gate_up: [B, 2 I] */
    float *act = gate_up + batch * 2 * inter;     /* act: [B, I] */
    float *proj = act + batch * inter;            /* proj: [B, hidden], o's and down's output */
#pragma omp parallel num_threads(threads)
    for (int64_t l = 0; l < count; l++) {
        const dense_layer_t *layer = layers + l;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; b++) rms_norm(x + b * hidden, layer->input_norm, hidden, s->eps, h + b * hidden);
        packed_rows_for(&layer->qkv, h, batch, qkv);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < batch * (s->heads + s->kv_heads); task++)
            qkv_heads(s, layer, qkv, qkv_size, task, positions, write_page, write_offset);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < batch * s->heads; task++)
            paged_decode_task(task, qkv, qkv_size, layer->k_pages, layer->v_pages, tables, table_stride, lens,
                              s->heads, s->kv_heads, d, s->page_size, s->scale, attn);
        packed_rows_for(&layer->o, attn, batch, proj);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t i = 0; i < hidden; i++) x[b * hidden + i] += proj[b * hidden + i];
            rms_norm(x + b * hidden, layer->post_norm, hidden, s->eps, h + b * hidden);
        }
        packed_rows_for(&layer->gate_up, h, batch, gate_up);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t i = 0; i < inter; i++) {
                const float g = gate_up[b * 2 * inter + i];
                act[b * inter + i] = g / (1.0f + expf(-g)) * gate_up[b * 2 * inter + inter + i];
            }
        packed_rows_for(&layer->down, act, batch, proj);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t i = 0; i < hidden; i++) x[b * hidden + i] += proj[b * hidden + i];
    }
}

int64_t dense_scratch_floats(const dense_shape_t *s, int64_t batch) {
    return batch * (2 * s->hidden + (2 * s->heads + 2 * s->kv_heads) * s->head_dim + 3 * s->intermediate);
}
