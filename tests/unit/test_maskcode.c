/* test_maskcode.c - the wire form of mask bits: sizes worked by hand, round
 * trips of random exact-k masks over awkward lengths, the union mode, and
 * every malformed code a peer could send refused with a reason. */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "maskcode.h"
#include "check_run.h"

/* a random mask with exactly k bits per tensor, comm-space words */
static void random_mask(const plan *p, uint32_t *words, unsigned *seed)
{
    memset(words, 0, p->nwords * sizeof *words);
    for (size_t i = 0; i < p->ntensors; i++) {
        const plan_tensor *t = &p->t[i];
        for (size_t got = 0; got < t->k;) {
            size_t pos = (size_t)rand_r(seed) % t->len;
            uint32_t *w = &words[t->word + pos / 32], bit = 1u << (pos % 32);
            if (!(*w & bit)) {
                *w |= bit;
                got++;
            }
        }
    }
}

static plan *build(const size_t *lens, size_t nt, int ranks, double rho)
{
    eng_tensor ts[16];
    static char names[16][24];
    size_t off = 0;
    for (size_t i = 0; i < nt; i++) {
        snprintf(names[i], sizeof names[i], "t%zu", i);
        ts[i] = (eng_tensor){ names[i], off, lens[i], 0 };
        off += lens[i];
    }
    plan *p = NULL;
    ck_assert_int_eq(plan_build(&p, ts, nt, ranks, rho), SCAPE_OK);
    return p;
}

START_TEST(sizes_by_hand)
{
    /* 16384 coordinates at rho 0.01: k = 164 positions of 14 bits = 2296
     * bits = 72 words, against 512 bitmap words.  64 at rho 0.01: k = 1
     * position of 6 bits, against 2 words.  1: one bit of position (1 bit)
     * against 1 word.  At rho 0.1, 16384 -> k = 1639 x 14 = 22946 bits >
     * 16384: the bitmap. */
    size_t lens[] = { 16384, 64, 1 };
    plan *p = build(lens, 3, 1, 0.01);
    ck_assert_int_eq(mcode_by_index(&p->t[0]), 1);
    ck_assert_int_eq(mcode_by_index(&p->t[1]), 1);
    ck_assert_int_eq(mcode_by_index(&p->t[2]), 1);
    ck_assert_uint_eq(mcode_bytes(p, 0, 3), 4 * ((2296 + 6 + 1 + 31) / 32));
    plan_destroy(&p);
    p = build(lens, 3, 1, 0.1);
    ck_assert_int_eq(mcode_by_index(&p->t[0]), 0);
    /* 64 at rho 0.1: k = 7 x 6 = 42 bits < 64: positions */
    ck_assert_int_eq(mcode_by_index(&p->t[1]), 1);
    ck_assert_uint_eq(mcode_bytes(p, 0, 3), 4 * (512 + (42 + 1 + 31) / 32));
    plan_destroy(&p);
}
END_TEST

START_TEST(round_trips)
{
    size_t lens[] = { 1, 2, 31, 32, 33, 100, 1000, 4097, 16384, 70000, 5 };
    size_t nt = sizeof lens / sizeof lens[0];
    double rhos[] = { 0.001, 0.01, 0.05, 0.1, 0.5, 1.0 };
    unsigned seed = 7;
    for (size_t ri = 0; ri < sizeof rhos / sizeof rhos[0]; ri++)
        for (int ranks = 1; ranks <= 4; ranks++) {
            plan *p = build(lens, nt, ranks, rhos[ri]);
            uint32_t *mask = calloc(p->nwords, 4), *back = calloc(p->nwords, 4);
            uint32_t *code = calloc(p->nwords + 8, 4);
            random_mask(p, mask, &seed);
            for (int r = 0; r < ranks; r++) {
                const plan_shard *sh = &p->shard[r];
                size_t nb = mcode_bytes(p, sh->first, sh->count);
                ck_assert_uint_eq(nb % 4, 0);
                ck_assert_uint_le(nb, 4 * sh->words); /* never more than the bitmap */
                ck_assert_int_eq(mcode_encode(p, sh->first, sh->count, mask + sh->word0, code),
                                 SCAPE_OK);
                memset(back + sh->word0, 0xa5, sh->words * 4); /* replaced, not merged */
                ck_assert_int_eq(mcode_decode(p, sh->first, sh->count, code, nb,
                                              back + sh->word0, 0, r), SCAPE_OK);
            }
            ck_assert_mem_eq(mask, back, p->nwords * 4);
            free(mask);
            free(back);
            free(code);
            plan_destroy(&p);
        }
}
END_TEST

START_TEST(union_of_ranks)
{
    size_t lens[] = { 5000, 300, 64 };
    plan *p = build(lens, 3, 1, 0.01);
    size_t nb = mcode_bytes(p, 0, 3);
    uint32_t *a = calloc(p->nwords, 4), *b = calloc(p->nwords, 4), *u = calloc(p->nwords, 4);
    uint32_t *ca = calloc(nb / 4, 4), *cb = calloc(nb / 4, 4);
    unsigned seed = 11;
    random_mask(p, a, &seed);
    random_mask(p, b, &seed);
    ck_assert_int_eq(mcode_encode(p, 0, 3, a, ca), SCAPE_OK);
    ck_assert_int_eq(mcode_encode(p, 0, 3, b, cb), SCAPE_OK);
    ck_assert_int_eq(mcode_decode(p, 0, 3, ca, nb, u, 1, 0), SCAPE_OK);
    ck_assert_int_eq(mcode_decode(p, 0, 3, cb, nb, u, 1, 1), SCAPE_OK);
    for (size_t w = 0; w < p->nwords; w++)
        ck_assert_uint_eq(u[w], a[w] | b[w]);
    free(a);
    free(b);
    free(u);
    free(ca);
    free(cb);
    plan_destroy(&p);
}
END_TEST

static void refused(const plan *p, const uint32_t *code, size_t nb, const char *what)
{
    uint32_t *out = calloc(p->nwords, 4);
    ck_assert_int_eq(mcode_decode(p, 0, p->ntensors, code, nb, out, 0, 3), SCAPE_PROTO);
    ck_assert_msg(strstr(scape_last_error(), what) && strstr(scape_last_error(), "rank 3"),
                  "want '%s', got '%s'", what, scape_last_error());
    free(out);
}

START_TEST(malformed_codes_refused)
{
    eng_tensor ts[] = { { "t0", 0, 1000, 0 }, { "t1", 1000, 40, 0 } };
    plan *p = NULL;
    ck_assert_int_eq(plan_build(&p, ts, 2, 1, 0.01), SCAPE_OK);
    /* t0: 10 x 10 bits; t1: k = 1 x 6 bits: a 106-bit stream, 4 words */
    size_t nb = mcode_bytes(p, 0, 2);
    ck_assert_uint_eq(nb, 16);
    uint32_t mask[40] = { 0 }, code[8], bad[8];
    unsigned seed = 3;
    random_mask(p, mask, &seed);
    ck_assert_int_eq(mcode_encode(p, 0, 2, mask, code), SCAPE_OK);
    refused(p, code, nb - 4, "bytes, the plan says");
    refused(p, code, nb + 4, "bytes, the plan says");
    /* positions out of order: swap the first two 10-bit fields */
    memcpy(bad, code, nb);
    uint32_t f0 = bad[0] & 0x3ff, f1 = (bad[0] >> 10) & 0x3ff;
    bad[0] = (bad[0] & ~0xfffffu) | f1 | (f0 << 10);
    refused(p, bad, nb, "not ascending");
    /* a position past the end: the last field of t0 set to 1023 */
    memcpy(bad, code, nb);
    bad[2] |= 0x3fu << 26; /* bits 90..99: word 2 bits 26..31, word 3 bits 0..3 */
    bad[3] |= 0xfu;
    refused(p, bad, nb, "not ascending inside the tensor");
    /* padding: bit 127 set */
    memcpy(bad, code, nb);
    bad[3] |= 1u << 31;
    refused(p, bad, nb, "padding");
    /* positions are only written for exactly k bits (bitmaps are checked
     * when decoded, the sender's own included) */
    mask[0] ^= 1u;
    ck_assert_int_eq(mcode_encode(p, 0, 2, mask, code), SCAPE_INVALID);
    plan_destroy(&p);

    /* at 0.5 both go as bitmaps (t0: 500 x 10 bits > 32 words; t1: 20 x 6 >
     * 2 words): popcount and the bits past the end */
    ck_assert_int_eq(plan_build(&p, ts, 2, 1, 0.5), SCAPE_OK);
    nb = mcode_bytes(p, 0, 2);
    ck_assert_uint_eq(nb, 4 * (32 + 2));
    uint32_t big[40], cb[40];
    random_mask(p, big, &seed);
    ck_assert_int_eq(mcode_encode(p, 0, 2, big, cb), SCAPE_OK);
    uint32_t *b2 = malloc(nb);
    memcpy(b2, cb, nb);
    b2[0] ^= 1u; /* one bit more or less */
    refused(p, b2, nb, "not exactly k bits");
    memcpy(b2, cb, nb);
    b2[31] |= 1u << 31; /* t0 is 1000 long: bit 1023 is past its end */
    refused(p, b2, nb, "past the tensor's end");
    free(b2);
    plan_destroy(&p);
}
END_TEST

/* Deltas: round trips between random masks (also across a change of k_l,
 * as under a density schedule), a size worked by hand, and every malformed
 * delta refused naming the rank and the tensor. */
START_TEST(delta_round_trips)
{
    size_t lens[] = { 1, 2, 31, 32, 33, 100, 1000, 4097, 16384, 5 };
    size_t nt = sizeof lens / sizeof lens[0];
    unsigned seed = 11;
    for (int rep = 0; rep < 50; rep++) {
        plan *p = build(lens, nt, 1, rep % 2 ? 0.01 : 0.2);
        uint32_t *prev = calloc(p->nwords, 4), *next = calloc(p->nwords, 4),
                 *out = calloc(p->nwords, 4);
        random_mask(p, prev, &seed);
        if (rep % 5 == 0)
            plan_set_rho(p, 0.05); /* the next mask has other k_l */
        random_mask(p, next, &seed);
        if (rep % 3 == 0 && rep % 5 != 0) /* no change at all */
            memcpy(next, prev, p->nwords * 4);
        size_t nb = mdelta_bytes(p, 0, nt, prev, next);
        uint32_t *code = calloc(nb / 4 + 1, 4);
        ck_assert_int_eq(mdelta_encode(p, 0, nt, prev, next, code), SCAPE_OK);
        ck_assert_int_eq(mdelta_decode(p, 0, nt, prev, code, nb, out, 2), SCAPE_OK);
        ck_assert_mem_eq(out, next, p->nwords * 4);
        free(code);
        free(prev);
        free(next);
        free(out);
        plan_destroy(&p);
    }
    /* by hand: one tensor of 1000, k = 10, one position moved, the first
     * left for the last free one: form (2 bits), the count that left (4
     * bits, up to kp = 10), index 0 among prev's 10 (r = 2: 3 bits), index
     * 989 among the 990 free (r = 8: 989 >> 8 = 3 ones, a zero, 8 bits:
     * 12), 21 bits in all, one word, against the fixed code's 100 bits (4
     * words); unchanged: 6 bits */
    size_t one[] = { 1000 };
    plan *p = build(one, 1, 1, 0.01);
    uint32_t prev[32] = { 0 }, next[32] = { 0 };
    random_mask(p, prev, &seed);
    memcpy(next, prev, sizeof next);
    ck_assert_uint_eq(mdelta_bytes(p, 0, 1, prev, next), 4);
    int from = 0;
    for (size_t w = 0; w < 32; w++)
        if (next[w]) {
            from = (int)(32 * w) + __builtin_ctz(next[w]);
            break;
        }
    next[from / 32] &= ~(1u << (from % 32));
    for (int pos = 999;; pos--)
        if (!(next[pos / 32] >> (pos % 32) & 1)) {
            next[pos / 32] |= 1u << (pos % 32);
            break;
        }
    ck_assert_uint_eq(mdelta_bytes(p, 0, 1, prev, next), 4);
    ck_assert_uint_eq(mcode_bytes(p, 0, 1), 16);
    plan_destroy(&p);
}
END_TEST

static void delta_refused(const plan *p, const uint32_t *prev, const uint32_t *code, size_t nb,
                          const char *what)
{
    uint32_t *out = calloc(p->nwords, 4);
    ck_assert_int_eq(mdelta_decode(p, 0, p->ntensors, prev, code, nb, out, 3), SCAPE_PROTO);
    ck_assert_msg(strstr(scape_last_error(), what) && strstr(scape_last_error(), "rank 3"),
                  "want '%s', got '%s'", what, scape_last_error());
    free(out);
}

START_TEST(malformed_deltas_refused)
{
    eng_tensor ts[] = { { "t0", 0, 1000, 0 }, { "t1", 1000, 40, 0 } };
    plan *p = NULL;
    ck_assert_int_eq(plan_build(&p, ts, 2, 1, 0.01), SCAPE_OK);
    uint32_t prev[40] = { 0 }, next[40] = { 0 };
    unsigned seed = 5;
    random_mask(p, prev, &seed);
    /* next: t0's first position moved to the last free one, t1 unchanged,
     * so t0 goes as its change (form 1 in bits 0..1, then its 4-bit count
     * of positions that left, up to kp = 10, at bits 2..5) */
    memcpy(next, prev, sizeof next);
    const plan_tensor *t0 = &p->t[0];
    for (size_t i = 0; i < 1000; i++)
        if (next[t0->word + i / 32] >> (i % 32) & 1) {
            next[t0->word + i / 32] &= ~(1u << (i % 32));
            break;
        }
    for (size_t i = 999;; i--)
        if (!(prev[t0->word + i / 32] >> (i % 32) & 1)) {
            next[t0->word + i / 32] |= 1u << (i % 32);
            break;
        }
    size_t nb = mdelta_bytes(p, 0, 2, prev, next);
    uint32_t code[64] = { 0 }, bad[64];
    ck_assert_int_eq(mdelta_encode(p, 0, 2, prev, next, code), SCAPE_OK);
    ck_assert_uint_eq(code[0] & 3u, 1u);
    delta_refused(p, prev, code, nb - 4, "ends early");
    delta_refused(p, prev, code, nb + 4, "padding");
    delta_refused(p, prev, code, nb - 1, "not whole words");
    memcpy(bad, code, sizeof bad);
    bad[0] = (bad[0] & ~(0xfu << 2)) | (15u << 2); /* 15 of 10 left */
    delta_refused(p, prev, bad, nb, "tensor t0: delta counts past");
    /* an unknown form (3) */
    memcpy(bad, code, sizeof bad);
    bad[0] |= 3u;
    delta_refused(p, prev, bad, nb, "tensor t0: an unknown form");
    /* the sender's own mask must have exactly k bits: one fewer is refused */
    uint32_t fewer[40];
    memcpy(fewer, prev, sizeof fewer);
    for (size_t w = 0; w < 32; w++)
        if (fewer[w]) {
            fewer[w] &= fewer[w] - 1;
            break;
        }
    uint32_t cf[64] = { 0 };
    ck_assert_int_eq(mdelta_encode(p, 0, 2, prev, fewer, cf), SCAPE_INVALID);
    /* one mask, one code: an unchanged t1 (40 long, k = 1) sent as its
     * bitmap (form 2) or its position list (form 0: a zero, then 7 in r =
     * 4 bits) where its change (form 1: the count 0 in one bit) is
     * shorter, is refused */
    eng_tensor one_t[] = { { "t1", 0, 40, 0 } };
    plan *q = NULL;
    ck_assert_int_eq(plan_build(&q, one_t, 1, 1, 0.01), SCAPE_OK);
    uint32_t qm[2] = { 1u << 7, 0 }, qc[2] = { 2u | (qm[0] << 2), qm[0] >> 30 };
    uint32_t qo[2] = { 0 };
    ck_assert_int_eq(mdelta_decode(q, 0, 1, qm, qc, 8, qo, 3), SCAPE_PROTO);
    ck_assert_msg(strstr(scape_last_error(), "tensor t1: a tensor in a longer form"),
                  "%s", scape_last_error());
    uint32_t ql[1] = { 7u << 3 };
    ck_assert_int_eq(mdelta_decode(q, 0, 1, qm, ql, 4, qo, 3), SCAPE_PROTO);
    ck_assert_msg(strstr(scape_last_error(), "tensor t1: a tensor in a longer form"),
                  "%s", scape_last_error());
    /* and the same mask as the encoder writes it (no change: 3 bits) is taken */
    uint32_t qe[2] = { 0 };
    ck_assert_int_eq(mdelta_encode(q, 0, 1, qm, qm, qe), SCAPE_OK);
    ck_assert_uint_eq(qe[0], 1u);
    ck_assert_int_eq(mdelta_decode(q, 0, 1, qm, qe, mdelta_bytes(q, 0, 1, qm, qm), qo, 3),
                     SCAPE_OK);
    ck_assert_uint_eq(qo[0], qm[0]);
    plan_destroy(&q);
    /* indices past the positions they count, by hand: t1 of 40, k = 2,
     * the last mask {3, 9}; form 1 (bits 0..1), one left (bits 2..3) */
    eng_tensor two_t[] = { { "t1", 0, 40, 0 } };
    ck_assert_int_eq(plan_build(&q, two_t, 1, 1, 0.05), SCAPE_OK);
    ck_assert_uint_eq(q->t[0].k, 2);
    uint32_t tm[2] = { 1u << 3 | 1u << 9, 0 };
    /* the one that left as index 2 of prev's 2 (r = 0: two ones, a zero) */
    uint32_t past_left[1] = { 1u | 1u << 2 | 1u << 4 | 1u << 5 };
    ck_assert_int_eq(mdelta_decode(q, 0, 1, tm, past_left, 4, qo, 3), SCAPE_PROTO);
    ck_assert_msg(strstr(scape_last_error(), "tensor t1: a delta index past the positions"),
                  "%s", scape_last_error());
    /* index 0 left, and the one that joined as index 38 of the 38 free
     * (r = 4: two ones, a zero, then 38 & 15 = 6 in 4 bits) */
    uint32_t past_joined[1] = { 1u | 1u << 2 | 1u << 5 | 1u << 6 | 6u << 8 };
    ck_assert_int_eq(mdelta_decode(q, 0, 1, tm, past_joined, 4, qo, 3), SCAPE_PROTO);
    ck_assert_msg(strstr(scape_last_error(), "tensor t1: a delta index past the positions"),
                  "%s", scape_last_error());
    /* index 37 of the free ones is position 39: {9, 39}, taken */
    uint32_t in_range[1] = { 1u | 1u << 2 | 1u << 5 | 1u << 6 | 5u << 8 };
    ck_assert_int_eq(mdelta_decode(q, 0, 1, tm, in_range, 4, qo, 3), SCAPE_OK);
    ck_assert_uint_eq(qo[0], 1u << 9);
    ck_assert_uint_eq(qo[1], 1u << (39 - 32));
    plan_destroy(&q);
    /* a mask unlike the last one: its tensors go whole, and decode to it */
    uint32_t whole[64] = { 0 }, other[40] = { 0 };
    uint32_t far[40] = { 0 };
    random_mask(p, far, &seed);
    size_t nw = mdelta_bytes(p, 0, 2, prev, far);
    ck_assert_int_eq(mdelta_encode(p, 0, 2, prev, far, whole), SCAPE_OK);
    ck_assert_int_eq(mdelta_decode(p, 0, 2, prev, whole, nw, other, 3), SCAPE_OK);
    ck_assert_mem_eq(other, far, sizeof far);
    plan_destroy(&p);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("maskcode");
    TCase *tc = tcase_create("maskcode");
    tcase_add_test(tc, sizes_by_hand);
    tcase_add_test(tc, round_trips);
    tcase_add_test(tc, union_of_ranks);
    tcase_add_test(tc, malformed_codes_refused);
    tcase_add_test(tc, delta_round_trips);
    tcase_add_test(tc, malformed_deltas_refused);
    suite_add_tcase(s, tc);
    return check_run(s);
}
