/* scapectl_checkpoint.c - `scapectl checkpoint`: ask the daemon for a
 * checkpoint after the next completed step (the daemons of a job agree among
 * themselves, so asking one is enough), and with --wait follow the status
 * until it is written or has failed.  Also the Checkpoint block of status. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <time.h>

#include "scapectl.h"

void print_checkpoint(printer *p, const Scape__CheckpointInfo *c)
{
    if (c == NULL) {
        pr_null(p, "checkpoint", "Checkpoint");
        return;
    }
    char b[64];
    if (c->step)
        snprintf(b, sizeof b, "after step %llu", (unsigned long long)c->step);
    else
        snprintf(b, sizeof b, "none yet");
    pr_open(p, "checkpoint", "Checkpoint", b);
    pr_uint(p, "step", NULL, c->step, NULL);
    pr_str(p, "dir", "Directory", c->dir && c->dir[0] ? c->dir : NULL);
    pr_str(p, "checkpoint_dir", "Root", c->checkpoint_dir && c->checkpoint_dir[0]
                                            ? c->checkpoint_dir : "(not configured)");
    pr_uint(p, "pending", "Pending", c->pending, c->pending ? "yes" : "no");
    pr_uint(p, "count", "Taken", c->count, NULL);
    pr_uint(p, "resumed_from", "Resumed from", c->resumed_from,
            c->resumed_from ? NULL : "-");
    pr_str(p, "error", "Last error", c->error);
    pr_close(p);
}

/* Poll the status until the daemon has taken a checkpoint beyond `count`,
 * or the attempt failed, or wait_ms passed. */
static scape_rc wait_taken(const ctl_opts *o, uint64_t count)
{
    int64_t deadline = ctl_now_ms() + o->wait_ms;
    for (;;) {
        Scape__Reply *r = NULL;
        TRY(ctl_status(o, &r));
        const Scape__CheckpointInfo *c = r->status_reply->checkpoint;
        scape_rc rc = SCAPE_TIMEOUT;
        if (c == NULL)
            rc = scape_set_error(SCAPE_PROTO, "the daemon reports no checkpoint state");
        else if (c->count > count)
            rc = SCAPE_OK;
        else if (!c->pending && c->error && c->error[0])
            rc = scape_set_error(SCAPE_SYSTEM, "%s", c->error);
        if (rc == SCAPE_OK) {
            printer p;
            pr_init(&p, stdout, o->json);
            print_checkpoint(&p, c);
            pr_done(&p);
        }
        scape__reply__free_unpacked(r, NULL);
        if (rc != SCAPE_TIMEOUT)
            return rc;
        if (ctl_interrupted)
            return scape_set_error(SCAPE_SYSTEM, "interrupted while waiting");
        if (ctl_now_ms() >= deadline)
            return scape_set_error(SCAPE_TIMEOUT, "no checkpoint within %d ms: the daemon "
                                   "takes it after the next completed step (are the "
                                   "trainers stepping?)", o->wait_ms);
        nanosleep(&(struct timespec){ 0, 100 * 1000000L }, NULL);
    }
}

scape_rc cmd_checkpoint(const ctl_opts *o)
{
    Scape__CheckpointRequest body = SCAPE__CHECKPOINT_REQUEST__INIT;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_CHECKPOINT;
    q.checkpoint = &body;
    Scape__Reply *r = NULL;
    TRY(ctl_ask(o, &q, &r));
    if (r->body_case != SCAPE__REPLY__BODY_CHECKPOINT) {
        scape__reply__free_unpacked(r, NULL);
        return scape_set_error(SCAPE_PROTO, "%s answered a checkpoint request without its "
                               "checkpoint state", o->status_ep);
    }
    uint64_t count = r->checkpoint->count;
    scape__reply__free_unpacked(r, NULL);
    if (o->wait_ms > 0)
        return wait_taken(o, count);
    if (!o->json)
        printf("checkpoint requested: scaped writes it after the next completed step\n");
    else
        printf("{\"requested\": true}\n");
    return SCAPE_OK;
}
