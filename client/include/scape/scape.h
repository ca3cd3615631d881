/* scape.h - libscape, the trainer's side of scaped.
 *
 * A trainer attaches to its node's daemon with the tensor layout of its
 * model.  libscape allocates one flat parameter buffer and one flat gradient
 * buffer that the daemon maps (POSIX shared memory on the host, CUDA IPC on a
 * GPU), so the trainer reads parameters from and writes gradients into plain
 * pointers.  After attaching, the trainer writes its initial parameters and
 * calls scape_sync, which replaces them with those of trainer 0 on rank 0.
 * Each step, the trainer fills the gradients and calls scape_step; when it
 * returns, the parameter buffer holds the updated parameters, the same bits on
 * every trainer of every node.
 *
 * Every function returns a scape_rc and, on failure, leaves a message for
 * scape_last_error() (per thread).  A session is used by one thread at a time.
 */
#ifndef SCAPE_SCAPE_H
#define SCAPE_SCAPE_H

#include <stddef.h>
#include <stdint.h>

#include "scape_rc.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SCAPE_PROTOCOL_VERSION 1

typedef enum scape_dtype { SCAPE_DTYPE_F32 = 0, SCAPE_DTYPE_BF16 = 1 } scape_dtype;

typedef enum scape_memory {
    SCAPE_MEMORY_HOST = 0, /* POSIX shared memory */
    SCAPE_MEMORY_CUDA = 1  /* cudaMalloc + cudaIpcGetMemHandle */
} scape_memory;

typedef struct scape_tensor {
    const char *name;
    size_t offset; /* first element in the flat buffers */
    size_t length; /* elements, >= 1 */
    unsigned group; /* its parameter group, < scape_options.ngroups (0 without) */
} scape_tensor;

#define SCAPE_MAX_GROUPS 16

typedef struct scape_options {
    scape_dtype param_dtype; /* default F32 */
    scape_dtype grad_dtype;  /* default F32 */
    scape_memory memory;     /* default HOST */
    int device;              /* CUDA device ordinal for SCAPE_MEMORY_CUDA */
    int index;               /* wanted trainer slot; -1 (default): $SCAPE_INDEX when
                                set (scape-run sets it to the local rank), else the
                                lowest free one */
    int timeout_ms;          /* longest wait for any reply, default 600000 */
    int start_wait_ms;       /* how long to wait for scaped's control socket to appear
                                (a daemon still starting; said once on stderr);
                                -1 (default): $SCAPE_START_WAIT_MS when set, else 0:
                                no daemon there fails scape_attach at once */
    int ngroups;             /* parameter groups (torch's param_groups), 0 (default):
                                one, with the daemon's weight_decay; at most
                                SCAPE_MAX_GROUPS */
    const float *group_weight_decay; /* ngroups of them, read at attach: each
                                group's weight decay, NaN for the daemon's */
    float max_grad_norm;     /* the gradient clipping bound this trainer expects of
                                the daemon (its max_grad_norm key; 0: no clipping),
                                refused at attach when the daemon's differs;
                                default -1: whatever the daemon is configured with */
    int daemon_lost_ms;      /* once scaped's process is gone (seen about every 100 ms
                                while waiting), how long a wait still goes on for a
                                reply already on its way before it fails (SCAPE_REMOTE,
                                naming the daemon and its runtime directory); -1
                                (default): $SCAPE_DAEMON_LOST_MS when set, else 2000.
                                Needs an ipc:// endpoint (its peer's pid) */
    void (*interrupt)(void *arg, int *give_up); /* NULL (default), or called while a
                                call waits, after each signal and about every 100 ms,
                                with *give_up 0: setting it gives the wait up (see
                                "Signals" below) */
    void *interrupt_arg;     /* its argument */
} scape_options;

/* Signals.  A signal that interrupts a wait inside libscape (its handler
 * returned) does not end it: the wait goes on for what is left of its
 * deadline, so no step is lost.  Only opts.interrupt can give a wait up:
 * scape_step_wait then returns SCAPE_SYSTEM ("interrupted") with the step
 * still in flight (wait for it again, or detach, which waits for it first);
 * any other call returns SCAPE_SYSTEM and leaves the session fit only for
 * scape_detach. */

/* Per-step figures the daemon returns. */
typedef struct scape_step_info {
    uint64_t step;
    uint64_t k;              /* values reduced this step */
    double density;          /* k / numel */
    uint64_t bytes;          /* collective payload bytes */
    uint64_t wire_bytes;     /* bytes this node received */
    double residual_norm;    /* 0 here: scapectl status reports it (a pass over N) */
    double mask_churn;
    double step_seconds;     /* the daemon's engine step */
    double wait_seconds;     /* first trainer's post to the last's */
    double grad_norm;        /* with max_grad_norm: the global L2 norm of g_hat, the
                                mean of what the daemons sent (for scape and
                                topk-adamw the error-feedback residual at the
                                mask included), before clipping (0 without) */
    double clip;             /* the factor g_hat was scaled by (1: none) */
    double mean_grad_norm;   /* with max_grad_norm: the norm torch's clip_grad_norm_
                                would see, of the mean of every trainer's
                                gradient this step; -1 without, or not measured */
    int mean_grad_exact;     /* 1: exact (one daemon, or a dense step); 0: the
                                bound (1/T) sum over daemons of the norm of their
                                trainers' summed gradient */
} scape_step_info;

typedef struct scape_session scape_session;

/* Fill opts with the defaults above. */
void scape_options_default(scape_options *opts);

/* Attach to the daemon at endpoint (e.g. "ipc:///tmp/scape-1234/control"; NULL
 * means $SCAPE_ENDPOINT, else the default runtime directory's control socket),
 * register the layout, and allocate the shared buffers.  opts may be NULL. */
scape_rc scape_attach(const char *endpoint, const scape_tensor *layout, size_t ntensors,
                      const scape_options *opts, scape_session **out);

/* The flat parameter and gradient buffers (host or device pointers). */
void *scape_params(const scape_session *s);
void *scape_grads(const scape_session *s);
/* Elements in each buffer (N), and this trainer's slot. */
size_t scape_numel(const scape_session *s);
int scape_index(const scape_session *s);
/* The step the daemon expects next (1 for a fresh job; later when a trainer
 * re-attaches to a running one); after a completed step, the one after it. */
uint64_t scape_next_step(const scape_session *s);
/* 1 while a step is begun and not yet waited for (scape_step_begin, or a
 * wait given up on by a timeout or an interrupt). */
int scape_step_in_flight(const scape_session *s);

/* Call once the parameter buffer holds this trainer's initial parameters, and
 * before the first step.  Blocks until the buffer holds the job's parameters:
 * those of trainer 0 when the job starts (the daemon waits for every trainer
 * it expects), or the current ones when joining a running job.  Afterwards
 * scape_next_step() is the step to post next. */
scape_rc scape_sync(scape_session *s);

/* Hand step `step` over (gradients must be in place) and wait for the new
 * parameters.  loss may be NULL; info may be NULL.  With SCAPE_MEMORY_CUDA
 * only the work on the stream given to scape_set_stream (the legacy default
 * stream unless set) is ordered before the hand-over: libscape records an
 * event there and the daemon waits for it.  Gradients written on any other
 * stream, a cudaStreamNonBlocking one in particular, must be ordered before
 * that stream by the caller (an event, or a synchronisation).  The daemon
 * reads and writes the buffers in place on its cuda executor and stages
 * them through host memory on the host executor (scape_step_info counts
 * those copies). */
scape_rc scape_step(scape_session *s, uint64_t step, float lr, const float *loss,
                    scape_step_info *info);
/* Bucketed hand-over: the gradients of registered tensors [first, first +
 * count) (indices into the layout given to scape_attach) are final for the
 * next step, scape_next_step(s); the daemon may pack them at once, while
 * backward still computes the rest.  A one-way message: it returns without
 * waiting for the daemon.  Those gradients must stay as they are until the
 * step's scape_step (or scape_step_wait) returns; scape_step posts what was
 * not posted.  Refused here, naming the tensor: a range outside the layout, a
 * tensor posted twice for one step, a call while a step is in flight.  A post
 * the daemon refuses fails the step, naming it.  With SCAPE_MEMORY_CUDA the
 * daemon waits, before it reads them, for the work queued so far on the
 * stream given to scape_set_stream (an event recorded there). */
scape_rc scape_post_tensors(scape_session *s, size_t first, size_t count);
/* The same, split: begin posts the step and returns at once; wait blocks until
 * the parameters are updated.  One step may be outstanding. */
scape_rc scape_step_begin(scape_session *s, uint64_t step, float lr, const float *loss);
/* With parameter groups: lrs[g] is group g's learning rate for this step
 * (ngroups of them, as attached). */
scape_rc scape_step_begin_groups(scape_session *s, uint64_t step, const float *lrs,
                                 int nlrs, const float *loss);
scape_rc scape_step_wait(scape_session *s, scape_step_info *info);
/* SCAPE_MEMORY_CUDA: the stream (a cudaStream_t; NULL, the default, for the
 * legacy default stream) on which the trainer makes its gradients and runs
 * its next forward.  scape_step_begin records an event on it for the daemon
 * to wait for, instead of synchronising the device; scape_step_wait, once
 * the daemon has answered, makes that stream wait for the new parameters
 * and returns (blocking 0), or waits for them on the host (blocking 1, the
 * default).  scape_sync synchronises that stream once, for the initial
 * parameters.  libscape sets the buffers' device only around its own CUDA
 * calls and gives the caller's current device back.  Between steps. */
scape_rc scape_set_stream(scape_session *s, void *stream, int blocking);

/* state_dict: the job's checkpoint of the state after the last completed
 * step, asked for on the daemon's status socket (next to an ipc://DIR/control
 * endpoint).  It is on disk when this returns, with one daemon or several
 * (they write it together; those whose trainers did not ask join in).
 * Before the first step of a fresh job: step 0, dir and name "" (nothing to
 * save; no checkpoint_dir needed).  After a restore and before the next
 * step: the checkpoint restored.  Later steps need the daemon's
 * checkpoint_dir.  Between steps only. */
typedef struct scape_checkpoint_info {
    uint64_t step;         /* the state after this step (0: a fresh job) */
    uint64_t layout_hash;  /* of the job's layout (tensors and parameter groups) */
    int pending;           /* always 0 for a state_dict */
    char dir[1024];        /* its step directory, as the daemon names it */
    char name[256];        /* dir relative to checkpoint_dir ("step-25"); "" when
                              not under it: scape_resume takes either */
    uint32_t job;          /* the job's identity (the daemon's `job` key) */
} scape_checkpoint_info;
scape_rc scape_checkpoint(scape_session *s, scape_checkpoint_info *out);
/* The step whose checkpoint the job was restored from (scaped --resume,
 * SCAPE_RESUME, or a scape_resume), 0 for a fresh job: a trainer restores
 * its own data position and schedule from it. */
scape_rc scape_resumed_step(scape_session *s, uint64_t *step);
/* load_state_dict: before the first step, restart the job from the
 * checkpoint in dir (absolute, or relative to the daemon's checkpoint_dir:
 * scape_checkpoint_info.name); every trainer of every daemon asks, and each
 * returns once its parameters are the checkpoint's (scape_next_step() is
 * then the step after it).  step and layout_hash (0: unchecked) must be the
 * checkpoint's; refusals name the reason (another layout, groups or
 * optimizer, a missing file, one pruned by checkpoint_keep).  A refused
 * restore leaves the job at step 1.  A job restored at step
 * scape_resumed_step() and not stepped since takes that same step as a
 * no-op and refuses any other. */
scape_rc scape_resume(scape_session *s, const char *dir, uint64_t step, uint64_t layout_hash);

/* Tell the daemon goodbye, free the buffers, and set *s to NULL.  CUDA
 * buffers are freed only once the daemon has answered the goodbye (it
 * answers after closing its mappings of them): when it did not (an error
 * here, a failed attach, a daemon that shut down), they stay allocated until
 * the process ends, and a line on stderr says so, because freeing device
 * memory another process still has open is undefined. */
scape_rc scape_detach(scape_session **s);

/* The library's version string. */
const char *scape_version(void);

#ifdef __cplusplus
}
#endif

#endif /* SCAPE_SCAPE_H */
