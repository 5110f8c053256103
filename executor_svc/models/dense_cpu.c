/* The dense decoder's layers for a CPU decode step of up to MAX_ROWS rows with packed weights, all in one call:
 * no torch op, no allocation, one parallel region for every layer (each phase an `omp for`, its barrier the
 * hand-over to the next). The same arithmetic as the torch layers (dense.py, layers.py), each op rounded as
 * torch rounds it (built with -ffp-contract=off): only the order of sums differs.
 *
 * Six barriers a layer: every thread norms the rows itself before a projection (a few hundred floats, cheaper
 * than a barrier, which stalls the whole team while a thread is descheduled), the residuals are added as o and
 * down store their sums, and SiLU(gate) * up is taken as gate_up's blocks finish. The barriers are the step's
 * own (team_wait), not OpenMP's.
 */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>

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
                      const int64_t *positions, const int32_t *write_page, const int32_t *write_offset) {
    const int64_t d = s->head_dim, heads = s->heads + s->kv_heads, b = task / heads, h = task % heads;
    float *row = qkv + b * qkv_size;
    const float *cos = s->rope_cos + positions[b] * d, *sin = s->rope_sin + positions[b] * d;
    float *head = row + h * d;
    const float *norm = h < s->heads ? layer->q_norm : layer->k_norm;
    if (norm) rms_norm(head, norm, d, s->eps, head);
    rope(head, cos, sin, d);
    if (h >= s->heads && write_page[b] != 0) { /* padding rows write nothing: the sink page's K/V never matter */
        const int64_t kv_head = h - s->heads, position_stride = s->kv_heads * d;
        const int64_t at = ((int64_t)write_page[b] * s->page_size + write_offset[b]) * position_stride + kv_head * d;
        const float *v = row + (s->heads + s->kv_heads + kv_head) * d;
        for (int64_t j = 0; j < d; j++) layer->k_pages[at + j] = head[j], layer->v_pages[at + j] = v[j];
    }
}

/* A barrier that spins briefly, then yields the core rather than sleeping. OpenMP's spins for its whole
 * spin count, then sleeps on a futex: where another program wants a core, the waiting thread burns the
 * partner's turn (two threads on two shared cores: steps 10-50x slower, measured). Yielding hands the core
 * over at once; on a quiet machine the phases meet within the spin. */
typedef struct {
    atomic_int arrived, phase;
} team_barrier_t;

#define TEAM_SPINS 256

static void team_wait(team_barrier_t *barrier, int threads) {
    const int phase = atomic_load_explicit(&barrier->phase, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&barrier->arrived, 1, memory_order_acq_rel) == threads - 1) {
        atomic_store_explicit(&barrier->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&barrier->phase, phase + 1, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&barrier->phase, memory_order_acquire) == phase; spins++) {
        if (spins >= TEAM_SPINS) {
            sched_yield();
        } else {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
    }
}

/* act[B, I] = SiLU(gate) * up with gate, up = h @ gate_up^T (its rows: I of gate, then I of up), blocks of I
 * shared out among the team (no barrier after it: the caller's). */
static void gate_up_for(const packed_t *gate_up, const float *h, int64_t batch, float *act) {
    const int64_t inter = gate_up->n / 2;
#pragma omp for schedule(static) nowait
    for (int64_t i0 = 0; i0 < inter; i0 += BLOCK) {
        const int64_t count = inter - i0 < BLOCK ? inter - i0 : BLOCK;
        float gate[MAX_ROWS * BLOCK], up[MAX_ROWS * BLOCK]; /* [batch, BLOCK] */
        packed_block(gate_up, i0, count, h, batch, gate, BLOCK, 0);
        packed_block(gate_up, inter + i0, count, h, batch, up, BLOCK, 0);
        for (int64_t b = 0; b < batch; b++)
            for (int64_t j = 0; j < count; j++) {
                const float g = gate[b * BLOCK + j];
                act[b * inter + i0 + j] = g / (1.0f + expf(-g)) * up[b * BLOCK + j];
            }
    }
}

/* x[batch, hidden] through `count` layers in place. scratch: dense_scratch_floats(shape, batch, threads) floats. */
void dense_decode_layers(const dense_shape_t *s, const dense_layer_t *layers, int64_t count, float *x, int64_t batch,
                         const int64_t *positions, const int32_t *write_page, const int32_t *write_offset,
                         const int32_t *tables, int64_t table_stride, const int32_t *lens, float *scratch,
                         int threads) {
    const int64_t hidden = s->hidden, d = s->head_dim;
    const int64_t qkv_size = (s->heads + 2 * s->kv_heads) * d;
    float *qkv = scratch;                          /* qkv: [B, (H + 2 KVH) D] */
    float *attn = qkv + batch * qkv_size;          /* attn: [B, H D] */
    float *act = attn + batch * s->heads * d;      /* act: [B, I] */
    float *normed = act + batch * s->intermediate; /* normed: [threads, B, hidden], each thread's own */
    team_barrier_t barrier = {0, 0};
#pragma omp parallel num_threads(threads)
    {
        const int team = omp_get_num_threads();
        float *h = normed + omp_get_thread_num() * batch * hidden;
        for (int64_t l = 0; l < count; l++) {
            const dense_layer_t *layer = layers + l;
            for (int64_t b = 0; b < batch; b++) rms_norm(x + b * hidden, layer->input_norm, hidden, s->eps, h + b * hidden);
            packed_rows_for(&layer->qkv, h, batch, qkv, 0);
            team_wait(&barrier, team);
#pragma omp for schedule(static) nowait
            for (int64_t task = 0; task < batch * (s->heads + s->kv_heads); task++)
                qkv_heads(s, layer, qkv, qkv_size, task, positions, write_page, write_offset);
            team_wait(&barrier, team);
#pragma omp for schedule(static) nowait
            for (int64_t task = 0; task < batch * s->heads; task++)
                paged_decode_task(task, qkv, qkv_size, layer->k_pages, layer->v_pages, tables, table_stride, lens,
                                  s->heads, s->kv_heads, d, s->page_size, s->scale, attn);
            team_wait(&barrier, team);
            packed_rows_for(&layer->o, attn, batch, x, 1);
            team_wait(&barrier, team);
            for (int64_t b = 0; b < batch; b++) rms_norm(x + b * hidden, layer->post_norm, hidden, s->eps, h + b * hidden);
            gate_up_for(&layer->gate_up, h, batch, act);
            team_wait(&barrier, team);
            packed_rows_for(&layer->down, act, batch, x, 1);
            team_wait(&barrier, team);
        }
    }
}

int64_t dense_scratch_floats(const dense_shape_t *s, int64_t batch, int threads) {
    return batch * ((2 * s->heads + 2 * s->kv_heads) * s->head_dim + s->intermediate + threads * s->hidden);
}
