/* engine_step.c - the phases of one step (docs/algorithm.md, "Step t"), written
 * once for every executor (exec.h).
 *
 * the mask (all ones in warm-up and for the dense optimizers, else the lagged
 * one, waiting for its all-gather) -> pack a = G + e on the mask, summing the
 * local trainers' gradients on the way -> statistics and exact top-k of the
 * next mask for the owned tensors, from the a just packed; its all-gather
 * starts at once -> one reduction collective -> update on the mask ->
 * (sharded) all-gather of the updated values -> write them into every
 * trainer's buffer.  With defer_select a sparse step keeps only what the
 * selection needs before the update changes m, and the selection runs after
 * the write-back, in eng_step_finish.
 *
 * A dense step packs in place in the dense buffer (the residual, kept in
 * comm order, where it is the executor's working memory) and marks the
 * residual zero (e_stale).  A sparse step packs into `send` (K_cap floats)
 * and gathers the new parameters in `upd` (K_cap floats).  Sharded
 * collectives run in place: each rank's segment is its own part of the same
 * buffer.
 *
 * Collectives run on the executor's memory when the comm can take it (host
 * memory; device memory on a comm with a device stream); otherwise, for the
 * cuda executor on the host or local backend, through host copies (bounce).
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine_internal.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- collectives on the executor's memory -------------------------------- */

/* The comm reads and writes the executor's vectors itself. */
static int comm_direct(const eng_t *e)
{
    return e->x->host_memory || comm_device_stream(e->comm) != NULL;
}

/* A host buffer of at least `bytes` in *buf (grown, never shrunk). */
static scape_rc bounce_buf(void **buf, size_t *cap, size_t bytes)
{
    if (bytes <= *cap)
        return SCAPE_OK;
    void *p = realloc(*buf, bytes);
    if (p == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: cannot allocate %zu bytes of host "
                               "staging for a collective", bytes);
    *buf = p;
    *cap = bytes;
    return SCAPE_OK;
}

/* Device `bytes` at src into the bounce buffer, once the work that writes
 * them is done. */
static scape_rc bounce_down(eng_t *e, const void *src, size_t bytes)
{
    TRY(bounce_buf(&e->bounce, &e->bounce_cap, bytes ? bytes : 1));
    TRY(e->x->ops->copy(e->x, e->bounce, src, bytes));
    e->last.bounce_bytes += bytes;
    return e->x->ops->sync(e->x);
}

/* The collective's result back from the bounce buffer. */
static scape_rc bounce_up(eng_t *e, void *dst, const void *src, size_t bytes)
{
    e->last.bounce_bytes += bytes;
    return e->x->ops->copy(e->x, dst, src, bytes);
}

static scape_rc x_allreduce(eng_t *e, float *buf, size_t n, int bf16)
{
    if (comm_direct(e))
        return comm_allreduce_sum_wire(e->comm, buf, n, bf16);
    TRY(bounce_down(e, buf, n * sizeof *buf));
    TRY(comm_allreduce_sum_wire(e->comm, e->bounce, n, bf16));
    return bounce_up(e, buf, e->bounce, n * sizeof *buf);
}

/* Reduce-scatter in place: recv is this rank's segment of send. */
static scape_rc x_reduce_scatter(eng_t *e, float *send, float *recv, const size_t *counts,
                                 int bf16)
{
    if (comm_direct(e))
        return comm_reduce_scatter_sum_wire(e->comm, send, recv, counts, bf16);
    size_t total = 0;
    for (int r = 0; r < e->comm->size; r++)
        total += counts[r];
    TRY(bounce_down(e, send, total * sizeof *send));
    float *hs = e->bounce, *hr = hs + (recv - send);
    TRY(comm_reduce_scatter_sum_wire(e->comm, hs, hr, counts, bf16));
    return bounce_up(e, recv, hr, counts[e->rank] * sizeof *recv);
}

/* All-gather in place: send is this rank's place in recv. */
static scape_rc x_allgather(eng_t *e, const void *send, void *recv, const size_t *counts)
{
    if (comm_direct(e))
        return comm_allgather(e->comm, send, recv, counts);
    size_t total = 0, own = (size_t)((const char *)send - (const char *)recv);
    for (int r = 0; r < e->comm->size; r++)
        total += counts[r];
    TRY(bounce_down(e, recv, total));
    char *h = e->bounce;
    TRY(comm_allgather(e->comm, h + own, h, counts));
    return bounce_up(e, recv, h, total);
}

/* The lagged mask all-gather: started here, finished by x_iallgather_wait;
 * through the bounce, this rank's code goes down first and the gathered
 * codes come up at the wait. */
static scape_rc x_iallgather(eng_t *e, const void *send, void *recv, const size_t *counts)
{
    if (comm_direct(e))
        return comm_iallgather(e->comm, send, recv, counts);
    size_t own = (size_t)((const char *)send - (const char *)recv);
    TRY(bounce_buf(&e->mbounce, &e->mbounce_cap, e->code_total ? e->code_total : 1));
    TRY(e->x->ops->copy(e->x, (char *)e->mbounce + own, send, counts[e->rank]));
    e->last.bounce_bytes += counts[e->rank];
    TRY(e->x->ops->sync(e->x));
    char *h = e->mbounce;
    return comm_iallgather(e->comm, h + own, h, counts);
}

static scape_rc x_iallgather_wait(eng_t *e)
{
    TRY(comm_iallgather_wait(e->comm));
    if (comm_direct(e))
        return SCAPE_OK;
    return bounce_up(e, e->a.code_all, e->mbounce, e->code_total);
}

scape_rc eng_broadcast(eng_t *e, void *buf, size_t bytes, int root)
{
    if (comm_direct(e))
        return comm_broadcast(e->comm, buf, bytes, root);
    TRY(bounce_down(e, buf, bytes));
    TRY(comm_broadcast(e->comm, e->bounce, bytes, root));
    return bounce_up(e, buf, e->bounce, bytes);
}

scape_rc eng_gather_shards(eng_t *e, const float *own, float *whole)
{
    float *mine = whole + e->p->shard[e->rank].pos0;
    TRY(e->x->ops->copy(e->x, mine, own, e->a.state_len * sizeof(float)));
    for (int r = 0; r < e->comm->size; r++)
        e->counts[r] = e->p->shard[r].len * sizeof(float);
    return x_allgather(e, mine, whole, e->counts);
}

/* ---- the mask ---------------------------------------------------------------- */

/* Rank r's delta (mask_deltas): applied on the host to its shard of the
 * last mask, the result put in place in mask_next. */
static scape_rc apply_delta(eng_t *e, int r, const uint32_t *body, size_t nbytes)
{
    const plan_shard *sh = &e->p->shard[r];
    if (e->a.mask_cur == NULL)
        return scape_set_error(SCAPE_PROTO, "mask from rank %d: a delta, but there is no "
                               "last mask to apply it to", r);
    const void *pv = NULL;
    TRY(exec_view(e->x, e->a.mask_cur + sh->word0, sh->words * 4, &pv));
    uint32_t *host = e->x->host_memory ? e->a.mask_next + sh->word0
                                       : malloc(sh->words ? sh->words * 4 : 4);
    scape_rc rc = host ? mdelta_decode(e->p, sh->first, sh->count, pv, body, nbytes, host, r)
                       : scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    exec_view_free(e->x, pv);
    if (rc == SCAPE_OK && !e->x->host_memory)
        rc = eng_upload(e, e->a.mask_next + sh->word0, host, sh->words * 4);
    if (!e->x->host_memory)
        free(host);
    return rc;
}

/* Rank r's code in the gathered codes at `code` (nbytes) into mask_next: the
 * fixed code straight, or with mask_deltas the form word first. */
static scape_rc decode_rank(eng_t *e, int r, const uint32_t *code, const uint32_t *host,
                            size_t nbytes)
{
    const plan_shard *sh = &e->p->shard[r];
    if (!e->cfg.mask_deltas)
        return e->x->ops->decode(e->x, sh->first, sh->count, code, nbytes,
                                 e->a.mask_next + sh->word0, 0, r);
    if (nbytes < 4)
        return scape_set_error(SCAPE_PROTO, "mask from rank %d: %zu bytes, no form word", r,
                               nbytes);
    if (host[0] == ENG_MASK_FULL)
        return e->x->ops->decode(e->x, sh->first, sh->count, code + 1, nbytes - 4,
                                 e->a.mask_next + sh->word0, 0, r);
    if (host[0] == ENG_MASK_DELTA)
        return apply_delta(e, r, host + 1, nbytes - 4);
    return scape_set_error(SCAPE_PROTO, "mask from rank %d: unknown form %#x", r,
                           (unsigned)host[0]);
}

scape_rc eng_mask_finish(eng_t *e, double *waited)
{
    if (waited)
        *waited = 0.0;
    if (!e->mask_pending)
        return SCAPE_OK;
    double t0 = now_s();
    TRY(x_iallgather_wait(e));
    if (waited)
        *waited = now_s() - t0;
    e->mask_pending = 0;
    /* with deltas the form words (and deltas) are read on the host */
    const void *hv = NULL;
    if (e->cfg.mask_deltas)
        TRY(exec_view(e->x, e->a.code_all, e->code_total, &hv));
    const uint32_t *host = hv;
    size_t off = 0;
    scape_rc rc = SCAPE_OK;
    for (int r = 0; rc == SCAPE_OK && r < e->comm->size; off += e->gcounts[r], r++)
        if (r != e->rank) /* its bits were selected straight into mask_next */
            rc = decode_rank(e, r, e->a.code_all + off / 4, host ? host + off / 4 : NULL,
                             e->gcounts[r]);
    exec_view_free(e->x, hv);
    if (rc != SCAPE_OK) {
        /* M_{t+1} is half written and the ranks no longer agree on it:
         * no further step may use it (outside eng_step, e.g. from a
         * checkpoint, nothing else would say so). */
        e->broken = 1;
        return rc;
    }
    return SCAPE_OK;
}

/* SCAPE: finish the lagged all-gather; M_t is all ones (NULL) in warm-up. */
static scape_rc scape_mask(eng_t *e, uint64_t t)
{
    if (e->mask_pending) {
        double waited;
        TRY(eng_mask_finish(e, &waited));
        double life = now_s() - e->mask_started;
        e->last.mask_overlap = life > 0.0 ? 1.0 - waited / life : 1.0;
    }
    const uint32_t *prev = e->a.mask_cur;
    if (t <= e->cfg.warmup || !eng_scape_masks(e)) {
        e->a.mask_cur = NULL;
    } else {
        e->a.mask_cur = e->a.mask_next;
        e->a.mask_next = e->a.mask_next == e->a.mask_buf[0] ? e->a.mask_buf[1] : e->a.mask_buf[0];
        /* this step's traffic includes the all-gather that brought its mask */
        memcpy(e->used_iag, e->next_iag, sizeof e->used_iag);
        e->last.mask_bytes = e->used_iag[1];
    }
    memset(e->next_iag, 0, sizeof e->next_iag);
    if (prev && e->a.mask_cur && e->early_churned && e->early_mask == e->a.mask_cur)
        e->last.mask_churn = e->early_churn; /* measured by the first early pack */
    else if (prev && e->a.mask_cur)
        TRY(e->x->ops->churn(e->x, e->a.mask_cur, prev));
    return SCAPE_OK;
}

/* mask_deltas: this rank's code for M_{t+1}, the fixed code or the delta
 * from M_t, whichever is smaller, after a form word; the sizes are
 * all-gathered first (8 bytes a rank), so every rank knows where each code
 * lands.  Built on the host; *own gets where it went in code_all. */
static scape_rc delta_code(eng_t *e, uint32_t **own)
{
    const plan_shard *me = &e->p->shard[e->rank];
    const void *nv = NULL, *pv = NULL;
    size_t full = e->code_bytes[e->rank], delta = SIZE_MAX;
    TRY(exec_view(e->x, e->a.mask_next + me->word0, me->words * 4, &nv));
    scape_rc rc = e->a.mask_cur ? exec_view(e->x, e->a.mask_cur + me->word0, me->words * 4, &pv)
                              : SCAPE_OK;
    if (rc == SCAPE_OK && pv)
        delta = mdelta_bytes(e->p, me->first, me->count, pv, nv);
    /* mask_deltas 2 (tests): a delta whenever there is a last mask */
    int use_delta = pv && (delta < full || e->cfg.mask_deltas == 2);
    e->dhost[0] = use_delta ? ENG_MASK_DELTA : ENG_MASK_FULL;
    if (rc == SCAPE_OK)
        rc = use_delta ? mdelta_encode(e->p, me->first, me->count, pv, nv, e->dhost + 1)
                       : mcode_encode(e->p, me->first, me->count, nv, e->dhost + 1);
    exec_view_free(e->x, nv);
    exec_view_free(e->x, pv);
    TRY(rc);
    uint64_t mine = 4 + (use_delta ? delta : full);
    for (int r = 0; r < e->comm->size; r++)
        e->counts[r] = sizeof mine;
    TRY(comm_allgather(e->comm, &mine, e->dsizes, e->counts));
    e->code_total = 0;
    for (int r = 0; r < e->comm->size; r++) {
        if (e->dsizes[r] < 4 || e->dsizes[r] > 4 + e->dmax[r] || e->dsizes[r] % 4)
            return scape_set_error(SCAPE_PROTO, "mask from rank %d: a code of %llu bytes "
                                   "(its shard's fixed code has %zu, a code at most %zu)",
                                   r, (unsigned long long)e->dsizes[r], e->code_bytes[r],
                                   4 + e->dmax[r]);
        if (r == e->rank)
            e->code_off = e->code_total;
        e->dcounts[r] = (size_t)e->dsizes[r];
        e->code_total += e->dcounts[r];
    }
    e->gcounts = e->dcounts;
    *own = e->a.code_all + e->code_off / 4;
    return e->x->host_memory ? (memcpy(*own, e->dhost, mine), SCAPE_OK)
                             : eng_upload(e, *own, e->dhost, mine);
}

/* SCAPE: this rank's bits of M_{t+1} (the executor's selection) go into
 * its place of the gathered code, whose all-gather starts at once and is
 * waited for at the next step. */
static scape_rc scape_select(eng_t *e)
{
    const plan *p = e->p;
    const plan_shard *me = &p->shard[e->rank];
    TRY(eng_mask_density(e, e->sel_step)); /* k_l of the mask selected now */
    TRY(e->x->ops->select(e->x));
    /* The own bits go straight into M_{t+1}'s words (the decode rewrites them
     * the same) and the code into this rank's place of the gathered code. */
    uint32_t *own = e->a.code_all + e->code_off / 4;
    if (e->cfg.mask_deltas)
        TRY(delta_code(e, &own));
    else
        TRY(e->x->ops->encode(e->x, me->first, me->count, e->a.mask_next + me->word0, own));
    const comm_stats *cs = &e->comm->stats;
    uint64_t before[3] = { cs->calls[COMM_IALLGATHER], cs->bytes[COMM_IALLGATHER],
                           cs->wire_bytes[COMM_IALLGATHER] };
    TRY(x_iallgather(e, own, e->a.code_all, e->gcounts));
    e->next_iag[0] = cs->calls[COMM_IALLGATHER] - before[0];
    e->next_iag[1] = cs->bytes[COMM_IALLGATHER] - before[1];
    e->next_iag[2] = cs->wire_bytes[COMM_IALLGATHER] - before[2];
    e->mask_pending = 1;
    e->mask_started = now_s();
    return SCAPE_OK;
}

static scape_rc keep_stats(eng_t *e)
{
    TRY(e->x->ops->keep_stats(e->x));
    e->a.sel_tr = e->a.tr;
    e->a.select_pending = 1;
    return SCAPE_OK;
}

scape_rc eng_select_pending(eng_t *e)
{
    e->x->ops->mark(e->x, ENG_PH_SELECT, 0);
    scape_rc rc = scape_select(e);
    e->a.select_pending = 0;
    e->x->ops->mark(e->x, ENG_PH_SELECT, 1);
    if (rc == SCAPE_OK)
        rc = e->x->ops->sync(e->x);
    e->x->ops->times(e->x, e->last.phase_s);
    return rc;
}

/* topk-adamw: each rank's top-k of |a_r| per tensor; the union is the mask. */
static scape_rc topk_union_mask(eng_t *e)
{
    const plan *p = e->p;
    TRY(e->x->ops->own_topk(e->x));
    /* this rank's own mask in the spare mask buffer, the union in the other */
    uint32_t *own = e->a.code_all + e->code_off / 4;
    TRY(e->x->ops->encode(e->x, 0, p->ntensors, e->a.mask_buf[1], own));
    TRY(x_allgather(e, own, e->a.code_all, e->code_bytes));
    e->last.mask_bytes = e->code_total;
    uint32_t *u = e->a.mask_buf[0];
    TRY(e->x->ops->mask_zero(e->x, u));
    size_t off = 0;
    for (int r = 0; r < e->comm->size; r++) {
        TRY(e->x->ops->decode(e->x, 0, p->ntensors, e->a.code_all + off / 4, e->code_bytes[r],
                              u, 1, r));
        off += e->code_bytes[r];
    }
    e->a.mask_cur = u;
    return SCAPE_OK;
}

/* Per-rank sizes of the packed segments, in units of `elem` bytes. */
static void shard_counts(eng_t *e, size_t elem)
{
    for (int r = 0; r < e->comm->size; r++) {
        const plan_shard *s = &e->p->shard[r];
        e->counts[r] = (e->a.toff[s->first + s->count] - e->a.toff[s->first]) * elem;
    }
}

/* ---- chunked reductions (reduce_chunk) -------------------------------------- */

/* An early pack's select_due, as step_phases will set it. */
static int early_select_due(const eng_t *e)
{
    return eng_scape_masks(e) && e->early_step + 1 > e->cfg.warmup;
}

/* The reduction goes in chunks of about cfg.reduce_chunk coordinates, whole
 * tensors by offset, the last first (backward makes their gradients first),
 * each one collective on a host staging buffer that holds its run of every
 * shard in rank order.  The backends sum each value in rank order whatever
 * the segments, so the sums are the bits of the one reduction.  Every rank
 * issues the chunks in the same order: early packs the prefix whose tensors
 * are all packed (early_chunks), the step the rest.  Not where a selection
 * in the step reads the pack that the reduction overwrites (a dense step
 * that selects, a sparse one without defer_select), nor on a comm that
 * reduces device memory itself; the condition is the same on every rank. */
static int chunked(const eng_t *e, const uint32_t *mask, int select_due)
{
    if (e->cfg.reduce_chunk == 0 || e->comm->size < 2 || comm_device_stream(e->comm) != NULL)
        return 0;
    return !select_due || (e->cfg.defer_select && mask != NULL);
}

/* The plan's chunks, once. */
static scape_rc chunks_build(eng_t *e)
{
    if (e->chunk_of != NULL)
        return SCAPE_OK;
    return plan_chunks(e->p, e->cfg.reduce_chunk, &e->chunk_of, &e->chunk_run, &e->nchunks);
}

/* Chunk c's runs of buf (toff's offsets), in rank order, into the staging
 * buffer (down) or back from it: every run, or (own) this rank's alone. */
static scape_rc stage_runs(eng_t *e, float *buf, const size_t *run, int down, int own)
{
    size_t at = 0;
    for (int s = 0; s < e->comm->size; at += e->counts[s], s++) {
        float *b = buf + e->a.toff[run[2 * s]], *h = e->cstage + at;
        if (e->counts[s] && (!own || s == e->rank))
            TRY(e->x->ops->copy(e->x, down ? (void *)h : (void *)b, down ? b : h,
                                e->counts[s] * sizeof(float)));
    }
    return e->x->ops->sync(e->x);
}

/* Chunk c of buf reduced: its runs staged in rank order, one collective,
 * the sums back (sharded: this rank's run only). */
static scape_rc reduce_chunk(eng_t *e, float *buf, size_t c, int bf16)
{
    int R = e->comm->size;
    const size_t *run = e->chunk_run + 2 * (size_t)R * c;
    size_t total = 0, own = 0;
    for (int s = 0; s < R; s++) {
        e->counts[s] = e->a.toff[run[2 * s + 1]] - e->a.toff[run[2 * s]];
        own += s < e->rank ? e->counts[s] : 0;
        total += e->counts[s];
    }
    TRY(bounce_buf((void **)&e->cstage, &e->cstage_cap, (total ? total : 1) * sizeof(float)));
    TRY(stage_runs(e, buf, run, 1, 0));
    int sharded = e->cfg.mode != ENG_MODE_REPLICATED;
    TRY(sharded ? comm_reduce_scatter_sum_wire(e->comm, e->cstage, e->cstage + own, e->counts,
                                               bf16)
                : comm_allreduce_sum_wire(e->comm, e->cstage, total, bf16));
    return stage_runs(e, buf, run, 0, sharded);
}

/* Early packs: reduce the chunks next in line whose every tensor is packed;
 * their comm counts go to the step. */
static scape_rc early_chunks(eng_t *e)
{
    if (!chunked(e, e->early_mask, early_select_due(e)))
        return SCAPE_OK;
    TRY(chunks_build(e));
    size_t R = (size_t)e->comm->size;
    float *buf = e->early_mask ? e->a.send : e->a.dense;
    int bf16 = e->cfg.wire_bf16 && e->early_mask != NULL;
    while (e->chunks_done < e->nchunks) {
        const size_t *run = e->chunk_run + 2 * R * e->chunks_done;
        for (size_t s = 0; s < R; s++)
            for (size_t j = run[2 * s]; j < run[2 * s + 1]; j++)
                if (!e->early_done[j])
                    return SCAPE_OK;
        comm_stats before = e->comm->stats;
        scape_rc rc = reduce_chunk(e, buf, e->chunks_done, bf16);
        eng_comm_since(&e->chunk_cs, &e->comm->stats, &before);
        if (rc != SCAPE_OK) {
            e->broken = 1; /* the ranks no longer agree on what is reduced */
            return rc;
        }
        e->chunks_done++;
    }
    return SCAPE_OK;
}

/* The one reduction collective, in place; sharded ranks keep their segment.
 * The values go in bf16 when the pack rounded them so (wire_now).  Chunked:
 * the chunks early packs did not reduce, in order. */
static scape_rc reduce(eng_t *e, float *buf, size_t k)
{
    e->a.sum = buf;
    if (chunked(e, e->a.mask_cur, e->select_due)) {
        TRY(chunks_build(e));
        for (; e->chunks_done < e->nchunks; e->chunks_done++)
            TRY(reduce_chunk(e, buf, e->chunks_done, e->a.wire_now));
        e->last.chunks = e->nchunks;
        return SCAPE_OK;
    }
    if (e->cfg.mode == ENG_MODE_REPLICATED)
        return x_allreduce(e, buf, k, e->a.wire_now);
    shard_counts(e, 1);
    return x_reduce_scatter(e, buf, buf + e->a.toff[e->p->shard[e->rank].first], e->counts,
                            e->a.wire_now);
}

/* Inspection: keep g_hat = S / T of the coordinates this rank reduced. */
static scape_rc keep_ghat(eng_t *e, size_t k)
{
    size_t first, count;
    const void *sv = NULL, *mv = NULL;
    eng_update_range(e, &first, &count);
    TRY(exec_view(e->x, e->a.sum, k * sizeof(float), &sv));
    scape_rc rc = e->a.mask_cur ? exec_view(e->x, e->a.mask_cur, e->p->nwords * 4, &mv) : SCAPE_OK;
    const float *sum = sv;
    const uint32_t *mask = mv;
    memset(e->ghave, 0, e->p->n);
    for (size_t j = first; rc == SCAPE_OK && j < first + count; j++) {
        const plan_tensor *t = eng_tensor_at(e, j);
        const float *s = sum + e->a.toff[j];
        for (size_t i = 0, q = 0; i < t->len; i++) {
            int on = !mask || ((mask[t->word + i / 32] >> (i & 31)) & 1u);
            e->ghat[t->pos + i] = on ? s[q++] / (float)e->a.t_total : 0.0f;
            e->ghave[t->pos + i] = (unsigned char)on;
        }
    }
    exec_view_free(e->x, sv);
    exec_view_free(e->x, mv);
    return rc;
}

/* max_grad_norm: the norm torch's clip_grad_norm_ would see, from the
 * ranks' (own sum of squares of g_hat, |G_r|^2) pairs: g_hat's own norm on
 * a dense step (no residual: g_hat is the mean gradient), |G_0| / T with one
 * rank, else the bound (1/T) sum_r |G_r| (triangle inequality, equal when
 * the ranks' gradients are parallel); -1 when a rank could not measure. */
static void mean_grad_norm(eng_t *e, double sent_norm)
{
    int R = e->comm->size;
    double bound = 0.0;
    e->last.mean_grad_exact = 1;
    if (e->a.mask_cur == NULL) {
        e->last.mean_grad_norm = sent_norm;
        return;
    }
    for (int r = 0; r < R; r++) {
        if (e->sq[2 * r + 1] < 0.0) {
            e->last.mean_grad_norm = -1.0;
            return;
        }
        bound += sqrt(e->sq[2 * r + 1]);
    }
    e->last.mean_grad_exact = R == 1;
    e->last.mean_grad_norm = bound / (double)e->a.t_total;
}

/* max_grad_norm: the clipping coefficient of this step.  Each rank's sum of
 * squares of g_hat covers the tensors it owns (the chunks of
 * scape_formula.h's rule start at each owner's first value); every rank
 * all-gathers it with its |G_r|^2 (the one scalar collective, 16 bytes a
 * rank), and the sums add in rank order, so that both modes and every
 * executor get the same bits.  clip_norm says which norm the factor comes
 * from: g_hat's (sent) or the mean gradient's (gradient). */
static scape_rc clip_coef(eng_t *e, uint64_t t)
{
    int R = e->comm->size;
    e->a.clip = 0.0f;
    e->last.grad_norm = 0.0;
    e->last.clip = 1.0;
    e->last.mean_grad_norm = -1.0;
    e->last.mean_grad_exact = 0;
    if (!(e->cfg.max_grad_norm > 0.0f))
        return SCAPE_OK;
    const plan_shard *sh = e->p->shard;
    double *own = &e->sq[2 * e->rank];
    TRY(e->x->ops->sqsum(e->x, sh[e->rank].first, sh[e->rank].count, own));
    TRY(e->x->ops->sync(e->x));
    own[1] = e->gsq[e->a.tr];
    for (int r = 0; r < R; r++)
        e->counts[r] = 2 * sizeof(double);
    TRY(comm_allgather(e->comm, own, e->sq, e->counts));
    double total = 0.0;
    for (int r = 0; r < R; r++)
        total += e->sq[2 * r];
    if (!isfinite(total))
        return scape_set_error(SCAPE_INVALID, "engine: step %llu: the mean gradient's norm "
                               "is not finite (%g); the update is not applied",
                               (unsigned long long)t, total);
    double norm = sqrt(total);
    mean_grad_norm(e, norm);
    double by = norm;
    if (e->cfg.clip_norm == ENG_CLIP_GRAD) {
        by = e->last.mean_grad_norm;
        if (!(by >= 0.0) || !isfinite(by))
            return scape_set_error(SCAPE_INVALID, "engine: step %llu: clip_norm gradient: "
                                   "the trainers' gradient norm is %s; the update is not "
                                   "applied (with gradients in device memory the cuda "
                                   "executor cannot measure it yet: use clip_norm: sent)",
                                   (unsigned long long)t, isnan(by) || isinf(by)
                                   ? "not finite" : "not measured");
    }
    float c = scape_f_clip_coef(by, e->cfg.max_grad_norm);
    e->last.grad_norm = norm;
    e->last.clip = c < 1.0f ? (double)c : 1.0;
    e->a.clip = c < 1.0f ? c : 0.0f;
    return SCAPE_OK;
}

/* max_grad_norm: each local trainer's |g_j|^2 and |G_r|^2, before the pack
 * adds the residual. */
static scape_rc grad_sqsums(eng_t *e, const void *const *grads)
{
    if (!(e->cfg.max_grad_norm > 0.0f))
        return SCAPE_OK;
    return e->x->ops->grad_sqsums(e->x, grads, e->gsq);
}

/* The new parameters, comm order, into `dst`: packed at the mask (sparse) or
 * whole (dense), in bf16 when every trainer holds bf16 (pub_bf16), or their
 * changes in bf16 from what the trainers hold (pub_delta); sharded ranks
 * then all-gather their parts in place. */
static scape_rc gather_updates(eng_t *e, float *dst, void *const *params)
{
    size_t first, count, esz = e->a.pub_bf16 ? 2 : sizeof(float);
    eng_update_range(e, &first, &count);
    TRY(e->x->ops->compact(e->x, first, count, dst, params));
    if (e->cfg.mode == ENG_MODE_REPLICATED)
        return SCAPE_OK;
    shard_counts(e, esz);
    return x_allgather(e, (char *)dst + e->a.toff[first] * esz, dst, e->counts);
}

/* Where the new parameters are gathered: `upd` when sparse; when dense, the
 * master copy itself (replicated) or the dense buffer, whose sums are spent
 * (sharded). */
static float *publish_buffer(eng_t *e)
{
    if (e->a.mask_cur)
        return e->a.upd;
    return e->cfg.mode == ENG_MODE_REPLICATED ? e->a.theta : e->a.dense;
}

/* Run the call as phase ph (the executor times it). */
#define PHASE(ph, call)                                                        \
    do {                                                                       \
        e->x->ops->mark(e->x, ph, 0);                                          \
        scape_rc rc_ = (call);                                                 \
        e->x->ops->mark(e->x, ph, 1);                                          \
        if (rc_ != SCAPE_OK)                                                   \
            return rc_;                                                        \
    } while (0)

static scape_rc choose_mask(eng_t *e, uint64_t t)
{
    if (e->opt->mask == ENG_MASK_LAGGED_M) {
        PHASE(ENG_PH_MASK_WAIT, scape_mask(e, t));
    } else if (e->opt->mask == ENG_MASK_NONE || t <= e->cfg.warmup) {
        e->a.mask_cur = NULL;
    } else {
        PHASE(ENG_PH_SELECT, topk_union_mask(e));
    }
    return SCAPE_OK;
}

/* ---- early packs (bucketed hand-over) ----------------------------------------- */

/* The first early pack of step t: what the step does before its pack, short
 * of swapping the masks (so that an undo has no mask to restore): the last
 * step's deferred selection, the lagged all-gather, the mask step t uses. */
static scape_rc early_begin(eng_t *e, uint64_t t)
{
    size_t nt = e->p->ntensors ? e->p->ntensors : 1;
    TRY(eng_step_finish(e));
    if (e->opt->mask == ENG_MASK_LAGGED_M && e->mask_pending) {
        double waited;
        TRY(eng_mask_finish(e, &waited));
        double life = now_s() - e->mask_started;
        e->early_overlap = life > 0.0 ? 1.0 - waited / life : 1.0;
        e->early_waited = 1;
    }
    if (e->early_done == NULL && (e->early_done = calloc(nt, 1)) == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    if (e->early_take == NULL && (e->early_take = calloc(nt, 1)) == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: out of memory");
    e->early_mask = eng_scape_masks(e) && t > e->cfg.warmup ? e->a.mask_next : NULL;
    e->early_stale0 = e->a.e_stale;
    e->early_step = t;
    if (e->x->ops->norm_kept && !e->kept_norm_ok) { /* before a part overwrites it */
        e->kept_norm = e->x->ops->residual_norm(e->x);
        e->kept_norm_ok = 1;
    }
    /* the churn of the step's mask, a statistic, off the step's path too;
     * the last step's figure in e->last stays what status shows till then */
    if (e->opt->mask == ENG_MASK_LAGGED_M && e->early_mask && e->a.mask_cur) {
        double shown = e->last.mask_churn;
        TRY(e->x->ops->churn(e->x, e->early_mask, e->a.mask_cur));
        scape_rc rc = e->x->ops->sync(e->x);
        e->early_churn = e->last.mask_churn;
        e->last.mask_churn = shown;
        TRY(rc);
        e->early_churned = 1;
    }
    return SCAPE_OK;
}

/* The residual of the comm tensors j with which[j]: into the undo buffer
 * (keep), or back from it. */
static scape_rc early_copy(eng_t *e, const unsigned char *which, int keep)
{
    size_t n = e->p->n ? e->p->n : 1;
    if (e->early_undo == NULL && (e->early_undo = malloc(n * sizeof(float))) == NULL)
        return scape_set_error(SCAPE_NOMEM, "engine: cannot allocate %zu floats to undo "
                               "early packs", n);
    for (size_t j = 0; j < e->p->ntensors; j++) {
        const plan_tensor *pt = eng_tensor_at(e, j);
        float *u = e->early_undo + pt->pos, *r = e->a.e + pt->pos;
        if (which[j])
            TRY(e->x->ops->copy(e->x, keep ? u : r, keep ? r : u, pt->len * sizeof(float)));
    }
    return e->x->ops->sync(e->x);
}

/* Pack the comm tensors early_take marks, with the mask (and its offsets)
 * step early_step will have; a.mask_cur stays the last step's. */
static scape_rc early_run(eng_t *e, const void *const *grads)
{
    if (!e->early_stale0)
        TRY(early_copy(e, e->early_take, 1));
    const uint32_t *cur = e->a.mask_cur;
    int wire = e->a.wire_now;
    size_t k = 0;
    e->a.mask_cur = e->early_mask;
    e->a.wire_now = e->cfg.wire_bf16 && e->early_mask != NULL;
    scape_rc rc = e->x->ops->offsets(e->x, &k);
    if (rc == SCAPE_OK && e->early_mask && k > e->a.k_cap)
        rc = scape_set_error(SCAPE_INVALID, "engine: mask of %zu values exceeds the "
                             "capacity of %zu", k, e->a.k_cap);
    if (rc == SCAPE_OK)
        rc = e->x->ops->pack_part(e->x, grads, e->early_take, early_select_due(e));
    if (rc == SCAPE_OK)
        rc = e->x->ops->sync(e->x);
    e->a.mask_cur = cur;
    e->a.wire_now = wire;
    /* a failed pack leaves these tensors as the last step did */
    if (rc != SCAPE_OK && !e->early_stale0 && early_copy(e, e->early_take, 0) != SCAPE_OK)
        e->broken = 1;
    return rc;
}

scape_rc eng_early_pack(eng_t *e, uint64_t t, const void *const *grads,
                        const unsigned char *take, size_t *packed)
{
    *packed = 0;
    if (e->opt->intake || e->x->ops->pack_part == NULL)
        return SCAPE_OK; /* the step packs everything */
    double t0 = now_s();
    if (e->early_step == 0)
        TRY(early_begin(e, t));
    size_t n = 0;
    for (size_t j = 0; j < e->p->ntensors; j++) {
        e->early_take[j] = take[eng_tensor_at(e, j)->parent] && !e->early_done[j];
        n += e->early_take[j];
    }
    if (n)
        TRY(early_run(e, grads));
    for (size_t j = 0; j < e->p->ntensors; j++)
        e->early_done[j] |= e->early_take[j];
    e->early_count += n;
    scape_rc rc = n ? early_chunks(e) : SCAPE_OK;
    e->early_s += now_s() - t0;
    *packed = n;
    return rc;
}

void eng_early_clear(eng_t *e)
{
    if (e->early_done)
        memset(e->early_done, 0, e->p->ntensors);
    e->early_step = 0;
    e->early_count = 0;
    e->early_s = 0.0;
    e->early_churned = 0;
    e->chunks_done = 0;
    memset(&e->chunk_cs, 0, sizeof e->chunk_cs);
}

/* With chunks reduced early (on every rank, or waited for by them), their
 * tensors stay packed and reduced: only the others are undone, and the
 * step packs them again (their new gradients; the reduced ones keep the
 * gradients they were reduced with). */
static scape_rc undo_uncommitted(eng_t *e)
{
    size_t kept = 0;
    for (size_t j = 0; j < e->p->ntensors; j++) {
        int committed = e->chunk_of[j] < e->chunks_done;
        e->early_take[j] = e->early_done[j] && !committed;
        e->early_done[j] = (unsigned char)committed;
        kept += (size_t)committed;
    }
    scape_rc rc = e->early_stale0 ? SCAPE_OK : early_copy(e, e->early_take, 0);
    if (rc != SCAPE_OK)
        e->broken = 1;
    e->early_count = kept;
    return rc;
}

scape_rc eng_early_undo(eng_t *e)
{
    if (e->early_step == 0)
        return SCAPE_OK;
    if (e->chunks_done > 0)
        return undo_uncommitted(e);
    scape_rc rc = e->early_stale0 ? SCAPE_OK : early_copy(e, e->early_done, 0);
    if (rc != SCAPE_OK)
        e->broken = 1;
    e->a.e_stale = e->early_stale0;
    eng_early_clear(e);
    return rc;
}

/* The pack of what early packs left, with the mask they used; then the
 * residual is zero (stale) after a dense pack, as the whole pack leaves it. */
static scape_rc pack(eng_t *e, const void *const *grads)
{
    if (e->early_step == 0)
        return e->x->ops->pack(e->x, grads, e->select_due);
    if (e->early_mask != e->a.mask_cur)
        return scape_set_error(SCAPE_INVALID, "engine: step %llu's early packs used "
                               "another mask than the step's", (unsigned long long)e->early_step);
    for (size_t j = 0; j < e->p->ntensors; j++)
        e->early_take[j] = !e->early_done[j];
    TRY(e->x->ops->pack_part(e->x, grads, e->early_take, e->select_due));
    e->a.e_stale = e->a.mask_cur == NULL;
    return SCAPE_OK;
}

static scape_rc step_phases(eng_t *e, uint64_t t, const void *const *grads,
                            void *const *params)
{
    size_t k = 0;
    float *pub;
    PHASE(ENG_PH_INTAKE, grad_sqsums(e, grads));
    if (e->opt->intake)
        PHASE(ENG_PH_INTAKE, e->x->ops->intake(e->x, grads));
    TRY(choose_mask(e, t));
    TRY(e->x->ops->offsets(e->x, &k));
    if (e->a.mask_cur && k > e->a.k_cap)
        return scape_set_error(SCAPE_INVALID, "engine: mask of %zu values exceeds the "
                               "capacity of %zu", k, e->a.k_cap);
    e->select_due = eng_scape_masks(e) && t + 1 > e->cfg.warmup;
    e->sel_step = t + 1;
    e->a.wire_now = e->cfg.wire_bf16 && e->a.mask_cur != NULL;
    PHASE(ENG_PH_PACK, pack(e, grads));
    if (e->select_due) {
        /* deferred only from a sparse step: a dense one's a is overwritten
         * by its in-place reduction */
        if (e->cfg.defer_select && e->a.mask_cur)
            PHASE(ENG_PH_SELECT, keep_stats(e));
        else
            PHASE(ENG_PH_SELECT, scape_select(e));
    }
    PHASE(ENG_PH_REDUCE, reduce(e, e->a.mask_cur ? e->a.send : e->a.dense, k));
    if (e->ghat)
        TRY(keep_ghat(e, k));
    PHASE(ENG_PH_UPDATE, clip_coef(e, t));
    size_t first, count;
    eng_update_range(e, &first, &count);
    PHASE(ENG_PH_UPDATE, e->x->ops->update(e->x, first, count, t));
    pub = publish_buffer(e);
    e->a.pub_delta = e->vdelta && e->a.mask_cur != NULL;
    e->a.pub_bf16 = (e->vbf16 && pub != e->a.theta) || e->a.pub_delta;
    if (pub != e->a.theta)
        PHASE(ENG_PH_GATHER, gather_updates(e, pub, params));
    PHASE(ENG_PH_WRITEBACK, e->x->ops->write_back(e->x, pub, params));
    e->last.k = k;
    return SCAPE_OK;
}

scape_rc eng_step_body(eng_t *e, uint64_t t, const void *const *grads,
                       void *const *params)
{
    scape_rc rc = step_phases(e, t, grads, params);
    /* the parameters are in every trainer's buffer once the work is done */
    if (rc == SCAPE_OK)
        rc = e->x->ops->sync(e->x);
    e->x->ops->times(e->x, e->last.phase_s);
    return rc;
}
