/* lsc_cuda_none.c - libscape without CUDA: device buffers are refused. */
#include <string.h>

#include "lsc_cuda.h"

scape_rc lsc_cuda_alloc(lsc_dev_buf *b, int device, size_t bytes)
{
    (void)device;
    (void)bytes;
    memset(b, 0, sizeof *b);
    return scape_set_error(SCAPE_UNSUPPORTED, "scape_attach: this libscape was built without "
                           "CUDA, so it cannot allocate CUDA buffers; use SCAPE_MEMORY_HOST");
}

void lsc_cuda_free(lsc_dev_buf *b) { memset(b, 0, sizeof *b); }

scape_rc lsc_cuda_sync(int device)
{
    (void)device;
    return SCAPE_OK;
}
