/* Fuzzes the IR text form (docs/ir.md): any text either parses or gives
 * "line L, col C: why"; a text that parses prints to a fixed point (print,
 * parse, print: the same bytes); kiln_load_string agrees with the parser, and
 * a loaded graph, called with inputs that fit its header and with one that
 * does not, returns results or an error naming the op, never a crash, a hang
 * or a leak. A text that starts with ";llvm" loads on the LLVM backend, any
 * other on the interpreter (so most runs stay fast); an LLVM one is also
 * run on the interpreter, and the two must agree wherever the value is not
 * ill-conditioned (ill_conditioned below). */
#include <math.h>
#include <string.h>

#include "fuzz/fuzz.h"
#include "kiln.h"
#include "tracer/tracer.h"

enum {
  MAX_TEXT = 16384,       /* longer texts test nothing new, only slower */
  MAX_NODE_NUMEL = 1 << 16 /* calls whose nodes would be larger are skipped */
};

static bool verbose; /* KILN_FUZZ_VERBOSE=1: say what each input did */

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  verbose = getenv("KILN_FUZZ_VERBOSE") != NULL;
  kiln_set_num_threads(1);
  return 0;
}

static bool starts_with_line_col(const char *err) {
  int l = 0, c = 0, k = 0;
  return sscanf(err, "line %d, col %d: %n", &l, &c, &k) == 2 && k > 0 && l >= 1 && c >= 1;
}

/* print -> parse -> print is a fixed point. */
static void check_fixed_point(const ir_graph *g, const char *text) {
  char err[256] = "";
  char *t1 = ir_to_string(g);
  FUZZ_CHECK(t1 != NULL, "the printer failed on a parsed graph; input:\n%s", text);
  ir_graph *g2 = ir_parse(t1, err, sizeof err);
  FUZZ_CHECK(g2 != NULL, "the printed text does not parse: %s\n--- printed ---\n%s--- input ---\n%s", err, t1, text);
  char *t2 = ir_to_string(g2);
  FUZZ_CHECK(t2 && !strcmp(t1, t2), "not a fixed point\n--- printed ---\n%s--- printed again ---\n%s--- input ---\n%s", t1,
             t2 ? t2 : "(null)", text);
  alloc_free(t1);
  alloc_free(t2);
  ir_free(g2);
}

static uint64_t mix(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* The inputs of the loaded fn (the graph's inputs, then its params) with
 * symbols set to small values within their bounds; false when the graph
 * cannot be called at a small size. The tensors belong to the open scope. */
static bool make_inputs(const ir_graph *g, uint64_t *s, kiln_tensor **in) {
  int64_t vals[IR_MAX_SYMS];
  for (int k = 0; k < g->n_syms; k++)
    if (g->sym_lo[k] > 64 || g->sym_hi[k] < g->sym_lo[k]) return false;
  /* a few tries at values that pass the guards; the last try is called anyway */
  for (int tries = 0; tries < 16; tries++) {
    for (int k = 0; k < g->n_syms; k++) {
      int64_t v = g->sym_lo[k] + (int64_t)(mix(s) % 5);
      vals[k] = v > g->sym_hi[k] ? g->sym_hi[k] : v;
    }
    bool ok = true;
    for (int i = 0; i < g->n_guards && ok; i++) ok = sym_guard_check(&g->guards[i], vals, g->n_syms) == 1;
    if (ok) break;
  }
  /* the run allocates every node: keep them small */
  for (int i = 0; i < g->n_nodes; i++) {
    int64_t shape[MAXD], n = 1;
    if (ir_node_shape(&g->nodes[i], vals, g->n_syms, shape)) return false;
    for (int d = 0; d < g->nodes[i].ndim; d++) {
      if (shape[d] > MAX_NODE_NUMEL) return false;
      n *= shape[d];
      if (n > MAX_NODE_NUMEL) return false;
    }
  }
  for (int i = 0; i < g->n_nodes; i++) {
    const ir_node *n = &g->nodes[i];
    if (n->op != IR_INPUT && n->op != IR_PARAM) continue;
    int64_t shape[MAXD];
    ir_node_shape(n, vals, g->n_syms, shape);
    int at = n->op == IR_INPUT ? n->index : g->n_inputs + n->index;
    uint64_t seed = mix(s);
    kiln_tensor *t;
    switch (n->dtype) {
    case KILN_F32:
    case KILN_F64: t = kiln_randn(n->dtype, n->ndim, shape, seed); break;
    case KILN_I64: /* mostly valid indices for small dims, sometimes not */
      t = kiln_cast(kiln_mul(kiln_rand(KILN_F64, n->ndim, shape, seed), kiln_scalar(KILN_F64, 4)), KILN_I64);
      break;
    default: t = kiln_gt(kiln_randn(KILN_F32, n->ndim, shape, seed), kiln_scalar(KILN_F32, 0)); break;
    }
    FUZZ_CHECK(t != NULL, "cannot make input %d: %s", at, kiln_last_error());
    in[at] = t;
  }
  /* a .grad the graph reads: set as backward would (owned by the tensor) */
  for (int i = 0; i < g->n_nodes; i++) {
    const ir_node *n = &g->nodes[i], *p = n->op == IR_GRAD ? &g->nodes[n->in[0]] : NULL;
    if (!p || (p->op != IR_INPUT && p->op != IR_PARAM)) continue;
    kiln_tensor *owner = in[p->op == IR_INPUT ? p->index : g->n_inputs + p->index];
    if (owner->grad || !kiln_is_contiguous(owner) || (owner->dtype != KILN_F32 && owner->dtype != KILN_F64)) continue;
    int64_t shape[KILN_MAX_DIMS];
    for (int d = 0; d < owner->ndim; d++) shape[d] = owner->shape[d];
    owner->grad = kiln_keep(kiln_randn(owner->dtype, owner->ndim, shape, mix(s)));
  }
  return true;
}

/* One call: results, or -1 with a message from kiln. */
static void call_once(kiln_fn *fn, const ir_graph *g, kiln_tensor **in, const char *text) {
  kiln_tensor **out = calloc((size_t)g->n_outputs + 1, sizeof *out);
  kiln_clear_error();
  int rc = kiln_call(fn, in, out);
  const char *e = kiln_last_error();
  if (verbose) fprintf(stderr, "call: %d %s\n", rc, e);
  FUZZ_CHECK(rc == 0 || rc == -1, "kiln_call returned %d", rc);
  if (rc) {
    FUZZ_CHECK(e[0] && strstr(e, "kiln_"), "a failed call set no message naming the op: '%s'\n--- input ---\n%s", e, text);
  } else {
    /* the outputs belong to the caller's scope */
    for (int i = 0; i < g->n_outputs; i++)
      FUZZ_CHECK(out[i] != NULL, "output %d is NULL after a successful call\n--- input ---\n%s", i, text);
  }
  free(out);
}

/* Equal within rounding: f32 results may differ by the order of a sum. */
static bool close_enough(double p, double q, kiln_dtype dt) {
  double tol = dt == KILN_F32 ? 1e-3 : dt == KILN_F64 ? 1e-9 : 0;
  if (p == q || (isnan(p) && isnan(q))) return true;
  if (!isfinite(p) || !isfinite(q)) { /* overflow at the edge, inf - inf */
    double fin = isfinite(p) ? p : q;
    return !isfinite(fin) || fabs(fin) > 1e30;
  }
  return fabs(p - q) <= tol * (1 + fabs(q));
}

/* x's elements as f64, malloc'ed. */
static double *values(kiln_tensor *x) {
  int64_t n = kiln_numel(x);
  double *p = malloc(sizeof(double) * (size_t)(n + 1));
  FUZZ_CHECK(!kiln_read(kiln_cast(x, KILN_F64), p, sizeof(double) * (size_t)n), "%s", kiln_last_error());
  return p;
}

/* x's (LLVM's) and y's (the interpreter's) shapes and dtypes agree, or abort. */
static void same_layout(kiln_tensor *x, kiln_tensor *y, const char *what, int i, const char *text) {
  char dx[128], dy[128];
  kiln_describe(x, dx, sizeof dx), kiln_describe(y, dy, sizeof dy);
  bool same = kiln_type(x) == kiln_type(y) && kiln_ndim(x) == kiln_ndim(y);
  for (int d = 0; same && d < kiln_ndim(x); d++) same = kiln_size(x, d) == kiln_size(y, d);
  FUZZ_CHECK(same, "%s %d: LLVM gives %s, the interpreter %s\n--- input ---\n%s", what, i, dx, dy, text);
}

/* The first element where p and q differ beyond rounding and that moved
 * does not mark (NULL: none), or -1. */
static int64_t first_mismatch(const double *p, const double *q, int64_t n, kiln_dtype dt, const bool *moved) {
  for (int64_t k = 0; k < n; k++)
    if (!close_enough(p[k], q[k], dt) && !(moved && moved[k])) return k;
  return -1;
}

/* Whether v, the value at inputs moved by a part in 2^20, is more than
 * 1000 times that further from ref in relative terms (or only one is
 * NaN, or an integer changed). */
static bool sensitive(double v, double ref) {
  if (v == ref || (isnan(v) && isnan(ref))) return false;
  return !(fabs(v - ref) <= 1e-3 * fabs(ref));
}

/* The elements of output i (of input i after the writes, when is_input)
 * that are ill-conditioned: where either backend's own value (p for fn,
 * q for ref_fn) is sensitive (above) to each float input moved by a
 * random part in 2^20. Such a value (the sqrt or rsqrt of a sum that
 * cancels to rounding noise) is decided by the order of a sum, which
 * compiled code may change. The test is relative, not the comparison's
 * tolerance, which near 0 is absolute and would let noise there pass as
 * unmoved; and both sides, since a short sequential sum (the
 * interpreter's) can cancel to exactly 0 for most draws. Eight draws; then
 * eight more by a part in 2^10, which mark only a value that turns NaN or
 * stops being one (0/0 of a sum that cancels exactly on one side, against
 * noise over itself, 1, on the other). Calloc'ed. */
static bool *ill_conditioned(kiln_fn *fn, kiln_fn *ref_fn, const ir_graph *g, uint64_t seed, bool is_input, int i,
                             const double *p, const double *q, int64_t n) {
  int n_in = g->n_inputs + g->n_params;
  kiln_tensor **c = calloc((size_t)n_in + 1, sizeof *c), **yc = calloc((size_t)g->n_outputs + 1, sizeof *yc);
  bool *moved = calloc((size_t)n + 1, sizeof *moved);
  for (int t = 0; t < 32; t++) {
    kiln_fn *f = t % 2 ? fn : ref_fn;
    const double *ref = t % 2 ? p : q;
    uint64_t s = seed;
    kiln_scope_begin();
    if (make_inputs(g, &s, c)) {
      for (int j = 0; j < n_in; j++) {
        kiln_dtype dt = kiln_type(c[j]);
        if (dt != KILN_F32 && dt != KILN_F64) continue;
        int64_t shape[KILN_MAX_DIMS];
        for (int d = 0; d < kiln_ndim(c[j]); d++) shape[d] = kiln_size(c[j], d);
        kiln_tensor *r = kiln_rand(dt, kiln_ndim(c[j]), shape, seed + 977 * (uint64_t)(t / 2 * n_in + j) + 1);
        double part = t < 16 ? 0x1p-19 : 0x1p-9;
        kiln_mul_(c[j], kiln_add(kiln_scalar(dt, 1), kiln_mul(kiln_sub(r, kiln_scalar(dt, 0.5)), kiln_scalar(dt, part))));
      }
      if (kiln_call(f, c, yc) == 0) {
        kiln_tensor *z = is_input ? c[i] : yc[i];
        double *v = values(z);
        for (int64_t k = 0; k < n; k++) moved[k] |= t < 16 ? sensitive(v[k], ref[k]) : isnan(v[k]) != isnan(ref[k]);
        free(v);
      }
    }
    kiln_scope_end();
  }
  free(c), free(yc);
  return moved;
}

/* A ;llvm text: the compiled graph against the interpreter on equal inputs
 * (made twice from one seed, since writes change them). The same outcome, the
 * same outputs, the same inputs after the writes, except at ill-conditioned
 * elements (above). */
static void differential(const char *text, const ir_graph *g, kiln_fn *fn, uint64_t seed) {
  setenv("KILN_BACKEND", "interp", 1);
  kiln_fn *ref_fn = kiln_load_string(text);
  FUZZ_CHECK(ref_fn != NULL, "loads on LLVM, not on the interpreter: %s\n--- input ---\n%s", kiln_last_error(), text);
  int n_in = g->n_inputs + g->n_params;
  kiln_tensor **a = calloc((size_t)n_in + 1, sizeof *a), **b = calloc((size_t)n_in + 1, sizeof *b);
  kiln_tensor **ya = calloc((size_t)g->n_outputs + 1, sizeof *ya), **yb = calloc((size_t)g->n_outputs + 1, sizeof *yb);
  uint64_t s1 = seed, s2 = seed;
  kiln_scope_begin();
  if (make_inputs(g, &s1, a) && make_inputs(g, &s2, b)) {
    char ea[512];
    kiln_clear_error();
    int ra = kiln_call(fn, a, ya);
    snprintf(ea, sizeof ea, "%s", kiln_last_error());
    kiln_clear_error();
    int rb = kiln_call(ref_fn, b, yb);
    FUZZ_CHECK(ra == rb, "LLVM returns %d (%s), the interpreter %d (%s)\n--- input ---\n%s", ra, ea, rb,
               kiln_last_error(), text);
    for (int i = 0; ra == 0 && i < g->n_outputs + n_in; i++) {
      bool is_input = i >= g->n_outputs;
      int at = is_input ? i - g->n_outputs : i;
      const char *what = is_input ? "input after the writes" : "output";
      kiln_tensor *x = is_input ? a[at] : ya[at], *y = is_input ? b[at] : yb[at];
      same_layout(x, y, what, at, text);
      int64_t n = kiln_numel(x);
      double *p = values(x), *q = values(y);
      int64_t k = first_mismatch(p, q, n, kiln_type(x), NULL);
      if (k >= 0) {
        bool *moved = ill_conditioned(fn, ref_fn, g, seed, is_input, at, p, q, n);
        k = first_mismatch(p, q, n, kiln_type(x), moved);
        free(moved);
      }
      char dx[128];
      FUZZ_CHECK(k < 0, "%s %d (%s), element %lld: LLVM %.17g, the interpreter %.17g\n--- input ---\n%s", what, at,
                 kiln_describe(x, dx, sizeof dx), (long long)k, p[k], q[k], text);
      free(p), free(q);
    }
  }
  kiln_scope_end();
  free(a), free(b), free(ya), free(yb);
  kiln_fn_free(ref_fn);
}

static void load_and_call(const char *text, const ir_graph *g, const char *parse_err) {
  setenv("KILN_BACKEND", strncmp(text, ";llvm", 5) ? "interp" : "llvm", 1);
  kiln_clear_error();
  kiln_fn *fn = kiln_load_string(text);
  const char *e = kiln_last_error();
  if (verbose) fprintf(stderr, "load: %s\n", fn ? "ok" : e);
  if (!fn) {
    /* "<this file>:<line>: kiln_load: ...", the line of the call above */
    const char *m = strstr(e, "kiln_load: "), *at = strstr(e, "fuzz_irtext.c:");
    FUZZ_CHECK(m && at && at < m, "a failed load says '%s'\n--- input ---\n%s", e, text);
    /* the loader reports the parser's own message */
    if (!g) FUZZ_CHECK(!strcmp(m + 11, parse_err), "load says '%s', the parser '%s'", e, parse_err);
    return;
  }
  FUZZ_CHECK(g != NULL, "kiln_load_string loaded a text the parser refuses (%s)\n--- input ---\n%s", parse_err, text);
  int n_in = g->n_inputs + g->n_params;
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (const char *p = text; *p; p++) s = (s ^ (uint8_t)*p) * 0x100000001b3ull;
  s |= 1;
  if (!strncmp(text, ";llvm", 5)) differential(text, g, fn, s);
  kiln_tensor **in = calloc((size_t)n_in + 1, sizeof *in);
  kiln_scope_begin();
  if (make_inputs(g, &s, in)) {
    call_once(fn, g, in, text);
    call_once(fn, g, in, text); /* a second call reuses the variant's buffers */
    /* one input that does not fit: one dim longer, or another dtype */
    if (n_in > 0) {
      int k = (int)(mix(&s) % (uint64_t)n_in);
      kiln_tensor *keep = in[k];
      if (kiln_ndim(keep) > 0 && mix(&s) % 2) {
        int64_t shape[KILN_MAX_DIMS];
        for (int d = 0; d < kiln_ndim(keep); d++) shape[d] = kiln_size(keep, d);
        shape[0] += 1;
        in[k] = kiln_zeros(kiln_type(keep), kiln_ndim(keep), shape);
      } else {
        in[k] = kiln_cast(keep, kiln_type(keep) == KILN_F32 ? KILN_F64 : KILN_F32);
      }
      call_once(fn, g, in, text);
    }
  }
  kiln_scope_end();
  free(in);
  kiln_fn_free(fn);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > MAX_TEXT) return -1;
  char *text = malloc(size + 1);
  memcpy(text, data, size);
  text[size] = '\0';
  char err[256] = "";
  ir_graph *g = ir_parse(text, err, sizeof err);
  if (!g) {
    FUZZ_CHECK(starts_with_line_col(err) || !strcmp(err, "out of memory"), "parse error without a place: '%s'", err);
  } else {
    check_fixed_point(g, text);
  }
  load_and_call(text, g, err);
  ir_free(g);
  free(text);
  return 0;
}
