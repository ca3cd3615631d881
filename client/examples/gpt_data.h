/* gpt_data.h - the character corpus of the GPT demo: byte vocabulary, a
 * deterministic train/validation split by fortune entry, and batches.
 *
 * A fortune file separates entries by lines holding only "%"; each entry keeps
 * its closing "%" line, so both token streams still read like fortune files.
 * Entry i goes to validation when a fixed hash of i is 0 mod 10: about 10%,
 * spread over the whole corpus, the same on every run and in every process. */
#ifndef SCAPE_GPT_DATA_H
#define SCAPE_GPT_DATA_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int vocab;                /* distinct bytes in the file */
    unsigned char byte[256];  /* token id -> byte, ids in increasing byte order */
    int id[256];              /* byte -> token id, -1 for bytes not in the file */
    int *train;               /* token ids of the training entries, in file order */
    size_t n_train;
    int *val;                 /* token ids of the validation entries */
    size_t n_val;
    size_t entries;           /* entries in the file */
    size_t val_entries;       /* of which in validation */
} gpt_corpus;

/* Reads and splits the file at path into c (overwritten, not freed); 0, or -1
 * with a message in err (missing or unreadable file, empty file, a split under
 * 2 tokens, no memory) and c left empty.  err may be NULL. */
int gpt_corpus_load(const char *path, gpt_corpus *c, char *err, size_t errlen);

/* Frees the token arrays and empties c; safe on an emptied or zeroed corpus. */
void gpt_corpus_free(gpt_corpus *c);

/* B random windows of tokens[0..n): x [B][T] and y = x shifted by one; the
 * caller's *rng_state drives (and advances) the choice.  -1 if n < T + 1. */
int gpt_batch(const int *tokens, size_t n, uint64_t *rng_state, int B, int T, int *x,
              int *y);

/* Batch index (0 .. count-1) of count fixed batches whose count*B windows
 * are evenly spaced over tokens[0..n): the same in every process, for a
 * comparable validation loss.  -1 on a bad index or n < T + 1. */
int gpt_batch_eval(const int *tokens, size_t n, int index, int count, int B, int T, int *x,
                   int *y);

/* Entropy in nats of the token frequencies of the training split: the loss
 * of the best model that ignores context. */
double gpt_unigram_entropy(const gpt_corpus *c);

#endif
