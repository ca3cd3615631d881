/* shm.h - the daemon's view of a trainer's buffer: a POSIX shared-memory
 * object mapped by name after its size has been checked (and, for the cuda
 * executor, registered with CUDA so that its kernels address it), or
 * (devmem.c) a CUDA IPC buffer opened on the daemon's GPU: read and written
 * in place by the cuda executor, or through a pinned host copy that the host
 * executor works on, pulled before and pushed after each step. */
#ifndef SCAPE_SHM_H
#define SCAPE_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "scape_rc.h"

#define SHM_NAME_MAX 128
#define SHM_IPC_HANDLE_BYTES 64  /* sizeof(cudaIpcMemHandle_t) */

typedef struct shm_map {
    void *addr;              /* host memory: the mapping, or a CUDA IPC
                                buffer's pinned copy (NULL: none) */
    size_t bytes;
    char name[SHM_NAME_MAX];
    void *dev;               /* CUDA IPC: the trainer's device buffer */
    void *mapped;            /* CUDA IPC: what cudaIpcOpenMemHandle returned (the
                                allocation's start, dev - offset), for closing */
    int pinned;              /* shm registered with cudaHostRegister */
    unsigned char ipc[SHM_IPC_HANDLE_BYTES]; /* CUDA IPC: the handle, which names the
                                                whole allocation */
    size_t offset;           /* CUDA IPC: the buffer's place in that allocation */
    int device;              /* CUDA IPC: the trainer's device ordinal */
    void *event;             /* CUDA IPC, a cudaEvent_t: the trainer's
                                gradient-ready event (grads), or the daemon's
                                parameters-ready event (params); NULL: none */
} shm_map;

/* What the engine reads and writes: the pinned copy or the mapping, else
 * the device buffer itself. */
static inline void *shm_map_engine(const shm_map *m) { return m->addr ? m->addr : m->dev; }

/* Map the shm object `name` read-write.  It must hold at least `need` bytes
 * and exactly the `declared` bytes the trainer said it has.  `what` names the
 * buffer in messages ("params", "grads"). */
scape_rc shm_map_open(shm_map *m, const char *name, size_t declared, size_t need,
                      const char *what);
/* Unmap; with unlink_it, also remove the name (the owner is gone). */
void shm_map_close(shm_map *m, int unlink_it);

/* ---- devmem.c: CUDA IPC buffers -------------------------------------------- */

/* Open the trainer's cudaIpcMemHandle on `device`: the buffer is `declared`
 * bytes (at least `need`) at `offset` in the allocation the handle names,
 * which must hold them; with `mirror`, also allocate the pinned host copy.
 * `from` is the device the trainer allocated it on (-1: not said, taken as
 * `device`): another device is read and written through peer access, and
 * refused, naming both devices and how to lay the job out, where `device`
 * has none to it.  UNSUPPORTED in a build without CUDA. */
scape_rc shm_map_open_cuda(shm_map *m, const void *handle, size_t handle_len, size_t offset,
                           size_t declared, size_t need, int device, int from, int mirror,
                           const char *what);
/* 1 when two CUDA IPC buffers share bytes: the same allocation, ranges
 * [offset, offset + bytes) that overlap. */
int shm_map_ipc_overlap(const void *handle, size_t offset, size_t bytes, const shm_map *other);
/* Register a shm mapping with CUDA (cudaHostRegister), so that kernels read
 * and write it; shm_map_close unregisters it before unmapping. */
scape_rc shm_map_pin(shm_map *m, const char *what);
void shm_map_unpin(shm_map *m);
/* The first `bytes` of a buffer into host memory, or from it: the mapping or
 * the pinned copy where there is one, else the device buffer. */
scape_rc shm_map_read(const shm_map *m, void *dst, size_t bytes);
scape_rc shm_map_write(shm_map *m, const void *src, size_t bytes);
/* Copy the first `bytes` of a CUDA IPC buffer into its host copy (pull) or
 * back (push); *copied grows by the bytes moved.  Nothing for shm buffers
 * and for CUDA IPC buffers without a copy. */
scape_rc shm_map_pull(shm_map *m, size_t bytes, uint64_t *copied);
scape_rc shm_map_push(shm_map *m, size_t bytes, uint64_t *copied);
/* Events instead of device synchronisations (Register.grad_event,
 * Registered.params_event), interprocess events of SHM_IPC_HANDLE_BYTES:
 *  - open: the trainer's gradient-ready event, which it records on the
 *    stream that made the gradients before each Step, kept with m;
 *  - export: an event of the daemon's, kept with m, its handle written out;
 *  - done: whether the last record of m's event has completed (*done 1;
 *    also without an event), one query that never blocks: the step's
 *    wait polls it (control.c), bounded and watching the trainer's pid;
 *  - record: m's event, once the step's parameters are in place (the engine
 *    has returned: it is complete at once).
 * UNSUPPORTED in a build without CUDA.  The event goes with shm_map_close. */
scape_rc shm_map_open_event(shm_map *m, const void *handle, size_t handle_len,
                            const char *what);
scape_rc shm_map_export_event(shm_map *m, unsigned char *handle, const char *what);
scape_rc shm_map_event_done(const shm_map *m, int *done, const char *what);
scape_rc shm_map_record_event(shm_map *m, const char *what);
/* The ordinal, among the GPUs this daemon sees, of the one with this UUID
 * (SHM_GPU_UUID_BYTES, cudaDeviceProp.uuid); UNSUPPORTED, naming the UUID,
 * when it sees no such GPU (or is built without CUDA). */
#define SHM_GPU_UUID_BYTES 16
scape_rc shm_map_cuda_device(const unsigned char *uuid, int *ordinal, const char *what);
/* Close a CUDA IPC buffer (called by shm_map_close). */
void shm_map_close_cuda(shm_map *m);

#endif /* SCAPE_SHM_H */
