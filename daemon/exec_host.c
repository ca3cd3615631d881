/* exec_host.c - the host executor: the CPU kernels of kernels/ on the
 * engine's fork-join pool, every vector in host memory (exec.h).
 *
 * The pack is cut into pieces of intake_chunk coordinates that never
 * straddle tensors and start on a mask word; a piece sums the trainers'
 * gradients into its worker's chunk buffer (or reads a trainer's own buffer
 * when it alone is G_r) and packs it.  Selection, update, compaction and
 * write-back run one tensor per pool item.  Nothing is asynchronous: sync()
 * has nothing to wait for.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "exec.h"
#include "maskcode.h"
#include "scape_formula.h"
#include "try.h"

/* One piece of the pack: coordinates [c, c + len) of tensor j (comm order). */
typedef struct item {
    size_t j, c, len;
    size_t done;         /* values of tensor j packed before this piece */
} item;

typedef struct host_x {
    pool *pool;          /* cfg.threads workers */
    item *items;         /* the pack's pieces, comm order */
    size_t nitems;
    size_t *sel;         /* a partial pack's pieces (indices into items) */
    float *gchunk;       /* one intake chunk per worker */
    const float *g;      /* G_r whole for this step, or NULL: summed per chunk */
    void *topk_scratch;  /* one per worker, topk_scratch_bytes each */
    size_t topk_scratch_bytes;
    float *sstat;        /* defer_select: the statistic at M_t's coordinates of
                            the owned tensors, packed like `send` (K_cap) */
    int stats_parted;    /* this step's packs were partial and each kept the
                            statistic of the owned tensors it packed */
    double begun[ENG_PH_COUNT], spent[ENG_PH_COUNT];
    double *sq;          /* max_grad_norm: the chunks' sums of squares */
    size_t sq_cap;
} host_x;

static host_x *impl(const exec_t *x) { return x->impl; }

/* The least a scattered access moves through host memory: a cache line. */
#define LINE 64

/* Bytes of host memory (the byte model of eng_step_stats.mem_bytes). */
static void count(exec_t *x, uint64_t bytes) { exec_count(x, bytes, 0); }

/* Coordinates, packed values and mask words of comm range [first, +count). */
static void range_sizes(const exec_args *xa, size_t first, size_t n_t, uint64_t *n, uint64_t *k,
                        uint64_t *w)
{
    *n = *k = *w = 0;
    for (size_t j = first; j < first + n_t; j++) {
        *n += exec_tensor_at(xa, j)->len;
        *w += (exec_tensor_at(xa, j)->len + 31) / 32;
    }
    *k = xa->toff[first + n_t] - xa->toff[first];
}

/* vecs vectors read and written at a range's packed values (a line each,
 * scattered) or over all of it, plus reading the values and the mask. */
static void count_masked(exec_t *x, uint64_t n, uint64_t k, uint64_t w, uint64_t vecs)
{
    if (x->a->mask_cur)
        count(x, k * vecs * LINE + 4 * k + 4 * w);
    else
        count(x, n * vecs * 4 + 4 * n);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *worker_scratch(const host_x *h, int w)
{
    return (char *)h->topk_scratch + (size_t)w * h->topk_scratch_bytes;
}

/* ---- life ------------------------------------------------------------------- */

/* Every tensor in comm order cut into intake_chunk coordinates (a multiple
 * of 32, so each piece starts on a mask word). */
static scape_rc plan_items(const exec_args *xa, host_x *h)
{
    const plan *p = xa->p;
    size_t chunk = xa->cfg->intake_chunk, n = 0;
    for (size_t j = 0; j < p->ntensors; j++)
        n += (exec_tensor_at(xa, j)->len + chunk - 1) / chunk;
    h->items = calloc(n ? n : 1, sizeof *h->items);
    if (h->items == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    for (size_t j = 0; j < p->ntensors; j++) {
        size_t len = exec_tensor_at(xa, j)->len;
        for (size_t c = 0; c < len; c += chunk)
            h->items[h->nitems++] = (item){ .j = j, .c = c,
                                            .len = len - c < chunk ? len - c : chunk };
    }
    return SCAPE_OK;
}

static scape_rc host_create(exec_t *x)
{
    exec_args *xa = x->a;
    const plan *p = xa->p;
    size_t n = p->n, w = p->nwords, sl = xa->state_len ? xa->state_len : 1;
    host_x *h = calloc(1, sizeof *h);
    if (h == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    x->impl = h;
    x->host_memory = 1;
    xa->m = calloc(sl, sizeof(float));
    xa->v = xa->opt->keeps_v ? calloc(sl, sizeof(float)) : NULL;
    xa->theta = calloc(sl, sizeof(float));
    xa->e = calloc(n ? n : 1, sizeof(float));
    xa->dense = xa->e;
    xa->send = calloc(xa->k_cap, sizeof(float));
    xa->upd = calloc(xa->k_cap, sizeof(float));
    xa->mask_buf[0] = calloc(w ? w : 1, sizeof(uint32_t));
    xa->mask_buf[1] = calloc(w ? w : 1, sizeof(uint32_t));
    xa->code_all = calloc(xa->code_cap / 4 + 1, sizeof(uint32_t));
    size_t workers = (size_t)xa->cfg->threads;
    h->topk_scratch_bytes = kern_topk_scratch_bytes(p->max_len);
    h->topk_scratch = malloc(h->topk_scratch_bytes ? workers * h->topk_scratch_bytes : 1);
    h->gchunk = calloc(workers * xa->cfg->intake_chunk, sizeof(float));
    int defer = xa->cfg->defer_select && xa->opt->mask == ENG_MASK_LAGGED_M;
    if (defer)
        h->sstat = calloc(xa->k_cap, sizeof(float));
    if (!xa->m || (xa->opt->keeps_v && !xa->v) || !xa->theta || !xa->e || !xa->send || !xa->upd ||
        !xa->mask_buf[0] || !xa->mask_buf[1] || !xa->code_all || !h->topk_scratch ||
        !h->gchunk || (defer && !h->sstat))
        return scape_set_error(SCAPE_NOMEM, "engine: cannot allocate state for N=%zu", n);
    TRY(plan_items(xa, h));
    if ((h->sel = calloc(h->nitems ? h->nitems : 1, sizeof *h->sel)) == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    return pool_create(&h->pool, xa->cfg->threads);
}

static void host_destroy(exec_t *x)
{
    exec_args *xa = x->a;
    host_x *h = impl(x);
    void *bufs[] = { xa->m, xa->v, xa->theta, xa->e, xa->g, xa->send, xa->upd, xa->mask_buf[0],
                     xa->mask_buf[1], xa->code_all };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free(bufs[i]);
    if (h) {
        pool_destroy(&h->pool);
        free(h->items);
        free(h->sel);
        free(h->gchunk);
        free(h->topk_scratch);
        free(h->sstat);
        free(h->sq);
        free(h);
    }
    x->impl = NULL;
}

/* ---- intake and pack ------------------------------------------------------ */

/* G_r whole for topk-adamw (it selects before packing): a trainer's own
 * buffer when it is the only one, else the sum in xa->g. */
static scape_rc host_intake(exec_t *x, const void *const *grads)
{
    exec_args *xa = x->a;
    host_x *h = impl(x);
    if (xa->tr == 1 && xa->gdt == KERN_F32) {
        h->g = grads[0];
        return SCAPE_OK;
    }
    if (xa->g == NULL && (xa->g = calloc(xa->p->n ? xa->p->n : 1, sizeof(float))) == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: cannot allocate the intake buffer");
    for (int j = 0; j < xa->tr; j++)
        TRY(kern_grad_accum(xa->g, grads[j], xa->gdt, xa->p->n, j == 0));
    h->g = xa->g;
    count(x, xa->p->n * ((uint64_t)xa->tr * kern_dtype_size(xa->gdt) + 8 * (uint64_t)xa->tr - 4));
    return SCAPE_OK;
}

/* G_r over coordinates [off, off + len) into buf (a worker's chunk). */
static scape_rc intake_chunk(const exec_args *xa, const void *const *grads, size_t off, size_t len,
                             float *buf)
{
    size_t esz = kern_dtype_size(xa->gdt);
    for (int j = 0; j < xa->tr; j++)
        TRY(kern_grad_accum(buf, (const char *)grads[j] + off * esz, xa->gdt, len, j == 0));
    return SCAPE_OK;
}

typedef struct pack_ctx {
    exec_t *x;
    const float *g;
    const void *const *grads;
    const size_t *sel;   /* the pieces to pack; NULL: every one */
} pack_ctx;

/* Pack one piece, the gradient sum read from g or summed into the worker's
 * chunk buffer.  A stale residual is zero: a dense pack overwrites it, a
 * sparse one zeroes the piece first. */
static scape_rc pack_item(void *ctx, size_t i, int w)
{
    pack_ctx *pc = ctx;
    exec_args *xa = pc->x->a;
    host_x *h = impl(pc->x);
    const item *it = &h->items[pc->sel ? pc->sel[i] : i];
    const plan_tensor *t = exec_tensor_at(xa, it->j);
    const float *g = pc->g ? pc->g + t->off + it->c : NULL;
    if (g == NULL) {
        float *buf = h->gchunk + (size_t)w * xa->cfg->intake_chunk;
        TRY(intake_chunk(xa, pc->grads, t->off + it->c, it->len, buf));
        g = buf;
    }
    size_t k;
    if (!xa->mask_cur)
        return kern_grad_accum(xa->e + t->pos + it->c, g, KERN_F32, it->len, xa->e_stale);
    if (xa->e_stale)
        memset(xa->e + t->pos + it->c, 0, it->len * sizeof *xa->e);
    return (xa->wire_now ? kern_pack_ef_bf16 : kern_pack_ef)(
        g, xa->e + t->pos + it->c, xa->mask_cur + t->word + it->c / 32, it->len,
        xa->send + xa->toff[it->j] + it->done, &k);
}

/* The pieces of the comm-order tensors j with take[j] into h->sel; their
 * coordinates, packed values and mask words into n, k, w. */
static size_t select_items(exec_t *x, const unsigned char *take, uint64_t *n, uint64_t *k,
                           uint64_t *w)
{
    exec_args *xa = x->a;
    host_x *h = impl(x);
    size_t m = 0;
    *n = *k = *w = 0;
    for (size_t j = 0; j < xa->p->ntensors; j++)
        if (take[j]) {
            uint64_t tn, tk, tw;
            range_sizes(xa, j, 1, &tn, &tk, &tw);
            *n += tn;
            *k += tk;
            *w += tw;
        }
    for (size_t i = 0; i < h->nitems; i++)
        if (take[h->items[i].j])
            h->sel[m++] = i;
    return m;
}

/* The pack of the tensors with take[j] (NULL: all); e_stale unchanged. */
static scape_rc pack_run(exec_t *x, const void *const *grads, const unsigned char *take)
{
    exec_args *xa = x->a;
    host_x *h = impl(x);
    const float *g = xa->opt->intake ? h->g : NULL;
    if (g == NULL && xa->tr == 1 && xa->gdt == KERN_F32)
        g = grads[0];
    pack_ctx pc = { x, g, grads, take ? h->sel : NULL };
    uint64_t n = xa->p->n, k = xa->toff[xa->p->ntensors], w = xa->p->nwords;
    size_t nitems = take ? select_items(x, take, &n, &k, &w) : h->nitems;
    /* G (the trainers', summed in a chunk that stays in cache), e read and
     * written, the mask, the packed values */
    uint64_t gread = g ? 4 * n : n * (uint64_t)xa->tr * kern_dtype_size(xa->gdt);
    count(x, gread + 4 * n * (uint64_t)(1 + (!xa->e_stale || xa->mask_cur != NULL)) +
                 (xa->mask_cur ? 4 * w + 4 * k : 0));
    return pool_run(h->pool, nitems, pack_item, &pc);
}

static scape_rc keep_stats_taken(exec_t *x, const unsigned char *take);

static scape_rc host_pack(exec_t *x, const void *const *grads, int select_due)
{
    (void)select_due; /* the selection reads a back from e and send */
    impl(x)->stats_parted = 0; /* keep_stats takes every owned tensor's */
    TRY(pack_run(x, grads, NULL));
    /* dense: e now holds a, and after the reduction the sums */
    x->a->e_stale = x->a->mask_cur == NULL;
    return SCAPE_OK;
}

/* A deferred selection's statistic needs only the tensor's own pack and m
 * (unchanged until the update): a partial pack keeps it for the owned
 * tensors it packed, so early packs take it off the step's path too. */
static scape_rc host_pack_part(exec_t *x, const void *const *grads, const unsigned char *take,
                               int select_due)
{
    exec_args *xa = x->a;
    TRY(pack_run(x, grads, take));
    if (!select_due || xa->mask_cur == NULL || !xa->cfg->defer_select ||
        xa->opt->mask != ENG_MASK_LAGGED_M)
        return SCAPE_OK;
    impl(x)->stats_parted = 1;
    return keep_stats_taken(x, take);
}

/* ---- offsets ---------------------------------------------------------------- */

static scape_rc count_item(void *ctx, size_t i, int w)
{
    exec_t *x = ctx;
    exec_args *xa = x->a;
    item *it = &impl(x)->items[i];
    (void)w;
    if (!xa->mask_cur) {
        it->done = it->len;
        return SCAPE_OK;
    }
    return kern_mask_popcount(xa->mask_cur + exec_tensor_at(xa, it->j)->word + it->c / 32,
                              it->len, &it->done);
}

/* toff[j]: where tensor j (comm order) starts among the packed values; and
 * for each pack piece, the values of its tensor before it. */
static scape_rc host_offsets(exec_t *x, size_t *k_out)
{
    exec_args *xa = x->a;
    host_x *h = impl(x);
    if (xa->mask_cur)
        count(x, 4 * xa->p->nwords);
    TRY(pool_run(h->pool, h->nitems, count_item, x));
    xa->toff[0] = 0;
    size_t j = 0, before = 0; /* values of tensor j in the pieces so far */
    for (size_t i = 0; i < h->nitems; i++) {
        item *it = &h->items[i];
        if (it->j != j) {
            xa->toff[j + 1] = xa->toff[j] + before;
            j = it->j;
            before = 0;
        }
        size_t k = it->done;
        it->done = before;
        before += k;
    }
    xa->toff[j + 1] = xa->toff[j] + before;
    *k_out = xa->toff[xa->p->ntensors];
    return SCAPE_OK;
}

/* ---- selection --------------------------------------------------------------- */

/* SCAPE: exact top-k of the statistic over the owned tensors -> M_{t+1}.
 * Right after the pack, from the a = G + e it left in e and `send`; or,
 * deferred, from e and the statistic keep_stats took at the mask's
 * coordinates before the update changed m there. */
static scape_rc select_tensor(void *ctx, size_t i, int w)
{
    exec_t *x = ctx;
    exec_args *xa = x->a;
    host_x *h = impl(x);
    size_t j = xa->p->shard[xa->rank].first + i;
    const plan_tensor *t = exec_tensor_at(xa, j);
    const uint32_t *sent = xa->mask_cur ? xa->mask_cur + t->word : NULL;
    const float *m = xa->m + (t->pos - xa->state_base);
    if (xa->select_pending)
        return kern_topk_prestat(m, xa->e + t->pos, sent, h->sstat + xa->toff[j], t->len,
                                 xa->cfg->hyper.beta1, (float)xa->sel_tr, t->k,
                                 xa->mask_next + t->word, worker_scratch(h, w),
                                 h->topk_scratch_bytes);
    return kern_topk_packed(m, xa->e + t->pos, sent, sent ? xa->send + xa->toff[j] : NULL, t->len,
                            xa->cfg->hyper.beta1, (float)xa->tr, t->k, xa->mask_next + t->word,
                            worker_scratch(h, w), h->topk_scratch_bytes);
}

/* Bytes of a selection over comm range [first, +count): the radix select
 * reads m, e and the packed values twice for most inputs (its histogram
 * pass and its finishing pass; more when ties crowd one bucket), and writes
 * the mask words. */
static void count_select(exec_t *x, size_t first, size_t n_t, int with_m)
{
    uint64_t n, k, w;
    range_sizes(x->a, first, n_t, &n, &k, &w);
    count(x, 2 * ((with_m ? 8 : 4) * n + 4 * k + 4 * w) + 4 * w);
}

static scape_rc host_select(exec_t *x)
{
    exec_args *xa = x->a;
    const plan_shard *me = &xa->p->shard[xa->rank];
    count_select(x, me->first, me->count, 1);
    return pool_run(impl(x)->pool, me->count, select_tensor, x);
}

/* defer_select: the statistic at M_t's coordinates of one owned tensor,
 * while m there and the packed a still hold what the selection needs. */
static scape_rc keep_stat_tensor(void *ctx, size_t i, int w)
{
    exec_t *x = ctx;
    exec_args *xa = x->a;
    size_t j = xa->p->shard[xa->rank].first + i;
    const plan_tensor *t = exec_tensor_at(xa, j);
    (void)w;
    return kern_stat_packed_rest(xa->m + (t->pos - xa->state_base), xa->mask_cur + t->word,
                                 xa->send + xa->toff[j], xa->wire_now ? xa->e + t->pos : NULL,
                                 t->len, xa->cfg->hyper.beta1, (float)xa->tr,
                                 impl(x)->sstat + xa->toff[j]);
}

typedef struct stat_ctx {
    exec_t *x;
    const unsigned char *take; /* comm order; NULL: every owned tensor */
} stat_ctx;

static scape_rc keep_stat_taken(void *ctx, size_t i, int w)
{
    stat_ctx *sc = ctx;
    const exec_args *xa = sc->x->a;
    size_t j = xa->p->shard[xa->rank].first + i;
    return sc->take && !sc->take[j] ? SCAPE_OK : keep_stat_tensor(sc->x, i, w);
}

/* The statistic of the owned tensors j with take[j] (NULL: all). */
static scape_rc keep_stats_taken(exec_t *x, const unsigned char *take)
{
    exec_args *xa = x->a;
    const plan_shard *me = &xa->p->shard[xa->rank];
    for (size_t j = me->first; j < me->first + me->count; j++)
        if (take == NULL || take[j]) {
            uint64_t n, k, w;
            range_sizes(xa, j, 1, &n, &k, &w);
            count(x, k * LINE + 8 * k + 4 * w); /* m at the mask, a read, the statistic */
        }
    stat_ctx sc = { x, take };
    return pool_run(impl(x)->pool, me->count, keep_stat_taken, &sc);
}

static scape_rc host_keep_stats(exec_t *x)
{
    host_x *h = impl(x);
    if (h->stats_parted) { /* every partial pack of the step kept its part */
        h->stats_parted = 0;
        return SCAPE_OK;
    }
    return keep_stats_taken(x, NULL);
}

/* topk-adamw: each rank's top-k of |a_r| per tensor into the spare buffer. */
static scape_rc own_topk_tensor(void *ctx, size_t i, int w)
{
    exec_t *x = ctx;
    exec_args *xa = x->a;
    host_x *h = impl(x);
    const plan_tensor *t = &xa->p->t[i];
    return kern_topk_ef(NULL, h->g + t->off, xa->e + t->pos, t->len, 0.0f, 1.0f, t->k,
                        xa->mask_buf[1] + t->word, worker_scratch(h, w), h->topk_scratch_bytes);
}

static scape_rc host_own_topk(exec_t *x)
{
    exec_args *xa = x->a;
    if (xa->e_stale) {
        memset(xa->e, 0, xa->p->n * sizeof *xa->e);
        xa->e_stale = 0;
    }
    count_select(x, 0, xa->p->ntensors, 0);
    return pool_run(impl(x)->pool, xa->p->ntensors, own_topk_tensor, x);
}

static scape_rc host_encode(exec_t *x, size_t first, size_t n_t, const uint32_t *words,
                            uint32_t *code)
{
    uint64_t n, k, w;
    range_sizes(x->a, first, n_t, &n, &k, &w);
    count(x, 4 * w + mcode_bytes(x->a->p, first, n_t));
    return mcode_encode(x->a->p, first, n_t, words, code);
}

static scape_rc host_decode(exec_t *x, size_t first, size_t n_t, const uint32_t *code,
                            size_t nbytes, uint32_t *words, int merge, int from)
{
    uint64_t n, k, w;
    range_sizes(x->a, first, n_t, &n, &k, &w);
    count(x, 4 * w + nbytes);
    return mcode_decode(x->a->p, first, n_t, code, nbytes, words, merge, from);
}

static scape_rc host_mask_zero(exec_t *x, uint32_t *words)
{
    memset(words, 0, x->a->p->nwords * sizeof *words);
    return SCAPE_OK;
}

static scape_rc host_churn(exec_t *x, const uint32_t *cur, const uint32_t *prev)
{
    exec_args *xa = x->a;
    uint64_t fresh = 0, total = 0;
    for (size_t w = 0; w < xa->p->nwords; w++) {
        fresh += (uint64_t)__builtin_popcount(cur[w] & ~prev[w]);
        total += (uint64_t)__builtin_popcount(cur[w]);
    }
    xa->stats->mask_churn = total ? (double)fresh / (double)total : 0.0;
    count(x, 8 * xa->p->nwords);
    return SCAPE_OK;
}

/* ---- update, compaction, write-back ------------------------------------- */

typedef struct update_ctx {
    exec_args *xa;
    size_t first;
    uint64_t t;
    float *dst;  /* compact */
    const float *src;       /* write_back */
    void *const *params;
} update_ctx;

static scape_rc update_tensor(void *ctx, size_t i, int w)
{
    update_ctx *u = ctx;
    exec_args *xa = u->xa;
    const plan_tensor *t = exec_tensor_at(xa, u->first + i);
    size_t s = t->pos - xa->state_base;
    const float *sum = xa->sum + xa->toff[u->first + i];
    const uint32_t *mask = xa->mask_cur ? xa->mask_cur + t->word : NULL;
    float div = (float)xa->t_total;
    kern_hyper hc = xa->cfg->hyper;
    const kern_hyper *h = &hc;
    hc.clip = xa->clip;
    hc.wd = xa->gwd[t->group];
    float lr = xa->glr[t->group];
    (void)w;
    return kern_update((int)xa->opt->update, xa->theta + s, xa->m + s, xa->v ? xa->v + s : NULL,
                       sum, div, mask, t->len, h, lr, u->t);
}

static scape_rc host_update(exec_t *x, size_t first, size_t n_t, uint64_t t)
{
    update_ctx u = { .xa = x->a, .first = first, .t = t };
    uint64_t n, k, w;
    range_sizes(x->a, first, n_t, &n, &k, &w);
    count_masked(x, n, k, w, 2 * (x->a->opt->keeps_v ? 3 : 2)); /* theta, m (v) read, written */
    return pool_run(impl(x)->pool, n_t, update_tensor, &u);
}

typedef struct sq_ctx {
    const float *in;
    size_t n;
    float div;
    double *part;
} sq_ctx;

static scape_rc sq_chunk(void *ctx, size_t c, int w)
{
    const sq_ctx *q = ctx;
    size_t left = q->n - c * SCAPE_SQ_CHUNK;
    (void)w;
    q->part[c] = scape_f_sqsum_chunk(q->in + c * SCAPE_SQ_CHUNK,
                                     left < SCAPE_SQ_CHUNK ? left : SCAPE_SQ_CHUNK, q->div);
    return SCAPE_OK;
}

static scape_rc host_grad_sqsums(exec_t *x, const void *const *grads, double *out)
{
    exec_args *xa = x->a;
    count(x, xa->p->n * (uint64_t)xa->tr * kern_dtype_size(xa->gdt));
    return eng_grad_sqsums(xa, impl(x)->pool, grads, out);
}

/* The chunks on the pool, their totals added in order. */
static scape_rc host_sqsum(exec_t *x, size_t first, size_t n_t, double *out)
{
    exec_args *xa = x->a;
    host_x *h = impl(x);
    sq_ctx q = { .in = xa->sum + xa->toff[first], .n = xa->toff[first + n_t] - xa->toff[first],
                 .div = (float)xa->t_total };
    size_t nc = (q.n + SCAPE_SQ_CHUNK - 1) / SCAPE_SQ_CHUNK;
    if (nc > h->sq_cap) {
        double *p = realloc(h->sq, nc * sizeof *p);
        if (p == NULL)
            return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
        h->sq = p;
        h->sq_cap = nc;
    }
    q.part = h->sq;
    count(x, 4 * q.n);
    TRY(pool_run(h->pool, nc, sq_chunk, &q));
    double total = 0.0;
    for (size_t c = 0; c < nc; c++)
        total += h->sq[c];
    *out = total;
    return SCAPE_OK;
}

static scape_rc compact_tensor(void *ctx, size_t i, int w)
{
    update_ctx *u = ctx;
    exec_args *xa = u->xa;
    size_t j = u->first + i, k;
    (void)w;
    const plan_tensor *t = exec_tensor_at(xa, j);
    float *th = xa->theta + (t->pos - xa->state_base);
    kern_dtype dt = xa->pub_bf16 ? KERN_BF16 : KERN_F32;
    void *dst = (char *)u->dst + xa->toff[j] * kern_dtype_size(dt);
    if (xa->pub_delta)
        return kern_mask_compact_delta(th, (const float *)u->params[0] + t->off,
                                       xa->mask_cur + t->word, t->len, dst, &k);
    if (xa->mask_cur)
        return kern_mask_compact_dt(th, xa->mask_cur + t->word, t->len, dst, dt, &k);
    if (dt == KERN_BF16)
        return kern_f32_to_bf16(th, dst, t->len);
    if (dst != th)
        memcpy(dst, th, t->len * sizeof *th);
    return SCAPE_OK;
}

static scape_rc host_compact(exec_t *x, size_t first, size_t n_t, float *dst,
                             void *const *params)
{
    update_ctx u = { .xa = x->a, .first = first, .dst = dst, .params = params };
    uint64_t n, k, w;
    range_sizes(x->a, first, n_t, &n, &k, &w);
    count_masked(x, n, k, w, 1);
    if (x->a->pub_delta)
        count(x, k * LINE); /* trainer 0's old values */
    return pool_run(impl(x)->pool, n_t, compact_tensor, &u);
}

/* Item j * T_r + q: tensor j (comm order) into trainer q's buffer. */
static scape_rc write_back_item(void *ctx, size_t i, int w)
{
    update_ctx *b = ctx;
    exec_args *xa = b->xa;
    size_t j = i / (size_t)xa->tr;
    int q = (int)(i % (size_t)xa->tr);
    (void)w;
    const plan_tensor *t = exec_tensor_at(xa, j);
    char *dst = (char *)b->params[q] + t->off * kern_dtype_size(xa->pdt);
    kern_dtype sdt = xa->pub_bf16 ? KERN_BF16 : KERN_F32;
    const void *src = (const char *)b->src + xa->toff[j] * kern_dtype_size(sdt);
    if (xa->pub_delta)
        return kern_mask_expand_delta(src, xa->mask_cur + t->word, t->len, (float *)dst);
    if (xa->mask_cur)
        return kern_mask_expand_dt(src, sdt, xa->mask_cur + t->word, t->len, dst, xa->pdt);
    if (xa->pdt == sdt) {
        memcpy(dst, src, t->len * kern_dtype_size(sdt));
        return SCAPE_OK;
    }
    return kern_f32_to_bf16(src, (uint16_t *)(void *)dst, t->len);
}

static scape_rc host_write_back(exec_t *x, const float *src, void *const *params)
{
    exec_args *xa = x->a;
    update_ctx b = { .xa = xa, .src = src, .params = params };
    uint64_t n = xa->p->n, k = xa->toff[xa->p->ntensors];
    count_masked(x, n, k, xa->p->nwords, 0);
    count(x, (uint64_t)xa->tr * (xa->mask_cur ? k * LINE : n * kern_dtype_size(xa->pdt)));
    return pool_run(impl(x)->pool, xa->p->ntensors * (size_t)xa->tr, write_back_item, &b);
}

static scape_rc host_replan(exec_t *x)
{
    (void)x; /* the kernels read k_l from the plan itself */
    return SCAPE_OK;
}

static scape_rc host_load_theta(exec_t *x, const void *src)
{
    exec_args *xa = x->a;
    count(x, xa->state_len * (4 + kern_dtype_size(xa->pdt)));
    for (size_t i = 0; i < xa->p->ntensors; i++) {
        const plan_tensor *t = &xa->p->t[i];
        if (t->pos < xa->state_base || t->pos >= xa->state_base + xa->state_len)
            continue;
        float *dst = xa->theta + (t->pos - xa->state_base);
        if (xa->pdt == KERN_F32)
            memcpy(dst, (const float *)src + t->off, t->len * sizeof(float));
        else
            TRY(kern_bf16_to_f32((const uint16_t *)src + t->off, dst, t->len));
    }
    return SCAPE_OK;
}

/* ---- memory, time ---------------------------------------------------------- */

static scape_rc host_copy(exec_t *x, void *dst, const void *src, size_t bytes)
{
    (void)x;
    if (bytes && dst != src)
        memmove(dst, src, bytes);
    return SCAPE_OK;
}

static scape_rc host_zero(exec_t *x, void *dst, size_t bytes)
{
    (void)x;
    if (bytes)
        memset(dst, 0, bytes);
    return SCAPE_OK;
}

static scape_rc host_sync(exec_t *x)
{
    (void)x;
    return SCAPE_OK;
}

static void host_mark(exec_t *x, eng_phase ph, int end)
{
    host_x *h = impl(x);
    if (end) {
        h->spent[ph] += now_s() - h->begun[ph];
    } else {
        h->begun[ph] = now_s();
        x->phase = ph;
    }
}

static void host_times(exec_t *x, double *phase_s)
{
    host_x *h = impl(x);
    for (int p = 0; p < ENG_PH_COUNT; p++) {
        phase_s[p] += h->spent[p];
        h->spent[p] = 0.0;
    }
}

static double host_residual_norm(exec_t *x)
{
    const exec_args *xa = x->a;
    double s = 0.0;
    for (size_t i = 0; !xa->e_stale && i < xa->p->n; i++)
        s += (double)xa->e[i] * (double)xa->e[i];
    return sqrt(s);
}

static uint64_t host_no_bytes(const exec_t *x)
{
    (void)x;
    return 0;
}

const exec_ops exec_host_ops = {
    .name = "host",
    .create = host_create,
    .destroy = host_destroy,
    .intake = host_intake,
    .pack = host_pack,
    .pack_part = host_pack_part,
    .keep_stats = host_keep_stats,
    .select = host_select,
    .own_topk = host_own_topk,
    .encode = host_encode,
    .decode = host_decode,
    .mask_zero = host_mask_zero,
    .churn = host_churn,
    .offsets = host_offsets,
    .update = host_update,
    .sqsum = host_sqsum,
    .grad_sqsums = host_grad_sqsums,
    .compact = host_compact,
    .write_back = host_write_back,
    .replan = host_replan,
    .load_theta = host_load_theta,
    .copy = host_copy,
    .zero = host_zero,
    .sync = host_sync,
    .mark = host_mark,
    .times = host_times,
    .residual_norm = host_residual_norm,
    .device_bytes = host_no_bytes,
    .pinned_bytes = host_no_bytes,
};
