/* fuzz_hostmsg.c - what a peer daemon sends on the host backend's data plane
 * (daemon/comm_host.c): a TCP port that anyone who can reach the node may
 * connect to.
 *
 * The target plays one rank of a two-rank group: for every input the other
 * rank is made for real (comm_host_create, TCP on loopback), the input's
 * messages are sent to it from a PUSH socket, as the played rank's would be,
 * and the real rank then runs one collective, which takes them apart.
 *
 * Both ranks run CURVE, as every authenticated job does (the played rank
 * with a fixed key pair the real rank admits), so the fuzzed bytes are what
 * the real rank reads after its handshake and decryption; bit 7 of the
 * chunk-size byte runs the input over plain TCP instead (auth: none).
 *
 * Input: the collective (barrier, all-gather, reduce-scatter, all-reduce,
 * broadcast from the played rank, or the asynchronous all-gather and its
 * wait) with, in bit 7, which rank is real (0 or 1); its size in floats and
 * the chunk size; then records (fuzz.h), one message each.  A record's selector: bit 0 sends its bytes as one bare frame; else
 * they are kind, op sequence, chunk index, sender (a byte each) and the
 * payload, framed with the right magic and job unless bit 1 (magic) or bit 2
 * (job) spoils them.
 *
 * Checked for every input, beyond "no crash" (ASan, UBSan): the collective
 * either succeeds or fails with a reason, no more messages are counted as
 * foreign (dropped as not of this job) than were sent bare, with a bad magic
 * or with another job's id, and no more failure reports (K_FAIL) are counted
 * as ignored than were sent framed.  The seeds are the played rank's real
 * side of each collective from either rank, plus three such stray messages
 * and four failure reports that a group of two must ignore (about the real
 * rank, about their sender, about rank 9, from rank 7), so they succeed.
 */
#define _POSIX_C_SOURCE 200809L
#include <string.h>
#include <zmq.h>

#include "comm.h"
#include "comm_host.h"
#include "comm_host_wire.h"
#include "fuzz.h"

#define JOB 4242u
#define TIMEOUT_MS 40 /* the played rank sends everything before the op starts */
#define MAX_N 48

enum op { OP_BARRIER, OP_ALLGATHER, OP_REDUCE_SCATTER, OP_ALLREDUCE, OP_BROADCAST, OP_IAG,
          OP_RS_BF16, OP_N };

static void *s_ctx, *s_pull[2]; /* the played rank's endpoints (plain, CURVE): the real
                                    rank's messages */
static int s_verbose;        /* SCAPE_FUZZ_LOG=2: what became of each input */
static const char *s_names[OP_N] = { "barrier", "allgather", "reduce-scatter", "allreduce",
                                     "broadcast", "iallgather", "reduce-scatter-bf16" };
static char s_pull_ep[2][128];
/* Key pairs (Z85): the played rank's, and the real rank's (made afresh by a
 * daemon; fixed here, which changes nothing the real rank checks). */
static char s_pub[2][41], s_sec[2][41];

void fuzz_setup(void)
{
    s_ctx = zmq_ctx_new();
    FUZZ_CHECK(zmq_curve_keypair(s_pub[0], s_sec[0]) == 0 &&
                   zmq_curve_keypair(s_pub[1], s_sec[1]) == 0,
               "zmq_curve_keypair: %s", zmq_strerror(zmq_errno()));
    for (int k = 0; k < 2; k++) {
        s_pull[k] = s_ctx ? zmq_socket(s_ctx, ZMQ_PULL) : NULL;
        size_t len = sizeof s_pull_ep[k];
        int zero = 0, one = 1;
        FUZZ_CHECK(s_pull[k] && zmq_setsockopt(s_pull[k], ZMQ_LINGER, &zero, sizeof zero) == 0 &&
                       (k == 0 ||
                        (zmq_setsockopt(s_pull[k], ZMQ_CURVE_SERVER, &one, sizeof one) == 0 &&
                         zmq_setsockopt(s_pull[k], ZMQ_CURVE_SECRETKEY, s_sec[0], 40) == 0)) &&
                       zmq_bind(s_pull[k], "tcp://127.0.0.1:*") == 0 &&
                       zmq_getsockopt(s_pull[k], ZMQ_LAST_ENDPOINT, s_pull_ep[k], &len) == 0,
                   "the played rank's socket: %s", zmq_strerror(zmq_errno()));
    }
    const char *v = getenv("SCAPE_FUZZ_LOG");
    s_verbose = v && strcmp(v, "2") == 0;
}

typedef struct meet_ctx {
    int real, curve;
    char bound[256];
    const char *eps[2], *keys[2];
} meet_ctx;

static scape_rc meet(void *arg, const char *bound, const char *const **endpoints,
                     const char *const **keys)
{
    meet_ctx *m = arg;
    snprintf(m->bound, sizeof m->bound, "%s", bound);
    m->eps[m->real] = m->bound;
    m->eps[1 - m->real] = s_pull_ep[m->curve];
    m->keys[m->real] = s_pub[1];
    m->keys[1 - m->real] = s_pub[0];
    *endpoints = m->eps;
    *keys = m->curve ? m->keys : NULL;
    return SCAPE_OK;
}

/* The op, the real rank, rank 0's and rank 1's element counts. */
typedef struct shape {
    enum op op;
    int real, curve;
    size_t n, chunk_bytes, cnt[2];
} shape;

static void read_shape(fuzz_in *in, shape *sh)
{
    uint32_t b = fuzz_u8(in);
    sh->op = (enum op)((b & 0x7f) % OP_N);
    sh->real = (int)(b >> 7);
    sh->n = 1 + fuzz_u8(in) % MAX_N;
    uint32_t c = fuzz_u8(in);
    sh->chunk_bytes = 4 * (1 + (c & 0x7f) % 8);
    sh->curve = !(c & 0x80);
    sh->cnt[0] = (sh->n + 1) / 2; /* all-reduce's equal segments, for every op */
    sh->cnt[1] = sh->n - sh->cnt[0];
}

/* Run the op on the real rank. */
static scape_rc run_op(comm_t *c, const shape *sh)
{
    float send[MAX_N], recv[MAX_N];
    for (size_t i = 0; i < MAX_N; i++)
        send[i] = recv[i] = -1.0f - (float)i;
    size_t bytes[2] = { 4 * sh->cnt[0], 4 * sh->cnt[1] };
    scape_rc rc;
    switch (sh->op) {
    case OP_BARRIER: return comm_barrier(c);
    case OP_ALLGATHER: return comm_allgather(c, send, recv, bytes);
    case OP_REDUCE_SCATTER: return comm_reduce_scatter_sum(c, send, recv, sh->cnt);
    case OP_ALLREDUCE: return comm_allreduce_sum(c, send, sh->n);
    case OP_BROADCAST: return comm_broadcast(c, recv, bytes[0] + bytes[1], 1 - sh->real);
    case OP_IAG:
        rc = comm_iallgather(c, send, recv, bytes);
        return rc == SCAPE_OK ? comm_iallgather_wait(c) : rc;
    case OP_RS_BF16: /* -1 - i: bf16 numbers for every i < MAX_N */
        return comm_reduce_scatter_sum_wire(c, send, recv, sh->cnt, 1);
    case OP_N: break;
    }
    abort();
}

static void send_msg(void *push, uint32_t sel, const uint8_t *p, size_t n)
{
    if (sel & 1) { /* one bare frame */
        FUZZ_CHECK(zmq_send(push, p, n, 0) >= 0, "send: %s", zmq_strerror(zmq_errno()));
        return;
    }
    fuzz_in in = { p, n };
    wire_hdr h = { .job = sel & 4 ? JOB + 1 : JOB, .magic = sel & 2 ? ~HOST_MAGIC : HOST_MAGIC };
    h.kind = (uint16_t)fuzz_u8(&in);
    h.seq = fuzz_u8(&in);
    h.chunk = fuzz_u8(&in);
    h.sender = (uint16_t)fuzz_u8(&in);
    FUZZ_CHECK(zmq_send(push, &h, sizeof h, ZMQ_SNDMORE) >= 0 &&
                   zmq_send(push, in.p, in.left, 0) >= 0,
               "send: %s", zmq_strerror(zmq_errno()));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_in in = { data, size };
    shape sh;
    read_shape(&in, &sh);
    meet_ctx m = { .real = sh.real, .curve = sh.curve };
    comm_host_opts o = { .rank = sh.real, .size = 2, .listen = "tcp://127.0.0.1:*", .meet = meet,
                         .meet_arg = &m, .timeout_ms = TIMEOUT_MS,
                         .chunk_bytes = sh.chunk_bytes, .job = JOB,
                         .curve_public = sh.curve ? s_pub[1] : NULL,
                         .curve_secret = sh.curve ? s_sec[1] : NULL };
    comm_t *c = NULL;
    FUZZ_CHECK(comm_host_create(&o, &c) == SCAPE_OK, "rank %d: %s", sh.real,
               scape_last_error());
    void *push = zmq_socket(s_ctx, ZMQ_PUSH);
    int zero = 0;
    FUZZ_CHECK(push && zmq_setsockopt(push, ZMQ_LINGER, &zero, sizeof zero) == 0 &&
                   (!sh.curve ||
                    (zmq_setsockopt(push, ZMQ_CURVE_SERVERKEY, s_pub[1], 40) == 0 &&
                     zmq_setsockopt(push, ZMQ_CURVE_PUBLICKEY, s_pub[0], 40) == 0 &&
                     zmq_setsockopt(push, ZMQ_CURVE_SECRETKEY, s_sec[0], 40) == 0)) &&
                   zmq_connect(push, m.bound) == 0,
               "played rank -> real rank: %s", zmq_strerror(zmq_errno()));
    uint32_t sel;
    const uint8_t *p;
    size_t n;
    uint64_t foreign = 0, reports = 0;
    while (fuzz_record(&in, &sel, &p, &n)) {
        send_msg(push, sel, p, n);
        foreign += (sel & 7) != 0;
        reports += (sel & 7) == 0 && n > 0 && p[0] == K_FAIL;
    }
    scape_rc rc = run_op(c, &sh);
    if (s_verbose)
        fprintf(stderr, "rank %d: %s of %zu floats: %s\n", sh.real, s_names[sh.op], sh.n,
                rc == SCAPE_OK ? "done" : scape_last_error());
    if (rc != SCAPE_OK)
        FUZZ_CHECK(scape_last_error()[0] != '\0', "the collective failed without a reason");
    /* Foreign messages are dropped and counted, never an error; those that
     * had not been read when the op ended are not counted yet. */
    FUZZ_CHECK(comm_foreign(c, NULL, 0) <= foreign, "%llu foreign messages counted of %llu sent",
               (unsigned long long)comm_foreign(c, NULL, 0), (unsigned long long)foreign);
    /* In a group of two no report names a rank the real one may blame. */
    char ign[128];
    FUZZ_CHECK(comm_host_reports_ignored(c, ign, sizeof ign) <= reports,
               "%llu reports ignored of %llu sent (the last: %s)",
               (unsigned long long)comm_host_reports_ignored(c, NULL, 0),
               (unsigned long long)reports, ign);
    /* The played rank holds a key the real rank admits: never refused. */
    char why[256];
    FUZZ_CHECK(comm_refused(c, why, sizeof why) == 0, "the played rank was refused: %s", why);
    zmq_close(push);
    comm_destroy(&c);
    for (zmq_msg_t msg;
         zmq_msg_init(&msg) == 0 && zmq_msg_recv(&msg, s_pull[sh.curve], ZMQ_DONTWAIT) >= 0;)
        zmq_msg_close(&msg);
    return 0;
}

/* ---- seeds: the played rank's side of every collective ---------------------- */

static void put_msg(fuzz_buf *b, int sender, int kind, int seq, int chunk, const void *body,
                    size_t n)
{
    uint8_t buf[4 + 4 * MAX_N];
    buf[0] = (uint8_t)kind;
    buf[1] = (uint8_t)seq;
    buf[2] = (uint8_t)chunk;
    buf[3] = (uint8_t)sender;
    if (n)
        memcpy(buf + 4, body, n);
    fuzz_put(b, 0, buf, 4 + n);
}

/* A stream of count values in chunks: 0.5, 1.5, ...; as floats, or (bf16,
 * wire_values: bf16) as their upper halves. */
static void put_stream(fuzz_buf *b, int sender, int kind, int seq, size_t count,
                       size_t chunk_bytes, int bf16)
{
    size_t cf = chunk_bytes / 4;
    for (size_t i = 0; i * cf < count; i++) {
        float v[MAX_N];
        uint16_t h[MAX_N];
        size_t len = count - i * cf < cf ? count - i * cf : cf;
        for (size_t j = 0; j < len; j++) {
            v[j] = 0.5f + (float)(i * cf + j);
            uint32_t u;
            memcpy(&u, &v[j], sizeof u);
            h[j] = (uint16_t)(u >> 16);
        }
        if (bf16)
            put_msg(b, sender, kind, seq, (int)i, h, 2 * len);
        else
            put_msg(b, sender, kind, seq, (int)i, v, 4 * len);
    }
}

void fuzz_seeds(fuzz_emit emit, void *ctx)
{
    fuzz_buf *b = calloc(1, sizeof *b);
    FUZZ_CHECK(b != NULL, "out of memory");
    for (int real = 0; real < 2; real++)
        for (int op = 0; op < OP_N; op++) {
            b->len = 0;
            const size_t n = 21, chunk_bytes = 8 * 4; /* several chunks, the last short */
            b->data[b->len++] = (uint8_t)(op | real << 7);
            b->data[b->len++] = (uint8_t)(n - 1);
            b->data[b->len++] = (uint8_t)(chunk_bytes / 4 - 1);
            int me = 1 - real; /* the played rank */
            size_t cnt[2] = { (n + 1) / 2, n - (n + 1) / 2 };
            switch ((enum op)op) {
            case OP_BARRIER: /* rank 1 reports to rank 0, which releases it */
                put_msg(b, me, me ? K_BAR_IN : K_BAR_OUT, 0, 0, NULL, 0);
                break;
            case OP_ALLGATHER: put_stream(b, me, K_AG, 0, cnt[me], chunk_bytes, 0); break;
            case OP_REDUCE_SCATTER:
                put_stream(b, me, K_RS_PART, 0, cnt[real], chunk_bytes, 0);
                break;
            case OP_ALLREDUCE: /* a reduce-scatter (op 0), then an all-gather (op 1) */
                put_stream(b, me, K_RS_PART, 0, cnt[real], chunk_bytes, 0);
                put_stream(b, me, K_AG, 1, cnt[me], chunk_bytes, 0);
                break;
            case OP_BROADCAST: put_stream(b, me, K_BC, 0, n, chunk_bytes, 0); break;
            case OP_IAG: put_stream(b, me, K_IAG, 0, cnt[me], chunk_bytes, 0); break;
            case OP_RS_BF16:
                put_stream(b, me, K_RS_PART, 0, cnt[real], chunk_bytes, 1);
                break;
            case OP_N: break;
            }
            /* Failure reports no rank of two can act on: ignored and counted. */
            static const char why[] = "rank 1 sent nothing for 40 ms during barrier (op 0)";
            put_msg(b, me, K_FAIL, 0, real, why, sizeof why - 1);
            put_msg(b, me, K_FAIL, 0, me, why, sizeof why - 1);
            put_msg(b, me, K_FAIL, 0, 9, why, sizeof why - 1);
            put_msg(b, 7, K_FAIL, 0, real, "\x01\xff", 2);
            /* A stray sender on the port: dropped and counted, never fatal. */
            fuzz_put(b, 1, "hello?", 6);
            fuzz_put(b, 2, "\x02\x00\x00\x01", 4);
            fuzz_put(b, 4, "\x02\x00\x00\x01", 4);
            char name[64];
            snprintf(name, sizeof name, "rank%d-%s", real, s_names[op]);
            emit(ctx, name, b->data, b->len);
        }
    free(b);
}
