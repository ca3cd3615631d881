/* scape_prom.h - a StatusReply in the Prometheus text exposition format
 * (version 0.0.4): the one renderer behind `scapectl metrics` and the
 * daemon's HTTP /metrics (metrics_listen), so both give the same series. */
#ifndef SCAPE_PROM_H
#define SCAPE_PROM_H

#include <stdio.h>

#include "scape.pb-c.h"

/* The Content-Type of what prom_render writes. */
#define PROM_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* Write every series of st to out, each labelled with the daemon's rank;
 * figures the reply lacks are left out.  0, or -1 when out reports an
 * error. */
int prom_render(FILE *out, const Scape__StatusReply *st);
/* Write `scape_up 0` (no rank: nobody answered) for a daemon that did not
 * answer.  0, or -1 when out reports an error. */
int prom_render_down(FILE *out);

#endif /* SCAPE_PROM_H */
