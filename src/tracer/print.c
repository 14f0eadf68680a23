/* The IR's text form, written (docs/ir.md has the grammar; parse.c reads it
 * back). One graph is a header line listing the leaves and the outputs, the
 * symbol and guard lines, one line per node and one per write. The printer
 * writes only what the parser reads, so print(parse(print(g))) is print(g)
 * byte for byte; the same text is the dump and the file kiln_save writes.
 *
 * Floats are written as C99 hex floats, exact, by hand rather than with
 * printf("%a"): printf follows the caller's LC_NUMERIC and could write a
 * decimal comma, which the parser would split on. */
#include <inttypes.h>
#include <stdarg.h>
#include <string.h>

#include "tracer/tracer.h"

/* Where the text goes: a FILE, or a growing buffer (alloc_*) when f is NULL. */
typedef struct out {
  FILE *f;
  char *buf;
  size_t len, cap;
  bool failed; /* a write or an allocation failed: the text is incomplete */
} out;

static void put(out *o, const char *s, size_t n) {
  if (o->failed || !n) return;
  if (o->f) {
    if (fwrite(s, 1, n, o->f) != n) o->failed = true;
    return;
  }
  if (o->cap - o->len < n + 1) {
    size_t cap = o->cap ? o->cap : 256;
    while (cap - o->len < n + 1) cap *= 2;
    char *b = alloc_realloc(o->buf, cap);
    if (!b) {
      o->failed = true;
      return;
    }
    o->buf = b;
    o->cap = cap;
  }
  memcpy(o->buf + o->len, s, n);
  o->len += n;
  o->buf[o->len] = '\0';
}

static void put_str(out *o, const char *s) { put(o, s, strlen(s)); }

/* Short formatted pieces only (numbers, ids): at most 127 chars. */
static void putf(out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(out *o, const char *fmt, ...) {
  char b[128];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(b, sizeof b, fmt, ap);
  va_end(ap);
  if (n < 0 || (size_t)n >= sizeof b) {
    o->failed = true;
    return;
  }
  put(o, b, (size_t)n);
}

/* A symbolic dim; an error dim prints as "?" (the parser refuses it). */
static void put_dim(out *o, sym_dim d) {
  char small[128];
  int n = sym_print(d, small, sizeof small);
  if (n < 0) {
    put_str(o, "?");
  } else if ((size_t)n < sizeof small) {
    put(o, small, (size_t)n);
  } else {
    char *big = alloc_malloc((size_t)n + 1);
    if (!big) {
      o->failed = true;
      return;
    }
    sym_print(d, big, (size_t)n + 1);
    put(o, big, (size_t)n);
    alloc_free(big);
  }
}

static void put_dims(out *o, int n, const sym_dim *d) {
  put_str(o, "[");
  for (int i = 0; i < n; i++) {
    if (i) put_str(o, ",");
    put_dim(o, d[i]);
  }
  put_str(o, "]");
}

static void put_ints(out *o, int n, const int *v) {
  put_str(o, "[");
  for (int i = 0; i < n; i++) putf(o, i ? ",%d" : "%d", v[i]);
  put_str(o, "]");
}

static int clamp_rank(int n) { return n < 0 ? 0 : n > MAXD ? MAXD : n; }

static void put_type(out *o, const ir_node *n) {
  put_str(o, kiln_dtype_name(n->dtype));
  put_dims(o, clamp_rank(n->ndim), n->shape);
}

/* The hex float text of v, as glibc's "%a" writes it in the C locale:
 * [-]0x1.hhhp+d, [-]0x0.hhhp-1022 (subnormal), [-]0x0p+0, inf, nan. */
static int format_double(double v, char *b) {
  uint64_t bits;
  memcpy(&bits, &v, sizeof bits);
  bool neg = bits >> 63;
  int ex = (int)(bits >> 52 & 0x7ff);
  uint64_t man = bits & ((UINT64_C(1) << 52) - 1);
  char *p = b;
  if (neg) *p++ = '-';
  if (ex == 0x7ff) {
    memcpy(p, man ? "nan" : "inf", 4);
    return (int)(p + 3 - b);
  }
  *p++ = '0';
  *p++ = 'x';
  if (ex == 0 && man == 0) {
    memcpy(p, "0p+0", 5);
    return (int)(p + 4 - b);
  }
  *p++ = ex ? '1' : '0';
  if (man) {
    *p++ = '.';
    for (int sh = 48; sh >= 0 && man; sh -= 4) {
      *p++ = "0123456789abcdef"[man >> sh & 0xf];
      man &= (UINT64_C(1) << sh) - 1;
    }
  }
  int e = ex ? ex - 1023 : -1022;
  return (int)(p - b) + sprintf(p, "p%+d", e);
}

/* Element i of a const as it prints; NaNs of one sign print alike. */
static void format_elem(const ir_node *n, int64_t i, char *b) {
  switch (n->dtype) {
  case KILN_F32: format_double(((const float *)n->data)[i], b); break;
  case KILN_F64: format_double(((const double *)n->data)[i], b); break;
  case KILN_I64: sprintf(b, "%" PRId64, ((const int64_t *)n->data)[i]); break;
  case KILN_BOOL: sprintf(b, "%d", ((const unsigned char *)n->data)[i] != 0); break;
  case KILN_I32: sprintf(b, "%" PRId32, ((const int32_t *)n->data)[i]); break;
  case KILN_F16:
  case KILN_BF16: format_double(elem_load(n->dtype, n->data, i), b); break;
  default: strcpy(b, "?"); break;
  }
}

/* Whether elements i and j print the same text (bitwise equal, NaN payloads aside). */
static bool same_elem(const ir_node *n, int64_t i, int64_t j) {
  size_t sz = kiln_dtype_size(n->dtype);
  const unsigned char *d = n->data;
  if (!memcmp(d + (size_t)i * sz, d + (size_t)j * sz, sz)) return true;
  char a[40], b[40];
  format_elem(n, i, a);
  format_elem(n, j, b);
  return !strcmp(a, b);
}

static void put_const_values(out *o, const ir_node *n) {
  int64_t k = ir_node_numel_const(n);
  if (k <= 0 || !n->data || kiln_dtype_size(n->dtype) == 0) {
    if (k != 0) put_str(o, "?"); /* not printable: the parser refuses it */
    return;
  }
  int64_t show = k;
  bool uniform = true;
  for (int64_t i = 1; i < k && uniform; i++) uniform = same_elem(n, 0, i);
  if (uniform) show = 1;
  char b[40];
  for (int64_t i = 0; i < show && !o->failed; i++) {
    if (i) put_str(o, ", ");
    format_elem(n, i, b);
    put_str(o, b);
  }
}

/* ` {name=value, ...}`: the fields of the op's schema, in AF_ order. */
static void put_attrs(out *o, const ir_graph *g, int id) {
  const ir_node *n = &g->nodes[id];
  const op_attrs *a = &n->attrs;
  unsigned fields = ir_attr_fields(n->op);
  if (!fields) return;
  put_str(o, " {");
  const char *sep = "";
  for (int b = 0; b < AF_FIELDS; b++) {
    unsigned f = 1u << b;
    if (!(fields & f)) continue;
    put_str(o, sep);
    sep = ", ";
    put_str(o, attr_field_name(f));
    put_str(o, "=");
    char num[40];
    switch (f) {
    case AF_AXES: put_ints(o, clamp_rank(a->naxes), a->axes); break;
    case AF_KEEPDIM: put_str(o, a->keepdim ? "true" : "false"); break;
    case AF_FLAG: put_str(o, a->flag ? "true" : "false"); break;
    case AF_SHAPE: put_dims(o, clamp_rank(a->ndim), a->shape); break;
    case AF_PERM: {
      /* as many entries as the input has dims */
      int in = n->n_in >= 1 ? n->in[0] : -1;
      put_ints(o, in >= 0 && in < id ? clamp_rank(g->nodes[in].ndim) : 0, a->perm);
      break;
    }
    case AF_DIM: putf(o, "%d", a->dim); break;
    case AF_START: put_dim(o, a->start); break;
    case AF_END: put_dim(o, a->end); break;
    case AF_STEP: putf(o, "%" PRId64, a->step); break;
    case AF_K: putf(o, "%" PRId64, a->k); break;
    case AF_DTYPE: put_str(o, kiln_dtype_name(a->dtype)); break;
    case AF_VALUE: format_double(a->value, num); put_str(o, num); break;
    case AF_VALUE2: format_double(a->value2, num); put_str(o, num); break;
    case AF_RNG:
      put_str(o, "[");
      put_dim(o, a->seed);
      put_str(o, ",");
      put_dim(o, a->offset);
      put_str(o, "]");
      break;
    case AF_INTS:
      put_str(o, "[");
      for (int i = 0; i < (a->nints < 0 ? 0 : a->nints > 2 * MAXD ? 2 * MAXD : a->nints); i++) putf(o, i ? ",%" PRId64 : "%" PRId64, a->ints[i]);
      put_str(o, "]");
      break;
    default: break;
    }
  }
  put_str(o, "}");
}

/* "  # file:line", omitted when neither is known. Control characters in the
 * file name would break the line structure: they print as '?'. */
static void put_where(out *o, const char *file, int line) {
  if (!file) file = "";
  if (!*file && !line) return;
  put_str(o, "  # ");
  for (const char *s = file; *s; s++) {
    unsigned char c = (unsigned char)*s;
    put(o, c < 0x20 || c == 0x7f ? "?" : s, 1);
  }
  putf(o, ":%d", line);
}

static bool is_header_leaf(int op) { return op == IR_INPUT || op == IR_PARAM || op == IR_GRAD; }

static void put_name(out *o, const char *name) {
  char b[sizeof((ir_graph *)0)->name];
  size_t n = strnlen(name, sizeof b - 1);
  for (size_t i = 0; i < n; i++) {
    char c = name[i];
    bool ok =
        (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_' || (i > 0 && ((c >= '0' && c <= '9') || c == '.'));
    b[i] = ok ? c : '_';
  }
  b[n] = '\0';
  put_str(o, n ? b : "graph");
}

static void put_indent(out *o, int depth) {
  for (int i = 0; i < depth; i++) put_str(o, "  ");
}

static void print_region(out *o, const ir_graph *r, const char *name, int depth);

/* The node lines of g from node k on, indented depth steps; a control-flow
 * node's regions follow its line, one step deeper. */
static void print_nodes(out *o, const ir_graph *g, int k, int depth) {
  /* a leaf out of place prints as a node line, which the parser refuses */
  for (int id = k; id < g->n_nodes && !o->failed; id++) {
    const ir_node *n = &g->nodes[id];
    put_indent(o, depth);
    putf(o, "%%%d: ", id);
    if (ir_is_cf(n->op))
      put_str(o, "tuple");
    else
      put_type(o, n);
    put_str(o, " = ");
    put_str(o, ir_op_name(n->op));
    put_str(o, "(");
    if (n->op == IR_CONST) {
      put_const_values(o, n);
    } else {
      for (int j = 0; j < n->n_in; j++) putf(o, j ? ", %%%d" : "%%%d", n->in[j]);
    }
    put_str(o, ")");
    if (n->op == IR_SCAN) putf(o, " {carry=%d, xs=%d}", n->n_carry, n->n_xs);
    if (n->op == IR_WHILE) putf(o, " {carry=%d}", n->n_carry);
    put_attrs(o, g, id);
    put_where(o, n->file, n->line);
    put_str(o, "\n");
    for (int i = 0; i < ir_n_sub(n->op); i++) {
      if (n->sub[i]) {
        print_region(o, n->sub[i], ir_sub_name(n->op, i), depth + 1);
      } else {
        put_indent(o, depth + 1);
        put_str(o, "?\n"); /* a region missing: the parser refuses it */
      }
    }
  }
}

/* `region NAME(%0: TYPE, ...) -> (%N, ...)`, its nodes, then `end`. */
static void print_region(out *o, const ir_graph *r, const char *name, int depth) {
  int k = 0;
  while (k < r->n_nodes && is_header_leaf(r->nodes[k].op)) k++;
  put_indent(o, depth);
  put_str(o, "region ");
  put_str(o, name);
  put_str(o, "(");
  for (int i = 0; i < k; i++) {
    putf(o, i ? ", %%%d: " : "%%%d: ", i);
    put_type(o, &r->nodes[i]);
  }
  put_str(o, ") -> (");
  for (int i = 0; i < r->n_outputs; i++) putf(o, i ? ", %%%d" : "%%%d", r->outputs[i]);
  put_str(o, ")\n");
  print_nodes(o, r, k, depth + 1);
  put_indent(o, depth);
  put_str(o, "end\n");
}

static void print_graph(out *o, const ir_graph *g) {
  /* the leaves leading the node array are the header's arguments */
  int k = 0;
  while (k < g->n_nodes && is_header_leaf(g->nodes[k].op)) k++;

  put_str(o, "graph ");
  put_name(o, g->name);
  put_str(o, "(");
  for (int i = 0; i < k; i++) {
    const ir_node *n = &g->nodes[i];
    putf(o, i ? ", %%%d: " : "%%%d: ", i);
    put_type(o, n);
    if (n->op == IR_PARAM) put_str(o, " @param");
    if (n->op == IR_PARAM && n->name) putf(o, "(%s)", n->name);
    if (n->op == IR_INPUT && n->attrs.k > 0) putf(o, " @sym(s%lld)", (long long)(n->attrs.k - 1));
    if (n->op == IR_GRAD) putf(o, " @grad(%%%d)", n->n_in >= 1 ? n->in[0] : -1);
  }
  put_str(o, ") -> (");
  for (int i = 0; i < g->n_outputs; i++) putf(o, i ? ", %%%d" : "%%%d", g->outputs[i]);
  put_str(o, ")\n");

  for (int i = 0; i < g->n_syms && i < IR_MAX_SYMS; i++)
    putf(o, "  sym s%d in [%" PRId64 ", %" PRId64 "]\n", i, g->sym_lo[i], g->sym_hi[i]);

  if (g->n_guards) {
    put_str(o, "  guards: ");
    for (int i = 0; i < g->n_guards && !o->failed; i++) {
      char small[256];
      int n = sym_guard_print(&g->guards[i], small, sizeof small);
      if (i) put_str(o, ", ");
      if (n < 0) {
        put_str(o, "?");
      } else if ((size_t)n < sizeof small) {
        put(o, small, (size_t)n);
      } else {
        char *big = alloc_malloc((size_t)n + 1);
        if (!big) {
          o->failed = true;
          break;
        }
        sym_guard_print(&g->guards[i], big, (size_t)n + 1);
        put(o, big, (size_t)n);
        alloc_free(big);
      }
    }
    put_str(o, "\n");
  }

  print_nodes(o, g, k, 1);

  for (int i = 0; i < g->n_writes; i++) {
    const ir_write *w = &g->writes[i];
    if (w->kind == IR_WRITE_DATA)
      putf(o, "  write %%%d = %%%d", w->target, w->value);
    else if (w->value < 0)
      putf(o, "  grad %%%d = none", w->target);
    else
      putf(o, "  grad %%%d = %%%d", w->target, w->value);
    if (w->has_when) {
      put_str(o, " when ");
      put_dim(o, w->when);
    } else if (w->has_cond) {
      putf(o, " when %%%d", w->cond);
    }
    if ((w->has_when || w->has_cond) && w->else_none) put_str(o, " else none");
    put_where(o, w->file, w->line);
    put_str(o, "\n");
  }
}

int ir_print(const ir_graph *g, FILE *f) {
  if (!g || !f) return -1;
  out o = {.f = f};
  print_graph(&o, g);
  return o.failed ? -1 : 0;
}

char *ir_to_string(const ir_graph *g) {
  if (!g) return NULL;
  out o = {0};
  print_graph(&o, g);
  if (o.failed) {
    alloc_free(o.buf);
    return NULL;
  }
  return o.buf;
}
