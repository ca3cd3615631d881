/* bench_host.h - what the benchmarks say about the machine they ran on. */
#ifndef SCAPE_BENCH_HOST_H
#define SCAPE_BENCH_HOST_H

#include <stddef.h>

/* The CPU's model name from /proc/cpuinfo ("unknown CPU" if none). */
void bench_cpu_model(char *buf, size_t len);

#endif /* SCAPE_BENCH_HOST_H */
