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
    int k = 0;
    secs[k++] = (eng_ckpt_sec){ ENG_SEC_M, NULL, sl };
    if (opt == ENG_OPT_ADAMW || opt == ENG_OPT_TOPK_ADAMW)
        secs[k++] = (eng_ckpt_sec){ ENG_SEC_V, NULL, sl };
    secs[k++] = (eng_ckpt_sec){ ENG_SEC_THETA, NULL, sl };
    if (!(flags & ENG_CKF_RESIDUAL_ZERO))
        secs[k++] = (eng_ckpt_sec){ ENG_SEC_RESIDUAL, NULL, n * sizeof(float) };
    if (flags & ENG_CKF_MASK_CUR)
        secs[k++] = (eng_ckpt_sec){ ENG_SEC_MASK_CUR, NULL, wb };
    if (flags & ENG_CKF_MASK_NEXT)
        secs[k++] = (eng_ckpt_sec){ ENG_SEC_MASK_NEXT, NULL, wb };
    return k;
}

/* The layout, pointing into this engine's buffers. */
static void describe(eng_t *e, uint32_t flags, eng_ckpt_sec *secs, int *nsecs)
{
    *nsecs = eng_ckpt_layout(e->cfg.optimizer, flags, e->state_len, e->p->n, e->p->nwords,
                             secs);
    for (int i = 0; i < *nsecs; i++) {
        switch (secs[i].id) {
        case ENG_SEC_M: secs[i].ptr = e->m; break;
        case ENG_SEC_V: secs[i].ptr = e->v; break;
        case ENG_SEC_THETA: secs[i].ptr = e->theta; break;
        case ENG_SEC_RESIDUAL: secs[i].ptr = e->e; break;
        /* A fresh engine's next mask is buffer 0; the last one goes to buffer 1. */
        case ENG_SEC_MASK_CUR:
            secs[i].ptr = e->mask_cur ? (void *)e->mask_cur : e->mask_buf[1];
            break;
        default: secs[i].ptr = e->mask_next; break;
        }
    }
}

/* SCAPE knows the mask of the step after `step` once its warm-up is over. */
static int next_mask_due(const eng_t *e, uint64_t step)
{
    return e->cfg.optimizer == ENG_OPT_SCAPE && step + 1 > e->cfg.warmup;
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
    m->state_base = e->state_base;
    m->state_len = e->state_len;
    m->trainers = (uint32_t)e->t_total;
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
    TRY(eng_step_finish(e)); /* M_{t+1} must be whole to be saved */
    TRY(eng_mask_finish(e, NULL));
    fill_meta(e, meta);
    /* topk-adamw chooses its mask afresh each step: only SCAPE carries one. */
    int scape = e->cfg.optimizer == ENG_OPT_SCAPE;
    if (e->e_stale)
        meta->flags |= ENG_CKF_RESIDUAL_ZERO;
    if (scape && e->mask_cur)
        meta->flags |= ENG_CKF_MASK_CUR;
    if (next_mask_due(e, e->last_step))
        meta->flags |= ENG_CKF_MASK_NEXT;
    describe(e, meta->flags, secs, nsecs);
    return SCAPE_OK;
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
                               "%016llx) differs from the trainers' (N=%llu, hash %016llx)",
                               (unsigned long long)meta->n,
                               (unsigned long long)meta->layout_hash,
                               (unsigned long long)mine.n,
                               (unsigned long long)mine.layout_hash);
    if (meta->config_hash != mine.config_hash || meta->optimizer != mine.optimizer ||
        meta->mode != mine.mode)
        return scape_set_error(SCAPE_INVALID,
                               "restore: the checkpoint was taken with other optimizer settings "
                               "(%s, %s); this job runs %s, %s (optimizer, mode, rho, warmup "
                               "and the hyper-parameters must match)",
                               eng_optimizer_name((eng_optimizer)meta->optimizer),
                               eng_mode_name((eng_mode)meta->mode),
                               eng_optimizer_name(e->cfg.optimizer), eng_mode_name(e->cfg.mode));
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
    return SCAPE_OK;
}

/* The master parameters, coordinate order per tensor, into every trainer's
 * buffer; sharded ranks first gather the whole vector (comm order). */
static scape_rc publish_theta(eng_t *e, void *const *params)
{
    const float *src = e->theta;
    float *whole = NULL;
    if (e->cfg.mode == ENG_MODE_SHARDED) {
        whole = malloc((e->p->n ? e->p->n : 1) * sizeof *whole);
        if (whole == NULL)
            return scape_set_error(SCAPE_NOMEM, "restore: out of memory");
        for (int r = 0; r < e->comm->size; r++)
            e->counts[r] = e->p->shard[r].len * sizeof(float);
        scape_rc rc = comm_allgather(e->comm, e->theta, whole, e->counts);
        if (rc != SCAPE_OK) {
            free(whole);
            return rc;
        }
        src = whole;
    }
    size_t esz = kern_dtype_size(e->pdt);
    scape_rc rc = SCAPE_OK;
    for (size_t i = 0; rc == SCAPE_OK && i < e->p->ntensors; i++) {
        const plan_tensor *t = &e->p->t[i];
        for (int q = 0; rc == SCAPE_OK && q < e->tr; q++) {
            char *dst = (char *)params[q] + t->off * esz;
            if (e->pdt == KERN_F32)
                memcpy(dst, src + t->pos, t->len * sizeof(float));
            else
                rc = kern_f32_to_bf16(src + t->pos, (uint16_t *)(void *)dst, t->len);
        }
    }
    free(whole);
    return rc;
}

scape_rc eng_ckpt_load_finish(eng_t *e, const eng_ckpt_meta *meta, void *const *params)
{
    if (e == NULL || meta == NULL || params == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_ckpt_load_finish: NULL argument");
    for (int q = 0; q < e->tr; q++)
        if (params[q] == NULL)
            return scape_set_error(SCAPE_INVALID, "restore: params[%d] is NULL", q);
    TRY(publish_theta(e, params));
    e->last_step = meta->step;
    e->e_stale = (meta->flags & ENG_CKF_RESIDUAL_ZERO) != 0;
    e->mask_cur = (meta->flags & ENG_CKF_MASK_CUR) ? e->mask_buf[1] : NULL;
    e->mask_next = e->mask_buf[0];
    e->mask_pending = 0;
    e->select_pending = 0;
    memset(e->next_iag, 0, sizeof e->next_iag); /* the mask came from the file */
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
        out[i] = (eng_tensor){ e->p->t[i].name, e->p->t[i].off, e->p->t[i].len };
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

scape_rc eng_ckpt_load_coords(eng_t *e, const eng_coord_state *st, void *const *params)
{
    if (e == NULL || st == NULL || params == NULL || st->m == NULL || st->theta == NULL ||
        (eng_uses_v(e) && st->v == NULL))
        return scape_set_error(SCAPE_INVALID, "eng_ckpt_load_coords: missing state");
    if (e->initialised)
        return scape_set_error(SCAPE_INVALID, "restore: the engine has already started");
    if (st->step == 0)
        return scape_set_error(SCAPE_INVALID, "restore: the checkpoint holds no step");
    for (size_t l = 0; l < e->p->ntensors; l++) {
        const plan_tensor *t = &e->p->t[l];
        if (t->pos >= e->state_base && t->pos < e->state_base + e->state_len) {
            size_t s = t->pos - e->state_base;
            memcpy(e->m + s, st->m + t->off, t->len * sizeof(float));
            memcpy(e->theta + s, st->theta + t->off, t->len * sizeof(float));
            if (eng_uses_v(e))
                memcpy(e->v + s, st->v + t->off, t->len * sizeof(float));
        }
        if (st->residual)
            memcpy(e->e + t->pos, st->residual + t->off, t->len * sizeof(float));
        else
            memset(e->e + t->pos, 0, t->len * sizeof(float));
    }
    int cur = (st->flags & ENG_CKF_MASK_CUR) && st->mask_cur;
    int next = (st->flags & ENG_CKF_MASK_NEXT) && st->mask_next;
    if (next_mask_due(e, st->step) && !next)
        return scape_set_error(SCAPE_INVALID, "restore: the checkpoint has no next mask");
    if (cur)
        pack_mask(e, st->mask_cur, e->mask_buf[1]);
    if (next)
        pack_mask(e, st->mask_next, e->mask_buf[0]);
    eng_ckpt_meta meta;
    fill_meta(e, &meta);
    meta.step = st->step;
    meta.flags = (cur ? ENG_CKF_MASK_CUR : 0) | (next ? ENG_CKF_MASK_NEXT : 0);
    return eng_ckpt_load_finish(e, &meta, params);
}
