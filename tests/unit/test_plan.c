/* test_plan.c - layout validation, k_l, greedy ownership and comm order. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "check_run.h"

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
    suite_add_tcase(s, tc);
    return check_run(s);
}
