/* auth.c - the rendezvous seals (auth.h): munge credentials, a shared key,
 * or nothing.
 *
 * A secret seal is "SCS1" | nonce (24 bytes) | secretbox(key, nonce,
 * sealed_at (8 bytes, little endian, ms since the epoch) | message).  The
 * box authenticates and encrypts at once, so a seal made with another key
 * does not open at all; the time and a cache of the nonces already opened
 * refuse what a listener on the network could replay.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* getpwuid_r */
#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>
#ifdef SCAPE_HAVE_MUNGE
#include <munge.h>
#endif

#include "auth.h"

#define SEAL_MAGIC "SCS1"
#define SEAL_HEAD (4 + crypto_secretbox_NONCEBYTES)
#define SEAL_MAX (1u << 20)  /* a join or a table is a few KiB */
#define REPLAY_SLOTS 256
#define KEY_Z85 40

struct auth_ctx {
    auth_mode mode;
    unsigned char key[crypto_secretbox_KEYBYTES];
    unsigned char seen[REPLAY_SLOTS][crypto_secretbox_NONCEBYTES];
    int nseen, next_seen;
#ifdef SCAPE_HAVE_MUNGE
    munge_ctx_t enc, enc_private, dec;
#endif
};

static const char *const s_names[AUTH_MODE_COUNT] = { "none", "munge", "secret" };

const char *auth_mode_name(auth_mode m)
{
    return (unsigned)m < AUTH_MODE_COUNT ? s_names[m] : "?";
}

auth_mode auth_ctx_mode(const auth_ctx *a) { return a ? a->mode : AUTH_NONE; }

void auth_uid_name(unsigned uid, char *buf, size_t len)
{
    struct passwd pw, *res = NULL;
    char tmp[1024];
    if (getpwuid_r(uid, &pw, tmp, sizeof tmp, &res) == 0 && res)
        snprintf(buf, len, "uid %u (%s)", (unsigned)uid, res->pw_name);
    else
        snprintf(buf, len, "uid %u", (unsigned)uid);
}

/* ---- munge ------------------------------------------------------------------ */

#ifdef SCAPE_HAVE_MUNGE
static munge_ctx_t munge_ctx(const char *socket, char *why, size_t len)
{
    munge_ctx_t c = munge_ctx_create();
    if (c == NULL) {
        snprintf(why, len, "munge_ctx_create failed");
        return NULL;
    }
    if (socket && socket[0] && munge_ctx_set(c, MUNGE_OPT_SOCKET, socket) != EMUNGE_SUCCESS) {
        snprintf(why, len, "munge socket %s: %s", socket, munge_ctx_strerror(c));
        munge_ctx_destroy(c);
        return NULL;
    }
    return c;
}

int auth_munge_answers(const char *socket, char *why, size_t len)
{
    munge_ctx_t c = munge_ctx(socket, why, len);
    if (c == NULL)
        return 0;
    char *cred = NULL;
    munge_err_t e = munge_encode(&cred, c, NULL, 0);
    if (e != EMUNGE_SUCCESS)
        snprintf(why, len, "no munged answers at %s: %s",
                 socket && socket[0] ? socket : "munge's default socket",
                 munge_ctx_strerror(c) ? munge_ctx_strerror(c) : munge_strerror(e));
    free(cred);
    munge_ctx_destroy(c);
    return e == EMUNGE_SUCCESS;
}

static scape_rc munge_setup(auth_ctx *a, const char *socket)
{
    char why[300];
    if (!auth_munge_answers(socket, why, sizeof why))
        return scape_set_error(SCAPE_UNSUPPORTED, "auth munge: %s", why);
    if ((a->enc = munge_ctx(socket, why, sizeof why)) == NULL ||
        (a->enc_private = munge_ctx(socket, why, sizeof why)) == NULL ||
        (a->dec = munge_ctx(socket, why, sizeof why)) == NULL)
        return scape_set_error(SCAPE_SYSTEM, "auth munge: %s", why);
    if (munge_ctx_set(a->enc_private, MUNGE_OPT_UID_RESTRICTION, geteuid()) != EMUNGE_SUCCESS)
        return scape_set_error(SCAPE_SYSTEM, "auth munge: uid restriction: %s",
                               munge_ctx_strerror(a->enc_private));
    return SCAPE_OK;
}

static scape_rc munge_seal(auth_ctx *a, const void *p, size_t n, int private_, uint8_t **out,
                           size_t *outn)
{
    char *cred = NULL;
    munge_ctx_t c = private_ ? a->enc_private : a->enc;
    munge_err_t e = munge_encode(&cred, c, p, (int)n);
    if (e != EMUNGE_SUCCESS) {
        free(cred);
        return scape_set_error(SCAPE_SYSTEM, "auth munge: cannot make a credential: %s",
                               munge_ctx_strerror(c) ? munge_ctx_strerror(c) : munge_strerror(e));
    }
    *outn = strlen(cred);
    *out = (uint8_t *)cred;
    return SCAPE_OK;
}

static scape_rc munge_open(auth_ctx *a, const void *in, size_t n, uint8_t **p, size_t *pn)
{
    if (n < 6 || memcmp(in, "MUNGE:", 6) != 0 || memchr(in, '\0', n) != NULL)
        return scape_set_error(SCAPE_INVALID, "no munge credential (is this rank auth: munge?)");
    char *cred = malloc(n + 1);
    if (cred == NULL)
        return scape_set_error(SCAPE_NOMEM, "auth munge: out of memory");
    memcpy(cred, in, n);
    cred[n] = '\0';
    void *buf = NULL;
    int len = 0;
    uid_t uid = (uid_t)-1;
    gid_t gid = (gid_t)-1;
    munge_err_t e = munge_decode(cred, a->dec, &buf, &len, &uid, &gid);
    free(cred);
    char who[300], me[300];
    auth_uid_name(uid, who, sizeof who);
    auth_uid_name(geteuid(), me, sizeof me);
    scape_rc rc = SCAPE_OK;
    if (e == EMUNGE_CRED_UNAUTHORIZED)
        rc = scape_set_error(SCAPE_INVALID, "a munge credential for another user than %s", me);
    else if (e != EMUNGE_SUCCESS)
        rc = scape_set_error(SCAPE_INVALID, "a munge credential of %s that does not hold: %s",
                             uid == (uid_t)-1 ? "an unknown user" : who,
                             munge_ctx_strerror(a->dec) ? munge_ctx_strerror(a->dec)
                                                        : munge_strerror(e));
    else if (uid != geteuid())
        rc = scape_set_error(SCAPE_INVALID, "a munge credential of %s, not of the job's %s", who,
                             me);
    if (rc != SCAPE_OK) {
        free(buf);
        return rc;
    }
    *p = buf ? buf : malloc(1);
    *pn = (size_t)len;
    return *p ? SCAPE_OK : scape_set_error(SCAPE_NOMEM, "auth munge: out of memory");
}
#else
int auth_munge_answers(const char *socket, char *why, size_t len)
{
    (void)socket;
    snprintf(why, len, "this scaped was built without libmunge, so it has no auth: munge (for "
             "that, install libmunge's headers: libmunge-dev on Debian, munge-devel on RHEL, "
             "munge in Spack; and rebuild scaped)");
    return 0;
}
#endif

/* ---- a shared key ------------------------------------------------------------- */

static scape_rc read_key(const char *path, unsigned char key[AUTH_KEY_BYTES])
{
    if (path == NULL || path[0] == '\0')
        return scape_set_error(SCAPE_INVALID, "auth secret needs auth_key_file (write one with "
                               "'scaped keygen FILE' in a directory the job's nodes share)");
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        int err = errno;
        if (fd >= 0)
            close(fd);
        return scape_set_error(SCAPE_SYSTEM, "auth_key_file %s: %s", path, strerror(err));
    }
    char text[KEY_Z85 + 2] = { 0 };
    ssize_t n = S_ISREG(st.st_mode) ? read(fd, text, sizeof text) : -1;
    close(fd);
    if (!S_ISREG(st.st_mode))
        return scape_set_error(SCAPE_INVALID, "auth_key_file %s is not a regular file", path);
    if (st.st_uid != geteuid())
        return scape_set_error(SCAPE_INVALID, "auth_key_file %s belongs to uid %u, not to this "
                               "user (uid %u)", path, (unsigned)st.st_uid, (unsigned)geteuid());
    if (st.st_mode & 077)
        return scape_set_error(SCAPE_INVALID, "auth_key_file %s can be read by others (mode "
                               "%04o): chmod 600 it, and make a new key if others may have "
                               "read it", path, (unsigned)(st.st_mode & 07777));
    if (n == KEY_Z85 + 1 && text[KEY_Z85] == '\n')
        n = KEY_Z85;
    text[n > 0 && n <= KEY_Z85 ? n : 0] = '\0';
    if (n != KEY_Z85 || zmq_z85_decode(key, text) == NULL)
        return scape_set_error(SCAPE_INVALID, "auth_key_file %s does not hold a key (40 Z85 "
                               "characters, as 'scaped keygen' writes)", path);
    return SCAPE_OK;
}

scape_rc auth_keygen(const char *path)
{
    if (sodium_init() < 0)
        return scape_set_error(SCAPE_SYSTEM, "keygen: libsodium cannot start");
    unsigned char key[AUTH_KEY_BYTES];
    char text[KEY_Z85 + 2];
    randombytes_buf(key, sizeof key);
    if (zmq_z85_encode(text, key, sizeof key) == NULL)
        return scape_set_error(SCAPE_SYSTEM, "keygen: cannot encode the key");
    sodium_memzero(key, sizeof key);
    strcat(text, "\n");
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return scape_set_error(SCAPE_SYSTEM, "keygen: cannot create %s: %s%s", path,
                               strerror(errno),
                               errno == EEXIST ? " (a key is never overwritten; remove it "
                                                 "first to replace it)" : "");
    ssize_t w = write(fd, text, strlen(text));
    int ok = w == (ssize_t)strlen(text) && fsync(fd) == 0;
    int err = errno;
    sodium_memzero(text, sizeof text);
    if (close(fd) != 0 || !ok) {
        unlink(path);
        return scape_set_error(SCAPE_SYSTEM, "keygen: cannot write %s: %s", path,
                               strerror(ok ? errno : err));
    }
    return SCAPE_OK;
}

static uint64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static scape_rc secret_seal(auth_ctx *a, const void *p, size_t n, uint8_t **out, size_t *outn)
{
    if (n > SEAL_MAX)
        return scape_set_error(SCAPE_INVALID, "auth secret: message too long");
    size_t plain = 8 + n, total = SEAL_HEAD + crypto_secretbox_MACBYTES + plain;
    uint8_t *m = malloc(plain), *s = malloc(total);
    if (m == NULL || s == NULL) {
        free(m);
        free(s);
        return scape_set_error(SCAPE_NOMEM, "auth secret: out of memory");
    }
    uint64_t t = wall_ms();
    for (int i = 0; i < 8; i++)
        m[i] = (uint8_t)(t >> (8 * i));
    if (n)
        memcpy(m + 8, p, n);
    memcpy(s, SEAL_MAGIC, 4);
    randombytes_buf(s + 4, crypto_secretbox_NONCEBYTES);
    crypto_secretbox_easy(s + SEAL_HEAD, m, plain, s + 4, a->key);
    free(m);
    *out = s;
    *outn = total;
    return SCAPE_OK;
}

static int seen_before(auth_ctx *a, const unsigned char *nonce)
{
    for (int i = 0; i < a->nseen; i++)
        if (memcmp(a->seen[i], nonce, crypto_secretbox_NONCEBYTES) == 0)
            return 1;
    memcpy(a->seen[a->next_seen], nonce, crypto_secretbox_NONCEBYTES);
    a->next_seen = (a->next_seen + 1) % REPLAY_SLOTS;
    if (a->nseen < REPLAY_SLOTS)
        a->nseen++;
    return 0;
}

static scape_rc secret_open(auth_ctx *a, const void *in, size_t n, uint8_t **p, size_t *pn)
{
    const uint8_t *s = in;
    if (n < SEAL_HEAD + crypto_secretbox_MACBYTES + 8 || n > SEAL_MAX + 256 ||
        memcmp(s, SEAL_MAGIC, 4) != 0)
        return scape_set_error(SCAPE_INVALID, "not sealed with a key (is this rank auth: "
                               "secret?)");
    size_t plain = n - SEAL_HEAD - crypto_secretbox_MACBYTES;
    uint8_t *m = malloc(plain);
    if (m == NULL)
        return scape_set_error(SCAPE_NOMEM, "auth secret: out of memory");
    if (crypto_secretbox_open_easy(m, s + SEAL_HEAD, n - SEAL_HEAD, s + 4, a->key) != 0) {
        free(m);
        return scape_set_error(SCAPE_INVALID, "sealed with another key than this job's "
                               "auth_key_file");
    }
    uint64_t t = 0, now = wall_ms();
    for (int i = 0; i < 8; i++)
        t |= (uint64_t)m[i] << (8 * i);
    uint64_t age = now > t ? now - t : t - now;
    scape_rc rc = SCAPE_OK;
    if (age > (uint64_t)AUTH_SEAL_TTL_S * 1000u)
        rc = scape_set_error(SCAPE_INVALID, "a seal made %.0f s %s: expired, replayed, or the "
                             "nodes' clocks disagree", (double)age / 1e3,
                             now > t ? "ago" : "in the future");
    else if (seen_before(a, s + 4))
        rc = scape_set_error(SCAPE_INVALID, "a seal opened before: replayed");
    if (rc != SCAPE_OK) {
        free(m);
        return rc;
    }
    memmove(m, m + 8, plain - 8);
    *p = m;
    *pn = plain - 8;
    return SCAPE_OK;
}

/* ---- either ------------------------------------------------------------------ */

scape_rc auth_create(auth_mode mode, const char *key_file, const char *munge_socket,
                     auth_ctx **out)
{
    if (out == NULL || (unsigned)mode >= AUTH_MODE_COUNT)
        return scape_set_error(SCAPE_INVALID, "auth_create: bad argument");
    if (sodium_init() < 0)
        return scape_set_error(SCAPE_SYSTEM, "auth: libsodium cannot start");
    auth_ctx *a = sodium_malloc(sizeof *a);
    if (a == NULL)
        return scape_set_error(SCAPE_NOMEM, "auth: out of memory");
    memset(a, 0, sizeof *a);
    a->mode = mode;
    scape_rc rc = SCAPE_OK;
    if (mode == AUTH_SECRET)
        rc = read_key(key_file, a->key);
    else if (mode == AUTH_MUNGE) {
#ifdef SCAPE_HAVE_MUNGE
        rc = munge_setup(a, munge_socket);
#else
        (void)munge_socket;
        rc = scape_set_error(SCAPE_UNSUPPORTED, "auth munge: this scaped was built without "
                             "libmunge (install libmunge-dev and rebuild, or use auth: secret)");
#endif
    }
    if (rc != SCAPE_OK) {
        auth_destroy(a);
        return rc;
    }
    *out = a;
    return SCAPE_OK;
}

void auth_destroy(auth_ctx *a)
{
    if (a == NULL)
        return;
#ifdef SCAPE_HAVE_MUNGE
    if (a->enc)
        munge_ctx_destroy(a->enc);
    if (a->enc_private)
        munge_ctx_destroy(a->enc_private);
    if (a->dec)
        munge_ctx_destroy(a->dec);
#endif
    sodium_free(a); /* zeroes the key */
}

scape_rc auth_seal(auth_ctx *a, const void *p, size_t n, int private_, uint8_t **out,
                   size_t *outn)
{
    if (out == NULL || outn == NULL || (n && p == NULL))
        return scape_set_error(SCAPE_INVALID, "auth_seal: bad argument");
    switch (auth_ctx_mode(a)) {
#ifdef SCAPE_HAVE_MUNGE
    case AUTH_MUNGE: return munge_seal(a, p, n, private_, out, outn);
#endif
    case AUTH_SECRET: return secret_seal(a, p, n, out, outn);
    default:
        if ((*out = malloc(n ? n : 1)) == NULL)
            return scape_set_error(SCAPE_NOMEM, "auth_seal: out of memory");
        if (n)
            memcpy(*out, p, n);
        *outn = n;
        return SCAPE_OK;
    }
}

scape_rc auth_open(auth_ctx *a, const void *in, size_t n, uint8_t **p, size_t *pn)
{
    if (p == NULL || pn == NULL || (n && in == NULL))
        return scape_set_error(SCAPE_INVALID, "auth_open: bad argument");
    switch (auth_ctx_mode(a)) {
#ifdef SCAPE_HAVE_MUNGE
    case AUTH_MUNGE: return munge_open(a, in, n, p, pn);
#endif
    case AUTH_SECRET: return secret_open(a, in, n, p, pn);
    default: return auth_seal(NULL, in, n, 0, p, pn);
    }
}
