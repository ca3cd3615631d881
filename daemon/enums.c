/* enums.c - one lookup for every enum's names (enums.h). */
#include <stdio.h>
#include <string.h>

#include "enums.h"

scape_rc eng_enum_parse(const eng_enum *names, const char *what, const char *s, int *out)
{
    for (const eng_enum *e = names; s && out && e->name; e++)
        if (strcmp(s, e->name) == 0) {
            *out = e->value;
            return SCAPE_OK;
        }
    char list[160] = "";
    size_t used = 0;
    for (const eng_enum *e = names; e->name && used < sizeof list; e++)
        used += (size_t)snprintf(list + used, sizeof list - used, "%s%s",
                                 e == names ? "" : ", ", e->name);
    return scape_set_error(SCAPE_INVALID, "unknown %s '%s' (%s)", what, s ? s : "(null)", list);
}

const char *eng_enum_name(const eng_enum *names, int value)
{
    for (const eng_enum *e = names; e->name; e++)
        if (e->value == value)
            return e->name;
    return "?";
}
