/* comm_host_wire.h - the framing of the host backend's messages (see the
 * "Framing" paragraph of comm_host.c): a 32-byte header frame, then one
 * payload frame.  Only comm_host.c speaks it; tests/fuzz/fuzz_hostmsg.c
 * writes it to play a peer. */
#ifndef SCAPE_COMM_HOST_WIRE_H
#define SCAPE_COMM_HOST_WIRE_H

#include <stdint.h>

#define HOST_MAGIC 0x31484353u /* "SCH1" */

/* What a message carries: a reduce-scatter part, a chunk of an all-gather,
 * of the asynchronous all-gather, of a broadcast, a barrier arrival at rank
 * 0 and rank 0's release; and K_FAIL, a report that a wait of the sender's
 * gave up on a rank: chunk is that rank, seq the sender's op, the payload
 * the sender's error text (at most HOST_FAIL_TEXT bytes, not terminated). */
enum host_kind { K_RS_PART = 1, K_AG, K_IAG, K_BC, K_BAR_IN, K_BAR_OUT, K_FAIL, K_END };

#define HOST_FAIL_TEXT 300

typedef struct wire_hdr {
    uint64_t job;
    uint64_t seq;      /* op sequence number (K_IAG: its own sequence) */
    uint64_t chunk;    /* index within the stream */
    uint32_t magic;
    uint16_t kind;
    uint16_t sender;
} wire_hdr;

#endif /* SCAPE_COMM_HOST_WIRE_H */
