/* Structured control flow: kiln_cond, kiln_while_loop and kiln_scan.
 * Values against hand-unrolled C loops in double; gradients through cond and
 * scan against central finite differences in f64; the errors name the op,
 * the shapes and this file's line; inside a compiled function the results
 * match eager. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

/* the message names this file's line `line` and contains every `want` */
static void expect_error(int line, const char *w1, const char *w2, const char *w3) {
  const char *e = kiln_last_error();
  char loc[64];
  snprintf(loc, sizeof loc, "test_control.c:%d: ", line);
  ck_assert_msg(strstr(e, loc) != NULL, "expected %s in: %s", loc, e);
  const char *w[3] = {w1, w2, w3};
  for (int i = 0; i < 3; i++) ck_assert_msg(!w[i] || strstr(e, w[i]), "expected \"%s\" in: %s", w[i], e);
}

static void read_f64(const kiln_tensor *t, double *dst, int64_t n) {
  ck_assert_msg(t != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(n, kiln_numel(t));
  ck_assert_int_eq(0, kiln_read(kiln_cast((kiln_tensor *)t, KILN_F64), dst, sizeof(double) * (size_t)n));
}

static void close_all(const double *want, const double *got, int64_t n, double tol, const char *what) {
  for (int64_t i = 0; i < n; i++)
    ck_assert_msg(fabs(want[i] - got[i]) <= tol * (1 + fabs(want[i])), "%s at %lld: expected %.12g, got %.12g", what,
                  (long long)i, want[i], got[i]);
}

/* deterministic values in (-1, 1), independent of kiln's generator */
static void fill(double *d, int64_t n, unsigned seed) {
  uint64_t s = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    d[i] = (double)(s >> 11) * 0x1.0p-53 * 2 - 1;
  }
}

/* ---- cond ---- */

/* then: (a*b, a+b); else: (a-b, a*a) */
static int then_fn(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_mul(in[0], in[1]);
  out[1] = kiln_add(in[0], in[1]);
  return !out[0] || !out[1];
}
static int else_fn(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_sub(in[0], in[1]);
  out[1] = kiln_mul(in[0], in[0]);
  return !out[0] || !out[1];
}

START_TEST(test_cond_branches) {
  kiln_scope_begin();
  double a[3] = {1, 2, 3}, b[3] = {4, -5, 6};
  kiln_tensor *in[2] = {kiln_tensor_from(KILN_F64, 1, (int64_t[]){3}, a),
                        kiln_tensor_from(KILN_F64, 1, (int64_t[]){3}, b)};
  for (int p = 0; p < 2; p++) {
    kiln_tensor *out[2];
    /* the predicate is computed, as a user would: sum(a) > 5 or < 5 */
    kiln_tensor *s = kiln_sum_all(in[0]);
    kiln_tensor *pred = p ? kiln_gt(s, kiln_scalar(KILN_F64, 5)) : kiln_lt(s, kiln_scalar(KILN_F64, 5));
    ck_assert_int_eq(0, kiln_cond(pred, then_fn, else_fn, NULL, 2, in, 2, out));
    double g0[3], g1[3], w0[3], w1[3];
    for (int i = 0; i < 3; i++) {
      w0[i] = p ? a[i] * b[i] : a[i] - b[i];
      w1[i] = p ? a[i] + b[i] : a[i] * a[i];
    }
    read_f64(out[0], g0, 3);
    read_f64(out[1], g1, 3);
    close_all(w0, g0, 3, 0, "out 0");
    close_all(w1, g1, 3, 0, "out 1");
  }
  kiln_scope_end();
}
END_TEST

static int one_out_vec(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_add(in[0], in[0]));
}
static int one_out_sum(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_sum_all(in[0]));
}
static int fails_quietly(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx, (void)in, (void)out;
  return 7;
}
static int leaves_null(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx, (void)in, (void)out;
  return 0;
}

START_TEST(test_cond_errors) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_tensor_from(KILN_F32, 1, (int64_t[]){3}, (float[]){1, 2, 3}), *out[1];
  int l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_cond(x, one_out_vec, one_out_sum, NULL, 1, &x, 1, out));
  expect_error(l, "kiln_cond", "one-element bool", "f32[3]");
  kiln_tensor *two = kiln_tensor_from(KILN_BOOL, 1, (int64_t[]){2}, (bool[]){true, false});
  l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_cond(two, one_out_vec, one_out_sum, NULL, 1, &x, 1, out));
  expect_error(l, "kiln_cond", "bool[2]", NULL);
  ck_assert(out[0] == NULL);
  kiln_tensor *yes = kiln_scalar(KILN_BOOL, 1);
  l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_cond(yes, fails_quietly, one_out_sum, NULL, 1, &x, 1, out));
  expect_error(l, "kiln_cond", "then_fn returned 7", NULL);
  l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_cond(yes, leaves_null, one_out_sum, NULL, 1, &x, 1, out));
  expect_error(l, "kiln_cond", "out[0] NULL", NULL);
  kiln_clear_error(); /* a NULL argument keeps a pending message, as after a failed op */
  l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_cond(NULL, one_out_vec, one_out_sum, NULL, 1, &x, 1, out));
  expect_error(l, "kiln_cond", "pred is NULL", NULL);
  kiln_clear_error();
  l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_cond(yes, one_out_vec, one_out_sum, NULL, 1, (kiln_tensor *[]){NULL}, 1, out));
  expect_error(l, "kiln_cond", "in[0] is NULL", NULL);
  kiln_scope_end();
}
END_TEST

/* f(w) = sum(R * cond(sum(w) > 0, w*w, sin(w))) in f64; dL/dw by backward vs
 * central differences, at a w where each branch is taken. */
static int sq(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_mul(in[0], in[0]));
}
static int sn(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_sin(in[0]));
}
static double cond_loss(const double *w, const double *r, int n) {
  double s = 0, l = 0;
  for (int i = 0; i < n; i++) s += w[i];
  for (int i = 0; i < n; i++) l += r[i] * (s > 0 ? w[i] * w[i] : sin(w[i]));
  return l;
}

START_TEST(test_cond_gradient) {
  enum { N = 4 };
  for (int branch = 0; branch < 2; branch++) {
    kiln_scope_begin();
    double w[N], r[N], g[N];
    fill(w, N, 3);
    fill(r, N, 4);
    for (int i = 0; i < N; i++) w[i] += branch ? 1.0 : -1.0; /* sum > 0 or < 0 */
    kiln_tensor *tw = kiln_tensor_from(KILN_F64, 1, (int64_t[]){N}, w);
    kiln_requires_grad(tw, true);
    kiln_tensor *out[1];
    kiln_tensor *pred = kiln_gt(kiln_sum_all(tw), kiln_scalar(KILN_F64, 0));
    ck_assert_int_eq(0, kiln_cond(pred, sq, sn, NULL, 1, &tw, 1, out));
    kiln_tensor *loss = kiln_sum_all(kiln_mul(out[0], kiln_tensor_from(KILN_F64, 1, (int64_t[]){N}, r)));
    ck_assert_int_eq(0, kiln_backward(loss));
    read_f64(kiln_grad(tw), g, N);
    double fd[N];
    for (int i = 0; i < N; i++) {
      double wp[N], wm[N];
      memcpy(wp, w, sizeof w);
      memcpy(wm, w, sizeof w);
      wp[i] += 1e-6, wm[i] -= 1e-6;
      fd[i] = (cond_loss(wp, r, N) - cond_loss(wm, r, N)) / 2e-6;
    }
    close_all(fd, g, N, 1e-6, branch ? "d/dw through then_fn" : "d/dw through else_fn");
    kiln_scope_end();
  }
}
END_TEST

/* ---- while_loop ---- */

/* carry (i: i64, acc: f64); while i < *bound: i += 1, acc = acc * 2 + 1 */
typedef struct count_ctx {
  kiln_tensor *bound; /* i64 0-d, data-dependent */
} count_ctx;
static int below(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  count_ctx *c = ctx;
  return !(out[0] = kiln_lt(in[0], c->bound));
}
static int step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_add(in[0], kiln_scalar(KILN_I64, 1));
  out[1] = kiln_add(kiln_mul(in[1], kiln_scalar(KILN_F64, 2)), kiln_scalar(KILN_F64, 1));
  return !out[0] || !out[1];
}

START_TEST(test_while_counts_to_data_bound) {
  kiln_scope_begin();
  /* bound = number of positive entries of a tensor: known only from data */
  double v[7] = {0.5, -1, 2, 3, -4, 5, 0.25};
  kiln_tensor *data = kiln_tensor_from(KILN_F64, 1, (int64_t[]){7}, v);
  count_ctx c = {kiln_sum_all(kiln_cast(kiln_gt(data, kiln_scalar(KILN_F64, 0)), KILN_I64))};
  kiln_tensor *fin[2];
  ck_assert_int_eq(0, kiln_while_loop(below, step, &c, 2,
                                      (kiln_tensor *[]){kiln_scalar(KILN_I64, 0), kiln_scalar(KILN_F64, 0)}, fin));
  int64_t i;
  double acc;
  ck_assert_int_eq(0, kiln_read(fin[0], &i, sizeof i));
  ck_assert_int_eq(0, kiln_read(fin[1], &acc, sizeof acc));
  ck_assert_int_eq(5, i);        /* five positives */
  ck_assert(acc == 31.0);        /* 2^5 - 1 */
  ck_assert_int_eq(KILN_I64, kiln_type(fin[0]));
  /* a bound already reached: no step, the init comes back */
  c.bound = kiln_scalar(KILN_I64, -3);
  ck_assert_int_eq(0, kiln_while_loop(below, step, &c, 2,
                                      (kiln_tensor *[]){kiln_scalar(KILN_I64, 0), kiln_scalar(KILN_F64, 7)}, fin));
  ck_assert_int_eq(0, kiln_read(fin[1], &acc, sizeof acc));
  ck_assert(acc == 7.0);
  kiln_scope_end();
}
END_TEST

/* Eagerly, gradients flow through the steps a while_loop ran: carry (x, n),
 * x = sin(x) * w while n < 3, so L = sum(x_3); dL/dw against differences. */
typedef struct sinw {
  kiln_tensor *w;
} sinw;
static int under3(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_lt(in[1], kiln_scalar(KILN_I64, 3)));
}
static int sin_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  sinw *c = ctx;
  out[0] = kiln_mul(kiln_sin(in[0]), c->w);
  out[1] = kiln_add(in[1], kiln_scalar(KILN_I64, 1));
  return !out[0] || !out[1];
}
/* while_loop is forward only, as in JAX: a backward that reaches its
 * results fails, naming the loop's line; under no_grad it runs as ever. */
START_TEST(test_while_backward_is_an_error) {
  enum { N = 3 };
  double x0[N] = {0.3, -0.7, 1.1}, w[N] = {1.5, -0.5, 0.9};
  kiln_scope_begin();
  sinw c = {kiln_tensor_from(KILN_F64, 1, (int64_t[]){N}, w)};
  kiln_requires_grad(c.w, true);
  kiln_tensor *init[2] = {kiln_tensor_from(KILN_F64, 1, (int64_t[]){N}, x0), kiln_scalar(KILN_I64, 0)}, *fin[2];
  int line = __LINE__ + 1;
  ck_assert_int_eq(0, kiln_while_loop(under3, sin_step, &c, 2, init, fin));
  ck_assert(kiln_get_requires_grad(fin[0]));
  ck_assert_int_eq(-1, kiln_backward(kiln_sum_all(fin[0])));
  char where[64];
  snprintf(where, sizeof where, "test_control.c:%d", line);
  ck_assert_msg(strstr(kiln_last_error(), where) && strstr(kiln_last_error(), "forward only"), "%s", kiln_last_error());
  ck_assert(kiln_grad(c.w) == NULL);
  /* no step at all (the counter starts past the bound): still forward only */
  kiln_requires_grad(init[0], true);
  init[1] = kiln_scalar(KILN_I64, 5);
  ck_assert_int_eq(0, kiln_while_loop(under3, sin_step, &c, 2, init, fin));
  ck_assert_int_eq(-1, kiln_backward(kiln_sum_all(fin[0])));
  ck_assert(kiln_grad(init[0]) == NULL);
  /* the init it returned as is keeps its own flag */
  ck_assert(kiln_get_requires_grad(init[0]));
  /* under no_grad: no history, the loop's values as before */
  init[1] = kiln_scalar(KILN_I64, 0);
  kiln_no_grad_begin();
  ck_assert_int_eq(0, kiln_while_loop(under3, sin_step, &c, 2, init, fin));
  kiln_no_grad_end();
  ck_assert(!kiln_get_requires_grad(fin[0]));
  /* ... and no history even for an init it passed through, as compiled */
  init[1] = kiln_scalar(KILN_I64, 5);
  kiln_no_grad_begin();
  kiln_tensor *same[2];
  ck_assert_int_eq(0, kiln_while_loop(under3, sin_step, &c, 2, init, same));
  kiln_no_grad_end();
  ck_assert(!kiln_get_requires_grad(same[0]));
  double got[N];
  read_f64(fin[0], got, N);
  for (int i = 0; i < N; i++) {
    double x = x0[i];
    for (int k = 0; k < 3; k++) x = sin(x) * w[i];
    ck_assert_msg(fabs(got[i] - x) < 1e-12, "x[%d] = %.15g, want %.15g", i, got[i], x);
  }
  kiln_scope_end();
}
END_TEST

static int grows(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_cat((kiln_tensor *[]){in[0], in[0]}, 2, 0));
}
static int to_f32(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_cast(in[0], KILN_F32));
}
static int always(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx, (void)in;
  return !(out[0] = kiln_scalar(KILN_BOOL, 1));
}
static int not_bool(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_sum_all(in[0]));
}

START_TEST(test_while_errors) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_tensor_from(KILN_F64, 1, (int64_t[]){2}, (double[]){1, 2}), *fin[1];
  int l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_while_loop(always, grows, NULL, 1, &x, fin));
  expect_error(l, "kiln_while_loop", "body_fn's out 0 is f64[4]", "the carry is f64[2]");
  l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_while_loop(always, to_f32, NULL, 1, &x, fin));
  expect_error(l, "kiln_while_loop", "f32[2]", "f64[2]");
  l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_while_loop(not_bool, to_f32, NULL, 1, &x, fin));
  expect_error(l, "kiln_while_loop", "cond_fn's out[0] must be a one-element bool", "f64[]");
  l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_while_loop(always, to_f32, NULL, 0, &x, fin));
  expect_error(l, "kiln_while_loop", "init: 0 tensors", NULL);
  kiln_scope_end();
}
END_TEST

/* ---- scan: an RNN ---- */

enum { B = 2, I = 3, H = 4 };
typedef struct rnn {
  kiln_tensor *w, *u, *bias; /* (H,H), (I,H), (H) */
} rnn;

/* h' = tanh(h W + x U + bias); y = h' */
static int rnn_cell(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  rnn *m = ctx;
  kiln_tensor *h = kiln_tanh(kiln_add(kiln_add(kiln_matmul(in[0], m->w), kiln_matmul(in[1], m->u)), m->bias));
  out[0] = h;
  out[1] = h;
  return !h;
}

/* the same RNN, hand-unrolled in double: h (B,H) in place, ys (T,B,H) */
static void rnn_ref(const double *w, const double *u, const double *bias, const double *x, int T, double *h,
                    double *ys) {
  for (int t = 0; t < T; t++) {
    double nh[B * H];
    for (int b = 0; b < B; b++)
      for (int j = 0; j < H; j++) {
        double s = bias[j];
        for (int k = 0; k < H; k++) s += h[b * H + k] * w[k * H + j];
        for (int k = 0; k < I; k++) s += x[(t * B + b) * I + k] * u[k * H + j];
        nh[b * H + j] = tanh(s);
      }
    memcpy(h, nh, sizeof nh);
    memcpy(ys + t * B * H, nh, sizeof nh);
  }
}

typedef struct rnn_data {
  double w[H * H], u[I * H], bias[H], h0[B * H], x[32 * B * I];
} rnn_data;

static void rnn_data_init(rnn_data *d) {
  fill(d->w, H * H, 1);
  fill(d->u, I * H, 2);
  fill(d->bias, H, 3);
  fill(d->h0, B * H, 4);
  fill(d->x, 32 * B * I, 5);
}

static rnn rnn_tensors(const rnn_data *d, kiln_dtype dt) {
  rnn m = {kiln_cast(kiln_tensor_from(KILN_F64, 2, (int64_t[]){H, H}, d->w), dt),
           kiln_cast(kiln_tensor_from(KILN_F64, 2, (int64_t[]){I, H}, d->u), dt),
           kiln_cast(kiln_tensor_from(KILN_F64, 1, (int64_t[]){H}, d->bias), dt)};
  return m;
}

START_TEST(test_scan_rnn_lengths) {
  rnn_data d;
  rnn_data_init(&d);
  kiln_scope_begin();
  rnn m = rnn_tensors(&d, KILN_F64);
  int lengths[] = {0, 1, 2, 5, 19};
  for (size_t li = 0; li < sizeof lengths / sizeof *lengths; li++) {
    int T = lengths[li];
    kiln_scope_begin();
    kiln_tensor *h0 = kiln_tensor_from(KILN_F64, 2, (int64_t[]){B, H}, d.h0);
    kiln_tensor *x = kiln_tensor_from(KILN_F64, 3, (int64_t[]){T, B, I}, d.x);
    kiln_tensor *hT[1], *ys[1];
    ck_assert_msg(kiln_scan(rnn_cell, &m, 1, &h0, 1, &x, hT, 1, ys) == 0, "%s", kiln_last_error());
    double h[B * H], want_ys[19 * B * H], got_h[B * H], got_ys[19 * B * H];
    memcpy(h, d.h0, sizeof h);
    rnn_ref(d.w, d.u, d.bias, d.x, T, h, want_ys);
    ck_assert_int_eq(3, kiln_ndim(ys[0]));
    ck_assert_int_eq(T, kiln_size(ys[0], 0));
    ck_assert_int_eq(B, kiln_size(ys[0], 1));
    ck_assert_int_eq(H, kiln_size(ys[0], 2));
    read_f64(hT[0], got_h, B * H);
    read_f64(ys[0], got_ys, (int64_t)T * B * H);
    close_all(h, got_h, B * H, 1e-12, "last carry");
    close_all(want_ys, got_ys, (int64_t)T * B * H, 1e-12, "ys");
    kiln_scope_end();
  }
  kiln_scope_end();
}
END_TEST

/* two xs, two ys of different shapes, and no carry at all */
static int pairwise(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_mul(in[0], in[1]);
  out[1] = kiln_sum_all(in[0]);
  return !out[0] || !out[1];
}

static int add_rows(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_add(in[0], in[1]));
}

START_TEST(test_scan_two_xs_no_carry) {
  kiln_scope_begin();
  double a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {2, 3, 5, 7, 11, 13};
  kiln_tensor *xs[2] = {kiln_tensor_from(KILN_F64, 2, (int64_t[]){3, 2}, a),
                        kiln_tensor_from(KILN_F64, 2, (int64_t[]){3, 2}, b)};
  kiln_tensor *ys[2];
  ck_assert_int_eq(0, kiln_scan(pairwise, NULL, 0, NULL, 2, xs, NULL, 2, ys));
  double p[6], s[3];
  read_f64(ys[0], p, 6);
  read_f64(ys[1], s, 3);
  for (int i = 0; i < 6; i++) ck_assert(p[i] == a[i] * b[i]);
  ck_assert(s[0] == 3 && s[1] == 7 && s[2] == 11);
  ck_assert_int_eq(1, kiln_ndim(ys[1]));
  /* a fold: a carry and no ys (the running sum of the rows of a) */
  kiln_tensor *acc[1];
  ck_assert_int_eq(0, kiln_scan(add_rows, NULL, 1, (kiln_tensor *[]){kiln_zeros(KILN_F64, 1, (int64_t[]){2})}, 1, xs,
                                acc, 0, NULL));
  double r[2];
  read_f64(acc[0], r, 2);
  ck_assert(r[0] == 1 + 3 + 5 && r[1] == 2 + 4 + 6);
  kiln_scope_end();
}
END_TEST

static int carry_shrinks(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_sum(in[0], 0, false);
  out[1] = in[1];
  return !out[0];
}
static int y_changes(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  /* y's length grows with the carry's value: 1, 2, ... */
  out[0] = kiln_add(in[0], kiln_scalar(KILN_F64, 1));
  double v = kiln_item(in[0]);
  out[1] = kiln_zeros(KILN_F64, 1, (int64_t[]){(int64_t)v + 1});
  return !out[0] || !out[1];
}

START_TEST(test_scan_errors) {
  kiln_scope_begin();
  kiln_tensor *c = kiln_zeros(KILN_F64, 1, (int64_t[]){2});
  kiln_tensor *x3 = kiln_zeros(KILN_F64, 2, (int64_t[]){3, 2}), *x4 = kiln_zeros(KILN_F64, 1, (int64_t[]){4});
  kiln_tensor *co[1], *ys[1];
  int l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_scan(rnn_cell, NULL, 1, &c, 2, (kiln_tensor *[]){x3, x4}, co, 1, ys));
  expect_error(l, "kiln_scan", "xs[1] [4] and xs[0] [3,2] differ in dim 0", NULL);
  l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_scan(carry_shrinks, NULL, 1, &c, 1, &x3, co, 1, ys));
  expect_error(l, "kiln_scan", "body_fn's out 0 is f64[]", "the carry is f64[2]");
  ck_assert(co[0] == NULL && ys[0] == NULL);
  kiln_tensor *s = kiln_scalar(KILN_F64, 0);
  l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_scan(y_changes, NULL, 1, &s, 1, &x3, co, 1, ys));
  expect_error(l, "kiln_scan", "step 1's out 1 is f64[2]", "the first step's is f64[1]");
  l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_scan(carry_shrinks, NULL, 1, &c, 1, &s, co, 1, ys));
  expect_error(l, "kiln_scan", "xs[0] is 0-d", NULL);
  l = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_scan(carry_shrinks, NULL, 1, &c, 0, NULL, co, 1, ys));
  expect_error(l, "kiln_scan", "xs: 0 tensors", NULL);
  kiln_scope_end();
}
END_TEST

/* L = sum(R1 * ys) + sum(R2 * h_T) of the RNN in f64: dL/dW, dL/dU, dL/dbias,
 * dL/dh0 and dL/dx by backward against central differences on rnn_ref. */
static double rnn_loss(const rnn_data *d, int T, const double *r1, const double *r2) {
  double h[B * H], ys[8 * B * H], l = 0;
  memcpy(h, d->h0, sizeof h);
  rnn_ref(d->w, d->u, d->bias, d->x, T, h, ys);
  for (int i = 0; i < T * B * H; i++) l += r1[i] * ys[i];
  for (int i = 0; i < B * H; i++) l += r2[i] * h[i];
  return l;
}

START_TEST(test_scan_gradient) {
  enum { T = 6 };
  rnn_data d;
  rnn_data_init(&d);
  double r1[T * B * H], r2[B * H];
  fill(r1, T * B * H, 9);
  fill(r2, B * H, 10);
  kiln_scope_begin();
  rnn m = rnn_tensors(&d, KILN_F64);
  kiln_tensor *h0 = kiln_tensor_from(KILN_F64, 2, (int64_t[]){B, H}, d.h0);
  kiln_tensor *x = kiln_tensor_from(KILN_F64, 3, (int64_t[]){T, B, I}, d.x);
  kiln_tensor *leaves[5] = {m.w, m.u, m.bias, h0, x};
  double *vals[5] = {d.w, d.u, d.bias, d.h0, d.x};
  int64_t ns[5] = {H * H, I * H, H, B * H, T * B * I};
  const char *names[5] = {"W", "U", "bias", "h0", "x"};
  for (int i = 0; i < 5; i++) kiln_requires_grad(leaves[i], true);
  kiln_tensor *hT[1], *ys[1];
  ck_assert_int_eq(0, kiln_scan(rnn_cell, &m, 1, &h0, 1, &x, hT, 1, ys));
  kiln_tensor *loss =
      kiln_add(kiln_sum_all(kiln_mul(ys[0], kiln_tensor_from(KILN_F64, 3, (int64_t[]){T, B, H}, r1))),
               kiln_sum_all(kiln_mul(hT[0], kiln_tensor_from(KILN_F64, 2, (int64_t[]){B, H}, r2))));
  double l0;
  ck_assert_int_eq(0, kiln_read(loss, &l0, sizeof l0));
  ck_assert(fabs(l0 - rnn_loss(&d, T, r1, r2)) < 1e-12);
  ck_assert_int_eq(0, kiln_backward(loss));
  for (int k = 0; k < 5; k++) {
    double g[T * B * I], fd[T * B * I];
    read_f64(kiln_grad(leaves[k]), g, ns[k]);
    for (int64_t i = 0; i < ns[k]; i++) {
      double keep = vals[k][i];
      vals[k][i] = keep + 1e-6;
      double lp = rnn_loss(&d, T, r1, r2);
      vals[k][i] = keep - 1e-6;
      double lm = rnn_loss(&d, T, r1, r2);
      vals[k][i] = keep;
      fd[i] = (lp - lm) / 2e-6;
    }
    close_all(fd, g, ns[k], 1e-6, names[k]);
  }
  kiln_scope_end();
}
END_TEST

/* A scan's intermediates do not pile up: after a long scan inside a scope
 * the memory in use is back where it was. */
START_TEST(test_scan_memory) {
  rnn_data d;
  rnn_data_init(&d);
  kiln_scope_begin();
  rnn m = rnn_tensors(&d, KILN_F64);
  kiln_tensor *h0 = kiln_tensor_from(KILN_F64, 2, (int64_t[]){B, H}, d.h0);
  kiln_tensor *x = kiln_zeros(KILN_F64, 3, (int64_t[]){500, B, I});
  size_t before = kiln_mem_in_use();
  kiln_scope_begin();
  kiln_tensor *hT[1], *ys[1];
  ck_assert_int_eq(0, kiln_scan(rnn_cell, &m, 1, &h0, 1, &x, hT, 1, ys));
  /* only the stacked ys and the last carry are alive now, plus small change */
  size_t live = kiln_mem_in_use() - before;
  ck_assert_msg(live < 2 * sizeof(double) * (500 * B * H + B * H) + 4096, "%zu bytes live after the scan", live);
  kiln_scope_end();
  ck_assert_int_eq(before, kiln_mem_in_use());
  kiln_scope_end();
}
END_TEST

/* ---- inside a compiled function ---- */

static rnn *g_rnn;
static int rnn_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return kiln_scan(rnn_cell, g_rnn, 1, &in[0], 1, &in[1], &out[0], 1, &out[1]);
}

START_TEST(test_scan_compiled_matches_eager) {
  rnn_data d;
  rnn_data_init(&d);
  kiln_scope_begin();
  rnn m = rnn_tensors(&d, KILN_F32);
  g_rnn = &m;
  for (int backend = KILN_BACKEND_INTERP; backend <= KILN_BACKEND_LLVM; backend++) {
    kiln_fn *fn = kiln_compile(rnn_body, NULL,
                               &(kiln_options){.name = "rnn", .n_in = 2, .n_out = 2, .backend = backend, .max_variants = 32});
    ck_assert_msg(fn != NULL, "%s", kiln_last_error());
    for (int T = 5; T <= 8; T++)
      for (int rep = 0; rep < 2; rep++) {
        kiln_scope_begin();
        kiln_tensor *in[2] = {kiln_cast(kiln_tensor_from(KILN_F64, 2, (int64_t[]){B, H}, d.h0), KILN_F32),
                              kiln_cast(kiln_tensor_from(KILN_F64, 3, (int64_t[]){T, B, I}, d.x), KILN_F32)};
        kiln_tensor *out[2];
        ck_assert_msg(kiln_call(fn, in, out) == 0, "%s", kiln_last_error());
        double h[B * H], want[8 * B * H], got_h[B * H], got[8 * B * H];
        memcpy(h, d.h0, sizeof h);
        rnn_ref(d.w, d.u, d.bias, d.x, T, h, want);
        read_f64(out[0], got_h, B * H);
        read_f64(out[1], got, (int64_t)T * B * H);
        close_all(h, got_h, B * H, 1e-5, "compiled last carry");
        close_all(want, got, (int64_t)T * B * H, 1e-5, "compiled ys");
        kiln_scope_end();
      }
    kiln_fn_stats st;
    ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
    ck_assert_int_eq(8, st.calls);
    ck_assert_int_ge(st.hits, 4); /* each length's second call */
    kiln_fn_free(fn);
  }
  kiln_scope_end();
}
END_TEST

/* cond inside a compiled body, its predicate computed there: both branches
 * at different predicate values, compiled results against hand values, one
 * trace for both (the branches are regions of the graph). */
static int cond_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *pred = kiln_gt(kiln_sum_all(in[0]), kiln_scalar(KILN_F32, 0));
  kiln_tensor *r[2];
  if (kiln_cond(pred, then_fn, else_fn, NULL, 2, in, 2, r)) return -1;
  out[0] = kiln_add(r[0], r[1]);
  return !out[0];
}

START_TEST(test_cond_compiled) {
  kiln_scope_begin();
  kiln_fn *fn = kiln_compile(cond_body, NULL, &(kiln_options){.name = "cond", .n_in = 2, .n_out = 1});
  ck_assert_msg(fn != NULL, "%s", kiln_last_error());
  float b[3] = {0.5f, 2, -1};
  for (int rep = 0; rep < 6; rep++) {
    float sign = rep % 2 ? 1.0f : -1.0f, a[3] = {sign * 1, sign * 2, sign * 3};
    kiln_scope_begin();
    kiln_tensor *in[2] = {kiln_tensor_from(KILN_F32, 1, (int64_t[]){3}, a),
                          kiln_tensor_from(KILN_F32, 1, (int64_t[]){3}, b)},
                *out[1];
    ck_assert_msg(kiln_call(fn, in, out) == 0, "%s", kiln_last_error());
    double got[3], want[3];
    read_f64(out[0], got, 3);
    for (int i = 0; i < 3; i++)
      want[i] = sign > 0 ? (double)a[i] * b[i] + (a[i] + b[i]) : (double)(a[i] - b[i]) + (double)a[i] * a[i];
    close_all(want, got, 3, 1e-6, sign > 0 ? "then" : "else");
    kiln_scope_end();
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(0, st.breaks); /* both branches are regions: the predicate is never read */
  ck_assert_int_eq(1, st.traces);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST


/* while_loop inside a compiled body, its bound an input's value: every
 * condition is a read, so each call runs as segments; the results count. */
static int while_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  count_ctx c = {in[0]};
  (void)ctx;
  return kiln_while_loop(below, step, &c, 2, (kiln_tensor *[]){kiln_scalar(KILN_I64, 0), kiln_scalar(KILN_F64, 0)},
                         out);
}

START_TEST(test_while_compiled) {
  kiln_scope_begin();
  kiln_fn *fn = kiln_compile(while_body, NULL, &(kiln_options){.name = "count", .n_in = 1, .n_out = 2});
  ck_assert_msg(fn != NULL, "%s", kiln_last_error());
  int64_t bounds[] = {3, 0, 6, 3};
  for (int i = 0; i < 4; i++) {
    kiln_scope_begin();
    kiln_tensor *out[2], *b = kiln_tensor_from(KILN_I64, 0, NULL, &bounds[i]);
    ck_assert_msg(kiln_call(fn, &b, out) == 0, "%s", kiln_last_error());
    int64_t n;
    double acc;
    ck_assert_int_eq(0, kiln_read(out[0], &n, sizeof n));
    ck_assert_int_eq(0, kiln_read(out[1], &acc, sizeof acc));
    ck_assert_int_eq(bounds[i], n);
    ck_assert(acc == ldexp(1, (int)bounds[i]) - 1);
    kiln_scope_end();
  }
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* A cond inside a scan: carry c; for each x_t, c = c + x_t when sum(x_t) > 0,
 * else c * x_t; y_t = c. Eager and compiled against a C loop. */
static int add_fn(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_add(in[0], in[1]));
}
static int mul_fn(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_mul(in[0], in[1]));
}
static int cond_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *pred = kiln_gt(kiln_sum_all(in[1]), kiln_scalar(KILN_F64, 0));
  if (kiln_cond(pred, add_fn, mul_fn, NULL, 2, in, 1, out)) return -1;
  out[1] = out[0];
  return 0;
}
static int cond_scan_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return kiln_scan(cond_step, NULL, 1, &in[0], 1, &in[1], &out[0], 1, &out[1]);
}

START_TEST(test_cond_inside_scan) {
  enum { N = 3 };
  double x[9 * N], c0[N] = {0.5, -1, 2};
  fill(x, 9 * N, 11);
  kiln_scope_begin();
  kiln_fn *fn = kiln_compile(cond_scan_body, NULL, &(kiln_options){.name = "cond_scan", .n_in = 2, .n_out = 2});
  ck_assert_msg(fn != NULL, "%s", kiln_last_error());
  int lengths[] = {0, 1, 9, 4};
  for (int li = 0; li < 4; li++)
    for (int compiled = 0; compiled < 2; compiled++) {
      int T = lengths[li];
      kiln_scope_begin();
      kiln_tensor *in[2] = {kiln_tensor_from(KILN_F64, 1, (int64_t[]){N}, c0),
                            kiln_tensor_from(KILN_F64, 2, (int64_t[]){T, N}, x)},
                  *out[2];
      ck_assert_msg((compiled ? kiln_call(fn, in, out) : cond_scan_body(NULL, in, out)) == 0, "%s", kiln_last_error());
      double c[N], want[9 * N], got_c[N], got[9 * N];
      memcpy(c, c0, sizeof c);
      for (int t = 0; t < T; t++) {
        double s = 0;
        for (int j = 0; j < N; j++) s += x[t * N + j];
        for (int j = 0; j < N; j++) c[j] = s > 0 ? c[j] + x[t * N + j] : c[j] * x[t * N + j];
        memcpy(want + t * N, c, sizeof c);
      }
      ck_assert_int_eq(T, kiln_size(out[1], 0));
      read_f64(out[0], got_c, N);
      read_f64(out[1], got, (int64_t)T * N);
      close_all(c, got_c, N, 1e-12, compiled ? "compiled carry" : "eager carry");
      close_all(want, got, (int64_t)T * N, 1e-12, compiled ? "compiled ys" : "eager ys");
      kiln_scope_end();
    }
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

static Suite *control_suite(void) {
  Suite *s = suite_create("control");
  TCase *tc = tcase_create("eager");
  tcase_add_test(tc, test_cond_branches);
  tcase_add_test(tc, test_cond_errors);
  tcase_add_test(tc, test_cond_gradient);
  tcase_add_test(tc, test_while_counts_to_data_bound);
  tcase_add_test(tc, test_while_errors);
  tcase_add_test(tc, test_while_backward_is_an_error);
  tcase_add_test(tc, test_scan_rnn_lengths);
  tcase_add_test(tc, test_scan_two_xs_no_carry);
  tcase_add_test(tc, test_scan_errors);
  tcase_add_test(tc, test_scan_gradient);
  tcase_add_test(tc, test_scan_memory);
  suite_add_tcase(s, tc);
  TCase *tcc = tcase_create("compiled");
  tcase_set_timeout(tcc, 120);
  tcase_add_test(tcc, test_scan_compiled_matches_eager);
  tcase_add_test(tcc, test_cond_compiled);
  tcase_add_test(tcc, test_while_compiled);
  tcase_add_test(tcc, test_cond_inside_scan);
  suite_add_tcase(s, tcc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(control_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
