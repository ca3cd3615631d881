/* rendezvous.c - rank 0 collects every rank's data endpoint and hands out the
 * table.  ZeroMQ does the retrying: a DEALER keeps reconnecting to a
 * coordinator that is not up yet, and its join waits in the queue meanwhile;
 * only the overall deadline ends the wait. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* getifaddrs, IFF_* */
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "comm.h"
#include "log.h"
#include "rendezvous.h"
#include "try.h"
#include "scape.pb-c.h"
#include "scape_wire.h"

#define RDV_PROTOCOL 2 /* 2: seals and CURVE keys */
#define RDV_KEY_CHARS 40
#define RDV_BACKLOG_SPARE 64 /* pending connections beyond one per rank */

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

static scape_rc check_opts(const rdv_opts *o, const rdv_result *out)
{
    if (o == NULL || out == NULL || o->endpoint == NULL)
        return scape_set_error(SCAPE_INVALID, "rendezvous: NULL argument");
    if (o->world < 1 || o->rank < 0 || o->rank >= o->world)
        return scape_set_error(SCAPE_INVALID, "rendezvous: rank %d outside world %d", o->rank,
                               o->world);
    if (o->world > 1 && o->coordinator == NULL)
        return scape_set_error(SCAPE_INVALID, "rendezvous: no coordinator endpoint");
    if (o->timeout_ms < 1 || o->blob_len > RDV_BLOB_MAX || (o->blob_len && !o->blob))
        return scape_set_error(SCAPE_INVALID, "rendezvous: bad timeout or blob");
    if (o->curve_key && strlen(o->curve_key) != RDV_KEY_CHARS)
        return scape_set_error(SCAPE_INVALID, "rendezvous: a CURVE key is 40 Z85 characters");
    return SCAPE_OK;
}

static scape_rc new_result(rdv_result *out, const rdv_opts *o)
{
    memset(out, 0, sizeof *out);
    out->endpoints = calloc((size_t)o->world, sizeof *out->endpoints);
    out->keys = o->curve_key ? calloc((size_t)o->world, sizeof *out->keys) : NULL;
    out->world = o->world;
    return out->endpoints && (out->keys || !o->curve_key)
               ? SCAPE_OK
               : scape_set_error(SCAPE_NOMEM, "rendezvous: out of memory");
}

void rdv_result_free(rdv_result *r)
{
    for (int i = 0; r && r->endpoints && i < r->world; i++)
        free(r->endpoints[i]);
    for (int i = 0; r && r->keys && i < r->world; i++)
        free(r->keys[i]);
    if (r) {
        free(r->endpoints);
        free(r->keys);
        memset(r, 0, sizeof *r);
    }
}

/* Wait up to the deadline for a message on sock (a shutdown request, see
 * comm_set_interrupt, ends a wait that stalls as if the deadline had
 * passed). */
static int wait_in(void *sock, double deadline)
{
    zmq_pollitem_t it = { sock, 0, ZMQ_POLLIN, 0 };
    for (;;) {
        double left = deadline - now_ms();
        if (left <= 0 || comm_interrupted())
            return 0;
        long slice = left < COMM_INTERRUPT_SLICE_MS ? (long)left : COMM_INTERRUPT_SLICE_MS;
        int n = zmq_poll(&it, 1, slice);
        if (n > 0) {
            comm_progress();
            return 1;
        }
        if (n < 0 && zmq_errno() != EINTR)
            return 0;
    }
}

/* Send reply r to the peer with routing id rid (rank 0's side). */
/* Send reply r to the peer with routing id rid (rank 0's side), sealed
 * with a (NULL: plain, as refusals go). */
static scape_rc send_reply(void *sock, const void *rid, size_t rid_len, const Scape__RdvReply *r,
                           auth_ctx *a)
{
    size_t len = scape__rdv_reply__get_packed_size(r), slen = 0;
    uint8_t *buf = malloc(len ? len : 1), *sealed = NULL;
    if (buf == NULL)
        return scape_set_error(SCAPE_NOMEM, "rendezvous: out of memory");
    scape__rdv_reply__pack(r, buf);
    scape_rc rc = auth_seal(a, buf, len, 1, &sealed, &slen);
    free(buf);
    if (rc == SCAPE_OK && (zmq_send(sock, rid, rid_len, ZMQ_SNDMORE) < 0 ||
                           zmq_send(sock, sealed, slen, 0) < 0))
        rc = scape_set_error(SCAPE_ZMQ, "rendezvous: send: %s", zmq_strerror(zmq_errno()));
    free(sealed);
    return rc;
}

static void refuse(void *sock, const void *rid, size_t rid_len, scape_rc rc)
{
    Scape__Error e = SCAPE__ERROR__INIT;
    e.code = wire_status(rc);
    e.message = (char *)scape_last_error();
    Scape__RdvReply r = SCAPE__RDV_REPLY__INIT;
    r.status = e.code;
    r.error = &e;
    send_reply(sock, rid, rid_len, &r, NULL); /* best effort: the join is refused anyway */
}

/* ---- rank 0 ---------------------------------------------------------------- */

typedef struct joiner {
    unsigned char rid[256];
    size_t rid_len;
} joiner;

/* Refused joins: the first RDV_LOG_FIRST are logged one by one, then at most
 * one line per RDV_LOG_EVERY_MS with how many came since, so that a flood of
 * bogus joins cannot flood the log. */
#define RDV_LOG_FIRST 5
#define RDV_LOG_EVERY_MS 10000
#define RDV_LOG_EVERY_TEXT "10 s"

typedef struct refusals {
    uint64_t count;    /* refused in all */
    uint64_t unlogged; /* refused since the last line */
    double since_ms;   /* when the current interval began */
    char last[400];    /* the latest unlogged one: whence and why */
} refusals;

/* tail: what follows the line ("" once the rendezvous is over). */
static void refusals_flush(refusals *f, const char *tail)
{
    if (f->unlogged)
        LOG_WARN(SUB_COMM, "refused %llu more joins in the last %.0f s (%llu in all); the "
                 "latest %s%s", (unsigned long long)f->unlogged,
                 (now_ms() - f->since_ms) / 1e3, (unsigned long long)f->count, f->last, tail);
    f->unlogged = 0;
    f->since_ms = now_ms();
}

static void refusals_note(refusals *f, const char *peer, const char *why)
{
    if (++f->count <= RDV_LOG_FIRST) {
        LOG_WARN(SUB_COMM, "refused a join from %s: %s; still waiting for the job's ranks%s",
                 peer, why, f->count == RDV_LOG_FIRST
                                ? " (more refusals: one line every " RDV_LOG_EVERY_TEXT
                                  " with their count)"
                                : "");
        f->since_ms = now_ms();
        return;
    }
    f->unlogged++;
    snprintf(f->last, sizeof f->last, "from %s: %.300s", peer, why);
    if (now_ms() - f->since_ms >= RDV_LOG_EVERY_MS)
        refusals_flush(f, "; still waiting for the job's ranks");
}

/* Check one join; on success record the rank's endpoint. */
static scape_rc admit(const rdv_opts *o, const Scape__RdvJoin *j, rdv_result *out)
{
    if (j->protocol != RDV_PROTOCOL)
        return scape_set_error(SCAPE_PROTO, "rendezvous: protocol %u, rank 0 speaks %d",
                               j->protocol, RDV_PROTOCOL);
    if (j->job != o->job)
        return scape_set_error(SCAPE_INVALID,
                               "rendezvous: job %llu is not this job (%llu): another job's "
                               "daemon on this coordinator?",
                               (unsigned long long)j->job, (unsigned long long)o->job);
    if ((int)j->world != o->world || j->rank == 0 || (int)j->rank >= o->world)
        return scape_set_error(SCAPE_INVALID, "rendezvous: rank %u of %u does not fit world %d",
                               j->rank, j->world, o->world);
    if (out->endpoints[j->rank])
        return scape_set_error(SCAPE_INVALID, "rendezvous: rank %u joined twice", j->rank);
    int has_key = j->curve_key != NULL;
    if (has_key != (o->curve_key != NULL))
        return scape_set_error(SCAPE_INVALID, "rendezvous: rank %u %s a CURVE key and rank 0 "
                               "%s (do all ranks have the same auth and comm_backend?)", j->rank,
                               has_key ? "sends" : "has no", has_key ? "has none" : "has one");
    if (has_key && strlen(j->curve_key) != RDV_KEY_CHARS)
        return scape_set_error(SCAPE_PROTO, "rendezvous: rank %u's CURVE key is malformed",
                               j->rank);
    if ((out->endpoints[j->rank] = strdup(j->endpoint)) == NULL ||
        (has_key && (out->keys[j->rank] = strdup(j->curve_key)) == NULL))
        return scape_set_error(SCAPE_NOMEM, "rendezvous: cannot keep rank %u", j->rank);
    return SCAPE_OK;
}

scape_rc rdv_judge_join(const rdv_opts *o, const void *buf, size_t n, rdv_result *out,
                        int *rank)
{
    uint8_t *plain = NULL;
    size_t pn = 0;
    if (n > RDV_JOIN_MAX)
        return scape_set_error(SCAPE_PROTO, "rendezvous: a join of %zu bytes (at most %d)", n,
                               RDV_JOIN_MAX);
    if (auth_open(o->auth, buf, n, &plain, &pn) != SCAPE_OK)
        return scape_set_error(SCAPE_INVALID, "rendezvous (auth %s): %s",
                               auth_mode_name(auth_ctx_mode(o->auth)), scape_last_error());
    Scape__RdvJoin *j = scape__rdv_join__unpack(NULL, pn, plain);
    free(plain);
    if (j == NULL)
        return scape_set_error(SCAPE_PROTO, "rendezvous: undecodable join of %zu bytes", n);
    scape_rc rc = admit(o, j, out);
    if (rc == SCAPE_OK)
        *rank = (int)j->rank;
    scape__rdv_join__free_unpacked(j, NULL);
    return rc;
}

/* Receive and judge one join; refused joiners are told why, and the
 * refusal is logged with where it came from. */
static int take_join(void *sock, const rdv_opts *o, rdv_result *out, joiner *who,
                     refusals *f)
{
    unsigned char rid[256];
    int rl = zmq_recv(sock, rid, sizeof rid, 0);
    zmq_msg_t m;
    zmq_msg_init(&m);
    int got = rl >= 0 && zmq_msg_recv(&m, sock, 0) >= 0;
    for (int more = got && zmq_msg_more(&m); more;) { /* a join is one frame: drop the rest */
        zmq_msg_t extra;
        zmq_msg_init(&extra);
        more = zmq_msg_recv(&extra, sock, 0) >= 0 && zmq_msg_more(&extra);
        zmq_msg_close(&extra);
    }
    if (!got) {
        zmq_msg_close(&m);
        return 0;
    }
    size_t rid_len = (size_t)rl > sizeof rid ? sizeof rid : (size_t)rl;
    int rank = 0;
    scape_rc rc = rdv_judge_join(o, zmq_msg_data(&m), zmq_msg_size(&m), out, &rank);
    if (rc == SCAPE_OK) {
        memcpy(who[rank].rid, rid, rid_len);
        who[rank].rid_len = rid_len;
    } else {
        const char *peer = zmq_msg_gets(&m, "Peer-Address");
        refusals_note(f, peer ? peer : "an unknown address", scape_last_error());
        refuse(sock, rid, rid_len, rc);
    }
    zmq_msg_close(&m);
    return rc == SCAPE_OK;
}

static scape_rc missing(const rdv_opts *o, const rdv_result *out)
{
    char list[512] = "";
    size_t used = 0;
    for (int r = 1; r < o->world && used + 12 < sizeof list; r++)
        if (out->endpoints[r] == NULL)
            used += (size_t)snprintf(list + used, sizeof list - used, " %d", r);
    return scape_set_error(SCAPE_TIMEOUT,
                           "rendezvous: rank(s)%s never joined %s within %d ms", list,
                           o->coordinator, o->timeout_ms);
}

/* Every joiner gets the table, each in its own seal. */
static scape_rc send_table(void *sock, const rdv_opts *o, const rdv_result *out,
                           const joiner *who)
{
    Scape__RdvTable t = SCAPE__RDV_TABLE__INIT;
    t.n_endpoints = (size_t)o->world;
    t.endpoints = out->endpoints;
    t.n_curve_keys = out->keys ? (size_t)o->world : 0;
    t.curve_keys = out->keys;
    t.has_blob = o->blob_len > 0;
    t.blob.len = o->blob_len;
    t.blob.data = (uint8_t *)o->blob;
    Scape__RdvReply r = SCAPE__RDV_REPLY__INIT;
    r.table = &t;
    for (int k = 1; k < o->world; k++)
        TRY(send_reply(sock, who[k].rid, who[k].rid_len, &r, o->auth));
    return SCAPE_OK;
}

/* Rank 0 listens on every interface at the coordinator's port: the name the
 * others connect to (a host name, often) is not something ZeroMQ can bind. */
static scape_rc bind_address(const char *coordinator, char *buf, size_t len)
{
    const char *colon = strrchr(coordinator, ':');
    if (strncmp(coordinator, "tcp://", 6) != 0 || colon == NULL || colon[1] == '\0' ||
        colon < coordinator + 6)
        return scape_set_error(SCAPE_INVALID,
                               "rendezvous: coordinator '%s' is not tcp://host:port", coordinator);
    if ((size_t)snprintf(buf, len, "tcp://*%s", colon) >= len)
        return scape_set_error(SCAPE_INVALID, "rendezvous: coordinator too long");
    return SCAPE_OK;
}

static scape_rc serve(void *ctx, const rdv_opts *o, rdv_result *out)
{
    char where[300];
    TRY(bind_address(o->coordinator, where, sizeof where));
    void *sock = zmq_socket(ctx, ZMQ_ROUTER);
    int linger = o->timeout_ms; /* the table must leave before the socket closes */
    int64_t maxmsg = RDV_JOIN_MAX + 1; /* longer: refused as such, never held */
    /* every rank connects at once: past the backlog (ZeroMQ's default: 100)
     * the kernel drops connections, which then wait for TCP's SYN retries */
    int backlog = o->world + RDV_BACKLOG_SPARE;
    joiner *who = calloc((size_t)o->world, sizeof *who);
    scape_rc rc = SCAPE_OK;
    if (sock == NULL || who == NULL ||
        zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_setsockopt(sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg) != 0 ||
        zmq_setsockopt(sock, ZMQ_BACKLOG, &backlog, sizeof backlog) != 0 ||
        zmq_bind(sock, where) != 0)
        rc = scape_set_error(SCAPE_ZMQ, "rendezvous: bind %s: %s", where,
                             zmq_strerror(zmq_errno()));
    double deadline = now_ms() + o->timeout_ms;
    refusals f = { 0 };
    for (int joined = 1; rc == SCAPE_OK && joined < o->world;) {
        if (!wait_in(sock, deadline))
            rc = missing(o, out);
        else
            joined += take_join(sock, o, out, who, &f);
    }
    refusals_flush(&f, "");
    if (f.count)
        LOG_WARN(SUB_COMM, "rendezvous: refused %llu joins in all (bogus, of another job, or "
                 "not sealed by its user)", (unsigned long long)f.count);
    out->refused = f.count;
    if (rc == SCAPE_OK)
        rc = send_table(sock, o, out, who);
    if (sock)
        zmq_close(sock);
    free(who);
    return rc;
}

/* ---- the other ranks ---------------------------------------------------------- */

static scape_rc send_join(void *sock, const rdv_opts *o)
{
    Scape__RdvJoin j = SCAPE__RDV_JOIN__INIT;
    j.protocol = RDV_PROTOCOL;
    j.job = o->job;
    j.rank = (uint32_t)o->rank;
    j.world = (uint32_t)o->world;
    j.endpoint = (char *)o->endpoint;
    j.curve_key = (char *)o->curve_key;
    uint8_t buf[RDV_JOIN_MAX], *sealed = NULL;
    size_t len = scape__rdv_join__get_packed_size(&j), slen = 0;
    if (len > sizeof buf / 2) /* room for the seal */
        return scape_set_error(SCAPE_INVALID, "rendezvous: endpoint too long");
    scape__rdv_join__pack(&j, buf);
    TRY(auth_seal(o->auth, buf, len, 0, &sealed, &slen));
    scape_rc rc = SCAPE_OK;
    if (slen > RDV_JOIN_MAX)
        rc = scape_set_error(SCAPE_INVALID, "rendezvous: sealed join too long (%zu bytes)", slen);
    else if (zmq_send(sock, sealed, slen, 0) < 0)
        rc = scape_set_error(SCAPE_ZMQ, "rendezvous: send: %s", zmq_strerror(zmq_errno()));
    free(sealed);
    return rc;
}

static scape_rc read_table(const Scape__RdvReply *r, const rdv_opts *o, rdv_result *out)
{
    if (r->status != SCAPE__STATUS__OK)
        return scape_set_error(wire_rc(r->status), "rendezvous: rank 0 refused rank %d: %s",
                               o->rank, r->error && r->error->message ? r->error->message : "?");
    const Scape__RdvTable *t = r->table;
    if (t == NULL || (int)t->n_endpoints != o->world || t->blob.len > RDV_BLOB_MAX)
        return scape_set_error(SCAPE_PROTO, "rendezvous: malformed table from rank 0");
    if ((o->curve_key != NULL) != (t->n_curve_keys > 0) ||
        (t->n_curve_keys && (int)t->n_curve_keys != o->world))
        return scape_set_error(SCAPE_PROTO, "rendezvous: rank 0's table %s CURVE keys and rank "
                               "%d %s (do all ranks have the same auth?)",
                               t->n_curve_keys ? "has" : "has no", o->rank,
                               o->curve_key ? "has one" : "has none");
    for (int k = 0; k < (int)t->n_curve_keys; k++)
        if (strlen(t->curve_keys[k]) != RDV_KEY_CHARS ||
            (k == o->rank && strcmp(t->curve_keys[k], o->curve_key) != 0))
            return scape_set_error(SCAPE_PROTO, "rendezvous: rank 0's table has a bad CURVE key "
                                   "for rank %d", k);
    for (int k = 0; k < o->world; k++)
        if ((out->endpoints[k] = strdup(t->endpoints[k])) == NULL ||
            (out->keys && (out->keys[k] = strdup(t->curve_keys[k])) == NULL))
            return scape_set_error(SCAPE_NOMEM, "rendezvous: out of memory");
    out->blob_len = t->has_blob ? t->blob.len : 0;
    if (out->blob_len)
        memcpy(out->blob, t->blob.data, out->blob_len);
    return SCAPE_OK;
}

/* A table counts only sealed by the job's user; a refusal may come plain
 * (rank 0 could not open our join, so we might not open its answer). */
scape_rc rdv_read_reply(const rdv_opts *o, const void *buf, size_t n, rdv_result *out)
{
    uint8_t *plain = NULL;
    size_t pn = 0;
    int sealed = auth_open(o->auth, buf, n, &plain, &pn) == SCAPE_OK;
    char why[300];
    snprintf(why, sizeof why, "%s", sealed ? "" : scape_last_error());
    Scape__RdvReply *r = scape__rdv_reply__unpack(NULL, sealed ? pn : n, sealed ? plain : buf);
    free(plain);
    if (r == NULL)
        return scape_set_error(SCAPE_PROTO, "rendezvous: undecodable answer from rank 0 "
                               "(%zu bytes)%s%s", n, why[0] ? ": " : "", why);
    scape_rc rc = !sealed && r->status == SCAPE__STATUS__OK
                      ? scape_set_error(SCAPE_INVALID, "rendezvous: an answer from rank 0 that "
                                        "is not sealed by the job's user: %s", why)
                      : read_table(r, o, out);
    scape__rdv_reply__free_unpacked(r, NULL);
    return rc;
}

static scape_rc join(void *ctx, const rdv_opts *o, rdv_result *out)
{
    void *sock = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    scape_rc rc = SCAPE_OK;
    if (sock == NULL || zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_connect(sock, o->coordinator) != 0)
        rc = scape_set_error(SCAPE_ZMQ, "rendezvous: connect %s: %s", o->coordinator,
                             zmq_strerror(zmq_errno()));
    if (rc == SCAPE_OK)
        rc = send_join(sock, o);
    if (rc == SCAPE_OK && !wait_in(sock, now_ms() + o->timeout_ms))
        rc = scape_set_error(SCAPE_TIMEOUT,
                             "rendezvous: rank 0 at %s did not answer rank %d within %d ms "
                             "(is it running, in this job?)",
                             o->coordinator, o->rank, o->timeout_ms);
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (rc == SCAPE_OK && zmq_msg_recv(&msg, sock, 0) < 0)
        rc = scape_set_error(SCAPE_ZMQ, "rendezvous: receive: %s", zmq_strerror(zmq_errno()));
    if (rc == SCAPE_OK)
        rc = rdv_read_reply(o, zmq_msg_data(&msg), zmq_msg_size(&msg), out);
    zmq_msg_close(&msg);
    if (sock)
        zmq_close(sock);
    return rc;
}

scape_rc rdv_run(const rdv_opts *o, rdv_result *out)
{
    scape_rc rc = check_opts(o, out);
    if (rc == SCAPE_OK)
        rc = new_result(out, o);
    if (rc != SCAPE_OK)
        return rc;
    void *ctx = zmq_ctx_new();
    if (ctx == NULL)
        rc = scape_set_error(SCAPE_ZMQ, "rendezvous: zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
    else if (o->rank == 0 && ((out->endpoints[0] = strdup(o->endpoint)) == NULL ||
                              (out->keys && (out->keys[0] = strdup(o->curve_key)) == NULL)))
        rc = scape_set_error(SCAPE_NOMEM, "rendezvous: out of memory");
    else if (o->rank == 0 && o->world > 1)
        rc = serve(ctx, o, out);
    else if (o->rank > 0)
        rc = join(ctx, o, out);
    if (rc == SCAPE_OK && o->rank == 0) {
        out->blob_len = o->blob_len;
        if (o->blob_len)
            memcpy(out->blob, o->blob, o->blob_len);
    }
    if (ctx)
        zmq_ctx_term(ctx);
    if (rc != SCAPE_OK)
        rdv_result_free(out);
    return rc;
}

/* ---- Slurm ----------------------------------------------------------------------- */

/* The first host of a Slurm host list: its first top-level item, each
 * bracket group replaced by the first number of its first range (zero padding
 * kept): "gh[001-004,010],login1" -> gh001, "rack[1-2]-n[1-3]" -> rack1-n1. */
scape_rc rdv_first_host(const char *list, char *host, size_t len)
{
    if (list == NULL || *list == '\0' || *list == ',')
        return scape_set_error(SCAPE_INVALID, "host list is empty");
    size_t o = 0;
    for (const char *c = list; *c && *c != ',';) {
        size_t take;
        const char *from = c;
        if (*c == '[') {
            const char *num = c + 1;
            size_t digits = strspn(num, "0123456789");
            size_t body = strspn(num, "0123456789-,");
            if (digits == 0 || num[body] != ']' ||
                (num[digits] != '-' && num[digits] != ',' && num[digits] != ']'))
                return scape_set_error(SCAPE_INVALID, "cannot read the host list '%s'", list);
            from = num;
            take = digits;
            c = num + body + 1;
        } else {
            take = strcspn(c, ",[]");
            if (c[take] == ']')
                return scape_set_error(SCAPE_INVALID, "cannot read the host list '%s'", list);
            c += take;
        }
        if (o + take >= len)
            return scape_set_error(SCAPE_INVALID, "host name in '%s' is too long", list);
        memcpy(host + o, from, take);
        o += take;
    }
    host[o] = '\0';
    return SCAPE_OK;
}

static scape_rc env_long(const char *name, long lo, long hi, long *out)
{
    const char *v = getenv(name);
    char *end = NULL;
    long x = v ? strtol(v, &end, 10) : 0;
    if (v == NULL || *v == '\0' || *end != '\0' || x < lo || x > hi)
        return scape_set_error(SCAPE_INVALID, "%s='%s' is not an integer in [%ld, %ld]", name,
                               v ? v : "(unset)", lo, hi);
    *out = x;
    return SCAPE_OK;
}

scape_rc rdv_from_slurm(int *rank, int *world, uint64_t *job, char *host, size_t len)
{
    long r = 0, w = 1, j = 0;
    scape_rc rc = env_long("SLURM_PROCID", 0, 1 << 20, &r);
    if (rc == SCAPE_OK)
        rc = env_long("SLURM_NTASKS", 1, 1 << 20, &w);
    if (rc == SCAPE_OK)
        rc = env_long("SLURM_JOB_ID", 0, 0x7fffffffL, &j);
    if (rc == SCAPE_OK && r >= w)
        rc = scape_set_error(SCAPE_INVALID, "SLURM_PROCID=%ld >= SLURM_NTASKS=%ld", r, w);
    const char *nodes = getenv("SLURM_STEP_NODELIST");
    if (nodes == NULL || *nodes == '\0')
        nodes = getenv("SLURM_JOB_NODELIST");
    if (rc == SCAPE_OK && (nodes == NULL || *nodes == '\0'))
        rc = scape_set_error(SCAPE_INVALID,
                             "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set");
    if (rc == SCAPE_OK)
        rc = rdv_first_host(nodes, host, len);
    if (rc == SCAPE_OK) {
        *rank = (int)r;
        *world = (int)w;
        *job = (uint64_t)j;
    }
    return rc;
}

static int is_loopback(const struct in_addr *a) { return (ntohl(a->s_addr) >> 24) == 127; }

/* The first IPv4 address of an interface that is up, running (a bridge with
 * nothing on it is not) and not loopback. */
static int interface_address(struct in_addr *out)
{
    struct ifaddrs *all = NULL;
    if (getifaddrs(&all) != 0)
        return 0;
    int found = 0;
    for (const struct ifaddrs *i = all; i && !found; i = i->ifa_next) {
        if (i->ifa_addr == NULL || i->ifa_addr->sa_family != AF_INET ||
            !(i->ifa_flags & IFF_UP) || !(i->ifa_flags & IFF_RUNNING) ||
            (i->ifa_flags & IFF_LOOPBACK))
            continue;
        *out = ((const struct sockaddr_in *)(const void *)i->ifa_addr)->sin_addr;
        found = !is_loopback(out);
    }
    freeifaddrs(all);
    return found;
}

int rdv_slurm_port(uint64_t job)
{
    return RDV_SLURM_PORT_BASE + (int)(job % RDV_SLURM_PORT_SPAN);
}

/* What the host name resolves to, unless that is only loopback (Debian maps
 * the name to 127.0.1.1): then the first address of an interface that is up;
 * loopback only when there is nothing else (one machine). */
scape_rc rdv_host_address(char *buf, size_t len)
{
    char name[256];
    if (gethostname(name, sizeof name) != 0)
        return scape_set_error(SCAPE_SYSTEM, "gethostname failed");
    name[sizeof name - 1] = '\0';
    struct addrinfo hints = { .ai_family = AF_INET, .ai_socktype = SOCK_STREAM }, *res = NULL;
    int e = getaddrinfo(name, NULL, &hints, &res);
    struct in_addr pick = { 0 }, loop = { 0 };
    int have = 0, have_loop = 0;
    for (const struct addrinfo *a = e == 0 ? res : NULL; a && !have; a = a->ai_next) {
        struct in_addr x = ((const struct sockaddr_in *)(const void *)a->ai_addr)->sin_addr;
        if (!is_loopback(&x)) {
            pick = x;
            have = 1;
        } else if (!have_loop) {
            loop = x;
            have_loop = 1;
        }
    }
    if (res)
        freeaddrinfo(res);
    if (!have)
        have = interface_address(&pick);
    if (!have && have_loop) {
        pick = loop;
        have = 1;
    }
    if (!have)
        return scape_set_error(SCAPE_SYSTEM, "no IPv4 address for this host '%s'%s%s", name,
                               e ? ": " : "", e ? gai_strerror(e) : "");
    return inet_ntop(AF_INET, &pick, buf, (socklen_t)len)
               ? SCAPE_OK
               : scape_set_error(SCAPE_SYSTEM, "inet_ntop failed");
}
