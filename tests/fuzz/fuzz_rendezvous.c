/* fuzz_rendezvous.c - what the daemons of a job tell each other when they
 * meet (daemon/rendezvous.c): the joins rank 0 receives on its TCP port from
 * anyone who can reach it, and the answer each joiner gets back.
 *
 * Input: a world size byte, then records (fuzz.h): selector bit 0 clear, a
 * join that this input's rank 0 judges (joins accumulate, as at a real
 * rendezvous); set, rank 0's answer as a joiner of rank 1 + (selector >> 1)
 * reads it.
 *
 * Checked for every input, beyond "no crash":
 *   - rank 0 takes a join only for a rank in [1, world) it has not taken yet,
 *     and records that rank's endpoint, nothing else;
 *   - a joiner that takes an answer has an endpoint for every rank;
 *   - every refusal says why.
 */
#include <string.h>

#include "fuzz.h"
#include "rendezvous.h"
#include "scape.pb-c.h"

#define JOB 20261130u

void fuzz_setup(void) {}

static void fresh(rdv_result *r, int world)
{
    memset(r, 0, sizeof *r);
    r->world = world;
    r->endpoints = calloc((size_t)world, sizeof *r->endpoints);
    FUZZ_CHECK(r->endpoints != NULL, "out of memory");
}

static int taken(const rdv_result *r)
{
    int n = 0;
    for (int i = 0; i < r->world; i++)
        n += r->endpoints[i] != NULL;
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_in in = { data, size };
    int world = 1 + (int)(fuzz_u8(&in) % 16);
    rdv_opts o = { .rank = 0, .world = world, .coordinator = "tcp://127.0.0.1:1",
                   .endpoint = "tcp://127.0.0.1:2", .job = JOB, .timeout_ms = 1000 };
    rdv_result root;
    fresh(&root, world);
    int joined = 0;
    uint32_t sel;
    const uint8_t *p;
    size_t n;
    while (fuzz_record(&in, &sel, &p, &n)) {
        if ((sel & 1) == 0) {
            int rank = -1;
            scape_rc rc = rdv_judge_join(&o, p, n, &root, &rank);
            if (rc == SCAPE_OK) {
                FUZZ_CHECK(rank >= 1 && rank < world, "took rank %d of world %d", rank, world);
                joined++;
            } else {
                FUZZ_CHECK(scape_last_error()[0] != '\0', "a join refused without a reason");
            }
            FUZZ_CHECK(taken(&root) == joined, "%d endpoints recorded for %d joins",
                       taken(&root), joined);
            continue;
        }
        rdv_opts jo = o;
        jo.rank = 1 + (int)(sel >> 1) % (world > 1 ? world - 1 : 1);
        rdv_result mine;
        fresh(&mine, world);
        if (rdv_read_reply(&jo, p, n, &mine) == SCAPE_OK) {
            FUZZ_CHECK(taken(&mine) == world, "an answer taken with %d of %d endpoints",
                       taken(&mine), world);
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

static void put_join(fuzz_buf *b, uint32_t rank, uint32_t world, uint64_t job, const char *ep)
{
    Scape__RdvJoin j = SCAPE__RDV_JOIN__INIT;
    j.protocol = 1;
    j.job = job;
    j.rank = rank;
    j.world = world;
    j.endpoint = (char *)ep;
    uint8_t buf[512];
    size_t len = scape__rdv_join__pack(&j, buf);
    fuzz_put(b, 0, buf, len);
}

static void put_table(fuzz_buf *b, uint8_t sel, int world, const void *blob, size_t blob_len)
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
    Scape__RdvReply r = SCAPE__RDV_REPLY__INIT;
    r.status = SCAPE__STATUS__OK;
    r.table = &t;
    uint8_t buf[2048];
    size_t len = scape__rdv_reply__pack(&r, buf);
    fuzz_put(b, sel, buf, len);
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
    free(b);
}
