/* fuzz_request.c - what trainers and scapectl send a daemon: control
 * requests on its ROUTER, status requests on its REP (daemon/server.c,
 * control.c, status.c).
 *
 * Every input gets a fresh, real server (srv_create: runtime directory, lock,
 * sockets, the local comm) expecting two trainers, and two shared-memory
 * buffers per trainer slot sized for the seeds' layout, so a well-formed
 * sequence attaches, registers, syncs and runs real engine steps.  The input
 * is a series of records (fuzz.h); the selector's low two bits pick the
 * sender (trainers "t0", "t1", "t2" on DEALER sockets, or scapectl on a REQ
 * socket), bit 2 sends the bytes as two frames.  The server handles each
 * message through srv_serve_once, as its loop would.
 *
 * Checked for every input, beyond "no crash" (ASan and UBSan in the fuzz and
 * sanitizer builds):
 *   - every status request gets an answer;
 *   - every message the daemon sends decodes as a scape.Reply, and every
 *     refusal carries an error with a message;
 *   - after the whole series the daemon still answers a status request,
 *     unless it was asked to shut down.
 */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zmq.h>

#include "config.h"
#include "fuzz.h"
#include "scape.pb-c.h"
#include "server.h"

#define NSEND 3                  /* trainer sockets */
#define NUMEL 64                 /* the seeds' layout: w[40], b[24] */
static const char *s_shm[2][2] = { { "/scapefz-p0", "/scapefz-g0" },
                                   { "/scapefz-p1", "/scapefz-g1" } };

static char s_dir[64];
static void *s_ctx;
static int s_verbose; /* SCAPE_FUZZ_LOG=2: every reply, in one line */

static void cleanup(void) { rmdir(s_dir); }

void fuzz_setup(void)
{
    snprintf(s_dir, sizeof s_dir, "/tmp/scape-fuzz-XXXXXX");
    FUZZ_CHECK(mkdtemp(s_dir) != NULL, "mkdtemp failed");
    atexit(cleanup);
    s_ctx = zmq_ctx_new();
    FUZZ_CHECK(s_ctx != NULL, "zmq_ctx_new failed");
    const char *v = getenv("SCAPE_FUZZ_LOG");
    s_verbose = v && strcmp(v, "2") == 0;
}

/* Fresh buffers for both trainer slots: params 1, 2, 3, ..., grads small.
 * The names are fixed (the seeds name them); a second fuzz_request running
 * at the same time may share them, which can only make a register fail. */
static void make_buffers(void)
{
    for (int t = 0; t < 2; t++)
        for (int g = 0; g < 2; g++) {
            shm_unlink(s_shm[t][g]);
            int fd = shm_open(s_shm[t][g], O_RDWR | O_CREAT, 0600);
            FUZZ_CHECK(fd >= 0 && ftruncate(fd, NUMEL * sizeof(float)) == 0,
                       "cannot make %s", s_shm[t][g]);
            float *v = mmap(NULL, NUMEL * sizeof(float), PROT_READ | PROT_WRITE, MAP_SHARED,
                            fd, 0);
            FUZZ_CHECK(v != MAP_FAILED, "cannot map %s", s_shm[t][g]);
            for (int i = 0; i < NUMEL; i++)
                v[i] = g ? 0.001f * (float)((i * 7 + t) % 13 - 6) : (float)(i + 1);
            munmap(v, NUMEL * sizeof(float));
            close(fd);
        }
}

static void *open_sock(int type, const char *id, const char *name)
{
    char ep[128];
    snprintf(ep, sizeof ep, "ipc://%s/%s", s_dir, name);
    void *so = zmq_socket(s_ctx, type);
    int zero = 0;
    FUZZ_CHECK(so != NULL && zmq_setsockopt(so, ZMQ_LINGER, &zero, sizeof zero) == 0,
               "socket: %s", zmq_strerror(zmq_errno()));
    if (id)
        FUZZ_CHECK(zmq_setsockopt(so, ZMQ_ROUTING_ID, id, strlen(id)) == 0, "routing id");
    FUZZ_CHECK(zmq_connect(so, ep) == 0, "connect %s: %s", ep, zmq_strerror(zmq_errno()));
    return so;
}

/* Every reply the daemon sends must be a scape.Reply that explains a refusal. */
static void check_reply(const void *buf, size_t n, const char *who)
{
    Scape__Reply *r = scape__reply__unpack(NULL, n, buf);
    FUZZ_CHECK(r != NULL, "%s got an undecodable reply of %zu bytes", who, n);
    if (s_verbose)
        fprintf(stderr, "  %s <- status %d body %d%s%s\n", who, (int)r->status, (int)r->body_case,
                r->body_case == SCAPE__REPLY__BODY_ERROR ? ": " : "",
                r->body_case == SCAPE__REPLY__BODY_ERROR ? r->error->message : "");
    if (r->status != SCAPE__STATUS__OK)
        FUZZ_CHECK(r->body_case == SCAPE__REPLY__BODY_ERROR && r->error->message &&
                       r->error->message[0],
                   "%s: a refusal (status %d) without a message", who, (int)r->status);
    scape__reply__free_unpacked(r, NULL);
}

/* Take what the daemon sent a socket so far; returns how many messages. */
static int drain(void *so, const char *who, int wait_ms)
{
    int got = 0;
    zmq_pollitem_t it = { so, 0, ZMQ_POLLIN, 0 };
    while (zmq_poll(&it, 1, got ? 0 : wait_ms) > 0 && (it.revents & ZMQ_POLLIN)) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        int n = zmq_msg_recv(&m, so, ZMQ_DONTWAIT);
        FUZZ_CHECK(n >= 0 && !zmq_msg_more(&m), "%s: a reply in several frames", who);
        check_reply(zmq_msg_data(&m), zmq_msg_size(&m), who);
        zmq_msg_close(&m);
        got++;
    }
    return got;
}

/* Let the server take what was sent: turns until it handled something. */
static void serve(server *s)
{
    for (int i = 0; i < 200; i++) { /* 10 s: only a stalled machine takes that long */
        int handled = 0;
        FUZZ_CHECK(srv_serve_once(s, 50, &handled) == SCAPE_OK, "serve: %s",
                   scape_last_error());
        if (handled)
            return;
    }
}

static void send_frames(void *so, const uint8_t *p, size_t n, int split)
{
    size_t cut = split ? n / 2 : n;
    FUZZ_CHECK(zmq_send(so, p, cut, split ? ZMQ_SNDMORE : 0) >= 0, "send: %s",
               zmq_strerror(zmq_errno()));
    if (split)
        FUZZ_CHECK(zmq_send(so, p + cut, n - cut, 0) >= 0, "send: %s",
                   zmq_strerror(zmq_errno()));
}

/* Serve until the answer is back: a trainer's message that came late may be
 * handled first (then one turn is not enough).  10 s without it: lost. */
static void ask_status(server *s, void *req, const uint8_t *p, size_t n, int split)
{
    send_frames(req, p, n, split);
    for (int i = 0; i < 1000; i++) {
        FUZZ_CHECK(srv_serve_once(s, 10, NULL) == SCAPE_OK, "serve: %s", scape_last_error());
        int got = drain(req, "scapectl", 1);
        if (got) {
            FUZZ_CHECK(got == 1, "%d answers to one status request", got);
            return;
        }
    }
    FUZZ_CHECK(0, "a status request got no answer");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    scaped_config cfg;
    cfg_defaults(&cfg);
    snprintf(cfg.runtime_dir, sizeof cfg.runtime_dir, "%s", s_dir);
    cfg.trainers = 2;
    cfg.liveness_ms = 60000;
    cfg.max_message_bytes = 4096;
    make_buffers();
    server *s = NULL;
    FUZZ_CHECK(srv_create(&s, &cfg) == SCAPE_OK, "srv_create: %s", scape_last_error());
    void *tr[NSEND];
    for (int i = 0; i < NSEND; i++) {
        char id[4] = { 't', (char)('0' + i), 0, 0 };
        tr[i] = open_sock(ZMQ_DEALER, id, "control");
    }
    void *req = open_sock(ZMQ_REQ, NULL, "status");

    fuzz_in in = { data, size };
    uint32_t sel;
    const uint8_t *p;
    size_t n;
    while (!srv_stopping(s) && fuzz_record(&in, &sel, &p, &n)) {
        int who = (int)(sel & 3), split = (sel >> 2) & 1 && n >= 2;
        if (s_verbose)
            fprintf(stderr, "%s sends %zu bytes%s\n", who == 3 ? "scapectl" : "a trainer", n,
                    split ? " in two frames" : "");
        if (who == 3) {
            ask_status(s, req, p, n, split);
            continue;
        }
        send_frames(tr[who], p, n, split);
        serve(s);
        for (int i = 0; i < NSEND; i++)
            drain(tr[i], "a trainer", 0);
    }
    if (!srv_stopping(s)) {
        Scape__StatusRequest sr = SCAPE__STATUS_REQUEST__INIT;
        Scape__Request q = SCAPE__REQUEST__INIT;
        q.body_case = SCAPE__REQUEST__BODY_STATUS;
        q.status = &sr;
        uint8_t buf[64];
        ask_status(s, req, buf, scape__request__pack(&q, buf), 0);
    }
    /* The answers still on their way. */
    zmq_pollitem_t its[NSEND];
    for (int i = 0; i < NSEND; i++)
        its[i] = (zmq_pollitem_t){ tr[i], 0, ZMQ_POLLIN, 0 };
    zmq_poll(its, NSEND, 1);
    for (int i = 0; i < NSEND; i++) {
        drain(tr[i], "a trainer", 0);
        zmq_close(tr[i]);
    }
    zmq_close(req);
    srv_destroy(&s);
    for (int t = 0; t < 2; t++)
        for (int g = 0; g < 2; g++)
            shm_unlink(s_shm[t][g]);
    return 0;
}

/* ---- seeds: what libscape and scapectl send -------------------------------- */

static void put_req(fuzz_buf *b, uint8_t sel, Scape__Request *q)
{
    uint8_t buf[1024];
    size_t len = scape__request__pack(q, buf);
    fuzz_put(b, sel, buf, len);
}

static void hello(fuzz_buf *b, uint8_t who, int index)
{
    Scape__Hello h = SCAPE__HELLO__INIT;
    h.protocol = 1;
    h.trainer = "fuzz:1";
    h.pid = 1; /* init: alive, so the liveness check keeps the trainer */
    if (index >= 0) {
        h.has_index = 1;
        h.index = index;
    }
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_HELLO;
    q.hello = &h;
    put_req(b, who, &q);
}

/* groups: 0 none; else two parameter groups, "b" in group 1 (groups == 2:
 * "b" in a group that is not there, and a negative weight decay too). */
static void reg_groups(fuzz_buf *b, uint8_t who, int slot, int groups)
{
    Scape__Tensor w = SCAPE__TENSOR__INIT, bias = SCAPE__TENSOR__INIT;
    w.name = "w";
    w.offset = 0;
    w.length = 40;
    bias.name = "b";
    bias.offset = 40;
    bias.length = NUMEL - 40;
    Scape__Tensor *ts[] = { &w, &bias };
    Scape__MemHandle ph = SCAPE__MEM_HANDLE__INIT, gh = SCAPE__MEM_HANDLE__INIT;
    ph.kind = gh.kind = SCAPE__MEM_KIND__SHM;
    ph.shm_name = (char *)s_shm[slot][0];
    gh.shm_name = (char *)s_shm[slot][1];
    ph.bytes = gh.bytes = NUMEL * sizeof(float);
    Scape__Register g = SCAPE__REGISTER__INIT;
    g.n_tensors = 2;
    g.tensors = ts;
    g.param_dtype = g.grad_dtype = SCAPE__DTYPE__F32;
    g.params = &ph;
    g.grads = &gh;
    float wds[2] = { 0.1f, groups == 2 ? -1.0f : NAN };
    if (groups) {
        bias.has_group = 1;
        bias.group = groups == 2 ? 5 : 1;
        g.n_group_weight_decay = 2;
        g.group_weight_decay = wds;
    }
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_REGISTER;
    q.register_ = &g;
    put_req(b, who, &q);
}

static void reg(fuzz_buf *b, uint8_t who, int slot) { reg_groups(b, who, slot, 0); }

/* A registration of two CUDA IPC buffers in one (forged) allocation, at
 * the offsets given, with a gradient-ready event handle of ev_len bytes (0:
 * none): the range and event checks' input (no handle here can open). */
static void reg_ipc(fuzz_buf *b, uint8_t who, uint64_t poff, uint64_t goff, size_t ev_len,
                    size_t uuid_len)
{
    static uint8_t handle[64];
    for (int i = 0; i < 64; i++)
        handle[i] = (uint8_t)(i * 7 + 1);
    Scape__Tensor w = SCAPE__TENSOR__INIT;
    w.name = "w";
    w.offset = 0;
    w.length = NUMEL;
    Scape__Tensor *ts[] = { &w };
    Scape__MemHandle ph = SCAPE__MEM_HANDLE__INIT, gh = SCAPE__MEM_HANDLE__INIT;
    Scape__MemHandle *hs[2] = { &ph, &gh };
    uint64_t off[2] = { poff, goff };
    for (int i = 0; i < 2; i++) {
        hs[i]->kind = SCAPE__MEM_KIND__CUDA_IPC;
        hs[i]->has_ipc_handle = 1;
        hs[i]->ipc_handle.data = handle;
        hs[i]->ipc_handle.len = sizeof handle;
        hs[i]->bytes = NUMEL * sizeof(float);
        hs[i]->has_offset = 1;
        hs[i]->offset = off[i];
        hs[i]->has_device = 1;
        hs[i]->has_device_uuid = uuid_len > 0; /* the GPU by its UUID (16 bytes) */
        hs[i]->device_uuid.data = handle;
        hs[i]->device_uuid.len = uuid_len;
    }
    Scape__Register g = SCAPE__REGISTER__INIT;
    g.n_tensors = 1;
    g.tensors = ts;
    g.param_dtype = g.grad_dtype = SCAPE__DTYPE__F32;
    g.params = &ph;
    g.grads = &gh;
    g.has_grad_event = ev_len > 0;
    g.grad_event.data = handle;
    g.grad_event.len = ev_len;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_REGISTER;
    q.register_ = &g;
    put_req(b, who, &q);
}

/* nlr > 0: that many group learning rates (the last one negative when
 * bad). */
static void step_groups(fuzz_buf *b, uint8_t who, uint64_t t, size_t nlr, int bad)
{
    Scape__Step st = SCAPE__STEP__INIT;
    float lrs[3] = { 1e-3f, 2e-3f, 3e-3f };
    if (bad)
        lrs[nlr - 1] = -1.0f;
    st.n_group_lr = nlr;
    st.group_lr = lrs;
    st.step = t;
    st.lr = 1e-3f;
    st.has_loss = 1;
    st.loss = 2.5f;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_STEP;
    q.step = &st;
    put_req(b, who, &q);
}

static void step(fuzz_buf *b, uint8_t who, uint64_t t) { step_groups(b, who, t, 0, 0); }

/* load_state_dict of a checkpoint directory (none exists here), and a
 * state_dict on the status socket. */
static void resume(fuzz_buf *b, uint8_t who, const char *dir, uint64_t step)
{
    Scape__Resume m = SCAPE__RESUME__INIT;
    m.dir = (char *)dir;
    m.has_step = 1;
    m.step = step;
    m.has_layout_hash = 1;
    m.layout_hash = 0x1234;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_RESUME;
    q.resume = &m;
    put_req(b, who, &q);
}

static void checkpoint_now(fuzz_buf *b, uint8_t who)
{
    Scape__CheckpointRequest c = SCAPE__CHECKPOINT_REQUEST__INIT;
    c.has_now = 1;
    c.now = 1;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = SCAPE__REQUEST__BODY_CHECKPOINT;
    q.checkpoint = &c;
    put_req(b, who, &q);
}

/* The requests without fields. */
static void bare(fuzz_buf *b, uint8_t who, Scape__Request__BodyCase body)
{
    Scape__Sync sy = SCAPE__SYNC__INIT;
    Scape__Detach de = SCAPE__DETACH__INIT;
    Scape__StatusRequest sr = SCAPE__STATUS_REQUEST__INIT;
    Scape__MetricsRequest mr = SCAPE__METRICS_REQUEST__INIT;
    Scape__Shutdown sd = SCAPE__SHUTDOWN__INIT;
    Scape__CheckpointRequest cr = SCAPE__CHECKPOINT_REQUEST__INIT;
    Scape__Request q = SCAPE__REQUEST__INIT;
    q.body_case = body;
    switch (body) {
    case SCAPE__REQUEST__BODY_SYNC: q.sync = &sy; break;
    case SCAPE__REQUEST__BODY_DETACH: q.detach = &de; break;
    case SCAPE__REQUEST__BODY_STATUS: q.status = &sr; break;
    case SCAPE__REQUEST__BODY_METRICS: q.metrics = &mr; break;
    case SCAPE__REQUEST__BODY_SHUTDOWN: q.shutdown = &sd; break;
    case SCAPE__REQUEST__BODY_CHECKPOINT: q.checkpoint = &cr; break;
    default: abort();
    }
    put_req(b, who, &q);
}

void fuzz_seeds(fuzz_emit emit, void *ctx)
{
    fuzz_buf *b = calloc(1, sizeof *b);
    FUZZ_CHECK(b != NULL, "out of memory");
    /* Two trainers attach, register, sync and step three times; scapectl
     * asks for status and metrics on the way; one trainer leaves. */
    hello(b, 0, -1);
    hello(b, 1, -1);
    reg(b, 0, 0);
    reg(b, 1, 1);
    bare(b, 3, SCAPE__REQUEST__BODY_STATUS);
    bare(b, 0, SCAPE__REQUEST__BODY_SYNC);
    bare(b, 1, SCAPE__REQUEST__BODY_SYNC);
    for (uint64_t t = 1; t <= 3; t++) {
        step(b, 0, t);
        step(b, 1, t);
    }
    bare(b, 3, SCAPE__REQUEST__BODY_METRICS);
    bare(b, 3, SCAPE__REQUEST__BODY_STATUS);
    bare(b, 0, SCAPE__REQUEST__BODY_DETACH);
    emit(ctx, "train", b->data, b->len);

    /* Refusals: a request before hello, hello twice, a slot taken twice, a
     * step before sync, a checkpoint without a directory, a split message. */
    b->len = 0;
    step(b, 2, 1);
    hello(b, 0, 1);
    hello(b, 0, 1);
    hello(b, 1, 1);
    reg(b, 0, 1);
    step(b, 0, 1);
    bare(b, 3, SCAPE__REQUEST__BODY_CHECKPOINT);
    bare(b, 0 | 4, SCAPE__REQUEST__BODY_DETACH);
    bare(b, 3 | 4, SCAPE__REQUEST__BODY_STATUS);
    emit(ctx, "refusals", b->data, b->len);

    /* CUDA IPC registrations: overlapping in one allocation, apart in it,
     * and one whose offset overflows; none can open here. */
    b->len = 0;
    hello(b, 0, -1);
    reg_ipc(b, 0, 0, NUMEL * sizeof(float) - 4, 0, 0);
    reg_ipc(b, 0, 0, NUMEL * sizeof(float), 0, 0);
    reg_ipc(b, 0, UINT64_MAX - 8, 0, 0, 0);
    bare(b, 3, SCAPE__REQUEST__BODY_STATUS);
    emit(ctx, "cuda-ipc-ranges", b->data, b->len);

    /* ... with gradient-ready events: a handle of the wrong size, and a
     * well-formed one on buffers apart in one allocation */
    b->len = 0;
    hello(b, 0, -1);
    reg_ipc(b, 0, 0, NUMEL * sizeof(float), 63, 0);
    reg_ipc(b, 0, 0, NUMEL * sizeof(float), 64, 0);
    bare(b, 3, SCAPE__REQUEST__BODY_STATUS);
    emit(ctx, "cuda-ipc-events", b->data, b->len);

    /* ... naming their GPU by UUID: one of the wrong size, one no GPU has */
    b->len = 0;
    hello(b, 0, -1);
    reg_ipc(b, 0, 0, NUMEL * sizeof(float), 0, 15);
    reg_ipc(b, 0, 0, NUMEL * sizeof(float), 64, 16);
    bare(b, 3, SCAPE__REQUEST__BODY_STATUS);
    emit(ctx, "cuda-ipc-uuid", b->data, b->len);

    /* Parameter groups: a registration with a group that is not there, then
     * two trainers with two groups; steps with the right number of group
     * learning rates, too few, too many and a negative one. */
    b->len = 0;
    hello(b, 0, -1);
    hello(b, 1, -1);
    reg_groups(b, 0, 0, 2);
    reg_groups(b, 0, 0, 1);
    reg_groups(b, 1, 1, 1);
    bare(b, 0, SCAPE__REQUEST__BODY_SYNC);
    bare(b, 1, SCAPE__REQUEST__BODY_SYNC);
    step_groups(b, 0, 1, 2, 0);
    step_groups(b, 1, 1, 1, 0);
    step_groups(b, 1, 1, 3, 0);
    step_groups(b, 1, 1, 2, 1);
    step_groups(b, 1, 1, 2, 0);
    bare(b, 3, SCAPE__REQUEST__BODY_STATUS);
    emit(ctx, "parameter-groups", b->data, b->len);

    /* state_dict and load_state_dict: before the job starts, a state_dict
     * with no step and no checkpoint_dir, loads of missing checkpoints, an
     * empty directory name, then a step and a late load. */
    b->len = 0;
    hello(b, 0, -1);
    reg(b, 0, 0);
    resume(b, 0, "/nonexistent/ck", 3);
    checkpoint_now(b, 3);
    bare(b, 0, SCAPE__REQUEST__BODY_SYNC);
    checkpoint_now(b, 3);
    resume(b, 0, "/nonexistent/ck", 3);
    resume(b, 0, "", 0);
    step(b, 0, 1);
    checkpoint_now(b, 3);
    resume(b, 0, "/nonexistent/ck", 0);
    emit(ctx, "state-dict", b->data, b->len);

    /* A third trainer joins a running job, then scapectl shuts it down. */
    b->len = 0;
    hello(b, 0, -1);
    hello(b, 1, -1);
    reg(b, 0, 0);
    reg(b, 1, 1);
    bare(b, 0, SCAPE__REQUEST__BODY_SYNC);
    bare(b, 1, SCAPE__REQUEST__BODY_SYNC);
    step(b, 0, 1);
    step(b, 1, 1);
    bare(b, 1, SCAPE__REQUEST__BODY_DETACH);
    hello(b, 2, -1);
    reg(b, 2, 1);
    bare(b, 2, SCAPE__REQUEST__BODY_SYNC);
    step(b, 0, 2);
    step(b, 2, 2);
    bare(b, 3, SCAPE__REQUEST__BODY_SHUTDOWN);
    emit(ctx, "join-and-shutdown", b->data, b->len);
    free(b);
}
