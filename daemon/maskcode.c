/* maskcode.c - bitmap words or fixed-width positions per tensor; see maskcode.h. */
#include "maskcode.h"

#include <string.h>

#include "try.h"

static size_t words_of(const plan_tensor *t) { return (t->len + 31) / 32; }

unsigned mcode_pos_bits(size_t len)
{
    unsigned b = 1;
    while (b < 64 && (len - 1) >> b)
        b++;
    return b;
}

int mcode_by_index(const plan_tensor *t)
{
    return t->k * mcode_pos_bits(t->len) < 32 * words_of(t); /* k <= len < 2^57: no overflow */
}

static const plan_tensor *at(const plan *p, size_t j) { return &p->t[p->order[j]]; }

size_t mcode_bytes(const plan *p, size_t first, size_t count)
{
    size_t words = 0, bits = 0;
    for (size_t j = first; j < first + count; j++) {
        const plan_tensor *t = at(p, j);
        if (mcode_by_index(t))
            bits += t->k * mcode_pos_bits(t->len);
        else
            words += words_of(t);
    }
    return 4 * (words + (bits + 31) / 32);
}

/* ---- bit stream: little-endian, 32 bits at a time --------------------------- */

typedef struct bitw {
    uint32_t *out;
    uint64_t acc;
    unsigned n; /* bits in acc, < 32 between calls */
} bitw;

static void put(bitw *w, uint64_t v, unsigned b)
{
    while (b) {
        unsigned take = b > 32 ? 32 : b;
        uint64_t part = v & ((1ull << take) - 1);
        w->acc |= part << w->n;
        w->n += take;
        if (w->n >= 32) {
            *w->out++ = (uint32_t)w->acc;
            w->acc >>= 32;
            w->n -= 32;
        }
        v >>= take;
        b -= take;
    }
}

static void put_flush(bitw *w)
{
    if (w->n)
        *w->out++ = (uint32_t)w->acc;
    w->acc = 0;
    w->n = 0;
}

typedef struct bitr {
    const uint32_t *in, *end;
    uint64_t acc;
    unsigned n;
} bitr;

static int get(bitr *r, unsigned b, uint64_t *v)
{
    uint64_t out = 0;
    unsigned have = 0;
    while (have < b) {
        if (r->n == 0) {
            if (r->in == r->end)
                return -1;
            r->acc = *r->in++;
            r->n = 32;
        }
        unsigned take = b - have < r->n ? b - have : r->n;
        out |= (r->acc & ((1ull << take) - 1)) << have;
        r->acc >>= take;
        r->n -= take;
        have += take;
    }
    *v = out;
    return 0;
}

/* ---- encode / decode --------------------------------------------------------- */

scape_rc mcode_encode(const plan *p, size_t first, size_t count, const uint32_t *words,
                      uint32_t *out)
{
    size_t w0 = count ? at(p, first)->word : 0;
    uint32_t *o = out;
    for (size_t j = first; j < first + count; j++) {
        const plan_tensor *t = at(p, j);
        if (!mcode_by_index(t)) {
            memcpy(o, words + (t->word - w0), words_of(t) * sizeof *o);
            o += words_of(t);
        }
    }
    bitw w = { o, 0, 0 };
    for (size_t j = first; j < first + count; j++) {
        const plan_tensor *t = at(p, j);
        if (!mcode_by_index(t))
            continue;
        const uint32_t *tw = words + (t->word - w0);
        unsigned b = mcode_pos_bits(t->len);
        size_t got = 0;
        for (size_t i = 0; i < words_of(t); i++)
            for (uint32_t x = tw[i]; x; x &= x - 1, got++) {
                size_t pos = 32 * i + (size_t)__builtin_ctz(x);
                if (got == t->k || pos >= t->len)
                    return scape_set_error(SCAPE_INVALID,
                                           "mask code: tensor %s has more than k=%zu bits",
                                           t->name, t->k);
                put(&w, pos, b);
            }
        if (got != t->k)
            return scape_set_error(SCAPE_INVALID, "mask code: tensor %s has %zu bits, k=%zu",
                                   t->name, got, t->k);
    }
    put_flush(&w);
    return SCAPE_OK;
}

static scape_rc bad(int from, const plan_tensor *t, const char *what)
{
    return scape_set_error(SCAPE_PROTO, "mask from rank %d: tensor %s: %s", from,
                           t ? t->name : "-", what);
}

scape_rc mcode_decode(const plan *p, size_t first, size_t count, const uint32_t *code,
                      size_t nbytes, uint32_t *words, int merge, int from)
{
    if (nbytes != mcode_bytes(p, first, count))
        return scape_set_error(SCAPE_PROTO, "mask from rank %d: %zu bytes, the plan says %zu",
                               from, nbytes, mcode_bytes(p, first, count));
    size_t w0 = count ? at(p, first)->word : 0;
    const uint32_t *c = code;
    for (size_t j = first; j < first + count; j++) {
        const plan_tensor *t = at(p, j);
        if (mcode_by_index(t))
            continue;
        size_t nw = words_of(t), ones = 0;
        if (t->len % 32 && c[nw - 1] >> (t->len % 32))
            return bad(from, t, "bits set past the tensor's end");
        for (size_t i = 0; i < nw; i++)
            ones += (size_t)__builtin_popcount(c[i]);
        if (ones != t->k)
            return bad(from, t, "not exactly k bits");
        uint32_t *tw = words + (t->word - w0);
        for (size_t i = 0; i < nw; i++)
            tw[i] = merge ? tw[i] | c[i] : c[i];
        c += nw;
    }
    bitr r = { c, code + nbytes / 4, 0, 0 };
    for (size_t j = first; j < first + count; j++) {
        const plan_tensor *t = at(p, j);
        if (!mcode_by_index(t))
            continue;
        uint32_t *tw = words + (t->word - w0);
        if (!merge)
            memset(tw, 0, words_of(t) * sizeof *tw);
        unsigned b = mcode_pos_bits(t->len);
        uint64_t prev = 0;
        for (size_t q = 0; q < t->k; q++) {
            uint64_t pos;
            if (get(&r, b, &pos) != 0)
                return bad(from, t, "code ends early");
            if (pos >= t->len || (q && pos <= prev))
                return bad(from, t, "positions not ascending inside the tensor");
            tw[pos / 32] |= 1u << (pos % 32);
            prev = pos;
        }
    }
    if ((r.n && r.acc) || r.in != r.end)
        return bad(from, NULL, "padding is not zero");
    return SCAPE_OK;
}

/* ---- deltas ------------------------------------------------------------------ */

/* Bits set in a but not in b over one tensor's words. */
static size_t only_in(const uint32_t *a, const uint32_t *b, size_t nw)
{
    size_t c = 0;
    for (size_t i = 0; i < nw; i++)
        c += (size_t)__builtin_popcount(a[i] & ~b[i]);
    return c;
}

/* One tensor's bits in the delta stream: whole (its k positions, or its
 * bitmap of len bits, as the fixed code has it), or as its change. */
static uint64_t whole_bits(const plan_tensor *t)
{
    return mcode_by_index(t) ? (uint64_t)t->k * mcode_pos_bits(t->len) : (uint64_t)t->len;
}

static uint64_t change_bits(const plan_tensor *t, size_t left, size_t joined)
{
    uint64_t b = mcode_pos_bits(t->len);
    return 2 * (b + 1) + b * (uint64_t)(left + joined);
}

/* Whether tensor t goes as its change (1) or whole (0): the smaller, whole
 * on a tie; and the bits it takes, its form bit included. */
static int by_change(const plan_tensor *t, const uint32_t *prev, const uint32_t *next,
                     uint64_t *bits)
{
    size_t nw = words_of(t);
    uint64_t c = change_bits(t, only_in(prev, next, nw), only_in(next, prev, nw));
    uint64_t w = whole_bits(t);
    *bits = 1 + (c < w ? c : w);
    return c < w;
}

size_t mdelta_bytes(const plan *p, size_t first, size_t count, const uint32_t *prev,
                    const uint32_t *next)
{
    size_t w0 = count ? at(p, first)->word : 0;
    uint64_t bits = 0;
    for (size_t j = first; j < first + count; j++) {
        const plan_tensor *t = at(p, j);
        uint64_t tb;
        by_change(t, prev + (t->word - w0), next + (t->word - w0), &tb);
        bits += tb;
    }
    return 4 * (size_t)((bits + 31) / 32);
}

/* The positions of the bits of a not in b, ascending. */
static void put_only_in(bitw *w, const uint32_t *a, const uint32_t *b, size_t nw, unsigned bits)
{
    for (size_t i = 0; i < nw; i++)
        for (uint32_t x = a[i] & ~b[i]; x; x &= x - 1)
            put(w, 32 * i + (size_t)__builtin_ctz(x), bits);
}

scape_rc mdelta_encode(const plan *p, size_t first, size_t count, const uint32_t *prev,
                       const uint32_t *next, uint32_t *out)
{
    size_t w0 = count ? at(p, first)->word : 0;
    bitw w = { out, 0, 0 };
    for (size_t j = first; j < first + count; j++) {
        const plan_tensor *t = at(p, j);
        size_t o = t->word - w0, nw = words_of(t);
        unsigned b = mcode_pos_bits(t->len);
        size_t ones = 0;
        for (size_t i = 0; i < nw; i++)
            ones += (size_t)__builtin_popcount(next[o + i]);
        if (ones != t->k || (t->len % 32 && next[o + nw - 1] >> (t->len % 32)))
            return scape_set_error(SCAPE_INVALID, "mask delta: tensor %s has %zu bits in "
                                   "range, k=%zu", t->name, ones, t->k);
        uint64_t tb;
        int change = by_change(t, prev + o, next + o, &tb);
        put(&w, (uint64_t)change, 1);
        if (change) {
            put(&w, only_in(prev + o, next + o, nw), b + 1);
            put(&w, only_in(next + o, prev + o, nw), b + 1);
            put_only_in(&w, prev + o, next + o, nw, b);
            put_only_in(&w, next + o, prev + o, nw, b);
        } else if (mcode_by_index(t)) {
            for (size_t i = 0; i < nw; i++)
                for (uint32_t x = next[o + i]; x; x &= x - 1)
                    put(&w, 32 * i + (size_t)__builtin_ctz(x), b);
        } else {
            for (size_t i = 0; i < nw; i++)
                put(&w, next[o + i], i + 1 < nw || t->len % 32 == 0 ? 32 : t->len % 32);
        }
    }
    put_flush(&w);
    return SCAPE_OK;
}
/* n ascending positions of one list: each inside the tensor, its bit in tw
 * `want` (1: a position that left, 0: one that joined), then flipped. */
static scape_rc take_list(bitr *r, const plan_tensor *t, unsigned b, uint64_t n, uint32_t *tw,
                          int want, int from)
{
    uint64_t last = 0;
    for (uint64_t q = 0; q < n; q++) {
        uint64_t pos;
        if (get(r, b, &pos) != 0)
            return bad(from, t, "delta ends early");
        if (pos >= t->len || (q && pos <= last))
            return bad(from, t, "delta positions not ascending inside the tensor");
        if ((int)((tw[pos / 32] >> (pos % 32)) & 1u) != want)
            return bad(from, t, want ? "a position left the mask that was not in it"
                                     : "a position joined the mask that was already in it");
        tw[pos / 32] ^= 1u << (pos % 32);
        last = pos;
    }
    return SCAPE_OK;
}

/* A tensor sent whole in the delta stream: its k ascending positions, or
 * its bitmap of len bits; exactly k bits either way. */
static scape_rc take_whole(bitr *r, const plan_tensor *t, uint32_t *tw, int from)
{
    size_t nw = words_of(t);
    memset(tw, 0, nw * sizeof *tw);
    if (mcode_by_index(t)) {
        unsigned b = mcode_pos_bits(t->len);
        uint64_t last = 0;
        for (size_t q = 0; q < t->k; q++) {
            uint64_t pos;
            if (get(r, b, &pos) != 0)
                return bad(from, t, "delta ends early");
            if (pos >= t->len || (q && pos <= last))
                return bad(from, t, "positions not ascending inside the tensor");
            tw[pos / 32] |= 1u << (pos % 32);
            last = pos;
        }
        return SCAPE_OK;
    }
    size_t ones = 0;
    for (size_t i = 0; i < nw; i++) {
        uint64_t v;
        if (get(r, i + 1 < nw || t->len % 32 == 0 ? 32 : (unsigned)(t->len % 32), &v) != 0)
            return bad(from, t, "delta ends early");
        tw[i] = (uint32_t)v;
        ones += (size_t)__builtin_popcount(tw[i]);
    }
    return ones == t->k ? SCAPE_OK : bad(from, t, "not exactly k bits");
}

scape_rc mdelta_decode(const plan *p, size_t first, size_t count, const uint32_t *prev,
                       const uint32_t *code, size_t nbytes, uint32_t *words, int from)
{
    if (nbytes % 4)
        return scape_set_error(SCAPE_PROTO, "mask delta from rank %d: %zu bytes, not whole "
                               "words", from, nbytes);
    size_t w0 = count ? at(p, first)->word : 0;
    bitr r = { code, code + nbytes / 4, 0, 0 };
    for (size_t j = first; j < first + count; j++) {
        const plan_tensor *t = at(p, j);
        size_t o = t->word - w0, nw = words_of(t);
        unsigned b = mcode_pos_bits(t->len);
        uint32_t *tw = words + o;
        uint64_t change;
        if (get(&r, 1, &change) != 0)
            return bad(from, t, "delta ends early");
        if (!change) {
            TRY(take_whole(&r, t, tw, from));
            continue;
        }
        memcpy(tw, prev + o, nw * sizeof *tw);
        uint64_t left, joined;
        if (get(&r, b + 1, &left) != 0 || get(&r, b + 1, &joined) != 0)
            return bad(from, t, "delta ends early");
        if (left > t->len || joined > t->len)
            return bad(from, t, "delta counts past the tensor's length");
        TRY(take_list(&r, t, b, left, tw, 1, from));
        TRY(take_list(&r, t, b, joined, tw, 0, from));
        size_t ones = 0;
        for (size_t i = 0; i < nw; i++)
            ones += (size_t)__builtin_popcount(tw[i]);
        if (ones != t->k)
            return bad(from, t, "not exactly k bits after the delta");
    }
    if ((r.n && r.acc) || r.in != r.end)
        return bad(from, NULL, "padding is not zero");
    return SCAPE_OK;
}
