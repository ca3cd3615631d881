/* bench_threads.c - the engine step of one daemon's engine (one rank, T
 * trainers' gradients in memory) against its engine_threads.  Per optimizer
 * it runs the same steps with each thread count, rounds alternating so that
 * every count sees the same load on the machine, and reports the median
 * step and the speed-up over the first thread count (1 by default) in the
 * same run.  The final parameters of
 * every thread count must be bitwise equal (exit 1 otherwise); nothing fails
 * on timing.
 *
 * usage: bench_threads [--n N] [--trainers T] [--steps S] [--rounds R]
 *                      [--threads a,b,...] [--quick]
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm.h"
#include "engine.h"
#include "synth.h"
#include "bench_host.h"

#define MAX_COUNTS 8
#define MAX_TR 16
#define MAX_ROUNDS 64
#define MAX_STEPS 1024
#define SEED 1u

typedef struct opts {
    size_t n;
    int trainers, steps, rounds, ncounts;
    int counts[MAX_COUNTS];
} opts;

typedef struct layout {
    eng_tensor ts[SYNTH_MAX_TENSORS];
    char names[SYNTH_MAX_TENSORS][16];
    size_t nt, n;
} layout;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* One run: `steps` steps from the same start; per-step seconds of steps
 * 3.. into dt, the final parameters of trainer 0 into out. */
static scape_rc run_once(const opts *o, const layout *L, eng_optimizer opt, int threads,
                         float **p, float **g, double *dt, float *out)
{
    for (int q = 0; q < o->trainers; q++)
        for (size_t i = 0; i < L->n; i++)
            p[q][i] = synth_init(SEED, 0, i);
    comm_t *c = NULL;
    eng_t *e = NULL;
    eng_config cfg;
    eng_config_default(&cfg);
    cfg.optimizer = opt;
    cfg.rho = opt == ENG_OPT_SCAPE ? 0.01 : 1.0;
    cfg.threads = threads;
    eng_layout lay = { L->ts, L->nt, KERN_F32, KERN_F32, NULL, 0 };
    scape_rc rc = comm_local_create(1, &c);
    if (rc == SCAPE_OK)
        rc = eng_create(&e, &cfg, &lay, c, o->trainers);
    if (rc == SCAPE_OK)
        rc = eng_init_params(e, (void *const *)p);
    for (int t = 1; rc == SCAPE_OK && t <= o->steps; t++) {
        for (int q = 0; q < o->trainers; q++)
            for (size_t l = 0; l < L->nt; l++)
                for (size_t i = L->ts[l].offset; i < L->ts[l].offset + L->ts[l].length; i++)
                    g[q][i] = synth_grad(SEED, q, (uint64_t)t, i, p[q][i], synth_scale(l));
        double t0 = now_s();
        rc = eng_step(e, (uint64_t)t, 1e-2f, (const void *const *)g, (void *const *)p);
        if (t >= 3)
            dt[t - 3] = now_s() - t0;
    }
    if (rc == SCAPE_OK)
        memcpy(out, p[0], L->n * sizeof *out);
    eng_destroy(&e);
    comm_destroy(&c);
    return rc;
}

static int parse(int argc, char **argv, opts *o)
{
    long nproc = sysconf(_SC_NPROCESSORS_ONLN);
    *o = (opts){ .n = 10000000, .trainers = 4, .steps = 12, .rounds = 3, .ncounts = 0 };
    for (int t = 1; t <= (nproc > 1 ? nproc : 1) && o->ncounts < MAX_COUNTS; t *= 2)
        o->counts[o->ncounts++] = t;
    if (o->ncounts == 1)
        o->counts[o->ncounts++] = 2;
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(k, "--quick")) {
            o->n = 100000;
            o->steps = 5;
            o->rounds = 1;
            continue;
        }
        if (v == NULL)
            return 1;
        i++;
        if (!strcmp(k, "--n"))
            o->n = (size_t)strtod(v, NULL);
        else if (!strcmp(k, "--trainers"))
            o->trainers = atoi(v);
        else if (!strcmp(k, "--steps"))
            o->steps = atoi(v);
        else if (!strcmp(k, "--rounds"))
            o->rounds = atoi(v);
        else if (!strcmp(k, "--threads")) {
            o->ncounts = 0;
            for (char *s = (char *)v; *s && o->ncounts < MAX_COUNTS;) {
                char *end;
                o->counts[o->ncounts++] = (int)strtol(s, &end, 10);
                s = *end == ',' ? end + 1 : end;
                if (end == s && *s)
                    return 1;
            }
        } else
            return 1;
    }
    return o->n < 64 || o->trainers < 1 || o->trainers > MAX_TR || o->steps < 3 ||
           o->steps > MAX_STEPS || o->rounds < 1 || o->rounds > MAX_ROUNDS || o->ncounts < 1;
}

int main(int argc, char **argv)
{
    opts o;
    if (parse(argc, argv, &o)) {
        fprintf(stderr, "usage: bench_threads [--n N] [--trainers T] [--steps S] "
                        "[--rounds R] [--threads a,b,...] [--quick]\n");
        return 2;
    }
    layout L;
    size_t off[SYNTH_MAX_TENSORS], len[SYNTH_MAX_TENSORS];
    L.nt = synth_layout(o.n, off, len, L.names);
    for (size_t l = 0; l < L.nt; l++)
        L.ts[l] = (eng_tensor){ L.names[l], off[l], len[l], 0 };
    L.n = off[L.nt - 1] + len[L.nt - 1];
    float *p[MAX_TR], *g[MAX_TR], *ref = malloc(L.n * sizeof *ref),
                                 *out = malloc(L.n * sizeof *out);
    int bad = ref == NULL || out == NULL;
    for (int q = 0; q < o.trainers; q++) {
        p[q] = malloc(L.n * sizeof(float));
        g[q] = malloc(L.n * sizeof(float));
        bad |= p[q] == NULL || g[q] == NULL;
    }
    if (bad) {
        fprintf(stderr, "bench_threads: out of memory\n");
        return 1;
    }
    char cpu[256];
    bench_cpu_model(cpu, sizeof cpu);
    printf("bench_threads: N=%zu, %d trainers, %d steps (steps 3.. timed), %d rounds; "
           "cpu: %s, %ld online\n", L.n, o.trainers, o.steps, o.rounds, cpu,
           sysconf(_SC_NPROCESSORS_ONLN));
    printf("%-8s %8s %12s %10s\n", "opt", "threads", "step ms", "speed-up");
    static const eng_optimizer opt_list[2] = { ENG_OPT_SCAPE, ENG_OPT_ADAMS };
    int per = o.steps - 2;
    static double dt[MAX_COUNTS][MAX_ROUNDS * MAX_STEPS];
    for (int oi = 0; oi < 2; oi++) {
        for (int r = 0; r < o.rounds; r++)
            for (int k = 0; k < o.ncounts; k++) {
                fprintf(stderr, "bench_threads: %s, %d thread(s), round %d/%d ...\n",
                        eng_optimizer_name(opt_list[oi]), o.counts[k], r + 1, o.rounds);
                scape_rc rc = run_once(&o, &L, opt_list[oi], o.counts[k], p, g,
                                       dt[k] + (size_t)r * per, k || r ? out : ref);
                if (rc != SCAPE_OK) {
                    fprintf(stderr, "bench_threads: %s\n", scape_last_error());
                    bad = 1;
                } else if ((k || r) && memcmp(out, ref, L.n * sizeof *out) != 0) {
                    fprintf(stderr, "bench_threads: %s with %d threads: parameters differ "
                            "from %d thread(s)'s\n", eng_optimizer_name(opt_list[oi]),
                            o.counts[k], o.counts[0]);
                    bad = 1;
                }
                if (bad)
                    goto out;
            }
        double base = 0.0;
        for (int k = 0; k < o.ncounts; k++) {
            double m = 1e3 * bench_median(dt[k], o.rounds * per);
            if (k == 0)
                base = m;
            printf("%-8s %8d %12.2f %9.2fx\n", eng_optimizer_name(opt_list[oi]), o.counts[k],
                   m, base / m);
        }
    }
    printf("bench_threads: final parameters bitwise equal for every thread count\n");
out:
    for (int q = 0; q < o.trainers; q++) {
        free(p[q]);
        free(g[q]);
    }
    free(ref);
    free(out);
    return bad;
}
