/* scape_cuda_err.h - a failed CUDA runtime call, for the host code that
 * calls the runtime directly (scaped's devmem, libscape's device buffers).
 *
 * The runtime keeps a failure as the thread's last error, and the next
 * kernel launch's check (the engine's, or torch's in a trainer) would
 * report it as its own: the message of a failure is taken together with
 * clearing it, and calls whose failure changes nothing (a close, a
 * destroy, a free) drop theirs.  Only for files built with CUDA. */
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

#endif /* SCAPE_CUDA_ERR_H */
