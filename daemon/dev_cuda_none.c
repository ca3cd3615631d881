/* dev_cuda_none.c - the cuda executor's device in a build without CUDA: a
 * refusal that says so. */
#include "dev.h"
#include "exec.h"

static scape_rc none_create(dev_t **out, int device, void *main, comm_t *comm, int timeout_ms,
                            unsigned long seed)
{
    (void)device;
    (void)main;
    (void)comm;
    (void)timeout_ms;
    (void)seed;
    *out = NULL;
    return scape_set_error(SCAPE_UNSUPPORTED, "executor cuda: scaped was built without CUDA "
                           "(SCAPE_CUDA=OFF or no nvcc found); use executor host");
}

const dev_ops dev_cuda_ops = { .name = "cuda", .create = none_create };

scape_rc exec_cuda_use_device(int device)
{
    return scape_set_error(SCAPE_UNSUPPORTED, "executor cuda: no CUDA in this build (device %d)",
                           device);
}
