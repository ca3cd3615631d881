/* bench_comm.c - bytes on the wire per step and step time of the engine on
 * the host comm backend (ranks as threads over 127.0.0.1), next to the wire
 * cost formulas of docs/algorithm.md.  Figures are ratios to dense AdamS of the
 * same run; nothing fails on timing.  Exit 0, 1 on an engine, comm or
 * validation failure (ranks' final parameters not bitwise identical), 2 on
 * bad arguments.  The step time is measured over plain TCP (auth: none) and
 * over CURVE (what an authenticated job runs: every message authenticated and
 * encrypted), so the encryption's cost is a ratio of the same run.
 *
 * usage: bench_comm [--quick] [--markdown FILE]
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "comm_host.h"
#include "engine.h"
#include "maskcode.h"
#include "plan.h"
#include "synth.h"
#include "try.h"
#include "bench_host.h"

#define MAXR 8
#define SEED 1u
#define LR 1e-2f
#define TIMEOUT_MS 300000
#define FIRST 3             /* first measured step (warm-up is step 1) */
#define NBYTES_ROWS 12
#define NTIME_ROWS 4 /* adams, scape; plain TCP, then CURVE */
#define NCOL 13

typedef struct spec {
    eng_optimizer opt;
    double rho;
    int R;
    size_t n_req;   /* synth_layout's size argument */
    uint64_t steps; /* steps FIRST..steps are measured */
    int sync;       /* barrier before each step (timing runs) */
    int curve;      /* the data plane runs CURVE */
} spec;

/* Sums over the measured steps of one rank. */
typedef struct rank_out {
    double k, reduce_b, mask_b, model_b, real_b, step_s;
    float *theta; /* final parameters */
    scape_rc rc;
    char err[512];
} rank_out;

typedef struct job {
    const spec *s;
    const eng_tensor *ts;
    size_t nt, n;
    int rank;
    comm_t *comm;
    rank_out *out;
} job;

/* Per-step means: k and payloads of rank 0, model and real bytes and step
 * time averaged over the ranks, and the real bytes of the rank that received
 * most. */
typedef struct result {
    spec s;
    size_t n;
    double k, reduce_b, mask_b, model_b, real_b, real_max_b, step_ms;
    double code_b; /* the mask all-gather's payload from the plan: every rank's code */
} result;

typedef struct report {
    char head[1024], md_head[2048];
    result bytes[NBYTES_ROWS], time[NTIME_ROWS];
} report;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void fill_grad(const job *j, uint64_t t, const float *p, float *g)
{
    uint64_t seed = SEED + 1000u * (uint64_t)j->rank;
    for (size_t l = 0; l < j->nt; l++)
        for (size_t i = j->ts[l].offset; i < j->ts[l].offset + j->ts[l].length; i++)
            g[i] = synth_grad(seed, 0, t, i, p[i], synth_scale(l));
}

static void account(rank_out *o, const eng_step_stats *st, double secs)
{
    const comm_stats *c = &st->comm;
    o->k += (double)st->k;
    o->reduce_b += (double)(c->bytes[COMM_ALLREDUCE] + c->bytes[COMM_REDUCE_SCATTER]);
    o->mask_b += (double)(c->bytes[COMM_ALLGATHER] + c->bytes[COMM_IALLGATHER]);
    for (int op = 0; op < COMM_OP_COUNT; op++)
        o->model_b += (double)c->wire_bytes[op];
    o->step_s += secs;
}

static scape_rc one_step(const job *j, eng_t *e, uint64_t t, float *p, float *g)
{
    fill_grad(j, t, p, g);
    if (j->s->sync)
        TRY(comm_barrier(j->comm));
    double t0 = now_s();
    TRY(eng_step(e, t, LR, (const void *const *)&g, (void *const *)&p));
    double secs = now_s() - t0;
    if (t >= FIRST) {
        eng_step_stats st;
        TRY(eng_last_stats(e, &st));
        account(j->out, &st, secs);
    }
    return SCAPE_OK;
}

/* Real bytes received over the measured steps: the delta of the host
 * backend's counter from the end of step FIRST-1 to the end of the run. */
static scape_rc train(const job *j, eng_t *e, float *p, float *g)
{
    uint64_t sent, r0 = 0, r1 = 0;
    for (uint64_t t = 1; t <= j->s->steps; t++) {
        TRY(one_step(j, e, t, p, g));
        if (t + 1 == FIRST)
            TRY(comm_host_wire_stats(j->comm, &sent, &r0));
    }
    TRY(comm_host_wire_stats(j->comm, &sent, &r1));
    j->out->real_b = (double)(r1 - r0);
    memcpy(j->out->theta, p, j->n * sizeof *p);
    return SCAPE_OK;
}

static scape_rc rank_run(const job *j, float *p, float *g)
{
    uint64_t seed = SEED + 1000u * (uint64_t)j->rank;
    for (size_t i = 0; i < j->n; i++)
        p[i] = synth_init(seed, 0, i);
    eng_config cfg;
    eng_config_default(&cfg);
    cfg.optimizer = j->s->opt;
    cfg.mode = ENG_MODE_REPLICATED;
    cfg.rho = j->s->rho;
    cfg.warmup = 1;
    eng_layout lay = { j->ts, j->nt, KERN_F32, KERN_F32, NULL, 0 };
    eng_t *e = NULL;
    scape_rc rc = eng_create(&e, &cfg, &lay, j->comm, 1);
    if (rc == SCAPE_OK)
        rc = eng_init_params(e, (void *const *)&p);
    if (rc == SCAPE_OK)
        rc = train(j, e, p, g);
    eng_destroy(&e);
    return rc;
}

static void *rank_thread(void *arg)
{
    job *j = arg;
    float *p = malloc(j->n * sizeof *p), *g = malloc(j->n * sizeof *g);
    j->out->rc = p && g ? rank_run(j, p, g)
                        : scape_set_error(SCAPE_NOMEM, "bench_comm: out of memory");
    if (j->out->rc != SCAPE_OK)
        snprintf(j->out->err, sizeof j->out->err, "%s", scape_last_error());
    free(p);
    free(g);
    return NULL;
}

/* A host group on random ports outside the ephemeral range, retried when a
 * port is taken (as test_comm_host.c). */
static scape_rc group_try(int R, int curve, char ep[][40], comm_t **c)
{
    const char *eps[MAXR], *pubs[MAXR];
    char pub[MAXR][41], sec[MAXR][41];
    int base = 20000 + (int)((unsigned)rand() % 12000u);
    for (int r = 0; r < R; r++) {
        snprintf(ep[r], 40, "tcp://127.0.0.1:%d", base + r);
        eps[r] = ep[r];
        if (curve && zmq_curve_keypair(pub[r], sec[r]) != 0)
            return scape_set_error(SCAPE_ZMQ, "zmq_curve_keypair failed");
        pubs[r] = pub[r];
    }
    for (int r = 0; r < R; r++) {
        comm_host_opts o = { .rank = r, .size = R, .endpoints = eps,
                             .timeout_ms = TIMEOUT_MS, .job = 1,
                             .curve_public = curve ? pub[r] : NULL,
                             .curve_secret = curve ? sec[r] : NULL,
                             .curve_keys = curve ? pubs : NULL };
        scape_rc rc = comm_host_create(&o, &c[r]);
        if (rc != SCAPE_OK) {
            while (r-- > 0)
                comm_destroy(&c[r]);
            return rc;
        }
    }
    return SCAPE_OK;
}

static scape_rc group_open(int R, int curve, comm_t **c)
{
    char ep[MAXR][40];
    scape_rc rc = SCAPE_ZMQ;
    for (int attempt = 0; attempt < 20 && rc != SCAPE_OK; attempt++)
        rc = group_try(R, curve, ep, c);
    return rc;
}

static size_t make_layout(size_t n_req, eng_tensor *ts, char names[][16], size_t *nt)
{
    size_t off[SYNTH_MAX_TENSORS], len[SYNTH_MAX_TENSORS];
    *nt = synth_layout(n_req, off, len, names);
    for (size_t l = 0; l < *nt; l++)
        ts[l] = (eng_tensor){ names[l], off[l], len[l], 0 };
    return off[*nt - 1] + len[*nt - 1];
}

static int check_ranks(const spec *s, const rank_out *o, size_t n)
{
    int bad = 0;
    for (int r = 0; r < s->R; r++) {
        if (o[r].rc != SCAPE_OK) {
            fprintf(stderr, "bench_comm: %s R=%d rank %d: %s\n",
                    eng_optimizer_name(s->opt), s->R, r, o[r].err);
            bad = 1;
        } else if (memcmp(o[r].theta, o[0].theta, n * sizeof(float)) != 0) {
            fprintf(stderr, "bench_comm: %s R=%d: rank %d's parameters differ from "
                    "rank 0's\n", eng_optimizer_name(s->opt), s->R, r);
            bad = 1;
        }
    }
    return bad;
}

static void summarize(const rank_out *o, result *res)
{
    double m = (double)(res->s.steps - FIRST + 1), R = res->s.R;
    res->k = o[0].k / m;
    res->reduce_b = o[0].reduce_b / m;
    res->mask_b = o[0].mask_b / m;
    for (int r = 0; r < res->s.R; r++) {
        res->model_b += o[r].model_b / (m * R);
        res->real_b += o[r].real_b / (m * R);
        if (o[r].real_b / m > res->real_max_b)
            res->real_max_b = o[r].real_b / m;
        res->step_ms += 1e3 * o[r].step_s / (m * R);
    }
}

static void run_threads(job *jobs, int R)
{
    pthread_t th[MAXR];
    int started[MAXR] = { 0 };
    for (int r = 0; r < R; r++) {
        started[r] = pthread_create(&th[r], NULL, rank_thread, &jobs[r]) == 0;
        if (!started[r])
            jobs[r].out->rc = scape_set_error(SCAPE_NOMEM, "bench_comm: no thread");
    }
    for (int r = 0; r < R; r++)
        if (started[r])
            pthread_join(th[r], NULL);
}

/* Run one configuration; 0 on success, 1 on any failure. */
static int run_case(const spec *s, result *res)
{
    eng_tensor ts[SYNTH_MAX_TENSORS];
    char names[SYNTH_MAX_TENSORS][16];
    rank_out out[MAXR] = { 0 };
    job jobs[MAXR];
    comm_t *c[MAXR] = { 0 };
    size_t nt, n = make_layout(s->n_req, ts, names, &nt);
    *res = (result){ .s = *s, .n = n };
    plan *p = NULL;
    if (plan_build(&p, ts, nt, s->R, s->rho) != SCAPE_OK) {
        fprintf(stderr, "bench_comm: %s\n", scape_last_error());
        return 1;
    }
    for (int r = 0; r < s->R; r++)
        res->code_b += s->opt == ENG_OPT_TOPK_ADAMW
                           ? (double)mcode_bytes(p, 0, p->ntensors)
                           : (double)mcode_bytes(p, p->shard[r].first, p->shard[r].count);
    plan_destroy(&p);
    fprintf(stderr, "bench_comm: %s rho=%g R=%d N=%zu%s ...\n", eng_optimizer_name(s->opt),
            s->rho, s->R, n, s->curve ? " CURVE" : "");
    if (group_open(s->R, s->curve, c) != SCAPE_OK) {
        fprintf(stderr, "bench_comm: cannot open a host group: %s\n", scape_last_error());
        return 1;
    }
    int bad = 0;
    for (int r = 0; r < s->R; r++) {
        out[r].theta = malloc(n * sizeof(float));
        jobs[r] = (job){ s, ts, nt, n, r, c[r], &out[r] };
        bad |= out[r].theta == NULL;
    }
    if (bad)
        fprintf(stderr, "bench_comm: out of memory\n");
    else
        run_threads(jobs, s->R);
    bad = bad || check_ranks(s, out, n);
    summarize(out, res);
    for (int r = 0; r < s->R; r++) {
        comm_destroy(&c[r]);
        free(out[r].theta);
    }
    return bad;
}

/* docs/algorithm.md's bytes received per rank and step: ring all-reduce of the
 * values plus the mask all-gather, whose payload is the mask code
 * (maskcode.h) instead of the design's N-bit bitmap: a rank receives every
 * other rank's code, (R-1)/R of the total on average (SCAPE: the owners'
 * bits, sum_l k_l in all; topk-adamw: every rank's bits of every tensor). */
static double formula(const result *r)
{
    double R = r->s.R, ring = 2.0 * (R - 1.0) / R, n = (double)r->n;
    switch (r->s.opt) {
    case ENG_OPT_SCAPE:
        return ring * 4.0 * r->k + (R - 1.0) / R * r->code_b;
    case ENG_OPT_TOPK_ADAMW:
        return ring * 4.0 * r->k + (R - 1.0) / R * r->code_b;
    default:
        return ring * 4.0 * n;
    }
}

/* ---- output ------------------------------------------------------------ */

static void emit(FILE *f, int md, char cells[][32], const int *width, int ncol)
{
    for (int i = 0; i < ncol; i++) {
        if (md)
            fprintf(f, "| %s ", cells[i]);
        else
            fprintf(f, "%*s ", width[i], cells[i]);
    }
    fputs(md ? "|\n" : "\n", f);
}

static void emit_rule(FILE *f, int ncol)
{
    fputs("|---", f);
    for (int i = 1; i < ncol; i++)
        fputs("|---:", f);
    fputs("|\n", f);
}

static void rho_cell(char *cell, const result *r)
{
    if (r->s.opt == ENG_OPT_ADAMS)
        snprintf(cell, 32, "-");
    else
        snprintf(cell, 32, "%g", r->s.rho);
}

static void bytes_cells(const result *r, const result *dense, char c[][32])
{
    double f = formula(r), fd = formula(dense);
    snprintf(c[0], 32, "%s", eng_optimizer_name(r->s.opt));
    rho_cell(c[1], r);
    snprintf(c[2], 32, "%d", r->s.R);
    snprintf(c[3], 32, "%.0f", r->k);
    snprintf(c[4], 32, "%.0f", r->reduce_b);
    snprintf(c[5], 32, "%.0f", r->mask_b);
    snprintf(c[6], 32, "%.0f", r->model_b);
    snprintf(c[7], 32, "%.0f", f);
    snprintf(c[8], 32, "%.0f", r->real_b);
    snprintf(c[9], 32, "%.0f", r->real_max_b);
    snprintf(c[10], 32, "%.2f", r->real_b / f);
    snprintf(c[11], 32, "%.4f", f / fd);
    snprintf(c[12], 32, "%.4f", r->real_b / dense->real_b);
}

static const char *const s_bytes_head[NCOL] = {
    "optimizer", "rho", "R", "K", "reduce payload B", "mask payload B", "ring model B",
    "formula B", "real recv B", "real max B", "real/formula", "formula/dense", "real/dense"
};
static const int s_bytes_w[NCOL] = { 10, 5, 2, 8, 16, 14, 12, 10, 11, 10, 12, 13, 10 };

static void print_bytes(FILE *f, int md, const report *rep)
{
    char c[NCOL][32];
    for (int i = 0; i < NCOL; i++)
        snprintf(c[i], 32, "%s", s_bytes_head[i]);
    emit(f, md, c, s_bytes_w, NCOL);
    if (md)
        emit_rule(f, NCOL);
    for (int i = 0; i < NBYTES_ROWS; i++) {
        bytes_cells(&rep->bytes[i], &rep->bytes[i / 4 * 4], c);
        emit(f, md, c, s_bytes_w, NCOL);
    }
}

static void print_time(FILE *f, int md, const report *rep)
{
    static const char *const head[8] = { "optimizer", "rho", "R", "data plane", "K",
                                         "step ms", "ratio vs dense", "CURVE vs plain" };
    static const int w[8] = { 10, 5, 2, 10, 8, 9, 14, 14 };
    char c[8][32];
    for (int i = 0; i < 8; i++)
        snprintf(c[i], 32, "%s", head[i]);
    emit(f, md, c, w, 8);
    if (md)
        emit_rule(f, 8);
    for (int i = 0; i < NTIME_ROWS; i++) {
        const result *r = &rep->time[i];
        const result *dense = &rep->time[i / 2 * 2], *plain = &rep->time[i % 2];
        snprintf(c[0], 32, "%s", eng_optimizer_name(r->s.opt));
        rho_cell(c[1], r);
        snprintf(c[2], 32, "%d", r->s.R);
        snprintf(c[3], 32, "%s", r->s.curve ? "CURVE" : "plain TCP");
        snprintf(c[4], 32, "%.0f", r->k);
        snprintf(c[5], 32, "%.2f", r->step_ms);
        snprintf(c[6], 32, "%.3f", r->step_ms / dense->step_ms);
        snprintf(c[7], 32, "%.3f", r->step_ms / plain->step_ms);
        emit(f, md, c, w, 8);
    }
}

static void print_markdown(FILE *f, const report *rep)
{
    const result *b = &rep->bytes[0], *t = &rep->time[0];
    fprintf(f, "<!-- bench-comm:begin -->\n%s\n\n", rep->md_head);
    fprintf(f, "Bytes per rank and step, N = %zu, replicated, 1 trainer per rank, mean of "
            "steps %d..%llu:\n\n", b->n, FIRST, (unsigned long long)b->s.steps);
    print_bytes(f, 1, rep);
    fprintf(f, "\nEngine step, N = %zu, R = %d, mean of steps %d..%llu over ranks:\n\n",
            t->n, t->s.R, FIRST, (unsigned long long)t->s.steps);
    print_time(f, 1, rep);
    fputs("<!-- bench-comm:end -->\n", f);
}

static void print_text(FILE *f, const report *rep)
{
    fprintf(f, "%s\n\nbytes per rank and step, N=%zu, replicated, 1 trainer/rank, "
            "steps %d..%llu\n", rep->head, rep->bytes[0].n, FIRST,
            (unsigned long long)rep->bytes[0].s.steps);
    print_bytes(f, 0, rep);
    fprintf(f, "\nengine step, N=%zu, R=%d, steps %d..%llu, mean over ranks\n",
            rep->time[0].n, rep->time[0].s.R, FIRST,
            (unsigned long long)rep->time[0].s.steps);
    print_time(f, 0, rep);
    fputc('\n', f);
    print_markdown(f, rep);
}

/* ---- header and driver --------------------------------------------------- */

static void make_heads(report *rep, int argc, char **argv)
{
    char date[64], host[128] = "unknown", cpu[256], cmd[512] = "";
    time_t now = time(NULL);
    struct tm tm;
    strftime(date, sizeof date, "%Y-%m-%d %H:%M:%S %Z", gmtime_r(&now, &tm));
    if (gethostname(host, sizeof host - 1) != 0)
        snprintf(host, sizeof host, "unknown");
    bench_cpu_model(cpu, sizeof cpu);
    for (int i = 0; i < argc; i++) {
        size_t used = strlen(cmd);
        snprintf(cmd + used, sizeof cmd - used, "%s%s", i ? " " : "", argv[i]);
    }
    snprintf(rep->head, sizeof rep->head,
             "bench_comm  date: %s  host: %s  cpu: %s\ncommand: %s", date, host, cpu, cmd);
    snprintf(rep->md_head, sizeof rep->md_head,
             "Measured %s on `%s` (%s) with `%s`; host backend, ranks as threads over "
             "127.0.0.1.", date, host, cpu, cmd);
}

static int run_bytes(report *rep, int quick)
{
    static const struct { eng_optimizer opt; double rho; } opts[4] = {
        { ENG_OPT_ADAMS, 1.0 }, { ENG_OPT_SCAPE, 0.1 }, { ENG_OPT_SCAPE, 0.01 },
        { ENG_OPT_TOPK_ADAMW, 0.01 }
    };
    static const int ranks[3] = { 2, 4, 8 };
    int bad = 0;
    for (int i = 0; i < NBYTES_ROWS && !bad; i++) {
        spec s = { opts[i % 4].opt, opts[i % 4].rho, ranks[i / 4],
                   quick ? 100000 : 1000000, quick ? 4 : 6, 0, 0 };
        bad = run_case(&s, &rep->bytes[i]);
    }
    return bad;
}

static int run_time(report *rep, int quick)
{
    int bad = 0;
    for (int i = 0; i < NTIME_ROWS && !bad; i++) {
        int scape = i % 2;
        spec s = { scape ? ENG_OPT_SCAPE : ENG_OPT_ADAMS, scape ? 0.01 : 1.0, 4,
                   quick ? 1000000 : 10000000, quick ? 5 : 12, 1, i / 2 };
        bad = run_case(&s, &rep->time[i]);
    }
    return bad;
}

static int write_markdown(const char *path, const report *rep)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        perror(path);
        return 1;
    }
    print_markdown(f, rep);
    if (fclose(f) != 0) {
        perror(path);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    int quick = 0;
    const char *md = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) {
            quick = 1;
        } else if (!strcmp(argv[i], "--markdown") && i + 1 < argc) {
            md = argv[++i];
        } else {
            fprintf(stderr, "usage: bench_comm [--quick] [--markdown FILE]\n");
            return 2;
        }
    }
    srand((unsigned)getpid() ^ (unsigned)time(NULL));
    static report rep;
    make_heads(&rep, argc, argv);
    if (run_bytes(&rep, quick) || run_time(&rep, quick))
        return 1;
    print_text(stdout, &rep);
    return md ? write_markdown(md, &rep) : 0;
}
