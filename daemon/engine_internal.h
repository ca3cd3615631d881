/* engine_internal.h - the engine's state, shared by engine.c (the step) and
 * engine_inspect.c (read-only views for tests, status and checkpoints).
 *
 * The vectors belong to the executor (exec.h), which allocates them; the
 * engine keeps the plan, the step's bookkeeping and small host arrays
 * (per-tensor offsets, per-rank counts).  Memory beyond the optimizer state
 * (m, theta, v) and the residual is kept small: two masks of N bits, two
 * buffers of K_cap floats (sum k_l for SCAPE) and, on the host executor, one
 * chunk per worker for summing the trainers' gradients.  A dense step packs
 * in place in the residual where the residual is the executor's working
 * memory, which the comm order makes possible: the residual is stored in
 * comm order, so with every bit set it already is the packed send buffer.
 * SCAPE selects the next mask after the pack, from the a = G + e the pack
 * stored, so G is never whole in memory.
 */
#ifndef SCAPE_ENGINE_INTERNAL_H
#define SCAPE_ENGINE_INTERNAL_H

#include "engine.h"
#include "exec.h"
#include "maskcode.h"
#include "plan.h"
#include "pool.h"
#include "try.h"

struct eng {
    eng_config cfg;
    plan *p;
    comm_t *comm;
    int rank;
    int tr;              /* trainers on this rank, T_r */
    int t_total;         /* T */
    kern_dtype pdt, gdt;
    uint64_t last_step;
    int initialised;
    int broken;          /* a step failed after its collectives began */

    exec_t *x;           /* the executor: it owns every vector below */

    /* Optimizer state in comm order, elements [base, base + len). */
    size_t state_base, state_len;
    float *m, *v, *theta;

    float *e;            /* residual e_r, comm order, N */
    int e_stale;         /* the residual is zero (e holds a dense step's sums,
                            or nothing) */
    float *dense;        /* where a dense step packs a and reduces it, N (the
                            residual itself where it is N floats of the
                            executor's working memory) */
    float *g;            /* topk-adamw: G_r whole, coordinate order */
    size_t k_cap;        /* most values a sparse step reduces */
    float *send;         /* sparse: packed a_r, then the sums (own segment in place) */
    float *upd;          /* sparse: packed updated parameters */

    uint32_t *mask_buf[2];
    const uint32_t *mask_cur; /* mask of the last step; NULL: all ones (dense) */
    uint32_t *mask_next; /* target of the lagged all-gather */
    int mask_pending;    /* that all-gather is outstanding */
    double mask_started; /* when it started (monotonic seconds) */
    uint32_t *code_all;  /* every rank's mask bits in wire form (maskcode.h), as
                          * the mask all-gather leaves them; this rank's code is
                          * encoded in place at code_off */
    size_t *code_bytes;  /* per rank: the size of its code */
    size_t code_off;     /* bytes before this rank's code */
    size_t code_total;   /* bytes of all ranks' codes: a mask all-gather's payload */
    size_t code_cap;     /* the most code_total can be (code_all's size) */
    size_t k_target;     /* K at the configured rho (sum of its k_l) */
    double k_rho;        /* the density the plan's k_l are for now: with a
                            schedule, that of the mask last selected */
    int vbf16;           /* packed updated parameters go in bf16 (every rank's
                            trainers hold bf16, gather not f32) */
    int vdelta;          /* masked steps publish changes (gather delta, every
                            rank's trainers hold fp32) */
    int pub_delta;       /* this step's compact / write-back: vdelta, masked */
    int pub_bf16;        /* this step's compact / write-back: vbf16 and not
                            from theta itself */
    uint64_t sel_step;   /* the step whose mask the next selection picks */
    /* mask_deltas: each rank's code this time (a form word, then its code
     * or its delta), the sizes exchanged for it, and the own code staged on
     * the host; gcounts is what the lagged all-gather in flight was started
     * with (code_bytes without deltas) */
    size_t *dcounts, *dmax; /* dmax: the most a rank's code can be after its form word */
    uint64_t *dsizes;
    uint32_t *dhost;
    const size_t *gcounts;
    int wire_now;        /* this step's packed values are bf16 (wire_bf16, masked) */
    size_t *toff;        /* packed offset of each tensor, comm order, ntensors + 1 */
    uint64_t next_iag[3];  /* calls, bytes, wire bytes of the all-gather that
                              fills mask_next (counted to the step that uses it) */
    uint64_t used_iag[3];  /* the same for the mask of the step in progress */

    /* defer_select: the selection waits for eng_step_finish, from what the
     * executor kept (keep_stats) before the update changed m. */
    int select_pending;
    int sel_tr;          /* T_r of the step whose selection waits */

    size_t *counts;      /* per rank, scratch for collective counts */
    const float *sum;    /* the last step's reduced values, packed */
    int select_due;      /* this step selects the next mask */

    /* Host copies for collectives the comm cannot run on the executor's
     * memory (the cuda executor on the host or local backend). */
    void *bounce, *mbounce;
    size_t bounce_cap, mbounce_cap;

    /* Checkpoints of an executor whose vectors are not host memory: the
     * sections' host copies, and where each belongs. */
    void *stage;
    struct {
        void *vec, *host;
        size_t bytes;
        uint32_t id;
    } staged[ENG_CKPT_MAX_SECS];
    int nstaged;

    /* Parameter groups: their weight decay, and this step's learning rates
     * (one group, of the configured weight decay, without). */
    size_t ngroups;
    float gwd[ENG_MAX_GROUPS];
    float glr[ENG_MAX_GROUPS];

    /* max_grad_norm: this step's clipping coefficient for the update (0:
     * none), and each rank's sum of squares of g_hat (host, comm size). */
    float clip;
    double *sq;
    /* max_grad_norm: each local trainer's |g_j|^2, then |G_r|^2 at [tr]
     * (-1: not measured), ENG_MAX_TRAINERS + 1; and the host pass's
     * chunk totals and per-worker chunk buffers (engine_gnorm.c) */
    double *gsq;
    double *gn_part;
    size_t gn_part_cap;
    float *gn_buf;
    size_t gn_buf_cap;

    float *ghat;         /* inspection only: the last g_hat, comm order */
    unsigned char *ghave;

    eng_step_stats last;
};

/* mask_deltas: the word before each rank's code says its form. */
#define ENG_MASK_FULL 0x4c4c5546u  /* "FULL": the fixed code of maskcode.h */
#define ENG_MASK_DELTA 0x544c4544u /* "DELT": mdelta_encode's delta */

/* SCAPE with masks to select: some tensor has k_l < len.  At rho = 1 every
 * mask would be all ones, so every step runs dense, with no selection and
 * no mask all-gather. */
/* engine_gnorm.c: the squared norms of each trainer's gradient and of
 * their sum G_r into out[0 .. tr] (gsq's layout), by scape_formula.h's
 * chunk rule over the coordinates in layout order, on the pool (NULL: the
 * calling thread).  The buffers must be host memory. */
scape_rc eng_grad_sqsums(eng_t *e, pool *pl, const void *const *grads, double *out);

static inline int eng_scape_masks(const eng_t *e)
{
    return e->cfg.optimizer == ENG_OPT_SCAPE && e->k_target < e->p->n;
}

/* The optimizer keeps a second moment (the AdamW variants). */
static inline int eng_uses_v(const eng_t *e)
{
    return e->cfg.optimizer == ENG_OPT_ADAMW || e->cfg.optimizer == ENG_OPT_TOPK_ADAMW;
}

/* Finish an outstanding lagged mask all-gather and decode every rank's
 * bits into mask_next; *waited (may be NULL) gets the seconds it blocked. */
scape_rc eng_mask_finish(eng_t *e, double *waited);

/* Every rank's mask code size for the plan's k_l (code_bytes, code_off,
 * code_total). */
void eng_code_sizes(eng_t *e);
/* The plan's k_l for the mask of step t, under the density schedule (no-op
 * without one); the executor is told (replan). */
scape_rc eng_mask_density(eng_t *e, uint64_t t);

/* Run the deferred selection (select_pending is set; engine_step.c). */
scape_rc eng_select_pending(eng_t *e);

/* Tensor j of comm order. */
static inline const plan_tensor *eng_tensor_at(const eng_t *e, size_t j)
{
    return &e->p->t[e->p->order[j]];
}

/* Range of comm order this rank updates: all tensors, or its shard. */
static inline void eng_update_range(const eng_t *e, size_t *first, size_t *count)
{
    if (e->cfg.mode == ENG_MODE_REPLICATED) {
        *first = 0;
        *count = e->p->ntensors;
    } else {
        *first = e->p->shard[e->rank].first;
        *count = e->p->shard[e->rank].count;
    }
}

/* A host view of `bytes` of the executor's memory at p: p itself on the
 * host executor, else a copy (after the executor's work is done) that the
 * caller frees with eng_view_free. */
scape_rc eng_view(const eng_t *e, const void *p, size_t bytes, const void **out);
void eng_view_free(const eng_t *e, const void *view);
/* Copy host memory into the executor's memory and wait for it. */
scape_rc eng_upload(eng_t *e, void *dst, const void *src, size_t bytes);
/* Collectives on the executor's memory (engine_step.c): a broadcast from
 * root, and every rank's state shard (`own`, state_len floats) into whole
 * (N floats, comm order). */
scape_rc eng_broadcast(eng_t *e, void *buf, size_t bytes, int root);
scape_rc eng_gather_shards(eng_t *e, const float *own, float *whole);
/* Free the host copies a checkpoint left (engine_ckpt.c). */
void eng_ckpt_unstage(eng_t *e);

/* Run step t's phases (engine_step.c); the caller validated the arguments. */
scape_rc eng_step_body(eng_t *e, uint64_t t, const void *const *grads,
                       void *const *params);

#endif /* SCAPE_ENGINE_INTERNAL_H */
