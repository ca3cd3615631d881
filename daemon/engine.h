/* engine.h - one rank's optimizer: the SCAPE step of docs/algorithm.md and the
 * dense/top-k baselines behind the same interface.
 *
 * An engine holds the first moment m, the fp32 master parameters (the whole
 * vector when replicated, its shard when sharded), the error-feedback residual
 * and the packed masks.  It talks to other ranks only through a comm_t.
 * eng_create, eng_init_params and eng_step are collective: every rank of the
 * comm calls them in the same order.  Any failure leaves a message in
 * scape_last_error(); a failure inside a step after a collective has begun
 * marks the engine broken, and later steps are refused.
 */
#ifndef SCAPE_ENGINE_H
#define SCAPE_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "enums.h" /* eng_enum: the names of an enum key's values */
#include "scape_kernels.h"

typedef enum eng_optimizer {
    ENG_OPT_SCAPE = 0,  /* AdamS, lagged partitioned first-moment masks */
    ENG_OPT_ADAMS,      /* dense AdamS */
    ENG_OPT_ADAMW,      /* dense AdamW with bias correction */
    ENG_OPT_TOPK_ADAMW, /* raw-gradient top-k per rank, union mask, AdamW */
    ENG_OPT_COUNT
} eng_optimizer;

typedef enum eng_mode {
    ENG_MODE_REPLICATED = 0, /* all-reduce; every rank keeps all state */
    ENG_MODE_SHARDED,        /* reduce-scatter to owners, all-gather back */
    ENG_MODE_COUNT
} eng_mode;

/* Where the step's per-coordinate work runs (exec.h). */
typedef enum eng_executor {
    ENG_EXEC_HOST = 0, /* CPU kernels on a thread pool, state in host memory */
    ENG_EXEC_CUDA,     /* CUDA kernels, state on the GPU */
    ENG_EXEC_SIM,      /* the cuda executor's orchestration on the CPU (tests) */
    ENG_EXEC_COUNT
} eng_executor;

/* What a masked step publishes (gather_values):
 *  - PARAMS: the new values in the trainers' dtype (bf16 when every rank's
 *    trainers hold bf16, the same bits in half the bytes; else fp32);
 *  - F32: the new values in fp32 always;
 *  - DELTA: when every rank's trainers hold fp32, each value's change in
 *    bf16, which owners and trainers add to the value they hold (the
 *    update is rounded so: docs/algorithm.md, "Changes on the wire"); as
 *    PARAMS otherwise.  Every rank must set it alike. */
/* What max_grad_norm measures (clip_norm; docs/algorithm.md, "Gradient
 * clipping"):
 *  - SENT: the global norm of g_hat, the mean of what the ranks send, which
 *    for the masked optimizers includes the error-feedback residual at the
 *    mask;
 *  - GRAD: the norm of this step's mean gradient (1/T) sum of every
 *    trainer's gradient, without the residual: exact with one rank or on a
 *    dense step, else the bound (1/T) sum_r |G_r|. */
typedef enum eng_clip_norm {
    ENG_CLIP_SENT = 0,
    ENG_CLIP_GRAD,
    ENG_CLIP_COUNT
} eng_clip_norm;

typedef enum eng_gather {
    ENG_GATHER_PARAMS = 0,
    ENG_GATHER_F32,
    ENG_GATHER_DELTA,
    ENG_GATHER_COUNT
} eng_gather;

typedef struct eng_config {
    eng_optimizer optimizer;
    eng_mode mode;
    double rho;       /* density in (0, 1] */
    uint32_t warmup;  /* dense warm-up steps W >= 1 */
    kern_hyper hyper; /* beta1, beta2, eps, weight decay */
    size_t intake_chunk; /* elements of G_r summed at a time when several
                            trainers' (or bf16) gradients are fused into the
                            pack; a multiple of 32 (default 16384) */
    int threads;         /* workers for the data-parallel phases (pack, selection,
                            update, write-back), the calling thread included;
                            1..256, default 1.  Results do not depend on it. */
    int defer_select;    /* SCAPE: a sparse step leaves the selection of the next
                            mask, and the start of its all-gather, to
                            eng_step_finish, so a caller can return the
                            parameters first (default 0).  Results do not depend
                            on it; every rank must set it alike. */
    eng_executor executor; /* host (default), cuda or sim; results do not
                              depend on it, ranks may differ */
    int device;            /* cuda: the CUDA device ordinal (default 0) */
    int residual_on_device; /* cuda/sim: keep the residual in device memory
                               instead of pinned host memory (default 0) */
    uint32_t residual_chunk; /* cuda/sim: about this many coordinates of the
                                residual stream through the GPU at a time
                                (whole mask words; default 4 Mi, >= 32) */
    float max_grad_norm;     /* > 0: scale g_hat so that its global L2 norm is
                                at most this (torch's clip_grad_norm_ rule,
                                docs/design.md); 0: no clipping (default) */
    eng_clip_norm clip_norm; /* which norm max_grad_norm bounds (above).  Every
                                rank must set it alike. */
    int wire_bf16;           /* masked steps (scape, topk-adamw) send the packed
                                values as bf16 and keep each one's rounding in
                                the residual (docs/algorithm.md; the default);
                                0: fp32.  Every rank must set it alike. */
    eng_gather gather;       /* how masked steps publish the updated parameters
                                (sharded: what the gather carries; the default,
                                params, and f32 give the same bits) */
    double rho_start;        /* scape's density schedule: 0 (default) none;
                                else in (rho, 1], the density of the first
                                masked step, halved at equal intervals until it
                                reaches rho at masked step rho_steps + 1 */
    uint32_t rho_steps;      /* the schedule's length in masked steps (>= 1) */
    int mask_deltas;         /* scape: an owner sends its next mask as the change
                                from the last one when that is smaller than the
                                code (maskcode.h); the sizes go first, in one
                                all-gather of 8 bytes a rank (default 0; 2, for
                                tests: a delta whenever there is a last mask).
                                Every rank must set it alike. */
    uint32_t dense_below;    /* scape, topk-adamw: a tensor of at most this many
                                coordinates is sent whole on every step
                                (k_l = |L_l|), as PowerSGD leaves vectors
                                uncompressed; 0 (default): none.  Every rank
                                must set it alike. */
    uint32_t split_above;    /* a tensor longer than this many coordinates is
                                split into ranges of at most this many, each
                                with its own owner and top-k (plan.h); 0
                                (default): whole tensors.  Hashed when set. */
    uint32_t reduce_chunk;   /* with several ranks, the reduction in chunks of
                                about this many coordinates (whole tensors, in
                                backward's order), so that early packs start
                                theirs before the step; 0 (default): one
                                reduction.  Results do not depend on it; every
                                rank must set it alike. */
} eng_config;

typedef struct eng_tensor {
    const char *name; /* may be NULL; used in messages */
    size_t offset;    /* first coordinate in the flat vector */
    size_t length;    /* >= 1 */
    uint32_t group;   /* its parameter group, < eng_layout.ngroups (0 without) */
} eng_tensor;

/* Parameter groups (torch's param_groups): per-group hyper-parameters of the
 * update.  Each step gives every group its learning rate (eng_step_groups). */
#define ENG_MAX_GROUPS 16
typedef struct eng_group {
    float weight_decay; /* >= 0; NaN: the configured hyper.wd */
} eng_group;

typedef struct eng_layout {
    const eng_tensor *tensors; /* must tile [0, N) exactly, any order */
    size_t ntensors;
    kern_dtype param_dtype;    /* trainers' parameter buffers */
    kern_dtype grad_dtype;     /* trainers' gradient buffers */
    const eng_group *groups;   /* ngroups of them; NULL and 0: one group, the
                                  configured weight decay */
    size_t ngroups;            /* 0 .. ENG_MAX_GROUPS */
} eng_layout;

/* Seconds spent in each phase of the last step. */
typedef enum eng_phase {
    ENG_PH_INTAKE = 0, /* intra-node gradient reduction */
    ENG_PH_MASK_WAIT,  /* waiting for the lagged mask all-gather */
    ENG_PH_SELECT,     /* statistics and top-k of the next mask */
    ENG_PH_PACK,       /* error-compensated pack */
    ENG_PH_REDUCE,     /* the reduction collective */
    ENG_PH_UPDATE,     /* the optimizer update */
    ENG_PH_GATHER,     /* sharded: all-gather of updated values */
    ENG_PH_WRITEBACK,  /* parameters into the trainers' buffers */
    ENG_PH_COUNT
} eng_phase;

typedef struct eng_step_stats {
    uint64_t step;
    size_t n;             /* coordinates */
    size_t k;             /* values reduced this step (K_t) */
    double density;       /* k / n */
    double mask_churn;    /* fraction of this mask's bits not set in the last one */
    double mask_overlap;  /* of the lagged mask all-gather's life, from its start
                             to its completion, the fraction not spent waiting
                             for it: how much of it hid behind other work */
    uint64_t mask_bytes;  /* payload of the mask all-gather that brought this
                             step's mask (every rank's code, maskcode.h); 0 if
                             none (dense, or the mask came from a checkpoint).
                             comm counts that all-gather here too, not in the
                             step that started it */
    double phase_s[ENG_PH_COUNT];
    double grad_norm;     /* max_grad_norm: the global L2 norm of g_hat before
                             clipping (0 without max_grad_norm) */
    double clip;          /* the factor g_hat was scaled by (1: not clipped) */
    double mean_grad_norm; /* max_grad_norm: the norm torch's clip_grad_norm_
                             would see, that of the mean of every trainer's
                             gradient this step; -1: not measured (the cuda
                             executor with gradients in device memory) */
    int mean_grad_exact;  /* 1: mean_grad_norm is exact (one rank, or a dense
                             step); 0: the bound (1/T) sum_r |G_r| */
    uint64_t launches;    /* kernels the executor launched for this step (its
                             deferred selection included); 0 on the host */
    /* Bytes each phase's work moved, by the executor's byte model of its own
     * kernels (exec.h): through the memory the state lives in (the GPU's
     * for the cuda executor, the host's for the host one), and between host
     * and device (the streamed residual, trainers' buffers in host memory). */
    uint64_t mem_bytes[ENG_PH_COUNT];
    uint64_t link_bytes[ENG_PH_COUNT];
    uint64_t bounce_bytes; /* host copies around collectives the comm cannot run
                              on the executor's memory (cuda executor, host or
                              local backend): there and back */
    comm_stats comm;      /* this step's collectives only */
    size_t early_tensors; /* comm-order tensors packed before the step by
                             eng_pack_early (bucketed hand-over) */
    double early_pack_s;  /* seconds spent in eng_pack_early for this step */
    size_t early_chunks;  /* reduce_chunk: chunks early packs reduced before the
                             step (of chunks, the step's in all) */
    size_t chunks;
} eng_step_stats;

typedef struct eng eng_t;

/* The keys eng_config_hash covers but the mode, which messages name apart
 * (resharding may change it), in table order: "optimizer, rho, ... and
 * mask_deltas".  Made once from the rows flagged ENG_KEY_HASH. */
const char *eng_config_hashed(void);

extern const eng_enum eng_mode_names[], eng_gather_names[], eng_clip_norm_names[],
    eng_executor_names[], eng_bool_names[], eng_wire_names[];
/* The optimizer rows' names (eng_opt.name) as pairs. */
const eng_enum *eng_optimizer_names(void);

/* The engine's configuration keys: one row per eng_config field that a key
 * sets, with everything about it: its default, what the engine does with it,
 * and the bounds and doc by which config.c reads, prints and lists it (its
 * YAML key, --flag and SCAPE_<KEY> variable are its name).  They live here,
 * not in config.c, because the engine (and the tests, tools and fuzzers that
 * create one without config.c) hashes checkpoints, shakes hands and takes
 * defaults from them. */
typedef enum eng_key_type {
    ENG_KT_DOUBLE,
    ENG_KT_FLOAT, /* config.c applies the bounds after rounding to float */
    ENG_KT_U32,
    ENG_KT_INT, /* int, or an enum (names) */
} eng_key_type;

enum {
    ENG_KEY_HASH = 1u << 0,        /* hashed into checkpoints (eng_config_hash) */
    ENG_KEY_HASH_IF_SET = 1u << 1, /* ... only when set (> 0), so that a configuration
                                      without it hashes as before the key existed */
    ENG_KEY_AGREE = 1u << 2,       /* not hashed, yet every rank must set it alike */
    ENG_KEY_AGREE_LAGGED = 1u << 3, /* ... when the optimizer's masks are lagged */
    ENG_KEY_STATUS = 1u << 4,      /* shown in scapectl status (StatusReply.config) */
};

typedef struct eng_key {
    const char *name;      /* the configuration key */
    size_t offset;         /* of the field in eng_config */
    eng_key_type type;
    double def;            /* the default */
    unsigned flags;        /* ENG_KEY_* */
    unsigned seq;          /* hashed and agreed keys: 1, 2, ..., the order of the
                              hash, then of the handshake, as earlier versions had
                              it (a new such key takes the next number); else 0 */
    const char *hash_tag;  /* hashed as this text, not as its value (a double) */
    int hash_tag_value;    /* ... then its value as a uint64 */
    const char *hash_gate; /* hashed only when this key is set as well */
    const eng_enum *names; /* ENG_KT_INT: its names (an enum key), else NULL */
    double min, max;       /* numbers: the values config.c accepts; an integer's
                              min must be >= 0 */
    int min_open, max_open; /* ... the bound itself excluded */
    const char *doc;       /* one line, for --help and --print-config */
} eng_key;

/* The engine's keys, in the order config.c lists them; *n gets their
 * count.  The hash and the handshake take them in seq order. */
const eng_key *eng_keys(size_t *n);
/* The row of the engine key called name, or NULL. */
const eng_key *eng_key_find(const char *name);
/* Key k's field in c, as a double. */
double eng_key_value(const eng_key *k, const eng_config *c);

/* Every key at its default (eng_keys), the rest at docs/algorithm.md's. */
void eng_config_default(eng_config *cfg);
/* Names as used in configuration files ("scape", "topk-adamw", "sharded"...). */
const char *eng_optimizer_name(eng_optimizer opt);
const char *eng_mode_name(eng_mode mode);
const char *eng_executor_name(eng_executor x);
const char *eng_gather_name(eng_gather g);
const char *eng_clip_norm_name(eng_clip_norm c);
scape_rc eng_clip_norm_parse(const char *s, eng_clip_norm *out);
scape_rc eng_executor_parse(const char *s, eng_executor *out);
scape_rc eng_optimizer_parse(const char *s, eng_optimizer *out);
scape_rc eng_mode_parse(const char *s, eng_mode *out);

/* Create this rank's engine (collective).  local_trainers >= 1 is T_r; the
 * ranks exchange T_r, and a hash of config and layout that must agree. */
scape_rc eng_create(eng_t **out, const eng_config *cfg, const eng_layout *layout,
                    comm_t *comm, int local_trainers);
/* Broadcast the parameters of trainer 0 of rank 0 into every trainer's buffer
 * and initialise the master copy from them (collective, before step 1). */
scape_rc eng_init_params(eng_t *e, void *const *params);
/* Step t (t = last step + 1): grads[j] and params[j] are trainer j's buffers
 * of N elements in the layout's dtypes: host memory for the host executor;
 * device memory or pinned (cudaHostRegister'ed) host memory for the cuda
 * executor.  Writes the new parameters into every params[j] and returns once
 * they are there (collective). */
scape_rc eng_step(eng_t *e, uint64_t t, float lr, const void *const *grads,
                  void *const *params);
/* The same with a learning rate per parameter group: lrs[g] for the tensors
 * of group g, max(1, ngroups) of them. */
scape_rc eng_step_groups(eng_t *e, uint64_t t, const float *lrs, const void *const *grads,
                         void *const *params);
/* Bucketed hand-over: before eng_step_groups(e, t, ...), pack now the
 * registered (layout) tensors i with take[i] != 0 (size: the number of
 * registered tensors), from grads: the same trainers' buffers eng_step_groups(t)
 * will get, which keep those tensors' values until then.  Each comm-order
 * tensor (each piece of a split one) is packed once per step;
 * eng_step_groups(t) packs only the rest, and the step's result is bitwise
 * the step without early packs.  Not collective (at most it completes the
 * lagged mask's all-gather, and runs a pending eng_step_finish first, as
 * eng_step does).  *packed: comm-order tensors packed by this call; 0 where
 * the engine leaves everything to the step: an executor without early packs,
 * an optimizer that reads the whole gradient first (eng_opt.intake). */
scape_rc eng_pack_early(eng_t *e, uint64_t t, const void *const *grads,
                        const unsigned char *take, size_t *packed);
/* Undo every early pack of the step in flight: the engine is back to the state
 * after the last completed step (a trainer died or the trainers changed before
 * the step ran).  Nothing to do (SCAPE_OK) when none is in flight.  With
 * reduce_chunk, the tensors of chunks already reduced (collectives every rank
 * takes part in) stay packed and reduced with the gradients they had; the step
 * packs only the rest (eng_early_kept), and a checkpoint still saves the last
 * step's state. */
scape_rc eng_pack_early_undo(eng_t *e);
/* Comm-order pieces of registered tensor reg (SIZE_MAX: of every one) that
 * early packs reduced (reduce_chunk), which an undo keeps. */
size_t eng_early_kept(const eng_t *e, size_t reg);
/* Parameter groups of the layout, 1 without (eng_layout.ngroups or 1). */
size_t eng_groups(const eng_t *e);
/* With cfg.defer_select: select the next mask and start its all-gather,
 * which the last eng_step left pending (collective; nothing to do when none
 * is).  The caller runs it once the parameters are out, so that the
 * selection overlaps the trainers' next forward/backward; eng_step,
 * eng_set_local_trainers and checkpoints run a pending one first.  Its time
 * is added to the last step's select phase. */
scape_rc eng_step_finish(eng_t *e);
/* Change T_r when trainers come or go between steps (collective: the ranks
 * exchange their counts again).  Takes effect from the next step. */
scape_rc eng_set_local_trainers(eng_t *e, int local_trainers);
/* Statistics of the last completed step. */
scape_rc eng_last_stats(const eng_t *e, eng_step_stats *out);
/* max_grad_norm: the L2 norm of local trainer j's own gradient at the last
 * step (grads[j]); -1 when not measured (no max_grad_norm, j out of range,
 * or gradients in device memory). */
double eng_trainer_grad_norm(const eng_t *e, int j);
/* Finish any outstanding mask all-gather and free; sets *e to NULL. */
void eng_destroy(eng_t **e);

/* ---- inspection (tests, status, checkpoints) --------------------------- */

size_t eng_n(const eng_t *e);
/* Bytes of optimizer state and residual this rank holds: m, theta (and v)
 * for its state range (all N when replicated, its shard when sharded), the
 * residual for all N. */
uint64_t eng_state_bytes(const eng_t *e);
/* Bytes of device memory and of pinned host memory the executor holds. */
uint64_t eng_device_bytes(const eng_t *e);
/* The executor's device may still be running work on the trainers' buffers
 * (a wait for it failed): CUDA mappings of them must stay open. */
int eng_device_stuck(const eng_t *e);
uint64_t eng_pinned_bytes(const eng_t *e);
/* 1 when sharded gathers of the updated parameters go in bf16 (every
 * rank's trainers hold bf16, gather_values params). */
int eng_gathers_bf16(const eng_t *e);
/* 1 when masked steps publish changes in bf16 (gather_values: delta, every
 * rank's trainers fp32); then the gathers move 2 bytes a value. */
int eng_gathers_delta(const eng_t *e);
/* The executor that runs the step (host, cuda or sim). */
eng_executor eng_get_executor(const eng_t *e);
/* T, the trainers of all ranks. */
int eng_total_trainers(const eng_t *e);
/* k_l of plan tensor l (layout index; with split_above, of the pieces, a
 * tensor's in a row) and its owning rank. */
size_t eng_tensor_k(const eng_t *e, size_t l);
int eng_tensor_owner(const eng_t *e, size_t l);
/* L2 norm of this rank's residual. */
double eng_residual_norm(const eng_t *e);  /* the last step's, also while early packs run */
/* This rank's residual, coordinate order (N floats). */
scape_rc eng_get_residual(const eng_t *e, float *out);

typedef enum eng_state_vec { ENG_VEC_M = 0, ENG_VEC_V, ENG_VEC_THETA } eng_state_vec;
/* m, v or the master parameters in coordinate order; have[i] = 1 where this
 * rank holds coordinate i (all of them when replicated), else out[i] = 0. */
scape_rc eng_get_state(const eng_t *e, eng_state_vec which, float *out,
                       unsigned char *have);
/* The mask used by the last step, one byte (0/1) per coordinate. */
scape_rc eng_get_mask(const eng_t *e, unsigned char *bits);
/* Keep (on != 0) or stop keeping a copy of every step's g_hat for
 * eng_get_ghat: N floats and N bytes, for tests and debugging. */
scape_rc eng_set_inspect(eng_t *e, int on);
/* The last step's g_hat = S / T at the coordinates this rank reduced (all
 * mask coordinates when replicated, its shard's when sharded); have[i] marks
 * them, elsewhere out[i] = 0.  Needs eng_set_inspect before the step. */
scape_rc eng_get_ghat(const eng_t *e, float *out, unsigned char *have);

/* ---- checkpoints (engine_ckpt.c) ---------------------------------------- */

/* What a checkpoint of one rank records besides its sections. */
typedef struct eng_ckpt_meta {
    uint64_t step;        /* the last completed step */
    uint64_t layout_hash; /* tensors: names, offsets, lengths */
    uint64_t config_hash; /* optimizer, mode, rho, warm-up, hyper-parameters */
    uint32_t rank, world;
    uint32_t optimizer, mode;
    uint64_t n, state_base, state_len;
    uint32_t flags;       /* ENG_CKF_* */
    uint32_t trainers;    /* T, the trainers of all ranks, when it was taken */
} eng_ckpt_meta;

enum {
    ENG_CKF_RESIDUAL_ZERO = 1u << 0, /* the last step was dense: e = 0 */
    ENG_CKF_MASK_CUR = 1u << 1,      /* the last step used a sparse mask */
    ENG_CKF_MASK_NEXT = 1u << 2,     /* the next step's mask is known (SCAPE) */
};

typedef enum eng_ckpt_section {
    ENG_SEC_M = 1,     /* first moment, this rank's state range */
    ENG_SEC_V,         /* second moment (AdamW variants) */
    ENG_SEC_THETA,     /* fp32 master parameters, this rank's state range */
    ENG_SEC_RESIDUAL,  /* e_r, N floats in comm order */
    ENG_SEC_MASK_CUR,  /* the last step's mask, packed words */
    ENG_SEC_MASK_NEXT, /* the next step's mask, packed words */
    ENG_SEC_COUNT
} eng_ckpt_section;

/* Where an optimizer's mask comes from. */
typedef enum eng_mask_src {
    ENG_MASK_NONE = 0,  /* none: every step is dense */
    ENG_MASK_LAGGED_M,  /* SCAPE: each owner's top-k of the first-moment statistic,
                           chosen a step ahead and all-gathered while the step runs */
    ENG_MASK_TOPK_GRAD, /* each rank's top-k of |G_r + e_r| per tensor, chosen each
                           step after the warm-up; the step uses their union */
} eng_mask_src;

/* One optimizer: everything the engine, the executors and the checkpoints
 * branch on.  One row each in engine.c's table; nothing else compares
 * eng_config.optimizer. */
typedef struct eng_opt {
    eng_optimizer id;
    const char *name;     /* as in configuration files */
    int keeps_v;          /* a second moment v beside m and theta */
    eng_mask_src mask;
    int intake;           /* the step sums G_r whole before the pack
                             (exec_ops.intake): its mask is chosen from G_r */
    uint32_t secs;        /* sections its checkpoints may hold (1u << ENG_SEC_*):
                             the residual and the masks only as the flags say */
    int update;           /* the update variant the kernels run, per tensor and
                             segmented: a SCAPE_UPD_* of scape_formula.h */
} eng_opt;

/* The row of `opt`; NULL when there is none. */
const eng_opt *eng_opt_get(eng_optimizer opt);

/* A run of engine memory that a checkpoint holds. */
typedef struct eng_ckpt_sec {
    uint32_t id;   /* eng_ckpt_section */
    void *ptr;     /* into the engine: read it to save, fill it to restore */
    size_t bytes;
} eng_ckpt_sec;

#define ENG_CKPT_MAX_SECS 6

const char *eng_ckpt_section_name(uint32_t id);
/* The sections a rank of this optimizer writes for these flags, in order,
 * with their sizes (ptr NULL): state_len floats for m, v and theta, n for the
 * residual, nwords for each mask.  Returns how many; secs holds
 * ENG_CKPT_MAX_SECS.  Saving, restoring and resharding all check against it. */
int eng_ckpt_layout(eng_optimizer opt, uint32_t flags, size_t state_len, size_t n,
                    size_t nwords, eng_ckpt_sec *secs);
/* Collective: bring the state to rest for a checkpoint after the last step
 * (finishes the lagged mask all-gather, so the next mask is whole), then
 * describe it.  secs must hold ENG_CKPT_MAX_SECS. */
scape_rc eng_ckpt_save(eng_t *e, eng_ckpt_meta *meta, eng_ckpt_sec *secs, int *nsecs);
/* Check that a checkpoint fits this freshly created engine (same layout,
 * config, world size and rank) and list the memory to fill, in the order
 * eng_ckpt_save gave it. */
scape_rc eng_ckpt_load_begin(eng_t *e, const eng_ckpt_meta *meta, eng_ckpt_sec *secs,
                             int *nsecs);
/* After the sections are filled: take up the saved step and masks, and write
 * the master parameters into every trainer's buffer (collective: sharded
 * ranks all-gather their shards).  Replaces eng_init_params. */
scape_rc eng_ckpt_load_finish(eng_t *e, const eng_ckpt_meta *meta, void *const *params);

/* The whole state in coordinate order, for restoring a checkpoint taken by
 * another number of ranks (resharding). */
typedef struct eng_coord_state {
    uint64_t step;                 /* the last completed step */
    uint32_t flags;                /* ENG_CKF_MASK_CUR / ENG_CKF_MASK_NEXT as saved */
    const float *m, *v, *theta;    /* N floats each (v only for the AdamW variants) */
    const float *residual;         /* this rank's residual, N floats; NULL: zero */
    const unsigned char *mask_cur; /* N bytes of 0/1 when the flag says so */
    const unsigned char *mask_next;
} eng_coord_state;

/* Hash of the settings every rank must share and checkpoints record: the
 * keys flagged ENG_KEY_HASH, FNV-1a over each one's value (a double) or tag,
 * in seq order. */
uint64_t eng_config_hash(const eng_config *c);
/* The layout this engine was created with (names borrowed), ntensors entries:
 * with split_above, its pieces as tensors (a plan of them for any R has the
 * owners of a split plan of that R: what resharding rebuilds). */
scape_rc eng_get_layout(const eng_t *e, eng_tensor *out, size_t ntensors);
size_t eng_ntensors(const eng_t *e);
const eng_config *eng_get_config(const eng_t *e);
uint64_t eng_layout_hash(const eng_t *e);
/* Restore a freshly created engine from coordinate-order state: this rank
 * keeps its own range of m, v and theta, takes `residual` as its residual and
 * writes theta into every trainer's buffer (collective, like
 * eng_ckpt_load_finish). */
scape_rc eng_ckpt_load_coords(eng_t *e, const eng_coord_state *st, void *const *params);

#endif /* SCAPE_ENGINE_H */
