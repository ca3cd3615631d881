/* comm_nccl.c - the `nccl` backend (see comm_nccl.h).  Built when CUDA and
 * NCCL are found; comm_nccl_none.c stands in otherwise.
 *
 * The communicators are non-blocking (ncclConfig_t.blocking = 0), so no call
 * can hang the daemon: every NCCL call that answers ncclInProgress, and every
 * stream, is polled with a deadline, and past it the communicator is aborted
 * and the operation fails with SCAPE_TIMEOUT.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "comm_nccl.h"

_Static_assert(sizeof(ncclUniqueId) == COMM_NCCL_ID_BYTES, "ncclUniqueId size");

typedef struct lane {
    ncclComm_t comm;
    cudaStream_t stream;
    void *dev;            /* staging in device memory */
    size_t dev_cap;
    void *pinned;         /* staging in pinned host memory */
    size_t pinned_cap;
    int aborted;
} lane;

typedef struct nccl_impl {
    int device;
    int timeout_ms;
    lane main, mask;
    void *mask_recv;      /* where the outstanding all-gather's result goes */
    size_t mask_bytes;
} nccl_impl;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

static void nap(void)
{
    nanosleep(&(struct timespec){ 0, 20000 }, NULL);
}

#define CUDA_TRY(call)                                                         \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess)                                                 \
            return scape_set_error(SCAPE_CUDA, "comm nccl: %s: %s", #call,     \
                                   cudaGetErrorString(e_));                    \
    } while (0)

/* Wait until the lane's communicator has no call in progress. */
static scape_rc settle(nccl_impl *n, lane *l, ncclResult_t r, const char *what)
{
    double deadline = now_ms() + n->timeout_ms;
    while (r == ncclInProgress) {
        if (now_ms() > deadline) {
            ncclCommAbort(l->comm);
            l->aborted = 1;
            return scape_set_error(SCAPE_TIMEOUT, "comm nccl: %s did not finish within %d ms "
                                   "(a peer is gone?); the communicator was aborted", what,
                                   n->timeout_ms);
        }
        nap();
        if (ncclCommGetAsyncError(l->comm, &r) != ncclSuccess)
            break;
    }
    if (r != ncclSuccess)
        return scape_set_error(SCAPE_NCCL, "comm nccl: %s: %s (%s)", what,
                               ncclGetErrorString(r), ncclGetLastError(l->comm));
    return SCAPE_OK;
}

#define NCCL_TRY(n, l, call, what) TRY_RC(settle((n), (l), (call), (what)))
#define TRY_RC(x)                                                              \
    do {                                                                       \
        scape_rc rc_ = (x);                                                    \
        if (rc_ != SCAPE_OK)                                                   \
            return rc_;                                                        \
    } while (0)

/* Wait for the lane's stream, watching the communicator for errors. */
static scape_rc drain(nccl_impl *n, lane *l, const char *what)
{
    double deadline = now_ms() + n->timeout_ms;
    for (;;) {
        cudaError_t e = cudaStreamQuery(l->stream);
        if (e == cudaSuccess)
            return SCAPE_OK;
        if (e != cudaErrorNotReady)
            return scape_set_error(SCAPE_CUDA, "comm nccl: %s: %s", what, cudaGetErrorString(e));
        ncclResult_t r = ncclSuccess;
        ncclCommGetAsyncError(l->comm, &r);
        if (r != ncclSuccess && r != ncclInProgress)
            return scape_set_error(SCAPE_NCCL, "comm nccl: %s: %s", what, ncclGetErrorString(r));
        if (now_ms() > deadline) {
            ncclCommAbort(l->comm);
            l->aborted = 1;
            return scape_set_error(SCAPE_TIMEOUT, "comm nccl: %s did not complete within %d ms "
                                   "(a peer is gone?); the communicator was aborted", what,
                                   n->timeout_ms);
        }
        nap();
    }
}

static scape_rc usable(const lane *l)
{
    if (l->aborted)
        return scape_set_error(SCAPE_NCCL, "comm nccl: the communicator was aborted after an "
                               "earlier failure; restart the job from a checkpoint");
    return SCAPE_OK;
}

static scape_rc grow(lane *l, size_t dev_bytes, size_t pinned_bytes)
{
    if (dev_bytes > l->dev_cap) {
        if (l->dev)
            cudaFree(l->dev);
        l->dev = NULL;
        l->dev_cap = 0;
        CUDA_TRY(cudaMalloc(&l->dev, dev_bytes));
        l->dev_cap = dev_bytes;
    }
    if (pinned_bytes > l->pinned_cap) {
        if (l->pinned)
            cudaFreeHost(l->pinned);
        l->pinned = NULL;
        l->pinned_cap = 0;
        CUDA_TRY(cudaMallocHost(&l->pinned, pinned_bytes));
        l->pinned_cap = pinned_bytes;
    }
    return SCAPE_OK;
}

static size_t total_of(const comm_t *c, const size_t *counts, size_t *offs)
{
    size_t t = 0;
    for (int r = 0; r < c->size; r++) {
        offs[r] = t;
        t += counts[r];
    }
    return t;
}

/* ---- blocking collectives on the main lane ---------------------------- */

static scape_rc nc_allreduce(comm_t *c, float *buf, size_t n)
{
    nccl_impl *x = c->impl;
    lane *l = &x->main;
    TRY_RC(usable(l));
    if (n == 0)
        return SCAPE_OK;
    size_t b = n * sizeof(float);
    TRY_RC(grow(l, b, 0));
    CUDA_TRY(cudaMemcpyAsync(l->dev, buf, b, cudaMemcpyHostToDevice, l->stream));
    NCCL_TRY(x, l, ncclAllReduce(l->dev, l->dev, n, ncclFloat32, ncclSum, l->comm, l->stream),
             "all-reduce");
    CUDA_TRY(cudaMemcpyAsync(buf, l->dev, b, cudaMemcpyDeviceToHost, l->stream));
    return drain(x, l, "all-reduce");
}

static scape_rc nc_reduce_scatter(comm_t *c, const float *send, float *recv,
                                  const size_t *counts)
{
    nccl_impl *x = c->impl;
    lane *l = &x->main;
    TRY_RC(usable(l));
    size_t *offs = malloc((size_t)c->size * sizeof *offs);
    if (offs == NULL)
        return scape_set_error(SCAPE_NOMEM, "comm nccl: out of memory");
    size_t total = total_of(c, counts, offs), mine = counts[c->rank];
    scape_rc rc = grow(l, (total + mine + 1) * sizeof(float), 0);
    float *d = l->dev, *dr = d + total;
    cudaError_t e = cudaSuccess;
    if (rc == SCAPE_OK && total)
        e = cudaMemcpyAsync(d, send, total * sizeof(float), cudaMemcpyHostToDevice, l->stream);
    if (rc == SCAPE_OK && e != cudaSuccess)
        rc = scape_set_error(SCAPE_CUDA, "comm nccl: reduce-scatter copy-in: %s",
                             cudaGetErrorString(e));
    /* One reduce per owner: segment r summed onto rank r. */
    ncclResult_t r = rc == SCAPE_OK ? ncclGroupStart() : ncclSuccess;
    for (int q = 0; rc == SCAPE_OK && r == ncclSuccess && q < c->size; q++)
        if (counts[q])
            r = ncclReduce(d + offs[q], dr, counts[q], ncclFloat32, ncclSum, q, l->comm,
                           l->stream);
    if (rc == SCAPE_OK) {
        ncclResult_t g = ncclGroupEnd();
        rc = settle(x, l, r != ncclSuccess ? r : g, "reduce-scatter");
    }
    free(offs);
    TRY_RC(rc);
    if (mine)
        CUDA_TRY(cudaMemcpyAsync(recv, dr, mine * sizeof(float), cudaMemcpyDeviceToHost,
                                 l->stream));
    return drain(x, l, "reduce-scatter");
}

/* Every rank's segment broadcast from its owner: an all-gather of uneven
 * segments, from dev + offs[r] to the same place on every rank. */
static scape_rc gather_group(nccl_impl *x, lane *l, const comm_t *c, const size_t *counts,
                             const size_t *offs, const char *what)
{
    char *d = l->dev;
    ncclResult_t r = ncclGroupStart();
    for (int q = 0; r == ncclSuccess && q < c->size; q++)
        if (counts[q])
            r = ncclBroadcast(d + offs[q], d + offs[q], counts[q], ncclUint8, q, l->comm,
                              l->stream);
    ncclResult_t g = ncclGroupEnd();
    return settle(x, l, r != ncclSuccess ? r : g, what);
}

/* Copy this rank's segment in (through pinned memory when `pinned`, so the
 * call never waits for the GPU) and start the grouped broadcasts; *total is
 * the gathered size in bytes, left in the lane's device buffer. */
static scape_rc gather_start(nccl_impl *x, lane *l, const comm_t *c, const void *send,
                             const size_t *counts, int pinned, size_t *total, const char *what)
{
    TRY_RC(usable(l));
    size_t *offs = malloc((size_t)c->size * sizeof *offs);
    if (offs == NULL)
        return scape_set_error(SCAPE_NOMEM, "comm nccl: out of memory");
    *total = total_of(c, counts, offs);
    size_t mine = counts[c->rank], at = offs[c->rank];
    scape_rc rc = grow(l, *total + 1, pinned ? *total + 1 : 0);
    const void *from = send;
    if (rc == SCAPE_OK && mine && pinned) {
        memcpy((char *)l->pinned + at, send, mine);
        from = (char *)l->pinned + at;
    }
    if (rc == SCAPE_OK && mine &&
        cudaMemcpyAsync((char *)l->dev + at, from, mine, cudaMemcpyHostToDevice, l->stream) !=
            cudaSuccess)
        rc = scape_set_error(SCAPE_CUDA, "comm nccl: %s copy-in failed", what);
    if (rc == SCAPE_OK)
        rc = gather_group(x, l, c, counts, offs, what);
    free(offs);
    return rc;
}

static scape_rc nc_allgather(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    nccl_impl *x = c->impl;
    lane *l = &x->main;
    size_t total = 0;
    TRY_RC(gather_start(x, l, c, send, counts, 0, &total, "all-gather"));
    if (total)
        CUDA_TRY(cudaMemcpyAsync(recv, l->dev, total, cudaMemcpyDeviceToHost, l->stream));
    return drain(x, l, "all-gather");
}

static scape_rc nc_broadcast(comm_t *c, void *buf, size_t bytes, int root)
{
    nccl_impl *x = c->impl;
    lane *l = &x->main;
    TRY_RC(usable(l));
    if (bytes == 0)
        return SCAPE_OK;
    TRY_RC(grow(l, bytes, 0));
    CUDA_TRY(cudaMemcpyAsync(l->dev, buf, bytes, cudaMemcpyHostToDevice, l->stream));
    NCCL_TRY(x, l, ncclBroadcast(l->dev, l->dev, bytes, ncclUint8, root, l->comm, l->stream),
             "broadcast");
    CUDA_TRY(cudaMemcpyAsync(buf, l->dev, bytes, cudaMemcpyDeviceToHost, l->stream));
    return drain(x, l, "broadcast");
}

static scape_rc nc_barrier(comm_t *c)
{
    float one = 1.0f;
    return nc_allreduce(c, &one, 1);
}

/* ---- the lagged mask all-gather on its own lane ------------------------ */

static scape_rc nc_iallgather(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    nccl_impl *x = c->impl;
    lane *l = &x->mask;
    size_t total = 0;
    TRY_RC(gather_start(x, l, c, send, counts, 1, &total, "mask all-gather"));
    if (total)
        CUDA_TRY(cudaMemcpyAsync(l->pinned, l->dev, total, cudaMemcpyDeviceToHost, l->stream));
    x->mask_recv = recv;
    x->mask_bytes = total;
    return SCAPE_OK;
}

static scape_rc nc_iallgather_wait(comm_t *c)
{
    nccl_impl *x = c->impl;
    TRY_RC(drain(x, &x->mask, "mask all-gather"));
    if (x->mask_bytes)
        memcpy(x->mask_recv, x->mask.pinned, x->mask_bytes);
    x->mask_bytes = 0;
    return SCAPE_OK;
}

static void lane_free(lane *l)
{
    if (l->comm) {
        if (l->aborted)
            ncclCommAbort(l->comm);
        else
            ncclCommDestroy(l->comm);
    }
    if (l->stream)
        cudaStreamDestroy(l->stream);
    if (l->dev)
        cudaFree(l->dev);
    if (l->pinned)
        cudaFreeHost(l->pinned);
    memset(l, 0, sizeof *l);
}

static void nc_destroy(comm_t *c)
{
    nccl_impl *x = c->impl;
    if (x) {
        lane_free(&x->mask);
        lane_free(&x->main);
        free(x);
    }
    free(c);
}

static uint64_t nc_device_bytes(const comm_t *c)
{
    const nccl_impl *x = c->impl;
    return (uint64_t)x->main.dev_cap + (uint64_t)x->mask.dev_cap;
}

static const comm_ops s_nccl_ops = {
    .name = "nccl",
    .allreduce_sum = nc_allreduce,
    .reduce_scatter_sum = nc_reduce_scatter,
    .allgather = nc_allgather,
    .iallgather = nc_iallgather,
    .iallgather_wait = nc_iallgather_wait,
    .broadcast = nc_broadcast,
    .barrier = nc_barrier,
    .destroy = nc_destroy,
    .device_bytes = nc_device_bytes,
};

int comm_nccl_built(void) { return 1; }

scape_rc comm_nccl_make_ids(unsigned char *ids, size_t len)
{
    if (ids == NULL || len < COMM_NCCL_IDS * COMM_NCCL_ID_BYTES)
        return scape_set_error(SCAPE_INVALID, "comm_nccl_make_ids: buffer too small");
    for (int i = 0; i < COMM_NCCL_IDS; i++) {
        ncclUniqueId id;
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess)
            return scape_set_error(SCAPE_NCCL, "ncclGetUniqueId: %s", ncclGetErrorString(r));
        memcpy(ids + i * COMM_NCCL_ID_BYTES, &id, COMM_NCCL_ID_BYTES);
    }
    return SCAPE_OK;
}

static scape_rc lane_init(nccl_impl *x, lane *l, const comm_nccl_opts *o, int which)
{
    CUDA_TRY(cudaStreamCreateWithFlags(&l->stream, cudaStreamNonBlocking));
    ncclUniqueId id;
    memcpy(&id, o->ids + which * COMM_NCCL_ID_BYTES, COMM_NCCL_ID_BYTES);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&l->comm, o->size, id, o->rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress)
        return scape_set_error(SCAPE_NCCL, "ncclCommInitRankConfig (rank %d of %d): %s",
                               o->rank, o->size, ncclGetErrorString(r));
    return settle(x, l, r, which ? "joining the mask communicator"
                                 : "joining the communicator");
}

scape_rc comm_nccl_create(const comm_nccl_opts *o, comm_t **out)
{
    if (o == NULL || out == NULL || o->size < 1 || o->rank < 0 || o->rank >= o->size)
        return scape_set_error(SCAPE_INVALID, "comm_nccl_create: bad arguments");
    *out = NULL;
    int ndev = 0;
    CUDA_TRY(cudaGetDeviceCount(&ndev));
    if (o->device < 0 || o->device >= ndev)
        return scape_set_error(SCAPE_INVALID, "comm nccl: cuda_device %d, but %d device(s) are "
                               "visible", o->device, ndev);
    CUDA_TRY(cudaSetDevice(o->device));
    comm_t *c = calloc(1, sizeof *c);
    nccl_impl *x = calloc(1, sizeof *x);
    if (c == NULL || x == NULL) {
        free(c);
        free(x);
        return scape_set_error(SCAPE_NOMEM, "comm_nccl_create: out of memory");
    }
    x->device = o->device;
    x->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : 300000;
    c->ops = &s_nccl_ops;
    c->rank = o->rank;
    c->size = o->size;
    c->impl = x;
    scape_rc rc = lane_init(x, &x->main, o, 0);
    if (rc == SCAPE_OK)
        rc = lane_init(x, &x->mask, o, 1);
    if (rc != SCAPE_OK) {
        nc_destroy(c);
        return rc;
    }
    *out = c;
    return SCAPE_OK;
}
