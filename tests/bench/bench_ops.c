/* bench_ops.c - the streaming kernels under test: one call of each, a check of
 * that call against an independent recomputation from the original operands,
 * and the bytes the call must move.
 *
 * Byte model: bytes read + bytes written by the operation's contract, each
 * buffer counted once per direction.  n elements, k set bits, W mask words:
 *   - a dense buffer counts its full size (4n fp32, 2n bf16, 4W mask);
 *   - a packed buffer counts 4k;
 *   - a dense buffer touched only at set bits counts 64 bytes per cache line
 *     holding a set bit (L4 lines of an fp32 buffer, L2 of a bf16 one): memory
 *     moves whole lines, so this is the least traffic the access can cause.
 * Write-allocate reads of written lines are not counted: they are overhead a
 * kernel with ordinary stores pays and a non-temporal memcpy does not.
 */
#include <math.h>
#include <string.h>

#include "bench.h"

static const kern_hyper HYPER = { BENCH_BETA1, 0.95f, 1e-8f, 0.01f, 0.0f };
#define LR 1e-3f
#define DIV 4.0f /* trainers summed into the gradient */
#define STEP 10  /* AdamW step, for the bias corrections */

/* 1 when x is off a double-precision reference by more than fp32 rounding of
 * a few operations allows (NaN is always off). */
static size_t off(float x, double ref)
{
    return !(fabs((double)x - ref) <= 1e-6 + 1e-5 * fabs(ref));
}

/* fp32 -> bf16 round-to-nearest-even by comparing the two neighbouring bf16
 * values in double; finite inputs only. */
static uint16_t ref_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1);
    double dl = fabs((double)x - bench_bf16_value(lo));
    double dh = fabs((double)x - bench_bf16_value(hi));
    if (dl != dh)
        return dl < dh ? lo : hi;
    return (lo & 1) ? hi : lo;
}

/* ---- pack and the statistics ------------------------------------------- */

static scape_rc run_pack(void *p)
{
    bench_case *c = p;
    return kern_pack_ef(c->p[BR_G], c->p[BR_E], c->p[BR_MASK], c->n,
                        c->p[BR_OUT], &c->k_out);
}

/* Packed values are g+e at the set bits in order; the residual is zero there
 * and g+e elsewhere. */
static size_t check_pack(const bench_case *c)
{
    const float *e = c->p[BR_E], *out = c->p[BR_OUT];
    size_t bad = 0, j = 0;
    for (size_t i = 0; i < c->n; i++) {
        float a = bench_f32(BR_G, i) + bench_f32(BR_E, i);
        if (bench_bit(BR_MASK, i, c->rho)) {
            bad += j >= c->k || out[j] != a || e[i] != 0.0f;
            j++;
        } else {
            bad += e[i] != a;
        }
    }
    return bad + (j != c->k_out);
}

/* g, e read; e written; mask read; k packed values written. */
static size_t bytes_pack(const bench_case *c) { return 12 * c->n + 4 * c->nw + 4 * c->k; }

/* dst, src read; dst written (grad_accum f32). */
static size_t bytes_12n(const bench_case *c) { return 12 * c->n; }

/* ---- compact and expand ------------------------------------------------- */

static scape_rc run_compact(void *p)
{
    bench_case *c = p;
    return kern_mask_compact_dt(c->p[BR_G], c->p[BR_MASK], c->n, c->p[BR_OUT], KERN_F32,
                                &c->k_out);
}

static size_t check_compact(const bench_case *c)
{
    const float *out = c->p[BR_OUT];
    size_t bad = 0, j = 0;
    for (size_t i = 0; i < c->n; i++) {
        if (!bench_bit(BR_MASK, i, c->rho))
            continue;
        bad += j >= c->k || out[j] != bench_f32(BR_G, i);
        j++;
    }
    return bad + (j != c->k_out);
}

/* mask read; dense read at set bits (lines); k values written. */
static size_t bytes_compact(const bench_case *c)
{
    return 4 * c->nw + 64 * c->lines4 + 4 * c->k;
}

static scape_rc run_expand_f32(void *p)
{
    bench_case *c = p;
    return kern_mask_expand_dt(c->p[BR_PACKED], KERN_F32, c->p[BR_MASK], c->n, c->p[BR_DST],
                               KERN_F32);
}

static size_t check_expand_f32(const bench_case *c)
{
    const float *d = c->p[BR_DST];
    size_t bad = 0, j = 0;
    for (size_t i = 0; i < c->n; i++) {
        float want = bench_bit(BR_MASK, i, c->rho) ? bench_f32(BR_PACKED, j++)
                                                   : bench_f32(BR_DST, i);
        bad += d[i] != want;
    }
    return bad;
}

static scape_rc run_expand_bf16(void *p)
{
    bench_case *c = p;
    return kern_mask_expand_dt(c->p[BR_PACKED], KERN_F32, c->p[BR_MASK], c->n, c->p[BR_HALF],
                               KERN_BF16);
}

static size_t check_expand_bf16(const bench_case *c)
{
    const uint16_t *d = c->p[BR_HALF];
    size_t bad = 0, j = 0;
    for (size_t i = 0; i < c->n; i++) {
        uint16_t want = bench_bit(BR_MASK, i, c->rho)
                            ? ref_bf16(bench_f32(BR_PACKED, j++))
                            : bench_bf16(BR_HALF, i);
        bad += d[i] != want;
    }
    return bad;
}

/* mask and k values read; dense written at set bits (lines). */
static size_t bytes_expand_f32(const bench_case *c)
{
    return 4 * c->nw + 4 * c->k + 64 * c->lines4;
}

static size_t bytes_expand_bf16(const bench_case *c)
{
    return 4 * c->nw + 4 * c->k + 64 * c->lines2;
}

/* ---- AdamS and AdamW ---------------------------------------------------- */

static scape_rc run_adams_masked(void *p)
{
    bench_case *c = p;
    return kern_adams_masked(c->p[BR_THETA], c->p[BR_M], c->p[BR_PACKED], DIV,
                             c->p[BR_MASK], c->n, &HYPER, LR);
}

static scape_rc run_adams_dense(void *p)
{
    bench_case *c = p;
    return kern_adams_dense(c->p[BR_THETA], c->p[BR_M], c->p[BR_SUM], DIV, c->n,
                            &HYPER, LR);
}

/* Mismatches of theta_i and m_i against AdamS in double with gradient g. */
static size_t adams_off(const bench_case *c, size_t i, double g)
{
    const float *theta = c->p[BR_THETA], *m = c->p[BR_M];
    const double b1 = HYPER.beta1, b2 = HYPER.beta2;
    double m0 = bench_f32(BR_M, i), th = bench_f32(BR_THETA, i);
    double b = b1 * m0 + (1.0 - b1) * g;
    double v = b2 * (m0 * m0) + (1.0 - b2) * (g * g);
    double t = th - LR * (b / (sqrt(v) + HYPER.eps) + HYPER.wd * th);
    return off(m[i], b) + off(theta[i], t);
}

/* Mismatches of theta_i, m_i (and v_i) against their original values. */
static size_t untouched(const bench_case *c, size_t i)
{
    const float *theta = c->p[BR_THETA], *m = c->p[BR_M], *v = c->p[BR_V];
    return (theta[i] != bench_f32(BR_THETA, i)) + (m[i] != bench_f32(BR_M, i)) +
           (v != NULL && v[i] != bench_f32(BR_V, i));
}

static size_t check_adams_masked(const bench_case *c)
{
    size_t bad = 0, j = 0;
    for (size_t i = 0; i < c->n; i++)
        bad += bench_bit(BR_MASK, i, c->rho)
                   ? adams_off(c, i, (double)bench_f32(BR_PACKED, j++) / DIV)
                   : untouched(c, i);
    return bad;
}

static size_t check_adams_dense(const bench_case *c)
{
    size_t bad = 0;
    for (size_t i = 0; i < c->n; i++)
        bad += adams_off(c, i, (double)bench_f32(BR_SUM, i) / DIV);
    return bad;
}

/* mask and k sums read; theta and m read and written at set bits (lines). */
static size_t bytes_adams_masked(const bench_case *c)
{
    return 4 * c->nw + 4 * c->k + 4 * 64 * c->lines4;
}

/* theta, m, sum read; theta, m written. */
static size_t bytes_adams_dense(const bench_case *c) { return 20 * c->n; }

static scape_rc run_adamw_dense(void *p)
{
    bench_case *c = p;
    return kern_adamw_dense(c->p[BR_THETA], c->p[BR_M], c->p[BR_V], c->p[BR_SUM],
                            DIV, c->n, &HYPER, LR, STEP);
}

static scape_rc run_adamw_masked(void *p)
{
    bench_case *c = p;
    return kern_adamw_masked(c->p[BR_THETA], c->p[BR_M], c->p[BR_V],
                             c->p[BR_PACKED], DIV, c->p[BR_MASK], c->n, &HYPER,
                             LR, STEP);
}

/* Bias corrections as the header specifies: in double, rounded once. */
static double bias_correction(float beta) { return (float)(1.0 - pow(beta, STEP)); }

/* Mismatches of theta_i, m_i, v_i against AdamW in double with gradient g. */
static size_t adamw_off(const bench_case *c, size_t i, double g, double bc1,
                        double bc2)
{
    const float *theta = c->p[BR_THETA], *m = c->p[BR_M], *v = c->p[BR_V];
    const double b1 = HYPER.beta1, b2 = HYPER.beta2;
    double th = bench_f32(BR_THETA, i);
    double mi = b1 * bench_f32(BR_M, i) + (1.0 - b1) * g;
    double vi = b2 * bench_f32(BR_V, i) + (1.0 - b2) * (g * g);
    double t = th - LR * ((mi / bc1) / (sqrt(vi / bc2) + HYPER.eps) + HYPER.wd * th);
    return off(m[i], mi) + off(v[i], vi) + off(theta[i], t);
}

static size_t check_adamw_dense(const bench_case *c)
{
    double bc1 = bias_correction(HYPER.beta1), bc2 = bias_correction(HYPER.beta2);
    size_t bad = 0;
    for (size_t i = 0; i < c->n; i++)
        bad += adamw_off(c, i, (double)bench_f32(BR_SUM, i) / DIV, bc1, bc2);
    return bad;
}

static size_t check_adamw_masked(const bench_case *c)
{
    double bc1 = bias_correction(HYPER.beta1), bc2 = bias_correction(HYPER.beta2);
    size_t bad = 0, j = 0;
    for (size_t i = 0; i < c->n; i++)
        bad += bench_bit(BR_MASK, i, c->rho)
                   ? adamw_off(c, i, (double)bench_f32(BR_PACKED, j++) / DIV, bc1, bc2)
                   : untouched(c, i);
    return bad;
}

/* theta, m, v, sum read; theta, m, v written. */
static size_t bytes_adamw_dense(const bench_case *c) { return 28 * c->n; }

/* mask and k sums read; theta, m, v read and written at set bits (lines). */
static size_t bytes_adamw_masked(const bench_case *c)
{
    return 4 * c->nw + 4 * c->k + 6 * 64 * c->lines4;
}

/* ---- gradient intake and conversions ------------------------------------ */

static scape_rc run_accum_f32(void *p)
{
    bench_case *c = p;
    return kern_grad_accum(c->p[BR_DST], c->p[BR_G], KERN_F32, c->n, 0);
}

static size_t check_accum_f32(const bench_case *c)
{
    const float *d = c->p[BR_DST];
    size_t bad = 0;
    for (size_t i = 0; i < c->n; i++)
        bad += d[i] != bench_f32(BR_DST, i) + bench_f32(BR_G, i);
    return bad;
}

static scape_rc run_accum_bf16(void *p)
{
    bench_case *c = p;
    return kern_grad_accum(c->p[BR_DST], c->p[BR_HALF], KERN_BF16, c->n, 0);
}

static size_t check_accum_bf16(const bench_case *c)
{
    const float *d = c->p[BR_DST];
    size_t bad = 0;
    for (size_t i = 0; i < c->n; i++)
        bad += d[i] != bench_f32(BR_DST, i) +
                           bench_bf16_value(bench_bf16(BR_HALF, i));
    return bad;
}

/* dst read and written, bf16 src read. */
static size_t bytes_accum_bf16(const bench_case *c) { return 10 * c->n; }

static scape_rc run_to_bf16(void *p)
{
    bench_case *c = p;
    return kern_f32_to_bf16(c->p[BR_G], c->p[BR_HALF], c->n);
}

static size_t check_to_bf16(const bench_case *c)
{
    const uint16_t *h = c->p[BR_HALF];
    size_t bad = 0;
    for (size_t i = 0; i < c->n; i++)
        bad += h[i] != ref_bf16(bench_f32(BR_G, i));
    return bad;
}

static scape_rc run_to_f32(void *p)
{
    bench_case *c = p;
    return kern_bf16_to_f32(c->p[BR_HALF], c->p[BR_DST], c->n);
}

static size_t check_to_f32(const bench_case *c)
{
    const float *d = c->p[BR_DST];
    size_t bad = 0;
    for (size_t i = 0; i < c->n; i++)
        bad += d[i] != bench_bf16_value(bench_bf16(BR_HALF, i));
    return bad;
}

/* fp32 read and bf16 written, or the reverse. */
static size_t bytes_convert(const bench_case *c) { return 6 * c->n; }

/* ---- mask helpers ------------------------------------------------------- */

static scape_rc run_popcount(void *p)
{
    bench_case *c = p;
    return kern_mask_popcount(c->p[BR_MASK], c->n, &c->k_out);
}

static size_t check_popcount(const bench_case *c)
{
    size_t count = 0;
    for (size_t w = 0; w < c->nw; w++)
        count += (size_t)__builtin_popcount(bench_mask_word(BR_MASK, c->n, w, c->rho));
    return count != c->k_out;
}

/* mask read. */
static size_t bytes_popcount(const bench_case *c) { return 4 * c->nw; }

/* ---- the table ---------------------------------------------------------- */

#define PACK_ROLES (BR(BR_G) | BR(BR_E) | BR(BR_MASK) | BR(BR_OUT))
#define ADAMS_ROLES (BR(BR_THETA) | BR(BR_M))
#define ADAMW_ROLES (BR(BR_THETA) | BR(BR_M) | BR(BR_V))
#define SPARSE (BR(BR_PACKED) | BR(BR_MASK))

const bench_op bench_ops[] = {
    { "pack_ef rho=0.01", 0.01, PACK_ROLES, run_pack, check_pack, bytes_pack },
    { "pack_ef rho=0.1", 0.1, PACK_ROLES, run_pack, check_pack, bytes_pack },
    { "pack_ef all-ones", 1.0, PACK_ROLES, run_pack, check_pack, bytes_pack },
    { "mask_compact rho=0.01", 0.01, BR(BR_G) | BR(BR_MASK) | BR(BR_OUT),
      run_compact, check_compact, bytes_compact },
    { "mask_expand f32 rho=0.01", 0.01, SPARSE | BR(BR_DST), run_expand_f32,
      check_expand_f32, bytes_expand_f32 },
    { "mask_expand bf16 rho=0.01", 0.01, SPARSE | BR(BR_HALF), run_expand_bf16,
      check_expand_bf16, bytes_expand_bf16 },
    { "adams_masked rho=0.01", 0.01, ADAMS_ROLES | SPARSE, run_adams_masked,
      check_adams_masked, bytes_adams_masked },
    { "adams_dense", 0, ADAMS_ROLES | BR(BR_SUM), run_adams_dense,
      check_adams_dense, bytes_adams_dense },
    { "adamw_dense", 0, ADAMW_ROLES | BR(BR_SUM), run_adamw_dense,
      check_adamw_dense, bytes_adamw_dense },
    { "adamw_masked rho=0.01", 0.01, ADAMW_ROLES | SPARSE, run_adamw_masked,
      check_adamw_masked, bytes_adamw_masked },
    { "grad_accum f32 +=", 0, BR(BR_DST) | BR(BR_G), run_accum_f32,
      check_accum_f32, bytes_12n },
    { "grad_accum bf16 +=", 0, BR(BR_DST) | BR(BR_HALF), run_accum_bf16,
      check_accum_bf16, bytes_accum_bf16 },
    { "f32_to_bf16", 0, BR(BR_G) | BR(BR_HALF), run_to_bf16, check_to_bf16,
      bytes_convert },
    { "bf16_to_f32", 0, BR(BR_HALF) | BR(BR_DST), run_to_f32, check_to_f32,
      bytes_convert },
    { "mask_popcount rho=0.01", 0.01, BR(BR_MASK), run_popcount, check_popcount,
      bytes_popcount },
};

const size_t bench_nops = sizeof bench_ops / sizeof bench_ops[0];
