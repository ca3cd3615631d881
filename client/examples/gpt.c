/* gpt.c - the character GPT of gpt.h: layout, initialisation, forward and
 * backward passes.  Compiled twice: as float (gpt_*) and, with -DGPT_DOUBLE,
 * as double (gptd_*), so that the gradient check can be tight.
 *
 * Rows are positions, n = b*T + t.  Every matrix product goes through gemm(),
 * which accumulates each output in increasing order of the shared index (no
 * reassociation, so the numbers do not depend on the -O level or the tiling)
 * while a register tile of outputs streams over contiguous weight rows.  A
 * transposed left operand is a strided view; a transposed right operand
 * (weights in the backward pass, keys, values) is copied once into scratch.
 * Attention works per (sequence, head) on dense T x T blocks, the causal mask
 * being applied in the softmax.  Single-threaded; everything is allocated once
 * in gpt_work_new. */
#include "gpt.h"
#include "gpt_rand.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef GPT_DOUBLE
typedef double real;
#define GPT_FN(name) gptd_##name
#define R_SQRT sqrt
#define R_EXP exp
#define R_LOG log
#else
typedef float real;
#define GPT_FN(name) gpt_##name
#define R_SQRT sqrtf
#define R_EXP expf
#define R_LOG logf
#endif
#define R(x) ((real)(x))

typedef struct GPT_FN(work) work_t;

/* tensor indices: wte, wpe, then PER_LAYER per layer, then lnf.w, lnf.b, head.w */
enum { T_WTE, T_WPE, T_LAYERS };
enum { L_LN1W, L_LN1B, L_QKVW, L_QKVB, L_PROJW, L_PROJB,
       L_LN2W, L_LN2B, L_FCW, L_FCB, L_FC2W, L_FC2B, PER_LAYER };
enum { F_LNFW, F_LNFB, F_HEAD, N_FINAL };

#define LN_EPS 1e-5
#define GELU_K 0.7978845608028654 /* sqrt(2/pi) */
#define GELU_C 0.044715

typedef struct {
    real *ln1, *ln1_mean, *ln1_rstd;  /* layernorm 1 output and statistics */
    real *qkv;                        /* [N][3d] */
    real *att;                        /* softmax rows [B][heads][T][T] */
    real *atty;                       /* attention output before proj, [N][d] */
    real *res_mid;                    /* residual after attention */
    real *ln2, *ln2_mean, *ln2_rstd;
    real *fc, *fc_th, *fc_act;        /* [N][4d]: pre-GELU, its tanh, post-GELU */
    real *res_out;                    /* residual after the MLP */
} layer_act;

struct GPT_FN(work) {
    gpt_ready_fn ready;       /* gpt_work_on_ready's, or NULL */
    void *ready_ctx;
    gpt_config c;
    int B, T;                 /* capacity */
    size_t nparams;           /* gpt_num_params(&c) */
    size_t *off;              /* offset of each tensor in the parameter buffer */
    layer_act *act;           /* [layers] */
    real *res0;               /* embeddings, [N][d] */
    real *lnf, *lnf_mean, *lnf_rstd;
    real *probs;              /* [N][vocab] */
    real *d_logits;           /* [N][vocab] */
    real *d_res;              /* gradient of the residual stream, [N][d] */
    real *d_ln;               /* gradient of a layernorm output, [N][d] */
    real *d_atty;             /* [N][d] */
    real *d_qkv;              /* [N][3d] */
    real *d_fc;               /* [N][4d] */
    real *d_att;              /* one head's attention gradient, [T][T] */
    real *kt;                 /* one head's keys or values transposed, [hs][T] */
    real *wt;                 /* a weight matrix transposed */
    real *block;              /* the single allocation all of the above live in */
};

/* ---- layout and initialisation (float build only; shared by the twin) ---- */
#ifndef GPT_DOUBLE

enum { K_WEIGHT, K_RESID_PROJ, K_GAIN, K_BIAS };

static const char *const s_layer_names[PER_LAYER] = {
    "ln1.w", "ln1.b", "attn.qkv.w", "attn.qkv.b", "attn.proj.w", "attn.proj.b",
    "ln2.w", "ln2.b", "mlp.fc.w", "mlp.fc.b", "mlp.proj.w", "mlp.proj.b"
};
static const int s_layer_kinds[PER_LAYER] = {
    K_GAIN, K_BIAS, K_WEIGHT, K_BIAS, K_RESID_PROJ, K_BIAS,
    K_GAIN, K_BIAS, K_WEIGHT, K_BIAS, K_RESID_PROJ, K_BIAS
};

int gpt_config_check(const gpt_config *c)
{
    /* bounds keep every size product far from overflow */
    if (!c || c->vocab < 1 || c->vocab > (1 << 20) || c->ctx < 1 || c->ctx > (1 << 16) ||
        c->d < 1 || c->d > (1 << 14) || c->layers < 1 || c->layers > 1000 ||
        c->heads < 1 || c->d % c->heads != 0)
        return -1;
    return 0;
}

static size_t layer_tensor_len(const gpt_config *c, int k)
{
    size_t d = (size_t)c->d;
    switch (k) {
    case L_QKVW: return d * 3 * d;
    case L_QKVB: return 3 * d;
    case L_PROJW: return d * d;
    case L_FCW: case L_FC2W: return d * 4 * d;
    case L_FCB: return 4 * d;
    default: return d;
    }
}

/* Name (may be NULL), length and init kind of tensor i. */
static size_t tensor_info(const gpt_config *c, int i, char *name, int *kind)
{
    int nlayer = PER_LAYER * c->layers, k = i - T_LAYERS - nlayer;
    const char *fin[N_FINAL] = { "lnf.w", "lnf.b", "head.w" };
    const int fin_kind[N_FINAL] = { K_GAIN, K_BIAS, K_WEIGHT };
    if (i < T_LAYERS) {
        if (name) strcpy(name, i == T_WTE ? "wte" : "wpe");
        *kind = K_WEIGHT;
        return (size_t)(i == T_WTE ? c->vocab : c->ctx) * (size_t)c->d;
    }
    if (k < 0) {
        int l = (i - T_LAYERS) / PER_LAYER, j = (i - T_LAYERS) % PER_LAYER;
        if (name) snprintf(name, sizeof ((gpt_tensor *)0)->name, "h%d.%s", l, s_layer_names[j]);
        *kind = s_layer_kinds[j];
        return layer_tensor_len(c, j);
    }
    if (name) strcpy(name, fin[k]);
    *kind = fin_kind[k];
    return k == F_HEAD ? (size_t)c->d * (size_t)c->vocab : (size_t)c->d;
}

int gpt_layout(const gpt_config *c, gpt_tensor *out, int max)
{
    if (gpt_config_check(c) != 0)
        return -1;
    int n = T_LAYERS + PER_LAYER * c->layers + N_FINAL, kind;
    size_t off = 0;
    for (int i = 0; out && i < n && i < max; i++) {
        out[i].offset = off;
        out[i].length = tensor_info(c, i, out[i].name, &kind);
        off += out[i].length;
    }
    return n;
}

size_t gpt_num_params(const gpt_config *c)
{
    int n = gpt_layout(c, NULL, 0), kind;
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += tensor_info(c, i, NULL, &kind);
    return total;
}


/* Standard normal by Box-Muller; u1 lies in (0, 1], so the log is finite. */
static double gauss(uint64_t *s)
{
    double u1 = (double)((gpt_next64(s) >> 11) + 1) * 0x1.0p-53;
    double u2 = (double)(gpt_next64(s) >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

void gpt_init(const gpt_config *c, float *params, uint64_t seed)
{
    int n = gpt_layout(c, NULL, 0), kind;
    uint64_t s = seed;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        size_t len = tensor_info(c, i, NULL, &kind);
        double std = kind == K_RESID_PROJ ? 0.02 / sqrt(2.0 * c->layers) : 0.02;
        for (size_t j = 0; j < len; j++)
            params[off + j] = kind == K_GAIN ? 1.0f
                            : kind == K_BIAS ? 0.0f : (float)(std * gauss(&s));
        off += len;
    }
}

#endif /* !GPT_DOUBLE */

/* ---- building blocks ---- */

static void layernorm_fwd(real *restrict out, real *restrict mean, real *restrict rstd,
                          const real *restrict in, const real *restrict g,
                          const real *restrict b, int N, int C)
{
    for (int n = 0; n < N; n++) {
        const real *x = in + (size_t)n * C;
        real *y = out + (size_t)n * C;
        real m = 0, v = 0;
        for (int i = 0; i < C; i++)
            m += x[i];
        m /= R(C);
        for (int i = 0; i < C; i++)
            v += (x[i] - m) * (x[i] - m);
        real s = R(1) / R_SQRT(v / R(C) + R(LN_EPS));
        for (int i = 0; i < C; i++)
            y[i] = (x[i] - m) * s * g[i] + b[i];
        mean[n] = m;
        rstd[n] = s;
    }
}

/* dx += d(layernorm)/dx . dout; dg, db accumulate. */
static void layernorm_bwd(real *restrict dx, real *restrict dg, real *restrict db,
                          const real *restrict dout, const real *restrict in,
                          const real *restrict g, const real *restrict mean,
                          const real *restrict rstd, int N, int C)
{
    for (int n = 0; n < N; n++) {
        const real *x = in + (size_t)n * C, *dy = dout + (size_t)n * C;
        real m = mean[n], s = rstd[n], sum_g = 0, sum_gx = 0;
        for (int i = 0; i < C; i++) {
            real xhat = (x[i] - m) * s, dxhat = dy[i] * g[i];
            sum_g += dxhat;
            sum_gx += dxhat * xhat;
            dg[i] += dy[i] * xhat;
            db[i] += dy[i];
        }
        sum_g /= R(C);
        sum_gx /= R(C);
        real *d = dx + (size_t)n * C;
        for (int i = 0; i < C; i++)
            d[i] += s * (dy[i] * g[i] - sum_g - (x[i] - m) * s * sum_gx);
    }
}

/* The left operand of a product: element (r, c) at p[r * rs + c * cs], so a
 * transpose is a view, not a copy. */
typedef struct {
    const real *p;
    size_t rs, cs;
} mview;

static mview rows_of(const real *p, size_t ld)
{
    mview m = { p, ld, 1 };
    return m;
}

static mview cols_of(const real *p, size_t ld)
{
    mview m = { p, 1, ld };
    return m;
}

/* The matrix product keeps a tile of TILE_R rows by TILE_C columns of the
 * output in registers (GCC vector types, so at any -O level) while the
 * shared dimension streams past.  Edges take the same arithmetic in the same
 * order, so results do not depend on the tiling, and neither do they on
 * whether the vector path exists. */
#define TILE_R 4

/* Columns o0 <= o < o1 of rows r < rows of out (row stride ldo) =
 * init + sum_i x(r, i) * w[i][o] (w with row stride ldw), in increasing i;
 * init is out itself when acc, else b[o], or 0 when b is NULL. */
static void gemm_edge(real *out, size_t ldo, mview x, const real *w, size_t ldw,
                      const real *b, int acc, int rows, int o0, int o1, int I)
{
    for (int r = 0; r < rows; r++)
        for (int o = o0; o < o1; o++) {
            real s = acc ? out[r * ldo + o] : b ? b[o] : R(0);
            for (int i = 0; i < I; i++)
                s += x.p[r * x.rs + i * x.cs] * w[i * ldw + o];
            out[r * ldo + o] = s;
        }
}

#if defined(__GNUC__)
typedef real vreal __attribute__((vector_size(16)));
#define VLEN ((int)(sizeof(vreal) / sizeof(real)))
#define TILE_C (2 * VLEN)

static vreal vload(const real *p)
{
    vreal v;
    memcpy(&v, p, sizeof v);
    return v;
}

static void vstore(real *p, vreal v)
{
    memcpy(p, &v, sizeof v);
}

/* The two vectors of one tile row, initialised as gemm_edge does. */
static void tile_init(vreal *lo, vreal *hi, const real *out_row, const real *b, int acc,
                      int o0)
{
    const real *src = acc ? out_row + o0 : b ? b + o0 : NULL;
    *lo = src ? vload(src) : (vreal){ 0 };
    *hi = src ? vload(src + VLEN) : (vreal){ 0 };
}

static void gemm_tile(real *out, size_t ldo, mview x, const real *w, size_t ldw,
                      const real *b, int acc, int o0, int I)
{
    vreal c0l, c0h, c1l, c1h, c2l, c2h, c3l, c3h;
    const real *x0 = x.p, *x1 = x0 + x.rs, *x2 = x1 + x.rs, *x3 = x2 + x.rs;
    real *y0 = out, *y1 = y0 + ldo, *y2 = y1 + ldo, *y3 = y2 + ldo;
    tile_init(&c0l, &c0h, y0, b, acc, o0);
    tile_init(&c1l, &c1h, y1, b, acc, o0);
    tile_init(&c2l, &c2h, y2, b, acc, o0);
    tile_init(&c3l, &c3h, y3, b, acc, o0);
    for (int i = 0; i < I; i++) {
        const real *wr = w + i * ldw + o0;
        size_t k = i * x.cs;
        vreal wl = vload(wr), wh = vload(wr + VLEN);
        c0l += x0[k] * wl, c0h += x0[k] * wh;
        c1l += x1[k] * wl, c1h += x1[k] * wh;
        c2l += x2[k] * wl, c2h += x2[k] * wh;
        c3l += x3[k] * wl, c3h += x3[k] * wh;
    }
    vstore(y0 + o0, c0l), vstore(y0 + o0 + VLEN, c0h);
    vstore(y1 + o0, c1l), vstore(y1 + o0 + VLEN, c1h);
    vstore(y2 + o0, c2l), vstore(y2 + o0 + VLEN, c2h);
    vstore(y3 + o0, c3l), vstore(y3 + o0 + VLEN, c3h);
}
#else
#define TILE_C 1
static void gemm_tile(real *out, size_t ldo, mview x, const real *w, size_t ldw,
                      const real *b, int acc, int o0, int I)
{
    gemm_edge(out, ldo, x, w, ldw, b, acc, TILE_R, o0, o0 + TILE_C, I);
}
#endif

/* out[N][O] (row stride ldo) = x[N][I] . w[I][O] + (b, or 0 when b is NULL),
 * or out += x . w when acc.  out must not overlap x, w or b. */
static void gemm(real *out, size_t ldo, mview x, const real *w, size_t ldw, const real *b,
                 int acc, int N, int I, int O)
{
    int full_c = O - O % TILE_C, n = 0;
    for (; n + TILE_R <= N; n += TILE_R) {
        real *rows = out + (size_t)n * ldo;
        mview xr = x;
        xr.p += (size_t)n * x.rs;
        for (int o0 = 0; o0 < full_c; o0 += TILE_C)
            gemm_tile(rows, ldo, xr, w, ldw, b, acc, o0, I);
        gemm_edge(rows, ldo, xr, w, ldw, b, acc, TILE_R, full_c, O, I);
    }
    x.p += (size_t)n * x.rs;
    gemm_edge(out + (size_t)n * ldo, ldo, x, w, ldw, b, acc, N - n, 0, O, I);
}

/* out[N][O] = in[N][I] . w[I][O] + b, all contiguous (b may be NULL) */
static void linear_fwd(real *out, const real *in, const real *w, const real *b, int N, int I,
                       int O)
{
    gemm(out, (size_t)O, rows_of(in, (size_t)I), w, (size_t)O, b, 0, N, I, O);
}

/* dst[cols][rows] = src[rows][cols] transposed, src with row stride ld */
static void transpose(real *restrict dst, const real *restrict src, size_t ld, int rows,
                      int cols)
{
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < cols; k++)
            dst[(size_t)k * rows + r] = src[r * ld + k];
}

/* For out = in . w + b: dw[I][O] += in^T . dout; db[O] += the column sums of
 * dout (db may be NULL); din[N][I] = dout . w^T, through wt (w transposed). */
static void linear_bwd_raw(real *dw, real *db, real *din, real *wt, const real *dout,
                           const real *in, const real *w, int N, int I, int O)
{
    gemm(dw, (size_t)O, cols_of(in, (size_t)I), dout, (size_t)O, NULL, 1, I, N, O);
    for (int n = 0; db && n < N; n++)
        for (int o = 0; o < O; o++)
            db[o] += dout[(size_t)n * O + o];
    transpose(wt, w, (size_t)O, I, O);
    gemm(din, (size_t)I, rows_of(dout, (size_t)O), wt, (size_t)I, NULL, 0, N, O, I);
}

/* tanh(u) = 1 - 2/(exp(2u) + 1): one exp, a few times cheaper than libm's tanh;
 * saturates to +-1 without NaN. */
static real fast_tanh(real u)
{
    return R(1) - R(2) / (R_EXP(R(2) * u) + R(1));
}

static void gelu_fwd(real *restrict out, real *restrict th, const real *restrict in, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        real x = in[i];
        real t = fast_tanh(R(GELU_K) * (x + R(GELU_C) * x * x * x));
        th[i] = t;
        out[i] = R(0.5) * x * (R(1) + t);
    }
}

/* d in place: d = d * gelu'(in) */
static void gelu_bwd(real *restrict d, const real *restrict in, const real *restrict th,
                     size_t n)
{
    for (size_t i = 0; i < n; i++) {
        real x = in[i], t = th[i];
        real du = R(GELU_K) * (R(1) + R(3 * GELU_C) * x * x);
        d[i] *= R(0.5) * (R(1) + t) + R(0.5) * x * (R(1) - t * t) * du;
    }
}

static void add_inplace(real *restrict a, const real *restrict b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        a[i] += b[i];
}

/* ---- attention ----
 * Per (sequence b, head h) the products are dense T x T gemms; the causal
 * mask lives in the softmax, which leaves exact zeros above the diagonal, so
 * nothing at s > t reaches position t in either direction. */

/* Softmax of row t of the scores, scaled, over s <= t; zeros after t. */
static void softmax_causal(real *p, int t, int T, real scale)
{
    real mx = p[0] * scale, sum = 0;
    for (int s = 0; s <= t; s++) {
        p[s] *= scale;
        mx = p[s] > mx ? p[s] : mx;
    }
    for (int s = 0; s <= t; s++) {
        p[s] = R_EXP(p[s] - mx);
        sum += p[s];
    }
    for (int s = 0; s <= t; s++)
        p[s] /= sum;
    for (int s = t + 1; s < T; s++)
        p[s] = 0;
}

/* Gradient of the scaled softmax in place: dp -> d scores, row by row. */
static void softmax_causal_bwd(real *dp, const real *p, int T, real scale)
{
    for (int t = 0; t < T; t++) {
        real *d = dp + (size_t)t * T, dot = 0;
        const real *pr = p + (size_t)t * T;
        for (int s = 0; s <= t; s++)
            dot += pr[s] * d[s];
        for (int s = 0; s <= t; s++)
            d[s] = pr[s] * (d[s] - dot) * scale;
        for (int s = t + 1; s < T; s++)
            d[s] = 0;
    }
}

static void attention_head_fwd(work_t *w, layer_act *a, int b, int h, int T)
{
    size_t C = (size_t)w->c.d, C3 = 3 * C, hs = C / (size_t)w->c.heads, tt = (size_t)T;
    const real *q = a->qkv + (size_t)b * T * C3 + h * hs;
    real *att = a->att + ((size_t)b * w->c.heads + h) * T * T;
    transpose(w->kt, q + C, C3, T, (int)hs);
    gemm(att, tt, rows_of(q, C3), w->kt, tt, NULL, 0, T, (int)hs, T);
    for (int t = 0; t < T; t++)
        softmax_causal(att + (size_t)t * T, t, T, R(1) / R_SQRT(R(hs)));
    gemm(a->atty + (size_t)b * T * C + h * hs, C, rows_of(att, tt), q + 2 * C, C3, NULL, 0,
         T, T, (int)hs);
}

/* Writes head h's slices of dq, dk, dv for sequence b into d_qkv. */
static void attention_head_bwd(work_t *w, const layer_act *a, int b, int h, int T)
{
    size_t C = (size_t)w->c.d, C3 = 3 * C, hs = C / (size_t)w->c.heads, tt = (size_t)T;
    size_t base = (size_t)b * T * C3 + h * hs;
    const real *q = a->qkv + base, *att = a->att + ((size_t)b * w->c.heads + h) * T * T;
    const real *dy = w->d_atty + (size_t)b * T * C + h * hs;
    real *dqkv = w->d_qkv + base, *ds = w->d_att;
    transpose(w->kt, q + 2 * C, C3, T, (int)hs); /* the values */
    gemm(ds, tt, rows_of(dy, C), w->kt, tt, NULL, 0, T, (int)hs, T);
    softmax_causal_bwd(ds, att, T, R(1) / R_SQRT(R(hs)));
    gemm(dqkv, C3, rows_of(ds, tt), q + C, C3, NULL, 0, T, T, (int)hs);        /* dq = dS K */
    gemm(dqkv + C, C3, cols_of(ds, tt), q, C3, NULL, 0, T, T, (int)hs);        /* dk = dS^T Q */
    gemm(dqkv + 2 * C, C3, cols_of(att, tt), dy, C, NULL, 0, T, T, (int)hs);   /* dv = P^T dY */
}

/* ---- the model ---- */

static const real *tensor(const work_t *w, const real *base, int l, int k)
{
    return base + w->off[T_LAYERS + PER_LAYER * l + k];
}

static real *gtensor(const work_t *w, real *base, int l, int k)
{
    return base + w->off[T_LAYERS + PER_LAYER * l + k];
}

static void embed_fwd(const work_t *w, const real *p, const int *x, int B, int T)
{
    int C = w->c.d;
    const real *wte = p + w->off[T_WTE], *wpe = p + w->off[T_WPE];
    for (int n = 0; n < B * T; n++) {
        real *out = w->res0 + (size_t)n * C;
        const real *te = wte + (size_t)x[n] * C, *pe = wpe + (size_t)(n % T) * C;
        for (int i = 0; i < C; i++)
            out[i] = te[i] + pe[i];
    }
}

/* out = in . W + b for layer l's tensors kw (W) and kw + 1 (b) */
static void linear_fwd_l(const work_t *w, const real *p, int l, int kw, real *out,
                         const real *in, int N, int I, int O)
{
    linear_fwd(out, in, tensor(w, p, l, kw), tensor(w, p, l, kw + 1), N, I, O);
}

static void block_fwd(work_t *w, const real *p, int l, const real *in, int B, int T)
{
    layer_act *a = &w->act[l];
    int N = B * T, C = w->c.d;
    layernorm_fwd(a->ln1, a->ln1_mean, a->ln1_rstd, in, tensor(w, p, l, L_LN1W),
                  tensor(w, p, l, L_LN1B), N, C);
    linear_fwd_l(w, p, l, L_QKVW, a->qkv, a->ln1, N, C, 3 * C);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < w->c.heads; h++)
            attention_head_fwd(w, a, b, h, T);
    linear_fwd_l(w, p, l, L_PROJW, a->res_mid, a->atty, N, C, C);
    add_inplace(a->res_mid, in, (size_t)N * C);
    layernorm_fwd(a->ln2, a->ln2_mean, a->ln2_rstd, a->res_mid, tensor(w, p, l, L_LN2W),
                  tensor(w, p, l, L_LN2B), N, C);
    linear_fwd_l(w, p, l, L_FCW, a->fc, a->ln2, N, C, 4 * C);
    gelu_fwd(a->fc_act, a->fc_th, a->fc, (size_t)N * 4 * C);
    linear_fwd_l(w, p, l, L_FC2W, a->res_out, a->fc_act, N, 4 * C, C);
    add_inplace(a->res_out, a->res_mid, (size_t)N * C);
}

/* Logits to probabilities in place; the summed cross-entropy (0 without y). */
static double softmax_xent(real *probs, const int *y, int N, int V)
{
    double loss = 0;
    for (int n = 0; n < N; n++) {
        real *r = probs + (size_t)n * V, mx = r[0], sum = 0;
        for (int v = 1; v < V; v++)
            mx = r[v] > mx ? r[v] : mx;
        real ly = y ? r[y[n]] - mx : R(0);
        for (int v = 0; v < V; v++) {
            r[v] = R_EXP(r[v] - mx);
            sum += r[v];
        }
        for (int v = 0; v < V; v++)
            r[v] /= sum;
        if (y)
            loss += (double)(R_LOG(sum) - ly);
    }
    return loss;
}

static double forward(work_t *w, const real *p, const int *x, const int *y, int B, int T)
{
    int N = B * T, C = w->c.d, L = w->c.layers, fin = T_LAYERS + PER_LAYER * L;
    const real *res = w->res0;
    embed_fwd(w, p, x, B, T);
    for (int l = 0; l < L; l++) {
        block_fwd(w, p, l, res, B, T);
        res = w->act[l].res_out;
    }
    layernorm_fwd(w->lnf, w->lnf_mean, w->lnf_rstd, res, p + w->off[fin + F_LNFW],
                  p + w->off[fin + F_LNFB], N, C);
    linear_fwd(w->probs, w->lnf, p + w->off[fin + F_HEAD], NULL, N, C, w->c.vocab);
    return softmax_xent(w->probs, y, N, w->c.vocab) / N;
}

/* Backward of linear_fwd_l: dW and db accumulate into g, din = dout . W^T. */
static void linear_bwd(work_t *w, const real *p, real *g, int l, int kw, real *din,
                       const real *dout, const real *in, int N, int I, int O)
{
    linear_bwd_raw(gtensor(w, g, l, kw), gtensor(w, g, l, kw + 1), din, w->wt, dout, in,
                   tensor(w, p, l, kw), N, I, O);
}

/* On entry w->d_res holds d loss / d(res_out of layer l); on exit, d loss / d(its input). */
static void block_bwd(work_t *w, const real *p, real *g, int l, const real *in, int B, int T)
{
    layer_act *a = &w->act[l];
    int N = B * T, C = w->c.d;
    linear_bwd(w, p, g, l, L_FC2W, w->d_fc, w->d_res, a->fc_act, N, 4 * C, C);
    gelu_bwd(w->d_fc, a->fc, a->fc_th, (size_t)N * 4 * C);
    linear_bwd(w, p, g, l, L_FCW, w->d_ln, w->d_fc, a->ln2, N, C, 4 * C);
    layernorm_bwd(w->d_res, gtensor(w, g, l, L_LN2W), gtensor(w, g, l, L_LN2B), w->d_ln,
                  a->res_mid, tensor(w, p, l, L_LN2W), a->ln2_mean, a->ln2_rstd, N, C);
    linear_bwd(w, p, g, l, L_PROJW, w->d_atty, w->d_res, a->atty, N, C, C);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < w->c.heads; h++)
            attention_head_bwd(w, a, b, h, T);
    linear_bwd(w, p, g, l, L_QKVW, w->d_ln, w->d_qkv, a->ln1, N, C, 3 * C);
    layernorm_bwd(w->d_res, gtensor(w, g, l, L_LN1W), gtensor(w, g, l, L_LN1B), w->d_ln,
                  in, tensor(w, p, l, L_LN1W), a->ln1_mean, a->ln1_rstd, N, C);
}

static void logits_bwd(work_t *w, const int *y, int N)
{
    int V = w->c.vocab;
    real inv = R(1) / R(N);
    for (int n = 0; n < N; n++) {
        const real *pr = w->probs + (size_t)n * V;
        real *d = w->d_logits + (size_t)n * V;
        for (int v = 0; v < V; v++)
            d[v] = pr[v] * inv;
        d[y[n]] -= inv;
    }
}

static void embed_bwd(const work_t *w, real *g, const int *x, int B, int T)
{
    int C = w->c.d;
    real *dte = g + w->off[T_WTE], *dpe = g + w->off[T_WPE];
    for (int n = 0; n < B * T; n++) {
        const real *d = w->d_res + (size_t)n * C;
        add_inplace(dte + (size_t)x[n] * C, d, (size_t)C);
        add_inplace(dpe + (size_t)(n % T) * C, d, (size_t)C);
    }
}

static void backward(work_t *w, const real *p, real *g, const int *x, const int *y, int B,
                     int T)
{
    int N = B * T, C = w->c.d, V = w->c.vocab, L = w->c.layers;
    int fin = T_LAYERS + PER_LAYER * L;
    logits_bwd(w, y, N);
    linear_bwd_raw(g + w->off[fin + F_HEAD], NULL, w->d_ln, w->wt, w->d_logits, w->lnf,
                   p + w->off[fin + F_HEAD], N, C, V);
    memset(w->d_res, 0, (size_t)N * C * sizeof(real));
    layernorm_bwd(w->d_res, g + w->off[fin + F_LNFW], g + w->off[fin + F_LNFB], w->d_ln,
                  w->act[L - 1].res_out, p + w->off[fin + F_LNFW], w->lnf_mean,
                  w->lnf_rstd, N, C);
    if (w->ready)
        w->ready(w->ready_ctx, fin, N_FINAL);
    for (int l = L - 1; l >= 0; l--) {
        block_bwd(w, p, g, l, l > 0 ? w->act[l - 1].res_out : w->res0, B, T);
        if (w->ready)
            w->ready(w->ready_ctx, T_LAYERS + PER_LAYER * l, PER_LAYER);
    }
    embed_bwd(w, g, x, B, T);
    if (w->ready)
        w->ready(w->ready_ctx, T_WTE, T_LAYERS);
}

/* ---- workspace ---- */

static real *take(real *base, size_t *used, size_t n)
{
    real *p = base ? base + *used : NULL;
    *used += n;
    return p;
}

/* Points every buffer into base (NULL: only count); returns the reals needed. */
static size_t carve(work_t *w, real *base)
{
    size_t N = (size_t)w->B * w->T, C = (size_t)w->c.d, T = (size_t)w->T, used = 0;
    size_t V = (size_t)w->c.vocab, hs = C / (size_t)w->c.heads;
    size_t wmax = C * (4 * C > V ? 4 * C : V);
    for (int l = 0; l < w->c.layers; l++) {
        layer_act *a = &w->act[l];
        a->ln1 = take(base, &used, N * C);
        a->ln1_mean = take(base, &used, N);
        a->ln1_rstd = take(base, &used, N);
        a->qkv = take(base, &used, N * 3 * C);
        a->att = take(base, &used, (size_t)w->B * (size_t)w->c.heads * T * T);
        a->atty = take(base, &used, N * C);
        a->res_mid = take(base, &used, N * C);
        a->ln2 = take(base, &used, N * C);
        a->ln2_mean = take(base, &used, N);
        a->ln2_rstd = take(base, &used, N);
        a->fc = take(base, &used, N * 4 * C);
        a->fc_th = take(base, &used, N * 4 * C);
        a->fc_act = take(base, &used, N * 4 * C);
        a->res_out = take(base, &used, N * C);
    }
    w->res0 = take(base, &used, N * C);
    w->lnf = take(base, &used, N * C);
    w->lnf_mean = take(base, &used, N);
    w->lnf_rstd = take(base, &used, N);
    w->probs = take(base, &used, N * V);
    w->d_logits = take(base, &used, N * V);
    w->d_res = take(base, &used, N * C);
    w->d_ln = take(base, &used, N * C);
    w->d_atty = take(base, &used, N * C);
    w->d_qkv = take(base, &used, N * 3 * C);
    w->d_fc = take(base, &used, N * 4 * C);
    w->d_att = take(base, &used, T * T);
    w->kt = take(base, &used, hs * T);
    w->wt = take(base, &used, wmax);
    return used;
}

static int fill_offsets(work_t *w, const gpt_config *c)
{
    int n = gpt_layout(c, NULL, 0);
    gpt_tensor *ts = malloc((size_t)n * sizeof *ts);
    w->off = malloc((size_t)n * sizeof *w->off);
    if (!ts || !w->off) {
        free(ts);
        return -1;
    }
    gpt_layout(c, ts, n);
    for (int i = 0; i < n; i++)
        w->off[i] = ts[i].offset;
    free(ts);
    return 0;
}

work_t *GPT_FN(work_new)(const gpt_config *c, int B, int T)
{
    if (gpt_config_check(c) != 0 || B < 1 || B > (1 << 16) || T < 1 || T > c->ctx)
        return NULL;
    work_t *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    w->c = *c;
    w->nparams = gpt_num_params(c);
    w->B = B;
    w->T = T;
    w->act = calloc((size_t)c->layers, sizeof *w->act);
    if (!w->act || fill_offsets(w, c) != 0)
        goto fail;
    w->block = malloc(carve(w, NULL) * sizeof(real));
    if (!w->block)
        goto fail;
    carve(w, w->block);
    return w;
fail:
    GPT_FN(work_free)(w);
    return NULL;
}

void GPT_FN(work_on_ready)(work_t *w, gpt_ready_fn fn, void *ctx)
{
    if (w) {
        w->ready = fn;
        w->ready_ctx = ctx;
    }
}

void GPT_FN(work_free)(work_t *w)
{
    if (!w)
        return;
    free(w->block);
    free(w->off);
    free(w->act);
    free(w);
}

const real *GPT_FN(work_probs)(const work_t *w)
{
    return w ? w->probs : NULL;
}

static int args_ok(const gpt_config *c, const work_t *w, const real *p, const int *x,
                   const int *y, int B, int T)
{
    if (!c || !w || !p || !x || B < 1 || T < 1 || B > w->B || T > w->T ||
        memcmp(c, &w->c, sizeof *c) != 0)
        return 0;
    for (int n = 0; n < B * T; n++)
        if (x[n] < 0 || x[n] >= c->vocab || (y && (y[n] < 0 || y[n] >= c->vocab)))
            return 0;
    return 1;
}

real GPT_FN(loss)(const gpt_config *c, work_t *w, const real *params, const int *x,
                  const int *y, int B, int T)
{
    if (!args_ok(c, w, params, x, y, B, T))
        return R(NAN);
    return (real)forward(w, params, x, y, B, T);
}

real GPT_FN(forward_backward)(const gpt_config *c, work_t *w, const real *params,
                              real *grads, const int *x, const int *y, int B, int T)
{
    if (!y || !grads || !args_ok(c, w, params, x, y, B, T))
        return R(NAN);
    double loss = forward(w, params, x, y, B, T);
    memset(grads, 0, w->nparams * sizeof(real));
    backward(w, params, grads, x, y, B, T);
    return (real)loss;
}
