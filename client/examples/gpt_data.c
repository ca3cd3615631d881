/* gpt_data.c - corpus loading, split and batches for the GPT demo (gpt_data.h). */
#include "gpt_data.h"
#include "gpt_rand.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The batch stream: its state advances by the golden ratio before mixing. */
static uint64_t next_random(uint64_t *state)
{
    *state += 0x9E3779B97F4A7C15ull;
    return gpt_mix64(*state);
}

static int is_val_entry(size_t index)
{
    return gpt_mix64((uint64_t)index) % 10 == 0;
}

/* The whole file in a malloc'd buffer; NULL with a message in err. */
static unsigned char *read_all(const char *path, size_t *len, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    unsigned char *buf = NULL;
    size_t cap = 0, n = 0;
    if (!f) {
        snprintf(err, errlen, "cannot open '%s': %s", path, strerror(errno));
        return NULL;
    }
    for (;;) {
        if (n == cap) {
            unsigned char *nb = realloc(buf, cap = cap ? 2 * cap : 1 << 16);
            if (!nb) {
                snprintf(err, errlen, "'%s': out of memory", path);
                goto fail;
            }
            buf = nb;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    if (ferror(f)) {
        snprintf(err, errlen, "cannot read '%s'", path);
        goto fail;
    }
    fclose(f);
    *len = n;
    return buf;
fail:
    free(buf);
    fclose(f);
    return NULL;
}

/* Length of the entry starting at pos: up to and including its "%" line. */
static size_t entry_len(const unsigned char *buf, size_t len, size_t pos)
{
    size_t i = pos;
    while (i < len) {
        const unsigned char *nl = memchr(buf + i, '\n', len - i);
        size_t eol = nl ? (size_t)(nl - buf) : len, next = nl ? eol + 1 : len;
        if (eol - i == 1 && buf[i] == '%')
            return next - pos;
        i = next;
    }
    return len - pos;
}

/* Walks the entries: with c->train/val NULL counts the split sizes, else fills them. */
static void split(const unsigned char *buf, size_t len, gpt_corpus *c)
{
    size_t nt = 0, nv = 0, entries = 0, val_entries = 0;
    for (size_t pos = 0; pos < len; entries++) {
        size_t el = entry_len(buf, len, pos);
        int val = is_val_entry(entries);
        int *dst = val ? c->val : c->train;
        size_t *nd = val ? &nv : &nt;
        for (size_t i = 0; dst && i < el; i++)
            dst[*nd + i] = c->id[buf[pos + i]];
        *nd += el;
        val_entries += (size_t)val;
        pos += el;
    }
    c->n_train = nt;
    c->n_val = nv;
    c->entries = entries;
    c->val_entries = val_entries;
}

static void build_vocab(const unsigned char *buf, size_t len, gpt_corpus *c)
{
    int seen[256] = { 0 };
    for (size_t i = 0; i < len; i++)
        seen[buf[i]] = 1;
    c->vocab = 0;
    for (int b = 0; b < 256; b++) {
        c->id[b] = seen[b] ? c->vocab : -1;
        if (seen[b])
            c->byte[c->vocab++] = (unsigned char)b;
    }
}

int gpt_corpus_load(const char *path, gpt_corpus *c, char *err, size_t errlen)
{
    size_t len = 0;
    if (!err)
        errlen = 0; /* snprintf(NULL, 0, ...) writes nothing */
    if (!path || !c) {
        snprintf(err, errlen, "gpt_corpus_load: no path or no corpus");
        return -1;
    }
    memset(c, 0, sizeof *c);
    unsigned char *buf = read_all(path, &len, err, errlen);
    if (!buf)
        return -1;
    int rc = -1;
    if (len == 0) {
        snprintf(err, errlen, "'%s' is empty", path);
        goto out;
    }
    build_vocab(buf, len, c);
    split(buf, len, c);
    if (c->n_train < 2 || c->n_val < 2) {
        snprintf(err, errlen, "'%s': %zu entries leave the %s split under 2 tokens; "
                 "it needs more entries separated by lines holding only '%%'",
                 path, c->entries, c->n_val < 2 ? "validation" : "training");
        goto out;
    }
    c->train = malloc(c->n_train * sizeof *c->train);
    c->val = malloc(c->n_val * sizeof *c->val);
    if (!c->train || !c->val) {
        snprintf(err, errlen, "'%s': out of memory", path);
        goto out;
    }
    split(buf, len, c);
    rc = 0;
out:
    free(buf);
    if (rc != 0)
        gpt_corpus_free(c);
    return rc;
}

void gpt_corpus_free(gpt_corpus *c)
{
    if (!c)
        return;
    free(c->train);
    free(c->val);
    memset(c, 0, sizeof *c);
}

static void window(const int *tokens, size_t start, int T, int *x, int *y)
{
    for (int t = 0; t < T; t++) {
        x[t] = tokens[start + (size_t)t];
        y[t] = tokens[start + (size_t)t + 1];
    }
}

int gpt_batch(const int *tokens, size_t n, uint64_t *rng_state, int B, int T, int *x,
              int *y)
{
    if (B < 1 || T < 1 || n < (size_t)T + 1)
        return -1;
    /* n - T starts fit; the modulo bias is below 2^-40 for any real corpus */
    for (int b = 0; b < B; b++)
        window(tokens, next_random(rng_state) % (n - (size_t)T), T, x + (size_t)b * T,
               y + (size_t)b * T);
    return 0;
}

int gpt_batch_eval(const int *tokens, size_t n, int index, int count, int B, int T, int *x,
                   int *y)
{
    if (B < 1 || T < 1 || count < 1 || index < 0 || index >= count || n < (size_t)T + 1)
        return -1;
    uint64_t windows = (uint64_t)count * (uint64_t)B, last = n - (size_t)T - 1;
    for (int b = 0; b < B; b++) {
        uint64_t j = (uint64_t)index * (uint64_t)B + (uint64_t)b;
        size_t start = windows > 1 ? (size_t)(j * last / (windows - 1)) : 0;
        window(tokens, start, T, x + (size_t)b * T, y + (size_t)b * T);
    }
    return 0;
}

double gpt_unigram_entropy(const gpt_corpus *c)
{
    size_t count[256] = { 0 };
    double h = 0;
    if (c->n_train == 0)
        return 0;
    for (size_t i = 0; i < c->n_train; i++)
        if (c->train[i] >= 0 && c->train[i] < 256)
            count[c->train[i]]++;
    for (int v = 0; v < c->vocab && v < 256; v++)
        if (count[v]) {
            double p = (double)count[v] / (double)c->n_train;
            h -= p * log(p);
        }
    return h;
}
