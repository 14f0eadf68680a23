/* debug_walkthrough: the program docs/debugging.md runs. Each step is small
 * and shows one way to see what kiln did with your code; the dumps come from
 * the environment (KILN_DUMP, KILN_CHECK, KILN_BACKEND), not from this file.
 *
 *   shape    eager errors, and the line of your code they name
 *   compile  a softmax classifier head compiled and called at batch 4, 6, 9
 *   badcall  the compiled head given a wrong width, then f64 input
 *   grad     a body that calls kiln_backward: the backward is in the graph
 *   item     a body that reads a value (kiln_item): a graph break; and the same without it
 *   check    a body that branches on C state kiln cannot see, as KILN_CHECK=1 finds
 *
 * Built from the repository root, __FILE__ (and so every file:line kiln
 * prints) is the relative path examples/debug_walkthrough.c:
 *
 *   cc -std=c17 examples/debug_walkthrough.c -Iinclude -Lbuild -lkiln \
 *      -Wl,-rpath,"$PWD/build" -o walk
 *   KILN_DUMP=graph ./walk compile
 *
 * (The copy CMake builds, build/examples/debug_walkthrough, prints absolute
 * paths, because CMake hands the compiler absolute file names.)
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kiln.h"

enum { D = 16, C = 8 }; /* features in, classes out */

/* The weights live in the context: a trace captures them by reference. */
typedef struct head {
  kiln_tensor *w, *b; /* (D,C), (C,) */
} head;

/* probs (B,C) = softmax(x @ w + b), for x (B,D) */
static int head_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const head *m = ctx;
  kiln_tensor *logits = kiln_add(kiln_matmul(in[0], m->w), m->b);
  out[0] = kiln_softmax(logits, -1);
  return out[0] ? 0 : -1;
}

static void print_stats(const kiln_fn *fn) {
  kiln_fn_stats st;
  if (kiln_fn_get_stats(fn, &st) != 0) return;
  printf("stats: %lld calls, %lld hits, %lld traces, %lld fallbacks, %lld variants, %lld check fails\n",
         (long long)st.calls, (long long)st.hits, (long long)st.traces, (long long)st.fallbacks,
         (long long)st.variants, (long long)st.check_fails);
}

/* Calls fn on x and says how the call ran (from the change in the stats). */
static kiln_tensor *call_and_say(kiln_fn *fn, kiln_tensor *x, const char *what) {
  kiln_fn_stats a, b;
  kiln_tensor *y = NULL;
  kiln_fn_get_stats(fn, &a);
  int rc = kiln_call(fn, &x, &y);
  kiln_fn_get_stats(fn, &b);
  if (rc != 0) {
    printf("%s: error: %s\n", what, kiln_last_error());
    return NULL;
  }
  printf("%s: %s\n", what,
         b.guard_hits > a.guard_hits ? "hit (guard-only path)"
         : b.hits > a.hits           ? "hit (recorded)"
         : b.traces > a.traces       ? "traced"
                                     : "ran eagerly");
  return y;
}

/* ---- shape: eager errors ---------------------------------------------- */

static int step_shape(const head *m) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){4, D + 1}), 1); /* one column too many */
  /* one check at the end of the chain: the first op that failed keeps its message */
  kiln_tensor *p = kiln_softmax(kiln_add(kiln_matmul(x, m->w), m->b), -1);
  if (!p) printf("%s\n", kiln_last_error());
  kiln_tensor *q = kiln_add(kiln_zeros(KILN_F32, 2, ((int64_t[]){4, C})), kiln_zeros(KILN_F32, 1, ((int64_t[]){C - 1})));
  if (!q) printf("%s\n", kiln_last_error());
  kiln_scope_end();
  return 0;
}

/* ---- compile: trace, symbolic batch, hits ------------------------------ */

static int step_compile(head *m) {
  kiln_options opts = {.name = "head", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(head_body, m, &opts);
  if (!fn) return -1;
  const int64_t batches[] = {4, 6, 9};
  int bad = 0;
  for (int i = 0; i < 3; i++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){batches[i], D}), 10 + (uint64_t)i);
    char what[32];
    snprintf(what, sizeof what, "batch %lld", (long long)batches[i]);
    bad |= call_and_say(fn, x, what) == NULL;
    kiln_scope_end();
  }
  print_stats(fn);
  kiln_fn_free(fn);
  return bad ? -1 : 0;
}

/* ---- badcall: what a compiled call does with input it was not traced for */

static int step_badcall(head *m) {
  kiln_options opts = {.name = "head", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(head_body, m, &opts);
  if (!fn) return -1;
  kiln_scope_begin();
  call_and_say(fn, kiln_randn(KILN_F32, 2, ((int64_t[]){4, D}), 1), "f32 (4,16)");
  /* no variant fits, so the body runs again and its own line reports the error */
  call_and_say(fn, kiln_randn(KILN_F32, 2, ((int64_t[]){4, D + 1}), 2), "f32 (4,17)");
  /* a new dtype is a new graph; f64 x promotes the f32 weights */
  call_and_say(fn, kiln_randn(KILN_F64, 2, ((int64_t[]){4, D}), 3), "f64 (4,16)");
  kiln_scope_end();
  print_stats(fn);
  kiln_fn_free(fn);
  return 0;
}

/* ---- grad: a body that calls kiln_backward ----------------------------- */

/* loss = mean((x @ w)^2). The backward ops pass through dispatch like any
 * other op, so the graph computes the loss and w's .grad together. */
static int loss_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const head *m = ctx;
  kiln_tensor *y = kiln_matmul(in[0], m->w);
  out[0] = kiln_mean_all(kiln_mul(y, y));
  return out[0] && kiln_backward(out[0]) == 0 ? 0 : -1;
}

static int step_grad(head *m) {
  kiln_options opts = {.name = "loss", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(loss_body, m, &opts);
  if (!fn) return -1;
  kiln_requires_grad(m->w, true);
  for (int i = 0; i < 3; i++) {
    kiln_scope_begin();
    char what[32];
    snprintf(what, sizeof what, "call %d", i + 1);
    call_and_say(fn, kiln_randn(KILN_F32, 2, ((int64_t[]){4, D}), 30 + (uint64_t)i), what);
    kiln_scope_end();
  }
  print_stats(fn);
  kiln_zero_grad(m->w);
  kiln_requires_grad(m->w, false);
  kiln_fn_free(fn);
  return 0;
}

/* ---- item: reading a value inside the body ----------------------------- */

/* Scales x down to norm 1 when its norm is larger: the C branch depends on a
 * value, so the read is a graph break. */
static int clip_item(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  double norm = kiln_item(kiln_sqrt(kiln_sum_all(kiln_mul(in[0], in[0]))));
  out[0] = norm > 1 ? kiln_div(in[0], kiln_scalar(KILN_F32, norm)) : in[0];
  return out[0] ? 0 : -1;
}

/* The same without leaving the graph: x / max(norm, 1). */
static int clip_graph(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *norm = kiln_sqrt(kiln_sum_all(kiln_mul(in[0], in[0])));
  out[0] = kiln_div(in[0], kiln_maximum(norm, kiln_scalar(KILN_F32, 1)));
  return out[0] ? 0 : -1;
}

static int step_item(void) {
  kiln_body bodies[2] = {clip_item, clip_graph};
  const char *names[2] = {"clip_item", "clip_graph"};
  for (int f = 0; f < 2; f++) {
    kiln_options opts = {.name = names[f], .n_in = 1, .n_out = 1};
    kiln_fn *fn = kiln_compile(bodies[f], NULL, &opts);
    if (!fn) return -1;
    for (int i = 0; i < 3; i++) {
      kiln_scope_begin();
      char what[32];
      snprintf(what, sizeof what, "%s call %d", names[f], i + 1);
      call_and_say(fn, kiln_randn(KILN_F32, 1, ((int64_t[]){32}), (uint64_t)i), what);
      kiln_scope_end();
    }
    print_stats(fn);
    kiln_fn_free(fn);
  }
  return 0;
}

/* ---- check: C state the recording never sees --------------------------- */

/* Column means of x (B,D), or their absolute values. The bug: the choice is
 * a C flag the body reads directly, not a size, a number made a tensor or a
 * value, so nothing kiln records depends on it. The first recording shows a
 * body that reads nothing kiln could watch, so later calls take the
 * guard-only path and do not run the body: the flag's change is not seen.
 * Passing the choice in as a tensor, or KILN_CAPTURE=record, is the fix. */
static bool use_abs;

static int colmean_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = use_abs ? kiln_abs(in[0]) : in[0];
  out[0] = kiln_mean(x, 0, false);
  return out[0] ? 0 : -1;
}

static int step_check(void) {
  kiln_options opts = {.name = "colmean", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(colmean_body, NULL, &opts);
  if (!fn) return -1;
  for (int i = 0; i < 3; i++) {
    use_abs = i == 2;
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){6, D}), 20 + (uint64_t)i);
    char what[48];
    snprintf(what, sizeof what, "call %d, use_abs %d", i + 1, use_abs);
    kiln_tensor *y = call_and_say(fn, x, what);
    kiln_tensor *want = kiln_mean(use_abs ? kiln_abs(x) : x, 0, false);
    kiln_tensor *err = kiln_max_axes(kiln_abs(kiln_sub(y, want)), NULL, 0, false);
    if (err) printf("  max |result - eager| = %.3g\n", kiln_item(err));
    kiln_scope_end();
  }
  print_stats(fn);
  kiln_fn_free(fn);
  return 0;
}

int main(int argc, char **argv) {
  const char *step = argc > 1 ? argv[1] : "";
  head m = {0};
  kiln_scope_begin();
  m.w = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 2, ((int64_t[]){D, C}), 7), kiln_scalar(KILN_F32, 0.25)));
  m.b = kiln_keep(kiln_zeros(KILN_F32, 1, ((int64_t[]){C})));
  kiln_scope_end();
  int rc = -1;
  if (!m.w || !m.b) fprintf(stderr, "debug_walkthrough: %s\n", kiln_last_error());
  else if (!strcmp(step, "shape")) rc = step_shape(&m);
  else if (!strcmp(step, "compile")) rc = step_compile(&m);
  else if (!strcmp(step, "badcall")) rc = step_badcall(&m);
  else if (!strcmp(step, "grad")) rc = step_grad(&m);
  else if (!strcmp(step, "item")) rc = step_item();
  else if (!strcmp(step, "check")) rc = step_check();
  else fprintf(stderr, "usage: debug_walkthrough shape|compile|badcall|grad|item|check\n");
  kiln_release(m.w);
  kiln_release(m.b);
  return rc ? 1 : 0;
}
