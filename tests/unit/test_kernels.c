/* test_kernels.c - the CPU kernels against references written here.
 *
 * Every kernel runs on fresh random inputs (the seed is printed; set
 * SCAPE_TEST_SEED to replay a run) at the edge sizes below.  Outputs are
 * poisoned before each call and sit between guard regions that must come
 * back untouched.  Data movement is compared bit for bit; the Adam updates
 * are compared with a float64 evaluation of the formulas of scape_kernels.h,
 * within a bound proportional to the magnitude of the terms involved.
 */
#define _POSIX_C_SOURCE 200809L

#include <check.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "scape_kernels.h"
#include "try.h"
#include "check_run.h"
#include "test_rng.h"

/* ---- random inputs ------------------------------------------------------ */

static uint64_t s_seed;

/* A generator of its own for each test and loop index (test_rng.h). */
static rng rng_make(const char *name, int i) { return rng_for(s_seed, name, i); }
static uint32_t rng_u32(rng *r) { return (uint32_t)(rng_next(r) >> 32); }
static double rng_unit(rng *r) { return (double)(rng_next(r) >> 11) * 0x1p-53; }


static uint64_t pick_seed(void)
{
    const char *env = getenv("SCAPE_TEST_SEED");
    if (env != NULL && *env != '\0')
        return strtoull(env, NULL, 0);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t s = (uint64_t)ts.tv_sec ^ ((uint64_t)ts.tv_nsec << 20) ^
                 ((uint64_t)getpid() << 40);
    return rng_splitmix(&s);
}

/* ---- buffers: exact-size inputs, guarded and poisoned outputs ----------- */

#define GUARD 64          /* bytes before and after every output buffer */
#define GUARD_BYTE 0x5c
#define POISON_BYTE 0xab
#define POISON_COUNT ((size_t)0xababababababababull)

static const size_t s_sizes[] = { 0, 1, 31, 32, 33, 1000, (1u << 20) + 7 };
#define NSIZES ((int)(sizeof s_sizes / sizeof s_sizes[0]))

/* An input of exactly `bytes` bytes, so that ASan sees any over-read. */
static void *xalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(p);
    return p;
}

/* An output of `bytes` poisoned bytes between two guard regions; the size is
 * kept in the front region. */
static void *galloc(size_t bytes)
{
    unsigned char *raw = malloc(2 * GUARD + bytes);
    ck_assert_ptr_nonnull(raw);
    memcpy(raw, &bytes, sizeof bytes);
    memset(raw + sizeof bytes, GUARD_BYTE, GUARD - sizeof bytes);
    memset(raw + GUARD, POISON_BYTE, bytes);
    memset(raw + GUARD + bytes, GUARD_BYTE, GUARD);
    return raw + GUARD;
}

static void gcheck(const void *p, const char *what)
{
    const unsigned char *front = (const unsigned char *)p - GUARD;
    size_t bytes;
    memcpy(&bytes, front, sizeof bytes);
    for (size_t i = sizeof bytes; i < GUARD; i++)
        if (front[i] != GUARD_BYTE)
            ck_abort_msg("%s: guard byte %zu before the buffer was written",
                         what, GUARD - i);
    for (size_t i = 0; i < GUARD; i++)
        if (front[GUARD + bytes + i] != GUARD_BYTE)
            ck_abort_msg("%s: byte %zu past the end of %zu bytes was written",
                         what, i, bytes);
}

static void gfree(void *p) { free((unsigned char *)p - GUARD); }

static void *dup_bytes(const void *p, size_t bytes)
{
    void *q = xalloc(bytes);
    memcpy(q, p, bytes);
    return q;
}

static uint32_t f2u(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float u2f(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static void fill_f32(rng *r, float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = rng_float(r);
}

static float *rand_f32(rng *r, size_t n)
{
    float *x = xalloc(n * sizeof *x);
    fill_f32(r, x, n);
    return x;
}

static float *rand_f32_guarded(rng *r, size_t n)
{
    float *x = galloc(n * sizeof *x);
    fill_f32(r, x, n);
    return x;
}

/* ---- comparisons -------------------------------------------------------- */

static void assert_ok(scape_rc rc, const char *what, size_t n)
{
    if (rc != SCAPE_OK)
        ck_abort_msg("%s (n=%zu): rc %s (%s)", what, n, scape_rc_name(rc),
                     scape_last_error());
}

static void assert_f32_eq(const float *got, const float *want, size_t n,
                          const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (f2u(got[i]) != f2u(want[i]))
            ck_abort_msg("%s[%zu] of %zu: got %a (0x%08x), want %a (0x%08x)",
                         what, i, n, (double)got[i], (unsigned)f2u(got[i]),
                         (double)want[i], (unsigned)f2u(want[i]));
}

static void assert_u32_eq(const uint32_t *got, const uint32_t *want, size_t n,
                          const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i])
            ck_abort_msg("%s[%zu] of %zu: got 0x%08x, want 0x%08x", what, i, n,
                         (unsigned)got[i], (unsigned)want[i]);
}

static void assert_u16_eq(const uint16_t *got, const uint16_t *want, size_t n,
                          const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i])
            ck_abort_msg("%s[%zu] of %zu: got 0x%04x, want 0x%04x", what, i, n,
                         (unsigned)got[i], (unsigned)want[i]);
}

/* ---- masks -------------------------------------------------------------- */

enum mask_kind { MK_NONE, MK_ALL, MK_MIXED, MK_COUNT };

static int bit(const uint32_t *mask, size_t i) { return (mask[i >> 5] >> (i & 31)) & 1u; }

static size_t bits_in(uint32_t w)
{
    size_t c = 0;
    for (; w; w &= w - 1)
        c++;
    return c;
}

static size_t ref_popcount(const uint32_t *mask, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        c += (size_t)bit(mask, i);
    return c;
}

/* Mixed words: empty, full, sparse and dense ones, to reach every path. */
static uint32_t mask_word(rng *r, int kind)
{
    if (kind == MK_NONE)
        return 0;
    if (kind == MK_ALL)
        return ~0u;
    uint64_t x = rng_next(r);
    switch (x & 3) {
    case 0: return 0;
    case 1: return ~0u;
    case 2: return (uint32_t)(x >> 32) & (uint32_t)(x >> 2);
    default: return (uint32_t)(x >> 32);
    }
}

/* A mask over n elements with random bits past n, which readers ignore. */
static uint32_t *rand_mask(rng *r, size_t n, int kind)
{
    size_t nw = kern_mask_words(n);
    uint32_t *mask = xalloc(nw * sizeof *mask);
    for (size_t w = 0; w < nw; w++)
        mask[w] = mask_word(r, kind);
    if (n & 31)
        mask[nw - 1] |= rng_u32(r) << (n & 31);
    return mask;
}

/* ---- bf16 reference ----------------------------------------------------- */

static int is_nan32(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

/* Round to nearest even on the 16 dropped bits (finite values and inf). */
static uint16_t ref_bf16(uint32_t u)
{
    uint32_t hi = u >> 16, lo = u & 0xffffu;
    if (lo > 0x8000u || (lo == 0x8000u && (hi & 1u)))
        hi++;
    return (uint16_t)hi;
}

/* A converted NaN must stay a quiet NaN with its sign. */
static int bf16_ok(uint16_t got, uint32_t src)
{
    if (!is_nan32(src))
        return got == ref_bf16(src);
    return (got & 0x7f80u) == 0x7f80u && (got & 0x0040u) &&
           (got >> 15) == (src >> 31);
}

static void check_bf16(const uint32_t *src, const uint16_t *got, size_t n,
                       const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (!bf16_ok(got[i], src[i]))
            ck_abort_msg("%s[%zu]: f32 0x%08x -> bf16 0x%04x, want 0x%04x%s",
                         what, i, (unsigned)src[i], (unsigned)got[i],
                         (unsigned)ref_bf16(src[i]),
                         is_nan32(src[i]) ? " (a quiet NaN, sign kept)" : "");
}

/* ---- result codes and the last error ------------------------------------ */

START_TEST(test_rc_names)
{
    static const char *const want[] = {
        "OK",   "INVALID", "NOMEM",  "SYSTEM",  "CUDA",       "NCCL",
        "ZMQ",  "PROTO",   "REMOTE", "TIMEOUT", "UNSUPPORTED",
    };
    _Static_assert(sizeof want / sizeof want[0] == SCAPE_RC_COUNT,
                   "one name per result code");
    for (int i = 0; i < SCAPE_RC_COUNT; i++)
        ck_assert_str_eq(scape_rc_name((scape_rc)i), want[i]);
    ck_assert_str_eq(scape_rc_name(SCAPE_RC_COUNT), "UNKNOWN");
    ck_assert_str_eq(scape_rc_name((scape_rc)(SCAPE_RC_COUNT + 7)), "UNKNOWN");
    ck_assert_str_eq(scape_rc_name((scape_rc)-1), "UNKNOWN");
}
END_TEST

/* TRY's trail: every level a failure passes through reports its file:line
 * and the code, innermost first; a success reports nothing; no sink, no
 * report. */
static int s_trail_n;
static int s_trail_line[4];
static scape_rc s_trail_rc[4];
static void record_trail(scape_rc rc, const char *file, int line)
{
    ck_assert_ptr_nonnull(strstr(file, "test_kernels.c"));
    if (s_trail_n < 4) {
        s_trail_rc[s_trail_n] = rc;
        s_trail_line[s_trail_n] = line;
    }
    s_trail_n++;
}
static scape_rc trail_leaf(int fail)
{
    return fail ? scape_set_error(SCAPE_INVALID, "the leaf failed") : SCAPE_OK;
}
static int s_line_mid, s_line_top;
static scape_rc trail_mid(int fail)
{
    s_line_mid = __LINE__ + 1;
    TRY(trail_leaf(fail));
    return SCAPE_OK;
}
static scape_rc trail_top(int fail)
{
    s_line_top = __LINE__ + 1;
    TRY(trail_mid(fail));
    return SCAPE_OK;
}

START_TEST(test_try_trail)
{
    scape_set_trail(record_trail);
    s_trail_n = 0;
    ck_assert_int_eq(trail_top(0), SCAPE_OK);
    ck_assert_int_eq(s_trail_n, 0);
    ck_assert_int_eq(trail_top(1), SCAPE_INVALID);
    ck_assert_int_eq(s_trail_n, 2);
    ck_assert_int_eq(s_trail_line[0], s_line_mid);
    ck_assert_int_eq(s_trail_line[1], s_line_top);
    ck_assert_int_eq(s_trail_rc[0], SCAPE_INVALID);
    ck_assert_int_eq(s_trail_rc[1], SCAPE_INVALID);
    ck_assert_str_eq(scape_last_error(), "the leaf failed"); /* the message is kept */
    scape_set_trail(NULL);
    s_trail_n = 0;
    ck_assert_int_eq(trail_top(1), SCAPE_INVALID);
    ck_assert_int_eq(s_trail_n, 0);
}
END_TEST

START_TEST(test_last_error)
{
    static char longmsg[4096];
    scape_clear_error();
    ck_assert_str_eq(scape_last_error(), "");
    ck_assert_int_eq(scape_set_error(SCAPE_PROTO, "x=%d %s", 42, "y"), SCAPE_PROTO);
    ck_assert_str_eq(scape_last_error(), "x=42 y");
    memset(longmsg, 'z', sizeof longmsg - 1);
    ck_assert_int_eq(scape_set_error(SCAPE_SYSTEM, "%s", longmsg), SCAPE_SYSTEM);
    ck_assert_uint_gt(strlen(scape_last_error()), 0);
    ck_assert_uint_lt(strlen(scape_last_error()), sizeof longmsg - 1);
    scape_clear_error();
    ck_assert_str_eq(scape_last_error(), "");
}
END_TEST

/* ---- pack --------------------------------------------------------------- */

static void pack_case(rng *r, size_t n, int kind)
{
    float *g = rand_f32(r, n), *e = rand_f32_guarded(r, n);
    float *e0 = dup_bytes(e, n * 4), *resid = xalloc(n * 4);
    uint32_t *mask = rand_mask(r, n, kind);
    size_t k = ref_popcount(mask, n), j = 0, k_out = POISON_COUNT;
    float *want = xalloc(k * 4), *out = galloc(k * 4);
    for (size_t i = 0; i < n; i++) {
        float a = g[i] + e0[i];
        resid[i] = bit(mask, i) ? 0.0f : a;
        if (bit(mask, i))
            want[j++] = a;
    }
    assert_ok(kern_pack_ef(g, e, mask, n, out, &k_out), "kern_pack_ef", n);
    ck_assert_uint_eq(k_out, k);
    assert_f32_eq(out, want, k, "pack out");
    assert_f32_eq(e, resid, n, "pack residual");
    gcheck(out, "pack out");
    gcheck(e, "pack residual");
    free(g), gfree(e), free(e0), free(resid), free(mask), free(want), gfree(out);
}

START_TEST(test_pack)
{
    rng r = rng_make(__func__, _i);
    for (int kind = 0; kind < MK_COUNT; kind++)
        pack_case(&r, s_sizes[_i], kind);
}
END_TEST

/* ---- statistics ---------------------------------------------------------- */

/* The header's formula in float, in its order: the SCAPE statistic (m given)
 * or |g + e|; the keys kern_topk_ef selects by. */
static void ref_stat(const float *m, const float *g, const float *e, size_t n, float beta1,
                     float t_r, float *stat)
{
    for (size_t i = 0; i < n; i++) {
        float a = g[i] + e[i], c1 = 1.0f - beta1;
        stat[i] = m ? fabsf(beta1 * m[i] + c1 * (a / t_r)) : fabsf(a);
    }
}

/* ---- top-k -------------------------------------------------------------- */

/* The top-k of a stored statistic: kern_topk_packed with nothing sent and no
 * m selects by |e| itself, the radix select without arithmetic on the keys. */
static scape_rc topk_of(const float *stat, size_t n, size_t k, uint32_t *mask, void *scratch,
                        size_t sb)
{
    return kern_topk_packed(NULL, stat, NULL, NULL, n, 0.0f, 1.0f, k, mask, scratch, sb);
}

typedef struct ranked { float v; size_t i; } ranked;

/* -1 when |a| ranks above |b| (NaN above everything), 1 below, 0 equal. */
static int cmp_abs(float a, float b)
{
    int na = !!isnan(a), nb = !!isnan(b);
    if (na || nb)
        return nb - na;
    float fa = fabsf(a), fb = fabsf(b);
    return (fa < fb) - (fa > fb);
}

/* Selection order: value descending, then index ascending. */
static int rank_cmp(const void *pa, const void *pb)
{
    const ranked *a = pa, *b = pb;
    int c = cmp_abs(a->v, b->v);
    return c ? c : (a->i > b->i) - (a->i < b->i);
}

static ranked *ref_order(const float *stat, size_t n)
{
    ranked *order = xalloc(n * sizeof *order);
    for (size_t i = 0; i < n; i++)
        order[i] = (ranked){ stat[i], i };
    qsort(order, n, sizeof *order, rank_cmp);
    return order;
}

/* Every selected element must precede every unselected one in the order. */
static void check_separation(const float *stat, size_t n, const uint32_t *mask)
{
    ranked worst = { 0.0f, 0 }, best = { 0.0f, 0 };
    int have_sel = 0, have_un = 0;
    for (size_t i = 0; i < n; i++) {
        ranked x = { stat[i], i };
        if (bit(mask, i) && (!have_sel || rank_cmp(&x, &worst) > 0))
            worst = x, have_sel = 1;
        if (!bit(mask, i) && (!have_un || rank_cmp(&x, &best) < 0))
            best = x, have_un = 1;
    }
    if (have_sel && have_un && rank_cmp(&worst, &best) > 0)
        ck_abort_msg("selected stat[%zu]=%g ranks below unselected stat[%zu]=%g",
                     worst.i, (double)worst.v, best.i, (double)best.v);
}

static void run_topk(const float *stat, size_t n, size_t k, const ranked *order)
{
    size_t nw = kern_mask_words(n), sb = kern_topk_scratch_bytes(n);
    uint32_t *mask = galloc(nw * 4), *want = xalloc(nw * 4);
    void *scratch = galloc(sb);
    memset(want, 0, nw * 4);
    for (size_t j = 0; j < k; j++)
        want[order[j].i >> 5] |= 1u << (order[j].i & 31);
    assert_ok(topk_of(stat, n, k, mask, scratch, sb), "kern_topk_packed", n);
    size_t got = 0;
    for (size_t w = 0; w < nw; w++)
        got += bits_in(mask[w]);
    if (got != k)
        ck_abort_msg("topk n=%zu k=%zu: %zu bits set", n, k, got);
    check_separation(stat, n, mask);
    assert_u32_eq(mask, want, nw, "topk mask");
    gcheck(mask, "topk mask");
    gcheck(scratch, "topk scratch");
    gfree(mask), free(want), gfree(scratch);
}

enum { D_RANDOM, D_EQUAL, D_TINY, D_SPECIAL, D_NEAR, D_LOW20, D_COUNT };

static float special_value(rng *r)
{
    static const uint32_t sp[] = {
        0x7fc00000u, 0xffc00000u, 0x7f800000u, 0xff800000u, 0x00000000u,
        0x80000000u, 0x00000001u, 0x807fffffu, 0x7f7fffffu, 0x00800000u,
    };
    return u2f(sp[rng_u32(r) % (sizeof sp / sizeof sp[0])]);
}

/* Statistics: random; all equal; from {0,1,2,3} with signs (ties at the
 * threshold); random with NaN/inf/zeros/denormals; near 1.0, where only
 * the low key bits differ; in [1, 1.125) with the low 20 bits random, so
 * that all keys share the top digit and the second one spreads them (each
 * of the selection's three ways to finish is taken at n = 2^20 + 7). */
static float stat_value(rng *r, int dist)
{
    uint32_t x = rng_u32(r), sign = (x & 1u) << 31;
    switch (dist) {
    case D_EQUAL: return 1.0f;
    case D_TINY: return u2f(f2u((float)((x >> 1) & 3u)) | sign);
    case D_SPECIAL: return (x & 0x70u) ? rng_float(r) : special_value(r);
    case D_NEAR: return u2f((0x3f800000u + ((x >> 1) & 0xfffu)) | sign);
    case D_LOW20: return u2f((0x3f800000u + ((x >> 1) & 0xfffffu)) | sign);
    default: return rng_float(r);
    }
}

START_TEST(test_topk)
{
    size_t n = s_sizes[_i];
    rng r = rng_make(__func__, _i);
    float *stat = xalloc(n * 4);
    for (int dist = 0; dist < D_COUNT; dist++) {
        for (size_t i = 0; i < n; i++)
            stat[i] = stat_value(&r, dist);
        ranked *order = ref_order(stat, n);
        const size_t ks[] = { 0, 1, n / 3, n / 2, n ? n - 1 : 0, n };
        for (size_t c = 0; c < sizeof ks / sizeof ks[0]; c++)
            if (ks[c] <= n)
                run_topk(stat, n, ks[c], order);
        free(order);
    }
    free(stat);
}
END_TEST

static uint32_t first_k_word(size_t w, size_t k)
{
    if (k >= 32 * (w + 1))
        return ~0u;
    return k <= 32 * w ? 0u : (1u << (k - 32 * w)) - 1u;
}

/* All |stat| equal (1.0; +-1.0; +-0.0): the lowest-index k win. */
START_TEST(test_topk_all_equal)
{
    size_t n = s_sizes[_i], k = n / 3, nw = kern_mask_words(n);
    size_t sb = kern_topk_scratch_bytes(n);
    rng r = rng_make(__func__, _i);
    float *stat = xalloc(n * 4);
    for (int kind = 0; kind < 3; kind++) {
        for (size_t i = 0; i < n; i++) {
            float sign = (kind && (rng_u32(&r) & 1u)) ? -1.0f : 1.0f;
            stat[i] = sign * (kind == 2 ? 0.0f : 1.0f);
        }
        uint32_t *mask = galloc(nw * 4);
        void *scratch = galloc(sb);
        assert_ok(topk_of(stat, n, k, mask, scratch, sb), "kern_topk_packed", n);
        for (size_t w = 0; w < nw; w++)
            if (mask[w] != first_k_word(w, k))
                ck_abort_msg("all-equal kind %d n=%zu k=%zu: word %zu is 0x%08x, "
                             "want 0x%08x", kind, n, k, w, (unsigned)mask[w],
                             (unsigned)first_k_word(w, k));
        gcheck(mask, "topk mask");
        gcheck(scratch, "topk scratch");
        gfree(mask), gfree(scratch);
    }
    free(stat);
}
END_TEST

/* A gradient rewritten while it is being selected from (a trainer that
 * keeps writing the buffer it posted): the fused top-k reads its input in
 * several passes, and must then fail or give a mask, never write past its
 * scratch (the sanitizer build watches).  The rewrite starts at a different
 * moment in each round, from before the first pass to after the last. */
#define RACE_N (1u << 20)
typedef struct racer {
    float *g;
    long delay_ns;
    volatile int go;
} racer;

static void *rewrite_later(void *arg)
{
    racer *r = arg;
    while (!__atomic_load_n(&r->go, __ATOMIC_ACQUIRE))
        ;
    nanosleep(&(struct timespec){ r->delay_ns / 1000000000L, r->delay_ns % 1000000000L }, NULL);
    for (size_t i = 0; i < RACE_N; i++)
        __atomic_store_n((uint32_t *)(void *)&r->g[i], 0x42c80000u, __ATOMIC_RELAXED); /* 100 */
    return NULL;
}

START_TEST(test_topk_input_changing_underneath)
{
    const size_t k = 10;
    float *g = xalloc(RACE_N * 4), *e = xalloc(RACE_N * 4);
    uint32_t *mask = xalloc(kern_mask_words(RACE_N) * 4);
    size_t sb = kern_topk_scratch_bytes(RACE_N);
    void *scratch = galloc(sb);
    memset(e, 0, RACE_N * 4);
    for (size_t i = 0; i < RACE_N; i++)
        g[i] = i < k ? 100.0f : 1.0f;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_ok(kern_topk_ef(NULL, g, e, RACE_N, 0.0f, 1.0f, k, mask, scratch, sb), "kern_topk_ef",
              RACE_N);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    long call_ns = (t1.tv_sec - t0.tv_sec) * 1000000000L + (t1.tv_nsec - t0.tv_nsec);
    int failed = 0;
    for (int round = 0; round < 16; round++) {
        for (size_t i = 0; i < RACE_N; i++)
            g[i] = i < k ? 100.0f : 1.0f;
        racer r = { g, call_ns * round / 12, 0 };
        pthread_t th;
        ck_assert_int_eq(pthread_create(&th, NULL, rewrite_later, &r), 0);
        __atomic_store_n(&r.go, 1, __ATOMIC_RELEASE);
        scape_rc rc = kern_topk_ef(NULL, g, e, RACE_N, 0.0f, 1.0f, k, mask, scratch, sb);
        ck_assert_int_eq(pthread_join(th, NULL), 0);
        ck_assert_msg(rc == SCAPE_OK || rc == SCAPE_INVALID, "round %d: rc %d", round, rc);
        if (rc == SCAPE_INVALID) {
            ck_assert_msg(strstr(scape_last_error(), "changed"), "%s", scape_last_error());
            failed++;
        }
        gcheck(scratch, "topk scratch");
    }
    fprintf(stderr, "topk_input_changing_underneath: %d of 16 rounds noticed the change\n",
            failed);
    free(g), free(e), free(mask), gfree(scratch);
}
END_TEST

/* A hand-ranked segment: NaN > +-inf (tied) > +-2 (tied) > 1 > +-0 (tied). */
START_TEST(test_topk_crafted)
{
    const float stat[8] = { 1.0f, -INFINITY, NAN, 2.0f, -0.0f, INFINITY, -2.0f, 0.0f };
    static const uint32_t want[9] = { 0x00, 0x04, 0x06, 0x26, 0x2e,
                                      0x6e, 0x6f, 0x7f, 0xff };
    for (size_t k = 0; k <= 8; k++) {
        uint32_t *mask = galloc(4);
        void *scratch = galloc(kern_topk_scratch_bytes(8));
        assert_ok(topk_of(stat, 8, k, mask, scratch, kern_topk_scratch_bytes(8)),
                  "kern_topk_packed", 8);
        ck_assert_msg(mask[0] == want[k], "k=%zu: mask 0x%08x, want 0x%08x", k,
                      (unsigned)mask[0], (unsigned)want[k]);
        gcheck(mask, "topk mask");
        gfree(mask), gfree(scratch);
    }
}
END_TEST

/* ---- mask helpers ------------------------------------------------------- */

START_TEST(test_mask_popcount)
{
    size_t n = s_sizes[_i];
    rng r = rng_make(__func__, _i);
    for (int kind = 0; kind < MK_COUNT; kind++) {
        uint32_t *mask = rand_mask(&r, n, kind);
        size_t count = POISON_COUNT;
        assert_ok(kern_mask_popcount(mask, n, &count), "kern_mask_popcount", n);
        ck_assert_uint_eq(count, ref_popcount(mask, n));
        free(mask);
    }
}
END_TEST

static void compact_case(rng *r, size_t n, int kind)
{
    float *dense = rand_f32(r, n);
    uint32_t *mask = rand_mask(r, n, kind);
    size_t k = ref_popcount(mask, n), j = 0, k_out = POISON_COUNT;
    float *want = xalloc(k * 4), *packed = galloc(k * 4);
    for (size_t i = 0; i < n; i++)
        if (bit(mask, i))
            want[j++] = dense[i];
    assert_ok(kern_mask_compact_dt(dense, mask, n, packed, KERN_F32, &k_out),
              "kern_mask_compact_dt", n);
    ck_assert_uint_eq(k_out, k);
    assert_f32_eq(packed, want, k, "compact");
    gcheck(packed, "compact");
    free(dense), free(mask), free(want), gfree(packed);
}

START_TEST(test_mask_compact)
{
    rng r = rng_make(__func__, _i);
    for (int kind = 0; kind < MK_COUNT; kind++)
        compact_case(&r, s_sizes[_i], kind);
}
END_TEST

/* dense starts with random old values; clear positions must keep them. */
static void expand_case(rng *r, size_t n, int kind, kern_dtype dt)
{
    size_t es = kern_dtype_size(dt), j = 0;
    uint32_t *mask = rand_mask(r, n, kind);
    size_t k = ref_popcount(mask, n);
    float *packed = rand_f32(r, k);
    unsigned char *dense = galloc(n * es);
    for (size_t b = 0; b < n * es; b++)
        dense[b] = (unsigned char)rng_u32(r);
    unsigned char *want = dup_bytes(dense, n * es);
    for (size_t i = 0; i < n; i++) {
        if (!bit(mask, i))
            continue;
        uint16_t h = ref_bf16(f2u(packed[j]));
        memcpy(want + i * es, dt == KERN_F32 ? (void *)&packed[j] : (void *)&h, es);
        j++;
    }
    assert_ok(kern_mask_expand_dt(packed, KERN_F32, mask, n, dense, dt), "kern_mask_expand_dt",
              n);
    if (dt == KERN_F32)
        assert_f32_eq((const float *)dense, (const float *)want, n, "expand f32");
    else
        assert_u16_eq((const uint16_t *)dense, (const uint16_t *)want, n, "expand bf16");
    gcheck(dense, "expand");
    free(mask), free(packed), gfree(dense), free(want);
}

START_TEST(test_mask_expand)
{
    rng r = rng_make(__func__, _i);
    for (int kind = 0; kind < MK_COUNT; kind++) {
        expand_case(&r, s_sizes[_i], kind, KERN_F32);
        expand_case(&r, s_sizes[_i], kind, KERN_BF16);
    }
}
END_TEST

/* gather_values: delta.  compact: the j-th set bit's change d, the fp32
 * difference theta - old rounded to nearest even bf16 (ref_bf16), goes to
 * packed[j], and theta becomes old + d; expand adds d to what dense holds.
 * Old values near theta, as a step's are (and some equal, d = 0). */
static void delta_case(rng *r, size_t n, int kind)
{
    uint32_t *mask = rand_mask(r, n, kind);
    size_t k = ref_popcount(mask, n), j = 0, k_out = POISON_COUNT;
    float *old = rand_f32(r, n), *theta = xalloc(n * 4), *want_th = xalloc(n * 4);
    float *held = xalloc(n * 4), *want_held = xalloc(n * 4);
    uint16_t *want = xalloc(k * 2 + 2), *packed = galloc(k * 2);
    for (size_t i = 0; i < n; i++) {
        float step = u2f(f2u(old[i]) ^ (rng_u32(r) & 0x007fffffu)) * 1e-3f;
        theta[i] = i % 7 == 3 ? old[i] : old[i] - step;
        want_th[i] = theta[i];
        held[i] = want_held[i] = old[i];
        if (!bit(mask, i))
            continue;
        float diff = theta[i] - old[i];
        want[j] = ref_bf16(f2u(diff));
        want_th[i] = want_held[i] = old[i] + u2f((uint32_t)want[j] << 16);
        j++;
    }
    assert_ok(kern_mask_compact_delta(theta, old, mask, n, packed, &k_out),
              "kern_mask_compact_delta", n);
    ck_assert_uint_eq(k_out, k);
    assert_u16_eq(packed, want, k, "compact delta");
    assert_f32_eq(theta, want_th, n, "compact delta: theta");
    gcheck(packed, "compact delta");
    /* every trainer holding old gets the owner's new value, bit for bit */
    assert_ok(kern_mask_expand_delta(packed, mask, n, held), "kern_mask_expand_delta", n);
    assert_f32_eq(held, want_held, n, "expand delta");
    free(mask), free(old), free(theta), free(want_th), free(held), free(want_held), free(want);
    gfree(packed);
}

START_TEST(test_mask_delta)
{
    rng r = rng_make(__func__, _i);
    for (int kind = 0; kind < MK_COUNT; kind++)
        delta_case(&r, s_sizes[_i], kind);
}
END_TEST

/* ---- bf16 conversion ---------------------------------------------------- */

static const struct { uint32_t f; uint16_t b; } s_bf16_cases[] = {
    { 0x3f800000u, 0x3f80u }, /* 1.0, exact */
    { 0x3f808000u, 0x3f80u }, /* halfway, even LSB: down */
    { 0x3f818000u, 0x3f82u }, /* halfway, odd LSB: up */
    { 0x3f808001u, 0x3f81u }, /* just above halfway: up */
    { 0x3f807fffu, 0x3f80u }, /* just below halfway: down */
    { 0xbf808000u, 0xbf80u }, /* negative halfway, even */
    { 0xbf818000u, 0xbf82u }, /* negative halfway, odd */
    { 0xbf80c000u, 0xbf81u }, /* negative above halfway */
    { 0x3fff8000u, 0x4000u }, /* carry into the exponent */
    { 0x7f7fffffu, 0x7f80u }, /* FLT_MAX rounds to +inf */
    { 0x7f7f8000u, 0x7f80u }, /* halfway past the largest bf16: +inf */
    { 0x7f7f7fffu, 0x7f7fu }, /* largest finite bf16 stays */
    { 0x7f7e8000u, 0x7f7eu }, /* halfway, even: stays */
    { 0xff7fffffu, 0xff80u }, /* -FLT_MAX rounds to -inf */
    { 0x7f800000u, 0x7f80u }, /* +inf */
    { 0xff800000u, 0xff80u }, /* -inf */
    { 0x00000000u, 0x0000u }, /* +0 */
    { 0x80000000u, 0x8000u }, /* -0 */
    { 0x00000001u, 0x0000u }, /* smallest denormal: to +0 */
    { 0x80000001u, 0x8000u }, /* to -0 */
    { 0x00008000u, 0x0000u }, /* denormal halfway, even */
    { 0x00018000u, 0x0002u }, /* denormal halfway, odd */
    { 0x00010000u, 0x0001u }, /* smallest bf16 denormal, exact */
    { 0x007fffffu, 0x0080u }, /* largest denormal rounds to FLT_MIN */
    { 0x807fffffu, 0x8080u },
    { 0x00800000u, 0x0080u }, /* FLT_MIN, exact */
};
#define NCASES (sizeof s_bf16_cases / sizeof s_bf16_cases[0])

static const uint32_t s_nan_cases[] = {
    0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u,
    0x7fffffffu, 0xffffffffu, 0x7fbfffffu, 0x7f80ffffu,
};
#define NNANS (sizeof s_nan_cases / sizeof s_nan_cases[0])

/* Convert through kern_f32_to_bf16 or through a full-mask bf16 expand. */
static void convert(const uint32_t *bits, size_t n, uint16_t *dst, int via_expand)
{
    float *src = dup_bytes(bits, n * 4);
    uint32_t mask[2] = { ~0u, ~0u };
    ck_assert_uint_le(n, 64);
    if (via_expand)
        assert_ok(kern_mask_expand_dt(src, KERN_F32, mask, n, dst, KERN_BF16),
                  "kern_mask_expand_dt", n);
    else
        assert_ok(kern_f32_to_bf16(src, dst, n), "kern_f32_to_bf16", n);
    free(src);
}

START_TEST(test_bf16_crafted)
{
    uint32_t in[NCASES + NNANS];
    for (size_t i = 0; i < NCASES; i++) {
        in[i] = s_bf16_cases[i].f;
        ck_assert_uint_eq(ref_bf16(in[i]), s_bf16_cases[i].b); /* the reference */
    }
    memcpy(in + NCASES, s_nan_cases, sizeof s_nan_cases);
    for (int via = 0; via < 2; via++) {
        uint16_t *out = galloc(sizeof in / 2);
        convert(in, NCASES + NNANS, out, via);
        for (size_t i = 0; i < NCASES; i++)
            ck_assert_msg(out[i] == s_bf16_cases[i].b, "%s: 0x%08x -> 0x%04x, want 0x%04x",
                          via ? "expand" : "f32_to_bf16", (unsigned)in[i],
                          (unsigned)out[i], (unsigned)s_bf16_cases[i].b);
        check_bf16(in, out, NCASES + NNANS, via ? "expand" : "f32_to_bf16");
        gcheck(out, "bf16 out");
        gfree(out);
    }
}
END_TEST

/* The owners' rank-order sum of bf16 parts (scape_f_sum_bf16_parts, the
 * formula of kern_cuda_sum_bf16_parts): against the sum written out here in
 * fp32, part after part, and an exact sum where the fp32 one is exact
 * (small integers). */
START_TEST(test_sum_bf16_parts)
{
    enum { N = 1000, P = 5 };
    static uint16_t parts[P * N];
    static float out[N];
    unsigned seed = 7;
    for (size_t i = 0; i < (size_t)P * N; i++) {
        float v = (float)((int)(rand_r(&seed) % 2001) - 1000) * 0.37f;
        parts[i] = kern_bf16_from_f32(v);
    }
    for (unsigned np = 1; np <= P; np++) {
        for (size_t i = 0; i < N / 2; i++)
            out[i] = scape_f_sum_bf16_parts(parts, np, N / 2, i);
        for (size_t i = 0; i < N / 2; i++) {
            float want = kern_f32_from_bf16(parts[i]);
            for (unsigned q = 1; q < np; q++)
                want = want + kern_f32_from_bf16(parts[(size_t)q * (N / 2) + i]);
            ck_assert_msg(memcmp(&want, &out[i], 4) == 0, "parts %u elem %zu: %.9g vs %.9g",
                          np, i, (double)out[i], (double)want);
        }
    }
    for (size_t i = 0; i < (size_t)3 * N; i++)
        parts[i] = kern_bf16_from_f32((float)((int)(i % 255) - 127));
    for (size_t i = 0; i < N; i++)
        out[i] = scape_f_sum_bf16_parts(parts, 3, N, i);
    for (size_t i = 0; i < N; i++)
        ck_assert_float_eq(out[i], (float)((int)(i % 255) - 127 + (int)((N + i) % 255) - 127 +
                                           (int)((2 * N + i) % 255) - 127));
}
END_TEST

/* Every bf16 widens exactly and narrows back to itself (NaN stays NaN). */
START_TEST(test_bf16_exhaustive)
{
    const size_t n = 65536;
    uint16_t *src = xalloc(n * 2), *back = galloc(n * 2);
    float *wide = galloc(n * 4);
    uint32_t *want = xalloc(n * 4);
    for (size_t i = 0; i < n; i++)
        src[i] = (uint16_t)i, want[i] = (uint32_t)i << 16;
    assert_ok(kern_bf16_to_f32(src, wide, n), "kern_bf16_to_f32", n);
    for (size_t i = 0; i < n; i++)
        if (f2u(wide[i]) != want[i])
            ck_abort_msg("bf16_to_f32: 0x%04x -> 0x%08x", (unsigned)i,
                         (unsigned)f2u(wide[i]));
    assert_ok(kern_f32_to_bf16(wide, back, n), "kern_f32_to_bf16", n);
    check_bf16(want, back, n, "round trip");
    for (size_t i = 0; i < n; i++)
        if (!is_nan32(want[i]) && back[i] != src[i])
            ck_abort_msg("round trip 0x%04x -> 0x%04x", (unsigned)src[i], (unsigned)back[i]);
    gcheck(wide, "bf16_to_f32"), gcheck(back, "f32_to_bf16");
    free(src), gfree(back), gfree(wide), free(want);
}
END_TEST

/* Random bit patterns, half of them on or next to a rounding tie. */
START_TEST(test_bf16_random)
{
    static const uint32_t lows[] = { 0x8000u, 0x7fffu, 0x8001u, 0x0000u };
    size_t n = s_sizes[_i];
    rng r = rng_make(__func__, _i);
    uint32_t *bits = xalloc(n * 4);
    uint16_t *h = xalloc(n * 2), *out = galloc(n * 2);
    float *wide = galloc(n * 4);
    for (size_t i = 0; i < n; i++) {
        uint64_t x = rng_next(&r);
        bits[i] = (uint32_t)x;
        if (x & (1ull << 32))
            bits[i] = (bits[i] & 0xffff0000u) | lows[(x >> 33) & 3];
        h[i] = (uint16_t)(x >> 40);
    }
    float *src = dup_bytes(bits, n * 4);
    assert_ok(kern_f32_to_bf16(src, out, n), "kern_f32_to_bf16", n);
    check_bf16(bits, out, n, "f32_to_bf16");
    assert_ok(kern_bf16_to_f32(h, wide, n), "kern_bf16_to_f32", n);
    for (size_t i = 0; i < n; i++)
        if (f2u(wide[i]) != (uint32_t)h[i] << 16)
            ck_abort_msg("bf16_to_f32[%zu]: 0x%04x -> 0x%08x", i, (unsigned)h[i],
                         (unsigned)f2u(wide[i]));
    gcheck(out, "f32_to_bf16"), gcheck(wide, "bf16_to_f32");
    free(bits), free(h), gfree(out), gfree(wide), free(src);
}
END_TEST

/* ---- gradient intake ---------------------------------------------------- */

static void accum_case(rng *r, size_t n, kern_dtype dt, int overwrite)
{
    float *dst = rand_f32_guarded(r, n), *want = xalloc(n * 4);
    void *src = xalloc(n * kern_dtype_size(dt));
    for (size_t i = 0; i < n; i++) {
        float s = rng_float(r);
        if (dt == KERN_BF16) {
            uint16_t b = (uint16_t)(f2u(s) >> 16);
            ((uint16_t *)src)[i] = b;
            s = u2f((uint32_t)b << 16);
        } else {
            ((float *)src)[i] = s;
        }
        want[i] = overwrite ? s : dst[i] + s;
    }
    assert_ok(kern_grad_accum(dst, src, dt, n, overwrite), "kern_grad_accum", n);
    assert_f32_eq(dst, want, n, overwrite ? "grad_accum overwrite" : "grad_accum add");
    gcheck(dst, "grad_accum");
    gfree(dst), free(want), free(src);
}

START_TEST(test_grad_accum)
{
    rng r = rng_make(__func__, _i);
    for (int ow = 0; ow < 2; ow++) {
        accum_case(&r, s_sizes[_i], KERN_F32, ow);
        accum_case(&r, s_sizes[_i], KERN_BF16, ow);
    }
}
END_TEST

/* ---- Adam updates ------------------------------------------------------- */

/* fp32 rounding bound: relative to the sum of the magnitudes of the terms,
 * so cancellation in the result cannot make it fail spuriously. */
#define ADAM_TOL 2e-6
#define ADAM_ABS 1e-30

typedef struct want { double x, scale; } want;

static void check_close(float got, want w, const char *what, size_t i)
{
    double err = fabs((double)got - w.x), tol = ADAM_TOL * w.scale + ADAM_ABS;
    if (!(err <= tol))
        ck_abort_msg("%s[%zu]: got %.9g, want %.9g (error %.3g > %.3g)", what, i,
                     (double)got, w.x, err, tol);
}

typedef struct adam_case {
    size_t n, k;
    float *theta, *m, *v;    /* guarded; updated in place */
    float *theta0, *m0, *v0; /* the inputs, for the reference */
    float *sum;              /* k values, exact size */
    uint32_t *mask;          /* NULL for the dense kernels */
    kern_hyper h;
    float div, lr;
} adam_case;

/* kind < 0: dense (no mask). */
static void adam_init(adam_case *c, rng *r, size_t n, int kind)
{
    c->n = n;
    c->mask = kind < 0 ? NULL : rand_mask(r, n, kind);
    c->k = c->mask ? ref_popcount(c->mask, n) : n;
    c->theta = rand_f32_guarded(r, n);
    c->m = rand_f32_guarded(r, n);
    c->v = rand_f32_guarded(r, n);
    for (size_t i = 0; i < n; i++)
        c->v[i] = fabsf(c->v[i]);
    c->theta0 = dup_bytes(c->theta, n * 4);
    c->m0 = dup_bytes(c->m, n * 4);
    c->v0 = dup_bytes(c->v, n * 4);
    c->sum = rand_f32(r, c->k);
    static const float clips[] = { 0.0f, 1.0f, 0.37f, 1e-3f };
    c->h = (kern_hyper){ 0.9f, 0.95f, 1e-8f, (rng_u32(r) & 1u) ? 0.01f : 0.0f,
                         clips[rng_u32(r) & 3u] };
    c->div = (rng_u32(r) & 1u) ? 3.0f : 1.0f;
    c->lr = (float)(1e-3 * (1.0 + rng_unit(r)));
}

static void adam_free(adam_case *c)
{
    gcheck(c->theta, "theta"), gcheck(c->m, "m"), gcheck(c->v, "v");
    gfree(c->theta), gfree(c->m), gfree(c->v);
    free(c->theta0), free(c->m0), free(c->v0), free(c->sum), free(c->mask);
}

static void check_untouched(const adam_case *c, size_t i)
{
    if (f2u(c->theta[i]) != f2u(c->theta0[i]) || f2u(c->m[i]) != f2u(c->m0[i]) ||
        f2u(c->v[i]) != f2u(c->v0[i]))
        ck_abort_msg("off-mask element %zu of %zu was changed", i, c->n);
}

/* g_hat, scaled by the clipping factor when it is in (0, 1). */
static double clipped(const adam_case *c, float sum)
{
    double g = (double)sum / c->div;
    return c->h.clip > 0.0f && c->h.clip < 1.0f ? g * c->h.clip : g;
}

static void check_adams_at(const adam_case *c, size_t i, float sum)
{
    double b1 = c->h.beta1, b2 = c->h.beta2, m = c->m0[i], th = c->theta0[i];
    double g = clipped(c, sum), mt = b1 * m, gt = (1.0 - b1) * g;
    double b = mt + gt, v = b2 * m * m + (1.0 - b2) * g * g;
    double den = sqrt(v) + c->h.eps;
    double step = c->lr * (b / den + c->h.wd * th);
    double mag = c->lr * ((fabs(mt) + fabs(gt)) / den + c->h.wd * fabs(th));
    check_close(c->m[i], (want){ b, fabs(mt) + fabs(gt) }, "adams m", i);
    check_close(c->theta[i], (want){ th - step, fabs(th) + mag }, "adams theta", i);
    if (f2u(c->v[i]) != f2u(c->v0[i]))
        ck_abort_msg("AdamS wrote v[%zu], which it does not take", i);
}

static void check_adamw_at(const adam_case *c, size_t i, float sum, uint64_t t)
{
    double b1 = c->h.beta1, b2 = c->h.beta2, th = c->theta0[i];
    double bc1 = 1.0 - pow(b1, (double)t), bc2 = 1.0 - pow(b2, (double)t);
    double g = clipped(c, sum), mt = b1 * c->m0[i], gt = (1.0 - b1) * g;
    double m = mt + gt, v = b2 * c->v0[i] + (1.0 - b2) * g * g;
    double den = sqrt(v / bc2) + c->h.eps;
    double step = c->lr * ((m / bc1) / den + c->h.wd * th);
    double mag = c->lr * ((fabs(mt) + fabs(gt)) / bc1 / den + c->h.wd * fabs(th));
    check_close(c->m[i], (want){ m, fabs(mt) + fabs(gt) }, "adamw m", i);
    check_close(c->v[i], (want){ v, v }, "adamw v", i);
    check_close(c->theta[i], (want){ th - step, fabs(th) + mag }, "adamw theta", i);
}

/* t == 0: AdamS; otherwise AdamW at step t. */
static void verify_adam(const adam_case *c, uint64_t t)
{
    size_t j = 0;
    for (size_t i = 0; i < c->n; i++) {
        if (c->mask && !bit(c->mask, i)) {
            check_untouched(c, i);
            continue;
        }
        if (t == 0)
            check_adams_at(c, i, c->sum[j++]);
        else
            check_adamw_at(c, i, c->sum[j++], t);
    }
}

START_TEST(test_adams_masked)
{
    size_t n = s_sizes[_i];
    rng r = rng_make(__func__, _i);
    for (int kind = 0; kind < MK_COUNT; kind++) {
        adam_case c;
        adam_init(&c, &r, n, kind);
        assert_ok(kern_adams_masked(c.theta, c.m, c.sum, c.div, c.mask, n, &c.h, c.lr),
                  "kern_adams_masked", n);
        verify_adam(&c, 0);
        adam_free(&c);
    }
}
END_TEST

START_TEST(test_adams_dense)
{
    size_t n = s_sizes[_i];
    rng r = rng_make(__func__, _i);
    adam_case c;
    adam_init(&c, &r, n, -1);
    assert_ok(kern_adams_dense(c.theta, c.m, c.sum, c.div, n, &c.h, c.lr),
              "kern_adams_dense", n);
    verify_adam(&c, 0);
    adam_free(&c);
}
END_TEST

static const uint64_t s_steps[] = { 1, 2, 1000 };

START_TEST(test_adamw_dense)
{
    size_t n = s_sizes[_i];
    rng r = rng_make(__func__, _i);
    for (size_t s = 0; s < 3; s++) {
        adam_case c;
        adam_init(&c, &r, n, -1);
        assert_ok(kern_adamw_dense(c.theta, c.m, c.v, c.sum, c.div, n, &c.h, c.lr,
                                   s_steps[s]),
                  "kern_adamw_dense", n);
        verify_adam(&c, s_steps[s]);
        adam_free(&c);
    }
}
END_TEST

START_TEST(test_adamw_masked)
{
    size_t n = s_sizes[_i];
    rng r = rng_make(__func__, _i);
    for (size_t s = 0; s < 3; s++)
        for (int kind = 0; kind < MK_COUNT; kind++) {
            adam_case c;
            adam_init(&c, &r, n, kind);
            assert_ok(kern_adamw_masked(c.theta, c.m, c.v, c.sum, c.div, c.mask, n,
                                        &c.h, c.lr, s_steps[s]),
                      "kern_adamw_masked", n);
            verify_adam(&c, s_steps[s]);
            adam_free(&c);
        }
}
END_TEST

/* A full mask and the dense kernel compute the same bits. */
START_TEST(test_adam_masked_dense_agree)
{
    size_t n = s_sizes[_i];
    rng r = rng_make(__func__, _i);
    adam_case c;
    adam_init(&c, &r, n, MK_ALL);
    float *th = dup_bytes(c.theta0, n * 4), *m = dup_bytes(c.m0, n * 4);
    float *v = dup_bytes(c.v0, n * 4);
    assert_ok(kern_adams_masked(c.theta, c.m, c.sum, c.div, c.mask, n, &c.h, c.lr),
              "kern_adams_masked", n);
    assert_ok(kern_adams_dense(th, m, c.sum, c.div, n, &c.h, c.lr), "kern_adams_dense", n);
    assert_f32_eq(th, c.theta, n, "adams theta, dense vs masked");
    assert_f32_eq(m, c.m, n, "adams m, dense vs masked");
    assert_ok(kern_adamw_masked(c.theta, c.m, c.v, c.sum, c.div, c.mask, n, &c.h, c.lr, 7),
              "kern_adamw_masked", n);
    assert_ok(kern_adamw_dense(th, m, v, c.sum, c.div, n, &c.h, c.lr, 7),
              "kern_adamw_dense", n);
    assert_f32_eq(th, c.theta, n, "adamw theta, dense vs masked");
    assert_f32_eq(m, c.m, n, "adamw m, dense vs masked");
    assert_f32_eq(v, c.v, n, "adamw v, dense vs masked");
    free(th), free(m), free(v);
    adam_free(&c);
}
END_TEST

/* kern_update, the executors' entry, by variant: each against its
 * reference above, masked (every mask kind) and dense; v NULL for AdamS. */
START_TEST(test_update_variants)
{
    size_t n = s_sizes[_i];
    rng r = rng_make(__func__, _i);
    for (int kind = -1; kind < MK_COUNT; kind++)
        for (size_t s = 0; s < 4; s++) {
            uint64_t t = s ? s_steps[s - 1] : 0; /* 0: AdamS, as verify_adam */
            adam_case c;
            adam_init(&c, &r, n, kind);
            assert_ok(kern_update(t ? SCAPE_UPD_ADAMW : SCAPE_UPD_ADAMS, c.theta, c.m,
                                  t ? c.v : NULL, c.sum, c.div, c.mask, n, &c.h, c.lr,
                                  t ? t : 1),
                      "kern_update", n);
            verify_adam(&c, t);
            adam_free(&c);
        }
}
END_TEST

/* ---- refused calls ------------------------------------------------------ */

#define BN 33 /* fixture segment: one full word and one partial word */

/* Every buffer a refused call could touch, in one block that is compared
 * bytewise before and after the call. */
typedef struct fx {
    float g[BN], e[BN], m[BN], v[BN], theta[BN], stat[BN], sum[BN], out[BN];
    _Alignas(16) uint16_t h16[BN + 1];
    uint32_t mask[2], mask2[2], prefix[3], scratch[2048 + 2 * BN];
    size_t count;
} fx;

static const kern_hyper s_h = { 0.9f, 0.95f, 1e-8f, 0.0f, 0.0f };

static void fx_init(fx *f, const char *name, int i)
{
    rng r = rng_make(name, i);
    float *const fl[] = { f->g, f->e, f->m, f->v, f->theta, f->stat, f->sum, f->out };
    memset(f, 0, sizeof *f);
    for (size_t a = 0; a < sizeof fl / sizeof fl[0]; a++)
        fill_f32(&r, fl[a], BN);
    for (size_t j = 0; j < BN; j++) {
        f->v[j] = fabsf(f->v[j]);
        f->h16[j] = (uint16_t)(f2u(f->g[j]) >> 16);
        f->scratch[j] = rng_u32(&r);
    }
    for (size_t w = 0; w < 2; w++) {
        f->mask[w] = mask_word(&r, MK_MIXED);
        f->mask2[w] = rng_u32(&r);
    }
    f->mask[0] |= 0xffu; /* >= 8 bits, so the overlap cases below do overlap */
    f->count = POISON_COUNT;
}

static void refused(scape_rc rc, const fx *f, const fx *before, const char *fn,
                    const char *call)
{
    ck_assert_msg(rc == SCAPE_INVALID, "%s: rc %s, want INVALID", call,
                  scape_rc_name(rc));
    ck_assert_msg(strstr(scape_last_error(), fn) != NULL,
                  "%s: last error \"%s\" does not name %s", call,
                  scape_last_error(), fn);
    ck_assert_msg(memcmp(f, before, sizeof *f) == 0,
                  "%s: a refused call changed memory", call);
}

/* Run `call` on fixture f; it must be refused by function fn, leave a
 * message naming fn and change nothing. */
#define REFUSE(f, fn, call)                                                    \
    do {                                                                       \
        fx before_;                                                            \
        memcpy(&before_, (f), sizeof before_);                                 \
        scape_clear_error();                                                   \
        scape_rc rc_ = (call);                                                 \
        refused(rc_, (f), &before_, fn, #call);                                \
    } while (0)

/* Loop index 0: n = 0; 1: n = BN.  Valid calls close each list, showing that
 * the refusals came from the null alone. */
START_TEST(test_null_pack_stat)
{
    size_t n = _i ? BN : 0;
    fx f;
    fx_init(&f, __func__, _i);
    REFUSE(&f, "kern_pack_ef", kern_pack_ef(NULL, f.e, f.mask, n, f.out, &f.count));
    REFUSE(&f, "kern_pack_ef", kern_pack_ef(f.g, NULL, f.mask, n, f.out, &f.count));
    REFUSE(&f, "kern_pack_ef", kern_pack_ef(f.g, f.e, NULL, n, f.out, &f.count));
    REFUSE(&f, "kern_pack_ef", kern_pack_ef(f.g, f.e, f.mask, n, NULL, &f.count));
    REFUSE(&f, "kern_pack_ef", kern_pack_ef(f.g, f.e, f.mask, n, f.out, NULL));
    assert_ok(kern_pack_ef(f.g, f.e, f.mask, n, f.out, &f.count), "kern_pack_ef", n);
}
END_TEST

START_TEST(test_null_topk_masks)
{
    size_t n = _i ? BN : 0;
    fx f;
    fx_init(&f, __func__, _i);
    size_t sb = sizeof f.scratch;
    REFUSE(&f, "kern_topk_packed", topk_of(NULL, n, 0, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_packed", topk_of(f.stat, n, 0, NULL, f.scratch, sb));
    REFUSE(&f, "kern_topk_packed", topk_of(f.stat, n, 0, f.mask, NULL, sb));
    REFUSE(&f, "kern_mask_popcount", kern_mask_popcount(NULL, n, &f.count));
    REFUSE(&f, "kern_mask_popcount", kern_mask_popcount(f.mask, n, NULL));
    REFUSE(&f, "kern_mask_compact_dt",
           kern_mask_compact_dt(NULL, f.mask, n, f.out, KERN_F32, &f.count));
    REFUSE(&f, "kern_mask_compact_dt",
           kern_mask_compact_dt(f.g, NULL, n, f.out, KERN_F32, &f.count));
    REFUSE(&f, "kern_mask_compact_dt",
           kern_mask_compact_dt(f.g, f.mask, n, NULL, KERN_F32, &f.count));
    REFUSE(&f, "kern_mask_compact_dt",
           kern_mask_compact_dt(f.g, f.mask, n, f.out, KERN_F32, NULL));
    REFUSE(&f, "kern_mask_expand_dt",
           kern_mask_expand_dt(NULL, KERN_F32, f.mask, n, f.out, KERN_F32));
    REFUSE(&f, "kern_mask_expand_dt",
           kern_mask_expand_dt(f.g, KERN_F32, NULL, n, f.out, KERN_F32));
    REFUSE(&f, "kern_mask_expand_dt",
           kern_mask_expand_dt(f.g, KERN_F32, f.mask, n, NULL, KERN_BF16));
    assert_ok(topk_of(f.stat, n, 0, f.mask, f.scratch, sb), "kern_topk_packed", n);
    assert_ok(kern_mask_popcount(f.mask, n, &f.count), "kern_mask_popcount", n);
    assert_ok(kern_mask_compact_dt(f.g, f.mask, n, f.out, KERN_F32, &f.count),
              "kern_mask_compact_dt", n);
    assert_ok(kern_mask_expand_dt(f.g, KERN_F32, f.mask, n, f.out, KERN_F32),
              "kern_mask_expand_dt", n);
}
END_TEST

START_TEST(test_null_adam)
{
    size_t n = _i ? BN : 0;
    const kern_hyper *h = &s_h;
    fx f;
    fx_init(&f, __func__, _i);
    REFUSE(&f, "kern_adams_masked", kern_adams_masked(NULL, f.m, f.sum, 1, f.mask, n, h, 1e-3f));
    REFUSE(&f, "kern_adams_masked", kern_adams_masked(f.theta, NULL, f.sum, 1, f.mask, n, h, 1e-3f));
    REFUSE(&f, "kern_adams_masked", kern_adams_masked(f.theta, f.m, NULL, 1, f.mask, n, h, 1e-3f));
    REFUSE(&f, "kern_adams_masked", kern_adams_masked(f.theta, f.m, f.sum, 1, NULL, n, h, 1e-3f));
    REFUSE(&f, "kern_adams_masked", kern_adams_masked(f.theta, f.m, f.sum, 1, f.mask, n, NULL, 1e-3f));
    REFUSE(&f, "kern_adams_dense", kern_adams_dense(NULL, f.m, f.sum, 1, n, h, 1e-3f));
    REFUSE(&f, "kern_adams_dense", kern_adams_dense(f.theta, NULL, f.sum, 1, n, h, 1e-3f));
    REFUSE(&f, "kern_adams_dense", kern_adams_dense(f.theta, f.m, NULL, 1, n, h, 1e-3f));
    REFUSE(&f, "kern_adams_dense", kern_adams_dense(f.theta, f.m, f.sum, 1, n, NULL, 1e-3f));
    REFUSE(&f, "kern_adamw_dense", kern_adamw_dense(NULL, f.m, f.v, f.sum, 1, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_dense", kern_adamw_dense(f.theta, NULL, f.v, f.sum, 1, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_dense", kern_adamw_dense(f.theta, f.m, NULL, f.sum, 1, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_dense", kern_adamw_dense(f.theta, f.m, f.v, NULL, 1, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_dense", kern_adamw_dense(f.theta, f.m, f.v, f.sum, 1, n, NULL, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_masked",
           kern_adamw_masked(NULL, f.m, f.v, f.sum, 1, f.mask, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_masked",
           kern_adamw_masked(f.theta, NULL, f.v, f.sum, 1, f.mask, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_masked",
           kern_adamw_masked(f.theta, f.m, NULL, f.sum, 1, f.mask, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_masked",
           kern_adamw_masked(f.theta, f.m, f.v, NULL, 1, f.mask, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_masked",
           kern_adamw_masked(f.theta, f.m, f.v, f.sum, 1, NULL, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_masked",
           kern_adamw_masked(f.theta, f.m, f.v, f.sum, 1, f.mask, n, NULL, 1e-3f, 1));
    assert_ok(kern_adams_masked(f.theta, f.m, f.sum, 1, f.mask, n, h, 1e-3f), "adams_masked", n);
    REFUSE(&f, "kern_update", kern_update(-1, f.theta, f.m, f.v, f.sum, 1, f.mask, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_update",
           kern_update(SCAPE_UPD_COUNT, f.theta, f.m, f.v, f.sum, 1, f.mask, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_update",
           kern_update(SCAPE_UPD_ADAMW, f.theta, f.m, NULL, f.sum, 1, NULL, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_update",
           kern_update(SCAPE_UPD_ADAMS, f.theta, NULL, NULL, f.sum, 1, f.mask, n, h, 1e-3f, 1));
    REFUSE(&f, "kern_update",
           kern_update(SCAPE_UPD_ADAMS, f.theta, f.m, NULL, f.sum, 1, f.mask, n, h, 1e-3f, 0));
    assert_ok(kern_update(SCAPE_UPD_ADAMS, f.theta, f.m, NULL, f.sum, 1, f.mask, n, h, 1e-3f, 1),
              "kern_update", n);
    assert_ok(kern_adams_dense(f.theta, f.m, f.sum, 1, n, h, 1e-3f), "adams_dense", n);
    assert_ok(kern_adamw_dense(f.theta, f.m, f.v, f.sum, 1, n, h, 1e-3f, 1), "adamw_dense", n);
    assert_ok(kern_adamw_masked(f.theta, f.m, f.v, f.sum, 1, f.mask, n, h, 1e-3f, 1),
              "adamw_masked", n);
}
END_TEST

START_TEST(test_null_convert)
{
    size_t n = _i ? BN : 0;
    fx f;
    fx_init(&f, __func__, _i);
    REFUSE(&f, "kern_grad_accum", kern_grad_accum(NULL, f.g, KERN_F32, n, 0));
    REFUSE(&f, "kern_grad_accum", kern_grad_accum(f.e, NULL, KERN_F32, n, 1));
    REFUSE(&f, "kern_grad_accum", kern_grad_accum(NULL, f.h16, KERN_BF16, n, 0));
    REFUSE(&f, "kern_grad_accum", kern_grad_accum(f.e, NULL, KERN_BF16, n, 1));
    REFUSE(&f, "kern_f32_to_bf16", kern_f32_to_bf16(NULL, f.h16, n));
    REFUSE(&f, "kern_f32_to_bf16", kern_f32_to_bf16(f.g, NULL, n));
    REFUSE(&f, "kern_bf16_to_f32", kern_bf16_to_f32(NULL, f.out, n));
    REFUSE(&f, "kern_bf16_to_f32", kern_bf16_to_f32(f.h16, NULL, n));
    assert_ok(kern_grad_accum(f.e, f.g, KERN_F32, n, 0), "kern_grad_accum", n);
    assert_ok(kern_grad_accum(f.e, f.h16, KERN_BF16, n, 0), "kern_grad_accum", n);
    assert_ok(kern_f32_to_bf16(f.g, f.h16, n), "kern_f32_to_bf16", n);
    assert_ok(kern_bf16_to_f32(f.h16, f.out, n), "kern_bf16_to_f32", n);
}
END_TEST

START_TEST(test_bad_pack_stat)
{
    fx f;
    fx_init(&f, __func__, 0);
    REFUSE(&f, "kern_pack_ef", kern_pack_ef(f.g, f.e, f.mask, BN, f.e + 1, &f.count));
    REFUSE(&f, "kern_pack_ef", kern_pack_ef(f.e, f.e, f.mask, BN, f.out, &f.count));
    REFUSE(&f, "kern_pack_ef", kern_pack_ef(f.g, f.e, f.mask, BN, f.g, &f.count));
}
END_TEST

START_TEST(test_bad_topk)
{
    size_t sb = kern_topk_scratch_bytes(BN);
    fx f;
    fx_init(&f, __func__, 0);
    ck_assert_uint_le(sb, sizeof f.scratch);
    REFUSE(&f, "kern_topk_packed", topk_of(f.stat, BN, BN + 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_packed", topk_of(f.stat, 0, 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_packed", topk_of(f.stat, BN, 3, f.mask, f.scratch, sb - 1));
    REFUSE(&f, "kern_topk_packed",
           topk_of(f.stat, BN, 3, (uint32_t *)(void *)f.stat, f.scratch, sb));
    REFUSE(&f, "kern_topk_packed", topk_of(f.stat, BN, 3, f.scratch, f.scratch, sb));
}
END_TEST

START_TEST(test_bad_masks)
{
    fx f;
    fx_init(&f, __func__, 0);
    REFUSE(&f, "kern_mask_compact_dt",
           kern_mask_compact_dt(f.g, f.mask, BN, f.g, KERN_F32, &f.count));
    REFUSE(&f, "kern_mask_compact_dt",
           kern_mask_compact_dt(f.g, f.mask, BN, (float *)(void *)f.mask, KERN_F32, &f.count));
    REFUSE(&f, "kern_mask_expand_dt",
           kern_mask_expand_dt(f.g, KERN_F32, f.mask, BN, f.out, (kern_dtype)2));
    REFUSE(&f, "kern_mask_expand_dt",
           kern_mask_expand_dt(f.g, KERN_F32, f.mask, BN, f.out, (kern_dtype)-1));
    REFUSE(&f, "kern_mask_expand_dt",
           kern_mask_expand_dt(f.g, KERN_F32, f.mask, BN, f.g, KERN_F32));
    REFUSE(&f, "kern_mask_expand_dt",
           kern_mask_expand_dt(f.g, KERN_F32, f.mask, BN, f.g + 1, KERN_BF16));
    REFUSE(&f, "kern_mask_expand_dt",
           kern_mask_expand_dt(f.g, KERN_F32, f.mask, BN, f.mask, KERN_F32));
}
END_TEST

/* The four Adam kernels behind one signature, on the fixture. */
typedef scape_rc (*adam_fn)(fx *f, const kern_hyper *h, float div, float lr, uint64_t t);

static scape_rc call_adams_masked(fx *f, const kern_hyper *h, float div, float lr,
                                  uint64_t t)
{
    (void)t;
    return kern_adams_masked(f->theta, f->m, f->sum, div, f->mask, BN, h, lr);
}

static scape_rc call_adams_dense(fx *f, const kern_hyper *h, float div, float lr,
                                 uint64_t t)
{
    (void)t;
    return kern_adams_dense(f->theta, f->m, f->sum, div, BN, h, lr);
}

static scape_rc call_adamw_dense(fx *f, const kern_hyper *h, float div, float lr,
                                 uint64_t t)
{
    return kern_adamw_dense(f->theta, f->m, f->v, f->sum, div, BN, h, lr, t);
}

static scape_rc call_adamw_masked(fx *f, const kern_hyper *h, float div, float lr,
                                  uint64_t t)
{
    return kern_adamw_masked(f->theta, f->m, f->v, f->sum, div, f->mask, BN, h, lr, t);
}

static const kern_hyper s_bad_hyper[] = {
    { 1.0f, 0.95f, 1e-8f, 0.0f, 0.0f },  { -0.1f, 0.95f, 1e-8f, 0.0f, 0.0f },
    { NAN, 0.95f, 1e-8f, 0.0f, 0.0f },   { 0.9f, 1.0f, 1e-8f, 0.0f, 0.0f },
    { 0.9f, 1.5f, 1e-8f, 0.0f, 0.0f },   { 0.9f, NAN, 1e-8f, 0.0f, 0.0f },
    { 0.9f, 0.95f, 0.0f, 0.0f, 0.0f },   { 0.9f, 0.95f, -1e-8f, 0.0f, 0.0f },
    { 0.9f, 0.95f, NAN, 0.0f, 0.0f },    { 0.9f, 0.95f, 1e-8f, -0.01f, 0.0f },
    { 0.9f, 0.95f, 1e-8f, NAN, 0.0f },   { 0.9f, 0.95f, 1e-8f, INFINITY, 0.0f },
    { 0.9f, 0.95f, 1e-8f, 0.0f, -0.5f }, { 0.9f, 0.95f, 1e-8f, 0.0f, 1.5f },
    { 0.9f, 0.95f, 1e-8f, 0.0f, NAN },
};
static const float s_bad_div[] = { 0.0f, -0.0f, -1.0f, NAN };
static const float s_bad_lr[] = { -1e-3f, NAN, -INFINITY };

static void refuse_adam(fx *f, adam_fn call, const char *fn, const kern_hyper *h,
                        float div, float lr, uint64_t t, const char *what, size_t i)
{
    char label[96];
    fx before;
    snprintf(label, sizeof label, "%s: %s #%zu", fn, what, i);
    memcpy(&before, f, sizeof before);
    scape_clear_error();
    refused(call(f, h, div, lr, t), f, &before, fn, label);
}

/* Bad hyper-parameters, divisors and learning rates, then one valid call. */
static void refuse_adam_scalars(adam_fn call, const char *fn, int i)
{
    fx f;
    fx_init(&f, fn, i);
    for (size_t j = 0; j < sizeof s_bad_hyper / sizeof s_bad_hyper[0]; j++)
        refuse_adam(&f, call, fn, &s_bad_hyper[j], 1.0f, 1e-3f, 1, "hyper", j);
    for (size_t j = 0; j < sizeof s_bad_div / sizeof s_bad_div[0]; j++)
        refuse_adam(&f, call, fn, &s_h, s_bad_div[j], 1e-3f, 1, "div", j);
    for (size_t j = 0; j < sizeof s_bad_lr / sizeof s_bad_lr[0]; j++)
        refuse_adam(&f, call, fn, &s_h, 1.0f, s_bad_lr[j], 1, "lr", j);
    assert_ok(call(&f, &s_h, 2.0f, 0.0f, 1), fn, BN);
}

START_TEST(test_bad_adam_scalars)
{
    refuse_adam_scalars(call_adams_masked, "kern_adams_masked", _i);
    refuse_adam_scalars(call_adams_dense, "kern_adams_dense", _i);
    refuse_adam_scalars(call_adamw_dense, "kern_adamw_dense", _i);
    refuse_adam_scalars(call_adamw_masked, "kern_adamw_masked", _i);
}
END_TEST

START_TEST(test_bad_adam_buffers)
{
    const kern_hyper *h = &s_h;
    fx f;
    fx_init(&f, __func__, 0);
    const uint32_t *mt = (const uint32_t *)(const void *)f.theta; /* mask on theta */
    REFUSE(&f, "kern_adams_masked", kern_adams_masked(f.theta, f.theta, f.sum, 1, f.mask, BN, h, 1e-3f));
    REFUSE(&f, "kern_adams_masked", kern_adams_masked(f.theta, f.m, f.theta, 1, f.mask, BN, h, 1e-3f));
    REFUSE(&f, "kern_adams_masked", kern_adams_masked(f.theta, f.m, f.sum, 1, mt, BN, h, 1e-3f));
    REFUSE(&f, "kern_adams_dense", kern_adams_dense(f.theta, f.theta, f.sum, 1, BN, h, 1e-3f));
    REFUSE(&f, "kern_adams_dense", kern_adams_dense(f.theta, f.m, f.m + 5, 1, BN, h, 1e-3f));
    REFUSE(&f, "kern_adamw_dense", kern_adamw_dense(f.theta, f.m, f.m, f.sum, 1, BN, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_dense", kern_adamw_dense(f.theta, f.m, f.theta, f.sum, 1, BN, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_dense", kern_adamw_dense(f.theta, f.theta, f.v, f.sum, 1, BN, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_dense", kern_adamw_dense(f.theta, f.m, f.v, f.v, 1, BN, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_dense", kern_adamw_dense(f.theta, f.m, f.v, f.sum, 1, BN, h, 1e-3f, 0));
    REFUSE(&f, "kern_adamw_masked",
           kern_adamw_masked(f.theta, f.m, f.m, f.sum, 1, f.mask, BN, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_masked",
           kern_adamw_masked(f.theta, f.m, f.theta, f.sum, 1, f.mask, BN, h, 1e-3f, 1));
    REFUSE(&f, "kern_adamw_masked",
           kern_adamw_masked(f.theta, f.m, f.v, f.sum, 1, f.mask, BN, h, 1e-3f, 0));
}
END_TEST

START_TEST(test_bad_convert)
{
    fx f;
    fx_init(&f, __func__, 0);
    REFUSE(&f, "kern_grad_accum", kern_grad_accum(f.e, f.g, (kern_dtype)2, BN, 0));
    REFUSE(&f, "kern_grad_accum", kern_grad_accum(f.e, f.g, (kern_dtype)-1, BN, 1));
    REFUSE(&f, "kern_grad_accum", kern_grad_accum(f.g, f.g, KERN_F32, BN, 0));
    REFUSE(&f, "kern_grad_accum", kern_grad_accum(f.g, f.g + 16, KERN_BF16, BN, 0));
    REFUSE(&f, "kern_f32_to_bf16",
           kern_f32_to_bf16(f.g, (uint16_t *)(void *)(f.g + 1), BN));
    REFUSE(&f, "kern_bf16_to_f32",
           kern_bf16_to_f32(f.h16, (float *)(void *)f.h16, BN));
}
END_TEST

/* The fused statistic + top-k gives the bits of the two-step path, for the
 * SCAPE statistic and for |g + e|, on random and on heavily tied inputs. */
static void topk_ef_case(rng *r, size_t n, int tied, int scape_stat)
{
    float *m = rand_f32(r, n ? n : 1), *g = rand_f32(r, n ? n : 1), *e = rand_f32(r, n ? n : 1);
    for (size_t i = 0; tied && i < n; i++) {
        g[i] = (float)(int)(3.0f * g[i]);
        e[i] = 0.0f;
        m[i] = 0.5f;
    }
    size_t nw = kern_mask_words(n), sb = kern_topk_scratch_bytes(n), k = n / 7 + (n > 0);
    float *stat = xalloc((n ? n : 1) * sizeof *stat);
    uint32_t *want = xalloc((nw ? nw : 1) * 4), *got = galloc(nw * 4);
    void *scratch = xalloc(sb ? sb : 1);
    ref_stat(scape_stat ? m : NULL, g, e, n, 0.9f, 3.0f, stat);
    assert_ok(topk_of(stat, n, k, want, scratch, sb), "kern_topk_packed", n);
    assert_ok(kern_topk_ef(scape_stat ? m : NULL, g, e, n, 0.9f, 3.0f, k, got, scratch, sb),
              "kern_topk_ef", n);
    ck_assert_msg(memcmp(got, want, nw * 4) == 0, "kern_topk_ef differs (n=%zu, tied=%d, "
                  "scape=%d)", n, tied, scape_stat);
    gcheck(got, "topk_ef mask");
    free(m), free(g), free(e), free(stat), free(want), gfree(got), free(scratch);
}

/* After a pack, the top-k from the stored a (residual off the mask, packed
 * values on it) equals the top-k from g + e before it. */
static void topk_packed_case(rng *r, size_t n, int scape_stat, int dense)
{
    size_t n1 = n ? n : 1, nw = kern_mask_words(n), sb = kern_topk_scratch_bytes(n);
    size_t k = n / 5 + (n > 0), kp = 0;
    float *m = rand_f32(r, n1), *g = rand_f32(r, n1), *e = rand_f32(r, n1);
    float *e2 = xalloc(n1 * 4), *packed = xalloc(n1 * 4), *zero = xalloc(n1 * 4);
    uint32_t *sent = xalloc((nw ? nw : 1) * 4), *want = xalloc((nw ? nw : 1) * 4);
    uint32_t *got = galloc(nw * 4);
    void *scratch = xalloc(sb ? sb : 1);
    for (size_t w = 0; w < nw; w++)
        sent[w] = mask_word(r, MK_MIXED);
    memcpy(e2, e, n1 * 4);
    memset(zero, 0, n1 * 4);
    const float *mm = scape_stat ? m : NULL;
    assert_ok(kern_topk_ef(mm, g, e, n, 0.9f, 2.0f, k, want, scratch, sb), "kern_topk_ef", n);
    if (dense) { /* a = e: the dense pack adds g into e in place */
        for (size_t i = 0; i < n; i++)
            e2[i] = g[i] + e[i];
        assert_ok(kern_topk_packed(mm, e2, NULL, NULL, n, 0.9f, 2.0f, k, got, scratch, sb),
                  "kern_topk_packed", n);
    } else {
        assert_ok(kern_pack_ef(g, e2, sent, n, packed, &kp), "kern_pack_ef", n);
        assert_ok(kern_topk_packed(mm, e2, sent, packed, n, 0.9f, 2.0f, k, got, scratch, sb),
                  "kern_topk_packed", n);
    }
    ck_assert_msg(memcmp(got, want, nw * 4) == 0, "kern_topk_packed differs (n=%zu, scape=%d,"
                  " dense=%d)", n, scape_stat, dense);
    gcheck(got, "topk_packed mask");
    if (!dense) {
        /* the statistic at the packed bits taken first, then m changed there
         * (the update) and the packed a overwritten (the reduction): the
         * selection from the kept statistic is the same */
        float *pstat = xalloc((kp ? kp : 1) * 4);
        assert_ok(kern_stat_packed_rest(mm, sent, packed, NULL, n, 0.9f, 2.0f, pstat),
                  "kern_stat_packed_rest", n);
        for (size_t i = 0; i < n; i++)
            if ((sent[i / 32] >> (i % 32)) & 1u)
                m[i] = -7.5f * m[i] + 1.0f;
        memset(packed, 0xff, kp * 4);
        memset(got, 0, nw * 4);
        assert_ok(kern_topk_prestat(mm, e2, sent, pstat, n, 0.9f, 2.0f, k, got, scratch, sb),
                  "kern_topk_prestat", n);
        ck_assert_msg(memcmp(got, want, nw * 4) == 0, "kern_topk_prestat differs (n=%zu, "
                      "scape=%d)", n, scape_stat);
        free(pstat);
    }
    free(m), free(g), free(e), free(e2), free(packed), free(zero), free(sent), free(want);
    gfree(got), free(scratch);
}

START_TEST(test_topk_packed)
{
    rng r = rng_make(__func__, _i);
    for (int sc = 0; sc < 2; sc++)
        for (int dense = 0; dense < 2; dense++)
            topk_packed_case(&r, s_sizes[_i], sc, dense);
}
END_TEST

START_TEST(test_topk_ef)
{
    rng r = rng_make(__func__, _i);
    for (int tied = 0; tied < 2; tied++)
        for (int sc = 0; sc < 2; sc++)
            topk_ef_case(&r, s_sizes[_i], tied, sc);
}
END_TEST

START_TEST(test_bad_topk_ef)
{
    fx f;
    fx_init(&f, __func__, 0);
    size_t sb = kern_topk_scratch_bytes(BN);
    REFUSE(&f, "kern_topk_ef", kern_topk_ef(f.m, NULL, f.e, BN, 0.9f, 1.0f, 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_ef", kern_topk_ef(f.m, f.g, NULL, BN, 0.9f, 1.0f, 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_ef", kern_topk_ef(f.m, f.g, f.e, BN, 0.9f, 1.0f, 1, NULL, f.scratch, sb));
    REFUSE(&f, "kern_topk_ef", kern_topk_ef(f.m, f.g, f.e, BN, 0.9f, 1.0f, 1, f.mask, NULL, sb));
    REFUSE(&f, "kern_topk_ef", kern_topk_ef(f.m, f.g, f.e, BN, 0.9f, 1.0f, BN + 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_ef", kern_topk_ef(f.m, f.g, f.e, BN, 0.9f, 1.0f, 1, f.mask, f.scratch, sb - 1));
    REFUSE(&f, "kern_topk_ef", kern_topk_ef(f.m, f.g, f.e, BN, 1.0f, 1.0f, 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_ef", kern_topk_ef(f.m, f.g, f.e, BN, 0.9f, 0.5f, 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_ef", kern_topk_ef(f.m, f.g, f.e, BN, 0.9f, 1.0f, 1, (uint32_t *)(void *)f.g, f.scratch, sb));
    assert_ok(kern_topk_ef(NULL, f.g, f.e, BN, 0.0f, 0.0f, 1, f.mask, f.scratch, sb), "kern_topk_ef", BN);
    REFUSE(&f, "kern_topk_packed", kern_topk_packed(f.m, NULL, NULL, NULL, BN, 0.9f, 1.0f, 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_packed", kern_topk_packed(f.m, f.e, f.mask2, NULL, BN, 0.9f, 1.0f, 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_packed", kern_topk_packed(f.m, f.e, NULL, NULL, BN, 0.9f, 1.0f, BN + 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_packed", kern_topk_packed(f.m, f.e, NULL, NULL, BN, 0.9f, 1.0f, 1, f.mask, f.scratch, sb - 1));
    REFUSE(&f, "kern_topk_packed", kern_topk_packed(f.m, f.e, NULL, NULL, BN, 0.9f, 0.0f, 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_packed", kern_topk_packed(f.m, f.e, f.mask, f.out, BN, 0.9f, 1.0f, 1, f.mask, f.scratch, sb));
    assert_ok(kern_topk_packed(f.m, f.e, f.mask2, f.out, BN, 0.9f, 1.0f, 1, f.mask, f.scratch, sb), "kern_topk_packed", BN);
    REFUSE(&f, "kern_stat_packed_rest",
           kern_stat_packed_rest(f.m, NULL, f.out, NULL, BN, 0.9f, 1.0f, f.g));
    REFUSE(&f, "kern_stat_packed_rest",
           kern_stat_packed_rest(f.m, f.mask2, NULL, NULL, BN, 0.9f, 1.0f, f.g));
    REFUSE(&f, "kern_stat_packed_rest",
           kern_stat_packed_rest(f.m, f.mask2, f.out, NULL, BN, 0.9f, 1.0f, NULL));
    REFUSE(&f, "kern_stat_packed_rest",
           kern_stat_packed_rest(f.m, f.mask2, f.out, NULL, BN, 1.0f, 1.0f, f.g));
    REFUSE(&f, "kern_stat_packed_rest",
           kern_stat_packed_rest(f.m, f.mask2, f.out, NULL, BN, 0.9f, 1.0f, f.out));
    assert_ok(kern_stat_packed_rest(f.m, f.mask2, f.out, NULL, BN, 0.9f, 1.0f, f.g),
              "kern_stat_packed_rest", BN);
    REFUSE(&f, "kern_topk_prestat", kern_topk_prestat(f.m, NULL, f.mask2, f.g, BN, 0.9f, 1.0f, 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_prestat", kern_topk_prestat(f.m, f.e, NULL, f.g, BN, 0.9f, 1.0f, 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_prestat", kern_topk_prestat(f.m, f.e, f.mask2, NULL, BN, 0.9f, 1.0f, 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_prestat", kern_topk_prestat(f.m, f.e, f.mask2, f.g, BN, 0.9f, 1.0f, BN + 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_prestat", kern_topk_prestat(f.m, f.e, f.mask2, f.g, BN, 0.9f, 0.5f, 1, f.mask, f.scratch, sb));
    REFUSE(&f, "kern_topk_prestat", kern_topk_prestat(f.m, f.e, f.mask2, f.g, BN, 0.9f, 1.0f, 1, f.mask2, f.scratch, sb));
    assert_ok(kern_topk_prestat(f.m, f.e, f.mask2, f.g, BN, 0.9f, 1.0f, 1, f.mask, f.scratch, sb), "kern_topk_prestat", BN);
}
END_TEST

/* ---- the suite ---------------------------------------------------------- */

static TCase *sized(const char *name, const TTest *t, int timeout)
{
    TCase *tc = tcase_create(name);
    tcase_add_loop_test(tc, t, 0, NSIZES);
    tcase_set_timeout(tc, timeout);
    return tc;
}

static Suite *kernels_suite(void)
{
    Suite *s = suite_create("kernels");
    TCase *tc = tcase_create("errors");
    tcase_add_test(tc, test_rc_names);
    tcase_add_test(tc, test_last_error);
    tcase_add_test(tc, test_try_trail);
    suite_add_tcase(s, tc);
    suite_add_tcase(s, sized("pack", test_pack, 300));
    suite_add_tcase(s, sized("topk", test_topk, 900));
    suite_add_tcase(s, sized("topk_all_equal", test_topk_all_equal, 300));
    suite_add_tcase(s, sized("topk_ef", test_topk_ef, 900));
    suite_add_tcase(s, sized("topk_packed", test_topk_packed, 900));
    suite_add_tcase(s, sized("popcount", test_mask_popcount, 300));
    suite_add_tcase(s, sized("compact", test_mask_compact, 300));
    suite_add_tcase(s, sized("expand", test_mask_expand, 300));
    suite_add_tcase(s, sized("delta", test_mask_delta, 300));
    suite_add_tcase(s, sized("bf16_random", test_bf16_random, 300));
    suite_add_tcase(s, sized("grad_accum", test_grad_accum, 300));
    suite_add_tcase(s, sized("adams_masked", test_adams_masked, 600));
    suite_add_tcase(s, sized("adams_dense", test_adams_dense, 300));
    suite_add_tcase(s, sized("adamw_dense", test_adamw_dense, 600));
    suite_add_tcase(s, sized("adamw_masked", test_adamw_masked, 900));
    suite_add_tcase(s, sized("adam_agree", test_adam_masked_dense_agree, 300));
    suite_add_tcase(s, sized("update_variants", test_update_variants, 900));

    tc = tcase_create("fixed");
    tcase_add_test(tc, test_topk_crafted);
    tcase_add_test(tc, test_topk_input_changing_underneath);
    tcase_add_test(tc, test_bf16_crafted);
    tcase_add_test(tc, test_bf16_exhaustive);
    tcase_add_test(tc, test_sum_bf16_parts);
    suite_add_tcase(s, tc);

    tc = tcase_create("refused");
    tcase_add_loop_test(tc, test_null_pack_stat, 0, 2);
    tcase_add_loop_test(tc, test_null_topk_masks, 0, 2);
    tcase_add_test(tc, test_bad_topk_ef);
    tcase_add_loop_test(tc, test_null_adam, 0, 2);
    tcase_add_loop_test(tc, test_null_convert, 0, 2);
    tcase_add_test(tc, test_bad_pack_stat);
    tcase_add_test(tc, test_bad_topk);
    tcase_add_test(tc, test_bad_masks);
    tcase_add_test(tc, test_bad_adam_scalars);
    tcase_add_test(tc, test_bad_adam_buffers);
    tcase_add_test(tc, test_bad_convert);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    s_seed = pick_seed();
    printf("test_kernels: seed %" PRIu64 " (SCAPE_TEST_SEED=%" PRIu64
           " replays this run)\n", s_seed, s_seed);
    fflush(stdout);
    return check_run(kernels_suite());
}
