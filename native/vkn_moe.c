/* fp32 EXL3 linear and fused MoE MLP on top of the raw tile GEMV, threaded with pthreads. */
#define _POSIX_C_SOURCE 200112L /* pthreads under strict -std=c99 */
#include "vkn_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- Hadamard (spec 5, exact fp32 order) */

static void fwht128(float *v)
{
    for (int w = 1; w < 128; w <<= 1)
        for (int b = 0; b < 128; b += 2 * w)
            for (int i = b; i < b + w; i++) {
                float a = v[i], c = v[i + w];
                v[i] = a + c;
                v[i + w] = a - c;
            }
}

/* dst = FWHT(src ⊙ s)·r per 128-block (s may be NULL). */
static void had_in_f32(const float *src, const float *s, float *dst, int len)
{
    for (int b = 0; b < len; b += 128) {
        float *v = dst + b;
        for (int i = 0; i < 128; i++) v[i] = s ? src[b + i] * s[b + i] : src[b + i];
        fwht128(v);
        for (int i = 0; i < 128; i++) v[i] *= VKN_HAD_SCALE;
    }
}

/* v = FWHT(v)·r ⊙ svh + bias, in place. */
static void had_out_f32(float *v, const float *svh, const float *bias, int len)
{
    for (int b = 0; b < len; b += 128) {
        fwht128(v + b);
        for (int i = 0; i < 128; i++) {
            float y = (v[b + i] * VKN_HAD_SCALE) * svh[b + i];
            v[b + i] = bias ? y + bias[b + i] : y;
        }
    }
}

/* ---------------------------------------------------------------- threads */

typedef void (*item_fn)(void *ctx, int item);
typedef struct {
    item_fn fn;
    void *ctx;
    int nitems;
    volatile int next;
} pool_job;

static void *pool_worker(void *arg)
{
    pool_job *job = (pool_job *)arg;
    for (;;) {
        /* Dynamic hand-out: items differ in cost (experts have different row counts); results do not
           depend on which thread ran an item, so the output stays deterministic. */
        int it = __sync_fetch_and_add(&job->next, 1);
        if (it >= job->nitems) break;
        job->fn(job->ctx, it);
    }
    return NULL;
}

static void parallel_for(int nitems, item_fn fn, void *ctx, int threads)
{
    pool_job job = {fn, ctx, nitems, 0};
    if (threads > nitems) threads = nitems;
    if (threads <= 1) { pool_worker(&job); return; }
    pthread_t tid[256];
    if (threads > 256) threads = 256;
    int started = 0;
    for (int t = 1; t < threads; t++)
        if (pthread_create(&tid[started], NULL, pool_worker, &job) == 0) started++;
    pool_worker(&job);
    for (int t = 0; t < started; t++) pthread_join(tid[t], NULL);
}

/* ---------------------------------------------------------------- linear */

#define COLS_PER_ITEM 4 /* 64 output columns per work item */

typedef struct {
    const vkn_tensor *T;
    const float *X;
    float *Y;
    int m, isa;
} linear_ctx;

static void linear_item(void *p, int item)
{
    linear_ctx *c = (linear_ctx *)p;
    int nt = c->T->n / 16;
    int j0 = item * COLS_PER_ITEM, j1 = j0 + COLS_PER_ITEM < nt ? j0 + COLS_PER_ITEM : nt;
    vkn_gemv_cols(c->T, c->X, c->m, c->Y, j0, j1, c->isa);
}

int vkn_linear(const vkn_tensor *t, const float *x, int m, float *y, int threads)
{
    vkn_init_tables();
    if (m <= 0) return 0;
    float *xh = (float *)malloc(sizeof(float) * (size_t)m * t->k);
    if (!xh) return -1;
    for (int r = 0; r < m; r++) had_in_f32(x + (size_t)r * t->k, t->suh, xh + (size_t)r * t->k, t->k);
    linear_ctx c = {t, xh, y, m, vkn_isa_active()};
    int nt = t->n / 16;
    parallel_for((nt + COLS_PER_ITEM - 1) / COLS_PER_ITEM, linear_item, &c, threads);
    for (int r = 0; r < m; r++) had_out_f32(y + (size_t)r * t->n, t->svh, t->bias, t->n);
    free(xh);
    return 0;
}

/* ---------------------------------------------------------------- MoE */

typedef struct {
    const vkn_tensor *proj[3]; /* gate (or NULL), up, down */
    int E, H, I, isa, act;
    float limit;
    const int *expert_start, *expert_count; /* rows of expert e: [start, start + count) */
    const int *active;                      /* experts with rows */
    int nactive;
    float *xin[2];  /* gate/up inputs after had_in (R x H) */
    float *mid[2];  /* gate/up raw, then outputs (R x I); mid[1] becomes the down input */
    float *dout;    /* down raw (R x H) */
    int items_per_expert;
    int gated;
} moe_ctx;

/* Gate/up work item: (active expert, projection, column chunk of I). */
static void moe_gateup_item(void *p, int item)
{
    moe_ctx *c = (moe_ctx *)p;
    int nproj = c->gated ? 2 : 1;
    int chunks = (c->I / 16 + COLS_PER_ITEM - 1) / COLS_PER_ITEM;
    int ch = item % chunks, rest = item / chunks;
    int pj = rest % nproj, a = rest / nproj;
    int e = c->active[a], which = c->gated ? pj : 1;
    const vkn_tensor *T = &c->proj[which][e];
    int r0 = c->expert_start[e], nr = c->expert_count[e];
    int j0 = ch * COLS_PER_ITEM, j1 = j0 + COLS_PER_ITEM < c->I / 16 ? j0 + COLS_PER_ITEM : c->I / 16;
    vkn_gemv_cols(T, c->xin[which] + (size_t)r0 * c->H, nr, c->mid[which] + (size_t)r0 * c->I, j0, j1, c->isa);
}

static void moe_down_item(void *p, int item)
{
    moe_ctx *c = (moe_ctx *)p;
    int chunks = (c->H / 16 + COLS_PER_ITEM - 1) / COLS_PER_ITEM;
    int ch = item % chunks, a = item / chunks;
    int e = c->active[a];
    const vkn_tensor *T = &c->proj[2][e];
    int r0 = c->expert_start[e], nr = c->expert_count[e];
    int j0 = ch * COLS_PER_ITEM, j1 = j0 + COLS_PER_ITEM < c->H / 16 ? j0 + COLS_PER_ITEM : c->H / 16;
    vkn_gemv_cols(T, c->mid[1] + (size_t)r0 * c->I, nr, c->dout + (size_t)r0 * c->H, j0, j1, c->isa);
}

/* min / max / clamp written so that a NaN operand comes out NaN, as numpy's np.minimum / np.maximum / np.clip
 * give it (the reference's act_limit and relu2): a comparison with NaN is false, so each keeps its operand. */
static float act_product(float g, float u, int act, float L)
{
    float a;
    if (act == VKN_ACT_SWIGLU_OAI) {
        if (L != 0.0f) {
            g = g > L ? L : g;
            u = u < -L ? -L : (u > L ? L : u);
        }
        return (u + 1.0f) * g / (1.0f + expf(-1.702f * g));
    }
    if (act == VKN_ACT_SILU) a = g / (1.0f + expf(-g));
    else if (act == VKN_ACT_GELU) a = 0.5f * g * (1.0f + tanhf(0.797884560803f * (g + 0.044715f * g * g * g)));
    else if (act == VKN_ACT_GELU_ERF) a = 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
    else a = (u > 0.0f || u != u) ? u : 0.0f; /* relu2: relu(u)·u (a -0.0 becomes +0.0, as before) */
    if (L != 0.0f) {
        a = a > L ? L : a;
        u = u < -L ? -L : (u > L ? L : u);
    }
    return a * u;
}

int vkn_moe(const vkn_tensor *gate, const vkn_tensor *up, const vkn_tensor *down, int E, int m, int topk,
            const float *hidden, const int64_t *ids, const float *weights, int act, float act_limit, float *out,
            int threads)
{
    vkn_init_tables();
    const int H = up[0].k, I = up[0].n;
    memset(out, 0, sizeof(float) * (size_t)m * H);
    int nslots = m * topk;
    int *count = (int *)calloc((size_t)E, sizeof(int));
    int *start = (int *)calloc((size_t)E, sizeof(int));
    int *active = (int *)calloc((size_t)E, sizeof(int));
    int *slot_row = (int *)malloc(sizeof(int) * (size_t)(nslots > 0 ? nslots : 1));
    int *fill = (int *)calloc((size_t)E, sizeof(int));
    if (!count || !start || !active || !slot_row || !fill) goto oom0;
    for (int s = 0; s < nslots; s++)
        if (ids[s] >= 0 && ids[s] < E) count[ids[s]]++;
    int R = 0, nactive = 0;
    for (int e = 0; e < E; e++) {
        start[e] = R;
        R += count[e];
        if (count[e]) active[nactive++] = e;
    }
    for (int s = 0; s < nslots; s++) {
        int64_t e = ids[s];
        slot_row[s] = (e >= 0 && e < E) ? start[e] + fill[e]++ : -1;
    }
    if (R == 0) goto done;
    size_t szH = (size_t)R * H, szI = (size_t)R * I;
    float *buf = (float *)malloc(sizeof(float) * (3 * szH + 2 * szI));
    if (!buf) goto oom0;
    moe_ctx c;
    memset(&c, 0, sizeof c);
    c.proj[0] = gate; c.proj[1] = up; c.proj[2] = down;
    c.E = E; c.H = H; c.I = I; c.isa = vkn_isa_active(); c.act = act; c.limit = act_limit;
    c.expert_start = start; c.expert_count = count; c.active = active; c.nactive = nactive;
    c.xin[0] = buf; c.xin[1] = buf + szH; c.dout = buf + 2 * szH;
    c.mid[0] = buf + 3 * szH; c.mid[1] = buf + 3 * szH + szI;
    c.gated = gate != NULL;

    /* Stage 1: gather + input Hadamard per row. */
    for (int s = 0; s < nslots; s++) {
        int r = slot_row[s];
        if (r < 0) continue;
        int e = (int)ids[s];
        const float *x = hidden + (size_t)(s / topk) * H;
        if (gate) had_in_f32(x, gate[e].suh, c.xin[0] + (size_t)r * H, H);
        had_in_f32(x, up[e].suh, c.xin[1] + (size_t)r * H, H);
    }
    /* Stage 2: gate/up GEMV. */
    int chunksI = (I / 16 + COLS_PER_ITEM - 1) / COLS_PER_ITEM;
    parallel_for(nactive * chunksI * (gate ? 2 : 1), moe_gateup_item, &c, threads);
    /* Stage 3: output transforms, activation, down input transform (in place in mid[1]). */
    for (int s = 0; s < nslots; s++) {
        int r = slot_row[s];
        if (r < 0) continue;
        int e = (int)ids[s];
        float *u = c.mid[1] + (size_t)r * I, *g = c.mid[0] + (size_t)r * I;
        had_out_f32(u, up[e].svh, up[e].bias, I);
        if (gate) had_out_f32(g, gate[e].svh, gate[e].bias, I);
        for (int i = 0; i < I; i++) u[i] = act_product(gate ? g[i] : 0.0f, u[i], act, act_limit);
        had_in_f32(u, down[e].suh, u, I);
    }
    /* Stage 4: down GEMV. */
    int chunksH = (H / 16 + COLS_PER_ITEM - 1) / COLS_PER_ITEM;
    parallel_for(nactive * chunksH, moe_down_item, &c, threads);
    /* Stage 5: output transform and routing-weighted sum, slots in order (deterministic). */
    for (int s = 0; s < nslots; s++) {
        int r = slot_row[s];
        if (r < 0) continue;
        int e = (int)ids[s];
        float *d = c.dout + (size_t)r * H, w = weights[s];
        float *o = out + (size_t)(s / topk) * H;
        had_out_f32(d, down[e].svh, down[e].bias, H);
        for (int i = 0; i < H; i++) o[i] += w * d[i];
    }
    free(buf);
done:
    free(count); free(start); free(active); free(slot_row); free(fill);
    return 0;
oom0:
    free(count); free(start); free(active); free(slot_row); free(fill);
    return -1;
}
