/* lsc_cuda.c - libscape's device buffers (lsc_cuda.h). */
#include <string.h>

#include <cuda_runtime.h>

#include "lsc_cuda.h"

_Static_assert(sizeof(cudaIpcMemHandle_t) == LSC_IPC_HANDLE_BYTES, "IPC handle size");

#define LSC_CUDA_TRY(call)                                                     \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess)                                                 \
            return scape_set_error(SCAPE_CUDA, "libscape: %s: %s", #call,      \
                                   cudaGetErrorString(e_));                    \
    } while (0)

scape_rc lsc_cuda_alloc(lsc_dev_buf *b, int device, size_t bytes)
{
    memset(b, 0, sizeof *b);
    LSC_CUDA_TRY(cudaSetDevice(device));
    LSC_CUDA_TRY(cudaMalloc(&b->ptr, bytes ? bytes : 1));
    b->bytes = bytes;
    b->device = device;
    cudaIpcMemHandle_t h;
    /* The daemon reads the buffers from another process: the zeros must be
     * there before anyone can be told about them. */
    cudaError_t e = cudaMemset(b->ptr, 0, bytes);
    if (e == cudaSuccess)
        e = cudaDeviceSynchronize();
    if (e == cudaSuccess)
        e = cudaIpcGetMemHandle(&h, b->ptr);
    if (e != cudaSuccess) {
        cudaFree(b->ptr);
        memset(b, 0, sizeof *b);
        return scape_set_error(SCAPE_CUDA, "libscape: exporting a device buffer: %s",
                               cudaGetErrorString(e));
    }
    memcpy(b->handle, &h, sizeof h);
    return SCAPE_OK;
}

void lsc_cuda_free(lsc_dev_buf *b)
{
    if (b->ptr) {
        cudaSetDevice(b->device);
        cudaDeviceSynchronize(); /* cudaFree need not wait for work on the buffer */
        cudaFree(b->ptr);
    }
    memset(b, 0, sizeof *b);
}

scape_rc lsc_cuda_sync(int device)
{
    LSC_CUDA_TRY(cudaSetDevice(device));
    LSC_CUDA_TRY(cudaDeviceSynchronize());
    return SCAPE_OK;
}
