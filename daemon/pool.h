/* pool.h - a fork-join pool for the engine's data-parallel phases.
 *
 * pool_run hands items 0..n-1 to the calling thread and the pool's helper
 * threads, which claim them in order from a shared counter; it returns when
 * every claimed item is done.  Which thread runs an item varies from run to
 * run, so an item's result must not depend on it (the engine's items write
 * disjoint outputs): the outcome is then the same for any number of threads.
 * The first failure stops the claiming; its code is returned and its message
 * becomes the caller's last error.  One pool_run at a time per pool.
 */
#ifndef SCAPE_POOL_H
#define SCAPE_POOL_H

#include <stddef.h>

#include "scape_rc.h"

typedef struct pool pool;

/* item: which item; worker: 0 (the caller) .. pool_size - 1, for per-thread
 * scratch. */
typedef scape_rc (*pool_fn)(void *ctx, size_t item, int worker);

/* A pool of `threads` workers in all (1..POOL_MAX_THREADS), the caller
 * included: threads - 1 helper threads are started. */
#define POOL_MAX_THREADS 256
scape_rc pool_create(pool **out, int threads);
int pool_size(const pool *p);
/* Run fn on items 0..n-1; with one worker (or n <= 1) on the calling thread
 * alone, in order. */
scape_rc pool_run(pool *p, size_t n, pool_fn fn, void *ctx);
/* Stop and join the helpers; *p becomes NULL. */
void pool_destroy(pool **p);

#endif /* SCAPE_POOL_H */
