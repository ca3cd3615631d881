/* bench_report.c - the run's header, the result tables (aligned text and a
 * markdown block for docs/benchmarks.md) and the performance targets. */
#define _POSIX_C_SOURCE 200809L

#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "bench_host.h"

#define TARGET_COPY_RATIO 0.5   /* streaming kernels vs memcpy at 1e8 */
#define TARGET_TOPK_SPEEDUP 5.0 /* top-k vs sort at 1e7, k = 1% */

void bench_results_init(bench_results *r, int argc, char **argv)
{
    time_t now = time(NULL);
    struct tm tm;
    memset(r, 0, sizeof *r);
    strftime(r->date, sizeof r->date, "%Y-%m-%d %H:%M:%S %Z", localtime_r(&now, &tm));
    if (gethostname(r->host, sizeof r->host - 1) != 0)
        snprintf(r->host, sizeof r->host, "unknown");
    bench_cpu_model(r->cpu, sizeof r->cpu);
    for (int i = 0; i < argc; i++) {
        size_t used = strlen(r->cmd);
        snprintf(r->cmd + used, sizeof r->cmd - used, "%s%s", i ? " " : "", argv[i]);
    }
}

void bench_fmt_n(char *buf, size_t len, size_t n)
{
    size_t m = n;
    int e = 0;
    while (m >= 10 && m % 10 == 0) {
        m /= 10;
        e++;
    }
    if (m < 10 && e > 0)
        snprintf(buf, len, "%zue%d", m, e);
    else
        snprintf(buf, len, "%zu", n);
}

void bench_print_header(FILE *f, const bench_results *r)
{
    fprintf(f, "bench_kernels  date: %s  host: %s  cpu: %s\n", r->date, r->host, r->cpu);
    fprintf(f, "command: %s\n", r->cmd);
    fprintf(f, "median of %d repeats (sort baseline: at most %d); caches flushed "
            "by reading %zu MiB before each\n",
            r->repeats, BENCH_SORT_REPEATS, r->flush_bytes >> 20);
}

static double gbs(size_t bytes, double ms) { return (double)bytes / (ms * 1e6); }
static double row_gbs(const bench_row *w) { return gbs(w->bytes, w->ms); }
/* memcpy moved bytes/2 each way: its read + write traffic. */
static double row_copy_gbs(const bench_row *w)
{
    return gbs(w->bytes / 2 * 2, w->copy_ms);
}
static double row_ratio(const bench_row *w) { return row_gbs(w) / row_copy_gbs(w); }

static double speedup_select(const bench_topk_row *t) { return t->sort_ms / t->topk_ms; }
static double speedup_total(const bench_topk_row *t)
{
    return (t->stat_ms + t->sort_ms) / (t->stat_ms + t->topk_ms);
}

static void print_row(FILE *f, const bench_row *w)
{
    char ns[24];
    bench_fmt_n(ns, sizeof ns, w->n);
    if (!w->ok) {
        fprintf(f, "%-26s %6s  VALIDATION FAILED, not timed\n", w->op, ns);
        return;
    }
    fprintf(f, "%-26s %6s %10.1f %10.3f %8.2f %8.2f %6.2f\n", w->op, ns,
            (double)w->bytes / 1e6, w->ms, row_gbs(w), row_copy_gbs(w), row_ratio(w));
}

static void print_topk(FILE *f, const bench_topk_row *t)
{
    char ns[24];
    bench_fmt_n(ns, sizeof ns, t->n);
    fprintf(f, "%6s %3d%% %10zu %10.3f %10.3f", ns, t->pct, t->k, t->stat_ms, t->topk_ms);
    if (t->sort_ms < 0)
        fprintf(f, " %10s %8s %8s\n", "skipped", "-", "-");
    else
        fprintf(f, " %10.1f %7.1fx %7.1fx\n", t->sort_ms, speedup_select(t),
                speedup_total(t));
}

void bench_print_table(FILE *f, const bench_results *r)
{
    fprintf(f, "\n%-26s %6s %10s %10s %8s %8s %6s\n", "op", "n", "MB moved", "ms",
            "GB/s", "memcpy", "ratio");
    for (size_t i = 0; i < r->nrows; i++)
        print_row(f, &r->rows[i]);
    fprintf(f, "\ntop-k selection (radix select) vs sort-based selection\n");
    fprintf(f, "%6s %4s %10s %10s %10s %10s %8s %8s\n", "n", "k/n", "k", "stat ms",
            "topk ms", "sort ms", "select", "+stat");
    for (size_t i = 0; i < r->ntopk; i++)
        print_topk(f, &r->topk[i]);
}

static void md_row(FILE *f, const bench_row *w)
{
    char ns[24];
    bench_fmt_n(ns, sizeof ns, w->n);
    if (!w->ok)
        fprintf(f, "| %s | %s | validation failed | | | | |\n", w->op, ns);
    else
        fprintf(f, "| %s | %s | %.1f | %.3f | %.2f | %.2f | %.2f |\n", w->op, ns,
                (double)w->bytes / 1e6, w->ms, row_gbs(w), row_copy_gbs(w),
                row_ratio(w));
}

static void md_topk(FILE *f, const bench_topk_row *t)
{
    char ns[24];
    bench_fmt_n(ns, sizeof ns, t->n);
    fprintf(f, "| %s | %d%% (%zu) | %.3f | %.3f | ", ns, t->pct, t->k, t->stat_ms,
            t->topk_ms);
    if (t->sort_ms < 0)
        fprintf(f, "not run | | |\n");
    else
        fprintf(f, "%.1f | %.1fx | %.1fx |\n", t->sort_ms, speedup_select(t),
                speedup_total(t));
}

void bench_print_markdown(FILE *f, const bench_results *r)
{
    fprintf(f, "<!-- bench:begin -->\n");
    fprintf(f, "Measured %s on `%s` (%s) with `%s`; median of %d repeats, caches "
            "flushed before each.\n\n", r->date, r->host, r->cpu, r->cmd, r->repeats);
    fprintf(f, "| op | n | MB moved | ms | GB/s | memcpy GB/s | ratio vs memcpy |\n");
    fprintf(f, "|---|---:|---:|---:|---:|---:|---:|\n");
    for (size_t i = 0; i < r->nrows; i++)
        md_row(f, &r->rows[i]);
    fprintf(f, "\n| top-k n | k | stat ms | topk ms | sort-select ms | "
            "speedup (select) | speedup (stat + select) |\n");
    fprintf(f, "|---:|---:|---:|---:|---:|---:|---:|\n");
    for (size_t i = 0; i < r->ntopk; i++)
        md_topk(f, &r->topk[i]);
    fprintf(f, "<!-- bench:end -->\n");
}

static int at_1e8(const bench_row *w) { return w->n == 100000000u && w->ok; }

/* Streaming kernels at 1e8 against half the same-run memcpy bandwidth. */
static void targets_copy(FILE *f, const bench_results *r)
{
    size_t seen = 0, below = 0;
    for (size_t i = 0; i < r->nrows; i++) {
        seen += at_1e8(&r->rows[i]);
        below += at_1e8(&r->rows[i]) && row_ratio(&r->rows[i]) < TARGET_COPY_RATIO;
    }
    if (seen == 0) {
        fprintf(f, "  streaming kernels >= %.0f%% of memcpy at 1e8: not measured "
                "(1e8 not in --sizes)\n", TARGET_COPY_RATIO * 100);
        return;
    }
    fprintf(f, "  streaming kernels >= %.0f%% of memcpy at 1e8: %s (%zu of %zu "
            "reach it)\n", TARGET_COPY_RATIO * 100, below ? "NOT MET" : "MET",
            seen - below, seen);
    for (size_t i = 0; i < r->nrows; i++)
        if (at_1e8(&r->rows[i]) && row_ratio(&r->rows[i]) < TARGET_COPY_RATIO)
            fprintf(f, "    below: %-26s ratio %.2f\n", r->rows[i].op,
                    row_ratio(&r->rows[i]));
}

static void targets_topk(FILE *f, const bench_results *r)
{
    for (size_t i = 0; i < r->ntopk; i++) {
        const bench_topk_row *t = &r->topk[i];
        if (t->n != 10000000u || t->pct != 1 || t->sort_ms < 0)
            continue;
        fprintf(f, "  top-k >= %.0fx faster than sort at 1e7, k=1%%: %s (select "
                "%.1fx, stat + select %.1fx)\n", TARGET_TOPK_SPEEDUP,
                speedup_total(t) >= TARGET_TOPK_SPEEDUP ? "MET" : "NOT MET",
                speedup_select(t), speedup_total(t));
        return;
    }
    fprintf(f, "  top-k >= %.0fx faster than sort at 1e7, k=1%%: not measured "
            "(1e7 not in --sizes)\n", TARGET_TOPK_SPEEDUP);
}

void bench_print_targets(FILE *f, const bench_results *r)
{
    fprintf(f, "\ntargets (information only; timing never fails this program):\n");
    targets_copy(f, r);
    targets_topk(f, r);
}
