/* gpu_args.c - bad arguments to the CUDA entry points: each kern_cuda_* call
 * must return SCAPE_INVALID with a message naming the function, before any
 * work is enqueued, and leave its output as it was; the empty segment
 * (n == 0) must be accepted.  The segmented kernels take plain tables that
 * the executor has checked; of their entry point only the kernel id is
 * checked (an unknown one is refused). */
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_check.h"
#include "scape_seg.h"

#define N 1024                           /* elements of each test buffer */
#define BIG ((size_t)UINT32_MAX + 1)     /* one past the segment limit */
#define BAD(call) expect_rc(t, (call), SCAPE_INVALID, "kern_cuda_", #call)
#define GOOD(call) expect_rc(t, (call), SCAPE_OK, "", #call)

static void expect_rc(gc_tally *t, scape_rc rc, scape_rc want, const char *prefix,
                      const char *what)
{
    const char *msg = scape_last_error();
    int named = want == SCAPE_OK || strncmp(msg, prefix, strlen(prefix)) == 0;
    gc_expect(t, rc == want && named, "args: %s returned %s (\"%s\"), expected %s", what,
              scape_rc_name(rc), msg, scape_rc_name(want));
    scape_clear_error();
}

static void bad_convert(gc_tally *t, float *a, float *b)
{
    uint16_t *h = (uint16_t *)b;
    BAD(kern_cuda_f32_to_bf16(NULL, h, N, NULL));
    BAD(kern_cuda_f32_to_bf16(a, NULL, N, NULL));
    BAD(kern_cuda_f32_to_bf16(a, h, BIG, NULL));
    BAD(kern_cuda_f32_to_bf16(a, (uint16_t *)(a + 10), N, NULL));
    GOOD(kern_cuda_f32_to_bf16(a, h, 0, NULL));
    GOOD(kern_cuda_f32_to_bf16(a, h, N, NULL));
}

static void bad_parts(gc_tally *t, float *a, float *b)
{
    const uint16_t *p = (const uint16_t *)a;
    BAD(kern_cuda_sum_bf16_parts(NULL, 2, N, b, NULL));
    BAD(kern_cuda_sum_bf16_parts(p, 2, N, NULL, NULL));
    BAD(kern_cuda_sum_bf16_parts(p, 0, N, b, NULL));
    BAD(kern_cuda_sum_bf16_parts(p, 2, BIG, b, NULL));
    BAD(kern_cuda_sum_bf16_parts(p, 2, N, a + N / 2, NULL)); /* out inside the parts */
    GOOD(kern_cuda_sum_bf16_parts(p, 2, 0, b, NULL));
    GOOD(kern_cuda_sum_bf16_parts(p, 2, N, b, NULL));
}

/* A rejected call leaves its output as it was. */
static void rejected_is_untouched(gc_tally *t, float *a, float *b)
{
    unsigned char h[N * 2];
    GC_CUDA(cudaMemset(b, 0xff, N * 2));
    BAD(kern_cuda_f32_to_bf16(a, (uint16_t *)b, BIG, NULL));
    BAD(kern_cuda_sum_bf16_parts((const uint16_t *)a, 0, N / 2, b, NULL));
    GC_CUDA(cudaDeviceSynchronize());
    GC_CUDA(cudaMemcpy(h, b, sizeof h, cudaMemcpyDeviceToHost));
    size_t changed = 0;
    for (size_t i = 0; i < sizeof h; i++)
        changed += h[i] != 0xff;
    gc_expect(t, changed == 0, "args: rejected calls changed %zu bytes of their output", changed);
}

static void bad_kernel_id(gc_tally *t)
{
    kseg_args a;
    memset(&a, 0, sizeof a);
    expect_rc(t, kseg_run_cuda(KSEG_NKERNELS, &a, NULL), SCAPE_INVALID, "kseg_run_cuda",
              "kseg_run_cuda(KSEG_NKERNELS)");
    expect_rc(t, kseg_run_cpu(KSEG_NKERNELS, &a), SCAPE_INVALID, "kseg_run_cpu",
              "kseg_run_cpu(KSEG_NKERNELS)");
}

void check_bad_args(gc_tally *t)
{
    gc_arena arena;
    memset(&arena, 0, sizeof arena);
    float *a = gc_dev(&arena, N * 4, 0), *b = gc_dev(&arena, N * 4, 0);
    GC_CUDA(cudaMemset(a, 0, N * 4));
    unsigned before = t->failures;
    bad_convert(t, a, b);
    bad_parts(t, a, b);
    rejected_is_untouched(t, a, b);
    bad_kernel_id(t);
    GC_CUDA(cudaDeviceSynchronize());
    gc_arena_free(&arena);
    printf("bad arguments: %s (%u checks so far)\n", t->failures == before ? "ok" : "FAILED",
           t->checks);
}
