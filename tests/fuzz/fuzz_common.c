/* fuzz_common.c - the part of every fuzz target that is not its decoder:
 * one-time set-up, and writing the target's seeds into a directory when
 * SCAPE_FUZZ_SEEDS names one (tests/fuzz/run.sh does that before a libFuzzer
 * campaign; the driver takes the seeds in memory instead). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"
#include "log.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);

static void write_seed(void *ctx, const char *name, const void *buf, size_t len)
{
    const char *dir = ctx;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(buf, 1, len, f) != len || fclose(f) != 0) {
        fprintf(stderr, "fuzz: cannot write seed %s: %s\n", path, strerror(errno));
        exit(1);
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    /* Refusals are the point here; logging each one would drown the output
     * and slow every run down.  SCAPE_FUZZ_LOG=1 keeps the errors. */
    const char *keep = getenv("SCAPE_FUZZ_LOG");
    FILE *out = keep && *keep == '1' ? stderr : fopen("/dev/null", "w");
    log_init(0, LOG_LVL_ERROR, out ? out : stderr);
    const char *dir = getenv("SCAPE_FUZZ_SEEDS");
    if (dir && *dir) {
        if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
            fprintf(stderr, "fuzz: cannot make %s: %s\n", dir, strerror(errno));
            exit(1);
        }
        fuzz_seeds(write_seed, (void *)dir);
        exit(0);
    }
    fuzz_setup();
    return 0;
}
