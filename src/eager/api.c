/* The public op entry points: argument checks that need the user's view of
 * the call (axes, -1 in reshape, slice bounds), then op_dispatch. */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <string.h>

#include "eager/eager.h"

#define BINARY(name, ID)                                                             \
  kiln_tensor *kiln_##name##_at(kiln_tensor *a, kiln_tensor *b, const char *file, int line) { \
    kiln_tensor *in[2] = {a, b};                                                     \
    return op_dispatch(OP_##ID, in, 2, NULL, file, line);                            \
  }
#define UNARY(name, ID)                                                              \
  kiln_tensor *kiln_##name##_at(kiln_tensor *a, const char *file, int line) {        \
    return op_dispatch(OP_##ID, &a, 1, NULL, file, line);                            \
  }

BINARY(add, ADD) BINARY(sub, SUB) BINARY(mul, MUL) BINARY(div, DIV) BINARY(pow, POW)
BINARY(maximum, MAXIMUM) BINARY(minimum, MINIMUM) BINARY(eq, EQ) BINARY(ne, NE) BINARY(lt, LT)
BINARY(le, LE) BINARY(gt, GT) BINARY(ge, GE) BINARY(matmul, MATMUL)
UNARY(neg, NEG) UNARY(abs, ABS) UNARY(exp, EXP) UNARY(log, LOG) UNARY(sqrt, SQRT) UNARY(rsqrt, RSQRT)
UNARY(tanh, TANH) UNARY(sigmoid, SIGMOID) UNARY(relu, RELU) UNARY(gelu, GELU) UNARY(gelu_erf, GELU_ERF)
UNARY(erf, ERF) UNARY(sin, SIN) UNARY(cos, COS) UNARY(silu, SILU) UNARY(softplus, SOFTPLUS) UNARY(log1p, LOG1P)
UNARY(expm1, EXPM1) UNARY(floor, FLOOR) UNARY(ceil, CEIL) UNARY(round, ROUND) UNARY(sign, SIGN)

static bool whole(double v) { return v == floor(v) || v != v || v == INFINITY || v == -INFINITY; }

kiln_tensor *kiln_clamp_at(kiln_tensor *x, double lo, double hi, const char *file, int line) {
  if (tensor_bad_arg(x, file, line, "clamp", "input 0")) return NULL;
  if (lo != lo || hi != hi) return err_set(file, line, "clamp", "bound %g is nan", lo != lo ? lo : hi);
  op_attrs a = {.value = lo, .value2 = hi};
  if (x->dtype == KILN_I64 && !(whole(lo) && whole(hi))) {
    /* torch's promotion: an integer tensor and a fractional number compute in f32 */
    kiln_scope_begin();
    kiln_tensor *f = kiln_cast_at(x, KILN_F32, file, line);
    kiln_tensor *r = kiln_keep(op_dispatch(OP_CLAMP, &f, 1, &a, file, line));
    kiln_scope_end();
    return r;
  }
  return op_dispatch(OP_CLAMP, &x, 1, &a, file, line);
}

kiln_tensor *kiln_leaky_relu_at(kiln_tensor *x, double slope, const char *file, int line) {
  op_attrs a = {.value = slope};
  return op_dispatch(OP_LEAKY_RELU, &x, 1, &a, file, line);
}

/* x op value: the number as a 0-d tensor of x's dtype (f32 for a fractional
 * number and i64 x), so that no promotion widens x. */
static kiln_tensor *scalar_op(kiln_tensor *(*fn)(kiln_tensor *, kiln_tensor *, const char *, int), const char *name,
                              kiln_tensor *x, double v, const char *file, int line) {
  if (tensor_bad_arg(x, file, line, name, "input 0")) return NULL;
  /* an integer x computes in f32 with a fractional number, and in a divide (true division, as torch) */
  bool to_f32 = x->dtype == KILN_I64 && (!whole(v) || fn == kiln_div_at);
  kiln_dtype dt = to_f32 ? KILN_F32 : x->dtype == KILN_BOOL ? KILN_I64 : x->dtype;
  kiln_scope_begin();
  if (to_f32) x = kiln_cast_at(x, KILN_F32, file, line);
  kiln_tensor *r = kiln_keep(fn(x, kiln_scalar_at(dt, v, file, line), file, line));
  kiln_scope_end();
  return r;
}
#define SCALAR_OP(name)                                                                   \
  kiln_tensor *kiln_##name##_scalar_at(kiln_tensor *x, double v, const char *file, int line) { \
    return scalar_op(kiln_##name##_at, #name "_scalar", x, v, file, line);                  \
  }
SCALAR_OP(add) SCALAR_OP(sub) SCALAR_OP(mul) SCALAR_OP(div)

kiln_tensor *kiln_where_at(kiln_tensor *c, kiln_tensor *a, kiln_tensor *b, const char *file, int line) {
  kiln_tensor *in[3] = {c, a, b};
  return op_dispatch(OP_WHERE, in, 3, NULL, file, line);
}

/* A new reference to t itself, owned like any op result. */
static kiln_tensor *same(kiln_tensor *t) { return scope_adopt(kiln_retain(t)); }

kiln_tensor *kiln_cast_at(kiln_tensor *t, kiln_dtype dt, const char *file, int line) {
  if (tensor_bad_arg(t, file, line, "cast", "input 0")) return NULL;
  if (t->dtype == dt) return same(t);
  op_attrs a = {.dtype = dt};
  return op_dispatch(OP_CAST, &t, 1, &a, file, line);
}

kiln_tensor *kiln_contiguous_at(kiln_tensor *t, const char *file, int line) {
  if (tensor_bad_arg(t, file, line, "contiguous", "input 0")) return NULL;
  /* t itself or a copy, by its layout: a write into the result reaches t
   * only in the first case. A choice on the layout, as kiln_is_contiguous's
   * would be, which the guard-only path does not check: a recording runs
   * again at every call (an input transposed at one call, plain at the next) */
  meta_read(t, META_LAYOUT);
  if (tensor_contiguous(t)) return same(t);
  return op_dispatch(OP_COPY, &t, 1, NULL, file, line);
}

/* ---- reductions ---- */

/* Sorted, unique, non-negative axes into a; naxes == 0 means all. */
static int norm_axes(const char *op, const kiln_tensor *t, const int *axes, int naxes, op_attrs *a,
                     const char *file, int line) {
  if (tensor_bad_arg(t, file, line, op, "input 0")) return -1;
  if (naxes < 0 || naxes > MAXD || (naxes > 0 && !axes)) return err_set(file, line, op, "bad axis list (%d axes)", naxes), -1;
  bool seen[MAXD] = {0};
  if (naxes == 0)
    for (int i = 0; i < t->ndim; i++) seen[i] = true;
  for (int i = 0; i < naxes; i++) {
    int ax = axis_norm(axes[i], t->ndim);
    if (ax < 0) {
      char b[SHAPE_BUF];
      return err_set(file, line, op, "axis %d is out of range for shape %s", axes[i], err_shape(b, t->ndim, t->shape)), -1;
    }
    if (t->ndim == 0) continue;
    if (seen[ax]) return err_set(file, line, op, "axis %d appears twice", axes[i]), -1;
    seen[ax] = true;
  }
  a->naxes = 0;
  for (int i = 0; i < t->ndim; i++)
    if (seen[i]) a->axes[a->naxes++] = i;
  return 0;
}

static kiln_tensor *reduce(op_id op, const char *name, kiln_tensor *t, const int *axes, int naxes, bool keepdim,
                           const char *file, int line) {
  op_attrs a = {.keepdim = keepdim};
  if (norm_axes(name, t, axes, naxes, &a, file, line)) return NULL;
  return op_dispatch(op, &t, 1, &a, file, line);
}

#define REDUCTION(name, ID)                                                                              \
  kiln_tensor *kiln_##name##_axes_at(kiln_tensor *t, const int *axes, int n, bool kd, const char *f, int l) { \
    return reduce(OP_##ID, #name "_axes", t, axes, n, kd, f, l);                                                 \
  }                                                                                                      \
  kiln_tensor *kiln_##name##_at(kiln_tensor *t, int axis, bool kd, const char *f, int l) {              \
    return reduce(OP_##ID, #name, t, &axis, 1, kd, f, l);                                                \
  }
REDUCTION(sum, SUM)
REDUCTION(mean, MEAN)
REDUCTION(max, MAX)
REDUCTION(min, MIN)

kiln_tensor *kiln_argmax_at(kiln_tensor *t, int axis, bool keepdim, const char *file, int line) {
  return reduce(OP_ARGMAX, "argmax", t, &axis, 1, keepdim, file, line);
}

kiln_tensor *kiln_argmin_at(kiln_tensor *t, int axis, bool keepdim, const char *file, int line) {
  return reduce(OP_ARGMIN, "argmin", t, &axis, 1, keepdim, file, line);
}

/* var = sum((x - mean)^2) / (N - correction), written with primitives */
static kiln_tensor *var(const char *name, kiln_tensor *t, const int *axes, int naxes, int correction, bool keepdim,
                        const char *file, int line) {
  op_attrs a = {0};
  if (norm_axes(name, t, axes, naxes, &a, file, line)) return NULL;
  if (!dtype_is_float(t->dtype)) return err_set(file, line, name, "dtype %s is not supported (floats only)", kiln_dtype_name(t->dtype));
  kiln_scope_begin();
  kiln_tensor *mu = kiln_mean_axes_at(t, a.axes, a.naxes, true, file, line);
  kiln_tensor *d = kiln_sub_at(t, mu, file, line);
  kiln_tensor *ss = kiln_sum_axes_at(kiln_mul_at(d, d, file, line), a.axes, a.naxes, keepdim, file, line);
  kiln_tensor *v = kiln_div_at(ss, numel_scalar(t, a.axes, a.naxes, -correction, t->dtype, file, line), file, line);
  kiln_keep(v);
  kiln_scope_end();
  return v;
}

kiln_tensor *kiln_var_axes_at(kiln_tensor *t, const int *axes, int naxes, int correction, bool keepdim,
                              const char *file, int line) {
  return var("var_axes", t, axes, naxes, correction, keepdim, file, line);
}

kiln_tensor *kiln_var_at(kiln_tensor *t, int axis, int correction, bool keepdim, const char *file, int line) {
  return var("var", t, &axis, 1, correction, keepdim, file, line);
}

/* ---- views ---- */

static kiln_tensor *view(op_id op, kiln_tensor *t, const op_attrs *a, const char *file, int line) {
  return op_dispatch(op, &t, 1, a, file, line);
}

static kiln_tensor *reshape(kiln_tensor *t, int ndim, const int64_t *shape, const char *file, int line);
kiln_tensor *kiln_reshape_at(kiln_tensor *t, int ndim, const int64_t *shape, const char *file, int line) {
  ag_shape_begin(shape);
  kiln_tensor *r = reshape(t, ndim, shape, file, line);
  ag_shape_end();
  return r;
}
static kiln_tensor *reshape(kiln_tensor *t, int ndim, const int64_t *shape, const char *file, int line) {
  if (tensor_bad_arg(t, file, line, "reshape", "input 0")) return NULL;
  char b0[SHAPE_BUF], b1[SHAPE_BUF];
  if (ndim < 0 || ndim > MAXD || (ndim > 0 && !shape)) return err_set(file, line, "reshape", "rank %d is outside 0..%d", ndim, MAXD);
  op_attrs a = {.ndim = ndim};
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < ndim; i++) {
    a.shape[i] = sym_const(shape[i]);
    if (shape[i] == -1) {
      if (infer >= 0) return err_set(file, line, "reshape", "shape %s has more than one -1", err_shape(b0, ndim, shape));
      infer = i;
    } else if (shape[i] < 0) {
      return err_set(file, line, "reshape", "shape %s has a negative size", err_shape(b0, ndim, shape));
    } else {
      if (shape[i] && known > INT64_MAX / shape[i]) return err_set(file, line, "reshape", "shape %s is too large", err_shape(b0, ndim, shape));
      known *= shape[i];
    }
  }
  int64_t numel = shape_numel(t->ndim, t->shape);
  if (infer >= 0) {
    if (known == 0 || numel % known)
      return err_set(file, line, "reshape", "cannot reshape %s (%" PRId64 " elements) to %s", err_shape(b0, t->ndim, t->shape),
                     numel, err_shape(b1, ndim, shape));
    a.shape[infer] = sym_const(numel / known);
    a.infer = infer + 1;
  } else if (known != numel) {
    return err_set(file, line, "reshape", "cannot reshape %s (%" PRId64 " elements) to %s (%" PRId64 ")",
                   err_shape(b0, t->ndim, t->shape), numel, err_shape(b1, ndim, shape), known);
  }
  user_numbers_begin();
  kiln_tensor *r = view(OP_RESHAPE, t, &a, file, line);
  user_numbers_end();
  return r;
}

kiln_tensor *kiln_permute_at(kiln_tensor *t, const int *perm, const char *file, int line) {
  if (tensor_bad_arg(t, file, line, "permute", "input 0")) return NULL;
  if (t->ndim > 0 && !perm) return err_set(file, line, "permute", "perm is NULL");
  op_attrs a = {0};
  bool seen[MAXD] = {0};
  for (int i = 0; i < t->ndim; i++) {
    int p = perm[i] < 0 ? perm[i] + t->ndim : perm[i];
    if (p < 0 || p >= t->ndim || seen[p]) {
      char b[SHAPE_BUF];
      return err_set(file, line, "permute", "(%d at position %d) is not a permutation of the dims of %s", perm[i], i,
                     err_shape(b, t->ndim, t->shape));
    }
    seen[p] = true;
    a.perm[i] = p;
  }
  return view(OP_PERMUTE, t, &a, file, line);
}

kiln_tensor *kiln_transpose_at(kiln_tensor *t, int d0, int d1, const char *file, int line) {
  if (tensor_bad_arg(t, file, line, "transpose", "input 0")) return NULL;
  int a0 = axis_norm(d0, t->ndim), a1 = axis_norm(d1, t->ndim);
  if (a0 < 0 || a1 < 0 || t->ndim == 0) {
    char b[SHAPE_BUF];
    return err_set(file, line, "transpose", "dims (%d, %d) are out of range for shape %s", d0, d1, err_shape(b, t->ndim, t->shape));
  }
  int perm[MAXD];
  for (int i = 0; i < t->ndim; i++) perm[i] = i;
  perm[a0] = a1;
  perm[a1] = a0;
  return kiln_permute_at(t, perm, file, line);
}

static kiln_tensor *expand(kiln_tensor *t, int ndim, const int64_t *shape, const char *file, int line);
kiln_tensor *kiln_expand_at(kiln_tensor *t, int ndim, const int64_t *shape, const char *file, int line) {
  ag_shape_begin(shape);
  kiln_tensor *r = expand(t, ndim, shape, file, line);
  ag_shape_end();
  return r;
}
static kiln_tensor *expand(kiln_tensor *t, int ndim, const int64_t *shape, const char *file, int line) {
  if (tensor_bad_arg(t, file, line, "expand", "input 0")) return NULL;
  char b0[SHAPE_BUF], b1[SHAPE_BUF];
  if (ndim < t->ndim || ndim > MAXD || (ndim && !shape))
    return err_set(file, line, "expand", "cannot expand %s to rank %d", err_shape(b0, t->ndim, t->shape), ndim);
  op_attrs a = {.ndim = ndim};
  for (int i = 0; i < ndim; i++) {
    int j = i - (ndim - t->ndim);
    int64_t want = shape[i] == -1 && j >= 0 ? t->shape[j] : shape[i];
    if (want < 0 || (j >= 0 && t->shape[j] != 1 && t->shape[j] != want) || (j < 0 && shape[i] == -1))
      return err_set(file, line, "expand", "cannot expand %s to %s", err_shape(b0, t->ndim, t->shape), err_shape(b1, ndim, shape));
    a.shape[i] = sym_const(want);
  }
  /* a view allocates nothing, but every op on it counts its elements */
  int64_t count = 1;
  for (int i = 0; i < ndim; i++) {
    int64_t v = a.shape[i].c;
    if (v && count > INT64_MAX / v) return err_set(file, line, "expand", "shape %s has too many elements", err_shape(b1, ndim, shape));
    count *= v;
  }
  user_numbers_begin();
  kiln_tensor *r = view(OP_EXPAND, t, &a, file, line);
  user_numbers_end();
  return r;
}

kiln_tensor *kiln_squeeze_at(kiln_tensor *t, int dim, const char *file, int line) {
  if (tensor_bad_arg(t, file, line, "squeeze", "input 0")) return NULL;
  int d = axis_norm(dim, t->ndim);
  char b[SHAPE_BUF];
  if (d < 0) return err_set(file, line, "squeeze", "dim %d is out of range for shape %s", dim, err_shape(b, t->ndim, t->shape));
  if (t->ndim == 0 || t->shape[d] != 1) {
    /* as torch: squeezing a dim that is not 1 keeps it. That is a choice on
     * the size, as kiln_size's would be: no op is recorded for it, so a
     * recording must run again at every call (a symbolic dim that is 1 at a
     * later call must drop), never the guard-only path */
    if (t->ndim) meta_read(t, d);
    return same(t);
  }
  op_attrs a = {.ndim = t->ndim - 1};
  for (int i = 0, k = 0; i < t->ndim; i++)
    if (i != d) a.shape[k++] = sym_const(t->shape[i]);
  return view(OP_RESHAPE, t, &a, file, line);
}

kiln_tensor *kiln_unsqueeze_at(kiln_tensor *t, int dim, const char *file, int line) {
  if (tensor_bad_arg(t, file, line, "unsqueeze", "input 0")) return NULL;
  int n = t->ndim + 1;
  char b[SHAPE_BUF];
  if (dim < -n || dim >= n || n > MAXD)
    return err_set(file, line, "unsqueeze", "dim %d is out of range for shape %s", dim, err_shape(b, t->ndim, t->shape));
  int d = dim < 0 ? dim + n : dim;
  op_attrs a = {.ndim = n};
  for (int i = 0, k = 0; i < n; i++) a.shape[i] = sym_const(i == d ? 1 : t->shape[k++]);
  return view(OP_RESHAPE, t, &a, file, line);
}

kiln_tensor *kiln_slice_at(kiln_tensor *t, int dim, int64_t start, int64_t end, int64_t step, const char *file,
                           int line) {
  if (tensor_bad_arg(t, file, line, "slice", "input 0")) return NULL;
  char b[SHAPE_BUF];
  int d = axis_norm(dim, t->ndim);
  if (d < 0 || t->ndim == 0) return err_set(file, line, "slice", "dim %d is out of range for shape %s", dim, err_shape(b, t->ndim, t->shape));
  if (step < 1) return err_set(file, line, "slice", "step %" PRId64 " must be at least 1", step);
  int64_t n = t->shape[d], raw_start = start, raw_end = end;
  /* a recording keeps the bounds as given, and may pass them at run time:
   * one far out (INT64_MAX for "to the end") is kept as the nearest number
   * a graph's symbols can hold that means the same for this dim */
  const int64_t far = (int64_t)1 << 40; /* well inside a symbol's range: sums of two stay exact */
  if (n <= far) {
    raw_start = raw_start > far ? far : raw_start < -far ? -far : raw_start;
    raw_end = raw_end > far ? far : raw_end < -far ? -far : raw_end;
  }
  /* Python's rules: negative bounds count from the end, then clamp */
  if (start < 0) start = start + n < 0 ? 0 : start + n;
  if (end < 0) end = end + n < 0 ? 0 : end + n;
  if (start > n) start = n;
  if (end > n) end = n;
  if (end < start) end = start;
  op_attrs a = {.dim = d, .start = sym_const(start), .end = sym_const(end), .step = step, .raw = true, .raw_start = raw_start,
                .raw_end = raw_end};
  user_numbers_begin();
  kiln_tensor *r = view(OP_SLICE, t, &a, file, line);
  user_numbers_end();
  return r;
}

kiln_tensor *kiln_cat_at(kiln_tensor *const *ts, int n, int dim, const char *file, int line) {
  if (n < 1 || !ts) return err_set(file, line, "cat", "needs at least one tensor, got %d", n);
  for (int i = 0; i < n; i++)
    if (!ts[i]) return err_null(file, line, "cat", "input %d", i);
    else if (tensor_check_live(ts[i], "an input", "cat", file, line)) return NULL;
  int d = axis_norm(dim, ts[0]->ndim);
  char b[SHAPE_BUF];
  if (d < 0 || ts[0]->ndim == 0)
    return err_set(file, line, "cat", "dim %d is out of range for shape %s", dim, err_shape(b, ts[0]->ndim, ts[0]->shape));
  op_attrs a = {.dim = d};
  return op_dispatch(OP_CAT, ts, n, &a, file, line);
}

kiln_tensor *kiln_stack_at(kiln_tensor *const *ts, int n, int dim, const char *file, int line) {
  if (n < 1 || !ts) return err_set(file, line, "stack", "needs at least one tensor, got %d", n);
  for (int i = 0; i < n; i++)
    if (!ts[i]) return err_null(file, line, "stack", "input %d", i);
    else if (tensor_check_live(ts[i], "an input", "stack", file, line)) return NULL;
  int nd = ts[0]->ndim + 1;
  /* checked here, or the unsqueeze inside would report it under its own name */
  if (nd > MAXD) return err_set(file, line, "stack", "inputs of rank %d would give rank %d, more than %d", nd - 1, nd, MAXD);
  if (dim < -nd || dim >= nd) return err_set(file, line, "stack", "dim %d is out of range for rank %d", dim, nd);
  for (int i = 1; i < n; i++) {
    char b0[SHAPE_BUF], b1[SHAPE_BUF];
    if (ts[i]->ndim != ts[0]->ndim || memcmp(ts[i]->shape, ts[0]->shape, sizeof(int64_t) * (size_t)ts[0]->ndim))
      return err_set(file, line, "stack", "input %d %s does not match input 0 %s", i, err_shape(b0, ts[i]->ndim, ts[i]->shape),
                     err_shape(b1, ts[0]->ndim, ts[0]->shape));
    /* checked here, or the cat inside would report it under its own name */
    if (ts[i]->dtype != ts[0]->dtype)
      return err_set(file, line, "stack", "input %d is %s, input 0 %s", i, kiln_dtype_name(ts[i]->dtype),
                     kiln_dtype_name(ts[0]->dtype));
  }
  kiln_scope_begin();
  kiln_tensor **us = alloc_malloc(sizeof *us * (size_t)n), *r = NULL;
  if (us) {
    for (int i = 0; i < n; i++) us[i] = kiln_unsqueeze_at(ts[i], dim, file, line);
    r = kiln_keep(kiln_cat_at(us, n, dim, file, line));
    alloc_free(us);
  } else {
    err_set(file, line, "stack", "out of memory");
  }
  kiln_scope_end();
  return r;
}

kiln_tensor *kiln_index_select_at(kiln_tensor *t, int dim, kiln_tensor *idx, const char *file, int line) {
  if (tensor_bad_arg(t, file, line, "index_select", "input 0") || tensor_bad_arg(idx, file, line, "index_select", "input 1"))
    return NULL;
  int d = axis_norm(dim, t->ndim);
  char b[SHAPE_BUF];
  if (d < 0 || t->ndim == 0)
    return err_set(file, line, "index_select", "dim %d is out of range for shape %s", dim, err_shape(b, t->ndim, t->shape));
  op_attrs a = {.dim = d};
  kiln_tensor *in[2] = {t, idx};
  return op_dispatch(OP_INDEX_SELECT, in, 2, &a, file, line);
}

/* ---- gather, scatter, index_copy, triangles, pad, cumsum ---- */

/* dim of t normalized, or -1 with the error set. */
static int dim_of(const char *op, const kiln_tensor *t, int dim, const char *file, int line) {
  int d = axis_norm(dim, t->ndim);
  char b[SHAPE_BUF];
  if (d < 0 || t->ndim == 0) return err_set(file, line, op, "dim %d is out of range for shape %s", dim, err_shape(b, t->ndim, t->shape)), -1;
  return d;
}

kiln_tensor *kiln_gather_at(kiln_tensor *x, int dim, kiln_tensor *idx, const char *file, int line) {
  if (tensor_bad_arg(x, file, line, "gather", "input 0") || tensor_bad_arg(idx, file, line, "gather", "index")) return NULL;
  int d = dim_of("gather", x, dim, file, line);
  if (d < 0) return NULL;
  kiln_tensor *in[2] = {x, idx};
  return op_dispatch(OP_GATHER, in, 2, &(op_attrs){.dim = d}, file, line);
}

/* scatter_add and index_copy: x, an index and a source along dim */
static kiln_tensor *scatter(op_id op, const char *name, kiln_tensor *x, int dim, kiln_tensor *idx, kiln_tensor *src,
                            const char *file, int line) {
  if (tensor_bad_arg(x, file, line, name, "input 0") || tensor_bad_arg(idx, file, line, name, "index") ||
      tensor_bad_arg(src, file, line, name, "source"))
    return NULL;
  int d = dim_of(name, x, dim, file, line);
  if (d < 0) return NULL;
  kiln_tensor *in[3] = {x, idx, src};
  return op_dispatch(op, in, 3, &(op_attrs){.dim = d}, file, line);
}

kiln_tensor *kiln_scatter_add_at(kiln_tensor *x, int dim, kiln_tensor *idx, kiln_tensor *src, const char *file, int line) {
  return scatter(OP_SCATTER_ADD, "scatter_add", x, dim, idx, src, file, line);
}

kiln_tensor *kiln_index_copy_at(kiln_tensor *x, int dim, kiln_tensor *idx, kiln_tensor *src, const char *file, int line) {
  return scatter(OP_INDEX_COPY, "index_copy", x, dim, idx, src, file, line);
}

/* In a recording, tril and triu are column minus row compared with k, k a
 * number of the graph: a diagonal that follows a length (a decode step's
 * causal mask, k = S - T) is then one variant, not a constant attribute
 * that makes a new one for every value. The same elements kept, the rest 0. */
static kiln_tensor *tri_recorded(op_id op, kiln_tensor *x, int64_t k, const char *file, int line) {
  int nd = x->ndim;
  int64_t rows = x->shape[nd - 2], cols = x->shape[nd - 1], lim = rows + cols;
  k = k > lim ? lim : k < -lim ? -lim : k; /* beyond, all kept or none: exact in a double */
  kiln_scope_begin();
  kiln_tensor *i = kiln_reshape_at(kiln_arange_at(KILN_I64, 0, (double)rows, 1, file, line), 2, (int64_t[]){rows, 1}, file, line);
  kiln_tensor *d = kiln_sub_at(kiln_arange_at(KILN_I64, 0, (double)cols, 1, file, line), i, file, line);
  kiln_tensor *kk = kiln_scalar_at(KILN_I64, (double)k, file, line);
  kiln_tensor *keep = op == OP_TRIL ? kiln_le_at(d, kk, file, line) : kiln_ge_at(d, kk, file, line);
  kiln_tensor *r = kiln_keep(kiln_where_at(keep, x, kiln_zeros_at(x->dtype, 0, NULL, file, line), file, line));
  kiln_scope_end();
  return r;
}

static kiln_tensor *tri(op_id op, kiln_tensor *x, int64_t k, const char *file, int line) {
  const trace_hooks *h = dispatch_hooks();
  if (h && h->record && x && !tensor_check_live(x, "input 0", op_table[op].name, file, line) && x->ndim >= 2)
    return tri_recorded(op, x, k, file, line);
  return op_dispatch(op, &x, 1, &(op_attrs){.k = k}, file, line);
}

kiln_tensor *kiln_tril_at(kiln_tensor *x, int64_t k, const char *file, int line) { return tri(OP_TRIL, x, k, file, line); }

kiln_tensor *kiln_triu_at(kiln_tensor *x, int64_t k, const char *file, int line) { return tri(OP_TRIU, x, k, file, line); }

kiln_tensor *kiln_pad_at(kiln_tensor *x, int n, const int64_t *pads, double value, const char *file, int line) {
  if (tensor_bad_arg(x, file, line, "pad", "input 0")) return NULL;
  if (n < 0 || n > 2 * MAXD || (n && !pads)) return err_set(file, line, "pad", "bad pad list (%d widths)", n);
  op_attrs a = {.nints = n, .value = value};
  for (int i = 0; i < n; i++) a.ints[i] = pads[i]; /* the shape rule refuses widths past any size */
  return op_dispatch(OP_PAD, &x, 1, &a, file, line);
}

kiln_tensor *kiln_cumsum_at(kiln_tensor *x, int dim, const char *file, int line) {
  if (tensor_bad_arg(x, file, line, "cumsum", "input 0")) return NULL;
  int d = axis_norm(dim, x->ndim);
  char b[SHAPE_BUF];
  if (d < 0) return err_set(file, line, "cumsum", "dim %d is out of range for shape %s", dim, err_shape(b, x->ndim, x->shape));
  return op_dispatch(OP_CUMSUM, &x, 1, &(op_attrs){.dim = d}, file, line);
}

/* ---- topk, split, one_hot, repeat ---- */

int kiln_topk_at(kiln_tensor *x, int64_t k, int dim, bool largest, kiln_tensor **values, kiln_tensor **indices,
                 const char *file, int line) {
  if (values) *values = NULL;
  if (indices) *indices = NULL;
  if (tensor_bad_arg(x, file, line, "topk", "input 0")) return -1;
  if (!values && !indices) return err_set(file, line, "topk", "values and indices are both NULL"), -1;
  int d = axis_norm(dim, x->ndim);
  char b[SHAPE_BUF];
  if (d < 0) return err_set(file, line, "topk", "dim %d is out of range for shape %s", dim, err_shape(b, x->ndim, x->shape)), -1;
  kiln_scope_begin();
  kiln_tensor *idx = op_dispatch(OP_TOPK, &x, 1, &(op_attrs){.dim = d, .k = k, .flag = largest}, file, line), *v = NULL;
  /* the values are a gather of x at the indices, so that gradients flow to x */
  if (idx && values) v = x->ndim ? kiln_gather_at(x, d, idx, file, line) : kiln_contiguous_at(x, file, line);
  bool ok = idx && (!values || v);
  if (ok && indices) *indices = kiln_keep(idx);
  if (ok && values) *values = kiln_keep(v);
  kiln_scope_end();
  return ok ? 0 : -1;
}

int kiln_split_n_at(kiln_tensor *x, int64_t size, int dim, kiln_tensor **outs, int max_outs, const char *file, int line) {
  if (tensor_bad_arg(x, file, line, "split", "input 0")) return -1;
  char b[SHAPE_BUF];
  int d = axis_norm(dim, x->ndim);
  if (d < 0 || x->ndim == 0) return err_set(file, line, "split", "dim %d is out of range for shape %s", dim, err_shape(b, x->ndim, x->shape)), -1;
  if (size < 1) return err_set(file, line, "split", "piece size %" PRId64 " must be at least 1", size), -1;
  /* the count is a C number that depends on the size: a traced body must be
   * re-recorded when the size changes, as after a kiln_size */
  int64_t len = kiln_size(x, d), count = len / size + (len % size != 0);
  if (count > INT_MAX) return err_set(file, line, "split", "%" PRId64 " pieces are too many", count), -1;
  if (!outs) return (int)count;
  if (max_outs < count)
    return err_set(file, line, "split", "%s in pieces of %" PRId64 " along dim %d makes %" PRId64 " pieces, more than max_outs %d",
                   err_shape(b, x->ndim, x->shape), size, dim, count, max_outs), -1;
  for (int64_t i = 0; i < count; i++) {
    int64_t end = (i + 1) * size < len ? (i + 1) * size : len;
    if (!(outs[i] = kiln_slice_at(x, d, i * size, end, 1, file, line))) {
      for (int64_t j = 0; j < i; j++) outs[j] = NULL;
      return -1;
    }
  }
  return (int)count;
}

int kiln_split_at(kiln_tensor *x, int64_t size, int dim, kiln_tensor **outs, const char *file, int line) {
  return kiln_split_n_at(x, size, dim, outs, INT_MAX, file, line);
}

kiln_tensor *kiln_one_hot_at(kiln_tensor *idx, int64_t n, const char *file, int line) {
  if (tensor_bad_arg(idx, file, line, "one_hot", "input 0")) return NULL;
  char b[SHAPE_BUF];
  if (idx->dtype != KILN_I64) return err_set(file, line, "one_hot", "indices must be i64, got %s", kiln_dtype_name(idx->dtype));
  if (idx->ndim >= MAXD) return err_set(file, line, "one_hot", "indices %s have too many dims", err_shape(b, idx->ndim, idx->shape));
  if (n < -1) return err_set(file, line, "one_hot", "class count %" PRId64 " must be -1 or at least 0", n);
  int64_t count = shape_numel(idx->ndim, idx->shape);
  kiln_scope_begin();
  if (n == -1) {
    /* the count from the data: a value read (a traced body falls back to eager here) */
    if (count == 0) {
      kiln_scope_end();
      return err_set(file, line, "one_hot", "cannot infer the class count from empty indices");
    }
    n = (int64_t)kiln_item_at(kiln_max_axes_at(idx, NULL, 0, false, file, line), file, line) + 1;
  }
  /* the indices checked by an op: eagerly now, and in a compiled graph on every call's data */
  kiln_tensor *t = op_dispatch(OP_INDEX_CHECK, &idx, 1, &(op_attrs){.k = n}, file, line);
  kiln_tensor *classes = kiln_arange_at(KILN_I64, 0, (double)n, 1, file, line);
  kiln_tensor *y = kiln_keep(kiln_cast_at(kiln_eq_at(kiln_unsqueeze_at(t, -1, file, line), classes, file, line), KILN_I64, file, line));
  kiln_scope_end();
  return y;
}

kiln_tensor *kiln_repeat_at(kiln_tensor *x, int n, const int64_t *reps, const char *file, int line) {
  if (tensor_bad_arg(x, file, line, "repeat", "input 0")) return NULL;
  char b[SHAPE_BUF];
  if (n < x->ndim || n > MAXD || (n && !reps))
    return err_set(file, line, "repeat", "%d repeats for %s: at least one per dim, at most %d", n, err_shape(b, x->ndim, x->shape), MAXD);
  int64_t shape[MAXD], total = 1;
  bool empty = false;
  for (int i = 0; i < n; i++) {
    int j = i - (n - x->ndim);
    if (reps[i] < 0) return err_set(file, line, "repeat", "repeat %" PRId64 " of dim %d is negative", reps[i], i);
    shape[i] = j >= 0 ? x->shape[j] : 1;
    empty |= shape[i] == 0 || reps[i] == 0;
  }
  /* sizes and the element count checked here, or a view inside would refuse them under its own name */
  for (int i = 0; i < n; i++) {
    if (reps[i] && shape[i] > INT64_MAX / reps[i])
      return err_set(file, line, "repeat", "%s repeated %" PRId64 " times along dim %d is too large", err_shape(b, x->ndim, x->shape),
                     reps[i], i);
    if (!empty && total > INT64_MAX / 8 / (shape[i] * reps[i]))
      return err_set(file, line, "repeat", "%s repeated has too many elements", err_shape(b, x->ndim, x->shape));
    if (!empty) total *= shape[i] * reps[i];
  }
  if (n == MAXD && x->ndim == MAXD) {
    bool all_one = true;
    for (int i = 0; i < n; i++) all_one &= reps[i] == 1;
    if (!all_one) return err_set(file, line, "repeat", "inputs of rank %d are not supported", MAXD);
  }
  kiln_scope_begin();
  kiln_tensor *y = kiln_reshape_at(x, n, shape, file, line);
  /* dim by dim: (.., a, ..) -> (.., 1, a, ..) -> expanded (.., r, a, ..) -> (.., r*a, ..) */
  for (int i = 0; i < n && y; i++) {
    if (reps[i] == 1) continue;
    int64_t s1[MAXD], s2[MAXD];
    for (int j = 0, k = 0; j < n; j++) {
      if (j == i) s1[k++] = reps[i];
      s1[k++] = shape[j];
    }
    kiln_tensor *e = kiln_expand_at(kiln_unsqueeze_at(y, i, file, line), n + 1, s1, file, line);
    for (int j = 0; j < n; j++) s2[j] = j == i ? reps[i] * shape[i] : shape[j];
    shape[i] = s2[i];
    y = kiln_reshape_at(e, n, s2, file, line);
  }
  kiln_keep(y);
  kiln_scope_end();
  return y;
}
