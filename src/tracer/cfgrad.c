/* Reverse mode through a construct recorded as one region (on_cf in
 * record.c). The construct's results get one autograd node (a multi-output
 * node, autograd.c) that keeps what the recording logged of each body: its
 * events, copied into a small program over the region's arguments and its
 * captures (the outer tensors it read). The user's C body is never run
 * again, so a backward after the body's ctx went out of scope is sound, and
 * so are bodies with side effects.
 *
 * Backward replays a body's program with gradients on over fresh leaves,
 * then takes the gradients of sum_k sum(out_k * cot_k) (the cotangents of
 * its results) with kiln's autograd: under a recording, that records the
 * step's VJP, forward recomputed included, as one region again.
 *  - scan: the forward also stacks each step's incoming carry as extra ys
 *    (the saved carries: T times the carry's size). The backward is a
 *    kiln_scan over the steps in reverse (flipped xs: the saved carries, xs,
 *    the ys' cotangents), whose carry is the carry's cotangent and the
 *    captures' gradients summed over the steps, and whose ys are the xs'
 *    gradients. What a step computes inside is recomputed, not saved.
 *  - cond: the backward is a kiln_cond on the same predicate of the two
 *    branches' VJPs.
 *  - while_loop: forward only, as in JAX: its results get a node whose
 *    backward is an error naming the loop's line (ag_forward_only).
 * A body whose events a program cannot hold (a nested construct, a
 * draw, an in-place write) is not a region: record.c runs it step by step. */
#include <string.h>

#include "tracer/tracer.h"

/* One event of a body: its inputs are references, a slot (>= 0) or a
 * capture (-1 - index). */
typedef struct cfg_ins {
  rec_ekind kind; /* EV_OP, EV_FULL, EV_DATA or EV_NUMEL */
  int op;
  op_attrs a;
  int n_in, *in;
  void *data; /* EV_DATA's bytes (owned) */
  const char *file;
  int line;
} cfg_ins;

typedef struct cfg_prog {
  int n_args;   /* slots 0..n_args: the region's arguments; then one per instruction */
  cfg_ins *ins;
  int n_ins;
  int n_out, *out; /* the yield's references */
} cfg_prog;

struct cfg_grad {
  cf_kind kind;
  int n_carry, n_xs, n_res; /* n_res: the construct's results the user sees */
  int n_in;                 /* the construct's inputs, then the captures: the node's inputs */
  kiln_tensor **in;
  int n_caps, cap_caps;
  kiln_tensor **caps;
  struct { kiln_dtype dtype; int ndim; int64_t shape[MAXD]; } *res; /* cond: its results' types */
  cfg_prog prog[2];
  kiln_tensor **saved; /* scan: the stacked carries, n_carry of them */
  const char *file;
  int line;
};

/* ---- the program of a body ---- */

static int ref_of(recording *r, cfg_grad *g, int *slot_of, int id) {
  if (slot_of[id] >= 0) return slot_of[id];
  kiln_tensor *t = rec_tensor_of(r, id);
  if (!t) return INT32_MIN;
  for (int c = 0; c < g->n_caps; c++)
    if (g->caps[c] == t) return -1 - c;
  if (alloc_grow((void **)&g->caps, &g->cap_caps, g->n_caps + 1, sizeof *g->caps)) return INT32_MIN;
  g->caps[g->n_caps] = kiln_retain(t);
  return -1 - g->n_caps++;
}

/* Region i's program from the events first.. of r: 0, 1 when a program
 * cannot hold them, -1 out of memory. */
static int prog_build(recording *r, int first, int region, cfg_grad *g, cfg_prog *p) {
  int *slot_of = alloc_malloc(sizeof(int) * (size_t)(r->n_val + 1));
  if (!slot_of) return -1;
  for (int v = 0; v < r->n_val; v++) slot_of[v] = -1;
  p->ins = alloc_calloc((size_t)(r->n_ev - first + 1), sizeof *p->ins);
  int rc = p->ins ? 1 : -1, depth = 0;
  bool in_region = false;
  for (int k = first + 1; k < r->n_ev && p->ins; k++) {
    const rec_event *e = &r->ev[k];
    if (e->kind == EV_CF) depth++;
    if (e->kind == EV_ARG && depth == 0 && e->a.dim == region) {
      in_region = true;
      slot_of[e->out] = (int)e->a.k;
      if ((int)e->a.k + 1 > p->n_args) p->n_args = (int)e->a.k + 1;
      continue;
    }
    if (!in_region) continue;
    if (e->kind == EV_YIELD && depth == 0) {
      p->n_out = e->n_in;
      if (!(p->out = alloc_malloc(sizeof(int) * (size_t)(e->n_in + 1)))) {
        rc = -1;
        break;
      }
      rc = 0;
      for (int j = 0; j < e->n_in && !rc; j++)
        if ((p->out[j] = ref_of(r, g, slot_of, r->ids[e->in + j])) == INT32_MIN) rc = 1;
      break;
    }
    bool ok = e->kind == EV_FULL || e->kind == EV_DATA || e->kind == EV_NUMEL ||
              (e->kind == EV_OP && !(op_table[e->op].attrs & AF_RNG));
    if (!ok || depth) break; /* a nested construct, a draw, a write in place: not replayable */
    cfg_ins *in = &p->ins[p->n_ins];
    *in = (cfg_ins){.kind = e->kind, .op = e->op, .a = e->a, .n_in = e->n_in, .file = e->file, .line = e->line};
    in->in = alloc_malloc(sizeof(int) * (size_t)(e->n_in + 1));
    if (!in->in) {
      rc = -1;
      break;
    }
    p->n_ins++;
    bool bad = false;
    for (int j = 0; j < e->n_in && !bad; j++) bad = (in->in[j] = ref_of(r, g, slot_of, r->ids[e->in + j])) == INT32_MIN;
    if (bad) break;
    if (e->kind == EV_DATA) {
      int64_t shape[MAXD];
      for (int d = 0; d < e->a.ndim; d++) shape[d] = e->a.shape[d].c;
      size_t bytes = (size_t)shape_numel(e->a.ndim, shape) * kiln_dtype_size(e->a.dtype);
      if (!(in->data = alloc_malloc(bytes + 1))) {
        rc = -1;
        break;
      }
      if (bytes) memcpy(in->data, e->data, bytes);
    }
    slot_of[e->out] = p->n_args + p->n_ins - 1;
  }
  alloc_free(slot_of);
  return rc;
}

static void prog_free(cfg_prog *p) {
  for (int i = 0; i < p->n_ins; i++) {
    alloc_free(p->ins[i].in);
    alloc_free(p->ins[i].data);
  }
  alloc_free(p->ins);
  alloc_free(p->out);
}

static kiln_tensor *ref_get(const cfg_grad *g, kiln_tensor *const *slots, int ref) {
  return ref >= 0 ? slots[ref] : g->caps[-1 - ref];
}

/* Runs region i's program over args: out[0..n_out) scope-owned, or -1 with the error set. */
static int prog_run(const cfg_grad *g, int region, kiln_tensor *const *args, kiln_tensor **out) {
  const cfg_prog *p = &g->prog[region];
  kiln_tensor **v = alloc_malloc(sizeof *v * (size_t)(p->n_args + p->n_ins + 1));
  if (!v) return err_set(g->file, g->line, "autograd", "out of memory"), -1;
  memcpy(v, args, sizeof *v * (size_t)p->n_args);
  int rc = 0;
  for (int i = 0; i < p->n_ins && !rc; i++) {
    const cfg_ins *in = &p->ins[i];
    kiln_tensor *x[64];
    for (int j = 0; j < in->n_in && j < 64; j++) x[j] = ref_get(g, v, in->in[j]);
    int64_t shape[MAXD];
    for (int d = 0; d < in->a.ndim && d < MAXD; d++) shape[d] = in->a.shape[d].c;
    kiln_tensor *t = NULL;
    switch (in->kind) {
    case EV_OP: t = in->n_in <= 64 ? op_dispatch((op_id)in->op, x, in->n_in, &in->a, in->file, in->line) : NULL; break;
    case EV_FULL: t = kiln_full_at(in->a.dtype, in->a.ndim, shape, in->a.value, in->file, in->line); break;
    case EV_DATA: t = kiln_tensor_from_at(in->a.dtype, in->a.ndim, shape, in->data, in->file, in->line); break;
    case EV_NUMEL: t = numel_scalar(x[0], in->a.axes, in->a.naxes, in->a.start.c, in->a.dtype, in->file, in->line); break;
    default: break;
    }
    if (!t) rc = -1;
    v[p->n_args + i] = t;
  }
  for (int k = 0; k < p->n_out && !rc; k++) out[k] = ref_get(g, v, p->out[k]);
  alloc_free(v);
  return rc;
}

/* ---- a body's VJP ---- */

static kiln_tensor *zeros_like(const kiln_tensor *t, const char *file, int line) {
  return kiln_zeros_at(t->dtype, t->ndim, t->shape, file, line);
}

/* Region i replayed over args (gradients on, the args that need[] theirs
 * as new leaves); then the gradients of sum_k sum(out_k * cot_k) (cot_k
 * NULL: none) into d: d[j] of args[j] (NULL unless need[j]), d[n_args + c]
 * of each capture that requires grad (zeros where none flows). 0 or -1. */
static int vjp(const cfg_grad *g, int region, kiln_tensor *const *args, const bool *need, kiln_tensor *const *cot,
               kiln_tensor **d) {
  const cfg_prog *p = &g->prog[region];
  int n_args = p->n_args, n = 0, rc = 0, depth = grad_mode_force_on();
  kiln_tensor *out[128], *wrt[192], *res[192];
  int where[192];
  bool had[128];
  for (int j = 0; j < n_args; j++) {
    d[j] = NULL;
    had[j] = args[j]->requires_grad;
    if (!need[j]) continue;
    /* a new leaf (an eager operand keeps its history: the walk stops at it) */
    if (!args[j]->grad_fn) args[j]->requires_grad = true;
    where[n] = j;
    wrt[n++] = args[j];
  }
  for (int c = 0; c < g->n_caps; c++)
    if (g->caps[c]->requires_grad && dtype_is_float(g->caps[c]->dtype)) where[n] = n_args + c, wrt[n++] = g->caps[c];
  rc = prog_run(g, region, args, out);
  kiln_tensor *L = NULL;
  for (int k = 0; !rc && k < p->n_out; k++) {
    if (!cot[k] || !out[k]->requires_grad) continue;
    kiln_tensor *term = kiln_sum_axes_at(kiln_mul_at(out[k], cot[k], g->file, g->line), NULL, 0, false, g->file, g->line);
    L = L ? kiln_add_at(L, term, g->file, g->line) : term;
    if (!L) rc = -1;
  }
  for (int j = 0; j < n; j++) res[j] = NULL;
  if (!rc && L) rc = ag_grad_of_stop(L, wrt, n, res, g->file, g->line);
  grad_mode_restore(depth);
  for (int j = 0; j < n && !rc; j++) {
    kiln_tensor *x = where[j] < n_args ? args[where[j]] : g->caps[where[j] - n_args];
    d[where[j]] = res[j] ? res[j] : zeros_like(x, g->file, g->line);
    if (!d[where[j]]) rc = -1;
  }
  for (int j = 0; j < n_args; j++) args[j]->requires_grad = had[j];
  return rc;
}

/* ---- scan ---- */

/* x reversed along dim 0, with ops a trace keeps symbolic in T. */
static kiln_tensor *flip0(kiln_tensor *x, const char *file, int line) {
  int64_t T = x->shape[0];
  kiln_tensor *steps = kiln_cumsum_at(kiln_expand_at(kiln_scalar_at(KILN_F32, 1, file, line), 1, &T, file, line), 0, file, line);
  kiln_tensor *n = numel_scalar(x, (int[]){0}, 1, 0, KILN_F32, file, line);
  kiln_tensor *idx = kiln_cast_at(kiln_sub_at(n, steps, file, line), KILN_I64, file, line);
  return kiln_index_select_at(x, 0, idx, file, line);
}

typedef struct rev_ctx {
  const cfg_grad *g;
  int n_dy, dy_of[64]; /* the ys whose cotangents the reverse scan steps over */
  int n_capg, capg[64];
  bool x_need[64];
  int n_dx;
} rev_ctx;

/* The reverse scan's step: in = dcarry, dcaps, carry_t, xs_t, dy_t; out =
 * dcarry', dcaps', dx_t (of the xs that need theirs). */
static int rev_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const rev_ctx *rc = ctx;
  const cfg_grad *g = rc->g;
  int nc = g->n_carry, nx = g->n_xs, n_args = nc + nx;
  kiln_tensor *const *dcarry = in, *const *dcaps = in + nc, *const *cx = in + nc + rc->n_capg;
  kiln_tensor *cot[128] = {0}, *d[192];
  bool need[128];
  for (int k = 0; k < nc; k++) cot[k] = dcarry[k], need[k] = dtype_is_float(cx[k]->dtype);
  for (int j = 0; j < nx; j++) need[nc + j] = rc->x_need[j];
  for (int k = 0; k < rc->n_dy; k++) cot[nc + rc->dy_of[k]] = cx[n_args + k];
  if (vjp(g, 0, cx, need, cot, d)) return -1;
  for (int k = 0; k < nc; k++)
    if (!(out[k] = d[k] ? d[k] : zeros_like(cx[k], g->file, g->line))) return -1;
  for (int c = 0; c < rc->n_capg; c++)
    if (!(out[nc + c] = kiln_add_at(dcaps[c], d[n_args + rc->capg[c]], g->file, g->line))) return -1;
  for (int j = 0, m = 0; j < nx; j++)
    if (rc->x_need[j]) out[nc + rc->n_capg + m++] = d[nc + j];
  return 0;
}

static int scan_backward(void *data, kiln_tensor *const *gout, kiln_tensor **gin, const char *file, int line) {
  (void)file, (void)line;
  const cfg_grad *g = data;
  int nc = g->n_carry, nx = g->n_xs, ny = g->n_res - nc;
  rev_ctx rc = {.g = g};
  kiln_tensor *init[128], *xs[192], *cout[128], *dx[64];
  for (int k = 0; k < nc; k++)
    if (!(init[k] = gout[k] ? gout[k] : zeros_like(g->in[k], g->file, g->line))) return -1;
  for (int c = 0; c < g->n_caps; c++)
    if (g->caps[c]->requires_grad && dtype_is_float(g->caps[c]->dtype)) {
      rc.capg[rc.n_capg] = c;
      if (!(init[nc + rc.n_capg++] = zeros_like(g->caps[c], g->file, g->line))) return -1;
    }
  int n_xs = 0;
  for (int k = 0; k < nc; k++)
    if (!(xs[n_xs++] = flip0(g->saved[k], g->file, g->line))) return -1;
  for (int j = 0; j < nx; j++) {
    if (!(xs[n_xs++] = flip0(g->in[nc + j], g->file, g->line))) return -1;
    rc.x_need[j] = g->in[nc + j]->requires_grad && dtype_is_float(g->in[nc + j]->dtype);
    rc.n_dx += rc.x_need[j];
  }
  for (int k = 0; k < ny; k++)
    if (gout[nc + k]) {
      rc.dy_of[rc.n_dy++] = k;
      if (!(xs[n_xs++] = flip0(gout[nc + k], g->file, g->line))) return -1;
    }
  if (kiln_scan_at(rev_step, &rc, nc + rc.n_capg, init, n_xs, xs, cout, rc.n_dx, dx, g->file, g->line)) return -1;
  for (int k = 0; k < nc; k++) gin[k] = cout[k];
  for (int j = 0, m = 0; j < nx; j++)
    if (rc.x_need[j] && !(gin[nc + j] = flip0(dx[m++], g->file, g->line))) return -1;
  for (int c = 0; c < rc.n_capg; c++) gin[g->n_in + rc.capg[c]] = cout[nc + c];
  return 0;
}

/* ---- cond ---- */

/* A branch's VJP: in = operands, cotangents of the results; out = the
 * operands' gradients (zeros for those that need none), the captures'. */
static int cond_branch_vjp(const cfg_grad *g, int region, kiln_tensor *const *in, kiln_tensor **out) {
  int n_ops = g->n_in - 1;
  kiln_tensor *d[192];
  bool need[128] = {0};
  for (int j = 0; j < n_ops; j++) need[j] = dtype_is_float(in[j]->dtype);
  if (vjp(g, region, in, need, in + n_ops, d)) return -1;
  int m = 0;
  for (int j = 0; j < n_ops; j++)
    if (!(out[m++] = d[j] ? d[j] : zeros_like(in[j], g->file, g->line))) return -1;
  for (int c = 0; c < g->n_caps; c++)
    if (g->caps[c]->requires_grad && dtype_is_float(g->caps[c]->dtype)) out[m++] = d[n_ops + c];
  return 0;
}
static int then_vjp(void *ctx, kiln_tensor *const *in, kiln_tensor **out) { return cond_branch_vjp(ctx, 0, in, out); }
static int else_vjp(void *ctx, kiln_tensor *const *in, kiln_tensor **out) { return cond_branch_vjp(ctx, 1, in, out); }

static int cond_backward(void *data, kiln_tensor *const *gout, kiln_tensor **gin, const char *file, int line) {
  (void)file, (void)line;
  const cfg_grad *g = data;
  int n_ops = g->n_in - 1, n = 0, n_out = 0;
  kiln_tensor *in[128], *out[128];
  for (int j = 0; j < n_ops; j++) in[n++] = g->in[1 + j];
  for (int k = 0; k < g->n_res; k++)
    if (!(in[n++] = gout[k] ? gout[k] : kiln_zeros_at(g->res[k].dtype, g->res[k].ndim, g->res[k].shape, g->file, g->line)))
      return -1;
  n_out = n_ops;
  for (int c = 0; c < g->n_caps; c++) n_out += g->caps[c]->requires_grad && dtype_is_float(g->caps[c]->dtype);
  if (kiln_cond_at(g->in[0], then_vjp, else_vjp, (void *)g, n, in, n_out, out, g->file, g->line)) return -1;
  for (int j = 0; j < n_ops; j++) gin[1 + j] = out[j];
  for (int c = 0, m = n_ops; c < g->n_caps; c++)
    if (g->caps[c]->requires_grad && dtype_is_float(g->caps[c]->dtype)) gin[g->n_in + c] = out[m++];
  return 0;
}

/* ---- the node ---- */

static void cfg_free(void *data) {
  cfg_grad *g = data;
  if (!g) return;
  for (int i = 0; i < g->n_in; i++) kiln_release(g->in[i]);
  for (int c = 0; c < g->n_caps; c++) kiln_release(g->caps[c]);
  for (int k = 0; g->saved && k < g->n_carry; k++) kiln_release(g->saved[k]);
  alloc_free(g->res);
  alloc_free(g->in);
  alloc_free(g->caps);
  alloc_free(g->saved);
  prog_free(&g->prog[0]);
  prog_free(&g->prog[1]);
  alloc_free(g);
}

static const ag_multi_ops scan_ops = {scan_backward, cfg_free};
static const ag_multi_ops cond_ops = {cond_backward, cfg_free};

cfg_grad *cfg_new(recording *r, const cf_call *c, int first) {
  cfg_grad *g = alloc_calloc(1, sizeof *g);
  if (!g) return NULL;
  *g = (cfg_grad){.kind = c->kind, .n_carry = c->n_carry, .n_xs = c->n_xs, .n_res = c->n_results, .n_in = c->n_in,
                  .file = c->file, .line = c->line};
  g->in = alloc_calloc((size_t)c->n_in + 1, sizeof *g->in);
  if (!g->in) return cfg_free(g), NULL;
  for (int i = 0; i < c->n_in; i++) g->in[i] = kiln_retain(c->in[i]);
  for (int i = 0; i < c->n_regions; i++)
    if (prog_build(r, first, i, g, &g->prog[i])) return cfg_free(g), NULL;
  if (g->n_caps + g->n_in > 128 || g->n_res + c->n_carry > 128) return cfg_free(g), NULL;
  return g;
}

void cfg_discard(cfg_grad *g) { cfg_free(g); }

int cfg_attach(cfg_grad *g, kiln_tensor *const *results, kiln_tensor *const *saved) {
  const char *file = g->file;
  int line = g->line;
  g->saved = alloc_calloc((size_t)g->n_carry + 1, sizeof *g->saved);
  g->res = alloc_calloc((size_t)g->n_res + 1, sizeof *g->res);
  kiln_tensor **in = alloc_malloc(sizeof *in * (size_t)(g->n_in + g->n_caps + 1));
  if (!g->saved || !g->res || !in) {
    alloc_free(in);
    cfg_free(g);
    return err_set(file, line, "autograd", "out of memory"), -1;
  }
  /* scan: the stacked carries; cond: only the results' types (keeping a
   * result would keep its own node alive) */
  for (int k = 0; g->kind == CF_SCAN && k < g->n_carry; k++) g->saved[k] = kiln_retain(saved[k]);
  for (int k = 0; k < g->n_res; k++) {
    g->res[k].dtype = results[k]->dtype;
    g->res[k].ndim = results[k]->ndim;
    memcpy(g->res[k].shape, results[k]->shape, sizeof g->res[k].shape);
  }
  memcpy(in, g->in, sizeof *in * (size_t)g->n_in);
  memcpy(in + g->n_in, g->caps, sizeof *in * (size_t)g->n_caps);
  int rc = ag_record_multi(g->kind == CF_SCAN ? &scan_ops : &cond_ops, g, in, g->n_in + g->n_caps, results, g->n_res,
                           g->file, g->line);
  alloc_free(in);
  return rc;
}
