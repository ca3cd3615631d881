/* error.c - result-code names and the per-thread last-error buffer. */
#include <stdarg.h>
#include <stdio.h>

#include "scape_kernels.h"

static _Thread_local char s_last_error[512];

static const char *const s_rc_names[SCAPE_RC_COUNT] = {
    [SCAPE_OK] = "OK",           [SCAPE_INVALID] = "INVALID",
    [SCAPE_NOMEM] = "NOMEM",     [SCAPE_SYSTEM] = "SYSTEM",
    [SCAPE_CUDA] = "CUDA",       [SCAPE_NCCL] = "NCCL",
    [SCAPE_ZMQ] = "ZMQ",         [SCAPE_PROTO] = "PROTO",
    [SCAPE_REMOTE] = "REMOTE",   [SCAPE_TIMEOUT] = "TIMEOUT",
    [SCAPE_UNSUPPORTED] = "UNSUPPORTED",
};

const char *scape_rc_name(scape_rc rc)
{
    if ((unsigned)rc >= SCAPE_RC_COUNT)
        return "UNKNOWN";
    return s_rc_names[rc];
}

const char *scape_last_error(void) { return s_last_error; }

void scape_clear_error(void) { s_last_error[0] = '\0'; }

scape_rc scape_set_error(scape_rc rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s_last_error, sizeof s_last_error, fmt, ap);
    va_end(ap);
    return rc;
}
