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


static const char *const s_opt_names[ENG_OPT_COUNT] = {
    [ENG_OPT_SCAPE] = "scape", [ENG_OPT_ADAMS] = "adams",
    [ENG_OPT_ADAMW] = "adamw", [ENG_OPT_TOPK_ADAMW] = "topk-adamw",
};
static const char *const s_mode_names[ENG_MODE_COUNT] = {
    [ENG_MODE_REPLICATED] = "replicated", [ENG_MODE_SHARDED] = "sharded",
};

void eng_config_default(eng_config *cfg)
{
    memset(cfg, 0, sizeof *cfg); /* defer_select off; fields added later start at 0 */
    cfg->optimizer = ENG_OPT_SCAPE;
    cfg->mode = ENG_MODE_REPLICATED;
    cfg->rho = 0.01;
    cfg->warmup = 1;
    cfg->hyper = (kern_hyper){ .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .wd = 0.0f };
    cfg->intake_chunk = 16384;
    cfg->threads = 1;
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
    if (c->intake_chunk < 32 || c->intake_chunk % 32)
        return scape_set_error(SCAPE_INVALID,
                               "config: intake_chunk=%zu must be a positive multiple of 32",
                               c->intake_chunk);
    if (c->threads < 1 || c->threads > POOL_MAX_THREADS)
        return scape_set_error(SCAPE_INVALID, "config: threads=%d must be in [1, %d]",
                               c->threads, POOL_MAX_THREADS);
    const kern_hyper *h = &c->hyper;
    if (!(h->beta1 >= 0.0f && h->beta1 < 1.0f) || !(h->beta2 >= 0.0f && h->beta2 < 1.0f))
        return scape_set_error(SCAPE_INVALID, "config: beta1=%g beta2=%g must be in [0, 1)",
                               (double)h->beta1, (double)h->beta2);
    if (!(h->eps > 0.0f) || !(h->wd >= 0.0f) || !isfinite(h->wd))
        return scape_set_error(SCAPE_INVALID, "config: eps=%g must be > 0, wd=%g >= 0",
                               (double)h->eps, (double)h->wd);
    return SCAPE_OK;
}

uint64_t eng_config_hash(const eng_config *c)
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

/* The pack's pieces: every tensor in comm order cut into intake_chunk
 * coordinates (a multiple of 32, so each piece starts on a mask word). */
static scape_rc plan_items(eng_t *e)
{
    const plan *p = e->p;
    size_t chunk = e->cfg.intake_chunk, n = 0;
    for (size_t j = 0; j < p->ntensors; j++)
        n += (p->t[p->order[j]].len + chunk - 1) / chunk;
    e->items = calloc(n ? n : 1, sizeof *e->items);
    if (e->items == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    e->nitems = 0;
    for (size_t j = 0; j < p->ntensors; j++) {
        size_t len = p->t[p->order[j]].len;
        for (size_t c = 0; c < len; c += chunk)
            e->items[e->nitems++] = (eng_item){ .j = j, .c = c,
                                                .len = len - c < chunk ? len - c : chunk };
    }
    return SCAPE_OK;
}

static scape_rc alloc_state(eng_t *e)
{
    const plan *p = e->p;
    size_t n = p->n, w = p->nwords, R = (size_t)e->comm->size;
    const plan_shard *me = &p->shard[e->rank];
    int sharded = e->cfg.mode == ENG_MODE_SHARDED;
    int topk = e->cfg.optimizer == ENG_OPT_TOPK_ADAMW;
    int dense_only = e->cfg.optimizer == ENG_OPT_ADAMS || e->cfg.optimizer == ENG_OPT_ADAMW;

    e->state_base = sharded ? me->pos0 : 0;
    e->state_len = sharded ? me->len : n;
    size_t sl = e->state_len ? e->state_len : 1;
    e->k_cap = dense_only ? 1 : topk ? (R * p->k_total < n ? R * p->k_total : n) : p->k_total;
    e->m = calloc(sl, sizeof(float));
    e->v = eng_uses_v(e) ? calloc(sl, sizeof(float)) : NULL;
    e->theta = calloc(sl, sizeof(float));
    e->e = calloc(n, sizeof(float));
    e->send = calloc(e->k_cap, sizeof(float));
    e->upd = calloc(e->k_cap, sizeof(float));
    if (e->cfg.defer_select && e->cfg.optimizer == ENG_OPT_SCAPE &&
        (e->sstat = calloc(e->k_cap, sizeof(float))) == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: cannot allocate state for N=%zu", n);
    size_t workers = (size_t)e->cfg.threads;
    e->topk_scratch_bytes = kern_topk_scratch_bytes(p->max_len);
    e->topk_scratch = malloc(e->topk_scratch_bytes ? workers * e->topk_scratch_bytes : 1);
    e->mask_buf[0] = calloc(w, sizeof(uint32_t));
    e->mask_buf[1] = calloc(w, sizeof(uint32_t));
    e->toff = calloc(p->ntensors + 1, sizeof(size_t));
    e->counts = calloc(R, sizeof(size_t));
    e->code_bytes = calloc(R, sizeof(size_t));
    if (e->code_bytes == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: cannot allocate state for N=%zu", n);
    /* SCAPE: each rank sends its shard's bits; topk-adamw: every rank all of its own. */
    for (size_t r = 0; r < R; r++) {
        const plan_shard *sh = &p->shard[r];
        e->code_bytes[r] = topk ? mcode_bytes(p, 0, p->ntensors)
                                : mcode_bytes(p, sh->first, sh->count);
        if ((int)r == e->rank)
            e->code_off = e->code_total;
        e->code_total += e->code_bytes[r];
    }
    e->code_all = calloc(e->code_total / 4 + 1, sizeof(uint32_t));
    if (!e->m || (eng_uses_v(e) && !e->v) || !e->theta || !e->e || !e->send || !e->upd ||
        !e->topk_scratch || !e->mask_buf[0] || !e->mask_buf[1] || !e->code_all || !e->toff ||
        !e->counts)
        return scape_set_error(SCAPE_NOMEM, "engine: cannot allocate state for N=%zu", n);
    e->mask_cur = NULL;
    e->mask_next = e->mask_buf[0];
    TRY(plan_items(e));
    TRY(pool_create(&e->pool, e->cfg.threads));
    return eng_alloc_intake(e);
}

scape_rc eng_alloc_intake(eng_t *e)
{
    if (e->tr == 1 && e->gdt == KERN_F32)
        return SCAPE_OK; /* the trainer's buffer is G_r */
    int whole = e->cfg.optimizer == ENG_OPT_TOPK_ADAMW; /* selects before packing */
    float **buf = whole ? &e->g : &e->gchunk;
    if (*buf == NULL)
        *buf = calloc(whole ? e->p->n : (size_t)e->cfg.threads * e->cfg.intake_chunk,
                      sizeof(float));
    if (*buf == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: cannot allocate the intake buffer");
    return SCAPE_OK;
}

/* Exchange T_r and the hashes of config and layout; all ranks must agree. */
static scape_rc handshake(eng_t *e)
{
    e->t_total = 0;
    int R = e->comm->size;
    /* defer_select is not in the config hash (checkpoints do not depend on
     * it) but must agree: it moves the mask all-gather among the collectives */
    uint64_t mine[4] = { (uint64_t)e->tr, e->p->hash, eng_config_hash(&e->cfg),
                         (uint64_t)(e->cfg.defer_select != 0) };
    uint64_t *all = calloc((size_t)R * 4, sizeof *all);
    if (all == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    for (int r = 0; r < R; r++)
        e->counts[r] = sizeof mine;
    scape_rc rc = comm_allgather(e->comm, mine, all, e->counts);
    for (int r = 0; rc == SCAPE_OK && r < R; r++) {
        if (all[4 * r + 1] != mine[1])
            rc = scape_set_error(SCAPE_INVALID,
                                 "engine: rank %d registered a different layout than rank %d",
                                 r, e->rank);
        else if (all[4 * r + 2] != mine[2])
            rc = scape_set_error(SCAPE_INVALID,
                                 "engine: rank %d has a different optimizer config than rank %d",
                                 r, e->rank);
        else if (all[4 * r + 3] != mine[3] && e->cfg.optimizer == ENG_OPT_SCAPE)
            rc = scape_set_error(SCAPE_INVALID,
                                 "engine: rank %d has defer_select %s and rank %d %s: set it "
                                 "alike on every daemon", r, all[4 * r + 3] ? "on" : "off",
                                 e->rank, mine[3] ? "on" : "off");
        e->t_total += (int)all[4 * r];
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
    pool_destroy(&e->pool);
    plan_destroy(&e->p);
    void *bufs[] = { e->items, e->m, e->v, e->theta, e->e, e->g, e->gchunk, e->send, e->upd,
                     e->topk_scratch, e->sstat,
                     e->mask_buf[0], e->mask_buf[1], e->code_all,
                     e->code_bytes, e->toff, e->counts, e->ghat, e->ghave };
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
    TRY(eng_step_finish(e)); /* it selects with the old T_r */
    e->tr = local_trainers;
    TRY(eng_alloc_intake(e));
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
    TRY(eng_step_finish(e)); /* the caller left the last step's selection */
    comm_stats before = e->comm->stats;
    memset(&e->last, 0, sizeof e->last);
    memset(e->used_iag, 0, sizeof e->used_iag);
    scape_rc rc = eng_step_body(e, t, lr, grads, params);
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
    /* the mask all-gather counts to the step whose mask it brought, not to
     * the one that started it (which may be before or after this window) */
    e->last.comm.calls[COMM_IALLGATHER] = e->used_iag[0];
    e->last.comm.bytes[COMM_IALLGATHER] = e->used_iag[1];
    e->last.comm.wire_bytes[COMM_IALLGATHER] = e->used_iag[2];
    return SCAPE_OK;
}

scape_rc eng_step_finish(eng_t *e)
{
    if (e == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_step_finish: engine is NULL");
    if (!e->select_pending)
        return SCAPE_OK;
    if (e->broken)
        return scape_set_error(SCAPE_INVALID, "eng_step_finish: the engine is broken");
    scape_rc rc = eng_select_pending(e);
    if (rc != SCAPE_OK)
        e->broken = 1;
    return rc;
}

scape_rc eng_last_stats(const eng_t *e, eng_step_stats *out)
{
    if (e == NULL || out == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_last_stats: NULL argument");
    *out = e->last;
    return SCAPE_OK;
}
