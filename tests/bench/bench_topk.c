/* bench_topk.c - top-k selection (the SCAPE statistic of scape_formula.h, then
 * the radix select of kern_topk_packed on it) against a sort-based selection
 * of the same statistic, measured in the same run.  (The host executor runs
 * the two fused, kern_topk_ef; apart, the selection alone compares with the
 * sort.)
 *
 * The baseline copies (stat, index) pairs, sorts them with qsort by value
 * descending and index ascending, and sets the bits of the first k: the
 * obvious correct selection, which also yields the reference mask. */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

typedef struct sel_pair {
    float v;
    uint32_t i;
} sel_pair;

typedef struct topk_job {
    bench_case c;       /* m, g, e in; BR_DST holds the statistic */
    size_t k;
    uint32_t *mask;     /* kern_topk_packed */
    uint32_t *ref;      /* sort baseline */
    void *scratch;
    size_t scratch_bytes;
    sel_pair *pairs;    /* NULL when the sort baseline is skipped */
} topk_job;

static scape_rc run_stat(void *p)
{
    bench_case *c = &((topk_job *)p)->c;
    const float *m = c->p[BR_M], *g = c->p[BR_G], *e = c->p[BR_E];
    float *stat = c->p[BR_DST];
    const float c1 = 1.0f - BENCH_BETA1;
    for (size_t i = 0; i < c->n; i++)
        stat[i] = scape_f_stat(m[i], scape_f_ef(g[i], e[i]), BENCH_BETA1, c1, BENCH_TRAINERS);
    return SCAPE_OK;
}

/* The selection by the stored statistic: with nothing sent and no m,
 * kern_topk_packed's keys are those of e = stat itself. */
static scape_rc run_topk(void *p)
{
    topk_job *j = p;
    return kern_topk_packed(NULL, j->c.p[BR_DST], NULL, NULL, j->c.n, 0.0f, 1.0f, j->k, j->mask,
                            j->scratch, j->scratch_bytes);
}

static int cmp_pair(const void *a, const void *b)
{
    const sel_pair *x = a, *y = b;
    if (x->v != y->v)
        return x->v < y->v ? 1 : -1;
    return (x->i > y->i) - (x->i < y->i);
}

static scape_rc run_sort(void *p)
{
    topk_job *j = p;
    const float *stat = j->c.p[BR_DST];
    for (size_t i = 0; i < j->c.n; i++)
        j->pairs[i] = (sel_pair){ stat[i], (uint32_t)i };
    qsort(j->pairs, j->c.n, sizeof *j->pairs, cmp_pair);
    memset(j->ref, 0, j->c.nw * sizeof *j->ref);
    for (size_t s = 0; s < j->k; s++)
        j->ref[j->pairs[s].i / 32] |= 1u << (j->pairs[s].i % 32);
    return SCAPE_OK;
}

static int selected(const uint32_t *mask, size_t i)
{
    return (mask[i / 32] >> (i % 32)) & 1;
}

/* Independent check of a top-k mask: exactly k bits, every selected value >=
 * every unselected one, and among values equal to the smallest selected one
 * the selected indices all precede the unselected ones. */
static int topk_ok(const float *stat, size_t n, size_t k, const uint32_t *mask)
{
    size_t count = 0, last_sel = 0, first_uns = SIZE_MAX;
    float lo = INFINITY, hi = -INFINITY; /* min selected, max unselected */
    for (size_t i = 0; i < n; i++) {
        if (selected(mask, i)) {
            count++;
            lo = stat[i] < lo ? stat[i] : lo;
        } else {
            hi = stat[i] > hi ? stat[i] : hi;
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (stat[i] != lo)
            continue;
        if (selected(mask, i))
            last_sel = i;
        else if (first_uns == SIZE_MAX)
            first_uns = i;
    }
    int tail_clear = n % 32 == 0 || (mask[n / 32] >> (n % 32)) == 0;
    return count == k && tail_clear && (count == 0 || count == n || lo >= hi) &&
           (first_uns == SIZE_MAX || last_sel < first_uns);
}

/* Allocate mask, reference, scratch and (when the sort runs) the pairs. */
static scape_rc job_buffers(topk_job *j, int with_sort)
{
    size_t n = j->c.n;
    j->scratch_bytes = kern_topk_scratch_bytes(n);
    j->mask = bench_alloc(j->c.nw * 4);
    j->ref = bench_alloc(j->c.nw * 4);
    j->scratch = bench_alloc(j->scratch_bytes);
    j->pairs = with_sort ? bench_alloc(n * sizeof *j->pairs) : NULL;
    if (!j->mask || !j->ref || !j->scratch || (with_sort && !j->pairs))
        return scape_set_error(SCAPE_NOMEM, "bench: cannot allocate top-k "
                               "buffers for n=%zu", n);
    memset(j->scratch, 0, j->scratch_bytes);
    if (with_sort)
        memset(j->pairs, 0, n * sizeof *j->pairs);
    return SCAPE_OK;
}

static void job_free(topk_job *j)
{
    bench_case_free(&j->c);
    free(j->mask);
    free(j->ref);
    free(j->scratch);
    free(j->pairs);
}

/* Validate and time the radix select, then time the sort and compare masks. */
static scape_rc topk_one(const bench_cfg *cfg, topk_job *j, bench_topk_row *row)
{
    const float *stat = j->c.p[BR_DST];
    scape_rc rc = run_topk(j);
    if (rc != SCAPE_OK)
        return rc;
    if (!topk_ok(stat, j->c.n, j->k, j->mask))
        return scape_set_error(SCAPE_INVALID, "top-k n=%zu k=%zu: wrong mask",
                               j->c.n, j->k);
    rc = bench_time_ms(run_topk, j, cfg->repeats, NULL, &row->topk_ms);
    row->sort_ms = -1.0;
    if (rc != SCAPE_OK || j->pairs == NULL)
        return rc;
    char label[96], ns[24];
    bench_fmt_n(ns, sizeof ns, j->c.n);
    snprintf(label, sizeof label, "sort baseline n=%s k=%d%%", ns, row->pct);
    int reps = cfg->repeats < BENCH_SORT_REPEATS ? cfg->repeats : BENCH_SORT_REPEATS;
    rc = bench_time_ms(run_sort, j, reps, label, &row->sort_ms);
    if (rc == SCAPE_OK && memcmp(j->mask, j->ref, j->c.nw * 4) != 0)
        rc = scape_set_error(SCAPE_INVALID, "top-k n=%zu k=%zu: mask differs "
                             "from the sort-based selection", j->c.n, j->k);
    return rc;
}

/* The statistic is timed with its inputs, which are then dropped. */
static scape_rc topk_stat(const bench_cfg *cfg, topk_job *j, size_t n, double *ms)
{
    scape_rc rc = bench_case_init(&j->c, n, 0.0,
                                  BR(BR_M) | BR(BR_G) | BR(BR_E) | BR(BR_DST));
    if (rc == SCAPE_OK)
        rc = run_stat(j);
    if (rc == SCAPE_OK)
        rc = bench_time_ms(run_stat, j, cfg->repeats, NULL, ms);
    bench_case_release(&j->c, BR_M);
    bench_case_release(&j->c, BR_G);
    bench_case_release(&j->c, BR_E);
    return rc;
}

scape_rc bench_topk(const bench_cfg *cfg, size_t n, bench_results *res)
{
    static const int pcts[2] = { 1, 10 };
    topk_job j;
    double stat_ms = 0.0;
    memset(&j, 0, sizeof j);
    scape_rc rc = topk_stat(cfg, &j, n, &stat_ms);
    if (rc == SCAPE_OK)
        rc = job_buffers(&j, !(cfg->quick && n >= 100000000u));
    for (int p = 0; p < 2 && rc == SCAPE_OK; p++) {
        bench_topk_row *row = &res->topk[res->ntopk];
        j.k = (n * (size_t)pcts[p] + 50) / 100;
        *row = (bench_topk_row){ .n = n, .k = j.k, .pct = pcts[p], .stat_ms = stat_ms };
        rc = topk_one(cfg, &j, row);
        if (rc == SCAPE_OK)
            res->ntopk++;
    }
    job_free(&j);
    return rc;
}
