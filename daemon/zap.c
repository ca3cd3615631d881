/* zap.c - the ZAP handler of a CURVE server socket (see zap.h).
 *
 * The ZAP endpoint is a ROUTER rather than the usual REP so that requests can
 * wait for the keys and be answered later, in any order.  A request is the
 * frames of RFC 27 after the routing envelope: version, request id, domain,
 * address, routing id, mechanism, credentials (CURVE: the client's 32-byte
 * public key).  Only CURVE is admitted, and only a listed key.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "zap.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01"
#define ZAP_FRAMES 10     /* envelope (2) + the 7 request frames + 1 spare */
#define ZAP_STRANGERS 64  /* requests held until the keys arrive, beyond one per rank */
#define ZAP_SLICE_MS 50
#define KEY_BYTES 32

typedef struct request {
    zmq_msg_t f[ZAP_FRAMES];
    int n;
    long long since;
} request;

struct zap {
    void *router, *mon;
    pthread_t thread;
    atomic_int stop;
    int hold_ms;
    pthread_mutex_t mu;     /* guards everything below */
    unsigned char *keys;    /* n * KEY_BYTES, NULL until zap_allow */
    int nkeys, ready;
    uint64_t refused;
    char why[240];          /* the last refusal */
    char denied[200];       /* the handler's last denial, for the event that follows */
    request *pending;       /* cap: every other rank may knock before the keys come */
    int npending, cap;
};

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void request_close(request *r)
{
    for (int i = 0; i < r->n; i++)
        zmq_msg_close(&r->f[i]);
    r->n = 0;
}

/* Read one whole multi-frame request; 0 if it is not one (then dropped). */
static int request_read(void *router, request *r)
{
    int more = 1;
    r->n = 0;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, router, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            request_close(r);
            return 0;
        }
        more = zmq_msg_more(&m);
        if (r->n < ZAP_FRAMES)
            r->f[r->n++] = m;
        else
            zmq_msg_close(&m);
    }
    r->since = now_ms();
    return 1;
}

static void send_frame(void *router, const void *p, size_t n, int more)
{
    zmq_send(router, p, n, more ? ZMQ_SNDMORE : 0); /* inproc to libzmq: cannot block */
}

/* Answer r: 200 with user id "scape", or 400 with text. */
static void reply(void *router, request *r, int ok, const char *text)
{
    /* envelope: routing id, empty; then version, request id */
    if (r->n >= 4) {
        for (int i = 0; i < 2; i++)
            send_frame(router, zmq_msg_data(&r->f[i]), zmq_msg_size(&r->f[i]), 1);
        send_frame(router, "1.0", 3, 1);
        send_frame(router, zmq_msg_data(&r->f[3]), zmq_msg_size(&r->f[3]), 1);
        send_frame(router, ok ? "200" : "400", 3, 1);
        send_frame(router, text, strlen(text), 1);
        send_frame(router, ok ? "scape" : "", ok ? 5 : 0, 1);
        send_frame(router, "", 0, 0);
    }
    request_close(r);
}

static void frame_text(const request *r, int i, char *buf, size_t len)
{
    size_t n = i < r->n ? zmq_msg_size((zmq_msg_t *)&r->f[i]) : 0;
    if (n >= len)
        n = len - 1;
    memcpy(buf, n ? zmq_msg_data((zmq_msg_t *)&r->f[i]) : "", n);
    buf[n] = '\0';
    for (size_t k = 0; k < n; k++)
        if (buf[k] < 32 || buf[k] > 126)
            buf[k] = '?';
}

/* Judge r with the keys known (mutex held); answers it. */
static void judge(zap *z, request *r)
{
    char addr[64], mech[16], why[200];
    frame_text(r, 5, addr, sizeof addr);
    frame_text(r, 7, mech, sizeof mech);
    int ok = 0;
    if (r->n < 8 || zmq_msg_size(&r->f[2]) != 3 || memcmp(zmq_msg_data(&r->f[2]), "1.0", 3))
        snprintf(why, sizeof why, "a malformed ZAP request");
    else if (strcmp(mech, "CURVE") != 0 || r->n < 9 || zmq_msg_size(&r->f[8]) != KEY_BYTES)
        snprintf(why, sizeof why, "a %s handshake from %s, not CURVE", mech, addr);
    else {
        const unsigned char *k = zmq_msg_data(&r->f[8]);
        for (int i = 0; i < z->nkeys && !ok; i++)
            ok = memcmp(k, z->keys + (size_t)i * KEY_BYTES, KEY_BYTES) == 0;
        char text[ZAP_KEY_Z85];
        if (!ok && zmq_z85_encode(text, k, KEY_BYTES) == NULL)
            snprintf(text, sizeof text, "?");
        if (!ok)
            snprintf(why, sizeof why, "a CURVE key %.12s... from %s that is not a rank of this job",
                     text, addr);
    }
    if (!ok)
        snprintf(z->denied, sizeof z->denied, "%s", why);
    reply(z->router, r, ok, ok ? "OK" : why);
}

static void take_requests(zap *z)
{
    for (;;) {
        request r;
        if (!request_read(z->router, &r))
            return;
        pthread_mutex_lock(&z->mu);
        if (z->ready)
            judge(z, &r);
        else if (z->npending < z->cap)
            z->pending[z->npending++] = r;
        else
            reply(z->router, &r, 0, "too many handshakes before the job's keys were known");
        pthread_mutex_unlock(&z->mu);
    }
}

/* Answer what waited: judged once the keys are there, refused past hold_ms. */
static void answer_pending(zap *z)
{
    pthread_mutex_lock(&z->mu);
    long long t = now_ms();
    int kept = 0;
    for (int i = 0; i < z->npending; i++) {
        request *r = &z->pending[i];
        if (z->ready)
            judge(z, r);
        else if (t - r->since > z->hold_ms) {
            snprintf(z->denied, sizeof z->denied,
                     "a handshake waited %d ms and the job's keys never came", z->hold_ms);
            reply(z->router, r, 0, z->denied);
        } else
            z->pending[kept++] = *r;
    }
    z->npending = kept;
    pthread_mutex_unlock(&z->mu);
}

static const char *protocol_error(uint32_t v)
{
    switch (v) {
    case ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "a peer without CURVE (another mechanism)";
    case ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "a CURVE handshake that does not decrypt (a peer with another server key)";
    default:
        return v >= ZMQ_PROTOCOL_ERROR_ZAP_UNSPECIFIED && v < ZMQ_PROTOCOL_ERROR_WS_UNSPECIFIED
                   ? "a ZAP failure"
                   : "bytes that are not a valid ZMTP handshake";
    }
}

/* One monitor event: count the failed handshakes. */
static void take_event(zap *z)
{
    zmq_msg_t ev, addr;
    zmq_msg_init(&ev);
    zmq_msg_init(&addr);
    if (zmq_msg_recv(&ev, z->mon, ZMQ_DONTWAIT) >= 0 && zmq_msg_more(&ev) &&
        zmq_msg_recv(&addr, z->mon, 0) >= 0 && zmq_msg_size(&ev) >= 6) {
        const unsigned char *d = zmq_msg_data(&ev);
        uint16_t e;
        uint32_t v;
        memcpy(&e, d, sizeof e);
        memcpy(&v, d + 2, sizeof v);
        pthread_mutex_lock(&z->mu);
        if (e == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
            z->refused++;
            snprintf(z->why, sizeof z->why, "%.200s (ZAP %u)",
                     z->denied[0] ? z->denied : "a refused key", v);
        } else if (e == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
            z->refused++;
            snprintf(z->why, sizeof z->why, "%s (ZMTP error 0x%08x)", protocol_error(v), v);
        } else if (e == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
            z->refused++;
            snprintf(z->why, sizeof z->why, "a handshake that broke off (%s): a peer that does "
                     "not speak this job's CURVE, or a rank that stopped in the middle",
                     zmq_strerror((int)v));
        }
        pthread_mutex_unlock(&z->mu);
    }
    zmq_msg_close(&ev);
    zmq_msg_close(&addr);
}

static void *run(void *arg)
{
    zap *z = arg;
    zmq_pollitem_t it[2] = { { z->router, 0, ZMQ_POLLIN, 0 }, { z->mon, 0, ZMQ_POLLIN, 0 } };
    while (!atomic_load(&z->stop)) {
        int n = zmq_poll(it, 2, ZAP_SLICE_MS);
        if (n > 0 && (it[0].revents & ZMQ_POLLIN))
            take_requests(z);
        if (n > 0 && (it[1].revents & ZMQ_POLLIN))
            take_event(z);
        if (z->npending) /* only this thread changes npending's being non-zero */
            answer_pending(z);
    }
    while (z->npending) { /* stopping: nothing more is decided */
        request *r = &z->pending[--z->npending];
        reply(z->router, r, 0, "the daemon is stopping");
    }
    return NULL;
}

static scape_rc zerr(const char *what)
{
    return scape_set_error(SCAPE_ZMQ, "ZAP handler: %s: %s", what, zmq_strerror(zmq_errno()));
}

static void zap_free(zap *z)
{
    if (z->router)
        zmq_close(z->router);
    if (z->mon)
        zmq_close(z->mon);
    pthread_mutex_destroy(&z->mu);
    free(z->keys);
    free(z->pending);
    free(z);
}

scape_rc zap_start(void *ctx, void *server, int hold_ms, int ranks, zap **out)
{
    if (ctx == NULL || server == NULL || out == NULL || hold_ms < 0 || ranks < 1)
        return scape_set_error(SCAPE_INVALID, "zap_start: bad argument");
    zap *z = calloc(1, sizeof *z);
    /* All other ranks get the table at once and may all knock before this
     * one has read it (a loaded node, a large job): hold them all, so that
     * none is refused, and some strangers too. */
    int cap = ranks - 1 + ZAP_STRANGERS;
    if (z == NULL || (z->pending = calloc((size_t)cap, sizeof *z->pending)) == NULL) {
        free(z);
        return scape_set_error(SCAPE_NOMEM, "zap_start: out of memory");
    }
    z->cap = cap;
    pthread_mutex_init(&z->mu, NULL);
    z->hold_ms = hold_ms;
    char name[64];
    snprintf(name, sizeof name, "inproc://scape-zap-monitor-%p", server);
    int zero = 0;
    scape_rc rc = SCAPE_OK;
    if ((z->router = zmq_socket(ctx, ZMQ_ROUTER)) == NULL ||
        zmq_setsockopt(z->router, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_bind(z->router, ZAP_ENDPOINT) != 0)
        rc = zerr("bind " ZAP_ENDPOINT);
    else if (zmq_socket_monitor(server, name, ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                                  ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                                  ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) != 0)
        rc = zerr("zmq_socket_monitor");
    else if ((z->mon = zmq_socket(ctx, ZMQ_PAIR)) == NULL ||
             zmq_setsockopt(z->mon, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
             zmq_connect(z->mon, name) != 0)
        rc = zerr("monitor connect");
    else if (pthread_create(&z->thread, NULL, run, z) != 0)
        rc = scape_set_error(SCAPE_SYSTEM, "ZAP handler: pthread_create failed");
    if (rc != SCAPE_OK) {
        zap_free(z);
        return rc;
    }
    *out = z;
    return SCAPE_OK;
}

scape_rc zap_allow(zap *z, const char *const *keys, int n)
{
    if (z == NULL || keys == NULL || n < 1)
        return scape_set_error(SCAPE_INVALID, "zap_allow: bad argument");
    unsigned char *k = malloc((size_t)n * KEY_BYTES);
    if (k == NULL)
        return scape_set_error(SCAPE_NOMEM, "zap_allow: out of memory");
    for (int i = 0; i < n; i++)
        if (keys[i] == NULL || strlen(keys[i]) != ZAP_KEY_Z85 - 1 ||
            zmq_z85_decode(k + (size_t)i * KEY_BYTES, keys[i]) == NULL) {
            free(k);
            return scape_set_error(SCAPE_PROTO, "zap_allow: key %d is not a Z85 CURVE key", i);
        }
    pthread_mutex_lock(&z->mu);
    free(z->keys);
    z->keys = k;
    z->nkeys = n;
    z->ready = 1;
    pthread_mutex_unlock(&z->mu);
    return SCAPE_OK;
}

uint64_t zap_refused(zap *z, char *why, size_t len)
{
    if (z == NULL)
        return 0;
    pthread_mutex_lock(&z->mu);
    uint64_t n = z->refused;
    if (why && len)
        snprintf(why, len, "%s", z->why);
    pthread_mutex_unlock(&z->mu);
    return n;
}

void zap_stop(zap *z)
{
    if (z == NULL)
        return;
    atomic_store(&z->stop, 1);
    pthread_join(z->thread, NULL); /* a zap exists only with its thread running */
    zap_free(z);
}
