/* scapectl_net.c - scapectl's side of the status plane: one REQ socket per
 * request, closed with linger 0, and every wait bounded by a deadline, so
 * that a daemon that is gone or stuck never hangs the CLI. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <zmq.h>

#include "scapectl.h"

volatile sig_atomic_t ctl_interrupted;

int64_t ctl_now_ms(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0; /* CLOCK_MONOTONIC is mandatory on Linux; cannot fail there */
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static scape_rc zmq_failed(const char *what, const char *ep)
{
    return scape_set_error(SCAPE_ZMQ, "%s %s: %s", what, ep, zmq_strerror(zmq_errno()));
}

scape_rc ctl_connect(const ctl_opts *o, int type, const char *ep, void **sock)
{
    void *s = zmq_socket(o->zctx, type);
    if (s == NULL)
        return zmq_failed("socket for", ep);
    int zero = 0;
    if (zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_setsockopt(s, ZMQ_SNDTIMEO, &o->timeout_ms, sizeof o->timeout_ms) != 0 ||
        zmq_connect(s, ep) != 0) {
        scape_rc rc = zmq_failed("connect to", ep);
        zmq_close(s); /* already failing; the first error is the one to report */
        return rc;
    }
    *sock = s;
    return SCAPE_OK;
}

scape_rc ctl_close(void **sock, scape_rc rc)
{
    if (*sock != NULL && zmq_close(*sock) != 0 && rc == SCAPE_OK)
        rc = zmq_failed("close", "socket");
    *sock = NULL;
    return rc;
}

scape_rc ctl_wait(void *sock, int64_t deadline_ms, int *ready)
{
    for (;;) {
        int64_t left = deadline_ms - ctl_now_ms();
        *ready = 0;
        if (left <= 0)
            return SCAPE_OK;
        zmq_pollitem_t item = { sock, 0, ZMQ_POLLIN, 0 };
        int n = zmq_poll(&item, 1, (long)left);
        if (n >= 0) {
            *ready = n > 0;
            if (n > 0 || ctl_now_ms() >= deadline_ms)
                return SCAPE_OK;
            continue; /* woken early: poll again for what is left */
        }
        if (zmq_errno() != EINTR)
            return zmq_failed("poll", "socket");
        if (ctl_interrupted)
            return scape_set_error(SCAPE_SYSTEM, "interrupted");
    }
}

static scape_rc no_answer(const ctl_opts *o)
{
    return scape_set_error(SCAPE_TIMEOUT,
                           "no answer from scaped at %s within %d ms (is it running? "
                           "runtime dir %s)",
                           o->status_ep, o->timeout_ms, o->dir);
}

static scape_rc send_request(void *sock, const ctl_opts *o, const Scape__Request *q)
{
    size_t len = scape__request__get_packed_size(q);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf == NULL)
        return scape_set_error(SCAPE_NOMEM, "out of memory for a %zu-byte request", len);
    scape__request__pack(q, buf);
    int n = zmq_send(sock, buf, len, 0);
    free(buf);
    if (n >= 0)
        return SCAPE_OK;
    return zmq_errno() == EAGAIN ? no_answer(o) : zmq_failed("send to", o->status_ep);
}

/* A reply that is not OK: its status, and the daemon's message. */
static scape_rc refused(const Scape__Reply *r)
{
    const char *msg = r->body_case == SCAPE__REPLY__BODY_ERROR && r->error->message
                          ? r->error->message
                          : "(no message)";
    scape_rc rc = wire_rc(r->status);
    return scape_set_error(rc, "scaped answered %s: %s", scape_rc_name(rc), msg);
}

static scape_rc recv_reply(void *sock, const ctl_opts *o, Scape__Reply **reply)
{
    zmq_msg_t msg;
    if (zmq_msg_init(&msg) != 0)
        return zmq_failed("message for", o->status_ep);
    int n = zmq_msg_recv(&msg, sock, ZMQ_DONTWAIT);
    if (n < 0) {
        scape_rc rc = zmq_failed("receive from", o->status_ep);
        zmq_msg_close(&msg); /* cannot fail on an initialised message */
        return rc;
    }
    Scape__Reply *r = scape__reply__unpack(NULL, zmq_msg_size(&msg), zmq_msg_data(&msg));
    zmq_msg_close(&msg);
    if (r == NULL)
        return scape_set_error(SCAPE_PROTO, "undecodable reply (%d bytes) from %s", n,
                               o->status_ep);
    if (r->status != SCAPE__STATUS__OK) {
        scape_rc rc = refused(r);
        scape__reply__free_unpacked(r, NULL);
        return rc;
    }
    *reply = r;
    return SCAPE_OK;
}

/* ZeroMQ would retry an ipc:// endpoint with no socket file until the
 * timeout; when there is none, nobody can answer, so say so at once (or
 * after start_wait_ms, for a daemon that is still starting; said once). */
static scape_rc socket_exists(const ctl_opts *o)
{
    const char *path = o->status_ep + strlen("ipc://");
    struct stat st;
    int64_t until = ctl_now_ms() + o->start_wait_ms;
    static int said;
    while (stat(path, &st) != 0 && errno == ENOENT && ctl_now_ms() < until &&
           !ctl_interrupted) {
        if (!said++)
            fprintf(stderr, "scapectl: waiting up to %d s for scaped at %s to start\n",
                    (o->start_wait_ms + 999) / 1000, o->status_ep);
        nanosleep(&(struct timespec){ 0, 50000000 }, NULL); /* a signal only shortens it */
    }
    if (stat(path, &st) == 0)
        return SCAPE_OK;
    return scape_set_error(SCAPE_TIMEOUT,
                           "no answer from scaped at %s: %s (is it running? runtime dir %s)",
                           o->status_ep, strerror(errno), o->dir);
}

scape_rc ctl_ask(const ctl_opts *o, const Scape__Request *q, Scape__Reply **reply)
{
    int64_t deadline = ctl_now_ms() + o->timeout_ms;
    void *sock = NULL;
    int ready = 0;
    scape_rc rc = socket_exists(o);
    if (rc == SCAPE_OK)
        rc = ctl_connect(o, ZMQ_REQ, o->status_ep, &sock);
    if (rc == SCAPE_OK)
        rc = send_request(sock, o, q);
    if (rc == SCAPE_OK)
        rc = ctl_wait(sock, deadline, &ready);
    if (rc == SCAPE_OK)
        rc = ready ? recv_reply(sock, o, reply) : no_answer(o);
    return ctl_close(&sock, rc);
}

scape_rc ctl_status(const ctl_opts *o, Scape__Reply **reply)
{
    Scape__StatusRequest body = SCAPE__STATUS_REQUEST__INIT;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_STATUS;
    q.status = &body;
    Scape__Reply *r = NULL;
    scape_rc rc = ctl_ask(o, &q, &r);
    if (rc != SCAPE_OK)
        return rc;
    if (r->body_case != SCAPE__REPLY__BODY_STATUS_REPLY) {
        scape__reply__free_unpacked(r, NULL);
        return scape_set_error(SCAPE_PROTO, "%s answered a status request without a status",
                               o->status_ep);
    }
    *reply = r;
    return SCAPE_OK;
}
