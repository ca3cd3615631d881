/* reference.c - the in-process run the daemon must match bit for bit: the
 * engine on the local backend (one rank) with T trainers' buffers, fed the
 * same synthetic gradients as trainer_c, in trainer-index order.
 *
 * usage: reference --trainers T --n N --steps S [--seed X] [--lr LR]
 *                  [--optimizer O] [--mode M] [--rho R] [--warmup W] --out FILE
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine.h"
#include "synth.h"

typedef struct args {
    int trainers;
    size_t n;
    uint64_t steps, seed;
    float lr;
    const char *out;
    eng_config cfg;
} args;

static int parse(int argc, char **argv, args *a)
{
    *a = (args){ .trainers = 1, .n = 1000, .steps = 10, .seed = 1, .lr = 1e-2f };
    eng_config_default(&a->cfg);
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        scape_rc rc = SCAPE_OK;
        if (!strcmp(k, "--trainers")) a->trainers = atoi(v);
        else if (!strcmp(k, "--n")) a->n = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--steps")) a->steps = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--seed")) a->seed = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--lr")) a->lr = strtof(v, NULL);
        else if (!strcmp(k, "--out")) a->out = v;
        else if (!strcmp(k, "--rho")) a->cfg.rho = strtod(v, NULL);
        else if (!strcmp(k, "--warmup")) a->cfg.warmup = (uint32_t)atoi(v);
        else if (!strcmp(k, "--optimizer")) rc = eng_optimizer_parse(v, &a->cfg.optimizer);
        else if (!strcmp(k, "--mode")) rc = eng_mode_parse(v, &a->cfg.mode);
        else rc = scape_set_error(SCAPE_INVALID, "unknown flag %s", k);
        if (rc != SCAPE_OK) {
            fprintf(stderr, "reference: %s\n", scape_last_error());
            return 2;
        }
    }
    return a->trainers < 1 || a->trainers > 64;
}

int main(int argc, char **argv)
{
    args a;
    if (parse(argc, argv, &a))
        return 2;
    size_t off[SYNTH_MAX_TENSORS], len[SYNTH_MAX_TENSORS];
    char names[SYNTH_MAX_TENSORS][16];
    size_t nt = synth_layout(a.n, off, len, names);
    eng_tensor ts[SYNTH_MAX_TENSORS];
    for (size_t l = 0; l < nt; l++)
        ts[l] = (eng_tensor){ names[l], off[l], len[l] };
    size_t n = off[nt - 1] + len[nt - 1];
    float *p[64], *g[64];
    for (int j = 0; j < a.trainers; j++) {
        p[j] = malloc(n * sizeof(float));
        g[j] = malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++)
            p[j][i] = synth_init(a.seed, j, i);
    }
    comm_t *comm;
    eng_t *e = NULL;
    eng_layout lay = { ts, nt, KERN_F32, KERN_F32 };
    if (comm_local_create(1, &comm) != SCAPE_OK ||
        eng_create(&e, &a.cfg, &lay, comm, a.trainers) != SCAPE_OK ||
        eng_init_params(e, (void *const *)p) != SCAPE_OK) {
        fprintf(stderr, "reference: %s\n", scape_last_error());
        return 1;
    }
    struct timespec t0, t1;
    double step_s = 0.0;
    for (uint64_t t = 1; t <= a.steps; t++) {
        for (int j = 0; j < a.trainers; j++)
            for (size_t l = 0; l < nt; l++)
                for (size_t i = off[l]; i < off[l] + len[l]; i++)
                    g[j][i] = synth_grad(a.seed, j, t, i, p[j][i], synth_scale(l));
        clock_gettime(CLOCK_MONOTONIC, &t0);
        if (eng_step(e, t, a.lr, (const void *const *)g, (void *const *)p) != SCAPE_OK) {
            fprintf(stderr, "reference: step %llu: %s\n", (unsigned long long)t,
                    scape_last_error());
            return 1;
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        step_s += (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    }
    printf("reference: %llu steps, N=%zu, T=%d, mean engine step %.3f ms\n",
           (unsigned long long)a.steps, n, a.trainers, 1e3 * step_s / (double)a.steps);
    FILE *f = a.out ? fopen(a.out, "wb") : NULL;
    if (a.out && (f == NULL || fwrite(p[0], sizeof(float), n, f) != n || fclose(f) != 0)) {
        perror(a.out);
        return 1;
    }
    eng_destroy(&e);
    comm_destroy(&comm);
    for (int j = 0; j < a.trainers; j++) {
        free(p[j]);
        free(g[j]);
    }
    return 0;
}
