/* job.h - the job: the engine, the step the trainers post next, the step
 * itself (the trainers' posted buffers through the engine) and the figures
 * of the completed steps as plain C.  The engine is created, replaced,
 * destroyed, stepped and asked about only here: the control plane
 * (control.c) decides when the job starts and when a step runs and answers
 * the trainers; the status plane (status.c) reports the figures;
 * checkpoint.c saves and restores the job's state; all fill their wire
 * messages from these structs when they send them.  The job calls the
 * engine, the checkpoint files (ckpt.h), the comm and the buffer maps,
 * never the server. */
#ifndef SCAPE_JOB_H
#define SCAPE_JOB_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "ckpt.h"
#include "comm.h"
#include "engine.h"
#include "shm.h"

/* The figures of one completed step. */
typedef struct job_step {
    eng_step_stats eng;     /* the engine's; launches count the deferred selection */
    double wait;            /* from the first trainer's post to the step's start, s */
    double total;           /* the step itself, s */
    double queued;          /* the longest wait of a Step message before it was read;
                               < 0: unknown */
    int has_after_reply;    /* defer_select: the next mask is selected after the replies */
    double after_reply;     /* that selection's time, s (0 until it is done) */
    uint64_t copied;        /* bytes staged between trainers' CUDA IPC buffers and host */
    uint64_t control_bytes; /* the step's Step messages, bytes */
} job_step;

/* What the completed steps add up to since the daemon started. */
typedef struct job_totals {
    uint64_t steps;
    uint64_t bytes, wire_bytes;     /* the steps' collective and wire bytes summed */
    uint64_t coll_calls[COMM_OP_COUNT], coll_bytes[COMM_OP_COUNT]; /* per comm_op */
    uint64_t clipped;               /* steps whose clip factor was below 1 */
    double queued;                  /* the steps' queued seconds summed (known ones) */
} job_totals;

/* The job's engine and health, and the figures status replies, metrics and
 * StepDone replies are filled from. */
typedef struct job {
    eng_t *eng;             /* NULL: not started (or lost); only job.c touches it */
    int trainers;           /* T_r the engine runs with */
    uint64_t next_step;     /* the step the trainers post next */
    int broken;             /* the engine failed mid-step: the ranks are out of step */
    char broken_why[512];   /* what failed, for the trainers' later steps */
    int clipping;           /* max_grad_norm is on: grad_norm and clip are figures */
    int have_last;
    job_step last;          /* the last completed step */
    int have_loss;
    double last_loss;       /* the mean loss the trainers posted with it */
    job_totals totals;
} job;

/* One trainer's part of a step. */
typedef struct job_part {
    shm_map *params, *grads;
    pid_t pid;
    int index;              /* its slot, for messages */
    int has_loss;
    float loss;
    double posted_at;       /* job_now() when its Step arrived */
    double queued;          /* its Step's wait before it was read; < 0: unknown */
    size_t msg_bytes;       /* size of its Step message */
} job_part;

/* CLOCK_MONOTONIC in seconds: the clock trainers stamp their Step messages
 * with, and the daemon's for every deadline and phase. */
double job_now(void);
/* A job that has not started: step 1 next; clipping: max_grad_norm is on. */
void job_init(job *j, int clipping);
/* Mark the job broken (the ranks are no longer in step) with the current
 * last error as the reason. */
void job_mark_broken(job *j);
/* Bytes of n values of type dt. */
static inline size_t job_bytes(size_t n, kern_dtype dt) { return n * kern_dtype_size(dt); }
/* CUDA IPC buffers under the host executor: pull the parts' grads (grads)
 * or params into the engine's host copies, or push the params back; adds
 * the bytes moved to *copied (NULL: not counted). */
scape_rc job_pull(job_part *p, int n, int grads, size_t bytes, uint64_t *copied);
scape_rc job_push(job_part *p, int n, size_t bytes, uint64_t *copied);
/* Wait, at most timeout_ms for them all, until every part's gradient-ready
 * event has completed.  A trainer found dead meanwhile: *dead is its
 * position in p (the step is then abandoned), else -1. */
scape_rc job_await_grads(job_part *p, int n, int timeout_ms, int *dead);
/* The job's engine: job_open creates it for n trainers on comm (collective:
 * the engine's handshake; it holds no state until job_init_params or
 * job_restore; n becomes j->trainers); job_close destroys it (none: nothing
 * to do), the figures and the next step stay. */
scape_rc job_open(job *j, const eng_config *cfg, const eng_layout *lay, comm_t *comm, int n);
void job_close(job *j);
/* 1 from job_open until job_close: the job has started. */
static inline int job_started(const job *j) { return j->eng != NULL; }
/* The started engine's state: fresh, trainer 0's parameters broadcast from
 * rank 0, or the checkpoint ref (collective). */
scape_rc job_init_params(job *j, void *const *params);
scape_rc job_restore(job *j, const ckpt_ref *ref, comm_t *comm, void *const *params);
/* Checkpoint the state after the last step under root (ckpt_save; collective). */
scape_rc job_save(job *j, const char *root, comm_t *comm, int keep, uint64_t *step,
                  char *dir, size_t len);
/* Trainers came or went between steps: the engine runs with n (its
 * T_r) from now on; collective (the engine's handshake). */
scape_rc job_set_trainers(job *j, int n);
/* Run step j->next_step on the engine with the parts' buffers, record its
 * figures in j (the parts' losses, queued times and message sizes included)
 * and move on to the next step.  now: the time the step started
 * (job_now()).  On failure *broke says whether the engine has failed
 * mid-step (the job is broken), or only the staging of the gradients did. */
scape_rc job_step_run(job *j, const float *lr, job_part *p, int n, size_t grad_bytes,
                      size_t param_bytes, double now, int *broke);
/* After the replies: the engine's deferred work (defer_select: the next
 * mask), timed as the step's after_reply phase.  After a failure the ranks
 * are out of step: the caller marks the job broken. */
scape_rc job_step_finish(job *j, int defer_select);
/* Bucketed hand-over: pack registered tensors with take[i] of the next step
 * now, from the parts' gradients (eng_pack_early).  CUDA IPC gradients that
 * the engine reads in place (the cuda executor) are packed once each
 * part's gradient-ready event, which libscape records at every post, has
 * completed (job_await_grads, timeout_ms): its latest record covers every
 * tensor the trainer has posted.  Left to the step (no error) where a part's
 * gradients go through a pinned host copy (the host executor: the step
 * pulls them whole), and where a part died waiting (*dead: its index; the
 * step finds the death). */
scape_rc job_pack_early(job *j, job_part *p, int n, const unsigned char *take, int timeout_ms,
                        int *dead);
/* Undo what job_pack_early packed (eng_pack_early_undo). */
scape_rc job_pack_undo(job *j);
/* Tensors (comm order) of chunks that early packs reduced, which an undo
 * keeps (reduce_chunk). */
size_t job_early_kept(const job *j);
/* What the engine holds and sends, for status (0 and "f32" before the start). */
typedef struct job_footprint {
    uint64_t state_bytes;       /* the optimizer's state (m, theta, v) */
    uint64_t device_bytes;      /* on the executor's device */
    uint64_t pinned_bytes;      /* in pinned host memory */
    const char *gather_values;  /* the parameter all-gather's values: delta, bf16, f32 */
} job_footprint;
void job_footprint_of(const job *j, job_footprint *f);
/* The residual's norm (a pass over N values: when asked, not per step). */
double job_residual_norm(const job *j);
/* The layout's hash (checkpoints and state_dicts carry it; 0 before the start). */
uint64_t job_layout_hash(const job *j);
/* The number of parameter groups (0 before the start). */
size_t job_groups(const job *j);
/* Trainer i's own gradient norm in the last step (max_grad_norm); < 0: unknown. */
double job_grad_norm(const job *j, int i);
/* The executor's device has work that cannot finish (a trainer's mapped
 * buffer may still be in use). */
int job_device_stuck(const job *j);
/* The job's parameters as f32 (have: which of them this rank holds). */
scape_rc job_params(const job *j, float *theta, unsigned char *have);
/* Add the last step to the totals (once per completed step). */
void job_count(job *j);

#endif /* SCAPE_JOB_H */
