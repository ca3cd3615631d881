/* lsc_cuda.h - libscape's device buffers: cudaMalloc'd and exported with
 * cudaIpcGetMemHandle for the daemon to open (lsc_cuda.c), or a refusal in a
 * build without CUDA (lsc_cuda_none.c). */
#ifndef SCAPE_LSC_CUDA_H
#define SCAPE_LSC_CUDA_H

#include <stddef.h>

#include "scape/scape.h"

#define LSC_IPC_HANDLE_BYTES 64

/* Buffers are allocated in whole multiples of this, so that the CUDA
 * allocator gives each its own block rather than a piece of a shared one (a
 * handle names a whole block, neighbours included). */
#define LSC_ALLOC_GRANULE ((size_t)2 << 20)

typedef struct lsc_dev_buf {
    void *ptr;
    size_t bytes;
    int device;
    unsigned char handle[LSC_IPC_HANDLE_BYTES];
    size_t offset;    /* ptr's place in the allocation the handle names */
    unsigned char uuid[16]; /* the device's UUID (cudaDeviceProp.uuid) */
} lsc_dev_buf;

/* Ordering with the daemon by events, on the caller's stream:
 *  - grad: our interprocess event, recorded on `stream` before each Step
 *    (the daemon waits for it before it reads the gradients);
 *  - params: the daemon's (Registered.params_event), which `stream` waits
 *    for (or, blocking, the host) once the step's reply has come; NULL: a
 *    daemon that does not know events, and `stream` is synchronised before
 *    each Step instead.
 * No function here leaves the caller's current device changed, and no step
 * synchronises a whole device (attach and detach allocate and free device
 * memory, which cudaMalloc and cudaFree may synchronise). */
typedef struct lsc_dev_events {
    void *grad, *params;  /* cudaEvent_t */
    unsigned char grad_handle[LSC_IPC_HANDLE_BYTES];
    void *stream;         /* cudaStream_t; NULL: the legacy default stream */
    int blocking;         /* 1: wait for the parameters on the host */
    int device;
} lsc_dev_events;

/* Refuse, with the reason, a device where the daemon could not open our
 * buffers and events: no unified addressing, no interprocess events, CUDA
 * IPC unavailable (a MIG instance). */
scape_rc lsc_cuda_check_ipc(int device);
/* Allocate bytes (zeroed, rounded up to LSC_ALLOC_GRANULE) on device and
 * export its IPC handle and offset. */
scape_rc lsc_cuda_alloc(lsc_dev_buf *b, int device, size_t bytes);
/* After `stream`'s work on it (what the caller did with the buffer). */
void lsc_cuda_free(lsc_dev_buf *b, void *stream);
/* Our gradient-ready event, exported into ev->grad_handle; the stream is
 * the legacy default one, blocking, until scape_set_stream sets them. */
scape_rc lsc_cuda_events_create(lsc_dev_events *ev, int device);
/* The daemon's parameters-ready event from its Registered. */
scape_rc lsc_cuda_events_open_params(lsc_dev_events *ev, const void *handle, size_t len);
void lsc_cuda_events_free(lsc_dev_events *ev);
/* The gradients (or, before scape_sync, the initial parameters) that
 * ev->stream made are for the daemon to read: record the event, or without
 * the daemon's event synchronise that stream. */
scape_rc lsc_cuda_grads_ready(lsc_dev_events *ev, int initial);
/* The daemon has answered the step: order ev->stream (or the host) after
 * its parameters-ready event. */
scape_rc lsc_cuda_params_ready(lsc_dev_events *ev);

#endif /* SCAPE_LSC_CUDA_H */
