/* driver.c - the main of a fuzz target built without libFuzzer (every
 * normal and ASan build; ctest runs it).  It replays the target's seeds and
 * every input named on the command line (files, or every file of a
 * directory), then runs -runs=N inputs mutated from those with a seeded
 * generator, so a run is repeatable.  It has no coverage feedback: the
 * coverage-guided search is the libFuzzer build's (tests/fuzz/run.sh).
 *
 * When an input crashes the target or breaks one of its checks, the input is
 * written to crash-<target>-<hash> (in $SCAPE_FUZZ_ARTIFACTS, else the
 * current directory) and the path printed; give that file back to the same
 * program to replay just it. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
/* Called by ASan/UBSan just before they end the process on a report. */
void __sanitizer_set_death_callback(void (*cb)(void)) __attribute__((weak));

#define POOL_MAX 512

typedef struct input {
    uint8_t *p;
    size_t n;
} input;

static input s_pool[POOL_MAX];
static size_t s_npool, s_nfixed; /* the first s_nfixed are the given inputs */
static size_t s_max_len = 1 << 16;
static const char *s_name = "fuzz";
static const uint8_t *s_cur; /* the input being run, for the crash file */
static size_t s_cur_n;

static uint64_t s_rng;

static uint64_t rnd(void) /* xorshift64* */
{
    s_rng ^= s_rng >> 12;
    s_rng ^= s_rng << 25;
    s_rng ^= s_rng >> 27;
    return s_rng * 0x2545F4914F6CDD1Dull;
}

static size_t below(size_t n) { return n ? (size_t)(rnd() % n) : 0; }

static void die(const char *what)
{
    fprintf(stderr, "%s: %s\n", s_name, what);
    exit(2);
}

static void add(const void *p, size_t n)
{
    if (s_npool == POOL_MAX)
        return;
    n = n < s_max_len ? n : s_max_len;
    uint8_t *c = malloc(n ? n : 1);
    if (c == NULL)
        die("out of memory");
    memcpy(c, p, n);
    s_pool[s_npool].p = c;
    s_pool[s_npool++].n = n;
}

static void emit_seed(void *ctx, const char *name, const void *buf, size_t len)
{
    (void)ctx;
    (void)name;
    add(buf, len);
}

static void add_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "%s: %s: %s\n", s_name, path, strerror(errno));
        exit(2);
    }
    uint8_t *buf = malloc(s_max_len);
    if (buf == NULL)
        die("out of memory");
    size_t n = fread(buf, 1, s_max_len, f);
    fclose(f);
    add(buf, n);
    free(buf);
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void add_path(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "%s: %s: %s\n", s_name, path, strerror(errno));
        exit(2);
    }
    if (!S_ISDIR(st.st_mode)) {
        add_file(path);
        return;
    }
    DIR *d = opendir(path);
    if (d == NULL) {
        fprintf(stderr, "%s: %s: %s\n", s_name, path, strerror(errno));
        exit(2);
    }
    /* Sorted, so the pool (and so every run) is the same on every machine. */
    char **names = NULL;
    size_t count = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.')
            continue;
        char **more = realloc(names, (count + 1) * sizeof *names);
        if (more == NULL || (more[count] = strdup(e->d_name)) == NULL)
            die("out of memory");
        names = more;
        count++;
    }
    closedir(d);
    qsort(names, count, sizeof *names, cmp_names);
    for (size_t i = 0; i < count; i++) {
        char file[4096];
        snprintf(file, sizeof file, "%s/%s", path, names[i]);
        add_file(file);
        free(names[i]);
    }
    free(names);
}

/* ---- crashes ------------------------------------------------------------- */

static void save_crash(void)
{
    if (s_cur == NULL)
        return;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < s_cur_n; i++)
        h = (h ^ s_cur[i]) * 1099511628211ull;
    const char *dir = getenv("SCAPE_FUZZ_ARTIFACTS");
    char path[4096];
    snprintf(path, sizeof path, "%s/crash-%s-%016llx", dir && *dir ? dir : ".", s_name,
             (unsigned long long)h);
    FILE *f = fopen(path, "wb");
    if (f && fwrite(s_cur, 1, s_cur_n, f) == s_cur_n && fclose(f) == 0)
        fprintf(stderr, "%s: the input (%zu bytes) is in %s\n", s_name, s_cur_n, path);
    else
        fprintf(stderr, "%s: could not save the input to %s\n", s_name, path);
    s_cur = NULL;
}

static void on_signal(int sig)
{
    save_crash();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void run(const uint8_t *p, size_t n)
{
    s_cur = p;
    s_cur_n = n;
    LLVMFuzzerTestOneInput(p, n);
    s_cur = NULL;
}

/* ---- mutation ------------------------------------------------------------ */

static const uint8_t s_special[] = { 0x00, 0x01, 0x7f, 0x80, 0xff, 0xfe, 0x20, 0x0a };

static size_t mutate(uint8_t *b, size_t n, size_t cap)
{
    for (int ops = 1 + (int)below(4); ops > 0; ops--) {
        switch (below(9)) {
        case 0: /* flip a bit */
            if (n)
                b[below(n)] ^= (uint8_t)(1u << below(8));
            break;
        case 1: /* set a byte to a special value or any */
            if (n)
                b[below(n)] = below(2) ? s_special[below(sizeof s_special)] : (uint8_t)rnd();
            break;
        case 2: { /* insert random bytes */
            size_t k = 1 + below(8), at = below(n + 1);
            if (n + k > cap)
                break;
            memmove(b + at + k, b + at, n - at);
            for (size_t i = 0; i < k; i++)
                b[at + i] = (uint8_t)rnd();
            n += k;
            break;
        }
        case 3: { /* delete a run */
            if (n == 0)
                break;
            size_t at = below(n), k = 1 + below(n - at < 16 ? n - at : 16);
            memmove(b + at, b + at + k, n - at - k);
            n -= k;
            break;
        }
        case 4: /* cut the tail */
            n = below(n + 1);
            break;
        case 5: { /* splice: from here on, another input's tail */
            const input *o = &s_pool[below(s_npool)];
            size_t at = below(n + 1), from = below(o->n + 1);
            size_t k = o->n - from < cap - at ? o->n - from : cap - at;
            memcpy(b + at, o->p + from, k);
            n = at + k;
            break;
        }
        case 6: { /* repeat a slice */
            if (n == 0)
                break;
            size_t at = below(n), k = 1 + below(n - at < 32 ? n - at : 32);
            if (n + k > cap)
                break;
            memmove(b + at + k, b + at, n - at);
            n += k;
            break;
        }
        case 7: { /* a 16- or 32-bit field off by a little, or extreme */
            size_t w = below(2) ? 2 : 4;
            if (n < w)
                break;
            size_t at = below(n - w + 1);
            uint32_t v = 0;
            memcpy(&v, b + at, w);
            uint32_t opts[] = { v + 1, v - 1, v + (uint32_t)below(64), 0, 0xffffffffu, v << 1 };
            v = opts[below(6)];
            memcpy(b + at, &v, w);
            break;
        }
        default: /* a run of 0xff: huge varints, lengths, counts */
            if (n + 10 <= cap) {
                size_t at = below(n + 1), k = 1 + below(10);
                memmove(b + at + k, b + at, n - at);
                memset(b + at, 0xff, k);
                n += k;
            }
            break;
        }
    }
    return n;
}

int main(int argc, char **argv)
{
    const char *slash = strrchr(argv[0], '/');
    s_name = slash ? slash + 1 : argv[0];
    unsigned long long runs = 0, seed = 20261130;
    char **paths = calloc((size_t)argc, sizeof *paths);
    int npaths = 0;
    if (paths == NULL)
        die("out of memory");
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "-runs=", 6) == 0)
            runs = strtoull(argv[i] + 6, NULL, 10);
        else if (strncmp(argv[i], "-seed=", 6) == 0)
            seed = strtoull(argv[i] + 6, NULL, 10);
        else if (strncmp(argv[i], "-max_len=", 9) == 0)
            s_max_len = (size_t)strtoull(argv[i] + 9, NULL, 10);
        else if (argv[i][0] == '-') {
            fprintf(stderr, "usage: %s [-runs=N] [-seed=S] [-max_len=L] [FILE|DIR]...\n",
                    s_name);
            return 2;
        } else
            paths[npaths++] = argv[i];
    }
    if (s_max_len < 16)
        s_max_len = 16;
    s_rng = seed * 2654435761u + 1;
    signal(SIGSEGV, on_signal);
    signal(SIGBUS, on_signal);
    signal(SIGABRT, on_signal);
    signal(SIGFPE, on_signal);
    if (__sanitizer_set_death_callback)
        __sanitizer_set_death_callback(save_crash);
    LLVMFuzzerInitialize(&argc, &argv);

    /* A file named alone is replayed alone: that is how a crash reproduces. */
    int only_files = npaths > 0 && runs == 0;
    if (!only_files)
        fuzz_seeds(emit_seed, NULL);
    size_t seeds = s_npool;
    qsort(paths, (size_t)npaths, sizeof *paths, cmp_names);
    for (int i = 0; i < npaths; i++)
        add_path(paths[i]);
    free(paths);
    if (s_npool == 0)
        add("", 0); /* nothing given: start from the empty input */
    s_nfixed = s_npool;
    for (size_t i = 0; i < s_nfixed; i++)
        run(s_pool[i].p, s_pool[i].n);

    uint8_t *buf = malloc(s_max_len);
    if (buf == NULL)
        die("out of memory");
    for (unsigned long long r = 0; r < runs; r++) {
        const input *from = &s_pool[below(s_npool)];
        memcpy(buf, from->p, from->n);
        size_t n = mutate(buf, from->n, s_max_len);
        run(buf, n);
        /* Stack mutations now and then: keep some results to mutate further. */
        if (below(8) == 0) {
            if (s_npool < POOL_MAX) {
                add(buf, n);
            } else if (s_npool > s_nfixed) {
                size_t k = s_nfixed + below(s_npool - s_nfixed);
                free(s_pool[k].p);
                s_npool--;
                s_pool[k] = s_pool[s_npool];
                add(buf, n);
            }
        }
    }
    free(buf);
    printf("%s: %zu seeds and %zu given inputs replayed, %llu mutated inputs run (seed %llu): "
           "no crash, every check held\n",
           s_name, seeds, s_nfixed - seeds, runs, seed);
    for (size_t i = 0; i < s_npool; i++)
        free(s_pool[i].p);
    return 0;
}
