/* try.h - propagate a failed scape_rc to the caller (the message is already
 * in the last-error buffer), leaving a trail: each level a failure passes
 * through reports its file:line to the trail sink (scape_set_trail), as
 * NCCLCHECK does; the daemon logs them at log_level debug.  A success costs
 * only the comparison. */
#ifndef SCAPE_TRY_H
#define SCAPE_TRY_H

#include "scape_rc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where the trail goes: called once per level with the failing code and the
 * TRY's place.  NULL (the default): nowhere. */
typedef void (*scape_trail_fn)(scape_rc rc, const char *file, int line);
/* Install the process's trail sink (not thread-safe: once, at start-up). */
void scape_set_trail(scape_trail_fn fn);
/* TRY's failure path: hand (rc, file, line) to the sink, if any. */
void scape_trail(scape_rc rc, const char *file, int line);

#ifdef __cplusplus
}
#endif

#define TRY(call)                                                              \
    do {                                                                       \
        scape_rc rc_ = (call);                                                 \
        if (rc_ != SCAPE_OK) {                                                 \
            scape_trail(rc_, __FILE__, __LINE__);                              \
            return rc_;                                                        \
        }                                                                      \
    } while (0)

#endif /* SCAPE_TRY_H */
