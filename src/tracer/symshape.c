/* The op table's shape rules (eager/shape.c) run over a graph's symbolic
 * dims. Where a rule has to decide about a symbol (is s0 1? is s0 equal to
 * s1?) shape_decide answers from the bounds, then from the graph's guards,
 * then from the traced values (and records the guard that answer needs), as
 * torch's ShapeEnv does. */
#include <stddef.h>
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

static int fail(char *err, size_t errn, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t errn, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errn, fmt, ap);
  va_end(ap);
  return -1;
}

static int decide_in_graph(dim_env *d, sym_dim a, sym_cmp op, sym_dim b) {
  shape_env *env = (shape_env *)((char *)d - offsetof(shape_env, dims));
  return shape_decide(env, a, op, b);
}

int symshape_infer(shape_env *env, ir_node *n, char *err, size_t errn) {
  ir_graph *g = env->g;
  const char *name = ir_op_name(n->op);
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
  if (n->n_in < 1) return fail(err, errn, "%s: no inputs", name);
  for (int i = 0; i < n->n_in; i++)
    if (n->in[i] < 0 || n->in[i] >= g->n_nodes) return fail(err, errn, "%s: input %d is not defined", name, i);
  shape_arg small[4], *args = n->n_in <= 4 ? small : alloc_malloc(sizeof *args * (size_t)n->n_in), out = {0};
  if (!args) return fail(err, errn, "%s: out of memory", name);
  for (int i = 0; i < n->n_in; i++) {
    const ir_node *x = &g->nodes[n->in[i]];
    args[i].dtype = x->dtype;
    args[i].ndim = x->ndim;
    memcpy(args[i].shape, x->shape, sizeof args[i].shape);
  }
  env->dims = (dim_env){g->sym, decide_in_graph};
  char why[400];
  int rc = shape_infer(&env->dims, (op_id)n->op, args, n->n_in, &n->attrs, &out, why, sizeof why);
  if (args != small) alloc_free(args);
  if (rc) return fail(err, errn, "%s: %s", name, why);
  n->dtype = out.dtype;
  n->ndim = out.ndim;
  memcpy(n->shape, out.shape, sizeof n->shape);
  return 0;
}
