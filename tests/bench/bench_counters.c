/* bench_counters.c - the engine's own byte counters for one configuration,
 * for the projection of tests/bench/project.py.
 *
 * R ranks run as threads on the local backend, sharded, one trainer each,
 * on gpt_layout.h's GPT of 1.82e9 parameters with every tensor length
 * multiplied by --scale (at least 1).  After the dense warm-up step and --steps sparse steps it
 * prints one JSON object: N, K, and per phase the slowest rank's bytes
 * through the state's memory, bytes between host and device (the
 * executor's byte model of its own kernels: eng_step_stats.mem_bytes and
 * link_bytes), the host copies around collectives (bounce_bytes: the sim
 * executor on the local backend has them, the cuda executor on nccl not),
 * the comm's payload and ring-model bytes, and the measured seconds here,
 * for the last step.
 *
 * usage: bench_counters [--executor host|sim] [--ranks R] [--rho RHO | --dense]
 *                       [--scale S] [--steps N]
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "gpt_layout.h"

#define MAX_R 256

typedef struct run {
    eng_config cfg;
    int R, steps;
    eng_tensor ts[GPT_TENSORS];
    size_t nt, n;
    float *grads;             /* one gradient for every rank (read only) */
    comm_t *comms[MAX_R];
    eng_step_stats st[MAX_R];
    scape_rc rc[MAX_R];
    char err[MAX_R][256];
} run;

typedef struct rank_arg {
    run *r;
    int rank;
} rank_arg;

static void *rank_main(void *p)
{
    rank_arg *a = p;
    run *r = a->r;
    float *params = calloc(r->n, sizeof *params);
    eng_layout lay = { r->ts, r->nt, KERN_F32, KERN_F32, NULL, 0 };
    eng_t *e = NULL;
    scape_rc rc = params ? eng_create(&e, &r->cfg, &lay, r->comms[a->rank], 1)
                         : scape_set_error(SCAPE_NOMEM, "out of memory");
    if (rc == SCAPE_OK)
        rc = eng_init_params(e, (void *const *)&params);
    const void *g = r->grads;
    for (uint64_t t = 1; rc == SCAPE_OK && t <= (uint64_t)r->steps + 1; t++) {
        rc = eng_step(e, t, 1e-3f, &g, (void *const *)&params);
        if (rc == SCAPE_OK)
            rc = eng_step_finish(e); /* its selection counts to the step */
    }
    if (rc == SCAPE_OK)
        rc = eng_last_stats(e, &r->st[a->rank]);
    r->rc[a->rank] = rc;
    if (rc != SCAPE_OK)
        snprintf(r->err[a->rank], sizeof r->err[a->rank], "%s", scape_last_error());
    eng_destroy(&e);
    free(params);
    return NULL;
}

static uint64_t most(const run *r, const uint64_t *(*field)(const eng_step_stats *), int i)
{
    uint64_t m = 0;
    for (int q = 0; q < r->R; q++)
        m = field(&r->st[q])[i] > m ? field(&r->st[q])[i] : m;
    return m;
}

static const uint64_t *mem_of(const eng_step_stats *s) { return s->mem_bytes; }
static const uint64_t *link_of(const eng_step_stats *s) { return s->link_bytes; }
static const uint64_t *bytes_of(const eng_step_stats *s) { return s->comm.bytes; }
static const uint64_t *wire_of(const eng_step_stats *s) { return s->comm.wire_bytes; }

static void print_array(const char *name, const run *r,
                        const uint64_t *(*field)(const eng_step_stats *), int count)
{
    printf(", \"%s\": [", name);
    for (int i = 0; i < count; i++)
        printf("%s%llu", i ? ", " : "", (unsigned long long)most(r, field, i));
    printf("]");
}

int main(int argc, char **argv)
{
    static run r;
    eng_config_default(&r.cfg);
    r.cfg.mode = ENG_MODE_SHARDED;
    r.cfg.defer_select = 1;
    r.R = 8;
    r.steps = 2;
    double scale = 1e-3;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--executor") && v && eng_executor_parse(v, &r.cfg.executor) ==
                                                       SCAPE_OK)
            i++;
        else if (!strcmp(argv[i], "--ranks") && v)
            r.R = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rho") && v)
            r.cfg.rho = atof(argv[++i]);
        else if (!strcmp(argv[i], "--dense"))
            r.cfg.optimizer = ENG_OPT_ADAMS;
        else if (!strcmp(argv[i], "--scale") && v)
            scale = atof(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && v)
            r.steps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_counters [--executor host|sim] [--ranks R] "
                            "[--rho RHO | --dense] [--scale S] [--steps N]\n");
            return 2;
        }
    }
    if (r.R < 1 || r.R > MAX_R || r.steps < 1 || !(scale > 0.0 && scale <= 1.0)) {
        fprintf(stderr, "bench_counters: ranks in [1, %d], steps >= 1, scale in (0, 1]\n",
                MAX_R);
        return 2;
    }
    r.nt = gpt_layout(scale, r.ts, &r.n);
    r.grads = malloc(r.n * sizeof *r.grads);
    for (size_t i = 0; r.grads && i < r.n; i++)
        r.grads[i] = (float)((i * 2654435761u) % 2001) * 1e-3f - 1.0f;
    if (r.grads == NULL || comm_local_create(r.R, r.comms) != SCAPE_OK) {
        fprintf(stderr, "bench_counters: %s\n", r.grads ? scape_last_error() : "out of memory");
        return 1;
    }
    pthread_t tid[MAX_R];
    rank_arg args[MAX_R];
    for (int q = 0; q < r.R; q++) {
        args[q] = (rank_arg){ &r, q };
        pthread_create(&tid[q], NULL, rank_main, &args[q]);
    }
    for (int q = 0; q < r.R; q++)
        pthread_join(tid[q], NULL);
    for (int q = 0; q < r.R; q++)
        if (r.rc[q] != SCAPE_OK) {
            fprintf(stderr, "bench_counters: rank %d: %s\n", q, r.err[q]);
            return 1;
        }
    printf("{\"executor\": \"%s\", \"optimizer\": \"%s\", \"rho\": %g, \"ranks\": %d, "
           "\"scale\": %g, \"n\": %zu, \"tensors\": %zu, \"k\": %zu, \"launches\": %llu",
           eng_executor_name(r.cfg.executor), eng_optimizer_name(r.cfg.optimizer), r.cfg.rho,
           r.R, scale, r.n, r.nt, r.st[0].k, (unsigned long long)r.st[0].launches);
    print_array("mem_bytes", &r, mem_of, ENG_PH_COUNT);
    print_array("link_bytes", &r, link_of, ENG_PH_COUNT);
    uint64_t bounce = 0;
    for (int q = 0; q < r.R; q++)
        bounce = r.st[q].bounce_bytes > bounce ? r.st[q].bounce_bytes : bounce;
    printf(", \"bounce_bytes\": %llu", (unsigned long long)bounce);
    print_array("comm_bytes", &r, bytes_of, COMM_OP_COUNT);
    print_array("wire_bytes", &r, wire_of, COMM_OP_COUNT);
    printf(", \"seconds\": [");
    for (int i = 0; i < ENG_PH_COUNT; i++) {
        double m = 0.0;
        for (int q = 0; q < r.R; q++)
            m = r.st[q].phase_s[i] > m ? r.st[q].phase_s[i] : m;
        printf("%s%.6f", i ? ", " : "", m);
    }
    printf("]}\n");
    for (int q = 0; q < r.R; q++)
        comm_destroy(&r.comms[q]);
    free(r.grads);
    return 0;
}
