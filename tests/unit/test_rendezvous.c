/* test_rendezvous.c - daemons finding each other over loopback TCP: the
 * table and blob every rank receives, a rank that never comes, another
 * job's daemon, a coordinator that is not there; the seals of auth secret
 * (a rank with another key), CURVE keys handed to all; and Slurm's
 * environment. */
#define _POSIX_C_SOURCE 200809L
#define _GNU_SOURCE /* memmem */
#include <arpa/inet.h>
#include <check.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "auth.h"
#include "rendezvous.h"
#include "check_run.h"

#define MAX_R 8

typedef struct rank_case {
    rdv_opts o;
    rdv_result res;
    scape_rc rc;
    char err[512];
    char endpoint[64];
} rank_case;

/* A free loopback port: bind to "*", read it back, release it. */
static void free_endpoint(char *buf, size_t len)
{
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_REP);
    ck_assert_int_eq(zmq_bind(s, "tcp://127.0.0.1:*"), 0);
    size_t n = len;
    ck_assert_int_eq(zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, buf, &n), 0);
    zmq_close(s);
    zmq_ctx_term(ctx);
}

static void *rank_main(void *p)
{
    rank_case *c = p;
    c->rc = rdv_run(&c->o, &c->res);
    snprintf(c->err, sizeof c->err, "%s", scape_last_error());
    return NULL;
}

/* Run ranks [0, world) except `absent`; rank `stranger` uses another job;
 * rank 0 (the coordinator) starts late0_ms after the others. */
static void run(rank_case *cs, int world, int absent, int stranger, int timeout_ms, int late0_ms)
{
    char coord[64];
    free_endpoint(coord, sizeof coord);
    static const char blob[] = "nccl-unique-id-stand-in";
    pthread_t th[MAX_R];
    for (int r = 0; r < world; r++) {
        rank_case *c = &cs[r];
        memset(c, 0, sizeof *c);
        snprintf(c->endpoint, sizeof c->endpoint, "tcp://127.0.0.1:%d", 40000 + r);
        c->o = (rdv_opts){ .rank = r, .world = world, .coordinator = coord,
                           .endpoint = c->endpoint, .job = r == stranger ? 99 : 7,
                           .timeout_ms = timeout_ms };
        if (r == 0) {
            c->o.blob = blob;
            c->o.blob_len = sizeof blob;
        }
    }
    for (int r = world - 1; r >= 0; r--) {
        if (r == 0 && late0_ms > 0)
            nanosleep(&(struct timespec){ late0_ms / 1000, (late0_ms % 1000) * 1000000L }, NULL);
        if (r != absent)
            ck_assert_int_eq(pthread_create(&th[r], NULL, rank_main, &cs[r]), 0);
    }
    for (int r = 0; r < world; r++)
        if (r != absent)
            pthread_join(th[r], NULL);
}

START_TEST(table_reaches_every_rank)
{
    static const int worlds[] = { 1, 2, 3, 4, 8 };
    for (size_t w = 0; w < sizeof worlds / sizeof worlds[0]; w++) {
        int world = worlds[w];
        rank_case cs[MAX_R];
        run(cs, world, -1, -1, 10000, 0);
        for (int r = 0; r < world; r++) {
            ck_assert_msg(cs[r].rc == SCAPE_OK, "world %d rank %d: %s", world, r, cs[r].err);
            ck_assert_int_eq(cs[r].res.world, world);
            for (int k = 0; k < world; k++)
                ck_assert_str_eq(cs[r].res.endpoints[k], cs[k].endpoint);
            ck_assert_uint_eq(cs[r].res.blob_len, sizeof "nccl-unique-id-stand-in");
            ck_assert_str_eq((const char *)cs[r].res.blob, "nccl-unique-id-stand-in");
            rdv_result_free(&cs[r].res);
        }
    }
}
END_TEST

/* The other ranks keep trying while the coordinator is not up yet (a
 * daemon that srun starts last): all of them get the table. */
START_TEST(late_coordinator_is_waited_for)
{
    rank_case cs[3];
    run(cs, 3, -1, -1, 10000, 1500);
    for (int r = 0; r < 3; r++) {
        ck_assert_msg(cs[r].rc == SCAPE_OK, "rank %d: %s", r, cs[r].err);
        ck_assert_str_eq(cs[r].res.endpoints[2], cs[2].endpoint);
        rdv_result_free(&cs[r].res);
    }
}
END_TEST

START_TEST(missing_rank_is_named)
{
    rank_case cs[4];
    run(cs, 4, 2, -1, 400, 0);
    ck_assert_int_eq(cs[0].rc, SCAPE_TIMEOUT);
    ck_assert_msg(strstr(cs[0].err, "rank(s) 2 never joined") != NULL, "%s", cs[0].err);
    for (int r = 1; r < 4; r += 2) {
        ck_assert_int_eq(cs[r].rc, SCAPE_TIMEOUT);
        ck_assert_msg(strstr(cs[r].err, "did not answer") != NULL, "%s", cs[r].err);
    }
}
END_TEST

START_TEST(another_job_is_refused)
{
    rank_case cs[3];
    run(cs, 3, -1, 1, 400, 0);
    ck_assert_int_eq(cs[1].rc, SCAPE_INVALID);
    ck_assert_msg(strstr(cs[1].err, "job 99 is not this job (7)") != NULL, "%s", cs[1].err);
    ck_assert_int_eq(cs[0].rc, SCAPE_TIMEOUT);
    ck_assert_msg(strstr(cs[0].err, "rank(s) 1 never joined") != NULL, "%s", cs[0].err);
}
END_TEST

START_TEST(no_coordinator)
{
    rank_case cs[2];
    run(cs, 2, 0, -1, 300, 0);
    ck_assert_int_eq(cs[1].rc, SCAPE_TIMEOUT);
    ck_assert_msg(strstr(cs[1].err, "rank 0 at tcp://127.0.0.1:") != NULL, "%s", cs[1].err);
}
END_TEST

START_TEST(bad_options)
{
    rdv_result res;
    rdv_opts o = { .rank = 2, .world = 2, .coordinator = "tcp://127.0.0.1:1",
                   .endpoint = "tcp://x:1", .timeout_ms = 100 };
    ck_assert_int_eq(rdv_run(&o, &res), SCAPE_INVALID);
    o.rank = 0;
    o.timeout_ms = 0;
    ck_assert_int_eq(rdv_run(&o, &res), SCAPE_INVALID);
    o.timeout_ms = 100;
    o.blob_len = RDV_BLOB_MAX + 1;
    o.blob = "x";
    ck_assert_int_eq(rdv_run(&o, &res), SCAPE_INVALID);
    ck_assert_int_eq(rdv_run(NULL, &res), SCAPE_INVALID);
}
END_TEST

static void expect_host(const char *list, const char *want)
{
    char host[64];
    ck_assert_msg(rdv_first_host(list, host, sizeof host) == SCAPE_OK, "%s: %s", list,
                  scape_last_error());
    ck_assert_str_eq(host, want);
}

/* Two key files in a fresh directory: the job's and another. */
static void two_keys(char *dir, char *good, char *bad, size_t len)
{
    snprintf(dir, len, "/tmp/rdv-keys-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(good, len, "%s/job.key", dir);
    snprintf(bad, len, "%s/other.key", dir);
    ck_assert_int_eq(auth_keygen(good), SCAPE_OK);
    ck_assert_int_eq(auth_keygen(bad), SCAPE_OK);
}

static void remove_keys(const char *dir, const char *good, const char *bad)
{
    unlink(good);
    unlink(bad);
    rmdir(dir);
}

/* auth secret: four ranks with the job's key, each publishing a CURVE key,
 * all get every endpoint and every key; then a rank with another key is
 * refused with the reason and rank 0 names it as never joined. */
START_TEST(sealed_meeting_hands_out_keys)
{
    char dir[64], good[96], bad[96];
    two_keys(dir, good, bad, sizeof dir);
    auth_ctx *a[MAX_R] = { 0 }, *other = NULL;
    char pub[MAX_R][41], sec[41];
    rank_case cs[MAX_R];
    for (int r = 0; r < 4; r++) {
        ck_assert_int_eq(auth_create(AUTH_SECRET, good, NULL, &a[r]), SCAPE_OK);
        ck_assert_int_eq(zmq_curve_keypair(pub[r], sec), 0);
    }
    ck_assert_int_eq(auth_create(AUTH_SECRET, bad, NULL, &other), SCAPE_OK);
    for (int round = 0; round < 2; round++) {
        char coord[64];
        free_endpoint(coord, sizeof coord);
        pthread_t th[MAX_R];
        for (int r = 0; r < 4; r++) {
            rank_case *c = &cs[r];
            memset(c, 0, sizeof *c);
            snprintf(c->endpoint, sizeof c->endpoint, "tcp://127.0.0.1:%d", 41000 + r);
            c->o = (rdv_opts){ .rank = r, .world = 4, .coordinator = coord,
                               .endpoint = c->endpoint, .job = 7, .timeout_ms = 3000,
                               .auth = round == 1 && r == 2 ? other : a[r],
                               .curve_key = pub[r] };
            ck_assert_int_eq(pthread_create(&th[r], NULL, rank_main, c), 0);
        }
        for (int r = 0; r < 4; r++)
            pthread_join(th[r], NULL);
        for (int r = 0; r < 4; r++) {
            if (round == 0) {
                ck_assert_msg(cs[r].rc == SCAPE_OK, "rank %d: %s", r, cs[r].err);
                ck_assert_ptr_nonnull(cs[r].res.keys);
                for (int k = 0; k < 4; k++) {
                    ck_assert_str_eq(cs[r].res.keys[k], pub[k]);
                    ck_assert_str_eq(cs[r].res.endpoints[k], cs[k].endpoint);
                }
            } else if (r == 2) {
                ck_assert_int_ne(cs[r].rc, SCAPE_OK);
                ck_assert_msg(strstr(cs[r].err, "rank 0 refused rank 2") &&
                                  strstr(cs[r].err, "another key"), "%s", cs[r].err);
            } else if (r == 0) {
                ck_assert_int_eq(cs[r].rc, SCAPE_TIMEOUT);
                ck_assert_msg(strstr(cs[r].err, "rank(s) 2 never joined"), "%s", cs[r].err);
            }
            rdv_result_free(&cs[r].res);
        }
    }
    for (int r = 0; r < 4; r++)
        auth_destroy(a[r]);
    auth_destroy(other);
    remove_keys(dir, good, bad);
}
END_TEST

/* The seals themselves: a round trip; another key; a replay; a message that
 * was never sealed; key files that are refused and why. */
START_TEST(seals_and_key_files)
{
    char dir[64], good[96], bad[96];
    two_keys(dir, good, bad, sizeof dir);
    auth_ctx *a = NULL, *b = NULL, *none = NULL;
    ck_assert_int_eq(auth_create(AUTH_SECRET, good, NULL, &a), SCAPE_OK);
    ck_assert_int_eq(auth_create(AUTH_SECRET, bad, NULL, &b), SCAPE_OK);
    ck_assert_int_eq(auth_create(AUTH_NONE, NULL, NULL, &none), SCAPE_OK);
    static const char msg[] = "a join of rank 3";
    uint8_t *sealed = NULL, *open = NULL;
    size_t sn = 0, on = 0;
    ck_assert_int_eq(auth_seal(a, msg, sizeof msg, 0, &sealed, &sn), SCAPE_OK);
    ck_assert_uint_gt(sn, sizeof msg);
    ck_assert_ptr_null(memmem(sealed, sn, "rank 3", 6)); /* encrypted */
    ck_assert_int_eq(auth_open(b, sealed, sn, &open, &on), SCAPE_INVALID);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "another key"));
    ck_assert_int_eq(auth_open(a, sealed, sn, &open, &on), SCAPE_OK);
    ck_assert_uint_eq(on, sizeof msg);
    ck_assert_mem_eq(open, msg, sizeof msg);
    free(open);
    ck_assert_int_eq(auth_open(a, sealed, sn, &open, &on), SCAPE_INVALID);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "replayed"));
    sealed[sn - 1] ^= 1;
    ck_assert_int_eq(auth_open(a, sealed, sn, &open, &on), SCAPE_INVALID);
    free(sealed);
    ck_assert_int_eq(auth_open(a, msg, sizeof msg, &open, &on), SCAPE_INVALID);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "not sealed"));
    ck_assert_int_eq(auth_seal(none, msg, sizeof msg, 1, &sealed, &sn), SCAPE_OK);
    ck_assert_int_eq(auth_open(none, sealed, sn, &open, &on), SCAPE_OK);
    ck_assert_mem_eq(open, msg, sizeof msg);
    free(sealed);
    free(open);
    /* key files */
    auth_ctx *x = NULL;
    ck_assert_int_eq(auth_keygen(good), SCAPE_SYSTEM);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "never overwritten"));
    ck_assert_int_eq(chmod(bad, 0640), 0);
    ck_assert_int_eq(auth_create(AUTH_SECRET, bad, NULL, &x), SCAPE_INVALID);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "can be read by others (mode 0640)"));
    ck_assert_int_eq(auth_create(AUTH_SECRET, dir, NULL, &x), SCAPE_INVALID);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "not a regular file"));
    ck_assert_int_eq(auth_create(AUTH_SECRET, "", NULL, &x), SCAPE_INVALID);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "scaped keygen"));
    FILE *f = fopen(bad, "w");
    ck_assert_ptr_nonnull(f);
    fputs("not a key\n", f);
    fclose(f);
    ck_assert_int_eq(chmod(bad, 0600), 0);
    ck_assert_int_eq(auth_create(AUTH_SECRET, bad, NULL, &x), SCAPE_INVALID);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "does not hold a key"));
    ck_assert_int_eq(auth_create(AUTH_MUNGE, NULL, "/nonexistent/munge.socket", &x),
                     SCAPE_UNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "no munged answers"));
    auth_destroy(a);
    auth_destroy(b);
    auth_destroy(none);
    remove_keys(dir, good, bad);
}
END_TEST

START_TEST(slurm_host_lists)
{
    expect_host("gh001", "gh001");
    expect_host("c1,c2", "c1");
    expect_host("n[1-4]", "n1");
    expect_host("gh[001-004,010],login1", "gh001");
    expect_host("a[3]", "a3");
    expect_host("rack[1-2]-n[1-3]", "rack1-n1");
    expect_host("rack[07,9]-n[010-012],x[1-2]", "rack07-n010");
    expect_host("c[1-2]-ib", "c1-ib");
    char host[8];
    ck_assert_int_eq(rdv_first_host("", host, sizeof host), SCAPE_INVALID);
    ck_assert_int_eq(rdv_first_host("n[x-2]", host, sizeof host), SCAPE_INVALID);
    ck_assert_int_eq(rdv_first_host("n[1-2", host, sizeof host), SCAPE_INVALID);
    ck_assert_int_eq(rdv_first_host("n]1", host, sizeof host), SCAPE_INVALID);
    ck_assert_int_eq(rdv_first_host("n[]", host, sizeof host), SCAPE_INVALID);
    ck_assert_int_eq(rdv_first_host(",n1", host, sizeof host), SCAPE_INVALID);
    ck_assert_int_eq(rdv_first_host("averyveryverylonghost", host, sizeof host), SCAPE_INVALID);
}
END_TEST

/* A dotted quad this host can be reached at (loopback only without any
 * other interface that is up). */
START_TEST(host_address)
{
    char ip[64];
    struct in_addr a;
    ck_assert_int_eq(rdv_host_address(ip, sizeof ip), SCAPE_OK);
    ck_assert_int_eq(inet_pton(AF_INET, ip, &a), 1);
    ck_assert_int_eq(rdv_host_address(ip, 4), SCAPE_SYSTEM);
}
END_TEST

START_TEST(slurm_environment)
{
    int rank, world;
    uint64_t job;
    char host[64];
    setenv("SLURM_PROCID", "3", 1);
    setenv("SLURM_NTASKS", "4", 1);
    setenv("SLURM_JOB_ID", "123456", 1);
    setenv("SLURM_JOB_NODELIST", "gh[010-013]", 1);
    unsetenv("SLURM_STEP_NODELIST");
    ck_assert_int_eq(rdv_from_slurm(&rank, &world, &job, host, sizeof host), SCAPE_OK);
    ck_assert_int_eq(rank, 3);
    ck_assert_int_eq(world, 4);
    ck_assert_uint_eq(job, 123456);
    ck_assert_str_eq(host, "gh010");
    setenv("SLURM_STEP_NODELIST", "n[7-8]", 1);
    ck_assert_int_eq(rdv_from_slurm(&rank, &world, &job, host, sizeof host), SCAPE_OK);
    ck_assert_str_eq(host, "n7");
    setenv("SLURM_PROCID", "4", 1);
    ck_assert_int_eq(rdv_from_slurm(&rank, &world, &job, host, sizeof host), SCAPE_INVALID);
    unsetenv("SLURM_NTASKS");
    ck_assert_int_eq(rdv_from_slurm(&rank, &world, &job, host, sizeof host), SCAPE_INVALID);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "SLURM_NTASKS"));
}
END_TEST

int main(void)
{
    Suite *s = suite_create("rendezvous");
    TCase *tc = tcase_create("rendezvous");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, table_reaches_every_rank);
    tcase_add_test(tc, late_coordinator_is_waited_for);
    tcase_add_test(tc, missing_rank_is_named);
    tcase_add_test(tc, another_job_is_refused);
    tcase_add_test(tc, no_coordinator);
    tcase_add_test(tc, bad_options);
    tcase_add_test(tc, sealed_meeting_hands_out_keys);
    tcase_add_test(tc, seals_and_key_files);
    tcase_add_test(tc, slurm_host_lists);
    tcase_add_test(tc, slurm_environment);
    tcase_add_test(tc, host_address);
    suite_add_tcase(s, tc);
    return check_run(s);
}
