/* gpt.h - a small character-level GPT for single-threaded CPU training.
 *
 * Parameters are float32 in ONE flat buffer; gpt_layout() names the tensors,
 * contiguous, in a fixed order, without gaps, from offset 0:
 *
 *   wte [vocab][d]  wpe [ctx][d]
 *   per layer l (h<l>.):  ln1.w [d]  ln1.b [d]  attn.qkv.w [d][3d]  attn.qkv.b [3d]
 *                         attn.proj.w [d][d]  attn.proj.b [d]  ln2.w [d]  ln2.b [d]
 *                         mlp.fc.w [d][4d]  mlp.fc.b [4d]  mlp.proj.w [4d][d]  mlp.proj.b [d]
 *   lnf.w [d]  lnf.b [d]  head.w [d][vocab]
 *
 * Matrices are row-major [in][out]: y[o] = b[o] + sum_i x[i] * w[i*out + o].
 * The blocks are pre-LN (x += attn(ln1(x)); x += mlp(ln2(x))), attention is
 * causal multi-head, the MLP uses GELU (tanh form), and the output head is its
 * own matrix, not tied to wte, without bias.
 *
 * The same source compiled with -DGPT_DOUBLE gives the gptd_* twin below, in
 * double precision: it exists for the finite-difference gradient check. */
#ifndef SCAPE_GPT_H
#define SCAPE_GPT_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int vocab;  /* token ids are 0 .. vocab-1 */
    int ctx;    /* longest sequence, rows of wpe */
    int d;      /* model width, a multiple of heads */
    int layers;
    int heads;
} gpt_config;

typedef struct {
    char name[48];  /* e.g. "h0.attn.qkv.w" */
    size_t offset;  /* in floats, from the start of the buffer */
    size_t length;  /* in floats */
} gpt_tensor;

typedef struct gpt_work gpt_work;

/* 0 when every field is positive and d is a multiple of heads, else -1. */
int gpt_config_check(const gpt_config *c);

/* Number of floats in the parameter buffer; 0 for an invalid config. */
size_t gpt_num_params(const gpt_config *c);

/* Writes up to max tensors to out and returns how many the model has (out
 * may be NULL to ask); -1 for an invalid config. */
int gpt_layout(const gpt_config *c, gpt_tensor *out, int max);

/* GPT-2-like initialisation, the same for the same seed on every run: weights
 * and embeddings N(0, 0.02), the two projections into the residual stream
 * N(0, 0.02/sqrt(2*layers)), layernorm gains 1, biases 0.  Writes nothing
 * for an invalid config. */
void gpt_init(const gpt_config *c, float *params, uint64_t seed);

/* Activations and scratch for batches of up to B sequences of up to T tokens
 * (T <= ctx); NULL on an invalid argument or out of memory. */
gpt_work *gpt_work_new(const gpt_config *c, int B, int T);
void gpt_work_free(gpt_work *w);

/* While gpt_forward_backward runs backward, fn(ctx, first, count) is called
 * each time the gradients of tensors [first, first + count) (gpt_layout's
 * order) are final: the final layernorm and head, each block from the last,
 * then the embeddings.  fn NULL: none (the default). */
typedef void (*gpt_ready_fn)(void *ctx, int first, int count);
void gpt_work_on_ready(gpt_work *w, gpt_ready_fn fn, void *ctx);

/* Mean cross-entropy (nats) of predicting y from x, both [B][T]; grads (all
 * gpt_num_params floats) is OVERWRITTEN with d(mean loss)/d(params).
 * NaN when B, T or a token id is out of range. */
float gpt_forward_backward(const gpt_config *c, gpt_work *w, const float *params,
                           float *grads, const int *x, const int *y, int B, int T);

/* The same loss, forward only; y may be NULL to only compute the
 * probabilities (then 0 is returned). */
float gpt_loss(const gpt_config *c, gpt_work *w, const float *params, const int *x,
               const int *y, int B, int T);

/* The next-token distributions of the last forward pass: [B][T][vocab],
 * row b*T + t; valid until the next call on w. */
const float *gpt_work_probs(const gpt_work *w);

/* ---- double-precision twin (library gpt_model_f64), for tests only ---- */
typedef struct gptd_work gptd_work;
gptd_work *gptd_work_new(const gpt_config *c, int B, int T);
void gptd_work_free(gptd_work *w);
void gptd_work_on_ready(gptd_work *w, gpt_ready_fn fn, void *ctx);
double gptd_forward_backward(const gpt_config *c, gptd_work *w, const double *params,
                             double *grads, const int *x, const int *y, int B, int T);
double gptd_loss(const gpt_config *c, gptd_work *w, const double *params, const int *x,
                 const int *y, int B, int T);
const double *gptd_work_probs(const gptd_work *w);

#endif
