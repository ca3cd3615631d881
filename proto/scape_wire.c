/* scape_wire.c - socket locations and status mapping. */
#define _POSIX_C_SOURCE 200809L
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
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
