/* fuzz_config.c - scaped's YAML configuration file (daemon/config.c).
 *
 * Input: the text of a configuration file.
 *
 * Checked for every input, beyond "no crash":
 *   - a refused file leaves the configuration exactly as it was, and says
 *     why, naming the file;
 *   - an accepted one prints (cfg_print, what --print-config shows) to a
 *     file that loads back into the same configuration: printing, loading
 *     the print and printing again gives the same text, so every value
 *     survives, quoted strings and shortest-round-trip numbers included.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "fuzz.h"

static scaped_config s_defaults;

void fuzz_setup(void) { cfg_defaults(&s_defaults); }

/* cfg_print into a malloc'ed string (free it). */
static char *print(const scaped_config *c, size_t *len)
{
    char *text = NULL;
    FILE *f = open_memstream(&text, len);
    FUZZ_CHECK(f != NULL, "open_memstream failed");
    FUZZ_CHECK(cfg_print(c, f) == SCAPE_OK, "cfg_print: %s", scape_last_error());
    fclose(f);
    return text;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    scaped_config c = s_defaults;
    if (cfg_load_text(&c, "fuzz.yaml", (const char *)data, size) != SCAPE_OK) {
        FUZZ_CHECK(memcmp(&c, &s_defaults, sizeof c) == 0, "a refused file changed the "
                   "configuration (%s)", scape_last_error());
        FUZZ_CHECK(strstr(scape_last_error(), "fuzz.yaml") != NULL,
                   "the refusal does not name the file: %s", scape_last_error());
        return 0;
    }
    size_t n1, n2;
    char *first = print(&c, &n1);
    scaped_config back = s_defaults;
    FUZZ_CHECK(cfg_load_text(&back, "printed.yaml", first, n1) == SCAPE_OK,
               "the printed configuration does not load: %s\n%s", scape_last_error(), first);
    char *second = print(&back, &n2);
    FUZZ_CHECK(n1 == n2 && memcmp(first, second, n1) == 0,
               "the printed configuration loads as another:\n%s\nthen:\n%s", first, second);
    free(first);
    free(second);
    return 0;
}

/* ---- seeds ------------------------------------------------------------------ */

static void text(fuzz_emit emit, void *ctx, const char *name, const char *t)
{
    emit(ctx, name, t, strlen(t));
}

void fuzz_seeds(fuzz_emit emit, void *ctx)
{
    scaped_config c;
    cfg_defaults(&c);
    size_t n;
    char *all = print(&c, &n);
    emit(ctx, "print-config", all, n); /* every key, as --print-config writes it */
    free(all);
    text(emit, ctx, "empty", "");
    text(emit, ctx, "comments", "# nothing but a comment\n---\n");
    text(emit, ctx, "engine",
         "optimizer: topk-adamw\nmode: sharded\nrho: 0.125\nwarmup: 10\nbeta1: 0.8\n"
         "beta2: 0.999\neps: 1.0e-6\nweight_decay: 0.1\nengine_threads: 2\n"
         "defer_select: false\n");
    text(emit, ctx, "service",
         "runtime_dir: \"/tmp/scape fuzz\"\nlog_level: warn\nmax_trainers: 8\n"
         "max_message_bytes: 65536\nliveness_ms: 50\ntrainers: 2\n");
    text(emit, ctx, "multinode",
         "world: 4\nrank: 3\ncoordinator: 'tcp://node1:20042'\nlisten: tcp://10.0.0.4:*\n"
         "job: 1234567\ncomm_timeout_ms: 60000\ncomm_backend: nccl\ncuda_device: 1\n");
    text(emit, ctx, "checkpoint",
         "checkpoint_dir: /scratch/ckpt\ncheckpoint_every: 100\ncheckpoint_keep: 3\n"
         "resume: /scratch/ckpt/step-200\n");
    text(emit, ctx, "flow", "{rho: 0.05, mode: replicated, world: 2}\n");
    text(emit, ctx, "anchors", "rho: &r 0.5\nbeta1: *r\n");
    text(emit, ctx, "escapes", "runtime_dir: \"a\\tb\\u00e9\\x41\\\"q\"\nlisten: \"\"\n");
    text(emit, ctx, "block", "runtime_dir: |\n  multi\n  line\n");
    text(emit, ctx, "two-docs", "rho: 0.1\n---\nrho: 0.2\n");
    text(emit, ctx, "dup", "rho: 0.1\nrho: 0.2\n");
    text(emit, ctx, "nested", "rho:\n  - 0.1\n");
    text(emit, ctx, "tags", "rho: !!float 0.25\nwarmup: !!int 3\n");
}
