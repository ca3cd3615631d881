/* test_comm_host.c - the host comm backend over 127.0.0.1: every collective
 * compared bit for bit with the local backend on the same inputs, a killed
 * peer, foreign messages (another job's, a raw peer's) dropped, wire counters,
 * bad arguments, and what a stop request does to a wait. */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "comm_host.h"
#include "comm_host_wire.h"
#include "rank_threads.h"
#include "try.h"
#include "check_run.h"

#define CHUNK 4096
#define MAXR 8

static const int s_sizes[] = { 1, 2, 3, 4, 8 };
#define NSIZES (int)(sizeof s_sizes / sizeof s_sizes[0])

/* Endpoints of one group; ports outside Linux's ephemeral range, random per
 * attempt so that parallel runs rarely meet, and retried when they do. */
typedef struct group {
    char ep[MAXR][40];
    const char *eps[MAXR];
    comm_t *c[MAXR];
} group;

/* Groups opened while this is set run CURVE, a fresh key pair per rank. */
static int s_curve;
static char s_pub[MAXR][41], s_sec[MAXR][41];
static const char *s_pubs[MAXR];

static scape_rc group_try(group *g, int R, uint64_t job, int timeout_ms)
{
    int base = 20000 + (int)((unsigned)rand() % 12000u);
    for (int r = 0; r < R; r++) {
        snprintf(g->ep[r], sizeof g->ep[r], "tcp://127.0.0.1:%d", base + r);
        g->eps[r] = g->ep[r];
        ck_assert_int_eq(zmq_curve_keypair(s_pub[r], s_sec[r]), 0);
        s_pubs[r] = s_pub[r];
    }
    for (int r = 0; r < R; r++) {
        comm_host_opts o = { .rank = r, .size = R, .endpoints = g->eps,
                             .timeout_ms = timeout_ms, .chunk_bytes = CHUNK, .job = job,
                             .curve_public = s_curve ? s_pub[r] : NULL,
                             .curve_secret = s_curve ? s_sec[r] : NULL,
                             .curve_keys = s_curve ? s_pubs : NULL };
        scape_rc rc = comm_host_create(&o, &g->c[r]);
        if (rc != SCAPE_OK) {
            while (r-- > 0)
                comm_destroy(&g->c[r]);
            return rc;
        }
    }
    return SCAPE_OK;
}

static void group_open(group *g, int R, uint64_t job, int timeout_ms)
{
    scape_rc rc = SCAPE_ZMQ;
    for (int attempt = 0; attempt < 20 && rc != SCAPE_OK; attempt++)
        rc = group_try(g, R, job, timeout_ms);
    ck_assert_msg(rc == SCAPE_OK, "cannot create a host group: %s", scape_last_error());
}

static void group_close(group *g, int R)
{
    for (int r = 0; r < R; r++)
        comm_destroy(&g->c[r]);
}

/* Run fn on every rank whose comm is not NULL, each on its own thread. */
static void run_on(int R, comm_t **comms, rank_fn fn, void *ctx, rank_arg *args)
{
    pthread_t th[MAXR];
    rank_thunk tk[MAXR];
    for (int r = 0; r < R; r++) {
        args[r] = (rank_arg){ .rank = r, .nranks = R, .comm = comms[r], .ctx = ctx };
        tk[r] = (rank_thunk){ fn, &args[r] };
        if (comms[r])
            ck_assert_int_eq(pthread_create(&th[r], NULL, rank_main, &tk[r]), 0);
    }
    for (int r = 0; r < R; r++)
        if (comms[r])
            pthread_join(th[r], NULL);
}

/* Deterministic values with fractional parts: another sum order rounds
 * differently. */
static float val(int r, size_t i)
{
    uint32_t h = (uint32_t)(r * 2654435761u) ^ (uint32_t)(i * 40503u + 17u);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    return ((float)(h & 0xffffff) / 16777216.0f - 0.5f) * (float)(1 + (h % 7) * 1000);
}

/* What each rank produced, appended in order, for the bitwise comparison. */
typedef struct outputs {
    size_t n;                   /* floats per rank input */
    unsigned char *out[MAXR];
    size_t len[MAXR], cap;
} outputs;

static void put(outputs *o, int r, const void *p, size_t bytes)
{
    if (o->len[r] + bytes <= o->cap && bytes)
        memcpy(o->out[r] + o->len[r], p, bytes);
    o->len[r] += bytes;
}

/* Uneven float counts summing to n; rank 1's is empty. */
static void seg_counts(int R, size_t n, size_t *counts)
{
    size_t w[MAXR], W = 0, acc = 0, prev = 0;
    for (int r = 0; r < R; r++)
        W += w[r] = r == 1 ? 0 : (size_t)((r * 37) % 50 + 3);
    for (int r = 0; r < R; r++) {
        acc += w[r];
        size_t b = n * acc / W;
        counts[r] = b - prev;
        prev = b;
    }
}

typedef struct bufs {
    float *x, *y, *z, *ag;
    unsigned char *msend, *mrecv, *bc;
    size_t counts[MAXR], bcounts[MAXR], mcounts[MAXR], off, mtotal;
} bufs;

static scape_rc bufs_new(const rank_arg *a, size_t n, bufs *b)
{
    memset(b, 0, sizeof *b);
    seg_counts(a->nranks, n, b->counts);
    for (int r = 0; r < a->nranks; r++) {
        b->off += r < a->rank ? b->counts[r] : 0;
        b->bcounts[r] = b->counts[r] * sizeof(float);
        b->mtotal += b->mcounts[r] = n / 3 + (size_t)r;
    }
    size_t fb = (n + 1) * sizeof(float);
    b->x = malloc(fb), b->y = malloc(fb), b->z = malloc(fb), b->ag = malloc(fb);
    b->msend = malloc(b->mtotal + 1), b->mrecv = malloc(b->mtotal + 1), b->bc = malloc(fb);
    if (!b->x || !b->y || !b->z || !b->ag || !b->msend || !b->mrecv || !b->bc)
        return scape_set_error(SCAPE_NOMEM, "test: out of memory");
    for (size_t i = 0; i < n; i++)
        b->x[i] = b->y[i] = b->z[i] = val(a->rank, i);
    memset(b->msend, a->rank + 1, b->mcounts[a->rank] + 1);
    return SCAPE_OK;
}

static void bufs_free(bufs *b)
{
    free(b->x), free(b->y), free(b->z), free(b->ag);
    free(b->msend), free(b->mrecv), free(b->bc);
}

/* Rank r's inputs cut to bf16 numbers (their upper halves). */
static void bf16_inputs(int r, float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float v = val(r, i);
        uint32_t u;
        memcpy(&u, &v, sizeof u);
        u &= 0xffff0000u;
        memcpy(&x[i], &u, sizeof u);
    }
}

/* All-reduce; reduce-scatter out of place (into ag's tail) and in place;
 * all-gather in place and out of place. */
static scape_rc sync_part(rank_arg *a, outputs *o, bufs *b)
{
    size_t n = o->n, mine = b->counts[a->rank];
    float *rs = b->ag + n - mine; /* out of place, overwritten by the gather later */
    TRY(comm_allreduce_sum(a->comm, b->x, n));
    put(o, a->rank, b->x, n * 4);
    TRY(comm_reduce_scatter_sum(a->comm, b->y, rs, b->counts));
    put(o, a->rank, rs, mine * 4);
    TRY(comm_reduce_scatter_sum(a->comm, b->y, b->y + b->off, b->counts));
    put(o, a->rank, b->y + b->off, mine * 4);
    TRY(comm_allgather(a->comm, b->y + b->off, b->y, b->bcounts));
    put(o, a->rank, b->y, n * 4);
    TRY(comm_allgather(a->comm, b->x + b->off, b->ag, b->bcounts));
    put(o, a->rank, b->ag, n * 4);
    /* bf16 inputs (wire_values: bf16): 16 bits a value on the host wire, the
     * same fp32 sums in rank order as the local backend's */
    bf16_inputs(a->rank, b->ag, n);
    TRY(comm_reduce_scatter_sum_wire(a->comm, b->ag, b->ag + b->off, b->counts, 1));
    put(o, a->rank, b->ag + b->off, mine * 4);
    bf16_inputs(a->rank, b->ag, n);
    TRY(comm_allreduce_sum_wire(a->comm, b->ag, n, 1));
    put(o, a->rank, b->ag, n * 4);
    return SCAPE_OK;
}

/* The asynchronous all-gather with its send buffer reused at once and other
 * collectives before the wait; then a broadcast from a non-zero root. */
static scape_rc async_part(rank_arg *a, outputs *o, bufs *b)
{
    size_t n = o->n;
    int root = a->nranks / 2;
    TRY(comm_iallgather(a->comm, b->msend, b->mrecv, b->mcounts));
    memset(b->msend, 0xee, b->mcounts[a->rank] + 1);
    TRY(comm_allreduce_sum(a->comm, b->z, n));
    TRY(comm_barrier(a->comm));
    for (size_t i = 0; i < n; i++)
        b->bc[i] = a->rank == root ? (unsigned char)(i * 7 + 1) : 0;
    TRY(comm_broadcast(a->comm, b->bc, n, root));
    TRY(comm_iallgather_wait(a->comm));
    put(o, a->rank, b->mrecv, b->mtotal);
    put(o, a->rank, b->z, n * 4);
    put(o, a->rank, b->bc, n);
    return comm_barrier(a->comm);
}

static scape_rc scenario(rank_arg *a)
{
    outputs *o = a->ctx;
    bufs b;
    scape_rc rc = bufs_new(a, o->n, &b);
    if (rc == SCAPE_OK)
        rc = sync_part(a, o, &b);
    if (rc == SCAPE_OK)
        rc = async_part(a, o, &b);
    bufs_free(&b);
    return rc;
}

static void outputs_init(outputs *o, size_t n, int R)
{
    memset(o, 0, sizeof *o);
    o->n = n;
    o->cap = 10 * (n + 1) * 4 + 4096;
    for (int r = 0; r < R; r++)
        ck_assert_ptr_nonnull(o->out[r] = malloc(o->cap));
}

static void outputs_free(outputs *o, int R)
{
    for (int r = 0; r < R; r++)
        free(o->out[r]);
}

static void expect_ok(int R, const rank_arg *args, const char *what)
{
    for (int r = 0; r < R; r++)
        ck_assert_msg(args[r].rc == SCAPE_OK, "%s R=%d rank %d: %s", what, R, r, args[r].err);
}

/* The host backend's outputs, on the comms `host` (NULL: a group opened
 * here), equal the local backend's, byte for byte. */
static void compare_backends_on(int R, size_t n, comm_t **host)
{
    outputs lo, ho;
    rank_arg args[MAXR];
    outputs_init(&lo, n, R);
    outputs_init(&ho, n, R);
    ck_assert_int_eq(run_ranks(R, scenario, &lo, args), 0);
    expect_ok(R, args, "local");
    group g;
    if (host == NULL)
        group_open(&g, R, 7, 10000);
    run_on(R, host ? host : g.c, scenario, &ho, args);
    if (host == NULL)
        group_close(&g, R);
    expect_ok(R, args, "host");
    for (int r = 0; r < R; r++) {
        ck_assert_uint_le(lo.len[r], lo.cap);
        ck_assert_uint_eq(lo.len[r], ho.len[r]);
        ck_assert_msg(memcmp(lo.out[r], ho.out[r], lo.len[r]) == 0,
                      "R=%d n=%zu rank %d: host differs from local", R, n, r);
    }
    outputs_free(&lo, R);
    outputs_free(&ho, R);
}

static void compare_backends(int R, size_t n) { compare_backends_on(R, n, NULL); }

START_TEST(small_sizes_match_local)
{
    static const size_t ns[] = { 0, 1, 1001, 5000 };
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++)
        compare_backends(s_sizes[_i], ns[k]);
}
END_TEST

/* ~3 MB per rank: hundreds of chunks per stream, not a whole number of them. */
START_TEST(megabytes_match_local)
{
    compare_backends(s_sizes[_i], 750001);
}
END_TEST

static void plain_tcp(void) { s_curve = 0; } /* a failed CURVE test leaves no trace */

/* CURVE: the same bytes as the local backend, in chunks as large as the
 * limit on a frame allows (a box is larger than its frame), and no rank of
 * the group refused. */
START_TEST(curve_groups_match_local)
{
    s_curve = 1;
    compare_backends(s_sizes[_i], 1001);
    compare_backends(s_sizes[_i], 750001);
    s_curve = 0;
}
END_TEST

/* A plain ZeroMQ peer and a CURVE peer whose key is not a rank's, at a
 * CURVE rank's data port: refused at the handshake, counted with the
 * reason; nothing they sent is read (no foreign message); the group still
 * runs. */
START_TEST(curve_refuses_strangers)
{
    s_curve = 1;
    group g;
    group_open(&g, 2, 7, 10000);
    void *zctx = zmq_ctx_new();
    char pub[41], sec[41], why[256];
    ck_assert_int_eq(zmq_curve_keypair(pub, sec), 0);
    int zero = 0;
    for (int k = 0; k < 2; k++) {
        void *push = zmq_socket(zctx, ZMQ_PUSH);
        ck_assert_ptr_nonnull(push);
        ck_assert_int_eq(zmq_setsockopt(push, ZMQ_LINGER, &zero, sizeof zero), 0);
        if (k == 1) {
            ck_assert_int_eq(zmq_setsockopt(push, ZMQ_CURVE_SERVERKEY, s_pub[1], 40), 0);
            ck_assert_int_eq(zmq_setsockopt(push, ZMQ_CURVE_PUBLICKEY, pub, 40), 0);
            ck_assert_int_eq(zmq_setsockopt(push, ZMQ_CURVE_SECRETKEY, sec, 40), 0);
        }
        ck_assert_int_eq(zmq_connect(push, g.eps[1]), 0);
        ck_assert_int_ge(zmq_send(push, "junk", 4, ZMQ_DONTWAIT), 0);
        uint64_t before = comm_refused(g.c[1], NULL, 0);
        for (int i = 0; i < 400 && comm_refused(g.c[1], why, sizeof why) <= before; i++)
            nanosleep(&(struct timespec){ 0, 10000000L }, NULL);
        ck_assert_uint_gt(comm_refused(g.c[1], why, sizeof why), before);
        /* a plain peer: whichever side sees the other's mechanism first ends it */
        ck_assert_msg(k == 0 ? strstr(why, "without CURVE") || strstr(why, "broke off")
                             : strstr(why, "not a rank of this job") != NULL,
                      "%s", why);
        zmq_close(push);
    }
    zmq_ctx_term(zctx);
    compare_backends_on(2, 1001, g.c);
    ck_assert_uint_eq(comm_foreign(g.c[1], NULL, 0), 0);
    ck_assert_uint_eq(comm_refused(g.c[0], NULL, 0), 0);
    group_close(&g, 2);
    s_curve = 0;
}
END_TEST

static double since(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0->tv_nsec);
}

static scape_rc do_allreduce(rank_arg *a)
{
    float buf[1000];
    for (int i = 0; i < 1000; i++)
        buf[i] = val(a->rank, (size_t)i);
    return comm_allreduce_sum(a->comm, buf, 1000);
}

static scape_rc do_barrier(rank_arg *a) { return comm_barrier(a->comm); }

/* Rank R-1 is gone before the first collective: the others time out naming
 * it within the timeout, and then refuse further calls. */
START_TEST(killed_peer_times_out_naming_it)
{
    const int R = 3;
    group g;
    group_open(&g, R, 7, 400);
    comm_destroy(&g.c[R - 1]);
    rank_arg args[MAXR];
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    run_on(R, g.c, do_allreduce, NULL, args);
    double waited = since(&t0);
    for (int r = 0; r < R - 1; r++) {
        ck_assert_int_eq(args[r].rc, SCAPE_TIMEOUT);
        /* which one depends on whether rank r had reached rank 2 before it went */
        ck_assert_msg(strstr(args[r].err, "rank 2 sent nothing for 400 ms during allreduce") ||
                      strstr(args[r].err, "lost rank 2 during allreduce"),
                      "rank %d: %s", r, args[r].err);
    }
    ck_assert_msg(waited >= 0.39 && waited < 3.0, "waited %.3f s", waited);
    ck_assert_int_eq(comm_barrier(g.c[0]), SCAPE_TIMEOUT);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "refused after an earlier failure"));
    group_close(&g, R);
}
END_TEST

/* Until every rank's connections reach all its peers (ZeroMQ connects in
 * the background; a peer that dies before it is reached cannot be seen to
 * go, only to time out). */
static void wait_connected(group *g, int R)
{
    for (int r = 0; r < R; r++)
        for (int i = 0; comm_host_connected(g->c[r]) < R - 1; i++) {
            ck_assert_msg(i < 500, "rank %d reaches %d of %d peers", r,
                          comm_host_connected(g->c[r]), R - 1);
            nanosleep(&(struct timespec){ 0, 10000000 }, NULL);
        }
}

/* A daemon dies in the middle of the chain.  Rank 0 waits for rank 2 (the
 * chain's end delivers its segment) and rank 2 for rank 1; both must name
 * rank 1, whose connections closed, and fail well before the timeout. */
START_TEST(dead_rank_is_named_not_the_rank_waited_for)
{
    const int R = 3;
    for (int dead = 0; dead < R; dead++) {
        group g;
        group_open(&g, R, 7, 20000);
        rank_arg args[MAXR];
        wait_connected(&g, R);
        run_on(R, g.c, do_barrier, NULL, args);
        expect_ok(R, args, "host");
        comm_destroy(&g.c[dead]);
        struct timespec t0;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        run_on(R, g.c, do_allreduce, NULL, args);
        double waited = since(&t0);
        char want[32];
        snprintf(want, sizeof want, "lost rank %d during allreduce", dead);
        for (int r = 0; r < R; r++) {
            if (r == dead)
                continue;
            ck_assert_int_eq(args[r].rc, SCAPE_TIMEOUT);
            ck_assert_msg(strstr(args[r].err, want), "dead %d, rank %d: %s", dead, r,
                          args[r].err);
        }
        ck_assert_msg(waited < 10.0, "dead %d: waited %.3f s of a 20 s timeout", dead, waited);
        group_close(&g, R);
    }
}
END_TEST

/* In a barrier, rank 0 names the rank that never arrived (hung: connected,
 * silent); ranks 1 and 2, which wait on rank 0 for the release, name it too,
 * from rank 0's report, whether their own wait timed out first or not. */
START_TEST(barrier_names_missing_rank)
{
    const int R = 4;
    group g;
    group_open(&g, R, 7, 300);
    comm_t *live[MAXR] = { g.c[0], g.c[1], g.c[2], NULL };
    rank_arg args[MAXR];
    run_on(R, live, do_barrier, NULL, args);
    ck_assert_int_eq(args[0].rc, SCAPE_TIMEOUT);
    ck_assert_msg(strstr(args[0].err, "rank 3 sent nothing"), "%s", args[0].err);
    for (int r = 1; r < R - 1; r++) {
        ck_assert_int_eq(args[r].rc, SCAPE_TIMEOUT);
        ck_assert_msg(strstr(args[r].err, "rank 3 failed, as rank 0 reported") &&
                          strstr(args[r].err, "rank 3 sent nothing") &&
                          !strstr(args[r].err, "rank 0 sent nothing"), "%s", args[r].err);
    }
    /* the comms refuse what follows with the same culprit */
    ck_assert_int_eq(comm_barrier(g.c[1]), SCAPE_TIMEOUT);
    ck_assert_msg(strstr(scape_last_error(), "rank 3 failed"), "%s", scape_last_error());
    group_close(&g, R);
}
END_TEST

/* ---- a stop request during a wait ---------------------------------------- */

static volatile int s_stop_flag;
static int stop_flag(void) { return s_stop_flag; }

static void nap_ms(long ms) { nanosleep(&(struct timespec){ ms / 1000, ms % 1000 * 1000000L }, NULL); }

/* Rank 0 runs three barriers at once; rank 1 comes to each 600 ms late. */
static scape_rc late_barriers(rank_arg *a)
{
    for (int i = 0; i < 3; i++) {
        if (a->rank == 1)
            nap_ms(600);
        TRY(comm_barrier(a->comm));
    }
    return SCAPE_OK;
}

/* With the stop requested before the first barrier, rank 0 still finishes
 * all three (1.8 s in all): each wait makes progress within the grace. */
START_TEST(stop_lets_a_progressing_wait_finish)
{
    group g;
    group_open(&g, 2, 7, 20000);
    s_stop_flag = 1;
    comm_set_interrupt(stop_flag);
    rank_arg args[MAXR];
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    run_on(2, g.c, late_barriers, NULL, args);
    double waited = since(&t0);
    comm_set_interrupt(NULL);
    expect_ok(2, args, "host");
    ck_assert_msg(waited > 1.0 + 1e-3 * COMM_STOP_GRACE_MS / 2, "waited %.3f s", waited);
    group_close(&g, 2);
}
END_TEST

/* Rank 1 never comes: after the stop request rank 0 gives up once the wait
 * has made no progress for the grace, long before the 20 s timeout. */
START_TEST(stop_gives_up_a_stalled_wait)
{
    group g;
    group_open(&g, 2, 7, 20000);
    comm_t *live[MAXR] = { g.c[0], NULL };
    s_stop_flag = 1;
    comm_set_interrupt(stop_flag);
    rank_arg args[MAXR];
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    run_on(2, live, do_barrier, NULL, args);
    double waited = since(&t0);
    comm_set_interrupt(NULL);
    ck_assert_int_eq(args[0].rc, SCAPE_REMOTE);
    ck_assert_msg(strstr(args[0].err, "shutting down and the wait made no progress"), "%s",
                  args[0].err);
    ck_assert_msg(waited >= 1e-3 * COMM_STOP_GRACE_MS && waited < 10.0, "waited %.3f s",
                  waited);
    group_close(&g, 2);
}
END_TEST

/* ---- a rank of this job that breaks the schedule -------------------------- */

/* A raw PUSH socket at rank 0 of g (free: zmq_close, zmq_ctx_term). */
static void *forger(const group *g, void **zctx)
{
    *zctx = zmq_ctx_new();
    void *push = zmq_socket(*zctx, ZMQ_PUSH);
    int linger = 0;
    ck_assert_int_eq(zmq_setsockopt(push, ZMQ_LINGER, &linger, sizeof linger), 0);
    ck_assert_int_eq(zmq_connect(push, g->ep[0]), 0);
    return push;
}

/* One message of this job, job 7, as rank `sender` would frame it. */
static void forge(void *push, uint16_t kind, uint16_t sender, uint64_t chunk, const void *body,
                  size_t len)
{
    wire_hdr h = { .job = 7, .seq = 0, .chunk = chunk, .magic = HOST_MAGIC, .kind = kind,
                   .sender = sender };
    ck_assert_int_eq(zmq_send(push, &h, sizeof h, ZMQ_SNDMORE), (int)sizeof h);
    ck_assert_int_eq(zmq_send(push, body, len, 0), (int)len);
}

/* Rank 0 of a fresh group runs a reduce-scatter of 2 x 50 floats while a raw
 * socket, posing as rank `sender` of the job, sends it one message; rank 0
 * must fail with PROTO and `want` in the message, long before the timeout. */
static void forged_part(uint16_t kind, uint16_t sender, uint64_t chunk, size_t floats,
                        const char *want)
{
    group g;
    group_open(&g, 2, 7, 20000);
    void *zctx, *push = forger(&g, &zctx);
    float body[64] = { 0 };
    forge(push, kind, sender, chunk, body, floats * sizeof *body);
    float x[100] = { 0 };
    size_t counts[2] = { 50, 50 };
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    scape_rc rc = comm_reduce_scatter_sum(g.c[0], x, x, counts);
    ck_assert_int_eq(rc, SCAPE_PROTO);
    ck_assert_msg(strstr(scape_last_error(), want), "%s", scape_last_error());
    ck_assert_msg(since(&t0) < 10.0, "took %.1f s", since(&t0));
    /* and the comm refuses what follows instead of running on */
    ck_assert_int_eq(comm_barrier(g.c[0]), SCAPE_PROTO);
    zmq_close(push);
    zmq_ctx_term(zctx);
    group_close(&g, 2);
}

START_TEST(schedule_breakers_are_refused)
{
    forged_part(K_RS_PART, 1, 0, 3, "wrong length");     /* a part of 3 floats, not 50 */
    forged_part(K_RS_PART, 1, 1, 50, "out of order or past"); /* chunk 1 of 1 */
    forged_part(K_AG, 1, 0, 50, "unexpected message");
    forged_part(99, 1, 0, 50, "unknown kind");
    forged_part(K_RS_PART, 0, 0, 50, "impossible sender"); /* rank 0 from outside */
    forged_part(K_RS_PART, 5, 0, 50, "impossible sender"); /* no rank 5 of 2 */
}
END_TEST

/* A bad chunk of the asynchronous all-gather fails its wait with PROTO, and
 * the message is freed once (it was freed twice on this path: run this
 * under ASan). */
START_TEST(bad_async_chunk_is_refused)
{
    group g;
    group_open(&g, 2, 7, 20000);
    void *zctx, *push = forger(&g, &zctx);
    forge(push, K_IAG, 1, 0, "abc", 3); /* 3 bytes of rank 1's 64 */
    unsigned char send[64] = { 0 }, recv[128];
    size_t counts[2] = { 64, 64 };
    ck_assert_int_eq(comm_iallgather(g.c[0], send, recv, counts), SCAPE_OK);
    ck_assert_int_eq(comm_iallgather_wait(g.c[0]), SCAPE_PROTO);
    ck_assert_msg(strstr(scape_last_error(), "wrong length"), "%s", scape_last_error());
    ck_assert_int_eq(comm_barrier(g.c[0]), SCAPE_PROTO);
    zmq_close(push);
    zmq_ctx_term(zctx);
    group_close(&g, 2);
}
END_TEST

/* Failure reports rank 0 of three cannot act on (about itself, about their
 * sender, naming rank 7, from rank 9) are counted and dropped, and barriers
 * go on; then one from rank 1 about rank 2 fails rank 0's next wait,
 * naming rank 2 and rank 1, with rank 1's text. */
START_TEST(failure_reports_are_checked)
{
    static const char why[] = "rank 2 sent nothing for 9 ms during barrier (op 0)";
    group g;
    group_open(&g, 3, 7, 20000);
    void *zctx, *push = forger(&g, &zctx);
    forge(push, K_FAIL, 1, 0, why, sizeof why - 1);
    forge(push, K_FAIL, 1, 1, why, sizeof why - 1);
    forge(push, K_FAIL, 1, 7, why, sizeof why - 1);
    forge(push, K_FAIL, 9, 2, why, sizeof why - 1);
    rank_arg args[MAXR];
    for (int i = 0; i < 200 && comm_host_reports_ignored(g.c[0], NULL, 0) < 4; i++) {
        run_on(3, g.c, do_barrier, NULL, args);
        expect_ok(3, args, "host");
        nanosleep(&(struct timespec){ 0, 5000000 }, NULL);
    }
    char last[160];
    ck_assert_uint_eq(comm_host_reports_ignored(g.c[0], last, sizeof last), 4);
    ck_assert_msg(strstr(last, "from rank 9 that rank 2"), "%s", last);
    forge(push, K_FAIL, 1, 2, why, sizeof why - 1);
    /* (rank 0's own timeout would name whom it waited for, in its own words) */
    ck_assert_int_eq(comm_barrier(g.c[0]), SCAPE_TIMEOUT);
    ck_assert_msg(strstr(scape_last_error(), "rank 2 failed, as rank 1 reported") &&
                      strstr(scape_last_error(), why), "%s", scape_last_error());
    zmq_close(push);
    zmq_ctx_term(zctx);
    group_close(&g, 3);
}
END_TEST

/* Barriers on both ranks of g until rank 0 has dropped `want` foreign
 * messages (they come over other connections, in no fixed order). */
static void barriers_until_foreign(group *g, uint64_t want)
{
    rank_arg args[MAXR];
    for (int i = 0; i < 200 && comm_foreign(g->c[0], NULL, 0) < want; i++) {
        run_on(2, g->c, do_barrier, NULL, args);
        for (int r = 0; r < 2; r++)
            ck_assert_msg(args[r].rc == SCAPE_OK, "rank %d: %s", r, args[r].err);
        nanosleep(&(struct timespec){ 0, 5000000 }, NULL);
    }
    ck_assert_uint_eq(comm_foreign(g->c[0], NULL, 0), want);
}

/* What cannot come from a rank of this job is dropped and counted, and the
 * job goes on: a comm of job 99 whose "rank 1" is rank 0 of job 7 (its
 * broadcast lands in job 7's barriers), then a raw ZeroMQ peer's frames. */
START_TEST(foreign_messages_are_dropped)
{
    group g, rogue;
    group_open(&g, 2, 7, 5000);
    group_open(&rogue, 2, 99, 5000);
    comm_destroy(&rogue.c[1]);
    comm_destroy(&rogue.c[0]);
    const char *eps[2] = { rogue.ep[0], g.ep[0] };
    comm_host_opts o = { .rank = 0, .size = 2, .endpoints = eps, .timeout_ms = 5000,
                         .chunk_bytes = CHUNK, .job = 99 };
    comm_t *bad = NULL;
    ck_assert_int_eq(comm_host_create(&o, &bad), SCAPE_OK);
    char payload[10] = "intruder", why[200];
    ck_assert_int_eq(comm_broadcast(bad, payload, sizeof payload, 0), SCAPE_OK);
    barriers_until_foreign(&g, 1);
    comm_foreign(g.c[0], why, sizeof why);
    ck_assert_msg(strstr(why, "job 99") && strstr(why, "this is job 7"), "%s", why);

    void *zctx, *push = forger(&g, &zctx);
    unsigned char hdr[32];
    memset(hdr, 0xA5, sizeof hdr); /* the right size, a wrong magic number */
    ck_assert_int_eq(zmq_send(push, "garbage", 7, 0), 7);                  /* one frame */
    ck_assert_int_eq(zmq_send(push, hdr, sizeof hdr, ZMQ_SNDMORE), 32);    /* three */
    ck_assert_int_eq(zmq_send(push, "x", 1, ZMQ_SNDMORE), 1);
    ck_assert_int_eq(zmq_send(push, "y", 1, 0), 1);
    ck_assert_int_eq(zmq_send(push, hdr, sizeof hdr, ZMQ_SNDMORE), 32);    /* bad magic */
    ck_assert_int_eq(zmq_send(push, "z", 1, 0), 1);
    barriers_until_foreign(&g, 4);
    comm_foreign(g.c[0], why, sizeof why);
    ck_assert_msg(strstr(why, "magic") != NULL, "%s", why);

    /* The job's own collectives still agree bit for bit. */
    rank_arg args[MAXR];
    run_on(2, g.c, do_allreduce, NULL, args);
    for (int r = 0; r < 2; r++)
        ck_assert_msg(args[r].rc == SCAPE_OK, "rank %d: %s", r, args[r].err);
    ck_assert_uint_eq(comm_foreign(g.c[1], NULL, 0), 0);
    zmq_close(push);
    zmq_ctx_term(zctx);
    comm_destroy(&bad);
    group_close(&g, 2);
}
END_TEST

/* Two ranks: what one sent is what the other received, and it is the
 * ring's traffic: each way, half the vector for the reduce-scatter and half
 * for the all-gather (2 * (R-1)/R * 4n bytes), plus a header per chunk. */
START_TEST(wire_counters_balance)
{
    group g;
    group_open(&g, 2, 7, 5000);
    rank_arg args[MAXR];
    run_on(2, g.c, do_allreduce, NULL, args);
    expect_ok(2, args, "host");
    uint64_t s0, r0, s1, r1;
    ck_assert_int_eq(comm_host_wire_stats(g.c[0], &s0, &r0), SCAPE_OK);
    ck_assert_int_eq(comm_host_wire_stats(g.c[1], &s1, &r1), SCAPE_OK);
    ck_assert_uint_eq(s0, r1);
    ck_assert_uint_eq(s1, r0);
    /* rank 0: its part of rank 1's segment 2000 + its segment 2000 out, and
     * the same in; rank 1 alike */
    uint64_t all[4] = { s0, r0, s1, r1 };
    for (int i = 0; i < 4; i++) {
        ck_assert_uint_ge(all[i], 4000);
        ck_assert_uint_le(all[i], 4000 + 4 * 64);
    }
    group_close(&g, 2);
}
END_TEST

/* ---- binding first: the kernel picks the ports, meet() publishes them ---- */

typedef struct meet_table {
    pthread_barrier_t all_bound;
    char ep[MAXR][64];
    const char *eps[MAXR];
    int fail_rank;              /* this rank's meet fails (-1: none) */
} meet_table;

typedef struct meet_arg {
    meet_table *t;
    int rank, R;
    const char *listen;
    comm_t *c;
    scape_rc rc;
    char err[512];
} meet_arg;

static scape_rc meet_here(void *arg, const char *bound, const char *const **eps,
                          const char *const **keys)
{
    *keys = NULL;
    meet_arg *m = arg;
    snprintf(m->t->ep[m->rank], sizeof m->t->ep[m->rank], "%s", bound);
    pthread_barrier_wait(&m->t->all_bound);
    if (m->rank == m->t->fail_rank)
        return scape_set_error(SCAPE_TIMEOUT, "rendezvous: rank 0 never answered");
    *eps = m->t->eps;
    return SCAPE_OK;
}

static void *meet_main(void *p)
{
    meet_arg *m = p;
    comm_host_opts o = { .rank = m->rank, .size = m->R, .listen = m->listen, .meet = meet_here,
                         .meet_arg = m, .timeout_ms = 10000, .chunk_bytes = CHUNK, .job = 7 };
    m->rc = comm_host_create(&o, &m->c);
    if (m->rc != SCAPE_OK)
        snprintf(m->err, sizeof m->err, "%s", scape_last_error());
    return NULL;
}

static void meet_group(int R, const char *listen, int fail_rank, meet_table *t, meet_arg *m)
{
    pthread_t th[MAXR];
    t->fail_rank = fail_rank;
    ck_assert_int_eq(pthread_barrier_init(&t->all_bound, NULL, (unsigned)R), 0);
    for (int r = 0; r < R; r++) {
        t->eps[r] = t->ep[r];
        m[r] = (meet_arg){ .t = t, .rank = r, .R = R, .listen = listen };
        ck_assert_int_eq(pthread_create(&th[r], NULL, meet_main, &m[r]), 0);
    }
    for (int r = 0; r < R; r++)
        pthread_join(th[r], NULL);
    pthread_barrier_destroy(&t->all_bound);
}

/* Every rank binds port '*'; what meet() hears is a real port, distinct per
 * rank, and the group built on those computes what the local backend does,
 * byte for byte. */
START_TEST(ports_picked_by_the_kernel_are_met)
{
    const int R = 3;
    meet_table t;
    meet_arg m[MAXR];
    meet_group(R, "tcp://127.0.0.1:*", -1, &t, m);
    comm_t *c[MAXR];
    for (int r = 0; r < R; r++) {
        ck_assert_msg(m[r].rc == SCAPE_OK, "rank %d: %s", r, m[r].err);
        c[r] = m[r].c;
        int port = 0;
        ck_assert_msg(sscanf(t.ep[r], "tcp://127.0.0.1:%d", &port) == 1 && port > 0,
                      "rank %d bound %s", r, t.ep[r]);
        for (int q = 0; q < r; q++)
            ck_assert_str_ne(t.ep[q], t.ep[r]);
    }
    compare_backends_on(R, 5000, c);
    for (int r = 0; r < R; r++)
        comm_destroy(&c[r]);
}
END_TEST

/* Listening on every interface cannot be published (peers would connect to
 * 0.0.0.0): refused before meet() runs, naming the remedy.  A failing meet()
 * fails the create with its own error, and leaves nothing behind. */
START_TEST(unpublishable_listen_and_failed_meet)
{
    meet_table t;
    meet_arg m[MAXR];
    pthread_barrier_init(&t.all_bound, NULL, 1);
    m[0] = (meet_arg){ .t = &t, .rank = 0, .R = 2, .listen = "tcp://*:*" };
    t.fail_rank = -1;
    meet_main(&m[0]);
    pthread_barrier_destroy(&t.all_bound);
    ck_assert_int_eq(m[0].rc, SCAPE_INVALID);
    ck_assert_ptr_null(m[0].c);
    ck_assert_msg(strstr(m[0].err, "listens on every interface") &&
                  strstr(m[0].err, "tcp://0.0.0.0:"), "%s", m[0].err);

    meet_group(2, "tcp://127.0.0.1:*", 1, &t, m);
    ck_assert_msg(m[0].rc == SCAPE_OK, "%s", m[0].err);
    ck_assert_int_eq(m[1].rc, SCAPE_TIMEOUT);
    ck_assert_ptr_null(m[1].c);
    ck_assert_ptr_nonnull(strstr(m[1].err, "never answered"));
    comm_destroy(&m[0].c);

    comm_host_opts o = { .rank = 0, .size = 2, .meet = meet_here }; /* no listen */
    comm_t *c = NULL;
    ck_assert_int_eq(comm_host_create(&o, &c), SCAPE_INVALID);
}
END_TEST

START_TEST(bad_arguments)
{
    const char *eps[2] = { "tcp://127.0.0.1:1", NULL };
    comm_host_opts o = { .rank = 0, .size = 2, .endpoints = eps };
    comm_t *c = NULL, *l[1];
    uint64_t s, r;
    ck_assert_int_eq(comm_host_create(NULL, &c), SCAPE_INVALID);
    ck_assert_int_eq(comm_host_create(&o, NULL), SCAPE_INVALID);
    ck_assert_int_eq(comm_host_create(&o, &c), SCAPE_INVALID); /* endpoint 1 is NULL */
    eps[1] = "nonsense";
    o.rank = 2;
    ck_assert_int_eq(comm_host_create(&o, &c), SCAPE_INVALID);
    o.rank = 0;
    o.chunk_bytes = 2;
    ck_assert_int_eq(comm_host_create(&o, &c), SCAPE_INVALID);
    o.chunk_bytes = 0;
    eps[0] = "nonsense";
    ck_assert_int_eq(comm_host_create(&o, &c), SCAPE_ZMQ);
    ck_assert_ptr_null(c);
    ck_assert_int_eq(comm_local_create(1, l), SCAPE_OK);
    ck_assert_int_eq(comm_host_wire_stats(l[0], &s, &r), SCAPE_INVALID);
    comm_destroy(&l[0]);
}
END_TEST

int main(void)
{
    srand((unsigned)getpid() ^ (unsigned)time(NULL));
    Suite *s = suite_create("comm_host");
    TCase *tc = tcase_create("host");
    tcase_set_timeout(tc, 600);
    tcase_add_loop_test(tc, small_sizes_match_local, 0, NSIZES);
    tcase_add_loop_test(tc, megabytes_match_local, 0, NSIZES);
    tcase_add_checked_fixture(tc, plain_tcp, NULL);
    tcase_add_loop_test(tc, curve_groups_match_local, 1, 4); /* R = 2, 3, 4 */
    tcase_add_test(tc, curve_refuses_strangers);
    tcase_add_test(tc, killed_peer_times_out_naming_it);
    tcase_add_test(tc, barrier_names_missing_rank);
    tcase_add_test(tc, dead_rank_is_named_not_the_rank_waited_for);
    tcase_add_test(tc, foreign_messages_are_dropped);
    tcase_add_test(tc, wire_counters_balance);
    tcase_add_test(tc, bad_arguments);
    tcase_add_test(tc, stop_lets_a_progressing_wait_finish);
    tcase_add_test(tc, stop_gives_up_a_stalled_wait);
    tcase_add_test(tc, schedule_breakers_are_refused);
    tcase_add_test(tc, bad_async_chunk_is_refused);
    tcase_add_test(tc, failure_reports_are_checked);
    tcase_add_test(tc, ports_picked_by_the_kernel_are_met);
    tcase_add_test(tc, unpublishable_listen_and_failed_meet);
    suite_add_tcase(s, tc);
    return check_run(s);
}
