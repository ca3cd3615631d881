/* plan.c - layout validation, ownership and comm order. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"

size_t plan_k(double rho, size_t len)
{
    /* rho * len carries the rounding of rho itself (0.07 * 100 is 7.000000000000001
     * in double); shaving a relative 1e-12 keeps exact products exact. */
    double x = rho * (double)len;
    double k = ceil(x - x * 1e-12);
    if (k < 1.0)
        return 1;
    return k > (double)len ? len : (size_t)k;
}

/* A sort key with its tensor index; the index breaks ties so sorts are
 * deterministic without a context pointer (engines run in many threads). */
typedef struct keyed {
    size_t key, idx;
} keyed;

static int by_key_asc(const void *a, const void *b)
{
    const keyed *x = a, *y = b;
    if (x->key != y->key)
        return (x->key > y->key) - (x->key < y->key);
    return (x->idx > y->idx) - (x->idx < y->idx);
}

static int by_key_desc(const void *a, const void *b)
{
    const keyed *x = a, *y = b;
    if (x->key != y->key)
        return (x->key < y->key) - (x->key > y->key);
    return (x->idx > y->idx) - (x->idx < y->idx);
}

/* Check that the tensors tile [0, N) exactly; idx receives them by offset. */
static scape_rc check_tiling(const eng_tensor *ts, size_t nt, keyed *idx, size_t *n_out)
{
    for (size_t i = 0; i < nt; i++) {
        if (ts[i].length == 0)
            return scape_set_error(SCAPE_INVALID, "layout: tensor %zu (%s) has length 0",
                                   i, ts[i].name ? ts[i].name : "?");
        if (ts[i].offset > SIZE_MAX - ts[i].length)
            return scape_set_error(SCAPE_INVALID, "layout: tensor %zu overflows", i);
        idx[i] = (keyed){ ts[i].offset, i };
    }
    qsort(idx, nt, sizeof *idx, by_key_asc);
    size_t next = 0;
    for (size_t j = 0; j < nt; j++) {
        const eng_tensor *t = &ts[idx[j].idx];
        if (t->offset != next)
            return scape_set_error(SCAPE_INVALID,
                                   "layout does not tile [0, N): tensor %zu (%s) starts at "
                                   "%zu, expected %zu (%s)",
                                   idx[j].idx, t->name ? t->name : "?", t->offset, next,
                                   t->offset < next ? "overlap" : "gap");
        next += t->length;
    }
    if (next > (size_t)UINT32_MAX)
        return scape_set_error(SCAPE_INVALID, "layout: N=%zu exceeds 2^32-1", next);
    *n_out = next;
    return SCAPE_OK;
}

/* Greedy balance: largest tensor first (ties: lower index) to the least
 * loaded rank (ties: lower rank). */
static scape_rc assign_owners(plan *p)
{
    size_t nt = p->ntensors;
    keyed *by_len = malloc(nt * sizeof *by_len);
    size_t *load = calloc((size_t)p->nranks, sizeof *load);
    if (!by_len || !load) {
        free(by_len);
        free(load);
        return scape_set_error(SCAPE_NOMEM, "layout: out of memory");
    }
    for (size_t i = 0; i < nt; i++)
        by_len[i] = (keyed){ p->t[i].len, i };
    qsort(by_len, nt, sizeof *by_len, by_key_desc);
    for (size_t a = 0; a < nt; a++) {
        int r_min = 0;
        for (int r = 1; r < p->nranks; r++)
            if (load[r] < load[r_min])
                r_min = r;
        p->t[by_len[a].idx].owner = r_min;
        load[r_min] += by_len[a].key;
    }
    free(by_len);
    free(load);
    return SCAPE_OK;
}

/* Lay out comm order: shards in rank order, tensors by offset inside. */
static void lay_out(plan *p, const keyed *by_off)
{
    size_t j = 0, word = 0, pos = 0;
    for (int r = 0; r < p->nranks; r++) {
        plan_shard *s = &p->shard[r];
        s->first = j;
        s->word0 = word;
        s->pos0 = pos;
        for (size_t i = 0; i < p->ntensors; i++) {
            plan_tensor *t = &p->t[by_off[i].idx];
            if (t->owner != r)
                continue;
            p->order[j++] = by_off[i].idx;
            t->word = word;
            t->pos = pos;
            word += kern_mask_words(t->len);
            pos += t->len;
        }
        s->count = j - s->first;
        s->words = word - s->word0;
        s->len = pos - s->pos0;
    }
    p->nwords = word;
}

uint64_t plan_fnv1a(uint64_t h, const void *data, size_t len)
{
    const unsigned char *b = data;
    for (size_t i = 0; i < len; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static uint64_t layout_hash(const plan *p)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < p->ntensors; i++) {
        uint64_t ol[2] = { p->t[i].off, p->t[i].len };
        h = plan_fnv1a(h, ol, sizeof ol);
        if (p->t[i].group) /* a layout without groups hashes as before */
            h = plan_fnv1a(h, &p->t[i].group, sizeof p->t[i].group);
        if (p->t[i].name)
            h = plan_fnv1a(h, p->t[i].name, strlen(p->t[i].name) + 1);
    }
    return h;
}

void plan_destroy(plan **pp)
{
    if (pp == NULL || *pp == NULL)
        return;
    plan *p = *pp;
    free(p->t);
    free(p->order);
    free(p->shard);
    free(p);
    *pp = NULL;
}

scape_rc plan_build(plan **out, const eng_tensor *ts, size_t nt, int nranks, double rho)
{
    if (out == NULL || ts == NULL)
        return scape_set_error(SCAPE_INVALID, "layout: NULL argument");
    if (nt == 0)
        return scape_set_error(SCAPE_INVALID, "layout: no tensors");
    if (nranks < 1)
        return scape_set_error(SCAPE_INVALID, "layout: nranks=%d must be >= 1", nranks);
    if (!(rho > 0.0 && rho <= 1.0))
        return scape_set_error(SCAPE_INVALID, "rho=%g must be in (0, 1]", rho);
    plan *p = calloc(1, sizeof *p);
    keyed *by_off = malloc(nt * sizeof *by_off);
    if (p) {
        p->t = calloc(nt, sizeof *p->t);
        p->order = calloc(nt, sizeof *p->order);
        p->shard = calloc((size_t)nranks, sizeof *p->shard);
    }
    if (!p || !by_off || !p->t || !p->order || !p->shard) {
        free(by_off);
        plan_destroy(&p);
        return scape_set_error(SCAPE_NOMEM, "layout: out of memory (%zu tensors)", nt);
    }
    scape_rc rc = check_tiling(ts, nt, by_off, &p->n);
    if (rc != SCAPE_OK) {
        free(by_off);
        plan_destroy(&p);
        return rc;
    }
    p->ntensors = nt;
    p->nranks = nranks;
    for (size_t i = 0; i < nt; i++) {
        plan_tensor *t = &p->t[i];
        t->name = ts[i].name;
        t->off = ts[i].offset;
        t->len = ts[i].length;
        t->group = ts[i].group;
        if (t->len > p->max_len)
            p->max_len = t->len;
    }
    plan_set_rho(p, rho);
    rc = assign_owners(p);
    if (rc != SCAPE_OK) {
        free(by_off);
        plan_destroy(&p);
        return rc;
    }
    lay_out(p, by_off);
    p->hash = layout_hash(p);
    free(by_off);
    *out = p;
    return SCAPE_OK;
}

void plan_set_rho(plan *p, double rho)
{
    p->k_total = 0;
    for (size_t i = 0; i < p->ntensors; i++) {
        size_t len = p->t[i].len;
        p->t[i].k = len <= p->dense_below ? len : plan_k(rho, len);
        p->k_total += p->t[i].k;
    }
}

void plan_set_dense(plan *p, size_t dense_below, double rho)
{
    p->dense_below = dense_below;
    plan_set_rho(p, rho);
}

/* The halvings from rho_start down to rho: the least h >= 1 with
 * rho_start / 2^h <= rho (exact: halving a double is). */
static uint32_t schedule_halvings(double rho_start, double rho)
{
    uint32_t h = 1;
    for (double r = rho_start / 2.0; r > rho && h < 64; r /= 2.0)
        h++;
    return h;
}

double plan_rho_at(const eng_config *c, uint64_t t)
{
    if (!(c->rho_start > 0.0) || t <= c->warmup)
        return c->rho;
    uint64_t u = t - c->warmup - 1, steps = c->rho_steps ? c->rho_steps : 1;
    uint64_t h = schedule_halvings(c->rho_start, c->rho);
    if (u >= steps)
        return c->rho;
    uint64_t stage = u * h / steps; /* u < steps < 2^32, h <= 64: no overflow */
    double r = ldexp(c->rho_start, -(int)stage);
    return r > c->rho ? r : c->rho;
}
