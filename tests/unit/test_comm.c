/* test_comm.c - the local comm backend: results, sum order, counters,
 * asynchronous all-gather, bad arguments and the barrier timeout. */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rank_threads.h"
#include "check_run.h"

static const int s_sizes[] = { 1, 2, 3, 4, 8 };
#define NSIZES (int)(sizeof s_sizes / sizeof s_sizes[0])

/* Deterministic per-(rank, i) value with a fractional part, so that sums in
 * a different order would round differently. */
static float val(int r, size_t i)
{
    uint32_t h = (uint32_t)(r * 2654435761u) ^ (uint32_t)(i * 40503u + 17u);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    return ((float)(h & 0xffffff) / 16777216.0f - 0.5f) * (float)(1 + (h % 7) * 1000);
}

/* The sum in rank order, computed here in float as the contract says. */
static float rank_order_sum(int R, size_t i)
{
    float s = val(0, i);
    for (int q = 1; q < R; q++)
        s += val(q, i);
    return s;
}

#define N_AR 1001

static scape_rc do_allreduce(rank_arg *a)
{
    float *buf = malloc(N_AR * sizeof *buf);
    for (size_t i = 0; i < N_AR; i++)
        buf[i] = val(a->rank, i);
    scape_rc rc = comm_allreduce_sum(a->comm, buf, N_AR);
    for (size_t i = 0; rc == SCAPE_OK && i < N_AR; i++)
        if (memcmp(&buf[i], &(float){ rank_order_sum(a->nranks, i) }, 4) != 0)
            rc = scape_set_error(SCAPE_INVALID, "rank %d: element %zu differs", a->rank, i);
    const comm_stats *st = &a->comm->stats;
    if (rc == SCAPE_OK && (st->calls[COMM_ALLREDUCE] != 1 ||
                           st->bytes[COMM_ALLREDUCE] != N_AR * 4 ||
                           st->wire_bytes[COMM_ALLREDUCE] !=
                               2ull * (uint64_t)(a->nranks - 1) * N_AR * 4 / (uint64_t)a->nranks))
        rc = scape_set_error(SCAPE_INVALID, "rank %d: counters wrong", a->rank);
    free(buf);
    return rc;
}

static void expect_all_ok(int R, const rank_arg *args)
{
    for (int r = 0; r < R; r++)
        ck_assert_msg(args[r].rc == SCAPE_OK, "R=%d rank %d: %s", R, r, args[r].err);
}

START_TEST(allreduce_rank_order)
{
    for (int s = 0; s < NSIZES; s++) {
        rank_arg args[8];
        ck_assert_int_eq(run_ranks(s_sizes[s], do_allreduce, NULL, args), 0);
        expect_all_ok(s_sizes[s], args);
    }
}
END_TEST

/* Uneven segments, one of them empty: counts[r] = (r * 37) % 50 + (r == 1 ? 0 : 3). */
static void seg_counts(int R, size_t *counts)
{
    for (int r = 0; r < R; r++)
        counts[r] = r == 1 ? 0 : (size_t)((r * 37) % 50 + 3);
}

static scape_rc do_reduce_scatter(rank_arg *a)
{
    size_t counts[8] = { 0 }, total = 0, off = 0;
    seg_counts(a->nranks, counts);
    for (int r = 0; r < a->nranks; r++) {
        if (r < a->rank)
            off += counts[r];
        total += counts[r];
    }
    float *send = malloc((total + 1) * sizeof *send), *recv = malloc((counts[a->rank] + 1) * 4);
    for (size_t i = 0; i < total; i++)
        send[i] = val(a->rank, i);
    recv[counts[a->rank]] = 12345.0f; /* guard */
    scape_rc rc = comm_reduce_scatter_sum(a->comm, send, recv, counts);
    for (size_t i = 0; rc == SCAPE_OK && i < counts[a->rank]; i++)
        if (memcmp(&recv[i], &(float){ rank_order_sum(a->nranks, off + i) }, 4) != 0)
            rc = scape_set_error(SCAPE_INVALID, "rank %d: element %zu differs", a->rank, i);
    if (rc == SCAPE_OK && recv[counts[a->rank]] != 12345.0f)
        rc = scape_set_error(SCAPE_INVALID, "rank %d: wrote past its segment", a->rank);
    if (rc == SCAPE_OK && (a->comm->stats.bytes[COMM_REDUCE_SCATTER] != total * 4 ||
                           a->comm->stats.wire_bytes[COMM_REDUCE_SCATTER] !=
                               (total - counts[(a->rank + a->nranks - 1) % a->nranks]) * 4))
        rc = scape_set_error(SCAPE_INVALID, "rank %d: counters wrong", a->rank);
    free(send);
    free(recv);
    return rc;
}

/* In place: recv is this rank's own segment of send, and the all-gather's
 * send is this rank's own place in recv. */
static scape_rc do_in_place(rank_arg *a)
{
    size_t counts[8] = { 0 }, total = 0, off = 0, bcounts[8];
    seg_counts(a->nranks, counts);
    for (int r = 0; r < a->nranks; r++) {
        if (r < a->rank)
            off += counts[r];
        total += counts[r];
        bcounts[r] = counts[r] * sizeof(float);
    }
    float *buf = malloc((total + 1) * sizeof *buf);
    for (size_t i = 0; i < total; i++)
        buf[i] = val(a->rank, i);
    scape_rc rc = comm_reduce_scatter_sum(a->comm, buf, buf + off, counts);
    for (size_t i = 0; rc == SCAPE_OK && i < counts[a->rank]; i++)
        if (memcmp(&buf[off + i], &(float){ rank_order_sum(a->nranks, off + i) }, 4) != 0)
            rc = scape_set_error(SCAPE_INVALID, "rank %d: in-place element %zu", a->rank, i);
    if (rc == SCAPE_OK)
        rc = comm_allgather(a->comm, buf + off, buf, bcounts);
    for (size_t i = 0; rc == SCAPE_OK && i < total; i++)
        if (memcmp(&buf[i], &(float){ rank_order_sum(a->nranks, i) }, 4) != 0)
            rc = scape_set_error(SCAPE_INVALID, "rank %d: gathered element %zu", a->rank, i);
    free(buf);
    return rc;
}

START_TEST(in_place_collectives)
{
    for (int s = 0; s < NSIZES; s++) {
        rank_arg args[8];
        ck_assert_int_eq(run_ranks(s_sizes[s], do_in_place, NULL, args), 0);
        expect_all_ok(s_sizes[s], args);
    }
}
END_TEST

START_TEST(reduce_scatter_matches_allreduce)
{
    for (int s = 0; s < NSIZES; s++) {
        rank_arg args[8];
        ck_assert_int_eq(run_ranks(s_sizes[s], do_reduce_scatter, NULL, args), 0);
        expect_all_ok(s_sizes[s], args);
    }
}
END_TEST

/* Rank r contributes counts[r] bytes of value (r + 1). */
static scape_rc check_gathered(const rank_arg *a, const unsigned char *recv, const size_t *counts)
{
    size_t off = 0;
    for (int r = 0; r < a->nranks; r++)
        for (size_t i = 0; i < counts[r]; i++, off++)
            if (recv[off] != (unsigned char)(r + 1))
                return scape_set_error(SCAPE_INVALID, "rank %d: byte %zu from rank %d wrong",
                                       a->rank, off, r);
    return SCAPE_OK;
}

static scape_rc do_gathers(rank_arg *a)
{
    size_t counts[8] = { 0 }, total = 0;
    seg_counts(a->nranks, counts);
    for (int r = 0; r < a->nranks; r++)
        total += counts[r];
    unsigned char send[64], recv_a[512], recv_b[512];
    memset(send, a->rank + 1, sizeof send);
    scape_rc rc = comm_allgather(a->comm, send, recv_a, counts);
    if (rc == SCAPE_OK)
        rc = check_gathered(a, recv_a, counts);
    /* asynchronous: the send buffer is reused at once and another collective
     * runs before the wait */
    if (rc == SCAPE_OK)
        rc = comm_iallgather(a->comm, send, recv_b, counts);
    memset(send, 0xee, sizeof send);
    float x = 1.0f;
    if (rc == SCAPE_OK)
        rc = comm_allreduce_sum(a->comm, &x, 1);
    if (rc == SCAPE_OK)
        rc = comm_iallgather_wait(a->comm);
    if (rc == SCAPE_OK)
        rc = check_gathered(a, recv_b, counts);
    if (rc == SCAPE_OK && x != (float)a->nranks)
        rc = scape_set_error(SCAPE_INVALID, "interleaved all-reduce wrong");
    const comm_stats *st = &a->comm->stats;
    if (rc == SCAPE_OK && (st->calls[COMM_ALLGATHER] != 1 || st->calls[COMM_IALLGATHER] != 1 ||
                           st->bytes[COMM_IALLGATHER] != total ||
                           st->wire_bytes[COMM_ALLGATHER] != total - counts[a->rank]))
        rc = scape_set_error(SCAPE_INVALID, "rank %d: counters wrong", a->rank);
    return rc;
}

START_TEST(allgather_sync_and_async)
{
    for (int s = 0; s < NSIZES; s++) {
        rank_arg args[8];
        ck_assert_int_eq(run_ranks(s_sizes[s], do_gathers, NULL, args), 0);
        expect_all_ok(s_sizes[s], args);
    }
}
END_TEST

static scape_rc do_broadcast(rank_arg *a)
{
    int root = a->nranks - 1;
    double buf[33];
    for (int i = 0; i < 33; i++)
        buf[i] = a->rank == root ? i * 0.5 : -1.0;
    scape_rc rc = comm_broadcast(a->comm, buf, sizeof buf, root);
    for (int i = 0; rc == SCAPE_OK && i < 33; i++)
        if (buf[i] != i * 0.5)
            rc = scape_set_error(SCAPE_INVALID, "rank %d: element %d", a->rank, i);
    if (rc == SCAPE_OK)
        rc = comm_barrier(a->comm);
    if (rc == SCAPE_OK &&
        a->comm->stats.wire_bytes[COMM_BROADCAST] != (a->rank == root ? 0 : sizeof buf))
        rc = scape_set_error(SCAPE_INVALID, "rank %d: counters wrong", a->rank);
    return rc;
}

START_TEST(broadcast_and_barrier)
{
    for (int s = 0; s < NSIZES; s++) {
        rank_arg args[8];
        ck_assert_int_eq(run_ranks(s_sizes[s], do_broadcast, NULL, args), 0);
        expect_all_ok(s_sizes[s], args);
    }
}
END_TEST

START_TEST(bad_arguments)
{
    comm_t *c[2];
    size_t counts[2] = { 4, 4 };
    float f = 0.0f;
    ck_assert_int_eq(comm_local_create(0, c), SCAPE_INVALID);
    ck_assert_int_eq(comm_local_create(2, NULL), SCAPE_INVALID);
    ck_assert_int_eq(comm_local_create_timeout(2, 0, c), SCAPE_INVALID);
    ck_assert_int_eq(comm_local_create(2, c), SCAPE_OK);
    ck_assert_int_eq(comm_allreduce_sum(NULL, &f, 1), SCAPE_INVALID);
    ck_assert_int_eq(comm_allreduce_sum(c[0], NULL, 1), SCAPE_INVALID);
    ck_assert_int_eq(comm_reduce_scatter_sum(c[0], &f, &f, NULL), SCAPE_INVALID);
    ck_assert_int_eq(comm_reduce_scatter_sum(c[0], NULL, &f, counts), SCAPE_INVALID);
    ck_assert_int_eq(comm_allgather(c[0], NULL, &f, counts), SCAPE_INVALID);
    ck_assert_int_eq(comm_iallgather(c[0], &f, NULL, counts), SCAPE_INVALID);
    ck_assert_int_eq(comm_iallgather_wait(c[0]), SCAPE_INVALID);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "nothing outstanding"));
    ck_assert_int_eq(comm_broadcast(c[0], &f, 4, 2), SCAPE_INVALID);
    ck_assert_int_eq(comm_broadcast(c[0], &f, 4, -1), SCAPE_INVALID);
    ck_assert_int_eq(comm_barrier(NULL), SCAPE_INVALID);
    /* A second asynchronous all-gather while one is outstanding. */
    float g2[2];
    ck_assert_int_eq(comm_iallgather(c[0], &f, g2, counts), SCAPE_OK);
    ck_assert_int_eq(comm_iallgather(c[0], &f, g2, counts), SCAPE_INVALID);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "already outstanding"));
    for (int r = 0; r < 2; r++)
        ck_assert_uint_eq(c[r]->stats.calls[COMM_ALLREDUCE], 0);
    comm_destroy(&c[0]);
    comm_destroy(&c[1]);
    ck_assert_ptr_null(c[0]);
    comm_destroy(NULL);
}
END_TEST

START_TEST(barrier_times_out_naming_missing_rank)
{
    comm_t *c[3];
    ck_assert_int_eq(comm_local_create_timeout(3, 200, c), SCAPE_OK);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    /* ranks 1 and 2 never arrive */
    ck_assert_int_eq(comm_barrier(c[0]), SCAPE_TIMEOUT);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ck_assert_msg(strstr(scape_last_error(), "missing rank(s): 1 2") != NULL, "%s",
                  scape_last_error());
    double waited = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    ck_assert_msg(waited >= 0.19, "returned before the timeout (%.3f s)", waited);
    for (int r = 0; r < 3; r++)
        comm_destroy(&c[r]);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("comm");
    TCase *tc = tcase_create("local");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, allreduce_rank_order);
    tcase_add_test(tc, reduce_scatter_matches_allreduce);
    tcase_add_test(tc, allgather_sync_and_async);
    tcase_add_test(tc, in_place_collectives);
    tcase_add_test(tc, broadcast_and_barrier);
    tcase_add_test(tc, bad_arguments);
    tcase_add_test(tc, barrier_times_out_naming_missing_rank);
    suite_add_tcase(s, tc);
    return check_run(s);
}
