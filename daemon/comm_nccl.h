/* comm_nccl.h - the `nccl` comm backend: one daemon per node and GPU, NCCL
 * between them (InfiniBand or NVLink as NCCL finds it).
 *
 * The engine keeps its buffers in host memory; the main communicator's
 * collectives stream them through two fixed device staging slots, round by
 * round on the daemon's comm stream, so the host's copy of the next round
 * overlaps the GPU's work on the current one and device memory does not grow
 * with N.  The lagged mask all-gather has its own communicator and
 * stream, so it proceeds while the reduction runs, and lands in pinned host
 * memory until comm_iallgather_wait.  Per-rank segment sizes (the engine's
 * shards are uneven) are served by grouped ncclReduce / ncclBroadcast, one
 * per root.  Every wait is bounded: a peer that is gone makes the operation
 * fail with SCAPE_TIMEOUT after timeout_ms and the communicator is aborted.
 *
 * NCCL's summation order is its own (ring or tree), so unlike the local and
 * host backends the sums are not in rank order: every rank still gets the
 * same bits, but not the bits of the host backend.
 */
#ifndef SCAPE_COMM_NCCL_H
#define SCAPE_COMM_NCCL_H

#include <stddef.h>

#include "comm.h"

#define COMM_NCCL_ID_BYTES 128   /* sizeof(ncclUniqueId) */
#define COMM_NCCL_IDS 2          /* the main communicator, the mask's */

typedef struct comm_nccl_opts {
    int rank, size;
    int device;                  /* CUDA device ordinal */
    /* From comm_nccl_make_ids on rank 0, handed out by the rendezvous. */
    unsigned char ids[COMM_NCCL_IDS * COMM_NCCL_ID_BYTES];
    int timeout_ms;              /* longest wait for any operation; 0: 300000 */
} comm_nccl_opts;

/* 1 when scaped was built with CUDA and NCCL. */
int comm_nccl_built(void);
/* Rank 0: the unique ids of both communicators (COMM_NCCL_IDS x 128 bytes). */
scape_rc comm_nccl_make_ids(unsigned char *ids, size_t len);
/* Join the communicators (collective over the group; bounded by timeout_ms). */
scape_rc comm_nccl_create(const comm_nccl_opts *o, comm_t **out);

#endif /* SCAPE_COMM_NCCL_H */
