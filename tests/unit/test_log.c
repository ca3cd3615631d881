/* test_log.c - level names, the line format, filtering before formatting and
 * whole lines from concurrent threads. */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <pthread.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "check_run.h"

#define STAMP "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z "
#define THREADS 8
#define LINES_PER_THREAD 500

/* The short host name, as the prefix shows it. */
static void short_host(char *buf, size_t len)
{
    ck_assert_int_eq(gethostname(buf, len), 0);
    buf[len - 1] = '\0';
    buf[strcspn(buf, ".")] = '\0';
}

/* Everything written to f so far. */
static char *slurp(FILE *f)
{
    static char text[1 << 16];
    ck_assert_int_eq(fflush(f), 0);
    rewind(f);
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    return text;
}

static int matches(const char *pattern, const char *s)
{
    regex_t re;
    ck_assert_int_eq(regcomp(&re, pattern, REG_EXTENDED | REG_NOSUB), 0);
    int ok = regexec(&re, s, 0, NULL, 0) == 0;
    regfree(&re);
    return ok;
}

START_TEST(level_names)
{
    const char *names[] = { "error", "warn", "info", "debug" };
    log_level l = LOG_LVL_INFO;
    for (int i = 0; i < 4; i++) {
        ck_assert_int_eq(log_level_parse(names[i], &l), SCAPE_OK);
        ck_assert_int_eq(l, i);
        ck_assert_str_eq(log_level_name((log_level)i), names[i]);
    }
    ck_assert_int_eq(LOG_LVL_ERROR, 0);
    ck_assert_int_eq(LOG_LVL_DEBUG, 3);
    l = LOG_LVL_WARN;
    ck_assert_int_eq(log_level_parse("INFO", &l), SCAPE_INVALID);
    ck_assert_str_eq(scape_last_error(), "unknown log level 'INFO' (error, warn, info, debug)");
    ck_assert_int_eq(l, LOG_LVL_WARN);
    ck_assert_int_eq(log_level_parse(NULL, &l), SCAPE_INVALID);
    ck_assert_str_eq(log_level_name((log_level)7), "?");
}
END_TEST

START_TEST(line_format)
{
    char host[64], want[1024];
    short_host(host, sizeof host);
    FILE *f = tmpfile();
    ck_assert_ptr_nonnull(f);
    log_init(3, LOG_LVL_DEBUG, f);
    /* Local time 5:30 away from UTC, so a local time stamp would show. */
    setenv("TZ", "XST-5:30", 1);
    tzset();
    time_t before = time(NULL);
    int line = __LINE__; LOG_INFO(SUB_CTRL, "hello %d", 42);
    LOG_WARN(SUB_COMM, "careful: %s", "x");
    LOG_ERROR(SUB_SHM, "bad");
    LOG_DEBUG(SUB_STATUS, "detail");
    time_t after = time(NULL);
    const char *text = slurp(f);
    snprintf(want, sizeof want,
             "^" STAMP "scaped\\[rank 3 %s\\] INFO  ctrl: hello 42 \\(test_log\\.c:%d\\)\n"
             STAMP "scaped\\[rank 3 %s\\] WARN  comm: careful: x \\(test_log\\.c:%d\\)\n"
             STAMP "scaped\\[rank 3 %s\\] ERROR shm: bad \\(test_log\\.c:%d\\)\n"
             STAMP "scaped\\[rank 3 %s\\] DEBUG status: detail \\(test_log\\.c:%d\\)\n$",
             host, line, host, line + 1, host, line + 2, host, line + 3);
    ck_assert_msg(matches(want, text), "got:\n%s", text);

    /* The time is UTC: the date and hour agree with gmtime around the call. */
    char lo[32], hi[32];
    struct tm tm;
    strftime(lo, sizeof lo, "%Y-%m-%dT%H:%M", gmtime_r(&before, &tm));
    strftime(hi, sizeof hi, "%Y-%m-%dT%H:%M", gmtime_r(&after, &tm));
    ck_assert_msg(strncmp(text, lo, strlen(lo)) == 0 || strncmp(text, hi, strlen(hi)) == 0,
                  "%.24s is not near %s", text, lo);
    fclose(f);
}
END_TEST

static int s_evaluated;

static int side_effect(void) { return ++s_evaluated; }

START_TEST(filtered_before_formatting)
{
    FILE *f = tmpfile();
    ck_assert_ptr_nonnull(f);
    log_init(0, LOG_LVL_WARN, f);
    s_evaluated = 0;
    LOG_INFO(SUB_MAIN, "%d", side_effect());
    LOG_DEBUG(SUB_MAIN, "%d", side_effect());
    ck_assert_int_eq(s_evaluated, 0);
    ck_assert_str_eq(slurp(f), "");
    ck_assert(!log_enabled(LOG_LVL_INFO));
    ck_assert(log_enabled(LOG_LVL_WARN));
    /* A direct call below the level writes nothing either. */
    log_msg(LOG_LVL_INFO, SUB_MAIN, __FILE__, __LINE__, "direct");
    ck_assert_str_eq(slurp(f), "");

    log_set_level(LOG_LVL_DEBUG);
    LOG_DEBUG(SUB_ENGINE, "now %d", side_effect());
    ck_assert_int_eq(s_evaluated, 1);
    ck_assert(matches("^" STAMP "scaped\\[rank 0 [^]]*\\] DEBUG engine: now 1 "
                      "\\(test_log\\.c:[0-9]+\\)\n$", slurp(f)));
    fclose(f);
}
END_TEST

START_TEST(one_line_per_call)
{
    FILE *f = tmpfile();
    ck_assert_ptr_nonnull(f);
    log_init(1, LOG_LVL_INFO, f);
    static char big[4096];
    memset(big, 'x', sizeof big - 1);
    LOG_INFO(SUB_CONFIG, "two\nlines\r%s", "here");
    LOG_WARN(SUB_CONFIG, "%s", big);
    LOG_ERROR(SUB_MAIN, "the cause");
    /* below level debug no line shows where in the code it was written */
    const char *text = slurp(f);
    ck_assert(matches("^" STAMP "scaped\\[rank 1 [^]]*\\] INFO  config: two lines here\n" STAMP
                      "scaped\\[rank 1 [^]]*\\] WARN  config: x+\\.\\.\\.\n" STAMP
                      "scaped\\[rank 1 [^]]*\\] ERROR main: the cause\n$",
                      text));
    ck_assert_uint_lt(strlen(text), 2 * 2048);
    fclose(f);
}
END_TEST

/* scape_text_clean: what a peer's bytes become in messages and log lines. */
START_TEST(text_clean_escapes_what_is_not_printable_utf8)
{
    static const struct {
        const char *in, *out;
    } cases[] = {
        { "plain ascii", "plain ascii" },
        { "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80", "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80" },
        { "tab\tnewline\n", "tab\tnewline\n" },
        { "esc\x1B[2Jbell\x07" "del\x7F", "esc\\x1B[2Jbell\\x07del\\x7F" },
        { "b\x80" "as", "b\\x80" "as" },                      /* a lone continuation byte */
        { "\xC0\xAF", "\\xC0\\xAF" },                    /* overlong '/' */
        { "\xE0\x80\xAF", "\\xE0\\x80\\xAF" },            /* overlong, 3 bytes */
        { "\xED\xA0\x80", "\\xED\\xA0\\x80" },            /* a surrogate */
        { "\xF4\x90\x80\x80", "\\xF4\\x90\\x80\\x80" },    /* above U+10FFFF */
        { "\xF5\xFF", "\\xF5\\xFF" },
        { "cut \xE2\x82", "cut \\xE2\\x82" },             /* a character cut short */
    };
    char out[128];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t n = scape_text_clean(out, sizeof out, cases[i].in, (size_t)-1);
        ck_assert_str_eq(out, cases[i].out);
        ck_assert_uint_eq(n, strlen(cases[i].out));
    }
    /* Explicit length: an embedded NUL is a control byte like any other. */
    scape_text_clean(out, sizeof out, "a\0b", 3);
    ck_assert_str_eq(out, "a\\x00b");
    /* A small buffer: never a split character or a split escape. */
    ck_assert_uint_eq(scape_text_clean(out, 5, "ab\xE2\x82\xAC", (size_t)-1), 2);
    ck_assert_str_eq(out, "ab");
    ck_assert_uint_eq(scape_text_clean(out, 6, "ab\xFF" "cd", (size_t)-1), 2);
    ck_assert_str_eq(out, "ab");
    ck_assert_uint_eq(scape_text_clean(out, 1, "abc", (size_t)-1), 0);
    ck_assert_str_eq(out, "");
    ck_assert(scape_text_is_clean("w.0 \xC3\xA9"));
    ck_assert(!scape_text_is_clean("w\n0"));
    ck_assert(!scape_text_is_clean("b\x80" "as"));
    /* The last-error buffer goes through it. */
    scape_set_error(SCAPE_INVALID, "tensor \"%s\"", "b\x80\x1B]0;x\x07");
    ck_assert_str_eq(scape_last_error(), "tensor \"b\\x80\\x1B]0;x\\x07\"");
}
END_TEST

START_TEST(log_lines_escape_peer_bytes)
{
    FILE *f = tmpfile();
    ck_assert_ptr_nonnull(f);
    log_init(0, LOG_LVL_INFO, f);
    LOG_INFO(SUB_CTRL, "trainer %s attached", "x\x1B[31mred\xFF");
    ck_assert(matches("^" STAMP "scaped\\[rank 0 [^]]*\\] INFO  ctrl: trainer "
                      "x\\\\x1B\\[31mred\\\\xFF attached\n$", slurp(f)));
    fclose(f);
}
END_TEST

static void *writer(void *arg)
{
    int t = (int)(size_t)arg;
    for (int i = 0; i < LINES_PER_THREAD; i++)
        LOG_INFO(SUB_COMM, "thread %d line %d padding %s", t, i, "................................");
    return NULL;
}

START_TEST(threads_never_mix_lines)
{
    FILE *f = tmpfile();
    ck_assert_ptr_nonnull(f);
    log_init(2, LOG_LVL_INFO, f);
    pthread_t th[THREADS];
    for (int t = 0; t < THREADS; t++)
        ck_assert_int_eq(pthread_create(&th[t], NULL, writer, (void *)(size_t)t), 0);
    for (int t = 0; t < THREADS; t++)
        ck_assert_int_eq(pthread_join(th[t], NULL), 0);
    ck_assert_int_eq(fflush(f), 0);
    rewind(f);
    int next[THREADS] = { 0 };
    char line[512];
    regex_t re;
    ck_assert_int_eq(regcomp(&re,
                             "^" STAMP "scaped\\[rank 2 [^]]*\\] INFO  comm: thread [0-9] line "
                             "[0-9]+ padding \\.{32}\n$",
                             REG_EXTENDED | REG_NOSUB),
                     0);
    while (fgets(line, sizeof line, f)) {
        ck_assert_msg(regexec(&re, line, 0, NULL, 0) == 0, "mixed: %s", line);
        int t, i;
        ck_assert_int_eq(sscanf(strstr(line, "thread"), "thread %d line %d", &t, &i), 2);
        ck_assert_int_eq(i, next[t]); /* each thread's lines in its own order */
        next[t]++;
    }
    regfree(&re);
    for (int t = 0; t < THREADS; t++)
        ck_assert_int_eq(next[t], LINES_PER_THREAD);
    fclose(f);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("log");
    TCase *tc = tcase_create("log");
    tcase_add_test(tc, level_names);
    tcase_add_test(tc, line_format);
    tcase_add_test(tc, filtered_before_formatting);
    tcase_add_test(tc, one_line_per_call);
    tcase_add_test(tc, threads_never_mix_lines);
    tcase_add_test(tc, text_clean_escapes_what_is_not_printable_utf8);
    tcase_add_test(tc, log_lines_escape_peer_bytes);
    suite_add_tcase(s, tc);
    return check_run(s);
}
