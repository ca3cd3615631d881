/* pool.c - see pool.h.  Helpers sleep on a condition variable between runs;
 * a run bumps a generation number, everyone claims items from an atomic
 * counter, and the last one out signals the caller. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

struct pool {
    int threads;
    pthread_t *tid;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    unsigned long gen;     /* bumped by every run */
    int stop;
    int busy;              /* helpers still in the current run */

    /* the current run */
    pool_fn fn;
    void *ctx;
    size_t n;
    atomic_size_t next;    /* the next unclaimed item */
    atomic_int failed;
    scape_rc rc;           /* the first failure, under mu */
    char msg[512];
};

typedef struct helper_arg {
    pool *p;
    int worker;
} helper_arg;

static void claim_items(pool *p, int worker)
{
    for (;;) {
        if (atomic_load_explicit(&p->failed, memory_order_relaxed))
            return;
        size_t i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (i >= p->n)
            return;
        scape_rc rc = p->fn(p->ctx, i, worker);
        if (rc != SCAPE_OK) {
            pthread_mutex_lock(&p->mu);
            if (!atomic_load(&p->failed)) {
                p->rc = rc;
                snprintf(p->msg, sizeof p->msg, "%s", scape_last_error());
                atomic_store(&p->failed, 1);
            }
            pthread_mutex_unlock(&p->mu);
            return;
        }
    }
}

static void *helper_main(void *arg)
{
    helper_arg a = *(helper_arg *)arg;
    free(arg);
    pool *p = a.p;
    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->gen == seen)
            pthread_cond_wait(&p->go, &p->mu);
        if (p->stop)
            break;
        seen = p->gen;
        pthread_mutex_unlock(&p->mu);
        claim_items(p, a.worker);
        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

scape_rc pool_create(pool **out, int threads)
{
    if (out == NULL)
        return scape_set_error(SCAPE_INVALID, "pool: NULL argument");
    *out = NULL;
    if (threads < 1 || threads > POOL_MAX_THREADS)
        return scape_set_error(SCAPE_INVALID, "engine threads %d outside 1..%d", threads,
                               POOL_MAX_THREADS);
    pool *p = calloc(1, sizeof *p);
    if (p == NULL)
        return scape_set_error(SCAPE_NOMEM, "pool: out of memory");
    p->threads = 1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    p->tid = calloc((size_t)threads, sizeof *p->tid);
    if (p->tid == NULL) {
        pool_destroy(&p);
        return scape_set_error(SCAPE_NOMEM, "pool: out of memory");
    }
    for (int w = 1; w < threads; w++) {
        helper_arg *a = malloc(sizeof *a);
        if (a)
            *a = (helper_arg){ p, w };
        int err = a ? pthread_create(&p->tid[w], NULL, helper_main, a) : -1;
        if (err == 0) {
            p->threads++;
            continue;
        }
        free(a);
        pool_destroy(&p);
        return scape_set_error(SCAPE_SYSTEM, "pool: cannot start engine thread %d of %d%s%s",
                               w + 1, threads, err > 0 ? ": " : "",
                               err > 0 ? strerror(err) : "");
    }
    *out = p;
    return SCAPE_OK;
}

int pool_size(const pool *p) { return p ? p->threads : 1; }

scape_rc pool_run(pool *p, size_t n, pool_fn fn, void *ctx)
{
    if (p == NULL || p->threads == 1 || n <= 1) {
        for (size_t i = 0; i < n; i++) {
            scape_rc rc = fn(ctx, i, 0);
            if (rc != SCAPE_OK)
                return rc;
        }
        return SCAPE_OK;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    atomic_store(&p->next, 0);
    atomic_store(&p->failed, 0);
    p->rc = SCAPE_OK;
    p->busy = p->threads - 1;
    p->gen++;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    claim_items(p, 0);
    pthread_mutex_lock(&p->mu);
    while (p->busy > 0)
        pthread_cond_wait(&p->done, &p->mu);
    scape_rc rc = p->rc;
    pthread_mutex_unlock(&p->mu);
    if (rc != SCAPE_OK)
        scape_set_error(rc, "%s", p->msg);
    return rc;
}

void pool_destroy(pool **pp)
{
    pool *p = pp ? *pp : NULL;
    if (p == NULL)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int w = 1; w < p->threads; w++)
        pthread_join(p->tid[w], NULL);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->go);
    pthread_mutex_destroy(&p->mu);
    free(p->tid);
    free(p);
    *pp = NULL;
}
