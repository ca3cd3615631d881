/* trainer_c.c - a C trainer for the integration tests: attaches to scaped
 * through libscape, trains the synthetic problem of synth.h, and writes its
 * final parameters to a file.
 *
 * usage: trainer_c --endpoint EP --index I --n N --steps S [--seed X] [--lr LR]
 *                  [--sleep-ms MS] [--stop-before STEP] [--out FILE] [--timing FILE]
 *                  [--start-wait-ms MS] [--catch-signal SIG]
 *                  [--buckets K] [--bucket-order fwd|rev|mix] [--die-after-buckets B]
 * --buckets hands the gradients over in K buckets of consecutive tensors
 * (scape_post_tensors), each as soon as its gradients are computed, in the
 * order --bucket-order says (mix: a shuffle of its own per trainer and step);
 * the step posts the rest (with K above the tensor count, some stay for it).
 * --die-after-buckets exits (status 3) half a second after posting B buckets
 * of the last step, without posting the step.
 * --start-wait-ms waits that long for a daemon that is still starting.
 * --catch-signal installs a handler for SIG (a number) that only counts, without
 * SA_RESTART, so that it interrupts libscape's waits; the count is printed.
 * --timing writes one line per step: step, seconds inside scape_step, and the
 * daemon's wait (first post to last post) and engine seconds.
 * --stop-before stops the trainer (SIGSTOP) just before it posts that step,
 * so a test knows for certain that the step is not posted.
 * A step abandoned because another trainer died is posted again.  A trainer
 * that attaches to a running job starts at the daemon's next step. */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "scape/scape.h"
#include "synth.h"

typedef struct args {
    const char *endpoint, *out, *timing;
    int index;
    size_t n;
    uint64_t steps, seed;
    float lr;
    int sleep_ms;
    uint64_t stop_before;
    int start_wait_ms, catch_signal;
    int buckets, die_after;
    const char *order;
} args;

static volatile sig_atomic_t s_caught;

static void on_signal(int sig)
{
    (void)sig;
    s_caught++;
}

/* A counting handler for sig, without SA_RESTART. */
static int catch_signal(int sig)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    if (sigemptyset(&sa.sa_mask) != 0 || sigaction(sig, &sa, NULL) != 0) {
        perror("trainer_c: sigaction");
        return 1;
    }
    return 0;
}

static const char s_usage[] =
    "usage: trainer_c [--endpoint EP] [--index I] [--n N] [--steps S] [--seed X] [--lr LR]\n"
    "                 [--sleep-ms MS] [--stop-before STEP] [--out FILE] [--timing FILE]\n"
    "                 [--start-wait-ms MS] [--catch-signal SIG]\n"
    "                 [--buckets K] [--bucket-order fwd|rev|mix] [--die-after-buckets B]\n"
    "A test trainer: attaches to scaped (EP, else $SCAPE_ENDPOINT, else the runtime\n"
    "directory's control socket), trains the synthetic problem of synth.h for S\n"
    "steps and writes its final parameters to FILE.\n";

/* 0 to run, 1 after --help, 2 on a bad flag. */
static int parse(int argc, char **argv, args *a)
{
    *a = (args){ .index = -1, .n = 1000, .steps = 10, .seed = 1, .lr = 1e-2f,
                 .start_wait_ms = -1 };
    for (int i = 1; i < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--help") || !strcmp(k, "-h")) {
            fputs(s_usage, stdout);
            return 1;
        }
        if (v == NULL) {
            fprintf(stderr, "trainer_c: %s needs a value\n%s", k, s_usage);
            return 2;
        }
        if (!strcmp(k, "--endpoint")) a->endpoint = v;
        else if (!strcmp(k, "--out")) a->out = v;
        else if (!strcmp(k, "--timing")) a->timing = v;
        else if (!strcmp(k, "--index")) a->index = atoi(v);
        else if (!strcmp(k, "--n")) a->n = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--steps")) a->steps = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--seed")) a->seed = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--lr")) a->lr = strtof(v, NULL);
        else if (!strcmp(k, "--sleep-ms")) a->sleep_ms = atoi(v);
        else if (!strcmp(k, "--stop-before")) a->stop_before = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--start-wait-ms")) a->start_wait_ms = atoi(v);
        else if (!strcmp(k, "--catch-signal")) a->catch_signal = atoi(v);
        else if (!strcmp(k, "--buckets")) a->buckets = atoi(v);
        else if (!strcmp(k, "--bucket-order")) a->order = v;
        else if (!strcmp(k, "--die-after-buckets")) a->die_after = atoi(v);
        else {
            fprintf(stderr, "trainer_c: unknown flag %s\n", k);
            return 2;
        }
    }
    return 0;
}

static void tensor_grads(const args *a, const scape_tensor *ts, size_t l, uint64_t t,
                         const float *p, float *g)
{
    for (size_t i = ts[l].offset; i < ts[l].offset + ts[l].length; i++)
        g[i] = synth_grad(a->seed, a->index, t, i, p[i], synth_scale(l));
}

static void compute_grads(const args *a, const scape_tensor *ts, size_t nt, uint64_t t,
                          const float *p, float *g)
{
    for (size_t l = 0; l < nt; l++)
        tensor_grads(a, ts, l, t, p, g);
}

/* --buckets: bucket b holds tensors [b * nt / K, (b + 1) * nt / K); each is
 * computed, then posted, in the order asked.  Returns the buckets posted. */
static int post_buckets(const args *a, scape_session *s, const scape_tensor *ts, size_t nt,
                        uint64_t t, const float *p, float *g, int limit)
{
    int k = a->buckets, order[64];
    for (int b = 0; b < k; b++)
        order[b] = b;
    if (a->order && !strcmp(a->order, "rev")) {
        for (int b = 0; b < k; b++)
            order[b] = k - 1 - b;
    } else if (a->order && !strcmp(a->order, "mix")) {
        uint64_t h = synth_mix(t * 7919 + (uint64_t)a->index * 104729 + 1);
        for (int b = k - 1; b > 0; b--, h = synth_mix(h)) {
            int j = (int)(h % (uint64_t)(b + 1)), x = order[b];
            order[b] = order[j];
            order[j] = x;
        }
    }
    compute_grads(a, ts, nt, t, p, g); /* tensors in no bucket (K > nt) too */
    int posted = 0;
    for (int q = 0; q < k && posted < limit; q++) {
        size_t lo = (size_t)order[q] * nt / (size_t)k, hi = (size_t)(order[q] + 1) * nt / (size_t)k;
        if (lo == hi)
            continue;
        for (size_t l = lo; l < hi; l++)
            tensor_grads(a, ts, l, t, p, g);
        if (scape_post_tensors(s, lo, hi - lo) != SCAPE_OK) {
            fprintf(stderr, "trainer_c %d: post: %s\n", a->index, scape_last_error());
            return -1;
        }
        posted++;
    }
    return posted;
}

/* Post step t, again while it is abandoned because a peer died. */
static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static scape_rc step_retrying(scape_session *s, uint64_t t, float lr, int index,
                              scape_step_info *info)
{
    for (int tries = 0;; tries++) {
        scape_rc rc = scape_step(s, t, lr, NULL, info);
        if (rc != SCAPE_REMOTE || !strstr(scape_last_error(), "abandoned") || tries > 100)
            return rc;
        fprintf(stderr, "trainer_c %d: %s; posting again\n", index, scape_last_error());
    }
}

static int write_out(const char *path, const float *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(p, sizeof *p, n, f) != n) {
        perror(path);
        if (f)
            fclose(f);
        return 1;
    }
    return fclose(f) != 0;
}

int main(int argc, char **argv)
{
    args a;
    int how = parse(argc, argv, &a);
    if (how)
        return how == 1 ? 0 : 2;
    size_t off[SYNTH_MAX_TENSORS], len[SYNTH_MAX_TENSORS];
    char names[SYNTH_MAX_TENSORS][16];
    size_t nt = synth_layout(a.n, off, len, names);
    scape_tensor ts[SYNTH_MAX_TENSORS];
    for (size_t l = 0; l < nt; l++)
        ts[l] = (scape_tensor){ names[l], off[l], len[l], 0 };
    scape_options o;
    scape_options_default(&o);
    o.index = a.index;
    o.start_wait_ms = a.start_wait_ms;
    if (a.catch_signal && catch_signal(a.catch_signal))
        return 1;
    scape_session *s = NULL;
    if (scape_attach(a.endpoint, ts, nt, &o, &s) != SCAPE_OK) {
        fprintf(stderr, "trainer_c: attach: %s\n", scape_last_error());
        return 1;
    }
    a.index = scape_index(s);
    size_t n = scape_numel(s);
    float *p = scape_params(s), *g = scape_grads(s);
    for (size_t i = 0; i < n; i++)
        p[i] = synth_init(a.seed, a.index, i);
    if (scape_sync(s) != SCAPE_OK) {
        fprintf(stderr, "trainer_c %d: sync: %s\n", a.index, scape_last_error());
        return 1;
    }
    uint64_t first = scape_next_step(s);
    double loss0 = synth_loss(a.seed, p, off, len, nt);
    FILE *timing = a.timing ? fopen(a.timing, "w") : NULL;
    if (a.timing && timing == NULL) {
        perror(a.timing);
        return 1;
    }
    if (a.buckets < 0 || a.buckets > 64) {
        fprintf(stderr, "trainer_c: --buckets %d: 0..64\n", a.buckets);
        return 2;
    }
    for (uint64_t t = first; t <= a.steps; t++) {
        if (a.buckets == 0) {
            compute_grads(&a, ts, nt, t, p, g);
        } else {
            int die = a.die_after && t == a.steps;
            int posted = post_buckets(&a, s, ts, nt, t, p, g, die ? a.die_after : 64);
            if (posted < 0)
                return 1;
            if (die) {
                printf("trainer_c %d: exits after %d bucket(s) of step %llu\n", a.index,
                       posted, (unsigned long long)t);
                fflush(stdout);
                /* a Post is one-way: give ZeroMQ's I/O thread, and the
                 * daemon, time to take them before the process goes */
                nanosleep(&(struct timespec){ 0, 500000000L }, NULL);
                _exit(3);
            }
        }
        if (t == a.stop_before)
            raise(SIGSTOP);
        scape_step_info info;
        double t0 = now_s();
        scape_rc rc = step_retrying(s, t, a.lr, a.index, &info);
        if (timing && rc == SCAPE_OK)
            fprintf(timing, "%llu %.9f %.9f %.9f\n", (unsigned long long)t, now_s() - t0,
                    info.wait_seconds, info.step_seconds);
        if (rc != SCAPE_OK) {
            fprintf(stderr, "trainer_c %d: step %llu: %s\n", a.index, (unsigned long long)t,
                    scape_last_error());
            return 1;
        }
        if (a.sleep_ms)
            nanosleep(&(struct timespec){ 0, a.sleep_ms * 1000000L }, NULL);
    }
    if (timing)
        fclose(timing);
    int rc = a.out ? write_out(a.out, p, n) : 0;
    printf("trainer_c %d: steps %llu..%llu done, N=%zu, loss %.6f -> %.6f, params %016llx\n",
           a.index, (unsigned long long)first, (unsigned long long)a.steps, n, loss0,
           synth_loss(a.seed, p, off, len, nt), (unsigned long long)synth_hash(p, n));
    if (a.catch_signal)
        printf("trainer_c %d: caught signal %d %d times\n", a.index, a.catch_signal,
               (int)s_caught);
    if (scape_detach(&s) != SCAPE_OK) {
        fprintf(stderr, "trainer_c %d: detach: %s\n", a.index, scape_last_error());
        return 1;
    }
    return rc;
}
