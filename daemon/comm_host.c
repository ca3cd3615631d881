/* comm_host.c - the `host` comm backend: TCP between daemons over ZeroMQ.
 *
 * Sockets.  Each rank binds one PULL socket at its endpoint and keeps one
 * PUSH socket per peer.  High-water marks are off (0): a send never blocks,
 * so no cycle of ranks blocked in send can deadlock; the price is that a
 * collective may park up to one extra copy of its data in ZeroMQ's queues.
 *
 * Framing.  Every message is two frames: a 32-byte header (magic, kind,
 * sender, job, op sequence number, chunk index) and the payload.  The
 * receiver checks magic and job, that the sender is a peer, that the op is
 * the current one (a later op's message is kept aside until that op runs: a
 * fast rank may start the next collective before this one finished here; an
 * earlier op's message is an error), that the kind and sender are what the
 * schedule expects and that chunks of each stream arrive in order with the
 * expected length.  A message that cannot be from a rank of this job (not
 * header + payload, a bad magic number, another job's id) is dropped and
 * counted (comm_foreign): a stray sender, such as a rank of an earlier job
 * still pushing to a reused port, must not bring this job down.  Anything
 * else, from a rank of this job, fails the call with SCAPE_PROTO.
 *
 * Sum order.  Reduce-scatter is direct: every rank sends each owner its
 * part of the owner's segment, chunk by chunk, and the owner adds the parts
 * in rank order, so every element is ((x0 + x1) + x2) + ..., bit for bit what
 * the local backend computes (a ring would sum each segment in another
 * rotation of the ranks).  A part that comes before its turn waits in its
 * sender's queue.  Each rank sends T - own and receives (R-1) * own (T = the
 * whole vector): the ring's totals, in one hop instead of R-1.  All-reduce is
 * that reduce-scatter over equal segments (as comm_local) and a direct
 * all-gather: 2T(R-1)/R each way per rank, as a ring.
 *
 * All-gather is direct: each rank sends its segment, chunked, to every peer
 * (chunk-major, peers in rotated order).  Each rank receives total - own and
 * sends (R-1) * own, the ring's totals without its R-1 forwarding steps.
 * Broadcast is a pipelined chain root -> root+1 -> ... (ring order).  Barrier:
 * every rank reports to rank 0, which releases them all.
 *
 * Asynchronous all-gather.  Its start queues every chunk for every peer (the
 * send buffer is copied, so it may be reused at once); ZeroMQ's I/O thread
 * moves the bytes while the caller computes or runs other collectives.  Its
 * messages (their own kind and sequence) are copied into recv by whichever
 * call receives them - any collective on this comm or the wait - so there is
 * no helper thread and the comm stays single-threaded.
 *
 * Failures.  Every wait for a peer is bounded by timeout_ms.  After any
 * failure (timeout, protocol, ZeroMQ) the comm refuses every further
 * collective with the same code: its peers are in an unknown state.
 *
 * Failure reports.  A wait that gives up on rank k (a timeout, or k gone)
 * tells every other peer so (K_FAIL, queued without blocking); a rank with
 * such a report in hand fails its wait at once, or its next one, naming k.
 * The first report names the culprit, unless the rank it names reports too:
 * that rank is alive, and whom it waited on replaces it.  So a rank stuck
 * on a hung peer and the ranks stuck behind it name the same rank: before
 * failing, a rank whose culprit is still connected reads reports a little
 * longer (settle) for the culprit's own.
 *
 * Lost peers.  A ZeroMQ monitor on each PUSH socket reports when its TCP
 * connection closes or comes back.  A peer whose daemon died closes them at
 * once (its kernel does), so a wait fails as soon as some peer's connection
 * has stayed closed for LOST_GRACE_MS (or timeout_ms, if shorter), naming
 * that peer - not only after timeout_ms, and not naming whichever live rank
 * the schedule happened to be waiting for (in a chain every rank after the
 * dead one stops sending too).  A timeout also names the peers that are
 * down.  Without a closed connection (a hung daemon, a lost node) only the
 * timeout tells.
 */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <errno.h>
#include <net/if.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <zmq.h>

#include "comm_host.h"
#include "comm_host_wire.h"
#include "try.h"
#include "zap.h"

#define HOST_DEFAULT_TIMEOUT_MS 30000
#define HOST_DEFAULT_CHUNK (1u << 20)
#define HOST_MAX_RANKS 4096
#define LOST_GRACE_MS 1000  /* a closed connection this long: the peer is gone */
#define REPORT_HOLD_MS 1000 /* longest wait for the named rank's own report */
#define PUMP_DEADLINE SCAPE_RC_COUNT /* pump_one: the deadline passed (no error set) */
#define CURVE_FRAME_OVERHEAD 64 /* "\x07MESSAGE", an 8-byte nonce, a 16-byte MAC, flags */
/* Open files per peer: the TCP connections to and from it, and the
 * mailboxes (eventfds) of its PUSH socket, of that socket's monitor and of
 * the PAIR reading the monitor; and what the rest of the daemon may hold
 * (trainers, checkpoint files, status and metrics clients, the ZAP handler). */
#define HOST_FILES_PER_PEER 5
#define HOST_FILES_SPARE 256
#define HOST_SOCKETS_PER_PEER 3 /* ZeroMQ sockets: PUSH, its monitor, the PAIR */
#define HOST_BACKLOG_SPARE 64   /* pending connections beyond one per peer */

/* What the running collective waits for (hc_waiting_for: status during a
 * wait): the parts of this rank's segment (reduce-scatter), the chunks of an
 * all-gather, one rank (broadcast, a barrier's release), or the barrier's
 * arrivals (rank 0). */
typedef enum { W_NONE = 0, W_RS, W_AG, W_IAG, W_ONE, W_BAR } wait_kind;

typedef struct host_msg {
    wire_hdr h;
    zmq_msg_t body;
    struct host_msg *next;  /* in the stash */
} host_msg;

typedef struct gather {     /* receive side of one all-gather */
    unsigned char *recv;
    size_t *counts;         /* bytes per rank */
    size_t *offs;           /* where each rank's bytes go */
    uint64_t *next;         /* next chunk expected from each rank */
    uint64_t left;          /* chunks still to arrive */
} gather;

typedef struct host {
    void *zctx, *pull;
    zap *zap;               /* CURVE: who may connect to pull (NULL: plain) */
    int curve;              /* messages travel as CURVE boxes */
    void **push;            /* per peer; NULL for this rank */
    void **mon;             /* per peer: PAIR reading push[q]'s monitor events */
    long long *down_since;  /* per peer: when its connection closed (ms), 0: up */
    unsigned char *up;      /* per peer: its connection is established */
    int timeout_ms;
    int handshake_ms;       /* ZMQ_HANDSHAKE_IVL of every socket (handshake_bound) */
    size_t chunk;           /* bytes */
    uint64_t job;
    uint64_t seq;           /* the current (or next) synchronous op */
    uint64_t aseq;          /* the current (or next) asynchronous all-gather */
    int async_active;
    gather sg, ag;          /* synchronous and asynchronous all-gathers */
    size_t *cnt_f, *cnt_b;  /* all-reduce's segment counts: floats, bytes */
    size_t *segoff;         /* reduce-scatter's segment offsets, size + 1 */
    unsigned char *arrived; /* barrier at rank 0 */
    float *scratch;         /* one chunk */
    float *part;            /* one chunk: a received part, aligned for summing */
    uint16_t *half;         /* half a chunk: a part's values as bf16 */
    int rs_bf16;            /* the running reduction's inputs go as bf16 */
    host_msg **rq_head, **rq_tail; /* reduce-scatter: per sender, parts that came
                                      before their turn in the sum, in order */
    uint64_t *rq_next;      /* reduce-scatter: next part expected from each sender */
    host_msg *stash, *stash_tail; /* messages of later ops, in arrival order */
    const char *opname;
    wait_kind waits;        /* what the running op waits for */
    int wait_one;           /* W_ONE: the rank */
    uint64_t sent, recvd;
    uint64_t foreign;       /* dropped messages not of this job */
    char foreign_why[200];  /* the last one */
    int named;              /* the rank a failed wait named (-1: none) */
    int blame, blame_from;  /* the rank named as failed (-1: none yet), and by whom */
    uint64_t blame_seq;     /* the op of that report */
    char blame_why[HOST_FAIL_TEXT + 1]; /* its text */
    uint64_t reports_ignored; /* reports naming no rank this one could name */
    char ignored_why[120];  /* the last one */
    scape_rc failed;
    char failmsg[400];
} host;

static const comm_ops s_host_ops;

static scape_rc zerr(const char *what)
{
    return scape_set_error(SCAPE_ZMQ, "comm host: %s: %s", what, zmq_strerror(zmq_errno()));
}

static uint64_t nchunks(size_t bytes, size_t chunk) { return (bytes + chunk - 1) / chunk; }

static long long now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* ---- sending ---------------------------------------------------------- */

static scape_rc send_msg(comm_t *c, int to, int kind, uint64_t seq, uint64_t chunk,
                         const void *data, size_t len)
{
    host *h = c->impl;
    static const char none;
    wire_hdr w = { .job = h->job, .seq = seq, .chunk = chunk, .magic = HOST_MAGIC,
                   .kind = (uint16_t)kind, .sender = (uint16_t)c->rank };
    /* A signal (SIGUSR1 asks for a checkpoint) may interrupt a blocked send. */
    int r;
    while ((r = zmq_send(h->push[to], &w, sizeof w, ZMQ_SNDMORE)) < 0 && zmq_errno() == EINTR)
        ;
    while (r >= 0 && (r = zmq_send(h->push[to], len ? data : &none, len, 0)) < 0 &&
           zmq_errno() == EINTR)
        ;
    if (r < 0) {
        if (zmq_errno() == EAGAIN)
            return scape_set_error(SCAPE_TIMEOUT,
                                   "comm host: could not queue a message for rank %d "
                                   "within %d ms during %s (op %llu)",
                                   to, h->timeout_ms, h->opname, (unsigned long long)seq);
        return zerr("send");
    }
    h->sent += sizeof w + len;
    return SCAPE_OK;
}

/* ---- receiving -------------------------------------------------------- */

static scape_rc proto(host *h, const host_msg *m, const char *why)
{
    return scape_set_error(SCAPE_PROTO,
                           "comm host: %s (kind %u, op %llu, chunk %llu from rank %u) "
                           "during %s (op %llu)",
                           why, m->h.kind, (unsigned long long)m->h.seq,
                           (unsigned long long)m->h.chunk, m->h.sender, h->opname,
                           (unsigned long long)h->seq);
}

/* Can this message be from a rank of this job at all?  If not, say why. */
static int foreign_msg(const host *h, const host_msg *m, int framed, char *why, size_t len)
{
    if (!framed)
        snprintf(why, len, "a message that is not header + payload");
    else if (m->h.magic != HOST_MAGIC)
        snprintf(why, len, "a message with a bad magic number 0x%08x", m->h.magic);
    else if (m->h.job != h->job)
        snprintf(why, len, "a message of job %llu (from its rank %u); this is job %llu",
                 (unsigned long long)m->h.job, m->h.sender, (unsigned long long)h->job);
    else
        return 0;
    return 1;
}

static scape_rc check_hdr(comm_t *c, const host_msg *m)
{
    host *h = c->impl;
    if (m->h.sender >= c->size || m->h.sender == c->rank)
        return proto(h, m, "a message from an impossible sender");
    if (m->h.kind < K_RS_PART || m->h.kind >= K_END)
        return proto(h, m, "a message of unknown kind");
    return SCAPE_OK;
}

/* A peer's report that a wait of its own gave up on rank m->h.chunk.  The
 * first one names the culprit, unless the rank it names reports in turn (it
 * is alive, so whom it waited on is the better guess): "Failure reports".
 * One about this rank, its sender, a rank out of range or from a sender out
 * of range is counted and dropped. */
static void take_report(comm_t *c, const host_msg *m)
{
    host *h = c->impl;
    uint64_t k = m->h.chunk;
    int from = m->h.sender;
    if (from >= c->size || from == c->rank || k >= (uint64_t)c->size ||
        k == (uint64_t)c->rank || k == (uint64_t)from) {
        h->reports_ignored++;
        snprintf(h->ignored_why, sizeof h->ignored_why, "a report from rank %d that rank %llu "
                 "failed (this is rank %d of %d)", from, (unsigned long long)k, c->rank,
                 c->size);
        return;
    }
    if (h->blame >= 0 && h->blame != from)
        return; /* a culprit is named already */
    h->blame = (int)k;
    h->blame_from = from;
    h->blame_seq = m->h.seq;
    size_t n = zmq_msg_size((zmq_msg_t *)&m->body);
    const unsigned char *p = zmq_msg_data((zmq_msg_t *)&m->body);
    n = n < HOST_FAIL_TEXT ? n : HOST_FAIL_TEXT;
    for (size_t i = 0; i < n; i++) /* a peer's text goes into logs: printable only */
        h->blame_why[i] = p[i] >= 0x20 && p[i] < 0x7f ? (char)p[i] : '?';
    h->blame_why[n] = '\0';
}

/* Receive one two-frame message; *got = 0 if none was waiting, -1 if it was
 * dropped as foreign (counted; m holds nothing) or was a failure report
 * (taken). */
static scape_rc recv_msg(comm_t *c, host_msg *m, int *got)
{
    host *h = c->impl;
    zmq_msg_t hd;
    zmq_msg_init(&hd);
    zmq_msg_init(&m->body);
    memset(&m->h, 0, sizeof m->h);
    *got = 0;
    if (zmq_msg_recv(&hd, h->pull, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&hd);
        return zmq_errno() == EAGAIN || zmq_errno() == EINTR ? SCAPE_OK : zerr("recv");
    }
    int framed = zmq_msg_size(&hd) == sizeof m->h && zmq_msg_more(&hd);
    int more = zmq_msg_more(&hd);
    if (framed)
        memcpy(&m->h, zmq_msg_data(&hd), sizeof m->h);
    zmq_msg_close(&hd);
    *got = 1;
    /* ZeroMQ delivers the frames of a message together: take them all. */
    size_t frames = 1, bytes = 0;
    while (more) {
        zmq_msg_close(&m->body);
        zmq_msg_init(&m->body);
        if (zmq_msg_recv(&m->body, h->pull, ZMQ_DONTWAIT) < 0)
            return zerr("recv");
        frames++;
        bytes += zmq_msg_size(&m->body);
        more = zmq_msg_more(&m->body);
    }
    framed = framed && frames == 2;
    h->recvd += (framed ? sizeof m->h : 0) + bytes;
    if (foreign_msg(h, m, framed, h->foreign_why, sizeof h->foreign_why)) {
        h->foreign++;
        zmq_msg_close(&m->body);
        zmq_msg_init(&m->body);
        *got = -1;
        return SCAPE_OK;
    }
    if (m->h.kind == K_FAIL) {
        take_report(c, m);
        *got = -1;
        return SCAPE_OK;
    }
    return check_hdr(c, m);
}

static void stash_push(host *h, host_msg *m)
{
    m->next = NULL;
    if (h->stash_tail)
        h->stash_tail->next = m;
    else
        h->stash = m;
    h->stash_tail = m;
}

/* Remove and return the first stashed message of (kind class, seq), or NULL. */
static host_msg *stash_take(host *h, int async, uint64_t seq)
{
    host_msg *prev = NULL;
    for (host_msg *m = h->stash; m; prev = m, m = m->next) {
        if ((m->h.kind == K_IAG) != async || m->h.seq != seq)
            continue;
        if (prev)
            prev->next = m->next;
        else
            h->stash = m->next;
        if (h->stash_tail == m)
            h->stash_tail = prev;
        return m;
    }
    return NULL;
}

static void msg_free(host_msg *m)
{
    if (m) {
        zmq_msg_close(&m->body);
        free(m);
    }
}

/* ---- all-gather bookkeeping -------------------------------------------- */

static void gather_begin(comm_t *c, gather *g, void *recv, const size_t *counts)
{
    host *h = c->impl;
    size_t off = 0;
    g->recv = recv;
    g->left = 0;
    for (int q = 0; q < c->size; q++) {
        g->counts[q] = counts[q];
        g->offs[q] = off;
        g->next[q] = 0;
        off += counts[q];
        if (q != c->rank)
            g->left += nchunks(counts[q], h->chunk);
    }
}

/* Place one chunk of rank m->h.sender's segment. */
static scape_rc gather_take(comm_t *c, gather *g, const host_msg *m)
{
    host *h = c->impl;
    int q = m->h.sender;
    size_t start = (size_t)m->h.chunk * h->chunk;
    if (m->h.chunk != g->next[q] || start >= g->counts[q])
        return proto(h, m, "an all-gather chunk out of order");
    size_t len = g->counts[q] - start < h->chunk ? g->counts[q] - start : h->chunk;
    if (zmq_msg_size((zmq_msg_t *)&m->body) != len)
        return proto(h, m, "an all-gather chunk of the wrong length");
    memcpy(g->recv + g->offs[q] + start, zmq_msg_data((zmq_msg_t *)&m->body), len);
    g->next[q]++;
    g->left--;
    return SCAPE_OK;
}

static int gather_missing(comm_t *c, const gather *g)
{
    host *h = c->impl;
    for (int q = 0; q < c->size; q++)
        if (q != c->rank && g->next[q] < nchunks(g->counts[q], h->chunk))
            return q;
    return c->rank;
}

/* Queue this rank's segment for every peer, chunk-major so that every peer
 * gets its first bytes early. */
static scape_rc gather_send(comm_t *c, int kind, uint64_t seq, const void *send, size_t len)
{
    host *h = c->impl;
    for (uint64_t i = 0; i < nchunks(len, h->chunk); i++) {
        size_t start = (size_t)i * h->chunk;
        size_t n = len - start < h->chunk ? len - start : h->chunk;
        for (int d = 1; d < c->size; d++) {
            scape_rc rc = send_msg(c, (c->rank + d) % c->size, kind, seq, i,
                                   (const char *)send + start, n);
            if (rc != SCAPE_OK)
                return rc;
        }
    }
    return SCAPE_OK;
}

/* ---- routing ------------------------------------------------------------ */

/* Handle or keep one message.  Returns SCAPE_OK with *mine = 1 when it belongs
 * to the current synchronous op (in_op) and the caller takes it; on any other
 * success the message was used up or stashed.  On failure it is still the
 * caller's to free. */
static scape_rc route(comm_t *c, host_msg *m, int in_op, int *mine)
{
    host *h = c->impl;
    *mine = 0;
    if (m->h.kind == K_IAG) {
        if (h->async_active && m->h.seq == h->aseq) {
            scape_rc rc = gather_take(c, &h->ag, m);
            if (rc == SCAPE_OK)
                msg_free(m);
            return rc;
        }
        if (m->h.seq < h->aseq + (uint64_t)h->async_active)
            return proto(h, m, "a message of a finished all-gather");
    } else if (in_op && m->h.seq == h->seq) {
        *mine = 1;
        return SCAPE_OK;
    } else if (m->h.seq < h->seq + (uint64_t)in_op) {
        return proto(h, m, "a message of a finished op");
    }
    stash_push(h, m);
    return SCAPE_OK;
}

/* Read every pending connect/disconnect event of the peers' PUSH sockets.
 * Returns the peer whose connection has been closed the longest, if that is
 * at least grace_ms, else -1; *down_ms is how long. */
static int peers_down(const comm_t *c, long long grace_ms, long long *down_ms)
{
    host *h = (host *)c->impl; /* the events are read: the state advances */
    long long now = now_ms();
    int worst = -1;
    *down_ms = 0;
    for (int q = 0; q < c->size; q++) {
        if (h->mon == NULL || h->mon[q] == NULL)
            continue;
        unsigned char ev[6];
        char addr[256];
        int n;
        while ((n = zmq_recv(h->mon[q], ev, sizeof ev, ZMQ_DONTWAIT)) >= 0) {
            /* the second frame is the endpoint */
            if (zmq_recv(h->mon[q], addr, sizeof addr, ZMQ_DONTWAIT) < 0 || n != sizeof ev)
                continue;
            uint16_t id;
            memcpy(&id, ev, sizeof id);
            if (id == ZMQ_EVENT_DISCONNECTED && h->down_since[q] == 0)
                h->down_since[q] = now;
            if (id == ZMQ_EVENT_CONNECTED)
                h->down_since[q] = 0;
            h->up[q] = id == ZMQ_EVENT_CONNECTED;
        }
        long long d = h->down_since[q] ? now - h->down_since[q] : 0;
        if (h->down_since[q] && d >= grace_ms && d >= *down_ms) {
            worst = q;
            *down_ms = d;
        }
    }
    return worst;
}

/* The error of a wait for `from` that timed out; it names a peer that is
 * gone instead, if there is one (h->named: the rank named). */
static scape_rc timed_out(const comm_t *c, int from, const char *what, uint64_t seq)
{
    host *h = c->impl;
    long long down_ms;
    int lost = peers_down(c, 0, &down_ms);
    h->named = lost >= 0 ? lost : from;
    if (lost >= 0 && lost != from)
        return scape_set_error(SCAPE_TIMEOUT,
                               "comm host: rank %d sent nothing for %d ms during %s (op %llu); "
                               "the connection to rank %d closed %lld ms ago: rank %d's daemon "
                               "is gone (rank %d is likely waiting for it)",
                               from, h->timeout_ms, what, (unsigned long long)seq, lost, down_ms,
                               lost, from);
    return scape_set_error(SCAPE_TIMEOUT,
                           "comm host: rank %d sent nothing for %d ms during %s (op %llu); %s",
                           from, h->timeout_ms, what, (unsigned long long)seq,
                           lost == from ? "its connection closed: its daemon is gone"
                           : from != c->rank && !h->up[from]
                               ? "is it alive? (this daemon has no connection to it)"
                               : "is it alive?");
}

/* Wait up to the deadline for one message and route it; PUMP_DEADLINE when
 * the deadline has passed. */
static scape_rc pump_one(comm_t *c, long long deadline, int in_op, host_msg **out)
{
    host *h = c->impl;
    long long left = deadline - now_ms();
    if (left <= 0)
        return PUMP_DEADLINE;
    if (comm_interrupted())
        return scape_set_error(SCAPE_REMOTE, "comm host: %s (op %llu) given up: the daemon is "
                               "shutting down and the wait made no progress for %d ms",
                               h->opname ? h->opname : "a wait", (unsigned long long)h->seq,
                               COMM_STOP_GRACE_MS);
    long slice = left < COMM_INTERRUPT_SLICE_MS ? (long)left : COMM_INTERRUPT_SLICE_MS;
    int ready = comm_wait_poll(h->pull, slice); /* status is served meanwhile */
    if (ready == 0) {
        /* Nothing left to read: is a peer gone for good?  (What it sent before
         * it died has been read by now: it arrived before its connection
         * closed, and the grace period outlasts the local queue.) */
        long long grace = h->timeout_ms < LOST_GRACE_MS ? h->timeout_ms : LOST_GRACE_MS;
        long long down_ms;
        int lost = peers_down(c, grace, &down_ms);
        h->named = lost;
        if (lost >= 0)
            return scape_set_error(SCAPE_TIMEOUT,
                                   "comm host: lost rank %d during %s (op %llu): its connection "
                                   "closed %lld ms ago and did not come back; its daemon is gone",
                                   lost, h->opname, (unsigned long long)h->seq, down_ms);
    }
    if (ready <= 0)
        return ready == 0 || zmq_errno() == EINTR ? SCAPE_OK : zerr("poll");
    host_msg *m = malloc(sizeof *m);
    if (m == NULL)
        return scape_set_error(SCAPE_NOMEM, "comm host: out of memory");
    int got = 0, mine = 0;
    scape_rc rc = recv_msg(c, m, &got);
    if (rc == SCAPE_OK && got > 0) {
        rc = route(c, m, in_op, &mine);
        comm_progress(); /* a peer of this job is still at work */
    }
    if (rc != SCAPE_OK || got <= 0)
        msg_free(m);
    else if (mine)
        *out = m;
    return rc;
}

/* ---- failure reports ------------------------------------------------------ */

/* Tell every peer but k that this rank's wait gave up on rank k, and why:
 * best effort, never blocking (a hung peer must not hold this rank up). */
static void report_send(comm_t *c, int k, uint64_t seq, const char *why)
{
    host *h = c->impl;
    /* no longer than a frame the peers' sockets take (open_socket) */
    size_t most = h->chunk > sizeof(wire_hdr) ? h->chunk : sizeof(wire_hdr);
    size_t len = strnlen(why, HOST_FAIL_TEXT < most ? HOST_FAIL_TEXT : most);
    wire_hdr w = { .job = h->job, .seq = seq, .chunk = (uint64_t)k, .magic = HOST_MAGIC,
                   .kind = K_FAIL, .sender = (uint16_t)c->rank };
    for (int q = 0; q < c->size; q++) {
        if (q == c->rank || q == k || h->push[q] == NULL)
            continue;
        if (zmq_send(h->push[q], &w, sizeof w, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
            continue; /* no connection to q (yet): it learns by its own timeout */
        /* the rest of a message whose first frame was queued is taken too */
        int r;
        while ((r = zmq_send(h->push[q], why, len, ZMQ_DONTWAIT)) < 0 && zmq_errno() == EINTR)
            ;
        if (r >= 0)
            h->sent += sizeof w + len;
    }
}

/* A wait failed with rc: on rank k (this rank's own finding, error set), or
 * (k < 0) on a peer's report.  Report an own finding to every peer; then,
 * while the rank named is still connected, wait a little (REPORT_HOLD_MS,
 * at most a quarter of timeout_ms) for a report from that rank itself, which
 * replaces it as the culprit (take_report); the error names the culprit. */
static scape_rc settle(comm_t *c, int k, uint64_t seq, scape_rc rc)
{
    host *h = c->impl;
    char own[sizeof h->failmsg];
    snprintf(own, sizeof own, "%s", k >= 0 ? scape_last_error() : "");
    if (h->blame < 0 && k >= 0) {
        h->blame = k;
        h->blame_from = c->rank;
        h->blame_seq = seq;
        snprintf(h->blame_why, sizeof h->blame_why, "%.300s", own);
        report_send(c, k, seq, own);
    }
    long long hold = h->timeout_ms / 4 < REPORT_HOLD_MS ? h->timeout_ms / 4 : REPORT_HOLD_MS;
    long long deadline = now_ms() + hold;
    while (h->blame >= 0 && h->up[h->blame]) {
        host_msg *none = NULL; /* in_op 0: the op's late messages are only kept */
        if (pump_one(c, deadline, 0, &none) != SCAPE_OK)
            break;
    }
    if (h->blame_from == c->rank)
        return scape_set_error(rc, "%s", own);
    const char *why = h->blame_why;
    if (strncmp(why, "comm host: ", 11) == 0)
        why += 11;
    return scape_set_error(SCAPE_TIMEOUT,
                           "comm host: rank %d failed, as rank %d reported (its op %llu): %.200s; "
                           "this rank gave up its %s (op %llu)%s",
                           h->blame, h->blame_from, (unsigned long long)h->blame_seq, why,
                           h->opname, (unsigned long long)seq,
                           k >= 0 && k != h->blame ? ", where it waited on another rank" : "");
}

/* The next message of the current synchronous op, from the stash or the
 * socket; `from` names the rank the schedule waits for in a timeout.  A
 * peer's failure report, received now or before, fails it at once. */
static scape_rc next_msg(comm_t *c, int from, host_msg **out)
{
    host *h = c->impl;
    *out = h->blame < 0 ? stash_take(h, 0, h->seq) : NULL;
    long long deadline = now_ms() + h->timeout_ms;
    while (*out == NULL) {
        if (h->blame >= 0)
            return settle(c, -1, h->seq, SCAPE_TIMEOUT);
        scape_rc rc = pump_one(c, deadline, 1, out);
        if (rc == PUMP_DEADLINE)
            rc = timed_out(c, from, h->opname, h->seq);
        if (rc != SCAPE_OK)
            return rc == SCAPE_TIMEOUT && h->named >= 0 ? settle(c, h->named, h->seq, rc) : rc;
    }
    return SCAPE_OK;
}

/* ---- op framing ---------------------------------------------------------- */

static scape_rc begin_op(comm_t *c, const char *name)
{
    host *h = c->impl;
    if (h->failed != SCAPE_OK)
        return scape_set_error(h->failed, "comm host: refused after an earlier failure: %s",
                               h->failmsg);
    h->opname = name;
    return SCAPE_OK;
}

/* Remember the first failure: later calls are refused with it. */
static scape_rc latch(comm_t *c, scape_rc rc)
{
    host *h = c->impl;
    if (rc != SCAPE_OK && h->failed == SCAPE_OK) {
        h->failed = rc;
        snprintf(h->failmsg, sizeof h->failmsg, "%s", scape_last_error());
    }
    return rc;
}

/* Close a synchronous op: every rank numbers them alike. */
static scape_rc end_op(comm_t *c, scape_rc rc)
{
    ((host *)c->impl)->seq++;
    return latch(c, rc);
}

/* ---- reduce-scatter ------------------------------------------------------- */

/* Floats of part i of rank q's segment (parts of cf floats; the last shorter). */
static size_t rs_part_len(const host *h, int q, uint64_t i, size_t cf)
{
    size_t len = h->segoff[q + 1] - h->segoff[q], a = (size_t)i * cf;
    return len - a < cf ? len - a : cf;
}

/* Part i of this rank's segment from rank q: from q's queue, or received
 * (parts of other senders, and q's later ones, are queued on the way).
 * Each sender's parts arrive in order. */
static scape_rc rs_part_from(comm_t *c, int q, uint64_t i, size_t cf, host_msg **out)
{
    host *h = c->impl;
    for (;;) {
        host_msg *m = h->rq_head[q];
        if (m != NULL && m->h.chunk == i) {
            h->rq_head[q] = m->next;
            if (h->rq_head[q] == NULL)
                h->rq_tail[q] = NULL;
            *out = m;
            return SCAPE_OK;
        }
        TRY(next_msg(c, q, &m));
        int from = m->h.sender;
        scape_rc rc = SCAPE_OK;
        if (m->h.kind != K_RS_PART || from == c->rank)
            rc = proto(h, m, "an unexpected message in a reduce-scatter");
        else if (m->h.chunk != h->rq_next[from] ||
                 h->segoff[c->rank] + (size_t)m->h.chunk * cf >= h->segoff[c->rank + 1])
            rc = proto(h, m, "a reduce-scatter part out of order or past the segment");
        else if (zmq_msg_size(&m->body) !=
                 rs_part_len(h, c->rank, m->h.chunk, cf) * (h->rs_bf16 ? 2 : sizeof(float)))
            rc = proto(h, m, "a reduce-scatter part of the wrong length");
        if (rc != SCAPE_OK) {
            msg_free(m);
            return rc;
        }
        h->rq_next[from]++;
        m->next = NULL;
        if (h->rq_tail[from])
            h->rq_tail[from]->next = m;
        else
            h->rq_head[from] = m;
        h->rq_tail[from] = m;
    }
}

/* One part of n floats to rank q: as they are, or (rs_bf16) their upper
 * halves, which are all of a bf16 number held in fp32. */
static scape_rc rs_send_part(comm_t *c, int q, uint64_t i, const float *x, size_t n)
{
    host *h = c->impl;
    if (!h->rs_bf16)
        return send_msg(c, q, K_RS_PART, h->seq, i, x, n * sizeof *x);
    for (size_t j = 0; j < n; j++) {
        uint32_t u;
        memcpy(&u, &x[j], sizeof u);
        h->half[j] = (uint16_t)(u >> 16);
    }
    return send_msg(c, q, K_RS_PART, h->seq, i, h->half, n * sizeof *h->half);
}

/* A received part into dst, widened from bf16 when the inputs go so (a
 * message body need not be aligned: it is copied out first). */
static void rs_take_part(host *h, host_msg *m, float *dst, size_t n)
{
    if (!h->rs_bf16) {
        memcpy(dst, zmq_msg_data(&m->body), n * sizeof *dst);
        return;
    }
    memcpy(h->half, zmq_msg_data(&m->body), n * sizeof *h->half);
    for (size_t j = 0; j < n; j++) {
        uint32_t u = (uint32_t)h->half[j] << 16;
        memcpy(&dst[j], &u, sizeof u);
    }
}

/* Direct reduce-scatter: every rank sends each owner its part of the owner's
 * segment, chunk by chunk (chunk-major, owners in rotated order), and each
 * owner sums its segment chunk by chunk in rank order, ((x0 + x1) + x2) +
 * ..., bit for bit what the local backend computes.  recv may be this rank's
 * own segment of send (in place): a chunk is summed in scratch first. */
static scape_rc rs_run(comm_t *c, const float *send, float *recv)
{
    host *h = c->impl;
    size_t cf = h->chunk / sizeof(float), s0 = h->segoff[c->rank];
    size_t own = h->segoff[c->rank + 1] - s0;
    if (c->size == 1) {
        if (recv != send && own)
            memmove(recv, send, own * sizeof *recv);
        return SCAPE_OK;
    }
    size_t most = 0;
    for (int q = 0; q < c->size; q++) {
        size_t len = h->segoff[q + 1] - h->segoff[q];
        most = len > most ? len : most;
        h->rq_next[q] = 0;
    }
    for (uint64_t i = 0; (size_t)i * cf < most; i++)
        for (int k = 1; k < c->size; k++) {
            int q = (c->rank + k) % c->size;
            if ((size_t)i * cf >= h->segoff[q + 1] - h->segoff[q])
                continue;
            TRY(rs_send_part(c, q, i, send + h->segoff[q] + (size_t)i * cf,
                             rs_part_len(h, q, i, cf)));
        }
    h->waits = W_RS;
    for (uint64_t i = 0; (size_t)i * cf < own; i++) {
        size_t a = (size_t)i * cf, len = rs_part_len(h, c->rank, i, cf);
        for (int q = 0; q < c->size; q++) {
            /* the first term goes straight into scratch; a received one is
             * copied out first (a message body need not be float-aligned) */
            float *dst = q == 0 ? h->scratch : h->part;
            const float *x = send + s0 + a;
            if (q != c->rank) {
                host_msg *m;
                TRY(rs_part_from(c, q, i, cf, &m));
                rs_take_part(h, m, dst, len);
                msg_free(m);
                x = dst;
            } else if (q == 0) {
                memcpy(dst, x, len * sizeof *x);
            }
            for (size_t j = 0; q > 0 && j < len; j++)
                h->scratch[j] += x[j];
        }
        memcpy(recv + a, h->scratch, len * sizeof *recv);
    }
    return SCAPE_OK;
}

/* Segment offsets from per-rank float counts. */
static void set_segments(comm_t *c, const size_t *counts)
{
    host *h = c->impl;
    h->segoff[0] = 0;
    for (int q = 0; q < c->size; q++)
        h->segoff[q + 1] = h->segoff[q] + counts[q];
}

static scape_rc rs_op(comm_t *c, const float *send, float *recv, const size_t *counts,
                      int bf16)
{
    host *h = c->impl;
    set_segments(c, counts);
    h->rs_bf16 = bf16;
    scape_rc rc = rs_run(c, send, recv);
    h->rs_bf16 = 0;
    return end_op(c, rc);
}

static scape_rc reduce_scatter_sum(comm_t *c, const float *send, float *recv,
                                   const size_t *counts, int bf16)
{
    TRY(begin_op(c, "reduce_scatter"));
    return rs_op(c, send, recv, counts, bf16);
}

/* ---- all-gather ------------------------------------------------------------ */

static scape_rc ag_run(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    host *h = c->impl;
    gather_begin(c, &h->sg, recv, counts);
    unsigned char *own = h->sg.recv + h->sg.offs[c->rank];
    if (counts[c->rank] && (const void *)own != send)
        memcpy(own, send, counts[c->rank]);
    TRY(gather_send(c, K_AG, h->seq, own, counts[c->rank]));
    h->waits = W_AG;
    while (h->sg.left > 0) {
        host_msg *m;
        scape_rc rc = next_msg(c, gather_missing(c, &h->sg), &m);
        if (rc == SCAPE_OK)
            rc = m->h.kind == K_AG ? gather_take(c, &h->sg, m)
                                   : proto(h, m, "an unexpected message in an all-gather");
        msg_free(m);
        if (rc != SCAPE_OK)
            return rc;
    }
    return SCAPE_OK;
}

static scape_rc allgather(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    TRY(begin_op(c, "allgather"));
    return end_op(c, ag_run(c, send, recv, counts));
}

/* Equal segments as comm_local's, so the sums match it bit for bit. */
static scape_rc allreduce_sum(comm_t *c, float *buf, size_t n, int bf16)
{
    host *h = c->impl;
    size_t per = (n + (size_t)c->size - 1) / (size_t)c->size;
    TRY(begin_op(c, "allreduce"));
    for (int q = 0; q < c->size; q++) {
        size_t off = per * (size_t)q < n ? per * (size_t)q : n;
        h->cnt_f[q] = n - off < per ? n - off : per;
        h->cnt_b[q] = h->cnt_f[q] * sizeof *buf;
    }
    size_t own = per * (size_t)c->rank < n ? per * (size_t)c->rank : n;
    TRY(rs_op(c, buf, buf + own, h->cnt_f, bf16));
    return end_op(c, ag_run(c, buf + own, buf, h->cnt_b));
}

/* ---- asynchronous all-gather ------------------------------------------------ */

static scape_rc iag_start(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    host *h = c->impl;
    gather_begin(c, &h->ag, recv, counts);
    h->async_active = 1;
    unsigned char *own = h->ag.recv + h->ag.offs[c->rank];
    if (counts[c->rank] && (const void *)own != send)
        memcpy(own, send, counts[c->rank]);
    TRY(gather_send(c, K_IAG, h->aseq, own, counts[c->rank]));
    for (host_msg *m; (m = stash_take(h, 1, h->aseq)) != NULL;) {
        scape_rc rc = gather_take(c, &h->ag, m);
        msg_free(m);
        if (rc != SCAPE_OK)
            return rc;
    }
    return SCAPE_OK;
}

/* The asynchronous all-gather has its own sequence (aseq): it takes no
 * number from the synchronous ops it overlaps. */
static scape_rc iallgather(comm_t *c, const void *send, void *recv, const size_t *counts)
{
    TRY(begin_op(c, "iallgather"));
    return latch(c, iag_start(c, send, recv, counts));
}

static scape_rc iag_wait(comm_t *c)
{
    host *h = c->impl;
    long long deadline = now_ms() + h->timeout_ms;
    h->waits = W_IAG;
    while (h->ag.left > 0) {
        host_msg *none = NULL;
        if (h->blame >= 0)
            return settle(c, -1, h->aseq, SCAPE_TIMEOUT);
        scape_rc rc = pump_one(c, deadline, 0, &none);
        if (rc == PUMP_DEADLINE)
            rc = timed_out(c, gather_missing(c, &h->ag), "iallgather_wait (async op)", h->aseq);
        if (rc != SCAPE_OK)
            return rc == SCAPE_TIMEOUT && h->named >= 0 ? settle(c, h->named, h->aseq, rc) : rc;
    }
    h->async_active = 0;
    h->aseq++;
    return SCAPE_OK;
}

static scape_rc iallgather_wait(comm_t *c)
{
    TRY(begin_op(c, "iallgather_wait"));
    return latch(c, iag_wait(c));
}

/* ---- broadcast and barrier --------------------------------------------------- */

/* A pipelined chain in ring order from the root; the last rank before the
 * root does not forward. */
static scape_rc bc_run(comm_t *c, unsigned char *buf, size_t bytes, int root)
{
    host *h = c->impl;
    int prev = (c->rank + c->size - 1) % c->size, next = (c->rank + 1) % c->size;
    h->waits = W_ONE;
    h->wait_one = prev;
    for (uint64_t i = 0; c->size > 1 && i < nchunks(bytes, h->chunk); i++) {
        size_t a = (size_t)i * h->chunk, n = bytes - a < h->chunk ? bytes - a : h->chunk;
        if (c->rank != root) {
            host_msg *m;
            TRY(next_msg(c, prev, &m));
            scape_rc rc = SCAPE_OK;
            if (m->h.kind != K_BC || m->h.sender != prev || m->h.chunk != i ||
                zmq_msg_size(&m->body) != n)
                rc = proto(h, m, "an unexpected message in a broadcast");
            else
                memcpy(buf + a, zmq_msg_data(&m->body), n);
            msg_free(m);
            TRY(rc);
        }
        if (next != root)
            TRY(send_msg(c, next, K_BC, h->seq, i, buf + a, n));
    }
    return SCAPE_OK;
}

static scape_rc broadcast(comm_t *c, void *buf, size_t bytes, int root)
{
    TRY(begin_op(c, "broadcast"));
    return end_op(c, bc_run(c, buf, bytes, root));
}

/* Wait for one message of the given kind from `from` (-1: any rank not yet
 * marked in h->arrived, whom it then marks). */
static scape_rc expect(comm_t *c, int kind, int from)
{
    host *h = c->impl;
    int missing = from;
    for (int q = 1; from < 0 && q < c->size && missing < 0; q++)
        if (!h->arrived[q])
            missing = q;
    host_msg *m;
    TRY(next_msg(c, missing, &m));
    int q = m->h.sender;
    scape_rc rc = SCAPE_OK;
    if (m->h.kind != kind || (from >= 0 ? q != from : h->arrived[q]))
        rc = proto(h, m, "an unexpected message in a barrier");
    else if (from < 0)
        h->arrived[q] = 1;
    msg_free(m);
    return rc;
}

static scape_rc bar_run(comm_t *c)
{
    host *h = c->impl;
    h->waits = c->rank != 0 ? W_ONE : W_BAR;
    h->wait_one = 0;
    if (c->rank != 0) {
        TRY(send_msg(c, 0, K_BAR_IN, h->seq, 0, NULL, 0));
        return expect(c, K_BAR_OUT, 0);
    }
    memset(h->arrived, 0, (size_t)c->size);
    for (int k = 1; k < c->size; k++)
        TRY(expect(c, K_BAR_IN, -1));
    for (int q = 1; q < c->size; q++)
        TRY(send_msg(c, q, K_BAR_OUT, h->seq, 0, NULL, 0));
    return SCAPE_OK;
}

static scape_rc barrier(comm_t *c)
{
    TRY(begin_op(c, "barrier"));
    return end_op(c, bar_run(c));
}

/* ---- lifetime ------------------------------------------------------------------ */

static int gather_alloc(gather *g, int size)
{
    g->counts = calloc((size_t)size, sizeof *g->counts);
    g->offs = calloc((size_t)size, sizeof *g->offs);
    g->next = calloc((size_t)size, sizeof *g->next);
    return g->counts && g->offs && g->next;
}

static void gather_free(gather *g)
{
    free(g->counts);
    free(g->offs);
    free(g->next);
}

static void host_free(comm_t *c)
{
    host *h = c->impl;
    int size = c->size;
    /* Read the connections' last events (a peer may have come back; and a
     * monitor whose events nobody reads could hold up stopping it), then:
     * after a failure what is still queued has no taker that matters, and a
     * gone peer never takes it: don't linger (timeout_ms) on it. */
    long long down_ms;
    if (h->mon && h->down_since && h->up)
        peers_down(c, 0, &down_ms);
    int zero = 0;
    for (int q = 0; h->push && q < size; q++)
        if (h->push[q] && (h->failed != SCAPE_OK || (h->down_since && h->down_since[q])))
            zmq_setsockopt(h->push[q], ZMQ_LINGER, &zero, sizeof zero);
    for (int q = 0; h->push && q < size; q++) {
        if (h->push[q] && h->mon && h->mon[q])
            zmq_socket_monitor(h->push[q], NULL, 0); /* stop it: best effort */
        if (h->mon && h->mon[q])
            zmq_close(h->mon[q]);
        if (h->push[q])
            zmq_close(h->push[q]);
    }
    if (h->pull && h->zap)
        zmq_socket_monitor(h->pull, NULL, 0);
    zap_stop(h->zap);
    if (h->pull)
        zmq_close(h->pull);
    /* waits up to the linger time (timeout_ms) for queued messages */
    while (h->zctx && zmq_ctx_term(h->zctx) != 0 && zmq_errno() == EINTR)
        ;
    while (h->stash) {
        host_msg *m = h->stash;
        h->stash = m->next;
        msg_free(m);
    }
    for (int q = 0; h->rq_head && q < size; q++)
        while (h->rq_head[q]) {
            host_msg *m = h->rq_head[q];
            h->rq_head[q] = m->next;
            msg_free(m);
        }
    free(h->rq_head);
    free(h->rq_tail);
    free(h->rq_next);
    free(h->push);
    free(h->mon);
    free(h->down_since);
    free(h->up);
    gather_free(&h->sg);
    gather_free(&h->ag);
    free(h->cnt_f);
    free(h->segoff);
    free(h->arrived);
    free(h->scratch);
    free(h->part);
    free(h->half);
    free(h);
}

static void destroy(comm_t *c)
{
    host_free(c);
    free(c);
}

static uint64_t hc_foreign(const comm_t *c, char *why, size_t len)
{
    const host *h = c->impl;
    if (why && len)
        snprintf(why, len, "%s", h->foreign_why);
    return h->foreign;
}

static uint64_t hc_refused(const comm_t *c, char *why, size_t len)
{
    const host *h = c->impl;
    return zap_refused(h->zap, why, len);
}

static int hc_gone(const comm_t *c, long long *down_ms)
{
    const host *h = c->impl;
    return peers_down(c, h->timeout_ms < LOST_GRACE_MS ? h->timeout_ms : LOST_GRACE_MS, down_ms);
}

static int hc_peers_up(const comm_t *c, int *down, int cap, int *ndown)
{
    int up = comm_host_connected(c);
    for (int q = 0; q < c->size && *ndown < cap; q++)
        if (q != c->rank && !comm_host_peer_up(c, q))
            down[(*ndown)++] = q;
    return up;
}

/* The chunks of g some peer has not sent yet: those peers into ranks. */
static int gather_waits(const comm_t *c, const gather *g, int *ranks, int cap)
{
    const host *h = c->impl;
    int n = 0;
    for (int q = 0; q < c->size && n < cap; q++)
        if (q != c->rank && g->next[q] < nchunks(g->counts[q], h->chunk))
            ranks[n++] = q;
    return n;
}

/* Read between the waits' polls (comm_wait_poll's hook): the op's state is
 * the one its loop left there. */
static int hc_waiting_for(const comm_t *c, int *ranks, int cap)
{
    const host *h = c->impl;
    size_t cf = h->chunk / sizeof(float);
    uint64_t parts = (h->segoff[c->rank + 1] - h->segoff[c->rank] + cf - 1) / cf;
    int n = 0;
    switch (h->waits) {
    case W_RS:
        for (int q = 0; q < c->size && n < cap; q++)
            if (q != c->rank && h->rq_next[q] < parts)
                ranks[n++] = q;
        return n;
    case W_AG:
        return gather_waits(c, &h->sg, ranks, cap);
    case W_IAG:
        return gather_waits(c, &h->ag, ranks, cap);
    case W_ONE:
        if (cap > 0)
            ranks[n++] = h->wait_one;
        return n;
    case W_BAR:
        for (int q = 1; q < c->size && n < cap; q++)
            if (!h->arrived[q])
                ranks[n++] = q;
        return n;
    default:
        return -1;
    }
}

static void hc_data_bytes(const comm_t *c, uint64_t *sent, uint64_t *recvd)
{
    const host *h = c->impl;
    *sent = h->sent;
    *recvd = h->recvd;
}

/* bf16 reductions always go in 16 bits a value. */
static int always_bf16(const comm_t *c, const void *buf)
{
    (void)c;
    (void)buf;
    return 1;
}

/* How long a connection may take to finish its handshake.  ZeroMQ's own
 * bound (30 s) is shorter than the full mesh's R(R-1) CURVE handshakes take
 * on one loaded node at a few hundred ranks, and a connection dropped in the
 * middle of one looks like a lost peer; but a stranger that connects and
 * stalls holds a file until it passes.  So 30 s, plus half a second a rank
 * past 60, never more than timeout_ms. */
static int handshake_bound(int size, int timeout_ms)
{
    long long ms = 30000 + (size > 60 ? 500LL * (size - 60) : 0);
    return ms < timeout_ms ? (int)ms : timeout_ms;
}

static const comm_ops s_host_ops = {
    .name = "host",
    .allreduce_sum = allreduce_sum,
    .reduce_scatter_sum = reduce_scatter_sum,
    .wire_bf16 = always_bf16,
    .allgather = allgather,
    .iallgather = iallgather,
    .iallgather_wait = iallgather_wait,
    .broadcast = broadcast,
    .barrier = barrier,
    .destroy = destroy,
    .foreign = hc_foreign,
    .refused = hc_refused,
    .data_bytes = hc_data_bytes,
    .gone = hc_gone,
    .peers_up = hc_peers_up,
    .waiting_for = hc_waiting_for,
};

static scape_rc host_alloc(const comm_host_opts *o, host **out)
{
    host *h = calloc(1, sizeof *h);
    if (h == NULL)
        return scape_set_error(SCAPE_NOMEM, "comm_host_create: out of memory");
    size_t n = (size_t)o->size;
    h->timeout_ms = o->timeout_ms ? o->timeout_ms : HOST_DEFAULT_TIMEOUT_MS;
    h->handshake_ms = handshake_bound(o->size, h->timeout_ms);
    h->chunk = o->chunk_bytes ? o->chunk_bytes / sizeof(float) * sizeof(float)
                              : HOST_DEFAULT_CHUNK;
    h->job = o->job;
    h->opname = "create";
    h->named = h->blame = -1;
    h->push = calloc(n, sizeof *h->push);
    h->mon = calloc(n, sizeof *h->mon);
    h->down_since = calloc(n, sizeof *h->down_since);
    h->up = calloc(n, 1);
    h->cnt_f = calloc(2 * n, sizeof *h->cnt_f);
    h->segoff = calloc(n + 1, sizeof *h->segoff);
    h->arrived = calloc(n, 1);
    h->scratch = malloc(h->chunk);
    h->part = malloc(h->chunk);
    h->half = malloc(h->chunk / 2 + 2);
    h->rq_head = calloc(n, sizeof *h->rq_head);
    h->rq_tail = calloc(n, sizeof *h->rq_tail);
    h->rq_next = calloc(n, sizeof *h->rq_next);
    int ok = gather_alloc(&h->sg, o->size) & gather_alloc(&h->ag, o->size);
    *out = h;
    if (!ok || !h->push || !h->mon || !h->down_since || !h->up || !h->cnt_f || !h->segoff ||
        !h->arrived || !h->scratch || !h->part || !h->half || !h->rq_head || !h->rq_tail || !h->rq_next)
        return scape_set_error(SCAPE_NOMEM, "comm_host_create: out of memory");
    h->cnt_b = h->cnt_f + n;
    return SCAPE_OK;
}

static scape_rc open_socket(host *h, void **s, int type, int hwm_opt, int linger)
{
    int zero = 0;
    /* ZeroMQ applies the limit to a frame as it travels: a CURVE box is the
     * frame plus its MESSAGE command, nonce and MAC */
    int64_t maxmsg = (int64_t)(h->chunk > sizeof(wire_hdr) ? h->chunk : sizeof(wire_hdr)) +
                     (h->curve ? CURVE_FRAME_OVERHEAD : 0);
    if ((*s = zmq_socket(h->zctx, type)) == NULL)
        return zerr("zmq_socket");
    if (zmq_setsockopt(*s, hwm_opt, &zero, sizeof zero) != 0 ||
        zmq_setsockopt(*s, ZMQ_HANDSHAKE_IVL, &h->handshake_ms, sizeof h->handshake_ms) != 0 ||
        zmq_setsockopt(*s, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_setsockopt(*s, ZMQ_SNDTIMEO, &h->timeout_ms, sizeof h->timeout_ms) != 0 ||
        (type == ZMQ_PULL && zmq_setsockopt(*s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg) != 0))
        return zerr("zmq_setsockopt");
    return SCAPE_OK;
}

/* Monitor push[q]'s connection (inproc names are per context: one comm). */
static scape_rc watch_peer(host *h, int q)
{
    char name[48];
    snprintf(name, sizeof name, "inproc://scape-mon-%d", q);
    int linger = 0;
    if (zmq_socket_monitor(h->push[q], name, ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED) != 0)
        return zerr("zmq_socket_monitor");
    if ((h->mon[q] = zmq_socket(h->zctx, ZMQ_PAIR)) == NULL)
        return zerr("zmq_socket (monitor)");
    if (zmq_setsockopt(h->mon[q], ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_connect(h->mon[q], name) != 0)
        return zerr("monitor connect");
    return SCAPE_OK;
}

/* The address ZeroMQ really bound (a '*' port resolved), for the peers.  A
 * wildcard address cannot be connected to from another host: refuse it. */
static scape_rc bound_address(const host *h, int rank, char *buf, size_t len)
{
    size_t n = len;
    if (zmq_getsockopt(h->pull, ZMQ_LAST_ENDPOINT, buf, &n) != 0)
        return zerr("zmq_getsockopt(ZMQ_LAST_ENDPOINT)");
    buf[len - 1] = '\0';
    if (strncmp(buf, "tcp://0.0.0.0:", 14) == 0 || strncmp(buf, "tcp://[::]:", 11) == 0)
        return scape_set_error(SCAPE_INVALID,
                               "comm host: rank %d listens on every interface (%s); peers need "
                               "one address they can reach: give listen a host address, "
                               "e.g. tcp://10.0.0.5:* or tcp://ib0:*", rank, buf);
    return SCAPE_OK;
}

/* CURVE on the PULL socket: a server with this rank's secret key, behind a
 * ZAP handler that holds early handshakes until the peers' keys are known. */
static scape_rc curve_server(const comm_host_opts *o, host *h)
{
    int one = 1;
    if (zmq_setsockopt(h->pull, ZMQ_CURVE_SERVER, &one, sizeof one) != 0 ||
        zmq_setsockopt(h->pull, ZMQ_CURVE_SECRETKEY, o->curve_secret,
                       strlen(o->curve_secret)) != 0 ||
        zmq_setsockopt(h->pull, ZMQ_ZAP_DOMAIN, "scape", 5) != 0)
        return zerr("CURVE server options (is libzmq built with CURVE?)");
    return zap_start(h->zctx, h->pull, h->timeout_ms, o->size, &h->zap);
}

static scape_rc curve_client(const comm_host_opts *o, void *push, const char *server_key, int q)
{
    if (server_key == NULL || strlen(server_key) != ZAP_KEY_Z85 - 1)
        return scape_set_error(SCAPE_PROTO, "comm host: rank %d has no CURVE key", q);
    if (zmq_setsockopt(push, ZMQ_CURVE_SERVERKEY, server_key, strlen(server_key)) != 0 ||
        zmq_setsockopt(push, ZMQ_CURVE_PUBLICKEY, o->curve_public, strlen(o->curve_public)) ||
        zmq_setsockopt(push, ZMQ_CURVE_SECRETKEY, o->curve_secret, strlen(o->curve_secret)))
        return zerr("CURVE client options");
    return SCAPE_OK;
}

/* ZeroMQ binds an address or an interface name, never a host name (it says
 * "No such device"): tcp://HOST:PORT with a host name becomes HOST's first
 * IPv4 address; anything else is bound as it is. */
static scape_rc bind_endpoint(const char *ep, int rank, char *buf, size_t len)
{
    const char *h = strncmp(ep, "tcp://", 6) == 0 ? ep + 6 : ep;
    const char *colon = strrchr(h, ':');
    char name[256], ip[INET_ADDRSTRLEN];
    struct in_addr a;
    snprintf(buf, len, "%s", ep);
    if (h == ep || colon == NULL || colon == h || (size_t)(colon - h) >= sizeof name ||
        h[0] == '[' || h[0] == '*')
        return SCAPE_OK;
    memcpy(name, h, (size_t)(colon - h));
    name[colon - h] = '\0';
    if (inet_pton(AF_INET, name, &a) == 1 || if_nametoindex(name) != 0)
        return SCAPE_OK;
    struct addrinfo hints = { .ai_family = AF_INET, .ai_socktype = SOCK_STREAM }, *res = NULL;
    int e = getaddrinfo(name, NULL, &hints, &res);
    if (e != 0)
        return scape_set_error(SCAPE_INVALID, "comm host: rank %d cannot listen on %s: '%s' is "
                               "neither an IPv4 address nor an interface of this host, and as "
                               "a host name it does not resolve (%s); give listen an address "
                               "or an interface, e.g. tcp://10.0.0.5:* or tcp://ib0:*", rank,
                               ep, name, e == EAI_SYSTEM ? strerror(errno) : gai_strerror(e));
    const struct sockaddr_in *sin = (const struct sockaddr_in *)res->ai_addr;
    const char *txt = inet_ntop(AF_INET, &sin->sin_addr, ip, sizeof ip);
    freeaddrinfo(res);
    if (txt == NULL)
        return scape_set_error(SCAPE_SYSTEM, "comm host: inet_ntop: %s", strerror(errno));
    if ((size_t)snprintf(buf, len, "tcp://%s%s", ip, colon) >= len)
        return scape_set_error(SCAPE_INVALID, "comm host: listen %s is too long", ep);
    return SCAPE_OK;
}

/* A full mesh holds HOST_FILES_PER_PEER open files per peer: past about 150
 * ranks that is more than the common soft limit of 1024, and ZeroMQ's I/O
 * thread, which opens the connections, cannot report EMFILE to anyone (the
 * peer would just never connect).  So check first: raise the soft limit
 * (as far as needed, within the hard one: any process may), else refuse to
 * start, saying what is needed. */
static scape_rc ensure_files(int size)
{
    rlim_t need = (rlim_t)HOST_FILES_PER_PEER * (rlim_t)(size - 1) + HOST_FILES_SPARE;
    struct rlimit l;
    if (getrlimit(RLIMIT_NOFILE, &l) != 0)
        return scape_set_error(SCAPE_SYSTEM, "comm host: getrlimit(RLIMIT_NOFILE): %s",
                               strerror(errno));
    if (l.rlim_cur != RLIM_INFINITY && l.rlim_cur >= need)
        return SCAPE_OK;
    if (l.rlim_max != RLIM_INFINITY && l.rlim_max < need)
        return scape_set_error(SCAPE_SYSTEM,
                               "comm host: a group of %d daemons needs about %llu open files "
                               "per daemon (%d per peer), but the limit is %llu (hard %llu): "
                               "raise it to at least %llu where scaped starts (ulimit -n %llu; "
                               "systemd LimitNOFILE=, /etc/security/limits.conf nofile)",
                               size, (unsigned long long)need, HOST_FILES_PER_PEER,
                               (unsigned long long)l.rlim_cur, (unsigned long long)l.rlim_max,
                               (unsigned long long)need, (unsigned long long)need);
    rlim_t was = l.rlim_cur;
    l.rlim_cur = need;
    if (setrlimit(RLIMIT_NOFILE, &l) != 0)
        return scape_set_error(SCAPE_SYSTEM, "comm host: a group of %d daemons needs about %llu "
                               "open files per daemon; raising the limit from %llu failed (%s): "
                               "ulimit -n %llu where scaped starts", size,
                               (unsigned long long)need, (unsigned long long)was,
                               strerror(errno), (unsigned long long)need);
    return SCAPE_OK;
}

static scape_rc host_connect(const comm_host_opts *o, host *h)
{
    const char *const *eps = o->endpoints, *const *keys = o->curve_keys;
    char self[300];
    TRY(bind_endpoint(o->meet ? o->listen : o->endpoints[o->rank], o->rank, self, sizeof self));
    TRY(ensure_files(o->size));
    h->curve = o->curve_public != NULL;
    if ((h->zctx = zmq_ctx_new()) == NULL)
        return zerr("zmq_ctx_new");
    /* ZeroMQ's default of 1023 sockets a context is reached at about 340 ranks */
    if (zmq_ctx_set(h->zctx, ZMQ_MAX_SOCKETS, HOST_SOCKETS_PER_PEER * o->size + 16) != 0)
        return zerr("zmq_ctx_set(ZMQ_MAX_SOCKETS)");
    TRY(open_socket(h, &h->pull, ZMQ_PULL, ZMQ_RCVHWM, 0));
    /* Every peer connects at once: with ZeroMQ's backlog of 100 the kernel
     * drops the connections past it, and each dropped one waits for TCP's SYN
     * retries (1, 2, 4 ... s): minutes before the first step at 256 ranks. */
    int backlog = o->size + HOST_BACKLOG_SPARE;
    if (zmq_setsockopt(h->pull, ZMQ_BACKLOG, &backlog, sizeof backlog) != 0)
        return zerr("zmq_setsockopt(ZMQ_BACKLOG)");
    if (h->curve)
        TRY(curve_server(o, h));
    if (zmq_bind(h->pull, self) != 0)
        return scape_set_error(SCAPE_ZMQ, "comm host: rank %d cannot bind %s: %s", o->rank,
                               self, zmq_strerror(zmq_errno()));
    if (o->meet) {
        char bound[256];
        TRY(bound_address(h, o->rank, bound, sizeof bound));
        eps = NULL;
        keys = NULL;
        TRY(o->meet(o->meet_arg, bound, &eps, &keys));
        for (int q = 0; eps && q < o->size; q++)
            if (eps[q] == NULL)
                eps = NULL;
        if (eps == NULL)
            return scape_set_error(SCAPE_INVALID, "comm host: meet gave no endpoint table");
    }
    if (h->curve && keys == NULL)
        return scape_set_error(SCAPE_INVALID, "comm host: CURVE without the ranks' keys");
    if (h->curve)
        TRY(zap_allow(h->zap, keys, o->size));
    for (int q = 0; q < o->size; q++) {
        if (q == o->rank)
            continue;
        TRY(open_socket(h, &h->push[q], ZMQ_PUSH, ZMQ_SNDHWM, h->timeout_ms));
        if (h->curve)
            TRY(curve_client(o, h->push[q], keys[q], q));
        TRY(watch_peer(h, q));
        if (zmq_connect(h->push[q], eps[q]) != 0)
            return scape_set_error(SCAPE_ZMQ, "comm host: cannot connect to rank %d at %s: %s",
                                   q, eps[q], zmq_strerror(zmq_errno()));
    }
    return SCAPE_OK;
}

static scape_rc check_opts(const comm_host_opts *o, comm_t **out)
{
    if (o == NULL || out == NULL || (o->meet ? o->listen == NULL : o->endpoints == NULL))
        return scape_set_error(SCAPE_INVALID, "comm_host_create: NULL argument");
    if (o->size < 1 || o->size > HOST_MAX_RANKS || o->rank < 0 || o->rank >= o->size)
        return scape_set_error(SCAPE_INVALID, "comm_host_create: rank %d / size %d invalid",
                               o->rank, o->size);
    if (o->timeout_ms < 0 || (o->chunk_bytes > 0 && o->chunk_bytes < sizeof(float)))
        return scape_set_error(SCAPE_INVALID,
                               "comm_host_create: timeout_ms %d or chunk_bytes %zu invalid",
                               o->timeout_ms, o->chunk_bytes);
    for (int q = 0; !o->meet && q < o->size; q++)
        if (o->endpoints[q] == NULL)
            return scape_set_error(SCAPE_INVALID, "comm_host_create: endpoint %d is NULL", q);
    if ((o->curve_public == NULL) != (o->curve_secret == NULL) ||
        (o->curve_public && (strlen(o->curve_public) != ZAP_KEY_Z85 - 1 ||
                             strlen(o->curve_secret) != ZAP_KEY_Z85 - 1)))
        return scape_set_error(SCAPE_INVALID, "comm_host_create: CURVE needs a key pair, "
                               "40 Z85 characters each");
    if (o->curve_public && !o->meet && o->curve_keys == NULL)
        return scape_set_error(SCAPE_INVALID, "comm_host_create: CURVE without the ranks' keys");
    return SCAPE_OK;
}

scape_rc comm_host_create(const comm_host_opts *o, comm_t **out)
{
    TRY(check_opts(o, out));
    host *h = NULL;
    comm_t *c = calloc(1, sizeof *c);
    scape_rc rc = c ? host_alloc(o, &h)
                    : scape_set_error(SCAPE_NOMEM, "comm_host_create: out of memory");
    if (rc == SCAPE_OK)
        rc = host_connect(o, h);
    if (c)
        *c = (comm_t){ .ops = &s_host_ops, .rank = o->rank, .size = o->size, .impl = h };
    if (rc != SCAPE_OK) {
        if (h)
            host_free(c);
        free(c);
        return rc;
    }
    *out = c;
    return SCAPE_OK;
}

int comm_host_connected(const comm_t *c)
{
    if (c == NULL || c->ops != &s_host_ops)
        return -1;
    long long down_ms;
    peers_down(c, 0, &down_ms);
    const host *h = c->impl;
    int n = 0;
    for (int q = 0; q < c->size; q++)
        n += h->up[q];
    return n;
}

int comm_host_peer_up(const comm_t *c, int q)
{
    if (c == NULL || c->ops != &s_host_ops || q < 0 || q >= c->size || q == c->rank)
        return 0;
    const host *h = c->impl;
    return h->up[q];
}

uint64_t comm_host_reports_ignored(const comm_t *c, char *why, size_t len)
{
    if (c == NULL || c->ops != &s_host_ops)
        return 0;
    const host *h = c->impl;
    if (why && len)
        snprintf(why, len, "%s", h->ignored_why);
    return h->reports_ignored;
}

scape_rc comm_host_wire_stats(const comm_t *c, uint64_t *sent, uint64_t *recvd)
{
    if (c == NULL || c->ops != &s_host_ops || sent == NULL || recvd == NULL)
        return scape_set_error(SCAPE_INVALID, "comm_host_wire_stats: not a host comm");
    hc_data_bytes(c, sent, recvd);
    return SCAPE_OK;
}
