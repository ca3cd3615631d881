/* cpu_seg.c - the segmented kernels of scape_seg.h on the CPU, in order.
 *
 * Each kernel does, one element after another, what its CUDA version does
 * with one thread per element (or word, or position): the element work is
 * scape_seg.h's, shared with cuda_seg.cu; what differs is only how a
 * prefix over the mask is counted (running here, a block scan there) and
 * that counters here need no atomics.
 */
#include <string.h>

#include "scape_seg.h"

static uint32_t popc(uint32_t x) { return (uint32_t)__builtin_popcount(x); }

/* Set bits of the mask before word w, from the scan from word 0. */
static uint64_t bits_before(const kseg_args *a, uint64_t w)
{
    uint64_t tile0 = w / KSEG_TILE * KSEG_TILE, n = a->tiles[w / KSEG_TILE];
    for (uint64_t q = tile0; q < w; q++)
        n += popc(a->mask[q]);
    return n;
}

static void note(kseg_status *st, const kseg_acc *acc)
{
    if (st == NULL)
        return;
    st->err |= acc->err;
    st->norm2 += acc->norm2;
}

static void scan(const kseg_args *a)
{
    uint64_t nw = a->w1 - a->w0, nt = kseg_tiles(nw), acc = 0;
    for (uint64_t i = 0; i < nt; i++) {
        a->tiles[i] = (uint32_t)acc;
        uint64_t end = (i + 1) * KSEG_TILE < nw ? (i + 1) * KSEG_TILE : nw;
        for (uint64_t q = i * KSEG_TILE; q < end; q++)
            acc += popc(a->mask[a->w0 + q]);
    }
    a->tiles[nt] = (uint32_t)acc;
}

/* The elements of words [w0, w1), in order. */
static void word_range(kseg_kernel op, const kseg_args *a)
{
    kseg_acc acc = { 0.0, 0 };
    if (a->w1 <= a->w0)
        return;
    uint64_t before = a->mask ? bits_before(a, a->w0) : 0;
    uint32_t j = kseg_find(a->t, 0, a->nt, a->w0);
    for (uint64_t w = a->w0; w < a->w1; w++) {
        while (j + 1 < a->nt && a->t[j + 1].word <= w)
            j++;
        const kseg_tensor *t = &a->t[j];
        uint64_t base = (w - t->word) * 32;
        uint32_t len = t->len - base < 32 ? (uint32_t)(t->len - base) : 32u;
        uint32_t bits = a->mask ? a->mask[w] : 0xffffffffu;
        for (uint32_t l = 0; l < len; l++) {
            int on = (bits >> l) & 1u;
            uint64_t idx = a->mask ? before + popc(bits & ((1u << l) - 1u)) : t->pos + base + l;
            kseg_elem(op, a, t, base + l, on, idx, &acc);
        }
        if (a->mask)
            before += popc(bits);
    }
    note(a->status, &acc);
}

static void gsum(const kseg_args *a)
{
    for (uint64_t i = 0; i < a->n; i++)
        a->out[i] = kseg_grad(a, i);
}

static void churn(const kseg_args *a)
{
    uint64_t fresh = 0, total = 0;
    for (uint64_t w = a->w0; w < a->w1; w++) {
        fresh += popc(a->mask[w] & ~a->prev[w]);
        total += popc(a->mask[w]);
    }
    a->status->churn[0] += fresh;
    a->status->churn[1] += total;
}

/* The chunks' totals, then their sum in order (the CUDA version's two
 * kernels). */
static void sqsum(const kseg_args *a)
{
    uint64_t nc = kseg_sq_chunks(a->n);
    for (uint64_t c = 0; c < nc; c++) {
        uint64_t left = a->n - c * SCAPE_SQ_CHUNK;
        a->sq[c] = scape_f_sqsum_chunk(a->in + c * SCAPE_SQ_CHUNK,
                                       left < SCAPE_SQ_CHUNK ? left : SCAPE_SQ_CHUNK, a->div);
    }
    double total = 0.0;
    for (uint64_t c = 0; c < nc; c++)
        total += a->sq[c];
    *a->sq_total = total;
}

/* ---- top-k ------------------------------------------------------------------ */

/* Call fn(key, bit, word index within the item) for every element of item it. */
#define ITEM_KEYS(a, it, body)                                                   \
    do {                                                                         \
        const kseg_tensor *t_ = &(a)->t[(a)->first + (it)->sel];                 \
        for (uint32_t q_ = 0; q_ < (it)->nwords; q_++) {                         \
            uint64_t w_ = (it)->word + q_, base_ = (w_ - t_->word) * 32;         \
            uint32_t n_ = t_->len - base_ < 32 ? (uint32_t)(t_->len - base_) : 32u; \
            for (uint32_t l_ = 0; l_ < n_; l_++) {                               \
                uint32_t key = (a)->keys[t_->pos + base_ + l_ - (a)->key_lo];    \
                uint32_t bit = l_, wq = q_;                                      \
                (void)bit;                                                       \
                (void)wq;                                                        \
                body;                                                            \
            }                                                                    \
        }                                                                        \
    } while (0)

static void topk_hist(const kseg_topk_args *a)
{
    for (uint32_t i = 0; i < a->nitems; i++) {
        const kseg_item *it = &a->items[i];
        const kseg_tstate *s = &a->st[it->sel];
        uint32_t *h = a->hist + (size_t)it->sel * KSEG_BINS0;
        ITEM_KEYS(a, it, if (kseg_in_prefix(s, key, a->level)) h[kseg_digit(key, a->level)]++);
    }
}

static void topk_pick(const kseg_topk_args *a)
{
    uint32_t bins = a->level == 0 ? KSEG_BINS0 : KSEG_BINS;
    for (uint32_t s = 0; s < a->nsel; s++) {
        kseg_tstate *st = &a->st[s];
        const uint32_t *h = a->hist + (size_t)s * KSEG_BINS0;
        uint32_t need = a->level == 0 ? a->t[a->first + s].k : st->need, above;
        uint32_t d = kseg_pick(h, bins, need, &above);
        kseg_record_digit(st, a->level, d, need - above, h[d]);
    }
}

static void topk_count(const kseg_topk_args *a)
{
    for (uint32_t i = 0; i < a->nitems; i++) {
        const kseg_item *it = &a->items[i];
        const kseg_tstate *s = &a->st[it->sel];
        uint32_t n = 0;
        if (s->need < s->eq_total)
            ITEM_KEYS(a, it, n += key == s->tau);
        a->item_eq[i] = n;
    }
}

static void topk_scan(const kseg_topk_args *a)
{
    for (uint32_t s = 0; s < a->nsel; s++) {
        uint32_t acc = 0;
        for (uint32_t i = a->item0[s]; i < a->item0[s + 1]; i++) {
            uint32_t c = a->item_eq[i];
            a->item_eq[i] = acc;
            acc += c;
        }
    }
}

static void topk_write(const kseg_topk_args *a)
{
    for (uint32_t i = 0; i < a->nitems; i++) {
        const kseg_item *it = &a->items[i];
        const kseg_tstate *s = &a->st[it->sel];
        uint32_t gt[KSEG_TILE], eq[KSEG_TILE];
        memset(gt, 0, sizeof gt);
        memset(eq, 0, sizeof eq);
        ITEM_KEYS(a, it, {
            gt[wq] |= (uint32_t)(key > s->tau) << bit;
            eq[wq] |= (uint32_t)(key == s->tau) << bit;
        });
        uint32_t off = a->item_eq[i];
        for (uint32_t q = 0; q < it->nwords; q++) {
            a->mask[it->word + q] = kseg_topk_word(s, gt[q], eq[q], off);
            off += popc(eq[q]);
        }
    }
}

/* ---- mask code ----------------------------------------------------------------- */

static void put_bits(uint32_t *code, uint64_t at, uint32_t v, uint32_t b)
{
    uint32_t lo, hi;
    int spans;
    kseg_bits_split(at, v, b, &lo, &hi, &spans);
    code[at >> 5] |= lo;
    if (spans)
        code[(at >> 5) + 1] |= hi;
}

static void bad(const kseg_code_args *a, uint32_t tensor, uint32_t what)
{
    uint64_t b = kseg_bad(a->rank, tensor, what);
    a->status->err |= KSEG_E_CODE;
    if (b < a->status->first)
        a->status->first = b;
}

/* The code is zeroed by the caller; the bits go in where the plan says. */
static void encode(const kseg_code_args *a)
{
    for (uint32_t ci = 0; ci < a->nc; ci++) {
        const kseg_code *c = &a->c[ci];
        const kseg_tensor *t = &a->t[c->tensor];
        uint64_t nw = kseg_words_of(t), q = 0;
        int past = 0; /* a bit past the tensor's end: refused, as maskcode.c does */
        if (!c->by_index) {
            memcpy(a->code + c->at, a->words + t->word, nw * sizeof(uint32_t));
            continue;
        }
        for (uint64_t w = 0; w < nw; w++)
            for (uint32_t x = a->words[t->word + w]; x; x &= x - 1, q++) {
                uint32_t i = (uint32_t)(32 * w) + (uint32_t)__builtin_ctz(x);
                past |= i >= t->len;
                if (q < t->k && i < t->len)
                    put_bits(a->code, c->at + q * c->bits, i, c->bits);
            }
        if (q != t->k || past)
            bad(a, c->tensor, KSEG_BAD_K);
    }
}

static void decode_zero(const kseg_code_args *a)
{
    for (uint32_t ci = 0; ci < a->nc; ci++) {
        const kseg_tensor *t = &a->t[a->c[ci].tensor];
        if (a->c[ci].by_index && !a->merge)
            memset(a->words + t->word, 0, kseg_words_of(t) * sizeof(uint32_t));
    }
}

static void decode_map(const kseg_code_args *a)
{
    for (uint32_t ci = 0; ci < a->nc; ci++) {
        const kseg_code *c = &a->c[ci];
        const kseg_tensor *t = &a->t[c->tensor];
        if (c->by_index)
            continue;
        uint64_t nw = kseg_words_of(t);
        for (uint64_t q = 0; q < nw; q++) {
            uint32_t x = a->code[c->at + q];
            if (q + 1 == nw && (t->len & 31) && (x >> (t->len & 31)))
                bad(a, c->tensor, KSEG_BAD_TAIL);
            a->count[ci] += popc(x);
            uint32_t *w = &a->words[t->word + q];
            *w = a->merge ? *w | x : x;
        }
    }
}

static void decode_pos(const kseg_code_args *a)
{
    for (uint32_t ci = 0; ci < a->nc; ci++) {
        const kseg_code *c = &a->c[ci];
        const kseg_tensor *t = &a->t[c->tensor];
        if (!c->by_index)
            continue;
        for (uint32_t q = 0; q < t->k; q++) {
            uint32_t p = kseg_bits_get(a->code, c->at + (uint64_t)q * c->bits, c->bits);
            uint32_t prev = q ? kseg_bits_get(a->code, c->at + (uint64_t)(q - 1) * c->bits,
                                              c->bits) : 0;
            if (p >= t->len || (q && p <= prev)) {
                bad(a, c->tensor, KSEG_BAD_ORDER);
                continue;
            }
            a->words[t->word + p / 32] |= 1u << (p % 32);
        }
    }
}

static void decode_check(const kseg_code_args *a)
{
    for (uint32_t ci = 0; ci < a->nc; ci++)
        if (!a->c[ci].by_index && a->count[ci] != a->t[a->c[ci].tensor].k)
            bad(a, a->c[ci].tensor, KSEG_BAD_COUNT);
    uint64_t end = a->map_words * 32 + a->pos_bits;
    for (uint64_t b = end; b < a->code_words * 32; b++)
        if ((a->code[b >> 5] >> (b & 31)) & 1u) {
            bad(a, 0xffffffu, KSEG_BAD_PADDING);
            break;
        }
}

/* ---- dispatch --------------------------------------------------------------------- */

size_t kseg_args_bytes(kseg_kernel k)
{
    if (k >= KSEG_TOPK_HIST && k <= KSEG_TOPK_WRITE)
        return sizeof(kseg_topk_args);
    if (k >= KSEG_ENCODE && k < KSEG_NKERNELS)
        return sizeof(kseg_code_args);
    return sizeof(kseg_args);
}

scape_rc kseg_run_cpu(kseg_kernel k, const void *args)
{
    const kseg_args *a = args;
    const kseg_topk_args *tk = args;
    const kseg_code_args *ca = args;
    switch (k) {
    case KSEG_SCAN: scan(a); break;
    case KSEG_PACK:
    case KSEG_UPDATE:
    case KSEG_COMPACT:
    case KSEG_WRITEBACK:
    case KSEG_LOAD_THETA: word_range(k, a); break;
    case KSEG_GSUM: gsum(a); break;
    case KSEG_CHURN: churn(a); break;
    case KSEG_SQSUM: sqsum(a); break;
    case KSEG_TOPK_HIST: topk_hist(tk); break;
    case KSEG_TOPK_PICK: topk_pick(tk); break;
    case KSEG_TOPK_COUNT: topk_count(tk); break;
    case KSEG_TOPK_SCAN: topk_scan(tk); break;
    case KSEG_TOPK_WRITE: topk_write(tk); break;
    case KSEG_ENCODE: encode(ca); break;
    case KSEG_DECODE_ZERO: decode_zero(ca); break;
    case KSEG_DECODE_MAP: decode_map(ca); break;
    case KSEG_DECODE_POS: decode_pos(ca); break;
    case KSEG_DECODE_CHECK: decode_check(ca); break;
    default:
        return scape_set_error(SCAPE_INVALID, "kseg_run_cpu: unknown kernel %d", (int)k);
    }
    return SCAPE_OK;
}
