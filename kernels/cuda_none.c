/* cuda_none.c - the one CUDA entry point of a CPU-only build: it reports
 * that the twins are absent, so callers can skip with a reason. */
#include "scape_kernels.h"
#include "scape_seg.h"

int kern_cuda_available(const char **why)
{
    if (why)
        *why = "scaped was built without CUDA (SCAPE_CUDA=OFF or no nvcc/NCCL found)";
    return 0;
}

size_t kern_cuda_scratch_bytes(size_t n)
{
    (void)n;
    return 0;
}

scape_rc kseg_run_cuda(kseg_kernel k, const void *args, void *stream)
{
    (void)k;
    (void)args;
    (void)stream;
    return scape_set_error(SCAPE_UNSUPPORTED, "scaped was built without CUDA: no CUDA kernels");
}
