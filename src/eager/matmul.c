/* matmul through OpenBLAS: 1-D, 2-D and batched with broadcast batch dims.
 * A transposed view goes to BLAS as a transpose flag, never as a copy; only
 * layouts BLAS cannot take (neither dim unit-stride) are copied first. A
 * batch whose matrices stack into one (x @ w with x (B,M,K) contiguous) runs
 * as one GEMM. */
#include <cblas.h>
#include <stdbool.h>
#include <string.h>

#include "eager/eager.h"
#include "eager/gemm.h"

int cblas_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, CBLAS_TRANSPOSE *tr, int64_t *ld) {
  if (cs == 1 && (rows <= 1 || rs >= (cols > 1 ? cols : 1))) {
    *tr = CblasNoTrans;
    *ld = rows <= 1 ? (cols > 1 ? cols : 1) : rs;
    return 0;
  }
  if (rs == 1 && (cols <= 1 || cs >= (rows > 1 ? rows : 1))) {
    *tr = CblasTrans;
    *ld = cols <= 1 ? (rows > 1 ? rows : 1) : cs;
    return 0;
  }
  return -1;
}

/* A one-row product whose matrix has at most SMALL_GEMV elements runs here,
 * on the calling thread. OpenBLAS splits even a 256x256 gemv over both
 * cores: alone that gained nothing (batch-1 W6), and its second thread then
 * spins on the other core and slowed whatever ran next, eager or compiled,
 * by up to 2x (docs/perf.md). Larger ones go to OpenBLAS as before. */
enum { SMALL_GEMV = 1 << 18 };

/* c[0, n) = a[0, k) (stride inca) times the matrix b: with rows, b holds it
 * transposed, row j of length k at b + j*ldb (a dot product per output, in
 * one 64-byte vector of lanes added pairwise, as eager's sums); else row i of length n at
 * b + i*ldb (c accumulates a[i] times row i, in i's order). */
typedef float gv_f32 __attribute__((vector_size(64)));
typedef double gv_f64 __attribute__((vector_size(64)));

#define SMALL_GEMV_FN(T, VT, NAME)                                                               \
  KILN_HOT static void NAME(bool rows, int64_t n, int64_t k, const T *a, int64_t inca, const T *b,\
                            int64_t ldb, T *c) {                                                 \
    enum { L = 64 / sizeof(T) };                                                                 \
    if (rows) {                                                                                  \
      /* four outputs per pass: four independent chains hide the adds' latency */               \
      for (int64_t j = 0; j < n; j += 4) {                                                       \
        int nr = n - j < 4 ? (int)(n - j) : 4;                                                   \
        const T *r[4];                                                                           \
        for (int q = 0; q < 4; q++) r[q] = b + (j + (q < nr ? q : 0)) * ldb;                    \
        VT acc[4] = {{0}};                                                                       \
        T tail[4] = {0};                                                                         \
        int64_t i = 0;                                                                           \
        for (; inca == 1 && i + L <= k; i += L) {                                                \
          VT x, w;                                                                               \
          memcpy(&x, a + i, sizeof x);                                                           \
          for (int q = 0; q < 4; q++) {                                                          \
            memcpy(&w, r[q] + i, sizeof w);                                                      \
            acc[q] += w * x;                                                                     \
          }                                                                                      \
        }                                                                                        \
        for (; i < k; i++)                                                                       \
          for (int q = 0; q < 4; q++) tail[q] += r[q][i] * a[i * inca];                          \
        for (int q = 0; q < nr; q++) {                                                           \
          T lane[L];                                                                             \
          memcpy(lane, &acc[q], sizeof lane);                                                    \
          for (int w = L / 2; w; w >>= 1)                                                        \
            for (int l = 0; l < w; l++) lane[l] += lane[l + w];                                  \
          c[j + q] = lane[0] + tail[q];                                                          \
        }                                                                                        \
      }                                                                                          \
      return;                                                                                    \
    }                                                                                            \
    for (int64_t j = 0; j < n; j++) c[j] = 0;                                                    \
    for (int64_t i = 0; i < k; i++) {                                                            \
      const T s = a[i * inca], *r = b + i * ldb;                                                 \
      for (int64_t j = 0; j < n; j++) c[j] += s * r[j];                                          \
    }                                                                                            \
  }
SMALL_GEMV_FN(float, gv_f32, small_gemv_f32)
SMALL_GEMV_FN(double, gv_f64, small_gemv_f64)

/* m, n and k are at least 1 (k_matmul returns before an empty product) */
static void gemm(kiln_dtype dt, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k,
                 const void *a, int64_t lda, const void *b, int64_t ldb, void *c, int64_t ldc) {
  if (m == 1 && n * k <= SMALL_GEMV) {
    int64_t inca = ta == CblasNoTrans ? 1 : lda;
    if (dt == KILN_F32) small_gemv_f32(tb == CblasTrans, n, k, a, inca, b, ldb, c);
    else small_gemv_f64(tb == CblasTrans, n, k, a, inca, b, ldb, c);
    return;
  }
  if (dt == KILN_F32) {
    if (m == 1 && tb == CblasNoTrans)
      cblas_sgemv(CblasRowMajor, CblasTrans, (int)k, (int)n, 1.0f, b, (int)ldb, a, ta == CblasNoTrans ? 1 : (int)lda,
                  0.0f, c, 1);
    else if (m == 1)
      cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)n, (int)k, 1.0f, b, (int)ldb, a, ta == CblasNoTrans ? 1 : (int)lda,
                  0.0f, c, 1);
    else
      gemm_sgemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
  } else {
    if (m == 1 && tb == CblasNoTrans)
      cblas_dgemv(CblasRowMajor, CblasTrans, (int)k, (int)n, 1.0, b, (int)ldb, a, ta == CblasNoTrans ? 1 : (int)lda,
                  0.0, c, 1);
    else if (m == 1)
      cblas_dgemv(CblasRowMajor, CblasNoTrans, (int)n, (int)k, 1.0, b, (int)ldb, a, ta == CblasNoTrans ? 1 : (int)lda,
                  0.0, c, 1);
    else
      cblas_dgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, 1.0, a, (int)lda, b, (int)ldb, 0.0, c, (int)ldc);
  }
}

/* A contiguous copy of t, owned by the caller (for layouts BLAS cannot read). */
static kiln_tensor *dense_copy(const kiln_tensor *t) {
  kiln_tensor *c = tensor_new(t->dtype, t->ndim, t->shape);
  if (c) pw_copy(c, t);
  return c;
}

int k_matmul(op_id op, kiln_tensor *const *in, int n, const op_attrs *attrs, kiln_tensor *out) {
  (void)op, (void)n, (void)attrs;
  const kiln_tensor *a = in[0], *b = in[1];
  kiln_tensor *ca = NULL, *cb = NULL;
  /* 1-D operands as (1,K) and (K,1) matrices with the same storage */
  kiln_tensor av = tensor_header(a), bv = tensor_header(b);
  if (a->ndim == 1) {
    av.ndim = 2;
    av.shape[0] = 1, av.shape[1] = a->shape[0];
    av.stride[0] = a->shape[0], av.stride[1] = a->stride[0];
  }
  if (b->ndim == 1) {
    bv.ndim = 2;
    bv.shape[0] = b->shape[0], bv.shape[1] = 1;
    bv.stride[0] = b->stride[0], bv.stride[1] = 1;
  }
  int64_t m = av.shape[av.ndim - 2], k = av.shape[av.ndim - 1], nn = bv.shape[bv.ndim - 1];
  int64_t n_out = shape_numel(out->ndim, out->shape);
  if (n_out == 0 || k == 0) { /* an empty product, or sums over nothing: buffers of no bytes may be NULL */
    if (n_out) memset(tensor_data(out), 0, (size_t)n_out * kiln_dtype_size(out->dtype));
    return 0;
  }
  CBLAS_TRANSPOSE ta = CblasNoTrans, tb = CblasNoTrans;
  int64_t lda = 1, ldb = 1;
  if (cblas_layout(m, k, av.stride[av.ndim - 2], av.stride[av.ndim - 1], &ta, &lda)) {
    if (!(ca = dense_copy(&av))) return -1;
    av = *ca;
    cblas_layout(m, k, av.stride[av.ndim - 2], av.stride[av.ndim - 1], &ta, &lda);
  }
  if (cblas_layout(k, nn, bv.stride[bv.ndim - 2], bv.stride[bv.ndim - 1], &tb, &ldb)) {
    if (!(cb = dense_copy(&bv))) {
      kiln_release(ca);
      return -1;
    }
    bv = *cb;
    cblas_layout(k, nn, bv.stride[bv.ndim - 2], bv.stride[bv.ndim - 1], &tb, &ldb);
  }
  size_t es = kiln_dtype_size(a->dtype);
  int nba = av.ndim - 2, nbb = bv.ndim - 2;
  int64_t batch = 1;
  int nb = nba > nbb ? nba : nbb;
  int64_t bshape[MAXD];
  for (int i = 0; i < nb; i++) {
    int ia = i - (nb - nba), ib = i - (nb - nbb);
    int64_t da = ia >= 0 ? av.shape[ia] : 1, db = ib >= 0 ? bv.shape[ib] : 1;
    bshape[i] = da == 1 ? db : da; /* not the max: a 1 broadcasts to a 0 */
    batch *= bshape[i];
  }
  char *pa = tensor_data(&av), *pb = tensor_data(&bv), *pc = tensor_data(out);
  bool b_shared = true; /* b has no batch stride: fold a's batch into M when a stacks */
  for (int i = 0; i < nbb; i++) b_shared &= bv.shape[i] == 1;
  /* a's batch steps over whole (m, k) blocks laid end to end; a size-1
   * dim's stride says nothing (an expand's is 0), so it is skipped, not
   * taken as the step below it */
  bool a_stacks = ta == CblasNoTrans && nba > 0;
  int64_t step = m * lda;
  for (int i = nba - 1; i >= 0 && a_stacks; i--) {
    if (av.shape[i] == 1) continue;
    a_stacks = av.stride[i] == step;
    step *= av.shape[i];
  }
  if (batch > 1 && b_shared && a_stacks && nba == nb) {
    gemm(a->dtype, ta, tb, batch * m, nn, k, pa, lda, pb, ldb, pc, nn);
  } else {
    for (int64_t bi = 0; bi < batch; bi++) {
      int64_t oa = 0, ob = 0, rem = bi;
      for (int i = nb - 1; i >= 0; i--) {
        int64_t idx = rem % bshape[i];
        rem /= bshape[i];
        int ia = i - (nb - nba), ib = i - (nb - nbb);
        if (ia >= 0 && av.shape[ia] > 1) oa += idx * av.stride[ia];
        if (ib >= 0 && bv.shape[ib] > 1) ob += idx * bv.stride[ib];
      }
      gemm(a->dtype, ta, tb, m, nn, k, pa + oa * (int64_t)es, lda, pb + ob * (int64_t)es, ldb,
           pc + bi * m * nn * (int64_t)es, nn);
    }
  }
  kiln_release(ca);
  kiln_release(cb);
  return 0;
}
