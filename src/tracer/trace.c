/* Capture: runs the user's function once eagerly with the dispatch hooks set,
 * and records every op into a graph. Tensors are told apart by serial number:
 * the call's inputs become input nodes; tensors the function makes through an
 * op become op nodes; tensors it makes otherwise (kiln_scalar, kiln_zeros)
 * become constants; older tensors it reaches (weights in its context) become
 * params, read by reference on every call, and the .grad of a param becomes
 * a grad leaf. In-place writes rebind the tensor to a new value (functional
 * form) and are written back at the end. Sizes are symbolic where the spec
 * says so; a concrete size the function passes (a reshape target, a slice
 * bound) becomes symbolic when exactly one symbolic size of the trace has that
 * value, else it stays a constant and the guards keep that honest. */
#include <stdarg.h>
#include <string.h>

#include "tracer/tracer.h"

/* serial -> node id, open addressing */
typedef struct tmap {
  uint64_t *key;
  int *val;
  size_t cap, n;
} tmap;

/* traced value -> the one dim seen with it (or ambiguous) */
typedef struct size_entry {
  int64_t v;
  sym_dim d[4];      /* the distinct dims seen with this value */
  int n;
  bool used, ambiguous; /* ambiguous: more than fit */
} size_entry;

typedef struct leaf {
  kiln_tensor *t;    /* the input or param tensor (params retained) */
  uint64_t serial;
  int node;          /* its leaf node */
  kiln_tensor *grad0; /* .grad when it was lifted (or at the start, for inputs) */
  uint64_t grad0_serial;
  int grad_node;     /* IR_GRAD node, -1 until read */
  trace_leaf info;
} leaf;

typedef struct tracer {
  ir_graph *g;
  const trace_spec *spec;
  trace_hooks hooks;
  uint64_t serial0;
  tmap map;
  tmap layouts;      /* (storage, layout) of every op result -> its node: views made outside dispatch */
  tmap storages;     /* storage serials of op results */
  size_entry *sizes;
  size_t sizes_cap;
  int64_t vals[IR_MAX_SYMS];
  sym_dim reads[64]; /* symbolic sizes the body read with kiln_size */
  int n_reads;
  leaf *leaves;      /* inputs first, then params in lift order */
  int n_leaves, cap_leaves, n_in;
  /* storages written in place while views of them lived: a view made before
   * the write (serial below upto) other than the written tensor is stale */
  struct { uint64_t st, upto, dst; const char *file; int line; } stale[16];
  int n_stale;
  int n_params;
  bool failed, value_dep;
  char why[512];
} tracer;

static void tfail(tracer *tr, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tfail(tracer *tr, const char *fmt, ...) {
  if (tr->failed) return;
  tr->failed = true;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tr->why, sizeof tr->why, fmt, ap);
  va_end(ap);
}

/* ---- serial map ---- */

static uint64_t hash64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

static int map_get(const tmap *m, uint64_t k) {
  if (!m->cap) return -1;
  for (size_t i = hash64(k) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
    if (!m->key[i]) return -1;
    if (m->key[i] == k) return m->val[i];
  }
}

static int map_put(tmap *m, uint64_t k, int v) {
  if ((m->n + 1) * 2 > m->cap) {
    size_t cap = m->cap ? m->cap * 2 : 1024;
    uint64_t *key = alloc_calloc(cap, sizeof *key);
    int *val = alloc_calloc(cap, sizeof *val);
    if (!key || !val) {
      alloc_free(key);
      alloc_free(val);
      return -1;
    }
    for (size_t i = 0; i < m->cap; i++) {
      if (!m->key[i]) continue;
      size_t j = hash64(m->key[i]) & (cap - 1);
      while (key[j]) j = (j + 1) & (cap - 1);
      key[j] = m->key[i];
      val[j] = m->val[i];
    }
    alloc_free(m->key);
    alloc_free(m->val);
    m->key = key;
    m->val = val;
    m->cap = cap;
  }
  size_t i = hash64(k) & (m->cap - 1);
  while (m->key[i] && m->key[i] != k) i = (i + 1) & (m->cap - 1);
  if (!m->key[i]) m->n++;
  m->key[i] = k;
  m->val[i] = v;
  return 0;
}

static uint64_t layout_key(const kiln_tensor *t) {
  uint64_t h = hash64(t->st->serial ^ 0x5bd1e995u);
  h = hash64(h ^ ((uint64_t)t->dtype << 8 | (uint64_t)t->ndim));
  for (int i = 0; i < t->ndim; i++) h = hash64(h ^ (uint64_t)t->shape[i]) + (uint64_t)t->stride[i] * 0x9e3779b97f4a7c15ull;
  h = hash64(h ^ (uint64_t)t->offset);
  return h ? h : 1;
}

/* ---- sizes seen, for resolving concrete sizes the function passes ---- */

static int64_t dim_value(const tracer *tr, sym_dim d) {
  int64_t v = -1;
  if (sym_eval(d, tr->vals, tr->g->n_syms, &v)) return -1;
  return v;
}

static void note_size(tracer *tr, sym_dim d) {
  int64_t v = dim_value(tr, d);
  if (v < 2) return; /* 0 and 1 always stay constants */
  if (tr->sizes_cap == 0) {
    tr->sizes = alloc_calloc(256, sizeof *tr->sizes);
    if (!tr->sizes) return tfail(tr, "out of memory");
    tr->sizes_cap = 256;
  }
  size_t i = hash64((uint64_t)v) & (tr->sizes_cap - 1);
  for (size_t probes = 0; probes < tr->sizes_cap; probes++, i = (i + 1) & (tr->sizes_cap - 1)) {
    size_entry *e = &tr->sizes[i];
    if (!e->used) {
      *e = (size_entry){.v = v, .d = {d}, .n = 1, .used = true};
      return;
    }
    if (e->v == v) {
      for (int k = 0; k < e->n; k++)
        if (sym_same(e->d[k], d)) return;
      if (e->n < 4) e->d[e->n++] = d;
      else e->ambiguous = true;
      return;
    }
  }
  /* table full: sizes past the first few hundred distinct values resolve to constants */
}

static void note_shape(tracer *tr, const ir_node *n) {
  for (int i = 0; i < n->ndim; i++) note_size(tr, n->shape[i]);
}

/* The sizes the body read, one by one (j < i) and as products of two. */
static sym_dim read_size(tracer *tr, int i, int j) {
  return j < i ? tr->reads[i] : sym_mul(tr->g->sym, tr->reads[i], tr->reads[j]);
}

/* Keeps the variant to d == v (true at the trace); nothing when d is constant. */
static void keep_equal(tracer *tr, sym_dim d, int64_t v) {
  if (sym_is_err(d) || sym_is_const(d)) return;
  shape_env env = {.g = tr->g, .vals = tr->vals, .nvals = tr->g->n_syms, .record = true};
  if (shape_decide(&env, d, SYM_EQ, sym_const(v)) != 1)
    tfail(tr, "could not keep a size equal to its traced value %lld as a guard (out of memory, or a size that overflows)",
          (long long)v);
}

/* A constant v that a symbol, a size the body read or a product of two such
 * sizes also has as its traced value: the number may have come from it
 * (kiln_size arithmetic, 2*s0 included), so the variant is kept to that
 * value. Never a wrong answer, at worst a retrace. */
static sym_dim pin(tracer *tr, int64_t v) {
  for (int k = 0; k < tr->g->n_syms; k++)
    if (tr->vals[k] == v) keep_equal(tr, sym_var(tr->g->sym, k, tr->g->sym_lo[k], tr->g->sym_hi[k]), v);
  for (int i = 0; i < tr->n_reads; i++)
    for (int j = i - 1; j < tr->n_reads; j++) {
      sym_dim c = read_size(tr, i, j);
      if (!sym_is_err(c) && dim_value(tr, c) == v) keep_equal(tr, c, v);
    }
  return sym_const(v);
}

/* A number user code passed (a reshape target, a slice bound, a factory's
 * size): a symbolic size only when the body read sizes (kiln_size) of which
 * exactly one, or one product of two, has that value; else pinned. */
static sym_dim resolve_user(tracer *tr, int64_t v) {
  if (v < 2) return sym_const(v);
  shape_env env = {.g = tr->g, .vals = NULL, .nvals = 0, .record = false};
  sym_dim found = sym_error();
  for (int i = 0; i < tr->n_reads; i++)
    for (int j = i - 1; j < tr->n_reads; j++) {
      sym_dim c = read_size(tr, i, j);
      if (sym_is_err(c) || dim_value(tr, c) != v) continue;
      if (sym_is_err(found)) found = c;
      else if (!sym_same(found, c) && shape_decide(&env, found, SYM_EQ, c) != 1) return pin(tr, v);
    }
  return sym_is_err(found) || sym_is_const(found) ? pin(tr, v) : found;
}

/* A number the library passed (autograd's formulas, a view's bounds): the
 * one dim seen in the trace with that value, else pinned to every dim seen
 * with it (all symbols, when more were seen than the table keeps). */
static sym_dim resolve(tracer *tr, int64_t v) {
  if (v < 2 || !tr->sizes_cap) return sym_const(v);
  size_t i = hash64((uint64_t)v) & (tr->sizes_cap - 1);
  for (size_t probes = 0; probes < tr->sizes_cap; probes++, i = (i + 1) & (tr->sizes_cap - 1)) {
    size_entry *e = &tr->sizes[i];
    if (!e->used) break;
    if (e->v != v) continue;
    if (e->ambiguous) {
      for (int k = 0; k < tr->g->n_syms; k++)
        keep_equal(tr, sym_var(tr->g->sym, k, tr->g->sym_lo[k], tr->g->sym_hi[k]), tr->vals[k]);
      return sym_const(v);
    }
    /* one dim, or several the guards say are equal (s0 == s1): the first */
    shape_env env = {.g = tr->g, .vals = NULL, .nvals = 0, .record = false};
    bool one = !sym_is_const(e->d[0]);
    for (int k = 1; one && k < e->n; k++) one = shape_decide(&env, e->d[0], SYM_EQ, e->d[k]) == 1;
    if (one) return e->d[0];
    for (int k = 0; k < e->n; k++) keep_equal(tr, e->d[k], v);
    return pin(tr, v);
  }
  return pin(tr, v);
}

/* ---- leaves and constants ---- */

static int push_leaf(tracer *tr, leaf l) {
  if (tr->n_leaves == tr->cap_leaves) {
    int cap = tr->cap_leaves ? tr->cap_leaves * 2 : 16;
    leaf *nl = alloc_realloc(tr->leaves, sizeof *nl * (size_t)cap);
    if (!nl) return -1;
    tr->leaves = nl;
    tr->cap_leaves = cap;
  }
  tr->leaves[tr->n_leaves++] = l;
  return 0;
}

static void set_concrete(ir_node *n, const kiln_tensor *t) {
  n->dtype = t->dtype;
  n->ndim = t->ndim;
  for (int i = 0; i < t->ndim; i++) n->shape[i] = sym_const(t->shape[i]);
}

/* A tensor made in the trace by a factory (kiln_zeros, kiln_full, kiln_randn,
 * kiln_tensor_from ...): its sizes may come from kiln_size, so a size equal
 * to a symbol's traced value is either that symbol (a uniform tensor becomes
 * a scalar expanded to the symbolic shape) or is guarded to stay that value. */
static int make_const_raw(tracer *tr, const kiln_tensor *t, const char *file, int line);

/* Whether every element of t equals the first (NaN equal to NaN). */
static bool all_equal(const kiln_tensor *t, int64_t n) {
  if (tensor_contiguous(t)) {
    /* each element against the next, as bytes: one pass at memcmp's speed
     * (a tensor of zeros made in the body can be large); on a difference
     * (+0 and -0, two NaNs) the element-wise test below decides */
    size_t esz = kiln_dtype_size(t->dtype);
    const char *p = tensor_data(t);
    if (!memcmp(p, p + esz, (size_t)(n - 1) * esz)) return true;
  }
  double a = tensor_get(t, 0);
  for (int64_t i = 1; i < n; i++) {
    double b = tensor_get(t, i);
    if (!(a == b || (a != a && b != b))) return false;
  }
  return true;
}

static int make_const(tracer *tr, const kiln_tensor *t, const char *file, int line) {
  int64_t n = kiln_numel(t);
  bool uniform = n > 1 && all_equal(t, n);
  sym_dim dims[MAXD];
  bool symbolic = false;
  for (int d = 0; d < t->ndim; d++) {
    dims[d] = uniform ? resolve_user(tr, t->shape[d]) : pin(tr, t->shape[d]);
    symbolic |= !sym_is_const(dims[d]);
  }
  if (!symbolic) return make_const_raw(tr, t, file, line);
  kiln_tensor one = tensor_header(t);
  one.ndim = 0; /* the first element, as a scalar */
  int c = make_const_raw(tr, &one, file, line);
  if (c < 0) return -1;
  ir_node e = {.op = OP_EXPAND, .n_in = 1, .in = &c, .file = file, .line = line};
  e.attrs.ndim = t->ndim;
  memcpy(e.attrs.shape, dims, sizeof dims);
  e.attrs.start = e.attrs.end = sym_const(0);
  shape_env env = {.g = tr->g, .vals = tr->vals, .nvals = tr->g->n_syms, .record = true};
  char err[256];
  if (symshape_infer(&env, &e, err, sizeof err)) return make_const_raw(tr, t, file, line);
  return ir_add(tr->g, &e);
}

static int make_const_raw(tracer *tr, const kiln_tensor *t, const char *file, int line) {
  ir_node n = {.op = IR_CONST, .file = file, .line = line};
  set_concrete(&n, t);
  size_t bytes = (size_t)kiln_numel(t) * kiln_dtype_size(t->dtype);
  void *buf = alloc_malloc(bytes ? bytes : 1);
  if (!buf) return -1;
  if (bytes) {
    storage st = {.data = buf, .bytes = bytes};
    kiln_tensor dst = {.dtype = t->dtype, .ndim = t->ndim, .st = &st};
    memcpy(dst.shape, t->shape, sizeof dst.shape);
    contiguous_strides(t->ndim, t->shape, dst.stride);
    pw_copy(&dst, t);
  }
  n.data = buf;
  int id = ir_add(tr->g, &n);
  alloc_free(buf);
  return id;
}

/* The node for tensor t, making a constant, param or grad leaf when it is new. */
static int node_of(tracer *tr, kiln_tensor *t, const char *file, int line) {
  for (int i = 0; i < tr->n_stale; i++)
    if (t->st->serial == tr->stale[i].st && t->serial < tr->stale[i].upto && t->serial != tr->stale[i].dst) {
      tfail(tr, "%s:%d: uses a view made before the in-place write at %s:%d into the tensor it views; compiled code "
            "does not follow writes through views (make the view again after the write)", file, line,
            tr->stale[i].file, tr->stale[i].line);
      return -1;
    }
  int id = map_get(&tr->map, t->serial);
  if (id >= 0) return id;
  if (t->serial >= tr->serial0) {
    /* a view of an op result made outside dispatch (autograd saves outputs so) */
    id = map_get(&tr->layouts, layout_key(t));
    if (id < 0 && map_get(&tr->storages, t->st->serial + 1) >= 0) {
      tfail(tr, "%s:%d: a tensor made in the traced function views an op result without going through an op", file, line);
      return -1;
    }
    if (id < 0) id = make_const(tr, t, file, line);
  } else {
    /* the .grad of a leaf we know, read before it changed? */
    for (int i = 0; i < tr->n_leaves; i++) {
      leaf *l = &tr->leaves[i];
      if (l->grad0 != t || l->grad0_serial != t->serial) continue;
      ir_node n = {.op = IR_GRAD, .n_in = 1, .in = &l->node, .file = file, .line = line};
      set_concrete(&n, t);
      n.dtype = tr->g->nodes[l->node].dtype;
      n.ndim = tr->g->nodes[l->node].ndim;
      memcpy(n.shape, tr->g->nodes[l->node].shape, sizeof n.shape);
      id = ir_append(tr->g, &n);
      if (id >= 0) l->grad_node = id;
      break;
    }
    if (id < 0 && tr->spec->freeze && !t->requires_grad) {
      id = make_const(tr, t, file, line);
    } else if (id < 0) {
      ir_node n = {.op = IR_PARAM, .index = tr->n_params, .file = file, .line = line};
      set_concrete(&n, t);
      id = ir_append(tr->g, &n);
      if (id >= 0) {
        leaf l = {kiln_retain(t), t->serial, id, t->grad, t->grad ? t->grad->serial : 0, -1,
                  {t->requires_grad, t->grad != NULL}};
        if (push_leaf(tr, l)) {
          kiln_release(t);
          id = -1;
        } else {
          tr->n_params++;
        }
      }
    }
  }
  if (id < 0 || map_put(&tr->map, t->serial, id)) {
    tfail(tr, "out of memory while tracing");
    return -1;
  }
  note_shape(tr, &tr->g->nodes[id]);
  return id;
}

/* ---- attributes: concrete sizes back to symbols ---- */

/* Target dims of a reshape of node x to the concrete shape t[0..tn). */
static void reshape_target(tracer *tr, const ir_node *x, int tn, const int64_t *t, int infer, sym_dim *out) {
  ir_graph *g = tr->g;
  int xn = x->ndim;
  int64_t xv[MAXD];
  for (int i = 0; i < xn; i++) xv[i] = dim_value(tr, x->shape[i]);
  for (int j = 0; j < tn; j++) out[j] = sym_const(t[j]);
  int i = 0, j = 0;
  while (j < tn) {
    if (t[j] == 1 && (i >= xn || xv[i] != 1)) {
      j++;
      continue;
    }
    if (i < xn && xv[i] == 1 && t[j] != 1) {
      i++;
      continue;
    }
    if (i >= xn) return;
    if (t[j] == 1 && xv[i] == 1) {
      out[j++] = x->shape[i++];
      continue;
    }
    if (xv[i] == 0 || t[j] == 0) return; /* empty tensors keep constant shapes */
    /* the smallest groups x[i..i1) and t[j..j1) with equal products */
    int i1 = i + 1, j1 = j + 1;
    int64_t pi = xv[i], pj = t[j];
    while (pi != pj) {
      if (pi < pj) {
        if (i1 >= xn || pi > INT64_MAX / (xv[i1] ? xv[i1] : 1)) return;
        pi *= xv[i1++];
      } else {
        if (j1 >= tn || pj > INT64_MAX / (t[j1] ? t[j1] : 1)) return;
        pj *= t[j1++];
      }
    }
    sym_dim p = sym_const(1);
    bool all_const = true;
    for (int k = i; k < i1; k++) {
      p = sym_mul(g->sym, p, x->shape[k]);
      all_const &= sym_is_const(x->shape[k]);
    }
    if (!all_const) {
      if (j1 - j == 1) {
        out[j] = p;
      } else {
        /* match target dims to the group's input dims in order, else resolve them */
        bool taken[MAXD] = {0};
        int next = i;
        for (int k = j; k < j1; k++) {
          int m = -1;
          for (int q = next; q < i1; q++)
            if (xv[q] == t[k]) {
              m = q;
              break;
            }
          if (m >= 0) {
            out[k] = x->shape[m];
            next = m + 1;
            taken[k] = true;
          } else {
            out[k] = resolve(tr, t[k]);
          }
        }
        sym_dim q = sym_const(1);
        for (int k = j; k < j1; k++) q = sym_mul(g->sym, q, out[k]);
        /* sizes that are all constants cannot cover a symbolic product: one of
         * them (the -1 if there was one, else the last not matched) takes the rest;
         * otherwise the shape rule guards that the products agree */
        if (!sym_same(p, q) && sym_is_const(q)) {
          int free = infer > j && infer <= j1 ? infer - 1 : -1;
          for (int k = j1 - 1; k >= j && free < 0; k--)
            if (!taken[k] && t[k] > 1) free = k;
          if (free >= 0) {
            sym_dim others = sym_const(1);
            for (int k = j; k < j1; k++)
              if (k != free) others = sym_mul(g->sym, others, out[k]);
            sym_dim f = sym_floordiv(g->sym, p, others);
            if (!sym_is_err(f) && dim_value(tr, f) == t[free]) out[free] = f;
          }
        }
      }
    }
    i = i1;
    j = j1;
  }
}

/* A slice bound as the caller meant it: negative counts from the end of the
 * (maybe symbolic) size, past the end clamps to it, otherwise the number
 * (a symbolic size when it resolves to one: x[:T] with T from kiln_size). */
static sym_dim slice_bound(tracer *tr, sym_dim size, int64_t sv, bool raw, int64_t given, int64_t normalized) {
  ir_graph *g = tr->g;
  shape_env env = {.g = g, .vals = tr->vals, .nvals = g->n_syms, .record = true};
  if (!raw) return normalized == sv ? size : resolve(tr, normalized);
  bool user = user_numbers();
  if (given < 0) {
    if (given + sv < 0) {
      /* clamped to 0: keep it so */
      if (shape_decide(&env, sym_add(g->sym, size, sym_const(given)), SYM_LT, sym_const(0)) != 1) tfail(tr, "slice bound");
      return sym_const(0);
    }
    sym_dim b = sym_add(g->sym, size, sym_const(given));
    if (shape_decide(&env, b, SYM_GE, sym_const(0)) != 1) tfail(tr, "slice bound");
    return b;
  }
  if (given >= sv) {
    /* past the end: the size itself, as long as it stays at most the number given */
    if (given < INT64_MAX / 2 && shape_decide(&env, size, SYM_LE, sym_const(given)) != 1) tfail(tr, "slice bound");
    return size;
  }
  return user ? resolve_user(tr, given) : resolve(tr, given);
}

/* The attributes eager passed (constant dims) as the graph's: the fields
 * of the op's schema, with each size field's numbers resolved to the
 * symbolic sizes they came from (or pinned). */
static void convert_attrs(tracer *tr, int op, const ir_node *x, const op_attrs *a, op_attrs *o) {
  unsigned f = ir_attr_fields(op);
  *o = *a;
  o->infer = 0;
  o->raw = false;
  o->raw_start = o->raw_end = 0;
  if (f & AF_SHAPE) {
    int64_t t[MAXD];
    for (int i = 0; i < a->ndim; i++) t[i] = a->shape[i].c;
    if (op == OP_EXPAND) {
      for (int i = 0; i < a->ndim; i++) {
        int j = i - (a->ndim - x->ndim);
        o->shape[i] = j >= 0 && dim_value(tr, x->shape[j]) == t[i] ? x->shape[j]
                      : user_numbers()                       ? resolve_user(tr, t[i])
                                                             : resolve(tr, t[i]);
      }
    } else if (user_numbers()) {
      /* the caller's numbers: sizes it read, the -1, else pinned constants */
      for (int i = 0; i < a->ndim; i++) o->shape[i] = i == a->infer - 1 ? sym_const(t[i]) : resolve_user(tr, t[i]);
    } else {
      reshape_target(tr, x, a->ndim, t, a->infer, o->shape);
    }
    if (op == OP_RESHAPE && a->infer > 0 && a->infer <= a->ndim && sym_is_const(o->shape[a->infer - 1])) {
      /* the dim given as -1 is exactly what the others leave */
      ir_graph *g = tr->g;
      sym_dim p = sym_const(1), q = sym_const(1);
      for (int i = 0; i < x->ndim; i++) p = sym_mul(g->sym, p, x->shape[i]);
      for (int i = 0; i < a->ndim; i++)
        if (i != a->infer - 1) q = sym_mul(g->sym, q, o->shape[i]);
      sym_dim fl = sym_floordiv(g->sym, p, q);
      if (!sym_is_err(fl) && dim_value(tr, fl) == t[a->infer - 1]) o->shape[a->infer - 1] = fl;
    }
  }
  if (f & (AF_START | AF_END)) {
    sym_dim size = x->shape[a->dim];
    int64_t sv = dim_value(tr, size);
    o->start = slice_bound(tr, size, sv, a->raw, a->raw_start, a->start.c);
    o->end = slice_bound(tr, size, sv, a->raw, a->raw_end, a->end.c);
  }
}

/* Infers node n's dtype and shape (recording the guards that needs) and
 * interns it; the node id, or -1 with the trace failed. */
static int add_node(tracer *tr, ir_node *n, const char *file, int line) {
  shape_env env = {.g = tr->g, .vals = tr->vals, .nvals = tr->g->n_syms, .record = true};
  char err[256];
  if (symshape_infer(&env, n, err, sizeof err)) return tfail(tr, "%s:%d: %s", file, line, err), -1;
  int id = ir_add(tr->g, n);
  if (id < 0) tfail(tr, "out of memory while tracing");
  return id;
}

/* Node x broadcast to node like's shape (x itself when it has it already). */
static int expand_to(tracer *tr, int x, int like, const char *file, int line) {
  const ir_node *xn = &tr->g->nodes[x], *ln = &tr->g->nodes[like];
  bool same = xn->ndim == ln->ndim;
  for (int i = 0; same && i < ln->ndim; i++) same = sym_same(xn->shape[i], ln->shape[i]);
  if (same) return x;
  ir_node e = {.op = OP_EXPAND, .n_in = 1, .in = &x, .file = file, .line = line};
  e.attrs.ndim = ln->ndim;
  memcpy(e.attrs.shape, ln->shape, sizeof e.attrs.shape);
  e.attrs.start = e.attrs.end = sym_const(0);
  return add_node(tr, &e, file, line);
}

/* ---- hooks ---- */

static void on_op(void *ctx, op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out,
                  const char *file, int line) {
  tracer *tr = ctx;
  if (tr->failed || tr->value_dep) return;
  int buf[16];
  int *ids = n <= 16 ? buf : alloc_malloc(sizeof(int) * (size_t)n);
  if (!ids) return tfail(tr, "out of memory while tracing");
  ir_node node = {.op = (int)op, .n_in = n, .in = ids, .file = file, .line = line};
  for (int i = 0; i < n; i++)
    if ((ids[i] = node_of(tr, in[i], file, line)) < 0) goto done;
  static const op_attrs none;
  convert_attrs(tr, (int)op, &tr->g->nodes[ids[0]], a ? a : &none, &node.attrs);
  int id = add_node(tr, &node, file, line);
  if (id < 0) goto done;
  int64_t shape[MAXD];
  const ir_node *nn = &tr->g->nodes[id];
  if (nn->dtype != out->dtype || nn->ndim != out->ndim || ir_node_shape(nn, tr->vals, tr->g->n_syms, shape) ||
      memcmp(shape, out->shape, sizeof(int64_t) * (size_t)out->ndim)) {
    tfail(tr, "%s:%d: kiln_%s: the symbolic shape rule disagrees with the eager result", file, line, op_table[op].name);
    goto done;
  }
  if (map_put(&tr->map, out->serial, id) || map_put(&tr->layouts, layout_key(out), id) ||
      map_put(&tr->storages, out->st->serial + 1, id)) {
    tfail(tr, "out of memory while tracing");
    goto done;
  }
  note_shape(tr, &tr->g->nodes[id]);
done:
  if (ids != buf) alloc_free(ids);
}

/* An in-place write as a new value of dst: dst op src, src converted and
 * broadcast to dst (copy_), or value broadcast (fill_). */
static void on_inplace(void *ctx, op_id op, kiln_tensor *dst, kiln_tensor *src, double value, const char *file,
                       int line) {
  tracer *tr = ctx;
  if (tr->failed || tr->value_dep) return;
  int d = node_of(tr, dst, file, line), id;
  if (d < 0) return;
  if (atomic_load(&dst->st->refcount) > 1) {
    /* Views of it may live on (a transposed weight in a scope): fine while
     * none is used after the write. A write into a view itself would have to
     * reach the tensor it views, which compiled code does not do. */
    bool whole = dst->offset == 0 && kiln_is_contiguous(dst) &&
                 (size_t)shape_numel(dst->ndim, dst->shape) * kiln_dtype_size(dst->dtype) == dst->st->bytes;
    int k = 0;
    while (k < tr->n_stale && tr->stale[k].st != dst->st->serial) k++;
    if (!whole || k == 16)
      return tfail(tr, "%s:%d: an in-place write into a view of another tensor; compiled code does not follow writes "
                   "through views (write to a tensor of its own, or compute out of place)", file, line);
    if (k == tr->n_stale) tr->n_stale++;
    tr->stale[k].st = dst->st->serial;
    tr->stale[k].upto = tensor_serial_now();
    tr->stale[k].dst = dst->serial;
    tr->stale[k].file = file;
    tr->stale[k].line = line;
  }
  if (op == OP_COUNT) {
    kiln_tensor *s = tensor_new(dst->dtype, 0, NULL);
    if (!s) return tfail(tr, "out of memory while tracing");
    pw_fill(s, value);
    int c = make_const(tr, s, file, line);
    kiln_release(s);
    if (c < 0) return tfail(tr, "out of memory while tracing");
    id = expand_to(tr, c, d, file, line);
  } else {
    int s = node_of(tr, src, file, line);
    if (s < 0) return;
    if (op == OP_COPY) {
      if (tr->g->nodes[s].dtype != tr->g->nodes[d].dtype) {
        ir_node c = {.op = OP_CAST, .n_in = 1, .in = &s, .file = file, .line = line};
        c.attrs.dtype = tr->g->nodes[d].dtype;
        if ((s = add_node(tr, &c, file, line)) < 0) return;
      }
      id = expand_to(tr, s, d, file, line);
    } else {
      int ins[2] = {d, s};
      ir_node b = {.op = (int)op, .n_in = 2, .in = ins, .file = file, .line = line};
      id = add_node(tr, &b, file, line);
    }
  }
  if (id < 0) return;
  if (map_put(&tr->map, dst->serial, id) || map_put(&tr->layouts, layout_key(dst), id))
    tfail(tr, "out of memory while tracing");
}

static void on_read(void *ctx, const char *what, const kiln_tensor *t, const char *file, int line) {
  tracer *tr = ctx;
  (void)t;
  if (tr->value_dep) return;
  tr->value_dep = true;
  if (!tr->failed) {
    snprintf(tr->why, sizeof tr->why, "%s:%d: %s reads tensor data inside the traced function, so what it does next may "
             "depend on values: it runs eagerly from now on", file && *file ? file : "?", line, what);
  }
}

static void on_zero_grad(void *ctx, kiln_tensor *t) {
  tracer *tr = ctx;
  if (tr->failed || tr->value_dep) return;
  node_of(tr, t, "", 0); /* lift it now, so its .grad at the start of the call is what we record */
}

static void on_size_read(void *ctx, const kiln_tensor *t, int dim) {
  tracer *tr = ctx;
  int id = map_get(&tr->map, t->serial);
  if (tr->failed || tr->n_reads == 64) return;
  /* static sizes count too: a number equal to both a static and a symbolic size read is ambiguous */
  sym_dim d = id >= 0 ? tr->g->nodes[id].shape[dim] : sym_const(t->shape[dim]);
  for (int i = 0; i < tr->n_reads; i++)
    if (sym_same(tr->reads[i], d)) return;
  tr->reads[tr->n_reads++] = d;
}

static void on_numel(void *ctx, kiln_tensor *out, const kiln_tensor *x, const int *axes, int naxes, int64_t offset,
                     const char *file, int line) {
  tracer *tr = ctx;
  if (tr->failed || tr->value_dep) return;
  int xid = node_of(tr, (kiln_tensor *)x, file, line);
  if (xid < 0) return;
  ir_node n = {.op = IR_NUMEL, .dtype = out->dtype, .n_in = 1, .in = &xid, .file = file, .line = line};
  n.attrs.naxes = naxes;
  for (int i = 0; i < naxes && i < MAXD; i++) n.attrs.axes[i] = axes[i];
  n.attrs.start = sym_const(offset);
  n.attrs.end = sym_const(0);
  int id = ir_add(tr->g, &n);
  if (id < 0 || map_put(&tr->map, out->serial, id)) tfail(tr, "out of memory while tracing");
}

/* ---- the run ---- */

static void tracer_free(tracer *tr) {
  for (int i = tr->n_in; i < tr->n_leaves; i++) kiln_release(tr->leaves[i].t);
  alloc_free(tr->leaves);
  tmap *maps[3] = {&tr->map, &tr->layouts, &tr->storages};
  for (int i = 0; i < 3; i++) {
    alloc_free(maps[i]->key);
    alloc_free(maps[i]->val);
  }
  alloc_free(tr->sizes);
  ir_free(tr->g);
}

static int add_inputs(tracer *tr, kiln_tensor *const *in, int n_in) {
  for (int i = 0; i < n_in; i++) {
    kiln_tensor *t = in[i];
    ir_node n = {.op = IR_INPUT, .index = i, .dtype = t->dtype, .ndim = t->ndim, .file = "", .line = 0};
    for (int d = 0; d < t->ndim; d++) {
      n.shape[d] = sym_const(t->shape[d]);
      /* sizes 0 and 1 stay static when traced (as torch does): a 1 that
       * broadcasts cannot be told from one that does not, and formulas
       * (autograd's expand back to an input's shape) pass it as a number.
       * A variant traced at a larger size still serves 1 where no guard objects. */
      if (tr->spec->dynamic && tr->spec->dynamic[i][d] && t->shape[d] > 1) {
        int k = tr->g->n_syms;
        if (ir_add_sym(tr->g, 1, INT64_MAX, &n.shape[d])) return -1;
        tr->vals[k] = t->shape[d];
      }
    }
    int id = ir_append(tr->g, &n);
    if (id < 0) return -1;
    leaf l = {t, t->serial, id, t->grad, t->grad ? t->grad->serial : 0, -1, {t->requires_grad, t->grad != NULL}};
    if (push_leaf(tr, l)) return -1;
    tr->n_in++;
    /* the same tensor passed twice: the first input stands for both (the alias guard covers it) */
    if (map_get(&tr->map, t->serial) < 0 && map_put(&tr->map, t->serial, id)) return -1;
    note_shape(tr, &tr->g->nodes[id]);
  }
  return 0;
}

/* Leaves first (inputs, params, grads), then the rest in order. Frees g. */
static ir_graph *reorder(ir_graph *g) {
  int *order = alloc_malloc(sizeof(int) * (size_t)g->n_nodes + 1), k = 0;
  int *pos = alloc_malloc(sizeof(int) * (size_t)g->n_nodes + 1);
  ir_graph *r = ir_new(g->name);
  if (!order || !pos || !r) goto fail;
  for (int pass = IR_INPUT; pass <= IR_GRAD; pass++)
    for (int i = 0; i < g->n_nodes; i++)
      if (g->nodes[i].op == pass) order[k++] = i;
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i].op < IR_INPUT || g->nodes[i].op > IR_GRAD) order[k++] = i;
  sym_ctx_free(r->sym);
  r->sym = g->sym;
  g->sym = NULL;
  r->n_syms = g->n_syms;
  memcpy(r->sym_lo, g->sym_lo, sizeof r->sym_lo);
  memcpy(r->sym_hi, g->sym_hi, sizeof r->sym_hi);
  for (int i = 0; i < k; i++) {
    ir_node n = g->nodes[order[i]];
    int ins[64], *p = n.n_in <= 64 ? ins : alloc_malloc(sizeof(int) * (size_t)n.n_in);
    if (!p) goto fail;
    for (int j = 0; j < n.n_in; j++) p[j] = pos[n.in[j]];
    n.in = p;
    pos[order[i]] = ir_append(r, &n);
    if (p != ins) alloc_free(p);
    if (pos[order[i]] < 0) goto fail;
  }
  for (int i = 0; i < g->n_outputs; i++)
    if (ir_add_output(r, pos[g->outputs[i]])) goto fail;
  for (int i = 0; i < g->n_writes; i++) {
    ir_write w = g->writes[i];
    w.target = pos[w.target];
    if (w.value >= 0) w.value = pos[w.value];
    if (ir_add_write(r, w)) goto fail;
  }
  for (int i = 0; i < g->n_guards; i++)
    if (ir_add_guard(r, g->guards[i])) goto fail;
  alloc_free(order);
  alloc_free(pos);
  ir_free(g);
  return r;
fail:
  alloc_free(order);
  alloc_free(pos);
  ir_free(r);
  ir_free(g);
  return NULL;
}

static int finish(tracer *tr, kiln_tensor **out, int n_out) {
  ir_graph *g = tr->g;
  for (int i = 0; i < n_out; i++) {
    if (!out[i]) {
      tfail(tr, "output %d is NULL", i);
      return -1;
    }
    int id = node_of(tr, out[i], "", 0);
    if (id < 0 || ir_add_output(g, id)) return -1;
  }
  for (int i = 0; i < tr->n_leaves; i++) {
    leaf *l = &tr->leaves[i];
    int now = map_get(&tr->map, l->serial);
    if (now >= 0 && now != l->node) {
      ir_write w = {IR_WRITE_DATA, l->node, now, g->nodes[now].file, g->nodes[now].line};
      if (ir_add_write(g, w)) return -1;
    }
    kiln_tensor *gr = l->t->grad;
    bool same = gr == l->grad0 && (!gr || gr->serial == l->grad0_serial);
    int gv = -1;
    if (gr) {
      gv = map_get(&tr->map, gr->serial);
      if (same && (gv < 0 || gv == l->grad_node)) continue; /* untouched */
      if (gv < 0) gv = node_of(tr, gr, "", 0);
      if (gv < 0) return -1;
    } else if (!l->grad0) {
      continue;
    }
    if (i < tr->n_in && l->info.requires_grad == false && gr == NULL) continue;
    ir_write w = {IR_WRITE_GRAD, l->node, gv, "", 0};
    if (ir_add_write(g, w)) return -1;
  }
  return 0;
}

int trace_run(kiln_body body, void *ctx, kiln_tensor *const *in, int n_in, kiln_tensor **out, int n_out,
              const trace_spec *spec, const char *name, trace_result *res) {
  memset(res, 0, sizeof *res);
  tracer tr = {.spec = spec, .serial0 = tensor_serial_now()};
  tr.g = ir_new(name);
  tr.hooks = (trace_hooks){&tr, on_op, on_inplace, on_read, on_zero_grad, on_numel, on_size_read};
  if (!tr.g || add_inputs(&tr, in, n_in)) tfail(&tr, "out of memory while tracing");

  const trace_hooks *saved = dispatch_hooks();
  dispatch_set_hooks(&tr.hooks);
  int rc = body(ctx, in, out);
  dispatch_set_hooks(saved);

  if (rc == 0 && !tr.failed && !tr.value_dep && finish(&tr, out, n_out)) tfail(&tr, "out of memory while tracing");
  res->value_dependent = tr.value_dep;
  if (rc == 0 && !tr.failed && !tr.value_dep) {
    res->in_leaf = alloc_calloc((size_t)n_in + 1, sizeof *res->in_leaf);
    res->param_leaf = alloc_calloc((size_t)tr.n_params + 1, sizeof *res->param_leaf);
    res->params = alloc_calloc((size_t)tr.n_params + 1, sizeof *res->params);
    /* reorder takes tr.g (and frees it, even when it fails) */
    ir_graph *g = res->in_leaf && res->param_leaf && res->params ? reorder(tr.g) : (ir_free(tr.g), NULL);
    tr.g = NULL;
    if (g) {
      for (int i = 0; i < n_in; i++) res->in_leaf[i] = tr.leaves[i].info;
      for (int i = 0; i < tr.n_params; i++) {
        res->params[i] = kiln_retain(tr.leaves[n_in + i].t);
        res->param_leaf[i] = tr.leaves[n_in + i].info;
      }
      memcpy(res->vals, tr.vals, sizeof res->vals);
      res->g = g;
    } else {
      snprintf(res->why, sizeof res->why, "out of memory while tracing");
    }
  } else if (rc == 0) {
    snprintf(res->why, sizeof res->why, "%s", tr.why);
  }
  tracer_free(&tr);
  if (!res->g) {
    alloc_free(res->in_leaf);
    alloc_free(res->param_leaf);
    alloc_free(res->params);
    res->in_leaf = res->param_leaf = NULL;
    res->params = NULL;
  }
  return rc;
}

void trace_result_free(trace_result *res) {
  if (res->g)
    for (int i = 0; i < res->g->n_params; i++) kiln_release(res->params[i]);
  alloc_free(res->params);
  alloc_free(res->in_leaf);
  alloc_free(res->param_leaf);
  ir_free(res->g);
  memset(res, 0, sizeof *res);
}
