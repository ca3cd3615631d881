/* engine_gnorm.c - max_grad_norm's view of the trainers' own gradients: the
 * squared L2 norm of each local trainer's gradient g_j and of their sum G_r,
 * before any residual is added (docs/algorithm.md, "Gradient clipping").
 *
 * One pass over the trainers' buffers, only when max_grad_norm is set.  The
 * coordinates in layout order are cut into chunks of SCAPE_SQ_CHUNK from the
 * first; each chunk's squares are summed by scape_f_sqsum_chunk (the lanes
 * and the halving tree of g_hat's norm), the chunks then add in order, so
 * the bits do not depend on the pool's size or on which executor asks.
 * G_r's chunk is g_0 + g_1 + ... left to right in fp32, as the intake sums
 * it; with one fp32 trainer it is that trainer's gradient.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine_internal.h"
#include "scape_formula.h"

typedef struct gn_ctx {
    exec_args *a;
    const void *const *grads;
    size_t nchunks;
    int nw;              /* sums per chunk: tr, and G_r's when tr > 1 */
} gn_ctx;

/* scape_f_sqsum_chunk(x, n, 1.0f), the same bits (each lane adds its
 * squares in the same order; x / 1.0f is x), written lane-parallel so that
 * the compiler vectorises it: this pass reads every gradient. */
static double sq_chunk(const float *x, size_t n)
{
    double lane[SCAPE_SQ_LANES] = { 0.0 };
    size_t q = 0;
    for (; q + SCAPE_SQ_LANES <= n; q += SCAPE_SQ_LANES)
        for (unsigned l = 0; l < SCAPE_SQ_LANES; l++) {
            double v = (double)x[q + l];
            lane[l] += v * v;
        }
    for (unsigned l = 0; q + l < n; l++) {
        double v = (double)x[q + l];
        lane[l] += v * v;
    }
    for (unsigned d = SCAPE_SQ_LANES / 2; d > 0; d /= 2)
        for (unsigned l = 0; l < d; l++)
            lane[l] += lane[l + d];
    return lane[0];
}

/* Chunk c of every trainer's gradient and of their sum. */
static scape_rc gn_chunk(void *ctx, size_t c, int w)
{
    const gn_ctx *q = ctx;
    exec_args *a = q->a;
    size_t off = c * SCAPE_SQ_CHUNK, left = a->p->n - off;
    size_t len = left < SCAPE_SQ_CHUNK ? left : SCAPE_SQ_CHUNK;
    size_t esz = kern_dtype_size(a->gdt);
    float *one = a->gn_buf + (size_t)w * 2 * SCAPE_SQ_CHUNK, *sum = one + SCAPE_SQ_CHUNK;
    double *part = a->gn_part + c * (size_t)q->nw;
    for (int j = 0; j < a->tr; j++) {
        const char *src = (const char *)q->grads[j] + off * esz;
        const float *g = (const float *)src;
        if (a->gdt != KERN_F32) {
            TRY(kern_grad_accum(one, src, a->gdt, len, 1));
            g = one;
        }
        part[j] = sq_chunk(g, len);
        if (q->nw > a->tr)
            TRY(kern_grad_accum(sum, src, a->gdt, len, j == 0));
    }
    if (q->nw > a->tr)
        part[a->tr] = sq_chunk(sum, len);
    return SCAPE_OK;
}

static scape_rc gn_grow(exec_args *a, size_t parts, size_t bufs)
{
    if (parts > a->gn_part_cap) {
        double *p = realloc(a->gn_part, parts * sizeof *p);
        if (p == NULL)
            return scape_set_error(SCAPE_NOMEM, "engine: out of memory for max_grad_norm");
        a->gn_part = p;
        a->gn_part_cap = parts;
    }
    if (bufs > a->gn_buf_cap) {
        float *b = realloc(a->gn_buf, bufs * sizeof *b);
        if (b == NULL)
            return scape_set_error(SCAPE_NOMEM, "engine: out of memory for max_grad_norm");
        a->gn_buf = b;
        a->gn_buf_cap = bufs;
    }
    return SCAPE_OK;
}

scape_rc eng_grad_sqsums(exec_args *a, pool *pl, const void *const *grads, double *out)
{
    int workers = pl ? pool_size(pl) : 1;
    gn_ctx q = { a, grads, (a->p->n + SCAPE_SQ_CHUNK - 1) / SCAPE_SQ_CHUNK,
                 a->tr > 1 ? a->tr + 1 : a->tr };
    TRY(gn_grow(a, q.nchunks * (size_t)q.nw, (size_t)workers * 2 * SCAPE_SQ_CHUNK));
    if (pl)
        TRY(pool_run(pl, q.nchunks, gn_chunk, &q));
    for (size_t c = 0; pl == NULL && c < q.nchunks; c++)
        TRY(gn_chunk(&q, c, 0));
    for (int j = 0; j < q.nw; j++) {
        double total = 0.0;
        for (size_t c = 0; c < q.nchunks; c++)
            total += a->gn_part[c * (size_t)q.nw + (size_t)j];
        out[j] = total;
    }
    if (q.nw == a->tr)
        out[a->tr] = out[0];
    return SCAPE_OK;
}

double eng_trainer_grad_norm(const eng_t *e, int j)
{
    if (e == NULL || !(e->cfg.max_grad_norm > 0.0f) || j < 0 || j >= e->a.tr ||
        e->last.step == 0 || !(e->gsq[j] >= 0.0))
        return -1.0;
    return sqrt(e->gsq[j]);
}
