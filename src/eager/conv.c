/* The kernels of conv2d and its two gradients, over NCHW tensors.
 *
 * A convolution is a GEMM per group: with K = C/groups * kh * kw and P the
 * output positions of an image, y[n, group] (O/groups, P) = w[group]
 * (O/groups, K) @ columns (K, P), where the columns (im2col) hold, for each
 * (channel, i, j) of the window, the input element each output position
 * reads there. A 1x1 convolution of stride 1 without padding needs no
 * columns: the input plane is the matrix. Images with few output positions
 * (the late layers of a ResNet) go through the GEMM several at a time, as
 * columns side by side, so that OpenBLAS gets a matrix wide enough to run
 * well; the product is then scattered back to NCHW. Groups too thin for a
 * GEMM (depthwise) run as direct loops over the planes, split across the
 * thread pool. The gradients are the same GEMMs transposed: the weight's is
 * gy @ columns^T summed over the images, the input's is w^T @ gy, added back
 * through the windows (col2im). im2col and col2im run over the thread pool;
 * OpenBLAS threads each GEMM with the pool's thread count. */
#include <stdlib.h>
#include <string.h>

#include "eager/eager.h"
#include "eager/gemm.h"
#include "eager/pool.h"

typedef struct conv_geom {
  int64_t n, c, h, w;    /* input (N,C,H,W) */
  int64_t o, cg, kh, kw; /* weight (O, C/groups, kh, kw) */
  int64_t ho, wo;        /* output positions */
  int64_t sh, sw, ph, pw, dh, dw, groups;
  int64_t og, k, p;      /* O/groups; a column's length cg*kh*kw; ho*wo */
} conv_geom;

/* What a pool chunk works on. */
typedef struct conv_job {
  const conv_geom *q;
  const void *x, *w; /* the operands: input or gradient, weight or input */
  void *out, *col;
  int64_t n0, nb, g;
} conv_job;

/* Output columns [lo, hi) whose input column ow*stride - pad + off is inside [0, in_n). */
static void out_range(int64_t out_n, int64_t in_n, int64_t stride, int64_t pad, int64_t off, int64_t *lo, int64_t *hi) {
  int64_t first = pad - off, last = in_n - 1 + pad - off; /* ow*stride must lie in [first, last] */
  *lo = first > 0 ? (first + stride - 1) / stride : 0;
  *hi = last < 0 ? 0 : last / stride + 1;
  if (*hi > out_n) *hi = out_n;
  if (*lo > *hi) *lo = *hi;
}

/* Items per pool chunk for work of `per` elements an item: about 16K elements. */
static int64_t grain_for(int64_t per) { return per >= 16384 ? 1 : 16384 / (per > 0 ? per : 1); }

/* A group this thin is a poor GEMM: the direct loops run instead. */
static bool use_direct(const conv_geom *q) { return q->og < 4 || q->k < 4; }

/* A 1x1 window of stride 1 without padding: the input planes are the columns. */
static bool is_plain(const conv_geom *q) {
  return q->kh == 1 && q->kw == 1 && q->sh == 1 && q->sw == 1 && q->ph == 0 && q->pw == 0;
}

/* Images per GEMM: enough that it is at least 1024 columns wide. */
static int64_t chunk_images(const conv_geom *q) {
  int64_t nb = q->p >= 1024 ? 1 : 1024 / (q->p > 0 ? q->p : 1);
  return nb < 1 ? 1 : nb > q->n ? (q->n > 0 ? q->n : 1) : nb;
}

/* Working memory of the GEMM path: the columns (k rows of nb*p, none when
 * the input planes are the columns), then at a 64-byte boundary the product
 * of the images that share a GEMM (og rows of nb*p, when nb > 1). */
static size_t col_bytes(const conv_geom *q, size_t es) {
  int64_t nb = chunk_images(q);
  return use_direct(q) || (is_plain(q) && nb == 1) ? 0 : ((size_t)(q->k * nb * q->p) * es + 63) / 64 * 64;
}
static size_t scratch_bytes(const conv_geom *q, size_t es) {
  int64_t nb = chunk_images(q);
  return col_bytes(q, es) + (use_direct(q) || nb == 1 ? 0 : (size_t)(q->og * nb * q->p) * es);
}

/* Points *col and *tmp into scratch, or into memory of its own when scratch
 * is NULL (returned, for the caller to free; NULL when none was needed or it
 * could not be had: scratch_bytes tells which). */
static void *working_memory(const conv_geom *q, void *scratch, size_t es, void **col, void **tmp) {
  size_t cb = col_bytes(q, es), all = scratch_bytes(q, es);
  void *own = NULL, *base = scratch;
  if (!base && all) base = own = alloc_malloc(all);
  *col = base && cb ? base : NULL;
  *tmp = base && all > cb ? (char *)base + cb : NULL;
  return own;
}

/* tmp (og, nb*p) -> y[n0 + b, g*og + o, :] for the nb images of a GEMM. */
static void rows_out(const conv_geom *q, const void *tmp, void *y, int64_t n0, int64_t nb, int64_t g, size_t es) {
  for (int64_t b = 0; b < nb; b++)
    for (int64_t o = 0; o < q->og; o++)
      memcpy((char *)y + (((n0 + b) * q->o + g * q->og + o) * q->p) * (int64_t)es,
             (const char *)tmp + (o * nb * q->p + b * q->p) * (int64_t)es, es * (size_t)q->p);
}

/* gy[n0 + b, g*og + o, :] -> tmp (og, nb*p): the reverse of rows_out. */
static void rows_in(const conv_geom *q, const void *gy, void *tmp, int64_t n0, int64_t nb, int64_t g, size_t es) {
  for (int64_t b = 0; b < nb; b++)
    for (int64_t o = 0; o < q->og; o++)
      memcpy((char *)tmp + (o * nb * q->p + b * q->p) * (int64_t)es,
             (const char *)gy + (((n0 + b) * q->o + g * q->og + o) * q->p) * (int64_t)es, es * (size_t)q->p);
}

/* cblas_sgemm's signature (conv_impl.h's GEMM) over gemm_sgemm; the order is always row-major */
static void conv_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, float alpha,
                       const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  (void)order;
  gemm_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

#define T float
#define F(name) name##_f32
#define GEMM conv_sgemm
#include "eager/conv_impl.h"
#undef T
#undef F
#undef GEMM
#define T double
#define F(name) name##_f64
#define GEMM cblas_dgemm
#include "eager/conv_impl.h"
#undef T
#undef F
#undef GEMM

enum { FWD, GRAD_INPUT, GRAD_WEIGHT };

/* ---- which algorithm ---- */

enum { ALGO_AUTO, ALGO_GEMM, ALGO_WINOGRAD };

/* KILN_CONV=gemm or winograd forces one algorithm wherever it applies;
 * anything else (or unset) chooses by shape. Read once. */
static int conv_algo(void) {
  static _Atomic int algo = -1;
  int a = atomic_load_explicit(&algo, memory_order_relaxed);
  if (a < 0) {
    const char *env = getenv("KILN_CONV");
    a = env && !strcmp(env, "gemm") ? ALGO_GEMM : env && !strcmp(env, "winograd") ? ALGO_WINOGRAD : ALGO_AUTO;
    atomic_store_explicit(&algo, a, memory_order_relaxed);
  }
  return a;
}

/* Winograd's GEMMs are 2.25x smaller than im2col's, and its transforms
 * cost per input and output element: it pays with channels enough that
 * the GEMMs dominate and tiles enough to fill them. Measured: docs/perf.md. */
static bool winograd_pays(const wino_geom *wg) {
  return wg->c >= 16 && wg->o >= 16 && wg->n * ((wg->ho + 1) / 2) * ((wg->wo + 1) / 2) >= 64;
}

/* Whether op `which` on q (elements es bytes) runs as Winograd, and if so
 * its geometry in *wg: the forward and both gradients of f32 3x3
 * convolutions of stride 1, dilation 1 and one group (the input gradient's
 * padding 2 - p must not be negative), where they pay (see docs/perf.md)
 * and kiln's GEMM runs. The weight gradient's geometry is the forward's. */
static bool winograd_of(int which, const conv_geom *q, size_t es, wino_geom *wg) {
  if (es != sizeof(float) || q->kh != 3 || q->kw != 3 || q->sh != 1 || q->sw != 1 || q->dh != 1 || q->dw != 1 ||
      q->groups != 1)
    return false;
  if (which == FWD || which == GRAD_WEIGHT)
    *wg = (wino_geom){.n = q->n, .c = q->c, .h = q->h, .w = q->w, .o = q->o, .ph = q->ph, .pw = q->pw,
                      .ho = q->ho, .wo = q->wo};
  else if (q->ph <= 2 && q->pw <= 2)
    *wg = (wino_geom){.n = q->n, .c = q->o, .h = q->ho, .w = q->wo, .o = q->c, .ph = 2 - q->ph, .pw = 2 - q->pw,
                      .ho = q->h, .wo = q->w, .flip = true};
  else
    return false;
  int algo = conv_algo();
  if (algo != ALGO_AUTO) return algo == ALGO_WINOGRAD;
  /* its bits depend on no thread count only on kiln's GEMM (OpenBLAS's
   * results vary with the blocks' widths, which follow the thread count) */
  return strcmp(gemm_kernel_name(), "blas") != 0 && winograd_pays(wg);
}

/* The geometry of conv2d(x, w) with attrs.ints (the shape rule checked them). */
static conv_geom geom_of(const kiln_tensor *x, const kiln_tensor *w, const op_attrs *a) {
  conv_geom q = {.n = x->shape[0], .c = x->shape[1], .h = x->shape[2], .w = x->shape[3],
                 .o = w->shape[0], .cg = w->shape[1], .kh = w->shape[2], .kw = w->shape[3],
                 .sh = a->ints[0], .sw = a->ints[1], .ph = a->ints[2], .pw = a->ints[3],
                 .dh = a->ints[4], .dw = a->ints[5], .groups = a->ints[6]};
  q.ho = (q.h + 2 * q.ph - q.dh * (q.kh - 1) - 1) / q.sh + 1;
  q.wo = (q.w + 2 * q.pw - q.dw * (q.kw - 1) - 1) / q.sw + 1;
  q.og = q.o / q.groups;
  q.k = q.cg * q.kh * q.kw;
  q.p = q.ho * q.wo;
  return q;
}

/* t itself when contiguous, else a contiguous copy in *own (NULL when out of memory). */
static const kiln_tensor *dense(const kiln_tensor *t, kiln_tensor **own) {
  *own = NULL;
  if (tensor_contiguous(t)) return t;
  *own = tensor_new(t->dtype, t->ndim, t->shape);
  if (*own) pw_copy(*own, t);
  return *own;
}

/* One of the three ops: a and b are (x, w), (gy, w) or (gy, x), and x and w
 * give the geometry. Writes out through a contiguous temporary when out
 * itself is not. scratch: conv_scratch_bytes of working memory, or NULL. */
static int conv_run(int which, const kiln_tensor *a, const kiln_tensor *b, const kiln_tensor *x, const kiln_tensor *w,
                    const op_attrs *at, kiln_tensor *out, const void *prep, void *scratch, size_t bytes) {
  conv_geom q = geom_of(x, w, at);
  wino_geom wg;
  bool wino = winograd_of(which, &q, kiln_dtype_size(out->dtype), &wg);
  if (q.k > INT32_MAX || q.og > INT32_MAX || q.n * q.p > INT32_MAX || q.c * q.h * q.w > INT32_MAX) return -1;
  if (prep && (!wino || which != FWD)) return -1;
  kiln_tensor *oa, *ob = NULL, *oo = NULL;
  const kiln_tensor *da = dense(a, &oa), *db = prep ? b : dense(b, &ob); /* prep: w is not read */
  kiln_tensor *dst = out;
  if (!tensor_contiguous(out)) dst = oo = tensor_new(out->dtype, out->ndim, out->shape);
  int rc = -1;
  if (da && db && dst) {
    const void *pa = tensor_data(da), *pb = tensor_data(db);
    void *po = tensor_data(dst);
    if (prep)
      rc = wino_conv_prepared_f32(&wg, pa, prep, po, scratch, bytes);
    else if (wino && which == GRAD_WEIGHT)
      rc = wino_grad_weight_f32(&wg, pb, pa, po, scratch, bytes);
    else if (wino)
      rc = wino_conv_f32(&wg, pa, pb, po, scratch, bytes);
    else if (out->dtype == KILN_F32)
      rc = which == FWD ? conv_forward_f32(&q, pa, pb, po, scratch)
           : which == GRAD_INPUT ? conv_grad_input_f32(&q, pa, pb, po, scratch)
                                 : conv_grad_weight_f32(&q, pa, pb, po, scratch);
    else
      rc = which == FWD ? conv_forward_f64(&q, pa, pb, po, scratch)
           : which == GRAD_INPUT ? conv_grad_input_f64(&q, pa, pb, po, scratch)
                                 : conv_grad_weight_f64(&q, pa, pb, po, scratch);
    if (rc == 0 && oo) pw_copy(out, oo);
  }
  kiln_release(oa);
  kiln_release(ob);
  kiln_release(oo);
  return rc;
}

/* The operands of op in the order of the geometry: (x, w). */
static void geometry_operands(op_id op, kiln_tensor *const *in, const kiln_tensor **x, const kiln_tensor **w) {
  *x = op == OP_CONV2D_GRAD_INPUT ? in[2] : op == OP_CONV2D_GRAD_WEIGHT ? in[1] : in[0];
  *w = op == OP_CONV2D_GRAD_WEIGHT ? in[2] : in[1];
}

static int op_which(op_id op) { return op == OP_CONV2D ? FWD : op == OP_CONV2D_GRAD_INPUT ? GRAD_INPUT : GRAD_WEIGHT; }

size_t conv_scratch_bytes(op_id op, kiln_tensor *const *in, const op_attrs *a) {
  if (op != OP_CONV2D && op != OP_CONV2D_GRAD_INPUT && op != OP_CONV2D_GRAD_WEIGHT) return 0;
  const kiln_tensor *x, *w;
  geometry_operands(op, in, &x, &w);
  conv_geom q = geom_of(x, w, a);
  size_t es = kiln_dtype_size(in[0]->dtype);
  wino_geom wg;
  if (winograd_of(op_which(op), &q, es, &wg))
    return op == OP_CONV2D_GRAD_WEIGHT ? wino_grad_weight_scratch_bytes(&wg) : wino_scratch_bytes(&wg);
  return scratch_bytes(&q, es);
}

int conv_kernel(op_id op, kiln_tensor *const *in, const op_attrs *a, kiln_tensor *out, void *scratch, size_t bytes) {
  const kiln_tensor *x, *w;
  geometry_operands(op, in, &x, &w);
  return conv_run(op_which(op), in[0], in[1], x, w, a, out, NULL, scratch, bytes);
}

/* ---- a weight prepared once, for compiled inference ----
 *
 * A compiled graph calls the same kernels with the same weights again and
 * again: where a forward conv runs as Winograd, it may keep the weight's
 * transform U (16/9 of the weight's size) from one call to the next and
 * skip that transform, redoing it only when the weight changes (runtime.c
 * keys it on the weight's storage, serial and version). U is computed by
 * the same code as in a plain call, so the results are the same bits. */

/* The Winograd geometry of conv2d(in[0], in[1]) where its forward runs as Winograd in f32. */
static bool prepared_geom(op_id op, kiln_tensor *const *in, const op_attrs *a, wino_geom *wg) {
  if (op != OP_CONV2D || in[0]->dtype != KILN_F32 || in[1]->dtype != KILN_F32) return false;
  conv_geom q = geom_of(in[0], in[1], a);
  return winograd_of(FWD, &q, sizeof(float), wg);
}

size_t conv_prepared_bytes(op_id op, kiln_tensor *const *in, const op_attrs *a) {
  wino_geom wg;
  return prepared_geom(op, in, a, &wg) ? wino_weight_bytes(&wg) : 0;
}

size_t conv_prepared_scratch_bytes(op_id op, kiln_tensor *const *in, const op_attrs *a) {
  wino_geom wg;
  return prepared_geom(op, in, a, &wg) ? wino_prepared_scratch_bytes(&wg) : conv_scratch_bytes(op, in, a);
}

int conv_prepare_weight(op_id op, kiln_tensor *const *in, const op_attrs *a, void *prep) {
  wino_geom wg;
  if (!prepared_geom(op, in, a, &wg)) return -1;
  kiln_tensor *ow;
  const kiln_tensor *dw = dense(in[1], &ow);
  if (!dw) return -1;
  wino_weight_prepare(&wg, tensor_data(dw), prep);
  kiln_release(ow);
  return 0;
}

int conv_kernel_prepared(op_id op, kiln_tensor *const *in, const op_attrs *a, kiln_tensor *out, const void *prep,
                         void *scratch, size_t bytes) {
  if (op != OP_CONV2D || !prep) return -1;
  return conv_run(FWD, in[0], in[1], in[0], in[1], a, out, prep, scratch, bytes);
}

int k_conv2d(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)n;
  return conv_kernel(op, in, a, out, NULL, 0);
}

/* in: gy, w, x (x for its shape) */
int k_conv2d_grad_input(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)n;
  return conv_kernel(op, in, a, out, NULL, 0);
}

/* in: gy, x, w (w for its shape) */
int k_conv2d_grad_weight(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)n;
  return conv_kernel(op, in, a, out, NULL, 0);
}
