/* The hot eager loops on one thread: what KILN_NATIVE (-march=native) and
 * the run-time dispatch of src/eager (KILN_HOT) are about. Same API as
 * lifetime.c, so that tests/perf/compare.sh can run one source against two
 * builds:
 *
 *   eager_loops [rounds]   one line per case: ms per call, the best of `rounds`
 *
 * Cases on 4M f32 elements (16 MiB, as the bench's W1): add, mul by a
 * broadcast scalar, exp, tanh, gelu; and on (4096,1024): a sum and a max
 * over rows, a sum over columns. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c17 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kiln.h"

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

enum { ADD, MUL_SCALAR, EXP, TANH, GELU, ROW_SUM, ROW_MAX, COL_SUM, N_CASES };
static const char *names[N_CASES] = {"add (4M)",      "mul by scalar (4M)",  "exp (4M)",
                                     "tanh (4M)",     "gelu (4M)",           "sum over rows (4096,1024)",
                                     "max over rows", "sum over cols (4096,1024)"};

static kiln_tensor *run(int which, kiln_tensor *x, kiln_tensor *y, kiln_tensor *s, kiln_tensor *m) {
  switch (which) {
  case ADD: return kiln_add(x, y);
  case MUL_SCALAR: return kiln_mul(x, s);
  case EXP: return kiln_exp(x);
  case TANH: return kiln_tanh(x);
  case GELU: return kiln_gelu(x);
  case ROW_SUM: return kiln_sum(m, 1, false);
  case ROW_MAX: return kiln_max(m, 1, false);
  default: return kiln_sum(m, 0, false);
  }
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 5;
  kiln_set_num_threads(1);
  int64_t n[1] = {1 << 22}, rc[2] = {4096, 1024};
  kiln_tensor *x = kiln_randn(KILN_F32, 1, n, 1), *y = kiln_randn(KILN_F32, 1, n, 2);
  kiln_tensor *s = kiln_scalar(KILN_F32, 0.5), *m = kiln_randn(KILN_F32, 2, rc, 3);
  for (int k = 0; k < N_CASES; k++) {
    double best = 1e300;
    for (int r = 0; r < rounds + 1; r++) { /* the first is a warm-up */
      double t0 = now_ms();
      kiln_tensor *out = run(k, x, y, s, m);
      double ms = now_ms() - t0;
      if (!out) {
        fprintf(stderr, "%s\n", kiln_last_error());
        return 1;
      }
      kiln_release(out);
      if (r && ms < best) best = ms;
    }
    printf("%-26s %8.3f ms\n", names[k], best);
  }
  kiln_release(x);
  kiln_release(y);
  kiln_release(s);
  kiln_release(m);
  return 0;
}
