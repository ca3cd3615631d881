/* config.c - the key table and the ways of filling it.
 *
 * Every key is declared once: the daemon's own in s_own, the engine's on
 * their engine rows (engine.c, eng_keys), which s_own places among its own.
 * s_keys is the two made into one table, in the order --help and cfg_print
 * list them; defaults, parsing, bounds, the SCAPE_* environment, printing,
 * status and --help walk it, and nothing outside them knows a key.
 * The YAML reader only tokenises: it walks libyaml's events over one
 * top-level mapping of scalars and hands each pair to set_key, the setter
 * behind cfg_set, so a value means the same wherever it is written.
 */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <yaml.h>

#include "config.h"
#include "exec.h"
#include "try.h"

#define VALUE_BYTES 2200  /* a printed value: a 511-byte path fully escaped, quoted */
#define PRINT_COLUMN 30   /* where cfg_print starts the doc comments */
#define MAX_KEY_CHARS 64  /* longest key edit_distance compares against */

typedef enum key_type {
    KT_STRING, /* char array of .size bytes */
    KT_DOUBLE,
    KT_FLOAT,  /* bounds apply after rounding to float, the precision kept */
    KT_U32,    /* uint32_t */
    KT_INT,    /* int; read as an unsigned integer, so bounds must be >= 0 */
    KT_ENUM    /* an int-sized enum, text <-> value through .names */
} key_type;

enum {
    CF_STATUS = 1u << 0, /* shown in scapectl status (StatusReply.config) */
    CF_BOOL = 1u << 1,   /* KT_ENUM of false/true: read in every YAML 1.1 spelling */
};

/* A key's row.  An engine key's row is made from its engine row (engine_row):
 * its default stays there (eng_config_default), with what the engine does
 * with it (the checkpoint hash, the handshake), for the engine and the
 * programs that create one without this file. */
typedef struct cfg_key {
    const char *name;
    key_type type;
    size_t offset;                 /* of the field in scaped_config */
    size_t size;                   /* KT_STRING: capacity with the NUL */
    double min, max;               /* numbers: bounds */
    int min_open, max_open;        /* the bound itself is excluded */
    const eng_enum *names;         /* KT_ENUM */
    const char *def;               /* the default as written in a file; NULL: the
                                      engine's */
    unsigned flags;                /* CF_* */
    const char *doc;
    const char *engine_from;       /* s_own only: not a key, but the place of the
                                      engine's keys from this one on (ENGINE_KEYS) */
} cfg_key;

static const eng_enum s_backend_names[] = {
    { "host", COMM_BACKEND_HOST }, { "nccl", COMM_BACKEND_NCCL }, { NULL, 0 },
};
static const eng_enum s_exec_names[] = {
    { "auto", CFG_EXEC_AUTO }, { "host", CFG_EXEC_HOST }, { "cuda", CFG_EXEC_CUDA },
    { "sim", CFG_EXEC_SIM }, { NULL, 0 },
};
static const eng_enum s_auth_names[] = {
    { "auto", CFG_AUTH_AUTO }, { "munge", CFG_AUTH_MUNGE }, { "secret", CFG_AUTH_SECRET },
    { "none", CFG_AUTH_NONE }, { NULL, 0 },
};

const char *cfg_executor_name(cfg_executor x) { return eng_enum_name(s_exec_names, (int)x); }
const char *cfg_auth_name(cfg_auth a) { return eng_enum_name(s_auth_names, (int)a); }
const char *comm_backend_name(comm_backend b) { return eng_enum_name(s_backend_names, (int)b); }

scape_rc comm_backend_parse(const char *s, comm_backend *out)
{
    int v = 0;
    TRY(eng_enum_parse(s_backend_names, "comm_backend", s, out ? &v : NULL));
    *out = (comm_backend)v;
    return SCAPE_OK;
}

scape_rc cfg_resolve_executor(const scaped_config *c, eng_executor *out, const char **why)
{
    const char *no = NULL;
    int cuda = exec_cuda_available(&no);
    *why = "";
    switch (c->executor) {
    case CFG_EXEC_HOST: *out = ENG_EXEC_HOST; return SCAPE_OK;
    case CFG_EXEC_SIM: *out = ENG_EXEC_SIM; return SCAPE_OK;
    case CFG_EXEC_CUDA:
        if (!cuda)
            return scape_set_error(SCAPE_UNSUPPORTED, "executor cuda: %s (set executor: host "
                                   "or auto)", no);
        *out = ENG_EXEC_CUDA;
        return SCAPE_OK;
    default:
        *out = cuda ? ENG_EXEC_CUDA : ENG_EXEC_HOST;
        *why = cuda ? "a GPU is visible and this build has CUDA" : no;
        return SCAPE_OK;
    }
}

/* s is word (lower case) as YAML 1.1 allows it: "yes", "Yes" or "YES". */
static int yaml_spelling(const char *s, const char *word)
{
    size_t n = strlen(word);
    if (strlen(s) != n)
        return 0;
    int lower = 1, capital = toupper((unsigned char)s[0]) == s[0], upper = 1;
    for (size_t i = 0; i < n; i++) {
        lower &= s[i] == word[i];
        upper &= s[i] == toupper((unsigned char)word[i]);
        capital &= i == 0 || s[i] == word[i];
    }
    capital &= tolower((unsigned char)s[0]) == word[0];
    return lower || capital || upper;
}

scape_rc cfg_bool_parse(const char *s, int *out)
{
    static const char *const yes[] = { "true", "yes", "on", "y", "1" },
                             *const no[] = { "false", "no", "off", "n", "0" };
    for (size_t i = 0; s && out && i < sizeof yes / sizeof yes[0]; i++)
        if (yaml_spelling(s, yes[i]) || yaml_spelling(s, no[i])) {
            *out = yaml_spelling(s, yes[i]);
            return SCAPE_OK;
        }
    return scape_set_error(SCAPE_INVALID, "'%s' is not a boolean (true, yes, on, y or 1; "
                           "false, no, off, n or 0; also Capitalised or UPPER case)",
                           s ? s : "(null)");
}


#define OFF(field) offsetof(scaped_config, field)

/* Marks the place of the engine's keys from first (its eng_keys row) up to
 * the next mark's first, or to the last: the engine lists them in the order
 * shown here. */
#define ENGINE_KEYS(first) { .engine_from = (first) }

static const cfg_key s_own[] = {
    { .name = "runtime_dir", .type = KT_STRING, .offset = OFF(runtime_dir),
      .size = sizeof ((scaped_config *)0)->runtime_dir, .def = "",
      .doc = "directory of the control socket and shared memory (\"\" = daemon default)" },
    { .name = "log_level", .type = KT_ENUM, .offset = OFF(log_level),
      .names = log_level_names, .def = "info",
      .doc = "error, warn, info or debug" },
    ENGINE_KEYS("optimizer"),
    { .name = "executor", .type = KT_ENUM, .offset = OFF(executor), .names = s_exec_names,
      .def = "auto", .flags = CF_STATUS,
      .doc = "where the step runs: auto (cuda when built with CUDA and a GPU is visible, else "
             "host), host, cuda, or sim (the cuda executor's code on the CPU, for tests)" },
    ENGINE_KEYS("residual_on_device"),
    { .name = "max_trainers", .type = KT_INT, .offset = OFF(max_trainers), .min = 1,
      .max = 64, .def = "64", .flags = CF_STATUS, .doc = "trainer processes this daemon accepts" },
    { .name = "max_message_bytes", .type = KT_U32, .offset = OFF(max_message_bytes),
      .min = 1024, .max = 64 << 20, .def = "1048576",
      .doc = "largest control message accepted, bytes" },
    { .name = "liveness_ms", .type = KT_INT, .offset = OFF(liveness_ms), .min = 10,
      .max = 60000, .def = "200", .doc = "period of the trainer pid liveness check, ms" },
    { .name = "trainers", .type = KT_INT, .offset = OFF(trainers), .min = 0, .max = 64,
      .def = "0", .flags = CF_STATUS,
      .doc = "trainers that must register before step 1 (0: those attached)" },
    { .name = "world", .type = KT_INT, .offset = OFF(world), .min = 1, .max = 4096,
      .def = "1", .flags = CF_STATUS, .doc = "daemons in the job (one per node)" },
    { .name = "rank", .type = KT_INT, .offset = OFF(rank), .min = 0, .max = 4095,
      .def = "0", .flags = CF_STATUS, .doc = "this daemon's rank in [0, world)" },
    { .name = "coordinator", .type = KT_STRING, .offset = OFF(coordinator),
      .size = sizeof ((scaped_config *)0)->coordinator, .def = "",
      .doc = "rank 0's rendezvous endpoint, e.g. tcp://node1:29517 (world > 1)" },
    { .name = "listen", .type = KT_STRING, .offset = OFF(listen),
      .size = sizeof ((scaped_config *)0)->listen, .def = "",
      .doc = "this daemon's data endpoint: an address, interface or host name, e.g. "
             "tcp://10.0.0.2:* (*: a free port; world > 1)" },
    { .name = "job", .type = KT_U32, .offset = OFF(job), .min = 0, .max = UINT32_MAX,
      .def = "0", .doc = "job id: daemons of another job are refused at rendezvous" },
    { .name = "comm_timeout_ms", .type = KT_INT, .offset = OFF(comm_timeout_ms), .min = 100,
      .max = 3600000, .def = "300000",
      .doc = "longest wait for another daemon, ms (rendezvous and every collective)" },
    { .name = "comm_backend", .type = KT_ENUM, .offset = OFF(backend), .names = s_backend_names,
      .def = "host", .flags = CF_STATUS,
      .doc = "between daemons: host (ZeroMQ TCP) or nccl (the node's GPU)" },
    { .name = "auth", .type = KT_ENUM, .offset = OFF(auth), .names = s_auth_names,
      .def = "auto",
      .doc = "how the job's daemons prove who they are (world > 1): munge, secret (a key "
             "file), none, or auto (munge when a munged answers)" },
    { .name = "auth_key_file", .type = KT_STRING, .offset = OFF(auth_key_file),
      .size = sizeof ((scaped_config *)0)->auth_key_file, .def = "",
      .doc = "auth secret: the job's key, readable only by its user (scaped keygen FILE)" },
    { .name = "munge_socket", .type = KT_STRING, .offset = OFF(munge_socket),
      .size = sizeof ((scaped_config *)0)->munge_socket, .def = "",
      .doc = "munged's socket for auth munge (\"\" = munge's default)" },
    { .name = "cuda_device", .type = KT_INT, .offset = OFF(cuda_device), .min = 0, .max = 63,
      .def = "0", .doc = "CUDA device of the nccl backend and the cuda executor" },
    { .name = "checkpoint_dir", .type = KT_STRING, .offset = OFF(checkpoint_dir),
      .size = sizeof ((scaped_config *)0)->checkpoint_dir, .def = "",
      .doc = "directory of checkpoints, shared by the job's daemons (\"\" = none)" },
    { .name = "checkpoint_every", .type = KT_U32, .offset = OFF(checkpoint_every), .min = 0,
      .max = UINT32_MAX, .def = "0",
      .flags = CF_STATUS,
      .doc = "checkpoint every this many steps (0: on scapectl checkpoint or SIGUSR1 only)" },
    { .name = "checkpoint_keep", .type = KT_INT, .offset = OFF(checkpoint_keep), .min = 1,
      .max = 1000, .def = "2",
      .flags = CF_STATUS,
      .doc = "complete checkpoints kept; older ones are removed (and of those a state_dict "
             "named, as many again)" },
    { .name = "resume", .type = KT_STRING, .offset = OFF(resume),
      .size = sizeof ((scaped_config *)0)->resume, .def = "",
      .doc = "checkpoint to restore when the job starts: a checkpoint_dir or one step-N in it" },
    { .name = "metrics_listen", .type = KT_STRING, .offset = OFF(metrics_listen),
      .size = sizeof ((scaped_config *)0)->metrics_listen, .def = "",
      .doc = "serve Prometheus metrics over HTTP at http://HOST:PORT/metrics: HOST:PORT, "
             ":PORT (every interface) or [IPv6]:PORT (\"\" or off: not served)" },
};

#define NELEM(a) (sizeof (a) / sizeof (a)[0])
#define MAX_KEYS 64 /* the daemon's and the engine's; test_config counts them */

/* s_own and the engine's rows in one table, made once (fill_keys). */
static cfg_key s_keys[MAX_KEYS];
static size_t s_nkeys;
static pthread_once_t s_keys_once = PTHREAD_ONCE_INIT;

/* Key ek's row: its field inside scaped_config.engine, its text form from
 * its type and names. */
static cfg_key engine_row(const eng_key *ek)
{
    static const key_type types[] = {
        [ENG_KT_DOUBLE] = KT_DOUBLE, [ENG_KT_FLOAT] = KT_FLOAT, [ENG_KT_U32] = KT_U32,
        [ENG_KT_INT] = KT_INT,
    };
    return (cfg_key){
        .name = ek->name, .type = ek->names ? KT_ENUM : types[ek->type],
        .offset = OFF(engine) + ek->offset, .min = ek->min, .max = ek->max,
        .min_open = ek->min_open, .max_open = ek->max_open, .names = ek->names,
        .flags = (ek->flags & ENG_KEY_STATUS ? CF_STATUS : 0) |
                 (ek->names == eng_bool_names ? CF_BOOL : 0),
        .doc = ek->doc,
    };
}

/* The index among the n engine keys ek of the one s_own[i] marks; n when
 * i is past the last row. */
static size_t engine_index(size_t i, const eng_key *ek, size_t n)
{
    size_t j = 0;
    if (i >= NELEM(s_own))
        return n;
    while (j < n && strcmp(ek[j].name, s_own[i].engine_from) != 0)
        j++;
    return j;
}

static void add_key(cfg_key k)
{
    if (s_nkeys < MAX_KEYS)
        s_keys[s_nkeys++] = k;
}

static void fill_keys(void)
{
    size_t n = 0;
    const eng_key *ek = eng_keys(&n);
    for (size_t i = 0; i < NELEM(s_own); i++) {
        if (!s_own[i].engine_from) {
            add_key(s_own[i]);
            continue;
        }
        size_t next = i + 1;
        while (next < NELEM(s_own) && !s_own[next].engine_from)
            next++;
        size_t end = engine_index(next, ek, n);
        for (size_t j = engine_index(i, ek, n); j < end; j++)
            add_key(engine_row(&ek[j]));
    }
}

/* How many keys s_keys holds, made on first use. */
static size_t nkeys(void)
{
    (void)pthread_once(&s_keys_once, fill_keys);
    return s_nkeys;
}

static const cfg_key *find_key(const char *name)
{
    for (size_t i = 0; i < nkeys(); i++)
        if (strcmp(name, s_keys[i].name) == 0)
            return &s_keys[i];
    return NULL;
}

/* ---- messages ----------------------------------------------------------- */

/* Prefix the message a failed step left with "where: " and, given a key,
 * "key 'name': "; returns rc. */
static scape_rc blame(scape_rc rc, const char *where, const char *key)
{
    char msg[512];
    snprintf(msg, sizeof msg, "%s", scape_last_error());
    if (key)
        return scape_set_error(rc, "%s: key '%s': %s", where, key, msg);
    return scape_set_error(rc, "%s: %s", where, msg);
}

/* Levenshtein distance; key is a table key, at most MAX_KEY_CHARS long. */
static size_t edit_distance(const char *s, const char *key)
{
    size_t row[MAX_KEY_CHARS + 1], lk = strlen(key);
    if (lk > MAX_KEY_CHARS)
        return SIZE_MAX;
    for (size_t j = 0; j <= lk; j++)
        row[j] = j;
    for (size_t i = 1; s[i - 1]; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lk; j++) {
            size_t up = row[j], best = diag + (s[i - 1] != key[j - 1]);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lk];
}

/* Keep candidate in *best when it is nearer to name than *best_d edits and
 * near enough to be a typo of it. */
static void nearer(const char *name, const char *candidate, const char **best, size_t *best_d)
{
    size_t d = edit_distance(name, candidate);
    /* A typo is a few edits; more than that suggests an unrelated key. */
    if (d < *best_d && d <= 1 + strlen(candidate) / 4) {
        *best = candidate;
        *best_d = d;
    }
}

const char *cfg_closest_key(const char *name)
{
    const char *best = NULL;
    size_t best_d = SIZE_MAX;
    for (size_t i = 0; name && i < nkeys(); i++)
        nearer(name, s_keys[i].name, &best, &best_d);
    return best;
}

static scape_rc unknown_key(const char *name)
{
    const char *best = cfg_closest_key(name);
    if (best)
        return scape_set_error(SCAPE_INVALID, "unknown key '%s' (did you mean '%s'?)", name,
                               best);
    return scape_set_error(SCAPE_INVALID, "unknown key '%s'", name);
}

/* ---- values ------------------------------------------------------------- */

/* Fewest significant digits that read back as v (in float for KT_FLOAT), so
 * printed values round-trip exactly yet read as written ("0.9", not
 * "0.89999997615814209"). */
static void shortest(double v, key_type t, char *buf, size_t len)
{
    /* %g would write 10 as "1e+01". */
    if (v == floor(v) && fabs(v) < 1e15) {
        snprintf(buf, len, "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, len, "%.*g", prec, v);
        double back = strtod(buf, NULL);
        if (t == KT_FLOAT ? (float)back == (float)v : back == v)
            return;
    }
}

static void format_range(const cfg_key *k, char *buf, size_t len)
{
    char lo[32], hi[32];
    shortest(k->min, KT_DOUBLE, lo, sizeof lo);
    shortest(k->max, KT_DOUBLE, hi, sizeof hi);
    snprintf(buf, len, "%c%s, %s%c", k->min_open ? '(' : '[', lo, hi, k->max_open ? ')' : ']');
}

static int in_range(const cfg_key *k, double v)
{
    int lo = k->min_open ? v > k->min : v >= k->min;
    int hi = k->max_open ? v < k->max : v <= k->max;
    return lo && hi;
}

static scape_rc parse_uint(const char *s, double *out)
{
    char *end;
    /* strtoull would take "-1" as ULLONG_MAX and skip leading blanks. */
    if (!isdigit((unsigned char)s[0]))
        return scape_set_error(SCAPE_INVALID, "'%s' is not a non-negative integer", s);
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end)
        return scape_set_error(SCAPE_INVALID, "'%s' is not a non-negative integer", s);
    *out = errno == ERANGE ? HUGE_VAL : (double)v; /* then out of range */
    return SCAPE_OK;
}

static scape_rc parse_real(const char *s, key_type t, double *out)
{
    char *end = NULL;
    /* strtod would skip leading blanks and read "" as 0. */
    double v = s[0] && !isspace((unsigned char)s[0]) ? strtod(s, &end) : 0.0;
    if (!end || *end)
        return scape_set_error(SCAPE_INVALID, "'%s' is not a number", s);
    if (!isfinite(v))
        return scape_set_error(SCAPE_INVALID, "'%s' is not a finite number", s);
    if (t == KT_FLOAT && fabs(v) > FLT_MAX)
        return scape_set_error(SCAPE_INVALID, "'%s' is too large for a float", s);
    *out = t == KT_FLOAT ? (double)(float)v : v;
    return SCAPE_OK;
}

static void store_number(const cfg_key *k, void *f, double v)
{
    switch (k->type) {
    case KT_DOUBLE: *(double *)f = v; break;
    case KT_FLOAT: *(float *)f = (float)v; break;
    case KT_U32: *(uint32_t *)f = (uint32_t)v; break;
    case KT_INT: *(int *)f = (int)v; break;
    case KT_STRING:
    case KT_ENUM: break;
    }
}

static scape_rc set_number(const cfg_key *k, void *f, const char *s)
{
    double v = 0.0;
    int integer = k->type == KT_U32 || k->type == KT_INT;
    TRY(integer ? parse_uint(s, &v) : parse_real(s, k->type, &v));
    if (!in_range(k, v)) {
        char range[80];
        format_range(k, range, sizeof range);
        return scape_set_error(SCAPE_INVALID, "%s is out of range %s", s, range);
    }
    store_number(k, f, v);
    return SCAPE_OK;
}

static scape_rc set_string(const cfg_key *k, char *f, const char *s)
{
    size_t n = strlen(s);
    if (n >= k->size)
        return scape_set_error(SCAPE_INVALID, "value is %zu bytes long, at most %zu allowed", n,
                               k->size - 1);
    memcpy(f, s, n + 1);
    return SCAPE_OK;
}

static scape_rc set_enum(const cfg_key *k, int *f, const char *s)
{
    if (k->flags & CF_BOOL)
        return cfg_bool_parse(s, f);
    return eng_enum_parse(k->names, k->name, s, f);
}

/* Set k in c from text s; on failure c is unchanged and the message names
 * only the value (callers prefix where it came from). */
static scape_rc set_key(scaped_config *c, const cfg_key *k, const char *s)
{
    void *f = (char *)c + k->offset;
    switch (k->type) {
    case KT_STRING: return set_string(k, f, s);
    case KT_ENUM: return set_enum(k, f, s);
    default: return set_number(k, f, s);
    }
}

/* The code point of the valid UTF-8 sequence at s (its length in *len), or
 * -1: a stray byte, an overlong form, a surrogate or beyond U+10FFFF. */
static long utf8_at(const unsigned char *s, size_t *len)
{
    static const long least[5] = { 0, 0, 0x80, 0x800, 0x10000 };
    size_t n = s[0] >= 0xF0 && s[0] < 0xF8 ? 4 : s[0] >= 0xE0 ? 3 : s[0] >= 0xC0 ? 2 : 0;
    if (n == 0)
        return -1;
    long cp = s[0] & (0x3F >> (n - 1));
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return -1;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    if (cp < least[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return -1;
    *len = n;
    return cp;
}

/* A YAML double-quoted scalar, so any value survives cfg_print -> load: what
 * YAML may not hold as it is (controls, C1 controls and NEL, the line and
 * paragraph separators, BOM, U+FFFE/FFFF) is escaped.  A byte that is not
 * UTF-8 cannot be written in YAML at all; it comes out as \xNN, which reads
 * back as the character U+00NN. */
static void yaml_quote(const char *s, char *buf, size_t len)
{
    size_t n = 0;
    buf[n++] = '"';
    for (const unsigned char *p = (const unsigned char *)s; *p && n + 12 < len;) {
        size_t w = 1;
        long cp = *p < 0x80 ? *p : utf8_at(p, &w);
        if (cp == '"' || cp == '\\')
            n += (size_t)snprintf(buf + n, len - n, "\\%c", (char)cp);
        else if (cp < 0)
            n += (size_t)snprintf(buf + n, len - n, "\\x%02X", *p);
        else if (cp < 0x20 || (cp >= 0x7F && cp < 0xA0))
            n += (size_t)snprintf(buf + n, len - n, "\\x%02lX", cp);
        else if (cp == 0x2028 || cp == 0x2029 || cp == 0xFEFF || cp == 0xFFFE || cp == 0xFFFF)
            n += (size_t)snprintf(buf + n, len - n, "\\u%04lX", cp);
        else
            for (size_t i = 0; i < w; i++)
                buf[n++] = (char)p[i];
        p += w;
    }
    buf[n++] = '"';
    buf[n] = '\0';
}

static void format_value(const cfg_key *k, const void *f, char *buf, size_t len)
{
    switch (k->type) {
    case KT_STRING: yaml_quote(f, buf, len); break;
    case KT_ENUM:
        snprintf(buf, len, "%s", eng_enum_name(k->names, *(const int *)f));
        break;
    case KT_DOUBLE: shortest(*(const double *)f, KT_DOUBLE, buf, len); break;
    case KT_FLOAT: shortest(*(const float *)f, KT_FLOAT, buf, len); break;
    case KT_U32: snprintf(buf, len, "%" PRIu32, *(const uint32_t *)f); break;
    case KT_INT: snprintf(buf, len, "%d", *(const int *)f); break;
    }
}

/* ---- the YAML file ------------------------------------------------------ */

typedef struct loader {
    yaml_parser_t parser;
    const char *path;
    scaped_config *cfg;            /* a copy, committed only when all is well */
    size_t first_line[MAX_KEYS];   /* where each key was set, 0 = not yet */
} loader;

/* blame() with "path:line:col" from a 0-based libyaml mark. */
static scape_rc blame_at(const loader *ld, yaml_mark_t m, const char *key, scape_rc rc)
{
    char where[512];
    snprintf(where, sizeof where, "%s:%zu:%zu", ld->path, m.line + 1, m.column + 1);
    return blame(rc, where, key);
}

static scape_rc yaml_failed(const loader *ld)
{
    const yaml_parser_t *p = &ld->parser;
    if (p->error == YAML_MEMORY_ERROR)
        return scape_set_error(SCAPE_NOMEM, "%s: out of memory reading YAML", ld->path);
    /* Reader errors (bad encoding, read failure) carry an offset, not a mark. */
    if (p->error == YAML_READER_ERROR)
        return scape_set_error(SCAPE_INVALID, "%s: YAML error: %s at byte %zu", ld->path,
                               p->problem, p->problem_offset);
    if (p->context)
        scape_set_error(SCAPE_INVALID, "YAML error: %s (%s)", p->problem, p->context);
    else
        scape_set_error(SCAPE_INVALID, "YAML error: %s", p->problem);
    return blame_at(ld, p->problem_mark, NULL, SCAPE_INVALID);
}

static scape_rc next_event(loader *ld, yaml_event_t *ev)
{
    return yaml_parser_parse(&ld->parser, ev) ? SCAPE_OK : yaml_failed(ld);
}

/* Consume one event, keeping only its type and position. */
static scape_rc next_type(loader *ld, yaml_event_type_t *t, yaml_mark_t *m)
{
    yaml_event_t ev;
    TRY(next_event(ld, &ev));
    *t = ev.type;
    *m = ev.start_mark;
    yaml_event_delete(&ev);
    return SCAPE_OK;
}

static const char *event_noun(yaml_event_type_t t)
{
    switch (t) {
    case YAML_SEQUENCE_START_EVENT: return "a sequence";
    case YAML_MAPPING_START_EVENT: return "a mapping";
    case YAML_ALIAS_EVENT: return "an alias";
    default: return "a scalar";
    }
}

static scape_rc load_value(loader *ld, const cfg_key *k, const yaml_event_t *v)
{
    scape_rc rc;
    if (v->type != YAML_SCALAR_EVENT)
        rc = scape_set_error(SCAPE_INVALID, "expected a scalar, found %s", event_noun(v->type));
    else if (strlen((const char *)v->data.scalar.value) != v->data.scalar.length)
        rc = scape_set_error(SCAPE_INVALID, "the value contains a NUL character");
    else
        rc = set_key(ld->cfg, k, (const char *)v->data.scalar.value);
    return rc == SCAPE_OK ? SCAPE_OK : blame_at(ld, v->start_mark, k->name, rc);
}

static scape_rc load_pair(loader *ld, const yaml_event_t *key)
{
    if (key->type != YAML_SCALAR_EVENT)
        return blame_at(ld, key->start_mark, NULL,
                        scape_set_error(SCAPE_INVALID, "expected a key, found %s",
                                        event_noun(key->type)));
    const char *name = (const char *)key->data.scalar.value;
    const cfg_key *k = find_key(name);
    if (!k)
        return blame_at(ld, key->start_mark, NULL, unknown_key(name));
    size_t i = (size_t)(k - s_keys);
    if (ld->first_line[i])
        return blame_at(ld, key->start_mark, NULL,
                        scape_set_error(SCAPE_INVALID, "duplicate key '%s' (first on line %zu)",
                                        name, ld->first_line[i]));
    ld->first_line[i] = key->start_mark.line + 1;
    yaml_event_t v;
    TRY(next_event(ld, &v));
    scape_rc rc = load_value(ld, k, &v);
    yaml_event_delete(&v);
    return rc;
}

/* The pairs of the top-level mapping, through its end. */
static scape_rc load_pairs(loader *ld)
{
    for (;;) {
        yaml_event_t key;
        TRY(next_event(ld, &key));
        int end = key.type == YAML_MAPPING_END_EVENT;
        scape_rc rc = end ? SCAPE_OK : load_pair(ld, &key);
        yaml_event_delete(&key);
        if (end || rc != SCAPE_OK)
            return rc;
    }
}

/* After DOCUMENT-START: the mapping, then DOCUMENT-END. */
static scape_rc load_document(loader *ld)
{
    yaml_event_t ev;
    TRY(next_event(ld, &ev));
    yaml_event_type_t t = ev.type;
    yaml_mark_t m = ev.start_mark;
    /* A "---" with nothing under it is an empty (null) document. */
    int empty = t == YAML_SCALAR_EVENT && ev.data.scalar.length == 0 &&
                ev.data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
    yaml_event_delete(&ev);
    if (t != YAML_MAPPING_START_EVENT && !empty)
        return blame_at(ld, m, NULL,
                        scape_set_error(SCAPE_INVALID,
                                        "expected a mapping of key: value pairs, found %s",
                                        event_noun(t)));
    if (!empty)
        TRY(load_pairs(ld));
    return next_type(ld, &t, &m);
}

static scape_rc load_stream(loader *ld)
{
    yaml_event_type_t t;
    yaml_mark_t m;
    TRY(next_type(ld, &t, &m)); /* STREAM-START */
    TRY(next_type(ld, &t, &m));
    if (t == YAML_STREAM_END_EVENT)
        return SCAPE_OK; /* nothing but comments, or nothing at all */
    TRY(load_document(ld));
    TRY(next_type(ld, &t, &m));
    if (t != YAML_STREAM_END_EVENT)
        return blame_at(ld, m, NULL,
                        scape_set_error(SCAPE_INVALID, "only one YAML document is allowed"));
    return SCAPE_OK;
}

/* Load from f, or from the len bytes at text when f is NULL; *c changes only
 * when everything in it is valid. */
static scape_rc load_from(scaped_config *c, const char *path, FILE *f, const char *text,
                          size_t len)
{
    scaped_config next = *c;
    loader ld = { .path = path, .cfg = &next };
    if (!yaml_parser_initialize(&ld.parser))
        return scape_set_error(SCAPE_NOMEM, "%s: out of memory reading YAML", path);
    if (f)
        yaml_parser_set_input_file(&ld.parser, f);
    else
        yaml_parser_set_input_string(&ld.parser, (const unsigned char *)text, len);
    scape_rc rc = load_stream(&ld);
    yaml_parser_delete(&ld.parser);
    if (rc == SCAPE_OK)
        *c = next;
    return rc;
}

static scape_rc load_open_file(scaped_config *c, const char *path, FILE *f)
{
    struct stat st;
    if (fstat(fileno(f), &st) != 0)
        return scape_set_error(SCAPE_SYSTEM, "%s: %s", path, strerror(errno));
    /* fopen accepts a directory; reading it would fail as a vague YAML error. */
    if (S_ISDIR(st.st_mode))
        return scape_set_error(SCAPE_SYSTEM, "%s: %s", path, strerror(EISDIR));
    return load_from(c, path, f, NULL, 0);
}

/* ---- public ------------------------------------------------------------- */

void cfg_defaults(scaped_config *c)
{
    /* Zero first so string tails and padding are defined too, and the
     * struct can be compared or hashed whole. */
    memset(c, 0, sizeof *c);
    eng_config_default(&c->engine); /* the engine keys' defaults are on their rows there */
    /* The table's defaults are valid text for their keys; test_config checks
     * every one of them. */
    for (size_t i = 0; i < nkeys(); i++)
        if (s_keys[i].def)
            (void)set_key(c, &s_keys[i], s_keys[i].def);
}

scape_rc cfg_load_file(scaped_config *c, const char *path)
{
    if (!c || !path)
        return scape_set_error(SCAPE_INVALID, "cfg_load_file: NULL argument");
    FILE *f = fopen(path, "rb");
    if (!f)
        return scape_set_error(SCAPE_SYSTEM, "%s: %s", path, strerror(errno));
    scape_rc rc = load_open_file(c, path, f);
    fclose(f);
    return rc;
}

scape_rc cfg_load_text(scaped_config *c, const char *name, const char *text, size_t len)
{
    if (!c || !name || (!text && len))
        return scape_set_error(SCAPE_INVALID, "cfg_load_text: NULL argument");
    return load_from(c, name, NULL, text ? text : "", len);
}

/* s in upper case into buf (len bytes), cut to fit. */
static void upper_copy(const char *s, char *buf, size_t len)
{
    size_t i = 0;
    for (; s[i] && i + 1 < len; i++)
        buf[i] = (char)toupper((unsigned char)s[i]);
    buf[i] = '\0';
}

/* Key k's environment variable, SCAPE_<KEY>, into buf. */
static void env_name(const cfg_key *k, char *buf, size_t len)
{
    char up[MAX_KEY_CHARS + 1];
    upper_copy(k->name, up, sizeof up);
    snprintf(buf, len, "SCAPE_%s", up);
}

scape_rc cfg_apply_env(scaped_config *c)
{
    if (!c)
        return scape_set_error(SCAPE_INVALID, "cfg_apply_env: NULL argument");
    scaped_config next = *c;
    for (size_t i = 0; i < nkeys(); i++) {
        char var[MAX_KEY_CHARS + 8];
        env_name(&s_keys[i], var, sizeof var);
        /* An empty variable counts as unset, as "SCAPE_RHO= scaped" intends. */
        const char *v = getenv(var);
        if (v && *v && set_key(&next, &s_keys[i], v) != SCAPE_OK)
            return blame(SCAPE_INVALID, var, s_keys[i].name);
    }
    *c = next;
    return SCAPE_OK;
}

/* SCAPE_* variables that are no key of scaped's but are read by the other
 * parts of SCAPE (libscape, scapectl, scape-run, the Slurm scripts, the tests
 * and their tools): a job sets them for those, so no warning.  test_cli.py
 * checks that this covers every variable the tree reads. */
static const char *const s_other_env[] = {
    "SCAPE_ARGS", "SCAPE_BIN", "SCAPE_BUCKET_MB", "SCAPE_BUILD_DIR", "SCAPE_COORD_HOST",
    "SCAPE_CUDA",
    "SCAPE_DAEMON_LOST_MS", "SCAPE_DATA_PORT", "SCAPE_DEB_CACHE", "SCAPE_ENDPOINT",
    "SCAPE_GPU_BUDGET",
    "SCAPE_HOME", "SCAPE_INDEX", "SCAPE_LIB", "SCAPE_LIGHTNING_SPEC", "SCAPE_LISTEN_HOST",
    "SCAPE_LISTEN_IFACE", "SCAPE_MAX_RESTARTS", "SCAPE_PYTHON", "SCAPE_PYTHON_ENV",
    "SCAPE_RDV_PORT", "SCAPE_RUN_BASE", "SCAPE_SOURCE_DIR", "SCAPE_START_WAIT_MS",
    "SCAPE_TEST_SEED",
};
/* ... and whole families of them: the fuzzers', the test cluster's, the test
 * virtual environments'. */
static const char *const s_other_env_prefix[] = { "SCAPE_FUZZ_", "SCAPE_SLURM_", "SCAPE_HF_",
                                                  "SCAPE_TORCH2_" };

static int other_env(const char *name)
{
    for (size_t i = 0; i < NELEM(s_other_env); i++)
        if (strcmp(name, s_other_env[i]) == 0)
            return 1;
    for (size_t i = 0; i < NELEM(s_other_env_prefix); i++)
        if (strncmp(name, s_other_env_prefix[i], strlen(s_other_env_prefix[i])) == 0)
            return 1;
    return 0;
}

/* The known variable (a key's or another part's) nearest to name, which is
 * in upper case, into buf; 0 when none is near enough to be a typo of it. */
static int nearest_env(const char *name, char *buf, size_t len)
{
    char cand[MAX_KEY_CHARS + 8];
    const char *best = NULL; /* points into cand: only tested for NULL */
    size_t best_d = SIZE_MAX;
    for (size_t i = 0; i < nkeys() + NELEM(s_other_env); i++) {
        if (i < nkeys())
            env_name(&s_keys[i], cand, sizeof cand);
        else
            snprintf(cand, sizeof cand, "%s", s_other_env[i - nkeys()]);
        size_t was = best_d;
        nearer(name + 6, cand + 6, &best, &best_d);
        if (best_d < was)
            snprintf(buf, len, "%s", cand);
    }
    return best != NULL;
}

int cfg_env_unknown(const char *name, char *msg, size_t len)
{
    char var[MAX_KEY_CHARS + 8], up[256], near[MAX_KEY_CHARS + 8];
    if (!name || strncmp(name, "SCAPE_", 6) != 0 || other_env(name))
        return 0;
    for (size_t i = 0; i < nkeys(); i++) {
        env_name(&s_keys[i], var, sizeof var);
        if (strcmp(name, var) == 0)
            return 0;
    }
    upper_copy(name, up, sizeof up); /* SCAPE_rho is unknown, but near SCAPE_RHO */
    if (msg && len && nearest_env(up, near, sizeof near))
        snprintf(msg, len, "unknown environment variable %s, ignored (did you mean %s?)", name,
                 near);
    else if (msg && len)
        snprintf(msg, len, "unknown environment variable %s, ignored (SCAPE_<KEY> sets a "
                 "key; scaped --help lists them)", name);
    return 1;
}

extern char **environ;

int cfg_warn_env(void)
{
    int n = 0;
    for (char **e = environ; e && *e; e++) {
        char name[256], msg[512];
        size_t len = strcspn(*e, "=");
        if (strncmp(*e, "SCAPE_", 6) != 0)
            continue;
        len = len < sizeof name ? len : sizeof name - 1; /* a longer one is named cut */
        memcpy(name, *e, len);
        name[len] = '\0';
        if (cfg_env_unknown(name, msg, sizeof msg)) {
            LOG_WARN(SUB_CONFIG, "%s", msg);
            n++;
        }
    }
    return n;
}

scape_rc cfg_set(scaped_config *c, const char *key, const char *value, const char *origin)
{
    const char *where = origin ? origin : "cfg_set";
    if (!c || !key || !value)
        return scape_set_error(SCAPE_INVALID, "%s: NULL argument", where);
    const cfg_key *k = find_key(key);
    if (!k)
        return blame(unknown_key(key), where, NULL);
    scape_rc rc = set_key(c, k, value);
    return rc == SCAPE_OK ? SCAPE_OK : blame(rc, where, k->name);
}

scape_rc cfg_print(const scaped_config *c, FILE *out)
{
    if (!c || !out)
        return scape_set_error(SCAPE_INVALID, "cfg_print: NULL argument");
    for (size_t i = 0; i < nkeys(); i++) {
        const cfg_key *k = &s_keys[i];
        char val[VALUE_BYTES];
        format_value(k, (const char *)c + k->offset, val, sizeof val);
        int used = (int)(strlen(k->name) + 2 + strlen(val));
        int pad = used + 2 < PRINT_COLUMN ? PRINT_COLUMN - used : 2;
        fprintf(out, "%s: %s%*s# %s\n", k->name, val, pad, "", k->doc);
    }
    if (fflush(out) != 0 || ferror(out))
        return scape_set_error(SCAPE_SYSTEM, "cfg_print: %s", strerror(errno));
    return SCAPE_OK;
}

size_t cfg_status_values(const scaped_config *c, cfg_value *out, size_t max)
{
    size_t n = 0;
    for (size_t i = 0; c && out && i < nkeys() && n < max; i++) {
        const cfg_key *k = &s_keys[i];
        if (!(k->flags & CF_STATUS))
            continue;
        format_value(k, (const char *)c + k->offset, out[n].value, sizeof out->value);
        out[n++].key = k->name;
    }
    return n;
}

const char *cfg_key_doc(size_t i, const char **name)
{
    if (i >= nkeys())
        return NULL;
    if (name)
        *name = s_keys[i].name;
    return s_keys[i].doc;
}
