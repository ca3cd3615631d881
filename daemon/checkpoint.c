/* checkpoint.c - when scaped checkpoints and how a job resumes.
 *
 * A checkpoint is due after a step when any daemon of the job was asked for
 * one (scapectl checkpoint, SIGUSR1) or the step is a multiple of
 * checkpoint_every.  Daemons are asked one by one, at different steps, so
 * after every step of a job of several daemons they exchange one flag each
 * (an all-gather of 4 bytes per daemon, outside the step's own collectives);
 * every daemon then checkpoints after the same step.  The trainers already
 * have that step's reply: they compute the next step while the files are
 * written.
 *
 * A trainer's state_dict wants the state after the step just ended, on disk
 * before it returns, even when no step ever follows.  A lone daemon writes
 * it at once.  Several meet in between-steps rounds: each round is the same
 * 4-byte all-gather, and when any daemon's flag is set every daemon
 * checkpoints.  The daemon asked drops a request file in checkpoint_dir
 * (named by the step and the round) and enters a round with its flag set;
 * an idle daemon (no step for IDLE_LOOK_S) sees the file at its next
 * liveness check and enters the round too; a daemon whose trainers post the next step first enters rounds,
 * flag clear, before that step until a round where no flag is set.  Rounds
 * pair one to one on every daemon, so no daemon waits for a round the others
 * never enter, whichever trainers call state_dict and whenever.
 *
 * Leaving together.  Such a round needs every daemon, so a daemon whose own
 * trainers have ended must not stop while another's may still ask: under
 * scape-run each node stops its daemon as soon as its own trainers end, and
 * rank 0 typically saves last.  Every daemon keeps a marker in
 * checkpoint_dir (per job and rank): ".idle-" while it has no trainer,
 * ".leaving-" once it is told to stop.  A daemon told to stop waits, serving
 * rounds as when idle, until every rank has a marker; then every daemon
 * (stopping or idle) meets in one last 4-byte round with the flag LEAVE and
 * removes its marker; none can be asked for a state_dict any more.  The
 * round is entered only when all markers are there and at least one says
 * leaving, and markers are removed only after it (or by a daemon that gives
 * up), so every daemon sees the same set: it pairs one to one like the
 * others.  A lone daemon, a job without checkpoint_dir, one that never
 * stepped or is broken stops at once; the wait is bounded by comm_timeout_ms
 * and a second SIGTERM/SIGINT (server.c).
 */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "log.h"
#include "server_internal.h"
#include "try.h"

#define IDLE_LOOK_S 0.5 /* idle seconds after a step before request files are looked for */
#define FLAG_LEAVE 2u   /* a round's flag: the leave round (no checkpoint) */

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
    s->job.next_step = s->resume.step + 1;
    if (s->resume.reshard)
        LOG_WARN(SUB_ENGINE, "the checkpoint was taken by %u daemon(s), this job has %d: its "
                 "state is resharded (bit-identical continuation needs the same world size)",
                 s->resume.world, s->cfg.world);
    LOG_INFO(SUB_ENGINE, "resuming from %s: checked; the job continues at step %llu",
             s->resume.dir, (unsigned long long)s->job.next_step);
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
    /* the fourth word, whether this daemon has a checkpoint_dir, may differ:
     * only when every daemon has one can a state_dict reach them all, and
     * only then do they leave together (ckp_leave_begin) */
    uint64_t mine[4] = { (uint64_t)s->resuming, s->resuming ? s->resume.step : 0,
                         s->resuming ? s->resume.world : 0,
                         s->cfg.checkpoint_dir[0] != '\0' };
    uint64_t *all = calloc((size_t)R * 4, sizeof *all);
    size_t *counts = calloc((size_t)R, sizeof *counts);
    scape_rc rc = all && counts ? SCAPE_OK : scape_set_error(SCAPE_NOMEM, "out of memory");
    for (int r = 0; rc == SCAPE_OK && r < R; r++)
        counts[r] = sizeof mine;
    if (rc == SCAPE_OK)
        rc = comm_allgather(s->comm, mine, all, counts);
    for (int r = 0; rc == SCAPE_OK && r < R; r++)
        if (memcmp(all + 4 * r, mine, 3 * sizeof mine[0]) != 0)
            rc = scape_set_error(SCAPE_INVALID,
                                 "job start: rank %d %s, this rank (%d) %s; every daemon must "
                                 "resume the same checkpoint or none", r,
                                 all[4 * r] ? "resumes a checkpoint" : "starts fresh",
                                 s->cfg.rank, s->resuming ? "resumes one" : "starts fresh");
    if (rc == SCAPE_OK && s->resuming)
        for (int r = 0; rc == SCAPE_OK && r < R; r++)
            if (all[4 * r + 1] != mine[1])
                rc = scape_set_error(SCAPE_INVALID, "job start: rank %d resumes step %llu, "
                                     "this rank step %llu", r,
                                     (unsigned long long)all[4 * r + 1],
                                     (unsigned long long)mine[1]);
    s->all_ckpt_dirs = rc == SCAPE_OK;
    for (int r = 0; rc == SCAPE_OK && r < R; r++)
        s->all_ckpt_dirs &= all[4 * r + 3] != 0;
    free(all);
    free(counts);
    return rc;
}

/* The newest checkpoint is in dir; its name relative to checkpoint_dir. */
static void set_dir(server *s, const char *dir)
{
    snprintf(s->ckpt_dir, sizeof s->ckpt_dir, "%s", dir);
    s->ckpt_name[0] = '\0';
    if (s->cfg.checkpoint_dir[0])
        ckpt_relative(s->cfg.checkpoint_dir, dir, s->ckpt_name, sizeof s->ckpt_name);
}

scape_rc ckp_start(server *s, void *const *params)
{
    s->ckpt_rounds = 0;
    s->job_over = 0;
    s->leave_mark = CKPT_NO_MARK; /* a marker of an earlier run: gone before agree_start */
    if (s->cfg.world > 1 && s->cfg.checkpoint_dir[0])
        ckpt_mark(s->cfg.checkpoint_dir, s->cfg.job, s->cfg.rank, CKPT_NO_MARK);
    TRY(agree_start(s));
    if (!s->resuming)
        return job_init_params(&s->job, params);
    TRY(job_restore(&s->job, &s->resume, s->comm, params));
    s->resumed_from = s->resume.step;
    s->ckpt_step = s->resume.step;
    set_dir(s, s->resume.dir);
    LOG_INFO(SUB_ENGINE, "restored the state after step %llu from %s",
             (unsigned long long)s->resume.step, s->resume.dir);
    return SCAPE_OK;
}

void ckp_started(server *s) { s->resuming = 0; }

static scape_rc take(server *s);

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

/* Every daemon's wish, one 4-byte flag each; any one asks for all.
 * FLAG_LEAVE is the leave round's (*leave: how many daemons sent it); in any
 * other round it is an error: that daemon has left the job. */
static scape_rc agree_flags(server *s, uint32_t flag, int *due, int *leave)
{
    *due = flag == 1;
    *leave = flag == FLAG_LEAVE;
    if (s->cfg.world == 1)
        return SCAPE_OK;
    int R = s->comm->size;
    uint32_t *all = calloc((size_t)R, sizeof *all);
    size_t *counts = calloc((size_t)R, sizeof *counts);
    scape_rc rc = all && counts ? SCAPE_OK : scape_set_error(SCAPE_NOMEM, "out of memory");
    for (int r = 0; rc == SCAPE_OK && r < R; r++)
        counts[r] = sizeof flag;
    if (rc == SCAPE_OK)
        rc = comm_allgather(s->comm, &flag, all, counts);
    *leave = 0;
    for (int r = 0; rc == SCAPE_OK && r < R; r++) {
        *due |= all[r] == 1;
        *leave += all[r] == FLAG_LEAVE;
    }
    if (rc == SCAPE_OK && *leave && flag != FLAG_LEAVE)
        rc = scape_set_error(SCAPE_REMOTE, "%d daemon(s) of the job left it in this round "
                             "(every daemon had no trainer or was stopping)", *leave);
    free(all);
    free(counts);
    return rc;
}

static scape_rc agree(server *s, int mine, int *due)
{
    int leave = 0;
    return agree_flags(s, mine != 0, due, &leave);
}

void ckp_after_step(server *s, uint64_t step)
{
    int due = 0;
    s->ckpt_rounds = 0;
    /* while steps follow each other, their rounds meet a request: look for
     * request files (a metadata lookup on a shared file system) only once
     * the job has been idle for a while */
    s->ckpt_look_at = job_now() + IDLE_LOOK_S;
    scape_rc rc = agree(s, wanted_here(s, step), &due);
    if (rc != SCAPE_OK) {
        job_mark_broken(&s->job);
        LOG_ERROR(SUB_COMM, "after step %llu: lost the other daemons: %s",
                  (unsigned long long)step, scape_last_error());
        return;
    }
    if (!due)
        return;
    s->ckpt_requested = 0;
    take(s);
}

/* The state after step t is on disk already (every daemon agrees on this:
 * checkpoints are collective). */
static int saved(const server *s, uint64_t t)
{
    return s->ckpt_dir[0] != '\0' && s->ckpt_step == t;
}

static int lost_peers(scape_rc rc)
{
    return rc == SCAPE_TIMEOUT || rc == SCAPE_ZMQ || rc == SCAPE_REMOTE;
}

/* One between-steps round (several daemons): every daemon's flag; when any
 * is set, each checkpoints the state after the last step unless it is saved
 * already.  *due: a flag was set.  An error from the exchange marks the job
 * broken; one from the checkpoint is returned as it is. */
static scape_rc round_of(server *s, int mine, int *due)
{
    uint64_t t = s->job.next_step - 1;
    uint32_t g = s->ckpt_rounds;
    scape_rc rc = agree(s, mine, due);
    if (rc != SCAPE_OK) {
        job_mark_broken(&s->job);
        LOG_ERROR(SUB_COMM, "between steps %llu and %llu: lost the other daemons: %s",
                  (unsigned long long)t, (unsigned long long)t + 1, scape_last_error());
        return rc;
    }
    s->ckpt_rounds++;
    if (!*due)
        return SCAPE_OK;
    rc = saved(s, t) ? SCAPE_OK : take(s);
    if (s->cfg.rank == 0 && s->cfg.checkpoint_dir[0])
        ckpt_unwant(s->cfg.checkpoint_dir, t, g);
    return rc;
}

scape_rc ckp_before_step(server *s, uint64_t t)
{
    if (s->cfg.world == 1)
        return SCAPE_OK;
    int due = 1;
    scape_rc rc = SCAPE_OK;
    /* each round with a flag set needs a daemon asked by a trainer or by a
     * request file, which the round answers or removes: this ends */
    while (due) {
        rc = round_of(s, 0, &due);
        if (rc != SCAPE_OK && lost_peers(rc))
            return rc;
    }
    (void)t;
    return SCAPE_OK; /* a failed write is reported and the job goes on */
}

static void leave_idle(server *s);
static void mark(server *s, int kind);

/* Idle: a state_dict on another daemon asks for a round (its request file). */
static void join_state_dict(server *s)
{
    if (s->cfg.world == 1 || s->cfg.checkpoint_dir[0] == '\0' || !job_started(&s->job) ||
        s->job.broken || s->job.next_step <= 1 || saved(s, s->job.next_step - 1) ||
        job_now() < s->ckpt_look_at)
        return;
    if (!ckpt_wanted(s->cfg.checkpoint_dir, s->job.next_step - 1, s->ckpt_rounds))
        return;
    LOG_INFO(SUB_ENGINE, "state_dict on another daemon: saving the state after step %llu "
             "with it", (unsigned long long)s->job.next_step - 1);
    int due = 0;
    round_of(s, 1, &due); /* its outcome is logged; the trainer asked elsewhere hears it */
}

void ckp_idle(server *s)
{
    join_state_dict(s);
    leave_idle(s);
}

/* The state after step t, on disk before this returns. */
static scape_rc save_now(server *s, uint64_t t)
{
    if (s->cfg.checkpoint_dir[0] == '\0')
        return scape_set_error(SCAPE_INVALID, "state_dict: saving the state after step %llu "
                               "needs a checkpoint, and no checkpoint_dir is configured (set "
                               "checkpoint_dir in the config, SCAPE_CHECKPOINT_DIR or "
                               "--checkpoint-dir)", (unsigned long long)t);
    if (s->cfg.world == 1)
        return take(s);
    mark(s, CKPT_NO_MARK); /* a trainer is here again: no longer idle */
    TRY(ckpt_want(s->cfg.checkpoint_dir, t, s->ckpt_rounds));
    LOG_INFO(SUB_STATUS, "state_dict: saving the state after step %llu with the other "
             "daemons", (unsigned long long)t);
    int due = 0;
    TRY(round_of(s, 1, &due));
    if (!saved(s, t)) /* the round's take reported its own error */
        return scape_set_error(SCAPE_SYSTEM, "state_dict: the checkpoint after step %llu "
                               "was not written: %s", (unsigned long long)t,
                               s->ckpt_error[0] ? s->ckpt_error : "see the daemons' logs");
    return SCAPE_OK;
}

/* A trainer's state_dict: the reply names the checkpoint of the state after
 * the last step (step 0 and no dir: a fresh job). */
static scape_rc state_dict(server *s, Scape__CheckpointInfo *c)
{
    if (s->job.broken)
        return scape_set_error(SCAPE_INVALID, "state_dict: the optimizer failed part-way "
                               "through a step; its state is not saved");
    if (!job_started(&s->job) && s->resuming) {
        c->step = s->resume.step; /* not started yet: the checkpoint it starts from */
        set_dir(s, s->resume.dir);
        s->ckpt_step = s->resume.step;
    } else {
        uint64_t t = job_started(&s->job) ? s->job.next_step - 1 : 0;
        if (t == 0) {
            c->step = 0; /* a fresh job: nothing to save */
            c->dir = NULL;
            c->name = NULL;
            return SCAPE_OK;
        }
        if (!saved(s, t))
            TRY(save_now(s, t));
    }
    if (ckpt_mark_handed_out(s->ckpt_dir) != SCAPE_OK)
        LOG_WARN(SUB_ENGINE, "state_dict: %s (checkpoint_keep may prune it before newer "
                 "ones are handed out)", scape_last_error());
    c->step = s->ckpt_step;
    c->dir = s->ckpt_dir;
    c->name = s->ckpt_name;
    c->pending = 0;
    return SCAPE_OK;
}

scape_rc ckp_request(server *s, int now, Scape__CheckpointInfo *out)
{
    ckp_info(s, out);
    if (now)
        return state_dict(s, out);
    if (s->cfg.checkpoint_dir[0] == '\0')
        return scape_set_error(SCAPE_INVALID, "checkpoint: no checkpoint_dir is configured "
                               "(set checkpoint_dir in the config, SCAPE_CHECKPOINT_DIR or "
                               "--checkpoint-dir)");
    if (s->job.broken)
        return scape_set_error(SCAPE_INVALID, "checkpoint: the optimizer failed part-way "
                               "through a step; its state is not saved");
    s->ckpt_requested = 1;
    out->pending = 1;
    LOG_INFO(SUB_STATUS, "checkpoint requested: taken after step %llu completes",
             (unsigned long long)s->job.next_step);
    return SCAPE_OK;
}

scape_rc ckp_locate(const server *s, const char *given, char *dir, size_t len)
{
    const char *root = s->cfg.checkpoint_dir;
    if (given[0] != '/' && root[0] == '\0')
        return scape_set_error(SCAPE_INVALID, "load_state_dict: the state_dict names "
                               "checkpoint %s relative to checkpoint_dir, and this daemon has "
                               "no checkpoint_dir (set it as the job that saved it did)", given);
    if ((size_t)snprintf(dir, len, "%s%s%s", given[0] == '/' ? "" : root,
                         given[0] == '/' ? "" : "/", given) >= len)
        return scape_set_error(SCAPE_INVALID, "load_state_dict: path too long: %s", given);
    struct stat st;
    if (stat(dir, &st) == 0)
        return SCAPE_OK;
    /* a step directory that is gone: say why */
    char parent[CKPT_PATH_MAX];
    snprintf(parent, sizeof parent, "%s", dir);
    char *slash = strrchr(parent, '/');
    if (slash == NULL || strncmp(slash + 1, "step-", 5) != 0)
        return SCAPE_OK; /* ckpt_open names what is missing */
    *slash = '\0';
    char why[768];
    ckpt_missing(parent[0] ? parent : "/", slash + 1, s->cfg.checkpoint_keep);
    snprintf(why, sizeof why, "%s", scape_last_error());
    return scape_set_error(SCAPE_INVALID, "load_state_dict: %s", why);
}

/* Checkpoint the state after the last completed step now (collective). */
static scape_rc take(server *s)
{
    scape_rc rc;
    double t0 = job_now();
    uint64_t at = 0;
    char dir[CKPT_PATH_MAX];
    rc = job_save(&s->job, s->cfg.checkpoint_dir, s->comm, s->cfg.checkpoint_keep, &at, dir,
                  sizeof dir);
    if (rc != SCAPE_OK) {
        snprintf(s->ckpt_error, sizeof s->ckpt_error, "%s", scape_last_error());
        LOG_ERROR(SUB_ENGINE, "%s", s->ckpt_error);
        if (rc == SCAPE_TIMEOUT || rc == SCAPE_ZMQ || rc == SCAPE_REMOTE)
            job_mark_broken(&s->job); /* the daemons are no longer in step */
        return scape_set_error(rc, "%s", s->ckpt_error);
    }
    s->ckpt_error[0] = '\0';
    s->ckpt_step = at;
    s->ckpt_count++;
    set_dir(s, dir);
    LOG_INFO(SUB_ENGINE, "checkpoint after step %llu written to %s in %.3f s",
             (unsigned long long)at, dir, job_now() - t0);
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
    c->has_layout_hash = job_started(&s->job);
    c->layout_hash = job_layout_hash(&s->job);
    c->name = (char *)s->ckpt_name;
    c->has_job = 1;
    c->job = s->cfg.job;
    c->has_keep = 1;
    c->keep = (uint32_t)s->cfg.checkpoint_keep;
}

/* ---- leaving together ------------------------------------------------------ */

static int attached(const server *s)
{
    int n = 0;
    for (int i = 0; i < SRV_MAX_SLOTS; i++)
        n += s->slots[i].used;
    return n;
}

/* A trainer on some daemon of the job may still ask for a state_dict, and
 * this daemon would then be needed in its round. */
static int may_be_asked(const server *s)
{
    return s->cfg.world > 1 && s->cfg.checkpoint_dir[0] != '\0' && s->all_ckpt_dirs &&
           job_started(&s->job) &&
           !s->job.broken && s->job.next_step > 1 && !s->job_over;
}

static void mark(server *s, int kind)
{
    if (kind == s->leave_mark)
        return;
    if (ckpt_mark(s->cfg.checkpoint_dir, s->cfg.job, s->cfg.rank, kind) == SCAPE_OK) {
        s->leave_mark = kind;
        s->leave_warned = 0;
    } else if (!s->leave_warned) {
        s->leave_warned = 1;
        LOG_WARN(SUB_ENGINE, "%s (the daemons of the job may not leave together)",
                 scape_last_error());
    }
}

/* The last round: every daemon is done with the job. */
static void leave_round(server *s)
{
    int due = 0, leave = 0;
    scape_rc rc = agree_flags(s, FLAG_LEAVE, &due, &leave);
    s->job_over = 1;
    if (rc == SCAPE_OK && leave != s->cfg.world)
        rc = scape_set_error(SCAPE_REMOTE, "only %d of the %d daemons were leaving in the "
                             "leave round", leave, s->cfg.world);
    mark(s, CKPT_NO_MARK); /* every daemon has seen every marker */
    if (rc != SCAPE_OK) {
        job_mark_broken(&s->job);
        LOG_WARN(SUB_ENGINE, "the leave round failed: %s", scape_last_error());
        return;
    }
    LOG_INFO(SUB_ENGINE, "every daemon of the job is done with it (no trainer, or stopping): "
             "no state_dict can come any more");
}

/* At each liveness check: keep this daemon's marker true, and meet the
 * others in the leave round once every daemon has one and one is leaving. */
static void leave_idle(server *s)
{
    if (s->job_over && !s->stopping && attached(s) > 0)
        s->job_over = 0; /* trainers came back after the others left: a new round */
    if (!may_be_asked(s))
        return;
    mark(s, s->stopping ? CKPT_LEAVING : attached(s) == 0 ? CKPT_IDLE : CKPT_NO_MARK);
    if (s->leave_mark == CKPT_NO_MARK)
        return;
    int leaving = 0; /* one lookup a rank at most, up to the first unmarked */
    if (ckpt_marks(s->cfg.checkpoint_dir, s->cfg.job, s->cfg.world, &leaving, NULL, 0) == 0 &&
        leaving > 0)
        leave_round(s);
}

int ckp_leave_begin(server *s)
{
    if (!may_be_asked(s))
        return 0;
    mark(s, CKPT_LEAVING);
    if (s->leave_mark != CKPT_LEAVING)
        return 0; /* the others cannot know: logged */
    int leaving = 0;
    char missing[256];
    if (ckpt_marks(s->cfg.checkpoint_dir, s->cfg.job, s->cfg.world, &leaving, missing,
                   sizeof missing) == 0) {
        leave_round(s);
        ckp_leave_end(s, s->job.broken ? s->job.broken_why : NULL);
        return 0;
    }
    LOG_INFO(SUB_MAIN, "waiting for daemons %s to leave (a state_dict may still come; at most "
             "comm_timeout_ms, %d ms; a second SIGTERM or SIGINT stops at once)", missing,
             s->cfg.comm_timeout_ms);
    return 1;
}

int ckp_left(const server *s) { return s->job_over || s->job.broken; }

void ckp_leave_end(server *s, const char *why)
{
    if (why)
        LOG_WARN(SUB_MAIN, "stopping without the other daemons: %s", why);
    else if (s->job_over && !s->job.broken)
        LOG_INFO(SUB_MAIN, "the other daemons are leaving too: stopping");
    mark(s, CKPT_NO_MARK);
}
