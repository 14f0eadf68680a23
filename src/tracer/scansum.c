/* The sums pass: a scan carry that only accumulates, carry' = carry + z
 * (z computed from the step alone), leaves the loop. The body yields what
 * z is made of as extra ys and one computation after the loop adds the
 * steps up: for z = P @ Q (2-D) one matmul over the steps' rows stacked,
 * sum_t P_t Q_t = [P_0 .. P_{T-1}] @ [Q_0; ..; Q_{T-1}], (m, T*k) @ (T*k, n);
 * for z = sum(V, axes) one sum of the stacked V over the steps' dim too;
 * for any other z the stacked z summed over the steps. z may be a sum of
 * such terms. A reverse scan's weight gradients (h_{t-1}^T @ dgates_t,
 * x_t^T @ dgates_t, sum(dgates_t, 0)) are such carries: T small GEMMs in
 * the loop become one large one after it.
 *
 * The carry is removed from the scan (its argument was read by the add
 * alone, its result by nothing else in the body), its results renumbered,
 * and its last value is init + the sum. A factor the body takes from xs
 * (x_t, a saved carry) is not yielded again: the xs operand is its stack.
 * A captured factor (the same every step) multiplies the sum of the other.
 * The order of the additions changes (one GEMM's order instead of the
 * loop's), so results move by rounding; at T = 0 the sum is zeros.
 *
 * The same rebuild drops a y that is an xs argument as it came (a saved
 * per-step value the hoist pass had batched before the loop): its stack
 * is the xs operand, not a copy written a step at a time. */
#include <string.h>

#include "tracer/tracer.h"

enum { MAX_TERMS = 8, MAX_DEPTH = 4 };

typedef enum { TERM_MATMUL, TERM_SUM, TERM_STACK } term_kind;

typedef struct term {
  term_kind kind;
  int node;    /* the term in the region (TERM_SUM: after the reshape, if any) */
  int p, q;    /* MATMUL: the factors (the permuted value when pt/qt); SUM: p the sum node */
  bool pt, qt; /* MATMUL: the factor is permute [1,0] of p (of q) */
} term;

typedef struct acc {
  int n_terms;
  term t[MAX_TERMS];
} acc;

static bool same_type(const ir_node *a, const ir_node *b) {
  if (a->dtype != b->dtype || a->ndim != b->ndim) return false;
  for (int i = 0; i < a->ndim; i++)
    if (!sym_same(a->shape[i], b->shape[i])) return false;
  return true;
}

static int strip_copies(const ir_graph *r, int x) {
  while (r->nodes[x].op == OP_COPY && same_type(&r->nodes[x], &r->nodes[r->nodes[x].in[0]])) x = r->nodes[x].in[0];
  return x;
}

static bool is_transpose2(const ir_node *n) {
  return n->op == OP_PERMUTE && n->ndim == 2 && n->attrs.perm[0] == 1 && n->attrs.perm[1] == 0;
}

/* The region's argument index of x, or -1 when x is not an argument. */
static int arg_index(const ir_graph *r, int x) { return r->nodes[x].op == IR_INPUT ? r->nodes[x].index : -1; }

/* z's terms into a (z of the carry's type ty). False: not a carry to take out. */
static bool collect(const ir_graph *r, int first_cap, int z, const ir_node *ty, acc *a, int depth) {
  z = strip_copies(r, z);
  const ir_node *n = &r->nodes[z];
  if (!same_type(n, ty)) return false;
  if (n->op == OP_ADD && depth < MAX_DEPTH && same_type(&r->nodes[n->in[0]], n) && same_type(&r->nodes[n->in[1]], n))
    return collect(r, first_cap, n->in[0], ty, a, depth + 1) && collect(r, first_cap, n->in[1], ty, a, depth + 1);
  if (a->n_terms == MAX_TERMS) return false;
  term *t = &a->t[a->n_terms++];
  *t = (term){.kind = TERM_STACK, .node = z, .p = -1, .q = -1};
  if (n->op == OP_MATMUL && n->n_in == 2 && n->ndim == 2 && r->nodes[n->in[0]].ndim == 2 &&
      r->nodes[n->in[1]].ndim == 2) {
    t->kind = TERM_MATMUL;
    t->p = n->in[0], t->q = n->in[1];
    if (is_transpose2(&r->nodes[t->p])) t->p = r->nodes[t->p].in[0], t->pt = true;
    if (is_transpose2(&r->nodes[t->q])) t->q = r->nodes[t->q].in[0], t->qt = true;
    /* both factors the same every step: hoist's, not ours */
    return !(arg_index(r, t->p) >= first_cap && arg_index(r, t->q) >= first_cap);
  }
  int s = n->op == OP_RESHAPE ? strip_copies(r, n->in[0]) : z;
  const ir_node *sn = &r->nodes[s];
  bool axes_ok = sn->op == OP_SUM && sn->n_in == 1 && sn->dtype == n->dtype && sn->attrs.naxes > 0;
  for (int i = 0; axes_ok && i < sn->attrs.naxes; i++) axes_ok = sn->attrs.axes[i] >= 0 && sn->attrs.axes[i] < MAXD - 1;
  if (axes_ok && r->nodes[sn->in[0]].ndim < MAXD) t->kind = TERM_SUM, t->p = s;
  return true;
}

/* Carry k of scan n is `carry + z`, its argument and its new value read by
 * nothing else; z's terms into a, when some term pays (a matmul or a sum). */
static bool accumulates(const ir_node *n, const int *uses, int k, acc *a) {
  const ir_graph *r = n->sub[0];
  int first_cap = n->n_carry + n->n_xs;
  if (k >= r->n_inputs || r->nodes[k].op != IR_INPUT || r->nodes[k].index != k) return false;
  const ir_node *arg = &r->nodes[k];
  if (!dtype_is_float(arg->dtype) || uses[k] != 1) return false;
  int o = r->outputs[k];
  const ir_node *add = &r->nodes[o];
  if (add->op != OP_ADD || add->n_in != 2 || uses[o] != 1 || !same_type(add, arg)) return false;
  int z = add->in[0] == k ? add->in[1] : add->in[1] == k ? add->in[0] : -1;
  if (z < 0 || z == k) return false;
  *a = (acc){0};
  if (!collect(r, first_cap, z, arg, a, 0)) return false;
  for (int i = 0; i < a->n_terms; i++)
    if (a->t[i].kind != TERM_STACK) return true;
  return false;
}

/* ---- building ---------------------------------------------------------- */

typedef struct bld {
  ir_graph *dst;
  const char *file;
  int line;
} bld;

static int mk(const bld *b, int op, kiln_dtype dt, int ndim, const sym_dim *shape, int n_in, const int *in,
              const op_attrs *a) {
  ir_node n = {.op = op, .dtype = dt, .ndim = ndim, .n_in = n_in, .in = (int *)in, .file = b->file, .line = b->line};
  memcpy(n.shape, shape, sizeof(sym_dim) * (size_t)ndim);
  if (a) n.attrs = *a;
  return ir_add(b->dst, &n);
}

static int mk_reshape(const bld *b, int x, int ndim, const sym_dim *shape) {
  op_attrs a = {.ndim = ndim};
  memcpy(a.shape, shape, sizeof(sym_dim) * (size_t)ndim);
  return mk(b, OP_RESHAPE, b->dst->nodes[x].dtype, ndim, shape, 1, &x, &a);
}

static int mk_permute(const bld *b, int x, const int *perm) {
  const ir_node *v = &b->dst->nodes[x];
  op_attrs a = {0};
  sym_dim shape[MAXD];
  for (int i = 0; i < v->ndim; i++) a.perm[i] = perm[i], shape[i] = v->shape[perm[i]];
  return mk(b, OP_PERMUTE, v->dtype, v->ndim, shape, 1, &x, &a);
}

static int mk_copy(const bld *b, int x) {
  const ir_node *v = &b->dst->nodes[x];
  return mk(b, OP_COPY, v->dtype, v->ndim, v->shape, 1, &x, NULL);
}

/* The sum of x over the axes set in drop[] (keepdim off). */
static int mk_sum(const bld *b, int x, const bool *drop) {
  const ir_node *v = &b->dst->nodes[x];
  op_attrs a = {0};
  sym_dim shape[MAXD];
  int nd = 0;
  for (int i = 0; i < v->ndim; i++)
    if (drop[i]) a.axes[a.naxes++] = i;
    else shape[nd++] = v->shape[i];
  return mk(b, OP_SUM, v->dtype, nd, shape, 1, &x, &a);
}

static int mk_binary(const bld *b, int op, int x, int y, int ndim, const sym_dim *shape) {
  int in[2] = {x, y};
  return mk(b, op, b->dst->nodes[x].dtype, ndim, shape, 2, in, NULL);
}

/* The stacked per-step matrices x as one matrix whose contracted dim runs
 * over the steps: side 0, the left factor (m, T*k) of steps (m, k); side 1,
 * the right factor (T*k, n) of steps (k, n). tr: x stacks the steps'
 * transposes (a factor that was permute [1,0] of a value the body made). */
static int flatten_steps(const bld *b, int x, int side, bool tr) {
  ir_graph *dst = b->dst;
  const ir_node *v = &dst->nodes[x];
  sym_dim T = v->shape[0], d1 = v->shape[1], d2 = v->shape[2];
  static const int swap[2] = {1, 0}, steps_in[3] = {1, 0, 2};
  /* the stacked (T, rows, cols) as (T*rows, cols) when the steps run down the rows already */
  bool rows = (side == 1) != tr;
  if (rows) {
    sym_dim s[2] = {sym_mul(dst->sym, T, d1), d2};
    if (sym_is_err(s[0])) return -1;
    int y = mk_reshape(b, x, 2, s);
    return y < 0 ? -1 : tr ? mk_permute(b, y, swap) : y;
  }
  /* the steps along the columns: (rows, T, cols) made contiguous, then (rows, T*cols) */
  int y = mk_permute(b, x, steps_in);
  if (y >= 0) y = mk_copy(b, y);
  sym_dim s[2] = {d1, sym_mul(dst->sym, T, d2)};
  if (y < 0 || sym_is_err(s[1])) return -1;
  y = mk_reshape(b, y, 2, s);
  return y < 0 ? -1 : tr ? mk_permute(b, y, swap) : y;
}

/* ---- the scan ----------------------------------------------------------- */

typedef struct stacks {
  int n, *node; /* region nodes the body yields stacked (new ys) */
  int *outer;   /* their stacks in dst, once made */
} stacks;

static int stack_need(stacks *s, const ir_graph *r, int first_cap, int n_carry, int x) {
  int a = arg_index(r, x);
  if (a >= n_carry && a < first_cap) return 0; /* an xs: its operand is its stack */
  for (int i = 0; i < s->n; i++)
    if (s->node[i] == x) return 0;
  s->node[s->n++] = x;
  return 0;
}

/* The stack (T, ...) in dst of region node x. */
static int stack_of(const stacks *s, const ir_graph *r, const int *ins, int first_cap, int n_carry, int x) {
  int a = arg_index(r, x);
  if (a >= n_carry && a < first_cap) return ins[a];
  for (int i = 0; i < s->n; i++)
    if (s->node[i] == x) return s->outer[i];
  return -1;
}

/* One term's sum over the steps, in dst. */
static int term_sum(const bld *b, const term *t, const ir_graph *r, const stacks *s, const int *ins, int first_cap,
                    int n_carry) {
  ir_graph *dst = b->dst;
  bool drop[MAXD] = {true};
  static const int swap[2] = {1, 0};
  if (t->kind == TERM_STACK) return mk_sum(b, stack_of(s, r, ins, first_cap, n_carry, t->node), drop);
  if (t->kind == TERM_SUM) {
    const ir_node *sn = &r->nodes[t->p];
    for (int i = 0; i < sn->attrs.naxes; i++) drop[sn->attrs.axes[i] + 1] = true;
    int y = mk_sum(b, stack_of(s, r, ins, first_cap, n_carry, sn->in[0]), drop);
    const ir_node *tn = &r->nodes[t->node];
    if (y >= 0 && !same_type(&dst->nodes[y], tn)) y = mk_reshape(b, y, tn->ndim, tn->shape);
    return y;
  }
  const ir_node *tn = &r->nodes[t->node];
  int side[2], fac[2] = {t->p, t->q};
  bool tr[2] = {t->pt, t->qt};
  for (int j = 0; j < 2; j++) {
    int a = arg_index(r, fac[j]);
    if (a >= first_cap) {
      side[j] = ins[a]; /* the same every step */
      if (tr[j]) side[j] = mk_permute(b, side[j], swap);
      continue;
    }
    int x = stack_of(s, r, ins, first_cap, n_carry, fac[j]);
    if (arg_index(r, fac[1 - j]) >= first_cap) {
      side[j] = mk_sum(b, x, drop); /* the sum of this side's steps */
      if (side[j] >= 0 && tr[j]) side[j] = mk_permute(b, side[j], swap);
    } else {
      side[j] = flatten_steps(b, x, j, tr[j]);
    }
    if (side[j] < 0) return -1;
  }
  return mk(b, OP_MATMUL, tn->dtype, 2, tn->shape, 2, side, NULL);
}

/* Scan node i of src into dst (its operands ins[], dst's ids) with its
 * accumulating carries taken out. kmap[k]: result k's new index, or
 * -2 - (the dst id of its value). The node's id, or -1 (out of memory). */
static int sums_scan(ir_graph *dst, const ir_graph *src, int i, const int *ins, int *kmap) {
  const ir_node *n = &src->nodes[i];
  const ir_graph *r = n->sub[0];
  int nc = n->n_carry, first_cap = nc + n->n_xs, n_res = r->n_outputs, id = -1;
  for (int k = 0; k < n_res; k++) kmap[k] = k;
  int *uses = ir_use_counts(r);
  acc *accs = alloc_calloc((size_t)nc + 1, sizeof *accs);
  bool *out = alloc_calloc((size_t)n_res + 1, sizeof *out); /* a carry taken out, or a y that is an xs */
  stacks s = {0, alloc_malloc(sizeof(int) * ((size_t)r->n_nodes + 1)), alloc_malloc(sizeof(int) * ((size_t)r->n_nodes + 1))};
  int *rmap = alloc_malloc(sizeof(int) * ((size_t)r->n_nodes + 1));
  int *cins = alloc_malloc(sizeof(int) * ((size_t)n->n_in + 1)), *buf = NULL;
  ir_graph *nr = NULL;
  bool ok = uses && accs && out && s.node && s.outer && rmap && cins;
  int n_out = 0, n_pass = 0;
  for (int k = 0; k < nc && ok && n->n_xs > 0; k++) n_out += out[k] = accumulates(n, uses, k, &accs[k]);
  for (int k = nc; k < n_res && ok; k++) {
    int a = arg_index(r, r->outputs[k]);
    n_pass += out[k] = a >= nc && a < first_cap;
  }
  if (ok && !n_out && !n_pass) {
    ir_node c = *n;
    c.in = (int *)ins;
    id = ir_add(dst, &c);
    goto done;
  }
  for (int k = 0; k < nc && ok; k++)
    for (int e = 0; out[k] && e < accs[k].n_terms; e++) {
      const term *t = &accs[k].t[e];
      if (t->kind == TERM_STACK) stack_need(&s, r, first_cap, nc, t->node);
      if (t->kind == TERM_SUM) stack_need(&s, r, first_cap, nc, r->nodes[t->p].in[0]);
      for (int j = 0; t->kind == TERM_MATMUL && j < 2; j++) {
        int f = j ? t->q : t->p;
        if (arg_index(r, f) < first_cap) stack_need(&s, r, first_cap, nc, f);
      }
    }
  /* the body without those carries, yielding the stacks */
  ok = ok && (nr = ir_region_new(dst, r->name)) != NULL;
  int removed_before = 0;
  for (int x = 0; x < r->n_inputs && ok; x++) {
    ir_node in = r->nodes[x];
    if (in.index < nc && out[in.index]) {
      rmap[x] = -1;
      removed_before++;
      continue;
    }
    in.index -= in.index < nc ? removed_before : n_out;
    ok = (rmap[x] = ir_append(nr, &in)) >= 0;
  }
  int max_in = 1;
  for (int x = 0; x < r->n_nodes; x++)
    if (r->nodes[x].n_in > max_in) max_in = r->nodes[x].n_in;
  ok = ok && (buf = alloc_malloc(sizeof(int) * (size_t)max_in)) != NULL;
  for (int x = r->n_inputs; x < r->n_nodes && ok; x++) {
    ir_node c = r->nodes[x];
    bool dead = false;
    for (int j = 0; j < c.n_in; j++) dead |= (buf[j] = rmap[c.in[j]]) < 0;
    c.in = buf;
    rmap[x] = dead ? -1 : ir_add(nr, &c);
    ok = dead || rmap[x] >= 0;
  }
  for (int o = 0; o < n_res && ok; o++)
    if (!out[o]) ok = rmap[r->outputs[o]] >= 0 && !ir_add_output(nr, rmap[r->outputs[o]]);
  for (int e = 0; e < s.n && ok; e++) ok = rmap[s.node[e]] >= 0 && !ir_add_output(nr, rmap[s.node[e]]);
  /* the node: the kept carries' inits, the xs, the captures */
  int m = 0;
  for (int j = 0; j < n->n_in && ok; j++)
    if (!(j < nc && out[j])) cins[m++] = ins[j];
  if (ok) {
    ir_node c = *n;
    c.in = cins;
    c.n_in = m;
    c.n_carry = nc - n_out;
    c.sub[0] = nr;
    ok = (id = ir_append(dst, &c)) >= 0;
  }
  bld b = {dst, n->file, n->line};
  sym_dim T = ok ? dst->nodes[cins[nc - n_out]].shape[0] : sym_const(0);
  for (int e = 0; e < s.n && ok; e++) {
    const ir_node *v = &r->nodes[s.node[e]];
    ir_node g = {.op = IR_GET, .dtype = v->dtype, .ndim = v->ndim + 1, .n_in = 1, .in = &id, .file = n->file, .line = n->line};
    g.shape[0] = T;
    memcpy(g.shape + 1, v->shape, sizeof(sym_dim) * (size_t)v->ndim);
    g.attrs.k = n_res - n_out - n_pass + e;
    ok = v->ndim < MAXD && (s.outer[e] = ir_add(dst, &g)) >= 0;
  }
  for (int k = 0, kept = 0; k < n_res && ok; k++) {
    if (!out[k]) {
      kmap[k] = kept++;
      continue;
    }
    if (k >= nc) {
      kmap[k] = -2 - ins[arg_index(r, r->outputs[k])]; /* the xs it passes on */
      continue;
    }
    const ir_node *ty = &r->nodes[k];
    int sum = -1;
    for (int e = 0; e < accs[k].n_terms && ok; e++) {
      int y = term_sum(&b, &accs[k].t[e], r, &s, ins, first_cap, nc);
      if (y >= 0 && sum >= 0) y = mk_binary(&b, OP_ADD, sum, y, ty->ndim, ty->shape);
      ok = (sum = y) >= 0;
    }
    int v = ok ? mk_binary(&b, OP_ADD, ins[k], sum, ty->ndim, ty->shape) : -1;
    ok = v >= 0;
    kmap[k] = -2 - v;
  }
  if (!ok) id = -1;
done:
  ir_free(nr);
  alloc_free(uses), alloc_free(accs), alloc_free(out), alloc_free(s.node), alloc_free(s.outer);
  alloc_free(rmap), alloc_free(cins), alloc_free(buf);
  return ok ? id : -1;
}

ir_graph *pass_sums(ir_graph *g) {
  bool scans = false;
  for (int i = 0; i < g->n_nodes; i++) scans |= g->nodes[i].op == IR_SCAN && g->nodes[i].sub[0];
  if (!scans) return g;
  int max_in = 1;
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i].n_in > max_in) max_in = g->nodes[i].n_in;
  int *map = alloc_malloc(sizeof(int) * ((size_t)g->n_nodes + 1)), *ins = alloc_malloc(sizeof(int) * (size_t)max_in);
  int **kmaps = alloc_calloc((size_t)g->n_nodes + 1, sizeof *kmaps);
  ir_graph *dst = map && ins && kmaps ? ir_new_like(g) : NULL;
  bool ok = dst != NULL;
  for (int i = 0; i < g->n_nodes && ok; i++) {
    ir_node n = g->nodes[i];
    for (int j = 0; j < n.n_in; j++) ins[j] = map[n.in[j]];
    n.in = ins;
    if (n.op == IR_SCAN && n.sub[0]) {
      ok = (kmaps[i] = alloc_malloc(sizeof(int) * ((size_t)n.sub[0]->n_outputs + 1))) != NULL &&
           (map[i] = sums_scan(dst, g, i, ins, kmaps[i])) >= 0;
      continue;
    }
    const int *km = n.op == IR_GET ? kmaps[g->nodes[i].in[0]] : NULL;
    if (km && km[n.attrs.k] < -1) {
      map[i] = -2 - km[n.attrs.k];
      continue;
    }
    if (km) n.attrs.k = km[n.attrs.k];
    ok = (map[i] = ir_add(dst, &n)) >= 0;
  }
  ok = ok && !ir_copy_tail(dst, g, map);
  for (int i = 0; kmaps && i < g->n_nodes; i++) alloc_free(kmaps[i]);
  alloc_free(kmaps), alloc_free(map), alloc_free(ins);
  if (!ok) ir_free(dst), dst = NULL;
  ir_free(g);
  return dst;
}
