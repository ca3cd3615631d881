/* scape_seg.h - the segmented kernels of the device executor.
 *
 * One launch covers a table of tensors, never one tensor: a layout of a
 * thousand tensors costs a handful of launches per step.  The table lists
 * the tensors in comm order (daemon/plan.h): tensor j's elements are
 * [pos, pos + len) of the comm-order vectors, its mask bits start on word
 * `word` of the comm-space mask (bits past len are zero), and its trainers'
 * coordinates are [off, off + len) of their buffers.  A set bit's place in a
 * packed vector is the number of set bits before it in the whole mask (the
 * padding bits between tensors are zero), found from a scan per tile of
 * KSEG_TILE words (KSEG_SCAN) and a prefix inside the tile.
 *
 * Every kernel has a CPU version (cpu_seg.c) and a CUDA version
 * (cuda_seg.cu) with the same arguments; both compute each element with
 * scape_formula.h and find it with the inline functions below, so the CPU
 * version is the GPU's arithmetic and index math, run in order.  Launches
 * go by kernel id through kseg_run_cpu / kseg_run_cuda, so that a caller
 * can queue them (daemon/dev_sim.c); the arguments are plain structs of
 * device pointers, copied by value.
 *
 * Errors a kernel can meet in its data (a packed index past the buffer it
 * writes, a peer's mask code that breaks maskcode.h's rules) are recorded
 * in a kseg_status in device memory, never acted on: the caller reads it
 * once the stream has run.  Argument errors are the caller's, checked by
 * the executor when it builds the tables.
 */
#ifndef SCAPE_SEG_H
#define SCAPE_SEG_H

#include <stddef.h>
#include <stdint.h>

#include "scape_formula.h"
#include "scape_rc.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KSEG_TILE 256         /* mask words per tile (one CUDA block) */
#define KSEG_MAX_TRAINERS 64  /* trainer buffers one launch reads or writes */
#define KSEG_BINS0 2048       /* top-k: the top digit (key bits 30..20) */
#define KSEG_BINS 1024        /* the lower digits (19..10, 9..0) */
#define KSEG_GROUPS 16        /* parameter groups (daemon/engine.h ENG_MAX_GROUPS) */

typedef struct kseg_tensor {
    uint64_t pos;    /* first element in comm-order vectors */
    uint64_t off;    /* first coordinate in the trainers' buffers */
    uint64_t word;   /* first mask word */
    uint32_t len;    /* coordinates, >= 1 */
    uint32_t k;      /* k_l */
    uint32_t group;  /* parameter group: UPDATE's glr[group], gwd[group] */
    uint32_t pad;
} kseg_tensor;

/* What the kernels found in their data; zeroed by the caller. */
typedef struct kseg_status {
    uint32_t err;            /* KSEG_E_* bits */
    uint32_t pad;
    uint64_t first;          /* the first bad mask code: rank << 40 | tensor << 8 | what */
    uint64_t churn[2];       /* KSEG_CHURN: bits of cur not in prev, bits of cur */
    double norm2;            /* KSEG_PACK: sum of the new residual's squares */
} kseg_status;

enum {
    KSEG_E_PACKED = 1u << 0, /* a packed index past k_cap (a mask with too many bits) */
    KSEG_E_CODE = 1u << 1,   /* a peer's mask code is malformed (first says how) */
};

/* kseg_status.first's `what` for a bad code, as maskcode.c words it. */
enum {
    KSEG_BAD_TAIL = 1,   /* bits set past the tensor's end */
    KSEG_BAD_COUNT,      /* not exactly k bits */
    KSEG_BAD_ORDER,      /* positions not ascending inside the tensor */
    KSEG_BAD_PADDING,    /* padding is not zero */
    KSEG_BAD_K,          /* (encode) a tensor of the own mask has not k bits */
};

typedef enum kseg_kernel {
    KSEG_SCAN = 0,    /* tiles[i] = set bits of words [w0, w0 + i * TILE); [ntiles] = all */
    KSEG_PACK,        /* a = G + e; packed at the mask (or dense); keys */
    KSEG_GSUM,        /* out[i] = G_r[i], i < n (layout order) */
    KSEG_UPDATE,      /* the update variant (scape_f_update) on the mask (or dense) */
    KSEG_COMPACT,     /* theta at the mask -> packed (or dense) */
    KSEG_WRITEBACK,   /* packed (or dense) -> every trainer's buffer */
    KSEG_LOAD_THETA,  /* a trainer-form buffer -> theta (dense) */
    KSEG_CHURN,       /* status.churn over words [w0, w1) */
    KSEG_SQSUM,       /* *sq_total = the squares of in[0 .. n) / div, summed by
                         scape_formula.h's rule (chunk totals in sq) */
    KSEG_TOPK_HIST,   /* histogram of one digit per selected tensor */
    KSEG_TOPK_PICK,   /* the bucket of the k-th largest key per tensor */
    KSEG_TOPK_COUNT,  /* keys equal to tau per item */
    KSEG_TOPK_SCAN,   /* their exclusive scan within each tensor */
    KSEG_TOPK_WRITE,  /* the mask words: keys above tau and the first ties */
    KSEG_ENCODE,      /* mask words -> code (maskcode.h) */
    KSEG_DECODE_ZERO, /* clear the words of index-coded tensors (not merging) */
    KSEG_DECODE_MAP,  /* bitmap-coded tensors: words, tails, bit counts */
    KSEG_DECODE_POS,  /* index-coded tensors: positions, order, bits */
    KSEG_DECODE_CHECK,/* bit counts and zero padding */
    KSEG_NKERNELS
} kseg_kernel;

/* The word-range kernels (SCAN, PACK, GSUM, UPDATE, COMPACT, WRITEBACK,
 * LOAD_THETA, CHURN) over words [w0, w1); a field a kernel does not name is
 * ignored.  Vectors of comm order are addressed by pos minus a base (the
 * state range's, a streamed chunk's). */
typedef struct kseg_args {
    const kseg_tensor *t;   /* every tensor, comm order */
    uint32_t nt;
    uint64_t w0, w1;        /* any words; SCAN counts from w0, the others
                               address packed values from word 0 */
    const uint32_t *mask;   /* NULL: dense (every coordinate) */
    const uint32_t *prev;   /* CHURN */
    uint32_t *tiles;        /* SCAN writes, the others read (scan from word 0) */
    const void *tr[KSEG_MAX_TRAINERS]; /* trainers' buffers, layout order */
    uint32_t ntr;
    int bf16;               /* their dtype: grads (PACK, GSUM), params (WRITEBACK, LOAD_THETA) */
    float *e;               /* PACK: residual at e[pos - e_base] */
    uint64_t e_base;
    int e_zero;             /* PACK: the residual reads as zero (e may be NULL
                               unless e_write) */
    int e_write;            /* PACK, with a mask: store the new residual */
    int wire_bf16;          /* PACK, with a mask: send bf16(a), keep the rest
                               (scape_formula.h, scape_f_send) */
    int vbf16;              /* COMPACT writes, WRITEBACK reads the packed
                               values as bf16 (in the bytes of out / in) */
    int delta;              /* COMPACT: the change from trainer tr[0]'s fp32
                               value in bf16 (vbf16 set), theta = old + it;
                               WRITEBACK: added to every trainer's value
                               (scape_f_delta, scape_f_apply_delta) */
    float *out;             /* PACK, COMPACT, GSUM: packed index, or pos when
                               dense; PACK with NULL: keys only */
    const float *in;        /* UPDATE: the sums; WRITEBACK: the values; LOAD_THETA: source */
    uint64_t k_cap;         /* packed indexes must stay below it */
    uint64_t n;             /* GSUM: coordinates; LOAD_THETA: the state's length */
    float *theta, *m, *v;   /* state at [pos - s_base] */
    uint64_t s_base;
    uint32_t *keys;         /* PACK: keys[pos - key_lo] for pos in [key_lo, key_hi) */
    uint64_t key_lo, key_hi;
    int key_abs;            /* the key of |a| (topk-adamw) instead of SCAPE's statistic */
    float beta1, c1, t_r;   /* the statistic */
    int update;             /* UPDATE: the variant (scape_f_update); v only where
                               scape_f_update_reads_v */
    float b1, b2, eps, bc1, bc2, div;
    float glr[KSEG_GROUPS], gwd[KSEG_GROUPS]; /* UPDATE: per parameter group
                                                 (kseg_tensor.group) */
    float clip;             /* UPDATE: the clipping coefficient (scape_f_clip);
                               SQSUM: none */
    double *sq;             /* SQSUM: scratch of kseg_sq_chunks(n) chunk totals */
    double *sq_total;       /* SQSUM: the sum of the squares of in[j] / div, j < n,
                               by the rule of scape_formula.h */
    kseg_status *status;
} kseg_args;

/* A selected tensor's share of the top-k passes: at most KSEG_TILE of its
 * words.  Items of one tensor are consecutive and cover all its words. */
typedef struct kseg_item {
    uint64_t word;          /* first word (comm space) */
    uint32_t nwords;
    uint32_t sel;           /* the tensor's index in the selection */
} kseg_item;

/* Per selected tensor: the radix select so far. */
typedef struct kseg_tstate {
    uint32_t digit[3];
    uint32_t need;          /* keys to take inside the chosen bucket */
    uint32_t tau;           /* the k-th largest key */
    uint32_t eq_total;      /* keys equal to tau */
} kseg_tstate;

typedef struct kseg_topk_args {
    const kseg_tensor *t;   /* every tensor, comm order */
    uint32_t first, nsel;   /* the selection: tensors [first, first + nsel) */
    const kseg_item *items;
    uint32_t nitems;
    const uint32_t *item0;  /* nsel + 1: each tensor's first item */
    const uint32_t *keys;   /* keys[pos - key_lo] */
    uint64_t key_lo;
    uint32_t *hist;         /* nsel x KSEG_BINS0, zeroed before each HIST */
    kseg_tstate *st;        /* nsel */
    uint32_t *item_eq;      /* nitems: ties per item, then their scan */
    uint32_t *mask;         /* the words written (comm space) */
    int level;              /* HIST, PICK: the digit, 0..2 */
} kseg_topk_args;

/* One tensor's place in a range's mask code (maskcode.h). */
typedef struct kseg_code {
    uint32_t tensor;        /* comm index */
    uint32_t by_index;      /* positions (1) or bitmap words (0) */
    uint32_t bits;          /* bits of a position */
    uint32_t pad;
    uint64_t at;            /* bitmap: its first code word; index: its first bit */
    uint64_t kcum;          /* k of the range's tensors before it */
    uint64_t qbase;         /* positions of the range's index-coded tensors before it
                               (also for a bitmap-coded one, so that the last entry
                               with qbase <= f is the index-coded tensor of
                               position f) */
} kseg_code;

typedef struct kseg_code_args {
    const kseg_tensor *t;   /* every tensor, comm order */
    const kseg_code *c;     /* the range's tensors, in order */
    uint32_t nc;
    uint64_t w0, nwords;    /* the range's mask words */
    uint64_t npos;          /* positions of its index-coded tensors */
    uint64_t pos_bits;      /* bits they take: code words map_words.. hold them */
    uint64_t map_words;     /* code words of its bitmap-coded tensors */
    uint64_t code_words;    /* words of its code */
    uint32_t *words;        /* the mask words (comm space) */
    uint32_t *code;         /* the range's code */
    const uint32_t *tiles;  /* ENCODE: scan of the range's words from w0 */
    uint32_t *count;        /* nc entries of scratch: DECODE counts each bitmap-coded
                               tensor's bits there (zeroed first); the CUDA ENCODE
                               each entry's bits before it */
    int merge;              /* DECODE: OR into the words */
    uint32_t rank;          /* DECODE: the sender, for status.first */
    kseg_status *status;
} kseg_code_args;

/* Bytes of kernel k's argument struct. */
size_t kseg_args_bytes(kseg_kernel k);
/* Run kernel k now on the CPU. */
scape_rc kseg_run_cpu(kseg_kernel k, const void *args);
/* Enqueue kernel k on a CUDA stream (cudaStream_t); UNSUPPORTED without CUDA. */
scape_rc kseg_run_cuda(kseg_kernel k, const void *args, void *stream);
/* Tiles of a scan over nw words, and the entries KSEG_SCAN writes. */
static inline uint64_t kseg_tiles(uint64_t nw) { return (nw + KSEG_TILE - 1) / KSEG_TILE; }

/* Chunks of SCAPE_SQ_CHUNK values that hold n (SQSUM's scratch entries). */
SCAPE_HD uint64_t kseg_sq_chunks(uint64_t n) { return (n + SCAPE_SQ_CHUNK - 1) / SCAPE_SQ_CHUNK; }

/* ---- index math, both compilers ------------------------------------------- */

/* The tensor whose words hold word w: the last j in [lo, hi) with
 * t[j].word <= w. */
SCAPE_HD uint32_t kseg_find(const kseg_tensor *t, uint32_t lo, uint32_t hi, uint64_t w)
{
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (t[mid].word <= w)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

SCAPE_HD uint64_t kseg_words_of(const kseg_tensor *t) { return ((uint64_t)t->len + 31) / 32; }

/* The key of coordinate pos for the selection, from a and m (PACK). */
SCAPE_HD uint32_t kseg_key(const kseg_args *a, uint64_t pos, float av)
{
    if (a->key_abs)
        return scape_f_key(scape_f_abs_stat(av));
    return scape_f_key(scape_f_stat(a->m[pos - a->s_base], av, a->beta1, a->c1, a->t_r));
}

/* The trainer-order sum of the local gradients at coordinate c. */
SCAPE_HD float kseg_grad(const kseg_args *a, uint64_t c)
{
    float g = scape_f_load(a->tr[0], a->bf16, c);
    for (uint32_t q = 1; q < a->ntr; q++)
        g = scape_f_grad_add(g, scape_f_load(a->tr[q], a->bf16, c));
    return g;
}

/* Accumulators a thread keeps across its elements. */
typedef struct kseg_acc {
    double norm2;
    uint32_t err;
} kseg_acc;

/* PACK of element i of tensor t (comm position pos): `on` is its mask bit,
 * j its packed index (the dense index pos when there is no mask).  With
 * out NULL only the keys are written (topk-adamw's own selection). */
SCAPE_HD void kseg_pack_elem(const kseg_args *a, const kseg_tensor *t, uint64_t i, uint64_t pos,
                             int on, uint64_t j, kseg_acc *acc)
{
    float ein = a->e_zero ? 0.0f : a->e[pos - a->e_base];
    float av = scape_f_ef(kseg_grad(a, t->off + i), ein);
    if (a->keys && pos >= a->key_lo && pos < a->key_hi)
        a->keys[pos - a->key_lo] = kseg_key(a, pos, av);
    if (a->out == NULL)
        return;
    if (a->mask == NULL) {
        a->out[pos] = av;
        return;
    }
    float enew = av;
    if (on && j < a->k_cap) {
        a->out[j] = scape_f_send(av, a->wire_bf16, &enew);
    } else if (on) {
        acc->err |= KSEG_E_PACKED; /* not sent: it stays in the residual */
    }
    if (a->e_write) {
        a->e[pos - a->e_base] = enew;
        acc->norm2 += (double)enew * (double)enew;
    }
}

/* UPDATE of element pos: the optimizer step from its reduced sum. */
SCAPE_HD void kseg_update_elem(const kseg_args *a, const kseg_tensor *t, uint64_t pos,
                               uint64_t j, kseg_acc *acc)
{
    if (j >= a->k_cap) {
        acc->err |= KSEG_E_PACKED;
        return;
    }
    uint64_t s = pos - a->s_base;
    float g = scape_f_clip(scape_f_mean(a->in[j], a->div), a->clip);
    scape_f_update(a->update, &a->theta[s], &a->m[s], a->v ? &a->v[s] : NULL, g, a->b1, a->b2,
                   a->eps, a->gwd[t->group], a->glr[t->group], a->bc1, a->bc2);
}

SCAPE_HD void kseg_compact_elem(const kseg_args *a, const kseg_tensor *t, uint64_t i,
                                 uint64_t pos, uint64_t j, kseg_acc *acc)
{
    if (j >= a->k_cap) {
        acc->err |= KSEG_E_PACKED;
        return;
    }
    float *th = &a->theta[pos - a->s_base];
    if (a->delta) {
        float old = scape_f_load(a->tr[0], 0, t->off + i);
        float d = scape_f_delta(old, *th);
        *th = scape_f_apply_delta(old, d);
        scape_f_store(a->out, 1, j, d);
    } else {
        scape_f_store(a->out, a->vbf16, j, *th);
    }
}

SCAPE_HD void kseg_writeback_elem(const kseg_args *a, const kseg_tensor *t, uint64_t i,
                                  uint64_t j, kseg_acc *acc)
{
    if (j >= a->k_cap) {
        acc->err |= KSEG_E_PACKED;
        return;
    }
    float x = scape_f_load(a->in, a->vbf16, j);
    for (uint32_t q = 0; q < a->ntr; q++) {
        float y = a->delta ? scape_f_apply_delta(scape_f_load(a->tr[q], 0, t->off + i), x) : x;
        scape_f_store((void *)a->tr[q], a->bf16, t->off + i, y);
    }
}

SCAPE_HD void kseg_load_theta_elem(const kseg_args *a, const kseg_tensor *t, uint64_t i,
                                   uint64_t pos)
{
    if (pos >= a->s_base && pos - a->s_base < a->n)
        a->theta[pos - a->s_base] = scape_f_load(a->in, a->bf16, t->off + i);
}

/* One element of a word-range kernel: `on` its mask bit (1 when dense) and
 * j its packed index (pos when dense). */
SCAPE_HD void kseg_elem(kseg_kernel op, const kseg_args *a, const kseg_tensor *t, uint64_t i,
                        int on, uint64_t j, kseg_acc *acc)
{
    uint64_t pos = t->pos + i;
    switch (op) {
    case KSEG_PACK: kseg_pack_elem(a, t, i, pos, on, j, acc); break;
    case KSEG_UPDATE: if (on) kseg_update_elem(a, t, pos, j, acc); break;
    case KSEG_COMPACT: if (on) kseg_compact_elem(a, t, i, pos, j, acc); break;
    case KSEG_WRITEBACK: if (on) kseg_writeback_elem(a, t, i, j, acc); break;
    case KSEG_LOAD_THETA: kseg_load_theta_elem(a, t, i, pos); break;
    default: break;
    }
}

/* ---- top-k: one selected tensor's digits --------------------------------
 * The radix select, written once for every top-k of kernels/: the per-tensor
 * CPU one of the host executor (cpu_topk.c) and the segmented CPU and CUDA
 * ones (cpu_seg.c, cuda_seg.cu) split a key (scape_f_key) into the same
 * three digits, pick the bucket of the k-th largest key by the same rule and
 * take the ties in index order by the same rule; they differ only in how
 * they run the passes. */

/* The bits of digit `level` of a key, and whether the key's higher digits
 * are those chosen so far. */
SCAPE_HD uint32_t kseg_digit(uint32_t key, int level)
{
    return level == 0 ? key >> 20 : level == 1 ? (key >> 10) & 1023u : key & 1023u;
}

SCAPE_HD int kseg_in_prefix(const kseg_tstate *s, uint32_t key, int level)
{
    if (level == 0)
        return 1;
    if (level == 1)
        return (key >> 20) == s->digit[0];
    return (key >> 10) == ((s->digit[0] << 10) | s->digit[1]);
}

/* The bucket of a digit's histogram h (`bins` buckets) that holds the
 * need-th largest key, walking down from the top; *above gets the count of
 * the buckets above it.  need 0 gives the top bucket, fewer keys than need
 * bucket 0 (neither happens with 1 <= k <= len).  The CUDA version
 * (topk_pick_kernel) finds the same bucket with a block scan. */
SCAPE_HD uint32_t kseg_pick(const uint32_t *h, uint32_t bins, uint32_t need, uint32_t *above)
{
    uint32_t acc = 0, d = bins - 1;
    while (acc + h[d] < need && d > 0)
        acc += h[d--];
    *above = acc;
    return d;
}

/* Choose the bucket of digit `level` that holds the need-th largest key,
 * given above[d] = keys in buckets above d (computed by the caller). */
SCAPE_HD void kseg_record_digit(kseg_tstate *s, int level, uint32_t d, uint32_t need_left,
                                uint32_t in_bucket)
{
    s->digit[level] = d;
    s->need = need_left;
    if (level == 2) {
        s->tau = (s->digit[0] << 20) | (s->digit[1] << 10) | d;
        s->eq_total = in_bucket;
    }
}

/* The tie bits of a word whose first tie has rank `off` among the tensor's
 * ties: those ranked below need. */
SCAPE_HD uint32_t kseg_first_ties(uint32_t eq, uint32_t off, uint32_t need)
{
    if (off >= need)
        return 0;
    uint32_t left = need - off, sel = 0;
    for (; eq && left; left--) {
        sel |= eq & (0u - eq);
        eq &= eq - 1;
    }
    return sel;
}

/* A mask word of the selection from its keys above tau (gt) and equal to it
 * (eq), the first of whose ties has rank `off` among the tensor's: all of
 * gt, and the ties ranked below need (all of them when the tensor's ties
 * are all taken). */
SCAPE_HD uint32_t kseg_topk_word(const kseg_tstate *s, uint32_t gt, uint32_t eq, uint32_t off)
{
    return gt | (s->need < s->eq_total ? kseg_first_ties(eq, off, s->need) : eq);
}

/* ---- mask code ---------------------------------------------------------------- */

/* b bits of value v at bit `at` of a little-endian stream of words: the
 * parts for word at / 32 and the next (b <= 32). */
SCAPE_HD void kseg_bits_split(uint64_t at, uint32_t v, uint32_t b, uint32_t *lo, uint32_t *hi,
                              int *spans)
{
    uint32_t sh = (uint32_t)(at & 31);
    uint64_t x = (uint64_t)(b < 32 ? v & ((1u << b) - 1u) : v) << sh;
    *lo = (uint32_t)x;
    *hi = (uint32_t)(x >> 32);
    *spans = sh + b > 32;
}

/* b bits at bit `at` of the stream (b <= 32). */
SCAPE_HD uint32_t kseg_bits_get(const uint32_t *code, uint64_t at, uint32_t b)
{
    uint32_t sh = (uint32_t)(at & 31);
    uint64_t x = code[at >> 5] >> sh;
    if (sh + b > 32)
        x |= (uint64_t)code[(at >> 5) + 1] << (32 - sh);
    return b < 32 ? (uint32_t)x & ((1u << b) - 1u) : (uint32_t)x;
}

/* The first bad-code record: lower ranks, then lower tensors, win. */
SCAPE_HD uint64_t kseg_bad(uint32_t rank, uint32_t tensor, uint32_t what)
{
    return ((uint64_t)rank << 40) | ((uint64_t)tensor << 8) | what;
}

#ifdef __cplusplus
}
#endif

#endif /* SCAPE_SEG_H */
