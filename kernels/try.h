/* try.h - propagate a failed scape_rc to the caller (the message is already
 * in the last-error buffer). */
#ifndef SCAPE_TRY_H
#define SCAPE_TRY_H

#include "scape_rc.h"

#define TRY(call)                                                              \
    do {                                                                       \
        scape_rc rc_ = (call);                                                 \
        if (rc_ != SCAPE_OK)                                                   \
            return rc_;                                                        \
    } while (0)

#endif /* SCAPE_TRY_H */
