/* dev_sim.c - the device executor's device, modelled on the CPU (dev.h).
 *
 * Every operation is queued on its stream and nothing runs until the host
 * waits (sync).  Then the queues are drained in a random order: at each turn
 * one stream whose next operation may run is picked, at random, and runs it.
 * An operation may run when it is at the head of its stream's queue and, for
 * an event wait, once the record it refers to (the event's last record at
 * the time of the wait call, as in CUDA) has run.  So only the order the
 * caller declared holds, and the results depend on nothing else: a missing
 * wait or a host read before a sync shows as a wrong result.  Kernels are
 * the CPU versions of kernels/cpu_seg.c.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>

#include "dev.h"
#include "try.h"

typedef enum { OP_COPY, OP_ZERO, OP_RECORD, OP_WAIT, OP_LAUNCH } op_kind;

typedef struct op {
    op_kind kind;
    void *dst;
    const void *src;
    size_t bytes;
    int ev;
    uint64_t seq;          /* RECORD: its number; WAIT: the record it waits for */
    kseg_kernel k;
    void *args;            /* LAUNCH: a copy of the arguments */
} op;

typedef struct queue {
    op *ops;
    size_t head, n, cap;
} queue;

struct dev {
    queue q[DEV_STREAMS];
    uint64_t recorded[DEV_EVENTS]; /* records enqueued so far, per event */
    uint64_t done[DEV_EVENTS];     /* the last record that has run */
    uint64_t rng;
};

static uint64_t next_rand(dev_t *d)
{
    uint64_t x = d->rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return d->rng = x;
}

static scape_rc sim_create(dev_t **out, int device, void *main, comm_t *comm, int timeout_ms,
                           unsigned long seed)
{
    (void)device;
    (void)main;
    (void)comm;
    (void)timeout_ms;
    dev_t *d = calloc(1, sizeof *d);
    if (d == NULL)
        return scape_set_error(SCAPE_NOMEM, "dev sim: out of memory");
    d->rng = 0x9e3779b97f4a7c15ull ^ (uint64_t)seed;
    if (d->rng == 0)
        d->rng = 1;
    *out = d;
    return SCAPE_OK;
}

static void sim_destroy(dev_t *d)
{
    if (d == NULL)
        return;
    for (int s = 0; s < DEV_STREAMS; s++) {
        for (size_t i = d->q[s].head; i < d->q[s].n; i++)
            free(d->q[s].ops[i].args);
        free(d->q[s].ops);
    }
    free(d);
}

static scape_rc sim_alloc(dev_t *d, size_t bytes, int pinned, void **out)
{
    (void)d;
    (void)pinned;
    *out = calloc(1, bytes ? bytes : 1);
    if (*out == NULL)
        return scape_set_error(SCAPE_NOMEM, "dev sim: cannot allocate %zu bytes", bytes);
    return SCAPE_OK;
}

static void sim_release(dev_t *d, void *p, int pinned)
{
    (void)d;
    (void)pinned;
    free(p);
}

static scape_rc push(dev_t *d, int s, op o)
{
    if (s < 0 || s >= DEV_STREAMS)
        return scape_set_error(SCAPE_INVALID, "dev sim: no stream %d", s);
    queue *q = &d->q[s];
    if (q->head == q->n)
        q->head = q->n = 0;
    if (q->n == q->cap) {
        size_t cap = q->cap ? 2 * q->cap : 64;
        op *p = realloc(q->ops, cap * sizeof *p);
        if (p == NULL)
            return scape_set_error(SCAPE_NOMEM, "dev sim: out of memory");
        q->ops = p;
        q->cap = cap;
    }
    q->ops[q->n++] = o;
    return SCAPE_OK;
}

static scape_rc check_event(int ev)
{
    if (ev < 0 || ev >= DEV_EVENTS)
        return scape_set_error(SCAPE_INVALID, "dev sim: no event %d", ev);
    return SCAPE_OK;
}

static scape_rc sim_copy(dev_t *d, int s, void *dst, const void *src, size_t bytes)
{
    return bytes ? push(d, s, (op){ .kind = OP_COPY, .dst = dst, .src = src, .bytes = bytes })
                 : SCAPE_OK;
}

static scape_rc sim_zero(dev_t *d, int s, void *dst, size_t bytes)
{
    return bytes ? push(d, s, (op){ .kind = OP_ZERO, .dst = dst, .bytes = bytes }) : SCAPE_OK;
}

static scape_rc sim_record(dev_t *d, int s, int ev)
{
    TRY(check_event(ev));
    return push(d, s, (op){ .kind = OP_RECORD, .ev = ev, .seq = ++d->recorded[ev] });
}

static scape_rc sim_wait(dev_t *d, int s, int ev)
{
    TRY(check_event(ev));
    return push(d, s, (op){ .kind = OP_WAIT, .ev = ev, .seq = d->recorded[ev] });
}

static scape_rc sim_launch(dev_t *d, int s, kseg_kernel k, const void *args)
{
    size_t n = kseg_args_bytes(k);
    void *copy = malloc(n);
    if (copy == NULL)
        return scape_set_error(SCAPE_NOMEM, "dev sim: out of memory");
    memcpy(copy, args, n);
    scape_rc rc = push(d, s, (op){ .kind = OP_LAUNCH, .k = k, .args = copy });
    if (rc != SCAPE_OK)
        free(copy);
    return rc;
}

static int runnable(const dev_t *d, const op *o)
{
    return o->kind != OP_WAIT || d->done[o->ev] >= o->seq;
}

static scape_rc run(dev_t *d, op *o)
{
    scape_rc rc = SCAPE_OK;
    switch (o->kind) {
    case OP_COPY: memmove(o->dst, o->src, o->bytes); break;
    case OP_ZERO: memset(o->dst, 0, o->bytes); break;
    case OP_RECORD:
        if (o->seq > d->done[o->ev])
            d->done[o->ev] = o->seq;
        break;
    case OP_WAIT: break;
    case OP_LAUNCH:
        rc = kseg_run_cpu(o->k, o->args);
        free(o->args);
        o->args = NULL;
        break;
    }
    return rc;
}

static scape_rc sim_sync(dev_t *d)
{
    scape_rc first = SCAPE_OK;
    for (;;) {
        int ready[DEV_STREAMS], nready = 0, left = 0;
        for (int s = 0; s < DEV_STREAMS; s++) {
            queue *q = &d->q[s];
            if (q->head == q->n)
                continue;
            left = 1;
            if (runnable(d, &q->ops[q->head]))
                ready[nready++] = s;
        }
        if (!left)
            return first;
        if (nready == 0)
            return scape_set_error(SCAPE_INVALID, "dev sim: every stream waits for an event "
                                   "that is never recorded (on a GPU this would hang)");
        queue *q = &d->q[ready[next_rand(d) % (uint64_t)nready]];
        scape_rc rc = run(d, &q->ops[q->head++]);
        if (rc != SCAPE_OK && first == SCAPE_OK)
            first = rc;
    }
}

static double sim_elapsed(dev_t *d, int ev0, int ev1)
{
    (void)d;
    (void)ev0;
    (void)ev1;
    return -1.0;
}

static scape_rc sim_resolve(dev_t *d, const void *p, size_t bytes, const void **out,
                           int *on_host)
{
    (void)d;
    (void)bytes;
    *out = p;
    *on_host = 0; /* the model's trainers are on the "device" */
    return SCAPE_OK;
}

const dev_ops dev_sim_ops = {
    .name = "sim",
    .host_addressable = 1,
    .create = sim_create,
    .destroy = sim_destroy,
    .alloc = sim_alloc,
    .release = sim_release,
    .copy = sim_copy,
    .zero = sim_zero,
    .record = sim_record,
    .wait = sim_wait,
    .launch = sim_launch,
    .sync = sim_sync,
    .elapsed = sim_elapsed,
    .resolve = sim_resolve,
};
