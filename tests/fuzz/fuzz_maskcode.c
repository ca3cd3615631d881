/* fuzz_maskcode.c - the mask code a peer sends in the lagged all-gather
 * (daemon/maskcode.c).
 *
 * Input: a layout (1..8 tensors of 1..4096 coordinates), rho, the number of
 * ranks, whose shard's code it is, whether to merge, whether to fit the code
 * to the size the plan asks for; then the code bytes.
 *
 * Checked for every input, beyond "no crash":
 *   - a code the decoder takes leaves exactly k bits in every tensor, none
 *     past its end, and re-encodes to the very same bytes (the code is
 *     canonical: one mask, one code; the receiver accepted what the sender
 *     meant);
 *   - merging ORs exactly the decoded bits into what was there.
 */
#include <string.h>

#include "fuzz.h"
#include "fuzz_mask.h"
#include "maskcode.h"
#include "plan.h"

#define MAX_T 8
#define MAX_LEN 4096

typedef struct setup {
    eng_tensor ts[MAX_T];
    size_t nt;
    double rho;
    int ranks, shard, merge, fit;
} setup;

static const char *s_names[MAX_T] = { "t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7" };

/* The first 3 + 2 * nt bytes: the set-up.  Every value is folded into range. */
static void read_setup(fuzz_in *in, setup *s)
{
    uint32_t b = fuzz_u8(in);
    s->nt = 1 + (b & 7);
    s->ranks = 1 + (int)((b >> 3) & 3);
    s->merge = (b >> 5) & 1;
    s->fit = (b >> 6) & 1;
    s->rho = (fuzz_u8(in) + 1) / 256.0;
    s->shard = (int)fuzz_u8(in) % s->ranks;
    size_t off = 0;
    for (size_t i = 0; i < s->nt; i++) {
        s->ts[i].name = s_names[i];
        s->ts[i].offset = off;
        s->ts[i].length = 1 + fuzz_u16(in) % MAX_LEN;
        off += s->ts[i].length;
    }
}

static void write_setup(fuzz_buf *out, const setup *s)
{
    out->data[out->len++] = (uint8_t)((s->nt - 1) | (unsigned)(s->ranks - 1) << 3 |
                                      (unsigned)s->merge << 5 | (unsigned)s->fit << 6);
    out->data[out->len++] = (uint8_t)(s->rho * 256.0 - 1);
    out->data[out->len++] = (uint8_t)s->shard;
    for (size_t i = 0; i < s->nt; i++) {
        out->data[out->len++] = (uint8_t)((s->ts[i].length - 1) & 0xff);
        out->data[out->len++] = (uint8_t)((s->ts[i].length - 1) >> 8);
    }
}

void fuzz_setup(void) {}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_in in = { data, size };
    setup s;
    read_setup(&in, &s);
    plan *p = NULL;
    if (plan_build(&p, s.ts, s.nt, s.ranks, s.rho) != SCAPE_OK)
        return 0; /* plans are not what this target is about */
    const plan_shard *sh = &p->shard[s.shard];
    size_t want = mcode_bytes(p, sh->first, sh->count);
    size_t have;
    const uint8_t *rest = fuzz_bytes(&in, in.left, &have);
    size_t nbytes = s.fit ? want : have;
    uint32_t *code = calloc(nbytes / 4 + 1, 4);
    uint32_t *words = calloc(sh->words + 1, 4), *before = calloc(sh->words + 1, 4);
    uint32_t *fresh = calloc(sh->words + 1, 4), *again = calloc(want / 4 + 1, 4);
    FUZZ_CHECK(code && words && before && fresh && again, "out of memory");
    memcpy(code, rest, have < nbytes ? have : nbytes);
    /* What a merge ORs into: a pattern that depends on the input. */
    for (size_t i = 0; i < sh->words; i++)
        before[i] = s.merge ? (uint32_t)(i * 2654435761u) ^ (uint32_t)size : 0;
    memcpy(words, before, sh->words * 4);

    scape_rc rc = mcode_decode(p, sh->first, sh->count, code, nbytes, words, s.merge, 1);
    if (rc == SCAPE_OK) {
        FUZZ_CHECK(nbytes == want, "took %zu bytes, the plan says %zu", nbytes, want);
        /* The decoded bits alone, as a replace-decode gives them. */
        FUZZ_CHECK(mcode_decode(p, sh->first, sh->count, code, nbytes, fresh, 0, 1) == SCAPE_OK,
                   "a code taken by merge is refused by replace");
        for (size_t j = sh->first; j < sh->first + sh->count; j++) {
            const plan_tensor *t = &p->t[p->order[j]];
            const uint32_t *tw = fresh + (t->word - sh->word0);
            size_t nw = (t->len + 31) / 32;
            FUZZ_CHECK(fuzz_popcount(tw, nw) == t->k, "tensor %s: %zu bits, k is %zu", t->name,
                       fuzz_popcount(tw, nw), t->k);
            FUZZ_CHECK(t->len % 32 == 0 || tw[nw - 1] >> (t->len % 32) == 0,
                       "tensor %s: bits past its end", t->name);
        }
        for (size_t i = 0; i < sh->words; i++)
            FUZZ_CHECK(words[i] == (before[i] | fresh[i]), "word %zu: merged %08x, expected %08x",
                       i, words[i], before[i] | fresh[i]);
        FUZZ_CHECK(mcode_encode(p, sh->first, sh->count, fresh, again) == SCAPE_OK,
                   "a decoded mask does not encode: %s", scape_last_error());
        FUZZ_CHECK(memcmp(again, code, want) == 0, "the code is not canonical: decoding and "
                   "encoding again gives other bytes");
    } else {
        FUZZ_CHECK(scape_last_error()[0] != '\0', "refused without a reason");
    }
    free(code);
    free(words);
    free(before);
    free(fresh);
    free(again);
    plan_destroy(&p);
    return 0;
}

/* ---- seeds: real masks, encoded ------------------------------------------ */

static uint64_t s_rng = 88172645463325252ull;


static void seed_one(fuzz_emit emit, void *ctx, const char *name, const setup *s)
{
    plan *p = NULL;
    if (plan_build(&p, s->ts, s->nt, s->ranks, s->rho) != SCAPE_OK) {
        fprintf(stderr, "fuzz_maskcode: seed %s: %s\n", name, scape_last_error());
        abort();
    }
    const plan_shard *sh = &p->shard[s->shard];
    uint32_t *words = calloc(sh->words + 1, 4);
    size_t nbytes = mcode_bytes(p, sh->first, sh->count);
    uint32_t *code = calloc(nbytes / 4 + 1, 4);
    fuzz_buf *out = calloc(1, sizeof *out);
    FUZZ_CHECK(words && code && out, "out of memory");
    fuzz_draw_mask(p, sh, &s_rng, words);
    FUZZ_CHECK(mcode_encode(p, sh->first, sh->count, words, code) == SCAPE_OK, "seed %s: %s",
               name, scape_last_error());
    write_setup(out, s);
    memcpy(out->data + out->len, code, nbytes);
    out->len += nbytes;
    emit(ctx, name, out->data, out->len);
    free(words);
    free(code);
    free(out);
    plan_destroy(&p);
}

void fuzz_seeds(fuzz_emit emit, void *ctx)
{
    /* One tensor per coding, a mixed shard, several ranks, a merge. */
    static const struct {
        const char *name;
        size_t lens[MAX_T], nt;
        double rho;
        int ranks, shard, merge;
    } cases[] = {
        { "index-one", { 1000 }, 1, 4 / 256.0, 1, 0, 0 },
        { "bitmap-one", { 100 }, 1, 128 / 256.0, 1, 0, 0 },
        { "mixed", { 33, 4096, 7, 640 }, 4, 8 / 256.0, 1, 0, 0 },
        { "ranks3-shard1", { 500, 300, 200, 64, 1, 31 }, 6, 16 / 256.0, 3, 1, 0 },
        { "ranks4-merge", { 96, 4000, 2048, 5, 77, 1024, 333, 12 }, 8, 3 / 256.0, 4, 2, 1 },
        { "dense", { 32, 65 }, 2, 1.0, 2, 1, 0 },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        setup s = { .nt = cases[c].nt, .rho = cases[c].rho, .ranks = cases[c].ranks,
                    .shard = cases[c].shard, .merge = cases[c].merge, .fit = 0 };
        size_t off = 0;
        for (size_t i = 0; i < s.nt; i++) {
            s.ts[i] = (eng_tensor){ s_names[i], off, cases[c].lens[i], 0 };
            off += cases[c].lens[i];
        }
        seed_one(emit, ctx, cases[c].name, &s);
    }
}
