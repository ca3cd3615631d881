/* bench_quality.c - does SCAPE train as well as dense AdamS?  The GPT of
 * client/examples on the fortunes corpus, R ranks (threads on the local
 * backend, one trainer each, each with its own data order), the same model
 * seed, data seeds, schedule and steps for every optimizer:
 * adamw, adams, scape at rho 0.1 and 0.01, topk-adamw at rho 0.01.
 *
 * Per optimizer it reports the final validation loss, the mean collective
 * payload per step (from the comm counters, the mask all-gather included) and
 * its ratio to dense AdamS's, and the wall time; and writes one CSV per
 * optimizer (step, lr, mean train loss, val loss, bytes) for the plot.  It
 * never fails on a figure: tests/bench/quality_report.py compares them with
 * the targets and writes docs/benchmarks.md rows and the plot.
 *
 * usage: bench_quality --corpus FILE [--ranks R] [--out DIR] [--only NAME]
 *                      [--warmup W (dense warm-up of the sparse optimizers, 10)]
 *                      [--max-grad-norm C (clip g_hat's global norm, every
 *                       optimizer; 0 = off, the default)]
 *                      [--set KEY=VALUE ... (any engine key of scaped's
 *                       configuration, docs/configuration.md, over the
 *                       variant's settings: --set rho=0.02 --set
 *                       gather_values=delta)] [--name LABEL (with --only:
 *                       the row's and the CSV's name)]
 *                      [gpt_run options: --steps --lr --d --layers ...]
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "config.h"
#include "engine.h"
#include "gpt_run.h"
#include "../unit/rank_threads.h"

#define MAX_RANKS 16
#define MAX_SETS 32

typedef struct variant {
    const char *name;
    eng_optimizer opt;
    double rho;
    int wire_bf16;      /* wire_values: bf16 */
    double rho_start;   /* a density schedule from rho_start (0: none) */
    uint32_t rho_steps; /* over this many masked steps */
    int mask_deltas;    /* masks as deltas where smaller */
    int bf16_params;    /* the trainers hold bf16 parameters (widened for the
                           forward pass; the fp32 master stays in the engine) */
    uint32_t dense_below; /* tensors of at most this many coordinates go whole */
    eng_gather gather;    /* what masked steps publish (delta: changes in bf16) */
} variant;

static const variant s_variants[] = {
    { "adamw", ENG_OPT_ADAMW, 1.0, 0, 0.0, 0, 0, 0, 0, ENG_GATHER_PARAMS },
    { "adams", ENG_OPT_ADAMS, 1.0, 0, 0.0, 0, 0, 0, 0, ENG_GATHER_PARAMS },
    { "scape-0.1", ENG_OPT_SCAPE, 0.1, 0, 0.0, 0, 0, 0, 0, ENG_GATHER_PARAMS },
    { "scape-0.01", ENG_OPT_SCAPE, 0.01, 0, 0.0, 0, 0, 0, 0, ENG_GATHER_PARAMS },
    { "topk-adamw-0.01", ENG_OPT_TOPK_ADAMW, 0.01, 0, 0.0, 0, 0, 0, 0, ENG_GATHER_PARAMS },
    /* fewer bytes: values in bf16, masks as deltas, a density schedule
     * 0.16 -> 0.01 over 400 steps */
    { "scape-0.1-bf16", ENG_OPT_SCAPE, 0.1, 1, 0.0, 0, 0, 0, 0, ENG_GATHER_PARAMS },
    { "scape-0.01-bf16", ENG_OPT_SCAPE, 0.01, 1, 0.0, 0, 0, 0, 0, ENG_GATHER_PARAMS },
    { "scape-0.01-delta", ENG_OPT_SCAPE, 0.01, 1, 0.0, 0, 1, 0, 0, ENG_GATHER_PARAMS },
    { "scape-0.01-sched", ENG_OPT_SCAPE, 0.01, 1, 0.16, 400, 1, 0, 0, ENG_GATHER_PARAMS },
    /* gentler schedules: 0.04 halved twice over 1,000 masked steps, and
     * 0.02 for 2,000 masked steps */
    { "scape-0.01-sched-slow", ENG_OPT_SCAPE, 0.01, 1, 0.04, 1000, 1, 0, 0, ENG_GATHER_PARAMS },
    { "scape-0.01-sched-long", ENG_OPT_SCAPE, 0.01, 1, 0.02, 2000, 1, 0, 0, ENG_GATHER_PARAMS },
    { "scape-0.01-bf16p", ENG_OPT_SCAPE, 0.01, 1, 0.0, 0, 1, 1, 0, ENG_GATHER_PARAMS },
    { "adams-bf16p", ENG_OPT_ADAMS, 1.0, 0, 0.0, 0, 0, 1, 0, ENG_GATHER_PARAMS },
    /* small tensors whole (dense_below 256: this GPT's norms and biases,
     * 1,792 of its 118,784 coordinates), as PowerSGD leaves them */
    { "scape-0.01-small", ENG_OPT_SCAPE, 0.01, 1, 0.0, 0, 1, 0, 256, ENG_GATHER_PARAMS },
    { "scape-0.1-small", ENG_OPT_SCAPE, 0.1, 1, 0.0, 0, 1, 0, 256, ENG_GATHER_PARAMS },
    /* and the gathers carrying each parameter's change in bf16: rho 0.1 at
     * fewer bytes, and rho 0.15 at about scape-0.1-small's bytes */
    { "scape-0.1-small-gd", ENG_OPT_SCAPE, 0.1, 1, 0.0, 0, 1, 0, 256, ENG_GATHER_DELTA },
    { "scape-0.15-small-gd", ENG_OPT_SCAPE, 0.15, 1, 0.0, 0, 1, 0, 256, ENG_GATHER_DELTA },
    /* every byte saving together under the schedule target's 2% of dense
     * AdamS's mean bytes: 0.02 for 1,500 masked steps, then 0.01 */
    { "scape-0.01-sched-small-gd", ENG_OPT_SCAPE, 0.01, 1, 0.02, 1500, 1, 0, 256, ENG_GATHER_DELTA },
    /* the same savings at constant densities between: what bytes the
     * schedule target's quality (+0.15 to dense AdamS) takes */
    { "scape-0.02-small-gd", ENG_OPT_SCAPE, 0.02, 1, 0.0, 0, 1, 0, 256, ENG_GATHER_DELTA },
    { "scape-0.03-small-gd", ENG_OPT_SCAPE, 0.03, 1, 0.0, 0, 1, 0, 256, ENG_GATHER_DELTA },
    { "scape-0.05-small-gd", ENG_OPT_SCAPE, 0.05, 1, 0.0, 0, 1, 0, 256, ENG_GATHER_DELTA },
};
#define NVARIANTS (sizeof s_variants / sizeof s_variants[0])

typedef struct shared {
    const gpt_run *run;
    const gpt_corpus *corpus;
    const variant *v;
    const char *name;  /* the variant's, or --name */
    eng_config cfg;    /* the variant's settings under --set */
    eng_tensor *layout;
    int ntensors;
    int ranks;
    float *train_loss; /* [steps][ranks] */
    double *val_loss;  /* [steps], NaN where not measured */
    uint64_t *bytes;   /* [steps], rank 0's payload */
    uint64_t *mask;    /* [steps], of it the mask all-gather's */
    double *churn;     /* [steps], the mask's bits not in the last one (a fraction) */
} shared;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static scape_rc rank_train(rank_arg *a)
{
    shared *sh = a->ctx;
    const gpt_run *r = sh->run;
    size_t n = gpt_num_params(&r->model), bt = (size_t)r->batch * (size_t)r->seq;
    float *p = malloc(n * sizeof *p), *g = malloc(n * sizeof *g);
    int *x = malloc(bt * sizeof *x), *y = malloc(bt * sizeof *y);
    gpt_work *w = gpt_work_new(&r->model, r->batch, r->seq);
    eng_t *e = NULL;
    scape_rc rc = p && g && x && y && w ? SCAPE_OK
                                        : scape_set_error(SCAPE_NOMEM, "out of memory");
    eng_config cfg = sh->cfg;
    int bp = sh->v->bf16_params;
    uint16_t *ph = bp ? malloc(n * sizeof *ph) : NULL; /* the trainer's bf16 parameters */
    if (bp && ph == NULL)
        rc = scape_set_error(SCAPE_NOMEM, "out of memory");
    void *pbuf = bp ? (void *)ph : (void *)p;
    eng_layout lay = { sh->layout, (size_t)sh->ntensors, bp ? KERN_BF16 : KERN_F32, KERN_F32,
                       NULL, 0 };
    if (rc == SCAPE_OK) {
        gpt_init(&r->model, p, r->model_seed);
        for (size_t i = 0; bp && i < n; i++)
            ph[i] = kern_bf16_from_f32(p[i]);
        rc = eng_create(&e, &cfg, &lay, a->comm, 1);
    }
    if (rc == SCAPE_OK)
        rc = eng_init_params(e, (void *const *)&pbuf);
    uint64_t seed = r->seed + 1000u * (uint64_t)a->rank;
    for (uint64_t t = 1; rc == SCAPE_OK && t <= r->steps; t++) {
        if (gpt_run_batch(r, sh->corpus, seed, t, x, y) != 0) {
            rc = scape_set_error(SCAPE_INVALID, "the training split is shorter than --seq");
            break;
        }
        for (size_t i = 0; bp && i < n; i++)
            p[i] = kern_f32_from_bf16(ph[i]);
        float l = gpt_forward_backward(&r->model, w, p, g, x, y, r->batch, r->seq);
        sh->train_loss[(t - 1) * (uint64_t)sh->ranks + (uint64_t)a->rank] = l;
        const void *gs[1] = { g };
        rc = eng_step(e, t, gpt_run_lr(r, t), gs, (void *const *)&pbuf);
        for (size_t i = 0; bp && rc == SCAPE_OK && i < n; i++)
            p[i] = kern_f32_from_bf16(ph[i]); /* what the evaluation reads */
        if (rc != SCAPE_OK || a->rank != 0)
            continue;
        eng_step_stats st;
        eng_last_stats(e, &st);
        uint64_t b = 0;
        for (int op = 0; op < COMM_OP_COUNT; op++)
            b += st.comm.bytes[op];
        sh->bytes[t - 1] = b;
        sh->mask[t - 1] = st.mask_bytes;
        sh->churn[t - 1] = st.mask_churn;
        int eval = (r->eval_every && t % r->eval_every == 0) || t == r->steps;
        sh->val_loss[t - 1] = eval ? gpt_run_val_loss(r, sh->corpus, w, p, x, y) : NAN;
        if (eval) {
            fprintf(stderr, "\r  %-16s step %llu/%llu  val %.4f", sh->name,
                    (unsigned long long)t, (unsigned long long)r->steps, sh->val_loss[t - 1]);
            fflush(stderr);
        }
    }
    eng_destroy(&e);
    gpt_work_free(w);
    free(p);
    free(ph);
    free(g);
    free(x);
    free(y);
    return rc;
}

/* A variant's engine settings: sharded, W = warmup and every optimizer
 * clipped at clip, then the --set pairs (KEY=VALUE, scaped's configuration
 * keys) over them.  Prints why and returns 2 on a bad pair. */
static int variant_config(const variant *v, long warmup, double clip, char *const *sets,
                          int nsets, eng_config *out)
{
    scaped_config c;
    cfg_defaults(&c);
    eng_config *e = &c.engine;
    eng_config_default(e);
    e->optimizer = v->opt;
    e->rho = v->rho;
    e->mode = ENG_MODE_SHARDED;
    e->warmup = (uint32_t)warmup;
    e->wire_bf16 = v->wire_bf16;
    e->rho_start = v->rho_start;
    e->rho_steps = v->rho_steps;
    e->mask_deltas = v->mask_deltas;
    e->dense_below = v->dense_below;
    e->gather = v->gather;
    e->max_grad_norm = (float)clip;
    for (int i = 0; i < nsets; i++) {
        char key[64];
        const char *eq = strchr(sets[i], '=');
        size_t kl = eq ? (size_t)(eq - sets[i]) : 0;
        if (eq == NULL || kl == 0 || kl >= sizeof key) {
            fprintf(stderr, "bench_quality: --set %s: want KEY=VALUE\n", sets[i]);
            return 2;
        }
        memcpy(key, sets[i], kl);
        key[kl] = '\0';
        if (cfg_set(&c, key, eq + 1, "--set") != SCAPE_OK) {
            fprintf(stderr, "bench_quality: %s\n", scape_last_error());
            return 2;
        }
    }
    *out = *e;
    return 0;
}

static int write_csv(const char *dir, const shared *sh)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/quality-%s.csv", dir, sh->name);
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        perror(path);
        return 1;
    }
    fprintf(f, "step,lr,loss,val_loss,bytes,mask_bytes,mask_churn\n");
    for (uint64_t t = 1; t <= sh->run->steps; t++) {
        double mean = 0.0;
        for (int q = 0; q < sh->ranks; q++)
            mean += sh->train_loss[(t - 1) * (uint64_t)sh->ranks + (uint64_t)q];
        fprintf(f, "%llu,%.6g,%.6f,%.6f,%llu,%llu,%.4f\n", (unsigned long long)t,
                (double)gpt_run_lr(sh->run, t), mean / sh->ranks, sh->val_loss[t - 1],
                (unsigned long long)sh->bytes[t - 1], (unsigned long long)sh->mask[t - 1],
                sh->churn[t - 1]);
    }
    return fclose(f) != 0;
}

int main(int argc, char **argv)
{
    gpt_run run;
    gpt_run_defaults(&run);
    run.steps = 3000;
    run.eval_every = 250;
    run.eval_batches = 16;
    int ranks = 4;
    long warmup = 10;
    double clip = 0.0;
    const char *out = ".", *only = NULL, *label = NULL;
    char *sets[MAX_SETS];
    int nsets = 0;
    for (int i = 1; i < argc; i++) {
        int took = gpt_run_option(&run, argc, argv, &i);
        if (took < 0)
            return 2;
        if (took)
            continue;
        if (i + 1 < argc && !strcmp(argv[i], "--ranks")) ranks = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--out")) out = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "--only")) only = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "--warmup")) warmup = atol(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--max-grad-norm")) clip = atof(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--name")) label = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "--set") && nsets < MAX_SETS)
            sets[nsets++] = argv[++i];
        else {
            fprintf(stderr, "usage: bench_quality --corpus FILE [--ranks R] [--out DIR] "
                            "[--only NAME [--name LABEL]] [--warmup W] [--max-grad-norm C] "
                            "[--set KEY=VALUE ...] [options]\n%s",
                    gpt_run_usage());
            return 2;
        }
    }
    if (label && !only) {
        fprintf(stderr, "bench_quality: --name labels one variant: give --only too\n");
        return 2;
    }
    if (run.corpus == NULL || ranks < 1 || ranks > MAX_RANKS || warmup < 1 ||
        warmup > 1000000 || !(clip >= 0.0 && clip <= 1e6)) {
        fprintf(stderr, "bench_quality: --corpus is required; --ranks in [1, %d]; --warmup in "
                        "[1, 1000000]; --max-grad-norm in [0, 1e6]\n", MAX_RANKS);
        return 2;
    }
    if (mkdir(out, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "bench_quality: cannot create --out %s: %s\n", out, strerror(errno));
        return 1;
    }
    gpt_corpus corpus;
    char err[256];
    if (gpt_corpus_load(run.corpus, &corpus, err, sizeof err) != 0) {
        fprintf(stderr, "bench_quality: %s\n", err);
        return 1;
    }
    run.model.vocab = corpus.vocab;
    if (run.seq > run.model.ctx)
        run.seq = run.model.ctx;
    int nt = gpt_layout(&run.model, NULL, 0);
    if (nt <= 0) {
        fprintf(stderr, "bench_quality: invalid model shape\n");
        return 2;
    }
    gpt_tensor *gt = calloc((size_t)nt, sizeof *gt);
    eng_tensor *lay = calloc((size_t)nt, sizeof *lay);
    float *tl = calloc(run.steps * (uint64_t)ranks, sizeof *tl);
    double *vl = calloc(run.steps, sizeof *vl);
    uint64_t *by = calloc(run.steps, sizeof *by), *mb = calloc(run.steps, sizeof *mb);
    double *ch = calloc(run.steps, sizeof *ch);
    if (!gt || !lay || !tl || !vl || !by || !mb || !ch) {
        fprintf(stderr, "bench_quality: out of memory\n");
        return 1;
    }
    gpt_layout(&run.model, gt, nt);
    for (int i = 0; i < nt; i++)
        lay[i] = (eng_tensor){ gt[i].name, gt[i].offset, gt[i].length, 0 };
    size_t n = gpt_num_params(&run.model);
    printf("bench_quality: GPT d=%d layers=%d heads=%d ctx=%d vocab=%d, N=%zu; %d ranks x "
           "batch %d x seq %d; %llu steps, lr %g (warm-up %llu, cosine), sharded, W=%ld, "
           "max_grad_norm %g; corpus %zu train / %zu val tokens\n",
           run.model.d, run.model.layers, run.model.heads, run.model.ctx, run.model.vocab, n,
           ranks, run.batch, run.seq, (unsigned long long)run.steps, (double)run.lr,
           (unsigned long long)run.lr_warmup, warmup, clip, corpus.n_train, corpus.n_val);
    printf("%-16s %10s %10s %14s %9s %9s\n", "optimizer", "val loss", "train loss",
           "bytes/step", "of adams", "wall s");
    double adams_bytes = 4.0 * (double)n * 2.0; /* dense sharded: reduce-scatter + all-gather */
    int rc = 0, ran = 0;
    for (size_t v = 0; v < NVARIANTS && rc == 0; v++) {
        if (only && strcmp(only, s_variants[v].name) != 0)
            continue;
        ran++;
        shared sh = { .run = &run, .corpus = &corpus, .v = &s_variants[v],
                      .name = label ? label : s_variants[v].name, .layout = lay,
                      .ntensors = nt, .ranks = ranks, .train_loss = tl, .val_loss = vl,
                      .bytes = by, .mask = mb, .churn = ch };
        if (variant_config(&s_variants[v], warmup, clip, sets, nsets, &sh.cfg) != 0)
            return 2;
        rank_arg args[MAX_RANKS];
        double t0 = now_s();
        if (run_ranks(ranks, rank_train, &sh, args) != 0) {
            fprintf(stderr, "bench_quality: cannot start the ranks\n");
            return 1;
        }
        double wall = now_s() - t0;
        fprintf(stderr, "\r\033[K");
        for (int r = 0; r < ranks; r++)
            if (args[r].rc != SCAPE_OK) {
                fprintf(stderr, "bench_quality: %s rank %d: %s\n", sh.name, r,
                        args[r].err);
                rc = 1;
            }
        if (rc)
            break;
        double sum = 0.0, tail = 0.0;
        uint64_t from = run.steps > 100 ? run.steps - 100 : 0;
        for (uint64_t t = 0; t < run.steps; t++) {
            sum += (double)by[t];
            if (t >= from)
                for (int q = 0; q < ranks; q++)
                    tail += tl[t * (uint64_t)ranks + (uint64_t)q];
        }
        double mean_bytes = sum / (double)run.steps;
        printf("%-16s %10.4f %10.4f %14.0f %8.2f%% %9.1f\n", sh.name,
               vl[run.steps - 1], tail / (double)((run.steps - from) * (uint64_t)ranks),
               mean_bytes, 100.0 * mean_bytes / adams_bytes, wall);
        fflush(stdout);
        rc = write_csv(out, &sh);
    }
    if (only && !ran) {
        fprintf(stderr, "bench_quality: no variant '%s'; there are:", only);
        for (size_t v = 0; v < NVARIANTS; v++)
            fprintf(stderr, " %s", s_variants[v].name);
        fprintf(stderr, "\n");
        rc = 2;
    }
    free(gt);
    free(lay);
    free(tl);
    free(vl);
    free(by);
    free(mb);
    free(ch);
    gpt_corpus_free(&corpus);
    return rc;
}
