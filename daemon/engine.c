/* engine.c - one rank's optimizer: creation, the handshake between ranks,
 * the checks around each step (the phases are engine_step.c's, the
 * per-coordinate work the executor's, exec.h).
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <stddef.h>
#include <time.h>

#include "engine_internal.h"

#define ENG_MAX_TRAINERS 1024


#define SEC(id) (1u << ENG_SEC_##id)
#define MASK_SECS (SEC(RESIDUAL) | SEC(MASK_CUR) | SEC(MASK_NEXT))

/* The optimizers (engine.h, eng_opt), in eng_optimizer's order. */
static const eng_opt s_opts[ENG_OPT_COUNT] = {
    { ENG_OPT_SCAPE, "scape", 0, ENG_MASK_LAGGED_M, 0, SEC(M) | SEC(THETA) | MASK_SECS,
      SCAPE_UPD_ADAMS },
    { ENG_OPT_ADAMS, "adams", 0, ENG_MASK_NONE, 0, SEC(M) | SEC(THETA) | SEC(RESIDUAL),
      SCAPE_UPD_ADAMS },
    { ENG_OPT_ADAMW, "adamw", 1, ENG_MASK_NONE, 0,
      SEC(M) | SEC(V) | SEC(THETA) | SEC(RESIDUAL), SCAPE_UPD_ADAMW },
    { ENG_OPT_TOPK_ADAMW, "topk-adamw", 1, ENG_MASK_TOPK_GRAD, 1,
      SEC(M) | SEC(V) | SEC(THETA) | SEC(RESIDUAL), SCAPE_UPD_ADAMW },
};

const eng_opt *eng_opt_get(eng_optimizer opt)
{
    return (unsigned)opt < ENG_OPT_COUNT ? &s_opts[opt] : NULL;
}
const eng_enum eng_mode_names[] = {
    { "replicated", ENG_MODE_REPLICATED }, { "sharded", ENG_MODE_SHARDED }, { NULL, 0 },
};
const eng_enum eng_gather_names[] = {
    { "params", ENG_GATHER_PARAMS }, { "f32", ENG_GATHER_F32 }, { "delta", ENG_GATHER_DELTA },
    { NULL, 0 },
};
const eng_enum eng_clip_norm_names[] = {
    { "sent", ENG_CLIP_SENT }, { "gradient", ENG_CLIP_GRAD }, { NULL, 0 },
};
const eng_enum eng_executor_names[] = {
    { "host", ENG_EXEC_HOST }, { "cuda", ENG_EXEC_CUDA }, { "sim", ENG_EXEC_SIM }, { NULL, 0 },
};
/* Booleans print so; config.c reads every YAML 1.1 spelling of them. */
const eng_enum eng_bool_names[] = { { "false", 0 }, { "true", 1 }, { NULL, 0 } };
const eng_enum eng_wire_names[] = { { "f32", 0 }, { "bf16", 1 }, { NULL, 0 } };

#define EOFF(field) offsetof(eng_config, field)
#define HASHED ENG_KEY_HASH
#define IF_SET (ENG_KEY_HASH | ENG_KEY_HASH_IF_SET)
#define SHOWN ENG_KEY_STATUS

/* The optimizer rows' names, filled once (fill_tables) so that they stay there. */
static eng_enum s_opt_names[ENG_OPT_COUNT + 1];

/* In the order config.c lists them.  seq orders the hashed keys in the hash
 * and the agreed ones in the handshake: that order and the tags are what
 * checkpoints of earlier versions were hashed with, so a new hashed or
 * agreed key takes the next free seq (a hashed one IF_SET). */
static const eng_key s_keys[] = {
    { "optimizer", EOFF(optimizer), ENG_KT_INT, ENG_OPT_SCAPE, HASHED | SHOWN, 1,
      .names = s_opt_names, .doc = "scape, adams, adamw or topk-adamw" },
    { "mode", EOFF(mode), ENG_KT_INT, ENG_MODE_REPLICATED, HASHED | SHOWN, 2,
      .names = eng_mode_names,
      .doc = "replicated (all-reduce) or sharded (reduce-scatter, all-gather)" },
    { "rho", EOFF(rho), ENG_KT_DOUBLE, 0.01, HASHED | SHOWN, 3, .min = 0, .min_open = 1,
      .max = 1, .doc = "density: fraction of each tensor reduced per step" },
    { "warmup", EOFF(warmup), ENG_KT_U32, 1, HASHED | SHOWN, 4, .min = 1, .max = UINT32_MAX,
      .doc = "dense warm-up steps before masking starts" },
    { "beta1", EOFF(hyper.beta1), ENG_KT_FLOAT, 0.9, HASHED | SHOWN, 5, .min = 0, .max = 1,
      .max_open = 1, .doc = "first-moment decay" },
    { "beta2", EOFF(hyper.beta2), ENG_KT_FLOAT, 0.95, HASHED | SHOWN, 6, .min = 0, .max = 1,
      .max_open = 1, .doc = "normaliser decay" },
    { "eps", EOFF(hyper.eps), ENG_KT_FLOAT, 1e-8, HASHED | SHOWN, 7, .min = 0, .min_open = 1,
      .max = HUGE_VAL, .max_open = 1, .doc = "denominator guard" },
    { "weight_decay", EOFF(hyper.wd), ENG_KT_FLOAT, 0, HASHED | SHOWN, 8, .min = 0,
      .max = HUGE_VAL, .max_open = 1, .doc = "decoupled weight decay lambda" },
    { "max_grad_norm", EOFF(max_grad_norm), ENG_KT_FLOAT, 0, IF_SET | SHOWN, 9, .min = 0,
      .max = HUGE_VAL, .max_open = 1,
      .doc = "clip the mean gradient to this global L2 norm before the update (torch's "
             "clip_grad_norm_; 0: no clipping)" },
    { "clip_norm", EOFF(clip_norm), ENG_KT_INT, ENG_CLIP_SENT, IF_SET | SHOWN, 14,
      .hash_tag = "clip_norm=gradient", .hash_gate = "max_grad_norm",
      .names = eng_clip_norm_names,
      .doc = "which norm max_grad_norm bounds: sent (g_hat, the mean of what the daemons "
             "reduced: for scape the error-feedback residual at the mask included) or "
             "gradient (this step's mean gradient, torch's: exact with one daemon, else "
             "bounded above by the daemons' norms); alike on every daemon" },
    /* bf16 values cost no measurable quality (docs/benchmarks.md) */
    { "wire_values", EOFF(wire_bf16), ENG_KT_INT, 1, IF_SET | SHOWN, 10,
      .hash_tag = "wire_values=bf16", .names = eng_wire_names,
      .doc = "masked steps send the reduced values as f32 or bf16 (the rounding stays in the "
             "residual: nothing is lost); alike on every daemon" },
    /* the gather's value size (and, delta, the update's rounding) */
    { "gather_values", EOFF(gather), ENG_KT_INT, ENG_GATHER_PARAMS, ENG_KEY_AGREE | SHOWN, 17,
      .names = eng_gather_names,
      .doc = "sharded: gather the updated parameters in the trainers' dtype (params: bf16 "
             "when every trainer holds bf16, the same bits in half the bytes), in f32, or, "
             "when every trainer holds fp32, as their changes in bf16 (delta: the update is "
             "rounded so; half the gather's bytes); alike on every daemon" },
    { "rho_start", EOFF(rho_start), ENG_KT_DOUBLE, 0, IF_SET | SHOWN, 11, .min = 0, .max = 1,
      .doc = "scape density schedule: the first masked step's density, in (rho, 1], halved "
             "at equal intervals down to rho over rho_steps steps (0: no schedule)" },
    { "rho_steps", EOFF(rho_steps), ENG_KT_U32, 1000, HASHED | SHOWN, 12,
      .hash_gate = "rho_start", .min = 1, .max = UINT32_MAX,
      .doc = "masked steps over which the density schedule reaches rho" },
    { "dense_below", EOFF(dense_below), ENG_KT_U32, 0, IF_SET | SHOWN, 15,
      .hash_tag = "dense_below", .hash_tag_value = 1, .min = 0, .max = UINT32_MAX,
      .doc = "scape, topk-adamw: a tensor of at most this many coordinates (norms, biases) "
             "is sent whole every step, as PowerSGD leaves vectors uncompressed (0: none); "
             "alike on every daemon" },
    { "split_above", EOFF(split_above), ENG_KT_U32, 0, IF_SET | SHOWN, 18,
      .hash_tag = "split_above", .hash_tag_value = 1, .min = 0, .max = UINT32_MAX,
      .doc = "split a tensor longer than this many coordinates into ranges of at most this "
             "many, each with its own owner and top-k, so that no owner's share exceeds the "
             "mean by more than split_above (0: whole tensors); alike on every daemon" },
    { "mask_deltas", EOFF(mask_deltas), ENG_KT_INT, 0, IF_SET | SHOWN, 13,
      .hash_tag = "mask_deltas", .names = eng_bool_names,
      .doc = "scape: send each next mask as its change from the last one when that is "
             "smaller (its size goes first, in one small all-gather); alike on every daemon" },
    { "engine_threads", EOFF(threads), ENG_KT_INT, 1, SHOWN, 0, .min = 1, .max = 256,
      .doc = "threads for the step's data-parallel phases (results do not depend on it)" },
    { "residual_on_device", EOFF(residual_on_device), ENG_KT_INT, 0, 0, 0,
      .names = eng_bool_names,
      .doc = "cuda: keep the residual in GPU memory instead of pinned host memory streamed "
             "through the GPU" },
    { "residual_chunk", EOFF(residual_chunk), ENG_KT_U32, 4u << 20, 0, 0, .min = 32,
      .max = 2147483648.0,
      .doc = "cuda: coordinates of the pinned residual streamed through the GPU at a time" },
    /* the mask all-gather's place among the collectives */
    { "defer_select", EOFF(defer_select), ENG_KT_INT, 1, ENG_KEY_AGREE_LAGGED | SHOWN, 16,
      .names = eng_bool_names,
      .doc = "select the next mask after the trainers have their parameters, behind their "
             "compute (results do not depend on it; alike on every daemon)" },
    { "reduce_chunk", EOFF(reduce_chunk), ENG_KT_U32, 0, ENG_KEY_AGREE | SHOWN, 19, .min = 0,
      .max = UINT32_MAX,
      .doc = "with several daemons, reduce in chunks of about this many coordinates (whole "
             "tensors, the last layers first), each as soon as the trainers posted all of it "
             "(0: one reduction in the step; results do not depend on it; alike on every "
             "daemon)" },
};

#define NKEYS (sizeof s_keys / sizeof s_keys[0])

/* Filled once from the rows (fill_tables): the keys in seq order (s_seq[i]
 * has seq i + 1; s_nseq of them) and the hashed keys' names. */
static const eng_key *s_seq[NKEYS];
static size_t s_nseq;
static char s_hashed[512];
static pthread_once_t s_tables_once = PTHREAD_ONCE_INIT;

/* "a, b and c": the hashed keys but the mode, in table order. */
static void fill_hashed(void)
{
    size_t n = 0, done = 0, used = 0;
    for (size_t i = 0; i < NKEYS; i++)
        n += (s_keys[i].flags & ENG_KEY_HASH) && s_keys[i].offset != EOFF(mode);
    for (size_t i = 0; i < NKEYS && used < sizeof s_hashed; i++) {
        if (!(s_keys[i].flags & ENG_KEY_HASH) || s_keys[i].offset == EOFF(mode))
            continue;
        const char *sep = done == 0 ? "" : done + 1 == n ? " and " : ", ";
        used += (size_t)snprintf(s_hashed + used, sizeof s_hashed - used, "%s%s", sep,
                                 s_keys[i].name);
        done++;
    }
}

static void fill_tables(void)
{
    for (int i = 0; i < ENG_OPT_COUNT; i++)
        s_opt_names[i] = (eng_enum){ s_opts[i].name, (int)s_opts[i].id };
    for (size_t i = 0; i < NKEYS; i++)
        if (s_keys[i].seq >= 1 && s_keys[i].seq <= NKEYS) {
            s_seq[s_keys[i].seq - 1] = &s_keys[i];
            s_nseq = s_keys[i].seq > s_nseq ? s_keys[i].seq : s_nseq;
        }
    fill_hashed();
}

static void tables(void) { (void)pthread_once(&s_tables_once, fill_tables); }

const eng_enum *eng_optimizer_names(void)
{
    tables();
    return s_opt_names;
}

const char *eng_config_hashed(void)
{
    tables();
    return s_hashed;
}

const eng_key *eng_keys(size_t *n)
{
    tables(); /* the optimizer row's names */
    *n = NKEYS;
    return s_keys;
}

const eng_key *eng_key_find(const char *name)
{
    tables();
    for (size_t i = 0; name && i < NKEYS; i++)
        if (strcmp(name, s_keys[i].name) == 0)
            return &s_keys[i];
    return NULL;
}

double eng_key_value(const eng_key *k, const eng_config *c)
{
    const void *f = (const char *)c + k->offset;
    switch (k->type) {
    case ENG_KT_DOUBLE: return *(const double *)f;
    case ENG_KT_FLOAT: return (double)*(const float *)f;
    case ENG_KT_U32: return (double)*(const uint32_t *)f;
    default: return (double)*(const int *)f;
    }
}

static void set_key_value(const eng_key *k, eng_config *c, double v)
{
    void *f = (char *)c + k->offset;
    switch (k->type) {
    case ENG_KT_DOUBLE: *(double *)f = v; break;
    case ENG_KT_FLOAT: *(float *)f = (float)v; break;
    case ENG_KT_U32: *(uint32_t *)f = (uint32_t)v; break;
    default: *(int *)f = (int)v; break;
    }
}

void eng_config_default(eng_config *cfg)
{
    memset(cfg, 0, sizeof *cfg); /* fields added later start at 0 */
    for (size_t i = 0; i < NKEYS; i++)
        set_key_value(&s_keys[i], cfg, s_keys[i].def);
    cfg->intake_chunk = 16384; /* the fields no key sets */
    cfg->executor = ENG_EXEC_HOST;
}

const char *eng_optimizer_name(eng_optimizer opt)
{
    return (unsigned)opt < ENG_OPT_COUNT ? s_opts[opt].name : "?";
}

const char *eng_mode_name(eng_mode mode) { return eng_enum_name(eng_mode_names, (int)mode); }

const char *eng_executor_name(eng_executor x)
{
    return eng_enum_name(eng_executor_names, (int)x);
}

const char *eng_gather_name(eng_gather g) { return eng_enum_name(eng_gather_names, (int)g); }

const char *eng_clip_norm_name(eng_clip_norm c)
{
    return eng_enum_name(eng_clip_norm_names, (int)c);
}

#define PARSE_ENUM(type, names, key)                                           \
    do {                                                                       \
        int i_ = 0;                                                            \
        scape_rc rc_ = eng_enum_parse(names, key, s, &i_);                     \
        if (rc_ == SCAPE_OK)                                                   \
            *out = (type)i_;                                                   \
        return rc_;                                                            \
    } while (0)

scape_rc eng_clip_norm_parse(const char *s, eng_clip_norm *out)
{
    PARSE_ENUM(eng_clip_norm, eng_clip_norm_names, "clip_norm");
}

scape_rc eng_executor_parse(const char *s, eng_executor *out)
{
    PARSE_ENUM(eng_executor, eng_executor_names, "executor");
}

scape_rc eng_optimizer_parse(const char *s, eng_optimizer *out)
{
    PARSE_ENUM(eng_optimizer, eng_optimizer_names(), "optimizer");
}

scape_rc eng_mode_parse(const char *s, eng_mode *out)
{
    PARSE_ENUM(eng_mode, eng_mode_names, "mode");
}

/* ---- creation ----------------------------------------------------------- */

static scape_rc check_config(const eng_config *c)
{
    if ((unsigned)c->optimizer >= ENG_OPT_COUNT)
        return scape_set_error(SCAPE_INVALID, "config: unknown optimizer %d", (int)c->optimizer);
    if ((unsigned)c->mode >= ENG_MODE_COUNT)
        return scape_set_error(SCAPE_INVALID, "config: unknown mode %d", (int)c->mode);
    if (!(c->rho > 0.0 && c->rho <= 1.0))
        return scape_set_error(SCAPE_INVALID, "config: rho=%g must be in (0, 1]", c->rho);
    if (c->warmup < 1)
        return scape_set_error(SCAPE_INVALID, "config: warmup must be >= 1");
    if (c->intake_chunk < 32 || c->intake_chunk % 32)
        return scape_set_error(SCAPE_INVALID,
                               "config: intake_chunk=%zu must be a positive multiple of 32",
                               c->intake_chunk);
    if (c->threads < 1 || c->threads > POOL_MAX_THREADS)
        return scape_set_error(SCAPE_INVALID, "config: threads=%d must be in [1, %d]",
                               c->threads, POOL_MAX_THREADS);
    if ((unsigned)c->gather >= ENG_GATHER_COUNT)
        return scape_set_error(SCAPE_INVALID, "config: unknown gather_values %d", (int)c->gather);
    if ((unsigned)c->executor >= ENG_EXEC_COUNT)
        return scape_set_error(SCAPE_INVALID, "config: unknown executor %d", (int)c->executor);
    if (c->residual_chunk < 32)
        return scape_set_error(SCAPE_INVALID, "config: residual_chunk=%u must be >= 32",
                               (unsigned)c->residual_chunk);
    const kern_hyper *h = &c->hyper;
    if (!(h->beta1 >= 0.0f && h->beta1 < 1.0f) || !(h->beta2 >= 0.0f && h->beta2 < 1.0f))
        return scape_set_error(SCAPE_INVALID, "config: beta1=%g beta2=%g must be in [0, 1)",
                               (double)h->beta1, (double)h->beta2);
    if (!(h->eps > 0.0f) || !(h->wd >= 0.0f) || !isfinite(h->wd))
        return scape_set_error(SCAPE_INVALID, "config: eps=%g must be > 0, wd=%g >= 0",
                               (double)h->eps, (double)h->wd);
    if (!(c->max_grad_norm >= 0.0f) || !isfinite(c->max_grad_norm))
        return scape_set_error(SCAPE_INVALID, "config: max_grad_norm=%g must be >= 0 "
                               "(0: no clipping)", (double)c->max_grad_norm);
    if ((unsigned)c->clip_norm >= ENG_CLIP_COUNT)
        return scape_set_error(SCAPE_INVALID, "config: unknown clip_norm %d",
                               (int)c->clip_norm);
    if (c->rho_start != 0.0 && !(c->rho_start > c->rho && c->rho_start <= 1.0))
        return scape_set_error(SCAPE_INVALID, "config: rho_start=%g must be in (rho, 1] = "
                               "(%g, 1] (0: no density schedule)", c->rho_start, c->rho);
    if (c->rho_start != 0.0 && c->rho_steps < 1)
        return scape_set_error(SCAPE_INVALID, "config: rho_steps must be >= 1 with a density "
                               "schedule");
    return SCAPE_OK;
}

/* A number is set above 0, an integer or enum when not 0. */
static int key_set(const eng_key *k, const eng_config *c)
{
    double v = eng_key_value(k, c);
    return k->type == ENG_KT_DOUBLE || k->type == ENG_KT_FLOAT ? v > 0.0 : v != 0.0;
}

static uint64_t hash_key(uint64_t h, const eng_key *k, const eng_config *c)
{
    const eng_key *gate = k->hash_gate ? eng_key_find(k->hash_gate) : NULL;
    if (((k->flags & ENG_KEY_HASH_IF_SET) && !key_set(k, c)) || (gate && !key_set(gate, c)))
        return h;
    double v = eng_key_value(k, c);
    if (!k->hash_tag)
        return plan_fnv1a(h, &v, sizeof v);
    h = plan_fnv1a(h, k->hash_tag, strlen(k->hash_tag));
    uint64_t u = (uint64_t)v;
    return k->hash_tag_value ? plan_fnv1a(h, &u, sizeof u) : h;
}

uint64_t eng_config_hash(const eng_config *c)
{
    uint64_t h = 0xcbf29ce484222325ull;
    tables();
    for (size_t i = 0; i < s_nseq; i++)
        if (s_seq[i] && (s_seq[i]->flags & ENG_KEY_HASH))
            h = hash_key(h, s_seq[i], c);
    return h;
}

void eng_code_sizes(eng_t *e)
{
    const plan *p = e->p;
    int topk = e->opt->mask == ENG_MASK_TOPK_GRAD;
    /* SCAPE: each rank sends its shard's bits; topk-adamw: every rank all of its own. */
    e->code_total = 0;
    for (int r = 0; r < e->comm->size; r++) {
        const plan_shard *sh = &p->shard[r];
        e->code_bytes[r] = topk ? mcode_bytes(p, 0, p->ntensors)
                                : mcode_bytes(p, sh->first, sh->count);
        if (r == e->rank)
            e->code_off = e->code_total;
        e->code_total += e->code_bytes[r];
    }
}

scape_rc eng_mask_density(eng_t *e, uint64_t t)
{
    if (e->opt->mask != ENG_MASK_LAGGED_M || !(e->cfg.rho_start > 0.0))
        return SCAPE_OK;
    double rho = plan_rho_at(&e->cfg, t);
    if (rho == e->k_rho)
        return SCAPE_OK;
    plan_set_rho(e->p, rho);
    e->k_rho = rho;
    eng_code_sizes(e);
    if (e->p->k_total > e->a.k_cap || e->code_total > e->a.code_cap)
        return scape_set_error(SCAPE_INVALID, "engine: step %llu's density %g needs more "
                               "than the buffers hold", (unsigned long long)t, rho);
    return e->x->ops->replan(e->x);
}

/* The sizes the plan gives this rank, the small host arrays, and the
 * executor with every vector. */
static scape_rc alloc_state(eng_t *e)
{
    const plan *p = e->p;
    size_t n = p->n, R = (size_t)e->comm->size;
    const plan_shard *me = &p->shard[e->rank];
    int sharded = e->cfg.mode == ENG_MODE_SHARDED;
    int topk = e->opt->mask == ENG_MASK_TOPK_GRAD;
    int dense_only = e->opt->mask == ENG_MASK_NONE;

    e->a.state_base = sharded ? me->pos0 : 0;
    e->a.state_len = sharded ? me->len : n;
    e->k_target = p->k_total;
    /* with a density schedule the buffers are sized for its densest mask,
     * the first (every k_l and mask code only shrinks from there) */
    if (e->opt->mask == ENG_MASK_LAGGED_M && e->cfg.rho_start > 0.0) {
        e->k_rho = plan_rho_at(&e->cfg, (uint64_t)e->cfg.warmup + 1);
        plan_set_rho(e->p, e->k_rho);
    }
    e->a.k_cap = dense_only ? 1 : topk ? (R * p->k_total < n ? R * p->k_total : n) : p->k_total;
    e->a.toff = calloc(p->ntensors + 1, sizeof(size_t));
    e->counts = calloc(R, sizeof(size_t));
    e->code_bytes = calloc(R, sizeof(size_t));
    e->sq = calloc(2 * R, sizeof(double));
    e->gsq = calloc(ENG_MAX_TRAINERS + 1, sizeof(double));
    if (e->a.toff == NULL || e->counts == NULL || e->code_bytes == NULL || e->sq == NULL ||
        e->gsq == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: cannot allocate state for N=%zu", n);
    eng_code_sizes(e);
    e->a.code_cap = e->code_total;
    e->gcounts = e->code_bytes;
    if (eng_scape_masks(e) && e->cfg.mask_deltas) {
        /* each rank's code gains a word saying which form it takes; dmax
         * is the most the rest can be: the fixed code, or a delta with
         * every k_l at its largest (the schedule's first).  A delta takes
         * each tensor's shortest form, so at most its 2-bit form and its
         * bitmap (len bits) or its position list: k indices of r + 1 <= b
         * bits, and unary parts under 2 (k + 1) bits in all, since their
         * gaps sum to under len and r = floor(log2(mean gap)) */
        e->dcounts = calloc(R, sizeof *e->dcounts);
        e->dsizes = calloc(R, sizeof *e->dsizes);
        e->dmax = calloc(R, sizeof *e->dmax);
        if (e->dcounts == NULL || e->dsizes == NULL || e->dmax == NULL)
            return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
        e->a.code_cap = 0;
        for (size_t r = 0; r < R; r++) {
            const plan_shard *sh = &p->shard[r];
            uint64_t bits = 0;
            for (size_t j = sh->first; j < sh->first + sh->count; j++) {
                const plan_tensor *t = eng_tensor_at(e, j);
                uint64_t b = mcode_pos_bits(t->len), list = t->k * (b + 2) + 2;
                bits += 2 + (list < t->len ? list : t->len);
            }
            size_t delta = 4 * (size_t)((bits + 31) / 32);
            e->dmax[r] = delta > e->code_bytes[r] ? delta : e->code_bytes[r];
            e->a.code_cap += 4 + e->dmax[r];
        }
        if ((e->dhost = malloc(e->a.code_cap)) == NULL)
            return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    }
    TRY(exec_create(&e->a, &e->x));
    e->a.mask_cur = NULL;
    e->a.mask_next = e->a.mask_buf[0];
    return SCAPE_OK;
}

/* The layout's parameter groups: each one's weight decay (NaN: the
 * configured one), every tensor in one of them; groups and their weight
 * decay join the layout hash, which ranks and checkpoints compare. */
static scape_rc set_groups(eng_t *e, const eng_layout *l)
{
    if (l->ngroups > ENG_MAX_GROUPS || (l->ngroups && l->groups == NULL))
        return scape_set_error(SCAPE_INVALID, "layout: %zu parameter groups (at most %d)",
                               l->ngroups, ENG_MAX_GROUPS);
    e->a.ngroups = l->ngroups ? l->ngroups : 1;
    for (size_t g = 0; g < e->a.ngroups; g++) {
        float wd = l->ngroups ? l->groups[g].weight_decay : NAN;
        e->a.gwd[g] = isnan(wd) ? e->cfg.hyper.wd : wd;
        if (!(e->a.gwd[g] >= 0.0f) || !isfinite(e->a.gwd[g]))
            return scape_set_error(SCAPE_INVALID, "layout: parameter group %zu: weight_decay "
                                   "%g must be finite and >= 0", g, (double)e->a.gwd[g]);
    }
    for (size_t i = 0; i < e->p->ntensors; i++)
        if (e->p->t[i].group >= e->a.ngroups)
            return scape_set_error(SCAPE_INVALID, "layout: tensor %s is in parameter group %u "
                                   "of %zu", e->p->t[i].name ? e->p->t[i].name : "-",
                                   (unsigned)e->p->t[i].group, e->a.ngroups);
    if (l->ngroups) {
        uint64_t h = e->p->hash ^ 0x9e3779b97f4a7c15ull * (uint64_t)l->ngroups;
        for (size_t g = 0; g < e->a.ngroups; g++) {
            uint32_t bits;
            memcpy(&bits, &e->a.gwd[g], sizeof bits);
            h = (h ^ bits) * 0x100000001b3ull;
        }
        e->p->hash = h;
    }
    return SCAPE_OK;
}

#define HS_FIXED 4          /* T_r, the layout hash, the config hash, the params' dtype */
#define HS_MAX (HS_FIXED + 8) /* and each ENG_KEY_AGREE* key's value */

/* What this rank sends in the handshake; returns how many words. */
static size_t handshake_words(const eng_t *e, uint64_t *w)
{
    size_t n = 0;
    w[n++] = (uint64_t)e->a.tr;
    w[n++] = e->p->hash;
    w[n++] = eng_config_hash(&e->cfg); /* fills s_seq */
    w[n++] = (uint64_t)e->a.pdt;
    for (size_t i = 0; i < s_nseq && n < HS_MAX; i++)
        if (s_seq[i] && (s_seq[i]->flags & (ENG_KEY_AGREE | ENG_KEY_AGREE_LAGGED)))
            w[n++] = (uint64_t)eng_key_value(s_seq[i], &e->cfg);
    return n;
}

static const char *agree_name(const eng_key *k, uint64_t v, char *buf, size_t len)
{
    if (k->names)
        return eng_enum_name(k->names, v > INT32_MAX ? -1 : (int)v);
    snprintf(buf, len, "%llu", (unsigned long long)v);
    return buf;
}

/* The ENG_KEY_AGREE* keys of rank r (its words a) against this rank's. */
static scape_rc agree_keys(const eng_t *e, int r, const uint64_t *a, const uint64_t *mine)
{
    size_t n = HS_FIXED;
    char theirs[24], ours[24];
    for (size_t i = 0; i < s_nseq && n < HS_MAX; i++) {
        const eng_key *k = s_seq[i];
        if (!k || !(k->flags & (ENG_KEY_AGREE | ENG_KEY_AGREE_LAGGED)))
            continue;
        int applies = (k->flags & ENG_KEY_AGREE) || e->opt->mask == ENG_MASK_LAGGED_M;
        if (a[n] != mine[n] && applies)
            return scape_set_error(SCAPE_INVALID, "engine: rank %d has %s %s and rank %d %s: "
                                   "set it alike on every daemon", r, k->name,
                                   agree_name(k, a[n], theirs, sizeof theirs), e->rank,
                                   agree_name(k, mine[n], ours, sizeof ours));
        n++;
    }
    return SCAPE_OK;
}

/* Exchange T_r, the hashes of config and layout, and the keys flagged
 * ENG_KEY_AGREE* (eng_keys, in seq order); all ranks must agree. */
static scape_rc handshake(eng_t *e)
{
    e->a.t_total = 0;
    int R = e->comm->size;
    uint64_t mine[HS_MAX] = { 0 };
    size_t nw = handshake_words(e, mine);
    uint64_t *all = calloc((size_t)R * nw, sizeof *all);
    if (all == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    for (int r = 0; r < R; r++)
        e->counts[r] = nw * sizeof *mine;
    scape_rc rc = comm_allgather(e->comm, mine, all, e->counts);
    /* the owners gather the updated parameters in the trainers' dtype when
     * every rank's trainers hold bf16, and their changes in bf16 (delta)
     * when every rank's trainers hold fp32 */
    e->vbf16 = e->cfg.gather != ENG_GATHER_F32 && e->a.pdt == KERN_BF16;
    e->vdelta = e->cfg.gather == ENG_GATHER_DELTA && e->a.pdt == KERN_F32;
    for (int r = 0; rc == SCAPE_OK && r < R; r++) {
        const uint64_t *a = all + nw * (size_t)r;
        if (a[3] != (uint64_t)KERN_BF16)
            e->vbf16 = 0;
        if (a[3] != (uint64_t)KERN_F32)
            e->vdelta = 0;
        if (a[0] < 1 || a[0] > ENG_MAX_TRAINERS)
            rc = scape_set_error(SCAPE_INVALID, "engine: rank %d reports %llu trainers (1 to "
                                 "%d)", r, (unsigned long long)a[0], ENG_MAX_TRAINERS);
        else if (a[1] != mine[1])
            rc = scape_set_error(SCAPE_INVALID,
                                 "engine: rank %d registered a different layout than rank %d "
                                 "(tensors, or their parameter groups and weight decay)",
                                 r, e->rank);
        else if (a[2] != mine[2])
            rc = scape_set_error(SCAPE_INVALID,
                                 "engine: rank %d has a different optimizer config than rank %d "
                                 "(mode, or one of %s): set them alike on every daemon",
                                 r, e->rank, eng_config_hashed());
        else if ((rc = agree_keys(e, r, a, mine)) == SCAPE_OK)
            e->a.t_total += (int)a[0];
    }
    free(all);
    return rc;
}

scape_rc eng_create(eng_t **out, const eng_config *cfg, const eng_layout *layout,
                    comm_t *comm, int local_trainers)
{
    if (out == NULL || cfg == NULL || layout == NULL || comm == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_create: NULL argument");
    *out = NULL;
    TRY(check_config(cfg));
    if (local_trainers < 1 || local_trainers > ENG_MAX_TRAINERS)
        return scape_set_error(SCAPE_INVALID, "eng_create: local_trainers=%d not in [1, %d]",
                               local_trainers, ENG_MAX_TRAINERS);
    if ((layout->param_dtype != KERN_F32 && layout->param_dtype != KERN_BF16) ||
        (layout->grad_dtype != KERN_F32 && layout->grad_dtype != KERN_BF16))
        return scape_set_error(SCAPE_INVALID, "eng_create: unknown dtype");
    eng_t *e = calloc(1, sizeof *e);
    if (e == NULL)
        return scape_set_error(SCAPE_NOMEM, "eng_create: out of memory");
    e->cfg = *cfg;
    e->opt = eng_opt_get(cfg->optimizer);
    e->comm = comm;
    e->rank = comm->rank;
    e->a = (exec_args){ .cfg = &e->cfg, .opt = e->opt, .comm = comm, .rank = comm->rank,
                        .pdt = layout->param_dtype, .gdt = layout->grad_dtype,
                        .stats = &e->last, .tr = local_trainers };
    scape_rc rc = plan_build_split(&e->p, layout->tensors, layout->ntensors, comm->size,
                                   cfg->rho, cfg->split_above);
    e->a.p = e->p;
    if (rc == SCAPE_OK)
        plan_set_dense(e->p, cfg->dense_below, cfg->rho);
    if (rc == SCAPE_OK)
        rc = set_groups(e, layout);
    if (rc == SCAPE_OK)
        rc = alloc_state(e);
    if (rc == SCAPE_OK)
        rc = handshake(e);
    if (rc != SCAPE_OK) {
        eng_destroy(&e);
        return rc;
    }
    *out = e;
    return SCAPE_OK;
}

void eng_destroy(eng_t **ep)
{
    if (ep == NULL || *ep == NULL)
        return;
    eng_t *e = *ep;
    if (e->mask_pending && !e->broken)
        comm_iallgather_wait(e->comm);
    exec_destroy(&e->x);
    eng_ckpt_unstage(e);
    plan_destroy(&e->p);
    void *bufs[] = { e->code_bytes, e->a.toff, e->counts, e->ghat, e->ghave, e->bounce,
                     e->mbounce, e->sq, e->gsq, e->a.gn_part, e->a.gn_buf, e->dcounts,
                     e->dsizes, e->dhost, e->dmax, e->early_done, e->early_take,
                     e->early_undo, e->chunk_run, e->chunk_of, e->cstage };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free(bufs[i]);
    free(e);
    *ep = NULL;
}

scape_rc eng_set_local_trainers(eng_t *e, int local_trainers)
{
    if (e == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_set_local_trainers: engine is NULL");
    if (local_trainers < 1 || local_trainers > ENG_MAX_TRAINERS)
        return scape_set_error(SCAPE_INVALID,
                               "eng_set_local_trainers: %d not in [1, %d]", local_trainers,
                               ENG_MAX_TRAINERS);
    TRY(eng_early_undo(e)); /* packed from the old trainers */
    TRY(eng_step_finish(e)); /* it selects with the old T_r */
    e->a.tr = local_trainers;
    return handshake(e);
}

/* ---- parameters in and out --------------------------------------------- */

static scape_rc check_buffers(const eng_t *e, const void *const *bufs, const char *what)
{
    if (bufs == NULL)
        return scape_set_error(SCAPE_INVALID, "engine: %s array is NULL", what);
    for (int j = 0; j < e->a.tr; j++)
        if (bufs[j] == NULL)
            return scape_set_error(SCAPE_INVALID, "engine: %s[%d] is NULL", what, j);
    return SCAPE_OK;
}

scape_rc eng_init_params(eng_t *e, void *const *params)
{
    if (e == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_init_params: engine is NULL");
    if (e->initialised)
        return scape_set_error(SCAPE_INVALID, "eng_init_params: already initialised");
    TRY(check_buffers(e, (const void *const *)params, "params"));
    size_t bytes = e->p->n * kern_dtype_size(e->a.pdt);
    exec_t *x = e->x;
    /* On the host, trainer 0's buffer itself; else through the dense buffer
     * (N floats hold N parameters of either dtype) */
    void *buf = x->host_memory ? params[0] : (void *)e->a.dense;
    if (buf != params[0])
        TRY(x->ops->copy(x, buf, params[0], bytes));
    TRY(eng_broadcast(e, buf, bytes, 0));
    for (int j = 0; j < e->a.tr; j++)
        if (params[j] != buf)
            TRY(x->ops->copy(x, params[j], buf, bytes));
    TRY(x->ops->load_theta(x, buf));
    TRY(x->ops->sync(x));
    if (buf == e->a.e)
        e->a.e_stale = 1; /* it held the parameters: the residual is zero */
    e->initialised = 1;
    return SCAPE_OK;
}

/* An engine that may step: initialised, and no step failed part-way. */
static scape_rc check_ready(const eng_t *e)
{
    if (e->broken)
        return scape_set_error(SCAPE_INVALID,
                               "engine: a previous step failed part-way; state is "
                               "inconsistent and must be restored");
    if (!e->initialised)
        return scape_set_error(SCAPE_INVALID, "engine: eng_init_params was not called");
    return SCAPE_OK;
}

static scape_rc check_step(const eng_t *e, uint64_t t, const float *lrs,
                           const void *const *grads, void *const *params)
{
    TRY(check_ready(e));
    if (t != e->last_step + 1)
        return scape_set_error(SCAPE_INVALID, "engine: step %llu out of order (expected %llu)",
                               (unsigned long long)t, (unsigned long long)e->last_step + 1);
    if (lrs == NULL)
        return scape_set_error(SCAPE_INVALID, "engine: no learning rates");
    for (size_t g = 0; g < e->a.ngroups; g++)
        if (!isfinite(lrs[g]) || lrs[g] < 0.0f)
            return scape_set_error(SCAPE_INVALID, "engine: lr=%g%s must be finite and >= 0",
                                   (double)lrs[g], e->a.ngroups > 1 ? " of a group" : "");
    TRY(check_buffers(e, grads, "grads"));
    TRY(check_buffers(e, (const void *const *)params, "params"));
    size_t pb = e->p->n * kern_dtype_size(e->a.pdt), gb = e->p->n * kern_dtype_size(e->a.gdt);
    for (int a = 0; a < e->a.tr; a++)
        for (int b = 0; b < e->a.tr; b++) {
            const char *pa = params[a], *pbuf = params[b], *gbuf = grads[b];
            if ((a != b && pa < pbuf + pb && pbuf < pa + pb) ||
                (pa < gbuf + gb && gbuf < pa + pb))
                return scape_set_error(SCAPE_INVALID,
                                       "engine: params[%d] overlaps %s[%d]", a,
                                       a != b && pa < pbuf + pb && pbuf < pa + pb ? "params"
                                                                                   : "grads",
                                       b);
        }
    return SCAPE_OK;
}

size_t eng_groups(const eng_t *e) { return e ? e->a.ngroups : 0; }

scape_rc eng_pack_early(eng_t *e, uint64_t t, const void *const *grads,
                        const unsigned char *take, size_t *packed)
{
    if (e == NULL || take == NULL || packed == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_pack_early: NULL argument");
    *packed = 0;
    TRY(check_ready(e));
    if (t != e->last_step + 1)
        return scape_set_error(SCAPE_INVALID, "engine: early pack for step %llu, but the "
                               "next step is %llu", (unsigned long long)t,
                               (unsigned long long)e->last_step + 1);
    TRY(check_buffers(e, grads, "grads"));
    return eng_early_pack(e, t, grads, take, packed);
}

size_t eng_early_kept(const eng_t *e, size_t reg)
{
    size_t n = 0;
    for (size_t j = 0; e && e->chunk_of && j < e->p->ntensors; j++)
        n += (reg == SIZE_MAX || eng_tensor_at(e, j)->parent == reg) &&
             e->chunk_of[j] < e->chunks_done;
    return n;
}

scape_rc eng_pack_early_undo(eng_t *e)
{
    if (e == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_pack_early_undo: engine is NULL");
    return eng_early_undo(e);
}

scape_rc eng_step(eng_t *e, uint64_t t, float lr, const void *const *grads,
                  void *const *params)
{
    float lrs[ENG_MAX_GROUPS];
    for (size_t g = 0; g < ENG_MAX_GROUPS; g++)
        lrs[g] = lr;
    return eng_step_groups(e, t, lrs, grads, params);
}

scape_rc eng_step_groups(eng_t *e, uint64_t t, const float *lrs, const void *const *grads,
                         void *const *params)
{
    if (e == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_step: engine is NULL");
    TRY(check_step(e, t, lrs, grads, params));
    if (e->early_step && e->early_step != t)
        return scape_set_error(SCAPE_INVALID, "engine: step %llu, but the early packs in "
                               "flight are step %llu's", (unsigned long long)t,
                               (unsigned long long)e->early_step);
    memcpy(e->a.glr, lrs, e->a.ngroups * sizeof *lrs);
    TRY(eng_step_finish(e)); /* the caller left the last step's selection */
    eng_ckpt_unstage(e);     /* a checkpoint's host copies are written by now */
    comm_stats before = e->comm->stats;
    memset(&e->last, 0, sizeof e->last);
    memset(e->used_iag, 0, sizeof e->used_iag);
    e->last.early_tensors = e->early_count;
    e->last.early_pack_s = e->early_s;
    e->last.early_chunks = e->chunks_done;
    if (e->early_waited)
        e->last.mask_overlap = e->early_overlap;
    scape_rc rc = eng_step_body(e, t, grads, params);
    comm_stats early = e->chunk_cs; /* the chunks early packs reduced */
    eng_early_clear(e);
    e->kept_norm_ok = 0;
    e->early_waited = 0;
    if (rc != SCAPE_OK) {
        e->broken = 1;
        return rc;
    }
    e->last_step = t;
    e->last.step = t;
    e->last.n = e->p->n;
    e->last.density = (double)e->last.k / (double)e->p->n;
    e->last.comm = early;
    eng_comm_since(&e->last.comm, &e->comm->stats, &before);
    /* the mask all-gather counts to the step whose mask it brought, not to
     * the one that started it (which may be before or after this window) */
    e->last.comm.calls[COMM_IALLGATHER] = e->used_iag[0];
    e->last.comm.bytes[COMM_IALLGATHER] = e->used_iag[1];
    e->last.comm.wire_bytes[COMM_IALLGATHER] = e->used_iag[2];
    return SCAPE_OK;
}

scape_rc eng_step_finish(eng_t *e)
{
    if (e == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_step_finish: engine is NULL");
    if (!e->a.select_pending)
        return SCAPE_OK;
    if (e->broken)
        return scape_set_error(SCAPE_INVALID, "eng_step_finish: the engine is broken");
    scape_rc rc = eng_select_pending(e);
    if (rc != SCAPE_OK)
        e->broken = 1;
    return rc;
}

scape_rc eng_last_stats(const eng_t *e, eng_step_stats *out)
{
    if (e == NULL || out == NULL)
        return scape_set_error(SCAPE_INVALID, "eng_last_stats: NULL argument");
    *out = e->last;
    return SCAPE_OK;
}
