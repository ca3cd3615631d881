/* main.c - the scaped command line: configuration (defaults < YAML file <
 * SCAPE_* environment < flags), logging, signals, and the server. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "auth.h"
#include "comm_nccl.h"
#include "config.h"
#include "log.h"
#include "rendezvous.h"
#include "server.h"

#ifndef SCAPE_VERSION
#define SCAPE_VERSION "unknown" /* a build that does not pass CMake's project version */
#endif

static void usage(FILE *out)
{
    fprintf(out,
            "usage: scaped [--config FILE] [--print-config] [--KEY VALUE | --KEY=VALUE ...]\n"
            "       scaped --version | -h | --help\n"
            "       scaped keygen FILE   write a fresh key for auth: secret (mode 0600)\n"
            "\n"
            "The per-node SCAPE optimizer daemon.  Trainers attach over\n"
            "ipc://<runtime_dir>/control; scapectl reads ipc://<runtime_dir>/status.\n"
            "\n"
            "  --config FILE     read a YAML configuration file\n"
            "  --print-config    print the effective configuration and exit\n"
            "  --version         the version and what this build can do, then exit\n"
            "  -h, --help        this text\n"
            "\n"
            "Every configuration key is also a flag (underscores or dashes), and an\n"
            "environment variable SCAPE_<KEY>:\n");
    const char *name;
    for (size_t i = 0;; i++) {
        const char *doc = cfg_key_doc(i, &name);
        if (doc == NULL)
            break;
        fprintf(out, "  --%-20s %s\n", name, doc);
    }
}

/* scaped --version: the version, and what this build has of the choices
 * that depend on it (executor, comm_backend, auth). */
static int version(void)
{
#ifdef SCAPE_HAVE_CUDA
    const char *exec = "host, sim, cuda";
#else
    const char *exec = "host, sim (no cuda: built without CUDA)";
#endif
#ifdef SCAPE_HAVE_MUNGE
    const char *auth = "munge, secret, none";
#else
    const char *auth = "secret, none (no munge: built without libmunge)";
#endif
    printf("scaped %s\n"
           "executor:     %s\n"
           "comm_backend: %s\n"
           "auth:         %s\n", SCAPE_VERSION, exec,
           comm_nccl_built() ? "host, nccl" : "host (no nccl: built without CUDA and NCCL)",
           auth);
    return fflush(stdout) == 0 && !ferror(stdout) ? 0 : 1;
}

/* "--max-trainers" -> "max_trainers" in key (size len). */
static void flag_to_key(const char *flag, char *key, size_t len)
{
    size_t i = 0;
    for (; flag[i] && flag[i] != '=' && i + 1 < len; i++)
        key[i] = flag[i] == '-' ? '_' : flag[i];
    key[i] = '\0';
}

static int known_key(const char *key)
{
    const char *name;
    for (size_t i = 0; cfg_key_doc(i, &name) != NULL; i++)
        if (strcmp(key, name) == 0)
            return 1;
    return 0;
}

/* A flag that is no key: name the nearest key, spelt as the flag was. */
static int unknown_flag(const char *flag, const char *key)
{
    int n = (int)strcspn(flag, "=");
    const char *near = cfg_closest_key(key);
    char alt[64];
    if (near == NULL) {
        fprintf(stderr, "scaped: unknown option %.*s (scaped --help lists them)\n", n, flag);
        return 2;
    }
    snprintf(alt, sizeof alt, "%s", near);
    const char *dash = strchr(flag + 2, '-');
    int dashes = dash != NULL && dash < flag + n; /* --mask-delta, not --mask_delta */
    for (char *p = alt; dashes && *p; p++)
        if (*p == '_')
            *p = '-';
    fprintf(stderr, "scaped: unknown option %.*s (did you mean --%s?)\n", n, flag, alt);
    return 2;
}

/* Apply every --KEY VALUE flag; --config, --print-config and --help are
 * handled by the caller.  Returns 0, or 2 on a usage error. */
static int apply_flags(scaped_config *cfg, int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--print-config") == 0)
            continue;
        if (strncmp(a, "--", 2) != 0) {
            fprintf(stderr, "scaped: unexpected argument '%s' (see --help)\n", a);
            return 2;
        }
        char key[64];
        flag_to_key(a + 2, key, sizeof key);
        if (strcmp(key, "config") != 0 && !known_key(key))
            return unknown_flag(a, key);
        const char *eq = strchr(a, '=');
        const char *val = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (val == NULL) {
            fprintf(stderr, "scaped: %s needs a value\n", a);
            return 2;
        }
        if (strcmp(key, "config") == 0)
            continue;
        if (cfg_set(cfg, key, val, a) != SCAPE_OK) {
            fprintf(stderr, "scaped: %s\n", scape_last_error());
            return 2;
        }
    }
    return 0;
}

static const char *config_path(int argc, char **argv)
{
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
            path = argv[++i];
        else if (strncmp(argv[i], "--config=", 9) == 0)
            path = argv[i] + 9;
    }
    return path;
}

/* Inside a Slurm job step the job's shape comes from Slurm's environment; it
 * only sets defaults, which the file, SCAPE_* variables and flags override. */
static scape_rc slurm_defaults(scaped_config *cfg)
{
    /* a batch script without --ntasks has SLURM_PROCID but no SLURM_NTASKS:
     * it is not a step of several tasks, so one node, as outside Slurm */
    if (getenv("SLURM_PROCID") == NULL || getenv("SLURM_NTASKS") == NULL)
        return SCAPE_OK;
    int rank, world;
    uint64_t job;
    char host[200], ip[64], buf[300];
    scape_rc rc = rdv_from_slurm(&rank, &world, &job, host, sizeof host);
    if (rc == SCAPE_OK && world > 1)
        rc = rdv_host_address(ip, sizeof ip);
    if (rc != SCAPE_OK || world == 1)
        return rc;
    snprintf(buf, sizeof buf, "%d", world);
    cfg_set(cfg, "world", buf, "SLURM_NTASKS");
    snprintf(buf, sizeof buf, "%d", rank);
    cfg_set(cfg, "rank", buf, "SLURM_PROCID");
    snprintf(buf, sizeof buf, "%llu", (unsigned long long)job);
    cfg_set(cfg, "job", buf, "SLURM_JOB_ID");
    snprintf(buf, sizeof buf, "tcp://%s:%d", host, rdv_slurm_port(job));
    cfg_set(cfg, "coordinator", buf, "SLURM_JOB_NODELIST");
    /* the data plane takes any free port; the rendezvous publishes it */
    snprintf(buf, sizeof buf, "tcp://%s:*", ip);
    return cfg_set(cfg, "listen", buf, "this host's address");
}

static int has_flag(int argc, char **argv, const char *flag)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], flag) == 0)
            return 1;
    return 0;
}

static void on_signal(int sig)
{
    if (sig == SIGUSR1)
        srv_request_checkpoint();
    else
        srv_request_stop();
}

static int install_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    struct sigaction ign = sa;
    ign.sa_handler = SIG_IGN;
    return sigaction(SIGTERM, &sa, NULL) | sigaction(SIGINT, &sa, NULL) |
           sigaction(SIGUSR1, &sa, NULL) | sigaction(SIGPIPE, &ign, NULL);
}

/* scaped keygen FILE: a key for auth: secret, for the job's nodes to share. */
static int keygen(int argc, char **argv)
{
    if (argc != 3 || argv[2][0] == '-') {
        fprintf(stderr, "usage: scaped keygen FILE\n");
        return 2;
    }
    if (auth_keygen(argv[2]) != SCAPE_OK) {
        fprintf(stderr, "scaped: %s\n", scape_last_error());
        return 1;
    }
    printf("scaped: wrote a key for auth: secret to %s (mode 0600); give every daemon of the "
           "job auth_key_file: %s\n", argv[2], argv[2]);
    return 0;
}

/* A daemon that fails (any exit status but 0) as a task of a Slurm step:
 * srun ends the step when the task exits (--kill-on-bad-exit) and can then
 * drop the task's last output lines, the reason among them (seen: a
 * corrupted checkpoint's refusal missing from the job's output).  Waiting a
 * second before the exit lets srun forward them first. */
static int failed(int rc)
{
    if (rc != 0 && getenv("SLURM_STEP_ID") != NULL) {
        fflush(NULL);
        struct timespec ts = { 1, 0 };
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
            ;
    }
    return rc;
}

static int run(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "keygen") == 0)
        return keygen(argc, argv);
    if (has_flag(argc, argv, "--help") || has_flag(argc, argv, "-h")) {
        usage(stdout);
        return 0;
    }
    if (has_flag(argc, argv, "--version"))
        return version();
    scaped_config cfg;
    cfg_defaults(&cfg);
    const char *path = config_path(argc, argv);
    if (slurm_defaults(&cfg) != SCAPE_OK || (path && cfg_load_file(&cfg, path) != SCAPE_OK) ||
        cfg_apply_env(&cfg) != SCAPE_OK) {
        fprintf(stderr, "scaped: %s\n", scape_last_error());
        return 2;
    }
    int urc = apply_flags(&cfg, argc, argv);
    if (urc)
        return urc;
    log_init(cfg.rank, cfg.log_level, NULL);
    cfg_warn_env();
    if (has_flag(argc, argv, "--print-config"))
        return cfg_print(&cfg, stdout) == SCAPE_OK ? 0 : 1;
    if (install_signals() != 0) {
        LOG_ERROR(SUB_MAIN, "cannot install signal handlers");
        return 1;
    }
    server *s = NULL;
    if (srv_create(&s, &cfg) != SCAPE_OK) {
        LOG_ERROR(SUB_MAIN, "%s", scape_last_error());
        return 1;
    }
    scape_rc rc = srv_run(s);
    if (rc != SCAPE_OK)
        LOG_ERROR(SUB_MAIN, "%s", scape_last_error());
    srv_destroy(&s);
    LOG_INFO(SUB_MAIN, "stopped");
    return rc == SCAPE_OK ? 0 : 1;
}

int main(int argc, char **argv) { return failed(run(argc, argv)); }
