/* gemm.h - kiln's own single-precision GEMM (gemm.c). */
#ifndef KILN_EAGER_GEMM_H
#define KILN_EAGER_GEMM_H

#include <cblas.h>
#include <stdbool.h>
#include <stdint.h>

/* c (m x n, row stride ldc) = alpha * op(a) @ op(b) + beta * c, row-major as
 * cblas_sgemm: op(a) is a (m x k, stride lda) or, when ta, the transpose of a
 * (k x m); likewise b. beta 0 never reads c. Returns false, having written
 * nothing, where it does not run (no AVX-512 unless KILN_GEMM=avx2, not
 * x86-64, m < 6, a product too small to pay for packing, m > 96 where
 * OpenBLAS has AVX-512 kernels (gemm_blas_avx512) but for x @ W^T or
 * n <= 16, out of memory): the caller then calls BLAS. */
bool kgemm_f32(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
              const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

/* A row-major f32 GEMM as cblas_sgemm: kgemm_f32 where it runs, else
 * cblas_sgemm. What every f32 GEMM of kiln calls. */
void gemm_sgemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

/* c (m x n) = a (m x k) @ b (k x n), row-major, on the calling thread, for
 * a caller that is itself one of the pool's tasks: kiln's kernel wherever
 * it runs (also where gemm_sgemm would leave it to OpenBLAS, whose own
 * threads would fight the pool's), cblas_sgemm else. */
void gemm_sgemm_task(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb,
                     float *c, int64_t ldc);

/* c (m x n) = a (m x k) @ b^T + beta * c, b (n x k): gemm_sgemm_task's
 * other form, for sums over a long k run in pieces (Winograd's weight
 * gradient). */
void gemm_sgemm_task_bt(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb,
                        float beta, float *c, int64_t ldc);

/* Whether OpenBLAS runs its AVX-512 kernels here (by CPU model or
 * OPENBLAS_CORETYPE): kgemm_f32 then leaves it the products of more than
 * one row block (m > 96), where they are faster. */
bool gemm_blas_avx512(void);

/* Which kernel kgemm_f32 runs here: "avx512", "avx2" or "blas" (never runs).
 * AVX-512 CPUs run kiln's; KILN_GEMM=blas turns it off, KILN_GEMM=kiln
 * leaves OpenBLAS nothing it could take (for comparing), KILN_GEMM=avx2
 * runs the AVX2 kernel (which is not the default on AVX2 CPUs: OpenBLAS's
 * is a little faster there). */
const char *gemm_kernel_name(void);

#endif
