/* comm.c - argument checks and byte/call counting around the backend table,
 * and the stop request the backends' waits consult. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdlib.h>
#include <time.h>
#include <zmq.h>

#include "comm.h"

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The collective that runs, for comm_waiting (status during a wait). */
static void busy(comm_t *c, const char *op)
{
    c->busy_op = op;
    c->busy_since_ms = mono_ms();
}

static scape_rc done(comm_t *c, scape_rc rc)
{
    c->busy_op = NULL;
    return rc;
}

const char *comm_op_name(comm_op op)
{
    static const char *const names[COMM_OP_COUNT] = {
        [COMM_ALLREDUCE] = "allreduce",   [COMM_REDUCE_SCATTER] = "reduce_scatter",
        [COMM_ALLGATHER] = "allgather",   [COMM_IALLGATHER] = "iallgather",
        [COMM_BROADCAST] = "broadcast",   [COMM_BARRIER] = "barrier",
    };
    return (unsigned)op < COMM_OP_COUNT ? names[op] : "?";
}

static scape_rc check_comm(const char *fn, const comm_t *c)
{
    if (c == NULL || c->ops == NULL)
        return scape_set_error(SCAPE_INVALID, "%s: comm is NULL", fn);
    return SCAPE_OK;
}

static uint64_t sum_counts(const size_t *counts, int n)
{
    uint64_t s = 0;
    for (int r = 0; r < n; r++)
        s += counts[r];
    return s;
}

static void count(comm_t *c, comm_op op, uint64_t bytes, uint64_t wire)
{
    c->stats.calls[op]++;
    c->stats.bytes[op] += bytes;
    c->stats.wire_bytes[op] += wire;
}

scape_rc comm_allreduce_sum_wire(comm_t *c, float *buf, size_t n, int bf16)
{
    scape_rc rc = check_comm("comm_allreduce_sum", c);
    if (rc != SCAPE_OK)
        return rc;
    if (buf == NULL && n > 0)
        return scape_set_error(SCAPE_INVALID, "comm_allreduce_sum: buf is NULL");
    bf16 = bf16 && c->ops->wire_bf16 && c->ops->wire_bf16(c, buf);
    busy(c, comm_op_name(COMM_ALLREDUCE));
    rc = done(c, c->ops->allreduce_sum(c, buf, n, bf16));
    if (rc == SCAPE_OK) {
        /* a reduce-scatter of the inputs and an all-gather of the fp32 sums,
         * (R-1)/R of each per rank */
        uint64_t in = (uint64_t)n * (bf16 ? 2 : 4), R = (uint64_t)c->size;
        count(c, COMM_ALLREDUCE, in, (in + (uint64_t)n * 4) * (R - 1) / R);
    }
    return rc;
}

scape_rc comm_allreduce_sum(comm_t *c, float *buf, size_t n)
{
    return comm_allreduce_sum_wire(c, buf, n, 0);
}

scape_rc comm_reduce_scatter_sum_wire(comm_t *c, const float *send, float *recv,
                                      const size_t *counts, int bf16)
{
    scape_rc rc = check_comm("comm_reduce_scatter_sum", c);
    if (rc != SCAPE_OK)
        return rc;
    if (counts == NULL)
        return scape_set_error(SCAPE_INVALID, "comm_reduce_scatter_sum: counts is NULL");
    bf16 = bf16 && c->ops->wire_bf16 && c->ops->wire_bf16(c, send);
    uint64_t total = sum_counts(counts, c->size), esz = bf16 ? 2 : 4;
    if ((send == NULL && total > 0) || (recv == NULL && counts[c->rank] > 0))
        return scape_set_error(SCAPE_INVALID, "comm_reduce_scatter_sum: NULL buffer");
    busy(c, comm_op_name(COMM_REDUCE_SCATTER));
    rc = done(c, c->ops->reduce_scatter_sum(c, send, recv, counts, bf16));
    /* In a ring reduce-scatter that leaves segment r on rank r, a rank
     * receives a partial sum of every segment but its predecessor's, where
     * that segment's chain starts. */
    if (rc == SCAPE_OK)
        count(c, COMM_REDUCE_SCATTER, total * esz,
              (total - counts[(c->rank + c->size - 1) % c->size]) * esz);
    return rc;
}

scape_rc comm_reduce_scatter_sum(comm_t *c, const float *send, float *recv,
                                 const size_t *counts)
{
    return comm_reduce_scatter_sum_wire(c, send, recv, counts, 0);
}

static scape_rc check_gather(const char *fn, const comm_t *c, const void *send,
                             const void *recv, const size_t *counts)
{
    scape_rc rc = check_comm(fn, c);
    if (rc != SCAPE_OK)
        return rc;
    if (counts == NULL)
        return scape_set_error(SCAPE_INVALID, "%s: counts is NULL", fn);
    if ((send == NULL && counts[c->rank] > 0) ||
        (recv == NULL && sum_counts(counts, c->size) > 0))
        return scape_set_error(SCAPE_INVALID, "%s: NULL buffer", fn);
    return SCAPE_OK;
}

scape_rc comm_allgather(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    scape_rc rc = check_gather("comm_allgather", c, send, recv, counts);
    if (rc != SCAPE_OK)
        return rc;
    busy(c, comm_op_name(COMM_ALLGATHER));
    rc = done(c, c->ops->allgather(c, send, recv, counts));
    if (rc == SCAPE_OK) {
        uint64_t total = sum_counts(counts, c->size);
        count(c, COMM_ALLGATHER, total, total - counts[c->rank]);
    }
    return rc;
}

scape_rc comm_iallgather(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    scape_rc rc = check_gather("comm_iallgather", c, send, recv, counts);
    if (rc != SCAPE_OK)
        return rc;
    if (c->pending)
        return scape_set_error(SCAPE_INVALID,
                               "comm_iallgather: one is already outstanding");
    busy(c, comm_op_name(COMM_IALLGATHER));
    rc = done(c, c->ops->iallgather(c, send, recv, counts));
    if (rc == SCAPE_OK) {
        uint64_t total = sum_counts(counts, c->size);
        count(c, COMM_IALLGATHER, total, total - counts[c->rank]);
        c->pending = 1;
    }
    return rc;
}

scape_rc comm_iallgather_wait(comm_t *c)
{
    scape_rc rc = check_comm("comm_iallgather_wait", c);
    if (rc != SCAPE_OK)
        return rc;
    if (!c->pending)
        return scape_set_error(SCAPE_INVALID,
                               "comm_iallgather_wait: nothing outstanding");
    c->pending = 0;
    busy(c, comm_op_name(COMM_IALLGATHER));
    return done(c, c->ops->iallgather_wait(c));
}

scape_rc comm_broadcast(comm_t *c, void *buf, size_t bytes, int root)
{
    scape_rc rc = check_comm("comm_broadcast", c);
    if (rc != SCAPE_OK)
        return rc;
    if (root < 0 || root >= c->size)
        return scape_set_error(SCAPE_INVALID, "comm_broadcast: root %d not in [0,%d)",
                               root, c->size);
    if (buf == NULL && bytes > 0)
        return scape_set_error(SCAPE_INVALID, "comm_broadcast: buf is NULL");
    busy(c, comm_op_name(COMM_BROADCAST));
    rc = done(c, c->ops->broadcast(c, buf, bytes, root));
    if (rc == SCAPE_OK)
        count(c, COMM_BROADCAST, bytes, c->rank == root ? 0 : bytes);
    return rc;
}

scape_rc comm_barrier(comm_t *c)
{
    scape_rc rc = check_comm("comm_barrier", c);
    if (rc != SCAPE_OK)
        return rc;
    busy(c, comm_op_name(COMM_BARRIER));
    rc = done(c, c->ops->barrier(c));
    if (rc == SCAPE_OK)
        count(c, COMM_BARRIER, 0, 0);
    return rc;
}

static int (*s_interrupt)(void);
static long long s_stop_seen_ms;  /* when a wait first saw the request; 0: not yet */
static long long s_progress_ms;   /* the last comm_progress() */

void comm_set_interrupt(int (*check)(void))
{
    s_interrupt = check;
    s_stop_seen_ms = 0;
}

/* Only progress after the request counts: before it, no clock read on the
 * backends' per-message path. */
void comm_progress(void)
{
    if (s_stop_seen_ms != 0)
        s_progress_ms = mono_ms();
}

/* A stop request ends a wait only once the wait has gone COMM_STOP_GRACE_MS
 * without progress since the request: a step whose peers are all there
 * finishes, one waiting for a peer that never comes is given up. */
int comm_interrupted(void)
{
    if (s_interrupt == NULL || !s_interrupt())
        return 0;
    long long now = mono_ms();
    if (s_stop_seen_ms == 0)
        s_stop_seen_ms = now;
    long long since = s_progress_ms > s_stop_seen_ms ? s_progress_ms : s_stop_seen_ms;
    return now - since >= COMM_STOP_GRACE_MS;
}

uint64_t comm_device_bytes(const comm_t *c)
{
    return c && c->ops && c->ops->device_bytes ? c->ops->device_bytes(c) : 0;
}

int comm_quiet(const comm_t *c)
{
    return c == NULL || c->ops == NULL || c->ops->quiet == NULL || c->ops->quiet(c);
}

int comm_data_bytes(const comm_t *c, uint64_t *sent, uint64_t *recvd)
{
    *sent = *recvd = 0;
    if (c == NULL || c->ops == NULL || c->ops->data_bytes == NULL)
        return 0;
    c->ops->data_bytes(c, sent, recvd);
    return 1;
}

int comm_peers_up(const comm_t *c, int *down, int cap, int *ndown)
{
    *ndown = 0;
    return c && c->ops && c->ops->peers_up ? c->ops->peers_up(c, down, cap, ndown) : -1;
}

int comm_gone(const comm_t *c, long long *down_ms)
{
    *down_ms = 0;
    return c && c->ops && c->ops->gone ? c->ops->gone(c, down_ms) : -1;
}

uint64_t comm_foreign(const comm_t *c, char *why, size_t len)
{
    if (why && len)
        why[0] = '\0';
    return c && c->ops && c->ops->foreign ? c->ops->foreign(c, why, len) : 0;
}

uint64_t comm_refused(const comm_t *c, char *why, size_t len)
{
    if (why && len)
        why[0] = '\0';
    return c && c->ops && c->ops->refused ? c->ops->refused(c, why, len) : 0;
}

void comm_destroy(comm_t **c)
{
    if (c == NULL || *c == NULL)
        return;
    (*c)->ops->destroy(*c);
    *c = NULL;
}

void *comm_device_stream(const comm_t *c)
{
    return c && c->ops && c->ops->device_stream ? c->ops->device_stream(c) : NULL;
}

scape_rc comm_device_sync(comm_t *c)
{
    if (c == NULL || c->ops == NULL || c->ops->device_sync == NULL)
        return SCAPE_OK;
    busy(c, "device_sync");
    return done(c, c->ops->device_sync(c));
}

static comm_wait_fn s_wait_fn;
static void *s_wait_arg;
static int s_serving;           /* inside the hook: what it serves waits on nothing */
static long long s_served_ms;   /* comm_wait_serve's last turn */

void comm_set_wait_hook(comm_wait_fn fn, void *arg)
{
    s_wait_fn = fn;
    s_wait_arg = arg;
}

int comm_wait_poll(void *sock, long timeout_ms)
{
    if (s_wait_fn != NULL && !s_serving) {
        s_serving = 1;
        int r = s_wait_fn(s_wait_arg, sock, timeout_ms);
        s_serving = 0;
        return r;
    }
    zmq_pollitem_t it = { sock, 0, ZMQ_POLLIN, 0 };
    if (sock != NULL)
        return zmq_poll(&it, 1, timeout_ms) < 0 ? -1 : (it.revents & ZMQ_POLLIN) != 0;
    struct timespec ts = { timeout_ms / 1000, (timeout_ms % 1000) * 1000000L };
    return nanosleep(&ts, NULL) == 0 || errno == EINTR ? 0 : -1;
}

void comm_wait_serve(void)
{
    if (s_wait_fn == NULL || s_serving)
        return;
    long long now = mono_ms();
    if (now - s_served_ms < COMM_SERVE_MS)
        return;
    s_served_ms = now;
    comm_wait_poll(NULL, 0);
}

int comm_waiting(const comm_t *c, const char **op, double *seconds, int *ranks, int cap,
                 int *nranks)
{
    *op = NULL;
    *seconds = 0.0;
    *nranks = -1;
    if (c == NULL || c->ops == NULL || c->busy_op == NULL)
        return 0;
    *op = c->busy_op;
    *seconds = 1e-3 * (double)(mono_ms() - c->busy_since_ms);
    if (c->ops->waiting_for)
        *nranks = c->ops->waiting_for(c, ranks, cap);
    return 1;
}
