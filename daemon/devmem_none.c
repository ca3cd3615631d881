/* devmem_none.c - a build without CUDA refuses CUDA IPC buffers (shm.h). */
#include <string.h>

#include "shm.h"

scape_rc shm_map_open_cuda(shm_map *m, const void *handle, size_t handle_len, size_t declared,
                           size_t need, int device, const char *what)
{
    (void)handle;
    (void)handle_len;
    (void)declared;
    (void)need;
    (void)device;
    memset(m, 0, sizeof *m);
    return scape_set_error(SCAPE_UNSUPPORTED, "register: %s: CUDA IPC buffers need a scaped "
                           "built with CUDA (this one is CPU-only); use host shared memory",
                           what);
}

scape_rc shm_map_pull(shm_map *m, size_t bytes, uint64_t *copied)
{
    (void)m;
    (void)bytes;
    (void)copied;
    return SCAPE_OK;
}

scape_rc shm_map_push(shm_map *m, size_t bytes, uint64_t *copied)
{
    (void)m;
    (void)bytes;
    (void)copied;
    return SCAPE_OK;
}

void shm_map_close_cuda(shm_map *m) { memset(m, 0, sizeof *m); }
