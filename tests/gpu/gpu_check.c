/* gpu_check.c - every CUDA twin against its CPU reference.
 *
 * For each size and each operation: fresh random inputs (seeded from the
 * clock unless --seed is given), outputs poisoned with 0xff bytes on both
 * sides, the CPU reference and the CUDA twin run on the same inputs, and the
 * results compared: fp32 within 1e-6 relative (NaN only against the same
 * bits), masks, counts, prefixes and bf16 bit for bit.  Every size runs twice,
 * once with aligned device buffers and once with buffers 4 bytes off, so both
 * the vector and the scalar paths of the kernels are covered.  Top-k is also
 * checked against the rule itself (k bits, larger keys first, ties to the
 * lower index).  Exit 0 pass, 1 fail, 77 when no GPU can run the twins.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_check.h"

#define PAD 8 /* poisoned slots after a packed output: catch writes past k */

typedef struct ctx {
    gc_rng rng;
    gc_tally tally;
    gc_arena arena;   /* this check's buffers */
    size_t n;         /* current segment length */
    size_t off;       /* byte offset of every device buffer (0 or 4) */
    void *scratch;    /* device scratch for n */
    size_t scratch_bytes;
    char label[96];   /* operation and variant, for messages */
} ctx;

static void begin(ctx *c, size_t n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void begin(ctx *c, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->label, sizeof c->label, fmt, ap);
    va_end(ap);
    c->n = n;
}

/* ---- inputs ---------------------------------------------------------------- */

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

/* Bits set with probability p; the tail of the last word gets random junk,
 * which every kernel must ignore. */
static uint32_t *rand_mask(ctx *c, size_t n, double p)
{
    size_t nw = kern_mask_words(n);
    uint32_t *m = gc_host(&c->arena, nw * sizeof *m);
    for (size_t w = 0; w < nw; w++) {
        uint32_t word = 0;
        for (unsigned b = 0; b < 32; b++)
            if (gc_unit(&c->rng) < p)
                word |= 1u << b;
        m[w] = word;
    }
    if (n & 31)
        m[nw - 1] |= (uint32_t)gc_next(&c->rng) & ~((1u << (n & 31)) - 1u);
    return m;
}

static void *host_dup(ctx *c, const void *p, size_t bytes)
{
    void *q = gc_host(&c->arena, bytes);
    memcpy(q, p, bytes);
    return q;
}

static void *host_poison(ctx *c, size_t bytes)
{
    void *q = gc_host(&c->arena, bytes);
    memset(q, 0xff, bytes);
    return q;
}

static void *up(ctx *c, const void *h, size_t bytes)
{
    void *d = gc_dev(&c->arena, bytes, c->off);
    GC_CUDA(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}

static void *dev_poison(ctx *c, size_t bytes)
{
    void *d = gc_dev(&c->arena, bytes, c->off);
    GC_CUDA(cudaMemset(d, 0xff, bytes));
    return d;
}

/* Wait for the twin, then bring a device buffer back. */
static void *down(ctx *c, const void *d, size_t bytes)
{
    GC_CUDA(cudaDeviceSynchronize());
    void *h = gc_host(&c->arena, bytes);
    GC_CUDA(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
    return h;
}

static size_t cpu_popcount(const uint32_t *mask, size_t n)
{
    size_t k = 0;
    if (kern_mask_popcount(mask, n, &k) != SCAPE_OK) {
        fprintf(stderr, "kern_mask_popcount: %s\n", scape_last_error());
        exit(1);
    }
    return k;
}

/* ---- comparisons ------------------------------------------------------------ */

static int rc_ok(ctx *c, scape_rc rc, const char *side)
{
    return gc_expect(&c->tally, rc == SCAPE_OK, "%s n=%zu off=%zu: %s returned %s: %s",
                     c->label, c->n, c->off, side, scape_rc_name(rc),
                     scape_last_error());
}

static uint32_t bits_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static int close_f32(float cpu, float gpu)
{
    if (bits_of(cpu) == bits_of(gpu))
        return 1;
    if (isnan(cpu) || isnan(gpu))
        return 0;
    return fabs((double)gpu - (double)cpu) <= 1e-6 * fabs((double)cpu) + 1e-30;
}

static void cmp_f32(ctx *c, const char *what, const float *cpu, const float *gpu,
                    size_t n)
{
    size_t bad = 0, first = 0, inexact = 0;
    for (size_t i = 0; i < n; i++) {
        if (bits_of(cpu[i]) == bits_of(gpu[i]))
            continue;
        if (close_f32(cpu[i], gpu[i]))
            inexact++;
        else if (bad++ == 0)
            first = i;
    }
    if (inexact)
        printf("note: %s n=%zu %s: %zu values within 1e-6 but not bit-identical\n",
               c->label, c->n, what, inexact);
    gc_expect(&c->tally, bad == 0,
              "%s n=%zu off=%zu %s: %zu mismatches, first [%zu] cpu %.9g gpu %.9g",
              c->label, c->n, c->off, what, bad, first, bad ? cpu[first] : 0.0,
              bad ? gpu[first] : 0.0);
}

/* Bit-exact comparison of arrays of `elem`-byte unsigned integers. */
static void cmp_bits(ctx *c, const char *what, const void *cpu, const void *gpu,
                     size_t count, size_t elem)
{
    const unsigned char *a = cpu, *b = gpu;
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < count; i++)
        if (memcmp(a + i * elem, b + i * elem, elem) != 0 && bad++ == 0)
            first = i;
    uint32_t x = 0, y = 0;
    if (bad) {
        memcpy(&x, a + first * elem, elem);
        memcpy(&y, b + first * elem, elem);
    }
    gc_expect(&c->tally, bad == 0,
              "%s n=%zu off=%zu %s: %zu mismatches, first [%zu] cpu 0x%x gpu 0x%x",
              c->label, c->n, c->off, what, bad, first, (unsigned)x, (unsigned)y);
}

/* ---- pack, statistics, mask helpers ----------------------------------------- */

static void check_pack_ef(ctx *c, size_t n, double p)
{
    begin(c, n, "pack_ef p=%.2f", p);
    const size_t nw = kern_mask_words(n), cap = n + PAD;
    float *g = rand_f32(c, n), *e = rand_f32(c, n);
    uint32_t *mask = rand_mask(c, n, p);
    float *e_cpu = host_dup(c, e, n * 4), *out_cpu = host_poison(c, cap * 4);
    size_t k = 0;
    rc_ok(c, kern_pack_ef(g, e_cpu, mask, n, out_cpu, &k), "cpu");
    float *dg = up(c, g, n * 4), *de = up(c, e, n * 4), *dout = dev_poison(c, cap * 4);
    uint32_t *dm = up(c, mask, nw * 4);
    rc_ok(c, kern_cuda_pack_ef(dg, de, dm, n, dout, c->scratch, c->scratch_bytes, NULL),
          "gpu");
    cmp_f32(c, "e", e_cpu, down(c, de, n * 4), n);
    cmp_f32(c, "out", out_cpu, down(c, dout, cap * 4), cap);
    gc_arena_free(&c->arena);
}

static void check_stats(ctx *c, size_t n, float beta1, float t_r)
{
    begin(c, n, "mask_stat beta1=%g t_r=%g", (double)beta1, (double)t_r);
    float *m = rand_f32(c, n), *g = rand_f32(c, n), *e = rand_f32(c, n);
    float *s_cpu = host_poison(c, n * 4);
    float *dm = up(c, m, n * 4), *dg = up(c, g, n * 4), *de = up(c, e, n * 4);
    float *ds = dev_poison(c, n * 4);
    rc_ok(c, kern_mask_stat(m, g, e, n, beta1, t_r, s_cpu), "cpu");
    rc_ok(c, kern_cuda_mask_stat(dm, dg, de, n, beta1, t_r, ds, NULL), "gpu");
    cmp_f32(c, "stat", s_cpu, down(c, ds, n * 4), n);

    begin(c, n, "abs_stat");
    float *a_cpu = host_poison(c, n * 4), *da = dev_poison(c, n * 4);
    rc_ok(c, kern_abs_stat(g, e, n, a_cpu), "cpu");
    rc_ok(c, kern_cuda_abs_stat(dg, de, n, da, NULL), "gpu");
    cmp_f32(c, "stat", a_cpu, down(c, da, n * 4), n);
    gc_arena_free(&c->arena);
}

static void check_mask_counts(ctx *c, size_t n, double p)
{
    begin(c, n, "mask_popcount p=%.2f", p);
    const size_t nw = kern_mask_words(n);
    uint32_t *mask = rand_mask(c, n, p), *dm = up(c, mask, nw * 4);
    size_t k_cpu = cpu_popcount(mask, n), k_gpu = (size_t)-1;
    rc_ok(c, kern_cuda_mask_popcount(dm, n, &k_gpu, c->scratch, c->scratch_bytes, NULL),
          "gpu");
    gc_expect(&c->tally, k_cpu == k_gpu, "%s n=%zu off=%zu: count cpu %zu gpu %zu",
              c->label, n, c->off, k_cpu, k_gpu);

    begin(c, n, "mask_prefix p=%.2f", p);
    uint32_t *pre_cpu = host_poison(c, (nw + 1) * 4), *dpre = dev_poison(c, (nw + 1) * 4);
    rc_ok(c, kern_mask_prefix(mask, nw, pre_cpu), "cpu");
    rc_ok(c, kern_cuda_mask_prefix(dm, nw, dpre, c->scratch, c->scratch_bytes, NULL),
          "gpu");
    cmp_bits(c, "prefix", pre_cpu, down(c, dpre, (nw + 1) * 4), nw + 1, 4);

    begin(c, n, "mask_or");
    uint32_t *src = rand_mask(c, n, 0.5), *dsrc = up(c, src, nw * 4);
    rc_ok(c, kern_mask_or(mask, src, nw), "cpu");
    rc_ok(c, kern_cuda_mask_or(dm, dsrc, nw, NULL), "gpu");
    cmp_bits(c, "dst", mask, down(c, dm, nw * 4), nw, 4);
    gc_arena_free(&c->arena);
}

static void check_compact(ctx *c, size_t n, double p)
{
    begin(c, n, "mask_compact p=%.2f", p);
    const size_t nw = kern_mask_words(n), cap = n + PAD;
    float *dense = rand_f32(c, n), *out_cpu = host_poison(c, cap * 4);
    uint32_t *mask = rand_mask(c, n, p);
    size_t k = 0;
    rc_ok(c, kern_mask_compact(dense, mask, n, out_cpu, &k), "cpu");
    float *dd = up(c, dense, n * 4), *dout = dev_poison(c, cap * 4);
    uint32_t *dm = up(c, mask, nw * 4);
    rc_ok(c, kern_cuda_mask_compact(dd, dm, n, dout, c->scratch, c->scratch_bytes, NULL),
          "gpu");
    cmp_f32(c, "packed", out_cpu, down(c, dout, cap * 4), cap);
    gc_arena_free(&c->arena);
}

static void check_expand(ctx *c, size_t n, double p, kern_dtype dt)
{
    begin(c, n, "mask_expand p=%.2f %s", p, dt == KERN_BF16 ? "bf16" : "f32");
    const size_t nw = kern_mask_words(n), es = kern_dtype_size(dt);
    uint32_t *mask = rand_mask(c, n, p);
    size_t k = cpu_popcount(mask, n);
    float *packed = rand_f32(c, k);
    /* clear bits leave dense untouched: start both sides from the same bytes */
    void *dense_cpu = rand_f32(c, n * es / 4 + 1);
    float *dp = up(c, packed, k * 4);
    uint32_t *dm = up(c, mask, nw * 4);
    void *dd = up(c, dense_cpu, n * es);
    rc_ok(c, kern_mask_expand(packed, mask, n, dense_cpu, dt), "cpu");
    rc_ok(c, kern_cuda_mask_expand(dp, dm, n, dd, dt, c->scratch, c->scratch_bytes, NULL),
          "gpu");
    if (dt == KERN_F32)
        cmp_f32(c, "dense", dense_cpu, down(c, dd, n * 4), n);
    else
        cmp_bits(c, "dense", dense_cpu, down(c, dd, n * 2), n, 2);
    gc_arena_free(&c->arena);
}

/* ---- top-k ---------------------------------------------------------------- */

enum topk_kind { TK_SPREAD, TK_LEVELS, TK_EQUAL, TK_SPECIAL, TK_KINDS };
static const char *const topk_kind_name[TK_KINDS] = {"spread", "8-levels", "all-equal",
                                                       "nan-inf-zero"};

static float *topk_input(ctx *c, size_t n, enum topk_kind kind)
{
    static const float special[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f,
                                    1e-40f, -1e-45f, 3.0f, -3.0f};
    float *s = rand_f32(c, n);
    for (size_t i = 0; i < n; i++) {
        uint64_t r = gc_next(&c->rng);
        if (kind == TK_LEVELS)
            s[i] = (float)(int)(r % 8) - 3.5f;
        else if (kind == TK_EQUAL)
            s[i] = 1.5f;
        else if (kind == TK_SPECIAL && (r & 3) == 0)
            s[i] = special[(r >> 2) % (sizeof special / sizeof special[0])];
    }
    return s;
}

static uint32_t key_of(float x) { return bits_of(x) & 0x7fffffffu; }

static int bit_at(const uint32_t *mask, size_t i) { return (mask[i >> 5] >> (i & 31)) & 1u; }

/* The rule, derived from the definition rather than the reference: k bits,
 * no tail bits, every selected key >= every unselected key, and at the
 * boundary key the selected indices all precede the unselected ones. */
static void check_topk_rule(ctx *c, const float *stat, size_t n, size_t k,
                            const uint32_t *mask)
{
    size_t count = 0, nw = kern_mask_words(n), last_in = 0, first_out = n;
    uint32_t min_in = UINT32_MAX, max_out = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u = key_of(stat[i]);
        if (bit_at(mask, i)) {
            count++;
            min_in = u < min_in ? u : min_in;
        } else {
            max_out = u > max_out ? u : max_out;
        }
    }
    for (size_t i = 0; i < n && count && count < n; i++) {
        if (key_of(stat[i]) != min_in)
            continue;
        if (bit_at(mask, i))
            last_in = i;
        else if (first_out == n)
            first_out = i;
    }
    int tail_ok = !(n & 31) || (mask[nw - 1] >> (n & 31)) == 0;
    int order_ok = count == 0 || count == n ||
                   (min_in >= max_out && (min_in > max_out || last_in < first_out));
    gc_expect(&c->tally, count == k && tail_ok && order_ok,
              "%s n=%zu off=%zu k=%zu: rule broken (bits %zu, tail %s, order %s)",
              c->label, n, c->off, k, count, tail_ok ? "ok" : "set",
              order_ok ? "ok" : "wrong");
}

static void check_topk(ctx *c, size_t n, enum topk_kind kind, size_t k)
{
    begin(c, n, "topk_mask %s k=%zu", topk_kind_name[kind], k);
    const size_t nw = kern_mask_words(n), cs_bytes = kern_topk_scratch_bytes(n);
    float *stat = topk_input(c, n, kind);
    uint32_t *m_cpu = host_poison(c, nw * 4);
    rc_ok(c, kern_topk_mask(stat, n, k, m_cpu, gc_host(&c->arena, cs_bytes), cs_bytes),
          "cpu");
    float *ds = up(c, stat, n * 4);
    uint32_t *dm = dev_poison(c, nw * 4);
    rc_ok(c, kern_cuda_topk_mask(ds, n, k, dm, c->scratch, c->scratch_bytes, NULL), "gpu");
    uint32_t *m_gpu = down(c, dm, nw * 4);
    cmp_bits(c, "mask", m_cpu, m_gpu, nw, 4);
    check_topk_rule(c, stat, n, k, m_gpu);
    gc_arena_free(&c->arena);
}

static void check_topk_all(ctx *c, size_t n)
{
    const size_t ks[] = {0, 1, n / 100, n / 3, n ? n - 1 : 0, n};
    for (int kind = 0; kind < TK_KINDS; kind++)
        for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++)
            if ((i == 0 || ks[i] != ks[i - 1]) && ks[i] <= n) /* n = 0: k = 1 is refused */
                check_topk(c, n, (enum topk_kind)kind, ks[i]);
}

/* The fused selections: from g + e (topk_ef) and, after a pack, from the
 * stored a (topk_packed), each with the SCAPE statistic and with |a|; the
 * pack with fp32 values leaves 0 in the residual at the sent coordinates,
 * with bf16 values a - bf16(a), which topk_packed must add back. */
static void check_topk_fused(ctx *c, size_t n, int scape_stat, double p, int bf16)
{
    begin(c, n, "topk_ef/topk_packed %s p=%.2f %s values", scape_stat ? "scape" : "abs", p,
          bf16 ? "bf16" : "f32");
    const size_t nw = kern_mask_words(n), k = n / 50 + (n > 0);
    const size_t cs_bytes = kern_topk_scratch_bytes(n);
    void *cs = gc_host(&c->arena, cs_bytes ? cs_bytes : 1);
    float *m = rand_f32(c, n), *g = rand_f32(c, n), *e = rand_f32(c, n);
    uint32_t *sent = rand_mask(c, n, p);
    size_t kp = cpu_popcount(sent, n);
    float *packed = host_poison(c, (kp + 1) * 4);
    const float *mm = scape_stat ? m : NULL;
    uint32_t *m_ef = host_poison(c, nw * 4), *m_pk = host_poison(c, nw * 4);
    rc_ok(c, kern_topk_ef(mm, g, e, n, 0.9f, 3.0f, k, m_ef, cs, cs_bytes), "cpu ef");
    float *dm_ = scape_stat ? up(c, m, n * 4) : NULL, *dg = up(c, g, n * 4);
    float *de = up(c, e, n * 4);
    uint32_t *dmask = dev_poison(c, nw * 4);
    rc_ok(c, kern_cuda_topk_ef(dm_, dg, de, n, 0.9f, 3.0f, k, dmask, c->scratch,
                               c->scratch_bytes, NULL), "gpu ef");
    cmp_bits(c, "ef mask", m_ef, down(c, dmask, nw * 4), nw, 4);
    size_t kk = 0;
    rc_ok(c, (bf16 ? kern_pack_ef_bf16 : kern_pack_ef)(g, e, sent, n, packed, &kk), "cpu pack");
    rc_ok(c, kern_topk_packed(mm, e, sent, packed, n, 0.9f, 3.0f, k, m_pk, cs, cs_bytes),
          "cpu packed");
    cmp_bits(c, "packed vs ef (cpu)", m_ef, m_pk, nw, 4);
    float *de2 = up(c, e, n * 4), *dp = up(c, packed, (kp + 1) * 4);
    uint32_t *dsent = up(c, sent, nw * 4);
    rc_ok(c, kern_cuda_topk_packed(dm_, de2, dsent, dp, n, 0.9f, 3.0f, k, dmask, c->scratch,
                                   c->scratch_bytes, NULL), "gpu packed");
    cmp_bits(c, "packed mask", m_pk, down(c, dmask, nw * 4), nw, 4);
    gc_arena_free(&c->arena);
}

/* ---- Adam family --------------------------------------------------------- */

static const kern_hyper s_hyper = {0.9f, 0.95f, 1e-8f, 0.01f, 0.0f};
#define DIV 3.0f
#define LR 1e-3f
#define STEP 5

/* |x| for the AdamW second moment, which is never negative. */
static float *rand_pos(ctx *c, size_t n)
{
    float *v = rand_f32(c, n);
    for (size_t i = 0; i < n; i++)
        v[i] = fabsf(v[i]);
    return v;
}

static void check_adam_masked(ctx *c, size_t n, double p, int adamw)
{
    begin(c, n, "%s_masked p=%.2f", adamw ? "adamw" : "adams", p);
    const size_t nw = kern_mask_words(n);
    uint32_t *mask = rand_mask(c, n, p);
    const size_t k = cpu_popcount(mask, n);
    float *th = rand_f32(c, n), *m = rand_f32(c, n), *v = rand_pos(c, n);
    float *sum = rand_f32(c, k);
    float *dth = up(c, th, n * 4), *dm = up(c, m, n * 4), *dv = up(c, v, n * 4);
    float *dsum = up(c, sum, k * 4);
    uint32_t *dmask = up(c, mask, nw * 4);
    if (adamw) {
        rc_ok(c, kern_adamw_masked(th, m, v, sum, DIV, mask, n, &s_hyper, LR, STEP), "cpu");
        rc_ok(c, kern_cuda_adamw_masked(dth, dm, dv, dsum, DIV, dmask, n, &s_hyper, LR, STEP,
                                        c->scratch, c->scratch_bytes, NULL), "gpu");
        cmp_f32(c, "v", v, down(c, dv, n * 4), n);
    } else {
        rc_ok(c, kern_adams_masked(th, m, sum, DIV, mask, n, &s_hyper, LR), "cpu");
        rc_ok(c, kern_cuda_adams_masked(dth, dm, dsum, DIV, dmask, n, &s_hyper, LR,
                                        c->scratch, c->scratch_bytes, NULL), "gpu");
    }
    cmp_f32(c, "theta", th, down(c, dth, n * 4), n);
    cmp_f32(c, "m", m, down(c, dm, n * 4), n);
    gc_arena_free(&c->arena);
}

static void check_adam_dense(ctx *c, size_t n, int adamw)
{
    begin(c, n, "%s_dense", adamw ? "adamw" : "adams");
    float *th = rand_f32(c, n), *m = rand_f32(c, n), *v = rand_pos(c, n);
    float *sum = rand_f32(c, n);
    float *dth = up(c, th, n * 4), *dm = up(c, m, n * 4), *dv = up(c, v, n * 4);
    float *dsum = up(c, sum, n * 4);
    if (adamw) {
        rc_ok(c, kern_adamw_dense(th, m, v, sum, DIV, n, &s_hyper, LR, STEP), "cpu");
        rc_ok(c, kern_cuda_adamw_dense(dth, dm, dv, dsum, DIV, n, &s_hyper, LR, STEP, NULL),
              "gpu");
        cmp_f32(c, "v", v, down(c, dv, n * 4), n);
    } else {
        rc_ok(c, kern_adams_dense(th, m, sum, DIV, n, &s_hyper, LR), "cpu");
        rc_ok(c, kern_cuda_adams_dense(dth, dm, dsum, DIV, n, &s_hyper, LR, NULL), "gpu");
    }
    cmp_f32(c, "theta", th, down(c, dth, n * 4), n);
    cmp_f32(c, "m", m, down(c, dm, n * 4), n);
    gc_arena_free(&c->arena);
}

/* ---- intake and conversion ---------------------------------------------- */

/* bf16 values of finite floats (accumulating a NaN would compare payloads
 * that x86 and the GPU legitimately choose differently). */
static uint16_t *rand_bf16(ctx *c, size_t n)
{
    const float *f = rand_f32(c, n);
    uint16_t *h = gc_host(&c->arena, n * 2);
    for (size_t i = 0; i < n; i++)
        h[i] = kern_bf16_from_f32(f[i]);
    return h;
}

static void check_accum(ctx *c, size_t n, kern_dtype dt, int overwrite)
{
    begin(c, n, "grad_accum %s %s", dt == KERN_BF16 ? "bf16" : "f32",
          overwrite ? "overwrite" : "add");
    float *dst = rand_f32(c, n);
    void *src = dt == KERN_BF16 ? (void *)rand_bf16(c, n) : (void *)rand_f32(c, n);
    float *ddst = up(c, dst, n * 4);
    void *dsrc = up(c, src, n * kern_dtype_size(dt));
    rc_ok(c, kern_grad_accum(dst, src, dt, n, overwrite), "cpu");
    rc_ok(c, kern_cuda_grad_accum(ddst, dsrc, dt, n, overwrite, NULL), "gpu");
    cmp_f32(c, "dst", dst, down(c, ddst, n * 4), n);
    gc_arena_free(&c->arena);
}

/* Floats that stress rounding: NaNs with payloads, infinities, signed zeros,
 * subnormals, exact round-to-even ties, values that round up to infinity. */
static float *convert_input(ctx *c, size_t n)
{
    static const uint32_t special[] = {0x7fc00001u, 0xff800001u, 0x7f800000u, 0xff800000u,
                                       0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu,
                                       0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0xff7f8000u};
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

static void check_convert(ctx *c, size_t n)
{
    begin(c, n, "f32_to_bf16");
    float *f = convert_input(c, n), *df = up(c, f, n * 4);
    uint16_t *h_cpu = host_poison(c, n * 2), *dh = dev_poison(c, n * 2);
    rc_ok(c, kern_f32_to_bf16(f, h_cpu, n), "cpu");
    rc_ok(c, kern_cuda_f32_to_bf16(df, dh, n, NULL), "gpu");
    cmp_bits(c, "dst", h_cpu, down(c, dh, n * 2), n, 2);

    begin(c, n, "bf16_to_f32");
    uint16_t *raw = gc_host(&c->arena, n * 2);
    for (size_t i = 0; i < n; i++)
        raw[i] = (uint16_t)gc_next(&c->rng);
    uint16_t *draw = up(c, raw, n * 2);
    float *f_cpu = host_poison(c, n * 4), *dout = dev_poison(c, n * 4);
    rc_ok(c, kern_bf16_to_f32(raw, f_cpu, n), "cpu");
    rc_ok(c, kern_cuda_bf16_to_f32(draw, dout, n, NULL), "gpu");
    cmp_bits(c, "dst", f_cpu, down(c, dout, n * 4), n, 4);

    /* the owners' rank-order fp32 sum of bf16 parts (wire_values: bf16) */
    begin(c, n, "sum_bf16_parts");
    unsigned np = 3;
    uint16_t *parts = gc_host(&c->arena, (size_t)np * n * 2);
    for (size_t i = 0; i < (size_t)np * n; i++)
        parts[i] = kern_bf16_from_f32( /* finite: NaN payloads differ between the two */
            (float)((int)(gc_next(&c->rng) % 2001) - 1000) * 0.37f * (float)(1 + i / n));
    uint16_t *dparts = up(c, parts, (size_t)np * n * 2);
    float *s_cpu = host_poison(c, n * 4), *ds = dev_poison(c, n * 4);
    rc_ok(c, kern_sum_bf16_parts(parts, np, n, s_cpu), "cpu");
    rc_ok(c, kern_cuda_sum_bf16_parts(dparts, np, n, ds, NULL), "gpu");
    cmp_bits(c, "dst", s_cpu, down(c, ds, n * 4), n, 4);
    gc_arena_free(&c->arena);
}

/* ---- driver ---------------------------------------------------------------- */

static void check_offset(ctx *c, size_t n)
{
    static const double dens[] = {0.0, 0.01, 0.5, 1.0};
    for (int i = 0; i < 4; i++) {
        check_pack_ef(c, n, dens[i]);
        check_compact(c, n, dens[i]);
        check_mask_counts(c, n, dens[i]);
    }
    for (int i = 1; i < 3; i++)
        for (int w = 0; w < 2; w++) {
            check_expand(c, n, dens[i], w ? KERN_BF16 : KERN_F32);
            check_adam_masked(c, n, dens[i], w);
        }
    check_stats(c, n, 0.9f, 3.0f);
    check_stats(c, n, 0.0f, 1.0f);
    check_topk_all(c, n);
    for (int sc = 0; sc < 2; sc++)
        for (int bf = 0; bf < 2; bf++) {
            check_topk_fused(c, n, sc, 0.01, bf);
            check_topk_fused(c, n, sc, 1.0, bf);
        }
    for (int w = 0; w < 2; w++) {
        check_adam_dense(c, n, w);
        check_accum(c, n, w ? KERN_BF16 : KERN_F32, 0);
        check_accum(c, n, w ? KERN_BF16 : KERN_F32, 1);
    }
    check_convert(c, n);
}

static void check_size(ctx *c, size_t n)
{
    c->scratch_bytes = kern_cuda_scratch_bytes(n);
    GC_CUDA(cudaMalloc(&c->scratch, c->scratch_bytes + 256));
    unsigned before = c->tally.failures;
    for (c->off = 0; c->off <= 4; c->off += 4)
        check_offset(c, n);
    GC_CUDA(cudaFree(c->scratch));
    printf("n=%-9zu %s (%u checks so far)\n", n,
           c->tally.failures == before ? "ok" : "FAILED", c->tally.checks);
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
    /* 2^16 + 1: several scan tiles and histogram blocks, small enough for
     * the CPU emulator (tests/gpu/emu) */
    static const size_t sizes[] = {0, 1, 31, 33, 1000, (1u << 16) + 1, (1u << 20) + 7, 10000000};
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
