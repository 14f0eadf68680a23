/* The cost of tensor lifetime: what kiln does for every tensor it makes and
 * releases. Written against the API every version of kiln.h has, so that one
 * source measures two builds of the library (tests/perf/compare.sh):
 *
 *   lifetime [rounds]      prints one line per case: ns per iteration, the
 *                          best of `rounds` runs of the case
 *
 * Cases: a (16) zeros made and released (header, storage, fill); a view made
 * and released (a header alone); retain + release of one tensor; a small op
 * chain in a scope, relu(x * w + b) on (4,4), the eager path of a small model. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c17 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kiln.h"

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

typedef struct bench_ctx {
  kiln_tensor *x, *w, *b, *m;
} bench_ctx;

static void make_release(bench_ctx *c, long n) {
  (void)c;
  int64_t shape[1] = {16};
  for (long i = 0; i < n; i++) kiln_release(kiln_zeros(KILN_F32, 1, shape));
}

static void view_release(bench_ctx *c, long n) {
  for (long i = 0; i < n; i++) kiln_release(kiln_transpose(c->m, 0, 1));
}

static void retain_release(bench_ctx *c, long n) {
  for (long i = 0; i < n; i++) {
    kiln_retain(c->m);
    kiln_release(c->m);
  }
}

static void op_chain(bench_ctx *c, long n) {
  for (long i = 0; i < n; i++) {
    kiln_scope_begin();
    kiln_tensor *y = kiln_relu(kiln_add(kiln_mul(c->x, c->w), c->b));
    if (!y) abort();
    kiln_scope_end();
  }
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 5;
  kiln_set_num_threads(1);
  int64_t s44[2] = {4, 4}, s4[1] = {4};
  bench_ctx c = {kiln_randn(KILN_F32, 2, s44, 1), kiln_randn(KILN_F32, 2, s44, 2), kiln_randn(KILN_F32, 1, s4, 3),
                 kiln_zeros(KILN_F32, 2, s44)};
  struct {
    const char *name;
    void (*fn)(bench_ctx *, long);
    long n;
  } cases[] = {{"make+release (16)", make_release, 200000},
               {"view+release", view_release, 200000},
               {"retain+release", retain_release, 1000000},
               {"scope: relu(x*w+b) (4,4)", op_chain, 100000}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    cases[k].fn(&c, cases[k].n / 10); /* warm up */
    double best = 1e300;
    for (int r = 0; r < rounds; r++) {
      double t0 = now_ns();
      cases[k].fn(&c, cases[k].n);
      double ns = (now_ns() - t0) / (double)cases[k].n;
      if (ns < best) best = ns;
    }
    printf("%-26s %8.1f ns\n", cases[k].name, best);
  }
  kiln_release(c.x);
  kiln_release(c.w);
  kiln_release(c.b);
  kiln_release(c.m);
  return 0;
}
