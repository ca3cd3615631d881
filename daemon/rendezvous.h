/* rendezvous.h - how the daemons of one job find each other.
 *
 * Rank 0 serves a ZeroMQ ROUTER at the coordinator endpoint; every other rank
 * sends it its rank, the world size, the job id and the endpoint its data
 * plane listens on.  When all ranks have joined, rank 0 hands everyone the
 * table of endpoints and an optional blob (the NCCL unique id).  Every wait
 * is bounded; a rank that never arrives is named in the error.
 *
 * With an auth context (auth.h) every join and every table travels sealed:
 * rank 0 refuses a join it cannot open (another user's, another key's, a
 * replay), logs who was refused and why (the first few one by one, then one
 * line per interval with their count, so a flood cannot flood the log), and
 * goes on waiting for the real rank; a joiner accepts only a table sealed by
 * the job's user.  Each rank
 * may also publish its data plane's CURVE public key, handed to all.
 */
#ifndef SCAPE_RENDEZVOUS_H
#define SCAPE_RENDEZVOUS_H

#include <stddef.h>
#include <stdint.h>

#include "auth.h"
#include "scape_rc.h"

#define RDV_BLOB_MAX 256
#define RDV_JOIN_MAX 4096 /* bytes of one packed join */

typedef struct rdv_opts {
    int rank, world;
    const char *coordinator; /* "tcp://host:port" where rank 0 listens */
    const char *endpoint;    /* this rank's data-plane endpoint, published to all */
    uint64_t job;            /* a join from another job is refused */
    int timeout_ms;          /* longest wait for the whole rendezvous */
    const void *blob;        /* rank 0 only: handed to every rank (may be NULL) */
    size_t blob_len;         /* <= RDV_BLOB_MAX */
    auth_ctx *auth;          /* seals (NULL: auth none) */
    const char *curve_key;   /* this rank's CURVE public key (Z85), or NULL:
                                then every rank must have none */
} rdv_opts;

typedef struct rdv_result {
    char **endpoints;        /* world entries, by rank */
    char **keys;             /* world CURVE keys by rank, or NULL (no keys) */
    int world;
    unsigned char blob[RDV_BLOB_MAX];
    size_t blob_len;
    uint64_t refused;        /* rank 0: joins it refused (bogus, another job's) */
} rdv_result;

/* Run the rendezvous for this rank; on success *out holds the table. */
scape_rc rdv_run(const rdv_opts *o, rdv_result *out);
/* Free the table. */
void rdv_result_free(rdv_result *r);

/* The two readers of what a peer sends, as rdv_run uses them (tests/fuzz
 * feeds them bytes).  Rank 0 judges one join as received (opening its seal
 * with o->auth): on success the joiner's endpoint is recorded in out and
 * *rank says whose it is.  A joiner
 * reads rank 0's answer into out.  Either way out is as rdv_run makes it:
 * world = o->world and that many endpoint slots, NULL until filled. */
scape_rc rdv_judge_join(const rdv_opts *o, const void *buf, size_t n, rdv_result *out,
                        int *rank);
scape_rc rdv_read_reply(const rdv_opts *o, const void *buf, size_t n, rdv_result *out);

/* Where Slurm says we are: rank (SLURM_PROCID), world (SLURM_NTASKS), job
 * (SLURM_JOB_ID) and the first host of SLURM_STEP_NODELIST, else
 * SLURM_JOB_NODELIST, into host (len bytes).  SCAPE_INVALID, naming the
 * variable, when one is missing or malformed. */
scape_rc rdv_from_slurm(int *rank, int *world, uint64_t *job, char *host, size_t len);

/* Rank 0's rendezvous port inside Slurm job `job`: 20000 + job % 10000, so
 * that two jobs whose first node is the same do not both want one port
 * (below Linux's ephemeral range, which the data planes draw from).
 * slurm/scape-node.sh computes the same. */
#define RDV_SLURM_PORT_BASE 20000
#define RDV_SLURM_PORT_SPAN 10000
int rdv_slurm_port(uint64_t job);

/* This host's IPv4 address as a string, for the endpoint peers connect to. */
scape_rc rdv_host_address(char *buf, size_t len);

/* The first host of a Slurm host list: "gh[001-004,010],login1" -> "gh001". */
scape_rc rdv_first_host(const char *list, char *host, size_t len);

#endif /* SCAPE_RENDEZVOUS_H */
