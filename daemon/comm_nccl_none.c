/* comm_nccl_none.c - the `nccl` backend's stand-in in a build without CUDA
 * and NCCL: it says so instead of failing to link. */
#include "comm_nccl.h"

static scape_rc not_built(void)
{
    return scape_set_error(SCAPE_UNSUPPORTED,
                           "this scaped was built without CUDA and NCCL (SCAPE_CUDA=OFF, or "
                           "nvcc or NCCL were not found): use comm_backend host");
}

int comm_nccl_built(void) { return 0; }

scape_rc comm_nccl_make_ids(unsigned char *ids, size_t len)
{
    (void)ids;
    (void)len;
    return not_built();
}

scape_rc comm_nccl_create(const comm_nccl_opts *o, comm_t **out)
{
    (void)o;
    if (out)
        *out = NULL;
    return not_built();
}
