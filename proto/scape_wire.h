/* scape_wire.h - conventions both ends of the wire share: where the sockets
 * live, and how result codes map to the protocol's Status. */
#ifndef SCAPE_WIRE_H
#define SCAPE_WIRE_H

#include <stddef.h>
#include <sys/types.h>

#include "scape.pb-c.h"
#include "scape_rc.h"

/* Largest message either side accepts by default. */
#define WIRE_MAX_MESSAGE (1u << 20)

/* The runtime directory: $SCAPE_RUNTIME_DIR, else /tmp/scape-job<SLURM_JOB_ID>
 * inside a Slurm job, else /tmp/scape-<user>.  Returns SCAPE_INVALID if it
 * does not fit in len bytes. */
scape_rc wire_runtime_dir(char *buf, size_t len);

/* "ipc://<dir>/<name>" for name in control | status | events. */
scape_rc wire_endpoint(char *buf, size_t len, const char *dir, const char *name);

/* Fill r (and its error e) as the error reply for rc, carrying the calling
 * thread's last-error message; both stay valid while that message does. */
void wire_error_reply(Scape__Reply *r, Scape__Error *e, scape_rc rc);

/* 1 when process pid is gone, or a zombie nobody has reaped yet: the
 * liveness check of a peer on this node, the daemon's of its trainers and a
 * trainer's of its daemon. */
int wire_pid_gone(pid_t pid);

/* Map between scape_rc and Scape__Status (they share numbering). */
Scape__Status wire_status(scape_rc rc);
scape_rc wire_rc(Scape__Status st);

#endif /* SCAPE_WIRE_H */
