/* fuzz_mask.h - what the mask-code targets (fuzz_maskcode, fuzz_maskdelta)
 * share: a valid mask of a plan's shard for their seeds. */
#ifndef SCAPE_FUZZ_MASK_H
#define SCAPE_FUZZ_MASK_H

#include <string.h>

#include "plan.h"

static inline uint64_t fuzz_xorshift(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* Exactly k_l bits in each tensor of shard sh (the plan's current k_l),
 * drawn from the generator *x, into words (sh->words + 1 of them). */
static inline void fuzz_draw_mask(const plan *p, const plan_shard *sh, uint64_t *x,
                                  uint32_t *words)
{
    memset(words, 0, (sh->words + 1) * sizeof *words);
    for (size_t j = sh->first; j < sh->first + sh->count; j++) {
        const plan_tensor *t = &p->t[p->order[j]];
        uint32_t *tw = words + (t->word - sh->word0);
        for (size_t set = 0; set < t->k;) {
            size_t pos = (size_t)(fuzz_xorshift(x) % t->len);
            if (!(tw[pos / 32] >> (pos % 32) & 1)) {
                tw[pos / 32] |= 1u << (pos % 32);
                set++;
            }
        }
    }
}

#endif /* SCAPE_FUZZ_MASK_H */
