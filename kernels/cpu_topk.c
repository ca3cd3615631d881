/* cpu_topk.c - the exact per-tensor top-k selection of the host executor.
 *
 * Selection is the radix select of scape_seg.h on the bits of |stat|: for
 * non-negative floats the IEEE bit pattern orders like the value, so digit
 * passes (11, 10 and 10 bits: kseg_digit, kseg_pick) find the exact k-th
 * largest key tau and how many keys equal to tau still have to be taken;
 * every key above tau and the first `need` keys equal to it, in index order,
 * are the top k (the ties rule, kseg_topk_word).  Unlike the segmented
 * version it keeps no keys: the statistic is recomputed in each pass.  As
 * soon as the bucket holding tau is small (usually after the first pass) one
 * more pass sets every key above the bucket and collects the bucket's keys,
 * and the rest runs on those: two passes over the data instead of four.
 */
#include <string.h>

#include "kern_internal.h"
#include "scape_seg.h"

/* Where the keys come from: the statistic computed on the fly with exactly
 * the expressions of scape_f_stat / scape_f_abs_stat, from a = g + e, or
 * from a already stored (at the j-th set bit of `sent` in packed[j],
 * elsewhere in e). */
typedef struct key_src {
    const float *m;         /* NULL: the statistic is |a| */
    const float *g, *e;     /* g == NULL: a is stored */
    const uint32_t *sent;   /* stored a: the mask that was packed, or NULL */
    const float *packed;
    int packed_stat;        /* packed holds the statistic at sent's bits, not a */
    float beta1, c1, t_r;
} key_src;

/* The statistic of one coordinate: the one expression every path uses. */
static inline float stat_of(const float *m, float m_i, float a, float beta1, float c1, float t_r)
{
    return m ? scape_f_stat(m_i, a, beta1, c1, t_r) : scape_f_abs_stat(a);
}

/* Keys of the elements [base, base + len) of one mask word (len <= 32) into
 * out; *j counts the set bits of `sent` passed so far.  Word at a time, so
 * the arithmetic vectorises. */
static void word_keys(const key_src *s, size_t base, size_t len, size_t *j, uint32_t *out)
{
    float a[32];
    uint32_t bits = 0; /* stored a: the packed coordinates of this word */
    if (s->g) {
        for (size_t i = 0; i < len; i++)
            a[i] = scape_f_ef(s->g[base + i], s->e[base + i]);
    } else {
        memcpy(a, s->e + base, len * sizeof *a);
        bits = s->sent ? s->sent[base / 32] : 0;
        if (len < 32)
            bits &= (1u << len) - 1u;
        /* a = what was sent + what stayed: the residual there is 0 (fp32
         * values) or a - bf16(a) (bf16 values), exact either way */
        if (!s->packed_stat)
            for (uint32_t b = bits; b; b &= b - 1) {
                unsigned i = (unsigned)__builtin_ctz(b);
                a[i] = s->packed[(*j)++] + a[i];
            }
    }
    if (s->m)
        for (size_t i = 0; i < len; i++)
            out[i] = scape_f_key(stat_of(s->m, s->m[base + i], a[i], s->beta1, s->c1, s->t_r));
    else
        for (size_t i = 0; i < len; i++)
            out[i] = scape_f_key(stat_of(NULL, 0.0f, a[i], 0.0f, 0.0f, 1.0f));
    if (s->packed_stat) /* the statistic there was taken beforehand */
        for (; bits; bits &= bits - 1)
            out[__builtin_ctz(bits)] = scape_f_key(s->packed[(*j)++]);
}

/* A key that may be the k-th largest: in the histogram bucket that holds it. */
typedef struct cand {
    uint32_t idx, key;
} cand;

#define CAND_CAP 32768u /* candidates kept in the scratch: 256 KiB */

static size_t cand_cap(size_t n) { return n < CAND_CAP ? n : CAND_CAP; }

size_t kern_topk_scratch_bytes(size_t n)
{
    return n ? KSEG_BINS0 * sizeof(uint32_t) + cand_cap(n) * sizeof(cand) : 0;
}

/* The bits below digit `level` (scape_seg.h's digits: 30..20, 19..10, 9..0). */
static const int s_shift[3] = { 20, 10, 0 };

/* Histogram of digit d over the keys whose higher digits are those st chose;
 * inlined once per digit, so the digit's tests fold. */
static inline __attribute__((always_inline)) void hist_digit(const key_src *src, size_t n,
                                                             const int d, const kseg_tstate *st,
                                                             uint32_t *hist)
{
    memset(hist, 0, (d ? KSEG_BINS : KSEG_BINS0) * sizeof *hist);
    size_t j = 0;
    uint32_t keys[32];
    for (size_t base = 0; base < n; base += 32) {
        size_t len = n - base < 32 ? n - base : 32;
        word_keys(src, base, len, &j, keys);
        for (size_t i = 0; i < len; i++)
            if (kseg_in_prefix(st, keys[i], d))
                hist[kseg_digit(keys[i], d)]++;
    }
}

static void hist_pass(const key_src *src, size_t n, int d, const kseg_tstate *st, uint32_t *hist)
{
    if (d == 0)
        hist_digit(src, n, 0, st, hist);
    else if (d == 1)
        hist_digit(src, n, 1, st, hist);
    else
        hist_digit(src, n, 2, st, hist);
}

/* Pick digit `level`'s bucket from its histogram into st (scape_seg.h). */
static uint32_t pick(kseg_tstate *st, int level, const uint32_t *hist)
{
    uint32_t above, b = kseg_pick(hist, level ? KSEG_BINS : KSEG_BINS0, st->need, &above);
    kseg_record_digit(st, level, b, st->need - above, hist[b]);
    return hist[b];
}

/* Every key above tau and the first st->need keys equal to it, word by
 * word in index order (the ties rule of scape_seg.h): the last pass once
 * all three digits are known. */
static void write_mask(const key_src *src, size_t n, const kseg_tstate *st, uint32_t *mask)
{
    size_t nw = kern_mask_words(n), j = 0;
    uint32_t keys[32], off = 0;
    for (size_t w = 0; w < nw; w++) {
        size_t base = w * 32, len = n - base < 32 ? n - base : 32;
        uint32_t gt = 0, eq = 0;
        word_keys(src, base, len, &j, keys);
        for (size_t i = 0; i < len; i++) {
            gt |= (uint32_t)(keys[i] > st->tau) << i;
            eq |= (uint32_t)(keys[i] == st->tau) << i;
        }
        mask[w] = kseg_topk_word(st, gt, eq, off);
        off += (uint32_t)__builtin_popcount(eq);
    }
}

/* The last pass over the data, in index order, once the bucket of digit
 * `level` that holds the k-th largest key is known and small enough: set
 * the bits of every key above the bucket and collect the bucket's keys in c;
 * the remaining digits and the ties are then chosen among those alone.
 * Returns nonzero when the bucket held more than the `cap` keys the
 * histogram counted: the input changed between the passes (a trainer writing
 * the gradient it posted); the mask is then incomplete. */
static int finish_in_bucket(const key_src *src, size_t n, kseg_tstate *st, int level,
                            uint32_t *mask, cand *c, size_t cap, uint32_t *hist)
{
    const int shift = s_shift[level];
    const uint32_t prefix = level == 0 ? st->digit[0] : (st->digit[0] << 10) | st->digit[1];
    size_t nw = kern_mask_words(n), j = 0, nc = 0;
    int overflow = 0;
    uint32_t keys[32];
    for (size_t w = 0; w < nw; w++) {
        size_t base = w * 32, len = n - base < 32 ? n - base : 32;
        uint32_t word = 0;
        word_keys(src, base, len, &j, keys);
        for (size_t i = 0; i < len; i++) {
            uint32_t top = keys[i] >> shift;
            if (top > prefix) {
                word |= 1u << i;
            } else if (top == prefix) {
                if (nc < cap)
                    c[nc++] = (cand){ (uint32_t)(base + i), keys[i] };
                else
                    overflow = 1;
            }
        }
        mask[w] = word;
    }
    /* the remaining digits over the candidates */
    for (int d = level + 1; d < 3; d++) {
        memset(hist, 0, KSEG_BINS * sizeof *hist);
        for (size_t q = 0; q < nc; q++)
            if (kseg_in_prefix(st, c[q].key, d))
                hist[kseg_digit(c[q].key, d)]++;
        pick(st, d, hist);
    }
    uint32_t need = st->need; /* the ties, in index order */
    for (size_t q = 0; q < nc; q++)
        if (c[q].key > st->tau || (c[q].key == st->tau && need > 0 && need--))
            mask[c[q].idx / 32] |= 1u << (c[q].idx % 32);
    return overflow;
}

/* Radix select, digit by digit from the top: after each histogram pass, if
 * the bucket holding the k-th largest key has at most `cap` keys the
 * selection finishes on those (two passes over the data for most inputs);
 * otherwise the next digit narrows it, and with all three digits known a
 * last pass writes the mask. */
static scape_rc topk_run(const char *fn, const key_src *src, size_t n, size_t k,
                         uint32_t *mask, void *scratch, size_t scratch_bytes)
{
    if (k > n)
        return scape_set_error(SCAPE_INVALID, "%s: k=%zu > n=%zu", fn, k, n);
    if (scratch_bytes < kern_topk_scratch_bytes(n))
        return scape_set_error(SCAPE_INVALID,
                               "%s: scratch of %zu bytes < %zu needed", fn,
                               scratch_bytes, kern_topk_scratch_bytes(n));
    size_t nw = kern_mask_words(n);
    KERN_DISJOINT(fn, mask, nw * 4, scratch, scratch_bytes);
    memset(mask, 0, nw * sizeof *mask);
    if (k == 0)
        return SCAPE_OK;
    uint32_t *hist = scratch;
    cand *c = (cand *)(void *)((char *)scratch + KSEG_BINS0 * sizeof(uint32_t));
    size_t cap = (scratch_bytes - KSEG_BINS0 * sizeof(uint32_t)) / sizeof(cand);
    kseg_tstate st = { { 0, 0, 0 }, (uint32_t)k, 0, 0 };
    for (int d = 0; d < 2; d++) {
        hist_pass(src, n, d, &st, hist);
        size_t in_bucket = pick(&st, d, hist);
        if (in_bucket <= cap) {
            if (finish_in_bucket(src, n, &st, d, mask, c, in_bucket, hist))
                return scape_set_error(SCAPE_INVALID,
                                       "%s: the input changed while it was being selected "
                                       "from (is its writer still running?)", fn);
            return SCAPE_OK;
        }
    }
    hist_pass(src, n, 2, &st, hist);
    pick(&st, 2, hist);
    write_mask(src, n, &st, mask);
    return SCAPE_OK;
}

scape_rc kern_topk_ef(const float *m, const float *g, const float *e, size_t n,
                      float beta1, float t_r, size_t k, uint32_t *mask, void *scratch,
                      size_t scratch_bytes)
{
    static const char fn[] = "kern_topk_ef";
    KERN_NONNULL(fn, g);
    KERN_NONNULL(fn, e);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, scratch);
    TRY(kern_check_stat_args(fn, n, m, beta1, t_r));
    size_t mb = kern_mask_words(n) * 4;
    KERN_DISJOINT(fn, mask, mb, g, n * 4);
    KERN_DISJOINT(fn, mask, mb, e, n * 4);
    if (m)
        KERN_DISJOINT(fn, mask, mb, m, n * 4);
    key_src src = { .m = m, .g = g, .e = e, .beta1 = beta1, .c1 = 1.0f - beta1, .t_r = t_r };
    return topk_run(fn, &src, n, k, mask, scratch, scratch_bytes);
}

scape_rc kern_topk_packed(const float *m, const float *e, const uint32_t *sent,
                          const float *packed, size_t n, float beta1, float t_r, size_t k,
                          uint32_t *mask, void *scratch, size_t scratch_bytes)
{
    static const char fn[] = "kern_topk_packed";
    KERN_NONNULL(fn, e);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, scratch);
    if (sent)
        KERN_NONNULL(fn, packed);
    TRY(kern_check_stat_args(fn, n, m, beta1, t_r));
    size_t mb = kern_mask_words(n) * 4, kp = 0;
    if (sent)
        kern_mask_popcount(sent, n, &kp);
    KERN_DISJOINT(fn, mask, mb, e, n * 4);
    if (m)
        KERN_DISJOINT(fn, mask, mb, m, n * 4);
    if (sent) {
        KERN_DISJOINT(fn, mask, mb, sent, mb);
        KERN_DISJOINT(fn, mask, mb, packed, kp * 4);
    }
    key_src src = { .m = m, .e = e, .sent = sent, .packed = packed, .beta1 = beta1,
                    .c1 = 1.0f - beta1, .t_r = t_r };
    return topk_run(fn, &src, n, k, mask, scratch, scratch_bytes);
}

scape_rc kern_stat_packed_rest(const float *m, const uint32_t *sent, const float *packed_a,
                               const float *rest, size_t n, float beta1, float t_r,
                               float *packed_stat)
{
    static const char fn[] = "kern_stat_packed_rest";
    KERN_NONNULL(fn, sent);
    KERN_NONNULL(fn, packed_a);
    KERN_NONNULL(fn, packed_stat);
    TRY(kern_check_stat_args(fn, n, m, beta1, t_r));
    size_t kp = 0;
    kern_mask_popcount(sent, n, &kp);
    KERN_DISJOINT(fn, packed_stat, kp * 4, packed_a, kp * 4);
    if (m)
        KERN_DISJOINT(fn, packed_stat, kp * 4, m, n * 4);
    const float c1 = 1.0f - beta1;
    size_t j = 0;
    for (size_t base = 0; base < n; base += 32) {
        uint32_t bits = sent[base / 32];
        if (n - base < 32)
            bits &= (1u << (n - base)) - 1u;
        for (; bits; bits &= bits - 1, j++) {
            size_t i = base + (size_t)__builtin_ctz(bits);
            float av = rest ? packed_a[j] + rest[i] : packed_a[j];
            packed_stat[j] = stat_of(m, m ? m[i] : 0.0f, av, beta1, c1, t_r);
        }
    }
    return SCAPE_OK;
}

scape_rc kern_topk_prestat(const float *m, const float *e, const uint32_t *sent,
                           const float *packed_stat, size_t n, float beta1, float t_r,
                           size_t k, uint32_t *mask, void *scratch, size_t scratch_bytes)
{
    static const char fn[] = "kern_topk_prestat";
    KERN_NONNULL(fn, e);
    KERN_NONNULL(fn, sent);
    KERN_NONNULL(fn, packed_stat);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, scratch);
    TRY(kern_check_stat_args(fn, n, m, beta1, t_r));
    size_t mb = kern_mask_words(n) * 4, kp = 0;
    kern_mask_popcount(sent, n, &kp);
    KERN_DISJOINT(fn, mask, mb, e, n * 4);
    if (m)
        KERN_DISJOINT(fn, mask, mb, m, n * 4);
    KERN_DISJOINT(fn, mask, mb, sent, mb);
    KERN_DISJOINT(fn, mask, mb, packed_stat, kp * 4);
    key_src src = { .m = m, .e = e, .sent = sent, .packed = packed_stat, .packed_stat = 1,
                    .beta1 = beta1, .c1 = 1.0f - beta1, .t_r = t_r };
    return topk_run(fn, &src, n, k, mask, scratch, scratch_bytes);
}
