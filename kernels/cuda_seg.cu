/* cuda_seg.cu - the segmented kernels of scape_seg.h on a CUDA device.
 *
 * The element work and the index math are scape_seg.h's, the CPU version's
 * own (cpu_seg.c); here they are spread over threads:
 *  - word-range kernels (PACK, UPDATE, COMPACT, WRITEBACK, LOAD_THETA): one
 *    block per tile of KSEG_TILE mask words, aligned on word 0; a block scan
 *    of the words' popcounts plus the tile's entry of the scan from word 0
 *    gives every set bit its packed index; each warp then takes one word at
 *    a time, a lane per element (32 consecutive floats: coalesced);
 *  - top-k: a block per item (at most KSEG_TILE words of one tensor) for the
 *    histograms, tie counts and the mask words (ballots), a block per
 *    selected tensor to pick a digit's bucket or to scan the tie counts;
 *  - mask code: a block per tile of the range for the encode (a set bit's
 *    rank from the range's scan), a thread per word or per position for the
 *    decode, atomics into the words and the status.
 * Each launch's failure to start is reported; what the data holds (a packed
 * index past its buffer, a bad peer code) goes into the kseg_status.
 */
#include <cuda_runtime.h>

#include <stdint.h>

#include "cuda_scan.cuh"
#include "scape_seg.h"
#include "try.h"

#define WARPS (KSEG_TILE / 32)
#define MAP_THREADS 256
#define MAP_MAX_BLOCKS 8192

static __device__ __forceinline__ uint64_t gtid()
{
    return (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
}
static __device__ __forceinline__ uint64_t gthreads() { return (uint64_t)gridDim.x * blockDim.x; }

static __device__ void note_err(kseg_status *st, uint32_t err)
{
    if (err)
        atomicOr(&st->err, err);
}

static __device__ void bad_code(const kseg_code_args &a, uint32_t tensor, uint32_t what)
{
    atomicOr(&a.status->err, (uint32_t)KSEG_E_CODE);
    atomicMin(reinterpret_cast<unsigned long long *>(&a.status->first),
              (unsigned long long)kseg_bad(a.rank, tensor, what));
}

/* Sum of a double across the warp, to lane 0. */
static __device__ double warp_sum(double x)
{
    for (int d = 16; d > 0; d >>= 1)
        x += __shfl_down_sync(0xffffffffu, x, d);
    return x;
}

static __device__ unsigned long long warp_sum_u64(unsigned long long x)
{
    for (int d = 16; d > 0; d >>= 1)
        x += __shfl_down_sync(0xffffffffu, x, d);
    return x;
}

/* ---- scan ------------------------------------------------------------------------ */

/* tiles[b] = set bits of the words of tile b (words [w0 + b TILE, ...)). */
static __global__ void __launch_bounds__(KSEG_TILE)
    scan_count_kernel(const uint32_t *mask, uint64_t w0, uint64_t w1, uint32_t *tiles)
{
    uint64_t w = w0 + (uint64_t)blockIdx.x * KSEG_TILE + threadIdx.x;
    uint32_t total;
    block_excl_scan<KSEG_TILE>(w < w1 ? (uint32_t)__popc(mask[w]) : 0u, &total);
    if (threadIdx.x == 0)
        tiles[blockIdx.x] = total;
}

static __global__ void __launch_bounds__(SCAN_THREADS) scan_tiles_kernel(uint32_t *tiles,
                                                                         uint64_t nt)
{
    uint32_t total = block_scan_run(tiles, nt);
    if (threadIdx.x == 0)
        tiles[nt] = total;
}

/* ---- word-range kernels ----------------------------------------------------------- */

template <kseg_kernel OP>
static __global__ void __launch_bounds__(KSEG_TILE)
    word_kernel(const __grid_constant__ kseg_args a)
{
    __shared__ uint32_t s_bits[KSEG_TILE], s_off[KSEG_TILE];
    const uint64_t tile = a.w0 / KSEG_TILE + blockIdx.x;
    const uint64_t w = tile * KSEG_TILE + threadIdx.x;
    const bool dense = a.mask == NULL;
    /* words before w0 count for the prefix; words from w1 on come after */
    uint32_t bits = !dense && w < a.w1 ? a.mask[w] : 0u;
    uint32_t pre = dense ? 0u : a.tiles[tile] + block_excl_scan<KSEG_TILE>(__popc(bits), NULL);
    s_bits[threadIdx.x] = dense ? 0xffffffffu : bits;
    s_off[threadIdx.x] = pre;
    __syncthreads();

    kseg_acc acc = { 0.0, 0u };
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t below = (1u << lane) - 1u;
    for (unsigned r = 0; r < KSEG_TILE / WARPS; r++) {
        const unsigned lw = r * WARPS + warp;
        const uint64_t ww = tile * KSEG_TILE + lw;
        if (ww < a.w0 || ww >= a.w1)
            continue;
        const kseg_tensor *t = &a.t[kseg_find(a.t, 0, a.nt, ww)];
        const uint64_t i = (ww - t->word) * 32 + lane;
        if (i >= t->len)
            continue;
        const uint32_t b = s_bits[lw];
        const uint64_t idx = dense ? t->pos + i : (uint64_t)s_off[lw] + __popc(b & below);
        kseg_elem(OP, &a, t, i, (b >> lane) & 1u, idx, &acc);
    }
    uint32_t err = __reduce_or_sync(0xffffffffu, acc.err);
    /* The residual's squared norm, for the status metric only (nothing
     * computed from it): its sum runs in the order the warps finish, so its
     * last bits may differ from the host executor's and from run to run. */
    double n2 = OP == KSEG_PACK ? warp_sum(acc.norm2) : 0.0;
    if (lane == 0 && a.status) {
        note_err(a.status, err);
        if (n2 != 0.0)
            atomicAdd(&a.status->norm2, n2);
    }
}

static __global__ void __launch_bounds__(MAP_THREADS)
    gsum_kernel(const __grid_constant__ kseg_args a)
{
    for (uint64_t i = gtid(); i < a.n; i += gthreads())
        a.out[i] = kseg_grad(&a, i);
}

/* SQSUM: one warp per chunk, its lanes as scape_f_sq_lane, combined by
 * warp_sum's halving tree (scape_f_sqsum_chunk's order); then one thread adds
 * the chunks in order. */
static __global__ void __launch_bounds__(MAP_THREADS)
    sqsum_chunk_kernel(const __grid_constant__ kseg_args a)
{
    const uint64_t c = (uint64_t)blockIdx.x * (MAP_THREADS / 32) + (threadIdx.x >> 5);
    const unsigned lane = threadIdx.x & 31;
    if (c >= kseg_sq_chunks(a.n))
        return; /* a whole warp leaves together: c is the warp's */
    const uint64_t left = a.n - c * SCAPE_SQ_CHUNK;
    double x = scape_f_sq_lane(a.in + c * SCAPE_SQ_CHUNK,
                               left < SCAPE_SQ_CHUNK ? (size_t)left : SCAPE_SQ_CHUNK, a.div, lane);
    x = warp_sum(x);
    if (lane == 0)
        a.sq[c] = x;
}

static __global__ void sqsum_total_kernel(const __grid_constant__ kseg_args a)
{
    double total = 0.0;
    for (uint64_t c = 0, nc = kseg_sq_chunks(a.n); c < nc; c++)
        total += a.sq[c];
    *a.sq_total = total;
}

static __global__ void __launch_bounds__(MAP_THREADS)
    churn_kernel(const __grid_constant__ kseg_args a)
{
    unsigned long long fresh = 0, total = 0;
    for (uint64_t w = a.w0 + gtid(); w < a.w1; w += gthreads()) {
        fresh += (unsigned long long)__popc(a.mask[w] & ~a.prev[w]);
        total += (unsigned long long)__popc(a.mask[w]);
    }
    fresh = warp_sum_u64(fresh);
    total = warp_sum_u64(total);
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(reinterpret_cast<unsigned long long *>(&a.status->churn[0]), fresh);
        atomicAdd(reinterpret_cast<unsigned long long *>(&a.status->churn[1]), total);
    }
}

/* ---- top-k ------------------------------------------------------------------------- */

/* The item's tensor, its first element in the tensor and its element count. */
static __device__ const kseg_tensor *item_span(const kseg_topk_args &a, const kseg_item &it,
                                               uint64_t *base, uint32_t *n)
{
    const kseg_tensor *t = &a.t[a.first + it.sel];
    *base = (it.word - t->word) * 32;
    uint64_t left = t->len - *base, all = (uint64_t)it.nwords * 32;
    *n = (uint32_t)(left < all ? left : all);
    return t;
}

template <int LEVEL>
static __global__ void __launch_bounds__(KSEG_TILE)
    topk_hist_kernel(const __grid_constant__ kseg_topk_args a)
{
    __shared__ uint32_t h[KSEG_BINS0];
    const unsigned bins = LEVEL == 0 ? KSEG_BINS0 : KSEG_BINS;
    for (unsigned b = threadIdx.x; b < bins; b += blockDim.x)
        h[b] = 0;
    __syncthreads();
    const kseg_item it = a.items[blockIdx.x];
    const kseg_tstate s = a.st[it.sel];
    uint64_t base;
    uint32_t n;
    const kseg_tensor *t = item_span(a, it, &base, &n);
    const uint32_t *keys = a.keys + (t->pos + base - a.key_lo);
    for (uint32_t e = threadIdx.x; e < n; e += blockDim.x) {
        uint32_t key = keys[e];
        if (kseg_in_prefix(&s, key, LEVEL))
            atomicAdd(&h[kseg_digit(key, LEVEL)], 1u);
    }
    __syncthreads();
    uint32_t *g = a.hist + (uint64_t)it.sel * KSEG_BINS0;
    for (unsigned b = threadIdx.x; b < bins; b += blockDim.x)
        if (h[b])
            atomicAdd(&g[b], h[b]);
}

/* Thread q owns bins [hi - per, hi) counted from the top; a scan of their
 * sums gives the keys above each bin, and one bin crosses `need`. */
static __global__ void __launch_bounds__(SCAN_THREADS)
    topk_pick_kernel(const __grid_constant__ kseg_topk_args a)
{
    const uint32_t sel = blockIdx.x;
    const uint32_t nb = a.level == 0 ? KSEG_BINS0 : KSEG_BINS, per = nb / SCAN_THREADS;
    const uint32_t *h = a.hist + (uint64_t)sel * KSEG_BINS0;
    kseg_tstate *st = &a.st[sel];
    const uint32_t need = a.level == 0 ? a.t[a.first + sel].k : st->need;
    const uint32_t hi = nb - threadIdx.x * per;
    uint32_t mine = 0;
    for (uint32_t q = 1; q <= per; q++)
        mine += h[hi - q];
    uint32_t above = block_excl_scan<SCAN_THREADS>(mine, NULL);
    for (uint32_t q = 1; q <= per; q++) {
        uint32_t d = hi - q, c = h[d];
        /* as the CPU version: the crossing bucket, else bucket 0 (fewer
         * keys than need) or the top one (need 0); neither happens with
         * k >= 1, but the state is never left stale */
        bool hit = above + c >= need ? (above < need || (need == 0 && d == nb - 1)) : d == 0;
        if (hit)
            kseg_record_digit(st, a.level, d, need - above, c);
        above += c;
    }
}

static __global__ void __launch_bounds__(KSEG_TILE)
    topk_count_kernel(const __grid_constant__ kseg_topk_args a)
{
    const kseg_item it = a.items[blockIdx.x];
    const kseg_tstate s = a.st[it.sel];
    if (!(s.need < s.eq_total)) {
        if (threadIdx.x == 0)
            a.item_eq[blockIdx.x] = 0;
        return;
    }
    uint64_t base;
    uint32_t n, c = 0, total;
    const kseg_tensor *t = item_span(a, it, &base, &n);
    const uint32_t *keys = a.keys + (t->pos + base - a.key_lo);
    for (uint32_t e = threadIdx.x; e < n; e += blockDim.x)
        c += keys[e] == s.tau;
    block_excl_scan<KSEG_TILE>(c, &total);
    if (threadIdx.x == 0)
        a.item_eq[blockIdx.x] = total;
}

static __global__ void __launch_bounds__(SCAN_THREADS)
    topk_scan_kernel(const __grid_constant__ kseg_topk_args a)
{
    uint32_t i0 = a.item0[blockIdx.x], i1 = a.item0[blockIdx.x + 1];
    block_scan_run(a.item_eq + i0, i1 - i0);
}

static __global__ void __launch_bounds__(KSEG_TILE)
    topk_write_kernel(const __grid_constant__ kseg_topk_args a)
{
    __shared__ uint32_t s_gt[KSEG_TILE], s_eq[KSEG_TILE];
    const kseg_item it = a.items[blockIdx.x];
    const kseg_tstate s = a.st[it.sel];
    uint64_t base;
    uint32_t n;
    const kseg_tensor *t = item_span(a, it, &base, &n);
    const uint32_t *keys = a.keys + (t->pos + base - a.key_lo);
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (unsigned r = 0; r < KSEG_TILE / WARPS; r++) {
        const unsigned q = r * WARPS + warp;
        if (q >= it.nwords)
            continue; /* the same for the whole warp */
        const uint32_t e = q * 32 + lane;
        const bool live = e < n;
        const uint32_t key = live ? keys[e] : 0u;
        uint32_t gt = __ballot_sync(0xffffffffu, live && key > s.tau);
        uint32_t eq = __ballot_sync(0xffffffffu, live && key == s.tau);
        if (lane == 0) {
            s_gt[q] = gt;
            s_eq[q] = eq;
        }
    }
    __syncthreads();
    const unsigned q = threadIdx.x;
    uint32_t eq = q < it.nwords ? s_eq[q] : 0u;
    uint32_t off = a.item_eq[blockIdx.x] + block_excl_scan<KSEG_TILE>(__popc(eq), NULL);
    if (q < it.nwords)
        a.mask[it.word + q] = kseg_topk_word(&s, s_gt[q], eq, off);
}

/* ---- mask code ------------------------------------------------------------------------ */

/* The range's entry of word w. */
static __device__ uint32_t code_of_word(const kseg_code_args &a, uint64_t w)
{
    uint32_t c0 = a.c[0].tensor;
    return kseg_find(a.t, c0, c0 + a.nc, w) - c0;
}

static __device__ void put_bits(uint32_t *code, uint64_t at, uint32_t v, uint32_t b)
{
    uint32_t lo, hi;
    int spans;
    kseg_bits_split(at, v, b, &lo, &hi, &spans);
    if (lo)
        atomicOr(&code[at >> 5], lo);
    if (spans && hi)
        atomicOr(&code[(at >> 5) + 1], hi);
}

/* count[ci]: the range's set bits before entry ci's first word, so that a
 * bit's rank in its tensor does not depend on the other tensors' counts
 * (the CPU version counts per tensor). */
static __global__ void __launch_bounds__(MAP_THREADS)
    encode_base_kernel(const __grid_constant__ kseg_code_args a)
{
    for (uint64_t ci = gtid(); ci < a.nc; ci += gthreads()) {
        const uint64_t rel = a.t[a.c[ci].tensor].word - a.w0;
        uint32_t n = a.tiles[rel / KSEG_TILE];
        for (uint64_t q = rel / KSEG_TILE * KSEG_TILE; q < rel; q++)
            n += (uint32_t)__popc(a.words[a.w0 + q]);
        a.count[ci] = n;
    }
}

static __global__ void __launch_bounds__(KSEG_TILE)
    encode_kernel(const __grid_constant__ kseg_code_args a)
{
    const uint64_t rel = (uint64_t)blockIdx.x * KSEG_TILE + threadIdx.x, w = a.w0 + rel;
    const bool live = rel < a.nwords;
    const uint32_t bits = live ? a.words[w] : 0u;
    const uint32_t pre = a.tiles[blockIdx.x] + block_excl_scan<KSEG_TILE>(__popc(bits), NULL);
    if (!live)
        return;
    const uint32_t ci = code_of_word(a, w);
    const kseg_code c = a.c[ci];
    const kseg_tensor *t = &a.t[c.tensor];
    const uint64_t q_word = w - t->word;
    if (!c.by_index) {
        a.code[c.at + q_word] = bits;
        return;
    }
    uint64_t q = pre - a.count[ci];
    for (uint32_t x = bits; x; x &= x - 1, q++) {
        uint32_t i = (uint32_t)(32 * q_word) + (uint32_t)(__ffs(x) - 1);
        if (i >= t->len)
            bad_code(a, c.tensor, KSEG_BAD_K); /* a bit past the end, as maskcode.c */
        else if (q < t->k)
            put_bits(a.code, c.at + q * c.bits, i, c.bits);
    }
    if (q_word + 1 == kseg_words_of(t) && q != t->k)
        bad_code(a, c.tensor, KSEG_BAD_K);
}

static __global__ void __launch_bounds__(MAP_THREADS)
    decode_zero_kernel(const __grid_constant__ kseg_code_args a)
{
    for (uint64_t rel = gtid(); rel < a.nwords; rel += gthreads()) {
        uint64_t w = a.w0 + rel;
        if (a.c[code_of_word(a, w)].by_index)
            a.words[w] = 0u;
    }
}

static __global__ void __launch_bounds__(MAP_THREADS)
    decode_map_kernel(const __grid_constant__ kseg_code_args a)
{
    for (uint64_t rel = gtid(); rel < a.nwords; rel += gthreads()) {
        uint64_t w = a.w0 + rel;
        uint32_t ci = code_of_word(a, w);
        const kseg_code c = a.c[ci];
        if (c.by_index)
            continue;
        const kseg_tensor *t = &a.t[c.tensor];
        uint64_t q = w - t->word;
        uint32_t x = a.code[c.at + q];
        if (q + 1 == kseg_words_of(t) && (t->len & 31) && (x >> (t->len & 31)))
            bad_code(a, c.tensor, KSEG_BAD_TAIL);
        atomicAdd(&a.count[ci], (uint32_t)__popc(x));
        a.words[w] = a.merge ? a.words[w] | x : x;
    }
}

/* The last entry whose qbase <= f: the index-coded tensor of position f. */
static __device__ uint32_t code_of_pos(const kseg_code_args &a, uint64_t f)
{
    uint32_t lo = 0, hi = a.nc;
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (a.c[mid].qbase <= f)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

static __global__ void __launch_bounds__(MAP_THREADS)
    decode_pos_kernel(const __grid_constant__ kseg_code_args a)
{
    for (uint64_t f = gtid(); f < a.npos; f += gthreads()) {
        const kseg_code c = a.c[code_of_pos(a, f)];
        const kseg_tensor *t = &a.t[c.tensor];
        uint64_t q = f - c.qbase;
        uint32_t p = kseg_bits_get(a.code, c.at + q * c.bits, c.bits);
        uint32_t prev = q ? kseg_bits_get(a.code, c.at + (q - 1) * c.bits, c.bits) : 0u;
        if (p >= t->len || (q && p <= prev)) {
            bad_code(a, c.tensor, KSEG_BAD_ORDER);
            continue;
        }
        atomicOr(&a.words[t->word + p / 32], 1u << (p % 32));
    }
}

static __global__ void __launch_bounds__(MAP_THREADS)
    decode_check_kernel(const __grid_constant__ kseg_code_args a)
{
    for (uint32_t ci = threadIdx.x; ci < a.nc; ci += blockDim.x)
        if (!a.c[ci].by_index && a.count[ci] != a.t[a.c[ci].tensor].k)
            bad_code(a, a.c[ci].tensor, KSEG_BAD_COUNT);
    if (threadIdx.x != 0)
        return;
    for (uint64_t b = a.map_words * 32 + a.pos_bits; b < a.code_words * 32; b++)
        if ((a.code[b >> 5] >> (b & 31)) & 1u) {
            bad_code(a, 0xffffffu, KSEG_BAD_PADDING);
            break;
        }
}

/* ---- dispatch ------------------------------------------------------------------------ */

static unsigned grid_for(uint64_t work, unsigned threads)
{
    uint64_t b = (work + threads - 1) / threads;
    return b == 0 ? 1u : b > MAP_MAX_BLOCKS ? MAP_MAX_BLOCKS : (unsigned)b;
}

/* Blocks of the tiles aligned on word 0 that hold words [w0, w1). */
static unsigned word_blocks(uint64_t w0, uint64_t w1)
{
    return w1 > w0 ? (unsigned)((w1 + KSEG_TILE - 1) / KSEG_TILE - w0 / KSEG_TILE) : 0u;
}

static scape_rc launched(kseg_kernel k)
{
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "segmented kernel %d: launch failed: %s", (int)k,
                               cudaGetErrorString(err));
    return SCAPE_OK;
}

template <kseg_kernel OP> static void launch_words(const kseg_args &a, cudaStream_t s)
{
    unsigned blocks = word_blocks(a.w0, a.w1);
    if (blocks)
        word_kernel<OP><<<blocks, KSEG_TILE, 0, s>>>(a);
}

static void launch_topk_hist(const kseg_topk_args &a, cudaStream_t s)
{
    if (a.level == 0)
        topk_hist_kernel<0><<<a.nitems, KSEG_TILE, 0, s>>>(a);
    else if (a.level == 1)
        topk_hist_kernel<1><<<a.nitems, KSEG_TILE, 0, s>>>(a);
    else
        topk_hist_kernel<2><<<a.nitems, KSEG_TILE, 0, s>>>(a);
}

extern "C" scape_rc kseg_run_cuda(kseg_kernel k, const void *args, void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const kseg_args &a = *static_cast<const kseg_args *>(args);
    const kseg_topk_args &tk = *static_cast<const kseg_topk_args *>(args);
    const kseg_code_args &ca = *static_cast<const kseg_code_args *>(args);
    switch (k) {
    case KSEG_SCAN: {
        uint64_t nt = kseg_tiles(a.w1 - a.w0);
        if (nt)
            scan_count_kernel<<<(unsigned)nt, KSEG_TILE, 0, s>>>(a.mask, a.w0, a.w1, a.tiles);
        TRY(launched(k));
        scan_tiles_kernel<<<1, SCAN_THREADS, 0, s>>>(a.tiles, nt);
        break;
    }
    case KSEG_PACK: launch_words<KSEG_PACK>(a, s); break;
    case KSEG_UPDATE: launch_words<KSEG_UPDATE>(a, s); break;
    case KSEG_COMPACT: launch_words<KSEG_COMPACT>(a, s); break;
    case KSEG_WRITEBACK: launch_words<KSEG_WRITEBACK>(a, s); break;
    case KSEG_LOAD_THETA: launch_words<KSEG_LOAD_THETA>(a, s); break;
    case KSEG_GSUM:
        if (a.n)
            gsum_kernel<<<grid_for(a.n, MAP_THREADS), MAP_THREADS, 0, s>>>(a);
        break;
    case KSEG_CHURN:
        if (a.w1 > a.w0)
            churn_kernel<<<grid_for(a.w1 - a.w0, MAP_THREADS), MAP_THREADS, 0, s>>>(a);
        break;
    case KSEG_SQSUM: {
        uint64_t nc = kseg_sq_chunks(a.n);
        if (nc)
            sqsum_chunk_kernel<<<(unsigned)((nc + MAP_THREADS / 32 - 1) / (MAP_THREADS / 32)),
                                 MAP_THREADS, 0, s>>>(a);
        TRY(launched(k));
        sqsum_total_kernel<<<1, 1, 0, s>>>(a);
        break;
    }
    case KSEG_TOPK_HIST:
        if (tk.nitems)
            launch_topk_hist(tk, s);
        break;
    case KSEG_TOPK_PICK:
        if (tk.nsel)
            topk_pick_kernel<<<tk.nsel, SCAN_THREADS, 0, s>>>(tk);
        break;
    case KSEG_TOPK_COUNT:
        if (tk.nitems)
            topk_count_kernel<<<tk.nitems, KSEG_TILE, 0, s>>>(tk);
        break;
    case KSEG_TOPK_SCAN:
        if (tk.nsel)
            topk_scan_kernel<<<tk.nsel, SCAN_THREADS, 0, s>>>(tk);
        break;
    case KSEG_TOPK_WRITE:
        if (tk.nitems)
            topk_write_kernel<<<tk.nitems, KSEG_TILE, 0, s>>>(tk);
        break;
    case KSEG_ENCODE:
        if (ca.nwords == 0)
            break;
        encode_base_kernel<<<grid_for(ca.nc, MAP_THREADS), MAP_THREADS, 0, s>>>(ca);
        TRY(launched(k));
        encode_kernel<<<(unsigned)kseg_tiles(ca.nwords), KSEG_TILE, 0, s>>>(ca);
        break;
    case KSEG_DECODE_ZERO:
        if (ca.nwords && !ca.merge)
            decode_zero_kernel<<<grid_for(ca.nwords, MAP_THREADS), MAP_THREADS, 0, s>>>(ca);
        break;
    case KSEG_DECODE_MAP:
        if (ca.nwords)
            decode_map_kernel<<<grid_for(ca.nwords, MAP_THREADS), MAP_THREADS, 0, s>>>(ca);
        break;
    case KSEG_DECODE_POS:
        if (ca.npos)
            decode_pos_kernel<<<grid_for(ca.npos, MAP_THREADS), MAP_THREADS, 0, s>>>(ca);
        break;
    case KSEG_DECODE_CHECK:
        if (ca.nc)
            decode_check_kernel<<<1, MAP_THREADS, 0, s>>>(ca);
        break;
    default:
        return scape_set_error(SCAPE_INVALID, "kseg_run_cuda: unknown kernel %d", (int)k);
    }
    return launched(k);
}
