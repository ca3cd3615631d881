/* job.h - the job's step: the trainers' posted buffers through the engine,
 * and the figures of the completed steps as plain C.  The control plane
 * (control.c) decides when a step runs and answers the trainers; the status
 * plane (status.c) reports the figures; both fill their wire messages from
 * these structs when they send them.  The job calls the engine, the comm and
 * the buffer maps, never the server. */
#ifndef SCAPE_JOB_H
#define SCAPE_JOB_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

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

/* The job's health, and the figures status replies, metrics and StepDone
 * replies are filled from. */
typedef struct job {
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
/* Run step t on the engine with the parts' buffers and record its figures
 * in j (the parts' losses, queued times and message sizes included).  now:
 * the time the step started (job_now()).  On failure *broke says whether
 * the engine has failed mid-step (the job is broken), or only the staging
 * of the gradients did. */
scape_rc job_step_run(job *j, eng_t *e, uint64_t t, const float *lr, job_part *p,
                      int n, size_t grad_bytes, size_t param_bytes, double now, int *broke);
/* After the replies: the engine's deferred work (defer_select: the next
 * mask), timed as the step's after_reply phase.  Failure breaks the job. */
scape_rc job_step_finish(job *j, eng_t *e, int defer_select);
/* Add the last step to the totals (once per completed step). */
void job_count(job *j);

#endif /* SCAPE_JOB_H */
