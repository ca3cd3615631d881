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
 * - past the deadline, on any NCCL error, and on any other failure of a
 *   collective on this rank (a CUDA call, memory, a kernel: the peers are in
 *   it already), both communicators are aborted (an abort of one leaves the
 *   other's kernels spinning) and every later call is refused.
 * Both lanes are driven from this one thread in the same order on every
 * rank, and NCCL_LAUNCH_ORDER_IMPLICIT makes NCCL keep that order on the GPU,
 * which is what two communicators used concurrently require.  That setting
 * exists from NCCL 2.26 on; with an older NCCL (or the setting turned off in
 * the environment) the mask lane issues its work
 * on the main lane's stream (still its own communicator), so the GPU runs
 * the two in issue order: the mask all-gather then overlaps the host's work
 * and the trainers' compute, not the main lane's collectives.  (Per NCCL's
 * source, the implicit order waits for the previous launch's completion,
 * not only its start, where the CUDA runtime or driver is older than 12.3:
 * there, too, the two lanes' kernels run one after the other.)
 * Closing is bounded too: ncclCommFinalize, polled for up to NC_CLOSE_MS,
 * then ncclCommDestroy (which no longer waits for the peers); past that, or
 * on an error, ncclCommAbort.
 *
 * Device memory.  A collective on device buffers (the cuda executor's) runs
 * in place on them, enqueued on the main lane's stream, which is the
 * executor's main stream too (comm_device_stream), and returns at once: the
 * step's one host wait is comm_device_sync, bounded like all of the above.
 * Uneven segments go as grouped per-owner ncclReduce / ncclBroadcast.  The
 * mask all-gather then runs on the mask lane between two events: after the
 * main stream's selection and code, before its next step's decode.
 *
 * Streaming.  Host buffers (the host executor's: the residual, which a dense
 * step sends, among them) stay in host memory; the main lane's collectives
 * stream them
 * through two fixed staging slots (NC_SLOT_BYTES of device and of pinned
 * memory each) round by round: round c's input is copied into slot c % 2's
 * pinned half while the GPU still works on round c - 1, and round c - 2's
 * output is read back only once its event says it is there.  On the GPU the
 * copy in runs on its own stream (cin), the collective on the lane's stream
 * once that copy is done (ein), the copy out on a third (cout) once the
 * collective is done (ecoll): round c's copy to the device overlaps round
 * c - 1's collective, and its copy back overlaps round c + 1's.  A collective of per-rank segments
 * advances every segment by the same piece per round.  Device memory is so
 * bounded by the slots, whatever N is.  The mask lane's all-gather is small
 * (coded masks) and is staged whole.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "comm_nccl.h"
#include "scape_cuda_err.h"
#include "scape_kernels.h"
#include "try.h"

_Static_assert(sizeof(ncclUniqueId) == COMM_NCCL_ID_BYTES, "ncclUniqueId size");

#define NC_SLOT_BYTES ((size_t)8 << 20) /* per staging slot of the main lane */
#define NC_CLOSE_MS 10000                /* longest wait for the peers at close */

typedef struct lane {
    ncclComm_t comm;      /* NULL once aborted or destroyed */
    cudaStream_t stream;
    int borrowed;         /* the stream is the main lane's (NCCL < 2.26) */
    void *dev;            /* mask lane: staging in device memory */
    size_t dev_cap;
    void *pinned;         /* mask lane: staging in pinned host memory */
    size_t pinned_cap;
    void *sdev[2];        /* main lane: the two streaming slots */
    void *spin[2];
    cudaEvent_t ev[2];    /* each slot's last round is back in spin */
    cudaStream_t cin, cout; /* main lane: copies in and out, beside the collectives */
    cudaEvent_t ein[2];   /* slot's round is on the device */
    cudaEvent_t ecoll[2]; /* slot's round's collective is done */
    size_t slot_cap;      /* bytes of each sdev / spin */
} lane;

typedef struct nccl_impl {
    int timeout_ms;
    int aborted;          /* after a failure: both communicators are gone */
    lane main, mask;
    void *mask_recv;      /* where the outstanding all-gather's result goes */
    size_t mask_bytes;
    int mask_on_device;   /* the outstanding all-gather runs in place on device
                             memory: its wait is the main stream's, on `gathered` */
    cudaEvent_t selected; /* main stream: the mask's code is encoded */
    cudaEvent_t gathered; /* mask stream: every rank's code is in place */
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
                           what, scape_cuda_failed(e));
}

#define CUDA_TRY(x, call, what)                                                \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess)                                                 \
            return cuda_fail((x), e_, (what));                                 \
    } while (0)

/* One more round of a wait: past the deadline, or when the daemon is being
 * stopped and the wait has made no progress for COMM_STOP_GRACE_MS, abort
 * both communicators and fail; else let the daemon serve its status
 * (comm_wait_serve), nap and go on. */
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
        return scape_set_error(SCAPE_REMOTE, "comm nccl: %s given up: the daemon is shutting "
                               "down and the wait made no progress for %d ms", what,
                               COMM_STOP_GRACE_MS);
    }
    comm_wait_serve(); /* the daemon's status, while a peer is awaited */
    nap();
    return SCAPE_OK;
}

/* Wait until the lane's communicator has no call in progress; r is what the
 * call returned.  Anything but success is fatal for the job's communicators,
 * an invalid argument (this daemon's bug) too: after an error NCCL promises
 * nothing about what was enqueued, and the peers, already in the
 * collective, learn of the abort at once instead of at their timeout. */
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
    abort_all(x);
    return scape_set_error(SCAPE_NCCL, "comm nccl: %s: %s (%s); the communicators were aborted",
                           what, ncclGetErrorString(r), last);
}

/* A failure NCCL reports on lane l's communicator, else ncclSuccess. */
static ncclResult_t lane_error(const lane *l)
{
    ncclResult_t r = ncclSuccess;
    if (l->comm && ncclCommGetAsyncError(l->comm, &r) != ncclSuccess)
        r = ncclInternalError;
    return r == ncclInProgress ? ncclSuccess : r;
}

/* Wait for the event ev (NULL: all of the lane's stream), bounded and
 * watching both communicators for errors: the main lane's stream waits on
 * the mask lane's work (the device path's mask all-gather), and the mask
 * lane's may wait on the main lane's (a shared stream, or NCCL's launch
 * order), so a failure on either ends the wait at once. */
static scape_rc wait_for(nccl_impl *x, lane *l, cudaEvent_t ev, const char *what)
{
    double deadline = now_ms() + x->timeout_ms;
    for (;;) {
        cudaError_t e = scape_cuda_query(ev ? cudaEventQuery(ev) : cudaStreamQuery(l->stream));
        if (e == cudaSuccess) {
            comm_progress();
            return SCAPE_OK;
        }
        if (e != cudaErrorNotReady)
            return cuda_fail(x, e, what);
        lane *other = l == &x->main ? &x->mask : &x->main;
        ncclResult_t r = lane_error(l);
        if (r != ncclSuccess)
            return settle(x, l, r, what);
        if ((r = lane_error(other)) != ncclSuccess)
            return settle(x, other, r, what);
        TRY(wait_more(x, deadline, what));
    }
}

static scape_rc drain(nccl_impl *x, lane *l, const char *what)
{
    return wait_for(x, l, NULL, what);
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

/* A group's calls.  `first` keeps the first failure inside a group. */
static void note(ncclResult_t r, ncclResult_t *first)
{
    if (*first == ncclSuccess && r != ncclSuccess && r != ncclInProgress)
        *first = r;
}

/* ---- in place on device memory, on the main stream --------------------- */

/* Device memory: then a collective runs in place on it, enqueued on the
 * main stream, and is done when the stream reaches it (comm.h). */
static int on_device(const void *p)
{
    struct cudaPointerAttributes at;
    if (p == NULL || cudaPointerGetAttributes(&at, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged;
}

/* One grouped round of per-owner calls (ncclReduce or ncclBroadcast) on
 * lane l over segments at buf + off[q], counts[q] elements of `elem` bytes;
 * enqueued, not waited for. */
static scape_rc dev_grouped(nccl_impl *x, lane *l, const comm_t *c, char *buf,
                            const size_t *counts, size_t elem, int reduce, const char *what)
{
    size_t off = 0;
    ncclResult_t first = ncclSuccess;
    ncclResult_t r = ncclGroupStart();
    for (int q = 0; (r == ncclSuccess || r == ncclInProgress) && q < c->size; q++) {
        char *seg = buf + off * elem;
        if (counts[q])
            note(reduce ? ncclReduce(seg, seg, counts[q], ncclFloat32, ncclSum, q, l->comm,
                                     l->stream)
                        : ncclBroadcast(seg, seg, counts[q] * elem, ncclUint8, q, l->comm,
                                        l->stream),
                 &first);
        off += counts[q];
    }
    if (r != ncclSuccess && r != ncclInProgress)
        first = r;
    return end_group(x, l, first, what);
}

/* bf16 inputs on the device (wire_values: bf16), summed as the host
 * backend sums them: every rank sends each owner its part of the owner's
 * segment in bf16 (grouped ncclSend / ncclRecv, the ring's bytes in one
 * hop), and the owner adds the R parts in fp32 in rank order
 * (kern_cuda_sum_bf16_parts), so the nccl and host backends give the same
 * bits.  NCCL's own bf16 sum would round every partial sum to bf16 along
 * its ring, which error feedback cannot give back (tests/bench/
 * bf16_sum_model.py: a median relative error of 1e-3 at 2 ranks, 6e-3 at
 * 64).  The bf16 values live in a stream-ordered buffer (cudaMallocAsync /
 * cudaFreeAsync on the main stream: nothing synchronises the device, which
 * a stalled peer could hang).  Unverified on GPU. */
static scape_rc half_alloc(nccl_impl *x, lane *l, size_t n, uint16_t **out)
{
    *out = NULL;
    CUDA_TRY(x, cudaMallocAsync((void **)out, (n ? n : 1) * sizeof **out, l->stream),
             "cudaMallocAsync (bf16 values)");
    return SCAPE_OK;
}

static scape_rc half_free(nccl_impl *x, lane *l, uint16_t *h, scape_rc rc)
{
    cudaError_t e = cudaFreeAsync(h, l->stream);
    if (rc == SCAPE_OK && e != cudaSuccess)
        return cuda_fail(x, e, "cudaFreeAsync (bf16 values)");
    return rc;
}

/* send: sum(counts) floats of bf16 numbers; recv: this rank's sums. */
static scape_rc dev_rs_bf16(nccl_impl *x, const comm_t *c, const float *send, float *recv,
                            const size_t *counts)
{
    lane *l = &x->main;
    size_t total = 0, mine = counts[c->rank], R = (size_t)c->size, at = 0;
    for (int q = 0; q < c->size; q++)
        total += counts[q];
    uint16_t *h;
    TRY(half_alloc(x, l, total + R * mine, &h));
    uint16_t *parts = h + total; /* rank q's part of this rank's segment at q * mine */
    scape_rc rc = kern_cuda_f32_to_bf16(send, h, total, l->stream);
    for (int q = 0; rc == SCAPE_OK && q < c->size; at += counts[q], q++)
        if (q == c->rank && mine) {
            cudaError_t e = cudaMemcpyAsync(parts + (size_t)q * mine, h + at, mine * 2,
                                            cudaMemcpyDeviceToDevice, l->stream);
            if (e != cudaSuccess)
                rc = cuda_fail(x, e, "copy of the own bf16 part");
        }
    if (rc == SCAPE_OK) {
        ncclResult_t first = ncclSuccess;
        ncclResult_t r = ncclGroupStart();
        at = 0;
        for (int q = 0; (r == ncclSuccess || r == ncclInProgress) && q < c->size;
             at += counts[q], q++) {
            if (q == c->rank)
                continue;
            if (counts[q])
                note(ncclSend(h + at, counts[q], ncclBfloat16, q, l->comm, l->stream), &first);
            if (mine)
                note(ncclRecv(parts + (size_t)q * mine, mine, ncclBfloat16, q, l->comm,
                              l->stream), &first);
        }
        if (r != ncclSuccess && r != ncclInProgress)
            first = r;
        rc = end_group(x, l, first, "reduce-scatter (bf16)");
    }
    if (rc == SCAPE_OK && mine)
        rc = kern_cuda_sum_bf16_parts(parts, (unsigned)R, mine, recv, l->stream);
    return half_free(x, l, h, rc);
}

static scape_rc dev_allgather(nccl_impl *x, lane *l, const comm_t *c, const void *send,
                              void *recv, const size_t *counts, const char *what);

static scape_rc dev_allreduce(nccl_impl *x, const comm_t *c, float *buf, size_t n, int bf16)
{
    TRY(usable(x));
    lane *l = &x->main;
    if (!bf16)
        return settle(x, l, ncclAllReduce(buf, buf, n, ncclFloat32, ncclSum, l->comm,
                                          l->stream), "all-reduce");
    /* equal segments, as the host backend's: its reduce-scatter, then an
     * all-gather of the fp32 sums */
    size_t R = (size_t)c->size, per = (n + R - 1) / R, *cnt = malloc(2 * R * sizeof *cnt);
    if (cnt == NULL)
        return scape_set_error(SCAPE_NOMEM, "comm nccl: out of memory");
    for (size_t q = 0; q < R; q++) {
        size_t off = per * q < n ? per * q : n;
        cnt[q] = n - off < per ? n - off : per;
        cnt[R + q] = cnt[q] * sizeof(float);
    }
    size_t own = per * (size_t)c->rank < n ? per * (size_t)c->rank : n;
    scape_rc rc = dev_rs_bf16(x, c, buf, buf + own, cnt);
    if (rc == SCAPE_OK)
        rc = dev_allgather(x, l, c, buf + own, buf, cnt + R, "all-reduce (bf16 values)");
    free(cnt);
    return rc;
}

static scape_rc dev_broadcast(nccl_impl *x, void *buf, size_t bytes, int root)
{
    TRY(usable(x));
    lane *l = &x->main;
    return settle(x, l, ncclBroadcast(buf, buf, bytes, ncclUint8, root, l->comm, l->stream),
                  "broadcast");
}

/* Uneven segments: one ncclReduce per owner, in place (recv must be this
 * rank's segment of send, as the engine passes it). */
static scape_rc dev_reduce_scatter(nccl_impl *x, const comm_t *c, const float *send,
                                   float *recv, const size_t *counts, int bf16)
{
    TRY(usable(x));
    size_t mine = 0;
    for (int q = 0; q < c->rank; q++)
        mine += counts[q];
    if (recv != send + mine)
        return scape_set_error(SCAPE_INVALID, "comm nccl: a reduce-scatter of device memory "
                               "runs in place only");
    if (!bf16)
        return dev_grouped(x, &x->main, c, (char *)send, counts, sizeof(float), 1,
                           "reduce-scatter");
    return dev_rs_bf16(x, c, send, recv, counts);
}

/* Uneven segments: one ncclBroadcast per owner, in place; a send apart from
 * its place in recv is copied there first. */
static scape_rc dev_allgather(nccl_impl *x, lane *l, const comm_t *c, const void *send,
                              void *recv, const size_t *counts, const char *what)
{
    TRY(usable(x));
    size_t mine = 0;
    for (int q = 0; q < c->rank; q++)
        mine += counts[q];
    char *place = (char *)recv + mine;
    if (place != send && counts[c->rank])
        CUDA_TRY(x, cudaMemcpyAsync(place, send, counts[c->rank], cudaMemcpyDeviceToDevice,
                                    l->stream), "copy into the all-gather's place");
    return dev_grouped(x, l, c, recv, counts, 1, 0, what);
}

/* The mask all-gather on its own lane, ordered after what the main stream
 * has enqueued (the selection and the code) and before what the main stream
 * enqueues after the wait, by two events: no host wait in between. */
static scape_rc dev_iallgather(nccl_impl *x, const comm_t *c, const void *send, void *recv,
                               const size_t *counts)
{
    TRY(usable(x));
    if (x->selected == NULL) {
        CUDA_TRY(x, cudaEventCreateWithFlags(&x->selected, cudaEventDisableTiming),
                 "cudaEventCreate");
        CUDA_TRY(x, cudaEventCreateWithFlags(&x->gathered, cudaEventDisableTiming),
                 "cudaEventCreate");
    }
    CUDA_TRY(x, cudaEventRecord(x->selected, x->main.stream), "cudaEventRecord");
    CUDA_TRY(x, cudaStreamWaitEvent(x->mask.stream, x->selected, 0), "cudaStreamWaitEvent");
    TRY(dev_allgather(x, &x->mask, c, send, recv, counts, "mask all-gather"));
    CUDA_TRY(x, cudaEventRecord(x->gathered, x->mask.stream), "cudaEventRecord");
    x->mask_on_device = 1;
    return SCAPE_OK;
}

/* ---- blocking collectives on the main lane, streamed ------------------- */

/* One streamed collective: `nseg` segments of host bytes (segment q at
 * off[q], len[q] bytes, in both src and dst), each advanced by `piece` bytes
 * a round.  In a round, the pieces sit one after another in the slot; the
 * ones of `in_seg` (-1: all, NO_INPUT: none) are copied in, the collective runs, and the ones
 * of `out_seg` (-1: all) come back, or (reduce) the `out_seg` result that
 * the collective left after the pieces. */
#define NO_INPUT (-2)

typedef struct sop {
    const char *what;
    int nseg;
    const size_t *off, *len;
    size_t piece;
    const char *src;      /* segment q's input at src + off[q] ... */
    const char *in_at;    /* ... or, when set, in_seg's at in_at */
    char *dst;            /* segment q's output at dst + off[q] ... */
    char *out_at;         /* ... or, when set, out_seg's at out_at */
    int in_seg, out_seg;
    int reduce_out;       /* the round's result for out_seg follows its pieces */
    /* enqueue the round's collective: pieces at dev + pos[q], n[q] bytes */
    ncclResult_t (*run)(const struct sop *o, lane *l, char *dev, const size_t *pos,
                        const size_t *n, ncclResult_t *first);
    int root;             /* broadcast */
} sop;

/* Bytes of segment q in round c. */
static size_t piece_len(const sop *o, int q, size_t c)
{
    size_t at = c * o->piece;
    return at >= o->len[q] ? 0 : (o->len[q] - at < o->piece ? o->len[q] - at : o->piece);
}

static size_t rounds_of(const sop *o)
{
    size_t most = 0;
    for (int q = 0; q < o->nseg; q++)
        most = o->len[q] > most ? o->len[q] : most;
    return (most + o->piece - 1) / o->piece;
}

static scape_rc slots_ready(nccl_impl *x, lane *l)
{
    if (l->slot_cap)
        return SCAPE_OK;
    CUDA_TRY(x, cudaStreamCreateWithFlags(&l->cin, cudaStreamNonBlocking),
             "cudaStreamCreateWithFlags (copies in)");
    CUDA_TRY(x, cudaStreamCreateWithFlags(&l->cout, cudaStreamNonBlocking),
             "cudaStreamCreateWithFlags (copies out)");
    for (int b = 0; b < 2; b++) {
        CUDA_TRY(x, cudaMalloc(&l->sdev[b], NC_SLOT_BYTES), "cudaMalloc (streaming slot)");
        CUDA_TRY(x, cudaMallocHost(&l->spin[b], NC_SLOT_BYTES),
                 "cudaMallocHost (streaming slot)");
        CUDA_TRY(x, cudaEventCreateWithFlags(&l->ev[b], cudaEventDisableTiming),
                 "cudaEventCreate");
        CUDA_TRY(x, cudaEventCreateWithFlags(&l->ein[b], cudaEventDisableTiming),
                 "cudaEventCreate");
        CUDA_TRY(x, cudaEventCreateWithFlags(&l->ecoll[b], cudaEventDisableTiming),
                 "cudaEventCreate");
    }
    l->slot_cap = NC_SLOT_BYTES;
    return SCAPE_OK;
}

/* Wait until slot b's last round is back in pinned memory. */
static scape_rc slot_wait(nccl_impl *x, lane *l, int b, const char *what)
{
    return wait_for(x, l, l->ev[b], what);
}

/* The places of round c's pieces in a slot; returns the bytes they take. */
static size_t round_layout(const sop *o, size_t c, size_t *pos, size_t *n)
{
    size_t at = 0;
    for (int q = 0; q < o->nseg; q++) {
        pos[q] = at;
        n[q] = piece_len(o, q, c);
        at += n[q];
    }
    return at;
}

/* Round c's output, back in spin[c % 2], into dst. */
static void round_out(const sop *o, lane *l, size_t c, size_t *pos, size_t *n)
{
    size_t used = round_layout(o, c, pos, n);
    const char *pin = l->spin[c & 1];
    for (int q = 0; q < o->nseg; q++) {
        if ((o->out_seg >= 0 && q != o->out_seg) || n[q] == 0)
            continue;
        char *to = o->out_at ? o->out_at : o->dst + o->off[q];
        memcpy(to + c * o->piece, pin + (o->reduce_out ? used : pos[q]), n[q]);
    }
}

static scape_rc stream_op(nccl_impl *x, lane *l, const sop *o, size_t *pos, size_t *n)
{
    TRY(usable(x));
    TRY(slots_ready(x, l));
    /* An earlier op that failed part-way (and did not abort the comm) may
     * have left copies in flight into these slots: let them land first.
     * After an op that finished, both events have long fired. */
    for (int b = 0; b < 2; b++)
        TRY(slot_wait(x, l, b, o->what));
    size_t rounds = rounds_of(o);
    for (size_t c = 0; c < rounds; c++) {
        int b = (int)(c & 1);
        if (c >= 2) {
            TRY(slot_wait(x, l, b, o->what));
            round_out(o, l, c - 2, pos, n);
        }
        size_t used = round_layout(o, c, pos, n);
        char *pin = l->spin[b], *dev = l->sdev[b];
        size_t lo = SIZE_MAX, hi = 0;  /* the span copied in */
        for (int q = 0; q < o->nseg; q++) {
            if (o->in_seg == NO_INPUT || (o->in_seg >= 0 && q != o->in_seg) || n[q] == 0)
                continue;
            const char *from = o->in_at ? o->in_at : o->src + o->off[q];
            memcpy(pin + pos[q], from + c * o->piece, n[q]);
            lo = pos[q] < lo ? pos[q] : lo;
            hi = pos[q] + n[q] > hi ? pos[q] + n[q] : hi;
        }
        /* The slot is free on the device too: round c - 2's copy out (the
         * last to touch it) is done, as slot_wait saw. */
        if (hi > lo)
            CUDA_TRY(x, cudaMemcpyAsync(dev + lo, pin + lo, hi - lo, cudaMemcpyHostToDevice,
                                        l->cin), "copy to the device");
        CUDA_TRY(x, cudaEventRecord(l->ein[b], l->cin), "cudaEventRecord");
        CUDA_TRY(x, cudaStreamWaitEvent(l->stream, l->ein[b], 0), "cudaStreamWaitEvent");
        ncclResult_t first = ncclSuccess;
        ncclResult_t r = ncclGroupStart();
        if (r == ncclSuccess || r == ncclInProgress)
            r = o->run(o, l, dev, pos, n, &first);
        ncclResult_t g = ncclGroupEnd();
        TRY(settle(x, l, r == ncclSuccess || r == ncclInProgress ? g : r, o->what));
        TRY(settle(x, l, first, o->what));
        /* back: the result area (reduce) or the pieces that are wanted */
        size_t blo = o->reduce_out ? used : 0;
        size_t bhi = o->reduce_out ? used + (o->out_seg >= 0 ? n[o->out_seg] : 0) : used;
        if (!o->reduce_out && o->out_seg >= 0) {
            blo = pos[o->out_seg];
            bhi = blo + n[o->out_seg];
        }
        CUDA_TRY(x, cudaEventRecord(l->ecoll[b], l->stream), "cudaEventRecord");
        CUDA_TRY(x, cudaStreamWaitEvent(l->cout, l->ecoll[b], 0), "cudaStreamWaitEvent");
        if (bhi > blo)
            CUDA_TRY(x, cudaMemcpyAsync(pin + blo, dev + blo, bhi - blo, cudaMemcpyDeviceToHost,
                                        l->cout), "copy to the host");
        CUDA_TRY(x, cudaEventRecord(l->ev[b], l->cout), "cudaEventRecord");
    }
    for (size_t c = rounds > 2 ? rounds - 2 : 0; c < rounds; c++) {
        TRY(slot_wait(x, l, (int)(c & 1), o->what));
        round_out(o, l, c, pos, n);
    }
    return SCAPE_OK;
}

/* Largest piece (a multiple of 16 bytes) with which a round's pieces, plus
 * a reduce's result, fit in one slot. */
static size_t piece_for(int nseg, int reduce_out)
{
    size_t p = NC_SLOT_BYTES / (size_t)(nseg + (reduce_out ? 1 : 0));
    p -= p % 16;
    return p ? p : 16;
}


static ncclResult_t run_allreduce(const sop *o, lane *l, char *dev, const size_t *pos,
                                  const size_t *n, ncclResult_t *first)
{
    ncclResult_t r = ncclAllReduce(dev + pos[0], dev + pos[0], n[0] / sizeof(float),
                                   ncclFloat32, ncclSum, l->comm, l->stream);
    (void)o;
    note(r, first);
    return ncclSuccess;
}

static ncclResult_t run_broadcast(const sop *o, lane *l, char *dev, const size_t *pos,
                                  const size_t *n, ncclResult_t *first)
{
    note(ncclBroadcast(dev + pos[0], dev + pos[0], n[0], ncclUint8, o->root, l->comm,
                       l->stream), first);
    return ncclSuccess;
}

/* Reduce-scatter as one reduce per owner: piece q summed onto rank q, into
 * the result area after the pieces. */
static ncclResult_t run_reduce(const sop *o, lane *l, char *dev, const size_t *pos,
                               const size_t *n, ncclResult_t *first)
{
    size_t used = pos[o->nseg - 1] + n[o->nseg - 1];
    for (int q = 0; q < o->nseg; q++)
        if (n[q])
            note(ncclReduce(dev + pos[q], dev + used, n[q] / sizeof(float), ncclFloat32,
                            ncclSum, q, l->comm, l->stream), first);
    return ncclSuccess;
}

/* All-gather as one broadcast per owner. */
static ncclResult_t run_gather(const sop *o, lane *l, char *dev, const size_t *pos,
                               const size_t *n, ncclResult_t *first)
{
    for (int q = 0; q < o->nseg; q++)
        if (n[q])
            note(ncclBroadcast(dev + pos[q], dev + pos[q], n[q], ncclUint8, q, l->comm,
                               l->stream), first);
    return ncclSuccess;
}

/* A collective that failed on this rank, for whatever reason (a CUDA call,
 * memory, a kernel, an argument): its peers are in it or about to enter it,
 * and this rank will not follow, so the communicators are aborted and the
 * peers learn so at once instead of at their timeout. */
static scape_rc failed(nccl_impl *x, scape_rc rc)
{
    if (rc == SCAPE_OK || x->aborted)
        return rc;
    char why[512];
    snprintf(why, sizeof why, "%s", scape_last_error());
    abort_all(x);
    return scape_set_error(rc, "%s; the communicators were aborted", why);
}

/* bf16 inputs: on device memory 16 bits a value, summed in fp32 in rank
 * order (dev_rs_bf16); host memory goes through the staging slots as the
 * fp32 numbers it holds. */
static scape_rc nc_allreduce(comm_t *c, float *buf, size_t n, int bf16)
{
    nccl_impl *x = c->impl;
    if (n && on_device(buf))
        return failed(x, dev_allreduce(x, c, buf, n, bf16));
    size_t off = 0, len = n * sizeof(float), pos, cnt;
    sop o = { .what = "all-reduce", .nseg = 1, .off = &off, .len = &len,
              .piece = piece_for(1, 0), .src = (const char *)buf, .dst = (char *)buf,
              .in_seg = -1, .out_seg = -1, .run = run_allreduce };
    return n ? failed(x, stream_op(x, &x->main, &o, &pos, &cnt)) : usable(x);
}

static scape_rc nc_broadcast(comm_t *c, void *buf, size_t bytes, int root)
{
    nccl_impl *x = c->impl;
    if (bytes && on_device(buf))
        return failed(x, dev_broadcast(x, buf, bytes, root));
    size_t off = 0, pos, cnt;
    /* Only the root's bytes go in; the others' arrive. */
    sop o = { .what = "broadcast", .nseg = 1, .off = &off, .len = &bytes,
              .piece = piece_for(1, 0), .src = buf, .dst = buf,
              .in_seg = c->rank == root ? -1 : NO_INPUT, .out_seg = -1, .run = run_broadcast,
              .root = root };
    return bytes ? failed(x, stream_op(x, &x->main, &o, &pos, &cnt)) : usable(x);
}

/* Per-segment byte offsets and lengths of a collective with per-rank counts
 * of `elem` bytes, and the scratch for round layouts: 4 arrays of size. */
static size_t *seg_arrays(const comm_t *c, const size_t *counts, size_t elem)
{
    size_t R = (size_t)c->size, *a = malloc(4 * R * sizeof *a), at = 0;
    for (size_t q = 0; a && q < R; q++) {
        a[q] = at;
        a[R + q] = counts[q] * elem;
        at += a[R + q];
    }
    return a;
}

static scape_rc nc_reduce_scatter(comm_t *c, const float *send, float *recv,
                                  const size_t *counts, int bf16)
{
    nccl_impl *x = c->impl;
    if (on_device(send))
        return failed(x, dev_reduce_scatter(x, c, send, recv, counts, bf16));
    size_t R = (size_t)c->size, *a = seg_arrays(c, counts, sizeof(float));
    if (a == NULL)
        return failed(x, scape_set_error(SCAPE_NOMEM, "comm nccl: out of memory"));
    /* The result lands at recv, which may be this rank's segment of send: the
     * pieces of round c are read before round c's result is written back,
     * and each round writes only the bytes that round read. */
    sop o = { .what = "reduce-scatter", .nseg = c->size, .off = a, .len = a + R,
              .piece = piece_for(c->size, 1), .src = (const char *)send,
              .out_at = (char *)recv, .in_seg = -1, .out_seg = c->rank,
              .reduce_out = 1, .run = run_reduce };
    scape_rc rc = stream_op(x, &x->main, &o, a + 2 * R, a + 3 * R);
    free(a);
    return failed(x, rc);
}

static scape_rc nc_allgather(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    nccl_impl *x = c->impl;
    if (on_device(recv))
        return failed(x, dev_allgather(x, &x->main, c, send, recv, counts, "all-gather"));
    size_t R = (size_t)c->size, *a = seg_arrays(c, counts, 1);
    if (a == NULL)
        return failed(x, scape_set_error(SCAPE_NOMEM, "comm nccl: out of memory"));
    sop o = { .what = "all-gather", .nseg = c->size, .off = a, .len = a + R,
              .piece = piece_for(c->size, 0), .in_at = send, .dst = recv,
              .in_seg = c->rank, .out_seg = -1, .run = run_gather };
    scape_rc rc = stream_op(x, &x->main, &o, a + 2 * R, a + 3 * R);
    free(a);
    return failed(x, rc);
}

/* bf16 reductions go in 16 bits on device memory only. */
static int nc_wire_bf16(const comm_t *c, const void *buf)
{
    (void)c;
    return buf != NULL && on_device(buf);
}

static scape_rc nc_barrier(comm_t *c)
{
    float one = 1.0f;
    return nc_allreduce(c, &one, 1, 0);
}

/* ---- the lagged mask all-gather on its own lane ------------------------ */

/* Copy this rank's code in and start one broadcast per owner (an all-gather
 * of uneven segments), then the copy of all of it back to pinned memory;
 * *total is the gathered size in bytes.  Staged whole: masks are small. */
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

static scape_rc nc_iallgather(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    nccl_impl *x = c->impl;
    if (on_device(recv))
        return failed(x, dev_iallgather(x, c, send, recv, counts));
    size_t total = 0;
    TRY(failed(x, gather_start(x, &x->mask, c, send, counts, &total, "mask all-gather")));
    x->mask_recv = recv;
    x->mask_bytes = total;
    return SCAPE_OK;
}

static scape_rc nc_iallgather_wait(comm_t *c)
{
    nccl_impl *x = c->impl;
    TRY(usable(x));
    if (x->mask_on_device) {
        x->mask_on_device = 0;
        CUDA_TRY(x, cudaStreamWaitEvent(x->main.stream, x->gathered, 0),
                 "cudaStreamWaitEvent");
        return SCAPE_OK;
    }
    TRY(drain(x, &x->mask, "mask all-gather"));
    if (x->mask_bytes)
        memcpy(x->mask_recv, x->mask.pinned, x->mask_bytes);
    x->mask_bytes = 0;
    return SCAPE_OK;
}

/* ---- life ------------------------------------------------------------------ */

static void lane_free(lane *l)
{
    cudaStream_t copies[2] = { l->cin, l->cout };
    for (int i = 0; i < 2; i++)
        if (copies[i]) {
            cudaStreamSynchronize(copies[i]); /* copies end, even after an abort */
            cudaStreamDestroy(copies[i]);
        }
    for (int b = 0; b < 2; b++) {
        if (l->ev[b])
            cudaEventDestroy(l->ev[b]);
        if (l->ein[b])
            cudaEventDestroy(l->ein[b]);
        if (l->ecoll[b])
            cudaEventDestroy(l->ecoll[b]);
        if (l->sdev[b])
            cudaFree(l->sdev[b]);
        if (l->spin[b])
            cudaFreeHost(l->spin[b]);
    }
    if (l->comm)
        ncclCommDestroy(l->comm); /* finalized (close_lanes): does not wait for peers */
    if (l->stream && !l->borrowed) {
        cudaStreamSynchronize(l->stream);
        cudaStreamDestroy(l->stream);
    }
    if (l->dev)
        cudaFree(l->dev);
    if (l->pinned)
        cudaFreeHost(l->pinned);
    memset(l, 0, sizeof *l);
}

/* Finalize both communicators and wait, bounded, until they are quiescent;
 * abort them if that fails or takes past the deadline (a peer gone). */
static void close_lanes(nccl_impl *x)
{
    lane *ls[2] = { &x->main, &x->mask };
    ncclResult_t r[2] = { ncclSuccess, ncclSuccess };
    for (int i = 0; i < 2; i++)
        if (ls[i]->comm)
            r[i] = ncclCommFinalize(ls[i]->comm);
    /* the peers close at about the same time (scancel signals them all) */
    double deadline = now_ms() + (x->timeout_ms < NC_CLOSE_MS ? x->timeout_ms : NC_CLOSE_MS);
    for (int i = 0; i < 2; i++)
        while (ls[i]->comm && r[i] == ncclInProgress) {
            if (now_ms() > deadline) {
                abort_all(x);
                return;
            }
            if (ncclCommGetAsyncError(ls[i]->comm, &r[i]) != ncclSuccess)
                r[i] = ncclInternalError;
            if (r[i] == ncclInProgress)
                nap();
        }
    if ((ls[0]->comm && r[0] != ncclSuccess) || (ls[1]->comm && r[1] != ncclSuccess))
        abort_all(x);
}

static void nc_destroy(comm_t *c)
{
    nccl_impl *x = c->impl;
    if (x) {
        close_lanes(x);
        lane_free(&x->mask);
        lane_free(&x->main);
        if (x->selected)
            cudaEventDestroy(x->selected);
        if (x->gathered)
            cudaEventDestroy(x->gathered);
        free(x);
    }
    free(c);
}

static uint64_t nc_device_bytes(const comm_t *c)
{
    const nccl_impl *x = c->impl;
    return (uint64_t)x->main.dev_cap + (uint64_t)x->mask.dev_cap + 2 * (uint64_t)x->main.slot_cap;
}

/* A stream with work still queued (NotReady); an error counts as quiet:
 * nothing more will complete there anyway.  Neither answer stays the
 * thread's last error. */
static int stream_busy(cudaStream_t st)
{
    cudaError_t e = cudaStreamQuery(st);
    scape_cuda_quietly(e);
    return e == cudaErrorNotReady;
}

static int nc_quiet(const comm_t *c)
{
    const nccl_impl *x = c->impl;
    const lane *ls[] = { &x->main, &x->mask };
    for (int i = 0; i < 2; i++) {
        const lane *l = ls[i];
        if ((l->stream && stream_busy(l->stream)) || (l->cin && stream_busy(l->cin)) ||
            (l->cout && stream_busy(l->cout)))
            return 0;
    }
    return 1;
}

static void *nc_device_stream(const comm_t *c)
{
    const nccl_impl *x = c->impl;
    return x->main.stream;
}

/* Bounded, like every wait here: the main stream, watching for NCCL errors
 * (a peer gone aborts both communicators). */
static scape_rc nc_device_sync(comm_t *c)
{
    nccl_impl *x = c->impl;
    TRY(usable(x));
    return drain(x, &x->main, "the device work of the step");
}

static const comm_ops s_nccl_ops = {
    .name = "nccl",
    .allreduce_sum = nc_allreduce,
    .reduce_scatter_sum = nc_reduce_scatter,
    .wire_bf16 = nc_wire_bf16,
    .allgather = nc_allgather,
    .iallgather = nc_iallgather,
    .iallgather_wait = nc_iallgather_wait,
    .broadcast = nc_broadcast,
    .barrier = nc_barrier,
    .destroy = nc_destroy,
    .device_bytes = nc_device_bytes,
    .quiet = nc_quiet,
    .device_stream = nc_device_stream,
    .device_sync = nc_device_sync,
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

/* stream: NULL to create the lane's own, else the one it shares. */
static scape_rc lane_init(nccl_impl *x, lane *l, const comm_nccl_opts *o, int which,
                          cudaStream_t stream)
{
    l->borrowed = stream != NULL;
    if (stream)
        l->stream = stream;
    else
        CUDA_TRY(x, cudaStreamCreateWithFlags(&l->stream, cudaStreamNonBlocking),
                 "cudaStreamCreateWithFlags");
    ncclUniqueId id;
    memcpy(&id, o->ids + which * COMM_NCCL_ID_BYTES, COMM_NCCL_ID_BYTES);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&l->comm, o->size, id, o->rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        if (l->comm) /* a non-blocking init may fail with its handle made */
            ncclCommAbort(l->comm);
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
    int version = 0;
    ncclResult_t vr = ncclGetVersion(&version);
    if (vr != ncclSuccess) {
        free(c);
        free(x);
        return scape_set_error(SCAPE_NCCL, "ncclGetVersion: %s", ncclGetErrorString(vr));
    }
    /* launch_order() sets it unless the environment did: a 0 there wins */
    const char *implicit = getenv("NCCL_LAUNCH_ORDER_IMPLICIT");
    int ordered = version >= NCCL_VERSION(2, 26, 0) && implicit && atoi(implicit) != 0;
    scape_rc rc = lane_init(x, &x->main, o, 0, NULL);
    if (rc == SCAPE_OK)
        rc = lane_init(x, &x->mask, o, 1, ordered ? NULL : x->main.stream);
    if (rc != SCAPE_OK) {
        abort_all(x);
        nc_destroy(c);
        return rc;
    }
    *out = c;
    return SCAPE_OK;
}
