/* fuzz_rendezvous.c - what the daemons of a job tell each other when they
 * meet (daemon/rendezvous.c): the joins rank 0 receives on its TCP port from
 * anyone who can reach it, and the answer each joiner gets back.
 *
 * Input: a shape byte - world size - 1 in bits 0-3; bit 4: the ranks
 * publish CURVE keys; bits 5-6: 0 auth none, 1 auth secret with each record
 * sealed under the job's key before it is read (so the decoder behind the
 * seal is reached), 2 auth secret with the records read as they are (the
 * seal opener itself takes the bytes) - then records (fuzz.h): selector bit
 * 0 clear, a join that this input's rank 0 judges (joins accumulate, as at a
 * real rendezvous); set, rank 0's answer as a joiner of rank 1 + (selector
 * >> 1) reads it.
 *
 * Checked for every input, beyond "no crash":
 *   - rank 0 takes a join only for a rank in [1, world) it has not taken yet,
 *     and records that rank's endpoint (and key, with keys), nothing else;
 *   - a joiner that takes an answer has an endpoint (and key) for every rank;
 *   - under auth secret, unsealed bytes are never taken (mode 2 takes a join
 *     or a table only if the bytes are a seal of the job's key, which a
 *     mutation cannot make);
 *   - every refusal says why.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "auth.h"
#include "fuzz.h"
#include "rendezvous.h"
#include "scape.pb-c.h"

#define JOB 20261130u
#define MAX_WORLD 16

static auth_ctx *s_auth;              /* auth secret under a key made at setup */
static char s_keys[MAX_WORLD][41];    /* rank r's CURVE key (Z85 text) */
static char s_dir[64], s_key_file[96];

static void remove_key(void)
{
    unlink(s_key_file);
    rmdir(s_dir);
}

/* The ranks' public keys: a fixed Z85 key with its first character made the
 * rank's, so that seeds are the same on every run. */
static void make_keys(void)
{
    static const char z85[] = "0123456789abcdefghijklmnopqrstuvwxyz";
    for (int r = 0; r < MAX_WORLD; r++) {
        snprintf(s_keys[r], sizeof s_keys[r], "%s", "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID");
        s_keys[r][0] = z85[r];
    }
}

void fuzz_setup(void)
{
    make_keys();
    snprintf(s_dir, sizeof s_dir, "/tmp/fuzz-rdv-XXXXXX");
    FUZZ_CHECK(mkdtemp(s_dir) != NULL, "mkdtemp failed");
    snprintf(s_key_file, sizeof s_key_file, "%s/key", s_dir);
    FUZZ_CHECK(auth_keygen(s_key_file) == SCAPE_OK &&
                   auth_create(AUTH_SECRET, s_key_file, NULL, &s_auth) == SCAPE_OK,
               "auth secret: %s", scape_last_error());
    atexit(remove_key);
}

static void fresh(rdv_result *r, int world, int keys)
{
    memset(r, 0, sizeof *r);
    r->world = world;
    r->endpoints = calloc((size_t)world, sizeof *r->endpoints);
    r->keys = keys ? calloc((size_t)world, sizeof *r->keys) : NULL;
    FUZZ_CHECK(r->endpoints != NULL && (r->keys || !keys), "out of memory");
}

static int taken(const rdv_result *r)
{
    int n = 0;
    for (int i = 0; i < r->world; i++)
        n += r->endpoints[i] != NULL;
    return n;
}

static int keys_taken(const rdv_result *r)
{
    int n = 0;
    for (int i = 0; r->keys && i < r->world; i++)
        n += r->keys[i] != NULL;
    return n;
}

/* The record as the reader gets it: sealed first in mode 1. */
static const uint8_t *as_sent(int mode, const uint8_t *p, size_t n, uint8_t **own, size_t *len)
{
    *own = NULL;
    *len = n;
    if (mode != 1)
        return p;
    FUZZ_CHECK(auth_seal(s_auth, p, n, 0, own, len) == SCAPE_OK, "seal: %s", scape_last_error());
    return *own;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_in in = { data, size };
    uint32_t shape = fuzz_u8(&in);
    int world = 1 + (int)(shape & 15), keys = (shape >> 4) & 1, mode = (int)(shape >> 5) & 3;
    mode = mode == 3 ? 1 : mode;
    rdv_opts o = { .rank = 0, .world = world, .coordinator = "tcp://127.0.0.1:1",
                   .endpoint = "tcp://127.0.0.1:2", .job = JOB, .timeout_ms = 1000,
                   .auth = mode ? s_auth : NULL, .curve_key = keys ? s_keys[0] : NULL };
    rdv_result root;
    fresh(&root, world, keys);
    int joined = 0;
    uint32_t sel;
    const uint8_t *p;
    size_t n;
    while (fuzz_record(&in, &sel, &p, &n)) {
        uint8_t *own;
        size_t len;
        const uint8_t *q = as_sent(mode, p, n, &own, &len);
        if ((sel & 1) == 0) {
            int rank = -1;
            scape_rc rc = rdv_judge_join(&o, q, len, &root, &rank);
            free(own);
            if (rc == SCAPE_OK) {
                FUZZ_CHECK(rank >= 1 && rank < world, "took rank %d of world %d", rank, world);
                FUZZ_CHECK(mode != 2, "auth secret took a join that was never sealed");
                joined++;
            } else {
                FUZZ_CHECK(scape_last_error()[0] != '\0', "a join refused without a reason");
            }
            FUZZ_CHECK(taken(&root) == joined, "%d endpoints recorded for %d joins",
                       taken(&root), joined);
            FUZZ_CHECK(keys_taken(&root) == (keys ? joined : 0), "%d keys recorded for %d joins",
                       keys_taken(&root), joined);
            continue;
        }
        rdv_opts jo = o;
        jo.rank = 1 + (int)(sel >> 1) % (world > 1 ? world - 1 : 1);
        jo.curve_key = keys ? s_keys[jo.rank] : NULL;
        rdv_result mine;
        fresh(&mine, world, keys);
        scape_rc rc = rdv_read_reply(&jo, q, len, &mine);
        free(own);
        if (rc == SCAPE_OK) {
            FUZZ_CHECK(mode != 2, "auth secret took a table that was never sealed");
            FUZZ_CHECK(taken(&mine) == world, "an answer taken with %d of %d endpoints",
                       taken(&mine), world);
            FUZZ_CHECK(keys_taken(&mine) == (keys ? world : 0), "%d keys for %d ranks",
                       keys_taken(&mine), world);
            FUZZ_CHECK(mine.blob_len <= RDV_BLOB_MAX, "blob of %zu bytes", mine.blob_len);
        } else {
            FUZZ_CHECK(scape_last_error()[0] != '\0', "an answer refused without a reason");
        }
        rdv_result_free(&mine);
    }
    rdv_result_free(&root);
    return 0;
}

/* ---- seeds: what real daemons send ---------------------------------------- */

static void put_join_key(fuzz_buf *b, uint32_t rank, uint32_t world, uint64_t job,
                         const char *ep, const char *key)
{
    Scape__RdvJoin j = SCAPE__RDV_JOIN__INIT;
    j.protocol = 2;
    j.curve_key = (char *)key;
    j.job = job;
    j.rank = rank;
    j.world = world;
    j.endpoint = (char *)ep;
    uint8_t buf[512];
    size_t len = scape__rdv_join__pack(&j, buf);
    fuzz_put(b, 0, buf, len);
}

static void put_join(fuzz_buf *b, uint32_t rank, uint32_t world, uint64_t job, const char *ep)
{
    put_join_key(b, rank, world, job, ep, NULL);
}

static void put_table_keys(fuzz_buf *b, uint8_t sel, int world, const void *blob,
                           size_t blob_len, int keys)
{
    char eps[16][64];
    char *list[16];
    for (int i = 0; i < world; i++) {
        snprintf(eps[i], sizeof eps[i], "tcp://10.0.0.%d:%d", i + 1, 20000 + i);
        list[i] = eps[i];
    }
    Scape__RdvTable t = SCAPE__RDV_TABLE__INIT;
    t.n_endpoints = (size_t)world;
    t.endpoints = list;
    t.has_blob = blob != NULL;
    t.blob.data = (uint8_t *)blob;
    t.blob.len = blob_len;
    char *klist[MAX_WORLD];
    for (int i = 0; keys && i < world; i++)
        klist[i] = s_keys[i];
    t.n_curve_keys = keys ? (size_t)world : 0;
    t.curve_keys = klist;
    Scape__RdvReply r = SCAPE__RDV_REPLY__INIT;
    r.status = SCAPE__STATUS__OK;
    r.table = &t;
    uint8_t buf[2048];
    size_t len = scape__rdv_reply__pack(&r, buf);
    fuzz_put(b, sel, buf, len);
}

static void put_table(fuzz_buf *b, uint8_t sel, int world, const void *blob, size_t blob_len)
{
    put_table_keys(b, sel, world, blob, blob_len, 0);
}

static void put_refusal(fuzz_buf *b, uint8_t sel)
{
    Scape__Error e = SCAPE__ERROR__INIT;
    e.code = SCAPE__STATUS__INVALID;
    e.message = "rendezvous: job 7 is not this job (8)";
    Scape__RdvReply r = SCAPE__RDV_REPLY__INIT;
    r.status = e.code;
    r.error = &e;
    uint8_t buf[512];
    size_t len = scape__rdv_reply__pack(&r, buf);
    fuzz_put(b, sel, buf, len);
}

void fuzz_seeds(fuzz_emit emit, void *ctx)
{
    fuzz_buf *b = calloc(1, sizeof *b);
    FUZZ_CHECK(b != NULL, "out of memory");
    uint8_t nccl_id[128];
    for (size_t i = 0; i < sizeof nccl_id; i++)
        nccl_id[i] = (uint8_t)(i * 37 + 11);

    /* Four daemons meet: three joins, then each joiner's answer. */
    b->data[b->len++] = 3; /* world 4 */
    for (uint32_t r = 1; r < 4; r++) {
        char ep[64];
        snprintf(ep, sizeof ep, "tcp://10.0.0.%u:%u", r + 1, 20000 + r);
        put_join(b, r, 4, JOB, ep);
    }
    for (uint8_t r = 0; r < 3; r++)
        put_table(b, (uint8_t)(1 | r << 1), 4, NULL, 0);
    emit(ctx, "meet-4", b->data, b->len);

    /* nccl: the unique id travels as the blob. */
    b->len = 0;
    b->data[b->len++] = 1; /* world 2 */
    put_join(b, 1, 2, JOB, "tcp://10.0.0.2:*");
    put_table(b, 1, 2, nccl_id, sizeof nccl_id);
    emit(ctx, "meet-2-nccl", b->data, b->len);

    /* What rank 0 must refuse: another job, a rank twice, a rank outside,
     * another world size; and a refusal as a joiner reads it. */
    b->len = 0;
    b->data[b->len++] = 7; /* world 8 */
    put_join(b, 3, 8, JOB + 1, "tcp://10.0.0.4:1");
    put_join(b, 3, 8, JOB, "tcp://10.0.0.4:1");
    put_join(b, 3, 8, JOB, "tcp://10.0.0.4:2");
    put_join(b, 8, 8, JOB, "tcp://10.0.0.9:1");
    put_join(b, 0, 8, JOB, "tcp://10.0.0.1:1");
    put_join(b, 2, 9, JOB, "tcp://10.0.0.3:1");
    put_refusal(b, 1);
    emit(ctx, "refusals", b->data, b->len);

    /* An authenticated job: sealed under the job's key, with CURVE keys;
     * then the same under auth secret read unsealed (all refused); then a
     * join without a key where rank 0 has one. */
    make_keys();
    for (int mode = 1; mode <= 2; mode++) {
        b->len = 0;
        b->data[b->len++] = (uint8_t)(3 | 1 << 4 | mode << 5); /* world 4, keys */
        for (uint32_t r = 1; r < 4; r++) {
            char ep[64];
            snprintf(ep, sizeof ep, "tcp://10.0.0.%u:%u", r + 1, 20000 + r);
            put_join_key(b, r, 4, JOB, ep, s_keys[r]);
        }
        for (uint8_t r = 0; r < 3; r++)
            put_table_keys(b, (uint8_t)(1 | r << 1), 4, NULL, 0, 1);
        put_join(b, 2, 4, JOB, "tcp://10.0.0.3:1");
        emit(ctx, mode == 1 ? "meet-4-sealed-keys" : "meet-4-unsealed", b->data, b->len);
    }
    free(b);
}
