/* gpu_bench.c - throughput of the CUDA twins against a device-to-device copy
 * measured in the same run.
 *
 * Each figure is the median of --repeats timed calls (CUDA events on one
 * stream); before every timed call a 256 MiB memset evicts the L2, so inputs
 * come from HBM as they would in a training step.  Bytes are what the
 * operation must move: every array read or written once for the streaming
 * ops; the mask plus the touched elements for the masked ops (density 1%);
 * one read of the statistic for top-k (k = 1%).  %copy compares GB/s with the
 * copy (read + write) of the same n.  Correctness is gpu_check's job: run it
 * first (tests/gpu/run.sh does).  Lines starting with BENCH are for scripts.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_common.h"

#define FLUSH_BYTES ((size_t)256 << 20)
#define MAX_REPEATS 64
#define MAX_SIZES 8
#define DENSITY 0.01

typedef struct bench {
    float *g, *e, *m, *v, *th, *sum, *stat, *out; /* max_n floats each */
    uint16_t *bf;                                 /* max_n bf16 */
    uint32_t *mask, *mask2;                       /* max_n bits, density 1% */
    void *scratch, *flush;
    size_t scratch_bytes;
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

static const kern_hyper s_hyper = {0.9f, 0.95f, 1e-8f, 0.0f, 0.0f};

/* ---- the operations, each on the first n elements ---------------------- */

static scape_rc op_copy(bench *b, size_t n)
{
    cudaError_t err = cudaMemcpyAsync(b->out, b->g, n * 4, cudaMemcpyDeviceToDevice, b->s);
    if (err != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "cudaMemcpyAsync: %s", cudaGetErrorString(err));
    return SCAPE_OK;
}

static scape_rc op_mask_stat(bench *b, size_t n)
{
    return kern_cuda_mask_stat(b->m, b->g, b->e, n, 0.9f, 2.0f, b->out, b->s);
}

static scape_rc op_abs_stat(bench *b, size_t n)
{
    return kern_cuda_abs_stat(b->g, b->e, n, b->out, b->s);
}

static scape_rc op_adams_dense(bench *b, size_t n)
{
    return kern_cuda_adams_dense(b->th, b->m, b->sum, 2.0f, n, &s_hyper, 1e-4f, b->s);
}

static scape_rc op_adamw_dense(bench *b, size_t n)
{
    return kern_cuda_adamw_dense(b->th, b->m, b->v, b->sum, 2.0f, n, &s_hyper, 1e-4f, 3,
                                 b->s);
}

static scape_rc op_accum_f32(bench *b, size_t n)
{
    return kern_cuda_grad_accum(b->out, b->g, KERN_F32, n, 0, b->s);
}

static scape_rc op_accum_bf16(bench *b, size_t n)
{
    return kern_cuda_grad_accum(b->out, b->bf, KERN_BF16, n, 0, b->s);
}

static scape_rc op_to_bf16(bench *b, size_t n)
{
    return kern_cuda_f32_to_bf16(b->g, b->bf, n, b->s);
}

static scape_rc op_from_bf16(bench *b, size_t n)
{
    return kern_cuda_bf16_to_f32(b->bf, b->out, n, b->s);
}

static scape_rc op_mask_or(bench *b, size_t n)
{
    return kern_cuda_mask_or(b->mask2, b->mask, kern_mask_words(n), b->s);
}

static scape_rc op_pack_ef(bench *b, size_t n)
{
    return kern_cuda_pack_ef(b->g, b->e, b->mask, n, b->out, b->scratch, b->scratch_bytes,
                             b->s);
}

static scape_rc op_popcount(bench *b, size_t n)
{
    size_t k;
    return kern_cuda_mask_popcount(b->mask, n, &k, b->scratch, b->scratch_bytes, b->s);
}

static scape_rc op_prefix(bench *b, size_t n)
{
    return kern_cuda_mask_prefix(b->mask, kern_mask_words(n), (uint32_t *)b->out,
                                 b->scratch, b->scratch_bytes, b->s);
}

static scape_rc op_compact(bench *b, size_t n)
{
    return kern_cuda_mask_compact(b->g, b->mask, n, b->out, b->scratch, b->scratch_bytes,
                                  b->s);
}

static scape_rc op_expand(bench *b, size_t n)
{
    return kern_cuda_mask_expand(b->sum, b->mask, n, b->out, KERN_F32, b->scratch,
                                 b->scratch_bytes, b->s);
}

static scape_rc op_adams_masked(bench *b, size_t n)
{
    return kern_cuda_adams_masked(b->th, b->m, b->sum, 2.0f, b->mask, n, &s_hyper, 1e-4f,
                                  b->scratch, b->scratch_bytes, b->s);
}

static scape_rc op_adamw_masked(bench *b, size_t n)
{
    return kern_cuda_adamw_masked(b->th, b->m, b->v, b->sum, 2.0f, b->mask, n, &s_hyper,
                                  1e-4f, 3, b->scratch, b->scratch_bytes, b->s);
}

static scape_rc op_topk(bench *b, size_t n)
{
    size_t k = n / 100 ? n / 100 : 1;
    return kern_cuda_topk_mask(b->stat, n, k, b->mask2, b->scratch, b->scratch_bytes, b->s);
}

static const op_desc s_ops[] = {
    {"copy_d2d", op_copy, 8, 0},
    {"mask_stat", op_mask_stat, 16, 0},
    {"abs_stat", op_abs_stat, 12, 0},
    {"adams_dense", op_adams_dense, 20, 0},
    {"adamw_dense", op_adamw_dense, 28, 0},
    {"grad_accum_f32", op_accum_f32, 12, 0},
    {"grad_accum_bf16", op_accum_bf16, 10, 0},
    {"f32_to_bf16", op_to_bf16, 6, 0},
    {"bf16_to_f32", op_from_bf16, 6, 0},
    {"mask_or", op_mask_or, 12.0 / 32, 0},
    {"pack_ef", op_pack_ef, 12 + 1.0 / 8, 4},
    {"mask_popcount", op_popcount, 1.0 / 8, 0},
    {"mask_prefix", op_prefix, 2.0 / 8, 0},
    {"mask_compact", op_compact, 1.0 / 8, 8},
    {"mask_expand_f32", op_expand, 1.0 / 8, 8},
    {"adams_masked", op_adams_masked, 1.0 / 8, 20},
    {"adamw_masked", op_adamw_masked, 1.0 / 8, 28},
    {"topk_mask_1pct", op_topk, 4, 0},
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

/* Normal data for the float arrays (|x| where a value must be >= 0), a 1%
 * random mask, bf16 copies of the gradient. */
static void fill(bench *b, size_t max_n, gc_rng *r, gc_arena *host)
{
    float *x = gc_host(host, max_n * 4);
    for (size_t i = 0; i < max_n; i++)
        x[i] = gc_normal(r);
    float *dst[] = {b->g, b->e, b->m, b->th, b->sum, b->out};
    for (size_t i = 0; i < sizeof dst / sizeof dst[0]; i++)
        upload(dst[i], x, max_n * 4);
    for (size_t i = 0; i < max_n; i++)
        x[i] = x[i] < 0 ? -x[i] : x[i];
    upload(b->v, x, max_n * 4);
    upload(b->stat, x, max_n * 4);
    size_t nw = kern_mask_words(max_n);
    uint32_t *mk = gc_host(host, nw * 4);
    for (size_t w = 0; w < nw; w++) {
        mk[w] = 0;
        for (unsigned bit = 0; bit < 32; bit++)
            if (gc_unit(r) < DENSITY)
                mk[w] |= 1u << bit;
    }
    upload(b->mask, mk, nw * 4);
    upload(b->mask2, mk, nw * 4);
    must(kern_cuda_f32_to_bf16(b->g, b->bf, max_n, NULL), "f32_to_bf16");
}

static void setup(bench *b, size_t max_n, gc_arena *dev)
{
    float **f[] = {&b->g, &b->e, &b->m, &b->v, &b->th, &b->sum, &b->stat, &b->out};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        *f[i] = gc_dev(dev, max_n * 4, 0);
    b->bf = gc_dev(dev, max_n * 2, 0);
    b->mask = gc_dev(dev, kern_mask_words(max_n) * 4, 0);
    b->mask2 = gc_dev(dev, kern_mask_words(max_n) * 4, 0);
    b->scratch_bytes = kern_cuda_scratch_bytes(max_n);
    b->scratch = gc_dev(dev, b->scratch_bytes, 0);
    b->flush = gc_dev(dev, FLUSH_BYTES, 0);
    GC_CUDA(cudaStreamCreate(&b->s));
    GC_CUDA(cudaEventCreate(&b->t0));
    GC_CUDA(cudaEventCreate(&b->t1));
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

static void run_size(bench *b, size_t n)
{
    size_t k = 0;
    must(kern_cuda_mask_popcount(b->mask, n, &k, b->scratch, b->scratch_bytes, b->s),
         "mask_popcount");
    double copy_gbs = 0;
    for (size_t i = 0; i < sizeof s_ops / sizeof s_ops[0]; i++) {
        const op_desc *op = &s_ops[i];
        double ms = time_op(b, op, n);
        double bytes = op->dense_bytes * (double)n + op->packed_bytes * (double)k;
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
    for (int i = 0; i < nsizes; i++)
        run_size(&b, sizes[i]);
    GC_CUDA(cudaStreamDestroy(b.s));
    GC_CUDA(cudaEventDestroy(b.t0));
    GC_CUDA(cudaEventDestroy(b.t1));
    gc_arena_free(&dev);
    return 0;
}
