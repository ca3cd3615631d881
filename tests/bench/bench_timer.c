/* bench_timer.c - median wall time with cold caches, and the memcpy baseline.
 * Before every timed call the caches are flushed by reading a buffer twice
 * the size of the largest cache: the previous call's dirty lines are written
 * back during the flush, not during the next timed call. */
#define _POSIX_C_SOURCE 200809L

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "bench_host.h"

#define MIN_FLUSH_BYTES ((size_t)64 << 20)

static unsigned char *s_flush;
static size_t s_flush_bytes;
static volatile uint64_t s_sink; /* keeps the flush reads alive */

/* Largest cache of cpu0 in bytes, from sysfs; 0 if unknown. */
static size_t largest_cache(void)
{
    size_t best = 0;
    for (int i = 0; i < 8; i++) {
        char path[96], unit = 0;
        unsigned long v = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue;
        if (fscanf(f, "%lu%c", &v, &unit) >= 1) {
            size_t b = v * (unit == 'K' ? 1024u : unit == 'M' ? 1048576u : 1u);
            best = b > best ? b : best;
        }
        fclose(f);
    }
    return best;
}

scape_rc bench_timer_init(void)
{
    size_t want = 2 * largest_cache();
    s_flush_bytes = want > MIN_FLUSH_BYTES ? want : MIN_FLUSH_BYTES;
    s_flush = bench_alloc(s_flush_bytes);
    if (s_flush == NULL)
        return scape_set_error(SCAPE_NOMEM, "bench: cannot allocate the %zu-byte "
                               "flush buffer", s_flush_bytes);
    memset(s_flush, 1, s_flush_bytes); /* real pages, not the shared zero page */
    return SCAPE_OK;
}

void bench_timer_fini(void)
{
    free(s_flush);
    s_flush = NULL;
}

size_t bench_flush_bytes(void) { return s_flush_bytes; }

/* One read per 64-byte line evicts everything else from the caches. */
static void flush_caches(void)
{
    const uint64_t *p = (const uint64_t *)s_flush;
    uint64_t acc = 0;
    for (size_t i = 0; i < s_flush_bytes / 8; i += 8)
        acc += p[i];
    s_sink = acc;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* Time one call of fn(arg) with cold caches. */
static scape_rc time_one(bench_fn fn, void *arg, double *ms)
{
    flush_caches();
    double t0 = now_ms();
    scape_rc rc = fn(arg);
    *ms = now_ms() - t0;
    return rc;
}

scape_rc bench_time_ms(bench_fn fn, void *arg, int repeats, const char *label,
                       double *ms)
{
    double t[BENCH_MAX_REPEATS];
    for (int r = 0; r < repeats; r++) {
        scape_rc rc = time_one(fn, arg, &t[r]);
        if (rc != SCAPE_OK)
            return rc;
        if (label != NULL)
            fprintf(stderr, "bench_kernels: %s: repeat %d/%d took %.1f s\n",
                    label, r + 1, repeats, t[r] * 1e-3);
    }
    *ms = bench_median(t, repeats);
    return SCAPE_OK;
}

scape_rc bench_time_pair(bench_fn fa, void *a, bench_fn fb, void *b, int repeats,
                         double *ms_a, double *ms_b)
{
    double ta[BENCH_MAX_REPEATS], tb[BENCH_MAX_REPEATS];
    for (int r = 0; r < repeats; r++) {
        scape_rc rc = time_one(fa, a, &ta[r]);
        if (rc == SCAPE_OK)
            rc = time_one(fb, b, &tb[r]);
        if (rc != SCAPE_OK)
            return rc;
    }
    *ms_a = bench_median(ta, repeats);
    *ms_b = bench_median(tb, repeats);
    return SCAPE_OK;
}

scape_rc bench_copy_init(bench_copy *cp, size_t bytes)
{
    cp->len = bytes / 2;
    cp->dst = bench_alloc(cp->len);
    cp->src = bench_alloc(cp->len);
    if (cp->dst == NULL || cp->src == NULL) {
        bench_copy_free(cp);
        return scape_set_error(SCAPE_NOMEM, "bench: cannot allocate 2 x %zu bytes "
                               "for the memcpy baseline", bytes / 2);
    }
    memset(cp->dst, 0, cp->len);
    memset(cp->src, 1, cp->len);
    return SCAPE_OK;
}

void bench_copy_free(bench_copy *cp)
{
    free(cp->dst);
    free(cp->src);
    cp->dst = cp->src = NULL;
}

scape_rc bench_copy_run(void *p)
{
    bench_copy *cp = p;
    memcpy(cp->dst, cp->src, cp->len);
    return SCAPE_OK;
}
