/* The interpreter backend: runs a graph node by node through the eager
 * kernels, with autograd off (a traced backward is already in the graph).
 * It is the reference the compiled code is checked against, and the backend
 * that serves every graph the compiler cannot. Each intermediate is freed at
 * its last use; every result's shape is checked against the node's symbolic
 * shape, so a graph loaded from a file can never run with sizes it did not
 * declare. */
#include <stdatomic.h>
#include <string.h>

#include "tracer/tracer.h"

static const char *leaf_tensor_desc(const ir_node *n, char *buf, size_t len) {
  snprintf(buf, len, "%s %d", n->op == IR_INPUT ? "input" : "param", n->index);
  return buf;
}

int ir_bind_syms(const ir_graph *g, const int *leaves, int n_leaves, kiln_tensor *const *in, kiln_tensor *const *params,
                 int64_t *vals, char *err, size_t errn) {
  bool bound[IR_MAX_SYMS] = {0};
  char who[32]; /* filled only for a message: a call binds every leaf */
  int n_scan = leaves ? n_leaves : g->n_nodes;
  /* two rounds: plain symbols bind first, expressions check after */
  for (int round = 0; round < 2; round++) {
    for (int li = 0; li < n_scan; li++) {
      const ir_node *n = &g->nodes[leaves ? leaves[li] : li];
      if (n->op != IR_INPUT && n->op != IR_PARAM) continue;
      const kiln_tensor *t = ir_leaf_tensor(g, n, in, params);
      if (!t) return snprintf(err, errn, "%s is NULL", leaf_tensor_desc(n, who, sizeof who)), -1;
      if (round == 0 && n->op == IR_INPUT && n->attrs.k > 0) {
        /* a size the call passes as a number */
        int k = (int)n->attrs.k - 1;
        if (t->dtype != KILN_I64 || t->ndim != 0 || t->st->meta || k >= g->n_syms)
          return snprintf(err, errn, "%s: a size argument must be an i64 scalar", leaf_tensor_desc(n, who, sizeof who)), -1;
        int64_t got = *(const int64_t *)tensor_data(t);
        if (got < g->sym_lo[k] || got > g->sym_hi[k])
          return snprintf(err, errn, "%s: %lld is outside the bounds of s%d", leaf_tensor_desc(n, who, sizeof who), (long long)got, k), -1;
        if (bound[k] && vals[k] != got)
          return snprintf(err, errn, "%s: s%d is %lld here but %lld elsewhere", leaf_tensor_desc(n, who, sizeof who), k, (long long)got, (long long)vals[k]), -1;
        vals[k] = got;
        bound[k] = true;
        continue;
      }
      if (round == 0) {
        const char *tn = atomic_load(&t->st->name);
        if (n->op == IR_INPUT && n->name && tn && strcmp(tn, n->name))
          return snprintf(err, errn, "%s: the tensor named '%s' is passed where the graph takes '%s' (params in the wrong order?)",
                          leaf_tensor_desc(n, who, sizeof who), tn, n->name), -1;
        if (t->dtype != n->dtype)
          return snprintf(err, errn, "%s: dtype %s, the graph wants %s", leaf_tensor_desc(n, who, sizeof who), kiln_dtype_name(t->dtype), kiln_dtype_name(n->dtype)), -1;
        if (t->ndim != n->ndim) return snprintf(err, errn, "%s: rank %d, the graph wants %d", leaf_tensor_desc(n, who, sizeof who), t->ndim, n->ndim), -1;
      }
      for (int d = 0; d < n->ndim; d++) {
        sym_dim s = n->shape[d];
        int64_t got = t->shape[d], want;
        if (sym_is_const(s)) {
          if (round == 0 && got != s.c)
            return snprintf(err, errn, "%s dim %d: the graph wants %lld, got %lld", leaf_tensor_desc(n, who, sizeof who), d, (long long)s.c, (long long)got), -1;
          continue;
        }
        int k = ir_sym_id(g, s);
        if (round == 0 && k >= 0) {
          if (!bound[k]) {
            if (got < g->sym_lo[k] || got > g->sym_hi[k])
              return snprintf(err, errn, "%s dim %d: %lld is outside the bounds of s%d [%lld, %lld]", leaf_tensor_desc(n, who, sizeof who), d, (long long)got, k,
                              (long long)g->sym_lo[k], (long long)g->sym_hi[k]), -1;
            vals[k] = got;
            bound[k] = true;
          } else if (vals[k] != got) {
            return snprintf(err, errn, "%s dim %d: s%d is %lld here but %lld elsewhere", leaf_tensor_desc(n, who, sizeof who), d, k, (long long)got, (long long)vals[k]), -1;
          }
        } else if (round == 1 && k < 0) {
          if (sym_eval(s, vals, g->n_syms, &want) || want != got)
            return snprintf(err, errn, "%s dim %d: %lld does not fit the graph's size expression", leaf_tensor_desc(n, who, sizeof who), d, (long long)got), -1;
        }
      }
    }
    if (round == 0)
      for (int k = 0; k < g->n_syms; k++)
        if (!bound[k]) return snprintf(err, errn, "s%d is not the size of any input", k), -1;
  }
  for (int i = 0; i < g->n_guards; i++) {
    if (sym_guard_check(&g->guards[i], vals, g->n_syms) == 1) continue;
    char gt[256];
    if (sym_guard_print(&g->guards[i], gt, sizeof gt) < 0) snprintf(gt, sizeof gt, "?");
    return snprintf(err, errn, "guard %s fails", gt), -1;
  }
  return 0;
}

int *ir_leaf_ids(const ir_graph *g, int *n) {
  int *ids = alloc_malloc(sizeof *ids * (size_t)(g->n_nodes + 1));
  *n = 0;
  for (int i = 0; ids && i < g->n_nodes; i++)
    if (g->nodes[i].op == IR_INPUT || g->nodes[i].op == IR_PARAM) ids[(*n)++] = i;
  return ids;
}

int ir_bind_or(const ir_graph *g, const int *leaves, int n_leaves, kiln_tensor *const *in, kiln_tensor *const *params,
               const int64_t *bound, int64_t *vals) {
  char err[512];
  if (bound) {
    memcpy(vals, bound, sizeof(int64_t) * IR_MAX_SYMS);
    return 0;
  }
  if (!ir_bind_syms(g, leaves, n_leaves, in, params, vals, err, sizeof err)) return 0;
  err_set("", 0, "call", "%s: %s", g->name, err);
  return -1;
}

/* Copies value into dst's storage (same shape and dtype). */
static void write_data(kiln_tensor *dst, const kiln_tensor *value) {
  if (dst == value) return;
  pw_copy(dst, value);
  atomic_fetch_add(&dst->st->version, 1);
}

static int run(const ir_graph *g, kiln_tensor *const *consts, kiln_tensor *const *in, kiln_tensor *const *params,
               kiln_tensor **out, kiln_tensor **all, const int64_t *bound, const region_execs *rx);

/* ---- a region's values kept between its runs ---- */

/* A graph with constructs of its own, run as a region (a loop's step with a
 * cond or a scan inside) runs here once per step. Each run leaves every
 * value it made in its node's slot, and each loop its carry buffers, its
 * stacked ys, its predicate and its captures made contiguous; the next run
 * writes into those that nothing else holds any longer and have its sizes,
 * so a step makes no storage. One run at a time uses it (busy). */
struct interp_cache {
  atomic_bool busy;
  int n;
  kiln_tensor **val;  /* by node */
  kiln_tensor ***cf;  /* by node: a loop's slots (cf_slots) */
  int *n_cf;
};

struct interp_cache *interp_cache_new(const ir_graph *g) {
  struct interp_cache *c = alloc_calloc(1, sizeof *c);
  if (!c) return NULL;
  c->n = g->n_nodes;
  c->val = alloc_calloc((size_t)c->n + 1, sizeof *c->val);
  c->cf = alloc_calloc((size_t)c->n + 1, sizeof *c->cf);
  c->n_cf = alloc_calloc((size_t)c->n + 1, sizeof *c->n_cf);
  if (!c->val || !c->cf || !c->n_cf) return interp_cache_free(c), NULL;
  return c;
}

void interp_cache_free(struct interp_cache *c) {
  if (!c) return;
  for (int i = 0; i < c->n && c->val; i++) kiln_release(c->val[i]);
  for (int i = 0; i < c->n && c->cf; i++) {
    for (int k = 0; c->cf[i] && k < c->n_cf[i]; k++) kiln_release(c->cf[i][k]);
    alloc_free(c->cf[i]);
  }
  alloc_free(c->val), alloc_free(c->cf), alloc_free(c->n_cf);
  alloc_free(c);
}

struct interp_cache *interp_cache_take(struct interp_cache *c) {
  return c && !atomic_exchange(&c->busy, true) ? c : NULL;
}

void interp_cache_give(struct interp_cache *c) {
  if (c) atomic_store(&c->busy, false);
}

/* Whether t, a slot's tensor, may take a value of this type now: nothing but the slot holds it or its storage. */
static bool reusable(const kiln_tensor *t, kiln_dtype dt, int ndim, const int64_t *shape) {
  return t && tensor_refs(t) == 1 && atomic_load(&t->st->refcount) == 1 && t->dtype == dt && t->ndim == ndim &&
         (!ndim || !memcmp(t->shape, shape, sizeof *shape * (size_t)ndim));
}

/* A new tensor of this type (a reference of the caller's): *slot's when it
 * is reusable, else a new one that *slot keeps. slot NULL: a new one. */
static kiln_tensor *slot_tensor(kiln_tensor **slot, kiln_dtype dt, int ndim, const int64_t *shape) {
  if (slot && reusable(*slot, dt, ndim, shape)) return kiln_retain(*slot);
  kiln_tensor *t = tensor_new(dt, ndim, shape);
  if (slot && t) {
    kiln_release(*slot);
    *slot = kiln_retain(t);
  }
  return t;
}

/* op_run, its result in *slot's tensor where that is reusable (shape: the
 * result's), else a new one that *slot keeps when it owns its storage. */
static kiln_tensor *slot_run(kiln_tensor **slot, op_id op, kiln_tensor *const *in, int n, const op_attrs *a,
                             const int64_t *shape, int ndim, kiln_dtype dt, const char *file, int line) {
  if (slot && reusable(*slot, dt, ndim, shape)) {
    int rc = op_run_into(op, in, n, a, *slot, file, line);
    if (rc < 0) return NULL;
    if (rc == 0) return kiln_retain(*slot);
  }
  kiln_tensor *t = op_run(op, in, n, a, file, line);
  if (slot && t && !t->offset && tensor_contiguous(t) && atomic_load(&t->st->refcount) == 1) {
    kiln_release(*slot);
    *slot = kiln_retain(t);
  }
  return t;
}

/* Loop node id's slots in c (NULL: none kept): carry sets 0 and 1 (nc
 * each), the results (n_res: a scan's ys from nc on), the predicate, the
 * arguments made contiguous (n_args), the results' own copies (n_res). A
 * cond's: nc and n_args 0. */
static kiln_tensor **cf_slots(struct interp_cache *c, int id, int nc, int n_res, int n_args) {
  int n = 2 * nc + n_res + 1 + n_args + n_res;
  if (!c || id >= c->n) return NULL;
  if (c->cf[id] && c->n_cf[id] != n) return NULL; /* never: a node's counts do not change */
  if (!c->cf[id] && (c->cf[id] = alloc_calloc((size_t)n + 1, sizeof **c->cf))) c->n_cf[id] = n;
  return c->cf[id];
}

/* ---- control flow: regions run with the parent's sizes ---- */

/* Region k of node id: on its compiled exec when rx has one, else here. */
static int run_region(const ir_graph *g, int id, int k, const int64_t *vals, const region_execs *rx,
                      kiln_tensor *const *args, kiln_tensor **out) {
  backend_exec *x = rx && id < rx->n ? rx->sub[id][k] : NULL;
  if (x) return rx->be->run_bound(x, args, vals, out);
  return run(g->nodes[id].sub[k], NULL, args, NULL, out, NULL, vals, NULL);
}

static void release_n(kiln_tensor **ts, int n) {
  for (int i = 0; i < n; i++) {
    kiln_release(ts[i]);
    ts[i] = NULL;
  }
}

static int cf_oom(const ir_node *n) {
  err_set(n->file, n->line, ir_op_name(n->op), "out of memory");
  return -1;
}

/* A one-element bool's value. */
static bool pred_value(const kiln_tensor *p) { return *(const unsigned char *)tensor_data(p) != 0; }

/* A loop's captures from first on that are strided views (a transposed
 * weight, an expanded scalar) copied once into own[] and args[], when the
 * region runs compiled: its exec reads arguments as contiguous and would
 * copy them on every step. 0, or -1 out of memory. */
static int dense_captures(const ir_node *n, int first, bool compiled, kiln_tensor **args, int n_args, kiln_tensor **own,
                          kiln_tensor **slots) {
  for (int j = first; j < n_args && compiled; j++) {
    if (tensor_contiguous(args[j])) continue;
    if (!(own[j] = slot_run(slots ? &slots[j] : NULL, OP_COPY, &args[j], 1, NULL, args[j]->shape, args[j]->ndim,
                            args[j]->dtype, n->file, n->line)))
      return -1;
    args[j] = own[j];
  }
  return 0;
}

/* Outputs (n of them) copied into into[], then released. */
static int copy_into(kiln_tensor **out, int n, kiln_tensor *const *into) {
  for (int i = 0; i < n; i++) {
    pw_copy(into[i], out[i]);
    kiln_release(out[i]);
    out[i] = NULL;
  }
  return 0;
}

/* run_region writing output i into into[i] (contiguous, aliasing no
 * argument): a compiled exec stores there itself (backend.run_into), so a
 * loop's step allocates no result; else the results are copied there. */
static int run_region_into(const ir_graph *g, int id, int k, const int64_t *vals, const region_execs *rx,
                           kiln_tensor *const *args, kiln_tensor *const *into) {
  backend_exec *x = rx && id < rx->n ? rx->sub[id][k] : NULL;
  if (x && rx->be->run_into) return rx->be->run_into(x, args, vals, into);
  const ir_graph *r = g->nodes[id].sub[k];
  kiln_tensor *out[2 * 64 + 1] = {0}, **o = r->n_outputs <= 2 * 64 ? out : alloc_calloc((size_t)r->n_outputs, sizeof *o);
  if (!o) return cf_oom(&g->nodes[id]);
  int rc = run_region(g, id, k, vals, rx, args, o);
  if (!rc) copy_into(o, r->n_outputs, into);
  if (o != out) alloc_free(o);
  return rc;
}

/* Two sets of n carry tensors shaped like like[j], which a loop's steps
 * write in turn (one is the step's arguments, the other its results). */
static int carry_buffers(kiln_tensor *const *like, int n, kiln_tensor **set0, kiln_tensor **set1, kiln_tensor **slots) {
  for (int j = 0; j < n; j++) {
    set0[j] = slot_tensor(slots ? &slots[j] : NULL, like[j]->dtype, like[j]->ndim, like[j]->shape);
    set1[j] = slot_tensor(slots ? &slots[n + j] : NULL, like[j]->dtype, like[j]->ndim, like[j]->shape);
    if (!set0[j] || !set1[j]) return -1;
  }
  return 0;
}

int interp_cf_run(const ir_graph *g, int id, kiln_tensor *const *x, const int64_t *vals, const region_execs *rx,
                  struct interp_cache *cache, const cf_stream *st, bool own_results, kiln_tensor ***res) {
  const ir_node *n = &g->nodes[id];
  int n_res = ir_cf_n_results(n), n_args = ir_cf_n_args(g, id, 0), rc = 0;
  kiln_tensor **r = alloc_calloc((size_t)n_res + 1, sizeof *r);
  kiln_tensor **args = alloc_calloc((size_t)n_args + 1, sizeof *args);
  kiln_tensor **step = alloc_calloc((size_t)n_res + 1, sizeof *step);
  kiln_tensor **own = alloc_calloc((size_t)n_args + 1, sizeof *own); /* captures made contiguous */
  if (!r || !args || !step || !own) {
    rc = cf_oom(n);
    goto done;
  }
  if (n->op == IR_COND && cache) {
    /* kept between runs: the results go into the tensors of the run before */
    kiln_tensor **slots = cf_slots(cache, id, 0, n_res, 0);
    const ir_graph *br = n->sub[0];
    for (int j = 0; j < n_args; j++) args[j] = x[j + 1];
    for (int k = 0; k < n_res && !rc; k++) {
      const ir_node *y = &br->nodes[br->outputs[k]];
      int64_t shape[MAXD];
      if (ir_node_shape(y, vals, g->n_syms, shape) ||
          !(r[k] = slot_tensor(slots ? &slots[k] : NULL, y->dtype, y->ndim, shape)))
        rc = cf_oom(n);
    }
    if (!rc) rc = run_region_into(g, id, pred_value(x[0]) ? 0 : 1, vals, rx, args, r);
    if (rc) release_n(r, n_res);
  } else if (n->op == IR_COND) {
    for (int j = 0; j < n_args; j++) args[j] = x[j + 1];
    rc = run_region(g, id, pred_value(x[0]) ? 0 : 1, vals, rx, args, r);
  } else {
    /* a loop: the carry's two sets of buffers are made once, and each step
     * writes the next carry into the set its arguments are not in (and a
     * scan's ys into their rows of the stacked results): steps allocate
     * nothing when the region is compiled (backend.run_into) */
    int nc = n->n_carry, nx = n->op == IR_SCAN ? n->n_xs : 0;
    kiln_tensor *set[2][64] = {{0}}, *init[64], *pred = NULL, **rows = step;
    kiln_tensor **slots = cf_slots(cache, id, nc, n_res, n_args), **pslot = slots ? &slots[2 * nc + n_res] : NULL;
    int64_t T = n->op == IR_SCAN ? x[nc]->shape[0] : -1;
    for (int j = 0; j < n_args; j++) args[j] = j < nc || j >= nc + nx ? x[j] : NULL;
    if (dense_captures(n, nc + nx, rx && id < rx->n, args, n_args, own, slots ? slots + 2 * nc + n_res + 1 : NULL))
      rc = cf_oom(n);
    for (int j = 0; j < nc && j < 64; j++) init[j] = x[j];
    if (nc > 64 || carry_buffers(init, nc, set[0], set[1], slots)) rc = cf_oom(n);
    if (!rc && n->op == IR_WHILE) {
      const ir_node *pn = &n->sub[0]->nodes[n->sub[0]->outputs[0]];
      int64_t shape[MAXD];
      if (ir_node_shape(pn, vals, g->n_syms, shape) || !(pred = slot_tensor(pslot, pn->dtype, pn->ndim, shape))) rc = cf_oom(n);
    }
    /* a scan's ys stack into tensors of their own; xs[t] and y[t] are views moved along dim 0 */
    const ir_graph *body = n->sub[n->op == IR_SCAN ? 0 : 1];
    for (int k = nc; k < n_res && !rc; k++) {
      const ir_node *y = &body->nodes[body->outputs[k]];
      int64_t shape[MAXD];
      shape[0] = T;
      if (ir_node_shape(y, vals, g->n_syms, shape + 1) ||
          !(r[k] = slot_tensor(slots ? &slots[2 * nc + k] : NULL, y->dtype, y->ndim + 1, shape)) ||
          !(rows[k] = tensor_view(r[k], r[k]->ndim - 1, r[k]->shape + 1, r[k]->stride + 1, r[k]->offset)))
        rc = cf_oom(n);
    }
    for (int j = nc; j < nc + nx && !rc; j++) {
      kiln_tensor *xj = x[j];
      if (!(args[j] = tensor_view(xj, xj->ndim - 1, xj->shape + 1, xj->stride + 1, xj->offset))) rc = cf_oom(n);
    }
    int s = 0;
    for (int64_t t = 0; !rc && (n->op == IR_WHILE || t < T); t++) {
      if (n->op == IR_WHILE) {
        if ((rc = run_region_into(g, id, 0, vals, rx, args, &pred)) || !pred_value(pred)) break;
      } else {
        if (st && t % st->k == 0 && (rc = st->fill(st->ctx, t, T - t < st->k ? T - t : st->k))) break;
        for (int j = nc; j < nc + nx; j++)
          args[j]->offset = x[j]->offset + (st && j == st->j ? t % st->k : t) * x[j]->stride[0];
        for (int k = nc; k < n_res; k++) rows[k]->offset = r[k]->offset + t * r[k]->stride[0];
      }
      memcpy(rows, set[s], sizeof *rows * (size_t)nc);
      if ((rc = run_region_into(g, id, n->op == IR_SCAN ? 0 : 1, vals, rx, args, rows))) break;
      memcpy(args, set[s], sizeof *args * (size_t)nc);
      s ^= 1;
    }
    /* the last carry: the set last written, or init when no step ran */
    for (int j = 0; j < nc; j++) r[j] = kiln_retain(args[j]);
    for (int j = nc; j < nc + nx; j++) kiln_release(args[j]);
    for (int k = nc; k < n_res; k++) kiln_release(rows[k]), rows[k] = NULL;
    for (int j = 0; j < nc; j++) kiln_release(set[0][j]), kiln_release(set[1][j]);
    kiln_release(pred);
    if (rc) release_n(r, n_res);
  }
  /* results of storage of their own: a copy (kept in the cache's slots
   * after the loop's) where one shares an operand's or an earlier one's */
  for (int i = 0; own_results && !rc && i < n_res; i++) {
    bool shared = false;
    for (int j = 0; j < n->n_in && !shared; j++) shared = r[i]->st == x[j]->st;
    for (int q = 0; q < i && !shared; q++) shared = r[i]->st == r[q]->st;
    if (!shared) continue;
    int nc = n->op == IR_COND ? 0 : n->n_carry, na = n->op == IR_COND ? 0 : n_args;
    kiln_tensor **slots = cf_slots(cache, id, nc, n_res, na);
    kiln_tensor *c = slot_run(slots ? &slots[2 * nc + n_res + 1 + na + i] : NULL, OP_COPY, &r[i], 1, NULL, r[i]->shape,
                              r[i]->ndim, r[i]->dtype, n->file, n->line);
    kiln_release(r[i]);
    r[i] = c;
    if (!c) {
      rc = -1;
      release_n(r, n_res);
    }
  }
done:
  if (own) release_n(own, n_args);
  alloc_free(own);
  alloc_free(args);
  alloc_free(step);
  if (rc) {
    alloc_free(r);
    r = NULL;
  }
  *res = r;
  return rc;
}

/* all: when not NULL, every node's value is kept there (retained) and
 * nothing is written back: the check mode's view of the whole graph (a
 * tuple's value is NULL). bound: a region's symbol values (its parent's),
 * else they bind from the inputs. */
static int run(const ir_graph *g, kiln_tensor *const *consts, kiln_tensor *const *in, kiln_tensor *const *params,
               kiln_tensor **out, kiln_tensor **all, const int64_t *bound, const region_execs *rx) {
  int64_t vals[IR_MAX_SYMS];
  if (ir_bind_or(g, NULL, 0, in, params, bound, vals)) return -1;
  /* a region's run keeps its values for the next (interp_cache) */
  struct interp_cache *cache = bound && !all && rx && rx->cache && rx->cache->n == g->n_nodes &&
                                       !atomic_exchange(&rx->cache->busy, true)
                                   ? rx->cache
                                   : NULL;
  int *uses = ir_use_counts(g);
  kiln_tensor **v = alloc_calloc((size_t)g->n_nodes + 1, sizeof *v);
  bool *owned = alloc_calloc((size_t)g->n_nodes + 1, sizeof *owned);
  kiln_tensor ***tup = alloc_calloc((size_t)g->n_nodes + 1, sizeof *tup); /* control-flow results */
  /* grad writes whose condition fails (a region writes nothing: no allocation per step) */
  bool *skipped = g->n_writes ? alloc_calloc((size_t)g->n_writes, sizeof *skipped) : NULL;
  int rc = -1;
  if (!uses || !v || !owned || !tup || (g->n_writes && !skipped)) {
    err_set("", 0, "call", "%s: out of memory", g->name);
    goto done;
  }
  kiln_no_grad_begin();
  for (int i = 0; i < g->n_nodes; i++) {
    const ir_node *n = &g->nodes[i];
    if (ir_is_cf(n->op)) {
      kiln_tensor *xa[16], **x = n->n_in <= 16 ? xa : alloc_malloc(sizeof *x * (size_t)n->n_in);
      if (!x) {
        err_set(n->file, n->line, ir_op_name(n->op), "out of memory");
        goto fail;
      }
      for (int j = 0; j < n->n_in; j++) x[j] = v[n->in[j]];
      int cr = interp_cf_run(g, i, x, vals, rx, cache, NULL, false, &tup[i]);
      if (x != xa) alloc_free(x);
      if (cr) goto fail;
      continue;
    }
    if (n->op == IR_GET) {
      v[i] = kiln_retain(tup[n->in[0]][n->attrs.k]);
      owned[i] = true;
      continue;
    }
    if (n->op == IR_NUMEL) {
      int64_t c;
      v[i] = slot_tensor(cache ? &cache->val[i] : NULL, n->dtype, 0, NULL);
      owned[i] = true;
      if (!v[i] || sym_eval(ir_numel_value(g, n), vals, g->n_syms, &c)) {
        err_set(n->file, n->line, "numel", "%s: %%%d: cannot evaluate", g->name, i);
        goto fail;
      }
      pw_fill(v[i], (double)c);
      continue;
    }
    if (n->op >= IR_INPUT) {
      if (n->op == IR_CONST) {
        /* a region's constants made once, as a backend's are */
        if (!consts && cache && !cache->val[i]) cache->val[i] = ir_const_tensor(n);
        v[i] = consts ? consts[i] : cache ? kiln_retain(cache->val[i]) : ir_const_tensor(n);
        owned[i] = !consts;
        if (!v[i]) {
          err_set(n->file, n->line, "const", "out of memory");
          goto fail;
        }
      } else {
        v[i] = ir_leaf_tensor(g, n, in, params);
        if (!v[i]) {
          err_set(n->file, n->line, "call", "%s: %%%d: the .grad it reads is NULL", g->name, i);
          goto fail;
        }
      }
      continue;
    }
    kiln_tensor *args[16], **a = n->n_in <= 16 ? args : alloc_malloc(sizeof *a * (size_t)n->n_in);
    if (!a) {
      err_set(n->file, n->line, ir_op_name(n->op), "out of memory");
      goto fail;
    }
    for (int j = 0; j < n->n_in; j++) a[j] = v[n->in[j]];
    op_attrs at;
    if (ir_attrs_eval(n, vals, g->n_syms, &at)) {
      if (a != args) alloc_free(a);
      err_set(n->file, n->line, ir_op_name(n->op), "%s: %%%d: attributes do not evaluate", g->name, i);
      goto fail;
    }
    int64_t shape[MAXD];
    bool shaped = !ir_node_shape(n, vals, g->n_syms, shape);
    v[i] = cache && shaped ? slot_run(&cache->val[i], (op_id)n->op, a, n->n_in, &at, shape, n->ndim, n->dtype, n->file, n->line)
                           : op_run((op_id)n->op, a, n->n_in, &at, n->file, n->line);
    owned[i] = true;
    if (a != args) alloc_free(a);
    if (!v[i]) goto fail;
    if (v[i]->dtype != n->dtype || v[i]->ndim != n->ndim || !shaped ||
        memcmp(shape, v[i]->shape, sizeof(int64_t) * (size_t)n->ndim)) {
      err_set(n->file, n->line, ir_op_name(n->op), "%s: %%%d: the result's shape differs from the graph's", g->name, i);
      goto fail;
    }
    /* free inputs at their last use */
    for (int j = 0; j < n->n_in && !all; j++) {
      int k = n->in[j];
      if (--uses[k] == 0 && owned[k]) {
        kiln_release(v[k]);
        v[k] = NULL;
      }
    }
  }
  if (all) {
    for (int i = 0; i < g->n_nodes; i++) all[i] = kiln_retain(v[i]);
    rc = 0;
    goto fail;
  }
  for (int i = 0; i < g->n_outputs; i++) out[i] = kiln_retain(v[g->outputs[i]]);
  if (ir_outputs_before_writes(g, out, g->n_outputs, in, params)) {
    for (int j = 0; j < g->n_outputs; j++) kiln_release(out[j]), out[j] = NULL;
    goto fail;
  }
  /* writes after every read: in-place updates take effect at the end of the call */
  for (int i = 0; i < g->n_writes; i++) {
    /* a grad write's condition, read before a data write can change it */
    const ir_write *w = &g->writes[i];
    if (w->kind == IR_WRITE_GRAD && ir_write_skipped(g, w, vals, w->has_cond ? v[w->cond] : NULL)) skipped[i] = true;
  }
  for (int i = 0; i < g->n_writes; i++) {
    const ir_write *w = &g->writes[i];
    kiln_tensor *dst = ir_leaf_tensor(g, &g->nodes[w->target], in, params);
    if (w->kind == IR_WRITE_DATA) {
      write_data(dst, v[w->value]);
      continue;
    }
    if (skipped[i] && !w->else_none) continue;
    kiln_tensor *gv = NULL;
    if (!skipped[i] && w->value >= 0) {
      /* .grad is a tensor of its own, as in eager */
      kiln_tensor *src = v[w->value];
      gv = owned[w->value] && tensor_refs(src) == 1 ? kiln_retain(src) : op_run(OP_COPY, &src, 1, NULL, w->file, w->line);
      if (!gv) {
        for (int j = 0; j < g->n_outputs; j++) kiln_release(out[j]), out[j] = NULL;
        goto fail;
      }
    }
    kiln_release(dst->grad);
    dst->grad = gv;
  }
  rc = 0;
fail:
  kiln_no_grad_end();
  for (int i = 0; i < g->n_nodes; i++) {
    if (owned[i]) kiln_release(v[i]);
    if (tup[i]) release_n(tup[i], ir_cf_n_results(&g->nodes[i]));
    alloc_free(tup[i]);
  }
done:
  if (cache) atomic_store(&cache->busy, false);
  alloc_free(uses);
  alloc_free(v);
  alloc_free(owned);
  alloc_free(tup);
  alloc_free(skipped);
  return rc;
}

int interp_run(const ir_graph *g, kiln_tensor *const *in, kiln_tensor *const *params, kiln_tensor **out) {
  return run(g, NULL, in, params, out, NULL, NULL, NULL);
}

int interp_values(const ir_graph *g, kiln_tensor *const *in, kiln_tensor *const *params, kiln_tensor **all) {
  return run(g, NULL, in, params, NULL, all, NULL, NULL);
}

int interp_values_bound(const ir_graph *g, kiln_tensor *const *in, const int64_t *vals, kiln_tensor **all) {
  return run(g, NULL, in, NULL, NULL, all, vals, NULL);
}

/* ---- as a backend: constants made once ---- */

struct backend_exec {
  const ir_graph *g;
  kiln_tensor **consts; /* by node id; NULL for other nodes */
};

static backend_exec *interp_compile(const ir_graph *g, unsigned dump, FILE *dump_to, char *err, size_t errn) {
  (void)dump, (void)dump_to;
  backend_exec *e = alloc_calloc(1, sizeof *e);
  if (e) e->consts = alloc_calloc((size_t)g->n_nodes + 1, sizeof *e->consts);
  if (!e || !e->consts) goto oom;
  e->g = g;
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i].op == IR_CONST && !(e->consts[i] = ir_const_tensor(&g->nodes[i]))) goto oom;
  return e;
oom:
  snprintf(err, errn, "out of memory");
  if (e && e->consts)
    for (int i = 0; i < g->n_nodes; i++) kiln_release(e->consts[i]);
  if (e) alloc_free(e->consts);
  alloc_free(e);
  return NULL;
}

static int interp_exec(backend_exec *e, kiln_tensor *const *in, kiln_tensor *const *params, kiln_tensor **out) {
  return run(e->g, e->consts, in, params, out, NULL, NULL, NULL);
}

static int interp_exec_bound(backend_exec *e, kiln_tensor *const *in, const int64_t *vals, kiln_tensor **out) {
  return run(e->g, e->consts, in, NULL, out, NULL, vals, NULL);
}

int interp_run_with(const ir_graph *g, kiln_tensor *const *in, kiln_tensor *const *params, const int64_t *bound,
                    const region_execs *rx, kiln_tensor **out) {
  return run(g, NULL, in, params, out, NULL, bound, rx);
}

int interp_run_into(const ir_graph *g, kiln_tensor *const *in, const int64_t *bound, const region_execs *rx,
                    kiln_tensor *const *into) {
  kiln_tensor *out[2 * 64 + 1] = {0}, **o = g->n_outputs <= 2 * 64 ? out : alloc_calloc((size_t)g->n_outputs, sizeof *o);
  if (!o) return err_set("", 0, "call", "%s: out of memory", g->name), -1;
  int rc = run(g, NULL, in, NULL, o, NULL, bound, rx);
  if (!rc) copy_into(o, g->n_outputs, into);
  if (o != out) alloc_free(o);
  return rc;
}

/* ---- check mode through compiled regions ---- */

int region_execs_check(const ir_graph *g, kiln_tensor *const *in, kiln_tensor *const *params, const int64_t *bound,
                       const region_execs *rx, char *report, size_t rn) {
  int64_t vals[IR_MAX_SYMS];
  if (ir_bind_or(g, NULL, 0, in, params, bound, vals)) return -1;
  kiln_tensor **all = alloc_calloc((size_t)g->n_nodes + 1, sizeof *all), *args[2 * 64 + 64] = {0}, *p = NULL;
  int rc = all ? run(g, NULL, in, params, NULL, all, vals, rx) : (err_set("", 0, "call", "out of memory"), -1);
  for (int id = 0; id < g->n_nodes && rc == 0; id++) {
    const ir_node *n = &g->nodes[id];
    if (!ir_is_cf(n->op) || id >= rx->n) continue;
    int na = ir_cf_n_args(g, id, 0), k = 0, nv = 0;
    kiln_tensor *views[64];
    if (na > (int)(sizeof args / sizeof args[0])) continue;
    for (int j = 0; j < na; j++) args[j] = all[n->in[n->op == IR_COND ? j + 1 : j]];
    if (n->op == IR_COND) k = pred_value(all[n->in[0]]) ? 0 : 1;
    if (n->op == IR_SCAN) {
      if (all[n->in[n->n_carry]]->shape[0] == 0) continue;
      for (int j = 0; j < n->n_xs && rc == 0; j++) {
        kiln_tensor *x = args[n->n_carry + j];
        views[nv] = tensor_view(x, x->ndim - 1, x->shape + 1, x->stride + 1, x->offset);
        if (!views[nv]) rc = cf_oom(n);
        args[n->n_carry + j] = views[nv++];
      }
    }
    for (int pass = 0; rc == 0 && pass < (n->op == IR_WHILE ? 2 : 1); pass++, k++) {
      if (pass == 1) {
        /* the body's first step runs only when the condition holds at the start */
        if ((rc = run_region(g, id, 0, vals, NULL, args, &p))) break;
        bool go = pred_value(p);
        kiln_release(p);
        if (!go) break;
      }
      rc = rx->sub[id][k] && rx->be->check_bound ? rx->be->check_bound(rx->sub[id][k], args, vals, report, rn) : 0;
      if (rc == 1) {
        char inner[1024];
        snprintf(inner, sizeof inner, "%s", report);
        snprintf(report, rn, "in region '%s' of %%%d (%s at %s:%d), its first step: %s", ir_sub_name(n->op, k), id,
                 ir_op_name(n->op), n->file, n->line, inner);
      }
    }
    for (int j = 0; j < nv; j++) kiln_release(views[j]);
  }
  for (int i = 0; all && i < g->n_nodes; i++) kiln_release(all[i]);
  alloc_free(all);
  return rc;
}

static void interp_free(backend_exec *e) {
  if (!e) return;
  for (int i = 0; i < e->g->n_nodes; i++) kiln_release(e->consts[i]);
  alloc_free(e->consts);
  alloc_free(e);
}

const backend backend_interp = {"interp", interp_compile, interp_exec, interp_free, NULL, NULL, interp_exec_bound, NULL, NULL};
