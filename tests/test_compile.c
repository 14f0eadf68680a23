/* kiln_compile end to end on the interpreter backend: traced results equal
 * eager ones, shapes stay symbolic, guards retrace, the cap and value reads
 * fall back, training steps compile, save/load round-trips, threads share a
 * kiln_fn. Eager is the oracle throughout (its own tests check it against
 * numpy and finite differences). */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kiln.h"
#include "eager/eager.h" /* alloc_fail_after */
#include "saved_loaded.h"

/* max |a - b| over two tensors of the same shape (read as f64) */
static double maxdiff(const kiln_tensor *a, const kiln_tensor *b) {
  ck_assert_ptr_nonnull(a);
  ck_assert_ptr_nonnull(b);
  ck_assert_int_eq(kiln_ndim(a), kiln_ndim(b));
  for (int d = 0; d < kiln_ndim(a); d++) ck_assert_int_eq(kiln_size(a, d), kiln_size(b, d));
  int64_t n = kiln_numel(a);
  kiln_scope_begin();
  kiln_tensor *da = kiln_cast((kiln_tensor *)a, KILN_F64), *db = kiln_cast((kiln_tensor *)b, KILN_F64);
  double *x = malloc(sizeof(double) * (size_t)(n + 1)), *y = malloc(sizeof(double) * (size_t)(n + 1)), m = 0;
  ck_assert_int_eq(0, kiln_read(da, x, sizeof(double) * (size_t)n));
  ck_assert_int_eq(0, kiln_read(db, y, sizeof(double) * (size_t)n));
  for (int64_t i = 0; i < n; i++) {
    if (isnan(x[i]) && isnan(y[i])) continue;
    double e = fabs(x[i] - y[i]);
    if (!(e <= m)) m = e;
  }
  free(x), free(y);
  kiln_scope_end();
  return m;
}

static bool has(const char *s, const char *needle) { return s && strstr(s, needle) != NULL; }

/* ---- an MLP with weights in its context (implicit inputs) ---- */

typedef struct mlp {
  kiln_tensor *w1, *b1, *w2, *b2;
  float lr;
} mlp;

static void mlp_init(mlp *m, int in, int hid, int out, bool grad) {
  int64_t s1[2] = {in, hid}, s2[2] = {hid, out}, sb1[1] = {hid}, sb2[1] = {out};
  kiln_scope_begin();
  m->w1 = kiln_mul(kiln_randn(KILN_F32, 2, s1, 1), kiln_scalar(KILN_F32, 0.3));
  m->b1 = kiln_mul(kiln_randn(KILN_F32, 1, sb1, 2), kiln_scalar(KILN_F32, 0.1));
  m->w2 = kiln_mul(kiln_randn(KILN_F32, 2, s2, 3), kiln_scalar(KILN_F32, 0.3));
  m->b2 = kiln_mul(kiln_randn(KILN_F32, 1, sb2, 4), kiln_scalar(KILN_F32, 0.1));
  kiln_keep(m->w1), kiln_keep(m->b1), kiln_keep(m->w2), kiln_keep(m->b2);
  kiln_scope_end();
  m->lr = 0.05f;
  if (grad) {
    kiln_requires_grad(m->w1, true), kiln_requires_grad(m->b1, true);
    kiln_requires_grad(m->w2, true), kiln_requires_grad(m->b2, true);
  }
}

static void mlp_free(mlp *m) {
  kiln_release(m->w1), kiln_release(m->b1), kiln_release(m->w2), kiln_release(m->b2);
}

static kiln_tensor *mlp_forward(mlp *m, kiln_tensor *x) {
  kiln_tensor *h = kiln_gelu(kiln_add(kiln_matmul(x, m->w1), m->b1));
  return kiln_add(kiln_matmul(h, m->w2), m->b2);
}

static int mlp_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = mlp_forward(ctx, in[0]);
  return out[0] ? 0 : -1;
}

START_TEST(test_mlp_dynamic_batch) {
  mlp m;
  mlp_init(&m, 16, 32, 8, false);
  kiln_options o = {.name = "mlp", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(mlp_body, &m, &o);
  ck_assert_ptr_nonnull(fn);
  int64_t batches[] = {32, 7, 33, 1000, 1, 32};
  for (size_t i = 0; i < sizeof batches / sizeof *batches; i++) {
    kiln_scope_begin();
    int64_t s[2] = {batches[i], 16};
    kiln_tensor *x = kiln_randn(KILN_F32, 2, s, 100 + i), *y = NULL;
    ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
    kiln_tensor *ref = mlp_forward(&m, x);
    ck_assert_double_le(maxdiff(y, ref), 1e-5);
    kiln_scope_end();
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  /* batch 32 traced static, batch 7 made dim 0 a symbol; the rest hit that variant */
  ck_assert_int_eq(2, st.traces);
  ck_assert_int_eq(6, st.calls);
  ck_assert_int_eq(4, st.hits);
  ck_assert_int_eq(0, st.fallbacks);
  char *text = kiln_fn_graph(fn, 1);
  ck_assert(has(text, "f32[s0,16]") && has(text, "f32[s0,8]"));
  ck_assert(has(text, "@param") && has(text, "test_compile.c:"));
  free(text);
  kiln_fn_free(fn);
  mlp_free(&m);
}
END_TEST

/* reshape with -1, and sizes the function computes from kiln_size, stay symbolic */
static int reshape_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0];
  int64_t b = kiln_size(x, 0), t = kiln_size(x, 1);
  kiln_tensor *flat = kiln_reshape(x, 2, ((int64_t[]){b * t, 8}));       /* (B*T, 8) */
  kiln_tensor *four = kiln_reshape(flat, 2, ((int64_t[]){-1, 4}));        /* (B*T*2, 4) */
  kiln_tensor *back = kiln_reshape(kiln_tanh(four), 3, ((int64_t[]){b, t, 8}));
  kiln_tensor *heads = kiln_reshape(back, 4, ((int64_t[]){b, t, 2, 4})); /* split the last dim */
  out[0] = kiln_sum(kiln_transpose(heads, 1, 2), 3, false);                /* (B, 2, T) */
  return out[0] ? 0 : -1;
}

START_TEST(test_reshape_stays_symbolic) {
  kiln_options o = {.name = "rs", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(reshape_body, NULL, &o);
  ck_assert_int_eq(0, kiln_mark_dynamic(fn, 0, 0));
  ck_assert_int_eq(0, kiln_mark_dynamic(fn, 0, 1));
  ck_assert_int_eq(-1, kiln_mark_dynamic(fn, 1, 0));
  int64_t sizes[][2] = {{3, 5}, {4, 6}, {1, 9}, {7, 1}, {2, 2}};
  for (int i = 0; i < 5; i++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 3, ((int64_t[]){sizes[i][0], sizes[i][1], 8}), 7 + i), *y = NULL, *ref = NULL;
    ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
    ck_assert_int_eq(0, reshape_body(NULL, &x, &ref));
    ck_assert_double_le(maxdiff(y, ref), 1e-6);
    kiln_scope_end();
  }
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  /* one variant served every size, T=1 and B=1 included: the numbers the
   * body computed from sizes cover groups of the input's dims, and a later
   * call with other sizes holds them to those expressions */
  char *text = kiln_fn_graph(fn, 0);
  ck_assert_ptr_nonnull(text);
  if (st.traces != 1 || !has(text, "{shape=[2*s0*s1,4]}")) fprintf(stderr, "%s\n", text);
  ck_assert_int_eq(1, st.traces);
  ck_assert_int_eq(4, st.hits);
  ck_assert(has(text, "{shape=[2*s0*s1,4]}") && has(text, "{shape=[s0,s1,2,4]}") && !has(text, "guards"));
  free(text);
  kiln_fn_free(fn);
}
END_TEST

/* ---- guards ---- */

static int add_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_add(kiln_mul(in[0], in[1]), in[0]);
  return out[0] ? 0 : -1;
}

START_TEST(test_guards_retrace) {
  kiln_options o = {.name = "add", .n_in = 2, .n_out = 1};
  kiln_fn *fn = kiln_compile(add_body, NULL, &o);
  kiln_scope_begin();
  int64_t s[1] = {6};
  kiln_tensor *a = kiln_randn(KILN_F32, 1, s, 1), *b = kiln_randn(KILN_F32, 1, s, 2);
  kiln_tensor *a64 = kiln_cast(a, KILN_F64), *b64 = kiln_cast(b, KILN_F64);
  kiln_tensor *bb = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 3);
  kiln_tensor *cases[][2] = {{a, b}, {a, b}, {a64, b64}, {a, bb}, {a64, b64}, {a, a}, {a, b}};
  long traces[] = {1, 1, 2, 3, 3, 4, 4};
  for (int i = 0; i < 7; i++) {
    kiln_tensor *y = NULL, *ref = NULL;
    ck_assert_msg(kiln_call(fn, cases[i], &y) == 0, "%s", kiln_last_error());
    ck_assert_int_eq(0, add_body(NULL, cases[i], &ref));
    ck_assert_double_le(maxdiff(y, ref), 1e-12);
    kiln_fn_stats st;
    kiln_fn_get_stats(fn, &st);
    ck_assert_msg(st.traces == traces[i], "call %d: traces %lld, want %ld", i, (long long)st.traces, traces[i]);
  }
  kiln_scope_end();
  kiln_fn_free(fn);
}
END_TEST

START_TEST(test_cap_falls_back) {
  kiln_options o = {.name = "capped", .n_in = 2, .n_out = 1, .dynamic = KILN_DYNAMIC_STATIC, .max_variants = 2};
  kiln_fn *fn = kiln_compile(add_body, NULL, &o);
  for (int n = 1; n <= 5; n++) {
    kiln_scope_begin();
    int64_t s[1] = {n};
    kiln_tensor *in[2] = {kiln_randn(KILN_F32, 1, s, 1), kiln_randn(KILN_F32, 1, s, 2)}, *y = NULL, *ref = NULL;
    ck_assert_int_eq(0, kiln_call(fn, in, &y));
    ck_assert_int_eq(0, add_body(NULL, in, &ref));
    ck_assert_double_le(maxdiff(y, ref), 0);
    kiln_scope_end();
  }
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(2, st.traces);
  ck_assert_int_eq(2, st.variants);
  ck_assert_int_eq(3, st.fallbacks);
  kiln_fn_free(fn);
}
END_TEST

/* a body that looks at a value and branches on it */
static int branchy(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  double s = kiln_item(kiln_sum_all(in[0]));
  out[0] = s > 0 ? kiln_exp(in[0]) : kiln_neg(in[0]);
  return out[0] ? 0 : -1;
}

/* A value read inside the body is a graph break: the ops before it run
 * compiled, the value goes to C, and recording goes on. Each branch is a
 * variant of its own; both stay compiled. */
START_TEST(test_value_dependent_breaks) {
  kiln_options o = {.name = "branchy", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(branchy, NULL, &o);
  kiln_scope_begin();
  int64_t s[1] = {4};
  float pos[4] = {1, 2, 3, 4}, neg[4] = {-1, -2, -3, -4};
  kiln_tensor *p = kiln_tensor_from(KILN_F32, 1, s, pos), *q = kiln_tensor_from(KILN_F32, 1, s, neg), *y = NULL;
  kiln_tensor *order[4] = {p, q, p, q};
  for (int i = 0; i < 4; i++) {
    ck_assert_int_eq(0, kiln_call(fn, &order[i], &y));
    ck_assert_double_le(maxdiff(y, i % 2 ? kiln_neg(q) : kiln_exp(p)), 1e-6);
  }
  kiln_scope_end();
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(2, st.traces);
  ck_assert_int_eq(2, st.hits);
  ck_assert_int_eq(0, st.fallbacks);
  ck_assert_int_eq(2, st.variants);
  ck_assert_int_eq(4, st.breaks);
  kiln_fn_free(fn);
}
END_TEST

/* ---- training: forward, backward and SGD in one compiled step ---- */

static kiln_tensor *train_step(mlp *m, kiln_tensor *x, kiln_tensor *t) {
  kiln_tensor *loss = kiln_mse_loss(mlp_forward(m, x), t);
  if (!loss || kiln_backward(loss)) return NULL;
  kiln_no_grad_begin();
  kiln_tensor *ps[4] = {m->w1, m->b1, m->w2, m->b2};
  for (int i = 0; i < 4; i++) {
    kiln_sub_(ps[i], kiln_mul(kiln_grad(ps[i]), kiln_scalar(KILN_F32, m->lr)));
    kiln_zero_grad(ps[i]);
  }
  kiln_no_grad_end();
  return loss;
}

static int train_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = train_step(ctx, in[0], in[1]);
  return out[0] ? 0 : -1;
}

START_TEST(test_training_step_matches_eager) {
  mlp a, b;
  mlp_init(&a, 8, 16, 4, true);
  mlp_init(&b, 8, 16, 4, true);
  kiln_options o = {.name = "train", .n_in = 2, .n_out = 1};
  kiln_fn *fn = kiln_compile(train_body, &a, &o);
  for (int step = 0; step < 20; step++) {
    kiln_scope_begin();
    int64_t sx[2] = {10, 8}, st[2] = {10, 4};
    kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, sx, 50 + step), kiln_randn(KILN_F32, 2, st, 90 + step)}, *loss = NULL;
    ck_assert_msg(kiln_call(fn, in, &loss) == 0, "step %d: %s", step, kiln_last_error());
    kiln_tensor *ref = train_step(&b, in[0], in[1]);
    ck_assert_double_le(maxdiff(loss, ref), 1e-5);
    kiln_scope_end();
  }
  ck_assert_double_le(maxdiff(a.w1, b.w1), 1e-5);
  ck_assert_double_le(maxdiff(a.b1, b.b1), 1e-5);
  ck_assert_double_le(maxdiff(a.w2, b.w2), 1e-5);
  ck_assert_double_le(maxdiff(a.b2, b.b2), 1e-5);
  ck_assert_ptr_null(kiln_grad(a.w1)); /* zero_grad ran inside the step */
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(1, st.traces);
  ck_assert_int_eq(19, st.hits);
  char *text = kiln_fn_graph(fn, 0);
  /* four parameter updates written back; .grad was NULL before and after, so no grad line */
  int writes = 0;
  for (const char *p = text; (p = strstr(p, "  write %")); p++) writes++;
  ck_assert_int_eq(4, writes);
  ck_assert(!has(text, "  grad %"));
  free(text);
  kiln_fn_free(fn);
  mlp_free(&a), mlp_free(&b);
}
END_TEST

/* the batch changes between steps: the mean's gradient must divide by the
 * batch of each call, not by the one traced */
START_TEST(test_training_dynamic_batch) {
  mlp a, b;
  mlp_init(&a, 8, 16, 4, true);
  mlp_init(&b, 8, 16, 4, true);
  kiln_options o = {.name = "train", .n_in = 2, .n_out = 1};
  kiln_fn *fn = kiln_compile(train_body, &a, &o);
  int64_t batches[] = {10, 7, 13, 1, 7, 10, 33};
  for (int step = 0; step < 7; step++) {
    kiln_scope_begin();
    int64_t sx[2] = {batches[step], 8}, st[2] = {batches[step], 4};
    kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, sx, 50 + step), kiln_randn(KILN_F32, 2, st, 90 + step)}, *loss = NULL;
    ck_assert_msg(kiln_call(fn, in, &loss) == 0, "step %d: %s", step, kiln_last_error());
    kiln_tensor *ref = train_step(&b, in[0], in[1]);
    ck_assert_double_le(maxdiff(loss, ref), 1e-5);
    ck_assert_double_le(maxdiff(a.w1, b.w1), 1e-5);
    kiln_scope_end();
  }
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(2, st.traces); /* static at 10, then one symbolic batch for all */
  kiln_fn_free(fn);
  mlp_free(&a), mlp_free(&b);
}
END_TEST

/* var divides by its count too */
static int var_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_var(in[0], 0, 1, false);
  return out[0] ? 0 : -1;
}

START_TEST(test_var_dynamic) {
  kiln_options o = {.name = "var", .n_in = 1, .n_out = 1, .dynamic = KILN_DYNAMIC_ALL};
  kiln_fn *fn = kiln_compile(var_body, NULL, &o);
  for (int n = 3; n < 9; n += 2) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){n, 3}), (uint64_t)n), *y = NULL, *ref = NULL;
    ck_assert_int_eq(0, kiln_call(fn, &x, &y));
    ck_assert_int_eq(0, var_body(NULL, &x, &ref));
    ck_assert_double_le(maxdiff(y, ref), 1e-5);
    kiln_scope_end();
  }
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(1, st.traces);
  kiln_fn_free(fn);
}
END_TEST

/* the grad accumulates across calls when the step does not zero it */
static int accumulate_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor *w = ctx;
  out[0] = kiln_sum_all(kiln_mul(kiln_mul(w, w), in[0]));
  return out[0] && kiln_backward(out[0]) == 0 ? 0 : -1;
}

START_TEST(test_grad_accumulates) {
  int64_t s[1] = {3};
  float wv[3] = {1, 2, 3}, xv[3] = {1, 10, 100};
  kiln_tensor *w = kiln_tensor_from(KILN_F32, 1, s, wv), *x = kiln_tensor_from(KILN_F32, 1, s, xv), *y = NULL;
  kiln_requires_grad(w, true);
  kiln_options o = {.name = "acc", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(accumulate_body, w, &o);
  for (int i = 0; i < 4; i++) {
    ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
    kiln_release(y);
  }
  /* d/dw sum(w*w*x) = 2*w*x, added four times */
  float g[3];
  ck_assert_int_eq(0, kiln_read(kiln_grad(w), g, sizeof g));
  for (int i = 0; i < 3; i++) ck_assert_float_eq(4 * 2 * wv[i] * xv[i], g[i]);
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  /* first call: .grad NULL; second: set (a new variant); then hits */
  ck_assert_int_eq(2, st.traces);
  kiln_fn_free(fn);
  kiln_release(w), kiln_release(x);
}
END_TEST

/* ---- aliasing, outputs that are inputs or views ---- */

static int view_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_transpose(in[0], 0, 1);
  out[1] = in[0];
  return 0;
}

START_TEST(test_outputs_alias_inputs) {
  kiln_options o = {.name = "views", .n_in = 1, .n_out = 2};
  kiln_fn *fn = kiln_compile(view_body, NULL, &o);
  for (int i = 0; i < 3; i++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){2, 3}), 5), *y[2] = {0};
    ck_assert_int_eq(0, kiln_call(fn, &x, y));
    ck_assert_ptr_eq(x, y[1]);
    ck_assert_int_eq(3, kiln_size(y[0], 0));
    ck_assert_int_eq(1, kiln_stride(y[0], 0)); /* a view of x, not a copy */
    kiln_fill_(x, 2.0);
    ck_assert_double_eq(2.0, kiln_item(kiln_sum_all(kiln_slice(kiln_slice(y[0], 0, 1, 2, 1), 1, 0, 1, 1))));
    kiln_scope_end();
  }
  /* a strided argument comes back as itself too */
  kiln_scope_begin();
  kiln_tensor *xt = kiln_transpose(kiln_randn(KILN_F32, 2, ((int64_t[]){3, 2}), 5), 0, 1), *yt[2] = {0};
  for (int i = 0; i < 2; i++) {
    ck_assert_int_eq(0, kiln_call(fn, &xt, yt));
    ck_assert_ptr_eq(xt, yt[1]);
  }
  kiln_scope_end();
  kiln_fn_free(fn);
}
END_TEST

static int inplace_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_add_(in[0], in[1]); /* writes into the caller's tensor */
  out[0] = kiln_mul(in[0], in[1]);
  return out[0] ? 0 : -1;
}

/* _i 1: in check mode too, which must agree with eager (an input passed
 * twice is one leaf of its snapshot) */
START_TEST(test_inplace_and_alias_guard) {
  kiln_options o = {.name = "inplace", .n_in = 2, .n_out = 1, .check = _i};
  kiln_fn *fn = kiln_compile(inplace_body, NULL, &o);
  kiln_scope_begin();
  int64_t s[1] = {3};
  float av[3] = {1, 2, 3}, bv[3] = {10, 20, 30};
  for (int i = 0; i < 3; i++) {
    kiln_tensor *a = kiln_tensor_from(KILN_F32, 1, s, av), *b = kiln_tensor_from(KILN_F32, 1, s, bv);
    kiln_tensor *in[2] = {a, b}, *y = NULL;
    ck_assert_int_eq(0, kiln_call(fn, in, &y));
    float ga[3], gy[3];
    kiln_read(a, ga, sizeof ga), kiln_read(y, gy, sizeof gy);
    for (int k = 0; k < 3; k++) {
      ck_assert_float_eq(av[k] + bv[k], ga[k]);
      ck_assert_float_eq((av[k] + bv[k]) * bv[k], gy[k]);
    }
  }
  /* the same tensor twice: a += a, then a*a; a variant for distinct inputs must not run */
  kiln_tensor *a = kiln_tensor_from(KILN_F32, 1, s, av), *in[2] = {a, a}, *y = NULL;
  ck_assert_int_eq(0, kiln_call(fn, in, &y));
  float gy[3];
  kiln_read(y, gy, sizeof gy);
  for (int k = 0; k < 3; k++) ck_assert_float_eq(4 * av[k] * av[k], gy[k]);
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(2, st.traces);
  ck_assert_int_eq(0, st.check_fails);
  kiln_scope_end();
  kiln_fn_free(fn);
}
END_TEST

/* A weight updated in place while a view of it (the transposed weight a
 * forward made) still lives in the scope: compiles, and matches eager. A view
 * used after the write cannot be followed: that trace falls back. */
typedef struct {
  kiln_tensor *w;
  bool late; /* use the old view after the write */
} tied;

static int tied_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  tied *c = ctx;
  kiln_tensor *wt = kiln_transpose(c->w, 0, 1);
  kiln_tensor *y = kiln_matmul(in[0], wt);
  kiln_sub_(c->w, kiln_mul(kiln_sum(y, 0, false), kiln_scalar(KILN_F32, 0.01)));
  out[0] = c->late ? kiln_matmul(in[0], wt) : y;
  return out[0] ? 0 : -1;
}

START_TEST(test_write_with_live_view) {
  for (int late = 0; late < 2; late++) {
    int64_t ws[2] = {3, 3};
    tied a = {kiln_keep(kiln_randn(KILN_F32, 2, ws, 5)), late}, b = {kiln_keep(kiln_randn(KILN_F32, 2, ws, 5)), late};
    kiln_options o = {.name = "tied", .n_in = 1, .n_out = 1};
    kiln_fn *fn = kiln_compile(tied_body, &a, &o);
    for (int i = 0; i < 4; i++) {
      kiln_scope_begin();
      kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 3}), 10 + (uint64_t)i), *y = NULL, *ye = NULL;
      ck_assert_int_eq(0, kiln_call(fn, &x, &y));
      ck_assert_int_eq(0, tied_body(&b, &x, &ye));
      ck_assert_double_le(maxdiff(y, ye), 1e-6);
      ck_assert_double_le(maxdiff(a.w, b.w), 1e-6);
      kiln_scope_end();
    }
    kiln_fn_stats st;
    kiln_fn_get_stats(fn, &st);
    ck_assert_int_eq(1, st.traces);
    ck_assert_int_eq(1, st.variants);
    /* late: the ops up to the stale view's use run compiled, the rest of each call eagerly */
    ck_assert_int_eq(late ? 4 : 0, st.fallbacks);
    ck_assert_int_eq(late ? 0 : 3, st.hits);
    kiln_fn_free(fn);
    kiln_release(a.w), kiln_release(b.w);
  }
}
END_TEST

/* Targets the body makes are checked when the compiled graph has their
 * values: a bad one is the same error as eager's, never a loss that skips
 * the row. */
static int bad_targets_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *t = kiln_cast(kiln_mul(kiln_gt(kiln_sum(in[0], 1, false), kiln_scalar(KILN_F32, -1e9)), kiln_scalar(KILN_I64, 9)), KILN_I64);
  out[0] = kiln_cross_entropy(in[0], t); /* every target is 9, and there are 4 classes */
  return out[0] ? 0 : -1;
}

START_TEST(test_bad_targets_compiled) {
  kiln_options o = {.name = "ce", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(bad_targets_body, NULL, &o);
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 4}), 1), *y = NULL;
  for (int i = 0; i < 2; i++) {
    kiln_clear_error();
    ck_assert_int_eq(-1, kiln_call(fn, &x, &y));
    ck_assert_msg(has(kiln_last_error(), "kiln_cross_entropy: target 9 of row 0 is out of range [0, 4)") &&
                      has(kiln_last_error(), "test_compile.c:"),
                  "%s", kiln_last_error());
  }
  kiln_scope_end();
  kiln_fn_free(fn);
}
END_TEST

/* An index the body checks (cross entropy's targets, an embedding's
 * indices, one_hot's) is checked on every call's data by the compiled
 * code, on every capture path: the guard-only path runs no body, so a check
 * made only while recording passed a bad target of a later call as a loss
 * of the wrong row. */
static int index_kind_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  switch (*(const int *)ctx) {
  case 0: out[0] = kiln_cross_entropy(in[0], in[1]); break;
  case 1: out[0] = kiln_embedding(kiln_transpose(in[0], 0, 1), in[1]); break;
  default: out[0] = kiln_one_hot(in[1], 4); break;
  }
  return out[0] ? 0 : -1;
}

START_TEST(test_index_checks_every_call) {
  int kind = _i % 3;
  kiln_options o = {.name = "idx", .n_in = 2, .n_out = 1, .backend = 1 + _i / 3 % 2};
  o.capture = _i / 6 == 0 ? KILN_CAPTURE_AUTO : _i / 6 == 1 ? KILN_CAPTURE_RECORD : KILN_CAPTURE_GUARDS;
  kiln_fn *fn = kiln_compile(index_kind_body, &kind, &o);
  int64_t t[5][2] = {{1, 2}, {3, 0}, {2, 2}, {1, 7}, {0, 3}};
  for (int i = 0; i < 5; i++) {
    kiln_scope_begin();
    kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, ((int64_t[]){2, 4}), 5 + (uint64_t)i),
                          kiln_tensor_from(KILN_I64, 1, ((int64_t[]){2}), t[i])};
    kiln_tensor *y = NULL, *want = NULL;
    kiln_clear_error();
    int rc = kiln_call(fn, in, &y);
    if (i == 3) {
      /* target 7 of 4 classes: an error at the body's line, as eager's */
      ck_assert_int_eq(-1, rc);
      const char *want_msg[3] = {"kiln_cross_entropy: target 7 of row 1 is out of range [0, 4)",
                                 "kiln_index_select: index 7 at position 1 is out of range [0, 4)",
                                 "kiln_one_hot: index 7 at position 1 is out of range [0, 4)"};
      ck_assert_msg(has(kiln_last_error(), want_msg[kind]) && has(kiln_last_error(), "test_compile.c:"), "kind %d: %s", kind,
                    kiln_last_error());
      ck_assert_int_eq(-1, index_kind_body(&kind, in, &want));
    } else {
      ck_assert_msg(rc == 0, "kind %d call %d: %s", kind, i, kiln_last_error());
      ck_assert_int_eq(0, index_kind_body(&kind, in, &want));
      ck_assert_double_le(maxdiff(y, want), 1e-5);
    }
    kiln_scope_end();
  }
  kiln_fn_free(fn);
}
END_TEST

/* Indices the body wrote in place before using them: a recording writes
 * nothing, so their data are the old values there, and a check of them
 * while recording failed a call that eager runs (the position starts at
 * -1 and the body steps it first). */
typedef struct written_pos {
  kiln_tensor *pos, *cache, *table;
} written_pos;

static int written_pos_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  written_pos *m = ctx;
  if (!kiln_add_(m->pos, kiln_scalar(KILN_I64, 1))) return -1;
  if (!kiln_index_copy_(m->cache, 0, m->pos, kiln_reshape(in[0], 2, ((int64_t[]){1, 3})))) return -1;
  out[0] = kiln_add(kiln_sum(m->cache, 0, false), kiln_sum(kiln_embedding(m->table, m->pos), 0, false));
  return out[0] ? 0 : -1;
}

static void written_pos_init(written_pos *m) {
  int64_t p0 = -1;
  m->pos = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &p0);
  m->cache = kiln_zeros(KILN_F32, 2, ((int64_t[]){4, 3}));
  m->table = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 3}), 3);
}

static void written_pos_free(written_pos *m) { kiln_release(m->pos), kiln_release(m->cache), kiln_release(m->table); }

START_TEST(test_index_written_in_body) {
  written_pos m, e;
  written_pos_init(&m), written_pos_init(&e);
  kiln_options o = {.name = "pos", .n_in = 1, .n_out = 1, .backend = 1 + _i % 2};
  o.capture = _i / 2 == 0 ? KILN_CAPTURE_AUTO : _i / 2 == 1 ? KILN_CAPTURE_RECORD : KILN_CAPTURE_GUARDS;
  kiln_fn *fn = kiln_compile(written_pos_body, &m, &o);
  for (int i = 0; i < 5; i++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 1, ((int64_t[]){3}), 20 + (uint64_t)i), *y = NULL, *want = NULL;
    kiln_clear_error();
    int rc = kiln_call(fn, &x, &y), rc_e = written_pos_body(&e, &x, &want);
    if (i < 4) {
      ck_assert_msg(rc == 0 && rc_e == 0, "call %d: %s", i, kiln_last_error());
      ck_assert_double_le(maxdiff(y, want), 1e-5);
    } else {
      /* position 4 of 4 rows, both fail; the cache is as eager left it */
      ck_assert_int_eq(-1, rc);
      ck_assert_int_eq(-1, rc_e);
    }
    ck_assert_double_eq(0, maxdiff(m.cache, e.cache));
    kiln_scope_end();
  }
  kiln_fn_free(fn);
  written_pos_free(&m), written_pos_free(&e);
}
END_TEST

/* A tensor the body kept from a call whose compiled run failed has no
 * data; the ops that check indices with a loop of their own say so, as
 * every op does, instead of reading it. */
static int keeps_argmax_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor **kept = ctx;
  kiln_release(*kept);
  *kept = kiln_retain(kiln_argmax(in[0], 1, false));
  out[0] = kiln_cross_entropy(in[0], in[1]);
  return out[0] ? 0 : -1;
}

START_TEST(test_kept_without_data) {
  kiln_tensor *kept = NULL;
  kiln_options o = {.name = "keep", .n_in = 2, .n_out = 1, .backend = 1 + _i};
  kiln_fn *fn = kiln_compile(keeps_argmax_body, &kept, &o);
  kiln_scope_begin();
  int64_t bad[3] = {0, 1, 7};
  kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, ((int64_t[]){3, 4}), 1), kiln_tensor_from(KILN_I64, 1, ((int64_t[]){3}), bad)},
              *y = NULL;
  ck_assert_int_eq(-1, kiln_call(fn, in, &y));
  ck_assert_ptr_nonnull(kept);
  kiln_tensor *table = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 2}), 2), *cache = kiln_zeros(KILN_F32, 2, ((int64_t[]){4, 2}));
  kiln_tensor *r[4] = {kiln_one_hot(kept, 4), kiln_cross_entropy(in[0], kept), kiln_embedding(table, kept),
                       kiln_index_copy_(cache, 0, kept, kiln_ones(KILN_F32, 2, ((int64_t[]){3, 2})))};
  for (int k = 0; k < 4; k++) ck_assert_ptr_null(r[k]);
  ck_assert_msg(has(kiln_last_error(), "no data"), "%s", kiln_last_error());
  kiln_scope_end();
  kiln_release(kept);
  kiln_fn_free(fn);
}
END_TEST

/* A call that fails on its data makes no write the body makes after the
 * failing op: the LLVM backend moved a counter's update, which nothing else
 * reads, ahead of the index_copy_ that failed; and it stored a position's
 * new value, computed before the index_copy_ and copied into the position
 * after it, at the kernel that computed it. Nor one the body made before
 * it: a failed call writes no argument (eager has made that write). */
typedef struct counted_cache {
  kiln_tensor *cache, *step;
  int pos;
  bool copied; /* the position is a tensor, stepped before and copied back after */
  bool before; /* the counter stepped before the index_copy_ */
} counted_cache;

static int counted_cache_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  counted_cache *m = ctx;
  if (m->copied) {
    kiln_tensor *np = kiln_add(m->step, kiln_scalar(KILN_I64, 1));
    if (!kiln_index_copy_(m->cache, 0, kiln_reshape(np, 1, ((int64_t[]){1})), kiln_reshape(in[0], 2, ((int64_t[]){1, 3}))) ||
        !kiln_copy_(m->step, np))
      return -1;
    out[0] = kiln_sum(m->cache, 0, false);
    return out[0] ? 0 : -1;
  }
  kiln_tensor *idx = kiln_full(KILN_I64, 1, ((int64_t[]){1}), (double)m->pos);
  if (m->before && !kiln_add_(m->step, kiln_scalar(KILN_I64, 1))) return -1;
  if (!kiln_index_copy_(m->cache, 0, idx, kiln_reshape(kiln_mul(in[0], kiln_scalar(KILN_F32, 2)), 2, ((int64_t[]){1, 3}))))
    return -1;
  out[0] = kiln_sum(m->cache, 0, false);
  if (!m->before && !kiln_add_(m->step, kiln_scalar(KILN_I64, 1))) return -1;
  m->pos++;
  return out[0] ? 0 : -1;
}

START_TEST(test_failed_call_writes_nothing_after) {
  counted_cache m = {kiln_zeros(KILN_F32, 2, ((int64_t[]){4, 3})), kiln_full(KILN_I64, 0, NULL, _i / 4 == 1 ? -1 : 0), 0,
                     _i / 4 == 1, _i / 4 == 2};
  kiln_options o = {.name = "cc", .n_in = 1, .n_out = 1, .backend = 1 + _i % 2,
                    .capture = _i / 2 % 2 ? KILN_CAPTURE_RECORD : KILN_CAPTURE_AUTO};
  kiln_fn *fn = kiln_compile(counted_cache_body, &m, &o);
  for (int i = 0; i < 5; i++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_ones(KILN_F32, 1, ((int64_t[]){3})), *y = NULL;
    int rc = kiln_call(fn, &x, &y);
    ck_assert_int_eq(i < 4 ? 0 : -1, rc);
    /* eager stops at the 5th call's index_copy_, before the counter (from -1 when copied; stepped
     * before it, the failed call writes it neither) */
    ck_assert_double_eq((i < 4 ? i + 1 : 4) - m.copied, kiln_item(m.step));
    kiln_scope_end();
  }
  kiln_fn_free(fn);
  kiln_release(m.cache), kiln_release(m.step);
}
END_TEST

/* ---- save and load ---- */

/* KILN_CHECK=1 reaches loaded functions too, whose calls are not checked
 * (their body is not at hand): a call of one must not leave its variant
 * for the next checked call of another function to compare, after the
 * loaded one is freed (ASan saw the read of freed memory). */
START_TEST(test_check_mode_loaded_then_checked) {
  setenv("KILN_CHECK", "1", 1);
  mlp m;
  mlp_init(&m, 16, 32, 8, false);
  /* fn records every call: its checked calls hit no variant on the guard-only path */
  kiln_options o = {.name = "mlp", .n_in = 1, .n_out = 1, .capture = KILN_CAPTURE_RECORD};
  kiln_fn *fn = kiln_compile(mlp_body, &m, &o);
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){5, 16}), 1), *y = NULL;
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  kiln_fn *ld = saved_and_loaded(fn, "check");
  kiln_tensor *in[5] = {x, m.w1, m.b1, m.w2, m.b2}, *y2 = NULL;
  ck_assert_msg(kiln_call(ld, in, &y2) == 0, "%s", kiln_last_error());
  ck_assert_double_le(maxdiff(y2, mlp_forward(&m, x)), 1e-5);
  kiln_fn_free(ld);
  /* a checked call of fn, which must not take the loaded function's freed variant to compare */
  ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
  ck_assert_double_le(maxdiff(y, mlp_forward(&m, x)), 1e-5);
  kiln_scope_end();
  kiln_fn_free(fn);
  mlp_free(&m);
  unsetenv("KILN_CHECK");
}
END_TEST


START_TEST(test_save_load) {
  mlp m;
  mlp_init(&m, 16, 32, 8, false);
  kiln_options o = {.name = "mlp", .n_in = 1, .n_out = 1, .dynamic = KILN_DYNAMIC_ALL};
  kiln_fn *fn = kiln_compile(mlp_body, &m, &o);
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){5, 16}), 1), *y = NULL;
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  kiln_fn *ld = saved_and_loaded(fn, "save");
  kiln_tensor *x2 = kiln_randn(KILN_F32, 2, ((int64_t[]){9, 16}), 2), *y2 = NULL;
  kiln_tensor *in[5] = {x2, m.w1, m.b1, m.w2, m.b2};
  ck_assert_msg(kiln_call(ld, in, &y2) == 0, "%s", kiln_last_error());
  ck_assert_double_le(maxdiff(y2, mlp_forward(&m, x2)), 1e-5);
  /* a call that does not fit: a clear error, no retrace */
  in[1] = m.w2;
  ck_assert_int_eq(-1, kiln_call(ld, in, &y2));
  ck_assert_msg(has(kiln_last_error(), "does not fit the loaded graph") && has(kiln_last_error(), "test_compile.c:"), "%s",
                kiln_last_error());
  kiln_scope_end();
  kiln_fn_free(ld);
  kiln_fn_free(fn);
  mlp_free(&m);
}
END_TEST

START_TEST(test_load_rejects_bad_text) {
  ck_assert_ptr_null(kiln_load_string("graph g(%0: f32[4]) -> (%1)\n  %1: f32[4] = exq(%0)\n"));
  ck_assert_msg(has(kiln_last_error(), "line 2"), "%s", kiln_last_error());
  ck_assert_ptr_null(kiln_load_string("graph g(%0: f32[4]) -> (%1)\n  %1: f32[5] = exp(%0)\n"));
  ck_assert_msg(has(kiln_last_error(), "%1"), "%s", kiln_last_error());
  ck_assert_ptr_null(kiln_load("/nonexistent/kiln.ir"));
  ck_assert_msg(has(kiln_last_error(), "cannot open"), "%s", kiln_last_error());
}
END_TEST

/* ---- every op traced and replayed equals eager ---- */

typedef struct op_case {
  const char *name;
  kiln_tensor *(*f)(kiln_tensor *a, kiln_tensor *b);
} op_case;

#define BIN(n) static kiln_tensor *f_##n(kiln_tensor *a, kiln_tensor *b) { return kiln_##n(a, b); }
#define UN(n) static kiln_tensor *f_##n(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_##n(a); }
BIN(add) BIN(sub) BIN(mul) BIN(div) BIN(maximum) BIN(minimum)
UN(neg) UN(abs) UN(exp) UN(tanh) UN(sigmoid) UN(relu) UN(gelu) UN(gelu_erf) UN(erf) UN(sin) UN(cos)
static kiln_tensor *f_pow(kiln_tensor *a, kiln_tensor *b) { return kiln_pow(kiln_abs(a), b); }
static kiln_tensor *f_log(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_log(kiln_abs(a)); }
static kiln_tensor *f_sqrt(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_sqrt(kiln_abs(a)); }
static kiln_tensor *f_rsqrt(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_rsqrt(kiln_add(kiln_abs(a), kiln_scalar(KILN_F32, 1))); }
static kiln_tensor *f_cmp(kiln_tensor *a, kiln_tensor *b) {
  return kiln_where(kiln_lt(a, b), kiln_cast(kiln_eq(a, a), KILN_F32), kiln_cast(kiln_ge(a, b), KILN_F32));
}
static kiln_tensor *f_sum(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_sum(a, 1, true); }
static kiln_tensor *f_mean(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_mean(a, 0, false); }
static kiln_tensor *f_max(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_max(a, -1, false); }
static kiln_tensor *f_min(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_min_axes(a, NULL, 0, false); }
static kiln_tensor *f_argmax(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_cast(kiln_argmax(a, 1, false), KILN_F32); }
static kiln_tensor *f_var(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_var(a, 1, 1, false); }
static kiln_tensor *f_matmul(kiln_tensor *a, kiln_tensor *b) { return kiln_matmul(a, kiln_transpose(b, 0, 1)); }
static kiln_tensor *f_softmax(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_softmax(a, 1); }
static kiln_tensor *f_logsm(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_log_softmax(a, 0); }
static kiln_tensor *f_ln(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_layer_norm(a, NULL, NULL, 1e-5); }
static kiln_tensor *f_views(kiln_tensor *a, kiln_tensor *b) {
  kiln_tensor *t = kiln_slice(kiln_permute(a, ((int[]){1, 0})), 0, 1, -1, 2);
  kiln_tensor *col = kiln_transpose(kiln_slice(b, 1, 0, 1, 1), 0, 1); /* (1, 5) */
  return kiln_add(kiln_contiguous(t), kiln_expand(kiln_slice(col, 1, 0, 1, 1), 2, ((int64_t[]){kiln_size(t, 0), kiln_size(t, 1)})));
}
static kiln_tensor *f_cat(kiln_tensor *a, kiln_tensor *b) { return kiln_stack(((kiln_tensor *[]){a, b, a}), 3, 1); }
static kiln_tensor *f_squeeze(kiln_tensor *a, kiln_tensor *b) { (void)b; return kiln_squeeze(kiln_unsqueeze(a, 1), 1); }
static kiln_tensor *f_index(kiln_tensor *a, kiln_tensor *b) {
  (void)b;
  int64_t idx[3] = {2, 0, 2};
  kiln_tensor *i = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){3}), idx);
  return kiln_index_select(a, 0, i);
}
static kiln_tensor *f_ce(kiln_tensor *a, kiln_tensor *b) {
  (void)b;
  int64_t tv[5] = {0, 3, 1, 6, 2};
  kiln_tensor *t = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){5}), tv);
  return kiln_cross_entropy(a, t);
}

static const op_case op_cases[] = {
    {"add", f_add}, {"sub", f_sub}, {"mul", f_mul}, {"div", f_div}, {"maximum", f_maximum}, {"minimum", f_minimum},
    {"pow", f_pow}, {"neg", f_neg}, {"abs", f_abs}, {"exp", f_exp}, {"log", f_log}, {"sqrt", f_sqrt}, {"rsqrt", f_rsqrt},
    {"tanh", f_tanh}, {"sigmoid", f_sigmoid}, {"relu", f_relu}, {"gelu", f_gelu}, {"gelu_erf", f_gelu_erf}, {"erf", f_erf},
    {"sin", f_sin}, {"cos", f_cos}, {"compare/where/cast", f_cmp}, {"sum", f_sum}, {"mean", f_mean}, {"max", f_max},
    {"min", f_min}, {"argmax", f_argmax}, {"var", f_var}, {"matmul", f_matmul}, {"softmax", f_softmax},
    {"log_softmax", f_logsm}, {"layer_norm", f_ln}, {"views", f_views}, {"cat/stack", f_cat}, {"squeeze", f_squeeze},
    {"index_select", f_index}, {"cross_entropy", f_ce},
};

static int op_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const op_case *c = ctx;
  out[0] = c->f(in[0], in[1]);
  return out[0] ? 0 : -1;
}

/* and the gradient of each differentiable op, traced */
static int op_grad_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const op_case *c = ctx;
  kiln_tensor *y = c->f(in[0], in[1]);
  if (!y) return -1;
  kiln_tensor *loss = kiln_sum_all(kiln_mul(y, y));
  kiln_tensor *g[2] = {0};
  if (kiln_grad_of(loss, (kiln_tensor *const *)in, 2, g)) return -1;
  out[0] = g[0], out[1] = g[1];
  return 0;
}

START_TEST(test_every_op_replays) {
  const op_case *c = &op_cases[_i];
  for (int grad = 0; grad < 2; grad++) {
    bool differentiable = strcmp(c->name, "argmax") && strcmp(c->name, "compare/where/cast");
    if (grad && !differentiable) continue;
    kiln_options o = {.name = c->name, .n_in = 2, .n_out = grad ? 2 : 1};
    kiln_fn *fn = kiln_compile(grad ? op_grad_body : op_body, (void *)c, &o);
    for (int call = 0; call < 3; call++) {
      kiln_scope_begin();
      int64_t s[2] = {5, 7};
      kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, s, 10 + call), kiln_randn(KILN_F32, 2, s, 20 + call)};
      if (grad) kiln_requires_grad(in[0], true), kiln_requires_grad(in[1], true);
      kiln_tensor *y[2] = {0}, *ref[2] = {0};
      ck_assert_msg(kiln_call(fn, in, y) == 0, "%s: %s", c->name, kiln_last_error());
      ck_assert_msg((grad ? op_grad_body : op_body)((void *)c, in, ref) == 0, "%s", kiln_last_error());
      for (int k = 0; k < (grad ? 2 : 1); k++) {
        double d = maxdiff(y[k], ref[k]);
        ck_assert_msg(d <= 1e-5, "%s%s call %d output %d: max diff %g", c->name, grad ? " (grad)" : "", call, k, d);
      }
      kiln_scope_end();
    }
    kiln_fn_stats st;
    kiln_fn_get_stats(fn, &st);
    ck_assert_msg(st.traces == 1 && st.hits == 2, "%s: traces %lld hits %lld", c->name, (long long)st.traces, (long long)st.hits);
    kiln_fn_free(fn);
  }
}
END_TEST

/* ---- check mode ---- */

START_TEST(test_check_mode) {
  mlp a;
  mlp_init(&a, 8, 16, 4, true);
  kiln_options o = {.name = "train", .n_in = 2, .n_out = 1, .check = 1};
  kiln_fn *fn = kiln_compile(train_body, &a, &o);
  kiln_scope_begin();
  kiln_tensor *w1_start = kiln_keep(kiln_mul(a.w1, kiln_scalar(KILN_F32, 1))); /* a copy */
  kiln_scope_end();
  for (int step = 0; step < 3; step++) {
    kiln_scope_begin();
    kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, ((int64_t[]){10, 8}), step), kiln_randn(KILN_F32, 2, ((int64_t[]){10, 4}), 9)};
    kiln_tensor *loss = NULL;
    ck_assert_msg(kiln_call(fn, in, &loss) == 0, "%s", kiln_last_error());
    kiln_scope_end();
  }
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(2, st.hits);
  ck_assert_int_eq(0, st.check_fails);
  /* three steps happened, not five: the eager check run does not update twice */
  mlp b;
  mlp_init(&b, 8, 16, 4, true);
  for (int step = 0; step < 3; step++) {
    kiln_scope_begin();
    train_step(&b, kiln_randn(KILN_F32, 2, ((int64_t[]){10, 8}), step), kiln_randn(KILN_F32, 2, ((int64_t[]){10, 4}), 9));
    kiln_scope_end();
  }
  ck_assert_double_le(maxdiff(a.w1, b.w1), 1e-5);
  ck_assert_double_gt(maxdiff(a.w1, w1_start), 1e-4);
  kiln_release(w1_start);
  kiln_fn_free(fn);
  mlp_free(&a), mlp_free(&b);
}
END_TEST

/* ---- threads: one kiln_fn, many callers, new sizes at once ---- */

typedef struct tjob {
  kiln_fn *fn;
  mlp *m;
  int seed;
  int bad;
} tjob;

static void *caller(void *arg) {
  tjob *j = arg;
  for (int i = 0; i < 30; i++) {
    kiln_scope_begin();
    int64_t s[2] = {1 + (j->seed * 7 + i * 3) % 17, 16};
    kiln_tensor *x = kiln_randn(KILN_F32, 2, s, (uint64_t)(j->seed * 1000 + i)), *y = NULL;
    if (kiln_call(j->fn, &x, &y) || maxdiff(y, mlp_forward(j->m, x)) > 1e-5) j->bad++;
    /* and eager work of its own meanwhile */
    if (!kiln_softmax(kiln_randn(KILN_F32, 2, ((int64_t[]){8, 8}), 3), 1)) j->bad++;
    kiln_scope_end();
  }
  return NULL;
}

START_TEST(test_threads_share_fn) {
  mlp m;
  mlp_init(&m, 16, 32, 8, false);
  kiln_options o = {.name = "mlp", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(mlp_body, &m, &o);
  pthread_t th[4];
  tjob jobs[4];
  for (int i = 0; i < 4; i++) {
    jobs[i] = (tjob){fn, &m, i, 0};
    pthread_create(&th[i], NULL, caller, &jobs[i]);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(th[i], NULL);
    ck_assert_int_eq(0, jobs[i].bad);
  }
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(120, st.calls);
  ck_assert_int_le(st.variants, 8);
  kiln_fn_free(fn);
  mlp_free(&m);
}
END_TEST

/* ---- errors ---- */

START_TEST(test_errors_name_the_caller) {
  kiln_options o = {.name = "add", .n_in = 2, .n_out = 1};
  kiln_fn *fn = kiln_compile(add_body, NULL, &o);
  kiln_tensor *in[2] = {NULL, NULL}, *y = NULL;
  kiln_clear_error(); /* a NULL input keeps an earlier op's message (err_null): start from none */
  int line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_call(fn, in, &y));
  char want[64];
  snprintf(want, sizeof want, "test_compile.c:%d: kiln_call", line);
  ck_assert_msg(has(kiln_last_error(), want), "%s", kiln_last_error());
  /* a shape error inside the body names the body's line, on the first call and on later ones */
  kiln_scope_begin();
  kiln_tensor *a = kiln_randn(KILN_F32, 1, ((int64_t[]){3}), 1), *b = kiln_randn(KILN_F32, 1, ((int64_t[]){4}), 1);
  in[0] = a, in[1] = b;
  kiln_clear_error();
  ck_assert_int_eq(-1, kiln_call(fn, in, &y));
  ck_assert_msg(has(kiln_last_error(), "kiln_mul: shapes [3] and [4]"), "%s", kiln_last_error());
  kiln_scope_end();
#ifdef KILN_TEST_BUILD
  /* a compiled call that fails deep in its run (out of memory) names a line
   * of the caller: the call's, or (interpreter) the body's node */
  kiln_scope_begin();
  in[0] = kiln_randn(KILN_F32, 1, ((int64_t[]){3}), 1), in[1] = kiln_randn(KILN_F32, 1, ((int64_t[]){3}), 2);
  ck_assert_int_eq(0, kiln_call(fn, in, &y));
  int failed = 0;
  for (int n = 1; n < 64; n++) {
    alloc_fail_after(n);
    line = __LINE__ + 1;
    int rc = kiln_call(fn, in, &y);
    alloc_fail_after(0);
    if (rc == 0) break;
    snprintf(want, sizeof want, "test_compile.c:%d: kiln_", line);
    ck_assert_msg(has(kiln_last_error(), want) || (getenv("KILN_BACKEND") && has(kiln_last_error(), "test_compile.c:")),
                  "n=%d: %s", n, kiln_last_error());
    failed++;
  }
  ck_assert_int_ge(failed, 1);
  kiln_scope_end();
#endif
  ck_assert_ptr_null(kiln_compile(NULL, NULL, &o));
  o.n_out = -1;
  ck_assert_ptr_null(kiln_compile(add_body, NULL, &o));
  ck_assert_msg(has(kiln_last_error(), "n_out"), "%s", kiln_last_error());
  kiln_fn_free(fn);
}
END_TEST

/* mode 0: x + 1; 1: returns -1 with no error of its own; 2: returns 0 and leaves out[0] NULL */
static int flaky_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  int mode = *(const int *)ctx;
  if (mode == 1) return -1;
  if (mode == 2) return 0;
  out[0] = kiln_add(in[0], kiln_scalar(KILN_F32, 1));
  return out[0] ? 0 : -1;
}

/* "test_compile.c:<line>: kiln_<fn>: " and what in the last error */
static void expect_at(int line, const char *fn, const char *what) {
  char want[128];
  snprintf(want, sizeof want, "test_compile.c:%d: %s: ", line, fn);
  ck_assert_msg(has(kiln_last_error(), want), "wanted %s: %s", want, kiln_last_error());
  ck_assert_msg(has(kiln_last_error(), what), "wanted %s: %s", what, kiln_last_error());
}

/* Errors of the calls on a kiln_fn name the line of that call, not the line
 * of kiln_compile. */
START_TEST(test_fn_errors_name_the_call) {
  int mode = 1;
  kiln_options o = {.name = "flaky", .n_in = 1, .n_out = 1, .dynamic = KILN_DYNAMIC_STATIC, .max_variants = 1};
  kiln_fn *fn = kiln_compile(flaky_body, &mode, &o);
  int line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_save(fn, "never-written.ir"));
  expect_at(line, "kiln_save", "has no compiled variant yet");
  line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_mark_dynamic(fn, 1, 0));
  expect_at(line, "kiln_mark_dynamic", "out of range");
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_fn_graph(fn, 0));
  expect_at(line, "kiln_fn_graph", "has no variant 0");

  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_F32, 1, (int64_t[]){3}), *y = NULL;
  /* an older, unrelated error is not taken for the body's */
  ck_assert_ptr_null(kiln_reshape(x, 1, (int64_t[]){4}));
  line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_call(fn, &x, &y)); /* traces: the body fails */
  expect_at(line, "kiln_call", "flaky: the body returned -1");
  mode = 2;
  line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_call(fn, &x, &y));
  expect_at(line, "kiln_call", "flaky: the body returned 0 but left output 0 NULL");
  mode = 0;
  ck_assert_int_eq(0, kiln_call(fn, &x, &y)); /* the one variant the cap allows */
  ck_assert_double_eq(2, kiln_item(kiln_sum_all(y)) / 3);
  line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_save(fn, "/nonexistent-dir/x.ir"));
  expect_at(line, "kiln_save", "cannot open /nonexistent-dir/x.ir");
  /* past the cap, a new size runs the body eagerly: the same messages there */
  kiln_tensor *x4 = kiln_ones(KILN_F32, 1, (int64_t[]){4});
  mode = 1;
  line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_call(fn, &x4, &y));
  expect_at(line, "kiln_call", "flaky: the body returned -1");
  mode = 2;
  line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_call(fn, &x4, &y));
  expect_at(line, "kiln_call", "flaky: the body returned 0 but left output 0 NULL");
  kiln_scope_end();
  kiln_fn_free(fn);
  line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_mark_dynamic(fn, 0, 0));
  expect_at(line, "kiln_mark_dynamic", "fn was freed");
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_load("/nonexistent-dir/x.ir"));
  expect_at(line, "kiln_load", "cannot open");
}
END_TEST

/* three ones: no inputs, one output */
static int ones_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx, (void)in;
  out[0] = kiln_mul(kiln_ones(KILN_F32, 1, (int64_t[]){3}), kiln_scalar(KILN_F32, 2));
  return out[0] ? 0 : -1;
}

/* opts = NULL is every default, as zero is for each field: no inputs, one
 * output; and n_out = 0 is one output. */
START_TEST(test_null_options) {
  kiln_fn *fn = kiln_compile(ones_body, NULL, NULL);
  ck_assert_msg(fn != NULL, "%s", kiln_last_error());
  kiln_fn *fn0 = kiln_compile(ones_body, NULL, &(kiln_options){.name = "zero"});
  ck_assert_msg(fn0 != NULL, "%s", kiln_last_error());
  kiln_scope_begin();
  for (int i = 0; i < 3; i++) { /* a trace, then hits */
    kiln_tensor *y = NULL, *y0 = NULL;
    ck_assert_int_eq(0, kiln_call(fn, NULL, &y));
    ck_assert_int_eq(0, kiln_call(fn0, NULL, &y0));
    ck_assert_int_eq(3, kiln_numel(y));
    ck_assert_double_eq(6, kiln_item(kiln_sum_all(y)));
    ck_assert_double_eq(6, kiln_item(kiln_sum_all(y0)));
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.traces);
  ck_assert_int_eq(2, st.hits);
  char *g = kiln_fn_graph(fn, 0);
  ck_assert_msg(g && has(g, "graph fn("), "%s", g ? g : kiln_last_error()); /* the default name */
  free(g);
  kiln_scope_end();
  kiln_fn_free(fn);
  kiln_fn_free(fn0);
}
END_TEST

/* ---- regressions: each once gave a wrong answer compiled ---- */

static int reg_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  int which = *(const int *)ctx;
  kiln_tensor *x = in[0], *w = in[1];
  switch (which) {
  case 0: out[0] = kiln_sum(kiln_mul(x, w), 1, false); break;                    /* a lower-rank operand under keepdim=false */
  case 1: { /* a nested keepdim=false reduce (on a square matrix, where it broadcasts along the other dim) */
    kiln_tensor *sq = kiln_matmul(kiln_transpose(x, 0, 1), x);
    out[0] = kiln_sum(kiln_sub(sq, kiln_max(sq, 1, false)), 1, false);
    break;
  }
  case 2: out[0] = kiln_reshape(kiln_transpose(x, 0, 1), 1, ((int64_t[]){-1}));   /* an output in a copy buffer */
    out[1] = kiln_sum_all(kiln_exp(kiln_matmul(kiln_relu(kiln_mul(x, x)), kiln_transpose(x, 0, 1))));
    return out[0] && out[1] ? 0 : -1;
  case 3: { /* the mean's gradient after a trace at size 1 */
    kiln_tensor *g = NULL;
    kiln_tensor *loss = kiln_mean_all(kiln_mul(x, x));
    if (!loss || kiln_grad_of(loss, &x, 1, &g)) return -1;
    out[0] = g;
    break;
  }
  case 4: out[0] = kiln_sum_all(kiln_mul(kiln_ones(KILN_F32, 2, ((int64_t[]){kiln_size(x, 0), kiln_size(x, 1)})), x)); break;
  case 5: { /* labels differ on every call */
    kiln_tensor *t = kiln_cast(kiln_gt(kiln_sum(x, 1, false), kiln_scalar(KILN_F32, 0)), KILN_I64);
    out[0] = kiln_cross_entropy(x, t);
    break;
  }
  case 6: out[0] = kiln_sum(kiln_add(kiln_sum(x, 1, true), w), 1, false); break;  /* (N,1) + (C,) under a reduction */
  case 7: out[0] = kiln_reshape(x, 2, ((int64_t[]){2, -1})); break;              /* a literal 2, never the batch */
  case 8: out[0] = kiln_slice(x, 0, 0, 3, 1); break;                              /* a literal bound, never the batch */
  }
  if (which != 2) out[1] = kiln_sum_all(x);
  return out[0] ? 0 : -1;
}

START_TEST(test_regressions) {
  int64_t rows[] = {4, 2, 3, 6, 4};
  for (int which = 0; which < 9; which++) {
    kiln_options o = {.name = "reg", .n_in = 2, .n_out = 2};
    kiln_fn *fn = kiln_compile(reg_body, &which, &o);
    for (int i = 0; i < 5; i++) {
      kiln_scope_begin();
      int64_t n = rows[i], c = 4;
      kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){n, c}), 10 + (uint64_t)i), *w = kiln_randn(KILN_F32, 1, ((int64_t[]){c}), 20);
      if (which == 3) kiln_requires_grad(x, true);
      kiln_tensor *in[2] = {x, w}, *y[2] = {0}, *ref[2] = {0};
      ck_assert_msg(kiln_call(fn, in, y) == 0, "case %d call %d: %s", which, i, kiln_last_error());
      ck_assert_int_eq(0, reg_body(&which, in, ref));
      for (int k = 0; k < 2; k++) {
        /* relative: compiled code sums in another order than eager */
        double d = maxdiff(y[k], ref[k]), scale = 1 + maxdiff(ref[k], kiln_mul(ref[k], kiln_scalar(KILN_F32, 0)));
        ck_assert_msg(d <= 1e-5 * scale, "case %d call %d (rows %lld) output %d: max diff %g (scale %g)", which, i, (long long)n, k, d, scale);
      }
      kiln_scope_end();
    }
    kiln_fn_free(fn);
  }
}
END_TEST

/* sizes the body reads with kiln_size stay symbolic where it passes them back */
static int pos_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor *table = ctx; /* (16, 4): positions */
  int64_t t = kiln_size(in[0], 0);
  out[0] = kiln_add(in[0], kiln_slice(table, 0, 0, t, 1)); /* x + table[:T] */
  return out[0] ? 0 : -1;
}

START_TEST(test_read_sizes_stay_symbolic) {
  kiln_tensor *table = kiln_randn(KILN_F32, 2, ((int64_t[]){16, 4}), 3);
  kiln_options o = {.name = "pos", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(pos_body, table, &o);
  for (int64_t t = 5; t <= 12; t++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){t, 4}), (uint64_t)t), *y = NULL, *ref = NULL;
    ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
    ck_assert_int_eq(0, pos_body(table, &x, &ref));
    ck_assert_double_le(maxdiff(y, ref), 0);
    kiln_scope_end();
  }
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(2, st.traces); /* T=5 static, then one symbolic variant for T=6..12 */
  kiln_fn_free(fn);
  kiln_release(table);
}
END_TEST

/* a factory size two read sizes share when traced (2*s0 and 2*s1 are both 32
 * at B=16): once it lost both guards, and B=7 got the 32 rows of the trace */
static int shared_size_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0], *y = in[1];
  int64_t n = kiln_size(kiln_cat(((kiln_tensor *[]){x, x}), 2, 0), 0); /* 2*s0 */
  int64_t m = kiln_size(kiln_cat(((kiln_tensor *[]){y, y}), 2, 0), 0); /* 2*s1 */
  kiln_tensor *z = kiln_zeros(KILN_F32, 2, ((int64_t[]){n, kiln_size(x, 1)}));
  kiln_copy_(z, kiln_slice(x, 0, 0, 1, 1)); /* (1,C) over (2B,C): meets no symbolic size */
  out[0] = kiln_add(z, kiln_mean_all(y));
  out[1] = kiln_add(kiln_zeros(KILN_F32, 1, ((int64_t[]){m})), kiln_mean_all(x));
  return out[0] && out[1] ? 0 : -1;
}

START_TEST(test_shared_read_size_guarded) {
  kiln_options o = {.name = "shared", .n_in = 2, .n_out = 2};
  kiln_fn *fn = kiln_compile(shared_size_body, NULL, &o);
  int64_t batch[] = {5, 16, 7, 16, 9};
  for (int i = 0; i < 5; i++) {
    kiln_scope_begin();
    int64_t b = batch[i];
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){b, 3}), 30 + (uint64_t)i);
    kiln_tensor *y = kiln_randn(KILN_F32, 2, ((int64_t[]){b, 1}), 40 + (uint64_t)i);
    kiln_tensor *in[2] = {x, y}, *got[2] = {0}, *ref[2] = {0};
    ck_assert_msg(kiln_call(fn, in, got) == 0, "B=%lld: %s", (long long)b, kiln_last_error());
    ck_assert_int_eq(0, shared_size_body(NULL, in, ref));
    ck_assert_int_eq(2 * b, kiln_size(got[0], 0));
    ck_assert_int_eq(2 * b, kiln_size(got[1], 0));
    for (int k = 0; k < 2; k++) ck_assert_msg(maxdiff(got[k], ref[k]) <= 1e-6, "B=%lld output %d", (long long)b, k);
    kiln_scope_end();
  }
  kiln_fn_free(fn);
}
END_TEST

/* ---- freeze, dumps ---- */

START_TEST(test_freeze_and_dump_dir) {
  mlp m;
  mlp_init(&m, 4, 8, 2, false);
  char dir[] = "/tmp/kiln_dumpXXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  setenv("KILN_DUMP_DIR", dir, 1);
  kiln_options o = {.name = "frozen", .n_in = 1, .n_out = 1, .freeze = 1,
                    .dump = KILN_DUMP_TRACE | KILN_DUMP_GRAPH | KILN_DUMP_GUARDS | KILN_DUMP_RECOMPILES | KILN_DUMP_KERNELS};
  kiln_fn *fn = kiln_compile(mlp_body, &m, &o);
  unsetenv("KILN_DUMP_DIR");
  for (int b = 3; b <= 4; b++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){b, 4}), 1), *y = NULL;
    ck_assert_int_eq(0, kiln_call(fn, &x, &y));
    ck_assert_double_le(maxdiff(y, mlp_forward(&m, x)), 1e-5);
    kiln_scope_end();
  }
  char *text = kiln_fn_graph(fn, 1);
  ck_assert_ptr_nonnull(text);
  ck_assert(!has(text, "@param"));    /* the weights are constants now */
  ck_assert(has(text, "= const("));
  free(text);
  /* the dumps went to files, one per kind and variant, and the recompile says why */
  const char *kinds[] = {"frozen.1.trace.txt", "frozen.2.graph.txt", "frozen.2.guards.txt", "frozen.recompiles.txt",
                         "frozen.2.kernels.txt", "frozen.1.kernels.txt"};
  bool llvm = !getenv("KILN_BACKEND") || strcmp(getenv("KILN_BACKEND"), "interp");
  const char *want[] = {"graph frozen(%0: f32[3,4])", "f32[s0,4]", "s0 in [1,", "input 0 dim 0: traced 3, got 4", "kernels of frozen",
                        "kernels of frozen"};
  for (int i = 0; i < (llvm ? 6 : 4); i++) {
    char path[256], buf[4096] = "";
    snprintf(path, sizeof path, "%s/%s", dir, kinds[i]);
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s missing", path);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    ck_assert_msg(has(buf, want[i]), "%s lacks '%s'", kinds[i], want[i]);
    unlink(path);
  }
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  ck_assert_int_eq(0, system(cmd));
  kiln_fn_free(fn);
  mlp_free(&m);
}
END_TEST

/* a released weight is noticed: the variant that captured it does not run
 * (_i 1: in check mode too, whose snapshot must not keep it alive) */
START_TEST(test_released_param_retraces) {
  mlp m;
  mlp_init(&m, 4, 8, 2, false);
  kiln_options o = {.name = "mlp", .n_in = 1, .n_out = 1, .check = _i};
  kiln_fn *fn = kiln_compile(mlp_body, &m, &o);
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 4}), 1), *y = NULL;
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  /* new weights in the struct, the old ones released */
  kiln_release(m.w2);
  m.w2 = kiln_keep(kiln_randn(KILN_F32, 2, ((int64_t[]){8, 2}), 77));
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  ck_assert_double_le(maxdiff(y, mlp_forward(&m, x)), 1e-5);
  kiln_scope_end();
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(2, st.traces);
  ck_assert_int_eq(1, st.variants); /* the variant that held the old weight is gone */
  /* replacing weights again and again never reaches the cap */
  for (int i = 0; i < 12; i++) {
    kiln_scope_begin();
    kiln_release(m.w1);
    m.w1 = kiln_keep(kiln_randn(KILN_F32, 2, ((int64_t[]){4, 8}), 100 + (uint64_t)i));
    kiln_tensor *xi = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 4}), 1), *yi = NULL;
    ck_assert_int_eq(0, kiln_call(fn, &xi, &yi));
    ck_assert_double_le(maxdiff(yi, mlp_forward(&m, xi)), 1e-5);
    kiln_scope_end();
  }
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(0, st.fallbacks);
  ck_assert_int_eq(1, st.variants);
  ck_assert_int_eq(0, st.check_fails);
  kiln_fn_free(fn);
  mlp_free(&m);
}
END_TEST

/* ---- the guard-only path of a batch-1 call ---- */

typedef struct {
  kiln_tensor *w;
  bool t; /* w is (out,in): x @ w^T */
} captured_mv;

static int captured_mv_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  captured_mv *c = ctx;
  out[0] = kiln_matmul(in[0], c->t ? kiln_transpose(c->w, 0, 1) : c->w);
  return out[0] ? 0 : -1;
}

/* A batch-1 matvec over a captured weight (the bench's M1), in both
 * layouts, called until it runs on the guard-only path: that path reads the
 * variant's input nodes and the exec's leaf list rather than every node, and
 * a graph without intermediates plans no arena. Later calls that differ are
 * still caught, each at the call where it first differs: another row count,
 * another rank, and an input that is a row of the weight itself (sharing its
 * storage); each result against eager. Then the same graph saved and loaded
 * (no body to retrace): hits, and a wrong size or dtype refused, after hits. */
START_TEST(test_guard_path_after_hits) {
  for (int t = 0; t < 2; t++) {
    kiln_scope_begin();
    captured_mv c = {kiln_randn(KILN_F32, 2, ((int64_t[]){24, 24}), 5), t == 1};
    kiln_options o = {.name = "m1", .n_in = 1, .n_out = 1};
    kiln_fn *fn = kiln_compile(captured_mv_body, &c, &o);
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){1, 24}), 6);
    kiln_tensor *x3 = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 24}), 7);
    kiln_tensor *x1d = kiln_randn(KILN_F32, 1, ((int64_t[]){24}), 8);
    kiln_tensor *xw = kiln_slice(c.w, 0, 2, 3, 1); /* (1,24), the weight's own storage */
    kiln_tensor *cases[] = {x, x, x, x, x3, x1d, x1d, xw, xw, x};
    /* what each call is: a trace (1) or a hit on the guard-only path (0) */
    int traced[] = {1, 0, 0, 0, 1, 1, 0, 1, 0, 0};
    kiln_fn_stats st;
    for (int i = 0; i < 10; i++) {
      kiln_fn_get_stats(fn, &st);
      long long traces = st.traces, hits = st.guard_hits;
      kiln_tensor *y = NULL, *ref = NULL;
      ck_assert_msg(kiln_call(fn, &cases[i], &y) == 0, "call %d: %s", i, kiln_last_error());
      ck_assert_int_eq(0, captured_mv_body(&c, &cases[i], &ref));
      ck_assert_int_eq(kiln_ndim(ref), kiln_ndim(y));
      ck_assert_double_le(maxdiff(y, ref), 1e-5);
      kiln_fn_get_stats(fn, &st);
      ck_assert_msg(st.traces - traces == traced[i] && st.guard_hits - hits == 1 - traced[i],
                    "t %d call %d: traces +%lld, guard hits +%lld", t, i, st.traces - traces, st.guard_hits - hits);
    }
    ck_assert_int_eq(0, st.fallbacks);

    char path[] = "/tmp/kiln_test_m1XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    ck_assert_msg(kiln_save(fn, path) == 0, "%s", kiln_last_error()); /* the newest variant: x's */
    kiln_fn *ld = kiln_load(path);
    unlink(path);
    ck_assert_msg(ld != NULL, "%s", kiln_last_error());
    kiln_tensor *in[2] = {x, c.w}, *y = NULL, *ref = NULL;
    ck_assert_int_eq(0, captured_mv_body(&c, &x, &ref));
    for (int i = 0; i < 3; i++) {
      ck_assert_msg(kiln_call(ld, in, &y) == 0, "%s", kiln_last_error());
      ck_assert_double_le(maxdiff(y, ref), 1e-5);
    }
    kiln_tensor *bad[][2] = {{x3, c.w}, {kiln_cast(x, KILN_F64), c.w}, {x, kiln_slice(c.w, 0, 0, 23, 1)}};
    for (int i = 0; i < 3; i++) {
      y = NULL;
      ck_assert_int_eq(-1, kiln_call(ld, bad[i], &y));
      ck_assert_ptr_null(y);
      ck_assert_msg(has(kiln_last_error(), "does not fit the loaded graph"), "bad call %d: %s", i, kiln_last_error());
    }
    ck_assert_msg(kiln_call(ld, in, &y) == 0, "%s", kiln_last_error());
    kiln_fn_free(ld);
    kiln_fn_free(fn);
    kiln_scope_end();
  }
  /* an input sized by an expression: the guard path leaves it to the run's
   * binding (over the leaf list), which refuses it after hits */
  kiln_fn *ld = kiln_load_string("graph e(%0: f32[s0], %1: f32[2*s0]) -> (%3)\n  sym s0 in [1, 1000]\n"
                                 "  %2: f32[2*s0] = cat(%0, %0) {dim=0}\n  %3: f32[2*s0] = add(%2, %1)\n");
  ck_assert_msg(ld != NULL, "%s", kiln_last_error());
  kiln_scope_begin();
  kiln_tensor *a = kiln_randn(KILN_F32, 1, ((int64_t[]){5}), 1), *in[2] = {a, kiln_randn(KILN_F32, 1, ((int64_t[]){10}), 2)};
  kiln_tensor *y = NULL;
  for (int i = 0; i < 3; i++) ck_assert_msg(kiln_call(ld, in, &y) == 0, "%s", kiln_last_error());
  ck_assert_double_le(maxdiff(y, kiln_add(kiln_cat(KILN_TENSORS(a, a), 0), in[1])), 1e-6);
  in[1] = kiln_randn(KILN_F32, 1, ((int64_t[]){11}), 3);
  y = NULL;
  ck_assert_int_eq(-1, kiln_call(ld, in, &y));
  ck_assert_ptr_null(y);
  ck_assert_msg(has(kiln_last_error(), "does not fit the graph's size expression"), "%s", kiln_last_error());
  kiln_scope_end();
  kiln_fn_free(ld);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("compile");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_mlp_dynamic_batch);
  tcase_add_test(tc, test_reshape_stays_symbolic);
  tcase_add_test(tc, test_guards_retrace);
  tcase_add_test(tc, test_cap_falls_back);
  tcase_add_test(tc, test_value_dependent_breaks);
  tcase_add_test(tc, test_bad_targets_compiled);
  tcase_add_loop_test(tc, test_index_checks_every_call, 0, 18);
  tcase_add_loop_test(tc, test_index_written_in_body, 0, 6);
  tcase_add_loop_test(tc, test_failed_call_writes_nothing_after, 0, 12);
  tcase_add_loop_test(tc, test_kept_without_data, 0, 2);
  tcase_add_test(tc, test_training_step_matches_eager);
  tcase_add_test(tc, test_grad_accumulates);
  tcase_add_test(tc, test_training_dynamic_batch);
  tcase_add_test(tc, test_var_dynamic);
  tcase_add_test(tc, test_outputs_alias_inputs);
  tcase_add_loop_test(tc, test_inplace_and_alias_guard, 0, 2);
  tcase_add_test(tc, test_write_with_live_view);
  tcase_add_test(tc, test_save_load);
  tcase_add_test(tc, test_check_mode_loaded_then_checked);
  tcase_add_test(tc, test_load_rejects_bad_text);
  tcase_add_loop_test(tc, test_every_op_replays, 0, (int)(sizeof op_cases / sizeof *op_cases));
  tcase_add_test(tc, test_check_mode);
  tcase_add_test(tc, test_threads_share_fn);
  tcase_add_test(tc, test_errors_name_the_caller);
  tcase_add_test(tc, test_fn_errors_name_the_call);
  tcase_add_test(tc, test_null_options);
  tcase_add_test(tc, test_freeze_and_dump_dir);
  tcase_add_test(tc, test_regressions);
  tcase_add_test(tc, test_read_sizes_stay_symbolic);
  tcase_add_test(tc, test_shared_read_size_guarded);
  tcase_add_loop_test(tc, test_released_param_retraces, 0, 2);
  tcase_add_test(tc, test_guard_path_after_hits);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *r = srunner_create(suite());
  srunner_run_all(r, CK_NORMAL);
  int failed = srunner_ntests_failed(r);
  srunner_free(r);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
