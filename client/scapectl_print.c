/* scapectl_print.c - the one printer behind every subcommand's output:
 * aligned `Label : value` lines for people, one JSON object for programs;
 * and the human units the text uses. */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "scapectl.h"

/* ---- JSON strings ------------------------------------------------------------ */

/* Length of the well-formed UTF-8 sequence at s, or 0 if it is not one. */
static size_t utf8_len(const unsigned char *s)
{
    static const uint32_t least[] = { 0, 0, 0x80, 0x800, 0x10000 };
    size_t n = s[0] < 0x80 ? 1 : s[0] >= 0xF8 ? 0 : s[0] >= 0xF0 ? 4 : s[0] >= 0xE0 ? 3
             : s[0] >= 0xC0 ? 2 : 0;
    if (n <= 1)
        return n;
    uint32_t cp = s[0] & (0x7Fu >> n);
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = cp << 6 | (s[i] & 0x3Fu);
    }
    return cp >= least[n] && cp <= 0x10FFFF && (cp < 0xD800 || cp > 0xDFFF) ? n : 0;
}

/* The letter of c's two-character JSON escape, or 0. */
static char short_escape(unsigned char c)
{
    switch (c) {
    case '"': return '"';
    case '\\': return '\\';
    case '\b': return 'b';
    case '\f': return 'f';
    case '\n': return 'n';
    case '\r': return 'r';
    case '\t': return 't';
    default: return 0;
    }
}

/* The characters of s, escaped for JSON or, for a terminal, with control
 * characters as '?' so that a peer's string cannot drive the terminal;
 * bytes that are not UTF-8 become U+FFFD either way. */
static void put_chars(FILE *f, const char *s, int json)
{
    const unsigned char *u = (const unsigned char *)s;
    while (*u) {
        size_t n = utf8_len(u);
        int control = n == 1 && (*u < 0x20 || *u == 0x7F);
        if (n == 0)
            fputs(json ? "\\ufffd" : "\xef\xbf\xbd", f);
        else if (json && n == 1 && short_escape(*u))
            fprintf(f, "\\%c", short_escape(*u));
        else if (json && control)
            fprintf(f, "\\u%04x", *u);
        else if (control)
            fputc('?', f);
        else
            fwrite(u, 1, n, f);
        u += n ? n : 1;
    }
}

static void json_string(FILE *f, const char *s)
{
    fputc('"', f);
    put_chars(f, s, 1);
    fputc('"', f);
}

/* ---- members --------------------------------------------------------------------- */

/* Write the separator and key of a JSON member; 0 if it is not in the JSON. */
static int json_member(printer *p, const char *key)
{
    int in_list = p->closer[p->depth] == ']';
    if (!p->json || !p->shown[p->depth] || (key == NULL && !in_list))
        return 0;
    if (p->members[p->depth]++)
        fputc(',', p->out);
    if (!in_list) {
        json_string(p->out, key);
        fputc(':', p->out);
    }
    return 1;
}

static void text_member(printer *p, const char *label, const char *value)
{
    if (p->json || label == NULL)
        return;
    if (p->row) {
        fprintf(p->out, "%s%s%s", p->row++ > 1 ? ", " : "", label, *label ? " " : "");
        put_chars(p->out, value, 0);
        return;
    }
    int indent = p->indents[p->depth];
    fprintf(p->out, "%*s%-*s :%s", indent, "", PR_WIDTH - indent, label, *value ? " " : "");
    put_chars(p->out, value, 0);
    fputc('\n', p->out);
}

static void push(printer *p, const char *key, const char *label, char open)
{
    int shown = json_member(p, key);
    if (shown)
        fputc(open, p->out);
    int indent = p->indents[p->depth] + (label != NULL ? 2 : 0);
    if (p->depth + 1 < PR_MAX_DEPTH)
        p->depth++;
    p->shown[p->depth] = shown;
    p->members[p->depth] = 0;
    p->closer[p->depth] = open == '{' ? '}' : ']';
    p->indents[p->depth] = indent;
}

void pr_init(printer *p, FILE *out, int json)
{
    *p = (printer){ .out = out, .json = json };
    p->closer[0] = '}';
    p->shown[0] = json;
    if (json)
        fputc('{', out);
}

void pr_done(printer *p)
{
    if (p->json)
        fputs("}\n", p->out);
}

void pr_open(printer *p, const char *key, const char *label, const char *summary)
{
    text_member(p, label, summary ? summary : "");
    push(p, key, label, '{');
}

void pr_list(printer *p, const char *key, const char *label, size_t n)
{
    char b[24];
    snprintf(b, sizeof b, "%zu", n);
    text_member(p, label, b);
    push(p, key, label, '[');
}

void pr_row(printer *p, const char *key, const char *label)
{
    if (!p->json && label != NULL) {
        int indent = p->indents[p->depth];
        fprintf(p->out, "%*s%-*s : ", indent, "", PR_WIDTH - indent, label);
        p->row = 1;
    }
    push(p, key, NULL, '{');
}

void pr_close(printer *p)
{
    if (p->shown[p->depth])
        fputc(p->closer[p->depth], p->out);
    if (p->row)
        fputc('\n', p->out);
    p->row = 0;
    if (p->depth > 0)
        p->depth--;
}

void pr_str(printer *p, const char *key, const char *label, const char *v)
{
    if (json_member(p, key)) {
        if (v != NULL)
            json_string(p->out, v);
        else
            fputs("null", p->out);
    }
    text_member(p, label, v != NULL ? v : "-");
}

void pr_bool(printer *p, const char *key, const char *label, int v)
{
    if (json_member(p, key))
        fputs(v ? "true" : "false", p->out);
    text_member(p, label, v ? "yes" : "no");
}

void pr_uint(printer *p, const char *key, const char *label, uint64_t v, const char *text)
{
    char b[24];
    snprintf(b, sizeof b, "%" PRIu64, v);
    if (json_member(p, key))
        fputs(b, p->out);
    text_member(p, label, text ? text : b);
}

void pr_real(printer *p, const char *key, const char *label, double v, const char *text)
{
    char b[40];
    if (json_member(p, key))
        fputs(isfinite(v) ? fmt_real(b, sizeof b, v) : "null", p->out);
    if (text == NULL)
        snprintf(b, sizeof b, "%.6g", v);
    text_member(p, label, text ? text : b);
}

void pr_null(printer *p, const char *key, const char *label)
{
    if (json_member(p, key))
        fputs("null", p->out);
    text_member(p, label, "-");
}

/* ---- human units ------------------------------------------------------------------- */

const char *fmt_real(char *buf, size_t len, double v)
{
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, len, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            break;
    }
    return buf;
}

const char *fmt_bytes(char *buf, size_t len, uint64_t v)
{
    static const char *const unit[] = { "KiB", "MiB", "GiB", "TiB" };
    if (v < 1024) {
        snprintf(buf, len, "%" PRIu64 " B", v);
        return buf;
    }
    double x = (double)v / 1024;
    size_t u = 0;
    for (; x >= 1024 && u + 1 < sizeof unit / sizeof unit[0]; u++)
        x /= 1024;
    snprintf(buf, len, "%.1f %s", x, unit[u]);
    return buf;
}

const char *fmt_ms(char *buf, size_t len, double seconds)
{
    snprintf(buf, len, "%.3f ms", 1e3 * seconds);
    return buf;
}

const char *fmt_uptime(char *buf, size_t len, uint64_t ms)
{
    uint64_t s = ms / 1000;
    if (ms < 1000)
        snprintf(buf, len, "%" PRIu64 " ms", ms);
    else if (s < 60)
        snprintf(buf, len, "%.1f s", (double)ms / 1e3);
    else
        snprintf(buf, len, "%" PRIu64 "h %02" PRIu64 "m %02" PRIu64 "s", s / 3600,
                 s / 60 % 60, s % 60);
    return buf;
}

const char *fmt_count(char *buf, size_t len, uint64_t v)
{
    static const char unit[] = "kMGTP";
    double x = (double)v;
    size_t u = 0;
    if (v < 10000) {
        snprintf(buf, len, "%" PRIu64, v);
        return buf;
    }
    for (x /= 1e3; x >= 1e3 && u + 2 < sizeof unit; u++)
        x /= 1e3;
    snprintf(buf, len, "%" PRIu64 " (%.2f %c)", v, x, unit[u]);
    return buf;
}

const char *fmt_percent(char *buf, size_t len, double frac)
{
    snprintf(buf, len, "%.3f %%", 1e2 * frac);
    return buf;
}
