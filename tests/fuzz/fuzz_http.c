/* fuzz_http.c - what an HTTP client sends the daemon's metrics_listen port
 * (daemon/metrics_http.c): anyone who reaches that port may connect.
 *
 * One real responder (mhttp_create on 127.0.0.1, a free port) serves every
 * input, rendering with the real proto/scape_prom.c over a made-up
 * StatusReply.  For each input the target connects a real TCP socket, sends
 * the request bytes (in up to three writes, with rounds of the responder's
 * loop between them), half-closes when asked or when the bytes do not
 * complete a request (so the responder answers at once instead of after its
 * 5 s timeout), and drives mhttp_poll_items / zmq_poll / mhttp_serve, as
 * daemon/server.c does, until the responder ends the connection.
 *
 * Input: a flags byte (bits 0-1: writes, 1 + value % 3; bit 2: half-close
 * after the last write; bits 3-7: idle connections opened first, value % 18,
 * so that 16 or more make the responder close its oldest), two 16-bit split
 * points, then the request's bytes.
 *
 * Checked for every input, beyond "no crash" (ASan, UBSan):
 *   - a request whose headers end (CRLF CRLF or LF LF) within the first
 *     MHTTP_MAX_REQUEST - 1 bytes gets one response; longer ones get 431;
 *     shorter unfinished ones are closed without a response;
 *   - a response is "HTTP/1.x NNN", NNN one of 200 400 404 405 431, with
 *     Connection: close and a Content-Length equal to the body's length,
 *     and the responder then closes the connection (no reset);
 *   - a 200 (the exposition, byte for byte, as its content type says) only
 *     for a request line "GET /metrics[?query] HTTP/..."; 404 and 405 only
 *     for a request line that starts with a method and a space; a plain
 *     request line (METHOD /path HTTP/d.d) gets exactly 200, 404 or 405;
 *   - afterwards no connection is left open, and a well-formed GET /metrics
 *     still gets the exposition.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "fuzz.h"
#include "metrics_http.h"
#include "scape.pb-c.h"
#include "scape_prom.h"

#define MAX_IDLE 17                       /* idle connections: one more than it holds */
#define MAX_RESP (1 << 16)                /* the longest response read */
#define LOOP_S 10.0                       /* one exchange's bound: twice the responder's */
#define SCRAPE "GET /metrics HTTP/1.0\r\n\r\n"

static mhttp *s_http;
static struct sockaddr_in s_addr;
static char *s_expo;                      /* the exposition every 200 must carry */
static size_t s_expo_len;
static int s_verbose;                     /* SCAPE_FUZZ_LOG=2: what each input got */

/* ---- the responder -------------------------------------------------------- */

static int render(void *arg, FILE *out)
{
    (void)arg;
    Scape__StatusReply st = SCAPE__STATUS_REPLY__INIT;
    st.rank = 1;
    st.world = 2;
    st.version = "fuzz";
    st.state = "running";
    st.optimizer = "adamw";
    st.mode = "sparse";
    st.step = 42;
    st.numel = 1000;
    st.rho = 0.01;
    st.has_steps_total = 1;
    st.steps_total = 42;
    st.has_wire_bytes_total = 1;
    st.wire_bytes_total = 123456;
    return prom_render(out, &st);
}

void fuzz_setup(void)
{
    FUZZ_CHECK(mhttp_create(&s_http, "127.0.0.1:0", render, NULL) == SCAPE_OK,
               "mhttp_create: %s", scape_last_error());
    FUZZ_CHECK(mhttp_port(s_http) > 0, "no port: %d", mhttp_port(s_http));
    s_addr.sin_family = AF_INET;
    s_addr.sin_port = htons((uint16_t)mhttp_port(s_http));
    s_addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    FILE *f = open_memstream(&s_expo, &s_expo_len);
    FUZZ_CHECK(f != NULL && render(NULL, f) == 0 && fclose(f) == 0 && s_expo_len > 0,
               "cannot render the expected exposition");
    const char *v = getenv("SCAPE_FUZZ_LOG");
    s_verbose = v && strcmp(v, "2") == 0;
}

/* Open connections, the responder's listening socket not counted. */
static int open_conns(void)
{
    zmq_pollitem_t items[MHTTP_MAX_ITEMS];
    return mhttp_poll_items(s_http, items) - 1;
}

/* ---- one client ------------------------------------------------------------ */

typedef struct client {
    int fd;
    const uint8_t *req;
    size_t len, off;          /* the request, and how much of it is sent */
    size_t cut[3];            /* the end of each write */
    int part, nparts, gap;    /* gap: loop rounds left before the next write */
    int shut_after;           /* half-close once everything is sent */
    int shut, eof, reset;
    char resp[MAX_RESP];
    size_t resp_len;
} client;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A non-blocking connection to the listener.  The connect is non-blocking
 * too: libFuzzer's SIGALRM (its -timeout watchdog) may interrupt a blocking
 * one (EINTR), which then goes on in the background; either way the
 * connection is waited for, bounded, by poll.  On loopback the kernel
 * completes it from the listen backlog, before anything accepts. */
static int dial(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    FUZZ_CHECK(fd >= 0, "socket: %s", strerror(errno));
    int fl = fcntl(fd, F_GETFL);
    FUZZ_CHECK(fl >= 0 && fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0, "fcntl: %s",
               strerror(errno));
    if (connect(fd, (struct sockaddr *)&s_addr, sizeof s_addr) == 0)
        return fd;
    FUZZ_CHECK(errno == EINPROGRESS || errno == EINTR, "connect to 127.0.0.1:%d: %s",
               mhttp_port(s_http), strerror(errno));
    double deadline = now_s() + 10.0;
    struct pollfd p = { .fd = fd, .events = POLLOUT, .revents = 0 };
    int rc;
    while ((rc = poll(&p, 1, 100)) <= 0) {
        FUZZ_CHECK(rc == 0 || errno == EINTR, "poll: %s", strerror(errno));
        FUZZ_CHECK(now_s() < deadline, "connect to 127.0.0.1:%d: no connection in 10 s",
                   mhttp_port(s_http));
    }
    int err = 0;
    socklen_t len = sizeof err;
    FUZZ_CHECK(getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0,
               "connect to 127.0.0.1:%d: %s", mhttp_port(s_http), strerror(err ? err : errno));
    return fd;
}

/* One round of the responder's loop (as srv_serve_once), with the client's
 * socket polled too when there is one. */
static void round_trip(client *c, int timeout_ms)
{
    zmq_pollitem_t items[MHTTP_MAX_ITEMS + 1];
    int n = mhttp_poll_items(s_http, items);
    int ci = -1;
    if (c != NULL && !c->eof) {
        ci = n;
        int want_out = !c->shut && c->gap == 0 && c->off < c->cut[c->part];
        items[n++] = (zmq_pollitem_t){ .fd = c->fd,
                                       .events = (short)(ZMQ_POLLIN |
                                                         (want_out ? ZMQ_POLLOUT : 0)) };
    }
    int rc = zmq_poll(items, n, timeout_ms);
    FUZZ_CHECK(rc >= 0 || zmq_errno() == EINTR, "zmq_poll: %s", zmq_strerror(zmq_errno()));
    mhttp_serve(s_http, items, rc > 0 ? (ci >= 0 ? ci : n) : 0);
    if (ci < 0)
        return;
    if (c->gap > 0)
        c->gap--;
    short ev = rc > 0 ? items[ci].revents : 0;
    if (ev & (ZMQ_POLLIN | ZMQ_POLLERR)) {
        for (;;) {
            ssize_t k = recv(c->fd, c->resp + c->resp_len, sizeof c->resp - c->resp_len, 0);
            if (k > 0) {
                c->resp_len += (size_t)k;
                FUZZ_CHECK(c->resp_len < sizeof c->resp, "a response over %d bytes", MAX_RESP);
                continue;
            }
            if (k == 0 || errno == ECONNRESET) {
                c->eof = 1;
                c->reset = k != 0;
            } else {
                FUZZ_CHECK(errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR,
                           "recv: %s", strerror(errno));
            }
            break;
        }
    }
    if ((ev & ZMQ_POLLOUT) && !c->eof) {
        ssize_t k = send(c->fd, c->req + c->off, c->cut[c->part] - c->off, MSG_NOSIGNAL);
        if (k > 0)
            c->off += (size_t)k;
        else if (k < 0 && (errno == EPIPE || errno == ECONNRESET))
            c->shut = 1; /* it closed first: what it had decides */
        else
            FUZZ_CHECK(k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR),
                       "send: %s", strerror(errno));
    }
    if (c->gap == 0 && c->off == c->cut[c->part] && c->part + 1 < c->nparts) {
        c->part++;
        c->gap = 2; /* let the responder read this write on its own */
    }
    if (!c->shut && c->off == c->len && c->shut_after) {
        FUZZ_CHECK(shutdown(c->fd, SHUT_WR) == 0, "shutdown: %s", strerror(errno));
        c->shut = 1;
    }
}

/* Send c's request and read until the responder ends the connection. */
static void exchange(client *c)
{
    double t0 = now_s();
    while (!c->eof) {
        FUZZ_CHECK(now_s() - t0 < LOOP_S, "no end to the exchange after %.0f s (%zu of %zu "
                   "bytes sent, %zu received)", LOOP_S, c->off, c->len, c->resp_len);
        round_trip(c, c->gap > 0 ? 0 : 100);
    }
    FUZZ_CHECK(close(c->fd) == 0, "close: %s", strerror(errno));
}

/* Loop rounds until the responder holds want connections. */
static void settle(int want)
{
    double t0 = now_s();
    while (open_conns() != want) {
        FUZZ_CHECK(now_s() - t0 < LOOP_S, "%d connections open after %.0f s, not %d",
                   open_conns(), LOOP_S, want);
        round_trip(NULL, 100);
    }
}

/* ---- what the bytes ask for -------------------------------------------------- */

/* Where the headers end, as the responder sees them: the index past the
 * blank line's LF within the first max bytes, or 0. */
static size_t headers_end(const uint8_t *p, size_t n, size_t max)
{
    n = n < max ? n : max;
    for (size_t i = 1; i < n; i++)
        if (p[i] == '\n' && (p[i - 1] == '\n' || (i >= 3 && memcmp(p + i - 3, "\r\n\r", 3) == 0)))
            return i + 1;
    return 0;
}

static int upper(uint8_t ch) { return ch >= 'A' && ch <= 'Z'; }

/* The request line "METHOD /path HTTP/d.d" of plain characters: the status
 * it must get, or 0 for any other line. */
static int plain_status(const uint8_t *line, size_t n)
{
    if (n > 0 && line[n - 1] == '\r')
        n--;
    size_t m = 0;
    while (m < n && upper(line[m]))
        m++;
    if (m == 0 || m > 15 || m + 1 >= n || line[m] != ' ' || line[m + 1] != '/')
        return 0;
    size_t t = m + 1, e = t;
    while (e < n && line[e] > ' ' && line[e] < 0x7f)
        e++;
    const uint8_t *v = line + e + 1;
    if (e - t > 255 || n - e != 9 || line[e] != ' ' || memcmp(v, "HTTP/", 5) != 0 ||
        v[5] < '0' || v[5] > '9' || v[6] != '.' || v[7] < '0' || v[7] > '9')
        return 0;
    if (m != 3 || memcmp(line, "GET", 3) != 0)
        return 405;
    size_t path = t;
    while (path < e && line[path] != '?')
        path++;
    return path - t == 8 && memcmp(line + t, "/metrics", 8) == 0 ? 200 : 404;
}

/* Does the line ask for GET /metrics, a query allowed? */
static int asks_metrics(const uint8_t *line, size_t n)
{
    static const char get[] = "GET /metrics";
    if (n < sizeof get || memcmp(line, get, sizeof get - 1) != 0 ||
        (line[sizeof get - 1] != ' ' && line[sizeof get - 1] != '?'))
        return 0;
    for (size_t i = sizeof get - 1; i + 6 <= n; i++)
        if (memcmp(line + i, " HTTP/", 6) == 0)
            return 1;
    return 0;
}

/* The value of header name (with its ": "), or NULL. */
static const char *header(const char *head, size_t n, const char *name)
{
    size_t k = strlen(name);
    for (const char *p = head; p + k + 2 <= head + n; p++)
        if ((p == head || p[-1] == '\n') && memcmp(p, name, k) == 0 && p[k] == ':')
            return p + k + 1 + (p[k + 1] == ' ');
    return NULL;
}

/* The response's status after the checks every response must pass; 0 for
 * none at all. */
static int check_response(const client *c)
{
    const char *r = c->resp;
    size_t n = c->resp_len;
    FUZZ_CHECK(!c->reset, "the connection was reset (%zu response bytes read)", n);
    if (n == 0)
        return 0;
    FUZZ_CHECK(n >= 13 && memcmp(r, "HTTP/1.", 7) == 0 && r[8] == ' ' && r[12] == ' ',
               "not a status line: %.40s", r);
    int code = (r[9] - '0') * 100 + (r[10] - '0') * 10 + (r[11] - '0');
    FUZZ_CHECK(code == 200 || code == 400 || code == 404 || code == 405 || code == 431,
               "status %.3s", r + 9);
    const char *end = NULL;
    for (size_t i = 0; i + 4 <= n && end == NULL; i++)
        if (memcmp(r + i, "\r\n\r\n", 4) == 0)
            end = r + i + 4;
    FUZZ_CHECK(end != NULL, "a %d without the blank line that ends its headers", code);
    size_t head = (size_t)(end - r), body = n - head;
    const char *cl = header(r, head, "Content-Length");
    FUZZ_CHECK(cl != NULL && strtoull(cl, NULL, 10) == body,
               "a %d with a %zu-byte body: Content-Length %.12s", code, body, cl ? cl : "missing");
    const char *conn = header(r, head, "Connection");
    FUZZ_CHECK(conn != NULL && strncmp(conn, "close\r\n", 7) == 0,
               "a %d without Connection: close", code);
    if (code == 200) {
        const char *type = header(r, head, "Content-Type");
        FUZZ_CHECK(type != NULL && strncmp(type, PROM_CONTENT_TYPE "\r\n",
                                           sizeof PROM_CONTENT_TYPE + 1) == 0,
                   "a 200 of another type: %.60s", type ? type : "(none)");
        FUZZ_CHECK(body == s_expo_len && memcmp(end, s_expo, body) == 0,
                   "a 200 whose body (%zu bytes) is not the exposition (%zu)", body, s_expo_len);
    }
    return code;
}

/* ---- the target ------------------------------------------------------------ */

static client s_cli; /* big: one, reused */

static void run_client(client *c, const uint8_t *req, size_t len, const size_t *cut, int nparts,
                       int shut_after)
{
    memset(c, 0, offsetof(client, resp));
    c->resp_len = 0;
    c->req = req;
    c->len = len;
    c->nparts = nparts;
    for (int i = 0; i < nparts; i++)
        c->cut[i] = cut[i];
    c->shut_after = shut_after;
    c->fd = dial();
    exchange(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_in in = { data, size };
    uint32_t flags = fuzz_u8(&in);
    uint32_t at[2] = { fuzz_u16(&in), fuzz_u16(&in) };
    const uint8_t *req = in.p;
    size_t len = in.left;
    int nparts = 1 + (int)((flags & 3) % 3);
    size_t cut[3] = { at[0] % (len + 1), at[1] % (len + 1), len };
    if (cut[0] > cut[1]) {
        size_t t = cut[0];
        cut[0] = cut[1];
        cut[1] = t;
    }
    if (nparts == 2)
        cut[1] = len;
    else if (nparts == 1)
        cut[0] = len;
    int nidle = (int)((flags >> 3) % (MAX_IDLE + 1));

    FUZZ_CHECK(open_conns() == 0, "%d connections left open before the input", open_conns());
    int idle[MAX_IDLE];
    for (int i = 0; i < nidle; i++)
        idle[i] = dial();

    size_t end = headers_end(req, len, MHTTP_MAX_REQUEST - 1);
    /* Unfinished bytes get the half-close that makes the responder act now. */
    run_client(&s_cli, req, len, cut, nparts, (flags & 4) || end == 0);
    int code = check_response(&s_cli);
    if (s_verbose)
        fprintf(stderr, "http: %zu bytes in %d writes%s, %d idle: %d\n", len, nparts,
                (flags & 4) ? " and a half-close" : "", nidle, code);
    if (end == 0) {
        int want = len >= MHTTP_MAX_REQUEST - 1 ? 431 : 0;
        FUZZ_CHECK(code == want, "%zu bytes without the end of the headers got %d, not %d",
                   len, code, want);
    } else {
        size_t line = 0;
        while (req[line] != '\n')
            line++;
        int plain = plain_status(req, line);
        FUZZ_CHECK(code != 0 && code != 431, "a complete %zu-byte request got %d", end, code);
        FUZZ_CHECK(plain == 0 || code == plain, "the request line %.*s got %d, not %d",
                   (int)line, req, code, plain);
        FUZZ_CHECK(code != 200 || asks_metrics(req, line),
                   "a 200 for the request line %.*s", (int)line, req);
        if (code == 404 || code == 405) {
            size_t m = 0;
            while (m < line && upper(req[m]))
                m++;
            FUZZ_CHECK(m > 0 && m < line && req[m] == ' ' && (code == 405) == (m != 3 ||
                           memcmp(req, "GET", 3) != 0),
                       "a %d for the request line %.*s", code, (int)line, req);
        }
    }
    for (int i = 0; i < nidle; i++)
        FUZZ_CHECK(close(idle[i]) == 0, "close: %s", strerror(errno));
    settle(0);

    /* It still serves a scrape. */
    size_t whole = sizeof SCRAPE - 1;
    run_client(&s_cli, (const uint8_t *)SCRAPE, whole, &whole, 1, 0);
    FUZZ_CHECK(check_response(&s_cli) == 200, "the scrape after the input got %.12s",
               s_cli.resp_len ? s_cli.resp : "no response");
    settle(0);
    return 0;
}

/* ---- seeds -------------------------------------------------------------------- */

static void put_seed(fuzz_emit emit, void *ctx, const char *name, uint8_t flags, uint16_t a,
                     uint16_t b, const void *req, size_t len)
{
    uint8_t *buf = malloc(5 + len);
    FUZZ_CHECK(buf != NULL, "out of memory");
    buf[0] = flags;
    buf[1] = (uint8_t)(a & 0xff);
    buf[2] = (uint8_t)(a >> 8);
    buf[3] = (uint8_t)(b & 0xff);
    buf[4] = (uint8_t)(b >> 8);
    memcpy(buf + 5, req, len);
    emit(ctx, name, buf, 5 + len);
    free(buf);
}

#define SEED(name, flags, a, b, text) put_seed(emit, ctx, name, flags, a, b, text, sizeof text - 1)

void fuzz_seeds(fuzz_emit emit, void *ctx)
{
    SEED("get-metrics", 0, 0, 0,
         "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:9464\r\nUser-Agent: Prometheus/2.45\r\n"
         "Accept: text/plain;version=0.0.4\r\n\r\n");
    SEED("get-metrics-query-split", 2, 5, 20, "GET /metrics?name[]=scape_up HTTP/1.0\r\n\r\n");
    SEED("get-root", 4, 0, 0, "GET / HTTP/1.0\r\n\r\n");
    SEED("post", 1, 9, 0, "POST /metrics HTTP/1.1\r\nContent-Length: 4\r\n\r\nbody");
    SEED("head", 0, 0, 0, "HEAD /metrics HTTP/1.1\r\n\r\n");
    SEED("bare-lf", 0, 0, 0, "GET /metrics HTTP/1.0\nHost: x\n\n");
    SEED("unfinished", 0, 0, 0, "GET /metrics HTTP/1.0\r\nHost: x\r\n");
    SEED("garbage", 4, 0, 0, "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n");
    SEED("idle-16", 16 << 3, 0, 0, "GET /metrics HTTP/1.0\r\n\r\n");
    /* Headers past MHTTP_MAX_REQUEST: 431. */
    size_t n = MHTTP_MAX_REQUEST + 200;
    char *big = malloc(n);
    FUZZ_CHECK(big != NULL, "out of memory");
    static const char start[] = "GET /metrics HTTP/1.1\r\nX-Big: ";
    memcpy(big, start, sizeof start - 1);
    memset(big + sizeof start - 1, 'a', n - (sizeof start - 1) - 4);
    memcpy(big + n - 4, "\r\n\r\n", 4);
    put_seed(emit, ctx, "oversized-header", 1, 0, 0, big, n);
    free(big);
}
