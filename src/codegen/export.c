/* Ahead-of-time export: one compiled variant as an object file and a C
 * header that a program links with libkiln_rt alone (no libkiln, no LLVM).
 * The stages are the JIT's: fuse the graph, lower every loop kernel into one
 * module, optimize for the target and emit an object (jit.c). Beside the
 * kernels the module holds the plan (rt/plan.h: the buffers, the kernels'
 * sizes as code over the symbols, the guards, the inputs and outputs), the
 * embedded weights, and <name>_run and <name>_error, which call the runtime
 * (src/rt/rt.c). Sizes stay symbolic, so one export serves every size its
 * guards allow. What the runtime has no kernel for (an op that runs through
 * an eager kernel, a write back to an input, a .grad) is refused here, with
 * the op and the user's file:line.
 *
 * A graph with control flow exports as units (rt/plan.h): the graph and each
 * region, nested ones included, fused and planned on its own as the JIT does
 * (runtime.c's region execs); a cond, while or scan node is one kernel of its
 * graph that runs its regions' units, and each get of its results a copy out
 * of the construct's result slots. */
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "codegen/codegen.h"

/* The plan's words, growing. */
typedef struct words {
  int64_t *w;
  size_t n, cap;
  bool oom;
} words;

static size_t put(words *p, int64_t v) {
  if (p->n == p->cap) {
    size_t cap = p->cap ? 2 * p->cap : 1024;
    int64_t *w = alloc_realloc(p->w, cap * sizeof *w);
    if (!w) {
      p->oom = true;
      return p->n;
    }
    p->w = w, p->cap = cap;
  }
  p->w[p->n] = v;
  return p->n++;
}

/* Bytes (the strings, the weights), growing. */
typedef struct bytes {
  char *b;
  size_t n, cap;
  bool oom;
} bytes;

static size_t put_bytes(bytes *s, const void *data, size_t n, size_t align) {
  size_t at = (s->n + align - 1) / align * align;
  if (at + n + 1 > s->cap) {
    size_t cap = s->cap ? s->cap : 4096;
    while (cap < at + n + 1) cap *= 2;
    char *b = alloc_realloc(s->b, cap);
    if (!b) {
      s->oom = true;
      return 0;
    }
    s->b = b, s->cap = cap;
  }
  memset(s->b + s->n, 0, at - s->n);
  if (data) memcpy(s->b + at, data, n);
  else memset(s->b + at, 0, n);
  s->n = at + n;
  return at;
}

static size_t put_str(bytes *s, const char *str) { return put_bytes(s, str, strlen(str) + 1, 1); }

/* Appends d's code; its offset. */
static int64_t code(words *p, sym_dim d) {
  int64_t tmp[512];
  int n = sym_code(d, tmp, 512);
  if (n < 0) {
    p->oom = true; /* too large: reported as such by the caller */
    return 0;
  }
  size_t at = p->n;
  for (int i = 0; i < n; i++) put(p, tmp[i]);
  return (int64_t)at;
}

/* The code of the product of n dims. */
static int64_t code_numel(words *p, int n, const sym_dim *shape) {
  size_t at = p->n;
  put(p, RT_C_CONST), put(p, 1);
  for (int d = 0; d < n; d++) {
    int64_t tmp[512];
    int k = sym_code(shape[d], tmp, 512);
    if (k < 1) {
      p->oom = true;
      return 0;
    }
    for (int i = 0; i < k - 1; i++) put(p, tmp[i]); /* without its END */
    put(p, RT_C_MUL);
  }
  put(p, RT_C_END);
  return (int64_t)at;
}

/* A view record at its place in the plan: buf, offset, ndim, shape, strides. */
static void put_view(words *p, size_t at, int buf, const ir_node *n, const cg_view *v) {
  int64_t off = code(p, v->off), sh[RT_MAXD] = {0}, st[RT_MAXD] = {0};
  for (int d = 0; d < n->ndim; d++) sh[d] = code(p, n->shape[d]), st[d] = code(p, v->stride[d]);
  if (p->oom) return;
  p->w[at] = buf, p->w[at + 1] = off, p->w[at + 2] = n->ndim;
  for (int d = 0; d < RT_MAXD; d++) p->w[at + 3 + d] = sh[d], p->w[at + 3 + RT_MAXD + d] = st[d];
}

static int fail(char *err, size_t errn, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t errn, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errn, fmt, ap);
  va_end(ap);
  return -1;
}

/* "op (file.c:42)" of node n, into buf. */
static const char *where(const ir_node *n, char *buf, size_t bn) {
  if (n->file && *n->file) snprintf(buf, bn, "%s (%s:%d)", ir_op_name(n->op), n->file, n->line);
  else snprintf(buf, bn, "%s", ir_op_name(n->op));
  return buf;
}

/* What the runtime cannot run; 0, or -1 with why. */
static int refuse(const ir_graph *g, const cg_program *p, const export_request *rq, char *err, size_t errn) {
  char w[256];
  if (g->n_writes && g->region)
    return fail(err, errn, "a region writes back to an input (%s:%d): an export runs graphs without in-place updates",
                g->writes[0].file ? g->writes[0].file : "?", g->writes[0].line);
  if (g->n_writes)
    return fail(err, errn, "the variant writes back to an input or param (%s:%d): an export runs graphs without in-place updates",
                g->writes[0].file ? g->writes[0].file : "?", g->writes[0].line);
  if (g->n_syms > RT_MAX_SYMS) return fail(err, errn, "the variant has %d symbols (the runtime takes %d)", g->n_syms, RT_MAX_SYMS);
  for (int i = 0; i < g->n_nodes; i++) {
    const ir_node *n = &g->nodes[i];
    if (n->op == IR_INPUT && n->attrs.k > 0)
      return fail(err, errn, "input %d is a number the body passes as a size: an export binds sizes from its inputs' shapes only", n->index);
  }
  for (int b = 0; b < p->n_buf; b++) {
    const cg_buf *bf = &p->buf[b];
    if (bf->kind == CG_BUF_GRAD) return fail(err, errn, "the variant reads a .grad: an export runs no autograd state");
    if (bf->scratch_of >= 0 || (bf->kind == CG_BUF_TEMP && bf->alias_of >= 0 && p->buf[bf->alias_of].kind != CG_BUF_TEMP))
      return fail(err, errn, "%s: its kernel works in memory the runtime does not plan", where(&g->nodes[bf->node], w, sizeof w));
  }
  for (int k = 0; k < p->n_k; k++) {
    const cg_kernel *kk = &p->k[k];
    const ir_node *n = &g->nodes[kk->node];
    if (kk->kind == CG_K_EAGER && ir_is_cf(n->op) && n->n_in > 256)
      return fail(err, errn, "%s has %d operands (the runtime takes 256)", where(n, w, sizeof w), n->n_in);
    bool cumsum = n->op == OP_CUMSUM && (n->dtype == KILN_F32 || n->dtype == KILN_F64 || n->dtype == KILN_I64);
    if (kk->kind == CG_K_EAGER && !ir_is_cf(n->op) && n->op != IR_GET && !cumsum &&
        (n->op != OP_INDEX_SELECT || g->nodes[n->in[1]].ndim != 1))
      return fail(err, errn, "%s runs through an eager kernel, which libkiln_rt does not have: the op cannot be exported yet",
                  where(n, w, sizeof w));
    if (kk->kind == CG_K_MATMUL && n->dtype != KILN_F32 && n->dtype != KILN_F64)
      return fail(err, errn, "%s: a matmul of %s (the runtime's BLAS takes f32 and f64)", where(n, w, sizeof w),
                  kiln_dtype_name(n->dtype));
    if (kk->kind == CG_K_LOOP && (kk->n_acc > 64 || kk->ndim > RT_MAXD))
      return fail(err, errn, "kernel %s has %d accesses (the runtime takes 64)", kk->name, kk->n_acc);
  }
  (void)rq;
  return 0;
}

/* The leaf node of export input i (the graph's inputs, then its params when they are inputs). */
static const ir_node *input_node(const ir_graph *g, const export_request *rq, int i) {
  for (int j = 0; j < g->n_nodes; j++) {
    const ir_node *n = &g->nodes[j];
    if (n->op == IR_INPUT && n->index == i) return n;
    if (n->op == IR_PARAM && rq->params_as_inputs && g->n_inputs + n->index == i) return n;
  }
  return NULL;
}

/* The name an input goes by in the header and messages. */
static void input_name(const ir_graph *g, const export_request *rq, int i, char *buf, size_t bn) {
  const ir_node *n = input_node(g, rq, i);
  if (n && n->name) snprintf(buf, bn, "%s", n->name);
  else if (n && n->op == IR_PARAM) snprintf(buf, bn, "param%d", n->index);
  else snprintf(buf, bn, "in%d", i);
}

/* A graph of the export: the top one (unit 0) or a region. */
typedef struct unit {
  const ir_graph *g;
  cg_program *p;
  int (*sub)[2]; /* per node: the units of its regions */
  int64_t header; /* its header's word */
} unit;

/* The plan and the weights of unit u (program p of graph g), its header at
 * the plan's end; *loops counts the loop kernels before it (in), then with
 * its own (out); *n_cf likewise the control-flow kernels. 0, or -1 with err. */
static int build_plan(const unit *u, const export_request *rq, words *pl, bytes *str, bytes *wt, int *n_loops,
                      int *n_cf, char *err, size_t errn) {
  const ir_graph *g = u->g;
  const cg_program *p = u->p;
  bool top = !g->region;
  int n_in = g->n_inputs + (top && rq->params_as_inputs ? g->n_params : 0);
  size_t base = pl->n;
  int *cf_of = NULL; /* per node: its construct's id */
  for (int i = 0; i < PLAN_HEADER; i++) put(pl, 0);
  size_t syms = pl->n, ins = syms + (size_t)g->n_syms * SYM_WORDS, outs = ins + (size_t)n_in * IN_WORDS;
  size_t bufs = outs + (size_t)g->n_outputs * OUT_WORDS, kers = bufs + (size_t)p->n_buf * BUF_WORDS;
  size_t guards = kers + (size_t)p->n_k, end = guards + (size_t)g->n_guards * GUARD_WORDS;
  while (pl->n < end && !pl->oom) put(pl, 0);
  if (pl->oom) goto oom;
  int64_t h[PLAN_HEADER] = {[PLAN_MAGIC] = (int64_t)RT_MAGIC, [PLAN_VERSION] = RT_PLAN_VERSION, [PLAN_NSYMS] = g->n_syms,
                            [PLAN_NIN] = n_in, [PLAN_NOUT] = g->n_outputs, [PLAN_NBUF] = p->n_buf, [PLAN_NK] = p->n_k,
                            [PLAN_NGUARD] = g->n_guards, [PLAN_SYMS] = (int64_t)syms, [PLAN_INS] = (int64_t)ins,
                            [PLAN_OUTS] = (int64_t)outs, [PLAN_BUFS] = (int64_t)bufs, [PLAN_KERNELS] = (int64_t)kers,
                            [PLAN_GUARDS] = (int64_t)guards};
  h[PLAN_NAME] = (int64_t)put_str(str, rq->name);
  /* symbols: bounds, and the input dim each is bound from */
  for (int s = 0; s < g->n_syms; s++) {
    int64_t at = (int64_t)(syms + (size_t)s * SYM_WORDS), bi = -1, bd = -1;
    for (int i = 0; i < n_in && bi < 0; i++) {
      const ir_node *n = input_node(g, rq, i);
      for (int d = 0; n && d < n->ndim && bi < 0; d++)
        if (ir_sym_id(g, n->shape[d]) == s) bi = i, bd = d;
    }
    if (bi < 0 && top) return fail(err, errn, "s%d is not the size of any input of the export (an embedded param's?)", s);
    if (!top) bi = bd = -1; /* a region's symbols are its parent's */
    pl->w[at] = g->sym_lo[s], pl->w[at + 1] = g->sym_hi[s], pl->w[at + 2] = bi, pl->w[at + 3] = bd;
  }
  for (int i = 0; i < n_in; i++) {
    const ir_node *n = input_node(g, rq, i);
    if (!n) return fail(err, errn, "input %d is not in the graph", i);
    char nm[160]; /* a param's name: up to 128 */
    input_name(g, rq, i, nm, sizeof nm);
    size_t at = ins + (size_t)i * IN_WORDS;
    int64_t name = (int64_t)put_str(str, nm), dims[RT_MAXD] = {0};
    for (int d = 0; d < n->ndim; d++) dims[d] = code(pl, n->shape[d]);
    if (pl->oom) goto oom;
    pl->w[at] = n->dtype, pl->w[at + 1] = n->ndim, pl->w[at + 2] = name;
    for (int d = 0; d < RT_MAXD; d++) pl->w[at + 3 + d] = dims[d];
  }
  for (int i = 0; i < g->n_outputs; i++) {
    const ir_node *n = &g->nodes[g->outputs[i]];
    const cg_view *v = &p->views[g->outputs[i]];
    if (v->buf < 0) return fail(err, errn, "output %d has no buffer", i);
    size_t at = outs + (size_t)i * OUT_WORDS;
    pl->w[at] = n->dtype;
    put_view(pl, at + 1, v->buf, n, v);
  }
  for (int b = 0; b < p->n_buf; b++) {
    const cg_buf *bf = &p->buf[b];
    const ir_node *n = &g->nodes[bf->node];
    int64_t kind = RT_BUF_TEMP, src = 0, numel = code_numel(pl, bf->ndim, bf->shape);
    if (bf->kind == CG_BUF_INPUT && (n->op == IR_INPUT || rq->params_as_inputs)) {
      kind = RT_BUF_INPUT;
      src = n->op == IR_INPUT ? n->index : g->n_inputs + n->index;
    } else if (bf->kind == CG_BUF_INPUT || bf->kind == CG_BUF_CONST) {
      /* the param's values now, or the constant's: row-major, 64-byte aligned */
      kiln_tensor *t = bf->kind == CG_BUF_CONST ? ir_const_tensor(n) : rq->params[n->index];
      if (!t) goto oom;
      size_t nb = (size_t)kiln_numel(t) * kiln_dtype_size(kiln_type(t));
      kind = RT_BUF_WEIGHT;
      src = (int64_t)put_bytes(wt, NULL, nb, 64);
      int rc = wt->oom ? -1 : kiln_read(t, wt->b + src, nb);
      if (bf->kind == CG_BUF_CONST) kiln_release(t);
      if (rc) goto oom;
    } else if (bf->kind == CG_BUF_OUTPUT) {
      kind = RT_BUF_OUTPUT;
    }
    if (pl->oom) goto oom;
    size_t at = bufs + (size_t)b * BUF_WORDS;
    int64_t w[BUF_WORDS] = {kind, bf->dtype, numel, src, bf->alias_of, bf->first, bf->last};
    memcpy(pl->w + at, w, sizeof w);
  }
  int loops = *n_loops;
  if (!(cf_of = alloc_malloc(sizeof(int) * ((size_t)g->n_nodes + 1)))) goto oom;
  for (int i = 0; i < g->n_nodes; i++) cf_of[i] = -1;
  for (int ki = 0; ki < p->n_k; ki++) {
    const cg_kernel *k = &p->k[ki];
    size_t rec = pl->n;
    pl->w[kers + (size_t)ki] = (int64_t)rec;
    const ir_node *kn = &g->nodes[k->node];
    if (k->kind == CG_K_EAGER && ir_is_cf(kn->op)) {
      /* the construct over its operands' views; its id numbers its state in a call */
      char w[256];
      int op = kn->op == IR_COND ? RT_CF_COND : kn->op == IR_WHILE ? RT_CF_WHILE : RT_CF_SCAN;
      cf_of[k->node] = *n_cf;
      int64_t head[CF_WORDS] = {RT_K_CF, op, (*n_cf)++, kn->n_in, kn->n_carry, kn->n_xs, u->sub[k->node][0],
                                u->sub[k->node][1], (int64_t)put_str(str, where(kn, w, sizeof w))};
      for (int i = 0; i < CF_WORDS; i++) put(pl, head[i]);
      size_t ops = pl->n;
      for (int i = 0; i < kn->n_in * (1 + VIEW_WORDS); i++) put(pl, 0);
      for (int j = 0; j < kn->n_in && !pl->oom; j++) {
        const ir_node *x = &g->nodes[kn->in[j]];
        size_t at = ops + (size_t)j * (1 + VIEW_WORDS);
        pl->w[at] = x->dtype;
        put_view(pl, at + 1, p->views[kn->in[j]].buf, x, &p->views[kn->in[j]]);
      }
      if (pl->oom) goto oom;
      continue;
    }
    if (k->kind == CG_K_EAGER && kn->op == IR_GET) {
      /* the construct's result into this node's buffer: the construct is the
       * kernel that made its tuple's buffer (every construct has one id) */
      int cf = cf_of[kn->in[0]];
      if (cf < 0) {
        alloc_free(cf_of);
        return fail(err, errn, "%%%d: get of a construct that runs after it", k->node);
      }
      put(pl, RT_K_GET), put(pl, cf), put(pl, kn->attrs.k), put(pl, kn->dtype);
      size_t v = pl->n;
      for (int i = 0; i < VIEW_WORDS; i++) put(pl, 0);
      if (!pl->oom) put_view(pl, v, k->out_buf, kn, &p->views[k->node]);
      if (pl->oom) goto oom;
      continue;
    }
    if (k->kind == CG_K_EAGER && kn->op == OP_CUMSUM) {
      /* the running sums along dim (the reverse scan's step indices) */
      put(pl, RT_K_CUMSUM), put(pl, kn->dtype), put(pl, kn->attrs.dim);
      size_t v = pl->n;
      for (int i = 0; i < 2 * VIEW_WORDS; i++) put(pl, 0);
      if (!pl->oom) put_view(pl, v, p->views[kn->in[0]].buf, &g->nodes[kn->in[0]], &p->views[kn->in[0]]);
      if (!pl->oom) put_view(pl, v + VIEW_WORDS, k->out_buf, kn, &p->views[k->node]);
      if (pl->oom) goto oom;
      continue;
    }
    if (k->kind == CG_K_MATMUL || k->kind == CG_K_EAGER) {
      const ir_node *n = &g->nodes[k->node];
      int64_t ab, bb;
      char w[256];
      memcpy(&ab, &k->alpha, sizeof ab);
      memcpy(&bb, &k->beta, sizeof bb);
      if (k->kind == CG_K_MATMUL) put(pl, RT_K_MATMUL), put(pl, n->dtype), put(pl, ab), put(pl, bb);
      else put(pl, RT_K_GATHER), put(pl, n->dtype), put(pl, n->attrs.dim), put(pl, (int64_t)put_str(str, where(n, w, sizeof w)));
      size_t views = pl->n;
      for (int i = 0; i < 3 * VIEW_WORDS; i++) put(pl, 0);
      for (int j = 0; j < 2 && !pl->oom; j++)
        put_view(pl, views + (size_t)j * VIEW_WORDS, p->views[n->in[j]].buf, &g->nodes[n->in[j]], &p->views[n->in[j]]);
      if (!pl->oom) put_view(pl, views + 2 * VIEW_WORDS, k->out_buf, n, &p->views[k->node]);
      if (pl->oom) goto oom;
      continue;
    }
    bool staged = cg_staged(k);
    /* the record's codes come after it: reserve its words, then fill them */
    size_t len = 6 + (size_t)k->ndim + 1 + (size_t)k->n_param + 1 + 2 * (size_t)k->n_acc;
    for (size_t i = 0; i < len; i++) put(pl, 0);
    /* plain staged: an exported model's calls may come one at a time, and
     * the finer split of a small matvec pays only back to back (runtime.c) */
    int64_t head[6] = {RT_K_LOOP, loops++, k->split, staged, k->n_outer, k->ndim};
    int64_t dims[RT_MAXD], prm[256];
    for (int d = 0; d < k->ndim; d++) dims[d] = code(pl, k->dim[d]);
    for (int i = 0; i < k->n_param && i < 256; i++) prm[i] = code(pl, k->param[i]);
    if (pl->oom) goto oom;
    int64_t *r = pl->w + rec;
    memcpy(r, head, sizeof head);
    memcpy(r + 6, dims, sizeof *dims * (size_t)k->ndim);
    r += 6 + k->ndim;
    r[0] = k->n_param;
    memcpy(r + 1, prm, sizeof *prm * (size_t)k->n_param);
    r += 1 + k->n_param;
    r[0] = k->n_acc;
    for (int a = 0; a < k->n_acc; a++) r[1 + 2 * a] = k->acc[a].buf, r[2 + 2 * a] = cg_pointer_shift(k, a);
  }
  for (int i = 0; i < g->n_guards; i++) {
    char text[512];
    if (sym_guard_print(&g->guards[i], text, sizeof text) < 0) snprintf(text, sizeof text, "#%d", i);
    int64_t l = code(pl, g->guards[i].lhs), r = code(pl, g->guards[i].rhs), t = (int64_t)put_str(str, text);
    if (pl->oom) goto oom;
    size_t at = guards + (size_t)i * GUARD_WORDS;
    pl->w[at] = g->guards[i].op, pl->w[at + 1] = l, pl->w[at + 2] = r, pl->w[at + 3] = t;
  }
  alloc_free(cf_of);
  cf_of = NULL;
  h[PLAN_WORDS] = (int64_t)pl->n;
  if (pl->oom || str->oom || wt->oom) goto oom;
  memcpy(pl->w + base, h, sizeof h);
  *n_loops = loops;
  return 0;
oom:
  alloc_free(cf_of);
  return fail(err, errn, "out of memory (or a size expression too large for the runtime)");
}

static LLVMValueRef add_global(LLVMModuleRef m, LLVMValueRef init, const char *name, bool constant, unsigned align) {
  LLVMValueRef gv = LLVMAddGlobal(m, LLVMTypeOf(init), name);
  LLVMSetInitializer(gv, init);
  LLVMSetGlobalConstant(gv, constant);
  LLVMSetLinkage(gv, LLVMPrivateLinkage);
  LLVMSetAlignment(gv, align);
  return gv;
}

/* The header's shape text, "f32[s0, 784]". */
static void shape_text(const ir_node *n, char *buf, size_t bn) {
  size_t w = (size_t)snprintf(buf, bn, "%s[", kiln_dtype_name(n->dtype));
  for (int d = 0; d < n->ndim && w < bn; d++) {
    if (d) w += (size_t)snprintf(buf + w, bn - w, ", ");
    if (w < bn) {
      int k = sym_print(n->shape[d], buf + w, bn - w);
      w += k > 0 ? (size_t)k : 0;
    }
  }
  if (w < bn) snprintf(buf + w, bn - w, "]");
}

static int write_header(const ir_graph *g, const export_request *rq, const char *triple, const char *cpu, char *err,
                        size_t errn) {
  char path[4200];
  snprintf(path, sizeof path, "%s.h", rq->prefix);
  FILE *f = fopen(path, "w");
  if (!f) return fail(err, errn, "cannot open %s: %s", path, strerror(errno));
  const char *base = strrchr(rq->prefix, '/');
  base = base ? base + 1 : rq->prefix;
  int n_in = g->n_inputs + (rq->params_as_inputs ? g->n_params : 0);
  fprintf(f, "/* %s.h: the entry points of %s.o, written by kiln_export from %s (variant %d); do not edit.\n", base, base,
          g->name, rq->variant);
  fprintf(f, " * Target %s, cpu %s. Link: cc app.c %s.o -lkiln_rt -lopenblas -lm -lpthread\n *\n", triple, cpu, base);
  fprintf(f, " * %s_run(in, out): 0, or -1 with %s_error() saying why (an input that breaks the\n"
             " * guards below, out of memory). Buffers are row-major and contiguous; an out[i] whose\n"
             " * data is NULL is malloc'ed (free() it) and its shape filled in.\n *\n",
          rq->name, rq->name);
  if (g->n_syms) {
    fprintf(f, " * Sizes (bound from the inputs' shapes, any value the bounds and guards allow):\n");
    for (int s = 0; s < g->n_syms; s++)
      fprintf(f, " *   s%d in [%lld, %lld]\n", s, (long long)g->sym_lo[s], (long long)g->sym_hi[s]);
  }
  if (g->n_guards) {
    fprintf(f, " * Guards (a call that breaks one is an error):\n");
    for (int i = 0; i < g->n_guards; i++) {
      char text[512];
      if (sym_guard_print(&g->guards[i], text, sizeof text) >= 0) fprintf(f, " *   %s\n", text);
    }
  }
  fprintf(f, " * Inputs:\n");
  int width = 12; /* the names' column */
  for (int i = 0; i < n_in; i++) {
    char nm[160];
    input_name(g, rq, i, nm, sizeof nm);
    if ((int)strlen(nm) > width) width = (int)strlen(nm);
  }
  for (int i = 0; i < n_in; i++) {
    char nm[160], sh[512];
    input_name(g, rq, i, nm, sizeof nm);
    shape_text(input_node(g, rq, i), sh, sizeof sh);
    fprintf(f, " *   in[%d]  %-*s %s\n", i, width, nm, sh);
  }
  fprintf(f, " * Outputs:\n");
  for (int i = 0; i < g->n_outputs; i++) {
    char sh[512];
    shape_text(&g->nodes[g->outputs[i]], sh, sizeof sh);
    fprintf(f, " *   out[%d] %s\n", i, sh);
  }
  char guard[160];
  size_t gl = 0;
  for (const char *c = rq->name; *c && gl < sizeof guard - 8; c++) guard[gl++] = (char)toupper((unsigned char)*c);
  snprintf(guard + gl, sizeof guard - gl, "_H");
  fprintf(f, " */\n#ifndef %s\n#define %s\n\n#include \"kiln_rt.h\"\n\n#ifdef __cplusplus\nextern \"C\" {\n#endif\n\n", guard, guard);
  fprintf(f, "enum { %s_N_IN = %d, %s_N_OUT = %d };\n\n", rq->name, n_in, rq->name, g->n_outputs);
  fprintf(f, "int %s_run(const kiln_rt_buffer *in, kiln_rt_buffer *out);\nconst char *%s_error(void);\n\n", rq->name,
          rq->name);
  fprintf(f, "#ifdef __cplusplus\n}\n#endif\n\n#endif\n");
  if (fclose(f)) return fail(err, errn, "cannot write %s", path);
  return 0;
}

/* Adds g and, depth first, every region under it to us (grown); g's unit id, or -1 when out of memory. */
static int add_units(const ir_graph *g, unit **us, int *n, int *cap) {
  if (*n == *cap) {
    int c = *cap ? 2 * *cap : 8;
    unit *nu = alloc_realloc(*us, sizeof *nu * (size_t)c);
    if (!nu) return -1;
    *us = nu, *cap = c;
  }
  int id = (*n)++;
  (*us)[id] = (unit){.g = g, .header = -1};
  int (*sub)[2] = alloc_calloc((size_t)g->n_nodes + 1, sizeof *sub);
  if (!sub) return -1;
  (*us)[id].sub = sub;
  for (int i = 0; i < g->n_nodes; i++) {
    sub[i][0] = sub[i][1] = -1;
    for (int k = 0; k < ir_n_sub(g->nodes[i].op); k++) {
      int r = add_units(g->nodes[i].sub[k], us, n, cap);
      if (r < 0) return -1;
      (*us)[id].sub[i][k] = r;
    }
  }
  return id;
}

int export_graph(const ir_graph *g, const export_request *rq, char *err, size_t errn) {
  char why[256] = "";
  int rc = -1, n_loops = 0, n_units = 0, cap_units = 0, n_cf = 0;
  words pl = {0};
  bytes str = {0}, wt = {0};
  void *obj = NULL;
  size_t obj_len = 0;
  LLVMContextRef cx = NULL;
  LLVMModuleRef mod = NULL;
  LLVMTargetMachineRef tm = NULL;
  LLVMValueRef *fns = NULL;
  char **keys = NULL;
  unit *us = NULL;
  if (!(tm = jit_machine_for(rq->target, rq->cpu, err, errn))) goto done;
  if (add_units(g, &us, &n_units, &cap_units) < 0) {
    fail(err, errn, "out of memory");
    goto done;
  }
  for (int u = 0; u < n_units; u++) {
    char e[400];
    if ((us[u].p = fuse_graph(us[u].g, e, sizeof e)) && !refuse(us[u].g, us[u].p, rq, e, sizeof e)) continue;
    if (u) fail(err, errn, "region '%s': %s", us[u].g->name, e);
    else fail(err, errn, "%s", e);
    goto done;
  }
  LLVMTargetDataRef td = LLVMCreateTargetDataLayout(tm);
  unsigned ptr_bytes = LLVMPointerSize(td);
  bool little = LLVMByteOrder(td) == LLVMLittleEndian;
  char *triple = LLVMGetTargetMachineTriple(tm), *cpu = LLVMGetTargetMachineCPU(tm);
  cx = LLVMContextCreate();
  mod = LLVMModuleCreateWithNameInContext(rq->name, cx);
  LLVMSetTarget(mod, triple);
  LLVMSetModuleDataLayout(mod, td);
  LLVMDisposeTargetData(td);
  if (ptr_bytes != 8 || !little) {
    fail(err, errn, "target %s: the runtime takes 64-bit little-endian targets", triple);
    goto done_names;
  }
  LLVMTypeRef i64 = LLVMInt64TypeInContext(cx), i8 = LLVMInt8TypeInContext(cx), i32 = LLVMInt32TypeInContext(cx);
  LLVMTypeRef ptr = LLVMPointerTypeInContext(cx, 0);
  for (int u = 0; u < n_units; u++)
    for (int ki = 0; ki < us[u].p->n_k; ki++) n_loops += us[u].p->k[ki].kind == CG_K_LOOP;
  fns = alloc_calloc((size_t)n_loops + 1, sizeof *fns);
  keys = alloc_calloc((size_t)n_loops + 1, sizeof *keys);
  if (!fns || !keys) {
    fail(err, errn, "out of memory");
    goto done_names;
  }
  /* every unit's loop kernels in one module, numbered in unit order */
  for (int u = 0, at = 0; u < n_units; u++)
    for (int ki = 0; ki < us[u].p->n_k; ki++) {
      cg_kernel *k = &us[u].p->k[ki];
      if (k->kind != CG_K_LOOP) continue;
      k->own_vectors = false; /* the target's vectorizer picks the widths */
      if (lower_kernel(us[u].p, k, mod, why, sizeof why)) {
        fail(err, errn, "lowering failed: %s", why[0] ? why : k->name);
        goto done_names;
      }
      LLVMValueRef fn = LLVMGetNamedFunction(mod, k->name);
      if (!fn) {
        fail(err, errn, "kernel %s not found after lowering", k->name);
        goto done_names;
      }
      /* a kernel whose code an earlier one has (a repeated layer) runs that
       * one's with its own sizes in p, as in the JIT (equal keys, equal code) */
      keys[at] = kernel_key(fn, k, false);
      int twin = -1;
      for (int j = 0; j < at && keys[at] && twin < 0; j++)
        if (keys[j] && !strcmp(keys[j], keys[at])) twin = j;
      if (twin >= 0) {
        LLVMDeleteFunction(fn);
        fns[at++] = fns[twin];
        continue;
      }
      char nm[160];
      if (u) snprintf(nm, sizeof nm, "%s.r%d.%s", rq->name, u, k->name);
      else snprintf(nm, sizeof nm, "%s.%s", rq->name, k->name);
      LLVMSetValueName2(fn, nm, strlen(nm));
      LLVMSetLinkage(fn, LLVMInternalLinkage);
      /* lowering tunes for the host's vector width; the target chooses its own */
      LLVMRemoveStringAttributeAtIndex(fn, LLVMAttributeFunctionIndex, "prefer-vector-width", 19);
      fns[at++] = fn;
    }
  /* the plan (after lowering: it fills in each kernel's parameters), what it
   * points at, then the model and the two entry points */
  int loops = 0;
  for (int u = 0; u < n_units; u++) {
    us[u].header = (int64_t)pl.n;
    if (build_plan(&us[u], rq, &pl, &str, &wt, &loops, &n_cf, err, errn)) goto done_names;
  }
  /* the top's header: the units' table and counts, the plan's length */
  size_t unit_table = pl.n;
  for (int u = 0; u < n_units; u++) put(&pl, us[u].header);
  if (pl.oom) {
    fail(err, errn, "out of memory");
    goto done_names;
  }
  pl.w[PLAN_NUNIT] = n_units, pl.w[PLAN_UNITS] = (int64_t)unit_table, pl.w[PLAN_NCF] = n_cf;
  pl.w[PLAN_WORDS] = (int64_t)pl.n;
  char nm[160];
  snprintf(nm, sizeof nm, "%s.plan", rq->name);
  LLVMValueRef *pw = alloc_malloc(pl.n * sizeof *pw);
  if (!pw) {
    fail(err, errn, "out of memory");
    goto done_names;
  }
  for (size_t i = 0; i < pl.n; i++) pw[i] = LLVMConstInt(i64, (unsigned long long)pl.w[i], 1);
  LLVMValueRef plan = add_global(mod, LLVMConstArray2(i64, pw, pl.n), nm, true, 8);
  alloc_free(pw);
  snprintf(nm, sizeof nm, "%s.strings", rq->name);
  LLVMValueRef strings = add_global(mod, LLVMConstStringInContext2(cx, str.b ? str.b : "", str.n, 1), nm, true, 1);
  snprintf(nm, sizeof nm, "%s.weights", rq->name);
  LLVMValueRef weights = add_global(mod, LLVMConstStringInContext2(cx, wt.b ? wt.b : "", wt.n, 1), nm, true, 64);
  snprintf(nm, sizeof nm, "%s.kernels", rq->name);
  LLVMValueRef table = add_global(mod, n_loops ? LLVMConstArray2(ptr, fns, (uint64_t)n_loops) : LLVMConstNull(LLVMArrayType2(ptr, 1)),
                                  nm, true, 8);
  snprintf(nm, sizeof nm, "%s.state", rq->name);
  LLVMValueRef state = add_global(mod, LLVMConstNull(LLVMArrayType2(i64, RT_STATE_WORDS)), nm, false, 8);
  LLVMValueRef fields[5] = {plan, strings, table, weights, state};
  snprintf(nm, sizeof nm, "%s.model", rq->name);
  LLVMValueRef model = add_global(mod, LLVMConstStructInContext(cx, fields, 5, 0), nm, true, 8);
  LLVMTypeRef run_args[3] = {ptr, ptr, ptr};
  LLVMTypeRef rt_run_t = LLVMFunctionType(i32, run_args, 3, 0), run_t = LLVMFunctionType(i32, run_args, 2, 0);
  LLVMTypeRef err_t = LLVMFunctionType(ptr, NULL, 0, 0);
  LLVMValueRef rt_run = LLVMAddFunction(mod, "kiln_rt_run", rt_run_t), rt_err = LLVMAddFunction(mod, "kiln_rt_error", err_t);
  LLVMBuilderRef b = LLVMCreateBuilderInContext(cx);
  snprintf(nm, sizeof nm, "%s_run", rq->name);
  LLVMValueRef run = LLVMAddFunction(mod, nm, run_t);
  LLVMPositionBuilderAtEnd(b, LLVMAppendBasicBlockInContext(cx, run, "entry"));
  LLVMValueRef args[3] = {model, LLVMGetParam(run, 0), LLVMGetParam(run, 1)};
  LLVMBuildRet(b, LLVMBuildCall2(b, rt_run_t, rt_run, args, 3, ""));
  snprintf(nm, sizeof nm, "%s_error", rq->name);
  LLVMValueRef errf = LLVMAddFunction(mod, nm, err_t);
  LLVMPositionBuilderAtEnd(b, LLVMAppendBasicBlockInContext(cx, errf, "entry"));
  LLVMBuildRet(b, LLVMBuildCall2(b, err_t, rt_err, NULL, 0, ""));
  LLVMDisposeBuilder(b);
  (void)i8;
  if (jit_emit_for(mod, tm, &obj, &obj_len, err, errn)) goto done_names;
  char path[4200];
  snprintf(path, sizeof path, "%s.o", rq->prefix);
  FILE *f = fopen(path, "wb");
  if (!f) {
    fail(err, errn, "cannot open %s: %s", path, strerror(errno));
    goto done_names;
  }
  size_t wrote = fwrite(obj, 1, obj_len, f);
  if (fclose(f) || wrote != obj_len) {
    fail(err, errn, "cannot write %s", path);
    goto done_names;
  }
  rc = write_header(g, rq, triple, cpu, err, errn);
done_names:
  LLVMDisposeMessage(triple);
  LLVMDisposeMessage(cpu);
done:
  alloc_free(obj);
  for (int i = 0; keys && i < n_loops; i++) alloc_free(keys[i]);
  alloc_free(keys);
  alloc_free(fns);
  alloc_free(pl.w), alloc_free(str.b), alloc_free(wt.b);
  if (mod) LLVMDisposeModule(mod);
  if (cx) LLVMContextDispose(cx);
  if (tm) LLVMDisposeTargetMachine(tm);
  for (int u = 0; us && u < n_units; u++) cg_program_free(us[u].p), alloc_free(us[u].sub);
  alloc_free(us);
  return rc;
}
