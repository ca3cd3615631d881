/* cuda_comm.cu - the CUDA kernels of the nccl comm backend (daemon/comm_nccl.c)
 * and the device check every CUDA caller makes first.
 *
 * Each kern_cuda_* function validates its arguments (kern_internal.h), then
 * enqueues one grid-stride kernel on the caller's stream; the element work
 * is scape_formula.h's, the CPU's own, so the values are the CPU's bit for
 * bit.  The segmented kernels of the executors are in cuda_seg.cu.
 */
#include <cuda_runtime.h>

#include <stdint.h>

#include "kern_internal.h"

#define MAP_THREADS 256
#define MAP_MAX_BLOCKS 8192 /* grid-stride beyond this: several waves on any GPU */

static cudaStream_t as_stream(void *s) { return static_cast<cudaStream_t>(s); }

static bool aligned(const void *p, size_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

/* ---- availability ---------------------------------------------------------- */

/* Why the kernels cannot run on the current device, or NULL when they can. */
static const char *unavailable_reason(void)
{
    int count = 0, dev = 0, major = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err == cudaSuccess && count == 0)
        return "no CUDA device is visible";
    if (err == cudaSuccess)
        err = cudaGetDevice(&dev);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err == cudaErrorInsufficientDriver)
        return "no NVIDIA driver, or one too old for this CUDA runtime";
    if (err != cudaSuccess)
        return cudaGetErrorString(err);
    if (major < 9)
        return "the current CUDA device is older than sm_90, which this build targets";
    return NULL;
}

extern "C" int kern_cuda_available(const char **why)
{
    const char *reason = unavailable_reason();
    if (reason)
        cudaGetLastError(); /* leave no failed query for a later launch check */
    if (why)
        *why = reason ? reason : "";
    return reason == NULL;
}

/* ---- elementwise kernels ------------------------------------------------------ */

/* Report a failed kernel launch (bad configuration, no image for device). */
static scape_rc launched(const char *fn)
{
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "%s: kernel launch failed: %s", fn,
                               cudaGetErrorString(err));
    return SCAPE_OK;
}

static unsigned grid_for(size_t work)
{
    size_t b = (work + MAP_THREADS - 1) / MAP_THREADS;
    return b == 0 ? 1u : b > MAP_MAX_BLOCKS ? MAP_MAX_BLOCKS : (unsigned)b;
}

/* Four fp32 in, four bf16 out, as one aligned access each. */
struct alignas(16) f32x4 {
    float x[4];
};
struct alignas(8) bf16x4 {
    uint16_t x[4];
};

static __global__ void __launch_bounds__(MAP_THREADS)
    to_bf16_kernel(const float *src, uint16_t *dst, size_t n, bool vec4)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t nv = vec4 ? n / 4 : 0;
    for (size_t v = t; v < nv; v += stride) {
        f32x4 s = reinterpret_cast<const f32x4 *>(src)[v];
        bf16x4 d;
#pragma unroll
        for (int i = 0; i < 4; i++)
            d.x[i] = scape_f_bf16(s.x[i]);
        reinterpret_cast<bf16x4 *>(dst)[v] = d;
    }
    for (size_t i = nv * 4 + t; i < n; i += stride)
        dst[i] = scape_f_bf16(src[i]);
}

static __global__ void __launch_bounds__(MAP_THREADS)
    sum_bf16_parts_kernel(const uint16_t *parts, unsigned nparts, size_t n, float *out)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = scape_f_sum_bf16_parts(parts, nparts, n, i);
}

extern "C" scape_rc kern_cuda_f32_to_bf16(const float *src, uint16_t *dst, size_t n,
                                          void *stream)
{
    static const char fn[] = "kern_cuda_f32_to_bf16";
    KERN_NONNULL(fn, src);
    KERN_NONNULL(fn, dst);
    KERN_MAXN(fn, n);
    KERN_DISJOINT(fn, src, n * 4, dst, n * 2);
    if (n == 0)
        return SCAPE_OK;
    bool vec4 = aligned(src, 16) && aligned(dst, 8);
    to_bf16_kernel<<<grid_for(vec4 ? n / 4 : n), MAP_THREADS, 0, as_stream(stream)>>>(
        src, dst, n, vec4);
    return launched(fn);
}

extern "C" scape_rc kern_cuda_sum_bf16_parts(const uint16_t *parts, unsigned nparts, size_t n,
                                             float *out, void *stream)
{
    static const char fn[] = "kern_cuda_sum_bf16_parts";
    TRY(kern_check_parts(fn, parts, nparts, n, out));
    if (n == 0)
        return SCAPE_OK;
    sum_bf16_parts_kernel<<<grid_for(n), MAP_THREADS, 0, as_stream(stream)>>>(parts, nparts,
                                                                             n, out);
    return launched(fn);
}
