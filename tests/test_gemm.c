/* test_gemm.c - kiln's own GEMM (src/eager/gemm.c) against a triple loop in
 * double: every transpose, leading dimensions wider than the matrix, alpha
 * and beta, sizes on and off the tile and block edges (several K slices,
 * several column blocks, several row blocks). Also: C outside the product
 * is never written, beta 0 never reads C, the bits do not depend on the
 * thread count, and the cases it declines (m < 6, tiny products; the
 * bigger ones where OpenBLAS runs AVX-512 kernels, unless KILN_GEMM=kiln)
 * leave C alone. Run twice by ctest: once with the host's kernel, once with
 * KILN_GEMM=avx2 (the 8-lane kernel on an AVX-512 host). */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "eager/gemm.h"
#include "eager/pool.h"

static uint64_t rng = 88172645463325252ull;
static float unif(void) { /* xorshift64 in [-1, 1) */
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (float)((double)(rng >> 11) / 9007199254740992.0 * 2 - 1);
}

typedef struct gcase {
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;
} gcase;

static const float GUARD = 12345.0f; /* what C holds past column n */

/* Runs one case through kgemm_f32 and checks it against double sums. */
static void run_case(gcase g) {
  int64_t arows = g.ta ? g.k : g.m, brows = g.tb ? g.n : g.k;
  float *a = malloc(sizeof(float) * (size_t)(arows * g.lda)), *b = malloc(sizeof(float) * (size_t)(brows * g.ldb));
  float *c = malloc(sizeof(float) * (size_t)(g.m * g.ldc)), *c0 = malloc(sizeof(float) * (size_t)(g.m * g.ldc));
  for (int64_t i = 0; i < arows * g.lda; i++) a[i] = unif();
  for (int64_t i = 0; i < brows * g.ldb; i++) b[i] = unif();
  for (int64_t i = 0; i < g.m; i++)
    for (int64_t j = 0; j < g.ldc; j++)
      c0[i * g.ldc + j] = j >= g.n ? GUARD : g.beta == 0 ? NAN : unif(); /* beta 0 must not read the NaNs */
  memcpy(c, c0, sizeof(float) * (size_t)(g.m * g.ldc));
  bool ran = kgemm_f32(g.ta, g.tb, g.m, g.n, g.k, g.alpha, a, g.lda, b, g.ldb, g.beta, c, g.ldc);
  /* where OpenBLAS has AVX-512 kernels, products of several row blocks are its (see gemm.h) */
  bool head = g.tb && !g.ta && g.n >= 4 * g.m && g.m >= 8;
  const char *mode = getenv("KILN_GEMM");
  if (!ran && gemm_blas_avx512() && !(mode && !strcmp(mode, "kiln")) && !strcmp(gemm_kernel_name(), "avx512") &&
      g.m > 96 && g.n > 16 && !head) {
    free(a), free(b), free(c), free(c0);
    return;
  }
  ck_assert_msg(ran, "kgemm_f32 declined %lldx%lldx%lld", (long long)g.m, (long long)g.n, (long long)g.k);
  for (int64_t i = 0; i < g.m; i++)
    for (int64_t j = 0; j < g.ldc; j++) {
      float got = c[i * g.ldc + j];
      if (j >= g.n) {
        ck_assert_msg(got == GUARD, "C[%lld,%lld] past n written", (long long)i, (long long)j);
        continue;
      }
      double s = 0, mag = 0;
      for (int64_t q = 0; q < g.k; q++) {
        double x = g.ta ? a[q * g.lda + i] : a[i * g.lda + q], y = g.tb ? b[j * g.ldb + q] : b[q * g.ldb + j];
        s += x * y, mag += fabs(x * y);
      }
      double want = g.alpha * s + (g.beta == 0 ? 0 : g.beta * (double)c0[i * g.ldc + j]);
      double tol = 4e-7 * (double)(g.k + 2) * (fabs(g.alpha) * mag + 1);
      ck_assert_msg(fabs(got - want) <= tol, "%s%s %lldx%lldx%lld alpha %g beta %g: C[%lld,%lld] = %.9g, want %.9g",
                    g.ta ? "A^T" : "A", g.tb ? "B^T" : "B", (long long)g.m, (long long)g.n, (long long)g.k,
                    (double)g.alpha, (double)g.beta, (long long)i, (long long)j, (double)got, want);
    }
  free(a), free(b), free(c), free(c0);
}

static gcase make(bool ta, bool tb, int64_t m, int64_t n, int64_t k, int pad, float alpha, float beta) {
  gcase g = {.ta = ta, .tb = tb, .m = m, .n = n, .k = k, .alpha = alpha, .beta = beta};
  g.lda = (ta ? m : k) + pad, g.ldb = (tb ? k : n) + pad, g.ldc = n + pad;
  return g;
}

START_TEST(test_kernel_is_known) {
  const char *want = getenv("KILN_GEMM"), *got = gemm_kernel_name();
  ck_assert(!strcmp(got, "avx512") || !strcmp(got, "avx2") || !strcmp(got, "blas"));
  if (want && !strcmp(want, "avx2")) ck_assert_msg(strcmp(got, "avx512") != 0, "KILN_GEMM=avx2 ran %s", got);
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f") && !want)
    ck_assert_msg(!strcmp(got, "avx512"), "an AVX-512 host ran %s", got);
  if (!__builtin_cpu_supports("avx512f") && !want) ck_assert_msg(!strcmp(got, "blas"), "an AVX2 host ran %s", got);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && want && !strcmp(want, "avx2"))
    ck_assert_msg(!strcmp(got, "avx2"), "KILN_GEMM=avx2 ran %s", got);
#endif
}
END_TEST

/* Every transpose pair, with and without padding, alpha and beta, at sizes on
 * and around the tile edges of both kernels (MR 6 or 8, NR 16 or 32). */
START_TEST(test_layouts_and_edges) {
  if (!strcmp(gemm_kernel_name(), "blas")) return; /* nothing of kiln's runs here: test_matmul covers BLAS */
  static const int64_t ms[] = {6, 7, 8, 9, 13, 48, 97}, ns[] = {15, 16, 17, 31, 32, 33, 100};
  static const int64_t ks[] = {1, 3, 64, 385, 800};
  int i = 0;
  for (int t = 0; t < 4; t++)
    for (size_t x = 0; x < sizeof ms / sizeof *ms; x++)
      for (size_t y = 0; y < sizeof ns / sizeof *ns; y++)
        for (size_t z = 0; z < sizeof ks / sizeof *ks; z++, i++) {
          if (ms[x] * ns[y] * ks[z] < (1 << 15)) continue; /* declined: see test_declines */
          float alpha = i % 3 == 0 ? 0.5f : 1.0f, beta = i % 4 == 1 ? 0.75f : 0.0f;
          run_case(make(t & 1, t >> 1 & 1, ms[x], ns[y], ks[z], i % 2 ? 3 : 0, alpha, beta));
        }
}
END_TEST

/* Column blocks past NC (3072), row blocks past MB (4032), K past two slices;
 * x @ W^T with W the wider one is computed as (W @ x^T)^T (n >= 4m). */
START_TEST(test_blocks) {
  if (!strcmp(gemm_kernel_name(), "blas")) return;
  run_case(make(false, true, 9, 3100, 40, 1, 1.0f, 0.0f));
  run_case(make(false, false, 4040, 20, 24, 0, 1.0f, 0.5f));
  run_case(make(true, false, 4040, 33, 17, 2, 2.0f, 0.0f));
  run_case(make(false, false, 37, 45, 1000, 0, 1.0f, 1.0f));
  run_case(make(false, false, 20, 40, 1024, 0, 1.0f, 0.0f)); /* rows 4 KiB apart: A packed, not read in place */
  run_case(make(false, true, 20, 40, 1024, 0, 1.0f, 0.0f));
}
END_TEST

/* The same product at 1, 2 and 3 threads gives the same bits. */
START_TEST(test_threads_same_bits) {
  if (!strcmp(gemm_kernel_name(), "blas")) return;
  enum { M = 90, N = 300, K = 500 };
  float *a = malloc(sizeof(float) * M * K), *b = malloc(sizeof(float) * K * N);
  float *c[3];
  for (int i = 0; i < M * K; i++) a[i] = unif();
  for (int i = 0; i < K * N; i++) b[i] = unif();
  for (int t = 0; t < 3; t++) {
    pool_set_num_threads(t + 1);
    c[t] = malloc(sizeof(float) * M * N);
    /* B^T: b read as (N, K) */
    ck_assert_msg(kgemm_f32(false, true, M, N, K, 1.0f, a, K, b, K, 0.0f, c[t], N), "declined");
  }
  pool_set_num_threads(0);
  ck_assert(!memcmp(c[0], c[1], sizeof(float) * M * N));
  ck_assert(!memcmp(c[0], c[2], sizeof(float) * M * N));
  free(a), free(b), free(c[0]), free(c[1]), free(c[2]);
}
END_TEST

/* m < 6 and products too small to pay for packing go to BLAS: nothing written. */
START_TEST(test_declines) {
  float a[64 * 64] = {0}, b[64 * 64] = {0}, c[64 * 64];
  for (int i = 0; i < 64 * 64; i++) c[i] = GUARD;
  ck_assert(!kgemm_f32(false, false, 1, 64, 64, 1.0f, a, 64, b, 64, 0.0f, c, 64));
  ck_assert(!kgemm_f32(false, true, 5, 64, 64, 1.0f, a, 64, b, 64, 0.0f, c, 64));
  ck_assert(!kgemm_f32(false, false, 8, 8, 8, 1.0f, a, 8, b, 8, 0.0f, c, 8));
  ck_assert(!kgemm_f32(false, false, 4, 4, 0, 1.0f, a, 4, b, 4, 0.0f, c, 4));
  for (int i = 0; i < 64 * 64; i++) ck_assert(c[i] == GUARD);
  /* Where OpenBLAS runs AVX-512 kernels it keeps products of several row
   * blocks (ctest runs this file once with OPENBLAS_CORETYPE=SkylakeX). */
  if (!strcmp(gemm_kernel_name(), "avx512")) {
    enum { M = 200, N = 64, K = 64 };
    float *x = calloc(M * K, sizeof(float)), *y = calloc(K * N, sizeof(float)), *z = calloc(M * N, sizeof(float));
    const char *want = getenv("KILN_GEMM");
    bool own = want && !strcmp(want, "kiln"); /* KILN_GEMM=kiln: kiln's takes them all */
    ck_assert_int_eq(kgemm_f32(false, false, M, N, K, 1.0f, x, K, y, N, 0.0f, z, N), own || !gemm_blas_avx512());
    ck_assert(kgemm_f32(false, false, 96, N, K, 1.0f, x, K, y, N, 0.0f, z, N));
    ck_assert(kgemm_f32(false, false, M, 16, K, 1.0f, x, K, y, 16, 0.0f, z, 16)); /* 16 columns: kiln's */
    free(x), free(y), free(z);
  }
  const char *core = getenv("OPENBLAS_CORETYPE");
  if (core && !strcmp(core, "SkylakeX")) ck_assert(gemm_blas_avx512());
  if (core && !strcmp(core, "Haswell")) ck_assert(!gemm_blas_avx512());
}
END_TEST

int main(void) {
  Suite *s = suite_create("gemm");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_kernel_is_known);
  tcase_add_test(tc, test_layouts_and_edges);
  tcase_add_test(tc, test_blocks);
  tcase_add_test(tc, test_threads_same_bits);
  tcase_add_test(tc, test_declines);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
