/* scapectl_metrics.c - `scapectl metrics`: the status reply in the Prometheus
 * text exposition format (version 0.0.4), for a node_exporter textfile
 * collector or any scraper that runs a command.  Every series carries the
 * daemon's rank; figures the daemon has not produced yet are left out. */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <math.h>
#include <stdio.h>

#include "scapectl.h"

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

/* name{rank="r"[,key="val"]} v; extra is NULL or a key and its value. */
static void sample(const prom *m, const char *name, const char *const extra[2], double v)
{
    char b[40];
    fprintf(m->out, "%s{rank=\"%s\"", name, m->rank);
    if (extra != NULL) {
        fprintf(m->out, ",%s=", extra[0]);
        label_value(m->out, extra[1]);
    }
    if (isnan(v))
        fprintf(m->out, "} NaN\n");
    else if (isinf(v))
        fprintf(m->out, "} %cInf\n", v > 0 ? '+' : '-');
    else
        fprintf(m->out, "} %s\n", fmt_real(b, sizeof b, v));
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

static void last_step(const prom *m, const Scape__StepDone *d)
{
    gauge(m, "scape_last_step_k", "Values reduced in the last step.", (double)d->k);
    gauge(m, "scape_last_step_density", "K / N in the last step.", d->density);
    gauge(m, "scape_last_step_bytes", "Collective payload bytes of the last step.",
          (double)d->bytes);
    gauge(m, "scape_last_step_wire_bytes",
          "Bytes this daemon receives in the last step per the ring model of each collective.",
          (double)d->wire_bytes);
    if (d->n_collectives) {
        const char *const fam[2][2] = {
            { "scape_last_step_collective_calls", "Collectives of each op in the last step." },
            { "scape_last_step_collective_bytes",
              "Payload bytes of each op's collectives in the last step." },
        };
        for (int f = 0; f < 2; f++) {
            family(m, fam[f][0], fam[f][1]);
            for (size_t i = 0; i < d->n_collectives; i++) {
                const Scape__CollectiveCount *c = d->collectives[i];
                const char *const label[2] = { "op", c->op };
                sample(m, fam[f][0], label, (double)(f ? c->bytes : c->calls));
            }
        }
    }
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

static void exposition(const prom *m, const Scape__StatusReply *st)
{
    gauge(m, "scape_up", "1 when scaped answered the status request.", 1);
    info(m, st);
    gauge(m, "scape_world", "Number of daemons in the job.", st->world);
    gauge(m, "scape_rho", "Configured density target.", st->rho);
    gauge(m, "scape_step", "Last completed step.", (double)st->step);
    gauge(m, "scape_numel", "Parameters (N) the daemon optimizes.", (double)st->numel);
    trainers(m, st);
    gauge(m, "scape_uptime_seconds", "Seconds since scaped started.", 1e-3 * (double)st->uptime_ms);
    gauge(m, "scape_rss_bytes", "Private resident memory of scaped (RssAnon).",
          (double)st->rss_bytes);
    gauge(m, "scape_state_bytes", "Bytes of optimizer state and residual.",
          (double)st->state_bytes);
    gauge(m, "scape_device_bytes",
          "GPU memory scaped holds (the cuda executor's state and buffers, nccl staging).",
          (double)st->device_bytes);
    /* what only some backends report */
    const struct {
        protobuf_c_boolean has;
        int is_counter;
        const char *name, *help;
        double v;
    } opt[] = {
        { st->has_pinned_bytes, 0, "scape_pinned_bytes",
          "Pinned host memory the executor holds (the cuda executor's residual).",
          (double)st->pinned_bytes },
        { st->has_data_sent_bytes, 1, "scape_data_sent_bytes_total",
          "Bytes scaped sent on its data plane (host backend, framing included).",
          (double)st->data_sent_bytes },
        { st->has_data_recv_bytes, 1, "scape_data_received_bytes_total",
          "Bytes scaped received on its data plane (host backend, framing included).",
          (double)st->data_recv_bytes },
        { st->has_foreign_messages, 1, "scape_data_foreign_messages_total",
          "Messages dropped on the data port as not of this job (host backend).",
          (double)st->foreign_messages },
        { st->has_refused_handshakes, 1, "scape_data_refused_handshakes_total",
          "Connections to the data port refused at the CURVE handshake (not a rank's key, "
          "no CURVE, not ZMTP).",
          (double)st->refused_handshakes },
        { st->has_peers_connected, 0, "scape_peers_connected",
          "Other daemons this one's data-plane connections reach now (host backend).",
          (double)st->peers_connected },
        { st->has_queued_seconds_total, 1, "scape_step_queued_seconds_total",
          "Seconds trainers' step requests waited before scaped read them, summed.",
          st->queued_seconds_total },
    };
    for (size_t i = 0; i < sizeof opt / sizeof opt[0]; i++)
        if (opt[i].has)
            (opt[i].is_counter ? counter : gauge)(m, opt[i].name, opt[i].help, opt[i].v);
    if (st->last != NULL)
        last_step(m, st->last);
    if (st->has_loss)
        gauge(m, "scape_loss", "Mean loss the trainers reported with the last step.",
              st->loss);
}

scape_rc cmd_metrics(const ctl_opts *o)
{
    Scape__Reply *r = NULL;
    scape_rc rc = ctl_status(o, &r);
    if (rc != SCAPE_OK)
        return rc;
    prom m = { .out = stdout };
    snprintf(m.rank, sizeof m.rank, "%" PRIu32, r->status_reply->rank);
    exposition(&m, r->status_reply);
    scape__reply__free_unpacked(r, NULL);
    return SCAPE_OK;
}
