/* comm_nccl.c - the `nccl` backend (see comm_nccl.h).  Built when CUDA and
 * NCCL are found; comm_nccl_none.c stands in otherwise.
 *
 * Nothing here may hang the daemon:
 * - the communicators are non-blocking (ncclConfig_t.blocking = 0), and every
 *   call that answers ncclInProgress is polled with a deadline;
 * - every host<->device copy goes through pinned memory, so no copy waits
 *   implicitly for the stream (a pageable copy would, behind a collective
 *   that a dead peer never completes); the stream is then polled with the
 *   same deadline;
 * - past the deadline, or on any error NCCL calls fatal, both communicators
 *   are aborted (an abort of one leaves the other's kernels spinning) and
 *   every later call is refused.
 * Both lanes are driven from this one thread in the same order on every
 * rank, and NCCL_LAUNCH_ORDER_IMPLICIT makes NCCL keep that order on the GPU,
 * which is what two communicators used concurrently require.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "comm_nccl.h"
#include "try.h"

_Static_assert(sizeof(ncclUniqueId) == COMM_NCCL_ID_BYTES, "ncclUniqueId size");

typedef struct lane {
    ncclComm_t comm;      /* NULL once aborted or destroyed */
    cudaStream_t stream;
    void *dev;            /* staging in device memory */
    size_t dev_cap;
    void *pinned;         /* staging in pinned host memory */
    size_t pinned_cap;
} lane;

typedef struct nccl_impl {
    int timeout_ms;
    int aborted;          /* after a failure: both communicators are gone */
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

static void abort_all(nccl_impl *x)
{
    lane *ls[2] = { &x->main, &x->mask };
    for (int i = 0; i < 2; i++)
        if (ls[i]->comm) {
            ncclCommAbort(ls[i]->comm);
            ls[i]->comm = NULL;
        }
    x->aborted = 1;
}

/* A CUDA failure: the streams can no longer be trusted to finish. */
static scape_rc cuda_fail(nccl_impl *x, cudaError_t e, const char *what)
{
    abort_all(x);
    return scape_set_error(SCAPE_CUDA, "comm nccl: %s: %s; the communicators were aborted",
                           what, cudaGetErrorString(e));
}

#define CUDA_TRY(x, call, what)                                                \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess)                                                 \
            return cuda_fail((x), e_, (what));                                 \
    } while (0)

/* One more round of a wait: past the deadline, or when the daemon is being
 * stopped, abort both communicators and fail; else nap and go on. */
static scape_rc wait_more(nccl_impl *x, double deadline, const char *what)
{
    if (now_ms() > deadline) {
        abort_all(x);
        return scape_set_error(SCAPE_TIMEOUT, "comm nccl: %s did not finish within %d ms (a "
                               "peer is gone?); the communicators were aborted", what,
                               x->timeout_ms);
    }
    if (comm_interrupted()) {
        abort_all(x);
        return scape_set_error(SCAPE_REMOTE, "comm nccl: %s interrupted: the daemon is "
                               "shutting down", what);
    }
    nap();
    return SCAPE_OK;
}

/* Wait until the lane's communicator has no call in progress; r is what the
 * call returned.  Anything but success is fatal for the job's communicators
 * (an invalid argument is this daemon's bug, and is reported as such). */
static scape_rc settle(nccl_impl *x, lane *l, ncclResult_t r, const char *what)
{
    double deadline = now_ms() + x->timeout_ms;
    while (r == ncclInProgress) {
        TRY(wait_more(x, deadline, what));
        if (ncclCommGetAsyncError(l->comm, &r) != ncclSuccess)
            r = ncclInternalError;
    }
    if (r == ncclSuccess)
        return SCAPE_OK;
    char last[256];
    snprintf(last, sizeof last, "%s", ncclGetLastError(l->comm));
    if (r != ncclInvalidArgument)
        abort_all(x);
    return scape_set_error(SCAPE_NCCL, "comm nccl: %s: %s (%s)%s", what, ncclGetErrorString(r),
                           last, x->aborted ? "; the communicators were aborted" : "");
}

/* Wait for the lane's stream, watching its communicator for errors. */
static scape_rc drain(nccl_impl *x, lane *l, const char *what)
{
    double deadline = now_ms() + x->timeout_ms;
    for (;;) {
        cudaError_t e = cudaStreamQuery(l->stream);
        if (e == cudaSuccess)
            return SCAPE_OK;
        if (e != cudaErrorNotReady)
            return cuda_fail(x, e, what);
        ncclResult_t r = ncclSuccess;
        if (ncclCommGetAsyncError(l->comm, &r) != ncclSuccess)
            r = ncclInternalError;
        if (r != ncclSuccess && r != ncclInProgress)
            return settle(x, l, r, what);
        TRY(wait_more(x, deadline, what));
    }
}

static scape_rc usable(const nccl_impl *x)
{
    if (x->aborted)
        return scape_set_error(SCAPE_NCCL, "comm nccl: the communicators were aborted after an "
                               "earlier failure; restart the job from a checkpoint");
    return SCAPE_OK;
}

/* Staging of at least `bytes` on the device and in pinned host memory.  Only
 * grows (allocation synchronises implicitly, so it happens rarely: once per
 * size the engine uses). */
static scape_rc grow(nccl_impl *x, lane *l, size_t bytes)
{
    bytes = bytes ? bytes : 1;
    if (bytes > l->dev_cap) {
        if (l->dev)
            cudaFree(l->dev);
        l->dev = NULL;
        l->dev_cap = 0;
        CUDA_TRY(x, cudaMalloc(&l->dev, bytes), "cudaMalloc (staging)");
        l->dev_cap = bytes;
    }
    if (bytes > l->pinned_cap) {
        if (l->pinned)
            cudaFreeHost(l->pinned);
        l->pinned = NULL;
        l->pinned_cap = 0;
        CUDA_TRY(x, cudaMallocHost(&l->pinned, bytes), "cudaMallocHost (staging)");
        l->pinned_cap = bytes;
    }
    return SCAPE_OK;
}

/* Host bytes into the device staging at off, through pinned memory. */
static scape_rc copy_in(nccl_impl *x, lane *l, size_t off, const void *src, size_t bytes)
{
    if (bytes == 0)
        return SCAPE_OK;
    memcpy((char *)l->pinned + off, src, bytes);
    CUDA_TRY(x, cudaMemcpyAsync((char *)l->dev + off, (char *)l->pinned + off, bytes,
                                cudaMemcpyHostToDevice, l->stream), "copy to the device");
    return SCAPE_OK;
}

/* Device staging at off back to pinned memory (read it after drain). */
static scape_rc copy_back(nccl_impl *x, lane *l, size_t off, size_t bytes)
{
    if (bytes == 0)
        return SCAPE_OK;
    CUDA_TRY(x, cudaMemcpyAsync((char *)l->pinned + off, (char *)l->dev + off, bytes,
                                cudaMemcpyDeviceToHost, l->stream), "copy to the host");
    return SCAPE_OK;
}

static size_t *offsets(const comm_t *c, const size_t *counts, size_t *total)
{
    size_t *offs = malloc((size_t)c->size * sizeof *offs);
    *total = 0;
    for (int r = 0; offs && r < c->size; r++) {
        offs[r] = *total;
        *total += counts[r];
    }
    return offs;
}

/* End a group of per-owner calls: wait for the group, then report the first
 * failed call, if any. */
static scape_rc end_group(nccl_impl *x, lane *l, ncclResult_t first, const char *what)
{
    TRY(settle(x, l, ncclGroupEnd(), what));
    return settle(x, l, first, what);
}

/* ---- blocking collectives on the main lane ---------------------------- */

/* An in-place collective on the lane's device buffer: bytes of buf go in
 * before the caller enqueues it, and come back into buf after it. */
static scape_rc staged_in(nccl_impl *x, lane *l, const void *buf, size_t bytes)
{
    TRY(grow(x, l, bytes));
    return copy_in(x, l, 0, buf, bytes);
}

static scape_rc staged_out(nccl_impl *x, lane *l, void *buf, size_t bytes, const char *what)
{
    TRY(copy_back(x, l, 0, bytes));
    TRY(drain(x, l, what));
    memcpy(buf, l->pinned, bytes);
    return SCAPE_OK;
}

static scape_rc nc_allreduce(comm_t *c, float *buf, size_t n)
{
    nccl_impl *x = c->impl;
    lane *l = &x->main;
    TRY(usable(x));
    if (n == 0)
        return SCAPE_OK;
    size_t b = n * sizeof(float);
    TRY(staged_in(x, l, buf, b));
    TRY(settle(x, l, ncclAllReduce(l->dev, l->dev, n, ncclFloat32, ncclSum, l->comm,
                                   l->stream), "all-reduce"));
    return staged_out(x, l, buf, b, "all-reduce");
}

static scape_rc nc_reduce_scatter(comm_t *c, const float *send, float *recv,
                                  const size_t *counts)
{
    nccl_impl *x = c->impl;
    lane *l = &x->main;
    TRY(usable(x));
    size_t total;
    size_t *offs = offsets(c, counts, &total);
    if (offs == NULL)
        return scape_set_error(SCAPE_NOMEM, "comm nccl: out of memory");
    size_t mine = counts[c->rank];
    /* Device: the whole send vector, then this rank's sums after it. */
    scape_rc rc = grow(x, l, (total + mine) * sizeof(float));
    if (rc == SCAPE_OK)
        rc = copy_in(x, l, 0, send, total * sizeof(float));
    if (rc == SCAPE_OK) {
        float *d = l->dev, *dr = d + total;
        /* One reduce per owner: segment q summed onto rank q. */
        ncclResult_t r = ncclGroupStart();
        ncclResult_t first = r == ncclSuccess || r == ncclInProgress ? ncclSuccess : r;
        for (int q = 0; (r == ncclSuccess || r == ncclInProgress) && q < c->size; q++)
            if (counts[q]) {
                r = ncclReduce(d + offs[q], dr, counts[q], ncclFloat32, ncclSum, q, l->comm,
                               l->stream);
                first = first == ncclSuccess && r != ncclInProgress ? r : first;
            }
        rc = end_group(x, l, first, "reduce-scatter");
    }
    free(offs);
    TRY(rc);
    TRY(copy_back(x, l, total * sizeof(float), mine * sizeof(float)));
    TRY(drain(x, l, "reduce-scatter"));
    if (mine)
        memcpy(recv, (char *)l->pinned + total * sizeof(float), mine * sizeof(float));
    return SCAPE_OK;
}

/* Copy this rank's segment in and start one broadcast per owner (an
 * all-gather of uneven segments), then the copy of all of it back to pinned
 * memory; *total is the gathered size in bytes. */
static scape_rc gather_start(nccl_impl *x, lane *l, const comm_t *c, const void *send,
                             const size_t *counts, size_t *total, const char *what)
{
    TRY(usable(x));
    size_t *offs = offsets(c, counts, total);
    if (offs == NULL)
        return scape_set_error(SCAPE_NOMEM, "comm nccl: out of memory");
    scape_rc rc = grow(x, l, *total);
    if (rc == SCAPE_OK)
        rc = copy_in(x, l, offs[c->rank], send, counts[c->rank]);
    if (rc == SCAPE_OK) {
        char *d = l->dev;
        ncclResult_t r = ncclGroupStart();
        ncclResult_t first = r == ncclSuccess || r == ncclInProgress ? ncclSuccess : r;
        for (int q = 0; (r == ncclSuccess || r == ncclInProgress) && q < c->size; q++)
            if (counts[q]) {
                r = ncclBroadcast(d + offs[q], d + offs[q], counts[q], ncclUint8, q, l->comm,
                                  l->stream);
                first = first == ncclSuccess && r != ncclInProgress ? r : first;
            }
        rc = end_group(x, l, first, what);
    }
    free(offs);
    TRY(rc);
    return copy_back(x, l, 0, *total);
}

static scape_rc nc_allgather(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    nccl_impl *x = c->impl;
    lane *l = &x->main;
    size_t total = 0;
    TRY(gather_start(x, l, c, send, counts, &total, "all-gather"));
    TRY(drain(x, l, "all-gather"));
    if (total)
        memcpy(recv, l->pinned, total);
    return SCAPE_OK;
}

static scape_rc nc_broadcast(comm_t *c, void *buf, size_t bytes, int root)
{
    nccl_impl *x = c->impl;
    lane *l = &x->main;
    TRY(usable(x));
    if (bytes == 0)
        return SCAPE_OK;
    TRY(staged_in(x, l, buf, bytes));
    TRY(settle(x, l, ncclBroadcast(l->dev, l->dev, bytes, ncclUint8, root, l->comm,
                                   l->stream), "broadcast"));
    return staged_out(x, l, buf, bytes, "broadcast");
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
    size_t total = 0;
    TRY(gather_start(x, &x->mask, c, send, counts, &total, "mask all-gather"));
    x->mask_recv = recv;
    x->mask_bytes = total;
    return SCAPE_OK;
}

static scape_rc nc_iallgather_wait(comm_t *c)
{
    nccl_impl *x = c->impl;
    TRY(usable(x));
    TRY(drain(x, &x->mask, "mask all-gather"));
    if (x->mask_bytes)
        memcpy(x->mask_recv, x->mask.pinned, x->mask_bytes);
    x->mask_bytes = 0;
    return SCAPE_OK;
}

/* ---- life ------------------------------------------------------------------ */

static void lane_free(lane *l)
{
    if (l->comm)
        ncclCommDestroy(l->comm); /* only live, healthy ones: failures aborted theirs */
    if (l->stream) {
        cudaStreamSynchronize(l->stream);
        cudaStreamDestroy(l->stream);
    }
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

/* Two communicators in flight at once: let NCCL order their kernels as the
 * host issued them (NCCL 2.26+; an explicit setting wins). */
static void launch_order(void)
{
    setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", 0);
}

scape_rc comm_nccl_make_ids(unsigned char *ids, size_t len)
{
    if (ids == NULL || len < COMM_NCCL_IDS * COMM_NCCL_ID_BYTES)
        return scape_set_error(SCAPE_INVALID, "comm_nccl_make_ids: buffer too small");
    launch_order();
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
    CUDA_TRY(x, cudaStreamCreateWithFlags(&l->stream, cudaStreamNonBlocking),
             "cudaStreamCreateWithFlags");
    ncclUniqueId id;
    memcpy(&id, o->ids + which * COMM_NCCL_ID_BYTES, COMM_NCCL_ID_BYTES);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&l->comm, o->size, id, o->rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        l->comm = NULL;
        return scape_set_error(SCAPE_NCCL, "ncclCommInitRankConfig (rank %d of %d): %s",
                               o->rank, o->size, ncclGetErrorString(r));
    }
    return settle(x, l, r, which ? "joining the mask communicator"
                                 : "joining the communicator");
}

scape_rc comm_nccl_create(const comm_nccl_opts *o, comm_t **out)
{
    if (o == NULL || out == NULL || o->size < 1 || o->rank < 0 || o->rank >= o->size)
        return scape_set_error(SCAPE_INVALID, "comm_nccl_create: bad arguments");
    *out = NULL;
    launch_order();
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "comm nccl: no usable GPU: %s",
                               cudaGetErrorString(e));
    if (o->device < 0 || o->device >= ndev)
        return scape_set_error(SCAPE_INVALID, "comm nccl: cuda_device %d, but %d device(s) are "
                               "visible", o->device, ndev);
    if ((e = cudaSetDevice(o->device)) != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "comm nccl: cudaSetDevice(%d): %s", o->device,
                               cudaGetErrorString(e));
    comm_t *c = calloc(1, sizeof *c);
    nccl_impl *x = calloc(1, sizeof *x);
    if (c == NULL || x == NULL) {
        free(c);
        free(x);
        return scape_set_error(SCAPE_NOMEM, "comm_nccl_create: out of memory");
    }
    x->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : 300000;
    c->ops = &s_nccl_ops;
    c->rank = o->rank;
    c->size = o->size;
    c->impl = x;
    scape_rc rc = lane_init(x, &x->main, o, 0);
    if (rc == SCAPE_OK)
        rc = lane_init(x, &x->mask, o, 1);
    if (rc != SCAPE_OK) {
        abort_all(x);
        nc_destroy(c);
        return rc;
    }
    *out = c;
    return SCAPE_OK;
}
