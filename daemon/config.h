/* config.h - scaped's configuration (docs/configuration.md).
 *
 * Every key is declared once, in config.c's key table, with its type, bounds,
 * default and doc.  A key can be set, in rising precedence, by its default,
 * the YAML file, its SCAPE_<KEY> environment variable and a command-line flag
 * (the daemon applies them in that order).  Errors leave a message in
 * scape_last_error() that names where the value came from and the key, e.g.
 * "scaped.yaml:3:6: key 'rho': 1.5 is out of range (0, 1]"; a failed call
 * leaves the configuration as it was.
 */
#ifndef SCAPE_CONFIG_H
#define SCAPE_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "engine.h"
#include "log.h"

typedef enum comm_backend {
    COMM_BACKEND_HOST = 0, /* ZeroMQ over TCP between daemons, host memory */
    COMM_BACKEND_NCCL,     /* NCCL on the daemon's GPU */
    COMM_BACKEND_COUNT
} comm_backend;

const char *comm_backend_name(comm_backend b);
scape_rc comm_backend_parse(const char *s, comm_backend *out);

/* The executor key: a choice of eng_executor, or auto. */
typedef enum cfg_executor {
    CFG_EXEC_AUTO = 0, /* cuda when this build has CUDA and a GPU is visible, else host */
    CFG_EXEC_HOST,
    CFG_EXEC_CUDA,
    CFG_EXEC_SIM,
    CFG_EXEC_COUNT
} cfg_executor;

const char *cfg_executor_name(cfg_executor x);

/* The auth key: how the job's daemons prove who they are (auth.h). */
typedef enum cfg_auth {
    CFG_AUTH_AUTO = 0, /* munge when a munged answers, else a start-up error */
    CFG_AUTH_MUNGE,
    CFG_AUTH_SECRET,
    CFG_AUTH_NONE,
    CFG_AUTH_COUNT
} cfg_auth;

const char *cfg_auth_name(cfg_auth a);

typedef struct scaped_config {
    char runtime_dir[256];      /* "" = default (resolved later by the daemon) */
    log_level log_level;        /* default info */
    eng_config engine;          /* optimizer, mode, rho, warmup, hyper */
    int max_trainers;           /* 1..64, default 64 */
    uint32_t max_message_bytes; /* 1024..64 MiB, default 1 MiB */
    int liveness_ms;            /* trainer pid check period, 10..60000, default 200 */
    int trainers;               /* wait for this many before step 1; 0..64, default 0 */
    int world;                  /* daemons in the job, 1..4096, default 1 */
    int rank;                   /* this daemon's rank, 0..4095, default 0 */
    char coordinator[256];      /* rank 0's rendezvous endpoint (world > 1) */
    char listen[256];           /* this daemon's data-plane endpoint (world > 1) */
    uint32_t job;               /* job id; daemons of other jobs are refused */
    int comm_timeout_ms;        /* longest wait for another daemon */
    comm_backend backend;       /* host (default) or nccl */
    cfg_auth auth;              /* auto (default), munge, secret or none */
    char auth_key_file[512];    /* auth secret: the job's key (scaped keygen) */
    char munge_socket[256];     /* munged's socket ("" = libmunge's default) */
    int cuda_device;            /* the GPU of the nccl backend and the cuda executor, 0..63 */
    cfg_executor executor;      /* auto (default), host, cuda or sim */
    char checkpoint_dir[512];   /* where checkpoints go; "" = none */
    uint32_t checkpoint_every;  /* take one every this many steps; 0 = on request */
    int checkpoint_keep;        /* complete checkpoints kept, 1..1000, default 2 */
    char resume[512];           /* a checkpoint to restore at the job's start */
    char metrics_listen[256];   /* HTTP /metrics at HOST:PORT ("" or "off": none) */
} scaped_config;

/* The engine's executor for the executor key: auto resolved here (*why
 * says which and why), cuda refused when it cannot run on this machine. */
scape_rc cfg_resolve_executor(const scaped_config *c, eng_executor *out, const char **why);

/* Every key at its default. */
void cfg_defaults(scaped_config *c);
/* Apply the YAML file at path: a mapping of key: value scalars (empty file
 * allowed).  SYSTEM if it cannot be read, INVALID on any bad content. */
scape_rc cfg_load_file(scaped_config *c, const char *path);
/* The same from len bytes of YAML text; name stands for the file in
 * messages.  *c changes only when all of it is valid (so does the file's). */
scape_rc cfg_load_text(scaped_config *c, const char *name, const char *text, size_t len);
/* Apply every non-empty SCAPE_<KEY> environment variable (SCAPE_RHO,
 * SCAPE_WEIGHT_DECAY, ...); the only place the daemon reads the environment
 * for configuration. */
scape_rc cfg_apply_env(scaped_config *c);
/* Warn (LOG_WARN) about each SCAPE_* environment variable that is neither a
 * key nor read by another part of SCAPE, naming the nearest known one;
 * returns how many. */
int cfg_warn_env(void);
/* Whether the environment variable name is such an unknown SCAPE_* one; if
 * so, msg (len bytes) says so and names the nearest known variable, if any. */
int cfg_env_unknown(const char *name, char *msg, size_t len);
/* The key nearest to name by edit distance when name looks like a typo of
 * it ("optimiser" -> "optimizer"), else NULL. */
const char *cfg_closest_key(const char *name);
/* A boolean as YAML 1.1 spells it: true, yes, on, y (and 1) or false, no,
 * off, n (and 0), each also Capitalised or UPPER case; *out 1 or 0. */
scape_rc cfg_bool_parse(const char *s, int *out);
/* Set key from its text; origin names the source in messages ("--rho"). */
scape_rc cfg_set(scaped_config *c, const char *key, const char *value, const char *origin);
/* Write c as YAML, one "key: value  # doc" line per key, that cfg_load_file
 * reads back to the same configuration. */
scape_rc cfg_print(const scaped_config *c, FILE *out);
/* A key and its value as cfg_print writes it. */
typedef struct cfg_value {
    const char *key;
    char value[256];
} cfg_value;
#define CFG_STATUS_MAX 48 /* room for every key shown in status */

/* The keys shown in status (the table's CF_STATUS flag), in table order,
 * into out[0..max); returns how many. */
size_t cfg_status_values(const scaped_config *c, cfg_value *out, size_t max);
/* Key i's one-line doc and, in *name, its name; NULL past the last key. */
const char *cfg_key_doc(size_t i, const char **name);

#endif /* SCAPE_CONFIG_H */
