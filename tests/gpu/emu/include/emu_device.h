/* emu_device.h - the device side of scaped's CUDA emulator, for the .cu
 * files compiled as C++ (cuda_runtime.h includes it there): the built-in
 * variables, the intrinsics scaped's kernels use, and emu_launch, which
 * cu2cpp.py writes in place of every `kernel<<<grid, block, shmem,
 * stream>>>(args)`.  A kernel's arguments are converted and copied at the
 * launch, as CUDA does; its threads run as fibers (emu.cpp), which switch
 * only at __syncthreads and at warp intrinsics. */
#ifndef SCAPE_EMU_DEVICE_H
#define SCAPE_EMU_DEVICE_H

#include <stdint.h>
#include <string.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static /* one copy, shared by every fiber of the block */
#define __launch_bounds__(...)
#define __grid_constant__
#ifndef __CUDACC__
#define __CUDACC__ 1
#endif
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900 /* the device branches of shared headers run too */
#endif

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

/* The running fiber's; the scheduler sets them at every switch. */
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
static const int warpSize = 32;

void __syncthreads(void);

/* Warp exchange: this lane's value in, all 32 lanes' values out (lanes not
 * in mask read as 0); every lane named in mask must call it (op names the
 * intrinsic, for the divergence check). */
void emu_warp_exchange(const char *op, unsigned mask, uint64_t mine, uint64_t out[32]);

template <class T> static inline uint64_t emu_to_bits(T v)
{
    static_assert(sizeof(T) <= 8, "warp intrinsics on at most 8 bytes");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    return u;
}
template <class T> static inline T emu_from_bits(uint64_t u)
{
    T v;
    memcpy(&v, &u, sizeof v);
    return v;
}
/* The lane: the thread's linear index in the block, mod 32 (x fastest). */
static inline unsigned emu_lane(void)
{
    return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) & 31u;
}

template <class T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32)
{
    uint64_t all[32];
    emu_warp_exchange("__shfl_sync", mask, emu_to_bits(v), all);
    unsigned base = emu_lane() & ~(unsigned)(width - 1);
    return emu_from_bits<T>(all[base + ((unsigned)src & (unsigned)(width - 1))]);
}
template <class T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32)
{
    uint64_t all[32];
    emu_warp_exchange("__shfl_down_sync", mask, emu_to_bits(v), all);
    unsigned lane = emu_lane(), seg = lane & (unsigned)(width - 1);
    return seg + d < (unsigned)width ? emu_from_bits<T>(all[lane + d]) : v;
}
template <class T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32)
{
    uint64_t all[32];
    emu_warp_exchange("__shfl_up_sync", mask, emu_to_bits(v), all);
    unsigned lane = emu_lane(), seg = lane & (unsigned)(width - 1);
    return seg >= d ? emu_from_bits<T>(all[lane - d]) : v;
}
static inline unsigned __ballot_sync(unsigned mask, int pred)
{
    uint64_t all[32];
    emu_warp_exchange("__ballot_sync", mask, pred != 0, all);
    unsigned r = 0;
    for (unsigned l = 0; l < 32; l++)
        r |= (all[l] ? 1u : 0u) << l;
    return r & mask;
}
static inline unsigned __reduce_or_sync(unsigned mask, unsigned v)
{
    uint64_t all[32];
    emu_warp_exchange("__reduce_or_sync", mask, v, all);
    unsigned r = 0;
    for (unsigned l = 0; l < 32; l++)
        r |= (unsigned)all[l];
    return r;
}
static inline unsigned __reduce_add_sync(unsigned mask, unsigned v)
{
    uint64_t all[32];
    emu_warp_exchange("__reduce_add_sync", mask, v, all);
    unsigned r = 0;
    for (unsigned l = 0; l < 32; l++)
        r += (unsigned)all[l];
    return r;
}
static inline void __syncwarp(unsigned mask = 0xffffffffu)
{
    uint64_t all[32];
    emu_warp_exchange("__syncwarp", mask, 0, all);
}

static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline unsigned __brev(unsigned x)
{
    unsigned r = 0;
    for (int i = 0; i < 32; i++)
        r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
static inline unsigned __float_as_uint(float f) { return emu_to_bits(f) & 0xffffffffu; }
static inline float __uint_as_float(unsigned u) { return emu_from_bits<float>(u); }
static inline void __threadfence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

/* Atomics: the fibers of a kernel run on one host thread, one at a time. */
template <class T> static inline T atomicAdd(T *p, T v) { T o = *p; *p = o + v; return o; }
template <class T> static inline T atomicSub(T *p, T v) { T o = *p; *p = o - v; return o; }
template <class T> static inline T atomicOr(T *p, T v) { T o = *p; *p = o | v; return o; }
template <class T> static inline T atomicAnd(T *p, T v) { T o = *p; *p = o & v; return o; }
template <class T> static inline T atomicXor(T *p, T v) { T o = *p; *p = o ^ v; return o; }
template <class T> static inline T atomicMin(T *p, T v) { T o = *p; *p = v < o ? v : o; return o; }
template <class T> static inline T atomicMax(T *p, T v) { T o = *p; *p = v > o ? v : o; return o; }
template <class T> static inline T atomicExch(T *p, T v) { T o = *p; *p = v; return o; }
template <class T> static inline T atomicCAS(T *p, T cmp, T v)
{
    T o = *p;
    if (o == cmp)
        *p = v;
    return o;
}

/* ---- launches ---------------------------------------------------------------- */

struct emu_cfg {
    dim3 grid, block;
    size_t shmem;
    cudaStream_t stream;
};
static inline emu_cfg emu_config(dim3 grid, dim3 block, size_t shmem = 0, cudaStream_t s = 0)
{
    return emu_cfg{ grid, block, shmem, s };
}

/* Checks the configuration (a failure becomes the thread's last error, as a
 * launch's does) and queues the body, which runs once per thread. */
void emu_enqueue_kernel(const char *name, const emu_cfg &cfg, std::function<void()> body);

/* The arguments are copied at the launch, as CUDA copies them; each thread
 * calls the kernel with them through `call` (cu2cpp.py's lambda, which lets
 * the kernel's template arguments be deduced from them). */
template <class F, class... A>
static inline void emu_launch(const char *name, emu_cfg cfg, F call, A &&...a)
{
    std::tuple<std::decay_t<A>...> args(std::forward<A>(a)...);
    emu_enqueue_kernel(name, cfg, [call, args]() { std::apply(call, args); });
}

#endif /* SCAPE_EMU_DEVICE_H */
