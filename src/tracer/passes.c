/* Graph passes between the trace and a backend: simplify (algebraic
 * identities and view chains), fold (evaluate small constant subgraphs with
 * the eager kernels), cse (merge equal nodes) and dce (drop what no output or
 * write reaches). pass_pipeline lists them in order, each run on the graph
 * and then on every region inside it; test builds run the verifier (which
 * walks the regions too) after each one.
 *
 * simplify, fold and cse rebuild the graph node by node in topological order
 * through ir_add, so each node's inputs are already rewritten when it is met
 * and equal nodes merge on the way. A rewrite replaces a node only by one of
 * exactly the same dtype and shape; leaves are copied as they are. */
#include <math.h>
#include <string.h>

#include "tracer/tracer.h"

enum {
  FOLD_MAX_NUMEL = 4096,   /* fold a node only when its result is at most this big */
  SIMPLIFY_MAX_ROUNDS = 8, /* one round reaches the fixed point; the next one confirms it */
  SIMPLIFY_MAX_STEPS = 64  /* rewrites of one node in a row (each shortens a view chain) */
};

static bool is_leaf(int op) { return op == IR_INPUT || op == IR_PARAM || op == IR_GRAD; }

static bool same_type(const ir_node *a, const ir_node *b) {
  if (a->dtype != b->dtype || a->ndim != b->ndim) return false;
  for (int i = 0; i < a->ndim; i++)
    if (!sym_same(a->shape[i], b->shape[i])) return false;
  return true;
}

/* ---- rebuilding ---------------------------------------------------------- */

/* What node n (its inputs already dst's ids) becomes: appends it, or what
 * replaces it, to dst and returns the id; -1 on out of memory. Counts the
 * rewrites it made in *changed. */
typedef int (*rewrite_fn)(ir_graph *dst, ir_node *n, int *changed);

/* A new graph with every op node of src passed through rw (or just
 * interned when rw is NULL), outputs and writes following their nodes.
 * Frees src; NULL on out of memory. */
static ir_graph *rebuild_in(ir_graph *src, const int *order, rewrite_fn rw, int *changed);

static ir_graph *rebuild(ir_graph *src, rewrite_fn rw, int *changed) { return rebuild_in(src, NULL, rw, changed); }

/* The src id of the node a rewrite_fn is given (for a rule that looked at src first). */
static _Thread_local int rebuild_at;

/* The same, taking src's nodes in order[] (a topological order; NULL: their own). */
static ir_graph *rebuild_in(ir_graph *src, const int *order, rewrite_fn rw, int *changed) {
  *changed = 0;
  int max_in = 1;
  for (int i = 0; i < src->n_nodes; i++)
    if (src->nodes[i].n_in > max_in) max_in = src->nodes[i].n_in;
  int *map = alloc_malloc(sizeof(int) * ((size_t)src->n_nodes + 1));
  int *ins = alloc_malloc(sizeof(int) * (size_t)max_in);
  ir_graph *dst = map && ins ? ir_new_like(src) : NULL;
  if (!dst) goto oom;
  for (int o = 0; o < src->n_nodes; o++) {
    int i = order ? order[o] : o;
    ir_node n = src->nodes[i];
    for (int j = 0; j < n.n_in; j++) ins[j] = map[n.in[j]];
    n.in = ins;
    rebuild_at = i;
    map[i] = rw && n.op < OP_COUNT ? rw(dst, &n, changed) : ir_add(dst, &n);
    if (map[i] < 0) goto oom;
  }
  if (ir_copy_tail(dst, src, map)) goto oom;
  alloc_free(map);
  alloc_free(ins);
  ir_free(src);
  return dst;
oom:
  alloc_free(map);
  alloc_free(ins);
  ir_free(dst);
  ir_free(src);
  return NULL;
}

/* ---- dce ------------------------------------------------------------------ */

ir_graph *pass_dce(ir_graph *g) {
  bool *keep = alloc_calloc((size_t)g->n_nodes + 1, sizeof *keep);
  if (!keep) {
    ir_free(g);
    return NULL;
  }
  for (int i = 0; i < g->n_outputs; i++) keep[g->outputs[i]] = true;
  for (int i = 0; i < g->n_writes; i++) {
    int r[2], n = ir_write_reads(&g->writes[i], r);
    keep[g->writes[i].target] = true;
    for (int k = 0; k < n; k++) keep[r[k]] = true;
  }
  int kept = 0;
  for (int i = g->n_nodes - 1; i >= 0; i--) {
    /* leaves are the calling convention: a variant takes every input and param */
    if (is_leaf(g->nodes[i].op)) keep[i] = true;
    if (!keep[i]) continue;
    kept++;
    for (int j = 0; j < g->nodes[i].n_in; j++) keep[g->nodes[i].in[j]] = true;
  }
  ir_graph *r = g;
  if (kept < g->n_nodes) {
    r = ir_compact(g, keep);
    ir_free(g);
  }
  alloc_free(keep);
  return r;
}

/* ---- cse ------------------------------------------------------------------ */

ir_graph *pass_cse(ir_graph *g) {
  int changed;
  return rebuild(g, NULL, &changed);
}

/* ---- simplify ------------------------------------------------------------ */

/* Whether n is a constant whose elements all equal v (and there is one). */
static bool const_uniform(const ir_node *n, double v) {
  if (n->op != IR_CONST) return false;
  int64_t k = ir_node_numel_const(n);
  if (k <= 0) return false;
  for (int64_t i = 0; i < k; i++) {
    double x;
    if (n->dtype == KILN_BOOL) return false;
    x = elem_load(n->dtype, n->data, i);
    if (x != v) return false;
  }
  return true;
}

enum { NO_RULE = -1, REWRITTEN = -2 };

/* One rule applied to n in g: the id of the node n equals, REWRITTEN when
 * n itself became a simpler node (try the rules again), NO_RULE. */
static int simplify_step(const ir_graph *g, ir_node *n) {
  const ir_node *x = &g->nodes[n->in[0]];
  switch (n->op) {
  case OP_ADD:
  case OP_SUB:
  case OP_MUL:
  case OP_DIV: {
    /* x+0, 0+x, x-0, x*1, 1*x, x/1: unless the constant broadcasts x or changes its type */
    double unit = n->op == OP_MUL || n->op == OP_DIV ? 1.0 : 0.0;
    int first = n->op == OP_ADD || n->op == OP_MUL ? 0 : 1;
    for (int k = 1; k >= first; k--) {
      int other = n->in[1 - k];
      if (const_uniform(&g->nodes[n->in[k]], unit) && same_type(n, &g->nodes[other])) return other;
    }
    return NO_RULE;
  }
  case OP_NEG:
    return x->op == OP_NEG && same_type(n, &g->nodes[x->in[0]]) ? x->in[0] : NO_RULE;
  case OP_CAST:
    return n->attrs.dtype == x->dtype && same_type(n, x) ? n->in[0] : NO_RULE;
  case OP_PERMUTE: {
    const int *p = n->attrs.perm;
    for (int i = 0; i < n->ndim; i++)
      if (p[i] < 0 || p[i] >= n->ndim) return NO_RULE;
    if (x->op == OP_PERMUTE && x->ndim == n->ndim) {
      /* out[i] = x[p[i]] = y[q[p[i]]]; entries past the rank stay 0, as the tracer leaves them */
      int composed[MAXD] = {0};
      for (int i = 0; i < n->ndim; i++) composed[i] = x->attrs.perm[p[i]];
      memcpy(n->attrs.perm, composed, sizeof composed);
      n->in[0] = x->in[0];
      return REWRITTEN;
    }
    for (int i = 0; i < n->ndim; i++)
      if (p[i] != i) return NO_RULE;
    return same_type(n, x) ? n->in[0] : NO_RULE;
  }
  case OP_RESHAPE:
    if (x->op == OP_RESHAPE) {
      n->in[0] = x->in[0];
      return REWRITTEN;
    }
    return same_type(n, x) ? n->in[0] : NO_RULE;
  case OP_EXPAND:
    return same_type(n, x) ? n->in[0] : NO_RULE;
  case OP_SLICE: {
    const op_attrs *a = &n->attrs;
    bool whole = a->step == 1 && a->dim >= 0 && a->dim < x->ndim && sym_same(a->start, sym_const(0)) &&
                 sym_same(a->end, x->shape[a->dim]);
    return whole && same_type(n, x) ? n->in[0] : NO_RULE;
  }
  default:
    /* contiguous (COPY) stays: it decides the layout a consumer sees */
    return NO_RULE;
  }
}

static int simplify_node(ir_graph *dst, ir_node *n, int *changed) {
  for (int step = 0; n->n_in > 0 && step < SIMPLIFY_MAX_STEPS; step++) {
    int r = simplify_step(dst, n);
    if (r == NO_RULE) break;
    ++*changed;
    if (r >= 0) return r;
  }
  return ir_add(dst, n);
}

ir_graph *pass_simplify(ir_graph *g) {
  int changed = 1;
  for (int round = 0; g && changed && round < SIMPLIFY_MAX_ROUNDS; round++) g = rebuild(g, simplify_node, &changed);
  return g;
}

/* ---- fold ----------------------------------------------------------------- */

/* Whether n can be folded: constant inputs, concrete attrs and a small concrete result. */
static bool foldable(const ir_graph *g, const ir_node *n, op_attrs *a) {
  if (n->n_in < 1 || n->op >= OP_COUNT) return false;
  /* a collective is made by every process at run time, never by one compile */
  if (n->op == OP_ALLREDUCE) return false;
  for (int j = 0; j < n->n_in; j++)
    if (g->nodes[n->in[j]].op != IR_CONST || ir_node_numel_const(&g->nodes[n->in[j]]) < 0) return false;
  int64_t k = ir_node_numel_const(n);
  return k >= 0 && k <= FOLD_MAX_NUMEL && ir_attrs_eval(n, NULL, 0, a) == 0;
}

/* Runs n on its constant inputs with the eager kernels into data (numel of n
 * elements, row-major). 1 done, 0 the op failed (leave the node), -1 out of memory. */
static int evaluate(const ir_graph *g, const ir_node *n, const op_attrs *a, void *data) {
  kiln_tensor **ins = alloc_calloc((size_t)n->n_in, sizeof *ins), *t = NULL;
  if (!ins) return -1;
  bool made = true;
  for (int j = 0; j < n->n_in && made; j++) made = (ins[j] = ir_const_tensor(&g->nodes[n->in[j]])) != NULL;
  if (made) {
    /* no tracer may see these ops, and nothing here needs a gradient */
    const trace_hooks *hooks = dispatch_hooks();
    dispatch_set_hooks(NULL);
    kiln_no_grad_begin();
    t = op_run((op_id)n->op, ins, n->n_in, a, n->file, n->line);
    kiln_no_grad_end();
    dispatch_set_hooks(hooks);
  }
  int rc;
  if (!made) {
    rc = -1;
  } else if (!t) {
    /* every failure of op_run sets a message; out of memory is not the op's fault */
    rc = strstr(kiln_last_error(), "out of memory") ? -1 : 0;
  } else {
    bool same = t->dtype == n->dtype && t->ndim == n->ndim;
    for (int i = 0; same && i < n->ndim; i++) same = t->shape[i] == n->shape[i].c;
    rc = same && kiln_read(t, data, (size_t)kiln_numel(t) * kiln_dtype_size(t->dtype)) == 0;
  }
  kiln_release(t);
  for (int j = 0; j < n->n_in; j++) kiln_release(ins[j]);
  alloc_free(ins);
  return rc;
}

static int fold_node(ir_graph *dst, ir_node *n, int *changed) {
  op_attrs a;
  if (!foldable(dst, n, &a)) return ir_add(dst, n);
  size_t bytes = (size_t)ir_node_numel_const(n) * kiln_dtype_size(n->dtype);
  void *data = alloc_malloc(bytes ? bytes : 1);
  if (!data) return -1;
  int r = evaluate(dst, n, &a, data), id = -1;
  if (r == 0) {
    id = ir_add(dst, n);
  } else if (r == 1) {
    ir_node c = {.op = IR_CONST, .dtype = n->dtype, .ndim = n->ndim, .data = data, .file = n->file, .line = n->line};
    memcpy(c.shape, n->shape, sizeof c.shape);
    id = ir_add(dst, &c);
    ++*changed;
  }
  alloc_free(data);
  return id;
}

ir_graph *pass_fold(ir_graph *g) {
  int changed;
  return rebuild(g, fold_node, &changed);
}

/* ---- schedule ------------------------------------------------------------- */

/* Each allreduce moves up to just after its input (after the leaves, which
 * come first), so that a training step's gradient is sent as soon as the
 * backward has made it and travels while the rest of the backward runs
 * (runtime.c waits for it only where it is read). The order depends on the
 * graph alone, so every process issues the collectives in the same order,
 * as MPI requires. */
/* Appends the allreduces of node x (of every leaf when x is the last leaf), then theirs, to order. */
static void place_after(const ir_graph *g, int x, int last_leaf, const int *ar, int n_ar, bool *placed, int *order,
                        int *k) {
  for (int a = 0; a < n_ar; a++) {
    int j = ar[a], in = g->nodes[j].in[0];
    if (placed[j] || !(in == x || (x == last_leaf && in < x))) continue;
    placed[j] = true;
    order[(*k)++] = j;
    place_after(g, j, last_leaf, ar, n_ar, placed, order, k);
  }
}

ir_graph *pass_schedule(ir_graph *g) {
  int n = g->n_nodes, last_leaf = -1, n_ar = 0, k = 0;
  for (int i = 0; i < n; i++) {
    if (is_leaf(g->nodes[i].op)) last_leaf = i;
    n_ar += g->nodes[i].op == OP_ALLREDUCE;
  }
  if (!n_ar) return g;
  int *order = alloc_malloc(sizeof(int) * (size_t)n), *ar = alloc_malloc(sizeof(int) * (size_t)n_ar);
  bool *placed = alloc_calloc((size_t)n, sizeof *placed);
  if (!order || !ar || !placed) {
    alloc_free(order), alloc_free(ar), alloc_free(placed);
    ir_free(g);
    return NULL;
  }
  n_ar = 0;
  for (int i = 0; i < n; i++)
    if (g->nodes[i].op == OP_ALLREDUCE) ar[n_ar++] = i;
  for (int i = 0; i < n; i++) {
    if (placed[i]) continue;
    if (g->nodes[i].op == OP_ALLREDUCE && g->nodes[i].in[0] >= last_leaf) continue; /* placed after its input */
    placed[i] = true;
    order[k++] = i;
    if (i >= last_leaf) place_after(g, i, last_leaf, ar, n_ar, placed, order, &k);
  }
  int changed;
  ir_graph *r = k == n ? rebuild_in(g, order, NULL, &changed) : g; /* k < n cannot be: keep the graph */
  alloc_free(order), alloc_free(ar), alloc_free(placed);
  return r;
}

/* ---- hoist ------------------------------------------------------------- */

/* Work in a loop's region that depends only on its captures (and
 * constants) is the same every step: it moves out, before the loop, and its
 * values come in as new captures. Captured recordings have none (build.c
 * keeps such work outside by construction); a graph read from text may.
 * A scan's work on xs[t] and captures alone (an RNN's input projection
 * x[t] @ W) is batched: done once outside over all of xs, a matmul or a
 * pointwise op on (T, ...), its result a new xs of the scan. */

/* (a draw is never the same twice: it stays in) */
static bool hoistable_op(int op) { return (op >= 0 && op < OP_COUNT && !(op_table[op].attrs & AF_RNG)) || op == IR_NUMEL; }

/* Region r's node c (or its batched form) appended to dst: each input as
 * batch/bat say (the batched value), else at (its id in dst; a constant
 * not there yet is copied out). Its id in dst, or -1. */
static int copy_out(ir_graph *dst, const ir_graph *r, const ir_node *c, int *at, const bool *batch, const int *bat) {
  int small[16], *in = c->n_in <= 16 ? small : alloc_malloc(sizeof(int) * (size_t)c->n_in), id = -1;
  if (!in) return -1;
  bool ok = true;
  for (int j = 0; j < c->n_in && ok; j++) {
    int y = c->in[j];
    if (batch && batch[y]) {
      in[j] = bat[y];
      continue;
    }
    if (at[y] < 0) ok = (at[y] = ir_add(dst, &r->nodes[y])) >= 0;
    in[j] = at[y];
  }
  ir_node h = *c;
  h.in = in;
  if (ok) id = ir_add(dst, &h);
  if (in != small) alloc_free(in);
  return id;
}

/* Loop node i of src (its operands ins[] already dst's ids) into dst, its
 * regions' invariant work computed in dst first. The node's id, or -1. */
static int hoist_loop(ir_graph *dst, const ir_graph *src, int i, const int *ins) {
  const ir_node *n = &src->nodes[i];
  int first_cap = n->op == IR_SCAN ? n->n_carry + n->n_xs : n->n_carry, n_sub = ir_n_sub(n->op), id = -1, n_extra = 0;
  int max = 0;
  for (int k = 0; k < n_sub; k++) max += n->sub[k]->n_nodes;
  bool *lift[2] = {NULL, NULL};
  int *at[2] = {NULL, NULL}, *extra = alloc_malloc(sizeof(int) * ((size_t)max + 1)), *cins = NULL;
  int *rmap = alloc_malloc(sizeof(int) * ((size_t)max + 1)), *rin = alloc_malloc(sizeof(int) * ((size_t)max + 1));
  int *xnew = alloc_malloc(sizeof(int) * ((size_t)max + 1)), *xin = alloc_malloc(sizeof(int) * ((size_t)max + 1)), n_xnew = 0;
  bool *batch = NULL; /* the scan's region: a node computed for all steps at once outside */
  int *bat = NULL;
  ir_graph *sub[2] = {NULL, NULL};
  bool ok = extra && rmap && rin && xnew && xin;
  for (int k = 0; k < n_sub && ok; k++) {
    const ir_graph *r = n->sub[k];
    lift[k] = alloc_calloc((size_t)r->n_nodes + 1, sizeof(bool));
    at[k] = alloc_malloc(sizeof(int) * ((size_t)r->n_nodes + 1)); /* a region node's id in dst, or -1 */
    bool *inv = alloc_calloc((size_t)r->n_nodes + 1, sizeof(bool));
    if (n->op == IR_SCAN) {
      batch = alloc_calloc((size_t)r->n_nodes + 1, sizeof(bool));
      bat = alloc_malloc(sizeof(int) * ((size_t)r->n_nodes + 1)); /* a batched node's id in dst */
    }
    ok = lift[k] && at[k] && inv && (n->op != IR_SCAN || (batch && bat));
    for (int x = 0; x < r->n_nodes && ok; x++) {
      const ir_node *c = &r->nodes[x];
      at[k][x] = -1;
      if (c->op == IR_INPUT) {
        inv[x] = c->index >= first_cap;
        if (inv[x]) at[k][x] = ins[c->index];
        continue;
      }
      if (c->op == IR_CONST) {
        inv[x] = true;
        continue;
      }
      if (!hoistable_op(c->op) || c->n_in < 1) continue;
      bool all = true, any_cap = false;
      for (int j = 0; j < c->n_in; j++) {
        all &= inv[c->in[j]];
        any_cap |= r->nodes[c->in[j]].op != IR_CONST;
      }
      if (!all || !any_cap) continue; /* constants alone are fold's */
      inv[x] = lift[k][x] = true;
      ok = (at[k][x] = copy_out(dst, r, c, at[k], NULL, NULL)) >= 0;
    }
    /* a scan's work on xs[t] alone (and invariants) is the same op on all of
     * xs at once: a pointwise op whose xs-side inputs have its rank, or a
     * matmul of such by an invariant matrix; done once outside, its result
     * comes in as a new xs */
    for (int x = 0; x < r->n_nodes && ok && n->op == IR_SCAN; x++) {
      const ir_node *c = &r->nodes[x];
      if (c->op == IR_INPUT) {
        if (c->index >= n->n_carry && c->index < first_cap) batch[x] = true, bat[x] = ins[c->index];
        continue;
      }
      if (lift[k][x] || c->op < 0 || c->op >= OP_COUNT || c->n_in < 1) continue;
      if (op_table[c->op].attrs & AF_RNG) continue;
      int kind = op_table[c->op].kind;
      bool fits = kind == KIND_POINTWISE || (c->op == OP_MATMUL && c->n_in == 2 && !batch[c->in[1]] && inv[c->in[1]] &&
                                             r->nodes[c->in[1]].ndim == 2 && r->nodes[c->in[0]].ndim >= 2);
      bool any = false;
      for (int j = 0; j < c->n_in && fits; j++) {
        const ir_node *y = &r->nodes[c->in[j]];
        if (batch[c->in[j]]) any = true, fits = y->ndim == c->ndim;
        else fits = inv[c->in[j]] && y->ndim <= c->ndim;
      }
      if (!fits || !any || c->ndim >= MAXD) continue;
      ir_node h = *c;
      /* (T, ...): the steps' values stacked, T being xs's dim 0 */
      memmove(h.shape + 1, h.shape, sizeof h.shape[0] * (size_t)h.ndim);
      h.shape[0] = dst->nodes[ins[n->n_carry]].shape[0];
      h.ndim++;
      ok = (bat[x] = copy_out(dst, r, &h, at[k], batch, bat)) >= 0;
      batch[x] = true;
    }
    for (int x = r->n_inputs; x < r->n_nodes && ok && batch; x++) {
      const ir_node *c = &r->nodes[x];
      bool need = false;
      for (int j = 0; j < c->n_in && !batch[x] && !lift[k][x]; j++) need |= batch[c->in[j]] && r->nodes[c->in[j]].op != IR_INPUT;
      for (int j = 0; j < c->n_in && need; j++) {
        int y = c->in[j], e = 0;
        if (!batch[y] || r->nodes[y].op == IR_INPUT) continue;
        while (e < n_xnew && xnew[e] != bat[y]) e++;
        if (e == n_xnew) xnew[n_xnew++] = bat[y];
      }
    }
    for (int o = 0; o < r->n_outputs && ok && n->op == IR_SCAN; o++) {
      int y = r->outputs[o], e = 0;
      if (!batch[y] || r->nodes[y].op == IR_INPUT) continue;
      while (e < n_xnew && xnew[e] != bat[y]) e++;
      if (e == n_xnew) xnew[n_xnew++] = bat[y];
    }
    /* the lifted values the region still reads come in as captures */
    for (int x = 0; x < r->n_nodes && ok; x++) {
      const ir_node *c = &r->nodes[x];
      bool need = false;
      for (int j = 0; j < c->n_in && !lift[k][x] && !(batch && batch[x]); j++) need |= lift[k][c->in[j]];
      for (int j = 0; j < c->n_in && need; j++) {
        int y = c->in[j], e = 0;
        if (!lift[k][y]) continue;
        while (e < n_extra && extra[e] != at[k][y]) e++;
        if (e == n_extra) extra[n_extra++] = at[k][y];
      }
    }
    for (int o = 0; o < r->n_outputs && ok; o++) {
      int y = r->outputs[o], e = 0;
      if (!lift[k][y]) continue;
      while (e < n_extra && extra[e] != at[k][y]) e++;
      if (e == n_extra) extra[n_extra++] = at[k][y];
    }
    alloc_free(inv);
  }
  if (!ok) goto done;
  if (!n_extra && !n_xnew) {
    /* nothing to move out: the node as it is */
    ir_node c = *n;
    c.in = (int *)ins;
    id = ir_add(dst, &c);
    goto done;
  }
  for (int k = 0; k < n_sub && ok; k++) {
    const ir_graph *r = n->sub[k];
    ir_graph *nr = sub[k] = ir_region_new(dst, r->name);
    ok = nr != NULL;
    /* arguments: the carry, the xs, the new xs, the captures, the new captures */
    for (int x = 0; x < first_cap && ok; x++) ok = (rmap[x] = ir_append(nr, &r->nodes[x])) >= 0;
    for (int e = 0; e < n_xnew && ok; e++) {
      const ir_node *v = &dst->nodes[xnew[e]];
      ir_node in = {.op = IR_INPUT, .index = first_cap + e, .dtype = v->dtype, .ndim = v->ndim - 1, .file = ""};
      memcpy(in.shape, v->shape + 1, sizeof in.shape[0] * (size_t)in.ndim);
      ok = (xin[e] = ir_append(nr, &in)) >= 0;
    }
    for (int x = first_cap; x < r->n_inputs && ok; x++) {
      ir_node in = r->nodes[x];
      in.index += n_xnew;
      ok = (rmap[x] = ir_append(nr, &in)) >= 0;
    }
    for (int e = 0; e < n_extra && ok; e++) {
      const ir_node *v = &dst->nodes[extra[e]];
      ir_node in = {.op = IR_INPUT, .index = r->n_inputs + n_xnew + e, .dtype = v->dtype, .ndim = v->ndim, .file = ""};
      memcpy(in.shape, v->shape, sizeof in.shape);
      ok = (rin[e] = ir_append(nr, &in)) >= 0;
    }
    for (int x = r->n_inputs; x < r->n_nodes && ok; x++) {
      if (lift[k][x]) {
        int e = 0;
        while (e < n_extra && extra[e] != at[k][x]) e++;
        rmap[x] = e < n_extra ? rin[e] : -1; /* -1: only lifted nodes read it */
        continue;
      }
      if (batch && batch[x]) {
        int e = 0;
        while (e < n_xnew && xnew[e] != bat[x]) e++;
        rmap[x] = e < n_xnew ? xin[e] : -1; /* -1: only batched nodes read it */
        continue;
      }
      ir_node c = r->nodes[x];
      int small[16], *cin = c.n_in <= 16 ? small : alloc_malloc(sizeof(int) * (size_t)c.n_in);
      if (!cin) {
        ok = false;
        break;
      }
      for (int j = 0; j < c.n_in; j++) cin[j] = rmap[c.in[j]];
      c.in = cin;
      ok = (rmap[x] = ir_add(nr, &c)) >= 0;
      if (cin != small) alloc_free(cin);
    }
    for (int o = 0; o < r->n_outputs && ok; o++) ok = !ir_add_output(nr, rmap[r->outputs[o]]);
  }
  if (ok && (cins = alloc_malloc(sizeof(int) * (size_t)(n->n_in + n_xnew + n_extra)))) {
    memcpy(cins, ins, sizeof(int) * (size_t)first_cap);
    memcpy(cins + first_cap, xnew, sizeof(int) * (size_t)n_xnew);
    memcpy(cins + first_cap + n_xnew, ins + first_cap, sizeof(int) * (size_t)(n->n_in - first_cap));
    memcpy(cins + n->n_in + n_xnew, extra, sizeof(int) * (size_t)n_extra);
    ir_node c = *n;
    c.in = cins;
    c.n_in = n->n_in + n_xnew + n_extra;
    c.n_xs = n->n_xs + n_xnew;
    c.sub[0] = sub[0], c.sub[1] = sub[1];
    id = ir_append(dst, &c);
  }
done:
  for (int k = 0; k < 2; k++) ir_free(sub[k]), alloc_free(lift[k]), alloc_free(at[k]);
  alloc_free(extra), alloc_free(rmap), alloc_free(rin), alloc_free(cins), alloc_free(xnew), alloc_free(xin);
  alloc_free(batch), alloc_free(bat);
  return id;
}

ir_graph *pass_hoist(ir_graph *g) {
  bool loops = false;
  for (int i = 0; i < g->n_nodes; i++) loops |= g->nodes[i].op == IR_SCAN || g->nodes[i].op == IR_WHILE;
  if (!loops) return g;
  int max_in = 1;
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i].n_in > max_in) max_in = g->nodes[i].n_in;
  int *map = alloc_malloc(sizeof(int) * ((size_t)g->n_nodes + 1)), *ins = alloc_malloc(sizeof(int) * (size_t)max_in);
  ir_graph *dst = map && ins ? ir_new_like(g) : NULL;
  if (!dst) goto oom;
  for (int i = 0; i < g->n_nodes; i++) {
    ir_node n = g->nodes[i];
    for (int j = 0; j < n.n_in; j++) ins[j] = map[n.in[j]];
    n.in = ins;
    map[i] = n.op == IR_SCAN || n.op == IR_WHILE ? hoist_loop(dst, g, i, ins) : ir_add(dst, &n);
    if (map[i] < 0) goto oom;
  }
  if (ir_copy_tail(dst, g, map)) goto oom;
  alloc_free(map), alloc_free(ins);
  ir_free(g);
  return dst;
oom:
  alloc_free(map), alloc_free(ins);
  ir_free(dst);
  ir_free(g);
  return NULL;
}

/* ---- accumulate ----------------------------------------------------------- */

/* x + index_add(zeros, dim, idx, src) becomes index_add_to(x, dim, idx, src):
 * the same bits (k_index_add_to), without the index_add's result, which is
 * as large as x. A tied embedding's gradient is the case: the head's
 * gradient of the table plus the embedding's rows, two (V, C) buffers live
 * at once where one is enough. Where x is a 2-D transpose of M (the head's
 * gradient is M = h^T @ dlogits, read transposed), the rows go into M's
 * columns instead: permute(index_add_to(M, 1, idx, permute(src))), so the
 * sum is M's buffer, never a transposed copy of it. Taken only where the
 * index_add has no other reader and the sum is no output or write (the
 * transposed form is a view). */

static _Thread_local const signed char *acc_form; /* per src node: 0 no, 1 x + rows, 2 transposed */

/* Whether n is all +0: a constant, or a constant broadcast (x + -0 keeps a
 * -0 in x, which index_add_to's x + 0 would not). */
static bool zeros_node(const ir_graph *g, const ir_node *n) {
  if (n->op == OP_EXPAND) n = &g->nodes[n->in[0]];
  return const_uniform(n, 0.0) && !signbit(elem_load(n->dtype, n->data, 0));
}

/* Which input of add n is the index_add into zeros (1 or 0), or -1. */
static int rows_input(const ir_graph *g, const ir_node *n) {
  if (n->op != OP_ADD || n->n_in != 2 || n->dtype == KILN_BOOL) return -1;
  for (int k = 1; k >= 0; k--) {
    const ir_node *y = &g->nodes[n->in[k]], *x = &g->nodes[n->in[1 - k]];
    if (y->op == OP_INDEX_ADD && zeros_node(g, &g->nodes[y->in[0]]) && same_type(n, y) && same_type(n, x)) return k;
  }
  return -1;
}

/* The M of x = permute(M) or contiguous(permute(M)), 2-D, perm [1, 0]; else -1. */
static int transpose_of(const ir_graph *g, const ir_node *x) {
  if (x->op == OP_COPY) x = &g->nodes[x->in[0]];
  return x->op == OP_PERMUTE && x->ndim == 2 && x->attrs.perm[0] == 1 && x->attrs.perm[1] == 0 ? x->in[0] : -1;
}

static int accumulate_node(ir_graph *dst, ir_node *n, int *changed) {
  int form = acc_form[rebuild_at], k = form ? rows_input(dst, n) : -1;
  if (k < 0) return ir_add(dst, n);
  const ir_node y = dst->nodes[n->in[k]];
  int x = n->in[1 - k], in3[3];
  int m = form == 2 ? transpose_of(dst, &dst->nodes[x]) : -1;
  ++*changed;
  if (m < 0) {
    ir_node r = *n;
    in3[0] = x, in3[1] = y.in[1], in3[2] = y.in[2];
    r.op = OP_INDEX_ADD_TO, r.n_in = 3, r.in = in3, r.attrs = y.attrs;
    return ir_add(dst, &r);
  }
  /* transposed: the rows (n_idx, C) become columns (C, n_idx) of M (C, V) */
  const ir_node *src = &dst->nodes[y.in[2]];
  ir_node pt = *n, q = *n, r = *n;
  int one[1] = {y.in[2]};
  pt.op = OP_PERMUTE, pt.n_in = 1, pt.in = one, pt.attrs = (op_attrs){0};
  pt.attrs.perm[0] = 1, pt.attrs.perm[1] = 0;
  pt.dtype = src->dtype, pt.shape[0] = src->shape[1], pt.shape[1] = src->shape[0];
  int ptid = ir_add(dst, &pt);
  if (ptid < 0) return -1;
  in3[0] = m, in3[1] = y.in[1], in3[2] = ptid;
  q.op = OP_INDEX_ADD_TO, q.n_in = 3, q.in = in3, q.attrs = y.attrs, q.attrs.dim = 1;
  q.shape[0] = n->shape[1], q.shape[1] = n->shape[0];
  int qid = ir_add(dst, &q);
  if (qid < 0) return -1;
  r.op = OP_PERMUTE, r.n_in = 1, r.in = &qid, r.attrs = pt.attrs;
  return ir_add(dst, &r);
}

ir_graph *pass_accumulate(ir_graph *g) {
  int *uses = alloc_calloc((size_t)g->n_nodes + 1, sizeof *uses);
  signed char *form = alloc_calloc((size_t)g->n_nodes + 1, 1);
  bool any = false;
  if (!uses || !form) goto oom;
  for (int i = 0; i < g->n_nodes; i++)
    for (int j = 0; j < g->nodes[i].n_in; j++) uses[g->nodes[i].in[j]]++;
  for (int i = 0; i < g->n_outputs; i++) uses[g->outputs[i]] += 1 << 20;
  for (int i = 0; i < g->n_writes; i++)
    for (int r[2], k = 0, nr = ir_write_reads(&g->writes[i], r); k < nr; k++) uses[r[k]] += 1 << 20;
  for (int i = 0; i < g->n_nodes; i++) {
    const ir_node *n = &g->nodes[i];
    int k = rows_input(g, n);
    if (k < 0 || uses[n->in[k]] != 1) continue;
    const ir_node *y = &g->nodes[n->in[k]], *x = &g->nodes[n->in[1 - k]];
    /* transposed where x is read only here (else its copy is made anyway) */
    form[i] = y->attrs.dim == 0 && uses[i] < 1 << 20 && uses[n->in[1 - k]] == 1 && transpose_of(g, x) >= 0 ? 2 : 1;
    any = true;
  }
  alloc_free(uses);
  if (!any) {
    alloc_free(form);
    return g;
  }
  int changed;
  acc_form = form;
  g = rebuild(g, accumulate_node, &changed);
  acc_form = NULL;
  alloc_free(form);
  return g;
oom:
  alloc_free(uses);
  alloc_free(form);
  ir_free(g);
  return NULL;
}

/* ---- the pipeline ------------------------------------------------------- */

static const struct {
  const char *name;
  ir_graph *(*run)(ir_graph *g);
} pipeline[] = {
    {"simplify", pass_simplify}, /* x*1, cast(cast...), view chains: exposes constants */
    {"fold", pass_fold},         /* constant subgraphs, the casts of scalars among them */
    {"simplify", pass_simplify}, /* identities the folded constants made visible */
    {"hoist", pass_hoist},       /* loop-invariant work out of loop regions */
    {"sums", pass_sums},         /* a scan carry that only accumulates: summed after the loop (scansum.c) */
    {"accumulate", pass_accumulate}, /* x + index_add(zeros, ...): the rows added into x */
    {"cse", pass_cse},
    {"dce", pass_dce},
    {"schedule", pass_schedule}, /* collectives early, to overlap what follows */
};

/* Runs pass over every region of g, deepest first: each node's region is
 * replaced by what the pass makes of it. 0, or -1 on out of memory. */
static int in_regions(ir_graph *g, ir_graph *(*pass)(ir_graph *g)) {
  for (int i = 0; i < g->n_nodes; i++)
    for (int k = 0; k < 2; k++) {
      ir_graph *sub = g->nodes[i].sub[k];
      if (!sub) continue;
      if (in_regions(sub, pass)) return -1;
      ir_graph *r = pass(ir_region_hold(sub));
      if (!r) return -1;
      ir_free(sub);
      g->nodes[i].sub[k] = r;
    }
  return 0;
}

ir_graph *pass_pipeline(ir_graph *g, char *err, size_t errn) {
  if (errn) err[0] = '\0';
  if (!g) {
    snprintf(err, errn, "no graph");
    return NULL;
  }
#ifdef KILN_TEST_BUILD
  char why[512];
  if (ir_verify(g, why, sizeof why)) {
    snprintf(err, errn, "before the passes: %s", why);
    ir_free(g);
    return NULL;
  }
#endif
  for (size_t i = 0; i < sizeof pipeline / sizeof pipeline[0]; i++) {
    g = pipeline[i].run(g);
    if (g && in_regions(g, pipeline[i].run)) {
      ir_free(g);
      g = NULL;
    }
    if (!g) {
      snprintf(err, errn, "%s: out of memory", pipeline[i].name);
      return NULL;
    }
#ifdef KILN_TEST_BUILD
    if (ir_verify(g, why, sizeof why)) {
      snprintf(err, errn, "after %s: %s", pipeline[i].name, why);
      ir_free(g);
      return NULL;
    }
#endif
  }
  return g;
}
