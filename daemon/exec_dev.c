/* exec_dev.c - the device executor: the step's per-coordinate work as the
 * segmented kernels of kernels/scape_seg.h on a device (dev.h): the CUDA
 * one (executor cuda) or its CPU model (executor sim), which runs this very
 * code in the CPU tests.
 *
 * Memory.  m, theta (v), send, upd, both masks, the gathered mask codes, the
 * selection keys and the kernels' tables live in device memory.  The
 * residual lives in pinned host memory, in comm order, and streams through
 * the device in chunks of about residual_chunk coordinates (whole mask
 * words), two slots: on
 * stream IN chunk c+1 is copied into its slot while MAIN packs chunk c and
 * OUT copies chunk c-1 back.  residual_on_device keeps it in device memory
 * instead, where a dense step packs in place in it; otherwise a dense step
 * packs into a device buffer of N floats (`wide`).
 *
 * The step.  Everything is enqueued on MAIN in the engine's order, and the
 * host waits once, in sync() at the end of the step (and where a collective
 * needs host copies).  The plan fixes SCAPE's packed offsets (k_l per
 * tensor), so no count goes back to the host; a scan of the mask per tile
 * gives each set bit its packed index.  The pack also writes the selection's
 * key of every owned coordinate, from a = G + e and the m before the update,
 * so the selection (whenever it runs) needs neither e nor a second pass:
 * a radix select over the keys, one launch per pass for all owned tensors.
 * Mask codes are encoded and decoded on the device; what a peer's code
 * breaks is recorded there and reported by the next sync().
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dev.h"
#include "exec.h"
#include "maskcode.h"
#include "try.h"

_Static_assert(KSEG_GROUPS == ENG_MAX_GROUPS, "one limit on parameter groups");

/* The least a scattered access moves on the device: one 32-byte sector. */
#define SECTOR 32

/* Events: the streaming slots', then pairs for the phases' marks. */
#define EV_IN(b) (b)
#define EV_K(b) (2 + (b))
#define EV_OUT(b) (4 + (b))
#define EV_MARK0 8
#define MAX_MARKS ((DEV_EVENTS - EV_MARK0) / 2)

typedef struct chunk {
    uint64_t w0, w1;     /* mask words */
    uint64_t p0, p1;     /* their elements, comm order */
} chunk;

/* A set of tensors selected from together: their top-k tables. */
typedef struct sel {
    uint32_t first, n;
    kseg_item *items;    /* device */
    uint32_t nitems;
    uint32_t *item0, *hist, *item_eq;
    kseg_tstate *st;
} sel;

/* A range of tensors coded together: a rank's shard (SCAPE), or all. */
typedef struct crange {
    uint32_t first, n;
    kseg_code *c;        /* device */
    uint32_t *tiles, *count;
    uint64_t w0, nwords, npos, pos_bits, map_words, code_words;
} crange;

typedef struct mark {
    int ph;
    double h0, h1;       /* host seconds, when the dev does not time */
} mark;

typedef struct dev_x {
    const dev_ops *ops;
    dev_t *d;
    int timing;          /* the dev times phases with events */
    int resident;        /* the residual is device memory */
    kseg_tensor *tt;     /* device: every tensor, comm order */
    uint32_t *tiles;     /* device: the scan of mask_cur from word 0 */
    kseg_status *status, *status_h; /* device, and its pinned copy */
    float *slot[2];
    chunk *chunks;
    size_t nchunks;
    uint32_t *keys;      /* device: keys of [key_lo, key_hi) */
    uint64_t key_lo, key_hi;
    sel own, all;        /* SCAPE's owned tensors; topk-adamw's every tensor */
    crange *ranges;      /* SCAPE: per rank; topk-adamw: one of all tensors */
    int nranges;
    float *wide;         /* device N floats: dense steps when streamed */
    int churn_due, norm_due;
    int part_open;       /* early packs: a sparse step's parts began (norm2 zeroed) */
    mark marks[MAX_MARKS];
    int nmarks;
    uint64_t launched;   /* kernels since the last times() */
    int tr_host;         /* trainers' buffers resolved in host memory (last resolve) */
    double norm;
    double *sq, *sq_out, *sq_h; /* max_grad_norm: device chunk totals, the sums
                                   (device) and their pinned copy */
    double **sq_to;             /* where each pending sum goes at sync */
    int sq_n;                   /* pending sums */
    uint64_t dev_bytes, pin_bytes;
} dev_x;

static dev_x *impl(const exec_t *x) { return x->impl; }

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- memory ------------------------------------------------------------------ */

static scape_rc dalloc(dev_x *h, size_t bytes, int pinned, void *out)
{
    void **p = out;
    bytes = bytes ? bytes : 4;
    TRY(h->ops->alloc(h->d, bytes, pinned, p));
    if (pinned)
        h->pin_bytes += bytes;
    else
        h->dev_bytes += bytes;
    return SCAPE_OK;
}

static void dfree(dev_x *h, void *p, int pinned)
{
    if (p)
        h->ops->release(h->d, p, pinned);
}

/* Host bytes into a fresh device buffer (the tables, at creation). */
static scape_rc upload_new(dev_x *h, const void *src, size_t bytes, void *out)
{
    TRY(dalloc(h, bytes, 0, out));
    if (bytes)
        TRY(h->ops->copy(h->d, DEV_MAIN, *(void **)out, src, bytes));
    return SCAPE_OK;
}

/* ---- tables ------------------------------------------------------------------- */

/* The tensor table; a second call (replan) rewrites it in place. */
static scape_rc build_tensors(exec_args *xa, dev_x *h)
{
    const plan *p = xa->p;
    kseg_tensor *t = calloc(p->ntensors ? p->ntensors : 1, sizeof *t);
    if (t == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    for (size_t j = 0; j < p->ntensors; j++) {
        const plan_tensor *pt = exec_tensor_at(xa, j);
        t[j] = (kseg_tensor){ pt->pos, pt->off, pt->word, (uint32_t)pt->len, (uint32_t)pt->k,
                              pt->group, 0 };
    }
    scape_rc rc = h->tt ? h->ops->copy(h->d, DEV_MAIN, h->tt, t, p->ntensors * sizeof *t)
                        : upload_new(h, t, p->ntensors * sizeof *t, &h->tt);
    if (rc == SCAPE_OK)
        rc = h->ops->sync(h->d);
    free(t);
    return rc;
}

/* The residual's chunks: runs of whole mask words, about residual_chunk
 * coordinates each. */
static scape_rc build_chunks(exec_args *xa, dev_x *h, size_t *most)
{
    const plan *p = xa->p;
    size_t cap = p->n / xa->cfg->residual_chunk + p->ntensors + 1;
    h->chunks = calloc(cap, sizeof *h->chunks);
    if (h->chunks == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    *most = 0;
    uint64_t w0 = 0, p0 = 0;
    for (size_t j = 0; j < p->ntensors; j++) {
        const plan_tensor *t = exec_tensor_at(xa, j);
        uint64_t words = (t->len + 31) / 32;
        for (uint64_t q = 0; q < words; q++) {
            /* after word q of tensor j: the element where the next word starts */
            uint64_t pw = q + 1 < words ? t->pos + 32 * (q + 1) : t->pos + t->len;
            int last = j + 1 == p->ntensors && q + 1 == words;
            if (pw - p0 >= xa->cfg->residual_chunk || last) {
                if (h->nchunks == cap)
                    return scape_set_error(SCAPE_INVALID, "engine: residual chunks overflow");
                h->chunks[h->nchunks++] = (chunk){ w0, t->word + q + 1, p0, pw };
                *most = pw - p0 > *most ? pw - p0 : *most;
                w0 = t->word + q + 1;
                p0 = pw;
            }
        }
    }
    return SCAPE_OK;
}

static scape_rc build_sel(exec_args *xa, dev_x *h, sel *s, uint32_t first, uint32_t n)
{
    s->first = first;
    s->n = n;
    size_t ni = 0;
    for (uint32_t q = 0; q < n; q++)
        ni += (kseg_tiles((exec_tensor_at(xa, first + q)->len + 31) / 32));
    kseg_item *items = calloc(ni ? ni : 1, sizeof *items);
    uint32_t *item0 = calloc(n + 1, sizeof *item0);
    if (items == NULL || item0 == NULL) {
        free(items);
        free(item0);
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    }
    for (uint32_t q = 0; q < n; q++) {
        const plan_tensor *t = exec_tensor_at(xa, first + q);
        uint64_t words = (t->len + 31) / 32;
        item0[q] = s->nitems;
        for (uint64_t w = 0; w < words; w += KSEG_TILE)
            items[s->nitems++] = (kseg_item){ t->word + w,
                                              (uint32_t)(words - w < KSEG_TILE ? words - w
                                                                              : KSEG_TILE),
                                              q };
    }
    item0[n] = s->nitems;
    scape_rc rc = upload_new(h, items, ni * sizeof *items, &s->items);
    if (rc == SCAPE_OK)
        rc = upload_new(h, item0, (n + 1) * sizeof *item0, &s->item0);
    if (rc == SCAPE_OK)
        rc = dalloc(h, (size_t)n * KSEG_BINS0 * sizeof(uint32_t), 0, &s->hist);
    if (rc == SCAPE_OK)
        rc = dalloc(h, n * sizeof(kseg_tstate), 0, &s->st);
    if (rc == SCAPE_OK)
        rc = dalloc(h, ni * sizeof(uint32_t), 0, &s->item_eq);
    if (rc == SCAPE_OK)
        rc = h->ops->sync(h->d);
    free(items);
    free(item0);
    return rc;
}

/* Where each tensor of comm range [first, first + n) goes in its code; a
 * second call (replan: other k_l) rewrites the table in place. */
static scape_rc build_range(exec_args *xa, dev_x *h, crange *r, uint32_t first, uint32_t n)
{
    kseg_code *c = calloc(n ? n : 1, sizeof *c);
    if (c == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    kseg_code *dc = r->c;
    uint32_t *tiles = r->tiles, *cnt = r->count;
    *r = (crange){ .c = dc, .tiles = tiles, .count = cnt };
    r->first = first;
    r->n = n;
    r->w0 = n ? exec_tensor_at(xa, first)->word : 0;
    uint64_t kcum = 0;
    for (uint32_t q = 0; q < n; q++) {
        const plan_tensor *t = exec_tensor_at(xa, first + q);
        r->nwords += (t->len + 31) / 32;
        if (!mcode_by_index(t)) {
            c[q] = (kseg_code){ .tensor = first + q, .at = r->map_words, .kcum = kcum };
            r->map_words += (t->len + 31) / 32;
        }
        kcum += t->k;
    }
    kcum = 0;
    for (uint32_t q = 0; q < n; q++) {
        const plan_tensor *t = exec_tensor_at(xa, first + q);
        if (mcode_by_index(t)) {
            uint32_t b = mcode_pos_bits(t->len);
            c[q] = (kseg_code){ .tensor = first + q, .by_index = 1, .bits = b,
                                .at = 32 * r->map_words + r->pos_bits, .kcum = kcum,
                                .qbase = r->npos };
            r->npos += t->k;
            r->pos_bits += (uint64_t)t->k * b;
        } else {
            c[q].qbase = r->npos; /* so that a search by qbase lands on an index tensor */
        }
        kcum += t->k;
    }
    r->code_words = r->map_words + (r->pos_bits + 31) / 32;
    scape_rc rc = SCAPE_OK;
    if (4 * r->code_words != mcode_bytes(xa->p, first, n))
        rc = scape_set_error(SCAPE_INVALID, "engine: the device's mask code of tensors "
                             "[%u, +%u) has %llu bytes, maskcode.c's %zu", first, n,
                             (unsigned long long)(4 * r->code_words),
                             mcode_bytes(xa->p, first, n));
    if (rc == SCAPE_OK)
        rc = dc ? h->ops->copy(h->d, DEV_MAIN, dc, c, n * sizeof *c)
                : upload_new(h, c, n * sizeof *c, &r->c);
    if (rc == SCAPE_OK && tiles == NULL)
        rc = dalloc(h, (kseg_tiles(r->nwords) + 1) * sizeof(uint32_t), 0, &r->tiles);
    if (rc == SCAPE_OK && cnt == NULL)
        rc = dalloc(h, n * sizeof(uint32_t), 0, &r->count);
    if (rc == SCAPE_OK)
        rc = h->ops->sync(h->d);
    free(c);
    return rc;
}

/* ---- life ------------------------------------------------------------------------ */

static const dev_ops *dev_for(eng_executor x)
{
    return x == ENG_EXEC_CUDA ? &dev_cuda_ops : &dev_sim_ops;
}

static scape_rc alloc_vectors(exec_args *xa, dev_x *h)
{
    const plan *p = xa->p;
    size_t n = p->n, sl = xa->state_len, f = sizeof(float);
    TRY(dalloc(h, sl * f, 0, &xa->m));
    if (xa->opt->keeps_v)
        TRY(dalloc(h, sl * f, 0, &xa->v));
    TRY(dalloc(h, sl * f, 0, &xa->theta));
    TRY(dalloc(h, n * f, !h->resident, &xa->e));
    if (!h->resident)
        TRY(dalloc(h, n * f, 0, &h->wide));
    xa->dense = h->resident ? xa->e : h->wide;
    if (xa->opt->intake)
        TRY(dalloc(h, n * f, 0, &xa->g));
    TRY(dalloc(h, xa->k_cap * f, 0, &xa->send));
    TRY(dalloc(h, xa->k_cap * f, 0, &xa->upd));
    TRY(dalloc(h, p->nwords * 4, 0, &xa->mask_buf[0]));
    TRY(dalloc(h, p->nwords * 4, 0, &xa->mask_buf[1]));
    TRY(dalloc(h, xa->code_cap + 4, 0, &xa->code_all));
    TRY(dalloc(h, (kseg_tiles(p->nwords) + 1) * 4, 0, &h->tiles));
    TRY(dalloc(h, sizeof(kseg_status), 0, &h->status));
    TRY(dalloc(h, sizeof(kseg_status), 1, &h->status_h));
    /* no bad code seen yet: the first one recorded is the least */
    memset(h->status_h, 0, sizeof *h->status_h);
    h->status_h->first = UINT64_MAX;
    return h->ops->copy(h->d, DEV_MAIN, h->status, h->status_h, sizeof *h->status);
}

static scape_rc dev_create(exec_t *x)
{
    static atomic_ulong s_engines;
    exec_args *xa = x->a;
    const plan *p = xa->p;
    dev_x *h = calloc(1, sizeof *h);
    if (h == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    x->impl = h;
    h->ops = dev_for(xa->cfg->executor);
    h->timing = xa->cfg->executor == ENG_EXEC_CUDA;
    h->resident = xa->cfg->residual_on_device;
    x->host_memory = 0;
    x->residual_host = !h->resident;
    void *main = xa->cfg->executor == ENG_EXEC_CUDA ? comm_device_stream(xa->comm) : NULL;
    TRY(h->ops->create(&h->d, xa->cfg->device, main, xa->comm, 600000,
                       atomic_fetch_add(&s_engines, 1) * 7919ul + (unsigned long)xa->rank));
    TRY(alloc_vectors(xa, h));
    TRY(build_tensors(xa, h));
    size_t most = 0;
    if (!h->resident) {
        TRY(build_chunks(xa, h, &most));
        TRY(dalloc(h, most * sizeof(float), 0, &h->slot[0]));
        TRY(dalloc(h, most * sizeof(float), 0, &h->slot[1]));
    }
    const plan_shard *me = &p->shard[xa->rank];
    if (xa->opt->mask == ENG_MASK_LAGGED_M) {
        h->key_lo = me->pos0;
        h->key_hi = me->pos0 + me->len;
        TRY(build_sel(xa, h, &h->own, (uint32_t)me->first, (uint32_t)me->count));
        h->nranges = xa->comm->size;
        if ((h->ranges = calloc((size_t)h->nranges, sizeof *h->ranges)) == NULL)
            return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
        for (int r = 0; r < h->nranges; r++)
            TRY(build_range(xa, h, &h->ranges[r], (uint32_t)p->shard[r].first,
                            (uint32_t)p->shard[r].count));
    } else if (xa->opt->mask == ENG_MASK_TOPK_GRAD) {
        h->key_lo = 0;
        h->key_hi = p->n;
        TRY(build_sel(xa, h, &h->all, 0, (uint32_t)p->ntensors));
        h->nranges = 1;
        if ((h->ranges = calloc(1, sizeof *h->ranges)) == NULL)
            return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
        TRY(build_range(xa, h, &h->ranges[0], 0, (uint32_t)p->ntensors));
    }
    if (h->key_hi > h->key_lo)
        TRY(dalloc(h, (h->key_hi - h->key_lo) * sizeof(uint32_t), 0, &h->keys));
    if (xa->cfg->max_grad_norm > 0.0f) {
        size_t R = (size_t)xa->comm->size;
        TRY(dalloc(h, kseg_sq_chunks(p->n) * sizeof(double), 0, &h->sq));
        TRY(dalloc(h, R * sizeof(double), 0, &h->sq_out));
        TRY(dalloc(h, R * sizeof(double), 1, &h->sq_h));
        if ((h->sq_to = calloc(R, sizeof *h->sq_to)) == NULL)
            return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    }
    return h->ops->sync(h->d);
}

static void free_sel(dev_x *h, sel *s)
{
    dfree(h, s->items, 0);
    dfree(h, s->item0, 0);
    dfree(h, s->hist, 0);
    dfree(h, s->st, 0);
    dfree(h, s->item_eq, 0);
}

static void dev_destroy(exec_t *x)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    if (h == NULL)
        return;
    if (h->d) {
        h->ops->sync(h->d); /* nothing may still write what is freed */
        void *dv[] = { xa->m, xa->v, xa->theta, h->wide, xa->g, xa->send, xa->upd, xa->mask_buf[0],
                       xa->mask_buf[1], xa->code_all, h->tiles, h->status, h->tt, h->slot[0],
                       h->slot[1], h->keys, h->sq, h->sq_out };
        for (size_t i = 0; i < sizeof dv / sizeof dv[0]; i++)
            dfree(h, dv[i], 0);
        dfree(h, xa->e, !h->resident);
        dfree(h, h->status_h, 1);
        dfree(h, h->sq_h, 1);
        free_sel(h, &h->own);
        free_sel(h, &h->all);
        for (int r = 0; h->ranges && r < h->nranges; r++) {
            dfree(h, h->ranges[r].c, 0);
            dfree(h, h->ranges[r].tiles, 0);
            dfree(h, h->ranges[r].count, 0);
        }
        h->ops->destroy(h->d);
    }
    free(h->ranges);
    free(h->chunks);
    free(h->sq_to);
    free(h);
    x->impl = NULL;
}

/* ---- launches ----------------------------------------------------------------- */

static scape_rc run(dev_x *h, kseg_kernel k, const void *args)
{
    h->launched++;
    return h->ops->launch(h->d, DEV_MAIN, k, args);
}

/* A word-range kernel's arguments with the engine's tables filled in. */
static kseg_args args_for(const exec_args *xa, const dev_x *h)
{
    kseg_args a;
    memset(&a, 0, sizeof a);
    a.t = h->tt;
    a.nt = (uint32_t)xa->p->ntensors;
    a.w1 = xa->p->nwords;
    a.mask = xa->mask_cur;
    a.tiles = h->tiles;
    a.k_cap = xa->mask_cur ? xa->k_cap : xa->p->n;
    a.theta = xa->theta;
    a.m = xa->m;
    a.v = xa->v;
    a.s_base = xa->state_base;
    a.status = h->status;
    return a;
}

/* The trainers' buffers as the kernels address them; h->tr_host counts
 * those in host memory (their traffic crosses the link). */
static scape_rc resolve_all(exec_t *x, const void *const *bufs, size_t elem, kseg_args *a)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    if (xa->tr > KSEG_MAX_TRAINERS)
        return scape_set_error(SCAPE_INVALID, "engine: the %s executor serves at most %d "
                               "trainers per daemon, %d are attached",
                               eng_executor_name(xa->cfg->executor), KSEG_MAX_TRAINERS, xa->tr);
    h->tr_host = 0;
    for (int j = 0; j < xa->tr; j++) {
        int on_host = 0;
        TRY(h->ops->resolve(h->d, bufs[j], xa->p->n * elem, &a->tr[j], &on_host));
        h->tr_host += on_host;
    }
    a->ntr = (uint32_t)xa->tr;
    return SCAPE_OK;
}

/* Trainer traffic of `bytes` per trainer: device memory or the link. */
static void count_trainers(exec_t *x, int ntr, uint64_t bytes)
{
    int on_host = impl(x)->tr_host < ntr ? impl(x)->tr_host : ntr;
    exec_count(x, (uint64_t)(ntr - on_host) * bytes, (uint64_t)on_host * bytes);
}

/* Words [w0, w1) of comm range [first, first + count). */
static void range_words(const exec_args *xa, size_t first, size_t count, uint64_t *w0, uint64_t *w1)
{
    *w0 = *w1 = 0;
    if (count == 0)
        return;
    const plan_tensor *a = exec_tensor_at(xa, first), *b = exec_tensor_at(xa, first + count - 1);
    *w0 = a->word;
    *w1 = b->word + (b->len + 31) / 32;
}

/* ---- the pack and the streamed residual -------------------------------------- */

static scape_rc stream_part(exec_t *x, kseg_args *a, int in, int out, uint64_t w0, uint64_t w1,
                            uint64_t p0, uint64_t p1);

/* One PACK over the residual: in one launch when it is device memory, else
 * chunk by chunk through the two slots (in: copy the chunk in first; out:
 * copy it back after). */
static scape_rc stream_pack(exec_t *x, kseg_args *a, int in, int out)
{
    return stream_part(x, a, in, out, 0, x->a->p->nwords, 0, x->a->p->n);
}

/* The selection's keys: SCAPE's statistic of the owned coordinates. */
static void want_keys(const exec_args *xa, const dev_x *h, kseg_args *a)
{
    a->keys = h->keys;
    a->key_lo = h->key_lo;
    a->key_hi = h->key_hi;
    a->beta1 = xa->cfg->hyper.beta1;
    a->c1 = 1.0f - xa->cfg->hyper.beta1;
    a->t_r = (float)xa->tr;
}

static scape_rc dev_intake(exec_t *x, const void *const *grads)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    kseg_args a = args_for(xa, h);
    TRY(resolve_all(x, grads, kern_dtype_size(xa->gdt), &a));
    a.bf16 = xa->gdt == KERN_BF16;
    a.out = xa->g;
    a.n = xa->p->n;
    count_trainers(x, xa->tr, xa->p->n * kern_dtype_size(xa->gdt));
    exec_count(x, 4 * xa->p->n, 0);
    return run(h, KSEG_GSUM, &a);
}

/* G as the pack reads it: the trainers' buffers, or topk-adamw's sum. */
static scape_rc grad_source(exec_t *x, const void *const *grads, kseg_args *a)
{
    exec_args *xa = x->a;
    if (xa->opt->intake) {
        a->tr[0] = xa->g;
        a->ntr = 1;
        a->bf16 = 0;
        return SCAPE_OK;
    }
    a->bf16 = xa->gdt == KERN_BF16;
    return resolve_all(x, grads, kern_dtype_size(xa->gdt), a);
}

/* A pass over the residual: its bytes cross the link when it streams. */
static void count_residual(exec_t *x, uint64_t bytes)
{
    if (impl(x)->resident)
        exec_count(x, bytes, 0);
    else
        exec_count(x, 0, bytes);
}

/* What a PACK over every coordinate moves, besides the residual: G, the
 * mask and its scan, the packed values, and the keys (m read, key written). */
static void count_pack(exec_t *x, const kseg_args *a, uint64_t k)
{
    exec_args *xa = x->a;
    uint64_t n = xa->p->n, w = xa->p->nwords;
    size_t gsz = a->bf16 ? 2 : 4;
    if (xa->opt->intake)
        exec_count(x, 4 * n, 0);
    else
        count_trainers(x, (int)a->ntr, n * gsz);
    uint64_t keys = a->keys ? a->key_hi - a->key_lo : 0;
    exec_count(x, (a->mask ? 8 * w : 0) + (a->out ? 4 * (a->mask ? k : n) : 0) + 8 * keys, 0);
}

/* The pack's arguments: the gradient source, and the keys when a selection
 * is due. */
static scape_rc pack_args(exec_t *x, const void *const *grads, int select_due, kseg_args *a)
{
    *a = args_for(x->a, impl(x));
    TRY(grad_source(x, grads, a));
    if (select_due)
        want_keys(x->a, impl(x), a);
    return SCAPE_OK;
}

static scape_rc dev_pack(exec_t *x, const void *const *grads, int select_due)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    kseg_args a;
    TRY(pack_args(x, grads, select_due, &a));
    count_pack(x, &a, xa->toff[xa->p->ntensors]);
    count_residual(x, 4 * xa->p->n * (uint64_t)(!xa->e_stale + (xa->mask_cur != NULL)));
    int stale = xa->e_stale;
    a.e_zero = stale;
    if (xa->mask_cur) {
        a.out = xa->send;
        a.e_write = 1;
        a.wire_bf16 = xa->wire_now;
        TRY(h->ops->zero(h->d, DEV_MAIN, &h->status->norm2, sizeof h->status->norm2));
        TRY(stream_pack(x, &a, !stale, 1));
        h->part_open = 0;
        xa->e_stale = 0;
        h->norm_due = 1;
    } else {
        a.out = xa->dense;
        TRY(stream_pack(x, &a, !stale && !h->resident, 0));
        xa->e_stale = 1;
        h->norm = 0.0;
    }
    return SCAPE_OK;
}

/* Early packs: PACK over positions [p0, p1) (words [w0, w1)) of one run of
 * tensors, as stream_pack would, but copying only that range of each chunk
 * in and out (the rest of a slot may hold another run's values). */
static scape_rc stream_part(exec_t *x, kseg_args *a, int in, int out, uint64_t w0, uint64_t w1,
                            uint64_t p0, uint64_t p1)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    if (h->resident || (!in && !out)) {
        a->e = h->resident ? xa->e : NULL;
        a->e_base = 0;
        a->w0 = w0;
        a->w1 = w1;
        return run(h, KSEG_PACK, a);
    }
    for (size_t c = 0; c < h->nchunks; c++) {
        const chunk *ch = &h->chunks[c];
        if (ch->w1 <= w0 || ch->w0 >= w1)
            continue;
        int b = (int)(c & 1);
        uint64_t q0 = ch->p0 > p0 ? ch->p0 : p0, q1 = ch->p1 < p1 ? ch->p1 : p1;
        size_t bytes = (q1 - q0) * sizeof(float);
        a->w0 = ch->w0 > w0 ? ch->w0 : w0;
        a->w1 = ch->w1 < w1 ? ch->w1 : w1;
        a->e = h->slot[b];
        a->e_base = ch->p0;
        float *sl = h->slot[b] + (q0 - ch->p0);
        if (in) {
            TRY(h->ops->wait(h->d, DEV_IN, EV_K(b)));
            TRY(h->ops->wait(h->d, DEV_IN, EV_OUT(b)));
            TRY(h->ops->copy(h->d, DEV_IN, sl, xa->e + q0, bytes));
            TRY(h->ops->record(h->d, DEV_IN, EV_IN(b)));
            TRY(h->ops->wait(h->d, DEV_MAIN, EV_IN(b)));
        } else {
            TRY(h->ops->wait(h->d, DEV_MAIN, EV_OUT(b)));
        }
        TRY(run(h, KSEG_PACK, a));
        TRY(h->ops->record(h->d, DEV_MAIN, EV_K(b)));
        if (out) {
            TRY(h->ops->wait(h->d, DEV_OUT, EV_K(b)));
            TRY(h->ops->copy(h->d, DEV_OUT, xa->e + q0, sl, bytes));
            TRY(h->ops->record(h->d, DEV_OUT, EV_OUT(b)));
        }
    }
    return SCAPE_OK;
}

/* The pack of the comm tensors j with take[j], a run of consecutive ones at
 * a time.  The residual's norm then sums the parts of the step (zeroed at
 * its first part; an undone part still counts: it is a statistic). */
static scape_rc dev_pack_part(exec_t *x, const void *const *grads, const unsigned char *take,
                              int select_due)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    kseg_args a;
    TRY(pack_args(x, grads, select_due, &a));
    int stale = xa->e_stale, sparse = xa->mask_cur != NULL;
    a.e_zero = stale;
    a.out = sparse ? xa->send : xa->dense;
    a.e_write = sparse;
    a.wire_bf16 = sparse && xa->wire_now;
    if (sparse && !h->part_open)
        TRY(h->ops->zero(h->d, DEV_MAIN, &h->status->norm2, sizeof h->status->norm2));
    h->part_open = sparse;
    for (size_t j = 0; j < xa->p->ntensors;) {
        size_t j1 = j;
        while (j1 < xa->p->ntensors && take[j1])
            j1++;
        if (j1 == j) {
            j++;
            continue;
        }
        uint64_t w0, w1;
        const plan_tensor *last = exec_tensor_at(xa, j1 - 1);
        range_words(xa, j, j1 - j, &w0, &w1);
        count_residual(x, 4 * (last->pos + last->len - exec_tensor_at(xa, j)->pos) *
                              (uint64_t)(!stale + sparse));
        TRY(stream_part(x, &a, sparse ? !stale : !stale && !h->resident, sparse, w0, w1,
                        exec_tensor_at(xa, j)->pos, last->pos + last->len));
        j = j1;
    }
    h->norm_due = sparse;
    if (!sparse)
        h->norm = 0.0;
    return SCAPE_OK;
}

/* ---- selection --------------------------------------------------------------------- */

/* Exact top-k of every tensor of s from the keys, into mask. */
static scape_rc topk(exec_t *x, const sel *s, uint32_t *mask)
{
    dev_x *h = impl(x);
    if (s->n == 0)
        return SCAPE_OK;
    kseg_topk_args a = { .t = h->tt, .first = s->first, .nsel = s->n, .items = s->items,
                         .nitems = s->nitems, .item0 = s->item0, .keys = h->keys,
                         .key_lo = h->key_lo, .hist = s->hist, .st = s->st,
                         .item_eq = s->item_eq, .mask = mask };
    /* the keys read five times (three digits, the ties counted, the mask
     * written), the histograms cleared thrice, the mask words written */
    uint64_t nkeys = 0;
    for (uint32_t q = 0; q < s->n; q++)
        nkeys += exec_tensor_at(x->a, s->first + q)->len;
    exec_count(x, 20 * nkeys + 3 * (uint64_t)s->n * KSEG_BINS0 * 4 + nkeys / 8, 0);
    for (a.level = 0; a.level < 3; a.level++) {
        TRY(h->ops->zero(h->d, DEV_MAIN, s->hist, (size_t)s->n * KSEG_BINS0 * 4));
        TRY(run(h, KSEG_TOPK_HIST, &a));
        TRY(run(h, KSEG_TOPK_PICK, &a));
    }
    TRY(run(h, KSEG_TOPK_COUNT, &a));
    TRY(run(h, KSEG_TOPK_SCAN, &a));
    return run(h, KSEG_TOPK_WRITE, &a);
}

static scape_rc dev_keep_stats(exec_t *x)
{
    (void)x; /* the pack wrote every key the selection reads */
    return SCAPE_OK;
}

static scape_rc dev_select(exec_t *x)
{
    return topk(x, &impl(x)->own, x->a->mask_next);
}

static scape_rc dev_own_topk(exec_t *x)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    kseg_args a = args_for(xa, h);
    TRY(grad_source(x, NULL, &a));
    a.mask = NULL; /* keys only: no mask to read */
    a.keys = h->keys;
    a.key_lo = 0;
    a.key_hi = xa->p->n;
    a.key_abs = 1;
    a.e_zero = xa->e_stale;
    count_pack(x, &a, 0);
    count_residual(x, xa->e_stale ? 0 : 4 * xa->p->n);
    TRY(stream_pack(x, &a, !xa->e_stale, 0));
    return topk(x, &h->all, xa->mask_buf[1]);
}

/* ---- mask codes ------------------------------------------------------------------ */

static crange *range_of(dev_x *h, size_t first, size_t count, int from)
{
    if (h->nranges == 1 && h->ranges[0].first == first && h->ranges[0].n == count)
        return &h->ranges[0];
    if (from >= 0 && from < h->nranges && h->ranges[from].first == first &&
        h->ranges[from].n == count)
        return &h->ranges[from];
    return NULL;
}

static kseg_code_args code_args(const exec_t *x, const crange *r, const uint32_t *words,
                                const uint32_t *code)
{
    dev_x *h = impl(x);
    kseg_code_args a = { .t = h->tt, .c = r->c, .nc = r->n, .w0 = r->w0, .nwords = r->nwords,
                         .npos = r->npos, .pos_bits = r->pos_bits, .map_words = r->map_words,
                         .code_words = r->code_words,
                         /* the range's words are given from its first word */
                         .words = (uint32_t *)words - r->w0, .code = (uint32_t *)code,
                         .tiles = r->tiles, .count = r->count,
                         .rank = (uint32_t)x->a->rank, .status = h->status };
    return a;
}

static scape_rc dev_encode(exec_t *x, size_t first, size_t count, const uint32_t *words,
                           uint32_t *code)
{
    dev_x *h = impl(x);
    crange *r = range_of(h, first, count, x->a->rank);
    if (r == NULL)
        return scape_set_error(SCAPE_INVALID, "engine: no mask code for tensors [%zu, +%zu)",
                               first, count);
    kseg_code_args a = code_args(x, r, words, code);
    kseg_args s;
    memset(&s, 0, sizeof s);
    s.mask = a.words;
    s.w0 = r->w0;
    s.w1 = r->w0 + r->nwords;
    s.tiles = r->tiles;
    exec_count(x, 8 * r->nwords + 8 * r->code_words, 0);
    TRY(h->ops->zero(h->d, DEV_MAIN, code, r->code_words * 4));
    TRY(run(h, KSEG_SCAN, &s));
    return run(h, KSEG_ENCODE, &a);
}

static scape_rc dev_decode(exec_t *x, size_t first, size_t count, const uint32_t *code,
                           size_t nbytes, uint32_t *words, int merge, int from)
{
    dev_x *h = impl(x);
    crange *r = range_of(h, first, count, from);
    if (r == NULL)
        return scape_set_error(SCAPE_INVALID, "engine: no mask code for tensors [%zu, +%zu)",
                               first, count);
    if (nbytes != 4 * r->code_words)
        return scape_set_error(SCAPE_PROTO, "mask from rank %d: %zu bytes, the plan says %llu",
                               from, nbytes, (unsigned long long)(4 * r->code_words));
    kseg_code_args a = code_args(x, r, words, code);
    a.merge = merge;
    a.rank = (uint32_t)from;
    exec_count(x, 8 * r->nwords + 4 * r->code_words, 0);
    TRY(h->ops->zero(h->d, DEV_MAIN, r->count, r->n * sizeof(uint32_t)));
    TRY(run(h, KSEG_DECODE_ZERO, &a));
    TRY(run(h, KSEG_DECODE_MAP, &a));
    TRY(run(h, KSEG_DECODE_POS, &a));
    return run(h, KSEG_DECODE_CHECK, &a);
}

static scape_rc dev_mask_zero(exec_t *x, uint32_t *words)
{
    return impl(x)->ops->zero(impl(x)->d, DEV_MAIN, words, x->a->p->nwords * 4);
}

static scape_rc dev_churn(exec_t *x, const uint32_t *cur, const uint32_t *prev)
{
    dev_x *h = impl(x);
    kseg_args a = args_for(x->a, h);
    a.mask = cur;
    a.prev = prev;
    exec_count(x, 8 * x->a->p->nwords, 0);
    TRY(h->ops->zero(h->d, DEV_MAIN, h->status->churn, sizeof h->status->churn));
    TRY(run(h, KSEG_CHURN, &a));
    h->churn_due = 1;
    return SCAPE_OK;
}

/* Packed offsets: fixed by the plan for SCAPE (k_l per tensor) and dense
 * steps; topk-adamw's union is counted on the host. */
static scape_rc dev_offsets(exec_t *x, size_t *k_out)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    const plan *p = xa->p;
    xa->toff[0] = 0;
    if (xa->mask_cur == NULL || xa->opt->mask == ENG_MASK_LAGGED_M) {
        for (size_t j = 0; j < p->ntensors; j++) {
            const plan_tensor *t = exec_tensor_at(xa, j);
            xa->toff[j + 1] = xa->toff[j] + (xa->mask_cur ? t->k : t->len);
        }
    } else {
        const void *v;
        TRY(exec_view(x, xa->mask_cur, p->nwords * 4, &v));
        const uint32_t *mask = v;
        for (size_t j = 0; j < p->ntensors; j++) {
            const plan_tensor *t = exec_tensor_at(xa, j);
            size_t k = 0;
            kern_mask_popcount(mask + t->word, t->len, &k);
            xa->toff[j + 1] = xa->toff[j] + k;
        }
        exec_view_free(x, v);
    }
    *k_out = xa->toff[p->ntensors];
    if (xa->mask_cur == NULL)
        return SCAPE_OK;
    kseg_args a = args_for(xa, h);
    a.w0 = 0;
    exec_count(x, 4 * p->nwords, 0);
    return run(h, KSEG_SCAN, &a);
}

/* ---- update, compaction, write-back ---------------------------------------- */

/* Coordinates, packed values and mask words of comm range [first, +count). */
static void range_sizes(const exec_args *xa, size_t first, size_t count, uint64_t *n, uint64_t *k,
                        uint64_t *w)
{
    uint64_t w0, w1;
    range_words(xa, first, count, &w0, &w1);
    const plan_tensor *a = exec_tensor_at(xa, first), *b = exec_tensor_at(xa, first + count - 1);
    *n = b->pos + b->len - a->pos;
    *k = xa->toff[first + count] - xa->toff[first];
    *w = w1 - w0;
}

/* vecs vectors read and written at a range's packed values (a sector each,
 * scattered) or over all of it, plus reading the values and the mask. */
static void count_masked(exec_t *x, uint64_t n, uint64_t k, uint64_t w, uint64_t vecs)
{
    if (x->a->mask_cur)
        exec_count(x, k * vecs * SECTOR + 4 * k + 4 * w, 0);
    else
        exec_count(x, n * vecs * 4 + 4 * n, 0);
}

/* A word-range kernel's arguments for comm-order tensors [first, first +
 * count), its traffic counted (vecs state vectors per value); 0 when the
 * range is empty. */
static int range_args(exec_t *x, size_t first, size_t count, uint64_t vecs, kseg_args *a)
{
    if (count == 0)
        return 0;
    *a = args_for(x->a, impl(x));
    range_words(x->a, first, count, &a->w0, &a->w1);
    uint64_t n, k, w;
    range_sizes(x->a, first, count, &n, &k, &w);
    count_masked(x, n, k, w, vecs);
    return 1;
}

static scape_rc dev_update(exec_t *x, size_t first, size_t count, uint64_t t)
{
    exec_args *xa = x->a;
    kseg_args a;
    impl(x)->part_open = 0; /* the step's packs are done */
    /* theta, m (v), read and written */
    if (!range_args(x, first, count, 2 * (xa->opt->keeps_v ? 3 : 2), &a))
        return SCAPE_OK;
    const kern_hyper *hy = &xa->cfg->hyper;
    a.in = xa->sum;
    a.update = (int)xa->opt->update;
    a.b1 = hy->beta1;
    a.b2 = hy->beta2;
    a.eps = hy->eps;
    memcpy(a.glr, xa->glr, xa->ngroups * sizeof *a.glr);
    memcpy(a.gwd, xa->gwd, xa->ngroups * sizeof *a.gwd);
    a.div = (float)xa->t_total;
    a.bc1 = scape_f_bias_correction(hy->beta1, t); /* read where the variant takes them */
    a.bc2 = scape_f_bias_correction(hy->beta2, t);
    a.clip = xa->clip;
    return run(impl(x), KSEG_UPDATE, &a);
}

/* On the host, where the host can read every trainer's buffer (the sim's
 * memory, pinned host memory); no kernel reads gradients in device memory
 * for this yet, so there the figures are not measured. */
static scape_rc dev_grad_sqsums(exec_t *x, const void *const *grads, double *out)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    int readable = h->ops->host_addressable;
    for (int j = 0; !readable && j < xa->tr; j++) {
        const void *p;
        int on_host = 0;
        TRY(h->ops->resolve(h->d, grads[j], xa->p->n * kern_dtype_size(xa->gdt), &p, &on_host));
        if (!on_host)
            break;
        readable = j == xa->tr - 1;
    }
    if (!readable) {
        for (int j = 0; j <= xa->tr; j++)
            out[j] = -1.0;
        return SCAPE_OK;
    }
    return eng_grad_sqsums(xa, NULL, grads, out);
}

static scape_rc dev_sqsum(exec_t *x, size_t first, size_t count, double *out)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    if (h->sq_to == NULL || h->sq_n == xa->comm->size)
        return scape_set_error(SCAPE_INVALID, "engine: sum of squares %s",
                               h->sq_to ? "requested too often before a sync"
                                        : "without max_grad_norm");
    kseg_args a = args_for(xa, h);
    a.in = xa->sum + xa->toff[first];
    a.n = xa->toff[first + count] - xa->toff[first];
    a.div = (float)xa->t_total;
    a.sq = h->sq;
    a.sq_total = h->sq_out + h->sq_n;
    h->sq_to[h->sq_n++] = out;
    exec_count(x, 4 * a.n + 8 * kseg_sq_chunks(a.n) * 2, 0);
    return run(h, KSEG_SQSUM, &a);
}

static scape_rc dev_compact(exec_t *x, size_t first, size_t count, float *dst,
                            void *const *params)
{
    exec_args *xa = x->a;
    kseg_args a;
    if (!range_args(x, first, count, 1, &a))
        return SCAPE_OK;
    a.out = dst;
    a.vbf16 = xa->pub_bf16;
    a.delta = xa->pub_delta;
    if (a.delta) { /* the changes from trainer 0's values */
        TRY(resolve_all(x, (const void *const *)params, sizeof(float), &a));
        count_trainers(x, 1, (xa->toff[first + count] - xa->toff[first]) * SECTOR);
    }
    return run(impl(x), KSEG_COMPACT, &a);
}

static scape_rc dev_write_back(exec_t *x, const float *src, void *const *params)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    kseg_args a = args_for(xa, h);
    TRY(resolve_all(x, (const void *const *)params, kern_dtype_size(xa->pdt), &a));
    a.bf16 = xa->pdt == KERN_BF16;
    a.in = src;
    a.vbf16 = xa->pub_bf16;
    a.delta = xa->pub_delta;
    uint64_t n = xa->p->n, k = xa->toff[xa->p->ntensors], w = xa->p->nwords;
    count_masked(x, n, k, w, 0);
    count_trainers(x, xa->tr, xa->mask_cur ? k * SECTOR : n * kern_dtype_size(xa->pdt));
    return run(h, KSEG_WRITEBACK, &a);
}

/* SCAPE's k_l changed (a density schedule): the tensor table and every
 * rank's code table again (a handful of times a run). */
static scape_rc dev_replan(exec_t *x)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    TRY(build_tensors(xa, h));
    for (int r = 0; xa->opt->mask == ENG_MASK_LAGGED_M && r < h->nranges; r++)
        TRY(build_range(xa, h, &h->ranges[r], (uint32_t)xa->p->shard[r].first,
                        (uint32_t)xa->p->shard[r].count));
    return SCAPE_OK;
}

static scape_rc dev_load_theta(exec_t *x, const void *src)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    kseg_args a = args_for(xa, h);
    size_t first, count;
    exec_update_range(xa, &first, &count);
    range_words(xa, first, count, &a.w0, &a.w1);
    a.mask = NULL;
    int on_host = 0;
    TRY(h->ops->resolve(h->d, src, xa->p->n * kern_dtype_size(xa->pdt), (const void **)&a.in,
                        &on_host));
    a.bf16 = xa->pdt == KERN_BF16;
    a.n = xa->state_len;
    uint64_t pb = xa->state_len * kern_dtype_size(xa->pdt);
    exec_count(x, 4 * xa->state_len + (on_host ? 0 : pb), on_host ? pb : 0);
    return count ? run(h, KSEG_LOAD_THETA, &a) : SCAPE_OK;
}

/* ---- memory, waiting, time ------------------------------------------------------ */

static scape_rc dev_copy(exec_t *x, void *dst, const void *src, size_t bytes)
{
    return dst == src ? SCAPE_OK : impl(x)->ops->copy(impl(x)->d, DEV_MAIN, dst, src, bytes);
}

static scape_rc dev_zero(exec_t *x, void *dst, size_t bytes)
{
    return impl(x)->ops->zero(impl(x)->d, DEV_MAIN, dst, bytes);
}

/* What the kernels recorded in the status, as the engine reports it. */
static scape_rc status_rc(const exec_args *xa, const kseg_status *st)
{
    if (st->err & KSEG_E_CODE) {
        static const char *const what[] = { "?", "bits set past the tensor's end",
                                            "not exactly k bits",
                                            "positions not ascending inside the tensor",
                                            "padding is not zero",
                                            "the own mask has not exactly k bits" };
        uint32_t w = (uint32_t)(st->first & 0xff), j = (uint32_t)((st->first >> 8) & 0xffffffu);
        const char *name = j < xa->p->ntensors ? exec_tensor_at(xa, j)->name : "-";
        return scape_set_error(SCAPE_PROTO, "mask from rank %u: tensor %s: %s",
                               (unsigned)(st->first >> 40), name ? name : "-",
                               w < sizeof what / sizeof what[0] ? what[w] : "?");
    }
    if (st->err & KSEG_E_PACKED)
        return scape_set_error(SCAPE_INVALID, "engine: a mask held more bits than the plan "
                               "allows; its values were not packed");
    return SCAPE_OK;
}

static scape_rc dev_sync(exec_t *x)
{
    exec_args *xa = x->a;
    dev_x *h = impl(x);
    TRY(h->ops->copy(h->d, DEV_MAIN, h->status_h, h->status, sizeof *h->status));
    int nsq = h->sq_n;
    h->sq_n = 0;
    if (nsq)
        TRY(h->ops->copy(h->d, DEV_MAIN, h->sq_h, h->sq_out, (size_t)nsq * sizeof(double)));
    TRY(h->ops->sync(h->d));
    for (int i = 0; i < nsq; i++)
        *h->sq_to[i] = h->sq_h[i];
    const kseg_status *st = h->status_h;
    if (h->churn_due) {
        xa->stats->mask_churn = st->churn[1] ? (double)st->churn[0] / (double)st->churn[1] : 0.0;
        h->churn_due = 0;
    }
    if (h->norm_due) {
        h->norm = sqrt(st->norm2);
        h->norm_due = 0;
    }
    return status_rc(xa, st);
}

static void dev_mark(exec_t *x, eng_phase ph, int end)
{
    dev_x *h = impl(x);
    if (!end) {
        x->phase = ph;
        if (h->nmarks == MAX_MARKS)
            return; /* more phases than events: the rest go untimed */
        mark *m = &h->marks[h->nmarks++];
        m->ph = ph;
        m->h0 = now_s();
        if (h->timing)
            h->ops->record(h->d, DEV_MAIN, EV_MARK0 + 2 * (h->nmarks - 1));
        return;
    }
    for (int i = h->nmarks; i-- > 0;)
        if (h->marks[i].ph == (int)ph) {
            h->marks[i].h1 = now_s();
            if (h->timing)
                h->ops->record(h->d, DEV_MAIN, EV_MARK0 + 2 * i + 1);
            return;
        }
}

static void dev_times(exec_t *x, double *phase_s)
{
    dev_x *h = impl(x);
    for (int i = 0; i < h->nmarks; i++) {
        const mark *m = &h->marks[i];
        double s = h->timing ? h->ops->elapsed(h->d, EV_MARK0 + 2 * i, EV_MARK0 + 2 * i + 1)
                             : -1.0;
        phase_s[m->ph] += s >= 0.0 ? s : m->h1 - m->h0;
    }
    h->nmarks = 0;
    x->a->stats->launches += h->launched;
    h->launched = 0;
}

static double dev_residual_norm(exec_t *x)
{
    return x->a->e_stale ? 0.0 : impl(x)->norm;
}

static uint64_t dev_device_bytes(const exec_t *x) { return impl(x)->dev_bytes; }
static uint64_t dev_pinned_bytes(const exec_t *x) { return impl(x)->pin_bytes; }
static int dev_stuck(const exec_t *x)
{
    const dev_x *h = impl(x);
    return h->d && h->ops->stuck && h->ops->stuck(h->d);
}

const exec_ops exec_dev_ops = {
    .name = "dev",
    .create = dev_create,
    .destroy = dev_destroy,
    .intake = dev_intake,
    .pack = dev_pack,
    .pack_part = dev_pack_part,
    .keep_stats = dev_keep_stats,
    .select = dev_select,
    .own_topk = dev_own_topk,
    .encode = dev_encode,
    .decode = dev_decode,
    .mask_zero = dev_mask_zero,
    .churn = dev_churn,
    .offsets = dev_offsets,
    .update = dev_update,
    .sqsum = dev_sqsum,
    .grad_sqsums = dev_grad_sqsums,
    .compact = dev_compact,
    .write_back = dev_write_back,
    .replan = dev_replan,
    .load_theta = dev_load_theta,
    .copy = dev_copy,
    .zero = dev_zero,
    .sync = dev_sync,
    .mark = dev_mark,
    .times = dev_times,
    .residual_norm = dev_residual_norm,
    .norm_kept = 1,
    .device_bytes = dev_device_bytes,
    .pinned_bytes = dev_pinned_bytes,
    .stuck = dev_stuck,
};
