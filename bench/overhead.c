/* Call overhead of a compiled function: W6 (batch-1 MLP, weights captured
 * from the context) run eagerly and through kiln_call, side by side, plus the
 * guard check on a hit as kiln_fn_stats measures it.
 *
 *   kiln_bench --overhead
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "kiln.h"
#include "stats.h"

typedef struct w6 {
  kiln_tensor *w[3], *b[3];
} w6;

static kiln_tensor *w6_forward(w6 *m, kiln_tensor *x) {
  kiln_tensor *h = x;
  for (int i = 0; i < 3; i++) {
    h = kiln_add(kiln_matmul(h, kiln_transpose(m->w[i], 0, 1)), m->b[i]);
    if (i < 2) h = kiln_relu(h);
  }
  return h;
}

static int w6_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = w6_forward(ctx, in[0]);
  return out[0] ? 0 : -1;
}

int bench_overhead(void) {
  /* many short rounds, eager and compiled alternating: the best round shows
   * the code's own speed on a shared machine, the median what a caller saw */
  enum { ROUNDS = 400, CALLS = 100 };
  w6 m;
  int64_t ws[2] = {256, 256}, bs[1] = {256}, xs[2] = {1, 256};
  for (int i = 0; i < 3; i++) {
    m.w[i] = kiln_randn(KILN_F32, 2, ws, 62 + 2 * (uint64_t)i);
    m.b[i] = kiln_randn(KILN_F32, 1, bs, 63 + 2 * (uint64_t)i);
  }
  kiln_tensor *x = kiln_randn(KILN_F32, 2, xs, 61);
  kiln_options o = {.name = "w6", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(w6_body, &m, &o);
  static double eager[ROUNDS], call[ROUNDS];
  for (int round = 0; round < ROUNDS; round++) {
    double t0 = 1e6 * bench_now_s();
    for (int i = 0; i < CALLS; i++) {
      kiln_scope_begin();
      if (!w6_forward(&m, x)) return fprintf(stderr, "%s\n", kiln_last_error()), 1;
      kiln_scope_end();
    }
    double t1 = 1e6 * bench_now_s();
    for (int i = 0; i < CALLS; i++) {
      kiln_scope_begin();
      kiln_tensor *y;
      if (kiln_call(fn, &x, &y)) return fprintf(stderr, "%s\n", kiln_last_error()), 1;
      kiln_scope_end();
    }
    double t2 = 1e6 * bench_now_s();
    eager[round] = (t1 - t0) / CALLS;
    call[round] = (t2 - t1) / CALLS;
  }
  double eager_med = bench_median(eager, ROUNDS), call_med = bench_median(call, ROUNDS);
  printf("call overhead (W6, 1x256, weights captured; %d alternating rounds of %d calls: best, median)\n", ROUNDS, CALLS);
  printf("  eager            %8.2f us/call, %.2f\n", eager[0], eager_med);
  printf("  kiln_call        %8.2f us/call, %.2f (default backend)\n", call[0], call_med);
  printf("  speedup          %8.2fx best, %.2fx median\n", eager[0] / call[0], eager_med / call_med);
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  printf("  guard check      %8.0f ns/call (sampled mean; %lld hits)\n", st.guard_ns, (long long)st.hits);
  printf("  trace            %8.2f ms, passes and compile %.2f ms\n", st.trace_ms, st.compile_ms);
  kiln_fn_free(fn);
  for (int i = 0; i < 3; i++) kiln_release(m.w[i]), kiln_release(m.b[i]);
  kiln_release(x);
  return 0;
}
