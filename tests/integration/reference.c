/* reference.c - the in-process run the daemon must match bit for bit: the
 * engine on the local backend (one rank) with T trainers' buffers, fed the
 * same synthetic gradients as trainer_c, in trainer-index order.
 *
 * usage: reference --trainers T --n N --steps S [--seed X] [--lr LR]
 *                  [--optimizer O] [--mode M] [--rho R] [--warmup W]
 *                  [--max-grad-norm MAX] [--clip-norm sent|gradient]
 *                  [--groups WD0,WD1,...] --out FILE
 *                  [--timing FILE]   (rank 0's engine step per step, seconds)
 *                  [--members S:C,...]  (one rank: from step S on, trainers
 *                   0..C-1 step, as when a trainer died and another took its
 *                   place; one that comes back starts from trainer 0's
 *                   parameters, as the daemon hands a joiner the job's)
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>

#include "engine.h"
#include "synth.h"

#define MAX_RANKS 256
#define MAX_MEMBERS 16

typedef struct args {
    int ranks;
    int tr[MAX_RANKS];
    size_t n;
    uint64_t steps, seed;
    float lr;
    const char *out, *timing;
    eng_config cfg;
    eng_group groups[ENG_MAX_GROUPS]; /* --groups: tensor l in group l % ngroups,
                                         group g's lr (1 + g) * lr */
    size_t ngroups;
    uint64_t member_step[MAX_MEMBERS]; /* --members: from these steps on ... */
    int member_count[MAX_MEMBERS];     /* ... this many trainers */
    int nmembers;
} args;

static scape_rc parse_groups(const char *v, args *a)
{
    a->ngroups = 0;
    for (const char *p = v; *p && a->ngroups < ENG_MAX_GROUPS;) {
        char *end;
        a->groups[a->ngroups++].weight_decay = strtof(p, &end);
        if (end == p)
            return scape_set_error(SCAPE_INVALID, "bad --groups '%s'", v);
        p = *end == ',' ? end + 1 : end;
    }
    return a->ngroups ? SCAPE_OK : scape_set_error(SCAPE_INVALID, "bad --groups '%s'", v);
}

static scape_rc parse_trainers(const char *v, args *a)
{
    const char *p = v;
    for (a->ranks = 0; *p && a->ranks < MAX_RANKS; a->ranks++) {
        char *end;
        long t = strtol(p, &end, 10);
        if (end == p || t < 1 || t > 64)
            return scape_set_error(SCAPE_INVALID, "bad --trainers '%s'", v);
        a->tr[a->ranks] = (int)t;
        p = *end == ',' ? end + 1 : end;
    }
    if (*p)
        return scape_set_error(SCAPE_INVALID, "--trainers '%s': more than %d ranks", v,
                               MAX_RANKS);
    return a->ranks ? SCAPE_OK : scape_set_error(SCAPE_INVALID, "bad --trainers '%s'", v);
}

static scape_rc parse_members(const char *v, args *a)
{
    a->nmembers = 0;
    for (const char *p = v; *p;) {
        char *end;
        unsigned long long st = strtoull(p, &end, 10);
        if (end == p || *end != ':' || a->nmembers == MAX_MEMBERS)
            return scape_set_error(SCAPE_INVALID, "--members takes STEP:COUNT,... (at most %d)",
                                   MAX_MEMBERS);
        p = end + 1;
        long c = strtol(p, &end, 10);
        if (end == p || c < 1 || c > 64 || st < 1 ||
            (a->nmembers && st <= a->member_step[a->nmembers - 1]))
            return scape_set_error(SCAPE_INVALID, "--members: steps rising from 1, counts in "
                                   "[1, 64]");
        if (*end != ',' && *end != '\0')
            return scape_set_error(SCAPE_INVALID, "--members takes STEP:COUNT,...");
        a->member_step[a->nmembers] = st;
        a->member_count[a->nmembers++] = (int)c;
        p = *end ? end + 1 : end;
    }
    return SCAPE_OK;
}

static const char s_usage[] =
    "usage: reference [--trainers T0,T1,...] [--n N] [--steps S] [--seed X] [--lr LR]\n"
    "                 [--rho RHO] [--warmup W] [--optimizer OPT] [--mode MODE]\n"
    "                 [--max-grad-norm MAX] [--clip-norm sent|gradient]\n"
    "                 [--groups WD0,WD1,...] [--weight-decay WD]\n"
    "                 [--dense-below D] [--gather-values params|f32|delta]\n"
    "                 [--out FILE] [--timing FILE] [--members STEP:COUNT,...]\n"
    "The in-process engine (ranks as threads, the host executor) on the synthetic\n"
    "problem the test trainers train, for comparison with a daemon's results.\n";

/* 0 to run, 1 after --help, 2 on a bad flag. */
static int parse(int argc, char **argv, args *a)
{
    *a = (args){ .ranks = 1, .tr = { 1 }, .n = 1000, .steps = 10, .seed = 1, .lr = 1e-2f };
    eng_config_default(&a->cfg);
    for (int i = 1; i < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        scape_rc rc = SCAPE_OK;
        if (!strcmp(k, "--help") || !strcmp(k, "-h")) {
            fputs(s_usage, stdout);
            return 1;
        }
        if (v == NULL) {
            fprintf(stderr, "reference: %s needs a value\n%s", k, s_usage);
            return 2;
        }
        if (!strcmp(k, "--trainers")) rc = parse_trainers(v, a);
        else if (!strcmp(k, "--n")) a->n = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--steps")) a->steps = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--seed")) a->seed = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--lr")) a->lr = strtof(v, NULL);
        else if (!strcmp(k, "--out")) a->out = v;
        else if (!strcmp(k, "--timing")) a->timing = v;
        else if (!strcmp(k, "--rho")) a->cfg.rho = strtod(v, NULL);
        else if (!strcmp(k, "--warmup")) a->cfg.warmup = (uint32_t)atoi(v);
        else if (!strcmp(k, "--max-grad-norm")) a->cfg.max_grad_norm = strtof(v, NULL);
        else if (!strcmp(k, "--clip-norm")) rc = eng_clip_norm_parse(v, &a->cfg.clip_norm);
        else if (!strcmp(k, "--dense-below")) a->cfg.dense_below = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(k, "--split-above")) a->cfg.split_above = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(k, "--gather-values")) {
            if (!strcmp(v, "params")) a->cfg.gather = ENG_GATHER_PARAMS;
            else if (!strcmp(v, "f32")) a->cfg.gather = ENG_GATHER_F32;
            else if (!strcmp(v, "delta")) a->cfg.gather = ENG_GATHER_DELTA;
            else rc = scape_set_error(SCAPE_INVALID, "--gather-values: params, f32 or delta");
        }
        else if (!strcmp(k, "--groups")) rc = parse_groups(v, a);
        else if (!strcmp(k, "--members")) rc = parse_members(v, a);
        else if (!strcmp(k, "--weight-decay")) a->cfg.hyper.wd = strtof(v, NULL);
        else if (!strcmp(k, "--optimizer")) rc = eng_optimizer_parse(v, &a->cfg.optimizer);
        else if (!strcmp(k, "--mode")) rc = eng_mode_parse(v, &a->cfg.mode);
        else rc = scape_set_error(SCAPE_INVALID, "unknown flag %s", k);
        if (rc != SCAPE_OK) {
            fprintf(stderr, "reference: %s\n", scape_last_error());
            return 2;
        }
    }
    return 0;
}

typedef struct rank_job {
    const args *a;
    int rank;
    comm_t *comm;
    const eng_tensor *ts;
    size_t nt, n;
    double step_s;
    FILE *timing;    /* rank 0: one line per step */
    float *out;      /* rank 0: trainer 0's final parameters */
    scape_rc rc;
    char err[512];
} rank_job;

static scape_rc train(rank_job *j, eng_t *e, float **p, float **g)
{
    const args *a = j->a;
    uint64_t seed = a->seed + 1000u * (uint64_t)j->rank;
    int now = a->tr[j->rank], next = 0;
    for (uint64_t t = 1; t <= a->steps; t++) {
        if (next < a->nmembers && a->member_step[next] == t) {
            int c = a->member_count[next++];
            if (c > a->tr[j->rank])
                return scape_set_error(SCAPE_INVALID, "--members: %d trainers, more than the "
                                       "%d of --trainers", c, a->tr[j->rank]);
            for (int q = now; q < c; q++) /* a joiner gets the job's parameters */
                memcpy(p[q], p[0], j->n * sizeof(float));
            if (c != now) {
                scape_rc rc = eng_set_local_trainers(e, c);
                if (rc != SCAPE_OK)
                    return rc;
                now = c;
            }
        }
        for (int q = 0; q < now; q++)
            for (size_t l = 0; l < j->nt; l++)
                for (size_t i = j->ts[l].offset; i < j->ts[l].offset + j->ts[l].length; i++)
                    g[q][i] = synth_grad(seed, q, t, i, p[q][i], synth_scale(l));
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        float lrs[ENG_MAX_GROUPS];
        for (size_t q = 0; q < ENG_MAX_GROUPS; q++)
            lrs[q] = a->ngroups ? (float)(1 + q) * a->lr : a->lr;
        scape_rc rc = eng_step_groups(e, t, lrs, (const void *const *)g, (void *const *)p);
        if (rc != SCAPE_OK)
            return rc;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        j->step_s += dt;
        if (j->timing)
            fprintf(j->timing, "%llu %.9f\n", (unsigned long long)t, dt);
    }
    if (j->out)
        memcpy(j->out, p[0], j->n * sizeof(float));
    return SCAPE_OK;
}

static void *rank_main(void *arg)
{
    rank_job *j = arg;
    int tr = j->a->tr[j->rank];
    uint64_t seed = j->a->seed + 1000u * (uint64_t)j->rank;
    float *p[64], *g[64];
    for (int q = 0; q < tr; q++) {
        p[q] = malloc(j->n * sizeof(float));
        g[q] = malloc(j->n * sizeof(float));
        for (size_t i = 0; i < j->n; i++)
            p[q][i] = synth_init(seed, q, i);
    }
    eng_layout lay = { j->ts, j->nt, KERN_F32, KERN_F32, j->a->groups, j->a->ngroups };
    eng_t *e = NULL;
    j->rc = eng_create(&e, &j->a->cfg, &lay, j->comm, tr);
    if (j->rc == SCAPE_OK)
        j->rc = eng_init_params(e, (void *const *)p);
    if (j->rc == SCAPE_OK)
        j->rc = train(j, e, p, g);
    if (j->rc != SCAPE_OK)
        snprintf(j->err, sizeof j->err, "%s", scape_last_error());
    eng_destroy(&e);
    for (int q = 0; q < tr; q++) {
        free(p[q]);
        free(g[q]);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    args a;
    int how = parse(argc, argv, &a);
    if (how)
        return how == 1 ? 0 : 2;
    if (a.nmembers && a.ranks != 1) {
        fprintf(stderr, "reference: --members is for one rank\n");
        return 2;
    }
    size_t off[SYNTH_MAX_TENSORS], len[SYNTH_MAX_TENSORS];
    char names[SYNTH_MAX_TENSORS][16];
    size_t nt = synth_layout(a.n, off, len, names);
    eng_tensor ts[SYNTH_MAX_TENSORS];
    for (size_t l = 0; l < nt; l++)
        ts[l] = (eng_tensor){ names[l], off[l], len[l],
                              a.ngroups ? (uint32_t)(l % a.ngroups) : 0 };
    size_t n = off[nt - 1] + len[nt - 1];
    comm_t *comms[MAX_RANKS];
    rank_job jobs[MAX_RANKS];
    pthread_t th[MAX_RANKS];
    float *out = malloc(n * sizeof *out);
    if (out == NULL || comm_local_create(a.ranks, comms) != SCAPE_OK) {
        fprintf(stderr, "reference: %s\n", scape_last_error());
        return 1;
    }
    FILE *timing = a.timing ? fopen(a.timing, "w") : NULL;
    if (a.timing && timing == NULL) {
        perror(a.timing);
        return 1;
    }
    for (int r = 0; r < a.ranks; r++) {
        jobs[r] = (rank_job){ .a = &a, .rank = r, .comm = comms[r], .ts = ts, .nt = nt,
                              .n = n, .out = r == 0 ? out : NULL,
                              .timing = r == 0 ? timing : NULL };
        pthread_create(&th[r], NULL, rank_main, &jobs[r]);
    }
    int bad = 0;
    for (int r = 0; r < a.ranks; r++) {
        pthread_join(th[r], NULL);
        if (jobs[r].rc != SCAPE_OK) {
            fprintf(stderr, "reference: rank %d: %s\n", r, jobs[r].err);
            bad = 1;
        }
        comm_destroy(&comms[r]);
    }
    if (timing && fclose(timing) != 0) {
        perror(a.timing);
        bad = 1;
    }
    printf("reference: %llu steps, N=%zu, %d rank(s), mean engine step %.3f ms\n",
           (unsigned long long)a.steps, n, a.ranks, 1e3 * jobs[0].step_s / (double)a.steps);
    FILE *f = a.out && !bad ? fopen(a.out, "wb") : NULL;
    if (a.out && !bad && (f == NULL || fwrite(out, sizeof(float), n, f) != n || fclose(f) != 0)) {
        perror(a.out);
        bad = 1;
    }
    free(out);
    return bad;
}
