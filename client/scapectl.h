/* scapectl.h - the pieces of scapectl, the operator's CLI: where the daemon
 * is, how to ask it, one printer for `Label : value` lines or JSON, and one
 * function per subcommand. */
#ifndef SCAPE_SCAPECTL_H
#define SCAPE_SCAPECTL_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "scape_wire.h"
#include "try.h"

#define CTL_EXIT_USAGE 64 /* sysexits.h EX_USAGE */

typedef struct ctl_opts {
    char dir[256];        /* runtime directory */
    char status_ep[300];  /* ipc://<dir>/status */
    char events_ep[300];  /* ipc://<dir>/events */
    int timeout_ms;       /* for each request */
    int json;             /* status, watch: JSON instead of labels */
    int interval_ms;      /* watch: time between updates */
    long count;           /* watch: stop after this many updates; 0: never */
    int wait_ms;          /* checkpoint: wait this long for it to be written; 0: no */
    int start_wait_ms;    /* $SCAPE_START_WAIT_MS: wait this long for a daemon still
                             starting (its status socket to appear); 0: no */
    void *zctx;
} ctl_opts;

/* ---- scapectl_net.c: requests and subscriptions ------------------------------ */

/* Set by the SIGINT handler watch installs. */
extern volatile sig_atomic_t ctl_interrupted;

/* Milliseconds on the monotonic clock. */
int64_t ctl_now_ms(void);
/* A socket of type connected to ep with linger 0; closed again on failure. */
scape_rc ctl_connect(const ctl_opts *o, int type, const char *ep, void **sock);
/* Close a socket from ctl_connect and set *sock to NULL; folds a failure into rc. */
scape_rc ctl_close(void **sock, scape_rc rc);
/* Wait until sock is readable (*ready = 1) or deadline_ms passes (*ready = 0);
 * SCAPE_SYSTEM if a signal interrupted the wait while ctl_interrupted is set. */
scape_rc ctl_wait(void *sock, int64_t deadline_ms, int *ready);
/* Send q on a fresh REQ socket and receive the Reply within o->timeout_ms; a
 * reply whose status is not OK becomes that status and the daemon's message.
 * The caller frees *reply with scape__reply__free_unpacked. */
scape_rc ctl_ask(const ctl_opts *o, const Scape__Request *q, Scape__Reply **reply);
/* ctl_ask for a status request, checking that the reply carries a StatusReply. */
scape_rc ctl_status(const ctl_opts *o, Scape__Reply **reply);

/* ---- scapectl_print.c: the printer --------------------------------------------- */

#define PR_MAX_DEPTH 8
#define PR_WIDTH 16 /* indent + label, so the colons line up */

/* Writes either aligned `Label : value` lines or one JSON object.  Every
 * member has a JSON key and a text label: a NULL key leaves the member out
 * of the JSON (inside an object), a NULL label leaves it out of the text, and
 * an empty label prints the bare value.  Objects whose label is NULL do not
 * indent the text.  A row prints its members on one text line.  Nesting
 * stops at PR_MAX_DEPTH - 1 levels. */
typedef struct printer {
    FILE *out;
    int json;
    int depth;
    int members[PR_MAX_DEPTH]; /* JSON members written at each depth */
    char closer[PR_MAX_DEPTH]; /* '}' or ']' */
    int shown[PR_MAX_DEPTH];   /* the object or list is in the JSON */
    int indents[PR_MAX_DEPTH]; /* text indent at each depth */
    int row;                   /* 0, or 1 + the members printed on the row */
} printer;

/* Start the output: JSON opens the top-level object. */
void pr_init(printer *p, FILE *out, int json);
/* End the output: JSON closes the top-level object and ends the line. */
void pr_done(printer *p);
/* A nested object; text prints `Label : summary` (summary may be NULL). */
void pr_open(printer *p, const char *key, const char *label, const char *summary);
/* A list of n items; text prints `Label : n`. */
void pr_list(printer *p, const char *key, const char *label, size_t n);
/* An object whose text members share one line after `Label : `. */
void pr_row(printer *p, const char *key, const char *label);
/* Close the innermost object, list or row. */
void pr_close(printer *p);
/* A string member; NULL prints null / "-". */
void pr_str(printer *p, const char *key, const char *label, const char *v);
/* A boolean member: JSON true/false, text yes/no. */
void pr_bool(printer *p, const char *key, const char *label, int v);
/* An integer member; text shows text if not NULL, else the number. */
void pr_uint(printer *p, const char *key, const char *label, uint64_t v, const char *text);
/* A real member (JSON null if not finite); text shows text if not NULL. */
void pr_real(printer *p, const char *key, const char *label, double v, const char *text);
/* A missing value: JSON null, text "-". */
void pr_null(printer *p, const char *key, const char *label);

/* Shortest "%.*g" of v that reads back exactly. */
const char *fmt_real(char *buf, size_t len, double v);
/* Bytes in B, KiB, MiB, GiB or TiB. */
const char *fmt_bytes(char *buf, size_t len, uint64_t v);
/* Seconds as milliseconds: "0.212 ms". */
const char *fmt_ms(char *buf, size_t len, double seconds);
/* A duration given in ms: "850 ms", "12.3 s", "3h 02m 07s". */
const char *fmt_uptime(char *buf, size_t len, uint64_t ms);
/* A count, with an SI figure when large: "7000000 (7.00 M)". */
const char *fmt_count(char *buf, size_t len, uint64_t v);
/* A fraction as a percentage: "1.000 %". */
const char *fmt_percent(char *buf, size_t len, double frac);

/* ---- the subcommands --------------------------------------------------------------- */

/* scapectl_status.c: the daemon's state as labels or JSON. */
scape_rc cmd_status(const ctl_opts *o);
/* `Waiting for : 1 more trainer (slot 1)` while a daemon waits for the
 * trainers of its `trainers` key (JSON: waiting_for, null when not waiting,
 * waiting_slots, trainers_expected); status and watch both show it. */
void pr_waiting(printer *p, const char *label, const Scape__StatusReply *st);
/* scapectl_watch.c: live updates until --count, Ctrl-C or silence. */
scape_rc cmd_watch(const ctl_opts *o);
/* scapectl_metrics.c: Prometheus text exposition. */
scape_rc cmd_metrics(const ctl_opts *o);
/* scapectl_checkpoint.c: ask for a checkpoint (and wait for it). */
scape_rc cmd_checkpoint(const ctl_opts *o);
/* scapectl_checkpoint.c: the Checkpoint block of status. */
void print_checkpoint(printer *p, const Scape__CheckpointInfo *c);
/* scapectl.c: ask the daemon to stop. */
scape_rc cmd_shutdown(const ctl_opts *o);
/* scapectl.c: the help text on stdout. */
scape_rc cmd_help(const ctl_opts *o);

#endif /* SCAPE_SCAPECTL_H */
