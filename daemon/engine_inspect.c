/* engine_inspect.c - read-only views of an engine's state in coordinate
 * order, for tests, the status plane and checkpoints. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine_internal.h"

size_t eng_n(const eng_t *e) { return e ? e->p->n : 0; }

scape_rc eng_upload(eng_t *e, void *dst, const void *src, size_t bytes)
{
    if (dst == src)
        return SCAPE_OK;
    TRY(e->x->ops->copy(e->x, dst, src, bytes));
    return e->x->ops->sync(e->x);
}

uint64_t eng_device_bytes(const eng_t *e)
{
    return e ? e->x->ops->device_bytes(e->x) : 0;
}

int eng_device_stuck(const eng_t *e)
{
    return e && e->x->ops->stuck && e->x->ops->stuck(e->x);
}

uint64_t eng_pinned_bytes(const eng_t *e)
{
    return e ? e->x->ops->pinned_bytes(e->x) : 0;
}

eng_executor eng_get_executor(const eng_t *e)
{
    return e ? e->cfg.executor : ENG_EXEC_HOST;
}

uint64_t eng_state_bytes(const eng_t *e)
{
    if (e == NULL)
        return 0;
    uint64_t per = 2 + (uint64_t)e->opt->keeps_v; /* m, theta, (v) */
    return sizeof(float) * (per * (uint64_t)e->a.state_len + (uint64_t)e->p->n);
}

int eng_total_trainers(const eng_t *e) { return e ? e->a.t_total : 0; }

size_t eng_tensor_k(const eng_t *e, size_t l)
{
    return e && l < e->p->ntensors ? e->p->t[l].k : 0;
}

int eng_tensor_owner(const eng_t *e, size_t l)
{
    return e && l < e->p->ntensors ? e->p->t[l].owner : -1;
}

double eng_residual_norm(const eng_t *e)
{
    if (e == NULL)
        return 0.0;
    /* Early packs of the next step (in flight, or undone): the residual as
     * the last step left it; an executor that keeps the figure had it
     * overwritten, one that sums finds it in early_undo for the packed
     * tensors (host memory, comm order). */
    if (e->kept_norm_ok)
        return e->kept_norm; /* 0 for a stale residual, as the executor said */
    if (e->early_step == 0)
        return e->x->ops->residual_norm(e->x);
    if (e->early_stale0)
        return 0.0;
    double s = 0.0;
    for (size_t j = 0; j < e->p->ntensors; j++) {
        const plan_tensor *pt = eng_tensor_at(e, j);
        const float *r = (e->early_done[j] ? e->early_undo : e->a.e) + pt->pos;
        for (size_t i = 0; i < pt->len; i++)
            s += (double)r[i] * (double)r[i];
    }
    return sqrt(s);
}

scape_rc eng_get_residual(const eng_t *e, float *out)
{
    if (e == NULL || out == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_get_residual: NULL argument");
    const void *v = NULL;
    if (!e->a.e_stale)
        TRY(exec_view(e->x, e->a.e, e->p->n * sizeof(float), &v));
    const float *res = v;
    for (size_t l = 0; l < e->p->ntensors; l++) {
        const plan_tensor *t = &e->p->t[l];
        if (e->a.e_stale)
            memset(out + t->off, 0, t->len * sizeof *out);
        else
            memcpy(out + t->off, res + t->pos, t->len * sizeof *out);
    }
    if (v)
        exec_view_free(e->x, v);
    return SCAPE_OK;
}

static int holds(const eng_t *e, const plan_tensor *t)
{
    return t->pos >= e->a.state_base && t->pos < e->a.state_base + e->a.state_len;
}

scape_rc eng_get_state(const eng_t *e, eng_state_vec which, float *out, unsigned char *have)
{
    if (e == NULL || out == NULL || have == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_get_state: NULL argument");
    const float *src = which == ENG_VEC_M ? e->a.m : which == ENG_VEC_V ? e->a.v
                     : which == ENG_VEC_THETA ? e->a.theta : NULL;
    if (src == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_get_state: this optimizer keeps no such vector");
    const void *v;
    TRY(exec_view(e->x, src, e->a.state_len * sizeof(float), &v));
    const float *state = v;
    memset(out, 0, e->p->n * sizeof *out);
    memset(have, 0, e->p->n);
    for (size_t i = 0; i < e->p->ntensors; i++) {
        const plan_tensor *t = &e->p->t[i];
        if (!holds(e, t))
            continue;
        memcpy(out + t->off, state + (t->pos - e->a.state_base), t->len * sizeof *out);
        memset(have + t->off, 1, t->len);
    }
    exec_view_free(e->x, v);
    return SCAPE_OK;
}

scape_rc eng_get_mask(const eng_t *e, unsigned char *bits)
{
    if (e == NULL || bits == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_get_mask: NULL argument");
    const void *v = NULL;
    if (e->a.mask_cur)
        TRY(exec_view(e->x, e->a.mask_cur, e->p->nwords * sizeof(uint32_t), &v));
    const uint32_t *mask = v;
    for (size_t l = 0; l < e->p->ntensors; l++) {
        const plan_tensor *t = &e->p->t[l];
        if (mask == NULL) { /* a dense step: every bit */
            memset(bits + t->off, 1, t->len);
            continue;
        }
        const uint32_t *w = mask + t->word;
        for (size_t i = 0; i < t->len; i++)
            bits[t->off + i] = (unsigned char)((w[i >> 5] >> (i & 31)) & 1u);
    }
    if (v)
        exec_view_free(e->x, v);
    return SCAPE_OK;
}

scape_rc eng_set_inspect(eng_t *e, int on)
{
    if (e == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_set_inspect: engine is NULL");
    if (on && e->ghat == NULL) {
        e->ghat = calloc(e->p->n, sizeof *e->ghat);
        e->ghave = calloc(e->p->n, 1);
        if (e->ghat == NULL || e->ghave == NULL)
            return scape_set_error(SCAPE_NOMEM, "eng_set_inspect: out of memory");
    } else if (!on) {
        free(e->ghat);
        free(e->ghave);
        e->ghat = NULL;
        e->ghave = NULL;
    }
    return SCAPE_OK;
}

scape_rc eng_get_ghat(const eng_t *e, float *out, unsigned char *have)
{
    if (e == NULL || out == NULL || have == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_get_ghat: NULL argument");
    if (e->ghat == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_get_ghat: enable it with eng_set_inspect");
    if (e->last_step == 0)
        return scape_set_error(SCAPE_INVALID, "eng_get_ghat: no step has run");
    for (size_t l = 0; l < e->p->ntensors; l++) {
        const plan_tensor *t = &e->p->t[l];
        memcpy(out + t->off, e->ghat + t->pos, t->len * sizeof *out);
        memcpy(have + t->off, e->ghave + t->pos, t->len);
    }
    return SCAPE_OK;
}

int eng_gathers_bf16(const eng_t *e)
{
    return e && e->vbf16 && e->cfg.mode == ENG_MODE_SHARDED;
}

int eng_gathers_delta(const eng_t *e)
{
    return e && e->vdelta;
}
