/* bench.h - the pieces of bench_kernels, the CPU kernel benchmark.
 * Private to tests/bench; one header for the few files of one tool. */
#ifndef SCAPE_BENCH_H
#define SCAPE_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "scape_kernels.h"

#define BENCH_MAX_SIZES 8
#define BENCH_MAX_REPEATS 99
#define BENCH_SORT_REPEATS 3 /* the sort baseline is slow: at most this many */
#define BENCH_MAX_ROWS 256
#define BENCH_BETA1 0.9f    /* first-moment decay in the mask statistic */
#define BENCH_TRAINERS 4.0f /* local trainers behind the mask statistic */

typedef struct bench_cfg {
    size_t sizes[BENCH_MAX_SIZES];
    int nsizes;
    int repeats;          /* timed repeats per figure; the median is reported */
    int quick;            /* --quick: no sort baseline at n >= 1e8 */
    const char *markdown; /* --markdown FILE, or NULL */
} bench_cfg;

/* ---- deterministic operands (bench_data.c) ------------------------------
 * Element i of stream s is a pure function of (s, i), so a check recomputes
 * any input of a kernel call without keeping a copy.  Buffer role r of a
 * case is filled from stream r. */

typedef enum bench_role {
    BR_G, BR_E, BR_M, BR_V, BR_THETA, BR_SUM, BR_DST, /* n fp32 each */
    BR_HALF,        /* n bf16 */
    BR_PACKED,      /* k fp32 inputs, one per set bit of BR_MASK */
    BR_OUT,         /* k fp32 outputs, zeroed */
    BR_MASK,        /* n-bit mask of density rho */
    BR_COUNT
} bench_role;

#define BR(r) (1u << (r))

typedef struct bench_case {
    size_t n, nw, k;       /* elements, mask words, set bits of BR_MASK */
    size_t lines4, lines2; /* 64-byte lines of an fp32 / bf16 array with a set bit */
    double rho;            /* density of the masks */
    size_t k_out;          /* count returned by the last kernel call */
    void *p[BR_COUNT];     /* NULL for roles the case does not use */
} bench_case;

/* Stream s, element i: a multiple of 2^-23 in [-1, 1); in [0, 1) for BR_V
 * (second moments are non-negative). */
float bench_f32(unsigned s, size_t i);
/* bf16 bits of bench_f32(s, i), truncated. */
uint16_t bench_bf16(unsigned s, size_t i);
/* The fp32 value of bf16 bits h (the format's definition: the high half). */
float bench_bf16_value(uint16_t h);
/* Bit i of stream s's masks: set with probability rho (always when rho = 1). */
int bench_bit(unsigned s, size_t i, double rho);
/* Word w of an n-bit mask from stream s with bits set at density rho. */
uint32_t bench_mask_word(unsigned s, size_t n, size_t w, double rho);
/* 64-byte aligned allocation of max(bytes, 64) bytes, or NULL. */
void *bench_alloc(size_t bytes);
/* Allocate and fill the buffers of `roles` (BR() bits) for n elements. */
scape_rc bench_case_init(bench_case *c, size_t n, double rho, unsigned roles);
/* Free one role's buffer early (the top-k run drops its inputs). */
void bench_case_release(bench_case *c, bench_role r);
/* Free every buffer of the case. */
void bench_case_free(bench_case *c);

/* ---- the streaming kernels under test (bench_ops.c) --------------------- */

typedef scape_rc (*bench_fn)(void *arg);

typedef struct bench_op {
    const char *name;
    double rho;                           /* mask density; 0 without a mask */
    unsigned roles;                       /* BR() bits of the buffers it uses */
    bench_fn run;                         /* one kernel call on a bench_case */
    size_t (*check)(const bench_case *c); /* mismatches after exactly one call */
    size_t (*bytes)(const bench_case *c); /* byte model: bytes read + written */
} bench_op;

extern const bench_op bench_ops[];
extern const size_t bench_nops;

/* ---- timing (bench_timer.c) --------------------------------------------- */

/* Size the cache flush buffer from the largest CPU cache and touch it. */
scape_rc bench_timer_init(void);
void bench_timer_fini(void);
/* Bytes the flush streams over before every timed call. */
size_t bench_flush_bytes(void);
/* Median wall time (ms) of `repeats` calls of fn(arg), caches flushed before
 * each; with a non-NULL label each repeat is reported on stderr. */
scape_rc bench_time_ms(bench_fn fn, void *arg, int repeats, const char *label,
                       double *ms);
/* Median times (ms) of fa(a) and fb(b) called alternately, caches flushed
 * before each call, so both see the same load on the machine. */
scape_rc bench_time_pair(bench_fn fa, void *a, bench_fn fb, void *b, int repeats,
                         double *ms_a, double *ms_b);

/* The baseline: memcpy of bytes/2 bytes, i.e. read + write traffic `bytes`. */
typedef struct bench_copy {
    void *dst, *src;
    size_t len;
} bench_copy;

/* Allocate and touch both halves. */
scape_rc bench_copy_init(bench_copy *cp, size_t bytes);
void bench_copy_free(bench_copy *cp);
/* One memcpy (a bench_fn). */
scape_rc bench_copy_run(void *cp);

/* ---- results and reports (bench_report.c) ------------------------------- */

typedef struct bench_row {
    const char *op;
    size_t n, bytes;
    double ms, copy_ms; /* op, and memcpy of the same traffic */
    int ok;             /* 0: failed validation, not timed */
} bench_row;

typedef struct bench_topk_row {
    size_t n, k;
    int pct;
    double stat_ms, topk_ms;
    double sort_ms; /* < 0: the sort baseline was skipped */
} bench_topk_row;

typedef struct bench_results {
    char date[40], host[64], cpu[128], cmd[512];
    size_t flush_bytes;
    int repeats;
    bench_row rows[BENCH_MAX_ROWS];
    size_t nrows;
    bench_topk_row topk[2 * BENCH_MAX_SIZES];
    size_t ntopk;
    int failures; /* validations that failed */
} bench_results;

/* Fill date, host, CPU model and the command line. */
void bench_results_init(bench_results *r, int argc, char **argv);
/* "1e8" for a power of ten times 1..9, else the decimal digits. */
void bench_fmt_n(char *buf, size_t len, size_t n);
void bench_print_header(FILE *f, const bench_results *r);
void bench_print_table(FILE *f, const bench_results *r);
/* The block between <!-- bench:begin --> and <!-- bench:end -->. */
void bench_print_markdown(FILE *f, const bench_results *r);
/* Which of the performance targets the run met (information only). */
void bench_print_targets(FILE *f, const bench_results *r);

/* ---- top-k against a sort (bench_topk.c) -------------------------------- */

/* Time mask_stat + topk_mask at k = 1% and 10% of n against a sort-based
 * selection; appends two rows.  SCAPE_INVALID on a wrong mask. */
scape_rc bench_topk(const bench_cfg *cfg, size_t n, bench_results *res);

#endif /* SCAPE_BENCH_H */
