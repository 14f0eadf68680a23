/* Reductions: sum, mean, max, min over any set of axes, and argmax over one.
 * The output is viewed with stride 0 along reduced dims and walked with the
 * input in memory order, so a reduction over the inner dim sums contiguous
 * rows (blocked accumulators) and one over an outer dim adds whole rows into
 * the output (vectorized); threads split kept dims, so every output element
 * is reduced in the same order whatever the thread count. */
#include <math.h>
#include <string.h>

#include "eager/iter.h"
#include "eager/pool.h"
#include "eager/vmath.h"

/* Pairwise sum over blocks of at most 512, each block with 16 independent
 * lanes combined pairwise: vectorized, and the error grows with log n as in
 * NumPy rather than with n. The last partial block goes into the lanes too
 * (a row shorter than 16 is summed pairwise, not in order: eight equal
 * values sum exactly). U is the type the adds are done in: T itself for
 * floats, uint64_t for i64, whose sums wrap (two's complement) like its
 * pointwise ops instead of overflowing. */
#define CONTIG_SUM(T, U, NAME)                                   \
  KILN_HOT static T NAME(const T *x, int64_t n) {                \
    if (n > 512) {                                               \
      int64_t h = (n / 2 + 15) & ~(int64_t)15;                   \
      return (T)((U)NAME(x, h) + (U)NAME(x + h, n - h));         \
    }                                                            \
    U acc[16] = {0};                                             \
    int64_t i = 0;                                               \
    for (; i + 16 <= n; i += 16)                                 \
      for (int j = 0; j < 16; j++) acc[j] += (U)x[i + j];        \
    for (int j = 0; i + j < n; j++) acc[j] += (U)x[i + j];       \
    for (int w = 8; w; w >>= 1)                                  \
      for (int j = 0; j < w; j++) acc[j] += acc[j + w];          \
    return (T)acc[0];                                            \
  }
CONTIG_SUM(float, float, csum_f32)
CONTIG_SUM(double, double, csum_f64)
CONTIG_SUM(int64_t, uint64_t, csum_i64)

/* max/min of a row: 32-byte vectors of a plain compare-and-select, two at
 * a time (GCC's vectorizer leaves the NaN-propagating form scalar), NaNs
 * noted on the side; a row that has one is scanned again for its first NaN,
 * the result the NaN-propagating F gives too. 32 bytes, because GCC turns a
 * compare of vectors wider than the clone's registers into one scalar
 * compare per lane: 64-byte vectors made the AVX2 clone's max a scalar loop
 * through the stack, and W2 eager 2.5x slower there. Always inlined: each
 * KILN_HOT caller's clone must compile it for its own instructions (an
 * out-of-line copy, built for the baseline, runs the vectors in pieces). */
#define ALWAYS_INLINE __attribute__((always_inline))
typedef float vf32 __attribute__((vector_size(32)));
typedef double vf64 __attribute__((vector_size(32)));
typedef int64_t vi64 __attribute__((vector_size(32)));
typedef int32_t vi32 __attribute__((vector_size(32)));
#define CONTIG_EXT(T, VT, VI, NAME, F, CMP)                      \
  ALWAYS_INLINE static inline T NAME(const T *x, int64_t n, T init) { \
    if (init != init) return init;                               \
    enum { L = 32 / sizeof(T) };                                 \
    VT a0, a1;                                                   \
    VI bad = {0};                                                \
    for (int j = 0; j < L; j++) a0[j] = a1[j] = init;            \
    int64_t i = 0;                                               \
    for (; i + 2 * L <= n; i += 2 * L) {                         \
      VT v0, v1;                                                 \
      memcpy(&v0, x + i, sizeof v0);                             \
      memcpy(&v1, x + i + L, sizeof v1);                         \
      VI k0 = a0 CMP v0, k1 = a1 CMP v1;                         \
      a0 = (VT)((k0 & (VI)a0) | (~k0 & (VI)v0));                 \
      a1 = (VT)((k1 & (VI)a1) | (~k1 & (VI)v1));                 \
      bad |= (v0 != v0) | (v1 != v1);                            \
    }                                                            \
    VI none = {0};                                               \
    if (memcmp(&bad, &none, sizeof bad))                         \
      for (int64_t k = 0; k < i; k++)                            \
        if (x[k] != x[k]) return x[k];                           \
    T r = init;                                                  \
    for (int j = 0; j < L; j++) r = F(r, a0[j]);                 \
    for (int j = 0; j < L; j++) r = F(r, a1[j]);                 \
    for (; i < n; i++) r = F(r, x[i]);                           \
    return r;                                                    \
  }
CONTIG_EXT(float, vf32, vi32, cmax_f32, MAXNAN, >)
CONTIG_EXT(double, vf64, vi64, cmax_f64, MAXNAN, >)
CONTIG_EXT(int64_t, vi64, vi64, cmax_i64, MAXNAN, >)
CONTIG_EXT(float, vf32, vi32, cmin_f32, MINNAN, <)
CONTIG_EXT(double, vf64, vi64, cmin_f64, MINNAN, <)
CONTIG_EXT(int64_t, vi64, vi64, cmin_i64, MINNAN, <)

#define SUM_LOOP(T, U, SFX)                                                       \
  KILN_HOT static void sum_##SFX(char **p, const int64_t *s, int64_t n, const void *c) {  \
    (void)c;                                                                      \
    T *o = (T *)p[0];                                                             \
    const T *x = (const T *)p[1];                                                 \
    if (s[0] == 0) {                                                              \
      if (s[1] == 1) {                                                            \
        *o = (T)((U)*o + (U)csum_##SFX(x, n));                                    \
      } else {                                                                    \
        U a = 0;                                                                  \
        for (int64_t i = 0; i < n; i++) a += (U)x[i * s[1]];                      \
        *o = (T)((U)*o + a);                                                      \
      }                                                                           \
    } else if (s[0] == 1 && s[1] == 1) {                                          \
      for (int64_t i = 0; i < n; i++) o[i] = (T)((U)o[i] + (U)x[i]);              \
    } else {                                                                      \
      for (int64_t i = 0; i < n; i++) o[i * s[0]] = (T)((U)o[i * s[0]] + (U)x[i * s[1]]); \
    }                                                                             \
  }
SUM_LOOP(float, float, f32)
SUM_LOOP(double, double, f64)
SUM_LOOP(int64_t, uint64_t, i64)

#define EXT_LOOP(T, NAME, CFN, F)                                                 \
  KILN_HOT static void NAME(char **p, const int64_t *s, int64_t n, const void *c) {       \
    (void)c;                                                                      \
    T *o = (T *)p[0];                                                             \
    const T *x = (const T *)p[1];                                                 \
    if (s[0] == 0) {                                                              \
      if (s[1] == 1) {                                                            \
        *o = CFN(x, n, *o);                                                       \
      } else {                                                                    \
        T a = *o;                                                                 \
        for (int64_t i = 0; i < n; i++) a = F(a, x[i * s[1]]);                    \
        *o = a;                                                                   \
      }                                                                           \
    } else if (s[0] == 1 && s[1] == 1) {                                          \
      for (int64_t i = 0; i < n; i++) o[i] = F(o[i], x[i]);                       \
    } else {                                                                      \
      for (int64_t i = 0; i < n; i++) o[i * s[0]] = F(o[i * s[0]], x[i * s[1]]);  \
    }                                                                             \
  }
EXT_LOOP(float, max_f32, cmax_f32, MAXNAN)
EXT_LOOP(double, max_f64, cmax_f64, MAXNAN)
EXT_LOOP(int64_t, max_i64, cmax_i64, MAXNAN)
EXT_LOOP(float, min_f32, cmin_f32, MINNAN)
EXT_LOOP(double, min_f64, cmin_f64, MINNAN)
EXT_LOOP(int64_t, min_i64, cmin_i64, MINNAN)

typedef struct red_job {
  const iter *it;
  iter_inner fn;
  int split;          /* the dim threads divide (a kept dim), or -1 */
  char *partials;     /* full reductions: one slot per block */
  int64_t block;
} red_job;

static void red_split_chunk(void *c, int64_t b, int64_t e) {
  red_job *j = c;
  iter sub = *j->it;
  sub.shape[j->split] = e - b;
  for (int o = 0; o < sub.nop; o++) sub.base[o] += b * sub.stride[o][j->split] * sub.esize[o];
  sub.numel = shape_numel(sub.ndim, sub.shape);
  iter_run_range(&sub, j->fn, NULL, 0, sub.numel);
}

static void red_block_chunk(void *c, int64_t b, int64_t e) {
  red_job *j = c;
  for (int64_t blk = b; blk < e; blk++) {
    iter sub = *j->it;
    sub.base[0] = j->partials + blk * sub.esize[0];
    int64_t lo = blk * j->block, hi = lo + j->block < sub.numel ? lo + j->block : sub.numel;
    iter_run_range(&sub, j->fn, NULL, lo, hi);
  }
}

static void fill_init(kiln_tensor *out, op_id op) {
  double v = 0;
  if (op == OP_MAX) v = out->dtype == KILN_I64 ? (double)INT64_MIN : -INFINITY;
  if (op == OP_MIN) v = out->dtype == KILN_I64 ? (double)INT64_MAX : INFINITY;
  pw_fill(out, v); /* its float-to-i64 conversion saturates to exactly INT64_MIN/MAX */
}

int k_reduce(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)n;
  const kiln_tensor *x = in[0];
  fill_init(out, op);
  if (shape_numel(x->ndim, x->shape) == 0) goto finish;
  /* the output viewed with the input's rank: size 1 and stride 0 on reduced dims */
  kiln_tensor ov = *out;
  ov.ndim = x->ndim;
  int64_t s = 1;
  for (int d = x->ndim - 1; d >= 0; d--) {
    bool red = false;
    for (int j = 0; j < a->naxes; j++) red |= a->axes[j] == d;
    ov.shape[d] = red ? 1 : x->shape[d];
    ov.stride[d] = red ? 0 : s;
    s *= ov.shape[d];
  }
  iter it;
  iter_build(&it, &ov, &x, 1);
  iter_sort_by(&it, 1);
  static const iter_inner loops[3][3] = {
      {sum_f32, sum_f64, sum_i64}, {max_f32, max_f64, max_i64}, {min_f32, min_f64, min_i64}};
  int which = op == OP_MAX ? 1 : op == OP_MIN ? 2 : 0;
  red_job j = {&it, loops[which][x->dtype], -1, NULL, 0};
  for (int d = 0; d < it.ndim && j.split < 0; d++)
    if (it.stride[0][d] != 0 && it.shape[d] > 1) j.split = d;
  if (j.split >= 0) {
    int64_t per = it.numel / it.shape[j.split];
    int64_t grain = per >= PARALLEL_GRAIN ? 1 : PARALLEL_GRAIN / (per ? per : 1);
    pool_parallel_for(it.shape[j.split], grain, red_split_chunk, &j);
  } else {
    /* every dim reduced: fixed-size blocks (independent of thread count), combined in order */
    j.block = 1 << 16;
    int64_t nblk = (it.numel + j.block - 1) / j.block;
    /* up to 16 blocks (a million elements) the partials lie on the stack: a
     * sum in a loop's step makes no storage (interp.c's region runs) */
    struct {
      kiln_tensor t;
      storage st;
    } sp;
    double few[16];
    kiln_tensor *part = &sp.t;
    if (nblk <= 16) {
      memset(&sp, 0, sizeof sp);
      sp.st.data = few;
      atomic_init(&sp.st.refcount, 1 << 30);
      atomic_init(&sp.t.refs, 1u << 30);
      sp.t.st = &sp.st, sp.t.dtype = out->dtype, sp.t.ndim = 1, sp.t.shape[0] = nblk, sp.t.stride[0] = 1;
    } else if (!(part = tensor_new(out->dtype, 1, &nblk))) {
      return -1;
    }
    fill_init(part, op);
    j.partials = tensor_data(part);
    pool_parallel_for(nblk, 1, red_block_chunk, &j);
    iter pit;
    kiln_tensor *pp = part;
    iter_build(&pit, out, (const kiln_tensor *const *)&pp, 1);
    /* out has one element, so it gets stride 0 over the partials */
    iter_run_range(&pit, j.fn, NULL, 0, nblk);
    if (part != &sp.t) kiln_release(part);
  }
finish:
  if (op == OP_MEAN) {
    int64_t cnt = 1;
    for (int k = 0; k < a->naxes; k++) cnt *= x->shape[a->axes[k]];
    int64_t no = shape_numel(out->ndim, out->shape);
    if (out->dtype == KILN_F32) {
      float *o = tensor_data(out);
      for (int64_t i = 0; i < no; i++) o[i] = (float)((double)o[i] / (double)cnt);
    } else {
      double *o = tensor_data(out);
      for (int64_t i = 0; i < no; i++) o[i] = o[i] / (double)cnt;
    }
  }
  return 0;
}

/* ---- argmax (argmin) over one axis: the first index of the largest (smallest) value; NaN wins ---- */

typedef struct argmax_job {
  const kiln_tensor *x;
  kiln_tensor *out;
  int axis;
  bool min; /* argmin */
} argmax_job;

static void argmax_chunk(void *c, int64_t b, int64_t e) {
  argmax_job *j = c;
  const kiln_tensor *x = j->x;
  int64_t len = x->shape[j->axis], st = x->stride[j->axis];
  int64_t *o = tensor_data(j->out);
  for (int64_t r = b; r < e; r++) {
    /* offset of row r: decompose r over the dims other than axis */
    int64_t off = x->offset, rem = r;
    for (int d = x->ndim - 1; d >= 0; d--) {
      if (d == j->axis) continue;
      off += (rem % x->shape[d]) * x->stride[d];
      rem /= x->shape[d];
    }
    int64_t best = 0;
    /* a before b: better for argmax, or for argmin */
#define BETTER(a, b) (j->min ? (a) < (b) : (a) > (b))
    if (x->dtype == KILN_I64) {
      const int64_t *p = (const int64_t *)x->st->data + off;
      for (int64_t i = 1; i < len; i++)
        if (BETTER(p[i * st], p[best * st])) best = i;
    } else if (x->dtype == KILN_F32) {
      const float *p = (const float *)x->st->data + off;
      for (int64_t i = 1; i < len && p[best * st] == p[best * st]; i++)
        if (BETTER(p[i * st], p[best * st]) || p[i * st] != p[i * st]) best = i;
    } else {
      const double *p = (const double *)x->st->data + off;
      for (int64_t i = 1; i < len && p[best * st] == p[best * st]; i++)
        if (BETTER(p[i * st], p[best * st]) || p[i * st] != p[i * st]) best = i;
    }
#undef BETTER
    o[r] = best;
  }
}

int k_argmax(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)n;
  const kiln_tensor *x = in[0];
  argmax_job j = {x, out, x->ndim ? a->axes[0] : 0, op == OP_ARGMIN};
  if (x->ndim == 0) {
    *(int64_t *)tensor_data(out) = 0;
    return 0;
  }
  int64_t rows = shape_numel(out->ndim, out->shape);
  int64_t len = x->shape[j.axis] ? x->shape[j.axis] : 1;
  pool_parallel_for(rows, PARALLEL_GRAIN / len + 1, argmax_chunk, &j);
  return 0;
}

/* ---- softmax and log_softmax along contiguous rows, in one kernel ---- */

/* The same steps as the composites of nn.c, element by element (the row's
 * max, x - max, exp, the pairwise sum, the divide or log and subtract), so
 * the results are bit for bit theirs; but a row is read from memory once and
 * the result written once, where the composite makes four full-size passes
 * and three intermediates. */
typedef struct softmax_job {
  const void *x;
  void *out;
  int64_t cols;
  bool log, f64;
} softmax_job;

#define SOFTMAX_ROWS(T, SFX, EXP, LOG)                                            \
  KILN_HOT static void softmax_rows_##SFX(const softmax_job *j, int64_t b, int64_t e) { \
    for (int64_t r = b; r < e; r++) {                                             \
      const T *x = (const T *)j->x + r * j->cols;                                 \
      T *y = (T *)j->out + r * j->cols, m = cmax_##SFX(x, j->cols, -INFINITY);    \
      for (int64_t i = 0; i < j->cols; i++) y[i] = EXP(x[i] - m);                 \
      T s = csum_##SFX(y, j->cols);                                               \
      if (j->log) {                                                               \
        T lse = LOG(s);                                                           \
        for (int64_t i = 0; i < j->cols; i++) y[i] = (x[i] - m) - lse;            \
      } else {                                                                    \
        for (int64_t i = 0; i < j->cols; i++) y[i] = y[i] / s;                    \
      }                                                                           \
    }                                                                             \
  }
SOFTMAX_ROWS(float, f32, vm_expf, vm_logf)
SOFTMAX_ROWS(double, f64, exp, log)

static void softmax_chunk(void *c, int64_t b, int64_t e) {
  const softmax_job *j = c;
  if (j->f64) softmax_rows_f64(j, b, e);
  else softmax_rows_f32(j, b, e);
}

void red_softmax_rows(const kiln_tensor *x, kiln_tensor *out, bool log) {
  int64_t cols = x->shape[x->ndim - 1], rows = shape_numel(x->ndim, x->shape) / (cols ? cols : 1);
  softmax_job j = {tensor_data(x), tensor_data(out), cols, log, x->dtype == KILN_F64};
  if (!cols) return;
  pool_parallel_for(rows, cols >= PARALLEL_GRAIN ? 1 : PARALLEL_GRAIN / cols, softmax_chunk, &j);
}
