/* scape_prom.c - a StatusReply as Prometheus series.  Counters (names in
 * _total) hold what accumulates since the daemon started; gauges hold the
 * current state and the last step's figures. */
#define _POSIX_C_SOURCE 200809L
#include "scape_prom.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

typedef struct prom {
    FILE *out;
    char rank[16]; /* the rank label's value */
} prom;

static void family_of(const prom *m, const char *type, const char *name, const char *help)
{
    fprintf(m->out, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void family(const prom *m, const char *name, const char *help)
{
    family_of(m, "gauge", name, help);
}

/* A label value with \, " and newline escaped. */
static void label_value(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '\\' || *s == '"')
            fprintf(f, "\\%c", *s);
        else if (*s == '\n')
            fputs("\\n", f);
        else
            fputc(*s, f);
    }
    fputc('"', f);
}

/* The shortest "%.*g" of v that reads back exactly; NaN and +-Inf as the
 * format spells them. */
static void number(FILE *f, double v)
{
    char b[40];
    if (isnan(v)) {
        fputs("NaN", f);
        return;
    }
    if (isinf(v)) {
        fputs(v > 0 ? "+Inf" : "-Inf", f);
        return;
    }
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(b, sizeof b, "%.*g", prec, v);
        if (strtod(b, NULL) == v)
            break;
    }
    fputs(b, f);
}

/* name{rank="r"[,key="val"]} v; extra is NULL or a key and its value. */
static void sample(const prom *m, const char *name, const char *const extra[2], double v)
{
    fprintf(m->out, "%s{rank=\"%s\"", name, m->rank);
    if (extra != NULL) {
        fprintf(m->out, ",%s=", extra[0]);
        label_value(m->out, extra[1]);
    }
    fputs("} ", m->out);
    number(m->out, v);
    fputc('\n', m->out);
}

static void gauge(const prom *m, const char *name, const char *help, double v)
{
    family(m, name, help);
    sample(m, name, NULL, v);
}

static void counter(const prom *m, const char *name, const char *help, double v)
{
    family_of(m, "counter", name, help);
    sample(m, name, NULL, v);
}

static void info(const prom *m, const Scape__StatusReply *st)
{
    const char *const labels[][2] = { { "version", st->version }, { "state", st->state },
                                      { "optimizer", st->optimizer }, { "mode", st->mode } };
    fprintf(m->out, "# HELP scape_info The daemon's version, state, optimizer and mode.\n"
                    "# TYPE scape_info gauge\nscape_info{rank=\"%s\"", m->rank);
    for (size_t i = 0; i < sizeof labels / sizeof labels[0]; i++) {
        fprintf(m->out, ",%s=", labels[i][0]);
        label_value(m->out, labels[i][1]);
    }
    fputs("} 1\n", m->out);
}

static void trainers(const prom *m, const Scape__StatusReply *st)
{
    gauge(m, "scape_trainers", "Trainers attached to this daemon.", (double)st->n_trainers);
    if (st->n_trainers == 0)
        return;
    family(m, "scape_trainer_last_step", "The last step each trainer posted.");
    for (size_t i = 0; i < st->n_trainers; i++) {
        char index[16];
        snprintf(index, sizeof index, "%u", st->trainers[i]->index);
        const char *const label[2] = { "trainer", index };
        sample(m, "scape_trainer_last_step", label, (double)st->trainers[i]->last_step);
    }
}

static void phases(const prom *m, const Scape__Phases *ph)
{
    const struct {
        const char *name;
        protobuf_c_boolean has;
        double s;
    } f[] = {
        { "wait", ph->has_wait, ph->wait },           { "intake", ph->has_intake, ph->intake },
        { "mask_wait", ph->has_mask_wait, ph->mask_wait },
        { "select", ph->has_select, ph->select },     { "pack", ph->has_pack, ph->pack },
        { "reduce", ph->has_reduce, ph->reduce },     { "update", ph->has_update, ph->update },
        { "gather", ph->has_gather, ph->gather },
        { "writeback", ph->has_writeback, ph->writeback },
        { "after_reply", ph->has_after_reply, ph->after_reply },
        { "queued", ph->has_queued, ph->queued },
        { "total", ph->has_total, ph->total },
    };
    family(m, "scape_phase_seconds", "Seconds the last step spent in each phase.");
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        const char *const label[2] = { "phase", f[i].name };
        if (f[i].has)
            sample(m, "scape_phase_seconds", label, f[i].s);
    }
}

/* One family of per-op figures: calls (is_bytes 0) or payload bytes. */
static void per_op(const prom *m, const char *type, const char *name, const char *help,
                   Scape__CollectiveCount *const *c, size_t n, int is_bytes)
{
    if (n == 0)
        return;
    family_of(m, type, name, help);
    for (size_t i = 0; i < n; i++) {
        const char *const label[2] = { "op", c[i]->op };
        sample(m, name, label, (double)(is_bytes ? c[i]->bytes : c[i]->calls));
    }
}

static void last_step(const prom *m, const Scape__StepDone *d)
{
    gauge(m, "scape_last_step_k", "Values reduced in the last step.", (double)d->k);
    gauge(m, "scape_last_step_density", "K / N in the last step.", d->density);
    gauge(m, "scape_last_step_bytes", "Collective payload bytes of the last step.",
          (double)d->bytes);
    gauge(m, "scape_last_step_wire_bytes",
          "Bytes this daemon receives in the last step per the ring model of each collective.",
          (double)d->wire_bytes);
    per_op(m, "gauge", "scape_last_step_collective_calls",
           "Collectives of each op in the last step.", d->collectives, d->n_collectives, 0);
    per_op(m, "gauge", "scape_last_step_collective_bytes",
           "Payload bytes of each op's collectives in the last step.", d->collectives,
           d->n_collectives, 1);
    if (d->has_mask_bytes)
        gauge(m, "scape_last_step_mask_bytes",
              "Of the last step's payload, the mask all-gather's (coded mask bits).",
              (double)d->mask_bytes);
    if (d->has_residual_norm)
        gauge(m, "scape_residual_norm", "Norm of the error-feedback residual.",
              d->residual_norm);
    if (d->has_mask_churn)
        gauge(m, "scape_mask_churn", "Fraction of the mask that changed in the last step.",
              d->mask_churn);
    if (d->has_mask_overlap)
        gauge(m, "scape_mask_overlap",
              "Fraction of the lagged mask all-gather hidden behind other work.",
              d->mask_overlap);
    if (d->has_grad_norm)
        gauge(m, "scape_grad_norm",
              "Global L2 norm of what the last step's update clipped (g_hat: the mean of "
              "what the daemons sent, for scape the residual at the mask included).",
              d->grad_norm);
    if (d->has_mean_grad_norm)
        gauge(m, "scape_mean_grad_norm",
              "L2 norm of the last step's mean gradient, what torch's clip_grad_norm_ "
              "would see (with several daemons on a sparse step: an upper bound).",
              d->mean_grad_norm);
    if (d->has_clip)
        gauge(m, "scape_clip_factor",
              "Factor the last step's mean gradient was scaled by (1: not clipped).", d->clip);
    if (d->has_handover_copy_bytes)
        gauge(m, "scape_handover_copy_bytes", "Gradient bytes copied in the last handover.",
              (double)d->handover_copy_bytes);
    phases(m, d->phases);
}

/* What only some daemons or backends report: left out when absent. */
static void optional_series(const prom *m, const Scape__StatusReply *st)
{
    const struct {
        protobuf_c_boolean has;
        int is_counter;
        const char *name, *help;
        double v;
    } opt[] = {
        { st->has_pinned_bytes, 0, "scape_pinned_bytes",
          "Pinned host memory the executor holds (the cuda executor's residual).",
          (double)st->pinned_bytes },
        { st->has_foreign_messages, 1, "scape_data_foreign_messages_total",
          "Messages dropped on the data port as not of this job (host backend).",
          (double)st->foreign_messages },
        { st->has_peers_connected, 0, "scape_peers_connected",
          "Other daemons this one's data-plane connections reach now (host backend).",
          (double)st->peers_connected },
        { st->has_queued_seconds_total, 1, "scape_step_queued_seconds_total",
          "Seconds trainers' step requests waited before scaped read them, summed.",
          st->queued_seconds_total },
        { st->has_steps_total, 1, "scape_steps_total",
          "Steps this daemon completed since it started.", (double)st->steps_total },
        { st->has_collective_bytes_total, 1, "scape_collective_bytes_total",
          "Collective payload bytes of the completed steps, summed (scape_last_step_bytes "
          "of each).", (double)st->collective_bytes_total },
        { st->has_wire_bytes_total, 1, "scape_wire_bytes_total",
          "Bytes received per the ring model of each collective, summed over the steps "
          "(scape_last_step_wire_bytes of each; 0 with one daemon).",
          (double)st->wire_bytes_total },
        { st->has_clipped_steps_total, 1, "scape_clipped_steps_total",
          "Steps whose mean gradient max_grad_norm scaled down (clip factor below 1).",
          (double)st->clipped_steps_total },
        { st->checkpoint != NULL && st->checkpoint->has_count, 1, "scape_checkpoints_total",
          "Checkpoints this daemon wrote since it started.",
          st->checkpoint ? (double)st->checkpoint->count : 0.0 },
    };
    for (size_t i = 0; i < sizeof opt / sizeof opt[0]; i++)
        if (opt[i].has)
            (opt[i].is_counter ? counter : gauge)(m, opt[i].name, opt[i].help, opt[i].v);
}

/* The data plane's counters are always there: 0 where nothing was measured
 * (one daemon has no data plane; handshakes are refused only under CURVE). */
static void data_plane(const prom *m, const Scape__StatusReply *st)
{
    counter(m, "scape_data_sent_bytes_total",
            "Bytes scaped sent on its data plane (host backend, framing included; 0 with "
            "one daemon).", st->has_data_sent_bytes ? (double)st->data_sent_bytes : 0.0);
    counter(m, "scape_data_received_bytes_total",
            "Bytes scaped received on its data plane (host backend, framing included; 0 "
            "with one daemon).", st->has_data_recv_bytes ? (double)st->data_recv_bytes : 0.0);
    counter(m, "scape_data_refused_handshakes_total",
            "Connections to the data port refused at the CURVE handshake (not a rank's key, "
            "no CURVE, not ZMTP; 0 without CURVE).",
            st->has_refused_handshakes ? (double)st->refused_handshakes : 0.0);
    counter(m, "scape_rendezvous_refused_joins_total",
            "Joins rank 0's rendezvous refused at the start (a wrong key or uid, another "
            "job's, not a join; 0 on other ranks and with one daemon).",
            st->has_rendezvous_refused_joins ? (double)st->rendezvous_refused_joins : 0.0);
}

/* The collective the daemon waits in when scraped (status during a wait):
 * 0 seconds and no peers between collectives. */
static void wait_series(const prom *m, const Scape__StatusReply *st)
{
    const char *op[2] = { "op", st->wait_op };
    family(m, "scape_collective_wait_seconds",
           "Seconds the collective running now has waited (label op); 0 between collectives.");
    sample(m, "scape_collective_wait_seconds", st->wait_op ? op : NULL,
           st->wait_op && st->has_wait_seconds ? st->wait_seconds : 0.0);
    if (st->wait_op == NULL || !st->wait_ranks_known || st->n_wait_ranks == 0)
        return;
    family(m, "scape_collective_waiting_for",
           "1 for each peer (label peer) whose data the running collective still waits for.");
    for (size_t i = 0; i < st->n_wait_ranks; i++) {
        char peer[16];
        snprintf(peer, sizeof peer, "%" PRIu32, st->wait_ranks[i]);
        const char *extra[2] = { "peer", peer };
        sample(m, "scape_collective_waiting_for", extra, 1);
    }
}

int prom_render(FILE *out, const Scape__StatusReply *st)
{
    prom m = { .out = out };
    snprintf(m.rank, sizeof m.rank, "%" PRIu32, st->rank);
    gauge(&m, "scape_up", "1 when scaped answered the status request.", 1);
    info(&m, st);
    gauge(&m, "scape_world", "Number of daemons in the job.", st->world);
    gauge(&m, "scape_rho", "Configured density target.", st->rho);
    gauge(&m, "scape_step", "Last completed step (the job's count, a resumed job's included).",
          (double)st->step);
    gauge(&m, "scape_numel", "Parameters (N) the daemon optimizes.", (double)st->numel);
    trainers(&m, st);
    gauge(&m, "scape_uptime_seconds", "Seconds since scaped started.",
          1e-3 * (double)st->uptime_ms);
    gauge(&m, "scape_rss_bytes", "Private resident memory of scaped (RssAnon).",
          (double)st->rss_bytes);
    gauge(&m, "scape_state_bytes", "Bytes of optimizer state and residual.",
          (double)st->state_bytes);
    gauge(&m, "scape_device_bytes",
          "GPU memory scaped holds (the cuda executor's state and buffers, nccl staging).",
          (double)st->device_bytes);
    data_plane(&m, st);
    optional_series(&m, st);
    wait_series(&m, st);
    per_op(&m, "counter", "scape_collectives_total",
           "Collectives of each op in the completed steps, summed.", st->collectives_total,
           st->n_collectives_total, 0);
    if (st->last != NULL)
        last_step(&m, st->last);
    if (st->has_loss)
        gauge(&m, "scape_loss", "Mean loss the trainers reported with the last step.",
              st->loss);
    return ferror(out) ? -1 : 0;
}

int prom_render_down(FILE *out)
{
    fputs("# HELP scape_up 1 when scaped answered the status request.\n"
          "# TYPE scape_up gauge\nscape_up 0\n", out);
    return ferror(out) ? -1 : 0;
}
