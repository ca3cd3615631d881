/* metrics_http.c - GET /metrics over HTTP/1.0 in the daemon's poll loop.
 *
 * Every socket is non-blocking; a connection goes READ (the request, up to
 * MHTTP_MAX_REQUEST bytes and the blank line that ends its headers), WRITE
 * (one response, Connection: close), then DRAIN (our side shut down, what
 * the client still sends is read and dropped until it closes, so that the
 * kernel does not reset the connection under an unread response).  A
 * connection older than MHTTP_TIMEOUT_MS is closed wherever it is. */
#define _POSIX_C_SOURCE 200809L
#include "metrics_http.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "scape_prom.h"

typedef enum { C_FREE = 0, C_READ, C_WRITE, C_DRAIN } conn_state;

typedef struct conn {
    conn_state state;
    int fd;
    double opened;                 /* monotonic seconds */
    char req[MHTTP_MAX_REQUEST];
    size_t req_len;
    char *resp;                    /* malloc'd response */
    size_t resp_len, resp_off;
} conn;

struct mhttp {
    int fd;                        /* listening socket */
    int port;
    mhttp_render_fn render;
    void *arg;
    conn conns[MHTTP_MAX_CLIENTS];
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int set_nonblocking(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0)
        return -1;
    return fcntl(fd, F_SETFD, FD_CLOEXEC);
}

/* ---- listening ----------------------------------------------------------- */

/* "HOST:PORT", ":PORT" or "[V6]:PORT" into host ("" = any) and port. */
static scape_rc split_addr(const char *addr, char *host, size_t hlen, char *port, size_t plen)
{
    const char *colon = strrchr(addr, ':');
    const char *h = addr;
    size_t n = colon ? (size_t)(colon - addr) : 0;
    if (colon && addr[0] == '[' && n >= 2 && addr[n - 1] == ']') {
        h = addr + 1;
        n -= 2;
    }
    const char *p = colon ? colon + 1 : "";
    size_t digits = strspn(p, "0123456789");
    if (colon == NULL || digits == 0 || p[digits] != '\0' || digits > 5 || atoi(p) > 65535 ||
        n >= hlen || (h == addr && memchr(addr, ':', n) != NULL))
        return scape_set_error(SCAPE_INVALID,
                               "metrics_listen '%s' is not HOST:PORT, :PORT or [IPV6]:PORT "
                               "(e.g. 127.0.0.1:9464, or :9464 for every interface)", addr);
    memcpy(host, h, n);
    host[n] = '\0';
    snprintf(port, plen, "%s", p);
    return SCAPE_OK;
}

/* A socket bound and listening at one of the addresses of res. */
static int listen_any(const struct addrinfo *res, int *err)
{
    for (const struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
        if (fd < 0) {
            *err = errno;
            continue;
        }
        int one = 1;
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
            bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 64) == 0 &&
            set_nonblocking(fd) == 0)
            return fd;
        *err = errno;
        close(fd);
    }
    return -1;
}

static int bound_port(int fd)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0)
        return -1;
    char port[16];
    if (getnameinfo((struct sockaddr *)&ss, len, NULL, 0, port, sizeof port,
                    NI_NUMERICSERV) != 0)
        return -1;
    return atoi(port);
}

scape_rc mhttp_create(mhttp **out, const char *addr, mhttp_render_fn render, void *arg)
{
    char host[256], port[8];
    scape_rc rc = split_addr(addr, host, sizeof host, port, sizeof port);
    if (rc != SCAPE_OK)
        return rc;
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                              .ai_flags = AI_PASSIVE };
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(host[0] ? host : NULL, port, &hints, &res);
    if (gai != 0)
        return scape_set_error(SCAPE_INVALID, "metrics_listen '%s': cannot resolve '%s': %s",
                               addr, host, gai_strerror(gai));
    int err = 0;
    int fd = listen_any(res, &err);
    freeaddrinfo(res);
    if (fd < 0)
        return scape_set_error(SCAPE_SYSTEM,
                               "metrics_listen '%s': cannot listen there: %s (%s)", addr,
                               strerror(err),
                               err == EADDRINUSE ? "another process has that port: pick "
                               "another, or port 0 for a free one"
                               : err == EACCES ? "ports below 1024 need privileges: pick a "
                               "higher one" : "is the address one of this host's?");
    mhttp *h = calloc(1, sizeof *h);
    if (h == NULL) {
        close(fd);
        return scape_set_error(SCAPE_NOMEM, "metrics_listen: out of memory");
    }
    h->fd = fd;
    h->port = bound_port(fd);
    h->render = render;
    h->arg = arg;
    LOG_INFO(SUB_STATUS, "metrics at http://%s%s%s:%d/metrics", strchr(host, ':') ? "[" : "",
             host[0] ? host : "*", strchr(host, ':') ? "]" : "", h->port);
    *out = h;
    return SCAPE_OK;
}

int mhttp_port(const mhttp *h) { return h->port; }

/* ---- connections ---------------------------------------------------------- */

static void conn_close(conn *c)
{
    if (c->fd >= 0 && close(c->fd) != 0)
        LOG_DEBUG(SUB_STATUS, "metrics: close: %s", strerror(errno));
    free(c->resp);
    c->resp = NULL;
    c->fd = -1;
    c->state = C_FREE;
}

/* A free slot, or the oldest connection closed to make one. */
static conn *conn_slot(mhttp *h)
{
    conn *oldest = &h->conns[0];
    for (int i = 0; i < MHTTP_MAX_CLIENTS; i++) {
        if (h->conns[i].state == C_FREE)
            return &h->conns[i];
        if (h->conns[i].opened < oldest->opened)
            oldest = &h->conns[i];
    }
    LOG_DEBUG(SUB_STATUS, "metrics: %d connections open: closing the oldest",
              MHTTP_MAX_CLIENTS);
    conn_close(oldest);
    return oldest;
}

static void accept_all(mhttp *h)
{
    for (int i = 0; i < MHTTP_MAX_CLIENTS; i++) {
        int fd = accept(h->fd, NULL, NULL);
        if (fd < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR &&
                errno != ECONNABORTED)
                LOG_WARN(SUB_STATUS, "metrics: accept: %s", strerror(errno));
            return;
        }
        if (set_nonblocking(fd) != 0) {
            LOG_WARN(SUB_STATUS, "metrics: fcntl: %s", strerror(errno));
            close(fd);
            continue;
        }
        conn *c = conn_slot(h);
        *c = (conn){ .state = C_READ, .fd = fd, .opened = now_s() };
    }
}

/* Give c the response: status line, headers and body. */
static void respond(conn *c, int code, const char *reason, const char *type, const char *extra,
                    const char *body, size_t body_len)
{
    char head[512];
    int n = snprintf(head, sizeof head,
                     "HTTP/1.0 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "Connection: close\r\n%s\r\n", code, reason, type, body_len, extra);
    c->resp = malloc((size_t)n + body_len);
    if (c->resp == NULL) {
        LOG_WARN(SUB_STATUS, "metrics: out of memory for a %zu-byte response", body_len);
        conn_close(c);
        return;
    }
    memcpy(c->resp, head, (size_t)n);
    memcpy(c->resp + n, body, body_len);
    c->resp_len = (size_t)n + body_len;
    c->resp_off = 0;
    c->state = C_WRITE;
}

static void respond_text(conn *c, int code, const char *reason, const char *extra,
                         const char *body)
{
    respond(c, code, reason, "text/plain; charset=utf-8", extra, body, strlen(body));
}

static void respond_metrics(mhttp *h, conn *c)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    int bad = f == NULL || h->render(h->arg, f) != 0;
    if (f != NULL && fclose(f) != 0)
        bad = 1;
    if (bad) {
        LOG_WARN(SUB_STATUS, "metrics: cannot render the exposition (out of memory?)");
        respond_text(c, 500, "Internal Server Error", "", "the metrics could not be "
                     "rendered; see the daemon's log\n");
    } else {
        respond(c, 200, "OK", PROM_CONTENT_TYPE, "", text, len);
    }
    free(text);
}

/* The request line of a complete request: METHOD SP TARGET SP HTTP/x.y.
 * Each SP is one space, matched as such ("%1[ ]"): a " " in the format
 * would match no space at all, or newlines, and so read a request line out
 * of "GET/metrics" or across the end of the headers. */
static void answer(mhttp *h, conn *c)
{
    char method[16], target[256], version[16], sp[2];
    c->req[c->req_len] = '\0';
    if (sscanf(c->req, "%15[A-Z]%1[ ]%255[^ \r\n]%1[ ]%15[^ \r\n]", method, sp, target, sp,
               version) != 5 ||
        strncmp(version, "HTTP/", 5) != 0) {
        respond_text(c, 400, "Bad Request", "", "not an HTTP request; try GET /metrics\n");
        return;
    }
    if (strcmp(method, "GET") != 0) {
        respond_text(c, 405, "Method Not Allowed", "Allow: GET\r\n",
                     "only GET is served; try GET /metrics\n");
        return;
    }
    target[strcspn(target, "?")] = '\0';
    if (strcmp(target, "/metrics") != 0) {
        respond_text(c, 404, "Not Found", "", "only /metrics is served here\n");
        return;
    }
    respond_metrics(h, c);
}

/* The headers end at a blank line (CRLF CRLF, or bare LF LF); the bytes
 * before from were looked at already. */
static int request_complete(const conn *c, size_t from)
{
    for (size_t i = from > 3 ? from - 3 : 1; i < c->req_len; i++)
        if (c->req[i] == '\n' &&
            (c->req[i - 1] == '\n' || (i >= 3 && memcmp(c->req + i - 3, "\r\n\r", 3) == 0)))
            return 1;
    return 0;
}

static void read_request(mhttp *h, conn *c)
{
    size_t room = sizeof c->req - 1 - c->req_len;
    ssize_t n = recv(c->fd, c->req + c->req_len, room, 0);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    if (n <= 0) { /* gone before asking, or an error */
        conn_close(c);
        return;
    }
    c->req_len += (size_t)n;
    if (request_complete(c, c->req_len - (size_t)n))
        answer(h, c);
    else if (c->req_len == sizeof c->req - 1)
        respond_text(c, 431, "Request Header Fields Too Large", "",
                     "the request's headers are too large\n");
}

static void write_response(conn *c)
{
    ssize_t n = send(c->fd, c->resp + c->resp_off, c->resp_len - c->resp_off, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    if (n < 0) {
        LOG_DEBUG(SUB_STATUS, "metrics: send: %s", strerror(errno));
        conn_close(c);
        return;
    }
    c->resp_off += (size_t)n;
    if (c->resp_off < c->resp_len)
        return;
    if (shutdown(c->fd, SHUT_WR) != 0) {
        conn_close(c);
        return;
    }
    c->state = C_DRAIN;
}

static void drain(conn *c)
{
    char buf[1024];
    ssize_t n = recv(c->fd, buf, sizeof buf, 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
        conn_close(c);
}

/* ---- the loop's part -------------------------------------------------------- */

int mhttp_poll_items(const mhttp *h, zmq_pollitem_t *items)
{
    int n = 0;
    items[n++] = (zmq_pollitem_t){ .fd = h->fd, .events = ZMQ_POLLIN };
    for (int i = 0; i < MHTTP_MAX_CLIENTS; i++) {
        const conn *c = &h->conns[i];
        if (c->state != C_FREE)
            items[n++] = (zmq_pollitem_t){ .fd = c->fd,
                                           .events = c->state == C_WRITE ? ZMQ_POLLOUT
                                                                         : ZMQ_POLLIN };
    }
    return n;
}

static conn *conn_of(mhttp *h, int fd)
{
    for (int i = 0; i < MHTTP_MAX_CLIENTS; i++)
        if (h->conns[i].state != C_FREE && h->conns[i].fd == fd)
            return &h->conns[i];
    return NULL;
}

void mhttp_serve(mhttp *h, const zmq_pollitem_t *items, int n)
{
    /* the connections first: accepting may close the oldest, whose fd
     * number a new connection can then reuse */
    for (int i = 1; i < n; i++) {
        conn *c = items[i].revents ? conn_of(h, items[i].fd) : NULL;
        if (c == NULL)
            continue;
        if (c->state == C_READ)
            read_request(h, c);
        if (c->state == C_WRITE)
            write_response(c);
        else if (c->state == C_DRAIN && (items[i].revents & (ZMQ_POLLIN | ZMQ_POLLERR)))
            drain(c);
    }
    if (n > 0 && (items[0].revents & ZMQ_POLLIN))
        accept_all(h);
    double t = now_s();
    for (int i = 0; i < MHTTP_MAX_CLIENTS; i++)
        if (h->conns[i].state != C_FREE && t - h->conns[i].opened > 1e-3 * MHTTP_TIMEOUT_MS) {
            LOG_DEBUG(SUB_STATUS, "metrics: a connection timed out after %d ms",
                      MHTTP_TIMEOUT_MS);
            conn_close(&h->conns[i]);
        }
}

void mhttp_destroy(mhttp **hp)
{
    if (hp == NULL || *hp == NULL)
        return;
    mhttp *h = *hp;
    for (int i = 0; i < MHTTP_MAX_CLIENTS; i++)
        if (h->conns[i].state != C_FREE)
            conn_close(&h->conns[i]);
    if (h->fd >= 0)
        close(h->fd);
    free(h);
    *hp = NULL;
}
