/* bench_host.c - what the benchmarks say about the machine they ran on, and
 * the median they report. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
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

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double bench_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
