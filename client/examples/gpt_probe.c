/* gpt_probe.c - one forward and backward pass of the C GPT on one fixed
 * batch, written to a file, so that another implementation of the same model
 * (tests/integration/test_gpt_equivalence.py: torch_train.py's GPT) can be
 * checked against it on the same parameters and the same tokens.
 *
 * usage: gpt_probe --out FILE [--corpus FILE | --vocab N] [--step T]
 *                  [--perturb X] [gpt_run options: --d --layers --heads --ctx
 *                  --batch --seq --seed --model-seed --eval-batches]
 *
 * The parameters are gpt_init's for --model-seed, as the C trainers
 * (gpt_train, bench_quality) start from; --perturb X then adds X * u, u
 * uniform in [-1, 1) from a fixed stream, to every parameter (biases and
 * gains included), so that no term of the model hides behind a zero bias or
 * a unit gain and attention is far from uniform.  The batch is, with
 * --corpus, the training batch gpt_run_batch gives the trainer seeded --seed
 * at step --step (1); without, --batch sequences of --seq + 1 tokens below
 * --vocab from splitmix64 seeded with --seed, x the first --seq and y the
 * last --seq of each.  The float model (gpt_forward_backward) and its double
 * twin (gptd_forward_backward, on the same parameters widened exactly) both
 * run.  With --corpus it also measures the validation loss of the C trainers
 * (gpt_run_val_loss: --eval-batches fixed batches of --batch windows of
 * --seq tokens) and describes the split, so that the other side can check
 * its corpus split and its evaluation too.  The layout goes to stdout, one
 * "tensor NAME OFFSET LENGTH" line per tensor, then "params N", "loss L",
 * "loss64 L" and, with --corpus, "val_loss L".
 *
 * The output file, in the host's byte order (little-endian on every machine
 * this project runs on), no padding:
 *
 *   char     magic[8]          "GPTPROB1"
 *   int32    vocab, ctx, d, layers, heads, batch, seq, ntensors
 *   uint64   nparams           gpt_num_params
 *   ntensors records of        { char name[48] (NUL-padded); uint64 offset;
 *                                uint64 length }  gpt_layout's, in its order,
 *                              offsets and lengths in floats
 *   int32    x[batch*seq]      the inputs, row b*seq + t
 *   int32    y[batch*seq]      the targets
 *   float32  params[nparams]   the parameters, gpt.h's flat layout
 *   float64  loss              gpt_forward_backward's (a float, widened)
 *   float32  grads[nparams]    d(mean loss)/d(params), the same layout
 *   float64  loss64            gptd_forward_backward's on params widened
 *   float64  grads64[nparams]
 *   float64  val_loss          gpt_run_val_loss's; NaN without --corpus
 *   uint64   n_train, n_val    tokens in the two splits (0 without --corpus)
 *   uint64   hash_train, hash_val  FNV-1a (64-bit) of each split's token
 *                              ids, one byte each (ids are bytes' ranks)
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpt.h"
#include "gpt_data.h"
#include "gpt_rand.h"
#include "gpt_run.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: gpt_probe --out FILE [--corpus FILE | --vocab N] [--step T] "
               "[--perturb X] [options]\n\n"
               "  --out FILE          where the parameters, loss and gradients go\n"
               "  --vocab N           vocabulary without a corpus (random tokens)\n"
               "  --step T            with --corpus: the batch of this step (1)\n"
               "  --perturb X         add X * uniform[-1, 1) to every parameter (0)\n%s",
            gpt_run_usage());
}

static int write_all(FILE *f, const void *p, size_t size, size_t n)
{
    return fwrite(p, size, n, f) == n ? 0 : -1;
}

static int write_i32(FILE *f, int v)
{
    int32_t x = (int32_t)v;
    return write_all(f, &x, sizeof x, 1);
}

static int write_u64(FILE *f, uint64_t v)
{
    return write_all(f, &v, sizeof v, 1);
}

static int write_f64(FILE *f, double v)
{
    return write_all(f, &v, sizeof v, 1);
}

/* FNV-1a over the ids, one byte each (a byte vocabulary has ids below 256). */
static uint64_t fnv1a(const int *ids, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint64_t)(unsigned char)ids[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static int write_ints(FILE *f, const int *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (write_i32(f, v[i]) != 0)
            return -1;
    return 0;
}

typedef struct probe {
    gpt_run run;
    const char *out;
    uint64_t step;
    double perturb;
    int vocab;
} probe;

static int parse(int argc, char **argv, probe *pr)
{
    memset(pr, 0, sizeof *pr);
    gpt_run_defaults(&pr->run);
    pr->step = 1;
    for (int i = 1; i < argc; i++) {
        int took = gpt_run_option(&pr->run, argc, argv, &i);
        if (took < 0)
            return 2;
        if (took)
            continue;
        const char *k = argv[i];
        char *end = NULL;
        if (!strcmp(k, "--help")) {
            usage(stdout);
            exit(0);
        } else if (i + 1 < argc && !strcmp(k, "--out")) {
            pr->out = argv[++i];
        } else if (i + 1 < argc && !strcmp(k, "--vocab")) {
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 65536) {
                fprintf(stderr, "gpt_probe: --vocab wants 1 .. 65536\n");
                return 2;
            }
            pr->vocab = (int)v;
        } else if (i + 1 < argc && !strcmp(k, "--step")) {
            unsigned long long v = strtoull(argv[++i], &end, 10);
            if (*end || v < 1) {
                fprintf(stderr, "gpt_probe: --step wants a whole number >= 1\n");
                return 2;
            }
            pr->step = v;
        } else if (i + 1 < argc && !strcmp(k, "--perturb")) {
            double v = strtod(argv[++i], &end);
            if (*end || !isfinite(v) || v < 0.0) {
                fprintf(stderr, "gpt_probe: --perturb wants a number >= 0\n");
                return 2;
            }
            pr->perturb = v;
        } else {
            fprintf(stderr, "gpt_probe: unknown or incomplete option '%s'\n", k);
            usage(stderr);
            return 2;
        }
    }
    if (!pr->out || (pr->run.corpus == NULL) == (pr->vocab == 0)) {
        fprintf(stderr, "gpt_probe: --out, and one of --corpus and --vocab, are required\n");
        return 2;
    }
    if (pr->run.seq > pr->run.model.ctx) {
        fprintf(stderr, "gpt_probe: --seq %d is longer than --ctx %d\n", pr->run.seq,
                pr->run.model.ctx);
        return 2;
    }
    return 0;
}

/* The batch: the trainer's of step pr->step, or random tokens (see the top). */
static int make_batch(const probe *pr, const gpt_corpus *c, int *x, int *y)
{
    const gpt_run *r = &pr->run;
    if (c)
        return gpt_run_batch(r, c, r->seed, pr->step, x, y);
    uint64_t s = r->seed;
    for (int b = 0; b < r->batch; b++) {
        int prev = (int)(gpt_next64(&s) % (uint64_t)r->model.vocab);
        for (int t = 0; t < r->seq; t++) {
            int next = (int)(gpt_next64(&s) % (uint64_t)r->model.vocab);
            x[b * r->seq + t] = prev;
            y[b * r->seq + t] = next;
            prev = next;
        }
    }
    return 0;
}

static int write_probe(const probe *pr, const gpt_corpus *c, const gpt_tensor *ts, int nt,
                       size_t n, const int *x, const int *y, const float *p, double loss,
                       const float *g, double loss64, const double *g64, double val)
{
    const gpt_run *r = &pr->run;
    const gpt_config *m = &r->model;
    size_t bt = (size_t)r->batch * (size_t)r->seq;
    FILE *f = fopen(pr->out, "wb");
    if (!f) {
        perror(pr->out);
        return 1;
    }
    int bad = write_all(f, "GPTPROB1", 1, 8);
    const int head[] = { m->vocab, m->ctx, m->d, m->layers, m->heads, r->batch, r->seq, nt };
    for (size_t i = 0; i < sizeof head / sizeof head[0]; i++)
        bad |= write_i32(f, head[i]);
    bad |= write_u64(f, (uint64_t)n);
    for (int i = 0; i < nt; i++) {
        char name[sizeof ts[i].name] = { 0 };
        strncpy(name, ts[i].name, sizeof name - 1);
        bad |= write_all(f, name, 1, sizeof name);
        bad |= write_u64(f, (uint64_t)ts[i].offset);
        bad |= write_u64(f, (uint64_t)ts[i].length);
    }
    bad |= write_ints(f, x, bt);
    bad |= write_ints(f, y, bt);
    bad |= write_all(f, p, sizeof *p, n);
    bad |= write_f64(f, loss);
    bad |= write_all(f, g, sizeof *g, n);
    bad |= write_f64(f, loss64);
    bad |= write_all(f, g64, sizeof *g64, n);
    bad |= write_f64(f, val);
    bad |= write_u64(f, c ? (uint64_t)c->n_train : 0);
    bad |= write_u64(f, c ? (uint64_t)c->n_val : 0);
    bad |= write_u64(f, c ? fnv1a(c->train, c->n_train) : 0);
    bad |= write_u64(f, c ? fnv1a(c->val, c->n_val) : 0);
    if (fclose(f) != 0 || bad) {
        fprintf(stderr, "gpt_probe: cannot write '%s'\n", pr->out);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    probe pr;
    int rc = parse(argc, argv, &pr);
    if (rc)
        return rc;
    gpt_run *r = &pr.run;
    gpt_corpus corpus, *c = NULL;
    char err[256];
    memset(&corpus, 0, sizeof corpus);
    if (r->corpus) {
        if (gpt_corpus_load(r->corpus, &corpus, err, sizeof err) != 0) {
            fprintf(stderr, "gpt_probe: %s\n", err);
            return 1;
        }
        c = &corpus;
        r->model.vocab = corpus.vocab;
    } else {
        r->model.vocab = pr.vocab;
    }
    int nt = gpt_layout(&r->model, NULL, 0);
    if (nt <= 0) {
        fprintf(stderr, "gpt_probe: invalid model shape (d must be a multiple of heads)\n");
        gpt_corpus_free(&corpus);
        return 2;
    }
    size_t n = gpt_num_params(&r->model), bt = (size_t)r->batch * (size_t)r->seq;
    gpt_tensor *ts = calloc((size_t)nt, sizeof *ts);
    float *p = malloc(n * sizeof *p), *g = malloc(n * sizeof *g);
    double *p64 = malloc(n * sizeof *p64), *g64 = malloc(n * sizeof *g64);
    int *x = malloc(bt * sizeof *x), *y = malloc(bt * sizeof *y);
    int *ex = malloc(bt * sizeof *ex), *ey = malloc(bt * sizeof *ey);
    gpt_work *w = gpt_work_new(&r->model, r->batch, r->seq);
    gptd_work *w64 = gptd_work_new(&r->model, r->batch, r->seq);
    rc = 1;
    if (!ts || !p || !g || !p64 || !g64 || !x || !y || !ex || !ey || !w || !w64) {
        fprintf(stderr, "gpt_probe: out of memory\n");
        goto out;
    }
    gpt_layout(&r->model, ts, nt);
    gpt_init(&r->model, p, r->model_seed);
    uint64_t s = r->model_seed ^ 0x5052304245ull; /* the perturbation's own stream */
    for (size_t i = 0; pr.perturb > 0.0 && i < n; i++) {
        double u = (double)(gpt_next64(&s) >> 11) * 0x1.0p-52 - 1.0;
        p[i] = (float)((double)p[i] + pr.perturb * u);
    }
    for (size_t i = 0; i < n; i++)
        p64[i] = (double)p[i];
    if (make_batch(&pr, c, x, y) != 0) {
        fprintf(stderr, "gpt_probe: the training split is shorter than --seq\n");
        goto out;
    }
    float loss = gpt_forward_backward(&r->model, w, p, g, x, y, r->batch, r->seq);
    double loss64 = gptd_forward_backward(&r->model, w64, p64, g64, x, y, r->batch, r->seq);
    if (!isfinite(loss) || !isfinite(loss64)) {
        fprintf(stderr, "gpt_probe: the loss is %g (double %g)\n", (double)loss, loss64);
        goto out;
    }
    double val = c ? gpt_run_val_loss(r, c, w, p, ex, ey) : NAN;
    if (c && !isfinite(val)) {
        fprintf(stderr, "gpt_probe: the validation split is shorter than --seq\n");
        goto out;
    }
    for (int i = 0; i < nt; i++)
        printf("tensor %s %zu %zu\n", ts[i].name, ts[i].offset, ts[i].length);
    printf("params %zu\nloss %.9g\nloss64 %.17g\n", n, (double)loss, loss64);
    if (c)
        printf("val_loss %.9g\n", val);
    rc = write_probe(&pr, c, ts, nt, n, x, y, p, (double)loss, g, loss64, g64, val);
out:
    gpt_work_free(w);
    gptd_work_free(w64);
    free(ts);
    free(p);
    free(g);
    free(p64);
    free(g64);
    free(x);
    free(y);
    free(ex);
    free(ey);
    gpt_corpus_free(&corpus);
    return rc;
}
