/* fuzz_ckpt.c - a checkpoint as `scaped --resume` finds it on disk
 * (daemon/ckpt.c): LATEST, the step directory's MANIFEST, and the rank file
 * with its header, section table and checksummed sections.
 *
 * Input: records (fuzz.h) whose selector says which file they are: 0 the
 * MANIFEST, 1 rank 0's file (rank-00000.ckpt), 2 LATEST at the root (no
 * record: resume names the step directory itself).  The seed is a real
 * checkpoint that the engine wrote after three steps.
 *
 * Checked for every input, beyond "no crash":
 *   - a refusal says why;
 *   - a checkpoint ckpt_open accepts names the step directory it checked and
 *     this job's world or a resharding, and restores into a fresh engine of
 *     the seed's layout, or is refused there with a reason; a restore that
 *     succeeds leaves finite parameters.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "comm.h"
#include "engine.h"
#include "fuzz.h"

#define N 96
static const eng_tensor s_layout[] = { { "w", 0, 64, 0 }, { "b", 64, 32, 0 } };
static char s_root[64], s_step[128];
/* A step directory's files, by record selector. */
static const char *s_files[] = { "MANIFEST", "rank-00000.ckpt" };

static void write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    FUZZ_CHECK(f && fwrite(p, 1, n, f) == n && fclose(f) == 0, "cannot write %s: %s", path,
               strerror(errno));
}

/* An engine of the seed's layout on one local rank. */
static void make_engine(eng_t **e, comm_t **comm)
{
    FUZZ_CHECK(comm_local_create(1, comm) == SCAPE_OK, "comm: %s", scape_last_error());
    eng_config cfg;
    eng_config_default(&cfg);
    cfg.rho = 0.125;
    eng_layout lay = { s_layout, 2, KERN_F32, KERN_F32, NULL, 0 };
    FUZZ_CHECK(eng_create(e, &cfg, &lay, *comm, 1) == SCAPE_OK, "engine: %s",
               scape_last_error());
}

static void remove_files(void)
{
    char path[256];
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", s_step, s_files[i]);
        unlink(path);
    }
    snprintf(path, sizeof path, "%s/LATEST", s_root);
    unlink(path);
}

static void cleanup(void)
{
    remove_files();
    rmdir(s_step);
    rmdir(s_root);
}

void fuzz_setup(void)
{
    snprintf(s_root, sizeof s_root, "/tmp/scape-fuzz-ckpt-XXXXXX");
    FUZZ_CHECK(mkdtemp(s_root) != NULL, "mkdtemp: %s", strerror(errno));
    snprintf(s_step, sizeof s_step, "%s/step-3", s_root);
    FUZZ_CHECK(mkdir(s_step, 0700) == 0, "mkdir %s: %s", s_step, strerror(errno));
    atexit(cleanup);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[256];
    remove_files();
    int latest = 0;
    fuzz_in in = { data, size };
    uint32_t sel;
    const uint8_t *p;
    size_t n;
    while (fuzz_record(&in, &sel, &p, &n)) {
        sel %= 3;
        if (sel == 2)
            snprintf(path, sizeof path, "%s/LATEST", s_root);
        else
            snprintf(path, sizeof path, "%s/%s", s_step, s_files[sel]);
        write_file(path, p, n);
        latest |= sel == 2;
    }
    const char *v = getenv("SCAPE_FUZZ_LOG");
    int verbose = v && strcmp(v, "2") == 0; /* SCAPE_FUZZ_LOG=2: what became of it */
    ckpt_ref ref;
    if (ckpt_open(latest ? s_root : s_step, 0, 1, &ref) != SCAPE_OK) {
        if (verbose)
            fprintf(stderr, "open refused: %s\n", scape_last_error());
        FUZZ_CHECK(scape_last_error()[0] != '\0', "a checkpoint refused without a reason");
        return 0;
    }
    FUZZ_CHECK(strncmp(ref.dir, s_root, strlen(s_root)) == 0, "opened %s, outside %s", ref.dir,
               s_root);
    FUZZ_CHECK(ref.world >= 1 && (ref.world == 1) == !ref.reshard,
               "world %u with reshard %d for a job of 1", ref.world, ref.reshard);
    eng_t *e = NULL;
    comm_t *comm = NULL;
    make_engine(&e, &comm);
    float *params = calloc(N, sizeof *params);
    FUZZ_CHECK(params != NULL, "out of memory");
    void *bufs[1] = { params };
    scape_rc rc = ckpt_restore(&ref, e, comm, bufs);
    if (verbose)
        fprintf(stderr, "opened %s (step %llu, world %u): restore %s\n", ref.dir,
                (unsigned long long)ref.step, ref.world,
                rc == SCAPE_OK ? "done" : scape_last_error());
    if (rc == SCAPE_OK) {
        for (int i = 0; i < N; i++)
            FUZZ_CHECK(isfinite(params[i]), "restored parameter %d is %g", i, params[i]);
    } else {
        FUZZ_CHECK(scape_last_error()[0] != '\0', "a restore refused without a reason");
    }
    free(params);
    eng_destroy(&e);
    comm_destroy(&comm);
    return 0;
}

/* ---- seeds: a checkpoint the engine wrote ---------------------------------- */

static void put_file(fuzz_buf *b, uint8_t sel, const char *path)
{
    FILE *f = fopen(path, "rb");
    FUZZ_CHECK(f != NULL, "cannot read %s: %s", path, strerror(errno));
    static uint8_t buf[60000];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    FUZZ_CHECK(n < sizeof buf, "%s is too big for a seed", path);
    fuzz_put(b, sel, buf, n);
}

void fuzz_seeds(fuzz_emit emit, void *ctx)
{
    char root[64];
    snprintf(root, sizeof root, "/tmp/scape-fuzz-seed-XXXXXX");
    FUZZ_CHECK(mkdtemp(root) != NULL, "mkdtemp: %s", strerror(errno));
    eng_t *e = NULL;
    comm_t *comm = NULL;
    make_engine(&e, &comm);
    float params[N], grads[N];
    for (int i = 0; i < N; i++)
        params[i] = 0.01f * (float)(i % 17) - 0.05f;
    void *pp[1] = { params };
    const void *gp[1] = { grads };
    FUZZ_CHECK(eng_init_params(e, pp) == SCAPE_OK, "init: %s", scape_last_error());
    for (uint64_t t = 1; t <= 3; t++) {
        for (int i = 0; i < N; i++)
            grads[i] = sinf((float)(i * 7 + t));
        FUZZ_CHECK(eng_step(e, t, 1e-2f, gp, pp) == SCAPE_OK, "step: %s", scape_last_error());
        FUZZ_CHECK(eng_step_finish(e) == SCAPE_OK, "step: %s", scape_last_error());
    }
    uint64_t step;
    char dir[CKPT_PATH_MAX];
    FUZZ_CHECK(ckpt_save(root, e, comm, 2, &step, dir, sizeof dir) == SCAPE_OK, "save: %s",
               scape_last_error());
    eng_destroy(&e);
    comm_destroy(&comm);

    fuzz_buf *b = calloc(1, sizeof *b);
    FUZZ_CHECK(b != NULL, "out of memory");
    char path[CKPT_PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/MANIFEST", dir);
    put_file(b, 0, path);
    snprintf(path, sizeof path, "%s/rank-00000.ckpt", dir);
    put_file(b, 1, path);
    emit(ctx, "step-dir", b->data, b->len); /* resume names the step directory */
    fuzz_put(b, 2, "step-3\n", 7);
    emit(ctx, "latest", b->data, b->len);   /* resume names the root */
    free(b);

    /* What ckpt_save left: its step directory, LATEST, the root. */
    snprintf(path, sizeof path, "%s/MANIFEST", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/rank-00000.ckpt", dir);
    unlink(path);
    rmdir(dir);
    snprintf(path, sizeof path, "%s/LATEST", root);
    unlink(path);
    FUZZ_CHECK(rmdir(root) == 0, "%s is not empty after the seed: %s", root, strerror(errno));
}
