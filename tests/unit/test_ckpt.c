/* test_ckpt.c - checkpoints of the engine on the local backend: for every
 * optimizer and mode, with uneven trainers per rank, saving after a warm-up
 * step, at the warm-up boundary and after sparse steps, then restoring into
 * fresh engines gives bitwise the parameters of an uninterrupted run, also
 * when the engine that saves and the one that restores run on different
 * executors; the
 * checksum catches any one changed word; and a checkpoint of other settings
 * is refused on every rank. */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt.h"
#include "rank_threads.h"
#include "check_run.h"

#define R 3
#define STEPS 12
#define MAX_TR 3

static const eng_tensor s_tensors[] = {
    { "a", 0, 700, 0 }, { "b", 700, 33, 0 }, { "c", 733, 1, 0 }, { "d", 734, 290, 0 },
};
#define NT (sizeof s_tensors / sizeof s_tensors[0])
#define NUMEL 1024

typedef struct job {
    eng_config cfg;
    eng_config restore_cfg; /* the settings the restoring engines run with */
    int save_at;            /* 0: uninterrupted */
    char root[256];
    float out[R][NUMEL];    /* trainer 0's parameters at the end, per rank */
    int expect_refusal;
    const char *refusal;    /* and what its message says, besides "refused" */
    int groups, restore_groups; /* parameter groups of make_engine: 0 none */
} job;

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

static float grad(int r, int j, uint64_t t, size_t i, float p)
{
    uint64_t h = mix((uint64_t)r * 1000003u + (uint64_t)j * 7919u + t * 104729u + i);
    return (float)((double)(h >> 11) / 9007199254740992.0 - 0.5) + 0.1f * p;
}

/* Parameter groups: 0 none; 1: "a" and "c" in group 0 (weight decay 0.1),
 * "b" and "d" in group 1 (0); 2: the same tensors, group 1's decay 0.05;
 * 3: "b" in group 0 too.  Group g's lr is (1 + g) * 1e-2. */
static scape_rc make_engine(rank_arg *a, const eng_config *cfg, int groups, eng_t **e)
{
    eng_tensor ts[NT];
    memcpy(ts, s_tensors, sizeof ts);
    eng_group g[2] = { { 0.1f }, { groups == 2 ? 0.05f : 0.0f } };
    for (size_t l = 0; groups && l < NT; l++)
        ts[l].group = groups == 3 && l == 1 ? 0 : (uint32_t)(l % 2);
    eng_layout lay = { ts, NT, KERN_F32, KERN_F32, groups ? g : NULL, groups ? 2 : 0 };
    return eng_create(e, cfg, &lay, a->comm, a->rank + 1);
}

static scape_rc steps(eng_t *e, rank_arg *a, uint64_t from, uint64_t to, float **g, float **p)
{
    for (uint64_t t = from; t <= to; t++) {
        for (int j = 0; j <= a->rank; j++)
            for (size_t i = 0; i < NUMEL; i++)
                g[j][i] = grad(a->rank, j, t, i, p[j][i]);
        const float lrs[2] = { 1e-2f, 2e-2f };
        scape_rc rc = eng_step_groups(e, t, lrs, (const void *const *)g, (void *const *)p);
        if (rc != SCAPE_OK)
            return rc;
    }
    return SCAPE_OK;
}

static scape_rc rank_job(rank_arg *a)
{
    job *jb = a->ctx;
    float *g[MAX_TR], *p[MAX_TR];
    for (int j = 0; j <= a->rank; j++) {
        g[j] = calloc(NUMEL, sizeof(float));
        p[j] = calloc(NUMEL, sizeof(float));
        for (size_t i = 0; i < NUMEL; i++)
            p[j][i] = (float)(j + 1) * 0.01f * (float)(i % 17); /* trainer 0's win */
    }
    eng_t *e = NULL;
    scape_rc rc = make_engine(a, &jb->cfg, jb->groups, &e);
    if (rc == SCAPE_OK)
        rc = eng_init_params(e, (void *const *)p);
    uint64_t upto = jb->save_at ? (uint64_t)jb->save_at : STEPS;
    if (rc == SCAPE_OK)
        rc = steps(e, a, 1, upto, g, p);
    if (rc == SCAPE_OK && jb->save_at) {
        uint64_t at = 0;
        rc = ckpt_save(jb->root, e, a->comm, 2, &at, NULL, 0);
        eng_destroy(&e);
        /* The trainers' buffers are lost with the job: scribble over them. */
        for (int j = 0; j <= a->rank; j++)
            memset(p[j], 0x7f, NUMEL * sizeof(float));
        ckpt_ref ref;
        if (rc == SCAPE_OK)
            rc = ckpt_open(jb->root, a->rank, R, &ref);
        if (rc == SCAPE_OK && ref.step != (uint64_t)jb->save_at)
            rc = scape_set_error(SCAPE_INVALID, "LATEST is step %llu", (unsigned long long)ref.step);
        if (rc == SCAPE_OK)
            rc = make_engine(a, &jb->restore_cfg, jb->restore_groups, &e);
        if (rc == SCAPE_OK)
            rc = ckpt_restore(&ref, e, a->comm, (void *const *)p);
        if (rc == SCAPE_OK)
            rc = steps(e, a, upto + 1, STEPS, g, p);
    }
    if (rc == SCAPE_OK)
        memcpy(jb->out[a->rank], p[0], sizeof jb->out[a->rank]);
    eng_destroy(&e);
    for (int j = 0; j <= a->rank; j++) {
        free(g[j]);
        free(p[j]);
    }
    return rc;
}

static void run_job(job *jb)
{
    rank_arg args[R];
    ck_assert_int_eq(run_ranks(R, rank_job, jb, args), 0);
    for (int r = 0; r < R; r++) {
        if (jb->expect_refusal) {
            ck_assert_msg(args[r].rc == SCAPE_INVALID, "rank %d: rc %d (%s)", r,
                          (int)args[r].rc, args[r].err);
            ck_assert_msg(strstr(args[r].err, "refused"), "rank %d: %s", r, args[r].err);
            if (jb->refusal)
                ck_assert_msg(strstr(args[r].err, jb->refusal), "rank %d: %s", r, args[r].err);
        } else {
            ck_assert_msg(args[r].rc == SCAPE_OK, "rank %d: %s", r, args[r].err);
        }
    }
}

static void temp_dir(char *root, size_t len)
{
    snprintf(root, len, "/tmp/scape-ckpt-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(root));
}

static void temp_root(job *jb) { temp_dir(jb->root, sizeof jb->root); }

static void remove_root(const char *root)
{
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    ck_assert_int_eq(system(cmd), 0);
}

/* Executors a checkpoint is saved with and restored on (exec.h). */
typedef struct exec_pair {
    eng_executor save, restore;
    int resident;  /* the sim's residual in device memory */
} exec_pair;

static void set_executor(eng_config *c, eng_executor x, int resident)
{
    c->executor = x;
    c->residual_on_device = resident;
    c->residual_chunk = 100; /* several chunks of the 1024 coordinates */
}

static void roundtrip_on(eng_optimizer opt, eng_mode mode, exec_pair ex)
{
    static job full, part;
    memset(&full, 0, sizeof full);
    eng_config_default(&full.cfg);
    full.cfg.optimizer = opt;
    full.cfg.mode = mode;
    full.cfg.rho = 0.05;
    full.cfg.warmup = 3;
    full.cfg.intake_chunk = 64;
    run_job(&full);
    for (int r = 1; r < R; r++)
        ck_assert_int_eq(memcmp(full.out[0], full.out[r], sizeof full.out[0]), 0);
    const int at[] = { 2, 3, 7 }; /* warm-up; the boundary; after sparse steps */
    for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
        memset(&part, 0, sizeof part);
        part.cfg = part.restore_cfg = full.cfg;
        set_executor(&part.cfg, ex.save, ex.resident);
        set_executor(&part.restore_cfg, ex.restore, ex.resident);
        part.save_at = at[k];
        temp_root(&part);
        run_job(&part);
        for (int r = 0; r < R; r++)
            ck_assert_msg(memcmp(full.out[r], part.out[r], sizeof full.out[r]) == 0,
                          "%s/%s: saved on %s, resumed on %s after step %d differs on "
                          "rank %d", eng_optimizer_name(opt), eng_mode_name(mode),
                          eng_executor_name(ex.save), eng_executor_name(ex.restore), at[k], r);
        remove_root(part.root);
    }
}

static void roundtrip(eng_optimizer opt, eng_mode mode)
{
    roundtrip_on(opt, mode, (exec_pair){ ENG_EXEC_HOST, ENG_EXEC_HOST, 0 });
}

START_TEST(roundtrip_every_optimizer_and_mode)
{
    for (int opt = 0; opt < ENG_OPT_COUNT; opt++)
        for (int mode = 0; mode < ENG_MODE_COUNT; mode++)
            roundtrip((eng_optimizer)opt, (eng_mode)mode);
}
END_TEST

/* A checkpoint written by one executor resumes on the other, bitwise the
 * uninterrupted host run: host -> sim, sim -> host (residual streamed from
 * pinned memory), and sim -> sim with the residual in device memory. */
START_TEST(checkpoints_cross_executors)
{
    const exec_pair pairs[] = { { ENG_EXEC_HOST, ENG_EXEC_SIM, 0 },
                                { ENG_EXEC_SIM, ENG_EXEC_HOST, 0 },
                                { ENG_EXEC_SIM, ENG_EXEC_SIM, 1 } };
    for (size_t q = 0; q < sizeof pairs / sizeof pairs[0]; q++)
        for (int opt = 0; opt < ENG_OPT_COUNT; opt++)
            for (int mode = 0; mode < ENG_MODE_COUNT; mode++)
                roundtrip_on((eng_optimizer)opt, (eng_mode)mode, pairs[q]);
}
END_TEST

START_TEST(other_settings_are_refused_on_every_rank)
{
    static job jb;
    memset(&jb, 0, sizeof jb);
    eng_config_default(&jb.cfg);
    jb.cfg.rho = 0.05;
    jb.cfg.warmup = 3;
    jb.restore_cfg = jb.cfg;
    jb.restore_cfg.rho = 0.1;
    jb.save_at = 5;
    jb.expect_refusal = 1;
    temp_root(&jb);
    run_job(&jb);
    remove_root(jb.root);
}
END_TEST

/* A checkpoint of parameter groups resumes bitwise under the same groups,
 * and is refused, saying why, under other groups, another group weight
 * decay, or none. */
START_TEST(parameter_groups_are_part_of_the_checkpoint)
{
    static job full, jb;
    memset(&full, 0, sizeof full);
    eng_config_default(&full.cfg);
    full.cfg.rho = 0.05;
    full.cfg.warmup = 3;
    full.groups = 1;
    run_job(&full);
    memset(&jb, 0, sizeof jb);
    jb.cfg = jb.restore_cfg = full.cfg;
    jb.groups = jb.restore_groups = 1;
    jb.save_at = 5;
    temp_root(&jb);
    run_job(&jb);
    for (int r = 0; r < R; r++)
        ck_assert_int_eq(memcmp(full.out[r], jb.out[r], sizeof full.out[r]), 0);
    remove_root(jb.root);
    for (int other = 0; other <= 3; other++) {
        if (other == 1)
            continue;
        memset(&jb, 0, sizeof jb);
        jb.cfg = jb.restore_cfg = full.cfg;
        jb.groups = 1;
        jb.restore_groups = other;
        jb.save_at = 5;
        jb.expect_refusal = 1;
        jb.refusal = "parameter groups";
        temp_root(&jb);
        run_job(&jb);
        remove_root(jb.root);
    }
}
END_TEST

/* split_above is hashed: a checkpoint of split tensors resumes bitwise
 * under the same split (sharded: the pieces' owners hold their state), and
 * is refused, naming the key, with another split or none; a checkpoint of
 * whole tensors is refused with a split. */
START_TEST(split_ranges_are_part_of_the_checkpoint)
{
    static job full, jb;
    for (int mode = 0; mode < ENG_MODE_COUNT; mode++) {
        memset(&full, 0, sizeof full);
        eng_config_default(&full.cfg);
        full.cfg.mode = (eng_mode)mode;
        full.cfg.rho = 0.05;
        full.cfg.warmup = 3;
        full.cfg.split_above = 100; /* a: 7 pieces, d: 3 */
        run_job(&full);
        memset(&jb, 0, sizeof jb);
        jb.cfg = jb.restore_cfg = full.cfg;
        jb.save_at = 5;
        temp_root(&jb);
        run_job(&jb);
        for (int r = 0; r < R; r++)
            ck_assert_int_eq(memcmp(full.out[r], jb.out[r], sizeof full.out[r]), 0);
        remove_root(jb.root);
    }
    const uint32_t saved[] = { 100, 100, 0 }, restored[] = { 0, 64, 100 };
    for (int q = 0; q < 3; q++) {
        memset(&jb, 0, sizeof jb);
        eng_config_default(&jb.cfg);
        jb.cfg.rho = 0.05;
        jb.cfg.warmup = 3;
        jb.restore_cfg = jb.cfg;
        jb.cfg.split_above = saved[q];
        jb.restore_cfg.split_above = restored[q];
        jb.save_at = 5;
        jb.expect_refusal = 1;
        jb.refusal = "split_above";
        temp_root(&jb);
        run_job(&jb);
        remove_root(jb.root);
    }
}
END_TEST

START_TEST(checksum_sees_every_word)
{
    unsigned char buf[4096];
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = (unsigned char)mix(i);
    uint64_t h = ckpt_hash(CKPT_HASH_SEED, buf, sizeof buf);
    /* Continuing over pieces of whole words is the same as one pass. */
    uint64_t h2 = ckpt_hash(ckpt_hash(CKPT_HASH_SEED, buf, 1024), buf + 1024, 3072);
    ck_assert_uint_eq(h, h2);
    for (int trial = 0; trial < 2000; trial++) {
        size_t at = mix((uint64_t)trial) % sizeof buf;
        unsigned char flip = (unsigned char)(1u + mix((uint64_t)trial + 99) % 255);
        buf[at] ^= flip;
        ck_assert_uint_ne(ckpt_hash(CKPT_HASH_SEED, buf, sizeof buf), h);
        buf[at] ^= flip;
    }
    /* A tail shorter than a word counts, and so does its length. */
    ck_assert_uint_ne(ckpt_hash(CKPT_HASH_SEED, buf, 13), ckpt_hash(CKPT_HASH_SEED, buf, 12));
    unsigned char z[9] = { 0 };
    ck_assert_uint_ne(ckpt_hash(CKPT_HASH_SEED, z, 9), ckpt_hash(CKPT_HASH_SEED, z, 8));
}
END_TEST

START_TEST(missing_checkpoints_are_named)
{
    ckpt_ref ref;
    ck_assert_int_ne(ckpt_open("/nonexistent/scape", 0, 1, &ref), SCAPE_OK);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "holds no checkpoint"));
    char root[64] = "/tmp/scape-ckpt-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(root));
    char latest[128];
    snprintf(latest, sizeof latest, "%s/LATEST", root);
    FILE *f = fopen(latest, "w");
    ck_assert_ptr_nonnull(f);
    fputs("step-5\n", f);
    fclose(f);
    ck_assert_int_ne(ckpt_open(root, 0, 1, &ref), SCAPE_OK);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "MANIFEST"));
    remove_root(root);
}
END_TEST


/* ---- what state_dicts hand out ---------------------------------------------------- */

typedef struct keep_job {
    char root[256];
    char dirs[7][CKPT_PATH_MAX]; /* the step directory of each step's checkpoint */
} keep_job;

/* One rank, one trainer: a checkpoint after each of steps 1..6 (keep 2), and
 * steps 1, 2 and 3's handed out by a state_dict right after they are taken. */
static scape_rc keep_rank(rank_arg *a)
{
    keep_job *kj = a->ctx;
    float *g = calloc(NUMEL, sizeof(float)), *p = calloc(NUMEL, sizeof(float));
    eng_config cfg;
    eng_config_default(&cfg);
    cfg.rho = 0.05;
    eng_t *e = NULL;
    scape_rc rc = g && p ? make_engine(a, &cfg, 0, &e) : SCAPE_NOMEM;
    if (rc == SCAPE_OK)
        rc = eng_init_params(e, (void *const *)&p);
    for (uint64_t t = 1; rc == SCAPE_OK && t <= 6; t++) {
        rc = steps(e, a, t, t, &g, &p);
        uint64_t at = 0;
        if (rc == SCAPE_OK)
            rc = ckpt_save(kj->root, e, a->comm, 2, &at, kj->dirs[t], sizeof kj->dirs[t]);
        if (rc == SCAPE_OK && t <= 3)
            rc = ckpt_mark_handed_out(kj->dirs[t]);
    }
    eng_destroy(&e);
    free(g);
    free(p);
    return rc;
}

static int exists(const char *root, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", root, name);
    return access(path, F_OK) == 0;
}

START_TEST(handed_out_checkpoints_outlive_the_newest_keep)
{
    static keep_job kj;
    memset(&kj, 0, sizeof kj);
    temp_dir(kj.root, sizeof kj.root);
    rank_arg args[1];
    ck_assert_int_eq(run_ranks(1, keep_rank, &kj, args), 0);
    ck_assert_msg(args[0].rc == SCAPE_OK, "%s", args[0].err);
    /* the newest 2 (5, 6) and the newest 2 handed out (2, 3); 1 and 4 go */
    const char *kept[] = { "step-2", "step-3", "step-5", "step-6" };
    for (size_t i = 0; i < 4; i++)
        ck_assert_msg(exists(kj.root, kept[i]), "%s was pruned", kept[i]);
    ck_assert(!exists(kj.root, "step-1") && !exists(kj.root, "step-4"));
    ck_assert_int_eq(ckpt_missing(kj.root, "step-1", 2), SCAPE_INVALID);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "was pruned: checkpoint_keep is 2"));
    ck_assert_int_eq(ckpt_missing(kj.root, "step-9", 2), SCAPE_INVALID);
    ck_assert_ptr_nonnull(strstr(scape_last_error(), "not in"));
    ck_assert_ptr_null(strstr(scape_last_error(), "was pruned"));

    /* names relative to the root, also through a trailing slash and a link */
    char name[64], root2[300], link[300];
    ckpt_relative(kj.root, kj.dirs[5], name, sizeof name);
    ck_assert_str_eq(name, "step-5");
    snprintf(root2, sizeof root2, "%s/", kj.root);
    ckpt_relative(root2, kj.dirs[6], name, sizeof name);
    ck_assert_str_eq(name, "step-6");
    snprintf(link, sizeof link, "%s-link", kj.root);
    ck_assert_int_eq(symlink(kj.root, link), 0);
    ckpt_relative(link, kj.dirs[3], name, sizeof name);
    ck_assert_str_eq(name, "step-3");
    ckpt_relative("/nonexistent/other", kj.dirs[3], name, sizeof name);
    ck_assert_str_eq(name, "");
    ck_assert_int_eq(unlink(link), 0);

    /* the request files of between-steps rounds */
    ck_assert(!ckpt_wanted(kj.root, 6, 0));
    ck_assert_int_eq(ckpt_want(kj.root, 6, 0), SCAPE_OK);
    ck_assert(ckpt_wanted(kj.root, 6, 0) && !ckpt_wanted(kj.root, 6, 1));
    ckpt_unwant(kj.root, 6, 0);
    ck_assert(!ckpt_wanted(kj.root, 6, 0));
    remove_root(kj.root);
}
END_TEST

/* ---- resharding: R ranks' checkpoint restored on another number ------------ */

typedef struct rs_job {
    eng_config cfg;
    char root[256];
    int restore;                 /* 0: train and save; 1: restore and continue */
    pthread_mutex_t lock;
    float m[NUMEL], theta[NUMEL], params[NUMEL];
    double res[NUMEL];           /* sum of every rank's residual */
    double res_abs[NUMEL];       /* and of their magnitudes: the rounding scale */
    unsigned char mask[NUMEL], have[NUMEL];
} rs_job;

static scape_rc collect(rank_arg *a, rs_job *jb, eng_t *e, const float *p0)
{
    float *buf = malloc(NUMEL * sizeof *buf);
    unsigned char *have = malloc(NUMEL);
    scape_rc rc = buf && have ? SCAPE_OK : scape_set_error(SCAPE_NOMEM, "out of memory");
    pthread_mutex_lock(&jb->lock);
    if (rc == SCAPE_OK)
        rc = eng_get_state(e, ENG_VEC_M, buf, have);
    for (size_t i = 0; rc == SCAPE_OK && i < NUMEL; i++)
        if (have[i]) {
            jb->m[i] = buf[i];
            jb->have[i] = 1;
        }
    if (rc == SCAPE_OK)
        rc = eng_get_state(e, ENG_VEC_THETA, buf, have);
    for (size_t i = 0; rc == SCAPE_OK && i < NUMEL; i++)
        if (have[i])
            jb->theta[i] = buf[i];
    if (rc == SCAPE_OK)
        rc = eng_get_residual(e, buf);
    for (size_t i = 0; rc == SCAPE_OK && i < NUMEL; i++) {
        jb->res[i] += buf[i];
        jb->res_abs[i] += fabs(buf[i]);
    }
    if (rc == SCAPE_OK && a->rank == 0) {
        rc = eng_get_mask(e, jb->mask);
        memcpy(jb->params, p0, sizeof jb->params);
    }
    pthread_mutex_unlock(&jb->lock);
    free(buf);
    free(have);
    return rc;
}

static scape_rc rank_reshard(rank_arg *a)
{
    rs_job *jb = a->ctx;
    float *g[MAX_TR], *p[MAX_TR];
    int tr = a->rank % 2 + 1;
    for (int j = 0; j < tr; j++) {
        g[j] = calloc(NUMEL, sizeof(float));
        p[j] = calloc(NUMEL, sizeof(float));
        for (size_t i = 0; i < NUMEL; i++)
            p[j][i] = 0.01f * (float)(i % 13);
    }
    eng_layout lay = { s_tensors, NT, KERN_F32, KERN_F32, NULL, 0 };
    eng_t *e = NULL;
    scape_rc rc = eng_create(&e, &jb->cfg, &lay, a->comm, tr);
    uint64_t t = 1;
    if (rc == SCAPE_OK && !jb->restore) {
        rc = eng_init_params(e, (void *const *)p);
        for (; rc == SCAPE_OK && t <= 7; t++) {
            for (int j = 0; j < tr; j++)
                for (size_t i = 0; i < NUMEL; i++)
                    g[j][i] = grad(a->rank, j, t, i, p[j][i]);
            rc = eng_step(e, t, 1e-2f, (const void *const *)g, (void *const *)p);
        }
        uint64_t at = 0;
        if (rc == SCAPE_OK)
            rc = ckpt_save(jb->root, e, a->comm, 2, &at, NULL, 0);
        if (rc == SCAPE_OK)
            rc = collect(a, jb, e, p[0]);
    } else if (rc == SCAPE_OK) {
        ckpt_ref ref;
        rc = ckpt_open(jb->root, a->rank, a->nranks, &ref);
        if (rc == SCAPE_OK && !ref.reshard)
            rc = scape_set_error(SCAPE_INVALID, "not resharded (world %u)", ref.world);
        if (rc == SCAPE_OK)
            rc = ckpt_restore(&ref, e, a->comm, (void *const *)p);
        if (rc == SCAPE_OK)
            rc = collect(a, jb, e, p[0]);
        /* ... and it trains on. */
        for (t = 8; rc == SCAPE_OK && t <= 12; t++) {
            for (int j = 0; j < tr; j++)
                for (size_t i = 0; i < NUMEL; i++)
                    g[j][i] = grad(a->rank, j, t, i, p[j][i]);
            rc = eng_step(e, t, 1e-2f, (const void *const *)g, (void *const *)p);
        }
    }
    eng_destroy(&e);
    for (int j = 0; j < tr; j++) {
        free(g[j]);
        free(p[j]);
    }
    return rc;
}

static void run_reshard(rs_job *jb, int R_)
{
    rank_arg args[8];
    pthread_mutex_init(&jb->lock, NULL);
    ck_assert_int_eq(run_ranks(R_, rank_reshard, jb, args), 0);
    for (int r = 0; r < R_; r++)
        ck_assert_msg(args[r].rc == SCAPE_OK, "%d ranks, rank %d: %s", R_, r, args[r].err);
    pthread_mutex_destroy(&jb->lock);
}

/* The leave markers: a rank marked idle or leaving is not missing; a new
 * mark replaces the old one (never both, never neither in between); no mark
 * removes it; other jobs' markers do not count; a cut list says so. */
START_TEST(leave_markers_are_counted_per_job)
{
    char root[64] = "/tmp/scape-ckpt-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(root));
    char missing[64];
    int leaving = -1;
    ck_assert_int_eq(ckpt_marks(root, 7, 3, &leaving, missing, sizeof missing), 3);
    ck_assert_str_eq(missing, "0, 1, 2");
    ck_assert_int_eq(leaving, 0);
    ck_assert_int_eq(ckpt_mark(root, 7, 1, CKPT_IDLE), SCAPE_OK);
    ck_assert_int_eq(ckpt_mark(root, 8, 0, CKPT_LEAVING), SCAPE_OK); /* another job */
    ck_assert_int_eq(ckpt_marks(root, 7, 3, &leaving, missing, sizeof missing), 2);
    ck_assert_str_eq(missing, "0, 2");
    ck_assert_int_eq(leaving, 0);
    ck_assert_int_eq(ckpt_mark(root, 7, 1, CKPT_LEAVING), SCAPE_OK);
    ck_assert_int_eq(ckpt_mark(root, 7, 0, CKPT_LEAVING), SCAPE_OK);
    ck_assert_int_eq(ckpt_marks(root, 7, 3, &leaving, missing, sizeof missing), 1);
    ck_assert_str_eq(missing, "2");
    ck_assert_int_eq(leaving, 2);
    char path[128];
    snprintf(path, sizeof path, "%s/.idle-7.1", root); /* replaced, not kept */
    ck_assert_int_ne(access(path, F_OK), 0);
    ck_assert_int_eq(ckpt_marks(root, 7, 3, &leaving, missing, 0), 1); /* any missing: 1 */
    ck_assert_int_eq(ckpt_mark(root, 7, 2, CKPT_IDLE), SCAPE_OK);
    ck_assert_int_eq(ckpt_marks(root, 7, 3, &leaving, missing, sizeof missing), 0);
    ck_assert_str_eq(missing, "");
    ck_assert_int_eq(ckpt_marks(root, 7, 3, &leaving, missing, 0), 0);
    for (int r = 0; r < 3; r++)
        ck_assert_int_eq(ckpt_mark(root, 7, r, CKPT_NO_MARK), SCAPE_OK);
    ck_assert_int_eq(ckpt_mark(root, 7, 2, CKPT_NO_MARK), SCAPE_OK); /* twice: still fine */
    ck_assert_int_eq(ckpt_marks(root, 7, 3, &leaving, missing, sizeof missing), 3);
    ck_assert_int_eq(leaving, 0);
    char small[8]; /* "0, 1, 2" does not fit in 7 characters and a NUL: cut */
    ck_assert_int_eq(ckpt_marks(root, 7, 40, &leaving, small, sizeof small), 40);
    ck_assert_ptr_nonnull(strstr(small, "..."));
    snprintf(path, sizeof path, "%s/.leaving-8.0", root);
    ck_assert_int_eq(unlink(path), 0);
    remove_root(root);
}
END_TEST

START_TEST(reshard_keeps_state_and_residual_sum)
{
    const eng_mode modes[] = { ENG_MODE_SHARDED, ENG_MODE_REPLICATED };
    const int onto[] = { 2, 5 };
    static rs_job before, after;
    for (int k = 0; k < 4; k++) {
        memset(&before, 0, sizeof before);
        eng_config_default(&before.cfg);
        before.cfg.rho = 0.05;
        before.cfg.warmup = 3;
        before.cfg.mode = ENG_MODE_SHARDED;
        before.cfg.split_above = k < 2 ? 0 : 100; /* then split tensors, on both sides */
        temp_dir(before.root, sizeof before.root);
        run_reshard(&before, R);
        memset(&after, 0, sizeof after);
        after.cfg = before.cfg;
        after.cfg.mode = modes[k % 2];
        /* the second onto the sim executor: resharding stages through it too */
        if (k % 2 == 1)
            set_executor(&after.cfg, ENG_EXEC_SIM, 0);
        after.restore = 1;
        memcpy(after.root, before.root, sizeof after.root);
        run_reshard(&after, onto[k % 2]);
        for (size_t i = 0; i < NUMEL; i++) {
            ck_assert_msg(after.have[i], "coordinate %zu has no owner after resharding", i);
            ck_assert_msg(after.m[i] == before.m[i] && after.theta[i] == before.theta[i],
                          "coordinate %zu: m or theta changed", i);
            ck_assert_msg(after.params[i] == before.params[i], "trainer parameter %zu", i);
            /* float32 sums of the old residuals onto fewer ranks: rounding only */
            ck_assert_msg(fabs(after.res[i] - before.res[i]) <= 2.4e-7 * before.res_abs[i],
                          "coordinate %zu: residual total %g became %g", i, before.res[i],
                          after.res[i]);
            ck_assert_msg(after.mask[i] == before.mask[i], "mask bit %zu", i);
        }
        remove_root(before.root);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("ckpt");
    TCase *tc = tcase_create("ckpt");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, checksum_sees_every_word);
    tcase_add_test(tc, roundtrip_every_optimizer_and_mode);
    tcase_add_test(tc, checkpoints_cross_executors);
    tcase_add_test(tc, other_settings_are_refused_on_every_rank);
    tcase_add_test(tc, parameter_groups_are_part_of_the_checkpoint);
    tcase_add_test(tc, split_ranges_are_part_of_the_checkpoint);
    tcase_add_test(tc, missing_checkpoints_are_named);
    tcase_add_test(tc, handed_out_checkpoints_outlive_the_newest_keep);
    tcase_add_test(tc, leave_markers_are_counted_per_job);
    tcase_add_test(tc, reshard_keeps_state_and_residual_sum);
    suite_add_tcase(s, tc);
    return check_run(s);
}
