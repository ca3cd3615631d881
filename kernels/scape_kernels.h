/* scape_kernels.h - the per-tensor CPU kernels of the host executor
 * (daemon/exec_host.c), and the CUDA kernels of the nccl comm backend.
 *
 * The device executor runs the segmented kernels instead (scape_seg.h: one
 * CPU and one CUDA version of each); both families compute every element
 * with scape_formula.h, so they agree to the last bit.  Masks are packed bits in uint32_t words: element i of a segment
 * is bit (i & 31) of word (i >> 5), LSB first.  A segment's mask always starts
 * on a word boundary; bits past n in its last word are zero after any kernel
 * that writes a mask, and are ignored by kernels that read one.
 *
 * Every function returns a scape_rc and, on failure, leaves a message in the
 * calling thread's last-error buffer (scape_last_error()).  Nothing aborts.
 * n == 0 is a valid, empty segment; null pointers never are.
 *
 * Arithmetic is spelled out in the order of docs/algorithm.md and compiled without
 * FMA contraction on both CPU and GPU.
 */
#ifndef SCAPE_KERNELS_H
#define SCAPE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "scape_formula.h"
#include "scape_rc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- shared types ------------------------------------------------------- */

typedef enum kern_dtype { KERN_F32 = 0, KERN_BF16 = 1 } kern_dtype;

typedef struct kern_hyper {
    float beta1;  /* first-moment decay (0.9) */
    float beta2;  /* normaliser decay (0.95) */
    float eps;    /* denominator guard (1e-8) */
    float wd;     /* decoupled weight decay lambda (0.0) */
    float clip;   /* gradient clipping: the mean gradient times clip when
                     0 < clip < 1; 0 or 1: as it is (scape_f_clip) */
} kern_hyper;

/* Number of uint32_t words that hold n mask bits. */
static inline size_t kern_mask_words(size_t n) { return (n + 31) / 32; }
/* Bytes of one element of dtype dt. */
static inline size_t kern_dtype_size(kern_dtype dt) { return dt == KERN_BF16 ? 2 : 4; }

/* ---- CPU reference ------------------------------------------------------ */

/* Error-compensated pack, one pass: a = g + e; out[j] = a_i for the j-th set
 * bit i (coordinate order); e_i = 0 where the bit is set, a_i elsewhere.
 * *k_out receives the number of values written.  out must hold popcount. */
scape_rc kern_pack_ef(const float *g, float *e, const uint32_t *mask, size_t n,
                      float *out, size_t *k_out);
/* As kern_pack_ef with values on the wire in bf16 (scape_formula.h,
 * scape_f_send): out[j] = bf16(a_i) held in fp32, e_i = a_i - out[j]. */
scape_rc kern_pack_ef_bf16(const float *g, float *e, const uint32_t *mask, size_t n,
                           float *out, size_t *k_out);

/* Scratch bytes the top-k functions below need for a segment of n elements. */
size_t kern_topk_scratch_bytes(size_t n);

/* Exact top-k by radix select on the float bits of the statistic
 * (scape_formula.h: scape_f_stat with m given, scape_f_abs_stat of a = g + e
 * with m == NULL), recomputed in each pass instead of stored: no n-element
 * buffer.  Sets exactly k bits, those of the k largest keys (scape_f_key);
 * among equal keys the lower index wins; NaN ranks above +inf.  Requires
 * k <= n.  beta1 and t_r are ignored when m is NULL.  Scratch as
 * kern_topk_scratch_bytes(n).  The inputs are read in several passes and
 * must not change during the call; if a change is noticed (another process
 * writing a shared gradient) the call fails with SCAPE_INVALID instead of
 * writing past its scratch, and the mask is not a valid top-k. */
scape_rc kern_topk_ef(const float *m, const float *g, const float *e, size_t n,
                      float beta1, float t_r, size_t k, uint32_t *mask, void *scratch,
                      size_t scratch_bytes);

/* The same selection after the pack, from the a = g + e it stored: a_i is
 * packed[j] at the j-th set bit of `sent` (the mask that was packed) and e_i
 * elsewhere; sent == NULL means a = e.  Lets the caller drop its gradient sum
 * once packed.  Bit-identical to kern_topk_ef on the same a. */
scape_rc kern_topk_packed(const float *m, const float *e, const uint32_t *sent,
                          const float *packed, size_t n, float beta1, float t_r, size_t k,
                          uint32_t *mask, void *scratch, size_t scratch_bytes);

/* The statistic at the set bits of `sent` alone, packed: for the j-th set
 * bit i, packed_stat[j] = |beta1 m_i + (1 - beta1) a / t_r| with a =
 * packed_a[j] + rest[i] (|a| when m is NULL), the value sent and the
 * residual kept (scape_f_send); rest == NULL: a = packed_a[j] (fp32 values,
 * nothing kept).  Taken before m changes at those coordinates, it lets
 * kern_topk_prestat select afterwards. */
scape_rc kern_stat_packed_rest(const float *m, const uint32_t *sent, const float *packed_a,
                               const float *rest, size_t n, float beta1, float t_r,
                               float *packed_stat);

/* kern_topk_packed with the keys at the set bits of `sent` taken from
 * packed_stat (kern_stat_packed_rest) instead of computed from m and the packed
 * a; elsewhere a_i = e_i as there.  Bit-identical to kern_topk_packed on the
 * inputs the statistic was taken from, however m has changed at `sent`'s
 * bits since. */
scape_rc kern_topk_prestat(const float *m, const float *e, const uint32_t *sent,
                           const float *packed_stat, size_t n, float beta1, float t_r,
                           size_t k, uint32_t *mask, void *scratch, size_t scratch_bytes);

/* Number of set bits among the first n bits. */
scape_rc kern_mask_popcount(const uint32_t *mask, size_t n, size_t *count);

/* Compact: packed[j] = dense[i] for the j-th set bit i, stored in pdt (bf16:
 * rounded to nearest even, as every conversion to the trainers' bf16);
 * *k_out = count. */
scape_rc kern_mask_compact_dt(const float *dense, const uint32_t *mask, size_t n,
                              void *packed, kern_dtype pdt, size_t *k_out);

/* Expand: dense[i] = packed[j] for the j-th set bit i, converted from pdt to
 * dt (bf16 into bf16 is a copy of the bits); positions whose bit is clear
 * are left untouched. */
scape_rc kern_mask_expand_dt(const void *packed, kern_dtype pdt, const uint32_t *mask,
                             size_t n, void *dense, kern_dtype dt);

/* gather_values: delta (scape_formula.h).  Compact the change: for the j-th
 * set bit i, d = scape_f_delta(old[i], theta[i]) goes to packed[j] as bf16
 * and theta[i] becomes old[i] + d (scape_f_apply_delta); *k_out = count.
 * Expand it: dense[i] = dense[i] + packed[j] (bf16 widened), fp32. */
scape_rc kern_mask_compact_delta(float *theta, const float *old, const uint32_t *mask,
                                 size_t n, uint16_t *packed, size_t *k_out);
scape_rc kern_mask_expand_delta(const uint16_t *packed, const uint32_t *mask, size_t n,
                                float *dense);

/* The update of variant `variant` (scape_f_update; SCAPE_UPD_COUNT refused)
 * at the set bits of mask, the j-th set bit with g = sum[j] / div, or with
 * mask NULL at every coordinate i with g = sum[i] / div (times h->clip, when
 * it clips); clear bits leave the state untouched.  v is read only where
 * scape_f_update_reads_v (NULL elsewhere); bias correction at step t >= 1.
 * The named entries below are this update at a fixed variant. */
scape_rc kern_update(int variant, float *theta, float *m, float *v, const float *sum, float div,
                     const uint32_t *mask, size_t n, const kern_hyper *h, float lr, uint64_t t);

/* Masked AdamS with the single-buffer reconstruction.  For the j-th set bit i,
 * with g = sum[j] / div (times h->clip, when it clips):
 *   b = beta1*m + (1-beta1)*g;   v = beta2*(m*m) + (1-beta2)*(g*g);   m = b;
 *   theta -= lr * (b / (sqrt(v) + eps) + wd*theta).
 * Clear bits leave theta and m untouched. */
scape_rc kern_adams_masked(float *theta, float *m, const float *sum, float div,
                           const uint32_t *mask, size_t n, const kern_hyper *h,
                           float lr);

/* Dense AdamS: the update above on every coordinate, g = sum[i] / div. */
scape_rc kern_adams_dense(float *theta, float *m, const float *sum, float div,
                          size_t n, const kern_hyper *h, float lr);

/* Dense AdamW with bias correction at step t >= 1, g = sum[i] / div:
 *   m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g*g;
 *   theta -= lr * ((m/bc1) / (sqrt(v/bc2) + eps) + wd*theta),
 * bc1 = 1 - beta1^t, bc2 = 1 - beta2^t (computed in double, rounded once). */
scape_rc kern_adamw_dense(float *theta, float *m, float *v, const float *sum,
                          float div, size_t n, const kern_hyper *h, float lr,
                          uint64_t t);

/* Masked AdamW (the topk-adamw baseline): the AdamW update for the j-th set
 * bit i with g = sum[j] / div; clear bits leave theta, m and v untouched. */
scape_rc kern_adamw_masked(float *theta, float *m, float *v, const float *sum,
                           float div, const uint32_t *mask, size_t n,
                           const kern_hyper *h, float lr, uint64_t t);

/* Gradient intake: dst = src (overwrite != 0) or dst += src, src in dtype dt. */
scape_rc kern_grad_accum(float *dst, const void *src, kern_dtype dt, size_t n,
                         int overwrite);

/* fp32 -> bf16, round to nearest even; NaN stays NaN (quiet). */
scape_rc kern_f32_to_bf16(const float *src, uint16_t *dst, size_t n);
/* bf16 -> fp32 (exact). */
scape_rc kern_bf16_to_f32(const uint16_t *src, float *dst, size_t n);

/* Scalar conversions (scape_formula.h), under their kernel names. */
static inline uint16_t kern_bf16_from_f32(float x) { return scape_f_bf16(x); }
static inline float kern_f32_from_bf16(uint16_t x) { return scape_f_from_bf16(x); }

/* ---- CUDA (cuda_comm.cu) ---------------------------------------------------
 * The kernels of the nccl comm backend: device pointers, enqueued on
 * `stream` (a cudaStream_t; NULL is the legacy default stream), the values
 * of scape_formula.h bit for bit.  Declared always; defined only in builds
 * with SCAPE_HAVE_CUDA (check kern_cuda_available() at run time).
 */

/* 1 when this build has the CUDA kernels (these and scape_seg.h's) and a
 * device is visible, else 0; *why (if non-null) says why not. */
int kern_cuda_available(const char **why);

/* dst[i] = scape_f_bf16(src[i]): fp32 -> bf16, round to nearest even. */
scape_rc kern_cuda_f32_to_bf16(const float *src, uint16_t *dst, size_t n, void *stream);
/* out[i] = the fp32 sum, in part order, of the nparts bf16 parts (part q
 * at parts + q * n): what an owner computes from every rank's bf16 values
 * (scape_f_sum_bf16_parts). */
scape_rc kern_cuda_sum_bf16_parts(const uint16_t *parts, unsigned nparts, size_t n, float *out,
                                  void *stream);

#ifdef __cplusplus
}
#endif

#endif /* SCAPE_KERNELS_H */
