/* compile_mlp: one MLP forward compiled with kiln_compile, called at several
 * batch sizes, checked against the same forward run eagerly, then saved to
 * a file and loaded back as a function that no longer needs the C body.
 *
 * Batch 32 traces a static graph. Batch 7 differs in dim 0, so it retraces
 * with that dim symbolic (s0); every later batch size hits that variant.
 * To watch it happen:
 *
 *   KILN_DUMP=graph,guards,recompiles build/examples/compile_mlp
 */
#define _POSIX_C_SOURCE 200809L /* mkstemp */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kiln.h"

enum { D = 64, H = 256, C = 10 };

/* The weights live in the context: the traced graph reads them by reference. */
typedef struct mlp {
  kiln_tensor *w1, *b1, *w2, *b2;
} mlp;

/* logits (n,C) = gelu(x @ w1 + b1) @ w2 + b2, for x (n,D) */
static kiln_tensor *forward(const mlp *m, kiln_tensor *x) {
  kiln_tensor *h = kiln_gelu(kiln_add(kiln_matmul(x, m->w1), m->b1));
  return kiln_add(kiln_matmul(h, m->w2), m->b2);
}

/* The body kiln_compile wraps: one input, one output. */
static int body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = forward(ctx, in[0]);
  return out[0] ? 0 : -1;
}

/* max |a - b|, or -1 on error */
static double max_diff(kiln_tensor *a, kiln_tensor *b) {
  kiln_scope_begin();
  kiln_tensor *d = kiln_max_axes(kiln_abs(kiln_sub(a, b)), NULL, 0, false);
  double v = d ? kiln_item(d) : -1;
  kiln_scope_end();
  return v;
}

/* The first line of a graph's text: its name, inputs and params. */
static void print_signature(const kiln_fn *fn, int variant) {
  char *text = kiln_fn_graph(fn, variant);
  if (!text) return;
  printf("    %.*s\n", (int)strcspn(text, "\n"), text);
  free(text);
}

int main(void) {
  mlp m = {0};
  kiln_fn *fn = NULL, *loaded = NULL;
  char path[] = "/tmp/kiln_compile_mlpXXXXXX";
  int saved = 0, status = 1;
  kiln_clear_error(); /* so that a failure with no message is a mismatch */

  kiln_scope_begin();
  m.w1 = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 2, ((int64_t[]){D, H}), 1), kiln_scalar(KILN_F32, 0.125)));
  m.b1 = kiln_keep(kiln_zeros(KILN_F32, 1, ((int64_t[]){H})));
  m.w2 = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 2, ((int64_t[]){H, C}), 2), kiln_scalar(KILN_F32, 0.0625)));
  m.b2 = kiln_keep(kiln_zeros(KILN_F32, 1, ((int64_t[]){C})));
  kiln_scope_end();
  if (!m.w1 || !m.b1 || !m.w2 || !m.b2) goto fail;

  kiln_options opts = {.name = "mlp", .n_in = 1, .n_out = 1}; /* dynamic: automatic */
  fn = kiln_compile(body, &m, &opts);
  if (!fn) goto fail;

  printf("compile_mlp: %d -> %d (gelu) -> %d, compiled, weights captured from the context\n", D, H, C);
  const int64_t batches[] = {32, 7, 33, 1000, 1};
  for (size_t i = 0; i < sizeof batches / sizeof *batches; i++) {
    kiln_fn_stats before, after;
    if (kiln_fn_get_stats(fn, &before) != 0) goto fail;
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){batches[i], D}), 10 + i), *y = NULL;
    int rc = x ? kiln_call(fn, &x, &y) : -1;
    kiln_tensor *ref = rc == 0 ? forward(&m, x) : NULL; /* the same forward, eagerly */
    double err = ref ? max_diff(y, ref) : -1;
    if (err >= 0)
      printf("batch %4lld: out [%lld,%lld]  max |compiled - eager| %.2g", (long long)batches[i],
             (long long)kiln_size(y, 0), (long long)kiln_size(y, 1), err);
    kiln_scope_end();
    if (err < 0 || err > 1e-4 || kiln_fn_get_stats(fn, &after) != 0) goto fail;
    if (after.traces > before.traces) {
      printf("  traced a new graph:\n");
      print_signature(fn, (int)after.variants - 1);
    } else {
      printf("  hit\n");
    }
  }

  kiln_fn_stats st;
  if (kiln_fn_get_stats(fn, &st) != 0) goto fail;
  printf("stats: %lld calls, %lld hits, %lld traces, %lld variants, %lld fallbacks, guards %.0f ns per hit\n",
         (long long)st.calls, (long long)st.hits, (long long)st.traces, (long long)st.variants,
         (long long)st.fallbacks, st.guard_ns);
  char *text = kiln_fn_graph(fn, (int)st.variants - 1);
  if (!text) goto fail;
  printf("the graph that served batches 7 to 1:\n%s", text);
  free(text);

  /* save the newest graph, load it back: its inputs are x, then the params in order */
  int fd = mkstemp(path);
  if (fd < 0) {
    perror("compile_mlp: mkstemp");
    goto done;
  }
  close(fd);
  saved = 1;
  if (kiln_save(fn, path) != 0 || !(loaded = kiln_load(path))) goto fail;
  kiln_scope_begin();
  kiln_tensor *in[5] = {kiln_randn(KILN_F32, 2, ((int64_t[]){5, D}), 99), m.w1, m.b1, m.w2, m.b2}, *y = NULL;
  double err = in[0] && kiln_call(loaded, in, &y) == 0 ? max_diff(y, forward(&m, in[0])) : -1;
  kiln_scope_end();
  if (err < 0 || err > 1e-4) goto fail;
  printf("saved to %s and loaded back: batch 5, max |loaded - eager| %.2g\n", path, err);
  status = 0;
  goto done;
fail:
  fprintf(stderr, "compile_mlp: %s\n", *kiln_last_error() ? kiln_last_error() : "result differs from eager");
done:
  if (saved) remove(path);
  kiln_fn_free(loaded);
  kiln_fn_free(fn);
  kiln_release(m.w1);
  kiln_release(m.b1);
  kiln_release(m.w2);
  kiln_release(m.b2);
  return status;
}
