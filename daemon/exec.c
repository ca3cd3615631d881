/* exec.c - choosing and creating an engine's executor (exec.h). */
#include <stdlib.h>

#include "engine_internal.h"

scape_rc exec_create(eng_t *e)
{
    exec_t *x = calloc(1, sizeof *x);
    if (x == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    x->e = e;
    x->ops = e->cfg.executor == ENG_EXEC_HOST ? &exec_host_ops : &exec_dev_ops;
    e->x = x;
    scape_rc rc = x->ops->create(x);
    if (rc != SCAPE_OK)
        exec_destroy(e);
    return rc;
}

void exec_count(exec_t *x, uint64_t mem, uint64_t link)
{
    x->e->last.mem_bytes[x->phase] += mem;
    x->e->last.link_bytes[x->phase] += link;
}

void exec_destroy(eng_t *e)
{
    exec_t *x = e->x;
    if (x == NULL)
        return;
    x->ops->destroy(x);
    free(x);
    e->x = NULL;
}

int exec_cuda_available(const char **why)
{
    return kern_cuda_available(why);
}
