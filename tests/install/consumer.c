/* consumer.c - a trainer outside the tree: builds against an installed
 * libscape and checks that the library answers (no daemon needed). */
#include <stdio.h>
#include <string.h>

#include <scape/scape.h>

int main(void)
{
    scape_tensor t = { "w", 0, 8 };
    scape_options o;
    scape_options_default(&o);
    o.timeout_ms = 200;
    scape_session *s = NULL;
    scape_rc rc = scape_attach("ipc:///nonexistent-scape-dir/control", &t, 1, &o, &s);
    printf("libscape %s: attach -> %s (%s)\n", scape_version(), scape_rc_name(rc),
           scape_last_error());
    /* no daemon there: refused at once, saying where it looked */
    return rc == SCAPE_REMOTE && strstr(scape_last_error(), "nonexistent") &&
                   strstr(scape_last_error(), "is scaped running?")
               ? 0
               : 1;
}
