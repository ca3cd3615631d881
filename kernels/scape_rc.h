/* scape_rc.h - result codes and the per-thread last-error message shared by
 * every scaped library: kernels, engine, daemon and the client (libscape).
 * Installed as <scape/scape_rc.h>. */
#ifndef SCAPE_RC_H
#define SCAPE_RC_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum scape_rc {
    SCAPE_OK = 0,
    SCAPE_INVALID,     /* bad argument or input; nothing was changed */
    SCAPE_NOMEM,       /* allocation failed */
    SCAPE_SYSTEM,      /* a libc/system call failed (errno in the message) */
    SCAPE_CUDA,        /* a CUDA runtime call failed */
    SCAPE_NCCL,        /* an NCCL call failed */
    SCAPE_ZMQ,         /* a ZeroMQ call failed */
    SCAPE_PROTO,       /* a malformed or unexpected message */
    SCAPE_REMOTE,      /* a peer reported an error */
    SCAPE_TIMEOUT,     /* a peer did not answer in time */
    SCAPE_UNSUPPORTED, /* not available in this build or on this machine */
    SCAPE_RC_COUNT
} scape_rc;

/* Short stable name of a result code ("OK", "INVALID", ...). */
const char *scape_rc_name(scape_rc rc);
/* The calling thread's last error message ("" if none). */
const char *scape_last_error(void);
/* Format a message into the last-error buffer and return rc.  The message is
 * passed through scape_text_clean, so a peer's string quoted in it can make it
 * neither invalid UTF-8 nor a terminal escape sequence. */
scape_rc scape_set_error(scape_rc rc, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Clear the calling thread's last error. */
void scape_clear_error(void);
/* Copy src (len bytes, or up to its NUL when len is (size_t)-1) into dst
 * (cap >= 1 bytes, always NUL-terminated) as printable UTF-8: well-formed
 * UTF-8 characters, newline and tab pass; every other byte (control
 * characters, a malformed or overlong sequence, a surrogate, a cut-off
 * character) is written as the four characters \xNN.  Stops early rather than
 * split a character.  Returns the length written. */
size_t scape_text_clean(char *dst, size_t cap, const char *src, size_t len);
/* Non-zero when s (NUL-terminated) would come out of scape_text_clean
 * unchanged and holds no newline or tab. */
int scape_text_is_clean(const char *s);

#ifdef __cplusplus
}
#endif

#endif /* SCAPE_RC_H */
