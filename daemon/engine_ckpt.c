/* engine_ckpt.c - the engine's side of checkpoints: which memory holds the
 * state after a step, and how a fresh engine takes it back.
 *
 * After step t the state that step t+1 needs is: m (and v) and the master
 * parameters of this rank's range, the residual e_r, and for SCAPE the mask
 * M_{t+1} that the lagged all-gather is bringing in.  Saving finishes that
 * all-gather first, so the next mask is whole in memory and no collective is
 * in flight.  The file format and the writing live in ckpt.c; the engine only
 * lists its buffers, so nothing is copied on the way to the disk.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>

#include "engine_internal.h"

static const char *const s_sec_names[ENG_SEC_COUNT] = {
    [ENG_SEC_M] = "m", [ENG_SEC_V] = "v", [ENG_SEC_THETA] = "theta",
    [ENG_SEC_RESIDUAL] = "residual", [ENG_SEC_MASK_CUR] = "mask_cur",
    [ENG_SEC_MASK_NEXT] = "mask_next",
};

const char *eng_ckpt_section_name(uint32_t id)
{
    return id > 0 && id < ENG_SEC_COUNT ? s_sec_names[id] : "?";
}

int eng_ckpt_layout(eng_optimizer opt, uint32_t flags, size_t state_len, size_t n,
                    size_t nwords, eng_ckpt_sec *secs)
{
    size_t sl = state_len * sizeof(float), wb = nwords * sizeof(uint32_t);
    uint32_t has = eng_opt_get(opt)->secs;
    int k = 0;
    for (uint32_t id = ENG_SEC_M; id <= ENG_SEC_THETA; id++)
        if (has & (1u << id))
            secs[k++] = (eng_ckpt_sec){ id, NULL, sl };
    if (!(flags & ENG_CKF_RESIDUAL_ZERO))
        secs[k++] = (eng_ckpt_sec){ ENG_SEC_RESIDUAL, NULL, n * sizeof(float) };
    if (flags & ENG_CKF_MASK_CUR)
        secs[k++] = (eng_ckpt_sec){ ENG_SEC_MASK_CUR, NULL, wb };
    if (flags & ENG_CKF_MASK_NEXT)
        secs[k++] = (eng_ckpt_sec){ ENG_SEC_MASK_NEXT, NULL, wb };
    return k;
}

void eng_ckpt_unstage(eng_t *e)
{
    free(e->stage);
    e->stage = NULL;
    free(e->ckpt_res);
    e->ckpt_res = NULL;
    e->nstaged = 0;
}

/* The residual is host memory even where the other vectors are not (the
 * cuda executor's pinned residual). */
static int host_section(const eng_t *e, uint32_t id)
{
    return e->x->host_memory || (id == ENG_SEC_RESIDUAL && e->x->residual_host);
}

/* Point the sections that are not in host memory at host copies, filled
 * from the executor when `down` (saving); the rest stay where they are.
 * Waits for the executor's work either way, so host sections are current. */
static scape_rc stage(eng_t *e, eng_ckpt_sec *secs, int nsecs, int down)
{
    eng_ckpt_unstage(e);
    size_t total = 0;
    for (int i = 0; i < nsecs; i++)
        if (!host_section(e, secs[i].id))
            total += (secs[i].bytes + 63) & ~(size_t)63;
    if (total && (e->stage = malloc(total)) == NULL)
        return scape_set_error(SCAPE_NOMEM, "checkpoint: cannot allocate %zu bytes to stage "
                               "the state through host memory", total);
    char *at = e->stage;
    for (int i = 0; i < nsecs; i++) {
        if (host_section(e, secs[i].id))
            continue;
        e->staged[e->nstaged++] = (__typeof__(e->staged[0])){ secs[i].ptr, at, secs[i].bytes,
                                                              secs[i].id };
        if (down)
            TRY(e->x->ops->copy(e->x, at, secs[i].ptr, secs[i].bytes));
        secs[i].ptr = at;
        at += (secs[i].bytes + 63) & ~(size_t)63;
    }
    return e->x->ops->sync(e->x);
}

/* The staged sections into the executor's memory: all but the residual
 * (residual 0), or the residual alone (1). */
static scape_rc unstage_up(eng_t *e, int residual)
{
    for (int i = 0; i < e->nstaged; i++)
        if ((e->staged[i].id == ENG_SEC_RESIDUAL) == residual)
            TRY(e->x->ops->copy(e->x, e->staged[i].vec, e->staged[i].host, e->staged[i].bytes));
    return e->x->ops->sync(e->x);
}

/* Chunks reduced early (reduce_chunk) keep their tensors packed through
 * eng_early_undo; the saved residual is the last step's all the same: the
 * staged copy, or a copy of the live one, takes those tensors' from
 * early_undo. */
static scape_rc residual_before_step(eng_t *e, eng_ckpt_sec *secs, int nsecs)
{
    if (e->chunks_done == 0 || e->early_stale0)
        return SCAPE_OK;
    for (int i = 0; i < nsecs; i++) {
        if (secs[i].id != ENG_SEC_RESIDUAL)
            continue;
        float *r = secs[i].ptr;
        if (secs[i].ptr == (void *)e->a.e) {
            if ((e->ckpt_res = malloc(secs[i].bytes ? secs[i].bytes : 1)) == NULL)
                return scape_set_error(SCAPE_NOMEM, "checkpoint: cannot allocate %zu bytes "
                                       "for the residual", secs[i].bytes);
            memcpy(e->ckpt_res, secs[i].ptr, secs[i].bytes);
            r = e->ckpt_res;
            secs[i].ptr = r;
        }
        for (size_t j = 0; j < e->p->ntensors; j++) {
            const plan_tensor *pt = eng_tensor_at(e, j);
            if (e->chunk_of[j] < e->chunks_done)
                memcpy(r + pt->pos, e->early_undo + pt->pos, pt->len * sizeof(float));
        }
    }
    return SCAPE_OK;
}

/* The layout, pointing into this engine's buffers. */
static void describe(eng_t *e, uint32_t flags, eng_ckpt_sec *secs, int *nsecs)
{
    *nsecs = eng_ckpt_layout(e->cfg.optimizer, flags, e->a.state_len, e->p->n, e->p->nwords,
                             secs);
    for (int i = 0; i < *nsecs; i++) {
        switch (secs[i].id) {
        case ENG_SEC_M: secs[i].ptr = e->a.m; break;
        case ENG_SEC_V: secs[i].ptr = e->a.v; break;
        case ENG_SEC_THETA: secs[i].ptr = e->a.theta; break;
        case ENG_SEC_RESIDUAL: secs[i].ptr = e->a.e; break;
        /* A fresh engine's next mask is buffer 0; the last one goes to buffer 1. */
        case ENG_SEC_MASK_CUR:
            secs[i].ptr = e->a.mask_cur ? (void *)e->a.mask_cur : e->a.mask_buf[1];
            break;
        default: secs[i].ptr = e->a.mask_next; break;
        }
    }
}

/* SCAPE knows the mask of the step after `step` once its warm-up is over. */
static int next_mask_due(const eng_t *e, uint64_t step)
{
    return eng_scape_masks(e) && step + 1 > e->cfg.warmup;
}

static void fill_meta(const eng_t *e, eng_ckpt_meta *m)
{
    memset(m, 0, sizeof *m);
    m->step = e->last_step;
    m->layout_hash = e->p->hash;
    m->config_hash = eng_config_hash(&e->cfg);
    m->rank = (uint32_t)e->rank;
    m->world = (uint32_t)e->comm->size;
    m->optimizer = (uint32_t)e->cfg.optimizer;
    m->mode = (uint32_t)e->cfg.mode;
    m->n = e->p->n;
    m->state_base = e->a.state_base;
    m->state_len = e->a.state_len;
    m->trainers = (uint32_t)e->a.t_total;
}

scape_rc eng_ckpt_save(eng_t *e, eng_ckpt_meta *meta, eng_ckpt_sec *secs, int *nsecs)
{
    if (e == NULL || meta == NULL || secs == NULL || nsecs == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_ckpt_save: NULL argument");
    if (e->broken)
        return scape_set_error(SCAPE_INVALID, "checkpoint: a step failed part-way; the "
                               "state is inconsistent and is not saved");
    if (!e->initialised)
        return scape_set_error(SCAPE_INVALID, "checkpoint: the job has not started");
    TRY(eng_early_undo(e)); /* the state after the last step; the step repacks */
    TRY(eng_step_finish(e)); /* M_{t+1} must be whole to be saved */
    TRY(eng_mask_finish(e, NULL));
    fill_meta(e, meta);
    /* topk-adamw chooses its mask afresh each step: only SCAPE carries one. */
    int carries = (e->opt->secs & (1u << ENG_SEC_MASK_CUR)) != 0;
    if (e->a.e_stale)
        meta->flags |= ENG_CKF_RESIDUAL_ZERO;
    if (carries && e->a.mask_cur)
        meta->flags |= ENG_CKF_MASK_CUR;
    if (next_mask_due(e, e->last_step))
        meta->flags |= ENG_CKF_MASK_NEXT;
    describe(e, meta->flags, secs, nsecs);
    TRY(stage(e, secs, *nsecs, 1));
    return residual_before_step(e, secs, *nsecs);
}

scape_rc eng_ckpt_load_begin(eng_t *e, const eng_ckpt_meta *meta, eng_ckpt_sec *secs,
                             int *nsecs)
{
    if (e == NULL || meta == NULL || secs == NULL || nsecs == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_ckpt_load_begin: NULL argument");
    if (e->initialised)
        return scape_set_error(SCAPE_INVALID, "restore: the engine has already started");
    eng_ckpt_meta mine;
    fill_meta(e, &mine);
    if (meta->world != mine.world)
        return scape_set_error(SCAPE_INVALID,
                               "restore: the checkpoint was taken by %u rank(s), this job has "
                               "%u (ckpt_restore reshards such a checkpoint)",
                               meta->world, mine.world);
    if (meta->rank != mine.rank)
        return scape_set_error(SCAPE_INVALID, "restore: the file is rank %u's, this is rank %u",
                               meta->rank, mine.rank);
    if (meta->n != mine.n || meta->layout_hash != mine.layout_hash)
        return scape_set_error(SCAPE_INVALID,
                               "restore: the checkpoint's tensor layout (N=%llu, hash "
                               "%016llx) differs from the trainers' (N=%llu, hash %016llx): "
                               "other tensors, or other parameter groups or weight decay",
                               (unsigned long long)meta->n,
                               (unsigned long long)meta->layout_hash,
                               (unsigned long long)mine.n,
                               (unsigned long long)mine.layout_hash);
    if (meta->config_hash != mine.config_hash || meta->optimizer != mine.optimizer ||
        meta->mode != mine.mode)
        return scape_set_error(SCAPE_INVALID,
                               "restore: the checkpoint was taken with other optimizer settings "
                               "(%s, %s); this job runs %s, %s (the mode and %s must match)",
                               eng_optimizer_name((eng_optimizer)meta->optimizer),
                               eng_mode_name((eng_mode)meta->mode),
                               eng_optimizer_name(e->cfg.optimizer), eng_mode_name(e->cfg.mode),
                               eng_config_hashed());
    if (meta->state_base != mine.state_base || meta->state_len != mine.state_len)
        return scape_set_error(SCAPE_INVALID, "restore: the checkpoint's shard [%llu, +%llu) "
                               "differs from this rank's [%llu, +%llu)",
                               (unsigned long long)meta->state_base,
                               (unsigned long long)meta->state_len,
                               (unsigned long long)mine.state_base,
                               (unsigned long long)mine.state_len);
    uint32_t known = ENG_CKF_RESIDUAL_ZERO | ENG_CKF_MASK_CUR | ENG_CKF_MASK_NEXT;
    if (meta->flags & ~known)
        return scape_set_error(SCAPE_INVALID, "restore: unknown flags %#x", meta->flags);
    if (meta->step == 0)
        return scape_set_error(SCAPE_INVALID, "restore: the checkpoint holds no step");
    if (next_mask_due(e, meta->step) && !(meta->flags & ENG_CKF_MASK_NEXT))
        return scape_set_error(SCAPE_INVALID, "restore: the checkpoint has no next mask");
    describe(e, meta->flags, secs, nsecs);
    return stage(e, secs, *nsecs, 0);
}

/* The master parameters into every trainer's buffer (the write-back of a
 * dense step); sharded ranks first gather the whole vector (comm order). */
static scape_rc publish_theta(eng_t *e, void *const *params)
{
    exec_t *x = e->x;
    const float *src = e->a.theta;
    float *whole = NULL;
    size_t k;
    if (e->cfg.mode == ENG_MODE_SHARDED) {
        /* on the host apart, the residual being restored; elsewhere the
         * dense buffer, whose residual (if it is one) is uploaded after */
        whole = x->host_memory ? malloc((e->p->n ? e->p->n : 1) * sizeof *whole) : e->a.dense;
        if (whole == NULL)
            return scape_set_error(SCAPE_NOMEM, "restore: out of memory");
        scape_rc rc = eng_gather_shards(e, e->a.theta, whole);
        if (rc != SCAPE_OK) {
            if (x->host_memory)
                free(whole);
            return rc;
        }
        src = whole;
    }
    e->a.mask_cur = NULL;
    e->a.pub_bf16 = 0; /* from theta, in fp32 */
    e->a.pub_delta = 0;
    scape_rc rc = x->ops->offsets(x, &k);
    if (rc == SCAPE_OK)
        rc = x->ops->write_back(x, src, params);
    if (rc == SCAPE_OK)
        rc = x->ops->sync(x);
    if (x->host_memory)
        free(whole);
    return rc;
}

scape_rc eng_ckpt_load_finish(eng_t *e, const eng_ckpt_meta *meta, void *const *params)
{
    if (e == NULL || meta == NULL || params == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_ckpt_load_finish: NULL argument");
    for (int q = 0; q < e->a.tr; q++)
        if (params[q] == NULL)
            return scape_set_error(SCAPE_INVALID, "restore: params[%d] is NULL", q);
    TRY(unstage_up(e, 0));
    TRY(publish_theta(e, params));
    TRY(unstage_up(e, 1));
    eng_ckpt_unstage(e);
    e->last_step = meta->step;
    e->a.e_stale = (meta->flags & ENG_CKF_RESIDUAL_ZERO) != 0;
    e->a.mask_cur = (meta->flags & ENG_CKF_MASK_CUR) ? e->a.mask_buf[1] : NULL;
    e->a.mask_next = e->a.mask_buf[0];
    e->mask_pending = 0;
    e->a.select_pending = 0;
    memset(e->next_iag, 0, sizeof e->next_iag); /* the mask came from the file */
    TRY(eng_mask_density(e, meta->step + 1)); /* k_l of that mask, for its offsets */
    e->initialised = 1;
    return SCAPE_OK;
}

/* ---- resharding -------------------------------------------------------------- */

size_t eng_ntensors(const eng_t *e) { return e ? e->p->ntensors : 0; }

const eng_config *eng_get_config(const eng_t *e) { return e ? &e->cfg : NULL; }

uint64_t eng_layout_hash(const eng_t *e) { return e ? e->p->hash : 0; }

scape_rc eng_get_layout(const eng_t *e, eng_tensor *out, size_t ntensors)
{
    if (e == NULL || out == NULL || ntensors != e->p->ntensors)
        return scape_set_error(SCAPE_INVALID, "eng_get_layout: bad arguments");
    for (size_t i = 0; i < ntensors; i++)
        out[i] = (eng_tensor){ e->p->t[i].name, e->p->t[i].off, e->p->t[i].len,
                               e->p->t[i].group };
    return SCAPE_OK;
}

/* Pack coordinate bytes into mask words in this plan's comm layout. */
static void pack_mask(const eng_t *e, const unsigned char *bytes, uint32_t *words)
{
    memset(words, 0, e->p->nwords * sizeof *words);
    for (size_t l = 0; l < e->p->ntensors; l++) {
        const plan_tensor *t = &e->p->t[l];
        for (size_t i = 0; i < t->len; i++)
            if (bytes[t->off + i])
                words[t->word + i / 32] |= 1u << (i % 32);
    }
}

/* Coordinate order into a section of comm order: this rank's state range
 * (state) or all N (residual). */
static void to_comm_order(const eng_t *e, const float *src, float *dst, int state)
{
    for (size_t l = 0; l < e->p->ntensors; l++) {
        const plan_tensor *t = &e->p->t[l];
        if (!state)
            memcpy(dst + t->pos, src + t->off, t->len * sizeof(float));
        else if (t->pos >= e->a.state_base && t->pos < e->a.state_base + e->a.state_len)
            memcpy(dst + (t->pos - e->a.state_base), src + t->off, t->len * sizeof(float));
    }
}

scape_rc eng_ckpt_load_coords(eng_t *e, const eng_coord_state *st, void *const *params)
{
    if (e == NULL || st == NULL || params == NULL || st->m == NULL || st->theta == NULL ||
        (e->opt->keeps_v && st->v == NULL))
        return scape_set_error(SCAPE_INVALID, "eng_ckpt_load_coords: missing state");
    if (e->initialised)
        return scape_set_error(SCAPE_INVALID, "restore: the engine has already started");
    if (st->step == 0)
        return scape_set_error(SCAPE_INVALID, "restore: the checkpoint holds no step");
    int cur = (st->flags & ENG_CKF_MASK_CUR) && st->mask_cur;
    int next = (st->flags & ENG_CKF_MASK_NEXT) && st->mask_next;
    if (next_mask_due(e, st->step) && !next)
        return scape_set_error(SCAPE_INVALID, "restore: the checkpoint has no next mask");
    eng_ckpt_meta meta;
    fill_meta(e, &meta);
    meta.step = st->step;
    meta.flags = (cur ? ENG_CKF_MASK_CUR : 0) | (next ? ENG_CKF_MASK_NEXT : 0);
    eng_ckpt_sec secs[ENG_CKPT_MAX_SECS];
    int nsecs;
    describe(e, meta.flags, secs, &nsecs);
    TRY(stage(e, secs, nsecs, 0));
    for (int i = 0; i < nsecs; i++) {
        void *at = secs[i].ptr;
        switch (secs[i].id) {
        case ENG_SEC_M: to_comm_order(e, st->m, at, 1); break;
        case ENG_SEC_V: to_comm_order(e, st->v, at, 1); break;
        case ENG_SEC_THETA: to_comm_order(e, st->theta, at, 1); break;
        case ENG_SEC_RESIDUAL:
            if (st->residual)
                to_comm_order(e, st->residual, at, 0);
            else
                memset(at, 0, secs[i].bytes);
            break;
        case ENG_SEC_MASK_CUR: pack_mask(e, st->mask_cur, at); break;
        default: pack_mask(e, st->mask_next, at); break;
        }
    }
    return eng_ckpt_load_finish(e, &meta, params);
}
