/* log.c - format a log line into a buffer and write it in one call. */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "try.h"

#define LINE_BYTES 2048  /* a whole line, newline included */
#define SUFFIX_BYTES 128 /* kept free after the message for " (file.c:123)\n" */

const eng_enum log_level_names[] = {
    { "error", LOG_LVL_ERROR }, { "warn", LOG_LVL_WARN }, { "info", LOG_LVL_INFO },
    { "debug", LOG_LVL_DEBUG }, { NULL, 0 },
};
static const char *const s_level_tags[] = { "ERROR", "WARN", "INFO", "DEBUG" };
static const char *const s_sub_names[SUB_COUNT] = {
    [SUB_MAIN] = "main",     [SUB_CONFIG] = "config", [SUB_CTRL] = "ctrl",
    [SUB_ENGINE] = "engine", [SUB_COMM] = "comm",     [SUB_SHM] = "shm",
    [SUB_STATUS] = "status",
};

/* Atomic because log_set_level may run while other threads log. */
static atomic_int s_level = LOG_LVL_INFO;
static int s_rank;
static FILE *s_out; /* NULL = stderr, which is not a constant initialiser */
static char s_host[64] = "?";

void log_init(int rank, log_level level, FILE *out)
{
    char host[sizeof s_host];
    s_rank = rank;
    s_out = out;
    log_set_level(level);
    /* gethostname may truncate without a terminator. */
    if (gethostname(host, sizeof host) == 0) {
        host[sizeof host - 1] = '\0';
        /* The short name keeps the prefix narrow; ranks tell nodes apart. */
        host[strcspn(host, ".")] = '\0';
        memcpy(s_host, host, sizeof s_host);
    }
}

void log_set_level(log_level level)
{
    atomic_store_explicit(&s_level, (int)level, memory_order_relaxed);
}

int log_enabled(log_level level)
{
    return (int)level <= atomic_load_explicit(&s_level, memory_order_relaxed);
}

scape_rc log_level_parse(const char *s, log_level *out)
{
    int v = 0;
    TRY(eng_enum_parse(log_level_names, "log level", s, out ? &v : NULL));
    *out = (log_level)v;
    return SCAPE_OK;
}

const char *log_level_name(log_level l) { return eng_enum_name(log_level_names, (int)l); }

/* Append to buf[0..n) within cap bytes; like snprintf, returns the length
 * the text would have had, which is >= cap when it was cut. */
static size_t vput(char *buf, size_t n, size_t cap, const char *fmt, va_list ap)
{
    int r = vsnprintf(buf + n, cap - n, fmt, ap);
    return r < 0 ? n : n + (size_t)r;
}

/* The length vput left in a buffer of cap bytes. */
static size_t fit(size_t want, size_t cap) { return want < cap ? want : cap - 1; }

static size_t put(char *buf, size_t n, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static size_t put(char *buf, size_t n, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    n = vput(buf, n, cap, fmt, ap);
    va_end(ap);
    return n;
}

static size_t put_prefix(char *buf, size_t cap, log_level l, log_sub sub)
{
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    size_t n = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    const char *tag = (unsigned)l <= LOG_LVL_DEBUG ? s_level_tags[l] : "?";
    const char *name = (unsigned)sub < SUB_COUNT ? s_sub_names[sub] : "?";
    return fit(put(buf, n, cap, ".%03ldZ scaped[rank %d %s] %-5s %s: ",
                   (long)(ts.tv_nsec / 1000000), s_rank, s_host, tag, name),
               cap);
}

/* A newline inside a message (a peer's string, say) would forge a line. */
static void flatten(char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] == '\n' || s[i] == '\r')
            s[i] = ' ';
}

void log_msg(log_level l, log_sub sub, const char *file, int line, const char *fmt, ...)
{
    char buf[LINE_BYTES], raw[LINE_BYTES];
    const size_t msg_cap = sizeof buf - SUFFIX_BYTES;
    if (!log_enabled(l))
        return;
    size_t start = put_prefix(buf, msg_cap, l, sub);
    va_list ap;
    va_start(ap, fmt);
    size_t want = vput(raw, 0, sizeof raw, fmt, ap);
    va_end(ap);
    /* A peer's string in the message: one line, printable UTF-8 only. */
    flatten(raw, fit(want, sizeof raw));
    size_t n = start + scape_text_clean(buf + start, msg_cap - start, raw, fit(want, sizeof raw));
    if (want >= sizeof raw || n + 1 >= msg_cap)
        memcpy(buf + n - 3, "...", 3);
    /* Where in the code a line comes from is for developers: shown at log
     * level debug only, so that users read the cause, not "(main.c:190)". */
    if (log_enabled(LOG_LVL_DEBUG)) {
        const char *base = file ? strrchr(file, '/') : NULL;
        n = fit(put(buf, n, sizeof buf - 1, " (%s:%d)", base ? base + 1 : file ? file : "?",
                    line),
                sizeof buf - 1);
    }
    buf[n++] = '\n';
    FILE *out = s_out ? s_out : stderr;
    /* A failed write of a log line has nowhere to be reported. */
    (void)fwrite(buf, 1, n, out);
    (void)fflush(out);
}
