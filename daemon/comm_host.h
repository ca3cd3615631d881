/* comm_host.h - the `host` comm backend: one daemon per rank, host memory,
 * TCP between the daemons over ZeroMQ.  See comm_host.c for the schedules,
 * the framing and their byte costs. */
#ifndef SCAPE_COMM_HOST_H
#define SCAPE_COMM_HOST_H

#include <stddef.h>
#include <stdint.h>

#include "comm.h"

typedef struct comm_host_opts {
    int rank, size;                  /* this rank and the group size (1..4096) */
    const char *const *endpoints;    /* size entries: where rank r listens */
    int timeout_ms;                  /* longest wait for any peer; 0: 30000 */
    size_t chunk_bytes;              /* pipelining unit (>= 4); 0: 1 MiB */
    uint64_t job;                    /* every message carries it; others are refused */
    /* Optional: learn the peers' endpoints only after binding.  Then listen
     * is bound instead of endpoints[rank] (its port may be '*' or 0: one the
     * kernel picks), endpoints may be NULL, and meet is called with the
     * address the peers must use; it points *endpoints at the size entries
     * (kept valid until comm_host_create returns).  The daemon runs its
     * rendezvous there, so it never has to guess a free port. */
    const char *listen;
    scape_rc (*meet)(void *arg, const char *bound, const char *const **endpoints,
                     const char *const **keys);
    void *meet_arg;
    /* Optional: CURVE on the data plane.  This rank's key pair (Z85 text, 40
     * characters each; NULL: plain TCP, as before) and every rank's public key
     * by rank (size entries; with meet, meet points *keys at them instead).
     * The PULL socket is then a CURVE server that admits only those keys
     * (zap.h): anyone else is refused at the handshake and counted
     * (comm_refused); every message is authenticated and encrypted. */
    const char *curve_public, *curve_secret;
    const char *const *curve_keys;
} comm_host_opts;

/* Bind this rank's endpoint and start connecting to every peer.  Returns at
 * once, without waiting for the peers: a peer that never comes up makes the
 * first collective fail with SCAPE_TIMEOUT.  All ranks must pass the same
 * size, chunk_bytes and job, and agree on the endpoints. */
scape_rc comm_host_create(const comm_host_opts *o, comm_t **out);
/* Bytes this rank really sent and received (headers included, ZeroMQ's own
 * framing not); SCAPE_INVALID if c is not a host comm. */
scape_rc comm_host_wire_stats(const comm_t *c, uint64_t *sent, uint64_t *recvd);
/* Failure reports (K_FAIL) this rank dropped: about itself, about their
 * sender, or naming or sent by a rank out of range; the last one in why (0:
 * not a host comm). */
uint64_t comm_host_reports_ignored(const comm_t *c, char *why, size_t len);
/* Peers this rank's connections currently reach (-1: not a host comm). */
int comm_host_connected(const comm_t *c);
/* Whether rank q was reached at the last comm_host_connected (or any wait);
 * 0 for this rank itself and for a rank out of range. */
int comm_host_peer_up(const comm_t *c, int q);

#endif /* SCAPE_COMM_HOST_H */
