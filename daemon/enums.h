/* enums.h - the names of an enum's values, for keys and log levels.
 *
 * A leaf: the engine's keys, config.c's own keys and the log levels all
 * name their values here, so that none of them depends on another for it.
 */
#ifndef SCAPE_ENUMS_H
#define SCAPE_ENUMS_H

#include "scape_rc.h"

/* An enum's names, as Redis' configEnum: {name, value} pairs ending in
 * {NULL, 0}.  One lookup, eng_enum_parse, serves every enum. */
typedef struct eng_enum {
    const char *name;
    int value;
} eng_enum;

/* s's value in names; else INVALID, "unknown WHAT 's' (a, b, c)". */
scape_rc eng_enum_parse(const eng_enum *names, const char *what, const char *s, int *out);
/* value's name in names; "?" when it has none. */
const char *eng_enum_name(const eng_enum *names, int value);

#endif /* SCAPE_ENUMS_H */
