/* The IR's text form, read (docs/ir.md has the grammar; print.c writes it).
 * The text is copied once and cut into NUL-terminated lines as they are met. The header's
 * types may name symbols that the sym lines after it declare, so those are
 * read first, then the header, then the rest in order. Nodes are appended
 * with ir_append, never merged, so ids stay what the text says.
 *
 * The parser checks structure (ids count up, uses follow definitions,
 * arity, leaves only in the header, write and grad targets, a const's value
 * count) but not op semantics: ir_verify does that. Hostile text is bounded
 * everywhere (numbers, ranks, input counts, const sizes) and every error is
 * "line L, col C: why", or "out of memory". */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "tracer/tracer.h"

enum {
  CONST_MAX_NUMEL = 1 << 28, /* elements of one const */
  MAX_GUARDS = 1 << 12       /* ir_add_guard looks for duplicates: quadratic beyond this */
};

typedef struct out_ref {
  int id;
  long lno;
  long long col;
} out_ref;

typedef struct parser {
  ir_graph *g;
  char *text; /* the copy, each line NUL-terminated */
  char *end;  /* one past the last line's NUL */
  char *next; /* the next unread line */
  long next_lno;
  char *line;    /* the current line */
  long lno;      /* its number, 1-based */
  const char *p; /* the cursor in it */
  char *err;
  size_t errn;
  bool failed;
  int *ins; /* a node line's inputs */
  int cap_ins;
  out_ref *outs; /* the header's outputs, checked once all nodes are read */
  int n_outs, cap_outs;
  void *vals; /* a const's data while its line is read */
  int depth;  /* regions open around the current line */
} parser;

/* ---- errors ---- */

static int vfail(parser *ps, long lno, long long col, const char *fmt, va_list ap) {
  if (!ps->failed && ps->errn) {
    char msg[256];
    vsnprintf(msg, sizeof msg, fmt, ap);
    snprintf(ps->err, ps->errn, "line %ld, col %lld: %s", lno, col, msg);
  }
  ps->failed = true;
  return -1;
}

/* An error at position at of the current line; always -1. */
static int fail(parser *ps, const char *at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(parser *ps, const char *at, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail(ps, ps->lno, (long long)(at - ps->line) + 1, fmt, ap);
  va_end(ap);
  return -1;
}

/* An error at an explicit line and column; always -1. */
static int fail_pos(parser *ps, long lno, long long col, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int fail_pos(parser *ps, long lno, long long col, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail(ps, lno, col, fmt, ap);
  va_end(ap);
  return -1;
}

static int fail_oom(parser *ps) {
  if (!ps->failed && ps->errn) snprintf(ps->err, ps->errn, "out of memory");
  ps->failed = true;
  return -1;
}

/* The char at the cursor, for "unexpected ..." messages. */
static int fail_unexpected(parser *ps, const char *what) {
  unsigned char c = (unsigned char)*ps->p;
  if (!c) return fail(ps, ps->p, "%s at end of line", what);
  if (c >= 0x20 && c < 0x7f) return fail(ps, ps->p, "%s, not '%c'", what, c);
  return fail(ps, ps->p, "%s, not byte 0x%02x", what, c);
}

/* A "col N: why" error of sym_parse over text starting at base. */
static int fail_sym(parser *ps, const char *base, const char *e) {
  if (strstr(e, "out of memory")) return fail_oom(ps);
  long long col = 0;
  int k = 0;
  if (sscanf(e, "col %lld: %n", &col, &k) == 1 && k > 0 && col >= 1 && col <= (long long)strlen(base) + 1)
    return fail(ps, base + col - 1, "%s", e + k);
  return fail(ps, base, "%s", e);
}

/* ---- lexing within a line ---- */

static bool is_digit(char c) { return c >= '0' && c <= '9'; }
static bool is_alpha(char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_'; }
static bool is_word(char c) { return is_alpha(c) || is_digit(c); }

static void skip_blank(parser *ps) {
  while (*ps->p == ' ' || *ps->p == '\t') ps->p++;
}

/* Skips blanks, then tok or an error. */
static int expect(parser *ps, const char *tok) {
  skip_blank(ps);
  size_t n = strlen(tok);
  if (strncmp(ps->p, tok, n)) return fail(ps, ps->p, "expected '%s'", tok);
  ps->p += n;
  return 0;
}

static int expect_eol(parser *ps) {
  skip_blank(ps);
  return *ps->p ? fail_unexpected(ps, "expected end of line") : 0;
}

/* Skips blanks; the word ([A-Za-z0-9_]+) at the cursor, not consumed. */
static size_t peek_word(parser *ps) {
  skip_blank(ps);
  size_t n = 0;
  while (is_word(ps->p[n])) n++;
  return n;
}

/* Whether the next word is w; consumes it if so. */
static bool accept_word(parser *ps, const char *w) {
  size_t n = peek_word(ps);
  if (n != strlen(w) || strncmp(ps->p, w, n)) return false;
  ps->p += n;
  return true;
}

static int expect_word(parser *ps, const char *w) {
  return accept_word(ps, w) ? 0 : fail(ps, ps->p, "expected '%s'", w);
}

/* `key=` */
static int expect_key(parser *ps, const char *key) { return expect_word(ps, key) || expect(ps, "="); }

/* An optionally negative decimal integer in [lo, hi]. */
static int read_int(parser *ps, int64_t lo, int64_t hi, int64_t *out) {
  skip_blank(ps);
  const char *at = ps->p, *q = at;
  bool neg = *q == '-';
  if (neg) q++;
  if (!is_digit(*q)) return fail(ps, at, "expected a number");
  uint64_t limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX, v = 0;
  bool big = false;
  for (; is_digit(*q); q++) {
    uint64_t d = (uint64_t)(*q - '0');
    if (v > (limit - d) / 10)
      big = true;
    else
      v = v * 10 + d;
  }
  int64_t x = !neg ? (int64_t)v : v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v;
  if (big || x < lo || x > hi) {
    if (lo == INT64_MIN && hi == INT64_MAX) return fail(ps, at, "number out of range");
    return fail(ps, at, "number out of range [%lld, %lld]", (long long)lo, (long long)hi);
  }
  ps->p = q;
  *out = x;
  return 0;
}

/* `%N` with N a node id (not checked against the graph here). */
static int read_id(parser *ps, int *id) {
  skip_blank(ps);
  const char *at = ps->p;
  if (*at != '%' || !is_digit(at[1])) return fail(ps, at, "expected a node id '%%N'");
  int64_t v = 0;
  const char *q = at + 1;
  for (; is_digit(*q); q++)
    if ((v = v * 10 + (*q - '0')) >= INT_MAX) return fail(ps, at, "node id out of range");
  ps->p = q;
  *id = (int)v;
  return 0;
}

/* A node id that an earlier line (or header entry) defined. */
static int read_use(parser *ps, int *id) {
  const char *at = (skip_blank(ps), ps->p);
  if (read_id(ps, id)) return -1;
  if (*id >= ps->g->n_nodes) return fail(ps, at, "%%%d is not defined yet", *id);
  return 0;
}

static int read_dtype(parser *ps, kiln_dtype *dt) {
  size_t n = peek_word(ps);
  static const kiln_dtype all[] = {KILN_F32, KILN_F64, KILN_I64, KILN_BOOL, KILN_I32, KILN_F16, KILN_BF16};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
    const char *name = kiln_dtype_name(all[i]);
    if (n == strlen(name) && !strncmp(ps->p, name, n)) {
      *dt = all[i];
      ps->p += n;
      return 0;
    }
  }
  if (!n) return fail(ps, ps->p, "expected a dtype (f32, f64, f16, bf16, i64, i32, bool)");
  return fail(ps, ps->p, "unknown dtype '%.*s'", (int)(n > 32 ? 32 : n), ps->p);
}

/* Every s<id> in the expression text at p names a declared symbol. The
 * expression's chars are a subset of these, so the scan stops where it ends
 * (or later, at the end of a comparison). */
static int check_syms(parser *ps, const char *p) {
  size_t n = strspn(p, "s0123456789+-*/%() \t=!<>");
  for (size_t i = 0; i < n; i++) {
    if (p[i] != 's' || !is_digit(p[i + 1])) continue;
    size_t j = i + 1;
    int64_t id = 0;
    for (; j < n && is_digit(p[j]); j++) id = id < IR_MAX_SYMS ? id * 10 + (p[j] - '0') : id;
    if (id >= ps->g->n_syms)
      return fail(ps, p + i, "%.*s is not declared (no 'sym' line for it)", (int)(j - i > 24 ? 24 : j - i), p + i);
    i = j - 1;
  }
  return 0;
}

static int read_dim(parser *ps, sym_dim *d) {
  skip_blank(ps);
  const char *start = ps->p, *end;
  char e[192];
  if (check_syms(ps, start)) return -1;
  if (sym_parse(ps->g->sym, start, d, &end, e, sizeof e)) return fail_sym(ps, start, e);
  ps->p = end;
  return 0;
}

/* `[d, d, ...]` of at most MAXD symbolic dims. */
static int read_dims(parser *ps, int *nd, sym_dim *dims) {
  if (expect(ps, "[")) return -1;
  *nd = 0;
  skip_blank(ps);
  if (*ps->p == ']') {
    ps->p++;
    return 0;
  }
  for (;;) {
    skip_blank(ps);
    if (*nd == MAXD) return fail(ps, ps->p, "more than %d dims", MAXD);
    if (read_dim(ps, &dims[(*nd)++])) return -1;
    skip_blank(ps);
    if (*ps->p == ']') break;
    if (*ps->p != ',') return fail_unexpected(ps, "expected ',' or ']'");
    ps->p++;
  }
  ps->p++;
  return 0;
}

/* `[i, i, ...]` of at most MAXD ints in [0, MAXD). */
/* `[a,b,...]`: at most max integers in [lo, hi]. */
static int read_list(parser *ps, int max, int64_t lo, int64_t hi, int *n, int64_t *v) {
  if (expect(ps, "[")) return -1;
  *n = 0;
  skip_blank(ps);
  if (*ps->p == ']') {
    ps->p++;
    return 0;
  }
  for (;;) {
    skip_blank(ps);
    if (*n == max) return fail(ps, ps->p, "more than %d entries", max);
    if (read_int(ps, lo, hi, &v[*n])) return -1;
    (*n)++;
    skip_blank(ps);
    if (*ps->p == ']') break;
    if (*ps->p != ',') return fail_unexpected(ps, "expected ',' or ']'");
    ps->p++;
  }
  ps->p++;
  return 0;
}

/* `[a,b,...]` of dim numbers (0 .. MAXD-1). */
static int read_ints(parser *ps, int *n, int *v) {
  int64_t x[MAXD];
  if (read_list(ps, MAXD, 0, MAXD - 1, n, x)) return -1;
  for (int i = 0; i < *n; i++) v[i] = (int)x[i];
  return 0;
}

/* `f32[s0,4]` into n's dtype and shape. */
static int read_type(parser *ps, ir_node *n) { return read_dtype(ps, &n->dtype) || read_dims(ps, &n->ndim, n->shape); }

/* `  # file:line` at the end of a node or write line, or nothing. The file
 * is everything up to the last ':' (cut out of the line in place). */
static int read_where(parser *ps, const char **file, int *line) {
  *file = "";
  *line = 0;
  skip_blank(ps);
  if (*ps->p != '#') return 0;
  ps->p++;
  if (*ps->p != ' ') return fail_unexpected(ps, "expected ' ' after '#'");
  char *start = ps->line + (ps->p + 1 - ps->line);
  char *colon = strrchr(start, ':');
  if (!colon) return fail(ps, start, "expected 'file:line' after '# '");
  ps->p = colon + 1;
  int64_t v;
  if (read_int(ps, INT_MIN, INT_MAX, &v) || expect_eol(ps)) return -1;
  *colon = '\0';
  *file = start;
  *line = (int)v;
  return 0;
}

/* ---- const values ---- */

static int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* The digits of a hex float after "0x": h[.h][p[+-]d], rounded to nearest
 * even. NULL when malformed, else where it ended. Locale-free, unlike strtod. */
static const char *hex_float(const char *q, double *v) {
  uint64_t m = 0;
  int64_t e2 = 0;
  bool sticky = false, any = false, dot = false;
  for (;; q++) {
    if (*q == '.' && !dot) {
      dot = true;
      continue;
    }
    int d = hex_digit(*q);
    if (d < 0) break;
    any = true;
    if (m >> 60) { /* full: the rest only decides rounding */
      sticky |= d != 0;
      if (!dot) e2 += 4;
    } else {
      m = m << 4 | (uint64_t)d;
      if (dot) e2 -= 4;
    }
  }
  if (!any) return NULL;
  if (*q == 'p' || *q == 'P') {
    q++;
    bool neg = *q == '-';
    if (*q == '-' || *q == '+') q++;
    if (!is_digit(*q)) return NULL;
    int64_t x = 0;
    for (; is_digit(*q); q++) x = x < 100000 ? x * 10 + (*q - '0') : x; /* saturates far outside double */
    e2 += neg ? -x : x;
  }
  if (m == 0) {
    *v = 0.0;
    return q;
  }
  int lz = __builtin_clzll(m);
  m <<= lz;
  e2 -= lz;            /* value = m * 2^e2, m in [2^63, 2^64) */
  int64_t e = e2 + 63; /* value in [2^e, 2^(e+1)) */
  if (e > 1023) {
    *v = INFINITY;
    return q;
  }
  int64_t keep = e + 1075; /* significant bits a double holds at this exponent */
  if (keep > 53) keep = 53;
  if (keep <= 0) {
    bool up = keep == 0 && (m > UINT64_C(1) << 63 || (m == UINT64_C(1) << 63 && sticky));
    *v = up ? 0x1p-1074 : 0.0;
    return q;
  }
  int drop = (int)(64 - keep);
  uint64_t r = m >> drop, rem = m & ((UINT64_C(1) << drop) - 1), half = UINT64_C(1) << (drop - 1);
  if (rem > half || (rem == half && (sticky || (r & 1)))) r++;
  *v = ldexp((double)r, (int)(e2 + drop));
  return q;
}

/* A float: [+-] inf | nan | 0x hex float | decimal. */
static int read_float(parser *ps, double *out) {
  skip_blank(ps);
  const char *at = ps->p, *q = at;
  bool neg = *q == '-';
  if (*q == '-' || *q == '+') q++;
  double v;
  if (!strncmp(q, "inf", 3) && !is_word(q[3])) {
    v = INFINITY;
    q += 3;
  } else if (!strncmp(q, "nan", 3) && !is_word(q[3])) {
    v = NAN;
    q += 3;
  } else if (q[0] == '0' && (q[1] == 'x' || q[1] == 'X')) {
    q = hex_float(q + 2, &v);
    if (!q) return fail(ps, at, "malformed hex float");
  } else if (is_digit(*q) || *q == '.') {
    const char *s = q;
    size_t digits = 0;
    for (; is_digit(*q); q++) digits++;
    if (*q == '.')
      for (q++; is_digit(*q); q++) digits++;
    if (!digits) return fail(ps, at, "expected a number");
    if (*q == 'e' || *q == 'E') {
      q++;
      if (*q == '+' || *q == '-') q++;
      if (!is_digit(*q)) return fail(ps, at, "malformed number");
      while (is_digit(*q)) q++;
    }
    char buf[128];
    if ((size_t)(q - s) >= sizeof buf) return fail(ps, at, "number longer than %d chars", (int)sizeof buf - 1);
    memcpy(buf, s, (size_t)(q - s));
    buf[q - s] = '\0';
    char *e;
    v = strtod(buf, &e);
    if (*e) return fail(ps, at, "malformed number");
  } else {
    return fail(ps, at, "expected a number");
  }
  if (is_word(*q) || *q == '.') return fail(ps, at, "malformed number");
  ps->p = q;
  *out = neg ? -v : v;
  return 0;
}

static int read_value(parser *ps, kiln_dtype dt, void *data, int64_t i) {
  double d;
  int64_t x;
  const char *at = (skip_blank(ps), ps->p);
  switch (dt) {
  case KILN_F32:
    if (read_float(ps, &d)) return -1;
    ((float *)data)[i] = (float)d;
    return 0;
  case KILN_F64:
    if (read_float(ps, &d)) return -1;
    ((double *)data)[i] = d;
    return 0;
  case KILN_I64:
    if (read_int(ps, INT64_MIN, INT64_MAX, &x)) return -1;
    ((int64_t *)data)[i] = x;
    return 0;
  case KILN_BOOL:
    if (read_int(ps, INT64_MIN, INT64_MAX, &x)) return -1;
    if (x != 0 && x != 1) return fail(ps, at, "a bool is 0 or 1");
    ((unsigned char *)data)[i] = (unsigned char)x;
    return 0;
  case KILN_I32:
    if (read_int(ps, INT32_MIN, INT32_MAX, &x)) return -1;
    ((int32_t *)data)[i] = (int32_t)x;
    return 0;
  case KILN_F16:
  case KILN_BF16:
    /* printed exactly (every f16 and bf16 is a double), so this rounding is exact too */
    if (read_float(ps, &d)) return -1;
    elem_store(dt, data, i, d);
    return 0;
  }
  return fail(ps, at, "bad dtype");
}

/* The values of a const after its '(' and up to its ')': numel of them, or
 * one for all. The shape must be concrete. */
static int read_const(parser *ps, ir_node *n, const char *type_at) {
  int64_t numel = 1;
  bool zero = false;
  for (int i = 0; i < n->ndim; i++) {
    if (!sym_is_const(n->shape[i]) || n->shape[i].c < 0)
      return fail(ps, type_at, "a const's shape must be concrete and non-negative");
    int64_t c = n->shape[i].c;
    if (c == 0)
      zero = true;
    else if (numel > CONST_MAX_NUMEL / c)
      return fail(ps, type_at, "a const holds at most %d elements", CONST_MAX_NUMEL);
    else
      numel *= c;
  }
  if (zero) numel = 0;
  size_t size = kiln_dtype_size(n->dtype);
  ps->vals = alloc_malloc((size_t)numel * size + 1);
  if (!ps->vals) return fail_oom(ps);
  int64_t count = 0;
  skip_blank(ps);
  if (*ps->p != ')') {
    for (;;) {
      skip_blank(ps);
      if (count == numel) return fail(ps, ps->p, "more values than the %lld of the shape", (long long)numel);
      if (read_value(ps, n->dtype, ps->vals, count++)) return -1;
      skip_blank(ps);
      if (*ps->p == ')') break;
      if (*ps->p != ',') return fail_unexpected(ps, "expected ',' or ')'");
      ps->p++;
    }
  }
  if (count == 1)
    for (int64_t i = 1; i < numel; i++) memcpy((char *)ps->vals + (size_t)i * size, ps->vals, size);
  else if (count != numel)
    return fail(ps, ps->p, "a const of %lld elements needs %lld values or one, not %lld", (long long)numel,
                (long long)numel, (long long)count);
  ps->p++;
  n->data = ps->vals;
  return 0;
}

/* ---- lines ---- */

/* Moves to the next line that is neither blank nor a comment, the cursor at
 * its first char; false at the end of the text (the cursor then at the end of
 * the last line, where errors about missing text point). Lines are cut as
 * they are reached: a line already passed stays cut. */
static bool next_line(parser *ps) {
  while (ps->next < ps->end) {
    char *s = ps->next, *nl = strchr(s, '\n');
    size_t n = nl ? (size_t)(nl - s) : strlen(s);
    ps->next = s + n + 1;
    if (nl) *nl = '\0';
    if (n && s[n - 1] == '\r') s[--n] = '\0'; /* CRLF */
    ps->lno = ps->next_lno++;
    ps->line = s;
    ps->p = s;
    skip_blank(ps);
    if (*ps->p && *ps->p != ';') return true;
    ps->p = s + n;
  }
  return false;
}

static bool is_header_leaf(int op) { return op == IR_INPUT || op == IR_PARAM || op == IR_GRAD; }

/* `sym sK in [LO, HI]`, the word sym already read. */
static int parse_sym(parser *ps) {
  ir_graph *g = ps->g;
  skip_blank(ps);
  const char *at = ps->p;
  int64_t id, lo, hi;
  if (*ps->p != 's' || !is_digit(ps->p[1])) return fail(ps, at, "expected s%d", g->n_syms);
  ps->p++;
  if (read_int(ps, 0, INT_MAX, &id)) return -1;
  if (id != g->n_syms) return fail(ps, at, "expected s%d (symbols are declared in order)", g->n_syms);
  if (g->n_syms == IR_MAX_SYMS) return fail(ps, at, "more than %d symbols", IR_MAX_SYMS);
  if (expect_word(ps, "in") || expect(ps, "[")) return -1;
  const char *lo_at = (skip_blank(ps), ps->p);
  if (read_int(ps, INT64_MIN, INT64_MAX, &lo) || expect(ps, ",") || read_int(ps, INT64_MIN, INT64_MAX, &hi) ||
      expect(ps, "]") || expect_eol(ps))
    return -1;
  if (lo > hi) return fail(ps, lo_at, "empty bounds: %lld > %lld", (long long)lo, (long long)hi);
  sym_dim d;
  return ir_add_sym(g, lo, hi, &d) ? fail_oom(ps) : 0;
}

/* `graph NAME(leaves) -> (outputs)`, the word graph already read. */
/* `-> (%N, ...)` to the end of the line: the outputs, checked once the
 * nodes are read (resolve_outputs). */
static int read_outputs(parser *ps) {
  if (expect(ps, "->") || expect(ps, "(")) return -1;
  skip_blank(ps);
  if (*ps->p != ')')
    for (;;) {
      skip_blank(ps);
      const char *at = ps->p;
      int id;
      if (read_id(ps, &id)) return -1;
      if (ps->n_outs == ps->cap_outs) {
        int cap = ps->cap_outs ? ps->cap_outs * 2 : 8;
        out_ref *o = alloc_realloc(ps->outs, sizeof *o * (size_t)cap);
        if (!o) return fail_oom(ps);
        ps->outs = o;
        ps->cap_outs = cap;
      }
      ps->outs[ps->n_outs++] = (out_ref){id, ps->lno, (long long)(at - ps->line) + 1};
      skip_blank(ps);
      if (*ps->p == ')') break;
      if (*ps->p != ',') return fail_unexpected(ps, "expected ',' or ')'");
      ps->p++;
    }
  ps->p++;
  return expect_eol(ps);
}

static int resolve_outputs(parser *ps) {
  for (int i = 0; i < ps->n_outs; i++) {
    out_ref o = ps->outs[i];
    if (o.id >= ps->g->n_nodes) return fail_pos(ps, o.lno, o.col, "output %%%d is not defined", o.id);
    if (ir_add_output(ps->g, o.id)) return fail_oom(ps);
  }
  return 0;
}

static int parse_header(parser *ps) {
  ir_graph *g = ps->g;
  skip_blank(ps);
  const char *name = ps->p;
  size_t n = 0;
  if (is_alpha(name[0]))
    while (is_word(name[n]) || name[n] == '.') n++;
  if (!n) return fail(ps, name, "expected the graph's name");
  if (n >= sizeof g->name) return fail(ps, name, "graph name longer than %d chars", (int)sizeof g->name - 1);
  memcpy(g->name, name, n);
  g->name[n] = '\0';
  ps->p += n;
  if (expect(ps, "(")) return -1;
  skip_blank(ps);
  if (*ps->p != ')')
    for (;;) {
      skip_blank(ps);
      const char *at = ps->p;
      int id, k;
      ir_node leaf = {.op = IR_INPUT, .file = ""};
      if (read_id(ps, &id)) return -1;
      if (id != g->n_nodes) return fail(ps, at, "expected %%%d (ids count up from %%0)", g->n_nodes);
      if (expect(ps, ":") || read_type(ps, &leaf)) return -1;
      skip_blank(ps);
      if (*ps->p == '@') {
        ps->p++;
        if (accept_word(ps, "param")) {
          leaf.op = IR_PARAM;
          if (*ps->p == '(') { /* its name: kiln_param_name's characters */
            char *nm = (char *)++ps->p;
            size_t len = 0;
            while (len < 128 && (is_word(nm[len]) || (nm[len] && strchr(".:/-", nm[len])))) len++;
            if (!len || nm[len] != ')') return fail(ps, nm + len, "expected a param name (1 to 128 of A-Z a-z 0-9 _ . : / -) and ')'");
            nm[len] = '\0'; /* the text is ours: cut the name out in place */
            leaf.name = nm;
            ps->p = nm + len + 1;
          }
        } else if (accept_word(ps, "grad")) {
          if (expect(ps, "(")) return -1;
          const char *kat = (skip_blank(ps), ps->p);
          if (read_use(ps, &k)) return -1;
          int kop = g->nodes[k].op;
          if (kop != IR_PARAM && kop != IR_INPUT) return fail(ps, kat, "%%%d is not an input or a param", k);
          if (expect(ps, ")")) return -1;
          leaf.op = IR_GRAD;
          leaf.n_in = 1;
          leaf.in = &k;
        } else if (accept_word(ps, "sym")) {
          /* an input whose value (a 0-d i64) is the size s<k>: a number the call passes */
          if (expect(ps, "(")) return -1;
          const char *sat = (skip_blank(ps), ps->p);
          int64_t sk;
          if (*ps->p != 's') return fail(ps, sat, "expected a symbol s<k>");
          ps->p++;
          if (read_int(ps, 0, IR_MAX_SYMS - 1, &sk) || expect(ps, ")")) return -1;
          if (leaf.dtype != KILN_I64 || leaf.ndim != 0) return fail(ps, sat, "a size argument is an i64[] input");
          leaf.attrs.k = sk + 1;
        } else {
          return fail(ps, ps->p, "expected '@param', '@grad(%%N)' or '@sym(s<k>)'");
        }
      }
      leaf.index = leaf.op == IR_INPUT ? g->n_inputs : leaf.op == IR_PARAM ? g->n_params : 0;
      if (ir_append(g, &leaf) < 0) return fail_oom(ps);
      skip_blank(ps);
      if (*ps->p == ')') break;
      if (*ps->p != ',') return fail_unexpected(ps, "expected ',' or ')'");
      ps->p++;
    }
  ps->p++;
  return read_outputs(ps);
}

/* `guards: G, G, ...`, the word guards already read. */
static int parse_guards(parser *ps) {
  if (expect(ps, ":")) return -1;
  for (;;) {
    skip_blank(ps);
    const char *at = ps->p, *end;
    char e[192];
    sym_guard gd;
    if (ps->g->n_guards == MAX_GUARDS) return fail(ps, at, "more than %d guards", MAX_GUARDS);
    if (check_syms(ps, at)) return -1;
    if (sym_guard_parse(ps->g->sym, at, &gd, &end, e, sizeof e)) return fail_sym(ps, at, e);
    if (ir_add_guard(ps->g, gd)) return fail_oom(ps);
    ps->p = end;
    skip_blank(ps);
    if (!*ps->p) return 0;
    if (*ps->p != ',') return fail_unexpected(ps, "expected ',' or end of line");
    ps->p++;
  }
}

/* Inputs an op takes: -1 for one or more, -2 for an op with no node line. */
static int op_arity(int op) {
  if (op >= 0 && op < OP_COUNT) return op_table[op].arity;
  return op == IR_NUMEL || op == IR_GET ? 1 : ir_is_cf(op) ? -1 : -2;
}

static int read_bool(parser *ps, bool *b) {
  if (accept_word(ps, "true")) return *b = true, 0;
  if (accept_word(ps, "false")) return *b = false, 0;
  return fail(ps, ps->p, "expected 'true' or 'false'");
}

/* `{...}` after a node's ')': exactly the fields of its op's schema, in order. */
static int read_attrs(parser *ps, ir_node *n) {
  op_attrs *a = &n->attrs;
  unsigned fields = ir_attr_fields(n->op);
  skip_blank(ps);
  if (!fields) return *ps->p == '{' ? fail(ps, ps->p, "'%s' takes no attributes", ir_op_name(n->op)) : 0;
  if (expect(ps, "{")) return -1;
  bool first = true;
  for (int b = 0; b < AF_FIELDS; b++) {
    unsigned f = 1u << b;
    if (!(fields & f)) continue;
    if (!first && expect(ps, ",")) return -1;
    first = false;
    if (expect_key(ps, attr_field_name(f))) return -1;
    int64_t x;
    const char *at = (skip_blank(ps), ps->p);
    switch (f) {
    case AF_AXES:
      if (read_ints(ps, &a->naxes, a->axes)) return -1;
      break;
    case AF_KEEPDIM:
      if (read_bool(ps, &a->keepdim)) return -1;
      break;
    case AF_FLAG:
      if (read_bool(ps, &a->flag)) return -1;
      break;
    case AF_SHAPE:
      if (read_dims(ps, &a->ndim, a->shape)) return -1;
      break;
    case AF_PERM: {
      int k, rank = ps->g->nodes[n->in[0]].ndim;
      if (read_ints(ps, &k, a->perm)) return -1;
      if (k != rank) return fail(ps, at, "perm has %d entries but %%%d has %d dims", k, n->in[0], rank);
      break;
    }
    case AF_DIM:
      if (read_int(ps, 0, MAXD - 1, &x)) return -1;
      a->dim = (int)x;
      break;
    case AF_START:
      if (read_dim(ps, &a->start)) return -1;
      break;
    case AF_END:
      if (read_dim(ps, &a->end)) return -1;
      break;
    case AF_STEP:
      if (read_int(ps, INT64_MIN, INT64_MAX, &a->step)) return -1;
      break;
    case AF_K:
      if (read_int(ps, INT64_MIN, INT64_MAX, &a->k)) return -1;
      break;
    case AF_DTYPE:
      if (read_dtype(ps, &a->dtype)) return -1;
      break;
    case AF_VALUE:
      if (read_float(ps, &a->value)) return -1;
      break;
    case AF_VALUE2:
      if (read_float(ps, &a->value2)) return -1;
      break;
    case AF_RNG:
      if (expect(ps, "[") || read_dim(ps, &a->seed) || expect(ps, ",") || read_dim(ps, &a->offset) || expect(ps, "]"))
        return -1;
      break;
    case AF_INTS:
      if (read_list(ps, 2 * MAXD, INT64_MIN, INT64_MAX, &a->nints, a->ints)) return -1;
      break;
    default:
      break;
    }
  }
  return expect(ps, "}");
}

/* scan's `{carry=N, xs=M}` and while's `{carry=N}`: how its inputs split. */
static int read_cf_attrs(parser *ps, ir_node *n, const char *op_at) {
  if (n->op != IR_SCAN && n->op != IR_WHILE) return 0;
  int64_t c, x = 0;
  if (expect(ps, "{") || expect_key(ps, "carry") || read_int(ps, 0, n->n_in, &c)) return -1;
  if (n->op == IR_SCAN && (expect(ps, ",") || expect_key(ps, "xs") || read_int(ps, 1, n->n_in - c, &x))) return -1;
  if (expect(ps, "}")) return -1;
  if (n->op == IR_WHILE && c < 1) return fail(ps, op_at, "a while loop carries at least one value");
  n->n_carry = (int)c;
  n->n_xs = (int)x;
  return 0;
}

static int parse_node(parser *ps);

/* Region i of node id: `region NAME(%0: TYPE, ...) -> (%N, ...)`, its node
 * lines, `end`. Its ids count from %0 again; it sees only its arguments. */
static int parse_region(parser *ps, int id, int i) {
  enum { MAX_DEPTH = 32 };
  ir_graph *parent = ps->g;
  int op = parent->nodes[id].op;
  const char *name = ir_sub_name(op, i);
  if (!next_line(ps)) return fail(ps, ps->p, "expected 'region %s' of %%%d", name, id);
  if (!accept_word(ps, "region")) return fail(ps, ps->p, "expected 'region %s' of %%%d", name, id);
  if (!accept_word(ps, name)) return fail(ps, ps->p, "expected region '%s'", name);
  if (ps->depth == MAX_DEPTH) return fail(ps, ps->p, "regions nested more than %d deep", MAX_DEPTH);
  ir_graph *r = ir_region_new(parent, name);
  if (!r) return fail_oom(ps);
  parent->nodes[id].sub[i] = r; /* the parent frees it from now on */
  out_ref *outs = ps->outs;
  int n_outs = ps->n_outs, cap_outs = ps->cap_outs;
  ps->outs = NULL;
  ps->n_outs = ps->cap_outs = 0;
  ps->g = r;
  ps->depth++;
  int rc = expect(ps, "(");
  skip_blank(ps);
  if (!rc && *ps->p != ')')
    for (;;) {
      skip_blank(ps);
      const char *at = ps->p;
      int a;
      ir_node leaf = {.op = IR_INPUT, .file = "", .index = r->n_inputs};
      if ((rc = read_id(ps, &a))) break;
      if (a != r->n_nodes) {
        rc = fail(ps, at, "expected %%%d (ids count up from %%0)", r->n_nodes);
        break;
      }
      if ((rc = expect(ps, ":") || read_type(ps, &leaf))) break;
      if (ir_append(r, &leaf) < 0) {
        rc = fail_oom(ps);
        break;
      }
      skip_blank(ps);
      if (*ps->p == ')') break;
      if (*ps->p != ',') {
        rc = fail_unexpected(ps, "expected ',' or ')'");
        break;
      }
      ps->p++;
    }
  if (!rc) {
    ps->p++;
    rc = read_outputs(ps);
  }
  while (!rc) {
    if (!next_line(ps)) {
      rc = fail(ps, ps->p, "region '%s' of %%%d has no 'end'", name, id);
    } else if (accept_word(ps, "end")) {
      rc = expect_eol(ps) || resolve_outputs(ps);
      break;
    } else if (*ps->p == '%') {
      rc = parse_node(ps);
    } else {
      rc = fail(ps, ps->p, "expected a node line or 'end' in region '%s'", name);
    }
  }
  alloc_free(ps->outs);
  ps->outs = outs;
  ps->n_outs = n_outs;
  ps->cap_outs = cap_outs;
  ps->g = parent;
  ps->depth--;
  return rc ? -1 : 0;
}

/* `%ID: TYPE = OP(ARGS) {ATTRS}  # file:line`, the cursor at '%'. */
static int parse_node(parser *ps) {
  ir_graph *g = ps->g;
  ir_node n = {0};
  const char *at = ps->p;
  int id;
  if (read_id(ps, &id)) return -1;
  if (id != g->n_nodes) return fail(ps, at, "expected %%%d (ids count up by one)", g->n_nodes);
  if (expect(ps, ":")) return -1;
  const char *type_at = (skip_blank(ps), ps->p);
  bool tuple = accept_word(ps, "tuple");
  if ((!tuple && read_type(ps, &n)) || expect(ps, "=")) return -1;
  size_t len = peek_word(ps);
  const char *op_at = ps->p;
  if (!len) return fail(ps, op_at, "expected an op name");
  n.op = ir_op_parse(op_at, len);
  if (n.op < 0) return fail(ps, op_at, "unknown op '%.*s'", (int)(len > 32 ? 32 : len), op_at);
  if (tuple != ir_is_cf(n.op))
    return fail(ps, tuple ? type_at : op_at, tuple ? "only cond, while and scan make a tuple" : "'%s' makes a tuple: write its type 'tuple'",
                ir_op_name(n.op));
  if (is_header_leaf(n.op))
    return fail(ps, op_at, "'%s' is a leaf: leaves are listed in the graph header", ir_op_name(n.op));
  if (n.op != IR_CONST && op_arity(n.op) == -2) return fail(ps, op_at, "'%s' has no node line", ir_op_name(n.op));
  ps->p += len;
  if (expect(ps, "(")) return -1;
  if (n.op == IR_CONST) {
    if (read_const(ps, &n, type_at)) return -1;
  } else {
    skip_blank(ps);
    if (*ps->p != ')')
      for (;;) {
        if (n.n_in == IR_MAX_IN) return fail(ps, ps->p, "more than %d inputs", IR_MAX_IN);
        if (n.n_in == ps->cap_ins) {
          int cap = ps->cap_ins ? ps->cap_ins * 2 : 16;
          int *ins = alloc_realloc(ps->ins, sizeof *ins * (size_t)cap);
          if (!ins) return fail_oom(ps);
          ps->ins = ins;
          ps->cap_ins = cap;
        }
        if (read_use(ps, &ps->ins[n.n_in++])) return -1;
        skip_blank(ps);
        if (*ps->p == ')') break;
        if (*ps->p != ',') return fail_unexpected(ps, "expected ',' or ')'");
        ps->p++;
      }
    ps->p++;
    n.in = ps->ins;
    int arity = op_arity(n.op);
    if (arity < 0 && n.n_in < 1) return fail(ps, op_at, "'%s' takes at least 1 input", ir_op_name(n.op));
    if (arity >= 0 && n.n_in != arity)
      return fail(ps, op_at, "'%s' takes %d input%s, not %d", ir_op_name(n.op), arity, arity == 1 ? "" : "s", n.n_in);
  }
  if (read_cf_attrs(ps, &n, op_at) || read_attrs(ps, &n) || read_where(ps, &n.file, &n.line) || expect_eol(ps)) return -1;
  int rc = ir_append(g, &n) < 0 ? fail_oom(ps) : 0;
  alloc_free(ps->vals);
  ps->vals = NULL;
  for (int i = 0; !rc && i < ir_n_sub(n.op); i++) rc = parse_region(ps, id, i);
  return rc;
}

/* `write %T = %V` or `grad %T = %V|none [when D|%C [else none]]`, the keyword already read. */
static int parse_write(parser *ps, ir_write_kind kind) {
  ir_graph *g = ps->g;
  ir_write w = {.kind = kind, .value = -1};
  const char *at = (skip_blank(ps), ps->p);
  if (read_use(ps, &w.target)) return -1;
  int op = g->nodes[w.target].op;
  if (op != IR_INPUT && op != IR_PARAM) return fail(ps, at, "%%%d is not an input or a param", w.target);
  if (expect(ps, "=")) return -1;
  if (kind == IR_WRITE_DATA || !accept_word(ps, "none"))
    if (read_use(ps, &w.value)) return -1;
  if (kind == IR_WRITE_GRAD && w.value >= 0 && accept_word(ps, "when")) {
    if ((skip_blank(ps), *ps->p == '%')) {
      const char *c = ps->p;
      if (read_use(ps, &w.cond)) return -1;
      const ir_node *cn = &g->nodes[w.cond];
      bool one = cn->dtype == KILN_BOOL;
      for (int d = 0; d < cn->ndim; d++) one = one && sym_same(cn->shape[d], sym_const(1));
      if (!one) return fail(ps, c, "%%%d: a grad's condition must be a one-element bool", w.cond);
      w.has_cond = true;
    } else if (read_dim(ps, &w.when)) {
      return -1;
    } else {
      w.has_when = true;
    }
    if (accept_word(ps, "else")) {
      if (!accept_word(ps, "none")) return fail(ps, ps->p, "expected `none` after `else`");
      w.else_none = true;
    }
  }
  if (read_where(ps, &w.file, &w.line) || expect_eol(ps)) return -1;
  return ir_add_write(g, w) ? fail_oom(ps) : 0;
}

/* The lines after the header and the sym lines, in their order: the guards,
 * the nodes, the writes. */
static int parse_body(parser *ps, bool more) {
  enum { GUARDS, NODES, WRITES } phase = GUARDS;
  static const char *const phase_name[] = {"the guards line", "the node lines", "the write and grad lines"};
  for (; more; more = next_line(ps)) {
    const char *at = ps->p;
    if (*ps->p == '%') {
      if (phase > NODES) return fail(ps, at, "a node line after %s", phase_name[phase]);
      phase = NODES;
      if (parse_node(ps)) return -1;
    } else if (accept_word(ps, "guards")) {
      if (phase > GUARDS) return fail(ps, at, "a guards line after %s", phase_name[phase]);
      phase = NODES;
      if (parse_guards(ps)) return -1;
    } else if (accept_word(ps, "write")) {
      phase = WRITES;
      if (parse_write(ps, IR_WRITE_DATA)) return -1;
    } else if (accept_word(ps, "grad")) {
      phase = WRITES;
      if (parse_write(ps, IR_WRITE_GRAD)) return -1;
    } else if (accept_word(ps, "sym")) {
      return fail(ps, at, "a sym line must follow the header or another sym line");
    } else if (accept_word(ps, "graph")) {
      return fail(ps, at, "a second graph (one per text)");
    } else {
      return fail(ps, at, "expected a node line, 'write' or 'grad'");
    }
  }
  return 0;
}

static int parse_graph(parser *ps) {
  bool have = next_line(ps);
  /* `version N` first in a saved file; a text without it is of the format before versions */
  if (have && accept_word(ps, "version")) {
    const char *at = (skip_blank(ps), ps->p);
    int64_t v;
    if (read_int(ps, INT64_MIN, INT64_MAX, &v) || expect_eol(ps)) return -1;
    if (v > IR_TEXT_VERSION)
      return fail(ps, at, "graph format version %lld is newer than this kiln reads (1 .. %d): load it with the kiln that wrote it or a newer one",
                  (long long)v, IR_TEXT_VERSION);
    if (v < 1) return fail(ps, at, "graph format version %lld is not one (1 .. %d)", (long long)v, IR_TEXT_VERSION);
    have = next_line(ps);
  }
  if (!have || !accept_word(ps, "graph")) return fail(ps, ps->p, "expected 'graph'");
  char *header = ps->line;
  const char *after_graph = ps->p;
  long header_lno = ps->lno;
  bool more;
  while ((more = next_line(ps)) && accept_word(ps, "sym"))
    if (parse_sym(ps)) return -1;
  /* the header, now that its symbols are known; then back to where we were */
  char *line = ps->line;
  const char *p = ps->p;
  long lno = ps->lno;
  ps->line = header;
  ps->p = after_graph;
  ps->lno = header_lno;
  if (parse_header(ps)) return -1;
  ps->line = line;
  ps->lno = lno;
  ps->p = p;
  if (parse_body(ps, more)) return -1;
  return resolve_outputs(ps);
}

ir_graph *ir_parse(const char *text, char *err, size_t errn) {
  parser ps = {.err = err, .errn = err ? errn : 0, .lno = 1, .next_lno = 1};
  if (ps.errn) err[0] = '\0';
  if (!text) {
    fail_pos(&ps, 1, 1, "no text");
    return NULL;
  }
  size_t len = strlen(text);
  ps.text = alloc_malloc(len + 1);
  ps.g = ir_new("graph");
  if (!ps.text || !ps.g) {
    fail_oom(&ps);
  } else {
    memcpy(ps.text, text, len + 1);
    ps.next = ps.line = ps.text;
    ps.p = ps.text;
    ps.end = ps.text + len + 1;
    parse_graph(&ps);
  }
  alloc_free(ps.text);
  alloc_free(ps.ins);
  alloc_free(ps.outs);
  alloc_free(ps.vals);
  if (ps.failed) {
    ir_free(ps.g);
    return NULL;
  }
  return ps.g;
}
