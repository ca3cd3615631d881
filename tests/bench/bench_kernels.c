/* bench_kernels.c - the CPU kernel benchmark.
 *
 * For every streaming kernel: GB/s under the byte model of bench_ops.c, as a
 * ratio to memcpy of the same read + write traffic measured in the same run;
 * and top-k selection against a sort-based selection.  Every operation is
 * validated once against an independent recomputation before it is timed.
 * Timings are information: the exit status is 0 whatever they are, 1 on a
 * validation or allocation failure, 2 on bad arguments.
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

#define DEFAULT_REPEATS 7
#define QUICK_REPEATS 3

static void usage(FILE *f)
{
    fprintf(f,
            "usage: bench_kernels [--sizes N[,N...]] [--quick] [--repeats R] "
            "[--markdown FILE]\n"
            "  --sizes LIST     element counts, e.g. 1e6,1e7 (default 1e6,1e7,1e8)\n"
            "  --quick          sizes 1e6,1e7 and %d repeats; no sort baseline at "
            ">= 1e8\n"
            "  --repeats R      timed repeats per figure, median reported "
            "(default %d, max %d)\n"
            "  --markdown FILE  also write the markdown block to FILE\n",
            QUICK_REPEATS, DEFAULT_REPEATS, BENCH_MAX_REPEATS);
}

/* "1e6,1e7": positive whole numbers a kernel segment can hold. */
static int parse_sizes(const char *arg, bench_cfg *cfg)
{
    const char *p = arg;
    cfg->nsizes = 0;
    while (*p != '\0') {
        char *end;
        errno = 0;
        double v = strtod(p, &end);
        if (end == p || errno != 0 || (*end != ',' && *end != '\0') || v < 1 ||
            v > (double)UINT32_MAX || v != (double)(size_t)v ||
            cfg->nsizes == BENCH_MAX_SIZES)
            return -1;
        cfg->sizes[cfg->nsizes++] = (size_t)v;
        p = *end == ',' ? end + 1 : end;
    }
    return cfg->nsizes > 0 ? 0 : -1;
}

static int parse_repeats(const char *arg, bench_cfg *cfg)
{
    char *end;
    long v = strtol(arg, &end, 10);
    if (end == arg || *end != '\0' || v < 1 || v > BENCH_MAX_REPEATS)
        return -1;
    cfg->repeats = (int)v;
    return 0;
}

/* Apply option a, with val the next argument (NULL if none): the number of
 * arguments consumed, or -1 for a bad option. */
static int parse_opt(const char *a, const char *val, bench_cfg *cfg)
{
    if (strcmp(a, "--quick") == 0) {
        cfg->quick = 1;
        return 1;
    }
    if (val == NULL)
        return -1;
    if (strcmp(a, "--sizes") == 0)
        return parse_sizes(val, cfg) == 0 ? 2 : -1;
    if (strcmp(a, "--repeats") == 0)
        return parse_repeats(val, cfg) == 0 ? 2 : -1;
    if (strcmp(a, "--markdown") == 0) {
        cfg->markdown = val;
        return 2;
    }
    return -1;
}

/* -1: run; otherwise the exit status (0 after --help). */
static int parse_args(int argc, char **argv, bench_cfg *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    for (int i = 1; i < argc;) {
        if (strcmp(argv[i], "--help") == 0) {
            usage(stdout);
            return 0;
        }
        int used = parse_opt(argv[i], i + 1 < argc ? argv[i + 1] : NULL, cfg);
        if (used < 0) {
            fprintf(stderr, "bench_kernels: bad argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
        i += used;
    }
    return -1;
}

/* Defaults the flags left open: sizes, then repeats. */
static void apply_defaults(bench_cfg *cfg)
{
    if (cfg->nsizes == 0) {
        const size_t def[3] = { 1000000u, 10000000u, 100000000u };
        cfg->nsizes = cfg->quick ? 2 : 3;
        memcpy(cfg->sizes, def, sizeof def);
    }
    if (cfg->repeats == 0)
        cfg->repeats = cfg->quick ? QUICK_REPEATS : DEFAULT_REPEATS;
}

/* Set up, call once and check, then time the op alternately with memcpy of
 * the same traffic.  SCAPE_INVALID marks a failed validation. */
static scape_rc measure_op(const bench_cfg *cfg, const bench_op *op, size_t n,
                           bench_row *row)
{
    bench_case c;
    bench_copy cp = { NULL, NULL, 0 };
    scape_rc rc = bench_case_init(&c, n, op->rho, op->roles);
    if (rc != SCAPE_OK)
        return rc;
    *row = (bench_row){ .op = op->name, .n = n, .bytes = op->bytes(&c) };
    rc = op->run(&c);
    size_t bad = rc == SCAPE_OK ? op->check(&c) : 0;
    if (bad != 0)
        rc = scape_set_error(SCAPE_INVALID, "%s n=%zu: %zu mismatches", op->name,
                             n, bad);
    if (rc == SCAPE_OK)
        rc = bench_copy_init(&cp, row->bytes);
    if (rc == SCAPE_OK)
        rc = bench_time_pair(op->run, &c, bench_copy_run, &cp, cfg->repeats,
                             &row->ms, &row->copy_ms);
    bench_case_free(&c);
    bench_copy_free(&cp);
    row->ok = rc == SCAPE_OK;
    return rc;
}

/* A failed check is counted and the run goes on; running out of memory ends it. */
static scape_rc note(scape_rc rc, bench_results *res)
{
    if (rc == SCAPE_OK || rc == SCAPE_NOMEM)
        return rc;
    fprintf(stderr, "bench_kernels: FAILED: %s\n", scape_last_error());
    res->failures++;
    return SCAPE_OK;
}

static scape_rc run_size(const bench_cfg *cfg, size_t n, bench_results *res)
{
    char ns[24];
    scape_rc rc = SCAPE_OK;
    bench_fmt_n(ns, sizeof ns, n);
    for (size_t i = 0; i < bench_nops && rc == SCAPE_OK; i++) {
        fprintf(stderr, "bench_kernels: n=%s %s\n", ns, bench_ops[i].name);
        rc = note(measure_op(cfg, &bench_ops[i], n, &res->rows[res->nrows++]), res);
    }
    if (rc == SCAPE_OK) {
        fprintf(stderr, "bench_kernels: n=%s top-k\n", ns);
        rc = note(bench_topk(cfg, n, res), res);
    }
    return rc;
}

static int write_markdown(const char *path, const bench_results *res)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        fprintf(stderr, "bench_kernels: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    bench_print_markdown(f, res);
    return fclose(f) == 0 ? 0 : -1;
}

int main(int argc, char **argv)
{
    static bench_results res;
    bench_cfg cfg;
    int status = parse_args(argc, argv, &cfg);
    if (status >= 0)
        return status;
    apply_defaults(&cfg);
    bench_results_init(&res, argc, argv);
    res.repeats = cfg.repeats;
    scape_rc rc = bench_timer_init();
    res.flush_bytes = bench_flush_bytes();
    if (rc == SCAPE_OK)
        bench_print_header(stdout, &res);
    fflush(stdout);
    for (int s = 0; s < cfg.nsizes && rc == SCAPE_OK; s++)
        rc = run_size(&cfg, cfg.sizes[s], &res);
    bench_timer_fini();
    if (rc != SCAPE_OK) {
        fprintf(stderr, "bench_kernels: %s\n", scape_last_error());
        return 1;
    }
    bench_print_table(stdout, &res);
    printf("\n");
    bench_print_markdown(stdout, &res);
    bench_print_targets(stdout, &res);
    if (cfg.markdown != NULL && write_markdown(cfg.markdown, &res) != 0)
        return 1;
    return res.failures ? 1 : 0;
}
