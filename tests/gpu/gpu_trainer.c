/* gpu_trainer.c - trainer_c's synthetic problem with its buffers on the GPU:
 * libscape allocates them with cudaMalloc and hands their IPC handles to
 * scaped.  Each step it copies the parameters to the host, computes the
 * gradients of synth.h there, copies them into the device buffer and posts
 * the step; the final parameters must match trainer_c's and the in-process
 * reference's bit for bit (tests/gpu/run.sh).  With --stream 1 every copy
 * runs on a non-blocking stream of its own, handed to libscape
 * (scape_set_stream, not blocking): the daemon takes the gradients by the
 * event recorded on it, the stream waits for the new parameters by the
 * daemon's event, and nothing else orders the two processes, so a wrong
 * ordering shows as parameters unlike the reference's.  The current device
 * is checked around every libscape call: it must be what it was.
 * --die-after-post T kills the trainer (SIGKILL) right after it has posted
 * step T, its buffers and events still open in the daemon.  A step abandoned
 * because another trainer died is posted again; a trainer that attaches to a
 * running job starts at the daemon's next step.  --ready-file F writes F once
 * the trainer has synced; --hold-at T --hold-file F waits (60 s at most)
 * before step T until F exists: so a replacement joins while its survivor
 * still trains, and the run's history (who stepped when) is known.
 *
 * --buckets 1 hands each tensor's gradients over as its own bucket, the
 * last tensor first (as backward makes them): copied into the device
 * buffer, then posted (scape_post_tensors records the gradient-ready event
 * after the copy); the daemon packs each once the event has completed, and
 * the step posts nothing more.  The parameters must not change by a bit.
 *
 * --bench times the hand-over instead (issue 16's benchmark): the gradients
 * are set once on the device, nothing is computed on the host, and each
 * step's call (post to parameters ready) is timed against the daemon's own
 * engine step (StepDone's total); it prints one line
 *   BENCH handover N call_ms engine_ms handover_ms handover/engine
 * of medians over the steps after the dense warm-up (--warmup W, default 3).
 *
 * usage: gpu_trainer --endpoint EP --index I --n N --steps S [--seed X]
 *                    [--lr LR] [--device D] [--stream 0|1] [--die-after-post T] [--buckets 1]
 *                    [--bench 1 [--warmup W]] --out FILE
 */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include "scape/scape.h"
#include "synth.h"

/* The calling thread's current device is still `device`. */
static int same_device(int device)
{
    int now = -1;
    return cudaGetDevice(&now) == cudaSuccess && now == device;
}

static int fail(const char *what, const char *why)
{
    fprintf(stderr, "gpu_trainer: %s: %s\n", what, why);
    return 1;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, size_t n)
{
    qsort(v, n, sizeof *v, by_value);
    return n ? (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2])) : 0.0;
}

/* --bench: the hand-over's cost per step against the engine's. */
static int bench_handover(scape_session *s, cudaStream_t st, size_t n, uint64_t first,
                          uint64_t steps, float lr, int warmup)
{
    /* 0x3c3c3c3c: a float of about 0.0115, the same gradient every step */
    if (cudaMemsetAsync(scape_grads(s), 0x3c, n * sizeof(float), st) != cudaSuccess ||
        cudaStreamSynchronize(st) != cudaSuccess)
        return fail("cudaMemsetAsync", "the bench's gradients");
    size_t m = 0, cap = (size_t)(steps - first + 1);
    double *call = calloc(cap, sizeof *call), *eng = calloc(cap, sizeof *eng),
           *hand = calloc(cap, sizeof *hand);
    if (call == NULL || eng == NULL || hand == NULL)
        return fail("calloc", "out of memory");
    for (uint64_t t = first; t <= steps; t++) {
        scape_step_info info;
        double t0 = now_s();
        if (scape_step(s, t, lr, NULL, &info) != SCAPE_OK ||
            (st && cudaStreamSynchronize(st) != cudaSuccess))
            return fail("step", scape_last_error());
        double dt = now_s() - t0;
        if (t <= (uint64_t)warmup)
            continue;
        call[m] = dt * 1e3;
        eng[m] = info.step_seconds * 1e3;
        hand[m] = call[m] - eng[m];
        m++;
    }
    double c = median(call, m), e = median(eng, m), h = median(hand, m);
    printf("BENCH handover %zu %.3f %.3f %.3f %.4f\n", n, c, e, h, e > 0 ? h / e : 0.0);
    free(call);
    free(eng);
    free(hand);
    return scape_detach(&s) == SCAPE_OK ? 0 : fail("detach", scape_last_error());
}

int main(int argc, char **argv)
{
    const char *endpoint = NULL, *out = NULL, *ready_file = NULL, *hold_file = NULL;
    int index = -1, device = 0, use_stream = 0, bench = 0, warmup = 3, buckets = 0;
    size_t n = 1000;
    uint64_t steps = 10, seed = 1, die_at = 0, hold_at = 0;
    float lr = 1e-2f;
    for (int i = 1; i < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--help") || !strcmp(k, "-h")) {
            puts("usage: gpu_trainer [--endpoint EP] [--index I] [--device D] [--n N] "
                 "[--steps S] [--seed X] [--lr LR] [--out FILE]\n"
                 "trainer_c with its buffers on CUDA device D (CUDA IPC)");
            return 0;
        }
        if (v == NULL)
            return fail("usage: a value is missing after", k);
        if (!strcmp(k, "--endpoint")) endpoint = v;
        else if (!strcmp(k, "--out")) out = v;
        else if (!strcmp(k, "--index")) index = atoi(v);
        else if (!strcmp(k, "--device")) device = atoi(v);
        else if (!strcmp(k, "--stream")) use_stream = atoi(v);
        else if (!strcmp(k, "--bench")) bench = atoi(v);
        else if (!strcmp(k, "--buckets")) buckets = atoi(v);
        else if (!strcmp(k, "--warmup")) warmup = atoi(v);
        else if (!strcmp(k, "--die-after-post")) die_at = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--ready-file")) ready_file = v;
        else if (!strcmp(k, "--hold-file")) hold_file = v;
        else if (!strcmp(k, "--hold-at")) hold_at = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--n")) n = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--steps")) steps = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--seed")) seed = strtoull(v, NULL, 0);
        else if (!strcmp(k, "--lr")) lr = strtof(v, NULL);
        else return fail("usage", k);
    }
    size_t off[SYNTH_MAX_TENSORS], len[SYNTH_MAX_TENSORS];
    char names[SYNTH_MAX_TENSORS][16];
    size_t nt = synth_layout(n, off, len, names);
    scape_tensor ts[SYNTH_MAX_TENSORS];
    for (size_t l = 0; l < nt; l++)
        ts[l] = (scape_tensor){ names[l], off[l], len[l], 0 };
    scape_options o;
    scape_options_default(&o);
    o.index = index;
    o.memory = SCAPE_MEMORY_CUDA;
    o.device = device;
    scape_session *s = NULL;
    if (cudaSetDevice(device) != cudaSuccess)
        return fail("cudaSetDevice", "the trainer's device");
    cudaStream_t st = NULL; /* NULL: the legacy default stream, libscape blocking */
    if (use_stream && cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess)
        return fail("cudaStreamCreateWithFlags", "the trainer's stream");
    if (scape_attach(endpoint, ts, nt, &o, &s) != SCAPE_OK)
        return fail("attach", scape_last_error());
    if (!same_device(device))
        return fail("attach", "libscape left another current device");
    if (use_stream && scape_set_stream(s, st, 0) != SCAPE_OK)
        return fail("scape_set_stream", scape_last_error());
    index = scape_index(s);
    n = scape_numel(s);
    float *p = malloc(n * sizeof *p), *g = malloc(n * sizeof *g);
    if (p == NULL || g == NULL)
        return fail("malloc", "out of memory");
    for (size_t i = 0; i < n; i++)
        p[i] = synth_init(seed, index, i);
    if (cudaMemcpyAsync(scape_params(s), p, n * sizeof *p, cudaMemcpyHostToDevice, st) !=
        cudaSuccess)
        return fail("cudaMemcpyAsync", "params in");
    if (scape_sync(s) != SCAPE_OK)
        return fail("sync", scape_last_error());
    uint64_t first = scape_next_step(s), sent = 0;
    if (ready_file) {
        FILE *rf = fopen(ready_file, "w");
        if (rf == NULL || fprintf(rf, "%llu\n", (unsigned long long)first) < 0 ||
            fclose(rf) != 0)
            return fail(ready_file, "cannot write");
    }
    if (bench)
        return bench_handover(s, st, n, first, steps, lr, warmup);
    for (uint64_t t = first; t <= steps; t++) {
        if (t == hold_at && hold_file) {
            double until = now_s() + 60.0;
            const struct timespec nap = { 0, 10000000 };
            while (access(hold_file, F_OK) != 0) {
                if (now_s() > until)
                    return fail(hold_file, "did not appear within 60 s");
                nanosleep(&nap, NULL);
            }
        }
        if (cudaMemcpyAsync(p, scape_params(s), n * sizeof *p, cudaMemcpyDeviceToHost, st) !=
                cudaSuccess ||
            cudaStreamSynchronize(st) != cudaSuccess)
            return fail("cudaMemcpyAsync", "params out");
        for (size_t l = 0; l < nt; l++)
            for (size_t i = off[l]; i < off[l] + len[l]; i++)
                g[i] = synth_grad(seed, index, t, i, p[i], synth_scale(l));
        for (size_t b = nt; buckets && b-- > 0;) { /* the last tensor first */
            if (cudaMemcpyAsync((float *)scape_grads(s) + off[b], g + off[b],
                                len[b] * sizeof *g, cudaMemcpyHostToDevice, st) != cudaSuccess)
                return fail("cudaMemcpyAsync", "a bucket's grads in");
            if (scape_post_tensors(s, b, 1) != SCAPE_OK)
                return fail("post", scape_last_error());
        }
        if (!buckets && cudaMemcpyAsync(scape_grads(s), g, n * sizeof *g, cudaMemcpyHostToDevice,
                                        st) != cudaSuccess)
            return fail("cudaMemcpyAsync", "grads in");
        scape_step_info info;
        if (t == die_at) {
            if (scape_step_begin(s, t, lr, NULL) != SCAPE_OK)
                return fail("step", scape_last_error());
            fprintf(stderr, "gpu_trainer %d: posted step %llu, dying\n", index,
                    (unsigned long long)t);
            raise(SIGKILL);
        }
        scape_rc rc;
        for (int tries = 0;; tries++) {
            rc = scape_step(s, t, lr, NULL, &info);
            if (rc != SCAPE_REMOTE || !strstr(scape_last_error(), "abandoned") || tries > 100)
                break;
            fprintf(stderr, "gpu_trainer %d: %s; posting again\n", index, scape_last_error());
        }
        if (rc != SCAPE_OK)
            return fail("step", scape_last_error());
        if (!same_device(device))
            return fail("step", "libscape left another current device");
        sent = info.bytes;
    }
    if (cudaMemcpyAsync(p, scape_params(s), n * sizeof *p, cudaMemcpyDeviceToHost, st) !=
            cudaSuccess ||
        cudaStreamSynchronize(st) != cudaSuccess)
        return fail("cudaMemcpyAsync", "final params");
    FILE *f = out ? fopen(out, "wb") : NULL;
    if (out && (f == NULL || fwrite(p, sizeof *p, n, f) != n || fclose(f) != 0))
        return fail(out, "cannot write");
    printf("gpu_trainer %d: steps %llu..%llu done on CUDA device %d (%s), N=%zu, last step "
           "sent %llu B, params %016llx\n", index, (unsigned long long)first,
           (unsigned long long)steps, device, use_stream ? "its own stream, by events"
                                                         : "the default stream, blocking",
           n, (unsigned long long)sent, (unsigned long long)synth_hash(p, n));
    free(p);
    free(g);
    return scape_detach(&s) == SCAPE_OK ? 0 : fail("detach", scape_last_error());
}
