/* train_compiled: one MLP training step, run eagerly and through kiln_compile.
 *
 * The task is mlp_train's, larger: standard normal inputs labelled by the
 * argmax of a fixed random "teacher" MLP. Two students start from the same
 * weights. Each step, student A runs the step as a plain C function
 * (forward, cross entropy, backward, SGD), and student B runs the same
 * function wrapped by kiln_compile: the first call traces it, later calls run
 * the fused graph. The two losses must agree to float32 tolerance and fall.
 *
 * Then: time and peak memory per step, the start of the compiled graph, one
 * step at a new batch size, and the kernels of the forward pass. The program
 * exits nonzero when anything is off, so it doubles as a smoke test.
 *
 *   build/examples/train_compiled
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kiln.h"

/* 15 full batches of 256 per epoch and a tail of 160 rows */
enum { N = 4000, D = 256, H = 1024, C = 10, B = 256, STEPS = 200, PRINT_EVERY = 20 };
enum { MEASURE_STEP = 10 };   /* the step whose peak memory is measured */
enum { IR_LINES = 12 };       /* lines of the graph shown */
static const double LR = 0.5;
static const double RTOL = 1e-3; /* |eager - compiled| / |eager| allowed for a loss */

/* A student: its weights, and the learning rate, reached by the step through ctx. */
typedef struct mlp {
  kiln_tensor *w1, *b1, *w2, *b2;
  double lr;
} mlp;

/* Weights owned by the caller: made in a scope of their own and kept. */
static int mlp_init(mlp *m, uint64_t seed, double w2_scale) {
  int64_t s_w1[2] = {D, H}, s_b1[1] = {H}, s_w2[2] = {H, C}, s_b2[1] = {C};
  kiln_scope_begin();
  /* 1/sqrt(fan_in) keeps the hidden pre-activations near unit variance */
  m->w1 = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 2, s_w1, seed), kiln_scalar(KILN_F32, 1 / sqrt(D))));
  m->b1 = kiln_keep(kiln_zeros(KILN_F32, 1, s_b1));
  m->w2 = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 2, s_w2, seed + 1), kiln_scalar(KILN_F32, w2_scale)));
  m->b2 = kiln_keep(kiln_zeros(KILN_F32, 1, s_b2));
  kiln_scope_end();
  m->lr = LR;
  return m->w1 && m->b1 && m->w2 && m->b2 ? 0 : -1;
}

static void mlp_free(mlp *m) {
  kiln_release(m->w1);
  kiln_release(m->b1);
  kiln_release(m->w2);
  kiln_release(m->b2);
}

/* logits (n,C) = gelu(x @ w1 + b1) @ w2 + b2, for x (n,D) */
static kiln_tensor *forward(const mlp *m, kiln_tensor *x) {
  kiln_tensor *h = kiln_gelu(kiln_add(kiln_matmul(x, m->w1), m->b1));
  return kiln_add(kiln_matmul(h, m->w2), m->b2);
}

/* One SGD step on x (n,D) with labels y (n,) i64; returns the loss before the
 * update, or NULL. The update runs under no-grad, so it is not recorded for
 * autograd, and the tracer records it as writes to the weights. */
static kiln_tensor *sgd_step(mlp *m, kiln_tensor *x, kiln_tensor *y) {
  kiln_tensor *loss = kiln_cross_entropy(forward(m, x), y);
  if (!loss || kiln_backward(loss) != 0) return NULL;
  kiln_tensor *ps[4] = {m->w1, m->b1, m->w2, m->b2};
  kiln_tensor *lr = kiln_scalar(KILN_F32, m->lr);
  int bad = 0;
  kiln_no_grad_begin();
  for (int i = 0; i < 4; i++) {
    if (!kiln_sub_(ps[i], kiln_mul(kiln_grad(ps[i]), lr))) bad = 1;
    kiln_zero_grad(ps[i]);
  }
  kiln_no_grad_end();
  return bad ? NULL : loss;
}

/* The body both students run: in[0] x, in[1] labels; out[0] the loss. */
static int step_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = sgd_step(ctx, in[0], in[1]);
  return out[0] ? 0 : -1;
}

/* The forward pass alone, compiled once more to show its kernels. */
static int forward_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = forward(ctx, in[0]);
  return out[0] ? 0 : -1;
}

/* Loss over the whole data set, without recording a graph; -1 on error. */
static double evaluate(const mlp *m, kiln_tensor *x, kiln_tensor *y) {
  kiln_scope_begin();
  kiln_no_grad_begin();
  kiln_tensor *l = kiln_cross_entropy(forward(m, x), y);
  double v = l ? kiln_item(l) : -1;
  kiln_no_grad_end();
  kiln_scope_end();
  return v;
}

static double now_ms(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static double rel_diff(double a, double b) {
  return fabs(a - b) / fmax(fabs(a), 1e-12);
}

/* Prints one verdict line; clears *ok when it failed. */
static void check(bool pass, bool *ok, const char *what) {
  printf("  %-6s %s\n", pass ? "ok" : "FAILED", what);
  if (!pass) *ok = false;
}

typedef struct step_result {
  double eager_loss, compiled_loss; /* before the update */
  double eager_ms, compiled_ms;
} step_result;

/* One step of each student on rows [start, start+n): A eagerly, then B
 * through fn. *eager_peak and *compiled_peak, when given, get the peak bytes
 * each step allocates above what was in use before it. 0 or -1. */
static int step_both(mlp *a, kiln_fn *fn, kiln_tensor *x, kiln_tensor *y, int64_t start, int64_t n, step_result *r,
                     size_t *eager_peak, size_t *compiled_peak) {
  int rc = -1;
  kiln_scope_begin();
  kiln_tensor *in[2] = {kiln_slice(x, 0, start, start + n, 1), kiln_slice(y, 0, start, start + n, 1)}; /* views */
  kiln_tensor *le = NULL, *lc = NULL;
  if (!in[0] || !in[1]) goto done;

  size_t base = kiln_mem_in_use();
  kiln_mem_reset_peak();
  double t0 = now_ms();
  kiln_scope_begin(); /* the step's intermediates die here, as in a training loop */
  if (step_body(a, in, &le) != 0) {
    kiln_scope_end();
    goto done;
  }
  r->eager_loss = kiln_item(le);
  kiln_scope_end();
  double t1 = now_ms();
  if (eager_peak) *eager_peak = kiln_mem_peak() - base;

  base = kiln_mem_in_use();
  kiln_mem_reset_peak();
  double t2 = now_ms();
  kiln_scope_begin();
  if (kiln_call(fn, in, &lc) != 0) {
    kiln_scope_end();
    goto done;
  }
  r->compiled_loss = kiln_item(lc);
  kiln_scope_end();
  double t3 = now_ms();
  if (compiled_peak) *compiled_peak = kiln_mem_peak() - base;

  r->eager_ms = t1 - t0;
  r->compiled_ms = t3 - t2;
  rc = isfinite(r->eager_loss) && isfinite(r->compiled_loss) ? 0 : -1;
done:
  kiln_scope_end();
  return rc;
}

/* The first `lines` lines of variant v's graph, indented. */
static int print_graph_head(const kiln_fn *fn, int v, int lines) {
  char *text = kiln_fn_graph(fn, v);
  if (!text) return -1;
  const char *p = text;
  for (int i = 0; i < lines && *p; i++) {
    int len = (int)strcspn(p, "\n");
    printf("    %.*s\n", len, p);
    p += len + (p[len] == '\n');
  }
  if (*p) printf("    ...\n");
  free(text);
  return 0;
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* the dumps go to stderr: keep the two in order */
  printf("train_compiled: %d -> %d (gelu) -> %d MLP, cross entropy, SGD lr %g, batch %d, %d steps, %d threads\n", D,
         H, C, LR, B, STEPS, kiln_get_num_threads());
  printf("data: %d standard normal rows labelled by a fixed random teacher MLP\n", N);
  printf("A: the step as a plain C function (eager)   B: the same function under kiln_compile\n\n");

  mlp teacher = {0}, a = {0}, b = {0};
  kiln_tensor *x = NULL, *y = NULL;
  kiln_fn *fn = NULL, *fwd = NULL;
  double *te = NULL, *tc = NULL;
  int status = 1;
  kiln_clear_error(); /* so that a failure with no message is a mismatch */

  /* the data set; the teacher's larger w2 makes its argmax clear-cut */
  if (mlp_init(&teacher, 100, 0.3) != 0) goto fail;
  x = kiln_randn(KILN_F32, 2, ((int64_t[]){N, D}), 1);
  kiln_scope_begin();
  y = kiln_keep(kiln_argmax(forward(&teacher, x), 1, false)); /* i64 labels (N,) */
  kiln_scope_end();
  /* two students, the same init: seed 200, w2 scaled by 1/sqrt(H) */
  if (!x || !y || mlp_init(&a, 200, 1 / sqrt(H)) != 0 || mlp_init(&b, 200, 1 / sqrt(H)) != 0) goto fail;
  kiln_tensor *params[8] = {a.w1, a.b1, a.w2, a.b2, b.w1, b.b1, b.w2, b.b2};
  for (int i = 0; i < 8; i++) kiln_requires_grad(params[i], true);

  kiln_options opts = {.name = "train_step", .n_in = 2, .n_out = 1};
  fn = kiln_compile(step_body, &b, &opts);
  if (!fn) goto fail;

  double loss0 = evaluate(&a, x, y);
  if (loss0 < 0) goto fail;
  te = malloc(sizeof(double) * STEPS);
  tc = malloc(sizeof(double) * STEPS);
  if (!te || !tc) {
    fprintf(stderr, "train_compiled: out of memory\n");
    goto done;
  }

  /* the compiled side keeps an arena between calls: count what stays */
  size_t before_first_call = kiln_mem_in_use();
  size_t eager_peak = 0, compiled_peak = 0, kept = 0;
  double worst = 0;
  const int64_t full = N / B;
  printf("step   eager loss  compiled loss  rel diff\n");
  for (int step = 0; step < STEPS; step++) {
    step_result r;
    bool measure = step == MEASURE_STEP;
    size_t in_use = kiln_mem_in_use();
    if (step_both(&a, fn, x, y, step % full * B, B, &r, measure ? &eager_peak : NULL,
                  measure ? &compiled_peak : NULL) != 0)
      goto fail;
    if (measure) kept = in_use > before_first_call ? in_use - before_first_call : 0;
    te[step] = r.eager_ms;
    tc[step] = r.compiled_ms;
    double d = rel_diff(r.eager_loss, r.compiled_loss);
    if (d > worst) worst = d;
    if (step % PRINT_EVERY == 0 || step == STEPS - 1)
      printf("%4d   %10.5f  %13.5f  %8.1e%s\n", step, r.eager_loss, r.compiled_loss, d,
             step == 0 ? "   (B's first call records the body and compiles it)" : "");
  }
  compiled_peak += kept;

  kiln_fn_stats st;
  if (kiln_fn_get_stats(fn, &st) != 0) goto fail;
  double loss_a = evaluate(&a, x, y), loss_b = evaluate(&b, x, y);
  if (loss_a < 0 || loss_b < 0) goto fail;
  printf("all %d rows: loss %.4f -> A %.4f, B %.4f\n\n", N, loss0, loss_a, loss_b);

  double me = median(te + 1, STEPS - 1), mc = median(tc + 1, STEPS - 1); /* step 0 traced */
  printf("                      eager   compiled\n");
  printf("ms/step (median)   %8.2f   %8.2f   speedup %.2fx\n", me, mc, me / mc);
  printf("compile ms                    %8.1f   (trace %.1f + passes and codegen %.1f)\n", st.trace_ms + st.compile_ms,
         st.trace_ms, st.compile_ms);
  printf("peak MiB per step  %8.2f   %8.2f   (compiled: %.2f MiB kept between calls)\n\n", eager_peak / 1048576.0,
         compiled_peak / 1048576.0, kept / 1048576.0);

  printf("the compiled step, first %d lines of its graph (dtype, shape, source line per node):\n", IR_LINES);
  if (print_graph_head(fn, 0, IR_LINES) != 0) goto fail;

  /* the tail of the epoch: a new batch size, so B retraces with the batch symbolic */
  int64_t tail = N - full * B;
  step_result r;
  if (step_both(&a, fn, x, y, full * B, tail, &r, NULL, NULL) != 0) goto fail;
  kiln_fn_stats st2;
  if (kiln_fn_get_stats(fn, &st2) != 0) goto fail;
  printf("\nthe last %lld rows (a partial batch): eager %.5f, compiled %.5f (rel diff %.1e), %s\n", (long long)tail,
         r.eager_loss, r.compiled_loss, rel_diff(r.eager_loss, r.compiled_loss),
         st2.traces > st.traces ? "traced a new variant:" : "hit");
  if (st2.traces > st.traces && print_graph_head(fn, (int)st2.variants - 1, 1) != 0) goto fail;
  printf("stats: %lld calls, %lld hits, %lld traces, %lld variants, %lld fallbacks, guards %.0f ns per hit\n",
         (long long)st2.calls, (long long)st2.hits, (long long)st2.traces, (long long)st2.variants,
         (long long)st2.fallbacks, st2.guard_ns);

  /* the forward pass alone, batch symbolic from the first trace, with its kernels */
  printf("\nthe forward pass alone, batch marked dynamic, KILN_DUMP_KERNELS (on stderr):\n");
  kiln_options fopts = {.name = "forward", .n_in = 1, .n_out = 1, .dump = KILN_DUMP_KERNELS};
  fwd = kiln_compile(forward_body, &b, &fopts);
  if (!fwd || kiln_mark_dynamic(fwd, 0, 0) != 0) goto fail;
  for (int call = 0; call < 2; call++) { /* the first traces, the second runs the kernels */
    kiln_scope_begin();
    kiln_tensor *xb = kiln_slice(x, 0, 0, 100, 1), *logits = NULL;
    fflush(stdout);
    int rc = xb ? kiln_call(fwd, &xb, &logits) : -1;
    fflush(stderr);
    kiln_scope_end();
    if (rc != 0) goto fail;
  }

  /* the verdicts: same numbers, learning happened, the cache did its job */
  bool ok = true;
  char line[200];
  printf("\nchecks:\n");
  snprintf(line, sizeof line, "eager and compiled losses agree at every step (worst rel diff %.1e, limit %g)", worst, RTOL);
  check(worst <= RTOL, &ok, line);
  snprintf(line, sizeof line, "the trained weights agree: loss over all rows A %.5f, B %.5f", loss_a, loss_b);
  check(rel_diff(loss_a, loss_b) <= RTOL, &ok, line);
  snprintf(line, sizeof line, "the loss at least halves: %.4f -> A %.4f, B %.4f", loss0, loss_a, loss_b);
  check(loss_a <= loss0 / 2 && loss_b <= loss0 / 2, &ok, line);
  snprintf(line, sizeof line, "one trace, then %d hits (got %lld traces, %lld hits, %lld fallbacks)", STEPS - 1,
           (long long)st.traces, (long long)st.hits, (long long)st.fallbacks);
  check(st.traces == 1 && st.hits == STEPS - 1 && st.fallbacks == 0, &ok, line);
  snprintf(line, sizeof line, "the partial batch agrees (rel diff %.1e) and did not fall back to eager",
           rel_diff(r.eager_loss, r.compiled_loss));
  check(rel_diff(r.eager_loss, r.compiled_loss) <= RTOL && st2.fallbacks == 0, &ok, line);
  status = ok ? 0 : 2;
  printf("%s\n", ok ? "train_compiled: ok" : "train_compiled: FAILED");
  goto done;
fail:
  fprintf(stderr, "train_compiled: %s\n", *kiln_last_error() ? kiln_last_error() : "a loss is not finite");
  status = 1;
done:
  free(te);
  free(tc);
  kiln_fn_free(fwd);
  kiln_fn_free(fn);
  mlp_free(&teacher);
  mlp_free(&a);
  mlp_free(&b);
  kiln_release(x);
  kiln_release(y);
  return status;
}
