/* test_config.c - defaults, the YAML file, SCAPE_* variables, cfg_set and the
 * cfg_print round trip.  Expected values and messages are written from the
 * documented keys and error format (docs/configuration.md); line:column
 * positions were counted by hand in the inputs. */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <stdint.h>
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "exec.h"
#include "check_run.h"
#include "rank_threads.h"

#define NKEYS 45

/* Every key with a valid value other than its default. */
static const struct {
    const char *key, *value;
} s_full[NKEYS] = {
    { "runtime_dir", "/tmp/scape test/run" },
    { "log_level", "debug" },
    { "optimizer", "topk-adamw" },
    { "mode", "sharded" },
    { "rho", "0.05" },
    { "warmup", "100" },
    { "beta1", "0.8" },
    { "beta2", "0.999" },
    { "eps", "1e-06" },
    { "weight_decay", "0.1" },
    { "max_grad_norm", "1.5" },
    { "clip_norm", "gradient" },
    { "wire_values", "f32" },
    { "gather_values", "delta" },
    { "rho_start", "0.25" },
    { "rho_steps", "500" },
    { "dense_below", "256" },
    { "split_above", "4096" },
    { "mask_deltas", "true" },
    { "engine_threads", "6" },
    { "executor", "sim" },
    { "residual_on_device", "true" },
    { "residual_chunk", "65536" },
    { "defer_select", "false" },
    { "reduce_chunk", "65536" },
    { "max_trainers", "8" },
    { "max_message_bytes", "4096" },
    { "liveness_ms", "50" },
    { "trainers", "4" },
    { "world", "3" },
    { "rank", "2" },
    { "coordinator", "tcp://node1:29517" },
    { "listen", "tcp://node3:29602" },
    { "job", "4242" },
    { "comm_timeout_ms", "5000" },
    { "comm_backend", "nccl" },
    { "auth", "secret" },
    { "auth_key_file", "/home/u/.scape/job.key" },
    { "munge_socket", "/run/munge/other.socket" },
    { "cuda_device", "3" },
    { "checkpoint_dir", "/scratch/ck points" },
    { "checkpoint_every", "500" },
    { "checkpoint_keep", "3" },
    { "resume", "/scratch/ck points/step-500" },
    { "metrics_listen", "127.0.0.1:9464" },
};

static void check_full(const scaped_config *c)
{
    ck_assert_str_eq(c->runtime_dir, "/tmp/scape test/run");
    ck_assert_int_eq(c->log_level, LOG_LVL_DEBUG);
    ck_assert_int_eq(c->engine.optimizer, ENG_OPT_TOPK_ADAMW);
    ck_assert_int_eq(c->engine.mode, ENG_MODE_SHARDED);
    ck_assert_double_eq(c->engine.rho, 0.05);
    ck_assert_uint_eq(c->engine.warmup, 100);
    ck_assert_float_eq(c->engine.hyper.beta1, 0.8f);
    ck_assert_float_eq(c->engine.hyper.beta2, 0.999f);
    ck_assert_int_eq(c->engine.defer_select, 0);
    ck_assert_float_eq(c->engine.hyper.eps, 1e-6f);
    ck_assert_float_eq(c->engine.hyper.wd, 0.1f);
    ck_assert_float_eq(c->engine.max_grad_norm, 1.5f);
    ck_assert_int_eq(c->engine.clip_norm, ENG_CLIP_GRAD);
    ck_assert_uint_eq(c->engine.split_above, 4096);
    ck_assert_int_eq(c->engine.threads, 6);
    ck_assert_int_eq(c->executor, CFG_EXEC_SIM);
    ck_assert_int_eq(c->engine.residual_on_device, 1);
    ck_assert_uint_eq(c->engine.residual_chunk, 65536);
    ck_assert_uint_eq(c->engine.reduce_chunk, 65536);
    ck_assert_int_eq(c->max_trainers, 8);
    ck_assert_uint_eq(c->max_message_bytes, 4096);
    ck_assert_int_eq(c->liveness_ms, 50);
    ck_assert_int_eq(c->trainers, 4);
    ck_assert_int_eq(c->world, 3);
    ck_assert_int_eq(c->rank, 2);
    ck_assert_str_eq(c->coordinator, "tcp://node1:29517");
    ck_assert_str_eq(c->listen, "tcp://node3:29602");
    ck_assert_uint_eq(c->job, 4242);
    ck_assert_int_eq(c->comm_timeout_ms, 5000);
    ck_assert_int_eq(c->backend, COMM_BACKEND_NCCL);
    ck_assert_int_eq(c->auth, CFG_AUTH_SECRET);
    ck_assert_str_eq(c->auth_key_file, "/home/u/.scape/job.key");
    ck_assert_str_eq(c->munge_socket, "/run/munge/other.socket");
    ck_assert_int_eq(c->cuda_device, 3);
    ck_assert_str_eq(c->checkpoint_dir, "/scratch/ck points");
    ck_assert_uint_eq(c->checkpoint_every, 500);
    ck_assert_int_eq(c->checkpoint_keep, 3);
    ck_assert_str_eq(c->resume, "/scratch/ck points/step-500");
    ck_assert_str_eq(c->metrics_listen, "127.0.0.1:9464");
}

/* Field by field and exact: the padding of a struct copy is not compared. */
static void check_same(const scaped_config *a, const scaped_config *b)
{
    ck_assert_str_eq(a->runtime_dir, b->runtime_dir);
    ck_assert_int_eq(a->log_level, b->log_level);
    ck_assert_int_eq(a->engine.optimizer, b->engine.optimizer);
    ck_assert_int_eq(a->engine.mode, b->engine.mode);
    ck_assert_double_eq(a->engine.rho, b->engine.rho);
    ck_assert_uint_eq(a->engine.warmup, b->engine.warmup);
    ck_assert_float_eq(a->engine.hyper.beta1, b->engine.hyper.beta1);
    ck_assert_float_eq(a->engine.hyper.beta2, b->engine.hyper.beta2);
    ck_assert_float_eq(a->engine.hyper.eps, b->engine.hyper.eps);
    ck_assert_float_eq(a->engine.hyper.wd, b->engine.hyper.wd);
    ck_assert_int_eq(a->engine.threads, b->engine.threads);
    ck_assert_int_eq(a->max_trainers, b->max_trainers);
    ck_assert_uint_eq(a->max_message_bytes, b->max_message_bytes);
    ck_assert_int_eq(a->liveness_ms, b->liveness_ms);
    ck_assert_int_eq(a->trainers, b->trainers);
    ck_assert_int_eq(a->world, b->world);
    ck_assert_int_eq(a->rank, b->rank);
    ck_assert_str_eq(a->coordinator, b->coordinator);
    ck_assert_str_eq(a->listen, b->listen);
    ck_assert_uint_eq(a->job, b->job);
    ck_assert_int_eq(a->comm_timeout_ms, b->comm_timeout_ms);
    ck_assert_int_eq(a->backend, b->backend);
    ck_assert_int_eq(a->cuda_device, b->cuda_device);
    ck_assert_str_eq(a->checkpoint_dir, b->checkpoint_dir);
    ck_assert_uint_eq(a->checkpoint_every, b->checkpoint_every);
    ck_assert_int_eq(a->checkpoint_keep, b->checkpoint_keep);
    ck_assert_str_eq(a->resume, b->resume);
    ck_assert_str_eq(a->metrics_listen, b->metrics_listen);
}

/* A new temporary file holding text; its name goes into path. */
static void write_temp(char *path, size_t len, const char *text)
{
    snprintf(path, len, "/tmp/test_config_XXXXXX");
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    size_t n = strlen(text);
    ck_assert_int_eq(write(fd, text, n), (ssize_t)n);
    ck_assert_int_eq(close(fd), 0);
}

static void set_full_config(scaped_config *c)
{
    cfg_defaults(c);
    for (int i = 0; i < NKEYS; i++)
        ck_assert_int_eq(cfg_set(c, s_full[i].key, s_full[i].value, "test"), SCAPE_OK);
}

static void env_var(char *buf, size_t len, const char *key)
{
    snprintf(buf, len, "SCAPE_%s", key);
    for (char *p = buf; *p; p++)
        *p = (char)toupper((unsigned char)*p);
}

static void unset_all_env(void)
{
    char var[80];
    for (int i = 0; i < NKEYS; i++) {
        env_var(var, sizeof var, s_full[i].key);
        unsetenv(var);
    }
}

START_TEST(defaults)
{
    scaped_config c;
    memset(&c, 0xab, sizeof c); /* every field must be written */
    cfg_defaults(&c);
    ck_assert_str_eq(c.runtime_dir, "");
    ck_assert_int_eq(c.log_level, LOG_LVL_INFO);
    ck_assert_int_eq(c.engine.optimizer, ENG_OPT_SCAPE);
    ck_assert_int_eq(c.engine.mode, ENG_MODE_REPLICATED);
    ck_assert_double_eq(c.engine.rho, 0.01);
    ck_assert_uint_eq(c.engine.warmup, 1);
    ck_assert_float_eq(c.engine.hyper.beta1, 0.9f);
    ck_assert_float_eq(c.engine.hyper.beta2, 0.95f);
    ck_assert_float_eq(c.engine.hyper.eps, 1e-8f);
    ck_assert_float_eq(c.engine.hyper.wd, 0.0f);
    ck_assert_int_eq(c.max_trainers, 64);
    ck_assert_uint_eq(c.max_message_bytes, 1u << 20);
    ck_assert_int_eq(c.liveness_ms, 200);
    ck_assert_int_eq(c.trainers, 0);

    /* The engine part agrees with the engine's own defaults. */
    eng_config e;
    eng_config_default(&e);
    ck_assert_int_eq(c.engine.optimizer, e.optimizer);
    ck_assert_int_eq(c.engine.mode, e.mode);
    ck_assert_double_eq(c.engine.rho, e.rho);
    ck_assert_uint_eq(c.engine.warmup, e.warmup);
    ck_assert_float_eq(c.engine.hyper.beta1, e.hyper.beta1);
    ck_assert_float_eq(c.engine.hyper.beta2, e.hyper.beta2);
    ck_assert_float_eq(c.engine.hyper.eps, e.hyper.eps);
    ck_assert_float_eq(c.engine.hyper.wd, e.hyper.wd);
}
END_TEST

START_TEST(key_listing)
{
    size_t i;
    const char *name = NULL;
    for (i = 0; cfg_key_doc(i, &name); i++) {
        ck_assert_ptr_nonnull(name);
        ck_assert_str_eq(name, s_full[i].key); /* s_full lists the keys in table order */
        ck_assert_uint_gt(strlen(cfg_key_doc(i, NULL)), 0);
    }
    ck_assert_uint_eq(i, NKEYS);
    name = "untouched";
    ck_assert_ptr_null(cfg_key_doc(NKEYS, &name));
    ck_assert_str_eq(name, "untouched");
}
END_TEST

START_TEST(full_file)
{
    char path[64], text[1024] = "# every key\n";
    for (int i = 0; i < NKEYS; i++) {
        size_t n = strlen(text);
        snprintf(text + n, sizeof text - n, "%s: %s\n", s_full[i].key, s_full[i].value);
    }
    write_temp(path, sizeof path, text);
    scaped_config c;
    cfg_defaults(&c);
    ck_assert_int_eq(cfg_load_file(&c, path), SCAPE_OK);
    check_full(&c);
    unlink(path);
}
END_TEST

START_TEST(other_yaml_forms)
{
    /* Quoted values, a flow mapping, document markers and comments. */
    char path[64];
    write_temp(path, sizeof path,
               "--- # start\n{rho: '0.25', mode: \"sharded\", runtime_dir: 'a: #b'}\n...\n");
    scaped_config c;
    cfg_defaults(&c);
    ck_assert_int_eq(cfg_load_file(&c, path), SCAPE_OK);
    ck_assert_double_eq(c.engine.rho, 0.25);
    ck_assert_int_eq(c.engine.mode, ENG_MODE_SHARDED);
    ck_assert_str_eq(c.runtime_dir, "a: #b");
    ck_assert_uint_eq(c.engine.warmup, 1);
    unlink(path);
}
END_TEST

static const char *const s_empty_files[] = { "", "# only a comment\n\n", "---\n", "--- # x\n...\n" };

START_TEST(empty_files)
{
    char path[64];
    write_temp(path, sizeof path, s_empty_files[_i]);
    scaped_config c, want;
    set_full_config(&c);
    set_full_config(&want);
    ck_assert_int_eq(cfg_load_file(&c, path), SCAPE_OK);
    check_same(&c, &want);
    unlink(path);
}
END_TEST

/* Bad files: the message after the path, positions counted in the text. */
static const struct {
    const char *text, *msg;
} s_bad_files[] = {
    { "rho: 1.5\n", ":1:6: key 'rho': 1.5 is out of range (0, 1]" },
    { "rho: 0.1\nwarmup: 3\nrhoo: 0.2\n", ":3:1: unknown key 'rhoo' (did you mean 'rho'?)" },
    { "weight-decay: 0.1\n", ":1:1: unknown key 'weight-decay' (did you mean 'weight_decay'?)" },
    { "mode: sharded\nfrobnicate: 1\n", ":2:1: unknown key 'frobnicate'" },
    { "rho: 0.1\nwarmup: 2: 3\n",
      ":2:10: YAML error: mapping values are not allowed in this context" },
    { "rho: 0.1\nmode: 'x\n",
      ":3:1: YAML error: found unexpected end of stream (while scanning a quoted scalar)" },
    { "rho: \xff\n", ": YAML error: invalid leading UTF-8 octet at byte 5" },
    { "rho: 0.1\nwarmup: 3\nrho: 0.2\n", ":3:1: duplicate key 'rho' (first on line 1)" },
    { "optimizer:\n  - scape\n", ":2:3: key 'optimizer': expected a scalar, found a sequence" },
    { "mode: {a: b}\n", ":1:7: key 'mode': expected a scalar, found a mapping" },
    { "rho: &a 0.5\neps: *a\n", ":2:6: key 'eps': expected a scalar, found an alias" },
    { "? [a]\n: 1\n", ":1:3: expected a key, found a sequence" },
    { "- rho\n", ":1:1: expected a mapping of key: value pairs, found a sequence" },
    { "just text\n", ":1:1: expected a mapping of key: value pairs, found a scalar" },
    { "rho: 0.1\n---\nrho: 0.2\n", ":2:1: only one YAML document is allowed" },
    { "rho: 0.1x\n", ":1:6: key 'rho': '0.1x' is not a number" },
    { "rho:\n", ":1:5: key 'rho': '' is not a number" },
    { "rho: ' 0.5'\n", ":1:6: key 'rho': ' 0.5' is not a number" },
    { "rho: \"0.5\\x00\"\n", ":1:6: key 'rho': the value contains a NUL character" },
    { "warmup: -3\n", ":1:9: key 'warmup': '-3' is not a non-negative integer" },
    { "max_trainers: 4.5\n", ":1:15: key 'max_trainers': '4.5' is not a non-negative integer" },
    { "liveness_ms: 0x10\n", ":1:14: key 'liveness_ms': '0x10' is not a non-negative integer" },
    { "max_message_bytes: 99999999999999999999999\n",
      ":1:20: key 'max_message_bytes': 99999999999999999999999 is out of range [1024, 67108864]" },
    { "eps: nan\n", ":1:6: key 'eps': 'nan' is not a finite number" },
    { "weight_decay: -inf\n", ":1:15: key 'weight_decay': '-inf' is not a finite number" },
    { "rho: 1e999\n", ":1:6: key 'rho': '1e999' is not a finite number" },
    { "eps: 1e39\n", ":1:6: key 'eps': '1e39' is too large for a float" },
    /* In range as doubles, out of range once rounded to the float kept. */
    { "beta2: 0.99999999999\n", ":1:8: key 'beta2': 0.99999999999 is out of range [0, 1)" },
    { "eps: 1e-50\n", ":1:6: key 'eps': 1e-50 is out of range (0, inf)" },
    { "mode: shard\n", ":1:7: key 'mode': unknown mode 'shard' (replicated, sharded)" },
    { "log_level: loud\n",
      ":1:12: key 'log_level': unknown log_level 'loud' (error, warn, info, debug)" },
};

START_TEST(bad_files)
{
    char path[64], want[256];
    write_temp(path, sizeof path, s_bad_files[_i].text);
    scaped_config c, before;
    cfg_defaults(&c);
    cfg_defaults(&before);
    ck_assert_int_eq(cfg_load_file(&c, path), SCAPE_INVALID);
    snprintf(want, sizeof want, "%s%s", path, s_bad_files[_i].msg);
    ck_assert_str_eq(scape_last_error(), want);
    check_same(&c, &before); /* nothing applied, not even the pairs before the error */
    unlink(path);
}
END_TEST

START_TEST(unreadable_files)
{
    scaped_config c;
    cfg_defaults(&c);
    ck_assert_int_eq(cfg_load_file(&c, "/nonexistent/scaped.yaml"), SCAPE_SYSTEM);
    ck_assert_str_eq(scape_last_error(), "/nonexistent/scaped.yaml: No such file or directory");
    ck_assert_int_eq(cfg_load_file(&c, "/tmp"), SCAPE_SYSTEM);
    ck_assert_str_eq(scape_last_error(), "/tmp: Is a directory");
    ck_assert_int_eq(cfg_load_file(&c, NULL), SCAPE_INVALID);
}
END_TEST

START_TEST(set_every_key)
{
    scaped_config c;
    set_full_config(&c);
    check_full(&c);
}
END_TEST

START_TEST(env_every_key)
{
    char var[80];
    for (int i = 0; i < NKEYS; i++) {
        env_var(var, sizeof var, s_full[i].key);
        setenv(var, s_full[i].value, 1);
    }
    scaped_config c;
    cfg_defaults(&c);
    scape_rc rc = cfg_apply_env(&c);
    unset_all_env();
    ck_assert_int_eq(rc, SCAPE_OK);
    check_full(&c);
}
END_TEST

START_TEST(precedence)
{
    char path[64];
    write_temp(path, sizeof path, "rho: 0.2\nweight_decay: 0.01\nwarmup: 5\n");
    scaped_config c;
    cfg_defaults(&c);
    ck_assert_int_eq(cfg_load_file(&c, path), SCAPE_OK);
    unlink(path);
    setenv("SCAPE_RHO", "0.3", 1);
    setenv("SCAPE_WEIGHT_DECAY", "0.05", 1);
    setenv("SCAPE_RUNTIME_DIR", "/run/scape", 1);
    setenv("SCAPE_WARMUP", "", 1); /* empty counts as unset */
    scape_rc rc = cfg_apply_env(&c);
    unset_all_env();
    ck_assert_int_eq(rc, SCAPE_OK);
    ck_assert_double_eq(c.engine.rho, 0.3);        /* env beats the file */
    ck_assert_float_eq(c.engine.hyper.wd, 0.05f);
    ck_assert_str_eq(c.runtime_dir, "/run/scape");
    ck_assert_uint_eq(c.engine.warmup, 5);         /* the file beats the default */
    ck_assert_float_eq(c.engine.hyper.beta1, 0.9f); /* set by nobody */
    ck_assert_int_eq(cfg_set(&c, "rho", "0.4", "--rho"), SCAPE_OK);
    ck_assert_double_eq(c.engine.rho, 0.4);        /* the command line beats env */
}
END_TEST

START_TEST(env_error)
{
    scaped_config c, before;
    cfg_defaults(&c);
    cfg_defaults(&before);
    setenv("SCAPE_RHO", "0.5", 1); /* valid, and applied before beta1 in key order */
    setenv("SCAPE_BETA1", "1", 1);
    scape_rc rc = cfg_apply_env(&c);
    unset_all_env();
    ck_assert_int_eq(rc, SCAPE_INVALID);
    ck_assert_str_eq(scape_last_error(), "SCAPE_BETA1: key 'beta1': 1 is out of range [0, 1)");
    check_same(&c, &before);
}
END_TEST

static const struct {
    const char *key, *value, *origin, *msg;
} s_bad_sets[] = {
    { "rho", "0", "--rho", "--rho: key 'rho': 0 is out of range (0, 1]" },
    { "rho", "1.0000000000000002", "--rho",
      "--rho: key 'rho': 1.0000000000000002 is out of range (0, 1]" },
    { "warmup", "0", "--warmup", "--warmup: key 'warmup': 0 is out of range [1, 4294967295]" },
    { "warmup", "4294967296", "--warmup",
      "--warmup: key 'warmup': 4294967296 is out of range [1, 4294967295]" },
    { "beta1", "-0.1", "--beta1", "--beta1: key 'beta1': -0.1 is out of range [0, 1)" },
    { "beta2", "1", "--beta2", "--beta2: key 'beta2': 1 is out of range [0, 1)" },
    { "eps", "0", "--eps", "--eps: key 'eps': 0 is out of range (0, inf)" },
    { "weight_decay", "-1e-9", "--weight-decay",
      "--weight-decay: key 'weight_decay': -1e-9 is out of range [0, inf)" },
    { "max_trainers", "0", "--max-trainers",
      "--max-trainers: key 'max_trainers': 0 is out of range [1, 64]" },
    { "max_trainers", "65", "--max-trainers",
      "--max-trainers: key 'max_trainers': 65 is out of range [1, 64]" },
    { "max_message_bytes", "1023", "-m",
      "-m: key 'max_message_bytes': 1023 is out of range [1024, 67108864]" },
    { "max_message_bytes", "67108865", "-m",
      "-m: key 'max_message_bytes': 67108865 is out of range [1024, 67108864]" },
    { "liveness_ms", "9", "x", "x: key 'liveness_ms': 9 is out of range [10, 60000]" },
    { "liveness_ms", "60001", "x", "x: key 'liveness_ms': 60001 is out of range [10, 60000]" },
    { "trainers", "-1", "x", "x: key 'trainers': '-1' is not a non-negative integer" },
    { "trainers", "65", "x", "x: key 'trainers': 65 is out of range [0, 64]" },
    { "optimizer", "sgd", "--optimizer",
      "--optimizer: key 'optimizer': unknown optimizer 'sgd' (scape, adams, adamw, topk-adamw)" },
    { "optimiser", "adamw", "--optimiser",
      "--optimiser: unknown key 'optimiser' (did you mean 'optimizer'?)" },
    { "frobnicate", "1", "--frobnicate", "--frobnicate: unknown key 'frobnicate'" },
};

START_TEST(bad_sets)
{
    scaped_config c, before;
    cfg_defaults(&c);
    cfg_defaults(&before);
    ck_assert_int_eq(cfg_set(&c, s_bad_sets[_i].key, s_bad_sets[_i].value, s_bad_sets[_i].origin),
                     SCAPE_INVALID);
    ck_assert_str_eq(scape_last_error(), s_bad_sets[_i].msg);
    check_same(&c, &before);
}
END_TEST

START_TEST(bounds_inclusive)
{
    scaped_config c;
    cfg_defaults(&c);
    const char *ok[][2] = { { "rho", "1" },          { "warmup", "4294967295" },
                            { "beta1", "0" },        { "weight_decay", "0" },
                            { "max_trainers", "1" }, { "max_message_bytes", "67108864" },
                            { "max_message_bytes", "1024" }, { "liveness_ms", "10" },
                            { "liveness_ms", "60000" }, { "trainers", "64" },
                            { "eps", "1e-45" } /* the least float above 0 */ };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        ck_assert_msg(cfg_set(&c, ok[i][0], ok[i][1], "t") == SCAPE_OK, "%s=%s: %s", ok[i][0],
                      ok[i][1], scape_last_error());
    ck_assert_uint_eq(c.engine.warmup, 4294967295u);
    ck_assert_uint_eq(c.max_message_bytes, 1024);
    ck_assert_float_gt(c.engine.hyper.eps, 0.0f);
}
END_TEST

START_TEST(runtime_dir_length)
{
    char dir[300];
    scaped_config c;
    cfg_defaults(&c);
    memset(dir, 'a', 255);
    dir[255] = '\0';
    ck_assert_int_eq(cfg_set(&c, "runtime_dir", dir, "--runtime-dir"), SCAPE_OK);
    ck_assert_str_eq(c.runtime_dir, dir);
    dir[255] = 'a';
    dir[256] = '\0';
    ck_assert_int_eq(cfg_set(&c, "runtime_dir", dir, "--runtime-dir"), SCAPE_INVALID);
    ck_assert_str_eq(scape_last_error(),
                     "--runtime-dir: key 'runtime_dir': value is 256 bytes long, at most 255 allowed");
    dir[255] = '\0';
    ck_assert_str_eq(c.runtime_dir, dir);
}
END_TEST

/* Print a, load the text over b (which differs from a in every key), compare. */
static void round_trip(const scaped_config *a, scaped_config *b)
{
    char path[64];
    write_temp(path, sizeof path, "");
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(cfg_print(a, f), SCAPE_OK);
    ck_assert_int_eq(fclose(f), 0);
    ck_assert_msg(cfg_load_file(b, path) == SCAPE_OK, "%s", scape_last_error());
    check_same(a, b);
    unlink(path);
}

START_TEST(print_round_trip)
{
    scaped_config a, b;
    cfg_defaults(&a);
    const char *odd[][2] = {
        { "runtime_dir", "/tmp/a \"b\" \\c: #d\te\x01\x7f caf\xc3\xa9 'q'" },
        { "log_level", "error" },   { "optimizer", "adams" }, { "mode", "sharded" },
        { "rho", "0.30000000000000004" }, /* not 0.3: every digit counts */
        { "warmup", "4294967295" }, { "beta1", "0.1" },       { "beta2", "0.3" },
        { "eps", "1.2345678e-7" },  { "weight_decay", "3.4e38" },
        { "max_trainers", "63" },   { "max_message_bytes", "67108863" },
        { "liveness_ms", "11" },    { "trainers", "63" },
    };
    for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++)
        ck_assert_int_eq(cfg_set(&a, odd[i][0], odd[i][1], "t"), SCAPE_OK);
    ck_assert_double_ne(a.engine.rho, 0.3);
    set_full_config(&b);
    round_trip(&a, &b);

    cfg_defaults(&a);
    set_full_config(&b);
    round_trip(&a, &b);
}
END_TEST

START_TEST(print_format)
{
    /* Defaults print as documented, one "key: value  # doc" line per key. */
    const char *want[NKEYS] = {
        "runtime_dir: \"\"",  "log_level: info",       "optimizer: scape",
        "mode: replicated",   "rho: 0.01",             "warmup: 1",
        "beta1: 0.9",         "beta2: 0.95",           "eps: 1e-08",
        "weight_decay: 0",    "max_grad_norm: 0",      "clip_norm: sent",
        "wire_values: bf16",
        "gather_values: params", "rho_start: 0",       "rho_steps: 1000",
        "dense_below: 0",     "split_above: 0",        "mask_deltas: false",
        "engine_threads: 1",
        "executor: auto",
        "residual_on_device: false",                   "residual_chunk: 4194304",
        "defer_select: true", "reduce_chunk: 0",
        "max_trainers: 64",
        "max_message_bytes: 1048576",
        "liveness_ms: 200",   "trainers: 0",           "world: 1",
        "rank: 0",            "coordinator: \"\"",       "listen: \"\"",
        "job: 0",             "comm_timeout_ms: 300000", "comm_backend: host",
        "auth: auto",         "auth_key_file: \"\"",     "munge_socket: \"\"",
        "cuda_device: 0",
        "checkpoint_dir: \"\"", "checkpoint_every: 0",    "checkpoint_keep: 2",
        "resume: \"\"",        "metrics_listen: \"\"",
    };
    scaped_config c;
    cfg_defaults(&c);
    FILE *f = tmpfile();
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(cfg_print(&c, f), SCAPE_OK);
    rewind(f);
    char line[512];
    int n = 0;
    for (; fgets(line, sizeof line, f); n++) {
        ck_assert_int_lt(n, NKEYS);
        size_t len = strlen(want[n]);
        ck_assert_msg(strncmp(line, want[n], len) == 0, "line %d: %s", n, line);
        const char *rest = line + len, *doc = cfg_key_doc((size_t)n, NULL);
        size_t pad = strspn(rest, " ");
        ck_assert_uint_ge(pad, 2);
        ck_assert_msg(rest[pad] == '#' && rest[pad + 1] == ' ', "line %d: %s", n, line);
        ck_assert_uint_eq(strlen(rest + pad + 2), strlen(doc) + 1); /* the doc, a newline */
        ck_assert_int_eq(strncmp(rest + pad + 2, doc, strlen(doc)), 0);
    }
    ck_assert_int_eq(n, NKEYS);
    fclose(f);
}
END_TEST

START_TEST(print_write_error)
{
    FILE *f = fopen("/dev/full", "w");
    if (!f) {
        fprintf(stderr, "print_write_error: skipped, no /dev/full\n");
        return;
    }
    scaped_config c;
    cfg_defaults(&c);
    ck_assert_int_eq(cfg_print(&c, f), SCAPE_SYSTEM);
    ck_assert_str_eq(scape_last_error(), "cfg_print: No space left on device");
    fclose(f);
}
END_TEST

/* The executor key resolves to the engine's executor: host and sim as
 * given; auto to cuda only where CUDA can run (a reason either way); cuda
 * refused, saying why, where it cannot. */
START_TEST(executor_resolution)
{
    scaped_config c;
    cfg_defaults(&c);
    ck_assert_int_eq(c.executor, CFG_EXEC_AUTO);
    eng_executor x = ENG_EXEC_COUNT;
    const char *why = NULL, *no = NULL;
    int cuda = exec_cuda_available(&no);
    ck_assert_int_eq(cfg_resolve_executor(&c, &x, &why), SCAPE_OK);
    ck_assert_int_eq(x, cuda ? ENG_EXEC_CUDA : ENG_EXEC_HOST);
    ck_assert(why != NULL && why[0] != '\0');
    ck_assert_int_eq(cfg_set(&c, "executor", "host", "test"), SCAPE_OK);
    ck_assert_int_eq(cfg_resolve_executor(&c, &x, &why), SCAPE_OK);
    ck_assert_int_eq(x, ENG_EXEC_HOST);
    ck_assert_int_eq(cfg_set(&c, "executor", "sim", "test"), SCAPE_OK);
    ck_assert_int_eq(cfg_resolve_executor(&c, &x, &why), SCAPE_OK);
    ck_assert_int_eq(x, ENG_EXEC_SIM);
    ck_assert_int_eq(cfg_set(&c, "executor", "cuda", "test"), SCAPE_OK);
    scape_rc rc = cfg_resolve_executor(&c, &x, &why);
    if (cuda) {
        ck_assert_int_eq(rc, SCAPE_OK);
        ck_assert_int_eq(x, ENG_EXEC_CUDA);
    } else {
        ck_assert_int_eq(rc, SCAPE_UNSUPPORTED);
        ck_assert_msg(strstr(scape_last_error(), no) != NULL, "%s", scape_last_error());
    }
    ck_assert_int_eq(cfg_set(&c, "executor", "gpu", "test"), SCAPE_INVALID);
    ck_assert_msg(strstr(scape_last_error(), "auto, host, cuda, sim") != NULL, "%s",
                  scape_last_error());
}
END_TEST

/* Booleans: every YAML 1.1 spelling, each in the three cases YAML allows
 * (made here from the lower-case word), and nothing else. */
START_TEST(bool_spellings)
{
    static const char *const yes[] = { "true", "yes", "on", "y" },
                             *const no[] = { "false", "no", "off", "n" };
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < 4; i++) {
            char forms[3][8];
            const char *w = t ? yes[i] : no[i];
            for (int f = 0; f < 3; f++) {
                for (size_t j = 0; j <= strlen(w); j++)
                    forms[f][j] = (char)(f == 2 || (f == 1 && j == 0) ? toupper(w[j]) : w[j]);
                int v = -1;
                ck_assert_int_eq(cfg_bool_parse(forms[f], &v), SCAPE_OK);
                ck_assert_msg(v == t, "%s gave %d", forms[f], v);
            }
        }
    int v = -1;
    ck_assert_int_eq(cfg_bool_parse("1", &v), SCAPE_OK);
    ck_assert_int_eq(v, 1);
    ck_assert_int_eq(cfg_bool_parse("0", &v), SCAPE_OK);
    ck_assert_int_eq(v, 0);
    static const char *const refused[] = { "tRUE", "TRue", "yES", "oN", "Truee", "", "2",
                                           "nope", "t", "f", "+1", " true", "true ", NULL };
    for (int i = 0; i < (int)(sizeof refused / sizeof refused[0]); i++) {
        v = 7;
        ck_assert_msg(cfg_bool_parse(refused[i], &v) == SCAPE_INVALID, "'%s' was taken",
                      refused[i] ? refused[i] : "NULL");
        ck_assert_int_eq(v, 7);
    }
    ck_assert_msg(strstr(scape_last_error(), "is not a boolean") != NULL, "%s",
                  scape_last_error());
}
END_TEST

/* The same spellings in a file, a flag and the environment. */
START_TEST(bool_everywhere)
{
    static const char text[] = "mask_deltas: True\ndefer_select: OFF\nresidual_on_device: Y\n";
    scaped_config c;
    cfg_defaults(&c);
    ck_assert_int_eq(c.engine.mask_deltas, 0);
    ck_assert_int_eq(c.engine.defer_select, 1);
    ck_assert_int_eq(cfg_load_text(&c, "t.yaml", text, sizeof text - 1), SCAPE_OK);
    ck_assert_int_eq(c.engine.mask_deltas, 1);
    ck_assert_int_eq(c.engine.defer_select, 0);
    ck_assert_int_eq(c.engine.residual_on_device, 1);
    ck_assert_int_eq(cfg_set(&c, "mask_deltas", "No", "--mask-deltas"), SCAPE_OK);
    ck_assert_int_eq(c.engine.mask_deltas, 0);
    setenv("SCAPE_MASK_DELTAS", "YES", 1);
    scape_rc rc = cfg_apply_env(&c);
    unsetenv("SCAPE_MASK_DELTAS");
    ck_assert_int_eq(rc, SCAPE_OK);
    ck_assert_int_eq(c.engine.mask_deltas, 1);
    ck_assert_int_eq(cfg_set(&c, "mask_deltas", "tRUE", "--mask-deltas"), SCAPE_INVALID);
    ck_assert_int_eq(c.engine.mask_deltas, 1);
}
END_TEST

START_TEST(closest_key)
{
    ck_assert_str_eq(cfg_closest_key("warmupp"), "warmup");
    ck_assert_str_eq(cfg_closest_key("optimiser"), "optimizer");
    ck_assert_str_eq(cfg_closest_key("mask_delta"), "mask_deltas");
    ck_assert_str_eq(cfg_closest_key("comm_timeout"), "comm_timeout_ms");
    ck_assert_str_eq(cfg_closest_key("rank"), "rank");
    ck_assert_ptr_null(cfg_closest_key("frobnicate"));
    ck_assert_ptr_null(cfg_closest_key(""));
    ck_assert_ptr_null(cfg_closest_key(NULL));
}
END_TEST

/* Unknown SCAPE_* variables name the nearest known one; keys, the variables
 * the other parts of SCAPE read and other names are not unknown. */
START_TEST(env_unknown)
{
    static const char *const known[] = { "SCAPE_WARMUP", "SCAPE_MASK_DELTAS", "SCAPE_INDEX",
                                         "SCAPE_DAEMON_LOST_MS", "SCAPE_START_WAIT_MS",
                                         "SCAPE_BUILD_DIR", "SCAPE_PYTHON_ENV", "SCAPE_ARGS",
                                         "SCAPE_ENDPOINT", "SCAPE_FUZZ_LOG", "SCAPE_SLURM_NET",
                                         "HOME", "SCAPEX", "" };
    char msg[512];
    for (int i = 0; i < (int)(sizeof known / sizeof known[0]); i++)
        ck_assert_msg(!cfg_env_unknown(known[i], msg, sizeof msg), "%s warned", known[i]);
    static const struct {
        const char *name, *hint;
    } unknown[] = {
        { "SCAPE_WARMUPP", "(did you mean SCAPE_WARMUP?)" },
        { "SCAPE_warmup", "(did you mean SCAPE_WARMUP?)" },
        { "SCAPE_MASK_DELTA", "(did you mean SCAPE_MASK_DELTAS?)" },
        { "SCAPE_INDX", "(did you mean SCAPE_INDEX?)" },
        { "SCAPE_FROBNICATE", "(SCAPE_<KEY> sets a key; scaped --help lists them)" },
    };
    for (int i = 0; i < (int)(sizeof unknown / sizeof unknown[0]); i++) {
        char want[256];
        snprintf(want, sizeof want, "unknown environment variable %s, ignored %s",
                 unknown[i].name, unknown[i].hint);
        ck_assert_int_eq(cfg_env_unknown(unknown[i].name, msg, sizeof msg), 1);
        ck_assert_str_eq(msg, want);
    }
}
END_TEST

/* cfg_warn_env: one warning line per unknown variable of the environment. */
START_TEST(env_warnings)
{
    FILE *f = tmpfile();
    ck_assert_ptr_nonnull(f);
    log_init(0, LOG_LVL_INFO, f);
    setenv("SCAPE_WARMUPP", "3", 1);
    setenv("SCAPE_INDEX", "1", 1);
    int n = cfg_warn_env();
    unsetenv("SCAPE_WARMUPP");
    unsetenv("SCAPE_INDEX");
    ck_assert_int_eq(fflush(f), 0);
    rewind(f);
    static char text[8192];
    text[fread(text, 1, sizeof text - 1, f)] = '\0';
    fclose(f);
    log_init(0, LOG_LVL_INFO, NULL);
    int lines = 0;
    for (const char *p = text; (p = strstr(p, " WARN  config: ")) != NULL; p++)
        lines++;
    ck_assert_int_ge(n, 1);
    ck_assert_int_eq(lines, n);
    ck_assert_msg(strstr(text, "unknown environment variable SCAPE_WARMUPP, ignored (did you "
                               "mean SCAPE_WARMUP?)\n") != NULL, "%s", text);
    ck_assert_msg(strstr(text, "SCAPE_INDEX") == NULL, "%s", text);
}
END_TEST

/* ---- the flags: hash, handshake, status, one default --------------------- */

/* eng_config_hash as it was written by hand before the key table drove it
 * (commit 5e4a43f), frozen: every configuration must hash as it did, or
 * older checkpoints would be refused. */
static uint64_t fnv(uint64_t h, const void *data, size_t len)
{
    const unsigned char *b = data;
    for (size_t i = 0; i < len; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static uint64_t frozen_hash(const eng_config *c)
{
    double f[] = { (double)c->optimizer, (double)c->mode, c->rho, (double)c->warmup,
                   (double)c->hyper.beta1, (double)c->hyper.beta2,
                   (double)c->hyper.eps, (double)c->hyper.wd, (double)c->max_grad_norm };
    size_t nf = sizeof f / sizeof f[0] - (c->max_grad_norm > 0.0f ? 0 : 1);
    uint64_t h = fnv(0xcbf29ce484222325ull, f, nf * sizeof f[0]);
    if (c->wire_bf16)
        h = fnv(h, "wire_values=bf16", 16);
    if (c->rho_start > 0.0) {
        double sch[] = { c->rho_start, (double)c->rho_steps };
        h = fnv(h, sch, sizeof sch);
    }
    if (c->mask_deltas)
        h = fnv(h, "mask_deltas", 11);
    if (c->max_grad_norm > 0.0f && c->clip_norm != ENG_CLIP_SENT)
        h = fnv(h, "clip_norm=gradient", 18);
    if (c->dense_below) {
        uint64_t d = c->dense_below;
        h = fnv(h, "dense_below", 11);
        h = fnv(h, &d, sizeof d);
    }
    if (c->split_above) {
        uint64_t a = c->split_above;
        h = fnv(h, "split_above", 11);
        h = fnv(h, &a, sizeof a);
    }
    return h;
}

static uint64_t s_rng = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void)
{
    s_rng ^= s_rng << 13;
    s_rng ^= s_rng >> 7;
    s_rng ^= s_rng << 17;
    return s_rng;
}

/* One of a few edge values, or a random one. */
static double pick(const double *edges, size_t n, double lo, double hi)
{
    size_t i = (size_t)(rnd() % (2 * n));
    return i < n ? edges[i] : lo + (hi - lo) * (double)(rnd() >> 11) / 9007199254740992.0;
}

static void random_config(eng_config *c)
{
    static const double unit[] = { 0.0, 1e-30, 0.5, 0.999, 1.0 };
    static const double big[] = { 0.0, 1.0, 1000.0, 4294967295.0, 65536.0 };
    eng_config_default(c);
    c->optimizer = (eng_optimizer)(rnd() % ENG_OPT_COUNT);
    c->mode = (eng_mode)(rnd() % ENG_MODE_COUNT);
    c->rho = pick(unit, 5, 0.0, 1.0);
    c->warmup = (uint32_t)pick(big, 5, 1, 1e6);
    c->hyper.beta1 = (float)pick(unit, 5, 0.0, 1.0);
    c->hyper.beta2 = (float)pick(unit, 5, 0.0, 1.0);
    c->hyper.eps = (float)pick(unit, 5, 1e-12, 1e-3);
    c->hyper.wd = (float)pick(unit, 5, 0.0, 0.5);
    c->max_grad_norm = (float)pick(big, 5, 0.0, 10.0);
    c->clip_norm = (eng_clip_norm)(rnd() % ENG_CLIP_COUNT);
    c->wire_bf16 = (int)(rnd() % 2);
    c->gather = (eng_gather)(rnd() % ENG_GATHER_COUNT);
    c->rho_start = rnd() % 2 ? 0.0 : pick(unit, 5, 0.0, 1.0);
    c->rho_steps = (uint32_t)pick(big, 5, 1, 1e5);
    c->mask_deltas = (int)(rnd() % 3); /* 2: the tests' "always a delta" */
    c->dense_below = (uint32_t)pick(big, 5, 0, 1e6);
    c->split_above = rnd() % 2 ? 0 : (uint32_t)pick(big, 5, 0, 1e8);
    c->defer_select = (int)(rnd() % 2);
    c->threads = 1 + (int)(rnd() % 8);
}

START_TEST(hash_as_before)
{
    eng_config c;
    eng_config_default(&c);
    ck_assert_uint_eq(eng_config_hash(&c), frozen_hash(&c));
    scaped_config d;
    cfg_defaults(&d);
    ck_assert_uint_eq(eng_config_hash(&d.engine), frozen_hash(&d.engine));
    /* every key set in s_full (another value than its default) */
    for (size_t i = 0; i < NKEYS; i++)
        ck_assert_int_eq(cfg_set(&d, s_full[i].key, s_full[i].value, "test"), SCAPE_OK);
    ck_assert_uint_eq(eng_config_hash(&d.engine), frozen_hash(&d.engine));
    for (int i = 0; i < 200000; i++) {
        random_config(&c);
        ck_assert_msg(eng_config_hash(&c) == frozen_hash(&c), "configuration %d differs", i);
    }
    /* and what is not hashed changes nothing */
    eng_config a, b;
    eng_config_default(&a);
    b = a;
    b.defer_select = !a.defer_select;
    b.gather = ENG_GATHER_DELTA;
    b.threads = 7;
    b.residual_chunk = 64;
    b.reduce_chunk = 4096;
    b.residual_on_device = 1;
    b.rho_steps = 5; /* without a schedule */
    b.clip_norm = ENG_CLIP_GRAD; /* without clipping */
    ck_assert_uint_eq(eng_config_hash(&a), eng_config_hash(&b));
}
END_TEST

START_TEST(engine_rows_are_keys)
{
    /* Each engine row is a key (config.c's marks place every one), and
     * setting the key sets the field the row names. */
    size_t n = 0;
    const eng_key *k = eng_keys(&n);
    ck_assert_uint_ge(n, 15);
    for (size_t i = 0; i < n; i++) {
        const char *name = NULL;
        size_t j = 0;
        while (cfg_key_doc(j, &name) && strcmp(name, k[i].name) != 0)
            j++;
        ck_assert_msg(cfg_key_doc(j, &name) != NULL, "engine key %s has no row", k[i].name);
        size_t f = 0;
        while (f < NKEYS && strcmp(s_full[f].key, k[i].name) != 0)
            f++;
        ck_assert_uint_lt(f, NKEYS);
        scaped_config c;
        cfg_defaults(&c);
        double before = eng_key_value(&k[i], &c.engine);
        double def = k[i].type == ENG_KT_FLOAT ? (double)(float)k[i].def : k[i].def;
        ck_assert_msg(before == def, "%s: default %g, row %g", k[i].name, before, def);
        ck_assert_int_eq(cfg_set(&c, s_full[f].key, s_full[f].value, "test"), SCAPE_OK);
        ck_assert_msg(eng_key_value(&k[i], &c.engine) != before, "%s: not its field",
                      k[i].name);
    }
    /* one default: the daemon's engine keys are the engine's defaults, the
     * table's defer_select (on) included */
    scaped_config c;
    eng_config e;
    cfg_defaults(&c);
    eng_config_default(&e);
    ck_assert_int_eq(memcmp(&c.engine, &e, sizeof e), 0);
    ck_assert_int_eq(e.defer_select, 1);
}
END_TEST

START_TEST(engine_key_order)
{
    /* seq orders the hash and the handshake as the commit before the rows
     * did (5e4a43f's eng_config_hash and handshake arrays, by hand): the
     * hashed keys, then the agreed ones.  Every hashed or agreed key has a
     * seq, each seq one key, none left out. */
    static const char *const want[] = {
        "optimizer", "mode", "rho", "warmup", "beta1", "beta2", "eps", "weight_decay",
        "max_grad_norm", "wire_values", "rho_start", "rho_steps", "mask_deltas", "clip_norm",
        "dense_below", "defer_select", "gather_values", "split_above", "reduce_chunk",
    };
    enum { NWANT = sizeof want / sizeof want[0] };
    const unsigned agree = ENG_KEY_AGREE | ENG_KEY_AGREE_LAGGED;
    size_t n = 0, with_seq = 0;
    const eng_key *k = eng_keys(&n);
    for (size_t i = 0; i < n; i++) {
        int exchanged = (k[i].flags & (ENG_KEY_HASH | agree)) != 0;
        ck_assert_msg(exchanged == (k[i].seq != 0), "%s: seq %u", k[i].name, k[i].seq);
        ck_assert_msg(k[i].doc && k[i].doc[0], "%s: no doc", k[i].name);
        if (!k[i].seq)
            continue;
        with_seq++;
        ck_assert_uint_le(k[i].seq, NWANT);
        ck_assert_str_eq(k[i].name, want[k[i].seq - 1]);
        ck_assert_int_eq((k[i].flags & agree) != 0, k[i].seq == 16 || k[i].seq == 17 ||
                                                       k[i].seq == 19);
    }
    ck_assert_uint_eq(with_seq, NWANT);
    /* the restore refusals name the hashed keys but the mode, as the
     * hand-typed list they replaced did, now in the keys' listed order (it
     * ended "mask_deltas and dense_below") */
    ck_assert_str_eq(eng_config_hashed(),
                     "optimizer, rho, warmup, beta1, beta2, eps, weight_decay, "
                     "max_grad_norm, clip_norm, wire_values, rho_start, rho_steps, "
                     "dense_below, split_above and mask_deltas");
}
END_TEST

/* The handshake compares the agreed keys: rank 1 sets defer_select off
 * (case 0: refused where the masks are lagged, scape; case 1: accepted for
 * adamw) or gather_values f32 (case 2: refused, whatever the optimizer).
 * Each rank names the key and both values. */
typedef struct agree_case {
    eng_optimizer opt;
    int key; /* 0: defer_select, 1: gather_values */
    const char *says[2]; /* rank 0's and rank 1's message; NULL: accepted */
} agree_case;

static const agree_case s_agree[] = {
    { ENG_OPT_SCAPE, 0,
      { "engine: rank 1 has defer_select false and rank 0 true: set it alike on every daemon",
        "engine: rank 0 has defer_select true and rank 1 false: set it alike on every "
        "daemon" } },
    { ENG_OPT_ADAMW, 0, { NULL, NULL } },
    { ENG_OPT_ADAMW, 1,
      { "engine: rank 1 has gather_values f32 and rank 0 params: set it alike on every "
        "daemon",
        "engine: rank 0 has gather_values params and rank 1 f32: set it alike on every "
        "daemon" } },
};

static scape_rc rank_agree(rank_arg *a)
{
    const agree_case *ac = a->ctx;
    eng_tensor ts[] = { { "a", 0, 48, 0 }, { "b", 48, 16, 0 } };
    eng_layout lay = { ts, 2, KERN_F32, KERN_F32, NULL, 0 };
    eng_config cfg;
    eng_config_default(&cfg);
    cfg.optimizer = ac->opt;
    if (a->rank == 1 && ac->key == 0)
        cfg.defer_select = 0;
    if (a->rank == 1 && ac->key == 1)
        cfg.gather = ENG_GATHER_F32;
    eng_t *e = NULL;
    scape_rc rc = eng_create(&e, &cfg, &lay, a->comm, 1);
    eng_destroy(&e);
    return rc;
}

START_TEST(handshake_agrees)
{
    rank_arg args[2];
    ck_assert_int_eq(run_ranks(2, rank_agree, (void *)&s_agree[_i], args), 0);
    for (int r = 0; r < 2; r++) {
        const char *want = s_agree[_i].says[r];
        ck_assert_msg(args[r].rc == (want ? SCAPE_INVALID : SCAPE_OK), "rank %d: %s", r,
                      args[r].err);
        if (want)
            ck_assert_str_eq(args[r].err, want);
    }
}
END_TEST

START_TEST(enum_lookup)
{
    int v = -1;
    ck_assert_int_eq(eng_enum_parse(eng_gather_names, "gather_values", "delta", &v), SCAPE_OK);
    ck_assert_int_eq(v, ENG_GATHER_DELTA);
    ck_assert_int_eq(eng_enum_parse(eng_gather_names, "gather_values", "bf16", &v),
                     SCAPE_INVALID);
    ck_assert_str_eq(scape_last_error(), "unknown gather_values 'bf16' (params, f32, delta)");
    ck_assert_int_eq(eng_enum_parse(eng_optimizer_names(), "optimizer", "adamw", &v), SCAPE_OK);
    ck_assert_int_eq(v, ENG_OPT_ADAMW);
    ck_assert_str_eq(eng_enum_name(eng_optimizer_names(), ENG_OPT_TOPK_ADAMW), "topk-adamw");
    ck_assert_str_eq(eng_enum_name(eng_mode_names, 7), "?");
    ck_assert_str_eq(comm_backend_name(COMM_BACKEND_NCCL), "nccl");
    ck_assert_str_eq(cfg_auth_name(CFG_AUTH_SECRET), "secret");
    ck_assert_str_eq(cfg_executor_name(CFG_EXEC_SIM), "sim");
    comm_backend b = COMM_BACKEND_HOST;
    ck_assert_int_eq(comm_backend_parse("ib", &b), SCAPE_INVALID);
    ck_assert_str_eq(scape_last_error(), "unknown comm_backend 'ib' (host, nccl)");
}
END_TEST

START_TEST(status_values)
{
    scaped_config c;
    cfg_defaults(&c);
    ck_assert_int_eq(cfg_set(&c, "optimizer", "adamw", "t"), SCAPE_OK);
    ck_assert_int_eq(cfg_set(&c, "beta2", "0.999", "t"), SCAPE_OK);
    ck_assert_int_eq(cfg_set(&c, "mask_deltas", "yes", "t"), SCAPE_OK);
    cfg_value v[CFG_STATUS_MAX];
    size_t n = cfg_status_values(&c, v, CFG_STATUS_MAX);
    ck_assert_uint_lt(n, CFG_STATUS_MAX);
    const char *want[][2] = { { "optimizer", "adamw" }, { "mode", "replicated" },
                              { "rho", "0.01" }, { "beta2", "0.999" },
                              { "mask_deltas", "true" }, { "defer_select", "true" },
                              { "wire_values", "bf16" }, { "comm_backend", "host" },
                              { "world", "1" }, { "checkpoint_keep", "2" } };
    for (size_t w = 0; w < sizeof want / sizeof want[0]; w++) {
        size_t i = 0;
        while (i < n && strcmp(v[i].key, want[w][0]) != 0)
            i++;
        ck_assert_msg(i < n, "%s not shown", want[w][0]);
        ck_assert_str_eq(v[i].value, want[w][1]);
    }
    /* not shown: paths and secrets' files */
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(strcmp(v[i].key, "auth_key_file") && strcmp(v[i].key, "runtime_dir"),
                      "%s shown", v[i].key);
    ck_assert_uint_eq(cfg_status_values(&c, v, 3), 3);
}
END_TEST

/* Checkpoints written by scaped of commit 5e4a43f, the one before the key
 * table drove the hash (tests/unit/fixtures/ckpt-5e4a43f: trainer_c --n 64
 * --steps 3, --checkpoint-every 3, one trainer, these flags): this build
 * opens and restores each one, which checks the recorded config hash. */
static const struct {
    const char *dir;
    const char *flags[16]; /* key, value, ..., NULL */
} s_old_ckpts[] = {
    { "scape-default", { NULL } },
    { "adamw-clip", { "optimizer", "adamw", "max_grad_norm", "1", "clip_norm", "gradient",
                      "wire_values", "f32", "weight_decay", "0.01", NULL } },
    { "scape-schedule", { "rho", "0.1", "rho_start", "0.5", "rho_steps", "2", "mask_deltas",
                          "true", "dense_below", "8", "beta1", "0.8", NULL } },
    { "topk-sharded", { "optimizer", "topk-adamw", "mode", "sharded", "rho", "0.2",
                        "max_grad_norm", "0.5", "eps", "1e-6", NULL } },
    { "adams", { "optimizer", "adams", "warmup", "2", "beta2", "0.99", NULL } },
};

#include "../integration/synth.h"
#include "ckpt.h"

START_TEST(old_checkpoints_restore)
{
    char dir[1024];
    const char *src = __FILE__, *slash = strrchr(src, '/');
    snprintf(dir, sizeof dir, "%.*s/fixtures/ckpt-5e4a43f/%s", slash ? (int)(slash - src) : 1,
             slash ? src : ".", s_old_ckpts[_i].dir);
    scaped_config c;
    cfg_defaults(&c);
    for (const char *const *f = s_old_ckpts[_i].flags; f[0]; f += 2)
        ck_assert_int_eq(cfg_set(&c, f[0], f[1], "test"), SCAPE_OK);
    enum { N = 64 };
    size_t off[SYNTH_MAX_TENSORS], len[SYNTH_MAX_TENSORS];
    char names[SYNTH_MAX_TENSORS][16];
    size_t nt = synth_layout(N, off, len, names);
    eng_tensor ts[SYNTH_MAX_TENSORS];
    for (size_t l = 0; l < nt; l++)
        ts[l] = (eng_tensor){ names[l], off[l], len[l], 0 };
    eng_layout lay = { ts, nt, KERN_F32, KERN_F32, NULL, 0 };
    comm_t *comms[1] = { NULL };
    ck_assert_int_eq(comm_local_create(1, comms), SCAPE_OK);
    ckpt_ref ref;
    ck_assert_msg(ckpt_open(dir, 0, 1, &ref) == SCAPE_OK, "%s: %s", dir, scape_last_error());
    ck_assert_uint_eq(ref.step, 3);
    eng_t *e = NULL;
    ck_assert_msg(eng_create(&e, &c.engine, &lay, comms[0], 1) == SCAPE_OK, "%s",
                  scape_last_error());
    static float p[N];
    void *params[1] = { p };
    ck_assert_msg(ckpt_restore(&ref, e, comms[0], params) == SCAPE_OK, "%s: %s",
                  s_old_ckpts[_i].dir, scape_last_error());
    /* and another setting of a hashed key is refused, saying so */
    eng_destroy(&e);
    eng_config other = c.engine;
    other.hyper.beta1 = 0.85f;
    ck_assert_int_eq(eng_create(&e, &other, &lay, comms[0], 1), SCAPE_OK);
    ck_assert_int_ne(ckpt_restore(&ref, e, comms[0], params), SCAPE_OK);
    eng_destroy(&e);
    comm_destroy(&comms[0]);
}
END_TEST

int main(void)
{
Suite *s = suite_create("config");
    TCase *tc = tcase_create("config");
    tcase_add_test(tc, defaults);
    tcase_add_test(tc, key_listing);
    tcase_add_test(tc, full_file);
    tcase_add_test(tc, other_yaml_forms);
    tcase_add_loop_test(tc, empty_files, 0, sizeof s_empty_files / sizeof s_empty_files[0]);
    tcase_add_loop_test(tc, bad_files, 0, sizeof s_bad_files / sizeof s_bad_files[0]);
    tcase_add_test(tc, unreadable_files);
    tcase_add_test(tc, set_every_key);
    tcase_add_test(tc, env_every_key);
    tcase_add_test(tc, precedence);
    tcase_add_test(tc, env_error);
    tcase_add_loop_test(tc, bad_sets, 0, sizeof s_bad_sets / sizeof s_bad_sets[0]);
    tcase_add_test(tc, bounds_inclusive);
    tcase_add_test(tc, runtime_dir_length);
    tcase_add_test(tc, print_round_trip);
    tcase_add_test(tc, print_format);
    tcase_add_test(tc, print_write_error);
    tcase_add_test(tc, executor_resolution);
    tcase_add_test(tc, bool_spellings);
    tcase_add_test(tc, bool_everywhere);
    tcase_add_test(tc, closest_key);
    tcase_add_test(tc, env_unknown);
    tcase_add_test(tc, env_warnings);
    tcase_add_test(tc, hash_as_before);
    tcase_add_test(tc, engine_rows_are_keys);
    tcase_add_test(tc, engine_key_order);
    tcase_add_loop_test(tc, handshake_agrees, 0, sizeof s_agree / sizeof s_agree[0]);
    tcase_add_test(tc, enum_lookup);
    tcase_add_test(tc, status_values);
    tcase_add_loop_test(tc, old_checkpoints_restore, 0,
                        sizeof s_old_ckpts / sizeof s_old_ckpts[0]);
    suite_add_tcase(s, tc);
    return check_run(s);
}
