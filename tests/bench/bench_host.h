/* bench_host.h - what the benchmarks say about the machine they ran on, and
 * the median they report. */
#ifndef SCAPE_BENCH_HOST_H
#define SCAPE_BENCH_HOST_H

#include <stddef.h>

/* The CPU's model name from /proc/cpuinfo ("unknown CPU" if none). */
void bench_cpu_model(char *buf, size_t len);
/* The median of v[0..n) (n >= 1); sorts v. */
double bench_median(double *v, int n);

#endif /* SCAPE_BENCH_HOST_H */
