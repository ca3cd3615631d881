/* dev_cuda.c - the device executor's device on CUDA (dev.h): the thin layer
 * of memory, streams, events and launches; everything it runs is
 * exec_dev.c's orchestration and kernels/cuda_seg.cu's kernels.
 *
 * Nothing here waits without a bound.  sync() polls the streams: through
 * the comm's own bounded wait (which also watches NCCL for a dead peer and
 * aborts its communicators) when the main stream is the comm's, else with a
 * deadline of its own that a daemon shutdown cuts short, like the comm
 * backends' waits.  Events 0..7 only order work (no timing); the rest time
 * the phases.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "dev.h"
#include "exec.h"
#include "scape_cuda_err.h"
#include "scape_kernels.h"
#include "try.h"

#define SYNC_EVENTS 8

struct dev {
    int device;
    cudaStream_t s[DEV_STREAMS];
    int borrowed;            /* the main stream is the comm's */
    comm_t *comm;
    cudaEvent_t ev[DEV_EVENTS];
    int timeout_ms;
    int stuck;               /* a wait failed: work may never finish, so
                                nothing may synchronise on it or free its memory */
};

static scape_rc cuda_err(cudaError_t e, const char *what)
{
    (void)cudaGetLastError(); /* reported here; not again at the next launch */
    return scape_set_error(SCAPE_CUDA, "executor cuda: %s: %s", what, cudaGetErrorString(e));
}

#define CU(call, what)                                                         \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess)                                                 \
            return cuda_err(e_, (what));                                       \
    } while (0)

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

static void cu_destroy(dev_t *d)
{
    if (d == NULL)
        return;
    for (int s = 0; s < DEV_STREAMS; s++)
        if (d->s[s] && !(s == DEV_MAIN && d->borrowed) && !d->stuck) {
            /* failures here would otherwise stay the thread's last error
             * and surface as the next executor's */
            scape_cuda_quietly(cudaStreamSynchronize(d->s[s]));
            scape_cuda_quietly(cudaStreamDestroy(d->s[s]));
        }
    for (int i = 0; i < DEV_EVENTS; i++)
        if (d->ev[i])
            scape_cuda_quietly(cudaEventDestroy(d->ev[i]));
    free(d);
}

static scape_rc make(dev_t *d, int device, void *main)
{
    CU(cudaSetDevice(device), "cudaSetDevice");
    for (int s = 0; s < DEV_STREAMS; s++) {
        if (s == DEV_MAIN && main) {
            d->s[s] = (cudaStream_t)main;
            d->borrowed = 1;
            continue;
        }
        CU(cudaStreamCreateWithFlags(&d->s[s], cudaStreamNonBlocking), "cudaStreamCreate");
    }
    for (int i = 0; i < DEV_EVENTS; i++)
        CU(cudaEventCreateWithFlags(&d->ev[i], i < SYNC_EVENTS ? cudaEventDisableTiming
                                                                : cudaEventDefault),
           "cudaEventCreate");
    return SCAPE_OK;
}

static scape_rc cu_create(dev_t **out, int device, void *main, comm_t *comm, int timeout_ms,
                          unsigned long seed)
{
    (void)seed;
    *out = NULL;
    const char *why = NULL;
    cudaError_t e = cudaSetDevice(device); /* the checks below are of this device */
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return scape_set_error(SCAPE_UNSUPPORTED, "executor cuda: cudaSetDevice(%d): %s",
                               device, cudaGetErrorString(e));
    }
    if (!kern_cuda_available(&why))
        return scape_set_error(SCAPE_UNSUPPORTED, "executor cuda: %s", why);
    dev_t *d = calloc(1, sizeof *d);
    if (d == NULL)
        return scape_set_error(SCAPE_NOMEM, "executor cuda: out of memory");
    d->device = device;
    d->comm = main ? comm : NULL;
    d->timeout_ms = timeout_ms;
    scape_rc rc = make(d, device, main);
    if (rc != SCAPE_OK) {
        cu_destroy(d);
        return rc;
    }
    *out = d;
    return SCAPE_OK;
}

static scape_rc cu_alloc(dev_t *d, size_t bytes, int pinned, void **out)
{
    (void)d;
    *out = NULL;
    cudaError_t e = pinned ? cudaMallocHost(out, bytes) : cudaMalloc(out, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *out = NULL;
        return scape_set_error(SCAPE_NOMEM, "executor cuda: %s of %zu bytes: %s",
                               pinned ? "cudaMallocHost" : "cudaMalloc", bytes,
                               cudaGetErrorString(e));
    }
    /* zeroed, as dev.h promises: on the main stream, before anything the
     * executor enqueues (it waits for all of it before its first step) */
    if (pinned) {
        memset(*out, 0, bytes);
        return SCAPE_OK;
    }
    if ((e = cudaMemsetAsync(*out, 0, bytes, d->s[DEV_MAIN])) != cudaSuccess) {
        scape_rc rc = cuda_err(e, "cudaMemsetAsync");
        scape_cuda_quietly(cudaFree(*out)); /* the caller frees only what it got */
        *out = NULL;
        return rc;
    }
    return SCAPE_OK;
}

/* cudaFree and cudaFreeHost synchronise the device: not after a wait that
 * failed (a collective of a dead peer may never finish); the memory then
 * goes with the process. */
static void cu_release(dev_t *d, void *p, int pinned)
{
    if (d->stuck)
        return;
    if (pinned)
        scape_cuda_quietly(cudaFreeHost(p));
    else
        scape_cuda_quietly(cudaFree(p));
}

static scape_rc cu_sync(dev_t *d);

/* Host memory CUDA does not know (malloc'd): a copy to it returns only once
 * it has run, behind everything queued, collectives included. */
static int pageable(const void *p)
{
    struct cudaPointerAttributes at;
    if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return 1;
    }
    return at.type == cudaMemoryTypeUnregistered;
}

static scape_rc cu_copy(dev_t *d, int s, void *dst, const void *src, size_t bytes)
{
    if (bytes == 0)
        return SCAPE_OK;
    /* with pageable memory on either side the copy would wait without a
     * bound: wait, bounded, for the queued work first */
    if (pageable(dst) || pageable(src))
        TRY(cu_sync(d));
    CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, d->s[s]), "cudaMemcpyAsync");
    return SCAPE_OK;
}

static scape_rc cu_zero(dev_t *d, int s, void *dst, size_t bytes)
{
    if (bytes)
        CU(cudaMemsetAsync(dst, 0, bytes, d->s[s]), "cudaMemsetAsync");
    return SCAPE_OK;
}

static scape_rc cu_record(dev_t *d, int s, int ev)
{
    CU(cudaEventRecord(d->ev[ev], d->s[s]), "cudaEventRecord");
    return SCAPE_OK;
}

static scape_rc cu_wait(dev_t *d, int s, int ev)
{
    CU(cudaStreamWaitEvent(d->s[s], d->ev[ev], 0), "cudaStreamWaitEvent");
    return SCAPE_OK;
}

static scape_rc cu_launch(dev_t *d, int s, kseg_kernel k, const void *args)
{
    return kseg_run_cuda(k, args, d->s[s]);
}

/* Poll stream s until it is idle, past no deadline. */
static scape_rc drain(dev_t *d, int s, double deadline)
{
    for (;;) {
        cudaError_t e = scape_cuda_query(cudaStreamQuery(d->s[s]));
        if (e == cudaSuccess)
            return SCAPE_OK;
        if (e != cudaErrorNotReady)
            return cuda_err(e, "the executor's work failed");
        if (now_ms() > deadline)
            return scape_set_error(SCAPE_TIMEOUT, "executor cuda: the device's work did not "
                                   "finish within %d ms", d->timeout_ms);
        if (comm_interrupted())
            return scape_set_error(SCAPE_REMOTE, "executor cuda: given up waiting for the "
                                   "device: the daemon is shutting down");
        nanosleep(&(struct timespec){ 0, 20000 }, NULL);
    }
}

static scape_rc cu_sync(dev_t *d)
{
    if (d->stuck)
        return scape_set_error(SCAPE_CUDA, "executor cuda: an earlier wait for the device "
                               "failed; its work may never finish (restore from a checkpoint)");
    double deadline = now_ms() + d->timeout_ms;
    for (int s = 0; s < DEV_STREAMS; s++) {
        scape_rc rc = s == DEV_MAIN && d->borrowed ? comm_device_sync(d->comm)
                                                   : drain(d, s, deadline);
        if (rc != SCAPE_OK) {
            d->stuck = 1;
            return rc;
        }
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return cuda_err(e, "after the executor's work");
    return SCAPE_OK;
}

static double cu_elapsed(dev_t *d, int ev0, int ev1)
{
    float ms = 0.0f;
    if (ev0 < SYNC_EVENTS || ev1 < SYNC_EVENTS ||
        cudaEventElapsedTime(&ms, d->ev[ev0], d->ev[ev1]) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1.0;
    }
    return 1e-3 * (double)ms;
}

/* Device memory of this device or of a peer it can reach (a trainer's CUDA
 * IPC buffer on another GPU of the node, opened with peer access enabled as
 * needed: cudaIpcMemLazyEnablePeerAccess), or pinned host memory: what the
 * kernels can address; anything else is refused with what to do instead. */
static scape_rc cu_resolve(dev_t *d, const void *p, size_t bytes, const void **out,
                           int *on_host)
{
    struct cudaPointerAttributes at;
    memset(&at, 0, sizeof at);
    cudaError_t e = cudaPointerGetAttributes(&at, p);
    if (e != cudaSuccess)
        return cuda_err(e, "cudaPointerGetAttributes on a trainer's buffer");
    if (at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged) {
        int peer = 1;
        if (at.type == cudaMemoryTypeDevice && at.device != d->device &&
            (e = cudaDeviceCanAccessPeer(&peer, d->device, at.device)) != cudaSuccess)
            return cuda_err(e, "cudaDeviceCanAccessPeer for a trainer's buffer");
        if (!peer)
            return scape_set_error(SCAPE_INVALID, "executor cuda: a trainer's buffer of %zu "
                                   "bytes is on CUDA device %d, which the daemon's device %d "
                                   "has no peer access to: run one daemon per GPU "
                                   "(cuda_device) with its trainers on it",
                                   bytes, at.device, d->device);
        *out = p;
        *on_host = 0;
        return SCAPE_OK;
    }
    if (at.type == cudaMemoryTypeHost && at.devicePointer) {
        *out = at.devicePointer;
        *on_host = 1;
        return SCAPE_OK;
    }
    return scape_set_error(SCAPE_INVALID, "executor cuda: a trainer's buffer of %zu bytes is "
                           "neither device memory nor pinned host memory (the daemon reads "
                           "CUDA IPC buffers in place and registers shared memory with "
                           "cudaHostRegister)", bytes);
}

scape_rc exec_cuda_use_device(int device)
{
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return scape_set_error(SCAPE_CUDA, "executor cuda: cudaSetDevice(%d): %s", device,
                               cudaGetErrorString(e));
    }
    return SCAPE_OK;
}

static int cu_stuck(const dev_t *d) { return d->stuck; }

const dev_ops dev_cuda_ops = {
    .name = "cuda",
    .create = cu_create,
    .destroy = cu_destroy,
    .alloc = cu_alloc,
    .release = cu_release,
    .copy = cu_copy,
    .zero = cu_zero,
    .record = cu_record,
    .wait = cu_wait,
    .launch = cu_launch,
    .sync = cu_sync,
    .elapsed = cu_elapsed,
    .resolve = cu_resolve,
    .stuck = cu_stuck,
};
