/* gpt_layout.h - a GPT's tensor layout for the benchmarks (bench_counters,
 * tests/gpu/gpu_step): 34 layers of width 2048 and a 50304-token vocabulary,
 * 1.82e9 parameters in 412 tensors, every length times `scale` (at least 1).
 * Names are "t<i>"; returns the tensor count and sets *n to N. */
#ifndef SCAPE_BENCH_GPT_LAYOUT_H
#define SCAPE_BENCH_GPT_LAYOUT_H

#include <stdio.h>

#include "engine.h"

#define GPT_TENSORS 412

static inline size_t gpt_layout(double scale, eng_tensor *ts, size_t *n)
{
    static char names[GPT_TENSORS][24];
    const size_t d = 2048, layers = 34, vocab = 50304, ctx = 2048;
    const size_t per_layer[] = { d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d,
                                 4 * d * d, d };
    size_t lens[GPT_TENSORS], nt = 0;
    lens[nt++] = vocab * d;
    lens[nt++] = ctx * d;
    for (size_t l = 0; l < layers; l++)
        for (size_t q = 0; q < sizeof per_layer / sizeof per_layer[0]; q++)
            lens[nt++] = per_layer[q];
    lens[nt++] = d;
    lens[nt++] = d;
    *n = 0;
    for (size_t i = 0; i < nt; i++) {
        size_t len = (size_t)((double)lens[i] * scale);
        len = len ? len : 1;
        snprintf(names[i], sizeof names[i], "t%zu", i);
        ts[i] = (eng_tensor){ names[i], *n, len, 0 };
        *n += len;
    }
    return nt;
}

/* N at scale 1. */
static inline size_t gpt_numel(void)
{
    eng_tensor ts[GPT_TENSORS];
    size_t n;
    gpt_layout(1.0, ts, &n);
    return n;
}

#endif /* SCAPE_BENCH_GPT_LAYOUT_H */
