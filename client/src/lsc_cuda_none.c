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

void lsc_cuda_free(lsc_dev_buf *b, void *stream)
{
    (void)stream;
    memset(b, 0, sizeof *b);
}

scape_rc lsc_cuda_check_ipc(int device)
{
    (void)device;
    return scape_set_error(SCAPE_UNSUPPORTED, "scape_attach: this libscape was built without "
                           "CUDA; use SCAPE_MEMORY_HOST");
}

scape_rc lsc_cuda_events_create(lsc_dev_events *ev, int device)
{
    memset(ev, 0, sizeof *ev);
    return lsc_cuda_check_ipc(device);
}

scape_rc lsc_cuda_events_open_params(lsc_dev_events *ev, const void *handle, size_t len)
{
    (void)ev;
    (void)handle;
    (void)len;
    return lsc_cuda_check_ipc(0);
}

void lsc_cuda_events_free(lsc_dev_events *ev) { memset(ev, 0, sizeof *ev); }

scape_rc lsc_cuda_grads_ready(lsc_dev_events *ev, int initial)
{
    (void)ev;
    (void)initial;
    return SCAPE_OK;
}

scape_rc lsc_cuda_params_ready(lsc_dev_events *ev)
{
    (void)ev;
    return SCAPE_OK;
}
