/* scape_wire.c - socket locations, status mapping and the liveness of a peer. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "scape_wire.h"

_Static_assert((int)SCAPE__STATUS__UNSUPPORTED == (int)SCAPE_UNSUPPORTED,
               "scape.proto Status and scape_rc must share numbering");

static scape_rc fits(int n, size_t len, const char *what)
{
    if (n < 0 || (size_t)n >= len)
        return scape_set_error(SCAPE_INVALID, "%s does not fit in %zu bytes", what, len);
    return SCAPE_OK;
}

int wire_pid_gone(pid_t pid)
{
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 1;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *close_paren = strrchr(buf, ')');
    return close_paren && close_paren[1] == ' ' && close_paren[2] == 'Z';
}

scape_rc wire_runtime_dir(char *buf, size_t len)
{
    const char *dir = getenv("SCAPE_RUNTIME_DIR");
    if (dir && *dir)
        return fits(snprintf(buf, len, "%s", dir), len, "SCAPE_RUNTIME_DIR");
    const char *job = getenv("SLURM_JOB_ID");
    if (job && *job)
        return fits(snprintf(buf, len, "/tmp/scape-job%s", job), len, "runtime directory");
    const char *user = getenv("USER");
    if (user == NULL || *user == '\0') {
        struct passwd *pw = getpwuid(getuid());
        user = pw ? pw->pw_name : "unknown";
    }
    return fits(snprintf(buf, len, "/tmp/scape-%s", user), len, "runtime directory");
}

scape_rc wire_endpoint(char *buf, size_t len, const char *dir, const char *name)
{
    return fits(snprintf(buf, len, "ipc://%s/%s", dir, name), len, "endpoint");
}

Scape__Status wire_status(scape_rc rc)
{
    if ((unsigned)rc >= SCAPE_RC_COUNT)
        return SCAPE__STATUS__SYSTEM;
    return (Scape__Status)rc;
}

scape_rc wire_rc(Scape__Status st)
{
    if ((unsigned)st >= SCAPE_RC_COUNT)
        return SCAPE_PROTO;
    return (scape_rc)st;
}

void wire_error_reply(Scape__Reply *r, Scape__Error *e, scape_rc rc)
{
    scape__error__init(e);
    e->code = wire_status(rc);
    e->message = (char *)scape_last_error();
    scape__reply__init(r);
    r->status = e->code;
    r->body_case = SCAPE__REPLY__BODY_ERROR;
    r->error = e;
}
