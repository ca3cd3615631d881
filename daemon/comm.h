/* comm.h - the interface between the engine and the other ranks.
 *
 * A comm is one rank's handle on a group of R ranks.  Backends (local threads
 * now; host TCP and NCCL later) fill in a table of function pointers and keep
 * everything else static.  The engine calls only the comm_* wrappers below,
 * which count calls and bytes per operation.  All collectives are called by
 * every rank of the group in the same order.  Sums are computed in rank order
 * 0, 1, ..., R-1 on every backend, so all-reduce and reduce-scatter give the
 * same bits for the same inputs.
 */
#ifndef SCAPE_COMM_H
#define SCAPE_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "scape_kernels.h"

typedef enum comm_op {
    COMM_ALLREDUCE = 0,   /* sum of fp32 vectors, result on every rank */
    COMM_REDUCE_SCATTER,  /* sum of fp32 vectors, rank r keeps segment r */
    COMM_ALLGATHER,       /* blocking all-gather of byte segments */
    COMM_IALLGATHER,      /* the asynchronous (mask) all-gather */
    COMM_BROADCAST,       /* bytes from a root to every rank */
    COMM_BARRIER,
    COMM_OP_COUNT
} comm_op;

typedef struct comm_stats {
    uint64_t calls[COMM_OP_COUNT];
    uint64_t bytes[COMM_OP_COUNT];      /* payload: the size of the collective's result */
    uint64_t wire_bytes[COMM_OP_COUNT]; /* received by this rank per the ring
                                           model of the op, not measured (see
                                           comm_data_bytes) */
} comm_stats;

/* The op's name as status and metrics show it ("reduce_scatter", ...). */
const char *comm_op_name(comm_op op);

typedef struct comm comm_t;

typedef struct comm_ops {
    const char *name;
    /* In-place sum of n floats across ranks.  bf16: every input is a bf16
     * number held in fp32 (scape_f_wire_bf16), so the backend may send each
     * in 16 bits; the sum is fp32 in rank order all the same (nccl on device
     * memory too: the parts go to their owners by send/receive). */
    scape_rc (*allreduce_sum)(comm_t *c, float *buf, size_t n, int bf16);
    /* send holds sum(counts) floats, segment r at offset sum(counts[0..r));
     * recv receives the sum of segment `rank` (counts[rank] floats).  recv may
     * be that segment of send itself (in place).  bf16 as above. */
    scape_rc (*reduce_scatter_sum)(comm_t *c, const float *send, float *recv,
                                   const size_t *counts, int bf16);
    /* recv receives the concatenation of every rank's bytes (counts[r] from
     * rank r); send holds counts[rank] bytes and may be this rank's own place
     * in recv (in place). */
    scape_rc (*allgather)(comm_t *c, const void *send, void *recv,
                          const size_t *counts);
    /* Start an all-gather as above that completes at iallgather_wait; send
     * may be reused at once, recv must stay untouched until the wait.  At most
     * one is outstanding per comm. */
    scape_rc (*iallgather)(comm_t *c, const void *send, void *recv,
                           const size_t *counts);
    scape_rc (*iallgather_wait)(comm_t *c);
    scape_rc (*broadcast)(comm_t *c, void *buf, size_t bytes, int root);
    scape_rc (*barrier)(comm_t *c);
    void (*destroy)(comm_t *c);
    /* 1 when a bf16 reduction of buf sends 16 bits a value (NULL or 0: the
     * backend sends such inputs as the fp32 numbers they are, and they are
     * counted so: nccl on host memory). */
    int (*wire_bf16)(const comm_t *c, const void *buf);
    /* Device memory the backend holds, bytes (NULL: none). */
    uint64_t (*device_bytes)(const comm_t *c);
    /* Messages dropped as not of this job (NULL: none can arrive); the last
     * one described into why. */
    uint64_t (*foreign)(const comm_t *c, char *why, size_t len);
    /* Connections refused at the handshake: not a rank of this job (NULL:
     * the backend authenticates nobody); the last one described into why. */
    uint64_t (*refused)(const comm_t *c, char *why, size_t len);
    /* Bytes this rank really sent and received on its data plane so far,
     * framing included (NULL: the backend does not measure them). */
    void (*data_bytes)(const comm_t *c, uint64_t *sent, uint64_t *recvd);
    /* 1 when none of the backend's device work is in flight, so that a
     * synchronising CUDA call (cudaFreeHost) cannot wait on a collective
     * that a dead peer stalls (NULL: the backend runs nothing on a device). */
    int (*quiet)(const comm_t *c);
    /* Between collectives: a peer whose connection has stayed closed for the
     * backend's grace period (its daemon is gone), how long into *down_ms;
     * -1 when none is (NULL: the backend cannot tell without a collective). */
    int (*gone)(const comm_t *c, long long *down_ms);
    /* How many peers the connections reach now, the unreached ones (at most
     * cap) into down and their count into *ndown (NULL: the backend cannot
     * tell, comm_peers_up says -1). */
    int (*peers_up)(const comm_t *c, int *down, int cap, int *ndown);
    /* The CUDA stream (a cudaStream_t) on which the backend also takes
     * device memory: a collective on device buffers is then enqueued there,
     * in place, and returns at once; it is done when the stream has reached
     * it (NULL: host memory only). */
    void *(*device_stream)(const comm_t *c);
    /* Wait, bounded like every wait of the backend, until the device stream
     * has run everything enqueued on it (with device_stream). */
    scape_rc (*device_sync)(comm_t *c);
    /* During a collective (from the wait hook): the peers whose data it still
     * waits for, at most cap of them into ranks; their count, or -1 when the
     * backend cannot tell (NULL: -1). */
    int (*waiting_for)(const comm_t *c, int *ranks, int cap);
} comm_ops;

struct comm {
    const comm_ops *ops;
    int rank;
    int size;
    comm_stats stats;
    int pending;  /* an iallgather is outstanding */
    void *impl;   /* backend state */
    const char *busy_op;     /* the collective running now (comm_waiting); NULL: none */
    long long busy_since_ms; /* when it began, CLOCK_MONOTONIC */
};

/* Sum of n floats across ranks, in place. */
scape_rc comm_allreduce_sum(comm_t *c, float *buf, size_t n);
/* Reduce-scatter with per-rank segment counts (floats). */
scape_rc comm_reduce_scatter_sum(comm_t *c, const float *send, float *recv,
                                 const size_t *counts);
/* The same with the inputs on the wire in bf16 (bf16 = 1; comm_ops): they
 * must be bf16 numbers held in fp32.  Where the backend sends them so
 * (comm_ops.wire_bf16) the byte counts are those of the 16-bit inputs (the
 * all-reduce's gather of the sums stays fp32). */
scape_rc comm_allreduce_sum_wire(comm_t *c, float *buf, size_t n, int bf16);
scape_rc comm_reduce_scatter_sum_wire(comm_t *c, const float *send, float *recv,
                                      const size_t *counts, int bf16);
/* All-gather with per-rank segment sizes in bytes. */
scape_rc comm_allgather(comm_t *c, const void *send, void *recv, const size_t *counts);
/* Start the asynchronous all-gather; finish it with comm_iallgather_wait. */
scape_rc comm_iallgather(comm_t *c, const void *send, void *recv, const size_t *counts);
/* Wait for the outstanding asynchronous all-gather. */
scape_rc comm_iallgather_wait(comm_t *c);
/* Broadcast bytes from root. */
scape_rc comm_broadcast(comm_t *c, void *buf, size_t bytes, int root);
/* Wait until every rank has arrived. */
scape_rc comm_barrier(comm_t *c);
/* A process-wide stop request that the backends' blocking waits consult a
 * few times a second (NULL: never).  The daemon sets it so that a shutdown
 * lets the running step finish but is not held up by a collective waiting
 * for a peer that will never come: once the request is seen, a wait gives up
 * with SCAPE_REMOTE when COMM_STOP_GRACE_MS pass without progress (a message
 * received, a collective completed: comm_progress) since the later of the
 * request and the last progress. */
void comm_set_interrupt(int (*check)(void));
/* What a process serves while one of its collectives waits (the daemon: its
 * status socket and metrics listener, docs/design.md "Status during a
 * wait").  The hook waits up to timeout_ms for sock (a ZeroMQ socket; NULL:
 * none) to have a message, serving its own sockets meanwhile, on the calling
 * thread; it returns 1 when sock is readable, 0 when not (yet), -1 when
 * polling failed (errno set).  NULL: none.  Process-wide, for a process with
 * one rank: the backends call it from their waits only. */
typedef int (*comm_wait_fn)(void *arg, void *sock, long timeout_ms);
void comm_set_wait_hook(comm_wait_fn fn, void *arg);
/* A backend's blocking wait for a message on sock: the hook's, else
 * zmq_poll on sock alone; returns as comm_wait_fn. */
int comm_wait_poll(void *sock, long timeout_ms);
/* A backend's busy wait (one that polls a device): lets the hook serve
 * what is pending, at most every COMM_SERVE_MS. */
void comm_wait_serve(void);
#define COMM_SERVE_MS 5
/* 1 while c runs a collective: its op's name (comm_op_name, or
 * "device_sync") into *op, the seconds since it began into *seconds, and the
 * peers it still waits for (comm_ops.waiting_for: at most cap into ranks,
 * their count into *nranks, -1 when the backend cannot tell); 0 when none
 * runs. */
int comm_waiting(const comm_t *c, const char **op, double *seconds, int *ranks, int cap,
                 int *nranks);
int comm_interrupted(void);
void comm_progress(void);
#define COMM_INTERRUPT_SLICE_MS 100
#define COMM_STOP_GRACE_MS 1000
/* Device memory the backend holds (staging buffers), bytes. */
uint64_t comm_device_bytes(const comm_t *c);
/* 1 when no device work of the comm is in flight (always, without a device
 * backend or without a comm). */
int comm_quiet(const comm_t *c);
/* Peers this rank's data plane reaches now, -1 when the backend cannot tell
 * (one without connections of its own); the ranks it does not reach into
 * down[0..*ndown), at most cap of them. */
int comm_peers_up(const comm_t *c, int *down, int cap, int *ndown);
/* A peer that is known to be gone while no collective runs (comm_ops.gone),
 * or -1: none, or the backend cannot tell. */
int comm_gone(const comm_t *c, long long *down_ms);
/* Messages the backend dropped because they cannot be from a rank of this
 * job (another job's, or not its framing): how many so far, and (why, len
 * bytes) what the last one was.  0 for backends that cannot receive any. */
uint64_t comm_foreign(const comm_t *c, char *why, size_t len);
/* Connections the backend refused at the handshake (CURVE: a key that is
 * not a rank's, a peer without CURVE): how many so far and the last reason.
 * 0 for backends that authenticate nobody. */
uint64_t comm_refused(const comm_t *c, char *why, size_t len);
/* Bytes really sent and received on the data plane so far, framing
 * included: 1 when the backend measures them (host), else 0 and zeros. */
int comm_data_bytes(const comm_t *c, uint64_t *sent, uint64_t *recvd);
/* The stream on which the comm takes device memory, or NULL (comm_ops). */
void *comm_device_stream(const comm_t *c);
/* Wait until that stream has run all its work (SCAPE_OK without one). */
scape_rc comm_device_sync(comm_t *c);
/* Free one rank's handle and set *c to NULL. */
void comm_destroy(comm_t **c);

/* The `local` backend: R ranks as threads of one process.  Fills comms[0..R)
 * with one handle per rank; each is used by one thread. */
scape_rc comm_local_create(int nranks, comm_t **comms);
/* As comm_local_create, with the longest barrier wait in milliseconds (the
 * default is two minutes); a wait past it fails with SCAPE_TIMEOUT. */
scape_rc comm_local_create_timeout(int nranks, int timeout_ms, comm_t **comms);

#endif /* SCAPE_COMM_H */
