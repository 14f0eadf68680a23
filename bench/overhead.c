/* Call overhead of a compiled function: W6 (batch-1 MLP, weights captured
 * from the context) run eagerly and through kiln_call on both capture paths
 * (the guard-only path, and recording: the body re-run over meta tensors and
 * matched), side by side, plus the guard check on a hit as kiln_fn_stats
 * measures it and the recording's cost per op.
 *
 *   kiln_bench --overhead
 *
 * And, for instruction counts under callgrind (wall time on a shared machine
 * is too noisy to see a few hundred instructions a call), one path alone:
 *
 *   valgrind --tool=callgrind --collect-atstart=no kiln_bench --count record 2000
 *
 * counts `calls` calls of W6 eager, guard or record (w8-guard, w8-record, and
 * w8-torch-guard, w8-torch-record in PyTorch's order:
 * steps of W8), collected only from after the first calls, which compile,
 * when valgrind's header was there at build time. Divide by the calls.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "kiln.h"
#include "stats.h"

#if defined(__has_include)
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#endif
#endif
#ifndef CALLGRIND_TOGGLE_COLLECT
#define CALLGRIND_TOGGLE_COLLECT
#endif

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

static void w6_init(w6 *m, kiln_tensor **x) {
  int64_t ws[2] = {256, 256}, bs[1] = {256}, xs[2] = {1, 256};
  for (int i = 0; i < 3; i++) {
    m->w[i] = kiln_randn(KILN_F32, 2, ws, 62 + 2 * (uint64_t)i);
    m->b[i] = kiln_randn(KILN_F32, 1, bs, 63 + 2 * (uint64_t)i);
  }
  *x = kiln_randn(KILN_F32, 2, xs, 61);
}

static void w6_free(w6 *m, kiln_tensor *x) {
  for (int i = 0; i < 3; i++) kiln_release(m->w[i]), kiln_release(m->b[i]);
  kiln_release(x);
}

int bench_overhead_count(const char *what, long calls) {
  if (strncmp(what, "w8-", 3) == 0) return bench_gpt_count(what + 3, calls, bench_toggle_collect);
  bool eager = strcmp(what, "eager") == 0, guard = strcmp(what, "guard") == 0;
  if (!eager && !guard && strcmp(what, "record") != 0)
    return fprintf(stderr, "--count: eager, guard, record, w8-guard, w8-record, w8-torch-guard or w8-torch-record, not %s\n", what), 2;
  w6 m;
  kiln_tensor *x;
  w6_init(&m, &x);
  kiln_options o = {.name = "w6", .n_in = 1, .n_out = 1, .capture = guard ? KILN_CAPTURE_GUARDS : KILN_CAPTURE_RECORD};
  kiln_fn *f = kiln_compile(w6_body, &m, &o);
  int rc = 0;
  for (long i = 0; i < calls + 3 && !rc; i++) {
    if (i == 3) bench_toggle_collect();
    kiln_scope_begin();
    kiln_tensor *y;
    rc = eager ? (w6_forward(&m, x) ? 0 : -1) : kiln_call(f, &x, &y);
    kiln_scope_end();
  }
  if (calls > 0) bench_toggle_collect();
  if (rc) fprintf(stderr, "%s\n", kiln_last_error());
  kiln_fn_stats st;
  kiln_fn_get_stats(f, &st);
  printf("W6 %s: %ld calls counted, %lld hits, %lld traces\n", what, calls, (long long)st.hits, (long long)st.traces);
  kiln_fn_free(f);
  w6_free(&m, x);
  return rc ? 1 : 0;
}

void bench_toggle_collect(void) { CALLGRIND_TOGGLE_COLLECT; }

int bench_overhead(void) {
  /* many short rounds, eager and compiled alternating: the best round shows
   * the code's own speed on a shared machine, the median what a caller saw */
  enum { ROUNDS = 400, CALLS = 100 };
  w6 m;
  kiln_tensor *x;
  w6_init(&m, &x);
  kiln_options og = {.name = "w6", .n_in = 1, .n_out = 1, .capture = KILN_CAPTURE_GUARDS};
  kiln_options orec = og;
  orec.capture = KILN_CAPTURE_RECORD;
  kiln_fn *fg = kiln_compile(w6_body, &m, &og), *fr = kiln_compile(w6_body, &m, &orec);
  kiln_fn *fns[2] = {fg, fr};
  static double eager[ROUNDS], call[2][ROUNDS];
  for (int round = 0; round < ROUNDS; round++) {
    double t0 = 1e6 * bench_now_s();
    for (int i = 0; i < CALLS; i++) {
      kiln_scope_begin();
      if (!w6_forward(&m, x)) return fprintf(stderr, "%s\n", kiln_last_error()), 1;
      kiln_scope_end();
    }
    eager[round] = (1e6 * bench_now_s() - t0) / CALLS;
    for (int f = 0; f < 2; f++) {
      double t1 = 1e6 * bench_now_s();
      for (int i = 0; i < CALLS; i++) {
        kiln_scope_begin();
        kiln_tensor *y;
        if (kiln_call(fns[f], &x, &y)) return fprintf(stderr, "%s\n", kiln_last_error()), 1;
        kiln_scope_end();
      }
      call[f][round] = (1e6 * bench_now_s() - t1) / CALLS;
    }
  }
  double eager_med = bench_median(eager, ROUNDS);
  double med[2] = {bench_median(call[0], ROUNDS), bench_median(call[1], ROUNDS)};
  const char *names[2] = {"guard-only path", "recording path"};
  printf("call overhead (W6, 1x256, weights captured; %d alternating rounds of %d calls: best, median)\n", ROUNDS, CALLS);
  printf("  eager              %8.2f us/call, %.2f\n", eager[0], eager_med);
  for (int f = 0; f < 2; f++)
    printf("  %-18s %8.2f us/call, %.2f; %.2fx eager best, %.2fx median\n", names[f], call[f][0], med[f],
           eager[0] / call[f][0], eager_med / med[f]);
  kiln_fn_stats st;
  kiln_fn_get_stats(fg, &st);
  printf("  guard check        %8.0f ns/call (sampled mean; %lld hits)\n", st.guard_ns, (long long)st.hits);
  printf("  trace              %8.2f ms, passes and compile %.2f ms\n", st.trace_ms, st.compile_ms);
  kiln_fn_stats sr;
  kiln_fn_get_stats(fr, &sr);
  /* the body makes 11 ops (3 transposes, 3 matmuls, 3 adds, 2 relus) */
  double rec_us = 1e3 * sr.trace_ms / (double)(sr.calls ? sr.calls : 1), per_call = med[1] - med[0];
  printf("  recording          %8.2f us/call running the body over meta tensors, %.3f us per op (11 ops)\n", rec_us,
         rec_us / 11);
  printf("  recording path     %8.2f us/call over the guard-only path in all (the recording, matching it, %lld hits)\n",
         per_call, (long long)sr.hits);
  kiln_fn_free(fr);
  kiln_fn_free(fg);
  w6_free(&m, x);
  return bench_gpt_paths() || bench_decode_paths() ? 1 : 0;
}
