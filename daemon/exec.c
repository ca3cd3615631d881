/* exec.c - choosing and creating an engine's executor (exec.h). */
#include <stdlib.h>

#include "exec.h"
#include "try.h"

scape_rc exec_create(exec_args *a, exec_t **out)
{
    exec_t *x = calloc(1, sizeof *x);
    *out = NULL;
    if (x == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    x->a = a;
    x->ops = a->cfg->executor == ENG_EXEC_HOST ? &exec_host_ops : &exec_dev_ops;
    scape_rc rc = x->ops->create(x);
    if (rc != SCAPE_OK) {
        exec_destroy(&x);
        return rc;
    }
    *out = x;
    return SCAPE_OK;
}

void exec_count(exec_t *x, uint64_t mem, uint64_t link)
{
    x->a->stats->mem_bytes[x->phase] += mem;
    x->a->stats->link_bytes[x->phase] += link;
}

void exec_destroy(exec_t **xp)
{
    exec_t *x = *xp;
    if (x == NULL)
        return;
    x->ops->destroy(x);
    free(x);
    *xp = NULL;
}

scape_rc exec_view(exec_t *x, const void *p, size_t bytes, const void **out)
{
    *out = NULL;
    if (x->host_memory) {
        *out = p;
        return SCAPE_OK;
    }
    void *h = malloc(bytes ? bytes : 1);
    if (h == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: cannot allocate %zu bytes for a view of "
                               "the executor's memory", bytes);
    scape_rc rc = x->ops->copy(x, h, p, bytes);
    if (rc == SCAPE_OK)
        rc = x->ops->sync(x);
    if (rc != SCAPE_OK) {
        free(h);
        return rc;
    }
    *out = h;
    return SCAPE_OK;
}

void exec_view_free(const exec_t *x, const void *view)
{
    if (!x->host_memory)
        free((void *)view);
}

int exec_cuda_available(const char **why)
{
    return kern_cuda_available(why);
}
