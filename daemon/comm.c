/* comm.c - argument checks and byte/call counting around the backend table,
 * and the stop request the backends' waits consult. */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <time.h>

#include "comm.h"

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
    rc = c->ops->allreduce_sum(c, buf, n, bf16);
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
    rc = c->ops->reduce_scatter_sum(c, send, recv, counts, bf16);
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
    rc = c->ops->allgather(c, send, recv, counts);
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
    rc = c->ops->iallgather(c, send, recv, counts);
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
    return c->ops->iallgather_wait(c);
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
    rc = c->ops->broadcast(c, buf, bytes, root);
    if (rc == SCAPE_OK)
        count(c, COMM_BROADCAST, bytes, c->rank == root ? 0 : bytes);
    return rc;
}

scape_rc comm_barrier(comm_t *c)
{
    scape_rc rc = check_comm("comm_barrier", c);
    if (rc != SCAPE_OK)
        return rc;
    rc = c->ops->barrier(c);
    if (rc == SCAPE_OK)
        count(c, COMM_BARRIER, 0, 0);
    return rc;
}

static int (*s_interrupt)(void);
static long long s_stop_seen_ms;  /* when a wait first saw the request; 0: not yet */
static long long s_progress_ms;   /* the last comm_progress() */

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

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
    return c && c->ops && c->ops->device_sync ? c->ops->device_sync(c) : SCAPE_OK;
}
