/* cpu_adam.c - the per-tensor CPU update, every variant (scape_f_update).
 * The scalar formulas are scape_formula.h's, so the masked and dense
 * loops, and the segmented kernels on CPU and GPU, compute identical bits. */
#include "kern_internal.h"

/* Shared validation of theta/m/(v)/sum/mask for the update kernels. */
static scape_rc check_update(const char *fn, const float *theta, const float *m,
                             const float *v, int need_v, const float *sum,
                             size_t k, const uint32_t *mask, size_t n,
                             const kern_hyper *h, float div, float lr)
{
    KERN_NONNULL(fn, theta);
    KERN_NONNULL(fn, m);
    KERN_NONNULL(fn, sum);
    if (need_v)
        KERN_NONNULL(fn, v);
    KERN_MAXN(fn, n);
    scape_rc rc = kern_check_hyper(fn, h);
    if (rc == SCAPE_OK)
        rc = kern_check_div_lr(fn, div, lr);
    if (rc != SCAPE_OK)
        return rc;
    KERN_DISJOINT(fn, theta, n * 4, m, n * 4);
    KERN_DISJOINT(fn, theta, n * 4, sum, k * 4);
    KERN_DISJOINT(fn, m, n * 4, sum, k * 4);
    if (need_v) {
        KERN_DISJOINT(fn, v, n * 4, theta, n * 4);
        KERN_DISJOINT(fn, v, n * 4, m, n * 4);
        KERN_DISJOINT(fn, v, n * 4, sum, k * 4);
    }
    if (mask) {
        size_t mb = kern_mask_words(n) * 4;
        KERN_DISJOINT(fn, mask, mb, theta, n * 4);
        KERN_DISJOINT(fn, mask, mb, m, n * 4);
        if (need_v)
            KERN_DISJOINT(fn, mask, mb, v, n * 4);
    }
    return SCAPE_OK;
}

static size_t masked_count(const uint32_t *mask, size_t n)
{
    size_t k = 0;
    kern_mask_popcount(mask, n, &k);
    return k;
}

/* The update of `variant` for kern_update and the named entries below:
 * fn names the entry in error messages. */
static scape_rc update_run(const char *fn, int variant, float *theta, float *m, float *v,
                           const float *sum, float div, const uint32_t *mask, size_t n,
                           const kern_hyper *h, float lr, uint64_t t)
{
    if (variant < 0 || variant >= SCAPE_UPD_COUNT)
        return scape_set_error(SCAPE_INVALID, "%s: unknown update variant %d (0..%d)", fn,
                               variant, SCAPE_UPD_COUNT - 1);
    int need_v = scape_f_update_reads_v(variant);
    scape_rc rc = check_update(fn, theta, m, v, need_v, sum, mask ? masked_count(mask, n) : n,
                               mask, n, h, div, lr);
    if (rc != SCAPE_OK)
        return rc;
    if (t == 0)
        return scape_set_error(SCAPE_INVALID, "%s: step t must be >= 1", fn);
    if (!need_v)
        v = NULL;
    const float b1 = h->beta1, b2 = h->beta2, eps = h->eps, wd = h->wd;
    const float bc1 = kern_bias_correction(b1, t), bc2 = kern_bias_correction(b2, t);
    if (mask == NULL) {
        for (size_t i = 0; i < n; i++)
            scape_f_update(variant, theta + i, m + i, v ? v + i : NULL,
                           scape_f_clip(scape_f_mean(sum[i], div), h->clip), b1, b2, eps, wd,
                           lr, bc1, bc2);
        return SCAPE_OK;
    }
    size_t nw = kern_mask_words(n), j = 0;
    for (size_t w = 0; w < nw; w++) {
        uint32_t bits = mask[w];
        if (w + 1 == nw && (n & 31))
            bits &= (1u << (n & 31)) - 1u;
        size_t base = w * 32;
        while (bits) {
            size_t i = base + (unsigned)__builtin_ctz(bits);
            scape_f_update(variant, theta + i, m + i, v ? v + i : NULL,
                           scape_f_clip(scape_f_mean(sum[j++], div), h->clip), b1, b2, eps, wd,
                           lr, bc1, bc2);
            bits &= bits - 1;
        }
    }
    return SCAPE_OK;
}

scape_rc kern_update(int variant, float *theta, float *m, float *v, const float *sum, float div,
                     const uint32_t *mask, size_t n, const kern_hyper *h, float lr, uint64_t t)
{
    return update_run("kern_update", variant, theta, m, v, sum, div, mask, n, h, lr, t);
}

/* The named entries: AdamS takes no step (its formula has no bias
 * correction), the masked ones a mask. */
scape_rc kern_adams_masked(float *theta, float *m, const float *sum, float div,
                           const uint32_t *mask, size_t n, const kern_hyper *h, float lr)
{
    KERN_NONNULL("kern_adams_masked", mask);
    return update_run("kern_adams_masked", SCAPE_UPD_ADAMS, theta, m, NULL, sum, div, mask, n,
                      h, lr, 1);
}

scape_rc kern_adams_dense(float *theta, float *m, const float *sum, float div, size_t n,
                          const kern_hyper *h, float lr)
{
    return update_run("kern_adams_dense", SCAPE_UPD_ADAMS, theta, m, NULL, sum, div, NULL, n, h,
                      lr, 1);
}

scape_rc kern_adamw_dense(float *theta, float *m, float *v, const float *sum, float div,
                          size_t n, const kern_hyper *h, float lr, uint64_t t)
{
    return update_run("kern_adamw_dense", SCAPE_UPD_ADAMW, theta, m, v, sum, div, NULL, n, h, lr,
                      t);
}

scape_rc kern_adamw_masked(float *theta, float *m, float *v, const float *sum, float div,
                           const uint32_t *mask, size_t n, const kern_hyper *h, float lr,
                           uint64_t t)
{
    KERN_NONNULL("kern_adamw_masked", mask);
    return update_run("kern_adamw_masked", SCAPE_UPD_ADAMW, theta, m, v, sum, div, mask, n, h,
                      lr, t);
}
