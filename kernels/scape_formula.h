/* scape_formula.h - every element-wise formula of SCAPE, defined once.
 *
 * The per-tensor CPU kernels (kernels/cpu_*.c), the segmented kernels' CPU
 * version (kernels/cpu_seg.c) and every CUDA kernel (kernels/cuda_*.cu) compute each
 * coordinate through these functions, so the CPU tests check the very
 * arithmetic the GPU runs.  Both compilers see them with FMA contraction off
 * (-ffp-contract=off for C and for nvcc's host pass, --fmad=false for the
 * device), and IEEE division and square root (nvcc's defaults, never
 * --use_fast_math): a*b + c is then two roundings everywhere, and CPU and
 * GPU agree to the last bit.
 *
 * Order of operations is part of the contract (docs/algorithm.md):
 *  - the local gradient G is trainer 0's value, then each further trainer's
 *    added in trainer order (scape_f_grad_add);
 *  - a = G + e (scape_f_ef);
 *  - g_hat = S / T (scape_f_mean), clipped (scape_f_clip), then the update
 *    of the optimizer's variant (scape_f_update: scape_f_adams or scape_f_adamw).
 */
#ifndef SCAPE_FORMULA_H
#define SCAPE_FORMULA_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define SCAPE_HD static __host__ __device__ __forceinline__
#else
#define SCAPE_HD static inline
#endif

/* ---- bits ------------------------------------------------------------------ */

SCAPE_HD uint32_t scape_f_bits(float x)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
#endif
}

SCAPE_HD float scape_f_from_bits(uint32_t u)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
#endif
}

/* fp32 -> bf16, round to nearest even; NaN stays NaN (quiet), sign kept.
 * Both candidates, then a select: branch-free, so CPU loops vectorise. */
SCAPE_HD uint16_t scape_f_bf16(float x)
{
    uint32_t u = scape_f_bits(x);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet = (u >> 16) | 0x0040u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

/* bf16 -> fp32 (exact). */
SCAPE_HD float scape_f_from_bf16(uint16_t x) { return scape_f_from_bits((uint32_t)x << 16); }

/* Element i of a buffer of fp32 (bf16 == 0) or bf16 values, as fp32. */
SCAPE_HD float scape_f_load(const void *p, int bf16, size_t i)
{
    return bf16 ? scape_f_from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Store x as fp32 or bf16 at element i. */
SCAPE_HD void scape_f_store(void *p, int bf16, size_t i, float x)
{
    if (bf16)
        ((uint16_t *)p)[i] = scape_f_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* ---- intake and error feedback --------------------------------------------- */

/* The local gradient sum: acc is trainer 0's value; each further trainer's
 * is added in trainer order, one rounding each. */
SCAPE_HD float scape_f_grad_add(float acc, float x) { return acc + x; }

/* The error-compensated value a = G + e. */
SCAPE_HD float scape_f_ef(float g, float e) { return g + e; }

/* Values on the wire in bf16 (wire_values: bf16).  The value a rank sends
 * for a: bf16(a), held in fp32 (so every sum of such values is an ordinary
 * fp32 sum); where rounding to nearest would carry a finite a to infinity,
 * a truncated instead.  What is not sent, a - sent, stays in the residual:
 * exact in fp32 for every finite a (the two share their top bits and differ
 * by less than a bf16 ulp of a), and 0 where a is not finite, as the fp32
 * path leaves 0 at a sent coordinate. */
SCAPE_HD float scape_f_wire_bf16(float a)
{
    uint32_t u = scape_f_bits(a);
    float s = scape_f_from_bf16(scape_f_bf16(a));
    int finite = (u & 0x7f800000u) != 0x7f800000u;
    return finite && (scape_f_bits(s) & 0x7fffffffu) == 0x7f800000u
               ? scape_f_from_bits(u & 0xffff0000u)
               : s;
}

SCAPE_HD float scape_f_wire_rest(float a, float sent)
{
    float r = a - sent;
    return r == r ? r : 0.0f; /* inf - inf, NaN: nothing is kept */
}

/* The value sent and the residual kept for a sent coordinate. */
SCAPE_HD float scape_f_send(float a, int bf16, float *rest)
{
    float s = bf16 ? scape_f_wire_bf16(a) : a;
    *rest = bf16 ? scape_f_wire_rest(a, s) : 0.0f;
    return s;
}

/* gather_values: delta.  What a masked step publishes for a parameter that
 * every trainer holds as `old` (fp32) and the owner's update made
 * `computed`: the change in bf16 (scape_f_wire_bf16 of the fp32
 * difference).  The new value, at the owner as at every trainer, is
 * old + delta, one fp32 rounding (scape_f_apply_delta), so the master and
 * every trainer stay bitwise equal. */
SCAPE_HD float scape_f_delta(float old, float computed)
{
    return scape_f_wire_bf16(computed - old);
}

SCAPE_HD float scape_f_apply_delta(float old, float delta) { return old + delta; }

/* Element i of the sum of nparts bf16 parts (part q at parts + q * n),
 * widened exactly and added in part order in fp32, one rounding each: the
 * rank-order sum of bf16 values that every backend takes. */
SCAPE_HD float scape_f_sum_bf16_parts(const uint16_t *parts, unsigned nparts, size_t n,
                                      size_t i)
{
    float acc = scape_f_from_bf16(parts[i]);
    for (unsigned q = 1; q < nparts; q++)
        acc = acc + scape_f_from_bf16(parts[(size_t)q * n + i]);
    return acc;
}

/* ---- the mask statistic and its top-k key -------------------------------- */

/* SCAPE: |beta1 m + (1 - beta1) (a / t_r)|, c1 = 1 - beta1 computed once. */
SCAPE_HD float scape_f_stat(float m, float a, float beta1, float c1, float t_r)
{
    return fabsf(beta1 * m + c1 * (a / t_r));
}

/* topk-adamw: |a|. */
SCAPE_HD float scape_f_abs_stat(float a) { return fabsf(a); }

/* Radix key of a non-negative statistic: its bits order like its value;
 * the sign bit is dropped, so NaN ranks above +inf. */
SCAPE_HD uint32_t scape_f_key(float stat) { return scape_f_bits(stat) & 0x7fffffffu; }

/* ---- updates ----------------------------------------------------------------- */

/* AdamW's bias correction 1 - beta^t, in double, rounded once (host side). */
static inline float scape_f_bias_correction(float beta, uint64_t t)
{
    return (float)(1.0 - pow((double)beta, (double)t));
}

/* g_hat: the reduced sum over T trainers, as their mean. */
SCAPE_HD float scape_f_mean(float sum, float div) { return sum / div; }

/* Gradient clipping: g_hat times the coefficient c of scape_f_clip_coef
 * when it is below 1; 0 (no clipping configured) and 1 leave g as it is. */
SCAPE_HD float scape_f_clip(float g, float c) { return c > 0.0f && c < 1.0f ? g * c : g; }

/* The clipping coefficient from the global norm of g_hat (torch's
 * clip_grad_norm_: max / (norm + 1e-6), capped at 1), in double, rounded
 * once (host side). */
static inline float scape_f_clip_coef(double norm, float max_norm)
{
    double c = (double)max_norm / (norm + 1e-6);
    return c < 1.0 ? (float)c : 1.0f;
}

/* The squares of g_hat summed in a fixed order, so that every executor
 * and mode gets the same bits: the values in chunks of SCAPE_SQ_CHUNK;
 * inside a chunk, lane l (of 32) sums the squares (in double) of the
 * values l, l + 32, l + 64, ... in order; the lanes then combine by halving,
 * lane l adding lane l + d for d = 16, 8, 4, 2, 1 (a warp's shuffle tree);
 * lane 0's total is the chunk's; the chunks add in order. */
#define SCAPE_SQ_CHUNK 4096
#define SCAPE_SQ_LANES 32

SCAPE_HD double scape_f_sq(float sum, float div)
{
    double g = (double)scape_f_mean(sum, div);
    return g * g;
}

/* Lane l's part of one chunk (n <= SCAPE_SQ_CHUNK values at sum): the
 * squares of the values l, l + 32, l + 64, ... added in that order. */
SCAPE_HD double scape_f_sq_lane(const float *sum, size_t n, float div, unsigned l)
{
    double acc = 0.0;
    for (size_t q = l; q < n; q += SCAPE_SQ_LANES)
        acc += scape_f_sq(sum[q], div);
    return acc;
}

/* One chunk of the rule above, on the host (the GPU combines the lanes
 * with warp shuffles in the same order). */
static inline double scape_f_sqsum_chunk(const float *sum, size_t n, float div)
{
    double lane[SCAPE_SQ_LANES];
    for (unsigned l = 0; l < SCAPE_SQ_LANES; l++)
        lane[l] = scape_f_sq_lane(sum, n, div, l);
    for (unsigned d = SCAPE_SQ_LANES / 2; d > 0; d /= 2)
        for (unsigned l = 0; l < d; l++)
            lane[l] += lane[l + d];
    return lane[0];
}

/* AdamS with the single-buffer reconstruction (docs/algorithm.md step 7). */
SCAPE_HD void scape_f_adams(float *theta, float *m, float g, float b1, float b2, float eps,
                            float wd, float lr)
{
    float mi = *m, th = *theta;
    float b = b1 * mi + (1.0f - b1) * g;
    float v = b2 * (mi * mi) + (1.0f - b2) * (g * g);
    *m = b;
    *theta = th - lr * (b / (sqrtf(v) + eps) + wd * th);
}

/* AdamW with bias correction; bc1 = 1 - beta1^t, bc2 = 1 - beta2^t. */
SCAPE_HD void scape_f_adamw(float *theta, float *m, float *v, float g, float b1, float b2,
                            float eps, float wd, float lr, float bc1, float bc2)
{
    float th = *theta;
    float mi = b1 * *m + (1.0f - b1) * g;
    float vi = b2 * *v + (1.0f - b2) * (g * g);
    *m = mi;
    *v = vi;
    *theta = th - lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + wd * th);
}

/* The update variants: an optimizer's update is its formula above, its
 * number here and its case in scape_f_update; every kernel (kern_update,
 * the segmented UPDATE on CPU and GPU) runs it from there.  The engine's
 * optimizer rows (daemon/engine.c) name these numbers. */
enum scape_update {
    SCAPE_UPD_ADAMS = 0, /* scape_f_adams: m only */
    SCAPE_UPD_ADAMW,     /* scape_f_adamw: m, v and bias correction */
    SCAPE_UPD_COUNT
};

/* Whether variant `variant` reads and writes v. */
SCAPE_HD int scape_f_update_reads_v(int variant) { return variant == SCAPE_UPD_ADAMW; }

/* One coordinate's update by its variant; v, bc1 and bc2 are read only
 * where the variant takes them (they may be NULL / anything elsewhere). */
SCAPE_HD void scape_f_update(int variant, float *theta, float *m, float *v, float g, float b1,
                             float b2, float eps, float wd, float lr, float bc1, float bc2)
{
    switch (variant) {
    case SCAPE_UPD_ADAMW:
        scape_f_adamw(theta, m, v, g, b1, b2, eps, wd, lr, bc1, bc2);
        break;
    default: /* SCAPE_UPD_ADAMS */
        scape_f_adams(theta, m, g, b1, b2, eps, wd, lr);
        break;
    }
}

#endif /* SCAPE_FORMULA_H */
