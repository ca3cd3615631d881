/* plan.h - what a layout means for R ranks: per-tensor k_l, owners (greedy
 * balance by length), and the comm order in which masks, packed values and
 * sharded state are laid out.
 *
 * With split_above > 0, a registered tensor longer than that is split into
 * ceil(len / split_above) ranges of nearly equal length (pieces), and the
 * plan's tensors are the pieces: each has its own k_l, owner and mask words
 * (docs/algorithm.md, "Split tensors").  split_above 0 gives one piece per
 * registered tensor, the plan of before the split.
 *
 * Comm order lists the tensors of rank 0's shard, then rank 1's, ... and each
 * shard's tensors by offset.  Every tensor's mask bits start on a fresh
 * uint32_t word, so a shard is a contiguous run of words, its packed values a
 * contiguous run of the send buffer, and kernels never see unaligned masks.
 */
#ifndef SCAPE_PLAN_H
#define SCAPE_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "engine.h"

typedef struct plan_tensor {
    const char *name; /* the registered tensor's (pieces share it) */
    size_t off;  /* coordinate offset in the flat vector */
    size_t len;
    size_t k;    /* k_l = max(1, ceil(rho * len)), or len when whole <= dense_below */
    int owner;
    size_t word; /* first mask word, comm space */
    size_t pos;  /* first element in comm-order state vectors */
    uint32_t group; /* parameter group (eng_tensor.group) */
    size_t parent;  /* index of the registered tensor this is (a piece of) */
    size_t whole;   /* that tensor's length: dense_below looks at it */
} plan_tensor;

typedef struct plan_shard {
    size_t first, count; /* range of plan.order */
    size_t word0, words; /* mask words */
    size_t pos0, len;    /* comm-order elements */
} plan_shard;

typedef struct plan {
    size_t n, ntensors, nwords, max_len, k_total;
    size_t dense_below;  /* tensors of at most this many coordinates go whole */
    size_t nreg;         /* registered tensors (ntensors counts the pieces) */
    size_t split_above;  /* 0: no split */
    int nranks;
    plan_tensor *t;      /* layout order; a tensor's pieces in a row, by offset */
    size_t *order;       /* comm order: indices into t */
    plan_shard *shard;   /* per rank */
    uint64_t hash;       /* of the registered tensors' offsets, lengths, names and
                            (non-zero) groups: the same whatever split_above */
} plan;

/* k_l for a tensor of len coordinates at density rho. */
size_t plan_k(double rho, size_t len);
/* Validate the tensors (they must tile [0, N)) and build the plan. */
scape_rc plan_build(plan **out, const eng_tensor *ts, size_t nt, int nranks, double rho);
/* ... splitting every tensor longer than split_above (> 0) into pieces of at
 * most split_above coordinates.  Greedy balance then keeps every owner's
 * share under mean + split_above (docs/algorithm.md).  Pieces do not depend
 * on nranks, so a plan built (plan_build) from the pieces as tensors, for
 * any R, has the owners a split plan of that R has. */
scape_rc plan_build_split(plan **out, const eng_tensor *ts, size_t nt, int nranks, double rho,
                          size_t split_above);
/* The number of pieces tensor len splits into (1 when split_above is 0 or
 * len <= split_above). */
size_t plan_pieces(size_t len, size_t split_above);
/* FNV-1a over len bytes, continuing from h (the hashes ranks compare). */
uint64_t plan_fnv1a(uint64_t h, const void *data, size_t len);
/* k_l and k_total for density rho (the owners and the layout do not
 * depend on it); a tensor of at most dense_below coordinates keeps all. */
void plan_set_rho(plan *p, double rho);
/* Tensors of at most dense_below coordinates go whole from now on (0:
 * none); k_l and k_total for density rho. */
void plan_set_dense(plan *p, size_t dense_below, double rho);
/* The density of step t's mask under c's schedule (docs/algorithm.md):
 * c->rho without one (rho_start 0) and in warm-up; else rho_start, halved
 * at equal intervals over rho_steps masked steps, never below rho.  Only
 * exact operations, so every rank derives the same value from t alone. */
double plan_rho_at(const eng_config *c, uint64_t t);
/* The reduction's chunks (reduce_chunk, docs/design.md "Chunked
 * reductions"): whole tensors by offset from the end, a chunk closed once it
 * holds at least `coords` coordinates; chunk 0 is the last one.  *of (comm
 * order) gets each tensor's chunk, *run (2 nranks *nchunks) the run [a, b)
 * of comm order that shard s holds of chunk c at [2 (nranks c + s)] (one run:
 * a shard lays its tensors out by offset; an empty one where it holds
 * none).  The caller frees *of and *run. */
scape_rc plan_chunks(const plan *p, size_t coords, size_t **of, size_t **run, size_t *nchunks);
/* Free; sets *p to NULL. */
void plan_destroy(plan **p);

#endif /* SCAPE_PLAN_H */
