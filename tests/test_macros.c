/* The public macros as a C programmer writes them: every macro of kiln.h
 * called with a compound literal wherever it takes an array (a shape, data,
 * an axis list, a tensor list, the options), which only compiles because the
 * macros are variadic; the checked lists KILN_SHAPE, KILN_AXES and
 * KILN_TENSORS; and a check that no macro of kiln.h is missing from this
 * file (a new op adds a line here). The wrong-type cases, which must not
 * compile, are in tests/compile/. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kiln.h"

/* The values of t (any dtype) as doubles, row-major. */
static void values(const kiln_tensor *t, double *out, int64_t n) {
  ck_assert_msg(t != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(n, kiln_numel(t));
  kiln_tensor *d = kiln_cast((kiln_tensor *)t, KILN_F64);
  ck_assert_int_eq(0, kiln_read(d, out, (size_t)n * sizeof(double)));
}

/* t has shape `shape` (ndim dims) and the n values `want`. */
static void expect(const kiln_tensor *t, int ndim, const int64_t *shape, int64_t n, const double *want,
                   const char *what) {
  ck_assert_msg(t != NULL, "%s: %s", what, kiln_last_error());
  ck_assert_int_eq(ndim, kiln_ndim(t));
  for (int d = 0; d < ndim; d++) ck_assert_int_eq(shape[d], kiln_size(t, d));
  double got[64];
  ck_assert(n <= 64);
  values(t, got, n);
  for (int64_t i = 0; i < n; i++)
    ck_assert_msg(fabs(want[i] - got[i]) <= 1e-6 * (1 + fabs(want[i])), "%s at %d: expected %.9g, got %.9g", what,
                  (int)i, want[i], got[i]);
}

#define EXPECT(t, shape_literal, ...)                                                                         \
  expect((t), (int)(sizeof(shape_literal) / sizeof(int64_t)), shape_literal,                                  \
         (int64_t)(sizeof((double[]){__VA_ARGS__}) / sizeof(double)), (double[]){__VA_ARGS__}, #t)
/* a 0-d t holding v */
#define EXPECT0(t, v) expect((t), 0, NULL, 1, (double[]){v}, #t)

/* a body for kiln_compile: out[0] = in[0] * in[1] + 1 */
static int mul_add_one(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_add(kiln_mul(in[0], in[1]), kiln_scalar(KILN_F32, 1));
  return out[0] ? 0 : -1;
}

START_TEST(test_creation_literals) {
  kiln_scope_begin();
  EXPECT(kiln_tensor_from(KILN_F32, 2, (int64_t[]){2, 2}, (float[]){1, 2, 3, 4}), ((int64_t[]){2, 2}), 1, 2, 3, 4);
  EXPECT(kiln_zeros(KILN_F32, 2, (int64_t[]){2, 3}), ((int64_t[]){2, 3}), 0, 0, 0, 0, 0, 0);
  EXPECT(kiln_ones(KILN_I64, 2, (int64_t[]){1, 2}), ((int64_t[]){1, 2}), 1, 1);
  EXPECT(kiln_full(KILN_F64, 2, (int64_t[]){2, 1}, 2.5), ((int64_t[]){2, 1}), 2.5, 2.5);
  EXPECT0(kiln_scalar(KILN_F32, 7), 7);
  EXPECT(kiln_arange(KILN_F32, 0, 3, 1), ((int64_t[]){3}), 0, 1, 2);
  /* same seed, same values, whatever the shape (the generator's contract) */
  kiln_tensor *r1 = kiln_randn(KILN_F64, 2, (int64_t[]){2, 3}, 5), *r2 = kiln_randn(KILN_F64, 1, (int64_t[]){6}, 5);
  kiln_tensor *u1 = kiln_rand(KILN_F64, 2, (int64_t[]){3, 2}, 9), *u2 = kiln_rand(KILN_F64, 1, (int64_t[]){6}, 9);
  double a[6], b[6];
  values(r1, a, 6), values(r2, b, 6);
  ck_assert(memcmp(a, b, sizeof a) == 0);
  values(u1, a, 6), values(u2, b, 6);
  ck_assert(memcmp(a, b, sizeof a) == 0);
  for (int i = 0; i < 6; i++) ck_assert(a[i] >= 0 && a[i] < 1);

  kiln_tensor *t = kiln_tensor_from(KILN_F32, 1, (int64_t[]){3}, (float[]){1, 2, 3});
  float back[3] = {0};
  ck_assert_int_eq(0, kiln_read(t, back, sizeof back));
  ck_assert(back[0] == 1 && back[1] == 2 && back[2] == 3);
  ck_assert_double_eq(2, kiln_item(kiln_tensor_from(KILN_F64, 1, (int64_t[]){1}, (double[]){2})));
  kiln_print(kiln_tensor_from(KILN_F32, 2, (int64_t[]){1, 2}, (float[]){8, 9}));
  kiln_scope_end();
}
END_TEST

START_TEST(test_view_literals) {
  kiln_scope_begin();
  kiln_tensor *m = kiln_tensor_from(KILN_F32, 2, (int64_t[]){2, 3}, (float[]){1, 2, 3, 4, 5, 6});
  EXPECT(kiln_reshape(m, 2, (int64_t[]){3, -1}), ((int64_t[]){3, 2}), 1, 2, 3, 4, 5, 6);
  EXPECT(kiln_transpose(m, 0, 1), ((int64_t[]){3, 2}), 1, 4, 2, 5, 3, 6);
  EXPECT(kiln_permute(m, (int[]){1, 0}), ((int64_t[]){3, 2}), 1, 4, 2, 5, 3, 6);
  kiln_tensor *col = kiln_tensor_from(KILN_F32, 2, (int64_t[]){2, 1}, (float[]){1, 2});
  EXPECT(kiln_expand(col, 2, (int64_t[]){2, 3}), ((int64_t[]){2, 3}), 1, 1, 1, 2, 2, 2);
  EXPECT(kiln_squeeze(col, 1), ((int64_t[]){2}), 1, 2);
  EXPECT(kiln_unsqueeze(col, 0), ((int64_t[]){1, 2, 1}), 1, 2);
  EXPECT(kiln_slice(m, 1, 0, 3, 2), ((int64_t[]){2, 2}), 1, 3, 4, 6);
  EXPECT(kiln_contiguous(kiln_transpose(m, 0, 1)), ((int64_t[]){3, 2}), 1, 4, 2, 5, 3, 6);
  kiln_tensor *r = kiln_tensor_from(KILN_F32, 1, (int64_t[]){2}, (float[]){7, 8});
  EXPECT(kiln_cat((kiln_tensor *[]){r, r}, 2, 0), ((int64_t[]){4}), 7, 8, 7, 8);
  EXPECT(kiln_stack((kiln_tensor *[]){r, r}, 2, 0), ((int64_t[]){2, 2}), 7, 8, 7, 8);
  EXPECT(kiln_cast(r, KILN_I64), ((int64_t[]){2}), 7, 8);
  kiln_tensor *ix = kiln_tensor_from(KILN_I64, 2, (int64_t[]){2, 1}, (int64_t[]){2, 0});
  EXPECT(kiln_gather(m, 1, ix), ((int64_t[]){2, 1}), 3, 4);
  EXPECT(kiln_scatter_add(m, 1, ix, kiln_tensor_from(KILN_F32, 2, (int64_t[]){2, 1}, (float[]){10, 20})), ((int64_t[]){2, 3}), 1, 2,
         13, 24, 5, 6);
  kiln_tensor *i1 = kiln_tensor_from(KILN_I64, 1, (int64_t[]){2}, (int64_t[]){1, 1});
  kiln_tensor *rows = kiln_tensor_from(KILN_F32, 2, (int64_t[]){2, 3}, (float[]){7, 7, 7, 9, 9, 9});
  EXPECT(kiln_index_copy(m, 0, i1, rows), ((int64_t[]){2, 3}), 1, 2, 3, 9, 9, 9); /* the last write wins */
  kiln_tensor *dst = kiln_zeros(KILN_F32, 2, (int64_t[]){2, 3});
  ck_assert_ptr_eq(dst, kiln_index_copy_(dst, 0, i1, rows));
  EXPECT(dst, ((int64_t[]){2, 3}), 0, 0, 0, 9, 9, 9);
  EXPECT(kiln_tril(m, 0), ((int64_t[]){2, 3}), 1, 0, 0, 4, 5, 0);
  EXPECT(kiln_triu(m, 1), ((int64_t[]){2, 3}), 0, 2, 3, 0, 0, 6);
  EXPECT(kiln_pad(m, 4, (int64_t[]){1, -2, 0, 1}, 0.5), ((int64_t[]){3, 2}), 0.5, 1, 0.5, 4, 0.5, 0.5);
  EXPECT(kiln_cumsum(m, 1), ((int64_t[]){2, 3}), 1, 3, 6, 4, 9, 15);
  kiln_tensor *tv, *ti;
  ck_assert_int_eq(0, kiln_topk(m, 2, 1, true, &tv, &ti));
  EXPECT(tv, ((int64_t[]){2, 2}), 3, 2, 6, 5);
  EXPECT(ti, ((int64_t[]){2, 2}), 2, 1, 2, 1);
  kiln_tensor *pieces[2];
  ck_assert_int_eq(2, kiln_split(m, 2, 1, NULL));
  ck_assert_int_eq(2, kiln_split(m, 2, 1, pieces));
  EXPECT(pieces[1], ((int64_t[]){2, 1}), 3, 6);
  ck_assert_int_eq(2, kiln_split_n(m, 2, 1, pieces, 2));
  EXPECT(pieces[0], ((int64_t[]){2, 2}), 1, 2, 4, 5);
  EXPECT(kiln_one_hot(kiln_tensor_from(KILN_I64, 1, (int64_t[]){2}, (int64_t[]){2, 0}), 3), ((int64_t[]){2, 3}), 0, 0, 1, 1, 0, 0);
  EXPECT(kiln_repeat(r, 2, (int64_t[]){2, 2}), ((int64_t[]){2, 4}), 7, 8, 7, 8, 7, 8, 7, 8);
  kiln_scope_end();
}
END_TEST

START_TEST(test_pointwise) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_tensor_from(KILN_F32, 1, (int64_t[]){2}, (float[]){1, 4});
  kiln_tensor *y = kiln_tensor_from(KILN_F32, 1, (int64_t[]){2}, (float[]){2, 2});
  int64_t two[1] = {2};
  EXPECT(kiln_add(x, y), two, 3, 6);
  EXPECT(kiln_sub(x, y), two, -1, 2);
  EXPECT(kiln_mul(x, y), two, 2, 8);
  EXPECT(kiln_div(x, y), two, 0.5, 2);
  EXPECT(kiln_pow(x, y), two, 1, 16);
  EXPECT(kiln_maximum(x, y), two, 2, 4);
  EXPECT(kiln_minimum(x, y), two, 1, 2);
  EXPECT(kiln_eq(x, y), two, 0, 0);
  EXPECT(kiln_ne(x, y), two, 1, 1);
  EXPECT(kiln_lt(x, y), two, 1, 0);
  EXPECT(kiln_le(x, y), two, 1, 0);
  EXPECT(kiln_gt(x, y), two, 0, 1);
  EXPECT(kiln_ge(x, y), two, 0, 1);
  EXPECT(kiln_neg(x), two, -1, -4);
  EXPECT(kiln_abs(kiln_neg(x)), two, 1, 4);
  EXPECT(kiln_exp(x), two, exp(1.0), exp(4.0));
  EXPECT(kiln_log(x), two, 0, log(4.0));
  EXPECT(kiln_sqrt(x), two, 1, 2);
  EXPECT(kiln_rsqrt(x), two, 1, 0.5);
  EXPECT(kiln_tanh(x), two, tanh(1.0), tanh(4.0));
  EXPECT(kiln_sigmoid(x), two, 1 / (1 + exp(-1.0)), 1 / (1 + exp(-4.0)));
  EXPECT(kiln_relu(kiln_sub(x, y)), two, 0, 2);
  double c = sqrt(2 / M_PI);
  EXPECT(kiln_gelu(x), two, 0.5 * (1 + tanh(c * (1 + 0.044715))), 0.5 * 4 * (1 + tanh(c * (4 + 0.044715 * 64))));
  EXPECT(kiln_gelu_erf(x), two, 0.5 * (1 + erf(1 / sqrt(2.0))), 0.5 * 4 * (1 + erf(4 / sqrt(2.0))));
  EXPECT(kiln_erf(x), two, erf(1.0), erf(4.0));
  EXPECT(kiln_sin(x), two, sin(1.0), sin(4.0));
  EXPECT(kiln_cos(x), two, cos(1.0), cos(4.0));
  EXPECT(kiln_where(kiln_gt(x, y), x, y), two, 2, 4);
  EXPECT(kiln_silu(x), two, 1 / (1 + exp(-1.0)), 4 / (1 + exp(-4.0)));
  EXPECT(kiln_softplus(x), two, log(1 + exp(1.0)), log(1 + exp(4.0)));
  EXPECT(kiln_log1p(x), two, log(2.0), log(5.0));
  EXPECT(kiln_expm1(x), two, exp(1.0) - 1, exp(4.0) - 1);
  kiln_tensor *h = kiln_tensor_from(KILN_F32, 1, (int64_t[]){2}, (float[]){-2.5f, 0.5f});
  EXPECT(kiln_floor(h), two, -3, 0);
  EXPECT(kiln_ceil(h), two, -2, 1);
  EXPECT(kiln_round(h), two, -2, 0); /* half to even */
  EXPECT(kiln_sign(h), two, -1, 1);
  EXPECT(kiln_clamp(h, -1, 0.25), two, -1, 0.25);
  EXPECT(kiln_leaky_relu(h, 0.1), two, -0.25, 0.5);
  EXPECT(kiln_add_scalar(x, 1), two, 2, 5);
  EXPECT(kiln_sub_scalar(x, 1), two, 0, 3);
  EXPECT(kiln_mul_scalar(x, 0.5), two, 0.5, 2);
  EXPECT(kiln_div_scalar(x, 4), two, 0.25, 1);
  kiln_scope_end();
}
END_TEST

START_TEST(test_reduction_literals) {
  kiln_scope_begin();
  kiln_tensor *m = kiln_tensor_from(KILN_F32, 2, (int64_t[]){2, 3}, (float[]){1, 2, 3, 4, 5, 9});
  EXPECT(kiln_sum(m, 1, false), ((int64_t[]){2}), 6, 18);
  EXPECT(kiln_mean(m, 0, true), ((int64_t[]){1, 3}), 2.5, 3.5, 6);
  EXPECT(kiln_max(m, -1, false), ((int64_t[]){2}), 3, 9);
  EXPECT(kiln_min(m, 0, false), ((int64_t[]){3}), 1, 2, 3);
  EXPECT(kiln_var(m, 1, 0, false), ((int64_t[]){2}), 2.0 / 3, 14.0 / 3);
  EXPECT(kiln_argmax(m, 1, false), ((int64_t[]){2}), 2, 2);
  EXPECT0(kiln_sum_axes(m, (int[]){0, 1}, 2, false), 24);
  EXPECT(kiln_mean_axes(m, (int[]){1, 0}, 2, true), ((int64_t[]){1, 1}), 4);
  EXPECT0(kiln_max_axes(m, (int[]){0, 1}, 2, false), 9);
  EXPECT0(kiln_min_axes(m, (int[]){0, 1}, 2, false), 1);
  EXPECT0(kiln_var_axes(m, (int[]){0, 1}, 2, 0, false), 40.0 / 6); /* deviations from 4: 9 4 1 0 1 25 */
  EXPECT0(kiln_sum_all(m), 24);
  EXPECT0(kiln_mean_all(m), 4);
  EXPECT(kiln_argmin(m, 0, false), ((int64_t[]){3}), 0, 0, 0);
  EXPECT0(kiln_max_all(m), 9);
  EXPECT0(kiln_min_all(m), 1);
  EXPECT(kiln_logsumexp(m, 1, false), ((int64_t[]){2}), log(exp(1.0) + exp(2.0) + exp(3.0)), log(exp(4.0) + exp(5.0) + exp(9.0)));
  kiln_tensor *mask = kiln_tensor_from(KILN_BOOL, 1, (int64_t[]){3}, (bool[]){true, false, true});
  EXPECT(kiln_masked_fill(m, mask, -1), ((int64_t[]){2, 3}), -1, 2, -1, -1, 5, -1);
  /* rows (1,2,3): mean square 14/3; (4,5,9): 122/3 */
  double r0 = 1 / sqrt(14.0 / 3), r1 = 1 / sqrt(122.0 / 3);
  EXPECT(kiln_rms_norm(m, NULL, 0), ((int64_t[]){2, 3}), r0, 2 * r0, 3 * r0, 4 * r1, 5 * r1, 9 * r1);
  /* one group per channel of (1, 2, 3): each row's layer norm */
  double s0 = sqrt(2.0 / 3), s1 = sqrt(14.0 / 3);
  EXPECT(kiln_group_norm(kiln_reshape(m, 3, (int64_t[]){1, 2, 3}), 2, NULL, NULL, 0), ((int64_t[]){1, 2, 3}), -1 / s0, 0, 1 / s0,
         -2 / s1, -1 / s1, 3 / s1);
  kiln_scope_end();
}
END_TEST

START_TEST(test_nn_and_inplace) {
  kiln_scope_begin();
  kiln_tensor *a = kiln_tensor_from(KILN_F32, 2, (int64_t[]){1, 2}, (float[]){1, 2});
  kiln_tensor *b = kiln_tensor_from(KILN_F32, 2, (int64_t[]){2, 1}, (float[]){3, 4});
  EXPECT(kiln_matmul(a, b), ((int64_t[]){1, 1}), 11);
  double e1 = exp(1.0), e2 = exp(2.0);
  EXPECT(kiln_softmax(a, -1), ((int64_t[]){1, 2}), e1 / (e1 + e2), e2 / (e1 + e2));
  EXPECT(kiln_log_softmax(a, -1), ((int64_t[]){1, 2}), 1 - log(e1 + e2), 2 - log(e1 + e2));
  /* mean 1.5, variance 0.25: (x - 1.5) / 0.5 */
  EXPECT(kiln_layer_norm(a, NULL, NULL, 0), ((int64_t[]){1, 2}), -1, 1);
  kiln_tensor *table = kiln_tensor_from(KILN_F32, 2, (int64_t[]){3, 2}, (float[]){0, 1, 10, 11, 20, 21});
  kiln_tensor *idx = kiln_tensor_from(KILN_I64, 1, (int64_t[]){2}, (int64_t[]){2, 0});
  EXPECT(kiln_embedding(table, idx), ((int64_t[]){2, 2}), 20, 21, 0, 1);
  EXPECT(kiln_index_select(table, 0, idx), ((int64_t[]){2, 2}), 20, 21, 0, 1);
  kiln_tensor *target = kiln_tensor_from(KILN_I64, 1, (int64_t[]){1}, (int64_t[]){1});
  EXPECT0(kiln_cross_entropy(a, target), log(e1 + e2) - 2);
  EXPECT0(kiln_mse_loss(a, kiln_tensor_from(KILN_F32, 2, (int64_t[]){1, 2}, (float[]){0, 0})), 2.5);

  kiln_tensor *d = kiln_zeros(KILN_F32, 1, (int64_t[]){2});
  kiln_tensor *s = kiln_tensor_from(KILN_F32, 1, (int64_t[]){2}, (float[]){1, 2});
  int64_t two[1] = {2};
  EXPECT(kiln_add_(d, s), two, 1, 2);
  EXPECT(kiln_mul_(d, s), two, 1, 4);
  EXPECT(kiln_sub_(d, s), two, 0, 2);
  EXPECT(kiln_copy_(d, kiln_tensor_from(KILN_F32, 1, (int64_t[]){1}, (float[]){5})), two, 5, 5);
  EXPECT(kiln_fill_(d, 3), two, 3, 3);
  EXPECT(kiln_zero_(d), two, 0, 0);
  kiln_scope_end();
}
END_TEST

START_TEST(test_cnn_literals) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_tensor_from(KILN_F32, 4, (int64_t[]){1, 1, 3, 3}, (float[]){1, 2, 3, 4, 5, 6, 7, 8, 9});
  kiln_tensor *w = kiln_ones(KILN_F32, 4, (int64_t[]){1, 1, 2, 2});
  int64_t two[4] = {1, 1, 2, 2};
  EXPECT(kiln_conv2d(x, w, NULL, NULL, NULL, NULL, 1), two, 12, 16, 24, 28);
  /* stride 2, padding 1: the windows at (-1,-1), (-1,1), (1,-1), (1,1) */
  EXPECT(kiln_conv2d(x, w, NULL, (int[]){2, 2}, (int[]){1, 1}, NULL, 1), two, 1, 5, 11, 28);
  EXPECT(kiln_max_pool2d(x, (int[]){2, 2}, NULL, NULL), ((int64_t[]){1, 1, 1, 1}), 5);
  EXPECT(kiln_avg_pool2d(x, (int[]){2, 2}, (int[]){1, 1}, NULL), two, 3, 4, 6, 7);
  EXPECT(kiln_adaptive_avg_pool2d(x, (int[]){1, 1}), ((int64_t[]){1, 1, 1, 1}), 5);
  kiln_tensor *s = kiln_tensor_from(KILN_F32, 3, (int64_t[]){1, 1, 3}, (float[]){1, 2, 3});
  kiln_tensor *k = kiln_ones(KILN_F32, 3, (int64_t[]){1, 1, 2});
  EXPECT(kiln_conv1d(s, k, kiln_full(KILN_F32, 1, (int64_t[]){1}, 10), 1, 0, 1, 1), ((int64_t[]){1, 1, 2}), 13, 15);
  /* batch [1, 3]: mean 2, biased variance 1 (unbiased 2); momentum 0.5 from 0 and 1 */
  kiln_tensor *rm = kiln_zeros(KILN_F32, 1, (int64_t[]){1}), *rv = kiln_ones(KILN_F32, 1, (int64_t[]){1});
  kiln_tensor *b = kiln_tensor_from(KILN_F32, 2, (int64_t[]){2, 1}, (float[]){1, 3});
  EXPECT(kiln_batch_norm(b, rm, rv, NULL, NULL, true, 0.5, 0), ((int64_t[]){2, 1}), -1, 1);
  EXPECT(rm, ((int64_t[]){1}), 1);
  EXPECT(rv, ((int64_t[]){1}), 1.5);
  kiln_scope_end();
}
END_TEST

START_TEST(test_autograd_and_compile_literals) {
  kiln_tensor *w = kiln_tensor_from(KILN_F64, 1, (int64_t[]){2}, (double[]){1, 3});
  kiln_tensor *b = kiln_tensor_from(KILN_F64, 1, (int64_t[]){2}, (double[]){2, 0});
  kiln_requires_grad(w, true);
  kiln_requires_grad(b, true);
  kiln_scope_begin();
  /* d/dw sum(w*w + b) = 2w, d/db = 1 */
  kiln_tensor *grads[2];
  kiln_tensor *loss = kiln_sum_all(kiln_add(kiln_mul(w, w), b));
  ck_assert_int_eq(0, kiln_grad_of(loss, (kiln_tensor *[]){w, b}, 2, grads));
  EXPECT(grads[0], ((int64_t[]){2}), 2, 6);
  EXPECT(grads[1], ((int64_t[]){2}), 1, 1);
  ck_assert_int_eq(0, kiln_backward(loss));
  EXPECT(kiln_grad(w), ((int64_t[]){2}), 2, 6);
  kiln_zero_grad(w);
  kiln_tensor *y = kiln_mul(w, kiln_tensor_from(KILN_F64, 1, (int64_t[]){2}, (double[]){5, 7}));
  ck_assert_int_eq(0, kiln_backward_with(y, kiln_tensor_from(KILN_F64, 1, (int64_t[]){2}, (double[]){1, 2})));
  EXPECT(kiln_grad(w), ((int64_t[]){2}), 5, 14);
  ck_assert_ptr_eq(kiln_grad(w), (kiln_grad)(w)); /* the plain function, for callers without the macro */

  kiln_fn *fn = kiln_compile(mul_add_one, NULL, &(kiln_options){.name = "mul_add_one", .n_in = 2, .n_out = 1});
  ck_assert_msg(fn != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_mark_dynamic(fn, 0, 0));
  ck_assert_int_eq(0, kiln_mark_dynamic(fn, 1, 0));
  kiln_tensor *out[1];
  for (int i = 0; i < 2; i++) { /* a trace, then the compiled graph */
    ck_assert_int_eq(0, kiln_call(fn,
                                  (kiln_tensor *[]){kiln_tensor_from(KILN_F32, 1, (int64_t[]){2}, (float[]){2, 3}),
                                                    kiln_tensor_from(KILN_F32, 1, (int64_t[]){2}, (float[]){4, 5})},
                                  out));
    EXPECT(out[0], ((int64_t[]){2}), 9, 16);
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &(kiln_fn_stats){0}));
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.hits);
  char *text = kiln_fn_graph(fn, 0);
  ck_assert_msg(text && strstr(text, "s0"), "%s", text ? text : kiln_last_error()); /* marked dynamic */
  char path[] = "/tmp/kiln_test_macros_XXXXXX";
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  close(fd);
  ck_assert_int_eq(0, kiln_param_name(w, "w"));
  ck_assert_int_eq(0, kiln_save_variant(fn, path, 1));
  ck_assert_int_eq(0, kiln_save(fn, path));
  kiln_fn *loaded = kiln_load(path), *from_text = kiln_load_string(text);
  ck_assert_msg(loaded && from_text, "%s", kiln_last_error());
  kiln_tensor *three[2] = {kiln_tensor_from(KILN_F32, 1, (int64_t[]){3}, (float[]){1, 2, 3}),
                           kiln_tensor_from(KILN_F32, 1, (int64_t[]){3}, (float[]){2, 2, 2})};
  ck_assert_int_eq(0, kiln_call(loaded, three, out));
  EXPECT(out[0], ((int64_t[]){3}), 3, 5, 7);
  ck_assert_int_eq(0, kiln_call(from_text, three, out));
  EXPECT(out[0], ((int64_t[]){3}), 3, 5, 7);
  /* an export writes <prefix>.o and <prefix>.h (test_export links and runs them) */
  ck_assert_msg(kiln_export(loaded, path, &(kiln_export_options){.name = "macros"}) == 0, "%s", kiln_last_error());
  char obj[64], hdr[64];
  snprintf(obj, sizeof obj, "%s.o", path), snprintf(hdr, sizeof hdr, "%s.h", path);
  ck_assert_int_eq(0, access(obj, R_OK) | access(hdr, R_OK));
  unlink(obj), unlink(hdr);
  kiln_fn_free(loaded);
  kiln_fn_free(from_text);
  free(text);
  unlink(path);
  kiln_fn_free(fn);
  kiln_scope_end();
  kiln_release(w);
  kiln_release(b);
}
END_TEST

/* Bodies for the control-flow macros: out = in * 2, in + 10, in < 3, in + 1,
 * and scan's (carry + x, carry). */
static int cf_double(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_mul(in[0], kiln_scalar(KILN_F64, 2)));
}
static int cf_add10(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_add(in[0], kiln_scalar(KILN_F64, 10)));
}
static int cf_below3(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_lt(in[0], kiln_scalar(KILN_F64, 3)));
}
static int cf_inc(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_add(in[0], kiln_scalar(KILN_F64, 1)));
}
static int cf_cumsum(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_add(in[0], in[1]);
  out[1] = out[0];
  return !out[0];
}

START_TEST(test_control_flow_literals) {
  kiln_scope_begin();
  kiln_tensor *out[1], *ys[1];
  kiln_tensor *x = kiln_tensor_from(KILN_F64, 1, (int64_t[]){2}, (double[]){1, 2});
  ck_assert_int_eq(0, kiln_cond(kiln_scalar(KILN_BOOL, 1), cf_double, cf_add10, NULL, 1, (kiln_tensor *[]){x}, 1, out));
  EXPECT(out[0], ((int64_t[]){2}), 2, 4);
  ck_assert_int_eq(0, kiln_cond(kiln_scalar(KILN_BOOL, 0), cf_double, cf_add10, NULL, 1, (kiln_tensor *[]){x}, 1, out));
  EXPECT(out[0], ((int64_t[]){2}), 11, 12);
  ck_assert_int_eq(0, kiln_while_loop(cf_below3, cf_inc, NULL, 1, (kiln_tensor *[]){kiln_scalar(KILN_F64, 0)}, out));
  EXPECT0(out[0], 3);
  ck_assert_int_eq(0, kiln_scan(cf_cumsum, NULL, 1, (kiln_tensor *[]){kiln_scalar(KILN_F64, 0)}, 1,
                                (kiln_tensor *[]){kiln_tensor_from(KILN_F64, 1, (int64_t[]){3}, (double[]){1, 2, 3})},
                                out, 1, ys));
  EXPECT0(out[0], 6);
  EXPECT(ys[0], ((int64_t[]){3}), 1, 3, 6);
  kiln_scope_end();
}
END_TEST

START_TEST(test_lifetime_macros) {
  kiln_scope_begin();
  kiln_tensor *t = kiln_keep(kiln_tensor_from(KILN_F32, 1, (int64_t[]){2}, (float[]){3, 4}));
  kiln_tensor *u = kiln_ones(KILN_F32, 1, (int64_t[]){2});
  ck_assert_ptr_eq(u, kiln_retain(u)); /* a reference of our own, past the scope */
  kiln_scope_end();
  kiln_scope_begin(); /* for what EXPECT makes */
  EXPECT(t, ((int64_t[]){2}), 3, 4); /* kept: the caller's now */
  EXPECT(u, ((int64_t[]){2}), 1, 1);
  kiln_scope_end();
  kiln_clear_error();
  kiln_release(t);
  kiln_release(u);
  ck_assert_str_eq("", kiln_last_error());
}
END_TEST

/* A list's count and its values, as the callee sees them. */
static int64_t shape_sum(int n, const int64_t *s) {
  int64_t t = n * 1000;
  for (int i = 0; i < n; i++) t += s[i];
  return t;
}
static int axes_sum(const int *a, int n) {
  int t = n * 1000;
  for (int i = 0; i < n; i++) t += a[i];
  return t;
}
static int tensors_count(kiln_tensor *const *ts, int n) {
  for (int i = 0; i < n; i++) ck_assert_ptr_null(ts[i]);
  return n;
}

START_TEST(test_checked_lists) {
  ck_assert_int_eq(1005, shape_sum(KILN_SHAPE(5)));
  ck_assert_int_eq(3000 + 2 + 3 + 4, shape_sum(KILN_SHAPE(2, 3, 4)));
  ck_assert_int_eq(8000 + 8, shape_sum(KILN_SHAPE(1, 1, 1, 1, 1, 1, 1, 1)));
  ck_assert_int_eq(2000 + 1, axes_sum(KILN_AXES(-1, 2)));
  ck_assert_int_eq(3, tensors_count(KILN_TENSORS(NULL, NULL, NULL)));
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_F32, KILN_SHAPE(2, 3));
  EXPECT(x, ((int64_t[]){2, 3}), 1, 1, 1, 1, 1, 1);
  EXPECT(kiln_reshape(x, KILN_SHAPE(-1)), ((int64_t[]){6}), 1, 1, 1, 1, 1, 1);
  EXPECT(kiln_expand(kiln_ones(KILN_F32, KILN_SHAPE(1, 2)), KILN_SHAPE(3, -1)), ((int64_t[]){3, 2}), 1, 1, 1, 1, 1, 1);
  EXPECT0(kiln_sum_axes(x, KILN_AXES(0, 1), false), 6);
  EXPECT(kiln_cat(KILN_TENSORS(x, x, x), 0), ((int64_t[]){6, 3}), 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
  EXPECT(kiln_full(KILN_F32, KILN_SHAPE(1), 4), ((int64_t[]){1}), 4);
  kiln_tensor *g = kiln_randn(KILN_F32, KILN_SHAPE(4, 2), 1);
  ck_assert_int_eq(2, kiln_ndim(g));
  ck_assert_int_eq(4, kiln_size(g, 0));
  ck_assert_int_eq(2, kiln_size(g, 1));
  kiln_scope_end();
}
END_TEST

/* Weights in a file, every call with compound literals for its lists. */
START_TEST(test_tensor_file_literals) {
  kiln_scope_begin();
  char path[] = "/tmp/kiln_macros_XXXXXX";
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  fclose(fdopen(fd, "w"));
  kiln_tensor *a = kiln_tensor_from(KILN_F32, 2, (int64_t[]){1, 2}, (float[]){1, 2});
  kiln_tensor *b = kiln_tensor_from(KILN_I64, 1, (int64_t[]){1}, (int64_t[]){7});
  ck_assert_int_eq(0, kiln_save_tensors(path, 2, (const char *[]){"a", "b"}, (kiln_tensor *[]){a, b}));
  ck_assert_int_eq(0, kiln_save_tensors_meta(path, 1, (const char *[]){"a"}, (kiln_tensor *[]){a},
                                             (const char *[]){"format", "pt", NULL}));
  kiln_tensor *got[1] = {NULL};
  ck_assert_int_eq(0, kiln_load_tensors(path, 1, (const char *[]){"a"}, got));
  EXPECT(got[0], ((int64_t[]){1, 2}), 1, 2);
  kiln_tensor *dst = kiln_zeros(KILN_F32, 2, (int64_t[]){1, 2});
  ck_assert_int_eq(0, kiln_load_tensors_into(path, 1, (const char *[]){"a"}, (kiln_tensor *[]){dst}));
  EXPECT(dst, ((int64_t[]){1, 2}), 1, 2);
  kiln_tensor_file *f = kiln_tensors_open(path);
  ck_assert_ptr_nonnull(f);
  kiln_tensor_info info;
  ck_assert_int_eq(0, kiln_tensors_info(f, 0, &info));
  ck_assert_str_eq("a", info.name);
  EXPECT(kiln_tensors_get(f, "a"), ((int64_t[]){1, 2}), 1, 2);
  kiln_tensors_close(f);
  unlink(path);
  kiln_scope_end();
}
END_TEST

/* The default generator's draws. */
START_TEST(test_random_literals) {
  kiln_scope_begin();
  kiln_manual_seed(3);
  kiln_tensor *x = kiln_tensor_from(KILN_F32, 2, (int64_t[]){2, 2}, (float[]){1, 2, 3, 4});
  kiln_tensor *u = kiln_rand_like(x), *z = kiln_randn_like(x), *d = kiln_dropout(x, 0.0, true);
  ck_assert_msg(u && z && d, "%s", kiln_last_error());
  EXPECT(d, ((int64_t[]){2, 2}), 1, 2, 3, 4);
  EXPECT(kiln_dropout(x, 0.5, false), ((int64_t[]){2, 2}), 1, 2, 3, 4);
  /* the first four numbers of seed 3's stream are kiln_rand's with seed 3 */
  double a[4], b[4];
  values(u, a, 4);
  values(kiln_rand(KILN_F32, 1, (int64_t[]){4}, 3), b, 4);
  for (int i = 0; i < 4; i++) ck_assert_double_eq(a[i], b[i]);
  kiln_scope_end();
}
END_TEST

/* The collectives, alone (one process), or their error without MPI. */
START_TEST(test_allreduce_literals) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_tensor_from(KILN_F32, 1, (int64_t[]){3}, (float[]){1, 2, 3});
  int64_t colls = kiln_dist_collectives();
  if (kiln_dist_size() < 0) {
    ck_assert_ptr_null(kiln_allreduce(x, KILN_REDUCE_SUM));
    ck_assert_ptr_nonnull(strstr(kiln_last_error(), "without MPI"));
    ck_assert_ptr_null(kiln_allreduce_(x, KILN_REDUCE_MEAN));
    ck_assert_int_eq(0, kiln_dist_collectives());
  } else {
    ck_assert_int_eq(1, kiln_dist_size());
    EXPECT(kiln_allreduce(x, KILN_REDUCE_SUM), ((int64_t[]){3}), 1, 2, 3);
    EXPECT(kiln_allreduce_(x, KILN_REDUCE_MEAN), ((int64_t[]){3}), 1, 2, 3);
    ck_assert_int_eq(colls + 2, kiln_dist_collectives()); /* eager: one each */
  }
  kiln_scope_end();
}
END_TEST

/* The header's version macros agree with each other and with the library. */
START_TEST(test_version) {
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", KILN_VERSION_MAJOR, KILN_VERSION_MINOR, KILN_VERSION_PATCH);
  ck_assert_str_eq(want, KILN_VERSION_STRING);
  ck_assert_str_eq(KILN_VERSION_STRING, kiln_version());
  ck_assert_int_eq(KILN_VERSION_MAJOR * 10000 + KILN_VERSION_MINOR * 100 + KILN_VERSION_PATCH, KILN_VERSION);
}
END_TEST

/* Every function-like macro named kiln_* in kiln.h is called in this file. */
START_TEST(test_every_macro_used) {
  char header[4096], *slash;
  snprintf(header, sizeof header, "%s", __FILE__);
  ck_assert_ptr_nonnull(slash = strrchr(header, '/'));
  snprintf(slash, sizeof header - (size_t)(slash - header), "/../include/kiln.h");
  FILE *hf = fopen(header, "r"), *sf = fopen(__FILE__, "r");
  ck_assert_msg(hf && sf, "cannot open %s or %s", header, __FILE__);
  static char self[1 << 17];
  size_t n = fread(self, 1, sizeof self - 1, sf);
  self[n] = 0;
  fclose(sf);
  char line[1024], missing[2048] = "";
  int macros = 0;
  while (fgets(line, sizeof line, hf)) {
    char name[128];
    if (sscanf(line, "#define %127[a-z0-9_](", name) != 1 || strncmp(name, "kiln_", 5) != 0) continue;
    if (!strchr(line, '(') || strchr(line, '(') != line + 8 + strlen(name)) continue; /* function-like only */
    macros++;
    char call[160];
    snprintf(call, sizeof call, "%s(", name);
    /* a call, not a longer name that ends the same way (kiln_add_ in kiln_add_( is fine: it is its own) */
    bool found = false;
    for (const char *p = strstr(self, call); p && !found; p = strstr(p + 1, call))
      found = p == self || !(p[-1] == '_' || (p[-1] >= 'a' && p[-1] <= 'z') || (p[-1] >= '0' && p[-1] <= '9'));
    if (!found) snprintf(missing + strlen(missing), sizeof missing - strlen(missing), " %s", name);
  }
  fclose(hf);
  ck_assert_int_ge(macros, 80);
  ck_assert_msg(!missing[0], "macros of kiln.h not called in tests/test_macros.c:%s", missing);
}
END_TEST

static Suite *macros_suite(void) {
  Suite *s = suite_create("macros");
  TCase *tc = tcase_create("literals");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_creation_literals);
  tcase_add_test(tc, test_view_literals);
  tcase_add_test(tc, test_pointwise);
  tcase_add_test(tc, test_reduction_literals);
  tcase_add_test(tc, test_nn_and_inplace);
  tcase_add_test(tc, test_cnn_literals);
  tcase_add_test(tc, test_autograd_and_compile_literals);
  tcase_add_test(tc, test_control_flow_literals);
  tcase_add_test(tc, test_lifetime_macros);
  tcase_add_test(tc, test_checked_lists);
  tcase_add_test(tc, test_tensor_file_literals);
  tcase_add_test(tc, test_random_literals);
  tcase_add_test(tc, test_allreduce_literals);
  tcase_add_test(tc, test_version);
  tcase_add_test(tc, test_every_macro_used);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(macros_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
