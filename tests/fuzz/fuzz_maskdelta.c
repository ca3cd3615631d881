/* fuzz_maskdelta.c - a mask delta a peer sends in the lagged all-gather with
 * mask_deltas on (daemon/maskcode.c, mdelta_decode).
 *
 * Input: a layout (1..8 tensors of 1..4096 coordinates), the densities of
 * the last mask and of the next (they differ under a density schedule), the
 * number of ranks, whose shard's delta it is, a seed for the last mask;
 * then the delta's bytes.
 *
 * Checked for every input, beyond "no crash":
 *   - a delta the decoder takes leaves exactly k bits in every tensor (the
 *     next mask's k), none past its end;
 *   - it encodes again, from the last mask and the decoded one, to the very
 *     same bytes (one change, one delta: the receiver took what the sender
 *     meant);
 *   - a refusal gives a reason.
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
    double rho_prev, rho_next;
    int ranks, shard;
    uint32_t seed;
} setup;

static const char *s_names[MAX_T] = { "t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7" };

/* The first 8 + 2 * nt bytes: the set-up, every value folded into range. */
static void read_setup(fuzz_in *in, setup *s)
{
    uint32_t b = fuzz_u8(in);
    s->nt = 1 + (b & 7);
    s->ranks = 1 + (int)((b >> 3) & 3);
    s->rho_prev = (fuzz_u8(in) + 1) / 256.0;
    s->rho_next = (fuzz_u8(in) + 1) / 256.0;
    s->shard = (int)fuzz_u8(in) % s->ranks;
    s->seed = fuzz_u16(in) | (uint32_t)fuzz_u16(in) << 16;
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
    out->data[out->len++] = (uint8_t)((s->nt - 1) | (unsigned)(s->ranks - 1) << 3);
    out->data[out->len++] = (uint8_t)(s->rho_prev * 256.0 - 1);
    out->data[out->len++] = (uint8_t)(s->rho_next * 256.0 - 1);
    out->data[out->len++] = (uint8_t)s->shard;
    for (int i = 0; i < 4; i++)
        out->data[out->len++] = (uint8_t)(s->seed >> (8 * i));
    for (size_t i = 0; i < s->nt; i++) {
        out->data[out->len++] = (uint8_t)((s->ts[i].length - 1) & 0xff);
        out->data[out->len++] = (uint8_t)((s->ts[i].length - 1) >> 8);
    }
}

/* A valid mask of the plan's current k_l over shard sh, drawn from seed. */
static void draw_mask(const plan *p, const plan_shard *sh, uint64_t seed, uint32_t *words)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    fuzz_draw_mask(p, sh, &x, words);
}

void fuzz_setup(void) {}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_in in = { data, size };
    setup s;
    read_setup(&in, &s);
    plan *p = NULL;
    if (plan_build(&p, s.ts, s.nt, s.ranks, s.rho_prev) != SCAPE_OK)
        return 0; /* plans are not what this target is about */
    const plan_shard *sh = &p->shard[s.shard];
    uint32_t *prev = calloc(sh->words + 1, 4), *words = calloc(sh->words + 1, 4);
    FUZZ_CHECK(prev && words, "out of memory");
    draw_mask(p, sh, s.seed, prev);
    plan_set_rho(p, s.rho_next); /* the delta brings the next mask's k_l */
    size_t have;
    const uint8_t *rest = fuzz_bytes(&in, in.left, &have);
    uint32_t *code = calloc(have / 4 + 1, 4);
    FUZZ_CHECK(code, "out of memory");
    memcpy(code, rest, have);
    scape_rc rc = mdelta_decode(p, sh->first, sh->count, prev, code, have, words, 1);
    if (rc == SCAPE_OK) {
        for (size_t j = sh->first; j < sh->first + sh->count; j++) {
            const plan_tensor *t = &p->t[p->order[j]];
            const uint32_t *tw = words + (t->word - sh->word0);
            size_t nw = (t->len + 31) / 32;
            FUZZ_CHECK(fuzz_popcount(tw, nw) == t->k, "tensor %s: %zu bits, k is %zu", t->name,
                       fuzz_popcount(tw, nw), t->k);
            FUZZ_CHECK(t->len % 32 == 0 || tw[nw - 1] >> (t->len % 32) == 0,
                       "tensor %s: bits past its end", t->name);
        }
        size_t want = mdelta_bytes(p, sh->first, sh->count, prev, words);
        FUZZ_CHECK(want == have, "took %zu bytes, the delta of those masks has %zu", have, want);
        uint32_t *again = calloc(want / 4 + 1, 4);
        FUZZ_CHECK(again, "out of memory");
        FUZZ_CHECK(mdelta_encode(p, sh->first, sh->count, prev, words, again) == SCAPE_OK,
                   "a decoded mask does not encode: %s", scape_last_error());
        FUZZ_CHECK(memcmp(again, code, want) == 0, "the delta is not canonical: decoding and "
                   "encoding again gives other bytes");
        free(again);
    } else {
        FUZZ_CHECK(scape_last_error()[0] != '\0', "refused without a reason");
    }
    free(code);
    free(prev);
    free(words);
    plan_destroy(&p);
    return 0;
}

/* ---- seeds: real deltas between two drawn masks ----------------------------- */

static void seed_one(fuzz_emit emit, void *ctx, const char *name, const setup *s)
{
    plan *p = NULL;
    if (plan_build(&p, s->ts, s->nt, s->ranks, s->rho_prev) != SCAPE_OK) {
        fprintf(stderr, "fuzz_maskdelta: seed %s: %s\n", name, scape_last_error());
        abort();
    }
    const plan_shard *sh = &p->shard[s->shard];
    uint32_t *prev = calloc(sh->words + 1, 4), *next = calloc(sh->words + 1, 4);
    fuzz_buf *out = calloc(1, sizeof *out);
    FUZZ_CHECK(prev && next && out, "out of memory");
    draw_mask(p, sh, s->seed, prev);
    plan_set_rho(p, s->rho_next);
    /* the next mask: the last one's first bits kept where k allows, the
     * rest drawn, so the delta is a real mix of left and joined */
    draw_mask(p, sh, s->seed + 1, next);
    size_t nbytes = mdelta_bytes(p, sh->first, sh->count, prev, next);
    uint32_t *code = calloc(nbytes / 4 + 1, 4);
    FUZZ_CHECK(code, "out of memory");
    FUZZ_CHECK(mdelta_encode(p, sh->first, sh->count, prev, next, code) == SCAPE_OK,
               "seed %s: %s", name, scape_last_error());
    write_setup(out, s);
    FUZZ_CHECK(out->len + nbytes <= sizeof out->data, "seed %s too large", name);
    memcpy(out->data + out->len, code, nbytes);
    out->len += nbytes;
    emit(ctx, name, out->data, out->len);
    free(prev);
    free(next);
    free(code);
    free(out);
    plan_destroy(&p);
}

void fuzz_seeds(fuzz_emit emit, void *ctx)
{
    static const struct {
        const char *name;
        size_t lens[MAX_T], nt;
        double rho_prev, rho_next;
        int ranks, shard;
        uint32_t seed;
    } cases[] = {
        { "one", { 1000 }, 1, 4 / 256.0, 4 / 256.0, 1, 0, 7 },
        { "schedule-step", { 2048, 300 }, 2, 16 / 256.0, 8 / 256.0, 1, 0, 11 },
        { "mixed", { 33, 4096, 7, 640 }, 4, 8 / 256.0, 8 / 256.0, 1, 0, 3 },
        { "ranks3-shard1", { 500, 300, 200, 64, 1, 31 }, 6, 16 / 256.0, 16 / 256.0, 3, 1, 5 },
        { "dense-to-sparse", { 96, 4000, 5 }, 3, 1.0, 2 / 256.0, 2, 1, 9 },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        setup s = { .nt = cases[c].nt, .rho_prev = cases[c].rho_prev,
                    .rho_next = cases[c].rho_next, .ranks = cases[c].ranks,
                    .shard = cases[c].shard, .seed = cases[c].seed };
        size_t off = 0;
        for (size_t i = 0; i < s.nt; i++) {
            s.ts[i] = (eng_tensor){ s_names[i], off, cases[c].lens[i], 0 };
            off += cases[c].lens[i];
        }
        seed_one(emit, ctx, cases[c].name, &s);
    }
}
