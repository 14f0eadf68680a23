/* matmul through OpenBLAS: 1-D, 2-D and batched with broadcast batch dims.
 * A transposed view goes to BLAS as a transpose flag, never as a copy; only
 * layouts BLAS cannot take (neither dim unit-stride) are copied first. A
 * batch whose matrices stack into one (x @ w with x (B,M,K) contiguous) runs
 * as one GEMM. */
#include <cblas.h>
#include <string.h>

#include "eager/eager.h"

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

static void gemm(kiln_dtype dt, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k,
                 const void *a, int64_t lda, const void *b, int64_t ldb, void *c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    memset(c, 0, (size_t)(m * n) * kiln_dtype_size(dt)); /* c is contiguous (m, n) here */
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
      cblas_sgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, 1.0f, a, (int)lda, b, (int)ldb, 0.0f, c, (int)ldc);
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
  bool a_stacks = ta == CblasNoTrans && nba > 0;
  for (int i = 0; i < nba && a_stacks; i++)
    a_stacks = av.shape[i] == 1 || av.stride[i] == av.shape[i + 1] * (i + 1 < nba ? av.stride[i + 1] : lda);
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
