/* libscape.c - the trainer's side: attach, shared buffers, steps, detach.
 *
 * The trainer's buffers are POSIX shared-memory objects that this library
 * creates and the daemon maps by name (the name is unlinked as soon as the
 * daemon has it mapped), or (SCAPE_MEMORY_CUDA) cudaMalloc'd
 * buffers whose IPC handles the daemon opens; only small protobuf messages cross
 * the DEALER socket.  Replies are matched to requests by order: a DEALER
 * sees exactly one reply per request, except for the daemon's unsolicited
 * farewell, which is an error reply and ends the session.
 */
#define _GNU_SOURCE /* struct ucred */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "lsc_cuda.h"
#include "scape.pb-c.h"
#include "scape/scape.h"
#include "scape_wire.h"

#ifndef LIBSCAPE_VERSION /* the project's version, from CMake */
#define LIBSCAPE_VERSION "unknown"
#endif

typedef struct shm_buf {
    char name[64];
    void *addr;
    size_t bytes;
    int linked; /* the name still exists in /dev/shm */
} shm_buf;

struct scape_session {
    void *zctx, *sock;
    char endpoint[300];
    scape_options opts;
    size_t numel;
    int index;
    uint64_t next_step;
    shm_buf params, grads;
    lsc_dev_buf dparams, dgrads;  /* SCAPE_MEMORY_CUDA */
    lsc_dev_events dev_ev;        /* SCAPE_MEMORY_CUDA: ordering with the daemon */
    int in_flight;  /* a step was begun and not yet waited for */
    uint64_t posted; /* the step in flight */
    int dead;       /* the daemon said goodbye */
    int dev_shared; /* the daemon may have dparams/dgrads open (CUDA IPC) */
    int registered; /* the daemon answered Registered: it holds our slot */
    int refused;    /* the daemon's last answer was a refusal (an error reply) */
    pid_t daemon_pid; /* scaped's process (the ipc socket's peer), 0: unknown */
    int owed;       /* replies still to come for requests given up (not the step) */
    int gave_up;    /* a call other than the step was given up: only detach is left */
    int unanswered; /* the last wait for a reply ended without one (timeout, interrupt) */
    size_t ntensors;      /* the registered layout's */
    unsigned char *bucket; /* ntensors: posted for next_step by scape_post_tensors */
};

#define WAIT_SLICE_MS 100 /* how often a wait looks at the daemon and opts.interrupt */

static atomic_uint s_counter;

void scape_options_default(scape_options *o)
{
    memset(o, 0, sizeof *o);
    o->param_dtype = SCAPE_DTYPE_F32;
    o->grad_dtype = SCAPE_DTYPE_F32;
    o->memory = SCAPE_MEMORY_HOST;
    o->index = -1;
    o->timeout_ms = 600000;
    o->start_wait_ms = -1;
    o->max_grad_norm = -1.0f;
    o->daemon_lost_ms = -1;
}

const char *scape_version(void) { return LIBSCAPE_VERSION; }

static int on_device(const scape_session *s) { return s->opts.memory == SCAPE_MEMORY_CUDA; }

void *scape_params(const scape_session *s)
{
    return s ? (on_device(s) ? s->dparams.ptr : s->params.addr) : NULL;
}

void *scape_grads(const scape_session *s)
{
    return s ? (on_device(s) ? s->dgrads.ptr : s->grads.addr) : NULL;
}
size_t scape_numel(const scape_session *s) { return s ? s->numel : 0; }
int scape_index(const scape_session *s) { return s ? s->index : -1; }
uint64_t scape_next_step(const scape_session *s) { return s ? s->next_step : 0; }
int scape_step_in_flight(const scape_session *s) { return s ? s->in_flight : 0; }

/* ---- shared memory ---------------------------------------------------------- */

static scape_rc shm_create(shm_buf *b, const char *tag, size_t bytes)
{
    /* The pid keeps names apart between live processes; the random part keeps a
     * new trainer clear of a segment that a killed process with the same (reused)
     * pid left behind.  The name lives only until the daemon has mapped it (see
     * shm_unlink_names), so a trainer killed with its daemon leaves nothing. */
    int fd = -1;
    for (int attempt = 0; attempt < 8 && fd < 0; attempt++) {
        uint32_t nonce = 0;
        if (getrandom(&nonce, sizeof nonce, GRND_NONBLOCK) != (ssize_t)sizeof nonce) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            nonce = (uint32_t)ts.tv_nsec * 2654435761u ^ (uint32_t)ts.tv_sec ^
                    (uint32_t)attempt << 24;
        }
        snprintf(b->name, sizeof b->name, "/scape-%d-%08x-%u-%s", (int)getpid(),
                 (unsigned)nonce, atomic_fetch_add(&s_counter, 1), tag);
        fd = shm_open(b->name, O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd < 0 && errno != EEXIST)
            break;
    }
    if (fd < 0)
        return scape_set_error(SCAPE_SYSTEM, "shm_open('%s'): %s", b->name, strerror(errno));
    scape_rc rc = SCAPE_OK;
    if (ftruncate(fd, (off_t)bytes) != 0) {
        rc = scape_set_error(SCAPE_SYSTEM, "ftruncate('%s', %zu): %s", b->name, bytes,
                             strerror(errno));
    } else {
        b->addr = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (b->addr == MAP_FAILED) {
            b->addr = NULL;
            rc = scape_set_error(SCAPE_SYSTEM, "mmap('%s', %zu): %s", b->name, bytes,
                                 strerror(errno));
        }
    }
    close(fd);
    if (rc != SCAPE_OK) {
        shm_unlink(b->name);
    } else {
        b->bytes = bytes;
        b->linked = 1;
    }
    return rc;
}

/* Once the daemon has mapped a buffer (it answered the registration) the
 * name is no longer needed: both mappings keep the memory alive, and the
 * kernel frees it when the last one goes, however the processes end. */
static void shm_unlink_name(shm_buf *b)
{
    if (b->linked && shm_unlink(b->name) != 0 && errno != ENOENT)
        fprintf(stderr, "libscape: shm_unlink('%s'): %s\n", b->name, strerror(errno));
    b->linked = 0;
}

static void shm_free(shm_buf *b)
{
    if (b->addr)
        munmap(b->addr, b->bytes);
    shm_unlink_name(b);
    memset(b, 0, sizeof *b);
}

/* ---- messages ----------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The runtime directory of an ipc://DIR/control endpoint (else the endpoint). */
static const char *endpoint_dir(const char *endpoint, char *buf, size_t len)
{
    snprintf(buf, len, "%s", strncmp(endpoint, "ipc://", 6) == 0 ? endpoint + 6 : endpoint);
    char *slash = strrchr(buf, '/');
    if (slash && slash != buf && strncmp(endpoint, "ipc://", 6) == 0)
        *slash = '\0';
    return buf;
}

/* The caller's opts.interrupt, if any: whether it gives the wait up.  The
 * verdict comes through give_up, which starts at 0, rather than a return
 * value, so that a callback that fails to return one (a Python handler
 * that raised on the way in) leaves the wait going. */
static int interrupted(const scape_session *s)
{
    int give_up = 0;
    if (s->opts.interrupt)
        s->opts.interrupt(s->opts.interrupt_arg, &give_up);
    return give_up != 0;
}

static scape_rc daemon_lost(scape_session *s, const char *what)
{
    char dir[300];
    s->dead = 1;
    return scape_set_error(SCAPE_REMOTE, "scaped (pid %d) at %s is gone (runtime directory "
                           "%s): the %s it was answering cannot complete. Start scaped again "
                           "(--resume from its newest checkpoint), then the trainers",
                           (int)s->daemon_pid, s->endpoint,
                           endpoint_dir(s->endpoint, dir, sizeof dir), what);
}

/* Wait until sock has `events` ready, in slices of WAIT_SLICE_MS: signals
 * do not end it (EINTR waits on), the deadline does (SCAPE_TIMEOUT, no
 * message), a daemon gone for daemon_lost_ms does (SCAPE_REMOTE), and so
 * does opts.interrupt asking to give up (SCAPE_SYSTEM, "interrupted"). */
static scape_rc wait_ready(scape_session *s, void *sock, short events, double deadline,
                           const char *what)
{
    double gone_since = 0.0;
    for (;;) {
        double left = deadline - now_s();
        if (left <= 0.0)
            return SCAPE_TIMEOUT;
        long ms = left * 1e3 < WAIT_SLICE_MS ? (long)(left * 1e3) + 1 : WAIT_SLICE_MS;
        zmq_pollitem_t item = { sock, 0, events, 0 };
        int n = zmq_poll(&item, 1, ms);
        if (n > 0)
            return SCAPE_OK;
        if (n < 0 && zmq_errno() != EINTR)
            return scape_set_error(SCAPE_ZMQ, "poll %s: %s", s->endpoint,
                                   zmq_strerror(zmq_errno()));
        if (interrupted(s))
            return scape_set_error(SCAPE_SYSTEM, "interrupted: the caller gave up waiting "
                                   "for the %s", what);
        if (s->daemon_pid > 0 && gone_since == 0.0 && wire_pid_gone(s->daemon_pid))
            gone_since = now_s();
        if (gone_since > 0.0 && now_s() - gone_since >= 1e-3 * s->opts.daemon_lost_ms)
            return daemon_lost(s, what);
    }
}

static scape_rc no_reply(const scape_session *s, const char *what)
{
    return scape_set_error(SCAPE_TIMEOUT, "no reply from scaped at %s within %d ms (the %s)",
                           s->endpoint, s->opts.timeout_ms, what);
}

static scape_rc send_request(scape_session *s, const Scape__Request *q, const char *what)
{
    size_t len = scape__request__get_packed_size(q);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf == NULL)
        return scape_set_error(SCAPE_NOMEM, "out of memory");
    scape__request__pack(q, buf);
    double deadline = now_s() + 1e-3 * s->opts.timeout_ms;
    scape_rc rc = SCAPE_OK;
    /* non-blocking, so that a daemon that is gone cannot hold the send */
    while (zmq_send(s->sock, buf, len, ZMQ_DONTWAIT) < 0) {
        int e = zmq_errno();
        if (e != EAGAIN && e != EINTR) {
            rc = scape_set_error(SCAPE_ZMQ, "send to %s: %s", s->endpoint, zmq_strerror(e));
            break;
        }
        rc = wait_ready(s, s->sock, ZMQ_POLLOUT, deadline, what);
        if (rc != SCAPE_OK) {
            if (rc == SCAPE_TIMEOUT)
                rc = no_reply(s, what);
            break;
        }
    }
    free(buf);
    return rc;
}

/* Receive one message before the deadline (SCAPE_TIMEOUT without a message
 * when there is none). */
static scape_rc recv_msg(scape_session *s, double deadline, const char *what, zmq_msg_t *msg)
{
    for (;;) {
        scape_rc rc = wait_ready(s, s->sock, ZMQ_POLLIN, deadline, what);
        if (rc != SCAPE_OK)
            return rc;
        if (zmq_msg_recv(msg, s->sock, ZMQ_DONTWAIT) >= 0)
            return SCAPE_OK;
        int e = zmq_errno();
        if (e != EAGAIN && e != EINTR)
            return scape_set_error(SCAPE_ZMQ, "receive from %s: %s", s->endpoint,
                                   zmq_strerror(e));
    }
}

/* Receive one Reply, first passing over those owed to requests given up;
 * an error reply becomes its code and message.  want_detach: the answer to
 * a detach, which is never a Synced, Welcome, Registered or StepDone. */
static scape_rc recv_reply_as(scape_session *s, Scape__Reply **out, const char *what,
                              int want_detach)
{
    double deadline = now_s() + 1e-3 * s->opts.timeout_ms;
    for (;;) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        scape_rc rc = recv_msg(s, deadline, what, &msg);
        s->unanswered = rc == SCAPE_TIMEOUT || rc == SCAPE_SYSTEM;
        if (rc != SCAPE_OK) {
            zmq_msg_close(&msg);
            return rc == SCAPE_TIMEOUT ? no_reply(s, what) : rc;
        }
        Scape__Reply *r = scape__reply__unpack(NULL, zmq_msg_size(&msg), zmq_msg_data(&msg));
        zmq_msg_close(&msg);
        if (r == NULL)
            return scape_set_error(SCAPE_PROTO, "undecodable reply from %s", s->endpoint);
        int stale = s->owed > 0 && (!want_detach || r->status != SCAPE__STATUS__OK ||
                                    r->body_case != SCAPE__REPLY__BODY__NOT_SET);
        if (stale) {
            s->owed--;
            if (r->status != SCAPE__STATUS__OK && r->body_case == SCAPE__REPLY__BODY_ERROR &&
                r->error->message && strstr(r->error->message, "shutting down"))
                s->dead = 1;
            scape__reply__free_unpacked(r, NULL);
            continue;
        }
        s->refused = r->status != SCAPE__STATUS__OK;
        if (r->status != SCAPE__STATUS__OK) {
            scape_rc rc = wire_rc(r->status);
            scape_set_error(rc, "scaped: %s",
                            r->body_case == SCAPE__REPLY__BODY_ERROR && r->error->message
                                ? r->error->message : scape_rc_name(rc));
            if (strstr(scape_last_error(), "shutting down"))
                s->dead = 1;
            scape__reply__free_unpacked(r, NULL);
            return rc;
        }
        *out = r;
        return SCAPE_OK;
    }
}

static scape_rc recv_reply(scape_session *s, Scape__Reply **out, const char *what)
{
    return recv_reply_as(s, out, what, 0);
}

/* Send q and wait for a reply whose body is `want` (or none if want is 0).
 * A wait given up (interrupted, timed out) leaves its reply owed: the
 * session is then fit only for detach. */
static scape_rc call(scape_session *s, const Scape__Request *q, Scape__Reply__BodyCase want,
                     Scape__Reply **out, const char *what)
{
    if (s->dead)
        return scape_set_error(SCAPE_REMOTE, "scaped has shut down this session");
    int detach = q->body_case == SCAPE__REQUEST__BODY_DETACH;
    if (s->gave_up && !detach)
        return scape_set_error(SCAPE_INVALID, "an earlier call of this session was given up "
                               "before its answer came: detach it (and attach again)");
    Scape__Reply *r = NULL;
    scape_rc rc = send_request(s, q, what);
    if (rc == SCAPE_OK) {
        rc = recv_reply_as(s, &r, what, detach);
        if (rc != SCAPE_OK && s->unanswered && !detach) {
            s->owed++;
            s->gave_up = 1;
        }
    }
    if (rc == SCAPE_OK && want && r->body_case != want) {
        rc = scape_set_error(SCAPE_PROTO, "unexpected reply (body %d, wanted %d)",
                             (int)r->body_case, (int)want);
        scape__reply__free_unpacked(r, NULL);
        r = NULL;
    }
    if (out)
        *out = r;
    else if (r)
        scape__reply__free_unpacked(r, NULL);
    return rc;
}

/* ---- attach ----------------------------------------------------------------------- */

static scape_rc check_attach(const scape_tensor *layout, size_t nt, const scape_options *o,
                             scape_session **out, size_t *numel)
{
    if (out == NULL || layout == NULL || nt == 0)
        return scape_set_error(SCAPE_INVALID, "scape_attach: need a layout and an out pointer");
    if (o->memory != SCAPE_MEMORY_HOST && o->memory != SCAPE_MEMORY_CUDA)
        return scape_set_error(SCAPE_INVALID, "scape_attach: unknown memory kind %d",
                               (int)o->memory);
    if (o->memory == SCAPE_MEMORY_CUDA && o->device < 0)
        return scape_set_error(SCAPE_INVALID, "scape_attach: CUDA device %d", o->device);
    if ((unsigned)o->param_dtype > SCAPE_DTYPE_BF16 || (unsigned)o->grad_dtype > SCAPE_DTYPE_BF16)
        return scape_set_error(SCAPE_INVALID, "scape_attach: unknown dtype");
    if (!(o->max_grad_norm >= 0.0f || o->max_grad_norm == -1.0f) || isinf(o->max_grad_norm))
        return scape_set_error(SCAPE_INVALID, "scape_attach: max_grad_norm %g: >= 0, or -1 "
                               "for the daemon's", (double)o->max_grad_norm);
    if (o->timeout_ms < 1 || o->start_wait_ms < 0)
        return scape_set_error(SCAPE_INVALID, "scape_attach: timeout_ms must be >= 1 and "
                               "start_wait_ms >= 0");
    if (o->ngroups < 0 || o->ngroups > SCAPE_MAX_GROUPS ||
        (o->ngroups > 0 && o->group_weight_decay == NULL))
        return scape_set_error(SCAPE_INVALID, "scape_attach: ngroups %d: 0..%d, with "
                               "group_weight_decay", o->ngroups, SCAPE_MAX_GROUPS);
    size_t end = 0;
    for (size_t i = 0; i < nt; i++) {
        if (layout[i].name == NULL || layout[i].length == 0)
            return scape_set_error(SCAPE_INVALID, "scape_attach: tensor %zu needs a name and "
                                   "a length", i);
        if (layout[i].group >= (unsigned)(o->ngroups ? o->ngroups : 1))
            return scape_set_error(SCAPE_INVALID, "scape_attach: tensor %s is in parameter "
                                   "group %u of %d", layout[i].name, layout[i].group,
                                   o->ngroups ? o->ngroups : 1);
        size_t e = layout[i].offset + layout[i].length;
        end = e > end ? e : end;
    }
    *numel = end;
    return SCAPE_OK;
}

/* Whether something listens on the Unix socket at path: 0 yes (and *pid
 * the listening process, as this pid namespace numbers it; 0 when unknown),
 * else the errno of the attempt (ENOENT: no socket; ECONNREFUSED: a socket
 * nobody serves, left by a daemon that died). */
static int probe_socket(const char *path, pid_t *pid)
{
    *pid = 0;
    struct sockaddr_un a;
    if (strlen(path) >= sizeof a.sun_path)
        return ENAMETOOLONG;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    memcpy(a.sun_path, path, strlen(path));
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return errno;
    int rc = connect(fd, (struct sockaddr *)&a, sizeof a) == 0 ? 0 : errno;
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (rc == 0 && getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 &&
        len == sizeof cred)
        *pid = cred.pid;
    close(fd);
    return rc;
}

/* An ipc:// endpoint must have a daemon behind it: fail at once, saying
 * where we looked, rather than wait for a reply that cannot come; with
 * start_wait_ms, wait that long for it to appear, saying so once. */
static scape_rc find_daemon(scape_session *s)
{
    if (strncmp(s->endpoint, "ipc://", 6) != 0)
        return SCAPE_OK; /* another transport: its connect tells */
    const char *path = s->endpoint + 6;
    double until = now_s() + 1e-3 * s->opts.start_wait_ms;
    int said = 0, err;
    while ((err = probe_socket(path, &s->daemon_pid)) != 0 && now_s() < until) {
        if (!said++)
            fprintf(stderr, "libscape: waiting up to %.0f s for scaped at %s to start\n",
                    1e-3 * s->opts.start_wait_ms, s->endpoint);
        if (interrupted(s))
            return scape_set_error(SCAPE_SYSTEM, "interrupted: the caller gave up waiting "
                                   "for scaped at %s to start", s->endpoint);
        nanosleep(&(struct timespec){ 0, 50000000 }, NULL); /* a signal only shortens it */
    }
    if (err == 0)
        return SCAPE_OK;
    char dir[256];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = '\0';
    return scape_set_error(SCAPE_REMOTE, "no scaped at %s: %s (runtime directory %s); is "
                           "scaped running? Start it first, or point the trainer at its "
                           "runtime directory (SCAPE_RUNTIME_DIR) or endpoint "
                           "(SCAPE_ENDPOINT)", s->endpoint,
                           err == ENOENT ? "its control socket does not exist"
                           : err == ECONNREFUSED ? "its control socket is there but no "
                                                   "daemon serves it (one that stopped?)"
                                                 : strerror(err),
                           slash ? dir : ".");
}

static scape_rc connect_socket(scape_session *s, const char *endpoint)
{
    char dir[256];
    const char *env = getenv("SCAPE_ENDPOINT");
    scape_rc rc = SCAPE_OK;
    if (endpoint)
        snprintf(s->endpoint, sizeof s->endpoint, "%s", endpoint);
    else if (env && *env)
        snprintf(s->endpoint, sizeof s->endpoint, "%s", env);
    else if ((rc = wire_runtime_dir(dir, sizeof dir)) == SCAPE_OK)
        rc = wire_endpoint(s->endpoint, sizeof s->endpoint, dir, "control");
    if (rc != SCAPE_OK || (rc = find_daemon(s)) != SCAPE_OK)
        return rc;
    s->zctx = zmq_ctx_new();
    s->sock = s->zctx ? zmq_socket(s->zctx, ZMQ_DEALER) : NULL;
    int linger = 0;
    if (s->sock == NULL ||
        zmq_setsockopt(s->sock, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_connect(s->sock, s->endpoint) != 0)
        return scape_set_error(SCAPE_ZMQ, "connect to %s: %s", s->endpoint,
                               zmq_strerror(zmq_errno()));
    return SCAPE_OK;
}

static scape_rc hello(scape_session *s)
{
    char ident[96], host[64] = "?";
    gethostname(host, sizeof host - 1);
    snprintf(ident, sizeof ident, "%s:%d", host, (int)getpid());
    Scape__Hello h = SCAPE__HELLO__INIT;
    h.protocol = SCAPE_PROTOCOL_VERSION;
    h.trainer = ident;
    h.pid = (uint32_t)getpid();
    h.has_index = 1;
    h.index = s->opts.index;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_HELLO;
    q.hello = &h;
    Scape__Reply *r = NULL;
    scape_rc rc = call(s, &q, SCAPE__REPLY__BODY_WELCOME, &r, "hello");
    if (rc != SCAPE_OK)
        return rc;
    s->index = (int)r->welcome->index;
    s->next_step = r->welcome->next_step;
    scape__reply__free_unpacked(r, NULL);
    return SCAPE_OK;
}

static scape_rc register_layout(scape_session *s, const scape_tensor *layout, size_t nt)
{
    Scape__Tensor *ts = calloc(nt, sizeof *ts);
    Scape__Tensor **tp = calloc(nt, sizeof *tp);
    if (!ts || !tp) {
        free(ts);
        free(tp);
        return scape_set_error(SCAPE_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < nt; i++) {
        scape__tensor__init(&ts[i]);
        ts[i].name = (char *)layout[i].name;
        ts[i].offset = layout[i].offset;
        ts[i].length = layout[i].length;
        ts[i].has_group = layout[i].group != 0;
        ts[i].group = layout[i].group;
        tp[i] = &ts[i];
    }
    Scape__MemHandle mp = SCAPE__MEM_HANDLE__INIT, mg = SCAPE__MEM_HANDLE__INIT;
    if (on_device(s)) {
        Scape__MemHandle *m[2] = { &mp, &mg };
        lsc_dev_buf *b[2] = { &s->dparams, &s->dgrads };
        for (int i = 0; i < 2; i++) {
            m[i]->kind = SCAPE__MEM_KIND__CUDA_IPC;
            m[i]->has_ipc_handle = 1;
            m[i]->ipc_handle.data = b[i]->handle;
            m[i]->ipc_handle.len = sizeof b[i]->handle;
            m[i]->has_device = 1;
            m[i]->device = b[i]->device;
            m[i]->bytes = b[i]->bytes;
            m[i]->has_offset = 1;
            m[i]->offset = b[i]->offset;
            m[i]->has_device_uuid = 1;
            m[i]->device_uuid.data = b[i]->uuid;
            m[i]->device_uuid.len = sizeof b[i]->uuid;
        }
    } else {
        mp.shm_name = s->params.name;
        mp.bytes = s->params.bytes;
        mg.shm_name = s->grads.name;
        mg.bytes = s->grads.bytes;
    }
    Scape__Register g = SCAPE__REGISTER__INIT;
    g.n_tensors = nt;
    g.tensors = tp;
    g.param_dtype = (Scape__DType)s->opts.param_dtype;
    g.grad_dtype = (Scape__DType)s->opts.grad_dtype;
    g.params = &mp;
    g.grads = &mg;
    g.n_group_weight_decay = (size_t)s->opts.ngroups;
    g.group_weight_decay = (float *)s->opts.group_weight_decay;
    g.has_max_grad_norm = s->opts.max_grad_norm >= 0.0f;
    g.max_grad_norm = s->opts.max_grad_norm;
    g.has_grad_event = on_device(s);
    g.grad_event.data = s->dev_ev.grad_handle;
    g.grad_event.len = on_device(s) ? sizeof s->dev_ev.grad_handle : 0;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_REGISTER;
    q.register_ = &g;
    /* From here the daemon may open the device buffers; only its answer to
     * a detach says that it has closed them again. */
    s->dev_shared = on_device(s);
    Scape__Reply *r = NULL;
    scape_rc rc = call(s, &q, SCAPE__REPLY__BODY_REGISTERED, &r, "registration");
    s->registered = rc == SCAPE_OK;
    free(ts);
    free(tp);
    /* a daemon that knows events answers with its own; one that does not
     * ignored ours, and each step then synchronises the stream instead */
    if (rc == SCAPE_OK && on_device(s) && r->registered->has_params_event)
        rc = lsc_cuda_events_open_params(&s->dev_ev, r->registered->params_event.data,
                                         r->registered->params_event.len);
    if (r)
        scape__reply__free_unpacked(r, NULL);
    return rc;
}

static void session_free(scape_session *s)
{
    if (s->sock)
        zmq_close(s->sock);
    if (s->zctx)
        zmq_ctx_term(s->zctx);
    shm_free(&s->params);
    shm_free(&s->grads);
    free(s->bucket);
    if (s->dev_shared) {
        /* Freeing device memory that another process still has open is
         * undefined (cudaIpcOpenMemHandle): keep it until this process ends. */
        fprintf(stderr, "libscape: scaped did not confirm that it closed this trainer's CUDA "
                "buffers (%zu bytes); they stay allocated until the process ends\n",
                s->dparams.bytes + s->dgrads.bytes);
    } else {
        lsc_cuda_free(&s->dparams, s->dev_ev.stream);
        lsc_cuda_free(&s->dgrads, s->dev_ev.stream);
        lsc_cuda_events_free(&s->dev_ev);
    }
    free(s);
}

/* The daemon refused the registration, or took it and then this side
 * failed (the parameters-ready event would not open), but holds the slot
 * it welcomed us to: give it back (bounded, best effort), keeping the
 * failure's message.  Its answer also says it closed our CUDA buffers. */
static void leave_after_refusal(scape_session *s, scape_rc rc)
{
    char why[1024];
    snprintf(why, sizeof why, "%s", scape_last_error());
    if (!s->dead) {
        Scape__Detach d = SCAPE__DETACH__INIT;
        Scape__Request q = SCAPE__REQUEST__INIT;
        q.body_case = SCAPE__REQUEST__BODY_DETACH;
        q.detach = &d;
        if (call(s, &q, 0, NULL, "goodbye") == SCAPE_OK)
            s->dev_shared = 0;
    }
    scape_set_error(rc, "%s", why);
}

/* An option in milliseconds left at -1: the environment variable's value
 * when it is set, else dflt. */
static scape_rc env_ms(int *v, const char *name, int dflt)
{
    if (*v != -1)
        return *v >= 0 ? SCAPE_OK
                       : scape_set_error(SCAPE_INVALID, "scape_attach: %s option %d is "
                                         "negative (-1: the default)", name, *v);
    const char *e = getenv(name);
    *v = dflt;
    if (e == NULL || *e == '\0')
        return SCAPE_OK;
    char *end = NULL;
    long ms = strtol(e, &end, 10);
    if (*end != '\0' || ms < 0 || ms > 86400000)
        return scape_set_error(SCAPE_INVALID, "scape_attach: %s='%s' is not a number of "
                               "milliseconds (0 to 86400000)", name, e);
    *v = (int)ms;
    return SCAPE_OK;
}

scape_rc scape_attach(const char *endpoint, const scape_tensor *layout, size_t ntensors,
                      const scape_options *opts, scape_session **out)
{
    scape_options o;
    if (opts)
        o = *opts;
    else
        scape_options_default(&o);
    const char *ix = getenv("SCAPE_INDEX");
    if (o.index == -1 && ix && *ix) {
        char *end = NULL;
        long v = strtol(ix, &end, 10);
        if (*end != '\0' || v < 0 || v > 1023)
            return scape_set_error(SCAPE_INVALID, "scape_attach: SCAPE_INDEX='%s' is not a "
                                   "trainer slot (0, 1, ...)", ix);
        o.index = (int)v;
    }
    size_t numel = 0;
    scape_rc rc = env_ms(&o.start_wait_ms, "SCAPE_START_WAIT_MS", 0);
    if (rc == SCAPE_OK)
        rc = env_ms(&o.daemon_lost_ms, "SCAPE_DAEMON_LOST_MS", 2000);
    if (rc == SCAPE_OK)
        rc = check_attach(layout, ntensors, &o, out, &numel);
    if (rc != SCAPE_OK)
        return rc;
    scape_session *s = calloc(1, sizeof *s);
    if (s == NULL)
        return scape_set_error(SCAPE_NOMEM, "out of memory");
    s->opts = o;
    s->numel = numel;
    s->ntensors = ntensors;
    if ((s->bucket = calloc(ntensors, 1)) == NULL) {
        free(s);
        return scape_set_error(SCAPE_NOMEM, "out of memory");
    }
    size_t pb = numel * (o.param_dtype == SCAPE_DTYPE_BF16 ? 2 : 4);
    size_t gb = numel * (o.grad_dtype == SCAPE_DTYPE_BF16 ? 2 : 4);
    rc = on_device(s) ? lsc_cuda_check_ipc(o.device) : SCAPE_OK;
    if (rc == SCAPE_OK)
        rc = connect_socket(s, endpoint);
    /* The buffers come after the daemon's welcome, which can take long (a
     * daemon still starting, or in its rendezvous): a shared-memory name lives
     * until the daemon has mapped it, and a trainer killed while it waits
     * would leave the name behind in /dev/shm. */
    if (rc == SCAPE_OK)
        rc = hello(s);
    int welcomed = rc == SCAPE_OK;
    if (rc == SCAPE_OK && on_device(s)) {
        rc = lsc_cuda_events_create(&s->dev_ev, o.device);
        if (rc == SCAPE_OK)
            rc = lsc_cuda_alloc(&s->dparams, o.device, pb);
        if (rc == SCAPE_OK)
            rc = lsc_cuda_alloc(&s->dgrads, o.device, gb);
    } else if (rc == SCAPE_OK) {
        rc = shm_create(&s->params, "p", pb);
        if (rc == SCAPE_OK)
            rc = shm_create(&s->grads, "g", gb);
    }
    if (rc == SCAPE_OK) {
        rc = register_layout(s, layout, ntensors);
        /* whatever the daemon refused it for (a layout, a GPU it cannot
         * reach, MIG): it holds the slot of our hello, and may have had our
         * buffers open */
        if (rc != SCAPE_OK && (s->refused || s->registered || s->gave_up))
            leave_after_refusal(s, rc);
    } else if (welcomed) {
        leave_after_refusal(s, rc); /* our buffers failed: give the slot back */
    }
    if (rc == SCAPE_OK && !on_device(s)) {
        shm_unlink_name(&s->params);
        shm_unlink_name(&s->grads);
    }
    if (rc != SCAPE_OK) {
        session_free(s);
        return rc;
    }
    *out = s;
    return SCAPE_OK;
}

/* ---- sync, steps and detach ---------------------------------------------------------- */

/* A request the daemon answers with Synced: the step to post next. */
static scape_rc call_synced(scape_session *s, const Scape__Request *q, const char *what)
{
    Scape__Reply *r = NULL;
    scape_rc rc = call(s, q, SCAPE__REPLY__BODY_SYNCED, &r, what);
    if (rc != SCAPE_OK)
        return rc;
    s->next_step = r->synced->next_step;
    scape__reply__free_unpacked(r, NULL);
    return SCAPE_OK;
}

scape_rc scape_sync(scape_session *s)
{
    if (s == NULL)
        return scape_set_error(SCAPE_INVALID, "scape_sync: session is NULL");
    if (s->in_flight)
        return scape_set_error(SCAPE_INVALID, "scape_sync: a step is in flight");
    if (on_device(s) && lsc_cuda_grads_ready(&s->dev_ev, 1) != SCAPE_OK)
        return SCAPE_CUDA; /* the initial parameters must be in place */
    Scape__Sync y = SCAPE__SYNC__INIT;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_SYNC;
    q.sync = &y;
    return call_synced(s, &q, "sync");
}

/* ---- state_dict: checkpoints and resume ------------------------------------------------ */

/* One request on the daemon's status socket (next to its control socket),
 * through call() with that socket in place of the control one. */
static scape_rc status_call(scape_session *s, const Scape__Request *q,
                            Scape__Reply__BodyCase want, Scape__Reply **out, const char *what)
{
    size_t len = strlen(s->endpoint);
    if (strncmp(s->endpoint, "ipc://", 6) != 0 || len < 8 ||
        strcmp(s->endpoint + len - 8, "/control") != 0)
        return scape_set_error(SCAPE_INVALID, "state_dict: the daemon's status socket is "
                               "next to an ipc://DIR/control endpoint, not %s", s->endpoint);
    char control[sizeof s->endpoint];
    memcpy(control, s->endpoint, sizeof control);
    snprintf(s->endpoint + len - 8, sizeof s->endpoint - (len - 8), "/status");
    void *ctrl = s->sock;
    int linger = 0, owed = s->owed, gave_up = s->gave_up;
    s->sock = zmq_socket(s->zctx, ZMQ_REQ);
    scape_rc rc = SCAPE_OK;
    if (s->sock == NULL || zmq_setsockopt(s->sock, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_connect(s->sock, s->endpoint) != 0)
        rc = scape_set_error(SCAPE_ZMQ, "connect to %s: %s", s->endpoint,
                             zmq_strerror(zmq_errno()));
    if (rc == SCAPE_OK)
        rc = call(s, q, want, out, what);
    if (s->sock)
        zmq_close(s->sock);
    /* a reply given up on this socket went with it */
    s->owed = owed;
    s->gave_up = gave_up;
    s->sock = ctrl;
    memcpy(s->endpoint, control, sizeof control);
    return rc;
}

scape_rc scape_checkpoint(scape_session *s, scape_checkpoint_info *out)
{
    if (s == NULL || out == NULL)
        return scape_set_error(SCAPE_INVALID, "scape_checkpoint: NULL argument");
    if (s->in_flight)
        return scape_set_error(SCAPE_INVALID, "scape_checkpoint: a step is in flight");
    Scape__CheckpointRequest c = SCAPE__CHECKPOINT_REQUEST__INIT;
    c.has_now = 1;
    c.now = 1;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_CHECKPOINT;
    q.checkpoint = &c;
    Scape__Reply *r = NULL;
    scape_rc rc = status_call(s, &q, SCAPE__REPLY__BODY_CHECKPOINT, &r, "checkpoint");
    if (rc != SCAPE_OK)
        return rc;
    const Scape__CheckpointInfo *ci = r->checkpoint;
    memset(out, 0, sizeof *out);
    out->step = ci->step;
    out->layout_hash = ci->layout_hash;
    out->pending = ci->pending;
    snprintf(out->dir, sizeof out->dir, "%s", ci->dir ? ci->dir : "");
    snprintf(out->name, sizeof out->name, "%s", ci->name ? ci->name : "");
    out->job = ci->job;
    scape__reply__free_unpacked(r, NULL);
    return SCAPE_OK;
}

scape_rc scape_resumed_step(scape_session *s, uint64_t *step)
{
    if (s == NULL || step == NULL)
        return scape_set_error(SCAPE_INVALID, "scape_resumed_step: NULL argument");
    if (s->in_flight)
        return scape_set_error(SCAPE_INVALID, "scape_resumed_step: a step is in flight");
    Scape__StatusRequest m = SCAPE__STATUS_REQUEST__INIT;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_STATUS;
    q.status = &m;
    Scape__Reply *r = NULL;
    scape_rc rc = status_call(s, &q, SCAPE__REPLY__BODY_STATUS_REPLY, &r, "resumed_step");
    if (rc != SCAPE_OK)
        return rc;
    const Scape__CheckpointInfo *ci = r->status_reply->checkpoint;
    *step = ci ? ci->resumed_from : 0;
    scape__reply__free_unpacked(r, NULL);
    return SCAPE_OK;
}

scape_rc scape_resume(scape_session *s, const char *dir, uint64_t step, uint64_t layout_hash)
{
    if (s == NULL || dir == NULL)
        return scape_set_error(SCAPE_INVALID, "scape_resume: NULL argument");
    if (s->in_flight)
        return scape_set_error(SCAPE_INVALID, "scape_resume: a step is in flight");
    /* The daemon writes the checkpoint's parameters into our buffer: what
     * the caller's stream still has queued on it (a model's load_state_dict)
     * must have landed first, or it would land after them. */
    if (on_device(s) && lsc_cuda_grads_ready(&s->dev_ev, 1) != SCAPE_OK)
        return SCAPE_CUDA;
    Scape__Resume m = SCAPE__RESUME__INIT;
    m.dir = (char *)dir;
    m.has_step = step != 0;
    m.step = step;
    m.has_layout_hash = layout_hash != 0;
    m.layout_hash = layout_hash;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_RESUME;
    q.resume = &m;
    return call_synced(s, &q, "resume");
}

scape_rc scape_step_begin(scape_session *s, uint64_t step, float lr, const float *loss)
{
    return scape_step_begin_groups(s, step, &lr, -1, loss);
}

/* nlrs -1: one lr for every group (scape_step_begin). */
scape_rc scape_step_begin_groups(scape_session *s, uint64_t step, const float *lrs,
                                 int nlrs, const float *loss)
{
    if (s == NULL)
        return scape_set_error(SCAPE_INVALID, "scape_step_begin: session is NULL");
    if (lrs == NULL || (nlrs >= 0 && nlrs != s->opts.ngroups))
        return scape_set_error(SCAPE_INVALID, "scape_step_begin_groups: %d learning rates "
                               "for %d parameter group(s)", nlrs, s->opts.ngroups);
    float per[SCAPE_MAX_GROUPS];
    for (int g = 0; g < s->opts.ngroups; g++)
        per[g] = lrs[nlrs < 0 ? 0 : g];
    if (s->in_flight)
        return scape_set_error(SCAPE_INVALID, "scape_step_begin: a step is already in flight");
    if (s->dead)
        return scape_set_error(SCAPE_REMOTE, "scaped has shut down this session");
    /* The daemon reads the gradients once the stream that made them has
     * got to this point: the event it waits for (no device sync). */
    if (on_device(s) && lsc_cuda_grads_ready(&s->dev_ev, 0) != SCAPE_OK)
        return SCAPE_CUDA;
    Scape__Step st = SCAPE__STEP__INIT;
    st.step = step;
    st.lr = lrs[0];
    st.n_group_lr = (size_t)s->opts.ngroups;
    st.group_lr = per;
    st.has_loss = loss != NULL;
    st.loss = loss ? *loss : 0.0f;
    /* the daemon tells from it how long the step waited for it (Phases.queued) */
    struct timespec now;
    if (clock_gettime(CLOCK_MONOTONIC, &now) == 0) {
        st.has_sent_ns = 1;
        st.sent_ns = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
    }
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_STEP;
    q.step = &st;
    scape_rc rc = send_request(s, &q, "step");
    if (rc == SCAPE_OK) {
        s->in_flight = 1;
        s->posted = step;
        memset(s->bucket, 0, s->ntensors); /* the Step posts the rest */
    }
    return rc;
}

scape_rc scape_post_tensors(scape_session *s, size_t first, size_t count)
{
    if (s == NULL)
        return scape_set_error(SCAPE_INVALID, "scape_post_tensors: session is NULL");
    if (s->in_flight)
        return scape_set_error(SCAPE_INVALID, "scape_post_tensors: step %llu is in flight; "
                               "post the next step's tensors after it returns",
                               (unsigned long long)s->posted);
    if (s->dead)
        return scape_set_error(SCAPE_REMOTE, "scaped has shut down this session");
    if (count == 0 || first >= s->ntensors || count > s->ntensors - first)
        return scape_set_error(SCAPE_INVALID, "scape_post_tensors: tensors [%zu, %zu + %zu) "
                               "of step %llu: the layout has tensors [0, %zu)", first, first,
                               count, (unsigned long long)s->next_step, s->ntensors);
    for (size_t i = first; i < first + count; i++)
        if (s->bucket[i])
            return scape_set_error(SCAPE_INVALID, "scape_post_tensors: tensor %zu of step %llu "
                                   "is already posted (a bucket posted twice, or overlapping "
                                   "another)", i, (unsigned long long)s->next_step);
    if (on_device(s) && lsc_cuda_grads_ready(&s->dev_ev, 0) != SCAPE_OK)
        return SCAPE_CUDA;
    Scape__Post p = SCAPE__POST__INIT;
    p.step = s->next_step;
    p.first = (uint32_t)first;
    p.count = (uint32_t)count;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_POST;
    q.post = &p;
    scape_rc rc = send_request(s, &q, "post");
    if (rc != SCAPE_OK)
        return rc;
    memset(s->bucket + first, 1, count);
    return SCAPE_OK;
}

static void fill_info(const Scape__StepDone *d, scape_step_info *info)
{
    memset(info, 0, sizeof *info);
    info->step = d->step;
    info->k = d->k;
    info->density = d->density;
    info->bytes = d->bytes;
    info->wire_bytes = d->wire_bytes;
    info->residual_norm = d->residual_norm;
    info->mask_churn = d->mask_churn;
    info->step_seconds = d->phases ? d->phases->total : 0.0;
    info->wait_seconds = d->phases ? d->phases->wait : 0.0;
    info->grad_norm = d->has_grad_norm ? d->grad_norm : 0.0;
    info->clip = d->has_clip ? d->clip : 1.0;
    info->mean_grad_norm = d->has_mean_grad_norm ? d->mean_grad_norm : -1.0;
    info->mean_grad_exact = d->has_mean_grad_exact && d->mean_grad_exact;
}

scape_rc scape_step_wait(scape_session *s, scape_step_info *info)
{
    if (s == NULL)
        return scape_set_error(SCAPE_INVALID, "scape_step_wait: session is NULL");
    if (!s->in_flight)
        return scape_set_error(SCAPE_INVALID, "scape_step_wait: no step in flight");
    Scape__Reply *r = NULL;
    char what[48];
    snprintf(what, sizeof what, "step %llu", (unsigned long long)s->posted);
    scape_rc rc = recv_reply(s, &r, what);
    if (rc != SCAPE_OK && s->unanswered)
        return rc; /* still in flight: the caller may wait again */
    s->in_flight = 0;
    if (rc != SCAPE_OK)
        return rc;
    if (r->body_case != SCAPE__REPLY__BODY_STEP_DONE)
        rc = scape_set_error(SCAPE_PROTO, "unexpected reply to a step (body %d)",
                             (int)r->body_case);
    else if (on_device(s) && lsc_cuda_params_ready(&s->dev_ev) != SCAPE_OK)
        rc = SCAPE_CUDA; /* the stream (or the host) after the new parameters */
    else if (info)
        fill_info(r->step_done, info);
    if (rc == SCAPE_OK)
        s->next_step = s->posted + 1;
    scape__reply__free_unpacked(r, NULL);
    return rc;
}

scape_rc scape_set_stream(scape_session *s, void *stream, int blocking)
{
    if (s == NULL)
        return scape_set_error(SCAPE_INVALID, "scape_set_stream: session is NULL");
    if (!on_device(s))
        return scape_set_error(SCAPE_INVALID, "scape_set_stream: this session's buffers are "
                               "in host memory (SCAPE_MEMORY_HOST): no stream to order");
    if (s->in_flight)
        return scape_set_error(SCAPE_INVALID, "scape_set_stream: a step is in flight");
    s->dev_ev.stream = stream;
    s->dev_ev.blocking = blocking != 0;
    return SCAPE_OK;
}

scape_rc scape_step(scape_session *s, uint64_t step, float lr, const float *loss,
                    scape_step_info *info)
{
    scape_rc rc = scape_step_begin(s, step, lr, loss);
    return rc == SCAPE_OK ? scape_step_wait(s, info) : rc;
}

scape_rc scape_detach(scape_session **sp)
{
    if (sp == NULL || *sp == NULL)
        return scape_set_error(SCAPE_INVALID, "scape_detach: session is NULL");
    scape_session *s = *sp;
    scape_rc rc = SCAPE_OK;
    if (s->in_flight)
        rc = scape_step_wait(s, NULL);
    if (s->in_flight && !s->dead) {
        /* scaped refuses a goodbye while this trainer's step is posted */
        char why[512];
        snprintf(why, sizeof why, "%s", scape_last_error());
        scape_set_error(rc, "detach: step %llu is still in flight (%s); the session is closed "
                        "without a goodbye, and scaped frees its slot when this process ends",
                        (unsigned long long)s->posted, why);
    } else if (!s->dead) {
        Scape__Detach d = SCAPE__DETACH__INIT;
        Scape__Request q = SCAPE__REQUEST__INIT;
        q.body_case = SCAPE__REQUEST__BODY_DETACH;
        q.detach = &d;
        scape_rc drc = call(s, &q, 0, NULL, "goodbye");
        if (drc == SCAPE_OK) /* answered once the daemon has closed our buffers */
            s->dev_shared = 0;
        rc = rc == SCAPE_OK ? drc : rc;
    }
    session_free(s);
    *sp = NULL;
    return rc;
}
