/* synth.h - the synthetic training problem shared by the C trainer and the
 * in-process reference, so both produce the same gradients bit for bit.
 *
 * Model: N parameters pulled towards a fixed target, g = (p - target) * s_l +
 * noise(trainer, step), with a per-tensor scale s_l.  The gradient depends on
 * the parameters, so a wrong parameter exchange changes every later step. */
#ifndef SCAPE_TEST_SYNTH_H
#define SCAPE_TEST_SYNTH_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define SYNTH_MAX_TENSORS 16

static inline uint64_t synth_mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

/* Uniform in [0, 2), exactly representable in float. */
static inline float synth_unit(uint64_t h)
{
    return (float)(int32_t)(h >> 40) / 8388608.0f;
}

/* A layout of about n elements: tensors of varied lengths, including 1 and
 * lengths that are not multiples of 32.  Returns the tensor count. */
static inline size_t synth_layout(size_t n, size_t *off, size_t *len, char names[][16])
{
    static const double share[] = { 0.40, 0.25, 0.15, 0.10, 0.05, 0.03 };
    size_t nt = 0, pos = 0;
    for (size_t i = 0; i < sizeof share / sizeof share[0]; i++) {
        size_t l = (size_t)(share[i] * (double)n) | 1; /* odd: never a multiple of 32 */
        off[nt] = pos;
        len[nt] = l;
        snprintf(names[nt], 16, "w%zu", i);
        pos += l;
        nt++;
    }
    off[nt] = pos; /* a bias of length 1 */
    len[nt] = 1;
    snprintf(names[nt], 16, "bias");
    return nt + 1;
}

static inline float synth_init(uint64_t seed, int trainer, size_t i)
{
    return 0.5f * synth_unit(synth_mix(seed ^ ((uint64_t)trainer << 48) ^ (i + 1)));
}

static inline float synth_grad(uint64_t seed, int trainer, uint64_t step, size_t i, float p,
                               float scale)
{
    float target = synth_unit(synth_mix(seed * 31 + i));
    float noise = synth_unit(synth_mix(seed ^ (step << 24) ^ ((uint64_t)trainer << 56) ^ i));
    return (p - target) * scale + 0.3f * noise;
}

static inline float synth_scale(size_t tensor) { return 0.05f + 0.1f * (float)(tensor % 3); }

/* The loss whose gradient the trainers' gradients are on average: the mean
 * over coordinates of scale/2 (p - target)^2 + 0.3 p (the noise term of
 * synth_grad has mean 1), in double. */
static inline double synth_loss(uint64_t seed, const float *p, const size_t *off,
                                const size_t *len, size_t nt)
{
    double sum = 0.0;
    size_t n = 0;
    for (size_t l = 0; l < nt; l++)
        for (size_t i = off[l]; i < off[l] + len[l]; i++, n++) {
            double d = (double)p[i] - (double)synth_unit(synth_mix(seed * 31 + i));
            sum += 0.5 * (double)synth_scale(l) * d * d + 0.3 * (double)p[i];
        }
    return n ? sum / (double)n : 0.0;
}

/* FNV-1a over the parameters' bytes: equal hashes, equal parameters. */
static inline uint64_t synth_hash(const float *p, size_t n)
{
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n * sizeof *p; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

#endif /* SCAPE_TEST_SYNTH_H */
