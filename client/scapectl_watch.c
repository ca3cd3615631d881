/* scapectl_watch.c - `scapectl watch`: one update every --interval-ms, from a
 * status request (state, trainers) and the newest Metrics the daemon
 * published on its events socket (the freshest step figures).  On a
 * terminal each update redraws the screen; otherwise it is one line (or one
 * JSON object with --json), so the output can be logged and parsed. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "scapectl.h"

typedef struct watch {
    const ctl_opts *o;
    void *sub;
    Scape__Metrics *event;  /* the newest event, or NULL */
    int tty;
    int have_prev;          /* prev_* hold the previous update */
    uint64_t prev_step;
    int64_t prev_ms;
} watch;

static void on_sigint(int sig)
{
    (void)sig;
    ctl_interrupted = 1;
}

/* SIGINT without SA_RESTART, so that a wait in zmq_poll returns. */
static scape_rc catch_sigint(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    if (sigemptyset(&sa.sa_mask) != 0 || sigaction(SIGINT, &sa, NULL) != 0)
        return scape_set_error(SCAPE_SYSTEM, "sigaction(SIGINT): %s", strerror(errno));
    return SCAPE_OK;
}

static scape_rc subscribe(watch *w)
{
    scape_rc rc = ctl_connect(w->o, ZMQ_SUB, w->o->events_ep, &w->sub);
    if (rc == SCAPE_OK && zmq_setsockopt(w->sub, ZMQ_SUBSCRIBE, "", 0) != 0)
        rc = scape_set_error(SCAPE_ZMQ, "subscribe to %s: %s", w->o->events_ep,
                             zmq_strerror(zmq_errno()));
    return rc;
}

/* Take one waiting event, keeping it if it is newer than the one held. */
static scape_rc take_event(watch *w)
{
    zmq_msg_t msg;
    if (zmq_msg_init(&msg) != 0)
        return scape_set_error(SCAPE_ZMQ, "zmq_msg_init: %s", zmq_strerror(zmq_errno()));
    if (zmq_msg_recv(&msg, w->sub, ZMQ_DONTWAIT) < 0) {
        int e = zmq_errno();
        zmq_msg_close(&msg); /* cannot fail on an initialised message */
        return e == EAGAIN ? SCAPE_OK
                           : scape_set_error(SCAPE_ZMQ, "receive from %s: %s",
                                             w->o->events_ep, zmq_strerror(e));
    }
    Scape__Metrics *m = scape__metrics__unpack(NULL, zmq_msg_size(&msg), zmq_msg_data(&msg));
    size_t n = zmq_msg_size(&msg);
    zmq_msg_close(&msg);
    if (m == NULL)
        return scape_set_error(SCAPE_PROTO, "undecodable event (%zu bytes) from %s", n,
                               w->o->events_ep);
    if (w->event != NULL)
        scape__metrics__free_unpacked(w->event, NULL);
    w->event = m;
    return SCAPE_OK;
}

/* Absorb events until deadline_ms. */
static scape_rc absorb_events(watch *w, int64_t deadline_ms)
{
    for (;;) {
        int ready = 0;
        scape_rc rc = ctl_wait(w->sub, deadline_ms, &ready);
        if (rc != SCAPE_OK || !ready)
            return rc;
        if ((rc = take_event(w)) != SCAPE_OK)
            return rc;
    }
}

/* The newest step figures and their loss: the event's, unless the status
 * reply has seen a later step. */
static const Scape__StepDone *newest(const watch *w, const Scape__StatusReply *st,
                                     int *has_loss, double *loss)
{
    const Scape__StepDone *d = st->last;
    *has_loss = st->has_loss;
    *loss = st->loss;
    if (w->event != NULL && (d == NULL || w->event->step->step > d->step)) {
        d = w->event->step;
        *has_loss = w->event->has_loss;
        *loss = w->event->loss;
    }
    return d;
}

static void print_rate(watch *w, printer *p, uint64_t step)
{
    int64_t now = ctl_now_ms();
    char b[32];
    if (w->have_prev && now > w->prev_ms && step >= w->prev_step) {
        double rate = 1e3 * (double)(step - w->prev_step) / (double)(now - w->prev_ms);
        snprintf(b, sizeof b, "%.1f", rate);
        pr_real(p, "steps_per_s", "steps/s", rate, b);
    } else {
        pr_null(p, "steps_per_s", "steps/s");
    }
    w->have_prev = 1;
    w->prev_step = step;
    w->prev_ms = now;
}

static void print_step(printer *p, const Scape__StepDone *d, int has_loss, double loss)
{
    char b[32];
    if (has_loss)
        pr_real(p, "loss", "loss", loss, NULL);
    else
        pr_null(p, "loss", "loss");
    if (d == NULL) {
        const char *const keys[][2] = { { "k", "K" }, { "density", "density" },
                                        { "bytes", "bytes/step" }, { "step_s", "step time" } };
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
            pr_null(p, keys[i][0], keys[i][1]);
        return;
    }
    pr_uint(p, "k", "K", d->k, NULL);
    pr_real(p, "density", "density", d->density, fmt_percent(b, sizeof b, d->density));
    pr_uint(p, "bytes", "bytes/step", d->bytes, fmt_bytes(b, sizeof b, d->bytes));
    if (d->phases->has_total)
        pr_real(p, "step_s", "step time", d->phases->total, fmt_ms(b, sizeof b, d->phases->total));
    else
        pr_null(p, "step_s", "step time");
}

/* The wall-clock time of an update, for the line and the JSON. */
static const char *timestamp(char *buf, size_t len)
{
    struct tm tm;
    time_t now = time(NULL);
    if (localtime_r(&now, &tm) == NULL || strftime(buf, len, "%Y-%m-%dT%H:%M:%S", &tm) == 0)
        snprintf(buf, len, "%lld", (long long)now);
    return buf;
}

static void render(watch *w, const Scape__StatusReply *st)
{
    int has_loss = 0, line = !w->tty && !w->o->json;
    double loss = 0;
    const Scape__StepDone *d = newest(w, st, &has_loss, &loss);
    uint64_t step = d != NULL && d->step > st->step ? d->step : st->step;
    char when[32];
    printer p;
    timestamp(when, sizeof when);
    if (w->tty && !w->o->json)
        printf("\033[H\033[2Jscapectl watch  %s  every %d ms  (Ctrl-C quits)\n\n",
               w->o->status_ep, w->o->interval_ms);
    pr_init(&p, stdout, w->o->json);
    pr_str(&p, "time", line ? NULL : "time", when);
    if (line)
        pr_row(&p, NULL, when);
    pr_uint(&p, "step", "step", step, NULL);
    pr_str(&p, "state", "state", st->state);
    print_step(&p, d, has_loss, loss);
    print_rate(w, &p, step);
    pr_uint(&p, "trainers", "trainers", st->n_trainers, NULL);
    pr_waiting(&p, "waiting for", st);
    if (line)
        pr_close(&p);
    pr_done(&p);
}

static scape_rc update(watch *w)
{
    Scape__Reply *r = NULL;
    scape_rc rc = ctl_status(w->o, &r);
    if (rc != SCAPE_OK)
        return rc;
    render(w, r->status_reply);
    scape__reply__free_unpacked(r, NULL);
    if (fflush(stdout) != 0 || ferror(stdout))
        return scape_set_error(SCAPE_SYSTEM, "writing the update: %s", strerror(errno));
    return SCAPE_OK;
}

static scape_rc run(watch *w)
{
    int64_t next = ctl_now_ms();
    scape_rc rc = catch_sigint();
    if (rc == SCAPE_OK)
        rc = subscribe(w);
    for (long n = 0; rc == SCAPE_OK && !ctl_interrupted && (w->o->count == 0 || n < w->o->count);
         n++) {
        if (n > 0)
            rc = absorb_events(w, next);
        if (rc == SCAPE_OK && !ctl_interrupted)
            rc = update(w);
        next += w->o->interval_ms;
    }
    return rc;
}

scape_rc cmd_watch(const ctl_opts *o)
{
    watch w = { .o = o, .tty = isatty(STDOUT_FILENO) };
    scape_rc rc = run(&w);
    if (ctl_interrupted) {
        rc = SCAPE_OK; /* Ctrl-C is how a watch ends */
        scape_clear_error();
    }
    if (w.event != NULL)
        scape__metrics__free_unpacked(w.event, NULL);
    return ctl_close(&w.sub, rc);
}
