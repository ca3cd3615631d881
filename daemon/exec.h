/* exec.h - where the step's per-coordinate work runs.
 *
 * engine_step.c writes the step once (mask, pack, selection, reduction,
 * update, gather, write-back); every phase that touches coordinates goes
 * through an executor, a table of operations chosen when the engine is
 * created, as comm backends are a comm_t:
 *  - host (exec_host.c): the CPU kernels on the fork-join pool, the engine's
 *    vectors in host memory;
 *  - cuda (exec_dev.c on dev_cuda.c): the segmented kernels of
 *    kernels/scape_seg.h on the daemon's streams, m, theta (v), the packed
 *    buffers, the masks and their codes in device memory, the residual in
 *    pinned host memory streamed through the GPU in double-buffered chunks
 *    (or in device memory, residual_on_device);
 *  - sim (exec_dev.c on dev_sim.c): the cuda executor's orchestration and
 *    kernels run on the CPU, with its streams replayed in a random order
 *    that keeps only the declared dependencies: the CPU tests' view of the
 *    GPU path.
 *
 * Operations work on ranges of tensors in comm order (plan.h), never one
 * tensor per call, and may only enqueue work: sync() waits for it.  The
 * engine's vectors (exec_args.m, .theta, .e, .send, ...) are the executor's
 * memory; when exec_t.host_memory is 0 the engine never dereferences them
 * and moves data through copy() and sync().
 */
#ifndef SCAPE_EXEC_H
#define SCAPE_EXEC_H

#include <stddef.h>
#include <stdint.h>

#include "engine.h"
#include "plan.h"
#include "pool.h"

typedef struct exec exec_t;

/* Everything an executor's operations read and write, and nothing else of
 * the engine: the engine keeps one (eng_t.a), fills the step's fields before
 * it calls an operation and reads back what the operations say they write. */
typedef struct exec_args {
    /* Fixed when the engine is created. */
    const eng_config *cfg;
    const eng_opt *opt;     /* cfg->optimizer's row */
    const plan *p;          /* the tensors' layout (its k_l follow a density schedule) */
    comm_t *comm;           /* for its size and its device stream */
    int rank;
    kern_dtype pdt, gdt;    /* the trainers' parameter and gradient dtypes */
    size_t state_base, state_len; /* this rank's optimizer state, comm order */
    size_t k_cap;           /* most values a sparse step reduces (send, upd) */
    size_t code_cap;        /* bytes of every rank's mask code (code_all) */
    eng_step_stats *stats;  /* the step's counters: traffic, mask_churn, launches */
    int tr;                 /* trainers on this rank, T_r */
    int t_total;            /* T */

    /* The vectors: create() allocates them, in the executor's memory. */
    float *m, *v, *theta;   /* optimizer state, [state_base, +state_len) */
    float *e;               /* residual e_r, comm order, N */
    float *dense;           /* where a dense step packs a and reduces it, N */
    float *g;               /* the intake's G_r whole, coordinate order */
    float *send;            /* sparse: packed a_r, then the sums */
    float *upd;             /* sparse: packed updated parameters */
    uint32_t *mask_buf[2];
    uint32_t *code_all;     /* every rank's mask code, as the all-gather leaves them */
    /* max_grad_norm's host pass (eng_grad_sqsums): its scratch */
    double *gn_part;
    size_t gn_part_cap;
    float *gn_buf;
    size_t gn_buf_cap;

    /* This step. */
    const uint32_t *mask_cur; /* the step's mask; NULL: all ones (dense) */
    uint32_t *mask_next;    /* where select() writes the next one */
    int e_stale;            /* in and out: the residual is zero */
    int wire_now;           /* the packed values go in bf16 */
    int pub_delta, pub_bf16; /* what compact / write_back publish */
    int select_pending;     /* select() runs deferred, from keep_stats() */
    int sel_tr;             /* T_r of the step whose selection waits */
    const float *sum;       /* the reduced values, packed (or dense) */
    size_t *toff;           /* packed offset of each tensor, ntensors + 1
                               (offsets() writes it) */
    size_t ngroups;
    float glr[ENG_MAX_GROUPS], gwd[ENG_MAX_GROUPS]; /* per parameter group */
    float clip;             /* the update's clipping coefficient (0: none) */
} exec_args;

/* Tensor j of comm order. */
static inline const plan_tensor *exec_tensor_at(const exec_args *a, size_t j)
{
    return &a->p->t[a->p->order[j]];
}

/* Range of comm order this rank updates: all tensors, or its shard. */
static inline void exec_update_range(const exec_args *a, size_t *first, size_t *count)
{
    if (a->cfg->mode == ENG_MODE_REPLICATED) {
        *first = 0;
        *count = a->p->ntensors;
    } else {
        *first = a->p->shard[a->rank].first;
        *count = a->p->shard[a->rank].count;
    }
}

typedef struct exec_ops {
    const char *name;
    /* Allocate the engine's vectors (m, v, theta, e, send, upd, g, the masks,
     * code_all) and the executor's own state. */
    scape_rc (*create)(exec_t *x);
    void (*destroy)(exec_t *x);

    /* eng_opt.intake: G_r whole into x->a->g (layout order), in trainer order. */
    scape_rc (*intake)(exec_t *x, const void *const *grads);
    /* a = G + e on x->a->mask_cur (NULL: dense): packed into x->a->send (bf16(a)
     * with the rest kept in the residual when x->a->wire_now), or in
     * place in the dense buffer (dense_buffer()); the residual keeps a off
     * the mask.  grads NULL: G is x->a->g.  x->a->e_stale on entry means the
     * residual is zero; a dense pack sets it.  select_due: a selection of
     * the next mask follows (from this step's a and the m before update). */
    scape_rc (*pack)(exec_t *x, const void *const *grads, int select_due);
    /* Early packs (NULL: none): the pack of the comm-order tensors j with
     * take[j] only, every value as pack() would write it.  It reads
     * x->a->e_stale but never changes it (a sparse pack of a stale residual
     * zeroes the parts it packs first): the engine sets it once every
     * tensor of the step is packed, 1 when dense, else 0.  select_due: as
     * for pack() (the step's, known before it runs). */
    scape_rc (*pack_part)(exec_t *x, const void *const *grads, const unsigned char *take,
                          int select_due);
    /* defer_select: keep what the selection needs before update changes m
     * (an executor may have kept it already, part by part, in pack_part). */
    scape_rc (*keep_stats)(exec_t *x);
    /* ENG_MASK_LAGGED_M: exact top-k of the owned tensors into x->a->mask_next. */
    scape_rc (*select)(exec_t *x);
    /* ENG_MASK_TOPK_GRAD: this rank's top-k of |G + e| per tensor into mask_buf[1]. */
    scape_rc (*own_topk)(exec_t *x);
    /* Mask words of comm-order tensors [first, first + count) to their wire
     * code (maskcode.h) at code, and back; decode failures may surface at
     * the next sync().  `from` names the sender. */
    scape_rc (*encode)(exec_t *x, size_t first, size_t count, const uint32_t *words,
                       uint32_t *code);
    scape_rc (*decode)(exec_t *x, size_t first, size_t count, const uint32_t *code,
                       size_t nbytes, uint32_t *words, int merge, int from);
    /* Zero nwords mask words. */
    scape_rc (*mask_zero)(exec_t *x, uint32_t *words);
    /* Start measuring the fraction of cur's bits not in prev; the result is
     * in x->a->stats->mask_churn after the next sync(). */
    scape_rc (*churn)(exec_t *x, const uint32_t *cur, const uint32_t *prev);
    /* x->a->toff from x->a->mask_cur (the packed offset of each tensor) and K. */
    scape_rc (*offsets)(exec_t *x, size_t *k_out);
    /* The optimizer update of comm-order tensors [first, first + count) from
     * the reduced sums at x->a->sum (packed, or dense), each tensor with its
     * parameter group's learning rate and weight decay (x->a->glr, x->a->gwd). */
    scape_rc (*update)(exec_t *x, size_t first, size_t count, uint64_t t);
    /* max_grad_norm: the sum of the squares of g_hat = S / T over the reduced
     * values of comm-order tensors [first, first + count) at x->a->sum, by the
     * rule of scape_formula.h (scape_f_sqsum_chunk), into *out (host memory)
     * once sync() has returned.  At most comm size sums between syncs. */
    scape_rc (*sqsum)(exec_t *x, size_t first, size_t count, double *out);
    /* max_grad_norm: |g_j|^2 of each trainer's gradient and |G_r|^2 of their
     * sum into out[0 .. tr] (host memory, engine_gnorm.c's rule), before
     * the pack; -1 in each where the buffers are not readable by the host
     * (the cuda executor with gradients in device memory). */
    scape_rc (*grad_sqsums)(exec_t *x, const void *const *grads, double *out);
    /* Their new parameters into dst (packed at the mask, or dense), comm order;
     * as bf16 when x->a->pub_bf16.  x->a->pub_delta: each one's change from trainer
     * 0's fp32 value (params[0]) in bf16, theta rounded to that value plus
     * it (scape_f_delta, scape_f_apply_delta). */
    scape_rc (*compact)(exec_t *x, size_t first, size_t count, float *dst,
                        void *const *params);
    /* The values at src (packed, or dense; comm order; bf16 when
     * x->a->pub_bf16) into every trainer's buffer, converted to the parameter
     * dtype; x->a->pub_delta: added to the value each trainer holds. */
    scape_rc (*write_back)(exec_t *x, const float *src, void *const *params);
    /* The plan's k_l changed (a density schedule): refresh whatever the
     * executor derived from them (the device's tensor and code tables). */
    scape_rc (*replan)(exec_t *x);
    /* theta of this rank's state range from a buffer of the trainers' form
     * (layout order, parameter dtype). */
    scape_rc (*load_theta)(exec_t *x, const void *src);

    /* Memory: bytes from src to dst, either in the executor's memory, a
     * trainer's buffer or host memory (enqueued); zero bytes at dst. */
    scape_rc (*copy)(exec_t *x, void *dst, const void *src, size_t bytes);
    scape_rc (*zero)(exec_t *x, void *dst, size_t bytes);
    /* Wait, bounded, for all enqueued work; report what failed in it. */
    scape_rc (*sync)(exec_t *x);
    /* Phase ph begins (end = 0) or ends (1); times() adds the phases' seconds
     * since the last call into phase_s (after a sync). */
    void (*mark)(exec_t *x, eng_phase ph, int end);
    void (*times)(exec_t *x, double *phase_s);
    /* L2 norm of the residual after the last step. */
    double (*residual_norm)(exec_t *x);
    /* 1: residual_norm returns a figure the last step kept (no pass over the
     * residual), which early packs may overwrite with a partial one; 0: it
     * sums the residual in host memory, in comm order, when asked. */
    int norm_kept;
    /* Bytes of device memory and of pinned host memory held. */
    uint64_t (*device_bytes)(const exec_t *x);
    uint64_t (*pinned_bytes)(const exec_t *x);
    /* The device may still run work that reads or writes the trainers'
     * buffers (an earlier wait for it failed); NULL: never. */
    int (*stuck)(const exec_t *x);
} exec_ops;

struct exec {
    const exec_ops *ops;
    exec_args *a;       /* the engine's; the executor sees nothing else of it */
    eng_phase phase;    /* the phase being run (set by mark): traffic counts to it */
    int host_memory;    /* the vectors are ordinary host memory */
    int residual_host;  /* the residual is (pinned) host memory, readable
                           once sync() has returned */
    void *impl;
};

/* Bytes the work just enqueued moves: through the state's memory and
 * between host and device (engine.h, eng_step_stats.mem_bytes). */
void exec_count(exec_t *x, uint64_t mem, uint64_t link);

/* The executor for a->cfg->executor (host, cuda or sim), with every vector
 * of a allocated; a must outlive it. */
scape_rc exec_create(exec_args *a, exec_t **out);
void exec_destroy(exec_t **x);

/* A host view of `bytes` of the executor's memory at p: p itself on the
 * host executor, else a copy (after the executor's work is done) that the
 * caller frees with exec_view_free. */
scape_rc exec_view(exec_t *x, const void *p, size_t bytes, const void **out);
void exec_view_free(const exec_t *x, const void *view);

/* max_grad_norm: the squared norms of each trainer's gradient and of their
 * sum G_r into out[0 .. tr] (engine_gnorm.c), by scape_formula.h's chunk
 * rule over the coordinates in layout order, on the pool (NULL: the calling
 * thread).  The buffers must be host memory. */
scape_rc eng_grad_sqsums(exec_args *a, pool *pl, const void *const *grads, double *out);

/* The host executor (exec_host.c), and the device executor on a CUDA
 * device or on the simulated one (exec_dev.c). */
extern const exec_ops exec_host_ops;
extern const exec_ops exec_dev_ops;

/* 1 when this build can run the cuda executor here; *why says why not. */
int exec_cuda_available(const char **why);
/* Make `device` the calling thread's CUDA device (the daemon does it once,
 * before anything of CUDA runs, so that nothing lands on device 0). */
scape_rc exec_cuda_use_device(int device);

#endif /* SCAPE_EXEC_H */
