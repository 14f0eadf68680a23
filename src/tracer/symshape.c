/* Shape and dtype rules over symbolic dims: the eager rules of shape.c,
 * written once more over sym_dim because the tracer must know how each
 * output size depends on the input sizes. Where a rule has to decide about a
 * symbol (is s0 1? is s0 equal to s1?) shape_decide answers from the bounds,
 * then from the graph's guards, then from the traced values (and records the
 * guard that answer needs), as torch's ShapeEnv does. */
#include <stdarg.h>
#include <string.h>

#include "tracer/tracer.h"

static sym_cmp negate(sym_cmp op) {
  switch (op) {
  case SYM_EQ: return SYM_NE;
  case SYM_NE: return SYM_EQ;
  case SYM_LT: return SYM_GE;
  case SYM_GE: return SYM_LT;
  case SYM_LE: return SYM_GT;
  case SYM_GT: return SYM_LE;
  default: return op;
  }
}

static bool guard_is(const sym_guard *g, sym_cmp op, sym_dim a, sym_dim b) {
  if (g->op != op) return false;
  if (sym_same(g->lhs, a) && sym_same(g->rhs, b)) return true;
  /* equality is symmetric */
  return (op == SYM_EQ || op == SYM_NE) && sym_same(g->lhs, b) && sym_same(g->rhs, a);
}

int shape_decide(shape_env *env, sym_dim a, sym_cmp op, sym_dim b) {
  bool res, needs;
  if (sym_is_err(a) || sym_is_err(b)) return -1;
  if (sym_decide(a, op, b, NULL, 0, &res, &needs) == 0 && !needs) return res;
  for (int i = 0; env->g && i < env->g->n_guards; i++) {
    if (guard_is(&env->g->guards[i], op, a, b)) return 1;
    if (op != SYM_DIVIDES && guard_is(&env->g->guards[i], negate(op), a, b)) return 0;
  }
  if (!env->vals) return -1;
  if (sym_decide(a, op, b, env->vals, env->nvals, &res, &needs)) return -1;
  if (needs && env->record) {
    if (!res && op == SYM_DIVIDES) return 0; /* no negated form: the caller fails instead */
    sym_guard gd = {res ? op : negate(op), a, b};
    if (ir_add_guard(env->g, gd)) return -1;
  }
  return res;
}

static const char *dims_text(const ir_graph *g, int nd, const sym_dim *d, char *buf, size_t n) {
  (void)g;
  size_t k = 0;
  k += (size_t)snprintf(buf + k, n - k, "[");
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

static int fail(char *err, size_t errn, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t errn, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errn, fmt, ap);
  va_end(ap);
  return -1;
}

/* Broadcasts one pair of dims: a when they agree or b is 1, b when a is 1. */
static int bcast_dim(shape_env *env, sym_dim a, sym_dim b, sym_dim *out) {
  if (sym_same(a, b)) return *out = a, 0;
  if (sym_is_const(b) && b.c == 1) return *out = a, 0;
  if (sym_is_const(a) && a.c == 1) return *out = b, 0;
  /* equal sizes first: one guard a == b serves every size, 1 included */
  int r = shape_decide(env, a, SYM_EQ, b);
  if (r < 0) return -1;
  if (r) return *out = sym_is_const(b) ? b : a, 0;
  r = shape_decide(env, a, SYM_EQ, sym_const(1));
  if (r < 0) return -1;
  if (r) return *out = b, 0;
  r = shape_decide(env, b, SYM_EQ, sym_const(1));
  if (r < 0) return -1;
  if (r) return *out = a, 0;
  return -1;
}

static int bcast(shape_env *env, int na, const sym_dim *sa, int nb, const sym_dim *sb, int *nout, sym_dim *out) {
  int n = na > nb ? na : nb;
  for (int i = 0; i < n; i++) {
    int ia = i - (n - na), ib = i - (n - nb);
    sym_dim da = ia >= 0 ? sa[ia] : sym_const(1), db = ib >= 0 ? sb[ib] : sym_const(1);
    if (bcast_dim(env, da, db, &out[i])) return -1;
  }
  *nout = n;
  return 0;
}

static sym_dim numel_of(ir_graph *g, int nd, const sym_dim *d) {
  sym_dim p = sym_const(1);
  for (int i = 0; i < nd; i++) p = sym_mul(g->sym, p, d[i]);
  return p;
}

static bool is_compare(int op) { return op >= OP_EQ && op <= OP_GE; }

int symshape_infer(shape_env *env, ir_node *n, char *err, size_t errn) {
  ir_graph *g = env->g;
  const char *name = ir_op_name(n->op);
  char b0[256], b1[256];
  if (n->op == IR_NUMEL) {
    if (n->n_in != 1 || n->in[0] < 0 || n->in[0] >= g->n_nodes) return fail(err, errn, "numel: needs one input");
    if (!dtype_is_float(n->dtype) && n->dtype != KILN_I64) return fail(err, errn, "numel: dtype %s", kiln_dtype_name(n->dtype));
    n->ndim = 0;
    return 0;
  }
  if (n->op >= IR_INPUT) {
    if (n->op == IR_GRAD) {
      const ir_node *p = &g->nodes[n->in[0]];
      n->dtype = p->dtype;
      n->ndim = p->ndim;
      memcpy(n->shape, p->shape, sizeof n->shape);
    }
    return 0;
  }
  for (int i = 0; i < n->n_in; i++)
    if (n->in[i] < 0 || n->in[i] >= g->n_nodes) return fail(err, errn, "%s: input %d is not defined", name, i);
  const ir_node *x = n->n_in ? &g->nodes[n->in[0]] : NULL;
  if (!x) return fail(err, errn, "%s: no inputs", name);
#define XSHAPE dims_text(g, x->ndim, x->shape, b0, sizeof b0)
  switch (op_table[n->op].kind) {
  case KIND_POINTWISE: {
    if (n->op == OP_WHERE) {
      const ir_node *a = &g->nodes[n->in[1]], *b = &g->nodes[n->in[2]];
      if (x->dtype != KILN_BOOL) return fail(err, errn, "where: condition must be bool, got %s", kiln_dtype_name(x->dtype));
      if (a->dtype != b->dtype) return fail(err, errn, "where: branches are %s and %s", kiln_dtype_name(a->dtype), kiln_dtype_name(b->dtype));
      int nt;
      sym_dim t[MAXD];
      if (bcast(env, x->ndim, x->shape, a->ndim, a->shape, &nt, t) || bcast(env, nt, t, b->ndim, b->shape, &n->ndim, n->shape))
        return fail(err, errn, "where: shapes %s, %s and %s do not broadcast", XSHAPE,
                    dims_text(g, a->ndim, a->shape, b1, sizeof b1), "(third)");
      n->dtype = a->dtype;
      return 0;
    }
    if (n->n_in == 2) {
      const ir_node *y = &g->nodes[n->in[1]];
      if (x->dtype != y->dtype)
        return fail(err, errn, "%s: dtypes %s and %s differ (the tracer inserts casts)", name, kiln_dtype_name(x->dtype),
                    kiln_dtype_name(y->dtype));
      if (bcast(env, x->ndim, x->shape, y->ndim, y->shape, &n->ndim, n->shape))
        return fail(err, errn, "%s: shapes %s and %s do not broadcast", name, XSHAPE, dims_text(g, y->ndim, y->shape, b1, sizeof b1));
      kiln_dtype t = x->dtype;
      if (is_compare(n->op)) {
        if (t == KILN_BOOL && n->op != OP_EQ && n->op != OP_NE) return fail(err, errn, "%s: bool compares with eq/ne only", name);
        n->dtype = KILN_BOOL;
      } else {
        if (t == KILN_BOOL) return fail(err, errn, "%s: dtype bool is not supported", name);
        if ((n->op == OP_DIV || n->op == OP_POW) && t == KILN_I64) return fail(err, errn, "%s: floats only", name);
        n->dtype = t;
      }
      return 0;
    }
    n->ndim = x->ndim;
    memcpy(n->shape, x->shape, sizeof n->shape);
    if (n->op == OP_CAST) {
      if ((unsigned)n->attrs.dtype > KILN_BOOL) return fail(err, errn, "cast: unknown dtype %d", (int)n->attrs.dtype);
      n->dtype = n->attrs.dtype;
      return 0;
    }
    n->dtype = x->dtype;
    if (n->op == OP_COPY) return 0;
    if (n->op == OP_NEG || n->op == OP_ABS || n->op == OP_RELU)
      return x->dtype == KILN_BOOL ? fail(err, errn, "%s: numbers only", name) : 0;
    if (!dtype_is_float(x->dtype)) return fail(err, errn, "%s: floats only, got %s", name, kiln_dtype_name(x->dtype));
    return 0;
  }
  case KIND_REDUCE: {
    const ir_attrs *a = &n->attrs;
    if (x->dtype == KILN_BOOL || (n->op == OP_MEAN && !dtype_is_float(x->dtype)))
      return fail(err, errn, "%s: dtype %s is not supported", name, kiln_dtype_name(x->dtype));
    if (a->naxes < 0 || a->naxes > x->ndim + (x->ndim == 0)) return fail(err, errn, "%s: %d axes for rank %d", name, a->naxes, x->ndim);
    for (int j = 0; j < a->naxes; j++)
      if (a->axes[j] < 0 || (a->axes[j] >= x->ndim && x->ndim > 0) || (j && a->axes[j] <= a->axes[j - 1]))
        return fail(err, errn, "%s: axes must be sorted and within rank %d", name, x->ndim);
    int k = 0;
    for (int i = 0, j = 0; i < x->ndim; i++) {
      if (j < a->naxes && a->axes[j] == i) {
        j++;
        if (n->op == OP_MAX || n->op == OP_MIN || n->op == OP_ARGMAX) {
          int r = shape_decide(env, x->shape[i], SYM_GE, sym_const(1));
          if (r != 1) return fail(err, errn, "%s: cannot reduce dim %d of %s: it may have size 0", name, i, XSHAPE);
        }
        if (a->keepdim) n->shape[k++] = sym_const(1);
      } else {
        n->shape[k++] = x->shape[i];
      }
    }
    n->ndim = k;
    n->dtype = n->op == OP_ARGMAX ? KILN_I64 : x->dtype;
    return 0;
  }
  case KIND_MATMUL: {
    const ir_node *y = &g->nodes[n->in[1]];
    if (!dtype_is_float(x->dtype) || x->dtype != y->dtype)
      return fail(err, errn, "matmul: dtypes %s and %s (f32 and f64 only, equal)", kiln_dtype_name(x->dtype), kiln_dtype_name(y->dtype));
    if (x->ndim == 0 || y->ndim == 0) return fail(err, errn, "matmul: operands must have at least one dim");
    sym_dim k1 = x->shape[x->ndim - 1], k2 = y->ndim == 1 ? y->shape[0] : y->shape[y->ndim - 2];
    if (shape_decide(env, k1, SYM_EQ, k2) != 1)
      return fail(err, errn, "matmul: shapes %s and %s do not match", XSHAPE, dims_text(g, y->ndim, y->shape, b1, sizeof b1));
    int nb;
    sym_dim bs[MAXD];
    int xb = x->ndim > 2 ? x->ndim - 2 : 0, yb = y->ndim > 2 ? y->ndim - 2 : 0;
    if (bcast(env, xb, x->shape, yb, y->shape, &nb, bs))
      return fail(err, errn, "matmul: batch dims of %s and %s do not broadcast", XSHAPE, dims_text(g, y->ndim, y->shape, b1, sizeof b1));
    int k = 0;
    for (int i = 0; i < nb; i++) n->shape[k++] = bs[i];
    if (x->ndim >= 2) n->shape[k++] = x->shape[x->ndim - 2];
    if (y->ndim >= 2) n->shape[k++] = y->shape[y->ndim - 1];
    n->ndim = k;
    n->dtype = x->dtype;
    return 0;
  }
  case KIND_VIEW: {
    const ir_attrs *a = &n->attrs;
    n->dtype = x->dtype;
    switch (n->op) {
    case OP_RESHAPE: {
      if (a->ndim < 0 || a->ndim > MAXD) return fail(err, errn, "reshape: rank %d", a->ndim);
      sym_dim p = numel_of(g, x->ndim, x->shape), q = numel_of(g, a->ndim, a->shape);
      if (shape_decide(env, p, SYM_EQ, q) != 1)
        return fail(err, errn, "reshape: cannot reshape %s to %s", XSHAPE, dims_text(g, a->ndim, a->shape, b1, sizeof b1));
      n->ndim = a->ndim;
      memcpy(n->shape, a->shape, sizeof n->shape);
      return 0;
    }
    case OP_PERMUTE: {
      bool seen[MAXD] = {0};
      for (int i = 0; i < x->ndim; i++) {
        int p = a->perm[i];
        if (p < 0 || p >= x->ndim || seen[p]) return fail(err, errn, "permute: not a permutation of the dims of %s", XSHAPE);
        seen[p] = true;
        n->shape[i] = x->shape[p];
      }
      n->ndim = x->ndim;
      return 0;
    }
    case OP_EXPAND: {
      if (a->ndim < x->ndim || a->ndim > MAXD) return fail(err, errn, "expand: cannot expand %s to rank %d", XSHAPE, a->ndim);
      for (int i = 0; i < a->ndim; i++) {
        int j = i - (a->ndim - x->ndim);
        if (j >= 0 && !sym_same(x->shape[j], a->shape[i]) && shape_decide(env, x->shape[j], SYM_EQ, sym_const(1)) != 1 &&
            shape_decide(env, x->shape[j], SYM_EQ, a->shape[i]) != 1)
          return fail(err, errn, "expand: cannot expand %s to %s", XSHAPE, dims_text(g, a->ndim, a->shape, b1, sizeof b1));
        n->shape[i] = a->shape[i];
      }
      n->ndim = a->ndim;
      return 0;
    }
    case OP_SLICE: {
      if (a->dim < 0 || a->dim >= x->ndim || a->step < 1) return fail(err, errn, "slice: dim %d / step %lld", a->dim, (long long)a->step);
      if (shape_decide(env, a->start, SYM_GE, sym_const(0)) != 1 || shape_decide(env, a->start, SYM_LE, a->end) != 1 ||
          shape_decide(env, a->end, SYM_LE, x->shape[a->dim]) != 1)
        return fail(err, errn, "slice: bounds do not satisfy 0 <= start <= end <= size of dim %d of %s", a->dim, XSHAPE);
      n->ndim = x->ndim;
      memcpy(n->shape, x->shape, sizeof n->shape);
      sym_dim len = sym_sub(g->sym, a->end, a->start);
      if (a->step > 1) len = sym_floordiv(g->sym, sym_add(g->sym, len, sym_const(a->step - 1)), sym_const(a->step));
      if (sym_is_err(len)) return fail(err, errn, "slice: %s", sym_ctx_error(g->sym));
      n->shape[a->dim] = len;
      return 0;
    }
    default:
      break;
    }
    break;
  }
  case KIND_OTHER:
    break;
  }
  const ir_attrs *a = &n->attrs;
  switch (n->op) {
  case OP_CAT: {
    int d = a->dim;
    if (d < 0 || d >= x->ndim) return fail(err, errn, "cat: dim %d is out of range for %s", d, XSHAPE);
    n->ndim = x->ndim;
    memcpy(n->shape, x->shape, sizeof n->shape);
    sym_dim sum = sym_const(0);
    for (int i = 0; i < n->n_in; i++) {
      const ir_node *t = &g->nodes[n->in[i]];
      bool ok = t->ndim == x->ndim && t->dtype == x->dtype;
      for (int j = 0; ok && j < x->ndim; j++) ok = j == d || shape_decide(env, t->shape[j], SYM_EQ, x->shape[j]) == 1;
      if (!ok)
        return fail(err, errn, "cat: input %d %s does not match input 0 %s outside dim %d", i,
                    dims_text(g, t->ndim, t->shape, b1, sizeof b1), XSHAPE, d);
      sum = sym_add(g->sym, sum, t->shape[d]);
    }
    if (sym_is_err(sum)) return fail(err, errn, "cat: %s", sym_ctx_error(g->sym));
    n->shape[d] = sum;
    n->dtype = x->dtype;
    return 0;
  }
  case OP_INDEX_SELECT: {
    const ir_node *idx = &g->nodes[n->in[1]];
    if (idx->dtype != KILN_I64 || idx->ndim != 1) return fail(err, errn, "index_select: indices must be a 1-D i64 tensor");
    if (a->dim < 0 || a->dim >= x->ndim) return fail(err, errn, "index_select: dim %d is out of range for %s", a->dim, XSHAPE);
    n->ndim = x->ndim;
    memcpy(n->shape, x->shape, sizeof n->shape);
    n->shape[a->dim] = idx->shape[0];
    n->dtype = x->dtype;
    return 0;
  }
  case OP_INDEX_ADD:
  case OP_SLICE_SCATTER: {
    const ir_node *src = &g->nodes[n->in[n->op == OP_INDEX_ADD ? 2 : 1]];
    if (a->dim < 0 || a->dim >= x->ndim) return fail(err, errn, "%s: dim %d is out of range for %s", name, a->dim, XSHAPE);
    sym_dim want[MAXD];
    memcpy(want, x->shape, sizeof want);
    if (n->op == OP_INDEX_ADD) {
      const ir_node *idx = &g->nodes[n->in[1]];
      if (idx->dtype != KILN_I64 || idx->ndim != 1) return fail(err, errn, "index_add: indices must be a 1-D i64 tensor");
      want[a->dim] = idx->shape[0];
    } else {
      if (a->step < 1 || shape_decide(env, a->start, SYM_LE, a->end) != 1 ||
          shape_decide(env, a->end, SYM_LE, x->shape[a->dim]) != 1)
        return fail(err, errn, "slice_scatter: bad bounds for %s", XSHAPE);
      sym_dim len = sym_sub(g->sym, a->end, a->start);
      if (a->step > 1) len = sym_floordiv(g->sym, sym_add(g->sym, len, sym_const(a->step - 1)), sym_const(a->step));
      want[a->dim] = len;
    }
    bool ok = src->ndim == x->ndim && src->dtype == x->dtype;
    for (int j = 0; ok && j < x->ndim; j++) ok = shape_decide(env, src->shape[j], SYM_EQ, want[j]) == 1;
    if (!ok)
      return fail(err, errn, "%s: source %s does not fit %s", name, dims_text(g, src->ndim, src->shape, b1, sizeof b1), XSHAPE);
    n->ndim = x->ndim;
    memcpy(n->shape, x->shape, sizeof n->shape);
    n->dtype = x->dtype;
    return 0;
  }
  default:
    return fail(err, errn, "%s: no shape rule", name);
  }
#undef XSHAPE
}
