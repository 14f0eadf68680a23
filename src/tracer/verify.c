/* The IR verifier: checks that a graph means what its nodes say. Inputs are
 * defined before use, leaves sit at the front in order, arities match the op
 * table, every symbol is declared, and each op node's dtype, rank and dims
 * are what its shape rule (symshape_infer) gives from its inputs. Test builds
 * run it between passes (passes.c), so a pass that breaks the graph is named.
 *
 * Shape rules decide from bounds and guards only (vals == NULL). Where that is
 * not enough, the node is checked at one assignment of the symbols that
 * satisfies the bounds and guards (a witness); with no witness found, the
 * declared dims are accepted: the runtime binds the sizes and checks them. */
#include <ctype.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "tracer/tracer.h"

typedef struct verifier {
  ir_graph *g; /* shape rules may add expressions to g->sym: nothing else changes */
  char *err;
  size_t errn;
  int witness_state; /* 0 not searched yet, 1 found, -1 none */
  int64_t witness[IR_MAX_SYMS];
} verifier;

static int fail(verifier *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(verifier *v, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (v->errn) vsnprintf(v->err, v->errn, fmt, ap);
  va_end(ap);
  return -1;
}

static bool is_leaf(int op) { return op == IR_INPUT || op == IR_PARAM || op == IR_GRAD; }

/* The text of d for a message ("?" for the error dim), truncated to n. */
static const char *dim_text(sym_dim d, char *buf, size_t n) {
  if (sym_print(d, buf, n) < 0) snprintf(buf, n, "?");
  return buf;
}

/* The first symbol id in d that g does not declare, -1 when all are declared,
 * -2 when d cannot be printed (the error dim, or out of memory). Symbols are
 * read off the text: `s` followed by digits is nothing else in the grammar. */
static long undeclared_symbol(const ir_graph *g, sym_dim d) {
  if (sym_is_const(d)) return -1;
  char buf[512], *text = buf;
  int len = sym_print(d, buf, sizeof buf);
  if (len < 0) return -2;
  if ((size_t)len >= sizeof buf) {
    text = alloc_malloc((size_t)len + 1);
    if (!text) return -2;
    sym_print(d, text, (size_t)len + 1);
  }
  long bad = -1;
  for (const char *p = text; *p && bad < 0; p++) {
    if (*p != 's' || !isdigit((unsigned char)p[1])) continue;
    char *end;
    long id = strtol(p + 1, &end, 10);
    if (id >= g->n_syms) bad = id;
    p = end - 1;
  }
  if (text != buf) alloc_free(text);
  return bad;
}

/* Checks one dim of a node ("dim 2", "reshape target 1", ...); 0 or -1. */
static int check_dim(verifier *v, int id, const char *what, int k, sym_dim d) {
  const char *op = ir_op_name(v->g->nodes[id].op);
  if (sym_is_err(d)) return fail(v, "%%%d: %s: %s %d is the error dim", id, op, what, k);
  if (sym_is_const(d)) return d.c < 0 ? fail(v, "%%%d: %s: %s %d is negative (%lld)", id, op, what, k, (long long)d.c) : 0;
  long s = undeclared_symbol(v->g, d);
  if (s == -2) return fail(v, "%%%d: %s: %s %d cannot be printed (out of memory?)", id, op, what, k);
  if (s >= 0) return fail(v, "%%%d: %s: %s %d uses s%ld, which is not declared (%d symbols)", id, op, what, k, s, v->g->n_syms);
  return 0;
}

/* Finds symbol values within the bounds that satisfy every guard, trying a
 * few simple assignments (all equal, or all distinct); 1 found, -1 none. */
static int find_witness(verifier *v) {
  if (v->witness_state) return v->witness_state;
  const ir_graph *g = v->g;
  static const int64_t bases[] = {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256, 1024};
  v->witness_state = -1;
  for (int distinct = 0; distinct < 2 && v->witness_state < 0; distinct++)
    for (size_t b = 0; b < sizeof bases / sizeof bases[0] && v->witness_state < 0; b++) {
      for (int i = 0; i < g->n_syms; i++) {
        int64_t x = bases[b] + (distinct ? i : 0);
        v->witness[i] = x < g->sym_lo[i] ? g->sym_lo[i] : x > g->sym_hi[i] ? g->sym_hi[i] : x;
      }
      bool ok = true;
      for (int k = 0; k < g->n_guards && ok; k++) ok = sym_guard_check(&g->guards[k], v->witness, g->n_syms) == 1;
      if (ok) v->witness_state = 1;
    }
  return v->witness_state;
}

/* Whether the declared dim d agrees with the rule's r: provably, by a guard,
 * or (undecidable) at the witness; accepted when there is no witness. */
static bool dims_agree(verifier *v, sym_dim d, sym_dim r) {
  if (sym_same(d, r)) return true;
  shape_env env = {.g = v->g, .vals = NULL, .nvals = 0, .record = false};
  int same = shape_decide(&env, d, SYM_EQ, r);
  if (same >= 0) return same == 1;
  if (find_witness(v) < 0) return true;
  int64_t a, b;
  return sym_eval(d, v->witness, v->g->n_syms, &a) == 0 && sym_eval(r, v->witness, v->g->n_syms, &b) == 0 && a == b;
}

/* An op node against its shape rule: dtype, rank, then each dim. */
static int check_rule(verifier *v, int id) {
  const ir_node *n = &v->g->nodes[id];
  const char *op = ir_op_name(n->op);
  ir_node r = *n;
  r.dtype = 0;
  r.ndim = 0;
  memset(r.shape, 0, sizeof r.shape);
  char why[384];
  shape_env env = {.g = v->g, .vals = NULL, .nvals = 0, .record = false};
  if (symshape_infer(&env, &r, why, sizeof why)) {
    /* undecidable from bounds and guards, or wrong: try concrete sizes */
    if (find_witness(v) < 0) return 0;
    env.vals = v->witness;
    env.nvals = v->g->n_syms;
    r = *n;
    r.dtype = 0;
    r.ndim = 0;
    memset(r.shape, 0, sizeof r.shape);
    if (symshape_infer(&env, &r, why, sizeof why)) return fail(v, "%%%d: %s", id, why);
  }
  if (r.dtype != n->dtype)
    return fail(v, "%%%d: %s: dtype %s, but the rule gives %s", id, op, kiln_dtype_name(n->dtype), kiln_dtype_name(r.dtype));
  if (r.ndim != n->ndim) return fail(v, "%%%d: %s: rank %d, but the rule gives %d", id, op, n->ndim, r.ndim);
  for (int i = 0; i < n->ndim; i++)
    if (!dims_agree(v, n->shape[i], r.shape[i])) {
      char b0[128], b1[128];
      return fail(v, "%%%d: %s: dim %d is %s, but the rule gives %s", id, op, i, dim_text(n->shape[i], b0, sizeof b0),
                  dim_text(r.shape[i], b1, sizeof b1));
    }
  return 0;
}

/* What any node must satisfy: op, inputs before it, arity, dtype, dims, symbols. */
static int check_node(verifier *v, int id) {
  const ir_node *n = &v->g->nodes[id];
  if (n->op < 0 || n->op >= IR_OP_COUNT) return fail(v, "%%%d: unknown op %d", id, n->op);
  const char *op = ir_op_name(n->op);
  if (n->n_in < 0 || n->n_in > IR_MAX_IN || (n->n_in > 0 && !n->in)) return fail(v, "%%%d: %s: bad input list (%d)", id, op, n->n_in);
  for (int j = 0; j < n->n_in; j++)
    if (n->in[j] < 0 || n->in[j] >= id)
      return fail(v, "%%%d: %s: input %d is %%%d, which is not defined before it", id, op, j, n->in[j]);
  int want = n->op < OP_COUNT ? op_table[n->op].arity
             : (n->op == IR_GRAD || n->op == IR_NUMEL || n->op == IR_GET) ? 1
             : ir_is_cf(n->op) ? -1 : 0;
  if (want >= 0 && n->n_in != want) return fail(v, "%%%d: %s: takes %d inputs, has %d", id, op, want, n->n_in);
  if (want < 0 && n->n_in < 1) return fail(v, "%%%d: %s: needs at least one input", id, op);
  if (!dtype_valid(n->dtype)) return fail(v, "%%%d: %s: unknown dtype %d", id, op, (int)n->dtype);
  if (n->ndim < 0 || n->ndim > MAXD) return fail(v, "%%%d: %s: rank %d is outside 0..%d", id, op, n->ndim, MAXD);
  for (int i = 0; i < n->ndim; i++)
    if (check_dim(v, id, "dim", i, n->shape[i])) return -1;
  const op_attrs *a = &n->attrs;
  unsigned f = ir_attr_fields(n->op);
  if (((f & AF_SHAPE) && (a->ndim < 0 || a->ndim > MAXD)) || ((f & AF_AXES) && (a->naxes < 0 || a->naxes > MAXD)) ||
      ((f & AF_INTS) && (a->nints < 0 || a->nints > 2 * MAXD)))
    return fail(v, "%%%d: %s: an attribute list's length is out of range", id, op);
  for (int i = 0; (f & AF_SHAPE) && i < a->ndim; i++)
    if (check_dim(v, id, "target dim", i, a->shape[i])) return -1;
  if ((f & AF_END) && (check_dim(v, id, "slice bound", 0, a->start) || check_dim(v, id, "slice bound", 1, a->end))) return -1;
  return 0;
}

/* Leaves: kinds at the front, indices in order, grads of inputs and params. */
static int check_leaves(verifier *v) {
  const ir_graph *g = v->g;
  int n_in = 0, n_par = 0, first_other = -1;
  for (int id = 0; id < g->n_nodes; id++) {
    const ir_node *n = &g->nodes[id];
    if (!is_leaf(n->op)) {
      if (first_other < 0) first_other = id;
      continue;
    }
    const char *op = ir_op_name(n->op);
    if (first_other >= 0) return fail(v, "%%%d: %s: leaf after %%%d, which is not a leaf", id, op, first_other);
    if (n->op == IR_INPUT && n->index != n_in++)
      return fail(v, "%%%d: input: index %d, expected %d", id, n->index, n_in - 1);
    if (n->op == IR_PARAM && n->index != n_par++)
      return fail(v, "%%%d: param: index %d, expected %d", id, n->index, n_par - 1);
    if (n->op == IR_GRAD) {
      const ir_node *p = &g->nodes[n->in[0]];
      if (p->op != IR_PARAM && p->op != IR_INPUT)
        return fail(v, "%%%d: grad: %%%d is a %s, not a param or input", id, n->in[0], ir_op_name(p->op));
      bool same = p->dtype == n->dtype && p->ndim == n->ndim;
      for (int i = 0; same && i < n->ndim; i++) same = sym_same(p->shape[i], n->shape[i]);
      if (!same) return fail(v, "%%%d: grad: dtype or shape differs from its leaf %%%d", id, n->in[0]);
    }
  }
  if (n_in != g->n_inputs || n_par != g->n_params)
    return fail(v, "graph: %d inputs and %d params, but the counts say %d and %d", n_in, n_par, g->n_inputs, g->n_params);
  return 0;
}

/* Same dtype and shape: each dim the same, or equal by the graph's guards
 * (a value broadcast against a carried input whose size a guard pins). */
static bool same_type(verifier *v, const ir_node *a, const ir_node *b) {
  if (a->dtype != b->dtype || a->ndim != b->ndim) return false;
  for (int i = 0; i < a->ndim; i++)
    if (!sym_same(a->shape[i], b->shape[i])) {
      shape_env env = {.g = v->g, .vals = NULL, .nvals = 0, .record = false};
      if (shape_decide(&env, a->shape[i], SYM_EQ, b->shape[i]) != 1) return false;
    }
  return true;
}

static int check_outputs_writes(verifier *v) {
  const ir_graph *g = v->g;
  if (g->n_outputs < 0 || (g->n_outputs > 0 && !g->outputs)) return fail(v, "graph: bad output list");
  for (int i = 0; i < g->n_outputs; i++)
    if (g->outputs[i] < 0 || g->outputs[i] >= g->n_nodes) return fail(v, "output %d: %%%d is not a node", i, g->outputs[i]);
  if (g->n_writes < 0 || (g->n_writes > 0 && !g->writes)) return fail(v, "graph: bad write list");
  for (int i = 0; i < g->n_writes; i++) {
    const ir_write *w = &g->writes[i];
    if (w->target < 0 || w->target >= g->n_nodes) return fail(v, "write %d: target %%%d is not a node", i, w->target);
    const ir_node *t = &g->nodes[w->target];
    if (t->op != IR_INPUT && t->op != IR_PARAM)
      return fail(v, "write %d: target %%%d is a %s, not an input or param", i, w->target, ir_op_name(t->op));
    if (w->kind != IR_WRITE_DATA && w->kind != IR_WRITE_GRAD) return fail(v, "write %d: unknown kind %d", i, (int)w->kind);
    if ((w->has_cond || w->has_when || w->else_none) && (w->kind != IR_WRITE_GRAD || w->value < 0))
      return fail(v, "write %d: only a grad write of a value has a condition", i);
    if (w->has_cond) {
      if (w->has_when || w->cond < 0 || w->cond >= g->n_nodes) return fail(v, "write %d: condition %%%d is not a node", i, w->cond);
      const ir_node *c = &g->nodes[w->cond];
      bool one = c->dtype == KILN_BOOL;
      for (int d = 0; d < c->ndim; d++) one = one && sym_same(c->shape[d], sym_const(1));
      if (!one) return fail(v, "write %d: condition %%%d is not a one-element bool", i, w->cond);
    }
    if (w->value == -1 && w->kind == IR_WRITE_GRAD) continue;
    if (w->value < 0 || w->value >= g->n_nodes) return fail(v, "write %d: value %%%d is not a node", i, w->value);
    if (!same_type(v, t, &g->nodes[w->value]))
      return fail(v, "write %d: value %%%d differs from target %%%d in dtype or shape", i, w->value, w->target);
  }
  return 0;
}

static int check_guards(verifier *v) {
  const ir_graph *g = v->g;
  if (g->n_guards < 0 || (g->n_guards > 0 && !g->guards)) return fail(v, "graph: bad guard list");
  for (int i = 0; i < g->n_guards; i++) {
    const sym_guard *gd = &g->guards[i];
    if ((unsigned)gd->op > SYM_DIVIDES) return fail(v, "guard %d: unknown relation %d", i, (int)gd->op);
    sym_dim side[2] = {gd->lhs, gd->rhs};
    for (int k = 0; k < 2; k++) {
      if (sym_is_err(side[k])) return fail(v, "guard %d: the error dim", i);
      long s = undeclared_symbol(g, side[k]);
      if (s == -2) return fail(v, "guard %d: cannot be printed (out of memory?)", i);
      if (s >= 0) return fail(v, "guard %d: uses s%ld, which is not declared (%d symbols)", i, s, g->n_syms);
    }
    int64_t lo, hi;
    sym_bounds(gd->rhs, &lo, &hi);
    if (gd->op == SYM_DIVIDES && lo < 1) return fail(v, "guard %d: divisor is not provably positive", i);
  }
  return 0;
}

/* ---- control flow ---- */

static bool same_type(verifier *v, const ir_node *a, const ir_node *b);

static const char *type_text(const ir_node *t, char *buf, size_t n) {
  size_t k = (size_t)snprintf(buf, n, "%s[", kiln_dtype_name(t->dtype));
  for (int i = 0; i < t->ndim && k < n; i++) {
    char d[64];
    k += (size_t)snprintf(buf + k, n - k, "%s%s", i ? "," : "", dim_text(t->shape[i], d, sizeof d));
  }
  if (k < n) snprintf(buf + k, n - k, "]");
  return buf;
}

/* "%5 (rnn.c:30)": a region node and the user's line that made it. */
static const char *where_text(const ir_graph *r, int id, char *buf, size_t n) {
  const ir_node *x = &r->nodes[id];
  if (x->file && *x->file)
    snprintf(buf, n, "%%%d (%s:%d)", id, x->file, x->line);
  else
    snprintf(buf, n, "%%%d", id);
  return buf;
}

/* Region i of control-flow node id: a region of inputs only, taking the
 * arguments the node gives it, and itself valid (its symbols and guards
 * the parent's). */
static int check_region(verifier *v, int id, int i) {
  ir_graph *g = v->g, *r = g->nodes[id].sub[i];
  const char *op = ir_op_name(g->nodes[id].op), *rn = ir_sub_name(g->nodes[id].op, i);
  if (!r) return fail(v, "%%%d: %s: region '%s' is missing", id, op, rn);
  if (!r->region || r->sym != g->sym) return fail(v, "%%%d: %s: region '%s' does not share the graph's symbols", id, op, rn);
  if (r->n_params || r->n_writes || r->n_guards)
    return fail(v, "%%%d: %s: region '%s' has params, writes or guards (a region takes arguments only)", id, op, rn);
  int want = ir_cf_n_args(g, id, i);
  if (r->n_inputs != want) return fail(v, "%%%d: %s: region '%s' takes %d arguments, the node gives %d", id, op, rn, r->n_inputs, want);
  for (int j = 0; j < want; j++) {
    ir_node t = {0};
    char b0[256], b1[256];
    if (ir_cf_arg_type(g, id, i, j, &t)) return fail(v, "%%%d: %s: argument %d of region '%s' has no type (xs 0-d?)", id, op, j, rn);
    if (j >= r->n_nodes || r->nodes[j].op != IR_INPUT || !same_type(v, &r->nodes[j], &t))
      return fail(v, "%%%d: %s: region '%s' takes argument %d as %s, the node gives %s", id, op, rn, j,
                  j < r->n_nodes ? type_text(&r->nodes[j], b0, sizeof b0) : "nothing", type_text(&t, b1, sizeof b1));
  }
  ir_region_sync(r, g);
  /* the region's dims are decided under the parent's guards */
  sym_guard *own = r->guards;
  r->guards = g->guards;
  r->n_guards = g->n_guards;
  char why[768];
  int rc = ir_verify(r, why, sizeof why);
  r->guards = own;
  r->n_guards = 0;
  if (rc) return fail(v, "%%%d: %s: region '%s': %s", id, op, rn, why);
  return 0;
}

/* Output k of region r has type t, or the error names both lines. */
static int check_region_out(verifier *v, int id, const ir_graph *r, int k, const ir_node *t, const char *what,
                            const ir_graph *tr, int tid) {
  const ir_node *o = &r->nodes[r->outputs[k]];
  if (same_type(v, o, t)) return 0;
  char b0[256], b1[256], w0[192], w1[192];
  return fail(v, "%%%d: %s: %s: %s's output %d is %s at %s, but %s at %s", id, ir_op_name(v->g->nodes[id].op), what,
              r->name, k, type_text(o, b0, sizeof b0), where_text(r, r->outputs[k], w0, sizeof w0), type_text(t, b1, sizeof b1),
              tr ? where_text(tr, tid, w1, sizeof w1) : "its input");
}

static int check_cf(verifier *v, int id) {
  ir_graph *g = v->g;
  const ir_node *n = &g->nodes[id];
  const char *op = ir_op_name(n->op);
  for (int i = 0; i < 2; i++)
    if ((i < ir_n_sub(n->op)) != (n->sub[i] != NULL)) return fail(v, "%%%d: %s: has %s region %d", id, op, n->sub[i] ? "an extra" : "no", i);
  if (n->op == IR_COND) {
    const ir_node *p = &g->nodes[n->in[0]];
    if (p->dtype != KILN_BOOL || ir_node_numel_const(p) != 1)
      return fail(v, "%%%d: cond: the predicate %%%d must be a one-element bool", id, n->in[0]);
  } else {
    int lo = n->op == IR_WHILE ? 1 : 0, need = n->n_carry + (n->op == IR_SCAN ? n->n_xs : 0);
    if (n->n_carry < lo || n->n_xs < (n->op == IR_SCAN) || need > n->n_in)
      return fail(v, "%%%d: %s: carry=%d, xs=%d do not fit its %d inputs", id, op, n->n_carry, n->n_xs, n->n_in);
  }
  for (int i = 0; i < ir_n_sub(n->op); i++)
    if (check_region(v, id, i)) return -1;
  const ir_graph *r0 = n->sub[0], *r1 = n->sub[1];
  if (n->op == IR_COND) {
    if (r0->n_outputs != r1->n_outputs)
      return fail(v, "%%%d: cond: then gives %d results, else %d", id, r0->n_outputs, r1->n_outputs);
    for (int k = 0; k < r0->n_outputs; k++)
      if (check_region_out(v, id, r1, k, &r0->nodes[r0->outputs[k]], "the branches disagree", r0, r0->outputs[k])) return -1;
  } else if (n->op == IR_WHILE) {
    if (r0->n_outputs != 1) return fail(v, "%%%d: while: cond gives %d results, not 1", id, r0->n_outputs);
    const ir_node *p = &r0->nodes[r0->outputs[0]];
    if (p->dtype != KILN_BOOL || ir_node_numel_const(p) != 1)
      return fail(v, "%%%d: while: cond's output %%%d must be a one-element bool", id, r0->outputs[0]);
    if (r1->n_outputs != n->n_carry) return fail(v, "%%%d: while: body gives %d results for %d carried", id, r1->n_outputs, n->n_carry);
    for (int k = 0; k < n->n_carry; k++)
      if (check_region_out(v, id, r1, k, &r1->nodes[k], "the carry changes", r1, k)) return -1;
  } else {
    if (r0->n_outputs < n->n_carry || r0->n_outputs < 1)
      return fail(v, "%%%d: scan: body gives %d results for %d carried", id, r0->n_outputs, n->n_carry);
    for (int k = 0; k < n->n_carry; k++)
      if (check_region_out(v, id, r0, k, &r0->nodes[k], "the carry changes", r0, k)) return -1;
    const ir_node *x0 = &g->nodes[n->in[n->n_carry]];
    for (int j = 1; j < n->n_xs; j++) {
      const ir_node *x = &g->nodes[n->in[n->n_carry + j]];
      shape_env env = {.g = g, .vals = NULL, .nvals = 0, .record = false}; /* equal by a guard will do */
      if (x->ndim < 1 || x0->ndim < 1 ||
          (!sym_same(x->shape[0], x0->shape[0]) && shape_decide(&env, x->shape[0], SYM_EQ, x0->shape[0]) != 1))
        return fail(v, "%%%d: scan: xs %d (%%%d) and xs 0 (%%%d) differ in dim 0", id, j, n->in[n->n_carry + j], n->in[n->n_carry]);
    }
    for (int k = n->n_carry; k < r0->n_outputs; k++)
      if (r0->nodes[r0->outputs[k]].ndim >= MAXD) return fail(v, "%%%d: scan: y %d would stack to more than %d dims", id, k - n->n_carry, MAXD);
  }
  return 0;
}

/* A tuple is read by get nodes only; a get reads a result that exists, at its type. */
static int check_tuples(verifier *v) {
  const ir_graph *g = v->g;
  for (int id = 0; id < g->n_nodes; id++) {
    const ir_node *n = &g->nodes[id];
    for (int j = 0; j < n->n_in; j++) {
      bool tup = ir_is_cf(g->nodes[n->in[j]].op);
      if (n->op == IR_GET && !tup) return fail(v, "%%%d: get: %%%d is not a cond, while or scan", id, n->in[j]);
      if (n->op != IR_GET && tup) return fail(v, "%%%d: %s: input %d is the tuple %%%d (read it with get)", id, ir_op_name(n->op), j, n->in[j]);
    }
    if (n->op != IR_GET) continue;
    ir_node t = {0};
    if (ir_cf_result_type(g, n->in[0], (int)n->attrs.k, &t))
      return fail(v, "%%%d: get: %%%d has no result %lld", id, n->in[0], (long long)n->attrs.k);
    if (!same_type(v, n, &t)) {
      char b0[256], b1[256];
      return fail(v, "%%%d: get: type %s, but result %lld of %%%d is %s", id, type_text(n, b0, sizeof b0), (long long)n->attrs.k,
                  n->in[0], type_text(&t, b1, sizeof b1));
    }
  }
  for (int i = 0; i < g->n_outputs; i++)
    if (g->outputs[i] >= 0 && g->outputs[i] < g->n_nodes && ir_is_cf(g->nodes[g->outputs[i]].op))
      return fail(v, "output %d: %%%d is a tuple (read it with get)", i, g->outputs[i]);
  return 0;
}

int ir_verify(const ir_graph *g, char *err, size_t errn) {
  verifier v = {(ir_graph *)g, err, errn, 0, {0}};
  if (errn) err[0] = '\0';
  if (!g) return fail(&v, "graph: NULL");
  if (!g->sym || g->n_syms < 0 || g->n_syms > IR_MAX_SYMS) return fail(&v, "graph: %d symbols", g->n_syms);
  for (int i = 0; i < g->n_syms; i++)
    if (g->sym_lo[i] > g->sym_hi[i])
      return fail(&v, "graph: s%d has bounds %lld..%lld", i, (long long)g->sym_lo[i], (long long)g->sym_hi[i]);
  if (g->n_nodes < 0 || (g->n_nodes > 0 && !g->nodes)) return fail(&v, "graph: bad node list");
  for (int id = 0; id < g->n_nodes; id++)
    if (check_node(&v, id)) return -1;
  if (check_leaves(&v) || check_guards(&v)) return -1;
  for (int id = 0; id < g->n_nodes; id++) {
    const ir_node *n = &g->nodes[id];
    if (n->op == IR_CONST) {
      if (ir_node_numel_const(n) < 0) return fail(&v, "%%%d: const: shape is not concrete", id);
      if (!n->data) return fail(&v, "%%%d: const: no data", id);
    } else if (n->op < OP_COUNT && check_rule(&v, id)) {
      return -1;
    } else if (ir_is_cf(n->op) && check_cf(&v, id)) {
      return -1;
    }
  }
  if (check_tuples(&v)) return -1;
  return check_outputs_writes(&v);
}

/* Each op node's dtype and dims at the sizes vals against its shape rule: for
 * a backend that trusts the declared shapes, where ir_verify accepted dims it
 * could not decide. Adds expressions to g->sym (callers serialize). 0, or -1
 * with why in err. */
int ir_verify_at(ir_graph *g, const int64_t *vals, char *err, size_t errn) {
  shape_env env = {.g = g, .vals = vals, .nvals = g->n_syms, .record = false};
  for (int id = 0; id < g->n_nodes; id++) {
    const ir_node *n = &g->nodes[id];
    if (n->op >= OP_COUNT) continue;
    ir_node r = *n;
    r.dtype = 0;
    r.ndim = 0;
    memset(r.shape, 0, sizeof r.shape);
    char why[384];
    if (symshape_infer(&env, &r, why, sizeof why)) return snprintf(err, errn, "%%%d: %s", id, why), -1;
    int64_t want[MAXD] = {0}, got[MAXD] = {0};
    bool same = r.dtype == n->dtype && r.ndim == n->ndim && !ir_node_shape(&r, vals, g->n_syms, want) &&
                !ir_node_shape(n, vals, g->n_syms, got);
    for (int i = 0; same && i < n->ndim; i++) same = want[i] == got[i];
    if (same && (op_table[n->op].kind == KIND_POINTWISE || op_table[n->op].kind == KIND_MATMUL)) {
      /* a symbolic input dim that is 1 here while the output's is not: the
       * compiled kernels read it as full-size, broadcasting only constant 1s */
      int skip = op_table[n->op].kind == KIND_MATMUL ? 2 : 0; /* matmul: the batch dims */
      for (int j = 0; j < n->n_in; j++) {
        const ir_node *x = &g->nodes[n->in[j]];
        for (int i = 0; i < x->ndim - skip && i < n->ndim - skip; i++) {
          sym_dim xd = x->shape[x->ndim - skip - 1 - i], od = n->shape[n->ndim - skip - 1 - i];
          int64_t xv, ov;
          if (sym_is_const(xd) || sym_same(xd, od) || sym_eval(xd, vals, g->n_syms, &xv) || sym_eval(od, vals, g->n_syms, &ov))
            continue;
          if (xv != ov) {
            char b0[64];
            sym_print(xd, b0, sizeof b0);
            return snprintf(err, errn, "%%%d: %s: input %d's dim %s is %lld here and broadcasts, which only a constant 1 may",
                            id, ir_op_name(n->op), j, b0, (long long)xv), -1;
          }
        }
      }
    }
    if (!same) {
      char b0[SHAPE_BUF], b1[SHAPE_BUF];
      return snprintf(err, errn, "%%%d: %s: the graph says %s%s, the rule gives %s%s at these sizes", id,
                      ir_op_name(n->op), kiln_dtype_name(n->dtype), err_shape(b0, n->ndim, got), kiln_dtype_name(r.dtype),
                      err_shape(b1, r.ndim, want)), -1;
    }
  }
  return 0;
}
