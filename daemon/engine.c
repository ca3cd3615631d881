/* engine.c - one rank's optimizer step (algorithm.md, "Step t").
 *
 * Per step: intake (sum the local trainers' gradients) -> pick the mask
 * (all ones in warm-up, else the lagged one, waiting for its all-gather) ->
 * statistics and top-k of the next mask for the owned tensors, whose
 * all-gather starts at once -> pack a = G + e on the mask and keep the rest
 * in e -> one reduction collective -> update on the mask -> (sharded) gather
 * the updated values -> write them into every trainer's buffer.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine_internal.h"

#define ENG_MAX_TRAINERS 1024

#define TRY(call)                                                              \
    do {                                                                       \
        scape_rc rc_ = (call);                                                 \
        if (rc_ != SCAPE_OK)                                                   \
            return rc_;                                                        \
    } while (0)

static const char *const s_opt_names[ENG_OPT_COUNT] = {
    [ENG_OPT_SCAPE] = "scape", [ENG_OPT_ADAMS] = "adams",
    [ENG_OPT_ADAMW] = "adamw", [ENG_OPT_TOPK_ADAMW] = "topk-adamw",
};
static const char *const s_mode_names[ENG_MODE_COUNT] = {
    [ENG_MODE_REPLICATED] = "replicated", [ENG_MODE_SHARDED] = "sharded",
};

void eng_config_default(eng_config *cfg)
{
    cfg->optimizer = ENG_OPT_SCAPE;
    cfg->mode = ENG_MODE_REPLICATED;
    cfg->rho = 0.01;
    cfg->warmup = 1;
    cfg->hyper = (kern_hyper){ .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .wd = 0.0f };
}

const char *eng_optimizer_name(eng_optimizer opt)
{
    return (unsigned)opt < ENG_OPT_COUNT ? s_opt_names[opt] : "?";
}

const char *eng_mode_name(eng_mode mode)
{
    return (unsigned)mode < ENG_MODE_COUNT ? s_mode_names[mode] : "?";
}

scape_rc eng_optimizer_parse(const char *s, eng_optimizer *out)
{
    for (int i = 0; s && out && i < ENG_OPT_COUNT; i++)
        if (strcmp(s, s_opt_names[i]) == 0) {
            *out = (eng_optimizer)i;
            return SCAPE_OK;
        }
    return scape_set_error(SCAPE_INVALID,
                           "unknown optimizer '%s' (scape, adams, adamw, topk-adamw)",
                           s ? s : "(null)");
}

scape_rc eng_mode_parse(const char *s, eng_mode *out)
{
    for (int i = 0; s && out && i < ENG_MODE_COUNT; i++)
        if (strcmp(s, s_mode_names[i]) == 0) {
            *out = (eng_mode)i;
            return SCAPE_OK;
        }
    return scape_set_error(SCAPE_INVALID, "unknown mode '%s' (replicated, sharded)",
                           s ? s : "(null)");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- creation ----------------------------------------------------------- */

static scape_rc check_config(const eng_config *c)
{
    if ((unsigned)c->optimizer >= ENG_OPT_COUNT)
        return scape_set_error(SCAPE_INVALID, "config: unknown optimizer %d", (int)c->optimizer);
    if ((unsigned)c->mode >= ENG_MODE_COUNT)
        return scape_set_error(SCAPE_INVALID, "config: unknown mode %d", (int)c->mode);
    if (!(c->rho > 0.0 && c->rho <= 1.0))
        return scape_set_error(SCAPE_INVALID, "config: rho=%g must be in (0, 1]", c->rho);
    if (c->warmup < 1)
        return scape_set_error(SCAPE_INVALID, "config: warmup must be >= 1");
    const kern_hyper *h = &c->hyper;
    if (!(h->beta1 >= 0.0f && h->beta1 < 1.0f) || !(h->beta2 >= 0.0f && h->beta2 < 1.0f))
        return scape_set_error(SCAPE_INVALID, "config: beta1=%g beta2=%g must be in [0, 1)",
                               (double)h->beta1, (double)h->beta2);
    if (!(h->eps > 0.0f) || !(h->wd >= 0.0f) || !isfinite(h->wd))
        return scape_set_error(SCAPE_INVALID, "config: eps=%g must be > 0, wd=%g >= 0",
                               (double)h->eps, (double)h->wd);
    return SCAPE_OK;
}

static uint64_t config_hash(const eng_config *c)
{
    double f[] = { (double)c->optimizer, (double)c->mode, c->rho, (double)c->warmup,
                   (double)c->hyper.beta1, (double)c->hyper.beta2,
                   (double)c->hyper.eps, (double)c->hyper.wd };
    uint64_t h = 0xcbf29ce484222325ull;
    const unsigned char *b = (const unsigned char *)f;
    for (size_t i = 0; i < sizeof f; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static int uses_v(const eng_t *e)
{
    return e->cfg.optimizer == ENG_OPT_ADAMW || e->cfg.optimizer == ENG_OPT_TOPK_ADAMW;
}

static scape_rc alloc_state(eng_t *e)
{
    const plan *p = e->p;
    size_t n = p->n, w = p->nwords, R = (size_t)e->comm->size;
    const plan_shard *me = &p->shard[e->rank];
    int sharded = e->cfg.mode == ENG_MODE_SHARDED;
    int topk = e->cfg.optimizer == ENG_OPT_TOPK_ADAMW;

    e->state_base = sharded ? me->pos0 : 0;
    e->state_len = sharded ? me->len : n;
    size_t sl = e->state_len ? e->state_len : 1;
    e->m = calloc(sl, sizeof(float));
    e->v = uses_v(e) ? calloc(sl, sizeof(float)) : NULL;
    e->theta = calloc(sl, sizeof(float));
    e->e = calloc(n, sizeof(float));
    e->g = (e->tr > 1 || e->gdt != KERN_F32) ? calloc(n, sizeof(float)) : NULL;
    e->send = calloc(n, sizeof(float));
    e->recv = sharded ? calloc(sl, sizeof(float)) : NULL;
    e->upd = calloc(n, sizeof(float));
    e->upd_own = sharded ? calloc(sl, sizeof(float)) : NULL;
    e->stat = calloc(p->max_len, sizeof(float));
    e->topk_scratch_bytes = kern_topk_scratch_bytes(p->max_len);
    e->topk_scratch = malloc(e->topk_scratch_bytes);
    e->ones = calloc(w, sizeof(uint32_t));
    e->mask_buf[0] = calloc(w, sizeof(uint32_t));
    e->mask_buf[1] = calloc(w, sizeof(uint32_t));
    e->own_bits = calloc(topk ? w : (me->words ? me->words : 1), sizeof(uint32_t));
    e->gathered = topk ? calloc(w * R, sizeof(uint32_t)) : NULL;
    e->prefix = calloc(w + 1, sizeof(uint32_t));
    e->counts = calloc(R, sizeof(size_t));
    if (!e->m || (uses_v(e) && !e->v) || !e->theta || !e->e ||
        ((e->tr > 1 || e->gdt != KERN_F32) && !e->g) || !e->send ||
        (sharded && (!e->recv || !e->upd_own)) || !e->upd || !e->stat ||
        !e->topk_scratch || !e->ones || !e->mask_buf[0] || !e->mask_buf[1] ||
        !e->own_bits || (topk && !e->gathered) || !e->prefix || !e->counts)
        return scape_set_error(SCAPE_NOMEM, "engine: cannot allocate state for N=%zu", n);

    for (size_t i = 0; i < p->ntensors; i++) {
        const plan_tensor *t = &p->t[i];
        memset(e->ones + t->word, 0xff, (t->len / 32) * sizeof(uint32_t));
        if (t->len & 31)
            e->ones[t->word + t->len / 32] = (1u << (t->len & 31)) - 1u;
    }
    e->mask_cur = e->ones;
    e->mask_next = e->mask_buf[0];
    return SCAPE_OK;
}

/* Exchange T_r and the hashes of config and layout; all ranks must agree. */
static scape_rc handshake(eng_t *e)
{
    e->t_total = 0;
    int R = e->comm->size;
    uint64_t mine[3] = { (uint64_t)e->tr, e->p->hash, config_hash(&e->cfg) };
    uint64_t *all = calloc((size_t)R * 3, sizeof *all);
    if (all == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    for (int r = 0; r < R; r++)
        e->counts[r] = sizeof mine;
    scape_rc rc = comm_allgather(e->comm, mine, all, e->counts);
    for (int r = 0; rc == SCAPE_OK && r < R; r++) {
        if (all[3 * r + 1] != mine[1])
            rc = scape_set_error(SCAPE_INVALID,
                                 "engine: rank %d registered a different layout than rank %d",
                                 r, e->rank);
        else if (all[3 * r + 2] != mine[2])
            rc = scape_set_error(SCAPE_INVALID,
                                 "engine: rank %d has a different optimizer config than rank %d",
                                 r, e->rank);
        e->t_total += (int)all[3 * r];
    }
    free(all);
    return rc;
}

scape_rc eng_create(eng_t **out, const eng_config *cfg, const eng_layout *layout,
                    comm_t *comm, int local_trainers)
{
    if (out == NULL || cfg == NULL || layout == NULL || comm == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_create: NULL argument");
    *out = NULL;
    TRY(check_config(cfg));
    if (local_trainers < 1 || local_trainers > ENG_MAX_TRAINERS)
        return scape_set_error(SCAPE_INVALID, "eng_create: local_trainers=%d not in [1, %d]",
                               local_trainers, ENG_MAX_TRAINERS);
    if ((layout->param_dtype != KERN_F32 && layout->param_dtype != KERN_BF16) ||
        (layout->grad_dtype != KERN_F32 && layout->grad_dtype != KERN_BF16))
        return scape_set_error(SCAPE_INVALID, "eng_create: unknown dtype");
    eng_t *e = calloc(1, sizeof *e);
    if (e == NULL)
        return scape_set_error(SCAPE_NOMEM, "eng_create: out of memory");
    e->cfg = *cfg;
    e->comm = comm;
    e->rank = comm->rank;
    e->tr = local_trainers;
    e->pdt = layout->param_dtype;
    e->gdt = layout->grad_dtype;
    scape_rc rc = plan_build(&e->p, layout->tensors, layout->ntensors, comm->size, cfg->rho);
    if (rc == SCAPE_OK)
        rc = alloc_state(e);
    if (rc == SCAPE_OK)
        rc = handshake(e);
    if (rc != SCAPE_OK) {
        eng_destroy(&e);
        return rc;
    }
    *out = e;
    return SCAPE_OK;
}

void eng_destroy(eng_t **ep)
{
    if (ep == NULL || *ep == NULL)
        return;
    eng_t *e = *ep;
    if (e->mask_pending && !e->broken)
        comm_iallgather_wait(e->comm);
    plan_destroy(&e->p);
    void *bufs[] = { e->m, e->v, e->theta, e->e, e->g, e->send, e->recv, e->upd,
                     e->upd_own, e->stat, e->topk_scratch, e->ones, e->mask_buf[0],
                     e->mask_buf[1], e->own_bits, e->gathered, e->prefix, e->counts };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free(bufs[i]);
    free(e);
    *ep = NULL;
}

scape_rc eng_set_local_trainers(eng_t *e, int local_trainers)
{
    if (e == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_set_local_trainers: engine is NULL");
    if (local_trainers < 1 || local_trainers > ENG_MAX_TRAINERS)
        return scape_set_error(SCAPE_INVALID,
                               "eng_set_local_trainers: %d not in [1, %d]", local_trainers,
                               ENG_MAX_TRAINERS);
    if ((local_trainers > 1 || e->gdt != KERN_F32) && e->g == NULL) {
        e->g = calloc(e->p->n, sizeof(float));
        if (e->g == NULL)
            return scape_set_error(SCAPE_NOMEM, "engine: cannot allocate the intake buffer");
    }
    e->tr = local_trainers;
    return handshake(e);
}

/* ---- parameters in and out --------------------------------------------- */

static scape_rc check_buffers(const eng_t *e, const void *const *bufs, const char *what)
{
    if (bufs == NULL)
        return scape_set_error(SCAPE_INVALID, "engine: %s array is NULL", what);
    for (int j = 0; j < e->tr; j++)
        if (bufs[j] == NULL)
            return scape_set_error(SCAPE_INVALID, "engine: %s[%d] is NULL", what, j);
    return SCAPE_OK;
}

scape_rc eng_init_params(eng_t *e, void *const *params)
{
    if (e == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_init_params: engine is NULL");
    if (e->initialised)
        return scape_set_error(SCAPE_INVALID, "eng_init_params: already initialised");
    TRY(check_buffers(e, (const void *const *)params, "params"));
    size_t bytes = e->p->n * kern_dtype_size(e->pdt);
    TRY(comm_broadcast(e->comm, params[0], bytes, 0));
    for (int j = 1; j < e->tr; j++)
        memcpy(params[j], params[0], bytes);
    for (size_t i = 0; i < e->p->ntensors; i++) {
        const plan_tensor *t = &e->p->t[i];
        if (t->pos < e->state_base || t->pos >= e->state_base + e->state_len)
            continue;
        float *dst = e->theta + (t->pos - e->state_base);
        if (e->pdt == KERN_F32)
            memcpy(dst, (const float *)params[0] + t->off, t->len * sizeof(float));
        else
            TRY(kern_bf16_to_f32((const uint16_t *)params[0] + t->off, dst, t->len));
    }
    e->initialised = 1;
    return SCAPE_OK;
}

/* ---- the step ----------------------------------------------------------- */

/* G_r: the sum of the local trainers' gradients, in trainer order. */
static scape_rc intake(eng_t *e, const void *const *grads, const float **g_out)
{
    if (e->tr == 1 && e->gdt == KERN_F32) {
        *g_out = grads[0];
        return SCAPE_OK;
    }
    for (int j = 0; j < e->tr; j++)
        TRY(kern_grad_accum(e->g, grads[j], e->gdt, e->p->n, j == 0));
    *g_out = e->g;
    return SCAPE_OK;
}

static int dense_step(const eng_t *e, uint64_t t)
{
    return e->cfg.optimizer == ENG_OPT_ADAMS || e->cfg.optimizer == ENG_OPT_ADAMW ||
           t <= e->cfg.warmup;
}

/* SCAPE: finish the lagged all-gather; M_t is all ones in warm-up, else it. */
static scape_rc scape_mask(eng_t *e, uint64_t t)
{
    if (e->mask_pending) {
        TRY(comm_iallgather_wait(e->comm));
        e->mask_pending = 0;
    }
    const uint32_t *prev = e->mask_cur;
    if (t <= e->cfg.warmup) {
        e->mask_cur = e->ones;
    } else {
        e->mask_cur = e->mask_next;
        e->mask_next = e->mask_next == e->mask_buf[0] ? e->mask_buf[1] : e->mask_buf[0];
    }
    e->last.mask_churn = 0.0;
    if (prev != e->ones && e->mask_cur != e->ones) {
        uint64_t fresh = 0, total = 0;
        for (size_t w = 0; w < e->p->nwords; w++) {
            fresh += (uint64_t)__builtin_popcount(e->mask_cur[w] & ~prev[w]);
            total += (uint64_t)__builtin_popcount(e->mask_cur[w]);
        }
        e->last.mask_churn = total ? (double)fresh / (double)total : 0.0;
    }
    return SCAPE_OK;
}

/* SCAPE: statistics and exact top-k of the owned tensors -> M_{t+1}, whose
 * all-gather starts immediately and is waited for at the next step. */
static scape_rc scape_select(eng_t *e, const float *g)
{
    const plan *p = e->p;
    const plan_shard *me = &p->shard[e->rank];
    for (size_t j = me->first; j < me->first + me->count; j++) {
        const plan_tensor *t = &p->t[p->order[j]];
        const float *m = e->m + (t->pos - e->state_base);
        TRY(kern_mask_stat(m, g + t->off, e->e + t->off, t->len, e->cfg.hyper.beta1,
                           (float)e->tr, e->stat));
        TRY(kern_topk_mask(e->stat, t->len, t->k, e->own_bits + (t->word - me->word0),
                           e->topk_scratch, e->topk_scratch_bytes));
    }
    for (int r = 0; r < e->comm->size; r++)
        e->counts[r] = p->shard[r].words * sizeof(uint32_t);
    TRY(comm_iallgather(e->comm, e->own_bits, e->mask_next, e->counts));
    e->mask_pending = 1;
    return SCAPE_OK;
}

/* topk-adamw: each rank's top-k of |a_r| per tensor; the union is the mask. */
static scape_rc topk_union_mask(eng_t *e, const float *g)
{
    const plan *p = e->p;
    for (size_t i = 0; i < p->ntensors; i++) {
        const plan_tensor *t = &p->t[i];
        TRY(kern_abs_stat(g + t->off, e->e + t->off, t->len, e->stat));
        TRY(kern_topk_mask(e->stat, t->len, t->k, e->own_bits + t->word,
                           e->topk_scratch, e->topk_scratch_bytes));
    }
    for (int r = 0; r < e->comm->size; r++)
        e->counts[r] = p->nwords * sizeof(uint32_t);
    TRY(comm_allgather(e->comm, e->own_bits, e->gathered, e->counts));
    uint32_t *u = e->mask_buf[0];
    memcpy(u, e->gathered, p->nwords * sizeof *u);
    for (int r = 1; r < e->comm->size; r++)
        TRY(kern_mask_or(u, e->gathered + (size_t)r * p->nwords, p->nwords));
    e->mask_cur = u;
    return SCAPE_OK;
}

/* Pack a = G + e on the mask, tensor by tensor in comm order. */
static scape_rc pack(eng_t *e, const float *g)
{
    const plan *p = e->p;
    for (size_t j = 0; j < p->ntensors; j++) {
        const plan_tensor *t = &p->t[p->order[j]];
        size_t k;
        TRY(kern_pack_ef(g + t->off, e->e + t->off, e->mask_cur + t->word, t->len,
                         e->send + e->prefix[t->word], &k));
    }
    return SCAPE_OK;
}

/* The one reduction collective; e->sum/sum_base locate the reduced values. */
static scape_rc reduce(eng_t *e, size_t k)
{
    if (e->cfg.mode == ENG_MODE_REPLICATED) {
        TRY(comm_allreduce_sum(e->comm, e->send, k));
        e->sum = e->send;
        e->sum_base = 0;
        return SCAPE_OK;
    }
    for (int r = 0; r < e->comm->size; r++) {
        const plan_shard *s = &e->p->shard[r];
        e->counts[r] = e->prefix[s->word0 + s->words] - e->prefix[s->word0];
    }
    TRY(comm_reduce_scatter_sum(e->comm, e->send, e->recv, e->counts));
    e->sum = e->recv;
    e->sum_base = e->prefix[e->p->shard[e->rank].word0];
    return SCAPE_OK;
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

static scape_rc update_tensor(eng_t *e, const plan_tensor *t, uint64_t t_step, float lr,
                              int dense)
{
    size_t s = t->pos - e->state_base;
    const float *sum = e->sum + (e->prefix[t->word] - e->sum_base);
    const uint32_t *mask = e->mask_cur + t->word;
    float div = (float)e->t_total;
    const kern_hyper *h = &e->cfg.hyper;
    if (uses_v(e))
        return dense ? kern_adamw_dense(e->theta + s, e->m + s, e->v + s, sum, div,
                                        t->len, h, lr, t_step)
                     : kern_adamw_masked(e->theta + s, e->m + s, e->v + s, sum, div,
                                         mask, t->len, h, lr, t_step);
    return dense ? kern_adams_dense(e->theta + s, e->m + s, sum, div, t->len, h, lr)
                 : kern_adams_masked(e->theta + s, e->m + s, sum, div, mask, t->len, h, lr);
}

static scape_rc update(eng_t *e, uint64_t t, float lr, int dense)
{
    size_t first, count;
    update_range(e, &first, &count);
    for (size_t j = first; j < first + count; j++)
        TRY(update_tensor(e, &e->p->t[e->p->order[j]], t, lr, dense));
    return SCAPE_OK;
}

/* upd = the updated parameters at the mask, packed in comm order. */
static scape_rc gather_updates(eng_t *e)
{
    size_t first, count, k;
    update_range(e, &first, &count);
    int sharded = e->cfg.mode == ENG_MODE_SHARDED;
    float *dst = sharded ? e->upd_own : e->upd;
    size_t base = sharded ? e->sum_base : 0;
    for (size_t j = first; j < first + count; j++) {
        const plan_tensor *t = &e->p->t[e->p->order[j]];
        TRY(kern_mask_compact(e->theta + (t->pos - e->state_base), e->mask_cur + t->word,
                              t->len, dst + (e->prefix[t->word] - base), &k));
    }
    if (!sharded)
        return SCAPE_OK;
    for (int r = 0; r < e->comm->size; r++) {
        const plan_shard *s = &e->p->shard[r];
        e->counts[r] = (e->prefix[s->word0 + s->words] - e->prefix[s->word0]) * sizeof(float);
    }
    return comm_allgather(e->comm, e->upd_own, e->upd, e->counts);
}

static scape_rc write_back(eng_t *e, void *const *params)
{
    size_t esz = kern_dtype_size(e->pdt);
    for (size_t i = 0; i < e->p->ntensors; i++) {
        const plan_tensor *t = &e->p->t[i];
        for (int j = 0; j < e->tr; j++)
            TRY(kern_mask_expand(e->upd + e->prefix[t->word], e->mask_cur + t->word, t->len,
                                 (char *)params[j] + t->off * esz, e->pdt));
    }
    return SCAPE_OK;
}

/* Run fn(args) and add its wall time to phase ph. */
#define PHASE(ph, call)                                                        \
    do {                                                                       \
        double t0_ = now_s();                                                  \
        scape_rc rc_ = (call);                                                 \
        e->last.phase_s[ph] += now_s() - t0_;                                  \
        if (rc_ != SCAPE_OK)                                                   \
            return rc_;                                                        \
    } while (0)

static scape_rc step_body(eng_t *e, uint64_t t, float lr, const void *const *grads,
                          void *const *params)
{
    const float *g = NULL;
    int dense = dense_step(e, t);
    int scape = e->cfg.optimizer == ENG_OPT_SCAPE;
    PHASE(ENG_PH_INTAKE, intake(e, grads, &g));
    if (scape)
        PHASE(ENG_PH_MASK_WAIT, scape_mask(e, t));
    else if (dense)
        e->mask_cur = e->ones;
    else
        PHASE(ENG_PH_SELECT, topk_union_mask(e, g));
    if (scape && t + 1 > e->cfg.warmup)
        PHASE(ENG_PH_SELECT, scape_select(e, g));
    TRY(kern_mask_prefix(e->mask_cur, e->p->nwords, e->prefix));
    size_t k = e->prefix[e->p->nwords];
    PHASE(ENG_PH_PACK, pack(e, g));
    PHASE(ENG_PH_REDUCE, reduce(e, k));
    PHASE(ENG_PH_UPDATE, update(e, t, lr, dense));
    PHASE(ENG_PH_GATHER, gather_updates(e));
    PHASE(ENG_PH_WRITEBACK, write_back(e, params));
    e->last.k = k;
    return SCAPE_OK;
}

static scape_rc check_step(const eng_t *e, uint64_t t, float lr, const void *const *grads,
                           void *const *params)
{
    if (e->broken)
        return scape_set_error(SCAPE_INVALID,
                               "engine: a previous step failed part-way; state is "
                               "inconsistent and must be restored");
    if (!e->initialised)
        return scape_set_error(SCAPE_INVALID, "engine: eng_init_params was not called");
    if (t != e->last_step + 1)
        return scape_set_error(SCAPE_INVALID, "engine: step %llu out of order (expected %llu)",
                               (unsigned long long)t, (unsigned long long)e->last_step + 1);
    if (!isfinite(lr) || lr < 0.0f)
        return scape_set_error(SCAPE_INVALID, "engine: lr=%g must be finite and >= 0",
                               (double)lr);
    TRY(check_buffers(e, grads, "grads"));
    TRY(check_buffers(e, (const void *const *)params, "params"));
    size_t pb = e->p->n * kern_dtype_size(e->pdt), gb = e->p->n * kern_dtype_size(e->gdt);
    for (int a = 0; a < e->tr; a++)
        for (int b = 0; b < e->tr; b++) {
            const char *pa = params[a], *pbuf = params[b], *gbuf = grads[b];
            if ((a != b && pa < pbuf + pb && pbuf < pa + pb) ||
                (pa < gbuf + gb && gbuf < pa + pb))
                return scape_set_error(SCAPE_INVALID,
                                       "engine: params[%d] overlaps %s[%d]", a,
                                       a != b && pa < pbuf + pb && pbuf < pa + pb ? "params"
                                                                                   : "grads",
                                       b);
        }
    return SCAPE_OK;
}

scape_rc eng_step(eng_t *e, uint64_t t, float lr, const void *const *grads,
                  void *const *params)
{
    if (e == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_step: engine is NULL");
    TRY(check_step(e, t, lr, grads, params));
    comm_stats before = e->comm->stats;
    memset(&e->last, 0, sizeof e->last);
    scape_rc rc = step_body(e, t, lr, grads, params);
    if (rc != SCAPE_OK) {
        e->broken = 1;
        return rc;
    }
    e->last_step = t;
    e->last.step = t;
    e->last.n = e->p->n;
    e->last.density = (double)e->last.k / (double)e->p->n;
    for (int op = 0; op < COMM_OP_COUNT; op++) {
        e->last.comm.calls[op] = e->comm->stats.calls[op] - before.calls[op];
        e->last.comm.bytes[op] = e->comm->stats.bytes[op] - before.bytes[op];
        e->last.comm.wire_bytes[op] = e->comm->stats.wire_bytes[op] - before.wire_bytes[op];
    }
    return SCAPE_OK;
}

scape_rc eng_last_stats(const eng_t *e, eng_step_stats *out)
{
    if (e == NULL || out == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_last_stats: NULL argument");
    *out = e->last;
    return SCAPE_OK;
}
