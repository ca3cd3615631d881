/* gpu_step.c - the cuda executor's step on one GPU, per phase, against the
 * time to move the same bytes at bandwidths measured in the same run.
 *
 * For each N (--sizes, default 1e8 and 1e9): the GPT layout of
 * tests/bench/gpt_layout.h scaled to N, one trainer with its buffers in
 * device memory, the nccl backend with one rank (collectives in place), the
 * residual streamed from pinned memory.  SCAPE at rho 0.01 (warm-up 1, the
 * selection deferred and timed apart) and dense AdamS run --steps steps
 * each; for the last one every phase's device time (events) is printed next
 * to the engine's own count of the bytes it moved through device memory and
 * between host and device, and the time those bytes take at a
 * device-to-device copy's and a pinned copy's bandwidth, both measured here.
 * The target is the whole step within 1.5x of that.  Then the selection
 * alone over one tensor of 1e8 coordinates at k = 1% (compare
 * tests/gpu/torch_topk.py's torch.topk).
 *
 * Lines "BENCH step ..." are for tests/gpu/run.sh's summary; exit 0 whatever
 * the timings, 77 ("SKIP: ...") without a GPU or NCCL, 1 on a failure.
 *
 *   gpu_step [--sizes 1e8,1e9] [--steps 6]
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "comm_nccl.h"
#include "engine.h"
#include "gpt_layout.h"

static const char *const s_phase[ENG_PH_COUNT] = { "intake", "mask wait", "select", "pack",
                                                    "reduce", "update", "gather",
                                                    "writeback" };

static void die(const char *what)
{
    printf("FAIL: %s: %s\n", what, scape_last_error());
    exit(1);
}

static void cuda_or_die(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        printf("FAIL: %s: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
}

/* Bytes per second of a copy of `bytes` from src to dst, best of 5. */
static double copy_bw(void *dst, const void *src, size_t bytes)
{
    cudaEvent_t a, b;
    cuda_or_die(cudaEventCreate(&a), "cudaEventCreate");
    cuda_or_die(cudaEventCreate(&b), "cudaEventCreate");
    float best = 1e30f;
    for (int r = 0; r < 5; r++) {
        cuda_or_die(cudaEventRecord(a, 0), "cudaEventRecord");
        cuda_or_die(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, 0), "cudaMemcpyAsync");
        cuda_or_die(cudaEventRecord(b, 0), "cudaEventRecord");
        cuda_or_die(cudaEventSynchronize(b), "cudaEventSynchronize");
        float ms;
        cuda_or_die(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
        best = ms < best ? ms : best;
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return (double)bytes / (1e-3 * (double)best);
}

typedef struct bw {
    double d2d;       /* a device copy: read + write counted, as the byte model counts */
    double pinned;    /* host to device and back, each direction */
} bw;

static bw measure_bw(size_t bytes)
{
    void *d0, *d1, *h;
    cuda_or_die(cudaMalloc(&d0, bytes), "cudaMalloc");
    cuda_or_die(cudaMalloc(&d1, bytes), "cudaMalloc");
    cuda_or_die(cudaMallocHost(&h, bytes), "cudaMallocHost");
    memset(h, 1, bytes);
    bw b;
    b.d2d = 2.0 * copy_bw(d1, d0, bytes);
    double in = copy_bw(d0, h, bytes), out = copy_bw(h, d0, bytes);
    b.pinned = in < out ? in : out;
    cudaFree(d0);
    cudaFree(d1);
    cudaFreeHost(h);
    return b;
}

/* One optimizer's steps on the layout; the last step's figures. */
static eng_step_stats run(comm_t *c, const eng_tensor *ts, size_t nt, size_t n,
                          eng_optimizer opt, double rho, int steps)
{
    eng_config cfg;
    eng_config_default(&cfg);
    cfg.optimizer = opt;
    cfg.rho = rho;
    cfg.executor = ENG_EXEC_CUDA;
    cfg.defer_select = 1;
    eng_layout lay = { ts, nt, KERN_F32, KERN_F32, NULL, 0 };
    float *g, *p, *host = malloc(n * sizeof *host);
    if (host == NULL)
        die("out of memory");
    cuda_or_die(cudaMalloc((void **)&g, n * sizeof *g), "cudaMalloc grads");
    cuda_or_die(cudaMalloc((void **)&p, n * sizeof *p), "cudaMalloc params");
    for (size_t i = 0; i < n; i++)
        host[i] = (float)((i * 2654435761u) % 2001) * 1e-3f - 1.0f;
    cuda_or_die(cudaMemcpy(g, host, n * sizeof *g, cudaMemcpyHostToDevice), "grads in");
    cuda_or_die(cudaMemcpy(p, host, n * sizeof *p, cudaMemcpyHostToDevice), "params in");
    /* from pageable memory the copies may land after cudaMemcpy returns */
    cuda_or_die(cudaStreamSynchronize(0), "copies in landed");
    free(host);
    eng_t *e = NULL;
    if (eng_create(&e, &cfg, &lay, c, 1) != SCAPE_OK ||
        eng_init_params(e, (void *const *)&p) != SCAPE_OK)
        die("engine");
    const void *gs[1] = { g };
    eng_step_stats st;
    for (uint64_t t = 1; t <= (uint64_t)steps; t++)
        if (eng_step(e, t, 1e-4f, gs, (void *const *)&p) != SCAPE_OK ||
            eng_step_finish(e) != SCAPE_OK)
            die("step");
    eng_last_stats(e, &st);
    eng_destroy(&e);
    cudaFree(g);
    cudaFree(p);
    return st;
}

static void report(const char *what, size_t n, const eng_step_stats *st, const bw *b)
{
    double total = 0.0, ideal_total = 0.0;
    printf("%s, N = %zu, K = %zu, %llu kernels\n", what, n, st->k,
           (unsigned long long)st->launches);
    printf("  %-10s %9s %12s %12s %9s %7s\n", "phase", "ms", "device GB", "link GB",
           "ideal ms", "ratio");
    for (int ph = 0; ph < ENG_PH_COUNT; ph++) {
        double ms = 1e3 * st->phase_s[ph];
        double ideal = 1e3 * ((double)st->mem_bytes[ph] / b->d2d +
                              (double)st->link_bytes[ph] / (2.0 * b->pinned));
        if (ms == 0.0 && ideal == 0.0)
            continue;
        printf("  %-10s %9.3f %12.3f %12.3f %9.3f %6.2fx\n", s_phase[ph], ms,
               1e-9 * (double)st->mem_bytes[ph], 1e-9 * (double)st->link_bytes[ph], ideal,
               ideal > 0.0 ? ms / ideal : 0.0);
        total += ms;
        ideal_total += ideal;
    }
    printf("  %-10s %9.3f %12s %12s %9.3f %6.2fx  (target <= 1.5x)\n", "step", total, "", "",
           ideal_total, ideal_total > 0.0 ? total / ideal_total : 0.0);
    printf("BENCH step %s %zu %.4f %.4f %.3f\n", what, n, total, ideal_total,
           ideal_total > 0.0 ? total / ideal_total : 0.0);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    const char *sizes = "1e8,1e9";
    int steps = 6;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--sizes") && i + 1 < argc)
            sizes = argv[++i];
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc)
            steps = atoi(argv[++i]);
    }
    const char *why = NULL;
    if (!comm_nccl_built() || !kern_cuda_available(&why)) {
        printf("SKIP: gpu_step: %s\n", why ? why : "no nccl backend in this build");
        return 77;
    }
    comm_nccl_opts o = { .rank = 0, .size = 1, .device = 0, .timeout_ms = 120000 };
    comm_t *c = NULL;
    if (comm_nccl_make_ids(o.ids, sizeof o.ids) != SCAPE_OK ||
        comm_nccl_create(&o, &c) != SCAPE_OK)
        die("nccl backend");
    bw b = measure_bw((size_t)1 << 30);
    printf("gpu_step: device copy %.0f GB/s (read + write), pinned copy %.1f GB/s each way\n",
           1e-9 * b.d2d, 1e-9 * b.pinned);
    static eng_tensor ts[GPT_TENSORS];
    for (const char *s = sizes; *s;) {
        double want = strtod(s, (char **)&s);
        size_t n, nt = gpt_layout(want / (double)gpt_numel(), ts, &n);
        eng_step_stats sc = run(c, ts, nt, n, ENG_OPT_SCAPE, 0.01, steps);
        report("scape-0.01", n, &sc, &b);
        eng_step_stats dn = run(c, ts, nt, n, ENG_OPT_ADAMS, 1.0, steps);
        report("adams", n, &dn, &b);
        if (*s == ',')
            s++;
    }
    eng_tensor one = { "w", 0, 100000000, 0 };
    eng_step_stats tk = run(c, &one, 1, one.length, ENG_OPT_SCAPE, 0.01, 3);
    printf("BENCH topk_seg %zu %.4f\n", one.length, 1e3 * tk.phase_s[ENG_PH_SELECT]);
    printf("gpu_step: selection of k = 1%% of one tensor of %zu: %.3f ms\n", one.length,
           1e3 * tk.phase_s[ENG_PH_SELECT]);
    comm_destroy(&c);
    return 0;
}
