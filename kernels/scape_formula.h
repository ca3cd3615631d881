/* scape_formula.h - every element-wise formula of SCAPE, defined once.
 *
 * The CPU reference (kernels/cpu_*.c), the segmented kernels' CPU version
 * (kernels/cpu_seg.c) and every CUDA kernel (kernels/cuda_*.cu) compute each
 * coordinate through these functions, so the CPU tests check the very
 * arithmetic the GPU runs.  Both compilers see them with FMA contraction off
 * (-ffp-contract=off for C and for nvcc's host pass, --fmad=false for the
 * device), and IEEE division and square root (nvcc's defaults, never
 * --use_fast_math): a*b + c is then two roundings everywhere, and the twins
 * agree to the last bit.
 *
 * Order of operations is part of the contract (docs/algorithm.md):
 *  - the local gradient G is trainer 0's value, then each further trainer's
 *    added in trainer order (scape_f_grad_add);
 *  - a = G + e (scape_f_ef);
 *  - g_hat = S / T (scape_f_mean), then the update of scape_f_adams or
 *    scape_f_adamw.
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

#endif /* SCAPE_FORMULA_H */
