/* bench_host.c - what the benchmarks say about the machine they ran on. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <string.h>

#include "bench_host.h"

void bench_cpu_model(char *buf, size_t len)
{
    char line[256];
    snprintf(buf, len, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f == NULL)
        return;
    while (fgets(line, sizeof line, f) != NULL) {
        char *p = strchr(line, ':');
        if (strncmp(line, "model name", 10) != 0 || p == NULL)
            continue;
        p += strspn(p + 1, " \t") + 1;
        p[strcspn(p, "\n")] = '\0';
        snprintf(buf, len, "%s", p);
        break;
    }
    fclose(f);
}
