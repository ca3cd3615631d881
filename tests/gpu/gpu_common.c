/* gpu_common.c - see gpu_common.h. */
#include "gpu_common.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <cuda_runtime_api.h>

void gc_cuda_check(int err, const char *what, const char *file, int line)
{
    if (err == cudaSuccess)
        return;
    fprintf(stderr, "%s:%d: %s failed: %s\n", file, line, what,
            cudaGetErrorString((cudaError_t)err));
    exit(1);
}

uint64_t gc_seed_from_time(void)
{
    struct timespec ts;
    if (timespec_get(&ts, TIME_UTC) != TIME_UTC)
        return (uint64_t)time(NULL);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void gc_rng_init(gc_rng *r, uint64_t seed)
{
    /* splitmix64 of the seed: nearby seeds give unrelated streams */
    uint64_t z = seed + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    r->s = z ? z : 1;
}

uint64_t gc_next(gc_rng *r)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545f4914f6cdd1dull;
}

double gc_unit(gc_rng *r) { return (double)(gc_next(r) >> 11) * 0x1.0p-53; }

float gc_normal(gc_rng *r)
{
    double u = 1.0 - gc_unit(r), v = gc_unit(r);
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

int gc_gpu_ready(const char *prog)
{
    const char *why = NULL;
    if (kern_cuda_available(&why))
        return 1;
    printf("SKIP: %s: %s\n", prog, why ? why : "CUDA kernels unavailable");
    return 0;
}

static void out_of_memory(size_t bytes)
{
    fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
    exit(1);
}

void *gc_dev(gc_arena *a, size_t bytes, size_t offset)
{
    void *p = NULL;
    if (a->ndev == GC_ARENA_MAX) {
        fprintf(stderr, "gc_dev: arena full\n");
        exit(1);
    }
    GC_CUDA(cudaMalloc(&p, bytes + offset + 256));
    a->dev[a->ndev++] = p;
    return (char *)p + offset;
}

void *gc_host(gc_arena *a, size_t bytes)
{
    if (a->nhost == GC_ARENA_MAX) {
        fprintf(stderr, "gc_host: arena full\n");
        exit(1);
    }
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL)
        out_of_memory(bytes);
    a->host[a->nhost++] = p;
    return p;
}

void gc_arena_free(gc_arena *a)
{
    for (int i = 0; i < a->ndev; i++)
        GC_CUDA(cudaFree(a->dev[i]));
    for (int i = 0; i < a->nhost; i++)
        free(a->host[i]);
    a->ndev = a->nhost = 0;
}

int gc_expect(gc_tally *t, int ok, const char *fmt, ...)
{
    t->checks++;
    if (ok)
        return 1;
    t->failures++;
    va_list ap;
    va_start(ap, fmt);
    fputs("FAIL: ", stdout);
    vprintf(fmt, ap);
    fputc('\n', stdout);
    va_end(ap);
    return 0;
}
