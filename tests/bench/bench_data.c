/* bench_data.c - deterministic operands and the buffers of one benchmark case.
 * Values come from a stateless hash of (stream, index), so filling the
 * buffers is their first touch and a check can recompute every input. */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

/* splitmix64 finaliser over (stream, index); index < 2^40. */
static uint64_t hash(unsigned s, size_t i)
{
    uint64_t z = ((uint64_t)s << 40) ^ (uint64_t)i;
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float bench_f32(unsigned s, size_t i)
{
    /* 24 random bits: exact in fp32, and ties are common enough to exercise
     * the top-k ties rule. */
    int32_t q = (int32_t)(hash(s, i) >> 40) - (1 << 23);
    float x = (float)q * 0x1p-23f;
    return s == BR_V ? fabsf(x) : x;
}

uint16_t bench_bf16(unsigned s, size_t i)
{
    float x = bench_f32(s, i);
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)(u >> 16);
}

float bench_bf16_value(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

int bench_bit(unsigned s, size_t i, double rho)
{
    return (double)(hash(s, i) >> 11) * 0x1p-53 < rho;
}

uint32_t bench_mask_word(unsigned s, size_t n, size_t w, double rho)
{
    uint32_t word = 0;
    for (size_t b = 0; b < 32 && w * 32 + b < n; b++)
        word |= (uint32_t)bench_bit(s, w * 32 + b, rho) << b;
    return word;
}

void *bench_alloc(size_t bytes)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0)
        return NULL;
    return p;
}

static size_t role_bytes(const bench_case *c, bench_role r)
{
    switch (r) {
    case BR_HALF:
        return c->n * 2;
    case BR_PACKED:
    case BR_OUT:
        return c->k * 4;
    case BR_MASK:
        return c->nw * 4;
    default:
        return c->n * 4;
    }
}

/* Mask bits, then their set-bit count and touched-line counts. */
static void fill_mask(bench_case *c, bench_role r)
{
    uint32_t *m = c->p[r];
    for (size_t w = 0; w < c->nw; w++)
        m[w] = bench_mask_word(r, c->n, w, c->rho);
    for (size_t w = 0; w < c->nw; w++) {
        c->k += (size_t)__builtin_popcount(m[w]);
        c->lines4 += ((m[w] & 0xffffu) != 0) + ((m[w] >> 16) != 0);
        c->lines2 += m[w] != 0;
    }
}

static void fill_role(bench_case *c, bench_role r)
{
    if (r == BR_MASK) {
        fill_mask(c, r);
    } else if (r == BR_OUT) {
        memset(c->p[r], 0, role_bytes(c, r));
    } else if (r == BR_HALF) {
        uint16_t *h = c->p[r];
        for (size_t i = 0; i < c->n; i++)
            h[i] = bench_bf16(r, i);
    } else {
        float *x = c->p[r];
        size_t len = r == BR_PACKED ? c->k : c->n;
        for (size_t i = 0; i < len; i++)
            x[i] = bench_f32(r, i);
    }
}

static scape_rc add_role(bench_case *c, bench_role r)
{
    size_t bytes = role_bytes(c, r);
    c->p[r] = bench_alloc(bytes);
    if (c->p[r] == NULL) {
        bench_case_free(c);
        return scape_set_error(SCAPE_NOMEM, "bench: cannot allocate %zu bytes",
                               bytes);
    }
    fill_role(c, r);
    return SCAPE_OK;
}

scape_rc bench_case_init(bench_case *c, size_t n, double rho, unsigned roles)
{
    /* The masks first: their set-bit count k sizes the packed buffers. */
    static const bench_role order[BR_COUNT] = {
        BR_MASK, BR_G, BR_E, BR_M, BR_V, BR_THETA, BR_SUM,
        BR_DST, BR_HALF, BR_PACKED, BR_OUT,
    };
    memset(c, 0, sizeof *c);
    c->n = n;
    c->nw = kern_mask_words(n);
    c->rho = rho;
    for (int j = 0; j < BR_COUNT; j++) {
        if (!(roles & BR(order[j])))
            continue;
        scape_rc rc = add_role(c, order[j]);
        if (rc != SCAPE_OK)
            return rc;
    }
    return SCAPE_OK;
}

void bench_case_release(bench_case *c, bench_role r)
{
    free(c->p[r]);
    c->p[r] = NULL;
}

void bench_case_free(bench_case *c)
{
    for (int r = 0; r < BR_COUNT; r++)
        bench_case_release(c, (bench_role)r);
}
