/* gpu_check.c - the segmented CUDA kernels (kernels/cuda_seg.cu) against their
 * CPU versions (kernels/cpu_seg.c), and the nccl backend's CUDA kernels
 * (kernels/cuda_comm.cu) against scape_formula.h, bit for bit.
 *
 * For each size, tensor tables as the executors build them (scape_seg.h): one
 * tensor of n elements, then n split into several tensors whose trainer
 * coordinates run in the opposite order, with parameter groups.  Every kernel
 * gets fresh random inputs (seeded from the clock unless --seed is given),
 * the same on both sides; outputs start from the same poison (0xff bytes),
 * and everything a kernel writes is compared whole: values, masks, keys, mask
 * codes, counts and the status' error bits and first bad code.  The one
 * exception is the status' residual norm, a double the GPU sums in another
 * order (checked within 1e-9 relative).  Data buffers sit 0 or 4 bytes past
 * an allocation.  Top-k is also checked against the rule itself (k bits,
 * larger keys first, ties to the lower index), and the mask code decoded
 * against the mask it was encoded from.  Exit 0 pass, 1 fail, 77 when no
 * GPU can run the kernels.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_check.h"
#include "scape_seg.h"

#define PAD 8     /* poisoned slots after a packed output: catch writes past k */
#define MAX_T 7   /* tensors of the split layout */
#define NGROUPS 3 /* parameter groups used */

typedef struct ctx {
    gc_rng rng;
    gc_tally tally;
    gc_arena arena;   /* this check's buffers */
    size_t n;         /* elements of the layout */
    size_t off;       /* byte offset of the data buffers (0 or 4) */
    char label[128];  /* kernel, variant and layout, for messages */
} ctx;

/* A tensor table and its mask words. */
typedef struct layout {
    kseg_tensor t[MAX_T];
    uint32_t nt;
    uint64_t n, nw;
    const char *name;
} layout;

/* One buffer on both sides: h for the CPU version, d for the CUDA one. */
typedef struct tw {
    void *h, *d;
    size_t bytes;
} tw;

#define SIDE(b, s) ((s) ? (b).d : (b).h)

static void begin(ctx *c, const layout *l, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void begin(ctx *c, const layout *l, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(c->label, sizeof c->label, fmt, ap);
    va_end(ap);
    if (l && len > 0 && (size_t)len < sizeof c->label)
        snprintf(c->label + len, sizeof c->label - (size_t)len, " [%s]", l->name);
}

/* ---- buffers ------------------------------------------------------------------ */

/* A twin holding src (or the 0xff poison when src is NULL) on both sides;
 * tables (aligned) sit at offset 0, data at c->off. */
static tw twin_at(ctx *c, const void *src, size_t bytes, size_t off)
{
    tw b = { gc_host(&c->arena, bytes), gc_dev(&c->arena, bytes, off), bytes };
    if (src)
        memcpy(b.h, src, bytes);
    else
        memset(b.h, 0xff, bytes);
    GC_CUDA(cudaMemcpy(b.d, b.h, bytes, cudaMemcpyHostToDevice));
    return b;
}

static tw twin(ctx *c, const void *src, size_t bytes) { return twin_at(c, src, bytes, c->off); }
static tw table(ctx *c, const void *src, size_t bytes) { return twin_at(c, src, bytes, 0); }

/* Both sides set to byte x again. */
static void twin_fill(tw *b, int x)
{
    memset(b->h, x, b->bytes);
    GC_CUDA(cudaMemset(b->d, x, b->bytes));
}

/* The device side, once the stream has run. */
static void *down(ctx *c, const tw *b)
{
    GC_CUDA(cudaDeviceSynchronize());
    void *h = gc_host(&c->arena, b->bytes);
    GC_CUDA(cudaMemcpy(h, b->d, b->bytes, cudaMemcpyDeviceToHost));
    return h;
}

/* ---- inputs ---------------------------------------------------------------------- */

/* Both signs, magnitudes over 16 binades (2^-8 .. 2^8), about 1/64 exact
 * zeros; built from the bits for speed at n = 1e7. */
static float *rand_f32(ctx *c, size_t n)
{
    float *p = gc_host(&c->arena, n * sizeof *p);
    for (size_t i = 0; i < n; i++) {
        uint64_t r = gc_next(&c->rng);
        uint32_t sign = (uint32_t)(r & 64) << 25, expo = 119 + (uint32_t)((r >> 8) & 15);
        uint32_t u = (r & 63) == 0 ? 0 : sign | expo << 23 | (uint32_t)(r >> 41);
        memcpy(&p[i], &u, sizeof u);
    }
    return p;
}

static float *rand_pos(ctx *c, size_t n)
{
    float *v = rand_f32(c, n);
    for (size_t i = 0; i < n; i++)
        v[i] = fabsf(v[i]);
    return v;
}

/* n values in fp32 or bf16 (finite: NaN payloads are no part of the contract). */
static void *rand_vals(ctx *c, size_t n, int bf16)
{
    float *f = rand_f32(c, n);
    if (!bf16)
        return f;
    uint16_t *h = gc_host(&c->arena, n * 2);
    for (size_t i = 0; i < n; i++)
        h[i] = scape_f_bf16(f[i]);
    return h;
}

/* Mask words of the layout, bits set with probability p; the padding bits
 * past each tensor's end are zero, as the executors keep them. */
static uint32_t *rand_mask(ctx *c, const layout *l, double p)
{
    uint32_t *m = gc_host(&c->arena, l->nw * 4 + 4);
    for (uint64_t w = 0; w < l->nw; w++) {
        uint32_t word = 0;
        for (unsigned b = 0; b < 32; b++)
            if (gc_unit(&c->rng) < p)
                word |= 1u << b;
        m[w] = word;
    }
    for (uint32_t j = 0; j < l->nt; j++)
        if (l->t[j].len & 31)
            m[l->t[j].word + kseg_words_of(&l->t[j]) - 1] &= (1u << (l->t[j].len & 31)) - 1u;
    return m;
}

static uint64_t popcount_words(const uint32_t *m, uint64_t nw)
{
    uint64_t k = 0;
    for (uint64_t w = 0; w < nw; w++)
        k += (uint64_t)__builtin_popcount(m[w]);
    return k;
}

/* One tensor of n, or n cut into up to MAX_T tensors whose trainer
 * coordinates run in reverse comm order; mask words per tensor. */
static void make_layout(ctx *c, size_t n, int split, layout *l)
{
    memset(l, 0, sizeof *l);
    l->n = n;
    l->name = split ? "split" : "one tensor";
    uint32_t nt = split ? 1 + (uint32_t)(gc_next(&c->rng) % MAX_T) : 1;
    if (nt > n)
        nt = (uint32_t)n;
    uint64_t left = n, pos = 0, word = 0;
    for (uint32_t j = 0; j < nt; j++) {
        uint64_t most = left - (nt - 1 - j), len = most;
        if (j + 1 < nt)
            len = 1 + gc_next(&c->rng) % (left / (nt - j) * 2 > most ? most : left / (nt - j) * 2);
        kseg_tensor *t = &l->t[j];
        t->pos = pos;
        t->len = (uint32_t)len;
        t->word = word;
        t->group = j % NGROUPS;
        pos += len;
        word += kseg_words_of(t);
        left -= len;
    }
    uint64_t off = 0;
    for (uint32_t j = nt; j-- > 0;) {
        l->t[j].off = off;
        off += l->t[j].len;
    }
    l->nt = nt;
    l->nw = word;
}

/* ---- comparisons ------------------------------------------------------------------- */

static int rc_ok(ctx *c, scape_rc rc, const char *side)
{
    return gc_expect(&c->tally, rc == SCAPE_OK, "%s n=%zu off=%zu: %s returned %s: %s",
                     c->label, c->n, c->off, side, scape_rc_name(rc), scape_last_error());
}

static void run2(ctx *c, kseg_kernel k, const void *cpu_args, const void *gpu_args)
{
    rc_ok(c, kseg_run_cpu(k, cpu_args), "cpu");
    rc_ok(c, kseg_run_cuda(k, gpu_args, NULL), "gpu");
}

/* Bit-exact comparison of arrays of `elem`-byte values. */
static void cmp_bits(ctx *c, const char *what, const void *cpu, const void *gpu, size_t count,
                     size_t elem)
{
    const unsigned char *a = cpu, *b = gpu;
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < count; i++)
        if (memcmp(a + i * elem, b + i * elem, elem) != 0 && bad++ == 0)
            first = i;
    uint64_t x = 0, y = 0;
    if (bad) {
        memcpy(&x, a + first * elem, elem < 8 ? elem : 8);
        memcpy(&y, b + first * elem, elem < 8 ? elem : 8);
    }
    gc_expect(&c->tally, bad == 0,
              "%s n=%zu off=%zu %s: %zu mismatches, first [%zu] cpu 0x%llx gpu 0x%llx", c->label,
              c->n, c->off, what, bad, first, (unsigned long long)x, (unsigned long long)y);
}

static void same(ctx *c, const char *what, const tw *b, size_t elem)
{
    cmp_bits(c, what, b->h, down(c, b), b->bytes / elem, elem);
}

/* Everything but the residual norm bit for bit; the norm within 1e-9. */
static void same_status(ctx *c, const tw *st)
{
    const kseg_status *a = st->h, *b = down(c, st);
    double tol = 1e-9 * fabs(a->norm2);
    gc_expect(&c->tally,
              a->err == b->err && a->first == b->first && a->churn[0] == b->churn[0] &&
                  a->churn[1] == b->churn[1] && fabs(a->norm2 - b->norm2) <= tol,
              "%s n=%zu off=%zu status: cpu err %u first 0x%llx churn %llu/%llu norm2 %.17g, "
              "gpu err %u first 0x%llx churn %llu/%llu norm2 %.17g",
              c->label, c->n, c->off, a->err, (unsigned long long)a->first,
              (unsigned long long)a->churn[0], (unsigned long long)a->churn[1], a->norm2, b->err,
              (unsigned long long)b->first, (unsigned long long)b->churn[0],
              (unsigned long long)b->churn[1], b->norm2);
}

static tw new_status(ctx *c)
{
    kseg_status s;
    memset(&s, 0, sizeof s);
    s.first = UINT64_MAX;
    return table(c, &s, sizeof s);
}

/* ---- the word-range kernels ---------------------------------------------------------- */

/* What the word-range checks share: the table, a mask and its scan. */
typedef struct wr {
    const layout *l;
    tw t, mask, tiles, status;
    uint64_t k;        /* set bits of the mask */
    int dense;
} wr;

/* kseg_args of side s over every word; the scan is the CPU's on both
 * sides (SCAN itself is checked apart). */
static kseg_args wr_args(const wr *w, int s)
{
    kseg_args a;
    memset(&a, 0, sizeof a);
    a.t = SIDE(w->t, s);
    a.nt = w->l->nt;
    a.w0 = 0;
    a.w1 = w->l->nw;
    a.mask = w->dense ? NULL : SIDE(w->mask, s);
    a.tiles = w->dense ? NULL : SIDE(w->tiles, s);
    a.k_cap = w->dense ? w->l->n : w->k;
    a.status = SIDE(w->status, s);
    return a;
}

static void wr_new(ctx *c, const layout *l, double p, int dense, wr *w)
{
    memset(w, 0, sizeof *w);
    w->l = l;
    w->dense = dense;
    w->t = table(c, l->t, sizeof l->t);
    uint32_t *m = rand_mask(c, l, p);
    w->k = popcount_words(m, l->nw);
    w->mask = twin(c, m, l->nw * 4);
    uint64_t nt = kseg_tiles(l->nw);
    w->tiles = twin(c, NULL, (nt + 1) * 4);
    kseg_args a = wr_args(w, 0);
    a.mask = m;
    a.tiles = w->tiles.h;
    rc_ok(c, kseg_run_cpu(KSEG_SCAN, &a), "cpu scan");
    GC_CUDA(cudaMemcpy(w->tiles.d, w->tiles.h, w->tiles.bytes, cudaMemcpyHostToDevice));
    w->status = new_status(c);
}

/* SCAN over every word and over a tail of them, each side its own. */
static void check_scan(ctx *c, const layout *l, double p)
{
    begin(c, l, "scan p=%.2f", p);
    wr w;
    wr_new(c, l, p, 0, &w);
    for (int tail = 0; tail < 2; tail++) {
        uint64_t w0 = tail ? l->nw / 3 : 0;
        tw tiles = twin(c, NULL, (kseg_tiles(l->nw - w0) + 1) * 4);
        kseg_args a[2];
        for (int s = 0; s < 2; s++) {
            a[s] = wr_args(&w, s);
            a[s].w0 = w0;
            a[s].mask = SIDE(w.mask, s);
            a[s].tiles = SIDE(tiles, s);
        }
        run2(c, KSEG_SCAN, &a[0], &a[1]);
        same(c, tail ? "tiles (tail)" : "tiles", &tiles, 4);
    }
    gc_arena_free(&c->arena);
}

/* PACK: a = G + e at the mask (or dense), the residual, keys. */
static void check_pack(ctx *c, const layout *l, double p, int dense, int bf16, int wire,
                       int key_abs, uint32_t ntr)
{
    begin(c, l, "pack p=%.2f %s %s grads, wire %s, %s keys, %u trainers", p,
          dense ? "dense" : "masked", bf16 ? "bf16" : "f32", wire ? "bf16" : "f32",
          key_abs ? "|a|" : "scape", ntr);
    const size_t n = l->n, es = bf16 ? 2 : 4;
    wr w;
    wr_new(c, l, p, dense, &w);
    tw tr[3], e = twin(c, rand_f32(c, n), n * 4), m = twin(c, rand_f32(c, n), n * 4);
    for (uint32_t q = 0; q < ntr; q++)
        tr[q] = twin(c, rand_vals(c, n, bf16), n * es);
    size_t nout = dense ? n : w.k + PAD;
    /* the keys of a window of positions, as a streamed chunk asks */
    uint64_t key_lo = n / 4, key_hi = n - n / 5;
    tw out = twin(c, NULL, nout * 4), keys = twin(c, NULL, (key_hi - key_lo) * 4 + 4);
    kseg_args a[2];
    for (int s = 0; s < 2; s++) {
        a[s] = wr_args(&w, s);
        for (uint32_t q = 0; q < ntr; q++)
            a[s].tr[q] = SIDE(tr[q], s);
        a[s].ntr = ntr;
        a[s].bf16 = bf16;
        a[s].e = SIDE(e, s);
        a[s].e_write = !dense;
        a[s].wire_bf16 = wire && !dense;
        a[s].out = SIDE(out, s);
        a[s].m = SIDE(m, s);
        a[s].keys = SIDE(keys, s);
        a[s].key_lo = key_lo;
        a[s].key_hi = key_hi;
        a[s].key_abs = key_abs;
        a[s].beta1 = 0.9f;
        a[s].c1 = 1.0f - 0.9f;
        a[s].t_r = (float)ntr;
    }
    run2(c, KSEG_PACK, &a[0], &a[1]);
    same(c, "out", &out, 4);
    same(c, "e", &e, 4);
    same(c, "keys", &keys, 4);
    same_status(c, &w.status);
    gc_arena_free(&c->arena);
}

/* GSUM: the trainer-order sum of the gradients, layout order. */
static void check_gsum(ctx *c, const layout *l, int bf16, uint32_t ntr)
{
    begin(c, l, "gsum %s, %u trainers", bf16 ? "bf16" : "f32", ntr);
    const size_t n = l->n, es = bf16 ? 2 : 4;
    tw tr[3], out = twin(c, NULL, (n + PAD) * 4);
    for (uint32_t q = 0; q < ntr; q++)
        tr[q] = twin(c, rand_vals(c, n, bf16), n * es);
    kseg_args a[2];
    memset(a, 0, sizeof a);
    for (int s = 0; s < 2; s++) {
        for (uint32_t q = 0; q < ntr; q++)
            a[s].tr[q] = SIDE(tr[q], s);
        a[s].ntr = ntr;
        a[s].bf16 = bf16;
        a[s].n = n;
        a[s].out = SIDE(out, s);
    }
    run2(c, KSEG_GSUM, &a[0], &a[1]);
    same(c, "out", &out, 4);
    gc_arena_free(&c->arena);
}

/* UPDATE: AdamS or AdamW at the mask (or dense), per-group rates, clipping. */
static void check_update(ctx *c, const layout *l, double p, int dense, int adamw, float clip)
{
    begin(c, l, "update %s p=%.2f %s clip=%g", adamw ? "adamw" : "adams", p,
          dense ? "dense" : "masked", (double)clip);
    const size_t n = l->n;
    wr w;
    wr_new(c, l, p, dense, &w);
    size_t nin = dense ? n : w.k;
    tw th = twin(c, rand_f32(c, n), n * 4), m = twin(c, rand_f32(c, n), n * 4);
    tw v = twin(c, rand_pos(c, n), n * 4), in = twin(c, rand_f32(c, nin + 1), nin * 4 + 4);
    kseg_args a[2];
    for (int s = 0; s < 2; s++) {
        a[s] = wr_args(&w, s);
        a[s].in = SIDE(in, s);
        a[s].theta = SIDE(th, s);
        a[s].m = SIDE(m, s);
        a[s].v = adamw ? SIDE(v, s) : NULL;
        a[s].update = adamw ? SCAPE_UPD_ADAMW : SCAPE_UPD_ADAMS;
        a[s].b1 = 0.9f;
        a[s].b2 = 0.95f;
        a[s].eps = 1e-8f;
        a[s].bc1 = scape_f_bias_correction(0.9f, 5);
        a[s].bc2 = scape_f_bias_correction(0.95f, 5);
        a[s].div = 3.0f;
        a[s].clip = clip;
        for (int g = 0; g < KSEG_GROUPS; g++) {
            a[s].glr[g] = 1e-3f * (float)(g + 1);
            a[s].gwd[g] = g == 1 ? 0.0f : 0.01f * (float)(g + 1);
        }
    }
    run2(c, KSEG_UPDATE, &a[0], &a[1]);
    same(c, "theta", &th, 4);
    same(c, "m", &m, 4);
    same(c, "v", &v, 4);
    same_status(c, &w.status);
    gc_arena_free(&c->arena);
}

/* COMPACT: theta at the mask -> packed fp32, bf16, or the bf16 change from
 * trainer 0's values (theta then becomes old + change). */
static void check_compact(ctx *c, const layout *l, double p, int vbf16, int delta)
{
    begin(c, l, "compact p=%.2f %s%s", p, vbf16 ? "bf16" : "f32", delta ? " delta" : "");
    const size_t n = l->n;
    wr w;
    wr_new(c, l, p, 0, &w);
    tw th = twin(c, rand_f32(c, n), n * 4), old = twin(c, rand_f32(c, n), n * 4);
    tw out = twin(c, NULL, (w.k + PAD) * 4);
    kseg_args a[2];
    for (int s = 0; s < 2; s++) {
        a[s] = wr_args(&w, s);
        a[s].theta = SIDE(th, s);
        a[s].out = SIDE(out, s);
        a[s].vbf16 = vbf16;
        a[s].delta = delta;
        a[s].tr[0] = SIDE(old, s);
        a[s].ntr = 1;
    }
    run2(c, KSEG_COMPACT, &a[0], &a[1]);
    same(c, "out", &out, 4);
    same(c, "theta", &th, 4);
    same_status(c, &w.status);
    gc_arena_free(&c->arena);
}

/* WRITEBACK: packed values (or a change) into every trainer's buffer. */
static void check_writeback(ctx *c, const layout *l, double p, int dense, int bf16, int vbf16,
                            int delta, uint32_t ntr)
{
    begin(c, l, "writeback p=%.2f %s %s params, %s values%s, %u trainers", p,
          dense ? "dense" : "masked", bf16 ? "bf16" : "f32", vbf16 ? "bf16" : "f32",
          delta ? " delta" : "", ntr);
    const size_t n = l->n, es = bf16 ? 2 : 4;
    wr w;
    wr_new(c, l, p, dense, &w);
    size_t nin = dense ? n : w.k;
    tw tr[3], in = twin(c, rand_vals(c, nin + 2, vbf16), (nin + 2) * (vbf16 ? 2 : 4));
    for (uint32_t q = 0; q < ntr; q++)
        tr[q] = twin(c, rand_vals(c, n, bf16), n * es);
    kseg_args a[2];
    for (int s = 0; s < 2; s++) {
        a[s] = wr_args(&w, s);
        for (uint32_t q = 0; q < ntr; q++)
            a[s].tr[q] = SIDE(tr[q], s);
        a[s].ntr = ntr;
        a[s].bf16 = bf16;
        a[s].vbf16 = vbf16;
        a[s].delta = delta;
        a[s].in = SIDE(in, s);
    }
    run2(c, KSEG_WRITEBACK, &a[0], &a[1]);
    for (uint32_t q = 0; q < ntr; q++)
        same(c, "trainer buffer", &tr[q], es);
    same_status(c, &w.status);
    gc_arena_free(&c->arena);
}

/* LOAD_THETA: a trainer-form buffer into theta, a window of the state. */
static void check_load_theta(ctx *c, const layout *l, int bf16)
{
    begin(c, l, "load_theta %s", bf16 ? "bf16" : "f32");
    const size_t n = l->n, es = bf16 ? 2 : 4;
    wr w;
    wr_new(c, l, 1.0, 1, &w);
    uint64_t s_base = n / 3, len = n - s_base - n / 4;
    tw in = twin(c, rand_vals(c, n, bf16), n * es), th = twin(c, NULL, (len + PAD) * 4);
    kseg_args a[2];
    for (int s = 0; s < 2; s++) {
        a[s] = wr_args(&w, s);
        a[s].in = SIDE(in, s);
        a[s].bf16 = bf16;
        a[s].theta = SIDE(th, s);
        a[s].s_base = s_base;
        a[s].n = len;
    }
    run2(c, KSEG_LOAD_THETA, &a[0], &a[1]);
    same(c, "theta", &th, 4);
    gc_arena_free(&c->arena);
}

/* CHURN and SQSUM: what the step reports (new mask bits, the squared norm). */
static void check_churn_sqsum(ctx *c, const layout *l, double p)
{
    begin(c, l, "churn p=%.2f", p);
    const size_t n = l->n;
    wr w;
    wr_new(c, l, p, 0, &w);
    tw prev = twin(c, rand_mask(c, l, p), l->nw * 4);
    kseg_args a[2];
    for (int s = 0; s < 2; s++) {
        a[s] = wr_args(&w, s);
        a[s].prev = SIDE(prev, s);
        a[s].w0 = l->nw / 5;
    }
    run2(c, KSEG_CHURN, &a[0], &a[1]);
    same_status(c, &w.status);

    begin(c, l, "sqsum");
    tw in = twin(c, rand_f32(c, n), n * 4), sq = table(c, NULL, kseg_sq_chunks(n) * 8 + 8);
    tw total = table(c, NULL, 8);
    for (int s = 0; s < 2; s++) {
        memset(&a[s], 0, sizeof a[s]);
        a[s].in = SIDE(in, s);
        a[s].n = n;
        a[s].div = 3.0f;
        a[s].sq = SIDE(sq, s);
        a[s].sq_total = SIDE(total, s);
    }
    run2(c, KSEG_SQSUM, &a[0], &a[1]);
    same(c, "chunks", &sq, 8);
    same(c, "total", &total, 8);
    gc_arena_free(&c->arena);
}

/* ---- top-k and the mask code ------------------------------------------------------ */

enum topk_kind { TK_SPREAD, TK_LEVELS, TK_EQUAL, TK_SPECIAL, TK_KINDS };
static const char *const topk_kind_name[TK_KINDS] = { "spread", "8-levels", "all-equal",
                                                      "nan-inf-zero" };

/* Keys (scape_f_key) of statistics of the given kind. */
static uint32_t *topk_keys(ctx *c, size_t n, enum topk_kind kind)
{
    static const float special[] = { NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f,
                                     1e-40f, -1e-45f, 3.0f, -3.0f };
    float *s = rand_f32(c, n);
    uint32_t *keys = gc_host(&c->arena, n * 4 + 4);
    for (size_t i = 0; i < n; i++) {
        uint64_t r = gc_next(&c->rng);
        if (kind == TK_LEVELS)
            s[i] = (float)(int)(r % 8) - 3.5f;
        else if (kind == TK_EQUAL)
            s[i] = 1.5f;
        else if (kind == TK_SPECIAL && (r & 3) == 0)
            s[i] = special[(r >> 2) % (sizeof special / sizeof special[0])];
        keys[i] = scape_f_key(s[i]);
    }
    return keys;
}

/* The rule, derived from the definition: per tensor k bits, none past its
 * end, every selected key >= every unselected one, and at the boundary key
 * the selected indices all precede the unselected ones. */
static void check_topk_rule(ctx *c, const layout *l, const uint32_t *keys, const uint32_t *mask)
{
    for (uint32_t j = 0; j < l->nt; j++) {
        const kseg_tensor *t = &l->t[j];
        const uint32_t *mk = mask + t->word, *key = keys + t->pos;
        uint64_t count = 0, nw = kseg_words_of(t), last_in = 0, first_out = t->len;
        uint32_t min_in = UINT32_MAX, max_out = 0;
        for (uint32_t i = 0; i < t->len; i++) {
            if ((mk[i >> 5] >> (i & 31)) & 1u) {
                count++;
                min_in = key[i] < min_in ? key[i] : min_in;
            } else {
                max_out = key[i] > max_out ? key[i] : max_out;
            }
        }
        for (uint32_t i = 0; i < t->len && count && count < t->len; i++) {
            if (key[i] != min_in)
                continue;
            if ((mk[i >> 5] >> (i & 31)) & 1u)
                last_in = i;
            else if (first_out == t->len)
                first_out = i;
        }
        int tail_ok = !(t->len & 31) || (mk[nw - 1] >> (t->len & 31)) == 0;
        int order_ok = count == 0 || count == t->len ||
                       (min_in >= max_out && (min_in > max_out || last_in < first_out));
        gc_expect(&c->tally, count == t->k && tail_ok && order_ok,
                  "%s n=%zu off=%zu tensor %u (len %u, k %u): rule broken (bits %llu, tail %s, "
                  "order %s)", c->label, c->n, c->off, j, t->len, t->k,
                  (unsigned long long)count, tail_ok ? "ok" : "set", order_ok ? "ok" : "wrong");
    }
}

/* The items of the selection (every tensor): KSEG_TILE words at most each. */
static uint32_t make_items(ctx *c, const layout *l, kseg_item **items, uint32_t **item0)
{
    uint64_t most = l->nw + l->nt;
    *items = gc_host(&c->arena, most * sizeof **items);
    *item0 = gc_host(&c->arena, (l->nt + 1) * 4);
    uint32_t ni = 0;
    for (uint32_t j = 0; j < l->nt; j++) {
        (*item0)[j] = ni;
        uint64_t nw = kseg_words_of(&l->t[j]);
        for (uint64_t q = 0; q < nw; q += KSEG_TILE)
            (*items)[ni++] = (kseg_item){ l->t[j].word + q,
                                          (uint32_t)(nw - q < KSEG_TILE ? nw - q : KSEG_TILE), j };
    }
    (*item0)[l->nt] = ni;
    return ni;
}

/* The passes of the device executor's selection; returns the mask twin. */
static tw run_topk(ctx *c, layout *l, const uint32_t *keys)
{
    kseg_item *items;
    uint32_t *item0, ni = make_items(c, l, &items, &item0);
    tw t = table(c, l->t, sizeof l->t), it = table(c, items, ni * sizeof *items + 1);
    tw i0 = table(c, item0, (l->nt + 1) * 4), k = twin(c, keys, l->n * 4);
    tw hist = table(c, NULL, (size_t)l->nt * KSEG_BINS0 * 4);
    tw st = table(c, NULL, l->nt * sizeof(kseg_tstate)), eq = table(c, NULL, ni * 4 + 4);
    tw mask = twin(c, NULL, l->nw * 4);
    kseg_topk_args a[2];
    for (int s = 0; s < 2; s++)
        a[s] = (kseg_topk_args){ .t = SIDE(t, s), .first = 0, .nsel = l->nt,
                                 .items = SIDE(it, s), .nitems = ni, .item0 = SIDE(i0, s),
                                 .keys = SIDE(k, s), .key_lo = 0, .hist = SIDE(hist, s),
                                 .st = SIDE(st, s), .item_eq = SIDE(eq, s),
                                 .mask = SIDE(mask, s) };
    for (int level = 0; level < 3; level++) {
        twin_fill(&hist, 0);
        a[0].level = a[1].level = level;
        run2(c, KSEG_TOPK_HIST, &a[0], &a[1]);
        run2(c, KSEG_TOPK_PICK, &a[0], &a[1]);
    }
    run2(c, KSEG_TOPK_COUNT, &a[0], &a[1]);
    run2(c, KSEG_TOPK_SCAN, &a[0], &a[1]);
    run2(c, KSEG_TOPK_WRITE, &a[0], &a[1]);
    return mask;
}

/* One tensor's place in the code, as maskcode.h lays it out: bitmap-coded
 * tensors' words first, then the positions of the index-coded ones. */
static uint32_t code_table(const layout *l, int pattern, kseg_code *cd, uint64_t sizes[4])
{
    uint64_t map = 0, kcum = 0, q = 0;
    for (uint32_t j = 0; j < l->nt; j++) {
        const kseg_tensor *t = &l->t[j];
        uint32_t b = 1;
        while (b < 32 && (1ull << b) < t->len)
            b++;
        cd[j] = (kseg_code){ .tensor = j, .by_index = (uint32_t)((pattern >> j) & 1),
                             .bits = b, .kcum = kcum, .qbase = q };
        kcum += t->k;
        if (cd[j].by_index)
            q += t->k;
        else
            map += kseg_words_of(t);
    }
    uint64_t mw = 0, pb = map * 32; /* positions start after the bitmaps */
    for (uint32_t j = 0; j < l->nt; j++) {
        if (cd[j].by_index) {
            cd[j].at = pb;
            pb += (uint64_t)l->t[j].k * cd[j].bits;
        } else {
            cd[j].at = mw;
            mw += kseg_words_of(&l->t[j]);
        }
    }
    sizes[0] = map;                             /* map_words */
    sizes[1] = pb - map * 32;                   /* pos_bits */
    sizes[2] = q;                               /* npos */
    sizes[3] = map + (sizes[1] + 31) / 32;      /* code_words */
    return l->nt;
}

/* ENCODE the selected mask, then DECODE it (and a corrupted copy) into
 * words that start as random bits: the same code, words and status on both
 * sides, and a clean round trip gives the mask back. */
static void check_code(ctx *c, layout *l, const tw *mask, int pattern)
{
    begin(c, l, "mask code pattern 0x%x", (unsigned)pattern);
    kseg_code cd[MAX_T];
    uint64_t sz[4];
    uint32_t nc = code_table(l, pattern, cd, sz);
    const uint32_t *sel = down(c, mask); /* both sides encode the same mask */
    tw t = table(c, l->t, sizeof l->t), ct = table(c, cd, sizeof cd);
    tw words = twin(c, sel, l->nw * 4), tiles = twin(c, NULL, (kseg_tiles(l->nw) + 1) * 4);
    tw code = twin(c, NULL, sz[3] * 4 + 8), count = table(c, NULL, nc * 4);
    tw status = new_status(c);
    twin_fill(&code, 0);
    kseg_args sa;
    memset(&sa, 0, sizeof sa);
    sa.mask = sel;
    sa.w1 = l->nw;
    sa.tiles = tiles.h;
    rc_ok(c, kseg_run_cpu(KSEG_SCAN, &sa), "cpu scan");
    GC_CUDA(cudaMemcpy(tiles.d, tiles.h, tiles.bytes, cudaMemcpyHostToDevice));
    kseg_code_args a[2];
    for (int s = 0; s < 2; s++)
        a[s] = (kseg_code_args){ .t = SIDE(t, s), .c = SIDE(ct, s), .nc = nc, .w0 = 0,
                                 .nwords = l->nw, .npos = sz[2], .pos_bits = sz[1],
                                 .map_words = sz[0], .code_words = sz[3],
                                 .words = SIDE(words, s), .code = SIDE(code, s),
                                 .tiles = SIDE(tiles, s), .count = SIDE(count, s),
                                 .status = SIDE(status, s) };
    run2(c, KSEG_ENCODE, &a[0], &a[1]);
    same(c, "code", &code, 4);
    same_status(c, &status);
    for (int corrupt = 0; corrupt < 2; corrupt++) {
        begin(c, l, "mask decode pattern 0x%x%s", (unsigned)pattern,
              corrupt ? ", one code bit flipped" : "");
        if (corrupt && sz[3]) {
            uint64_t b = gc_next(&c->rng) % (sz[3] * 32);
            ((uint32_t *)code.h)[b >> 5] ^= 1u << (b & 31);
            GC_CUDA(cudaMemcpy(code.d, code.h, code.bytes, cudaMemcpyHostToDevice));
        }
        uint32_t *junk = rand_mask(c, l, 0.5);
        memcpy(words.h, junk, words.bytes);
        GC_CUDA(cudaMemcpy(words.d, junk, words.bytes, cudaMemcpyHostToDevice));
        twin_fill(&count, 0);
        kseg_status fresh = { 0, 0, UINT64_MAX, { 0, 0 }, 0.0 };
        memcpy(status.h, &fresh, sizeof fresh);
        GC_CUDA(cudaMemcpy(status.d, &fresh, sizeof fresh, cudaMemcpyHostToDevice));
        run2(c, KSEG_DECODE_ZERO, &a[0], &a[1]);
        run2(c, KSEG_DECODE_MAP, &a[0], &a[1]);
        run2(c, KSEG_DECODE_POS, &a[0], &a[1]);
        run2(c, KSEG_DECODE_CHECK, &a[0], &a[1]);
        same(c, "words", &words, 4);
        same(c, "counts", &count, 4);
        same_status(c, &status);
        if (!corrupt)
            cmp_bits(c, "round trip", sel, words.h, l->nw, 4);
    }
}

static void check_topk(ctx *c, layout *l, enum topk_kind kind, int kpick)
{
    for (uint32_t j = 0; j < l->nt; j++) {
        uint32_t len = l->t[j].len;
        const uint32_t ks[4] = { 1, len / 100 + 1, len / 3 + 1, len };
        l->t[j].k = ks[(kpick + (int)j) % 4] > len ? len : ks[(kpick + (int)j) % 4];
    }
    begin(c, l, "topk %s k-pick %d", topk_kind_name[kind], kpick);
    const uint32_t *keys = topk_keys(c, l->n, kind);
    tw mask = run_topk(c, l, keys);
    same(c, "mask", &mask, 4);
    check_topk_rule(c, l, keys, down(c, &mask));
    if (kind == TK_SPREAD)
        check_code(c, l, &mask, kpick == 0 ? 0x55 : kpick == 1 ? 0x7f : 0x0);
    gc_arena_free(&c->arena);
    for (uint32_t j = 0; j < l->nt; j++)
        l->t[j].k = 0;
}

/* ---- the nccl backend's kernels ------------------------------------------------------- */

/* Floats that stress rounding: NaNs with payloads, infinities, signed zeros,
 * subnormals, exact round-to-even ties, values that round up to infinity. */
static float *convert_input(ctx *c, size_t n)
{
    static const uint32_t special[] = { 0x7fc00001u, 0xff800001u, 0x7f800000u, 0xff800000u,
                                        0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu,
                                        0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0xff7f8000u };
    float *f = rand_f32(c, n);
    for (size_t i = 0; i < n; i++) {
        uint64_t r = gc_next(&c->rng);
        uint32_t tie = ((uint32_t)(r >> 32) & 0xffff0000u) | 0x8000u; /* halfway */
        if ((r & 7) == 0)
            memcpy(&f[i], &special[(r >> 3) % (sizeof special / sizeof special[0])], 4);
        else if ((r & 7) == 1)
            memcpy(&f[i], &tie, 4);
    }
    return f;
}

static void check_comm(ctx *c, size_t n)
{
    begin(c, NULL, "kern_cuda_f32_to_bf16");
    float *f = convert_input(c, n);
    tw src = twin(c, f, n * 4), dst = twin(c, NULL, n * 2 + 2 * PAD);
    for (size_t i = 0; i < n; i++)
        ((uint16_t *)dst.h)[i] = scape_f_bf16(f[i]);
    rc_ok(c, kern_cuda_f32_to_bf16(src.d, dst.d, n, NULL), "gpu");
    same(c, "dst", &dst, 2);

    /* the owners' rank-order fp32 sum of bf16 parts (wire_values: bf16) */
    begin(c, NULL, "kern_cuda_sum_bf16_parts");
    unsigned np = 3;
    uint16_t *parts = gc_host(&c->arena, (size_t)np * n * 2 + 2);
    for (size_t i = 0; i < (size_t)np * n; i++)
        parts[i] = scape_f_bf16( /* finite: NaN payloads differ between the two */
            (float)((int)(gc_next(&c->rng) % 2001) - 1000) * 0.37f * (float)(1 + i / n));
    tw pt = twin(c, parts, (size_t)np * n * 2 + 2), out = twin(c, NULL, (n + PAD) * 4);
    for (size_t i = 0; i < n; i++)
        ((float *)out.h)[i] = scape_f_sum_bf16_parts(parts, np, n, i);
    rc_ok(c, kern_cuda_sum_bf16_parts(pt.d, np, n, out.d, NULL), "gpu");
    same(c, "out", &out, 4);
    gc_arena_free(&c->arena);
}

/* ---- driver ------------------------------------------------------------------------- */

static void check_layout(ctx *c, layout *l)
{
    static const double dens[] = { 0.0, 0.01, 0.5, 1.0 };
    for (int i = 0; i < 4; i++) {
        check_scan(c, l, dens[i]);
        check_pack(c, l, dens[i], 0, i & 1, i >= 2, i == 1, 1 + (uint32_t)(i % 3));
        check_update(c, l, dens[i], 0, i & 1, i == 2 ? 0.5f : 0.0f);
        check_compact(c, l, dens[i], i >= 1, i == 3);
        check_writeback(c, l, dens[i], 0, i == 1, i >= 2, i == 3, 1 + (uint32_t)(i % 3));
        check_churn_sqsum(c, l, dens[i]);
    }
    for (int w = 0; w < 2; w++) {
        check_pack(c, l, 1.0, 1, w, 0, w, 2);
        check_update(c, l, 1.0, 1, w, 0.0f);
        check_writeback(c, l, 1.0, 1, w, 0, 0, 3);
        check_gsum(c, l, w, 1 + 2 * (uint32_t)w);
        check_load_theta(c, l, w);
    }
    for (int kind = 0; kind < TK_KINDS; kind++)
        for (int kp = 0; kp < 3; kp++)
            check_topk(c, l, (enum topk_kind)kind, kp);
}

static void check_size(ctx *c, size_t n)
{
    unsigned before = c->tally.failures;
    c->n = n;
    for (c->off = 0; c->off <= 4; c->off += 4) {
        check_comm(c, n);
        for (int split = 0; split < 2 && n > 0; split++) {
            layout l;
            make_layout(c, n, split, &l);
            check_layout(c, &l);
        }
    }
    printf("n=%-9zu %s (%u checks so far)\n", n, c->tally.failures == before ? "ok" : "FAILED",
           c->tally.checks);
    fflush(stdout);
}

static void print_device(void)
{
    int dev = 0;
    struct cudaDeviceProp prop;
    GC_CUDA(cudaGetDevice(&dev));
    GC_CUDA(cudaGetDeviceProperties(&prop, dev));
    printf("gpu_check: device %d: %s (sm_%d%d, %.1f GiB)\n", dev, prop.name, prop.major,
           prop.minor, (double)prop.totalGlobalMem / (1u << 30));
}

static int parse_args(int argc, char **argv, uint64_t *seed, size_t *max_n)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc)
            *seed = strtoull(argv[++i], NULL, 0);
        else if (strcmp(argv[i], "--max-n") == 0 && i + 1 < argc)
            *max_n = (size_t)strtod(argv[++i], NULL);
        else {
            fprintf(stderr, "usage: %s [--seed S] [--max-n N]\n", argv[0]);
            return 0;
        }
    }
    return 1;
}

int main(int argc, char **argv)
{
    /* 2^16 + 1: several scan tiles and top-k items, small enough for the
     * CPU emulator (tests/gpu/emu) */
    static const size_t sizes[] = { 0, 1, 31, 33, 1000, (1u << 16) + 1, (1u << 20) + 7, 10000000 };
    setvbuf(stdout, NULL, _IOLBF, 0); /* lines survive a kill by run.sh's timeout */
    uint64_t seed = gc_seed_from_time();
    size_t max_n = 10000000;
    if (!parse_args(argc, argv, &seed, &max_n))
        return 2;
    if (!gc_gpu_ready("gpu_check"))
        return GC_SKIP;
    print_device();
    printf("gpu_check: seed %llu (rerun with --seed %llu)\n", (unsigned long long)seed,
           (unsigned long long)seed);
    ctx c;
    memset(&c, 0, sizeof c);
    gc_rng_init(&c.rng, seed);
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (sizes[i] <= max_n)
            check_size(&c, sizes[i]);
    check_bad_args(&c.tally);
    printf("gpu_check: %s: %u checks, %u failed, seed %llu\n",
           c.tally.failures ? "FAIL" : "PASS", c.tally.checks, c.tally.failures,
           (unsigned long long)seed);
    return c.tally.failures ? 1 : 0;
}
