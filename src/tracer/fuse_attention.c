/* The attention pass: finds softmax(scale * q @ k^T [masked]) @ v spelled
 * out in primitives and puts one attention node (the fused kernel of
 * src/eager/attention.c) in place of the final matmul:
 *
 *   s  = matmul(q, permute(k) swapping the last two dims)     (...,T,S)
 *   y  = s, s * c, c * s or s / c                             c a uniform constant
 *   x  = y, where(mask, y, -inf), where(mask, -inf, y),       masked_fill writes the
 *        y + m or m + y                                       second; m of y's dtype
 *   p  = div(e, sum(e, last dim, keepdim)) with
 *        e = exp(sub(x, max(x, last dim, keepdim)))           nn.c's softmax
 *   o  = matmul(p, v)                                         -> attention(q, k, v[, mask])
 *
 * It fires only when nothing else reads s, y, x, the max, e, the sum or p
 * (a training graph's backward reads p: the pattern stays unfused there),
 * only for f32 and f64, and only when q, k and v share their batch dims.
 * The LLVM backend runs it on its own copy of a variant's graph (runtime.c),
 * so the interpreter, check mode's reference and kiln_export keep the
 * unfused ops. KILN_FUSE_ATTENTION=0 turns it off. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tracer/tracer.h"

typedef struct attn_match {
  int q, k, v, mask; /* node ids; mask -1 when there is none */
  double scale;
  bool drop;         /* a bool mask's value that drops an entry */
} attn_match;

static const ir_node *node(const ir_graph *g, int id) { return &g->nodes[id]; }

/* The value of a constant all of whose elements are equal; false otherwise. */
static bool const_value(const ir_node *n, double *v) {
  if (n->op != IR_CONST || n->dtype == KILN_BOOL) return false;
  int64_t k = ir_node_numel_const(n);
  if (k <= 0) return false;
  *v = elem_load(n->dtype, n->data, 0);
  for (int64_t i = 1; i < k; i++)
    if (elem_load(n->dtype, n->data, i) != *v) return false;
  return true;
}

/* Whether dims a and b are equal for every call the graph serves: the same
 * expression, or linked by the graph's equality guards (a symbolic T gives
 * the scores (s0,s1) and a mask sliced to T (s3,s4), with s3 == s0, s4 == s1). */
static bool dims_eq(const ir_graph *g, sym_dim a, sym_dim b) {
  enum { MAX_HOPS = 16 };
  sym_dim seen[MAX_HOPS + 1];
  int n = 0;
  seen[n++] = a;
  for (int k = 0; k < n; k++) {
    if (sym_same(seen[k], b)) return true;
    for (int i = 0; i < g->n_guards && n <= MAX_HOPS; i++) {
      const sym_guard *gd = &g->guards[i];
      if (gd->op != SYM_EQ) continue;
      sym_dim other;
      if (sym_same(gd->lhs, seen[k])) other = gd->rhs;
      else if (sym_same(gd->rhs, seen[k])) other = gd->lhs;
      else continue;
      bool known = false;
      for (int j = 0; j < n; j++) known |= sym_same(seen[j], other);
      if (!known) seen[n++] = other;
    }
  }
  return false;
}

static bool same_shape(const ir_graph *g, const ir_node *a, const ir_node *b) {
  if (a->ndim != b->ndim) return false;
  for (int i = 0; i < a->ndim; i++)
    if (!dims_eq(g, a->shape[i], b->shape[i])) return false;
  return true;
}

/* A max or sum over the last dim with keepdim. */
static bool last_dim_reduce(const ir_node *n, int op) {
  return n->op == op && n->n_in == 1 && n->attrs.naxes == 1 && n->attrs.axes[0] == n->ndim - 1 && n->attrs.keepdim;
}

/* Whether node id is read exactly `uses` times (outputs and writes count). */
static bool used(const int *uses, int id, int n) { return uses[id] == n; }

/* s = matmul(q, permute(k)) with the permute swapping the last two dims. */
static bool match_scores(const ir_graph *g, int s, attn_match *m) {
  const ir_node *ns = node(g, s);
  if (ns->op != OP_MATMUL || ns->ndim < 2) return false;
  const ir_node *q = node(g, ns->in[0]), *kt = node(g, ns->in[1]);
  int nd = ns->ndim;
  if (kt->op != OP_PERMUTE || q->ndim != nd || kt->ndim != nd) return false;
  for (int i = 0; i < nd; i++)
    if (kt->attrs.perm[i] != (i < nd - 2 ? i : i == nd - 2 ? nd - 1 : nd - 2)) return false;
  const ir_node *k = node(g, kt->in[0]);
  for (int i = 0; i < nd - 2; i++)
    if (!dims_eq(g, q->shape[i], ns->shape[i]) || !dims_eq(g, k->shape[i], ns->shape[i])) return false;
  m->q = ns->in[0];
  m->k = kt->in[0];
  return true;
}

/* y = s, s*c, c*s or s/c: the scores and their scale. */
static bool match_scaled(const ir_graph *g, const int *uses, int y, attn_match *m) {
  const ir_node *n = node(g, y);
  double c;
  m->scale = 1;
  if ((n->op == OP_MUL || n->op == OP_DIV) && n->n_in == 2) {
    int s = n->in[0], other = n->in[1];
    if (n->op == OP_MUL && const_value(node(g, s), &c)) s = n->in[1], other = n->in[0];
    if (const_value(node(g, other), &c) && ir_node_numel_const(node(g, other)) == 1 && same_shape(g, node(g, s), n) &&
        used(uses, s, 1) && match_scores(g, s, m)) {
      m->scale = n->op == OP_MUL ? c : 1 / c;
      return true;
    }
  }
  return match_scores(g, y, m);
}

/* x = y or y masked: the mask (-1 if none) and the scaled scores y. */
static bool match_masked(const ir_graph *g, const int *uses, int x, attn_match *m) {
  const ir_node *n = node(g, x);
  double c;
  m->mask = -1;
  if (n->op == OP_WHERE && node(g, n->in[0])->dtype == KILN_BOOL) {
    for (int side = 1; side <= 2; side++) {
      int y = n->in[side], fill = n->in[3 - side];
      if (!const_value(node(g, fill), &c) || c != -INFINITY || !same_shape(g, node(g, y), n) || !used(uses, y, 1))
        continue;
      if (match_scaled(g, uses, y, m)) {
        m->mask = n->in[0];
        m->drop = side == 2; /* where(mask, -inf, y): true drops */
        return true;
      }
    }
    return false;
  }
  if (n->op == OP_ADD) {
    for (int side = 0; side < 2; side++) {
      int y = n->in[side], add = n->in[1 - side];
      if (node(g, add)->dtype != n->dtype || !same_shape(g, node(g, y), n) || !used(uses, y, 1)) continue;
      if (match_scaled(g, uses, y, m)) {
        m->mask = add;
        return true;
      }
    }
    return false;
  }
  return match_scaled(g, uses, x, m);
}

/* o = matmul(softmax(x), v) as nn.c spells softmax. */
static bool match_attention(const ir_graph *g, const int *uses, int o, attn_match *m) {
  const ir_node *no = node(g, o);
  if (no->op != OP_MATMUL || (no->dtype != KILN_F32 && no->dtype != KILN_F64) || no->ndim < 2) return false;
  int p = no->in[0], v = no->in[1];
  const ir_node *np = node(g, p);
  if (np->op != OP_DIV || !used(uses, p, 1)) return false;
  int e = np->in[0], sum = np->in[1];
  const ir_node *ne = node(g, e), *nsum = node(g, sum);
  if (ne->op != OP_EXP || !same_shape(g, ne, np) || !used(uses, e, 2) || !last_dim_reduce(nsum, OP_SUM) ||
      nsum->in[0] != e || !used(uses, sum, 1))
    return false;
  const ir_node *nd = node(g, ne->in[0]);
  if (nd->op != OP_SUB || !used(uses, ne->in[0], 1)) return false;
  int x = nd->in[0], mx = nd->in[1];
  const ir_node *nmx = node(g, mx);
  if (!last_dim_reduce(nmx, OP_MAX) || nmx->in[0] != x || !used(uses, mx, 1) || !used(uses, x, 2) ||
      !same_shape(g, node(g, x), nd))
    return false;
  const ir_node *nv = node(g, v);
  int r = no->ndim;
  if (nv->ndim != r) return false;
  for (int i = 0; i < r - 2; i++)
    if (!dims_eq(g, nv->shape[i], no->shape[i])) return false;
  if (!match_masked(g, uses, x, m)) return false;
  m->v = v;
  /* every operand of the fused op in the result's dtype, the scores' rank that of q */
  return node(g, m->q)->dtype == no->dtype && node(g, m->k)->dtype == no->dtype && nv->dtype == no->dtype &&
         node(g, x)->ndim == r;
}

static bool enabled(void) {
  const char *e = getenv("KILN_FUSE_ATTENTION");
  return !e || strcmp(e, "0") != 0;
}

/* The inputs node i has once the matches are made attention nodes. */
static int inputs_after(const ir_graph *g, const bool *hit, const attn_match *found, int i, int ins[4],
                        const int **in) {
  if (!hit[i]) return *in = g->nodes[i].in, g->nodes[i].n_in;
  const attn_match *m = &found[i];
  ins[0] = m->q, ins[1] = m->k, ins[2] = m->v, ins[3] = m->mask;
  *in = ins;
  return m->mask >= 0 ? 4 : 3;
}

int pass_attention(const ir_graph *g, ir_graph **out) {
  *out = NULL;
  if (!enabled()) return 0;
  int *uses = ir_use_counts(g), *map = alloc_malloc(sizeof(int) * ((size_t)g->n_nodes + 1));
  attn_match *found = alloc_calloc((size_t)g->n_nodes + 1, sizeof *found);
  bool *hit = alloc_calloc((size_t)g->n_nodes + 1, sizeof *hit), *keep = alloc_calloc((size_t)g->n_nodes + 1, 1);
  ir_graph *c = NULL;
  int n_hit = 0, ins[4], mapped[4];
  const int *in;
  if (!uses || !map || !found || !hit || !keep) goto oom;
  for (int i = 0; i < g->n_nodes; i++) n_hit += hit[i] = match_attention(g, uses, i, &found[i]);
  if (!n_hit) goto done;
  /* what the outputs and writes still reach once the matches are replaced:
   * the nodes only a match read are left out (dce, as pass_dce does it) */
  for (int i = 0; i < g->n_outputs; i++) keep[g->outputs[i]] = true;
  for (int i = 0; i < g->n_writes; i++) {
    int r[2], n = ir_write_reads(&g->writes[i], r);
    keep[g->writes[i].target] = true;
    for (int k = 0; k < n; k++) keep[r[k]] = true;
  }
  for (int i = g->n_nodes - 1; i >= 0; i--) {
    int op = g->nodes[i].op;
    if (op == IR_INPUT || op == IR_PARAM || op == IR_GRAD) keep[i] = true;
    if (!keep[i]) continue;
    int n = inputs_after(g, hit, found, i, ins, &in);
    for (int j = 0; j < n; j++) keep[in[j]] = true;
  }
  /* the new graph borrows g's symbols: pass_attention_free gives them back */
  if (!(c = ir_new(g->name))) goto oom;
  sym_ctx_free(c->sym);
  c->sym = g->sym;
  c->n_syms = g->n_syms;
  memcpy(c->sym_lo, g->sym_lo, sizeof c->sym_lo);
  memcpy(c->sym_hi, g->sym_hi, sizeof c->sym_hi);
  for (int i = 0; i < g->n_nodes; i++) {
    if (!keep[i]) continue;
    ir_node n = g->nodes[i];
    int k = inputs_after(g, hit, found, i, ins, &in);
    int *big = k > 4 ? alloc_malloc(sizeof(int) * (size_t)k) : NULL;
    if (k > 4 && !big) goto oom;
    int *to = big ? big : mapped;
    for (int j = 0; j < k; j++) to[j] = map[in[j]];
    n.in = to;
    n.n_in = k;
    if (hit[i]) {
      n.op = OP_ATTENTION;
      memset(&n.attrs, 0, sizeof n.attrs);
      n.attrs.value = found[i].scale;
      n.attrs.flag = found[i].mask >= 0 && found[i].drop;
    }
    map[i] = ir_append(c, &n);
    alloc_free(big);
    if (map[i] < 0) goto oom;
  }
  for (int i = 0; i < g->n_outputs; i++)
    if (ir_add_output(c, map[g->outputs[i]])) goto oom;
  for (int i = 0; i < g->n_writes; i++) {
    ir_write w = g->writes[i];
    w.target = map[w.target];
    if (w.value >= 0) w.value = map[w.value];
    if (w.has_cond) w.cond = map[w.cond];
    if (ir_add_write(c, w)) goto oom;
  }
  for (int i = 0; i < g->n_guards; i++)
    if (ir_add_guard(c, g->guards[i])) goto oom;
  *out = c;
done:
  alloc_free(uses), alloc_free(map), alloc_free(found), alloc_free(hit), alloc_free(keep);
  return n_hit;
oom:
  pass_attention_free(c);
  alloc_free(uses), alloc_free(map), alloc_free(found), alloc_free(hit), alloc_free(keep);
  return -1;
}

void pass_attention_free(ir_graph *g) {
  if (!g) return;
  g->sym = NULL;
  ir_free(g);
}
