/* engine_internal.h - the engine's state, shared by engine.c (the step) and
 * engine_inspect.c (read-only views for tests, status and checkpoints).
 *
 * Memory beyond the optimizer state (m, theta, v) and the residual is kept
 * small: two masks of N bits, per-tensor offsets, two buffers of K_cap floats
 * (sum k_l for SCAPE) and one chunk for summing the trainers' gradients.  A
 * dense step packs in place in the residual, which the comm order makes
 * possible: the residual is stored in comm order, so with every bit set it
 * already is the packed send buffer.  SCAPE selects the next mask after the
 * pack, from the a = G + e the pack stored, so G is never whole in memory.
 */
#ifndef SCAPE_ENGINE_INTERNAL_H
#define SCAPE_ENGINE_INTERNAL_H

#include "engine.h"
#include "maskcode.h"
#include "plan.h"
#include "pool.h"
#include "try.h"

/* One piece of the pack: coordinates [c, c + len) of tensor j (comm order);
 * chunks never straddle tensors and start on a mask word. */
typedef struct eng_item {
    size_t j, c, len;
    size_t done;         /* values of tensor j packed before this piece */
} eng_item;

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

    /* Optimizer state in comm order, elements [base, base + len). */
    size_t state_base, state_len;
    float *m, *v, *theta;

    float *e;            /* residual e_r, comm order, N */
    int e_stale;         /* e holds a dense step's sums: the residual is zero */
    float *g;            /* topk-adamw: G_r whole, coordinate order (NULL: a trainer's serves) */
    float *gchunk;       /* others: G_r one chunk at a time, fused into the pack;
                            one chunk per worker */
    pool *pool;          /* cfg.threads workers */
    eng_item *items;     /* the pack's pieces, comm order */
    size_t nitems;
    size_t k_cap;        /* most values a sparse step reduces */
    float *send;         /* sparse: packed a_r, then the sums (own segment in place) */
    float *upd;          /* sparse: packed updated parameters */
    void *topk_scratch;  /* one per worker, topk_scratch_bytes each */
    size_t topk_scratch_bytes;

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
    size_t *toff;        /* packed offset of each tensor, comm order, ntensors + 1 */
    uint64_t next_iag[3];  /* calls, bytes, wire bytes of the all-gather that
                              fills mask_next (counted to the step that uses it) */
    uint64_t used_iag[3];  /* the same for the mask of the step in progress */

    /* defer_select: the statistic at M_t's coordinates of the owned tensors,
     * taken before the update changed m there, packed like `send` (K_cap);
     * the selection from it and the residual waits for eng_step_finish. */
    float *sstat;
    int select_pending;
    int sel_tr;          /* T_r of the step whose selection waits */

    size_t *counts;      /* per rank, scratch for collective counts */
    const float *sum;    /* the last step's reduced values, packed */

    float *ghat;         /* inspection only: the last g_hat, comm order */
    unsigned char *ghave;

    eng_step_stats last;
};

/* The optimizer keeps a second moment (the AdamW variants). */
static inline int eng_uses_v(const eng_t *e)
{
    return e->cfg.optimizer == ENG_OPT_ADAMW || e->cfg.optimizer == ENG_OPT_TOPK_ADAMW;
}

/* Finish an outstanding lagged mask all-gather and decode every rank's
 * bits into mask_next; *waited (may be NULL) gets the seconds it blocked. */
scape_rc eng_mask_finish(eng_t *e, double *waited);

/* Run the deferred selection (select_pending is set; engine_step.c). */
scape_rc eng_select_pending(eng_t *e);

/* Allocate the intake buffer the optimizer and trainer count need. */
scape_rc eng_alloc_intake(eng_t *e);

/* Run step t's phases (engine_step.c); the caller validated the arguments. */
scape_rc eng_step_body(eng_t *e, uint64_t t, float lr, const void *const *grads,
                       void *const *params);

#endif /* SCAPE_ENGINE_INTERNAL_H */
