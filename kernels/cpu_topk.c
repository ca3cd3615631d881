/* cpu_topk.c - the mask statistics and exact per-tensor top-k selection.
 *
 * Selection is a radix select on the bits of |stat|: for non-negative floats
 * the IEEE bit pattern orders like the value, so three digit passes (11, 10
 * and 10 bits) find the exact k-th largest key tau and how many keys equal to
 * tau still have to be taken.  A last pass in index order takes every key
 * above tau and the first `need` keys equal to it, which is the ties rule.
 */
#include <string.h>

#include "kern_internal.h"

#define DIGIT_BITS 11
#define NBUCKETS (1u << DIGIT_BITS)

static inline uint32_t key_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u & 0x7fffffffu;
}

scape_rc kern_mask_stat(const float *m, const float *g, const float *e, size_t n,
                        float beta1, float t_r, float *stat)
{
    static const char fn[] = "kern_mask_stat";
    KERN_NONNULL(fn, m);
    KERN_NONNULL(fn, g);
    KERN_NONNULL(fn, e);
    KERN_NONNULL(fn, stat);
    KERN_MAXN(fn, n);
    if (!(beta1 >= 0.0f && beta1 < 1.0f))
        return scape_set_error(SCAPE_INVALID, "%s: beta1=%g out of [0,1)", fn,
                               (double)beta1);
    if (!(t_r >= 1.0f))
        return scape_set_error(SCAPE_INVALID, "%s: t_r=%g must be >= 1", fn,
                               (double)t_r);
    KERN_DISJOINT(fn, stat, n * 4, m, n * 4);
    KERN_DISJOINT(fn, stat, n * 4, g, n * 4);
    KERN_DISJOINT(fn, stat, n * 4, e, n * 4);
    const float c1 = 1.0f - beta1;
    for (size_t i = 0; i < n; i++) {
        float a = g[i] + e[i];
        stat[i] = fabsf(beta1 * m[i] + c1 * (a / t_r));
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
        stat[i] = fabsf(g[i] + e[i]);
    return SCAPE_OK;
}

size_t kern_topk_scratch_bytes(size_t n) { return n * sizeof(uint32_t); }

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

scape_rc kern_topk_mask(const float *stat, size_t n, size_t k, uint32_t *mask,
                        void *scratch, size_t scratch_bytes)
{
    static const char fn[] = "kern_topk_mask";
    KERN_NONNULL(fn, stat);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, scratch);
    KERN_MAXN(fn, n);
    if (k > n)
        return scape_set_error(SCAPE_INVALID, "%s: k=%zu > n=%zu", fn, k, n);
    if (scratch_bytes < kern_topk_scratch_bytes(n))
        return scape_set_error(SCAPE_INVALID,
                               "%s: scratch of %zu bytes < %zu needed", fn,
                               scratch_bytes, kern_topk_scratch_bytes(n));
    size_t nw = kern_mask_words(n);
    KERN_DISJOINT(fn, mask, nw * 4, stat, n * 4);
    KERN_DISJOINT(fn, mask, nw * 4, scratch, scratch_bytes);
    KERN_DISJOINT(fn, stat, n * 4, scratch, scratch_bytes);

    memset(mask, 0, nw * sizeof *mask);
    if (k == 0)
        return SCAPE_OK;

    uint32_t hist[NBUCKETS];
    uint32_t *cand = scratch;
    size_t need = k, ncand = 0;

    /* Digit 1: key bits 30..20 over the whole segment. */
    memset(hist, 0, sizeof hist);
    for (size_t i = 0; i < n; i++)
        hist[key_of(stat[i]) >> 20]++;
    uint32_t b = pick_bucket(hist, NBUCKETS, &need);
    for (size_t i = 0; i < n; i++) {
        uint32_t u = key_of(stat[i]);
        if ((u >> 20) == b)
            cand[ncand++] = u;
    }
    /* Digits 2 and 3: bits 19..10 and 9..0 over the shrinking candidates. */
    for (int shift = 10; shift >= 0; shift -= 10) {
        memset(hist, 0, 1024 * sizeof *hist);
        for (size_t c = 0; c < ncand; c++)
            hist[(cand[c] >> shift) & 1023u]++;
        uint32_t d = pick_bucket(hist, 1024, &need);
        size_t keep = 0;
        for (size_t c = 0; c < ncand; c++)
            if (((cand[c] >> shift) & 1023u) == d)
                cand[keep++] = cand[c];
        ncand = keep;
    }
    const uint32_t tau = cand[0]; /* every remaining candidate equals tau */

    /* Final pass in index order: all keys above tau, and the first `need`
     * keys equal to tau. */
    for (size_t w = 0; w < nw; w++) {
        size_t base = w * 32, len = n - base < 32 ? n - base : 32;
        uint32_t word = 0;
        for (size_t i = 0; i < len; i++) {
            uint32_t u = key_of(stat[base + i]);
            if (u > tau || (u == tau && need > 0 && need--))
                word |= 1u << i;
        }
        mask[w] = word;
    }
    return SCAPE_OK;
}
