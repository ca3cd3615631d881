/* comm_local.c - the `local` comm backend: R ranks as threads of one process.
 *
 * Every collective is post -> barrier -> read the peers' buffers -> barrier:
 * each rank publishes a pointer to its input, and nobody reuses an input until
 * the second barrier says every peer has finished reading it.  A rank writes
 * only the parts of its own buffers that no peer reads in that phase.
 * A barrier that waits longer than LOCAL_TIMEOUT_S names the missing ranks.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm.h"

#define LOCAL_TIMEOUT_MS 120000

typedef struct local_group {
    int nranks;
    int timeout_ms;          /* longest wait at a barrier */
    int refs;                /* handles not yet destroyed */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;             /* ranks at the current barrier */
    uint64_t generation;
    unsigned char *present;  /* per rank: arrived at the current barrier */
    const void **slot;       /* per rank: the posted input */
    void **stage;            /* per rank: copy of its iallgather input */
} local_group;

typedef struct local_rank {
    local_group *g;
    size_t stage_cap;
    void *ag_recv;           /* outstanding iallgather */
    size_t *ag_counts;
} local_rank;

static scape_rc grow(void **p, size_t *cap, size_t bytes)
{
    if (bytes <= *cap)
        return SCAPE_OK;
    void *q = realloc(*p, bytes);
    if (q == NULL)
        return scape_set_error(SCAPE_NOMEM, "comm local: cannot allocate %zu bytes", bytes);
    *p = q;
    *cap = bytes;
    return SCAPE_OK;
}

static scape_rc missing_ranks(local_group *g)
{
    char list[256] = "";
    size_t used = 0;
    for (int r = 0; r < g->nranks && used < sizeof list - 8; r++)
        if (!g->present[r])
            used += (size_t)snprintf(list + used, sizeof list - used, " %d", r);
    return scape_set_error(SCAPE_TIMEOUT,
                           "comm local: barrier timed out after %d ms; missing rank(s):%s",
                           g->timeout_ms, list);
}

static scape_rc barrier(comm_t *c)
{
    local_group *g = ((local_rank *)c->impl)->g;
    scape_rc rc = SCAPE_OK;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += g->timeout_ms / 1000;
    deadline.tv_nsec += (long)(g->timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }

    pthread_mutex_lock(&g->mu);
    uint64_t gen = g->generation;
    g->present[c->rank] = 1;
    if (++g->arrived == g->nranks) {
        g->arrived = 0;
        memset(g->present, 0, (size_t)g->nranks);
        g->generation++;
        pthread_cond_broadcast(&g->cv);
    } else {
        while (g->generation == gen) {
            int e = pthread_cond_timedwait(&g->cv, &g->mu, &deadline);
            if (e == ETIMEDOUT && g->generation == gen) {
                rc = missing_ranks(g);
                g->present[c->rank] = 0;
                g->arrived--;
                break;
            }
        }
    }
    pthread_mutex_unlock(&g->mu);
    return rc;
}

/* Publish this rank's input and wait until every rank has published. */
static scape_rc post(comm_t *c, const void *p)
{
    local_group *g = ((local_rank *)c->impl)->g;
    g->slot[c->rank] = p;
    return barrier(c);
}

/* out = sum over ranks (in rank order) of slot[q][off .. off+n).  out may be
 * this rank's own segment of its input (in place): each chunk is summed
 * aside before it is written. */
static void sum_slots(local_group *g, size_t off, size_t n, float *out)
{
    float acc[1024];
    for (size_t c = 0; c < n; c += 1024) {
        size_t len = n - c < 1024 ? n - c : 1024;
        memcpy(acc, (const float *)g->slot[0] + off + c, len * sizeof *acc);
        for (int q = 1; q < g->nranks; q++) {
            const float *s = (const float *)g->slot[q] + off + c;
            for (size_t i = 0; i < len; i++)
                acc[i] += s[i];
        }
        memcpy(out + c, acc, len * sizeof *acc);
    }
}

/* In place and without scratch: each rank sums its 1/R of the vector into
 * its own buffer (nobody else reads that part of it), then copies the other
 * parts from their owners.  The sums are in rank order, as reduce-scatter's. */
static scape_rc allreduce_sum(comm_t *c, float *buf, size_t n, int bf16)
{
    (void)bf16; /* bf16 inputs are exact in fp32: the same sums */
    local_group *g = ((local_rank *)c->impl)->g;
    size_t per = (n + (size_t)g->nranks - 1) / (size_t)g->nranks;
    scape_rc rc = post(c, buf);
    if (rc != SCAPE_OK)
        return rc;
    size_t off = per * (size_t)c->rank < n ? per * (size_t)c->rank : n;
    sum_slots(g, off, n - off < per ? n - off : per, buf + off);
    rc = barrier(c);
    for (int q = 0; rc == SCAPE_OK && q < g->nranks; q++) {
        size_t qoff = per * (size_t)q < n ? per * (size_t)q : n;
        size_t qlen = n - qoff < per ? n - qoff : per;
        if (q != c->rank && qlen)
            memcpy(buf + qoff, (const float *)g->slot[q] + qoff, qlen * sizeof *buf);
    }
    return rc == SCAPE_OK ? barrier(c) : rc;
}

static scape_rc reduce_scatter_sum(comm_t *c, const float *send, float *recv,
                                   const size_t *counts, int bf16)
{
    (void)bf16;
    size_t off = 0;
    for (int r = 0; r < c->rank; r++)
        off += counts[r];
    scape_rc rc = post(c, send);
    if (rc != SCAPE_OK)
        return rc;
    if (counts[c->rank])
        sum_slots(((local_rank *)c->impl)->g, off, counts[c->rank], recv);
    return barrier(c);
}

/* recv = concatenation of src[q] (counts[q] bytes each). */
static void gather_from(local_group *g, const void *const *src, void *recv,
                        const size_t *counts)
{
    size_t off = 0;
    for (int q = 0; q < g->nranks; q++) {
        /* in place: a rank's own part may already sit where it belongs */
        if (counts[q] && (const char *)src[q] != (char *)recv + off)
            memcpy((char *)recv + off, src[q], counts[q]);
        off += counts[q];
    }
}

static scape_rc allgather(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    local_group *g = ((local_rank *)c->impl)->g;
    scape_rc rc = post(c, send);
    if (rc != SCAPE_OK)
        return rc;
    gather_from(g, g->slot, recv, counts);
    return barrier(c);
}

static scape_rc iallgather(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    local_rank *lr = c->impl;
    local_group *g = lr->g;
    size_t mine = counts[c->rank];
    scape_rc rc = grow(&g->stage[c->rank], &lr->stage_cap, mine ? mine : 1);
    if (rc != SCAPE_OK)
        return rc;
    if (mine)
        memcpy(g->stage[c->rank], send, mine);
    memcpy(lr->ag_counts, counts, (size_t)c->size * sizeof *counts);
    lr->ag_recv = recv;
    return SCAPE_OK;
}

static scape_rc iallgather_wait(comm_t *c)
{
    local_rank *lr = c->impl;
    scape_rc rc = barrier(c);
    if (rc != SCAPE_OK)
        return rc;
    gather_from(lr->g, (const void *const *)lr->g->stage, lr->ag_recv, lr->ag_counts);
    return barrier(c);
}

static scape_rc broadcast(comm_t *c, void *buf, size_t bytes, int root)
{
    local_group *g = ((local_rank *)c->impl)->g;
    scape_rc rc = post(c, buf);
    if (rc != SCAPE_OK)
        return rc;
    if (c->rank != root && bytes)
        memcpy(buf, g->slot[root], bytes);
    return barrier(c);
}

static void group_free(local_group *g)
{
    for (int r = 0; r < g->nranks; r++)
        free(g->stage[r]);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g->present);
    free(g->slot);
    free(g->stage);
    free(g);
}

static void group_release(local_group *g)
{
    pthread_mutex_lock(&g->mu);
    int last = --g->refs == 0;
    pthread_mutex_unlock(&g->mu);
    if (last)
        group_free(g);
}

static void destroy(comm_t *c)
{
    local_rank *lr = c->impl;
    group_release(lr->g);
    free(lr->ag_counts);
    free(lr);
    free(c);
}

/* bf16 reductions always go in 16 bits a value. */
static int always_bf16(const comm_t *c, const void *buf)
{
    (void)c;
    (void)buf;
    return 1;
}

static const comm_ops s_local_ops = {
    .name = "local",
    .allreduce_sum = allreduce_sum,
    .reduce_scatter_sum = reduce_scatter_sum,
    .wire_bf16 = always_bf16, /* modelled: the same sums, counted at 16 bits */
    .allgather = allgather,
    .iallgather = iallgather,
    .iallgather_wait = iallgather_wait,
    .broadcast = broadcast,
    .barrier = barrier,
    .destroy = destroy,
};

static scape_rc group_new(int nranks, int timeout_ms, local_group **out)
{
    local_group *g = calloc(1, sizeof *g);
    if (g == NULL)
        return scape_set_error(SCAPE_NOMEM, "comm local: out of memory");
    g->nranks = nranks;
    g->timeout_ms = timeout_ms;
    g->present = calloc((size_t)nranks, 1);
    g->slot = calloc((size_t)nranks, sizeof *g->slot);
    g->stage = calloc((size_t)nranks, sizeof *g->stage);
    if (!g->present || !g->slot || !g->stage ||
        pthread_mutex_init(&g->mu, NULL) != 0) {
        free(g->present);
        free(g->slot);
        free(g->stage);
        free(g);
        return scape_set_error(SCAPE_NOMEM, "comm local: out of memory");
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_cond_init(&g->cv, &ca);
    pthread_condattr_destroy(&ca);
    *out = g;
    return SCAPE_OK;
}

scape_rc comm_local_create(int nranks, comm_t **comms)
{
    return comm_local_create_timeout(nranks, LOCAL_TIMEOUT_MS, comms);
}

scape_rc comm_local_create_timeout(int nranks, int timeout_ms, comm_t **comms)
{
    if (comms == NULL)
        return scape_set_error(SCAPE_INVALID, "comm_local_create: comms is NULL");
    if (nranks < 1 || nranks > 4096)
        return scape_set_error(SCAPE_INVALID,
                               "comm_local_create: nranks=%d not in [1,4096]", nranks);
    if (timeout_ms < 1)
        return scape_set_error(SCAPE_INVALID,
                               "comm_local_create: timeout_ms=%d must be >= 1", timeout_ms);
    local_group *g = NULL;
    scape_rc rc = group_new(nranks, timeout_ms, &g);
    if (rc != SCAPE_OK)
        return rc;
    for (int r = 0; r < nranks; r++) {
        comm_t *c = calloc(1, sizeof *c);
        local_rank *lr = calloc(1, sizeof *lr);
        size_t *agc = calloc((size_t)nranks, sizeof *agc);
        if (!c || !lr || !agc) {
            free(c);
            free(lr);
            free(agc);
            for (int q = 0; q < r; q++)
                comm_destroy(&comms[q]);
            if (r == 0)
                group_free(g);
            return scape_set_error(SCAPE_NOMEM, "comm_local_create: out of memory");
        }
        lr->g = g;
        lr->ag_counts = agc;
        c->ops = &s_local_ops;
        c->rank = r;
        c->size = nranks;
        c->impl = lr;
        g->refs++;
        comms[r] = c;
    }
    return SCAPE_OK;
}
