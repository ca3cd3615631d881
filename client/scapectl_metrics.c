/* scapectl_metrics.c - `scapectl metrics`: the status reply in the Prometheus
 * text exposition format (version 0.0.4), for a node_exporter textfile
 * collector or any scraper that runs a command.  The series are
 * proto/scape_prom.c's, the same the daemon serves at metrics_listen. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>

#include "scape_prom.h"
#include "scapectl.h"

/* A daemon that does not answer (gone, silent, refusing) is `scape_up 0`
 * with exit status 0, so that a textfile collector's file says it is down
 * instead of keeping the last `scape_up 1`; why goes to stderr. */
scape_rc cmd_metrics(const ctl_opts *o)
{
    Scape__Reply *r = NULL;
    scape_rc rc = ctl_status(o, &r);
    int bad;
    if (rc != SCAPE_OK) {
        fprintf(stderr, "scapectl metrics: %s\n", scape_last_error());
        bad = prom_render_down(stdout);
    } else {
        bad = prom_render(stdout, r->status_reply);
        scape__reply__free_unpacked(r, NULL);
    }
    if (bad || fflush(stdout) != 0)
        return scape_set_error(SCAPE_SYSTEM, "cannot write the metrics to stdout");
    return SCAPE_OK;
}
