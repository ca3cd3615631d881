/* dev.h - memory, streams, events and launches under the device executor.
 *
 * exec_dev.c writes the cuda executor once against this table; two
 * implementations fill it:
 *  - dev_cuda.c: the CUDA runtime.  Device and pinned allocations, copies
 *    and launches on three streams (the main one, which is the nccl comm's
 *    when it has one, and one each for copies in and out), events.
 *  - dev_sim.c: a CPU model of the same.  "Device" memory is host memory
 *    the engine must not touch; every copy, fill, event and launch (the
 *    kernels' CPU versions, kernels/cpu_seg.c) is queued on its stream and
 *    runs only when the host waits (sync), in a random order that keeps just
 *    the dependencies the caller declared: each stream's order and the event
 *    waits.  A missing wait then shows as a wrong result in the CPU tests,
 *    where on a GPU it would be a race.
 */
#ifndef SCAPE_DEV_H
#define SCAPE_DEV_H

#include <stddef.h>

#include "comm.h"
#include "scape_seg.h"

enum {
    DEV_MAIN = 0,   /* kernels, collectives, everything ordered with them */
    DEV_IN,         /* copies of the streamed residual into the device */
    DEV_OUT,        /* and back */
    DEV_STREAMS
};

#define DEV_EVENTS 64 /* events of a dev, numbered 0 .. DEV_EVENTS - 1 */

typedef struct dev dev_t;

typedef struct dev_ops {
    const char *name;
    int host_addressable; /* its device memory is host memory (the sim) */
    /* A context on CUDA device `device` whose main stream is `main` (the
     * comm's, a cudaStream_t) or its own when NULL; waits give up after
     * timeout_ms, or with the comm's bounded wait when the main stream is
     * the comm's.  seed orders the simulation. */
    scape_rc (*create)(dev_t **out, int device, void *main, comm_t *comm, int timeout_ms,
                       unsigned long seed);
    void (*destroy)(dev_t *d);
    /* Device memory (pinned = 0) or pinned host memory (1), zeroed. */
    scape_rc (*alloc)(dev_t *d, size_t bytes, int pinned, void **out);
    void (*release)(dev_t *d, void *p, int pinned);
    /* Enqueue on stream s: a copy between any two of device, pinned or
     * trainer memory; zero bytes; record event ev; make s wait for ev's
     * last record; kernel k with its arguments (copied). */
    scape_rc (*copy)(dev_t *d, int s, void *dst, const void *src, size_t bytes);
    scape_rc (*zero)(dev_t *d, int s, void *dst, size_t bytes);
    scape_rc (*record)(dev_t *d, int s, int ev);
    scape_rc (*wait)(dev_t *d, int s, int ev);
    scape_rc (*launch)(dev_t *d, int s, kseg_kernel k, const void *args);
    /* Wait until every stream has run all its work. */
    scape_rc (*sync)(dev_t *d);
    /* Seconds between two recorded and completed events (timing events),
     * or -1 when the dev does not time on the device. */
    double (*elapsed)(dev_t *d, int ev0, int ev1);
    /* The address kernels use for a trainer's buffer of `bytes` at p:
     * device memory or pinned host memory (*on_host says which); anything
     * else is refused. */
    scape_rc (*resolve)(dev_t *d, const void *p, size_t bytes, const void **out, int *on_host);
    /* A wait for the device failed: work may still be running on it (and
     * reading or writing trainers' buffers), so nothing it may touch can be
     * freed or unmapped.  NULL: never. */
    int (*stuck)(const dev_t *d);
} dev_ops;

extern const dev_ops dev_cuda_ops; /* UNSUPPORTED at create without CUDA */
extern const dev_ops dev_sim_ops;

#endif /* SCAPE_DEV_H */
