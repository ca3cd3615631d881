/* log.h - scaped's log lines, by level and subsystem.
 *
 * Every line reads
 *   2026-11-29T10:20:30.123Z scaped[rank 0 host] INFO  ctrl: message
 * (UTC with milliseconds); at level debug every line ends with " (file.c:123)"
 * too, the place in the code that wrote it.
 * A line goes out in one write, so lines of different threads never mix.
 * The LOG_* macros test the level before their arguments are evaluated.
 */
#ifndef SCAPE_LOG_H
#define SCAPE_LOG_H

#include <stdio.h>

#include "enums.h" /* eng_enum: the level names */
#include "scape_rc.h"

typedef enum log_level {
    LOG_LVL_ERROR = 0,
    LOG_LVL_WARN,
    LOG_LVL_INFO,
    LOG_LVL_DEBUG
} log_level;

typedef enum log_sub {
    SUB_MAIN = 0,
    SUB_CONFIG,
    SUB_CTRL,
    SUB_ENGINE,
    SUB_COMM,
    SUB_SHM,
    SUB_STATUS,
    SUB_COUNT
} log_sub;

/* Set rank and level, record the host name; out NULL = stderr.  Call before
 * other threads log; out must stay open while anything logs. */
void log_init(int rank, log_level level, FILE *out);
/* Change the level; safe while other threads log. */
void log_set_level(log_level level);
/* Non-zero when lines at level are written. */
int log_enabled(log_level level);
/* The levels' names: error, warn, info, debug. */
extern const eng_enum log_level_names[];
/* "error", "warn", "info" or "debug" into *out; INVALID otherwise. */
scape_rc log_level_parse(const char *s, log_level *out);
/* The name log_level_parse takes for l ("?" when out of range). */
const char *log_level_name(log_level l);
/* Write one line if l is enabled; file:line is shown at level debug.
 * Newlines in the message become spaces, so one call is one line. */
void log_msg(log_level l, log_sub sub, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

#define LOG_AT_(l, sub, ...)                                                   \
    do {                                                                       \
        if (log_enabled(l))                                                    \
            log_msg((l), (sub), __FILE__, __LINE__, __VA_ARGS__);              \
    } while (0)

#define LOG_ERROR(sub, ...) LOG_AT_(LOG_LVL_ERROR, sub, __VA_ARGS__)
#define LOG_WARN(sub, ...) LOG_AT_(LOG_LVL_WARN, sub, __VA_ARGS__)
#define LOG_INFO(sub, ...) LOG_AT_(LOG_LVL_INFO, sub, __VA_ARGS__)
#define LOG_DEBUG(sub, ...) LOG_AT_(LOG_LVL_DEBUG, sub, __VA_ARGS__)

#endif /* SCAPE_LOG_H */
