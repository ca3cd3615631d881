/* cpu_topk.c - the mask statistics and exact per-tensor top-k selection.
 *
 * Selection is a radix select on the bits of |stat|: for non-negative floats
 * the IEEE bit pattern orders like the value, so digit passes (11, 10 and 10
 * bits) find the exact k-th largest key tau and how many keys equal to tau
 * still have to be taken; every key above tau and the first `need` keys
 * equal to it, in index order, are the top k (the ties rule).  As soon as
 * the bucket holding tau is small (usually after the first pass) one more
 * pass sets every key above the bucket and collects the bucket's keys, and
 * the rest runs on those: two passes over the data instead of four.
 */
#include <string.h>

#include "kern_internal.h"

#define DIGIT_BITS 11
#define NBUCKETS (1u << DIGIT_BITS)

scape_rc kern_mask_stat(const float *m, const float *g, const float *e, size_t n,
                        float beta1, float t_r, float *stat)
{
    static const char fn[] = "kern_mask_stat";
    KERN_NONNULL(fn, m);
    KERN_NONNULL(fn, g);
    KERN_NONNULL(fn, e);
    KERN_NONNULL(fn, stat);
    TRY(kern_check_stat_args(fn, n, m, beta1, t_r));
    KERN_DISJOINT(fn, stat, n * 4, m, n * 4);
    KERN_DISJOINT(fn, stat, n * 4, g, n * 4);
    KERN_DISJOINT(fn, stat, n * 4, e, n * 4);
    const float c1 = 1.0f - beta1;
    for (size_t i = 0; i < n; i++) {
        stat[i] = scape_f_stat(m[i], scape_f_ef(g[i], e[i]), beta1, c1, t_r);
    }
    return SCAPE_OK;
}

scape_rc kern_abs_stat(const float *g, const float *e, size_t n, float *stat)
{
    static const char fn[] = "kern_abs_stat";
    KERN_NONNULL(fn, g);
    KERN_NONNULL(fn, e);
    KERN_NONNULL(fn, stat);
    KERN_MAXN(fn, n);
    KERN_DISJOINT(fn, stat, n * 4, g, n * 4);
    KERN_DISJOINT(fn, stat, n * 4, e, n * 4);
    for (size_t i = 0; i < n; i++)
        stat[i] = scape_f_abs_stat(scape_f_ef(g[i], e[i]));
    return SCAPE_OK;
}

/* Where the keys come from: a stored statistic, or one computed on the fly
 * with exactly the expressions of kern_mask_stat / kern_abs_stat, from
 * a = g + e, or from a already stored (at the j-th set bit of `sent` in
 * packed[j], elsewhere in e). */
typedef struct key_src {
    const float *stat;      /* stored statistic, or NULL */
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
    if (s->stat) {
        for (size_t i = 0; i < len; i++)
            out[i] = scape_f_key(s->stat[base + i]);
        return;
    }
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
    return n ? NBUCKETS * sizeof(uint32_t) + cand_cap(n) * sizeof(cand) : 0;
}

/* Walk the histogram from the top; return the bucket holding the need-th
 * largest key and reduce *need by the count of all larger buckets. */
static uint32_t pick_bucket(const uint32_t *hist, uint32_t nb, size_t *need)
{
    size_t above = 0;
    uint32_t d = nb - 1;
    for (;; d--) {
        if (above + hist[d] >= *need || d == 0)
            break;
        above += hist[d];
    }
    *need -= above;
    return d;
}

/* The three digits of a 31-bit key: bits 30..20, 19..10, 9..0. */
static const int s_shift[3] = { 20, 10, 0 };
static const int s_bits[3] = { DIGIT_BITS, 10, 10 };

/* Histogram of digit d over the keys whose higher digits equal prefix. */
static void hist_pass(const key_src *src, size_t n, int d, uint32_t prefix, uint32_t *hist)
{
    memset(hist, 0, ((size_t)1 << s_bits[d]) * sizeof *hist);
    int hi = s_shift[d] + s_bits[d]; /* bits above this digit */
    uint32_t dmask = (1u << s_bits[d]) - 1u;
    size_t j = 0;
    uint32_t keys[32];
    for (size_t base = 0; base < n; base += 32) {
        size_t len = n - base < 32 ? n - base : 32;
        word_keys(src, base, len, &j, keys);
        for (size_t i = 0; i < len; i++)
            if (d == 0 || (keys[i] >> hi) == prefix)
                hist[(keys[i] >> s_shift[d]) & dmask]++;
    }
}

/* The last pass over the data, in index order.  With the bucket of the
 * k-th largest key known (its top bits `prefix`, `shift` low bits
 * undecided) and small enough: set the bits of every key above the bucket
 * and collect the bucket's keys in c; the rest of the selection runs on those
 * alone.  With every bit known (shift 0, prefix = tau, c NULL): every key
 * above tau and the first `need` keys equal to it (the ties rule).
 * Returns nonzero when the bucket held more than the `cap` keys the
 * histogram counted: the input changed between the passes (a trainer writing
 * the gradient it posted); the mask is then incomplete. */
static int finish_in_bucket(const key_src *src, size_t n, uint32_t prefix, int shift,
                            size_t need, uint32_t *mask, cand *c, size_t cap, uint32_t *hist)
{
    size_t nw = kern_mask_words(n), j = 0, nc = 0;
    int overflow = 0;
    uint32_t keys[32];
    for (size_t w = 0; w < nw; w++) {
        size_t base = w * 32, len = n - base < 32 ? n - base : 32;
        uint32_t word = 0;
        word_keys(src, base, len, &j, keys);
        for (size_t i = 0; i < len; i++) {
            uint32_t top = keys[i] >> shift;
            if (top > prefix)
                word |= 1u << i;
            else if (top == prefix && c && nc < cap)
                c[nc++] = (cand){ (uint32_t)(base + i), keys[i] };
            else if (top == prefix && c)
                overflow = 1;
            else if (top == prefix && need > 0 && need--)
                word |= 1u << i;
        }
        mask[w] = word;
    }
    /* the remaining digits, 10 bits each, over the candidates */
    uint32_t low = 0, lmask = (1u << shift) - 1u;
    for (int done = 0; done < shift; done += 10) {
        int sh = shift - done - 10;
        memset(hist, 0, 1024 * sizeof *hist);
        for (size_t q = 0; q < nc; q++) {
            uint32_t l = c[q].key & lmask;
            if ((l >> (sh + 10)) == low)
                hist[(l >> sh) & 1023u]++;
        }
        low = (low << 10) | pick_bucket(hist, 1024, &need);
    }
    uint32_t tau = (prefix << shift) | low;
    for (size_t q = 0; q < nc; q++)
        if (c[q].key > tau || (c[q].key == tau && need > 0 && need--))
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
    cand *c = (cand *)(void *)((char *)scratch + NBUCKETS * sizeof(uint32_t));
    size_t cap = (scratch_bytes - NBUCKETS * sizeof(uint32_t)) / sizeof(cand);
    size_t need = k;
    uint32_t prefix = 0;
    for (int d = 0; d < 3; d++) {
        hist_pass(src, n, d, prefix, hist);
        uint32_t b = pick_bucket(hist, 1u << s_bits[d], &need);
        size_t in_bucket = hist[b];
        prefix = (prefix << s_bits[d]) | b;
        if (d < 2 && in_bucket <= cap) {
            if (finish_in_bucket(src, n, prefix, s_shift[d], need, mask, c, in_bucket, hist))
                return scape_set_error(SCAPE_INVALID,
                                       "%s: the input changed while it was being selected "
                                       "from (is its writer still running?)", fn);
            return SCAPE_OK;
        }
    }
    finish_in_bucket(src, n, prefix, 0, need, mask, NULL, 0, hist);
    return SCAPE_OK;
}

scape_rc kern_topk_mask(const float *stat, size_t n, size_t k, uint32_t *mask,
                        void *scratch, size_t scratch_bytes)
{
    static const char fn[] = "kern_topk_mask";
    KERN_NONNULL(fn, stat);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, scratch);
    KERN_MAXN(fn, n);
    size_t nw = kern_mask_words(n);
    KERN_DISJOINT(fn, mask, nw * 4, stat, n * 4);
    KERN_DISJOINT(fn, stat, n * 4, scratch, scratch_bytes);
    key_src src = { .stat = stat };
    return topk_run(fn, &src, n, k, mask, scratch, scratch_bytes);
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

scape_rc kern_stat_packed(const float *m, const uint32_t *sent, const float *packed_a, size_t n,
                          float beta1, float t_r, float *packed_stat)
{
    return kern_stat_packed_rest(m, sent, packed_a, NULL, n, beta1, t_r, packed_stat);
}

scape_rc kern_stat_packed_rest(const float *m, const uint32_t *sent, const float *packed_a,
                               const float *rest, size_t n, float beta1, float t_r,
                               float *packed_stat)
{
    static const char fn[] = "kern_stat_packed";
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
