/* gpt_run.h - what the GPT example trainer and the quality benchmark share:
 * the command-line settings of a training run, the learning-rate schedule,
 * each trainer's data order, and the validation loss.
 *
 * Everything a step needs is derived from the step number (the batch's
 * random windows, the learning rate), so a trainer that resumes at step t+1
 * after a checkpoint sees exactly what an uninterrupted one would. */
#ifndef SCAPE_GPT_RUN_H
#define SCAPE_GPT_RUN_H

#include <stddef.h>
#include <stdint.h>

#include "gpt.h"
#include "gpt_data.h"

typedef struct gpt_run {
    const char *corpus;   /* --corpus FILE (from fortunes-corpus.sh) */
    gpt_config model;     /* vocab comes from the corpus */
    int batch;            /* --batch: sequences per step per trainer */
    int seq;              /* --seq: tokens per sequence (<= ctx) */
    uint64_t steps;       /* --steps */
    float lr;             /* --lr: peak learning rate */
    uint64_t lr_warmup;   /* --lr-warmup: linear ramp steps */
    float lr_min_frac;    /* cosine decay to this fraction of lr at the end */
    uint64_t seed;        /* --seed: this trainer's data order */
    uint64_t model_seed;  /* --model-seed: initial weights */
    uint64_t eval_every;  /* --eval-every: validation loss period (0: end only) */
    int eval_batches;     /* --eval-batches */
} gpt_run;

/* Defaults: the demo's model (d 64, 2 layers, 4 heads, ctx 64), batch 8. */
void gpt_run_defaults(gpt_run *r);
/* Take the option at argv[*i] (and its value) if it is one of gpt_run's;
 * returns 1 if taken, 0 if not ours, -1 on a bad value (message on stderr). */
int gpt_run_option(gpt_run *r, int argc, char **argv, int *i);
/* Usage lines for the shared options. */
const char *gpt_run_usage(void);
/* The learning rate at step t (1-based): linear warm-up, then cosine. */
float gpt_run_lr(const gpt_run *r, uint64_t t);
/* The batch of step t for the trainer seeded with seed (x, y: [batch][seq]). */
int gpt_run_batch(const gpt_run *r, const gpt_corpus *c, uint64_t seed, uint64_t t, int *x,
                  int *y);
/* Mean loss over the fixed validation batches (the same in every process). */
double gpt_run_val_loss(const gpt_run *r, const gpt_corpus *c, gpt_work *w,
                        const float *params, int *x, int *y);

#endif /* SCAPE_GPT_RUN_H */
