/* The build_state: a graph from a recording's events. Each event becomes a node
 * (interned, so common subexpressions merge), with the symbolic shape the op
 * table's rule gives; the leaves are the call's inputs, the params the body
 * reached, their .grads, and values carried from earlier segments.
 *
 * The numbers user code passed (reshape targets, slice bounds, a factory's
 * sizes and fill value) are slots. Each slot gets a rule the later calls are
 * held to: a constant it must equal, a size expression it must equal, or an
 * argument (a symbol, or a scalar input) it sets on every call. A number is
 * decided from two observations when there are two: the same number at the
 * same place of an earlier call with other sizes is a literal; one that
 * changed with the sizes is the expression that explains both, else an
 * argument. With one observation a user's number is a constant, and a number
 * kiln's own formulas passed is the one size of the trace that has it
 * (verified on every call, so a wrong guess retraces, never misleads). */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "tracer/tracer.h"

static void bfail(build_state *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bfail(build_state *b, const char *fmt, ...) {
  if (b->failed) return;
  b->failed = true;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(b->why, sizeof b->why, fmt, ap);
  va_end(ap);
}

/* ---- symbols ---- */

static sym_dim sym_of(build_state *b, int k) { return sym_var(b->g->sym, k, b->sym[k].lo, b->sym[k].hi); }

static int64_t dim_value(const build_state *b, sym_dim d) {
  int64_t v = -1;
  if (sym_eval(d, b->vals, b->n_syms, &v)) return -1;
  return v;
}

/* d's value at the earlier observation; false when it has none. */
static bool prev_value(const build_state *b, sym_dim d, int64_t *v) {
  for (int k = 0; k < b->n_syms; k++)
    if (!b->has_prev[k]) {
      /* d may not use k: test by evaluating with another value for it */
      int64_t a, c, alt[IR_MAX_SYMS];
      memcpy(alt, b->prev_vals, sizeof alt);
      alt[k] = b->vals[k];
      if (sym_eval(d, alt, b->n_syms, &a)) return false;
      alt[k] = b->vals[k] + 1;
      if (sym_eval(d, alt, b->n_syms, &c) || a != c) return false;
    }
  return sym_eval(d, b->prev_vals, b->n_syms, v) == 0;
}

/* Declares the variant's symbols in the segment's graph. */
static int declare_syms(build_state *b) {
  for (int k = 0; k < b->n_syms; k++) {
    sym_dim d;
    if (ir_add_sym(b->g, b->sym[k].lo, b->sym[k].hi, &d)) return -1;
  }
  return 0;
}

/* A new argument symbol, bound from a slot on every call (value v now, pv at the earlier call). */
static sym_dim new_arg_sym_in(build_state *b, int64_t v, bool has_pv, int64_t pv, int64_t lo, int64_t hi, int *arg);
static sym_dim new_arg_sym(build_state *b, int64_t v, bool has_pv, int64_t pv, int *arg) {
  return new_arg_sym_in(b, v, has_pv, pv, v < 0 ? INT64_MIN / 4 : 0, INT64_MAX / 4, arg);
}
static sym_dim new_arg_sym_in(build_state *b, int64_t v, bool has_pv, int64_t pv, int64_t lo, int64_t hi, int *arg) {
  /* a call binds at most IR_MAX_SYMS arguments, sizes and scalars together */
  if (b->n_syms == IR_MAX_SYMS || b->n_args == IR_MAX_SYMS ||
      alloc_grow((void **)&b->args, &b->cap_args, b->n_args + 1, sizeof *b->args)) {
    bfail(b, "more than %d symbolic sizes and numbers passed at run time", IR_MAX_SYMS);
    return sym_error();
  }
  int k = b->n_syms++;
  b->sym[k] = (build_sym){.input = -1, .dim = 0, .arg = b->n_args, .lo = lo, .hi = hi};
  b->vals[k] = v;
  b->has_prev[k] = has_pv;
  b->prev_vals[k] = pv;
  b->args[b->n_args] = (build_arg){.is_float = false, .sym = k};
  *arg = b->n_args++;
  sym_dim d;
  if (ir_add_sym(b->g, b->sym[k].lo, b->sym[k].hi, &d)) {
    bfail(b, "out of memory while building");
    return sym_error();
  }
  return d;
}

/* ---- sizes seen: what a number kiln's formulas pass is ---- */

static void note_size(build_state *b, sym_dim d) {
  int64_t v = dim_value(b, d);
  if (v < 2 || sym_is_const(d)) return;
  if (!b->sizes_cap) {
    b->sizes = alloc_calloc(256, sizeof *b->sizes);
    if (!b->sizes) return;
    b->sizes_cap = 256;
  }
  size_t i = hash64((uint64_t)v) & (b->sizes_cap - 1);
  for (size_t probes = 0; probes < b->sizes_cap; probes++, i = (i + 1) & (b->sizes_cap - 1)) {
    build_size *e = &b->sizes[i];
    if (!e->used) {
      *e = (build_size){.v = v, .d = d, .used = true};
      return;
    }
    if (e->v == v) {
      if (!sym_same(e->d, d)) e->ambiguous = true;
      return;
    }
  }
}

static void note_shape(build_state *b, const ir_node *n) {
  for (int i = 0; i < n->ndim; i++) note_size(b, n->shape[i]);
}

/* The one symbolic size of the segment with value v, or the error dim. */
static sym_dim seen_size(build_state *b, int64_t v) {
  if (v < 2 || !b->sizes_cap) return sym_error();
  size_t i = hash64((uint64_t)v) & (b->sizes_cap - 1);
  for (size_t probes = 0; probes < b->sizes_cap; probes++, i = (i + 1) & (b->sizes_cap - 1)) {
    build_size *e = &b->sizes[i];
    if (!e->used) break;
    if (e->v == v) return e->ambiguous ? sym_error() : e->d;
  }
  return sym_error();
}

/* The node value v has in the segment so far (an input's always), or -1. */
static int known_node(const build_state *b, int v) {
  if (b->node[v] >= 0) return b->node[v];
  const rec_value *rv = &b->r->val[v];
  return rv->kind == RV_INPUT ? b->input_node[rv->index] : -1;
}

/* The one size the body read (or product of two) whose value is v, or the error dim. */
static sym_dim read_size(build_state *b, int64_t v) {
  if (v < 2) return sym_error();
  const recording *r = b->r;
  sym_dim found = sym_error();
  for (int i = 0; i < r->n_reads; i++)
    for (int j = i; j <= r->n_reads; j++) {
      int ni = known_node(b, r->reads[i].value), nj = j < r->n_reads ? known_node(b, r->reads[j].value) : -1;
      if (ni < 0 || (j < r->n_reads && nj < 0)) continue;
      sym_dim x = b->g->nodes[ni].shape[r->reads[i].dim];
      if (j < r->n_reads) x = sym_mul(b->g->sym, x, b->g->nodes[nj].shape[r->reads[j].dim]);
      if (sym_is_err(x) || sym_is_const(x) || dim_value(b, x) != v) continue;
      if (!sym_is_err(found) && !sym_same(found, x)) return sym_error();
      found = x;
    }
  return found;
}

/* ---- slots ---- */

/* Dim i of the value whose shape event e was given (rec_event.src), or the
 * error dim: none, or a value of another rank. */
static sym_dim src_dim(build_state *b, const rec_event *e, int i) {
  int n = e->src >= 0 ? known_node(b, e->src) : -1;
  if (n < 0 || b->g->nodes[n].ndim != e->a->ndim) return sym_error();
  return b->g->nodes[n].shape[i];
}

static int add_rule(build_state *b, slot_rule rule) {
  if (alloc_grow((void **)&b->rules, &b->cap_rules, b->n_rules + 1, sizeof *b->rules)) {
    bfail(b, "out of memory while building");
    return -1;
  }
  b->rules[b->n_rules++] = rule;
  return 0;
}

/* The earlier observation of slot si of event ev, when the earlier call reached the same event. */
static bool prev_slot(const build_state *b, int ev, int si, rec_slot *out) {
  const build_prev *p = b->prev;
  if (!p || ev >= p->n_ev || ev >= b->aligned) return false;
  rec_slot s[2 * MAXD + 8];
  int n = rec_slots(&p->ev[ev], s, (int)(sizeof s / sizeof s[0]));
  if (si >= n) return false;
  *out = s[si];
  return true;
}

/* Whether slot si of event ev was an argument of the earlier variant: a
 * number that changed there stays one, or two numbers that change on
 * alternate calls would each make the other a constant again, and every
 * call would compile. */
static bool prev_arg(const build_state *b, int ev, int si) {
  const build_prev *p = b->prev;
  if (!p || !p->rules || ev >= p->n_ev || ev >= b->aligned || si >= p->rule_at[ev + 1] - p->rule_at[ev]) return false;
  return p->rules[p->rule_at[ev] + si].kind == SLOT_ARG;
}

/* A candidate expression that takes the value v now and pv at the earlier
 * call: a*x + c over a symbol or, when no one symbol explains it, a product
 * of two, a != 0 (pos + 1 is pos's neighbour, not pos*pos + 1). */
static sym_dim explain_by(build_state *b, int64_t v, int64_t pv, bool products);
static sym_dim explain(build_state *b, int64_t v, int64_t pv) {
  sym_dim d = explain_by(b, v, pv, false);
  return sym_is_err(d) ? explain_by(b, v, pv, true) : d;
}
static sym_dim explain_by(build_state *b, int64_t v, int64_t pv, bool products) {
  sym_dim found = sym_error();
  int nfound = 0;
  for (int i = 0; i < b->n_syms && nfound < 2; i++) {
    if (!b->has_prev[i]) continue;
    for (int j = products ? i : b->n_syms; j <= b->n_syms && nfound < 2; j++) {
      /* j == n_syms: the symbol alone; else the product of two */
      if (j < b->n_syms && !b->has_prev[j]) continue;
      sym_dim x = j == b->n_syms ? sym_of(b, i) : sym_mul(b->g->sym, sym_of(b, i), sym_of(b, j));
      int64_t xn = dim_value(b, x), xp;
      if (xn < 0 || !prev_value(b, x, &xp) || xn == xp) continue;
      /* v = a*xn + c and pv = a*xp + c */
      int64_t dv = v - pv, dx = xn - xp;
      if (dv % dx) continue;
      int64_t a = dv / dx, c = v - a * xn;
      if (a == 0) continue;
      sym_dim e = sym_add(b->g->sym, sym_mul(b->g->sym, sym_const(a), x), sym_const(c));
      if (sym_is_err(e) || dim_value(b, e) != v) continue;
      if (nfound && sym_same(found, e)) continue;
      found = e;
      nfound++;
    }
  }
  return nfound == 1 ? found : sym_error();
}

/* A size slot: the dim it is in the graph, and its rule. hint: a dim the
 * number may stand for by its place (an expand keeping a dim), or the error
 * dim; src: the dim it is (an autograd formula passed that tensor's shape,
 * ev's src), or the error dim, which decides whatever the earlier call saw:
 * two sizes with the same values in both calls (a scan's length and a batch
 * dim, or a dim now static at 1) cannot be told apart by numbers. */
static sym_dim slot_size(build_state *b, int ev, int si, int64_t v, sym_dim hint, sym_dim src, bool user) {
  rec_slot ps = {0};
  sym_dim d;
  int arg = -1;
  bool had_prev = prev_slot(b, ev, si, &ps) && !ps.is_float;
  if (!sym_is_err(src) && dim_value(b, src) == v) {
    d = src;
  } else if (had_prev) {
    if (ps.i == v && prev_arg(b, ev, si)) {
      d = new_arg_sym(b, v, true, ps.i, &arg);
    } else if (ps.i == v) {
      d = sym_const(v); /* a literal: it stayed put while other things changed */
    } else {
      d = !sym_is_err(hint) && dim_value(b, hint) == v ? hint : sym_error();
      int64_t hp;
      if (!sym_is_err(d) && (!prev_value(b, d, &hp) || hp != ps.i)) d = sym_error();
      if (sym_is_err(d)) d = explain(b, v, ps.i);
      if (sym_is_err(d)) d = new_arg_sym(b, v, true, ps.i, &arg);
    }
  } else if (!sym_is_err(hint) && !sym_is_const(hint) && dim_value(b, hint) == v) {
    d = hint;
  } else if (user) {
    /* one observation: a size the body read (kiln_size) with this value, or a product of two, is a guess the
     * slot's rule checks on every call; anything else is a literal until another call shows otherwise */
    d = read_size(b, v);
    if (sym_is_err(d)) d = sym_const(v);
  } else if (!user) {
    d = seen_size(b, v);
    if (sym_is_err(d)) d = sym_const(v);
  } else {
    d = sym_const(v);
  }
  if (sym_is_err(d)) return d;
  slot_rule rule = {.kind = SLOT_CONST, .v = {false, v, 0}, .arg = -1};
  if (arg >= 0) {
    rule.kind = SLOT_ARG;
    rule.arg = arg;
  } else if (!sym_is_const(d)) {
    /* the rule's copy of d lives with the rules, not with this graph */
    char text[512];
    const char *end;
    char err[128];
    rule.kind = SLOT_EXPR;
    if (sym_print(d, text, sizeof text) >= (int)sizeof text ||
        sym_parse(b->rsym, text, &rule.e, &end, err, sizeof err) || *end) {
      /* the rules' context cannot hold it (too long, or a divisor it cannot
       * prove positive without this graph's bounds): a number that changed is
       * passed at run time, a first guess stays a literal; both checked */
      if (had_prev) {
        d = new_arg_sym(b, v, true, ps.i, &arg);
        if (sym_is_err(d)) return d;
        rule.kind = SLOT_ARG;
        rule.arg = arg;
      } else {
        d = sym_const(v);
        rule.kind = SLOT_CONST;
      }
    }
  }
  if (add_rule(b, rule)) return sym_error();
  return d;
}

/* A new argument a of the variant for the current slot (observed v): its
 * index, or -1 (out of memory). */
static int new_slot_arg(build_state *b, build_arg a, rec_slot v) {
  if (alloc_grow((void **)&b->args, &b->cap_args, b->n_args + 1, sizeof *b->args)) return bfail(b, "out of memory while building"), -1;
  b->args[b->n_args] = a;
  if (add_rule(b, (slot_rule){.kind = SLOT_ARG, .v = v, .arg = b->n_args})) return -1;
  return b->n_args++;
}

/* A value slot (a fill value): a constant, or a scalar argument when it changed since the earlier call.
 * Returns the argument, or -1 for a constant. */
static int slot_value(build_state *b, int ev, int si, double v, kiln_dtype dt) {
  rec_slot ps;
  /* past half the arguments a call can bind (the rest for sizes and draws),
   * a constant: a call with another value makes another variant (or runs
   * on the interpreter) */
  if (b->n_args < IR_MAX_SYMS / 2 && prev_slot(b, ev, si, &ps) && ps.is_float &&
      (memcmp(&ps.f, &v, sizeof v) || prev_arg(b, ev, si)))
    return new_slot_arg(b, (build_arg){.is_float = true, .sym = -1, .dtype = dt}, (rec_slot){true, 0, v});
  add_rule(b, (slot_rule){.kind = SLOT_CONST, .v = {true, 0, v}, .arg = -1});
  return -1;
}

/* A slot kept as it is (a number the graph can only hold as a constant). */
static void slot_fixed(build_state *b, rec_slot v) { add_rule(b, (slot_rule){.kind = SLOT_CONST, .v = v, .arg = -1}); }

/* ---- nodes ---- */

static int add_node(build_state *b, ir_node *n) {
  shape_env env = {.g = b->g, .vals = b->vals, .nvals = b->n_syms, .record = true};
  char err[400];
  if (symshape_infer(&env, n, err, sizeof err)) return bfail(b, "%s:%d: %s", n->file, n->line, err), -1;
  int id = ir_add(b->g, n);
  if (id < 0) bfail(b, "out of memory while building");
  else note_shape(b, &b->g->nodes[id]);
  return id;
}

/* Node x broadcast to node like's shape (x itself when it has it already). */
static int expand_to(build_state *b, int x, int like, const char *file, int line) {
  const ir_node *xn = &b->g->nodes[x], *ln = &b->g->nodes[like];
  bool same = xn->ndim == ln->ndim;
  for (int i = 0; same && i < ln->ndim; i++) same = sym_same(xn->shape[i], ln->shape[i]);
  if (same) return x;
  ir_node e = {.op = OP_EXPAND, .n_in = 1, .in = &x, .file = file, .line = line};
  e.attrs.ndim = ln->ndim;
  memcpy(e.attrs.shape, ln->shape, sizeof e.attrs.shape);
  return add_node(b, &e);
}

/* A 0-d constant of dtype dt holding v. */
static int scalar_const(build_state *b, kiln_dtype dt, double v, const char *file, int line) {
  kiln_tensor *t = tensor_new(dt, 0, NULL);
  if (!t) return bfail(b, "out of memory while building"), -1;
  pw_fill(t, v);
  ir_node n = {.op = IR_CONST, .dtype = dt, .ndim = 0, .data = t->st->data, .file = file, .line = line};
  int id = ir_add(b->g, &n);
  kiln_release(t);
  if (id < 0) bfail(b, "out of memory while building");
  return id;
}

/* An extra input of the segment (after the call's inputs): value v carried
 * from an earlier segment, or argument a given as -1 - a. */
static int extra_input(build_state *b, int what, kiln_dtype dt, int ndim, const sym_dim *shape, int sym_plus1) {
  build_seg *s = b->seg;
  if (alloc_grow((void **)&s->extra, &s->cap_extra, s->n_extra + 1, sizeof *s->extra) ||
      alloc_grow((void **)&s->extra_node, &s->cap_extra_node, s->n_extra + 1, sizeof *s->extra_node))
    return bfail(b, "out of memory while building"), -1;
  ir_node n = {.op = IR_INPUT, .dtype = dt, .ndim = ndim, .index = b->n_in + s->n_extra, .file = ""};
  if (ndim) memcpy(n.shape, shape, sizeof(sym_dim) * (size_t)ndim);
  n.attrs.k = sym_plus1;
  int id = ir_append(b->g, &n);
  if (id < 0) return bfail(b, "out of memory while building"), -1;
  s->extra[s->n_extra] = what;
  s->extra_node[s->n_extra++] = id;
  return id;
}

/* The node of a size or value argument, added to the segment's inputs on first use. */
static int arg_node(build_state *b, int arg) {
  build_seg *s = b->seg;
  for (int i = 0; i < s->n_extra; i++)
    if (s->extra[i] == -1 - arg) return s->extra_node[i];
  const build_arg *a = &b->args[arg];
  if (a->is_data) {
    sym_dim dims[MAXD];
    for (int i = 0; i < a->ndim; i++) dims[i] = sym_const(a->shape[i]);
    return extra_input(b, -1 - arg, a->dtype, a->ndim, dims, 0);
  }
  return a->is_float ? extra_input(b, -1 - arg, a->dtype, 0, NULL, 0) : extra_input(b, -1 - arg, KILN_I64, 0, NULL, a->sym + 1);
}

/* Makes sure every size argument the graph's dims use has its input node, so it binds. */
static void bind_args(build_state *b) {
  for (int k = 0; k < b->n_syms; k++)
    if (b->sym[k].arg >= 0 && !b->failed) arg_node(b, b->sym[k].arg);
}

static void concrete(ir_node *n, const rec_value *v) {
  n->dtype = v->dtype;
  n->ndim = v->ndim;
  for (int i = 0; i < v->ndim; i++) n->shape[i] = sym_const(v->shape[i]);
}

static bool param_name_taken(const ir_graph *g, const char *name) {
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i].op == IR_PARAM && g->nodes[i].name && !strcmp(g->nodes[i].name, name)) return true;
  return false;
}

/* The name of a param no kiln_param_name call named: the call that first
 * used it, "gpt_h_210" for gpt.h:210 (the file's base name, so a build
 * directory does not change it), then "gpt_h_210_1" ... for more params
 * first used there. A C identifier, unique in the graph, and the same on
 * every run of the program, since a trace is. */
static void site_name(const ir_graph *g, const char *file, int line, char buf[128]) {
  const char *base = file ? file : "";
  for (const char *c = base; *c; c++)
    if (*c == '/' || *c == '\\') base = c + 1;
  char first[96]; /* the stem (at most 80) and the line */
  size_t k = 0;
  if (isdigit((unsigned char)*base)) first[k++] = 'p';
  for (const char *c = base; *c && k < 80; c++) first[k++] = isalnum((unsigned char)*c) ? *c : '_';
  first[k] = '\0';
  if (!k) snprintf(first, sizeof first, "param");
  if (line > 0) snprintf(first + strlen(first), sizeof first - strlen(first), "_%d", line);
  snprintf(buf, 128, "%s", first);
  for (int i = 1; param_name_taken(g, buf); i++) snprintf(buf, 128, "%s_%d", first, i);
}

/* A param's name: kiln_param_name's, else its capture site's, which its
 * storage keeps when the param is the whole of it (so that a graph loaded
 * from the text can check the tensors passed for it by name). NULL out of
 * memory. */
static const char *param_name(build_state *b, kiln_tensor *t, char buf[128]) {
  const char *had = atomic_load(&t->st->name);
  if (had) return had;
  site_name(b->g, b->at_file, b->at_line, buf);
  bool whole = t->offset == 0 && (size_t)shape_numel(t->ndim, t->shape) * kiln_dtype_size(t->dtype) == t->st->bytes;
  return whole ? storage_name_default(t->st, buf) : buf;
}

/* The node of value id v, making the leaf when it is one not seen yet. */
static int node_of(build_state *b, int v) {
  if (b->node[v] >= 0) return b->node[v];
  const rec_value *rv = &b->r->val[v];
  build_seg *s = b->seg;
  int id = -1;
  switch (rv->kind) {
  case RV_INPUT:
    id = b->input_node[rv->index];
    break;
  case RV_PARAM: {
    ir_node n = {.op = IR_PARAM, .index = s->n_params, .file = b->at_file ? b->at_file : "", .line = b->at_line};
    concrete(&n, rv);
    if (b->freeze && !b->r->params[rv->index]->requires_grad) {
      /* frozen: the weight's data is a constant of the graph */
      kiln_tensor *t = b->r->params[rv->index];
      kiln_tensor *c = op_run(OP_COPY, &t, 1, NULL, "", 0);
      if (!c) return bfail(b, "out of memory while building"), -1;
      n.op = IR_CONST;
      n.index = 0;
      n.data = c->st->data;
      id = ir_add(b->g, &n);
      kiln_release(c);
      s->frozen = true;
      break;
    }
    char site[128];
    if (!(n.name = param_name(b, b->r->params[rv->index], site))) return bfail(b, "out of memory"), -1;
    if (alloc_grow((void **)&s->params, &s->cap_params, s->n_params + 1, sizeof *s->params)) return bfail(b, "out of memory"), -1;
    s->params[s->n_params++] = rv->index;
    id = ir_append(b->g, &n);
    break;
  }
  case RV_GRAD: {
    int leaf = node_of(b, rv->index);
    if (leaf < 0) return -1;
    ir_node n = {.op = IR_GRAD, .n_in = 1, .in = &leaf, .file = "", .line = 0};
    const ir_node *ln = &b->g->nodes[leaf];
    n.dtype = ln->dtype;
    n.ndim = ln->ndim;
    memcpy(n.shape, ln->shape, sizeof n.shape);
    id = ir_append(b->g, &n);
    break;
  }
  case RV_CARRY: {
    sym_dim shape[MAXD];
    for (int i = 0; i < rv->ndim; i++) shape[i] = sym_const(rv->shape[i]);
    const char *text = b->shape_text ? b->shape_text[rv->index] : NULL;
    for (int i = 0; text && i < rv->ndim; i++) {
      const char *end;
      char err[128];
      sym_dim d;
      if (sym_parse(b->g->sym, text, &d, &end, err, sizeof err)) break;
      if (dim_value(b, d) == rv->shape[i]) shape[i] = d;
      text = *end == ',' ? end + 1 : end;
    }
    id = extra_input(b, rv->index, rv->dtype, rv->ndim, shape, 0);
    break;
  }
  case RV_MADE:
    bfail(b, "value %d is used before the event that makes it", v);
    return -1;
  }
  if (id < 0) return bfail(b, "out of memory while building"), -1;
  b->node[v] = id;
  note_shape(b, &b->g->nodes[id]);
  return id;
}

/* ---- attributes: the event's numbers as the graph's dims ---- */

/* Target dims of a reshape of node x to the concrete shape t[0..tn): each
 * target dim that covers the same group of input dims as the input's keeps
 * their symbolic product. */
static void reshape_target(build_state *b, const ir_node *x, int tn, const int64_t *t, sym_dim *out) {
  int xn = x->ndim;
  int64_t xv[MAXD];
  for (int i = 0; i < xn; i++) xv[i] = dim_value(b, x->shape[i]);
  for (int j = 0; j < tn; j++) out[j] = sym_error();
  int i = 0, j = 0;
  while (j < tn) {
    if (t[j] == 1 && (i >= xn || xv[i] != 1)) {
      j++;
      continue;
    }
    if (i < xn && xv[i] == 1 && t[j] != 1) {
      i++;
      continue;
    }
    if (i >= xn) return;
    if (t[j] == 1 && xv[i] == 1) {
      out[j++] = x->shape[i++];
      continue;
    }
    if (xv[i] == 0 || t[j] == 0) return;
    int i1 = i + 1, j1 = j + 1;
    int64_t pi = xv[i], pj = t[j];
    while (pi != pj) {
      if (pi < pj) {
        if (i1 >= xn || pi > INT64_MAX / (xv[i1] ? xv[i1] : 1)) return;
        pi *= xv[i1++];
      } else {
        if (j1 >= tn || pj > INT64_MAX / (t[j1] ? t[j1] : 1)) return;
        pj *= t[j1++];
      }
    }
    if (j1 - j == 1) {
      sym_dim p = sym_const(1);
      for (int k = i; k < i1; k++) p = sym_mul(b->g->sym, p, x->shape[k]);
      out[j] = p;
    } else {
      /* split: target dims matched to input dims of the same value, in order */
      int next = i;
      for (int k = j; k < j1; k++)
        for (int q = next; q < i1; q++)
          if (xv[q] == t[k]) {
            out[k] = x->shape[q];
            next = q + 1;
            break;
          }
    }
    i = i1;
    j = j1;
  }
}

/* A slice bound the caller gave (raw: Python's rules for negative and
 * past-the-end numbers), as a dim of the graph; g is the given number as a
 * dim (constant, expression or argument). */
static sym_dim slice_bound(build_state *b, sym_dim size, sym_dim g) {
  ir_graph *gr = b->g;
  shape_env env = {.g = gr, .vals = b->vals, .nvals = b->n_syms, .record = true};
  int neg = shape_decide(&env, g, SYM_LT, sym_const(0));
  if (neg < 0) return bfail(b, "could not decide a slice bound"), sym_error();
  if (neg) {
    sym_dim s = sym_add(gr->sym, size, g);
    int clamped = shape_decide(&env, s, SYM_LT, sym_const(0));
    if (clamped < 0) return bfail(b, "could not decide a slice bound"), sym_error();
    return clamped ? sym_const(0) : s;
  }
  /* within the size (its end included, so that one guard covers both) */
  int within = shape_decide(&env, g, SYM_LE, size);
  if (within < 0) return bfail(b, "could not decide a slice bound"), sym_error();
  return within ? g : size;
}

/* The attributes of event ev (eager's numbers) as the graph's, slot by slot
 * in rec_slots' order. */
static void convert_attrs(build_state *b, int ev, const ir_node *x, op_attrs *o) {
  const rec_event *e = &b->r->ev[ev];
  const op_attrs *a = e->a;
  unsigned f = op_table[e->op].attrs;
  int si = 0;
  *o = *a;
  o->infer = 0;
  o->raw = false;
  o->raw_start = o->raw_end = 0;
  if (f & AF_SHAPE) {
    int64_t t[MAXD];
    sym_dim hint[MAXD];
    for (int i = 0; i < a->ndim; i++) t[i] = a->shape[i].c;
    if (e->op == OP_EXPAND) {
      for (int i = 0; i < a->ndim; i++) {
        int j = i - (a->ndim - x->ndim);
        hint[i] = j >= 0 ? x->shape[j] : sym_error();
      }
    } else {
      reshape_target(b, x, a->ndim, t, hint);
    }
    for (int i = 0; i < a->ndim; i++, si++) {
      if (i == a->infer - 1) {
        slot_fixed(b, (rec_slot){false, -1, 0});
        continue;
      }
      o->shape[i] = slot_size(b, ev, si, t[i], hint[i], src_dim(b, e, i), e->user);
    }
    if (e->op == OP_RESHAPE && a->infer > 0 && a->infer <= a->ndim) {
      /* the dim given as -1 is what the others leave */
      sym_dim p = sym_const(1), q = sym_const(1);
      for (int i = 0; i < x->ndim; i++) p = sym_mul(b->g->sym, p, x->shape[i]);
      for (int i = 0; i < a->ndim; i++)
        if (i != a->infer - 1) q = sym_mul(b->g->sym, q, o->shape[i]);
      sym_dim fl = sym_floordiv(b->g->sym, p, q);
      o->shape[a->infer - 1] = !sym_is_err(fl) && dim_value(b, fl) == t[a->infer - 1] ? fl : sym_const(t[a->infer - 1]);
    }
  }
  if (f & (AF_START | AF_END)) {
    sym_dim size = x->shape[a->dim];
    int64_t given[2] = {a->raw ? a->raw_start : a->start.c, a->raw ? a->raw_end : a->end.c};
    sym_dim norm[2] = {a->start, a->end};
    sym_dim *dst[2] = {&o->start, &o->end};
    for (int k = 0; k < 2; k++, si++) {
      /* a bound at the end of the dim stands for the size, as a hint */
      sym_dim hint = given[k] == dim_value(b, size) ? size : sym_error();
      sym_dim gd = slot_size(b, ev, si, given[k], hint, sym_error(), e->user);
      if (sym_is_err(gd)) return;
      *dst[k] = a->raw ? slice_bound(b, size, gd) : (sym_is_const(gd) && gd.c == norm[k].c ? norm[k] : gd);
    }
    if (a->raw) {
      /* and an end before the start is the start (an empty slice), as eagerly */
      shape_env env = {.g = b->g, .vals = b->vals, .nvals = b->n_syms, .record = true};
      int before = shape_decide(&env, o->end, SYM_LT, o->start);
      if (before < 0) return bfail(b, "could not decide a slice bound");
      if (before) o->end = o->start;
    }
  }
  if (f & AF_VALUE) slot_fixed(b, (rec_slot){true, 0, a->value}), si++;
  if (f & AF_VALUE2) slot_fixed(b, (rec_slot){true, 0, a->value2}), si++;
  if (f & AF_K) slot_fixed(b, (rec_slot){false, a->k, 0}), si++;
  if (f & AF_INTS)
    for (int i = 0; i < a->nints; i++) slot_fixed(b, (rec_slot){false, a->ints[i], 0}), si++;
  if (f & AF_RNG) {
    /* where a draw starts moves on every call: arguments from the first.
     * Two symbols a draw would run out of them past 32 draws (a dropout per
     * layer), and the call failed: past half of them, a draw from the seed
     * of the last draw of its kind (uniform or normal: offsets count
     * numbers or pairs) that took arguments reuses that draw's seed, and
     * its offset is that draw's plus the numbers drawn since, rules checked
     * on every call (a miss where a symbolic size moves that count) */
    int64_t v[2] = {a->seed.c, a->offset.c};
    int kind = a->flag != 0;
    sym_dim *dst[2] = {&o->seed, &o->offset}, d[2] = {sym_error(), sym_error()};
    if (b->rng_base[kind] && b->n_syms + 2 > IR_MAX_SYMS / 2 && v[0] == b->rng_v[kind][0] &&
        !__builtin_sub_overflow(v[1], b->rng_v[kind][1], &(int64_t){0})) {
      d[0] = b->rng_sym[kind][0];
      d[1] = sym_add(b->g->sym, b->rng_sym[kind][1], sym_const(v[1] - b->rng_v[kind][1]));
    }
    slot_rule rules[2];
    bool follow = !sym_is_err(d[0]) && !sym_is_err(d[1]) && dim_value(b, d[0]) == v[0] && dim_value(b, d[1]) == v[1];
    for (int k = 0; k < 2 && follow; k++) {
      char text[512], err[128];
      const char *end;
      rules[k] = (slot_rule){.kind = SLOT_EXPR, .v = {false, v[k], 0}, .arg = -1};
      follow = sym_print(d[k], text, sizeof text) < (int)sizeof text && !sym_parse(b->rsym, text, &rules[k].e, &end, err, sizeof err) &&
               !*end;
    }
    for (int k = 0; k < 2; k++, si++) {
      if (follow) {
        *dst[k] = d[k];
        add_rule(b, rules[k]);
        continue;
      }
      int arg;
      *dst[k] = new_arg_sym_in(b, v[k], false, 0, INT64_MIN, INT64_MAX, &arg);
      add_rule(b, (slot_rule){.kind = SLOT_ARG, .v = {false, v[k], 0}, .arg = arg});
      b->rng_sym[kind][k] = *dst[k];
      b->rng_v[kind][k] = v[k];
    }
    b->rng_base[kind] = true;
  }
}

/* ---- events ---- */

/* Checks node id's shape against the value's concrete one. */
static void check_value(build_state *b, int id, int v, const rec_event *e) {
  const ir_node *n = &b->g->nodes[id];
  const rec_value *rv = &b->r->val[v];
  int64_t shape[MAXD];
  if (n->dtype != rv->dtype || n->ndim != rv->ndim || ir_node_shape(n, b->vals, b->n_syms, shape) ||
      memcmp(shape, rv->shape, sizeof(int64_t) * (size_t)rv->ndim))
    bfail(b, "%s:%d: kiln_%s: the symbolic shape rule disagrees with the recorded shape", e->file, e->line,
          e->kind == EV_OP ? op_table[e->op].name : "factory");
}

static int ev_op(build_state *b, int ev) {
  const rec_event *e = &b->r->ev[ev];
  b->at_file = e->file, b->at_line = e->line;
  int buf[16], *ids = e->n_in <= 16 ? buf : alloc_malloc(sizeof(int) * (size_t)e->n_in);
  if (!ids) return bfail(b, "out of memory while building"), -1;
  int id = -1;
  for (int i = 0; i < e->n_in; i++)
    if ((ids[i] = node_of(b, b->r->ids[e->in + i])) < 0) goto done;
  ir_node n = {.op = e->op, .n_in = e->n_in, .in = ids, .file = e->file, .line = e->line};
  convert_attrs(b, ev, &b->g->nodes[ids[0]], &n.attrs);
  if (b->failed) goto done;
  id = add_node(b, &n);
  if (id >= 0) check_value(b, id, e->out, e);
done:
  if (ids != buf) alloc_free(ids);
  return id;
}

/* The bytes of EV_DATA event ev (its last slot): an argument when the
 * earlier call's differ at the same event, or were one already (a decode
 * loop's picks fed back, kiln_tensor_from at every call), else a constant.
 * The argument, or -1. */
static int data_arg(build_state *b, int ev, const int64_t *shape) {
  const rec_event *e = &b->r->ev[ev];
  const op_attrs *a = e->a;
  rec_slot ps;
  bool lift = b->n_args < IR_MAX_SYMS / 2 && prev_slot(b, ev, a->ndim, &ps) &&
              (prev_arg(b, ev, a->ndim) || memcmp(b->prev->ev[ev].data, e->data, rec_ev_bytes(e)));
  if (!lift) {
    slot_fixed(b, (rec_slot){false, 0, 0});
    return -1;
  }
  build_arg arg = {.is_float = false, .sym = -1, .dtype = a->dtype, .is_data = true, .ndim = a->ndim};
  memcpy(arg.shape, shape, sizeof(int64_t) * (size_t)a->ndim);
  return new_slot_arg(b, arg, (rec_slot){false, 0, 0});
}

/* A tensor made by a factory: sizes from slots; a uniform fill is a scalar (a constant or an argument) expanded. */
static int ev_factory(build_state *b, int ev) {
  const rec_event *e = &b->r->ev[ev];
  const op_attrs *a = e->a;
  sym_dim dims[MAXD];
  int si = 0;
  if (e->kind != EV_FULL) {
    /* the numbers themselves: a constant of the graph, of the recorded shape and seed */
    for (int i = 0; i < a->ndim; i++) slot_fixed(b, (rec_slot){false, a->shape[i].c, 0});
    if (e->kind == EV_RAND) slot_fixed(b, (rec_slot){false, a->k, 0});
    int64_t shape[MAXD];
    for (int i = 0; i < a->ndim; i++) shape[i] = a->shape[i].c;
    int arg = e->kind == EV_DATA ? data_arg(b, ev, shape) : -1;
    if (arg >= 0) return arg_node(b, arg);
    kiln_tensor *t;
    if (e->kind == EV_DATA) {
      t = tensor_new(a->dtype, a->ndim, shape);
      if (t) memcpy(t->st->data, e->data, (size_t)shape_numel(a->ndim, shape) * kiln_dtype_size(a->dtype));
    } else {
      /* no scope is open while a segment builds: the tensor is ours */
      t = a->flag ? kiln_randn_at(a->dtype, a->ndim, shape, (uint64_t)a->k, e->file, e->line)
                  : kiln_rand_at(a->dtype, a->ndim, shape, (uint64_t)a->k, e->file, e->line);
    }
    if (!t) return bfail(b, "out of memory while building"), -1;
    ir_node n = {.op = IR_CONST, .dtype = a->dtype, .ndim = a->ndim, .data = t->st->data, .file = e->file, .line = e->line};
    for (int i = 0; i < a->ndim; i++) n.shape[i] = sym_const(shape[i]);
    int id = ir_add(b->g, &n);
    kiln_release(t);
    if (id < 0) return bfail(b, "out of memory while building"), -1;
    note_shape(b, &b->g->nodes[id]);
    return id;
  }
  for (int i = 0; i < a->ndim; i++, si++) dims[i] = slot_size(b, ev, si, a->shape[i].c, sym_error(), src_dim(b, e, i), e->user);
  if (b->failed) return -1;
  int arg = slot_value(b, ev, si, a->value, a->dtype);
  int src = arg >= 0 ? arg_node(b, arg) : scalar_const(b, a->dtype, a->value, e->file, e->line);
  if (src < 0) return -1;
  if (a->ndim == 0) return src;
  ir_node x = {.op = OP_EXPAND, .n_in = 1, .in = &src, .file = e->file, .line = e->line};
  x.attrs.ndim = a->ndim;
  memcpy(x.attrs.shape, dims, sizeof dims);
  int id = add_node(b, &x);
  if (id >= 0) check_value(b, id, e->out, e);
  return id;
}

/* The written tensor's (or view's) new value. */
static int written_value(build_state *b, int ev) {
  const rec_event *e = &b->r->ev[ev];
  b->at_file = e->file, b->at_line = e->line;
  int d = node_of(b, b->r->ids[e->in]);
  if (d < 0) return -1;
  if (e->op == OP_COUNT) {
    const ir_node *dn = &b->g->nodes[d];
    int arg = slot_value(b, ev, 0, e->a->value, dn->dtype);
    int c = arg >= 0 ? arg_node(b, arg) : scalar_const(b, dn->dtype, e->a->value, e->file, e->line);
    return c < 0 ? -1 : expand_to(b, c, d, e->file, e->line);
  }
  int s = node_of(b, b->r->ids[e->in + 1]);
  if (s < 0) return -1;
  if (e->op == OP_COPY) {
    if (b->g->nodes[s].dtype != b->g->nodes[d].dtype) {
      ir_node c = {.op = OP_CAST, .n_in = 1, .in = &s, .file = e->file, .line = e->line};
      c.attrs.dtype = b->g->nodes[d].dtype;
      if ((s = add_node(b, &c)) < 0) return -1;
    }
    return expand_to(b, s, d, e->file, e->line);
  }
  int ins[2] = {d, s};
  ir_node n = {.op = e->op, .n_in = 2, .in = ins, .file = e->file, .line = e->line};
  return add_node(b, &n);
}

/* The base's new value after view node d (made from base by slices,
 * reshapes and permutes) took the value x: each view undone, innermost
 * first, a slice by scattering into the elements around it. */
static int scatter_to_base(build_state *b, int d, int x, int base, const char *file, int line) {
  while (d != base && x >= 0) {
    ir_node v = b->g->nodes[d]; /* a copy: add_node may move the array */
    int p = v.in[0];
    ir_node n = {.n_in = 1, .file = file, .line = line};
    int ins[2] = {p, x};
    if (v.op == OP_SLICE) {
      n.op = OP_SLICE_SCATTER;
      n.n_in = 2;
      n.in = ins;
      n.attrs = v.attrs;
    } else if (v.op == OP_RESHAPE) {
      n.op = OP_RESHAPE;
      n.in = &x;
      n.attrs.ndim = b->g->nodes[p].ndim;
      memcpy(n.attrs.shape, b->g->nodes[p].shape, sizeof n.attrs.shape);
    } else if (v.op == OP_PERMUTE) {
      n.op = OP_PERMUTE;
      n.in = &x;
      for (int i = 0; i < v.ndim; i++) n.attrs.perm[v.attrs.perm[i]] = i;
    } else {
      return bfail(b, "%s:%d: an in-place write through a %s view", file, line, op_table[v.op].name), -1;
    }
    x = add_node(b, &n);
    d = p;
  }
  return x;
}

/* An in-place write as the written tensor's new value: dst op src, src
 * converted and broadcast to dst (copy_), or a value broadcast (fill_).
 * Through a view (a.flag), the new value is the base's, its last input. */
static int ev_inplace(build_state *b, int ev) {
  const rec_event *e = &b->r->ev[ev];
  int x = written_value(b, ev);
  if (x < 0 || !e->a->flag) return x;
  int d = node_of(b, b->r->ids[e->in]), base = node_of(b, b->r->ids[e->in + e->n_in - 1]);
  if (d < 0 || base < 0) return -1;
  return scatter_to_base(b, d, x, base, e->file, e->line);
}

static int ev_numel(build_state *b, int ev) {
  const rec_event *e = &b->r->ev[ev];
  b->at_file = e->file, b->at_line = e->line;
  int x = node_of(b, b->r->ids[e->in]);
  if (x < 0) return -1;
  ir_node n = {.op = IR_NUMEL, .dtype = e->a->dtype, .n_in = 1, .in = &x, .file = e->file, .line = e->line};
  n.attrs.naxes = e->a->naxes;
  memcpy(n.attrs.axes, e->a->axes, sizeof n.attrs.axes);
  n.attrs.start = e->a->start;
  n.attrs.end = sym_const(0);
  int id = ir_add(b->g, &n);
  if (id < 0) bfail(b, "out of memory while building");
  return id;
}

/* ---- control flow: regions built in place, then moved out ---- */

/* Each region's body is built into the segment's graph like any code, over
 * placeholder nodes for its arguments (IR_GET without inputs, unique by
 * attrs.k). When the construct's last region ends, cf_extract moves every
 * node that depends on a region's placeholders and that its results reach
 * into a region graph; what a region reads that does not depend on them
 * (an outer value, or loop-invariant work on it) stays outside and becomes
 * a capture. The nodes left behind are dropped by dce at the segment's end. */

static void cf_frame_free(build_cf *f) {
  alloc_free(f->in);
  for (int i = 0; i < 2; i++) alloc_free(f->ph[i]), alloc_free(f->res[i]);
  memset(f, 0, sizeof *f);
}

static int ev_cf(build_state *b, int ev) {
  const rec_event *e = &b->r->ev[ev];
  b->at_file = e->file, b->at_line = e->line;
  if (b->n_cf == BUILD_MAX_CF) return bfail(b, "%s:%d: control flow nested more than %d deep", e->file, e->line, BUILD_MAX_CF), -1;
  build_cf *f = &b->cf[b->n_cf++];
  memset(f, 0, sizeof *f);
  f->op = e->op;
  f->n_carry = (int)e->a->k;
  f->n_xs = e->a->dim;
  f->n_in = e->n_in;
  f->n_args = e->op == IR_COND ? e->n_in - 1 : e->n_in;
  f->file = e->file, f->line = e->line;
  f->in = alloc_malloc(sizeof(int) * (size_t)(e->n_in + 1));
  for (int i = 0; i < ir_n_sub(e->op); i++) f->ph[i] = alloc_calloc((size_t)f->n_args + 1, sizeof(int));
  if (!f->in || !f->ph[0] || (ir_n_sub(e->op) > 1 && !f->ph[1])) return bfail(b, "out of memory while building"), -1;
  for (int i = 0; i < e->n_in; i++)
    if ((f->in[i] = node_of(b, b->r->ids[e->in + i])) < 0) return -1;
  if (e->op == IR_SCAN) {
    /* a scan's xs share their length (kiln_scan checked it): a guard says so
     * where their dims are symbols of their own, so that another call with
     * unequal lengths retraces into kiln_scan's error */
    shape_env env = {.g = b->g, .vals = b->vals, .nvals = b->n_syms, .record = true};
    const ir_node *x0 = &b->g->nodes[f->in[f->n_carry]];
    for (int j = 1; j < f->n_xs; j++) {
      const ir_node *x = &b->g->nodes[f->in[f->n_carry + j]];
      if (x->ndim < 1 || x0->ndim < 1 || shape_decide(&env, x->shape[0], SYM_EQ, x0->shape[0]) != 1)
        return bfail(b, "%s:%d: kiln_scan: xs %d and xs 0 differ in dim 0", e->file, e->line, j), -1;
    }
  }
  f->first = b->g->n_nodes;
  b->has_cf = true;
  return -1; /* no node of its own yet */
}

/* Argument a.k of region a.dim: a placeholder of the operand's type (xs[t]: dim 0 dropped). */
static int ev_arg(build_state *b, int ev) {
  const rec_event *e = &b->r->ev[ev];
  if (!b->n_cf) return bfail(b, "a region argument outside control flow"), -1;
  build_cf *f = &b->cf[b->n_cf - 1];
  int j = (int)e->a->k, i = e->a->dim;
  if (i < 0 || i >= ir_n_sub(f->op) || j < 0 || j >= f->n_args) return bfail(b, "a region argument out of range"), -1;
  const ir_node *src = &b->g->nodes[f->in[f->op == IR_COND ? j + 1 : j]];
  bool x = f->op == IR_SCAN && j >= f->n_carry;
  ir_node n = {.op = IR_GET, .dtype = src->dtype, .ndim = src->ndim - x, .file = e->file, .line = e->line};
  memcpy(n.shape, src->shape + x, sizeof(sym_dim) * (size_t)n.ndim);
  n.attrs.k = -1 - b->n_placeholders++;
  int id = ir_append(b->g, &n);
  if (id < 0) return bfail(b, "out of memory while building"), -1;
  f->ph[i][j] = id;
  return id;
}

static int cf_extract(build_state *b, build_cf *f);

static int ev_yield(build_state *b, int ev) {
  const rec_event *e = &b->r->ev[ev];
  if (!b->n_cf) return bfail(b, "a region's end outside control flow"), -1;
  build_cf *f = &b->cf[b->n_cf - 1];
  int i = (int)e->a->k;
  if (i < 0 || i >= ir_n_sub(f->op) || f->res[i]) return bfail(b, "a region's end out of order"), -1;
  if (!(f->res[i] = alloc_malloc(sizeof(int) * (size_t)(e->n_in + 1)))) return bfail(b, "out of memory while building"), -1;
  f->n_res[i] = e->n_in;
  for (int k = 0; k < e->n_in; k++)
    if ((f->res[i][k] = node_of(b, b->r->ids[e->in + k])) < 0) return -1;
  if (i < ir_n_sub(f->op) - 1) return -1;
  b->cf_node = cf_extract(b, f);
  cf_frame_free(f);
  b->n_cf--;
  return -1;
}

static int ev_get(build_state *b, int ev) {
  const rec_event *e = &b->r->ev[ev];
  ir_node n = {.op = IR_GET, .n_in = 1, .in = &b->cf_node, .file = e->file, .line = e->line};
  n.attrs.k = e->a->k;
  if (b->cf_node < 0 || ir_cf_result_type(b->g, b->cf_node, (int)e->a->k, &n)) return bfail(b, "%s:%d: a result of control flow without its construct", e->file, e->line), -1;
  int id = ir_add(b->g, &n);
  if (id < 0) return bfail(b, "out of memory while building"), -1;
  check_value(b, id, e->out, e);
  return id;
}

/* Moves the regions of frame f out of the segment's graph into region
 * graphs (see above) and appends the construct's node: its operands, then
 * the captures every region takes after its arguments. The node's id, or -1. */
static int cf_extract(build_state *b, build_cf *f) {
  ir_graph *g = b->g;
  int N = g->n_nodes, n_sub = ir_n_sub(f->op), id = -1, n_caps = 0;
  bool *dep = alloc_calloc((size_t)N + 1, sizeof *dep), *reach[2] = {NULL, NULL}, *is_cap = alloc_calloc((size_t)N + 1, 1);
  int *caps = alloc_malloc(sizeof(int) * ((size_t)N + 1)), *map = alloc_malloc(sizeof(int) * ((size_t)N + 1)), *stack = alloc_malloc(sizeof(int) * ((size_t)N + 1));
  int *ins = alloc_malloc(sizeof(int) * ((size_t)(f->n_in + N) + 1));
  ir_graph *sub[2] = {NULL, NULL};
  for (int i = 0; i < n_sub; i++) reach[i] = alloc_calloc((size_t)N + 1, sizeof(bool));
  if (!dep || !is_cap || !caps || !map || !stack || !ins || !reach[0] || (n_sub > 1 && !reach[1])) {
    bfail(b, "out of memory while building");
    goto done;
  }
  for (int i = 0; i < n_sub; i++) {
    /* what depends on region i's arguments, and of that what its results reach */
    memset(dep, 0, (size_t)N + 1);
    for (int j = 0; j < f->n_args; j++) dep[f->ph[i][j]] = true;
    for (int x = f->first; x < N; x++)
      for (int j = 0; j < g->nodes[x].n_in && !dep[x]; j++) dep[x] = dep[g->nodes[x].in[j]];
    int sp = 0;
    for (int k = 0; k < f->n_res[i]; k++) {
      int o = f->res[i][k];
      if (dep[o] && !reach[i][o]) reach[i][o] = true, stack[sp++] = o;
      if (!dep[o] && !is_cap[o]) is_cap[o] = true, caps[n_caps++] = o;
    }
    while (sp) {
      const ir_node *n = &g->nodes[stack[--sp]];
      for (int j = 0; j < n->n_in; j++) {
        int y = n->in[j];
        /* a small constant is copied in rather than passed */
        bool copy = g->nodes[y].op == IR_CONST && ir_node_numel_const(&g->nodes[y]) <= 16;
        if ((dep[y] || copy) && !reach[i][y]) reach[i][y] = true, stack[sp++] = y;
        if (!dep[y] && !copy && !is_cap[y]) is_cap[y] = true, caps[n_caps++] = y;
      }
    }
  }
  /* the captures in the order of the outer graph: operands of the node after its own */
  for (int x = 0, k = 0; x < N; x++)
    if (is_cap[x]) caps[k++] = x;
  for (int i = 0; i < n_sub && !b->failed; i++) {
    ir_graph *r = sub[i] = ir_region_new(g, ir_sub_name(f->op, i));
    if (!r) {
      bfail(b, "out of memory while building");
      break;
    }
    for (int a = 0; a < f->n_args + n_caps && !b->failed; a++) {
      int src = a < f->n_args ? f->ph[i][a] : caps[a - f->n_args];
      ir_node in = {.op = IR_INPUT, .index = a, .file = ""};
      in.dtype = g->nodes[src].dtype;
      in.ndim = g->nodes[src].ndim;
      memcpy(in.shape, g->nodes[src].shape, sizeof in.shape);
      if ((map[src] = ir_append(r, &in)) < 0) bfail(b, "out of memory while building");
    }
    for (int j = 0; j < f->n_args; j++) reach[i][f->ph[i][j]] = false; /* inputs already */
    for (int x = 0; x < N && !b->failed; x++) {
      if (!reach[i][x]) continue;
      ir_node n = g->nodes[x];
      for (int j = 0; j < n.n_in; j++) ins[j] = map[n.in[j]];
      n.in = ins;
      if ((map[x] = ir_add(r, &n)) < 0) bfail(b, "out of memory while building");
    }
    for (int k = 0; k < f->n_res[i] && !b->failed; k++)
      if (ir_add_output(r, map[f->res[i][k]])) bfail(b, "out of memory while building");
  }
  if (!b->failed) {
    memcpy(ins, f->in, sizeof(int) * (size_t)f->n_in);
    memcpy(ins + f->n_in, caps, sizeof(int) * (size_t)n_caps);
    ir_node n = {.op = f->op, .n_in = f->n_in + n_caps, .in = ins, .n_carry = f->n_carry, .n_xs = f->n_xs,
                 .sub = {sub[0], sub[1]}, .file = f->file, .line = f->line};
    if ((id = ir_append(g, &n)) < 0) bfail(b, "out of memory while building");
  }
done:
  for (int i = 0; i < 2; i++) ir_free(sub[i]), alloc_free(reach[i]);
  alloc_free(dep), alloc_free(is_cap), alloc_free(caps), alloc_free(map), alloc_free(stack), alloc_free(ins);
  return id;
}

/* After the segment is built: the placeholders and the region nodes left
 * behind are dropped; a placeholder still used means a body's value escaped
 * its region. 0 or -1. */
static int cf_finish(build_state *b) {
  ir_graph *g = pass_dce(b->g);
  b->g = g;
  if (!g) return bfail(b, "out of memory while building"), -1;
  for (int i = 0; i < g->n_nodes; i++) {
    const ir_node *n = &g->nodes[i];
    if (n->op == IR_GET && n->n_in == 0)
      return bfail(b, "%s:%d: a value made inside the body of a kiln_cond, kiln_while_loop or kiln_scan is used "
                      "outside it (return it from the body instead)", n->file, n->line), -1;
  }
  return 0;
}

/* ---- the graph ---- */

/* Leaves first (inputs, params, grads), then the rest in order. Frees g. */
static ir_graph *reorder(ir_graph *g, int *pos) {
  int *order = alloc_malloc(sizeof(int) * (size_t)g->n_nodes + 1), k = 0;
  ir_graph *r = order ? ir_new_like(g) : NULL;
  if (!order || !r) goto fail;
  for (int pass = IR_INPUT; pass <= IR_GRAD; pass++)
    for (int i = 0; i < g->n_nodes; i++)
      if (g->nodes[i].op == pass) order[k++] = i;
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i].op < IR_INPUT || g->nodes[i].op > IR_GRAD) order[k++] = i;
  for (int i = 0; i < k; i++) {
    ir_node n = g->nodes[order[i]];
    int ins[64], *p = n.n_in <= 64 ? ins : alloc_malloc(sizeof(int) * (size_t)n.n_in);
    if (!p) goto fail;
    for (int j = 0; j < n.n_in; j++) p[j] = pos[n.in[j]];
    n.in = p;
    pos[order[i]] = ir_append(r, &n);
    if (p != ins) alloc_free(p);
    if (pos[order[i]] < 0) goto fail;
  }
  if (ir_copy_tail(r, g, pos)) goto fail;
  alloc_free(order);
  ir_free(g);
  return r;
fail:
  alloc_free(order);
  ir_free(r);
  ir_free(g);
  return NULL;
}

int build_begin(build_state *b, recording *r, const uint8_t (*dynamic)[MAXD], bool freeze, const build_prev *prev) {
  memset(b, 0, sizeof *b);
  b->r = r;
  b->dynamic = dynamic;
  b->freeze = freeze;
  b->prev = prev;
  b->n_in = r->n_in;
  b->rsym = sym_ctx_new();
  if (!b->rsym) return -1;
  /* the inputs' dims: a symbol each where the spec says (sizes 0 and 1 stay static, as in torch) */
  for (int i = 0; i < r->n_in; i++) {
    const kiln_tensor *t = r->in[i];
    for (int d = 0; d < t->ndim; d++) {
      /* a scan's length is a symbol from the first trace, as small as 0 */
      bool scan = false;
      for (int q = 0; q < r->n_scan_dims; q++) scan |= r->scan_dims[q].input == i && r->scan_dims[q].dim == d;
      if (!scan && (!dynamic || !dynamic[i][d] || t->shape[d] <= 1)) continue;
      if (b->n_syms == IR_MAX_SYMS) return -1;
      int k = b->n_syms++;
      b->sym[k] = (build_sym){.input = i, .dim = d, .arg = -1, .lo = scan ? 0 : 1, .hi = INT64_MAX};
      b->vals[k] = t->shape[d];
      if (prev && i < prev->n_in && d < prev->in_ndim[i]) {
        b->has_prev[k] = true;
        b->prev_vals[k] = prev->in_shape[i][d];
      }
    }
  }
  b->aligned = prev ? prev->aligned : 0;
  return 0;
}

void build_seg_free(build_seg *s) {
  ir_free(s->g);
  alloc_free(s->extra);
  alloc_free(s->extra_node);
  alloc_free(s->params);
  alloc_free(s->out);
  memset(s, 0, sizeof *s);
}

void build_free(build_state *b) {
  alloc_free(b->args);
  alloc_free(b->rules);
  alloc_free(b->rule_at);
  alloc_free(b->sizes);
  if (b->shape_text)
    for (int i = 0; i < b->cap_text; i++) alloc_free(b->shape_text[i]);
  alloc_free(b->shape_text);
  sym_ctx_free(b->rsym);
  memset(b, 0, sizeof *b);
}

/* Keeps node id's symbolic shape as text, for value v carried into later segments. */
static void keep_shape(build_state *b, int v, int id) {
  if (alloc_grow((void **)&b->shape_text, &b->cap_text, v + 1, sizeof *b->shape_text)) return;
  for (int i = b->n_text; i < b->cap_text; i++) b->shape_text[i] = NULL;
  if (b->n_text < b->cap_text) b->n_text = b->cap_text;
  const ir_node *n = &b->g->nodes[id];
  char text[1024];
  size_t k = 0;
  for (int i = 0; i < n->ndim && k < sizeof text; i++) {
    int w = sym_print(n->shape[i], text + k, sizeof text - k);
    if (w < 0 || k + (size_t)w + 2 >= sizeof text) return;
    k += (size_t)w;
    text[k++] = ',';
  }
  text[k ? k - 1 : 0] = '\0';
  char *c = alloc_malloc(k + 1);
  if (!c) return;
  memcpy(c, text, k + 1);
  alloc_free(b->shape_text[v]);
  b->shape_text[v] = c;
}

int build_segment(build_state *b, int from, int to, const int *out, int n_out, const build_write *writes, int n_writes,
                  build_seg *seg) {
  recording *r = b->r;
  memset(seg, 0, sizeof *seg);
  b->seg = seg;
  b->failed = false;
  b->why[0] = 0;
  b->has_cf = false;
  b->cf_node = -1;
  if (alloc_grow((void **)&b->rule_at, &b->cap_rule_at, to + 1, sizeof *b->rule_at)) return bfail(b, "out of memory"), -1;
  alloc_free(b->sizes);
  b->sizes = NULL;
  b->sizes_cap = 0;
  b->g = ir_new(b->name);
  b->node = alloc_malloc(sizeof(int) * (size_t)(r->n_val + 1));
  b->input_node = alloc_malloc(sizeof(int) * (size_t)(r->n_in + 1));
  if (!b->g || !b->node || !b->input_node || declare_syms(b)) {
    bfail(b, "out of memory while building");
    goto out;
  }
  for (int i = 0; i < r->n_val; i++) b->node[i] = -1;
  /* the call's inputs, all of them and in order, so that their sizes bind the symbols */
  for (int i = 0; i < r->n_in; i++) {
    const kiln_tensor *t = r->in[i];
    ir_node n = {.op = IR_INPUT, .index = i, .dtype = t->dtype, .ndim = t->ndim, .file = "", .line = 0};
    for (int d = 0; d < t->ndim; d++) n.shape[d] = sym_const(t->shape[d]);
    for (int k = 0; k < b->n_syms; k++)
      if (b->sym[k].input == i) n.shape[b->sym[k].dim] = sym_of(b, k);
    if ((b->input_node[i] = ir_append(b->g, &n)) < 0) {
      bfail(b, "out of memory while building");
      goto out;
    }
    note_shape(b, &b->g->nodes[b->input_node[i]]);
  }
  for (int ev = from; ev < to && !b->failed; ev++) {
    const rec_event *e = &r->ev[ev];
    b->rule_at[ev] = b->n_rules;
    int id = -1;
    switch (e->kind) {
    case EV_OP: id = ev_op(b, ev); break;
    case EV_INPLACE: id = ev_inplace(b, ev); break;
    case EV_FULL:
    case EV_DATA:
    case EV_RAND: id = ev_factory(b, ev); break;
    case EV_NUMEL: id = ev_numel(b, ev); break;
    case EV_CF: id = ev_cf(b, ev); break;
    case EV_ARG: id = ev_arg(b, ev); break;
    case EV_YIELD: id = ev_yield(b, ev); break;
    case EV_GET: id = ev_get(b, ev); break;
    case EV_BREAK:
    case EV_ESCAPE:
    case EV_DEAD: continue;
    }
    if (id >= 0 && e->out >= 0) b->node[e->out] = id;
  }
  b->rule_at[to] = b->n_rules;
  /* what the segment hands out, then its writes back */
  if (alloc_grow((void **)&seg->out, &seg->cap_out, n_out + 1, sizeof *seg->out)) bfail(b, "out of memory");
  for (int i = 0; i < n_out && !b->failed; i++) {
    int id = node_of(b, out[i]);
    if (id < 0) break;
    if (ir_add_output(b->g, id)) bfail(b, "out of memory");
    seg->out[seg->n_out++] = out[i];
    keep_shape(b, out[i], id);
  }
  for (int i = 0; i < n_writes && !b->failed; i++) {
    const build_write *w = &writes[i];
    int target = node_of(b, w->base);
    if (target < 0) break;
    if (w->now != w->base) {
      int value = node_of(b, w->now);
      if (value < 0) break;
      if (b->g->nodes[target].op == IR_CONST) {
        bfail(b, "an in-place write into a frozen param");
        break;
      }
      const rec_event *e = &r->ev[r->val[w->now].event];
      if (ir_add_write(b->g, (ir_write){.kind = IR_WRITE_DATA, .target = target, .value = value, .file = e->file, .line = e->line})) bfail(b, "out of memory");
    }
    if (!w->grad_set || (b->g->nodes[target].op != IR_INPUT && b->g->nodes[target].op != IR_PARAM)) continue;
    int gv = w->grad >= 0 ? node_of(b, w->grad) : -1;
    if (w->grad >= 0 && gv < 0) break;
    ir_write gw = {.kind = IR_WRITE_GRAD, .target = target, .value = gv, .file = ""};
    int wn = w->when >= 0 && gv >= 0 ? node_of(b, w->when) : -1;
    const ir_node *cn = wn >= 0 ? &b->g->nodes[wn] : NULL;
    bool one = cn && cn->dtype == KILN_BOOL;
    for (int d = 0; one && d < cn->ndim; d++) one = sym_same(cn->shape[d], sym_const(1));
    if (cn && !w->when_bool && cn->ndim > 0) gw.has_when = true, gw.when = cn->shape[0];
    if (cn && w->when_bool && one) gw.has_cond = true, gw.cond = wn; /* else made always: zeros where eager has none */
    gw.else_none = (gw.has_when || gw.has_cond) && w->else_none;
    if (ir_add_write(b->g, gw)) bfail(b, "out of memory");
  }
  bind_args(b);
  if (b->n_cf && !b->failed) bfail(b, "%s:%d: control flow whose regions did not end", b->cf[b->n_cf - 1].file, b->cf[b->n_cf - 1].line);
  if (b->has_cf && !b->failed) cf_finish(b);
out:
  while (b->n_cf) cf_frame_free(&b->cf[--b->n_cf]);
  if (!b->failed) {
    int *pos = alloc_malloc(sizeof(int) * (size_t)(b->g->n_nodes + 1));
    ir_graph *g = pos ? reorder(b->g, pos) : NULL;
    if (!pos) ir_free(b->g);
    alloc_free(pos);
    b->g = NULL;
    if (!g) bfail(b, "out of memory while building");
    for (int i = 0; g && i < g->n_nodes; i++)
      for (int k = 0; k < 2; k++)
        if (g->nodes[i].sub[k]) ir_region_sync(g->nodes[i].sub[k], g);
    seg->g = g;
  } else {
    ir_free(b->g);
    b->g = NULL;
  }
  alloc_free(b->node);
  alloc_free(b->input_node);
  b->node = b->input_node = NULL;
  return b->failed ? -1 : 0;
}
