/* metrics_http.h - the metrics_listen key: a small HTTP/1.0 responder in the
 * daemon's own poll loop that answers GET /metrics with the Prometheus text
 * exposition (404 for other paths, 405 for other methods, 400 for what is
 * not HTTP) and closes every connection after its response.  A request is
 * bounded in size and each connection in time, so that slow or garbled
 * clients cannot hold the daemon or starve the next scrape. */
#ifndef SCAPE_METRICS_HTTP_H
#define SCAPE_METRICS_HTTP_H

#include <stdio.h>
#include <zmq.h>

#include "scape_rc.h"

#define MHTTP_MAX_CLIENTS 16      /* open connections; a new one closes the oldest */
#define MHTTP_MAX_REQUEST 8192    /* request line and headers, bytes */
#define MHTTP_TIMEOUT_MS 5000     /* a connection's whole life */
#define MHTTP_MAX_ITEMS (1 + MHTTP_MAX_CLIENTS)

typedef struct mhttp mhttp;

/* Writes the exposition to out: 0, or -1 when it could not (answered 500). */
typedef int (*mhttp_render_fn)(void *arg, FILE *out);

/* Listen on addr: "HOST:PORT", ":PORT" (every interface) or "[IPV6]:PORT";
 * port 0 takes a free one (logged).  INVALID on a malformed addr, SYSTEM when
 * it cannot be bound, the cause and the fix in the message. */
scape_rc mhttp_create(mhttp **out, const char *addr, mhttp_render_fn render, void *arg);
/* The port it listens on. */
int mhttp_port(const mhttp *h);
/* Fill items (room for MHTTP_MAX_ITEMS) with the listening socket and each
 * connection, polled for what it waits for; returns how many. */
int mhttp_poll_items(const mhttp *h, zmq_pollitem_t *items);
/* Handle the revents of the n items mhttp_poll_items filled, then close the
 * connections past MHTTP_TIMEOUT_MS.  Never fails: a client's trouble only
 * closes that client. */
void mhttp_serve(mhttp *h, const zmq_pollitem_t *items, int n);
/* Close every socket and free; sets *h to NULL. */
void mhttp_destroy(mhttp **h);

#endif /* SCAPE_METRICS_HTTP_H */
