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
 * It fires only when nothing else reads s, y, x, the max, e, the sum or p,
 * only for f32 and f64, and only when q, k and v share their batch dims.
 * Two looser forms, those of examples/llama.h's decode step: the permute
 * may be any whose last two dims are k's swapped (k is then a permute the
 * rewrite makes), and a reshape keeping the last dim may sit after y and
 * before the final matmul, with a mask that means the same over the
 * unreshaped scores (match_forward).
 *
 * Under autograd the backward that kiln_backward recorded reads p, e and the
 * sum; it is matched too (match_backward: the dozen primitives that the
 * matmul, div, sum, exp, where and scale formulas of autograd.c make), and
 * its results dq, dk and dv (those present) become slices of one
 * attention_grad(q, k, v, o, do[, mask]) node, the flash attention backward.
 * Anything else reading an intermediate keeps the whole pattern unfused.
 * The LLVM backend runs it on its own copy of a variant's graph (runtime.c),
 * so the interpreter, check mode's reference and kiln_export keep the
 * unfused ops. KILN_FUSE_ATTENTION=0 turns it off. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tracer/tracer.h"

typedef struct attn_match {
  int q, k, v, mask; /* node ids; mask -1 when there is none */
  int s;             /* the scores' matmul */
  bool kperm;        /* k is permute(node k, perm): a node the rewrite makes */
  int perm[MAXD];
  double scale;
  bool drop;         /* a bool mask's value that drops an entry */
  int scale_node;    /* the scale's constant (-1: none), by_div its divide */
  bool by_div;
  int p, e, sum;     /* the forward's probabilities, exps and their sum */
  int grad[3];       /* the backward's dq, dk, dv (-1: not made); all -1: no backward */
  int dout;          /* o's gradient (with a backward) */
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

/* s = matmul(q, kt) with kt = permute(x): kt swaps the last two dims of k
 * = x, or of k = permute(x, perm) otherwise (the permute of (S,H,hs) keys
 * to (H,hs,S) that llama.h's transpose of its (H,S,hs) keys composes to),
 * which the rewrite makes. */
static bool match_scores(const ir_graph *g, int s, attn_match *m) {
  const ir_node *ns = node(g, s);
  if (ns->op != OP_MATMUL || ns->ndim < 2) return false;
  const ir_node *q = node(g, ns->in[0]), *kt = node(g, ns->in[1]);
  int nd = ns->ndim;
  if (kt->op != OP_PERMUTE || q->ndim != nd || kt->ndim != nd) return false;
  m->kperm = false;
  for (int i = 0; i < nd; i++) {
    m->perm[i] = kt->attrs.perm[i < nd - 2 ? i : i == nd - 2 ? nd - 1 : nd - 2];
    m->kperm |= m->perm[i] != i;
  }
  for (int i = 0; i < nd - 2; i++)
    if (!dims_eq(g, q->shape[i], ns->shape[i]) || !dims_eq(g, kt->shape[i], ns->shape[i])) return false;
  m->q = ns->in[0];
  m->k = kt->in[0];
  m->s = s;
  return true;
}

/* The input of id when id is a reshape that keeps the last dim (so the
 * rows, in order, and the softmax over them are the same) and nothing else
 * reads that input; else id. The caller checks id's own uses. */
static int through_reshape(const ir_graph *g, const int *uses, int id) {
  const ir_node *n = node(g, id);
  if (n->op != OP_RESHAPE || n->n_in != 1 || n->ndim < 2 || !used(uses, n->in[0], 1)) return id;
  const ir_node *x = node(g, n->in[0]);
  return x->ndim >= 2 && dims_eq(g, x->shape[x->ndim - 1], n->shape[n->ndim - 1]) ? n->in[0] : id;
}

/* y = s, s*c, c*s or s/c: the scores and their scale. */
static bool match_scaled(const ir_graph *g, const int *uses, int y, attn_match *m) {
  y = through_reshape(g, uses, y); /* llama.h's (H,T,S) scores seen as (KVH,G,T,S) */
  const ir_node *n = node(g, y);
  double c;
  m->scale = 1;
  if ((n->op == OP_MUL || n->op == OP_DIV) && n->n_in == 2) {
    int s = n->in[0], other = n->in[1];
    if (n->op == OP_MUL && const_value(node(g, s), &c)) s = n->in[1], other = n->in[0];
    if (const_value(node(g, other), &c) && ir_node_numel_const(node(g, other)) == 1 && same_shape(g, node(g, s), n) &&
        used(uses, s, 1) && match_scores(g, through_reshape(g, uses, s), m)) {
      m->scale = n->op == OP_MUL ? c : 1 / c;
      m->scale_node = other;
      m->by_div = n->op == OP_DIV;
      return true;
    }
  }
  m->scale_node = -1;
  return match_scores(g, through_reshape(g, uses, y), m);
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

/* o = matmul(softmax(x), v) as nn.c spells softmax. The uses of p, e and
 * the sum are left to the caller (a backward reads them). */
static bool match_forward(const ir_graph *g, const int *uses, int o, attn_match *m) {
  const ir_node *no = node(g, o);
  if (no->op != OP_MATMUL || (no->dtype != KILN_F32 && no->dtype != KILN_F64) || no->ndim < 2) return false;
  int p3 = no->in[0], v = no->in[1], p = used(uses, p3, 1) ? through_reshape(g, uses, p3) : p3;
  const ir_node *np = node(g, p);
  if (np->op != OP_DIV) return false;
  int e = np->in[0], sum = np->in[1];
  const ir_node *ne = node(g, e), *nsum = node(g, sum);
  if (ne->op != OP_EXP || !same_shape(g, ne, np) || !last_dim_reduce(nsum, OP_SUM) || nsum->in[0] != e) return false;
  m->p = p, m->e = e, m->sum = sum;
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
  /* the probabilities @ v are the scores' rows in order (reshapes between keep them so) */
  const ir_node *ns = node(g, m->s), *nx = node(g, x);
  if (ns->ndim != r || !same_shape(g, node(g, p3), ns)) return false;
  if (m->mask >= 0 && !same_shape(g, nx, ns)) {
    /* a mask broadcast over reshaped scores (rows R' of x, R of s) must mean the
     * same over s: a row of the mask for every row, or rows that are s's rows */
    const ir_node *mk = node(g, m->mask);
    if (mk->ndim > 2) return false;
    if (mk->ndim == 2 && !(sym_is_const(mk->shape[0]) && mk->shape[0].c == 1) &&
        !(dims_eq(g, nx->shape[nx->ndim - 2], ns->shape[r - 2]) && dims_eq(g, mk->shape[0], ns->shape[r - 2])))
      return false;
  }
  /* every operand of the fused op in the result's dtype */
  return node(g, m->q)->dtype == no->dtype && node(g, m->k)->dtype == no->dtype && nv->dtype == no->dtype;
}

/* The one node that reads id (its only use), or -1. */
static int sole_user(const ir_graph *g, const int *uses, int id) {
  if (!used(uses, id, 1)) return -1;
  for (int i = id + 1; i < g->n_nodes; i++)
    for (int j = 0; j < g->nodes[i].n_in; j++)
      if (g->nodes[i].in[j] == id) return i;
  return -1; /* an output or a write */
}

/* Whether n is a permute of a swapping its last two dims. */
static bool swap_last2(const ir_node *n, int a) {
  int nd = n->ndim;
  if (n->op != OP_PERMUTE || n->in[0] != a || nd < 2) return false;
  for (int i = 0; i < nd; i++)
    if (n->attrs.perm[i] != (i < nd - 2 ? i : i == nd - 2 ? nd - 1 : nd - 2)) return false;
  return true;
}

/* A two-input op on a and b, in either order when commutes. */
static bool binary_of(const ir_node *n, int op, int a, int b, bool commutes) {
  return n->op == op && n->n_in == 2 &&
         ((n->in[0] == a && n->in[1] == b) || (commutes && n->in[0] == b && n->in[1] == a));
}

/* The scalar 0 of where's backward. */
static bool is_zero(const ir_graph *g, int id) {
  double c;
  return const_value(node(g, id), &c) && c == 0 && ir_node_numel_const(node(g, id)) == 1;
}

/* ds, the gradient of the scores s, from dx, the gradient of the masked
 * scores x: where's backward for a bool mask, the scale's; -1 if not so. */
static int match_ds(const ir_graph *g, const int *uses, const attn_match *m, int dx) {
  int dy = dx;
  if (m->mask >= 0 && node(g, m->mask)->dtype == KILN_BOOL) {
    if ((dy = sole_user(g, uses, dx)) < 0) return -1;
    const ir_node *w = node(g, dy);
    int side = m->drop ? 2 : 1; /* where(mask, g, 0) for where(mask, y, -inf); where(mask, 0, g) for masked_fill */
    if (w->op != OP_WHERE || w->in[0] != m->mask || w->in[side] != dx || !is_zero(g, w->in[3 - side])) return -1;
  }
  if (m->scale_node < 0) return dy;
  int ds = sole_user(g, uses, dy);
  if (ds < 0 || !binary_of(node(g, ds), m->by_div ? OP_DIV : OP_MUL, dy, m->scale_node, false)) return -1;
  return ds;
}

/* The backward of a forward match o, as autograd.c's formulas record it:
 *   dv = matmul(permute(p), do)                     matmul's, for v
 *   dp = matmul(do, permute(v));  a = dp / sum      matmul's for p; div's for e
 *   de = a + expand(sum(-(a * e / sum)))            div's for the sum, sum's
 *   dx = de * e                                     exp's (sub passes it on)
 *   ds = dx, masked by where, scaled                where's, the scale's
 *   dq = matmul(ds, k); dk = permute(matmul(permute(q), ds))
 * Fills m->grad and m->dout and says whether p, e and the sum have no
 * other readers; a forward without a backward is the case of no grads. */
static bool match_backward(const ir_graph *g, const int *uses, int o, attn_match *m) {
  m->grad[0] = m->grad[1] = m->grad[2] = m->dout = -1;
  int dsum = 0; /* the uses of e and the sum the backward adds */
  /* dv: p's second reader */
  if (uses[m->p] == 2) {
    int pt = -1, dv;
    for (int i = m->p + 1; i < g->n_nodes && pt < 0; i++)
      if (i != o && swap_last2(node(g, i), m->p)) pt = i;
    if (pt < 0 || (dv = sole_user(g, uses, pt)) < 0 || node(g, dv)->op != OP_MATMUL || node(g, dv)->in[0] != pt) return false;
    m->grad[2] = dv;
    m->dout = node(g, dv)->in[1];
  } else if (uses[m->p] != 1) {
    return false;
  }
  /* dp = matmul(do, permute(v)), then the softmax's backward */
  if (uses[m->e] == 4 && uses[m->sum] == 3) {
    int dp = -1;
    for (int i = m->v + 1; i < g->n_nodes && dp < 0; i++) {
      const ir_node *n = node(g, i);
      if (n->op == OP_MATMUL && n->n_in == 2 && (m->dout < 0 || n->in[0] == m->dout) && i != o &&
          swap_last2(node(g, n->in[1]), m->v) && used(uses, n->in[1], 1))
        dp = i;
    }
    if (dp < 0) return false;
    m->dout = node(g, dp)->in[0];
    int a = sole_user(g, uses, dp), b = -1, c, d, r, xe, de = -1, dx, ds;
    if (a < 0 || !binary_of(node(g, a), OP_DIV, dp, m->sum, false) || !used(uses, a, 2)) return false;
    for (int i = a + 1; i < g->n_nodes; i++) {
      if (binary_of(node(g, i), OP_MUL, a, m->e, true)) b = i;
      if (node(g, i)->op == OP_ADD && node(g, i)->n_in == 2 && (node(g, i)->in[0] == a || node(g, i)->in[1] == a)) de = i;
    }
    if (b < 0 || de < 0 || (c = sole_user(g, uses, b)) < 0 || !binary_of(node(g, c), OP_DIV, b, m->sum, false) ||
        (d = sole_user(g, uses, c)) < 0 || node(g, d)->op != OP_NEG || (r = sole_user(g, uses, d)) < 0)
      return false;
    if (last_dim_reduce(node(g, r), OP_SUM)) { /* a sum over one key and its expand are not recorded */
      if ((xe = sole_user(g, uses, r)) < 0 || node(g, xe)->op != OP_EXPAND) return false;
    } else {
      /* without the sum the form is the softmax's backward only over one key */
      const ir_node *kn = node(g, m->k);
      if (kn->ndim < 2 || !sym_is_const(kn->shape[kn->ndim - 2]) || kn->shape[kn->ndim - 2].c != 1) return false;
      xe = d;
    }
    if (!binary_of(node(g, de), OP_ADD, a, xe, true) || !same_shape(g, node(g, xe), node(g, a)) || !used(uses, xe, 1) ||
        !used(uses, de, 1) ||
        (dx = sole_user(g, uses, de)) < 0 || !binary_of(node(g, dx), OP_MUL, de, m->e, true) ||
        (ds = match_ds(g, uses, m, dx)) < 0)
      return false;
    /* ds's readers: dq = matmul(ds, k), dk = permute(matmul(permute(q), ds)) */
    int n_ds = 0;
    for (int i = ds + 1; i < g->n_nodes; i++) {
      const ir_node *n = node(g, i);
      if (n->op == OP_MATMUL && n->n_in == 2 && n->in[0] == ds && n->in[1] == m->k) {
        m->grad[0] = i, n_ds++;
      } else if (n->op == OP_MATMUL && n->n_in == 2 && n->in[1] == ds && swap_last2(node(g, n->in[0]), m->q) &&
                 used(uses, n->in[0], 1)) {
        int dk = sole_user(g, uses, i);
        if (dk < 0 || !swap_last2(node(g, dk), i)) return false;
        m->grad[1] = dk, n_ds++;
      }
    }
    if (n_ds == 0 || !used(uses, ds, n_ds)) return false;
    dsum = 2;
  }
  if (!used(uses, m->e, 2 + dsum) || !used(uses, m->sum, 1 + dsum)) return false;
  /* each gradient has its input's shape (the slices of attention_grad are),
   * and comes after o and do, which the attention_grad node made at the
   * first gradient reads */
  const int ins[3] = {m->q, m->k, m->v};
  for (int i = 0; i < 3; i++)
    if (m->grad[i] >= 0 && (!same_shape(g, node(g, m->grad[i]), node(g, ins[i])) || m->grad[i] <= o ||
                            m->grad[i] <= m->dout))
      return false;
  return m->dout < 0 || same_shape(g, node(g, m->dout), node(g, o));
}

/* The forward of o, and its backward when there is one. */
static bool match_attention(const ir_graph *g, const int *uses, int o, attn_match *m) {
  if (!match_forward(g, uses, o, m) || !match_backward(g, uses, o, m)) return false;
  /* the backward's dq and dk read k itself: a k the rewrite makes has no such readers */
  return !m->kperm || (m->grad[0] < 0 && m->grad[1] < 0 && m->grad[2] < 0);
}

static bool enabled(void) {
  const char *e = getenv("KILN_FUSE_ATTENTION");
  return !e || strcmp(e, "0") != 0;
}

/* A training graph's attention (forward and backward) fuses where its score
 * matrices are big: the fused backward recomputes the scores, which costs
 * more than it saves at short lengths (W8, T = 64: 13% more CPU a step),
 * and what it saves is the (T, S) probabilities a layer keeps for the
 * backward. Constant T * S below TRAIN_MIN_SCORES stays unfused;
 * KILN_FUSE_ATTENTION=1 fuses every length (tests). */
enum { TRAIN_MIN_SCORES = 256 * 256 };

static bool train_pays(const ir_graph *g, const attn_match *m) {
  if (m->grad[0] < 0 && m->grad[1] < 0 && m->grad[2] < 0) return true; /* no backward */
  const char *e = getenv("KILN_FUSE_ATTENTION");
  if (e && !strcmp(e, "1")) return true;
  const ir_node *q = node(g, m->q), *k = node(g, m->k);
  if (q->ndim < 2 || k->ndim < 2) return true;
  sym_dim t = q->shape[q->ndim - 2], s = k->shape[k->ndim - 2];
  if (!sym_is_const(t) || !sym_is_const(s)) return true;
  return t.c * s.c >= TRAIN_MIN_SCORES;
}

/* The inputs node i has once the matches are made attention nodes: a
 * forward's q, k, v[, mask]; a gradient's those of its attention_grad, q, k,
 * v, o, do[, mask]. owner[i]: the match whose gradient node i is, or -1. */
static int inputs_after(const ir_graph *g, const bool *hit, const int *owner, const attn_match *found, int i,
                        int ins[6], const int **in) {
  if (!hit[i] && owner[i] < 0) return *in = g->nodes[i].in, g->nodes[i].n_in;
  const attn_match *m = &found[hit[i] ? i : owner[i]];
  ins[0] = m->q, ins[1] = m->k, ins[2] = m->v;
  *in = ins;
  if (hit[i]) return ins[3] = m->mask, m->mask >= 0 ? 4 : 3;
  ins[3] = owner[i], ins[4] = m->dout, ins[5] = m->mask;
  return m->mask >= 0 ? 6 : 5;
}

/* Appends n (op, in, attrs set) to c with the dtype and shape its rule gives; its id or -1. */
static int append_inferred(ir_graph *c, ir_node *n) {
  char err[256];
  shape_env env = {.g = c};
  if (symshape_infer(&env, n, err, sizeof err)) return -1;
  return ir_append(c, n);
}

/* Gradient `which` (0 dq, 1 dk, 2 dv) of the match whose attention_grad
 * node is ag in c: reshape(slice(ag)) to the shape of g's node i. */
static int grad_slice(ir_graph *c, const ir_graph *g, const attn_match *m, int ag, int which, int i) {
  const int src[3] = {m->q, m->k, m->v};
  sym_dim at = sym_const(0), len = sym_const(0);
  for (int x = 0; x <= which; x++) {
    const ir_node *t = node(g, src[x]);
    sym_dim nx = sym_const(1);
    for (int d = 0; d < t->ndim; d++) nx = sym_mul(c->sym, nx, t->shape[d]);
    if (x < which) at = sym_add(c->sym, at, nx);
    else len = nx;
  }
  ir_node sl = {.op = OP_SLICE, .n_in = 1, .in = &ag, .file = g->nodes[i].file, .line = g->nodes[i].line};
  sl.attrs.dim = 0, sl.attrs.start = at, sl.attrs.end = sym_add(c->sym, at, len), sl.attrs.step = 1;
  int id = append_inferred(c, &sl);
  if (id < 0) return -1;
  ir_node rs = {.op = OP_RESHAPE, .n_in = 1, .in = &id, .file = sl.file, .line = sl.line};
  rs.attrs.ndim = g->nodes[i].ndim;
  memcpy(rs.attrs.shape, g->nodes[i].shape, sizeof rs.attrs.shape);
  return append_inferred(c, &rs);
}

int pass_attention(const ir_graph *g, ir_graph **out) {
  *out = NULL;
  if (!enabled()) return 0;
  size_t nn = (size_t)g->n_nodes + 1;
  int *uses = ir_use_counts(g), *map = alloc_malloc(sizeof(int) * nn), *owner = alloc_malloc(sizeof(int) * nn);
  int *which = alloc_malloc(sizeof(int) * nn), *ag = alloc_malloc(sizeof(int) * nn);
  attn_match *found = alloc_calloc(nn, sizeof *found);
  bool *hit = alloc_calloc(nn, sizeof *hit), *keep = alloc_calloc(nn, 1);
  ir_graph *c = NULL;
  int n_hit = 0, ins[6], mapped[6];
  const int *in;
  if (!uses || !map || !owner || !which || !ag || !found || !hit || !keep) goto oom;
  for (int i = 0; i < g->n_nodes; i++) owner[i] = ag[i] = -1;
  for (int i = 0; i < g->n_nodes; i++) {
    n_hit += hit[i] = match_attention(g, uses, i, &found[i]) && train_pays(g, &found[i]);
    for (int x = 0; hit[i] && x < 3; x++)
      if (found[i].grad[x] >= 0) owner[found[i].grad[x]] = i, which[found[i].grad[x]] = x;
  }
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
    int n = inputs_after(g, hit, owner, found, i, ins, &in);
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
    int k = inputs_after(g, hit, owner, found, i, ins, &in);
    int *big = k > 6 ? alloc_malloc(sizeof(int) * (size_t)k) : NULL;
    if (k > 6 && !big) goto oom;
    int *to = big ? big : mapped;
    for (int j = 0; j < k; j++) to[j] = map[in[j]];
    n.in = to;
    n.n_in = k;
    if (hit[i] || owner[i] >= 0) {
      memset(&n.attrs, 0, sizeof n.attrs);
      const attn_match *m = &found[hit[i] ? i : owner[i]];
      n.attrs.value = m->scale;
      n.attrs.flag = m->mask >= 0 && m->drop;
    }
    if (hit[i]) n.op = OP_ATTENTION;
    if (hit[i] && found[i].kperm) { /* k = permute(x, perm), made here */
      const ir_node *kt = node(g, g->nodes[found[i].s].in[1]);
      ir_node pn = {.op = OP_PERMUTE, .n_in = 1, .in = &to[1], .file = kt->file, .line = kt->line};
      memcpy(pn.attrs.perm, found[i].perm, sizeof pn.attrs.perm);
      if ((to[1] = append_inferred(c, &pn)) < 0) goto oom;
    }
    if (owner[i] >= 0) { /* the match's attention_grad, made at its first gradient, then a slice of it */
      int o = owner[i];
      if (ag[o] < 0) {
        const ir_node *no = node(g, o);
        n.op = OP_ATTENTION_GRAD, n.file = no->file, n.line = no->line;
        if ((ag[o] = append_inferred(c, &n)) < 0) goto oom;
      }
      map[i] = grad_slice(c, g, &found[o], ag[o], which[i], i);
    } else {
      map[i] = ir_append(c, &n);
    }
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
  alloc_free(uses), alloc_free(map), alloc_free(owner), alloc_free(which), alloc_free(ag);
  alloc_free(found), alloc_free(hit), alloc_free(keep);
  return n_hit;
oom:
  pass_attention_free(c);
  alloc_free(uses), alloc_free(map), alloc_free(owner), alloc_free(which), alloc_free(ag);
  alloc_free(found), alloc_free(hit), alloc_free(keep);
  return -1;
}

void pass_attention_free(ir_graph *g) {
  if (!g) return;
  g->sym = NULL;
  ir_free(g);
}
