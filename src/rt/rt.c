/* The runtime of exported models (libkiln_rt): binds the symbols from the
 * inputs' shapes, checks them against the exported variant's guards, sizes
 * the buffers, places the intermediates in an arena kept between calls, runs
 * the kernels in order (loops on the thread pool, matmuls through BLAS) and
 * hands out the outputs. It reads the plan codegen/export.c wrote
 * (rt/plan.h) and depends on nothing of kiln but the pool: no LLVM, no
 * tensors. Every failure is a message in kiln_rt_error and -1. */
#ifdef KILN_RT_NO_BLAS
/* Built without OpenBLAS (a cross build where the target's is not at hand):
 * the matmuls run gemm_loops below. The numbers differ from BLAS's only by
 * the order of the sums. */
typedef enum { CblasNoTrans = 111, CblasTrans = 112 } CBLAS_TRANSPOSE;
#else
#include <cblas.h>
#endif
#include <inttypes.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eager/pool.h"
#ifndef KILN_RT_NO_BLAS
#include "eager/gemm.h"
#endif
#include "kiln_rt.h"
#include "rt/plan.h"

static _Thread_local char last_error[512];

#ifdef KILN_RT_TEST_COUNTS
/* Built so by tests/test_export.c only: region outputs copied out of a run. */
atomic_long kiln_rt_test_copies;
#define COUNT_COPY() atomic_fetch_add(&kiln_rt_test_copies, 1)
#else
#define COUNT_COPY() ((void)0)
#endif

const char *kiln_rt_error(void) { return last_error; }
void kiln_rt_set_num_threads(int n) { pool_set_num_threads(n); }
int kiln_rt_plan_version(void) { return RT_PLAN_VERSION; }

struct frame;
struct cfstate;

/* One call: the model, its plan, what the call has bound so far, and per
 * unit (the top graph and each region) and per control-flow kernel what
 * the call keeps between a loop's steps. */
typedef struct run {
  const kiln_rt_model *m;
  const int64_t *plan;
  int64_t words;
  const char *name;
  int64_t vals[RT_MAX_SYMS];
  int n_syms;
  struct frame *units;
  int n_units;
  struct cfstate *cfs;
  int n_cf;
} run;

__attribute__((format(printf, 2, 3))) static int fail(const run *r, const char *fmt, ...) {
  int n = snprintf(last_error, sizeof last_error, "%s_run: ", r->name);
  va_list ap;
  va_start(ap, fmt);
  if (n > 0 && (size_t)n < sizeof last_error) vsnprintf(last_error + n, sizeof last_error - (size_t)n, fmt, ap);
  va_end(ap);
  return -1;
}

static size_t dtype_size(int64_t dt) { return dt == 0 ? 4 : dt == 3 ? 1 : 8; } /* kiln_dtype: F32 F64 I64 BOOL */
static const char *dtype_name(int64_t dt) { return dt == 0 ? "f32" : dt == 1 ? "f64" : dt == 2 ? "i64" : "bool"; }

static int64_t floordiv(int64_t a, int64_t b) { return a / b - (a % b != 0 && (a < 0) != (b < 0)); }

/* The size code at word at, for the call's symbols: 0, or -1 on overflow,
 * a divisor < 1 or a code that is not one. */
static int eval(const run *r, int64_t at, int64_t *out) {
  int64_t st[64];
  int sp = 0;
  for (int64_t pc = at; pc >= 0 && pc < r->words;) {
    int64_t op = r->plan[pc++], x, y;
    switch (op) {
    case RT_C_END:
      if (sp != 1) return -1;
      *out = st[0];
      return 0;
    case RT_C_CONST:
    case RT_C_SYM:
      if (pc >= r->words || sp == 64) return -1;
      x = r->plan[pc++];
      if (op == RT_C_SYM && (x < 0 || x >= r->n_syms)) return -1;
      st[sp++] = op == RT_C_CONST ? x : r->vals[x];
      break;
    case RT_C_ADD: case RT_C_MUL: case RT_C_FLOOR: case RT_C_MOD:
      if (sp < 2) return -1;
      y = st[--sp], x = st[sp - 1];
      if (op == RT_C_ADD) {
        if (__builtin_add_overflow(x, y, &st[sp - 1])) return -1;
      } else if (op == RT_C_MUL) {
        if (__builtin_mul_overflow(x, y, &st[sp - 1])) return -1;
      } else {
        if (y < 1) return -1;
        int64_t q = floordiv(x, y);
        st[sp - 1] = op == RT_C_FLOOR ? q : x - q * y;
      }
      break;
    default:
      return -1;
    }
  }
  return -1;
}

/* A view's sizes, strides (elements) and offset, evaluated. */
typedef struct view {
  int64_t buf, off, ndim, shape[RT_MAXD], stride[RT_MAXD];
} view;

static int eval_view(const run *r, int64_t at, view *v) {
  const int64_t *w = r->plan + at;
  v->buf = w[0];
  v->ndim = w[2];
  if (v->ndim < 0 || v->ndim > RT_MAXD || eval(r, w[1], &v->off)) return -1;
  for (int d = 0; d < v->ndim; d++)
    if (eval(r, w[3 + d], &v->shape[d]) || eval(r, w[3 + RT_MAXD + d], &v->stride[d])) return -1;
  return 0;
}

/* Are v's elements in row-major order, one after another? */
static bool dense(const view *v) {
  int64_t s = 1;
  for (int d = (int)v->ndim - 1; d >= 0; s *= v->shape[d], d--)
    if (v->shape[d] > 1 && v->stride[d] != s) return false;
  return true;
}

/* Copies the strided elements of v (from base) to dst, row-major. */
static void copy_out(char *dst, const char *base, const view *v, size_t es) {
  int64_t n = 1, idx[RT_MAXD] = {0};
  for (int d = 0; d < v->ndim; d++) n *= v->shape[d];
  if (n > 0 && dense(v)) {
    if (dst != base + v->off * (int64_t)es) memmove(dst, base + v->off * (int64_t)es, (size_t)n * es);
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    int64_t o = v->off;
    for (int d = 0; d < v->ndim; d++) o += idx[d] * v->stride[d];
    memcpy(dst + (size_t)i * es, base + o * (int64_t)es, es);
    for (int d = (int)v->ndim - 1; d >= 0 && ++idx[d] == v->shape[d]; d--) idx[d] = 0;
  }
}

/* A matrix of rows x cols with strides (rs, cs) as BLAS sees it (eager's cblas_layout). */
static int blas_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, CBLAS_TRANSPOSE *tr, int64_t *ld) {
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

#ifdef KILN_RT_NO_BLAS
/* C = alpha * op(A) @ op(B) + beta * C, row-major, as cblas_sgemm/dgemm. */
#define GEMM_LOOPS(name, T)                                                                                          \
  static void name(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, double alpha,           \
                   const T *a, int64_t lda, const T *b, int64_t ldb, double beta, T *c, int64_t ldc) {              \
    for (int64_t i = 0; i < m; i++) {                                                                                \
      T *row = c + i * ldc;                                                                                          \
      for (int64_t j = 0; j < n; j++) row[j] = beta == 0 ? (T)0 : (T)(beta * row[j]);                                 \
      for (int64_t p = 0; p < k; p++) {                                                                              \
        T x = (T)(alpha * (ta == CblasNoTrans ? a[i * lda + p] : a[p * lda + i]));                                   \
        if (tb == CblasNoTrans)                                                                                      \
          for (int64_t j = 0; j < n; j++) row[j] += x * b[p * ldb + j];                                              \
        else                                                                                                         \
          for (int64_t j = 0; j < n; j++) row[j] += x * b[j * ldb + p];                                              \
      }                                                                                                              \
    }                                                                                                                \
  }
GEMM_LOOPS(gemm_f32, float)
GEMM_LOOPS(gemm_f64, double)
#endif

/* One operand of a matmul as a batch of matrices: batch dims, then rows and cols. */
typedef struct mat {
  int nb;
  int64_t bshape[RT_MAXD], bstride[RT_MAXD];
  int64_t rows, cols, rs, cs, off;
} mat;

static void as_mat(const view *v, bool vec_is_row, mat *m) {
  m->off = v->off;
  if (v->ndim == 1) {
    m->nb = 0;
    if (vec_is_row) m->rows = 1, m->cols = v->shape[0], m->rs = 0, m->cs = v->stride[0];
    else m->rows = v->shape[0], m->cols = 1, m->rs = v->stride[0], m->cs = 0;
    return;
  }
  m->nb = (int)v->ndim - 2;
  for (int d = 0; d < m->nb; d++) m->bshape[d] = v->shape[d], m->bstride[d] = v->stride[d];
  m->rows = v->shape[v->ndim - 2], m->cols = v->shape[v->ndim - 1];
  m->rs = v->stride[v->ndim - 2], m->cs = v->stride[v->ndim - 1];
}

/* The element offset of batch index idx (of the output's nb dims) in m, broadcasting. */
static int64_t batch_off(const mat *m, const int64_t *idx, int nb) {
  int64_t o = m->off;
  for (int d = 0; d < m->nb; d++) {
    int od = nb - m->nb + d;
    if (m->bshape[d] != 1) o += idx[od] * m->bstride[d];
  }
  return o;
}

/* out = alpha * a @ b + beta * out over the batch dims, as eager's matmul
 * (1-D operands as a row or a column). */
static int matmul(const run *r, const int64_t *k, char **bufs) {
  int64_t dt = k[1];
  double alpha, beta;
  memcpy(&alpha, &k[2], sizeof alpha);
  memcpy(&beta, &k[3], sizeof beta);
  view va, vb, vo;
  int64_t base = k - r->plan + 4;
  if (eval_view(r, base, &va) || eval_view(r, base + VIEW_WORDS, &vb) || eval_view(r, base + 2 * VIEW_WORDS, &vo))
    return fail(r, "a matmul's sizes do not evaluate");
  mat a, b;
  as_mat(&va, true, &a);
  as_mat(&vb, false, &b);
  int64_t m = a.rows, kk = a.cols, n = b.cols;
  int nb = (int)vo.ndim - (va.ndim > 1) - (vb.ndim > 1);
  if (nb < 0) nb = 0;
  int64_t os_m = va.ndim > 1 && vo.ndim >= 1 + (vb.ndim > 1) ? vo.stride[vo.ndim - 1 - (vb.ndim > 1)] : 0;
  int64_t os_n = vb.ndim > 1 ? vo.stride[vo.ndim - 1] : 1;
  if (m <= 1) os_m = n;
  if (n <= 1) os_n = 1;
  CBLAS_TRANSPOSE ta, tb;
  int64_t lda, ldb;
  if (os_n != 1 || os_m < n || blas_layout(m, kk, a.rs, a.cs, &ta, &lda) || blas_layout(kk, n, b.rs, b.cs, &tb, &ldb))
    return fail(r, "a matmul's operands have a layout BLAS does not take");
  int64_t count = 1, idx[RT_MAXD] = {0};
  for (int d = 0; d < nb; d++) count *= vo.shape[d];
  size_t es = dtype_size(dt);
  for (int64_t i = 0; i < count && m > 0 && n > 0; i++) {
    int64_t oo = vo.off;
    for (int d = 0; d < nb; d++) oo += idx[d] * vo.stride[d];
    char *pa = bufs[va.buf] + batch_off(&a, idx, nb) * (int64_t)es, *pb = bufs[vb.buf] + batch_off(&b, idx, nb) * (int64_t)es;
    char *pc = bufs[vo.buf] + oo * (int64_t)es;
    if (kk == 0) {
      /* no products: the sum is empty */
      for (int64_t x = 0; x < m; x++)
        for (int64_t y = 0; y < n; y++) {
          if (dt == 0) ((float *)pc)[x * os_m + y] *= (float)beta;
          else ((double *)pc)[x * os_m + y] *= beta;
        }
#ifdef KILN_RT_NO_BLAS
    } else if (dt == 0) {
      gemm_f32(ta, tb, m, n, kk, alpha, (const float *)pa, lda, (const float *)pb, ldb, beta, (float *)pc, os_m);
    } else {
      gemm_f64(ta, tb, m, n, kk, alpha, (const double *)pa, lda, (const double *)pb, ldb, beta, (double *)pc, os_m);
    }
#else
    } else if (dt == 0) {
      /* the JIT's GEMM (kiln's where it runs, OpenBLAS else), so the kernels are the JIT's */
      gemm_sgemm(ta, tb, m, n, kk, (float)alpha, (const float *)pa, lda, (const float *)pb, ldb, (float)beta,
                 (float *)pc, os_m);
    } else {
      cblas_dgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)kk, alpha, (const double *)pa, (int)lda,
                  (const double *)pb, (int)ldb, beta, (double *)pc, (int)os_m);
    }
#endif
    for (int d = nb - 1; d >= 0 && ++idx[d] == vo.shape[d]; d--) idx[d] = 0;
  }
  return 0;
}

/* out's slices along dim are the source's at the indices, checked as eager checks them. */
static int gather(const run *r, const int64_t *k, char **bufs) {
  size_t es = dtype_size(k[1]);
  int64_t dim = k[2], base = k - r->plan + 4;
  const char *where = r->m->strings + k[3];
  view vs, vi, vo;
  if (eval_view(r, base, &vs) || eval_view(r, base + VIEW_WORDS, &vi) || eval_view(r, base + 2 * VIEW_WORDS, &vo) ||
      vi.ndim != 1 || dim < 0 || dim >= vs.ndim || vo.ndim != vs.ndim)
    return fail(r, "%s: its sizes do not evaluate", where);
  const int64_t *idx = (const int64_t *)(void *)bufs[vi.buf];
  for (int64_t i = 0; i < vi.shape[0]; i++) {
    int64_t v = idx[vi.off + i * vi.stride[0]];
    if (v < 0 || v >= vs.shape[dim])
      return fail(r, "%s: index %" PRId64 " (at %" PRId64 ") is out of range for a dim of %" PRId64, where, v, i,
                  vs.shape[dim]);
  }
  int64_t n = 1, at[RT_MAXD] = {0};
  for (int d = 0; d < vo.ndim; d++) n *= vo.shape[d];
  for (int64_t e = 0; e < n; e++) {
    int64_t so = vs.off, oo = vo.off;
    for (int d = 0; d < vo.ndim; d++) {
      int64_t sd = d == dim ? idx[vi.off + at[d] * vi.stride[0]] : at[d];
      so += sd * vs.stride[d];
      oo += at[d] * vo.stride[d];
    }
    memcpy(bufs[vo.buf] + oo * (int64_t)es, bufs[vs.buf] + so * (int64_t)es, es);
    for (int d = (int)vo.ndim - 1; d >= 0 && ++at[d] == vo.shape[d]; d--) at[d] = 0;
  }
  return 0;
}

/* out's running sums of the source along dim, as eager's k_cumsum (f32 summed in f64). */
static int cumsum(const run *r, const int64_t *k, char **bufs) {
  int64_t dt = k[1], dim = k[2], base = k - r->plan + 3;
  view vs, vo;
  if (eval_view(r, base, &vs) || eval_view(r, base + VIEW_WORDS, &vo) || vs.ndim != vo.ndim || dim < 0 ||
      (vs.ndim && dim >= vs.ndim))
    return fail(r, "a cumsum's sizes do not evaluate");
  if (vs.ndim == 0) {
    memcpy(bufs[vo.buf] + vo.off * (int64_t)dtype_size(dt), bufs[vs.buf] + vs.off * (int64_t)dtype_size(dt), dtype_size(dt));
    return 0;
  }
  int64_t len = vs.shape[dim], rows = 1, at[RT_MAXD] = {0};
  for (int d = 0; d < vs.ndim; d++) rows *= d == dim ? 1 : vs.shape[d];
  for (int64_t row = 0; row < rows && len > 0; row++) {
    int64_t so = vs.off, oo = vo.off;
    for (int d = 0; d < vs.ndim; d++) so += at[d] * vs.stride[d], oo += at[d] * vo.stride[d];
    int64_t ss = vs.stride[dim], os = vo.stride[dim];
    if (dt == 2) {
      const int64_t *p = (const int64_t *)(void *)bufs[vs.buf] + so;
      int64_t *o = (int64_t *)(void *)bufs[vo.buf] + oo;
      uint64_t acc = 0;
      for (int64_t i = 0; i < len; i++) o[i * os] = (int64_t)(acc += (uint64_t)p[i * ss]);
    } else if (dt == 0) {
      const float *p = (const float *)(void *)bufs[vs.buf] + so;
      float *o = (float *)(void *)bufs[vo.buf] + oo;
      double acc = 0;
      for (int64_t i = 0; i < len; i++) o[i * os] = (float)(acc += p[i * ss]);
    } else {
      const double *p = (const double *)(void *)bufs[vs.buf] + so;
      double *o = (double *)(void *)bufs[vo.buf] + oo;
      double acc = 0;
      for (int64_t i = 0; i < len; i++) o[i * os] = acc += p[i * ss];
    }
    for (int d = (int)vs.ndim - 1; d >= 0; d--) {
      if (d == dim) continue;
      if (++at[d] < vs.shape[d]) break;
      at[d] = 0;
    }
  }
  return 0;
}

/* Binds every symbol from the input dim it is named by, then checks each
 * input's dtype-free facts (rank, sizes) and the guards. */
static int bind(run *r, const kiln_rt_buffer *in) {
  const int64_t *P = r->plan;
  const int64_t *syms = P + P[PLAN_SYMS];
  for (int s = 0; s < r->n_syms; s++) {
    const int64_t *y = syms + s * SYM_WORDS;
    int64_t i = y[2], d = y[3];
    if (i < 0 || i >= P[PLAN_NIN] || d < 0 || d >= RT_MAXD) return fail(r, "s%d is not the size of any input", s);
    if (in[i].ndim <= d) return fail(r, "input %" PRId64 " has rank %d, the model takes more dims", i, in[i].ndim);
    int64_t v = in[i].shape[d];
    if (v < y[0] || v > y[1])
      return fail(r, "input %" PRId64 " (%s) dim %" PRId64 " is %" PRId64 ", outside the bounds of s%d [%" PRId64 ", %" PRId64 "]", i,
                  r->m->strings + P[P[PLAN_INS] + i * IN_WORDS + 2], d, v, s, y[0], y[1]);
    r->vals[s] = v;
  }
  for (int64_t i = 0; i < P[PLAN_NIN]; i++) {
    const int64_t *w = P + P[PLAN_INS] + i * IN_WORDS;
    const char *nm = r->m->strings + w[2];
    if (in[i].ndim != w[1])
      return fail(r, "input %" PRId64 " (%s) has rank %d, the model takes %" PRId64 " (%s)", i, nm, in[i].ndim, w[1],
                  dtype_name(w[0]));
    int64_t numel = 1;
    for (int d = 0; d < w[1]; d++) {
      int64_t want;
      if (eval(r, w[3 + d], &want)) return fail(r, "input %" PRId64 " (%s) dim %d: its size does not evaluate", i, nm, d);
      if (want != in[i].shape[d])
        return fail(r, "input %" PRId64 " (%s) dim %d is %" PRId64 ", the model takes %" PRId64 " there (from the sizes bound so far)",
                    i, nm, d, in[i].shape[d], want);
      numel *= want;
    }
    if (!in[i].data && numel > 0) return fail(r, "input %" PRId64 " (%s) has no data", i, nm);
  }
  const int64_t *gd = P + P[PLAN_GUARDS];
  for (int64_t i = 0; i < P[PLAN_NGUARD]; i++) {
    const int64_t *g = gd + i * GUARD_WORDS;
    int64_t x, y;
    bool ok = !eval(r, g[1], &x) && !eval(r, g[2], &y);
    if (ok) {
      switch (g[0]) {
      case 0: ok = x == y; break; /* sym_cmp: EQ NE LT LE GE GT DIVIDES */
      case 1: ok = x != y; break;
      case 2: ok = x < y; break;
      case 3: ok = x <= y; break;
      case 4: ok = x >= y; break;
      case 5: ok = x > y; break;
      case 6: ok = y >= 1 && x % y == 0; break;
      default: ok = false;
      }
    }
    if (!ok) {
      char vals[160] = "";
      size_t n = 0;
      for (int s = 0; s < r->n_syms && n < sizeof vals - 32; s++)
        n += (size_t)snprintf(vals + n, sizeof vals - n, "%ss%d = %" PRId64, s ? ", " : "", s, r->vals[s]);
      return fail(r, "the inputs break the guard %s of the exported variant (%s)", r->m->strings + g[3], vals);
    }
  }
  return 0;
}

/* The arena the model keeps between calls (its state words: busy, pointer,
 * capacity), or a fresh one when another call holds it. */
static char *arena_take(const kiln_rt_model *m, size_t bytes, bool *shared) {
  _Atomic int64_t *busy = (_Atomic int64_t *)&m->state[0];
  int64_t free_ = 0;
  *shared = atomic_compare_exchange_strong(busy, &free_, 1);
  if (!*shared) return bytes ? aligned_alloc(64, (bytes + 63) / 64 * 64) : NULL;
  if ((size_t)m->state[2] < bytes) {
    free((void *)(intptr_t)m->state[1]);
    size_t cap = (bytes + 63) / 64 * 64;
    void *a = aligned_alloc(64, cap);
    m->state[1] = (int64_t)(intptr_t)a;
    m->state[2] = a ? (int64_t)cap : 0;
  }
  return (char *)(intptr_t)m->state[1];
}

static void arena_give(const kiln_rt_model *m, char *arena, bool shared) {
  if (!shared) {
    free(arena);
    return;
  }
  atomic_store((_Atomic int64_t *)&m->state[0], 0);
}

/* One unit (the top graph or a region) in a call: its buffers, sized and
 * placed once per call. A region's arena and buffers then serve every step
 * of its loop: a step sets its arguments' pointers and runs the kernels. */
typedef struct frame {
  int64_t h; /* the unit's header */
  int nb, nk;
  char **bufs;
  size_t *bytes, *off;
  unsigned char *temp, *owned;
  int *first, *last;
  char *arena;
  bool shared, ready, top;
} frame;

/* What a control-flow kernel keeps between its runs in one call, grown to
 * the call's sizes on its first run: its operands (copied when strided),
 * its result slots, and two sets of carry buffers a loop swaps per step. */
typedef struct cfstate {
  int n_in, n_res;
  char **arg, **scratch, **call, **dst, **slot, **carry[2];
  size_t *scratch_cap, *slot_cap, *carry_cap[2], *arg_bytes, *slice, *res_bytes;
  int64_t *xs_len;
} cfstate;

static void frame_free(run *r, frame *f) {
  if (f->arena || f->shared) {
    if (f->top) arena_give(r->m, f->arena, f->shared);
    else free(f->arena);
  }
  for (int b = 0; f->bufs && f->owned && b < f->nb; b++)
    if (f->owned[b]) free(f->bufs[b]);
  free(f->bufs), free(f->bytes), free(f->off), free(f->temp), free(f->owned), free(f->first), free(f->last);
  memset(f, 0, sizeof *f);
}

static void cfstate_free(cfstate *c) {
  for (int j = 0; c->scratch && j < c->n_in; j++) free(c->scratch[j]);
  for (int k = 0; c->slot && k < c->n_res; k++) free(c->slot[k]);
  for (int s = 0; s < 2; s++)
    for (int k = 0; c->carry[s] && k < c->n_in; k++) free(c->carry[s][k]);
  free(c->arg), free(c->scratch), free(c->call), free(c->dst), free(c->slot), free(c->carry[0]), free(c->carry[1]);
  free(c->scratch_cap), free(c->slot_cap), free(c->carry_cap[0]), free(c->carry_cap[1]), free(c->arg_bytes);
  free(c->slice), free(c->res_bytes), free(c->xs_len);
  memset(c, 0, sizeof *c);
}

/* Sizes unit f's buffers at this call's symbols and places its temporaries.
 * The top's arguments are in[], its outputs malloc'ed; a region's arguments
 * are set per run and its outputs are temporaries alive to its end (the run
 * copies them out). 0, or -1 with the error. */
static int frame_prepare(run *r, frame *f, const kiln_rt_buffer *in) {
  const int64_t *P = r->plan, *H = P + f->h;
  int nb = f->nb = (int)H[PLAN_NBUF];
  f->nk = (int)H[PLAN_NK];
  f->bufs = calloc((size_t)nb + 1, sizeof *f->bufs);
  f->bytes = calloc((size_t)nb + 1, sizeof *f->bytes), f->off = calloc((size_t)nb + 1, sizeof *f->off);
  f->temp = calloc((size_t)nb + 1, 1), f->owned = calloc((size_t)nb + 1, 1);
  f->first = calloc((size_t)nb + 1, sizeof *f->first), f->last = calloc((size_t)nb + 1, sizeof *f->last);
  if (!f->bufs || !f->bytes || !f->off || !f->temp || !f->owned || !f->first || !f->last) return fail(r, "out of memory");
  for (int b = 0; b < nb; b++) {
    const int64_t *w = P + H[PLAN_BUFS] + b * BUF_WORDS;
    int64_t numel;
    if (eval(r, w[2], &numel) || numel < 0) return fail(r, "a size does not evaluate at these input sizes");
    f->bytes[b] = (size_t)numel * dtype_size(w[1]);
    f->first[b] = (int)w[5], f->last[b] = (int)w[6];
    switch (w[0]) {
    case RT_BUF_INPUT: f->bufs[b] = f->top ? in[w[3]].data : NULL; break;
    case RT_BUF_WEIGHT: f->bufs[b] = (char *)r->m->weights + w[3]; break;
    case RT_BUF_TEMP: f->temp[b] = w[4] < 0 && f->first[b] >= 0; break;
    case RT_BUF_OUTPUT:
      if (!f->top) {
        f->temp[b] = 1;
        if (f->first[b] < 0) f->first[b] = 0;
        f->last[b] = f->nk;
        break;
      }
      if (!(f->bufs[b] = malloc(f->bytes[b] ? f->bytes[b] : 1))) return fail(r, "out of memory");
      f->owned[b] = 1;
      break;
    }
  }
  size_t total = rt_plan_arena(nb, f->temp, f->first, f->last, f->bytes, f->off);
  if (f->top) f->arena = arena_take(r->m, total, &f->shared);
  else f->arena = total ? aligned_alloc(64, (total + 63) / 64 * 64) : NULL;
  if (total && !f->arena) return fail(r, "out of memory");
  for (int b = 0; b < nb; b++)
    if (f->temp[b]) f->bufs[b] = f->arena + f->off[b];
  for (int b = 0; b < nb; b++) {
    const int64_t *w = P + H[PLAN_BUFS] + b * BUF_WORDS;
    if (w[0] == RT_BUF_TEMP && w[4] >= 0) f->bufs[b] = f->bufs[w[4]]; /* in place in a dying buffer */
  }
  f->ready = true;
  return 0;
}

static int run_kernels(run *r, frame *f);

/* Where a region's buffer b lies in its arena. */
static char *home(const frame *f, int64_t b) { return f->arena ? f->arena + f->off[b] : NULL; }

/* Runs unit u on args (its inputs' data, contiguous) and writes its outputs
 * to dst[i] (contiguous, aliasing no argument). An output that is a whole
 * output buffer of the unit is that dst itself for this run, so its kernel
 * stores there (a loop's next carry, a scan's y[t] row: no copy per step);
 * any other is copied there after the kernels. 0, or -1 with the error. */
static int run_unit(run *r, int64_t u, char *const *args, char *const *dst) {
  if (u < 0 || u >= r->n_units) return fail(r, "region %" PRId64 " is not in the plan", u);
  frame *f = &r->units[u];
  const int64_t *P = r->plan;
  if (!f->ready) {
    f->h = P[P[PLAN_UNITS] + u];
    if (frame_prepare(r, f, NULL)) return -1;
  }
  const int64_t *H = P + f->h;
  int64_t n_out = H[PLAN_NOUT];
  enum { MAX_DIRECT = 64 };
  unsigned char direct[MAX_DIRECT] = {0}; /* output i is stored in place */
  for (int b = 0; b < f->nb; b++) {
    const int64_t *w = P + H[PLAN_BUFS] + b * BUF_WORDS;
    if (w[0] == RT_BUF_INPUT) f->bufs[b] = args[w[3]];
    if (w[0] == RT_BUF_OUTPUT) f->bufs[b] = home(f, b); /* a run before may have pointed it at its dst */
  }
  for (int64_t i = 0; i < n_out && i < MAX_DIRECT; i++) {
    view v;
    int64_t at = H[PLAN_OUTS] + i * OUT_WORDS, numel = 1;
    if (eval_view(r, at + 1, &v)) return fail(r, "a size does not evaluate at these input sizes");
    const int64_t *w = P + H[PLAN_BUFS] + v.buf * BUF_WORDS;
    for (int d = 0; d < v.ndim; d++) numel *= v.shape[d];
    if (w[0] != RT_BUF_OUTPUT || v.off != 0 || !dense(&v) || (size_t)numel * dtype_size(P[at]) != f->bytes[v.buf] ||
        f->bufs[v.buf] != home(f, v.buf) || !numel)
      continue; /* a view, or a buffer another output took already */
    f->bufs[v.buf] = dst[i];
    direct[i] = 1;
  }
  if (run_kernels(r, f)) return -1;
  for (int64_t i = 0; i < n_out; i++) {
    view v;
    int64_t at = H[PLAN_OUTS] + i * OUT_WORDS;
    if (i < MAX_DIRECT && direct[i]) continue;
    if (eval_view(r, at + 1, &v)) return fail(r, "a size does not evaluate at these input sizes");
    copy_out(dst[i], f->bufs[v.buf], &v, dtype_size(P[at]));
    COUNT_COPY();
  }
  return 0;
}

/* *p grown to n bytes (kept when it has them): 0, or -1. */
static int grow(char **p, size_t *cap, size_t n) {
  if (n <= *cap && *p) return 0;
  free(*p);
  *cap = 0;
  if (!(*p = aligned_alloc(64, (n + 63) / 64 * 64 + 64))) return -1;
  *cap = n;
  return 0;
}

/* The bytes of output i of unit u at this call's sizes. */
static int out_bytes(const run *r, int64_t u, int64_t i, size_t *n) {
  const int64_t *P = r->plan, *H = P + P[P[PLAN_UNITS] + u];
  int64_t at = H[PLAN_OUTS] + i * OUT_WORDS, numel = 1;
  view v;
  if (eval_view(r, at + 1, &v)) return -1;
  for (int d = 0; d < v.ndim; d++) numel *= v.shape[d];
  *n = (size_t)numel * dtype_size(P[at]);
  return 0;
}

/* A cond, while or scan (rt/plan.h: RT_K_CF) over frame f's buffers. */
static int run_cf(run *r, frame *f, const int64_t *k) {
  const int64_t *P = r->plan;
  int64_t op = k[1], id = k[2], n_in = k[3], nc = k[4], nx = k[5], u0 = k[6], u1 = k[7];
  const char *where = r->m->strings + k[8];
  if (id < 0 || id >= r->n_cf || n_in < 0 || u0 < 0 || u0 >= r->n_units)
    return fail(r, "%s: a control-flow record that is not one", where);
  int64_t ub = op == RT_CF_WHILE ? u1 : u0; /* the unit whose outputs are the results */
  if (ub < 0 || ub >= r->n_units) return fail(r, "%s: a control-flow record that is not one", where);
  int n_res = (int)P[P[P[PLAN_UNITS] + ub] + PLAN_NOUT];
  cfstate *c = &r->cfs[id];
  if (!c->arg) {
    size_t ni = (size_t)n_in + 1, nr = (size_t)n_res + 1;
    c->n_in = (int)n_in, c->n_res = n_res;
    c->arg = calloc(ni, sizeof(char *)), c->scratch = calloc(ni, sizeof(char *)), c->call = calloc(ni, sizeof(char *));
    c->carry[0] = calloc(ni, sizeof(char *)), c->carry[1] = calloc(ni, sizeof(char *));
    c->dst = calloc(nr, sizeof(char *)), c->slot = calloc(nr, sizeof(char *));
    c->scratch_cap = calloc(ni, sizeof(size_t)), c->carry_cap[0] = calloc(ni, sizeof(size_t));
    c->carry_cap[1] = calloc(ni, sizeof(size_t)), c->arg_bytes = calloc(ni, sizeof(size_t));
    c->slice = calloc(ni, sizeof(size_t)), c->slot_cap = calloc(nr, sizeof(size_t)), c->res_bytes = calloc(nr, sizeof(size_t));
    c->xs_len = calloc(ni, sizeof(int64_t));
    if (!c->arg || !c->scratch || !c->call || !c->carry[0] || !c->carry[1] || !c->dst || !c->slot || !c->scratch_cap ||
        !c->carry_cap[0] || !c->carry_cap[1] || !c->arg_bytes || !c->slice || !c->slot_cap || !c->res_bytes || !c->xs_len)
      return fail(r, "%s: out of memory", where);
  }
  /* the operands, contiguous: a strided one is copied into the kernel's scratch */
  for (int64_t j = 0; j < n_in; j++) {
    const int64_t *o = k + CF_WORDS + j * (1 + VIEW_WORDS);
    size_t es = dtype_size(o[0]);
    view v;
    if (eval_view(r, o + 1 - P, &v)) return fail(r, "%s: its sizes do not evaluate", where);
    int64_t numel = 1;
    for (int d = 0; d < v.ndim; d++) numel *= v.shape[d];
    c->arg_bytes[j] = (size_t)numel * es;
    c->xs_len[j] = v.ndim ? v.shape[0] : 1;
    c->slice[j] = c->xs_len[j] ? c->arg_bytes[j] / (size_t)c->xs_len[j] : 0;
    if (c->xs_len[j] == 0) { /* xs of length 0: its slices' bytes from the other dims */
      c->slice[j] = es;
      for (int d = 1; d < v.ndim; d++) c->slice[j] *= (size_t)v.shape[d];
    }
    char *base = f->bufs[v.buf];
    if (!numel || dense(&v)) {
      c->arg[j] = base ? base + v.off * (int64_t)es : NULL;
      continue;
    }
    if (grow(&c->scratch[j], &c->scratch_cap[j], c->arg_bytes[j])) return fail(r, "%s: out of memory", where);
    copy_out(c->scratch[j], base, &v, es);
    c->arg[j] = c->scratch[j];
  }
  /* the result slots, at this call's sizes */
  int64_t T = op == RT_CF_SCAN && nx > 0 ? c->xs_len[nc] : 0;
  for (int i = 0; i < n_res; i++) {
    if (out_bytes(r, ub, i, &c->res_bytes[i])) return fail(r, "%s: its sizes do not evaluate", where);
    size_t all = c->res_bytes[i] * (size_t)(op == RT_CF_SCAN && i >= nc ? T : 1);
    if (grow(&c->slot[i], &c->slot_cap[i], all)) return fail(r, "%s: out of memory", where);
  }
  if (op == RT_CF_COND) {
    bool p = c->arg[0] && *(const unsigned char *)c->arg[0];
    return run_unit(r, p ? u0 : u1, c->arg + 1, c->slot);
  }
  if (op != RT_CF_WHILE && op != RT_CF_SCAN) return fail(r, "%s: a control-flow record that is not one", where);
  /* the carry: in buffers of set s, the step's out into set 1 - s, swapped */
  int s = 0;
  for (int64_t j = 0; j < nc; j++) {
    for (int q = 0; q < 2; q++)
      if (grow(&c->carry[q][j], &c->carry_cap[q][j], c->arg_bytes[j])) return fail(r, "%s: out of memory", where);
    if (c->arg_bytes[j]) memcpy(c->carry[0][j], c->arg[j], c->arg_bytes[j]);
  }
  for (int64_t j = nc; j < n_in; j++) c->call[j] = c->arg[j];
  if (op == RT_CF_WHILE) {
    for (;;) {
      unsigned char go[64] = {0};
      char *gp = (char *)go;
      for (int64_t j = 0; j < nc; j++) c->call[j] = c->carry[s][j];
      if (run_unit(r, u0, c->call, &gp)) return -1;
      if (!go[0]) break;
      for (int64_t j = 0; j < nc; j++) c->dst[j] = c->carry[1 - s][j];
      if (run_unit(r, u1, c->call, c->dst)) return -1;
      s = 1 - s;
    }
  } else {
    for (int64_t t = 0; t < T; t++) {
      for (int64_t j = 0; j < nc; j++) c->call[j] = c->carry[s][j], c->dst[j] = c->carry[1 - s][j];
      for (int64_t j = nc; j < nc + nx; j++) c->call[j] = c->arg[j] + (size_t)t * c->slice[j];
      for (int i = (int)nc; i < n_res; i++) c->dst[i] = c->slot[i] + (size_t)t * c->res_bytes[i];
      if (run_unit(r, u0, c->call, c->dst)) return -1;
      s = 1 - s;
    }
  }
  for (int64_t j = 0; j < nc; j++)
    if (c->res_bytes[j]) memcpy(c->slot[j], c->carry[s][j], c->res_bytes[j]);
  return 0;
}

/* Result k of a control-flow kernel into its node's buffer (RT_K_GET). */
static int run_get(run *r, frame *f, const int64_t *k) {
  int64_t id = k[1], i = k[2];
  size_t es = dtype_size(k[3]);
  view v;
  if (eval_view(r, k + 4 - r->plan, &v)) return fail(r, "a size does not evaluate at these input sizes");
  cfstate *c = id >= 0 && id < r->n_cf ? &r->cfs[id] : NULL;
  if (!c || !c->slot || i < 0 || i >= c->n_res) return fail(r, "a result read before its construct ran");
  int64_t n = 1, idx[RT_MAXD] = {0};
  for (int d = 0; d < v.ndim; d++) n *= v.shape[d];
  char *base = f->bufs[v.buf];
  for (int64_t e = 0; e < n; e++) {
    int64_t o = v.off;
    for (int d = 0; d < v.ndim; d++) o += idx[d] * v.stride[d];
    memcpy(base + o * (int64_t)es, c->slot[i] + e * (int64_t)es, es);
    for (int d = (int)v.ndim - 1; d >= 0 && ++idx[d] == v.shape[d]; d--) idx[d] = 0;
  }
  return 0;
}

/* Runs the kernels of unit f in order. 0, or -1 with the error. */
static int run_kernels(run *r, frame *f) {
  const int64_t *P = r->plan, *H = P + f->h;
  char **bufs = f->bufs;
  for (int ki = 0; ki < f->nk; ki++) {
    const int64_t *k = P + P[H[PLAN_KERNELS] + ki];
    if (k[0] == RT_K_MATMUL || k[0] == RT_K_GATHER || k[0] == RT_K_CUMSUM) {
      if (k[0] == RT_K_MATMUL ? matmul(r, k, bufs) : k[0] == RT_K_GATHER ? gather(r, k, bufs) : cumsum(r, k, bufs)) return -1;
      continue;
    }
    if (k[0] == RT_K_CF || k[0] == RT_K_GET) {
      if (k[0] == RT_K_CF ? run_cf(r, f, k) : run_get(r, f, k)) return -1;
      continue;
    }
    /* kind, fn, split, staged, n_outer, ndim, dims, n_param, params, n_acc, accesses */
    int64_t fn = k[1], split = k[2], staged = k[3], n_outer = k[4], ndim = k[5], range = 1, inner = 1;
    for (int d = 0; d < ndim; d++) {
      int64_t v;
      if (eval(r, k[6 + d], &v) || v < 0) return fail(r, "a size does not evaluate at these input sizes");
      if (!staged || d < n_outer) range *= v;
      else inner *= v;
    }
    const int64_t *q = k + 6 + ndim;
    int64_t n_param = q[0], prm[256];
    for (int i = 0; i < n_param && i < 256; i++)
      if (eval(r, q[1 + i], &prm[i])) return fail(r, "a size does not evaluate at these input sizes");
    q += 1 + n_param;
    int64_t n_acc = q[0];
    char *acc[65];
    for (int a = 0; a < n_acc && a < 64; a++) {
      int64_t b = q[1 + 2 * a], shift = q[2 + 2 * a];
      const int64_t *bw = P + H[PLAN_BUFS] + b * BUF_WORDS;
      acc[a] = bufs[b] && shift ? bufs[b] + shift * (int64_t)dtype_size(bw[1]) : bufs[b];
    }
    acc[n_acc] = NULL;
    rt_run_loop(r->m->kernels[fn], prm, acc, (int)n_acc, range, inner, (int)staged, (int)split);
  }
  return 0;
}

int kiln_rt_run(const kiln_rt_model *m, const kiln_rt_buffer *in, kiln_rt_buffer *out) {
  run r = {.m = m, .name = "kiln_rt"};
  if (!m || !m->plan) return fail(&r, "the model is NULL");
  const int64_t *P = m->plan;
  if (P[PLAN_MAGIC] != (int64_t)RT_MAGIC) return fail(&r, "not an exported kiln model");
  if (P[PLAN_VERSION] != RT_PLAN_VERSION)
    return fail(&r, "the model was exported for runtime plan version %" PRId64 ", this libkiln_rt reads version %d",
                P[PLAN_VERSION], RT_PLAN_VERSION);
  r.plan = P;
  r.words = P[PLAN_WORDS];
  r.name = m->strings + P[PLAN_NAME];
  r.n_syms = (int)P[PLAN_NSYMS];
  int nout = (int)P[PLAN_NOUT];
  if ((P[PLAN_NIN] && !in) || !out) return fail(&r, "%s is NULL", !out ? "out" : "in");
  if (bind(&r, in)) return -1;
  int rc = -1;
  r.n_units = (int)P[PLAN_NUNIT], r.n_cf = (int)P[PLAN_NCF];
  r.units = calloc((size_t)r.n_units + 1, sizeof *r.units);
  r.cfs = calloc((size_t)r.n_cf + 1, sizeof *r.cfs);
  unsigned char *mine = calloc((size_t)nout + 1, 1);
  frame *f = r.units;
  if (!r.units || !r.cfs || !mine) {
    fail(&r, "out of memory");
    goto done;
  }
  f->top = true;
  if (frame_prepare(&r, f, in) || run_kernels(&r, f)) goto done;
  for (int i = 0; i < nout; i++) {
    const int64_t *w = P + P[PLAN_OUTS] + i * OUT_WORDS;
    view v;
    if (eval_view(&r, P[PLAN_OUTS] + i * OUT_WORDS + 1, &v)) goto bad_size;
    size_t es = dtype_size(w[0]);
    int64_t numel = 1;
    for (int d = 0; d < v.ndim; d++) numel *= v.shape[d];
    if (out[i].data) {
      bool same = out[i].ndim == v.ndim;
      for (int d = 0; same && d < v.ndim; d++) same = out[i].shape[d] == v.shape[d];
      if (!same) {
        fail(&r, "output %d has a shape other than the call's (rank %d, the call's %" PRId64 "); pass data NULL to have it allocated",
             i, out[i].ndim, v.ndim);
        goto done;
      }
      copy_out(out[i].data, f->bufs[v.buf], &v, es);
      continue;
    }
    /* the whole of an output buffer of this call's is handed over as it is */
    bool whole = f->owned[v.buf] && v.off == 0 && (size_t)numel * es == f->bytes[v.buf] && dense(&v);
    if (whole) {
      out[i].data = f->bufs[v.buf];
      f->owned[v.buf] = 0;
    } else {
      if (!(out[i].data = malloc(numel ? (size_t)numel * es : 1))) goto oom;
      copy_out(out[i].data, f->bufs[v.buf], &v, es);
    }
    mine[i] = 1;
    out[i].ndim = (int)v.ndim;
    for (int d = 0; d < v.ndim; d++) out[i].shape[d] = v.shape[d];
  }
  rc = 0;
  goto done;
bad_size:
  fail(&r, "a size does not evaluate at these input sizes");
  goto done;
oom:
  fail(&r, "out of memory");
done:
  for (int i = 0; rc && mine && i < nout; i++) /* what this call allocated goes; a caller's buffers stay */
    if (mine[i]) free(out[i].data), out[i].data = NULL;
  for (int u = 0; r.units && u < r.n_units; u++) frame_free(&r, &r.units[u]);
  for (int c = 0; r.cfs && c < r.n_cf; c++) cfstate_free(&r.cfs[c]);
  free(r.units), free(r.cfs), free(mine);
  return rc;
}
