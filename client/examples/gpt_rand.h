/* gpt_rand.h - the one random-number mixer of the GPT example (splitmix64):
 * weights, the corpus split, batches and the tests all draw from it, so a
 * seed means the same on every machine. */
#ifndef SCAPE_GPT_RAND_H
#define SCAPE_GPT_RAND_H

#include <stdint.h>

/* splitmix64's finaliser of z + golden ratio: a well-mixed function of z. */
static inline uint64_t gpt_mix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The next number of the stream whose state is *s (advances it). */
static inline uint64_t gpt_next64(uint64_t *s)
{
    uint64_t z = gpt_mix64(*s);
    *s += 0x9E3779B97F4A7C15ull;
    return z;
}

#endif /* SCAPE_GPT_RAND_H */
