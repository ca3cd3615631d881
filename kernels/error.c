/* error.c - result-code names and the per-thread last-error buffer. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "scape_kernels.h"
#include "try.h"

static _Thread_local char s_last_error[1024];
static scape_trail_fn s_trail; /* the TRY trail's sink (NULL: none) */

static const char *const s_rc_names[SCAPE_RC_COUNT] = {
    [SCAPE_OK] = "OK",           [SCAPE_INVALID] = "INVALID",
    [SCAPE_NOMEM] = "NOMEM",     [SCAPE_SYSTEM] = "SYSTEM",
    [SCAPE_CUDA] = "CUDA",       [SCAPE_NCCL] = "NCCL",
    [SCAPE_ZMQ] = "ZMQ",         [SCAPE_PROTO] = "PROTO",
    [SCAPE_REMOTE] = "REMOTE",   [SCAPE_TIMEOUT] = "TIMEOUT",
    [SCAPE_UNSUPPORTED] = "UNSUPPORTED",
};

const char *scape_rc_name(scape_rc rc)
{
    if ((unsigned)rc >= SCAPE_RC_COUNT)
        return "UNKNOWN";
    return s_rc_names[rc];
}

const char *scape_last_error(void) { return s_last_error; }

void scape_clear_error(void) { s_last_error[0] = '\0'; }

void scape_set_trail(scape_trail_fn fn) { s_trail = fn; }

void scape_trail(scape_rc rc, const char *file, int line)
{
    if (s_trail)
        s_trail(rc, file, line);
}

/* Length of the well-formed UTF-8 character at s[0..n) (RFC 3629: no
 * overlong forms, no surrogates, nothing above U+10FFFF), 0 if there is none. */
static size_t utf8_char(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    size_t len;
    uint32_t cp, min;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        len = 2, cp = c & 0x1Fu, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF)
        len = 3, cp = c & 0x0Fu, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4)
        len = 4, cp = c & 0x07u, min = 0x10000;
    else
        return 0;
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3Fu);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return len;
}

size_t scape_text_clean(char *dst, size_t cap, const char *src, size_t len)
{
    const unsigned char *s = (const unsigned char *)src;
    if (len == (size_t)-1)
        len = src ? strlen(src) : 0;
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        size_t k = utf8_char(s + i, len - i);
        int plain = k > 1 || (k == 1 && ((s[i] >= 0x20 && s[i] != 0x7F) || s[i] == '\n' ||
                                         s[i] == '\t'));
        size_t need = plain ? k : 4;
        if (o + need + 1 > cap)
            break;
        if (plain) {
            memcpy(dst + o, s + i, k);
            i += k;
        } else {
            snprintf(dst + o, 5, "\\x%02X", s[i]);
            i += 1;
        }
        o += need;
    }
    dst[o] = '\0';
    return o;
}

int scape_text_is_clean(const char *s)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        size_t k = utf8_char(u + i, n - i);
        if (k == 0 || (k == 1 && (u[i] < 0x20 || u[i] == 0x7F)))
            return 0;
        i += k;
    }
    return 1;
}

scape_rc scape_set_error(scape_rc rc, const char *fmt, ...)
{
    char raw[sizeof s_last_error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof raw, fmt, ap);
    va_end(ap);
    scape_text_clean(s_last_error, sizeof s_last_error, raw, (size_t)-1);
    return rc;
}
