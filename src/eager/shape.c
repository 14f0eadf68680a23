/* Shape and dtype rules of every primitive op, written once over dims that
 * are constants (eager) or symbolic expressions (the tracer). Where a rule
 * has to decide something about a dim (is it 1? are two dims equal?) it asks
 * the environment: eager compares constants, the tracer answers from bounds,
 * guards or the traced values and records the guard its answer needs.
 * Broadcasting follows NumPy: shapes align at the right, a size-1 dim
 * stretches, missing dims are 1. */
#include <inttypes.h>
#include <stdarg.h>
#include <string.h>

#include "eager/eager.h"

bool dtype_is_float(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_F64 || dt == KILN_F16 || dt == KILN_BF16; }

int axis_norm(int axis, int ndim) {
  int n = ndim > 0 ? ndim : 1; /* a 0-d tensor accepts axis 0 and -1 like a vector of one */
  if (axis < -n || axis >= n) return -1;
  return axis < 0 ? axis + n : axis;
}

static int category(kiln_dtype dt) { return dt == KILN_BOOL ? 0 : dtype_is_float(dt) ? 2 : 1; }
/* [bool, i32, i64, f16 and bf16, f32, f64]: f16 and bf16 share a rank, and meet at f32 */
static int rank(kiln_dtype dt) {
  static const int r[] = {[KILN_BOOL] = 0, [KILN_I32] = 1, [KILN_I64] = 2, [KILN_F16] = 3, [KILN_BF16] = 3,
                          [KILN_F32] = 4, [KILN_F64] = 5};
  return r[dt];
}

/* The result type of a binary op, torch's: bool < i32 < i64 < f16, bf16 < f32
 * < f64, and f16 with bf16 is f32. A 0-d operand does not widen a tensor of
 * its own category (f32 tensor * f64 scalar stays f32, bf16 tensor * f32
 * scalar stays bf16, i32 tensor + i64 scalar stays i32). */
kiln_dtype dtype_promote(const kiln_tensor *a, const kiln_tensor *b) {
  kiln_dtype x = a->dtype, y = b->dtype;
  if (x == y || !dtype_valid(x) || !dtype_valid(y)) return x;
  if ((a->ndim == 0) != (b->ndim == 0)) {
    const kiln_tensor *big = a->ndim == 0 ? b : a, *small = a->ndim == 0 ? a : b;
    if (category(small->dtype) <= category(big->dtype)) return big->dtype;
  }
  if (rank(x) == rank(y)) return KILN_F32; /* f16 with bf16 */
  return rank(x) > rank(y) ? x : y;
}

/* ---- helpers ---- */

static int fail(char *err, size_t errn, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t errn, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errn, fmt, ap);
  va_end(ap);
  return -1;
}

/* "[2,s0]" into buf. */
static const char *dims_text(int nd, const sym_dim *d, char *buf, size_t n) {
  size_t k = (size_t)snprintf(buf, n, "[");
  for (int i = 0; i < nd && k < n; i++) {
    if (i) k += (size_t)snprintf(buf + k, n - k, ",");
    if (k >= n) break;
    int w = sym_print(d[i], buf + k, n - k);
    if (w < 0) w = snprintf(buf + k, n - k, "?");
    k += (size_t)w;
  }
  if (k < n) snprintf(buf + k, n - k, "]");
  return buf;
}
#define TXT(arg, buf) dims_text((arg)->ndim, (arg)->shape, buf, sizeof buf)

static int decide(dim_env *env, sym_dim a, sym_cmp op, sym_dim b) {
  if (sym_is_err(a) || sym_is_err(b)) return -1;
  bool res, needs;
  if (sym_decide(a, op, b, NULL, 0, &res, &needs) == 0 && !needs) return res;
  return env->decide ? env->decide(env, a, op, b) : -1;
}
static bool is_true(dim_env *env, sym_dim a, sym_cmp op, sym_dim b) { return decide(env, a, op, b) == 1; }

/* One pair of dims broadcast: a when they agree or b is 1, b when a is 1. */
static int bcast_dim(dim_env *env, sym_dim a, sym_dim b, sym_dim *out) {
  if (sym_same(a, b)) return *out = a, 0;
  if (sym_is_const(b) && b.c == 1) return *out = a, 0;
  if (sym_is_const(a) && a.c == 1) return *out = b, 0;
  /* equal sizes first: one guard a == b serves every size, 1 included */
  int r = decide(env, a, SYM_EQ, b);
  if (r < 0) return -1;
  if (r) return *out = sym_is_const(b) ? b : a, 0;
  r = decide(env, a, SYM_EQ, sym_const(1));
  if (r < 0) return -1;
  if (r) return *out = b, 0;
  r = decide(env, b, SYM_EQ, sym_const(1));
  if (r < 0) return -1;
  if (r) return *out = a, 0;
  return -1;
}

/* -1 - (the result dim that fails) on failure, else 0. */
static int bcast(dim_env *env, int na, const sym_dim *sa, int nb, const sym_dim *sb, int *nout, sym_dim *out) {
  int n = na > nb ? na : nb;
  for (int i = 0; i < n; i++) {
    int ia = i - (n - na), ib = i - (n - nb);
    sym_dim da = ia >= 0 ? sa[ia] : sym_const(1), db = ib >= 0 ? sb[ib] : sym_const(1);
    if (bcast_dim(env, da, db, &out[i])) return -1 - i;
  }
  *nout = n;
  return 0;
}

int shape_broadcast(int na, const int64_t *sa, int nb, const int64_t *sb, int *nout, int64_t *out) {
  int n = na > nb ? na : nb;
  for (int i = 0; i < n; i++) {
    int ia = i - (n - na), ib = i - (n - nb);
    int64_t da = ia >= 0 ? sa[ia] : 1, db = ib >= 0 ? sb[ib] : 1;
    if (da != db && da != 1 && db != 1) return -1 - i;
    out[i] = da == 1 ? db : da;
  }
  *nout = n;
  return 0;
}

static sym_dim numel_of(dim_env *env, int nd, const sym_dim *d) {
  sym_dim p = sym_const(1);
  for (int i = 0; i < nd; i++) p = sym_mul(env->sym, p, d[i]);
  return p;
}

static void copy_shape(shape_arg *out, const shape_arg *x) {
  out->ndim = x->ndim;
  memcpy(out->shape, x->shape, sizeof(sym_dim) * (size_t)x->ndim);
}

/* The length of [start, end) by step. */
static sym_dim span(dim_env *env, sym_dim start, sym_dim end, int64_t step) {
  if (sym_is_const(start) && sym_is_const(end)) /* so that a huge step cannot overflow */
    return sym_const(end.c > start.c ? 1 + (end.c - start.c - 1) / step : 0);
  sym_dim len = sym_sub(env->sym, end, start);
  if (step > 1) len = sym_floordiv(env->sym, sym_add(env->sym, len, sym_const(step - 1)), sym_const(step));
  return len;
}

/* ---- the rules named in ops.def ---- */

int sh_pointwise(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
                 size_t errn) {
  (void)op, (void)a;
  char b0[160], b1[160];
  copy_shape(out, &in[0]);
  if (n == 2) {
    int r = bcast(env, in[0].ndim, in[0].shape, in[1].ndim, in[1].shape, &out->ndim, out->shape);
    if (r) return fail(err, errn, "shapes %s and %s do not broadcast (dim %d of the result)", TXT(&in[0], b0), TXT(&in[1], b1), -1 - r);
  }
  return 0;
}

int sh_where(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
             size_t errn) {
  (void)op, (void)n, (void)a;
  char b0[160], b1[160], b2[160];
  if (in[0].dtype != KILN_BOOL) return fail(err, errn, "condition must be bool, got %s", kiln_dtype_name(in[0].dtype));
  int nt;
  sym_dim t[MAXD];
  if (bcast(env, in[0].ndim, in[0].shape, in[1].ndim, in[1].shape, &nt, t) ||
      bcast(env, nt, t, in[2].ndim, in[2].shape, &out->ndim, out->shape))
    return fail(err, errn, "shapes %s, %s and %s do not broadcast", TXT(&in[0], b0), TXT(&in[1], b1), TXT(&in[2], b2));
  return 0;
}

int sh_reduce(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
              size_t errn) {
  (void)n;
  char b0[160];
  const shape_arg *x = &in[0];
  if (a->naxes < 0 || a->naxes > x->ndim + (x->ndim == 0)) return fail(err, errn, "%d axes for rank %d", a->naxes, x->ndim);
  for (int j = 0; j < a->naxes; j++)
    if (a->axes[j] < 0 || (a->axes[j] >= x->ndim && x->ndim > 0) || (j && a->axes[j] <= a->axes[j - 1]))
      return fail(err, errn, "axes must be sorted and within rank %d", x->ndim);
  bool nonempty = op == OP_MAX || op == OP_MIN || op == OP_ARGMAX || op == OP_ARGMIN;
  int k = 0;
  for (int i = 0, j = 0; i < x->ndim; i++) {
    if (j < a->naxes && a->axes[j] == i) {
      j++;
      if (nonempty && !is_true(env, x->shape[i], SYM_GE, sym_const(1)))
        return fail(err, errn, "cannot reduce dim %d of %s: it has size 0", i, TXT(x, b0));
      if (a->keepdim) out->shape[k++] = sym_const(1);
    } else {
      out->shape[k++] = x->shape[i];
    }
  }
  out->ndim = k;
  return 0;
}

int sh_matmul(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
              size_t errn) {
  (void)op, (void)n, (void)a;
  char b0[160], b1[160];
  const shape_arg *x = &in[0], *y = &in[1];
  if (x->ndim == 0 || y->ndim == 0)
    return fail(err, errn, "operands must have at least one dim, got %s and %s", TXT(x, b0), TXT(y, b1));
  sym_dim k1 = x->shape[x->ndim - 1], k2 = y->ndim == 1 ? y->shape[0] : y->shape[y->ndim - 2];
  if (!is_true(env, k1, SYM_EQ, k2)) {
    char c1[64], c2[64];
    if (sym_print(k1, c1, sizeof c1) < 0) snprintf(c1, sizeof c1, "?");
    if (sym_print(k2, c2, sizeof c2) < 0) snprintf(c2, sizeof c2, "?");
    return fail(err, errn, "shapes %s and %s do not match (%s != %s)", TXT(x, b0), TXT(y, b1), c1, c2);
  }
  int nb;
  sym_dim bs[MAXD];
  int xb = x->ndim > 2 ? x->ndim - 2 : 0, yb = y->ndim > 2 ? y->ndim - 2 : 0;
  if (bcast(env, xb, x->shape, yb, y->shape, &nb, bs))
    return fail(err, errn, "batch dims of %s and %s do not broadcast", TXT(x, b0), TXT(y, b1));
  int k = 0;
  for (int i = 0; i < nb; i++) out->shape[k++] = bs[i];
  if (x->ndim >= 2) out->shape[k++] = x->shape[x->ndim - 2];
  if (y->ndim >= 2) out->shape[k++] = y->shape[y->ndim - 1];
  out->ndim = k;
  return 0;
}

int sh_reshape(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
               size_t errn) {
  (void)op, (void)n;
  char b0[160], b1[160];
  if (a->ndim < 0 || a->ndim > MAXD) return fail(err, errn, "rank %d is outside 0..%d", a->ndim, MAXD);
  sym_dim p = numel_of(env, in[0].ndim, in[0].shape), q = numel_of(env, a->ndim, a->shape);
  if (!is_true(env, p, SYM_EQ, q))
    return fail(err, errn, "cannot reshape %s to %s", TXT(&in[0], b0), dims_text(a->ndim, a->shape, b1, sizeof b1));
  out->ndim = a->ndim;
  memcpy(out->shape, a->shape, sizeof(sym_dim) * (size_t)a->ndim);
  return 0;
}

int sh_permute(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
               size_t errn) {
  (void)env, (void)op, (void)n;
  char b0[160];
  bool seen[MAXD] = {0};
  for (int i = 0; i < in[0].ndim; i++) {
    int p = a->perm[i];
    if (p < 0 || p >= in[0].ndim || seen[p]) return fail(err, errn, "not a permutation of the dims of %s", TXT(&in[0], b0));
    seen[p] = true;
    out->shape[i] = in[0].shape[p];
  }
  out->ndim = in[0].ndim;
  return 0;
}

int sh_expand(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
              size_t errn) {
  (void)op, (void)n;
  char b0[160], b1[160];
  const shape_arg *x = &in[0];
  if (a->ndim < x->ndim || a->ndim > MAXD) return fail(err, errn, "cannot expand %s to rank %d", TXT(x, b0), a->ndim);
  for (int i = 0; i < a->ndim; i++) {
    int j = i - (a->ndim - x->ndim);
    if (j >= 0 && !sym_same(x->shape[j], a->shape[i]) && !is_true(env, x->shape[j], SYM_EQ, sym_const(1)) &&
        !is_true(env, x->shape[j], SYM_EQ, a->shape[i]))
      return fail(err, errn, "cannot expand %s to %s", TXT(x, b0), dims_text(a->ndim, a->shape, b1, sizeof b1));
    out->shape[i] = a->shape[i];
  }
  out->ndim = a->ndim;
  return 0;
}

/* 0 <= start <= end <= size, step >= 1. */
static int bounds_ok(dim_env *env, const op_attrs *a, sym_dim size) {
  return a->step >= 1 && is_true(env, a->start, SYM_GE, sym_const(0)) && is_true(env, a->start, SYM_LE, a->end) &&
         is_true(env, a->end, SYM_LE, size);
}

int sh_slice(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
             size_t errn) {
  (void)op, (void)n;
  char b0[160];
  const shape_arg *x = &in[0];
  if (a->dim < 0 || a->dim >= x->ndim) return fail(err, errn, "dim %d is out of range for %s", a->dim, TXT(x, b0));
  if (!bounds_ok(env, a, x->shape[a->dim]))
    return fail(err, errn, "bounds do not satisfy 0 <= start <= end <= size of dim %d of %s (step %lld >= 1)", a->dim,
                TXT(x, b0), (long long)a->step);
  copy_shape(out, x);
  out->shape[a->dim] = span(env, a->start, a->end, a->step);
  if (sym_is_err(out->shape[a->dim])) return fail(err, errn, "the slice's length overflows");
  return 0;
}

int sh_cat(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
           size_t errn) {
  (void)op;
  char b0[160], b1[160];
  const shape_arg *x = &in[0];
  int d = a->dim;
  if (d < 0 || d >= x->ndim) return fail(err, errn, "dim %d is out of range for %s", d, TXT(x, b0));
  copy_shape(out, x);
  sym_dim sum = sym_const(0);
  for (int i = 0; i < n; i++) {
    const shape_arg *t = &in[i];
    bool ok = t->ndim == x->ndim && t->dtype == x->dtype;
    for (int j = 0; ok && j < x->ndim; j++) ok = j == d || is_true(env, t->shape[j], SYM_EQ, x->shape[j]);
    if (!ok)
      return fail(err, errn, "input %d (%s%s) does not match input 0 (%s%s) outside dim %d", i, kiln_dtype_name(t->dtype),
                  TXT(t, b0), kiln_dtype_name(x->dtype), TXT(x, b1), d);
    sum = sym_add(env->sym, sum, t->shape[d]);
  }
  if (sym_is_err(sum)) return fail(err, errn, "the sizes along dim %d overflow", d);
  out->shape[d] = sum;
  return 0;
}

static int index_arg(const shape_arg *idx, char *err, size_t errn) {
  if (idx->dtype != KILN_I64 || idx->ndim != 1)
    return fail(err, errn, "indices must be a 1-D i64 tensor, got %s of rank %d", kiln_dtype_name(idx->dtype), idx->ndim);
  return 0;
}

int sh_index_select(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
                    size_t errn) {
  (void)env, (void)op, (void)n;
  char b0[160];
  if (a->dim < 0 || a->dim >= in[0].ndim) return fail(err, errn, "dim %d is out of range for %s", a->dim, TXT(&in[0], b0));
  if (index_arg(&in[1], err, errn)) return -1;
  copy_shape(out, &in[0]);
  out->shape[a->dim] = in[1].shape[0];
  return 0;
}

/* src must have x's shape with dim a->dim of size len. */
static int fits(dim_env *env, const shape_arg *x, const shape_arg *src, int dim, sym_dim len, char *err, size_t errn) {
  char b0[160], b1[160];
  shape_arg want = *x;
  want.shape[dim] = len;
  bool ok = src->ndim == x->ndim && src->dtype == x->dtype;
  for (int j = 0; ok && j < x->ndim; j++) ok = is_true(env, src->shape[j], SYM_EQ, want.shape[j]);
  if (!ok)
    return fail(err, errn, "source %s%s does not fit %s", kiln_dtype_name(src->dtype), TXT(src, b0), TXT(&want, b1));
  return 0;
}

int sh_index_add(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
                 size_t errn) {
  (void)op, (void)n;
  char b0[160];
  if (a->dim < 0 || a->dim >= in[0].ndim) return fail(err, errn, "dim %d is out of range for %s", a->dim, TXT(&in[0], b0));
  if (index_arg(&in[1], err, errn) || fits(env, &in[0], &in[2], a->dim, in[1].shape[0], err, errn)) return -1;
  copy_shape(out, &in[0]);
  return 0;
}

int sh_slice_scatter(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
                     size_t errn) {
  (void)op, (void)n;
  char b0[160];
  if (a->dim < 0 || a->dim >= in[0].ndim) return fail(err, errn, "dim %d is out of range for %s", a->dim, TXT(&in[0], b0));
  if (!bounds_ok(env, a, in[0].shape[a->dim]))
    return fail(err, errn, "bounds do not satisfy 0 <= start <= end <= size of dim %d of %s (step %lld >= 1)", a->dim,
                TXT(&in[0], b0), (long long)a->step);
  if (fits(env, &in[0], &in[1], a->dim, span(env, a->start, a->end, a->step), err, errn)) return -1;
  copy_shape(out, &in[0]);
  return 0;
}

/* gather: out has the index's shape; the index (i64, x's rank) may be
 * shorter than x in every dim but dim. */
static int gather_index(dim_env *env, const shape_arg *x, const shape_arg *idx, int dim, char *err, size_t errn) {
  char b0[160], b1[160];
  if (dim < 0 || dim >= x->ndim) return fail(err, errn, "dim %d is out of range for %s", dim, TXT(x, b0));
  if (idx->dtype != KILN_I64 || idx->ndim != x->ndim)
    return fail(err, errn, "index must be i64 of rank %d, got %s%s", x->ndim, kiln_dtype_name(idx->dtype), TXT(idx, b0));
  for (int d = 0; d < x->ndim; d++)
    if (d != dim && !is_true(env, idx->shape[d], SYM_LE, x->shape[d]))
      return fail(err, errn, "index %s is larger than %s in dim %d", TXT(idx, b0), TXT(x, b1), d);
  return 0;
}

int sh_gather(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
              size_t errn) {
  (void)op, (void)n;
  if (gather_index(env, &in[0], &in[1], a->dim, err, errn)) return -1;
  copy_shape(out, &in[1]);
  return 0;
}

int sh_scatter_add(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
                   size_t errn) {
  (void)op, (void)n;
  char b0[160], b1[160];
  if (gather_index(env, &in[0], &in[1], a->dim, err, errn)) return -1;
  bool ok = in[2].dtype == in[0].dtype && in[2].ndim == in[1].ndim;
  for (int d = 0; ok && d < in[1].ndim; d++) ok = is_true(env, in[2].shape[d], SYM_EQ, in[1].shape[d]);
  if (!ok)
    return fail(err, errn, "source %s%s must have the index's shape %s and the input's dtype %s", kiln_dtype_name(in[2].dtype),
                TXT(&in[2], b0), TXT(&in[1], b1), kiln_dtype_name(in[0].dtype));
  copy_shape(out, &in[0]);
  return 0;
}

int sh_tri(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err, size_t errn) {
  (void)env, (void)op, (void)n, (void)a;
  char b0[160];
  if (in[0].ndim < 2) return fail(err, errn, "input %s must have at least 2 dims", TXT(&in[0], b0));
  copy_shape(out, &in[0]);
  return 0;
}

/* attention(q (...,T,D), k (...,S,D), v (...,S,E)[, mask]) -> (...,T,E): q, k
 * and v of one float dtype and rank with equal batch dims; a mask bool or of
 * their dtype that broadcasts to (...,T,S) (attention.c). */
int sh_attention(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
                 size_t errn) {
  (void)op, (void)a;
  char b0[160], b1[160], b2[160];
  if (n != 3 && n != 4) return fail(err, errn, "takes q, k, v and an optional mask, got %d inputs", n);
  const shape_arg *q = &in[0], *k = &in[1], *v = &in[2];
  int nd = q->ndim;
  if (k->dtype != q->dtype || v->dtype != q->dtype)
    return fail(err, errn, "q, k and v must have one dtype, got %s, %s and %s", kiln_dtype_name(q->dtype),
                kiln_dtype_name(k->dtype), kiln_dtype_name(v->dtype));
  bool ok = nd >= 2 && k->ndim == nd && v->ndim == nd && is_true(env, k->shape[nd - 1], SYM_EQ, q->shape[nd - 1]) &&
            is_true(env, v->shape[nd - 2], SYM_EQ, k->shape[nd - 2]);
  for (int d = 0; ok && d < nd - 2; d++)
    ok = is_true(env, k->shape[d], SYM_EQ, q->shape[d]) && is_true(env, v->shape[d], SYM_EQ, q->shape[d]);
  if (!ok)
    return fail(err, errn, "q %s, k %s and v %s are not (...,T,D), (...,S,D) and (...,S,E)", TXT(q, b0), TXT(k, b1),
                TXT(v, b2));
  copy_shape(out, q);
  out->shape[nd - 1] = v->shape[nd - 1];
  if (n == 4) {
    const shape_arg *m = &in[3];
    if (m->dtype != KILN_BOOL && m->dtype != q->dtype)
      return fail(err, errn, "mask must be bool or %s, got %s", kiln_dtype_name(q->dtype), kiln_dtype_name(m->dtype));
    shape_arg sc = *out;
    sc.shape[nd - 1] = k->shape[nd - 2];
    int nt;
    sym_dim t[MAXD];
    bool fits = m->ndim <= nd && bcast(env, m->ndim, m->shape, nd, sc.shape, &nt, t) == 0;
    for (int d = 0; fits && d < nd; d++) fits = is_true(env, t[d], SYM_EQ, sc.shape[d]);
    if (!fits) return fail(err, errn, "mask %s does not broadcast to the scores %s", TXT(m, b0), TXT(&sc, b1));
  }
  return 0;
}

/* attention_grad(q, k, v, o, do[, mask]) -> (numel(q) + numel(k) + numel(v)): q, k, v and the
 * mask as attention takes them, o and do attention's result shape and q's dtype. */
int sh_attention_grad(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out,
                      char *err, size_t errn) {
  char b0[160], b1[160];
  if (n != 5 && n != 6) return fail(err, errn, "takes q, k, v, o, do and an optional mask, got %d inputs", n);
  shape_arg qkvm[4] = {in[0], in[1], in[2], n == 6 ? in[5] : in[0]}, y;
  if (sh_attention(env, op, qkvm, n == 6 ? 4 : 3, a, &y, err, errn)) return -1;
  for (int i = 3; i < 5; i++) {
    bool ok = in[i].dtype == in[0].dtype && in[i].ndim == y.ndim;
    for (int d = 0; ok && d < y.ndim; d++) ok = is_true(env, in[i].shape[d], SYM_EQ, y.shape[d]);
    if (!ok)
      return fail(err, errn, "%s %s must be attention's result %s of %s", i == 3 ? "o" : "do", TXT(&in[i], b0),
                  TXT(&y, b1), kiln_dtype_name(in[0].dtype));
  }
  out->ndim = 1;
  out->shape[0] = sym_const(0);
  for (int i = 0; i < 3; i++) out->shape[0] = sym_add(env->sym, out->shape[0], numel_of(env, in[i].ndim, in[i].shape));
  return 0;
}

int sh_pad(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err, size_t errn) {
  (void)op, (void)n;
  char b0[160];
  if (a->nints % 2 || a->nints > 2 * in[0].ndim)
    return fail(err, errn, "%d pad widths for %s: an even number, at most two per dim", a->nints, TXT(&in[0], b0));
  for (int i = 0; i < a->nints; i++) /* a loaded graph's widths too: their sum must not overflow */
    if (a->ints[i] < -(INT64_C(1) << 48) || a->ints[i] > (INT64_C(1) << 48))
      return fail(err, errn, "pad width %lld is out of range", (long long)a->ints[i]);
  copy_shape(out, &in[0]);
  for (int i = 0; i < a->nints / 2; i++) {
    int d = in[0].ndim - 1 - i;
    sym_dim s = sym_add(env->sym, in[0].shape[d], sym_const(a->ints[2 * i] + a->ints[2 * i + 1]));
    if (sym_is_err(s) || !is_true(env, s, SYM_GE, sym_const(0)))
      return fail(err, errn, "pads (%lld, %lld) of dim %d leave a negative size of %s", (long long)a->ints[2 * i],
                  (long long)a->ints[2 * i + 1], d, TXT(&in[0], b0));
    out->shape[d] = s;
  }
  return 0;
}

int sh_along(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
             size_t errn) {
  (void)env, (void)op, (void)n;
  char b0[160];
  if (a->dim < 0 || a->dim >= (in[0].ndim ? in[0].ndim : 1)) return fail(err, errn, "dim %d is out of range for %s", a->dim, TXT(&in[0], b0));
  copy_shape(out, &in[0]);
  return 0;
}

int sh_topk(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
            size_t errn) {
  (void)op, (void)n;
  char b0[160];
  if (a->dim < 0 || a->dim >= (in[0].ndim ? in[0].ndim : 1)) return fail(err, errn, "dim %d is out of range for %s", a->dim, TXT(&in[0], b0));
  sym_dim len = in[0].ndim ? in[0].shape[a->dim] : sym_const(1);
  if (a->k < 0 || !is_true(env, sym_const(a->k), SYM_LE, len))
    return fail(err, errn, "k %lld is outside [0, %s] (dim %d of %s)", (long long)a->k, dims_text(1, &len, (char[32]){0}, 32),
                a->dim, TXT(&in[0], b0));
  copy_shape(out, &in[0]);
  if (in[0].ndim) out->shape[a->dim] = sym_const(a->k);
  return 0;
}

/* ---- the whole rule: dtype, then shape ---- */

static const char *const in_text[] = {"any dtype", "numbers only; cast bool first", "floats only; cast first"};

/* The arity and dtype rule: the result's dtype, or -1 with the message. The
 * input dtypes are read through get (shape args or tensors). */
typedef kiln_dtype (*dtype_of)(const void *in, int i);
static int dtype_infer(op_id op, const void *in, dtype_of get, int n, const op_attrs *a, kiln_dtype *out, char *err,
                       size_t errn) {
  const op_info *oi = &op_table[op];
  if (oi->arity >= 0 ? n != oi->arity : n < 1)
    return fail(err, errn, "takes %s%d input%s, got %d", oi->arity < 0 ? "at least " : "", oi->arity < 0 ? 1 : oi->arity,
                oi->arity == 1 || oi->arity < 0 ? "" : "s", n);
  const dtype_rule *r = &oi->dt;
  int f = r->first < n ? r->first : 0;
  kiln_dtype dt = get(in, f);
  if (!dtype_valid(dt)) return fail(err, errn, "unknown dtype %d", (int)dt);
  bool ok = r->in == DT_IN_ANY || (r->in == DT_IN_NUM && dt != KILN_BOOL) || (r->in == DT_IN_FLOAT && dtype_is_float(dt));
  if (!ok) return fail(err, errn, "dtype %s is not supported (%s)", kiln_dtype_name(dt), in_text[r->in]);
  for (int i = f + 1; r->promote && i < n; i++)
    if (get(in, i) != dt)
      return fail(err, errn, "dtypes %s and %s differ (inputs are cast to one dtype first)", kiln_dtype_name(dt),
                  kiln_dtype_name(get(in, i)));
  switch (r->out) {
  case DT_OUT_SAME: *out = dt; break;
  case DT_OUT_BOOL: *out = KILN_BOOL; break;
  case DT_OUT_I64: *out = KILN_I64; break;
  case DT_OUT_ATTR:
    if (!dtype_valid(a->dtype)) return fail(err, errn, "unknown dtype %d", (int)a->dtype);
    *out = a->dtype;
    break;
  }
  return 0;
}

static kiln_dtype arg_dtype(const void *in, int i) { return ((const shape_arg *)in)[i].dtype; }
static kiln_dtype tensor_dtype(const void *in, int i) { return ((kiln_tensor *const *)in)[i]->dtype; }

int shape_infer(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
                size_t errn) {
  if (dtype_infer(op, in, arg_dtype, n, a, &out->dtype, err, errn)) return -1;
  for (int i = 0; i < n; i++)
    if (in[i].ndim < 0 || in[i].ndim > MAXD) return fail(err, errn, "input %d has rank %d", i, in[i].ndim);
  return op_table[op].shape(env, op, in, n, a, out, err, errn);
}

/* Eager's environment: every dim is a constant, which decide() settles itself. */
static dim_env eager_env = {NULL, NULL};

int shape_rule(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_dtype *dt, int *ndim, int64_t *shape,
               const char *file, int line) {
  return shape_rule_as(op, op_table[op].name, in, n, a, dt, ndim, shape, file, line);
}

/* The rules of the commonest ops (pointwise, matmul, permute, reduce,
 * reshape, expand, slice) over int64 dims, for eager and recorded ops, whose dims are constants: 0 with
 * the result, or 1 where the symbolic rule must answer (it also words a
 * failure). Each gives what its symbolic rule gives over constants
 * (test_sym's shape_rule_const checks them against it). */
static int const_rule(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_dtype *dt, int *ndim,
                      int64_t *shape) {
  shape_fn rule = op_table[op].shape;
  if ((rule != sh_pointwise && rule != sh_matmul && rule != sh_permute && rule != sh_reduce && rule != sh_reshape &&
       rule != sh_expand && rule != sh_slice) ||
      n < 1)
    return 1;
  char e[8];
  if (dtype_infer(op, in, tensor_dtype, n, a, dt, e, sizeof e)) return 1;
  const kiln_tensor *x = in[0];
  for (int i = 0; i < n; i++)
    if (in[i]->ndim < 0 || in[i]->ndim > MAXD) return 1;
  if (rule == sh_pointwise) {
    if (n > 2) return 1;
    return shape_broadcast(x->ndim, x->shape, in[n - 1]->ndim, in[n - 1]->shape, ndim, shape) ? 1 : 0;
  }
  if (rule == sh_matmul) {
    const kiln_tensor *y = in[1];
    if (x->ndim == 0 || y->ndim == 0) return 1;
    if (x->shape[x->ndim - 1] != (y->ndim == 1 ? y->shape[0] : y->shape[y->ndim - 2])) return 1;
    int xb = x->ndim > 2 ? x->ndim - 2 : 0, yb = y->ndim > 2 ? y->ndim - 2 : 0, k;
    if (shape_broadcast(xb, x->shape, yb, y->shape, &k, shape)) return 1;
    if (x->ndim >= 2) shape[k++] = x->shape[x->ndim - 2];
    if (y->ndim >= 2) shape[k++] = y->shape[y->ndim - 1];
    *ndim = k;
    return 0;
  }
  if (rule == sh_permute) {
    bool seen[MAXD] = {0};
    for (int i = 0; i < x->ndim; i++) {
      int p = a->perm[i];
      if (p < 0 || p >= x->ndim || seen[p]) return 1;
      seen[p] = true;
      shape[i] = x->shape[p];
    }
    *ndim = x->ndim;
    return 0;
  }
  if (rule == sh_reduce) {
    if (a->naxes < 0 || a->naxes > x->ndim + (x->ndim == 0)) return 1;
    for (int j = 0; j < a->naxes; j++)
      if (a->axes[j] < 0 || (a->axes[j] >= x->ndim && x->ndim > 0) || (j && a->axes[j] <= a->axes[j - 1])) return 1;
    bool nonempty = op == OP_MAX || op == OP_MIN || op == OP_ARGMAX || op == OP_ARGMIN;
    int k = 0;
    for (int i = 0, j = 0; i < x->ndim; i++) {
      if (j < a->naxes && a->axes[j] == i) {
        j++;
        if (nonempty && x->shape[i] < 1) return 1;
        if (a->keepdim) shape[k++] = 1;
      } else {
        shape[k++] = x->shape[i];
      }
    }
    *ndim = k;
    return 0;
  }
  if (rule == sh_reshape) {
    if (a->ndim < 0 || a->ndim > MAXD) return 1;
    int64_t p = 1, q = 1;
    for (int i = 0; i < x->ndim; i++)
      if (__builtin_mul_overflow(p, x->shape[i], &p)) return 1;
    for (int i = 0; i < a->ndim; i++)
      if (!sym_is_const(a->shape[i]) || __builtin_mul_overflow(q, a->shape[i].c, &q)) return 1;
    if (p != q) return 1;
    for (int i = 0; i < a->ndim; i++) shape[i] = a->shape[i].c;
    *ndim = a->ndim;
    return 0;
  }
  if (rule == sh_expand) {
    if (a->ndim < x->ndim || a->ndim > MAXD) return 1;
    for (int i = 0; i < a->ndim; i++) {
      if (!sym_is_const(a->shape[i])) return 1;
      int j = i - (a->ndim - x->ndim);
      if (j >= 0 && x->shape[j] != a->shape[i].c && x->shape[j] != 1) return 1;
      shape[i] = a->shape[i].c;
    }
    *ndim = a->ndim;
    return 0;
  }
  if (rule == sh_slice) {
    if (a->dim < 0 || a->dim >= x->ndim || !sym_is_const(a->start) || !sym_is_const(a->end)) return 1;
    int64_t start = a->start.c, end = a->end.c;
    if (a->step < 1 || start < 0 || start > end || end > x->shape[a->dim]) return 1;
    for (int i = 0; i < x->ndim; i++) shape[i] = x->shape[i];
    shape[a->dim] = end > start ? 1 + (end - start - 1) / a->step : 0;
    *ndim = x->ndim;
    return 0;
  }
  return 1;
}

int shape_rule_as(op_id op, const char *name, kiln_tensor *const *in, int n, const op_attrs *a, kiln_dtype *dt, int *ndim,
                  int64_t *shape, const char *file, int line) {
  /* the commonest ops over constant dims (every eager op and every recorded
   * one) need no symbolic dims; a failure takes the general rule below for
   * its message */
  if (!const_rule(op, in, n, a, dt, ndim, shape)) return 0;
  shape_arg small[4] = {0}, *args = n <= 4 ? small : alloc_malloc(sizeof *args * (size_t)n), out = {0};
  if (!args) return err_set(file, line, name, "out of memory"), -1;
  for (int i = 0; i < n; i++) {
    args[i].dtype = in[i]->dtype;
    args[i].ndim = in[i]->ndim;
    for (int d = 0; d < in[i]->ndim && d < MAXD; d++) args[i].shape[d] = sym_const(in[i]->shape[d]);
  }
  char err[512];
  int rc = shape_infer(&eager_env, op, args, n, a, &out, err, sizeof err);
  if (args != small) alloc_free(args);
  if (rc) return err_set(file, line, name, "%s", err), -1;
  *dt = out.dtype;
  *ndim = out.ndim;
  for (int d = 0; d < out.ndim; d++) shape[d] = out.shape[d].c;
  return 0;
}

/* ---- value checks ---- */

int chk_indices(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line) {
  (void)n;
  const kiln_tensor *idx = in[1];
  int64_t bound = in[0]->shape[a->dim];
  for (int64_t i = 0; i < idx->shape[0]; i++) {
    int64_t v = ((const int64_t *)idx->st->data)[idx->offset + i * idx->stride[0]];
    if (v < 0 || v >= bound)
      return err_set(file, line, op_table[op].name,
                     "index %" PRId64 " at position %" PRId64 " is out of range [0, %" PRId64 ")", v, i, bound),
             -1;
  }
  return 0;
}

int chk_gather(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line) {
  (void)n;
  const kiln_tensor *idx = in[1];
  int64_t bound = in[0]->shape[a->dim];
  for (int64_t i = 0, k = shape_numel(idx->ndim, idx->shape); i < k; i++) {
    double v = tensor_get(idx, i); /* compared as a double: near 2^63 the cast itself would overflow */
    if (v < 0 || v >= (double)bound)
      return err_set(file, line, op_table[op].name, "index %.0f at position %" PRId64 " is out of range [0, %" PRId64 ")", v, i,
                     bound),
             -1;
  }
  return 0;
}

/* index_check: cross entropy's targets (flag) or one_hot's indices, in
 * [0, k), eagerly and in compiled code alike */
int chk_index_range(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line) {
  (void)op, (void)n;
  const kiln_tensor *idx = in[0];
  const char *name = a->flag ? "cross_entropy" : "one_hot";
  if (idx->dtype != KILN_I64) return err_set(file, line, name, "indices must be i64, got %s", kiln_dtype_name(idx->dtype)), -1;
  for (int64_t i = 0, k = shape_numel(idx->ndim, idx->shape); i < k; i++) {
    double v = tensor_get(idx, i); /* compared as a double: near 2^63 the cast itself would overflow */
    if (v >= 0 && v < (double)a->k) continue;
    return err_set(file, line, name, a->flag ? "target %.0f of row %" PRId64 " is out of range [0, %" PRId64 ")"
                                             : "index %.0f at position %" PRId64 " is out of range [0, %" PRId64 ")",
                   v, i, a->k),
           -1;
  }
  return 0;
}

/* ---- convolution and pooling (NCHW) ----
 * The messages follow torch's, with kiln's shapes. Kernel sizes come from
 * the weight's shape and may be symbolic like any dim; strides, padding,
 * dilation, groups and pool windows are the integers of attrs.ints. */

static const char *dim_text(sym_dim d, char *buf, size_t n) {
  if (sym_print(d, buf, n) < 0) snprintf(buf, n, "?");
  return buf;
}

/* floor((size + 2 pad - (dil (k - 1) + 1)) / stride) + 1, after checking
 * that the padded size holds the dilated kernel (1 on success, 0 when not). */
static int window_count(dim_env *env, sym_dim size, sym_dim k, int64_t stride, int64_t pad, int64_t dil,
                        sym_dim *out) {
  sym_ctx *s = env->sym;
  sym_dim span = sym_add(s, sym_mul(s, sym_const(dil), sym_sub(s, k, sym_const(1))), sym_const(1));
  sym_dim padded = sym_add(s, size, sym_const(2 * pad));
  if (!is_true(env, padded, SYM_GE, span)) return 0;
  *out = sym_add(s, sym_floordiv(s, sym_sub(s, padded, span), sym_const(stride)), sym_const(1));
  return !sym_is_err(*out);
}

/* The output shape of conv2d(x, w) with ints [sh, sw, ph, pw, dh, dw, groups]. */
static int conv_shape(dim_env *env, const shape_arg *x, const shape_arg *w, const op_attrs *a, shape_arg *out,
                      char *err, size_t errn) {
  char b0[160], b1[160], c0[64], c1[64], c2[64], c3[64];
  const int64_t *p = a->ints;
  if (a->nints != 7) return fail(err, errn, "expects 7 integer parameters, got %d", a->nints);
  if (p[0] < 1 || p[1] < 1) return fail(err, errn, "non-positive stride is not supported (stride (%lld, %lld))", (long long)p[0], (long long)p[1]);
  if (p[2] < 0 || p[3] < 0) return fail(err, errn, "negative padding is not supported (padding (%lld, %lld))", (long long)p[2], (long long)p[3]);
  if (p[4] < 1 || p[5] < 1) return fail(err, errn, "dilation should be greater than zero (dilation (%lld, %lld))", (long long)p[4], (long long)p[5]);
  if (p[6] < 1) return fail(err, errn, "non-positive groups is not supported (groups %lld)", (long long)p[6]);
  if (x->ndim != 4) return fail(err, errn, "expected 4-D input (N,C,H,W), but got input of size %s", TXT(x, b0));
  if (w->ndim != 4) return fail(err, errn, "expected 4-D weight (out, in/groups, kh, kw), but got weight of size %s", TXT(w, b0));
  sym_dim groups = sym_const(p[6]);
  if (!is_true(env, sym_mod(env->sym, w->shape[0], groups), SYM_EQ, sym_const(0)))
    return fail(err, errn, "Given groups=%lld, expected weight to be divisible by %lld at dimension 0, but got weight of size %s instead",
                (long long)p[6], (long long)p[6], TXT(w, b0));
  sym_dim cin = sym_mul(env->sym, w->shape[1], groups);
  if (!is_true(env, x->shape[1], SYM_EQ, cin))
    return fail(err, errn, "Given groups=%lld, weight of size %s, expected input%s to have %s channels, but got %s channels instead",
                (long long)p[6], TXT(w, b0), TXT(x, b1), dim_text(cin, c0, sizeof c0), dim_text(x->shape[1], c1, sizeof c1));
  sym_dim ho, wo;
  if (!window_count(env, x->shape[2], w->shape[2], p[0], p[2], p[4], &ho) ||
      !window_count(env, x->shape[3], w->shape[3], p[1], p[3], p[5], &wo)) {
    sym_ctx *s = env->sym;
    sym_dim kh = sym_add(s, sym_mul(s, sym_const(p[4]), sym_sub(s, w->shape[2], sym_const(1))), sym_const(1));
    sym_dim kw = sym_add(s, sym_mul(s, sym_const(p[5]), sym_sub(s, w->shape[3], sym_const(1))), sym_const(1));
    return fail(err, errn,
                "Calculated padded input size per channel: (%s x %s). Kernel size: (%s x %s). Kernel size can't be greater "
                "than actual input size (input %s, weight %s)",
                dim_text(sym_add(s, x->shape[2], sym_const(2 * p[2])), c0, sizeof c0),
                dim_text(sym_add(s, x->shape[3], sym_const(2 * p[3])), c1, sizeof c1), dim_text(kh, c2, sizeof c2),
                dim_text(kw, c3, sizeof c3), TXT(x, b0), TXT(w, b1));
  }
  out->ndim = 4;
  out->shape[0] = x->shape[0];
  out->shape[1] = w->shape[0];
  out->shape[2] = ho;
  out->shape[3] = wo;
  return 0;
}

int sh_conv2d(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
              size_t errn) {
  (void)op, (void)n;
  return conv_shape(env, &in[0], &in[1], a, out, err, errn);
}

/* The gradient g must have the forward's output shape. */
static int grad_fits(dim_env *env, const shape_arg *g, const shape_arg *y, char *err, size_t errn) {
  char b0[160], b1[160];
  bool ok = g->ndim == y->ndim;
  for (int i = 0; ok && i < y->ndim; i++) ok = is_true(env, g->shape[i], SYM_EQ, y->shape[i]);
  if (!ok) return fail(err, errn, "the gradient %s does not match the forward's output %s", TXT(g, b0), TXT(y, b1));
  return 0;
}

/* conv2d_grad_input(g, w, x) has x's shape; conv2d_grad_weight(g, x, w) w's. */
int sh_conv2d_grad(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
                   size_t errn) {
  (void)n;
  const shape_arg *x = op == OP_CONV2D_GRAD_INPUT ? &in[2] : &in[1], *w = op == OP_CONV2D_GRAD_INPUT ? &in[1] : &in[2];
  shape_arg y = {0};
  if (conv_shape(env, x, w, a, &y, err, errn) || grad_fits(env, &in[0], &y, err, errn)) return -1;
  copy_shape(out, op == OP_CONV2D_GRAD_INPUT ? x : w);
  return 0;
}

/* The output shape of a pool of x: ints [kh, kw, sh, sw, ph, pw], or [oh, ow] adaptive. */
static int pool_shape(dim_env *env, op_id op, const shape_arg *x, const op_attrs *a, shape_arg *out, char *err,
                      size_t errn) {
  char b0[160], c0[64];
  const int64_t *p = a->ints;
  if (x->ndim != 4) return fail(err, errn, "expected 4-D input (N,C,H,W), but got input of size %s", TXT(x, b0));
  copy_shape(out, x);
  if (op == OP_ADAPTIVE_AVG_POOL2D || op == OP_ADAPTIVE_AVG_POOL2D_GRAD) {
    if (a->nints != 2) return fail(err, errn, "expects 2 integer parameters, got %d", a->nints);
    if (p[0] < 0 || p[1] < 0) return fail(err, errn, "output size (%lld, %lld) must be non-negative", (long long)p[0], (long long)p[1]);
    for (int d = 2; d < 4; d++)
      if (!is_true(env, x->shape[d], SYM_GE, sym_const(1)))
        return fail(err, errn, "Expected input to have non-zero size for non-batch dimensions, but input has sizes %s with dimension %d being empty",
                    TXT(x, b0), d);
    out->shape[2] = sym_const(p[0]);
    out->shape[3] = sym_const(p[1]);
    return 0;
  }
  if (a->nints != 6) return fail(err, errn, "expects 6 integer parameters, got %d", a->nints);
  if (p[0] < 1 || p[1] < 1) return fail(err, errn, "kernel size (%lld, %lld) must be greater than zero", (long long)p[0], (long long)p[1]);
  if (p[2] < 1 || p[3] < 1) return fail(err, errn, "stride (%lld, %lld) must be greater than zero", (long long)p[2], (long long)p[3]);
  if (p[4] < 0 || p[5] < 0 || 2 * p[4] > p[0] || 2 * p[5] > p[1])
    return fail(err, errn, "pad should be at most half of effective kernel size, but got pad (%lld, %lld) and kernel size (%lld, %lld)",
                (long long)p[4], (long long)p[5], (long long)p[0], (long long)p[1]);
  for (int d = 0; d < 2; d++)
    if (!window_count(env, x->shape[2 + d], sym_const(p[d]), p[2 + d], p[4 + d], 1, &out->shape[2 + d]))
      return fail(err, errn, "Given input size %s, the output size would be too small (padded size %s < kernel size %lld)",
                  TXT(x, b0), dim_text(sym_add(env->sym, x->shape[2 + d], sym_const(2 * p[4 + d])), c0, sizeof c0),
                  (long long)p[d]);
  return 0;
}

int sh_pool2d(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
              size_t errn) {
  (void)n;
  return pool_shape(env, op, &in[0], a, out, err, errn);
}

/* pool_grad(g, x) has x's shape; g has the pool's output shape. */
int sh_pool2d_grad(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
                   size_t errn) {
  (void)n;
  shape_arg y = {0};
  if (pool_shape(env, op, &in[1], a, &y, err, errn) || grad_fits(env, &in[0], &y, err, errn)) return -1;
  copy_shape(out, &in[1]);
  return 0;
}
