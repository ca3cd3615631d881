/* engine_internal.h - the engine's state, shared by engine.c (the step) and
 * engine_inspect.c (read-only views for tests, status and checkpoints). */
#ifndef SCAPE_ENGINE_INTERNAL_H
#define SCAPE_ENGINE_INTERNAL_H

#include "engine.h"
#include "plan.h"

struct eng {
    eng_config cfg;
    plan *p;
    comm_t *comm;
    int rank;
    int tr;              /* trainers on this rank, T_r */
    int t_total;         /* T */
    kern_dtype pdt, gdt;
    uint64_t last_step;
    int initialised;
    int broken;          /* a step failed after its collectives began */

    /* Optimizer state in comm order, elements [base, base + len). */
    size_t state_base, state_len;
    float *m, *v, *theta;

    float *e;            /* residual e_r, coordinate order, N */
    float *g;            /* intake buffer, N; NULL when a trainer's buffer serves */
    float *send;         /* packed a_r on the mask, then (replicated) the sum */
    float *recv;         /* sharded: this rank's segment of the sum */
    float *upd;          /* packed updated parameters, all ranks */
    float *upd_own;      /* sharded: this rank's part of upd before the gather */
    float *stat;         /* statistics of one tensor */
    void *topk_scratch;
    size_t topk_scratch_bytes;

    uint32_t *ones;      /* the all-ones mask (padding bits clear) */
    uint32_t *mask_buf[2];
    const uint32_t *mask_cur; /* mask of the last step: ones or a mask_buf */
    uint32_t *mask_next; /* target of the lagged all-gather */
    int mask_pending;    /* that all-gather is outstanding */
    uint32_t *own_bits;  /* scape: this shard's next-mask words; topk: local mask */
    uint32_t *gathered;  /* topk: every rank's local mask */
    uint32_t *prefix;    /* exclusive prefix of set bits per mask word */

    size_t *counts;      /* per rank, scratch for collective counts */
    const float *sum;    /* the last step's reduced values ... */
    size_t sum_base;     /* ... starting at this packed index */

    eng_step_stats last;
};

#endif /* SCAPE_ENGINE_INTERNAL_H */
