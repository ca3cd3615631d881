/* cuda_scan.cuh - the prefix sums of the segmented CUDA kernels
 * (cuda_seg.cu): across a warp, across a block, and over a run of counts by
 * one block. */
#ifndef SCAPE_CUDA_SCAN_CUH
#define SCAPE_CUDA_SCAN_CUH

#include <stddef.h>
#include <stdint.h>

#define SCAN_THREADS 1024
#define SCAN_ITEMS 8 /* counts per thread in the one-block scan */

static __device__ __forceinline__ uint32_t warp_incl_scan(uint32_t x)
{
    const unsigned lane = threadIdx.x & 31;
#pragma unroll
    for (unsigned d = 1; d < 32; d <<= 1) {
        uint32_t y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d)
            x += y;
    }
    return x;
}

/* Exclusive scan across a block of NT threads; *total (if non-null) gets the
 * block's sum.  Every thread of the block must call it. */
template <unsigned NT> static __device__ uint32_t block_excl_scan(uint32_t x, uint32_t *total)
{
    __shared__ uint32_t s_warp[NT / 32], s_total;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint32_t incl = warp_incl_scan(x);
    if (lane == 31)
        s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        uint32_t w = lane < NT / 32 ? s_warp[lane] : 0;
        uint32_t wi = warp_incl_scan(w);
        if (lane < NT / 32)
            s_warp[lane] = wi - w;
        if (lane == 31)
            s_total = wi;
    }
    __syncthreads();
    uint32_t r = s_warp[warp] + incl - x;
    if (total)
        *total = s_total;
    __syncthreads(); /* the next call reuses s_warp */
    return r;
}

/* In place, by a block of SCAN_THREADS: v[i] becomes the sum of v[0..i);
 * the total is returned to every thread.  The block walks the counts in
 * chunks, carrying the running sum. */
static __device__ uint32_t block_scan_run(uint32_t *v, size_t n)
{
    const size_t chunk = (size_t)SCAN_THREADS * SCAN_ITEMS;
    uint32_t carry = 0;
    for (size_t base = 0; base < n; base += chunk) {
        size_t first = base + (size_t)threadIdx.x * SCAN_ITEMS;
        uint32_t x[SCAN_ITEMS], sum = 0, total;
#pragma unroll
        for (int q = 0; q < SCAN_ITEMS; q++) {
            x[q] = first + q < n ? v[first + q] : 0;
            sum += x[q];
        }
        uint32_t off = carry + block_excl_scan<SCAN_THREADS>(sum, &total);
#pragma unroll
        for (int q = 0; q < SCAN_ITEMS; q++) {
            if (first + q < n)
                v[first + q] = off;
            off += x[q];
        }
        carry += total;
    }
    return carry;
}

#endif /* SCAPE_CUDA_SCAN_CUH */
