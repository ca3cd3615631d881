/* fuzz.h - what every target in tests/fuzz shares.
 *
 * A target is a libFuzzer entry point, LLVMFuzzerTestOneInput, over one
 * decoder of untrusted bytes, plus two functions of its own:
 *   fuzz_setup()  once per process, before any input (may be empty);
 *   fuzz_seeds()  the target's starting inputs, made from the real encoders
 *                 (protobuf-c, the mask coder, cfg_print), so they follow the
 *                 code instead of going stale as committed blobs would.
 * The same target links either with libFuzzer (-DSCAPE_FUZZ=ON, clang) or
 * with driver.c, a replay-and-mutate main that ctest runs in every build.
 *
 * A target checks more than "no crash": FUZZ_CHECK states what must hold of
 * every input (an answer to every status request, a decode that re-encodes to
 * the same bytes, ...).  A broken check prints why and aborts, which both
 * libFuzzer and the driver report with the input that did it. */
#ifndef SCAPE_FUZZ_H
#define SCAPE_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef void (*fuzz_emit)(void *ctx, const char *name, const void *buf, size_t len);

void fuzz_setup(void);
void fuzz_seeds(fuzz_emit emit, void *ctx);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_CHECK(cond, ...)                                                              \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fputc('\n', stderr);                                                           \
            abort();                                                                       \
        }                                                                                  \
    } while (0)

/* Reading a structured input front to back: every take is bounded by what is
 * left, and an exhausted reader yields zeros, so any bytes are a valid input. */
typedef struct fuzz_in {
    const uint8_t *p;
    size_t left;
} fuzz_in;

static inline uint32_t fuzz_u8(fuzz_in *in)
{
    if (in->left == 0)
        return 0;
    in->left--;
    return *in->p++;
}

static inline uint32_t fuzz_u16(fuzz_in *in)
{
    uint32_t lo = fuzz_u8(in);
    return lo | fuzz_u8(in) << 8;
}

/* Up to want bytes; *got says how many. */
static inline const uint8_t *fuzz_bytes(fuzz_in *in, size_t want, size_t *got)
{
    const uint8_t *p = in->p;
    *got = want < in->left ? want : in->left;
    in->p += *got;
    in->left -= *got;
    return p;
}

/* Framing the seeds use: a record is a selector byte, a 16-bit little-endian
 * length and that many bytes (fuzz_record reads one; fuzz_put writes one). */
/* Set bits in nw words (mask checks of the mask-code targets). */
static inline size_t fuzz_popcount(const uint32_t *w, size_t nw)
{
    size_t n = 0;
    for (size_t i = 0; i < nw; i++)
        n += (size_t)__builtin_popcount(w[i]);
    return n;
}

typedef struct fuzz_buf {
    uint8_t data[65536];
    size_t len;
} fuzz_buf;

static inline void fuzz_put(fuzz_buf *b, uint8_t sel, const void *p, size_t n)
{
    if (b->len + 3 + n > sizeof b->data) {
        fprintf(stderr, "fuzz_put: seed too long\n");
        abort();
    }
    b->data[b->len++] = sel;
    b->data[b->len++] = (uint8_t)(n & 0xff);
    b->data[b->len++] = (uint8_t)(n >> 8);
    for (size_t i = 0; i < n; i++)
        b->data[b->len++] = ((const uint8_t *)p)[i];
}

static inline int fuzz_record(fuzz_in *in, uint32_t *sel, const uint8_t **p, size_t *n)
{
    if (in->left == 0)
        return 0;
    *sel = fuzz_u8(in);
    *p = fuzz_bytes(in, fuzz_u16(in), n);
    return 1;
}

#endif /* SCAPE_FUZZ_H */
