/* stats.h - the clock and the median every part of kiln_bench times with. */
#ifndef KILN_BENCH_STATS_H
#define KILN_BENCH_STATS_H

#include <stdlib.h>
#include <time.h>

/* Set by --cpu-time (with --threads 1): time the process's CPU, which other
 * work on a shared machine does not add to. Defined in workloads.c. */
extern int bench_cpu_clock;

/* Seconds on the monotonic clock, or of the process's CPU time. */
static inline double bench_now_s(void) {
  struct timespec ts;
  clock_gettime(bench_cpu_clock ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline int bench_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Sorts v[0, n) in place (v[0] is then the least) and returns its median. */
static inline double bench_median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Compile times vary by 2x on a shared machine, so each workload is
 * compiled COLD_COMPILES times from nothing (kiln_cache_clear before each),
 * the first compile among them, and the median is reported with the range.
 * again(ctx) compiles once more and returns its ms, or < 0 on failure. */
enum { COLD_COMPILES = 5 };
typedef struct bench_compiles {
  double first, median, lo, hi;
} bench_compiles;

static inline int bench_cold_compiles(double first, double (*again)(void *ctx), void *ctx, bench_compiles *out) {
  double v[COLD_COMPILES] = {first};
  for (int i = 1; i < COLD_COMPILES; i++)
    if ((v[i] = again(ctx)) < 0) return -1;
  out->first = first;
  out->median = bench_median(v, COLD_COMPILES);
  out->lo = v[0], out->hi = v[COLD_COMPILES - 1];
  return 0;
}

#endif
