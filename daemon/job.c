/* job.c - the job: its engine's lifetime, the step (the trainers' buffers
 * through the engine), and the figures of the completed steps (job.h). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <time.h>

#include "job.h"
#include "scape_wire.h"
#include "try.h"

#define JOB_MAX_PARTS 64

double job_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void job_init(job *j, int clipping)
{
    *j = (job){ .next_step = 1, .clipping = clipping };
}

void job_mark_broken(job *j)
{
    j->broken = 1;
    snprintf(j->broken_why, sizeof j->broken_why, "%s", scape_last_error());
}

scape_rc job_pull(job_part *p, int n, int grads, size_t bytes, uint64_t *copied)
{
    for (int i = 0; i < n; i++)
        TRY(shm_map_pull(grads ? p[i].grads : p[i].params, bytes, copied));
    return SCAPE_OK;
}

scape_rc job_push(job_part *p, int n, size_t bytes, uint64_t *copied)
{
    for (int i = 0; i < n; i++)
        TRY(shm_map_push(p[i].params, bytes, copied));
    return SCAPE_OK;
}

/* Trainers that hand over by event (grad_event) have recorded it on the
 * stream that made their gradients: poll every such event under one
 * deadline, naming a trainer whose event does not get there.  Every 50 ms
 * the pids of those still awaited are looked at: a trainer that died after
 * posting leaves an event that may never complete, so it is returned in
 * *dead (the step is then abandoned as for any death) instead of holding
 * the daemon until the deadline. */
scape_rc job_await_grads(job_part *p, int n, int timeout_ms, int *dead)
{
    int done[JOB_MAX_PARTS], left = 0;
    char what[JOB_MAX_PARTS][32];
    *dead = -1;
    if (n > JOB_MAX_PARTS)
        return scape_set_error(SCAPE_INVALID, "step: %d trainers (at most %d)", n,
                               JOB_MAX_PARTS);
    for (int i = 0; i < n; i++) {
        done[i] = p[i].grads->event == NULL; /* shared memory, or no events */
        if (!done[i]) {
            snprintf(what[i], sizeof what[i], "step: trainer %d", p[i].index);
            left++;
        }
    }
    if (left == 0)
        return SCAPE_OK;
    double start = job_now(), look = start + 0.05;
    const struct timespec nap = { 0, 20000 }; /* 20 us between polls */
    for (;;) {
        for (int i = 0; i < n; i++) {
            if (done[i])
                continue;
            /* an event whose exporter has exited is undefined to use: a
             * query that fails for a dead trainer is its death, not the
             * step's error (deaths otherwise show at the pid checks) */
            scape_rc rc = shm_map_event_done(p[i].grads, &done[i], what[i]);
            if (rc != SCAPE_OK && wire_pid_gone(p[i].pid)) {
                *dead = i;
                return SCAPE_OK;
            }
            TRY(rc);
            left -= done[i];
        }
        if (left == 0)
            return SCAPE_OK;
        double now = job_now();
        if (now >= look) {
            look = now + 0.05;
            for (int i = 0; i < n; i++)
                if (!done[i] && wire_pid_gone(p[i].pid)) {
                    *dead = i;
                    return SCAPE_OK;
                }
        }
        if (now - start > 1e-3 * timeout_ms) {
            for (int i = 0; i < n; i++)
                if (!done[i])
                    return scape_set_error(SCAPE_TIMEOUT, "step: trainer %d (pid %d): its "
                                           "gradient-ready event has not completed after "
                                           "%d ms (its stream is stuck: comm_timeout_ms)",
                                           p[i].index, (int)p[i].pid, timeout_ms);
        }
        nanosleep(&nap, NULL);
    }
}

/* The step's figures: the engine's, and what the parts posted. */
static void record(job *j, const eng_step_stats *st, const job_part *p, int n,
                   double start, uint64_t copied)
{
    double first = p[0].posted_at, loss = 0.0, queued = -1.0;
    int nloss = 0;
    uint64_t control_bytes = 0;
    for (int i = 0; i < n; i++) {
        control_bytes += p[i].msg_bytes;
        queued = p[i].queued > queued ? p[i].queued : queued;
        first = p[i].posted_at < first ? p[i].posted_at : first;
        if (p[i].has_loss) {
            loss += p[i].loss;
            nloss++;
        }
    }
    job_step *l = &j->last;
    *l = (job_step){ .eng = *st, .wait = start - first, .total = job_now() - start,
                     .queued = queued, .copied = copied, .control_bytes = control_bytes };
    j->have_last = 1;
    j->totals.queued += queued > 0.0 ? queued : 0.0;
    j->have_loss = nloss > 0;
    j->last_loss = nloss ? loss / nloss : 0.0;
}

/* ---- the engine's lifetime ---------------------------------------------------- */

scape_rc job_open(job *j, const eng_config *cfg, const eng_layout *lay, comm_t *comm, int n)
{
    TRY(eng_create(&j->eng, cfg, lay, comm, n));
    j->trainers = n;
    return SCAPE_OK;
}

void job_close(job *j) { eng_destroy(&j->eng); }

scape_rc job_init_params(job *j, void *const *params)
{
    return eng_init_params(j->eng, params);
}

scape_rc job_restore(job *j, const ckpt_ref *ref, comm_t *comm, void *const *params)
{
    return ckpt_restore(ref, j->eng, comm, params);
}

scape_rc job_save(job *j, const char *root, comm_t *comm, int keep, uint64_t *step,
                  char *dir, size_t len)
{
    return ckpt_save(root, j->eng, comm, keep, step, dir, len);
}

scape_rc job_set_trainers(job *j, int n)
{
    TRY(eng_set_local_trainers(j->eng, n));
    j->trainers = n;
    return SCAPE_OK;
}

/* ---- the step ---------------------------------------------------------------- */

scape_rc job_step_run(job *j, const float *lr, job_part *p, int n, size_t grad_bytes,
                      size_t param_bytes, double start, int *broke)
{
    const void *grads[JOB_MAX_PARTS];
    void *params[JOB_MAX_PARTS];
    *broke = 0;
    if (n > JOB_MAX_PARTS)
        return scape_set_error(SCAPE_INVALID, "step: %d trainers (at most %d)", n,
                               JOB_MAX_PARTS);
    for (int i = 0; i < n; i++) {
        grads[i] = shm_map_engine(p[i].grads);
        params[i] = shm_map_engine(p[i].params);
    }
    uint64_t copied = 0;
    TRY(job_pull(p, n, 1, grad_bytes, &copied));
    scape_rc rc = eng_step_groups(j->eng, j->next_step, lr, grads, params);
    if (rc == SCAPE_OK)
        rc = job_push(p, n, param_bytes, &copied);
    for (int i = 0; i < n && rc == SCAPE_OK; i++)
        rc = shm_map_record_event(p[i].params, "step");
    if (rc != SCAPE_OK) {
        *broke = 1;
        return rc;
    }
    eng_step_stats st;
    eng_last_stats(j->eng, &st);
    record(j, &st, p, n, start, copied);
    j->next_step++;
    return SCAPE_OK;
}

scape_rc job_pack_early(job *j, job_part *p, int n, const unsigned char *take, int timeout_ms,
                        int *dead)
{
    const void *grads[JOB_MAX_PARTS];
    *dead = -1;
    if (n > JOB_MAX_PARTS)
        return scape_set_error(SCAPE_INVALID, "step: %d trainers (at most %d)", n,
                               JOB_MAX_PARTS);
    for (int i = 0; i < n; i++) {
        if (p[i].grads->dev && p[i].grads->addr)
            return SCAPE_OK; /* a pinned host copy: the step pulls it whole */
        grads[i] = shm_map_engine(p[i].grads);
    }
    TRY(job_await_grads(p, n, timeout_ms, dead));
    if (*dead >= 0)
        return SCAPE_OK;
    size_t packed = 0;
    return eng_pack_early(j->eng, j->next_step, grads, take, &packed);
}

scape_rc job_pack_undo(job *j) { return eng_pack_early_undo(j->eng); }

size_t job_early_kept(const job *j) { return j->eng ? eng_early_kept(j->eng, SIZE_MAX) : 0; }

scape_rc job_step_finish(job *j, int defer_select)
{
    j->last.has_after_reply = defer_select;
    j->last.after_reply = 0.0;
    double t0 = job_now();
    TRY(eng_step_finish(j->eng));
    j->last.after_reply = job_now() - t0;
    eng_step_stats st; /* the selection's kernels count to the step */
    if (eng_last_stats(j->eng, &st) == SCAPE_OK)
        j->last.eng.launches = st.launches;
    return SCAPE_OK;
}

void job_count(job *j)
{
    job_totals *t = &j->totals;
    const job_step *l = &j->last;
    t->steps++;
    for (int op = 0; op < COMM_OP_COUNT; op++) {
        t->bytes += l->eng.comm.bytes[op];
        t->wire_bytes += l->eng.comm.wire_bytes[op];
        t->coll_calls[op] += l->eng.comm.calls[op];
        t->coll_bytes[op] += l->eng.comm.calls[op] ? l->eng.comm.bytes[op] : 0;
    }
    if (j->clipping && l->eng.clip < 1.0)
        t->clipped++;
}

/* ---- what status, checkpoints and the control plane ask ----------------------- */

void job_footprint_of(const job *j, job_footprint *f)
{
    f->state_bytes = eng_state_bytes(j->eng);
    f->device_bytes = eng_device_bytes(j->eng);
    f->pinned_bytes = eng_pinned_bytes(j->eng);
    f->gather_values = eng_gathers_delta(j->eng) ? "delta"
                       : eng_gathers_bf16(j->eng) ? "bf16" : "f32";
}

double job_residual_norm(const job *j) { return eng_residual_norm(j->eng); }

uint64_t job_layout_hash(const job *j) { return eng_layout_hash(j->eng); }

size_t job_groups(const job *j) { return eng_groups(j->eng); }

double job_grad_norm(const job *j, int i) { return eng_trainer_grad_norm(j->eng, i); }

int job_device_stuck(const job *j) { return eng_device_stuck(j->eng); }

scape_rc job_params(const job *j, float *theta, unsigned char *have)
{
    return eng_get_state(j->eng, ENG_VEC_THETA, theta, have);
}
