/* rank_threads.h - run one function per rank on its own thread, for the
 * suites that drive the local comm backend. */
#ifndef SCAPE_TEST_RANK_THREADS_H
#define SCAPE_TEST_RANK_THREADS_H

#include <pthread.h>
#include <stdlib.h>

#include "comm.h"

typedef struct rank_arg {
    int rank, nranks;
    comm_t *comm;
    void *ctx;        /* shared test context */
    scape_rc rc;      /* what the rank function returned */
    char err[512];    /* its last error, if any */
} rank_arg;

typedef scape_rc (*rank_fn)(rank_arg *a);

typedef struct rank_thunk {
    rank_fn fn;
    rank_arg *arg;
} rank_thunk;

static void *rank_main(void *p)
{
    rank_thunk *t = p;
    t->arg->rc = t->fn(t->arg);
    if (t->arg->rc != SCAPE_OK) {
        const char *m = scape_last_error();
        size_t i = 0;
        for (; m[i] && i + 1 < sizeof t->arg->err; i++)
            t->arg->err[i] = m[i];
        t->arg->err[i] = '\0';
    }
    return NULL;
}

/* Create a local group of R ranks, run fn on each in its own thread, destroy
 * the group.  args receives each rank's result.  Returns 0 on success. */
static int run_ranks(int R, rank_fn fn, void *ctx, rank_arg *args)
{
    if (R < 1 || R > 4096)
        return 1;
    comm_t **comms = calloc((size_t)R, sizeof *comms);
    pthread_t *th = calloc((size_t)R, sizeof *th);
    rank_thunk *tk = calloc((size_t)R, sizeof *tk);
    int bad = !comms || !th || !tk || comm_local_create(R, comms) != SCAPE_OK;
    for (int r = 0; !bad && r < R; r++) {
        args[r] = (rank_arg){ .rank = r, .nranks = R, .comm = comms[r], .ctx = ctx };
        tk[r] = (rank_thunk){ fn, &args[r] };
        bad = pthread_create(&th[r], NULL, rank_main, &tk[r]) != 0;
    }
    for (int r = 0; !bad && r < R; r++)
        pthread_join(th[r], NULL);
    for (int r = 0; comms && r < R; r++)
        comm_destroy(&comms[r]);
    free(comms);
    free(th);
    free(tk);
    return bad;
}

#endif /* SCAPE_TEST_RANK_THREADS_H */
