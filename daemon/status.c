/* status.c - the status plane: a REP socket answering status, metrics and
 * shutdown requests, and a PUB socket with one Metrics message per step.
 * Also served from inside a collective's wait (server.c's wait hook): then
 * the reply says what the collective waits for. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "auth.h"
#include "log.h"
#include "metrics_http.h"
#include "scape_prom.h"
#include "scape_wire.h"
#include "server_internal.h"

#define SCAPED_VERSION "0.1.0"

/* Private resident memory (RssAnon): the trainers' shared buffers that this
 * process maps are theirs, not the daemon's. */
static uint64_t rss_bytes(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long kib = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "RssAnon: %llu kB", &kib) == 1)
            break;
    if (f)
        fclose(f);
    return (uint64_t)kib * 1024;
}

/* Before step 1: how many of the trainers the job waits for (the
 * `trainers` key) have not registered yet; 0 once it has started. */
static int trainers_missing(const server *s)
{
    int n = s->cfg.trainers - srv_trainers(s, 0);
    return !job_started(&s->job) && n > 0 ? n : 0;
}

static const char *state_name(const server *s)
{
    if (s->stopping)
        return "stopping";
    if (s->job.broken)
        return "broken";
    return srv_trainers(s, 0) && !trainers_missing(s) ? "ready" : "waiting";
}

/* The trainers the job still waits for, and the free slots they may take. */
static void fill_waiting(const server *s, Scape__StatusReply *st, uint32_t *slots)
{
    st->has_trainers_expected = 1;
    st->trainers_expected = (uint32_t)s->cfg.trainers;
    int missing = trainers_missing(s);
    if (missing == 0)
        return;
    st->has_waiting_for = 1;
    st->waiting_for = (uint32_t)missing;
    st->waiting_slots = slots;
    for (int i = 0; i < s->cfg.trainers && i < SRV_MAX_SLOTS; i++)
        if (!s->slots[i].used || !s->slots[i].registered)
            slots[st->n_waiting_slots++] = (uint32_t)i;
}

/* The keys shown in status, and their values (fill_config). */
typedef struct status_config {
    cfg_value values[CFG_STATUS_MAX];
    Scape__ConfigValue kv[CFG_STATUS_MAX];
    Scape__ConfigValue *ptrs[CFG_STATUS_MAX];
} status_config;

typedef struct status_buf {
    Scape__StatusReply st;
    Scape__TrainerInfo info[SRV_MAX_SLOTS];
    Scape__TrainerInfo *ptrs[SRV_MAX_SLOTS];
    Scape__CheckpointInfo ckpt;
    uint32_t down[64];
    uint32_t waiting[SRV_MAX_SLOTS];
    char foreign_last[200];
    char refused_last[200];
    char memory[SRV_MAX_SLOTS][16];
    Scape__CollectiveCount coll[COMM_OP_COUNT];
    Scape__CollectiveCount *coll_p[COMM_OP_COUNT];
    step_done_msg last;
    status_config config; /* StatusReply.config */
    uint32_t wait_ranks[64];
} status_buf;

/* The counters: what the completed steps add up to. */
static void fill_totals(const server *s, status_buf *b)
{
    Scape__StatusReply *st = &b->st;
    const job_totals *t = &s->job.totals;
    st->has_steps_total = st->has_collective_bytes_total = st->has_wire_bytes_total = 1;
    st->steps_total = t->steps;
    st->collective_bytes_total = t->bytes;
    st->wire_bytes_total = t->wire_bytes;
    st->has_clipped_steps_total = 1;
    st->clipped_steps_total = t->clipped;
    st->collectives_total = b->coll_p;
    for (int op = 0; op < COMM_OP_COUNT; op++) {
        if (t->coll_calls[op] == 0)
            continue;
        Scape__CollectiveCount *c = &b->coll[st->n_collectives_total];
        scape__collective_count__init(c);
        c->op = (char *)comm_op_name((comm_op)op);
        c->calls = t->coll_calls[op];
        c->bytes = t->coll_bytes[op];
        b->coll_p[st->n_collectives_total++] = c;
    }
}

/* StatusReply.config from the key table's shown-in-status flag. */
static void fill_config(const server *s, Scape__StatusReply *st, status_config *sc)
{
    size_t n = cfg_status_values(&s->cfg, sc->values, CFG_STATUS_MAX);
    for (size_t i = 0; i < n; i++) {
        scape__config_value__init(&sc->kv[i]);
        sc->kv[i].key = (char *)sc->values[i].key;
        sc->kv[i].value = sc->values[i].value;
        sc->ptrs[i] = &sc->kv[i];
    }
    st->n_config = n;
    st->config = sc->ptrs;
}

/* Status is asked from inside a collective's wait (the comm wait hook). */
static int in_collective(const server *s)
{
    const char *op;
    double secs;
    int n;
    return comm_waiting(s->comm, &op, &secs, NULL, 0, &n);
}

/* The collective this daemon waits in, when status is asked from inside its
 * wait (the comm wait hook): which, for how long, for which peers. */
static int fill_wait(const server *s, status_buf *b)
{
    Scape__StatusReply *st = &b->st;
    const char *op;
    double secs;
    int ranks[sizeof b->wait_ranks / sizeof *b->wait_ranks], n;
    if (!comm_waiting(s->comm, &op, &secs, ranks, (int)(sizeof ranks / sizeof *ranks), &n))
        return 0;
    st->wait_op = (char *)op;
    st->has_wait_seconds = 1;
    st->wait_seconds = secs;
    st->has_wait_ranks_known = 1;
    st->wait_ranks_known = n >= 0;
    st->wait_ranks = b->wait_ranks;
    for (int i = 0; i < n; i++)
        b->wait_ranks[st->n_wait_ranks++] = (uint32_t)ranks[i];
    return 1;
}

static void fill_status(server *s, status_buf *b)
{
    Scape__StatusReply *st = &b->st;
    scape__status_reply__init(st);
    st->version = SCAPED_VERSION;
    st->rank = (uint32_t)s->cfg.rank;
    st->world = (uint32_t)s->cfg.world;
    st->state = (char *)state_name(s);
    st->optimizer = (char *)eng_optimizer_name(s->cfg.engine.optimizer);
    st->mode = (char *)eng_mode_name(s->cfg.engine.mode);
    st->rho = s->cfg.engine.rho;
    st->step = s->job.next_step - 1;
    st->numel = s->numel;
    st->uptime_ms = (uint64_t)(1e3 * (job_now() - s->started_at));
    st->rss_bytes = rss_bytes();
    job_footprint fp;
    job_footprint_of(&s->job, &fp);
    st->state_bytes = fp.state_bytes;
    /* What the daemon holds on a GPU: the cuda executor's state and buffers,
     * and the nccl backend's staging (the trainers' CUDA IPC buffers are
     * theirs); in pinned host memory, the executor's residual and copies. */
    st->executor = (char *)eng_executor_name(s->cfg.engine.executor);
    st->has_device_bytes = 1;
    st->device_bytes = comm_device_bytes(s->comm) + fp.device_bytes;
    st->has_pinned_bytes = 1;
    st->pinned_bytes = fp.pinned_bytes;
    st->has_max_grad_norm = 1;
    st->max_grad_norm = s->cfg.engine.max_grad_norm;
    st->wire_values = (char *)(s->cfg.engine.wire_bf16 ? "bf16" : "f32");
    st->gather_values = (char *)fp.gather_values;
    st->has_mask_deltas = 1;
    st->mask_deltas = s->cfg.engine.mask_deltas != 0;
    st->has_rho_start = 1;
    st->rho_start = s->cfg.engine.rho_start;
    st->has_rho_steps = 1;
    st->rho_steps = s->cfg.engine.rho_steps;
    st->has_dense_below = 1;
    st->dense_below = s->cfg.engine.dense_below;
    fill_config(s, st, &b->config);
    st->has_device_bytes_per_param = 1;
    st->device_bytes_per_param = s->numel ? (double)st->device_bytes / (double)s->numel : 0.0;
    uint64_t sent, recvd;
    if (comm_data_bytes(s->comm, &sent, &recvd)) {
        st->has_data_sent_bytes = st->has_data_recv_bytes = 1;
        st->data_sent_bytes = sent;
        st->data_recv_bytes = recvd;
        st->has_foreign_messages = 1;
        st->foreign_messages = comm_foreign(s->comm, b->foreign_last, sizeof b->foreign_last);
        if (st->foreign_messages)
            st->foreign_last = b->foreign_last;
        st->has_data_encrypted = 1;
        st->data_encrypted = s->curve;
        if (s->curve) {
            st->has_refused_handshakes = 1;
            st->refused_handshakes =
                comm_refused(s->comm, b->refused_last, sizeof b->refused_last);
            if (st->refused_handshakes)
                st->refused_last = b->refused_last;
        }
    }
    if (s->cfg.world > 1 && s->cfg.rank == 0) {
        st->has_rendezvous_refused_joins = 1;
        st->rendezvous_refused_joins = s->rdv_refused;
    }
    if (s->cfg.world > 1)
        st->auth = (char *)auth_mode_name(s->auth_mode);
    if (s->curve_public[0])
        st->data_public_key = s->curve_public;
    if (s->data_ep[0])
        st->data_endpoint = s->data_ep;
    st->has_queued_seconds_total = 1;
    st->queued_seconds_total = s->job.totals.queued;
    int down[sizeof b->down / sizeof *b->down], ndown = 0;
    int up = comm_peers_up(s->comm, down, (int)(sizeof down / sizeof *down), &ndown);
    if (up >= 0) {
        st->has_peers_connected = 1;
        st->peers_connected = (uint32_t)up;
        st->peers_down = b->down;
        for (int i = 0; i < ndown; i++)
            b->down[st->n_peers_down++] = (uint32_t)down[i];
    }
    st->runtime_dir = s->dir;
    fill_waiting(s, st, b->waiting);
    /* The residual norm is a pass over N floats: taken when asked, not on
     * the per-step path; and not in the middle of a step, whose residual is
     * half updated (and whose device work a norm on the device would wait
     * behind). */
    int waiting = fill_wait(s, b);
    if (s->job.have_last) {
        status_step_done(&s->job, &b->last);
        b->last.d.has_residual_norm = !waiting;
        b->last.d.residual_norm = waiting ? 0.0 : job_residual_norm(&s->job);
        st->last = &b->last.d;
    }
    st->has_loss = s->job.have_loss;
    st->loss = s->job.last_loss;
    for (int i = 0; i < SRV_MAX_SLOTS; i++) {
        const trainer *t = &s->slots[i];
        if (!t->used)
            continue;
        Scape__TrainerInfo *ti = &b->info[st->n_trainers];
        scape__trainer_info__init(ti);
        ti->index = (uint32_t)t->index;
        ti->identity = (char *)t->identity;
        ti->pid = (uint32_t)t->pid;
        ti->last_step = t->last_step;
        if (t->registered) {
            char *mem = b->memory[st->n_trainers];
            if (t->params.dev)
                snprintf(mem, sizeof b->memory[0], "cuda:%d", t->params.device);
            else
                snprintf(mem, sizeof b->memory[0], "host");
            ti->memory = mem;
        }
        b->ptrs[st->n_trainers++] = ti;
    }
    st->trainers = b->ptrs;
    ckp_info(s, &b->ckpt);
    st->checkpoint = &b->ckpt;
    fill_totals(s, b);
}

static void send_reply(server *s, const Scape__Reply *r)
{
    size_t len = scape__reply__get_packed_size(r);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf == NULL) {
        LOG_ERROR(SUB_STATUS, "out of memory for a %zu-byte status reply", len);
        zmq_send(s->status, "", 0, 0); /* a REP must answer to stay usable */
        return;
    }
    scape__reply__pack(r, buf);
    if (zmq_send(s->status, buf, len, 0) < 0)
        LOG_WARN(SUB_STATUS, "status reply: %s", zmq_strerror(zmq_errno()));
    free(buf);
}

static void send_error(server *s, scape_rc rc)
{
    Scape__Error e;
    Scape__Reply r;
    wire_error_reply(&r, &e, rc);
    send_reply(s, &r);
}

static void answer(server *s, const Scape__Request *q)
{
    Scape__Reply r = SCAPE__REPLY__INIT;
    status_buf *b = malloc(sizeof *b);
    if (b == NULL) {
        send_error(s, scape_set_error(SCAPE_NOMEM, "out of memory"));
        return;
    }
    switch (q->body_case) {
    case SCAPE__REQUEST__BODY_STATUS:
    case SCAPE__REQUEST__BODY_METRICS:
        fill_status(s, b);
        r.body_case = SCAPE__REPLY__BODY_STATUS_REPLY;
        r.status_reply = &b->st;
        send_reply(s, &r);
        break;
    case SCAPE__REQUEST__BODY_CHECKPOINT: {
        int now = q->checkpoint->has_now && q->checkpoint->now;
        scape_rc rc = ckp_request(s, now, &b->ckpt); /* a state_dict: on disk now */
        if (rc != SCAPE_OK) {
            send_error(s, rc);
            break;
        }
        r.body_case = SCAPE__REPLY__BODY_CHECKPOINT;
        r.checkpoint = &b->ckpt;
        send_reply(s, &r);
        break;
    }
    case SCAPE__REQUEST__BODY_SHUTDOWN:
        LOG_INFO(SUB_STATUS, "shutdown requested on the status socket");
        s->stopping = 1;
        /* during a collective's wait: that wait gives up as on SIGTERM, once
         * it makes no progress (comm_set_interrupt), instead of holding the
         * stop until comm_timeout_ms when a peer hangs */
        if (in_collective(s))
            srv_request_stop();
        send_reply(s, &r);
        break;
    default:
        send_error(s, scape_set_error(SCAPE_INVALID,
                                      "the status endpoint answers status, metrics, "
                                      "checkpoint and shutdown only (got request type %d)",
                                      (int)q->body_case));
    }
    free(b);
}

void status_step_done(const job *j, step_done_msg *m)
{
    const job_step *l = &j->last;
    const eng_step_stats *st = &l->eng;
    Scape__Phases *ph = &m->ph;
    scape__phases__init(ph);
    ph->has_queued = l->queued >= 0.0;
    ph->queued = ph->has_queued ? l->queued : 0.0;
    ph->has_after_reply = l->has_after_reply;
    ph->after_reply = l->after_reply;
    ph->has_early_pack = ph->has_early_tensors = st->early_tensors > 0;
    ph->early_pack = st->early_pack_s;
    ph->early_tensors = (uint32_t)st->early_tensors;
    ph->has_early_chunks = ph->has_chunks = st->chunks > 0;
    ph->early_chunks = (uint32_t)st->early_chunks;
    ph->chunks = (uint32_t)st->chunks;
    double v[] = { l->wait, st->phase_s[ENG_PH_INTAKE], st->phase_s[ENG_PH_MASK_WAIT],
                   st->phase_s[ENG_PH_SELECT], st->phase_s[ENG_PH_PACK],
                   st->phase_s[ENG_PH_REDUCE], st->phase_s[ENG_PH_UPDATE],
                   st->phase_s[ENG_PH_GATHER], st->phase_s[ENG_PH_WRITEBACK], l->total };
    double *f[] = { &ph->wait, &ph->intake, &ph->mask_wait, &ph->select, &ph->pack,
                    &ph->reduce, &ph->update, &ph->gather, &ph->writeback, &ph->total };
    protobuf_c_boolean *has[] = { &ph->has_wait, &ph->has_intake, &ph->has_mask_wait,
                                  &ph->has_select, &ph->has_pack, &ph->has_reduce,
                                  &ph->has_update, &ph->has_gather, &ph->has_writeback,
                                  &ph->has_total };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        *f[i] = v[i];
        *has[i] = 1;
    }
    Scape__StepDone *d = &m->d;
    scape__step_done__init(d);
    d->step = st->step;
    d->phases = ph;
    d->k = st->k;
    d->density = st->density;
    d->collectives = m->coll_p;
    d->n_collectives = 0;
    for (int op = 0; op < COMM_OP_COUNT; op++) {
        d->bytes += st->comm.bytes[op];
        d->wire_bytes += st->comm.wire_bytes[op];
        if (st->comm.calls[op] == 0)
            continue;
        Scape__CollectiveCount *cc = &m->coll[d->n_collectives];
        scape__collective_count__init(cc);
        cc->op = (char *)comm_op_name((comm_op)op);
        cc->calls = st->comm.calls[op];
        cc->bytes = st->comm.bytes[op];
        m->coll_p[d->n_collectives++] = cc;
    }
    d->has_mask_churn = 1;
    d->mask_churn = st->mask_churn;
    d->has_mask_overlap = st->phase_s[ENG_PH_MASK_WAIT] > 0.0 || st->mask_overlap > 0.0;
    d->mask_overlap = st->mask_overlap;
    /* Host shared memory is read and written where the trainers have it: 0.
     * CUDA IPC buffers are staged through host copies: what moved. */
    d->has_handover_copy_bytes = 1;
    d->handover_copy_bytes = l->copied;
    d->has_control_bytes = 1;
    d->control_bytes = l->control_bytes;
    d->has_mask_bytes = 1;
    d->mask_bytes = st->mask_bytes;
    d->has_launches = 1;
    d->launches = st->launches;
    d->has_grad_norm = d->has_clip = j->clipping;
    d->grad_norm = st->grad_norm;
    d->clip = st->clip;
    d->has_mean_grad_norm = d->has_mean_grad_exact = st->mean_grad_norm >= 0.0;
    d->mean_grad_norm = st->mean_grad_norm;
    d->mean_grad_exact = st->mean_grad_exact;
}

int status_peer_refused(server *s, zmq_msg_t *msg, const char *what)
{
    const char *addr = zmq_msg_gets(msg, "Peer-Address");
    const char *c = addr ? strrchr(addr, ':') : NULL; /* ...:uid:gid:pid */
    int fields = 0;
    while (c && c > addr && fields < 2)
        if (*--c == ':')
            fields++;
    unsigned uid = 0, gid = 0;
    int pid = 0;
    if (fields < 2 || sscanf(c, ":%u:%u:%d", &uid, &gid, &pid) != 3)
        return 0;
    if (uid == (unsigned)geteuid() || uid == 0)
        return 0;
    char who[300], me[300];
    auth_uid_name(uid, who, sizeof who);
    auth_uid_name((unsigned)geteuid(), me, sizeof me);
    scape_set_error(SCAPE_INVALID, "process %d of %s is not this daemon's user (%s): only the "
                    "job's own processes may use its sockets", pid, who, me);
    LOG_WARN(SUB_CTRL, "refused a %s message: %s (is the runtime directory %s open to "
             "others?)", what, scape_last_error(), s->dir);
    return 1;
}

void status_serve(server *s)
{
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    int n = zmq_msg_recv(&msg, s->status, ZMQ_DONTWAIT);
    if (n < 0) {
        zmq_msg_close(&msg);
        return;
    }
    int more = zmq_msg_more(&msg);
    Scape__Request *q = NULL;
    int stranger = status_peer_refused(s, &msg, "status");
    if (!stranger && (more || (size_t)n > s->cfg.max_message_bytes))
        scape_set_error(SCAPE_PROTO, "status request of %d bytes%s refused", n,
                        more ? " in several frames" : "");
    else if (!stranger &&
             (q = scape__request__unpack(NULL, (size_t)n, zmq_msg_data(&msg))) == NULL)
        scape_set_error(SCAPE_PROTO, "undecodable status request (%d bytes)", n);
    zmq_msg_close(&msg);
    while (more) { /* drain the rest so the REP state machine stays in step */
        zmq_msg_init(&msg);
        zmq_msg_recv(&msg, s->status, 0);
        more = zmq_msg_more(&msg);
        zmq_msg_close(&msg);
    }
    if (q == NULL) {
        if (!stranger)
            LOG_WARN(SUB_STATUS, "%s", scape_last_error());
        send_error(s, stranger ? SCAPE_INVALID : SCAPE_PROTO);
        return;
    }
    /* A checkpoint runs collectives of its own: not inside this one. */
    if (q->body_case == SCAPE__REQUEST__BODY_CHECKPOINT && in_collective(s)) {
        LOG_INFO(SUB_STATUS, "a checkpoint request during a collective: answered after it");
        s->held = q;
        return;
    }
    answer(s, q);
    scape__request__free_unpacked(q, NULL);
}

void status_release(server *s)
{
    if (s->held == NULL || in_collective(s))
        return;
    Scape__Request *q = s->held;
    s->held = NULL;
    answer(s, q);
    scape__request__free_unpacked(q, NULL);
}

int status_poll_items(server *s, zmq_pollitem_t *items)
{
    int n = 0;
    if (s->held == NULL)
        items[n++] = (zmq_pollitem_t){ s->status, 0, ZMQ_POLLIN, 0 };
    if (s->metrics_http)
        n += mhttp_poll_items(s->metrics_http, items + n);
    return n;
}

int status_poll_serve(server *s, const zmq_pollitem_t *items, int n)
{
    int got = 0, first = 0;
    if (n > 0 && items[0].socket == s->status) {
        first = 1;
        if (items[0].revents & ZMQ_POLLIN) {
            status_serve(s);
            got = 1;
        }
    }
    if (s->metrics_http)
        mhttp_serve(s->metrics_http, items + first, n - first);
    return got;
}

int status_metrics(void *arg, FILE *out)
{
    server *s = arg;
    status_buf *b = malloc(sizeof *b);
    if (b == NULL)
        return -1;
    fill_status(s, b);
    int rc = prom_render(out, &b->st);
    free(b);
    return rc;
}

void status_publish(server *s)
{
    step_done_msg last;
    status_step_done(&s->job, &last);
    Scape__Metrics m = SCAPE__METRICS__INIT;
    m.rank = (uint32_t)s->cfg.rank;
    m.step = &last.d;
    m.has_loss = s->job.have_loss;
    m.loss = s->job.last_loss;
    m.trainers = (uint32_t)srv_trainers(s, 0);
    size_t len = scape__metrics__get_packed_size(&m);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf == NULL)
        return;
    scape__metrics__pack(&m, buf);
    if (zmq_send(s->events, buf, len, ZMQ_DONTWAIT) < 0 && zmq_errno() != EAGAIN)
        LOG_WARN(SUB_STATUS, "publish: %s", zmq_strerror(zmq_errno()));
    free(buf);
}
