/* The compile front: kiln_compile, kiln_call and the variant cache. A call
 * checks the guards of each cached variant (a flat list compiled once, no
 * allocation); a hit runs the variant's backend; a miss traces the body
 * (which runs it eagerly, so the call still returns real results), cleans
 * the graph with the passes, compiles it and caches it. The dynamic policy
 * decides which dims of the next trace are symbolic. Past the cap, or once
 * the body has read tensor data, misses run the body eagerly. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tracer/tracer.h"

#define FN_MAGIC 0x6b696c6eu
#define FN_FREED 0x66726565u /* freed: its header is parked, never reused for 16 more frees */
#define MAX_IN 64

/* One input dim, as a guard: a constant, or a symbol to bind. */
typedef struct dim_check {
  int64_t c;  /* when sym < 0 */
  int sym;    /* symbol id, or -1; -2: an expression, checked after binding */
} dim_check;

typedef struct variant {
  ir_graph *g;
  backend_exec *exec;
  const backend *be;
  int n_params;
  kiln_tensor **params;
  trace_leaf *in_leaf, *param_leaf;
  dim_check (*in_dims)[MAXD]; /* [n_in][MAXD] */
  int *alias;                 /* [n_in + n_params]: the first leaf sharing storage with this one */
  bool loaded;                /* from kiln_load: no autograd-state guards */
  int users;                  /* calls running it now (fn->mu) */
  bool dead;                  /* dropped from the cache: freed when the last user is done */
} variant;

struct kiln_fn {
  atomic_uint magic; /* first: all a freed kiln_fn still has that may be read */
  kiln_body body;
  void *ctx;
  kiln_options opts;
  char name[64];
  const char *file;
  int line;
  unsigned dump;
  char dump_dir[512];
  const backend *be;
  pthread_mutex_t mu;
  variant **variants;
  int n_variants, cap;
  uint8_t dyn[MAX_IN][MAXD];  /* dims that are symbolic in the next trace */
  int64_t last_shape[MAX_IN][MAXD]; /* shapes of the last trace, for the automatic policy */
  int last_ndim[MAX_IN];
  bool have_last;
  bool loaded;                /* from kiln_load: one graph, no body */
  bool eager_only;            /* the body reads tensor data: never trace again */
  bool warned_cap;
  char eager_why[600];
  kiln_fn_stats st;
  double guard_ns_total;
  int64_t guard_samples;
  int dump_seq;
};

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* ---- dumps ---- */

static unsigned parse_dump(const char *s) {
  static const struct {
    const char *name;
    unsigned bit;
  } names[] = {{"trace", KILN_DUMP_TRACE}, {"graph", KILN_DUMP_GRAPH}, {"guards", KILN_DUMP_GUARDS},
               {"recompiles", KILN_DUMP_RECOMPILES}, {"kernels", KILN_DUMP_KERNELS}, {"llvm", KILN_DUMP_LLVM},
               {"asm", KILN_DUMP_ASM}, {"all", KILN_DUMP_ALL}};
  unsigned bits = 0;
  while (s && *s) {
    size_t n = strcspn(s, ", ");
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
      if (strlen(names[i].name) == n && !strncmp(s, names[i].name, n)) bits |= names[i].bit;
    s += n;
    s += strspn(s, ", ");
  }
  return bits;
}

/* Where a dump of this kind goes: a file under KILN_DUMP_DIR, else stderr. */
static FILE *dump_open(kiln_fn *fn, const char *kind, int variant_no) {
  if (!fn->dump_dir[0]) {
    fprintf(stderr, "=== kiln %s: %s (variant %d) ===\n", kind, fn->name, variant_no);
    return stderr;
  }
  char path[768];
  snprintf(path, sizeof path, "%s/%s.%d.%s.txt", fn->dump_dir, fn->name, variant_no, kind);
  FILE *f = fopen(path, "a");
  return f ? f : stderr;
}

static void dump_close(FILE *f) {
  if (f != stderr) fclose(f);
  else fflush(f);
}

static void dump_note(kiln_fn *fn, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void dump_note(kiln_fn *fn, const char *fmt, ...) {
  if (!(fn->dump & KILN_DUMP_RECOMPILES)) return;
  FILE *f = stderr;
  if (fn->dump_dir[0]) {
    char path[768];
    snprintf(path, sizeof path, "%s/%s.recompiles.txt", fn->dump_dir, fn->name);
    f = fopen(path, "a");
    if (!f) f = stderr;
  }
  va_list ap;
  va_start(ap, fmt);
  fprintf(f, "kiln recompile: %s: ", fn->name);
  vfprintf(f, fmt, ap);
  fprintf(f, "\n");
  va_end(ap);
  dump_close(f);
}

static void print_guards(FILE *f, const kiln_fn *fn, const variant *v) {
  const ir_graph *g = v->g;
  fprintf(f, "guards of %s:\n", fn->name);
  for (int i = 0; i < g->n_nodes; i++) {
    const ir_node *n = &g->nodes[i];
    if (n->op != IR_INPUT && n->op != IR_PARAM) continue;
    fprintf(f, "  %s %d: %s[", n->op == IR_INPUT ? "input" : "param", n->index, kiln_dtype_name(n->dtype));
    for (int d = 0; d < n->ndim; d++) {
      char b[128];
      if (sym_print(n->shape[d], b, sizeof b) < 0) snprintf(b, sizeof b, "?");
      fprintf(f, "%s%s", d ? "," : "", b);
    }
    fprintf(f, "]");
    if (n->op == IR_PARAM) fprintf(f, " (captured by reference at %s:%d; held elsewhere)", *n->file ? n->file : "?", n->line);
    const trace_leaf *l = n->op == IR_INPUT ? (v->in_leaf ? &v->in_leaf[n->index] : NULL) : (v->param_leaf ? &v->param_leaf[n->index] : NULL);
    if (l && !v->loaded && l->requires_grad) fprintf(f, " requires_grad, .grad %s", l->grad_present ? "set" : "NULL");
    fprintf(f, "\n");
  }
  for (int k = 0; k < g->n_syms; k++)
    fprintf(f, "  s%d in [%lld, %lld]\n", k, (long long)g->sym_lo[k], (long long)g->sym_hi[k]);
  for (int i = 0; i < g->n_guards; i++) {
    char b[256];
    if (sym_guard_print(&g->guards[i], b, sizeof b) >= 0) fprintf(f, "  %s\n", b);
  }
  int n_leaves = fn->opts.n_in + v->n_params;
  for (int i = 0; i < n_leaves; i++)
    if (v->alias[i] != i) fprintf(f, "  leaf %d shares storage with leaf %d\n", i, v->alias[i]);
  fprintf(f, "  every other pair of inputs and params in distinct storage\n");
}

/* ---- guards ---- */

static kiln_tensor *leaf_at(const kiln_fn *fn, const variant *v, kiln_tensor *const *in, int i) {
  return i < fn->opts.n_in ? in[i] : v->params[i - fn->opts.n_in];
}

/* 1 when the call may run v, with the symbol values in vals; else 0 and
 * (when why) the first guard that failed. */
static int guards_pass(const kiln_fn *fn, const variant *v, kiln_tensor *const *in, int64_t *vals, char *why, size_t whyn) {
  const ir_graph *g = v->g;
  bool bound[IR_MAX_SYMS] = {0};
  int n_in = fn->opts.n_in;
  for (int i = 0; i < g->n_inputs; i++) {
    const ir_node *n = &g->nodes[i]; /* inputs come first, in order */
    const kiln_tensor *t = in[n->index];
    if (t->dtype != n->dtype) {
      if (why) snprintf(why, whyn, "input %d: traced %s, got %s", n->index, kiln_dtype_name(n->dtype), kiln_dtype_name(t->dtype));
      return 0;
    }
    if (t->ndim != n->ndim) {
      if (why) snprintf(why, whyn, "input %d: traced rank %d, got %d", n->index, n->ndim, t->ndim);
      return 0;
    }
    for (int d = 0; d < n->ndim; d++) {
      const dim_check *c = &v->in_dims[n->index][d];
      int64_t got = t->shape[d];
      if (c->sym == -1) {
        if (got != c->c) {
          if (why) snprintf(why, whyn, "input %d dim %d: traced %lld, got %lld", n->index, d, (long long)c->c, (long long)got);
          return 0;
        }
      } else if (c->sym >= 0) {
        int k = c->sym;
        if (!bound[k]) {
          if (got < g->sym_lo[k] || got > g->sym_hi[k]) {
            if (why) snprintf(why, whyn, "input %d dim %d: %lld is outside s%d's range [%lld, %lld]", n->index, d, (long long)got, k,
                              (long long)g->sym_lo[k], (long long)g->sym_hi[k]);
            return 0;
          }
          vals[k] = got;
          bound[k] = true;
        } else if (vals[k] != got) {
          if (why) snprintf(why, whyn, "input %d dim %d: %lld, but s%d is %lld", n->index, d, (long long)got, k, (long long)vals[k]);
          return 0;
        }
      }
    }
  }
  for (int i = 0; i < g->n_guards; i++)
    if (sym_guard_check(&g->guards[i], vals, g->n_syms) != 1) {
      if (why) {
        char b[256];
        if (sym_guard_print(&g->guards[i], b, sizeof b) < 0) snprintf(b, sizeof b, "?");
        snprintf(why, whyn, "guard %s fails", b);
      }
      return 0;
    }
  if (!v->loaded) {
    for (int i = 0; i < n_in + v->n_params; i++) {
      kiln_tensor *t = leaf_at(fn, v, in, i);
      const trace_leaf *l = i < n_in ? &v->in_leaf[i] : &v->param_leaf[i - n_in];
      const char *kind = i < n_in ? "input" : "param";
      int idx = i < n_in ? i : i - n_in;
      if (t->requires_grad != l->requires_grad) {
        if (why) snprintf(why, whyn, "%s %d: requires_grad changed", kind, idx);
        return 0;
      }
      if (l->requires_grad && (t->grad != NULL) != l->grad_present) {
        if (why) snprintf(why, whyn, "%s %d: .grad was %s when traced, now %s", kind, idx, l->grad_present ? "set" : "NULL",
                          t->grad ? "set" : "NULL");
        return 0;
      }
    }
    /* a param its owner released is not checked here: kiln_call drops that variant first */
  }
  /* aliasing: the same sharing of storage as when traced */
  int n_leaves = n_in + v->n_params;
  for (int i = 0; i < n_leaves; i++) {
    kiln_tensor *a = leaf_at(fn, v, in, i);
    for (int j = i + 1; j < n_leaves; j++) {
      kiln_tensor *b = leaf_at(fn, v, in, j);
      bool share = a->st == b->st, traced = v->alias[j] == v->alias[i];
      if (share != traced) {
        if (why) snprintf(why, whyn, "leaves %d and %d %s storage, unlike when traced", i, j, share ? "share" : "do not share");
        return 0;
      }
    }
  }
  return 1;
}

/* ---- variants ---- */

static void variant_free(variant *v) {
  if (!v) return;
  if (v->exec) v->be->free(v->exec);
  for (int i = 0; v->params && i < v->n_params; i++) kiln_release(v->params[i]);
  alloc_free(v->params);
  alloc_free(v->in_leaf);
  alloc_free(v->param_leaf);
  alloc_free(v->in_dims);
  alloc_free(v->alias);
  ir_free(v->g);
  alloc_free(v);
}

/* The guard of each input dim: its constant, its symbol, or an expression (-2). */
static void fill_in_dims(variant *v) {
  for (int i = 0; i < v->g->n_inputs; i++) {
    const ir_node *n = &v->g->nodes[i];
    for (int d = 0; d < n->ndim; d++) {
      int k = ir_sym_id(v->g, n->shape[d]);
      v->in_dims[n->index][d] = sym_is_const(n->shape[d]) ? (dim_check){n->shape[d].c, -1} : (dim_check){0, k >= 0 ? k : -2};
    }
  }
}

/* The flat guard list of v, from its graph and the tensors of the trace. */
static int variant_prepare(const kiln_fn *fn, variant *v, kiln_tensor *const *in) {
  int n_in = fn->opts.n_in;
  v->in_dims = alloc_calloc((size_t)n_in + 1, sizeof *v->in_dims);
  v->alias = alloc_calloc((size_t)(n_in + v->n_params) + 1, sizeof *v->alias);
  if (!v->in_dims || !v->alias) return -1;
  fill_in_dims(v);
  for (int i = 0; i < n_in + v->n_params; i++) {
    v->alias[i] = i;
    kiln_tensor *a = leaf_at(fn, v, in, i);
    for (int j = 0; j < i; j++)
      if (leaf_at(fn, v, in, j)->st == a->st) {
        v->alias[i] = v->alias[j];
        break;
      }
  }
  return 0;
}

/* ---- compile ---- */

/* kiln_fn headers are never freed (see alloc_handle), so that a freed one can
 * be told from a live one in every build. */
static handle_pool fn_pool = HANDLE_POOL(kiln_fn, sizeof(atomic_uint), 16);

kiln_fn *kiln_compile_at(kiln_body body, void *ctx, const kiln_options *opts, const char *file, int line) {
  if (!body) return err_set(file, line, "compile", "body is NULL");
  /* zero means the default, for the whole struct as for each field: n_out 0 is 1 */
  kiln_options o = opts ? *opts : (kiln_options){0};
  if (o.n_out == 0) o.n_out = 1;
  if (o.n_in < 0 || o.n_in > MAX_IN) return err_set(file, line, "compile", "n_in %d is outside 0..%d", o.n_in, MAX_IN);
  if (o.n_out < 1 || o.n_out > MAX_IN) return err_set(file, line, "compile", "n_out %d is outside 1..%d (0: 1)", o.n_out, MAX_IN);
  if (o.dynamic < KILN_DYNAMIC_AUTO || o.dynamic > KILN_DYNAMIC_ALL) return err_set(file, line, "compile", "unknown dynamic policy %d", o.dynamic);
  if (o.max_variants < 0) return err_set(file, line, "compile", "max_variants %d is negative", o.max_variants);
  kiln_fn *fn = alloc_handle(&fn_pool);
  if (!fn) return err_set(file, line, "compile", "out of memory");
  atomic_store(&fn->magic, FN_MAGIC);
  fn->body = body;
  fn->ctx = ctx;
  fn->opts = o;
  if (!fn->opts.max_variants) fn->opts.max_variants = 8;
  snprintf(fn->name, sizeof fn->name, "%s", o.name && *o.name ? o.name : "fn");
  fn->opts.name = fn->name;
  fn->file = file;
  fn->line = line;
  fn->dump = o.dump | parse_dump(getenv("KILN_DUMP"));
  const char *dir = getenv("KILN_DUMP_DIR");
  if (dir) snprintf(fn->dump_dir, sizeof fn->dump_dir, "%s", dir);
  const char *chk = getenv("KILN_CHECK");
  if (chk && *chk && strcmp(chk, "0")) fn->opts.check = 1;
  int be = o.backend;
  const char *bn = getenv("KILN_BACKEND");
  if (be == KILN_BACKEND_DEFAULT && bn && !strcmp(bn, "interp")) be = KILN_BACKEND_INTERP;
  fn->be = be == KILN_BACKEND_INTERP ? &backend_interp : &backend_llvm;
  if (o.dynamic == KILN_DYNAMIC_ALL) memset(fn->dyn, 1, sizeof fn->dyn);
  pthread_mutex_init(&fn->mu, NULL);
  return fn;
}

static bool fn_ok(const kiln_fn *fn) { return fn && atomic_load(&fn->magic) == FN_MAGIC; }

/* Why fn cannot be used. A freed fn's header is parked, not freed, so its
 * magic can be read. */
static const char *fn_dead(const kiln_fn *fn) {
  if (!fn) return "fn is NULL";
  if (atomic_load(&fn->magic) == FN_FREED) return "fn was freed (kiln_fn_free)";
  return "fn is not a live compiled function";
}

void kiln_fn_free_at(kiln_fn *fn, const char *file, int line) {
  if (!fn_ok(fn)) {
    if (fn) {
      err_set(file, line, "fn_free", "%s", fn_dead(fn));
      fprintf(stderr, "kiln: error: %s\n", kiln_last_error()); /* nothing to return it to */
    }
    return;
  }
  for (int i = 0; i < fn->n_variants; i++) variant_free(fn->variants[i]);
  alloc_free(fn->variants);
  pthread_mutex_destroy(&fn->mu);
  atomic_store(&fn->magic, FN_FREED);
  alloc_handle_park(&fn_pool, fn);
}

int kiln_mark_dynamic_at(kiln_fn *fn, int input, int dim, const char *file, int line) {
  if (!fn_ok(fn)) return err_set(file, line, "mark_dynamic", "%s", fn_dead(fn)), -1;
  if (fn->loaded) return err_set(file, line, "mark_dynamic", "%s was loaded from a file: its shapes are fixed", fn->name), -1;
  if (input < 0 || input >= fn->opts.n_in || dim < 0 || dim >= MAXD)
    return err_set(file, line, "mark_dynamic", "input %d dim %d is out of range (%d inputs)", input, dim, fn->opts.n_in), -1;
  pthread_mutex_lock(&fn->mu);
  fn->dyn[input][dim] = 1;
  pthread_mutex_unlock(&fn->mu);
  return 0;
}

/* ---- calling ---- */

/* Hands out[0..n_out) to the caller's scope. When the scope cannot take one
 * (out of memory) it is released, so none is handed out: -1, error set. */
static int adopt_outputs(kiln_fn *fn, kiln_tensor **out, const char *file, int line) {
  int rc = 0;
  for (int i = 0; i < fn->opts.n_out; i++)
    if (out[i] && !(out[i] = scope_adopt(out[i]))) rc = -1;
  if (rc == 0) return 0;
  for (int i = 0; i < fn->opts.n_out; i++) out[i] = NULL; /* the adopted ones go with the scope */
  return err_set(file, line, "call", "%s: out of memory", fn->name), -1;
}

/* Runs the body eagerly in a scope of its own; out[i] become one new
 * reference each, adopted by the caller's scope. file:line is the call's. */
static int run_eager(kiln_fn *fn, kiln_tensor *const *in, kiln_tensor **out, const char *file, int line) {
  kiln_scope_begin();
  for (int i = 0; i < fn->opts.n_out; i++) out[i] = NULL;
  unsigned long errors = err_count();
  int rc = fn->body(fn->ctx, in, out);
  for (int i = 0; i < fn->opts.n_out; i++) kiln_retain(out[i]);
  kiln_scope_end();
  if (rc == 0)
    for (int i = 0; i < fn->opts.n_out; i++)
      if (!out[i]) {
        rc = -1;
        err_set(file, line, "call", "%s: the body returned 0 but left output %d NULL", fn->name, i);
      }
  if (rc) {
    for (int i = 0; i < fn->opts.n_out; i++) kiln_release(out[i]), out[i] = NULL;
    /* a body that failed without an error of its own: say so, not an older message */
    if (rc && err_count() == errors) err_set(file, line, "call", "%s: the body returned %d", fn->name, rc);
    return -1;
  }
  return adopt_outputs(fn, out, file, line);
}

static int run_variant(kiln_fn *fn, variant *v, kiln_tensor *const *in, kiln_tensor **out, const char *file, int line) {
  if (v->be->run(v->exec, in, v->params, out)) return -1;
  return adopt_outputs(fn, out, file, line);
}

/* The dims of the next trace that are symbolic: marks, and under the
 * automatic policy every dim that differs from the last trace. */
static void next_spec(kiln_fn *fn, kiln_tensor *const *in, uint8_t (*dyn)[MAXD]) {
  pthread_mutex_lock(&fn->mu);
  if (fn->opts.dynamic == KILN_DYNAMIC_AUTO && fn->have_last)
    for (int i = 0; i < fn->opts.n_in; i++) {
      if (in[i]->ndim != fn->last_ndim[i]) continue;
      for (int d = 0; d < in[i]->ndim; d++)
        if (in[i]->shape[d] != fn->last_shape[i][d]) fn->dyn[i][d] = 1;
    }
  for (int i = 0; i < fn->opts.n_in; i++) {
    fn->last_ndim[i] = in[i]->ndim;
    memcpy(fn->last_shape[i], in[i]->shape, sizeof fn->last_shape[i]);
  }
  fn->have_last = true;
  memcpy(dyn, fn->dyn, sizeof fn->dyn);
  pthread_mutex_unlock(&fn->mu);
}

static void dump_graph(kiln_fn *fn, const ir_graph *g, const char *kind, int no) {
  FILE *f = dump_open(fn, kind, no);
  ir_print(g, f);
  dump_close(f);
}

/* Traces the body (returning its eager results in out) and caches a variant. */
static int trace_and_cache(kiln_fn *fn, kiln_tensor *const *in, kiln_tensor **out, const char *file, int line) {
  uint8_t dyn[MAX_IN][MAXD];
  next_spec(fn, in, dyn);
  trace_spec spec = {fn->opts.n_in, dyn, fn->opts.freeze != 0};
  trace_result res;
  double t0 = now_ms();
  kiln_scope_begin();
  for (int i = 0; i < fn->opts.n_out; i++) out[i] = NULL;
  unsigned long errors = err_count();
  int rc = trace_run(fn->body, fn->ctx, in, fn->opts.n_in, out, fn->opts.n_out, &spec, fn->name, &res);
  for (int i = 0; i < fn->opts.n_out; i++) kiln_retain(out[i]);
  kiln_scope_end();
  double t1 = now_ms();
  pthread_mutex_lock(&fn->mu);
  fn->st.traces++;
  fn->st.trace_ms += t1 - t0;
  int no = ++fn->dump_seq;
  pthread_mutex_unlock(&fn->mu);
  int null_out = -1;
  for (int i = fn->opts.n_out - 1; i >= 0; i--)
    if (!out[i]) null_out = i;
  if (rc || null_out >= 0) {
    trace_result_free(&res);
    for (int i = 0; i < fn->opts.n_out; i++) kiln_release(out[i]), out[i] = NULL;
    if (rc == 0) err_set(file, line, "call", "%s: the body returned 0 but left output %d NULL", fn->name, null_out);
    else if (err_count() == errors) err_set(file, line, "call", "%s: the body returned %d", fn->name, rc);
    return -1;
  }
  if (adopt_outputs(fn, out, file, line)) {
    trace_result_free(&res);
    return -1;
  }

  if (!res.g) {
    pthread_mutex_lock(&fn->mu);
    /* reading values, or a pattern the tracer does not take: tracing again would fail the same way */
    fn->eager_only = true;
    bool first = !fn->eager_why[0];
    snprintf(fn->eager_why, sizeof fn->eager_why, "%s", res.why);
    pthread_mutex_unlock(&fn->mu);
    if (first) fprintf(stderr, "kiln: warning: %s (compiled at %s:%d): %s\n", fn->name, fn->file, fn->line, res.why);
    dump_note(fn, "no graph: %s", res.why);
    trace_result_free(&res);
    return 0;
  }
  if (fn->dump & KILN_DUMP_TRACE) dump_graph(fn, res.g, "trace", no);
  char err[512] = "";
  variant *v = alloc_calloc(1, sizeof *v);
  int n_params = res.g->n_params; /* res.params holds a reference each until v takes them */
  ir_graph *g = pass_pipeline(res.g, err, sizeof err);
  double t_passes = now_ms();
  res.g = NULL;
  if (!v || !g) {
    if (!g && !err[0]) snprintf(err, sizeof err, "out of memory");
    ir_free(g);
    goto fail;
  }
#ifdef KILN_TEST_BUILD
  /* every graph a test makes must print, parse and print to the same text */
  {
    char *txt = ir_to_string(g), perr[256] = "";
    ir_graph *back = txt ? ir_parse(txt, perr, sizeof perr) : NULL;
    char *t2 = back ? ir_to_string(back) : NULL;
    bool oom = !txt || (!back && strstr(perr, "out of memory")) || (back && !t2); /* nothing to compare */
    if (!oom && (!back || strcmp(txt, t2))) {
      fprintf(stderr, "kiln: internal: the graph of %s does not round-trip (%s)\n%s\n---\n%s\n", fn->name, perr, txt,
              t2 ? t2 : "");
      KILN_ASSERT(!"print/parse round trip");
    }
    alloc_free(txt);
    alloc_free(t2);
    ir_free(back);
  }
#endif
  v->g = g;
  v->be = fn->be;
  v->n_params = g->n_params;
  v->params = res.params;
  v->in_leaf = res.in_leaf;
  v->param_leaf = res.param_leaf;
  res.params = NULL;
  res.in_leaf = res.param_leaf = NULL;
  if (variant_prepare(fn, v, in)) {
    snprintf(err, sizeof err, "out of memory");
    goto fail;
  }
  if (fn->dump & KILN_DUMP_GRAPH) dump_graph(fn, g, "graph", no);
  if (fn->dump & KILN_DUMP_GUARDS) {
    FILE *f = dump_open(fn, "guards", no);
    print_guards(f, fn, v);
    dump_close(f);
  }
  /* the backend's dumps (kernels, llvm, asm) follow KILN_DUMP_DIR like the others */
  FILE *bdump = fn->dump & (KILN_DUMP_KERNELS | KILN_DUMP_LLVM | KILN_DUMP_ASM) ? dump_open(fn, "kernels", no) : stderr;
  v->exec = v->be->compile(g, fn->dump, bdump, err, sizeof err);
  if (bdump != stderr) fclose(bdump);
  if (!v->exec && v->be != &backend_interp) {
    /* never a crash or a wrong answer: the interpreter runs what LLVM could not */
    fprintf(stderr, "kiln: warning: %s: the %s backend failed (%s); this variant runs on the interpreter\n", fn->name,
            v->be->name, err);
    dump_note(fn, "%s backend failed: %s; interpreter instead", v->be->name, err);
    v->be = &backend_interp;
    v->exec = v->be->compile(g, fn->dump, stderr, err, sizeof err);
  }
  if (!v->exec) goto fail;
  double t2 = now_ms();
  pthread_mutex_lock(&fn->mu);
  fn->st.compile_ms += t2 - t1;
  fn->st.passes_ms += t_passes - t1;
  if (v->be->times) {
    double a, b, c;
    v->be->times(v->exec, &a, &b, &c);
    fn->st.fuse_ms += a, fn->st.llvm_opt_ms += b, fn->st.llvm_codegen_ms += c;
  }
  if (fn->n_variants < fn->opts.max_variants) {
    if (fn->n_variants == fn->cap) {
      int cap = fn->cap ? fn->cap * 2 : 8;
      variant **nv = alloc_realloc(fn->variants, sizeof *nv * (size_t)cap);
      if (nv) fn->variants = nv, fn->cap = cap;
    }
    if (fn->n_variants < fn->cap) {
      fn->variants[fn->n_variants++] = v;
      v = NULL;
    }
  }
  fn->st.variants = fn->n_variants;
  pthread_mutex_unlock(&fn->mu);
  variant_free(v); /* another thread filled the cache first */
  trace_result_free(&res);
  return 0;
fail:
  /* the eager results stand; this shape runs eagerly until the next trace */
  dump_note(fn, "could not compile the trace: %s", err);
  fprintf(stderr, "kiln: warning: %s: could not compile the trace (%s); running eagerly\n", fn->name, err);
  for (int i = 0; res.params && i < n_params; i++) kiln_release(res.params[i]);
  variant_free(v);
  trace_result_free(&res);
  return 0;
}

/* ---- check mode ---- */

static bool close_enough(const kiln_tensor *a, const kiln_tensor *b, double *maxerr) {
  *maxerr = 0;
  if (a->dtype != b->dtype || a->ndim != b->ndim || memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim)) {
    *maxerr = INFINITY;
    return false;
  }
  bool ok = true;
  int64_t n = kiln_numel(a);
  double tol = a->dtype == KILN_F32 ? 1e-4 : a->dtype == KILN_F64 ? 1e-10 : 0;
  for (int64_t i = 0; i < n; i++) {
    double x = tensor_get(a, i), y = tensor_get(b, i);
    if (x == y || (x != x && y != y)) continue;
    double e = fabs(x - y);
    if (e > *maxerr) *maxerr = e;
    if (!(e <= tol * (1 + fabs(y)))) ok = false;
  }
  return ok;
}

/* Leaf state a call may change: data of written leaves and every .grad. */
typedef struct snapshot {
  kiln_tensor **data; /* copies of the written leaves */
  kiln_tensor **grad; /* the .grad tensors (retained) */
  int n;
} snapshot;

static int snap_take(const kiln_fn *fn, const variant *v, kiln_tensor *const *in, snapshot *s) {
  s->n = fn->opts.n_in + v->n_params;
  s->data = alloc_calloc((size_t)s->n + 1, sizeof *s->data);
  s->grad = alloc_calloc((size_t)s->n + 1, sizeof *s->grad);
  if (!s->data || !s->grad) return -1;
  for (int w = 0; w < v->g->n_writes; w++) {
    if (v->g->writes[w].kind != IR_WRITE_DATA) continue;
    const ir_node *n = &v->g->nodes[v->g->writes[w].target];
    int i = n->op == IR_INPUT ? n->index : fn->opts.n_in + n->index;
    kiln_tensor *t = leaf_at(fn, v, in, i);
    if (!s->data[i] && !(s->data[i] = op_run(OP_COPY, &t, 1, NULL, "", 0))) return -1;
  }
  for (int i = 0; i < s->n; i++) s->grad[i] = kiln_retain(leaf_at(fn, v, in, i)->grad);
  return 0;
}

/* Puts the leaves back as in s; the state they had is returned in s (swap). */
static void snap_swap(const kiln_fn *fn, const variant *v, kiln_tensor *const *in, snapshot *s) {
  for (int i = 0; i < s->n; i++) {
    kiln_tensor *t = leaf_at(fn, v, in, i);
    if (s->data[i]) {
      kiln_tensor *now = op_run(OP_COPY, &t, 1, NULL, "", 0);
      pw_copy(t, s->data[i]);
      kiln_release(s->data[i]);
      s->data[i] = now;
    }
    kiln_tensor *g = t->grad;
    t->grad = s->grad[i];
    s->grad[i] = g;
  }
}

static void snap_free(snapshot *s) {
  for (int i = 0; i < s->n; i++) {
    if (s->data) kiln_release(s->data[i]);
    if (s->grad) kiln_release(s->grad[i]);
  }
  alloc_free(s->data);
  alloc_free(s->grad);
}

/* Runs v and the body eagerly from the same state and compares outputs,
 * written leaves and grads. The compiled results stand when they agree;
 * when they do not, the eager ones do (check mode never returns a wrong
 * answer it has seen). */
static int run_checked(kiln_fn *fn, variant *v, kiln_tensor *const *in, kiln_tensor **out, const char *file, int line) {
  snapshot s = {0};
  kiln_tensor *eo[MAX_IN] = {0};
  if (snap_take(fn, v, in, &s)) {
    snap_free(&s);
    return err_set(file, line, "call", "%s: out of memory", fn->name), -1;
  }
  if (v->be->run(v->exec, in, v->params, out)) {
    snap_free(&s);
    return -1;
  }
  snap_swap(fn, v, in, &s); /* leaves back to the start, compiled state in s */
  /* kernel by kernel against the interpreter, from the same start */
  char kreport[1024] = "";
  if (v->be->check && v->be->check(v->exec, in, v->params, kreport, sizeof kreport) != 1) kreport[0] = 0;
  kiln_scope_begin();
  int rc = fn->body(fn->ctx, in, eo);
  char report[512] = "";
  double e = 0;
  if (rc == 0) {
    for (int i = 0; i < fn->opts.n_out && !report[0]; i++)
      if (!eo[i] || !close_enough(out[i], eo[i], &e))
        snprintf(report, sizeof report, "output %d differs from eager (max abs error %g)", i, e);
    for (int i = 0; i < s.n && !report[0]; i++) {
      kiln_tensor *t = leaf_at(fn, v, in, i);
      if (s.data[i] && !close_enough(s.data[i], t, &e))
        snprintf(report, sizeof report, "leaf %d after the call differs from eager (max abs error %g)", i, e);
      if (!report[0] && (s.grad[i] != NULL) != (t->grad != NULL))
        snprintf(report, sizeof report, "leaf %d: .grad is %s compiled, %s eager", i, s.grad[i] ? "set" : "NULL", t->grad ? "set" : "NULL");
      else if (!report[0] && s.grad[i] && !close_enough(s.grad[i], t->grad, &e))
        snprintf(report, sizeof report, "leaf %d: .grad differs from eager (max abs error %g)", i, e);
    }
  } else {
    snprintf(report, sizeof report, "the eager run failed: %s", kiln_last_error());
  }
  bool use_eager = report[0] && rc == 0;
  for (int i = 0; i < fn->opts.n_out; i++) {
    if (use_eager) {
      kiln_release(out[i]);
      out[i] = kiln_retain(eo[i]);
    }
  }
  kiln_scope_end();
  if (!use_eager) snap_swap(fn, v, in, &s); /* the compiled state stands */
  snap_free(&s);
  int adopted = adopt_outputs(fn, out, file, line);
  if (report[0] || kreport[0]) {
    pthread_mutex_lock(&fn->mu);
    fn->st.check_fails++;
    pthread_mutex_unlock(&fn->mu);
    fprintf(stderr, "kiln: check: %s (compiled at %s:%d): %s%s%s%s\n", fn->name, fn->file, fn->line,
            report[0] ? report : "outputs agree with eager", use_eager ? "; returning the eager results" : "",
            kreport[0] ? "; " : "", kreport);
  }
  return adopted;
}

int kiln_call_at(kiln_fn *fn, kiln_tensor *const *in, kiln_tensor **out, const char *file, int line) {
  if (!fn_ok(fn)) return err_set(file, line, "call", "%s", fn_dead(fn)), -1;
  if (!out) return err_set(file, line, "call", "%s: out is NULL", fn->name), -1;
  if (fn->opts.n_in && !in) return err_set(file, line, "call", "%s: in is NULL", fn->name), -1;
  for (int i = 0; i < fn->opts.n_in; i++)
    if (!in[i]) return err_null(file, line, "call", "%s: input %d", fn->name, i), -1;
    else if (tensor_check_live(in[i], "an input", "call", file, line)) return -1;
  int64_t vals[IR_MAX_SYMS];
  struct timespec g0 = {0}, g1 = {0};
  pthread_mutex_lock(&fn->mu);
  fn->st.calls++;
  /* the guard time is sampled after the first 16 hits, one call in 16:
   * two clock reads are a few percent of a batch-1 call */
  bool timed = fn->guard_samples < 16 || (fn->st.calls & 15) == 0;
  if (timed) clock_gettime(CLOCK_MONOTONIC, &g0);
  /* a variant whose weights their owner released can never run again: drop it,
   * so that replacing weights does not fill the cache */
  for (int i = 0; i < fn->n_variants; i++) {
    variant *v = fn->variants[i];
    int gone = -1;
    for (int k = 0; k < v->n_params && !v->loaded && gone < 0; k++)
      if (tensor_refs(v->params[k]) <= 1) gone = k;
    if (gone < 0) continue;
    const ir_node *pn = &v->g->nodes[v->g->n_inputs + gone];
    dump_note(fn, "variant %d dropped: param %d (captured at %s:%d) was released by its owner", i + 1, gone, pn->file,
              pn->line);
    memmove(&fn->variants[i], &fn->variants[i + 1], sizeof *fn->variants * (size_t)(fn->n_variants - i - 1));
    fn->n_variants--;
    i--;
    if (v->users) v->dead = true;
    else variant_free(v);
  }
  fn->st.variants = fn->n_variants;
  variant *hit = NULL;
  for (int i = fn->n_variants - 1; i >= 0 && !hit; i--)
    if (guards_pass(fn, fn->variants[i], in, vals, NULL, 0)) hit = fn->variants[i];
  char why[512] = "";
  /* the backends trust a loaded graph's dims, which the verifier accepts
   * when it cannot decide them: checked at these sizes */
  if (hit && fn->loaded && ir_verify_at(hit->g, vals, why, sizeof why)) hit = NULL;
  if (timed) clock_gettime(CLOCK_MONOTONIC, &g1);
  if (hit) {
    hit->users++;
    fn->st.hits++;
    if (timed) {
      fn->guard_ns_total += (double)(g1.tv_sec - g0.tv_sec) * 1e9 + (double)(g1.tv_nsec - g0.tv_nsec);
      fn->guard_samples++;
    }
  }
  if (!hit && fn->n_variants && !why[0]) guards_pass(fn, fn->variants[fn->n_variants - 1], in, vals, why, sizeof why);
  bool eager = !hit && (fn->eager_only || fn->n_variants >= fn->opts.max_variants || fn->loaded);
  bool warn_cap = eager && !fn->eager_only && !fn->loaded && !fn->warned_cap;
  if (warn_cap) fn->warned_cap = true;
  if (eager && !fn->loaded) fn->st.fallbacks++;
  int next_variant = fn->n_variants + 1; /* for the note below: read under the lock */
  pthread_mutex_unlock(&fn->mu);

  if (hit) {
    int rc = fn->opts.check && !fn->loaded ? run_checked(fn, hit, in, out, file, line)
                                           : run_variant(fn, hit, in, out, file, line);
    pthread_mutex_lock(&fn->mu);
    bool free_it = --hit->users == 0 && hit->dead;
    pthread_mutex_unlock(&fn->mu);
    if (free_it) variant_free(hit);
    if (rc) err_locate(file, line);
    return rc;
  }
  if (fn->loaded) return err_set(file, line, "call", "%s: the call does not fit the loaded graph: %s", fn->name, why), -1;
  if (eager) {
    if (warn_cap) {
      fprintf(stderr, "kiln: warning: %s (compiled at %s:%d): %d variants cached, the cap; calls that fit none run eagerly "
              "from now on (the guard that kept failing: %s)\n", fn->name, fn->file, fn->line, fn->opts.max_variants, why);
      dump_note(fn, "cap of %d variants reached (%s): eager from now on", fn->opts.max_variants, why);
    }
    return run_eager(fn, in, out, file, line);
  }
  if (why[0]) dump_note(fn, "%s; tracing variant %d", why, next_variant);
  return trace_and_cache(fn, in, out, file, line);
}

/* ---- inspection ---- */

int kiln_fn_get_stats_at(const kiln_fn *fn, kiln_fn_stats *stats, const char *file, int line) {
  if (!fn_ok(fn)) return err_set(file, line, "fn_get_stats", "%s", fn_dead(fn)), -1;
  if (!stats) return err_set(file, line, "fn_get_stats", "stats is NULL"), -1;
  pthread_mutex_lock((pthread_mutex_t *)&fn->mu);
  *stats = fn->st;
  stats->variants = fn->n_variants;
  stats->guard_ns = fn->guard_samples ? fn->guard_ns_total / (double)fn->guard_samples : 0;
  pthread_mutex_unlock((pthread_mutex_t *)&fn->mu);
  return 0;
}

char *kiln_fn_graph_at(const kiln_fn *fn, int variant_no, const char *file, int line) {
  if (!fn_ok(fn)) return err_set(file, line, "fn_graph", "%s", fn_dead(fn));
  pthread_mutex_lock((pthread_mutex_t *)&fn->mu);
  char *s = NULL;
  if (variant_no >= 0 && variant_no < fn->n_variants) {
    char *t = ir_to_string(fn->variants[variant_no]->g);
    if (t) {
      s = malloc(strlen(t) + 1);
      if (s) strcpy(s, t);
      alloc_free(t);
    }
  }
  pthread_mutex_unlock((pthread_mutex_t *)&fn->mu);
  if (!s) err_set(file, line, "fn_graph", "%s has no variant %d", fn->name, variant_no);
  return s;
}

/* ---- save and load ---- */

int kiln_save_at(kiln_fn *fn, const char *path, const char *file, int line) {
  if (!fn_ok(fn)) return err_set(file, line, "save", "%s", fn_dead(fn)), -1;
  if (!path) return err_set(file, line, "save", "path is NULL"), -1;
  pthread_mutex_lock(&fn->mu);
  const ir_graph *g = fn->n_variants ? fn->variants[fn->n_variants - 1]->g : NULL;
  int rc = -1;
  if (!g) {
    err_set(file, line, "save", "%s has no compiled variant yet (call it once first)", fn->name);
  } else {
    FILE *f = fopen(path, "w");
    if (!f) err_set(file, line, "save", "cannot open %s: %s", path, strerror(errno));
    else {
      rc = ir_print(g, f);
      if (fclose(f) || rc) rc = -1, err_set(file, line, "save", "cannot write %s", path);
    }
  }
  pthread_mutex_unlock(&fn->mu);
  return rc;
}

static int loaded_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx, (void)in, (void)out;
  return err_set("", 0, "call", "a loaded graph has no body"), -1;
}

kiln_fn *kiln_load_string_at(const char *text, const char *file, int line) {
  if (!text) return err_set(file, line, "load", "text is NULL");
  char err[512];
  ir_graph *g = ir_parse(text, err, sizeof err);
  if (!g) return err_set(file, line, "load", "%s", err);
  if (ir_verify(g, err, sizeof err)) {
    ir_free(g);
    return err_set(file, line, "load", "the graph does not verify: %s", err);
  }
  /* params become inputs after the graph's own */
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i].op == IR_PARAM) {
      g->nodes[i].op = IR_INPUT;
      g->nodes[i].index += g->n_inputs;
    }
  int n_in = g->n_inputs + g->n_params;
  int n_params = g->n_params;
  g->n_inputs = n_in;
  g->n_params = 0;
  (void)n_params;
  if (n_in > MAX_IN || g->n_outputs < 1 || g->n_outputs > MAX_IN) {
    int n_out = g->n_outputs; /* read before the graph is freed */
    ir_free(g);
    return err_set(file, line, "load", "the graph has %d inputs and %d outputs (at most %d each, one output at least)", n_in,
                   n_out, MAX_IN);
  }
  kiln_options o = {.name = g->name, .n_in = n_in, .n_out = g->n_outputs};
  kiln_fn *fn = kiln_compile_at(loaded_body, NULL, &o, "", 0);
  variant *v = fn ? alloc_calloc(1, sizeof *v) : NULL;
  if (!v) goto oom;
  fn->loaded = true;
  v->g = g;
  v->be = fn->be;
  v->loaded = true;
  v->in_dims = alloc_calloc((size_t)n_in + 1, sizeof *v->in_dims);
  v->alias = alloc_calloc((size_t)n_in + 1, sizeof *v->alias);
  fn->variants = alloc_calloc(1, sizeof *fn->variants);
  if (!v->in_dims || !v->alias || !fn->variants) goto oom;
  fill_in_dims(v);
  for (int i = 0; i < n_in; i++) v->alias[i] = i; /* compiled for distinct inputs */
  v->exec = v->be->compile(g, 0, stderr, err, sizeof err);
  if (!v->exec && v->be != &backend_interp) {
    fprintf(stderr, "kiln: warning: %s: the %s backend failed (%s); the loaded graph runs on the interpreter\n", fn->name,
            v->be->name, err);
    v->be = &backend_interp;
    v->exec = v->be->compile(g, 0, stderr, err, sizeof err);
  }
  if (!v->exec) goto oom;
  fn->variants[0] = v;
  fn->n_variants = fn->cap = 1;
  return fn;
oom:
  if (v) v->g = NULL;
  variant_free(v);
  kiln_fn_free(fn);
  ir_free(g);
  return err_set(file, line, "load", "out of memory");
}

kiln_fn *kiln_load_at(const char *path, const char *file, int line) {
  if (!path) return err_set(file, line, "load", "path is NULL");
  FILE *f = fopen(path, "rb");
  if (!f) return err_set(file, line, "load", "cannot open %s: %s", path, strerror(errno));
  char *buf = NULL;
  size_t n = 0, cap = 0;
  for (;;) {
    if (n + 4096 + 1 > cap) {
      cap = cap ? cap * 2 : 65536;
      if (cap > ((size_t)1 << 31)) {
        alloc_free(buf);
        fclose(f);
        return err_set(file, line, "load", "%s is larger than 2 GiB", path);
      }
      char *nb = alloc_realloc(buf, cap);
      if (!nb) {
        alloc_free(buf);
        fclose(f);
        return err_set(file, line, "load", "out of memory");
      }
      buf = nb;
    }
    size_t r = fread(buf + n, 1, 4096, f);
    n += r;
    if (r < 4096) break;
  }
  fclose(f);
  buf[n] = 0;
  if (strlen(buf) != n) {
    alloc_free(buf);
    return err_set(file, line, "load", "%s: contains a NUL byte (not an IR text file)", path);
  }
  kiln_fn *fn = kiln_load_string_at(buf, file, line);
  alloc_free(buf);
  if (!fn) {
    char msg[600];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    const char *p = strstr(msg, "kiln_load: ");
    err_set(file, line, "load", "%s: %s", path, p ? p + 11 : msg);
  }
  return fn;
}

/* The plain functions, for callers that need an address or were compiled
 * before the _at forms; their errors name no line. */
void (kiln_fn_free)(kiln_fn *fn) { kiln_fn_free_at(fn, "", 0); }
int (kiln_mark_dynamic)(kiln_fn *fn, int input, int dim) { return kiln_mark_dynamic_at(fn, input, dim, "", 0); }
int (kiln_fn_get_stats)(const kiln_fn *fn, kiln_fn_stats *stats) { return kiln_fn_get_stats_at(fn, stats, "", 0); }
char *(kiln_fn_graph)(const kiln_fn *fn, int variant_no) { return kiln_fn_graph_at(fn, variant_no, "", 0); }
int (kiln_save)(kiln_fn *fn, const char *path) { return kiln_save_at(fn, path, "", 0); }
kiln_fn *(kiln_load)(const char *path) { return kiln_load_at(path, "", 0); }
kiln_fn *(kiln_load_string)(const char *text) { return kiln_load_string_at(text, "", 0); }
