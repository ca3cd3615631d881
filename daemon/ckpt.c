/* ckpt.c - writing, checking and reading checkpoints (see ckpt.h).
 *
 * A rank file is little-endian:
 *   "SCAPECKP" | u32 version | u32 nsecs
 *   meta: u64 step, layout_hash, config_hash | u32 rank, world, optimizer,
 *         mode | u64 n, state_base, state_len | u32 flags, trainers
 *   nsecs x (u32 id, u32 0, u64 offset, u64 bytes, u64 checksum)
 *   u64 checksum of everything above
 *   the sections, back to back.
 * Sections are written straight from the engine's buffers and read straight
 * back into them, in chunks, checksumming on the way.
 */
#define _XOPEN_SOURCE 700 /* realpath */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"
#include "log.h"
#include "plan.h"
#include "try.h"

#define CKPT_MAGIC "SCAPECKP"
#define CKPT_VERSION 1u
#define CKPT_CHUNK (8u << 20) /* bytes written or read at a time; a multiple of 8 */
#define META_BYTES 72
#define SEC_BYTES 32
#define HEADER_MAX (16 + META_BYTES + ENG_CKPT_MAX_SECS * SEC_BYTES + 8)
#define MANIFEST "MANIFEST"
#define LATEST "LATEST"
#define HANDED_OUT "HANDED_OUT" /* in a step directory a state_dict named */
#define PRUNED "PRUNED"         /* in the root: the step directories pruned */

/* ---- checksum ------------------------------------------------------------ */

static uint64_t mix(uint64_t h, uint64_t w)
{
    h = (h ^ w) * 0x9e3779b97f4a7c15ull;
    return h ^ (h >> 32);
}

uint64_t ckpt_hash(uint64_t h, const void *buf, size_t n)
{
    const unsigned char *p = buf;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = mix(h, w);
    }
    if (i < n) {
        uint64_t w = 0;
        memcpy(&w, p + i, n - i);
        h = mix(mix(h, w), 0xff00u | (n - i));
    }
    return h;
}

/* ---- little-endian fields -------------------------------------------------- */

static void put32(unsigned char **p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        *(*p)++ = (unsigned char)(v >> (8 * i));
}

static void put64(unsigned char **p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        *(*p)++ = (unsigned char)(v >> (8 * i));
}

static uint32_t get32(const unsigned char **p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)*(*p)++ << (8 * i);
    return v;
}

static uint64_t get64(const unsigned char **p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)*(*p)++ << (8 * i);
    return v;
}

typedef struct sec_entry {
    uint32_t id;
    uint64_t offset, bytes, hash;
} sec_entry;

typedef struct header {
    eng_ckpt_meta meta;
    uint32_t nsecs;
    sec_entry sec[ENG_CKPT_MAX_SECS];
    size_t bytes;      /* of the header itself */
    uint64_t hash;     /* its checksum */
} header;

static size_t header_bytes(uint32_t nsecs)
{
    return 16 + META_BYTES + nsecs * SEC_BYTES + 8;
}

static void encode(const header *h, unsigned char *buf)
{
    unsigned char *p = buf;
    memcpy(p, CKPT_MAGIC, 8);
    p += 8;
    put32(&p, CKPT_VERSION);
    put32(&p, h->nsecs);
    const eng_ckpt_meta *m = &h->meta;
    put64(&p, m->step);
    put64(&p, m->layout_hash);
    put64(&p, m->config_hash);
    put32(&p, m->rank);
    put32(&p, m->world);
    put32(&p, m->optimizer);
    put32(&p, m->mode);
    put64(&p, m->n);
    put64(&p, m->state_base);
    put64(&p, m->state_len);
    put32(&p, m->flags);
    put32(&p, m->trainers);
    for (uint32_t i = 0; i < h->nsecs; i++) {
        put32(&p, h->sec[i].id);
        put32(&p, 0);
        put64(&p, h->sec[i].offset);
        put64(&p, h->sec[i].bytes);
        put64(&p, h->sec[i].hash);
    }
    put64(&p, ckpt_hash(CKPT_HASH_SEED, buf, (size_t)(p - buf)));
}

/* Decode and check a header read from name (len bytes at hand). */
static scape_rc decode(const unsigned char *buf, size_t len, const char *name, header *h)
{
    const unsigned char *p = buf;
    if (len < 16 || memcmp(p, CKPT_MAGIC, 8) != 0)
        return scape_set_error(SCAPE_INVALID, "%s: not a scaped checkpoint file", name);
    p += 8;
    uint32_t version = get32(&p);
    h->nsecs = get32(&p);
    if (version != CKPT_VERSION)
        return scape_set_error(SCAPE_INVALID, "%s: checkpoint format version %u (this scaped "
                               "reads %u)", name, version, CKPT_VERSION);
    if (h->nsecs == 0 || h->nsecs > ENG_CKPT_MAX_SECS)
        return scape_set_error(SCAPE_INVALID, "%s: corrupted header (%u sections)", name,
                               h->nsecs);
    h->bytes = header_bytes(h->nsecs);
    if (len < h->bytes)
        return scape_set_error(SCAPE_INVALID, "%s: truncated inside its header", name);
    const unsigned char *end = buf + h->bytes - 8;
    uint64_t want = ckpt_hash(CKPT_HASH_SEED, buf, h->bytes - 8);
    h->hash = get64(&end);
    if (want != h->hash)
        return scape_set_error(SCAPE_INVALID, "%s: header checksum mismatch (stored %016llx, "
                               "computed %016llx): the file is corrupted", name,
                               (unsigned long long)h->hash, (unsigned long long)want);
    eng_ckpt_meta *m = &h->meta;
    m->step = get64(&p);
    m->layout_hash = get64(&p);
    m->config_hash = get64(&p);
    m->rank = get32(&p);
    m->world = get32(&p);
    m->optimizer = get32(&p);
    m->mode = get32(&p);
    m->n = get64(&p);
    m->state_base = get64(&p);
    m->state_len = get64(&p);
    m->flags = get32(&p);
    m->trainers = get32(&p);
    uint64_t at = h->bytes;
    for (uint32_t i = 0; i < h->nsecs; i++) {
        sec_entry *s = &h->sec[i];
        s->id = get32(&p);
        (void)get32(&p);
        s->offset = get64(&p);
        s->bytes = get64(&p);
        s->hash = get64(&p);
        if (s->offset != at)
            return scape_set_error(SCAPE_INVALID, "%s: corrupted section table", name);
        at += s->bytes;
    }
    return SCAPE_OK;
}

/* ---- files ------------------------------------------------------------------ */

static scape_rc write_all(int fd, const void *buf, size_t n, const char *path)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return scape_set_error(SCAPE_SYSTEM, "%s: write: %s", path,
                                   w < 0 ? strerror(errno) : "no progress");
        p += w;
        n -= (size_t)w;
    }
    return SCAPE_OK;
}

/* Read exactly n bytes; a short file is reported as truncated. */
static scape_rc read_all(int fd, void *buf, size_t n, const char *path)
{
    char *p = buf;
    while (n > 0) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return scape_set_error(SCAPE_SYSTEM, "%s: read: %s", path, strerror(errno));
        if (r == 0)
            return scape_set_error(SCAPE_INVALID, "%s: truncated: the file ends early", path);
        p += r;
        n -= (size_t)r;
    }
    return SCAPE_OK;
}

static scape_rc fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        return scape_set_error(SCAPE_SYSTEM, "%s: %s", dir, strerror(errno));
    int rc = fsync(fd);
    int err = errno;
    close(fd);
    if (rc != 0 && err != EINVAL) /* some file systems cannot sync a directory */
        return scape_set_error(SCAPE_SYSTEM, "%s: fsync: %s", dir, strerror(err));
    return SCAPE_OK;
}

/* Finish a file written at tmp: fsync, close, rename to path, sync the dir. */
static scape_rc commit(int fd, const char *tmp, const char *path, const char *dir)
{
    scape_rc rc = SCAPE_OK;
    if (fsync(fd) != 0)
        rc = scape_set_error(SCAPE_SYSTEM, "%s: fsync: %s", tmp, strerror(errno));
    if (close(fd) != 0 && rc == SCAPE_OK)
        rc = scape_set_error(SCAPE_SYSTEM, "%s: close: %s", tmp, strerror(errno));
    if (rc == SCAPE_OK && rename(tmp, path) != 0)
        rc = scape_set_error(SCAPE_SYSTEM, "rename %s -> %s: %s", tmp, path, strerror(errno));
    if (rc != SCAPE_OK) {
        unlink(tmp);
        return rc;
    }
    return fsync_dir(dir);
}

static scape_rc open_tmp(const char *path, char *tmp, size_t len, int *fd)
{
    if ((size_t)snprintf(tmp, len, "%s.tmp.%ld", path, (long)getpid()) >= len)
        return scape_set_error(SCAPE_INVALID, "%s: path too long", path);
    *fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (*fd < 0)
        return scape_set_error(SCAPE_SYSTEM, "%s: %s", tmp, strerror(errno));
    return SCAPE_OK;
}

/* A small text file, atomically. */
static scape_rc write_text(const char *dir, const char *name, const char *text)
{
    char path[CKPT_PATH_MAX], tmp[CKPT_PATH_MAX + 32];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path)
        return scape_set_error(SCAPE_INVALID, "%s: path too long", dir);
    int fd;
    TRY(open_tmp(path, tmp, sizeof tmp, &fd));
    scape_rc rc = write_all(fd, text, strlen(text), tmp);
    if (rc != SCAPE_OK) {
        close(fd);
        unlink(tmp);
        return rc;
    }
    return commit(fd, tmp, path, dir);
}

static scape_rc mkdir_p(const char *path)
{
    char buf[CKPT_PATH_MAX];
    if ((size_t)snprintf(buf, sizeof buf, "%s", path) >= sizeof buf)
        return scape_set_error(SCAPE_INVALID, "%s: path too long", path);
    for (char *p = buf + 1;; p++) {
        char c = *p;
        if (c != '/' && c != '\0')
            continue;
        *p = '\0';
        if (mkdir(buf, 0750) != 0 && errno != EEXIST)
            return scape_set_error(SCAPE_SYSTEM, "cannot create %s: %s", buf, strerror(errno));
        *p = c;
        if (c == '\0')
            break;
    }
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return scape_set_error(SCAPE_SYSTEM, "%s is not a directory", path);
    return SCAPE_OK;
}

/* Open a regular file for reading; anything else (a FIFO would block the
 * daemon, a device would be nonsense) is refused. */
static int open_regular(const char *path, int *err_is_type)
{
    *err_is_type = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return -1;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        *err_is_type = 1;
        return -1;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    return fd;
}

static FILE *fopen_regular(const char *path)
{
    int type;
    int fd = open_regular(path, &type);
    if (fd < 0) {
        if (type)
            errno = EINVAL;
        return NULL;
    }
    FILE *f = fdopen(fd, "r");
    if (f == NULL)
        close(fd);
    return f;
}

/* pwrite/pread of exactly n bytes at off (EINTR and short transfers retried). */
static int pio_all(int fd, void *buf, size_t n, off_t off, int writing)
{
    char *p = buf;
    while (n > 0) {
        ssize_t k = writing ? pwrite(fd, p, n, off) : pread(fd, p, n, off);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        p += k;
        off += k;
        n -= (size_t)k;
    }
    return 0;
}

/* ---- saving ------------------------------------------------------------------ */

static void rank_file_name(int rank, char *buf, size_t len)
{
    snprintf(buf, len, "rank-%05d.ckpt", rank);
}

/* This rank's file: sections hashed while written, then the header. */
static scape_rc write_rank_file(const char *dir, const eng_ckpt_meta *meta,
                                const eng_ckpt_sec *secs, int nsecs, uint64_t *bytes,
                                uint64_t *hhash)
{
    char name[32], path[CKPT_PATH_MAX], tmp[CKPT_PATH_MAX + 32];
    rank_file_name((int)meta->rank, name, sizeof name);
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path)
        return scape_set_error(SCAPE_INVALID, "%s: path too long", dir);
    header h;
    memset(&h, 0, sizeof h);
    h.meta = *meta;
    h.nsecs = (uint32_t)nsecs;
    h.bytes = header_bytes(h.nsecs);
    unsigned char hbuf[HEADER_MAX];
    memset(hbuf, 0, sizeof hbuf);
    int fd;
    TRY(open_tmp(path, tmp, sizeof tmp, &fd));
    scape_rc rc = write_all(fd, hbuf, h.bytes, tmp);
    uint64_t at = h.bytes;
    for (int i = 0; rc == SCAPE_OK && i < nsecs; i++) {
        const char *p = secs[i].ptr;
        uint64_t hs = CKPT_HASH_SEED;
        for (size_t off = 0; rc == SCAPE_OK && off < secs[i].bytes; off += CKPT_CHUNK) {
            size_t n = secs[i].bytes - off < CKPT_CHUNK ? secs[i].bytes - off : CKPT_CHUNK;
            hs = ckpt_hash(hs, p + off, n);
            rc = write_all(fd, p + off, n, tmp);
        }
        h.sec[i] = (sec_entry){ secs[i].id, at, secs[i].bytes, mix(hs, secs[i].bytes) };
        at += secs[i].bytes;
    }
    if (rc == SCAPE_OK) {
        encode(&h, hbuf);
        const unsigned char *e = hbuf + h.bytes - 8;
        *hhash = get64(&e);
        *bytes = at;
        if (pio_all(fd, hbuf, h.bytes, 0, 1) != 0)
            rc = scape_set_error(SCAPE_SYSTEM, "%s: write: %s", tmp, strerror(errno));
    }
    if (rc != SCAPE_OK) {
        close(fd);
        unlink(tmp);
        return rc;
    }
    return commit(fd, tmp, path, dir);
}

typedef struct rank_result {
    uint64_t ok, bytes, hhash;
    char why[200];          /* the failure, for the other ranks' messages */
} rank_result;

static scape_rc write_manifest(const char *dir, const eng_ckpt_meta *m,
                               const rank_result *all, int world)
{
    size_t cap = 1024 + (size_t)world * 96;
    char *text = malloc(cap);
    if (text == NULL)
        return scape_set_error(SCAPE_NOMEM, "checkpoint: out of memory");
    char when[32];
    time_t now = time(NULL);
    struct tm tm;
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&now, &tm));
    size_t n = (size_t)snprintf(text, cap,
                                "scaped-checkpoint 1\nstep %llu\nworld %u\noptimizer %s\n"
                                "mode %s\nn %llu\nlayout_hash %016llx\nconfig_hash %016llx\n"
                                "trainers %u\ncreated %s\n",
                                (unsigned long long)m->step, m->world,
                                eng_optimizer_name((eng_optimizer)m->optimizer),
                                eng_mode_name((eng_mode)m->mode), (unsigned long long)m->n,
                                (unsigned long long)m->layout_hash,
                                (unsigned long long)m->config_hash, m->trainers, when);
    for (int r = 0; r < world; r++) {
        char name[32];
        rank_file_name(r, name, sizeof name);
        n += (size_t)snprintf(text + n, cap - n, "rank %d %s %llu %016llx\n", r, name,
                              (unsigned long long)all[r].bytes,
                              (unsigned long long)all[r].hhash);
    }
    snprintf(text + n, cap - n, "end\n");
    scape_rc rc = write_text(dir, MANIFEST, text);
    free(text);
    return rc;
}

/* "step-<t>" or, for a later attempt at the same step, "step-<t>.<k>". */
static int parse_step_dir2(const char *name, uint64_t *step, uint64_t *attempt)
{
    char *end;
    if (strncmp(name, "step-", 5) != 0 || name[5] < '0' || name[5] > '9')
        return 0;
    *step = strtoull(name + 5, &end, 10);
    *attempt = 0;
    if (*end == '.' && end[1] >= '0' && end[1] <= '9')
        *attempt = strtoull(end + 1, &end, 10);
    return *end == '\0';
}

static int parse_step_dir(const char *name, uint64_t *step)
{
    uint64_t attempt;
    return parse_step_dir2(name, step, &attempt);
}

typedef struct step_dir {
    uint64_t step, attempt;
    int complete;          /* has a MANIFEST */
    int handed_out;        /* a state_dict named it (HANDED_OUT) */
    char name[64];
} step_dir;

static int cmp_dir_desc(const void *a, const void *b)
{
    const step_dir *x = a, *y = b;
    if (x->step != y->step)
        return x->step < y->step ? 1 : -1;
    return x->attempt < y->attempt ? 1 : x->attempt > y->attempt ? -1 : 0;
}

/* Rank 0 removes every file of the directory (on the shared file system that
 * is every rank's part); the others their own file. */
static void remove_dir(const char *dir, int rank)
{
    char path[CKPT_PATH_MAX + 400];
    if (rank == 0) {
        DIR *d = opendir(dir);
        struct dirent *de;
        while (d && (de = readdir(d)) != NULL) {
            if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
                continue;
            snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
            unlink(path);
        }
        if (d)
            closedir(d);
    } else {
        char name[32];
        rank_file_name(rank, name, sizeof name);
        snprintf(path, sizeof path, "%s/%s", dir, name);
        unlink(path);
    }
    if (rmdir(dir) == 0)
        LOG_INFO(SUB_ENGINE, "removed old checkpoint %s", dir);
}

/* Rank 0 notes a pruned checkpoint in <root>/PRUNED, so that a state_dict
 * naming it later is told why it is gone. */
static void note_pruned(const char *root, const char *name)
{
    char path[CKPT_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/%s", root, PRUNED);
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
    if (fd < 0) {
        LOG_WARN(SUB_ENGINE, "%s: %s", path, strerror(errno));
        return;
    }
    char line[80];
    int n = snprintf(line, sizeof line, "%s\n", name);
    if (write_all(fd, line, (size_t)n, path) != SCAPE_OK)
        LOG_WARN(SUB_ENGINE, "%s", scape_last_error());
    close(fd);
}

/* Whether dir/name exists. */
static int has_file(const char *root, const char *dir, const char *name)
{
    char m[CKPT_PATH_MAX + 160];
    snprintf(m, sizeof m, "%s/%s/%s", root, dir, name);
    return access(m, F_OK) == 0;
}

/* Keep the newest `keep` complete checkpoints up to the one just written
 * (latest), and the newest `keep` complete ones a state_dict handed out
 * (a training framework lists those in its own checkpoints); the others,
 * complete or not, go. */
static void prune(const char *root, int rank, int keep, const char *latest)
{
    uint64_t ls, la;
    if (!parse_step_dir2(latest, &ls, &la))
        return;
    DIR *d = opendir(root);
    if (d == NULL)
        return;
    size_t n = 0, cap = 16;
    step_dir *dirs = malloc(cap * sizeof *dirs);
    struct dirent *de;
    while (dirs && (de = readdir(d)) != NULL) {
        step_dir x;
        if (!parse_step_dir2(de->d_name, &x.step, &x.attempt) ||
            strlen(de->d_name) >= sizeof x.name ||
            x.step > ls || (x.step == ls && x.attempt > la))
            continue;
        memcpy(x.name, de->d_name, strlen(de->d_name) + 1); /* length checked above */
        x.complete = has_file(root, x.name, MANIFEST);
        x.handed_out = x.complete && has_file(root, x.name, HANDED_OUT);
        if (n == cap) {
            step_dir *g = realloc(dirs, 2 * cap * sizeof *dirs);
            if (g == NULL)
                break;
            dirs = g;
            cap *= 2;
        }
        dirs[n++] = x;
    }
    closedir(d);
    if (dirs == NULL)
        return;
    qsort(dirs, n, sizeof *dirs, cmp_dir_desc);
    int kept = 0, kept_out = 0;
    for (size_t i = 0; i < n; i++) {
        int newest = dirs[i].complete && kept < keep;
        int out = dirs[i].handed_out && kept_out < keep;
        kept += newest;
        kept_out += dirs[i].handed_out;
        if (newest || out)
            continue;
        char dir[CKPT_PATH_MAX + 80];
        snprintf(dir, sizeof dir, "%s/%s", root, dirs[i].name);
        remove_dir(dir, rank);
        if (rank == 0 && dirs[i].complete)
            note_pruned(root, dirs[i].name);
    }
    free(dirs);
}

/* Rank 0: a fresh directory for this attempt, so that no complete checkpoint
 * is ever written over (a job resumed from an older step comes back to steps
 * it has checkpointed before). */
/* The directory of attempt k at step t: "step-<t>", then "step-<t>.<k>". */
static scape_rc attempt_dir(const char *root, uint64_t step, unsigned k, char *name,
                            size_t len, char *dir, size_t dir_len)
{
    if (k == 0)
        snprintf(name, len, "step-%llu", (unsigned long long)step);
    else
        snprintf(name, len, "step-%llu.%u", (unsigned long long)step, k);
    if ((size_t)snprintf(dir, dir_len, "%s/%s", root, name) >= CKPT_PATH_MAX)
        return scape_set_error(SCAPE_INVALID, "checkpoint_dir %s: path too long", root);
    return SCAPE_OK;
}

#define MAX_ATTEMPTS 1000

static scape_rc fresh_dir(const char *root, uint64_t step, char *name, size_t len)
{
    TRY(mkdir_p(root));
    for (unsigned k = 0; k < MAX_ATTEMPTS; k++) {
        char dir[CKPT_PATH_MAX + 80];
        TRY(attempt_dir(root, step, k, name, len, dir, sizeof dir));
        if (mkdir(dir, 0750) == 0)
            return SCAPE_OK;
        if (errno != EEXIST)
            return scape_set_error(SCAPE_SYSTEM, "cannot create %s: %s", dir, strerror(errno));
    }
    return scape_set_error(SCAPE_SYSTEM, "%s: %d attempts at step %llu already", root,
                           MAX_ATTEMPTS, (unsigned long long)step);
}

/* Rank 0, before the manifest: every rank's file must be in this directory
 * with the size its rank reported (a checkpoint_dir that is not one shared
 * directory fails here, not at resume time). */
static scape_rc check_peers(const char *dir, const rank_result *all, int R)
{
    for (int r = 0; r < R; r++) {
        char name[32], path[CKPT_PATH_MAX + 64];
        rank_file_name(r, name, sizeof name);
        snprintf(path, sizeof path, "%s/%s", dir, name);
        struct stat st;
        if (stat(path, &st) != 0 || (uint64_t)st.st_size != all[r].bytes)
            return scape_set_error(SCAPE_SYSTEM, "rank %d's file is not in %s (is "
                                   "checkpoint_dir one directory that every node sees?)", r,
                                   dir);
    }
    return SCAPE_OK;
}

scape_rc ckpt_save(const char *root, eng_t *e, comm_t *comm, int keep, uint64_t *step_out,
                   char *dir_out, size_t dir_len)
{
    eng_ckpt_meta meta;
    eng_ckpt_sec secs[ENG_CKPT_MAX_SECS];
    int nsecs = 0;
    char dir[CKPT_PATH_MAX] = "", err[512] = "";
    memset(&meta, 0, sizeof meta);
    rank_result mine;
    memset(&mine, 0, sizeof mine);
    /* A failure here is this rank's: it still takes part in the exchange
     * below, so the others learn of it instead of waiting. */
    scape_rc rc = eng_ckpt_save(e, &meta, secs, &nsecs);
    if (rc == SCAPE_OK && (root == NULL || root[0] == '\0'))
        rc = scape_set_error(SCAPE_INVALID, "no checkpoint_dir is configured on rank %d (set "
                             "checkpoint_dir, SCAPE_CHECKPOINT_DIR or --checkpoint-dir)",
                             comm->rank);
    /* Rank 0 names this attempt's directory; an empty name tells the others
     * it could not. */
    char name[64] = "";
    if (rc == SCAPE_OK && comm->rank == 0 && fresh_dir(root, meta.step, name, sizeof name) !=
        SCAPE_OK)
        name[0] = '\0';
    scape_rc brc = comm_broadcast(comm, name, sizeof name, 0);
    if (brc != SCAPE_OK)
        return brc;
    name[sizeof name - 1] = '\0';
    if (rc == SCAPE_OK && name[0] == '\0')
        rc = scape_set_error(SCAPE_SYSTEM, "rank 0 could not create the checkpoint directory "
                             "under %s", root ? root : "");
    if (rc == SCAPE_OK && (size_t)snprintf(dir, sizeof dir, "%s/%s", root, name) >= sizeof dir)
        rc = scape_set_error(SCAPE_INVALID, "checkpoint_dir %s: path too long", root);
    if (rc == SCAPE_OK)
        rc = mkdir_p(dir);
    if (rc == SCAPE_OK)
        rc = write_rank_file(dir, &meta, secs, nsecs, &mine.bytes, &mine.hhash);
    mine.ok = rc == SCAPE_OK;
    if (rc != SCAPE_OK) {
        snprintf(err, sizeof err, "%s", scape_last_error());
        snprintf(mine.why, sizeof mine.why, "%.*s", (int)sizeof mine.why - 1, err);
    }
    /* Every rank learns every rank's outcome; only then is the manifest
     * written and LATEST moved, by rank 0. */
    int R = comm->size;
    rank_result *all = calloc((size_t)R, sizeof *all);
    size_t *counts = calloc((size_t)R, sizeof *counts);
    if (all == NULL || counts == NULL) {
        free(all);
        free(counts);
        return scape_set_error(SCAPE_NOMEM, "checkpoint: out of memory");
    }
    for (int r = 0; r < R; r++)
        counts[r] = sizeof mine;
    rc = comm_allgather(comm, &mine, all, counts);
    free(counts);
    int failed = -1;
    for (int r = 0; rc == SCAPE_OK && r < R && failed < 0; r++)
        if (!all[r].ok)
            failed = r;
    if (failed == 0 && comm->rank != 0 && name[0] == '\0')
        err[0] = '\0'; /* rank 0's own reason says more than "no directory" */
    if (failed >= 0 && err[0] == '\0') {
        all[failed].why[sizeof all[failed].why - 1] = '\0';
        snprintf(err, sizeof err, "rank %d: %s", failed, all[failed].why);
    }
    uint64_t committed[2] = { 0, (uint64_t)keep }; /* rank 0's verdict and keep */
    if (rc == SCAPE_OK && failed < 0 && comm->rank == 0) {
        char latest[80];
        snprintf(latest, sizeof latest, "%s\n", name);
        scape_rc w = check_peers(dir, all, R);
        if (w == SCAPE_OK)
            w = write_manifest(dir, &meta, all, R);
        if (w == SCAPE_OK)
            w = write_text(root, LATEST, latest);
        committed[0] = w == SCAPE_OK;
        if (w != SCAPE_OK)
            snprintf(err, sizeof err, "%s", scape_last_error());
    }
    free(all);
    if (rc != SCAPE_OK)
        return rc;
    if (failed < 0)
        TRY(comm_broadcast(comm, committed, sizeof committed, 0));
    if (failed >= 0 || !committed[0]) {
        if (err[0])
            return scape_set_error(SCAPE_SYSTEM, "checkpoint after step %llu failed: %s",
                                   (unsigned long long)meta.step, err);
        return scape_set_error(SCAPE_SYSTEM, "checkpoint after step %llu failed on rank %d "
                               "(see that daemon's log); the previous checkpoint stands",
                               (unsigned long long)meta.step, failed >= 0 ? failed : 0);
    }
    prune(root, comm->rank, (int)committed[1], name);
    if (step_out)
        *step_out = meta.step;
    if (dir_out)
        snprintf(dir_out, dir_len, "%s", dir);
    return SCAPE_OK;
}

/* ---- checking and restoring --------------------------------------------------- */

/* Read path's first line into buf, without the newline. */
static scape_rc read_line_file(const char *path, char *buf, size_t len)
{
    FILE *f = fopen_regular(path);
    if (f == NULL)
        return scape_set_error(SCAPE_SYSTEM, "%s: %s", path, strerror(errno));
    char *got = fgets(buf, (int)len, f);
    fclose(f);
    if (got == NULL)
        return scape_set_error(SCAPE_INVALID, "%s is empty", path);
    buf[strcspn(buf, "\r\n")] = '\0';
    return SCAPE_OK;
}

typedef struct manifest {
    uint64_t step;
    uint32_t world;
    char file[64];
    uint64_t bytes, hhash;
    int have_rank, complete;
} manifest;

static scape_rc read_manifest(const char *dir, int rank, manifest *m)
{
    char path[CKPT_PATH_MAX + 16], line[256];
    snprintf(path, sizeof path, "%s/%s", dir, MANIFEST);
    FILE *f = fopen_regular(path);
    if (f == NULL)
        return scape_set_error(SCAPE_SYSTEM, "%s: %s (an incomplete checkpoint?)", path,
                               strerror(errno));
    memset(m, 0, sizeof *m);
    int lines = 0, have_step = 0, have_world = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long long a, b, c;
        int r;
        char name[64];
        if (lines++ == 0 && strcmp(line, "scaped-checkpoint 1\n") != 0)
            break;
        if (sscanf(line, "step %llu", &a) == 1) {
            m->step = a;
            have_step = 1;
        } else if (sscanf(line, "world %llu", &a) == 1) {
            m->world = a <= 4096 ? (uint32_t)a : 0;
            have_world = 1;
        } else if (sscanf(line, "rank %d %63s %llu %llx", &r, name, &b, &c) == 4 && r == rank) {
            snprintf(m->file, sizeof m->file, "%s", name);
            m->bytes = b;
            m->hhash = c;
            m->have_rank = 1;
        } else if (strcmp(line, "end\n") == 0) {
            m->complete = 1;
        }
    }
    fclose(f);
    if (lines == 0 || !have_step || !have_world || !m->complete)
        return scape_set_error(SCAPE_INVALID, "%s: not a complete scaped manifest", path);
    if (m->world < 1 || m->world > 4096)
        return scape_set_error(SCAPE_INVALID, "%s: world %u is not in [1, 4096]", path, m->world);
    if (m->world == 0 || (uint32_t)rank >= m->world)
        return SCAPE_OK; /* the caller reports the other world size */
    if (!m->have_rank || strchr(m->file, '/'))
        return scape_set_error(SCAPE_INVALID, "%s: lists no file for rank %d", path, rank);
    return SCAPE_OK;
}

/* Open a rank file and read its header; checks it against the manifest. */
static scape_rc open_rank_file(const char *path, const manifest *mf, int rank, int *fd_out,
                               header *h)
{
    int not_regular;
    int fd = open_regular(path, &not_regular);
    if (fd < 0)
        return scape_set_error(not_regular ? SCAPE_INVALID : SCAPE_SYSTEM, "%s: %s", path,
                               not_regular ? "not a regular file" : strerror(errno));
    struct stat st;
    unsigned char buf[HEADER_MAX];
    scape_rc rc = SCAPE_OK;
    if (fstat(fd, &st) != 0)
        rc = scape_set_error(SCAPE_SYSTEM, "%s: %s", path, strerror(errno));
    else if ((uint64_t)st.st_size != mf->bytes)
        rc = scape_set_error(SCAPE_INVALID, "%s: %s: the file has %llu bytes, the manifest "
                             "says %llu", path,
                             (uint64_t)st.st_size < mf->bytes ? "truncated" : "wrong size",
                             (unsigned long long)st.st_size, (unsigned long long)mf->bytes);
    size_t got = 0;
    if (rc == SCAPE_OK) {
        /* The header is at most HEADER_MAX bytes; the file is at least as
         * long as the manifest says, so read what there is of it. */
        got = (uint64_t)st.st_size < sizeof buf ? (size_t)st.st_size : sizeof buf;
        if (pio_all(fd, buf, got, 0, 0) != 0)
            rc = scape_set_error(SCAPE_SYSTEM, "%s: read: %s", path, strerror(errno));
    }
    if (rc == SCAPE_OK)
        rc = decode(buf, got, path, h);
    if (rc == SCAPE_OK && h->hash != mf->hhash)
        rc = scape_set_error(SCAPE_INVALID, "%s: header checksum %016llx differs from the "
                             "manifest's %016llx", path, (unsigned long long)h->hash,
                             (unsigned long long)mf->hhash);
    if (rc == SCAPE_OK && (h->meta.rank != (uint32_t)rank || h->meta.world != mf->world ||
                           h->meta.step != mf->step))
        rc = scape_set_error(SCAPE_INVALID, "%s: holds rank %u of %u after step %llu; the "
                             "manifest wants rank %d of %u after step %llu", path,
                             h->meta.rank, h->meta.world, (unsigned long long)h->meta.step,
                             rank, mf->world, (unsigned long long)mf->step);
    if (rc == SCAPE_OK && lseek(fd, (off_t)h->bytes, SEEK_SET) < 0)
        rc = scape_set_error(SCAPE_SYSTEM, "%s: seek: %s", path, strerror(errno));
    if (rc != SCAPE_OK) {
        close(fd);
        return rc;
    }
    *fd_out = fd;
    return SCAPE_OK;
}

/* Read every section in order, into dst[i] when given (else into scratch),
 * checking each checksum. */
static scape_rc read_sections(int fd, const char *path, const header *h,
                              const eng_ckpt_sec *dst)
{
    char *scratch = dst ? NULL : malloc(CKPT_CHUNK);
    if (dst == NULL && scratch == NULL)
        return scape_set_error(SCAPE_NOMEM, "checkpoint: out of memory");
    scape_rc rc = SCAPE_OK;
    for (uint32_t i = 0; rc == SCAPE_OK && i < h->nsecs; i++) {
        const sec_entry *s = &h->sec[i];
        uint64_t hs = CKPT_HASH_SEED;
        for (uint64_t off = 0; rc == SCAPE_OK && off < s->bytes; off += CKPT_CHUNK) {
            size_t n = s->bytes - off < CKPT_CHUNK ? (size_t)(s->bytes - off) : CKPT_CHUNK;
            char *to = dst ? (char *)dst[i].ptr + off : scratch;
            rc = read_all(fd, to, n, path);
            if (rc == SCAPE_OK)
                hs = ckpt_hash(hs, to, n);
        }
        if (rc == SCAPE_OK && mix(hs, s->bytes) != s->hash)
            rc = scape_set_error(SCAPE_INVALID, "%s: section '%s' checksum mismatch (stored "
                                 "%016llx, computed %016llx): the file is corrupted", path,
                                 eng_ckpt_section_name(s->id), (unsigned long long)s->hash,
                                 (unsigned long long)mix(hs, s->bytes));
    }
    free(scratch);
    return rc;
}

scape_rc ckpt_open(const char *path, int rank, int world, ckpt_ref *out)
{
    if (path == NULL || path[0] == '\0' || out == NULL)
        return scape_set_error(SCAPE_INVALID, "resume: no checkpoint path");
    memset(out, 0, sizeof *out);
    char latest[CKPT_PATH_MAX + 16], name[256];
    snprintf(latest, sizeof latest, "%s/%s", path, LATEST);
    if (access(latest, F_OK) == 0) {
        TRY(read_line_file(latest, name, sizeof name));
        uint64_t s;
        if (!parse_step_dir(name, &s))
            return scape_set_error(SCAPE_INVALID, "%s: '%s' is not a step directory", latest,
                                   name);
        if ((size_t)snprintf(out->dir, sizeof out->dir, "%s/%s", path, name) >= sizeof out->dir)
            return scape_set_error(SCAPE_INVALID, "%s: path too long", path);
    } else {
        snprintf(out->dir, sizeof out->dir, "%s", path);
        char mpath[CKPT_PATH_MAX + 16];
        snprintf(mpath, sizeof mpath, "%s/%s", path, MANIFEST);
        if (access(mpath, F_OK) != 0)
            return scape_set_error(SCAPE_INVALID, "resume: %s holds no checkpoint (neither "
                                   "LATEST nor MANIFEST)", path);
    }
    manifest mf;
    TRY(read_manifest(out->dir, rank, &mf));
    out->step = mf.step;
    out->world = mf.world;
    out->reshard = mf.world != (uint32_t)world;
    /* This rank's file, or every file when resharding. */
    uint32_t first = out->reshard ? 0 : (uint32_t)rank;
    uint32_t last = out->reshard ? mf.world : (uint32_t)rank + 1;
    for (uint32_t q = first; q < last; q++) {
        manifest mq;
        TRY(read_manifest(out->dir, (int)q, &mq));
        if ((size_t)snprintf(out->file, sizeof out->file, "%s/%s", out->dir, mq.file) >=
            sizeof out->file)
            return scape_set_error(SCAPE_INVALID, "%s: path too long", out->dir);
        int fd;
        header h;
        TRY(open_rank_file(out->file, &mq, (int)q, &fd, &h));
        scape_rc rc = read_sections(fd, out->file, &h, NULL);
        close(fd);
        TRY(rc);
    }
    if (out->reshard)
        snprintf(out->file, sizeof out->file, "%s", out->dir);
    return SCAPE_OK;
}

/* This rank's part of a restore: the file into the engine's buffers. */
static scape_rc restore_local(const ckpt_ref *ref, eng_t *e, int rank, eng_ckpt_meta *meta)
{
    manifest mf;
    TRY(read_manifest(ref->dir, rank, &mf));
    if (!mf.have_rank)
        return scape_set_error(SCAPE_INVALID, "%s: lists no file for rank %d", ref->dir, rank);
    int fd;
    header h;
    TRY(open_rank_file(ref->file, &mf, rank, &fd, &h));
    eng_ckpt_sec secs[ENG_CKPT_MAX_SECS];
    int nsecs = 0;
    scape_rc rc = eng_ckpt_load_begin(e, &h.meta, secs, &nsecs);
    if (rc == SCAPE_OK && (uint32_t)nsecs != h.nsecs)
        rc = scape_set_error(SCAPE_INVALID, "%s: %u sections, the engine expects %d",
                             ref->file, h.nsecs, nsecs);
    for (int i = 0; rc == SCAPE_OK && i < nsecs; i++)
        if (h.sec[i].id != secs[i].id || h.sec[i].bytes != secs[i].bytes)
            rc = scape_set_error(SCAPE_INVALID, "%s: section %d is '%s' of %llu bytes, the "
                                 "engine expects '%s' of %zu", ref->file, i,
                                 eng_ckpt_section_name(h.sec[i].id),
                                 (unsigned long long)h.sec[i].bytes,
                                 eng_ckpt_section_name(secs[i].id), secs[i].bytes);
    if (rc == SCAPE_OK)
        rc = read_sections(fd, ref->file, &h, secs);
    close(fd);
    *meta = h.meta;
    return rc;
}

/* ---- resharding ----------------------------------------------------------- */

typedef struct coords {
    float *m, *v, *theta, *res;
    unsigned char *mask_cur, *mask_next;
    eng_coord_state st;
} coords;

static void coords_free(coords *c)
{
    void *p[] = { c->m, c->v, c->theta, c->res, c->mask_cur, c->mask_next };
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        free(p[i]);
    memset(c, 0, sizeof *c);
}

/* Old rank q's sections, in its plan's comm order, into coordinate order:
 * its shard of m, v and theta; its residual added to ours when q maps to
 * us; the masks from rank 0. */
static void take_sections(const plan *old, const header *h, void *const *buf, int mine,
                          coords *c)
{
    const eng_ckpt_meta *m = &h->meta;
    for (uint32_t s = 0; s < h->nsecs; s++) {
        uint32_t id = h->sec[s].id;
        const float *f = buf[s];
        const uint32_t *w = buf[s];
        for (size_t l = 0; l < old->ntensors; l++) {
            const plan_tensor *t = &old->t[l];
            int in_shard = t->pos >= m->state_base && t->pos < m->state_base + m->state_len;
            float *dst = id == ENG_SEC_M ? c->m : id == ENG_SEC_V ? c->v
                       : id == ENG_SEC_THETA ? c->theta : NULL;
            if (dst && in_shard)
                memcpy(dst + t->off, f + (t->pos - m->state_base), t->len * sizeof(float));
            if (id == ENG_SEC_RESIDUAL && mine)
                for (size_t i = 0; i < t->len; i++)
                    c->res[t->off + i] += f[t->pos + i];
            unsigned char *mb = m->rank != 0 ? NULL : id == ENG_SEC_MASK_CUR ? c->mask_cur
                              : id == ENG_SEC_MASK_NEXT ? c->mask_next : NULL;
            for (size_t i = 0; mb && i < t->len; i++)
                mb[t->off + i] = (unsigned char)((w[t->word + i / 32] >> (i % 32)) & 1u);
        }
    }
}

/* An old rank's file must describe exactly what that rank of the old plan
 * held: its shard range and the sections an engine of that optimizer writes
 * for its flags, in order and of their sizes.  Anything else is refused
 * before a byte of it is used. */
static scape_rc check_old_file(const plan *old, const header *h, uint32_t q,
                               const eng_config *cfg, const char *path)
{
    const eng_ckpt_meta *m = &h->meta;
    uint32_t known = ENG_CKF_RESIDUAL_ZERO | ENG_CKF_MASK_CUR | ENG_CKF_MASK_NEXT;
    if (m->optimizer != (uint32_t)cfg->optimizer || m->mode >= ENG_MODE_COUNT ||
        (m->flags & ~known))
        return scape_set_error(SCAPE_INVALID, "%s: optimizer, mode or flags do not fit", path);
    size_t base = m->mode == ENG_MODE_SHARDED ? old->shard[q].pos0 : 0;
    size_t len = m->mode == ENG_MODE_SHARDED ? old->shard[q].len : old->n;
    if (m->state_base != base || m->state_len != len)
        return scape_set_error(SCAPE_INVALID, "%s: shard [%llu, +%llu) is not rank %u's of %d",
                               path, (unsigned long long)m->state_base,
                               (unsigned long long)m->state_len, q, old->nranks);
    eng_ckpt_sec want[ENG_CKPT_MAX_SECS];
    int k = eng_ckpt_layout(cfg->optimizer, m->flags, len, old->n, old->nwords, want);
    if ((uint32_t)k != h->nsecs)
        return scape_set_error(SCAPE_INVALID, "%s: %u sections, expected %d", path, h->nsecs, k);
    for (int i = 0; i < k; i++)
        if (h->sec[i].id != want[i].id || h->sec[i].bytes != want[i].bytes)
            return scape_set_error(SCAPE_INVALID, "%s: its sections are not those of rank %u "
                                   "(section %d)", path, q, i);
    return SCAPE_OK;
}

/* Read every old rank's file into coordinate-order state for this rank. */
static scape_rc reshard_local(const ckpt_ref *ref, eng_t *e, int rank, int R, coords *c)
{
    size_t n = eng_n(e), nt = eng_ntensors(e);
    const eng_config *cfg = eng_get_config(e);
    int adamw = eng_opt_get(cfg->optimizer)->keeps_v;
    memset(c, 0, sizeof *c);
    c->m = calloc(n, sizeof(float));
    c->v = adamw ? calloc(n, sizeof(float)) : NULL;
    c->theta = calloc(n, sizeof(float));
    c->res = calloc(n, sizeof(float));
    c->mask_cur = calloc(n, 1);
    c->mask_next = calloc(n, 1);
    eng_tensor *ts = calloc(nt, sizeof *ts);
    if (!c->m || (adamw && !c->v) || !c->theta || !c->res || !c->mask_cur || !c->mask_next ||
        !ts) {
        free(ts);
        return scape_set_error(SCAPE_NOMEM, "resharding: out of memory for N=%zu", n);
    }
    plan *old = NULL;
    scape_rc rc = eng_get_layout(e, ts, nt);
    if (rc == SCAPE_OK)
        rc = plan_build(&old, ts, nt, (int)ref->world, cfg->rho);
    free(ts);
    for (uint32_t q = 0; rc == SCAPE_OK && q < ref->world; q++) {
        manifest mq;
        char path[CKPT_PATH_MAX + 80];
        int fd = -1;
        header h;
        memset(&h, 0, sizeof h);
        rc = read_manifest(ref->dir, (int)q, &mq);
        if (rc == SCAPE_OK)
            snprintf(path, sizeof path, "%s/%s", ref->dir, mq.file);
        if (rc == SCAPE_OK)
            rc = open_rank_file(path, &mq, (int)q, &fd, &h);
        if (rc == SCAPE_OK && (h.meta.layout_hash != eng_layout_hash(e) || h.meta.n != n))
            rc = scape_set_error(SCAPE_INVALID, "restore: the checkpoint's tensor layout "
                                 "differs from the trainers'");
        if (rc == SCAPE_OK)
            rc = check_old_file(old, &h, q, cfg, path);
        eng_config as_taken = *cfg; /* the mode may change with the world size */
        as_taken.mode = (eng_mode)h.meta.mode;
        if (rc == SCAPE_OK && h.meta.config_hash != eng_config_hash(&as_taken))
            rc = scape_set_error(SCAPE_INVALID, "restore: the checkpoint was taken with other "
                                 "optimizer settings (%s must match; the mode may change)",
                                 eng_config_hashed());
        eng_ckpt_sec secs[ENG_CKPT_MAX_SECS];
        void *bufs[ENG_CKPT_MAX_SECS] = { 0 };
        for (uint32_t s = 0; rc == SCAPE_OK && s < h.nsecs; s++) {
            bufs[s] = malloc(h.sec[s].bytes ? (size_t)h.sec[s].bytes : 1);
            secs[s] = (eng_ckpt_sec){ h.sec[s].id, bufs[s], (size_t)h.sec[s].bytes };
            if (bufs[s] == NULL)
                rc = scape_set_error(SCAPE_NOMEM, "resharding: out of memory");
        }
        if (rc == SCAPE_OK)
            rc = read_sections(fd, path, &h, secs);
        if (rc == SCAPE_OK)
            take_sections(old, &h, bufs, (int)(q % (uint32_t)R) == rank, c);
        if (rc == SCAPE_OK && q == 0) {
            c->st.step = h.meta.step;
            c->st.flags = h.meta.flags;
        }
        for (uint32_t s = 0; s < ENG_CKPT_MAX_SECS; s++)
            free(bufs[s]);
        if (fd >= 0)
            close(fd);
    }
    plan_destroy(&old);
    c->st.m = c->m;
    c->st.v = c->v;
    c->st.theta = c->theta;
    c->st.residual = c->res;
    c->st.mask_cur = c->mask_cur;
    c->st.mask_next = c->mask_next;
    return rc;
}

scape_rc ckpt_restore(const ckpt_ref *ref, eng_t *e, comm_t *comm, void *const *params)
{
    eng_ckpt_meta meta;
    coords co;
    memset(&co, 0, sizeof co);
    uint64_t ok = (ref->reshard ? reshard_local(ref, e, comm->rank, comm->size, &co)
                                : restore_local(ref, e, comm->rank, &meta)) == SCAPE_OK;
    char err[512];
    snprintf(err, sizeof err, "%s", ok ? "" : scape_last_error());
    int R = comm->size;
    uint64_t *all = calloc((size_t)R, sizeof *all);
    size_t *counts = calloc((size_t)R, sizeof *counts);
    scape_rc rc = all && counts ? SCAPE_OK : scape_set_error(SCAPE_NOMEM, "out of memory");
    for (int r = 0; rc == SCAPE_OK && r < R; r++)
        counts[r] = sizeof ok;
    if (rc == SCAPE_OK)
        rc = comm_allgather(comm, &ok, all, counts);
    int failed = -1;
    for (int r = 0; rc == SCAPE_OK && r < R && failed < 0; r++)
        if (!all[r])
            failed = r;
    free(all);
    free(counts);
    if (rc != SCAPE_OK)
        return rc;
    if (!ok || failed >= 0)
        coords_free(&co);
    if (!ok)
        return scape_set_error(SCAPE_INVALID, "restore from %s refused: %s", ref->dir, err);
    if (failed >= 0)
        return scape_set_error(SCAPE_INVALID, "restore from %s refused: rank %d could not "
                               "read its part (see that daemon's log)", ref->dir, failed);
    if (ref->reshard) {
        LOG_INFO(SUB_ENGINE, "resharded the checkpoint of %u rank(s) onto %d", ref->world,
                 comm->size);
        rc = eng_ckpt_load_coords(e, &co.st, params);
        coords_free(&co);
        return rc;
    }
    if ((int)meta.trainers != eng_total_trainers(e))
        LOG_WARN(SUB_ENGINE, "the checkpoint was taken with %u trainer(s) in the job, it "
                 "resumes with %d: the gradient average changes from here on", meta.trainers,
                 eng_total_trainers(e));
    return eng_ckpt_load_finish(e, &meta, params);
}

/* ---- what state_dicts name -------------------------------------------------------- */

scape_rc ckpt_mark_handed_out(const char *dir)
{
    char path[CKPT_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/%s", dir, HANDED_OUT);
    if (access(path, F_OK) == 0)
        return SCAPE_OK;
    return write_text(dir, HANDED_OUT, "named by a state_dict: pruned only once checkpoint_keep "
                      "newer ones were\n");
}

void ckpt_relative(const char *root, const char *dir, char *name, size_t len)
{
    size_t n = strlen(root);
    name[0] = '\0';
    while (n > 1 && root[n - 1] == '/')
        n--;
    if (n && strncmp(dir, root, n) == 0 && dir[n] == '/' && dir[n + 1] != '\0') {
        snprintf(name, len, "%s", dir + n + 1);
        return;
    }
    char *r = realpath(root, NULL), *d = realpath(dir, NULL);
    n = r ? strlen(r) : 0;
    if (r && d && strncmp(d, r, n) == 0 && d[n] == '/' && d[n + 1] != '\0')
        snprintf(name, len, "%s", d + n + 1);
    free(r);
    free(d);
}

scape_rc ckpt_missing(const char *root, const char *name, int keep)
{
    char path[CKPT_PATH_MAX + 16], line[256];
    snprintf(path, sizeof path, "%s/%s", root, PRUNED);
    FILE *f = fopen(path, "r");
    int pruned = 0;
    while (f && !pruned && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        pruned = strcmp(line, name) == 0;
    }
    if (f)
        fclose(f);
    if (pruned)
        return scape_set_error(SCAPE_INVALID, "checkpoint %s in %s was pruned: checkpoint_keep "
                               "is %d (the newest %d checkpoints and the newest %d that "
                               "state_dicts named are kept); raise checkpoint_keep to keep "
                               "more", name, root, keep, keep, keep);
    return scape_set_error(SCAPE_INVALID, "checkpoint %s is not in %s, and was not pruned "
                           "there (removed by hand, never written, or another "
                           "checkpoint_dir)", name, root);
}

/* The request file of a state_dict after `step`, in round `round`. */
static void want_path(const char *root, uint64_t step, uint32_t round, char *path, size_t len)
{
    snprintf(path, len, "%s/.state_dict-%llu.%u", root, (unsigned long long)step, round);
}

scape_rc ckpt_want(const char *root, uint64_t step, uint32_t round)
{
    char path[CKPT_PATH_MAX + 48];
    TRY(mkdir_p(root));
    want_path(root, step, round, path, sizeof path);
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0640);
    if (fd < 0)
        return scape_set_error(SCAPE_SYSTEM, "state_dict: cannot ask the other daemons "
                               "through %s: %s", path, strerror(errno));
    close(fd);
    return SCAPE_OK;
}

int ckpt_wanted(const char *root, uint64_t step, uint32_t round)
{
    char path[CKPT_PATH_MAX + 48];
    want_path(root, step, round, path, sizeof path);
    return access(path, F_OK) == 0;
}

void ckpt_unwant(const char *root, uint64_t step, uint32_t round)
{
    char path[CKPT_PATH_MAX + 48];
    want_path(root, step, round, path, sizeof path);
    if (unlink(path) != 0 && errno != ENOENT)
        LOG_WARN(SUB_ENGINE, "%s: %s", path, strerror(errno));
}

/* The marker of rank `rank` of job `job`: what it says (CKPT_IDLE, CKPT_LEAVING). */
static void mark_path(const char *root, uint32_t job, int rank, int kind, char *path,
                      size_t len)
{
    snprintf(path, len, "%s/.%s-%u.%d", root, kind == CKPT_LEAVING ? "leaving" : "idle",
             (unsigned)job, rank);
}

scape_rc ckpt_mark(const char *root, uint32_t job, int rank, int kind)
{
    char path[CKPT_PATH_MAX + 48], old[CKPT_PATH_MAX + 48];
    if (kind != CKPT_NO_MARK) { /* the new one first: a rank is never seen unmarked between */
        TRY(mkdir_p(root));
        mark_path(root, job, rank, kind, path, sizeof path);
        int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0640);
        if (fd < 0)
            return scape_set_error(SCAPE_SYSTEM, "cannot tell the other daemons through %s: "
                                   "%s", path, strerror(errno));
        close(fd);
    }
    for (int k = CKPT_IDLE; k <= CKPT_LEAVING; k++) {
        if (k == kind)
            continue;
        mark_path(root, job, rank, k, old, sizeof old);
        if (unlink(old) != 0 && errno != ENOENT)
            LOG_WARN(SUB_ENGINE, "%s: %s", old, strerror(errno));
    }
    return SCAPE_OK;
}

int ckpt_marks(const char *root, uint32_t job, int world, int *leaving, char *missing,
               size_t len)
{
    char path[CKPT_PATH_MAX + 48];
    int n = 0;
    size_t used = 0;
    *leaving = 0;
    if (len)
        missing[0] = '\0';
    for (int r = 0; r < world; r++) {
        mark_path(root, job, r, CKPT_LEAVING, path, sizeof path);
        if (access(path, F_OK) == 0) {
            (*leaving)++;
            continue;
        }
        mark_path(root, job, r, CKPT_IDLE, path, sizeof path);
        if (access(path, F_OK) == 0)
            continue;
        if (len == 0)
            return 1; /* whether any is missing is all the caller asks */
        if (used < len) {
            int w = snprintf(missing + used, len - used, "%s%d", n ? ", " : "", r);
            used += w > 0 ? (size_t)w : 0;
        }
        n++;
    }
    if (len > 4 && used >= len) /* cut: say so */
        snprintf(missing + len - 5, 5, "...");
    return n;
}
