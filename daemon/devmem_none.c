/* devmem_none.c - a build without CUDA refuses CUDA IPC buffers (shm.h). */
#include <string.h>

#include "shm.h"

scape_rc shm_map_open_cuda(shm_map *m, const void *handle, size_t handle_len, size_t offset,
                           size_t declared, size_t need, int device, int from, int mirror,
                           const char *what)
{
    (void)from;
    (void)mirror;
    (void)offset;
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

scape_rc shm_map_pin(shm_map *m, const char *what)
{
    (void)m;
    return scape_set_error(SCAPE_UNSUPPORTED, "%s: this scaped is built without CUDA", what);
}

void shm_map_unpin(shm_map *m) { m->pinned = 0; }

scape_rc shm_map_read(const shm_map *m, void *dst, size_t bytes)
{
    if (bytes > m->bytes || m->addr == NULL)
        return scape_set_error(SCAPE_INVALID, "read of %zu bytes from a %zu-byte buffer", bytes,
                               m->bytes);
    memcpy(dst, m->addr, bytes);
    return SCAPE_OK;
}

scape_rc shm_map_write(shm_map *m, const void *src, size_t bytes)
{
    if (bytes > m->bytes || m->addr == NULL)
        return scape_set_error(SCAPE_INVALID, "write of %zu bytes into a %zu-byte buffer", bytes,
                               m->bytes);
    memcpy(m->addr, src, bytes);
    return SCAPE_OK;
}

scape_rc shm_map_open_event(shm_map *m, const void *handle, size_t handle_len,
                            const char *what)
{
    (void)m;
    (void)handle;
    (void)handle_len;
    return scape_set_error(SCAPE_UNSUPPORTED, "register: %s: interprocess CUDA events need a "
                           "scaped built with CUDA (this one is CPU-only)", what);
}

scape_rc shm_map_export_event(shm_map *m, unsigned char *handle, const char *what)
{
    (void)m;
    (void)handle;
    return scape_set_error(SCAPE_UNSUPPORTED, "register: %s: interprocess CUDA events need a "
                           "scaped built with CUDA (this one is CPU-only)", what);
}

scape_rc shm_map_cuda_device(const unsigned char *uuid, int *ordinal, const char *what)
{
    (void)uuid;
    (void)ordinal;
    return scape_set_error(SCAPE_UNSUPPORTED, "register: %s: CUDA IPC buffers need a scaped "
                           "built with CUDA (this one is CPU-only)", what);
}

scape_rc shm_map_event_done(const shm_map *m, int *done, const char *what)
{
    (void)m;
    (void)what;
    *done = 1;
    return SCAPE_OK;
}

scape_rc shm_map_record_event(shm_map *m, const char *what)
{
    (void)m;
    (void)what;
    return SCAPE_OK;
}
