/* server.c - scaped's lifecycle and event loop.
 *
 * One thread polls three ZeroMQ sockets: the control ROUTER (trainers), the
 * status REP (scapectl) and, outbound only, the events PUB.  Between polls it
 * checks that every attached trainer's process is still alive; a trainer that
 * died is dropped and a step it left half-posted is abandoned for the others.
 * Steps run on this thread as soon as every registered trainer has posted;
 * while one of their collectives waits for another daemon, the status socket
 * and the metrics listener are served from that wait's poll (wait_hook).
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "comm_host.h"
#include "comm_nccl.h"
#include "log.h"
#include "auth.h"
#include "rendezvous.h"
#include "scape_wire.h"
#include "exec.h"
#include "metrics_http.h"
#include "server_internal.h"
#include "try.h"

static volatile sig_atomic_t s_stop;          /* stop requests (signals) so far */
static volatile sig_atomic_t s_stop_leaving = -1; /* s_stop when leaving began; -1: not */

void srv_request_stop(void)
{
    if (s_stop < 1000)
        s_stop++;
}

/* A collective waiting on another daemon gives up when we are told to stop
 * (while leaving with the other daemons: told once more). */
static int stop_requested(void)
{
    return s_stop > 0 && (s_stop_leaving < 0 || s_stop > s_stop_leaving);
}

/* The TRY trail (try.h): each level a failure passes through, one debug
 * line with its file:line, before the line that reports the failure. */
static void log_trail(scape_rc rc, const char *file, int line)
{
    if (log_enabled(LOG_LVL_DEBUG))
        log_msg(LOG_LVL_DEBUG, SUB_MAIN, file, line, "%s passed up", scape_rc_name(rc));
}

/* ---- set-up ---------------------------------------------------------------- */

/* mkdir the runtime directory (mode 0700) and refuse one we do not own or
 * that others can enter. */
static scape_rc make_runtime_dir(const char *dir)
{
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return scape_set_error(SCAPE_SYSTEM, "mkdir('%s'): %s", dir, strerror(errno));
    struct stat st;
    if (stat(dir, &st) != 0)
        return scape_set_error(SCAPE_SYSTEM, "stat('%s'): %s", dir, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return scape_set_error(SCAPE_INVALID, "runtime dir '%s' is not a directory", dir);
    if (st.st_uid != geteuid())
        return scape_set_error(SCAPE_INVALID, "runtime dir '%s' belongs to uid %d, not us",
                               dir, (int)st.st_uid);
    if ((st.st_mode & 0777) != 0700 && chmod(dir, 0700) != 0)
        return scape_set_error(SCAPE_SYSTEM, "chmod('%s', 0700): %s", dir, strerror(errno));
    return SCAPE_OK;
}

/* One daemon per runtime directory: a write lock on scaped.pid. */
static scape_rc lock_dir(server *s)
{
    char path[320];
    snprintf(path, sizeof path, "%s/scaped.pid", s->dir);
    s->lock_fd = open(path, O_RDWR | O_CREAT, 0600);
    if (s->lock_fd < 0)
        return scape_set_error(SCAPE_SYSTEM, "open('%s'): %s", path, strerror(errno));
    struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET };
    if (fcntl(s->lock_fd, F_SETLK, &fl) != 0) {
        char pid[32] = "";
        ssize_t n = pread(s->lock_fd, pid, sizeof pid - 1, 0);
        pid[n > 0 ? n : 0] = '\0';
        return scape_set_error(SCAPE_INVALID,
                               "another scaped (pid %s) is serving '%s'; stop it or pick "
                               "another runtime_dir",
                               strtok(pid, "\n") ? pid : "?", s->dir);
    }
    s->locked = 1;
    char buf[32];
    int len = snprintf(buf, sizeof buf, "%d\n", (int)getpid());
    if (ftruncate(s->lock_fd, 0) != 0 || pwrite(s->lock_fd, buf, (size_t)len, 0) != len)
        return scape_set_error(SCAPE_SYSTEM, "write('%s'): %s", path, strerror(errno));
    return SCAPE_OK;
}

static scape_rc open_socket(server *s, void **sock, int type, const char *name, char *ep,
                            size_t eplen)
{
    scape_rc rc = wire_endpoint(ep, eplen, s->dir, name);
    if (rc != SCAPE_OK)
        return rc;
    *sock = zmq_socket(s->zctx, type);
    if (*sock == NULL)
        return scape_set_error(SCAPE_ZMQ, "zmq_socket(%s): %s", name, zmq_strerror(zmq_errno()));
    int linger = 0;
    int64_t maxmsg = SRV_HARD_MAX_MESSAGE;
    if (zmq_setsockopt(*sock, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_setsockopt(*sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg) != 0)
        return scape_set_error(SCAPE_ZMQ, "zmq_setsockopt(%s): %s", name,
                               zmq_strerror(zmq_errno()));
    if (zmq_bind(*sock, ep) != 0)
        return scape_set_error(SCAPE_ZMQ, "zmq_bind(%s): %s", ep, zmq_strerror(zmq_errno()));
    return SCAPE_OK;
}

/* How the job's daemons prove who they are: the auth key, auto resolved
 * (munge when a munged answers; otherwise there is no safe default and the
 * daemon does not start). */
static scape_rc open_auth(server *s, auth_ctx **out)
{
    const scaped_config *c = &s->cfg;
    auth_mode m = AUTH_MUNGE;
    char why[300] = "";
    if (c->auth == CFG_AUTH_SECRET)
        m = AUTH_SECRET;
    else if (c->auth == CFG_AUTH_NONE)
        m = AUTH_NONE;
    else if (c->auth == CFG_AUTH_AUTO && !auth_munge_answers(c->munge_socket, why, sizeof why))
        return scape_set_error(SCAPE_INVALID,
                               "world %d: the daemons must prove they are this job's, and auth "
                               "is auto but %.300s.  Choose one: auth: munge (a munged running, "
                               "as on every Slurm cluster; munge_socket names its socket), "
                               "auth: secret with auth_key_file (write one with 'scaped keygen "
                               "FILE' where the job's nodes share it), or auth: none (anyone "
                               "who reaches the ports can join or disturb the job)",
                               c->world, why);
    TRY(auth_create(m, c->auth_key_file, c->munge_socket, out));
    s->auth_mode = (int)m;
    if (m == AUTH_NONE)
        LOG_WARN(SUB_COMM, "auth none: the rendezvous and the data plane accept anyone who "
                 "reaches their ports");
    else
        LOG_INFO(SUB_COMM, "auth %s%s%s", auth_mode_name(m), m == AUTH_SECRET ? ": key " : "",
                 m == AUTH_SECRET ? c->auth_key_file : "");
    return SCAPE_OK;
}

/* The nccl backend: rank 0 makes the communicators' ids, the rendezvous
 * hands them out (with one daemon there is nobody to meet).  NCCL's own
 * traffic is not authenticated (docs/operations.md); the ids travel sealed. */
static scape_rc open_nccl(server *s)
{
    const scaped_config *c = &s->cfg;
    comm_nccl_opts o = { .rank = c->rank, .size = c->world, .device = c->cuda_device,
                         .timeout_ms = c->comm_timeout_ms };
    if (c->rank == 0)
        TRY(comm_nccl_make_ids(o.ids, sizeof o.ids));
    if (c->world > 1) {
        if (!c->coordinator[0])
            return scape_set_error(SCAPE_INVALID, "world %d needs a coordinator endpoint",
                                   c->world);
        auth_ctx *a = NULL;
        TRY(open_auth(s, &a));
        rdv_opts ro = { .rank = c->rank, .world = c->world, .coordinator = c->coordinator,
                        .endpoint = c->listen[0] ? c->listen : "nccl", .job = c->job,
                        .timeout_ms = c->comm_timeout_ms, .blob = o.ids,
                        .blob_len = sizeof o.ids, .auth = a };
        rdv_result r;
        scape_rc rc = rdv_run(&ro, &r);
        auth_destroy(a);
        if (rc != SCAPE_OK)
            return rc;
        s->rdv_refused = r.refused;
        int ok = r.blob_len == sizeof o.ids;
        if (ok)
            memcpy(o.ids, r.blob, sizeof o.ids);
        rdv_result_free(&r);
        if (!ok)
            return scape_set_error(SCAPE_PROTO, "rendezvous: rank 0 sent no NCCL ids (is it "
                                   "running comm_backend host?)");
    }
    LOG_INFO(SUB_COMM, "joining the NCCL communicators: rank %d of %d on CUDA device %d",
             c->rank, c->world, c->cuda_device);
    TRY(comm_nccl_create(&o, &s->comm));
    LOG_INFO(SUB_COMM, "connected over NCCL");
    return SCAPE_OK;
}

/* The host backend has bound this daemon's data plane (a '*' port is now a
 * real one): publish that address at the rendezvous, learn the others'. */
typedef struct meet_ctx {
    server *s;
    auth_ctx *auth;
    const char *curve_key; /* this daemon's public key, or NULL */
    rdv_result r;
    int have;
} meet_ctx;

static scape_rc meet_peers(void *arg, const char *bound, const char *const **endpoints,
                           const char *const **keys)
{
    meet_ctx *m = arg;
    const scaped_config *c = &m->s->cfg;
    snprintf(m->s->data_ep, sizeof m->s->data_ep, "%s", bound);
    LOG_INFO(SUB_COMM, "rendezvous: rank %d of %d via %s, data plane on %s", c->rank, c->world,
             c->coordinator, bound);
    rdv_opts o = { .rank = c->rank, .world = c->world, .coordinator = c->coordinator,
                   .endpoint = bound, .job = c->job, .timeout_ms = c->comm_timeout_ms,
                   .auth = m->auth, .curve_key = m->curve_key };
    TRY(rdv_run(&o, &m->r));
    m->have = 1;
    m->s->rdv_refused = m->r.refused;
    *endpoints = (const char *const *)m->r.endpoints;
    *keys = (const char *const *)m->r.keys;
    return SCAPE_OK;
}

/* Several daemons over the host backend: meet the others at the rendezvous,
 * then connect the data plane (CURVE when the rendezvous is authenticated). */
static scape_rc open_host(server *s)
{
    const scaped_config *c = &s->cfg;
    if (!c->coordinator[0] || !c->listen[0])
        return scape_set_error(SCAPE_INVALID, "world %d needs coordinator and listen endpoints",
                               c->world);
    meet_ctx m = { .s = s };
    TRY(open_auth(s, &m.auth));
    /* A fresh CURVE key pair for this daemon's data plane, whenever the
     * rendezvous that hands out the public keys is itself authenticated. */
    char pub[41], sec[41];
    scape_rc rc = SCAPE_OK;
    if (auth_ctx_mode(m.auth) != AUTH_NONE) {
        if (!zmq_has("curve"))
            rc = scape_set_error(SCAPE_UNSUPPORTED, "auth %s needs CURVE, and this libzmq has "
                                 "none (auth: none, or a libzmq built with libsodium)",
                                 auth_mode_name(auth_ctx_mode(m.auth)));
        else if (zmq_curve_keypair(pub, sec) != 0)
            rc = scape_set_error(SCAPE_ZMQ, "zmq_curve_keypair: %s", zmq_strerror(zmq_errno()));
        else
            m.curve_key = pub;
    }
    comm_host_opts h = { .rank = c->rank, .size = c->world, .listen = c->listen,
                         .meet = meet_peers, .meet_arg = &m,
                         .timeout_ms = c->comm_timeout_ms, .job = c->job,
                         .curve_public = m.curve_key, .curve_secret = m.curve_key ? sec : NULL };
    if (rc == SCAPE_OK)
        rc = comm_host_create(&h, &s->comm);
    memset(sec, 0, sizeof sec);
    auth_destroy(m.auth);
    if (m.have)
        rdv_result_free(&m.r);
    s->curve = rc == SCAPE_OK && m.curve_key != NULL;
    if (s->curve)
        snprintf(s->curve_public, sizeof s->curve_public, "%s", pub);
    if (rc == SCAPE_OK)
        LOG_INFO(SUB_COMM, "connected to %d daemon(s) over the host backend%s", c->world - 1,
                 s->curve ? ", CURVE: authenticated and encrypted" : ", plain TCP");
    return rc;
}

/* One daemon: the local backend with one rank. */
static scape_rc open_local(server *s) { return comm_local_create(1, &s->comm); }

static int fits_nccl(const scaped_config *c) { return c->backend == COMM_BACKEND_NCCL; }
static int fits_local(const scaped_config *c) { return c->world == 1; }
static int fits_host(const scaped_config *c) { (void)c; return 1; }

/* The comm backends, as NCCL's transports: the first row that fits the
 * configuration opens the comm. */
typedef struct comm_backend_row {
    const char *name;
    int (*fits)(const scaped_config *c);
    scape_rc (*open)(server *s);
} comm_backend_row;

static const comm_backend_row s_backends[] = {
    { "nccl", fits_nccl, open_nccl },
    { "local", fits_local, open_local },
    { "host", fits_host, open_host },
};

static scape_rc open_comm(server *s)
{
    const scaped_config *c = &s->cfg;
    if (c->rank >= c->world)
        return scape_set_error(SCAPE_INVALID, "rank %d is outside world %d", c->rank, c->world);
    for (size_t i = 0; i < sizeof s_backends / sizeof *s_backends; i++)
        if (s_backends[i].fits(c)) {
            LOG_DEBUG(SUB_COMM, "comm backend %s", s_backends[i].name);
            return s_backends[i].open(s);
        }
    return scape_set_error(SCAPE_INVALID, "no comm backend fits world %d", c->world);
}

/* The executor the engine will run on: the key's choice, auto resolved. */
static scape_rc choose_executor(server *s)
{
    const char *why = "";
    TRY(cfg_resolve_executor(&s->cfg, &s->cfg.engine.executor, &why));
    s->cfg.engine.device = s->cfg.cuda_device;
    if (s->cfg.engine.executor == ENG_EXEC_CUDA)
        TRY(exec_cuda_use_device(s->cfg.cuda_device)); /* trainers' buffers register there */
    if (s->cfg.executor == CFG_EXEC_AUTO)
        LOG_INFO(SUB_ENGINE, "executor %s (auto: %s)",
                 eng_executor_name(s->cfg.engine.executor), why);
    else
        LOG_INFO(SUB_ENGINE, "executor %s", eng_executor_name(s->cfg.engine.executor));
    return SCAPE_OK;
}

/* The comm wait hook (comm.h): while a collective waits for sock, the
 * status plane is served from the same poll (docs/design.md, "Status during
 * a wait"). */
static int wait_hook(void *arg, void *sock, long timeout_ms)
{
    server *s = arg;
    zmq_pollitem_t items[2 + MHTTP_MAX_ITEMS] = { { sock, 0, ZMQ_POLLIN, 0 } };
    int first = sock != NULL;
    int n = first + status_poll_items(s, items + first);
    int rc = zmq_poll(items, n, timeout_ms);
    if (rc < 0)
        return -1;
    status_poll_serve(s, items + first, rc > 0 ? n - first : 0);
    return first && (items[0].revents & ZMQ_POLLIN) ? 1 : 0;
}

scape_rc srv_create(server **out, const scaped_config *cfg)
{
    scape_set_trail(log_trail);
    server *s = calloc(1, sizeof *s);
    if (s == NULL)
        return scape_set_error(SCAPE_NOMEM, "server: out of memory");
    s->cfg = *cfg;
    s->lock_fd = -1;
    s->started_at = job_now();
    job_init(&s->job, cfg->engine.max_grad_norm > 0.0f);
    scape_rc rc = cfg->runtime_dir[0]
                      ? (snprintf(s->dir, sizeof s->dir, "%s", cfg->runtime_dir), SCAPE_OK)
                      : wire_runtime_dir(s->dir, sizeof s->dir);
    /* A checkpoint that cannot be resumed stops the daemon before it binds
     * anything that trainers or scapectl could find. */
    if (rc == SCAPE_OK)
        rc = choose_executor(s);
    if (rc == SCAPE_OK)
        rc = ckp_prepare_resume(s);
    if (rc == SCAPE_OK)
        rc = make_runtime_dir(s->dir);
    if (rc == SCAPE_OK)
        rc = lock_dir(s);
    if (rc == SCAPE_OK && (s->zctx = zmq_ctx_new()) == NULL)
        rc = scape_set_error(SCAPE_ZMQ, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
    /* The control socket last: whoever waits for it to appear (trainers,
     * scripts, tests) may then use every socket. */
    if (rc == SCAPE_OK)
        rc = open_socket(s, &s->status, ZMQ_REP, "status", s->ep_status, sizeof s->ep_status);
    if (rc == SCAPE_OK)
        rc = open_socket(s, &s->events, ZMQ_PUB, "events", s->ep_events, sizeof s->ep_events);
    if (rc == SCAPE_OK && s->cfg.metrics_listen[0] && strcmp(s->cfg.metrics_listen, "off") != 0)
        rc = mhttp_create(&s->metrics_http, s->cfg.metrics_listen, status_metrics, s);
    if (rc == SCAPE_OK)
        rc = open_socket(s, &s->ctrl, ZMQ_ROUTER, "control", s->ep_control, sizeof s->ep_control);
    if (rc == SCAPE_OK) {
        comm_set_interrupt(stop_requested);
        rc = open_comm(s);
    }
    if (rc == SCAPE_OK)
        comm_set_wait_hook(wait_hook, s);
    if (rc != SCAPE_OK) {
        srv_destroy(&s);
        return rc;
    }
    *out = s;
    return SCAPE_OK;
}

/* ---- the loop ------------------------------------------------------------- */

/* Receive one control message: [routing id][payload].  Anything else gets a
 * PROTO error; nothing is trusted before it is decoded and checked. */
static void control_recv(server *s)
{
    unsigned char rid[SRV_RID_MAX];
    int rlen = zmq_recv(s->ctrl, rid, sizeof rid, ZMQ_DONTWAIT);
    if (rlen < 0)
        return;
    size_t rid_len = (size_t)rlen > sizeof rid ? sizeof rid : (size_t)rlen;
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    int n = zmq_msg_recv(&msg, s->ctrl, ZMQ_DONTWAIT);
    int extra = 0;
    while (n >= 0 && zmq_msg_more(&msg)) { /* more frames than one payload */
        extra++;
        zmq_msg_close(&msg);
        zmq_msg_init(&msg);
        n = zmq_msg_recv(&msg, s->ctrl, ZMQ_DONTWAIT);
    }
    Scape__Request *q = NULL;
    if (n >= 0 && status_peer_refused(s, &msg, "control")) {
        zmq_msg_close(&msg);
        ctl_reply_error(s, rid, rid_len, SCAPE_INVALID);
        return;
    }
    if (n < 0)
        scape_set_error(SCAPE_PROTO, "a message without a payload frame");
    else if (extra)
        scape_set_error(SCAPE_PROTO, "a message of %d frames; one request per message", extra + 1);
    else if ((size_t)n > s->cfg.max_message_bytes)
        scape_set_error(SCAPE_PROTO, "a message of %d bytes exceeds the limit of %u bytes", n,
                        s->cfg.max_message_bytes);
    else if ((q = scape__request__unpack(NULL, (size_t)n, zmq_msg_data(&msg))) == NULL)
        scape_set_error(SCAPE_PROTO, "undecodable request of %d bytes (truncated or not a "
                        "scape.Request)", n);
    else if (q->body_case == SCAPE__REQUEST__BODY__NOT_SET)
        scape_set_error(SCAPE_PROTO, "unknown or empty request type");
    zmq_msg_close(&msg);
    if (q && q->body_case != SCAPE__REQUEST__BODY__NOT_SET) {
        s->msg_bytes = (size_t)n;
        ctl_handle(s, rid, rid_len, q);
    } else {
        LOG_WARN(SUB_CTRL, "refused: %s", scape_last_error());
        ctl_reply_error(s, rid, rid_len, SCAPE_PROTO);
    }
    if (q)
        scape__request__free_unpacked(q, NULL);
}

static void check_liveness(server *s)
{
    for (int i = 0; i < SRV_MAX_SLOTS; i++)
        if (s->slots[i].used && wire_pid_gone(s->slots[i].pid))
            ctl_drop(s, &s->slots[i], 1);
}

/* Tell every attached trainer, then forget them and unmap their buffers (the
 * unlink is for names a trainer had not yet unlinked itself). */
static void farewell(server *s)
{
    for (int i = 0; i < SRV_MAX_SLOTS; i++) {
        trainer *t = &s->slots[i];
        if (!t->used)
            continue;
        scape_set_error(SCAPE_REMOTE, "scaped is shutting down");
        ctl_reply_error(s, t->rid, t->rid_len, SCAPE_REMOTE);
        ctl_close_map(s, &t->params, 1);
        ctl_close_map(s, &t->grads, 1);
        free(t->bucket);
        t->bucket = NULL;
        t->used = 0;
    }
}

scape_rc srv_serve_once(server *s, int timeout_ms, int *handled)
{
    status_release(s); /* a checkpoint request held during a collective */
    zmq_pollitem_t items[2 + MHTTP_MAX_ITEMS] = { { s->ctrl, 0, ZMQ_POLLIN, 0 } };
    int nitems = 1 + status_poll_items(s, items + 1);
    int rc = zmq_poll(items, nitems, timeout_ms);
    if (rc < 0 && zmq_errno() != EINTR)
        return scape_set_error(SCAPE_ZMQ, "zmq_poll: %s", zmq_strerror(zmq_errno()));
    int n = 0;
    if (rc > 0 && (items[0].revents & ZMQ_POLLIN)) {
        control_recv(s);
        n++;
    }
    n += status_poll_serve(s, items + 1, rc > 0 ? nitems - 1 : 0);
    ctl_reap_maps(s, 0);
    if (job_now() >= s->next_check) {
        check_liveness(s);
        ckp_idle(s); /* a state_dict on another daemon of the job */
        s->next_check = job_now() + 1e-3 * s->cfg.liveness_ms;
    }
    if (handled)
        *handled = n;
    return SCAPE_OK;
}

/* Several daemons: stay, serving checkpoint rounds, until every daemon of
 * the job is leaving too (checkpoint.c, "Leaving together"), a peer is gone
 * or the job broken, comm_timeout_ms passes, or another signal comes. */
static void leave_together(server *s)
{
    s_stop_leaving = s_stop; /* from here the rounds go on until told again */
    if (!ckp_leave_begin(s)) {
        s_stop_leaving = -1;
        return;
    }
    double until = job_now() + 1e-3 * s->cfg.comm_timeout_ms;
    scape_rc rc = SCAPE_OK;
    int lost = -1;
    long long down_ms = 0;
    while (rc == SCAPE_OK && !ckp_left(s) && s_stop <= s_stop_leaving && job_now() < until &&
           (lost = comm_gone(s->comm, &down_ms)) < 0)
        rc = srv_serve_once(s, s->cfg.liveness_ms, NULL);
    const char *why = NULL;
    char gone[160];
    if (s_stop > s_stop_leaving) {
        why = "told to stop again: stopping now";
    } else if (rc != SCAPE_OK) {
        why = scape_last_error();
    } else if (lost >= 0) {
        snprintf(gone, sizeof gone, "rank %d's daemon is gone (its connection closed %lld ms "
                 "ago): no state_dict can come any more", lost, down_ms);
        why = gone;
    } else if (!ckp_left(s)) {
        why = "comm_timeout_ms passed";
    } else if (s->job.broken) {
        why = s->job.broken_why;
    }
    s_stop_leaving = -1;
    ckp_leave_end(s, why);
}

scape_rc srv_run(server *s)
{
    LOG_INFO(SUB_MAIN, "serving %s (status %s, events %s)", s->ep_control, s->ep_status,
             s->ep_events);
    while (!srv_stopping(s))
        TRY(srv_serve_once(s, s->cfg.liveness_ms, NULL));
    s->stopping = 1;
    LOG_INFO(SUB_MAIN, "stopping after step %llu", (unsigned long long)s->job.next_step - 1);
    farewell(s);
    leave_together(s);
    return SCAPE_OK;
}

int srv_stopping(const server *s) { return s->stopping || s_stop; }

void srv_destroy(server **sp)
{
    if (sp == NULL || *sp == NULL)
        return;
    server *s = *sp;
    comm_set_wait_hook(NULL, NULL);
    farewell(s);
    shm_map_close(&s->spare, 1);
    job_close(&s->job);
    comm_destroy(&s->comm); /* finalized or aborted: nothing in flight any more */
    ctl_reap_maps(s, 1);
    free(s->graves);
    if (s->held)
        scape__request__free_unpacked(s->held, NULL);
    mhttp_destroy(&s->metrics_http);
    void *socks[] = { s->ctrl, s->status, s->events };
    for (size_t i = 0; i < 3; i++)
        if (socks[i])
            zmq_close(socks[i]);
    if (s->zctx)
        zmq_ctx_term(s->zctx);
    const char *names[] = { "control", "status", "events", "scaped.pid" };
    for (size_t i = 0; s->locked && i < 4; i++) {
        char path[320];
        snprintf(path, sizeof path, "%s/%s", s->dir, names[i]);
        unlink(path);
    }
    if (s->lock_fd >= 0)
        close(s->lock_fd);
    for (size_t i = 0; s->layout && i < s->ntensors; i++)
        free((char *)s->layout[i].name);
    free(s->layout);
    free(s->early);
    free(s->take);
    free(s);
    *sp = NULL;
}
