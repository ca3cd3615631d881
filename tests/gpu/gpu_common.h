/* gpu_common.h - helpers shared by gpu_check and gpu_bench: random inputs,
 * device buffers that are freed together, the skip rule, a pass/fail tally.
 * These are test tools: a failing CUDA runtime call ends the process. */
#ifndef SCAPE_GPU_COMMON_H
#define SCAPE_GPU_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "scape_kernels.h"

#define GC_SKIP 77 /* exit status of a skipped run (ctest SKIP_RETURN_CODE) */

/* Exit with status 1 and the call's text when a CUDA runtime call fails. */
#define GC_CUDA(call) gc_cuda_check((int)(call), #call, __FILE__, __LINE__)
void gc_cuda_check(int err, const char *what, const char *file, int line);

/* xorshift64* generator; never seeded with 0. */
typedef struct gc_rng {
    uint64_t s;
} gc_rng;

/* A seed from the wall clock, different on every run. */
uint64_t gc_seed_from_time(void);
void gc_rng_init(gc_rng *r, uint64_t seed);
uint64_t gc_next(gc_rng *r);
/* Uniform in [0, 1). */
double gc_unit(gc_rng *r);
/* Standard normal (Box-Muller). */
float gc_normal(gc_rng *r);

/* 1 when the CUDA kernels can run here; otherwise print "SKIP: <reason>" and
 * return 0 (the caller then exits with GC_SKIP). */
int gc_gpu_ready(const char *prog);

/* Allocations freed together by gc_arena_free. */
#define GC_ARENA_MAX 64
typedef struct gc_arena {
    void *dev[GC_ARENA_MAX];
    void *host[GC_ARENA_MAX];
    int ndev, nhost;
} gc_arena;

/* Device buffer of `bytes` starting `offset` bytes past a fresh allocation;
 * never NULL, even for 0 bytes, so empty segments get a real pointer. */
void *gc_dev(gc_arena *a, size_t bytes, size_t offset);
/* Host buffer of `bytes` (at least 1). */
void *gc_host(gc_arena *a, size_t bytes);
void gc_arena_free(gc_arena *a);

/* Count of checks and failures; gc_expect prints a line for each failure. */
typedef struct gc_tally {
    unsigned checks, failures;
} gc_tally;

int gc_expect(gc_tally *t, int ok, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif /* SCAPE_GPU_COMMON_H */
