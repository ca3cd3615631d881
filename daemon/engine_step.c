/* engine_step.c - the phases of one step (algorithm.md, "Step t").
 *
 * the mask (all ones in warm-up and for the dense optimizers, else the lagged
 * one, waiting for its all-gather) -> pack a = G + e on the mask, summing the
 * local trainers' gradients on the way -> statistics and exact top-k of the
 * next mask for the owned tensors, from the a just packed; its all-gather
 * starts at once -> one reduction collective -> update on the mask ->
 * (sharded) all-gather of the updated values -> write them into every
 * trainer's buffer.  With defer_select a sparse step keeps only the
 * statistic at the mask's coordinates (which the update and the reduction
 * are about to overwrite) and the selection runs after the write-back, in
 * eng_step_finish.
 *
 * A dense step packs in place: the residual, kept in comm order, becomes the
 * send buffer and then holds the sums (e_stale), so no N-sized working
 * buffer exists.  A sparse step packs into `send` (K_cap floats) and gathers
 * the new parameters in `upd` (K_cap floats).  Sharded collectives run in
 * place: each rank's segment is its own part of the same buffer.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine_internal.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const plan_tensor *tensor_at(const eng_t *e, size_t j)
{
    return &e->p->t[e->p->order[j]];
}

/* G_r, the sum of the local trainers' gradients in trainer order: a
 * trainer's own buffer when it is the only one, the whole sum for topk-adamw
 * (it selects before packing), else NULL: the pack sums chunk by chunk. */
static scape_rc intake(eng_t *e, const void *const *grads, const float **g_out)
{
    *g_out = NULL;
    if (e->tr == 1 && e->gdt == KERN_F32) {
        *g_out = grads[0];
    } else if (e->g) {
        for (int j = 0; j < e->tr; j++)
            TRY(kern_grad_accum(e->g, grads[j], e->gdt, e->p->n, j == 0));
        *g_out = e->g;
    }
    return SCAPE_OK;
}

/* G_r over coordinates [off, off + len) into buf (a worker's chunk). */
static scape_rc intake_chunk(eng_t *e, const void *const *grads, size_t off, size_t len,
                             float *buf)
{
    size_t esz = kern_dtype_size(e->gdt);
    for (int j = 0; j < e->tr; j++)
        TRY(kern_grad_accum(buf, (const char *)grads[j] + off * esz, e->gdt, len, j == 0));
    return SCAPE_OK;
}

static void *worker_scratch(const eng_t *e, int w)
{
    return (char *)e->topk_scratch + (size_t)w * e->topk_scratch_bytes;
}

/* A dense step left its sums in e; the residual they stand for is zero. */
static void clean_residual(eng_t *e)
{
    if (e->e_stale) {
        memset(e->e, 0, e->p->n * sizeof *e->e);
        e->e_stale = 0;
    }
}

scape_rc eng_mask_finish(eng_t *e, double *waited)
{
    if (waited)
        *waited = 0.0;
    if (!e->mask_pending)
        return SCAPE_OK;
    double t0 = now_s();
    TRY(comm_iallgather_wait(e->comm));
    if (waited)
        *waited = now_s() - t0;
    e->mask_pending = 0;
    const plan *p = e->p;
    size_t off = 0;
    for (int r = 0; r < e->comm->size; off += e->code_bytes[r], r++) {
        if (r == e->rank)
            continue; /* its bits were selected straight into mask_next */
        const plan_shard *sh = &p->shard[r];
        scape_rc rc = mcode_decode(p, sh->first, sh->count, e->code_all + off / 4,
                                   e->code_bytes[r], e->mask_next + sh->word0, 0, r);
        if (rc != SCAPE_OK) {
            /* M_{t+1} is half written and the ranks no longer agree on it:
             * no further step may use it (outside eng_step, e.g. from a
             * checkpoint, nothing else would say so). */
            e->broken = 1;
            return rc;
        }
    }
    return SCAPE_OK;
}

/* SCAPE: finish the lagged all-gather; M_t is all ones (NULL) in warm-up. */
static scape_rc scape_mask(eng_t *e, uint64_t t)
{
    if (e->mask_pending) {
        double waited;
        TRY(eng_mask_finish(e, &waited));
        double life = now_s() - e->mask_started;
        e->last.mask_overlap = life > 0.0 ? 1.0 - waited / life : 1.0;
    }
    const uint32_t *prev = e->mask_cur;
    if (t <= e->cfg.warmup) {
        e->mask_cur = NULL;
    } else {
        e->mask_cur = e->mask_next;
        e->mask_next = e->mask_next == e->mask_buf[0] ? e->mask_buf[1] : e->mask_buf[0];
        /* this step's traffic includes the all-gather that brought its mask */
        memcpy(e->used_iag, e->next_iag, sizeof e->used_iag);
        e->last.mask_bytes = e->used_iag[1];
    }
    memset(e->next_iag, 0, sizeof e->next_iag);
    if (prev && e->mask_cur) {
        uint64_t fresh = 0, total = 0;
        for (size_t w = 0; w < e->p->nwords; w++) {
            fresh += (uint64_t)__builtin_popcount(e->mask_cur[w] & ~prev[w]);
            total += (uint64_t)__builtin_popcount(e->mask_cur[w]);
        }
        e->last.mask_churn = total ? (double)fresh / (double)total : 0.0;
    }
    return SCAPE_OK;
}

/* SCAPE: exact top-k of the statistic over the owned tensors -> M_{t+1},
 * whose all-gather starts at once and is waited for at the next step.  Runs
 * right after the pack, from the a = G + e it left in e and `send`; or,
 * deferred, after the step, from e and the statistic keep_stats took at the
 * mask's coordinates before the update changed m there. */
static scape_rc select_tensor(void *ctx, size_t i, int w)
{
    eng_t *e = ctx;
    size_t j = e->p->shard[e->rank].first + i;
    const plan_tensor *t = tensor_at(e, j);
    const uint32_t *sent = e->mask_cur ? e->mask_cur + t->word : NULL;
    const float *m = e->m + (t->pos - e->state_base);
    if (e->select_pending)
        return kern_topk_prestat(m, e->e + t->pos, sent, e->sstat + e->toff[j], t->len,
                                 e->cfg.hyper.beta1, (float)e->sel_tr, t->k,
                                 e->mask_next + t->word, worker_scratch(e, w),
                                 e->topk_scratch_bytes);
    return kern_topk_packed(m, e->e + t->pos, sent, sent ? e->send + e->toff[j] : NULL, t->len,
                            e->cfg.hyper.beta1, (float)e->tr, t->k, e->mask_next + t->word,
                            worker_scratch(e, w), e->topk_scratch_bytes);
}

static scape_rc scape_select(eng_t *e)
{
    const plan *p = e->p;
    const plan_shard *me = &p->shard[e->rank];
    TRY(pool_run(e->pool, me->count, select_tensor, e));
    /* The own bits go straight into M_{t+1}'s words (the decode rewrites them
     * the same) and the code into this rank's place of the gathered code. */
    uint32_t *own = e->code_all + e->code_off / 4;
    TRY(mcode_encode(p, me->first, me->count, e->mask_next + me->word0, own));
    const comm_stats *cs = &e->comm->stats;
    uint64_t before[3] = { cs->calls[COMM_IALLGATHER], cs->bytes[COMM_IALLGATHER],
                           cs->wire_bytes[COMM_IALLGATHER] };
    TRY(comm_iallgather(e->comm, own, e->code_all, e->code_bytes));
    e->next_iag[0] = cs->calls[COMM_IALLGATHER] - before[0];
    e->next_iag[1] = cs->bytes[COMM_IALLGATHER] - before[1];
    e->next_iag[2] = cs->wire_bytes[COMM_IALLGATHER] - before[2];
    e->mask_pending = 1;
    e->mask_started = now_s();
    return SCAPE_OK;
}

/* defer_select: the statistic at M_t's coordinates of one owned tensor,
 * while m there and the packed a still hold what the selection needs. */
static scape_rc keep_stat_tensor(void *ctx, size_t i, int w)
{
    eng_t *e = ctx;
    size_t j = e->p->shard[e->rank].first + i;
    const plan_tensor *t = tensor_at(e, j);
    (void)w;
    return kern_stat_packed(e->m + (t->pos - e->state_base), e->mask_cur + t->word,
                            e->send + e->toff[j], t->len, e->cfg.hyper.beta1, (float)e->tr,
                            e->sstat + e->toff[j]);
}

static scape_rc keep_stats(eng_t *e)
{
    TRY(pool_run(e->pool, e->p->shard[e->rank].count, keep_stat_tensor, e));
    e->sel_tr = e->tr;
    e->select_pending = 1;
    return SCAPE_OK;
}

scape_rc eng_select_pending(eng_t *e)
{
    double t0 = now_s();
    scape_rc rc = scape_select(e);
    e->select_pending = 0;
    e->last.phase_s[ENG_PH_SELECT] += now_s() - t0;
    return rc;
}

/* topk-adamw: each rank's top-k of |a_r| per tensor; the union is the mask. */
typedef struct union_ctx {
    eng_t *e;
    const float *g;
} union_ctx;

static scape_rc own_topk_tensor(void *ctx, size_t i, int w)
{
    union_ctx *u = ctx;
    eng_t *e = u->e;
    const plan_tensor *t = &e->p->t[i];
    return kern_topk_ef(NULL, u->g + t->off, e->e + t->pos, t->len, 0.0f, 1.0f, t->k,
                        e->mask_buf[1] + t->word, worker_scratch(e, w), e->topk_scratch_bytes);
}

static scape_rc topk_union_mask(eng_t *e, const float *g)
{
    const plan *p = e->p;
    clean_residual(e);
    union_ctx uc = { e, g };
    TRY(pool_run(e->pool, p->ntensors, own_topk_tensor, &uc));
    /* this rank's own mask in the spare mask buffer, the union in the other */
    uint32_t *own = e->code_all + e->code_off / 4;
    TRY(mcode_encode(p, 0, p->ntensors, e->mask_buf[1], own));
    TRY(comm_allgather(e->comm, own, e->code_all, e->code_bytes));
    e->last.mask_bytes = e->code_total;
    uint32_t *u = e->mask_buf[0];
    memset(u, 0, p->nwords * sizeof *u);
    size_t off = 0;
    for (int r = 0; r < e->comm->size; r++) {
        TRY(mcode_decode(p, 0, p->ntensors, e->code_all + off / 4, e->code_bytes[r], u, 1, r));
        off += e->code_bytes[r];
    }
    e->mask_cur = u;
    return SCAPE_OK;
}

static scape_rc count_item(void *ctx, size_t i, int w)
{
    eng_t *e = ctx;
    eng_item *it = &e->items[i];
    (void)w;
    if (!e->mask_cur) {
        it->done = it->len;
        return SCAPE_OK;
    }
    return kern_mask_popcount(e->mask_cur + tensor_at(e, it->j)->word + it->c / 32, it->len,
                              &it->done);
}

/* toff[j]: where tensor j (comm order) starts among the packed values; and
 * for each pack piece, the values of its tensor before it. */
static scape_rc tensor_offsets(eng_t *e, size_t *k_out)
{
    TRY(pool_run(e->pool, e->nitems, count_item, e));
    e->toff[0] = 0;
    size_t j = 0, before = 0; /* values of tensor j in the pieces so far */
    for (size_t i = 0; i < e->nitems; i++) {
        eng_item *it = &e->items[i];
        if (it->j != j) {
            e->toff[j + 1] = e->toff[j] + before;
            j = it->j;
            before = 0;
        }
        size_t k = it->done;
        it->done = before;
        before += k;
    }
    e->toff[j + 1] = e->toff[j] + before;
    *k_out = e->toff[e->p->ntensors];
    if (e->mask_cur && *k_out > e->k_cap)
        return scape_set_error(SCAPE_INVALID, "engine: mask of %zu values exceeds the "
                               "capacity of %zu", *k_out, e->k_cap);
    return SCAPE_OK;
}

/* Per-rank sizes of the packed segments, in units of `elem` bytes. */
static void shard_counts(eng_t *e, size_t elem)
{
    for (int r = 0; r < e->comm->size; r++) {
        const plan_shard *s = &e->p->shard[r];
        e->counts[r] = (e->toff[s->first + s->count] - e->toff[s->first]) * elem;
    }
}

typedef struct pack_ctx {
    eng_t *e;
    const float *g;
    const void *const *grads;
} pack_ctx;

/* Pack one piece: coordinates [c, c + len) of tensor j, with the gradient
 * sum read from g or summed into the worker's chunk buffer. */
static scape_rc pack_item(void *ctx, size_t i, int w)
{
    pack_ctx *pc = ctx;
    eng_t *e = pc->e;
    const eng_item *it = &e->items[i];
    const plan_tensor *t = tensor_at(e, it->j);
    const float *g = pc->g ? pc->g + t->off + it->c : NULL;
    if (g == NULL) {
        float *buf = e->gchunk + (size_t)w * e->cfg.intake_chunk;
        TRY(intake_chunk(e, pc->grads, t->off + it->c, it->len, buf));
        g = buf;
    }
    size_t k;
    if (!e->mask_cur)
        return kern_grad_accum(e->e + t->pos + it->c, g, KERN_F32, it->len, e->e_stale);
    return kern_pack_ef(g, e->e + t->pos + it->c, e->mask_cur + t->word + it->c / 32, it->len,
                        e->send + e->toff[it->j] + it->done, &k);
}

/* Pack a = G + e: in place in e when dense, into `send` on the mask.  Without
 * a whole G_r, the trainers' gradients are summed one chunk at a time. */
static scape_rc pack(eng_t *e, const float *g, const void *const *grads, float **buf)
{
    pack_ctx pc = { e, g, grads };
    TRY(pool_run(e->pool, e->nitems, pack_item, &pc));
    if (!e->mask_cur)
        e->e_stale = 1; /* e now holds a, and after the reduction the sums */
    *buf = e->mask_cur ? e->send : e->e;
    return SCAPE_OK;
}

/* The one reduction collective, in place; sharded ranks keep their segment. */
static scape_rc reduce(eng_t *e, float *buf, size_t k)
{
    e->sum = buf;
    if (e->cfg.mode == ENG_MODE_REPLICATED)
        return comm_allreduce_sum(e->comm, buf, k);
    shard_counts(e, 1);
    return comm_reduce_scatter_sum(e->comm, buf, buf + e->toff[e->p->shard[e->rank].first],
                                   e->counts);
}

/* Range of comm order this rank updates: all tensors, or its shard. */
static void update_range(const eng_t *e, size_t *first, size_t *count)
{
    if (e->cfg.mode == ENG_MODE_REPLICATED) {
        *first = 0;
        *count = e->p->ntensors;
    } else {
        *first = e->p->shard[e->rank].first;
        *count = e->p->shard[e->rank].count;
    }
}

/* Inspection: keep g_hat = S / T of the coordinates this rank reduced. */
static void keep_ghat(eng_t *e)
{
    size_t first, count;
    update_range(e, &first, &count);
    memset(e->ghave, 0, e->p->n);
    for (size_t j = first; j < first + count; j++) {
        const plan_tensor *t = tensor_at(e, j);
        const float *s = e->sum + e->toff[j];
        for (size_t i = 0, q = 0; i < t->len; i++) {
            int on = !e->mask_cur || ((e->mask_cur[t->word + i / 32] >> (i & 31)) & 1u);
            e->ghat[t->pos + i] = on ? s[q++] / (float)e->t_total : 0.0f;
            e->ghave[t->pos + i] = (unsigned char)on;
        }
    }
}

typedef struct update_ctx {
    eng_t *e;
    size_t first;
    uint64_t t;
    float lr;
    float *dst;  /* gather_updates */
} update_ctx;

static scape_rc update_tensor(void *ctx, size_t i, int w)
{
    update_ctx *u = ctx;
    eng_t *e = u->e;
    size_t j = u->first + i;
    uint64_t t_step = u->t;
    float lr = u->lr;
    (void)w;
    const plan_tensor *t = tensor_at(e, j);
    size_t s = t->pos - e->state_base;
    const float *sum = e->sum + e->toff[j];
    const uint32_t *mask = e->mask_cur ? e->mask_cur + t->word : NULL;
    float div = (float)e->t_total;
    const kern_hyper *h = &e->cfg.hyper;
    if (eng_uses_v(e))
        return mask ? kern_adamw_masked(e->theta + s, e->m + s, e->v + s, sum, div, mask,
                                        t->len, h, lr, t_step)
                    : kern_adamw_dense(e->theta + s, e->m + s, e->v + s, sum, div, t->len, h,
                                       lr, t_step);
    return mask ? kern_adams_masked(e->theta + s, e->m + s, sum, div, mask, t->len, h, lr)
                : kern_adams_dense(e->theta + s, e->m + s, sum, div, t->len, h, lr);
}

static scape_rc update(eng_t *e, uint64_t t, float lr)
{
    size_t count;
    update_ctx u = { .e = e, .t = t, .lr = lr };
    update_range(e, &u.first, &count);
    return pool_run(e->pool, count, update_tensor, &u);
}

/* The new parameters, comm order, into `dst`: packed at the mask (sparse) or
 * whole (dense); sharded ranks then all-gather their parts in place. */
static scape_rc compact_tensor(void *ctx, size_t i, int w)
{
    update_ctx *u = ctx;
    eng_t *e = u->e;
    size_t j = u->first + i, k;
    (void)w;
    const plan_tensor *t = tensor_at(e, j);
    const float *th = e->theta + (t->pos - e->state_base);
    if (e->mask_cur)
        return kern_mask_compact(th, e->mask_cur + t->word, t->len, u->dst + e->toff[j], &k);
    memcpy(u->dst + e->toff[j], th, t->len * sizeof *th);
    return SCAPE_OK;
}

static scape_rc gather_updates(eng_t *e, float *dst)
{
    size_t first, count;
    update_range(e, &first, &count);
    update_ctx u = { .e = e, .first = first, .dst = dst };
    TRY(pool_run(e->pool, count, compact_tensor, &u));
    if (e->cfg.mode == ENG_MODE_REPLICATED)
        return SCAPE_OK;
    shard_counts(e, sizeof(float));
    return comm_allgather(e->comm, dst + e->toff[first], dst, e->counts);
}

/* Every trainer's buffer receives the new values (at the mask when sparse). */
typedef struct wb_ctx {
    eng_t *e;
    const float *src;
    void *const *params;
} wb_ctx;

/* Item j * T_r + q: tensor j (comm order) into trainer q's buffer. */
static scape_rc write_back_item(void *ctx, size_t i, int w)
{
    wb_ctx *b = ctx;
    eng_t *e = b->e;
    size_t j = i / (size_t)e->tr;
    int q = (int)(i % (size_t)e->tr);
    (void)w;
    const plan_tensor *t = tensor_at(e, j);
    char *dst = (char *)b->params[q] + t->off * kern_dtype_size(e->pdt);
    const float *src = b->src + e->toff[j];
    if (e->mask_cur)
        return kern_mask_expand(src, e->mask_cur + t->word, t->len, dst, e->pdt);
    if (e->pdt == KERN_F32) {
        memcpy(dst, src, t->len * sizeof(float));
        return SCAPE_OK;
    }
    return kern_f32_to_bf16(src, (uint16_t *)(void *)dst, t->len);
}

static scape_rc write_back(eng_t *e, const float *src, void *const *params)
{
    wb_ctx b = { e, src, params };
    return pool_run(e->pool, e->p->ntensors * (size_t)e->tr, write_back_item, &b);
}

/* Where the new parameters are gathered: `upd` when sparse; when dense, the
 * master copy itself (replicated) or e, whose sums are spent (sharded). */
static float *publish_buffer(eng_t *e)
{
    if (e->mask_cur)
        return e->upd;
    return e->cfg.mode == ENG_MODE_REPLICATED ? e->theta : e->e;
}

/* Run the call and add its wall time to phase ph. */
#define PHASE(ph, call)                                                        \
    do {                                                                       \
        double t0_ = now_s();                                                  \
        scape_rc rc_ = (call);                                                 \
        e->last.phase_s[ph] += now_s() - t0_;                                  \
        if (rc_ != SCAPE_OK)                                                   \
            return rc_;                                                        \
    } while (0)

static scape_rc choose_mask(eng_t *e, uint64_t t, const float *g)
{
    int dense_opt = e->cfg.optimizer == ENG_OPT_ADAMS || e->cfg.optimizer == ENG_OPT_ADAMW;
    if (e->cfg.optimizer == ENG_OPT_SCAPE) {
        PHASE(ENG_PH_MASK_WAIT, scape_mask(e, t));
    } else if (dense_opt || t <= e->cfg.warmup) {
        e->mask_cur = NULL;
    } else {
        PHASE(ENG_PH_SELECT, topk_union_mask(e, g));
    }
    return SCAPE_OK;
}

scape_rc eng_step_body(eng_t *e, uint64_t t, float lr, const void *const *grads,
                       void *const *params)
{
    const float *g = NULL;
    float *buf = NULL, *pub;
    size_t k = 0;
    PHASE(ENG_PH_INTAKE, intake(e, grads, &g));
    TRY(choose_mask(e, t, g));
    TRY(tensor_offsets(e, &k));
    if (e->mask_cur)
        clean_residual(e);
    PHASE(ENG_PH_PACK, pack(e, g, grads, &buf));
    if (e->cfg.optimizer == ENG_OPT_SCAPE && t + 1 > e->cfg.warmup) {
        /* deferred only from a sparse step: a dense one's a is overwritten
         * by its in-place reduction */
        if (e->cfg.defer_select && e->mask_cur)
            PHASE(ENG_PH_SELECT, keep_stats(e));
        else
            PHASE(ENG_PH_SELECT, scape_select(e));
    }
    PHASE(ENG_PH_REDUCE, reduce(e, buf, k));
    if (e->ghat)
        keep_ghat(e);
    PHASE(ENG_PH_UPDATE, update(e, t, lr));
    pub = publish_buffer(e);
    if (pub != e->theta)
        PHASE(ENG_PH_GATHER, gather_updates(e, pub));
    PHASE(ENG_PH_WRITEBACK, write_back(e, pub, params));
    e->last.k = k;
    return SCAPE_OK;
}
