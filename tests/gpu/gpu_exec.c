/* gpu_exec.c - the cuda executor against the host executor, bit for bit.
 *
 * For every optimizer (scape, adams, adamw, topk-adamw), both modes, f32
 * and bf16 gradients, one and three local trainers: the same job runs
 * `steps` steps (200) on the host executor (local backend, one rank) and on
 * the cuda executor (the nccl backend with one rank, collectives in place on
 * device memory), and every trainer's parameters, m, v, theta, the residual
 * and the last mask must be equal bit for bit.  Variants put the trainers'
 * buffers in pinned host memory instead of device memory, keep the residual
 * in device memory, stream it in small chunks, defer the selection, and
 * clip the mean gradient by its global norm (max_grad_norm; the norm and
 * factor must agree bit for bit too).
 * Then checkpoints cross executors: a job saved halfway on one executor and
 * resumed on the other must end where the uninterrupted host run ends.
 * Last, bucketed hand-over: the run under test gets each step's gradients
 * in random buckets posted early (eng_pack_early) in a random order, some
 * first packed from wrong gradients and undone (eng_pack_early_undo), while
 * the host run steps plainly; the ends must be equal as above, and the
 * tensors each call packed those of its bucket.
 * The gradients depend on the parameters, so any difference grows instead of
 * hiding.  One line per case, a PASS/FAIL line last; "SKIP: <reason>" and
 * exit 77 without a GPU or NCCL.  With --sim the run under test is the sim
 * executor on the local backend instead (no GPU needed): the CPU tests run
 * this harness that way, so that its first GPU run checks the GPU, not the
 * harness.
 *
 *   gpu_exec [--steps S] [--quick] [--sim]
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "comm_nccl.h"
#include "engine.h"
#include "try.h"

#define MAX_TR 3
#define GC_SKIP 77

/* A layout with one tensor of several top-k items, many small ones and
 * lengths that are no multiple of 32. */
static const size_t s_lens[] = { 40000, 97, 1, 8192, 8193, 33, 3000, 511, 64, 20000,
                                 7, 12345, 31, 2048, 5000 };
#define NT (sizeof s_lens / sizeof s_lens[0])

typedef struct kase {
    eng_optimizer opt;
    eng_mode mode;
    double rho;
    kern_dtype gdt, pdt;
    int tr;
    int pinned;      /* the cuda run's trainer buffers in pinned host memory */
    int resident;    /* residual_on_device */
    int defer;
    uint32_t chunk;  /* residual_chunk */
    float clip_at;   /* max_grad_norm (0: none) */
    int wire_bf16;   /* wire_values: bf16 */
    int deltas;      /* mask_deltas (2: forced) */
    double rho_start; /* density schedule (0: none), over 40 masked steps */
    uint32_t dense_below; /* tensors of at most this many coordinates go whole */
    eng_gather gather;    /* gather_values */
    uint32_t split_above; /* tensors longer than this go in pieces (0: whole) */
} kase;

/* One job's buffers and engine. */
typedef struct job {
    eng_t *e;
    int device;      /* the buffers are GPU-side (cuda run, not --sim) */
    int pinned;
    void *g[MAX_TR], *p[MAX_TR];
    void *gh[MAX_TR]; /* host staging of the trainers' gradients */
    /* bucketed hand-over (eng_pack_early), on the job under test only */
    int early;
    void *poison;    /* host bytes 0xff (NaN): a gradient not yet produced */
    size_t pieces[NT]; /* comm-order pieces of each registered tensor */
    unsigned char written[NT]; /* step t's gradient is in the buffers */
    unsigned char done[NT];    /* packed early since the step or the undo */
} job;

static eng_tensor s_layout[NT];
static size_t s_n;
static int s_failures, s_cases;
static int s_sim;    /* the run under test is the sim executor, in host memory */

static void build_layout(void)
{
    static char names[NT][24];
    size_t off = 0;
    for (size_t i = 0; i < NT; i++) {
        snprintf(names[i], sizeof names[i], "t%zu", i);
        s_layout[i] = (eng_tensor){ names[i], off, s_lens[i], 0 };
        off += s_lens[i];
    }
    s_n = off;
}

static void cuda_or_die(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        printf("FAIL: %s: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
}

static comm_t *open_comm(int nccl)
{
    comm_t *c = NULL;
    scape_rc rc;
    if (nccl) {
        comm_nccl_opts o = { .rank = 0, .size = 1, .device = 0, .timeout_ms = 60000 };
        rc = comm_nccl_make_ids(o.ids, sizeof o.ids);
        if (rc == SCAPE_OK)
            rc = comm_nccl_create(&o, &c);
    } else {
        rc = comm_local_create(1, &c);
    }
    if (rc != SCAPE_OK) {
        printf("FAIL: %s backend: %s\n", nccl ? "nccl" : "local", scape_last_error());
        exit(1);
    }
    return c;
}

static eng_config config_of(const kase *k, int under_test)
{
    eng_config c;
    eng_config_default(&c);
    c.optimizer = k->opt;
    c.mode = k->mode;
    c.rho = k->rho;
    c.warmup = 3;
    c.hyper.wd = 0.01f;
    c.defer_select = k->defer;
    c.executor = !under_test ? ENG_EXEC_HOST : s_sim ? ENG_EXEC_SIM : ENG_EXEC_CUDA;
    c.residual_on_device = k->resident;
    c.residual_chunk = k->chunk;
    c.max_grad_norm = k->clip_at;
    c.wire_bf16 = k->wire_bf16;
    c.mask_deltas = k->deltas;
    c.rho_start = k->rho_start;
    c.rho_steps = 40;
    c.dense_below = k->dense_below;
    c.gather = k->gather;
    c.split_above = k->split_above;
    return c;
}

static void *buffer(const job *j, size_t bytes)
{
    void *p = NULL;
    if (!j->device)
        p = calloc(1, bytes);
    else if (j->pinned)
        cuda_or_die(cudaMallocHost(&p, bytes), "cudaMallocHost");
    else
        cuda_or_die(cudaMalloc(&p, bytes), "cudaMalloc");
    if (p == NULL) {
        printf("FAIL: out of memory\n");
        exit(1);
    }
    return p;
}

static void release(const job *j, void *p)
{
    if (!j->device)
        free(p);
    else if (j->pinned)
        cudaFreeHost(p);
    else
        cudaFree(p);
}

/* Bytes into one of the job's buffers, or out of it.  From pageable memory
 * cudaMemcpy may return before the bytes have landed on the device (the
 * runtime's "API synchronization behavior"), and the executor reads them on
 * streams of its own: the default stream it used is synchronised, as a
 * trainer's gradient-ready event would order them. */
static void put(const job *j, void *dst, const void *src, size_t bytes)
{
    if (j->device) {
        cuda_or_die(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
        cuda_or_die(cudaStreamSynchronize(0), "cudaStreamSynchronize");
    } else {
        memcpy(dst, src, bytes);
    }
}

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* Trainer q's gradient at step t: a persistent signal, fresh noise, and
 * 0.1 of the parameter (so results feed back). */
static float grad_of(int q, uint64_t t, size_t i, float p)
{
    uint64_t base = mix(i * 0x9e3779b97f4a7c15ull);
    uint64_t h = mix(base ^ ((uint64_t)q << 40) ^ t);
    double u = (double)(base >> 11) / 9007199254740992.0 - 0.5;
    double v = (double)(h >> 11) / 9007199254740992.0 - 0.5;
    return (float)(0.3 * u + v) + 0.1f * p;
}

static float as_f32(const void *buf, kern_dtype dt, size_t i)
{
    return dt == KERN_F32 ? ((const float *)buf)[i]
                          : kern_f32_from_bf16(((const uint16_t *)buf)[i]);
}

static void store(void *buf, kern_dtype dt, size_t i, float x)
{
    if (dt == KERN_F32)
        ((float *)buf)[i] = x;
    else
        ((uint16_t *)buf)[i] = kern_bf16_from_f32(x);
}

static void job_open(job *j, const kase *k, int under_test, comm_t *comm)
{
    memset(j, 0, sizeof *j);
    j->device = under_test && !s_sim;
    j->pinned = j->device && k->pinned;
    size_t pb = s_n * kern_dtype_size(k->pdt), gb = s_n * kern_dtype_size(k->gdt);
    void *init = malloc(pb);
    for (size_t i = 0; i < s_n; i++)
        store(init, k->pdt, i, 0.01f * (float)((i * 37) % 101) - 0.5f);
    for (int q = 0; q < k->tr; q++) {
        j->g[q] = buffer(j, gb);
        j->p[q] = buffer(j, pb);
        put(j, j->p[q], init, pb); /* trainer 0's are broadcast to the others */
    }
    for (int q = 0; q < k->tr; q++)
        j->gh[q] = calloc(1, gb + 8); /* + 8: write_tensor's wrong bytes */
    free(init);
    eng_config cfg = config_of(k, under_test);
    eng_layout lay = { s_layout, NT, k->pdt, k->gdt, NULL, 0 };
    if (eng_create(&j->e, &cfg, &lay, comm, k->tr) != SCAPE_OK) {
        printf("FAIL: eng_create (%s): %s\n", eng_executor_name(cfg.executor),
               scape_last_error());
        exit(1);
    }
}

static void job_close(job *j, const kase *k)
{
    eng_destroy(&j->e);
    for (int q = 0; q < k->tr; q++) {
        release(j, j->g[q]);
        release(j, j->p[q]);
        free(j->gh[q]);
    }
    free(j->poison);
}

/* ---- bucketed hand-over (eng_pack_early) ------------------------------- */

/* The job under test hands its gradients over in buckets; each registered
 * tensor is so many comm-order pieces (split_above: ceil(len / split_above)
 * when longer, as docs/algorithm.md cuts them). */
static void early_open(job *j, const kase *k)
{
    size_t gb = s_n * kern_dtype_size(k->gdt);
    j->early = 1;
    if ((j->poison = malloc(gb)) == NULL) {
        printf("FAIL: out of memory\n");
        exit(1);
    }
    memset(j->poison, 0xff, gb); /* NaN in f32 and in bf16 */
    for (size_t l = 0; l < NT; l++) {
        size_t len = s_layout[l].length, cut = k->split_above;
        j->pieces[l] = cut == 0 || len <= cut ? 1 : (len + cut - 1) / cut;
    }
}

/* Registered tensor l's gradient into every trainer's buffer: step t's, or
 * (wrong) bytes of no step, which an undo must take back. */
static void write_tensor(job *j, const kase *k, size_t l, int wrong)
{
    size_t es = kern_dtype_size(k->gdt), off = s_layout[l].offset * es;
    for (int q = 0; q < k->tr; q++) {
        const char *src = wrong ? (const char *)j->gh[(q + 1) % k->tr] + es
                                : (const char *)j->gh[q];
        put(j, (char *)j->g[q] + off, src + off, s_layout[l].length * es);
    }
    j->written[l] = !wrong;
}

/* One bucket's gradients written, then the bucket posted; the pieces the
 * engine says it packed must be those of its tensors not packed yet (none
 * for an optimizer that reads the whole gradient first). */
static scape_rc post(job *j, const kase *k, uint64_t t, const unsigned char *bucket, int wrong,
                     size_t *total)
{
    size_t packed = SIZE_MAX, want = 0;
    for (size_t l = 0; l < NT; l++) {
        if (!bucket[l])
            continue;
        if (wrong || !j->written[l])
            write_tensor(j, k, l, wrong);
        want += j->done[l] ? 0 : j->pieces[l];
    }
    TRY(eng_pack_early(j->e, t, (const void *const *)j->g, bucket, &packed));
    if (eng_opt_get(k->opt)->intake)
        want = 0;
    if (packed != want)
        return scape_set_error(SCAPE_INVALID, "step %llu: a bucket packed %zu comm-order "
                               "tensors early, expected %zu", (unsigned long long)t, packed, want);
    for (size_t l = 0; l < NT; l++)
        j->done[l] |= bucket[l];
    *total += packed;
    return SCAPE_OK;
}

/* nb buckets drawn from h: each tensor in one of them, and an order. */
static void draw_buckets(uint64_t h, size_t nb, unsigned char (*bucket)[NT], size_t *order)
{
    memset(bucket, 0, nb * sizeof *bucket);
    for (size_t l = 0; l < NT; l++)
        bucket[mix(h ^ (l * 77)) % nb][l] = 1;
    for (size_t b = 0; b < nb; b++)
        order[b] = b;
    for (size_t b = nb - 1; b > 0; b--) {
        size_t q = (size_t)(mix(h + b) % (b + 1)), s = order[b];
        order[b] = order[q];
        order[q] = s;
    }
}

/* Step t with buckets: the trainers' buffers start as NaN (nothing produced
 * yet); on one step in four some buckets are first packed from wrong
 * gradients and undone; then a random subset of the buckets is posted in a
 * random order, each written just before, one sometimes twice; the rest is
 * written and the step packs it.  The step's count must be the calls'. */
static scape_rc step_early(job *j, const kase *k, uint64_t t)
{
    uint64_t h = mix(t ^ ((uint64_t)s_cases << 32) ^ 0x5eedb0c4e7ull);
    size_t nb = 1 + (size_t)(h % 6), order[6], total = 0, gb = s_n * kern_dtype_size(k->gdt);
    unsigned char bucket[6][NT];
    eng_step_stats st;
    draw_buckets(h, nb, bucket, order);
    for (int q = 0; q < k->tr; q++)
        put(j, j->g[q], j->poison, gb);
    memset(j->written, 0, sizeof j->written);
    memset(j->done, 0, sizeof j->done);
    if ((h >> 8) % 4 == 0) {
        for (size_t b = 0; b < nb; b++)
            if (mix(h ^ b ^ 0x77) & 1)
                TRY(post(j, k, t, bucket[order[b]], 1, &total));
        TRY(eng_pack_early_undo(j->e));
        memset(j->done, 0, sizeof j->done);
        total = 0;
    }
    for (size_t b = 0; b < nb; b++) {
        if (mix(h ^ b) & 3)
            TRY(post(j, k, t, bucket[order[b]], 0, &total));
        if ((mix(h ^ b ^ 0xabc) & 7) == 0) /* posted again: nothing new */
            TRY(post(j, k, t, bucket[order[b]], 0, &total));
    }
    for (size_t l = 0; l < NT; l++)
        if (!j->written[l])
            write_tensor(j, k, l, 0);
    TRY(eng_step(j->e, t, 1e-3f, (const void *const *)j->g, j->p));
    TRY(eng_last_stats(j->e, &st));
    if (st.early_tensors != total)
        return scape_set_error(SCAPE_INVALID, "step %llu: the step counts %zu tensors packed "
                               "early, the calls %zu", (unsigned long long)t, st.early_tensors,
                               total);
    return SCAPE_OK;
}

/* Steps [from, to]: every trainer's gradient from its own parameters. */
static scape_rc run_steps(job *j, const kase *k, uint64_t from, uint64_t to)
{
    size_t pb = s_n * kern_dtype_size(k->pdt), gb = s_n * kern_dtype_size(k->gdt);
    void *ph = malloc(pb);
    scape_rc rc = SCAPE_OK;
    for (uint64_t t = from; rc == SCAPE_OK && t <= to; t++) {
        for (int q = 0; q < k->tr; q++) {
            put(j, ph, j->p[q], pb);
            for (size_t i = 0; i < s_n; i++)
                store(j->gh[q], k->gdt, i, grad_of(q, t, i, as_f32(ph, k->pdt, i)));
            if (!j->early)
                put(j, j->g[q], j->gh[q], gb);
        }
        if (j->early)
            rc = step_early(j, k, t);
        else
            rc = eng_step(j->e, t, 1e-3f, (const void *const *)j->g, j->p);
        if (rc == SCAPE_OK && k->defer && t % 2)
            rc = eng_step_finish(j->e);
    }
    free(ph);
    return rc;
}

/* The first coordinate where two vectors differ, or -1. */
static long first_diff(const void *a, const void *b, size_t n, size_t esz)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp((const char *)a + i * esz, (const char *)b + i * esz, esz) != 0)
            return (long)i;
    return -1;
}

/* m, v or theta of both engines; 0 and a reason when they differ. */
static int same_vector(const job *h, const job *c, eng_state_vec which, const char *name,
                       char *why, size_t len)
{
    float *va = malloc(s_n * sizeof *va), *vb = malloc(s_n * sizeof *vb);
    unsigned char *ha = malloc(s_n), *hb = malloc(s_n);
    int ok = 1;
    if (eng_get_state(h->e, which, va, ha) != SCAPE_OK ||
        eng_get_state(c->e, which, vb, hb) != SCAPE_OK) {
        snprintf(why, len, "eng_get_state %s: %s", name, scape_last_error());
        ok = 0;
    } else {
        long d = first_diff(va, vb, s_n, 4);
        if (d >= 0) {
            snprintf(why, len, "%s[%ld]: %.9g vs %.9g", name, d, (double)va[d], (double)vb[d]);
            ok = 0;
        }
    }
    free(va);
    free(vb);
    free(ha);
    free(hb);
    return ok;
}

/* The residual and the last mask of both engines. */
static int same_residual_and_mask(const job *h, const job *c, char *why, size_t len)
{
    float *va = malloc(s_n * sizeof *va), *vb = malloc(s_n * sizeof *vb);
    unsigned char *ha = malloc(s_n), *hb = malloc(s_n);
    int ok = 1;
    long d;
    if (eng_get_residual(h->e, va) != SCAPE_OK || eng_get_residual(c->e, vb) != SCAPE_OK) {
        snprintf(why, len, "eng_get_residual: %s", scape_last_error());
        ok = 0;
    } else if ((d = first_diff(va, vb, s_n, 4)) >= 0) {
        snprintf(why, len, "residual[%ld]: %.9g vs %.9g", d, (double)va[d], (double)vb[d]);
        ok = 0;
    } else if (eng_get_mask(h->e, ha) != SCAPE_OK || eng_get_mask(c->e, hb) != SCAPE_OK) {
        snprintf(why, len, "eng_get_mask: %s", scape_last_error());
        ok = 0;
    } else if ((d = first_diff(ha, hb, s_n, 1)) >= 0) {
        snprintf(why, len, "mask bit %ld", d);
        ok = 0;
    }
    free(va);
    free(vb);
    free(ha);
    free(hb);
    return ok;
}

/* Everything the issue names: parameters, m (v), theta, residual, mask. */
static int compare(const job *h, const job *c, const kase *k, char *why, size_t len)
{
    size_t pb = s_n * kern_dtype_size(k->pdt);
    void *a = malloc(pb), *b = malloc(pb);
    int ok = 1;
    for (int q = 0; ok && q < k->tr; q++) {
        put(h, a, h->p[q], pb);
        put(c, b, c->p[q], pb);
        long d = first_diff(a, b, s_n, kern_dtype_size(k->pdt));
        if (d >= 0) {
            snprintf(why, len, "trainer %d's parameter %ld: %.9g vs %.9g", q, d,
                     (double)as_f32(a, k->pdt, (size_t)d), (double)as_f32(b, k->pdt, (size_t)d));
            ok = 0;
        }
    }
    free(a);
    free(b);
    int uses_v = k->opt == ENG_OPT_ADAMW || k->opt == ENG_OPT_TOPK_ADAMW;
    ok = ok && same_vector(h, c, ENG_VEC_M, "m", why, len);
    ok = ok && (!uses_v || same_vector(h, c, ENG_VEC_V, "v", why, len));
    ok = ok && same_vector(h, c, ENG_VEC_THETA, "theta", why, len);
    eng_step_stats sh, sc;
    if (ok && (eng_last_stats(h->e, &sh) != SCAPE_OK || eng_last_stats(c->e, &sc) != SCAPE_OK ||
               memcmp(&sh.grad_norm, &sc.grad_norm, sizeof sh.grad_norm) != 0 ||
               memcmp(&sh.clip, &sc.clip, sizeof sh.clip) != 0)) {
        snprintf(why, len, "gradient norm %.17g vs %.17g, clip %.9g vs %.9g", sh.grad_norm,
                 sc.grad_norm, sh.clip, sc.clip);
        ok = 0;
    }
    return ok && same_residual_and_mask(h, c, why, len);
}

static const char *dt_name(kern_dtype d) { return d == KERN_F32 ? "f32" : "bf16"; }

static void describe(const kase *k, char *buf, size_t len)
{
    char small[32] = "", split[32] = "";
    if (k->dense_below)
        snprintf(small, sizeof small, " whole<=%u", (unsigned)k->dense_below);
    if (k->split_above)
        snprintf(split, sizeof split, " split>%u", (unsigned)k->split_above);
    snprintf(buf, len, "%-10s %-10s rho %-5g grads %-4s params %-4s T_r %d%s%s%s%s%s%s%s%s%s%s%s",
             eng_optimizer_name(k->opt), eng_mode_name(k->mode), k->rho, dt_name(k->gdt),
             dt_name(k->pdt), k->tr, k->pinned ? " pinned-buffers" : "",
             k->resident ? " residual-on-device" : "", k->defer ? " deferred" : "",
             k->chunk < 100000 ? " small-chunks" : "", k->clip_at > 0 ? " clipped" : "",
             k->wire_bf16 ? " bf16-values" : "", k->deltas ? " mask-deltas" : "",
             k->rho_start > 0 ? " schedule" : "", small,
             k->gather == ENG_GATHER_DELTA ? " gather-delta" : "", split);
}

static void report(const kase *k, const char *what, int ok, const char *why, double secs)
{
    char d[320];
    describe(k, d, sizeof d);
    printf("%-4s %-9s %s  (%.1f s)%s%s\n", ok ? "ok" : "FAIL", what, d, secs, ok ? "" : ": ",
           ok ? "" : why);
    s_cases++;
    s_failures += !ok;
    fflush(stdout);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The same job on both executors, compared at the end; with early, the run
 * under test hands its gradients over in buckets (step_early). */
static void same_bits(const kase *k, comm_t *local, comm_t *dev_comm, int steps, int early)
{
    double t0 = now_s();
    job h, c;
    job_open(&h, k, 0, local);
    job_open(&c, k, 1, dev_comm);
    if (early)
        early_open(&c, k);
    char why[300] = "";
    int ok = eng_init_params(h.e, h.p) == SCAPE_OK && eng_init_params(c.e, c.p) == SCAPE_OK;
    if (!ok)
        snprintf(why, sizeof why, "eng_init_params: %s", scape_last_error());
    if (ok && run_steps(&h, k, 1, (uint64_t)steps) != SCAPE_OK) {
        snprintf(why, sizeof why, "host step: %s", scape_last_error());
        ok = 0;
    }
    if (ok && run_steps(&c, k, 1, (uint64_t)steps) != SCAPE_OK) {
        snprintf(why, sizeof why, "step under test: %s", scape_last_error());
        ok = 0;
    }
    if (ok)
        ok = compare(&h, &c, k, why, sizeof why);
    job_close(&h, k);
    job_close(&c, k);
    report(k, early ? "buckets" : "steps", ok, why, now_s() - t0);
}

/* The sections a checkpoint of e would write, copied out (a checkpoint in
 * memory: the file format is ckpt.c's and tested apart). */
typedef struct saved {
    eng_ckpt_meta meta;
    int n;
    uint32_t id[ENG_CKPT_MAX_SECS];
    size_t bytes[ENG_CKPT_MAX_SECS];
    void *data[ENG_CKPT_MAX_SECS];
} saved;

static int save(eng_t *e, saved *s)
{
    eng_ckpt_sec secs[ENG_CKPT_MAX_SECS];
    memset(s, 0, sizeof *s);
    if (eng_ckpt_save(e, &s->meta, secs, &s->n) != SCAPE_OK)
        return 0;
    for (int i = 0; i < s->n; i++) {
        s->id[i] = secs[i].id;
        s->bytes[i] = secs[i].bytes;
        s->data[i] = malloc(secs[i].bytes ? secs[i].bytes : 1);
        memcpy(s->data[i], secs[i].ptr, secs[i].bytes);
    }
    return 1;
}

static int restore(eng_t *e, const saved *s, void *const *params)
{
    eng_ckpt_sec secs[ENG_CKPT_MAX_SECS];
    int n = 0;
    if (eng_ckpt_load_begin(e, &s->meta, secs, &n) != SCAPE_OK)
        return 0;
    if (n != s->n)
        return 0;
    for (int i = 0; i < n; i++) {
        if (secs[i].id != s->id[i] || secs[i].bytes != s->bytes[i])
            return 0;
        memcpy(secs[i].ptr, s->data[i], secs[i].bytes);
    }
    return eng_ckpt_load_finish(e, &s->meta, params) == SCAPE_OK;
}

static void saved_free(saved *s)
{
    for (int i = 0; i < s->n; i++)
        free(s->data[i]);
}

/* Save after half the steps on one executor, restore into a fresh engine on
 * the other, go on; compare with the uninterrupted host run, which lives
 * meanwhile on a comm of its own (its last mask all-gather is outstanding
 * there). */
static void resume_across(const kase *k, comm_t *ref_comm, comm_t *local, comm_t *dev_comm,
                          int steps, int from_test)
{
    double t0 = now_s();
    uint64_t half = (uint64_t)steps / 2;
    job ref, a, b;
    char why[300] = "";
    saved s;
    memset(&s, 0, sizeof s);
    job_open(&ref, k, 0, ref_comm);
    int ok = eng_init_params(ref.e, ref.p) == SCAPE_OK &&
             run_steps(&ref, k, 1, (uint64_t)steps) == SCAPE_OK;
    job_open(&a, k, from_test, from_test ? dev_comm : local);
    ok = ok && eng_init_params(a.e, a.p) == SCAPE_OK && run_steps(&a, k, 1, half) == SCAPE_OK &&
         save(a.e, &s);
    job_close(&a, k);
    job_open(&b, k, !from_test, from_test ? local : dev_comm);
    ok = ok && restore(b.e, &s, b.p) && run_steps(&b, k, half + 1, (uint64_t)steps) == SCAPE_OK;
    if (!ok)
        snprintf(why, sizeof why, "save, restore or step: %s", scape_last_error());
    if (ok)
        ok = compare(&ref, &b, k, why, sizeof why);
    saved_free(&s);
    job_close(&ref, k);
    job_close(&b, k);
    report(k, from_test ? "dev>host" : "host>dev", ok, why, now_s() - t0);
}

/* Bucketed hand-over: every optimizer in both modes with f32 gradients,
 * some with bf16 ones, 1 and 3 trainers, the residual streamed in small
 * chunks or kept on the device, and (scape) tensors split in pieces. */
static void bucketed(comm_t *local, comm_t *dev_comm, int steps)
{
    const kase eb[] = {
        { ENG_OPT_SCAPE, ENG_MODE_REPLICATED, 0.01, KERN_F32, KERN_F32, 1, 0, 0, 0, 5000,
          0.0f, 0, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_SCAPE, ENG_MODE_SHARDED, 0.01, KERN_BF16, KERN_F32, 3, 0, 1, 1, 4u << 20,
          0.01f, 0, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_ADAMS, ENG_MODE_REPLICATED, 1.0, KERN_F32, KERN_F32, 3, 1, 0, 0, 5000,
          0.0f, 0, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_ADAMS, ENG_MODE_SHARDED, 1.0, KERN_F32, KERN_F32, 1, 0, 0, 1, 4u << 20,
          0.0f, 0, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_ADAMW, ENG_MODE_REPLICATED, 1.0, KERN_F32, KERN_F32, 1, 0, 1, 0, 4u << 20,
          0.01f, 0, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_ADAMW, ENG_MODE_SHARDED, 1.0, KERN_F32, KERN_F32, 3, 0, 0, 1, 5000,
          0.0f, 0, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_TOPK_ADAMW, ENG_MODE_REPLICATED, 0.05, KERN_F32, KERN_F32, 3, 0, 0, 0,
          4u << 20, 0.0f, 0, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_TOPK_ADAMW, ENG_MODE_SHARDED, 0.05, KERN_BF16, KERN_F32, 1, 1, 0, 0,
          4u << 20, 0.0f, 1, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_SCAPE, ENG_MODE_SHARDED, 0.01, KERN_F32, KERN_F32, 3, 1, 0, 0, 5000,
          0.0f, 1, 1, 0.0, 0, ENG_GATHER_DELTA, 10000 },
        { ENG_OPT_SCAPE, ENG_MODE_REPLICATED, 0.01, KERN_BF16, KERN_BF16, 1, 0, 0, 1, 4u << 20,
          0.0f, 1, 2, 0.2, 5000, ENG_GATHER_PARAMS, 8192 },
    };
    for (size_t i = 0; i < sizeof eb / sizeof eb[0]; i++)
        same_bits(&eb[i], local, dev_comm, steps, 1);
}

/* 1 when the run under test can run here; else why not, printed. */
static int ready(void)
{
    const char *why = NULL;
    if (s_sim)
        return 1;
    if (!comm_nccl_built()) {
        printf("SKIP: gpu_exec: this build has no nccl backend\n");
        return 0;
    }
    if (!kern_cuda_available(&why)) {
        printf("SKIP: gpu_exec: %s\n", why);
        return 0;
    }
    return 1;
}

int main(int argc, char **argv)
{
    int steps = 200, quick = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--quick") == 0)
            quick = 1;
        else if (strcmp(argv[i], "--sim") == 0)
            s_sim = 1;
    }
    if (!ready())
        return GC_SKIP;
    build_layout();
    comm_t *local = open_comm(0), *ref_comm = open_comm(0), *dev_comm = open_comm(!s_sim);
    printf("gpu_exec: N = %zu in %zu tensors, %d steps per job, %s against host\n", s_n, NT,
           steps, s_sim ? "sim" : "cuda");
    const struct {
        eng_optimizer opt;
        double rho;
    } opts[] = { { ENG_OPT_SCAPE, 0.01 }, { ENG_OPT_ADAMS, 1.0 }, { ENG_OPT_ADAMW, 1.0 },
                 { ENG_OPT_TOPK_ADAMW, 0.05 } };
    int variant = 0;
    for (size_t o = 0; o < 4; o++)
        for (int mode = 0; mode < 2; mode++)
            for (int bf = 0; bf < 2; bf++)
                for (int tr = 1; tr <= 3; tr += 2, variant++) {
                    kase k = { opts[o].opt, (eng_mode)mode, opts[o].rho,
                               bf ? KERN_BF16 : KERN_F32, KERN_F32, tr,
                               .pinned = variant % 5 == 1, .resident = variant % 3 == 2,
                               .defer = variant % 2,
                               .chunk = variant % 4 == 3 ? 5000u : 4u << 20,
                               .clip_at = variant % 3 == 1 ? 0.01f : 0.0f };
                    if (bf && tr == 3)
                        k.pdt = KERN_BF16; /* bf16 parameters too, on some */
                    if (quick && variant % 4)
                        continue;
                    same_bits(&k, local, dev_comm, steps, 0);
                }
    /* fewer bytes: bf16 values, bf16 gathers, mask deltas, a schedule */
    const kase fb[] = {
        { ENG_OPT_SCAPE, ENG_MODE_SHARDED, 0.01, KERN_F32, KERN_F32, 1, 0, 0, 0, 4u << 20,
          0.0f, 1, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_SCAPE, ENG_MODE_SHARDED, 0.01, KERN_BF16, KERN_BF16, 3, 0, 1, 1, 5000,
          0.0f, 1, 1, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_SCAPE, ENG_MODE_REPLICATED, 0.01, KERN_F32, KERN_F32, 1, 0, 0, 1, 4u << 20,
          0.0f, 1, 2, 0.2, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_TOPK_ADAMW, ENG_MODE_SHARDED, 0.05, KERN_F32, KERN_F32, 1, 0, 0, 0,
          4u << 20, 0.0f, 1, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        /* changes on the wire (fp32 trainers): device and pinned trainers,
         * sharded and replicated, several trainers */
        { ENG_OPT_SCAPE, ENG_MODE_SHARDED, 0.01, KERN_F32, KERN_F32, 3, 0, 0, 1, 4u << 20,
          0.0f, 1, 1, 0.0, .gather = ENG_GATHER_DELTA },
        { ENG_OPT_SCAPE, ENG_MODE_SHARDED, 0.01, KERN_BF16, KERN_F32, 1, 1, 1, 0, 5000,
          0.01f, 1, 0, 0.0, .gather = ENG_GATHER_DELTA },
        { ENG_OPT_SCAPE, ENG_MODE_REPLICATED, 0.01, KERN_F32, KERN_F32, 3, 1, 0, 0, 4u << 20,
          0.0f, 1, 0, 0.0, .gather = ENG_GATHER_DELTA },
        /* small tensors whole: all but the 40000, 20000 and 12345 (top-k
         * with k = len, over several items at 8192 and 8193), under a
         * schedule, with and without changes on the wire */
        { ENG_OPT_SCAPE, ENG_MODE_SHARDED, 0.01, KERN_F32, KERN_F32, 3, 0, 0, 0, 4u << 20,
          0.0f, 1, 1, 0.2, .dense_below = 10000, .gather = ENG_GATHER_DELTA },
        { ENG_OPT_SCAPE, ENG_MODE_REPLICATED, 0.01, KERN_BF16, KERN_BF16, 1, 0, 1, 1, 4u << 20,
          0.0f, 1, 2, 0.0, .dense_below = 10000 },
    };
    for (size_t i = 0; i < sizeof fb / sizeof fb[0]; i++)
        same_bits(&fb[i], local, dev_comm, steps, 0);
    const kase rs[] = {
        { ENG_OPT_SCAPE, ENG_MODE_REPLICATED, 0.01, KERN_F32, KERN_F32, 3, 0, 0, 1, 5000, 0.0f,
          0, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_SCAPE, ENG_MODE_SHARDED, 0.01, KERN_BF16, KERN_F32, 1, 0, 1, 0, 4u << 20,
          0.01f, 0, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        { ENG_OPT_TOPK_ADAMW, ENG_MODE_REPLICATED, 0.05, KERN_F32, KERN_F32, 1, 0, 0, 0,
          4u << 20, 0.0f, 0, 0, 0.0, 0, ENG_GATHER_PARAMS, 0 },
        /* a checkpoint between deltas, under the schedule, bf16 values */
        { ENG_OPT_SCAPE, ENG_MODE_SHARDED, 0.01, KERN_F32, KERN_F32, 1, 0, 0, 0, 4u << 20,
          0.0f, 1, 2, 0.2, 0, ENG_GATHER_PARAMS, 0 },
        /* and with changes on the wire and the small tensors whole */
        { ENG_OPT_SCAPE, ENG_MODE_SHARDED, 0.01, KERN_F32, KERN_F32, 3, 0, 0, 1, 4u << 20,
          0.0f, 1, 1, 0.0, .dense_below = 5000, .gather = ENG_GATHER_DELTA },
    };
    for (size_t i = 0; i < sizeof rs / sizeof rs[0]; i++) {
        resume_across(&rs[i], ref_comm, local, dev_comm, steps, 1);
        resume_across(&rs[i], ref_comm, local, dev_comm, steps, 0);
    }
    bucketed(local, dev_comm, steps);
    comm_destroy(&dev_comm);
    comm_destroy(&ref_comm);
    comm_destroy(&local);
    printf("gpu_exec: %s: %d of %d cases equal bit for bit\n", s_failures ? "FAIL" : "PASS",
           s_cases - s_failures, s_cases);
    return s_failures ? 1 : 0;
}
