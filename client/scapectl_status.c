/* scapectl_status.c - `scapectl status`: the daemon's StatusReply as aligned
 * labels or, with --json, one JSON object with stable keys (numbers in the
 * wire's units: bytes, milliseconds of uptime, seconds per phase). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>

#include "scapectl.h"

static void print_trainers(printer *p, const Scape__StatusReply *st)
{
    pr_list(p, "trainers", "Trainers", st->n_trainers);
    for (size_t i = 0; i < st->n_trainers; i++) {
        const Scape__TrainerInfo *t = st->trainers[i];
        char label[32];
        snprintf(label, sizeof label, "Trainer %u", t->index);
        pr_row(p, NULL, label);
        pr_uint(p, "index", NULL, t->index, NULL);
        pr_str(p, "identity", "", t->identity);
        pr_uint(p, "pid", "pid", t->pid, NULL);
        pr_uint(p, "last_step", "last step", t->last_step, NULL);
        if (t->memory)
            pr_str(p, "memory", "memory", t->memory);
        pr_close(p);
    }
    pr_close(p);
}

void pr_waiting(printer *p, const char *label, const Scape__StatusReply *st)
{
    if (st->has_trainers_expected)
        pr_uint(p, "trainers_expected", NULL, st->trainers_expected, NULL);
    if (!st->has_waiting_for) {
        pr_null(p, "waiting_for", NULL);
        return;
    }
    char text[400];
    int n = snprintf(text, sizeof text, "%u more trainer%s", st->waiting_for,
                     st->waiting_for == 1 ? "" : "s");
    for (size_t i = 0; i < st->n_waiting_slots && n > 0 && (size_t)n < sizeof text - 16; i++)
        n += snprintf(text + n, sizeof text - (size_t)n, "%s%u",
                      i == 0 ? (st->n_waiting_slots == 1 ? " (slot " : " (slots ") : ", ",
                      st->waiting_slots[i]);
    if (st->n_waiting_slots && n > 0 && (size_t)n < sizeof text - 1)
        snprintf(text + n, sizeof text - (size_t)n, ")");
    pr_uint(p, "waiting_for", label, st->waiting_for, text);
    pr_list(p, "waiting_slots", NULL, st->n_waiting_slots);
    for (size_t i = 0; i < st->n_waiting_slots; i++)
        pr_uint(p, NULL, NULL, st->waiting_slots[i], NULL);
    pr_close(p);
}

/* Asked during a collective's wait: `Collective : waiting in reduce_scatter
 * for ranks [2] since 3.2 s` ("unknown" where the backend cannot tell). */
static void print_wait(printer *p, const Scape__StatusReply *st)
{
    if (st->wait_op == NULL) {
        pr_null(p, "wait", NULL);
        return;
    }
    char ranks[256] = "unknown", text[400];
    int n = 0;
    if (st->wait_ranks_known)
        ranks[0] = '\0';
    for (size_t i = 0; st->wait_ranks_known && i < st->n_wait_ranks && n >= 0 &&
                       (size_t)n < sizeof ranks - 16; i++)
        n += snprintf(ranks + n, sizeof ranks - (size_t)n, "%s%u", i ? ", " : "",
                      st->wait_ranks[i]);
    snprintf(text, sizeof text, "waiting in %s for ranks [%s] since %.1f s", st->wait_op,
             ranks, st->has_wait_seconds ? st->wait_seconds : 0.0);
    pr_open(p, "wait", "Collective", text);
    pr_str(p, "op", NULL, st->wait_op);
    pr_real(p, "seconds", NULL, st->has_wait_seconds ? st->wait_seconds : 0.0, NULL);
    pr_bool(p, "ranks_known", NULL, st->wait_ranks_known);
    pr_list(p, "ranks", NULL, st->n_wait_ranks);
    for (size_t i = 0; i < st->n_wait_ranks; i++)
        pr_uint(p, NULL, NULL, st->wait_ranks[i], NULL);
    pr_close(p);
    pr_close(p);
}

static void print_phases(printer *p, const Scape__Phases *ph)
{
    const struct {
        const char *key, *label;
        protobuf_c_boolean has;
        double s;
    } f[] = {
        { "wait", "wait", ph->has_wait, ph->wait },
        { "intake", "intake", ph->has_intake, ph->intake },
        { "mask_wait", "mask wait", ph->has_mask_wait, ph->mask_wait },
        { "select", "select", ph->has_select, ph->select },
        { "pack", "pack", ph->has_pack, ph->pack },
        { "reduce", "reduce", ph->has_reduce, ph->reduce },
        { "update", "update", ph->has_update, ph->update },
        { "gather", "gather", ph->has_gather, ph->gather },
        { "writeback", "writeback", ph->has_writeback, ph->writeback },
        { "after_reply", "after reply", ph->has_after_reply, ph->after_reply },
        { "queued", "queued", ph->has_queued, ph->queued },
        { "early_pack", "early pack", ph->has_early_pack, ph->early_pack },
        { "total", NULL, ph->has_total, ph->total }, /* the text shows it above */
    };
    char b[32];
    pr_open(p, "phases_s", "Step time", ph->has_total ? fmt_ms(b, sizeof b, ph->total) : "-");
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        if (f[i].has)
            pr_real(p, f[i].key, f[i].label, f[i].s, fmt_ms(b, sizeof b, f[i].s));
        else
            pr_null(p, f[i].key, f[i].label);
    }
    if (ph->has_early_tensors)
        pr_uint(p, "early_tensors", "packed early", ph->early_tensors, NULL);
    else
        pr_null(p, "early_tensors", "packed early");
    if (ph->has_chunks) {
        char c[48];
        snprintf(c, sizeof c, "%u of %u chunks", ph->early_chunks, ph->chunks);
        pr_uint(p, "early_chunks", "reduced early", ph->early_chunks, c);
        pr_uint(p, "chunks", "chunks", ph->chunks, NULL);
    } else {
        pr_null(p, "early_chunks", "reduced early");
        pr_null(p, "chunks", "chunks");
    }
    pr_close(p);
}

static void print_optional(printer *p, const char *key, const char *label,
                           protobuf_c_boolean has, double v)
{
    if (has)
        pr_real(p, key, label, v, NULL);
    else
        pr_null(p, key, label);
}

/* What the data port dropped as not of this job:
 * `Strays : 20 dropped; the last: a message of job 99 ...`. */
static void print_strays(printer *p, const Scape__StatusReply *st)
{
    if (!st->has_foreign_messages)
        return;
    char text[320];
    if (st->foreign_messages == 0)
        snprintf(text, sizeof text, "none dropped");
    else
        snprintf(text, sizeof text, "%llu dropped; the last: %s",
                 (unsigned long long)st->foreign_messages,
                 st->foreign_last ? st->foreign_last : "?");
    pr_uint(p, "foreign_messages", "Strays", st->foreign_messages, text);
    if (st->foreign_last)
        pr_str(p, "foreign_last", NULL, st->foreign_last);
}

/* Who may talk to this daemon: `Auth : munge; data plane CURVE, 3 refused
 * at the handshake; the last: ...`. */
static void print_auth(printer *p, const Scape__StatusReply *st)
{
    if (!st->auth)
        return;
    char text[400];
    int n = snprintf(text, sizeof text, "%s; data plane %s", st->auth,
                     st->has_data_encrypted && st->data_encrypted ? "CURVE (authenticated, "
                                                                    "encrypted)"
                                                                  : "plain TCP");
    if (st->has_refused_handshakes && n > 0 && (size_t)n < sizeof text)
        snprintf(text + n, sizeof text - (size_t)n, ", %llu refused at the handshake%s%s",
                 (unsigned long long)st->refused_handshakes, st->refused_last ? "; the last: " : "",
                 st->refused_last ? st->refused_last : "");
    pr_str(p, "auth", NULL, st->auth);
    pr_str(p, NULL, "Auth", text);
    if (st->has_data_encrypted)
        pr_bool(p, "data_encrypted", NULL, st->data_encrypted);
    if (st->has_refused_handshakes)
        pr_uint(p, "refused_handshakes", NULL, st->refused_handshakes, NULL);
    if (st->refused_last)
        pr_str(p, "refused_last", NULL, st->refused_last);
    if (st->has_rendezvous_refused_joins) {
        char j[64];
        snprintf(j, sizeof j, "%llu at the rendezvous",
                 (unsigned long long)st->rendezvous_refused_joins);
        pr_uint(p, "rendezvous_refused_joins", "Refused joins", st->rendezvous_refused_joins, j);
    }
    if (st->data_public_key)
        pr_str(p, "data_public_key", NULL, st->data_public_key);
}

/* The other daemons: `Peers : 2 of 3 connected; down: rank 2`. */
static void print_peers(printer *p, const Scape__StatusReply *st)
{
    if (!st->has_peers_connected)
        return;
    char text[400];
    int n = snprintf(text, sizeof text, "%u of %u connected", st->peers_connected,
                     st->world > 0 ? st->world - 1 : 0);
    for (size_t i = 0; i < st->n_peers_down && n > 0 && (size_t)n < sizeof text - 16; i++)
        n += snprintf(text + n, sizeof text - (size_t)n, "%s%u", i ? ", " : "; down: rank ",
                      st->peers_down[i]);
    pr_uint(p, "peers_connected", "Peers", st->peers_connected, text);
    pr_list(p, "peers_down", NULL, st->n_peers_down);
    for (size_t i = 0; i < st->n_peers_down; i++)
        pr_uint(p, NULL, NULL, st->peers_down[i], NULL);
    pr_close(p);
}

/* Collectives, one row per op: `allreduce : calls 1, 2.3 KiB` (a step's,
 * or the totals since the daemon started). */
static void print_collectives(printer *p, const char *key, const char *label, size_t n,
                              Scape__CollectiveCount *const *cc)
{
    char b[32];
    pr_list(p, key, label, n);
    for (size_t i = 0; i < n; i++) {
        const Scape__CollectiveCount *c = cc[i];
        pr_row(p, NULL, c->op);
        pr_str(p, "op", NULL, c->op);
        pr_uint(p, "calls", "calls", c->calls, NULL);
        pr_uint(p, "bytes", "", c->bytes, fmt_bytes(b, sizeof b, c->bytes));
        pr_close(p);
    }
    pr_close(p);
}

/* The counters since the daemon started (what `scapectl metrics` and the
 * HTTP endpoint serve as *_total): absent from a daemon that predates them. */
static void print_totals(printer *p, const Scape__StatusReply *st)
{
    if (!st->has_steps_total)
        return;
    char b[32], w[32], sum[160];
    snprintf(sum, sizeof sum, "%llu steps, %s collective (%s on the wire), %llu clipped",
             (unsigned long long)st->steps_total,
             fmt_bytes(b, sizeof b, st->collective_bytes_total),
             fmt_bytes(w, sizeof w, st->wire_bytes_total),
             (unsigned long long)st->clipped_steps_total);
    pr_open(p, "totals", "Totals", sum);
    pr_uint(p, "steps_total", NULL, st->steps_total, NULL);
    pr_uint(p, "collective_bytes_total", NULL, st->collective_bytes_total, NULL);
    pr_uint(p, "wire_bytes_total", NULL, st->wire_bytes_total, NULL);
    pr_uint(p, "clipped_steps_total", NULL, st->clipped_steps_total, NULL);
    print_collectives(p, "collectives_total", "Collectives", st->n_collectives_total,
                      st->collectives_total);
    pr_close(p);
}

static void print_last(printer *p, const Scape__StepDone *d)
{
    char b[32];
    if (d == NULL) {
        pr_null(p, "last", "Last step");
        return;
    }
    snprintf(b, sizeof b, "%llu", (unsigned long long)d->step);
    pr_open(p, "last", "Last step", b);
    pr_uint(p, "step", NULL, d->step, NULL);
    pr_uint(p, "k", "K", d->k, NULL);
    pr_real(p, "density", "Density", d->density, fmt_percent(b, sizeof b, d->density));
    pr_uint(p, "bytes", "Bytes/step", d->bytes, fmt_bytes(b, sizeof b, d->bytes));
    if (d->has_mask_bytes)
        pr_uint(p, "mask_bytes", "  of it mask", d->mask_bytes,
                fmt_bytes(b, sizeof b, d->mask_bytes));
    else
        pr_null(p, "mask_bytes", "  of it mask");
    pr_uint(p, "wire_bytes", "Wire bytes", d->wire_bytes, fmt_bytes(b, sizeof b, d->wire_bytes));
    print_optional(p, "residual_norm", "Residual norm", d->has_residual_norm, d->residual_norm);
    print_optional(p, "mask_churn", "Mask churn", d->has_mask_churn, d->mask_churn);
    print_optional(p, "mask_overlap", "Mask overlap", d->has_mask_overlap, d->mask_overlap);
    if (d->has_launches)
        pr_uint(p, "launches", "Kernel launches", d->launches, NULL);
    print_optional(p, "grad_norm", "Gradient norm", d->has_grad_norm, d->grad_norm);
    print_optional(p, "mean_grad_norm", d->has_mean_grad_exact && !d->mean_grad_exact
                   ? "Mean grad norm (bound)" : "Mean grad norm", d->has_mean_grad_norm,
                   d->mean_grad_norm);
    print_optional(p, "clip", "Clip factor", d->has_clip, d->clip);
    if (d->has_handover_copy_bytes)
        pr_uint(p, "handover_copy_bytes", "Handover copy", d->handover_copy_bytes,
                fmt_bytes(b, sizeof b, d->handover_copy_bytes));
    else
        pr_null(p, "handover_copy_bytes", "Handover copy");
    if (d->has_control_bytes)
        pr_uint(p, "control_bytes", "Control bytes", d->control_bytes,
                fmt_bytes(b, sizeof b, d->control_bytes));
    else
        pr_null(p, "control_bytes", "Control bytes");
    print_collectives(p, "collectives", "Collectives", d->n_collectives, d->collectives);
    print_phases(p, d->phases);
    pr_close(p);
}

static void print_identity(printer *p, const Scape__StatusReply *st)
{
    char b[48];
    pr_str(p, "version", "Version", st->version);
    pr_str(p, "state", "State", st->state);
    snprintf(b, sizeof b, "%u/%u", st->rank, st->world);
    pr_str(p, NULL, "Rank/World", b);
    pr_uint(p, "rank", NULL, st->rank, NULL);
    pr_uint(p, "world", NULL, st->world, NULL);
    pr_str(p, "optimizer", "Optimizer", st->optimizer);
    pr_str(p, "mode", "Mode", st->mode);
    pr_real(p, "rho", "Rho", st->rho, NULL);
    if (st->executor)
        pr_str(p, "executor", "Executor", st->executor);
    if (st->has_max_grad_norm)
        pr_real(p, "max_grad_norm", "Max grad norm", st->max_grad_norm,
                st->max_grad_norm > 0.0f ? NULL : "0 (no clipping)");
    if (st->wire_values)
        pr_str(p, "wire_values", "Values on wire", st->wire_values);
    if (st->gather_values)
        pr_str(p, "gather_values", "Gathers", st->gather_values);
    if (st->has_mask_deltas)
        pr_bool(p, "mask_deltas", "Mask deltas", st->mask_deltas);
    if (st->has_rho_start) {
        char b[96];
        snprintf(b, sizeof b, "%g -> %g over %u masked steps", st->rho_start, st->rho,
                 st->has_rho_steps ? st->rho_steps : 0u);
        pr_real(p, "rho_start", "Rho schedule", st->rho_start,
                st->rho_start > 0.0 ? b : "0 (none)");
        if (st->has_rho_steps)
            pr_uint(p, "rho_steps", NULL, st->rho_steps, NULL);
    }
    if (st->has_dense_below) {
        char b[64];
        snprintf(b, sizeof b, "those of <= %u coordinates", st->dense_below);
        pr_uint(p, "dense_below", "Whole tensors", st->dense_below,
                st->dense_below ? b : "0 (none)");
    }
}

/* The keys the daemon's key table shows in status (StatusReply.config): an
 * object of key: value text; a daemon before it sends none. */
static void print_config(printer *p, const Scape__StatusReply *st)
{
    if (st->n_config == 0)
        return;
    char n[32];
    snprintf(n, sizeof n, "%zu keys", st->n_config);
    pr_open(p, "config", "Configuration", n);
    for (size_t i = 0; i < st->n_config; i++)
        pr_str(p, st->config[i]->key, st->config[i]->key, st->config[i]->value);
    pr_close(p);
}

static void print_status(printer *p, const Scape__StatusReply *st)
{
    char b[48];
    print_identity(p, st);
    pr_uint(p, "step", "Step", st->step, NULL);
    pr_uint(p, "numel", "Parameters", st->numel, fmt_count(b, sizeof b, st->numel));
    print_trainers(p, st);
    pr_waiting(p, "Waiting for", st);
    print_wait(p, st);
    pr_uint(p, "uptime_ms", "Uptime", st->uptime_ms, fmt_uptime(b, sizeof b, st->uptime_ms));
    pr_uint(p, "rss_bytes", "RSS", st->rss_bytes, fmt_bytes(b, sizeof b, st->rss_bytes));
    pr_uint(p, "state_bytes", "State memory", st->state_bytes,
            fmt_bytes(b, sizeof b, st->state_bytes));
    char dev[64];
    snprintf(dev, sizeof dev, "%s (%.2f B/param)", fmt_bytes(b, sizeof b, st->device_bytes),
             st->device_bytes_per_param);
    pr_uint(p, "device_bytes", "Device memory", st->device_bytes, dev);
    pr_real(p, "device_bytes_per_param", NULL, st->device_bytes_per_param, NULL);
    if (st->has_pinned_bytes)
        pr_uint(p, "pinned_bytes", "Pinned memory", st->pinned_bytes,
                fmt_bytes(b, sizeof b, st->pinned_bytes));
    if (st->has_data_sent_bytes && st->has_data_recv_bytes) {
        char sb[24], rb[24], both[320];
        snprintf(both, sizeof both, "%s%ssent %s, received %s",
                 st->data_endpoint ? st->data_endpoint : "", st->data_endpoint ? ": " : "",
                 fmt_bytes(sb, sizeof sb, st->data_sent_bytes),
                 fmt_bytes(rb, sizeof rb, st->data_recv_bytes));
        pr_str(p, NULL, "Data plane", both);
        pr_uint(p, "data_sent_bytes", NULL, st->data_sent_bytes, NULL);
        pr_uint(p, "data_recv_bytes", NULL, st->data_recv_bytes, NULL);
    }
    if (st->data_endpoint)
        pr_str(p, "data_endpoint", NULL, st->data_endpoint);
    print_peers(p, st);
    print_strays(p, st);
    print_auth(p, st);
    print_last(p, st->last);
    print_optional(p, "loss", "Loss", st->has_loss, st->loss);
    if (st->has_queued_seconds_total) {
        char q[64];
        snprintf(q, sizeof q, "%.3f s (steps waiting for a busy daemon, in all)",
                 st->queued_seconds_total);
        pr_real(p, "queued_seconds_total", "Queued", st->queued_seconds_total, q);
    }
    print_totals(p, st);
    print_checkpoint(p, st->checkpoint);
    print_config(p, st);
    pr_str(p, "runtime_dir", "Runtime dir", st->runtime_dir);
}

scape_rc cmd_status(const ctl_opts *o)
{
    Scape__Reply *r = NULL;
    scape_rc rc = ctl_status(o, &r);
    if (rc != SCAPE_OK)
        return rc;
    printer p;
    pr_init(&p, stdout, o->json);
    print_status(&p, r->status_reply);
    pr_done(&p);
    scape__reply__free_unpacked(r, NULL);
    return SCAPE_OK;
}
