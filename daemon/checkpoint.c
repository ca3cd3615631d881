/* checkpoint.c - when scaped checkpoints and how a job resumes.
 *
 * A checkpoint is due after a step when any daemon of the job was asked for
 * one (scapectl checkpoint, SIGUSR1) or the step is a multiple of
 * checkpoint_every.  Daemons are asked one by one, at different steps, so
 * after every step of a job of several daemons they exchange one flag each
 * (an all-gather of 4 bytes per daemon, outside the step's own collectives);
 * every daemon then checkpoints after the same step.  The trainers already
 * have that step's reply: they compute the next step while the files are
 * written.  A trainer's state_dict wants the state after the step just
 * ended: a lone daemon writes it at once; several agree on a second flag
 * before the next step changes the state (ckp_before_step).
 */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "server_internal.h"
#include "try.h"

static volatile sig_atomic_t s_ckpt_signal;

void srv_request_checkpoint(void) { s_ckpt_signal = 1; }

scape_rc ckp_prepare_resume(server *s)
{
    if (s->cfg.resume[0] == '\0')
        return SCAPE_OK;
    scape_rc rc = ckpt_open(s->cfg.resume, s->cfg.rank, s->cfg.world, &s->resume);
    if (rc != SCAPE_OK) {
        char why[1024];
        snprintf(why, sizeof why, "%s", scape_last_error());
        return scape_set_error(rc, "resume refused: %s", why);
    }
    s->resuming = 1;
    s->next_step = s->resume.step + 1;
    if (s->resume.reshard)
        LOG_WARN(SUB_ENGINE, "the checkpoint was taken by %u daemon(s), this job has %d: its "
                 "state is resharded (bit-identical continuation needs the same world size)",
                 s->resume.world, s->cfg.world);
    LOG_INFO(SUB_ENGINE, "resuming from %s: checked; the job continues at step %llu",
             s->resume.dir, (unsigned long long)s->next_step);
    return SCAPE_OK;
}

/* Every daemon must start the same way: all fresh, or all from the same
 * checkpoint (the same step, taken by the same world).  One small all-gather
 * before the start's own collectives, so a mismatch is refused everywhere
 * instead of pairing one daemon's broadcast with another's restore. */
static scape_rc agree_start(server *s)
{
    if (s->cfg.world == 1)
        return SCAPE_OK;
    int R = s->comm->size;
    uint64_t mine[3] = { (uint64_t)s->resuming, s->resuming ? s->resume.step : 0,
                         s->resuming ? s->resume.world : 0 };
    uint64_t *all = calloc((size_t)R * 3, sizeof *all);
    size_t *counts = calloc((size_t)R, sizeof *counts);
    scape_rc rc = all && counts ? SCAPE_OK : scape_set_error(SCAPE_NOMEM, "out of memory");
    for (int r = 0; rc == SCAPE_OK && r < R; r++)
        counts[r] = sizeof mine;
    if (rc == SCAPE_OK)
        rc = comm_allgather(s->comm, mine, all, counts);
    for (int r = 0; rc == SCAPE_OK && r < R; r++)
        if (memcmp(all + 3 * r, mine, sizeof mine) != 0)
            rc = scape_set_error(SCAPE_INVALID,
                                 "job start: rank %d %s, this rank (%d) %s; every daemon must "
                                 "resume the same checkpoint or none", r,
                                 all[3 * r] ? "resumes a checkpoint" : "starts fresh",
                                 s->cfg.rank, s->resuming ? "resumes one" : "starts fresh");
    if (rc == SCAPE_OK && s->resuming)
        for (int r = 0; rc == SCAPE_OK && r < R; r++)
            if (all[3 * r + 1] != mine[1])
                rc = scape_set_error(SCAPE_INVALID, "job start: rank %d resumes step %llu, "
                                     "this rank step %llu", r,
                                     (unsigned long long)all[3 * r + 1],
                                     (unsigned long long)mine[1]);
    free(all);
    free(counts);
    return rc;
}

scape_rc ckp_start(server *s, void *const *params)
{
    TRY(agree_start(s));
    if (!s->resuming)
        return eng_init_params(s->eng, params);
    TRY(ckpt_restore(&s->resume, s->eng, s->comm, params));
    s->resumed_from = s->resume.step;
    s->ckpt_step = s->resume.step;
    snprintf(s->ckpt_dir, sizeof s->ckpt_dir, "%s", s->resume.dir);
    LOG_INFO(SUB_ENGINE, "restored the state after step %llu from %s",
             (unsigned long long)s->resume.step, s->resume.dir);
    return SCAPE_OK;
}

void ckp_started(server *s) { s->resuming = 0; }

static scape_rc take(server *s);

scape_rc ckp_request(server *s, int now)
{
    if (s->cfg.checkpoint_dir[0] == '\0')
        return scape_set_error(SCAPE_INVALID, "checkpoint: no checkpoint_dir is configured "
                               "(set checkpoint_dir in the config, SCAPE_CHECKPOINT_DIR or "
                               "--checkpoint-dir)");
    if (s->broken)
        return scape_set_error(SCAPE_INVALID, "checkpoint: the optimizer failed part-way "
                               "through a step; its state is not saved");
    if (!now) {
        s->ckpt_requested = 1;
        LOG_INFO(SUB_STATUS, "checkpoint requested: taken after step %llu completes",
                 (unsigned long long)s->next_step);
        return SCAPE_OK;
    }
    if (s->eng == NULL || s->next_step <= 1)
        return scape_set_error(SCAPE_INVALID, "state_dict: no step has completed yet: there "
                               "is no state to save");
    if (s->ckpt_count && s->ckpt_step == s->next_step - 1 && s->ckpt_error[0] == '\0')
        return SCAPE_OK; /* this state is saved already (another trainer asked) */
    if (s->cfg.world > 1) {
        s->ckpt_now = 1;
        LOG_INFO(SUB_STATUS, "state_dict: the state after step %llu is saved before step "
                 "%llu starts", (unsigned long long)s->next_step - 1,
                 (unsigned long long)s->next_step);
        return SCAPE_OK;
    }
    return take(s);
}

/* Whether this daemon wants a checkpoint after `step`. */
static int wanted_here(server *s, uint64_t step)
{
    if (s_ckpt_signal) {
        s_ckpt_signal = 0;
        if (s->cfg.checkpoint_dir[0] == '\0')
            LOG_WARN(SUB_ENGINE, "SIGUSR1: no checkpoint_dir is configured; no checkpoint");
        else {
            LOG_INFO(SUB_ENGINE, "SIGUSR1: checkpoint after step %llu",
                     (unsigned long long)step);
            s->ckpt_requested = 1;
        }
    }
    uint32_t every = s->cfg.checkpoint_every;
    int periodic = every > 0 && step % every == 0 && s->cfg.checkpoint_dir[0] != '\0';
    return s->ckpt_requested || periodic;
}

/* Every daemon's wish, one 4-byte flag each; any one asks for all. */
static scape_rc agree(server *s, int mine, int *due)
{
    *due = mine;
    if (s->cfg.world == 1)
        return SCAPE_OK;
    int R = s->comm->size;
    uint32_t flag = mine != 0, *all = calloc((size_t)R, sizeof *all);
    size_t *counts = calloc((size_t)R, sizeof *counts);
    scape_rc rc = all && counts ? SCAPE_OK : scape_set_error(SCAPE_NOMEM, "out of memory");
    for (int r = 0; rc == SCAPE_OK && r < R; r++)
        counts[r] = sizeof flag;
    if (rc == SCAPE_OK)
        rc = comm_allgather(s->comm, &flag, all, counts);
    for (int r = 0; rc == SCAPE_OK && r < R; r++)
        *due |= all[r] != 0;
    free(all);
    free(counts);
    return rc;
}

void ckp_after_step(server *s, uint64_t step)
{
    int due = 0;
    scape_rc rc = agree(s, wanted_here(s, step), &due);
    if (rc != SCAPE_OK) {
        srv_mark_broken(s);
        LOG_ERROR(SUB_COMM, "after step %llu: lost the other daemons: %s",
                  (unsigned long long)step, scape_last_error());
        return;
    }
    if (!due)
        return;
    s->ckpt_requested = 0;
    take(s);
}

scape_rc ckp_before_step(server *s, uint64_t t)
{
    if (s->cfg.world == 1)
        return SCAPE_OK;
    int due = 0;
    scape_rc rc = agree(s, s->ckpt_now, &due);
    if (rc != SCAPE_OK) {
        /* as after a step: the daemons are no longer in step */
        srv_mark_broken(s);
        LOG_ERROR(SUB_COMM, "before step %llu: lost the other daemons: %s",
                  (unsigned long long)t, scape_last_error());
        return rc;
    }
    if (!due)
        return rc;
    s->ckpt_now = 0;
    LOG_INFO(SUB_ENGINE, "state_dict: saving the state after step %llu before step %llu",
             (unsigned long long)t - 1, (unsigned long long)t);
    rc = take(s);
    /* a failed write is reported and the job goes on; lost daemons are not */
    return rc == SCAPE_TIMEOUT || rc == SCAPE_ZMQ || rc == SCAPE_REMOTE ? rc : SCAPE_OK;
}

/* Checkpoint the state after the last completed step now (collective). */
static scape_rc take(server *s)
{
    scape_rc rc;
    double t0 = srv_now();
    uint64_t at = 0;
    char dir[CKPT_PATH_MAX];
    rc = ckpt_save(s->cfg.checkpoint_dir, s->eng, s->comm, s->cfg.checkpoint_keep, &at, dir,
                   sizeof dir);
    if (rc != SCAPE_OK) {
        snprintf(s->ckpt_error, sizeof s->ckpt_error, "%s", scape_last_error());
        LOG_ERROR(SUB_ENGINE, "%s", s->ckpt_error);
        if (rc == SCAPE_TIMEOUT || rc == SCAPE_ZMQ || rc == SCAPE_REMOTE)
            srv_mark_broken(s); /* the daemons are no longer in step */
        return scape_set_error(rc, "%s", s->ckpt_error);
    }
    s->ckpt_error[0] = '\0';
    s->ckpt_step = at;
    s->ckpt_count++;
    snprintf(s->ckpt_dir, sizeof s->ckpt_dir, "%s", dir);
    LOG_INFO(SUB_ENGINE, "checkpoint after step %llu written to %s in %.3f s",
             (unsigned long long)at, dir, srv_now() - t0);
    return SCAPE_OK;
}

void ckp_info(const server *s, Scape__CheckpointInfo *c)
{
    scape__checkpoint_info__init(c);
    c->has_step = 1;
    c->step = s->ckpt_step;
    c->dir = (char *)s->ckpt_dir;
    c->has_pending = 1;
    c->pending = s->ckpt_requested != 0;
    c->error = s->ckpt_error[0] ? (char *)s->ckpt_error : NULL;
    c->has_count = 1;
    c->count = s->ckpt_count;
    c->has_resumed_from = 1;
    c->resumed_from = s->resumed_from;
    c->checkpoint_dir = (char *)s->cfg.checkpoint_dir;
    c->has_layout_hash = s->eng != NULL;
    c->layout_hash = s->eng ? eng_layout_hash(s->eng) : 0;
}
