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
 * engine's vectors (eng_t.m, .theta, .e, .send, ...) are the executor's
 * memory; when exec_t.host_memory is 0 the engine never dereferences them
 * and moves data through copy() and sync().
 */
#ifndef SCAPE_EXEC_H
#define SCAPE_EXEC_H

#include <stddef.h>
#include <stdint.h>

#include "engine.h"

typedef struct exec exec_t;

typedef struct exec_ops {
    const char *name;
    /* Allocate the engine's vectors (m, v, theta, e, send, upd, g, the masks,
     * code_all) and the executor's own state. */
    scape_rc (*create)(exec_t *x);
    void (*destroy)(exec_t *x);

    /* topk-adamw: G_r whole into e->g (layout order), in trainer order. */
    scape_rc (*intake)(exec_t *x, const void *const *grads);
    /* a = G + e on e->mask_cur (NULL: dense): packed into e->send (bf16(a)
     * with the rest kept in the residual when e->wire_now), or in
     * place in the dense buffer (dense_buffer()); the residual keeps a off
     * the mask.  grads NULL: G is e->g.  e->e_stale on entry means the
     * residual is zero; a dense pack sets it.  select_due: a selection of
     * the next mask follows (from this step's a and the m before update). */
    scape_rc (*pack)(exec_t *x, const void *const *grads, int select_due);
    /* defer_select: keep what the selection needs before update changes m. */
    scape_rc (*keep_stats)(exec_t *x);
    /* SCAPE: exact top-k of the owned tensors into e->mask_next. */
    scape_rc (*select)(exec_t *x);
    /* topk-adamw: this rank's top-k of |G + e| per tensor into mask_buf[1]. */
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
     * in e->last.mask_churn after the next sync(). */
    scape_rc (*churn)(exec_t *x, const uint32_t *cur, const uint32_t *prev);
    /* e->toff from e->mask_cur (the packed offset of each tensor) and K. */
    scape_rc (*offsets)(exec_t *x, size_t *k_out);
    /* The optimizer update of comm-order tensors [first, first + count) from
     * the reduced sums at e->sum (packed, or dense), each tensor with its
     * parameter group's learning rate and weight decay (e->glr, e->gwd). */
    scape_rc (*update)(exec_t *x, size_t first, size_t count, uint64_t t);
    /* max_grad_norm: the sum of the squares of g_hat = S / T over the reduced
     * values of comm-order tensors [first, first + count) at e->sum, by the
     * rule of scape_formula.h (scape_f_sqsum_chunk), into *out (host memory)
     * once sync() has returned.  At most comm size sums between syncs. */
    scape_rc (*sqsum)(exec_t *x, size_t first, size_t count, double *out);
    /* max_grad_norm: |g_j|^2 of each trainer's gradient and |G_r|^2 of their
     * sum into out[0 .. tr] (host memory, engine_gnorm.c's rule), before
     * the pack; -1 in each where the buffers are not readable by the host
     * (the cuda executor with gradients in device memory). */
    scape_rc (*grad_sqsums)(exec_t *x, const void *const *grads, double *out);
    /* Their new parameters into dst (packed at the mask, or dense), comm order;
     * as bf16 when e->pub_bf16.  e->pub_delta: each one's change from trainer
     * 0's fp32 value (params[0]) in bf16, theta rounded to that value plus
     * it (scape_f_delta, scape_f_apply_delta). */
    scape_rc (*compact)(exec_t *x, size_t first, size_t count, float *dst,
                        void *const *params);
    /* The values at src (packed, or dense; comm order; bf16 when
     * e->pub_bf16) into every trainer's buffer, converted to the parameter
     * dtype; e->pub_delta: added to the value each trainer holds. */
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
    /* Bytes of device memory and of pinned host memory held. */
    uint64_t (*device_bytes)(const exec_t *x);
    uint64_t (*pinned_bytes)(const exec_t *x);
    /* The device may still run work that reads or writes the trainers'
     * buffers (an earlier wait for it failed); NULL: never. */
    int (*stuck)(const exec_t *x);
} exec_ops;

struct exec {
    const exec_ops *ops;
    eng_t *e;
    eng_phase phase;    /* the phase being run (set by mark): traffic counts to it */
    int host_memory;    /* the vectors are ordinary host memory */
    int residual_host;  /* the residual is (pinned) host memory, readable
                           once sync() has returned */
    void *impl;
};

/* Bytes the work just enqueued moves: through the state's memory and
 * between host and device (engine.h, eng_step_stats.mem_bytes). */
void exec_count(exec_t *x, uint64_t mem, uint64_t link);

/* The executor for cfg->executor (host, cuda or sim), created for e after
 * its plan exists; e->x is set. */
scape_rc exec_create(eng_t *e);
void exec_destroy(eng_t *e);

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
