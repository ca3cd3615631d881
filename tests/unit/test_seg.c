/* test_seg.c - the segmented kernels' CPU versions (kernels/cpu_seg.c)
 * against references written apart from them, bit for bit:
 *  - mask code: KSEG_SCAN + KSEG_ENCODE against maskcode.c's mcode_encode;
 *    KSEG_DECODE_* against mcode_decode on valid and corrupted codes:
 *    refused exactly when mcode_decode refuses (for the same reason when one
 *    thing is wrong), the same words when both accept;
 *  - top-k: the segmented radix select against the per-tensor one of the
 *    host executor (kern_topk_packed on a stored statistic) per tensor;
 *  - the word-range kernels (PACK, UPDATE, COMPACT, WRITEBACK) against
 *    kern_grad_accum, the statistic of scape_formula.h, kern_pack_ef,
 *    kern_update, kern_mask_compact_dt and
 *    kern_mask_expand_dt, applied tensor by tensor in comm order.
 * The tables are built as daemon/exec_dev.c builds them (build_tensors,
 * build_range, build_sel); host memory stands in for device memory, since
 * the CPU kernels run on the host.  Outputs start from the same poison on
 * both sides and are compared whole, so a write out of place shows too.
 * The random cases come from a fixed seed, printed; SCAPE_TEST_SEED picks
 * another.
 */
#define _POSIX_C_SOURCE 200809L

#include <check.h>
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "maskcode.h"
#include "plan.h"
#include "scape_kernels.h"
#include "scape_seg.h"
#include "check_run.h"
#include "test_rng.h"

#define DEFAULT_SEED 0x5ca9e5e6ull
#define MAX_T 16     /* tensors per layout */
#define GUARD_W 16   /* poisoned elements after every output buffer */

static const double s_rhos[] = { 1.0, 0.5, 0.1, 0.01, 0.001 };
#define NRHOS ((int)(sizeof s_rhos / sizeof s_rhos[0]))

/* ---- random inputs ------------------------------------------------------ */

static uint64_t s_seed;

/* A generator of its own for each test and loop index (test_rng.h). */
static rng rng_make(const char *name, int i) { return rng_for(s_seed, name, i); }

/* Uniform in [0, n), n >= 1. */
static uint32_t rng_below(rng *r, uint32_t n)
{
    return (uint32_t)(((rng_next(r) >> 32) * (uint64_t)n) >> 32);
}

static uint64_t rng_below64(rng *r, uint64_t n) { return rng_next(r) % n; }


static uint64_t pick_seed(void)
{
    const char *env = getenv("SCAPE_TEST_SEED");
    if (env != NULL && *env != '\0')
        return strtoull(env, NULL, 0);
    return DEFAULT_SEED;
}

/* ---- memory ------------------------------------------------------------ */

/* prefix[w] = set bits of words [0, w), prefix[nw] = all of them. */
static void ref_prefix(const uint32_t *mask, uint64_t nw, uint32_t *prefix)
{
    uint32_t acc = 0;
    for (uint64_t w = 0; w < nw; w++) {
        prefix[w] = acc;
        acc += (uint32_t)__builtin_popcount(mask[w]);
    }
    prefix[nw] = acc;
}

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    ck_assert_ptr_nonnull(p);
    return p;
}

static void *xdup(const void *src, size_t bytes)
{
    void *p = xcalloc(1, bytes);
    if (bytes)
        memcpy(p, src, bytes);
    return p;
}

static void fill_random(rng *r, void *buf, size_t bytes)
{
    unsigned char *b = buf;
    for (size_t i = 0; i < bytes; i++)
        b[i] = (unsigned char)rng_next(r);
}

static float *random_floats(rng *r, size_t n, int non_negative)
{
    float *x = xcalloc(n + GUARD_W, sizeof *x);
    for (size_t i = 0; i < n + GUARD_W; i++)
        x[i] = non_negative ? fabsf(rng_float(r)) : rng_float(r);
    return x;
}

/* got and want agree byte for byte; else name the first element that differs. */
static void expect_same(const void *got, const void *want, size_t n, size_t esize,
                        const char *what, const char *ctx)
{
    if (n == 0 || memcmp(got, want, n * esize) == 0)
        return;
    const unsigned char *g = got, *w = want;
    size_t i = 0;
    while (memcmp(g + i * esize, w + i * esize, esize) == 0)
        i++;
    uint32_t gv = 0, wv = 0;
    memcpy(&gv, g + i * esize, esize < 4 ? esize : 4);
    memcpy(&wv, w + i * esize, esize < 4 ? esize : 4);
    ck_abort_msg("%s: %s[%zu] of %zu is 0x%08x, the reference has 0x%08x", ctx, what, i, n,
                 (unsigned)gv, (unsigned)wv);
}

static void run(kseg_kernel k, const void *args)
{
    ck_assert_int_eq(kseg_run_cpu(k, args), SCAPE_OK);
}

static kseg_status status_new(void)
{
    kseg_status st;
    memset(&st, 0, sizeof st);
    st.first = UINT64_MAX; /* no bad code seen: the first recorded is the least */
    return st;
}

/* ---- layouts: a plan and its kernel table ------------------------------- */

typedef struct layout {
    plan *p;
    kseg_tensor t[MAX_T]; /* every tensor, comm order: exec_dev.c's build_tensors */
    uint32_t nt;
    eng_tensor ts[MAX_T];
    char names[MAX_T][16];
} layout;

static const plan_tensor *comm_at(const plan *p, size_t j) { return &p->t[p->order[j]]; }

static layout *layout_new(const uint32_t *lens, uint32_t nt, int ranks, double rho)
{
    ck_assert_uint_le(nt, MAX_T);
    layout *l = xcalloc(1, sizeof *l);
    size_t off = 0;
    for (uint32_t i = 0; i < nt; i++) {
        snprintf(l->names[i], sizeof l->names[i], "t%u", i);
        l->ts[i] = (eng_tensor){ l->names[i], off, lens[i], 0 };
        off += lens[i];
    }
    ck_assert_int_eq(plan_build(&l->p, l->ts, nt, ranks, rho), SCAPE_OK);
    l->nt = nt;
    for (uint32_t j = 0; j < nt; j++) {
        const plan_tensor *pt = comm_at(l->p, j);
        l->t[j] = (kseg_tensor){ pt->pos, pt->off, pt->word, (uint32_t)pt->len, (uint32_t)pt->k,
                                 pt->group, 0 };
    }
    return l;
}

static void layout_free(layout *l)
{
    plan_destroy(&l->p);
    free(l);
}

/* Lengths inside a word or two, at word edges, or anything up to max (>= 64). */
static uint32_t rand_len(rng *r, uint32_t max)
{
    uint32_t x;
    switch (rng_below(r, 4)) {
    case 0: x = 1 + rng_below(r, 70); break;
    case 1:
        x = 32 * (1 + rng_below(r, max / 32));
        x += rng_below(r, 3) - 1;
        break;
    default: x = 1 + rng_below(r, max); break;
    }
    return x > max ? max : x;
}

static layout *layout_random(rng *r, uint32_t max_t, uint32_t max_len, double rho)
{
    uint32_t lens[MAX_T], nt = 1 + rng_below(r, max_t);
    for (uint32_t i = 0; i < nt; i++)
        lens[i] = rand_len(r, max_len);
    return layout_new(lens, nt, 1 + (int)rng_below(r, 4), rho);
}

/* A rank's shard as a comm range, or every tensor when rank == nranks. */
static void range_of_rank(const layout *l, int rank, uint32_t *first, uint32_t *n)
{
    if (rank == l->p->nranks) {
        *first = 0;
        *n = l->nt;
        return;
    }
    *first = (uint32_t)l->p->shard[rank].first;
    *n = (uint32_t)l->p->shard[rank].count;
}

/* Set exactly `want` of the (clear) len bits at words, want <= len. */
static void set_random_bits(rng *r, uint32_t *words, uint32_t len, uint32_t want)
{
    int invert = want > len / 2; /* many bits: set all, clear the rest at random */
    uint32_t n = invert ? len - want : want;
    if (invert)
        for (uint32_t i = 0; i < len; i++)
            words[i / 32] |= 1u << (i % 32);
    for (uint32_t got = 0; got < n;) {
        uint32_t i = rng_below(r, len), bit = 1u << (i % 32);
        if (((words[i / 32] & bit) != 0) == invert) {
            words[i / 32] ^= bit;
            got++;
        }
    }
}

/* Every tensor with exactly its k bits (comm-space words). */
static void mask_exact_k(rng *r, const layout *l, uint32_t *words)
{
    memset(words, 0, l->p->nwords * sizeof *words);
    for (uint32_t j = 0; j < l->nt; j++)
        set_random_bits(r, words + l->t[j].word, l->t[j].len, l->t[j].k);
}

/* KSEG_SCAN of words [w0, w1) into a fresh table, checked against
 * ref_prefix: tile i's entry is the prefix at word i * KSEG_TILE. */
static uint32_t *scan_words(const uint32_t *mask, uint64_t w0, uint64_t w1, const char *ctx)
{
    uint64_t nw = w1 - w0, ntiles = kseg_tiles(nw);
    uint32_t *tiles = xcalloc(ntiles + 1, sizeof *tiles), *prefix = xcalloc(nw + 1, 4);
    kseg_args s;
    memset(&s, 0, sizeof s);
    s.mask = mask;
    s.w0 = w0;
    s.w1 = w1;
    s.tiles = tiles;
    run(KSEG_SCAN, &s);
    ref_prefix(mask + w0, nw, prefix);
    for (uint64_t i = 0; i < ntiles; i++)
        ck_assert_msg(tiles[i] == prefix[i * KSEG_TILE], "%s: tile %" PRIu64 " is %u, want %u",
                      ctx, i, tiles[i], prefix[i * KSEG_TILE]);
    ck_assert_msg(tiles[ntiles] == prefix[nw], "%s: scan total %u, want %u", ctx, tiles[ntiles],
                  prefix[nw]);
    free(prefix);
    return tiles;
}

/* ---- mask code tables: exec_dev.c's build_range ------------------------- */

typedef struct crange {
    uint32_t first, n;
    kseg_code *c;
    uint64_t w0, nwords, npos, pos_bits, map_words, code_words;
} crange;

static crange range_new(const layout *l, uint32_t first, uint32_t n)
{
    crange r;
    memset(&r, 0, sizeof r);
    r.first = first;
    r.n = n;
    r.c = xcalloc(n, sizeof *r.c);
    r.w0 = n ? l->t[first].word : 0;
    uint64_t kcum = 0;
    for (uint32_t q = 0; q < n; q++) { /* the bitmaps first, in comm order */
        const kseg_tensor *t = &l->t[first + q];
        r.nwords += kseg_words_of(t);
        if (!mcode_by_index(comm_at(l->p, first + q))) {
            r.c[q] = (kseg_code){ .tensor = first + q, .at = r.map_words, .kcum = kcum };
            r.map_words += kseg_words_of(t);
        }
        kcum += t->k;
    }
    kcum = 0;
    for (uint32_t q = 0; q < n; q++) { /* then one stream of positions */
        const kseg_tensor *t = &l->t[first + q];
        if (mcode_by_index(comm_at(l->p, first + q))) {
            uint32_t b = mcode_pos_bits(t->len);
            r.c[q] = (kseg_code){ .tensor = first + q, .by_index = 1, .bits = b,
                                  .at = 32 * r.map_words + r.pos_bits, .kcum = kcum,
                                  .qbase = r.npos };
            r.npos += t->k;
            r.pos_bits += (uint64_t)t->k * b;
        } else {
            r.c[q].qbase = r.npos;
        }
        kcum += t->k;
    }
    r.code_words = r.map_words + (r.pos_bits + 31) / 32;
    return r;
}

/* The arguments of a code kernel; words and code are comm space / the range's code. */
static kseg_code_args code_args(const layout *l, const crange *r, uint32_t *words,
                                uint32_t *code, uint32_t *count, kseg_status *st)
{
    kseg_code_args a = { .t = l->t, .c = r->c, .nc = r->n, .w0 = r->w0, .nwords = r->nwords,
                         .npos = r->npos, .pos_bits = r->pos_bits, .map_words = r->map_words,
                         .code_words = r->code_words, .words = words, .code = code,
                         .count = count, .status = st };
    return a;
}

/* ---- 1. encode ---------------------------------------------------------- */

/* SCAN + ENCODE of range [first, first + n) equals mcode_encode's bytes. */
static void encode_range(const layout *l, uint32_t *mask, uint32_t first, uint32_t n,
                         const char *ctx)
{
    crange cr = range_new(l, first, n);
    uint64_t cw = cr.code_words;
    ck_assert_msg(4 * cw == mcode_bytes(l->p, first, n), "%s: [%u, +%u): %" PRIu64
                  " code bytes, maskcode.c's %zu", ctx, first, n, 4 * cw,
                  mcode_bytes(l->p, first, n));
    uint32_t *want = xcalloc(cw + GUARD_W, 4), *got = xcalloc(cw + GUARD_W, 4);
    for (uint32_t g = 0; g < GUARD_W; g++)
        want[cw + g] = got[cw + g] = 0xdeadbeefu ^ g;
    ck_assert_int_eq(mcode_encode(l->p, first, n, mask + cr.w0, want), SCAPE_OK);
    uint32_t *tiles = scan_words(mask, cr.w0, cr.w0 + cr.nwords, ctx);
    kseg_status st = status_new();
    kseg_code_args a = code_args(l, &cr, mask, got, NULL, &st);
    a.tiles = tiles;
    run(KSEG_ENCODE, &a);
    ck_assert_msg(st.err == 0, "%s: [%u, +%u): encode flagged %u", ctx, first, n, st.err);
    expect_same(got, want, cw + GUARD_W, 4, "code", ctx);
    free(tiles);
    free(want);
    free(got);
    free(cr.c);
}

/* One bit more or less in one tensor: ENCODE says KSEG_BAD_K exactly when
 * mcode_encode refuses (index-coded tensors; a bitmap is checked when
 * decoded), and codes what it accepts the same way. */
static void encode_wrong_k(rng *r, const layout *l, uint32_t *mask, uint32_t first,
                           uint32_t n, uint32_t rank, const char *ctx)
{
    if (n == 0)
        return;
    uint32_t j = first + rng_below(r, n), i = rng_below(r, l->t[j].len);
    mask[l->t[j].word + i / 32] ^= 1u << (i % 32);
    crange cr = range_new(l, first, n);
    uint32_t *want = xcalloc(cr.code_words, 4), *got = xcalloc(cr.code_words, 4);
    scape_rc rc = mcode_encode(l->p, first, n, mask + cr.w0, want);
    kseg_status st = status_new();
    kseg_code_args a = code_args(l, &cr, mask, got, NULL, &st);
    a.rank = rank;
    run(KSEG_ENCODE, &a);
    int by_index = mcode_by_index(comm_at(l->p, j));
    ck_assert_msg((rc != SCAPE_OK) == by_index, "%s: mcode_encode rc %d, tensor %u by_index %d",
                  ctx, (int)rc, j, by_index);
    if (by_index) {
        ck_assert_msg(st.err == KSEG_E_CODE && st.first == kseg_bad(rank, j, KSEG_BAD_K),
                      "%s: tensor %u with a bit flipped: err %u first 0x%" PRIx64, ctx, j,
                      st.err, st.first);
    } else {
        ck_assert_msg(st.err == 0, "%s: bitmap tensor %u: err %u", ctx, j, st.err);
        expect_same(got, want, cr.code_words, 4, "code", ctx);
    }
    mask[l->t[j].word + i / 32] ^= 1u << (i % 32);
    free(want);
    free(got);
    free(cr.c);
}

START_TEST(encode_matches_maskcode)
{
    rng r = rng_make("encode", _i);
    for (int c = 0; c < 40; c++) {
        layout *l = layout_random(&r, MAX_T, 5000, s_rhos[_i]);
        char ctx[160];
        snprintf(ctx, sizeof ctx, "seed %" PRIu64 " rho %g case %d (%u tensors, %d ranks)",
                 s_seed, s_rhos[_i], c, l->nt, l->p->nranks);
        uint32_t *mask = xcalloc(l->p->nwords, 4);
        mask_exact_k(&r, l, mask);
        for (int rank = 0; rank <= l->p->nranks; rank++) {
            uint32_t first, n;
            range_of_rank(l, rank, &first, &n);
            encode_range(l, mask, first, n, ctx);
            encode_wrong_k(&r, l, mask, first, n, (uint32_t)rank, ctx);
        }
        free(mask);
        layout_free(l);
    }
}
END_TEST

/* An index-coded tensor whose k bits include one past its end: refused
 * by the sender's encode, as mcode_encode refuses it ("more than k bits"),
 * not sent on to a peer that would blame the sender's code. */
START_TEST(encode_refuses_a_bit_past_the_end)
{
    const uint32_t len = 40;
    layout *l = layout_new(&len, 1, 1, 0.01);
    ck_assert(mcode_by_index(comm_at(l->p, 0)));
    uint32_t mask[2] = { 0, 1u << 10 }; /* k = 1 bit, at position 42 */
    uint32_t code[4] = { 0 };
    ck_assert_int_ne(mcode_encode(l->p, 0, 1, mask, code), SCAPE_OK);
    crange cr = range_new(l, 0, 1);
    uint32_t *tiles = scan_words(mask, cr.w0, cr.w0 + cr.nwords, "past the end");
    kseg_status st = status_new();
    kseg_code_args a = code_args(l, &cr, mask, code, NULL, &st);
    a.tiles = tiles;
    run(KSEG_ENCODE, &a);
    ck_assert_uint_eq(st.err, KSEG_E_CODE);
    ck_assert_uint_eq(st.first, kseg_bad(0, 0, KSEG_BAD_K));
    free(tiles);
    free(cr.c);
    layout_free(l);
}
END_TEST

/* ---- 2. decode ---------------------------------------------------------- */

/* Bit fields of the code, one bit at a time: apart from kseg_bits_get. */
static uint32_t field_get(const uint32_t *code, uint64_t at, uint32_t bits)
{
    uint32_t v = 0;
    for (uint32_t b = 0; b < bits; b++)
        v |= ((code[(at + b) >> 5] >> ((at + b) & 31)) & 1u) << b;
    return v;
}

static void field_set(uint32_t *code, uint64_t at, uint32_t bits, uint32_t v)
{
    for (uint32_t b = 0; b < bits; b++) {
        uint32_t *w = &code[(at + b) >> 5], m = 1u << ((at + b) & 31);
        *w = (v >> b) & 1u ? *w | m : *w & ~m;
    }
}

static void flip(uint32_t *code, uint64_t bit) { code[bit >> 5] ^= 1u << (bit & 31); }

enum { CX_FLIP, CX_TAIL, CX_ORDER, CX_PAD, CX_COUNT, CX_MOVE, CX_KINDS };
static const char *const s_cx[] = { "flip", "tail", "order", "padding", "count", "move" };

typedef int (*code_pred)(const kseg_code *c, const kseg_tensor *t);

static int can_tail(const kseg_code *c, const kseg_tensor *t)
{
    return c->by_index ? c->bits < 32 && (1u << c->bits) > t->len : (t->len & 31) != 0;
}
static int can_order(const kseg_code *c, const kseg_tensor *t) { return c->by_index && t->k >= 2; }
static int is_map(const kseg_code *c, const kseg_tensor *t) { (void)t; return !c->by_index; }
static int any_code(const kseg_code *c, const kseg_tensor *t) { (void)c; (void)t; return 1; }

/* A random tensor of the range that `ok` admits, or NULL. */
static const kseg_code *pick(rng *r, const layout *l, const crange *cr, code_pred ok)
{
    const kseg_code *cand[MAX_T];
    uint32_t nc = 0;
    for (uint32_t q = 0; q < cr->n; q++)
        if (ok(&cr->c[q], &l->t[cr->c[q].tensor]))
            cand[nc++] = &cr->c[q];
    return nc ? cand[rng_below(r, nc)] : NULL;
}

/* A bit past a tensor's end: in its bitmap's last word, or a position >= len. */
static void bad_tail(rng *r, const kseg_tensor *t, const kseg_code *c, uint32_t *code)
{
    if (!c->by_index) {
        uint32_t b = (t->len & 31) + rng_below(r, 32 - (t->len & 31));
        code[c->at + kseg_words_of(t) - 1] |= 1u << b;
        return;
    }
    uint32_t q = rng_below(r, t->k), v = t->len + rng_below(r, (1u << c->bits) - t->len);
    field_set(code, c->at + (uint64_t)q * c->bits, c->bits, v);
}

/* Two positions out of order: a repeat or a swap. */
static void bad_order(rng *r, const kseg_tensor *t, const kseg_code *c, uint32_t *code)
{
    uint32_t q = 1 + rng_below(r, t->k - 1);
    uint64_t a0 = c->at + (uint64_t)(q - 1) * c->bits, a1 = a0 + c->bits;
    uint32_t p0 = field_get(code, a0, c->bits), p1 = field_get(code, a1, c->bits);
    field_set(code, a0, c->bits, rng_below(r, 2) ? p0 : p1);
    field_set(code, a1, c->bits, p0);
}

/* A valid code for other words: a bitmap bit moved, or a position moved
 * between its neighbours. */
static void good_move(rng *r, const kseg_tensor *t, const kseg_code *c, uint32_t *code)
{
    if (c->by_index) {
        uint32_t q = rng_below(r, t->k);
        uint32_t lo = q ? field_get(code, c->at + (uint64_t)(q - 1) * c->bits, c->bits) + 1 : 0;
        uint32_t hi = q + 1 < t->k ? field_get(code, c->at + (uint64_t)(q + 1) * c->bits,
                                                c->bits) : t->len;
        if (hi > lo && hi <= t->len)
            field_set(code, c->at + (uint64_t)q * c->bits, c->bits, lo + rng_below(r, hi - lo));
        return;
    }
    for (int tries = 0; tries < 1000; tries++) {
        uint32_t a = rng_below(r, t->len), b = rng_below(r, t->len);
        uint32_t *wa = &code[c->at + a / 32], *wb = &code[c->at + b / 32];
        if ((*wa >> (a % 32) & 1u) && !(*wb >> (b % 32) & 1u)) {
            *wa ^= 1u << (a % 32);
            *wb ^= 1u << (b % 32);
            return;
        }
    }
}

/* Apply one corruption of the given kind where the range allows it (a flip
 * of any bit where it does not); returns the kind applied. */
static int corrupt(rng *r, const layout *l, const crange *cr, uint32_t *code, int kind)
{
    uint64_t bits = 32 * cr->code_words, end = 32 * cr->map_words + cr->pos_bits;
    const kseg_code *c = NULL;
    switch (kind) {
    case CX_TAIL: c = pick(r, l, cr, can_tail); break;
    case CX_ORDER: c = pick(r, l, cr, can_order); break;
    case CX_COUNT: c = pick(r, l, cr, is_map); break;
    case CX_MOVE: c = pick(r, l, cr, any_code); break;
    case CX_PAD:
        if (end < bits) {
            flip(code, end + rng_below64(r, bits - end));
            return CX_PAD;
        }
        break;
    default: break;
    }
    if (c == NULL) {
        flip(code, rng_below64(r, bits));
        return CX_FLIP;
    }
    const kseg_tensor *t = &l->t[c->tensor];
    if (kind == CX_TAIL)
        bad_tail(r, t, c, code);
    else if (kind == CX_ORDER)
        bad_order(r, t, c, code);
    else if (kind == CX_COUNT)
        flip(code, 32 * c->at + rng_below(r, t->len));
    else
        good_move(r, t, c, code);
    return kind;
}

/* ZERO, MAP, POS, CHECK as exec_dev.c's dev_decode launches them. */
static void kern_decode(const layout *l, const crange *cr, uint32_t *code, uint32_t *words,
                        int merge, uint32_t from, kseg_status *st)
{
    uint32_t *count = xcalloc(cr->n, 4); /* zeroed before every decode */
    kseg_code_args a = code_args(l, cr, words, code, count, st);
    a.merge = merge;
    a.rank = from;
    run(KSEG_DECODE_ZERO, &a);
    run(KSEG_DECODE_MAP, &a);
    run(KSEG_DECODE_POS, &a);
    run(KSEG_DECODE_CHECK, &a);
    free(count);
}

/* The first bad code of the status in maskcode.c's words (as exec_dev.c's
 * status_rc reports it). */
static void kseg_reason(const plan *p, const kseg_status *st, char *buf, size_t size)
{
    static const char *const what[] = { "?", "bits set past the tensor's end",
                                        "not exactly k bits",
                                        "positions not ascending inside the tensor",
                                        "padding is not zero" };
    uint32_t w = (uint32_t)(st->first & 0xff), j = (uint32_t)((st->first >> 8) & 0xffffffu);
    snprintf(buf, size, "mask from rank %u: tensor %s: %s", (unsigned)(st->first >> 40),
             j < p->ntensors ? comm_at(p, j)->name : "-", w < 5 ? what[w] : "?");
}

/* The kernels and mcode_decode on one code: the same verdict, the same
 * reason when one thing was broken, the same words when both accept. */
static void decode_compare(rng *r, const layout *l, const crange *cr, uint32_t *code,
                           int nbad, const char *ctx)
{
    const plan *p = l->p;
    int merge = (int)rng_below(r, 2);
    uint32_t from = rng_below(r, 5), nw = (uint32_t)p->nwords + GUARD_W;
    uint32_t *want = xcalloc(nw, 4);
    fill_random(r, want, nw * 4); /* merged into, or replaced */
    uint32_t *got = xdup(want, nw * 4), *init = xdup(want, nw * 4);
    scape_rc rc = mcode_decode(p, cr->first, cr->n, code, 4 * cr->code_words, want + cr->w0,
                               merge, (int)from);
    char why[256] = "", kwhy[256] = "";
    if (rc != SCAPE_OK)
        snprintf(why, sizeof why, "%s", scape_last_error());
    kseg_status st = status_new();
    kern_decode(l, cr, code, got, merge, from, &st);
    kseg_reason(p, &st, kwhy, sizeof kwhy);
    int refused = (st.err & KSEG_E_CODE) != 0;
    ck_assert_msg((st.err & ~(uint32_t)KSEG_E_CODE) == 0, "%s: err %u", ctx, st.err);
    ck_assert_msg(refused == (rc != SCAPE_OK), "%s (merge %d): mcode_decode says '%s', "
                  "the kernels '%s'", ctx, merge, rc ? why : "ok", refused ? kwhy : "ok");
    if (refused) {
        ck_assert_int_eq(rc, SCAPE_PROTO);
        ck_assert_msg(st.first >> 40 == from, "%s: first 0x%" PRIx64, ctx, st.first);
        /* whatever a peer sends, no word outside its range changes */
        uint64_t end = cr->w0 + cr->nwords;
        expect_same(got, init, cr->w0, 4, "words before the range", ctx);
        expect_same(got + end, init + end, nw - end, 4, "words after the range", ctx);
        if (nbad == 1) /* one thing broken: one reason, the same */
            ck_assert_msg(strcmp(why, kwhy) == 0, "%s: mcode_decode says '%s', the kernels "
                          "'%s'", ctx, why, kwhy);
    } else {
        ck_assert_msg(st.first == UINT64_MAX, "%s: first 0x%" PRIx64, ctx, st.first);
        expect_same(got, want, nw, 4, "words", ctx);
    }
    free(want);
    free(got);
    free(init);
}

static void decode_case(rng *r, int it, int c)
{
    layout *l = layout_random(r, 8, 5000, s_rhos[rng_below(r, NRHOS)]);
    uint32_t *mask = xcalloc(l->p->nwords, 4), first, n;
    mask_exact_k(r, l, mask);
    range_of_rank(l, (int)rng_below(r, (uint32_t)l->p->nranks + 1), &first, &n);
    crange cr = range_new(l, first, n);
    uint32_t *code = xcalloc(cr.code_words, 4);
    ck_assert_int_eq(mcode_encode(l->p, first, n, mask + cr.w0, code), SCAPE_OK);
    /* a quarter valid, half with one thing broken, the rest with a few */
    uint32_t u = rng_below(r, 4);
    int nbad = cr.code_words == 0 ? 0 : u == 0 ? 0 : u < 3 ? 1 : 2 + (int)rng_below(r, 3);
    char ctx[256];
    int len = snprintf(ctx, sizeof ctx, "seed %" PRIu64 " loop %d case %d: tensors [%u, +%u) "
                       "of %u, %" PRIu64 " code words:", s_seed, it, c, first, n, l->nt,
                       cr.code_words);
    for (int b = 0; b < nbad; b++) {
        int kind = corrupt(r, l, &cr, code, (int)rng_below(r, CX_KINDS));
        nbad -= kind == CX_MOVE; /* a move keeps the code valid */
        len += snprintf(ctx + len, sizeof ctx - (size_t)len, " %s", s_cx[kind]);
    }
    decode_compare(r, l, &cr, code, nbad, ctx);
    free(code);
    free(cr.c);
    free(mask);
    layout_free(l);
}

START_TEST(decode_matches_maskcode)
{
    rng r = rng_make("decode", _i);
    for (int c = 0; c < 500; c++)
        decode_case(&r, _i, c);
}
END_TEST

/* ---- 3. top-k ----------------------------------------------------------- */

static float special(rng *r)
{
    static const uint32_t bits[] = { 0x00000000u, 0x80000000u, 0x7fc00000u, 0xffc00000u,
                                     0x7f800001u, 0x7f800000u, 0xff800000u, 0x7f7fffffu,
                                     0x00000001u, 0x3f800000u };
    return scape_f_from_bits(bits[rng_below(r, sizeof bits / sizeof bits[0])]);
}

/* One tensor's statistics: distinct values, a few values many times over,
 * one value, or mostly zeros; NaNs, infinities and zeros among them. */
static void random_stats(rng *r, float *s, uint32_t n)
{
    float pool[8];
    uint32_t np = 1 + rng_below(r, 8), mode = rng_below(r, 4);
    for (uint32_t i = 0; i < np; i++)
        pool[i] = rng_below(r, 3) ? rng_float(r) : special(r);
    for (uint32_t i = 0; i < n; i++) {
        if (mode == 0)
            s[i] = rng_below(r, 10) ? rng_float(r) : special(r);
        else if (mode == 1)
            s[i] = pool[rng_below(r, np)];
        else if (mode == 2)
            s[i] = pool[0];
        else
            s[i] = rng_below(r, 16) ? (rng_below(r, 2) ? 0.0f : -0.0f) : pool[rng_below(r, np)];
    }
}

/* Short tensors, and tensors of one item, just over, and of several. */
static uint32_t topk_len(rng *r)
{
    static const uint32_t edge[] = { 8191, 8192, 8193, 16384, 16385, 3 * 8192 + 7 };
    uint32_t u = rng_below(r, 6);
    if (u < 4)
        return rand_len(r, 3000);
    return u == 4 ? edge[rng_below(r, 6)] : 8193 + rng_below(r, 32000);
}

static uint32_t topk_k(rng *r, const kseg_tensor *t)
{
    switch (rng_below(r, 5)) {
    case 0: return 1;
    case 1: return t->len;
    case 2: return t->len > 1 ? t->len - 1 : 1;
    case 3: return 1 + rng_below(r, t->len);
    default: return t->k;
    }
}

/* A selection's item tables, as exec_dev.c's build_sel makes them. */
typedef struct selt {
    kseg_item *items;
    uint32_t nitems, *item0;
} selt;

static selt sel_new(const layout *l, uint32_t first, uint32_t n)
{
    selt s = { NULL, 0, xcalloc(n + 1, sizeof(uint32_t)) };
    size_t ni = 0;
    for (uint32_t q = 0; q < n; q++)
        ni += kseg_tiles(kseg_words_of(&l->t[first + q]));
    s.items = xcalloc(ni, sizeof *s.items);
    for (uint32_t q = 0; q < n; q++) {
        const kseg_tensor *t = &l->t[first + q];
        uint64_t words = kseg_words_of(t);
        s.item0[q] = s.nitems;
        for (uint64_t w = 0; w < words; w += KSEG_TILE)
            s.items[s.nitems++] = (kseg_item){
                t->word + w, (uint32_t)(words - w < KSEG_TILE ? words - w : KSEG_TILE), q };
    }
    s.item0[n] = s.nitems;
    return s;
}

/* The passes of exec_dev.c's topk(): three digits, then ties. */
static void kern_topk(const layout *l, uint32_t first, uint32_t n, const uint32_t *keys,
                      uint64_t key_lo, uint32_t *mask, rng *r)
{
    selt s = sel_new(l, first, n);
    uint32_t *hist = xcalloc((size_t)n * KSEG_BINS0, 4), *item_eq = xcalloc(s.nitems, 4);
    kseg_tstate *st = xcalloc(n, sizeof *st);
    fill_random(r, st, n * sizeof *st); /* the passes must not read what they did not write */
    fill_random(r, item_eq, s.nitems * 4);
    kseg_topk_args a = { .t = l->t, .first = first, .nsel = n, .items = s.items,
                         .nitems = s.nitems, .item0 = s.item0, .keys = keys, .key_lo = key_lo,
                         .hist = hist, .st = st, .item_eq = item_eq, .mask = mask };
    for (a.level = 0; a.level < 3; a.level++) {
        memset(hist, 0, (size_t)n * KSEG_BINS0 * 4);
        run(KSEG_TOPK_HIST, &a);
        run(KSEG_TOPK_PICK, &a);
    }
    run(KSEG_TOPK_COUNT, &a);
    run(KSEG_TOPK_SCAN, &a);
    run(KSEG_TOPK_WRITE, &a);
    free(hist);
    free(item_eq);
    free(st);
    free(s.items);
    free(s.item0);
}

/* The host executor's top-k per selected tensor, into its words of mask:
 * kern_topk_packed with nothing sent and no m selects by the stored |stat|. */
static void ref_topk(const layout *l, uint32_t first, uint32_t n, const float *stats,
                     uint64_t key_lo, uint32_t *mask)
{
    size_t most = 1;
    for (uint32_t q = 0; q < n; q++)
        most = l->t[first + q].len > most ? l->t[first + q].len : most;
    size_t sb = kern_topk_scratch_bytes(most);
    void *scratch = xcalloc(1, sb);
    for (uint32_t q = 0; q < n; q++) {
        const kseg_tensor *t = &l->t[first + q];
        ck_assert_int_eq(kern_topk_packed(NULL, stats + (t->pos - key_lo), NULL, NULL, t->len,
                                          0.0f, 1.0f, t->k, mask + t->word, scratch, sb),
                         SCAPE_OK);
    }
    free(scratch);
}

static void topk_case(rng *r, int it, int c)
{
    uint32_t lens[MAX_T], nt = 1 + rng_below(r, 8), first, n;
    for (uint32_t i = 0; i < nt; i++)
        lens[i] = topk_len(r);
    int ranks = 1 + (int)rng_below(r, 3);
    layout *l = layout_new(lens, nt, ranks, s_rhos[rng_below(r, NRHOS)]);
    for (uint32_t j = 0; j < nt; j++)
        l->t[j].k = topk_k(r, &l->t[j]); /* the table is the test's: any 1 <= k <= len */
    range_of_rank(l, (int)rng_below(r, (uint32_t)l->p->nranks + 1), &first, &n);
    if (n == 0) { /* exec_dev.c launches nothing for an empty selection */
        layout_free(l);
        return;
    }
    const kseg_tensor *t0 = &l->t[first], *t1 = &l->t[first + n - 1];
    uint64_t key_lo = t0->pos - rng_below64(r, (t0->pos < 64 ? t0->pos : 64) + 1);
    uint64_t nkeys = t1->pos + t1->len - key_lo;
    float *stats = xcalloc(nkeys, sizeof *stats);
    uint32_t *keys = xcalloc(nkeys, sizeof *keys);
    random_stats(r, stats, (uint32_t)nkeys);
    for (uint32_t q = 0; q < n; q++) /* each tensor its own kind of statistics */
        random_stats(r, stats + (l->t[first + q].pos - key_lo), l->t[first + q].len);
    for (uint64_t i = 0; i < nkeys; i++)
        keys[i] = scape_f_key(stats[i]);
    size_t nw = l->p->nwords + GUARD_W;
    uint32_t *got = xcalloc(nw, 4);
    fill_random(r, got, nw * 4); /* words outside the selection stay as they are */
    uint32_t *want = xdup(got, nw * 4);
    kern_topk(l, first, n, keys, key_lo, got, r);
    ref_topk(l, first, n, stats, key_lo, want);
    char ctx[200];
    snprintf(ctx, sizeof ctx, "seed %" PRIu64 " loop %d case %d: tensors [%u, +%u) of %u, "
             "key_lo %" PRIu64, s_seed, it, c, first, n, nt, key_lo);
    expect_same(got, want, nw, 4, "mask", ctx);
    free(stats);
    free(keys);
    free(got);
    free(want);
    layout_free(l);
}

START_TEST(topk_matches_reference)
{
    rng r = rng_make("topk", _i);
    for (int c = 0; c < 25; c++)
        topk_case(&r, _i, c);
}
END_TEST

/* ---- 4. the word-range kernels ------------------------------------------ */

/* A layout, a mask (or none: dense), trainers' buffers and a word range. */
typedef struct wcase {
    layout *l;
    uint64_t nwords, n;
    uint32_t *mask;          /* NULL: dense */
    uint32_t *tiles;         /* KSEG_SCAN of the mask from word 0 */
    uint32_t *prefix;        /* ref_prefix of the mask: bits before each word */
    uint64_t nbits;
    uint64_t w0, w1, p0, p1; /* the range and its elements, comm order */
    uint32_t ntr;
    int bf16;                /* the trainers' dtype */
    void *tr[KSEG_MAX_TRAINERS];
    char ctx[240];
} wcase;

/* The comm position of word w's first element (n past the last word). */
static uint64_t word_pos(const layout *l, uint64_t w)
{
    for (uint32_t j = 0; j < l->nt; j++)
        if (w >= l->t[j].word && w < l->t[j].word + kseg_words_of(&l->t[j]))
            return l->t[j].pos + (w - l->t[j].word) * 32;
    return l->p->n;
}

/* Exact k (the plan's), or any number of bits, per tensor. */
static uint32_t *random_mask(rng *r, const layout *l)
{
    uint32_t *mask = xcalloc(l->p->nwords, 4);
    for (uint32_t j = 0; j < l->nt; j++) {
        const kseg_tensor *t = &l->t[j];
        set_random_bits(r, mask + t->word, t->len,
                        rng_below(r, 3) ? t->k : rng_below(r, t->len + 1));
    }
    return mask;
}

/* A rank's shard (starts anywhere in a tile), everything, or any run of words. */
static void random_range(rng *r, wcase *c)
{
    uint32_t u = rng_below(r, 3);
    if (u == 0) {
        const plan_shard *s = &c->l->p->shard[rng_below(r, (uint32_t)c->l->p->nranks)];
        c->w0 = s->word0;
        c->w1 = s->word0 + s->words;
    } else if (u == 1) {
        c->w0 = 0;
        c->w1 = c->nwords;
    } else {
        c->w0 = rng_below64(r, c->nwords);
        c->w1 = c->w0 + 1 + rng_below64(r, c->nwords - c->w0);
    }
    c->p0 = word_pos(c->l, c->w0);
    c->p1 = word_pos(c->l, c->w1);
}

static void random_trainers(rng *r, wcase *c)
{
    static const uint32_t counts[] = { 1, 1, 2, 3, 5, 7 };
    c->ntr = counts[rng_below(r, 6)];
    if (c->n < 20000 && rng_below(r, 10) == 0)
        c->ntr = KSEG_MAX_TRAINERS;
    c->bf16 = (int)rng_below(r, 2);
    for (uint32_t q = 0; q < c->ntr; q++) {
        float *x = random_floats(r, c->n, 0);
        if (c->bf16) {
            uint16_t *h = xcalloc(c->n, 2);
            ck_assert_int_eq(kern_f32_to_bf16(x, h, c->n), SCAPE_OK);
            free(x);
            c->tr[q] = h;
        } else {
            c->tr[q] = x;
        }
    }
}

static void wcase_new(rng *r, wcase *c, int dense, const char *name, int it)
{
    memset(c, 0, sizeof *c);
    uint32_t lens[MAX_T], nt = 1 + rng_below(r, 12);
    for (uint32_t i = 0; i < nt; i++)
        lens[i] = rng_below(r, 6) ? rand_len(r, 5000) : 8192 + rng_below(r, 20000);
    double rho = s_rhos[rng_below(r, NRHOS)];
    c->l = layout_new(lens, nt, 1 + (int)rng_below(r, 4), rho);
    c->nwords = c->l->p->nwords;
    c->n = c->l->p->n;
    random_range(r, c);
    random_trainers(r, c);
    snprintf(c->ctx, sizeof c->ctx, "%s seed %" PRIu64 " loop %d: %u tensors, %d ranks, "
             "rho %g, words [%" PRIu64 ", %" PRIu64 ") of %" PRIu64 ", %s, %u %s trainers",
             name, s_seed, it, nt, c->l->p->nranks, rho, c->w0, c->w1, c->nwords,
             dense ? "dense" : "masked", c->ntr, c->bf16 ? "bf16" : "f32");
    if (dense)
        return;
    c->mask = random_mask(r, c->l);
    c->tiles = scan_words(c->mask, 0, c->nwords, c->ctx);
    c->prefix = xcalloc(c->nwords + 1, 4);
    ref_prefix(c->mask, c->nwords, c->prefix);
    c->nbits = c->prefix[c->nwords];
}

static void wcase_free(wcase *c)
{
    for (uint32_t q = 0; q < c->ntr; q++)
        free(c->tr[q]);
    free(c->mask);
    free(c->tiles);
    free(c->prefix);
    layout_free(c->l);
}

/* The packed vectors' length: set bits, or every coordinate when dense. */
static uint64_t packed_len(const wcase *c) { return c->mask ? c->nbits : c->n; }

/* Where packed indexes must stay below: everything, the range's end, or
 * (a quarter of the masked cases) inside the range's bits: KSEG_E_PACKED. */
static uint64_t pick_k_cap(rng *r, const wcase *c)
{
    if (c->mask == NULL)
        return c->n; /* as exec_dev.c's args_for */
    uint64_t lo = c->prefix[c->w0], hi = c->prefix[c->w1];
    uint32_t u = rng_below(r, 8);
    if (u < 2 && hi > lo)
        return lo + rng_below64(r, hi - lo);
    return u == 2 ? hi : c->nbits;
}

/* The range holds a set bit whose packed index is k_cap or more. */
static uint32_t packed_err(const wcase *c, uint64_t k_cap)
{
    if (c->mask == NULL)
        return 0;
    uint64_t lo = c->prefix[c->w0], hi = c->prefix[c->w1];
    return hi > lo && hi > k_cap ? KSEG_E_PACKED : 0;
}

/* The mask without the bits of packed index k_cap and above: what the
 * kernels act on when they flag KSEG_E_PACKED (the rest keep their indexes). */
static uint32_t *mask_below(const wcase *c, uint64_t k_cap)
{
    uint32_t *m = xdup(c->mask, c->nwords * 4);
    uint64_t seen = 0;
    for (uint64_t w = 0; w < c->nwords; w++)
        for (uint32_t x = c->mask[w]; x; x &= x - 1)
            if (seen++ >= k_cap)
                m[w] &= ~(x & (0u - x));
    return m;
}

static kseg_args wargs(const wcase *c, kseg_status *st)
{
    kseg_args a;
    memset(&a, 0, sizeof a);
    a.t = c->l->t;
    a.nt = c->l->nt;
    a.w0 = c->w0;
    a.w1 = c->w1;
    a.mask = c->mask;
    a.tiles = c->tiles;
    for (uint32_t q = 0; q < c->ntr; q++)
        a.tr[q] = c->tr[q];
    a.ntr = c->ntr;
    a.bf16 = c->bf16;
    a.k_cap = packed_len(c);
    a.s_base = c->p0; /* the state covers the range (a rank's shard) */
    a.status = st;
    return a;
}

/* Tensor j's part of the range: elements [i0, i0 + n) of it, from word ws,
 * at comm position pos; j0 is the packed index of its first bit (pos when
 * dense). */
typedef struct seg {
    const kseg_tensor *t;
    uint64_t ws, i0, n, pos, j0;
} seg;

static int seg_get(const wcase *c, uint32_t j, seg *s)
{
    const kseg_tensor *t = &c->l->t[j];
    uint64_t tw1 = t->word + kseg_words_of(t);
    uint64_t ws = t->word > c->w0 ? t->word : c->w0, we = tw1 < c->w1 ? tw1 : c->w1;
    if (ws >= we)
        return 0;
    uint64_t end = (we - t->word) * 32 < t->len ? (we - t->word) * 32 : t->len;
    s->t = t;
    s->ws = ws;
    s->i0 = (ws - t->word) * 32;
    s->n = end - s->i0;
    s->pos = t->pos + s->i0;
    s->j0 = c->mask ? c->prefix[ws] : s->pos;
    return 1;
}

/* The segment's mask words: m's, or all ones when dense. */
static const uint32_t *seg_mask(const uint32_t *m, const seg *s)
{
    static uint32_t ones[2048];
    if (m)
        return m + s->ws;
    if (ones[0] == 0)
        memset(ones, 0xff, sizeof ones);
    ck_assert_uint_le(kern_mask_words(s->n), 2048);
    return ones;
}

/* The trainer-order sum of the segment's gradients. */
static void ref_grad(const wcase *c, const seg *s, float *g)
{
    size_t es = c->bf16 ? 2 : 4;
    for (uint32_t q = 0; q < c->ntr; q++)
        ck_assert_int_eq(kern_grad_accum(g, (const char *)c->tr[q] + (s->t->off + s->i0) * es,
                                         c->bf16 ? KERN_BF16 : KERN_F32, s->n, q == 0),
                         SCAPE_OK);
}

/* ---- PACK ---- */

typedef struct pack_opt {
    int e_zero, e_write, keys, key_abs, no_out;
    uint64_t key_lo, key_hi, k_cap;
} pack_opt;

static pack_opt random_pack_opt(rng *r, const wcase *c)
{
    pack_opt o;
    memset(&o, 0, sizeof o);
    o.e_zero = rng_below(r, 4) == 0;
    o.no_out = rng_below(r, 6) == 0; /* topk-adamw's own selection: keys only */
    o.e_write = c->mask && !o.no_out && rng_below(r, 4) != 0;
    o.keys = o.no_out || rng_below(r, 3) != 0;
    o.key_abs = (int)rng_below(r, 2);
    /* keys of a part of the range, or of more than it */
    uint64_t lo = c->p0 > 40 ? c->p0 - 40 : 0, span = c->p1 + 40 - lo;
    o.key_lo = lo + rng_below64(r, span);
    o.key_hi = o.key_lo + rng_below64(r, lo + span - o.key_lo + 1);
    if (rng_below(r, 2)) {
        o.key_lo = c->p0;
        o.key_hi = c->p1;
    }
    o.k_cap = pick_k_cap(r, c);
    return o;
}

/* kern_grad_accum, kern_*_stat and kern_pack_ef per segment, on the mask
 * below k_cap (a value past it is not sent and stays in the residual);
 * returns the new residual's sum of squares. */
static double ref_pack(const wcase *c, const pack_opt *o, const float *m, float *e, float *out,
                       uint32_t *keys)
{
    uint32_t *below = c->mask ? mask_below(c, o->k_cap) : NULL;
    uint64_t most = 32 * kern_mask_words(c->n) + 32;
    float *g = xcalloc(most, 4), *es = xcalloc(most, 4), *stat = xcalloc(most, 4);
    double norm2 = 0.0;
    seg s;
    for (uint32_t j = 0; j < c->l->nt; j++) {
        if (!seg_get(c, j, &s))
            continue;
        uint64_t r0 = s.pos - c->p0;
        ref_grad(c, &s, g);
        if (o->e_zero)
            memset(es, 0, s.n * 4);
        else
            memcpy(es, e + r0, s.n * 4);
        if (o->keys) {
            for (uint64_t i = 0; i < s.n; i++) {
                float a = scape_f_ef(g[i], es[i]);
                stat[i] = o->key_abs ? scape_f_abs_stat(a)
                                     : scape_f_stat(m[r0 + i], a, 0.9f, 1.0f - 0.9f,
                                                    (float)c->ntr);
            }
            for (uint64_t i = 0; i < s.n; i++)
                if (s.pos + i >= o->key_lo && s.pos + i < o->key_hi)
                    keys[s.pos + i - o->key_lo] = scape_f_key(stat[i]);
        }
        if (o->no_out)
            continue;
        size_t k;
        ck_assert_int_eq(kern_pack_ef(g, es, seg_mask(below, &s), s.n, out + s.j0, &k),
                         SCAPE_OK);
        if (c->mask && o->e_write) {
            memcpy(e + r0, es, s.n * 4);
            for (uint64_t i = 0; i < s.n; i++)
                norm2 += (double)es[i] * (double)es[i];
        }
    }
    free(g);
    free(es);
    free(stat);
    free(below);
    return norm2;
}

static void pack_one(rng *r, const wcase *c)
{
    pack_opt o = random_pack_opt(r, c);
    uint64_t len = c->p1 - c->p0, nout = packed_len(c) + GUARD_W;
    uint64_t nkeys = o.key_hi - o.key_lo + GUARD_W;
    float *m = random_floats(r, len, 0), *e_got = random_floats(r, len, 0);
    float *out_got = random_floats(r, nout - GUARD_W, 0);
    uint32_t *keys_got = xcalloc(nkeys, 4);
    fill_random(r, keys_got, nkeys * 4);
    float *e_want = xdup(e_got, (len + GUARD_W) * 4), *out_want = xdup(out_got, nout * 4);
    uint32_t *keys_want = xdup(keys_got, nkeys * 4);
    double norm2 = ref_pack(c, &o, m, e_want, out_want, keys_want);
    if (!o.no_out && c->mask) /* nothing is written from k_cap on */
        memcpy(out_want + o.k_cap, out_got + o.k_cap, (nout - o.k_cap) * 4);
    kseg_status st = status_new();
    kseg_args a = wargs(c, &st);
    a.e = o.e_zero && !o.e_write ? NULL : e_got; /* not read then */
    a.e_base = c->p0;
    a.e_zero = o.e_zero;
    a.e_write = o.e_write;
    a.out = o.no_out ? NULL : out_got;
    a.k_cap = o.k_cap;
    a.m = m;
    a.keys = o.keys ? keys_got : NULL;
    a.key_lo = o.key_lo;
    a.key_hi = o.key_hi;
    a.key_abs = o.key_abs;
    a.beta1 = 0.9f;
    a.c1 = 1.0f - 0.9f; /* as exec_dev.c's want_keys */
    a.t_r = (float)c->ntr;
    run(KSEG_PACK, &a);
    char ctx[400];
    snprintf(ctx, sizeof ctx, "%s; pack e_zero %d e_write %d keys %d abs %d out %d keys "
             "[%" PRIu64 ", %" PRIu64 ") k_cap %" PRIu64, c->ctx, o.e_zero, o.e_write, o.keys,
             o.key_abs, !o.no_out, o.key_lo, o.key_hi, o.k_cap);
    ck_assert_msg(st.err == (o.no_out ? 0 : packed_err(c, o.k_cap)), "%s: err %u", ctx, st.err);
    expect_same(out_got, out_want, nout, 4, "out", ctx);
    expect_same(e_got, e_want, len + GUARD_W, 4, "e", ctx);
    expect_same(keys_got, keys_want, nkeys, 4, "keys", ctx);
    ck_assert_msg(memcmp(&st.norm2, &norm2, sizeof norm2) == 0, "%s: norm2 %.17g, want %.17g",
                  ctx, st.norm2, norm2);
    free(m);
    free(e_got);
    free(e_want);
    free(out_got);
    free(out_want);
    free(keys_got);
    free(keys_want);
}

START_TEST(pack_matches_reference)
{
    rng r = rng_make("pack", _i);
    wcase c;
    wcase_new(&r, &c, _i % 4 == 3, "pack", _i);
    for (int v = 0; v < 6; v++)
        pack_one(&r, &c);
    wcase_free(&c);
}
END_TEST

/* ---- UPDATE ---- */

typedef struct upd_opt {
    int update; /* the variant (scape_f_update) */
    kern_hyper h;
    float lr, div;
    uint64_t t, k_cap;
} upd_opt;

/* kern_update per segment, on the mask below k_cap. */
static void ref_update(const wcase *c, const upd_opt *o, const float *in, float *theta,
                       float *m, float *v)
{
    uint32_t *mask = c->mask ? mask_below(c, o->k_cap) : NULL;
    seg s;
    for (uint32_t j = 0; j < c->l->nt; j++) {
        if (!seg_get(c, j, &s))
            continue;
        uint64_t r0 = s.pos - c->p0;
        scape_rc rc;
        rc = kern_update(o->update, theta + r0, m + r0, v ? v + r0 : NULL, in + s.j0, o->div,
                         mask ? mask + s.ws : NULL, s.n, &o->h, o->lr, o->t);
        ck_assert_int_eq(rc, SCAPE_OK);
    }
    free(mask);
}

static void update_one(rng *r, const wcase *c)
{
    upd_opt o = { .h = { 0.9f, 0.95f, 1e-8f, 0.0f } };
    /* one draw per statement: an initializer list's order is unspecified */
    o.update = (int)rng_below(r, SCAPE_UPD_COUNT);
    o.h.wd = rng_below(r, 2) ? 0.0f : 0.1f;
    o.lr = 1e-3f * (float)(1 + rng_below(r, 10));
    o.div = (float)(1 + rng_below(r, 8));
    o.t = 1 + rng_below(r, 1000);
    o.k_cap = pick_k_cap(r, c);
    uint64_t len = c->p1 - c->p0, bytes = (len + GUARD_W) * 4;
    float *in = random_floats(r, packed_len(c), 0);
    float *theta = random_floats(r, len, 0), *m = random_floats(r, len, 0);
    float *v = scape_f_update_reads_v(o.update) ? random_floats(r, len, 1) : NULL;
    float *theta_w = xdup(theta, bytes), *m_w = xdup(m, bytes);
    float *v_w = v ? xdup(v, bytes) : NULL;
    ref_update(c, &o, in, theta_w, m_w, v_w);
    kseg_status st = status_new();
    kseg_args a = wargs(c, &st);
    a.in = in;
    a.theta = theta;
    a.m = m;
    a.v = v;
    a.k_cap = o.k_cap;
    a.update = o.update;
    a.b1 = o.h.beta1;
    a.b2 = o.h.beta2;
    a.eps = o.h.eps;
    a.gwd[0] = o.h.wd;
    a.glr[0] = o.lr;
    a.div = o.div;
    a.bc1 = scape_f_bias_correction(o.h.beta1, o.t); /* as dev_update */
    a.bc2 = scape_f_bias_correction(o.h.beta2, o.t);
    run(KSEG_UPDATE, &a);
    char ctx[400];
    snprintf(ctx, sizeof ctx, "%s; update variant %d wd %g t %" PRIu64 " k_cap %" PRIu64,
             c->ctx, o.update, (double)o.h.wd, o.t, o.k_cap);
    ck_assert_msg(st.err == packed_err(c, o.k_cap), "%s: err %u", ctx, st.err);
    expect_same(theta, theta_w, len + GUARD_W, 4, "theta", ctx);
    expect_same(m, m_w, len + GUARD_W, 4, "m", ctx);
    if (v)
        expect_same(v, v_w, len + GUARD_W, 4, "v", ctx);
    free(in);
    free(theta);
    free(m);
    free(v);
    free(theta_w);
    free(m_w);
    free(v_w);
}

START_TEST(update_matches_reference)
{
    rng r = rng_make("update", _i);
    wcase c;
    wcase_new(&r, &c, _i % 4 == 3, "update", _i);
    for (int v = 0; v < 4; v++)
        update_one(&r, &c);
    wcase_free(&c);
}
END_TEST

/* ---- COMPACT ---- */

static void compact_one(rng *r, const wcase *c)
{
    uint64_t len = c->p1 - c->p0, nout = packed_len(c) + GUARD_W, k_cap = pick_k_cap(r, c);
    float *theta = random_floats(r, len, 0), *got = random_floats(r, nout - GUARD_W, 0);
    float *want = xdup(got, nout * 4);
    uint32_t *mask = c->mask ? mask_below(c, k_cap) : NULL;
    seg s;
    for (uint32_t j = 0; j < c->l->nt; j++) {
        size_t k;
        if (seg_get(c, j, &s))
            ck_assert_int_eq(kern_mask_compact_dt(theta + (s.pos - c->p0), seg_mask(mask, &s),
                                                  s.n, want + s.j0, KERN_F32, &k), SCAPE_OK);
    }
    kseg_status st = status_new();
    kseg_args a = wargs(c, &st);
    a.theta = theta;
    a.out = got;
    a.k_cap = k_cap;
    run(KSEG_COMPACT, &a);
    char ctx[400];
    snprintf(ctx, sizeof ctx, "%s; compact k_cap %" PRIu64, c->ctx, k_cap);
    ck_assert_msg(st.err == packed_err(c, k_cap), "%s: err %u", ctx, st.err);
    expect_same(got, want, nout, 4, "out", ctx);
    free(theta);
    free(got);
    free(want);
    free(mask);
}

START_TEST(compact_matches_reference)
{
    rng r = rng_make("compact", _i);
    wcase c;
    wcase_new(&r, &c, _i % 4 == 3, "compact", _i);
    for (int v = 0; v < 4; v++)
        compact_one(&r, &c);
    wcase_free(&c);
}
END_TEST

/* ---- WRITEBACK ---- */

/* kern_mask_expand_dt into every trainer's buffer, per segment. */
static void ref_writeback(const wcase *c, const float *in, const uint32_t *mask, void **tr)
{
    size_t es = c->bf16 ? 2 : 4;
    seg s;
    for (uint32_t q = 0; q < c->ntr; q++)
        for (uint32_t j = 0; j < c->l->nt; j++)
            if (seg_get(c, j, &s))
                ck_assert_int_eq(kern_mask_expand_dt(in + s.j0, KERN_F32, seg_mask(mask, &s),
                                                     s.n, (char *)tr[q] + (s.t->off + s.i0) * es,
                                                     c->bf16 ? KERN_BF16 : KERN_F32),
                                 SCAPE_OK);
}

static void writeback_one(rng *r, wcase *c)
{
    uint64_t k_cap = pick_k_cap(r, c);
    size_t bytes = c->n * (c->bf16 ? 2 : 4);
    float *in = random_floats(r, packed_len(c), 0);
    void *want[KSEG_MAX_TRAINERS];
    for (uint32_t q = 0; q < c->ntr; q++)
        want[q] = xdup(c->tr[q], bytes);
    uint32_t *mask = c->mask ? mask_below(c, k_cap) : NULL;
    ref_writeback(c, in, mask, want);
    kseg_status st = status_new();
    kseg_args a = wargs(c, &st); /* the trainers' buffers are the case's: written in place */
    a.in = in;
    a.k_cap = k_cap;
    run(KSEG_WRITEBACK, &a);
    char ctx[400];
    snprintf(ctx, sizeof ctx, "%s; writeback k_cap %" PRIu64, c->ctx, k_cap);
    ck_assert_msg(st.err == packed_err(c, k_cap), "%s: err %u", ctx, st.err);
    for (uint32_t q = 0; q < c->ntr; q++) {
        expect_same(c->tr[q], want[q], c->n, c->bf16 ? 2 : 4, "trainer buffer", ctx);
        free(want[q]);
    }
    free(in);
    free(mask);
}

START_TEST(writeback_matches_reference)
{
    rng r = rng_make("writeback", _i);
    wcase c;
    wcase_new(&r, &c, _i % 4 == 3, "writeback", _i);
    for (int v = 0; v < 4; v++)
        writeback_one(&r, &c);
    wcase_free(&c);
}
END_TEST

/* ---- COMPACT and WRITEBACK of changes (gather_values: delta) ---- */

/* fp32 trainers at a mask: COMPACT with delta publishes each change from
 * trainer 0's value in bf16 and rounds theta to it, as
 * kern_mask_compact_delta per segment; WRITEBACK with delta adds the
 * changes to every trainer's value, as kern_mask_expand_delta; then every
 * trainer holds the master's bits. */
static void delta_one(rng *r, wcase *c)
{
    uint64_t len = c->p1 - c->p0, nout = packed_len(c);
    float *theta = random_floats(r, len, 0), *want_th = NULL;
    float *old = c->tr[0];
    for (uint64_t p = 0; p < len; p++) /* a step's worth from the held value */
        theta[p] = rng_below(r, 5) ? theta[p] * 1e-3f : 0.0f;
    seg s;
    for (uint32_t j = 0; j < c->l->nt; j++)
        if (seg_get(c, j, &s))
            for (uint64_t i = 0; i < s.n; i++)
                theta[s.pos + i - c->p0] += old[s.t->off + s.i0 + i];
    want_th = xdup(theta, (len + GUARD_W) * 4);
    uint16_t *got = xcalloc(nout + GUARD_W, 2), *want = xcalloc(nout + GUARD_W, 2);
    void *want_tr[KSEG_MAX_TRAINERS];
    for (uint32_t j = 0; j < c->l->nt; j++) {
        size_t k;
        if (seg_get(c, j, &s))
            ck_assert_int_eq(kern_mask_compact_delta(want_th + (s.pos - c->p0),
                                                     old + s.t->off + s.i0,
                                                     seg_mask(c->mask, &s), s.n, want + s.j0,
                                                     &k), SCAPE_OK);
    }
    for (uint32_t q = 0; q < c->ntr; q++) {
        want_tr[q] = xdup(c->tr[q], c->n * 4);
        for (uint32_t j = 0; j < c->l->nt; j++)
            if (seg_get(c, j, &s))
                ck_assert_int_eq(kern_mask_expand_delta(want + s.j0, seg_mask(c->mask, &s), s.n,
                                                        (float *)want_tr[q] + s.t->off + s.i0),
                                 SCAPE_OK);
    }
    kseg_status st = status_new();
    kseg_args a = wargs(c, &st);
    a.theta = theta;
    a.out = (float *)(void *)got;
    a.vbf16 = 1;
    a.delta = 1;
    run(KSEG_COMPACT, &a);
    expect_same(got, want, nout, 2, "delta out", c->ctx);
    expect_same(theta, want_th, len, 4, "delta theta", c->ctx);
    a.in = (const float *)(const void *)got;
    run(KSEG_WRITEBACK, &a);
    ck_assert_msg(st.err == 0, "%s: err %u", c->ctx, st.err);
    for (uint32_t q = 0; q < c->ntr; q++) {
        expect_same(c->tr[q], want_tr[q], c->n, 4, "delta trainer buffer", c->ctx);
        free(want_tr[q]);
    }
    free(theta);
    free(want_th);
    free(got);
    free(want);
}

START_TEST(delta_matches_reference)
{
    rng r = rng_make("delta", _i);
    wcase c;
    wcase_new(&r, &c, 0, "delta", _i);
    if (c.mask && !c.bf16)
        for (int v = 0; v < 3; v++)
            delta_one(&r, &c);
    wcase_free(&c);
}
END_TEST

/* ---- GSUM, LOAD_THETA, CHURN ---- */

/* GSUM: the trainer-order sum of every coordinate, as kern_grad_accum. */
static void gsum_one(rng *r, const wcase *c)
{
    float *got = random_floats(r, c->n, 0), *want = xdup(got, (c->n + GUARD_W) * 4);
    for (uint32_t q = 0; q < c->ntr; q++)
        ck_assert_int_eq(kern_grad_accum(want, c->tr[q], c->bf16 ? KERN_BF16 : KERN_F32, c->n,
                                         q == 0), SCAPE_OK);
    kseg_args a = wargs(c, NULL);
    a.out = got;
    a.n = c->n;
    run(KSEG_GSUM, &a);
    expect_same(got, want, c->n + GUARD_W, 4, "gsum", c->ctx);
    free(got);
    free(want);
}

/* LOAD_THETA: the range's coordinates of a trainer-form buffer, converted
 * as kern_bf16_to_f32 does, into the first n of the state. */
static void load_theta_one(rng *r, const wcase *c)
{
    uint64_t len = c->p1 - c->p0, n = len ? len - rng_below64(r, len) / 4 : 0;
    float *got = random_floats(r, len, 0), *want = xdup(got, (len + GUARD_W) * 4);
    float *f32 = xcalloc(c->n, 4);
    size_t es = c->bf16 ? 2 : 4;
    seg s;
    for (uint32_t j = 0; j < c->l->nt; j++) {
        if (!seg_get(c, j, &s))
            continue;
        const char *src = (const char *)c->tr[0] + (s.t->off + s.i0) * es;
        if (c->bf16)
            ck_assert_int_eq(kern_bf16_to_f32((const uint16_t *)src, f32, s.n), SCAPE_OK);
        else
            memcpy(f32, src, s.n * 4);
        for (uint64_t i = 0; i < s.n && s.pos - c->p0 + i < n; i++)
            want[s.pos - c->p0 + i] = f32[i];
    }
    kseg_args a = wargs(c, NULL);
    a.mask = NULL; /* as dev_load_theta */
    a.in = c->tr[0];
    a.theta = got;
    a.n = n;
    run(KSEG_LOAD_THETA, &a);
    expect_same(got, want, len + GUARD_W, 4, "theta", c->ctx);
    free(got);
    free(want);
    free(f32);
}

/* CHURN: bits of cur not in prev, and bits of cur, over the range's words. */
static void churn_one(rng *r, const wcase *c)
{
    uint32_t *prev = random_mask(r, c->l);
    uint64_t fresh = 0, total = 0;
    for (uint64_t w = c->w0; w < c->w1; w++) {
        size_t x, y;
        uint32_t only = c->mask[w] & ~prev[w];
        ck_assert_int_eq(kern_mask_popcount(&only, 32, &x), SCAPE_OK);
        ck_assert_int_eq(kern_mask_popcount(&c->mask[w], 32, &y), SCAPE_OK);
        fresh += x;
        total += y;
    }
    kseg_status st = status_new();
    st.churn[0] = 7; /* added to, not replaced: the caller zeroes them */
    kseg_args a = wargs(c, &st);
    a.prev = prev;
    run(KSEG_CHURN, &a);
    ck_assert_msg(st.churn[0] == 7 + fresh && st.churn[1] == total, "%s: churn %" PRIu64 "/%"
                  PRIu64 ", want %" PRIu64 "/%" PRIu64, c->ctx, st.churn[0], st.churn[1],
                  7 + fresh, total);
    free(prev);
}

START_TEST(gsum_load_churn_match_reference)
{
    rng r = rng_make("gsum", _i);
    wcase c;
    wcase_new(&r, &c, 0, "gsum/load/churn", _i);
    gsum_one(&r, &c);
    load_theta_one(&r, &c);
    churn_one(&r, &c);
    wcase_free(&c);
}
END_TEST

/* ---- KSEG_E_PACKED: a mask with more bits than k_cap -------------------- */

/* Two tensors at the plan's k, then one bit more in the second: every
 * packing kernel flags it, and none writes the packed index k_cap. */
START_TEST(packed_overflow_flagged)
{
    rng r = rng_make("overflow", 0);
    const uint32_t lens[] = { 100, 50 };
    wcase c;
    memset(&c, 0, sizeof c);
    snprintf(c.ctx, sizeof c.ctx, "overflow");
    c.l = layout_new(lens, 2, 1, 0.1);
    c.nwords = c.l->p->nwords;
    c.n = c.l->p->n;
    c.w1 = c.nwords;
    c.p1 = c.n;
    c.mask = xcalloc(c.nwords, 4);
    mask_exact_k(&r, c.l, c.mask);
    const kseg_tensor *t1 = &c.l->t[1];
    for (uint32_t i = 0; i < t1->len; i++) /* the extra bit: the first clear one */
        if (!(c.mask[t1->word + i / 32] >> (i % 32) & 1u)) {
            c.mask[t1->word + i / 32] |= 1u << (i % 32);
            break;
        }
    c.tiles = scan_words(c.mask, 0, c.nwords, c.ctx);
    c.ntr = 1;
    c.tr[0] = random_floats(&r, c.n, 0);
    uint64_t k_cap = c.l->p->k_total;
    float *theta = random_floats(&r, c.n, 0), *m = random_floats(&r, c.n, 0);
    float *e = random_floats(&r, c.n, 0), *buf = random_floats(&r, k_cap, 0);
    float *v = random_floats(&r, c.n, 1), guard = buf[k_cap];
    static const kseg_kernel ks[] = { KSEG_PACK, KSEG_UPDATE, KSEG_COMPACT, KSEG_WRITEBACK };
    for (int q = 0; q < 4; q++) {
        kseg_status st = status_new();
        kseg_args a = wargs(&c, &st);
        a.k_cap = k_cap;
        a.e = e;
        a.e_write = 1;
        a.out = buf;
        a.in = buf;
        a.theta = theta;
        a.m = m;
        a.v = v;
        a.update = q & 1;
        a.b1 = 0.9f, a.b2 = 0.95f, a.eps = 1e-8f, a.glr[0] = 1e-3f, a.div = 1.0f;
        a.bc1 = a.bc2 = 1.0f;
        run(ks[q], &a);
        ck_assert_msg(st.err == KSEG_E_PACKED, "kernel %d: err %u", (int)ks[q], st.err);
        ck_assert_msg(memcmp(&buf[k_cap], &guard, 4) == 0, "kernel %d wrote index k_cap",
                      (int)ks[q]);
    }
    free(theta);
    free(m);
    free(v);
    free(e);
    free(buf);
    wcase_free(&c);
}
END_TEST

/* ---- the suite ---------------------------------------------------------- */

static Suite *seg_suite(void)
{
    Suite *s = suite_create("seg");
    TCase *tc = tcase_create("maskcode");
    tcase_add_loop_test(tc, encode_matches_maskcode, 0, NRHOS);
    tcase_add_test(tc, encode_refuses_a_bit_past_the_end);
    tcase_add_loop_test(tc, decode_matches_maskcode, 0, 8);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    tc = tcase_create("topk");
    tcase_add_loop_test(tc, topk_matches_reference, 0, 6);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    tc = tcase_create("word_range");
    tcase_add_loop_test(tc, pack_matches_reference, 0, 48);
    tcase_add_loop_test(tc, update_matches_reference, 0, 32);
    tcase_add_loop_test(tc, compact_matches_reference, 0, 24);
    tcase_add_loop_test(tc, writeback_matches_reference, 0, 32);
    tcase_add_loop_test(tc, delta_matches_reference, 0, 32);
    tcase_add_loop_test(tc, gsum_load_churn_match_reference, 0, 12);
    tcase_add_test(tc, packed_overflow_flagged);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    s_seed = pick_seed();
    printf("test_seg: seed %" PRIu64 " (SCAPE_TEST_SEED=%" PRIu64 " replays this run; set it "
           "to another value for other cases)\n", s_seed, s_seed);
    fflush(stdout);
    return check_run(seg_suite());
}
