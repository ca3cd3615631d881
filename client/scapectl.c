/* scapectl.c - the operator's CLI for scaped: the command line, where the
 * daemon is, and the small subcommands (shutdown, help).  The exit code is
 * the reply's status (scape.proto Status), 9 when the daemon does not
 * answer in time, and 64 on a usage error. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "scapectl.h"

#ifndef SCAPE_VERSION
#define SCAPE_VERSION "unknown" /* a build that does not pass CMake's project version */
#endif

enum { OPT_JSON = 1, OPT_INTERVAL = 2, OPT_COUNT = 4, OPT_WAIT = 8 }; /* subcommand options */

typedef struct command {
    const char *name;
    scape_rc (*run)(const ctl_opts *o);
    unsigned opts; /* OPT_* it accepts */
    const char *args, *doc;
} command;

static const command s_commands[] = {
    { "status", cmd_status, OPT_JSON, "[--json]", "the daemon's state, trainers and last step" },
    { "watch", cmd_watch, OPT_JSON | OPT_INTERVAL | OPT_COUNT,
      "[--interval-ms MS] [--count N] [--json]", "live updates until Ctrl-C" },
    { "metrics", cmd_metrics, 0, "", "Prometheus text exposition of the status" },
    { "checkpoint", cmd_checkpoint, OPT_JSON | OPT_WAIT, "[--wait] [--wait-ms MS] [--json]",
      "checkpoint after the next step (--wait: until written)" },
    { "shutdown", cmd_shutdown, 0, "", "ask scaped to stop" },
    { "help", cmd_help, 0, "", "this text" },
};

#define NCOMMANDS (sizeof s_commands / sizeof s_commands[0])

enum { O_RUNTIME_DIR, O_ENDPOINT, O_TIMEOUT, O_JSON, O_INTERVAL, O_COUNT, O_WAIT, O_WAIT_MS,
       NOPTIONS };

typedef struct option_spec {
    const char *name;
    unsigned bit;       /* OPT_* for a subcommand option, 0 for a global one */
    int numeric;        /* takes a whole number within [min, max] */
    long min, max, def;
} option_spec;

static const option_spec s_options[NOPTIONS] = {
    [O_RUNTIME_DIR] = { "--runtime-dir", 0, 0, 0, 0, 0 },
    [O_ENDPOINT] = { "--endpoint", 0, 0, 0, 0, 0 },
    [O_TIMEOUT] = { "--timeout-ms", 0, 1, 1, 3600000, 5000 },
    [O_JSON] = { "--json", OPT_JSON, 0, 0, 0, 0 },
    [O_INTERVAL] = { "--interval-ms", OPT_INTERVAL, 1, 10, 3600000, 1000 },
    [O_COUNT] = { "--count", OPT_COUNT, 1, 0, LONG_MAX, 0 },
    [O_WAIT] = { "--wait", OPT_WAIT, 0, 0, 0, 0 },
    [O_WAIT_MS] = { "--wait-ms", OPT_WAIT, 1, 1, 86400000, 600000 },
};

typedef struct args {
    const command *cmd;
    const char *runtime_dir, *endpoint;
    long num[NOPTIONS]; /* values of the numeric options */
    unsigned given;     /* OPT_* bits seen */
    unsigned flags;     /* 1 << O_* of the options without a value seen */
    int help, version;
} args;

static const char s_usage[] =
    "usage: scapectl [--runtime-dir DIR | --endpoint ipc://DIR/status] [--timeout-ms MS] "
    "COMMAND [OPTIONS]\n       scapectl --version | -h | --help";

scape_rc cmd_help(const ctl_opts *o)
{
    (void)o;
    printf("%s\n\nThe operator's CLI for scaped, the per-node SCAPE optimizer daemon.\n\n"
           "Commands:\n", s_usage);
    for (size_t i = 0; i < NCOMMANDS; i++) {
        char head[64];
        snprintf(head, sizeof head, "%s %s", s_commands[i].name, s_commands[i].args);
        printf("  %-46s %s\n", head, s_commands[i].doc);
    }
    printf("\nOptions:\n"
           "  --runtime-dir DIR   the daemon's runtime directory (default: $SCAPE_RUNTIME_DIR,\n"
           "                      else /tmp/scape-job$SLURM_JOB_ID, else /tmp/scape-$USER)\n"
           "  --endpoint EP       the status endpoint, ipc://DIR/status (instead of the dir)\n"
           "  --timeout-ms MS     how long to wait for each answer (default 5000)\n"
           "  --json              one JSON object (per update, for watch)\n"
           "  --interval-ms MS    watch: time between updates (default 1000)\n"
           "  --count N           watch: stop after N updates (default: never)\n"
           "  --wait              checkpoint: wait until it is written (or failed)\n"
           "  --wait-ms MS        checkpoint --wait: longest wait (default 600000)\n"
           "  --version           the version of scapectl, then exit\n"
           "  -h, --help          this text\n"
           "\nExit status: 0 when scaped answered OK; the reply's status code (1-10) when it\n"
           "refused; 9 when it did not answer in time; 64 on a usage error.\n");
    return SCAPE_OK;
}

scape_rc cmd_shutdown(const ctl_opts *o)
{
    Scape__Shutdown body = SCAPE__SHUTDOWN__INIT;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_SHUTDOWN;
    q.shutdown = &body;
    Scape__Reply *r = NULL;
    scape_rc rc = ctl_ask(o, &q, &r);
    if (rc != SCAPE_OK)
        return rc;
    scape__reply__free_unpacked(r, NULL);
    printf("scaped is stopping\n");
    return SCAPE_OK;
}

/* ---- the command line ------------------------------------------------------------ */

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("scapectl: ", stderr);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n%s\n(scapectl help lists the commands)\n", s_usage);
    return CTL_EXIT_USAGE;
}

static const option_spec *find_option(const char *arg, size_t *len)
{
    const char *eq = strchr(arg, '=');
    *len = eq ? (size_t)(eq - arg) : strlen(arg);
    for (size_t i = 0; i < NOPTIONS; i++)
        if (strlen(s_options[i].name) == *len && strncmp(arg, s_options[i].name, *len) == 0)
            return &s_options[i];
    return NULL;
}

static int parse_number(const option_spec *opt, const char *v, long *out)
{
    char *end = NULL;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0' || n < opt->min || n > opt->max)
        return usage_error("%s wants a whole number from %ld to %ld, not '%s'", opt->name,
                           opt->min, opt->max, v);
    *out = n;
    return 0;
}

/* Store the value of opt (from "--opt=v" or the next argument). */
static int take_value(args *a, const option_spec *opt, const char *inline_v, char **argv, int *i)
{
    const char *v = inline_v ? inline_v : argv[*i + 1];
    if (v == NULL)
        return usage_error("%s needs a value", opt->name);
    if (inline_v == NULL)
        (*i)++;
    if (opt->numeric)
        return parse_number(opt, v, &a->num[opt - s_options]);
    if (opt == &s_options[O_RUNTIME_DIR])
        a->runtime_dir = v;
    else
        a->endpoint = v;
    return 0;
}

static int parse_option(args *a, char **argv, int *i)
{
    size_t len = 0;
    const char *arg = argv[*i];
    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
        a->help = 1;
        return 0;
    }
    if (strcmp(arg, "--version") == 0) {
        a->version = 1;
        return 0;
    }
    const option_spec *opt = find_option(arg, &len);
    if (opt == NULL)
        return usage_error("unknown option '%s'", arg);
    a->given |= opt->bit;
    if (opt == &s_options[O_JSON] || opt == &s_options[O_WAIT]) {
        a->flags |= 1u << (opt - s_options);
        return arg[len] == '=' ? usage_error("%s takes no value", opt->name) : 0;
    }
    return take_value(a, opt, arg[len] == '=' ? arg + len + 1 : NULL, argv, i);
}

static int parse_command(args *a, const char *word)
{
    if (a->cmd != NULL)
        return usage_error("unexpected argument '%s'", word);
    for (size_t i = 0; i < NCOMMANDS; i++)
        if (strcmp(word, s_commands[i].name) == 0)
            a->cmd = &s_commands[i];
    return a->cmd ? 0 : usage_error("unknown command '%s'", word);
}

/* Options may come before or after the command. */
static int parse_args(int argc, char **argv, args *a)
{
    *a = (args){ .cmd = NULL };
    for (size_t i = 0; i < NOPTIONS; i++)
        a->num[i] = s_options[i].def;
    for (int i = 1; i < argc; i++) {
        int u = argv[i][0] == '-' ? parse_option(a, argv, &i) : parse_command(a, argv[i]);
        if (u)
            return u;
    }
    if (a->help || a->version)
        return 0;
    if (a->cmd == NULL)
        return usage_error("no command given");
    for (size_t i = 0; i < NOPTIONS; i++)
        if (s_options[i].bit & a->given & ~a->cmd->opts)
            return usage_error("%s does not apply to this command", s_options[i].name);
    if (a->runtime_dir && a->endpoint)
        return usage_error("give --runtime-dir or --endpoint, not both");
    return 0;
}

/* ---- where the daemon is ------------------------------------------------------------- */

/* The runtime dir of an endpoint of the form ipc://DIR/status. */
static int dir_of_endpoint(const char *ep, char *dir, size_t len)
{
    static const char pre[] = "ipc://", post[] = "/status";
    size_t n = strlen(ep), lp = sizeof pre - 1, ls = sizeof post - 1;
    if (n <= lp + ls || strncmp(ep, pre, lp) != 0 || strcmp(ep + n - ls, post) != 0 ||
        n - lp - ls >= len)
        return usage_error("--endpoint must look like ipc://DIR/status, not '%s'", ep);
    memcpy(dir, ep + lp, n - lp - ls);
    dir[n - lp - ls] = '\0';
    return 0;
}

/* Fill o from a; a usage error's exit code, or the scape_rc of a failure. */
static int locate(const args *a, ctl_opts *o)
{
    *o = (ctl_opts){ .timeout_ms = (int)a->num[O_TIMEOUT], .json = (a->given & OPT_JSON) != 0,
                     .interval_ms = (int)a->num[O_INTERVAL], .count = a->num[O_COUNT] };
    if (a->flags & (1u << O_WAIT))
        o->wait_ms = (int)a->num[O_WAIT_MS];
    const char *sw = getenv("SCAPE_START_WAIT_MS");
    if (sw && *sw) {
        char *end = NULL;
        long ms = strtol(sw, &end, 10);
        if (*end != '\0' || ms < 0 || ms > 86400000)
            return usage_error("SCAPE_START_WAIT_MS='%s' is not a number of milliseconds "
                               "(0 to 86400000)", sw);
        o->start_wait_ms = (int)ms;
    }
    if (a->endpoint) {
        int u = dir_of_endpoint(a->endpoint, o->dir, sizeof o->dir);
        if (u)
            return u;
    } else if (a->runtime_dir) {
        if (snprintf(o->dir, sizeof o->dir, "%s", a->runtime_dir) >= (int)sizeof o->dir)
            return usage_error("--runtime-dir '%s' is too long", a->runtime_dir);
    } else if (wire_runtime_dir(o->dir, sizeof o->dir) != SCAPE_OK) {
        fprintf(stderr, "scapectl: %s\n", scape_last_error());
        return SCAPE_INVALID;
    }
    if (wire_endpoint(o->status_ep, sizeof o->status_ep, o->dir, "status") != SCAPE_OK ||
        wire_endpoint(o->events_ep, sizeof o->events_ep, o->dir, "events") != SCAPE_OK) {
        fprintf(stderr, "scapectl: %s\n", scape_last_error());
        return SCAPE_INVALID;
    }
    return 0;
}

/* Run the command with a ZeroMQ context around it. */
static scape_rc run(const command *cmd, ctl_opts *o)
{
    o->zctx = zmq_ctx_new();
    if (o->zctx == NULL)
        return scape_set_error(SCAPE_ZMQ, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
    scape_rc rc = cmd->run(o);
    int t;
    while ((t = zmq_ctx_term(o->zctx)) != 0 && zmq_errno() == EINTR)
        continue;
    if (t != 0 && rc == SCAPE_OK)
        rc = scape_set_error(SCAPE_ZMQ, "zmq_ctx_term: %s", zmq_strerror(zmq_errno()));
    return rc;
}

int main(int argc, char **argv)
{
    args a;
    int u = parse_args(argc, argv, &a);
    if (u)
        return u;
    if (a.help || (a.cmd && a.cmd->run == cmd_help))
        return (int)cmd_help(NULL);
    if (a.version) {
        printf("scapectl %s\n", SCAPE_VERSION);
        return fflush(stdout) == 0 && !ferror(stdout) ? 0 : 1;
    }
    ctl_opts o;
    if ((u = locate(&a, &o)) != 0)
        return u;
    scape_rc rc = run(a.cmd, &o);
    if (rc == SCAPE_OK && (fflush(stdout) != 0 || ferror(stdout)))
        rc = scape_set_error(SCAPE_SYSTEM, "writing the output: %s", strerror(errno));
    if (rc != SCAPE_OK)
        fprintf(stderr, "scapectl %s: %s\n", a.cmd->name, scape_last_error());
    return (int)rc;
}
