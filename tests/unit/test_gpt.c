/* test_gpt.c - the demo's character GPT (client/examples): layout and init,
 * gradients against central differences in double precision, float against
 * double, causality, a short Adam run that must learn a pattern needing
 * attention, and the corpus: vocabulary, split, batches, entropy, bad files. */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpt.h"
#include "gpt_data.h"
#include "gpt_rand.h"
#include "check_run.h"

/* ---- helpers ---- */


/* uniform in [-1, 1) */
static double uniform(uint64_t *s)
{
    return (double)(gpt_next64(s) >> 11) * 0x1.0p-52 - 1.0;
}

/* gpt_init plus noise of amplitude 0.4 everywhere: weights large enough that
 * attention is far from uniform and every layernorm term matters. */
static double *noisy_params(const gpt_config *c, uint64_t seed)
{
    size_t n = gpt_num_params(c);
    float *f = malloc(n * sizeof *f);
    double *p = malloc(n * sizeof *p);
    ck_assert(f && p);
    gpt_init(c, f, seed);
    for (size_t i = 0; i < n; i++)
        p[i] = (double)f[i] + 0.4 * uniform(&seed);
    free(f);
    return p;
}

static void random_tokens(int *t, int n, int vocab, uint64_t seed)
{
    for (int i = 0; i < n; i++)
        t[i] = (int)(gpt_next64(&seed) % (uint64_t)vocab);
}

static gpt_tensor *layout_of(const gpt_config *c, int *nt)
{
    *nt = gpt_layout(c, NULL, 0);
    ck_assert_int_gt(*nt, 0);
    gpt_tensor *ts = malloc((size_t)*nt * sizeof *ts);
    ck_assert_ptr_nonnull(ts);
    ck_assert_int_eq(gpt_layout(c, ts, *nt), *nt);
    return ts;
}

/* A new temporary file holding len bytes of text; its name goes into path. */
static void write_temp(char *path, size_t pathlen, const char *text, size_t len)
{
    snprintf(path, pathlen, "/tmp/test_gpt_XXXXXX");
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, text, len), (ssize_t)len);
    ck_assert_int_eq(close(fd), 0);
}

/* ---- layout and init ---- */

START_TEST(layout_is_contiguous)
{
    gpt_config c = { 114, 64, 64, 2, 4 };
    int nt;
    gpt_tensor *ts = layout_of(&c, &nt);
    ck_assert_int_eq(nt, 5 + 12 * 2);
    size_t off = 0;
    for (int i = 0; i < nt; i++) {
        ck_assert_uint_eq(ts[i].offset, off);
        ck_assert_uint_gt(ts[i].length, 0);
        off += ts[i].length;
        for (int j = 0; j < i; j++)
            ck_assert_str_ne(ts[i].name, ts[j].name);
    }
    /* by hand: wte + wpe + L * (12 d^2 + 13 d) + lnf + head */
    ck_assert_uint_eq(off, 114 * 64 + 64 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64 + 64 * 114);
    ck_assert_uint_eq(gpt_num_params(&c), off);
    ck_assert_str_eq(ts[0].name, "wte");
    ck_assert_str_eq(ts[1].name, "wpe");
    ck_assert_str_eq(ts[4].name, "h0.attn.qkv.w");
    ck_assert_uint_eq(ts[4].length, 64 * 192);
    ck_assert_str_eq(ts[nt - 1].name, "head.w");
    /* a short out only gets what fits */
    gpt_tensor two[2];
    ck_assert_int_eq(gpt_layout(&c, two, 2), nt);
    ck_assert_str_eq(two[1].name, "wpe");
    free(ts);
}
END_TEST

START_TEST(init_is_deterministic_and_gpt2_like)
{
    gpt_config c = { 50, 32, 32, 3, 4 };
    size_t n = gpt_num_params(&c);
    float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
    ck_assert(a && b);
    gpt_init(&c, a, 7);
    gpt_init(&c, b, 7);
    ck_assert_int_eq(memcmp(a, b, n * sizeof *a), 0);
    gpt_init(&c, b, 8);
    ck_assert_int_ne(memcmp(a, b, n * sizeof *a), 0);
    int nt;
    gpt_tensor *ts = layout_of(&c, &nt);
    for (int i = 0; i < nt; i++) {
        const char *nm = ts[i].name, *tail = nm + strlen(nm) - 2;
        double s2 = 0, want;
        for (size_t j = 0; j < ts[i].length; j++)
            s2 += (double)a[ts[i].offset + j] * a[ts[i].offset + j];
        double rms = sqrt(s2 / (double)ts[i].length);
        if (strcmp(tail, ".b") == 0)
            want = 0;
        else if (strstr(nm, "ln") != NULL)
            want = 1; /* gains */
        else if (strstr(nm, "proj.w") != NULL)
            want = 0.02 / sqrt(2.0 * c.layers);
        else
            want = 0.02;
        ck_assert_msg(fabs(rms - want) <= 0.1 * want, "%s: rms %g, want %g", nm, rms, want);
    }
    free(ts);
    free(a);
    free(b);
}
END_TEST

/* ---- gradients ---- */

/* Central differences on every coordinate against gptd_forward_backward;
 * returns the worst relative error and prints it per tensor. */
static double check_gradients(const gpt_config *c, int B, int T, uint64_t seed)
{
    size_t n = gpt_num_params(c);
    double *p = noisy_params(c, seed), *g = malloc(n * sizeof *g), worst = 0;
    int *x = malloc((size_t)B * T * sizeof *x), *y = malloc((size_t)B * T * sizeof *y), nt;
    gptd_work *w = gptd_work_new(c, B, T);
    ck_assert(g && x && y && w);
    random_tokens(x, B * T, c->vocab, seed + 1);
    random_tokens(y, B * T, c->vocab, seed + 2);
    for (size_t i = 0; i < n; i++)
        g[i] = 1e30; /* must be overwritten, not added to */
    double loss = gptd_forward_backward(c, w, p, g, x, y, B, T);
    ck_assert(isfinite(loss));
    ck_assert_double_eq_tol(gptd_loss(c, w, p, x, y, B, T), loss, 1e-14);
    gpt_tensor *ts = layout_of(c, &nt);
    for (int t = 0; t < nt; t++) {
        double tworst = 0;
        for (size_t j = ts[t].offset; j < ts[t].offset + ts[t].length; j++) {
            const double h = 1e-5, keep = p[j];
            p[j] = keep + h;
            double lp = gptd_loss(c, w, p, x, y, B, T);
            p[j] = keep - h;
            double lm = gptd_loss(c, w, p, x, y, B, T);
            p[j] = keep;
            double fd = (lp - lm) / (2 * h), err = fabs(fd - g[j]);
            /* relative, with an absolute floor far below the typical 1e-2 */
            double rel = err / (fmax(fabs(fd), fabs(g[j])) + 1e-7);
            ck_assert_msg(rel < 1e-5, "%s[%zu]: analytic %.10g, numeric %.10g", ts[t].name,
                          j - ts[t].offset, g[j], fd);
            tworst = fmax(tworst, rel);
        }
        printf("  %-14s %5zu coords, worst relative error %.2e\n", ts[t].name, ts[t].length,
               tworst);
        worst = fmax(worst, tworst);
    }
    free(ts);
    gptd_work_free(w);
    free(p);
    free(g);
    free(x);
    free(y);
    return worst;
}

START_TEST(gradients_match_finite_differences)
{
    gpt_config c = { 11, 8, 8, 2, 2 };
    printf("gradient check: vocab 11, ctx 8, d 8, 2 layers, 2 heads, B 2, T 8\n");
    check_gradients(&c, 2, 8, 11);
}
END_TEST

START_TEST(gradients_match_on_ragged_sizes)
{
    /* no size a multiple of the register tiles: every edge path */
    gpt_config c = { 7, 9, 6, 1, 3 };
    printf("gradient check: vocab 7, ctx 9, d 6, 1 layer, 3 heads, B 3, T 5\n");
    check_gradients(&c, 3, 5, 23);
}
END_TEST

START_TEST(float_agrees_with_double)
{
    gpt_config c = { 30, 16, 16, 2, 4 };
    const int B = 3, T = 7; /* 21 rows, 30 columns: tiles and edges */
    size_t n = gpt_num_params(&c);
    double *pd = noisy_params(&c, 5), *gd = malloc(n * sizeof *gd);
    float *pf = malloc(n * sizeof *pf), *gf = malloc(n * sizeof *gf);
    int x[21], y[21], nt;
    ck_assert(gd && pf && gf);
    for (size_t i = 0; i < n; i++)
        pf[i] = (float)pd[i];
    for (size_t i = 0; i < n; i++)
        pd[i] = (double)pf[i]; /* the same parameters in both */
    random_tokens(x, B * T, c.vocab, 1);
    random_tokens(y, B * T, c.vocab, 2);
    gpt_work *wf = gpt_work_new(&c, B, T);
    gptd_work *wd = gptd_work_new(&c, B, T);
    ck_assert(wf && wd);
    double ld = gptd_forward_backward(&c, wd, pd, gd, x, y, B, T);
    float lf = gpt_forward_backward(&c, wf, pf, gf, x, y, B, T);
    ck_assert_msg(fabs(lf - ld) <= 1e-5 * ld, "loss: float %.8g, double %.8g", lf, ld);
    gpt_tensor *ts = layout_of(&c, &nt);
    for (int t = 0; t < nt; t++) {
        double scale = 0, diff = 0;
        for (size_t j = ts[t].offset; j < ts[t].offset + ts[t].length; j++) {
            scale = fmax(scale, fabs(gd[j]));
            diff = fmax(diff, fabs(gf[j] - gd[j]));
        }
        ck_assert_msg(diff <= 1e-4 * scale + 1e-9, "%s: max |float - double| %g, max |g| %g",
                      ts[t].name, diff, scale);
    }
    free(ts);
    gpt_work_free(wf);
    gptd_work_free(wd);
    free(pd);
    free(gd);
    free(pf);
    free(gf);
}
END_TEST

/* ---- causality ---- */

START_TEST(future_tokens_do_not_leak)
{
    gpt_config c = { 20, 16, 16, 2, 4 };
    const int B = 3, T = 13, V = 20;
    size_t n = gpt_num_params(&c);
    float *p = malloc(n * sizeof *p), *before = malloc((size_t)B * T * V * sizeof *before);
    double *pd = noisy_params(&c, 3);
    int x[39], y[39];
    ck_assert(p && before);
    for (size_t i = 0; i < n; i++)
        p[i] = (float)pd[i];
    gpt_work *w = gpt_work_new(&c, B, T);
    ck_assert_ptr_nonnull(w);
    random_tokens(x, B * T, V, 4);
    random_tokens(y, B * T, V, 5);
    /* the loss is the mean of -log p(y) over the probabilities it exposes */
    double want = 0;
    float loss = gpt_loss(&c, w, p, x, y, B, T);
    for (int i = 0; i < B * T; i++)
        want -= log(gpt_work_probs(w)[i * V + y[i]]);
    ck_assert_double_eq_tol(loss, want / (B * T), 1e-5);
    for (int t = 0; t < T; t += 4) {
        ck_assert_float_eq(gpt_loss(&c, w, p, x, NULL, B, T), 0);
        memcpy(before, gpt_work_probs(w), (size_t)B * T * V * sizeof *before);
        x[T + t] = (x[T + t] + 1) % V; /* sequence 1, position t */
        gpt_loss(&c, w, p, x, NULL, B, T);
        const float *after = gpt_work_probs(w);
        for (int b = 0; b < B; b++)
            for (int s = 0; s < T; s++) {
                size_t row = ((size_t)b * T + s) * V;
                int same = memcmp(before + row, after + row, V * sizeof *after) == 0;
                if (b != 1 || s < t)
                    ck_assert_msg(same, "changing (1, %d) changed the output at (%d, %d)", t,
                                  b, s);
                else if (s == t)
                    ck_assert_msg(!same, "changing (1, %d) left its own output alone", t);
            }
    }
    gpt_work_free(w);
    free(p);
    free(pd);
    free(before);
}
END_TEST

/* ---- training ---- */

typedef struct {
    float *m, *v;
    int t;
} adam;

static void adam_step(adam *a, float *p, const float *g, size_t n, float lr)
{
    const float b1 = 0.9f, b2 = 0.999f;
    a->t++;
    float c1 = 1.0f - powf(b1, (float)a->t), c2 = 1.0f - powf(b2, (float)a->t);
    for (size_t i = 0; i < n; i++) {
        a->m[i] = b1 * a->m[i] + (1 - b1) * g[i];
        a->v[i] = b2 * a->v[i] + (1 - b2) * g[i] * g[i];
        p[i] -= lr * (a->m[i] / c1) / (sqrtf(a->v[i] / c2) + 1e-8f);
    }
}

START_TEST(adam_learns_a_pattern_that_needs_attention)
{
    /* After a 0 the next token is 1, 3 or 5, depending on what preceded the
     * 0: a bigram model cannot beat (3/9) ln 3 = 0.366 nats. */
    static const int period[9] = { 0, 1, 2, 0, 3, 4, 0, 5, 6 };
    gpt_config c = { 11, 16, 16, 2, 2 };
    const int B = 4, T = 16, steps = 300;
    int seq[900], x[64], y[64];
    for (int i = 0; i < 900; i++)
        seq[i] = period[i % 9];
    size_t n = gpt_num_params(&c);
    float *p = malloc(n * sizeof *p), *g = malloc(n * sizeof *g);
    adam a = { calloc(n, sizeof(float)), calloc(n, sizeof(float)), 0 };
    gpt_work *w = gpt_work_new(&c, B, T);
    ck_assert(p && g && a.m && a.v && w);
    gpt_init(&c, p, 1);
    uint64_t rng = 42;
    float first = 0, loss = 0;
    for (int s = 0; s < steps; s++) {
        ck_assert_int_eq(gpt_batch(seq, 900, &rng, B, T, x, y), 0);
        loss = gpt_forward_backward(&c, w, p, g, x, y, B, T);
        ck_assert(isfinite(loss));
        if (s == 0)
            first = loss;
        adam_step(&a, p, g, n, 1e-2f);
    }
    double eval = 0;
    for (int k = 0; k < 4; k++) {
        ck_assert_int_eq(gpt_batch_eval(seq, 900, k, 4, B, T, x, y), 0);
        eval += gpt_loss(&c, w, p, x, y, B, T) / 4;
    }
    printf("training: loss %.3f at step 0, %.3f at step %d, %.3f on fixed batches\n", first,
           loss, steps, eval);
    ck_assert_double_gt(first, 2.0); /* about ln 11 = 2.40 */
    ck_assert_double_lt(eval, 0.2);
    gpt_work_free(w);
    free(p);
    free(g);
    free(a.m);
    free(a.v);
}
END_TEST

/* ---- bad model arguments ---- */

START_TEST(bad_model_arguments)
{
    gpt_config c = { 11, 8, 8, 1, 2 }, odd = { 11, 8, 9, 1, 2 }, zero = { 0, 8, 8, 1, 2 };
    ck_assert_int_eq(gpt_layout(&odd, NULL, 0), -1);
    ck_assert_uint_eq(gpt_num_params(&odd), 0);
    ck_assert_int_eq(gpt_layout(&zero, NULL, 0), -1);
    ck_assert_ptr_null(gpt_work_new(&odd, 1, 4));
    ck_assert_ptr_null(gpt_work_new(&c, 1, 9)); /* T > ctx */
    ck_assert_ptr_null(gpt_work_new(&c, 0, 4));
    gpt_work_free(NULL);
    size_t n = gpt_num_params(&c);
    float *p = calloc(n, sizeof *p), *g = calloc(n, sizeof *g);
    gpt_work *w = gpt_work_new(&c, 2, 4);
    ck_assert(p && g && w);
    int x[8] = { 0 }, y[8] = { 0 };
    ck_assert(isfinite(gpt_forward_backward(&c, w, p, g, x, y, 2, 4)));
    ck_assert(isfinite(gpt_loss(&c, w, p, x, y, 1, 3))); /* smaller than the capacity */
    ck_assert(isnan(gpt_forward_backward(&c, w, p, g, x, y, 3, 4)));
    ck_assert(isnan(gpt_loss(&c, w, p, x, y, 2, 5)));
    y[3] = 11;
    ck_assert(isnan(gpt_forward_backward(&c, w, p, g, x, y, 2, 4)));
    y[3] = 0;
    x[5] = -1;
    ck_assert(isnan(gpt_loss(&c, w, p, x, y, 2, 4)));
    x[5] = 0;
    ck_assert(isnan(gpt_forward_backward(&c, w, p, g, x, NULL, 2, 4)));
    ck_assert(isnan(gpt_loss(&odd, w, p, x, y, 2, 4))); /* not the config of w */
    gpt_work_free(w);
    free(p);
    free(g);
}
END_TEST

/* ---- corpus ---- */

#define ENTRIES 1000

/* ENTRIES fortune entries "[i] ...", the last one without its closing line. */
static char *fortune_text(size_t *len)
{
    char *s = malloc(ENTRIES * 64);
    size_t n = 0;
    ck_assert_ptr_nonnull(s);
    for (int i = 0; i < ENTRIES; i++)
        n += (size_t)sprintf(s + n, "[%d] %s\n%s", i, i % 3 ? "Go west." : "Zzz~",
                             i + 1 < ENTRIES ? "%\n" : "");
    *len = n;
    return s;
}

static char *decode(const gpt_corpus *c, const int *t, size_t n)
{
    char *s = malloc(n + 1);
    ck_assert_ptr_nonnull(s);
    for (size_t i = 0; i < n; i++)
        s[i] = (char)c->byte[t[i]];
    s[n] = 0;
    return s;
}

START_TEST(corpus_vocab_and_split)
{
    size_t len;
    char *text = fortune_text(&len), path[64], err[256], *seen = calloc(256, 1);
    ck_assert_ptr_nonnull(seen);
    write_temp(path, sizeof path, text, len);
    gpt_corpus c, again;
    ck_assert_msg(gpt_corpus_load(path, &c, err, sizeof err) == 0, "%s", err);
    /* vocabulary: the distinct bytes, in byte order */
    int distinct = 0;
    for (size_t i = 0; i < len; i++) {
        distinct += !seen[(unsigned char)text[i]];
        seen[(unsigned char)text[i]] = 1;
    }
    ck_assert_int_eq(c.vocab, distinct);
    for (int k = 0; k < c.vocab; k++) {
        ck_assert_int_eq(c.id[c.byte[k]], k);
        if (k > 0)
            ck_assert_int_lt(c.byte[k - 1], c.byte[k]);
    }
    ck_assert_int_eq(c.id['Q'], -1);
    /* split: whole entries, about 10% in validation, from all over the file */
    ck_assert_uint_eq(c.entries, ENTRIES);
    ck_assert_uint_eq(c.n_train + c.n_val, len);
    ck_assert_uint_ge(c.val_entries, 70);
    ck_assert_uint_le(c.val_entries, 130);
    char *tr = decode(&c, c.train, c.n_train), *va = decode(&c, c.val, c.n_val);
    int first_val = -1, last_val = -1;
    for (int i = 0; i < ENTRIES; i++) {
        char tag[16];
        snprintf(tag, sizeof tag, "[%d] ", i);
        int in_val = strstr(va, tag) != NULL;
        ck_assert_msg(in_val != (strstr(tr, tag) != NULL), "entry %d in both or neither", i);
        if (in_val && first_val < 0)
            first_val = i;
        if (in_val)
            last_val = i;
    }
    ck_assert_int_lt(first_val, ENTRIES / 10);
    ck_assert_int_gt(last_val, ENTRIES - ENTRIES / 10);
    ck_assert_int_eq(strncmp(va, "[", 1), 0);
    /* the same file splits the same way every time */
    ck_assert_int_eq(gpt_corpus_load(path, &again, err, sizeof err), 0);
    ck_assert_uint_eq(again.n_val, c.n_val);
    ck_assert_int_eq(memcmp(again.val, c.val, c.n_val * sizeof *c.val), 0);
    ck_assert_int_eq(memcmp(again.train, c.train, c.n_train * sizeof *c.train), 0);
    gpt_corpus_free(&again);
    gpt_corpus_free(&c);
    ck_assert_ptr_null(c.train);
    gpt_corpus_free(&c);
    unlink(path);
    free(tr);
    free(va);
    free(text);
    free(seen);
}
END_TEST

START_TEST(batches_are_shifted_windows)
{
    enum { N = 100, B = 5, T = 10 };
    int tok[N], x[B * T], y[B * T], x2[B * T], y2[B * T];
    for (int i = 0; i < N; i++)
        tok[i] = i; /* a token's value is its position */
    uint64_t r1 = 9, r2 = 9, r3 = 10;
    ck_assert_int_eq(gpt_batch(tok, N, &r1, B, T, x, y), 0);
    ck_assert_uint_ne(r1, 9);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            ck_assert_int_eq(x[b * T + t], x[b * T] + t);
            ck_assert_int_eq(y[b * T + t], x[b * T + t] + 1);
            ck_assert_int_lt(y[b * T + t], N);
        }
    ck_assert_int_eq(gpt_batch(tok, N, &r2, B, T, x2, y2), 0);
    ck_assert_int_eq(memcmp(x, x2, sizeof x), 0);
    ck_assert_int_eq(gpt_batch(tok, N, &r3, B, T, x2, y2), 0);
    ck_assert_int_ne(memcmp(x, x2, sizeof x), 0);
    /* every start is reachable, including the last, N - T - 1 */
    int hit[N] = { 0 };
    for (int k = 0; k < 2000; k++) {
        ck_assert_int_eq(gpt_batch(tok, N, &r1, 1, T, x, y), 0);
        hit[x[0]] = 1;
    }
    for (int s = 0; s < N - T; s++)
        ck_assert_msg(hit[s], "start %d never drawn", s);
    ck_assert_int_eq(gpt_batch(tok, T, &r1, 1, T, x, y), -1);
    ck_assert_int_eq(gpt_batch(tok, T + 1, &r1, 1, T, x, y), 0);
    /* fixed batches: evenly spaced, from the first token to the last */
    ck_assert_int_eq(gpt_batch_eval(tok, N, 0, 3, B, T, x, y), 0);
    ck_assert_int_eq(x[0], 0);
    ck_assert_int_eq(gpt_batch_eval(tok, N, 2, 3, B, T, x, y), 0);
    ck_assert_int_eq(y[B * T - 1], N - 1);
    ck_assert_int_eq(y[(B - 1) * T], x[(B - 1) * T] + 1);
    ck_assert_int_eq(gpt_batch_eval(tok, N, 2, 3, B, T, x2, y2), 0);
    ck_assert_int_eq(memcmp(x, x2, sizeof x), 0);
    ck_assert_int_eq(gpt_batch_eval(tok, N, 3, 3, B, T, x, y), -1);
    ck_assert_int_eq(gpt_batch_eval(tok, N, -1, 3, B, T, x, y), -1);
    ck_assert_int_eq(gpt_batch_eval(tok, N, 0, 1, 1, T, x, y), 0);
}
END_TEST

START_TEST(unigram_entropy_by_hand)
{
    int aab[3] = { 0, 0, 1 }, abcd[8] = { 0, 1, 2, 3, 3, 2, 1, 0 }, one[4] = { 0, 0, 0, 0 };
    gpt_corpus c;
    memset(&c, 0, sizeof c);
    c.vocab = 4;
    c.train = aab;
    c.n_train = 3;
    double want = -(2.0 / 3) * log(2.0 / 3) - (1.0 / 3) * log(1.0 / 3);
    ck_assert_double_eq_tol(gpt_unigram_entropy(&c), want, 1e-12);
    c.train = abcd;
    c.n_train = 8;
    ck_assert_double_eq_tol(gpt_unigram_entropy(&c), log(4.0), 1e-12);
    c.train = one;
    c.n_train = 4;
    ck_assert_double_eq_tol(gpt_unigram_entropy(&c), 0.0, 1e-15);
}
END_TEST

START_TEST(bad_corpus_files)
{
    char path[64], err[256];
    gpt_corpus c;
    err[0] = 0;
    ck_assert_int_eq(gpt_corpus_load("/nonexistent/corpus.txt", &c, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "/nonexistent/corpus.txt") && strstr(err, "No such file"), "%s",
                  err);
    ck_assert_ptr_null(c.train);
    gpt_corpus_free(&c);
    ck_assert_int_eq(gpt_corpus_load("/nonexistent/corpus.txt", &c, NULL, 0), -1);
    write_temp(path, sizeof path, "", 0);
    ck_assert_int_eq(gpt_corpus_load(path, &c, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "empty") != NULL, "%s", err);
    unlink(path);
    write_temp(path, sizeof path, "one fortune, no separator\n", 26);
    ck_assert_int_eq(gpt_corpus_load(path, &c, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "split") != NULL, "%s", err);
    ck_assert_ptr_null(c.train);
    unlink(path);
    ck_assert_int_eq(gpt_corpus_load("/tmp", &c, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "/tmp") != NULL, "%s", err);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("gpt");
    TCase *model = tcase_create("model");
    tcase_set_timeout(model, 900);
    tcase_add_test(model, layout_is_contiguous);
    tcase_add_test(model, init_is_deterministic_and_gpt2_like);
    tcase_add_test(model, gradients_match_finite_differences);
    tcase_add_test(model, gradients_match_on_ragged_sizes);
    tcase_add_test(model, float_agrees_with_double);
    tcase_add_test(model, future_tokens_do_not_leak);
    tcase_add_test(model, adam_learns_a_pattern_that_needs_attention);
    tcase_add_test(model, bad_model_arguments);
    suite_add_tcase(s, model);
    TCase *data = tcase_create("data");
    tcase_add_test(data, corpus_vocab_and_split);
    tcase_add_test(data, batches_are_shifted_windows);
    tcase_add_test(data, unigram_entropy_by_hand);
    tcase_add_test(data, bad_corpus_files);
    suite_add_tcase(s, data);
    return check_run(s);
}
