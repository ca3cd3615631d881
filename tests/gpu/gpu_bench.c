/* gpu_bench.c - throughput of the segmented CUDA kernels (kernels/cuda_seg.cu)
 * and the nccl backend's (kernels/cuda_comm.cu) against a device-to-device copy
 * measured in the same run.
 *
 * The segmented kernels run on a table of one tensor of n elements.  Each
 * figure is the median of --repeats timed calls (CUDA events on one stream);
 * before every timed call a 256 MiB memset evicts the L2, so inputs come from
 * HBM as they would in a training step.  Bytes are what the operation must
 * move: every array read or written once for the streaming ops; the mask
 * plus the touched elements for the masked ops (density 1%); one read of the
 * keys for top-k (k = 1%, all passes of the selection).  %copy compares GB/s
 * with the copy (read + write) of the same n.  Correctness is gpu_check's
 * job: run it first (tests/gpu/run.sh does).  Lines starting with BENCH are
 * for scripts.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_common.h"
#include "scape_seg.h"
#include "try.h"

#define FLUSH_BYTES ((size_t)256 << 20)
#define MAX_REPEATS 64
#define MAX_SIZES 8
#define DENSITY 0.01

typedef struct bench {
    float *g, *e, *m, *v, *th, *sum, *out;        /* max_n floats each */
    uint16_t *bf;                                 /* max_n bf16 (2 parts of max_n / 2) */
    uint32_t *mask, *keys, *sel;                  /* max_n bits, density 1%; keys; a mask */
    kseg_tensor *t;                               /* one tensor of n */
    uint32_t *tiles, *item0, *hist, *item_eq;
    kseg_item *items;
    kseg_tstate *st;
    kseg_status *status;
    uint32_t nitems;
    uint64_t k;                                   /* set bits of the mask's first n */
    void *flush;
    cudaStream_t s;
    cudaEvent_t t0, t1;
    int repeats;
} bench;

typedef scape_rc (*op_fn)(bench *b, size_t n);

typedef struct op_desc {
    const char *name;
    op_fn fn;
    double dense_bytes;  /* per element of the segment */
    double packed_bytes; /* per set mask bit */
} op_desc;

/* ---- the operations, each on the first n elements ---------------------- */

static scape_rc op_copy(bench *b, size_t n)
{
    cudaError_t err = cudaMemcpyAsync(b->out, b->g, n * 4, cudaMemcpyDeviceToDevice, b->s);
    if (err != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "cudaMemcpyAsync: %s", cudaGetErrorString(err));
    return SCAPE_OK;
}

/* The arguments of a word-range kernel over the one tensor's words. */
static kseg_args words(const bench *b, size_t n, int masked)
{
    kseg_args a;
    memset(&a, 0, sizeof a);
    a.t = b->t;
    a.nt = 1;
    a.w1 = kern_mask_words(n);
    a.mask = masked ? b->mask : NULL;
    a.tiles = b->tiles;
    a.k_cap = masked ? b->k : n;
    a.status = b->status;
    a.b1 = 0.9f;
    a.b2 = 0.95f;
    a.eps = 1e-8f;
    a.bc1 = scape_f_bias_correction(0.9f, 3);
    a.bc2 = scape_f_bias_correction(0.95f, 3);
    a.div = 2.0f;
    for (int g = 0; g < KSEG_GROUPS; g++)
        a.glr[g] = 1e-4f;
    return a;
}

static scape_rc op_scan(bench *b, size_t n)
{
    kseg_args a = words(b, n, 1);
    return kseg_run_cuda(KSEG_SCAN, &a, b->s);
}

static scape_rc op_pack_keys(bench *b, size_t n)
{
    kseg_args a = words(b, n, 1);
    a.tr[0] = b->g;
    a.ntr = 1;
    a.e = b->e;
    a.e_write = 1;
    a.out = b->out;
    a.m = b->m;
    a.keys = b->keys;
    a.key_hi = n;
    a.beta1 = 0.9f;
    a.c1 = 1.0f - 0.9f;
    a.t_r = 1.0f;
    return kseg_run_cuda(KSEG_PACK, &a, b->s);
}

static scape_rc op_pack_dense(bench *b, size_t n)
{
    kseg_args a = words(b, n, 0);
    a.tr[0] = b->g;
    a.ntr = 1;
    a.e = b->e;
    a.out = b->out;
    return kseg_run_cuda(KSEG_PACK, &a, b->s);
}

static scape_rc op_gsum_bf16(bench *b, size_t n)
{
    kseg_args a = words(b, n, 0);
    a.tr[0] = b->bf;
    a.ntr = 1;
    a.bf16 = 1;
    a.n = n;
    a.out = b->out;
    return kseg_run_cuda(KSEG_GSUM, &a, b->s);
}

static scape_rc update(bench *b, size_t n, int masked, int adamw)
{
    kseg_args a = words(b, n, masked);
    a.in = b->sum;
    a.theta = b->th;
    a.m = b->m;
    a.v = b->v;
    a.update = adamw ? SCAPE_UPD_ADAMW : SCAPE_UPD_ADAMS;
    return kseg_run_cuda(KSEG_UPDATE, &a, b->s);
}

static scape_rc op_adams_dense(bench *b, size_t n) { return update(b, n, 0, 0); }
static scape_rc op_adamw_dense(bench *b, size_t n) { return update(b, n, 0, 1); }
static scape_rc op_adams_masked(bench *b, size_t n) { return update(b, n, 1, 0); }
static scape_rc op_adamw_masked(bench *b, size_t n) { return update(b, n, 1, 1); }

static scape_rc op_compact(bench *b, size_t n)
{
    kseg_args a = words(b, n, 1);
    a.theta = b->th;
    a.out = b->out;
    return kseg_run_cuda(KSEG_COMPACT, &a, b->s);
}

static scape_rc op_writeback(bench *b, size_t n)
{
    kseg_args a = words(b, n, 1);
    a.in = b->sum;
    a.tr[0] = b->out;
    a.ntr = 1;
    return kseg_run_cuda(KSEG_WRITEBACK, &a, b->s);
}

static scape_rc op_to_bf16(bench *b, size_t n)
{
    return kern_cuda_f32_to_bf16(b->g, b->bf, n, b->s);
}

static scape_rc op_sum_parts(bench *b, size_t n)
{
    return kern_cuda_sum_bf16_parts(b->bf, 2, n / 2, b->out, b->s);
}

/* The device executor's selection passes, k = 1% of n. */
static scape_rc op_topk(bench *b, size_t n)
{
    kseg_topk_args a = { .t = b->t, .first = 0, .nsel = 1, .items = b->items,
                         .nitems = b->nitems, .item0 = b->item0, .keys = b->keys,
                         .key_lo = 0, .hist = b->hist, .st = b->st, .item_eq = b->item_eq,
                         .mask = b->sel };
    (void)n;
    for (a.level = 0; a.level < 3; a.level++) {
        cudaError_t err = cudaMemsetAsync(b->hist, 0, KSEG_BINS0 * 4, b->s);
        if (err != cudaSuccess)
            return scape_set_error(SCAPE_CUDA, "cudaMemsetAsync: %s", cudaGetErrorString(err));
        TRY(kseg_run_cuda(KSEG_TOPK_HIST, &a, b->s));
        TRY(kseg_run_cuda(KSEG_TOPK_PICK, &a, b->s));
    }
    TRY(kseg_run_cuda(KSEG_TOPK_COUNT, &a, b->s));
    TRY(kseg_run_cuda(KSEG_TOPK_SCAN, &a, b->s));
    return kseg_run_cuda(KSEG_TOPK_WRITE, &a, b->s);
}

static const op_desc s_ops[] = {
    {"copy_d2d", op_copy, 8, 0},
    {"mask_scan", op_scan, 1.0 / 8, 0},
    {"pack_keys", op_pack_keys, 20 + 1.0 / 8, 4},
    {"pack_dense", op_pack_dense, 12, 0},
    {"gsum_bf16", op_gsum_bf16, 6, 0},
    {"adams_dense", op_adams_dense, 20, 0},
    {"adamw_dense", op_adamw_dense, 28, 0},
    {"adams_masked", op_adams_masked, 1.0 / 8, 20},
    {"adamw_masked", op_adamw_masked, 1.0 / 8, 28},
    {"compact", op_compact, 1.0 / 8, 8},
    {"writeback", op_writeback, 1.0 / 8, 8},
    {"f32_to_bf16", op_to_bf16, 6, 0},
    {"sum_bf16_parts", op_sum_parts, 4, 0},
    {"topk_1pct", op_topk, 4, 0},
};

/* ---- set-up ------------------------------------------------------------ */

static void must(scape_rc rc, const char *name)
{
    if (rc == SCAPE_OK)
        return;
    fprintf(stderr, "gpu_bench: %s: %s: %s\n", name, scape_rc_name(rc), scape_last_error());
    exit(1);
}

static void upload(void *d, const void *h, size_t bytes)
{
    GC_CUDA(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
}

/* Normal data for the float arrays (|x| where a value must be >= 0), keys of
 * |x|, a 1% random mask, bf16 copies of the gradient. */
static void fill(bench *b, size_t max_n, gc_rng *r, gc_arena *host)
{
    float *x = gc_host(host, max_n * 4);
    for (size_t i = 0; i < max_n; i++)
        x[i] = gc_normal(r);
    float *dst[] = {b->g, b->e, b->m, b->th, b->sum, b->out};
    for (size_t i = 0; i < sizeof dst / sizeof dst[0]; i++)
        upload(dst[i], x, max_n * 4);
    uint32_t *keys = gc_host(host, max_n * 4);
    for (size_t i = 0; i < max_n; i++) {
        x[i] = fabsf(x[i]);
        keys[i] = scape_f_key(x[i]);
    }
    upload(b->v, x, max_n * 4);
    upload(b->keys, keys, max_n * 4);
    size_t nw = kern_mask_words(max_n);
    uint32_t *mk = gc_host(host, nw * 4);
    for (size_t w = 0; w < nw; w++) {
        mk[w] = 0;
        for (unsigned bit = 0; bit < 32; bit++)
            if (gc_unit(r) < DENSITY)
                mk[w] |= 1u << bit;
    }
    upload(b->mask, mk, nw * 4);
    must(kern_cuda_f32_to_bf16(b->g, b->bf, max_n, NULL), "f32_to_bf16");
}

static void setup(bench *b, size_t max_n, gc_arena *dev)
{
    float **f[] = {&b->g, &b->e, &b->m, &b->v, &b->th, &b->sum, &b->out};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        *f[i] = gc_dev(dev, max_n * 4, 0);
    size_t nw = kern_mask_words(max_n), ni = kseg_tiles(nw) + 1;
    b->bf = gc_dev(dev, max_n * 2, 0);
    b->mask = gc_dev(dev, nw * 4, 0);
    b->sel = gc_dev(dev, nw * 4, 0);
    b->keys = gc_dev(dev, max_n * 4, 0);
    b->t = gc_dev(dev, sizeof *b->t, 0);
    b->tiles = gc_dev(dev, ni * 4, 0);
    b->items = gc_dev(dev, ni * sizeof *b->items, 0);
    b->item0 = gc_dev(dev, 2 * 4, 0);
    b->item_eq = gc_dev(dev, ni * 4, 0);
    b->hist = gc_dev(dev, KSEG_BINS0 * 4, 0);
    b->st = gc_dev(dev, sizeof *b->st, 0);
    b->status = gc_dev(dev, sizeof *b->status, 0);
    b->flush = gc_dev(dev, FLUSH_BYTES, 0);
    GC_CUDA(cudaMemset(b->status, 0, sizeof *b->status));
    GC_CUDA(cudaStreamCreate(&b->s));
    GC_CUDA(cudaEventCreate(&b->t0));
    GC_CUDA(cudaEventCreate(&b->t1));
}

/* The table of one tensor of n, its top-k items, and the mask's scan. */
static void prepare(bench *b, size_t n, gc_arena *host)
{
    uint64_t nw = kern_mask_words(n);
    kseg_tensor t = { .pos = 0, .off = 0, .word = 0, .len = (uint32_t)n,
                      .k = (uint32_t)(n / 100 ? n / 100 : 1) };
    upload(b->t, &t, sizeof t);
    b->nitems = (uint32_t)kseg_tiles(nw);
    kseg_item *it = gc_host(host, b->nitems * sizeof *it);
    for (uint32_t i = 0; i < b->nitems; i++)
        it[i] = (kseg_item){ (uint64_t)i * KSEG_TILE,
                             (uint32_t)(nw - (uint64_t)i * KSEG_TILE < KSEG_TILE
                                            ? nw - (uint64_t)i * KSEG_TILE : KSEG_TILE), 0 };
    uint32_t item0[2] = { 0, b->nitems };
    upload(b->items, it, b->nitems * sizeof *it);
    upload(b->item0, item0, sizeof item0);
    must(op_scan(b, n), "mask_scan");
    GC_CUDA(cudaStreamSynchronize(b->s));
    uint32_t *mk = gc_host(host, nw * 4);
    GC_CUDA(cudaMemcpy(mk, b->mask, nw * 4, cudaMemcpyDeviceToHost));
    b->k = 0;
    for (uint64_t w = 0; w < nw; w++)
        b->k += (uint64_t)__builtin_popcount(w + 1 < nw || !(n & 31)
                                                 ? mk[w] : mk[w] & ((1u << (n & 31)) - 1u));
}

/* ---- timing ------------------------------------------------------------ */

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Median milliseconds of op over b->repeats calls, L2 flushed before each. */
static double time_op(bench *b, const op_desc *op, size_t n)
{
    float ms[MAX_REPEATS];
    must(op->fn(b, n), op->name);
    for (int r = 0; r < b->repeats; r++) {
        GC_CUDA(cudaMemsetAsync(b->flush, r & 0xff, FLUSH_BYTES, b->s));
        GC_CUDA(cudaEventRecord(b->t0, b->s));
        must(op->fn(b, n), op->name);
        GC_CUDA(cudaEventRecord(b->t1, b->s));
        GC_CUDA(cudaEventSynchronize(b->t1));
        GC_CUDA(cudaEventElapsedTime(&ms[r], b->t0, b->t1));
    }
    qsort(ms, (size_t)b->repeats, sizeof ms[0], cmp_float);
    return ms[b->repeats / 2];
}

static void run_size(bench *b, size_t n, gc_arena *host)
{
    prepare(b, n, host);
    double k = (double)b->k, copy_gbs = 0;
    for (size_t i = 0; i < sizeof s_ops / sizeof s_ops[0]; i++) {
        const op_desc *op = &s_ops[i];
        double ms = time_op(b, op, n);
        double bytes = op->dense_bytes * (double)n + op->packed_bytes * k;
        double gbs = bytes / (ms * 1e-3) / 1e9;
        if (i == 0)
            copy_gbs = gbs;
        printf("BENCH %-16s %10zu %10.4f %9.1f %7.1f\n", op->name, n, ms, gbs,
               100.0 * gbs / copy_gbs);
        fflush(stdout);
    }
}

/* ---- driver ---------------------------------------------------------------- */

static int parse_sizes(const char *s, size_t *sizes)
{
    int count = 0;
    while (*s && count < MAX_SIZES) {
        char *end;
        double v = strtod(s, &end);
        if (end == s || v < 1)
            return 0;
        sizes[count++] = (size_t)v;
        s = *end == ',' ? end + 1 : end;
    }
    return *s ? 0 : count;
}

static int parse_args(int argc, char **argv, size_t *sizes, int *nsizes, int *repeats)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--sizes") == 0 && i + 1 < argc)
            *nsizes = parse_sizes(argv[++i], sizes);
        else if (strcmp(argv[i], "--repeats") == 0 && i + 1 < argc)
            *repeats = atoi(argv[++i]);
        else
            *nsizes = 0;
    }
    if (*nsizes > 0 && *repeats >= 1 && *repeats <= MAX_REPEATS)
        return 1;
    fprintf(stderr, "usage: %s [--sizes 1e6,1e7,1e8] [--repeats 1..%d]\n", argv[0],
            MAX_REPEATS);
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* lines survive a kill by run.sh's timeout */
    size_t sizes[MAX_SIZES] = {1000000, 10000000, 100000000}, max_n = 0;
    int nsizes = 3, repeats = 9;
    if (!parse_args(argc, argv, sizes, &nsizes, &repeats))
        return 2;
    if (!gc_gpu_ready("gpu_bench"))
        return GC_SKIP;
    for (int i = 0; i < nsizes; i++)
        max_n = sizes[i] > max_n ? sizes[i] : max_n;
    struct cudaDeviceProp prop;
    GC_CUDA(cudaGetDeviceProperties(&prop, 0));
    printf("gpu_bench: %s, median of %d, L2 flushed (256 MiB) before each call\n", prop.name,
           repeats);
    printf("      %-16s %10s %10s %9s %7s\n", "op", "n", "ms", "GB/s", "%copy");
    bench b;
    gc_arena dev, host;
    gc_rng r;
    memset(&b, 0, sizeof b);
    memset(&dev, 0, sizeof dev);
    memset(&host, 0, sizeof host);
    gc_rng_init(&r, gc_seed_from_time());
    b.repeats = repeats;
    setup(&b, max_n, &dev);
    fill(&b, max_n, &r, &host);
    gc_arena_free(&host);
    for (int i = 0; i < nsizes; i++) {
        run_size(&b, sizes[i], &host);
        gc_arena_free(&host);
    }
    GC_CUDA(cudaStreamDestroy(b.s));
    GC_CUDA(cudaEventDestroy(b.t0));
    GC_CUDA(cudaEventDestroy(b.t1));
    gc_arena_free(&dev);
    return 0;
}
