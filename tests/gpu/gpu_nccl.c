/* gpu_nccl.c - the `nccl` comm backend on one GPU: one rank (NCCL refuses
 * two ranks on one GPU, so this is what one machine can run).  Every
 * collective against its one-rank meaning (all-reduce and reduce-scatter
 * leave the values, the gathers and the broadcast copy them, the mask
 * all-gather lands only at its wait), then the engine for 60 steps of SCAPE
 * and dense AdamS, replicated and sharded, on the nccl backend and on the
 * local backend: with one rank both must give the same bits.  Prints
 * "SKIP: <reason>" and exits 77 without a usable GPU.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "comm_nccl.h"
#include "engine.h"

static int s_fail;

#define EXPECT(cond, ...)                                                      \
    do {                                                                       \
        if (!(cond)) {                                                         \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                        \
            printf(__VA_ARGS__);                                               \
            printf("\n");                                                      \
            s_fail++;                                                          \
        }                                                                      \
    } while (0)

static comm_t *open_nccl(void)
{
    comm_nccl_opts o = { .rank = 0, .size = 1, .device = 0, .timeout_ms = 60000 };
    comm_t *c = NULL;
    if (comm_nccl_make_ids(o.ids, sizeof o.ids) != SCAPE_OK ||
        comm_nccl_create(&o, &c) != SCAPE_OK) {
        printf("FAIL: nccl backend: %s\n", scape_last_error());
        exit(1);
    }
    return c;
}

static void check_collectives(void)
{
    comm_t *c = open_nccl();
    /* 20 MB: several rounds through the main lane's two 8 MiB streaming
     * slots, the last one partial. */
    enum { N = 5000011 };
    float *a = malloc(N * sizeof *a), *b = malloc(N * sizeof *b);
    for (size_t i = 0; i < N; i++)
        a[i] = b[i] = (float)i * 0.5f - 7.0f;
    EXPECT(comm_allreduce_sum(c, a, N) == SCAPE_OK, "allreduce: %s", scape_last_error());
    EXPECT(memcmp(a, b, N * sizeof *a) == 0, "allreduce of one rank changed values");
    size_t counts[1] = { N };
    float *r = malloc(N * sizeof *r);
    EXPECT(comm_reduce_scatter_sum(c, a, r, counts) == SCAPE_OK, "rs: %s", scape_last_error());
    EXPECT(memcmp(r, b, N * sizeof *r) == 0, "reduce-scatter of one rank changed values");
    EXPECT(comm_reduce_scatter_sum(c, a, a, counts) == SCAPE_OK, "rs in place");
    EXPECT(memcmp(a, b, N * sizeof *a) == 0, "in-place reduce-scatter changed values");
    size_t bytes[1] = { N * sizeof(float) };
    memset(r, 0, N * sizeof *r);
    EXPECT(comm_allgather(c, a, r, bytes) == SCAPE_OK, "allgather: %s", scape_last_error());
    EXPECT(memcmp(r, b, N * sizeof *r) == 0, "allgather did not copy");
    memset(r, 0, N * sizeof *r);
    EXPECT(comm_iallgather(c, a, r, bytes) == SCAPE_OK, "iallgather: %s", scape_last_error());
    EXPECT(comm_iallgather_wait(c) == SCAPE_OK, "iallgather_wait: %s", scape_last_error());
    EXPECT(memcmp(r, b, N * sizeof *r) == 0, "iallgather did not copy");
    EXPECT(comm_broadcast(c, a, bytes[0], 0) == SCAPE_OK, "broadcast");
    EXPECT(memcmp(a, b, N * sizeof *a) == 0, "broadcast changed values");
    EXPECT(comm_barrier(c) == SCAPE_OK, "barrier: %s", scape_last_error());
    size_t zero[1] = { 0 };
    EXPECT(comm_allgather(c, a, r, zero) == SCAPE_OK, "empty allgather");
    EXPECT(c->stats.calls[COMM_ALLREDUCE] >= 1 && c->stats.calls[COMM_IALLGATHER] == 1,
           "counters");
    /* Device memory: the two streaming slots and the mask lane's staging (the
     * iallgather above, N floats), nothing that grows with the main lane's
     * collectives. */
    uint64_t dev = comm_device_bytes(c);
    EXPECT(dev <= ((uint64_t)16 << 20) + (uint64_t)N * sizeof(float),
           "device bytes %llu beyond the slots and the mask staging", (unsigned long long)dev);
    printf("gpu_nccl: device memory held: %llu bytes\n", (unsigned long long)dev);
    comm_destroy(&c);
    free(a);
    free(b);
    free(r);
    printf("gpu_nccl: collectives of one rank: %s\n", s_fail ? "FAIL" : "ok");
}

/* wire_values: bf16 on device memory: the parts go to their owners in
 * bf16 and are summed in fp32 in rank order.  With one rank the sum is the
 * input itself, so bf16 numbers must come back unchanged (their conversion
 * there and back is exact) and the counters must say 2 bytes a value; the
 * exchange between ranks needs two GPUs. */
static void check_bf16_device(void)
{
    comm_t *c = open_nccl();
    enum { N = 1000003 };
    float *h = malloc(N * sizeof *h), *back = malloc(N * sizeof *back), *d = NULL;
    for (size_t i = 0; i < N; i++) {
        float v = (float)i * 0.37f - 1000.0f;
        uint32_t u;
        memcpy(&u, &v, sizeof u);
        u &= 0xffff0000u;
        memcpy(&h[i], &u, sizeof u);
    }
    EXPECT(cudaMalloc((void **)&d, N * sizeof *d) == cudaSuccess, "cudaMalloc");
    EXPECT(cudaMemcpy(d, h, N * sizeof *d, cudaMemcpyHostToDevice) == cudaSuccess, "copy in");
    /* from pageable memory the copy may land after cudaMemcpy returns; the
     * collectives run on the comm's own stream */
    EXPECT(cudaStreamSynchronize(0) == cudaSuccess, "copy in landed");
    size_t counts[1] = { N };
    uint64_t before = c->stats.bytes[COMM_REDUCE_SCATTER];
    EXPECT(comm_reduce_scatter_sum_wire(c, d, d, counts, 1) == SCAPE_OK, "bf16 rs: %s",
           scape_last_error());
    EXPECT(comm_allreduce_sum_wire(c, d, N, 1) == SCAPE_OK, "bf16 allreduce: %s",
           scape_last_error());
    EXPECT(comm_device_sync(c) == SCAPE_OK, "device sync: %s", scape_last_error());
    EXPECT(cudaMemcpy(back, d, N * sizeof *d, cudaMemcpyDeviceToHost) == cudaSuccess,
           "copy back");
    EXPECT(memcmp(back, h, N * sizeof *h) == 0, "bf16 sums of one rank changed values");
    EXPECT(c->stats.bytes[COMM_REDUCE_SCATTER] - before == 2ull * N,
           "bf16 reduce-scatter counted %llu bytes, want %llu",
           (unsigned long long)(c->stats.bytes[COMM_REDUCE_SCATTER] - before),
           2ull * N);
    cudaFree(d);
    comm_destroy(&c);
    free(h);
    free(back);
    printf("gpu_nccl: bf16 values on device memory: %s\n", s_fail ? "FAIL" : "ok");
}

static const eng_tensor s_tensors[] = { { "a", 0, 70000, 0 }, { "b", 70000, 33, 0 },
                                        { "c", 70033, 1, 0 }, { "d", 70034, 29966, 0 } };
#define NUMEL 100000

static void run_engine(comm_t *c, eng_optimizer opt, eng_mode mode, float *out)
{
    eng_config cfg;
    eng_config_default(&cfg);
    cfg.optimizer = opt;
    cfg.mode = mode;
    cfg.rho = 0.02;
    cfg.warmup = 3;
    eng_layout lay = { s_tensors, 4, KERN_F32, KERN_F32, NULL, 0 };
    float *p = malloc(NUMEL * sizeof *p), *g = malloc(NUMEL * sizeof *g);
    for (size_t i = 0; i < NUMEL; i++)
        p[i] = 0.01f * (float)(i % 97);
    eng_t *e = NULL;
    scape_rc rc = eng_create(&e, &cfg, &lay, c, 1);
    if (rc == SCAPE_OK)
        rc = eng_init_params(e, (void *const *)&p);
    for (uint64_t t = 1; rc == SCAPE_OK && t <= 60; t++) {
        for (size_t i = 0; i < NUMEL; i++)
            g[i] = sinf((float)(i * 7 + t * 13)) + 0.1f * p[i];
        const void *gs[1] = { g };
        rc = eng_step(e, t, 1e-2f, gs, (void *const *)&p);
    }
    EXPECT(rc == SCAPE_OK, "engine on %s: %s", c->ops->name, scape_last_error());
    memcpy(out, p, NUMEL * sizeof *p);
    eng_destroy(&e);
    free(p);
    free(g);
}

static void check_engine(void)
{
    float *want = malloc(NUMEL * sizeof *want), *got = malloc(NUMEL * sizeof *got);
    const eng_optimizer opts[] = { ENG_OPT_SCAPE, ENG_OPT_ADAMS };
    for (int o = 0; o < 2; o++)
        for (int m = 0; m < ENG_MODE_COUNT; m++) {
            comm_t *local[1];
            comm_local_create(1, local);
            run_engine(local[0], opts[o], (eng_mode)m, want);
            comm_destroy(&local[0]);
            comm_t *c = open_nccl();
            run_engine(c, opts[o], (eng_mode)m, got);
            comm_destroy(&c);
            int same = memcmp(want, got, NUMEL * sizeof *got) == 0;
            EXPECT(same, "%s/%s: nccl and local differ", eng_optimizer_name(opts[o]),
                   eng_mode_name((eng_mode)m));
            printf("gpu_nccl: engine %s/%s, 60 steps, nccl == local: %s\n",
                   eng_optimizer_name(opts[o]), eng_mode_name((eng_mode)m), same ? "ok" : "FAIL");
        }
    free(want);
    free(got);
}

int main(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    setvbuf(stdout, NULL, _IOLBF, 0); /* lines survive a kill by run.sh's timeout */
    if (e != cudaSuccess || n == 0) {
        printf("SKIP: no usable GPU (%s)\n", e != cudaSuccess ? cudaGetErrorString(e)
                                                            : "no device");
        return 77;
    }
    check_collectives();
    check_bf16_device();
    check_engine();
    printf("gpu_nccl: %s\n", s_fail ? "FAIL" : "PASS");
    return s_fail ? 1 : 0;
}
