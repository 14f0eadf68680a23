/* Error paths: every bad call returns NULL (or -1, or NaN) without aborting,
 * and kiln_last_error() names the op and the caller's file:line, plus the
 * shapes where they are the problem. After each error the library keeps
 * working. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kiln.h"

/* Bad sizes and NULL shapes on purpose: GCC sees some of them through the
 * access attributes in kiln.h and warns; what is tested here is the check
 * the library makes at run time. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wnonnull"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#pragma GCC diagnostic ignored "-Wstringop-overread"
#endif

/* Checks the message of the last error: "test_errors.c:<line>: <op>: ...",
 * plus up to two more fragments it must contain (NULL: none). */
static void expect_error(int line, const char *op, const char *frag1, const char *frag2)
{
  const char *e = kiln_last_error();
  ck_assert_ptr_nonnull(e);
  char loc[64], opc[64];
  snprintf(loc, sizeof loc, "test_errors.c:%d", line);
  snprintf(opc, sizeof opc, "%s:", op);
  ck_assert_msg(strstr(e, loc) != NULL, "error \"%s\" does not name %s", e, loc);
  ck_assert_msg(strstr(e, opc) != NULL, "error \"%s\" does not name %s", e, op);
  if (frag1)
    ck_assert_msg(strstr(e, frag1) != NULL, "error \"%s\" does not mention %s", e, frag1);
  if (frag2)
    ck_assert_msg(strstr(e, frag2) != NULL, "error \"%s\" does not mention %s", e, frag2);
}

/* A valid op after an error still works. */
static void still_works(void)
{
  kiln_scope_begin();
  float av[3] = {1, 2, 3};
  kiln_tensor *a = kiln_tensor_from(KILN_F32, 1, (int64_t[]){3}, av);
  kiln_tensor *b = kiln_add(a, kiln_scalar(KILN_F32, 0.5));
  ck_assert_msg(b != NULL, "valid op after an error failed: %s", kiln_last_error());
  float bv[3];
  ck_assert_int_eq(0, kiln_read(b, bv, sizeof bv));
  for (int i = 0; i < 3; i++)
    ck_assert_float_eq(av[i] + 0.5f, bv[i]);
  kiln_scope_end();
}

static kiln_tensor *f32(int ndim, const int64_t *shape) { return kiln_ones(KILN_F32, ndim, shape); }

static const int64_t S23[2] = {2, 3}, S4[1] = {4}, S45[2] = {4, 5}, S22[2] = {2, 2}, S3[1] = {3};

START_TEST(test_clear_error)
{
  kiln_scope_begin();
  kiln_clear_error();
  ck_assert_str_eq("", kiln_last_error());
  ck_assert_ptr_null(kiln_reshape(f32(1, S4), 1, S3));
  ck_assert_str_ne("", kiln_last_error());
  kiln_clear_error();
  ck_assert_str_eq("", kiln_last_error());
  kiln_scope_end();
}
END_TEST

START_TEST(test_broadcast_mismatch)
{
  kiln_scope_begin();
  kiln_tensor *a = f32(2, S23), *b = f32(1, S4);
  kiln_clear_error();
  int line = __LINE__ + 1;
  kiln_tensor *r = kiln_add(a, b);
  ck_assert_ptr_null(r);
  expect_error(line, "kiln_add", "[2,3]", "[4]");
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_mul(b, a));
  expect_error(line, "kiln_mul", "[4]", "[2,3]");
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_mse_loss(f32(1, S3), b));
  expect_error(line, "kiln_mse_loss", NULL, NULL);
  still_works();
  kiln_scope_end();
}
END_TEST

START_TEST(test_matmul_errors)
{
  kiln_scope_begin();
  kiln_tensor *a = f32(2, S23), *b = f32(2, S45);
  int line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_matmul(a, b));
  expect_error(line, "kiln_matmul", "[2,3]", "[4,5]");
  still_works();

  /* Batch dims that do not broadcast. */
  kiln_tensor *p = kiln_ones(KILN_F32, 3, ((int64_t[]){2, 3, 4}));
  kiln_tensor *q = kiln_ones(KILN_F32, 3, ((int64_t[]){3, 4, 5}));
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_matmul(p, q));
  expect_error(line, "kiln_matmul", NULL, NULL);
  still_works();

  kiln_tensor *ia = kiln_ones(KILN_I64, 2, S22), *ib = kiln_ones(KILN_I64, 2, S22);
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_matmul(ia, ib));
  expect_error(line, "kiln_matmul", NULL, NULL);
  still_works();

  kiln_tensor *ba = kiln_ones(KILN_BOOL, 2, S22), *bb = kiln_ones(KILN_BOOL, 2, S22);
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_matmul(ba, bb));
  expect_error(line, "kiln_matmul", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_matmul(kiln_scalar(KILN_F32, 2), a));
  expect_error(line, "kiln_matmul", NULL, NULL);
  still_works();
  kiln_scope_end();
}
END_TEST

START_TEST(test_shape_op_errors)
{
  kiln_scope_begin();
  kiln_tensor *a = f32(2, S23);

  int line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_reshape(a, 1, S4));
  expect_error(line, "kiln_reshape", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_reshape(a, 2, ((int64_t[]){-1, -1})));
  expect_error(line, "kiln_reshape", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_reshape(a, 2, ((int64_t[]){4, -1})));
  expect_error(line, "kiln_reshape", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_transpose(a, 0, 2));
  expect_error(line, "kiln_transpose", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_permute(a, ((int[]){0, 2})));
  expect_error(line, "kiln_permute", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_permute(a, ((int[]){1, 1})));
  expect_error(line, "kiln_permute", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_squeeze(a, 2));
  expect_error(line, "kiln_squeeze", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_squeeze(a, -3));
  expect_error(line, "kiln_squeeze", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_unsqueeze(a, 3));
  expect_error(line, "kiln_unsqueeze", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_expand(a, 2, ((int64_t[]){2, 4})));
  expect_error(line, "kiln_expand", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_expand(a, 1, S3));
  expect_error(line, "kiln_expand", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_slice(a, 1, 0, 3, 0));
  expect_error(line, "kiln_slice", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_slice(a, 1, 3, 0, -1));
  expect_error(line, "kiln_slice", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_slice(a, 2, 0, 1, 1));
  expect_error(line, "kiln_slice", NULL, NULL);
  still_works();
  kiln_scope_end();
}
END_TEST

START_TEST(test_axis_errors)
{
  kiln_scope_begin();
  kiln_tensor *a = f32(2, S23);

  int line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_sum(a, 2, false));
  expect_error(line, "kiln_sum", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_mean(a, -3, true));
  expect_error(line, "kiln_mean", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_max_axes(a, ((int[]){0, 5}), 2, false));
  expect_error(line, "kiln_max_axes", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_var(a, 2, 1, false));
  expect_error(line, "kiln_var", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_argmax(a, 7, false));
  expect_error(line, "kiln_argmax", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_softmax(a, 2));
  expect_error(line, "kiln_softmax", NULL, NULL);
  still_works();
  kiln_scope_end();
}
END_TEST

START_TEST(test_cat_errors)
{
  kiln_scope_begin();
  kiln_tensor *ab[2] = {f32(2, S23), kiln_ones(KILN_F32, 2, ((int64_t[]){3, 4}))};
  int line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_cat(ab, 2, 0));
  expect_error(line, "kiln_cat", NULL, NULL);
  still_works();

  kiln_tensor *mixed[2] = {f32(2, S23), kiln_ones(KILN_F64, 2, S23)};
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_cat(mixed, 2, 0));
  expect_error(line, "kiln_cat", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_cat(mixed, 0, 0));
  expect_error(line, "kiln_cat", NULL, NULL);
  still_works();

  kiln_tensor *same[2] = {f32(2, S23), f32(2, S23)};
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_cat(same, 2, 2));
  expect_error(line, "kiln_cat", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_stack(ab, 2, 0));
  expect_error(line, "kiln_stack", NULL, NULL);
  still_works();
  kiln_scope_end();
}
END_TEST

START_TEST(test_dtype_errors)
{
  kiln_scope_begin();
  kiln_tensor *fa = f32(2, S23), *fb = f32(2, S23);
  kiln_tensor *ia = kiln_ones(KILN_I64, 2, S23), *ib = kiln_ones(KILN_I64, 2, S23);

  int line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_where(fa, fa, fb));
  expect_error(line, "kiln_where", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_div(ia, ib));
  expect_error(line, "kiln_div", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_log(ia));
  expect_error(line, "kiln_log", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_exp(ia));
  expect_error(line, "kiln_exp", NULL, NULL);
  still_works();

  /* Integers are fine where the op is exact. */
  kiln_tensor *isum = kiln_add(ia, ib);
  ck_assert_ptr_nonnull(isum);
  ck_assert_int_eq(KILN_I64, kiln_type(isum));
  kiln_scope_end();
}
END_TEST

START_TEST(test_index_errors)
{
  kiln_scope_begin();
  kiln_tensor *table = kiln_ones(KILN_F32, 2, ((int64_t[]){4, 3}));
  float fidx[2] = {0, 1};
  kiln_tensor *fi = kiln_tensor_from(KILN_F32, 1, (int64_t[]){2}, fidx);
  int line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_embedding(table, fi));
  expect_error(line, "kiln_embedding", NULL, NULL);
  still_works();

  int64_t bad[3] = {0, 4, 1};
  kiln_tensor *bi = kiln_tensor_from(KILN_I64, 1, (int64_t[]){3}, bad);
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_embedding(table, bi));
  expect_error(line, "kiln_embedding", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_index_select(table, 0, bi));
  expect_error(line, "kiln_index_select", NULL, NULL);
  still_works();

  kiln_tensor *logits = kiln_ones(KILN_F32, 2, ((int64_t[]){3, 5}));
  int64_t t_hi[3] = {0, 5, 2}, t_neg[3] = {0, -1, 2};
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_cross_entropy(logits, kiln_tensor_from(KILN_I64, 1, (int64_t[]){3}, t_hi)));
  expect_error(line, "kiln_cross_entropy", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_cross_entropy(logits, kiln_tensor_from(KILN_I64, 1, (int64_t[]){3}, t_neg)));
  expect_error(line, "kiln_cross_entropy", NULL, NULL);
  still_works();

  /* One target per row. */
  int64_t t_ok[2] = {0, 1};
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_cross_entropy(logits, kiln_tensor_from(KILN_I64, 1, (int64_t[]){2}, t_ok)));
  expect_error(line, "kiln_cross_entropy", NULL, NULL);
  still_works();
  kiln_scope_end();
}
END_TEST

/* Convolution, pooling and batch norm: torch's checks, each naming the op,
 * the shapes and this file's line. */
START_TEST(test_cnn_errors)
{
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_F32, 4, (int64_t[]){1, 4, 8, 8});
  int line;
  kiln_clear_error();
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_conv2d(x, kiln_ones(KILN_F32, 4, (int64_t[]){6, 3, 3, 3}), NULL, NULL, NULL, NULL, 1));
  expect_error(line, "kiln_conv2d", "weight of size [6,3,3,3], expected input[1,4,8,8] to have 3 channels", "got 4 channels");
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_conv2d(x, kiln_ones(KILN_F32, 4, (int64_t[]){6, 1, 3, 3}), NULL, NULL, NULL, NULL, 4));
  expect_error(line, "kiln_conv2d", "divisible by 4", "[6,1,3,3]");
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_conv2d(kiln_ones(KILN_F32, 4, (int64_t[]){1, 3, 2, 2}), kiln_ones(KILN_F32, 4, (int64_t[]){4, 3, 3, 3}), NULL, NULL, NULL, NULL, 1));
  expect_error(line, "kiln_conv2d", "Kernel size can't be greater than actual input size", "[1,3,2,2]");
  kiln_clear_error(); /* a NULL input reports itself only when no error is pending */
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_conv2d(NULL, kiln_ones(KILN_F32, 4, (int64_t[]){4, 3, 3, 3}), NULL, NULL, NULL, NULL, 1));
  expect_error(line, "kiln_conv2d", "input", NULL);
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_conv2d(kiln_ones(KILN_F32, 2, (int64_t[]){3, 8}), kiln_ones(KILN_F32, 4, (int64_t[]){4, 3, 3, 3}), NULL, NULL, NULL, NULL, 1));
  expect_error(line, "kiln_conv2d", "Expected 3D (unbatched) or 4D (batched) input", "[3,8]");
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_conv2d(x, kiln_ones(KILN_F32, 4, (int64_t[]){4, 4, 3, 3}), NULL, (int[]){0, 1}, NULL, NULL, 1));
  expect_error(line, "kiln_conv2d", "non-positive stride", NULL);
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_conv2d(x, kiln_ones(KILN_F32, 4, (int64_t[]){4, 4, 3, 3}), kiln_ones(KILN_F32, 1, (int64_t[]){5}), NULL, NULL, NULL, 1));
  expect_error(line, "kiln_conv2d", "expected bias to be 1-dimensional with 4 elements", "[5]");
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_conv1d(kiln_ones(KILN_F32, 3, (int64_t[]){2, 5, 9}), kiln_ones(KILN_F32, 3, (int64_t[]){4, 3, 3}), NULL, 1, 0, 1, 1));
  expect_error(line, "kiln_conv1d", "expected input[2,5,9] to have 3 channels", NULL);
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_max_pool2d(x, (int[]){2, 2}, NULL, (int[]){2, 2}));
  expect_error(line, "kiln_max_pool2d", "pad should be at most half", NULL);
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_avg_pool2d(kiln_ones(KILN_F32, 4, (int64_t[]){1, 1, 2, 2}), (int[]){3, 3}, NULL, NULL));
  expect_error(line, "kiln_avg_pool2d", "too small", "[1,1,2,2]");
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_max_pool2d(x, NULL, NULL, NULL));
  expect_error(line, "kiln_max_pool2d", "kernel size is NULL", NULL);
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_adaptive_avg_pool2d(x, NULL));
  expect_error(line, "kiln_adaptive_avg_pool2d", "output size is NULL", NULL);
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_batch_norm(kiln_ones(KILN_F32, 2, (int64_t[]){1, 3}), NULL, NULL, NULL, NULL, true, 0.1, 1e-5));
  expect_error(line, "kiln_batch_norm", "Expected more than 1 value per channel when training", "[1,3]");
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_batch_norm(x, kiln_zeros(KILN_F32, 1, (int64_t[]){3}), NULL, NULL, NULL, true, 0.1, 1e-5));
  expect_error(line, "kiln_batch_norm", "running_mean should contain 4 elements not 3", NULL);
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_batch_norm(x, NULL, NULL, NULL, NULL, false, 0.1, 1e-5));
  expect_error(line, "kiln_batch_norm", "must be given in evaluation mode", NULL);
  still_works();
  kiln_scope_end();
}
END_TEST

START_TEST(test_layer_norm_errors)
{
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_F32, 2, ((int64_t[]){3, 6}));
  kiln_tensor *w5 = kiln_ones(KILN_F32, 1, (int64_t[]){5}), *b5 = kiln_zeros(KILN_F32, 1, (int64_t[]){5});
  kiln_tensor *w6 = kiln_ones(KILN_F32, 1, (int64_t[]){6});
  int line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_layer_norm(x, w5, b5, 1e-5));
  expect_error(line, "kiln_layer_norm", NULL, NULL);
  still_works();

  /* weight without bias is valid (an affine norm with no shift) */
  ck_assert_ptr_nonnull(kiln_layer_norm(x, w6, NULL, 1e-5));
  kiln_scope_end();
}
END_TEST

/* The newer ops refuse bad input under their own names. */
#define EXPECT_ERR(call, op, frag)                    \
  do {                                                \
    int line_ = __LINE__;                             \
    ck_assert_ptr_null(call);                         \
    expect_error(line_, op, frag, NULL);              \
  } while (0)

START_TEST(test_new_op_errors)
{
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_F32, 2, ((int64_t[]){3, 6}));
  kiln_tensor *i = kiln_ones(KILN_I64, 1, S4), *e = kiln_ones(KILN_F32, 2, ((int64_t[]){3, 0}));
  kiln_tensor *bmask = kiln_ones(KILN_BOOL, 1, S4), *fmask = kiln_ones(KILN_F32, 1, (int64_t[]){6});
  EXPECT_ERR(kiln_clamp(x, NAN, 1), "kiln_clamp", "nan");
  EXPECT_ERR(kiln_clamp(kiln_ones(KILN_BOOL, 1, S4), 0, 1), "kiln_clamp", "bool");
  EXPECT_ERR(kiln_leaky_relu(i, 0.1), "kiln_leaky_relu", "i64");
  EXPECT_ERR(kiln_silu(i), "kiln_silu", "i64");
  kiln_clear_error();
  EXPECT_ERR(kiln_add_scalar(NULL, 1), "kiln_add_scalar", "NULL");
  EXPECT_ERR(kiln_argmin(e, 1, false), "kiln_argmin", "[3,0]");
  EXPECT_ERR(kiln_logsumexp(e, 1, false), "kiln_logsumexp", "size 0");
  EXPECT_ERR(kiln_logsumexp(x, 2, false), "kiln_logsumexp", "out of range");
  EXPECT_ERR(kiln_logsumexp(i, 0, false), "kiln_logsumexp", "i64");
  EXPECT_ERR(kiln_max_all(e), "kiln_max_all", "[3,0]");
  EXPECT_ERR(kiln_min_all(e), "kiln_min_all", "[3,0]");
  EXPECT_ERR(kiln_masked_fill(x, fmask, 0), "kiln_masked_fill", "bool");
  EXPECT_ERR(kiln_masked_fill(x, bmask, 0), "kiln_masked_fill", "[4]");
  EXPECT_ERR(kiln_masked_fill(kiln_ones(KILN_F32, 1, (int64_t[]){6}), kiln_ones(KILN_BOOL, 2, ((int64_t[]){3, 6})), 0),
             "kiln_masked_fill", "[3,6]");
  EXPECT_ERR(kiln_rms_norm(x, kiln_ones(KILN_F32, 1, S4), 1e-5), "kiln_rms_norm", "[4]");
  EXPECT_ERR(kiln_group_norm(x, 4, NULL, NULL, 1e-5), "kiln_group_norm", "4 groups");
  EXPECT_ERR(kiln_group_norm(x, 0, NULL, NULL, 1e-5), "kiln_group_norm", "0 groups");
  EXPECT_ERR(kiln_group_norm(x, 3, NULL, kiln_ones(KILN_F32, 1, S4), 1e-5), "kiln_group_norm", "bias");
  EXPECT_ERR(kiln_group_norm(kiln_ones(KILN_F32, 1, S4), 1, NULL, NULL, 1e-5), "kiln_group_norm", "(N,C,...)");

  kiln_tensor *i2 = kiln_tensor_from(KILN_I64, 2, ((int64_t[]){2, 1}), ((int64_t[]){0, 6}));
  kiln_tensor *i1 = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){2}), ((int64_t[]){0, 3}));
  EXPECT_ERR(kiln_gather(x, 1, i), "kiln_gather", "rank 2");
  EXPECT_ERR(kiln_gather(x, 1, i2), "kiln_gather", "index 6 at position 1");
  EXPECT_ERR(kiln_gather(x, 2, i2), "kiln_gather", "dim 2");
  EXPECT_ERR(kiln_gather(kiln_ones(KILN_F32, 2, ((int64_t[]){1, 6})), 1, i2), "kiln_gather", "larger");
  EXPECT_ERR(kiln_scatter_add(x, 1, i2, x), "kiln_scatter_add", "index's shape");
  EXPECT_ERR(kiln_index_copy(x, 0, i1, x), "kiln_index_copy", "does not fit");
  kiln_tensor *dst = kiln_zeros(KILN_F32, 2, ((int64_t[]){3, 6})), *rows = kiln_ones(KILN_F32, 2, ((int64_t[]){2, 6}));
  EXPECT_ERR(kiln_index_copy_(dst, 0, i1, rows), "kiln_index_copy_", "index 3 at position 1");
  EXPECT_ERR(kiln_index_copy_(dst, 2, i1, rows), "kiln_index_copy_", "dim 2");
  EXPECT_ERR(kiln_index_copy_(dst, 1, i1, rows), "kiln_index_copy_", "does not fit");
  EXPECT_ERR(kiln_index_copy_(kiln_expand(kiln_ones(KILN_F32, 2, ((int64_t[]){1, 6})), 2, ((int64_t[]){3, 6})), 0,
                              kiln_zeros(KILN_I64, 1, ((int64_t[]){2})), rows),
             "kiln_index_copy_", "repeated");
  EXPECT_ERR(kiln_tril(kiln_ones(KILN_F32, 1, S4), 0), "kiln_tril", "2 dims");
  kiln_clear_error();
  EXPECT_ERR(kiln_triu(NULL, 0), "kiln_triu", "NULL");
  EXPECT_ERR(kiln_pad(x, 3, ((int64_t[]){1, 1, 1}), 0), "kiln_pad", "even");
  EXPECT_ERR(kiln_pad(x, 6, ((int64_t[]){1, 1, 1, 1, 1, 1}), 0), "kiln_pad", "6 pad widths");
  EXPECT_ERR(kiln_pad(x, 2, ((int64_t[]){-4, -3}), 0), "kiln_pad", "negative size");
  EXPECT_ERR(kiln_pad(x, 2, ((int64_t[]){INT64_MAX, 1}), 0), "kiln_pad", "out of range");
  EXPECT_ERR(kiln_cumsum(x, 2), "kiln_cumsum", "out of range");
  EXPECT_ERR(kiln_cumsum(kiln_ones(KILN_BOOL, 1, S4), 0), "kiln_cumsum", "bool");
  kiln_tensor *tv = x, *ti = x;
  int tl = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_topk(x, 7, 1, true, &tv, &ti));
  expect_error(tl, "kiln_topk", "k 7", NULL);
  ck_assert(tv == NULL && ti == NULL);
  tl = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_topk(x, 1, 1, true, NULL, NULL));
  expect_error(tl, "kiln_topk", "both NULL", NULL);
  kiln_tensor *pieces[2];
  tl = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_split_n(x, 2, 1, pieces, 2));
  expect_error(tl, "kiln_split", "3 pieces", "max_outs 2");
  tl = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_split_n(x, 0, 1, pieces, 2));
  expect_error(tl, "kiln_split", "at least 1", NULL);
  EXPECT_ERR(kiln_one_hot(kiln_tensor_from(KILN_I64, 1, S3, ((int64_t[]){0, -1, 2})), 3), "kiln_one_hot", "index -1");
  EXPECT_ERR(kiln_one_hot(x, 3), "kiln_one_hot", "i64");
  EXPECT_ERR(kiln_repeat(x, 1, ((int64_t[]){2})), "kiln_repeat", "at least one per dim");
  EXPECT_ERR(kiln_repeat(x, 2, ((int64_t[]){-1, 2})), "kiln_repeat", "negative");
  /* a size-0 dim next to a huge repeat: refused here, not by a view inside */
  EXPECT_ERR(kiln_repeat(kiln_ones(KILN_F32, 2, ((int64_t[]){3, 0})), 2, ((int64_t[]){INT64_C(1) << 62, 1})), "kiln_repeat",
             "too large");
  ck_assert_ptr_nonnull(kiln_repeat(kiln_ones(KILN_F32, 1, ((int64_t[]){0})), 1, ((int64_t[]){INT64_C(1) << 62})));
  still_works();
  kiln_scope_end();
}
END_TEST

START_TEST(test_creation_errors)
{
  int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  float v[4] = {0};
  int line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_tensor_from(KILN_F32, 9, nine, v));
  expect_error(line, "kiln_tensor_from", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_tensor_from(KILN_F32, 2, ((int64_t[]){2, -2}), v));
  expect_error(line, "kiln_tensor_from", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_tensor_from(KILN_F32, -1, S4, v));
  expect_error(line, "kiln_tensor_from", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_zeros(KILN_F64, 1, ((int64_t[]){-5})));
  expect_error(line, "kiln_zeros", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_arange(KILN_F32, 0, 10, 0));
  expect_error(line, "kiln_arange", NULL, NULL);
  still_works();
}
END_TEST

START_TEST(test_read_and_item_errors)
{
  kiln_scope_begin();
  kiln_tensor *a = f32(2, S23);
  float buf[7];
  int line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_read(a, buf, 5 * sizeof(float)));
  expect_error(line, "kiln_read", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_read(a, buf, 7 * sizeof(float)));
  expect_error(line, "kiln_read", NULL, NULL);
  still_works();
  ck_assert_int_eq(0, kiln_read(a, buf, 6 * sizeof(float)));

  line = __LINE__ + 1;
  double x = kiln_item(a);
  ck_assert(isnan(x));
  expect_error(line, "kiln_item", NULL, NULL);
  still_works();
  kiln_scope_end();
}
END_TEST

START_TEST(test_inplace_errors)
{
  kiln_scope_begin();
  kiln_tensor *dst = f32(2, S23);
  int line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_add_(dst, f32(1, S4)));
  expect_error(line, "kiln_add_", NULL, NULL);
  still_works();

  /* src may broadcast to dst, never the other way round. */
  kiln_tensor *small = f32(1, S3);
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_add_(small, dst));
  expect_error(line, "kiln_add_", NULL, NULL);
  still_works();
  ck_assert_ptr_eq(dst, kiln_add_(dst, small));

  float xv[4] = {1, 2, 3, 4};
  kiln_tensor *x = kiln_tensor_from(KILN_F32, 1, S4, xv);
  kiln_tensor *d = kiln_slice(x, 0, 1, 3, 1), *s = kiln_slice(x, 0, 0, 2, 1);
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_copy_(d, s));
  expect_error(line, "kiln_copy_", NULL, NULL);
  still_works();
  float got[4];
  ck_assert_int_eq(0, kiln_read(x, got, sizeof got));
  for (int i = 0; i < 4; i++)
    ck_assert_float_eq(xv[i], got[i]); /* untouched by the refused copy */
  kiln_scope_end();
}
END_TEST

/* Disjoint slices of one base, and src == dst exactly, are both fine. */
START_TEST(test_inplace_allowed_overlaps)
{
  kiln_scope_begin();
  float xv[4] = {1, 2, 3, 4};
  kiln_tensor *x = kiln_tensor_from(KILN_F32, 1, S4, xv);
  kiln_tensor *hi = kiln_slice(x, 0, 2, 4, 1), *lo = kiln_slice(x, 0, 0, 2, 1);
  ck_assert_ptr_eq(hi, kiln_copy_(hi, lo));
  float got[4];
  ck_assert_int_eq(0, kiln_read(x, got, sizeof got));
  const float want1[4] = {1, 2, 1, 2};
  for (int i = 0; i < 4; i++)
    ck_assert_float_eq(want1[i], got[i]);
  ck_assert_ptr_eq(x, kiln_add_(x, x));
  ck_assert_int_eq(0, kiln_read(x, got, sizeof got));
  for (int i = 0; i < 4; i++)
    ck_assert_float_eq(2 * want1[i], got[i]);
  kiln_scope_end();
}
END_TEST

START_TEST(test_autograd_errors)
{
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_F64, 2, S23);
  kiln_requires_grad(x, true);
  kiln_tensor *y = kiln_mul(x, x);
  int line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_backward(y));
  expect_error(line, "kiln_backward", NULL, NULL);
  still_works();

  line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_backward_with(y, kiln_ones(KILN_F64, 1, S3)));
  expect_error(line, "kiln_backward_with", NULL, NULL);
  still_works();

  kiln_tensor *g[1] = {NULL};
  line = __LINE__ + 1;
  ck_assert_int_eq(-1, kiln_grad_of(y, &x, 1, g));
  expect_error(line, "kiln_grad_of", NULL, NULL);
  still_works();
  kiln_scope_end();
}
END_TEST

START_TEST(test_null_propagates)
{
  kiln_scope_begin();
  kiln_tensor *x = f32(2, S23);
  kiln_clear_error();
  ck_assert_ptr_null(kiln_add(NULL, x));
  ck_assert_msg(strstr(kiln_last_error(), "NULL") != NULL, "error \"%s\" does not mention NULL", kiln_last_error());
  ck_assert_ptr_null(kiln_add(x, NULL));
  ck_assert_ptr_null(kiln_exp(NULL));
  ck_assert_ptr_null(kiln_matmul(NULL, x));
  ck_assert_ptr_null(kiln_reshape(NULL, 1, S4));
  ck_assert_ptr_null(kiln_transpose(NULL, 0, 1));
  ck_assert_ptr_null(kiln_sum(NULL, 0, false));
  ck_assert_ptr_null(kiln_sum_all(NULL));
  ck_assert_ptr_null(kiln_softmax(NULL, 0));
  ck_assert_ptr_null(kiln_where(NULL, x, x));
  ck_assert_ptr_null(kiln_cast(NULL, KILN_F64));
  ck_assert_ptr_null(kiln_contiguous(NULL));
  ck_assert_ptr_null(kiln_add_(NULL, x));
  ck_assert_ptr_null(kiln_add_(x, NULL));
  ck_assert_ptr_null(kiln_cat(((kiln_tensor *[]){x, NULL}), 2, 0));
  ck_assert_int_eq(-1, kiln_backward(NULL));
  float buf[6];
  ck_assert_int_eq(-1, kiln_read(NULL, buf, sizeof buf));
  ck_assert(isnan(kiln_item(NULL)));
  kiln_release(NULL);
  ck_assert_ptr_null(kiln_keep(NULL));
  still_works();
  kiln_scope_end();
}
END_TEST

START_TEST(test_first_error_survives_chain)
{
  /* NULL in -> NULL out keeps the message of the op that failed first, so
   * one check at the end of a chain points at the real cause. */
  kiln_scope_begin();
  kiln_tensor *a = f32(2, S23), *b = f32(1, S4);
  int line = __LINE__ + 1;
  kiln_tensor *s = kiln_add(a, b);
  kiln_tensor *r = kiln_sum_all(kiln_exp(kiln_matmul(s, a)));
  ck_assert_ptr_null(r);
  expect_error(line, "kiln_add", "[2,3]", "[4]");
  still_works();
  kiln_scope_end();
}
END_TEST

/* Found by fuzzing (tests/fuzz/fuzz_eager.c): composite ops refuse with their
 * own name, not that of a primitive inside them, and a batch dim of 0
 * broadcasts against a 1. */
START_TEST(test_fuzz_findings)
{
  kiln_scope_begin();
  /* softmax over an axis of size 0: the max inside used to name itself */
  kiln_tensor *e = kiln_zeros(KILN_F32, 3, ((int64_t[]){1, 5, 0}));
  int line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_softmax(e, 2));
  expect_error(line, "kiln_softmax", "[1,5,0]", "size 0");
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_log_softmax(e, -1));
  expect_error(line, "kiln_log_softmax", "[1,5,0]", NULL);
  /* stack of mixed dtypes: the cat inside used to name itself */
  kiln_tensor *a = kiln_zeros(KILN_F32, 1, ((int64_t[]){1})), *b = kiln_zeros(KILN_F64, 1, ((int64_t[]){1}));
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_stack(((kiln_tensor *[]){a, b}), 2, 0));
  expect_error(line, "kiln_stack", "f64", "f32");
  /* stack of rank-8 inputs: the result would have 9 dims; the unsqueeze inside used to name itself */
  kiln_tensor *r8 = kiln_zeros(KILN_F32, 8, ((int64_t[]){2, 2, 2, 2, 2, 2, 2, 3}));
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_stack(((kiln_tensor *[]){r8, r8}), 2, -1));
  expect_error(line, "kiln_stack", "rank 9", NULL);
  /* (4) @ (3,0,4,5): the batch (3,0) is empty; it used to run one GEMV into a 0-element output */
  kiln_tensor *v = kiln_ones(KILN_F64, 1, ((int64_t[]){4}));
  kiln_tensor *m = kiln_ones(KILN_F64, 4, ((int64_t[]){3, 0, 4, 5}));
  kiln_tensor *p = kiln_matmul(v, m);
  ck_assert_msg(p != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(3, kiln_ndim(p));
  ck_assert_int_eq(3, kiln_size(p, 0));
  ck_assert_int_eq(0, kiln_size(p, 1));
  ck_assert_int_eq(5, kiln_size(p, 2));
  p = kiln_matmul(kiln_ones(KILN_F32, 3, ((int64_t[]){1, 2, 3})), kiln_ones(KILN_F32, 3, ((int64_t[]){0, 3, 2})));
  ck_assert_msg(p != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_numel(p));
  still_works();
  kiln_scope_end();
}
END_TEST

static Suite *errors_suite(void)
{
  Suite *s = suite_create("errors");
  TCase *tc = tcase_create("errors");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_clear_error);
  tcase_add_test(tc, test_broadcast_mismatch);
  tcase_add_test(tc, test_matmul_errors);
  tcase_add_test(tc, test_shape_op_errors);
  tcase_add_test(tc, test_axis_errors);
  tcase_add_test(tc, test_cat_errors);
  tcase_add_test(tc, test_dtype_errors);
  tcase_add_test(tc, test_index_errors);
  tcase_add_test(tc, test_layer_norm_errors);
  tcase_add_test(tc, test_cnn_errors);
  tcase_add_test(tc, test_creation_errors);
  tcase_add_test(tc, test_read_and_item_errors);
  tcase_add_test(tc, test_inplace_errors);
  tcase_add_test(tc, test_inplace_allowed_overlaps);
  tcase_add_test(tc, test_autograd_errors);
  tcase_add_test(tc, test_null_propagates);
  tcase_add_test(tc, test_first_error_survives_chain);
  tcase_add_test(tc, test_fuzz_findings);
  tcase_add_test(tc, test_new_op_errors);
  suite_add_tcase(s, tc);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(errors_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
