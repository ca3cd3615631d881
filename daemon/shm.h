/* shm.h - the daemon's view of a trainer's buffer: a POSIX shared-memory
 * object mapped by name after its size has been checked. */
#ifndef SCAPE_SHM_H
#define SCAPE_SHM_H

#include <stddef.h>

#include "scape_rc.h"

#define SHM_NAME_MAX 128

typedef struct shm_map {
    void *addr;
    size_t bytes;
    char name[SHM_NAME_MAX];
} shm_map;

/* Map the shm object `name` read-write.  It must hold at least `need` bytes
 * and exactly the `declared` bytes the trainer said it has.  `what` names the
 * buffer in messages ("params", "grads"). */
scape_rc shm_map_open(shm_map *m, const char *name, size_t declared, size_t need,
                      const char *what);
/* Unmap; with unlink_it, also remove the name (the owner is gone). */
void shm_map_close(shm_map *m, int unlink_it);

#endif /* SCAPE_SHM_H */
