/* server.h - scaped's service: the control ROUTER that trainers attach to,
 * the status REP and events PUB that scapectl reads, the trainer table, and
 * the engine the steps run on. */
#ifndef SCAPE_SERVER_H
#define SCAPE_SERVER_H

#include "config.h"
#include "scape_rc.h"

typedef struct server server;

/* Create the runtime directory (mode 0700) if missing, lock it, and bind the
 * control, status and events sockets inside it. */
scape_rc srv_create(server **out, const scaped_config *cfg);
/* Serve until a shutdown request or srv_request_stop(); then tell the
 * trainers, unlink their shared memory and return. */
scape_rc srv_run(server *s);
/* One turn of srv_run's loop: wait up to timeout_ms for a control or status
 * message, handle what came (*handled: how many, 0 or more), reap closed
 * buffers and check trainer liveness when due.  Fails only when polling
 * fails; for tests and tests/fuzz, which drive a server message by message. */
scape_rc srv_serve_once(server *s, int timeout_ms, int *handled);
/* A shutdown was asked for (a Shutdown request or srv_request_stop()). */
int srv_stopping(const server *s);
/* Close the sockets, remove the socket files and free; sets *s to NULL. */
void srv_destroy(server **s);
/* Async-signal-safe: ask the running server to stop after the current step. */
void srv_request_stop(void);
/* Async-signal-safe: ask for a checkpoint after the next completed step. */
void srv_request_checkpoint(void);

#endif /* SCAPE_SERVER_H */
