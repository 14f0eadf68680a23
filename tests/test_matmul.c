/* matmul layouts: transposed views go to BLAS as transposes (no copy, seen in
 * the storage peak), layouts BLAS cannot read are copied and still right, and
 * a batch that stacks into one GEMM gives the same numbers as the loop. Values
 * are checked against a plain triple loop in double. */
#include <check.h>
#include <math.h>
#include <stdlib.h>

#include "kiln.h"

/* C[i,j] = sum_k A[i,k] B[k,j] from row-major copies, in double. */
static double ref_at(const float *a, const float *b, int64_t k, int64_t n, int64_t i, int64_t j) {
  double s = 0;
  for (int64_t q = 0; q < k; q++) s += (double)a[i * k + q] * b[q * n + j];
  return s;
}

static void check_product(kiln_tensor *a, kiln_tensor *b, kiln_tensor *c) {
  int64_t m = kiln_size(a, 0), k = kiln_size(a, 1), n = kiln_size(b, 1);
  float *pa = malloc(sizeof(float) * (size_t)(m * k)), *pb = malloc(sizeof(float) * (size_t)(k * n)),
        *pc = malloc(sizeof(float) * (size_t)(m * n));
  ck_assert_int_eq(0, kiln_read(a, pa, sizeof(float) * (size_t)(m * k)));
  ck_assert_int_eq(0, kiln_read(b, pb, sizeof(float) * (size_t)(k * n)));
  ck_assert_int_eq(0, kiln_read(c, pc, sizeof(float) * (size_t)(m * n)));
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double want = ref_at(pa, pb, k, n, i, j);
      ck_assert_msg(fabs(pc[i * n + j] - want) <= 1e-4 * (1 + fabs(want)), "[%lld,%lld]: want %g got %g", (long long)i,
                    (long long)j, want, pc[i * n + j]);
    }
  free(pa), free(pb), free(pc);
}

START_TEST(test_transposed_views_are_not_copied) {
  kiln_scope_begin();
  int64_t sa[2] = {96, 64}, sb[2] = {80, 96};
  kiln_tensor *a0 = kiln_randn(KILN_F32, 2, sa, 1), *b0 = kiln_randn(KILN_F32, 2, sb, 2);
  kiln_tensor *a = kiln_transpose(a0, 0, 1), *b = kiln_transpose(b0, 0, 1); /* (64,96) and (96,80) */
  kiln_mem_reset_peak();
  size_t before = kiln_mem_in_use();
  kiln_tensor *c = kiln_matmul(a, b);
  ck_assert_ptr_nonnull(c);
  /* only the (64,80) output was allocated: no copy of either operand */
  ck_assert_uint_eq(before + 64 * 80 * sizeof(float), kiln_mem_peak());
  check_product(a, b, c);
  kiln_scope_end();
}
END_TEST

START_TEST(test_unreadable_layout_is_copied) {
  kiln_scope_begin();
  int64_t s[2] = {40, 60};
  kiln_tensor *x = kiln_randn(KILN_F32, 2, s, 3);
  /* every other row and column: neither dim has unit stride */
  kiln_tensor *a = kiln_slice(kiln_slice(x, 0, 0, 40, 2), 1, 0, 60, 2); /* (20,30) */
  kiln_tensor *b = kiln_transpose(kiln_slice(x, 1, 1, 60, 3), 0, 1);    /* (20,40) */
  kiln_tensor *c = kiln_matmul(kiln_transpose(a, 0, 1), b);               /* (30,40) */
  ck_assert_ptr_nonnull(c);
  check_product(kiln_contiguous(kiln_transpose(a, 0, 1)), kiln_contiguous(b), c);
  kiln_scope_end();
}
END_TEST

START_TEST(test_stacked_batch_matches_loop) {
  kiln_scope_begin();
  int64_t sa[3] = {3, 17, 24}, sb[2] = {24, 9};
  kiln_tensor *a = kiln_randn(KILN_F32, 3, sa, 4), *b = kiln_randn(KILN_F32, 2, sb, 5);
  kiln_tensor *c = kiln_matmul(a, b); /* one GEMM of (51,24) x (24,9) */
  ck_assert_int_eq(3, kiln_ndim(c));
  for (int64_t i = 0; i < 3; i++) {
    kiln_tensor *ai = kiln_squeeze(kiln_slice(a, 0, i, i + 1, 1), 0);
    check_product(kiln_contiguous(ai), b, kiln_squeeze(kiln_slice(c, 0, i, i + 1, 1), 0));
  }
  kiln_scope_end();
}
END_TEST

/* Found by fuzz_eager: a batch whose dims broadcast (an expand, stride 0)
 * over a 2-D b was taken as stacked, because a size-1 batch dim's stride
 * (any value; 0 here) stood in for the step below it, and the batch was
 * folded into one GEMM that read batch * m rows of an m-row matrix (heap
 * overflow). The fuzzer's shapes (3,1,3,2) @ (2,3)^T, and a larger one;
 * each batch is the 2-D product. A size-1 dim between dims that do stack,
 * (2,1,5,4) from a contiguous (2,5,4), still stacks: the same numbers. */
static void check_each_batch(kiln_tensor *a, kiln_tensor *b, int64_t batch, int64_t m) {
  kiln_tensor *c = kiln_matmul(a, b);
  ck_assert_ptr_nonnull(c);
  kiln_tensor *a3 = kiln_reshape(kiln_contiguous(a), 3, ((int64_t[]){batch, m, kiln_size(b, 0)}));
  kiln_tensor *c3 = kiln_reshape(kiln_contiguous(c), 3, ((int64_t[]){batch, m, kiln_size(b, 1)}));
  for (int64_t i = 0; i < batch; i++) {
    kiln_tensor *ai = kiln_squeeze(kiln_slice(a3, 0, i, i + 1, 1), 0);
    check_product(ai, kiln_contiguous(b), kiln_squeeze(kiln_slice(c3, 0, i, i + 1, 1), 0));
  }
}

START_TEST(test_broadcast_batch_is_not_stacked) {
  kiln_scope_begin();
  const int64_t ms[] = {3, 17}, ks[] = {2, 24}, ns[] = {3, 9};
  for (int t = 0; t < 2; t++) {
    int64_t m = ms[t], k = ks[t], n = ns[t];
    kiln_tensor *a0 = kiln_randn(KILN_F32, 2, ((int64_t[]){m, k}), 20 + (uint64_t)t);
    kiln_tensor *a = kiln_expand(a0, 4, ((int64_t[]){3, 1, m, k})); /* strides (0, 0, k, 1) */
    ck_assert_int_eq(0, kiln_stride(a, 0));
    ck_assert_int_eq(0, kiln_stride(a, 1));
    kiln_tensor *b = kiln_transpose(kiln_randn(KILN_F32, 2, ((int64_t[]){n, k}), 30 + (uint64_t)t), 0, 1);
    check_each_batch(a, b, 3, m);
    check_each_batch(a, kiln_contiguous(b), 3, m);
  }
  kiln_tensor *x = kiln_randn(KILN_F32, 3, ((int64_t[]){2, 5, 4}), 40);
  kiln_tensor *a = kiln_unsqueeze(x, 1); /* (2,1,5,4) */
  check_each_batch(a, kiln_randn(KILN_F32, 2, ((int64_t[]){4, 6}), 41), 2, 5);
  kiln_scope_end();
}
END_TEST

/* A one-row product whose matrix is small runs on kiln's own loop (the
 * matrix as rows of dot products when it is a transposed view, else
 * row-scaled adds), a larger one on BLAS: each layout, lengths that leave
 * a tail of the vector step or of the four rows per pass, a strided row,
 * f32 and f64, against the double triple loop. */
static void check_row_product(kiln_dtype dt, kiln_tensor *a, kiln_tensor *b) {
  kiln_tensor *c = kiln_matmul(a, b);
  ck_assert_ptr_nonnull(c);
  ck_assert_int_eq(dt, kiln_type(c));
  /* compared in f32 by check_product; f64 inputs are exact in f64 and the
   * tolerance there is far above f64's error */
  check_product(kiln_contiguous(kiln_cast(a, KILN_F32)), kiln_contiguous(kiln_cast(b, KILN_F32)), kiln_cast(c, KILN_F32));
}

START_TEST(test_row_products) {
  const int64_t ks[] = {1, 7, 16, 17, 100, 256}, ns[] = {1, 3, 4, 5, 33, 256};
  kiln_dtype dts[] = {KILN_F32, KILN_F64};
  uint64_t seed = 10;
  for (int d = 0; d < 2; d++)
    for (int ik = 0; ik < 6; ik++)
      for (int in = 0; in < 6; in++) {
        kiln_scope_begin();
        int64_t k = ks[ik], n = ns[in];
        kiln_tensor *a = kiln_randn(dts[d], 2, ((int64_t[]){1, k}), seed++);
        kiln_tensor *b = kiln_randn(dts[d], 2, ((int64_t[]){k, n}), seed++);
        kiln_tensor *bt = kiln_transpose(kiln_randn(dts[d], 2, ((int64_t[]){n, k}), seed++), 0, 1);
        /* row 0 of a (k,3) block's transpose: a (1,k) view with stride 3 */
        kiln_tensor *as = kiln_transpose(kiln_slice(kiln_randn(dts[d], 2, ((int64_t[]){k, 3}), seed++), 1, 0, 1, 1), 0, 1);
        check_row_product(dts[d], a, b);
        check_row_product(dts[d], a, bt);
        check_row_product(dts[d], as, b);
        check_row_product(dts[d], as, bt);
        kiln_scope_end();
      }
  /* past the small size: BLAS, the same numbers */
  kiln_scope_begin();
  kiln_tensor *a = kiln_randn(KILN_F32, 2, ((int64_t[]){1, 1024}), 90);
  check_row_product(KILN_F32, a, kiln_randn(KILN_F32, 2, ((int64_t[]){1024, 300}), 91));
  check_row_product(KILN_F32, a, kiln_transpose(kiln_randn(KILN_F32, 2, ((int64_t[]){300, 1024}), 92), 0, 1));
  kiln_scope_end();
}
END_TEST

int main(void) {
  Suite *s = suite_create("matmul");
  TCase *tc = tcase_create("layouts");
  tcase_add_test(tc, test_transposed_views_are_not_copied);
  tcase_add_test(tc, test_unreadable_layout_is_copied);
  tcase_add_test(tc, test_stacked_batch_matches_loop);
  tcase_add_test(tc, test_broadcast_batch_is_not_stacked);
  tcase_add_test(tc, test_row_products);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
