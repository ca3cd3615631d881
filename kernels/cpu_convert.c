/* cpu_convert.c - gradient intake and fp32/bf16 conversion (the formulas of
 * scape_formula.h: the trainer-order sum and the bf16 rounding). */
#include "kern_internal.h"

scape_rc kern_grad_accum(float *dst, const void *src, kern_dtype dt, size_t n,
                         int overwrite)
{
    static const char fn[] = "kern_grad_accum";
    KERN_NONNULL(fn, dst);
    KERN_NONNULL(fn, src);
    KERN_MAXN(fn, n);
    scape_rc rc = kern_check_dtype(fn, dt);
    if (rc != SCAPE_OK)
        return rc;
    KERN_DISJOINT(fn, dst, n * 4, src, n * kern_dtype_size(dt));
    if (dt == KERN_F32) {
        const float *s = src;
        if (overwrite)
            for (size_t i = 0; i < n; i++)
                dst[i] = s[i];
        else
            for (size_t i = 0; i < n; i++)
                dst[i] = scape_f_grad_add(dst[i], s[i]);
    } else {
        const uint16_t *s = src;
        if (overwrite)
            for (size_t i = 0; i < n; i++)
                dst[i] = scape_f_from_bf16(s[i]);
        else
            for (size_t i = 0; i < n; i++)
                dst[i] = scape_f_grad_add(dst[i], scape_f_from_bf16(s[i]));
    }
    return SCAPE_OK;
}

scape_rc kern_f32_to_bf16(const float *src, uint16_t *dst, size_t n)
{
    KERN_NONNULL("kern_f32_to_bf16", src);
    KERN_NONNULL("kern_f32_to_bf16", dst);
    KERN_MAXN("kern_f32_to_bf16", n);
    KERN_DISJOINT("kern_f32_to_bf16", src, n * 4, dst, n * 2);
    for (size_t i = 0; i < n; i++)
        dst[i] = scape_f_bf16(src[i]);
    return SCAPE_OK;
}

scape_rc kern_bf16_to_f32(const uint16_t *src, float *dst, size_t n)
{
    KERN_NONNULL("kern_bf16_to_f32", src);
    KERN_NONNULL("kern_bf16_to_f32", dst);
    KERN_MAXN("kern_bf16_to_f32", n);
    KERN_DISJOINT("kern_bf16_to_f32", src, n * 2, dst, n * 4);
    for (size_t i = 0; i < n; i++)
        dst[i] = scape_f_from_bf16(src[i]);
    return SCAPE_OK;
}
