/* Reverse-mode autograd. An op whose inputs require grad records a node: edges
 * to the nodes (or leaves) of its inputs, the input metadata, and only the
 * values its backward needs (an output is saved as a storage-sharing view
 * with no history, so nothing points back at itself). Backward walks the
 * nodes in dependency order; every formula is written with the public ops, so
 * a tracer that watches dispatch records backward like any other code. */
#include <math.h>
#include <string.h>

#include "eager/eager.h"

static KILN_TLS_HOT int no_grad_depth;

bool grad_mode(void) { return no_grad_depth == 0; }
int grad_depth(void) { return no_grad_depth; }
void kiln_no_grad_begin(void) { no_grad_depth++; }
void kiln_no_grad_end(void) {
  if (no_grad_depth > 0) no_grad_depth--;
}
bool kiln_grad_enabled(void) { return grad_mode(); }
int grad_mode_force_on(void) {
  int depth = no_grad_depth;
  no_grad_depth = 0;
  return depth;
}
void grad_mode_restore(int depth) { no_grad_depth = depth; }

/* ---- nodes ---- */

typedef struct ag_input {
  kiln_dtype dtype;
  int ndim;
  int64_t shape[MAXD];
  bool need;        /* requires grad: the backward computes its gradient */
  ag_node *next;    /* the node that made it (retained), or */
  kiln_tensor *leaf; /* the leaf it is (retained) */
  int slot;         /* next is a multi-output node: which of its outputs this is */
  uint64_t src_serial, src_call; /* the input tensor's serial and recording tag (shape_src) */
  int src_id;
} ag_input;

struct ag_extra {
  ag_input *inputs; /* n_in of them */
  kiln_tensor *saved_out;
  unsigned long out_version;
  unsigned long epoch; /* the backward that last visited it */
  /* a multi-output node (ag_record_multi): its formula, and per output the
   * gradient so far; its results' own nodes are single-output "gets" (op
   * OP_COUNT) whose one input is it */
  const ag_multi_ops *multi;
  void *multi_data;
  bool get;      /* passes its gradient to output slot of its one input */
  int n_out;
  kiln_tensor **accs;
};

/* The extra block lives right after the node; the struct in eager.h keeps
 * only what the tracer may read. */
typedef struct node_full {
  ag_node n;
  struct ag_extra x;
} node_full;
#define EXTRA(nd) (&((node_full *)(nd))->x)

/* A zeroed node with its n inputs' arrays (saved inputs, their versions,
 * the inputs' records) in the same block: one allocation an op, not four,
 * and ag_node_release frees them with the node. */
static node_full *node_alloc(int n) {
  size_t k = (size_t)n + 1;
  node_full *f = alloc_calloc(1, sizeof *f + k * (sizeof *f->x.inputs + sizeof *f->n.in + sizeof *f->n.version));
  if (!f) return NULL;
  char *p = (char *)(f + 1);
  f->x.inputs = (ag_input *)p;
  p += k * sizeof *f->x.inputs;
  f->n.in = (kiln_tensor **)p;
  p += k * sizeof *f->n.in;
  f->n.version = (unsigned long *)p;
  return f;
}

static void node_free_saved(ag_node *nd) {
  for (int i = 0; nd->in && i < nd->n_in; i++) {
    kiln_release(nd->in[i]);
    nd->in[i] = NULL;
  }
}


void ag_node_release(ag_node *nd) {
  if (!nd || atomic_fetch_sub(&nd->refcount, 1) != 1) return;
  /* iterative: a long chain of nodes must not overflow the C stack */
  ag_node *stack_small[64], **stack = stack_small;
  int sp = 0, cap = 64;
  stack[sp++] = nd;
  while (sp) {
    ag_node *n = stack[--sp];
    struct ag_extra *x = EXTRA(n);
    node_free_saved(n);
    kiln_release(x->saved_out);
    for (int i = 0; x->inputs && i < n->n_in; i++) { /* NULL: recording ran out of memory */
      kiln_release(x->inputs[i].leaf);
      ag_node *c = x->inputs[i].next;
      if (c && atomic_fetch_sub(&c->refcount, 1) == 1) {
        if (sp == cap) {
          ag_node **ns = alloc_malloc(sizeof *ns * (size_t)cap * 2);
          if (!ns) continue; /* out of memory while freeing: leak this branch rather than crash */
          memcpy(ns, stack, sizeof *ns * (size_t)sp);
          if (stack != stack_small) alloc_free(stack);
          stack = ns;
          cap *= 2;
        }
        stack[sp++] = c;
      }
    }
    kiln_release(n->acc);
    for (int k = 0; k < x->n_out; k++) kiln_release(x->accs[k]);
    alloc_free(x->accs);
    if (x->multi && x->multi->free) x->multi->free(x->multi_data);
    alloc_free(n); /* its arrays with it (node_alloc) */
  }
  if (stack != stack_small) alloc_free(stack);
}

static bool differentiable(op_id op);

int ag_record(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out, const char *file,
              int line) {
  if (!grad_mode() || !differentiable(op) || !dtype_is_float(out->dtype)) return 0;
  bool any = false;
  for (int i = 0; i < n; i++) any |= in[i]->requires_grad;
  if (!any) return 0;
  node_full *f = node_alloc(n);
  if (!f) return err_set(file, line, op_table[op].name, "out of memory recording for autograd"), -1;
  ag_node *nd = &f->n;
  atomic_init(&nd->refcount, 1);
  nd->op = op;
  if (a) nd->attrs = *a;
  nd->n_in = n;
  nd->file = file;
  nd->line = line;
  nd->out_dtype = out->dtype;
  nd->out_ndim = out->ndim;
  memcpy(nd->out_shape, out->shape, sizeof nd->out_shape);
  unsigned sv = op_table[op].saves; /* S_IN<i> is bit i, S_OUT bit 7 */
  if (sv & S_OUT) f->x.saved_out = tensor_view(out, out->ndim, out->shape, out->stride, out->offset);
  if ((sv & S_OUT) && !f->x.saved_out) {
    ag_node_release(nd);
    return err_set(file, line, op_table[op].name, "out of memory recording for autograd"), -1;
  }
  f->x.out_version = atomic_load(&out->st->version);
  for (int i = 0; i < n; i++) {
    ag_input *ai = &f->x.inputs[i];
    ai->dtype = in[i]->dtype;
    ai->ndim = in[i]->ndim;
    memcpy(ai->shape, in[i]->shape, sizeof ai->shape);
    ai->src_serial = in[i]->serial, ai->src_call = in[i]->rec_call, ai->src_id = in[i]->rec_id;
    ai->need = in[i]->requires_grad && dtype_is_float(in[i]->dtype);
    if (ai->need) {
      if (in[i]->grad_fn) {
        ai->next = in[i]->grad_fn;
        atomic_fetch_add(&ai->next->refcount, 1);
      } else {
        ai->leaf = kiln_retain(in[i]);
      }
    }
    if (i < 7 && (sv & (1u << i))) {
      nd->in[i] = kiln_retain(in[i]);
      nd->version[i] = atomic_load(&in[i]->st->version);
    }
  }
  out->grad_fn = nd;
  out->requires_grad = true;
  return 0;
}

/* A bare node of n inputs (the multi-output node's and its gets'). */
static node_full *node_bare(int n, const char *file, int line) {
  node_full *f = node_alloc(n);
  if (!f) return NULL;
  atomic_init(&f->n.refcount, 1);
  f->n.op = OP_COPY; /* never indexes the formulas: multi and get are asked first */
  f->n.n_in = n;
  f->n.file = file;
  f->n.line = line;
  return f;
}

static void input_of(ag_input *ai, const kiln_tensor *t) {
  ai->dtype = t->dtype;
  ai->ndim = t->ndim;
  memcpy(ai->shape, t->shape, sizeof ai->shape);
  ai->need = t->requires_grad && dtype_is_float(t->dtype);
  if (!ai->need) return;
  if (t->grad_fn) {
    ai->next = t->grad_fn;
    atomic_fetch_add(&ai->next->refcount, 1);
  } else {
    ai->leaf = kiln_retain((kiln_tensor *)t);
  }
}

int ag_record_multi(const ag_multi_ops *ops, void *data, kiln_tensor *const *in, int n_in, kiln_tensor *const *out,
                    int n_out, const char *file, int line) {
  node_full *m = node_bare(n_in, file, line);
  if (m) m->x.accs = alloc_calloc((size_t)n_out + 1, sizeof *m->x.accs);
  if (!m || !m->x.accs) {
    if (m) ag_node_release(&m->n);
    if (ops->free) ops->free(data);
    return err_set(file, line, "autograd", "out of memory recording for autograd"), -1;
  }
  m->x.multi = ops;
  m->x.multi_data = data;
  m->x.n_out = n_out;
  for (int i = 0; i < n_in; i++) input_of(&m->x.inputs[i], in[i]);
  int rc = 0;
  for (int k = 0; k < n_out && !rc; k++) {
    kiln_tensor *t = out[k];
    if (!dtype_is_float(t->dtype)) continue;
    node_full *g = node_bare(1, file, line);
    if (!g) {
      err_set(file, line, "autograd", "out of memory recording for autograd");
      rc = -1;
      break;
    }
    g->x.get = true;
    g->n.out_dtype = t->dtype;
    g->n.out_ndim = t->ndim;
    memcpy(g->n.out_shape, t->shape, sizeof g->n.out_shape);
    ag_input *ai = &g->x.inputs[0];
    ai->dtype = t->dtype;
    ai->ndim = t->ndim;
    memcpy(ai->shape, t->shape, sizeof ai->shape);
    ai->need = true;
    ai->next = &m->n;
    ai->slot = k;
    atomic_fetch_add(&m->n.refcount, 1);
    ag_node_release(t->grad_fn);
    t->grad_fn = &g->n;
    t->requires_grad = true;
  }
  ag_node_release(&m->n);
  return rc;
}

static int while_backward(void *data, kiln_tensor *const *gout, kiln_tensor **gin, const char *file, int line) {
  (void)data, (void)gout, (void)gin;
  return err_set(file, line, "while_loop",
                 "a backward reached kiln_while_loop, which is forward only (its trip count depends on data): use "
                 "kiln_scan over a fixed length, or run the loop under kiln_no_grad"),
         -1;
}

int ag_forward_only(kiln_tensor *const *out, int n_out, const char *file, int line) {
  static const ag_multi_ops ops = {while_backward, NULL};
  return ag_record_multi(&ops, NULL, NULL, 0, out, n_out, file, line);
}

/* ---- backward formulas (public ops, reported at the forward op's line) ---- */

#define AT nd->file, nd->line
#define IN(i) (EXTRA(nd)->inputs[i])
#define OUT (EXTRA(nd)->saved_out)

static kiln_tensor *scal(kiln_dtype dt, double v, ag_node *nd) { return kiln_scalar_at(dt, v, AT); }

/* Sums g over the dims broadcasting stretched, back to (ndim, shape). */
static kiln_tensor *reduce_to(kiln_tensor *g, int ndim, const int64_t *shape, ag_node *nd) {
  if (!g) return NULL;
  int lead = g->ndim - ndim, axes[MAXD], na = 0;
  for (int i = 0; i < g->ndim; i++)
    if (i < lead || (shape[i - lead] == 1 && g->shape[i] != 1)) axes[na++] = i;
  if (na == 0 && lead == 0) return g;
  kiln_tensor *s = na ? kiln_sum_axes_at(g, axes, na, true, AT) : g;
  return kiln_reshape_at(s, ndim, shape, AT);
}
#define REDUCE_IN(g, i) reduce_to((g), IN(i).ndim, IN(i).shape, nd)

/* The node whose formula runs on this thread (NULL: none). */
static _Thread_local ag_node *formula_of;

void ag_shape_begin(const int64_t *shape) {
  ag_node *nd = formula_of;
  if (!nd || !shape) return;
  const trace_hooks *h = dispatch_hooks();
  if (!h || !h->shape_src) return;
  for (int i = 0; i < nd->n_in; i++)
    if (shape == IN(i).shape) {
      h->shape_src(h->ctx, IN(i).src_serial, IN(i).src_call, IN(i).src_id);
      return;
    }
}
void ag_shape_end(void) {
  const trace_hooks *h = formula_of ? dispatch_hooks() : NULL;
  if (h && h->shape_src) h->shape_src(h->ctx, 0, 0, -1);
}

static int bw_add(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  if (IN(0).need) gin[0] = REDUCE_IN(g, 0);
  if (IN(1).need) gin[1] = REDUCE_IN(g, 1);
  return 0;
}
static int bw_sub(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  if (IN(0).need) gin[0] = REDUCE_IN(g, 0);
  if (IN(1).need) gin[1] = REDUCE_IN(kiln_neg_at(g, AT), 1);
  return 0;
}
static int bw_mul(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  if (IN(0).need) gin[0] = REDUCE_IN(kiln_mul_at(g, nd->in[1], AT), 0);
  if (IN(1).need) gin[1] = REDUCE_IN(kiln_mul_at(g, nd->in[0], AT), 1);
  return 0;
}
static int bw_div(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *a = nd->in[0], *b = nd->in[1];
  kiln_tensor *gb = kiln_div_at(g, b, AT);
  if (IN(0).need) gin[0] = REDUCE_IN(gb, 0);
  if (IN(1).need) gin[1] = REDUCE_IN(kiln_neg_at(kiln_div_at(kiln_mul_at(gb, a, AT), b, AT), AT), 1);
  return 0;
}
static int bw_pow(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *a = nd->in[0], *b = nd->in[1];
  kiln_dtype dt = nd->out_dtype;
  if (IN(0).need) {
    kiln_tensor *p = kiln_pow_at(a, kiln_sub_at(b, scal(dt, 1, nd), AT), AT);
    gin[0] = REDUCE_IN(kiln_mul_at(g, kiln_mul_at(b, p, AT), AT), 0);
  }
  if (IN(1).need) {
    /* d/db a^b = a^b log a; taken as 0 where a <= 0 (as torch does at a == 0) */
    kiln_tensor *pos = kiln_gt_at(a, scal(dt, 0, nd), AT);
    kiln_tensor *safe = kiln_where_at(pos, a, scal(dt, 1, nd), AT);
    kiln_tensor *t = kiln_mul_at(g, kiln_mul_at(OUT, kiln_log_at(safe, AT), AT), AT);
    gin[1] = REDUCE_IN(kiln_where_at(pos, t, scal(dt, 0, nd), AT), 1);
  }
  return 0;
}
/* maximum/minimum: the gradient goes to the chosen input, split evenly on ties */
static int bw_extremum(ag_node *nd, kiln_tensor *g, kiln_tensor **gin, bool is_max) {
  kiln_tensor *a = nd->in[0], *b = nd->in[1];
  kiln_dtype dt = nd->out_dtype;
  kiln_tensor *wins = is_max ? kiln_gt_at(a, b, AT) : kiln_lt_at(a, b, AT);
  kiln_tensor *ties = kiln_eq_at(a, b, AT);
  kiln_tensor *wa = kiln_add_at(kiln_cast_at(wins, dt, AT),
                                kiln_mul_at(kiln_cast_at(ties, dt, AT), scal(dt, 0.5, nd), AT), AT);
  if (IN(0).need) gin[0] = REDUCE_IN(kiln_mul_at(g, wa, AT), 0);
  if (IN(1).need) gin[1] = REDUCE_IN(kiln_mul_at(g, kiln_sub_at(scal(dt, 1, nd), wa, AT), AT), 1);
  return 0;
}
static int bw_maximum(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) { return bw_extremum(nd, g, gin, true); }
static int bw_minimum(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) { return bw_extremum(nd, g, gin, false); }
static int bw_where(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *zero = scal(nd->out_dtype, 0, nd);
  if (IN(1).need) gin[1] = REDUCE_IN(kiln_where_at(nd->in[0], g, zero, AT), 1);
  if (IN(2).need) gin[2] = REDUCE_IN(kiln_where_at(nd->in[0], zero, g, AT), 2);
  return 0;
}
static int bw_neg(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_neg_at(g, AT);
  return 0;
}
static int bw_abs(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *x = nd->in[0], *z = scal(nd->out_dtype, 0, nd);
  kiln_tensor *sign = kiln_sub_at(kiln_cast_at(kiln_gt_at(x, z, AT), nd->out_dtype, AT),
                                  kiln_cast_at(kiln_lt_at(x, z, AT), nd->out_dtype, AT), AT);
  gin[0] = kiln_mul_at(g, sign, AT);
  return 0;
}
static int bw_exp(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_mul_at(g, OUT, AT);
  return 0;
}
static int bw_log(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_div_at(g, nd->in[0], AT);
  return 0;
}
static int bw_sqrt(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_div_at(kiln_mul_at(g, scal(nd->out_dtype, 0.5, nd), AT), OUT, AT);
  return 0;
}
static int bw_rsqrt(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *y3 = kiln_mul_at(kiln_mul_at(OUT, OUT, AT), OUT, AT);
  gin[0] = kiln_mul_at(kiln_mul_at(g, scal(nd->out_dtype, -0.5, nd), AT), y3, AT);
  return 0;
}
static int bw_tanh(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *d = kiln_sub_at(scal(nd->out_dtype, 1, nd), kiln_mul_at(OUT, OUT, AT), AT);
  gin[0] = kiln_mul_at(g, d, AT);
  return 0;
}
static int bw_sigmoid(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *d = kiln_mul_at(OUT, kiln_sub_at(scal(nd->out_dtype, 1, nd), OUT, AT), AT);
  gin[0] = kiln_mul_at(g, d, AT);
  return 0;
}
static int bw_relu(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *z = scal(nd->out_dtype, 0, nd);
  gin[0] = kiln_where_at(kiln_gt_at(OUT, z, AT), g, z, AT);
  return 0;
}
static int bw_gelu(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  /* y = x/2 (1 + tanh u), u = C (x + A x^3):
   * dy/dx = (1 + t)/2 + x/2 (1 - t^2) C (1 + 3 A x^2) */
  kiln_dtype dt = nd->out_dtype;
  const double C = 0.7978845608028654, A = 0.044715;
  kiln_tensor *x = nd->in[0], *x2 = kiln_mul_at(x, x, AT);
  kiln_tensor *u = kiln_mul_at(scal(dt, C, nd), kiln_add_at(x, kiln_mul_at(scal(dt, A, nd), kiln_mul_at(x2, x, AT), AT), AT), AT);
  kiln_tensor *t = kiln_tanh_at(u, AT), *half = scal(dt, 0.5, nd), *one = scal(dt, 1, nd);
  kiln_tensor *left = kiln_mul_at(half, kiln_add_at(one, t, AT), AT);
  kiln_tensor *du = kiln_mul_at(scal(dt, C, nd), kiln_add_at(one, kiln_mul_at(scal(dt, 3 * A, nd), x2, AT), AT), AT);
  kiln_tensor *right = kiln_mul_at(kiln_mul_at(half, x, AT), kiln_mul_at(kiln_sub_at(one, kiln_mul_at(t, t, AT), AT), du, AT), AT);
  gin[0] = kiln_mul_at(g, kiln_add_at(left, right, AT), AT);
  return 0;
}
static int bw_gelu_erf(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  /* d/dx x Phi(x) = Phi(x) + x phi(x) */
  kiln_dtype dt = nd->out_dtype;
  kiln_tensor *x = nd->in[0];
  kiln_tensor *cdf = kiln_mul_at(scal(dt, 0.5, nd), kiln_add_at(scal(dt, 1, nd), kiln_erf_at(kiln_mul_at(x, scal(dt, M_SQRT1_2, nd), AT), AT), AT), AT);
  kiln_tensor *pdf = kiln_mul_at(scal(dt, 0.3989422804014327, nd), kiln_exp_at(kiln_mul_at(kiln_mul_at(x, x, AT), scal(dt, -0.5, nd), AT), AT), AT);
  gin[0] = kiln_mul_at(g, kiln_add_at(cdf, kiln_mul_at(x, pdf, AT), AT), AT);
  return 0;
}
static int bw_erf(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_dtype dt = nd->out_dtype;
  kiln_tensor *x = nd->in[0];
  kiln_tensor *d = kiln_mul_at(scal(dt, M_2_SQRTPI, nd), kiln_exp_at(kiln_neg_at(kiln_mul_at(x, x, AT), AT), AT), AT);
  gin[0] = kiln_mul_at(g, d, AT);
  return 0;
}
static int bw_sin(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_mul_at(g, kiln_cos_at(nd->in[0], AT), AT);
  return 0;
}
static int bw_cos(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_neg_at(kiln_mul_at(g, kiln_sin_at(nd->in[0], AT), AT), AT);
  return 0;
}
static int bw_silu(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  /* d/dx x s(x) = s (1 + x (1 - s)) */
  kiln_dtype dt = nd->out_dtype;
  kiln_tensor *x = nd->in[0], *s = kiln_sigmoid_at(x, AT), *one = scal(dt, 1, nd);
  kiln_tensor *d = kiln_mul_at(s, kiln_add_at(one, kiln_mul_at(x, kiln_sub_at(one, s, AT), AT), AT), AT);
  gin[0] = kiln_mul_at(g, d, AT);
  return 0;
}
static int bw_softplus(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  /* sigmoid(x), and exactly 1 past the threshold, where softplus is x */
  kiln_tensor *x = nd->in[0];
  kiln_tensor *past = kiln_gt_at(x, scal(nd->out_dtype, 20, nd), AT);
  gin[0] = kiln_where_at(past, g, kiln_mul_at(g, kiln_sigmoid_at(x, AT), AT), AT);
  return 0;
}
static int bw_log1p(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_div_at(g, kiln_add_at(nd->in[0], scal(nd->out_dtype, 1, nd), AT), AT);
  return 0;
}
static int bw_expm1(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_mul_at(g, kiln_add_at(OUT, scal(nd->out_dtype, 1, nd), AT), AT);
  return 0;
}
/* floor, ceil, round, sign: zero almost everywhere, as torch (where, not
 * g * 0, so that an infinite g gives 0, not nan) */
static int bw_zero(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_where_at(scal(KILN_BOOL, 0, nd), g, scal(nd->out_dtype, 0, nd), AT);
  return 0;
}
/* g where x was inside [lo, hi] (the bounds included, as torch), else 0 */
static int bw_clamp(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_where_at(kiln_eq_at(OUT, nd->in[0], AT), g, scal(nd->out_dtype, 0, nd), AT);
  return 0;
}
static int bw_leaky_relu(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_dtype dt = nd->out_dtype;
  kiln_tensor *pos = kiln_gt_at(nd->in[0], scal(dt, 0, nd), AT);
  gin[0] = kiln_where_at(pos, g, kiln_mul_at(g, scal(dt, nd->attrs.value, nd), AT), AT);
  return 0;
}
static int bw_cast(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_cast_at(g, IN(0).dtype, AT);
  return 0;
}
static int bw_copy(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  (void)nd;
  gin[0] = g;
  return 0;
}
/* g with the reduced axes put back as size-1 dims, then expanded to the input */
static kiln_tensor *unreduce(ag_node *nd, kiln_tensor *g) {
  int64_t kshape[MAXD];
  for (int i = 0, j = 0; i < IN(0).ndim; i++) {
    bool red = j < nd->attrs.naxes && nd->attrs.axes[j] == i;
    if (red) j++;
    kshape[i] = red ? 1 : IN(0).shape[i];
  }
  kiln_tensor *k = kiln_reshape_at(g, IN(0).ndim, kshape, AT);
  return kiln_expand_at(k, IN(0).ndim, IN(0).shape, AT);
}
static int bw_sum(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = unreduce(nd, g);
  return 0;
}
static int bw_mean(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  /* the count comes from the expanded gradient's shape: the input is not saved */
  kiln_tensor *e = unreduce(nd, g);
  gin[0] = e ? kiln_div_at(e, numel_scalar(e, nd->attrs.axes, nd->attrs.naxes, 0, nd->out_dtype, AT), AT) : NULL;
  return 0;
}
static int bw_maxmin(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  /* to every element equal to the extremum, shared evenly between ties */
  kiln_tensor *mask = kiln_eq_at(nd->in[0], unreduce(nd, OUT), AT);
  kiln_tensor *m = kiln_cast_at(mask, nd->out_dtype, AT);
  kiln_tensor *cnt = kiln_sum_axes_at(m, nd->attrs.axes, nd->attrs.naxes, true, AT);
  kiln_tensor *share = kiln_div_at(unreduce(nd, g), kiln_expand_at(cnt, IN(0).ndim, IN(0).shape, AT), AT);
  gin[0] = kiln_mul_at(share, m, AT);
  return 0;
}
static int bw_matmul(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *a = nd->in[0], *b = nd->in[1];
  /* 1-D operands as matrices, and g with their dims put back */
  kiln_tensor *a2 = a->ndim == 1 ? kiln_unsqueeze_at(a, 0, AT) : a;
  kiln_tensor *b2 = b->ndim == 1 ? kiln_unsqueeze_at(b, 1, AT) : b;
  kiln_tensor *g2 = g;
  if (a->ndim == 1) g2 = kiln_unsqueeze_at(g2, b->ndim == 1 ? 0 : g->ndim - 1, AT);
  if (b->ndim == 1) g2 = kiln_unsqueeze_at(g2, -1, AT);
  if (IN(0).need) {
    kiln_tensor *ga = kiln_matmul_at(g2, kiln_transpose_at(b2, -1, -2, AT), AT);
    ga = reduce_to(ga, a2->ndim, a2->shape, nd);
    gin[0] = kiln_reshape_at(ga, IN(0).ndim, IN(0).shape, AT);
  }
  /* a matrix shared by a batch (x (B,T,C) @ w): the sum over the batch of
   * a_i^T g_i is one GEMM of the batch's rows stacked, (B*T,C)^T @ (B*T,N),
   * not B products and a (B,C,N) temporary summed afterwards; an operand
   * not laid out as rows is copied first when that copy is no larger than
   * the temporary (T <= N for a, T <= C for g: an expanded gradient, say) */
  int64_t t_rows = a2->ndim > 2 ? a2->shape[a2->ndim - 2] : 0;
  if (IN(1).need && b2->ndim == 2 && a2->ndim > 2 && g2 && g2->ndim == a2->ndim &&
      (tensor_contiguous(a2) || t_rows <= b2->shape[1]) && (tensor_contiguous(g2) || t_rows <= b2->shape[0])) {
    int64_t rows = 1, ka = a2->shape[a2->ndim - 1], n = g2->shape[g2->ndim - 1];
    for (int i = 0; i < a2->ndim - 1; i++) rows *= a2->shape[i];
    kiln_tensor *af = kiln_reshape_at(a2, 2, ((int64_t[]){rows, ka}), AT);
    kiln_tensor *gf = kiln_reshape_at(g2, 2, ((int64_t[]){rows, n}), AT);
    kiln_tensor *gb = kiln_matmul_at(kiln_transpose_at(af, 0, 1, AT), gf, AT);
    gin[1] = kiln_reshape_at(gb, IN(1).ndim, IN(1).shape, AT);
  } else if (IN(1).need) {
    kiln_tensor *gb = kiln_matmul_at(kiln_transpose_at(a2, -1, -2, AT), g2, AT);
    gb = reduce_to(gb, b2->ndim, b2->shape, nd);
    gin[1] = kiln_reshape_at(gb, IN(1).ndim, IN(1).shape, AT);
  }
  return 0;
}
static int bw_reshape(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_reshape_at(g, IN(0).ndim, IN(0).shape, AT);
  return 0;
}
static int bw_permute(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  int inv[MAXD];
  for (int i = 0; i < IN(0).ndim; i++) inv[nd->attrs.perm[i]] = i;
  gin[0] = kiln_permute_at(g, inv, AT);
  return 0;
}
static int bw_expand(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = REDUCE_IN(g, 0);
  return 0;
}
static kiln_tensor *slice_scatter(kiln_tensor *base, kiln_tensor *src, const op_attrs *a, ag_node *nd) {
  kiln_tensor *in[2] = {base, src};
  return op_dispatch(OP_SLICE_SCATTER, in, 2, a, AT);
}
static int bw_slice(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = slice_scatter(kiln_zeros_at(IN(0).dtype, IN(0).ndim, IN(0).shape, AT), g, &nd->attrs, nd);
  return 0;
}
static int bw_cat(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  int64_t at = 0;
  for (int i = 0; i < nd->n_in; i++) {
    int64_t len = IN(i).shape[nd->attrs.dim];
    if (IN(i).need) gin[i] = kiln_slice_at(g, nd->attrs.dim, at, at + len, 1, AT);
    at += len;
  }
  return 0;
}
static int bw_index_select(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *in[3] = {kiln_zeros_at(IN(0).dtype, IN(0).ndim, IN(0).shape, AT), nd->in[1], g};
  gin[0] = op_dispatch(OP_INDEX_ADD, in, 3, &nd->attrs, AT);
  return 0;
}
static int bw_index_add(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  if (IN(0).need) gin[0] = g;
  if (IN(2).need) gin[2] = kiln_index_select_at(g, nd->attrs.dim, nd->in[1], AT);
  return 0;
}
static int bw_slice_scatter(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  if (IN(0).need) gin[0] = slice_scatter(g, kiln_zeros_at(IN(1).dtype, IN(1).ndim, IN(1).shape, AT), &nd->attrs, nd);
  if (IN(1).need) gin[1] = kiln_slice_at(g, nd->attrs.dim, nd->attrs.start.c, nd->attrs.end.c, nd->attrs.step, AT);
  return 0;
}

static kiln_tensor *zeros_of_in(ag_node *nd, int i) { return kiln_zeros_at(IN(i).dtype, IN(i).ndim, IN(i).shape, AT); }
static int bw_gather(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *in[3] = {zeros_of_in(nd, 0), nd->in[1], g};
  gin[0] = op_dispatch(OP_SCATTER_ADD, in, 3, &nd->attrs, AT);
  return 0;
}
static int bw_scatter_add(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  if (IN(0).need) gin[0] = g;
  kiln_tensor *in[2] = {g, nd->in[1]};
  if (IN(2).need) gin[2] = op_dispatch(OP_GATHER, in, 2, &nd->attrs, AT);
  return 0;
}
/* x's rows that were overwritten get no gradient; the source's rows get g's
 * rows at their indices (torch's formula: with a repeated index, every
 * source row gets it, though the last one won) */
static int bw_index_copy(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *in[3] = {g, nd->in[1], zeros_of_in(nd, 2)};
  if (IN(0).need) gin[0] = op_dispatch(OP_INDEX_COPY, in, 3, &nd->attrs, AT);
  if (IN(2).need) gin[2] = kiln_index_select_at(g, nd->attrs.dim, nd->in[1], AT);
  return 0;
}
static int bw_tri(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = op_dispatch(nd->op, &g, 1, &nd->attrs, AT);
  return 0;
}
/* the gradient of a pad is g padded back: every width negated (a pad crops, a crop pads with 0) */
static int bw_pad(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  op_attrs a = nd->attrs;
  for (int i = 0; i < a.nints; i++) a.ints[i] = -a.ints[i];
  a.value = 0;
  gin[0] = op_dispatch(OP_PAD, &g, 1, &a, AT);
  return 0;
}
/* the sum of g from each position to the end: sum(g) - cumsum(g) + g */
static int bw_cumsum(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  int d = nd->attrs.dim;
  kiln_tensor *c = op_dispatch(OP_CUMSUM, &g, 1, &nd->attrs, AT);
  kiln_tensor *total = IN(0).ndim ? kiln_sum_at(g, d, true, AT) : g;
  gin[0] = kiln_add_at(kiln_sub_at(total, c, AT), g, AT);
  return 0;
}
/* y = op over the processes of x_p: the objective is the sum of every process's
 * loss, so each x_p's gradient is the same op over the processes' gradients */
static int bw_allreduce(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = kiln_allreduce_at(g, nd->attrs.flag ? KILN_REDUCE_MEAN : KILN_REDUCE_SUM, AT);
  return 0;
}

/* convolution and pooling: their gradients are ops of their own (conv.c,
 * pooling.c), given the forward's input whose shape they have */
static kiln_tensor *grad_op(op_id op, kiln_tensor *a, kiln_tensor *b, kiln_tensor *c, ag_node *nd) {
  kiln_tensor *in[3] = {a, b, c};
  return op_dispatch(op, in, c ? 3 : 2, &nd->attrs, AT);
}
static int bw_conv2d(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  kiln_tensor *x = nd->in[0], *w = nd->in[1];
  if (IN(0).need) gin[0] = grad_op(OP_CONV2D_GRAD_INPUT, g, w, x, nd);
  if (IN(1).need) gin[1] = grad_op(OP_CONV2D_GRAD_WEIGHT, g, x, w, nd);
  return 0;
}
static int bw_max_pool2d(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  gin[0] = grad_op(OP_MAX_POOL2D_GRAD, g, nd->in[0], NULL, nd);
  return 0;
}
static int bw_avg_pool2d(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  op_id op = nd->op == OP_AVG_POOL2D ? OP_AVG_POOL2D_GRAD : OP_ADAPTIVE_AVG_POOL2D_GRAD;
  gin[0] = grad_op(op, g, nd->in[0], NULL, nd);
  return 0;
}

/* attention: one attention_grad (attention.c) makes dq, dk and dv, flattened;
 * each is a slice of it. An additive mask gets no gradient: refused. */
static int bw_attention(ag_node *nd, kiln_tensor *g, kiln_tensor **gin) {
  if (nd->n_in > 3 && IN(3).need)
    return err_set(AT, "attention", "no gradient for the mask: compute it outside the fused op"), -1;
  kiln_tensor *in[6] = {nd->in[0], nd->in[1], nd->in[2], OUT, g, nd->n_in > 3 ? nd->in[3] : NULL};
  kiln_tensor *all = op_dispatch(OP_ATTENTION_GRAD, in, nd->n_in > 3 ? 6 : 5, &nd->attrs, AT);
  int64_t at = 0;
  for (int i = 0; i < 3; i++) {
    int64_t n = shape_numel(IN(i).ndim, IN(i).shape);
    if (IN(i).need) gin[i] = kiln_reshape_at(kiln_slice_at(all, 0, at, at + n, 1, AT), IN(i).ndim, IN(i).shape, AT);
    at += n;
  }
  return 0;
}

static const backward_fn backwards[OP_COUNT] = {
#define NONE NULL
#define X(id, name, arity, kind, attrs, dtype, shape, kernel, check, backward, saves, cg, cost, emit) [OP_##id] = backward,
#include "ops.def"
#undef X
#undef NONE
};

static bool differentiable(op_id op) { return backwards[op] != NULL; }

/* ---- the engine ---- */

typedef struct nodelist {
  ag_node **v;
  int n, cap;
} nodelist;

static int nl_push(nodelist *l, ag_node *nd) {
  if (l->n == l->cap) {
    int cap = l->cap ? 2 * l->cap : 64;
    ag_node **v = alloc_realloc(l->v, sizeof *v * (size_t)cap);
    if (!v) return -1;
    l->v = v;
    l->cap = cap;
  }
  l->v[l->n++] = nd;
  return 0;
}

typedef struct bw_req {
  kiln_tensor *const *wrt; /* grad_of: the tensors whose gradients are wanted */
  kiln_tensor **res;
  int nwrt;
  bool accumulate; /* backward: into .grad of leaves */
  bool free_graph;
  bool stop;       /* a wrt tensor's node is a leaf: the walk does not go past it */
} bw_req;

static bool stopped(const bw_req *rq, const ag_node *nd) {
  for (int j = 0; rq->stop && j < rq->nwrt; j++)
    if (rq->wrt[j]->grad_fn == nd) return true;
  return false;
}

void ag_set_grad_if(kiln_tensor *g, kiln_tensor *m, int kind) {
  kiln_retain(m);
  kiln_release(g->grad_if);
  g->grad_if = m;
  g->grad_if_kind = m ? (uint8_t)kind : 0;
}

kiln_tensor *ag_grad_if_bool(const kiln_tensor *g, const char *file, int line) {
  kiln_tensor *m = g->grad_if, *b;
  internal_begin(); /* kiln's numbers (the 0 below), not the user's */
  if (g->grad_if_kind & GRAD_IF_TRUE)
    b = m->ndim == 0 ? m : kiln_reshape_at(m, 0, NULL, file, line);
  else
    b = kiln_gt_at(numel_scalar(m, (int[]){0}, 1, 0, KILN_I64, file, line), kiln_scalar_at(KILN_I64, 0, file, line),
                   file, line);
  internal_end();
  return b;
}

/* Whether g, a tensor with data, exists (its grad_if holds); a condition
 * without data (a recording's) cannot say, and the recording decides. */
static bool grad_if_holds(const kiln_tensor *g) {
  const kiln_tensor *m = g->grad_if;
  if (!m) return true;
  if (!(g->grad_if_kind & GRAD_IF_TRUE)) return m->shape[0] != 0;
  return m->st->meta || *(const unsigned char *)tensor_data(m) != 0;
}

/* t = a + b keeps their grad_if: a gradient of a construct that may not
 * run stays one through sums of such; a sum of two with different
 * conditions exists where either holds (their `or`, a where of the two);
 * any plain term makes it plain. */
static void grad_if_of(kiln_tensor *t, const kiln_tensor *a, const kiln_tensor *b, const char *file, int line) {
  if (!t || t == a) return;
  kiln_tensor *m = NULL;
  int kind = 0;
  if (a->grad_if && b->grad_if == a->grad_if && ((a->grad_if_kind ^ b->grad_if_kind) & GRAD_IF_TRUE) == 0) {
    m = a->grad_if, kind = a->grad_if_kind;
  } else if (a->grad_if && b->grad_if) {
    kiln_tensor *x = ag_grad_if_bool(a, file, line), *y = ag_grad_if_bool(b, file, line);
    /* out of memory: plain, a write always made (zeros where eager has none), never a gradient lost */
    m = x && y ? kiln_where_at(x, x, y, file, line) : NULL;
    kind = GRAD_IF_TRUE | (a->grad_if_kind & GRAD_IF_FROM_NULL);
  }
  if (t->grad_if != m || t->grad_if_kind != kind) ag_set_grad_if(t, m, kind);
}

/* t, a gradient a formula made from g, exists only where g does too: it
 * takes g's grad_if, or where it has one of its own (a construct's
 * backward marked it), both (their `and`). */
static void grad_if_within(kiln_tensor *t, const kiln_tensor *g, const char *file, int line) {
  if (!t || t == g || !g->grad_if || (t->grad_if == g->grad_if && t->grad_if_kind == g->grad_if_kind)) return;
  if (!t->grad_if) {
    ag_set_grad_if(t, g->grad_if, g->grad_if_kind);
    return;
  }
  kiln_tensor *x = ag_grad_if_bool(t, file, line), *y = ag_grad_if_bool(g, file, line);
  kiln_tensor *both = x && y ? kiln_where_at(x, y, x, file, line) : NULL;
  ag_set_grad_if(t, both ? both : g->grad_if, both ? GRAD_IF_TRUE : g->grad_if_kind); /* out of memory: g's alone */
}

/* acc += g (the first one is kept as is: it may be a view, it is never written) */
static kiln_tensor *acc_add(kiln_tensor *acc, kiln_tensor *g, const char *file, int line) {
  if (!acc) return kiln_retain(g);
  kiln_tensor *in[2] = {acc, g};
  kiln_tensor *s = op_dispatch(OP_ADD, in, 2, NULL, file, line);
  grad_if_of(s, acc, g, file, line);
  kiln_release(acc);
  return kiln_retain(s);
}

static int leaf_grad(kiln_tensor *leaf, kiln_tensor *g, const bw_req *rq, const char *file, int line) {
  for (int j = 0; j < rq->nwrt; j++)
    if (rq->wrt[j] == leaf) {
      rq->res[j] = acc_add(rq->res[j], g, file, line);
      if (!rq->res[j]) return -1;
    }
  if (!rq->accumulate) return 0;
  /* a gradient through a scan that ran no step, or a branch that did not run:
   * eager reached nothing (kiln_grad stays as it was); under a recording the
   * write depends on the condition (the trip count, the predicate) */
  if (g->grad_if && !g->st->meta && !grad_if_holds(g)) return 0;
  /* .grad is always a tensor of its own (a fresh copy, then out-of-place sums) */
  kiln_tensor *in[2] = {leaf->grad, g};
  kiln_tensor *ng = leaf->grad ? op_dispatch(OP_ADD, in, 2, NULL, file, line) : op_dispatch(OP_COPY, &g, 1, NULL, file, line);
  if (!ng) return -1;
  /* under a recording: the .grad write is made where g's condition holds;
   * else .grad is as the segment found it (a .grad with data), or NULL (none
   * then, or dropped in the call: FROM_NULL), or, for a .grad this segment
   * made, as that one's condition says (the two conditions' `or`) */
  if (g->grad_if && g->st->meta) {
    if (!leaf->grad || !leaf->grad->st->meta)
      ag_set_grad_if(ng, g->grad_if, (g->grad_if_kind & GRAD_IF_TRUE) | (leaf->grad ? 0 : GRAD_IF_FROM_NULL));
    else
      grad_if_of(ng, leaf->grad, g, file, line);
  }
  kiln_release(leaf->grad);
  leaf->grad = kiln_retain(ng);
  return 0;
}

static int check_versions(ag_node *nd) {
  for (int i = 0; i < nd->n_in; i++)
    if (nd->in[i] && atomic_load(&nd->in[i]->st->version) != nd->version[i])
      return err_set(nd->file, nd->line, op_table[nd->op].name,
                     "input %d, needed to compute gradients, was modified in place after this op", i),
             -1;
  struct ag_extra *x = EXTRA(nd);
  if (x->saved_out && atomic_load(&x->saved_out->st->version) != x->out_version)
    return err_set(nd->file, nd->line, op_table[nd->op].name,
                   "its output, needed to compute gradients, was modified in place"),
           -1;
  return 0;
}

/* A node's state in a backward run, kept aside while a nested run (a
 * construct's VJP replayed eagerly inside a formula, cfgrad.c) walks the
 * same nodes: the outer run's count of what it still waits for and the
 * gradient summed so far must not be taken, counted again or freed by it. */
typedef struct saved_state {
  ag_node *nd;
  int pending;
  kiln_tensor *acc, **accs;
} saved_state;
static _Thread_local int bw_depth;

static int run_backward_at(kiln_tensor *root, kiln_tensor *seed, const bw_req *rq, const char *file, int line);

static int run_backward(kiln_tensor *root, kiln_tensor *seed, const bw_req *rq, const char *file, int line) {
  bw_depth++;
  int rc = run_backward_at(root, seed, rq, file, line);
  bw_depth--;
  return rc;
}

/* Sets nd's run state aside (a nested run): 0, or -1 when out of memory. */
static int set_aside(saved_state **v, int *n, int *cap, ag_node *nd) {
  if (alloc_grow((void **)v, cap, *n + 1, sizeof **v)) return -1;
  struct ag_extra *x = EXTRA(nd);
  saved_state *s = &(*v)[(*n)++];
  *s = (saved_state){nd, nd->pending, nd->acc, NULL};
  nd->acc = NULL;
  if (x->multi && x->n_out) {
    if (!(s->accs = alloc_malloc(sizeof *s->accs * (size_t)x->n_out))) return -1;
    memcpy(s->accs, x->accs, sizeof *s->accs * (size_t)x->n_out);
    memset(x->accs, 0, sizeof *x->accs * (size_t)x->n_out);
  }
  return 0;
}

static void put_back(saved_state *v, int n) {
  for (int i = 0; i < n; i++) {
    struct ag_extra *x = EXTRA(v[i].nd);
    v[i].nd->pending = v[i].pending;
    v[i].nd->acc = v[i].acc;
    if (v[i].accs) memcpy(x->accs, v[i].accs, sizeof *x->accs * (size_t)x->n_out);
    alloc_free(v[i].accs);
  }
  alloc_free(v);
}

static int run_backward_at(kiln_tensor *root, kiln_tensor *seed, const bw_req *rq, const char *file, int line) {
  if (!root->requires_grad)
    return err_set(file, line, "backward", "the tensor does not require grad (no input of it requires grad)"), -1;
  if (!root->grad_fn) return leaf_grad(root, seed, rq, file, line);
  if (root->grad_fn->freed)
    return err_set(file, line, "backward",
                   "the graph was already freed by an earlier backward; call backward once per forward"),
           -1;
  /* count, for every reachable node, how many reachable nodes consume it */
  static atomic_ulong epochs;
  unsigned long epoch = atomic_fetch_add(&epochs, 1) + 1;
  nodelist all = {0}, stack = {0}, ready = {0};
  saved_state *aside = NULL;
  int rc = -1, n_aside = 0, cap_aside = 0;
  bool nested = bw_depth > 1;
  if (nl_push(&stack, root->grad_fn)) goto oom;
  EXTRA(root->grad_fn)->epoch = epoch;
  while (stack.n) {
    ag_node *nd = stack.v[--stack.n];
    if (nl_push(&all, nd)) goto oom;
    if (nested && set_aside(&aside, &n_aside, &cap_aside, nd)) goto oom;
    nd->pending = 0;
    for (int i = 0; i < nd->n_in && !stopped(rq, nd); i++) {
      ag_node *c = EXTRA(nd)->inputs[i].next;
      if (!c) continue;
      if (c->freed) {
        err_set(file, line, "backward", "part of the graph was already freed by an earlier backward");
        goto done;
      }
      if (EXTRA(c)->epoch == epoch) continue;
      EXTRA(c)->epoch = epoch;
      if (nl_push(&stack, c)) goto oom;
    }
  }
  for (int k = 0; k < all.n; k++)
    for (int i = 0; i < all.v[k]->n_in && !stopped(rq, all.v[k]); i++)
      if (EXTRA(all.v[k])->inputs[i].next) EXTRA(all.v[k])->inputs[i].next->pending++;
  root->grad_fn->acc = kiln_retain(seed);
  if (nl_push(&ready, root->grad_fn)) goto oom;
  while (ready.n) {
    ag_node *nd = ready.v[--ready.n];
    struct ag_extra *x = EXTRA(nd);
    kiln_tensor *g = nd->acc;
    nd->acc = NULL;
    for (int k = 0; x->multi && !g && k < x->n_out; k++)
      if (x->accs[k]) g = kiln_retain(x->accs[k]); /* some gradient flowed in: the formula runs */
    kiln_tensor *gin[64] = {0}, **gp = nd->n_in <= 64 ? gin : alloc_calloc((size_t)nd->n_in, sizeof *gp);
    if (!gp) goto oom;
    if (g && stopped(rq, nd)) {
      /* a wrt tensor taken as a leaf: its gradient is all that is wanted of it */
      for (int j = 0; j < rq->nwrt; j++)
        if (rq->wrt[j]->grad_fn == nd && !(rq->res[j] = acc_add(rq->res[j], g, file, line))) {
          kiln_release(g);
          if (gp != gin) alloc_free(gp);
          goto done;
        }
      kiln_release(g);
      if (gp != gin) alloc_free(gp);
      continue;
    }
    if (g) {
      /* a sum that could not be made (out of memory) fails the call: never a gradient short of a term */
      int bad = 0;
      for (int j = 0; j < rq->nwrt; j++)
        if (rq->wrt[j]->grad_fn == nd && !(rq->res[j] = acc_add(rq->res[j], g, file, line))) bad = 1;
      internal_begin();
      if (x->get) gp[0] = g;
      else if (x->multi) bad = bad || x->multi->backward(x->multi_data, x->accs, gp, nd->file, nd->line);
      else if (!(bad = bad || check_versions(nd))) {
        ag_node *outer = formula_of;
        formula_of = nd;
        bad = backwards[nd->op](nd, g, gp);
        formula_of = outer;
      }
      internal_end();
      for (int i = 0; !bad && g->grad_if && i < nd->n_in; i++) grad_if_within(gp[i], g, file, line);
      if (bad) {
        kiln_release(g);
        if (gp != gin) alloc_free(gp);
        goto done;
      }
    }
    for (int i = 0; i < nd->n_in; i++) {
      ag_input *ai = &EXTRA(nd)->inputs[i];
      kiln_tensor *gi = gp[i];
      if (g && ai->need && !gi && !x->multi) {
        /* a formula returned NULL: its op failed and set the error (a multi-output
         * node's says so by its return; its NULL is an input no gradient reaches) */
        kiln_release(g);
        if (gp != gin) alloc_free(gp);
        goto done;
      }
      if (gi) KILN_ASSERT(gi->ndim == ai->ndim);
      int r = 0;
      if (gi && gi->dtype != ai->dtype && !(gi = kiln_cast_at(gi, ai->dtype, nd->file, nd->line))) {
        r = -1;
      } else if (ai->next) {
        struct ag_extra *nx = EXTRA(ai->next);
        kiln_tensor **acc = nx->multi ? &nx->accs[ai->slot] : &ai->next->acc;
        if (gi && !(*acc = acc_add(*acc, gi, file, line))) r = -1;
        else if (--ai->next->pending == 0) r = nl_push(&ready, ai->next);
      } else if (ai->leaf && gi) {
        r = leaf_grad(ai->leaf, gi, rq, file, line);
      }
      if (r) {
        kiln_release(g);
        if (gp != gin) alloc_free(gp);
        goto done;
      }
    }
    kiln_release(g);
    if (gp != gin) alloc_free(gp);
  }
  rc = 0;
  goto done;
oom:
  err_set(file, line, "backward", "out of memory");
done:
  for (int k = 0; k < all.n; k++) {
    ag_node *nd = all.v[k];
    kiln_release(nd->acc);
    nd->acc = NULL;
    for (int j = 0; j < EXTRA(nd)->n_out; j++) {
      kiln_release(EXTRA(nd)->accs[j]);
      EXTRA(nd)->accs[j] = NULL;
    }
    if (rq->free_graph && rc == 0) {
      node_free_saved(nd);
      kiln_release(EXTRA(nd)->saved_out);
      EXTRA(nd)->saved_out = NULL;
      nd->freed = true;
    }
  }
  put_back(aside, n_aside);
  alloc_free(all.v);
  alloc_free(stack.v);
  alloc_free(ready.v);
  return rc;
}

/* The engine's runs on this thread: a compiled call asks whether its body
 * ran one (a backward walks on into its inputs' autograd history). */
static _Thread_local unsigned long engine_runs;
unsigned long ag_engine_runs(void) { return engine_runs; }

/* Runs the engine with grad mode off, inside a scope of its own. */
static int backward_entry(kiln_tensor *root, kiln_tensor *seed_in, const bw_req *rq, const char *file, int line) {
  engine_runs++;
  kiln_scope_begin();
  kiln_no_grad_begin();
  int rc = -1;
  kiln_tensor *seed = seed_in;
  if (!seed) {
    internal_begin(); /* the seed's 1 and shape are kiln's own, not numbers of the caller */
    seed = kiln_ones_at(root->dtype, root->ndim, root->shape, file, line);
    internal_end();
  }
  if (seed) rc = run_backward(root, seed, rq, file, line);
  kiln_no_grad_end();
  kiln_scope_end(); /* rq->res[] hold references of their own */
  return rc;
}

int kiln_backward_at(kiln_tensor *loss, const char *file, int line) {
  if (tensor_bad_arg(loss, file, line, "backward", "loss")) return -1;
  if (shape_numel(loss->ndim, loss->shape) != 1) {
    char b[SHAPE_BUF];
    return err_set(file, line, "backward", "loss must have one element, got %s; use kiln_backward_with",
                   err_shape(b, loss->ndim, loss->shape)),
           -1;
  }
  bw_req rq = {.accumulate = true, .free_graph = true};
  return backward_entry(loss, NULL, &rq, file, line);
}

int kiln_backward_with_at(kiln_tensor *out, kiln_tensor *grad_out, const char *file, int line) {
  if (tensor_bad_arg(out, file, line, "backward_with", "out") || tensor_bad_arg(grad_out, file, line, "backward_with", "grad_out"))
    return -1;
  if (out->ndim != grad_out->ndim || memcmp(out->shape, grad_out->shape, sizeof(int64_t) * (size_t)out->ndim)) {
    char b0[SHAPE_BUF], b1[SHAPE_BUF];
    return err_set(file, line, "backward_with", "grad_out %s does not match out %s", err_shape(b0, grad_out->ndim, grad_out->shape),
                   err_shape(b1, out->ndim, out->shape)),
           -1;
  }
  bw_req rq = {.accumulate = true, .free_graph = true};
  return backward_entry(out, grad_out, &rq, file, line);
}

static int grad_of(kiln_tensor *out, kiln_tensor *const *wrt, int n, kiln_tensor **grads, bool stop, const char *file,
                   int line);

int kiln_grad_of_at(kiln_tensor *out, kiln_tensor *const *wrt, int n, kiln_tensor **grads, const char *file,
                    int line) {
  if (!out || (n > 0 && (!wrt || !grads)) || n < 0) return err_set(file, line, "grad_of", "NULL argument"), -1;
  if (tensor_check_live(out, "out", "grad_of", file, line)) return -1;
  for (int j = 0; j < n; j++) {
    grads[j] = NULL;
    if (!wrt[j]) return err_set(file, line, "grad_of", "wrt[%d] is NULL", j), -1;
    if (tensor_check_live(wrt[j], "a wrt tensor", "grad_of", file, line)) return -1;
  }
  if (shape_numel(out->ndim, out->shape) != 1) return err_set(file, line, "grad_of", "out must have one element"), -1;
  return grad_of(out, wrt, n, grads, false, file, line);
}

int ag_grad_of_stop(kiln_tensor *out, kiln_tensor *const *wrt, int n, kiln_tensor **grads, const char *file, int line) {
  for (int j = 0; j < n; j++) grads[j] = NULL;
  return grad_of(out, wrt, n, grads, true, file, line);
}

static int grad_of(kiln_tensor *out, kiln_tensor *const *wrt, int n, kiln_tensor **grads, bool stop, const char *file,
                   int line) {
  bw_req rq = {.wrt = wrt, .res = grads, .nwrt = n, .stop = stop};
  int rc = backward_entry(out, NULL, &rq, file, line);
  for (int j = 0; j < n; j++) {
    kiln_tensor *g = grads[j];
    if (rc == 0 && stop && !g) {
      grads[j] = NULL; /* a replayed body's VJP: none reached it (cfgrad.c tells it from zeros) */
    } else if (rc == 0) {
      /* a tensor of its own, with wrt's shape and dtype (zeros where out does not depend on it) */
      kiln_no_grad_begin();
      kiln_tensor *r = g ? op_dispatch(OP_COPY, &g, 1, NULL, file, line)
                         : kiln_zeros_at(wrt[j]->dtype, wrt[j]->ndim, wrt[j]->shape, file, line);
      kiln_no_grad_end();
      grads[j] = r;
      if (!r) rc = -1;
      else if (stop && g->grad_if) ag_set_grad_if(r, g->grad_if, g->grad_if_kind); /* it may exist only where a nested construct ran */
    } else {
      grads[j] = NULL;
    }
    kiln_release(g);
  }
  return rc;
}

void kiln_requires_grad_at(kiln_tensor *t, bool on, const char *file, int line) {
  if (!t || tensor_check_live(t, "tensor", "requires_grad", file, line)) return;
  if (on && !dtype_is_float(t->dtype)) {
    err_set(file, line, "requires_grad", "only float tensors can require grad, not %s", kiln_dtype_name(t->dtype));
    return;
  }
  if (t->grad_fn) return; /* a computed tensor's flag follows its inputs */
  if (t->requires_grad != on) {
    /* a compiled body that changes a flag must run on every call, as
     * eagerly: the guard-only path would skip the change */
    meta_read(t, -1);
  }
  t->requires_grad = on;
}

void (kiln_requires_grad)(kiln_tensor *t, bool on) { kiln_requires_grad_at(t, on, "", 0); }

/* no caller's line: a released tensor gives the NULL answer, and an error without one */
static bool gone(const kiln_tensor *t, const char *op) { return !t || tensor_check_live(t, "tensor", op, "", 0); }
bool kiln_get_requires_grad(const kiln_tensor *t) { return !gone(t, "get_requires_grad") && t->requires_grad; }
/* .grad as eagerly. Under a recording a .grad a construct's backward made
 * may exist only where its condition holds (grad_if: the branch ran, a
 * step did); where it fails and the .grad was NULL before, eager has NULL,
 * and the body may branch on that. So the condition is read: a trip count
 * from the recording's shape (the body then runs on every call), a
 * predicate by a graph break (the segment so far runs and .grad is data,
 * or NULL). Where the .grad was set before, its value is the same either
 * way (old + zeros), and nothing is read. */
kiln_tensor *kiln_grad_at(const kiln_tensor *t, const char *file, int line) {
  if (!t || tensor_check_live(t, "tensor", "grad", file, line)) return NULL;
  const trace_hooks *h = dispatch_hooks();
  /* t a leaf of the recording now, so its .grad at the start (NULL or set,
   * which C can branch on) is a guard, even where t is in no op */
  if (h && h->zero_grad) h->zero_grad(h->ctx, (kiln_tensor *)t);
  kiln_tensor *g = t->grad;
  if (!g || !g->grad_if || !g->st->meta || !(g->grad_if_kind & GRAD_IF_FROM_NULL)) return g;
  if (g->grad_if_kind & GRAD_IF_TRUE) {
    hook_read("kiln_grad", g->grad_if, file, line);
    g = t->grad; /* after a break: the segment's write, or NULL */
    if (!g || !g->grad_if) return g;
  } else if (h && h->size_read) {
    h->size_read(h->ctx, g->grad_if, -1);
  }
  return grad_if_holds(g) ? g : NULL;
}
kiln_tensor *(kiln_grad)(const kiln_tensor *t) { return kiln_grad_at(t, "", 0); }

void kiln_zero_grad_at(kiln_tensor *t, const char *file, int line) {
  if (!t || tensor_check_live(t, "tensor", "zero_grad", file, line)) return;
  const trace_hooks *h = dispatch_hooks();
  if (h && h->zero_grad) h->zero_grad(h->ctx, t);
  kiln_release(t->grad);
  t->grad = NULL;
}

void (kiln_zero_grad)(kiln_tensor *t) { kiln_zero_grad_at(t, "", 0); }
