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

/* Over the registered tensors, in layout order: pieces do not change it. */
static uint64_t layout_hash(const eng_tensor *ts, size_t nt)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < nt; i++) {
        uint64_t ol[2] = { ts[i].offset, ts[i].length };
        h = plan_fnv1a(h, ol, sizeof ol);
        if (ts[i].group) /* a layout without groups hashes as before */
            h = plan_fnv1a(h, &ts[i].group, sizeof ts[i].group);
        if (ts[i].name)
            h = plan_fnv1a(h, ts[i].name, strlen(ts[i].name) + 1);
    }
    return h;
}

scape_rc plan_chunks(const plan *p, size_t coords, size_t **of_out, size_t **run_out,
                     size_t *nchunks)
{
    size_t nt = p->ntensors, R = (size_t)p->nranks;
    keyed *k = malloc((nt ? nt : 1) * sizeof *k);
    size_t *lchunk = malloc((nt ? nt : 1) * sizeof *lchunk);
    size_t *of = malloc((nt ? nt : 1) * sizeof *of);
    if (k == NULL || lchunk == NULL || of == NULL) {
        free(k);
        free(lchunk);
        free(of);
        return scape_set_error(SCAPE_NOMEM, "layout: out of memory (%zu tensors)", nt);
    }
    for (size_t i = 0; i < nt; i++)
        k[i] = (keyed){ p->t[i].off, i };
    qsort(k, nt, sizeof *k, by_key_desc);
    size_t c = 0, acc = 0;
    for (size_t q = 0; q < nt; q++) {
        if (acc >= coords) {
            c++;
            acc = 0;
        }
        lchunk[k[q].idx] = c;
        acc += p->t[k[q].idx].len;
    }
    free(k);
    size_t nc = nt ? c + 1 : 0, nrun = 2 * R * nc;
    size_t *run = malloc((nrun ? nrun : 1) * sizeof *run);
    if (run == NULL) {
        free(lchunk);
        free(of);
        return scape_set_error(SCAPE_NOMEM, "layout: out of memory (%zu chunks)", nc);
    }
    for (size_t s = 0; s < R; s++) {
        const plan_shard *sh = &p->shard[s];
        for (size_t q = 0; q < nc; q++)
            run[2 * (R * q + s)] = run[2 * (R * q + s) + 1] = sh->first;
        /* by offset in the shard, so a chunk's tensors follow each other */
        for (size_t j = sh->first; j < sh->first + sh->count; j++) {
            size_t *r = &run[2 * (R * lchunk[p->order[j]] + s)];
            of[j] = lchunk[p->order[j]];
            if (r[0] == r[1])
                r[0] = j;
            r[1] = j + 1;
        }
    }
    free(lchunk);
    *of_out = of;
    *run_out = run;
    *nchunks = nc;
    return SCAPE_OK;
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

size_t plan_pieces(size_t len, size_t split_above)
{
    if (split_above == 0 || len <= split_above)
        return 1;
    return len / split_above + (len % split_above != 0);
}

/* Registered tensor i's pieces into t (np of them, nearly equal: piece q
 * starts at floor(q * len / np), so none is longer than split_above). */
static void fill_pieces(plan_tensor *t, const eng_tensor *ts, size_t i, size_t np)
{
    size_t len = ts[i].length;
    for (size_t q = 0; q < np; q++) {
        size_t a = (size_t)((uint64_t)len * q / np); /* len < 2^32: no overflow */
        size_t b = (size_t)((uint64_t)len * (q + 1) / np);
        t[q] = (plan_tensor){ .name = ts[i].name, .off = ts[i].offset + a, .len = b - a,
                              .group = ts[i].group, .parent = i, .whole = len };
    }
}

/* The most tensors splitting may make: each costs a mask word, a plan entry
 * and a task in every phase, so pieces far shorter than N / 2^19 only add
 * overhead. */
#define PLAN_MAX_PIECES (1 << 20)

/* The plan's tensors (pieces) from the validated layout; by_off gets them
 * by offset. */
static scape_rc make_pieces(plan *p, const eng_tensor *ts, size_t nt, keyed **by_off)
{
    size_t np = 0;
    for (size_t i = 0; i < nt; i++)
        np += plan_pieces(ts[i].length, p->split_above);
    if (np > nt && np > PLAN_MAX_PIECES)
        return scape_set_error(SCAPE_INVALID, "split_above=%zu cuts the layout (N=%zu) into %zu "
                               "tensors, more than %d: raise split_above to at least %zu",
                               p->split_above, p->n, np, PLAN_MAX_PIECES,
                               p->n / (PLAN_MAX_PIECES / 2) + 1);
    p->t = calloc(np, sizeof *p->t);
    p->order = calloc(np, sizeof *p->order);
    *by_off = malloc(np * sizeof **by_off);
    if (!p->t || !p->order || !*by_off)
        return scape_set_error(SCAPE_NOMEM, "layout: out of memory (%zu tensors)", np);
    p->ntensors = np;
    for (size_t i = 0, j = 0; i < nt; i++) {
        size_t n = plan_pieces(ts[i].length, p->split_above);
        fill_pieces(p->t + j, ts, i, n);
        j += n;
    }
    for (size_t j = 0; j < np; j++) {
        (*by_off)[j] = (keyed){ p->t[j].off, j };
        if (p->t[j].len > p->max_len)
            p->max_len = p->t[j].len;
    }
    qsort(*by_off, np, sizeof **by_off, by_key_asc);
    return SCAPE_OK;
}

static scape_rc build(plan *p, const eng_tensor *ts, size_t nt, double rho)
{
    keyed *by_off = malloc(nt * sizeof *by_off);
    if (by_off == NULL)
        return scape_set_error(SCAPE_NOMEM, "layout: out of memory (%zu tensors)", nt);
    scape_rc rc = check_tiling(ts, nt, by_off, &p->n);
    free(by_off);
    by_off = NULL;
    if (rc == SCAPE_OK)
        rc = make_pieces(p, ts, nt, &by_off);
    if (rc == SCAPE_OK) {
        plan_set_rho(p, rho);
        rc = assign_owners(p);
    }
    if (rc == SCAPE_OK) {
        lay_out(p, by_off);
        p->hash = layout_hash(ts, nt);
    }
    free(by_off);
    return rc;
}

scape_rc plan_build_split(plan **out, const eng_tensor *ts, size_t nt, int nranks, double rho,
                          size_t split_above)
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
    if (p)
        p->shard = calloc((size_t)nranks, sizeof *p->shard);
    if (!p || !p->shard) {
        plan_destroy(&p);
        return scape_set_error(SCAPE_NOMEM, "layout: out of memory (%zu tensors)", nt);
    }
    p->nreg = nt;
    p->nranks = nranks;
    p->split_above = split_above;
    scape_rc rc = build(p, ts, nt, rho);
    if (rc != SCAPE_OK) {
        plan_destroy(&p);
        return rc;
    }
    *out = p;
    return SCAPE_OK;
}

scape_rc plan_build(plan **out, const eng_tensor *ts, size_t nt, int nranks, double rho)
{
    return plan_build_split(out, ts, nt, nranks, rho, 0);
}

void plan_set_rho(plan *p, double rho)
{
    p->k_total = 0;
    for (size_t i = 0; i < p->ntensors; i++) {
        size_t len = p->t[i].len;
        p->t[i].k = p->t[i].whole <= p->dense_below ? len : plan_k(rho, len);
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
