/* lsc_cuda.c - libscape's device buffers (lsc_cuda.h). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
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

typedef int (*get_range_fn)(unsigned long long *base, size_t *size, unsigned long long ptr);

/* The driver's cuMemGetAddressRange, from the libcuda the runtime loaded. */
static get_range_fn address_range(void)
{
    static get_range_fn fn;
    if (fn == NULL) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (h == NULL)
            h = dlopen("libcuda.so.1", RTLD_NOW);
        if (h)
            fn = (get_range_fn)dlsym(h, "cuMemGetAddressRange_v2");
    }
    return fn;
}

scape_rc lsc_cuda_alloc(lsc_dev_buf *b, int device, size_t bytes)
{
    memset(b, 0, sizeof *b);
    LSC_CUDA_TRY(cudaSetDevice(device));
    size_t whole = (bytes + LSC_ALLOC_GRANULE - 1) / LSC_ALLOC_GRANULE * LSC_ALLOC_GRANULE;
    LSC_CUDA_TRY(cudaMalloc(&b->ptr, whole ? whole : LSC_ALLOC_GRANULE));
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
    get_range_fn range = address_range();
    unsigned long long base = 0;
    size_t size = 0;
    if (e == cudaSuccess && (range == NULL ||
                             range(&base, &size, (unsigned long long)(uintptr_t)b->ptr) != 0))
        e = cudaErrorUnknown; /* the offset cannot be told: do not hand out the buffer */
    if (e != cudaSuccess) {
        cudaFree(b->ptr);
        memset(b, 0, sizeof *b);
        return scape_set_error(SCAPE_CUDA, "libscape: exporting a device buffer: %s",
                               e == cudaErrorUnknown ? "cannot measure its allocation "
                                                      "(cuMemGetAddressRange)"
                                                    : cudaGetErrorString(e));
    }
    memcpy(b->handle, &h, sizeof h);
    b->offset = (size_t)((unsigned long long)(uintptr_t)b->ptr - base);
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
