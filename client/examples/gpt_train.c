/* gpt_train.c - a small character-level GPT trained on the CPU through
 * scaped: the example trainer of the demo and the quality test.
 *
 * usage: gpt_train --corpus FILE [--endpoint EP] [--index I] [model and run
 *                  options] [--log FILE] [--progress] [--report] [--out FILE]
 *
 * Each step it computes the loss and gradients of its own batch (its --seed
 * chooses its data order) into libscape's gradient buffer, hands the step to
 * its node's daemon, and finds the updated parameters in place.  With
 * --report it also measures the validation loss every --eval-every steps and
 * writes a CSV log; --progress draws a progress bar on stderr with the loss
 * and the bytes the step sent, against what a dense all-reduce would send.
 * A trainer that attaches to a resumed job starts at the daemon's next step.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gpt_run.h"
#include "scape/scape.h"

typedef struct args {
    gpt_run run;
    const char *endpoint, *log, *out;
    int index, progress, report, buckets;
} args;

static void usage(FILE *f)
{
    fprintf(f, "usage: gpt_train --corpus FILE [--endpoint EP] [--index I] [--log FILE]\n"
               "                 [--progress] [--report] [--out FILE] [options]\n\n"
               "  --endpoint EP       scaped's control endpoint (default: $SCAPE_ENDPOINT,\n"
               "                      else the runtime dir's)\n"
               "  --index I           trainer slot on the node (default: the lowest free)\n"
               "  --report            measure the validation loss and write --log\n"
               "  --log FILE          CSV: step,lr,loss,val_loss,bytes,wire_bytes,k,step_ms,wall_s\n"
               "  --progress          draw a progress bar on stderr\n"
               "  --buckets           hand each layer's gradients over as soon as backward\n"
               "                      has made them (scape_post_tensors)\n"
               "  --out FILE          the final parameters, raw float32\n%s",
            gpt_run_usage());
}

static int parse(int argc, char **argv, args *a)
{
    memset(a, 0, sizeof *a);
    gpt_run_defaults(&a->run);
    a->index = -1;
    for (int i = 1; i < argc; i++) {
        int took = gpt_run_option(&a->run, argc, argv, &i);
        if (took < 0)
            return 2;
        if (took)
            continue;
        const char *k = argv[i];
        if (!strcmp(k, "--progress")) a->progress = 1;
        else if (!strcmp(k, "--report")) a->report = 1;
        else if (!strcmp(k, "--buckets")) a->buckets = 1;
        else if (!strcmp(k, "--help")) { usage(stdout); exit(0); }
        else if (i + 1 < argc && !strcmp(k, "--endpoint")) a->endpoint = argv[++i];
        else if (i + 1 < argc && !strcmp(k, "--log")) a->log = argv[++i];
        else if (i + 1 < argc && !strcmp(k, "--out")) a->out = argv[++i];
        else if (i + 1 < argc && !strcmp(k, "--index")) a->index = atoi(argv[++i]);
        else {
            fprintf(stderr, "gpt_train: unknown or incomplete option '%s'\n", k);
            usage(stderr);
            return 2;
        }
    }
    if (a->run.corpus == NULL) {
        fprintf(stderr, "gpt_train: --corpus is required\n");
        return 2;
    }
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const char *human_bytes(double b, char *buf, size_t len)
{
    const char *unit[] = { "B", "KiB", "MiB", "GiB" };
    int u = 0;
    while (b >= 1024.0 && u < 3) {
        b /= 1024.0;
        u++;
    }
    snprintf(buf, len, u ? "%.1f %s" : "%.0f %s", b, unit[u]);
    return buf;
}

/* One line, redrawn in place on a terminal, every 10% otherwise.  "sent" is
 * what this daemon moves over its links per step (wire_bytes, the ring model
 * of its collectives), not their payload, which counts every daemon's part.
 * Step 1 is always dense (the warm-up has at least one step): what it sent
 * is the dense reference for the later steps. */
static void progress(const args *a, uint64_t t, uint64_t first, double loss, double val,
                     const scape_step_info *info, double started)
{
    static double dense;
    if (t == 1)
        dense = (double)info->wire_bytes;
    int tty = isatty(STDERR_FILENO);
    uint64_t total = a->run.steps;
    if (!tty && t != total && t % (total / 10 ? total / 10 : 1) != 0)
        return;
    const int width = 24;
    int fill = (int)((double)width * (double)t / (double)total);
    char bar[32], b1[32], vbuf[32], share[48] = "";
    for (int i = 0; i < width; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[width] = '\0';
    if (dense > 0.0)
        snprintf(share, sizeof share, " (%.2f%% of dense)",
                 100.0 * (double)info->wire_bytes / dense);
    double rate = (double)(t - first + 1) / (now_s() - started);
    snprintf(vbuf, sizeof vbuf, isnan(val) ? "  -  " : "%.3f", val);
    fprintf(stderr, "%s[%s] step %llu/%llu  loss %.3f  val %s  sent %s/step%s  %.1f step/s%s",
            tty ? "\r" : "", bar, (unsigned long long)t, (unsigned long long)total, loss,
            vbuf, human_bytes((double)info->wire_bytes, b1, sizeof b1), share, rate,
            tty ? "\033[K" : "\n");
    if (tty && t == total)
        fputc('\n', stderr);
    fflush(stderr);
}

/* Post step t; again while it is abandoned because a peer trainer died. */
static scape_rc step_retrying(scape_session *s, uint64_t t, float lr, const float *loss,
                              scape_step_info *info)
{
    for (int tries = 0;; tries++) {
        scape_rc rc = scape_step(s, t, lr, loss, info);
        if (rc != SCAPE_REMOTE || !strstr(scape_last_error(), "abandoned") || tries > 100)
            return rc;
        fprintf(stderr, "gpt_train: %s; posting again\n", scape_last_error());
    }
}

static int write_out(const char *path, const float *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(p, sizeof *p, n, f) != n || fclose(f) != 0) {
        perror(path);
        return 1;
    }
    return 0;
}

typedef struct trainer {
    args a;
    gpt_corpus corpus;
    gpt_tensor *tensors;
    scape_tensor *layout;
    int ntensors;
    gpt_work *work;
    int *x, *y;
    scape_session *s;
    FILE *log;
    scape_rc post_rc; /* --buckets: the first failed post */
} trainer;

static int setup(trainer *tr)
{
    char err[256];
    gpt_run *r = &tr->a.run;
    if (gpt_corpus_load(r->corpus, &tr->corpus, err, sizeof err) != 0) {
        fprintf(stderr, "gpt_train: %s\n", err);
        return 1;
    }
    r->model.vocab = tr->corpus.vocab;
    if (r->seq > r->model.ctx)
        r->seq = r->model.ctx;
    tr->ntensors = gpt_layout(&r->model, NULL, 0);
    if (tr->ntensors <= 0) {
        fprintf(stderr, "gpt_train: invalid model shape (d must be a multiple of heads)\n");
        return 1;
    }
    tr->tensors = calloc((size_t)tr->ntensors, sizeof *tr->tensors);
    tr->layout = calloc((size_t)tr->ntensors, sizeof *tr->layout);
    tr->work = gpt_work_new(&r->model, r->batch, r->seq);
    tr->x = calloc((size_t)r->batch * (size_t)r->seq, sizeof(int));
    tr->y = calloc((size_t)r->batch * (size_t)r->seq, sizeof(int));
    if (!tr->tensors || !tr->layout || !tr->work || !tr->x || !tr->y) {
        fprintf(stderr, "gpt_train: out of memory\n");
        return 1;
    }
    gpt_layout(&r->model, tr->tensors, tr->ntensors);
    for (int i = 0; i < tr->ntensors; i++)
        tr->layout[i] = (scape_tensor){ tr->tensors[i].name, tr->tensors[i].offset,
                                        tr->tensors[i].length, 0 };
    if (tr->a.log && (tr->log = fopen(tr->a.log, "w")) == NULL) {
        perror(tr->a.log);
        return 1;
    }
    if (tr->log)
        fprintf(tr->log, "step,lr,loss,val_loss,bytes,wire_bytes,k,step_ms,wall_s\n");
    return 0;
}

static int attach(trainer *tr)
{
    scape_options o;
    scape_options_default(&o);
    o.index = tr->a.index;
    if (scape_attach(tr->a.endpoint, tr->layout, (size_t)tr->ntensors, &o, &tr->s) != SCAPE_OK) {
        fprintf(stderr, "gpt_train: attach: %s\n", scape_last_error());
        return 1;
    }
    gpt_init(&tr->a.run.model, scape_params(tr->s), tr->a.run.model_seed);
    if (scape_sync(tr->s) != SCAPE_OK) {
        fprintf(stderr, "gpt_train %d: sync: %s\n", scape_index(tr->s), scape_last_error());
        return 1;
    }
    return 0;
}

/* --buckets: backward made the final gradients of tensors [first, +count). */
static void post_ready(void *ctx, int first, int count)
{
    trainer *tr = ctx;
    if (tr->post_rc == SCAPE_OK)
        tr->post_rc = scape_post_tensors(tr->s, (size_t)first, (size_t)count);
}

static int train(trainer *tr)
{
    const gpt_run *r = &tr->a.run;
    float *p = scape_params(tr->s), *g = scape_grads(tr->s);
    size_t n = scape_numel(tr->s);
    uint64_t first = scape_next_step(tr->s);
    double started = now_s(), val = NAN, loss = NAN;
    if (tr->a.buckets)
        gpt_work_on_ready(tr->work, post_ready, tr);
    for (uint64_t t = first; t <= r->steps; t++) {
        if (gpt_run_batch(r, &tr->corpus, r->seed, t, tr->x, tr->y) != 0) {
            fprintf(stderr, "gpt_train: the training split is shorter than --seq\n");
            return 1;
        }
        float l = gpt_forward_backward(&r->model, tr->work, p, g, tr->x, tr->y, r->batch, r->seq);
        if (!isfinite(l)) {
            fprintf(stderr, "gpt_train: step %llu: loss is %g\n", (unsigned long long)t, (double)l);
            return 1;
        }
        if (tr->post_rc != SCAPE_OK) {
            fprintf(stderr, "gpt_train %d: step %llu: post: %s\n", scape_index(tr->s),
                    (unsigned long long)t, scape_last_error());
            return 1;
        }
        loss = l;
        scape_step_info info;
        double t0 = now_s();
        float lr = gpt_run_lr(r, t);
        if (step_retrying(tr->s, t, lr, &l, &info) != SCAPE_OK) {
            fprintf(stderr, "gpt_train %d: step %llu: %s\n", scape_index(tr->s),
                    (unsigned long long)t, scape_last_error());
            return 1;
        }
        double step_ms = 1e3 * (now_s() - t0);
        int eval = tr->a.report && ((r->eval_every && t % r->eval_every == 0) || t == r->steps);
        val = eval ? gpt_run_val_loss(r, &tr->corpus, tr->work, p, tr->x, tr->y) : NAN;
        if (tr->log)
            fprintf(tr->log, "%llu,%.6g,%.6f,%.6f,%llu,%llu,%llu,%.3f,%.3f\n",
                    (unsigned long long)t, (double)lr, (double)l, val,
                    (unsigned long long)info.bytes, (unsigned long long)info.wire_bytes,
                    (unsigned long long)info.k, step_ms, now_s() - started);
        if (tr->a.progress)
            progress(&tr->a, t, first, l, val, &info, started);
    }
    printf("gpt_train %d: steps %llu..%llu done, N=%zu, loss %.4f, val %.4f\n",
           scape_index(tr->s), (unsigned long long)first, (unsigned long long)r->steps, n,
           loss, val);
    return 0;
}

int main(int argc, char **argv)
{
    trainer tr;
    memset(&tr, 0, sizeof tr);
    int rc = parse(argc, argv, &tr.a);
    if (rc == 0)
        rc = setup(&tr);
    if (rc == 0)
        rc = attach(&tr);
    if (rc == 0)
        rc = train(&tr);
    if (rc == 0 && tr.a.out)
        rc = write_out(tr.a.out, scape_params(tr.s), scape_numel(tr.s));
    if (tr.log && fclose(tr.log) != 0 && rc == 0) {
        perror(tr.a.log);
        rc = 1;
    }
    if (tr.s && scape_detach(&tr.s) != SCAPE_OK) {
        fprintf(stderr, "gpt_train: detach: %s\n", scape_last_error());
        rc = rc ? rc : 1;
    }
    gpt_work_free(tr.work);
    gpt_corpus_free(&tr.corpus);
    free(tr.tensors);
    free(tr.layout);
    free(tr.x);
    free(tr.y);
    return rc;
}
