/* maskcode.h - the wire form of mask bits in the mask all-gathers.
 *
 * A tensor's selected bits go either as its bitmap words (ceil(len / 32)
 * words) or as its k selected positions, ascending, each in
 * b = bits(len - 1) bits, whichever is smaller; both sides decide the same
 * way from the plan alone, so every rank knows every other rank's code size
 * before anything is sent and the all-gather stays one fixed-size collective.
 * At rho = 0.01 a tensor of 2^14 coordinates sends 164 x 14 bits (72 words)
 * instead of 512 words: about a seventh.
 *
 * A range of tensors (comm order) codes as: the bitmap words of its
 * bitmap-coded tensors, in comm order, then one little-endian bit stream of
 * the positions of its index-coded tensors, in comm order, padded with zero
 * bits to a whole uint32_t.  Decoding checks everything a peer sent: exactly
 * k bits per tensor, positions ascending and inside the tensor, nothing set
 * past a tensor's end, zero padding.
 */
#ifndef SCAPE_MASKCODE_H
#define SCAPE_MASKCODE_H
#include <stddef.h>
#include <stdint.h>
#include "plan.h"

/* Bits that hold any position in [0, len): the width of an index code. */
unsigned mcode_pos_bits(size_t len);

/* The tensor goes as positions (1) or as bitmap words (0). */
int mcode_by_index(const plan_tensor *t);

/* Bytes of the code of comm-order tensors [first, first + count). */
size_t mcode_bytes(const plan *p, size_t first, size_t count);

/* Encode the bits of those tensors.  words: the mask words of tensor
 * `first` onwards (comm space, so words[0] is tensor first's first word).
 * Every tensor must have exactly k bits set; out holds mcode_bytes(). */
scape_rc mcode_encode(const plan *p, size_t first, size_t count, const uint32_t *words,
                      uint32_t *out);

/* Decode nbytes of code into those tensors' words (positioned as for
 * encode).  merge = 0 replaces their words, 1 ORs the decoded bits in (the
 * union of several ranks' masks).  `from` names the sender in errors. */
scape_rc mcode_decode(const plan *p, size_t first, size_t count, const uint32_t *code,
                      size_t nbytes, uint32_t *words, int merge, int from);

/* Deltas (mask_deltas): the same tensors' mask, each tensor in the
 * shortest of three forms (two bits; the lower on a tie), in one bit stream
 * padded with zero bits to a whole uint32_t, in comm order:
 *   0  its k positions as a Rice-coded list of positions;
 *   1  its change from the previous mask `prev` (words positioned as for
 *      encode), which holds kp positions: how many of them left (in
 *      count_bits(kp) bits; the count that joined follows, left + k - kp),
 *      then those that left as a Rice-coded list of their indices among
 *      prev's kp positions, then those that joined as one of their indices
 *      among the len - kp positions prev does not hold;
 *   2  its bitmap of len bits.
 * A Rice-coded list of m ascending indices in [0, u) sends each gap (the
 * first index, then the distance from the last one minus one) as gap >> r
 * one bits and a zero, then its low r bits, with r = floor(log2(mean gap))
 * derived from u and m (not sent): about log2(u / m) + 2 bits an index,
 * where the fixed code spends log2(len) a position.  So a position that
 * left costs about 2 bits when half the mask changes.  The decoder checks
 * everything and names the sender and the tensor: counts within the
 * positions they count, indices ascending and inside them, exactly k bits
 * after, the shortest form taken (one mask, one delta), zero padding. */
size_t mdelta_bytes(const plan *p, size_t first, size_t count, const uint32_t *prev,
                    const uint32_t *next);
scape_rc mdelta_encode(const plan *p, size_t first, size_t count, const uint32_t *prev,
                       const uint32_t *next, uint32_t *out);
scape_rc mdelta_decode(const plan *p, size_t first, size_t count, const uint32_t *prev,
                       const uint32_t *code, size_t nbytes, uint32_t *words, int from);

#endif /* SCAPE_MASKCODE_H */
