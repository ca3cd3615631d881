/* cuda_none.c - the CUDA entry points of a CPU-only build that callers
 * reach without CUDA: they report that the CUDA kernels are absent, so
 * callers can skip with a reason.  (The nccl backend, the only caller of
 * cuda_comm.cu's kernels, is built only with CUDA.) */
#include "scape_kernels.h"
#include "scape_seg.h"

int kern_cuda_available(const char **why)
{
    if (why)
        *why = "scaped was built without CUDA (SCAPE_CUDA=OFF or no nvcc/NCCL found)";
    return 0;
}

scape_rc kseg_run_cuda(kseg_kernel k, const void *args, void *stream)
{
    (void)k;
    (void)args;
    (void)stream;
    return scape_set_error(SCAPE_UNSUPPORTED, "scaped was built without CUDA: no CUDA kernels");
}
