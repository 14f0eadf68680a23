/* Fusion: partitions a graph into kernels. A node is either materialized (it
 * gets a buffer and is the root of a kernel that stores it) or inlined into
 * the expressions of the kernels that use it. Views never run: they compose
 * into the index map (offset and strides) through which a kernel reads their
 * base buffer. Kernels come in three kinds:
 *   pointwise   a MAP over the root's shape, the whole inlined tree in one loop
 *   row-wise    reductions over the trailing dims of the root's shape, run as
 *               REDUCE stages per row before the MAP (softmax, layer norm)
 *   reduction   a materialized reduce: its inlined prologue in the inner loop,
 *               the result stored once per outer element
 * plus matmul (BLAS) and eager (one node through its eager kernel). A bias
 * add or an SGD-style update right after a GEMM is folded into the GEMM's
 * beta (fold_epilogues).
 * The partition is found by building kernels and materializing what does not
 * fit (a reduce wanted by two kernels, a costly node that two kernels would
 * recompute, a reduce whose space differs from its consumer's), until stable. */
#include <string.h>

#include "codegen/codegen.h"

typedef cg_view vmap;

typedef struct fuser {
  const ir_graph *g;
  sym_ctx *sym;
  uint8_t *mat;          /* node -> materialized */
  uint8_t *is_out;       /* node -> a graph output */
  int *kcount;           /* node -> kernels that inlined it (so far) */
  int *klast;            /* node -> last kernel that counted it */
  vmap *map;             /* per node: for leaves, materialized nodes and views */
  cg_program *p;
  int cap_k, cap_buf;
  int restart;           /* a node became materialized: build again */
  /* the entries of memo and seen set since they were last cleared: clearing
   * those alone keeps a round linear in the graph (a memset per kernel
   * made rounds quadratic, most of a large graph's compile) */
  int *memo_set, n_memo_set, *seen_set, n_seen_set;
  int *stack;            /* a walk's nodes to visit (mark_inlined_inputs) */
  /* A round starts at the first node materialized since the last one: what
   * the nodes before it made does not depend on that node (inputs come
   * first), so their buffers and kernels stay. k_mark and b_mark hold the
   * kernel and buffer counts when each node's turn came. */
  int restart_from;
  int *k_mark, *b_mark;
  int *undo_stamp, stamp;
  char *err;
  size_t errn;
} fuser;

/* How the op table says codegen runs an op (cg and cost columns). */
static bool has_class(int op, cg_class c) { return op >= 0 && op < OP_COUNT && op_table[op].cg == c; }
static bool is_compute(int op) { return op == IR_NUMEL || has_class(op, CGC_FUSE) || has_class(op, CGC_REDUCE); }
static bool is_reduce(int op) { return has_class(op, CGC_REDUCE); }
static bool is_view(int op) { return has_class(op, CGC_VIEW); }
/* pow by a constant 1, 2 or 3 is lowered to multiplies (emit.c), so it is cheap */
static bool pow_is_mul(const ir_graph *g, const ir_node *n) {
  const ir_node *e = &g->nodes[n->in[1]];
  if (e->op != IR_CONST || ir_node_numel_const(e) != 1) return false;
  double c = dtype_is_float(e->dtype) ? elem_load(e->dtype, e->data, 0) : 0;
  return c == 1.0 || c == 2.0 || c == 3.0;
}
static bool is_heavy(const ir_graph *g, const ir_node *n) {
  if (n->op < 0 || n->op >= OP_COUNT || op_table[n->op].cost < 1) return false;
  return !(n->op == OP_POW && pow_is_mul(g, n));
}

/* A matmul with a few constant rows (batch-1 inference): a dot product per
 * output element runs faster as our own vectorized loop than as a BLAS call. */
static bool small_matmul(const ir_graph *g, const ir_node *n) {
  if (n->op != OP_MATMUL || n->n_in != 2) return false;
  const ir_node *a = &g->nodes[n->in[0]], *b = &g->nodes[n->in[1]];
  return a->ndim == 2 && b->ndim == 2 && dtype_is_float(n->dtype) && sym_is_const(a->shape[0]) && a->shape[0].c <= 8;
}

/* The node a matvec loads for operand id: through a cast of f16 or bf16 to
 * f32 (exact, and done by the load itself), so that narrow weights are read
 * narrow and never copied out wide. */
static int matvec_operand(const ir_graph *g, int id) {
  const ir_node *n = &g->nodes[id];
  if (n->op != OP_CAST || n->n_in != 1) return id;
  kiln_dtype from = g->nodes[n->in[0]].dtype;
  return (from == KILN_F16 || from == KILN_BF16) && n->dtype == KILN_F32 ? n->in[0] : id;
}

/* Whether matmul n runs as our loop: its (K,N) operand read along rows in
 * memory (K unit-stride, as x @ W^T with W (out,in) is), or, for one row
 * of x, along N (W (in,out)): that loop is a column kernel whose panels
 * keep vectors of outputs in registers as they run down K (lower.c). With
 * (in,out) weights and more rows it would walk columns, and the eager
 * kernel's gemv runs instead, except for f16 or bf16 weights, which that
 * would copy out to f32 whole on every call. */
static bool walks_rows(const fuser *f, const ir_node *n) {
  int w = matvec_operand(f->g, n->in[1]);
  if (w != n->in[1]) return true; /* narrow weights: the other way is an f32 copy of them all */
  const vmap *b = &f->map[w];
  if (b->buf < 0) return false;
  if (sym_is_const(b->stride[0]) && b->stride[0].c == 1) return true;
  const ir_node *x = &f->g->nodes[n->in[0]];
  return sym_is_const(x->shape[0]) && x->shape[0].c == 1 && sym_is_const(b->stride[1]) && b->stride[1].c == 1;
}

static bool is_one(const ir_graph *g, sym_dim d) {
  if (sym_is_const(d)) return d.c == 1;
  for (int i = 0; i < g->n_guards; i++) {
    const sym_guard *gd = &g->guards[i];
    if (gd->op != SYM_EQ) continue;
    if ((sym_same(gd->lhs, d) && sym_is_const(gd->rhs) && gd->rhs.c == 1) ||
        (sym_same(gd->rhs, d) && sym_is_const(gd->lhs) && gd->lhs.c == 1))
      return true;
  }
  return false;
}

static void contiguous(sym_ctx *s, int ndim, const sym_dim *shape, sym_dim *stride) {
  sym_dim acc = sym_const(1);
  for (int i = ndim - 1; i >= 0; i--) {
    stride[i] = acc;
    acc = sym_mul(s, acc, shape[i]);
  }
}

static bool same_dims(int n, const sym_dim *a, const sym_dim *b) {
  for (int i = 0; i < n; i++)
    if (!sym_same(a[i], b[i])) return false;
  return true;
}

/* ---- buffers and maps ---- */

static int add_buf(fuser *f, cg_buf_kind kind, int node) {
  cg_program *p = f->p;
  if (p->n_buf == f->cap_buf) {
    int cap = f->cap_buf ? f->cap_buf * 2 : 32;
    cg_buf *nb = alloc_realloc(p->buf, sizeof *nb * (size_t)cap);
    if (!nb) return -1;
    p->buf = nb;
    f->cap_buf = cap;
  }
  const ir_node *n = &f->g->nodes[node];
  cg_buf *b = &p->buf[p->n_buf];
  memset(b, 0, sizeof *b);
  b->kind = kind;
  b->node = node;
  b->dtype = n->dtype;
  b->ndim = n->ndim;
  memcpy(b->shape, n->shape, sizeof b->shape);
  b->first = b->last = -1;
  b->alias_of = b->scratch_of = -1;
  p->node_buf[node] = p->n_buf;
  f->map[node].buf = p->n_buf;
  f->map[node].off = sym_const(0);
  contiguous(f->sym, n->ndim, n->shape, f->map[node].stride);
  return p->n_buf++;
}

/* The index map of a view node from its input's; 0, or 1 when the view cannot
 * be expressed with strides (a reshape of a non-contiguous map). */
static int view_map(fuser *f, const ir_node *n, vmap *out) {
  const ir_graph *g = f->g;
  const ir_node *x = &g->nodes[n->in[0]];
  const vmap *m = &f->map[n->in[0]];
  sym_ctx *s = f->sym;
  out->buf = m->buf;
  out->off = m->off;
  const op_attrs *a = &n->attrs;
  switch (n->op) {
  case OP_PERMUTE:
    for (int i = 0; i < n->ndim; i++) out->stride[i] = m->stride[a->perm[i]];
    return 0;
  case OP_EXPAND:
    for (int i = 0; i < n->ndim; i++) {
      int j = i - (n->ndim - x->ndim);
      out->stride[i] = j < 0 || (is_one(g, x->shape[j]) && !is_one(g, n->shape[i])) ? sym_const(0) : m->stride[j];
    }
    return 0;
  case OP_SLICE:
    memcpy(out->stride, m->stride, sizeof out->stride);
    out->off = sym_add(s, m->off, sym_mul(s, a->start, m->stride[a->dim]));
    out->stride[a->dim] = sym_mul(s, m->stride[a->dim], sym_const(a->step));
    return 0;
  case OP_RESHAPE: {
    sym_dim want[MAXD];
    contiguous(s, x->ndim, x->shape, want);
    for (int i = 0; i < x->ndim; i++)
      if (!is_one(g, x->shape[i]) && !sym_same(want[i], m->stride[i])) return 1;
    contiguous(s, n->ndim, n->shape, out->stride);
    return 0;
  }
  default:
    return 1;
  }
}

/* ---- kernels ---- */

typedef struct kbuild {
  cg_kernel *k;
  int cap_acc, cap_expr, cap_stage, cap_nodes;
  int *memo;             /* node -> expr id + 1 in this kernel */
  int ref_ndim;          /* the reference shape values align with (right-aligned) */
  sym_dim ref[MAXD];
  int perm[MAXD];        /* space dim -> reference dim */
  int n_kept;            /* reduce kernels with keepdim=false: values of rank n_kept map to the kept dims */
  int kept[MAXD];
  int ovr_node[2];       /* nodes whose dims map to reference dims ovr_dims (a small matmul's operands) */
  int ovr_dims[2][MAXD];
  bool row;              /* trailing dims of the reference are inner */
  int row_inner;         /* how many */
} kbuild;

#define GROW(ptr, n, cap)                                                    \
  do {                                                                       \
    if ((n) == (cap)) {                                                      \
      int nc_ = (cap) ? (cap) * 2 : 8;                                       \
      void *np_ = alloc_realloc((ptr), sizeof *(ptr) * (size_t)nc_);         \
      if (!np_) return -1;                                                   \
      (ptr) = np_;                                                           \
      (cap) = nc_;                                                           \
    }                                                                        \
  } while (0)

static int add_acc(fuser *f, kbuild *kb, int node) {
  cg_kernel *k = kb->k;
  const ir_node *n = &f->g->nodes[node];
  const vmap *m = &f->map[node];
  GROW(k->acc, k->n_acc, kb->cap_acc);
  cg_access *a = &k->acc[k->n_acc];
  a->buf = m->buf;
  a->offset = m->off;
  int ovr = node == kb->ovr_node[0] ? 0 : node == kb->ovr_node[1] ? 1 : -1;
  for (int d = 0; d < k->ndim; d++) {
    int r = kb->perm[d];
    int j;
    if (ovr >= 0) {
      j = -1;
      for (int q = 0; q < n->ndim; q++)
        if (kb->ovr_dims[ovr][q] == r) j = q;
    } else if (kb->n_kept && n->ndim == kb->n_kept) {
      j = -1;
      for (int q = 0; q < kb->n_kept; q++)
        if (kb->kept[q] == r) j = q;
    } else {
      j = r - (kb->ref_ndim - n->ndim);
    }
    a->stride[d] = j < 0 || is_one(f->g, n->shape[j]) ? sym_const(0) : m->stride[j];
  }
  return k->n_acc++;
}

static int add_expr(kbuild *kb, cg_expr e) {
  cg_kernel *k = kb->k;
  GROW(k->expr, k->n_expr, kb->cap_expr);
  k->expr[k->n_expr] = e;
  return k->n_expr++;
}

static int add_stage(kbuild *kb, cg_stage s) {
  cg_kernel *k = kb->k;
  GROW(k->stage, k->n_stage, kb->cap_stage);
  k->stage[k->n_stage] = s;
  return k->n_stage++;
}

static int note_node(fuser *f, kbuild *kb, int node) {
  cg_kernel *k = kb->k;
  GROW(k->nodes, k->n_nodes, kb->cap_nodes);
  k->nodes[k->n_nodes++] = node;
  if (f->klast[node] != k->id) {
    f->klast[node] = k->id;
    f->kcount[node]++;
  }
  return 0;
}

static void materialize(fuser *f, int node) {
  if (!f->mat[node]) {
    f->mat[node] = 1;
    f->restart = 1;
    if (node < f->restart_from) f->restart_from = node;
  }
}

/* Does reduce node r fit this kernel as a REDUCE stage? */
static bool reduce_fits(fuser *f, kbuild *kb, const ir_node *r) {
  const ir_node *x = &f->g->nodes[r->in[0]];
  if (x->ndim != kb->ref_ndim || !same_dims(x->ndim, x->shape, kb->ref)) return false;
  if (!kb->row) {
    /* a reduction kernel: the same axes as its root, and a result that broadcasts
     * back along the kept dims (keepdim, or a reduction to a scalar) */
    if (r->attrs.naxes != kb->k->ndim - kb->k->n_outer) return false;
    if (!r->attrs.keepdim && r->attrs.naxes != x->ndim) return false;
    for (int i = 0; i < r->attrs.naxes; i++)
      if (r->attrs.axes[i] != kb->perm[kb->k->n_outer + i]) return false;
    return true;
  }
  /* a row kernel: the trailing dims, keepdim so the result broadcasts back */
  if (!r->attrs.keepdim || r->attrs.naxes != kb->row_inner) return false;
  for (int i = 0; i < r->attrs.naxes; i++)
    if (r->attrs.axes[i] != x->ndim - kb->row_inner + i) return false;
  return true;
}

/* Accesses a kernel may gather before its inputs' trees are cut off into
 * kernels of their own: room under lower.c's 64 for the loads a pending
 * parent still adds and the stores. */
enum { ACC_SOFT = 40 };

static int expr_of(fuser *f, kbuild *kb, int node, bool root);

static int reduce_stage(fuser *f, kbuild *kb, int node, int op_override) {
  const ir_node *n = &f->g->nodes[node];
  int e = expr_of(f, kb, n->in[0], false);
  if (e < 0) return e;
  if (note_node(f, kb, node)) return -1;
  int st = add_stage(kb, (cg_stage){CG_REDUCE, op_override >= 0 ? op_override : n->op, e, -1, true});
  if (st < 0) return -1;
  return add_expr(kb, (cg_expr){.kind = CG_ACC, .dtype = n->dtype, .a = st});
}

/* Does the kernel broadcast node n (a dim of its space that n has as 1, or lacks)? */
static bool broadcast_here(const fuser *f, const kbuild *kb, const ir_node *n) {
  if (kb->ovr_node[0] >= 0 || kb->n_kept || n->ndim > kb->ref_ndim) return false;
  if (n->ndim < kb->ref_ndim) return true;
  for (int i = 0; i < n->ndim; i++)
    if (is_one(f->g, n->shape[i]) && !is_one(f->g, kb->ref[i])) return true;
  return false;
}

/* Does expression e read a reduce stage's result (a row's statistic, which
 * the kernel computes once per row anyway)? */
static bool uses_acc(const cg_kernel *k, const cg_expr *e) {
  if (e->kind == CG_ACC) return true;
  for (int i = 0; e->kind == CG_OP && i < e->n_in; i++)
    if (uses_acc(k, &k->expr[e->in[i]])) return true;
  return false;
}

/* Expression id for node's value inside the kernel; -1 on OOM, -2 when the
 * build must restart (something was materialized). */
static int expr_of(fuser *f, kbuild *kb, int node, bool root) {
  if (kb->memo[node]) return kb->memo[node] - 1;
  const ir_node *n = &f->g->nodes[node];
  int id;
  if (n->op == IR_CONST && ir_node_numel_const(n) == 1) {
    /* a scalar constant is an immediate: LLVM folds it, pow(x, 3) becomes multiplies */
    double c = elem_load(n->dtype, n->data, 0);
    id = add_expr(kb, (cg_expr){.kind = CG_CONST, .dtype = n->dtype, .c = c});
  } else if (!root && (f->mat[node] || !is_compute(n->op))) {
    int a = add_acc(f, kb, node);
    if (a < 0) return -1;
    id = add_expr(kb, (cg_expr){.kind = CG_LOAD, .dtype = n->dtype, .a = a});
  } else if (is_reduce(n->op)) {
    if (!reduce_fits(f, kb, n)) {
      materialize(f, node);
      return -2;
    }
    id = reduce_stage(f, kb, node, -1);
  } else if (n->op == IR_NUMEL) {
    sym_dim s = ir_numel_value(f->g, n);
    if (sym_is_err(s)) {
      snprintf(f->err, f->errn, "%%%d: numel does not evaluate", node);
      return -1;
    }
    if (note_node(f, kb, node)) return -1;
    id = add_expr(kb, (cg_expr){.kind = CG_SYM, .dtype = n->dtype, .s = s});
  } else if (n->op == OP_COPY) {
    id = expr_of(f, kb, n->in[0], false);
    if (id >= 0 && note_node(f, kb, node)) return -1;
  } else {
    cg_expr e = {.kind = CG_OP, .op = n->op, .dtype = n->dtype, .n_in = n->n_in, .cast_to = n->attrs.dtype,
                 .num = {op_table[n->op].attrs & AF_VALUE ? n->attrs.value : 0,
                         op_table[n->op].attrs & AF_VALUE2 ? n->attrs.value2 : 0}};
    for (int i = 0; i < n->n_in; i++) {
      int c = expr_of(f, kb, n->in[i], false);
      if (c < 0) return c;
      e.in[i] = c;
    }
    if (!root && kb->k->n_acc > ACC_SOFT) {
      /* the kernel reads many buffers (a long chain, as an unrolled loop's
       * sum of per-step gradients): this node becomes a kernel's result of
       * its own, so that no kernel passes the 64 accesses the lowering takes */
      materialize(f, node);
      return -2;
    }
    if (!root && is_heavy(f->g, n) && broadcast_here(f, kb, n) && !uses_acc(kb->k, &e)) {
      /* a costly value that the kernel broadcasts would be computed once per
       * element it reaches (a batch norm's rsqrt(var + eps) per channel, over
       * every pixel): stored once, and loaded */
      materialize(f, node);
      return -2;
    }
    if (note_node(f, kb, node)) return -1;
    id = add_expr(kb, e);
  }
  if (id >= 0) {
    kb->memo[node] = id + 1;
    f->memo_set[f->n_memo_set++] = node;
  }
  return id;
}

/* "_kind": the number goes in front once the order is final (number_kernels);
 * formatting it in every round of a large graph took a tenth of fusion */
static void kind_name(cg_kernel *k, const char *kind) {
  size_t n = strlen(kind);
  if (n > sizeof k->name - 2) n = sizeof k->name - 2;
  k->name[0] = '_';
  memcpy(k->name + 1, kind, n);
  k->name[n + 1] = 0;
}

static cg_kernel *new_kernel(fuser *f, cg_kernel_kind kind, int node) {
  cg_program *p = f->p;
  if (p->n_k == f->cap_k) {
    int cap = f->cap_k ? f->cap_k * 2 : 16;
    cg_kernel *nk = alloc_realloc(p->k, sizeof *nk * (size_t)cap);
    if (!nk) return NULL;
    p->k = nk;
    f->cap_k = cap;
  }
  cg_kernel *k = &p->k[p->n_k];
  memset(k, 0, sizeof *k);
  k->kind = kind;
  k->id = p->n_k++;
  k->node = k->result_node = node;
  k->in_buf[0] = k->in_buf[1] = k->in_buf[2] = k->out_buf = k->scratch_buf = -1;
  k->alpha = 1.0;
  return k;
}

/* Finds the trailing-axes reductions under root's inlined tree: 0 none,
 * k > 0 their inner count when they all agree (others get materialized). */
static int find_row(fuser *f, int node, const ir_node *root, int *k, uint8_t *seen) {
  if (seen[node]) return 0;
  seen[node] = 1;
  f->seen_set[f->n_seen_set++] = node;
  const ir_node *n = &f->g->nodes[node];
  if (f->mat[node] && node != (int)(root - f->g->nodes)) return 0;
  if (!is_compute(n->op)) return 0;
  if (is_reduce(n->op)) {
    const ir_node *x = &f->g->nodes[n->in[0]];
    bool trailing = n->attrs.keepdim && x->ndim == root->ndim && same_dims(x->ndim, x->shape, root->shape);
    for (int i = 0; trailing && i < n->attrs.naxes; i++) trailing = n->attrs.axes[i] == x->ndim - n->attrs.naxes + i;
    if (!trailing || (*k && *k != n->attrs.naxes)) {
      materialize(f, node);
      return -2;
    }
    *k = n->attrs.naxes;
  }
  for (int i = 0; i < n->n_in; i++) {
    int r = find_row(f, n->in[i], root, k, seen);
    if (r) return r;
  }
  return 0;
}

static int build_loop_kernel(fuser *f, int node, int *memo, uint8_t *seen) {
  const ir_graph *g = f->g;
  const ir_node *n = &g->nodes[node];
  cg_kernel *k = new_kernel(f, CG_K_LOOP, node);
  if (!k) return -1;
  kbuild kb = {.k = k, .memo = memo, .ovr_node = {-1, -1}};
  while (f->n_memo_set) memo[f->memo_set[--f->n_memo_set]] = 0;
  int store_acc;
  if (n->op == OP_MATMUL) {
    /* (M,K) @ (K,N): loops [M, N | K], a sum of products per output element */
    const ir_node *a = &g->nodes[n->in[0]], *b = &g->nodes[n->in[1]];
    kb.ref_ndim = k->ndim = 3;
    kb.ref[0] = k->dim[0] = a->shape[0];
    kb.ref[1] = k->dim[1] = b->shape[1];
    kb.ref[2] = k->dim[2] = a->shape[1];
    for (int i = 0; i < 3; i++) kb.perm[i] = i;
    k->n_outer = 2;
    kb.n_kept = 2;
    kb.kept[0] = 0, kb.kept[1] = 1;
    int ia = matvec_operand(g, n->in[0]), ib = matvec_operand(g, n->in[1]);
    kb.ovr_node[0] = ia, kb.ovr_dims[0][0] = 0, kb.ovr_dims[0][1] = 2;
    kb.ovr_node[1] = ib, kb.ovr_dims[1][0] = 2, kb.ovr_dims[1][1] = 1;
    if (ia == ib) return -1; /* x @ x: the two maps differ; BLAS takes it */
    int la = add_acc(f, &kb, ia), lb = add_acc(f, &kb, ib);
    if (la < 0 || lb < 0) return -1;
    kb.ovr_node[0] = kb.ovr_node[1] = -1;
    int ea = add_expr(&kb, (cg_expr){.kind = CG_LOAD, .dtype = g->nodes[ia].dtype, .a = la});
    int eb = add_expr(&kb, (cg_expr){.kind = CG_LOAD, .dtype = g->nodes[ib].dtype, .a = lb});
    int em = add_expr(&kb, (cg_expr){.kind = CG_OP, .op = OP_MUL, .dtype = n->dtype, .n_in = 2, .in = {ea, eb}});
    if (ea < 0 || eb < 0 || em < 0 || note_node(f, &kb, node)) return -1;
    int st = add_stage(&kb, (cg_stage){CG_REDUCE, OP_SUM, em, -1, true});
    int acc = add_expr(&kb, (cg_expr){.kind = CG_ACC, .dtype = n->dtype, .a = st});
    store_acc = add_acc(f, &kb, node);
    if (st < 0 || acc < 0 || store_acc < 0 || add_stage(&kb, (cg_stage){CG_MAP, 0, acc, store_acc, false}) < 0) return -1;
    kind_name(k, "matvec");
  } else if (is_reduce(n->op)) {
    /* space: the input's dims, kept first (outer), reduced last (inner) */
    const ir_node *x = &g->nodes[n->in[0]];
    kb.ref_ndim = x->ndim;
    memcpy(kb.ref, x->shape, sizeof kb.ref);
    bool red[MAXD] = {0};
    for (int i = 0; i < n->attrs.naxes; i++) red[n->attrs.axes[i]] = true;
    int d = 0;
    for (int i = 0; i < x->ndim; i++)
      if (!red[i]) kb.perm[d++] = i;
    k->n_outer = d;
    for (int i = 0; i < x->ndim; i++)
      if (red[i]) kb.perm[d++] = i;
    k->ndim = x->ndim;
    for (int i = 0; i < x->ndim; i++) k->dim[i] = x->shape[kb.perm[i]];
    int acc = reduce_stage(f, &kb, node, -1);
    if (acc < 0) return acc;
    if (!n->attrs.keepdim) {
      /* only the result drops the reduced dims: the prologue's values broadcast right-aligned */
      kb.n_kept = k->n_outer;
      memcpy(kb.kept, kb.perm, sizeof kb.kept);
    }
    store_acc = add_acc(f, &kb, node);
    if (store_acc < 0 || add_stage(&kb, (cg_stage){CG_MAP, 0, acc, store_acc, false}) < 0) return -1;
    kind_name(k, "reduce");
  } else {
    int inner = 0;
    while (f->n_seen_set) seen[f->seen_set[--f->n_seen_set]] = 0;
    int r = find_row(f, node, n, &inner, seen);
    if (r) return r;
    kb.ref_ndim = n->ndim;
    memcpy(kb.ref, n->shape, sizeof kb.ref);
    for (int i = 0; i < n->ndim; i++) kb.perm[i] = i;
    k->ndim = n->ndim;
    memcpy(k->dim, n->shape, sizeof k->dim);
    kb.row = inner > 0;
    kb.row_inner = inner;
    k->n_outer = inner > 0 ? n->ndim - inner : n->ndim;
    int e = expr_of(f, &kb, node, true);
    if (e < 0) return e;
    store_acc = add_acc(f, &kb, node);
    if (store_acc < 0 || add_stage(&kb, (cg_stage){CG_MAP, 0, e, store_acc, inner > 0}) < 0) return -1;
    kind_name(k, inner ? "row" : "pointwise");
  }
  k->out_buf = f->map[node].buf;
  return 0;
}

/* A copy kernel that makes the strided map of node contiguous in a new buffer. */
static int build_copy_kernel(fuser *f, int node, int *memo) {
  const ir_node *n = &f->g->nodes[node];
  cg_kernel *k = new_kernel(f, CG_K_LOOP, node);
  if (!k) return -1;
  kbuild kb = {.k = k, .memo = memo, .ref_ndim = n->ndim};
  memcpy(kb.ref, n->shape, sizeof kb.ref);
  for (int i = 0; i < n->ndim; i++) kb.perm[i] = i;
  k->ndim = k->n_outer = n->ndim;
  memcpy(k->dim, n->shape, sizeof k->dim);
  int la = add_acc(f, &kb, node); /* reads through the view map */
  if (la < 0) return -1;
  int e = add_expr(&kb, (cg_expr){.kind = CG_LOAD, .dtype = n->dtype, .a = la});
  if (e < 0 || add_buf(f, CG_BUF_TEMP, node) < 0) return -1;
  int sa = add_acc(f, &kb, node); /* writes contiguous */
  if (sa < 0 || add_stage(&kb, (cg_stage){CG_MAP, 0, e, sa, false}) < 0) return -1;
  k->out_buf = f->map[node].buf;
  if (note_node(f, &kb, node)) return -1;
  kind_name(k, "copy");
  return 0;
}

/* The arrays a kernel owns (the kernel itself is a slot of p->k). */
static void kernel_free(cg_kernel *k) {
  alloc_free(k->acc), alloc_free(k->expr), alloc_free(k->stage), alloc_free(k->nodes), alloc_free(k->param), alloc_free(k->in_rest);
}

static void free_kernels(cg_program *p) {
  for (int i = 0; i < p->n_k; i++) kernel_free(&p->k[i]);
  p->n_k = 0;
}

void cg_program_free(cg_program *p) {
  if (!p) return;
  free_kernels(p);
  alloc_free(p->k);
  alloc_free(p->buf);
  alloc_free(p->node_buf);
  alloc_free(p->views);
  alloc_free(p);
}

/* How many full-size buffers (the shape of node root) a kernel reads to
 * recompute root: the leaves and stored nodes under its inlined inputs. A
 * chain of residual adds reads one more per layer. At most 64 nodes are
 * looked at: past that the count is large anyway. */
static int full_reads(const fuser *f, int root) {
  const ir_graph *g = f->g;
  const ir_node *r = &g->nodes[root];
  int stack[64], seen[64], ns = 0, nseen = 0, count = 0;
  for (int k = 0; k < r->n_in && ns < 64; k++) stack[ns++] = r->in[k];
  while (ns > 0 && nseen < 64) {
    int j = stack[--ns];
    bool dup = false;
    for (int q = 0; q < nseen && !dup; q++) dup = seen[q] == j;
    if (dup) continue;
    seen[nseen++] = j;
    const ir_node *n = &g->nodes[j];
    if (!f->mat[j] && ((is_compute(n->op) && !is_reduce(n->op)) || is_view(n->op))) {
      for (int k = 0; k < n->n_in && ns < 64; k++) stack[ns++] = n->in[k];
    } else if (n->ndim == r->ndim && same_dims(r->ndim, n->shape, r->shape)) {
      count++;
    }
  }
  return count;
}

/* Marks the nodes node's kernel inlines: its inputs, through compute nodes
 * and views that are not stored, down to stored nodes and leaves. */
static void mark_inlined_inputs(fuser *f, int node, uint8_t *under) {
  const ir_graph *g = f->g;
  int *stack = f->stack, ns = 0; /* each node goes on it once, when marked */
  int j = node;
  for (;;) {
    const ir_node *n = &g->nodes[j];
    for (int k = 0; k < n->n_in; k++) {
      int x = n->in[k];
      const ir_node *xn = &g->nodes[x];
      if (under[x] || f->mat[x] || !(is_compute(xn->op) || is_view(xn->op))) continue;
      under[x] = 1;
      f->seen_set[f->n_seen_set++] = x;
      stack[ns++] = x;
    }
    if (!ns) break;
    j = stack[--ns];
  }
}

/* One round: buffers and kernels for the current materialization. 0, -1 OOM, -2 again. */
static int build(fuser *f, int *memo, uint8_t *seen) {
  const ir_graph *g = f->g;
  cg_program *p = f->p;
  int from = f->restart_from;
  f->restart_from = g->n_nodes;
  if (from >= g->n_nodes) return 0;
  /* drop the kernels and buffers of nodes from `from` on, and their counts */
  int k0 = f->k_mark[from];
  for (int ki = k0; ki < p->n_k; ki++) {
    cg_kernel *k = &p->k[ki];
    f->stamp++;
    for (int j = 0; j < k->n_nodes; j++) {
      int x = k->nodes[j];
      if (f->undo_stamp[x] == f->stamp) continue;
      f->undo_stamp[x] = f->stamp;
      f->kcount[x]--;
      if (f->klast[x] >= k0) f->klast[x] = -1;
    }
    kernel_free(k);
  }
  p->n_k = k0;
  p->n_buf = f->b_mark[from];
  for (int i = from; i < g->n_nodes; i++) {
    p->node_buf[i] = -1;
    f->map[i].buf = -1;
  }
  for (int i = from; i < g->n_nodes; i++) {
    const ir_node *n = &g->nodes[i];
    int r = 0;
    f->k_mark[i] = p->n_k;
    f->b_mark[i] = p->n_buf;
    if (n->op == IR_INPUT || n->op == IR_PARAM) r = add_buf(f, CG_BUF_INPUT, i);
    else if (n->op == IR_GRAD) r = add_buf(f, CG_BUF_GRAD, i);
    else if (n->op == IR_CONST) r = add_buf(f, CG_BUF_CONST, i);
    else if (is_view(n->op)) {
      if (f->map[n->in[0]].buf < 0) { /* a view of an inlined node: materialize that */
        materialize(f, n->in[0]);
        return -2;
      }
      int v = view_map(f, n, &f->map[i]);
      if (v == 1) {
        /* cannot be strided: make the input contiguous first (a copy kernel for a view) */
        materialize(f, n->in[0]);
        return -2;
      }
      if (f->mat[i]) {
        /* a view someone needs contiguous (an eager op, a reshape of it) */
        r = build_copy_kernel(f, i, memo);
      }
    } else if (is_compute(n->op)) {
      if (f->mat[i]) {
        if (add_buf(f, f->is_out[i] ? CG_BUF_OUTPUT : CG_BUF_TEMP, i) < 0) return -1;
        r = build_loop_kernel(f, i, memo, seen);
      }
    } else if (small_matmul(g, n) && matvec_operand(g, n->in[0]) != matvec_operand(g, n->in[1]) && walks_rows(f, n)) {
      for (int j = 0; j < 2; j++)
        if (f->map[matvec_operand(g, n->in[j])].buf < 0) {
          materialize(f, matvec_operand(g, n->in[j]));
          return -2;
        }
      if (add_buf(f, f->is_out[i] ? CG_BUF_OUTPUT : CG_BUF_TEMP, i) < 0) return -1;
      r = build_loop_kernel(f, i, memo, seen);
    } else {
      /* matmul and eager ops: operands must be buffers or views of buffers */
      for (int j = 0; j < n->n_in; j++)
        if (f->map[n->in[j]].buf < 0) {
          materialize(f, n->in[j]);
          return -2;
        }
      if (add_buf(f, f->is_out[i] ? CG_BUF_OUTPUT : CG_BUF_TEMP, i) < 0) return -1;
      cg_kernel *k = new_kernel(f, n->op == OP_MATMUL ? CG_K_MATMUL : CG_K_EAGER, i);
      if (!k) return -1;
      for (int j = 0; j < n->n_in && j < 3; j++) k->in_buf[j] = f->map[n->in[j]].buf;
      if (n->n_in > 3) {
        k->in_rest = alloc_malloc(sizeof(int) * (size_t)(n->n_in - 3));
        if (!k->in_rest) return -1;
        k->n_in_rest = n->n_in - 3;
        for (int j = 3; j < n->n_in; j++) k->in_rest[j - 3] = f->map[n->in[j]].buf;
      }
      k->out_buf = p->node_buf[i];
      k->nodes = alloc_malloc(sizeof(int));
      if (!k->nodes) return -1;
      k->nodes[0] = i;
      k->n_nodes = 1;
      kind_name(k, n->op == OP_MATMUL ? "matmul" : ir_op_name(n->op));
    }
    if (r < 0) return r;
  }
  /* recompute is fine for cheap nodes; a reduce or a costly node in two
   * kernels is stored once. The last in graph order first: storing it often
   * leaves the costly nodes under it in one kernel only (a tanh stored for
   * the backward keeps the pow under it inlined). Its inlined inputs are
   * decided again next round, as their counts change; a node outside them
   * keeps its count, so it is decided in this round already. One node per
   * round took 105 rounds on a GPT training step, and this 60; it stored one
   * cheap chain fewer there (a node above one stored in the same round
   * reads less when its turn comes). */
  uint8_t *under = seen; /* in the inlined inputs of a node stored this round */
  while (f->n_seen_set) under[f->seen_set[--f->n_seen_set]] = 0;
  for (int i = g->n_nodes - 1; i >= 0; i--) {
    const ir_node *n = &g->nodes[i];
    if (f->mat[i] || f->kcount[i] < 2 || under[i]) continue;
    /* a cheap node too: when the k kernels recomputing it would read more
     * (k reads of its r inputs) than storing it costs (r reads, a write,
     * then k reads) */
    int users = f->kcount[i];
    if (is_reduce(n->op) || is_heavy(g, n) ||
        (is_compute(n->op) && (users - 1) * full_reads(f, i) >= users + 1)) {
      materialize(f, i);
      mark_inlined_inputs(f, i, under);
    }
  }
  /* every node a kernel reads, or an output or write names, must have a buffer or view map */
  for (int i = 0; i < g->n_outputs; i++)
    if (f->map[g->outputs[i]].buf < 0) materialize(f, g->outputs[i]);
  for (int i = 0; i < g->n_writes; i++)
    for (int rd[2], k = 0, nrd = ir_write_reads(&g->writes[i], rd); k < nrd; k++)
      if (f->map[rd[k]].buf < 0) materialize(f, rd[k]);
  return f->restart ? -2 : 0;
}

/* ---- GEMM epilogues folded into the GEMM's beta ---- */

static bool same_access(const cg_kernel *k, const cg_access *a, const cg_access *b) {
  if (!sym_same(a->offset, b->offset)) return false;
  for (int d = 0; d < k->ndim; d++)
    if (!sym_same(a->stride[d], b->stride[d])) return false;
  return true;
}

/* Does a MAP stage of k store through access a? */
static bool stores_to(const cg_kernel *k, int a) {
  for (int s = 0; s < k->n_stage; s++)
    if (k->stage[s].kind == CG_MAP && k->stage[s].store == a) return true;
  return false;
}

/* Does kernel ki read buffer b (its own store aside)? */
static bool kernel_reads(const cg_program *p, int ki, int b) {
  const cg_kernel *k = &p->k[ki];
  for (int j = 0; j < 3; j++)
    if (k->in_buf[j] == b) return true;
  for (int j = 0; j < k->n_in_rest; j++)
    if (k->in_rest[j] == b) return true;
  for (int a = 0; a < k->n_acc; a++)
    if (!stores_to(k, a) && k->acc[a].buf == b) return true;
  return false;
}

/* Is buffer b what an output or a write reads? */
static bool handed_out(const cg_program *p, const cg_view *views, int b) {
  const ir_graph *g = p->g;
  for (int i = 0; i < g->n_outputs; i++)
    if (views[g->outputs[i]].buf == b) return true;
  for (int i = 0; i < g->n_writes; i++)
    for (int rd[2], k = 0, nrd = ir_write_reads(&g->writes[i], rd); k < nrd; k++)
      if (views[rd[k]].buf == b) return true;
  return false;
}

static bool expr_loads(const cg_kernel *k, int e, int a) {
  const cg_expr *x = &k->expr[e];
  if (x->kind == CG_LOAD) return x->a == a;
  for (int i = 0; x->kind == CG_OP && i < x->n_in; i++)
    if (expr_loads(k, x->in[i], a)) return true;
  return false;
}

/* Removes access a, which no stage stores to or reaches through a load, so
 * that liveness and lowering never see a buffer the kernel no longer uses.
 * Unreachable loads of it become constants. */
static void drop_access(cg_kernel *k, int a) {
  for (int s = 0; s < k->n_stage; s++)
    if ((k->stage[s].kind == CG_MAP && k->stage[s].store == a) || expr_loads(k, k->stage[s].expr, a)) return;
  for (int e = 0; e < k->n_expr; e++) {
    cg_expr *x = &k->expr[e];
    if (x->kind != CG_LOAD) continue;
    if (x->a == a) *x = (cg_expr){.kind = CG_CONST, .dtype = x->dtype, .c = 0};
    else if (x->a > a) x->a--;
  }
  for (int s = 0; s < k->n_stage; s++)
    if (k->stage[s].kind == CG_MAP && k->stage[s].store > a) k->stage[s].store--;
  memmove(&k->acc[a], &k->acc[a + 1], sizeof *k->acc * (size_t)(k->n_acc - a - 1));
  k->n_acc--;
}

/* The pointwise kernel right after a 2-D GEMM whose product only it reads:
 *   bias   out = mm + b (b broadcast):  out is filled with b first, then the
 *          GEMM adds into it (beta 1), so the product is never stored apart;
 *   update P - c * mm written back to P (SGD): the GEMM adds -c * a @ b
 *          straight into P's buffer, and the update kernel goes away.
 * Either way one pass over the product less, and no buffer for it. */
static void fold_epilogues(cg_program *p, cg_view *views) {
  const ir_graph *g = p->g;
  for (int ki = 1; ki < p->n_k; ki++) {
    cg_kernel *k = &p->k[ki];
    if (k->kind != CG_K_LOOP || k->n_stage != 1 || k->stage[0].kind != CG_MAP || k->stage[0].inner || k->n_outer != k->ndim)
      continue;
    /* the GEMM: the kernel before k that stores a buffer k loads */
    int mi = -1;
    for (int kj = 0; kj < ki && mi < 0; kj++)
      for (int a = 0; a < k->n_acc && mi < 0; a++)
        if (p->k[kj].kind == CG_K_MATMUL && p->k[kj].out_buf == k->acc[a].buf && p->k[kj].beta == 0) mi = kj;
    if (mi < 0) continue;
    cg_kernel *m = &p->k[mi];
    const ir_node *mn = &g->nodes[m->node], *kn = &g->nodes[k->node];
    int mm = m->out_buf, o = k->out_buf;
    if (mn->ndim != 2 || g->nodes[mn->in[0]].ndim != 2 || g->nodes[mn->in[1]].ndim != 2 || !dtype_is_float(mn->dtype) || dtype_is_narrow(mn->dtype) ||
        kn->dtype != mn->dtype || kn->ndim != 2 || !same_dims(2, kn->shape, mn->shape))
      continue;
    if (mm < 0 || p->buf[mm].kind != CG_BUF_TEMP || handed_out(p, views, mm)) continue;
    bool alone = true; /* only k reads the product */
    for (int kj = 0; kj < p->n_k && alone; kj++) alone = kj == ki || !kernel_reads(p, kj, mm);
    if (!alone) continue;
    const cg_access *st = &k->acc[k->stage[0].store];
    const cg_expr *e = &k->expr[k->stage[0].expr];
    if (e->kind != CG_OP || e->n_in != 2) continue;
    const cg_expr *l = &k->expr[e->in[0]], *r = &k->expr[e->in[1]];
    /* a load of the product, element for element with the store */
#define IS_MM(x) ((x)->kind == CG_LOAD && k->acc[(x)->a].buf == mm && same_access(k, &k->acc[(x)->a], st))
    if (e->op == OP_ADD && (IS_MM(l) || IS_MM(r))) {
      const cg_expr *bias = IS_MM(l) ? r : l;
      if (bias->kind != CG_LOAD || bias->dtype != kn->dtype) continue;
      int bb = k->acc[bias->a].buf;
      if (bb == mm || bb == o || p->buf[o].kind == CG_BUF_INPUT) continue;
      for (int j = 0; j < 3; j++)
        if (m->in_buf[j] == o) bb = -1;
      /* the bias must exist before the GEMM runs */
      for (int kj = mi; kj < ki && bb >= 0; kj++)
        if (p->k[kj].out_buf == bb) bb = -1;
      if (bb < 0) continue;
      /* k becomes the prefill and runs just before the GEMM, which adds into its buffer */
      int product = IS_MM(l) ? l->a : r->a;
      k->stage[0].expr = (int)(bias - k->expr);
      drop_access(k, product); /* so that liveness never sees the product's buffer */
      k->result_node = -1;
      m->out_buf = o;
      m->beta = 1.0;
      m->result_node = k->node;
      cg_kernel t = *k;
      memmove(m + 1, m, sizeof *m * (size_t)(ki - mi));
      p->k[mi] = t;
    } else if (e->op == OP_SUB && r->kind == CG_OP && r->op == OP_MUL && r->n_in == 2 && l->kind == CG_LOAD &&
               same_access(k, &k->acc[l->a], st)) {
      const cg_expr *c = &k->expr[r->in[0]], *x = &k->expr[r->in[1]];
      if (c->kind != CG_CONST) {
        const cg_expr *t = c;
        c = x, x = t;
      }
      if (c->kind != CG_CONST || !IS_MM(x)) continue;
      /* P - c * mm, stored to a temp that is written back to P and read by nothing else */
      int pb = k->acc[l->a].buf, w = -1;
      if (p->buf[pb].kind != CG_BUF_INPUT || p->buf[o].kind != CG_BUF_TEMP || p->buf[pb].dtype != kn->dtype ||
          p->buf[pb].ndim != 2 || !same_dims(2, p->buf[pb].shape, kn->shape))
        continue;
      for (int i = 0; i < g->n_writes; i++)
        if (g->writes[i].kind == IR_WRITE_DATA && g->writes[i].value == k->node && p->node_buf[g->writes[i].target] == pb) w = i;
      if (w < 0 || views[k->node].buf != o) continue;
      bool ok = true;
      for (int i = 0; i < g->n_outputs && ok; i++) ok = views[g->outputs[i]].buf != o && views[g->outputs[i]].buf != pb;
      for (int i = 0; i < g->n_writes && ok; i++)
        ok = i == w || ((g->writes[i].value < 0 || (views[g->writes[i].value].buf != o && views[g->writes[i].value].buf != pb)) &&
                        (!g->writes[i].has_cond || (views[g->writes[i].cond].buf != o && views[g->writes[i].cond].buf != pb)));
      for (int j = 0; j < 3 && ok; j++) ok = m->in_buf[j] != pb;
      /* nothing after the GEMM but the update reads P, and nothing after the update its new value */
      for (int kj = mi + 1; kj < p->n_k && ok; kj++) ok = kj == ki || (!kernel_reads(p, kj, pb) && !kernel_reads(p, kj, o));
      if (!ok) continue;
      m->out_buf = o;
      m->alpha = -c->c;
      m->beta = 1.0;
      m->result_node = k->node;
      p->buf[o].alias_of = pb; /* o is P's memory: the GEMM updates P in place */
      /* drop k */
      kernel_free(k);
      memmove(k, k + 1, sizeof *k * (size_t)(p->n_k - ki - 1));
      p->n_k--;
      ki--; /* the next kernel is at ki now */
    }
#undef IS_MM
  }
}

/* A buffer of working memory for each eager kernel that takes some (a
 * conv's im2col columns): a temp like any other, live only while its kernel
 * runs, so the arena plan reuses it; its size comes from the op at each call.
 * 0, or -1 when out of memory. */
static int add_scratch_bufs(fuser *f) {
  cg_program *p = f->p;
  for (int ki = 0; ki < p->n_k; ki++) {
    cg_kernel *k = &p->k[ki];
    int op = k->kind == CG_K_EAGER ? f->g->nodes[k->node].op : -1;
    if (op != OP_CONV2D && op != OP_CONV2D_GRAD_INPUT && op != OP_CONV2D_GRAD_WEIGHT) continue;
    if (p->n_buf == f->cap_buf) {
      int cap = f->cap_buf ? f->cap_buf * 2 : 32;
      cg_buf *nb = alloc_realloc(p->buf, sizeof *nb * (size_t)cap);
      if (!nb) return -1;
      p->buf = nb;
      f->cap_buf = cap;
    }
    cg_buf *b = &p->buf[p->n_buf];
    *b = (cg_buf){.kind = CG_BUF_TEMP, .node = k->node, .dtype = f->g->nodes[k->node].dtype, .ndim = 0, .first = ki,
                  .last = ki, .alias_of = -1, .scratch_of = ki};
    k->scratch_buf = p->n_buf++;
  }
  return 0;
}

/* Kernels are named by their place in the order, once it is final. */
static void number_kernels(cg_program *p) {
  for (int ki = 0; ki < p->n_k; ki++) {
    cg_kernel *k = &p->k[ki];
    const char *rest = strchr(k->name, '_');
    char name[80];
    snprintf(name, sizeof name, "k%d%s", ki, rest ? rest : "");
    k->id = ki;
    snprintf(k->name, sizeof k->name, "%.31s", name);
  }
}

/* ---- pointwise consumers behind a reduction ---- */

/* Does b get written by a kernel in (from, to)? A buffer updated in place
 * through an alias counts for the buffer it aliases. */
static bool written_between(const cg_program *p, int from, int to, int b) {
  for (int kj = from + 1; kj < to; kj++) {
    int o = p->k[kj].out_buf;
    if (o >= 0 && (o == b || p->buf[o].alias_of == b)) return true;
  }
  return false;
}

/* Appends B's expression e (and what it uses) to A, a load of the reduced
 * buffer rb becoming A's value `red`; returns the new id, -1 OOM, -2 when B
 * reads rb at another element. map[] memoizes B's expression ids. */
static int move_expr(cg_kernel *a, const cg_kernel *b, int e, int rb, int red, int *map, int *acc_map) {
  if (map[e] >= 0) return map[e];
  cg_expr x = b->expr[e];
  if (x.kind == CG_LOAD) {
    const cg_access *ba = &b->acc[x.a];
    if (ba->buf == rb) {
      /* only element for element with A's store: the same offset, and the
       * same strides over the outer dims, which are B's dims */
      const cg_access *st = &a->acc[a->stage[a->n_stage - 1].store];
      if (!sym_same(ba->offset, st->offset)) return -2;
      for (int d = 0; d < b->ndim; d++)
        if (!sym_same(ba->stride[d], st->stride[d])) return -2;
      return map[e] = red;
    }
    if (acc_map[x.a] < 0) {
      cg_access na = {.buf = ba->buf, .offset = ba->offset};
      for (int d = 0; d < a->ndim; d++) na.stride[d] = d < b->ndim ? ba->stride[d] : sym_const(0);
      a->acc[a->n_acc] = na;
      acc_map[x.a] = a->n_acc++;
    }
    x.a = acc_map[x.a];
  } else if (x.kind == CG_OP) {
    for (int i = 0; i < x.n_in; i++) {
      int c = move_expr(a, b, x.in[i], rb, red, map, acc_map);
      if (c < 0) return c;
      x.in[i] = c;
    }
  } else if (x.kind == CG_ACC) {
    return -2;
  }
  a->expr[a->n_expr] = x;
  return map[e] = a->n_expr++;
}

/* A reduction (or matvec) kernel A whose result only a pointwise kernel B
 * reads, B looping over A's outer dims: B's expression becomes A's final
 * MAP, run once per outer element right after the reduction (bias and relu
 * behind a batch-1 matmul, the scale behind a mean). The reduced values are
 * never stored, and B's loop goes away. 0, or -1 out of memory. */
static int merge_reduce_epilogues(cg_program *p, cg_view *views) {
  for (int ai = 0; ai < p->n_k; ai++) {
    cg_kernel *a = &p->k[ai];
    if (a->kind != CG_K_LOOP || a->n_stage < 2 || a->stage[a->n_stage - 1].kind != CG_MAP ||
        a->stage[a->n_stage - 1].inner || a->stage[0].kind != CG_REDUCE)
      continue;
    int rb = a->out_buf;
    if (rb < 0 || p->buf[rb].kind != CG_BUF_TEMP || handed_out(p, views, rb)) continue;
    int bi = -1, readers = 0;
    for (int kj = ai + 1; kj < p->n_k; kj++)
      if (kernel_reads(p, kj, rb)) readers++, bi = bi < 0 ? kj : bi;
    if (readers != 1) continue;
    cg_kernel *b = &p->k[bi];
    if (b->kind != CG_K_LOOP || b->n_stage != 1 || b->stage[0].kind != CG_MAP || b->stage[0].inner ||
        b->n_outer != b->ndim || b->ndim != a->n_outer || b->result_node != b->node || a->n_acc + b->n_acc > 48)
      continue;
    bool ok = true;
    for (int d = 0; d < b->ndim && ok; d++) ok = sym_same(b->dim[d], a->dim[d]);
    /* what B reads must be there when A runs, and B's result written by nothing in between */
    for (int c = 0; c < b->n_acc && ok; c++) ok = !written_between(p, ai, bi, b->acc[c].buf);
    ok = ok && !written_between(p, ai, bi, b->out_buf);
    for (int kj = ai + 1; kj < bi && ok; kj++) ok = !kernel_reads(p, kj, b->out_buf);
    if (!ok) continue;
    int *map = alloc_malloc(sizeof(int) * (size_t)(b->n_expr + b->n_acc));
    cg_access *nacc = alloc_realloc(a->acc, sizeof *nacc * (size_t)(a->n_acc + b->n_acc));
    if (nacc) a->acc = nacc;
    cg_expr *nexp = alloc_realloc(a->expr, sizeof *nexp * (size_t)(a->n_expr + b->n_expr));
    if (nexp) a->expr = nexp;
    int *nnodes = alloc_realloc(a->nodes, sizeof *nnodes * (size_t)(a->n_nodes + b->n_nodes));
    if (nnodes) a->nodes = nnodes;
    if (!map || !nacc || !nexp || !nnodes) {
      alloc_free(map);
      return -1;
    }
    for (int i = 0; i < b->n_expr + b->n_acc; i++) map[i] = -1;
    int n_acc0 = a->n_acc, n_expr0 = a->n_expr;
    cg_stage *last = &a->stage[a->n_stage - 1];
    int e = move_expr(a, b, b->stage[0].expr, rb, last->expr, map, map + b->n_expr);
    /* B's store, in A's space */
    int store = -1;
    if (e >= 0) {
      const cg_access *bs = &b->acc[b->stage[0].store];
      cg_access na = {.buf = bs->buf, .offset = bs->offset};
      for (int d = 0; d < a->ndim; d++) na.stride[d] = d < b->ndim ? bs->stride[d] : sym_const(0);
      a->acc[a->n_acc] = na;
      store = a->n_acc++;
    }
    alloc_free(map);
    if (e < 0) { /* -2: not element for element; undo */
      a->n_acc = n_acc0, a->n_expr = n_expr0;
      continue;
    }
    /* A's own store of the reduced values goes, and rb gets no memory */
    int old_store = last->store;
    last->expr = e;
    last->store = store;
    drop_access(a, old_store);
    memcpy(a->nodes + a->n_nodes, b->nodes, sizeof(int) * (size_t)b->n_nodes);
    a->n_nodes += b->n_nodes;
    a->out_buf = b->out_buf;
    a->result_node = b->result_node;
    alloc_free(b->acc), alloc_free(b->expr), alloc_free(b->stage), alloc_free(b->nodes), alloc_free(b->param);
    memmove(b, b + 1, sizeof *b * (size_t)(p->n_k - bi - 1));
    p->n_k--;
  }
  return 0;
}

/* ---- row kernels one after another ---- */

/* A kernel with a loop over the inner dims per outer element (a REDUCE or
 * a MAP over them), not run by the column schedule. */
static bool row_kernel(const cg_kernel *k) {
  if (k->kind != CG_K_LOOP || k->n_outer < 1 || k->n_outer >= k->ndim || lower_is_column(k)) return false;
  for (int s = 0; s < k->n_stage; s++)
    if (k->stage[s].kind == CG_REDUCE || k->stage[s].inner) return true;
  return false;
}

/* How kernel b goes behind row kernel a, on a's loops: its stages as they
 * are (b has a's loops too), its one MAP over a's inner dims (b is
 * pointwise over a's whole space), or its one MAP once per outer element (b
 * is pointwise over a's outer dims, alone or then dims of 1: rsqrt(var +
 * eps) after a variance). -1: b has other loops. */
enum { BEHIND_STAGES, BEHIND_INNER, BEHIND_ROW };
static int behind_form(const cg_kernel *a, const cg_kernel *b) {
  if (b->kind != CG_K_LOOP || (b->ndim != a->ndim && b->ndim != a->n_outer)) return -1;
  for (int d = 0; d < a->n_outer; d++)
    if (!sym_same(a->dim[d], b->dim[d])) return -1;
  bool pointwise = b->n_stage == 1 && b->stage[0].kind == CG_MAP && b->n_outer == b->ndim;
  if (b->ndim == a->n_outer) return pointwise ? BEHIND_ROW : -1; /* over the outer dims alone: a reduction's result without keepdim */
  bool inner_same = true, inner_one = true;
  for (int d = a->n_outer; d < a->ndim; d++) {
    inner_same = inner_same && sym_same(a->dim[d], b->dim[d]);
    inner_one = inner_one && sym_is_const(b->dim[d]) && b->dim[d].c == 1;
  }
  if (inner_same && b->n_outer == a->n_outer && row_kernel(b)) return BEHIND_STAGES;
  if (inner_same && pointwise) return BEHIND_INNER;
  if (inner_one && pointwise) return BEHIND_ROW;
  return -1;
}

/* b's access c as it reads on a's loops: a BEHIND_ROW kernel's dims of 1 walk nothing. */
static cg_access access_behind(const cg_kernel *a, const cg_kernel *b, int c, int form) {
  cg_access x = b->acc[c];
  if (form == BEHIND_ROW)
    for (int d = a->n_outer; d < a->ndim; d++) x.stride[d] = sym_const(0);
  return x;
}

/* Kernel b (after a) reads what a's stages store only where a stored it
 * for the same outer element, before b's stages run for it: per element
 * of a MAP over the inner dims, or the element a once-per-row MAP stored
 * (b's inner strides 0). b stores nothing a stores. */
static bool reads_own_rows(const cg_kernel *a, const cg_kernel *b, int form, bool *reads_a) {
  *reads_a = false;
  for (int c = 0; c < b->n_acc; c++) {
    cg_access x = access_behind(a, b, c, form);
    bool b_stores = stores_to(b, c);
    for (int s = 0; s < a->n_stage; s++) {
      const cg_stage *st = &a->stage[s];
      if (st->kind != CG_MAP || a->acc[st->store].buf != x.buf) continue;
      if (b_stores) return false;
      const cg_access *sa = &a->acc[st->store];
      if (!sym_same(sa->offset, x.offset)) return false;
      for (int d = 0; d < a->ndim; d++) {
        bool walked = d < a->n_outer || st->inner; /* else b must read the row's one element */
        if (walked ? !sym_same(sa->stride[d], x.stride[d]) : !(sym_is_const(x.stride[d]) && x.stride[d].c == 0))
          return false;
      }
      *reads_a = true;
    }
  }
  return true;
}

/* *out = a with kernel b's accesses, expressions, stages and nodes after
 * its own, in arrays of its own (a's stay). 0, or -1 out of memory. */
static int append_kernel(cg_kernel *out, const cg_kernel *a, const cg_kernel *b, int form) {
  cg_access *acc = alloc_malloc(sizeof *acc * (size_t)(a->n_acc + b->n_acc));
  cg_expr *expr = alloc_malloc(sizeof *expr * (size_t)(a->n_expr + b->n_expr));
  cg_stage *stage = alloc_malloc(sizeof *stage * (size_t)(a->n_stage + b->n_stage));
  int *nodes = alloc_malloc(sizeof *nodes * (size_t)(a->n_nodes + b->n_nodes + 1));
  if (!acc || !expr || !stage || !nodes) {
    alloc_free(acc), alloc_free(expr), alloc_free(stage), alloc_free(nodes);
    return -1;
  }
  memcpy(acc, a->acc, sizeof *acc * (size_t)a->n_acc);
  for (int c = 0; c < b->n_acc; c++) acc[a->n_acc + c] = access_behind(a, b, c, form);
  memcpy(expr, a->expr, sizeof *expr * (size_t)a->n_expr);
  for (int e = 0; e < b->n_expr; e++) {
    cg_expr x = b->expr[e];
    if (x.kind == CG_LOAD) x.a += a->n_acc;
    else if (x.kind == CG_ACC) x.a += a->n_stage;
    else if (x.kind == CG_OP)
      for (int i = 0; i < x.n_in; i++) x.in[i] += a->n_expr;
    expr[a->n_expr + e] = x;
  }
  memcpy(stage, a->stage, sizeof *stage * (size_t)a->n_stage);
  for (int t = 0; t < b->n_stage; t++) {
    cg_stage x = b->stage[t];
    x.expr += a->n_expr;
    if (x.kind == CG_MAP) x.store += a->n_acc;
    if (form == BEHIND_INNER) x.inner = true;
    if (form == BEHIND_ROW) x.inner = false;
    stage[a->n_stage + t] = x;
  }
  memcpy(nodes, a->nodes, sizeof *nodes * (size_t)a->n_nodes);
  memcpy(nodes + a->n_nodes, b->nodes, sizeof *nodes * (size_t)b->n_nodes);
  *out = *a;
  out->acc = acc, out->expr = expr, out->stage = stage, out->nodes = nodes, out->param = NULL;
  out->n_acc += b->n_acc, out->n_expr += b->n_expr, out->n_stage += b->n_stage, out->n_nodes += b->n_nodes;
  out->out_buf = b->out_buf;
  out->node = b->node;
  out->result_node = b->result_node;
  return 0;
}

enum { ROW_MAX_STAGES = 8, ROW_MAX_ACCESSES = 48 };

/* A kernel that reads what a row kernel before it stored, row by row,
 * runs as the row kernel's next stages: a layer norm's mean, variance,
 * rsqrt and normalize become one kernel, the row in cache from the first
 * stage to the last, and a softmax that keeps its exp for the backward
 * sums and divides in the same pass. What it stores is still stored (a
 * later kernel may read it). It moves up to the row kernel's place, so
 * what it reads must not be written in between, nor what it stores be
 * read or written there. 0, or -1 out of memory. */
static int merge_rows(cg_program *p) {
  for (int ai = 0; ai < p->n_k; ai++) {
    if (!row_kernel(&p->k[ai])) continue;
    for (int bi = ai + 1; bi < p->n_k; bi++) {
      cg_kernel *a = &p->k[ai], *b = &p->k[bi];
      int form = behind_form(a, b);
      bool reads_a;
      if (form < 0 || a->n_stage + b->n_stage > ROW_MAX_STAGES || a->n_acc + b->n_acc > ROW_MAX_ACCESSES ||
          !reads_own_rows(a, b, form, &reads_a) || !reads_a)
        continue;
      bool ok = !a->param;
      for (int c = 0; c < b->n_acc && ok; c++) {
        int buf = b->acc[c].buf;
        bool b_stores = stores_to(b, c);
        ok = !written_between(p, ai, bi, buf);
        /* what b stores: its own buffer, which nothing before it reads */
        if (b_stores) ok = ok && p->buf[buf].alias_of < 0 && !kernel_reads(p, ai, buf);
        for (int kj = ai + 1; kj < bi && ok && b_stores; kj++) ok = !kernel_reads(p, kj, buf);
      }
      if (!ok) continue;
      cg_kernel merged;
      if (append_kernel(&merged, a, b, form)) return -1;
      /* the column schedule keeps no stage order between its blocks' rows */
      if (lower_is_column(&merged)) {
        kernel_free(&merged);
        continue;
      }
      kernel_free(a);
      *a = merged;
      kind_name(a, "row");
      kernel_free(b);
      memmove(b, b + 1, sizeof *b * (size_t)(p->n_k - bi - 1));
      p->n_k--;
      bi--;
    }
  }
  return 0;
}

/* Adjacent outer dims that every access walks as one (stride[d] is
 * stride[d+1] * dim[d+1]) become one dim, and outer dims of size 1 go: a
 * [8,64,128] pointwise kernel on contiguous tensors is a loop of 65536. The
 * code then splits fewer indices by div/mod, and kernels that differ only in
 * how a contiguous range was shaped (one optimizer update on weights of
 * several shapes) lower to the same code. Inner dims stay as they are: a
 * reduction's order, and so its bits, follows them. */
static void coalesce_dims(cg_program *p) {
  sym_ctx *s = p->g->sym;
  for (int ki = 0; ki < p->n_k; ki++) {
    cg_kernel *k = &p->k[ki];
    if (k->kind != CG_K_LOOP) continue;
    for (int d = k->n_outer - 1; d >= 0; d--) {
      bool one = sym_is_const(k->dim[d]) && k->dim[d].c == 1 && k->n_outer > 1;
      bool merge = !one && d + 1 < k->n_outer;
      for (int a = 0; a < k->n_acc && merge; a++) {
        sym_dim want = sym_mul(s, k->acc[a].stride[d + 1], k->dim[d + 1]);
        merge = !sym_is_err(want) && sym_same(want, k->acc[a].stride[d]);
      }
      if (!one && !merge) continue;
      if (merge) {
        sym_dim n = sym_mul(s, k->dim[d], k->dim[d + 1]);
        if (sym_is_err(n)) continue;
        k->dim[d + 1] = n; /* d+1 keeps its strides and stands for both */
      }
      memmove(&k->dim[d], &k->dim[d + 1], sizeof *k->dim * (size_t)(k->ndim - d - 1));
      for (int a = 0; a < k->n_acc; a++)
        memmove(&k->acc[a].stride[d], &k->acc[a].stride[d + 1], sizeof *k->acc[a].stride * (size_t)(k->ndim - d - 1));
      k->ndim--, k->n_outer--;
    }
  }
}

/* Buffer o's users, from kernel ki on, read and write buffer b instead: o
 * becomes b's memory. */
static void alias_buffer(cg_program *p, cg_view *views, int n_nodes, int ki, int o, int b) {
  p->buf[o].alias_of = b;
  p->buf[o].first = p->buf[o].last = -1;
  for (int kj = ki; kj < p->n_k; kj++) {
    cg_kernel *q = &p->k[kj];
    for (int c = 0; c < q->n_acc; c++)
      if (q->acc[c].buf == o) q->acc[c].buf = b;
    for (int j = 0; j < 3; j++)
      if (q->in_buf[j] == o) q->in_buf[j] = b;
    for (int j = 0; j < q->n_in_rest; j++)
      if (q->in_rest[j] == o) q->in_rest[j] = b;
    if (q->out_buf == o) q->out_buf = b;
  }
  for (int n = 0; n < n_nodes; n++) {
    if (views[n].buf == o) views[n].buf = b;
    if (p->node_buf[n] == o) p->node_buf[n] = b;
  }
}

/* Whether a write-back into the argument of buffer b takes its value from
 * node through slice_scatters only (node, or a scatter into node ...). */
static bool written_back_from(const cg_program *p, int b, int node) {
  const ir_graph *g = p->g;
  for (int i = 0; i < g->n_writes; i++) {
    const ir_write *w = &g->writes[i];
    if (w->kind != IR_WRITE_DATA || w->value < 0 || p->node_buf[w->target] != b) continue;
    for (int v = w->value;; v = g->nodes[v].in[0]) {
      if (v == node) return true;
      if (g->nodes[v].op != OP_SLICE_SCATTER) break;
    }
  }
  return false;
}

/* A write into a view in place: slice_scatter(P, x), or index_copy(P, dim,
 * idx, x) (index_add and index_add_to likewise), stores into P's buffer
 * when nothing after it reads P's old value (no later kernel, output or
 * write) and, for a param or input, the call
 * writes the scatter's value (or a scatter into it) back to P anyway. The
 * eager kernel then writes the rows alone (k_slice_scatter and the row
 * kernels skip copying P onto itself) and the write-back finds
 * nothing to copy: a KV cache update streams one row, not the cache twice.
 * An index_copy whose rows come from P itself keeps its own buffer. */
static void scatter_in_place(cg_program *p, cg_view *views, int n_nodes) {
  const ir_graph *g = p->g;
  for (int ki = 0; ki < p->n_k; ki++) {
    cg_kernel *k = &p->k[ki];
    int op = k->kind == CG_K_EAGER ? g->nodes[k->node].op : -1;
    bool rows = op == OP_INDEX_COPY || op == OP_INDEX_ADD || op == OP_INDEX_ADD_TO;
    if (op != OP_SLICE_SCATTER && !(rows && k->in_buf[1] != k->in_buf[0] && k->in_buf[2] != k->in_buf[0])) continue;
    int base = g->nodes[k->node].in[0], o = k->out_buf, b = k->in_buf[0];
    if (o < 0 || b < 0 || p->buf[o].kind != CG_BUF_TEMP || p->buf[o].alias_of >= 0 || p->node_buf[base] != b) continue;
    /* the base is its buffer, whole and in order (not a view of it) */
    if (!sym_same(views[base].off, sym_const(0)) || p->buf[b].dtype != p->buf[o].dtype) continue;
    bool ok = p->buf[b].kind == CG_BUF_INPUT ? written_back_from(p, b, k->node)
                                             : p->buf[b].kind == CG_BUF_TEMP && p->buf[b].alias_of < 0;
    ok = ok && !handed_out(p, views, b);
    for (int kj = ki + 1; kj < p->n_k && ok; kj++) ok = !kernel_reads(p, kj, b) && p->k[kj].out_buf != b;
    if (!ok) continue;
    if (p->buf[o].last > p->buf[b].last) p->buf[b].last = p->buf[o].last;
    alias_buffer(p, views, n_nodes, ki, o, b);
  }
}

/* Whether kernel ki stores to buffer b (its result, or a stage's store). */
static bool kernel_writes(const cg_program *p, int ki, int b) {
  const cg_kernel *k = &p->k[ki];
  if (k->out_buf == b) return true;
  for (int a = 0; a < k->n_acc; a++)
    if (k->acc[a].buf == b && stores_to(k, a)) return true;
  return false;
}

/* The argument write i could store its value in (before the order is
 * checked): one whole contiguous temp of the argument's dtype and shape,
 * read by no output or other write, for a param or input that no output
 * hands out and no other write targets. Else -1. */
static int in_place_target(const cg_program *p, const cg_view *views, int i) {
  const ir_graph *g = p->g;
  const ir_write *w = &g->writes[i];
  if (w->kind != IR_WRITE_DATA || w->value < 0) return -1;
  int o = p->node_buf[w->value], b = p->node_buf[w->target];
  if (o < 0 || b < 0 || views[w->value].buf != o || !sym_same(views[w->value].off, sym_const(0))) return -1;
  const cg_buf *ob = &p->buf[o], *bb = &p->buf[b];
  if (ob->kind != CG_BUF_TEMP || ob->alias_of >= 0 || ob->scratch_of >= 0 || bb->kind != CG_BUF_INPUT ||
      ob->dtype != bb->dtype || ob->ndim != bb->ndim || !same_dims(ob->ndim, ob->shape, bb->shape))
    return -1;
  bool ok = !handed_out(p, views, b);
  for (int j = 0; j < g->n_outputs && ok; j++) ok = views[g->outputs[j]].buf != o;
  for (int j = 0; j < g->n_writes && ok; j++)
    ok = j == i || ((g->writes[j].value < 0 || views[g->writes[j].value].buf != o) &&
                    (!g->writes[j].has_cond || views[g->writes[j].cond].buf != o) && p->node_buf[g->writes[j].target] != b);
  return ok ? b : -1;
}

/* Whether node n's run can fail on the call's data (an index out of
 * range): an op with a check of its inputs (an allreduce's checks the
 * process group, as eagerly before the call), or a construct whose regions
 * hold one. */
static bool node_checks(const ir_node *n);
static bool graph_checks(const ir_graph *g) {
  for (int i = 0; i < g->n_nodes; i++)
    if (node_checks(&g->nodes[i])) return true;
  return false;
}
static bool node_checks(const ir_node *n) {
  if (n->op < OP_COUNT) return op_table[n->op].check && n->op != OP_ALLREDUCE;
  return (n->sub[0] && graph_checks(n->sub[0])) || (n->sub[1] && graph_checks(n->sub[1]));
}

static bool kernel_may_fail(const cg_program *p, int ki) {
  return p->k[ki].kind == CG_K_EAGER && node_checks(&p->g->nodes[p->k[ki].node]);
}

/* Write-backs in place: the new value of a param or input (an optimizer's
 * update of a weight or a moment) is stored straight into the argument's
 * memory instead of a temp that lives until the call's end and is then
 * copied over it. Sound when one kernel makes the value, whole and
 * contiguous, of the argument's dtype and shape, nothing after that kernel
 * reads or writes the argument (no later kernel, output or other write sees
 * its old value), and that kernel reads the argument, if at all, only at
 * the element it stores (a pointwise loop: the same offset and strides),
 * and no kernel after it can fail on the call's data: a call that fails
 * there writes no argument (the body's write may come after the op that
 * failed). Without it a training step's arena holds a copy of every weight
 * and moment. The argument's buffer is marked `updated`, so that check
 * mode, which runs the kernels before the real call, updates a copy. */
static void write_in_place(cg_program *p, cg_view *views, int n_nodes) {
  const ir_graph *g = p->g;
  for (int i = 0; i < g->n_writes; i++) {
    int b = in_place_target(p, views, i), o = b >= 0 ? p->node_buf[g->writes[i].value] : -1;
    if (b < 0 || p->buf[o].first < 0) continue;
    bool ok = true;
    int ki = p->buf[o].first;
    const cg_kernel *k = &p->k[ki];
    /* one kernel makes it; nothing after that kernel touches the argument */
    for (int kj = 0; kj < p->n_k && ok; kj++) ok = kj == ki || !kernel_writes(p, kj, o);
    for (int kj = ki + 1; kj < p->n_k && ok; kj++) {
      int ko = p->k[kj].out_buf;
      ok = !kernel_reads(p, kj, b) && !kernel_writes(p, kj, b) && (ko < 0 || p->buf[ko].alias_of != b) &&
           !kernel_may_fail(p, kj);
    }
    if (!ok) continue;
    if (kernel_reads(p, ki, b)) {
      /* read and stored element for element, in one pointwise stage */
      if (k->kind != CG_K_LOOP || k->n_stage != 1 || k->stage[0].kind != CG_MAP || k->n_outer != k->ndim) continue;
      const cg_access *st = &k->acc[k->stage[0].store];
      if (st->buf != o) continue;
      for (int a = 0; a < k->n_acc && ok; a++) ok = k->acc[a].buf != b || same_access(k, &k->acc[a], st);
      if (!ok) continue;
    }
    p->buf[b].updated = true;
    alias_buffer(p, views, n_nodes, ki, o, b);
  }
}

/* ---- updates as soon as they can run ---- */

/* The buffers kernel ki reads (r) and writes (w), a buffer updated through
 * an alias counted as the buffer it aliases; a matmul that adds into its
 * output reads it too. Counts in *nr, *nw; -1 when out of memory. */
static int kernel_rw(const cg_program *p, int ki, int **r, int *nr, int **w, int *nw) {
  const cg_kernel *k = &p->k[ki];
  int cap = k->n_acc + k->n_in_rest + 4;
  *r = alloc_calloc((size_t)cap, sizeof(int)), *w = alloc_calloc((size_t)cap, sizeof(int));
  if (!*r || !*w) return -1;
  *nr = *nw = 0;
#define CANON(b) (p->buf[b].alias_of >= 0 ? p->buf[b].alias_of : (b))
  for (int a = 0; k->kind == CG_K_LOOP && a < k->n_acc; a++)
    if (stores_to(k, a)) (*w)[(*nw)++] = CANON(k->acc[a].buf);
    else (*r)[(*nr)++] = CANON(k->acc[a].buf);
  for (int j = 0; j < 3; j++)
    if (k->in_buf[j] >= 0) (*r)[(*nr)++] = CANON(k->in_buf[j]);
  for (int j = 0; j < k->n_in_rest; j++)
    if (k->in_rest[j] >= 0) (*r)[(*nr)++] = CANON(k->in_rest[j]);
  if (k->out_buf >= 0) {
    if (k->kind == CG_K_MATMUL && k->beta != 0) (*r)[(*nr)++] = CANON(k->out_buf);
    (*w)[(*nw)++] = CANON(k->out_buf);
  }
#undef CANON
  return 0;
}

static bool in_list(const int *l, int n, int b) {
  for (int i = 0; i < n; i++)
    if (l[i] == b) return true;
  return false;
}

/* An update (an optimizer's, of a weight and its moments) runs as soon as
 * what it reads is ready and nothing still needs the old value of the
 * argument it is written back to, instead of after the whole backward: the
 * gradient it consumes then dies at once, so the arena holds the gradients
 * of a layer or two rather than all of them. Hoisted are the kernels whose
 * results go only to other hoisted kernels and to write-backs into a param
 * or input (those write_in_place can store in place), loop kernels and
 * matmuls only; what reads an allreduce's result stays where it is, so that
 * the backward's compute overlaps the reduction. The order of every other
 * kernel is kept, and a hoisted kernel never passes one it conflicts with,
 * so each kernel computes what it did: results do not change by a bit.
 * Nor does it pass one that can fail on the call's data (an index out of
 * range), after which it could not be stored in place (write_in_place).
 * 0, or -1 when out of memory (the order is then unchanged). */
static int hoist_updates(cg_program *p, const cg_view *views) {
  const ir_graph *g = p->g;
  int n = p->n_k, nb = p->n_buf, rc = -1;
  if (n < 2 || g->n_writes == 0) return 0;
  int **r = alloc_calloc((size_t)n, sizeof *r), **w = alloc_calloc((size_t)n, sizeof *w);
  int **t = alloc_calloc((size_t)n, sizeof *t), *nr = alloc_calloc((size_t)n, sizeof(int));
  int *nw = alloc_calloc((size_t)n, sizeof(int)), *nt = alloc_calloc((size_t)n, sizeof(int));
  uint8_t *hoist = alloc_calloc((size_t)n, 1), *reduced = alloc_calloc((size_t)nb, 1);
  int *target = alloc_calloc((size_t)nb, sizeof(int)), *need = alloc_calloc((size_t)n, sizeof(int));
  int *last_w = alloc_calloc((size_t)nb, sizeof(int)), *last_r = alloc_calloc((size_t)nb, sizeof(int));
  int *order = alloc_calloc((size_t)n, sizeof(int)), *pend = alloc_calloc((size_t)n, sizeof(int));
  int *ustart = NULL, *users = NULL; /* per buffer b: the kernels that touch it, users[ustart[b] .. ustart[b+1]) */
  int *succ_n = alloc_calloc((size_t)n, sizeof(int)), *succ_at = alloc_calloc((size_t)n, sizeof(int));
  int *indeg = alloc_calloc((size_t)n, sizeof(int)), *edge_to = NULL; /* hoisted j's successors: edge_to[..] */
  cg_kernel *nk = alloc_calloc((size_t)n, sizeof *nk);
  if (!r || !w || !t || !nr || !nw || !nt || !hoist || !pend || !succ_n || !succ_at || !indeg || !reduced || !target ||
      !need || !last_w || !last_r || !order || !nk)
    goto out;
  for (int ki = 0; ki < n; ki++)
    if (kernel_rw(p, ki, &r[ki], &nr[ki], &w[ki], &nw[ki])) goto out;
  /* per buffer: the argument its value is written back to (-1 none, -2 a
   * write it cannot be stored in place for: an output, a .grad) */
  for (int b = 0; b < nb; b++) target[b] = -1;
  for (int i = 0; i < g->n_outputs; i++)
    if (views[g->outputs[i]].buf >= 0) target[views[g->outputs[i]].buf] = -2;
  for (int i = 0; i < g->n_writes; i++) {
    int v = g->writes[i].value >= 0 ? views[g->writes[i].value].buf : -1, b = in_place_target(p, views, i);
    if (v >= 0) target[v] = target[v] == -1 && b >= 0 ? b : -2;
    if (g->writes[i].has_cond && views[g->writes[i].cond].buf >= 0) target[views[g->writes[i].cond].buf] = -2;
  }
  for (int ki = 0; ki < n; ki++)
    if (p->k[ki].kind == CG_K_EAGER && g->nodes[p->k[ki].node].op == OP_ALLREDUCE)
      for (int i = 0; i < nw[ki]; i++) reduced[w[ki][i]] = 1;
  /* the kernels that touch each buffer, in order (a kernel once per buffer it names) */
  ustart = alloc_calloc((size_t)nb + 1, sizeof(int));
  if (!ustart) goto out;
  for (int ki = 0; ki < n; ki++) {
    for (int i = 0; i < nr[ki]; i++) ustart[r[ki][i] + 1]++;
    for (int i = 0; i < nw[ki]; i++) ustart[w[ki][i] + 1]++;
  }
  for (int b = 0; b < nb; b++) ustart[b + 1] += ustart[b];
  users = alloc_calloc((size_t)ustart[nb] + 1, sizeof(int));
  if (!users) goto out;
  for (int b = 0; b < nb; b++) last_w[b] = ustart[b]; /* fill cursors */
  for (int ki = 0; ki < n; ki++) {
    for (int i = 0; i < nr[ki]; i++) users[last_w[r[ki][i]]++] = ki;
    for (int i = 0; i < nw[ki]; i++) users[last_w[w[ki][i]]++] = ki;
  }
  /* which to hoist, from the last kernel back: what reads a hoisted kernel's results is hoisted too */
  for (int ki = n - 1; ki >= 0; ki--) {
    const cg_kernel *k = &p->k[ki];
    bool ok = k->kind != CG_K_EAGER && nw[ki] > 0;
    for (int i = 0; i < nr[ki] && ok; i++) ok = !reduced[r[ki][i]];
    for (int i = 0; i < nw[ki] && ok; i++) {
      int b = w[ki][i];
      bool used = false;
      for (int u = ustart[b]; u < ustart[b + 1] && ok; u++) {
        int kj = users[u];
        if (kj == ki) continue;
        /* an earlier kernel may only have read an argument's old value */
        ok = kj > ki ? hoist[kj] : !in_list(w[kj], nw[kj], b) && p->buf[b].kind == CG_BUF_INPUT;
        used |= kj > ki;
      }
      ok = ok && target[b] != -2 && (used || target[b] >= 0);
    }
    /* the arguments its results are written back to (through their own buffers, not the
     * aliases above) */
    if (ok) {
      int *tl = alloc_calloc((size_t)nw[ki] + 1, sizeof(int));
      if (!tl) goto out;
      for (int i = 0; i < k->n_acc + 1; i++) {
        int raw = i < k->n_acc ? (k->kind == CG_K_LOOP && stores_to(k, i) ? k->acc[i].buf : -1) : k->out_buf;
        if (raw >= 0 && target[raw] >= 0 && !in_list(tl, nt[ki], target[raw])) tl[nt[ki]++] = target[raw];
      }
      t[ki] = tl;
      /* a kernel after it that touches the argument would keep the value out of place, and
       * moving it up would only make that temp live longer */
      for (int i = 0; i < nt[ki] && ok; i++)
        for (int u = ustart[tl[i]]; u < ustart[tl[i] + 1] && ok; u++) ok = users[u] <= ki;
    }
    hoist[ki] = ok;
  }
  /* each hoisted kernel waits for the last kernel kept in place that it
   * conflicts with, or that can fail */
  for (int b = 0; b < nb; b++) last_w[b] = last_r[b] = -1;
  int last_fail = -1;
  for (int ki = 0; ki < n; ki++) {
    if (!hoist[ki]) {
      for (int i = 0; i < nr[ki]; i++) last_r[r[ki][i]] = ki;
      for (int i = 0; i < nw[ki]; i++) last_w[w[ki][i]] = ki;
      if (kernel_may_fail(p, ki)) last_fail = ki;
      continue;
    }
    int m = last_fail;
#define AT_LEAST(x) (m = (x) > m ? (x) : m)
    for (int i = 0; i < nr[ki]; i++) AT_LEAST(last_w[r[ki][i]]);
    for (int i = 0; i < nw[ki]; i++) AT_LEAST(last_w[w[ki][i]]), AT_LEAST(last_r[w[ki][i]]);
    for (int i = 0; i < nt[ki]; i++) AT_LEAST(last_w[t[ki][i]]), AT_LEAST(last_r[t[ki][i]]);
#undef AT_LEAST
    need[ki] = m;
  }
  /* and for the hoisted ones before it that it conflicts with (one that
   * writes what it reads, or reads or writes what it writes or writes back
   * to): edges j -> s (j < s), found through the users of the buffers s
   * names; a pair may repeat, counted alike both ways */
  int n_edge = 0;
  for (int pass = 0; pass < 2; pass++) {
    for (int sk = 0; sk < n; sk++) {
      if (!hoist[sk]) continue;
      for (int part = 0; part < 3; part++) {
        const int *l = part == 0 ? r[sk] : part == 1 ? w[sk] : t[sk];
        int nl = part == 0 ? nr[sk] : part == 1 ? nw[sk] : nt[sk];
        for (int i = 0; i < nl; i++)
          for (int u = ustart[l[i]]; u < ustart[l[i] + 1]; u++) {
            int j = users[u];
            /* a read of what j writes; any touch of what sk writes or writes back to */
            if (j >= sk || !hoist[j] || (part == 0 && !in_list(w[j], nw[j], l[i]))) continue;
            if (pass == 1) edge_to[succ_at[j]++] = sk, indeg[sk]++;
            else n_edge++, succ_n[j]++;
          }
      }
    }
    if (pass == 0) {
      edge_to = alloc_calloc((size_t)n_edge + 1, sizeof(int));
      if (!edge_to) goto out;
      for (int j = 0, at = 0; j < n; j++) succ_at[j] = at, at += succ_n[j];
    }
  }
  /* the new order: kept kernels in theirs, each hoisted one as soon as the
   * kept kernel it waits for and the hoisted ones it conflicts with have run
   * (pend: the hoisted ones still to place, in their order) */
  int no = 0, np = 0;
  for (int ki = 0; ki < n; ki++)
    if (hoist[ki]) pend[np++] = ki;
  for (int kept = -1; kept < n; kept++) {
    if (kept >= 0) {
      if (hoist[kept]) continue;
      order[no++] = kept;
    }
    int still = 0;
    for (int q = 0; q < np; q++) {
      int sk = pend[q];
      if (need[sk] > kept || indeg[sk] > 0) {
        pend[still++] = sk;
        continue;
      }
      order[no++] = sk;
      /* succ_at[sk] ran to the end of its edges: they start succ_n[sk] before */
      for (int e = succ_at[sk] - succ_n[sk]; e < succ_at[sk]; e++) indeg[edge_to[e]]--;
    }
    np = still;
  }
  if (no == n) {
    for (int i = 0; i < n; i++) nk[i] = p->k[order[i]];
    memcpy(p->k, nk, sizeof *nk * (size_t)n);
  }
  rc = 0;
out:
  for (int ki = 0; ki < n && r; ki++) alloc_free(r[ki]), alloc_free(w ? w[ki] : NULL), alloc_free(t ? t[ki] : NULL);
  alloc_free(r), alloc_free(w), alloc_free(t), alloc_free(nr), alloc_free(nw), alloc_free(nt), alloc_free(hoist);
  alloc_free(pend), alloc_free(reduced), alloc_free(target), alloc_free(need), alloc_free(last_w), alloc_free(last_r);
  alloc_free(order), alloc_free(nk), alloc_free(ustart), alloc_free(users), alloc_free(succ_n), alloc_free(succ_at);
  alloc_free(indeg), alloc_free(edge_to);
  return rc;
}

/* ---- large results as late as they can be made ---- */

/* Bytes of buffer b when its shape is constant, else -1. */
static int64_t const_bytes(const cg_buf *b) {
  int64_t n = (int64_t)kiln_dtype_size(b->dtype);
  for (int d = 0; d < b->ndim; d++) {
    if (!sym_is_const(b->shape[d])) return -1;
    n *= b->shape[d].c;
  }
  return n;
}

/* A kernel whose result is larger than the operands it would keep alive
 * runs just before the first kernel that reads it, instead of where the
 * graph's order put it. The case it is for: a tied LM head's weight
 * gradient, dlogits^T @ x, (vocab, C) and made at the start of the
 * backward, is read only at its end, where the embedding's gradient joins
 * it; made there instead, the arena holds dlogits (B*T rows) across the
 * backward rather than the (vocab, C) product, and the product takes the
 * memory the activations have left by then. Only pure kernels (loops and
 * matmuls that do not add into their output) move, past kernels that
 * neither write what they read nor touch what they write, so each computes
 * what it did: results do not change by a bit. Sizes must be constant (a
 * variant's first shapes): a symbolic comparison could go either way at
 * other sizes. A kernel that reads an argument a write-back updates stays,
 * so that the update can still be stored in place. 0, or -1 when out of
 * memory (the order is then unchanged). */
static int sink_results(cg_program *p, const cg_view *views) {
  const ir_graph *g = p->g;
  int n = p->n_k, nb = p->n_buf, rc = -1;
  if (n < 3) return 0;
  int **r = alloc_calloc((size_t)n, sizeof *r), **w = alloc_calloc((size_t)n, sizeof *w);
  int *nr = alloc_calloc((size_t)n, sizeof(int)), *nw = alloc_calloc((size_t)n, sizeof(int));
  int *ord = alloc_calloc((size_t)n, sizeof(int));
  uint8_t *pinned = alloc_calloc((size_t)nb, 1); /* outputs, write values and targets, aliased buffers */
  cg_kernel *nk = alloc_calloc((size_t)n, sizeof *nk);
  if (!r || !w || !nr || !nw || !ord || !pinned || !nk) goto out;
  for (int ki = 0; ki < n; ki++) {
    if (kernel_rw(p, ki, &r[ki], &nr[ki], &w[ki], &nw[ki])) goto out;
    ord[ki] = ki;
  }
  for (int i = 0; i < g->n_outputs; i++)
    if (views[g->outputs[i]].buf >= 0) pinned[views[g->outputs[i]].buf] = 1;
  for (int i = 0; i < g->n_writes; i++) {
    for (int rd[2], k = 0, nrd = ir_write_reads(&g->writes[i], rd); k < nrd; k++)
      if (views[rd[k]].buf >= 0) pinned[views[rd[k]].buf] = 1;
    if (p->node_buf[g->writes[i].target] >= 0) pinned[p->node_buf[g->writes[i].target]] = 1;
  }
  for (int b = 0; b < nb; b++)
    if (p->buf[b].alias_of >= 0) pinned[b] = pinned[p->buf[b].alias_of] = 1;
  bool moved = false;
  /* from the last position back: a kernel moves only past later ones */
  for (int pos = n - 2; pos >= 0; pos--) {
    int ki = ord[pos];
    const cg_kernel *k = &p->k[ki];
    if ((k->kind != CG_K_LOOP && k->kind != CG_K_MATMUL) || (k->kind == CG_K_MATMUL && k->beta != 0) || nw[ki] != 1)
      continue;
    int b = w[ki][0];
    const cg_buf *ob = &p->buf[b];
    int64_t out_bytes = const_bytes(ob);
    if (ob->kind != CG_BUF_TEMP || pinned[b] || ob->scratch_of >= 0 || out_bytes < 0) continue;
    bool ok = true;
    for (int i = 0; i < nr[ki] && ok; i++) ok = !pinned[r[ki][i]] || p->buf[r[ki][i]].kind != CG_BUF_INPUT;
    /* the first later kernel that touches b, and whether the ones before it conflict */
    int c = pos + 1;
    for (; c < n && ok; c++) {
      int kj = ord[c];
      if (in_list(r[kj], nr[kj], b) || in_list(w[kj], nw[kj], b)) break;
      for (int i = 0; i < nw[kj] && ok; i++) ok = !in_list(r[ki], nr[ki], w[kj][i]);
    }
    if (!ok || c >= n || c == pos + 1 || !in_list(r[ord[c]], nr[ord[c]], b)) continue;
    /* the operands it would keep alive from their last other use to c */
    int64_t kept = 0;
    for (int i = 0; i < nr[ki] && ok; i++) {
      int x = r[ki][i];
      if (p->buf[x].kind != CG_BUF_TEMP) continue;
      bool later = false;
      for (int q = c; q < n && !later; q++) later = in_list(r[ord[q]], nr[ord[q]], x);
      if (later) continue;
      int64_t xb = const_bytes(&p->buf[x]);
      if (xb < 0) ok = false;
      kept += xb;
    }
    if (!ok || out_bytes <= 2 * kept) continue;
    /* and before each kernel J just ahead of the reader that only makes a
     * result for it or later (the embedding's gradient, for the tied head),
     * so that the operands K frees do not sit beside that result */
    int at = c;
    while (kept > 0 && at - 1 > pos) {
      int kj = ord[at - 1];
      int64_t jb = nw[kj] == 1 && p->buf[w[kj][0]].kind == CG_BUF_TEMP ? const_bytes(&p->buf[w[kj][0]]) : -1;
      if (jb <= 0 || in_list(r[kj], nr[kj], b)) break;
      bool early = false; /* is its result read before the reader? */
      for (int q = at; q < c && !early; q++) early = in_list(r[ord[q]], nr[ord[q]], w[kj][0]);
      int64_t freed = 0; /* the operands J frees, which would now sit beside K's result */
      for (int i = 0; i < nr[kj]; i++) {
        int x = r[kj][i];
        bool later = p->buf[x].kind != CG_BUF_TEMP;
        for (int q = at; q < n && !later; q++) later = in_list(r[ord[q]], nr[ord[q]], x);
        int64_t xb = later ? 0 : const_bytes(&p->buf[x]);
        freed += xb < 0 ? jb : xb;
      }
      /* J then K holds, at its peak, K's operands, J's result and K's
       * result at once; K then J holds J's operands beside K's result and
       * the larger of the other two: better when J frees less than both */
      if (early || freed >= jb || freed >= kept) break;
      at--;
    }
    memmove(&ord[pos], &ord[pos + 1], sizeof(int) * (size_t)(at - 1 - pos));
    ord[at - 1] = ki;
    moved = true;
  }
  if (moved) {
    for (int i = 0; i < n; i++) nk[i] = p->k[ord[i]];
    memcpy(p->k, nk, sizeof *nk * (size_t)n);
  }
  rc = 0;
out:
  for (int ki = 0; ki < n && r; ki++) alloc_free(r[ki]), alloc_free(w ? w[ki] : NULL);
  alloc_free(r), alloc_free(w), alloc_free(nr), alloc_free(nw), alloc_free(ord), alloc_free(pinned), alloc_free(nk);
  return rc;
}

/* Whether buffers a and b hold as many elements (their shapes may differ: a
 * reshape between them). */
static bool same_numel(const cg_buf *a, const cg_buf *b) {
  if (a->ndim == b->ndim && same_dims(a->ndim, a->shape, b->shape)) return true;
  int64_t na = 1, nb = 1;
  for (int d = 0; d < a->ndim; d++)
    if (sym_is_const(a->shape[d])) na *= a->shape[d].c;
    else return false;
  for (int d = 0; d < b->ndim; d++)
    if (sym_is_const(b->shape[d])) nb *= b->shape[d].c;
    else return false;
  return na == nb;
}

/* A buffer that can lend its memory to what stage s of kernel ki stores
 * (buffer o): a temp some kernel writes (else it has no memory to lend),
 * that dies in ki, of o's dtype and shape (or, reshaped, element count),
 * which every stage reads only at the element the store writes and no
 * stage after s reads. -1: none. */
static int lender(const cg_program *p, int ki, int s, int o, bool reshaped) {
  const cg_kernel *k = &p->k[ki];
  const cg_access *st = &k->acc[k->stage[s].store];
  const cg_buf *ob = &p->buf[o];
  for (int a = 0; a < k->n_acc; a++) {
    int b = k->acc[a].buf;
    const cg_buf *bb = &p->buf[b];
    if (a == k->stage[s].store || b == o || bb->kind != CG_BUF_TEMP || bb->first < 0 || bb->last != ki || bb->alias_of >= 0)
      continue;
    if (bb->dtype != ob->dtype ||
        !(reshaped ? same_numel(bb, ob) : bb->ndim == ob->ndim && same_dims(bb->ndim, bb->shape, ob->shape)))
      continue;
    bool ok = true;
    for (int c = 0; c < k->n_acc && ok; c++) {
      if (k->acc[c].buf != b) continue;
      ok = same_access(k, &k->acc[c], st) && !stores_to(k, c);
      for (int t = s + 1; t < k->n_stage && ok; t++) ok = !expr_loads(k, k->stage[t].expr, c);
    }
    if (ok) return b;
  }
  return -1;
}

/* In place: a pointwise kernel whose input buffer dies in it, with the same
 * dtype, shape and element order as its result, stores into that buffer
 * (a matmul's output under its epilogue, a chain of materialized nodes).
 * Reading and writing the same element in the same iteration, through the
 * same pointer, keeps the loop vectorizable. */
static void reuse_in_place(cg_program *p, cg_view *views, int n_nodes) {
  for (int ki = 0; ki < p->n_k; ki++) {
    cg_kernel *k = &p->k[ki];
    if (k->kind != CG_K_LOOP || k->n_stage != 1 || k->stage[0].kind != CG_MAP || k->n_outer != k->ndim) continue;
    int o = k->out_buf, b;
    if (o < 0 || p->buf[o].kind != CG_BUF_TEMP || p->buf[o].alias_of >= 0 || (b = lender(p, ki, 0, o, false)) < 0)
      continue;
    p->buf[b].last = p->buf[o].last;
    alias_buffer(p, views, n_nodes, ki, o, b);
  }
}

/* The same in a row kernel: an inner MAP stage stores into a buffer that
 * dies in the kernel (lender). A row's reductions before the store have
 * then read all of its row, and rows do not read one another: a loss's
 * exponentials take the logits' memory (the logits are last read where the
 * exponentials are made). */
static void row_in_place(cg_program *p, cg_view *views, int n_nodes) {
  for (int ki = 0; ki < p->n_k; ki++) {
    cg_kernel *k = &p->k[ki];
    if (k->kind != CG_K_LOOP || k->n_outer == k->ndim) continue;
    for (int s = 0; s < k->n_stage; s++) {
      if (k->stage[s].kind != CG_MAP || !k->stage[s].inner) continue;
      int o = k->acc[k->stage[s].store].buf, b;
      if (o < 0 || p->buf[o].kind != CG_BUF_TEMP || p->buf[o].alias_of >= 0 || p->buf[o].first != ki ||
          (b = lender(p, ki, s, o, true)) < 0)
        continue;
      p->buf[b].last = p->buf[o].last;
      alias_buffer(p, views, n_nodes, ki, o, b);
      for (int x = 0; x < p->n_buf; x++) /* what reuse_in_place stored in o is in b (one level of aliases) */
        if (p->buf[x].alias_of == o) p->buf[x].alias_of = b;
    }
  }
}

cg_program *fuse_graph(const ir_graph *g, char *err, size_t errn) {
  fuser f = {.g = g, .sym = g->sym, .err = err, .errn = errn};
  size_t n = (size_t)g->n_nodes + 1;
  f.p = alloc_calloc(1, sizeof *f.p);
  f.mat = alloc_calloc(n, 1);
  f.is_out = alloc_calloc(n, 1);
  f.kcount = alloc_calloc(n, sizeof(int));
  f.klast = alloc_calloc(n, sizeof(int));
  f.map = alloc_calloc(n, sizeof *f.map);
  int *memo = alloc_calloc(n, sizeof(int));
  uint8_t *seen = alloc_calloc(n, 1);
  f.memo_set = alloc_calloc(n, sizeof(int));
  f.seen_set = alloc_calloc(n, sizeof(int));
  f.stack = alloc_calloc(n, sizeof(int));
  f.k_mark = alloc_calloc(n, sizeof(int));
  f.b_mark = alloc_calloc(n, sizeof(int));
  f.undo_stamp = alloc_calloc(n, sizeof(int));
  if (f.p) f.p->node_buf = alloc_calloc(n, sizeof(int));
  if (!f.p || !f.mat || !f.is_out || !f.kcount || !f.klast || !f.map || !memo || !seen || !f.memo_set || !f.seen_set || !f.stack ||
      !f.k_mark || !f.b_mark || !f.undo_stamp || !f.p->node_buf) {
    snprintf(err, errn, "out of memory");
    goto fail;
  }
  f.p->g = g;
  for (int i = 0; i < g->n_nodes; i++) f.klast[i] = -1;
  /* outputs of the graph that are computed get fresh tensors */
  for (int i = 0; i < g->n_outputs; i++) {
    int o = g->outputs[i];
    while (is_view(g->nodes[o].op)) o = g->nodes[o].in[0]; /* a returned view keeps its base alive */
    f.is_out[o] = 1;
    if (is_compute(g->nodes[o].op)) f.mat[o] = 1;
  }
  for (int i = 0; i < g->n_writes; i++)
    for (int rd[2], k = 0, nrd = ir_write_reads(&g->writes[i], rd); k < nrd; k++)
      if (is_compute(g->nodes[rd[k]].op)) f.mat[rd[k]] = 1;
  for (int i = 0; i < g->n_nodes; i++) {
    const ir_node *nd = &g->nodes[i];
    /* what a view, a matmul or an eager op reads must exist in memory */
    if (!is_compute(nd->op) && nd->op < OP_COUNT)
      for (int j = 0; j < nd->n_in; j++) {
        int in = small_matmul(g, nd) ? matvec_operand(g, nd->in[j]) : nd->in[j];
        if (is_compute(g->nodes[in].op)) f.mat[in] = 1;
      }
  }
  for (int round = 0; round < 4 * g->n_nodes + 8; round++) {
    f.restart = 0;
    int r = build(&f, memo, seen);
    if (r == 0) break;
    if (r == -1) {
      snprintf(err, errn, "out of memory");
      goto fail;
    }
  }
  if (f.restart) {
    snprintf(err, errn, "fusion did not settle");
    goto fail;
  }
#ifdef KILN_TEST_BUILD
  {
    /* a round over the whole graph must find the same partition, settled */
    int nk = f.p->n_k, nb = f.p->n_buf;
    f.restart_from = 0;
    int r = build(&f, memo, seen);
    if (r == -1) {
      snprintf(err, errn, "out of memory");
      goto fail;
    }
    if (r || f.restart || f.p->n_k != nk || f.p->n_buf != nb) {
      snprintf(err, errn, "fusion: a full round differs from the resumed ones (%d kernels, %d buffers; then %d, %d)", nk, nb,
               f.p->n_k, f.p->n_buf);
      goto fail;
    }
  }
#endif
  cg_program *p = f.p;
  if (merge_reduce_epilogues(p, f.map)) {
    snprintf(err, errn, "out of memory");
    goto fail;
  }
  fold_epilogues(p, f.map);
  if (merge_rows(p)) {
    snprintf(err, errn, "out of memory");
    goto fail;
  }
  /* an argument's memory written in place, or an update moved ahead, is
   * sound only where no other argument is the same memory */
  if ((!g->leaves_share && hoist_updates(p, f.map)) || sink_results(p, f.map)) {
    snprintf(err, errn, "out of memory");
    goto fail;
  }
  number_kernels(p);
  if (add_scratch_bufs(&f)) {
    snprintf(err, errn, "out of memory");
    goto fail;
  }
  /* liveness over the kernel order */
  for (int ki = 0; ki < p->n_k; ki++) {
    cg_kernel *k = &p->k[ki];
    if (k->out_buf >= 0 && p->buf[k->out_buf].first < 0) p->buf[k->out_buf].first = ki;
    for (int s = 0; k->kind == CG_K_LOOP && s < k->n_stage; s++) { /* a row kernel stores more than its result */
      int b = k->stage[s].kind == CG_MAP ? k->acc[k->stage[s].store].buf : -1;
      if (b >= 0 && p->buf[b].first < 0) p->buf[b].first = ki;
    }
    /* a result no kernel reads (a dead node of a loaded graph) still occupies its buffer while written */
    if (k->out_buf >= 0 && p->buf[k->out_buf].last < ki) p->buf[k->out_buf].last = ki;
    for (int a = 0; a < k->n_acc; a++) p->buf[k->acc[a].buf].last = ki;
    for (int j = 0; j < 3; j++)
      if (k->in_buf[j] >= 0) p->buf[k->in_buf[j]].last = ki;
    for (int j = 0; j < k->n_in_rest; j++)
      if (k->in_rest[j] >= 0) p->buf[k->in_rest[j]].last = ki;
  }
  /* write-backs and outputs read their buffers after the last kernel */
  for (int i = 0; i < g->n_writes; i++)
    for (int rd[2], k = 0, nrd = ir_write_reads(&g->writes[i], rd); k < nrd; k++)
      if (f.map[rd[k]].buf >= 0) p->buf[f.map[rd[k]].buf].last = p->n_k;
  for (int i = 0; i < g->n_outputs; i++)
    if (f.map[g->outputs[i]].buf >= 0) p->buf[f.map[g->outputs[i]].buf].last = p->n_k;
  if (!g->leaves_share) {
    scatter_in_place(p, f.map, g->n_nodes);
    write_in_place(p, f.map, g->n_nodes);
  }
  reuse_in_place(p, f.map, g->n_nodes);
  row_in_place(p, f.map, g->n_nodes);
  coalesce_dims(p);
  alloc_free(f.mat), alloc_free(f.is_out), alloc_free(f.kcount), alloc_free(f.klast);
  alloc_free(memo), alloc_free(seen), alloc_free(f.memo_set), alloc_free(f.seen_set), alloc_free(f.stack);
  alloc_free(f.k_mark), alloc_free(f.b_mark), alloc_free(f.undo_stamp);
  /* keep the view maps: the runtime reads outputs and operands through them */
  p->views = f.map;
  return p;
fail:
  alloc_free(f.mat), alloc_free(f.is_out), alloc_free(f.kcount), alloc_free(f.klast), alloc_free(f.map);
  alloc_free(memo), alloc_free(seen), alloc_free(f.memo_set), alloc_free(f.seen_set), alloc_free(f.stack);
  alloc_free(f.k_mark), alloc_free(f.b_mark), alloc_free(f.undo_stamp);
  cg_program_free(f.p);
  return NULL;
}

/* ---- dump ---- */

static void print_dim(FILE *o, sym_dim d) {
  char b[128];
  if (sym_print(d, b, sizeof b) < 0) snprintf(b, sizeof b, "?");
  fputs(b, o);
}

static const char *buf_kind_name(cg_buf_kind k) {
  static const char *const names[] = {"input", "grad", "const", "temp", "output"};
  return names[k];
}

void fuse_dump(const cg_program *p, FILE *o) {
  const ir_graph *g = p->g;
  fprintf(o, "kernels of %s: %d\n", g->name, p->n_k);
  for (int ki = 0; ki < p->n_k; ki++) {
    const cg_kernel *k = &p->k[ki];
    fprintf(o, "  %s", k->name);
    if (k->kind == CG_K_LOOP) {
      fprintf(o, "  loops [");
      for (int d = 0; d < k->ndim; d++) {
        if (d) fputs(d == k->n_outer ? " | " : ",", o);
        print_dim(o, k->dim[d]);
      }
      fprintf(o, "]%s", k->n_outer == k->ndim ? "" : " (outer | inner)");
      int nr = 0;
      for (int s = 0; s < k->n_stage; s++) nr += k->stage[s].kind == CG_REDUCE;
      if (nr) fprintf(o, ", %d reduce stage%s", nr, nr > 1 ? "s" : "");
    }
    fprintf(o, " -> b%d\n", k->out_buf);
    for (int i = 0; i < k->n_nodes; i++) {
      const ir_node *n = &g->nodes[k->nodes[i]];
      fprintf(o, "      %%%d %s", k->nodes[i], ir_op_name(n->op));
      if (n->file && *n->file) fprintf(o, "  # %s:%d", n->file, n->line);
      fputc('\n', o);
    }
  }
  fprintf(o, "buffers:\n");
  for (int b = 0; b < p->n_buf; b++) {
    const cg_buf *bf = &p->buf[b];
    fprintf(o, "  b%d %s %%%d %s[", b, buf_kind_name(bf->kind), bf->node, kiln_dtype_name(bf->dtype));
    for (int d = 0; d < bf->ndim; d++) {
      if (d) fputc(',', o);
      print_dim(o, bf->shape[d]);
    }
    fprintf(o, "]");
    if (bf->kind == CG_BUF_TEMP && bf->scratch_of >= 0) fprintf(o, " working memory of k%d, sized at each call", bf->scratch_of);
    else if (bf->kind == CG_BUF_TEMP && bf->alias_of >= 0) fprintf(o, " stored in place in b%d", bf->alias_of);
    else if (bf->kind == CG_BUF_TEMP && bf->first < 0) fprintf(o, " unused (folded into another kernel)");
    else if (bf->kind == CG_BUF_TEMP) fprintf(o, " live k%d..k%d", bf->first, bf->last);
    fputc('\n', o);
  }
}
