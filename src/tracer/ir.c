/* The IR: a graph of nodes in topological order that refer to each other by
 * index, with inputs, implicit inputs (params), the .grad of params and
 * constants as leaf nodes. Everything a graph owns beyond its arrays lives in
 * one arena, freed in one call. Nodes are interned on (op, dtype, shape,
 * inputs, attrs, data), so equal subexpressions are one node by construction. */
#include <string.h>

#include "tracer/tracer.h"

/* ---- arena ---- */

typedef struct ir_block {
  struct ir_block *next;
  size_t used, cap;
  max_align_t data[];
} ir_block;

struct ir_arena {
  ir_block *head;
};

void *ir_alloc(ir_graph *g, size_t n) {
  n = (n + 15) & ~(size_t)15;
  ir_block *b = g->arena->head;
  if (!b || b->cap - b->used < n) {
    size_t cap = n > 16384 ? n : 16384;
    ir_block *nb = alloc_malloc(sizeof *nb + cap);
    if (!nb) return NULL;
    nb->next = b;
    nb->used = 0;
    nb->cap = cap;
    g->arena->head = b = nb;
  }
  void *p = (char *)b->data + b->used;
  b->used += n;
  memset(p, 0, n);
  return p;
}

const char *ir_str(ir_graph *g, const char *s) {
  if (!s) return "";
  /* file names repeat on every node: reuse the last few */
  for (int i = 0; i < g->n_nodes && i < 8; i++) {
    const ir_node *n = &g->nodes[g->n_nodes - 1 - i];
    if (n->file && !strcmp(n->file, s)) return n->file;
  }
  size_t len = strlen(s);
  char *c = ir_alloc(g, len + 1);
  if (!c) return NULL;
  memcpy(c, s, len + 1);
  return c;
}

/* ---- interning: open addressing over node ids ---- */

typedef struct ir_intern ir_intern;
struct ir_intern {
  int *slot; /* node id + 1, 0 empty */
  size_t cap;
};

static uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

static uint64_t dim_hash(sym_dim d) { return d.e ? (uint64_t)(uintptr_t)d.e : (uint64_t)d.c * 31 + 7; }

static size_t node_data_bytes(const ir_node *n) {
  int64_t k = ir_node_numel_const(n);
  return k < 0 ? 0 : (size_t)k * kiln_dtype_size(n->dtype);
}

static uint64_t node_hash(const ir_node *n) {
  uint64_t h = mix((uint64_t)n->op, (uint64_t)n->dtype * 17 + (uint64_t)n->ndim);
  for (int i = 0; i < n->ndim; i++) h = mix(h, dim_hash(n->shape[i]));
  for (int i = 0; i < n->n_in; i++) h = mix(h, (uint64_t)n->in[i]);
  h = mix(h, attrs_hash(ir_attr_fields(n->op), &n->attrs));
  h = mix(h, (uint64_t)n->index);
  h = mix(h, (uint64_t)(uintptr_t)n->sub[0] ^ (uint64_t)(uintptr_t)n->sub[1] * 3 ^ (uint64_t)n->n_carry << 32 ^ (uint64_t)n->n_xs);
  if (n->op == IR_CONST) {
    const unsigned char *p = n->data;
    size_t k = node_data_bytes(n);
    for (size_t i = 0; i < k && i < 256; i++) h = mix(h, p[i]);
  }
  return h;
}

static bool dim_eq(sym_dim a, sym_dim b) { return a.e == b.e && (a.e || a.c == b.c); }

static bool node_eq(const ir_node *a, const ir_node *b) {
  if (a->op != b->op || a->dtype != b->dtype || a->ndim != b->ndim || a->n_in != b->n_in || a->index != b->index)
    return false;
  /* control flow: equal when it runs the same regions over the same inputs */
  if (a->sub[0] != b->sub[0] || a->sub[1] != b->sub[1] || a->n_carry != b->n_carry || a->n_xs != b->n_xs) return false;
  for (int i = 0; i < a->ndim; i++)
    if (!dim_eq(a->shape[i], b->shape[i])) return false;
  for (int i = 0; i < a->n_in; i++)
    if (a->in[i] != b->in[i]) return false;
  if (!attrs_equal(ir_attr_fields(a->op), &a->attrs, &b->attrs)) return false;
  if (a->op == IR_CONST) return !memcmp(a->data, b->data, node_data_bytes(a));
  return true;
}

static int intern_grow(ir_graph *g) {
  ir_intern *t = g->intern;
  size_t cap = t->cap ? t->cap * 2 : 256;
  int *slot = alloc_calloc(cap, sizeof *slot);
  if (!slot) return -1;
  for (int id = 0; id < g->n_nodes; id++) {
    size_t i = node_hash(&g->nodes[id]) & (cap - 1);
    while (slot[i]) i = (i + 1) & (cap - 1);
    slot[i] = id + 1;
  }
  alloc_free(t->slot);
  t->slot = slot;
  t->cap = cap;
  return 0;
}

/* ---- graphs ---- */

ir_graph *ir_new(const char *name) {
  ir_graph *g = alloc_calloc(1, sizeof *g);
  if (!g) return NULL;
  g->arena = alloc_calloc(1, sizeof *g->arena);
  g->intern = alloc_calloc(1, sizeof *g->intern);
  g->sym = sym_ctx_new();
  if (!g->arena || !g->intern || !g->sym) {
    ir_free(g);
    return NULL;
  }
  snprintf(g->name, sizeof g->name, "%s", name && *name ? name : "graph");
  return g;
}

ir_graph *ir_new_like(ir_graph *src) {
  ir_graph *g = ir_new(src->name);
  if (!g) return NULL;
  g->leaves_share = src->leaves_share;
  sym_ctx_free(g->sym);
  g->sym = src->sym;
  if (src->region) {
    /* a region borrows its parent's symbols: both keep them */
    g->region = true;
    g->refs = 1;
  } else {
    src->sym = NULL;
  }
  g->n_syms = src->n_syms;
  memcpy(g->sym_lo, src->sym_lo, sizeof g->sym_lo);
  memcpy(g->sym_hi, src->sym_hi, sizeof g->sym_hi);
  return g;
}

void ir_free(ir_graph *g) {
  if (!g) return;
  if (g->region && --g->refs > 0) return;
  for (int i = 0; i < g->n_nodes; i++)
    for (int k = 0; k < 2; k++) ir_free(g->nodes[i].sub[k]);
  if (g->arena) {
    for (ir_block *b = g->arena->head, *nb; b; b = nb) {
      nb = b->next;
      alloc_free(b);
    }
    alloc_free(g->arena);
  }
  if (g->intern) alloc_free(g->intern->slot);
  alloc_free(g->intern);
  if (!g->region) sym_ctx_free(g->sym);
  alloc_free(g->nodes);
  alloc_free(g->outputs);
  alloc_free(g->writes);
  alloc_free(g->guards);
  alloc_free(g);
}

int ir_add_sym(ir_graph *g, int64_t lo, int64_t hi, sym_dim *out) {
  if (g->n_syms >= IR_MAX_SYMS) return -1;
  sym_dim d = sym_var(g->sym, g->n_syms, lo, hi);
  if (sym_is_err(d)) return -1;
  g->sym_lo[g->n_syms] = lo;
  g->sym_hi[g->n_syms] = hi;
  g->n_syms++;
  *out = d;
  return 0;
}

static int grow(void **p, int *cap, int n, size_t size) {
  if (n < *cap) return 0;
  int nc = *cap ? *cap * 2 : 16;
  void *q = alloc_realloc(*p, (size_t)nc * size);
  if (!q) return -1;
  *p = q;
  *cap = nc;
  return 0;
}

/* Copies n into the graph (its inputs and data into the arena). */
static int push(ir_graph *g, const ir_node *n) {
  if (grow((void **)&g->nodes, &g->cap_nodes, g->n_nodes, sizeof *g->nodes)) return -1;
  ir_node c = *n;
  if (n->n_in) {
    c.in = ir_alloc(g, sizeof(int) * (size_t)n->n_in);
    if (!c.in) return -1;
    memcpy(c.in, n->in, sizeof(int) * (size_t)n->n_in);
  } else {
    c.in = NULL;
  }
  if (n->op == IR_CONST) {
    size_t k = node_data_bytes(n);
    c.data = ir_alloc(g, k ? k : 1);
    if (!c.data) return -1;
    if (k) memcpy(c.data, n->data, k);
  }
  c.file = ir_str(g, n->file);
  if (!c.file) return -1;
  if (n->name && !(c.name = ir_str(g, n->name))) return -1;
  for (int k = 0; k < 2; k++)
    if (c.sub[k]) ir_region_hold(c.sub[k]);
  if (n->op == IR_INPUT) g->n_inputs++;
  if (n->op == IR_PARAM) g->n_params++;
  g->nodes[g->n_nodes] = c;
  return g->n_nodes++;
}

int ir_append(ir_graph *g, const ir_node *n) {
  int id = push(g, n);
  if (id < 0) return -1;
  /* keep the table consistent so later ir_add calls can find it */
  ir_intern *t = g->intern;
  if ((size_t)(g->n_nodes * 2) > t->cap) return intern_grow(g) ? -1 : id;
  size_t i = node_hash(&g->nodes[id]) & (t->cap - 1);
  while (t->slot[i]) i = (i + 1) & (t->cap - 1);
  t->slot[i] = id + 1;
  return id;
}

int ir_add(ir_graph *g, const ir_node *n) {
  ir_intern *t = g->intern;
  if (t->cap) {
    size_t i = node_hash(n) & (t->cap - 1);
    for (; t->slot[i]; i = (i + 1) & (t->cap - 1))
      if (node_eq(&g->nodes[t->slot[i] - 1], n)) return t->slot[i] - 1;
  }
  return ir_append(g, n);
}

int ir_add_output(ir_graph *g, int node) {
  int cap = g->n_outputs; /* exact growth: outputs are few */
  int *o = alloc_realloc(g->outputs, sizeof(int) * (size_t)(cap + 1));
  if (!o) return -1;
  g->outputs = o;
  g->outputs[g->n_outputs++] = node;
  return 0;
}

bool ir_write_skipped(const ir_graph *g, const ir_write *w, const int64_t *vals, const kiln_tensor *cond) {
  int64_t c;
  if (w->has_cond) return cond && !*(const unsigned char *)tensor_data(cond);
  return w->has_when && !sym_eval(w->when, vals, g->n_syms, &c) && c == 0;
}

int ir_write_reads(const ir_write *w, int ids[2]) {
  int n = 0;
  if (w->value >= 0) ids[n++] = w->value;
  if (w->has_cond) ids[n++] = w->cond;
  return n;
}

int ir_add_write(ir_graph *g, ir_write w) {
  ir_write *o = alloc_realloc(g->writes, sizeof *o * (size_t)(g->n_writes + 1));
  if (!o) return -1;
  g->writes = o;
  w.file = ir_str(g, w.file);
  if (!w.file) return -1;
  g->writes[g->n_writes++] = w;
  return 0;
}

int ir_add_guard(ir_graph *g, sym_guard gd) {
  for (int i = 0; i < g->n_guards; i++)
    if (g->guards[i].op == gd.op && sym_same(g->guards[i].lhs, gd.lhs) && sym_same(g->guards[i].rhs, gd.rhs)) return 0;
  sym_guard *o = alloc_realloc(g->guards, sizeof *o * (size_t)(g->n_guards + 1));
  if (!o) return -1;
  g->guards = o;
  g->guards[g->n_guards++] = gd;
  return 0;
}

/* ---- names ---- */

static const char *const leaf_names[] = {"input", "param", "grad", "const", "numel", "cond", "while", "scan", "get"};
_Static_assert(sizeof leaf_names / sizeof leaf_names[0] == IR_OP_COUNT - IR_INPUT, "a name for every IR op");

const char *ir_op_name(int op) {
  if (op >= 0 && op < OP_COUNT) return op_table[op].name;
  if (op >= IR_INPUT && op < IR_OP_COUNT) return leaf_names[op - IR_INPUT];
  return "?";
}

int ir_op_parse(const char *name, size_t n) {
  for (int op = 0; op < IR_OP_COUNT; op++) {
    const char *s = ir_op_name(op);
    if (strlen(s) == n && !memcmp(s, name, n)) return op;
  }
  return -1;
}

/* ---- evaluation helpers ---- */

int64_t ir_node_numel_const(const ir_node *n) {
  int64_t k = 1;
  for (int i = 0; i < n->ndim; i++) {
    if (!sym_is_const(n->shape[i]) || n->shape[i].c < 0) return -1;
    if (n->shape[i].c && k > INT64_MAX / n->shape[i].c) return -1;
    k *= n->shape[i].c;
  }
  return k;
}

int ir_node_shape(const ir_node *n, const int64_t *vals, int nvals, int64_t *shape) {
  for (int i = 0; i < n->ndim; i++)
    if (sym_eval(n->shape[i], vals, nvals, &shape[i]) || shape[i] < 0) return -1;
  return 0;
}

unsigned ir_attr_fields(int op) {
  if (op >= 0 && op < OP_COUNT) return op_table[op].attrs;
  return op == IR_NUMEL ? AF_AXES | AF_START : op == IR_GET ? AF_K : AF_NONE;
}

int ir_attrs_eval(const ir_node *n, const int64_t *vals, int nvals, op_attrs *out) {
  return attrs_eval(ir_attr_fields(n->op), &n->attrs, vals, nvals, out);
}

int *ir_use_counts(const ir_graph *g) {
  int *uses = alloc_calloc((size_t)g->n_nodes + 1, sizeof *uses);
  if (!uses) return NULL;
  for (int i = 0; i < g->n_nodes; i++)
    for (int j = 0; j < g->nodes[i].n_in; j++) uses[g->nodes[i].in[j]]++;
  for (int i = 0; i < g->n_outputs; i++) uses[g->outputs[i]]++;
  for (int i = 0; i < g->n_writes; i++) {
    int r[2], n = ir_write_reads(&g->writes[i], r);
    uses[g->writes[i].target]++;
    for (int k = 0; k < n; k++) uses[r[k]]++;
  }
  return uses;
}

int ir_copy_tail(ir_graph *dst, const ir_graph *src, const int *map) {
  for (int i = 0; i < src->n_outputs; i++)
    if (ir_add_output(dst, map[src->outputs[i]])) return -1;
  for (int i = 0; i < src->n_writes; i++) {
    ir_write w = src->writes[i];
    w.target = map[w.target];
    if (w.value >= 0) w.value = map[w.value];
    if (w.has_cond) w.cond = map[w.cond];
    if (ir_add_write(dst, w)) return -1;
  }
  for (int i = 0; i < src->n_guards; i++)
    if (ir_add_guard(dst, src->guards[i])) return -1;
  return 0;
}

ir_graph *ir_compact(const ir_graph *src, const bool *keep) {
  int *map = alloc_malloc(sizeof(int) * ((size_t)src->n_nodes + 1));
  /* the symbols' expressions live in src's context: move it over */
  ir_graph *g = map ? ir_new_like((ir_graph *)src) : NULL;
  if (!g || !map) goto oom;
  int in_buf[64];
  for (int i = 0; i < src->n_nodes; i++) {
    map[i] = -1;
    if (!keep[i]) continue;
    ir_node n = src->nodes[i];
    int *ins = n.n_in <= 64 ? in_buf : alloc_malloc(sizeof(int) * (size_t)n.n_in);
    if (!ins) goto oom;
    for (int j = 0; j < n.n_in; j++) ins[j] = map[n.in[j]];
    n.in = ins;
    map[i] = ir_append(g, &n);
    if (ins != in_buf) alloc_free(ins);
    if (map[i] < 0) goto oom;
  }
  if (ir_copy_tail(g, src, map)) goto oom;
  alloc_free(map);
  return g;
oom:
  alloc_free(map);
  ir_free(g);
  return NULL;
}

sym_dim ir_numel_value(const ir_graph *g, const ir_node *n) {
  const ir_node *x = &g->nodes[n->in[0]];
  sym_dim p = sym_const(1);
  if (n->attrs.naxes == 0)
    for (int i = 0; i < x->ndim; i++) p = sym_mul(g->sym, p, x->shape[i]);
  for (int i = 0; i < n->attrs.naxes && i < MAXD; i++)
    if (n->attrs.axes[i] >= 0 && n->attrs.axes[i] < x->ndim) p = sym_mul(g->sym, p, x->shape[n->attrs.axes[i]]);
  return sym_add(g->sym, p, n->attrs.start);
}

kiln_tensor *ir_const_tensor(const ir_node *n) {
  int64_t shape[MAXD];
  for (int i = 0; i < n->ndim; i++) shape[i] = n->shape[i].c;
  kiln_tensor *t = tensor_new(n->dtype, n->ndim, shape);
  if (t) {
    size_t bytes = (size_t)shape_numel(n->ndim, shape) * kiln_dtype_size(n->dtype);
    if (bytes) memcpy(t->st->data, n->data, bytes);
  }
  return t;
}

int ir_sym_id(const ir_graph *g, sym_dim d) {
  if (sym_is_const(d)) return -1;
  for (int k = 0; k < g->n_syms; k++)
    if (sym_same(d, sym_var(g->sym, k, g->sym_lo[k], g->sym_hi[k]))) return k;
  return -1;
}

bool ir_written_storage(const ir_graph *g, const kiln_tensor *t, kiln_tensor *const *in, kiln_tensor *const *params) {
  for (int i = 0; t && i < g->n_writes; i++) {
    if (g->writes[i].kind != IR_WRITE_DATA) continue;
    const kiln_tensor *dst = ir_leaf_tensor(g, &g->nodes[g->writes[i].target], in, params);
    if (dst && dst->st == t->st) return true;
  }
  return false;
}

int ir_outputs_before_writes(const ir_graph *g, kiln_tensor **out, int n, kiln_tensor *const *in, kiln_tensor *const *params) {
  for (int i = 0; g->n_writes && i < n; i++) {
    kiln_tensor *r = out[i];
    if (!r || !ir_written_storage(g, r, in, params)) continue;
    const storage *st = r->st;
    int others = 0;
    for (int j = i + 1; j < n; j++) others += out[j] && out[j]->st == st;
    if (!others) {
      /* alone over that memory: a copy of itself */
      kiln_tensor *c = op_run(OP_COPY, &out[i], 1, NULL, "", 0);
      if (!c) return -1;
      kiln_release(r);
      out[i] = c;
      continue;
    }
    /* outputs that view each other: views of one copy of the whole storage,
     * each keeping its layout */
    size_t es = kiln_dtype_size(r->dtype);
    kiln_tensor *all = tensor_view(r, 1, (int64_t[]){(int64_t)(st->bytes / es)}, (int64_t[]){1}, 0);
    kiln_tensor *whole = all ? op_run(OP_COPY, &all, 1, NULL, "", 0) : NULL;
    kiln_release(all);
    if (!whole) return -1;
    for (int j = i; j < n; j++) {
      if (!out[j] || out[j]->st != st) continue;
      kiln_tensor *v = tensor_view(whole, out[j]->ndim, out[j]->shape, out[j]->stride, out[j]->offset);
      if (!v) return kiln_release(whole), -1;
      kiln_release(out[j]);
      out[j] = v;
    }
    kiln_release(whole);
  }
  return 0;
}

kiln_tensor *ir_leaf_tensor(const ir_graph *g, const ir_node *n, kiln_tensor *const *in, kiln_tensor *const *params) {
  if (n->op == IR_INPUT) return in[n->index];
  if (n->op == IR_PARAM) return params[n->index];
  const ir_node *p = &g->nodes[n->in[0]];
  kiln_tensor *owner = p->op == IR_INPUT ? in[p->index] : params[p->index];
  return owner->grad;
}
