/* shm.c - mapping trainers' POSIX shared-memory buffers. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shm.h"

/* A portable shm name: "/" followed by 1..SHM_NAME_MAX-2 characters from
 * [A-Za-z0-9._-]. */
static scape_rc check_name(const char *name, const char *what)
{
    size_t len = name ? strlen(name) : 0;
    if (len < 2 || len >= SHM_NAME_MAX || name[0] != '/')
        return scape_set_error(SCAPE_INVALID,
                               "%s: shm name '%s' must be '/' and 1..%d characters",
                               what, name ? name : "", SHM_NAME_MAX - 2);
    for (size_t i = 1; i < len; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return scape_set_error(SCAPE_INVALID, "%s: shm name '%s' has a bad character",
                                   what, name);
    }
    return SCAPE_OK;
}

scape_rc shm_map_open(shm_map *m, const char *name, size_t declared, size_t need,
                      const char *what)
{
    memset(m, 0, sizeof *m);
    scape_rc rc = check_name(name, what);
    if (rc != SCAPE_OK)
        return rc;
    if (declared < need)
        return scape_set_error(SCAPE_INVALID,
                               "%s: buffer of %zu bytes is too small, the layout needs %zu",
                               what, declared, need);
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0)
        return scape_set_error(errno == ENOENT ? SCAPE_INVALID : SCAPE_SYSTEM,
                               "%s: shm_open('%s'): %s", what, name, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        rc = scape_set_error(SCAPE_SYSTEM, "%s: fstat('%s'): %s", what, name, strerror(errno));
    } else if ((size_t)st.st_size != declared) {
        rc = scape_set_error(SCAPE_INVALID,
                             "%s: shm '%s' holds %lld bytes, the trainer declared %zu", what,
                             name, (long long)st.st_size, declared);
    } else {
        void *p = mmap(NULL, declared, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED)
            rc = scape_set_error(SCAPE_SYSTEM, "%s: mmap('%s', %zu): %s", what, name,
                                 declared, strerror(errno));
        else
            *m = (shm_map){ .addr = p, .bytes = declared };
    }
    close(fd);
    if (rc == SCAPE_OK)
        strcpy(m->name, name);
    return rc;
}

void shm_map_close(shm_map *m, int unlink_it)
{
    if (m->dev) {
        shm_map_close_cuda(m);
        return;
    }
    if (m->pinned)
        shm_map_unpin(m); /* before the pages go */
    if (m->addr)
        munmap(m->addr, m->bytes);
    if (unlink_it && m->name[0])
        shm_unlink(m->name);
    memset(m, 0, sizeof *m);
}

int shm_map_ipc_overlap(const void *handle, size_t offset, size_t bytes, const shm_map *other)
{
    if (other->dev == NULL || memcmp(handle, other->ipc, SHM_IPC_HANDLE_BYTES) != 0)
        return 0;
    return offset < other->offset + other->bytes && other->offset < offset + bytes;
}
