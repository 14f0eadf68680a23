/* Shape and dtype rules of every primitive op. Broadcasting follows NumPy:
 * shapes align at the right, a size-1 dim stretches, missing dims are 1. */
#include <inttypes.h>
#include <string.h>

#include "eager/eager.h"

bool dtype_is_float(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_F64; }

int axis_norm(int axis, int ndim) {
  int n = ndim > 0 ? ndim : 1; /* a 0-d tensor accepts axis 0 and -1 like a vector of one */
  if (axis < -n || axis >= n) return -1;
  return axis < 0 ? axis + n : axis;
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

static int category(kiln_dtype dt) { return dt == KILN_BOOL ? 0 : dt == KILN_I64 ? 1 : 2; }
static int rank(kiln_dtype dt) { return dt == KILN_BOOL ? 0 : dt == KILN_I64 ? 1 : dt == KILN_F32 ? 2 : 3; }

/* The result type of a binary op: bool < i64 < f32 < f64. A 0-d operand does
 * not widen a tensor of its own category (f32 tensor * f64 scalar stays f32),
 * as in torch. */
kiln_dtype dtype_promote(const kiln_tensor *a, const kiln_tensor *b) {
  kiln_dtype x = a->dtype, y = b->dtype;
  if (x == y) return x;
  if ((a->ndim == 0) != (b->ndim == 0)) {
    const kiln_tensor *big = a->ndim == 0 ? b : a, *small = a->ndim == 0 ? a : b;
    if (category(small->dtype) <= category(big->dtype)) return big->dtype;
  }
  return rank(x) > rank(y) ? x : y;
}

static bool is_compare(op_id op) { return op >= OP_EQ && op <= OP_GE; }

static int bad_dtype(const char *file, int line, op_id op, kiln_dtype dt, const char *want) {
  err_set(file, line, op_table[op].name, "dtype %s is not supported (%s)", kiln_dtype_name(dt), want);
  return -1;
}

static int check_indices(const kiln_tensor *idx, int64_t bound, op_id op, const char *file, int line) {
  if (idx->dtype != KILN_I64 || idx->ndim != 1)
    return err_set(file, line, op_table[op].name, "indices must be a 1-D i64 tensor, got %s of rank %d",
                   kiln_dtype_name(idx->dtype), idx->ndim),
           -1;
  for (int64_t i = 0; i < idx->shape[0]; i++) {
    int64_t v = ((const int64_t *)idx->st->data)[idx->offset + i * idx->stride[0]];
    if (v < 0 || v >= bound)
      return err_set(file, line, op_table[op].name, "index %" PRId64 " at position %" PRId64 " is out of range [0, %" PRId64 ")",
                     v, i, bound),
             -1;
  }
  return 0;
}

int shape_rule(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_dtype *dt, int *ndim,
               int64_t *shape, const char *file, int line) {
  const char *name = op_table[op].name;
  char b0[SHAPE_BUF], b1[SHAPE_BUF], b2[SHAPE_BUF];
  const kiln_tensor *x = in[0];
  switch (op_table[op].kind) {
  case KIND_POINTWISE:
    if (op == OP_WHERE) {
      int nt;
      int64_t t[MAXD];
      if (in[0]->dtype != KILN_BOOL)
        return err_set(file, line, name, "condition must be bool, got %s", kiln_dtype_name(in[0]->dtype)), -1;
      if (shape_broadcast(in[0]->ndim, in[0]->shape, in[1]->ndim, in[1]->shape, &nt, t) ||
          shape_broadcast(nt, t, in[2]->ndim, in[2]->shape, ndim, shape))
        return err_set(file, line, name, "shapes %s, %s and %s do not broadcast", err_shape(b0, in[0]->ndim, in[0]->shape),
                       err_shape(b1, in[1]->ndim, in[1]->shape), err_shape(b2, in[2]->ndim, in[2]->shape)),
               -1;
      *dt = in[1]->dtype;
      return 0;
    }
    if (n == 2) {
      int r = shape_broadcast(x->ndim, x->shape, in[1]->ndim, in[1]->shape, ndim, shape);
      if (r) {
        int d = -1 - r;
        return err_set(file, line, name, "shapes %s and %s do not broadcast (dim %d of the result)",
                       err_shape(b0, x->ndim, x->shape), err_shape(b1, in[1]->ndim, in[1]->shape), d),
               -1;
      }
      kiln_dtype t = x->dtype; /* inputs already promoted by dispatch */
      if (is_compare(op)) {
        if (t == KILN_BOOL && op != OP_EQ && op != OP_NE) return bad_dtype(file, line, op, t, "bool compares with eq/ne only");
        *dt = KILN_BOOL;
      } else {
        if (t == KILN_BOOL) return bad_dtype(file, line, op, t, "cast bool to a number type first");
        if ((op == OP_DIV || op == OP_POW) && t == KILN_I64) return bad_dtype(file, line, op, t, "floats only; cast first");
        *dt = t;
      }
      return 0;
    }
    *ndim = x->ndim;
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    if (op == OP_CAST) {
      if ((unsigned)a->dtype > KILN_BOOL) return err_set(file, line, name, "unknown dtype %d", (int)a->dtype), -1;
      *dt = a->dtype;
      return 0;
    }
    *dt = x->dtype;
    if (op == OP_COPY) return 0;
    if (op == OP_NEG || op == OP_ABS || op == OP_RELU) {
      if (x->dtype == KILN_BOOL) return bad_dtype(file, line, op, x->dtype, "numbers only");
      return 0;
    }
    if (!dtype_is_float(x->dtype)) return bad_dtype(file, line, op, x->dtype, "floats only; cast first");
    return 0;
  case KIND_REDUCE: {
    if (x->dtype == KILN_BOOL || (op == OP_MEAN && !dtype_is_float(x->dtype)))
      return bad_dtype(file, line, op, x->dtype, op == OP_MEAN ? "floats only" : "numbers only");
    int k = 0;
    for (int i = 0, j = 0; i < x->ndim; i++) {
      bool red = j < a->naxes && a->axes[j] == i;
      if (red) {
        j++;
        if (x->shape[i] == 0 && (op == OP_MAX || op == OP_MIN || op == OP_ARGMAX))
          return err_set(file, line, name, "cannot reduce dim %d of %s: it has size 0", i, err_shape(b0, x->ndim, x->shape)), -1;
        if (a->keepdim) shape[k++] = 1;
      } else {
        shape[k++] = x->shape[i];
      }
    }
    *ndim = k;
    *dt = op == OP_ARGMAX ? KILN_I64 : x->dtype;
    return 0;
  }
  case KIND_MATMUL: {
    const kiln_tensor *y = in[1];
    if (!dtype_is_float(x->dtype)) return bad_dtype(file, line, op, x->dtype, "f32 and f64 only");
    if (x->ndim == 0 || y->ndim == 0)
      return err_set(file, line, name, "operands must have at least one dim, got %s and %s", err_shape(b0, x->ndim, x->shape),
                     err_shape(b1, y->ndim, y->shape)),
             -1;
    int64_t k1 = x->shape[x->ndim - 1], k2 = y->ndim == 1 ? y->shape[0] : y->shape[y->ndim - 2];
    if (k1 != k2)
      return err_set(file, line, name, "shapes %s and %s do not match (%" PRId64 " != %" PRId64 ")",
                     err_shape(b0, x->ndim, x->shape), err_shape(b1, y->ndim, y->shape), k1, k2),
             -1;
    int nb;
    int64_t bshape[MAXD];
    int xb = x->ndim > 2 ? x->ndim - 2 : 0, yb = y->ndim > 2 ? y->ndim - 2 : 0;
    if (shape_broadcast(xb, x->shape, yb, y->shape, &nb, bshape))
      return err_set(file, line, name, "batch dims of %s and %s do not broadcast", err_shape(b0, x->ndim, x->shape),
                     err_shape(b1, y->ndim, y->shape)),
             -1;
    int k = 0;
    for (int i = 0; i < nb; i++) shape[k++] = bshape[i];
    if (x->ndim >= 2) shape[k++] = x->shape[x->ndim - 2];
    if (y->ndim >= 2) shape[k++] = y->shape[y->ndim - 1];
    *ndim = k;
    *dt = x->dtype;
    return 0;
  }
  case KIND_VIEW: {
    int64_t stride[MAXD], off;
    *dt = x->dtype;
    return view_layout(op, x, a, ndim, shape, stride, &off) < 0 ? -1 : 0;
  }
  case KIND_OTHER:
    break;
  }
  switch (op) {
  case OP_CAT: {
    int d = a->dim;
    *ndim = x->ndim;
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    shape[d] = 0;
    for (int i = 0; i < n; i++) {
      const kiln_tensor *t = in[i];
      bool ok = t->ndim == x->ndim && t->dtype == x->dtype;
      for (int j = 0; ok && j < x->ndim; j++) ok = j == d || t->shape[j] == x->shape[j];
      if (!ok)
        return err_set(file, line, name, "input %d (%s%s) does not match input 0 (%s%s) outside dim %d", i,
                       kiln_dtype_name(t->dtype), err_shape(b0, t->ndim, t->shape), kiln_dtype_name(x->dtype),
                       err_shape(b1, x->ndim, x->shape), d),
               -1;
      shape[d] += t->shape[d];
    }
    *dt = x->dtype;
    return 0;
  }
  case OP_INDEX_SELECT:
    if (check_indices(in[1], x->shape[a->dim], op, file, line)) return -1;
    *ndim = x->ndim;
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    shape[a->dim] = in[1]->shape[0];
    *dt = x->dtype;
    return 0;
  case OP_INDEX_ADD:
  case OP_SLICE_SCATTER: {
    /* in[0] base, then (INDEX_ADD) indices and source, or (SLICE_SCATTER) source */
    const kiln_tensor *src = op == OP_INDEX_ADD ? in[2] : in[1];
    int64_t want[MAXD];
    memcpy(want, x->shape, sizeof want);
    if (op == OP_INDEX_ADD) {
      if (check_indices(in[1], x->shape[a->dim], op, file, line)) return -1;
      want[a->dim] = in[1]->shape[0];
    } else {
      want[a->dim] = a->end > a->start ? (a->end - a->start + a->step - 1) / a->step : 0;
    }
    bool ok = src->ndim == x->ndim && src->dtype == x->dtype;
    for (int j = 0; ok && j < x->ndim; j++) ok = src->shape[j] == want[j];
    if (!ok)
      return err_set(file, line, name, "source %s%s does not fit %s", kiln_dtype_name(src->dtype),
                     err_shape(b0, src->ndim, src->shape), err_shape(b1, x->ndim, want)),
             -1;
    *ndim = x->ndim;
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    *dt = x->dtype;
    return 0;
  }
  default:
    return err_set(file, line, name, "no shape rule"), -1;
  }
}
