/* shm.h - the daemon's view of a trainer's buffer: a POSIX shared-memory
 * object mapped by name after its size has been checked, or (devmem.c) a
 * CUDA IPC buffer opened on the daemon's GPU with a pinned host copy that the
 * engine works on, pulled before and pushed after each step. */
#ifndef SCAPE_SHM_H
#define SCAPE_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "scape_rc.h"

#define SHM_NAME_MAX 128

typedef struct shm_map {
    void *addr;              /* what the engine reads and writes */
    size_t bytes;
    char name[SHM_NAME_MAX];
    void *dev;               /* CUDA IPC: the trainer's device buffer; addr is
                                a pinned host copy of it */
} shm_map;

/* Map the shm object `name` read-write.  It must hold at least `need` bytes
 * and exactly the `declared` bytes the trainer said it has.  `what` names the
 * buffer in messages ("params", "grads"). */
scape_rc shm_map_open(shm_map *m, const char *name, size_t declared, size_t need,
                      const char *what);
/* Unmap; with unlink_it, also remove the name (the owner is gone). */
void shm_map_close(shm_map *m, int unlink_it);

/* ---- devmem.c: CUDA IPC buffers -------------------------------------------- */

#define SHM_IPC_HANDLE_BYTES 64  /* sizeof(cudaIpcMemHandle_t) */

/* Open the trainer's cudaIpcMemHandle on `device`; the allocation must hold
 * exactly `declared` bytes and at least `need`.  UNSUPPORTED in a build
 * without CUDA. */
scape_rc shm_map_open_cuda(shm_map *m, const void *handle, size_t handle_len, size_t declared,
                           size_t need, int device, const char *what);
/* Copy the first `bytes` of a CUDA IPC buffer into its host copy (pull) or
 * back (push); *copied grows by the bytes moved.  Nothing for shm buffers. */
scape_rc shm_map_pull(shm_map *m, size_t bytes, uint64_t *copied);
scape_rc shm_map_push(shm_map *m, size_t bytes, uint64_t *copied);
/* Close a CUDA IPC buffer (called by shm_map_close). */
void shm_map_close_cuda(shm_map *m);

#endif /* SCAPE_SHM_H */
