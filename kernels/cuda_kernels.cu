/* cuda_kernels.cu - the CUDA twins of the CPU reference kernels.
 *
 * Each kern_cuda_* function validates its arguments exactly like the CPU
 * function of the same name, then enqueues work on the caller's stream.  The
 * arithmetic is scape_formula.h's, the CPU's own, and the build passes
 * --fmad=false, so the update kernels round like the reference, bit for bit.
 *
 * Three kernel families:
 *  - map kernels: one element (or one aligned group of four) per thread in a
 *    grid-stride loop, for the purely elementwise operations;
 *  - mask-scan kernels: per-tile popcount, one-block scan of the tile counts
 *    in the scratch buffer, then a scatter kernel in which each warp walks its
 *    tile's words and each lane handles one element, placing the j-th set bit
 *    at offset j;
 *  - top-k: a radix select on the bits of |stat|, one histogram pass per
 *    digit (11, 10, 10 bits) with shared-memory atomics, whose bucket choices
 *    stay in device memory (no host round trip), then a ballot pass that
 *    writes the mask and resolves ties in index order through a tile scan.
 *
 * The packed length k = popcount(mask) is known only on the device, so the
 * overlap checks that the CPU makes on [packed, packed + k) are made on the
 * packed buffer's first element (which any k >= 1 touches).
 */
#include <cuda_runtime.h>

#include <initializer_list>
#include <stdint.h>

#include "cuda_scan.cuh"
#include "kern_internal.h"

#define TILE 256          /* mask words per scan tile = threads of a tile block */
#define WARPS (TILE / 32) /* warps of a tile block */
#define BATCH 8           /* words a warp loads before using them: keeps loads in flight */
#define MAP_THREADS 256
#define MAP_MAX_BLOCKS 8192 /* grid-stride beyond this: several waves on any GPU */
#define HIST_THREADS 256
#define HIST_MAX_BLOCKS 1024 /* each block flushes a shared histogram: keep it few */
#define DIGIT1_BINS 2048     /* top digit: key bits 30..20 */
#define DIGIT_BINS 1024      /* lower digits: bits 19..10 and 9..0 */

/* Return SCAPE_CUDA with the failing call and CUDA's reason.  The error,
 * now reported, is taken off the thread's record, so that a later launch
 * check (launched) does not report it again as its own. */
#define CUDA_TRY(fn, call)                                                     \
    do {                                                                       \
        cudaError_t err_ = (call);                                             \
        if (err_ != cudaSuccess) {                                             \
            (void)cudaGetLastError();                                          \
            return scape_set_error(SCAPE_CUDA, "%s: %s: %s", fn, #call,        \
                                   cudaGetErrorString(err_));                  \
        }                                                                      \
    } while (0)


/* ---- host helpers -------------------------------------------------------- */

static cudaStream_t as_stream(void *s) { return static_cast<cudaStream_t>(s); }

/* Report a failed kernel launch (bad configuration, no image for device). */
static scape_rc launched(const char *fn)
{
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "%s: kernel launch failed: %s", fn,
                               cudaGetErrorString(err));
    return SCAPE_OK;
}

static bool aligned(const void *p, size_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

static unsigned grid_for(size_t work, unsigned threads, unsigned cap)
{
    size_t b = (work + threads - 1) / threads;
    return b == 0 ? 1u : b > cap ? cap : (unsigned)b;
}

/* Bits of the last word that belong to a segment of n elements. */
static uint32_t tail_bits(size_t n)
{
    size_t r = n & 31;
    return r ? ((1u << r) - 1u) : 0xffffffffu;
}

static size_t tiles_of(size_t nwords) { return (nwords + TILE - 1) / TILE; }

/* Scratch of a mask scan: one count per tile plus the grand total. */
static size_t scan_scratch_bytes(size_t nwords)
{
    return nwords ? (tiles_of(nwords) + 1) * sizeof(uint32_t) : 0;
}

/* Bytes of the packed buffer the overlap checks can see (see file comment). */
static size_t packed_probe(size_t n) { return n ? sizeof(float) : 0; }

struct span {
    const void *p;
    size_t bytes;
    const char *name;
};

/* Scratch must exist, be large enough, be word aligned (a misaligned device
 * access would poison the context) and overlap none of the other buffers. */
static scape_rc check_scratch(const char *fn, const void *scratch, size_t bytes,
                              size_t need, std::initializer_list<span> others)
{
    if (scratch == NULL)
        return scape_set_error(SCAPE_INVALID, "%s: scratch is NULL", fn);
    if (bytes < need)
        return scape_set_error(SCAPE_INVALID,
                               "%s: scratch of %zu bytes < %zu needed", fn,
                               bytes, need);
    if (!aligned(scratch, sizeof(uint32_t)))
        return scape_set_error(SCAPE_INVALID,
                               "%s: scratch is not 4-byte aligned", fn);
    for (const span &o : others)
        if (kern_overlap(scratch, bytes, o.p, o.bytes))
            return scape_set_error(SCAPE_INVALID,
                                   "%s: buffers scratch and %s overlap", fn,
                                   o.name);
    return SCAPE_OK;
}

/* ---- device helpers ------------------------------------------------------ */

/* V consecutive elements moved as one aligned access. */
template <class T, int V> struct alignas(sizeof(T) * V) vec {
    T x[V];
};

template <int V, class T> __device__ __forceinline__ vec<T, V> ld(const T *p, size_t v)
{
    return reinterpret_cast<const vec<T, V> *>(p)[v];
}

template <int V, class T>
__device__ __forceinline__ void st(T *p, size_t v, const vec<T, V> &a)
{
    reinterpret_cast<vec<T, V> *>(p)[v] = a;
}

/* Element loads of the accumulating ops: scape_formula.h's conversion. */
__device__ __forceinline__ float d_to_f32(uint16_t x) { return scape_f_from_bf16(x); }
__device__ __forceinline__ float d_to_f32(float x) { return x; }

__device__ __forceinline__ size_t global_tid() { return (size_t)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ size_t grid_threads() { return (size_t)gridDim.x * blockDim.x; }

/* ---- availability and scratch ------------------------------------------- */

/* Why the twins cannot run on the current device, or NULL when they can. */
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

/* Top-k bookkeeping, all in device memory so no pass waits for the host. */
struct topk_state {
    uint32_t hist[3][DIGIT1_BINS]; /* per digit; digits 2 and 3 use DIGIT_BINS */
    uint32_t digit[3];             /* chosen bucket of each digit */
    uint32_t need;                 /* keys still to take inside the chosen bucket */
    uint32_t tau;                  /* the k-th largest key */
    uint32_t eq_total;             /* keys equal to tau */
};

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* Scratch of top-k: the state, then the tie scan of the mask pass. */
static size_t topk_scratch_bytes(size_t n)
{
    if (n == 0)
        return 0;
    return align256(sizeof(topk_state)) + scan_scratch_bytes(kern_mask_words(n));
}

/* The fused top-k keeps the statistic in its scratch, then top-k's own. */
static size_t topk_ef_scratch_bytes(size_t n)
{
    return n ? align256(n * sizeof(float)) + topk_scratch_bytes(n) : 0;
}

/* The top-k after a pack rebuilds a (and a zero vector) before the fused one. */
static size_t topk_packed_scratch_bytes(size_t n)
{
    return n ? 2 * align256(n * sizeof(float)) + topk_ef_scratch_bytes(n) : 0;
}

extern "C" size_t kern_cuda_scratch_bytes(size_t n)
{
    /* each top-k variant includes the one it builds on, down to a mask
     * scan's worth, so the last bounds every twin */
    return topk_packed_scratch_bytes(n);
}

/* ---- elementwise operations ---------------------------------------------- */

/* Each op's run<V>(v) handles elements [v*V, v*V + V). */
template <int V, class Op>
__global__ void __launch_bounds__(MAP_THREADS) map_kernel(Op op, size_t n)
{
    const size_t nv = n / V, stride = grid_threads(), t = global_tid();
    for (size_t v = t; v < nv; v += stride)
        op.template run<V>(v);
    if (V > 1 && t < n - nv * V)
        op.template run<1>(nv * V + t);
}

/* Launch op over n elements, four at a time when every pointer allows it. */
template <class Op>
static scape_rc launch_map(const char *fn, const Op &op, size_t n, bool vec4,
                           cudaStream_t s)
{
    if (n == 0)
        return SCAPE_OK;
    unsigned blocks = grid_for(vec4 ? n / 4 : n, MAP_THREADS, MAP_MAX_BLOCKS);
    if (vec4)
        map_kernel<4><<<blocks, MAP_THREADS, 0, s>>>(op, n);
    else
        map_kernel<1><<<blocks, MAP_THREADS, 0, s>>>(op, n);
    return launched(fn);
}

struct mask_stat_op {
    const float *m, *g, *e;
    float *stat;
    float beta1, c1, t_r;
    template <int V> __device__ void run(size_t v) const
    {
        vec<float, V> mv = ld<V>(m, v), gv = ld<V>(g, v), ev = ld<V>(e, v), r;
#pragma unroll
        for (int i = 0; i < V; i++)
            r.x[i] = scape_f_stat(mv.x[i], scape_f_ef(gv.x[i], ev.x[i]), beta1, c1, t_r);
        st<V>(stat, v, r);
    }
};

struct abs_stat_op {
    const float *g, *e;
    float *stat;
    template <int V> __device__ void run(size_t v) const
    {
        vec<float, V> gv = ld<V>(g, v), ev = ld<V>(e, v), r;
#pragma unroll
        for (int i = 0; i < V; i++)
            r.x[i] = scape_f_abs_stat(scape_f_ef(gv.x[i], ev.x[i]));
        st<V>(stat, v, r);
    }
};

extern "C" scape_rc kern_cuda_mask_stat(const float *m, const float *g, const float *e,
                                        size_t n, float beta1, float t_r, float *stat,
                                        void *stream)
{
    static const char fn[] = "kern_cuda_mask_stat";
    KERN_NONNULL(fn, m);
    KERN_NONNULL(fn, g);
    KERN_NONNULL(fn, e);
    KERN_NONNULL(fn, stat);
    TRY(kern_check_stat_args(fn, n, m, beta1, t_r));
    KERN_DISJOINT(fn, stat, n * 4, m, n * 4);
    KERN_DISJOINT(fn, stat, n * 4, g, n * 4);
    KERN_DISJOINT(fn, stat, n * 4, e, n * 4);
    mask_stat_op op = {m, g, e, stat, beta1, 1.0f - beta1, t_r};
    bool vec4 = aligned(m, 16) && aligned(g, 16) && aligned(e, 16) && aligned(stat, 16);
    return launch_map(fn, op, n, vec4, as_stream(stream));
}

extern "C" scape_rc kern_cuda_abs_stat(const float *g, const float *e, size_t n,
                                       float *stat, void *stream)
{
    static const char fn[] = "kern_cuda_abs_stat";
    KERN_NONNULL(fn, g);
    KERN_NONNULL(fn, e);
    KERN_NONNULL(fn, stat);
    KERN_MAXN(fn, n);
    KERN_DISJOINT(fn, stat, n * 4, g, n * 4);
    KERN_DISJOINT(fn, stat, n * 4, e, n * 4);
    abs_stat_op op = {g, e, stat};
    bool vec4 = aligned(g, 16) && aligned(e, 16) && aligned(stat, 16);
    return launch_map(fn, op, n, vec4, as_stream(stream));
}

/* dst = src or dst += src, src fp32 or bf16. */
template <class S, bool OVERWRITE> struct accum_op {
    float *dst;
    const S *src;
    template <int V> __device__ void run(size_t v) const
    {
        vec<S, V> s = ld<V>(src, v);
        vec<float, V> d;
        if (!OVERWRITE)
            d = ld<V>(dst, v);
#pragma unroll
        for (int i = 0; i < V; i++)
            d.x[i] = OVERWRITE ? d_to_f32(s.x[i]) : scape_f_grad_add(d.x[i], d_to_f32(s.x[i]));
        st<V>(dst, v, d);
    }
};

template <class S>
static scape_rc launch_accum(const char *fn, float *dst, const S *src, size_t n,
                             int overwrite, cudaStream_t s)
{
    bool vec4 = aligned(dst, 16) && aligned(src, 4 * sizeof(S));
    if (overwrite)
        return launch_map(fn, accum_op<S, true>{dst, src}, n, vec4, s);
    return launch_map(fn, accum_op<S, false>{dst, src}, n, vec4, s);
}

extern "C" scape_rc kern_cuda_grad_accum(float *dst, const void *src, kern_dtype dt,
                                         size_t n, int overwrite, void *stream)
{
    static const char fn[] = "kern_cuda_grad_accum";
    KERN_NONNULL(fn, dst);
    KERN_NONNULL(fn, src);
    KERN_MAXN(fn, n);
    TRY(kern_check_dtype(fn, dt));
    KERN_DISJOINT(fn, dst, n * 4, src, n * kern_dtype_size(dt));
    if (dt == KERN_F32)
        return launch_accum(fn, dst, static_cast<const float *>(src), n, overwrite,
                            as_stream(stream));
    return launch_accum(fn, dst, static_cast<const uint16_t *>(src), n, overwrite,
                        as_stream(stream));
}

struct to_bf16_op {
    const float *src;
    uint16_t *dst;
    template <int V> __device__ void run(size_t v) const
    {
        vec<float, V> s = ld<V>(src, v);
        vec<uint16_t, V> d;
#pragma unroll
        for (int i = 0; i < V; i++)
            d.x[i] = scape_f_bf16(s.x[i]);
        st<V>(dst, v, d);
    }
};

struct from_bf16_op {
    const uint16_t *src;
    float *dst;
    template <int V> __device__ void run(size_t v) const
    {
        vec<uint16_t, V> s = ld<V>(src, v);
        vec<float, V> d;
#pragma unroll
        for (int i = 0; i < V; i++)
            d.x[i] = d_to_f32(s.x[i]);
        st<V>(dst, v, d);
    }
};

extern "C" scape_rc kern_cuda_f32_to_bf16(const float *src, uint16_t *dst, size_t n,
                                          void *stream)
{
    static const char fn[] = "kern_cuda_f32_to_bf16";
    KERN_NONNULL(fn, src);
    KERN_NONNULL(fn, dst);
    KERN_MAXN(fn, n);
    KERN_DISJOINT(fn, src, n * 4, dst, n * 2);
    bool vec4 = aligned(src, 16) && aligned(dst, 8);
    return launch_map(fn, to_bf16_op{src, dst}, n, vec4, as_stream(stream));
}

extern "C" scape_rc kern_cuda_bf16_to_f32(const uint16_t *src, float *dst, size_t n,
                                          void *stream)
{
    static const char fn[] = "kern_cuda_bf16_to_f32";
    KERN_NONNULL(fn, src);
    KERN_NONNULL(fn, dst);
    KERN_MAXN(fn, n);
    KERN_DISJOINT(fn, src, n * 2, dst, n * 4);
    bool vec4 = aligned(src, 8) && aligned(dst, 16);
    return launch_map(fn, from_bf16_op{src, dst}, n, vec4, as_stream(stream));
}

struct sum_bf16_parts_op {
    const uint16_t *parts;
    unsigned nparts;
    size_t n;
    float *out;
    template <int V> __device__ void run(size_t v) const
    {
#pragma unroll
        for (int i = 0; i < V; i++)
            out[v * V + i] = scape_f_sum_bf16_parts(parts, nparts, n, v * V + i);
    }
};

extern "C" scape_rc kern_cuda_sum_bf16_parts(const uint16_t *parts, unsigned nparts, size_t n,
                                             float *out, void *stream)
{
    static const char fn[] = "kern_cuda_sum_bf16_parts";
    TRY(kern_check_parts(fn, parts, nparts, n, out));
    return launch_map(fn, sum_bf16_parts_op{parts, nparts, n, out}, n, false,
                      as_stream(stream));
}

struct or_op {
    uint32_t *dst;
    const uint32_t *src;
    template <int V> __device__ void run(size_t v) const
    {
        vec<uint32_t, V> d = ld<V>(dst, v), s = ld<V>(src, v);
#pragma unroll
        for (int i = 0; i < V; i++)
            d.x[i] |= s.x[i];
        st<V>(dst, v, d);
    }
};

extern "C" scape_rc kern_cuda_mask_or(uint32_t *dst, const uint32_t *src, size_t nwords,
                                      void *stream)
{
    static const char fn[] = "kern_cuda_mask_or";
    KERN_NONNULL(fn, dst);
    KERN_NONNULL(fn, src);
    KERN_DISJOINT(fn, dst, nwords * 4, src, nwords * 4);
    bool vec4 = aligned(dst, 16) && aligned(src, 16);
    return launch_map(fn, or_op{dst, src}, nwords, vec4, as_stream(stream));
}

/* ---- Adam family: the updates of scape_formula.h ------------------------- */

struct adam_par {
    float div, b1, b2, eps, wd, lr, bc1, bc2, clip;
};

__device__ __forceinline__ void adams_one(float &theta, float &m, float g, const adam_par &p)
{
    scape_f_adams(&theta, &m, g, p.b1, p.b2, p.eps, p.wd, p.lr);
}

__device__ __forceinline__ void adamw_one(float &theta, float &m, float &v, float g,
                                          const adam_par &p)
{
    scape_f_adamw(&theta, &m, &v, g, p.b1, p.b2, p.eps, p.wd, p.lr, p.bc1, p.bc2);
}

static adam_par make_par(const kern_hyper *h, float div, float lr, uint64_t t)
{
    adam_par p = {div, h->beta1, h->beta2, h->eps, h->wd, lr, 1.0f, 1.0f, h->clip};
    if (t) {
        p.bc1 = kern_bias_correction(h->beta1, t);
        p.bc2 = kern_bias_correction(h->beta2, t);
    }
    return p;
}

struct adams_dense_op {
    float *theta, *m;
    const float *sum;
    adam_par p;
    template <int V> __device__ void run(size_t v) const
    {
        vec<float, V> th = ld<V>(theta, v), mv = ld<V>(m, v), s = ld<V>(sum, v);
#pragma unroll
        for (int i = 0; i < V; i++)
            adams_one(th.x[i], mv.x[i], scape_f_clip(scape_f_mean(s.x[i], p.div), p.clip), p);
        st<V>(m, v, mv);
        st<V>(theta, v, th);
    }
};

struct adamw_dense_op {
    float *theta, *m, *vv;
    const float *sum;
    adam_par p;
    template <int V> __device__ void run(size_t v) const
    {
        vec<float, V> th = ld<V>(theta, v), mv = ld<V>(m, v), w = ld<V>(vv, v);
        vec<float, V> s = ld<V>(sum, v);
#pragma unroll
        for (int i = 0; i < V; i++)
            adamw_one(th.x[i], mv.x[i], w.x[i], scape_f_clip(scape_f_mean(s.x[i], p.div), p.clip), p);
        st<V>(m, v, mv);
        st<V>(vv, v, w);
        st<V>(theta, v, th);
    }
};

/* The validation of cpu_adam.c's check_update; sum holds sum_bytes. */
static scape_rc check_update(const char *fn, const float *theta, const float *m,
                             const float *v, int need_v, const float *sum,
                             size_t sum_bytes, const uint32_t *mask, size_t n,
                             const kern_hyper *h, float div, float lr)
{
    KERN_NONNULL(fn, theta);
    KERN_NONNULL(fn, m);
    KERN_NONNULL(fn, sum);
    if (need_v)
        KERN_NONNULL(fn, v);
    KERN_MAXN(fn, n);
    TRY(kern_check_hyper(fn, h));
    TRY(kern_check_div_lr(fn, div, lr));
    KERN_DISJOINT(fn, theta, n * 4, m, n * 4);
    KERN_DISJOINT(fn, theta, n * 4, sum, sum_bytes);
    KERN_DISJOINT(fn, m, n * 4, sum, sum_bytes);
    if (need_v) {
        KERN_DISJOINT(fn, v, n * 4, theta, n * 4);
        KERN_DISJOINT(fn, v, n * 4, m, n * 4);
        KERN_DISJOINT(fn, v, n * 4, sum, sum_bytes);
    }
    if (mask) {
        size_t mb = kern_mask_words(n) * 4;
        KERN_DISJOINT(fn, mask, mb, theta, n * 4);
        KERN_DISJOINT(fn, mask, mb, m, n * 4);
        if (need_v)
            KERN_DISJOINT(fn, mask, mb, v, n * 4);
    }
    return SCAPE_OK;
}

extern "C" scape_rc kern_cuda_adams_dense(float *theta, float *m, const float *sum,
                                          float div, size_t n, const kern_hyper *h,
                                          float lr, void *stream)
{
    static const char fn[] = "kern_cuda_adams_dense";
    TRY(check_update(fn, theta, m, NULL, 0, sum, n * 4, NULL, n, h, div, lr));
    adams_dense_op op = {theta, m, sum, make_par(h, div, lr, 0)};
    bool vec4 = aligned(theta, 16) && aligned(m, 16) && aligned(sum, 16);
    return launch_map(fn, op, n, vec4, as_stream(stream));
}

extern "C" scape_rc kern_cuda_adamw_dense(float *theta, float *m, float *v,
                                          const float *sum, float div, size_t n,
                                          const kern_hyper *h, float lr, uint64_t t,
                                          void *stream)
{
    static const char fn[] = "kern_cuda_adamw_dense";
    TRY(check_update(fn, theta, m, v, 1, sum, n * 4, NULL, n, h, div, lr));
    if (t == 0)
        return scape_set_error(SCAPE_INVALID, "%s: step t must be >= 1", fn);
    adamw_dense_op op = {theta, m, v, sum, make_par(h, div, lr, t)};
    bool vec4 = aligned(theta, 16) && aligned(m, 16) && aligned(v, 16) &&
                aligned(sum, 16);
    return launch_map(fn, op, n, vec4, as_stream(stream));
}

/* ---- mask scan: per-tile counts, one-block scan, scatter ----------------- */

/* Word w of a segment of nw words, tail bits of the last word cleared. */
__device__ __forceinline__ uint32_t word_at(const uint32_t *mask, size_t w, size_t nw,
                                            uint32_t tail)
{
    if (w >= nw)
        return 0;
    uint32_t b = mask[w];
    return w + 1 == nw ? b & tail : b;
}

__global__ void __launch_bounds__(TILE)
    tile_count_kernel(const uint32_t *mask, size_t nw, uint32_t tail, uint32_t *tiles)
{
    size_t w = (size_t)blockIdx.x * TILE + threadIdx.x;
    uint32_t total;
    block_excl_scan<TILE>(__popc(word_at(mask, w, nw, tail)), &total);
    if (threadIdx.x == 0)
        tiles[blockIdx.x] = total;
}

/* In place: tiles[t] becomes the count of tiles before t; tiles[nt] the total. */
__global__ void __launch_bounds__(SCAN_THREADS) tile_scan_kernel(uint32_t *tiles, size_t nt)
{
    uint32_t total = block_scan_run(tiles, nt);
    if (threadIdx.x == 0)
        tiles[nt] = total;
}

/* Fill tiles[0..nt] with the exclusive offsets of the mask's tiles. */
static scape_rc scan_tiles(const char *fn, const uint32_t *mask, size_t nw,
                           uint32_t tail, uint32_t *tiles, cudaStream_t s)
{
    size_t nt = tiles_of(nw);
    tile_count_kernel<<<(unsigned)nt, TILE, 0, s>>>(mask, nw, tail, tiles);
    TRY(launched(fn));
    tile_scan_kernel<<<1, SCAN_THREADS, 0, s>>>(tiles, nt);
    return launched(fn);
}

/* Each warp handles rows of its tile: row r is word r*WARPS + warp, lane l is
 * bit l.  Op::load(i, j, on, live) reads what element i (packed slot j) needs;
 * Op::store writes it back.  Loads of BATCH rows are issued before any store. */
template <class Op>
__global__ void __launch_bounds__(TILE)
    scatter_kernel(Op op, const uint32_t *mask, size_t n, uint32_t tail,
                   const uint32_t *tiles)
{
    __shared__ uint32_t s_bits[TILE], s_off[TILE];
    const size_t nw = (n + 31) / 32, w = (size_t)blockIdx.x * TILE + threadIdx.x;
    const uint32_t bits = word_at(mask, w, nw, tail);
    s_bits[threadIdx.x] = bits;
    s_off[threadIdx.x] = tiles[blockIdx.x] + block_excl_scan<TILE>(__popc(bits), NULL);
    __syncthreads();

    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t below = (1u << lane) - 1u;
    const size_t e0 = (size_t)blockIdx.x * TILE * 32;
    for (unsigned r0 = 0; r0 < TILE / WARPS; r0 += BATCH) {
        typename Op::item x[BATCH];
        size_t idx[BATCH];
        uint32_t j[BATCH];
        bool on[BATCH];
#pragma unroll
        for (unsigned b = 0; b < BATCH; b++) {
            unsigned lw = (r0 + b) * WARPS + warp;
            idx[b] = e0 + (size_t)lw * 32 + lane;
            on[b] = (s_bits[lw] >> lane) & 1u;
            j[b] = s_off[lw] + __popc(s_bits[lw] & below);
            x[b] = op.load(idx[b], j[b], on[b], idx[b] < n);
        }
#pragma unroll
        for (unsigned b = 0; b < BATCH; b++)
            if (idx[b] < n)
                op.store(idx[b], j[b], on[b], x[b]);
    }
}

template <class Op>
static scape_rc run_scatter(const char *fn, const Op &op, const uint32_t *mask,
                            size_t n, void *scratch, cudaStream_t s)
{
    if (n == 0)
        return SCAPE_OK;
    size_t nw = kern_mask_words(n);
    uint32_t *tiles = static_cast<uint32_t *>(scratch);
    TRY(scan_tiles(fn, mask, nw, tail_bits(n), tiles, s));
    scatter_kernel<<<(unsigned)tiles_of(nw), TILE, 0, s>>>(op, mask, n, tail_bits(n), tiles);
    return launched(fn);
}

extern "C" scape_rc kern_cuda_mask_popcount(const uint32_t *mask, size_t n, size_t *count,
                                            void *scratch, size_t scratch_bytes,
                                            void *stream)
{
    static const char fn[] = "kern_cuda_mask_popcount";
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, count);
    KERN_MAXN(fn, n);
    size_t nw = kern_mask_words(n);
    TRY(check_scratch(fn, scratch, scratch_bytes, scan_scratch_bytes(nw),
                         {{mask, nw * 4, "mask"}}));
    if (n == 0) {
        *count = 0;
        return SCAPE_OK;
    }
    cudaStream_t s = as_stream(stream);
    uint32_t *tiles = static_cast<uint32_t *>(scratch), total = 0;
    TRY(scan_tiles(fn, mask, nw, tail_bits(n), tiles, s));
    CUDA_TRY(fn, cudaMemcpyAsync(&total, tiles + tiles_of(nw), sizeof total,
                                 cudaMemcpyDeviceToHost, s));
    CUDA_TRY(fn, cudaStreamSynchronize(s));
    *count = total;
    return SCAPE_OK;
}

__global__ void __launch_bounds__(TILE)
    prefix_kernel(const uint32_t *mask, size_t nw, const uint32_t *tiles, uint32_t *prefix)
{
    size_t w = (size_t)blockIdx.x * TILE + threadIdx.x;
    uint32_t c = __popc(word_at(mask, w, nw, 0xffffffffu));
    uint32_t off = tiles[blockIdx.x] + block_excl_scan<TILE>(c, NULL);
    if (w < nw)
        prefix[w] = off;
    if (w + 1 == nw)
        prefix[nw] = off + c;
}

extern "C" scape_rc kern_cuda_mask_prefix(const uint32_t *mask, size_t nwords,
                                          uint32_t *prefix, void *scratch,
                                          size_t scratch_bytes, void *stream)
{
    static const char fn[] = "kern_cuda_mask_prefix";
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, prefix);
    KERN_MAXN(fn, nwords * 32);
    KERN_DISJOINT(fn, mask, nwords * 4, prefix, (nwords + 1) * 4);
    TRY(check_scratch(fn, scratch, scratch_bytes, scan_scratch_bytes(nwords),
                         {{mask, nwords * 4, "mask"}, {prefix, (nwords + 1) * 4, "prefix"}}));
    cudaStream_t s = as_stream(stream);
    if (nwords == 0) {
        CUDA_TRY(fn, cudaMemsetAsync(prefix, 0, sizeof *prefix, s));
        return SCAPE_OK;
    }
    uint32_t *tiles = static_cast<uint32_t *>(scratch);
    TRY(scan_tiles(fn, mask, nwords, 0xffffffffu, tiles, s));
    prefix_kernel<<<(unsigned)tiles_of(nwords), TILE, 0, s>>>(mask, nwords, tiles, prefix);
    return launched(fn);
}

/* a = g + e; set bits move a to out[j] and clear e, clear bits keep a in e. */
struct pack_ef_op {
    const float *g;
    float *e, *out;
    struct item {
        float g, e;
    };
    __device__ item load(size_t i, uint32_t, bool, bool live) const
    {
        return live ? item{g[i], e[i]} : item{0.0f, 0.0f};
    }
    __device__ void store(size_t i, uint32_t j, bool on, item x) const
    {
        float a = scape_f_ef(x.g, x.e);
        if (on)
            out[j] = a;
        e[i] = on ? 0.0f : a;
    }
};

extern "C" scape_rc kern_cuda_pack_ef(const float *g, float *e, const uint32_t *mask,
                                      size_t n, float *out, void *scratch,
                                      size_t scratch_bytes, void *stream)
{
    static const char fn[] = "kern_cuda_pack_ef";
    KERN_NONNULL(fn, g);
    KERN_NONNULL(fn, e);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, out);
    KERN_MAXN(fn, n);
    size_t kb = packed_probe(n), nw = kern_mask_words(n);
    KERN_DISJOINT(fn, g, n * 4, e, n * 4);
    KERN_DISJOINT(fn, out, kb, e, n * 4);
    KERN_DISJOINT(fn, out, kb, g, n * 4);
    KERN_DISJOINT(fn, mask, nw * 4, e, n * 4);
    KERN_DISJOINT(fn, mask, nw * 4, out, kb);
    TRY(check_scratch(fn, scratch, scratch_bytes, scan_scratch_bytes(nw),
                         {{g, n * 4, "g"}, {e, n * 4, "e"}, {mask, nw * 4, "mask"},
                          {out, kb, "out"}}));
    return run_scatter(fn, pack_ef_op{g, e, out}, mask, n, scratch, as_stream(stream));
}

struct compact_op {
    const float *dense;
    float *packed;
    typedef float item;
    __device__ float load(size_t i, uint32_t, bool on, bool) const { return on ? dense[i] : 0.0f; }
    __device__ void store(size_t, uint32_t j, bool on, float x) const
    {
        if (on)
            packed[j] = x;
    }
};

extern "C" scape_rc kern_cuda_mask_compact(const float *dense, const uint32_t *mask,
                                           size_t n, float *packed, void *scratch,
                                           size_t scratch_bytes, void *stream)
{
    static const char fn[] = "kern_cuda_mask_compact";
    KERN_NONNULL(fn, dense);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, packed);
    KERN_MAXN(fn, n);
    size_t kb = packed_probe(n), nw = kern_mask_words(n);
    KERN_DISJOINT(fn, packed, kb, dense, n * 4);
    KERN_DISJOINT(fn, packed, kb, mask, nw * 4);
    TRY(check_scratch(fn, scratch, scratch_bytes, scan_scratch_bytes(nw),
                         {{dense, n * 4, "dense"}, {mask, nw * 4, "mask"},
                          {packed, kb, "packed"}}));
    return run_scatter(fn, compact_op{dense, packed}, mask, n, scratch,
                       as_stream(stream));
}

/* At the coordinates sent, a (a copy of the residual) becomes what was sent
 * plus what stayed: the residual there is 0 with fp32 values and a - bf16(a)
 * with bf16 ones, so a is rebuilt exactly either way, as cpu_topk.c does. */
struct rebuild_op {
    const float *packed;
    float *a;
    typedef float item;
    __device__ float load(size_t i, uint32_t j, bool on, bool) const
    {
        return on ? packed[j] + a[i] : 0.0f;
    }
    __device__ void store(size_t i, uint32_t, bool on, float x) const
    {
        if (on)
            a[i] = x;
    }
};

template <bool BF16> struct expand_op {
    const float *packed;
    void *dense;
    typedef float item;
    __device__ float load(size_t, uint32_t j, bool on, bool) const { return on ? packed[j] : 0.0f; }
    __device__ void store(size_t i, uint32_t, bool on, float x) const
    {
        if (!on)
            return;
        if (BF16)
            static_cast<uint16_t *>(dense)[i] = scape_f_bf16(x);
        else
            static_cast<float *>(dense)[i] = x;
    }
};

extern "C" scape_rc kern_cuda_mask_expand(const float *packed, const uint32_t *mask,
                                          size_t n, void *dense, kern_dtype dt,
                                          void *scratch, size_t scratch_bytes,
                                          void *stream)
{
    static const char fn[] = "kern_cuda_mask_expand";
    KERN_NONNULL(fn, packed);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, dense);
    KERN_MAXN(fn, n);
    TRY(kern_check_dtype(fn, dt));
    size_t kb = packed_probe(n), nw = kern_mask_words(n);
    size_t dbytes = n * kern_dtype_size(dt);
    KERN_DISJOINT(fn, packed, kb, dense, dbytes);
    KERN_DISJOINT(fn, mask, nw * 4, dense, dbytes);
    TRY(check_scratch(fn, scratch, scratch_bytes, scan_scratch_bytes(nw),
                         {{packed, kb, "packed"}, {mask, nw * 4, "mask"},
                          {dense, dbytes, "dense"}}));
    cudaStream_t s = as_stream(stream);
    if (dt == KERN_BF16)
        return run_scatter(fn, expand_op<true>{packed, dense}, mask, n, scratch, s);
    return run_scatter(fn, expand_op<false>{packed, dense}, mask, n, scratch, s);
}

struct adams_masked_op {
    float *theta, *m;
    const float *sum;
    adam_par p;
    struct item {
        float th, m, s;
    };
    __device__ item load(size_t i, uint32_t j, bool on, bool) const
    {
        return on ? item{theta[i], m[i], sum[j]} : item{0.0f, 0.0f, 0.0f};
    }
    __device__ void store(size_t i, uint32_t, bool on, item x) const
    {
        if (!on)
            return;
        adams_one(x.th, x.m, scape_f_clip(scape_f_mean(x.s, p.div), p.clip), p);
        m[i] = x.m;
        theta[i] = x.th;
    }
};

struct adamw_masked_op {
    float *theta, *m, *v;
    const float *sum;
    adam_par p;
    struct item {
        float th, m, v, s;
    };
    __device__ item load(size_t i, uint32_t j, bool on, bool) const
    {
        return on ? item{theta[i], m[i], v[i], sum[j]} : item{0.0f, 0.0f, 0.0f, 0.0f};
    }
    __device__ void store(size_t i, uint32_t, bool on, item x) const
    {
        if (!on)
            return;
        adamw_one(x.th, x.m, x.v, scape_f_clip(scape_f_mean(x.s, p.div), p.clip), p);
        m[i] = x.m;
        v[i] = x.v;
        theta[i] = x.th;
    }
};

extern "C" scape_rc kern_cuda_adams_masked(float *theta, float *m, const float *sum,
                                           float div, const uint32_t *mask, size_t n,
                                           const kern_hyper *h, float lr, void *scratch,
                                           size_t scratch_bytes, void *stream)
{
    static const char fn[] = "kern_cuda_adams_masked";
    KERN_NONNULL(fn, mask);
    size_t kb = packed_probe(n), nw = kern_mask_words(n);
    TRY(check_update(fn, theta, m, NULL, 0, sum, kb, mask, n, h, div, lr));
    TRY(check_scratch(fn, scratch, scratch_bytes, scan_scratch_bytes(nw),
                         {{theta, n * 4, "theta"}, {m, n * 4, "m"}, {sum, kb, "sum"},
                          {mask, nw * 4, "mask"}}));
    adams_masked_op op = {theta, m, sum, make_par(h, div, lr, 0)};
    return run_scatter(fn, op, mask, n, scratch, as_stream(stream));
}

extern "C" scape_rc kern_cuda_adamw_masked(float *theta, float *m, float *v,
                                           const float *sum, float div,
                                           const uint32_t *mask, size_t n,
                                           const kern_hyper *h, float lr, uint64_t t,
                                           void *scratch, size_t scratch_bytes,
                                           void *stream)
{
    static const char fn[] = "kern_cuda_adamw_masked";
    KERN_NONNULL(fn, mask);
    size_t kb = packed_probe(n), nw = kern_mask_words(n);
    TRY(check_update(fn, theta, m, v, 1, sum, kb, mask, n, h, div, lr));
    if (t == 0)
        return scape_set_error(SCAPE_INVALID, "%s: step t must be >= 1", fn);
    TRY(check_scratch(fn, scratch, scratch_bytes, scan_scratch_bytes(nw),
                         {{theta, n * 4, "theta"}, {m, n * 4, "m"}, {v, n * 4, "v"},
                          {sum, kb, "sum"}, {mask, nw * 4, "mask"}}));
    adamw_masked_op op = {theta, m, v, sum, make_par(h, div, lr, t)};
    return run_scatter(fn, op, mask, n, scratch, as_stream(stream));
}

/* ---- exact top-k: radix select, then a ballot pass ----------------------- */

__device__ void zero_shared(uint32_t *h, unsigned bins)
{
    for (unsigned b = threadIdx.x; b < bins; b += blockDim.x)
        h[b] = 0;
    __syncthreads();
}

/* Add a block's shared histogram into the global one, skipping empty bins. */
__device__ void flush_hist(const uint32_t *h, unsigned bins, uint32_t *global)
{
    __syncthreads();
    for (unsigned b = threadIdx.x; b < bins; b += blockDim.x)
        if (h[b])
            atomicAdd(&global[b], h[b]);
}

__device__ __forceinline__ void count_key(uint32_t *h, uint32_t u, uint32_t prefix,
                                          unsigned pshift, unsigned shift, unsigned bins)
{
    if ((u >> pshift) == prefix)
        atomicAdd(&h[(u >> shift) & (bins - 1)], 1u);
}

/* Histogram of digit LEVEL over the keys whose higher digits equal the
 * buckets chosen so far: level 0 takes bits 30..20 of every key, level 1
 * bits 19..10 and level 2 bits 9..0.  Each level reads the whole segment
 * again: cheaper than appending candidates through one global counter. */
template <int V, int LEVEL>
__global__ void __launch_bounds__(HIST_THREADS)
    topk_hist_kernel(const float *stat, size_t n, topk_state *st)
{
    __shared__ uint32_t h[DIGIT1_BINS];
    const unsigned bins = LEVEL == 0 ? DIGIT1_BINS : DIGIT_BINS;
    const unsigned shift = 20 - 10 * LEVEL, pshift = LEVEL == 0 ? 31 : shift + 10;
    const uint32_t prefix = LEVEL == 0   ? 0u
                            : LEVEL == 1 ? st->digit[0]
                                         : (st->digit[0] << 10) | st->digit[1];
    zero_shared(h, bins);
    const size_t nv = n / V, stride = grid_threads(), t = global_tid();
    /* two loads in flight per thread: this pass is bound by memory latency */
    for (size_t v = t; v < nv; v += 2 * stride) {
        const bool two = v + stride < nv;
        vec<float, V> x = ld<V>(stat, v), y = two ? ld<V>(stat, v + stride) : x;
#pragma unroll
        for (int i = 0; i < V; i++) {
            count_key(h, scape_f_key(x.x[i]), prefix, pshift, shift, bins);
            if (two)
                count_key(h, scape_f_key(y.x[i]), prefix, pshift, shift, bins);
        }
    }
    if (V > 1 && t < n - nv * V)
        count_key(h, scape_f_key(stat[nv * V + t]), prefix, pshift, shift, bins);
    flush_hist(h, bins, st->hist[LEVEL]);
}

__device__ void record_digit(topk_state *st, int level, uint32_t d, uint32_t need,
                             uint32_t count)
{
    st->digit[level] = d;
    st->need = need;
    if (level == 2) {
        st->tau = (st->digit[0] << 20) | (st->digit[1] << 10) | d;
        st->eq_total = count;
    }
}

/* Choose the bucket holding the need-th largest key (need = k at level 0):
 * thread t owns the t-th group of bins from the top; a scan of the group sums
 * gives the count above each bin, and exactly one bin crosses `need`. */
__global__ void __launch_bounds__(SCAN_THREADS)
    topk_select_kernel(topk_state *st, int level, uint32_t k)
{
    const uint32_t nb = level == 0 ? DIGIT1_BINS : DIGIT_BINS, per = nb / SCAN_THREADS;
    const uint32_t *h = st->hist[level];
    const uint32_t need = level == 0 ? k : st->need;
    const uint32_t hi = nb - threadIdx.x * per;
    uint32_t mine = 0;
    for (uint32_t q = 1; q <= per; q++)
        mine += h[hi - q];
    uint32_t above = block_excl_scan<SCAN_THREADS>(mine, NULL);
    for (uint32_t q = 1; q <= per; q++) {
        uint32_t d = hi - q, c = h[d];
        if (above < need && above + c >= need)
            record_digit(st, level, d, need - above, c);
        above += c;
    }
}

/* Per word of the block's tile: bits of keys above tau and equal to tau.
 * Row r of warp w is word r*WARPS + w; BATCH rows are loaded at once. */
__device__ void ballot_tile(const float *stat, size_t n, uint32_t tau, uint32_t *s_gt,
                            uint32_t *s_eq)
{
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t e0 = (size_t)blockIdx.x * TILE * 32;
    for (unsigned r0 = 0; r0 < TILE / WARPS; r0 += BATCH) {
        uint32_t u[BATCH];
        bool ok[BATCH];
#pragma unroll
        for (unsigned b = 0; b < BATCH; b++) {
            size_t i = e0 + (size_t)((r0 + b) * WARPS + warp) * 32 + lane;
            ok[b] = i < n;
            u[b] = ok[b] ? scape_f_key(stat[i]) : 0u;
        }
#pragma unroll
        for (unsigned b = 0; b < BATCH; b++) {
            uint32_t gt = __ballot_sync(0xffffffffu, ok[b] && u[b] > tau);
            uint32_t eq = __ballot_sync(0xffffffffu, ok[b] && u[b] == tau);
            if (lane == 0) {
                s_gt[(r0 + b) * WARPS + warp] = gt;
                s_eq[(r0 + b) * WARPS + warp] = eq;
            }
        }
    }
    __syncthreads();
}

/* The tie bits of a word whose first tie has rank off: those ranked < need. */
__device__ uint32_t first_ties(uint32_t eq, uint32_t off, uint32_t need)
{
    if (off >= need)
        return 0;
    uint32_t left = need - off;
    if (left >= (uint32_t)__popc(eq))
        return eq;
    uint32_t sel = 0;
    for (; left; left--) {
        sel |= eq & (0u - eq);
        eq &= eq - 1;
    }
    return sel;
}

/* COUNT pass (FINAL false): ties per tile, only when some ties are left out.
 * FINAL pass: mask word = keys above tau | the first `need` ties in order. */
template <bool FINAL>
__global__ void __launch_bounds__(TILE)
    topk_tile_kernel(const float *stat, size_t n, const topk_state *st,
                     uint32_t *tiles, uint32_t *mask)
{
    __shared__ uint32_t s_gt[TILE], s_eq[TILE];
    const uint32_t tau = st->tau, need = st->need;
    const bool trim = need < st->eq_total;
    if (!FINAL && !trim) {
        if (threadIdx.x == 0)
            tiles[blockIdx.x] = 0;
        return;
    }
    ballot_tile(stat, n, tau, s_gt, s_eq);
    uint32_t eq = s_eq[threadIdx.x], total;
    if (!FINAL) {
        block_excl_scan<TILE>(__popc(eq), &total);
        if (threadIdx.x == 0)
            tiles[blockIdx.x] = total;
        return;
    }
    if (trim)
        eq = first_ties(eq, tiles[blockIdx.x] + block_excl_scan<TILE>(__popc(eq), NULL),
                        need);
    const size_t w = (size_t)blockIdx.x * TILE + threadIdx.x;
    if (w < (n + 31) / 32)
        mask[w] = s_gt[threadIdx.x] | eq;
}

struct topk_layout {
    topk_state *st;
    uint32_t *tiles; /* tie counts per tile, then their scan */
};

static topk_layout topk_carve(void *scratch)
{
    char *p = static_cast<char *>(scratch);
    return {reinterpret_cast<topk_state *>(p),
            reinterpret_cast<uint32_t *>(p + align256(sizeof(topk_state)))};
}

template <int V>
static void launch_hist(int level, unsigned blocks, const float *stat, size_t n,
                        topk_state *st, cudaStream_t s)
{
    if (level == 0)
        topk_hist_kernel<V, 0><<<blocks, HIST_THREADS, 0, s>>>(stat, n, st);
    else if (level == 1)
        topk_hist_kernel<V, 1><<<blocks, HIST_THREADS, 0, s>>>(stat, n, st);
    else
        topk_hist_kernel<V, 2><<<blocks, HIST_THREADS, 0, s>>>(stat, n, st);
}

/* The three digit passes; leaves tau, need and eq_total in the state. */
static scape_rc topk_select(const char *fn, const float *stat, size_t n, size_t k,
                            topk_state *st, cudaStream_t s)
{
    const bool vec4 = aligned(stat, 16);
    const unsigned blocks = grid_for(vec4 ? n / 4 : n, HIST_THREADS, HIST_MAX_BLOCKS);
    CUDA_TRY(fn, cudaMemsetAsync(st, 0, sizeof(topk_state), s));
    for (int level = 0; level < 3; level++) {
        if (vec4)
            launch_hist<4>(level, blocks, stat, n, st, s);
        else
            launch_hist<1>(level, blocks, stat, n, st, s);
        TRY(launched(fn));
        topk_select_kernel<<<1, SCAN_THREADS, 0, s>>>(st, level, (uint32_t)k);
        TRY(launched(fn));
    }
    return SCAPE_OK;
}

/* Count ties per tile, scan the counts, write the mask. */
static scape_rc topk_write_mask(const char *fn, const float *stat, size_t n,
                                const topk_layout &L, uint32_t *mask, cudaStream_t s)
{
    const size_t nt = tiles_of(kern_mask_words(n));
    topk_tile_kernel<false><<<(unsigned)nt, TILE, 0, s>>>(stat, n, L.st, L.tiles, mask);
    TRY(launched(fn));
    tile_scan_kernel<<<1, SCAN_THREADS, 0, s>>>(L.tiles, nt);
    TRY(launched(fn));
    topk_tile_kernel<true><<<(unsigned)nt, TILE, 0, s>>>(stat, n, L.st, L.tiles, mask);
    return launched(fn);
}

extern "C" scape_rc kern_cuda_topk_mask(const float *stat, size_t n, size_t k,
                                        uint32_t *mask, void *scratch,
                                        size_t scratch_bytes, void *stream)
{
    static const char fn[] = "kern_cuda_topk_mask";
    KERN_NONNULL(fn, stat);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, scratch);
    KERN_MAXN(fn, n);
    if (k > n)
        return scape_set_error(SCAPE_INVALID, "%s: k=%zu > n=%zu", fn, k, n);
    TRY(check_scratch(fn, scratch, scratch_bytes, topk_scratch_bytes(n), {}));
    size_t nw = kern_mask_words(n);
    KERN_DISJOINT(fn, mask, nw * 4, stat, n * 4);
    KERN_DISJOINT(fn, mask, nw * 4, scratch, scratch_bytes);
    KERN_DISJOINT(fn, stat, n * 4, scratch, scratch_bytes);
    cudaStream_t s = as_stream(stream);
    if (k == 0) {
        if (nw)
            CUDA_TRY(fn, cudaMemsetAsync(mask, 0, nw * sizeof *mask, s));
        return SCAPE_OK;
    }
    topk_layout L = topk_carve(scratch);
    TRY(topk_select(fn, stat, n, k, L.st, s));
    return topk_write_mask(fn, stat, n, L, mask, s);
}

/* The device has the bandwidth to store the statistic, so the twin composes
 * the two kernels it is defined by; the result is the same bits. */
extern "C" scape_rc kern_cuda_topk_ef(const float *m, const float *g, const float *e,
                                      size_t n, float beta1, float t_r, size_t k,
                                      uint32_t *mask, void *scratch, size_t scratch_bytes,
                                      void *stream)
{
    static const char fn[] = "kern_cuda_topk_ef";
    KERN_NONNULL(fn, g);
    KERN_NONNULL(fn, e);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, scratch);
    TRY(kern_check_stat_args(fn, n, m, beta1, t_r));
    if (k > n)
        return scape_set_error(SCAPE_INVALID, "%s: k=%zu > n=%zu", fn, k, n);
    size_t mb = kern_mask_words(n) * 4, vb = n * sizeof(float), mvb = m ? vb : 0;
    KERN_DISJOINT(fn, mask, mb, g, vb);
    KERN_DISJOINT(fn, mask, mb, e, vb);
    KERN_DISJOINT(fn, mask, mb, m, mvb);
    TRY(check_scratch(fn, scratch, scratch_bytes, topk_ef_scratch_bytes(n),
                      {{g, vb, "g"}, {e, vb, "e"}, {m, mvb, "m"}, {mask, mb, "mask"}}));
    if (n == 0)
        return SCAPE_OK;
    float *stat = static_cast<float *>(scratch);
    void *rest = static_cast<char *>(scratch) + align256(n * sizeof(float));
    size_t rest_bytes = scratch_bytes - align256(n * sizeof(float));
    TRY(m ? kern_cuda_mask_stat(m, g, e, n, beta1, t_r, stat, stream)
             : kern_cuda_abs_stat(g, e, n, stat, stream));
    return kern_cuda_topk_mask(stat, n, k, mask, rest, rest_bytes, stream);
}

extern "C" scape_rc kern_cuda_topk_packed(const float *m, const float *e, const uint32_t *sent,
                                          const float *packed, size_t n, float beta1,
                                          float t_r, size_t k, uint32_t *mask, void *scratch,
                                          size_t scratch_bytes, void *stream)
{
    static const char fn[] = "kern_cuda_topk_packed";
    KERN_NONNULL(fn, e);
    KERN_NONNULL(fn, mask);
    KERN_NONNULL(fn, scratch);
    if (sent)
        KERN_NONNULL(fn, packed);
    TRY(kern_check_stat_args(fn, n, m, beta1, t_r));
    if (k > n)
        return scape_set_error(SCAPE_INVALID, "%s: k=%zu > n=%zu", fn, k, n);
    size_t mb = kern_mask_words(n) * 4, vb = n * sizeof(float), mvb = m ? vb : 0;
    size_t sb = sent ? mb : 0, pb = sent ? packed_probe(n) : 0;
    KERN_DISJOINT(fn, mask, mb, e, vb);
    KERN_DISJOINT(fn, mask, mb, m, mvb);
    KERN_DISJOINT(fn, mask, mb, sent, sb);
    KERN_DISJOINT(fn, mask, mb, packed, pb);
    TRY(check_scratch(fn, scratch, scratch_bytes, topk_packed_scratch_bytes(n),
                      {{e, vb, "e"}, {m, mvb, "m"}, {sent, sb, "sent"}, {packed, pb, "packed"},
                       {mask, mb, "mask"}}));
    if (n == 0)
        return SCAPE_OK;
    cudaStream_t s = as_stream(stream);
    size_t vec = align256(n * sizeof(float));
    float *a = static_cast<float *>(scratch);
    float *zero = reinterpret_cast<float *>(static_cast<char *>(scratch) + vec);
    void *rest = static_cast<char *>(scratch) + 2 * vec;
    size_t rest_bytes = scratch_bytes - 2 * vec;
    CUDA_TRY(fn, cudaMemcpyAsync(a, e, n * sizeof(float), cudaMemcpyDeviceToDevice, s));
    CUDA_TRY(fn, cudaMemsetAsync(zero, 0, n * sizeof(float), s));
    if (sent)
        TRY(run_scatter(fn, rebuild_op{packed, a}, sent, n, rest, s));
    return kern_cuda_topk_ef(m, a, zero, n, beta1, t_r, k, mask, rest, rest_bytes, stream);
}
