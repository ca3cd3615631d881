/* gpt_run.c - settings, schedule, data order and validation of a GPT run. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpt_run.h"
#include "gpt_rand.h"

void gpt_run_defaults(gpt_run *r)
{
    *r = (gpt_run){ .corpus = NULL,
                    .model = { .vocab = 0, .ctx = 64, .d = 64, .layers = 2, .heads = 4 },
                    .batch = 8, .seq = 64, .steps = 400, .lr = 3e-3f, .lr_warmup = 20,
                    .lr_min_frac = 0.1f, .seed = 1, .model_seed = 1234, .eval_every = 50,
                    .eval_batches = 8 };
}

const char *gpt_run_usage(void)
{
    return "  --corpus FILE       text corpus (client/examples/fortunes-corpus.sh writes it)\n"
           "  --d N --layers N --heads N --ctx N   model shape (64, 2, 4, 64)\n"
           "  --batch N --seq N   sequences per step and tokens per sequence (8, 64)\n"
           "  --steps N           steps to train (400)\n"
           "  --lr X              peak learning rate (3e-3)\n"
           "  --lr-warmup N       linear warm-up steps, then cosine to 10% (20)\n"
           "  --seed N            this trainer's data order (1)\n"
           "  --model-seed N      initial weights (1234)\n"
           "  --eval-every N      validation loss period, 0 = at the end only (50)\n"
           "  --eval-batches N    validation batches (8)\n";
}

static int parse_u64(const char *flag, const char *v, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end || v[0] == '-' || x < lo || x > hi) {
        fprintf(stderr, "%s wants a whole number in [%llu, %llu], not '%s'\n", flag,
                (unsigned long long)lo, (unsigned long long)hi, v);
        return -1;
    }
    *out = x;
    return 0;
}

static int parse_int(const char *flag, const char *v, int lo, int hi, int *out)
{
    uint64_t x;
    if (parse_u64(flag, v, (uint64_t)lo, (uint64_t)hi, &x))
        return -1;
    *out = (int)x;
    return 0;
}

static int parse_float(const char *flag, const char *v, float *out)
{
    char *end;
    float x = strtof(v, &end);
    if (end == v || *end || !isfinite(x) || x < 0.0f) {
        fprintf(stderr, "%s wants a number >= 0, not '%s'\n", flag, v);
        return -1;
    }
    *out = x;
    return 0;
}

int gpt_run_option(gpt_run *r, int argc, char **argv, int *i)
{
    const char *k = argv[*i];
    static const char *const known[] = { "--corpus", "--d", "--layers", "--heads", "--ctx",
                                         "--batch", "--seq", "--steps", "--lr", "--lr-warmup",
                                         "--seed", "--model-seed", "--eval-every",
                                         "--eval-batches" };
    size_t which = sizeof known / sizeof known[0];
    for (size_t j = 0; j < sizeof known / sizeof known[0]; j++)
        if (strcmp(k, known[j]) == 0)
            which = j;
    if (which == sizeof known / sizeof known[0])
        return 0;
    if (*i + 1 >= argc) {
        fprintf(stderr, "%s needs a value\n", k);
        return -1;
    }
    const char *v = argv[++*i];
    switch (which) {
    case 0: r->corpus = v; return 1;
    case 1: return parse_int(k, v, 1, 4096, &r->model.d) ? -1 : 1;
    case 2: return parse_int(k, v, 1, 64, &r->model.layers) ? -1 : 1;
    case 3: return parse_int(k, v, 1, 64, &r->model.heads) ? -1 : 1;
    case 4: return parse_int(k, v, 2, 4096, &r->model.ctx) ? -1 : 1;
    case 5: return parse_int(k, v, 1, 4096, &r->batch) ? -1 : 1;
    case 6: return parse_int(k, v, 1, 4096, &r->seq) ? -1 : 1;
    case 7: return parse_u64(k, v, 1, UINT64_C(1) << 40, &r->steps) ? -1 : 1;
    case 8: return parse_float(k, v, &r->lr) ? -1 : 1;
    case 9: return parse_u64(k, v, 0, UINT64_C(1) << 40, &r->lr_warmup) ? -1 : 1;
    case 10: return parse_u64(k, v, 0, UINT64_MAX, &r->seed) ? -1 : 1;
    case 11: return parse_u64(k, v, 0, UINT64_MAX, &r->model_seed) ? -1 : 1;
    case 12: return parse_u64(k, v, 0, UINT64_C(1) << 40, &r->eval_every) ? -1 : 1;
    default: return parse_int(k, v, 1, 4096, &r->eval_batches) ? -1 : 1;
    }
}

float gpt_run_lr(const gpt_run *r, uint64_t t)
{
    if (r->lr_warmup > 0 && t <= r->lr_warmup)
        return r->lr * (float)t / (float)r->lr_warmup;
    double span = (double)(r->steps > r->lr_warmup ? r->steps - r->lr_warmup : 1);
    double done = (double)(t - r->lr_warmup) / span;
    if (done > 1.0)
        done = 1.0;
    double c = 0.5 * (1.0 + cos(3.14159265358979323846 * done));
    return (float)((double)r->lr * (r->lr_min_frac + (1.0 - r->lr_min_frac) * c));
}


int gpt_run_batch(const gpt_run *r, const gpt_corpus *c, uint64_t seed, uint64_t t, int *x,
                  int *y)
{
    uint64_t state = gpt_mix64(gpt_mix64(seed) ^ t);
    return gpt_batch(c->train, c->n_train, &state, r->batch, r->seq, x, y);
}

double gpt_run_val_loss(const gpt_run *r, const gpt_corpus *c, gpt_work *w,
                        const float *params, int *x, int *y)
{
    double sum = 0.0;
    for (int b = 0; b < r->eval_batches; b++) {
        if (gpt_batch_eval(c->val, c->n_val, b, r->eval_batches, r->batch, r->seq, x, y) != 0)
            return NAN;
        sum += gpt_loss(&r->model, w, params, x, y, r->batch, r->seq);
    }
    return sum / r->eval_batches;
}
