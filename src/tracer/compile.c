/* The compile front: kiln_compile, kiln_call and the variant cache.
 *
 * A call runs the body as a recording (record.c): the body's C runs as it
 * would eagerly, but ops make meta tensors and append events to a log. The
 * log is matched, segment by segment, against the cached variants' scripts
 * (the logs of the calls that made them): events, the numbers user code
 * passed (each held by its slot rule), the values handed out, and the
 * guards. A segment that matches runs its compiled graph; one that does not
 * is built from the log (build.c), cleaned by the passes, compiled, run, and
 * a new variant is cached at the end of the call. A data read of a value
 * that has none yet is a graph break: the events before it run as a
 * segment, the value gets its data, and recording goes on.
 *
 * A body whose first recording read no size, data or number it could branch
 * on takes the guard-only path: a call that passes a variant's guards runs
 * its graph without running the body. kiln_load's graphs have no body and
 * take only that path. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#include "tracer/tracer.h"

#define FN_MAGIC 0x6b696c6eu
#define FN_FREED 0x66726565u /* freed: its header is parked, never reused for 16 more frees */
#define MAX_IN 64

/* Autograd state of a leaf when the call started: a guard-path variant runs only where it is the same. */
typedef struct trace_leaf {
  bool requires_grad;
  bool grad_present;
} trace_leaf;

/* One input dim, as a guard: a constant, or a symbol to bind. */
typedef struct dim_check {
  int64_t c; /* when sym < 0 */
  int sym;   /* symbol id, or -1; -2: an expression, checked after binding */
} dim_check;

/* A compiled piece of a variant: the events [from, to) of its script. */
typedef struct segment {
  int refs;                /* the variants that hold it */
  int from, to;
  int val_from, val_to;    /* the values its events made */
  ir_graph *g;             /* after the passes */
  backend_exec *exec;
  const backend *be;
  int n_extra, *extra;     /* inputs after the call's: a carried value id, or -1 - argument */
  int n_params, *params;   /* the call's params (in the order the body reached them), in the graph's order */
  int n_out, *out;         /* the values it hands out, in output order */
  int n_body;              /* the first n_body outputs are the body's outputs (the last segment) */
  bool frozen;
  int n_writes;            /* the leaves it writes back, as the call that made it wrote them: a */
  build_write *writes;     /* kiln_zero_grad is in no event, so a call must match these too */
} segment;

typedef struct variant {
  /* the script: the log of the call that made it */
  rec_event *ev;
  int n_ev;
  int *ids;
  rec_value *val;
  int n_val;
  char **data;             /* EV_DATA bytes (ev[i].data points into them) */
  int n_data;
  op_attrs *attrs;         /* the events' own attributes (ev[i].a points into them, or is rec_no_attrs) */
  slot_rule *rules;
  int *rule_at;            /* per event, its first rule; n_ev + 1 of them */
  sym_ctx *rsym;
  build_arg *args;
  int n_args;
  build_sym syms[IR_MAX_SYMS];
  int n_syms;
  segment **seg;
  int n_seg;
  int n_params;
  kiln_tensor **params;    /* retained: the guard path reads them */
  int *alias;              /* [n_in + n_params]: the first leaf sharing storage with this one */
  int *view_of;            /* [n_in + n_params]: the first leaf that is the same view as this one (tensor_same_view) */
  int in_first[MAX_IN];    /* the first input that is the same tensor as input i (one value, one .grad) */
  int in_ndim[MAX_IN];
  int64_t in_shape[MAX_IN][MAXD];
  uint64_t layout_in;      /* inputs whose layout chose a view or a copy (rec layout_in): */
  int64_t in_stride[MAX_IN][MAXD]; /* their strides when traced, */
  uint64_t in_contig;      /* and whether they were contiguous */
  /* the guard-only path */
  bool guard_ok;
  bool grad_on;            /* autograd was on when the body was recorded (kiln_no_grad_begin off) */
  bool backward;           /* the body ran a backward (or kiln_grad_of) when recorded */
  trace_leaf *in_leaf, *param_leaf;
  int *out_leaf;           /* [n_out]: the leaf (input, then param) the body returned as output i, or -1; NULL: none */
  dim_check (*in_dims)[MAXD];
  int in_node[MAX_IN];     /* the graph's input nodes, so a call reads those alone */
  int n_in_node;           /* -1: more than MAX_IN, every node is scanned */
  bool loaded;             /* from kiln_load */
  int users;               /* calls using it now (fn->mu) */
  bool dead;               /* dropped from the cache: freed when the last user is done */
  int no;                  /* its number in the dumps */
  /* the script a recorded call that ran it left (replay.c); NULL while a call replays it */
  rp_script *script;
  int script_misses;       /* recorded calls in a row it ran whose inputs the script did not fit */
  int script_breaks;       /* replays of it in a row that handed over (the body alternates, say) */
  int script_rest;         /* recorded calls it runs before it gets a script again */
  int script_fails;        /* recorded calls in a row whose log a replay could not check */
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
  uint8_t dyn[MAX_IN][MAXD];        /* dims that are symbolic in the next variant */
  int64_t last_shape[MAX_IN][MAXD]; /* the inputs of the last variant made, for the automatic policy */
  int last_ndim[MAX_IN];
  bool have_last;
  bool loaded;                      /* from kiln_load: one graph, no body */
  bool warned_cap;
  /* events whose constant number changed and stayed a constant of the
   * variant made for it (an op's attribute: a clamp bound, topk's k): a
   * third change runs on the interpreter instead of compiling again */
  struct { int ev, n; } futile[8];
  bool warned_futile;
  struct rec_state *spare;          /* a finished call's recording buffers, for the next call (rec_keep) */
  bool no_replay;                   /* KILN_REPLAY=0: every call on the recording path records */
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

static const struct {
  const char *name;
  unsigned bit;
} dump_names[] = {{"trace", KILN_DUMP_TRACE}, {"graph", KILN_DUMP_GRAPH}, {"guards", KILN_DUMP_GUARDS},
                  {"recompiles", KILN_DUMP_RECOMPILES}, {"kernels", KILN_DUMP_KERNELS}, {"llvm", KILN_DUMP_LLVM},
                  {"asm", KILN_DUMP_ASM}, {"breaks", KILN_DUMP_BREAKS}, {"all", KILN_DUMP_ALL}};

/* A variable's unknown words are said once per process, with the words it takes. */
static atomic_int warned_dump, warned_backend, warned_capture, warned_replay;

static unsigned parse_dump(const char *s) {
  unsigned bits = 0;
  while (s && *s) {
    size_t n = strcspn(s, ", ");
    bool known = false;
    for (size_t i = 0; i < sizeof dump_names / sizeof dump_names[0]; i++)
      if (strlen(dump_names[i].name) == n && !strncmp(s, dump_names[i].name, n)) bits |= dump_names[i].bit, known = true;
    if (!known && n && !atomic_exchange(&warned_dump, 1))
      fprintf(stderr, "kiln: warning: KILN_DUMP: unknown name '%.*s' (known: trace, graph, guards, recompiles, kernels, "
              "llvm, asm, breaks, all)\n", (int)(n > 32 ? 32 : n), s);
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

static void dump_line(kiln_fn *fn, unsigned bit, const char *kind, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void dump_line(kiln_fn *fn, unsigned bit, const char *kind, const char *fmt, ...) {
  if (!(fn->dump & bit)) return;
  FILE *f = stderr;
  if (fn->dump_dir[0]) {
    char path[768];
    snprintf(path, sizeof path, "%s/%s.%s.txt", fn->dump_dir, fn->name, kind);
    f = fopen(path, "a");
    if (!f) f = stderr;
  }
  va_list ap;
  va_start(ap, fmt);
  fprintf(f, "kiln %s: %s: ", bit == KILN_DUMP_RECOMPILES ? "recompile" : "break", fn->name);
  vfprintf(f, fmt, ap);
  fprintf(f, "\n");
  va_end(ap);
  dump_close(f);
}
#define dump_note(fn, ...) dump_line((fn), KILN_DUMP_RECOMPILES, "recompiles", __VA_ARGS__)

static void dump_graph(kiln_fn *fn, const ir_graph *g, const char *kind, int no) {
  FILE *f = dump_open(fn, kind, no);
  ir_print(g, f);
  dump_close(f);
}

/* Whether a segment of v holds a param's data as a constant (opts.freeze). */
static bool variant_frozen(const variant *v) {
  for (int s = 0; s < v->n_seg; s++)
    if (v->seg[s]->frozen) return true;
  return false;
}

/* Whether v still holds every param it was made with (a recording-path
 * variant lets go of those their owner released). */
static bool variant_params_held(const variant *v) {
  for (int k = 0; k < v->n_params; k++)
    if (!v->params[k]) return false;
  return true;
}

static kiln_tensor *leaf_at(const kiln_fn *fn, const variant *v, kiln_tensor *const *in, int i) {
  return i < fn->opts.n_in ? in[i] : v->params[i - fn->opts.n_in];
}

static void print_guards(FILE *f, const kiln_fn *fn, const variant *v) {
  fprintf(f, "guards of %s: %s\n", fn->name,
          v->loaded ? "a loaded graph: the guards below, no body"
          : v->guard_ok ? "guard-only path: a call that passes these runs compiled code without running the body"
                        : "recording path: every call runs the body as a recording, matched against this variant's "
                          "events and the numbers it passed");
  const ir_graph *g = v->seg[0]->g;
  for (int i = 0; i < g->n_nodes; i++) {
    const ir_node *n = &g->nodes[i];
    if (n->op != IR_INPUT && n->op != IR_PARAM) continue;
    if (n->op == IR_INPUT && n->index >= fn->opts.n_in) continue;
    fprintf(f, "  %s %d: %s[", n->op == IR_INPUT ? "input" : "param", n->index, kiln_dtype_name(n->dtype));
    for (int d = 0; d < n->ndim; d++) {
      char b[128];
      if (sym_print(n->shape[d], b, sizeof b) < 0) snprintf(b, sizeof b, "?");
      fprintf(f, "%s%s", d ? "," : "", b);
    }
    fprintf(f, "]");
    if (n->op == IR_PARAM) fprintf(f, " (captured by reference at %s:%d; held elsewhere)", *n->file ? n->file : "?", n->line);
    const trace_leaf *l = n->op == IR_INPUT ? (v->in_leaf ? &v->in_leaf[n->index] : NULL)
                                            : (v->param_leaf ? &v->param_leaf[n->index] : NULL);
    if (l && !v->loaded && l->requires_grad) fprintf(f, " requires_grad, .grad %s", l->grad_present ? "set" : "NULL");
    else if (l && !v->loaded && l->grad_present) fprintf(f, " .grad set");
    fprintf(f, "\n");
  }
  for (int k = 0; k < v->n_syms; k++) {
    fprintf(f, "  s%d in [%lld, %lld]", k, (long long)v->syms[k].lo, (long long)v->syms[k].hi);
    if (v->syms[k].input < 0) fprintf(f, ": a number the body passes (argument %d)", v->syms[k].arg);
    fprintf(f, "\n");
  }
  for (int s = 0; s < v->n_seg; s++)
    for (int i = 0; i < v->seg[s]->g->n_guards; i++) {
      char b[256];
      if (sym_guard_print(&v->seg[s]->g->guards[i], b, sizeof b) >= 0) fprintf(f, "  %s\n", b);
    }
  for (int e = 0; e < v->n_ev && !v->loaded; e++)
    for (int k = v->rule_at[e]; k < v->rule_at[e + 1]; k++) {
      const slot_rule *r = &v->rules[k];
      if (r->kind == SLOT_CONST) continue;
      char b[256] = "";
      if (r->kind == SLOT_EXPR && sym_print(r->e, b, sizeof b) < 0) snprintf(b, sizeof b, "?");
      const char *what = r->kind == SLOT_ARG && v->args[r->arg].is_data ? "a tensor made from C data" : "a number";
      fprintf(f, "  %s:%d: %s %s %s\n", v->ev[e].file, v->ev[e].line, what, r->kind == SLOT_EXPR ? "must equal" : "is argument",
              r->kind == SLOT_EXPR ? b : (snprintf(b, sizeof b, "%d", r->arg), b));
    }
  if (v->guard_ok && !v->loaded) fprintf(f, "  autograd %s, as when traced\n", v->grad_on ? "on" : "off (inside kiln_no_grad_begin)");
  if (v->guard_ok && !v->loaded && v->backward) fprintf(f, "  every input a leaf (no autograd history): the body runs a backward\n");
  for (uint64_t m = v->guard_ok ? v->layout_in : 0; m; m &= m - 1)
    fprintf(f, "  input %d %s, as when traced (a reshape or kiln_contiguous of it chose by its layout)\n", __builtin_ctzll(m),
            v->in_contig >> __builtin_ctzll(m) & 1 ? "contiguous" : "laid out (sizes and strides)");
  int n_leaves = fn->opts.n_in + v->n_params;
  for (int i = 0; i < n_leaves; i++)
    if (v->alias[i] != i)
      fprintf(f, "  leaf %d shares storage with leaf %d%s\n", i, v->alias[i],
              v->view_of && v->view_of[i] != i ? ", the same view as an earlier leaf" : "");
  fprintf(f, "  every other pair of inputs and params in distinct storage\n");
}

/* ---- guards ---- */

/* Binds v's input symbols from in: 1 when every input fits (dtype, rank,
 * constant dims, symbol bounds), else 0 with why (when given). */
static int inputs_pass(const kiln_fn *fn, const variant *v, kiln_tensor *const *in, int64_t *vals, char *why, size_t whyn) {
  bool bound[IR_MAX_SYMS] = {0};
  const ir_graph *g = v->seg[0]->g;
  int n_scan = v->n_in_node >= 0 ? v->n_in_node : g->n_nodes;
  for (int s = 0; s < n_scan; s++) {
    const ir_node *n = &g->nodes[v->n_in_node >= 0 ? v->in_node[s] : s];
    if (n->op != IR_INPUT || n->index >= fn->opts.n_in) continue;
    const kiln_tensor *t = in[n->index];
    if (t->dtype != n->dtype) {
      if (why) snprintf(why, whyn, "input %d: traced %s, got %s (variant %d)", n->index, kiln_dtype_name(n->dtype), kiln_dtype_name(t->dtype), v->no);
      return 0;
    }
    if (t->ndim != n->ndim) {
      if (why) snprintf(why, whyn, "input %d: traced rank %d, got %d (variant %d)", n->index, n->ndim, t->ndim, v->no);
      return 0;
    }
    for (int d = 0; d < n->ndim; d++) {
      const dim_check *c = &v->in_dims[n->index][d];
      int64_t got = t->shape[d];
      if (c->sym == -1) {
        if (got != c->c) {
          if (why) snprintf(why, whyn, "input %d dim %d: traced %lld, got %lld (variant %d)", n->index, d, (long long)c->c, (long long)got, v->no);
          return 0;
        }
      } else if (c->sym >= 0) {
        int k = c->sym;
        if (!bound[k]) {
          if (got < v->syms[k].lo || got > v->syms[k].hi) {
            if (why) snprintf(why, whyn, "input %d dim %d: %lld is outside s%d's range [%lld, %lld] (variant %d)", n->index, d,
                              (long long)got, k, (long long)v->syms[k].lo, (long long)v->syms[k].hi, v->no);
            return 0;
          }
          vals[k] = got;
          bound[k] = true;
        } else if (vals[k] != got) {
          if (why) snprintf(why, whyn, "input %d dim %d: %lld, but s%d is %lld (variant %d)", n->index, d, (long long)got, k, (long long)vals[k], v->no);
          return 0;
        }
      }
    }
  }
  return 1;
}

static int guards_hold(const ir_graph *g, const int64_t *vals, int nvals, char *why, size_t whyn, int no) {
  for (int i = 0; i < g->n_guards; i++)
    if (sym_guard_check(&g->guards[i], vals, nvals) != 1) {
      if (why) {
        char b[256];
        if (sym_guard_print(&g->guards[i], b, sizeof b) < 0) snprintf(b, sizeof b, "?");
        snprintf(why, whyn, "guard %s fails (variant %d)", b, no);
      }
      return 0;
    }
  return 1;
}

/* The guard-only path: 1 when the call may run v without the body. */
static int guards_pass(const kiln_fn *fn, const variant *v, kiln_tensor *const *in, int64_t *vals, char *why, size_t whyn) {
  if (!inputs_pass(fn, v, in, vals, why, whyn) || !guards_hold(v->seg[0]->g, vals, v->n_syms, why, whyn, v->no)) return 0;
  int n_in = fn->opts.n_in;
  /* an input the graph writes in place must not repeat elements (an
   * expanded view, stride 0): eagerly that write is an error, while the
   * graph's write-back would store into it regardless. Such a call records,
   * and the recording fails as eager code does */
  const ir_graph *g0 = v->seg[0]->g;
  for (int w = 0; w < g0->n_writes; w++) {
    const ir_node *n = &g0->nodes[g0->writes[w].target];
    if (g0->writes[w].kind != IR_WRITE_DATA || n->op != IR_INPUT || n->index >= n_in) continue;
    const kiln_tensor *t = in[n->index];
    for (int d = 0; d < t->ndim; d++)
      if (t->shape[d] > 1 && t->stride[d] == 0) {
        if (why) snprintf(why, whyn, "input %d is written in place but repeats elements (an expanded view) (variant %d)", n->index, v->no);
        return 0;
      }
  }
  /* an input whose layout chose a view or a copy when traced (a reshape, a
   * kiln_contiguous): the same choice now. A contiguous input views
   * always; another one, at the same sizes and strides, chooses the same */
  for (uint64_t m = v->layout_in; m; m &= m - 1) {
    int i = __builtin_ctzll(m);
    const kiln_tensor *t = in[i];
    bool contig = tensor_contiguous(t), was = v->in_contig >> i & 1;
    if (contig == was && (was || (t->ndim == v->in_ndim[i] && !memcmp(t->shape, v->in_shape[i], sizeof(int64_t) * (size_t)t->ndim) &&
                                  !memcmp(t->stride, v->in_stride[i], sizeof(int64_t) * (size_t)t->ndim))))
      continue;
    if (why) snprintf(why, whyn, "input %d: a reshape or kiln_contiguous chose a view or a copy by its layout, which %s (variant %d)", i,
                      contig == was ? "has other strides now" : was ? "was contiguous" : "is contiguous now", v->no);
    return 0;
  }
  if (!v->loaded) {
    /* under the caller's kiln_no_grad_begin the body's backward fails and
     * its in-place writes of what requires grad are allowed: another body */
    if (grad_mode() != v->grad_on) {
      if (why) snprintf(why, whyn, "autograd %s when traced, %s now (variant %d)", v->grad_on ? "on" : "off",
                        v->grad_on ? "off" : "on", v->no);
      return 0;
    }
    for (int i = 0; i < n_in + v->n_params; i++) {
      kiln_tensor *t = leaf_at(fn, v, in, i);
      const trace_leaf *l = i < n_in ? &v->in_leaf[i] : &v->param_leaf[i - n_in];
      const char *kind = i < n_in ? "input" : "param";
      int idx = i < n_in ? i : i - n_in;
      if (t->requires_grad != l->requires_grad) {
        if (why) snprintf(why, whyn, "%s %d: requires_grad changed (variant %d)", kind, idx, v->no);
        return 0;
      }
      /* traced as a leaf (a variant whose leaves had history records every
       * call): the body's backward must walk on into this one's history,
       * and its .grad is not set, as eagerly */
      if (v->backward && t->grad_fn) {
        if (why) snprintf(why, whyn, "%s %d has autograd history, the body runs a backward, and it was a leaf when traced (variant %d)",
                          kind, idx, v->no);
        return 0;
      }
      /* every leaf's: a tensor that no longer requires grad may keep its .grad, which the body can read */
      if ((t->grad != NULL) != l->grad_present) {
        if (why) snprintf(why, whyn, "%s %d: .grad was %s, now %s (variant %d)", kind, idx, l->grad_present ? "set" : "NULL",
                          t->grad ? "set" : "NULL", v->no);
        return 0;
      }
    }
  }
  /* pairs with an input only: two params are tensors the variant holds,
   * and a tensor's storage never changes (a decode step's ~70 params made
   * this loop thousands of pairs a call) */
  int n_leaves = n_in + v->n_params;
  for (int i = 0; i < n_in; i++) {
    kiln_tensor *a = leaf_at(fn, v, in, i);
    for (int j = i + 1; j < n_leaves; j++) {
      kiln_tensor *b = leaf_at(fn, v, in, j);
      bool share = a->st == b->st, traced = v->alias[j] == v->alias[i];
      if (share != traced) {
        if (why) snprintf(why, whyn, "leaves %d and %d %s storage, unlike variant %d", i, j, share ? "share" : "do not share", v->no);
        return 0;
      }
      /* over one storage: the same view of it as when traced, or not (a write
       * of one from the other is allowed eagerly for x and its reshape, an
       * error where they overlap otherwise, x and x transposed) */
      if (share && v->view_of && tensor_same_view(a, b) != (v->view_of[i] == v->view_of[j])) {
        if (why) snprintf(why, whyn, "leaves %d and %d are %s view of their storage, unlike variant %d", i, j,
                          tensor_same_view(a, b) ? "the same" : "another", v->no);
        return 0;
      }
      /* and one tensor as when traced, or two (a tensor passed twice is one value, with one .grad) */
      if (share && j < n_in && !v->loaded && (a == b) != (v->in_first[j] == v->in_first[i])) {
        if (why) snprintf(why, whyn, "inputs %d and %d are %s, unlike variant %d", i, j, a == b ? "one tensor" : "two tensors", v->no);
        return 0;
      }
    }
  }
  return 1;
}

/* ---- variants ---- */

static void segment_free(segment *s) {
  if (!s || --s->refs > 0) return;
  if (s->exec) s->be->free(s->exec);
  ir_free(s->g);
  alloc_free(s->extra);
  alloc_free(s->params);
  alloc_free(s->out);
  alloc_free(s->writes);
  alloc_free(s);
}

static void variant_free(variant *v) {
  if (!v) return;
  for (int i = 0; i < v->n_seg; i++) segment_free(v->seg[i]);
  alloc_free(v->seg);
  for (int i = 0; v->params && i < v->n_params; i++) kiln_release(v->params[i]);
  alloc_free(v->params);
  for (int i = 0; i < v->n_data; i++) alloc_free(v->data[i]);
  alloc_free(v->data);
  alloc_free(v->attrs);
  alloc_free(v->ev);
  alloc_free(v->ids);
  alloc_free(v->val);
  alloc_free(v->rules);
  alloc_free(v->rule_at);
  alloc_free(v->args);
  sym_ctx_free(v->rsym);
  alloc_free(v->in_leaf);
  alloc_free(v->out_leaf);
  alloc_free(v->param_leaf);
  alloc_free(v->in_dims);
  alloc_free(v->alias);
  alloc_free(v->view_of);
  rp_free(v->script);
  alloc_free(v);
}

/* The guard of each input dim: its constant, its symbol, or an expression
 * (-2); and the input nodes' ids, which the guard path reads instead of the
 * whole graph (a decode step's: hundreds of nodes, a cache line each). */
static void fill_in_dims(const kiln_fn *fn, variant *v) {
  const ir_graph *g = v->seg[0]->g;
  v->n_in_node = 0;
  for (int i = 0; i < g->n_nodes; i++) {
    const ir_node *n = &g->nodes[i];
    if (n->op != IR_INPUT || n->index >= fn->opts.n_in) continue;
    if (v->n_in_node >= 0 && v->n_in_node < MAX_IN) v->in_node[v->n_in_node++] = i;
    else v->n_in_node = -1;
    for (int d = 0; d < n->ndim; d++) {
      int k = ir_sym_id(g, n->shape[d]);
      v->in_dims[n->index][d] = sym_is_const(n->shape[d]) ? (dim_check){n->shape[d].c, -1} : (dim_check){0, k >= 0 ? k : -2};
    }
  }
}

/* The first leaf (of inputs then params) sharing storage with each. */
static int alias_pattern(kiln_tensor *const *in, int n_in, kiln_tensor *const *params, int n_params, int *alias) {
  int n = n_in + n_params;
  /* many leaves (a model's params): each storage's first leaf by a hash of
   * storages, not by looking back at every earlier leaf (quadratic) */
  size_t cap = 64;
  while (cap < 2 * (size_t)n) cap *= 2;
  const storage **key = n > 32 ? alloc_calloc(cap, sizeof *key) : NULL;
  int *first = key ? alloc_malloc(sizeof *first * cap) : NULL;
  if (first) {
    for (int i = 0; i < n; i++) {
      const storage *st = (i < n_in ? in[i] : params[i - n_in])->st;
      size_t h = hash64((uint64_t)(uintptr_t)st) & (cap - 1);
      while (key[h] && key[h] != st) h = (h + 1) & (cap - 1);
      if (!key[h]) key[h] = st, first[h] = i;
      alias[i] = first[h];
    }
    alloc_free(key);
    alloc_free(first);
    return 0;
  }
  alloc_free(key);
  for (int i = 0; i < n; i++) {
    alias[i] = i;
    const kiln_tensor *a = i < n_in ? in[i] : params[i - n_in];
    for (int j = 0; j < i; j++)
      if ((j < n_in ? in[j] : params[j - n_in])->st == a->st) {
        alias[i] = alias[j];
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
  if (o.capture < KILN_CAPTURE_AUTO || o.capture > KILN_CAPTURE_GUARDS) return err_set(file, line, "compile", "unknown capture mode %d", o.capture);
  if (o.max_variants < 0) return err_set(file, line, "compile", "max_variants %d is negative", o.max_variants);
  if (o.scan_save < KILN_SCAN_SAVE_DOTS || o.scan_save > KILN_SCAN_SAVE_CARRIES)
    return err_set(file, line, "compile", "unknown scan_save policy %d", o.scan_save);
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
  const char *fg = getenv("KILN_FULLGRAPH");
  if (fg && *fg && strcmp(fg, "0")) fn->opts.fullgraph = 1;
  const char *rp = getenv("KILN_REPLAY");
  fn->no_replay = rp && !strcmp(rp, "0");
  if (rp && *rp && strcmp(rp, "0") && strcmp(rp, "1") && !atomic_exchange(&warned_replay, 1))
    fprintf(stderr, "kiln: warning: KILN_REPLAY: unknown value '%.32s' (known: 0, 1)\n", rp);
  const char *ss = getenv("KILN_SCAN_SAVE");
  if (ss && !strcmp(ss, "dots")) fn->opts.scan_save = KILN_SCAN_SAVE_DOTS;
  if (ss && !strcmp(ss, "carries")) fn->opts.scan_save = KILN_SCAN_SAVE_CARRIES;
  const char *cap = getenv("KILN_CAPTURE");
  if (fn->opts.capture == KILN_CAPTURE_AUTO && cap && *cap) {
    if (!strcmp(cap, "record")) fn->opts.capture = KILN_CAPTURE_RECORD;
    else if (!strcmp(cap, "guards")) fn->opts.capture = KILN_CAPTURE_GUARDS;
    else if (strcmp(cap, "auto") && !atomic_exchange(&warned_capture, 1))
      fprintf(stderr, "kiln: warning: KILN_CAPTURE: unknown value '%.32s' (known: auto, record, guards)\n", cap);
  }
  int be = o.backend;
  const char *bn = getenv("KILN_BACKEND");
  if (be == KILN_BACKEND_DEFAULT && bn && *bn) {
    if (!strcmp(bn, "interp")) be = KILN_BACKEND_INTERP;
    else if (strcmp(bn, "llvm") && !atomic_exchange(&warned_backend, 1))
      fprintf(stderr, "kiln: warning: KILN_BACKEND: unknown value '%.32s' (known: llvm, interp)\n", bn);
  }
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
  rec_spare_free(fn->spare);
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
static int adopt_outputs(kiln_fn *fn, kiln_tensor **out) {
  int rc = 0;
  for (int i = 0; i < fn->opts.n_out; i++)
    if (out[i] && !(out[i] = scope_adopt(out[i]))) rc = -1;
  if (rc == 0) return 0;
  for (int i = 0; i < fn->opts.n_out; i++) out[i] = NULL; /* the adopted ones go with the scope */
  return err_set("", 0, "call", "%s: out of memory", fn->name), -1;
}

/* The dims of the next variant that are symbolic: marks, and under the
 * automatic policy every dim that differs from the last variant's call. */
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

/* What one segment of a call was: enough to build it again. */
typedef struct seg_info {
  int from, to;              /* events */
  int val_from, val_to;      /* values made */
  int *out, n_out, n_body;   /* values handed out; the body's outputs first (the last segment) */
  build_write *writes;
  int n_writes;
} seg_info;

enum { CALL_INLINE = 8 };

/* One recorded call: what it matched, what it built. */
typedef struct call_state {
  kiln_fn *fn;
  kiln_tensor *const *in;
  bool grad_on;               /* the caller's autograd mode, which the body ran under */
  bool backward;              /* the body ran autograd's engine (ag_engine_runs) */
  bool sets_state;            /* the body set kiln's own state (a seed, the thread count, a no-grad scope left open) */
  int *outs;                  /* the body's outputs' value ids (the last segment) */
  kiln_tensor **out_t;        /* and the tensors */
  recording rec;
  /* candidates: the variants whose inputs fit, newest first; alive while they match */
  variant **cand;
  int n_cand;
  bool *alive;
  int64_t (*cand_vals)[IR_MAX_SYMS];
  variant *prev_var;          /* no candidate: the newest variant, to tell literals from sizes */
  int n_seg;
  int val_start;              /* values before the running segment */
  /* building: from some segment on, the call matched no variant */
  bool building;
  segment **segs;             /* the new variant's segments */
  int n_segs;
  bool uncached;              /* the cache is full: the new segments run on the interpreter */
  bool storm;                 /* or an op's number changes at every call (uncached too) */
  bool kept_live;             /* the body keeps a tensor it made other than its outputs (even a view of one) */
  bool matched_all;
  variant *ran;               /* the cached variant whose first segment ran */
  double compile_ms, passes_ms, front_ms, opt_ms, machine_ms;
  int no;
  /* From here on, not cleared at the start of a call (call_start): filled
   * before they are read. */
  seg_info seg[64];           /* the segments that ran */
  /* the arguments of the segment running now */
  int64_t argi[IR_MAX_SYMS];
  double argf[IR_MAX_SYMS];
  const void *argd[IR_MAX_SYMS]; /* data arguments: bytes of the recording's EV_DATA events */
  build_state b;              /* building */
  build_prev prev;
  /* cand, alive, cand_vals and outs in place for a function of few variants
   * and outputs: no allocation for them on a call */
  variant *cand_in[CALL_INLINE];
  bool alive_in[CALL_INLINE];
  int64_t cand_vals_in[CALL_INLINE][IR_MAX_SYMS];
  int outs_in[CALL_INLINE];
  uint8_t dyn[MAX_IN][MAXD];
  char why[2048];             /* why each variant did not match, one after another */
} call_state;

/* A call's state, cleared up to the large fields (11 KiB in all would be
 * cleared on every call otherwise). */
static void call_start(call_state *cs, kiln_fn *fn, kiln_tensor *const *in) {
  memset(cs, 0, offsetof(call_state, seg));
  cs->fn = fn;
  cs->in = in;
  cs->grad_on = grad_mode();
  cs->why[0] = 0;
}

/* Appends one variant's reason to a list of them. */
static void add_why(char *list, size_t n, const char *why) {
  size_t k = strlen(list);
  if (k && k + 2 < n) k += (size_t)snprintf(list + k, n - k, "; ");
  if (k < n) snprintf(list + k, n - k, "%s", why);
}

/* Whether events a (of the call) and b (of a script) are the same but for their numbers. */
static bool same_structure(const int *ids_a, const rec_event *a, const int *ids_b, const rec_event *b) {
  if (a->kind != b->kind || a->op != b->op || a->n_in != b->n_in || a->out != b->out) return false;
  for (int i = 0; i < a->n_in; i++) /* one to three inputs: no memcmp call */
    if (ids_a[a->in + i] != ids_b[b->in + i]) return false;
  switch (a->kind) {
  case EV_OP:
    return rec_same_attrs(a->op, a->a, b->a);
  case EV_FULL:
  case EV_RAND:
    return a->a->dtype == b->a->dtype && a->a->ndim == b->a->ndim && a->a->flag == b->a->flag;
  case EV_DATA:
    /* the bytes are its last slot's (match_events) */
    if (a->a->dtype != b->a->dtype || a->a->ndim != b->a->ndim) return false;
    for (int i = 0; i < a->a->ndim; i++)
      if (a->a->shape[i].c != b->a->shape[i].c) return false;
    return true;
  case EV_NUMEL:
    return a->a->naxes == b->a->naxes && !memcmp(a->a->axes, b->a->axes, sizeof a->a->axes) && a->a->start.c == b->a->start.c &&
           a->a->dtype == b->a->dtype;
  case EV_CF:
  case EV_ARG:
  case EV_YIELD:
  case EV_GET:
    return a->a->k == b->a->k && a->a->dim == b->a->dim;
  case EV_INPLACE:
  case EV_BREAK:
  case EV_ESCAPE:
  case EV_DEAD:
    return true;
  }
  return false;
}

/* Whether the events [from, to) of the call match v's script, each number
 * by its slot rule: binds the arguments into argi/argf and the symbols
 * into vals. */
static bool match_events(call_state *cs, const variant *v, int from, int to, int64_t *vals, int64_t *argi, double *argf,
                         const void **argd, char *why, size_t whyn) {
  const recording *r = &cs->rec;
  if (to > v->n_ev) return snprintf(why, whyn, "the body did more than when variant %d was made", v->no), false;
  for (int i = from; i < to; i++) {
    const rec_event *a = &r->ev[i];
    if (!same_structure(r->ids, a, v->ids, &v->ev[i]))
      return snprintf(why, whyn, "%s:%d: the body did something else than when variant %d was made", a->file, a->line, v->no), false;
    rec_slot sa[2 * MAXD + 8];
    int n = rec_has_slots(a) ? rec_slots(a, sa, (int)(sizeof sa / sizeof sa[0])) : 0;
    if (n != v->rule_at[i + 1] - v->rule_at[i]) return snprintf(why, whyn, "%s:%d: other numbers (variant %d)", a->file, a->line, v->no), false;
    for (int k = 0; k < n; k++) {
      const slot_rule *rule = &v->rules[v->rule_at[i] + k];
      const rec_slot *sl = &sa[k];
      if (a->kind == EV_DATA && k == n - 1) {
        /* its bytes: the variant's, or passed at run time */
        if (rule->kind == SLOT_ARG) argd[rule->arg] = a->data;
        else if (memcmp(a->data, v->ev[i].data, rec_ev_bytes(a)))
          return snprintf(why, whyn, "%s:%d: a tensor made from C data holds other values than when variant %d was made", a->file,
                          a->line, v->no), false;
        continue;
      }
      if (rule->kind == SLOT_CONST) {
        if (sl->is_float ? !memcmp(&sl->f, &rule->v.f, sizeof sl->f) : sl->i == rule->v.i) continue;
        if (sl->is_float) {
          /* as many digits as tell them apart (0.003 and 0.003 are not one number) */
          char was[32], now[32];
          snprintf(was, sizeof was, "%g", rule->v.f);
          snprintf(now, sizeof now, "%g", sl->f);
          if (!strcmp(was, now)) snprintf(was, sizeof was, "%.17g", rule->v.f), snprintf(now, sizeof now, "%.17g", sl->f);
          snprintf(why, whyn, "%s:%d: a number was %s when variant %d was made, now %s", a->file, a->line, was, v->no, now);
        }
        else snprintf(why, whyn, "%s:%d: a number was %lld when variant %d was made, now %lld", a->file, a->line, (long long)rule->v.i, v->no, (long long)sl->i);
        return false;
      }
      if (rule->kind == SLOT_EXPR) {
        int64_t want;
        if (!sym_eval(rule->e, vals, v->n_syms, &want) && want == sl->i) continue;
        char t[128];
        if (sym_print(rule->e, t, sizeof t) < 0) snprintf(t, sizeof t, "?");
        snprintf(why, whyn, "%s:%d: a number stood for %s in variant %d, but is %lld here", a->file, a->line, t, v->no, (long long)sl->i);
        return false;
      }
      const build_arg *arg = &v->args[rule->arg];
      if (arg->is_float) {
        argf[rule->arg] = sl->f;
        continue;
      }
      const build_sym *sy = &v->syms[arg->sym];
      if (sl->i < sy->lo || sl->i > sy->hi)
        return snprintf(why, whyn, "%s:%d: %lld is outside s%d's range (variant %d)", a->file, a->line, (long long)sl->i, arg->sym, v->no), false;
      argi[rule->arg] = sl->i;
      vals[arg->sym] = sl->i;
    }
  }
  return true;
}

/* Whether two variants of as many leaves took them over storage the same
 * way: one made for x passed twice does not serve calls of x and y, so it
 * must not replace the variant that does (each call of the other kind then
 * compiled again). */
static bool same_sharing(const variant *a, const variant *b, int n_leaves) {
  if (a->n_params != b->n_params) return false;
  for (int i = 0; i < n_leaves; i++)
    if (a->alias[i] != b->alias[i] || (a->view_of && b->view_of && a->view_of[i] != b->view_of[i])) return false;
  return true;
}

/* Field by field: the structs have padding. */
static bool same_writes(const build_write *a, int na, const build_write *b, int nb) {
  if (na != nb) return false;
  for (int i = 0; i < na; i++)
    if (a[i].base != b[i].base || a[i].now != b[i].now || a[i].grad_set != b[i].grad_set || a[i].grad != b[i].grad ||
        a[i].when != b[i].when || a[i].when_bool != b[i].when_bool || a[i].else_none != b[i].else_none)
      return false;
  return true;
}

/* Whether two variants of as many segments write back the same leaves and .grads. */
static bool same_seg_writes(const variant *a, const variant *b) {
  for (int k = 0; k < a->n_seg; k++)
    if (!same_writes(a->seg[k]->writes, a->seg[k]->n_writes, b->seg[k]->writes, b->seg[k]->n_writes)) return false;
  return true;
}

/* Whether segment s of candidate c fits this call's segment. */
static bool match_segment(call_state *cs, int c, const seg_info *si, int64_t *argi, double *argf, const void **argd, char *why,
                          size_t whyn) {
  const variant *v = cs->cand[c];
  const recording *r = &cs->rec;
  int s = (int)(si - cs->seg);
  if (s >= v->n_seg) return snprintf(why, whyn, "the body went on past the end of variant %d", v->no), false;
  const segment *seg = v->seg[s];
  if (seg->from != si->from || seg->to != si->to) {
    if (seg->from != si->from || !seg->n_body || !si->n_body)
      return snprintf(why, whyn, "the body's data reads fell elsewhere than in variant %d", v->no), false;
    /* both end the call: the body did another number of things (a C branch) */
    for (int i = si->from; i < si->to && i < seg->to; i++)
      if (!same_structure(r->ids, &r->ev[i], v->ids, &v->ev[i]))
        return snprintf(why, whyn, "%s:%d: the body did something else than when variant %d was made", r->ev[i].file,
                        r->ev[i].line, v->no), false;
    return snprintf(why, whyn, "the body did %s than when variant %d was made", si->to > seg->to ? "more" : "less", v->no), false;
  }
  int64_t *vals = cs->cand_vals[c];
  if (!match_events(cs, v, si->from, si->to, vals, argi, argf, argd, why, whyn)) return false;
  if (seg->val_from != si->val_from || seg->val_to != si->val_to) return snprintf(why, whyn, "other values than variant %d", v->no), false;
  for (int i = si->val_from; i < si->val_to; i++) {
    const rec_value *a = &r->val[i], *b = &v->val[i];
    if (a->kind != b->kind || a->index != b->index || a->dtype != b->dtype || a->ndim != b->ndim ||
        (a->kind == RV_PARAM && memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim)))
      return snprintf(why, whyn, "a param or input other than variant %d's", v->no), false;
    /* a frozen segment holds its params' values: another tensor in their place is another graph */
    if (a->kind == RV_PARAM && seg->frozen && r->params[a->index] != v->params[b->index])
      return snprintf(why, whyn, "param %d is another tensor than the one frozen into variant %d", b->index, v->no), false;
  }
  if (si->n_out != seg->n_out || memcmp(si->out, seg->out, sizeof(int) * (size_t)si->n_out))
    return snprintf(why, whyn, "the body keeps other tensors than when variant %d was made", v->no), false;
  if (!same_writes(si->writes, si->n_writes, seg->writes, seg->n_writes))
    return snprintf(why, whyn, "the body writes other leaves or .grads than when variant %d was made", v->no), false;
  /* the same sharing of storage between the leaves */
  int n_leaves = r->n_in + r->n_params, small[64];
  int *alias = n_leaves < 64 ? small : alloc_malloc(sizeof(int) * (size_t)(n_leaves + 1));
  if (!alias) return snprintf(why, whyn, "out of memory"), false;
  alias_pattern(r->in, r->n_in, r->params, r->n_params, alias);
  bool same = true;
  for (int i = 0; i < n_leaves && i < r->n_in + v->n_params && same; i++) same = alias[i] == v->alias[i];
  if (alias != small) alloc_free(alias);
  if (!same) return snprintf(why, whyn, "leaves share storage unlike in variant %d", v->no), false;
  return guards_hold(seg->g, vals, v->n_syms, why, whyn, v->no) == 1;
}

/* Runs a compiled segment on this call's tensors; out: seg->n_out new tensors. 0 or -1. */
/* A segment's inputs for this call: the call's, then its extras (values
 * carried from earlier segments, and the arguments argi/argf, made into
 * tensors in own[]), and its params. 0, or -1 with the error set. */
typedef struct seg_inputs {
  kiln_tensor **ins, **ps;
  kiln_tensor *ins_in[16], *ps_in[32]; /* ins and ps in place when few: no allocation a call */
  kiln_tensor *own[64];
  int n_own;
} seg_inputs;

static void seg_inputs_free(seg_inputs *si) {
  for (int i = 0; i < si->n_own; i++) kiln_release(si->own[i]);
  if (si->ins != si->ins_in) alloc_free(si->ins);
  if (si->ps != si->ps_in) alloc_free(si->ps);
  si->ins = si->ps = NULL;
  si->n_own = 0;
}

static int seg_inputs_make(call_state *cs, const segment *seg, const build_arg *args, const int64_t *argi,
                           const double *argf, seg_inputs *si) {
  recording *r = &cs->rec;
  int n_in = r->n_in, rc = -1, n_ins = n_in + seg->n_extra;
  si->n_own = 0;
  si->ins = n_ins < 16 ? si->ins_in : alloc_malloc(sizeof *si->ins * (size_t)(n_ins + 1));
  si->ps = seg->n_params < 32 ? si->ps_in : alloc_malloc(sizeof *si->ps * (size_t)(seg->n_params + 1));
  rec_leaf *leaves = NULL;
  int n_leaves = 0;
  /* the leaves only to find the values carried in */
  if (!si->ins || !si->ps || (seg->n_extra && rec_leaves(r, &leaves, &n_leaves))) {
    err_set("", 0, "call", "%s: out of memory", cs->fn->name);
    goto done;
  }
  for (int i = 0; i < n_in; i++) si->ins[i] = (kiln_tensor *)r->in[i];
  for (int i = 0; i < seg->n_extra; i++) {
    int x = seg->extra[i];
    kiln_tensor *t = NULL;
    if (x >= 0) {
      for (int j = 0; j < n_leaves && !t; j++)
        if (r->val[leaves[j].base].kind == RV_CARRY && r->val[leaves[j].base].index == x) t = leaves[j].t;
      if (!t) {
        err_set("", 0, "call", "%s: a value carried from an earlier segment is gone", cs->fn->name);
        goto done;
      }
    } else {
      const build_arg *a = &args[-1 - x];
      t = a->is_data ? tensor_new(a->dtype, a->ndim, a->shape) : tensor_new(a->is_float ? a->dtype : KILN_I64, 0, NULL);
      if (!t || si->n_own == 64) {
        kiln_release(t);
        err_set("", 0, "call", "%s: out of memory", cs->fn->name);
        goto done;
      }
      if (a->is_data) memcpy(t->st->data, cs->argd[-1 - x], t->st->bytes);
      else if (a->is_float) pw_fill(t, argf[-1 - x]);
      else *(int64_t *)t->st->data = argi[-1 - x];
      si->own[si->n_own++] = t;
    }
    si->ins[n_in + i] = t;
  }
  for (int i = 0; i < seg->n_params; i++) si->ps[i] = r->params[seg->params[i]];
  rc = 0;
done:
  alloc_free(leaves);
  if (rc) seg_inputs_free(si);
  return rc;
}

/* Whether a cached segment takes this call's inputs: its events matched, but
 * the values carried into it come from segments that may have run from
 * another variant, and their shapes must bind with the arguments as its
 * graph says. */
static bool seg_binds(call_state *cs, const segment *seg, const build_arg *args, const int64_t *argi,
                      const double *argf, char *why, size_t whyn, int no) {
  bool any = false;
  for (int i = 0; i < seg->n_extra && !any; i++) any = seg->extra[i] >= 0;
  if (!any) return true;
  seg_inputs si;
  if (seg_inputs_make(cs, seg, args, argi, argf, &si)) return snprintf(why, whyn, "%s", kiln_last_error()), false;
  int64_t vals[IR_MAX_SYMS];
  char err[256];
  bool ok = ir_bind_syms(seg->g, NULL, 0, si.ins, si.ps, vals, err, sizeof err) == 0;
  if (!ok) snprintf(why, whyn, "values carried across a graph break do not fit variant %d (%s)", no, err);
  seg_inputs_free(&si);
  return ok;
}

static int run_segment(call_state *cs, const segment *seg, const build_arg *args, kiln_tensor **out) {
  seg_inputs si;
  if (seg_inputs_make(cs, seg, args, cs->argi, cs->argf, &si)) return -1;
  int rc = seg->be->run(seg->exec, si.ins, si.ps, out);
  seg_inputs_free(&si);
  return rc;
}
static void materialize(const segment *seg, kiln_tensor **outs, const rec_live *live, int n_live) {
  for (int i = 0; i < n_live; i++) {
    storage *st = live[i].st;
    if (!st || !st->meta) continue;
    for (int j = 0; j < seg->n_out; j++) {
      if (seg->out[j] != live[i].value || !outs[j]) continue;
      storage *src = outs[j]->st;
      /* the output alone holds its data (the runtime may hand one tensor out twice): the data moves */
      if (src->bytes == st->bytes && src->data && outs[j]->offset == 0 && tensor_contiguous(outs[j]) &&
          atomic_load(&src->refcount) == 1 && tensor_refs(outs[j]) == 1) {
        storage_steal(st, src);
      } else {
        /* shared or strided: copied */
        void *data = alloc_aligned((st->bytes + 63) & ~(size_t)63);
        if (!data) break;
        storage tmp = {.data = data, .bytes = st->bytes};
        kiln_tensor dst = {.dtype = outs[j]->dtype, .ndim = outs[j]->ndim, .st = &tmp};
        memcpy(dst.shape, outs[j]->shape, sizeof dst.shape);
        contiguous_strides(dst.ndim, dst.shape, dst.stride);
        pw_copy(&dst, outs[j]);
        storage_materialize(st, data);
      }
      break;
    }
  }
}

/* The body's outputs that still have no data get their own: the segment's
 * value of each (a view of a storage nobody else holds becomes a tensor of
 * its own, contiguous, with the same values). */
static void give_outputs(call_state *cs, const segment *seg, kiln_tensor **outs) {
  /* outputs that view another output eagerly (out[1] = a reshape of
   * out[0]) view it here too: the one that covers their shared storage
   * gets data first, the others then see its storage through their own
   * layout, which is eager's */
  int n = seg->n_body, small[16], *owner = n <= 16 ? small : alloc_malloc(sizeof(int) * (size_t)n);
  for (int i = 0; owner && i < n; i++) {
    owner[i] = -1;
    const kiln_tensor *t = cs->out_t[i];
    /* the first output that covers the storage is its owner */
    for (int k = 0; k < n && owner[i] < 0 && t->st->meta; k++)
      if (cs->out_t[k]->st == t->st && tensor_covers_storage(cs->out_t[k]) && outs[k]) owner[i] = k;
    if (owner[i] == i || (owner[i] >= 0 && cs->out_t[owner[i]] == t)) owner[i] = -1;
  }
  storage *meta_s[16], **meta = !owner ? NULL : n <= 16 ? meta_s : alloc_malloc(sizeof *meta * (size_t)(n + 1));
  for (int i = 0; meta && i < n; i++) meta[i] = cs->out_t[i]->st;
  if (!meta && owner) {
    if (owner != small) alloc_free(owner);
    owner = NULL;
  }
  for (int i = 0; i < n; i++) {
    kiln_tensor *t = cs->out_t[i];
    if (!t->st->meta || !outs[i] || (owner && owner[i] >= 0)) continue;
    kiln_tensor *v = outs[i];
    storage *own = v->st;
    if (atomic_load(&own->refcount) != 1 || tensor_refs(v) != 1 || v->offset || !tensor_contiguous(v)) {
      /* shared with another output, or strided: a copy of its own */
      kiln_tensor *c = op_run(OP_COPY, &v, 1, NULL, "", 0);
      if (!c) continue;
      kiln_release(outs[i]);
      outs[i] = v = c;
      own = v->st;
    }
    storage *old = t->st;
    t->st = own;
    atomic_fetch_add(&own->refcount, 1);
    t->offset = 0;
    contiguous_strides(t->ndim, t->shape, t->stride);
    storage_release_ref(old);
  }
  for (int i = 0; owner && i < n; i++) {
    int k = owner[i];
    kiln_tensor *t = cs->out_t[i];
    if (k < 0 || t->st != meta[i] || cs->out_t[k]->st->meta) continue;
    storage *old = t->st;
    t->st = cs->out_t[k]->st; /* offset and strides stay: the owner is laid out as eagerly */
    atomic_fetch_add(&t->st->refcount, 1);
    storage_release_ref(old);
  }
  /* an output the owner could not serve (it got no data) keeps the meta storage: copy it as before */
  for (int i = 0; owner && i < n; i++) {
    kiln_tensor *t = cs->out_t[i];
    if (owner[i] < 0 || !t->st->meta || !outs[i]) continue;
    kiln_tensor *c = op_run(OP_COPY, &outs[i], 1, NULL, "", 0);
    if (!c) continue;
    storage *old = t->st;
    t->st = c->st;
    atomic_fetch_add(&t->st->refcount, 1);
    t->offset = 0;
    contiguous_strides(t->ndim, t->shape, t->stride);
    storage_release_ref(old);
    kiln_release(c);
  }
  if (owner != small) alloc_free(owner);
  if (meta != meta_s) alloc_free(meta);
}

/* A .grad the body kept a handle to (g = kiln_retain(kiln_grad(w))) is that
 * handle after the call, as eagerly, not a copy beside it: a later write
 * through the handle (clipping, scaling) must reach the .grad. The handle got
 * its data from the same value as the write: leaf's .grad, which the run
 * just set, or an output's (the body returned the .grad). */
static void keep_grad_handle(kiln_tensor *leaf, kiln_tensor *g) {
  if (!g || !leaf || !leaf->grad || g == leaf->grad || !tensor_covers_storage(g) || g->dtype != leaf->grad->dtype ||
      g->ndim != leaf->grad->ndim || memcmp(g->shape, leaf->grad->shape, sizeof(int64_t) * (size_t)g->ndim))
    return;
  if (g->st->meta) {
    /* a handle the body borrowed (gw = kiln_grad(w), not retained): only
     * the recording held it, so it got no data, and the next segment would
     * have dropped it, leaving the body's pointer dangling and its writes
     * through it (gradient clipping) lost. Eagerly it is the .grad: it
     * takes the data the segment wrote there */
    kiln_tensor *now = leaf->grad;
    if (!tensor_covers_storage(now)) return;
    storage *old = g->st;
    g->st = now->st;
    atomic_fetch_add(&g->st->refcount, 1);
    g->offset = now->offset;
    memcpy(g->stride, now->stride, sizeof(int64_t) * (size_t)g->ndim);
    storage_release_ref(old);
  }
  kiln_release(leaf->grad);
  leaf->grad = kiln_retain(g);
}

static void grads_keep_handles(call_state *cs, const seg_info *si) {
  recording *r = &cs->rec;
  for (int i = 0; i < si->n_writes; i++) {
    const build_write *w = &si->writes[i];
    if (w->grad_set && w->grad >= 0 && w->when < 0) keep_grad_handle(rec_tensor_of(r, w->base), rec_tensor_of(r, w->grad));
  }
}

/* Whether segment s (graph g) writes memory that another of its leaves
 * also is, so that codegen must store no write early (g->leaves_share):
 * a written input or param sharing storage with another leaf, or any
 * write in a segment with values carried in from an earlier one (a view
 * of a param, say, which the sharing pattern does not hold). A read-only
 * input passed twice is fine. -1 on out of memory. */
static int writes_share_memory(const recording *r, const segment *s, const ir_graph *g, bool *share) {
  *share = false;
  for (int i = 0; i < s->n_extra && g->n_writes; i++) *share |= s->extra[i] >= 0;
  int nl = r->n_in + r->n_params, small[64], *alias = nl < 32 ? small : alloc_malloc(sizeof(int) * (size_t)(2 * nl + 1));
  if (!alias) return -1;
  int *written = alias + nl; /* per group (the first leaf of a storage): whether a leaf of it is written */
  alias_pattern(r->in, r->n_in, r->params, r->n_params, alias);
  for (int i = 0; i < nl; i++) written[i] = 0;
  for (int w = 0; w < g->n_writes; w++) {
    if (g->writes[w].kind != IR_WRITE_DATA) continue;
    const ir_node *t = &g->nodes[g->writes[w].target];
    /* a param node's index counts this segment's params */
    int leaf = -1;
    if (t->op == IR_INPUT && t->index < r->n_in) leaf = t->index;
    else if (t->op == IR_PARAM && t->index < s->n_params && s->params[t->index] < r->n_params) leaf = r->n_in + s->params[t->index];
    if (leaf < 0) *share = true; /* a leaf not among these */
    else written[alias[leaf]] = 1;
  }
  for (int i = 0; i < nl && !*share; i++) *share = alias[i] != i && written[alias[i]];
  if (alias != small) alloc_free(alias);
  return 0;
}

/* Builds, cleans and compiles the call's segment si for the new variant. 0 or -1 (error set). */
static int compile_new_segment(call_state *cs, const seg_info *si) {
  kiln_fn *fn = cs->fn;
  double t0 = now_ms();
  build_seg bs;
  if (build_segment(&cs->b, si->from, si->to, si->out, si->n_out, si->writes, si->n_writes, &bs)) {
    err_set("", 0, "call", "%s: %s", fn->name, cs->b.why);
    build_seg_free(&bs);
    return -1;
  }
  segment **nsegs = alloc_realloc(cs->segs, sizeof *nsegs * (size_t)(cs->n_segs + 1));
  segment *s = alloc_calloc(1, sizeof *s);
  if (!nsegs || !s) {
    if (nsegs) cs->segs = nsegs;
    alloc_free(s);
    build_seg_free(&bs);
    return err_set("", 0, "call", "%s: out of memory", fn->name), -1;
  }
  cs->segs = nsegs;
  cs->segs[cs->n_segs++] = s;
  *s = (segment){.refs = 1, .from = si->from, .to = si->to, .val_from = si->val_from, .val_to = si->val_to,
                 .n_extra = bs.n_extra, .extra = bs.extra, .n_params = bs.n_params, .params = bs.params,
                 .n_out = bs.n_out, .out = bs.out, .n_body = si->n_body, .frozen = bs.frozen};
  bs.extra = bs.params = bs.out = NULL;
  if (si->n_writes) {
    if (!(s->writes = alloc_malloc(sizeof *s->writes * (size_t)si->n_writes))) {
      build_seg_free(&bs);
      return err_set("", 0, "call", "%s: out of memory", fn->name), -1;
    }
    memcpy(s->writes, si->writes, sizeof *s->writes * (size_t)si->n_writes);
    s->n_writes = si->n_writes;
  }
  ir_graph *traced = bs.g;
  bs.g = NULL;
  build_seg_free(&bs);
  if (fn->dump & KILN_DUMP_TRACE) dump_graph(fn, traced, "trace", cs->no);
  char err[512] = "";
  ir_graph *g = pass_pipeline(traced, err, sizeof err);
  double t1 = now_ms();
  cs->passes_ms += t1 - t0;
  if (!g) return err_set("", 0, "call", "%s: %s", fn->name, err[0] ? err : "out of memory"), -1;
#ifdef KILN_TEST_BUILD
  /* every graph a test makes must print, parse and print to the same text */
  {
    char *txt = ir_to_string(g), perr[256] = "";
    ir_graph *back = txt ? ir_parse(txt, perr, sizeof perr) : NULL;
    char *t2 = back ? ir_to_string(back) : NULL;
    bool oom = !txt || (!back && strstr(perr, "out of memory")) || (back && !t2);
    if (!oom && (!back || strcmp(txt, t2))) {
      fprintf(stderr, "kiln: internal: the graph of %s does not round-trip (%s)\n%s\n---\n%s\n", fn->name, perr, txt, t2 ? t2 : "");
      KILN_ASSERT(!"print/parse round trip");
    }
    alloc_free(txt);
    alloc_free(t2);
    ir_free(back);
  }
#endif
  s->g = g;
  if (writes_share_memory(&cs->rec, s, g, &g->leaves_share)) return err_set("", 0, "call", "%s: out of memory", fn->name), -1;
  if (fn->dump & KILN_DUMP_GRAPH) dump_graph(fn, g, "graph", cs->no);
  s->be = cs->uncached ? &backend_interp : fn->be;
  FILE *bdump = fn->dump & (KILN_DUMP_KERNELS | KILN_DUMP_LLVM | KILN_DUMP_ASM) ? dump_open(fn, "kernels", cs->no) : stderr;
  s->exec = s->be->compile(g, fn->dump, bdump, err, sizeof err);
  if (bdump != stderr) fclose(bdump);
  if (!s->exec && s->be != &backend_interp) {
    /* never a crash or a wrong answer: the interpreter runs what LLVM could not */
    fprintf(stderr, "kiln: warning: %s: the %s backend failed (%s); this variant runs on the interpreter\n", fn->name,
            s->be->name, err);
    dump_note(fn, "%s backend failed: %s; interpreter instead", s->be->name, err);
    s->be = &backend_interp;
    s->exec = s->be->compile(g, fn->dump, stderr, err, sizeof err);
  }
  if (!s->exec) return err_set("", 0, "call", "%s: %s", fn->name, err), -1;
  cs->compile_ms += now_ms() - t1;
  if (s->be->times) {
    double a, b, c;
    s->be->times(s->exec, &a, &b, &c);
    cs->front_ms += a, cs->opt_ms += b, cs->machine_ms += c;
  }
  return 0;
}

/* The arguments of the new variant's segment: this call's numbers at its argument slots. */
static void bind_new_args(call_state *cs, const seg_info *si) {
  const build_state *b = &cs->b;
  for (int i = si->from; i < si->to; i++) {
    rec_slot sl[2 * MAXD + 8];
    int n = rec_slots(&cs->rec.ev[i], sl, (int)(sizeof sl / sizeof sl[0]));
    for (int k = 0; k < n && b->rule_at[i] + k < b->n_rules; k++) {
      const slot_rule *rule = &b->rules[b->rule_at[i] + k];
      if (rule->kind != SLOT_ARG) continue;
      if (b->args[rule->arg].is_data) cs->argd[rule->arg] = cs->rec.ev[i].data;
      else if (b->args[rule->arg].is_float) cs->argf[rule->arg] = sl[k].f;
      else cs->argi[rule->arg] = sl[k].i;
    }
  }
}

/* How far the call's log has v's structure. */
static int aligned_with(const recording *r, const variant *v) {
  int k = 0;
  while (k < r->n_ev && k < v->n_ev && same_structure(r->ids, &r->ev[k], v->ids, &v->ev[k])) k++;
  return k;
}

/* The first event of the call whose number differs from a constant of v's
 * (v's events aligned with the call's), or -1. */
static int const_changed(const recording *r, const variant *v) {
  for (int i = 0; i < r->n_ev && i < v->n_ev; i++) {
    const rec_event *e = &r->ev[i];
    rec_slot sl[2 * MAXD + 8];
    int n = rec_has_slots(e) ? rec_slots(e, sl, (int)(sizeof sl / sizeof sl[0])) : 0;
    for (int k = 0; k < n && k < v->rule_at[i + 1] - v->rule_at[i]; k++) {
      const slot_rule *rule = &v->rules[v->rule_at[i] + k];
      if (rule->kind != SLOT_CONST) continue;
      /* C data's bytes, a constant of v (past the arguments a call passes) */
      if (e->kind == EV_DATA && k == n - 1) {
        if (memcmp(e->data, v->ev[i].data, rec_ev_bytes(e))) return i;
        continue;
      }
      if (sl[k].is_float ? memcmp(&sl[k].f, &rule->v.f, sizeof sl[k].f) : sl[k].i != rule->v.i) return i;
    }
  }
  return -1;
}

/* Whether the inputs have the shapes v was traced with: a number that then
 * changes is no size's. */
static bool traced_shapes(const kiln_fn *fn, const variant *v, kiln_tensor *const *in) {
  for (int i = 0; i < fn->opts.n_in && i < MAX_IN; i++)
    if (in[i]->ndim != v->in_ndim[i] || memcmp(in[i]->shape, v->in_shape[i], sizeof(int64_t) * (size_t)in[i]->ndim)) return false;
  return true;
}

/* Whether event ev's slots that are constants of old are constants of nv
 * too (nothing there became an argument). */
static bool still_const(const variant *old, const variant *nv, int ev) {
  int n = old->rule_at[ev + 1] - old->rule_at[ev];
  if (n != nv->rule_at[ev + 1] - nv->rule_at[ev]) return false;
  for (int k = 0; k < n; k++)
    if (old->rules[old->rule_at[ev] + k].kind == SLOT_CONST && nv->rules[nv->rule_at[ev] + k].kind != SLOT_CONST) return false;
  return true;
}

/* How many times the constant at event ev changed without becoming an argument (fn->mu held). */
static int futile_count(const kiln_fn *fn, int ev) {
  for (int i = 0; ev >= 0 && i < 8; i++)
    if (fn->futile[i].n && fn->futile[i].ev == ev) return fn->futile[i].n;
  return 0;
}

/* Starts the new variant: the build_state, told about the variant the call
 * followed the longest (its numbers tell literals from sizes). */
static int start_building(call_state *cs) {
  kiln_fn *fn = cs->fn;
  recording *r = &cs->rec;
  next_spec(fn, cs->in, cs->dyn);
  const variant *best = cs->prev_var;
  int best_len = best ? aligned_with(r, best) : -1;
  for (int c = 0; c < cs->n_cand; c++) {
    int k = aligned_with(r, cs->cand[c]);
    if (k > best_len) best = cs->cand[c], best_len = k;
  }
  /* a call that differs from a variant only in a number that changed twice
   * already and stayed a constant each time (an op's attribute computed
   * anew every call) would compile at every call: it runs on the interpreter */
  int changed = best && best != cs->prev_var && best_len == r->n_ev && traced_shapes(fn, best, cs->in) ? const_changed(r, best) : -1;
  pthread_mutex_lock(&fn->mu);
  cs->no = ++fn->dump_seq;
  cs->uncached = fn->n_variants >= fn->opts.max_variants;
  bool storm = !cs->uncached && futile_count(fn, changed) >= 2;
  bool warn = storm && !fn->warned_futile;
  fn->warned_futile |= storm;
  cs->uncached |= storm;
  cs->storm = storm;
  pthread_mutex_unlock(&fn->mu);
  if (warn)
    fprintf(stderr, "kiln: warning: %s (compiled at %s:%d): the number at %s:%d changes from call to call but stays a constant "
            "of the graph (part of an op, or past the numbers a call passes at run time): calls that bring a new value "
            "run on the interpreter instead of compiling each time\n", fn->name, fn->file, fn->line, r->ev[changed].file, r->ev[changed].line);
  if (best)
    cs->prev = (build_prev){.ev = best->ev, .n_ev = best->n_ev, .aligned = best_len, .n_in = r->n_in,
                            .in_ndim = best->in_ndim, .in_shape = (const int64_t(*)[MAXD])best->in_shape,
                            .rules = best->rules, .rule_at = best->rule_at};
  if (build_begin(&cs->b, r, (const uint8_t(*)[MAXD])cs->dyn, fn->opts.freeze != 0, best ? &cs->prev : NULL))
    return err_set("", 0, "call", "%s: out of memory", fn->name), -1;
  snprintf(cs->b.name, sizeof cs->b.name, "%s", fn->name);
  cs->building = true;
  /* the segments that ran already are built too: the new variant starts with them */
  for (int k = 0; k < cs->n_seg; k++)
    if (compile_new_segment(cs, &cs->seg[k])) return -1;
  /* the new variant numbers its arguments its own way: every one gets this call's value */
  for (int k = 0; k < cs->n_seg; k++) bind_new_args(cs, &cs->seg[k]);
  return 0;
}

/* The leaves a segment writes back, from the recording. */
static int leaf_writes(recording *r, build_write **out, int *n) {
  rec_leaf *leaves;
  int nl;
  *out = NULL;
  *n = 0;
  if (rec_leaves(r, &leaves, &nl)) return -1;
  build_write *w = alloc_malloc(sizeof *w * (size_t)(nl + 1));
  if (!w) {
    alloc_free(leaves);
    return -1;
  }
  int k = 0;
  for (int i = 0; i < nl; i++) {
    const rec_leaf *l = &leaves[i];
    bool data = l->now >= 0 && l->now != l->base, grad = l->grad != l->grad0;
    if (!data && !grad) continue;
    int gv = grad && l->grad ? rec_value_of(r, l->grad) : -1;
    if (grad && l->grad && gv < 0) {
      alloc_free(leaves);
      alloc_free(w);
      return -1;
    }
    const kiln_tensor *lg = grad ? l->grad : NULL;
    int when = lg && lg->grad_if ? rec_value_of(r, lg->grad_if) : -1;
    /* a .grad the call dropped (or found NULL) stays NULL where the condition fails; one it
     * found set stays as it was (a skipped write): none is written only where they differ */
    w[k++] = (build_write){l->base, data ? l->now : l->base, grad, gv, when, when >= 0 && (lg->grad_if_kind & GRAD_IF_TRUE),
                           when >= 0 && (lg->grad_if_kind & GRAD_IF_FROM_NULL) && l->grad0};
  }
  alloc_free(leaves);
  *out = w;
  *n = k;
  return 0;
}

static void check_params(const kiln_fn *fn, kiln_tensor *const *ps, int n);
static void check_escaped(const kiln_fn *fn);

/* The recording's callback: runs the events since the last break (or, last,
 * up to the end of the body) as a segment, and gives the live values their data. */
static int seg_run(recording *r, void *ctx, bool last) {
  call_state *cs = ctx;
  kiln_fn *fn = cs->fn;
  if (!last) {
    const rec_event *br = &r->ev[r->n_ev - 1];
    if (br->kind == EV_ESCAPE) {
      /* most escapes say where they are already */
      char at[300];
      snprintf(at, sizeof at, "%s:%d:", br->file, br->line);
      if (!*br->file || !strncmp(r->why, at, strlen(at))) dump_line(fn, KILN_DUMP_BREAKS, "breaks", "%s", r->why);
      else dump_line(fn, KILN_DUMP_BREAKS, "breaks", "%s %s", at, r->why);
    } else
      dump_line(fn, KILN_DUMP_BREAKS, "breaks", "%s:%d: %s reads data inside the body: the ops before it run as a segment",
                br->file, br->line, r->reader ? r->reader : "a call");
    if (fn->opts.fullgraph) {
      if (br->kind == EV_ESCAPE) return err_set(br->file, br->line, "call", "%s: %s (fullgraph is on)", fn->name, r->why), -1;
      return err_set(br->file, br->line, "call", "%s: %s reads data here, which breaks the graph (fullgraph is on)", fn->name,
                     r->reader ? r->reader : "a call"),
             -1;
    }
  }
  if (cs->n_seg == 64) return err_set("", 0, "call", "%s: more than 63 graph breaks in one call", fn->name), -1;
  rec_pause(r);
  int rc = -1;
  rec_live *live = NULL;
  int n_live = 0;
  kiln_tensor **outs = NULL, *outs_small[16]; /* a segment's results, in place when few */
  const segment *seg = NULL;
  const build_arg *args = NULL;
  seg_info *si = &cs->seg[cs->n_seg];
  *si = (seg_info){.from = r->seg_start, .to = r->n_ev, .val_from = cs->val_start, .n_body = last ? fn->opts.n_out : 0};
  cs->n_seg++; /* counted now: call_free frees what it holds */
  /* the writes first (they name the .grads the body set), then the .grads back as they were */
  if (leaf_writes(r, &si->writes, &si->n_writes)) goto fail;
  if (last) rec_strip_history(r);
  rec_restore_grads(r);
  if (rec_live_values(r, last ? cs->out_t : NULL, last ? fn->opts.n_out : 0, &live, &n_live)) goto fail;
  if (last) cs->kept_live = n_live > 0;
  si->val_to = r->n_val;
  si->out = alloc_malloc(sizeof(int) * (size_t)(si->n_body + n_live + 1));
  if (!si->out) goto fail;
  for (int i = 0; i < si->n_body; i++) si->out[si->n_out++] = cs->outs[i];
  for (int i = 0; i < n_live; i++) {
    bool dup = false;
    for (int j = 0; j < si->n_out && !dup; j++) dup = si->out[j] == live[i].value;
    if (!dup) si->out[si->n_out++] = live[i].value;
  }
  if (!cs->building) {
    /* every candidate still alive is held to this segment (a later one may
     * part from the first that matches); the first that matches runs it */
    char why[512];
    why[0] = 0;
    int64_t argi[IR_MAX_SYMS];
    double argf[IR_MAX_SYMS];
    const void *argd[IR_MAX_SYMS];
    for (int c = 0; c < cs->n_cand; c++) {
      if (!cs->alive[c]) continue;
      bool first = !seg;
      cs->alive[c] = match_segment(cs, c, si, first ? cs->argi : argi, first ? cs->argf : argf, first ? cs->argd : argd, why,
                                   sizeof why);
      const variant *v = cs->cand[c];
      if (cs->alive[c] && first && !seg_binds(cs, v->seg[cs->n_seg - 1], v->args, cs->argi, cs->argf, why, sizeof why, v->no))
        cs->alive[c] = false;
      if (!cs->alive[c]) add_why(cs->why, sizeof cs->why, why);
      if (cs->alive[c] && first) {
        seg = v->seg[cs->n_seg - 1];
        args = v->args;
        if (cs->n_seg == 1) cs->ran = cs->cand[c];
      }
    }
    if (!seg && start_building(cs)) goto done;
  } else if (compile_new_segment(cs, si)) {
    goto done;
  }
  if (cs->building) {
    seg = cs->segs[cs->n_segs - 1];
    args = cs->b.args;
    bind_new_args(cs, si);
  }
  outs = seg->n_out < 16 ? memset(outs_small, 0, sizeof outs_small) : alloc_calloc((size_t)seg->n_out + 1, sizeof *outs);
  if (!outs) goto fail;
  check_params(fn, r->params, r->n_params);
  if (run_segment(cs, seg, args, outs)) goto done;
  materialize(seg, outs, live, n_live);
  grads_keep_handles(cs, si);
  if (last) give_outputs(cs, seg, outs);
  rc = 0;
  goto done;
fail:
  if (r->failed) err_set("", 0, "call", "%s: %s", fn->name, r->why);
  else err_set("", 0, "call", "%s: out of memory", fn->name);
done:
  for (int i = 0; outs && seg && i < seg->n_out; i++) kiln_release(outs[i]);
  if (outs != outs_small) alloc_free(outs);
  alloc_free(live);
  if (!last && !r->escaped) {
    if (rc == 0) {
      rec_next_segment(r);
      cs->val_start = r->n_val;
    }
    rec_resume(r);
  }
  return rc;
}

static void call_free(call_state *cs) {
  kiln_fn *fn = cs->fn;
  for (int i = 0; i < cs->n_seg; i++) {
    alloc_free(cs->seg[i].out);
    alloc_free(cs->seg[i].writes);
  }
  for (int i = 0; i < cs->n_segs; i++) segment_free(cs->segs[i]);
  alloc_free(cs->segs);
  if (cs->building) build_free(&cs->b);
  struct rec_state *spare = rec_keep(&cs->rec);
  pthread_mutex_lock(&fn->mu);
  if (!fn->spare) fn->spare = spare, spare = NULL;
  variant *gone[2 * 64 + 1];
  int n_gone = 0;
  for (int c = 0; c <= cs->n_cand; c++) {
    variant *v = c < cs->n_cand ? cs->cand[c] : cs->prev_var;
    if (v && --v->users == 0 && v->dead && n_gone < (int)(sizeof gone / sizeof gone[0])) gone[n_gone++] = v;
  }
  pthread_mutex_unlock(&fn->mu);
  for (int i = 0; i < n_gone; i++) variant_free(gone[i]);
  if (cs->cand != cs->cand_in) alloc_free(cs->cand);
  if (cs->alive != cs->alive_in) alloc_free(cs->alive);
  if (cs->cand_vals != cs->cand_vals_in) alloc_free(cs->cand_vals);
  if (cs->outs != cs->outs_in) alloc_free(cs->outs);
  rec_spare_free(spare);
}

/* Whether the body kept a reference to an input, an output or a .grad
 * beyond the call (m->saved = kiln_retain(in[0])): C that a call skipping
 * the body skips. An output that is the leaf itself holds one reference of
 * its own. Params are left out: another thread's call reaching the same
 * weights meanwhile holds references to them too, which would read as kept
 * (the guide says a body must not keep a weight on the guard-only path). */
static bool leaves_kept(const recording *r, kiln_tensor *const *out, int n_out) {
  for (int i = 0; i < r->n_in && i < 64; i++) {
    uint32_t want = r->in_refs[i];
    for (int k = 0; k < n_out; k++) want += out[k] == r->in[i];
    if (tensor_refs(r->in[i]) > want) return true;
  }
  /* an output the body made and also keeps (m->last = kiln_retain(y)); a
   * scope's reference (kiln_keep into the caller's scope) is no store */
  for (int i = 0; i < n_out; i++) {
    if (!out[i] || out[i]->rec_call != r->id) continue;
    uint32_t want = (uint32_t)rec_holds(r, out[i]) + tensor_scope_refs(out[i]);
    for (int k = 0; k < n_out; k++) want += out[k] == out[i];
    if (tensor_refs(out[i]) > want) return true;
  }
  /* a view the body made of an input or param and keeps (its data is the leaf's) */
  return rec_views_kept(r, out, n_out) || rec_grads_kept(r);
}

/* Whether an output views memory the call writes without being the written
 * leaf itself (a transpose of an input written in place): the guard-only
 * path could only hand back a copy, where eagerly a write into the output
 * reaches the leaf. */
static bool outputs_view_written(const recording *r, const segment *seg, kiln_tensor *const *out, int n_out) {
  for (int w = 0; w < seg->n_writes; w++) {
    const build_write *bw = &seg->writes[w];
    if (bw->now < 0 || bw->now == bw->base) continue; /* its data unwritten */
    const rec_value *rv = &r->val[bw->base];
    kiln_tensor *leaf = rv->kind == RV_INPUT ? r->in[rv->index] : rv->kind == RV_PARAM ? r->params[rv->index] : NULL;
    for (int i = 0; leaf && i < n_out; i++)
      if (out[i] && out[i] != leaf && out[i]->st == leaf->st) return true;
  }
  return false;
}

/* The new variant, from this call's log and segments; NULL on out of memory. */
static variant *make_variant(call_state *cs) {
  kiln_fn *fn = cs->fn;
  recording *r = &cs->rec;
  build_state *b = &cs->b;
  variant *v = alloc_calloc(1, sizeof *v);
  if (!v) return NULL;
  v->no = cs->no;
  v->grad_on = cs->grad_on;
  v->backward = cs->backward;
  v->layout_in = r->layout_in;
  v->n_ev = r->n_ev;
  v->n_val = r->n_val;
  v->ev = alloc_malloc(sizeof *v->ev * (size_t)(r->n_ev + 1));
  v->ids = alloc_malloc(sizeof *v->ids * (size_t)(r->n_ids + 1));
  v->val = alloc_malloc(sizeof *v->val * (size_t)(r->n_val + 1));
  v->rules = alloc_malloc(sizeof *v->rules * (size_t)(b->n_rules + 1));
  v->rule_at = alloc_malloc(sizeof *v->rule_at * (size_t)(r->n_ev + 1));
  v->args = alloc_malloc(sizeof *v->args * (size_t)(b->n_args + 1));
  v->seg = alloc_malloc(sizeof *v->seg * (size_t)(cs->n_segs + 1));
  v->params = alloc_calloc((size_t)r->n_params + 1, sizeof *v->params);
  v->alias = alloc_malloc(sizeof *v->alias * (size_t)(r->n_in + r->n_params + 1));
  v->view_of = alloc_malloc(sizeof *v->view_of * (size_t)(r->n_in + r->n_params + 1));
  v->in_dims = alloc_calloc((size_t)fn->opts.n_in + 1, sizeof *v->in_dims);
  v->in_leaf = alloc_calloc((size_t)fn->opts.n_in + 1, sizeof *v->in_leaf);
  v->param_leaf = alloc_calloc((size_t)r->n_params + 1, sizeof *v->param_leaf);
  v->data = alloc_calloc((size_t)r->n_ev + 1, sizeof *v->data);
  if (!v->ev || !v->ids || !v->val || !v->rules || !v->rule_at || !v->args || !v->seg || !v->params || !v->alias ||
      !v->view_of || !v->in_dims || !v->in_leaf || !v->param_leaf || !v->data)
    goto fail;
  if (r->n_ev) memcpy(v->ev, r->ev, sizeof *v->ev * (size_t)r->n_ev);
  if (r->n_ids) memcpy(v->ids, r->ids, sizeof *v->ids * (size_t)r->n_ids);
  memcpy(v->val, r->val, sizeof *v->val * (size_t)r->n_val);
  for (int i = 0; i < r->n_ev; i++) {
    if (v->ev[i].kind != EV_DATA) continue;
    size_t n = rec_ev_bytes(&v->ev[i]);
    if (!(v->data[v->n_data] = alloc_malloc(n ? n : 1))) goto fail;
    memcpy(v->data[v->n_data], r->ev[i].data, n);
    v->ev[i].data = v->data[v->n_data++];
  }
  int n_attrs = 0;
  for (int i = 0; i < r->n_ev; i++) n_attrs += v->ev[i].a != &rec_no_attrs;
  if (!(v->attrs = alloc_malloc(sizeof *v->attrs * (size_t)(n_attrs + 1)))) goto fail;
  for (int i = 0, k = 0; i < r->n_ev; i++) {
    if (v->ev[i].a == &rec_no_attrs) continue;
    v->attrs[k] = *v->ev[i].a;
    v->ev[i].a = &v->attrs[k++];
  }
  /* the rules: their expressions move to the variant's own context */
  v->rsym = b->rsym;
  b->rsym = sym_ctx_new();
  if (b->n_rules) memcpy(v->rules, b->rules, sizeof *v->rules * (size_t)b->n_rules);
  memcpy(v->rule_at, b->rule_at, sizeof *v->rule_at * (size_t)(r->n_ev + 1));
  if (b->n_args) memcpy(v->args, b->args, sizeof *v->args * (size_t)b->n_args);
  v->n_args = b->n_args;
  memcpy(v->syms, b->sym, sizeof v->syms);
  v->n_syms = b->n_syms;
  for (int i = 0; i < cs->n_segs; i++) {
    v->seg[i] = cs->segs[i];
    cs->segs[i]->refs++;
  }
  v->n_seg = cs->n_segs;
  v->n_params = r->n_params;
  for (int i = 0; i < r->n_params; i++) {
    v->params[i] = kiln_retain(r->params[i]);
    /* .grad as the call found it: the call's own writes do not count */
    v->param_leaf[i] = (trace_leaf){r->params[i]->requires_grad, r->param_seen[i].had_grad};
  }
  alias_pattern(r->in, r->n_in, r->params, r->n_params, v->alias);
  for (int i = 0; i < r->n_in + r->n_params; i++) {
    const kiln_tensor *t = i < r->n_in ? r->in[i] : r->params[i - r->n_in];
    v->view_of[i] = i;
    for (int j = v->alias[i]; j < i && v->view_of[i] == i; j++)
      if (v->alias[j] == v->alias[i] && tensor_same_view(t, j < r->n_in ? r->in[j] : r->params[j - r->n_in])) v->view_of[i] = v->view_of[j];
  }
  for (int i = 0; i < fn->opts.n_in; i++) {
    v->in_first[i] = i;
    for (int j = 0; j < i && v->in_first[i] == i; j++)
      if (r->in[j] == r->in[i]) v->in_first[i] = j;
  }
  for (int i = 0; i < fn->opts.n_in; i++) {
    v->in_leaf[i] = (trace_leaf){r->in[i]->requires_grad, (r->in_had_grad >> i & 1) != 0}; /* n_in <= 64 */
    v->in_ndim[i] = r->in[i]->ndim;
    memcpy(v->in_shape[i], r->in[i]->shape, sizeof v->in_shape[i]);
    memcpy(v->in_stride[i], r->in[i]->stride, sizeof v->in_stride[i]);
    if (tensor_contiguous(r->in[i])) v->in_contig |= 1ull << i;
  }
  fill_in_dims(fn, v);
  /* outputs that are leaves themselves: the guard-only path hands back the
   * leaf, as the body does, not a copy of its written values */
  for (int i = 0; i < fn->opts.n_out; i++)
    for (int k = 0; k < r->n_in + r->n_params; k++) {
      if (cs->out_t[i] != (k < r->n_in ? r->in[k] : r->params[k - r->n_in])) continue;
      if (!v->out_leaf) {
        if (!(v->out_leaf = alloc_malloc(sizeof *v->out_leaf * (size_t)fn->opts.n_out))) goto fail;
        for (int j = 0; j < fn->opts.n_out; j++) v->out_leaf[j] = -1;
      }
      v->out_leaf[i] = k;
      break;
    }
  /* the guard-only path: the body showed nothing a later call could change */
  bool plain = !r->read_meta && !r->c_numbers && !r->read_data && v->n_seg == 1 && v->n_args == 0 && !v->seg[0]->frozen;
  /* nor a tensor the body made and kept somewhere other than its outputs (a
   * state in its context): storing it there is C the guard-only path skips */
  plain = plain && v->seg[0]->n_out == fn->opts.n_out && !cs->kept_live && !leaves_kept(r, cs->out_t, fn->opts.n_out) &&
          !outputs_view_written(r, v->seg[0], cs->out_t, fn->opts.n_out);
  for (int i = 0; i < r->n_ev && plain; i++) plain = r->ev[i].kind != EV_RAND;
  /* a backward walks on into a leaf's autograd history (the ops that made
   * an input outside the call), which the recording took in as it was:
   * another call's input has other history, which no guard can compare */
  bool history = false;
  for (int i = 0; i < r->n_in + r->n_params && v->backward; i++)
    history |= (i < r->n_in ? r->in[i] : r->params[i - r->n_in])->grad_fn != NULL;
  /* never after an escape: the graph is the part before it, and the rest
   * of the body (its outputs, its writes) ran eagerly */
  /* nor a body that sets kiln's state (kiln_manual_seed, the thread count,
   * a kiln_no_grad_begin it leaves open): a call that skips the body would
   * not set it, though it is no C of the body's own */
  v->guard_ok = r->escaped || history || cs->sets_state     ? false
                : fn->opts.capture == KILN_CAPTURE_GUARDS ? v->n_seg == 1 && v->n_args == 0
                : fn->opts.capture == KILN_CAPTURE_RECORD ? false
                                                          : plain;
  return v;
fail:
  variant_free(v);
  return NULL;
}

/* A script a call took goes back to its variant, unless the variant is
 * gone, has another by now, or the replay handed it over (its tensors are
 * the recording's). */
static void script_give_back(kiln_fn *fn, variant *v, rp_script *s) {
  if (!s) return;
  pthread_mutex_lock(&fn->mu);
  if (!rp_broken(s) && !v->dead && !v->script) v->script = s, s = NULL;
  pthread_mutex_unlock(&fn->mu);
  rp_free(s);
}

/* At the end of a recorded call (fn->mu held): the script taken goes back,
 * and the variant whose one segment ran gets a script of this call's log
 * when it has none, or when its script did not fit the inputs of two such
 * calls in a row (the shapes changed for good). A variant whose replays
 * handed over three times in a row, or whose log a replay could not check
 * three times in a row (a step that clips its .grads in place), gets none for its next 32
 * recorded calls: making scripts no call replays would only cost time. */
static void script_leave(call_state *cs, variant *ran, variant *taken_from, rp_script *taken) {
  kiln_fn *fn = cs->fn;
  recording *r = &cs->rec;
  if (taken && rp_broken(taken) && !taken_from->dead && ++taken_from->script_breaks >= 3)
    taken_from->script_breaks = 0, taken_from->script_rest = 32;
  if (taken && !rp_broken(taken) && !taken_from->dead && !taken_from->script) taken_from->script = taken, taken = NULL;
  if (ran && ran->script_rest > 0) {
    ran->script_rest--;
  } else if (ran && !ran->dead && !fn->no_replay && ran->n_seg == 1 && ran->seg[0]->n_out == fn->opts.n_out &&
             !r->escaped && (!ran->script || ++ran->script_misses >= 2)) {
    rp_script *s = rp_make(r, cs->out_t, fn->opts.n_out, ran->rules, ran->rule_at, cs->argi, cs->argf, ran->n_args,
                           ran->seg[0]->writes, ran->seg[0]->n_writes);
    if (s) {
      rp_free(ran->script);
      ran->script = s;
      ran->script_misses = ran->script_fails = 0;
    } else if (++ran->script_fails >= 3) {
      ran->script_fails = 0, ran->script_rest = 32;
    }
  }
  rp_free(taken);
}

/* A replayed call whose body did its script's steps: the variant's segment
 * runs with this call's inputs and float numbers, and the script's
 * arguments otherwise (the same inputs' shapes give the same sizes). */
static int replay_run(call_state *cs, rp_call *rp, variant *v, kiln_tensor **out, double trace_ms) {
  kiln_fn *fn = cs->fn;
  recording *r = &cs->rec;
  int n_out = fn->opts.n_out, rc = -1, np = rp_n_params(rp);
  const segment *seg = v->seg[0];
  kiln_tensor *outs_small[16], **outs = NULL;
  rp_restore_grads(rp);
  if (alloc_grow((void **)&r->params, &r->cap_params, np + 1, sizeof *r->params)) {
    err_set("", 0, "call", "%s: out of memory", fn->name);
    goto done;
  }
  for (int i = 0; i < np; i++) r->params[i] = rp_take_param(rp, i);
  r->n_params = np;
  if (v->n_args) {
    memcpy(cs->argi, rp_argi(rp), sizeof *cs->argi * (size_t)v->n_args);
    memcpy(cs->argf, rp->argf, sizeof *cs->argf * (size_t)v->n_args);
  }
  outs = seg->n_out < 16 ? memset(outs_small, 0, sizeof outs_small) : alloc_calloc((size_t)seg->n_out + 1, sizeof *outs);
  if (!outs) {
    err_set("", 0, "call", "%s: out of memory", fn->name);
    goto done;
  }
  /* no hook may see the run (give_outputs copies through the dispatcher) */
  rp_end(rp);
  rec_end(r);
  check_params(fn, r->params, r->n_params);
  if (run_segment(cs, seg, v->args, outs)) goto done;
  give_outputs(cs, seg, outs);
  rc = 0;
done:
  /* each .grad the run set is the tensor the body saw there, as in a recorded call */
  for (int i = 0; rp->s && i < np; i++) {
    kiln_tensor *g = rp_grad_seen(rp, i);
    if (g && rc == 0) keep_grad_handle(r->params[i], g);
    kiln_release(g);
  }
  rp_end(rp);
  rec_end(r);
  for (int i = 0; outs && i < seg->n_out; i++) kiln_release(outs[i]);
  if (outs != outs_small) alloc_free(outs);
  pthread_mutex_lock(&fn->mu);
  fn->st.trace_ms += trace_ms;
  if (rc == 0) fn->st.hits++, fn->st.replays++;
  v->script_misses = v->script_breaks = 0;
  if (!v->dead && !v->script) v->script = rp->s, rp->s = NULL;
  pthread_mutex_unlock(&fn->mu);
  rp_free(rp->s);
  call_free(cs);
  if (rc) {
    for (int i = 0; i < n_out; i++) kiln_release(out[i]), out[i] = NULL;
    return -1;
  }
  return adopt_outputs(fn, out);
}

/* A call on the recording path. */
static int record_call(kiln_fn *fn, kiln_tensor *const *in, kiln_tensor **out) {
  call_state cs;
  call_start(&cs, fn, in);
  double t0 = now_ms();
  int n_out = fn->opts.n_out;
  if (n_out <= CALL_INLINE) cs.outs = memset(cs.outs_in, 0, sizeof cs.outs_in);
  else cs.outs = alloc_calloc((size_t)n_out + 1, sizeof *cs.outs);
  cs.out_t = out;
  /* the candidates: every variant whose inputs fit, newest first */
  pthread_mutex_lock(&fn->mu);
  if (fn->n_variants <= CALL_INLINE) {
    cs.cand = cs.cand_in, cs.alive = cs.alive_in, cs.cand_vals = cs.cand_vals_in;
  } else {
    cs.cand = alloc_malloc(sizeof *cs.cand * (size_t)(fn->n_variants + 1));
    cs.alive = alloc_malloc(sizeof *cs.alive * (size_t)(fn->n_variants + 1));
    cs.cand_vals = alloc_malloc(sizeof *cs.cand_vals * (size_t)(fn->n_variants + 1));
  }
  char why0[2048];
  why0[0] = 0;
  rp_script *script = NULL;
  variant *script_v = NULL;
  if (cs.cand && cs.alive && cs.cand_vals)
    for (int i = fn->n_variants - 1; i >= 0; i--) {
      variant *v = fn->variants[i];
      char w[512];
      if (!inputs_pass(fn, v, in, cs.cand_vals[cs.n_cand], w, sizeof w)) {
        add_why(why0, sizeof why0, w);
        continue;
      }
      v->users++;
      cs.alive[cs.n_cand] = true;
      cs.cand[cs.n_cand++] = v;
      if (!script && v->script && !fn->no_replay && rp_fits(v->script, in, fn->opts.n_in)) {
        script = v->script; /* this call's alone until it gives it back */
        script_v = v;
        v->script = NULL;
      }
    }
  if (!cs.n_cand && fn->n_variants) {
    cs.prev_var = fn->variants[fn->n_variants - 1];
    cs.prev_var->users++;
  }
  struct rec_state *spare = fn->spare;
  fn->spare = NULL;
  pthread_mutex_unlock(&fn->mu);
  bool lists = cs.outs && cs.cand && cs.alive && cs.cand_vals;
  if (!lists) rec_spare_free(spare);
  rp_call rp;
  rp.s = NULL; /* not cleared whole: its arguments are 512 bytes */
  if (!lists || rec_begin(&cs.rec, in, fn->opts.n_in, seg_run, &cs, lists ? spare : NULL)) {
    script_give_back(fn, script_v, script);
    call_free(&cs);
    return err_set("", 0, "call", "%s: out of memory", fn->name), -1;
  }
  if (script) rp_begin(&rp, script, &cs.rec, in);
  _Static_assert(sizeof why0 == sizeof cs.why, "why0 is copied whole into cs.why");
  memcpy(cs.why, why0, strlen(why0) + 1);
  cs.rec.scan_save = fn->opts.scan_save;
  kiln_scope_begin();
  for (int i = 0; i < n_out; i++) out[i] = NULL;
  unsigned long errors = err_count(), runs = ag_engine_runs(), sets = settings_count();
  int depth = grad_depth();
  int rc = fn->body(fn->ctx, in, out);
  cs.backward = ag_engine_runs() != runs;
  cs.sets_state = settings_count() != sets || grad_depth() != depth;
  /* a body that failed without an error of its own: say so (at the call's line), not an older message */
  if (rc && err_count() == errors) err_set("", 0, "call", "%s: the body returned %d", fn->name, rc);
  bool replayed = script && rp_finished(&rp, rc, out, n_out);
  bool ok = rc == 0 && !cs.rec.failed;
  for (int i = 0; i < n_out && ok; i++) {
    if (!out[i]) {
      ok = false;
      rc = -1;
      err_set("", 0, "call", "%s: the body returned 0 but left output %d NULL", fn->name, i);
    } else if (!replayed && (cs.outs[i] = rec_value_of(&cs.rec, out[i])) < 0) {
      ok = false;
    }
  }
  double t1 = now_ms();
  /* the body's scope goes first: what it alone held is not live */
  for (int i = 0; i < n_out; i++) kiln_retain(out[i]);
  kiln_scope_end();
  /* (inputs and params shared storage as the variant's did: the replay checked
   * that before any step touched them, rp_begin and take_params) */
  if (replayed && rp_nothing_kept(&rp))
    return replay_run(&cs, &rp, script_v, out, t1 - t0);
  for (int i = 0; i < n_out && replayed && ok; i++) /* the recording took over after the body */
    if ((cs.outs[i] = rec_value_of(&cs.rec, out[i])) < 0) ok = false;
  /* an output the body made a leaf that requires grad (kiln_requires_grad
   * on a tensor it made) stays one: outputs carry no history, but that flag
   * is no history (n_out <= 64) */
  uint64_t leaf_rg = 0;
  for (int i = 0; i < n_out && ok && !cs.rec.escaped; i++)
    if (out[i]->requires_grad && !out[i]->grad_fn && out[i]->rec_call == cs.rec.id) leaf_rg |= 1ull << i;
  if (ok && !cs.rec.escaped && seg_run(&cs.rec, &cs, true)) ok = false, rc = rc ? rc : -1;
  for (int i = 0; i < n_out && ok; i++)
    if (leaf_rg >> i & 1) out[i]->requires_grad = true;
  rp_end(&rp);
  if (cs.rec.escaped) check_escaped(fn);
  rec_end(&cs.rec);
  if (!ok && cs.rec.failed && (rc == 0 || cs.rec.why_is_error)) {
    /* an error that says where it is (a break under fullgraph) stands as it
     * is, also when the body failed after it: what failed then (a read of
     * data the stopped recording never computed, in kiln_cond, say) only
     * follows from it */
    if (cs.rec.why_is_error) err_restore(cs.rec.why);
    else err_set("", 0, "call", "%s: %s", fn->name, cs.rec.why);
    rc = -1;
  }
  if (rc) {
    for (int i = 0; i < n_out; i++) kiln_release(out[i]), out[i] = NULL;
    script_give_back(fn, script_v, script);
    call_free(&cs);
    return -1;
  }
  /* the call ran: count it, and keep what it built */
  variant *nv = cs.building ? make_variant(&cs) : NULL;
  pthread_mutex_lock(&fn->mu);
  fn->st.trace_ms += t1 - t0;
  fn->st.breaks += cs.n_seg - (cs.rec.escaped ? 0 : 1);
  if (cs.rec.escaped) fn->st.fallbacks++;
  if (!cs.building) {
    if (!cs.rec.escaped) fn->st.hits++;
  } else if (cs.uncached) {
    fn->st.fallbacks += !cs.rec.escaped;
  } else {
    fn->st.traces++;
    fn->st.compile_ms += cs.passes_ms + cs.compile_ms;
    fn->st.passes_ms += cs.passes_ms;
    fn->st.fuse_ms += cs.front_ms, fn->st.llvm_opt_ms += cs.opt_ms, fn->st.llvm_codegen_ms += cs.machine_ms;
  }
  bool cached = false, warn_cap = false;
  /* a variant made because only the numbers differed from one whose inputs
   * fit (a learning rate, a temperature) holds them as arguments: it serves
   * every call the other did, which it replaces */
  variant *old = NULL;
  for (int c = 0; nv && !cs.uncached && c < cs.n_cand && !old; c++) {
    variant *v = cs.cand[c];
    /* (not one with weights frozen into it: the new one may differ by which weight it read) */
    if (v->n_ev == cs.rec.n_ev && v->n_seg == nv->n_seg && !variant_frozen(v) && aligned_with(&cs.rec, v) == v->n_ev &&
        same_seg_writes(v, nv) && same_sharing(v, nv, cs.rec.n_in + nv->n_params))
      old = v;
  }
  int ev = old && traced_shapes(fn, old, in) ? const_changed(&cs.rec, old) : -1;
  if (ev >= 0 && still_const(old, nv, ev)) {
    /* the changed number (no size's) is a constant of the new one too: it
     * serves no call the old one did, so both stay (values that alternate
     * hit), and the event is counted towards running on the interpreter */
    int k = -1;
    for (int i = 0; i < 8 && k < 0; i++)
      if (fn->futile[i].n && fn->futile[i].ev == ev) k = i;
    for (int i = 0; i < 8 && k < 0; i++)
      if (!fn->futile[i].n) k = i;
    if (k >= 0) fn->futile[k].ev = ev, fn->futile[k].n++;
    old = NULL;
  }
  if (old)
    for (int i = 0; i < fn->n_variants; i++)
      if (fn->variants[i] == old) {
        memmove(&fn->variants[i], &fn->variants[i + 1], sizeof *fn->variants * (size_t)(fn->n_variants - i - 1));
        fn->n_variants--;
        old->dead = true; /* freed by call_free: this call holds it */
        break;
      }
  if (nv && !cs.uncached && fn->n_variants < fn->opts.max_variants) {
    if (fn->n_variants == fn->cap) {
      int cap = fn->cap ? fn->cap * 2 : 8;
      variant **vs = alloc_realloc(fn->variants, sizeof *vs * (size_t)cap);
      if (vs) fn->variants = vs, fn->cap = cap;
    }
    if (fn->n_variants < fn->cap) {
      fn->variants[fn->n_variants++] = nv;
      cached = true;
    }
  } else if (cs.building && cs.uncached && !cs.storm) {
    warn_cap = !fn->warned_cap;
    fn->warned_cap = true;
  }
  fn->st.variants = fn->n_variants;
  /* a script taken is handed over by now: a call that replayed to the end returned through replay_run */
  script_leave(&cs, cs.building ? (cached ? nv : NULL) : cs.ran, script_v, script);
  pthread_mutex_unlock(&fn->mu);
  if (cs.building) {
    if (cs.why[0]) dump_note(fn, "%s; variant %d made%s", cs.why, cs.no, old ? ", in place of the one the numbers differed from" : "");
    if (nv && (fn->dump & KILN_DUMP_GUARDS)) {
      FILE *f = dump_open(fn, "guards", cs.no);
      print_guards(f, fn, nv);
      dump_close(f);
    }
    if (warn_cap)
      fprintf(stderr, "kiln: warning: %s (compiled at %s:%d): %d variants cached, the cap; calls that fit none run on the "
              "interpreter from now on (why this one fit none: %s)\n", fn->name, fn->file, fn->line, fn->opts.max_variants,
              cs.why[0] ? cs.why : "?");
  }
  if (!cached) variant_free(nv);
  call_free(&cs);
  return adopt_outputs(fn, out);
}

/* ---- check mode ---- */

static bool close_enough(const kiln_tensor *a, const kiln_tensor *b, double *maxerr) {
  *maxerr = 0;
  if (a->dtype != b->dtype || a->ndim != b->ndim || memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim)) {
    *maxerr = INFINITY;
    return false;
  }
  bool ok = true;
  int64_t n = shape_numel(a->ndim, a->shape);
  double tol = dtype_check_tol(a->dtype);
  for (int64_t i = 0; i < n; i++) {
    double x = tensor_get(a, i), y = tensor_get(b, i);
    if (x == y || (x != x && y != y)) continue;
    double e = fabs(x - y);
    if (e > *maxerr) *maxerr = e;
    if (!(e <= tol * (1 + fabs(y)))) ok = false;
  }
  return ok;
}

/* Leaf state a call may change: data of the params and inputs, and every .grad. */
typedef struct snapshot {
  kiln_tensor **leaf;  /* the leaves (borrowed: inputs, and params retained by their variant or owner) */
  kiln_tensor **data;  /* copies of their data */
  kiln_tensor **grad;  /* their .grad tensors (retained) */
  int n, cap;
  bool incomplete;     /* a leaf could not be added (out of memory), or the call escaped: no eager run to compare with */
  bool ran;            /* compiled code of the call ran already (a segment before a break) */
} snapshot;

/* Adds leaf t (once) with copies of its data and .grad. 0 or -1. */
static int snap_add(snapshot *s, kiln_tensor *t) {
  for (int i = 0; i < s->n; i++)
    if (s->leaf[i] == t) return 0;
  if (s->n == s->cap) {
    int cap = s->cap ? 2 * s->cap : 8;
    kiln_tensor **l = alloc_realloc(s->leaf, sizeof *l * (size_t)cap);
    if (l) s->leaf = l;
    kiln_tensor **d = l ? alloc_realloc(s->data, sizeof *d * (size_t)cap) : NULL;
    if (d) s->data = d;
    kiln_tensor **g = d ? alloc_realloc(s->grad, sizeof *g * (size_t)cap) : NULL;
    if (!g) return -1;
    s->grad = g;
    s->cap = cap;
  }
  kiln_tensor *g = t->grad, *d = op_run(OP_COPY, &t, 1, NULL, "", 0);
  /* a copy, not the tensor: the compiled run may write into the .grad in place */
  kiln_tensor *gc = g && d ? op_run(OP_COPY, &g, 1, NULL, "", 0) : NULL;
  if (!d || (g && !gc)) {
    kiln_release(d);
    return -1;
  }
  s->leaf[s->n] = kiln_retain(t), s->data[s->n] = d, s->grad[s->n] = gc;
  s->n++;
  return 0;
}

static int snap_take(kiln_tensor *const *leaves, int n, snapshot *s) {
  for (int i = 0; i < n; i++)
    if (snap_add(s, leaves[i])) return -1;
  return 0;
}

/* Leaf i takes the data and .grad the snapshot holds, which takes cur (a copy of the leaf's data) and the old .grad. */
static void snap_swap_one(snapshot *s, int i, kiln_tensor *cur) {
  kiln_tensor *t = s->leaf[i];
  pw_copy(t, s->data[i]);
  kiln_release(s->data[i]);
  s->data[i] = cur;
  kiln_tensor *g = t->grad;
  t->grad = s->grad[i];
  s->grad[i] = g;
}

/* Puts the leaves back as in s; the state they had is returned in s (swap). */
static void snap_swap(snapshot *s) {
  /* every leaf read before any is written: leaves may share storage (an
   * input viewing a param), and a write of one would change what another
   * reads (out of memory: leaf by leaf) */
  kiln_tensor *small[8], **now = s->n <= 8 ? small : alloc_malloc(sizeof *now * (size_t)s->n);
  for (int i = 0; i < s->n; i++) {
    kiln_tensor *t = s->leaf[i], *cur = op_run(OP_COPY, &t, 1, NULL, "", 0);
    if (now) now[i] = cur;
    else snap_swap_one(s, i, cur);
  }
  for (int i = 0; now && i < s->n; i++) snap_swap_one(s, i, now[i]);
  if (now != small) alloc_free(now);
}

static void snap_free(snapshot *s) {
  for (int i = 0; i < s->n; i++) {
    if (s->data) kiln_release(s->data[i]);
    if (s->grad) kiln_release(s->grad[i]);
    if (s->leaf) kiln_release(s->leaf[i]);
  }
  alloc_free(s->leaf);
  alloc_free(s->data);
  alloc_free(s->grad);
}

/* Runs the call (compiled) and the body eagerly from the same state, and
 * compares outputs, leaves and grads. The compiled results stand when they
 * agree; when they do not, the eager ones do. The leaves are the inputs and
 * the params of the newest variant that served the call or was made by it. */
/* The function call_checked is running on this thread, and the variant
 * its call ran on the guard-only path (held: users). Only that call hands
 * its variant over: a loaded function's calls, unchecked, leave none. */
static _Thread_local const kiln_fn *checking;
static _Thread_local variant *checked_hit;
/* Its snapshot, which takes every param a compiled run reads before it runs:
 * the newest variant's params are not all (a body that picks a weight by a
 * C flag, a state it replaces, a weight first passed as the input), and a
 * param written by the compiled run and not put back was written again by
 * the eager run, which then started from the compiled result */
static _Thread_local snapshot *check_snap;

static void check_params(const kiln_fn *fn, kiln_tensor *const *ps, int n) {
  if (checking != fn || !check_snap) return;
  snapshot *s = check_snap;
  for (int i = 0; i < n && !s->incomplete; i++) {
    if (!ps[i]) continue;
    /* a param new to the snapshot that shares memory with one in it (a view
     * of a weight an earlier segment wrote) holds that segment's write by
     * now: putting both back would leave the memory half written */
    bool known = false, shares = false;
    for (int k = 0; k < s->n && !known; k++) known = s->leaf[k] == ps[i], shares |= s->leaf[k]->st == ps[i]->st;
    if (!known && ((s->ran && shares) || snap_add(s, ps[i]))) s->incomplete = true;
  }
  s->ran = true; /* compiled code runs next */
}

/* A call whose rest ran eagerly wrote tensors its recording never saw (an
 * optimizer's moments first used after the escape): the snapshot cannot put
 * them back, so an eager run would start from the call's results and apply
 * the rest twice. Its results stand unchecked, as when a copy failed. */
static void check_escaped(const kiln_fn *fn) {
  if (checking == fn && check_snap) check_snap->incomplete = true;
}

static int call_checked(kiln_fn *fn, kiln_tensor *const *in, kiln_tensor **out, int (*call)(kiln_fn *, kiln_tensor *const *, kiln_tensor **)) {
  /* the params are known after the call: a first, unchecked call finds them */
  pthread_mutex_lock(&fn->mu);
  variant *v = fn->n_variants ? fn->variants[fn->n_variants - 1] : NULL;
  int n = fn->opts.n_in + (v ? v->n_params : 0);
  kiln_tensor **leaves = alloc_malloc(sizeof *leaves * (size_t)(n + 1));
  int kept = 0, n_in = 0; /* leaves [0, n_in) are inputs, the rest params retained here */
  for (int i = 0; leaves && i < n; i++) {
    kiln_tensor *t = i < fn->opts.n_in ? in[i] : v->params[i - fn->opts.n_in];
    bool twice = false; /* a tensor passed twice is one leaf: two would swap its data back */
    for (int j = 0; j < kept && !twice; j++) twice = leaves[j] == t;
    if (twice) continue;
    if (i < fn->opts.n_in) {
      leaves[kept++] = t, n_in++;
    } else if (t && tensor_refs(t) > 1) {
      /* one only the variant still holds was released by its owner: the call
       * drops that variant, and a reference here would hide the release */
      leaves[kept++] = kiln_retain(t);
    }
  }
  n = kept;
  pthread_mutex_unlock(&fn->mu);
  if (!leaves) return err_set("", 0, "call", "%s: out of memory", fn->name), -1;
  snapshot s = {0};
  int rc = snap_take(leaves, n, &s);
  for (int i = n_in; i < n; i++) kiln_release(leaves[i]);
  alloc_free(leaves);
  if (rc) {
    snap_free(&s);
    return err_set("", 0, "call", "%s: out of memory", fn->name), -1;
  }
  uint64_t seed0, off0, seed1, off1;
  gen_state_get(&seed0, &off0);
  checking = fn;
  check_snap = &s;
  int call_rc = call(fn, in, out);
  checking = NULL;
  check_snap = NULL;
  if (call_rc || s.incomplete) { /* incomplete: out of memory for a param's copy, or a call whose rest ran eagerly
                                  * (check_escaped), so the compiled results stand unchecked */
    variant *hv = checked_hit;
    checked_hit = NULL;
    if (hv) {
      pthread_mutex_lock(&fn->mu);
      bool free_it = --hv->users == 0 && hv->dead;
      pthread_mutex_unlock(&fn->mu);
      if (free_it) variant_free(hv);
    }
    snap_free(&s);
    return call_rc ? -1 : 0;
  }
  snap_swap(&s); /* leaves back to the start, compiled state in s */
  /* kernel by kernel against the interpreter, from the same start (the guard-only path's variant) */
  char kreport[1024] = "";
  variant *hv = checked_hit;
  checked_hit = NULL;
  if (hv) {
    const segment *seg = hv->seg[0];
    if (seg->be->check(seg->exec, in, hv->params, kreport, sizeof kreport) != 1) kreport[0] = 0;
    pthread_mutex_lock(&fn->mu);
    bool free_it = --hv->users == 0 && hv->dead;
    pthread_mutex_unlock(&fn->mu);
    if (free_it) variant_free(hv);
  }
  /* the eager run draws what the compiled one drew, and both leave the generator where it left it */
  gen_state_get(&seed1, &off1);
  gen_state_set(seed0, off0);
  kiln_tensor *eo[MAX_IN] = {0};
  kiln_scope_begin();
  int brc = fn->body(fn->ctx, in, eo);
  gen_state_set(seed1, off1);
  char report[512] = "";
  double e = 0;
  if (brc == 0) {
    for (int i = 0; i < fn->opts.n_out && !report[0]; i++)
      if (!eo[i] || !close_enough(out[i], eo[i], &e)) snprintf(report, sizeof report, "output %d differs from eager (max abs error %g)", i, e);
    for (int i = 0; i < s.n && !report[0]; i++) {
      kiln_tensor *t = s.leaf[i];
      if (!close_enough(s.data[i], t, &e)) snprintf(report, sizeof report, "leaf %d after the call differs from eager (max abs error %g)", i, e);
      if (!report[0] && (s.grad[i] != NULL) != (t->grad != NULL))
        snprintf(report, sizeof report, "leaf %d: .grad is %s compiled, %s eager", i, s.grad[i] ? "set" : "NULL", t->grad ? "set" : "NULL");
      else if (!report[0] && s.grad[i] && !close_enough(s.grad[i], t->grad, &e))
        snprintf(report, sizeof report, "leaf %d: .grad differs from eager (max abs error %g)", i, e);
    }
  } else {
    snprintf(report, sizeof report, "the eager run failed: %s", kiln_last_error());
  }
  bool use_eager = report[0] && brc == 0;
  /* the compiled outputs stay in the caller's scope; the eager ones move there and are returned */
  for (int i = 0; i < fn->opts.n_out && use_eager; i++) out[i] = kiln_keep(eo[i]);
  kiln_scope_end();
  if (!use_eager) snap_swap(&s); /* the compiled state stands */
  snap_free(&s);
  if (report[0] || kreport[0]) {
    pthread_mutex_lock(&fn->mu);
    fn->st.check_fails++;
    pthread_mutex_unlock(&fn->mu);
    fprintf(stderr, "kiln: check: %s (compiled at %s:%d): %s%s%s%s\n", fn->name, fn->file, fn->line,
            report[0] ? report : "outputs agree with eager", use_eager ? "; returning the eager results" : "",
            kreport[0] ? "; " : "", kreport);
  }
  return 0;
}

/* ---- the call ---- */

/* The guard-only path: a cached variant whose guards pass runs without the
 * body. 1: served; 0: not on this path; -1: it ran and failed. */
static int guard_call(kiln_fn *fn, kiln_tensor *const *in, kiln_tensor **out, char *why, size_t whyn) {
  int64_t vals[IR_MAX_SYMS];
  struct timespec g0 = {0}, g1 = {0};
  pthread_mutex_lock(&fn->mu);
  fn->st.calls++; /* every call comes here first, once */
  bool timed = fn->guard_samples < 16 || (fn->st.calls & 15) == 0;
  if (timed) clock_gettime(CLOCK_MONOTONIC, &g0);
  /* a variant whose weights their owner released: on the guard-only path
   * (or with weights frozen into it) it can never run again, and is dropped;
   * a recording-path variant reads each call's params from its recording,
   * so it lets go of the dead tensor and stays (state a body replaces every
   * call, a running mean or a grown cache, would otherwise be traced anew
   * every call) */
  for (int i = 0; i < fn->n_variants; i++) {
    variant *v = fn->variants[i];
    int gone = -1;
    for (int k = 0; k < v->n_params && !v->loaded && gone < 0; k++)
      if (v->params[k] && tensor_refs(v->params[k]) <= 1) gone = k;
    if (gone < 0) continue;
    if (!v->guard_ok && !variant_frozen(v)) {
      for (int k = gone; k < v->n_params; k++)
        if (v->params[k] && tensor_refs(v->params[k]) <= 1) kiln_release(v->params[k]), v->params[k] = NULL;
      continue;
    }
    dump_note(fn, "variant %d dropped: param %d was released by its owner", v->no, gone);
    memmove(&fn->variants[i], &fn->variants[i + 1], sizeof *fn->variants * (size_t)(fn->n_variants - i - 1));
    fn->n_variants--;
    i--;
    if (v->users) v->dead = true;
    else variant_free(v);
  }
  fn->st.variants = fn->n_variants;
  variant *hit = NULL;
  char first_why[512]; /* set only, never zeroed: a hit's call is a few microseconds */
  first_why[0] = 0;
  for (int i = fn->n_variants - 1; i >= 0 && !hit; i--) {
    variant *v = fn->variants[i];
    if (!v->guard_ok && !v->loaded) continue;
    char w[512];
    if (guards_pass(fn, v, in, vals, w, sizeof w)) hit = v;
    else if (!first_why[0]) snprintf(first_why, sizeof first_why, "%s", w);
  }
  if (hit && fn->loaded && ir_verify_at(hit->seg[0]->g, vals, first_why, sizeof first_why)) hit = NULL;
  if (timed) clock_gettime(CLOCK_MONOTONIC, &g1);
  if (hit) {
    hit->users++;
    fn->st.hits++;
    fn->st.guard_hits++;
    if (timed) {
      fn->guard_ns_total += (double)(g1.tv_sec - g0.tv_sec) * 1e9 + (double)(g1.tv_nsec - g0.tv_nsec);
      fn->guard_samples++;
    }
  }
  pthread_mutex_unlock(&fn->mu);
  if (!hit) {
    /* a plain copy: snprintf costs a recorded call ~900 instructions */
    if (why && whyn) {
      size_t k = strnlen(first_why, whyn - 1);
      memcpy(why, first_why, k);
      why[k] = 0;
    }
    return 0;
  }
  kiln_tensor *all[MAX_IN];
  const segment *seg = hit->seg[0];
  for (int i = 0; i < seg->n_out && i < MAX_IN; i++) all[i] = NULL;
  check_params(fn, hit->params, hit->n_params);
  int rc = seg->be->run(seg->exec, in, hit->params, all);
  for (int i = 0; rc == 0 && hit->out_leaf && i < fn->opts.n_out; i++) {
    int k = hit->out_leaf[i];
    kiln_tensor *t = k < 0 ? NULL : k < fn->opts.n_in ? in[k] : hit->params[k - fn->opts.n_in];
    if (!t || all[i] == t) continue;
    kiln_release(all[i]); /* a copy of its values, made because the graph writes it */
    all[i] = kiln_retain(t);
  }
  if (rc == 0)
    for (int i = 0; i < fn->opts.n_out; i++) out[i] = all[i];
  for (int i = fn->opts.n_out; i < seg->n_out && i < MAX_IN; i++) kiln_release(all[i]);
  if (rc == 0 && checking == fn && seg->be->check) {
    /* check mode compares this variant's kernels with the interpreter after the call */
    pthread_mutex_lock(&fn->mu);
    hit->users++;
    pthread_mutex_unlock(&fn->mu);
    checked_hit = hit;
  }
  pthread_mutex_lock(&fn->mu);
  bool free_it = --hit->users == 0 && hit->dead;
  pthread_mutex_unlock(&fn->mu);
  if (free_it) variant_free(hit);
  if (rc) return -1;
  return adopt_outputs(fn, out) ? -1 : 1;
}

static int plain_call(kiln_fn *fn, kiln_tensor *const *in, kiln_tensor **out) {
  char why[512];
  why[0] = 0;
  int g = guard_call(fn, in, out, why, sizeof why);
  if (g) return g < 0 ? -1 : 0;
  if (fn->loaded) return err_set("", 0, "call", "%s: the call does not fit the loaded graph: %s", fn->name, why), -1;
  return record_call(fn, in, out);
}

int kiln_call_at(kiln_fn *fn, kiln_tensor *const *in, kiln_tensor **out, const char *file, int line) {
  if (!fn_ok(fn)) return err_set(file, line, "call", "%s", fn_dead(fn)), -1;
  if (!out) return err_set(file, line, "call", "%s: out is NULL", fn->name), -1;
  if (fn->opts.n_in && !in) return err_set(file, line, "call", "%s: in is NULL", fn->name), -1;
  for (int i = 0; i < fn->opts.n_in; i++)
    if (!in[i]) return err_null(file, line, "call", "%s: input %d", fn->name, i), -1;
    else if (tensor_check_live(in[i], "an input", "call", file, line)) return -1;
  if (dispatch_hooks() && dispatch_hooks()->record)
    return err_set(file, line, "call", "%s: called inside another compiled function's body; call its body directly", fn->name), -1;
  bool check = false; /* opts and loaded never change: most calls take no lock here (guard_call counts them) */
  if (fn->opts.check && !fn->loaded) {
    pthread_mutex_lock(&fn->mu);
    check = fn->n_variants > 0;
    pthread_mutex_unlock(&fn->mu);
  }
  kiln_clear_error();
  int rc = check ? call_checked(fn, in, out, plain_call) : plain_call(fn, in, out);
  if (rc) err_locate(file, line);
  return rc;
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
    const variant *v = fn->variants[variant_no];
    size_t len = 0;
    for (int i = 0; i < v->n_seg && (s || i == 0); i++) {
      char *t = ir_to_string(v->seg[i]->g);
      if (!t) break;
      size_t n = strlen(t);
      char *ns = realloc(s, len + n + 1);
      if (!ns) {
        alloc_free(t);
        break;
      }
      s = ns;
      memcpy(s + len, t, n + 1);
      len += n;
      alloc_free(t);
    }
  }
  pthread_mutex_unlock((pthread_mutex_t *)&fn->mu);
  if (!s) err_set(file, line, "fn_graph", "%s has no variant %d", fn->name, variant_no);
  return s;
}

/* ---- save and load ---- */

/* The first input of v that is the same tensor as an earlier one, or -1. The
 * recording takes a tensor passed twice for one value, so v's graph reads
 * one leaf for both; a saved or exported graph takes distinct tensors, and
 * would read the first for each. (Other views of one storage, a row of a
 * weight passed with the weight, are leaves of their own.) */
static int shared_leaf(const kiln_fn *fn, const variant *v) {
  for (int i = 0; !v->loaded && i < fn->opts.n_in && i < MAX_IN; i++)
    if (v->in_first[i] != i) return i;
  return -1;
}

int kiln_save_variant_at(kiln_fn *fn, const char *path, int variant_no, const char *file, int line) {
  if (!fn_ok(fn)) return err_set(file, line, "save", "%s", fn_dead(fn)), -1;
  if (!path) return err_set(file, line, "save", "path is NULL"), -1;
  pthread_mutex_lock(&fn->mu);
  int n = fn->n_variants, rc = -1;
  const variant *v = NULL;
  if (!n) err_set(file, line, "save", "%s has no compiled variant yet (call it once first)", fn->name);
  else if (variant_no < 0 || variant_no > n)
    err_set(file, line, "save", "%s has %d variants: variant %d is not one (0 is the newest, 1 .. %d the oldest first)",
            fn->name, n, variant_no, n);
  else v = fn->variants[variant_no ? variant_no - 1 : n - 1];
  if (v && (v->n_seg != 1 || v->n_args)) {
    err_set(file, line, "save", "%s's variant %d %s", fn->name, variant_no ? variant_no : n,
            v->n_seg != 1 ? "has graph breaks (data reads inside the body): a saved graph is one graph of the call's inputs"
                          : "takes numbers or C data the body passes: a saved graph is one graph of the call's inputs");
  } else if (v && shared_leaf(fn, v) >= 0) {
    int i = shared_leaf(fn, v);
    err_set(file, line, "save",
            "%s's variant %d was traced with one tensor as inputs %d and %d (a tensor passed twice): a "
            "saved graph takes distinct tensors; save a variant traced with distinct ones",
            fn->name, variant_no ? variant_no : n, v->in_first[i], i);
  } else if (v) {
    FILE *f = fopen(path, "w");
    if (!f) err_set(file, line, "save", "cannot open %s: %s", path, strerror(errno));
    else {
      rc = fprintf(f, "version %d\n", IR_TEXT_VERSION) < 0 ? -1 : ir_print(v->seg[0]->g, f);
      if (fclose(f) || rc) rc = -1, err_set(file, line, "save", "cannot write %s", path);
    }
  }
  pthread_mutex_unlock(&fn->mu);
  return rc;
}

int kiln_save_at(kiln_fn *fn, const char *path, const char *file, int line) {
  return kiln_save_variant_at(fn, path, 0, file, line);
}

/* ---- export ---- */

/* A C identifier of at most 100 chars? */
static bool c_ident(const char *s) {
  if (!s || !*s || strlen(s) > 100 || !(isalpha((unsigned char)*s) || *s == '_')) return false;
  for (; *s; s++)
    if (!isalnum((unsigned char)*s) && *s != '_') return false;
  return true;
}

int kiln_export_at(kiln_fn *fn, const char *prefix, const kiln_export_options *opts, const char *file, int line) {
  if (!fn_ok(fn)) return err_set(file, line, "export", "%s", fn_dead(fn)), -1;
  if (!prefix || !*prefix) return err_set(file, line, "export", "prefix is %s", prefix ? "empty" : "NULL"), -1;
  if (strlen(prefix) > 4000) return err_set(file, line, "export", "prefix is longer than 4000 chars"), -1;
  kiln_export_options o = opts ? *opts : (kiln_export_options){0};
  const char *name = o.name ? o.name : fn->name;
  if (!c_ident(name))
    return err_set(file, line, "export", "\"%s\" is not a C identifier: name the generated functions with opts->name", name), -1;
  pthread_mutex_lock(&fn->mu);
  int rc = -1, n = fn->n_variants;
  const variant *v = NULL;
  if (!n) err_set(file, line, "export", "%s has no compiled variant yet (call it once first)", fn->name);
  else if (o.variant < 0 || o.variant > n)
    err_set(file, line, "export", "%s has %d variants: variant %d is not one (0 is the newest, 1 .. %d the oldest first)",
            fn->name, n, o.variant, n);
  else v = fn->variants[o.variant ? o.variant - 1 : n - 1];
  if (v && (v->n_seg != 1 || v->n_args)) {
    err_set(file, line, "export", "%s's variant %d %s", fn->name, o.variant ? o.variant : n,
            v->n_seg != 1 ? "has graph breaks (data reads inside the body): an export is one graph of the call's inputs"
                          : "takes numbers or C data the body passes: an export binds sizes from its inputs' shapes only");
  } else if (v && !o.params_as_inputs && !variant_params_held(v)) {
    err_set(file, line, "export", "%s's variant %d reads a param its owner has released since (state the body replaces "
            "every call), whose values it no longer has: export with params_as_inputs", fn->name, o.variant ? o.variant : n);
  } else if (v && shared_leaf(fn, v) >= 0) {
    int i = shared_leaf(fn, v);
    err_set(file, line, "export",
            "%s's variant %d was traced with one tensor as inputs %d and %d (a tensor passed twice): an "
            "export takes distinct tensors; export a variant traced with distinct ones",
            fn->name, o.variant ? o.variant : n, v->in_first[i], i);
  } else if (v) {
    char err[600];
    export_request rq = {.name = name, .prefix = prefix, .target = o.target, .cpu = o.cpu,
                         .variant = o.variant ? o.variant : n, .params_as_inputs = o.params_as_inputs != 0,
                         .params = v->params};
    rc = export_graph(v->seg[0]->g, &rq, err, sizeof err);
    if (rc) err_set(file, line, "export", "%s: %s", fn->name, err);
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
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i].op == IR_INPUT && g->nodes[i].attrs.k > 0) {
      ir_free(g);
      return err_set(file, line, "load", "the graph takes a number as a size (@sym): a loaded graph binds sizes from its inputs' shapes only");
    }
  /* params become inputs after the graph's own */
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i].op == IR_PARAM) {
      g->nodes[i].op = IR_INPUT;
      g->nodes[i].index += g->n_inputs;
    }
  int n_in = g->n_inputs + g->n_params;
  g->n_inputs = n_in;
  g->n_params = 0;
  if (n_in > MAX_IN || g->n_outputs < 1 || g->n_outputs > MAX_IN) {
    int n_out = g->n_outputs; /* read before the graph is freed */
    ir_free(g);
    return err_set(file, line, "load", "the graph has %d inputs and %d outputs (at most %d each, one output at least)", n_in, n_out, MAX_IN);
  }
  kiln_options o = {.name = g->name, .n_in = n_in, .n_out = g->n_outputs};
  kiln_fn *fn = kiln_compile_at(loaded_body, NULL, &o, "", 0);
  variant *v = fn ? alloc_calloc(1, sizeof *v) : NULL;
  segment *s = v ? alloc_calloc(1, sizeof *s) : NULL;
  if (!s) goto oom;
  fn->loaded = true;
  v->loaded = true;
  v->guard_ok = true;
  v->no = 1;
  v->seg = alloc_calloc(1, sizeof *v->seg);
  v->in_dims = alloc_calloc((size_t)n_in + 1, sizeof *v->in_dims);
  v->alias = alloc_calloc((size_t)n_in + 1, sizeof *v->alias);
  v->rule_at = alloc_calloc(1, sizeof *v->rule_at);
  fn->variants = alloc_calloc(1, sizeof *fn->variants);
  if (!v->seg || !v->in_dims || !v->alias || !v->rule_at || !fn->variants) goto oom;
  *s = (segment){.refs = 1, .g = g, .be = fn->be, .n_out = g->n_outputs, .n_body = g->n_outputs};
  g = NULL;
  v->seg[0] = s;
  v->n_seg = 1;
  s = NULL;
  v->n_syms = v->seg[0]->g->n_syms;
  for (int k = 0; k < v->n_syms; k++)
    v->syms[k] = (build_sym){.input = 0, .arg = -1, .lo = v->seg[0]->g->sym_lo[k], .hi = v->seg[0]->g->sym_hi[k]};
  fill_in_dims(fn, v);
  for (int i = 0; i < n_in; i++) v->alias[i] = i; /* compiled for distinct inputs */
  segment *vs = v->seg[0];
  vs->exec = vs->be->compile(vs->g, 0, stderr, err, sizeof err);
  if (!vs->exec && vs->be != &backend_interp) {
    fprintf(stderr, "kiln: warning: %s: the %s backend failed (%s); the loaded graph runs on the interpreter\n", fn->name,
            vs->be->name, err);
    vs->be = &backend_interp;
    vs->exec = vs->be->compile(vs->g, 0, stderr, err, sizeof err);
  }
  if (!vs->exec) goto oom;
  fn->variants[0] = v;
  fn->n_variants = fn->cap = 1;
  return fn;
oom:
  alloc_free(s);
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
int (kiln_save_variant)(kiln_fn *fn, const char *path, int variant_no) { return kiln_save_variant_at(fn, path, variant_no, "", 0); }
kiln_fn *(kiln_load)(const char *path) { return kiln_load_at(path, "", 0); }
kiln_fn *(kiln_load_string)(const char *text) { return kiln_load_string_at(text, "", 0); }
int (kiln_export)(kiln_fn *fn, const char *prefix, const kiln_export_options *opts) { return kiln_export_at(fn, prefix, opts, "", 0); }
