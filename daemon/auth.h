/* auth.h - proving that a rendezvous message comes from the job's own user.
 *
 * The rendezvous wraps each join and each answer in a seal:
 *   munge   a munge credential whose payload is the message (restricted to
 *           this uid when it is private: only the job's user can decode it;
 *           munged refuses a replay and an expired one); the opener checks
 *           the sender's uid, and names it when it is another.
 *   secret  the message encrypted and authenticated with a 32-byte key that
 *           only the user can read (XSalsa20-Poly1305, libsodium), with the
 *           time it was sealed; the opener refuses another key, a seal older
 *           than AUTH_SEAL_TTL_S and a nonce it has already opened.
 *   none    the message as it is (auth: none, asked for explicitly).
 * A failed open leaves a message that says why (whose uid, which check),
 * for the refusal and the log.
 */
#ifndef SCAPE_AUTH_H
#define SCAPE_AUTH_H

#include <stddef.h>
#include <stdint.h>

#include "scape_rc.h"

typedef enum auth_mode {
    AUTH_NONE = 0,
    AUTH_MUNGE,
    AUTH_SECRET,
    AUTH_MODE_COUNT
} auth_mode;

#define AUTH_KEY_BYTES 32
#define AUTH_SEAL_TTL_S 300 /* as munge's default credential lifetime */

typedef struct auth_ctx auth_ctx;

const char *auth_mode_name(auth_mode m);

/* Whether a munged answers at socket (NULL or "": libmunge's default); on
 * 0, why (len bytes) says what failed. */
int auth_munge_answers(const char *socket, char *why, size_t len);

/* A sealer for mode.  secret: key_file must be a regular file of this user,
 * readable by nobody else, holding a key written by auth_keygen.  munge:
 * munge_socket as above; fails when this build has no libmunge. */
scape_rc auth_create(auth_mode mode, const char *key_file, const char *munge_socket,
                     auth_ctx **out);
auth_mode auth_ctx_mode(const auth_ctx *a);
void auth_destroy(auth_ctx *a);

/* Seal n bytes at p: *out (malloc'd, *outn bytes) is what goes on the wire.
 * private: only this user may read it (munge: a uid restriction; a secret
 * seal is always encrypted).  A join is not private (its endpoint and public
 * key are not secret, and rank 0 can then name another user who sends one);
 * rank 0's table, with the NCCL ids, is. */
scape_rc auth_seal(auth_ctx *a, const void *p, size_t n, int private_, uint8_t **out,
                   size_t *outn);
/* Open a seal: *p (malloc'd, *pn bytes) is the message.  SCAPE_INVALID with
 * the reason when it was not sealed by this user (or with this key), was
 * replayed or has expired; nothing is returned then. */
scape_rc auth_open(auth_ctx *a, const void *in, size_t n, uint8_t **p, size_t *pn);

/* "uid 1000 (alice)" into buf. */
void auth_uid_name(unsigned uid, char *buf, size_t len);

/* Write a fresh key to path (created with mode 0600, never overwritten). */
scape_rc auth_keygen(const char *path);

#endif /* SCAPE_AUTH_H */
