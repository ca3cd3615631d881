/* test_engine.c - the invariants of docs/algorithm.md, checked step by step
 * against a float64 reference written here.
 *
 * R ranks run as threads on the local comm backend.  After every step all
 * ranks publish their state; rank 0 then checks, in double precision:
 *   - the residual, g_hat, m, theta (and v) against a one-step reference
 *     computed from the state before the step (teacher forcing, so fp32 and
 *     fp64 trajectories never drift apart and tolerances stay tight);
 *   - the mask: all ranks agree, popcount == sum k_l (no fill-in), and it is
 *     the per-tensor top-k of the statistics of the previous step (lag);
 *   - conservation: sum_r e_r + T sum_tau [M] g_hat == sum_tau sum_r G_r;
 *   - one reduction collective of exactly K values and one mask all-gather;
 *   - every trainer's parameters equal the master copy (replica agreement).
 * Whole runs are compared bitwise across modes, and against a dense float64
 * AdamS / AdamW run for rho = 1.
 */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine.h"
#include "rank_threads.h"
#include "scape_formula.h"
#include "check_run.h"

#define MAX_R 8
#define MAX_TR 4

/* Lengths include 1, non-multiples of 32 and one exact multiple. */
static const size_t s_lens[] = { 1, 31, 33, 64, 100, 257, 1, 7, 500, 190 };
#define NT (sizeof s_lens / sizeof s_lens[0])
/* split_above forced on these small tensors (the invariant tests run with
 * 0 and with it: _i 1): w64 into 2 pieces, w500 into 11, 31 pieces in all. */
#define SPLIT_SMALL 48
#define MAX_PC 64
static uint32_t s_split; /* make_spec's split_above */
static uint32_t split_of(int i) { return i ? SPLIT_SMALL : 0; }

static uint64_t s_seed;

/* ---- the run description and shared per-step publication ------------- */

typedef struct spec {
    eng_config cfg;
    int R;
    int tr[MAX_R];
    kern_dtype pdt, gdt;
    int steps;
    int check;      /* run the per-step reference checks */
    int ties;       /* gradients from a tiny set of values */
    int finish;     /* call eng_step_finish after each step (else eng_step does) */
    int loud;       /* every third step's gradients 8 times larger */
    size_t ngroups; /* parameter groups: tensor l in group l % ngroups, weight
                       decay gwd[g] (NaN: cfg's), lr at step t of lr_at() */
    float gwd[4];
    float lr;
} spec;

typedef struct published {
    float *e_before, *e_after;
    float *m_before, *m_after, *v_before, *v_after, *th_before, *th_after;
    unsigned char *have, *mask, *ghave;
    float *ghat;
    float *params[MAX_TR]; /* as float */
    eng_step_stats st;
} published;

typedef struct ctx {
    const spec *sp;
    eng_tensor ts[NT];
    eng_tensor pc[MAX_PC];  /* the plan's tensors: ts split at split_above, */
    size_t pc_whole[MAX_PC]; /* ... each one's registered tensor's length */
    size_t npc;
    size_t n;
    int T;
    pthread_barrier_t bar;
    published pub[MAX_R];
    /* reference accumulators (rank 0 only) */
    double *sum_g, *sum_sent, *sum_abs, *stat_prev;
    int have_stat_prev;
    unsigned char *mask_prev; /* the last step's mask, when it was sparse */
    int have_mask_prev;
    float *final_params;     /* rank 0 trainer 0 after the run */
    size_t *k_hist;          /* K per step */
    int clipped, unclipped;  /* max_grad_norm: steps that did and did not clip */
    uint64_t delta_bytes, full_bytes; /* mask_deltas: what the mask all-gathers
                                         moved, and what the fixed codes would */
    char fail[1024];
    int failed;
} ctx;

static void note_fail(ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note_fail(ctx *c, const char *fmt, ...)
{
    if (c->failed)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->fail, sizeof c->fail, fmt, ap);
    va_end(ap);
    c->failed = 1;
}

/* The split rule restated (docs/algorithm.md): a tensor longer than S > 0
 * becomes np = ceil(len / S) pieces, piece q from floor(q len / np), in
 * layout order, a tensor's pieces in a row. */
static void split_layout(ctx *c)
{
    size_t S = c->sp->cfg.split_above;
    c->npc = 0;
    for (size_t j = 0; j < NT; j++) {
        size_t len = c->ts[j].length, np = S && len > S ? (len + S - 1) / S : 1;
        for (size_t q = 0; q < np && c->npc < MAX_PC; q++, c->npc++) {
            size_t a = len * q / np, b = len * (q + 1) / np;
            c->pc[c->npc] = (eng_tensor){ c->ts[j].name, c->ts[j].offset + a, b - a,
                                          c->ts[j].group };
            c->pc_whole[c->npc] = len;
        }
    }
}

static void build_layout(ctx *c)
{
    static const char *names[NT] = { "bias0", "w31", "w33", "w64", "w100",
                                     "w257", "bias1", "w7", "w500", "w190" };
    size_t off = 0;
    /* Registered in a shuffled order: the layout need not be sorted. */
    static const int perm[NT] = { 3, 0, 9, 1, 5, 2, 8, 4, 7, 6 };
    size_t offs[NT];
    for (size_t i = 0; i < NT; i++) {
        offs[i] = off;
        off += s_lens[i];
    }
    for (size_t j = 0; j < NT; j++)
        c->ts[j] = (eng_tensor){ names[perm[j]], offs[perm[j]], s_lens[perm[j]],
                                 c->sp->ngroups ? (uint32_t)(j % c->sp->ngroups) : 0 };
    c->n = off;
    split_layout(c);
}

/* Group g's learning rate at step t: with groups, g's own and changing
 * from step to step (a schedule per group); without, the spec's lr. */
static float lr_at(const spec *sp, size_t g, uint64_t t)
{
    return sp->ngroups ? sp->lr * (float)(1 + g) * (float)(1 + t % 3) : sp->lr;
}

/* The weight decay of group g, as the engine resolves it. */
static float wd_of(const spec *sp, size_t g)
{
    return sp->ngroups && !isnan(sp->gwd[g]) ? sp->gwd[g] : sp->cfg.hyper.wd;
}

static size_t tensor_of(const ctx *c, size_t i)
{
    for (size_t l = 0; l < NT; l++)
        if (i >= c->ts[l].offset && i < c->ts[l].offset + c->ts[l].length)
            return l;
    return 0;
}

/* The plan tensor (piece) holding coordinate i. */
static size_t piece_of(const ctx *c, size_t i)
{
    for (size_t l = 0; l < c->npc; l++)
        if (i >= c->pc[l].offset && i < c->pc[l].offset + c->pc[l].length)
            return l;
    return 0;
}

/* ---- gradients ---------------------------------------------------------- */

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static double unit(uint64_t h) { return (double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0; }

/* Trainer j of rank r at step t: a persistent per-coordinate signal (so the
 * first moment has structure and masks are stable) plus fresh noise. */
static float grad_val(const ctx *c, int r, int j, uint64_t t, size_t i)
{
    uint64_t base = mix(s_seed ^ (i * 0x9e3779b97f4a7c15ull));
    uint64_t h = mix(base ^ mix(((uint64_t)r << 40) ^ ((uint64_t)j << 32) ^ t));
    if (c->sp->ties)
        return (float)((int)(h % 3) - 1);
    double scale = (0.01 + 0.1 * (double)(tensor_of(c, i) % 4)) * (c->sp->loud && t % 3 == 0 ? 8.0 : 1.0);
    return (float)(scale * (0.6 * unit(base) + unit(h)));
}

/* Fill trainer buffers of rank r for step t in the gradient dtype. */
static void fill_grads(const ctx *c, int r, uint64_t t, void **grads)
{
    for (int j = 0; j < c->sp->tr[r]; j++)
        for (size_t i = 0; i < c->n; i++) {
            float g = grad_val(c, r, j, t, i);
            if (c->sp->gdt == KERN_F32)
                ((float *)grads[j])[i] = g;
            else
                ((uint16_t *)grads[j])[i] = kern_bf16_from_f32(g);
        }
}

/* G_r,i in double from the values the trainers actually handed over. */
static double grad_sum(const ctx *c, int r, uint64_t t, size_t i, double *abs_sum)
{
    double s = 0.0;
    *abs_sum = 0.0;
    for (int j = 0; j < c->sp->tr[r]; j++) {
        float g = grad_val(c, r, j, t, i);
        if (c->sp->gdt == KERN_BF16)
            g = kern_f32_from_bf16(kern_bf16_from_f32(g));
        s += g;
        *abs_sum += fabs(g);
    }
    return s;
}

/* ---- per-step checks (rank 0, after every rank has published) ---------- */

static int holder_of(const ctx *c, size_t i, int owner)
{
    (void)i;
    return c->sp->cfg.mode == ENG_MODE_SHARDED ? owner : 0;
}

static int dense_at(const spec *sp, uint64_t t)
{
    /* SCAPE at rho = 1 runs every step dense: its masks would be all ones */
    return sp->cfg.optimizer == ENG_OPT_ADAMS || sp->cfg.optimizer == ENG_OPT_ADAMW ||
           (sp->cfg.optimizer == ENG_OPT_SCAPE && sp->cfg.rho >= 1.0) || t <= sp->cfg.warmup;
}

/* The density schedule restated: rho_start halved at equal intervals over
 * rho_steps masked steps, never below rho; rho itself without one. */
static double rho_at(const spec *sp, uint64_t t)
{
    const eng_config *c = &sp->cfg;
    if (c->rho_start <= 0.0 || t <= c->warmup || t - c->warmup - 1 >= c->rho_steps)
        return c->rho;
    int halvings = 0;
    for (double r = c->rho_start; r > c->rho; r *= 0.5)
        halvings++;
    uint64_t stage = (t - c->warmup - 1) * (uint64_t)halvings / c->rho_steps;
    double r = c->rho_start;
    for (uint64_t q = 0; q < stage; q++)
        r *= 0.5;
    return r > c->rho ? r : c->rho;
}

/* k_l of plan tensor (piece) l in step t's mask: the plan's rule
 * (docs/algorithm.md) at the step's density, computed here; a piece of a
 * tensor of at most dense_below coordinates whole. */
static size_t want_k(const ctx *c, uint64_t t, size_t l)
{
    size_t len = c->pc[l].length;
    if (c->pc_whole[l] <= c->sp->cfg.dense_below)
        return len;
    double x = rho_at(c->sp, t) * (double)len, k = ceil(x - 1e-12 * x);
    return k < 1.0 ? 1 : k > (double)len ? len : (size_t)k;
}

/* This step published changes (gather_values: delta, fp32 trainers, a
 * mask): the owner's update is rounded to the trainers' value plus a bf16
 * change. */
static int delta_at(const spec *sp, uint64_t t)
{
    return sp->cfg.gather == ENG_GATHER_DELTA && sp->pdt == KERN_F32 && !dense_at(sp, t);
}

/* This step's packed values went in bf16 (wire_values: bf16, a mask). */
static int wire_bf16_at(const spec *sp, uint64_t t)
{
    return sp->cfg.wire_bf16 && !dense_at(sp, t);
}

/* a_r,i in fp32 as the engine computes it: the trainers' values summed in
 * trainer order, then the residual added. */
static float pack_value(const ctx *c, int r, uint64_t t, size_t i)
{
    float g = 0.0f;
    for (int j = 0; j < c->sp->tr[r]; j++) {
        float x = grad_val(c, r, j, t, i);
        if (c->sp->gdt == KERN_BF16)
            x = kern_f32_from_bf16(kern_bf16_from_f32(x));
        g = j ? g + x : x;
    }
    return g + c->pub[r].e_before[i];
}

static int uses_v(const spec *sp)
{
    return sp->cfg.optimizer == ENG_OPT_ADAMW || sp->cfg.optimizer == ENG_OPT_TOPK_ADAMW;
}

/* Residual and g_hat of coordinate i; accumulates the conservation sums. */
static void check_residual(ctx *c, uint64_t t, size_t i, int on_mask, int holder)
{
    double sent = 0.0, abs_all = 0.0, g_all = 0.0;
    for (int r = 0; r < c->sp->R; r++) {
        double ga;
        double g = grad_sum(c, r, t, i, &ga);
        double a = g + (double)c->pub[r].e_before[i];
        double want = on_mask ? 0.0 : a;
        double tol = 4e-7 * (ga + fabs((double)c->pub[r].e_before[i])) + 1e-30;
        if (on_mask && wire_bf16_at(c->sp, t)) {
            /* bf16 values: the rank sent s = bf16(a) and kept a - s, both
             * exact in fp32 (s + (a - s) == a, bit for bit) */
            float af = pack_value(c, r, t, i), sf = scape_f_wire_bf16(af);
            float ef = c->pub[r].e_after[i];
            if (memcmp(&ef, &(float){ af - sf }, sizeof ef) != 0 || sf + ef != af ||
                (scape_f_bits(sf) & 0xffffu) != 0)
                note_fail(c, "step %llu coord %zu rank %d: bf16 values: residual %.9g, want "
                          "a - bf16(a) = %.9g - %.9g", (unsigned long long)t, i, r,
                          (double)ef, (double)af, (double)sf);
            sent += sf;
        } else {
            if (fabs((double)c->pub[r].e_after[i] - want) > tol)
                note_fail(c, "step %llu coord %zu rank %d: residual %.9g, want %.9g",
                          (unsigned long long)t, i, r, (double)c->pub[r].e_after[i], want);
            sent += on_mask ? a : 0.0;
        }
        abs_all += ga + fabs((double)c->pub[r].e_before[i]); /* magnitudes before cancellation */
        g_all += g;
        c->sum_abs[i] += ga;
    }
    c->sum_g[i] += g_all;
    if (!on_mask)
        return;
    const published *h = &c->pub[holder];
    if (!h->ghave[i])
        note_fail(c, "step %llu coord %zu: holder %d has no g_hat", (unsigned long long)t, i, holder);
    double ghat = (double)h->ghat[i];
    if (fabs(ghat - sent / c->T) > 1e-6 * abs_all / c->T * (c->sp->R + 1) + 1e-30)
        note_fail(c, "step %llu coord %zu: g_hat %.9g, want %.9g", (unsigned long long)t, i, ghat,
             sent / c->T);
    c->sum_sent[i] += c->T * ghat;
}

/* The optimizer update of coordinate i from the holder's state before. */
static void check_update(ctx *c, uint64_t t, size_t i, int on_mask, int holder)
{
    const published *h = &c->pub[holder];
    const kern_hyper *hp = &c->sp->cfg.hyper;
    size_t grp = c->ts[tensor_of(c, i)].group;
    double th0 = h->th_before[i], m0 = h->m_before[i], lr = lr_at(c->sp, grp, t);
    double wd = wd_of(c->sp, grp);
    if (!on_mask) {
        if (h->th_after[i] != h->th_before[i] || h->m_after[i] != h->m_before[i])
            note_fail(c, "step %llu coord %zu: off-mask state changed", (unsigned long long)t, i);
        return;
    }
    /* the update takes g_hat times the step's clipping factor */
    double g = (double)h->ghat[i] * h->st.clip, b1 = hp->beta1, b2 = hp->beta2, m1, th1,
           v1 = 0.0;
    if (uses_v(c->sp)) {
        double bc1 = 1.0 - pow(b1, (double)t), bc2 = 1.0 - pow(b2, (double)t);
        m1 = b1 * m0 + (1 - b1) * g;
        v1 = b2 * h->v_before[i] + (1 - b2) * g * g;
        th1 = th0 - lr * ((m1 / bc1) / (sqrt(v1 / bc2) + hp->eps) + wd * th0);
        if (fabs(h->v_after[i] - v1) > 2e-6 * v1 + 1e-30)
            note_fail(c, "step %llu coord %zu: v %.9g, want %.9g", (unsigned long long)t, i,
                 (double)h->v_after[i], v1);
    } else {
        m1 = b1 * m0 + (1 - b1) * g;
        double v = b2 * m0 * m0 + (1 - b2) * g * g;
        th1 = th0 - lr * (m1 / (sqrt(v) + hp->eps) + wd * th0);
    }
    if (fabs(h->m_after[i] - m1) > 1e-6 * (fabs(m0) + fabs(g)) + 1e-30)
        note_fail(c, "step %llu coord %zu: m %.9g, want %.9g", (unsigned long long)t, i,
             (double)h->m_after[i], m1);
    /* delta: the change went in bf16, rounded to nearest (a relative 2^-9;
     * twice that where fp32 and this float64 round to neighbours) */
    double dtol = delta_at(c->sp, t) ? 0x1p-8 * fabs(th1 - th0) : 0.0;
    if (fabs(h->th_after[i] - th1) > 1e-6 * fabs(th0) + 2e-5 * lr + dtol)
        note_fail(c, "step %llu coord %zu: theta %.9g, want %.9g", (unsigned long long)t, i,
             (double)h->th_after[i], th1);
}

/* Every trainer of every rank holds exactly the master copy (in its dtype),
 * and all holders agree bitwise. */
static void check_replicas(ctx *c, uint64_t t, size_t i, int holder)
{
    float th = c->pub[holder].th_after[i];
    float want = c->sp->pdt == KERN_F32 ? th : kern_f32_from_bf16(kern_bf16_from_f32(th));
    for (int r = 0; r < c->sp->R; r++) {
        for (int j = 0; j < c->sp->tr[r]; j++)
            if (memcmp(&c->pub[r].params[j][i], &want, sizeof want) != 0)
                note_fail(c, "step %llu coord %zu: rank %d trainer %d param %.9g != master %.9g",
                     (unsigned long long)t, i, r, j, (double)c->pub[r].params[j][i],
                     (double)want);
        if (c->pub[r].mask[i] != c->pub[0].mask[i])
            note_fail(c, "step %llu coord %zu: ranks 0 and %d use different masks",
                 (unsigned long long)t, i, r);
        if (c->pub[r].have[i] && memcmp(&c->pub[r].th_after[i], &th, sizeof th) != 0)
            note_fail(c, "step %llu coord %zu: rank %d master differs", (unsigned long long)t, i, r);
    }
}

/* SCAPE statistic of coordinate i at this step, from the owner's view. */
static double scape_stat(const ctx *c, uint64_t t, size_t i, int owner, int holder)
{
    double ga, b1 = c->sp->cfg.hyper.beta1;
    double a = grad_sum(c, owner, t, i, &ga) + (double)c->pub[owner].e_before[i];
    return fabs(b1 * c->pub[holder].m_before[i] + (1 - b1) * a / c->sp->tr[owner]);
}

/* The mask used now is, per tensor, exactly k_l of the largest statistics of
 * the previous step (ties within fp32 rounding may go either way). */
static void check_lagged_selection(ctx *c, uint64_t t)
{
    for (size_t l = 0; l < c->npc; l++) {
        const eng_tensor *ts = &c->pc[l];
        size_t k = 0;
        double min_in = INFINITY, max_out = 0.0, top = 0.0;
        for (size_t i = ts->offset; i < ts->offset + ts->length; i++) {
            double s = c->stat_prev[i];
            top = fmax(top, s);
            if (c->pub[0].mask[i]) {
                k++;
                min_in = fmin(min_in, s);
            } else {
                max_out = fmax(max_out, s);
            }
        }
        if (k != want_k(c, t, l))
            note_fail(c, "step %llu tensor %s: %zu mask bits, want k=%zu", (unsigned long long)t,
                 ts->name, k, want_k(c, t, l));
        if (min_in < max_out - 1e-6 * top - 1e-30)
            note_fail(c, "step %llu tensor %s: selected stat %.9g below unselected %.9g",
                 (unsigned long long)t, ts->name, min_in, max_out);
    }
}

/* Bytes of the mask code of the tensors `owner` owns (-1: of all tensors),
 * maskcode.h's rule restated: k positions of b = bits(len - 1) bits where
 * that is fewer bits than the tensor's bitmap words, else the words; the
 * positions of a rank's tensors form one stream padded to a word. */
static size_t code_bytes(const ctx *c, const eng_t *e, int owner, uint64_t t)
{
    size_t words = 0, bits = 0;
    for (size_t l = 0; l < c->npc; l++) {
        if (owner >= 0 && eng_tensor_owner(e, l) != owner)
            continue;
        size_t len = c->pc[l].length, w = (len + 31) / 32;
        size_t k = c->sp->cfg.optimizer == ENG_OPT_SCAPE ? want_k(c, t, l) : eng_tensor_k(e, l);
        size_t b = 1;
        while ((len - 1) >> b)
            b++;
        if (k * b < 32 * w)
            bits += k * b;
        else
            words += w;
    }
    return 4 * (words + (bits + 31) / 32);
}

/* What a mask all-gather moves in all: SCAPE, every owner's bits of its
 * shard; topk-adamw, every rank's bits of every tensor. */
static size_t expected_mask_bytes(const ctx *c, const eng_t *e, int topk, uint64_t t)
{
    size_t total = 0;
    for (int r = 0; r < c->sp->R; r++)
        total += code_bytes(c, e, topk ? -1 : r, t);
    return total;
}

/* One reduction collective of K values; one (lagged) mask all-gather, that of
 * the step's own mask. */
static void check_collectives(ctx *c, uint64_t t, size_t K, const eng_t *e0)
{
    const spec *sp = c->sp;
    int sharded = sp->cfg.mode == ENG_MODE_SHARDED;
    int scape = sp->cfg.optimizer == ENG_OPT_SCAPE;
    int topk_sparse = sp->cfg.optimizer == ENG_OPT_TOPK_ADAMW && !dense_at(sp, t);
    for (int r = 0; r < sp->R; r++) {
        const comm_stats *s = &c->pub[r].st.comm;
        comm_op red = sharded ? COMM_REDUCE_SCATTER : COMM_ALLREDUCE;
        uint64_t reductions = s->calls[COMM_ALLREDUCE] + s->calls[COMM_REDUCE_SCATTER];
        size_t vsz = wire_bf16_at(sp, t) ? 2 : 4; /* the values: bf16 or fp32 */
        /* sharded owners gather the new parameters in the trainers' dtype */
        uint64_t gsz =
            (sp->pdt == KERN_BF16 && sp->cfg.gather != ENG_GATHER_F32) || delta_at(sp, t) ? 2 : 4;
        if (reductions != 1 || s->bytes[red] != vsz * K)
            note_fail(c, "step %llu rank %d: %llu reductions of %llu bytes, want 1 of %zu",
                 (unsigned long long)t, r, (unsigned long long)reductions,
                 (unsigned long long)s->bytes[red], vsz * K);
        /* clipping, both modes: each owner's sum of squares of g_hat and its
         * |G_r|^2, two doubles a rank */
        int clip_ag = sp->cfg.max_grad_norm > 0.0f;
        /* mask_deltas: a step that selects inside itself all-gathers the
         * sizes of the next mask's codes, 8 bytes a rank (a dense step
         * never defers its selection) */
        int sizes_ag = sp->cfg.mask_deltas && scape && sp->cfg.rho < 1.0 &&
                       t >= sp->cfg.warmup && (!sp->cfg.defer_select || dense_at(sp, t));
        uint64_t want_ag = (uint64_t)sharded + (uint64_t)topk_sparse + (uint64_t)clip_ag +
                           (uint64_t)sizes_ag;
        uint64_t want_ag_bytes = (sharded ? gsz * K : 0) +
                                 (topk_sparse ? expected_mask_bytes(c, e0, 1, t) : 0) +
                                 (clip_ag ? 16 * (uint64_t)sp->R : 0) +
                                 (sizes_ag ? 8 * (uint64_t)sp->R : 0);
        if (s->calls[COMM_ALLGATHER] != want_ag || s->bytes[COMM_ALLGATHER] != want_ag_bytes)
            note_fail(c, "step %llu rank %d: %llu all-gathers of %llu bytes, want %llu of %llu",
                 (unsigned long long)t, r, (unsigned long long)s->calls[COMM_ALLGATHER],
                 (unsigned long long)s->bytes[COMM_ALLGATHER], (unsigned long long)want_ag,
                 (unsigned long long)want_ag_bytes);
        /* the mask all-gather counts to the step whose mask it brought */
        uint64_t want_iag = scape && !dense_at(sp, t);
        /* deltas: at most the fixed codes and a form word a rank */
        uint64_t full = expected_mask_bytes(c, e0, 0, t), form = 4 * (uint64_t)sp->R;
        int iag_bytes_ok = sp->cfg.mask_deltas
                               ? ((sp->cfg.mask_deltas == 2 ||
                                   s->bytes[COMM_IALLGATHER] <= want_iag * (full + form)) &&
                                  s->bytes[COMM_IALLGATHER] >= want_iag * form)
                               : s->bytes[COMM_IALLGATHER] == want_iag * full;
        if (sp->cfg.mask_deltas && want_iag) {
            c->delta_bytes += s->bytes[COMM_IALLGATHER];
            c->full_bytes += full;
        }
        if (s->calls[COMM_IALLGATHER] != want_iag || !iag_bytes_ok)
            note_fail(c, "step %llu rank %d: %llu mask all-gathers of %llu bytes",
                 (unsigned long long)t, r, (unsigned long long)s->calls[COMM_IALLGATHER],
                 (unsigned long long)s->bytes[COMM_IALLGATHER]);
        uint64_t want_mask = want_iag ? expected_mask_bytes(c, e0, 0, t)
                                      : topk_sparse ? expected_mask_bytes(c, e0, 1, t) : 0;
        if (c->pub[r].st.mask_bytes != want_mask &&
            !(sp->cfg.mask_deltas && c->pub[r].st.mask_bytes == s->bytes[COMM_IALLGATHER]))
            note_fail(c, "step %llu rank %d: stats say %llu mask bytes, want %llu",
                 (unsigned long long)t, r, (unsigned long long)c->pub[r].st.mask_bytes,
                 (unsigned long long)want_mask);
    }
}

/* max_grad_norm: the norm torch's clip_grad_norm_ would see, in float64 from
 * the gradients the trainers handed over: g_hat's own norm on a dense step
 * (no residual yet), |G_0| / T with one rank, else (1/T) sum_r |G_r|; each
 * local trainer's own norm (rank 0's); every rank the same bits.  Returns
 * the reference. */
static double check_mean_grad_norm(ctx *c, uint64_t t, eng_t *e0, double sent)
{
    const spec *sp = c->sp;
    const eng_step_stats *st = &c->pub[0].st;
    double ga, bound = 0.0, want;
    for (int r = 0; r < sp->R; r++) {
        double sq = 0.0;
        for (size_t i = 0; i < c->n; i++) {
            double g = grad_sum(c, r, t, i, &ga);
            sq += g * g;
        }
        bound += sqrt(sq);
        if (memcmp(&c->pub[r].st.mean_grad_norm, &st->mean_grad_norm, sizeof(double)) != 0 ||
            c->pub[r].st.mean_grad_exact != st->mean_grad_exact)
            note_fail(c, "step %llu: rank %d reports mean gradient norm %.17g, rank 0 %.17g",
                      (unsigned long long)t, r, c->pub[r].st.mean_grad_norm,
                      st->mean_grad_norm);
    }
    int dense = dense_at(sp, t);
    want = dense ? sent : bound / (double)c->T;
    if (fabs(st->mean_grad_norm - want) > (dense ? 1e-12 : 1e-6) * want + 1e-300 ||
        st->mean_grad_exact != (dense || sp->R == 1))
        note_fail(c, "step %llu: mean gradient norm %.17g (exact %d), want %.17g (exact %d)",
                  (unsigned long long)t, st->mean_grad_norm, st->mean_grad_exact, want,
                  dense || sp->R == 1);
    for (int j = 0; j < sp->tr[0]; j++) {
        double sq = 0.0;
        for (size_t i = 0; i < c->n; i++) {
            float g = grad_val(c, 0, j, t, i);
            if (sp->gdt == KERN_BF16)
                g = kern_f32_from_bf16(kern_bf16_from_f32(g));
            sq += (double)g * (double)g;
        }
        double got = eng_trainer_grad_norm(e0, j);
        if (fabs(got - sqrt(sq)) > 1e-9 * sqrt(sq))
            note_fail(c, "step %llu: trainer %d's own gradient norm %.17g, want %.17g",
                      (unsigned long long)t, j, got, sqrt(sq));
    }
    return want;
}

/* max_grad_norm: the norm of g_hat over the coordinates reduced, in
 * float64 from the holders' g_hat; the factor torch's clip_grad_norm_ takes
 * from it (or, with clip_norm gradient, from the mean gradient's norm);
 * every rank reports the same bits. */
static void check_clipping(ctx *c, uint64_t t, eng_t *e0)
{
    const spec *sp = c->sp;
    const eng_step_stats *st = &c->pub[0].st;
    for (int r = 1; r < sp->R; r++)
        if (memcmp(&c->pub[r].st.grad_norm, &st->grad_norm, sizeof st->grad_norm) != 0 ||
            memcmp(&c->pub[r].st.clip, &st->clip, sizeof st->clip) != 0)
            note_fail(c, "step %llu: rank %d reports norm %.17g clip %.9g, rank 0 %.17g %.9g",
                      (unsigned long long)t, r, c->pub[r].st.grad_norm, c->pub[r].st.clip,
                      st->grad_norm, st->clip);
    if (!(sp->cfg.max_grad_norm > 0.0f)) {
        if (st->grad_norm != 0.0 || st->clip != 1.0)
            note_fail(c, "step %llu: no max_grad_norm, yet norm %g clip %g",
                      (unsigned long long)t, st->grad_norm, st->clip);
        return;
    }
    double sq = 0.0;
    for (size_t i = 0; i < c->n; i++)
        if (c->pub[0].mask[i]) {
            int holder = holder_of(c, i, eng_tensor_owner(e0, piece_of(c, i)));
            double g = c->pub[holder].ghat[i];
            sq += g * g;
        }
    double norm = sqrt(sq), mean = check_mean_grad_norm(c, t, e0, norm);
    double by = sp->cfg.clip_norm == ENG_CLIP_GRAD ? mean : norm;
    double coef = sp->cfg.max_grad_norm / (by + 1e-6);
    double want = coef < 1.0 ? coef : 1.0;
    if (fabs(st->grad_norm - norm) > 1e-12 * norm + 1e-300)
        note_fail(c, "step %llu: norm of g_hat %.17g, want %.17g", (unsigned long long)t,
                  st->grad_norm, norm);
    if (fabs(st->clip - want) > 6e-8 * want)
        note_fail(c, "step %llu: clipping factor %.9g, want %.9g (norm %g, max %g)",
                  (unsigned long long)t, st->clip, want, norm, (double)sp->cfg.max_grad_norm);
    if (want < 1.0)
        c->clipped++;
    else
        c->unclipped++;
}

/* SCAPE: the mask churn, M_t's coordinates not in M_{t-1} over M_t's, when
 * both are sparse. */
static void check_churn(ctx *c, uint64_t t)
{
    const spec *sp = c->sp;
    int sparse = sp->cfg.optimizer == ENG_OPT_SCAPE && !dense_at(sp, t);
    if (sparse && c->have_mask_prev) {
        uint64_t fresh = 0, total = 0;
        for (size_t i = 0; i < c->n; i++) {
            fresh += c->pub[0].mask[i] && !c->mask_prev[i];
            total += c->pub[0].mask[i] != 0;
        }
        double want = total ? (double)fresh / (double)total : 0.0;
        if (c->pub[0].st.mask_churn != want)
            note_fail(c, "step %llu: mask churn %.9g, want %.9g (%llu new of %llu)",
                      (unsigned long long)t, c->pub[0].st.mask_churn, want,
                      (unsigned long long)fresh, (unsigned long long)total);
    }
    c->have_mask_prev = sparse;
    memcpy(c->mask_prev, c->pub[0].mask, c->n);
}

static void check_step(ctx *c, uint64_t t, eng_t *e0)
{
    const spec *sp = c->sp;
    size_t K = 0, k_sum = 0;
    for (size_t i = 0; i < c->n; i++)
        K += c->pub[0].mask[i];
    for (size_t l = 0; l < c->npc; l++)
        k_sum += sp->cfg.optimizer == ENG_OPT_SCAPE ? want_k(c, t, l) : eng_tensor_k(e0, l);
    if (c->pub[0].st.k != K)
        note_fail(c, "step %llu: stats say K=%zu, mask has %zu", (unsigned long long)t,
             c->pub[0].st.k, K);
    if (eng_tensor_k(e0, c->npc - 1) == 0 || eng_tensor_k(e0, c->npc) != 0)
        note_fail(c, "split_above %u: the engine's plan has not the %zu pieces restated here",
                  (unsigned)sp->cfg.split_above, c->npc);
    if (dense_at(sp, t) && K != c->n)
        note_fail(c, "step %llu: dense step with K=%zu of %zu", (unsigned long long)t, K, c->n);
    if (sp->cfg.optimizer == ENG_OPT_SCAPE && !dense_at(sp, t)) {
        double ov = c->pub[0].st.mask_overlap;
        if (!(ov >= 0.0 && ov <= 1.0))
            note_fail(c, "step %llu: mask overlap %g outside [0, 1]", (unsigned long long)t, ov);
        if (K != k_sum)
            note_fail(c, "step %llu: popcount %zu != sum k_l %zu (fill-in)", (unsigned long long)t,
                 K, k_sum);
        if (c->have_stat_prev)
            check_lagged_selection(c, t);
    }
    if (sp->cfg.optimizer == ENG_OPT_TOPK_ADAMW && !dense_at(sp, t) &&
        (K < k_sum || K > (size_t)sp->R * k_sum))
        note_fail(c, "step %llu: union mask K=%zu outside [%zu, %zu]", (unsigned long long)t, K,
             k_sum, (size_t)sp->R * k_sum);
    check_collectives(c, t, K, e0);
    check_clipping(c, t, e0);
    check_churn(c, t);
    for (size_t i = 0; i < c->n && !c->failed; i++) {
        int owner = eng_tensor_owner(e0, piece_of(c, i));
        int holder = holder_of(c, i, owner);
        check_residual(c, t, i, c->pub[0].mask[i], holder);
        check_update(c, t, i, c->pub[0].mask[i], holder);
        check_replicas(c, t, i, holder);
        if (sp->cfg.optimizer == ENG_OPT_SCAPE)
            c->stat_prev[i] = scape_stat(c, t, i, owner, holder);
    }
    c->have_stat_prev = 1;
}

/* Conservation: nothing is lost, only delayed in the residuals. */
static void check_conservation(ctx *c)
{
    for (size_t i = 0; i < c->n; i++) {
        double e_sum = 0.0;
        for (int r = 0; r < c->sp->R; r++)
            e_sum += c->pub[r].e_after[i];
        double lhs = e_sum + c->sum_sent[i], rhs = c->sum_g[i];
        if (fabs(lhs - rhs) > 2e-6 * c->sum_abs[i] * (c->sp->R + 1) + 1e-30)
            note_fail(c, "conservation coord %zu: sum e + T sum g_hat = %.12g, sum G = %.12g", i,
                 lhs, rhs);
    }
}

/* ---- the rank thread ------------------------------------------------------ */

static void publish(eng_t *e, published *p, int before, void *const *params, const ctx *c,
                    int tr)
{
    if (before) {
        eng_get_residual(e, p->e_before);
        eng_get_state(e, ENG_VEC_M, p->m_before, p->have);
        eng_get_state(e, ENG_VEC_THETA, p->th_before, p->have);
        if (uses_v(c->sp))
            eng_get_state(e, ENG_VEC_V, p->v_before, p->have);
        return;
    }
    eng_get_residual(e, p->e_after);
    eng_get_state(e, ENG_VEC_M, p->m_after, p->have);
    eng_get_state(e, ENG_VEC_THETA, p->th_after, p->have);
    if (uses_v(c->sp))
        eng_get_state(e, ENG_VEC_V, p->v_after, p->have);
    eng_get_mask(e, p->mask);
    eng_get_ghat(e, p->ghat, p->ghave);
    eng_last_stats(e, &p->st);
    for (int j = 0; j < tr; j++)
        for (size_t i = 0; i < c->n; i++)
            p->params[j][i] = c->sp->pdt == KERN_F32
                                  ? ((float *)params[j])[i]
                                  : kern_f32_from_bf16(((uint16_t *)params[j])[i]);
}

/* Initial parameters: trainer 0 of rank 0 has the real ones; every other
 * trainer starts with garbage that the broadcast must overwrite. */
static void fill_params(const ctx *c, int r, void **params)
{
    for (int j = 0; j < c->sp->tr[r]; j++)
        for (size_t i = 0; i < c->n; i++) {
            float v = r == 0 && j == 0 ? (float)(0.5 * unit(mix(i + 77))) : 1e6f * (float)(r + j);
            if (c->sp->pdt == KERN_F32)
                ((float *)params[j])[i] = v;
            else
                ((uint16_t *)params[j])[i] = kern_bf16_from_f32(v);
        }
}

static scape_rc train(rank_arg *a, eng_t *e, void **grads, void **params)
{
    ctx *c = a->ctx;
    int tr = c->sp->tr[a->rank];
    published *p = &c->pub[a->rank];
    for (int t = 1; t <= c->sp->steps; t++) {
        fill_grads(c, a->rank, (uint64_t)t, grads);
        if (c->sp->check)
            publish(e, p, 1, params, c, tr);
        float lrs[ENG_MAX_GROUPS];
        for (size_t g = 0; g < ENG_MAX_GROUPS; g++)
            lrs[g] = lr_at(c->sp, g, (uint64_t)t);
        scape_rc rc = c->sp->ngroups
                          ? eng_step_groups(e, (uint64_t)t, lrs, (const void *const *)grads,
                                            params)
                          : eng_step(e, (uint64_t)t, c->sp->lr, (const void *const *)grads,
                                     params);
        if (rc == SCAPE_OK && c->sp->finish)
            rc = eng_step_finish(e);
        if (rc != SCAPE_OK)
            return rc;
        if (!c->sp->check)
            continue;
        publish(e, p, 0, params, c, tr);
        pthread_barrier_wait(&c->bar);
        if (a->rank == 0) {
            c->k_hist[t - 1] = p->st.k;
            check_step(c, (uint64_t)t, e);
            if (t == c->sp->steps || t % 50 == 0)
                check_conservation(c);
        }
        pthread_barrier_wait(&c->bar);
        if (c->failed)
            break;
    }
    return SCAPE_OK;
}

static scape_rc rank_run(rank_arg *a)
{
    ctx *c = a->ctx;
    int tr = c->sp->tr[a->rank];
    size_t pb = c->n * kern_dtype_size(c->sp->pdt), gb = c->n * kern_dtype_size(c->sp->gdt);
    void *grads[MAX_TR], *params[MAX_TR];
    for (int j = 0; j < tr; j++) {
        grads[j] = malloc(gb);
        params[j] = malloc(pb);
    }
    fill_params(c, a->rank, params);
    eng_group groups[4];
    for (size_t g = 0; g < c->sp->ngroups; g++)
        groups[g].weight_decay = c->sp->gwd[g];
    eng_layout lay = { c->ts, NT, c->sp->pdt, c->sp->gdt, groups, c->sp->ngroups };
    eng_t *e = NULL;
    scape_rc rc = eng_create(&e, &c->sp->cfg, &lay, a->comm, tr);
    if (rc == SCAPE_OK && c->sp->check)
        rc = eng_set_inspect(e, 1);
    if (rc == SCAPE_OK)
        rc = eng_init_params(e, params);
    if (rc == SCAPE_OK)
        rc = train(a, e, grads, params);
    if (rc == SCAPE_OK && a->rank == 0)
        for (size_t i = 0; i < c->n; i++)
            c->final_params[i] = c->sp->pdt == KERN_F32
                                     ? ((float *)params[0])[i]
                                     : kern_f32_from_bf16(((uint16_t *)params[0])[i]);
    eng_destroy(&e);
    for (int j = 0; j < tr; j++) {
        free(grads[j]);
        free(params[j]);
    }
    return rc;
}

/* ---- running a spec --------------------------------------------------------- */

static float *fvec(size_t n) { return calloc(n, sizeof(float)); }

static void ctx_init(ctx *c, const spec *sp)
{
    memset(c, 0, sizeof *c);
    c->sp = sp;
    build_layout(c);
    for (int r = 0; r < sp->R; r++) {
        published *p = &c->pub[r];
        c->T += sp->tr[r];
        p->e_before = fvec(c->n); p->e_after = fvec(c->n);
        p->m_before = fvec(c->n); p->m_after = fvec(c->n);
        p->v_before = fvec(c->n); p->v_after = fvec(c->n);
        p->th_before = fvec(c->n); p->th_after = fvec(c->n);
        p->ghat = fvec(c->n);
        p->have = calloc(c->n, 1); p->mask = calloc(c->n, 1); p->ghave = calloc(c->n, 1);
        for (int j = 0; j < sp->tr[r]; j++)
            p->params[j] = fvec(c->n);
    }
    c->sum_g = calloc(c->n, sizeof(double));
    c->sum_sent = calloc(c->n, sizeof(double));
    c->sum_abs = calloc(c->n, sizeof(double));
    c->stat_prev = calloc(c->n, sizeof(double));
    c->mask_prev = calloc(c->n, 1);
    c->final_params = fvec(c->n);
    c->k_hist = calloc((size_t)sp->steps, sizeof(size_t));
    pthread_barrier_init(&c->bar, NULL, (unsigned)sp->R);
}

static void ctx_free(ctx *c)
{
    for (int r = 0; r < c->sp->R; r++) {
        published *p = &c->pub[r];
        void *bufs[] = { p->e_before, p->e_after, p->m_before, p->m_after, p->v_before,
                         p->v_after, p->th_before, p->th_after, p->ghat, p->have,
                         p->mask, p->ghave };
        for (size_t b = 0; b < sizeof bufs / sizeof bufs[0]; b++)
            free(bufs[b]);
        for (int j = 0; j < c->sp->tr[r]; j++)
            free(p->params[j]);
    }
    free(c->sum_g);
    free(c->sum_sent);
    free(c->sum_abs);
    free(c->stat_prev);
    free(c->mask_prev);
    free(c->final_params);
    free(c->k_hist);
    pthread_barrier_destroy(&c->bar);
}

/* Run sp; on success the caller owns *final (N floats) and *k_hist. */
/* max_grad_norm: steps of the runs so far that clipped, and that did not. */
static int s_clip_seen[2];
/* mask_deltas: mask bytes the runs so far moved, and the fixed codes' */
static uint64_t s_delta_bytes[2];

static void run_spec(const spec *sp, float **final, size_t **k_hist, size_t *n)
{
    ctx *c = malloc(sizeof *c);
    ctx_init(c, sp);
    rank_arg args[MAX_R];
    ck_assert_int_eq(run_ranks(sp->R, rank_run, c, args), 0);
    for (int r = 0; r < sp->R; r++)
        ck_assert_msg(args[r].rc == SCAPE_OK, "%s %s R=%d rho=%g rank %d: %s",
                      eng_optimizer_name(sp->cfg.optimizer), eng_mode_name(sp->cfg.mode),
                      sp->R, sp->cfg.rho, r, args[r].err);
    ck_assert_msg(!c->failed, "%s %s R=%d rho=%g W=%u split_above=%u: %s",
                  eng_optimizer_name(sp->cfg.optimizer), eng_mode_name(sp->cfg.mode), sp->R,
                  sp->cfg.rho, sp->cfg.warmup, (unsigned)sp->cfg.split_above, c->fail);
    s_clip_seen[0] += c->clipped;
    s_clip_seen[1] += c->unclipped;
    s_delta_bytes[0] += c->delta_bytes;
    s_delta_bytes[1] += c->full_bytes;
    *final = c->final_params;
    *k_hist = c->k_hist;
    *n = c->n;
    c->final_params = NULL;
    c->k_hist = NULL;
    ctx_free(c);
    free(c);
}

static const int s_R[] = { 1, 2, 3, 4, 8 };
/* Uneven trainers per rank. */
static const int s_tr[MAX_R] = { 2, 1, 3, 1, 2, 4, 1, 2 };

static spec make_spec(eng_optimizer opt, eng_mode mode, int R, double rho, int steps)
{
    spec sp = { .R = R, .pdt = KERN_F32, .gdt = KERN_F32, .steps = steps, .check = 1,
                .lr = 1e-3f };
    eng_config_default(&sp.cfg);
    sp.cfg.defer_select = 0; /* as these tests were written (the key: 1) */
    sp.cfg.optimizer = opt;
    sp.cfg.mode = mode;
    sp.cfg.rho = rho;
    sp.cfg.warmup = 3;
    sp.cfg.hyper.wd = 0.01f;
    sp.cfg.intake_chunk = 64; /* several chunks per tensor when trainers are summed */
    sp.cfg.wire_bf16 = 0;     /* fp32 values; bf16_values and its kin ask for bf16 */
    sp.cfg.split_above = s_split;
    memcpy(sp.tr, s_tr, sizeof sp.tr);
    return sp;
}

static void expect_same(const float *a, const float *b, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(memcmp(&a[i], &b[i], sizeof a[i]) == 0,
                      "%s: coordinate %zu differs (%.9g vs %.9g)", what, i, (double)a[i],
                      (double)b[i]);
}

/* Every invariant, both modes, R in {1,2,3,4,8}, at density _i. */
static void run_scape_density(double rho, int steps)
{
    for (size_t ri = 0; ri < sizeof s_R / sizeof s_R[0]; ri++) {
        float *fin[2];
        size_t *kh[2], n = 0;
        for (int mode = 0; mode < 2; mode++) {
            spec sp = make_spec(ENG_OPT_SCAPE, (eng_mode)mode, s_R[ri], rho, steps);
            run_spec(&sp, &fin[mode], &kh[mode], &n);
        }
        char what[96];
        snprintf(what, sizeof what, "replicated vs sharded, R=%d rho=%g", s_R[ri], rho);
        expect_same(fin[0], fin[1], n, what);
        for (int mode = 0; mode < 2; mode++) {
            free(fin[mode]);
            free(kh[mode]);
        }
    }
}

START_TEST(scape_rho_1)    { s_split = split_of(_i); run_scape_density(1.0, 60); }
END_TEST
START_TEST(scape_rho_0_5)  { s_split = split_of(_i); run_scape_density(0.5, 100); }
END_TEST
START_TEST(scape_rho_0_1)  { s_split = split_of(_i); run_scape_density(0.1, 300); }
END_TEST
START_TEST(scape_rho_0_01) { s_split = split_of(_i); run_scape_density(0.01, 300); }
END_TEST

/* Runs variant 0..nv-1 of a spec (vary sets variant k) and expects every
 * variant's final parameters to be variant 0's, bit for bit. */
static void expect_variants_agree(const spec *base, int nv, void (*vary)(spec *, int),
                                  const char *what)
{
    float *fin[4];
    size_t *kh[4], n = 0;
    ck_assert_int_le(nv, 4);
    for (int k = 0; k < nv; k++) {
        spec sp = *base;
        vary(&sp, k);
        run_spec(&sp, &fin[k], &kh[k], &n);
    }
    for (int k = 1; k < nv; k++) {
        char msg[160];
        snprintf(msg, sizeof msg, "%s: variant %d vs 0", what, k);
        expect_same(fin[0], fin[k], n, msg);
    }
    for (int k = 0; k < nv; k++) {
        free(fin[k]);
        free(kh[k]);
    }
}

static void vary_threads(spec *sp, int k)
{
    static const int threads[] = { 1, 3, 8 };
    sp->cfg.threads = threads[k];
}

/* Every optimizer, both modes, one and three ranks, f32 and bf16 buffers:
 * each case's nv variants (vary) must agree bitwise, every per-step check
 * on.  alternate_defer: the selection is deferred in every other case. */
static void variants_over_matrix(int nv, void (*vary)(spec *, int), const char *variants,
                                 int alternate_defer)
{
    static const struct {
        eng_optimizer opt;
        double rho;
    } opts[] = { { ENG_OPT_SCAPE, 0.1 }, { ENG_OPT_SCAPE, 0.01 }, { ENG_OPT_ADAMS, 1.0 },
                 { ENG_OPT_ADAMW, 1.0 }, { ENG_OPT_TOPK_ADAMW, 0.1 } };
    for (size_t o = 0; o < sizeof opts / sizeof opts[0]; o++)
        for (int mode = 0; mode < 2; mode++)
            for (int R = 1; R <= 3; R += 2)
                for (int bf16 = 0; bf16 < 2; bf16++) {
                    spec sp = make_spec(opts[o].opt, (eng_mode)mode, R, opts[o].rho, 40);
                    if (bf16)
                        sp.pdt = sp.gdt = KERN_BF16;
                    if (alternate_defer)
                        sp.cfg.defer_select = (int)(o + (size_t)mode + (size_t)bf16) % 2;
                    char what[160];
                    snprintf(what, sizeof what, "%s %s R=%d%s%s, %s",
                             eng_optimizer_name(opts[o].opt), eng_mode_name((eng_mode)mode), R,
                             bf16 ? " bf16" : "", sp.cfg.defer_select ? " deferred" : "",
                             variants);
                    expect_variants_agree(&sp, nv, vary, what);
                }
}

/* The data-parallel phases on several worker threads compute the same bits
 * as on one (variants: 1, 3 and 8 threads). */
START_TEST(threads_do_not_change_results)
{
    s_split = split_of(_i);
    variants_over_matrix(3, vary_threads, "threads 1/3/8", 0);
}
END_TEST

/* variant 0: the host executor; 1: the device executor on the simulated
 * device, residual streamed in chunks of 64 coordinates (about twenty per
 * step); 2: the same, residual in device memory */
static void vary_executor(spec *sp, int k)
{
    sp->cfg.executor = k ? ENG_EXEC_SIM : ENG_EXEC_HOST;
    sp->cfg.residual_chunk = 64;
    sp->cfg.residual_on_device = k == 2;
}

/* The device executor's orchestration and kernels (the CPU versions of the
 * CUDA kernels, their streams replayed in a random order that keeps only
 * the declared dependencies) give the host executor's bits, the selection
 * deferred or not. */
START_TEST(sim_executor_is_the_host_executor)
{
    s_split = split_of(_i);
    variants_over_matrix(3, vary_executor, "host / sim / sim resident", 1);
}
END_TEST

/* Gradient clipping by the global norm of g_hat: every per-step check on,
 * the norm and factor against float64 (check_clipping), the update against
 * the reference with the factor, the owners' sums of squares all-gathered
 * once per sharded step; replicated and sharded agree bitwise, and so do
 * the host and the sim executors.  The bound sits inside the range of the
 * runs' norms (every third step's gradients are 8 times larger), so that
 * some steps clip and some do not. */
START_TEST(clipping_by_global_norm)
{
    s_split = split_of(_i);
    static const struct {
        eng_optimizer opt;
        double rho;
        float max;
        eng_clip_norm by;
    } opts[] = { { ENG_OPT_SCAPE, 0.1, 8.0f, ENG_CLIP_SENT },
                 { ENG_OPT_SCAPE, 1.0, 8.0f, ENG_CLIP_SENT },
                 { ENG_OPT_ADAMW, 1.0, 8.0f, ENG_CLIP_SENT },
                 { ENG_OPT_TOPK_ADAMW, 0.1, 8.0f, ENG_CLIP_SENT },
                 { ENG_OPT_SCAPE, 0.1, 4.0f, ENG_CLIP_GRAD },
                 { ENG_OPT_TOPK_ADAMW, 0.1, 4.0f, ENG_CLIP_GRAD } };
    for (size_t o = 0; o < sizeof opts / sizeof opts[0]; o++)
        for (int R = 1; R <= 3; R += 2) {
            memset(s_clip_seen, 0, sizeof s_clip_seen);
            float *fin[2];
            size_t *kh[2], n = 0;
            for (int mode = 0; mode < 2; mode++) {
                spec sp = make_spec(opts[o].opt, (eng_mode)mode, R, opts[o].rho, 40);
                sp.cfg.max_grad_norm = opts[o].max;
                sp.cfg.clip_norm = opts[o].by;
                sp.loud = 1;
                run_spec(&sp, &fin[mode], &kh[mode], &n);
            }
            char what[128];
            snprintf(what, sizeof what, "%s rho=%g R=%d clipped at %g by the %s norm: "
                     "replicated vs sharded", eng_optimizer_name(opts[o].opt), opts[o].rho, R,
                     (double)opts[o].max, eng_clip_norm_name(opts[o].by));
            expect_same(fin[0], fin[1], n, what);
            ck_assert_msg(s_clip_seen[0] > 0 && s_clip_seen[1] > 0,
                          "%s: %d steps clipped, %d did not: move the bound", what,
                          s_clip_seen[0], s_clip_seen[1]);
            for (int mode = 0; mode < 2; mode++) {
                free(fin[mode]);
                free(kh[mode]);
            }
            spec sp = make_spec(opts[o].opt, (eng_mode)(R > 1), R, opts[o].rho, 40);
            sp.cfg.max_grad_norm = opts[o].max;
            sp.cfg.clip_norm = opts[o].by;
            sp.loud = 1;
            snprintf(what, sizeof what, "%s rho=%g R=%d clipped: host / sim / sim resident",
                     eng_optimizer_name(opts[o].opt), opts[o].rho, R);
            expect_variants_agree(&sp, 3, vary_executor, what);
        }
}
END_TEST

/* Parameter groups: three groups (weight decay 0, 0.05, and NaN: the
 * configured 0.01), each with its own learning rate that changes every
 * step; every per-step check on, the update of each tensor against the
 * float64 reference with its group's lr and weight decay; replicated and
 * sharded agree bitwise, and the host and the sim executors. */
START_TEST(parameter_groups)
{
    s_split = split_of(_i);
    static const struct {
        eng_optimizer opt;
        double rho;
    } opts[] = { { ENG_OPT_SCAPE, 0.1 }, { ENG_OPT_SCAPE, 1.0 }, { ENG_OPT_ADAMW, 1.0 },
                 { ENG_OPT_TOPK_ADAMW, 0.1 } };
    for (size_t o = 0; o < sizeof opts / sizeof opts[0]; o++)
        for (int R = 1; R <= 3; R += 2) {
            float *fin[2];
            size_t *kh[2], n = 0;
            spec sp;
            for (int mode = 0; mode < 2; mode++) {
                sp = make_spec(opts[o].opt, (eng_mode)mode, R, opts[o].rho, 40);
                sp.ngroups = 3;
                sp.gwd[0] = 0.0f, sp.gwd[1] = 0.05f, sp.gwd[2] = NAN;
                run_spec(&sp, &fin[mode], &kh[mode], &n);
            }
            char what[128];
            snprintf(what, sizeof what, "%s rho=%g R=%d, 3 groups: replicated vs sharded",
                     eng_optimizer_name(opts[o].opt), opts[o].rho, R);
            expect_same(fin[0], fin[1], n, what);
            for (int mode = 0; mode < 2; mode++) {
                free(fin[mode]);
                free(kh[mode]);
            }
            snprintf(what, sizeof what, "%s rho=%g R=%d, 3 groups: host / sim / sim resident",
                     eng_optimizer_name(opts[o].opt), opts[o].rho, R);
            expect_variants_agree(&sp, 3, vary_executor, what);
        }
}
END_TEST

/* wire_values: bf16.  Every per-step check on, the residual checked bit for
 * bit against a - bf16(a) of the engine's own fp32 a (so s + e == a exactly:
 * conservation holds term by term), g_hat against the sum of the bf16
 * values sent, one reduction of 2 bytes a value; replicated equals sharded
 * at R 1, 2, 3, 4, 8; the host and sim executors agree. */
START_TEST(bf16_values)
{
    s_split = split_of(_i);
    static const struct {
        eng_optimizer opt;
        double rho;
    } opts[] = { { ENG_OPT_SCAPE, 0.1 }, { ENG_OPT_SCAPE, 0.01 }, { ENG_OPT_TOPK_ADAMW, 0.1 } };
    for (size_t o = 0; o < sizeof opts / sizeof opts[0]; o++)
        for (size_t ri = 0; ri < sizeof s_R / sizeof s_R[0]; ri++) {
            float *fin[2];
            size_t *kh[2], n = 0;
            for (int mode = 0; mode < 2; mode++) {
                spec sp = make_spec(opts[o].opt, (eng_mode)mode, s_R[ri], opts[o].rho, 40);
                sp.cfg.wire_bf16 = 1;
                run_spec(&sp, &fin[mode], &kh[mode], &n);
            }
            char what[128];
            snprintf(what, sizeof what, "%s rho=%g R=%d, bf16 values: replicated vs sharded",
                     eng_optimizer_name(opts[o].opt), opts[o].rho, s_R[ri]);
            expect_same(fin[0], fin[1], n, what);
            for (int mode = 0; mode < 2; mode++) {
                free(fin[mode]);
                free(kh[mode]);
            }
        }
    spec sp = make_spec(ENG_OPT_SCAPE, ENG_MODE_SHARDED, 3, 0.1, 40);
    sp.cfg.wire_bf16 = 1;
    sp.pdt = sp.gdt = KERN_BF16;
    expect_variants_agree(&sp, 3, vary_executor, "scape rho 0.1 R=3 bf16 values: host / sim");
}
END_TEST

static void vary_gather(spec *sp, int k) { sp->cfg.gather = (eng_gather)k; }

/* bf16 trainers, sharded: the owners gather the new parameters in bf16
 * (half the bytes, checked per step) and every trainer ends with the bits
 * of the fp32 gather; on both executors. */
START_TEST(gather_in_param_dtype)
{
    s_split = split_of(_i);
    static const struct {
        eng_optimizer opt;
        double rho;
    } opts[] = { { ENG_OPT_SCAPE, 0.1 }, { ENG_OPT_ADAMS, 1.0 }, { ENG_OPT_ADAMW, 1.0 },
                 { ENG_OPT_TOPK_ADAMW, 0.1 } };
    for (size_t o = 0; o < sizeof opts / sizeof opts[0]; o++)
        for (int x = 0; x < 2; x++) {
            spec sp = make_spec(opts[o].opt, ENG_MODE_SHARDED, 3, opts[o].rho, 30);
            sp.pdt = sp.gdt = KERN_BF16;
            sp.cfg.executor = x ? ENG_EXEC_SIM : ENG_EXEC_HOST;
            sp.cfg.residual_chunk = 64;
            char what[128];
            snprintf(what, sizeof what, "%s %s, gather in bf16 vs f32 vs delta (bf16 trainers: "
                     "as params)", eng_optimizer_name(opts[o].opt), x ? "sim" : "host");
            expect_variants_agree(&sp, 3, vary_gather, what);
        }
}
END_TEST

/* gather_values: delta, fp32 trainers.  Masked steps publish each change in
 * bf16 and the update is rounded to the old value plus it (the per-step
 * checks: theta within that rounding of the rule, gathers of 2 bytes a
 * value, every trainer bitwise the master); replicated equals sharded at
 * R 1, 3, 4; host equals sim; dense optimizers are unaffected; and the
 * rounding does change the result (the path ran). */
START_TEST(gather_delta)
{
    s_split = split_of(_i);
    static const struct {
        eng_optimizer opt;
        double rho;
    } opts[] = { { ENG_OPT_SCAPE, 0.1 }, { ENG_OPT_TOPK_ADAMW, 0.1 } };
    static const int rs[] = { 1, 3, 4 };
    for (size_t o = 0; o < sizeof opts / sizeof opts[0]; o++)
        for (size_t ri = 0; ri < sizeof rs / sizeof rs[0]; ri++) {
            float *fin[3];
            size_t *kh[3], n = 0;
            for (int v = 0; v < 3; v++) { /* replicated, sharded, sharded without delta */
                spec sp = make_spec(opts[o].opt, v ? ENG_MODE_SHARDED : ENG_MODE_REPLICATED,
                                    rs[ri], opts[o].rho, 40);
                sp.cfg.gather = v < 2 ? ENG_GATHER_DELTA : ENG_GATHER_PARAMS;
                sp.cfg.wire_bf16 = 1;
                run_spec(&sp, &fin[v], &kh[v], &n);
            }
            char what[128];
            snprintf(what, sizeof what, "%s R=%d, delta: replicated vs sharded",
                     eng_optimizer_name(opts[o].opt), rs[ri]);
            expect_same(fin[0], fin[1], n, what);
            ck_assert_msg(memcmp(fin[1], fin[2], n * sizeof *fin[1]) != 0,
                          "%s R=%d: delta left every parameter as without it",
                          eng_optimizer_name(opts[o].opt), rs[ri]);
            for (int v = 0; v < 3; v++) {
                free(fin[v]);
                free(kh[v]);
            }
        }
    spec sp = make_spec(ENG_OPT_SCAPE, ENG_MODE_SHARDED, 3, 0.1, 40);
    sp.cfg.gather = ENG_GATHER_DELTA;
    sp.cfg.mask_deltas = 1;
    sp.cfg.dense_below = 40;
    expect_variants_agree(&sp, 3, vary_executor, "scape delta R=3: host / sim");
    spec ad = make_spec(ENG_OPT_ADAMS, ENG_MODE_SHARDED, 3, 1.0, 20);
    expect_variants_agree(&ad, 3, vary_gather, "adams: params / f32 / delta");
}
END_TEST

/* The density schedule: k_l of every step's mask against the schedule
 * restated here (rho_at, want_k), exactly k_l bits per tensor and no
 * fill-in at every step (the per-step checks), code sizes that follow k_l;
 * replicated equals sharded, the host and sim executors agree. */
START_TEST(density_schedule)
{
    s_split = split_of(_i);
    for (size_t ri = 0; ri < sizeof s_R / sizeof s_R[0]; ri++) {
        float *fin[2];
        size_t *kh[2], n = 0;
        spec sp;
        for (int mode = 0; mode < 2; mode++) {
            sp = make_spec(ENG_OPT_SCAPE, (eng_mode)mode, s_R[ri], 0.02, 90);
            sp.cfg.rho_start = 0.5;
            sp.cfg.rho_steps = 60;
            run_spec(&sp, &fin[mode], &kh[mode], &n);
            /* K follows the schedule: denser first, then rho's K */
            ck_assert_uint_gt(kh[mode][sp.cfg.warmup], kh[mode][sp.cfg.warmup + 40]);
            ck_assert_uint_eq(kh[mode][sp.cfg.warmup + 61], kh[mode][sp.steps - 1]);
        }
        char what[128];
        snprintf(what, sizeof what, "schedule 0.5 -> 0.02 R=%d: replicated vs sharded", s_R[ri]);
        expect_same(fin[0], fin[1], n, what);
        for (int mode = 0; mode < 2; mode++) {
            free(fin[mode]);
            free(kh[mode]);
        }
        if (s_R[ri] == 3) {
            sp.cfg.wire_bf16 = 1;
            expect_variants_agree(&sp, 3, vary_executor, "schedule R=3 bf16 values: host / sim");
        }
    }
    /* the schedule's values: 0.5 halved 5 times gets below 0.02, so five
     * stages of 12 steps (0.5 .. 0.03125), then 0.02 from masked step 61 */
    spec sp = make_spec(ENG_OPT_SCAPE, ENG_MODE_SHARDED, 1, 0.02, 10);
    sp.cfg.rho_start = 0.5;
    sp.cfg.rho_steps = 60;
    ck_assert_double_eq(rho_at(&sp, 3), 0.02);
    ck_assert_double_eq(rho_at(&sp, 4), 0.5);
    ck_assert_double_eq(rho_at(&sp, 15), 0.5);
    ck_assert_double_eq(rho_at(&sp, 16), 0.25);
    ck_assert_double_eq(rho_at(&sp, 63), 0.03125);
    ck_assert_double_eq(rho_at(&sp, 64), 0.02);
}
END_TEST

/* dense_below: the tensors of at most 64 coordinates (six of the ten, 137
 * of 1,184 coordinates) go whole on every masked step, the others at rho.
 * Every step's mask against want_k (exactly k_l bits, len for the small
 * ones, no fill-in), conservation and the lag (the per-step checks);
 * replicated equals sharded for every R; the host and sim executors agree,
 * with bf16 values, mask deltas and a density schedule too; topk-adamw's
 * own masks take the small tensors whole as well. */
static void vary_deltas(spec *sp, int k);

START_TEST(small_tensors_whole)
{
    s_split = split_of(_i);
    static const int rs[] = { 1, 3, 4 };
    for (size_t ri = 0; ri < sizeof rs / sizeof rs[0]; ri++) {
        float *fin[2];
        size_t *kh[2], n = 0;
        for (int mode = 0; mode < 2; mode++) {
            spec sp = make_spec(ENG_OPT_SCAPE, (eng_mode)mode, rs[ri], 0.02, 60);
            sp.cfg.dense_below = 64;
            run_spec(&sp, &fin[mode], &kh[mode], &n);
            /* K: the whole small tensors plus the large ones' k_l at 0.02
             * (100 -> 2, 257 -> 6, 500 -> 10, 190 -> 4); split at 48, one
             * per piece (100: 3 pieces, 257: 6, 500: 11, 190: 4; w64 whole) */
            ck_assert_uint_eq(kh[mode][sp.steps - 1],
                              _i ? 137 + 3 + 6 + 11 + 4 : 137 + 2 + 6 + 10 + 4);
        }
        char what[96];
        snprintf(what, sizeof what, "dense_below 64, R=%d: replicated vs sharded", rs[ri]);
        expect_same(fin[0], fin[1], n, what);
        for (int mode = 0; mode < 2; mode++) {
            free(fin[mode]);
            free(kh[mode]);
        }
    }
    spec sp = make_spec(ENG_OPT_SCAPE, ENG_MODE_SHARDED, 3, 0.02, 60);
    sp.cfg.dense_below = 64;
    sp.cfg.wire_bf16 = 1;
    expect_variants_agree(&sp, 3, vary_executor, "dense_below 64, bf16 values: host / sim");
    sp.cfg.rho_start = 0.25;
    sp.cfg.rho_steps = 30;
    expect_variants_agree(&sp, 3, vary_deltas, "dense_below 64, schedule: fixed / deltas");
    spec tk = make_spec(ENG_OPT_TOPK_ADAMW, ENG_MODE_SHARDED, 3, 0.02, 40);
    tk.cfg.dense_below = 64;
    float *fin;
    size_t *kh, n = 0;
    run_spec(&tk, &fin, &kh, &n);
    free(fin);
    free(kh);
}
END_TEST

/* variant 0: fixed codes; 1: deltas where smaller; 2: deltas whenever
 * there is a last mask, the selection deferred */
static void vary_deltas(spec *sp, int k)
{
    sp->cfg.mask_deltas = k;
    sp->cfg.defer_select = k == 2;
}

/* mask_deltas: masks sent as their change from the last one decode to the
 * masks of the fixed code, every step of runs up to 300 steps with real churn
 * (each step's mask is checked as the lagged top-k, and the whole runs
 * agree bitwise with the fixed code's), selection inside the step and
 * deferred; the deltas move fewer bytes; the host and sim executors. */
START_TEST(mask_deltas_decode_to_the_same_masks)
{
    s_split = split_of(_i);
    static const double rhos[] = { 0.1, 0.01 };
    for (size_t o = 0; o < 2; o++)
        for (int mode = 0; mode < 2; mode++)
            for (int x = 0; x < 2; x++) {
                /* hundreds of steps where masks are smallest, fewer elsewhere */
                int steps = x ? 40 : o == 1 && mode == ENG_MODE_SHARDED ? 300 : 80;
                spec sp = make_spec(ENG_OPT_SCAPE, (eng_mode)mode, 3, rhos[o], steps);
                sp.cfg.executor = x ? ENG_EXEC_SIM : ENG_EXEC_HOST;
                sp.cfg.residual_chunk = 64;
                char what[128];
                snprintf(what, sizeof what, "rho %g %s %s: fixed codes / deltas / deferred",
                         rhos[o], eng_mode_name((eng_mode)mode), x ? "sim" : "host");
                memset(s_delta_bytes, 0, sizeof s_delta_bytes);
                expect_variants_agree(&sp, 3, vary_deltas, what);
                ck_assert_msg(s_delta_bytes[0] > 0 && s_delta_bytes[1] > 0,
                              "%s: no mask all-gather with deltas", what);
            }
    /* with the density schedule (k_l change between masks) and bf16 values */
    spec sp = make_spec(ENG_OPT_SCAPE, ENG_MODE_SHARDED, 4, 0.02, 90);
    sp.cfg.rho_start = 0.5;
    sp.cfg.rho_steps = 60;
    sp.cfg.wire_bf16 = 1;
    expect_variants_agree(&sp, 3, vary_deltas, "schedule, bf16 values: fixed / deltas");
}
END_TEST

/* Kernels the sim executor launches for one sparse SCAPE step with a layout
 * of nt tensors of len coordinates each (one rank, one trainer). */
static uint64_t launches_per_step(size_t nt, size_t len)
{
    eng_tensor *ts = calloc(nt, sizeof *ts);
    for (size_t i = 0; i < nt; i++)
        ts[i] = (eng_tensor){ NULL, i * len, len, 0 };
    size_t n = nt * len;
    float *g = calloc(n, sizeof *g), *p = calloc(n, sizeof *p);
    comm_t *c[1];
    ck_assert_int_eq(comm_local_create(1, c), SCAPE_OK);
    eng_config cfg;
    eng_config_default(&cfg);
    cfg.defer_select = 0; /* as these tests were written (the key: 1) */
    cfg.executor = ENG_EXEC_SIM;
    cfg.residual_chunk = (uint32_t)n; /* one chunk: count the kernels, not the chunks */
    eng_layout lay = { ts, nt, KERN_F32, KERN_F32, NULL, 0 };
    eng_t *e = NULL;
    ck_assert_int_eq(eng_create(&e, &cfg, &lay, c[0], 1), SCAPE_OK);
    ck_assert_int_eq(eng_init_params(e, (void *const *)&p), SCAPE_OK);
    eng_step_stats st;
    for (uint64_t t = 1; t <= 4; t++) {
        for (size_t i = 0; i < n; i++)
            g[i] = (float)((i * 7 + t * 13) % 101) - 50.0f;
        ck_assert_int_eq(eng_step(e, t, 1e-3f, (const void *const *)&g, (void *const *)&p),
                         SCAPE_OK);
        ck_assert_int_eq(eng_step_finish(e), SCAPE_OK);
    }
    ck_assert_int_eq(eng_last_stats(e, &st), SCAPE_OK);
    ck_assert_uint_gt(st.k, 0);
    eng_destroy(&e);
    comm_destroy(&c[0]);
    free(ts);
    free(g);
    free(p);
    return st.launches;
}

/* The device executor's launches per step do not grow with the number of
 * tensors: a thousand tensors cost what ten do, a few dozen kernels. */
START_TEST(launches_do_not_grow_with_tensors)
{
    uint64_t ten = launches_per_step(10, 1000), thousand = launches_per_step(1000, 10);
    ck_assert_uint_eq(ten, thousand);
    ck_assert_uint_le(thousand, 40);
    ck_assert_uint_gt(thousand, 0);
}
END_TEST

/* variant 0: selection inside the step; 1: deferred, eng_step_finish called
 * after each step; 2: deferred, left to the next eng_step */
static void vary_defer(spec *sp, int k)
{
    sp->cfg.defer_select = k > 0;
    sp->finish = k == 1;
}

/* A selection deferred to eng_step_finish gives the same bits as the one
 * inside the step, with every per-step check on: SCAPE at two densities,
 * both modes, one and three ranks, f32 and bf16 buffers. */
START_TEST(deferred_selection_changes_nothing)
{
    s_split = split_of(_i);
    static const double rhos[] = { 0.1, 0.01 };
    for (size_t o = 0; o < 2; o++)
        for (int mode = 0; mode < 2; mode++)
            for (int R = 1; R <= 3; R += 2)
                for (int bf16 = 0; bf16 < 2; bf16++) {
                    spec sp = make_spec(ENG_OPT_SCAPE, (eng_mode)mode, R, rhos[o], 40);
                    if (bf16)
                        sp.pdt = sp.gdt = KERN_BF16;
                    char what[128];
                    snprintf(what, sizeof what, "rho %g %s R=%d%s, deferred selection",
                             rhos[o], eng_mode_name((eng_mode)mode), R, bf16 ? " bf16" : "");
                    expect_variants_agree(&sp, 3, vary_defer, what);
                }
}
END_TEST

START_TEST(ties_keep_exact_k)
{
    s_split = split_of(_i);
    /* Gradients in {-1, 0, 1}: statistics tie massively; masks must still
     * hold exactly k_l bits per tensor (checked every step). */
    for (size_t ri = 0; ri < sizeof s_R / sizeof s_R[0]; ri++) {
        spec sp = make_spec(ENG_OPT_SCAPE, ENG_MODE_SHARDED, s_R[ri], 0.1, 40);
        sp.ties = 1;
        float *fin;
        size_t *kh, n;
        run_spec(&sp, &fin, &kh, &n);
        free(fin);
        free(kh);
    }
}
END_TEST

START_TEST(bf16_buffers)
{
    s_split = split_of(_i);
    float *fin[2];
    size_t *kh[2], n;
    for (int mode = 0; mode < 2; mode++) {
        spec sp = make_spec(ENG_OPT_SCAPE, (eng_mode)mode, 3, 0.1, 80);
        sp.pdt = KERN_BF16;
        sp.gdt = KERN_BF16;
        run_spec(&sp, &fin[mode], &kh[mode], &n);
    }
    expect_same(fin[0], fin[1], n, "bf16 replicated vs sharded");
    for (int mode = 0; mode < 2; mode++) {
        free(fin[mode]);
        free(kh[mode]);
    }
}
END_TEST

/* A dense float64 run of AdamS (or AdamW) on the mean gradient, from the
 * start, without teacher forcing. */
static void dense_reference(const spec *sp, int adamw, double *theta)
{
    ctx c;
    memset(&c, 0, sizeof c);
    c.sp = sp;
    build_layout(&c);
    int T = 0;
    for (int r = 0; r < sp->R; r++)
        T += sp->tr[r];
    double *m = calloc(c.n, sizeof *m), *v = calloc(c.n, sizeof *v);
    const kern_hyper *h = &sp->cfg.hyper;
    for (size_t i = 0; i < c.n; i++)
        theta[i] = (float)(0.5 * unit(mix(i + 77)));
    for (int t = 1; t <= sp->steps; t++)
        for (size_t i = 0; i < c.n; i++) {
            double g = 0.0, ga;
            for (int r = 0; r < sp->R; r++)
                g += grad_sum(&c, r, (uint64_t)t, i, &ga);
            g /= T;
            if (adamw) {
                m[i] = h->beta1 * m[i] + (1 - h->beta1) * g;
                v[i] = h->beta2 * v[i] + (1 - h->beta2) * g * g;
                double mh = m[i] / (1 - pow(h->beta1, t)), vh = v[i] / (1 - pow(h->beta2, t));
                theta[i] -= sp->lr * (mh / (sqrt(vh) + h->eps) + h->wd * theta[i]);
            } else {
                double b = h->beta1 * m[i] + (1 - h->beta1) * g;
                double vv = h->beta2 * m[i] * m[i] + (1 - h->beta2) * g * g;
                m[i] = b;
                theta[i] -= sp->lr * (b / (sqrt(vv) + h->eps) + h->wd * theta[i]);
            }
        }
    free(m);
    free(v);
}

static void expect_near_dense(const spec *sp, int adamw, const float *got, size_t n)
{
    double *ref = calloc(n, sizeof *ref);
    dense_reference(sp, adamw, ref);
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(fabs(got[i] - ref[i]) <= 1e-6 * fabs(ref[i]) + 1e-4 * sp->lr * sp->steps,
                      "%s R=%d coord %zu: %.9g vs float64 dense %.9g",
                      eng_optimizer_name(sp->cfg.optimizer), sp->R, i, (double)got[i], ref[i]);
    free(ref);
}

START_TEST(dense_equivalence)
{
    s_split = split_of(_i);
    /* rho = 1 SCAPE equals dense AdamS bitwise in the engine and the float64
     * dense AdamS to fp32 rounding, for any R and split of trainers. */
    for (size_t ri = 0; ri < sizeof s_R / sizeof s_R[0]; ri++) {
        float *fs, *fa;
        size_t *k1, *k2, n;
        spec s1 = make_spec(ENG_OPT_SCAPE, ENG_MODE_SHARDED, s_R[ri], 1.0, 60);
        spec s2 = make_spec(ENG_OPT_ADAMS, ENG_MODE_REPLICATED, s_R[ri], 1.0, 60);
        s1.check = 0;
        run_spec(&s1, &fs, &k1, &n);
        run_spec(&s2, &fa, &k2, &n);
        expect_same(fs, fa, n, "scape rho=1 vs adams");
        expect_near_dense(&s2, 0, fa, n);
        free(fs);
        free(fa);
        free(k1);
        free(k2);
    }
}
END_TEST

START_TEST(adamw_dense)
{
    s_split = split_of(_i);
    for (size_t ri = 0; ri < sizeof s_R / sizeof s_R[0]; ri++) {
        float *f[2];
        size_t *kh[2], n;
        for (int mode = 0; mode < 2; mode++) {
            spec sp = make_spec(ENG_OPT_ADAMW, (eng_mode)mode, s_R[ri], 1.0, 60);
            run_spec(&sp, &f[mode], &kh[mode], &n);
            if (mode == 0)
                expect_near_dense(&sp, 1, f[0], n);
        }
        expect_same(f[0], f[1], n, "adamw replicated vs sharded");
        for (int mode = 0; mode < 2; mode++) {
            free(f[mode]);
            free(kh[mode]);
        }
    }
}
END_TEST

/* The optimizer table: each row is its own optimizer's, its name parses back
 * to it, and its checkpoints hold v exactly when it keeps one.  The mask
 * sources and intakes are those docs/algorithm.md gives each optimizer. */
START_TEST(optimizer_rows)
{
    static const struct {
        eng_optimizer id;
        int keeps_v, intake;
        eng_mask_src mask;
    } want[] = {
        { ENG_OPT_SCAPE, 0, 0, ENG_MASK_LAGGED_M },
        { ENG_OPT_ADAMS, 0, 0, ENG_MASK_NONE },
        { ENG_OPT_ADAMW, 1, 0, ENG_MASK_NONE },
        { ENG_OPT_TOPK_ADAMW, 1, 1, ENG_MASK_TOPK_GRAD },
    };
    ck_assert_int_eq(sizeof want / sizeof want[0], ENG_OPT_COUNT);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const eng_opt *r = eng_opt_get(want[i].id);
        ck_assert_ptr_nonnull(r);
        ck_assert_int_eq(r->id, want[i].id);
        ck_assert_int_eq(r->keeps_v, want[i].keeps_v);
        ck_assert_int_eq(r->intake, want[i].intake);
        ck_assert_int_eq(r->mask, want[i].mask);
        ck_assert_int_eq(r->update == SCAPE_UPD_ADAMW, r->keeps_v);
        eng_optimizer back = ENG_OPT_COUNT;
        ck_assert_int_eq(eng_optimizer_parse(r->name, &back), SCAPE_OK);
        ck_assert_int_eq(back, want[i].id);
        ck_assert_str_eq(eng_optimizer_name(want[i].id), r->name);
        eng_ckpt_sec secs[ENG_CKPT_MAX_SECS];
        int k = eng_ckpt_layout(want[i].id, ENG_CKF_MASK_CUR, 10, 20, 1, secs);
        ck_assert_int_eq(k, 4 + r->keeps_v); /* m, (v), theta, residual, mask_cur */
        ck_assert_int_eq(secs[1].id, r->keeps_v ? ENG_SEC_V : ENG_SEC_THETA);
    }
    ck_assert_ptr_null(eng_opt_get(ENG_OPT_COUNT));
}
END_TEST

START_TEST(topk_adamw_fills_in)
{
    s_split = split_of(_i);
    /* Per-rank raw-gradient masks and their union: K grows with R. */
    size_t k_at[MAX_R + 1] = { 0 };
    for (size_t ri = 0; ri < sizeof s_R / sizeof s_R[0]; ri++) {
        float *f[2];
        size_t *kh[2], n;
        for (int mode = 0; mode < 2; mode++) {
            spec sp = make_spec(ENG_OPT_TOPK_ADAMW, (eng_mode)mode, s_R[ri], 0.01, 100);
            run_spec(&sp, &f[mode], &kh[mode], &n);
        }
        expect_same(f[0], f[1], n, "topk-adamw replicated vs sharded");
        k_at[s_R[ri]] = kh[0][99];
        for (int mode = 0; mode < 2; mode++) {
            free(f[mode]);
            free(kh[mode]);
        }
    }
    ck_assert_msg(k_at[8] > k_at[2] && k_at[2] > k_at[1],
                  "no fill-in: K = %zu (R=1), %zu (R=2), %zu (R=8)", k_at[1], k_at[2], k_at[8]);
}
END_TEST

/* ---- bad arguments ------------------------------------------------------- */

typedef struct bad_ctx {
    int variant;
} bad_ctx;

/* Rank 1 registers a layout with different tensor boundaries (variant 0),
 * another rho (1), "b" in another parameter group (2), group 1 with
 * another weight decay (3), or, all trainers bf16, gather_values f32
 * against params (4: the one gathers 4 bytes a value, the other 2). */
static scape_rc rank_mismatch(rank_arg *a)
{
    eng_tensor t0[] = { { "a", 0, 10, 0 }, { "b", 10, 10, 1 } };
    eng_tensor t1[] = { { "a", 0, 12, 0 }, { "b", 12, 8, 1 } };
    eng_tensor t2[] = { { "a", 0, 10, 0 }, { "b", 10, 10, 0 } };
    eng_group g0[] = { { 0.1f }, { 0.0f } }, g3[] = { { 0.1f }, { 0.01f } };
    int v = ((bad_ctx *)a->ctx)->variant, odd = a->rank == 1;
    kern_dtype dt = v == 4 ? KERN_BF16 : KERN_F32;
    eng_layout lay = { odd && v == 0 ? t1 : odd && v == 2 ? t2 : t0, 2, dt, dt,
                       odd && v == 3 ? g3 : g0, 2 };
    eng_config cfg;
    eng_config_default(&cfg);
    cfg.defer_select = 0; /* as these tests were written (the key: 1) */
    if (v == 1 && odd)
        cfg.rho = 0.5;
    if (v == 4) {
        cfg.mode = ENG_MODE_SHARDED;
        cfg.gather = odd ? ENG_GATHER_F32 : ENG_GATHER_PARAMS;
    }
    eng_t *e = NULL;
    scape_rc rc = eng_create(&e, &cfg, &lay, a->comm, 1);
    eng_destroy(&e);
    return rc;
}

START_TEST(ranks_disagree)
{
    static const char *const says[] = { "layout", "config", "layout", "layout",
                                        "gather_values" };
    for (int variant = 0; variant < 5; variant++) {
        bad_ctx bc = { variant };
        rank_arg args[3];
        ck_assert_int_eq(run_ranks(3, rank_mismatch, &bc, args), 0);
        for (int r = 0; r < 3; r++) {
            ck_assert_int_eq(args[r].rc, SCAPE_INVALID);
            ck_assert_msg(strstr(args[r].err, says[variant]) != NULL, "%s", args[r].err);
            if (variant == 2 || variant == 3)
                ck_assert_msg(strstr(args[r].err, "parameter groups") != NULL, "%s",
                              args[r].err);
        }
    }
}
END_TEST

/* The mask metrics: rank 1 dawdles `lag_ms` before each step, so rank 0
 * reaches the next step's mask wait long before rank 1 posts its bits:
 * rank 0 waits about lag_ms there and its all-gather was mostly waited for
 * (overlap low); rank 1 finds the bits there (overlap near 1). */
typedef struct lag_ctx {
    int lag_ms;
    double wait_s[2], overlap[2];
} lag_ctx;

static scape_rc rank_lagging(rank_arg *a)
{
    lag_ctx *lc = a->ctx;
    enum { N = 4000, STEPS = 8 };
    eng_tensor ts[] = { { "a", 0, 3000, 0 }, { "b", 3000, 1000, 0 } };
    eng_layout lay = { ts, 2, KERN_F32, KERN_F32, NULL, 0 };
    eng_config cfg;
    eng_config_default(&cfg);
    cfg.rho = 0.01;
    cfg.warmup = 1;
    cfg.defer_select = 0; /* the step waits for the mask it started itself */
    static float p[2][N], g[2][N];
    for (int i = 0; i < N; i++) {
        p[a->rank][i] = 0.0f;
        g[a->rank][i] = (float)((i * 7919 + a->rank * 31) % 1000) / 1000.0f - 0.5f;
    }
    void *params[1] = { p[a->rank] };
    const void *grads[1] = { g[a->rank] };
    eng_t *e = NULL;
    scape_rc rc = eng_create(&e, &cfg, &lay, a->comm, 1);
    if (rc == SCAPE_OK)
        rc = eng_init_params(e, params);
    for (uint64_t t = 1; rc == SCAPE_OK && t <= STEPS; t++) {
        if (a->rank == 1)
            nanosleep(&(struct timespec){ 0, lc->lag_ms * 1000000L }, NULL);
        rc = eng_step(e, t, 1e-3f, grads, params);
    }
    eng_step_stats st;
    if (rc == SCAPE_OK)
        rc = eng_last_stats(e, &st);
    if (rc == SCAPE_OK) {
        lc->wait_s[a->rank] = st.phase_s[ENG_PH_MASK_WAIT];
        lc->overlap[a->rank] = st.mask_overlap;
    }
    eng_destroy(&e);
    return rc;
}

START_TEST(mask_wait_and_overlap)
{
    lag_ctx lc = { .lag_ms = 150 };
    rank_arg args[2];
    ck_assert_int_eq(run_ranks(2, rank_lagging, &lc, args), 0);
    for (int r = 0; r < 2; r++)
        ck_assert_msg(args[r].rc == SCAPE_OK, "rank %d: %s", r, args[r].err);
    /* rank 0 waited for most of the lag; rank 1 hardly at all */
    ck_assert_msg(lc.wait_s[0] > 0.5 * 0.150 && lc.overlap[0] < 0.5,
                  "rank 0: waited %.4f s, overlap %.3f", lc.wait_s[0], lc.overlap[0]);
    ck_assert_msg(lc.wait_s[1] < lc.wait_s[0] && lc.overlap[1] > 0.5,
                  "rank 1: waited %.4f s, overlap %.3f", lc.wait_s[1], lc.overlap[1]);
}
END_TEST

static void expect_invalid(scape_rc rc, const char *needle)
{
    ck_assert_int_eq(rc, SCAPE_INVALID);
    ck_assert_msg(strstr(scape_last_error(), needle) != NULL, "message '%s' lacks '%s'",
                  scape_last_error(), needle);
}

START_TEST(bad_create_arguments)
{
    comm_t *c[1];
    ck_assert_int_eq(comm_local_create(1, c), SCAPE_OK);
    eng_tensor ts[] = { { "a", 0, 40, 0 }, { "b", 40, 1, 0 } };
    eng_tensor gap[] = { { "a", 0, 40, 0 }, { "b", 41, 1, 0 } };
    eng_layout lay = { ts, 2, KERN_F32, KERN_F32, NULL, 0 }, bad_lay = lay;
    eng_config cfg, bad;
    eng_config_default(&cfg);
    cfg.defer_select = 0; /* as these tests were written (the key: 1) */
    eng_t *e = NULL;
    expect_invalid(eng_create(NULL, &cfg, &lay, c[0], 1), "NULL");
    expect_invalid(eng_create(&e, NULL, &lay, c[0], 1), "NULL");
    expect_invalid(eng_create(&e, &cfg, NULL, c[0], 1), "NULL");
    expect_invalid(eng_create(&e, &cfg, &lay, NULL, 1), "NULL");
    expect_invalid(eng_create(&e, &cfg, &lay, c[0], 0), "local_trainers");
    bad = cfg; bad.rho = 0.0;
    expect_invalid(eng_create(&e, &bad, &lay, c[0], 1), "rho");
    bad = cfg; bad.warmup = 0;
    expect_invalid(eng_create(&e, &bad, &lay, c[0], 1), "warmup");
    bad = cfg; bad.hyper.beta1 = 1.0f;
    expect_invalid(eng_create(&e, &bad, &lay, c[0], 1), "beta1");
    bad = cfg; bad.hyper.eps = 0.0f;
    expect_invalid(eng_create(&e, &bad, &lay, c[0], 1), "eps");
    bad = cfg; bad.intake_chunk = 48;
    expect_invalid(eng_create(&e, &bad, &lay, c[0], 1), "intake_chunk");
    bad = cfg; bad.threads = 0;
    expect_invalid(eng_create(&e, &bad, &lay, c[0], 1), "threads=0");
    bad = cfg; bad.threads = 257;
    expect_invalid(eng_create(&e, &bad, &lay, c[0], 1), "threads=257");
    bad = cfg; bad.optimizer = ENG_OPT_COUNT;
    expect_invalid(eng_create(&e, &bad, &lay, c[0], 1), "optimizer");
    bad_lay.tensors = gap;
    expect_invalid(eng_create(&e, &cfg, &bad_lay, c[0], 1), "tile");
    bad_lay = lay; bad_lay.ntensors = 0;
    expect_invalid(eng_create(&e, &cfg, &bad_lay, c[0], 1), "no tensors");
    bad_lay = lay; bad_lay.tensors = NULL;
    expect_invalid(eng_create(&e, &cfg, &bad_lay, c[0], 1), "NULL");
    bad_lay = lay; bad_lay.grad_dtype = (kern_dtype)7;
    expect_invalid(eng_create(&e, &cfg, &bad_lay, c[0], 1), "dtype");
    eng_group groups[ENG_MAX_GROUPS + 1] = { { 0.1f }, { -1.0f } };
    eng_tensor grouped[] = { { "a", 0, 40, 0 }, { "b", 40, 1, 2 } };
    bad_lay = lay; bad_lay.groups = groups; bad_lay.ngroups = 2;
    expect_invalid(eng_create(&e, &cfg, &bad_lay, c[0], 1), "group 1: weight_decay -1");
    groups[1].weight_decay = 0.0f;
    bad_lay.tensors = grouped;
    expect_invalid(eng_create(&e, &cfg, &bad_lay, c[0], 1), "tensor b is in parameter group 2");
    bad_lay = lay; bad_lay.groups = groups; bad_lay.ngroups = ENG_MAX_GROUPS + 1;
    expect_invalid(eng_create(&e, &cfg, &bad_lay, c[0], 1), "parameter groups");
    ck_assert_ptr_null(e);
    eng_optimizer o;
    eng_mode m;
    expect_invalid(eng_optimizer_parse("sgd", &o), "sgd");
    expect_invalid(eng_mode_parse(NULL, &m), "mode");
    ck_assert_int_eq(eng_optimizer_parse("topk-adamw", &o), SCAPE_OK);
    ck_assert_int_eq(o, ENG_OPT_TOPK_ADAMW);
    comm_destroy(&c[0]);
}
END_TEST

START_TEST(bad_step_arguments)
{
    comm_t *c[1];
    ck_assert_int_eq(comm_local_create(1, c), SCAPE_OK);
    eng_tensor ts[] = { { "a", 0, 40, 0 }, { "b", 40, 1, 0 } };
    eng_layout lay = { ts, 2, KERN_F32, KERN_F32, NULL, 0 };
    eng_config cfg;
    eng_config_default(&cfg);
    cfg.defer_select = 0; /* as these tests were written (the key: 1) */
    eng_t *e = NULL;
    ck_assert_int_eq(eng_create(&e, &cfg, &lay, c[0], 2), SCAPE_OK);
    float p0[41] = { 0 }, p1[41], g0[41] = { 0 }, g1[41] = { 0 }, big[82];
    void *params[2] = { p0, p1 };
    const void *grads[2] = { g0, g1 };
    expect_invalid(eng_step(e, 1, 1e-3f, grads, params), "eng_init_params");
    expect_invalid(eng_init_params(e, NULL), "params");
    ck_assert_int_eq(eng_init_params(e, params), SCAPE_OK);
    expect_invalid(eng_init_params(e, params), "already");
    expect_invalid(eng_step(e, 2, 1e-3f, grads, params), "out of order");
    expect_invalid(eng_step(e, 1, NAN, grads, params), "lr");
    expect_invalid(eng_step(e, 1, 1e-3f, NULL, params), "grads");
    const void *grads_null[2] = { g0, NULL };
    expect_invalid(eng_step(e, 1, 1e-3f, grads_null, params), "grads[1]");
    void *overlap[2] = { big, big + 20 };
    expect_invalid(eng_step(e, 1, 1e-3f, grads, overlap), "overlaps params");
    const void *grads_alias[2] = { g0, p1 };
    expect_invalid(eng_step(e, 1, 1e-3f, grads_alias, params), "overlaps grads");
    ck_assert_int_eq(eng_step(e, 1, 1e-3f, grads, params), SCAPE_OK);
    expect_invalid(eng_step(NULL, 2, 1e-3f, grads, params), "NULL");
    expect_invalid(eng_last_stats(e, NULL), "NULL");
    eng_destroy(&e);
    ck_assert_ptr_null(e);
    eng_destroy(NULL);
    comm_destroy(&c[0]);
}
END_TEST

int main(void)
{
    const char *env = getenv("SCAPE_TEST_SEED");
    s_seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
    printf("test_engine: seed %llu (set SCAPE_TEST_SEED to reproduce)\n",
           (unsigned long long)s_seed);
    fflush(stdout);
    Suite *s = suite_create("engine");
    TCase *inv = tcase_create("invariants");
    tcase_set_timeout(inv, 1800);
    tcase_add_loop_test(inv, scape_rho_1, 0, 2);
    tcase_add_loop_test(inv, scape_rho_0_5, 0, 2);
    tcase_add_loop_test(inv, scape_rho_0_1, 0, 2);
    tcase_add_loop_test(inv, scape_rho_0_01, 0, 2);
    tcase_add_test(inv, threads_do_not_change_results);
    tcase_add_loop_test(inv, sim_executor_is_the_host_executor, 0, 2);
    tcase_add_test(inv, launches_do_not_grow_with_tensors);
    tcase_add_loop_test(inv, clipping_by_global_norm, 0, 2);
    tcase_add_loop_test(inv, parameter_groups, 0, 2);
    tcase_add_loop_test(inv, deferred_selection_changes_nothing, 0, 2);
    tcase_add_loop_test(inv, ties_keep_exact_k, 0, 2);
    tcase_add_loop_test(inv, bf16_buffers, 0, 2);
    tcase_add_loop_test(inv, bf16_values, 0, 2);
    tcase_add_loop_test(inv, gather_in_param_dtype, 0, 2);
    tcase_add_loop_test(inv, gather_delta, 0, 2);
    tcase_add_loop_test(inv, density_schedule, 0, 2);
    tcase_add_loop_test(inv, mask_deltas_decode_to_the_same_masks, 0, 2);
    tcase_add_loop_test(inv, small_tensors_whole, 0, 2);
    tcase_add_loop_test(inv, dense_equivalence, 0, 2);
    tcase_add_loop_test(inv, adamw_dense, 0, 2);
    tcase_add_loop_test(inv, topk_adamw_fills_in, 0, 2);
    tcase_add_test(inv, mask_wait_and_overlap);
    suite_add_tcase(s, inv);
    TCase *bad = tcase_create("bad arguments");
    tcase_add_test(bad, optimizer_rows);
    tcase_add_test(bad, ranks_disagree);
    tcase_add_test(bad, bad_create_arguments);
    tcase_add_test(bad, bad_step_arguments);
    suite_add_tcase(s, bad);
    return check_run(s);
}
