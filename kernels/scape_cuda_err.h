/* scape_cuda_err.h - a failed CUDA runtime call, for the host code that
 * calls the runtime directly (scaped's devmem, libscape's device buffers).
 *
 * The runtime keeps a failure as the thread's last error, and the next
 * kernel launch's check (the engine's, or torch's in a trainer) would
 * report it as its own: the message of a failure is taken together with
 * clearing it, and calls whose failure changes nothing (a close, a
 * destroy, a free) drop theirs; so do polled queries that answer "not
 * yet".  Only for files built with CUDA. */
#ifndef SCAPE_CUDA_ERR_H
#define SCAPE_CUDA_ERR_H

#include <cuda_runtime.h>

/* The message of a failed call, its error taken off the thread. */
static inline const char *scape_cuda_failed(cudaError_t e)
{
    (void)cudaGetLastError();
    return cudaGetErrorString(e);
}

/* A call whose failure changes nothing for the caller: its error dropped. */
static inline void scape_cuda_quietly(cudaError_t e)
{
    if (e != cudaSuccess)
        (void)cudaGetLastError();
}

/* The answer of a query (cudaEventQuery, cudaStreamQuery) that is polled:
 * "not yet" (cudaErrorNotReady) is no failure, but the runtime keeps it as
 * the thread's last error like one, where the next check of
 * cudaGetLastError (after a launch, after a wait) would take it for a
 * failure of its own; it is taken off the thread here. */
static inline cudaError_t scape_cuda_query(cudaError_t e)
{
    if (e == cudaErrorNotReady)
        (void)cudaGetLastError();
    return e;
}

#endif /* SCAPE_CUDA_ERR_H */
