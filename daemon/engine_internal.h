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
    const eng_opt *opt;  /* cfg.optimizer's row */
    plan *p;
    comm_t *comm;
    int rank;
    uint64_t last_step;
    int initialised;
    int broken;          /* a step failed after its collectives began */

    exec_t *x;           /* the executor: it owns every vector of a */
    /* What the executor reads and writes (exec.h): the trainers, the state
     * range, the vectors and this step's mask, sums and publishing.  The
     * residual a.e is stale when it is zero (it holds a dense step's sums,
     * or nothing); a.dense is the residual itself where that is N floats of
     * the executor's working memory; a.send is reduced with the own segment
     * in place; a.mask_next is the target of the lagged all-gather;
     * a.code_all holds every rank's mask bits in wire form (maskcode.h), as
     * the all-gather leaves them, this rank's encoded in place at code_off.
     * a.pub_delta: vdelta on a masked step; a.pub_bf16: vbf16 and not
     * published from theta itself.  defer_select: the selection waits for
     * eng_step_finish (a.select_pending, a.sel_tr), from what the executor
     * kept (keep_stats) before the update changed m.  Parameter groups
     * (a.ngroups): their weight decay a.gwd and this step's learning rates
     * a.glr (one group, of the configured weight decay, without). */
    exec_args a;

    int mask_pending;    /* the lagged all-gather is outstanding */
    double mask_started; /* when it started (monotonic seconds) */
    size_t *code_bytes;  /* per rank: the size of its code */
    size_t code_off;     /* bytes before this rank's code */
    size_t code_total;   /* bytes of all ranks' codes: a mask all-gather's payload
                            (a.code_cap the most it can be) */
    size_t k_target;     /* K at the configured rho (sum of its k_l) */
    double k_rho;        /* the density the plan's k_l are for now: with a
                            schedule, that of the mask last selected */
    int vbf16;           /* packed updated parameters go in bf16 (every rank's
                            trainers hold bf16, gather not f32) */
    int vdelta;          /* masked steps publish changes (gather delta, every
                            rank's trainers hold fp32) */
    uint64_t sel_step;   /* the step whose mask the next selection picks */
    /* mask_deltas: each rank's code this time (a form word, then its code
     * or its delta), the sizes exchanged for it, and the own code staged on
     * the host; gcounts is what the lagged all-gather in flight was started
     * with (code_bytes without deltas) */
    size_t *dcounts, *dmax; /* dmax: the most a rank's code can be after its form word */
    uint64_t *dsizes;
    uint32_t *dhost;
    const size_t *gcounts;
    uint64_t next_iag[3];  /* calls, bytes, wire bytes of the all-gather that
                              fills mask_next (counted to the step that uses it) */
    uint64_t used_iag[3];  /* the same for the mask of the step in progress */

    size_t *counts;      /* per rank, scratch for collective counts */
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

    /* max_grad_norm: each rank's sum of squares of g_hat (host, comm size;
     * the update's clipping coefficient is a.clip) */
    double *sq;
    /* max_grad_norm: each local trainer's |g_j|^2, then |G_r|^2 at [tr]
     * (-1: not measured), ENG_MAX_TRAINERS + 1 */
    double *gsq;

    float *ghat;         /* inspection only: the last g_hat, comm order */
    unsigned char *ghave;

    eng_step_stats last;

    /* Early packs (eng_pack_early) of step early_step before it runs (0:
     * none in flight).  early_done[j]: comm tensor j is packed, from mask
     * early_mask (the one the step will use; a.mask_cur stays the last
     * step's until then).  Where the residual was live (!early_stale0),
     * early_undo (N floats, comm order, host memory) keeps each packed
     * tensor's residual as the last step left it. */
    uint64_t early_step;
    unsigned char *early_done, *early_take; /* ntensors each */
    float *early_undo;
    const uint32_t *early_mask;
    int early_stale0;
    size_t early_count;  /* comm tensors packed early */
    double early_s;      /* seconds spent in eng_pack_early */
    int early_waited;     /* an early pack completed the lagged all-gather, */
    double early_overlap; /* whose mask_overlap then counts to the step */
    int early_churned;    /* the churn of early_mask against a.mask_cur is */
    double early_churn;   /* measured: the step takes it instead */
    /* The last step's residual norm, kept by the next step's first early
     * pack until that step ends (exec_ops.norm_kept): its parts, undone or
     * not, overwrite the executor's figure. */
    double kept_norm;
    int kept_norm_ok;

    /* reduce_chunk: the step's reduction in chunks (engine_step.c,
     * "Chunked reductions").  Chunk c covers a range of layout order, chunk
     * 0 the last one (backward's first); chunk_run[2 (R c + s)] is the run
     * [a, b) of comm order that shard s holds of it (a run per shard: each
     * shard lays its tensors out by offset).  A step issues the chunks in
     * the order 0, 1, ...; early packs issue those whose every tensor is
     * packed, a prefix (chunks_done of them), whose tensors are then
     * committed: an undo keeps them packed and reduced, so every rank issues
     * the same collectives.  chunk_cs: their comm counts, the step's. */
    size_t nchunks;
    size_t *chunk_run;   /* 2 R nchunks */
    size_t *chunk_of;    /* comm order: the tensor's chunk */
    size_t chunks_done;
    float *cstage;       /* host staging of one chunk */
    size_t cstage_cap;
    comm_stats chunk_cs;
    float *ckpt_res;     /* a checkpoint's residual, when chunks_done */
};

/* *to += now - before, per op (the collectives run between two looks). */
static inline void eng_comm_since(comm_stats *to, const comm_stats *now,
                                  const comm_stats *before)
{
    for (int op = 0; op < COMM_OP_COUNT; op++) {
        to->calls[op] += now->calls[op] - before->calls[op];
        to->bytes[op] += now->bytes[op] - before->bytes[op];
        to->wire_bytes[op] += now->wire_bytes[op] - before->wire_bytes[op];
    }
}

/* mask_deltas: the word before each rank's code says its form. */
#define ENG_MASK_FULL 0x4c4c5546u  /* "FULL": the fixed code of maskcode.h */
#define ENG_MASK_DELTA 0x544c4544u /* "DELT": mdelta_encode's delta */

/* SCAPE with masks to select: some tensor has k_l < len.  At rho = 1 every
 * mask would be all ones, so every step runs dense, with no selection and
 * no mask all-gather. */
static inline int eng_scape_masks(const eng_t *e)
{
    return e->opt->mask == ENG_MASK_LAGGED_M && e->k_target < e->p->n;
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
    return exec_tensor_at(&e->a, j);
}

/* Range of comm order this rank updates: all tensors, or its shard. */
static inline void eng_update_range(const eng_t *e, size_t *first, size_t *count)
{
    exec_update_range(&e->a, first, count);
}

/* Copy host memory into the executor's memory and wait for it. */
scape_rc eng_upload(eng_t *e, void *dst, const void *src, size_t bytes);
/* Collectives on the executor's memory (engine_step.c): a broadcast from
 * root, and every rank's state shard (`own`, state_len floats) into whole
 * (N floats, comm order). */
scape_rc eng_broadcast(eng_t *e, void *buf, size_t bytes, int root);
scape_rc eng_gather_shards(eng_t *e, const float *own, float *whole);
/* Free the host copies a checkpoint left (engine_ckpt.c). */
void eng_ckpt_unstage(eng_t *e);

/* Early packs (engine_step.c): pack the registered tensors with take[i]
 * of step t (the caller validated the arguments); undo them all; forget
 * them once the step ran. */
scape_rc eng_early_pack(eng_t *e, uint64_t t, const void *const *grads,
                        const unsigned char *take, size_t *packed);
scape_rc eng_early_undo(eng_t *e);
void eng_early_clear(eng_t *e);

/* Run step t's phases (engine_step.c); the caller validated the arguments. */
scape_rc eng_step_body(eng_t *e, uint64_t t, const void *const *grads,
                       void *const *params);

#endif /* SCAPE_ENGINE_INTERNAL_H */
