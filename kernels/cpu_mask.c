/* cpu_mask.c - CPU reference of the pack and the mask bit helpers. */
#include <string.h>

#include "kern_internal.h"

/* Bits of the last, partial word that belong to a segment of n elements. */
static uint32_t tail_bits(size_t n)
{
    size_t r = n & 31;
    return r ? ((1u << r) - 1u) : 0xffffffffu;
}

/* Set bits among the first n bits; the tail of the last word is ignored. */
static size_t popcount_n(const uint32_t *mask, size_t n)
{
    size_t nw = kern_mask_words(n), c = 0, w = 0;
    for (; w + 2 < nw; w += 2) { /* two words per 64-bit popcount */
        uint64_t pair;
        memcpy(&pair, mask + w, sizeof pair);
        c += (size_t)__builtin_popcountll(pair);
    }
    for (; w + 1 < nw; w++)
        c += (size_t)__builtin_popcount(mask[w]);
    if (nw)
        c += (size_t)__builtin_popcount(mask[nw - 1] & tail_bits(n));
    return c;
}

scape_rc kern_mask_popcount(const uint32_t *mask, size_t n, size_t *count)
{
    KERN_NONNULL("kern_mask_popcount", mask);
    KERN_NONNULL("kern_mask_popcount", count);
    KERN_MAXN("kern_mask_popcount", n);
    *count = popcount_n(mask, n);
    return SCAPE_OK;
}

static scape_rc pack_ef(const char *fn, const float *g, float *e, const uint32_t *mask,
                        size_t n, float *out, size_t *k_out, int bf16)
{
    KERN_NONNULL(fn, g);
    KERN_NONNULL(fn, e);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, out);
    KERN_NONNULL(fn, k_out);
    KERN_MAXN(fn, n);
    size_t k = popcount_n(mask, n), nw = kern_mask_words(n);
    KERN_DISJOINT(fn, g, n * 4, e, n * 4);
    KERN_DISJOINT(fn, out, k * 4, e, n * 4);
    KERN_DISJOINT(fn, out, k * 4, g, n * 4);
    KERN_DISJOINT(fn, mask, nw * 4, e, n * 4);
    KERN_DISJOINT(fn, mask, nw * 4, out, k * 4);

    size_t j = 0;
    for (size_t w = 0; w < nw; w++) {
        size_t base = w * 32, len = n - base < 32 ? n - base : 32;
        const float *gw = g + base;
        float *ew = e + base;
        uint32_t bits = mask[w] & (len == 32 ? 0xffffffffu : tail_bits(n));
        /* a = g + e for the whole word, then move the set bits out. */
        for (size_t i = 0; i < len; i++)
            ew[i] = scape_f_ef(gw[i], ew[i]);
        if (bits == 0xffffffffu && !bf16) {
            memcpy(out + j, ew, 32 * sizeof(float));
            memset(ew, 0, 32 * sizeof(float));
            j += 32;
            continue;
        }
        while (bits) {
            unsigned i = (unsigned)__builtin_ctz(bits);
            out[j++] = scape_f_send(ew[i], bf16, &ew[i]);
            bits &= bits - 1;
        }
    }
    *k_out = j;
    return SCAPE_OK;
}

scape_rc kern_pack_ef(const float *g, float *e, const uint32_t *mask, size_t n,
                      float *out, size_t *k_out)
{
    return pack_ef("kern_pack_ef", g, e, mask, n, out, k_out, 0);
}

scape_rc kern_pack_ef_bf16(const float *g, float *e, const uint32_t *mask, size_t n,
                           float *out, size_t *k_out)
{
    return pack_ef("kern_pack_ef_bf16", g, e, mask, n, out, k_out, 1);
}

scape_rc kern_mask_compact_dt(const float *dense, const uint32_t *mask, size_t n,
                              void *packed, kern_dtype pdt, size_t *k_out)
{
    static const char fn[] = "kern_mask_compact_dt";
    KERN_NONNULL(fn, dense);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, packed);
    KERN_NONNULL(fn, k_out);
    KERN_MAXN(fn, n);
    scape_rc rc = kern_check_dtype(fn, pdt);
    if (rc != SCAPE_OK)
        return rc;
    size_t k = popcount_n(mask, n), nw = kern_mask_words(n), esz = kern_dtype_size(pdt);
    KERN_DISJOINT(fn, packed, k * esz, dense, n * 4);
    KERN_DISJOINT(fn, packed, k * esz, mask, nw * 4);

    int bf16 = pdt == KERN_BF16;
    size_t j = 0;
    for (size_t w = 0; w < nw; w++) {
        uint32_t bits = mask[w] & (w + 1 == nw ? tail_bits(n) : 0xffffffffu);
        const float *dw = dense + w * 32;
        while (bits) {
            unsigned i = (unsigned)__builtin_ctz(bits);
            scape_f_store(packed, bf16, j++, dw[i]);
            bits &= bits - 1;
        }
    }
    *k_out = j;
    return SCAPE_OK;
}

scape_rc kern_mask_expand_dt(const void *packed, kern_dtype pdt, const uint32_t *mask,
                             size_t n, void *dense, kern_dtype dt)
{
    static const char fn[] = "kern_mask_expand_dt";
    KERN_NONNULL(fn, packed);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, dense);
    KERN_MAXN(fn, n);
    scape_rc rc = kern_check_dtype(fn, dt);
    if (rc == SCAPE_OK)
        rc = kern_check_dtype(fn, pdt);
    if (rc != SCAPE_OK)
        return rc;
    size_t k = popcount_n(mask, n), nw = kern_mask_words(n);
    size_t dbytes = n * kern_dtype_size(dt);
    KERN_DISJOINT(fn, packed, k * kern_dtype_size(pdt), dense, dbytes);
    KERN_DISJOINT(fn, mask, nw * 4, dense, dbytes);

    size_t j = 0;
    for (size_t w = 0; w < nw; w++) {
        uint32_t bits = mask[w] & (w + 1 == nw ? tail_bits(n) : 0xffffffffu);
        size_t base = w * 32;
        if (dt == KERN_F32 && pdt == KERN_F32) {
            float *d = (float *)dense + base;
            while (bits) {
                unsigned i = (unsigned)__builtin_ctz(bits);
                d[i] = ((const float *)packed)[j++];
                bits &= bits - 1;
            }
        } else if (dt == KERN_BF16 && pdt == KERN_BF16) {
            uint16_t *d = (uint16_t *)dense + base;
            while (bits) {
                unsigned i = (unsigned)__builtin_ctz(bits);
                d[i] = ((const uint16_t *)packed)[j++];
                bits &= bits - 1;
            }
        } else {
            while (bits) {
                unsigned i = (unsigned)__builtin_ctz(bits);
                scape_f_store(dense, dt == KERN_BF16, base + i,
                              scape_f_load(packed, pdt == KERN_BF16, j++));
                bits &= bits - 1;
            }
        }
    }
    return SCAPE_OK;
}

scape_rc kern_mask_compact_delta(float *theta, const float *old, const uint32_t *mask,
                                 size_t n, uint16_t *packed, size_t *k_out)
{
    static const char fn[] = "kern_mask_compact_delta";
    KERN_NONNULL(fn, theta);
    KERN_NONNULL(fn, old);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, packed);
    KERN_NONNULL(fn, k_out);
    KERN_MAXN(fn, n);
    size_t k = popcount_n(mask, n), nw = kern_mask_words(n);
    KERN_DISJOINT(fn, packed, k * 2, theta, n * 4);
    KERN_DISJOINT(fn, packed, k * 2, old, n * 4);
    KERN_DISJOINT(fn, theta, n * 4, old, n * 4);
    size_t j = 0;
    for (size_t w = 0; w < nw; w++) {
        uint32_t bits = mask[w] & (w + 1 == nw ? tail_bits(n) : 0xffffffffu);
        while (bits) {
            size_t i = w * 32 + (unsigned)__builtin_ctz(bits);
            float d = scape_f_delta(old[i], theta[i]);
            theta[i] = scape_f_apply_delta(old[i], d);
            scape_f_store(packed, 1, j++, d);
            bits &= bits - 1;
        }
    }
    *k_out = j;
    return SCAPE_OK;
}

scape_rc kern_mask_expand_delta(const uint16_t *packed, const uint32_t *mask, size_t n,
                                float *dense)
{
    static const char fn[] = "kern_mask_expand_delta";
    KERN_NONNULL(fn, packed);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, dense);
    KERN_MAXN(fn, n);
    size_t k = popcount_n(mask, n), nw = kern_mask_words(n);
    KERN_DISJOINT(fn, packed, k * 2, dense, n * 4);
    KERN_DISJOINT(fn, mask, nw * 4, dense, n * 4);
    size_t j = 0;
    for (size_t w = 0; w < nw; w++) {
        uint32_t bits = mask[w] & (w + 1 == nw ? tail_bits(n) : 0xffffffffu);
        while (bits) {
            size_t i = w * 32 + (unsigned)__builtin_ctz(bits);
            dense[i] = scape_f_apply_delta(dense[i], scape_f_load(packed, 1, j++));
            bits &= bits - 1;
        }
    }
    return SCAPE_OK;
}
