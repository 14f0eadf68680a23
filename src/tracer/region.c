/* Control-flow nodes and the regions they own. A cond, while or scan node
 * holds one or two region graphs: graphs whose leaves are inputs only (the
 * region's arguments), whose outputs are what the region gives back, and
 * whose symbols are the parent's (the region borrows its sym_ctx, so a dim
 * means the same inside and out). Regions are reference counted, because
 * the passes copy nodes from graph to graph and each copy holds them.
 *
 * A control-flow node makes a tuple; IR_GET nodes read its results. These
 * functions say what types its regions take and give (docs/ir.md). */
#include <string.h>

#include "tracer/tracer.h"

int ir_n_sub(int op) { return op == IR_SCAN ? 1 : ir_is_cf(op) ? 2 : 0; }

const char *ir_sub_name(int op, int i) {
  if (op == IR_COND) return i ? "else" : "then";
  if (op == IR_WHILE) return i ? "body" : "cond";
  return "body";
}

ir_graph *ir_region_new(ir_graph *parent, const char *name) {
  ir_graph *g = ir_new(name);
  if (!g) return NULL;
  sym_ctx_free(g->sym);
  g->sym = parent->sym;
  g->region = true;
  g->refs = 1;
  ir_region_sync(g, parent);
  return g;
}

ir_graph *ir_region_hold(ir_graph *r) {
  if (r) r->refs++;
  return r;
}

void ir_region_sync(ir_graph *r, const ir_graph *parent) {
  r->n_syms = parent->n_syms;
  memcpy(r->sym_lo, parent->sym_lo, sizeof r->sym_lo);
  memcpy(r->sym_hi, parent->sym_hi, sizeof r->sym_hi);
  for (int i = 0; i < r->n_nodes; i++)
    for (int k = 0; k < 2; k++)
      if (r->nodes[i].sub[k]) ir_region_sync(r->nodes[i].sub[k], r);
}

int ir_cf_n_results(const ir_node *n) {
  if (!ir_is_cf(n->op)) return 0;
  const ir_graph *r = n->sub[n->op == IR_WHILE ? 1 : 0];
  return r ? r->n_outputs : 0;
}

static void set_type(ir_node *out, const ir_node *t) {
  out->dtype = t->dtype;
  out->ndim = t->ndim;
  memcpy(out->shape, t->shape, sizeof out->shape);
}

int ir_cf_result_type(const ir_graph *g, int id, int k, ir_node *out) {
  const ir_node *n = &g->nodes[id];
  const ir_graph *r = n->sub[n->op == IR_WHILE ? 1 : 0];
  if (!ir_is_cf(n->op) || !r || k < 0 || k >= r->n_outputs) return -1;
  set_type(out, &r->nodes[r->outputs[k]]);
  if (n->op == IR_SCAN && k >= n->n_carry) {
    /* a y: the steps' values stacked along a new dim 0 of xs[0]'s length */
    if (out->ndim >= MAXD || n->n_xs < 1 || n->n_in <= n->n_carry) return -1;
    const ir_node *x = &g->nodes[n->in[n->n_carry]];
    if (x->ndim < 1) return -1;
    memmove(out->shape + 1, out->shape, sizeof out->shape[0] * (size_t)out->ndim);
    out->shape[0] = x->shape[0];
    out->ndim++;
  }
  return 0;
}

int ir_cf_n_args(const ir_graph *g, int id, int i) {
  const ir_node *n = &g->nodes[id];
  (void)i;
  return n->op == IR_COND ? n->n_in - 1 : n->n_in;
}

int ir_cf_arg_type(const ir_graph *g, int id, int i, int j, ir_node *out) {
  const ir_node *n = &g->nodes[id];
  if (j < 0 || j >= ir_cf_n_args(g, id, i)) return -1;
  const ir_node *x = &g->nodes[n->in[n->op == IR_COND ? j + 1 : j]];
  set_type(out, x);
  if (n->op == IR_SCAN && j >= n->n_carry && j < n->n_carry + n->n_xs) {
    /* xs[t]: the slice at step t, its dim 0 dropped */
    if (x->ndim < 1) return -1;
    out->ndim = x->ndim - 1;
    memmove(out->shape, x->shape + 1, sizeof out->shape[0] * (size_t)out->ndim);
  }
  return 0;
}

/* ---- compiled regions ---- */

int region_execs_compile(const ir_graph *g, const backend *be, unsigned dump, FILE *dump_to, region_execs *rx,
                         char *err, size_t errn) {
  memset(rx, 0, sizeof *rx);
  rx->be = be;
  rx->sub = alloc_calloc((size_t)g->n_nodes + 1, sizeof *rx->sub);
  if (!rx->sub) return snprintf(err, errn, "out of memory"), -1;
  rx->n = g->n_nodes;
  if (!(rx->cache = interp_cache_new(g))) return region_execs_free(rx), snprintf(err, errn, "out of memory"), -1;
  for (int i = 0; i < g->n_nodes; i++)
    for (int k = 0; k < ir_n_sub(g->nodes[i].op); k++) {
      char why[512];
      if ((rx->sub[i][k] = be->compile(g->nodes[i].sub[k], dump, dump_to, why, sizeof why))) continue;
      snprintf(err, errn, "%%%d: %s: region '%s': %s", i, ir_op_name(g->nodes[i].op), ir_sub_name(g->nodes[i].op, k), why);
      region_execs_free(rx);
      return -1;
    }
  return 0;
}

void region_execs_free(region_execs *rx) {
  for (int i = 0; rx->sub && i < rx->n; i++)
    for (int k = 0; k < 2; k++)
      if (rx->sub[i][k]) rx->be->free(rx->sub[i][k]);
  alloc_free(rx->sub);
  interp_cache_free(rx->cache);
  memset(rx, 0, sizeof *rx);
}
