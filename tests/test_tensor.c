/* Tensors: creation, dtypes, shapes and strides, views sharing storage, the
 * counter-based random generators, scopes, reference counts and the memory
 * counters. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eager/eager.h" /* alloc_fail_after */
#include "kiln.h"

static void read_f64(const kiln_tensor *t, double *dst, int64_t n)
{
  ck_assert_msg(t != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(n, kiln_numel(t));
  ck_assert_int_eq(0, kiln_read(t, dst, (size_t)n * sizeof(double)));
}

static void assert_eq_f64(const double *want, const double *got, int n, const char *what)
{
  for (int i = 0; i < n; i++)
    ck_assert_msg(want[i] == got[i], "%s at %d: expected %.17g, got %.17g", what, i, want[i], got[i]);
}

static void assert_shape(const kiln_tensor *t, int ndim, const int64_t *shape)
{
  ck_assert_ptr_nonnull(t);
  ck_assert_int_eq(ndim, kiln_ndim(t));
  for (int d = 0; d < ndim; d++)
    ck_assert_int_eq(shape[d], kiln_size(t, d));
}

START_TEST(test_creation)
{
  kiln_scope_begin();
  int64_t s23[2] = {2, 3};
  double v[6];

  kiln_tensor *z = kiln_zeros(KILN_F64, 2, s23);
  assert_shape(z, 2, s23);
  ck_assert_int_eq(6, kiln_numel(z));
  ck_assert_int_eq(KILN_F64, kiln_type(z));
  read_f64(z, v, 6);
  for (int i = 0; i < 6; i++)
    ck_assert_double_eq(0.0, v[i]);

  read_f64(kiln_ones(KILN_F64, 2, s23), v, 6);
  for (int i = 0; i < 6; i++)
    ck_assert_double_eq(1.0, v[i]);

  read_f64(kiln_full(KILN_F64, 2, s23, -2.5), v, 6);
  for (int i = 0; i < 6; i++)
    ck_assert_double_eq(-2.5, v[i]);

  float f[4];
  kiln_tensor *ff = kiln_full(KILN_F32, 1, (int64_t[]){4}, 0.1);
  ck_assert_int_eq(KILN_F32, kiln_type(ff));
  ck_assert_int_eq(0, kiln_read(ff, f, sizeof f));
  for (int i = 0; i < 4; i++)
    ck_assert_float_eq(0.1f, f[i]);

  int64_t iv[4];
  kiln_tensor *fi = kiln_full(KILN_I64, 1, (int64_t[]){4}, 7);
  ck_assert_int_eq(0, kiln_read(fi, iv, sizeof iv));
  for (int i = 0; i < 4; i++)
    ck_assert_int_eq(7, iv[i]);

  kiln_tensor *ar = kiln_arange(KILN_F64, 0, 5, 1);
  assert_shape(ar, 1, (int64_t[]){5});
  read_f64(ar, v, 5);
  assert_eq_f64((double[]){0, 1, 2, 3, 4}, v, 5, "arange(0,5,1)");

  kiln_tensor *arf = kiln_arange(KILN_F32, 1, 2, 0.25);
  assert_shape(arf, 1, (int64_t[]){4});
  ck_assert_int_eq(0, kiln_read(arf, f, sizeof f));
  const float wantf[4] = {1, 1.25f, 1.5f, 1.75f};
  for (int i = 0; i < 4; i++)
    ck_assert_float_eq(wantf[i], f[i]);

  kiln_tensor *ari = kiln_arange(KILN_I64, 0, 10, 3);
  assert_shape(ari, 1, (int64_t[]){4});
  ck_assert_int_eq(0, kiln_read(ari, iv, sizeof iv));
  const int64_t wanti[4] = {0, 3, 6, 9};
  for (int i = 0; i < 4; i++)
    ck_assert_int_eq(wanti[i], iv[i]);

  kiln_tensor *sc = kiln_scalar(KILN_F64, 3.5);
  ck_assert_ptr_nonnull(sc);
  ck_assert_int_eq(0, kiln_ndim(sc));
  ck_assert_int_eq(1, kiln_numel(sc));
  ck_assert_double_eq(3.5, kiln_item(sc));

  /* tensor_from copies: changing the source afterwards changes nothing. */
  double src[6] = {1, -2, 3.25, 4, 5e-3, -6e7};
  kiln_tensor *t = kiln_tensor_from(KILN_F64, 2, s23, src);
  double keep[6];
  memcpy(keep, src, sizeof src);
  src[0] = 99;
  read_f64(t, v, 6);
  assert_eq_f64(keep, v, 6, "tensor_from f64");

  int64_t isrc[3] = {-4, 0, INT64_C(1) << 40};
  ck_assert_int_eq(0, kiln_read(kiln_tensor_from(KILN_I64, 1, (int64_t[]){3}, isrc), iv, 3 * sizeof(int64_t)));
  for (int i = 0; i < 3; i++)
    ck_assert_int_eq(isrc[i], iv[i]);

  bool bsrc[3] = {true, false, true}, bv[3];
  ck_assert_int_eq(0, kiln_read(kiln_tensor_from(KILN_BOOL, 1, (int64_t[]){3}, bsrc), bv, sizeof bv));
  for (int i = 0; i < 3; i++)
    ck_assert_int_eq(bsrc[i], bv[i]);

  /* An empty dim is legal, as in NumPy. */
  kiln_tensor *e = kiln_zeros(KILN_F32, 2, ((int64_t[]){0, 3}));
  ck_assert_msg(e != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_numel(e));
  kiln_scope_end();
}
END_TEST

START_TEST(test_dtypes)
{
  ck_assert_uint_eq(4, kiln_dtype_size(KILN_F32));
  ck_assert_uint_eq(8, kiln_dtype_size(KILN_F64));
  ck_assert_uint_eq(8, kiln_dtype_size(KILN_I64));
  ck_assert_uint_eq(sizeof(bool), kiln_dtype_size(KILN_BOOL));
  ck_assert_str_eq("f32", kiln_dtype_name(KILN_F32));
  ck_assert_str_eq("f64", kiln_dtype_name(KILN_F64));
  ck_assert_str_eq("i64", kiln_dtype_name(KILN_I64));
  ck_assert_str_eq("bool", kiln_dtype_name(KILN_BOOL));

  kiln_scope_begin();
  char buf[128];
  kiln_tensor *t = kiln_zeros(KILN_F32, 2, ((int64_t[]){2, 3}));
  ck_assert_ptr_eq(buf, kiln_describe(t, buf, sizeof buf));
  ck_assert_msg(strstr(buf, "f32[2,3]") != NULL, "describe gave \"%s\"", buf);

  /* Casts convert values. */
  double dv[3] = {1.5, -2.25, 1e10};
  kiln_tensor *c = kiln_cast(kiln_tensor_from(KILN_F64, 1, (int64_t[]){3}, dv), KILN_F32);
  ck_assert_int_eq(KILN_F32, kiln_type(c));
  float fv[3];
  ck_assert_int_eq(0, kiln_read(c, fv, sizeof fv));
  for (int i = 0; i < 3; i++)
    ck_assert_float_eq((float)dv[i], fv[i]);
  kiln_scope_end();
}
END_TEST

START_TEST(test_sizes_and_strides)
{
  kiln_scope_begin();
  int64_t sh[3] = {2, 3, 4};
  kiln_tensor *t = kiln_zeros(KILN_F32, 3, sh);
  ck_assert_int_eq(4, kiln_size(t, -1));
  ck_assert_int_eq(3, kiln_size(t, -2));
  ck_assert_int_eq(2, kiln_size(t, -3));
  ck_assert_int_eq(-1, kiln_size(t, 3));
  ck_assert_int_eq(-1, kiln_size(t, -4));
  ck_assert_int_eq(24, kiln_numel(t));

  ck_assert(kiln_is_contiguous(t));
  ck_assert_int_eq(12, kiln_stride(t, 0));
  ck_assert_int_eq(4, kiln_stride(t, 1));
  ck_assert_int_eq(1, kiln_stride(t, 2));

  kiln_tensor *tt = kiln_transpose(t, 0, 2);
  assert_shape(tt, 3, (int64_t[]){4, 3, 2});
  ck_assert(!kiln_is_contiguous(tt));
  ck_assert_int_eq(1, kiln_stride(tt, 0));
  ck_assert_int_eq(4, kiln_stride(tt, 1));
  ck_assert_int_eq(12, kiln_stride(tt, 2));

  kiln_tensor *c = kiln_contiguous(tt);
  ck_assert(kiln_is_contiguous(c));
  ck_assert_int_eq(6, kiln_stride(c, 0));
  ck_assert_int_eq(2, kiln_stride(c, 1));
  ck_assert_int_eq(1, kiln_stride(c, 2));

  kiln_tensor *s = kiln_slice(t, 2, 0, 4, 2);
  assert_shape(s, 3, ((int64_t[]){2, 3, 2}));
  ck_assert_int_eq(2, kiln_stride(s, 2));
  ck_assert(!kiln_is_contiguous(s));

  kiln_tensor *e = kiln_expand(kiln_ones(KILN_F32, 2, ((int64_t[]){3, 1})), 3, sh);
  assert_shape(e, 3, sh);
  ck_assert_int_eq(0, kiln_stride(e, 0));
  ck_assert_int_eq(0, kiln_stride(e, 2));

  assert_shape(kiln_unsqueeze(t, 0), 4, ((int64_t[]){1, 2, 3, 4}));
  assert_shape(kiln_unsqueeze(t, -1), 4, ((int64_t[]){2, 3, 4, 1}));
  assert_shape(kiln_squeeze(kiln_unsqueeze(t, 1), 1), 3, sh);
  assert_shape(kiln_permute(t, ((int[]){1, 2, 0})), 3, ((int64_t[]){3, 4, 2}));
  assert_shape(kiln_reshape(t, 2, ((int64_t[]){-1, 6})), 2, ((int64_t[]){4, 6}));
  kiln_scope_end();
}
END_TEST

START_TEST(test_views_share_storage)
{
  kiln_scope_begin();
  kiln_tensor *x = kiln_zeros(KILN_F64, 2, ((int64_t[]){2, 3}));
  double v[6];

  kiln_tensor *sl = kiln_slice(x, 1, 1, 3, 1); /* columns 1..2 */
  assert_shape(sl, 2, ((int64_t[]){2, 2}));
  ck_assert_int_eq(3, kiln_stride(sl, 0));
  ck_assert_ptr_eq(sl, kiln_copy_(sl, kiln_full(KILN_F64, 2, ((int64_t[]){2, 2}), 7)));
  read_f64(x, v, 6);
  assert_eq_f64((double[]){0, 7, 7, 0, 7, 7}, v, 6, "base after a write into a slice");

  kiln_tensor *t = kiln_transpose(x, 0, 1); /* (3,2) */
  kiln_tensor *row = kiln_slice(t, 0, 0, 1, 1);
  ck_assert_ptr_eq(row, kiln_copy_(row, kiln_full(KILN_F64, 2, ((int64_t[]){1, 2}), 5)));
  read_f64(x, v, 6);
  assert_eq_f64((double[]){5, 7, 7, 5, 7, 7}, v, 6, "base after a write into a transposed view");
  read_f64(t, v, 6);
  assert_eq_f64((double[]){5, 5, 7, 7, 7, 7}, v, 6, "read of a transposed view is row-major in its shape");

  /* reshape of a contiguous tensor is a view. */
  size_t before = kiln_mem_in_use();
  kiln_tensor *r = kiln_reshape(x, 1, (int64_t[]){6});
  ck_assert_ptr_nonnull(r);
  ck_assert_uint_eq(before, kiln_mem_in_use());
  ck_assert_ptr_eq(r, kiln_copy_(r, kiln_arange(KILN_F64, 0, 6, 1)));
  read_f64(x, v, 6);
  assert_eq_f64((double[]){0, 1, 2, 3, 4, 5}, v, 6, "base after a write through its reshape");

  /* reshape of a transposed tensor must copy. */
  kiln_tensor *rt = kiln_reshape(kiln_transpose(x, 0, 1), 1, (int64_t[]){6});
  read_f64(rt, v, 6);
  assert_eq_f64((double[]){0, 3, 1, 4, 2, 5}, v, 6, "reshape of a transpose");
  ck_assert_ptr_eq(rt, kiln_fill_(rt, -1));
  read_f64(x, v, 6);
  assert_eq_f64((double[]){0, 1, 2, 3, 4, 5}, v, 6, "base after writing into the reshaped copy");

  /* contiguous of a contiguous tensor hands back the same data. */
  kiln_tensor *c = kiln_contiguous(x);
  read_f64(c, v, 6);
  assert_eq_f64((double[]){0, 1, 2, 3, 4, 5}, v, 6, "contiguous of contiguous");
  ck_assert_ptr_eq(c, kiln_fill_(c, 9));
  read_f64(x, v, 6);
  for (int i = 0; i < 6; i++)
    ck_assert_double_eq(9.0, v[i]);

  ck_assert_ptr_eq(x, kiln_zero_(x));
  read_f64(sl, v, 4);
  for (int i = 0; i < 4; i++)
    ck_assert_double_eq(0.0, v[i]);
  kiln_scope_end();
}
END_TEST

static double *randn_f64(int ndim, const int64_t *shape, uint64_t seed, int64_t n)
{
  kiln_scope_begin();
  kiln_tensor *t = kiln_randn(KILN_F64, ndim, shape, seed);
  ck_assert_msg(t != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(n, kiln_numel(t));
  double *v = malloc((size_t)n * sizeof(double));
  ck_assert_int_eq(0, kiln_read(t, v, (size_t)n * sizeof(double)));
  kiln_scope_end();
  return v;
}

START_TEST(test_randn_determinism)
{
  int64_t n = 1000;
  double *a = randn_f64(1, &n, 42, n), *b = randn_f64(1, &n, 42, n), *c = randn_f64(1, &n, 43, n);
  ck_assert_int_eq(0, memcmp(a, b, (size_t)n * sizeof(double)));
  int same = 0;
  for (int64_t i = 0; i < n; i++)
    same += a[i] == c[i];
  ck_assert_msg(same < 5, "seeds 42 and 43 agree on %d of %lld values", same, (long long)n);

  /* Element i depends only on (seed, i): not on the size or shape. */
  int64_t ten = 10;
  double *p = randn_f64(1, &ten, 42, 10);
  ck_assert_int_eq(0, memcmp(p, a, 10 * sizeof(double)));
  double *q = randn_f64(2, ((int64_t[]){2, 5}), 42, 10);
  ck_assert_int_eq(0, memcmp(q, a, 10 * sizeof(double)));
  free(a);
  free(b);
  free(c);
  free(p);
  free(q);
}
END_TEST

START_TEST(test_randn_statistics)
{
  int64_t n = 100000;
  double *x = randn_f64(1, &n, 7, n);
  double sum = 0, sq = 0;
  int64_t within1 = 0, beyond3 = 0;
  for (int64_t i = 0; i < n; i++) {
    ck_assert(isfinite(x[i]));
    sum += x[i];
    within1 += fabs(x[i]) < 1;
    beyond3 += fabs(x[i]) > 3;
  }
  double mean = sum / (double)n;
  for (int64_t i = 0; i < n; i++)
    sq += (x[i] - mean) * (x[i] - mean);
  double sd = sqrt(sq / (double)(n - 1));
  ck_assert_msg(fabs(mean) < 0.02, "mean %g", mean);
  ck_assert_msg(fabs(sd - 1) < 0.02, "std %g", sd);
  /* Normal: P(|z|<1) = 0.6827, P(|z|>3) = 0.0027. */
  double f1 = (double)within1 / (double)n;
  ck_assert_msg(fabs(f1 - 0.6827) < 0.01, "fraction within 1 sd: %g", f1);
  ck_assert_msg(beyond3 > 150 && beyond3 < 420, "%lld of %lld beyond 3 sd", (long long)beyond3, (long long)n);
  free(x);

  /* f32 too. */
  kiln_scope_begin();
  kiln_tensor *t = kiln_randn(KILN_F32, 1, &n, 8);
  float *f = malloc((size_t)n * sizeof(float));
  ck_assert_int_eq(0, kiln_read(t, f, (size_t)n * sizeof(float)));
  sum = sq = 0;
  for (int64_t i = 0; i < n; i++) {
    sum += f[i];
    sq += (double)f[i] * f[i];
  }
  mean = sum / (double)n;
  sd = sqrt(sq / (double)n - mean * mean);
  ck_assert_msg(fabs(mean) < 0.02, "f32 mean %g", mean);
  ck_assert_msg(fabs(sd - 1) < 0.02, "f32 std %g", sd);
  free(f);
  kiln_scope_end();
}
END_TEST

START_TEST(test_rand_uniform)
{
  kiln_scope_begin();
  int64_t n = 100000;
  double *x = malloc((size_t)n * sizeof(double));
  ck_assert_int_eq(0, kiln_read(kiln_rand(KILN_F64, 1, &n, 3), x, (size_t)n * sizeof(double)));
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < n; i++) {
    ck_assert_msg(x[i] >= 0 && x[i] < 1, "rand value %.17g at %lld", x[i], (long long)i);
    sum += x[i];
    sq += x[i] * x[i];
  }
  double mean = sum / (double)n, var = sq / (double)n - mean * mean;
  ck_assert_msg(fabs(mean - 0.5) < 0.01, "mean %g", mean);
  ck_assert_msg(fabs(var - 1.0 / 12) < 0.005, "var %g", var);
  free(x);

  float *f = malloc((size_t)n * sizeof(float));
  ck_assert_int_eq(0, kiln_read(kiln_rand(KILN_F32, 1, &n, 4), f, (size_t)n * sizeof(float)));
  for (int64_t i = 0; i < n; i++)
    ck_assert_msg(f[i] >= 0.0f && f[i] < 1.0f, "f32 rand value %.9g at %lld", f[i], (long long)i);
  free(f);

  double a[16], b[16];
  int64_t s16 = 16;
  read_f64(kiln_rand(KILN_F64, 1, &s16, 5), a, 16);
  read_f64(kiln_rand(KILN_F64, 1, &s16, 5), b, 16);
  ck_assert_int_eq(0, memcmp(a, b, sizeof a));
  kiln_scope_end();
}
END_TEST

START_TEST(test_rand_thread_independent)
{
  int prev = kiln_get_num_threads();
  ck_assert_int_ge(prev, 1);
  int64_t n = INT64_C(1) << 20;
  float *a = malloc((size_t)n * sizeof(float)), *b = malloc((size_t)n * sizeof(float));
  kiln_scope_begin();
  kiln_set_num_threads(1);
  ck_assert_int_eq(1, kiln_get_num_threads());
  ck_assert_int_eq(0, kiln_read(kiln_randn(KILN_F32, 1, &n, 11), a, (size_t)n * sizeof(float)));
  kiln_set_num_threads(2);
  ck_assert_int_eq(2, kiln_get_num_threads());
  ck_assert_int_eq(0, kiln_read(kiln_randn(KILN_F32, 1, &n, 11), b, (size_t)n * sizeof(float)));
  ck_assert_msg(memcmp(a, b, (size_t)n * sizeof(float)) == 0, "randn differs between 1 and 2 threads");
  kiln_scope_end();
  kiln_set_num_threads(prev);
  free(a);
  free(b);
}
END_TEST

START_TEST(test_scopes)
{
  size_t base = kiln_mem_in_use();
  kiln_scope_begin();
  kiln_tensor *a = kiln_zeros(KILN_F32, 1, (int64_t[]){1000});
  ck_assert_ptr_nonnull(a);
  ck_assert_uint_ge(kiln_mem_in_use(), base + 4000);
  kiln_tensor *b = kiln_exp(a);
  ck_assert_ptr_nonnull(b);
  ck_assert_uint_ge(kiln_mem_in_use(), base + 8000);
  kiln_scope_end();
  ck_assert_uint_eq(base, kiln_mem_in_use());

  /* keep hands a tensor to the caller when no scope is left. */
  kiln_scope_begin();
  kiln_tensor *k = kiln_keep(kiln_full(KILN_F64, 1, (int64_t[]){500}, 2.0));
  kiln_zeros(KILN_F64, 1, (int64_t[]){500});
  kiln_scope_end();
  ck_assert_uint_ge(kiln_mem_in_use(), base + 4000);
  ck_assert_uint_lt(kiln_mem_in_use(), base + 8000);
  double v[500];
  read_f64(k, v, 500);
  for (int i = 0; i < 500; i++)
    ck_assert_double_eq(2.0, v[i]);
  kiln_release(k);
  ck_assert_uint_eq(base, kiln_mem_in_use());

  /* Nested: keep moves one level out, not all the way. */
  kiln_scope_begin();
  kiln_zeros(KILN_F64, 1, (int64_t[]){100});
  size_t m1 = kiln_mem_in_use();
  kiln_scope_begin();
  kiln_zeros(KILN_F64, 1, (int64_t[]){200});
  size_t m2 = kiln_mem_in_use();
  kiln_tensor *c = kiln_keep(kiln_ones(KILN_F64, 1, (int64_t[]){300}));
  size_t cbytes = kiln_mem_in_use() - m2;
  ck_assert_uint_ge(cbytes, 300 * sizeof(double));
  kiln_scope_end();
  ck_assert_uint_eq(m1 + cbytes, kiln_mem_in_use());
  double cv[300];
  read_f64(c, cv, 300);
  for (int i = 0; i < 300; i++)
    ck_assert_double_eq(1.0, cv[i]);
  kiln_scope_end();
  ck_assert_uint_eq(base, kiln_mem_in_use());
}
END_TEST

START_TEST(test_retain_release)
{
  size_t base = kiln_mem_in_use();
  /* Outside any scope the caller owns what it gets. */
  kiln_tensor *x = kiln_full(KILN_F64, 1, (int64_t[]){100}, 3.0);
  ck_assert_ptr_nonnull(x);
  kiln_tensor *v = kiln_slice(x, 0, 10, 20, 1);
  ck_assert_ptr_nonnull(v);
  kiln_release(x);
  ck_assert_uint_ge(kiln_mem_in_use(), base + 800); /* the view keeps the storage alive */
  double vv[10];
  read_f64(v, vv, 10);
  for (int i = 0; i < 10; i++)
    ck_assert_double_eq(3.0, vv[i]);
  kiln_release(v);
  ck_assert_uint_eq(base, kiln_mem_in_use());

  kiln_tensor *y = kiln_zeros(KILN_F64, 1, (int64_t[]){64});
  ck_assert_ptr_eq(y, kiln_retain(y));
  kiln_release(y);
  ck_assert_uint_ge(kiln_mem_in_use(), base + 512);
  ck_assert_int_eq(64, kiln_numel(y));
  kiln_release(y);
  ck_assert_uint_eq(base, kiln_mem_in_use());

  /* A retained scope tensor outlives its scope. */
  kiln_scope_begin();
  kiln_tensor *z = kiln_retain(kiln_ones(KILN_F64, 1, (int64_t[]){8}));
  kiln_scope_end();
  double zv[8];
  read_f64(z, zv, 8);
  for (int i = 0; i < 8; i++)
    ck_assert_double_eq(1.0, zv[i]);
  kiln_release(z);
  ck_assert_uint_eq(base, kiln_mem_in_use());
}
END_TEST

/* Storage of 64 KiB and up goes back to the block cache on free and is
 * handed out again to the next request of its size, a smaller one only
 * when it rounds to the same pages: a training step that frees and makes
 * the same tensors again does not fault in fresh pages every time. */
START_TEST(test_block_cache_reuse) {
  size_t n = 40 * 512 * sizeof(float); /* 80 KiB */
  void *a = alloc_aligned(n);
  ck_assert_ptr_nonnull(a);
  alloc_aligned_free(a, n);
  void *b = alloc_aligned(n);
  ck_assert_ptr_eq(a, b);
  /* a size of the same pages meets it; one more page does not */
  alloc_aligned_free(b, n);
  void *c = alloc_aligned(n - 64);
  ck_assert_ptr_eq(a, c);
  alloc_aligned_free(c, n - 64);
  void *d = alloc_aligned(n + 4096);
  ck_assert_ptr_ne(a, d);
  alloc_aligned_free(d, n + 4096);
  void *e = alloc_aligned(n);
  ck_assert_ptr_eq(a, e);
  alloc_aligned_free(e, n);
}
END_TEST

START_TEST(test_mem_peak)
{
  size_t base = kiln_mem_in_use();
  kiln_mem_reset_peak();
  ck_assert_uint_ge(kiln_mem_peak(), base);
  ck_assert_uint_lt(kiln_mem_peak(), base + (1u << 20));
  kiln_scope_begin();
  kiln_tensor *big = kiln_zeros(KILN_F32, 1, (int64_t[]){1 << 18}); /* 1 MiB */
  ck_assert_ptr_nonnull(big);
  kiln_scope_end();
  ck_assert_uint_eq(base, kiln_mem_in_use());
  ck_assert_uint_ge(kiln_mem_peak(), base + (1u << 20));
  kiln_mem_reset_peak();
  ck_assert_uint_lt(kiln_mem_peak(), base + (1u << 20));
}
END_TEST

START_TEST(test_scalar_broadcast)
{
  kiln_scope_begin();
  double xv[6] = {1, 2, 3, 4, 5, 6}, v[6];
  int64_t s23[2] = {2, 3};
  kiln_tensor *x = kiln_tensor_from(KILN_F64, 2, s23, xv);
  kiln_tensor *two = kiln_scalar(KILN_F64, 2);

  kiln_tensor *a = kiln_add(x, two);
  assert_shape(a, 2, s23);
  read_f64(a, v, 6);
  assert_eq_f64((double[]){3, 4, 5, 6, 7, 8}, v, 6, "x + 2");

  kiln_tensor *s = kiln_sub(two, x);
  assert_shape(s, 2, s23);
  read_f64(s, v, 6);
  assert_eq_f64((double[]){1, 0, -1, -2, -3, -4}, v, 6, "2 - x");

  read_f64(kiln_div(x, two), v, 6);
  assert_eq_f64((double[]){0.5, 1, 1.5, 2, 2.5, 3}, v, 6, "x / 2");

  kiln_tensor *ss = kiln_mul(two, kiln_scalar(KILN_F64, -1.5));
  ck_assert_ptr_nonnull(ss);
  ck_assert_int_eq(0, kiln_ndim(ss));
  ck_assert_double_eq(-3.0, kiln_item(ss));

  /* A one-element tensor of any rank has an item. */
  ck_assert_double_eq(4.0, kiln_item(kiln_full(KILN_F64, 2, ((int64_t[]){1, 1}), 4.0)));
  /* And a 0-d reduction result. */
  kiln_tensor *tot = kiln_sum_all(x);
  ck_assert_int_eq(0, kiln_ndim(tot));
  ck_assert_double_eq(21.0, kiln_item(tot));
  kiln_scope_end();
}
END_TEST

#ifdef KILN_TEST_BUILD
/* A scope that cannot be opened (out of memory) still pairs with its end:
 * that end must not close the scope around it. */
START_TEST(test_scope_begin_out_of_memory) {
  kiln_tensor *held[16];
  for (int i = 0; i < 16; i++) { /* fill the scope stack's inline levels */
    kiln_scope_begin();
    held[i] = kiln_zeros(KILN_F32, 1, ((int64_t[]){4}));
  }
  alloc_fail_after(1);
  kiln_scope_begin(); /* needs to grow the stack: fails */
  alloc_fail_after(0);
  ck_assert(strstr(kiln_last_error(), "out of memory") != NULL);
  kiln_scope_end(); /* closes nothing */
  ck_assert_int_eq(4, kiln_numel(held[15])); /* still alive: its scope is open */
  for (int i = 0; i < 16; i++) kiln_scope_end();
  kiln_clear_error();
}
END_TEST
#endif

/* The caller's line is in every message about a tensor released before its
 * time, in every build (this runs in the release build too); nothing is
 * freed twice, and the library goes on. */
START_TEST(test_release_misuse)
{
  size_t base = kiln_mem_in_use();
  char want[128];
  kiln_tensor *t = kiln_zeros(KILN_F32, 1, (int64_t[]){4});
  kiln_release(t);
  ck_assert_uint_eq(base, kiln_mem_in_use()); /* the first release freed the storage */
  kiln_clear_error();
  int line = __LINE__ + 1;
  kiln_release(t);
  snprintf(want, sizeof want, "test_tensor.c:%d: kiln_release: tensor was already released", line);
  ck_assert_msg(strstr(kiln_last_error(), want), "%s", kiln_last_error());
  line = __LINE__ + 1;
  ck_assert_ptr_null(kiln_mul(t, t));
  snprintf(want, sizeof want, "test_tensor.c:%d: kiln_mul: an input was already released", line);
  ck_assert_msg(strstr(kiln_last_error(), want), "%s", kiln_last_error());
  ck_assert_int_eq(-1, kiln_ndim(t));

  /* a scope's tensor released by hand: refused where it is done */
  kiln_scope_begin();
  kiln_tensor *s = kiln_ones(KILN_F32, 1, (int64_t[]){4});
  line = __LINE__ + 1;
  kiln_release(s);
  snprintf(want, sizeof want, "test_tensor.c:%d: kiln_release: tensor belongs to a scope", line);
  ck_assert_msg(strstr(kiln_last_error(), want), "%s", kiln_last_error());
  ck_assert_double_eq(4, kiln_item(kiln_sum_all(s)));
  kiln_scope_end(); /* the one release, by its owner */
  ck_assert_uint_eq(base, kiln_mem_in_use());

  /* kept out of two scopes: the caller's, so its release is fine */
  kiln_scope_begin();
  kiln_scope_begin();
  kiln_tensor *k = kiln_keep(kiln_ones(KILN_F32, 1, (int64_t[]){4}));
  kiln_scope_end();
  kiln_release(k);
  ck_assert_msg(strstr(kiln_last_error(), "belongs to a scope"), "%s", kiln_last_error()); /* the outer scope's */
  ck_assert_int_eq(4, kiln_numel(k));
  kiln_keep(k);
  kiln_scope_end();
  kiln_clear_error();
  kiln_release(k);
  ck_assert_str_eq("", kiln_last_error());
  ck_assert_uint_eq(base, kiln_mem_in_use());
}
END_TEST

/* A released header is not handed out again before 4096 later releases (so
 * far a second release is still caught), and then it is: the headers kept
 * are bounded. */
START_TEST(test_released_header_reuse)
{
  kiln_tensor *t0 = kiln_zeros(KILN_F32, 1, (int64_t[]){1});
  kiln_release(t0);
  int reused_at = -1;
  for (int i = 0; i < 3 * 4096 && reused_at < 0; i++) {
    kiln_tensor *t = kiln_zeros(KILN_F32, 1, (int64_t[]){1});
    if (t == t0) reused_at = i;
    kiln_release(t);
    if (i == 4094) {
      kiln_clear_error();
      kiln_release(t0); /* 4095 releases later: still known as released */
      ck_assert_msg(strstr(kiln_last_error(), "already released"), "%s", kiln_last_error());
    }
  }
  ck_assert_msg(reused_at >= 4096, "the header was reused after %d releases", reused_at);
}
END_TEST

static Suite *tensor_suite(void)
{
  Suite *s = suite_create("tensor");
  TCase *make = tcase_create("make and inspect");
  tcase_add_test(make, test_creation);
#ifdef KILN_TEST_BUILD
  tcase_add_test(make, test_scope_begin_out_of_memory);
#endif
  tcase_add_test(make, test_dtypes);
  tcase_add_test(make, test_sizes_and_strides);
  tcase_add_test(make, test_views_share_storage);
  tcase_add_test(make, test_scalar_broadcast);
  suite_add_tcase(s, make);

  TCase *rng = tcase_create("random");
  tcase_set_timeout(rng, 60);
  tcase_add_test(rng, test_randn_determinism);
  tcase_add_test(rng, test_randn_statistics);
  tcase_add_test(rng, test_rand_uniform);
  tcase_add_test(rng, test_rand_thread_independent);
  suite_add_tcase(s, rng);

  TCase *life = tcase_create("lifetime");
  tcase_add_test(life, test_scopes);
  tcase_add_test(life, test_retain_release);
  tcase_add_test(life, test_release_misuse);
  tcase_add_test(life, test_released_header_reuse);
  tcase_add_test(life, test_mem_peak);
  tcase_add_test(life, test_block_cache_reuse);
  suite_add_tcase(s, life);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(tensor_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
