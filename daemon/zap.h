/* zap.h - who may talk to a CURVE server socket: a ZAP handler (ZeroMQ RFC
 * 27) for one ZeroMQ context, and the count of handshakes it refused.
 *
 * The host backend's data socket is a CURVE server.  Its peers' public keys
 * arrive with the rendezvous table, after the socket is bound; a handshake
 * that comes earlier waits in the handler (up to hold_ms) instead of being
 * refused, so a fast peer never races a slow one.  Once the keys are known a
 * client whose key is not among them is refused (ZAP 400), and every failed
 * handshake on the socket - a refused key, a peer without CURVE, bytes that
 * are not ZMTP - is counted, with the reason of the last one.
 *
 * The handler is one thread with its own two sockets: the ZAP endpoint and
 * a monitor of the server socket.  Everything else is behind a mutex.
 */
#ifndef SCAPE_ZAP_H
#define SCAPE_ZAP_H

#include <stddef.h>
#include <stdint.h>

#include "scape_rc.h"

#define ZAP_KEY_Z85 41 /* a CURVE key in Z85 text, with its NUL */

typedef struct zap zap;

/* Serve ZAP for ctx and watch server (a socket of ctx, not yet bound, that
 * the caller will bind as a CURVE server) of one of `ranks` ranks.  Call
 * before binding it. */
scape_rc zap_start(void *ctx, void *server, int hold_ms, int ranks, zap **out);
/* Admit the n public keys (Z85 text) from now on, and answer the waiting. */
scape_rc zap_allow(zap *z, const char *const *keys, int n);
/* Handshakes refused so far; why (len bytes) gets the last reason. */
uint64_t zap_refused(zap *z, char *why, size_t len);
/* Stop the thread and close its sockets (before the server socket closes). */
void zap_stop(zap *z);

#endif /* SCAPE_ZAP_H */
