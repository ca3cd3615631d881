/* test_early.c - bucketed hand-over (eng_pack_early) changes no bit.
 *
 * Each configuration runs twice over the same gradients on R ranks (threads
 * on the local comm backend): plainly, and with every step's registered
 * tensors cut into random buckets, a random subset of them posted early in
 * a random order (different per rank and step), some posted twice, the
 * early packs sometimes undone and posted again, and on some steps a
 * checkpoint taken between buckets; the step packs the rest.  theta, m, v,
 * the residual and the mask of every rank must be bitwise those of the
 * plain run every few steps, and the trainers' parameters at the end; the
 * checkpoints, byte for byte those the plain run saves before the same
 * steps.  Some early runs reduce in chunks (reduce_chunk) against the plain
 * run's one reduction: chunks that early packs reduced survive an undo and
 * a checkpoint, and must be reduced early on some step.
 */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine.h"
#include "rank_threads.h"
#include "check_run.h"
#include "try.h"

#define MAX_R 4
#define MAX_TR 3
#define STEPS 50
#define EVERY 10                 /* snapshot every EVERY steps */
#define SNAPS (STEPS / EVERY)
#define NVEC 5                   /* theta, m, v, residual, mask */

/* Lengths include 1, non-multiples of 32 and one multiple. */
static const size_t s_lens[] = { 1, 31, 33, 64, 100, 257, 1, 7, 500, 190 };
#define NT (sizeof s_lens / sizeof s_lens[0])
#define SPLIT_SMALL 48           /* split_above forced on small tensors */

static uint64_t s_seed;

typedef struct spec {
    eng_config cfg;
    int R, tr;
    uint32_t chunk;              /* the early run's reduce_chunk */
} spec;

#define SAVES 8                  /* checkpoints between buckets (t % 9 == 4) */

typedef struct ctx {
    const spec *sp;
    eng_tensor ts[NT];
    size_t n;
    int early;                   /* this run posts buckets early */
    float *snap[MAX_R][SNAPS + 1][NVEC]; /* plain run's; the last: params */
    double churn[MAX_R][STEPS + 1];      /* plain run's mask churn per step */
    /* the plain run's checkpoint before each step the early run saves
     * between buckets: every section, as saved */
    void *saved[MAX_R][SAVES][ENG_CKPT_MAX_SECS];
    size_t saved_bytes[MAX_R][SAVES][ENG_CKPT_MAX_SECS];
    size_t early_chunks;         /* chunks the early run's packs reduced */
    char fail[512];
    int failed;
    pthread_mutex_t mu;
} ctx;

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static double unit(uint64_t h) { return (double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0; }

static void note_fail(ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note_fail(ctx *c, const char *fmt, ...)
{
    pthread_mutex_lock(&c->mu);
    if (!c->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->fail, sizeof c->fail, fmt, ap);
        va_end(ap);
        c->failed = 1;
    }
    pthread_mutex_unlock(&c->mu);
}

static void fill_grads(const ctx *c, int r, uint64_t t, void **grads)
{
    for (int j = 0; j < c->sp->tr; j++)
        for (size_t i = 0; i < c->n; i++) {
            uint64_t h = mix(s_seed ^ mix(((uint64_t)r << 48) ^ ((uint64_t)j << 40) ^ (t << 24) ^ i));
            /* a few large coordinates, so that selections differ from step to step */
            double scale = (h & 15) == 0 ? 10.0 : 1.0;
            ((float *)grads[j])[i] = (float)(scale * unit(mix(h)));
        }
}

/* Comm-order pieces of each registered tensor (split ones have several). */
static void count_pieces(const ctx *c, eng_t *e, size_t *pieces)
{
    size_t np = eng_ntensors(e);
    eng_tensor *pc = calloc(np, sizeof *pc);
    memset(pieces, 0, NT * sizeof *pieces);
    ck_assert_int_eq(eng_get_layout(e, pc, np), SCAPE_OK);
    for (size_t p = 0; p < np; p++)
        for (size_t l = 0; l < NT; l++)
            if (pc[p].offset >= c->ts[l].offset && pc[p].offset < c->ts[l].offset + c->ts[l].length)
                pieces[l]++;
    free(pc);
}

/* Rank r's state: theta, m, v, residual, mask (as floats), coordinate order. */
static scape_rc state_of(const ctx *c, eng_t *e, float **out)
{
    unsigned char *have = calloc(c->n, 1), *bits = calloc(c->n, 1);
    scape_rc rc = have && bits ? SCAPE_OK : SCAPE_NOMEM;
    const eng_opt *o = eng_opt_get(c->sp->cfg.optimizer);
    if (rc == SCAPE_OK)
        rc = eng_get_state(e, ENG_VEC_THETA, out[0], have);
    if (rc == SCAPE_OK)
        rc = eng_get_state(e, ENG_VEC_M, out[1], have);
    if (rc == SCAPE_OK && o->keeps_v)
        rc = eng_get_state(e, ENG_VEC_V, out[2], have);
    if (rc == SCAPE_OK)
        rc = eng_get_residual(e, out[3]);
    if (rc == SCAPE_OK)
        rc = eng_get_mask(e, bits);
    for (size_t i = 0; rc == SCAPE_OK && i < c->n; i++)
        out[4][i] = bits[i];
    free(have);
    free(bits);
    return rc;
}

static const char *const s_vec[NVEC] = { "theta", "m", "v", "residual", "mask" };

/* The plain run keeps its snapshot; the early run compares with it. */
static scape_rc snapshot(ctx *c, int r, int slot, eng_t *e)
{
    float *got[NVEC];
    for (int v = 0; v < NVEC; v++)
        got[v] = calloc(c->n, sizeof(float));
    scape_rc rc = state_of(c, e, got);
    for (int v = 0; v < NVEC; v++) {
        if (!c->early) {
            c->snap[r][slot][v] = got[v];
            continue;
        }
        if (rc == SCAPE_OK && memcmp(got[v], c->snap[r][slot][v], c->n * sizeof(float)))
            for (size_t i = 0; i < c->n; i++)
                if (memcmp(&got[v][i], &c->snap[r][slot][v][i], sizeof(float))) {
                    note_fail(c, "rank %d step %d: %s[%zu] %.9g with early packs, %.9g "
                              "without", r, (slot + 1) * EVERY, s_vec[v], i,
                              (double)got[v][i], (double)c->snap[r][slot][v][i]);
                    break;
                }
        free(got[v]);
    }
    return rc;
}

/* One bucket posted early; checks what it says it packed.  posted[l]:
 * pieces of tensor l packed so far. */
static scape_rc post(ctx *c, eng_t *e, uint64_t t, void **grads, const unsigned char *bucket,
                     size_t *posted, const size_t *pieces, size_t *total, double norm0)
{
    size_t packed = 99, want = 0;
    for (size_t l = 0; l < NT; l++)
        if (bucket[l])
            want += pieces[l] - posted[l];
    TRY(eng_pack_early(e, t, (const void *const *)grads, bucket, &packed));
    if (eng_opt_get(c->sp->cfg.optimizer)->intake)
        want = 0; /* topk-adamw leaves everything to the step */
    if (packed != want)
        note_fail(c, "step %llu: a bucket packed %zu comm tensors, expected %zu",
                  (unsigned long long)t, packed, want);
    for (size_t l = 0; l < NT; l++)
        if (bucket[l] && !eng_opt_get(c->sp->cfg.optimizer)->intake)
            posted[l] = pieces[l];
    *total += packed;
    /* status between buckets shows the last step's residual norm, not one
     * of a residual half packed */
    double norm = eng_residual_norm(e);
    if (memcmp(&norm, &norm0, sizeof norm))
        note_fail(c, "step %llu: the residual norm between buckets is %.17g, the last "
                  "step's %.17g", (unsigned long long)t, norm, norm0);
    return SCAPE_OK;
}

/* After an undo: what stays packed (the chunks reduced early). */
static void kept(eng_t *e, size_t *posted, size_t *total)
{
    *total = 0;
    for (size_t l = 0; l < NT; l++)
        *total += posted[l] = eng_early_kept(e, l);
}

/* A checkpoint before step t, which saves the state after step t - 1:
 * the plain run keeps its sections, the early run (between buckets, with
 * chunks reduced early or not) must save the same bytes. */
static scape_rc save_between(ctx *c, int r, eng_t *e, uint64_t t)
{
    eng_ckpt_meta meta;
    eng_ckpt_sec secs[ENG_CKPT_MAX_SECS];
    int nsecs;
    size_t w = (size_t)(t / 9);
    TRY(eng_ckpt_save(e, &meta, secs, &nsecs));
    for (int i = 0; i < nsecs && w < SAVES; i++) {
        if (!c->early) {
            c->saved[r][w][i] = malloc(secs[i].bytes ? secs[i].bytes : 1);
            memcpy(c->saved[r][w][i], secs[i].ptr, secs[i].bytes);
            c->saved_bytes[r][w][i] = secs[i].bytes;
        } else if (secs[i].bytes != c->saved_bytes[r][w][i] ||
                   memcmp(secs[i].ptr, c->saved[r][w][i], secs[i].bytes)) {
            note_fail(c, "rank %d: the checkpoint saved between step %llu's buckets differs "
                      "in section %d (%zu bytes) from the one before the plain step", r,
                      (unsigned long long)t, i, secs[i].bytes);
        }
    }
    return SCAPE_OK;
}

/* Step t's buckets: a random partition of the tensors, a random subset of
 * the buckets posted early in random order, one of them sometimes twice;
 * sometimes every early pack undone and some posted again; on some steps
 * (every rank alike: it is collective) a checkpoint between buckets. */
static scape_rc post_buckets(ctx *c, int r, eng_t *e, uint64_t t, void **grads,
                             const size_t *pieces, size_t *total)
{
    uint64_t h = mix(s_seed ^ mix(((uint64_t)r << 32) ^ t ^ 0x5eedULL));
    size_t perm[NT], nb = 1 + (h >> 60) % 4, posted[NT];
    unsigned char bucket[4][NT];
    memset(bucket, 0, sizeof bucket);
    memset(posted, 0, sizeof posted);
    for (size_t l = 0; l < NT; l++)
        perm[l] = l;
    for (size_t l = NT - 1; l > 0; l--) {
        size_t q = (size_t)(mix(h + l) % (l + 1)), s = perm[l];
        perm[l] = perm[q];
        perm[q] = s;
    }
    for (size_t l = 0; l < NT; l++)
        bucket[mix(h ^ (l * 77)) % nb][perm[l]] = 1;
    /* after that many buckets (0 or 1: there is at least one) */
    size_t ckpt_at = t % 9 == 4 ? (size_t)(t % 2) : SIZE_MAX;
    double norm0 = eng_residual_norm(e);
    *total = 0;
    for (size_t b = 0; b <= nb; b++) {
        if (b == ckpt_at) {
            TRY(save_between(c, r, e, t));
            kept(e, posted, total); /* the save undid them */
        }
        if (b == nb)
            break;
        size_t which = (b + (h >> 8)) % nb;
        if ((mix(h ^ b) & 3) != 0)
            TRY(post(c, e, t, grads, bucket[which], posted, pieces, total, norm0));
        if ((mix(h ^ b ^ 0xabc) & 7) == 0) /* the same bucket again: nothing new */
            TRY(post(c, e, t, grads, bucket[which], posted, pieces, total, norm0));
    }
    if ((h & 0xff) < 64) {
        TRY(eng_pack_early_undo(e));
        kept(e, posted, total);
        for (size_t b = 0; b < nb; b++)
            if (mix(h ^ (b << 4)) & 1)
                TRY(post(c, e, t, grads, bucket[b], posted, pieces, total, norm0));
    }
    return SCAPE_OK;
}

static scape_rc train(rank_arg *a, eng_t *e, void **grads, void **params)
{
    ctx *c = a->ctx;
    size_t pieces[NT];
    count_pieces(c, e, pieces);
    for (uint64_t t = 1; t <= STEPS && !c->failed; t++) {
        fill_grads(c, a->rank, t, grads);
        size_t total = 0;
        if (c->early)
            TRY(post_buckets(c, a->rank, e, t, grads, pieces, &total));
        else if (t % 9 == 4)
            TRY(save_between(c, a->rank, e, t));
        TRY(eng_step(e, t, 1e-3f, (const void *const *)grads, params));
        eng_step_stats st;
        TRY(eng_last_stats(e, &st));
        pthread_mutex_lock(&c->mu);
        c->early_chunks += c->early ? st.early_chunks : 0;
        pthread_mutex_unlock(&c->mu);
        if (st.early_tensors != total)
            note_fail(c, "rank %d step %llu: stats say %zu tensors packed early, the calls "
                      "%zu", a->rank, (unsigned long long)t, st.early_tensors, total);
        if (!c->early)
            c->churn[a->rank][t] = st.mask_churn;
        else if (memcmp(&st.mask_churn, &c->churn[a->rank][t], sizeof(double)))
            note_fail(c, "rank %d step %llu: mask churn %.17g with early packs, %.17g without",
                      a->rank, (unsigned long long)t, st.mask_churn, c->churn[a->rank][t]);
        if (t % EVERY == 0)
            TRY(snapshot(c, a->rank, (int)(t / EVERY) - 1, e));
    }
    return SCAPE_OK;
}

static scape_rc rank_run(rank_arg *a)
{
    ctx *c = a->ctx;
    int tr = c->sp->tr;
    void *grads[MAX_TR], *params[MAX_TR];
    for (int j = 0; j < tr; j++) {
        grads[j] = calloc(c->n, sizeof(float));
        params[j] = calloc(c->n, sizeof(float));
        for (size_t i = 0; i < c->n; i++)
            ((float *)params[j])[i] = (float)(0.5 * unit(mix(i + 77)));
    }
    eng_layout lay = { c->ts, NT, KERN_F32, KERN_F32, NULL, 0 };
    eng_t *e = NULL;
    eng_config cfg = c->sp->cfg;
    cfg.reduce_chunk = c->early ? c->sp->chunk : 0; /* the plain run: one reduction */
    scape_rc rc = eng_create(&e, &cfg, &lay, a->comm, tr);
    if (rc == SCAPE_OK)
        rc = eng_init_params(e, params);
    if (rc == SCAPE_OK)
        rc = train(a, e, grads, params);
    float **last = c->snap[a->rank][SNAPS];
    if (rc == SCAPE_OK && !c->early)
        last[0] = malloc(c->n * sizeof(float)), memcpy(last[0], params[0], c->n * sizeof(float));
    else if (rc == SCAPE_OK && !c->failed && memcmp(last[0], params[0], c->n * sizeof(float)))
        note_fail(c, "rank %d: the trainers' parameters differ after %d steps", a->rank, STEPS);
    eng_destroy(&e);
    for (int j = 0; j < tr; j++) {
        free(grads[j]);
        free(params[j]);
    }
    return rc;
}

static void run_spec(const spec *sp)
{
    ctx *c = calloc(1, sizeof *c);
    c->sp = sp;
    pthread_mutex_init(&c->mu, NULL);
    char name[NT][16];
    for (size_t l = 0; l < NT; l++) {
        snprintf(name[l], sizeof name[l], "w%zu_%zu", l, s_lens[l]);
        c->ts[l] = (eng_tensor){ name[l], c->n, s_lens[l], 0 };
        c->n += s_lens[l];
    }
    for (c->early = 0; c->early < 2 && !c->failed; c->early++) {
        rank_arg args[MAX_R];
        ck_assert_int_eq(run_ranks(sp->R, rank_run, c, args), 0);
        for (int r = 0; r < sp->R; r++)
            ck_assert_msg(args[r].rc == SCAPE_OK, "%s %s R=%d T_r=%d split=%u %s run, rank "
                          "%d: %s", eng_optimizer_name(sp->cfg.optimizer),
                          eng_mode_name(sp->cfg.mode), sp->R, sp->tr,
                          (unsigned)sp->cfg.split_above, c->early ? "early" : "plain", r,
                          args[r].err);
    }
    ck_assert_msg(!c->failed, "%s %s %s%s R=%d T_r=%d split_above=%u defer_select=%d "
                  "reduce_chunk=%u: %s", eng_optimizer_name(sp->cfg.optimizer),
                  eng_mode_name(sp->cfg.mode), eng_executor_name(sp->cfg.executor),
                  sp->cfg.residual_on_device ? " (residual on device)" : "", sp->R,
                  sp->tr, (unsigned)sp->cfg.split_above, sp->cfg.defer_select,
                  (unsigned)sp->chunk, c->fail);
    /* the chunks went early where they can: several ranks, an optimizer
     * that packs early */
    if (sp->chunk && sp->R > 1 && !eng_opt_get(sp->cfg.optimizer)->intake)
        ck_assert_msg(c->early_chunks > 0, "%s %s R=%d reduce_chunk=%u: no chunk was reduced "
                      "by an early pack in %d steps", eng_optimizer_name(sp->cfg.optimizer),
                      eng_mode_name(sp->cfg.mode), sp->R, (unsigned)sp->chunk, STEPS);
    for (int r = 0; r < MAX_R; r++) {
        for (int s = 0; s <= SNAPS; s++)
            for (int v = 0; v < NVEC; v++)
                free(c->snap[r][s][v]);
        for (int w = 0; w < SAVES; w++)
            for (int i = 0; i < ENG_CKPT_MAX_SECS; i++)
                free(c->saved[r][w][i]);
    }
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static const eng_optimizer s_opts[] = { ENG_OPT_SCAPE, ENG_OPT_ADAMS, ENG_OPT_ADAMW,
                                        ENG_OPT_TOPK_ADAMW };
static const int s_R[] = { 1, 3, 4 };

/* _i: the optimizer (_i % 4) and executor (_i / 4: host, sim with the
 * residual streamed in chunks, sim with it on the device); every mode, R,
 * T_r and split_above for them. */
START_TEST(early_packs_change_no_bit)
{
    for (int mode = 0; mode < 2; mode++)
        for (size_t ri = 0; ri < sizeof s_R / sizeof s_R[0]; ri++)
            for (int tr = 1; tr <= 3; tr += 2)
                for (int split = 0; split < 2; split++) {
                    spec sp = { .R = s_R[ri], .tr = tr };
                    eng_config_default(&sp.cfg);
                    sp.cfg.optimizer = s_opts[_i % 4];
                    sp.cfg.executor = _i / 4 ? ENG_EXEC_SIM : ENG_EXEC_HOST;
                    sp.cfg.residual_chunk = 64; /* chunks cut through tensors */
                    sp.cfg.residual_on_device = _i / 4 == 2;
                    sp.cfg.mode = mode ? ENG_MODE_SHARDED : ENG_MODE_REPLICATED;
                    sp.cfg.rho = 0.1;
                    sp.cfg.warmup = 3;
                    sp.cfg.intake_chunk = 64; /* several pieces per tensor */
                    sp.cfg.split_above = split ? SPLIT_SMALL : 0;
                    sp.cfg.defer_select = (int)((ri + (size_t)split) % 2);
                    sp.cfg.wire_bf16 = tr == 3; /* bf16 values keep a remainder in e */
                    /* none, a chunk per piece, chunks of several tensors */
                    static const uint32_t chunks[] = { 0, 1, 150 };
                    sp.chunk = chunks[(ri + (size_t)tr + (size_t)split) % 3];
                    run_spec(&sp);
                }
}
END_TEST

static void expect_invalid(scape_rc rc, const char *needle)
{
    ck_assert_int_eq(rc, SCAPE_INVALID);
    ck_assert_msg(strstr(scape_last_error(), needle) != NULL, "message '%s' lacks '%s'",
                  scape_last_error(), needle);
}

START_TEST(bad_early_arguments)
{
    comm_t *c[1];
    ck_assert_int_eq(comm_local_create(1, c), SCAPE_OK);
    eng_tensor ts[] = { { "a", 0, 40, 0 }, { "b", 40, 1, 0 } };
    eng_layout lay = { ts, 2, KERN_F32, KERN_F32, NULL, 0 };
    eng_config cfg;
    eng_config_default(&cfg);
    eng_t *e = NULL;
    ck_assert_int_eq(eng_create(&e, &cfg, &lay, c[0], 1), SCAPE_OK);
    float p[41] = { 0 }, g[41] = { 0 };
    void *params[1] = { p };
    const void *grads[1] = { g };
    unsigned char take[2] = { 1, 0 };
    size_t packed = 7;
    expect_invalid(eng_pack_early(e, 1, grads, take, &packed), "eng_init_params");
    ck_assert_int_eq(eng_init_params(e, params), SCAPE_OK);
    expect_invalid(eng_pack_early(e, 2, grads, take, &packed), "early pack for step 2, but "
                                                                "the next step is 1");
    expect_invalid(eng_pack_early(e, 1, grads, NULL, &packed), "NULL");
    expect_invalid(eng_pack_early(e, 1, NULL, take, &packed), "grads");
    ck_assert_int_eq(eng_pack_early(e, 1, grads, take, &packed), SCAPE_OK);
    ck_assert_uint_eq(packed, 1);
    ck_assert_int_eq(eng_step(e, 1, 1e-3f, grads, params), SCAPE_OK);
    ck_assert_int_eq(eng_pack_early_undo(e), SCAPE_OK); /* none in flight */
    expect_invalid(eng_pack_early_undo(NULL), "NULL");
    eng_destroy(&e);
    cfg.optimizer = ENG_OPT_TOPK_ADAMW;
    ck_assert_int_eq(eng_create(&e, &cfg, &lay, c[0], 1), SCAPE_OK);
    ck_assert_int_eq(eng_init_params(e, params), SCAPE_OK);
    ck_assert_int_eq(eng_pack_early(e, 1, grads, take, &packed), SCAPE_OK);
    ck_assert_uint_eq(packed, 0);
    eng_destroy(&e);
    comm_destroy(&c[0]);
}
END_TEST

int main(void)
{
    const char *env = getenv("SCAPE_TEST_SEED");
    s_seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
    printf("test_early: seed %llu (set SCAPE_TEST_SEED to reproduce)\n",
           (unsigned long long)s_seed);
    fflush(stdout);
    Suite *s = suite_create("early");
    TCase *tc = tcase_create("early packs");
    tcase_set_timeout(tc, 600);
    tcase_add_loop_test(tc, early_packs_change_no_bit, 0, 12);
    tcase_add_test(tc, bad_early_arguments);
    suite_add_tcase(s, tc);
    return check_run(s);
}
