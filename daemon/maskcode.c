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

/* Bits set in a but not in b over one tensor's words (b NULL: none). */
static size_t only_in(const uint32_t *a, const uint32_t *b, size_t nw)
{
    size_t c = 0;
    for (size_t i = 0; i < nw; i++)
        c += (size_t)__builtin_popcount(a[i] & ~(b ? b[i] : 0u));
    return c;
}

/* The Rice parameter of m ascending indices in [0, u), from u and m alone
 * (so it is not sent): floor(log2) of their mean gap. */
static unsigned rice_r(size_t u, size_t m)
{
    uint64_t mean = m ? (uint64_t)(u - m) / (m + 1) : 0;
    unsigned r = 0;
    while (r < 40 && (2ull << r) <= mean)
        r++;
    return r;
}

/* Bits to hold a count in [0, n]. */
static unsigned count_bits(size_t n)
{
    unsigned b = 0;
    while (b < 64 && n >> b)
        b++;
    return b;
}

/* The positions a list's indices count, word i of a tensor: the set bits
 * of sw (inv 0), its clear bits inside the tensor (inv ~0), or every
 * position (sw NULL). */
typedef struct lsel {
    const uint32_t *sw;
    uint32_t inv;
} lsel;

static const lsel EVERY = { NULL, 0 };

static uint32_t sel_word(lsel s, const plan_tensor *t, size_t i)
{
    uint32_t x = s.sw ? s.sw[i] ^ s.inv : 0xffffffffu;
    if (i + 1 == words_of(t) && t->len % 32)
        x &= (1u << (t->len % 32)) - 1;
    return x;
}

static size_t sel_count(lsel s, const plan_tensor *t)
{
    size_t c = 0;
    for (size_t i = 0; i < words_of(t); i++)
        c += (size_t)__builtin_popcount(sel_word(s, t, i));
    return c;
}

/* The positions of a & ~b (b NULL: of a), all of them inside selector s of
 * u positions, as a Rice-coded list of their indices in s: each gap g (the
 * first index, then the distance from the last one minus one) as g >> r one
 * bits and a zero, then g's low r bits.  Returns its bits; writes them too
 * when w is given. */
static uint64_t rice_list(bitw *w, const plan_tensor *t, const uint32_t *a, const uint32_t *b,
                          lsel s, size_t u, size_t m)
{
    unsigned r = rice_r(u, m);
    uint64_t bits = 0, next = 0, base = 0;
    for (size_t i = 0; i < words_of(t); i++) {
        uint32_t sw = sel_word(s, t, i);
        for (uint32_t x = a[i] & ~(b ? b[i] : 0u); x; x &= x - 1) {
            unsigned j = (unsigned)__builtin_ctz(x);
            uint64_t idx = base + (uint64_t)__builtin_popcount(sw & ((1u << j) - 1)), g = idx - next;
            bits += (g >> r) + 1 + r;
            if (w) {
                for (uint64_t q = g >> r; q; q -= q > 32 ? 32 : q)
                    put(w, (q > 32 ? 0xffffffffull : (1ull << q) - 1), q > 32 ? 32 : (unsigned)q);
                put(w, 0, 1);
                if (r)
                    put(w, g & ((1ull << r) - 1), r);
            }
            next = idx + 1;
        }
        base += (uint64_t)__builtin_popcount(sw);
    }
    return bits;
}

/* A tensor's forms in the delta stream (two bits), the shortest chosen,
 * the lowest code on a tie: its positions as a Rice-coded list, its change
 * from prev, or its bitmap.  The change sends how many of prev's kp
 * positions left (count_bits(kp) bits; as many minus kp plus k joined),
 * then those as indices among prev's positions, then the ones that joined
 * as indices among the positions prev does not hold. */
enum { DF_LIST = 0, DF_CHANGE = 1, DF_BITMAP = 2 };

static int delta_form(const plan_tensor *t, const uint32_t *prev, const uint32_t *next,
                      uint64_t *bits)
{
    size_t nw = words_of(t), left = only_in(prev, next, nw), joined = only_in(next, prev, nw);
    lsel held = { prev, 0 }, free_ = { prev, ~0u };
    size_t kp = sel_count(held, t);
    uint64_t f[3] = { rice_list(NULL, t, next, NULL, EVERY, t->len, t->k),
                      count_bits(kp) + rice_list(NULL, t, prev, next, held, kp, left) +
                          rice_list(NULL, t, next, prev, free_, t->len - kp, joined),
                      (uint64_t)t->len };
    int best = 0;
    for (int q = 1; q < 3; q++)
        if (f[q] < f[best])
            best = q;
    *bits = 2 + f[best];
    return best;
}

size_t mdelta_bytes(const plan *p, size_t first, size_t count, const uint32_t *prev,
                    const uint32_t *next)
{
    size_t w0 = count ? at(p, first)->word : 0;
    uint64_t bits = 0;
    for (size_t j = first; j < first + count; j++) {
        const plan_tensor *t = at(p, j);
        uint64_t tb;
        delta_form(t, prev + (t->word - w0), next + (t->word - w0), &tb);
        bits += tb;
    }
    return 4 * (size_t)((bits + 31) / 32);
}

/* A mask must have exactly k bits, none past the tensor's end. */
static scape_rc check_mask(const plan_tensor *t, const uint32_t *m, const char *which)
{
    size_t nw = words_of(t), ones = only_in(m, NULL, nw);
    if (ones != t->k || (t->len % 32 && m[nw - 1] >> (t->len % 32)))
        return scape_set_error(SCAPE_INVALID, "mask delta: %s mask of tensor %s has %zu bits "
                               "in range, k=%zu", which, t->name, ones, t->k);
    return SCAPE_OK;
}

scape_rc mdelta_encode(const plan *p, size_t first, size_t count, const uint32_t *prev,
                       const uint32_t *next, uint32_t *out)
{
    size_t w0 = count ? at(p, first)->word : 0;
    bitw w = { out, 0, 0 };
    for (size_t j = first; j < first + count; j++) {
        const plan_tensor *t = at(p, j);
        size_t o = t->word - w0, nw = words_of(t);
        TRY(check_mask(t, next + o, "the next"));
        if (t->len % 32 && prev[o + nw - 1] >> (t->len % 32))
            return scape_set_error(SCAPE_INVALID, "mask delta: the last mask of tensor %s "
                                   "has bits past its end", t->name);
        uint64_t tb;
        int form = delta_form(t, prev + o, next + o, &tb);
        put(&w, (uint64_t)form, 2);
        if (form == DF_CHANGE) {
            lsel held = { prev + o, 0 }, free_ = { prev + o, ~0u };
            size_t kp = sel_count(held, t), left = only_in(prev + o, next + o, nw);
            put(&w, left, count_bits(kp));
            rice_list(&w, t, prev + o, next + o, held, kp, left);
            rice_list(&w, t, next + o, prev + o, free_, t->len - kp, left + t->k - kp);
        } else if (form == DF_LIST) {
            rice_list(&w, t, next + o, NULL, EVERY, t->len, t->k);
        } else {
            for (size_t i = 0; i < nw; i++)
                put(&w, next[o + i], i + 1 < nw || t->len % 32 == 0 ? 32 : t->len % 32);
        }
    }
    put_flush(&w);
    return SCAPE_OK;
}

/* n indices of a Rice-coded list, ascending and below u (the positions of
 * selector s), each position's bit in tw flipped. */
static scape_rc take_list(bitr *r, const plan_tensor *t, uint64_t n, lsel s, uint64_t u,
                          uint32_t *tw, int from)
{
    unsigned rr = rice_r((size_t)u, (size_t)n);
    uint64_t next = 0, base = 0;
    size_t i = 0, nw = words_of(t);
    for (uint64_t q = 0; q < n; q++) {
        uint64_t ones = 0, bit, low = 0;
        for (;;) {
            if (get(r, 1, &bit) != 0)
                return bad(from, t, "delta ends early");
            if (!bit)
                break;
            if (++ones > (u >> rr))
                return bad(from, t, "a delta index past the positions it counts");
        }
        if (rr && get(r, rr, &low) != 0)
            return bad(from, t, "delta ends early");
        uint64_t idx = next + ((ones << rr) | low);
        if (idx >= u)
            return bad(from, t, "a delta index past the positions it counts");
        uint32_t sw = 0;
        while (i < nw && base + (uint64_t)__builtin_popcount(sw = sel_word(s, t, i)) <= idx) {
            base += (uint64_t)__builtin_popcount(sw);
            i++;
        }
        if (i == nw) /* u is the selector's size: not reached */
            return bad(from, t, "a delta index past the positions it counts");
        for (uint64_t skip = idx - base; skip; skip--)
            sw &= sw - 1;
        tw[i] ^= 1u << __builtin_ctz(sw);
        next = idx + 1;
    }
    return SCAPE_OK;
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
        uint32_t *tw = words + o;
        uint64_t form;
        if (get(&r, 2, &form) != 0)
            return bad(from, t, "delta ends early");
        if (form == DF_CHANGE) {
            lsel held = { prev + o, 0 }, free_ = { prev + o, ~0u };
            size_t kp = sel_count(held, t);
            memcpy(tw, prev + o, nw * sizeof *tw);
            if (t->len % 32)
                tw[nw - 1] &= (1u << (t->len % 32)) - 1;
            uint64_t left;
            if (get(&r, count_bits(kp), &left) != 0)
                return bad(from, t, "delta ends early");
            if (left > kp || left + t->k < kp || left + t->k - kp > t->len - kp)
                return bad(from, t, "delta counts past the tensor's positions");
            TRY(take_list(&r, t, left, held, kp, tw, from));
            TRY(take_list(&r, t, left + t->k - kp, free_, t->len - kp, tw, from));
        } else if (form == DF_LIST) {
            memset(tw, 0, nw * sizeof *tw);
            TRY(take_list(&r, t, t->k, EVERY, t->len, tw, from));
        } else if (form == DF_BITMAP) {
            for (size_t i = 0; i < nw; i++) {
                uint64_t v;
                if (get(&r, i + 1 < nw || t->len % 32 == 0 ? 32 : (unsigned)(t->len % 32),
                        &v) != 0)
                    return bad(from, t, "delta ends early");
                tw[i] = (uint32_t)v;
            }
        } else {
            return bad(from, t, "an unknown form in the delta");
        }
        if (only_in(tw, NULL, nw) != t->k)
            return bad(from, t, "not exactly k bits after the delta");
        /* one mask, one delta: the sender must have taken the shortest form */
        uint64_t tb;
        if (delta_form(t, prev + o, tw, &tb) != (int)form)
            return bad(from, t, "a tensor in a longer form than it needs");
    }
    if ((r.n && r.acc) || r.in != r.end)
        return bad(from, NULL, "padding is not zero");
    return SCAPE_OK;
}
