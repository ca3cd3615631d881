/* kern_internal.h - argument checks and helpers shared by the per-tensor
 * CPU kernels and cuda_comm.cu.  Not installed; included only by kernels/. */
#ifndef SCAPE_KERN_INTERNAL_H
#define SCAPE_KERN_INTERNAL_H

#include <math.h>
#include <stdint.h>

#include "scape_kernels.h"
#include "try.h"

/* Largest segment a kernel accepts: counts travel as uint32_t. */
#define KERN_MAX_N ((size_t)UINT32_MAX)

/* Reject a null pointer argument of function fn. */
#define KERN_NONNULL(fn, p)                                                    \
    do {                                                                       \
        if ((p) == NULL)                                                       \
            return scape_set_error(SCAPE_INVALID, "%s: %s is NULL", fn, #p);   \
    } while (0)

/* Reject a segment longer than KERN_MAX_N. */
#define KERN_MAXN(fn, n)                                                       \
    do {                                                                       \
        if ((n) > KERN_MAX_N)                                                  \
            return scape_set_error(SCAPE_INVALID,                              \
                                   "%s: n=%zu exceeds the segment limit %zu",  \
                                   fn, (size_t)(n), KERN_MAX_N);               \
    } while (0)

/* Reject two buffers [a, a+abytes) and [b, b+bbytes) that overlap. */
#define KERN_DISJOINT(fn, a, abytes, b, bbytes)                                \
    do {                                                                       \
        if (kern_overlap((a), (abytes), (b), (bbytes)))                        \
            return scape_set_error(SCAPE_INVALID,                              \
                                   "%s: buffers %s and %s overlap", fn, #a,    \
                                   #b);                                        \
    } while (0)

static inline int kern_overlap(const void *a, size_t abytes, const void *b,
                               size_t bbytes)
{
    uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
    if (abytes == 0 || bbytes == 0)
        return 0;
    return pa < pb + bbytes && pb < pa + abytes;
}

/* n, and beta1 and t_r of the SCAPE statistic (ignored without m). */
static inline scape_rc kern_check_stat_args(const char *fn, size_t n, const float *m,
                                            float beta1, float t_r)
{
    KERN_MAXN(fn, n);
    if (m && !(beta1 >= 0.0f && beta1 < 1.0f))
        return scape_set_error(SCAPE_INVALID, "%s: beta1=%g out of [0,1)", fn, (double)beta1);
    if (m && !(t_r >= 1.0f))
        return scape_set_error(SCAPE_INVALID, "%s: t_r=%g must be >= 1", fn, (double)t_r);
    return SCAPE_OK;
}

/* kern_cuda_sum_bf16_parts: nparts parts of n bf16 values. */
static inline scape_rc kern_check_parts(const char *fn, const uint16_t *parts, unsigned nparts,
                                        size_t n, const float *out)
{
    KERN_NONNULL(fn, parts);
    KERN_NONNULL(fn, out);
    KERN_MAXN(fn, n);
    if (nparts < 1)
        return scape_set_error(SCAPE_INVALID, "%s: nparts must be >= 1", fn);
    KERN_DISJOINT(fn, parts, (size_t)nparts * n * 2, out, n * 4);
    return SCAPE_OK;
}

/* 1 - beta^t, computed in double and rounded once to float. */
static inline float kern_bias_correction(float beta, uint64_t t)
{
    return scape_f_bias_correction(beta, t);
}

/* Validate the hyper-parameters shared by all Adam-family kernels. */
static inline scape_rc kern_check_hyper(const char *fn, const kern_hyper *h)
{
    if (h == NULL)
        return scape_set_error(SCAPE_INVALID, "%s: h is NULL", fn);
    if (!(h->beta1 >= 0.0f && h->beta1 < 1.0f) ||
        !(h->beta2 >= 0.0f && h->beta2 < 1.0f) || !(h->eps > 0.0f) ||
        !(h->wd >= 0.0f) || !isfinite(h->wd) || !(h->clip >= 0.0f && h->clip <= 1.0f))
        return scape_set_error(SCAPE_INVALID,
                               "%s: hyper-parameters out of range (beta1=%g "
                               "beta2=%g eps=%g wd=%g clip=%g)",
                               fn, (double)h->beta1, (double)h->beta2,
                               (double)h->eps, (double)h->wd, (double)h->clip);
    return SCAPE_OK;
}

/* Validate a divisor (trainer count) and a learning rate. */
static inline scape_rc kern_check_div_lr(const char *fn, float div, float lr)
{
    if (!(div > 0.0f) || !isfinite(div))
        return scape_set_error(SCAPE_INVALID, "%s: div=%g must be positive",
                               fn, (double)div);
    if (!isfinite(lr) || lr < 0.0f)
        return scape_set_error(SCAPE_INVALID,
                               "%s: lr=%g must be finite and >= 0", fn,
                               (double)lr);
    return SCAPE_OK;
}

static inline scape_rc kern_check_dtype(const char *fn, kern_dtype dt)
{
    if (dt != KERN_F32 && dt != KERN_BF16)
        return scape_set_error(SCAPE_INVALID, "%s: unknown dtype %d", fn,
                               (int)dt);
    return SCAPE_OK;
}

#endif /* SCAPE_KERN_INTERNAL_H */
