/* test_plan.c - layout validation, k_l, greedy ownership and comm order. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "check_run.h"
#include "../bench/gpt_layout.h"

START_TEST(k_formula)
{
    /* k_l = max(1, ceil(rho * |L|)), derived by hand. */
    ck_assert_uint_eq(plan_k(0.01, 1), 1);
    ck_assert_uint_eq(plan_k(0.01, 100), 1);
    ck_assert_uint_eq(plan_k(0.01, 101), 2);
    ck_assert_uint_eq(plan_k(0.1, 33), 4);
    ck_assert_uint_eq(plan_k(0.5, 7), 4);
    ck_assert_uint_eq(plan_k(1.0, 31), 31);
    ck_assert_uint_eq(plan_k(0.01, 1000000), 10000);
    ck_assert_uint_eq(plan_k(0.07, 100), 7); /* 0.07 * 100 > 7 in double */
    ck_assert_uint_eq(plan_k(0.01, 300), 3);
}
END_TEST

START_TEST(greedy_owners)
{
    /* lengths 10, 7, 7, 5, 1 over 2 ranks: 10->r0, 7(idx1)->r1, 7(idx2)->r1
     * (load 7 < 10), 5->r0 (10 < 14), 1->r0 (15 vs 14 -> r1).  Worked by hand. */
    eng_tensor ts[] = { { "a", 0, 10, 0 }, { "b", 10, 7, 0 }, { "c", 17, 7, 0 },
                        { "d", 24, 5, 0 }, { "e", 29, 1, 0 } };
    plan *p = NULL;
    ck_assert_int_eq(plan_build(&p, ts, 5, 2, 0.5), SCAPE_OK);
    int want[] = { 0, 1, 1, 0, 1 };
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(p->t[i].owner, want[i]);
    ck_assert_uint_eq(p->n, 30);
    /* comm order: rank 0 {a, d}, rank 1 {b, c, e}; each tensor word aligned */
    ck_assert_uint_eq(p->order[0], 0);
    ck_assert_uint_eq(p->order[1], 3);
    ck_assert_uint_eq(p->order[2], 1);
    ck_assert_uint_eq(p->shard[0].words, 2);
    ck_assert_uint_eq(p->shard[1].word0, 2);
    ck_assert_uint_eq(p->shard[1].len, 15);
    ck_assert_uint_eq(p->t[3].pos, 10);
    ck_assert_uint_eq(p->nwords, 5);
    plan_destroy(&p);
    ck_assert_ptr_null(p);
}
END_TEST

START_TEST(ties_lower_rank)
{
    eng_tensor ts[] = { { NULL, 0, 4, 0 }, { NULL, 4, 4, 0 }, { NULL, 8, 4, 0 } };
    plan *p = NULL;
    ck_assert_int_eq(plan_build(&p, ts, 3, 8, 1.0), SCAPE_OK);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(p->t[i].owner, i);
    for (int r = 3; r < 8; r++)
        ck_assert_uint_eq(p->shard[r].count, 0);
    plan_destroy(&p);
}
END_TEST

START_TEST(unordered_layout_tiles)
{
    eng_tensor ts[] = { { "x", 40, 33, 0 }, { "y", 0, 40, 0 }, { "z", 73, 1, 0 } };
    plan *p = NULL;
    ck_assert_int_eq(plan_build(&p, ts, 3, 3, 0.1), SCAPE_OK);
    ck_assert_uint_eq(p->n, 74);
    ck_assert_uint_eq(p->k_total, 4 + 4 + 1);
    plan_destroy(&p);
}
END_TEST

/* dense_below: tensors of at most that many coordinates keep k_l = len, at
 * every density the plan is set to; the owners and the layout stay. */
START_TEST(small_tensors_whole)
{
    eng_tensor ts[] = { { "w", 0, 1000, 0 }, { "g", 1000, 64, 0 }, { "b", 1064, 65, 0 } };
    plan *p = NULL;
    ck_assert_int_eq(plan_build(&p, ts, 3, 2, 0.01), SCAPE_OK);
    ck_assert_uint_eq(p->k_total, 10 + 1 + 1);
    int owner = p->t[1].owner;
    size_t pos = p->t[1].pos;
    plan_set_dense(p, 64, 0.01);
    ck_assert_uint_eq(p->t[0].k, 10);
    ck_assert_uint_eq(p->t[1].k, 64);
    ck_assert_uint_eq(p->t[2].k, 1);
    ck_assert_uint_eq(p->k_total, 10 + 64 + 1);
    plan_set_rho(p, 0.1); /* a schedule's step: the small tensor stays whole */
    ck_assert_uint_eq(p->k_total, 100 + 64 + 7);
    ck_assert_int_eq(p->t[1].owner, owner);
    ck_assert_uint_eq(p->t[1].pos, pos);
    plan_set_dense(p, 0, 0.01);
    ck_assert_uint_eq(p->k_total, 10 + 1 + 1);
    plan_destroy(&p);
}
END_TEST

static void expect_bad(const eng_tensor *ts, size_t nt, int R, double rho, const char *needle)
{
    plan *p = NULL;
    scape_clear_error();
    ck_assert_int_eq(plan_build(&p, ts, nt, R, rho), SCAPE_INVALID);
    ck_assert_ptr_null(p);
    ck_assert_msg(strstr(scape_last_error(), needle) != NULL, "message '%s' lacks '%s'",
                  scape_last_error(), needle);
}

START_TEST(bad_layouts)
{
    eng_tensor gap[] = { { "a", 0, 10, 0 }, { "b", 11, 5, 0 } };
    eng_tensor overlap[] = { { "a", 0, 10, 0 }, { "b", 9, 5, 0 } };
    eng_tensor late[] = { { "a", 3, 10, 0 } };
    eng_tensor empty[] = { { "a", 0, 10, 0 }, { "z", 10, 0, 0 } };
    expect_bad(gap, 2, 1, 0.1, "gap");
    expect_bad(overlap, 2, 1, 0.1, "overlap");
    expect_bad(late, 1, 1, 0.1, "tile");
    expect_bad(empty, 2, 1, 0.1, "length 0");
    expect_bad(gap, 0, 1, 0.1, "no tensors");
    expect_bad(late, 1, 0, 0.1, "nranks");
    expect_bad(late, 1, 1, 0.0, "rho");
    expect_bad(late, 1, 1, 1.5, "rho");
    expect_bad(NULL, 1, 1, 0.1, "NULL");
}
END_TEST

/* Two plans are the same in every field the engine reads. */
static void expect_same_plan(const plan *a, const plan *b)
{
    ck_assert_uint_eq(a->n, b->n);
    ck_assert_uint_eq(a->ntensors, b->ntensors);
    ck_assert_uint_eq(a->nwords, b->nwords);
    ck_assert_uint_eq(a->max_len, b->max_len);
    ck_assert_uint_eq(a->k_total, b->k_total);
    ck_assert_uint_eq(a->hash, b->hash);
    for (size_t i = 0; i < a->ntensors; i++) {
        const plan_tensor *x = &a->t[i], *y = &b->t[i];
        ck_assert_ptr_eq(x->name, y->name);
        ck_assert_uint_eq(x->off, y->off);
        ck_assert_uint_eq(x->len, y->len);
        ck_assert_uint_eq(x->k, y->k);
        ck_assert_int_eq(x->owner, y->owner);
        ck_assert_uint_eq(x->word, y->word);
        ck_assert_uint_eq(x->pos, y->pos);
        ck_assert_uint_eq(x->group, y->group);
        ck_assert_uint_eq(a->order[i], b->order[i]);
    }
    ck_assert_int_eq(memcmp(a->shard, b->shard, (size_t)a->nranks * sizeof *a->shard), 0);
}

/* split_above 0, or above every tensor's length, is the whole-tensor plan
 * (greedy_owners' worked one included): one piece per tensor, its own. */
START_TEST(split_off_is_whole)
{
    eng_tensor ts[] = { { "a", 0, 10, 0 }, { "b", 10, 7, 0 }, { "c", 17, 7, 0 },
                        { "d", 24, 5, 0 }, { "e", 29, 1, 0 } };
    plan *w = NULL, *z = NULL, *big = NULL;
    ck_assert_int_eq(plan_build(&w, ts, 5, 2, 0.5), SCAPE_OK);
    ck_assert_int_eq(plan_build_split(&z, ts, 5, 2, 0.5, 0), SCAPE_OK);
    ck_assert_int_eq(plan_build_split(&big, ts, 5, 2, 0.5, 10), SCAPE_OK);
    int want[] = { 0, 1, 1, 0, 1 };
    for (int i = 0; i < 5; i++) {
        ck_assert_int_eq(z->t[i].owner, want[i]);
        ck_assert_uint_eq(z->t[i].parent, (size_t)i);
        ck_assert_uint_eq(z->t[i].whole, z->t[i].len);
    }
    expect_same_plan(w, z);
    expect_same_plan(w, big);
    ck_assert_uint_eq(z->nreg, 5);
    plan_destroy(&w);
    plan_destroy(&z);
    plan_destroy(&big);
}
END_TEST

/* Worked by hand: split_above 4 cuts a (10) into 3, 3, 4 (piece q from
 * floor(10 q / 3)) and b (7) into 3, 4; c (3) stays.  Greedy over the
 * pieces (length descending, ties by index): a2 -> r0, b1 -> r1, a0 -> r0,
 * a1 -> r1, b0 -> r0, c -> r1: 10 coordinates each. */
START_TEST(split_pieces_by_hand)
{
    eng_tensor ts[] = { { "a", 0, 10, 0 }, { "b", 10, 7, 3 }, { "c", 17, 3, 0 } };
    plan *p = NULL, *w = NULL;
    ck_assert_int_eq(plan_build_split(&p, ts, 3, 2, 0.5, 4), SCAPE_OK);
    ck_assert_int_eq(plan_build(&w, ts, 3, 2, 0.5), SCAPE_OK);
    ck_assert_uint_eq(p->ntensors, 6);
    ck_assert_uint_eq(p->nreg, 3);
    const size_t off[] = { 0, 3, 6, 10, 13, 17 }, len[] = { 3, 3, 4, 3, 4, 3 };
    const size_t parent[] = { 0, 0, 0, 1, 1, 2 }, whole[] = { 10, 10, 10, 7, 7, 3 };
    const int owner[] = { 0, 1, 0, 0, 1, 1 };
    for (size_t i = 0; i < 6; i++) {
        ck_assert_uint_eq(p->t[i].off, off[i]);
        ck_assert_uint_eq(p->t[i].len, len[i]);
        ck_assert_uint_eq(p->t[i].parent, parent[i]);
        ck_assert_uint_eq(p->t[i].whole, whole[i]);
        ck_assert_int_eq(p->t[i].owner, owner[i]);
        ck_assert_uint_eq(p->t[i].k, 2); /* ceil(0.5 * 3) = ceil(0.5 * 4) = 2 */
        ck_assert_ptr_eq(p->t[i].name, ts[parent[i]].name);
        ck_assert_uint_eq(p->t[i].group, ts[parent[i]].group);
    }
    ck_assert_uint_eq(p->k_total, 12);
    /* comm order: rank 0 {a0, a2, b0}, rank 1 {a1, b1, c}, by offset */
    const size_t order[] = { 0, 2, 3, 1, 4, 5 };
    for (size_t j = 0; j < 6; j++) {
        ck_assert_uint_eq(p->order[j], order[j]);
        ck_assert_uint_eq(p->t[order[j]].word, j);
    }
    ck_assert_uint_eq(p->shard[0].len, 10);
    ck_assert_uint_eq(p->shard[1].len, 10);
    ck_assert_uint_eq(p->nwords, 6);
    ck_assert_uint_eq(p->max_len, 4);
    ck_assert_uint_eq(p->hash, w->hash); /* the registered layout's */
    /* dense_below looks at the registered tensor: b (7) goes whole */
    plan_set_dense(p, 7, 0.5);
    ck_assert_uint_eq(p->k_total, 2 + 2 + 2 + 3 + 4 + 3);
    plan_destroy(&p);
    plan_destroy(&w);
}
END_TEST

/* The pieces as tensors, planned without splitting for any R, give the
 * split plan's owners (what resharding a checkpoint relies on). */
START_TEST(split_pieces_replan)
{
    eng_tensor ts[] = { { "a", 0, 1000, 0 }, { "b", 1000, 77, 0 }, { "c", 1077, 333, 0 },
                        { "d", 1410, 5, 0 } };
    eng_tensor pc[64];
    for (int R = 1; R <= 8; R++) {
        plan *p = NULL, *q = NULL;
        ck_assert_int_eq(plan_build_split(&p, ts, 4, R, 0.1, 100), SCAPE_OK);
        ck_assert_uint_le(p->ntensors, 64);
        for (size_t i = 0; i < p->ntensors; i++)
            pc[i] = (eng_tensor){ p->t[i].name, p->t[i].off, p->t[i].len, p->t[i].group };
        ck_assert_int_eq(plan_build(&q, pc, p->ntensors, R, 0.1), SCAPE_OK);
        for (size_t i = 0; i < p->ntensors; i++) {
            ck_assert_int_eq(q->t[i].owner, p->t[i].owner);
            ck_assert_uint_eq(q->t[i].pos, p->t[i].pos);
            ck_assert_uint_eq(q->t[i].word, p->t[i].word);
        }
        plan_destroy(&p);
        plan_destroy(&q);
    }
}
END_TEST

/* A split_above that would cut the layout into more than 2^20 pieces is
 * refused, naming the key and the least value that fits; that one works. */
START_TEST(split_too_fine_is_refused)
{
    eng_tensor ts[] = { { "emb", 0, 3u << 20, 0 }, { "b", 3u << 20, 5, 0 } };
    plan *p = NULL;
    scape_clear_error();
    ck_assert_int_eq(plan_build_split(&p, ts, 2, 4, 0.01, 2), SCAPE_INVALID);
    ck_assert_ptr_null(p);
    const char *msg = scape_last_error(), *at = strstr(msg, "at least ");
    ck_assert_msg(strstr(msg, "split_above=2") && at, "%s", msg);
    size_t least = strtoull(at + 9, NULL, 10);
    ck_assert_int_eq(plan_build_split(&p, ts, 2, 4, 0.01, least), SCAPE_OK);
    ck_assert_uint_le(p->ntensors, 1u << 20);
    plan_destroy(&p);
}
END_TEST

/* The bound (docs/algorithm.md): with every piece at most S coordinates,
 * greedy balance gives every owner under mean + S.  On the GPT layout
 * (1.82e9 coordinates, the embedding 5.7% of them) at R = 8 ... 64, with
 * S = floor(f N / R), no owner exceeds (1 + f) times the mean; whole
 * tensors leave the embedding's owner far above it at R = 64. */
START_TEST(split_balance_gpt)
{
    static eng_tensor ts[GPT_TENSORS];
    size_t n = 0, nt = gpt_layout(1.0, ts, &n);
    const double fs[] = { 0.05, 0.1, 0.25 };
    for (int R = 8; R <= 64; R *= 2) {
        double mean = (double)n / R;
        for (size_t q = 0; q < sizeof fs / sizeof fs[0]; q++) {
            size_t S = (size_t)(fs[q] * (double)n / R);
            plan *p = NULL;
            ck_assert_int_eq(plan_build_split(&p, ts, nt, R, 0.01, S), SCAPE_OK);
            size_t most = 0, k = 0, sum = 0;
            for (int r = 0; r < R; r++)
                most = p->shard[r].len > most ? p->shard[r].len : most;
            for (size_t i = 0; i < p->ntensors; i++) {
                ck_assert_uint_le(p->t[i].len, S);
                k += plan_k(0.01, p->t[i].len);
                sum += p->t[i].len;
            }
            ck_assert_uint_eq(sum, n);
            ck_assert_uint_eq(p->k_total, k);
            ck_assert_msg((double)most < mean + (double)S && (double)most <= (1 + fs[q]) * mean,
                          "R=%d f=%g: largest share %zu, mean %.0f (%.3fx)", R, fs[q], most,
                          mean, (double)most / mean);
            plan_destroy(&p);
        }
    }
    plan *w = NULL;
    ck_assert_int_eq(plan_build(&w, ts, nt, 64, 0.01), SCAPE_OK);
    size_t most = 0;
    for (int r = 0; r < 64; r++)
        most = w->shard[r].len > most ? w->shard[r].len : most;
    ck_assert_msg((double)most > 3.0 * (double)n / 64, "whole tensors: %zu vs mean %zu", most,
                  n / 64);
    plan_destroy(&w);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("plan");
    TCase *tc = tcase_create("plan");
    tcase_add_test(tc, k_formula);
    tcase_add_test(tc, greedy_owners);
    tcase_add_test(tc, ties_lower_rank);
    tcase_add_test(tc, unordered_layout_tiles);
    tcase_add_test(tc, small_tensors_whole);
    tcase_add_test(tc, bad_layouts);
    tcase_add_test(tc, split_off_is_whole);
    tcase_add_test(tc, split_pieces_by_hand);
    tcase_add_test(tc, split_pieces_replan);
    tcase_add_test(tc, split_balance_gpt);
    tcase_add_test(tc, split_too_fine_is_refused);
    suite_add_tcase(s, tc);
    return check_run(s);
}
