/* Hostile and edge inputs: shapes that overflow, negative sizes, ranks past
 * KILN_MAX_DIMS, axes out of range, dtypes an op does not take, NULL for
 * every pointer argument of the public API, tensors released twice and a
 * freed kiln_fn used again (both detected in every build). Each gives an
 * error naming the function and, where the API passes one, the caller's
 * file:line; none crashes. Then NaN, infinities, signed zeros and denormals:
 * compiled (LLVM) code gives what eager gives, NaN positions and signs
 * included. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kiln.h"

/* Bad sizes and NULL shapes on purpose: GCC sees some of them through the
 * access attributes in kiln.h and warns; what is tested here is the check
 * the library makes at run time. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wnonnull"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#pragma GCC diagnostic ignored "-Wstringop-overread"
#endif

static int n_cases; /* hostile calls checked, printed at the end */

/* The last error names "kiln_<fn>:" and, when line > 0, "test_hostile.c:<line>:". */
static void expect_error(const char *fn, int line, const char *what) {
  const char *e = kiln_last_error();
  char loc[64], name[64];
  snprintf(loc, sizeof loc, "test_hostile.c:%d: ", line);
  snprintf(name, sizeof name, "%s: ", fn);
  ck_assert_msg(strstr(e, name) != NULL, "%s: error \"%s\" does not name %s", what, e, fn);
  if (line > 0) ck_assert_msg(strstr(e, loc) != NULL, "%s: error \"%s\" does not name %s", what, e, loc);
  n_cases++;
}

/* expr must give NULL (or -1) and an error naming fn at this line. One line each. */
#define BAD(fn, expr)                                        \
  do {                                                       \
    kiln_clear_error();                                      \
    ck_assert_msg((expr) == NULL, "%s: not refused", #expr); \
    expect_error(fn, __LINE__, #expr);                       \
  } while (0)
#define BAD_RC(fn, expr)                                   \
  do {                                                     \
    kiln_clear_error();                                    \
    ck_assert_msg((expr) == -1, "%s: not refused", #expr); \
    expect_error(fn, __LINE__, #expr);                     \
  } while (0)
static kiln_tensor *f32(int ndim, const int64_t *shape) { return kiln_ones(KILN_F32, ndim, shape); }

static const int64_t S23[2] = {2, 3}, S3[1] = {3}, S11[2] = {1, 1};

/* ---- shapes, ranks, axes, dtypes ---- */

START_TEST(test_bad_shapes) {
  kiln_scope_begin();
  const int64_t big[2] = {INT64_MAX / 2, 4}, wide[3] = {1 << 22, 1 << 22, 1 << 22}, neg[2] = {2, -1},
                huge1[1] = {INT64_MAX}, nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  float dummy[4] = {0};
  /* creation: every maker refuses counts past int64, negative sizes, ranks past 8, unknown dtypes */
  BAD("kiln_zeros", kiln_zeros(KILN_F32, 2, big));
  BAD("kiln_ones", kiln_ones(KILN_F64, 3, wide));
  BAD("kiln_full", kiln_full(KILN_I64, 1, huge1, 1));
  BAD("kiln_randn", kiln_randn(KILN_F32, 2, big, 1));
  BAD("kiln_rand", kiln_rand(KILN_F32, 3, wide, 1));
  BAD("kiln_tensor_from", kiln_tensor_from(KILN_F32, 2, big, dummy));
  BAD("kiln_zeros", kiln_zeros(KILN_F32, 2, neg));
  BAD("kiln_randn", kiln_randn(KILN_F32, 2, neg, 1));
  BAD("kiln_tensor_from", kiln_tensor_from(KILN_F32, 2, neg, dummy));
  BAD("kiln_zeros", kiln_zeros(KILN_F32, 9, nine));
  BAD("kiln_ones", kiln_ones(KILN_F32, -1, S3));
  BAD("kiln_full", kiln_full(KILN_F32, INT32_MAX, S3, 0));
  BAD("kiln_zeros", kiln_zeros((kiln_dtype)7, 1, S3));
  BAD("kiln_scalar", kiln_scalar((kiln_dtype)-1, 1));
  BAD("kiln_arange", kiln_arange(KILN_F32, 0, 1e300, 1));
  BAD("kiln_arange", kiln_arange(KILN_F32, 0, 1, 0));
  BAD("kiln_arange", kiln_arange(KILN_F32, 0, NAN, 1));
  BAD("kiln_arange", kiln_arange(KILN_F32, -INFINITY, 0, 1));

  /* views: overflowing, negative, too many dims */
  kiln_tensor *a = f32(2, S23), *one = f32(2, S11);
  BAD("kiln_reshape", kiln_reshape(a, 2, big));
  BAD("kiln_reshape", kiln_reshape(a, 2, ((int64_t[]){-2, -3})));
  BAD("kiln_reshape", kiln_reshape(a, 2, ((int64_t[]){-1, -1})));
  BAD("kiln_reshape", kiln_reshape(a, 9, nine));
  BAD("kiln_reshape", kiln_reshape(a, 2, ((int64_t[]){0, -1})));
  BAD("kiln_expand", kiln_expand(one, 2, ((int64_t[]){INT64_MAX, INT64_MAX})));
  BAD("kiln_expand", kiln_expand(one, 3, wide));
  BAD("kiln_expand", kiln_expand(one, 2, ((int64_t[]){-2, 3})));
  BAD("kiln_expand", kiln_expand(one, 9, nine));
  BAD("kiln_expand", kiln_expand(a, 1, S3));
  kiln_tensor *r8 = kiln_reshape(one, 8, nine);
  ck_assert_ptr_nonnull(r8);
  BAD("kiln_unsqueeze", kiln_unsqueeze(r8, 0));
  BAD("kiln_slice", kiln_slice(a, 0, 0, 2, 0));
  BAD("kiln_slice", kiln_slice(a, 0, 0, 2, -1));
  BAD("kiln_slice", kiln_slice(a, 0, INT64_MIN, INT64_MAX, INT64_MIN));
  /* extreme bounds clamp (Python rules) rather than overflow */
  kiln_tensor *all = kiln_slice(a, 1, INT64_MIN, INT64_MAX, INT64_MAX);
  ck_assert_ptr_nonnull(all);
  ck_assert_int_eq(1, kiln_size(all, 1));
  /* two broadcast views whose result would overflow */
  kiln_tensor *col = kiln_expand(one, 2, ((int64_t[]){INT64_MAX / 4, 1})), *row = kiln_expand(one, 2, ((int64_t[]){1, INT64_MAX / 4}));
  if (col && row) BAD("kiln_add", kiln_add(col, row));
  else BAD("kiln_expand", kiln_expand(one, 2, ((int64_t[]){INT64_MAX / 4, 1})));
  kiln_scope_end();
}
END_TEST

START_TEST(test_bad_axes) {
  kiln_scope_begin();
  kiln_tensor *a = f32(2, S23), *s = kiln_scalar(KILN_F32, 1);
  kiln_tensor *ia = kiln_arange(KILN_I64, 0, 2, 1);
  const int axes_oob[1] = {2}, axes_dup[2] = {0, -2}, axes_min[1] = {INT32_MIN};
  BAD("kiln_sum", kiln_sum(a, 2, false));
  BAD("kiln_sum", kiln_sum(a, -3, false));
  BAD("kiln_mean", kiln_mean(a, INT32_MAX, true));
  BAD("kiln_max", kiln_max(a, INT32_MIN, false));
  BAD("kiln_min", kiln_min(s, 1, false));
  BAD("kiln_var", kiln_var(a, 5, 1, false));
  BAD("kiln_argmax", kiln_argmax(a, -3, false));
  BAD("kiln_sum_axes", kiln_sum_axes(a, axes_oob, 1, false));
  BAD("kiln_mean_axes", kiln_mean_axes(a, axes_dup, 2, false));
  BAD("kiln_max_axes", kiln_max_axes(a, axes_min, 1, false));
  BAD("kiln_min_axes", kiln_min_axes(a, axes_oob, -1, false));
  BAD("kiln_var_axes", kiln_var_axes(a, axes_oob, 9, 0, false));
  BAD("kiln_transpose", kiln_transpose(a, 0, 2));
  BAD("kiln_transpose", kiln_transpose(a, INT32_MIN, 0));
  BAD("kiln_permute", kiln_permute(a, ((int[]){0, 0})));
  BAD("kiln_permute", kiln_permute(a, ((int[]){1, 2})));
  BAD("kiln_permute", kiln_permute(a, ((int[]){0, -3})));
  BAD("kiln_squeeze", kiln_squeeze(a, 2));
  BAD("kiln_unsqueeze", kiln_unsqueeze(a, 3));
  BAD("kiln_unsqueeze", kiln_unsqueeze(a, -4));
  BAD("kiln_slice", kiln_slice(a, 2, 0, 1, 1));
  BAD("kiln_slice", kiln_slice(s, 0, 0, 1, 1));
  BAD("kiln_cat", kiln_cat(((kiln_tensor *[]){a, a}), 2, 2));
  BAD("kiln_cat", kiln_cat(((kiln_tensor *[]){a, a}), 2, INT32_MIN));
  BAD("kiln_cat", kiln_cat(((kiln_tensor *[]){a}), 0, 0));
  BAD("kiln_cat", kiln_cat(((kiln_tensor *[]){a}), -1, 0));
  BAD("kiln_stack", kiln_stack(((kiln_tensor *[]){a, a}), 2, 3));
  BAD("kiln_stack", kiln_stack(((kiln_tensor *[]){a}), -5, 0));
  BAD("kiln_softmax", kiln_softmax(a, 2));
  BAD("kiln_log_softmax", kiln_log_softmax(a, -3));
  BAD("kiln_index_select", kiln_index_select(a, 2, ia));
  BAD("kiln_index_select", kiln_index_select(a, 0, kiln_arange(KILN_I64, 1, 3, 1)));
  BAD("kiln_index_select", kiln_index_select(a, 0, kiln_full(KILN_I64, 1, S3, -1)));
  BAD("kiln_embedding", kiln_embedding(a, kiln_full(KILN_I64, 1, S3, INT64_MAX)));
  BAD("kiln_embedding", kiln_embedding(a, kiln_full(KILN_I64, 1, S3, INT64_MIN)));
  BAD("kiln_cross_entropy", kiln_cross_entropy(a, kiln_full(KILN_I64, 1, ((int64_t[]){2}), 3)));
  BAD("kiln_cross_entropy", kiln_cross_entropy(a, kiln_full(KILN_I64, 1, ((int64_t[]){2}), -1)));
  kiln_scope_end();
}
END_TEST

START_TEST(test_bad_dtypes) {
  kiln_scope_begin();
  kiln_tensor *f = f32(2, S23), *i = kiln_ones(KILN_I64, 2, S23), *b = kiln_gt(f, kiln_scalar(KILN_F32, 0));
  kiln_tensor *sq = kiln_ones(KILN_I64, 2, ((int64_t[]){3, 3}));
  BAD("kiln_matmul", kiln_matmul(sq, sq));
  BAD("kiln_matmul", kiln_matmul(kiln_cast(sq, KILN_BOOL), kiln_cast(sq, KILN_BOOL)));
  BAD("kiln_softmax", kiln_softmax(i, 0));
  BAD("kiln_log_softmax", kiln_log_softmax(b, 0));
  BAD("kiln_layer_norm", kiln_layer_norm(i, NULL, NULL, 1e-5));
  BAD("kiln_exp", kiln_exp(i));
  BAD("kiln_log", kiln_log(b));
  BAD("kiln_tanh", kiln_tanh(b));
  BAD("kiln_gelu", kiln_gelu(i));
  BAD("kiln_sqrt", kiln_sqrt(i));
  BAD("kiln_where", kiln_where(f, f, f));
  BAD("kiln_where", kiln_where(i, f, f));
  BAD("kiln_embedding", kiln_embedding(f, kiln_ones(KILN_F32, 1, S3)));
  BAD("kiln_index_select", kiln_index_select(f, 0, kiln_ones(KILN_F32, 1, S3)));
  BAD("kiln_cross_entropy", kiln_cross_entropy(f, kiln_ones(KILN_F32, 1, ((int64_t[]){2}))));
  BAD("kiln_randn", kiln_randn(KILN_I64, 1, S3, 1));
  BAD("kiln_rand", kiln_rand(KILN_BOOL, 1, S3, 1));
  BAD("kiln_arange", kiln_arange(KILN_BOOL, 0, 3, 1));
  BAD("kiln_cast", kiln_cast(f, (kiln_dtype)9));
  BAD("kiln_mean", kiln_mean(i, 0, false));
  BAD("kiln_var", kiln_var(b, 0, 1, false));
  /* autograd needs floats and a one-element loss */
  BAD_RC("kiln_backward", kiln_backward(kiln_sum_all(i)));
  BAD_RC("kiln_backward", kiln_backward(f));
  kiln_scope_end();
}
END_TEST

/* ---- NULL for every pointer argument ---- */

static int body_id(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_mul(in[0], in[0]);
  return out[0] ? 0 : -1;
}

START_TEST(test_null_everywhere) {
  kiln_scope_begin();
  kiln_tensor *a = f32(2, S23), *N = NULL;
  kiln_tensor *idx = kiln_arange(KILN_I64, 0, 2, 1), *tg = kiln_arange(KILN_I64, 0, 2, 1);
  float buf[6];
  char desc[64];

  /* makers: a NULL shape with rank > 0, NULL data */
  BAD("kiln_tensor_from", kiln_tensor_from(KILN_F32, 2, NULL, buf));
  BAD("kiln_tensor_from", kiln_tensor_from(KILN_F32, 2, S23, NULL));
  BAD("kiln_zeros", kiln_zeros(KILN_F32, 1, NULL));
  BAD("kiln_ones", kiln_ones(KILN_F32, 1, NULL));
  BAD("kiln_full", kiln_full(KILN_F32, 1, NULL, 2));
  BAD("kiln_randn", kiln_randn(KILN_F32, 1, NULL, 1));
  BAD("kiln_rand", kiln_rand(KILN_F32, 1, NULL, 1));
  /* rank 0 needs no shape: a NULL one is fine */
  ck_assert_ptr_nonnull(kiln_zeros(KILN_F32, 0, NULL));

  /* inspection: a sentinel, never a crash */
  ck_assert_int_eq(-1, kiln_ndim(NULL));
  ck_assert_int_eq(-1, kiln_size(NULL, 0));
  ck_assert_int_eq(-1, kiln_numel(NULL));
  ck_assert_int_eq(-1, kiln_stride(NULL, 0));
  ck_assert(!kiln_is_contiguous(NULL));
  ck_assert_int_eq(KILN_F32, kiln_type(NULL));
  ck_assert_str_eq("(null)", kiln_describe(NULL, desc, sizeof desc));
  ck_assert_ptr_null(kiln_describe(a, NULL, 10));
  ck_assert_ptr_eq(desc, kiln_describe(a, desc, 0));
  ck_assert_str_eq("?", kiln_dtype_name((kiln_dtype)99));
  ck_assert_uint_eq(0, kiln_dtype_size((kiln_dtype)99));
  BAD_RC("kiln_read", kiln_read(NULL, buf, sizeof buf));
  BAD_RC("kiln_read", kiln_read(a, NULL, sizeof buf));
  kiln_clear_error();
  ck_assert(isnan(kiln_item(NULL)));
  expect_error("kiln_item", __LINE__ - 1, "kiln_item(NULL)");
  kiln_print(NULL); /* prints "(null)" */
  n_cases += 14;

  /* lifetime */
  ck_assert_ptr_null(kiln_retain(NULL));
  kiln_release(NULL);
  ck_assert_ptr_null(kiln_keep(NULL));
  n_cases += 3;

  /* views */
  BAD("kiln_reshape", kiln_reshape(N, 1, S3));
  BAD("kiln_reshape", kiln_reshape(a, 1, NULL));
  BAD("kiln_transpose", kiln_transpose(N, 0, 1));
  BAD("kiln_permute", kiln_permute(N, ((int[]){1, 0})));
  BAD("kiln_permute", kiln_permute(a, NULL));
  BAD("kiln_expand", kiln_expand(N, 1, S3));
  BAD("kiln_expand", kiln_expand(a, 2, NULL));
  BAD("kiln_squeeze", kiln_squeeze(N, 0));
  BAD("kiln_unsqueeze", kiln_unsqueeze(N, 0));
  BAD("kiln_slice", kiln_slice(N, 0, 0, 1, 1));
  BAD("kiln_contiguous", kiln_contiguous(N));
  BAD("kiln_cat", kiln_cat(NULL, 2, 0));
  BAD("kiln_cat", kiln_cat(((kiln_tensor *[]){a, NULL}), 2, 0));
  BAD("kiln_stack", kiln_stack(NULL, 2, 0));
  BAD("kiln_stack", kiln_stack(((kiln_tensor *[]){NULL, a}), 2, 0));
  BAD("kiln_cast", kiln_cast(N, KILN_F64));

  /* every pointwise op, NULL in each position */
#define BIN_NULL(name)                                             \
  BAD("kiln_" #name, kiln_##name##_at(NULL, a, __FILE__, __LINE__)); \
  BAD("kiln_" #name, kiln_##name##_at(a, NULL, __FILE__, __LINE__));
#define UN_NULL(name) BAD("kiln_" #name, kiln_##name##_at(NULL, __FILE__, __LINE__));
  KILN_BINARY_OPS(BIN_NULL)
  KILN_UNARY_OPS(UN_NULL)
#undef BIN_NULL
#undef UN_NULL
  kiln_tensor *c = kiln_gt(a, kiln_scalar(KILN_F32, 0));
  BAD("kiln_where", kiln_where(NULL, a, a));
  BAD("kiln_where", kiln_where(c, NULL, a));
  BAD("kiln_where", kiln_where(c, a, NULL));

  /* reductions */
  BAD("kiln_sum", kiln_sum(N, 0, false));
  BAD("kiln_mean", kiln_mean(N, 0, false));
  BAD("kiln_max", kiln_max(N, 0, false));
  BAD("kiln_min", kiln_min(N, 0, false));
  BAD("kiln_var", kiln_var(N, 0, 1, false));
  BAD("kiln_argmax", kiln_argmax(N, 0, false));
  BAD("kiln_sum_axes", kiln_sum_axes(N, NULL, 0, false));
  BAD("kiln_sum_axes", kiln_sum_axes(a, NULL, 1, false));
  BAD("kiln_mean_axes", kiln_mean_axes(a, NULL, 2, false));
  BAD("kiln_max_axes", kiln_max_axes(a, NULL, 1, false));
  BAD("kiln_min_axes", kiln_min_axes(N, NULL, 0, false));
  BAD("kiln_var_axes", kiln_var_axes(a, NULL, 1, 1, false));

  /* matmul and NN */
  kiln_tensor *w = f32(2, ((int64_t[]){3, 2}));
  BAD("kiln_matmul", kiln_matmul(N, w));
  BAD("kiln_matmul", kiln_matmul(a, NULL));
  BAD("kiln_softmax", kiln_softmax(N, 0));
  BAD("kiln_log_softmax", kiln_log_softmax(N, 0));
  BAD("kiln_layer_norm", kiln_layer_norm(N, NULL, NULL, 1e-5));
  BAD("kiln_embedding", kiln_embedding(N, idx));
  BAD("kiln_embedding", kiln_embedding(a, NULL));
  BAD("kiln_index_select", kiln_index_select(N, 0, idx));
  BAD("kiln_index_select", kiln_index_select(a, 0, NULL));
  BAD("kiln_cross_entropy", kiln_cross_entropy(N, tg));
  BAD("kiln_cross_entropy", kiln_cross_entropy(a, NULL));
  BAD("kiln_mse_loss", kiln_mse_loss(N, a));
  BAD("kiln_mse_loss", kiln_mse_loss(a, NULL));

  /* in place */
  BAD("kiln_add_", kiln_add_(N, a));
  BAD("kiln_add_", kiln_add_(a, NULL));
  BAD("kiln_sub_", kiln_sub_(N, a));
  BAD("kiln_sub_", kiln_sub_(a, NULL));
  BAD("kiln_mul_", kiln_mul_(N, a));
  BAD("kiln_mul_", kiln_mul_(a, NULL));
  BAD("kiln_copy_", kiln_copy_(N, a));
  BAD("kiln_copy_", kiln_copy_(a, NULL));
  BAD("kiln_fill_", kiln_fill_(N, 1));
  BAD("kiln_zero_", kiln_zero_(N));

  /* autograd */
  kiln_tensor *g[1];
  kiln_requires_grad(NULL, true);
  ck_assert(!kiln_get_requires_grad(NULL));
  ck_assert_ptr_null(kiln_grad(NULL));
  kiln_zero_grad(NULL);
  n_cases += 4;
  BAD_RC("kiln_backward", kiln_backward(N));
  BAD_RC("kiln_backward_with", kiln_backward_with(N, a));
  BAD_RC("kiln_backward_with", kiln_backward_with(a, NULL));
  kiln_tensor *p = kiln_ones(KILN_F32, 1, S3);
  kiln_requires_grad(p, true);
  kiln_tensor *loss = kiln_sum_all(kiln_mul(p, p));
  BAD_RC("kiln_grad_of", kiln_grad_of(N, &p, 1, g));
  BAD_RC("kiln_grad_of", kiln_grad_of(loss, NULL, 1, g));
  BAD_RC("kiln_grad_of", kiln_grad_of(loss, &p, 1, NULL));
  BAD_RC("kiln_grad_of", kiln_grad_of(loss, ((kiln_tensor *[]){NULL}), 1, g));

  /* compile */
  kiln_options o = {.n_in = 1, .n_out = 1};
  BAD("kiln_compile", kiln_compile(NULL, NULL, &o));
  BAD("kiln_compile", kiln_compile(body_id, NULL, &(kiln_options){.n_in = -1}));
  kiln_fn *fn = kiln_compile(body_id, NULL, &o);
  ck_assert_ptr_nonnull(fn);
  kiln_tensor *y;
  BAD_RC("kiln_call", kiln_call(NULL, &a, &y));
  BAD_RC("kiln_call", kiln_call(fn, NULL, &y));
  BAD_RC("kiln_call", kiln_call(fn, &a, NULL));
  BAD_RC("kiln_call", kiln_call(fn, ((kiln_tensor *[]){NULL}), &y));
  kiln_fn_stats st;
  BAD_RC("kiln_mark_dynamic", kiln_mark_dynamic(NULL, 0, 0));
  BAD_RC("kiln_fn_get_stats", kiln_fn_get_stats(NULL, &st));
  BAD_RC("kiln_fn_get_stats", kiln_fn_get_stats(fn, NULL));
  BAD("kiln_fn_graph", kiln_fn_graph(NULL, 0));
  BAD_RC("kiln_save", kiln_save(NULL, "x.txt"));
  BAD_RC("kiln_save", kiln_save(fn, NULL));
  BAD("kiln_load", kiln_load(NULL));
  BAD("kiln_load", kiln_load_string(NULL));
  kiln_fn_free(NULL);
  n_cases++;
  /* a NULL file in an _at call: the message just has no location */
  kiln_clear_error();
  ck_assert_ptr_null(kiln_add_at(a, NULL, NULL, 7));
  ck_assert_str_eq("kiln_add: input 1 is NULL", kiln_last_error());
  n_cases++;
  /* and the library still works */
  ck_assert_int_eq(0, kiln_call(fn, &a, &y));
  ck_assert_double_eq(6, kiln_item(kiln_sum_all(y)));
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* ---- released tensors and freed functions (every build) ---- */

START_TEST(test_release_twice) {
  kiln_tensor *t = kiln_ones(KILN_F32, 2, S23);
  kiln_release(t);
  kiln_clear_error();
  kiln_release(t); /* detected: an error and a line on stderr, no crash */
  expect_error("kiln_release", __LINE__ - 1, "kiln_release(t)");
  ck_assert_msg(strstr(kiln_last_error(), "tensor was already released"), "%s", kiln_last_error());
  /* any op given it says so, with the caller's line */
  BAD("kiln_add", kiln_add(t, t));
  BAD("kiln_exp", kiln_exp(t));
  BAD("kiln_sum", kiln_sum(t, 0, false));
  BAD("kiln_reshape", kiln_reshape(t, 1, (int64_t[]){6}));
  BAD("kiln_softmax", kiln_softmax(t, 0));
  BAD("kiln_cast", kiln_cast(t, KILN_F32));
  BAD("kiln_contiguous", kiln_contiguous(t));
  BAD("kiln_cat", kiln_cat(&t, 1, 0));
  BAD("kiln_add_", kiln_add_(t, t));
  BAD_RC("kiln_read", kiln_read(t, (float[6]){0}, 6 * sizeof(float)));
  BAD_RC("kiln_backward", kiln_backward(t));
  BAD("kiln_retain", kiln_retain(t));
  BAD("kiln_keep", kiln_keep(t));
  kiln_clear_error();
  ck_assert(isnan(kiln_item(t)));
  expect_error("kiln_item", __LINE__ - 1, "kiln_item(t)");
  kiln_clear_error();
  kiln_print(t);
  expect_error("kiln_print", __LINE__ - 1, "kiln_print(t)");
  /* the inspectors give their NULL answers */
  ck_assert_int_eq(-1, kiln_ndim(t));
  ck_assert_int_eq(-1, kiln_numel(t));
  ck_assert_int_eq(-1, kiln_size(t, 0));
  ck_assert_ptr_null(kiln_grad(t));
  kiln_options o = {.n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(body_id, NULL, &o);
  kiln_tensor *y = NULL;
  BAD_RC("kiln_call", kiln_call(fn, &t, &y));
  kiln_fn_free(fn);

  /* released while its scope still owns it: refused at that line, and the
   * scope releases it once, as it should */
  kiln_scope_begin();
  kiln_tensor *s = kiln_zeros(KILN_F32, 1, S3);
  kiln_clear_error();
  kiln_release(s);
  expect_error("kiln_release", __LINE__ - 1, "kiln_release(s)");
  ck_assert_msg(strstr(kiln_last_error(), "belongs to a scope"), "%s", kiln_last_error());
  ck_assert_int_eq(3, kiln_numel(s)); /* still alive */
  kiln_tensor *r = kiln_retain(s);      /* a reference of our own: that one we may release */
  kiln_clear_error();
  kiln_release(r);
  ck_assert_str_eq("", kiln_last_error());
  kiln_release(s); /* the retained reference is gone: the scope's is not ours */
  ck_assert_msg(strstr(kiln_last_error(), "belongs to a scope"), "%s", kiln_last_error());
  kiln_clear_error();
  kiln_scope_end();
  ck_assert_str_eq("", kiln_last_error());
  /* the library goes on working */
  kiln_scope_begin();
  ck_assert_double_eq(3, kiln_item(kiln_sum_all(kiln_ones(KILN_F32, 1, S3))));
  kiln_scope_end();
}
END_TEST

START_TEST(test_freed_fn) {
  kiln_options o = {.name = "gone", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(body_id, NULL, &o);
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_F32, 1, S3), *y;
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  kiln_fn_free(fn);
  BAD_RC("kiln_call", kiln_call(fn, &x, &y));
  ck_assert_msg(strstr(kiln_last_error(), "fn was freed"), "%s", kiln_last_error());
  kiln_fn_stats st;
  BAD_RC("kiln_fn_get_stats", kiln_fn_get_stats(fn, &st));
  BAD_RC("kiln_mark_dynamic", kiln_mark_dynamic(fn, 0, 0));
  BAD("kiln_fn_graph", kiln_fn_graph(fn, 0));
  BAD_RC("kiln_save", kiln_save(fn, "never.txt"));
  kiln_clear_error();
  kiln_fn_free(fn); /* twice: reported, not a double free */
  expect_error("kiln_fn_free", __LINE__ - 1, "kiln_fn_free(fn)");
  ck_assert_msg(strstr(kiln_last_error(), "kiln_fn_free: fn was freed"), "%s", kiln_last_error());
  n_cases++;
  ck_assert_int_eq(-1, access("never.txt", F_OK));
  kiln_scope_end();
}
END_TEST

/* ---- non-finite values: compiled code as eager ---- */

/* Specials and ordinary values, 37 of them so vector loops have a tail. */
static const float specials[37] = {
    NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, -1.0f, FLT_MIN, -FLT_MIN, FLT_MIN / 4, -FLT_MIN / 4,
    FLT_TRUE_MIN, -FLT_TRUE_MIN, FLT_MAX, -FLT_MAX, 88.0f, 89.0f, -88.0f, -104.0f, 1e-20f, -1e-20f, 20.0f, -20.0f,
    0.5f, -0.5f, 3.0f, -3.0f, 1e30f, -1e30f, 1e-38f, 10.0f, -10.0f, 2.0f, NAN, 7.0f, -7.0f};

/* The rows the reductions and row ops see: the specials without the huge
 * finite values, whose sums overflow to an infinity whose sign depends on the
 * summation order (eager's 16 lanes vs compiled vector order: both are
 * rounding, not propagation). */
static float row_specials(int i) {
  float v = specials[i];
  return isfinite(v) && fabsf(v) > 1e29f ? (v > 0 ? 5.0f : -5.0f) : v;
}

/* Compares compiled against eager element by element: NaN where eager has
 * NaN, the same sign on every non-NaN (zeros and infinities included, but
 * for max/min reductions, where max(-0, +0) may give either zero), the same
 * value to a few ulps. Returns the number of mismatches (first one printed). */
static int compare_special(const char *what, kiln_tensor *got, kiln_tensor *want, bool any_zero) {
  ck_assert_ptr_nonnull(got);
  ck_assert_ptr_nonnull(want);
  ck_assert_int_eq(kiln_numel(want), kiln_numel(got));
  int64_t n = kiln_numel(want);
  kiln_scope_begin();
  float *g = malloc(sizeof(float) * (size_t)(n + 1)), *w = malloc(sizeof(float) * (size_t)(n + 1));
  ck_assert_int_eq(0, kiln_read(kiln_cast(got, KILN_F32), g, sizeof(float) * (size_t)n));
  ck_assert_int_eq(0, kiln_read(kiln_cast(want, KILN_F32), w, sizeof(float) * (size_t)n));
  kiln_scope_end();
  int bad = 0;
  for (int64_t i = 0; i < n; i++) {
    bool ok;
    if (isnan(w[i]) || isnan(g[i])) ok = isnan(w[i]) && isnan(g[i]);
    else if (w[i] == 0 && any_zero) ok = g[i] == 0;
    else if (isinf(w[i]) || w[i] == 0) ok = memcmp(&g[i], &w[i], sizeof *g) == 0;
    else ok = signbit(g[i]) == signbit(w[i]) && fabsf(g[i] - w[i]) <= 4 * FLT_EPSILON * fabsf(w[i]) + 1e-37f;
    if (!ok && bad++ == 0)
      fprintf(stderr, "%s: element %lld: compiled %a, eager %a\n", what, (long long)i, (double)g[i], (double)w[i]);
  }
  free(g), free(w);
  return bad;
}

typedef kiln_tensor *(*unary_at)(kiln_tensor *, const char *, int);
typedef kiln_tensor *(*binary_at)(kiln_tensor *, kiln_tensor *, const char *, int);

/* One body per op family, the op picked through ctx. */
typedef struct special_op {
  const char *name;
  unary_at un;
  binary_at bin;
  int kind; /* 0 unary, 1 binary, 2 reduce/NN (by name) */
} special_op;

static kiln_tensor *apply(const special_op *op, kiln_tensor *x, kiln_tensor *y) {
  if (op->kind == 0) return op->un(x, __FILE__, __LINE__);
  if (op->kind == 1) return op->bin(x, y, __FILE__, __LINE__);
  const char *n = op->name;
  if (!strcmp(n, "sum_rows")) return kiln_sum(x, 1, false);
  if (!strcmp(n, "sum_cols")) return kiln_sum(x, 0, false);
  if (!strcmp(n, "max_rows")) return kiln_max(x, 1, false);
  if (!strcmp(n, "max_cols")) return kiln_max(x, 0, true);
  if (!strcmp(n, "min_rows")) return kiln_min(x, 1, false);
  if (!strcmp(n, "min_cols")) return kiln_min(x, 0, false);
  if (!strcmp(n, "mean_rows")) return kiln_mean(x, 1, false);
  if (!strcmp(n, "softmax")) return kiln_softmax(x, -1);
  if (!strcmp(n, "log_softmax")) return kiln_log_softmax(x, -1);
  if (!strcmp(n, "layer_norm")) return kiln_layer_norm(x, NULL, NULL, 1e-5);
  if (!strcmp(n, "exp_sum")) return kiln_sum(kiln_exp(x), 1, false);
  if (!strcmp(n, "where_nan")) return kiln_where(kiln_gt(x, y), x, y);
  return NULL;
}

static int special_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = apply(ctx, in[0], in[1]);
  return out[0] ? 0 : -1;
}

START_TEST(test_nonfinite_compiled_as_eager) {
  static special_op ops[] = {
#define UN(name) {#name, kiln_##name##_at, NULL, 0},
#define BIN(name) {#name, NULL, kiln_##name##_at, 1},
      KILN_UNARY_OPS(UN) KILN_BINARY_OPS(BIN)
#undef UN
#undef BIN
      {"sum_rows", NULL, NULL, 2}, {"sum_cols", NULL, NULL, 2}, {"max_rows", NULL, NULL, 2}, {"max_cols", NULL, NULL, 2},
      {"min_rows", NULL, NULL, 2}, {"min_cols", NULL, NULL, 2}, {"mean_rows", NULL, NULL, 2}, {"softmax", NULL, NULL, 2},
      {"log_softmax", NULL, NULL, 2}, {"layer_norm", NULL, NULL, 2}, {"exp_sum", NULL, NULL, 2}, {"where_nan", NULL, NULL, 2},
  };
  int n_ops = (int)(sizeof ops / sizeof *ops), failures = 0;
  kiln_scope_begin();
  /* x: the specials down a column, against every special across (37,37) for binary ops */
  kiln_tensor *xs = kiln_tensor_from(KILN_F32, 1, ((int64_t[]){37}), specials);
  kiln_tensor *x = kiln_contiguous(kiln_expand(kiln_reshape(xs, 2, ((int64_t[]){37, 1})), 2, ((int64_t[]){37, 37})));
  kiln_tensor *y = kiln_contiguous(kiln_transpose(x, 0, 1));
  /* rows that mix the specials for the reductions (each row a different rotation) */
  float rows[37 * 36];
  for (int i = 0; i < 37 * 36; i++) rows[i] = row_specials((3 + i) / 37);
  kiln_tensor *m = kiln_tensor_from(KILN_F32, 2, ((int64_t[]){37, 36}), rows);
  ck_assert_ptr_nonnull(m);
  for (int k = 0; k < n_ops; k++) {
    kiln_options o = {.name = ops[k].name, .n_in = 2, .n_out = 1, .backend = KILN_BACKEND_LLVM};
    kiln_fn *fn = kiln_compile(special_body, &ops[k], &o);
    kiln_tensor *in[2] = {ops[k].kind == 2 ? m : x, ops[k].kind == 2 ? kiln_transpose(m, 0, 1) : y};
    if (ops[k].kind == 2) in[1] = kiln_contiguous(kiln_slice(m, 0, 0, 37, 1)); /* same shape as m */
    kiln_tensor *want = apply(&ops[k], in[0], in[1]), *got = NULL;
    ck_assert_msg(want != NULL, "%s: %s", ops[k].name, kiln_last_error());
    ck_assert_int_eq(0, kiln_call(fn, in, &got)); /* traced */
    ck_assert_int_eq(0, kiln_call(fn, in, &got)); /* compiled */
    kiln_fn_stats st;
    kiln_fn_get_stats(fn, &st);
    ck_assert_int_eq(1, st.hits);
    bool extreme = !strncmp(ops[k].name, "max_", 4) || !strncmp(ops[k].name, "min_", 4);
    failures += compare_special(ops[k].name, got, want, extreme) > 0;
    n_cases++;
    kiln_fn_free(fn);
  }
  kiln_scope_end();
  ck_assert_msg(failures == 0, "%d of %d ops differ between compiled and eager on non-finite inputs (see stderr)",
                failures, n_ops);
}
END_TEST

int main(void) {
  Suite *s = suite_create("hostile");
  TCase *tc = tcase_create("hostile");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_bad_shapes);
  tcase_add_test(tc, test_bad_axes);
  tcase_add_test(tc, test_bad_dtypes);
  tcase_add_test(tc, test_null_everywhere);
  tcase_add_test(tc, test_release_twice);
  tcase_add_test(tc, test_freed_fn);
  tcase_add_test(tc, test_nonfinite_compiled_as_eager);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_set_fork_status(sr, CK_NOFORK); /* one process, so the case count adds up */
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  printf("hostile: %d hostile calls checked\n", n_cases);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
