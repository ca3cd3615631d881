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
} lsc_dev_buf;

/* Allocate bytes (zeroed, rounded up to LSC_ALLOC_GRANULE) on device and
 * export its IPC handle and offset. */
scape_rc lsc_cuda_alloc(lsc_dev_buf *b, int device, size_t bytes);
void lsc_cuda_free(lsc_dev_buf *b);
/* Wait until the device has finished all work (the gradients the trainer
 * wrote), before the daemon reads the buffer. */
scape_rc lsc_cuda_sync(int device);

#endif /* SCAPE_LSC_CUDA_H */
