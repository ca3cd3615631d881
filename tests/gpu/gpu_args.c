/* gpu_args.c - bad arguments to the CUDA twins: each call must return
 * SCAPE_INVALID with a message naming the kern_cuda_ function, before any
 * work is enqueued; the empty segment (n == 0) must be accepted. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_check.h"

#define N 1024                           /* elements of each test buffer */
#define BIG ((size_t)UINT32_MAX + 1)     /* one past the segment limit */
#define BAD(call) expect_rc(t, (call), SCAPE_INVALID, #call)
#define GOOD(call) expect_rc(t, (call), SCAPE_OK, #call)

typedef struct bufs {
    float *a, *b, *c, *d; /* N floats each, on the device */
    uint32_t *mk;         /* N bits */
    void *sc;             /* scratch for N */
    size_t sb;
} bufs;

static void expect_rc(gc_tally *t, scape_rc rc, scape_rc want, const char *what)
{
    const char *msg = scape_last_error();
    int named = want == SCAPE_OK || strncmp(msg, "kern_cuda_", 10) == 0;
    gc_expect(t, rc == want && named, "args: %s returned %s (\"%s\"), expected %s", what,
              scape_rc_name(rc), msg, scape_rc_name(want));
    scape_clear_error();
}

static void bad_pack(gc_tally *t, const bufs *B)
{
    float *a = B->a, *b = B->b, *o = B->c;
    const uint32_t *mk = B->mk;
    void *sc = B->sc;
    size_t sb = B->sb;
    BAD(kern_cuda_pack_ef(NULL, b, mk, N, o, sc, sb, NULL));
    BAD(kern_cuda_pack_ef(a, NULL, mk, N, o, sc, sb, NULL));
    BAD(kern_cuda_pack_ef(a, b, NULL, N, o, sc, sb, NULL));
    BAD(kern_cuda_pack_ef(a, b, mk, N, NULL, sc, sb, NULL));
    BAD(kern_cuda_pack_ef(a, b, mk, N, o, NULL, sb, NULL));
    BAD(kern_cuda_pack_ef(a, b, mk, BIG, o, sc, sb, NULL));
    BAD(kern_cuda_pack_ef(a, a + 1, mk, N, o, sc, sb, NULL));
    BAD(kern_cuda_pack_ef(a, b, mk, N, b + 5, sc, sb, NULL));
    BAD(kern_cuda_pack_ef(a, b, mk, N, o, sc, 0, NULL));
    BAD(kern_cuda_pack_ef(a, b, mk, N, o, a, sb, NULL));
    BAD(kern_cuda_mask_compact(NULL, mk, N, o, sc, sb, NULL));
    BAD(kern_cuda_mask_compact(a, mk, N, a + 3, sc, sb, NULL));
    BAD(kern_cuda_mask_compact(a, mk, N, o, sc, 3, NULL));
    BAD(kern_cuda_mask_compact(a, mk, N, o, (char *)sc + 2, sb - 2, NULL));
    BAD(kern_cuda_mask_expand(a, mk, N, b, (kern_dtype)7, sc, sb, NULL));
    BAD(kern_cuda_mask_expand(a, mk, N, NULL, KERN_F32, sc, sb, NULL));
    BAD(kern_cuda_mask_expand(b + 2, mk, N, b, KERN_BF16, sc, sb, NULL));
    GOOD(kern_cuda_pack_ef(a, b, mk, 0, o, sc, 0, NULL));
    GOOD(kern_cuda_mask_compact(a, mk, 0, o, sc, 0, NULL));
    GOOD(kern_cuda_mask_expand(a, mk, 0, b, KERN_BF16, sc, 0, NULL));
}

static void bad_mask(gc_tally *t, const bufs *B)
{
    uint32_t *mk = B->mk, *pre = (uint32_t *)B->c;
    void *sc = B->sc;
    size_t sb = B->sb, cnt = 7;
    BAD(kern_cuda_mask_popcount(NULL, N, &cnt, sc, sb, NULL));
    BAD(kern_cuda_mask_popcount(mk, N, NULL, sc, sb, NULL));
    BAD(kern_cuda_mask_popcount(mk, BIG, &cnt, sc, sb, NULL));
    BAD(kern_cuda_mask_popcount(mk, N, &cnt, sc, 0, NULL));
    BAD(kern_cuda_mask_prefix(mk, N / 32, NULL, sc, sb, NULL));
    BAD(kern_cuda_mask_prefix(mk, BIG / 32, pre, sc, sb, NULL));
    BAD(kern_cuda_mask_prefix(mk, N / 32, mk + 1, sc, sb, NULL));
    BAD(kern_cuda_mask_prefix(mk, N / 32, pre, NULL, sb, NULL));
    BAD(kern_cuda_mask_or(mk, NULL, N / 32, NULL));
    BAD(kern_cuda_mask_or(mk, mk + 1, N / 32, NULL));
    GOOD(kern_cuda_mask_popcount(mk, 0, &cnt, sc, 0, NULL));
    gc_expect(t, cnt == 0, "args: popcount of an empty mask gave %zu", cnt);
    GOOD(kern_cuda_mask_prefix(mk, 0, pre, sc, 0, NULL));
    GOOD(kern_cuda_mask_or(mk, pre, 0, NULL));
}

static void bad_select(gc_tally *t, const bufs *B)
{
    float *a = B->a, *b = B->b, *d = B->d, *o = B->c;
    uint32_t *mk = B->mk;
    void *sc = B->sc;
    size_t sb = B->sb;
    BAD(kern_cuda_mask_stat(NULL, a, b, N, 0.9f, 1.0f, o, NULL));
    BAD(kern_cuda_mask_stat(a, b, d, N, 1.0f, 1.0f, o, NULL));
    BAD(kern_cuda_mask_stat(a, b, d, N, NAN, 1.0f, o, NULL));
    BAD(kern_cuda_mask_stat(a, b, d, N, 0.9f, 0.5f, o, NULL));
    BAD(kern_cuda_mask_stat(a, b, d, N, 0.9f, 1.0f, a, NULL));
    BAD(kern_cuda_abs_stat(a, b, N, NULL, NULL));
    BAD(kern_cuda_abs_stat(a, b, N, b + 1, NULL));
    BAD(kern_cuda_topk_mask(NULL, N, 1, mk, sc, sb, NULL));
    BAD(kern_cuda_topk_mask(a, N, 1, NULL, sc, sb, NULL));
    BAD(kern_cuda_topk_mask(a, N, 1, mk, NULL, sb, NULL));
    BAD(kern_cuda_topk_mask(a, N, N + 1, mk, sc, sb, NULL));
    BAD(kern_cuda_topk_mask(a, BIG, 1, mk, sc, sb, NULL));
    BAD(kern_cuda_topk_mask(a, N, 1, mk, sc, 16, NULL)); /* below any top-k's need */
    BAD(kern_cuda_topk_mask(a, N, 1, (uint32_t *)(a + 8), sc, sb, NULL));
    BAD(kern_cuda_topk_mask(a, N, 1, mk, a + 4, sb, NULL));
    /* the composed twins check everything before enqueueing anything */
    BAD(kern_cuda_topk_ef(a, b, d, N, 1.0f, 1.0f, 1, mk, sc, sb, NULL));
    BAD(kern_cuda_topk_ef(a, b, d, 0, 0.9f, 0.5f, 0, mk, sc, sb, NULL));
    BAD(kern_cuda_topk_ef(a, b, d, N, 0.9f, 1.0f, 1, (uint32_t *)(b + 4), sc, sb, NULL));
    BAD(kern_cuda_topk_ef(NULL, b, d, N, 0.9f, 1.0f, 1, mk, b, sb, NULL));
    BAD(kern_cuda_topk_packed(a, d, mk, b, N, NAN, 1.0f, 1, (uint32_t *)o, sc, sb, NULL));
    BAD(kern_cuda_topk_packed(a, d, mk, b, 0, 0.9f, 0.0f, 0, (uint32_t *)o, sc, sb, NULL));
    BAD(kern_cuda_topk_packed(a, d, mk, NULL, N, 0.9f, 1.0f, 1, (uint32_t *)o, sc, sb, NULL));
    BAD(kern_cuda_topk_packed(a, d, mk, b, N, 0.9f, 1.0f, 1, mk, sc, sb, NULL));
    BAD(kern_cuda_topk_packed(NULL, d, NULL, NULL, N, 0.9f, 1.0f, 1, (uint32_t *)o, d, sb,
                              NULL));
    GOOD(kern_cuda_abs_stat(a, b, 0, o, NULL));
    GOOD(kern_cuda_topk_mask(a, 0, 0, mk, sc, 0, NULL));
    GOOD(kern_cuda_topk_ef(NULL, b, d, 0, 2.0f, 0.0f, 0, mk, sc, sb, NULL)); /* no m: no beta1 */
}

static void bad_hyper(gc_tally *t, const bufs *B, const kern_hyper *h0)
{
    float *th = B->a, *m = B->b, *s = B->d;
    kern_hyper h = *h0;
    h.beta1 = 1.0f;
    BAD(kern_cuda_adams_dense(th, m, s, 1.0f, N, &h, 1e-3f, NULL));
    h = *h0;
    h.beta2 = NAN;
    BAD(kern_cuda_adams_dense(th, m, s, 1.0f, N, &h, 1e-3f, NULL));
    h = *h0;
    h.eps = 0.0f;
    BAD(kern_cuda_adams_dense(th, m, s, 1.0f, N, &h, 1e-3f, NULL));
    h = *h0;
    h.wd = -1.0f;
    BAD(kern_cuda_adams_dense(th, m, s, 1.0f, N, &h, 1e-3f, NULL));
    h.wd = INFINITY;
    BAD(kern_cuda_adams_dense(th, m, s, 1.0f, N, &h, 1e-3f, NULL));
}

static void bad_adam(gc_tally *t, const bufs *B)
{
    const kern_hyper h = {0.9f, 0.95f, 1e-8f, 0.0f, 0.0f};
    float *th = B->a, *m = B->b, *v = B->c, *s = B->d;
    const uint32_t *mk = B->mk;
    void *sc = B->sc;
    size_t sb = B->sb;
    BAD(kern_cuda_adams_masked(th, m, s, 1.0f, NULL, N, &h, 1e-3f, sc, sb, NULL));
    BAD(kern_cuda_adams_masked(th, m, s, 1.0f, mk, N, NULL, 1e-3f, sc, sb, NULL));
    BAD(kern_cuda_adams_masked(th, m, s, 0.0f, mk, N, &h, 1e-3f, sc, sb, NULL));
    BAD(kern_cuda_adams_masked(th, m, s, 1.0f, mk, N, &h, -1.0f, sc, sb, NULL));
    BAD(kern_cuda_adams_masked(th, m, s, 1.0f, mk, N, &h, NAN, sc, sb, NULL));
    BAD(kern_cuda_adams_masked(th, th + 1, s, 1.0f, mk, N, &h, 1e-3f, sc, sb, NULL));
    BAD(kern_cuda_adams_masked(th, m, th + 7, 1.0f, mk, N, &h, 1e-3f, sc, sb, NULL));
    BAD(kern_cuda_adams_masked(th, m, s, 1.0f, mk, N, &h, 1e-3f, sc, 0, NULL));
    BAD(kern_cuda_adams_dense(NULL, m, s, 1.0f, N, &h, 1e-3f, NULL));
    BAD(kern_cuda_adams_dense(th, m, NULL, 1.0f, N, &h, 1e-3f, NULL));
    BAD(kern_cuda_adams_dense(th, m, s, INFINITY, N, &h, 1e-3f, NULL));
    BAD(kern_cuda_adams_dense(th, m, s, 1.0f, BIG, &h, 1e-3f, NULL));
    BAD(kern_cuda_adamw_dense(th, m, NULL, s, 1.0f, N, &h, 1e-3f, 1, NULL));
    BAD(kern_cuda_adamw_dense(th, m, v, s, 1.0f, N, &h, 1e-3f, 0, NULL));
    BAD(kern_cuda_adamw_dense(th, m, m + 3, s, 1.0f, N, &h, 1e-3f, 1, NULL));
    BAD(kern_cuda_adamw_masked(th, m, v, s, 1.0f, mk, N, &h, 1e-3f, 0, sc, sb, NULL));
    BAD(kern_cuda_adamw_masked(th, m, NULL, s, 1.0f, mk, N, &h, 1e-3f, 1, sc, sb, NULL));
    BAD(kern_cuda_adamw_masked(th, m, v, s, 1.0f, (const uint32_t *)(v + 2), N, &h, 1e-3f,
                               1, sc, sb, NULL));
    bad_hyper(t, B, &h);
    GOOD(kern_cuda_adams_masked(th, m, s, 1.0f, mk, 0, &h, 1e-3f, sc, 0, NULL));
    GOOD(kern_cuda_adamw_dense(th, m, v, s, 1.0f, 0, &h, 1e-3f, 1, NULL));
}

static void bad_convert(gc_tally *t, const bufs *B)
{
    float *a = B->a, *b = B->b;
    BAD(kern_cuda_grad_accum(NULL, b, KERN_F32, N, 0, NULL));
    BAD(kern_cuda_grad_accum(a, NULL, KERN_F32, N, 0, NULL));
    BAD(kern_cuda_grad_accum(a, b, (kern_dtype)9, N, 0, NULL));
    BAD(kern_cuda_grad_accum(a, a + 100, KERN_BF16, N, 1, NULL));
    BAD(kern_cuda_grad_accum(a, b, KERN_F32, BIG, 1, NULL));
    BAD(kern_cuda_f32_to_bf16(NULL, (uint16_t *)b, N, NULL));
    BAD(kern_cuda_f32_to_bf16(a, (uint16_t *)(a + 10), N, NULL));
    BAD(kern_cuda_bf16_to_f32((const uint16_t *)a, NULL, N, NULL));
    BAD(kern_cuda_bf16_to_f32((const uint16_t *)a, a + 10, N, NULL));
    GOOD(kern_cuda_grad_accum(a, b, KERN_BF16, 0, 0, NULL));
    GOOD(kern_cuda_f32_to_bf16(a, (uint16_t *)b, 0, NULL));
}

/* A rejected call leaves its output as it was. */
static void rejected_is_untouched(gc_tally *t, const bufs *B)
{
    unsigned char h[N * 4];
    GC_CUDA(cudaMemset(B->d, 0xff, N * 4));
    BAD(kern_cuda_mask_stat(B->a, B->b, B->c, N, 2.0f, 1.0f, B->d, NULL));
    GC_CUDA(cudaDeviceSynchronize());
    GC_CUDA(cudaMemcpy(h, B->d, sizeof h, cudaMemcpyDeviceToHost));
    size_t changed = 0;
    for (size_t i = 0; i < sizeof h; i++)
        changed += h[i] != 0xff;
    gc_expect(t, changed == 0, "args: a rejected mask_stat changed %zu bytes of stat",
              changed);
}

void check_bad_args(gc_tally *t)
{
    gc_arena arena;
    memset(&arena, 0, sizeof arena);
    bufs B;
    B.a = gc_dev(&arena, N * 4, 0);
    B.b = gc_dev(&arena, N * 4, 0);
    B.c = gc_dev(&arena, N * 4, 0);
    B.d = gc_dev(&arena, N * 4, 0);
    B.mk = gc_dev(&arena, N / 8, 0);
    B.sb = kern_cuda_scratch_bytes(N);
    B.sc = gc_dev(&arena, B.sb, 0);
    GC_CUDA(cudaMemset(B.mk, 0x5a, N / 8));
    unsigned before = t->failures;
    bad_pack(t, &B);
    bad_mask(t, &B);
    bad_select(t, &B);
    bad_adam(t, &B);
    bad_convert(t, &B);
    rejected_is_untouched(t, &B);
    GC_CUDA(cudaDeviceSynchronize());
    gc_arena_free(&arena);
    printf("bad arguments: %s (%u checks so far)\n", t->failures == before ? "ok" : "FAILED",
           t->checks);
}
