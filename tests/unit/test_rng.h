/* test_rng.h - the random inputs of the kernel suites (test_kernels,
 * test_seg): splitmix64 streams, one per test and loop index, so that any
 * one test replays alone from the printed seed. */
#ifndef SCAPE_TEST_RNG_H
#define SCAPE_TEST_RNG_H

#include <math.h>
#include <stdint.h>

static inline uint64_t rng_splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct rng { uint64_t s; } rng;

/* The stream of test `name`, loop index i, under the run's seed. */
static inline rng rng_for(uint64_t seed, const char *name, int i)
{
    uint64_t h = 1469598103934665603ull;
    for (; *name; name++)
        h = (h ^ (unsigned char)*name) * 1099511628211ull;
    rng r = { seed ^ h ^ ((uint64_t)(unsigned)i << 48) };
    return r;
}

static inline uint64_t rng_next(rng *r) { return rng_splitmix(&r->s); }

/* Signed values over 16 binades, with an occasional +0 or -0. */
static inline float rng_float(rng *r)
{
    uint64_t x = rng_next(r);
    if ((x & 63) == 0)
        return (x & 64) ? -0.0f : 0.0f;
    double mag = ldexp(1.0 + (double)(x >> 40) * 0x1p-24, (int)((x >> 8) & 15) - 10);
    return (float)((x & 128) ? -mag : mag);
}

#endif /* SCAPE_TEST_RNG_H */
