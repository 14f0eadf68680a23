/* The LLVM backend: the stages of codegen.h in order, and the runtime that
 * runs a compiled graph. compile: fuse -> lower every loop kernel into one
 * module -> optimize and JIT -> look the kernels up. run: bind the symbols,
 * evaluate each kernel's parameters, place the intermediates in the arena
 * (kept between calls), run the kernels in order (loops split across the
 * thread pool, matmul through BLAS, the rest through eager kernels), then
 * hand out the outputs and apply the writes. */
#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "codegen/codegen.h"
#include "eager/gemm.h"
#include "eager/pool.h"
#include "rt/plan.h"

typedef rt_kernel_fn kern_fn;

#define MAX_GROUPS 4

struct backend_exec {
  const ir_graph *g;      /* the variant's graph, or own_g */
  ir_graph *own_g;        /* the variant's graph after the attention pass, when it fused any */
  cg_program *prog;
  cg_jit *jit;            /* the kernels' machine code, linked */
  kern_fn *fn;            /* per kernel (loops only) */
  unsigned char *staged;  /* per loop kernel: rt_run_loop's staged (0, 1, RT_STAGED_DOT), worked out once */
  _Atomic int64_t last_end; /* when a run last finished its kernels (ns, CLOCK_MONOTONIC) */
  bool has_dot;             /* a kernel runs as RT_STAGED_DOT: runs keep last_end */
  kiln_tensor **consts;   /* per buffer (CONST only) */
  pthread_mutex_t mu;     /* guards the arena */
  char *arena;
  size_t arena_cap;
  bool arena_busy;
  unsigned dump;
  FILE *dump_to;
  bool own_dump;          /* dump_to is a handle of ours, to close */
  bool plan_dumped;
  double front_ms, opt_ms, machine_ms; /* compile time, by phase */
  size_t *plan_bytes, *plan_off, plan_total; /* the last call's plan (under mu) */
  int last_allreduce;     /* the last allreduce's kernel: its bucket goes at once */
  int *leaves, n_leaves;  /* g's input and param nodes: a call binds the symbols from those alone */
  bool temps;             /* some buffer lives in the arena: a call plans it (else it takes no lock) */
  /* A graph with control flow: its regions compiled (each its own kernels,
   * compiled once, rx), and the graph around them fused as any graph, each
   * construct one kernel that runs its loop or branch on those (cf_of: a
   * construct node's index among the graph's, else -1). driver: the graph
   * around them could not be fused and runs node by node (interp_run_with). */
  bool driver;
  region_execs rx;
  int *cf_of, n_cf;
  int *last_get;          /* per construct: the kernel of the last get that reads its results, -1 none */
  int *cf_kernel;         /* per construct: its kernel */
  /* per buffer: a get's, whose memory is its construct's result itself where
   * that is a contiguous tensor of its own (no copy, no arena space); it
   * lives up to end_of[b], b's last reader (the fuse passes make that of a
   * buffer stored in place in it b's too). adopted lists them. */
  bool *adopt;
  int *end_of, *adopted, n_adopted;
  /* outputs made just before the kernel that first writes them, not at
   * the call's start: a call peaks lower (the arena's early intermediates
   * are gone by then). In the order of those kernels. */
  int *lazy, n_lazy;
  size_t *adopt_key;      /* the sizes choose_adoption last decided for (under mu), and what it chose */
  bool *adopt_zero;
  /* A scan's xs operand made by the matmul kernel just before it (a loop's
   * input projection, batched out of the loop) and read by nothing else:
   * made a chunk of steps at a time inside the loop (stream_fill), in a
   * buffer of that many rows, not all T at once. Per kernel: the scan's
   * operand (stream_j, -1 none) and whether a matmul is so made
   * (streamed); per buffer: whether it holds a chunk (stream_buf). */
  int *stream_j;
  bool *streamed, *stream_buf;
  cg_prep prep;           /* weights prepared once (prepare.c); used by the call that holds the arena */
};

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Runs this close after the last are back to back: the pool's worker, if
 * the last run used it, still spins, and a small matvec pays to split. */
static _Atomic int64_t hot_gap = 20000;

int64_t runtime_set_hot_gap(int64_t ns) { return atomic_exchange(&hot_gap, ns); }

/* A streamed input projection's chunk: this many bytes (in L2 while the
 * loop reads it) but no more than a quarter of the whole, or an eighth of
 * the whole where that is more (fewer, larger GEMMs on long loops); whole
 * steps, at least one. So a call holds at most a quarter of it. */
static _Atomic size_t stream_bytes = 256 * 1024;

size_t runtime_set_stream_bytes(size_t n) { return atomic_exchange(&stream_bytes, n); }

/* Steps a chunk holds, of T steps of row bytes each. */
static int64_t stream_rows(size_t row, int64_t T) {
  size_t want = atomic_load(&stream_bytes), whole = row * (size_t)T;
  if (want > whole / 4) want = whole / 4;
  if (want < whole / 8) want = whole / 8;
  int64_t k = row ? (int64_t)(want / row) : T;
  if (k > T) k = T;
  return k < 1 ? 1 : k;
}

static double now_ms(void) { return (double)now_ns() / 1e6; }

static void exec_free(backend_exec *e) {
  if (!e) return;
  region_execs_free(&e->rx);
  prep_free(&e->prep);
  /* the caller's dump file is the caller's to close (a compile that fails
   * has not made its own handle yet) */
  if (e->own_dump && e->dump_to) fclose(e->dump_to);
  if (e->consts && e->prog)
    for (int i = 0; i < e->prog->n_buf; i++) kiln_release(e->consts[i]);
  alloc_free(e->consts);
  alloc_free(e->fn);
  alloc_free(e->staged);
  alloc_free(e->plan_bytes), alloc_free(e->plan_off);
  alloc_free(e->leaves);
  alloc_free(e->cf_of), alloc_free(e->last_get), alloc_free(e->cf_kernel), alloc_free(e->adopt), alloc_free(e->end_of), alloc_free(e->adopted);
  alloc_free(e->lazy), alloc_free(e->adopt_key), alloc_free(e->adopt_zero);
  alloc_free(e->stream_j), alloc_free(e->streamed), alloc_free(e->stream_buf);
  jit_free(e->jit);
  cg_program_free(e->prog);
  if (e->arena) {
    alloc_aligned_free(e->arena, e->arena_cap);
    alloc_track(-(int64_t)e->arena_cap);
  }
  pthread_mutex_destroy(&e->mu);
  pass_attention_free(e->own_g);
  alloc_free(e);
}

/* The memory plan for these buffer sizes, under e->mu: a call with the
 * sizes of the last one takes its offsets (placing the GPT step's 480
 * temporaries took about 1% of a step). */
static size_t plan_cached(backend_exec *e, const size_t *bytes, size_t *off) {
  const cg_program *p = e->prog;
  size_t n = (size_t)p->n_buf;
  if (e->plan_bytes && !memcmp(e->plan_bytes, bytes, n * sizeof *bytes)) {
    memcpy(off, e->plan_off, n * sizeof *off);
    return e->plan_total;
  }
  size_t total = plan_arena(p, bytes, off);
  if (!e->plan_bytes) {
    e->plan_bytes = alloc_malloc(n * sizeof *bytes + 1);
    e->plan_off = alloc_calloc(n + 1, sizeof *off);
  }
  if (e->plan_bytes && e->plan_off) {
    memcpy(e->plan_bytes, bytes, n * sizeof *bytes);
    for (size_t b = 0; b < n; b++) e->plan_off[b] = p->buf[b].kind == CG_BUF_TEMP ? off[b] : 0;
    e->plan_total = total;
  } else { /* no room to keep it: plan every call */
    alloc_free(e->plan_bytes), alloc_free(e->plan_off);
    e->plan_bytes = e->plan_off = NULL;
  }
  return total;
}

/* A distinct loop kernel of a variant. */
typedef struct kern_code {
  int k;              /* kernel index */
  char *key;          /* the cache key: target, pipeline, kernel_key; NULL: none */
  size_t keylen;
  char sym[40];       /* the symbol it is compiled under */
} kern_code;

/* An object to link into the variant: a group's, or one from the cache
 * (whose id is kept beside it, in the held list kcache_get reads). */
typedef struct kern_obj {
  void *obj;
  size_t len;
} kern_obj;

/* Kernels compiled together, in one module, on one thread. */
typedef struct compile_group {
  cg_module m;
  int n;              /* kernels in m */
  const char **keys;  /* the keys of those that have one */
  size_t *keylens;
  int n_keys;
  bool keyless;       /* m holds a kernel without a key: its object is not filed */
  const char *passes;
  int64_t load;
  unsigned dump;
  FILE *dump_to;
  double opt_ms, cg_ms;
  kern_obj out;
  char err[256];
} compile_group;

static void *compile_group_run(void *arg) {
  compile_group *g = arg;
  if (!g->n) {
    jit_module_dispose(&g->m);
    return NULL;
  }
  if (jit_emit(&g->m, g->passes, g->dump, g->dump_to, &g->opt_ms, &g->cg_ms, &g->out.obj, &g->out.len, g->err,
               sizeof g->err))
    return NULL;
  /* a kernel without a key keeps its own strong name, which a later variant
   * linking this object beside its own kernels could define twice */
  if (!g->keyless) kcache_put(g->keys, g->keylens, g->n_keys, g->out.obj, g->out.len);
  return NULL;
}

/* The groups of a compile, taken in order by as many threads. Groups
 * [0, ready) may be taken: the costly kernels' groups compile while the
 * calling thread still lowers the light ones. After a failure (stop) no
 * group is taken any more. */
typedef struct group_queue {
  compile_group *grp;
  int n;
  atomic_int next;
  int ready;
  bool stop;
  pthread_mutex_t mu;
  pthread_cond_t more;
  pthread_t th[MAX_GROUPS];
  bool started[MAX_GROUPS];
} group_queue;

static void *group_queue_run(void *arg) {
  group_queue *gq = arg;
  for (int i; (i = atomic_fetch_add(&gq->next, 1)) < gq->n;) {
    pthread_mutex_lock(&gq->mu);
    while (i >= gq->ready && !gq->stop) pthread_cond_wait(&gq->more, &gq->mu);
    bool stop = gq->stop;
    pthread_mutex_unlock(&gq->mu);
    if (stop) break;
    compile_group_run(&gq->grp[i]);
  }
  return NULL;
}

/* Groups [0, ready) may be taken (stop: none may). gq->n is set before
 * any thread starts, and not written after: the threads read it unlocked. */
static void queue_ready(group_queue *gq, int ready, bool stop) {
  pthread_mutex_lock(&gq->mu);
  gq->ready = ready;
  gq->stop |= stop;
  pthread_cond_broadcast(&gq->more);
  pthread_mutex_unlock(&gq->mu);
}

/* Threads 1 .. threads - 1 take groups; the caller is thread 0. */
static void queue_start(group_queue *gq, int threads) {
  for (int t = 1; t < threads; t++) gq->started[t] = pthread_create(&gq->th[t], NULL, group_queue_run, gq) == 0;
}

static void queue_join(group_queue *gq) {
  for (int t = 1; t < MAX_GROUPS; t++)
    if (gq->started[t]) pthread_join(gq->th[t], NULL), gq->started[t] = false;
}

/* A loop kernel's signature: everything lower_kernel reads from it, with
 * each size, offset or stride that is not a constant numbered by its first
 * appearance (syms). Kernels of equal signatures lower to the same code,
 * up to which symbolic size each p[i] holds; so a kernel whose signature an
 * earlier one has is neither lowered nor printed (most kernels of a large
 * graph repeat a layer's), and runs the earlier one's code with its own
 * sizes in p. The test build lowers it anyway and checks that claim. */
typedef struct ksig {
  uint64_t *w;
  size_t n, cap;
  sym_dim *syms;
  int n_syms, cap_syms;
  uint64_t hash;
  bool oom;
  int first; /* the first loop kernel of this signature (llvm_compile) */
} ksig;

static void sig_word(ksig *s, uint64_t v) {
  if (s->n == s->cap) {
    size_t cap = s->cap ? 2 * s->cap : 64;
    uint64_t *w = alloc_realloc(s->w, sizeof *w * cap);
    if (!w) {
      s->oom = true;
      return;
    }
    s->w = w, s->cap = cap;
  }
  s->w[s->n++] = v;
  s->hash = (s->hash ^ v) * 0x100000001b3ull;
}

static void sig_dim(ksig *s, sym_dim d) {
  if (sym_is_const(d)) {
    sig_word(s, 0), sig_word(s, (uint64_t)d.c);
    return;
  }
  int i = 0;
  while (i < s->n_syms && !sym_same(s->syms[i], d)) i++;
  if (i == s->n_syms) {
    if (s->n_syms == s->cap_syms) {
      int cap = s->cap_syms ? 2 * s->cap_syms : 16;
      sym_dim *ns = alloc_realloc(s->syms, sizeof *ns * (size_t)cap);
      if (!ns) {
        s->oom = true;
        return;
      }
      s->syms = ns, s->cap_syms = cap;
    }
    s->syms[s->n_syms++] = d;
  }
  sig_word(s, 1), sig_word(s, (uint64_t)i);
}

static void kernel_sig(const cg_program *p, const cg_kernel *k, ksig *s) {
  s->hash = 0xcbf29ce484222325ull;
  sig_word(s, (uint64_t)k->ndim), sig_word(s, (uint64_t)k->n_outer);
  sig_word(s, (uint64_t)k->n_acc), sig_word(s, (uint64_t)k->n_expr), sig_word(s, (uint64_t)k->n_stage);
  for (int d = 0; d < k->ndim; d++) sig_dim(s, k->dim[d]);
  for (int a = 0; a < k->n_acc; a++) {
    const cg_access *x = &k->acc[a];
    int first = cg_first_access(k, a); /* accesses to one buffer share its pointer and alias scope */
    sig_word(s, (uint64_t)first), sig_word(s, (uint64_t)p->buf[x->buf].dtype);
    /* the offset from the pointer passed (cg_pointer_shift): the code's */
    int64_t shift = cg_pointer_shift(k, a);
    if (sym_is_const(x->offset)) {
      sig_dim(s, sym_const(x->offset.c - shift));
    } else {
      sig_dim(s, x->offset);
      sig_word(s, (uint64_t)shift);
    }
    for (int d = 0; d < k->ndim; d++) sig_dim(s, x->stride[d]);
  }
  for (int e = 0; e < k->n_expr; e++) {
    const cg_expr *x = &k->expr[e];
    sig_word(s, (uint64_t)x->kind), sig_word(s, (uint64_t)x->dtype);
    switch (x->kind) {
    case CG_LOAD: case CG_ACC:
      sig_word(s, (uint64_t)x->a);
      break;
    case CG_CONST: {
      uint64_t bits;
      memcpy(&bits, &x->c, sizeof bits);
      sig_word(s, bits);
      break;
    }
    case CG_SYM:
      sig_dim(s, x->s);
      break;
    case CG_OP:
      sig_word(s, (uint64_t)x->op), sig_word(s, (uint64_t)x->n_in), sig_word(s, (uint64_t)x->cast_to);
      for (int i = 0; i < 2; i++) { /* clamp's bounds: two kernels that differ only there run different code */
        uint64_t bits;
        memcpy(&bits, &x->num[i], sizeof bits);
        sig_word(s, bits);
      }
      for (int i = 0; i < x->n_in; i++) sig_word(s, (uint64_t)x->in[i]);
      break;
    }
  }
  for (int t = 0; t < k->n_stage; t++) {
    const cg_stage *x = &k->stage[t];
    sig_word(s, (uint64_t)x->kind), sig_word(s, (uint64_t)x->op), sig_word(s, (uint64_t)x->expr);
    sig_word(s, (uint64_t)x->store), sig_word(s, (uint64_t)x->inner);
  }
}

static bool sig_equal(const ksig *a, const ksig *b) {
  return !a->oom && !b->oom && a->hash == b->hash && a->n == b->n && a->n_syms == b->n_syms &&
         !memcmp(a->w, b->w, sizeof *a->w * a->n);
}

/* Gives dup (signature ds) the parameters of its twin k (lowered, signature
 * ks): each p[i] of k's code is a sym of k's signature, and dup's is the
 * sym of dup's at the same place. 0, or -1 (then dup is lowered itself). */
static int borrow_params(const cg_kernel *k, const ksig *ks, cg_kernel *dup, const ksig *ds) {
  sym_dim *param = alloc_calloc((size_t)k->n_param + 1, sizeof *param);
  if (!param) return -1;
  for (int i = 0; i < k->n_param; i++) {
    int t = 0;
    while (t < ks->n_syms && !sym_same(ks->syms[t], k->param[i])) t++;
    if (t == ks->n_syms) { /* a size lowering made up: not in the signature */
      alloc_free(param);
      return -1;
    }
    param[i] = ds->syms[t];
  }
  alloc_free(dup->param);
  dup->param = param;
  dup->n_param = k->n_param;
  dup->split = k->split;
  dup->own_vectors = k->own_vectors;
  return 0;
}

/* LLVM takes about 5 ms of machine code per kernel here: a compile of many
 * distinct kernels (a training step) gives its light ones (no costly op, lower_costly_ops)
 * the quick code generator, which takes half that. KILN_QUICK=0 never does,
 * KILN_QUICK=1 does in any compile. */
enum { QUICK_MIN_KERNELS = 16 };
static bool want_quick(int distinct) {
  const char *q = getenv("KILN_QUICK");
  if (q && !strcmp(q, "0")) return false;
  if (q && !strcmp(q, "1")) return true;
  return distinct >= QUICK_MIN_KERNELS;
}

bool runtime_own_vectors(void) {
  const char *v = getenv("KILN_VECTORIZE");
  return !(v && !strcmp(v, "llvm"));
}

/* Frees what compiling made, modules not compiled included. */
static void compile_free(kern_code *code, int n_code, kern_obj *objs, uint64_t *held, int n_objs, compile_group *grp,
                         int groups, int *same, char **keys, ksig *sigs, int n_k) {
  alloc_free(held);
  for (int k = 0; sigs && k < n_k; k++) alloc_free(sigs[k].w), alloc_free(sigs[k].syms);
  alloc_free(sigs);
  for (int i = 0; code && i < n_code; i++) alloc_free(code[i].key);
  for (int i = 0; objs && i < n_objs; i++) alloc_free(objs[i].obj);
  for (int q = 0; q < groups; q++) {
    jit_module_dispose(&grp[q].m);
    alloc_free(grp[q].keys);
    alloc_free(grp[q].keylens);
    alloc_free(grp[q].out.obj);
  }
  for (int k = 0; keys && k < 2 * n_k + 2; k++) alloc_free(keys[k]);
  alloc_free(keys);
  alloc_free(same);
  alloc_free(code);
  alloc_free(objs);
}

static int find_streams(backend_exec *e);

static backend_exec *llvm_compile(const ir_graph *g, unsigned dump, FILE *dump_to, char *err, size_t errn) {
#ifdef KILN_TEST_BUILD
  /* fault injection: the fallback to the interpreter must hold */
  if (getenv("KILN_TEST_FAIL_LLVM")) return snprintf(err, errn, "LLVM failure forced by KILN_TEST_FAIL_LLVM"), NULL;
#endif
  if (jit_init(err, errn)) return NULL;
  bool has_cf = false;
  const ir_graph *g0 = g;
  for (int i = 0; i < g->n_nodes; i++) has_cf |= ir_is_cf(g->nodes[i].op);
  backend_exec *e = alloc_calloc(1, sizeof *e);
  if (!e) return snprintf(err, errn, "out of memory"), NULL;
  pthread_mutex_init(&e->mu, NULL);
  e->g = g;
  e->dump = dump;
  e->dump_to = dump_to ? dump_to : stderr;
  double t0 = now_ms();
  /* attention spelled out in primitives becomes one fused kernel here, not
   * in the pass pipeline: the interpreter and kiln_export keep the ops */
  if (pass_attention(g, &e->own_g) < 0) goto oom;
  if (e->own_g) g = e->g = e->own_g;
#ifdef KILN_TEST_BUILD
  if (e->own_g && ir_verify(g, err, errn)) goto fail;
#endif
  e->prog = fuse_graph(g, err, errn);
  if (!e->prog && has_cf) {
    /* the constructs run on their compiled regions all the same */
    e->driver = true;
    g = e->g = g0;
    if (region_execs_compile(g, &backend_llvm, dump, dump_to, &e->rx, err, errn)) goto fail;
    return e;
  }
  if (!e->prog) goto fail;
  cg_program *p = e->prog;
  if (has_cf) {
    double tr = now_ms(); /* the regions' compile times are their own: not this graph's front */
    if (region_execs_compile(g, &backend_llvm, dump, dump_to, &e->rx, err, errn)) goto fail;
    t0 += now_ms() - tr;
    if (!(e->cf_of = alloc_malloc(sizeof *e->cf_of * (size_t)g->n_nodes))) goto oom;
    for (int i = 0; i < g->n_nodes; i++) e->cf_of[i] = ir_is_cf(g->nodes[i].op) ? e->n_cf++ : -1;
    e->last_get = alloc_malloc(sizeof *e->last_get * (size_t)e->n_cf);
    e->cf_kernel = alloc_malloc(sizeof *e->cf_kernel * (size_t)e->n_cf);
    e->adopt = alloc_calloc((size_t)p->n_buf + 1, sizeof *e->adopt);
    e->end_of = alloc_calloc((size_t)p->n_buf + 1, sizeof *e->end_of);
    e->adopted = alloc_calloc((size_t)p->n_buf + 1, sizeof *e->adopted);
    if (!e->last_get || !e->cf_kernel || !e->adopt || !e->end_of || !e->adopted) goto oom;
    for (int c = 0; c < e->n_cf; c++) e->last_get[c] = e->cf_kernel[c] = -1;
    for (int ki = 0; ki < p->n_k; ki++) {
      const cg_kernel *k = &p->k[ki];
      const ir_node *n = &g->nodes[k->node];
      if (k->kind == CG_K_EAGER && ir_is_cf(n->op)) e->cf_kernel[e->cf_of[k->node]] = ki;
      if (k->kind != CG_K_EAGER || n->op != IR_GET) continue;
      e->last_get[e->cf_of[n->in[0]]] = ki;
      const cg_buf *bf = &p->buf[k->out_buf];
      bool whole = p->views[k->node].buf == k->out_buf && bf->node == k->node;
      if (whole && bf->alias_of < 0 && bf->scratch_of < 0 && (bf->kind == CG_BUF_TEMP || bf->kind == CG_BUF_OUTPUT) &&
          !e->adopt[k->out_buf]) {
        e->adopt[k->out_buf] = true;
        e->adopted[e->n_adopted++] = k->out_buf;
        e->end_of[k->out_buf] = bf->kind == CG_BUF_OUTPUT ? p->n_k : bf->last;
      }
    }
    if (find_streams(e)) goto oom;
  }
  e->fn = alloc_calloc((size_t)p->n_k + 1, sizeof *e->fn);
  e->consts = alloc_calloc((size_t)p->n_buf + 1, sizeof *e->consts);
  e->staged = alloc_calloc((size_t)p->n_k + 1, 1);
  if (!e->fn || !e->consts || !e->staged) goto oom;
  for (int k = 0; k < p->n_k; k++) {
    const cg_kernel *kk = &p->k[k];
    e->staged[k] = kk->kind != CG_K_LOOP || !cg_staged(kk) ? 0 : lower_is_jammed(kk) ? RT_STAGED_DOT : 1;
    e->has_dot |= e->staged[k] == RT_STAGED_DOT;
  }
  if (!(e->leaves = ir_leaf_ids(g, &e->n_leaves))) goto oom;
  if (!(e->lazy = alloc_malloc(sizeof *e->lazy * ((size_t)p->n_buf + 1)))) goto oom;
  for (int b = 0; b < p->n_buf; b++) {
    if (p->buf[b].kind != CG_BUF_OUTPUT || p->buf[b].first < 0 || (e->adopt && e->adopt[b])) continue;
    int i = e->n_lazy++; /* in order of their first writers: outputs are few */
    for (; i > 0 && p->buf[e->lazy[i - 1]].first > p->buf[b].first; i--) e->lazy[i] = e->lazy[i - 1];
    e->lazy[i] = b;
  }
  if (prep_init(&e->prep, p)) goto oom;
  for (int b = 0; b < p->n_buf; b++) e->temps |= p->buf[b].kind == CG_BUF_TEMP;
  e->last_allreduce = -1;
  for (int k = 0; k < p->n_k; k++)
    if (p->k[k].kind != CG_K_LOOP && g->nodes[p->k[k].node].op == OP_ALLREDUCE) e->last_allreduce = k;
  for (int b = 0; b < p->n_buf; b++)
    if (p->buf[b].kind == CG_BUF_CONST && !(e->consts[b] = ir_const_tensor(&g->nodes[p->buf[b].node]))) goto oom;
  /* Kernels go into groups, one module each, optimized and compiled on as
   * many threads (LLVM's time dominates compiling a big graph). A kernel
   * whose code is another's (a repeated layer, the same optimizer update on
   * weights of one shape) is not compiled again, nor one the kernel cache
   * has (kcache.c): its object is linked instead. A compile that dumps LLVM
   * IR or machine code compiles every kernel, in one module, under its own
   * name. */
  bool dumping = dump & (KILN_DUMP_LLVM | KILN_DUMP_ASM);
  int loops = 0, exprs = 0;
  for (int k = 0; k < p->n_k; k++)
    if (p->k[k].kind == CG_K_LOOP) loops++, exprs += p->k[k].n_expr;
  int threads = pool_num_threads();
  if (threads > MAX_GROUPS) threads = MAX_GROUPS;
  if (threads > loops) threads = loops;
  if (loops < 4 || exprs < 200 || dumping) threads = loops ? 1 : 0;
  /* with the quick code generator, its kernels and the others go to groups
   * of their own (jit_emit compiles an all-quick module at level None):
   * groups [0, threads) take the costly kernels, the n_light after them the
   * light ones (two a thread: the threads' ends come closer). A compile
   * that dumps keeps one module. */
  compile_group grp[3 * MAX_GROUPS] = {0};
  int groups = 0;
  group_queue gq = {.grp = grp, .mu = PTHREAD_MUTEX_INITIALIZER, .more = PTHREAD_COND_INITIALIZER};
  /* read once: the key and the compile must agree on the pipeline */
  const char *target = jit_target_id(), *passes = jit_passes();
  int n_same = 0, n_code = 0, n_objs = 0, n_cached = 0, n_disk = 0;
  kern_code *code = alloc_calloc((size_t)p->n_k + 1, sizeof *code);
  kern_obj *objs = alloc_calloc((size_t)p->n_k + MAX_GROUPS, sizeof *objs);
  uint64_t *held = alloc_calloc((size_t)p->n_k + 1, sizeof *held); /* the ids of objs */
  int *same = alloc_malloc(sizeof(int) * (size_t)p->n_k + 1);
  /* keys, then (test build) each one's printed form */
  char **keys = alloc_calloc(2 * (size_t)p->n_k + 2, sizeof *keys), **tkeys = keys ? keys + p->n_k + 1 : NULL;
  (void)tkeys;
  ksig *sigs = alloc_calloc((size_t)p->n_k + 1, sizeof *sigs);
  if (!code || !objs || !held || !same || !keys || !sigs) goto oom_compile;
  for (int k = 0; k < p->n_k; k++) same[k] = -1;
  /* signatures first: how many differ decides the code generator, and the
   * first kernel of k's signature is where k's twin is looked for */
  int distinct = 0, n_quick = 0;
  for (int k = 0; k < p->n_k; k++) {
    if (p->k[k].kind != CG_K_LOOP) continue;
    kernel_sig(p, &p->k[k], &sigs[k]);
    int j = 0;
    while (j < k && !(p->k[j].kind == CG_K_LOOP && sig_equal(&sigs[j], &sigs[k]))) j++;
    sigs[k].first = j;
    distinct += j == k;
  }
  bool quick = want_quick(distinct), own_vectors = runtime_own_vectors();
  int n_light = threads > 1 ? 2 * threads : 1;
  groups = quick && !dumping && threads ? threads + n_light : threads;
  gq.n = groups;
  for (int q = 0; q < groups; q++) {
    grp[q].keys = alloc_calloc((size_t)p->n_k + 1, sizeof *grp[q].keys);
    grp[q].keylens = alloc_calloc((size_t)p->n_k + 1, sizeof *grp[q].keylens);
    grp[q].dump = dump;
    grp[q].dump_to = e->dump_to;
    grp[q].passes = passes;
    if (!grp[q].keys || !grp[q].keylens) goto oom_compile;
    if (jit_module_new(&grp[q].m, g->name, err, errn)) goto fail_compile;
  }
  /* with light groups of their own, the costly kernels are lowered first,
   * and their groups compile on the other threads while this one lowers
   * the light kernels */
  bool early = groups > threads && threads > 1;
  for (int pass = early ? 0 : 1; pass < 2; pass++) {
    for (int k = 0; k < p->n_k && groups; k++) {
      if (p->k[k].kind != CG_K_LOOP) continue;
      int costly = lower_costly_ops(&p->k[k]);
      /* a kernel of one element has no loop for the full generator to make fast */
      bool light = quick && (!costly || p->k[k].ndim == 0);
      if (early && (pass == 0) == light) continue;
      p->k[k].own_vectors = light && own_vectors;
      int from = groups > threads && light ? threads : 0, n_kind = groups > threads && light ? n_light : threads;
      int to = from; /* the least loaded group of its kind */
      for (int q = from + 1; q < from + n_kind; q++)
        if (grp[q].load < grp[to].load) to = q;
      int twin = -1;
      for (int j = sigs[k].first; j < k && twin < 0; j++)
        if (p->k[j].kind == CG_K_LOOP && keys[j] && sig_equal(&sigs[j], &sigs[k])) twin = j;
      if (twin >= 0 && borrow_params(&p->k[twin], &sigs[twin], &p->k[k], &sigs[k])) twin = -1;
#ifdef KILN_TEST_BUILD
      sym_dim *borrowed = NULL;
      int n_borrowed = 0;
      if (twin >= 0) { /* lowered all the same, to check the claim */
        borrowed = p->k[k].param, n_borrowed = p->k[k].n_param;
        p->k[k].param = NULL, p->k[k].n_param = 0;
      }
#else
      if (twin >= 0) {
        same[k] = twin;
        n_same++;
        continue;
      }
#endif
      char why[256] = "";
#ifdef KILN_TEST_BUILD
      /* fault injection: a light kernel fails to lower while the costly
       * kernels' groups compile; the threads must stop and be joined */
      const char *fail = getenv("KILN_TEST_FAIL_LOWERING");
      if (fail && !strcmp(fail, "light") && early && light) snprintf(why, sizeof why, "%s: forced", p->k[k].name);
      if (why[0] || lower_kernel(p, &p->k[k], grp[to].m.mod, why, sizeof why)) {
#else
      if (lower_kernel(p, &p->k[k], grp[to].m.mod, why, sizeof why)) {
#endif
        snprintf(err, errn, "lowering failed: %s", why[0] ? why : p->k[k].name);
#ifdef KILN_TEST_BUILD
        alloc_free(borrowed);
#endif
        goto fail_compile;
      }
      LLVMValueRef fn = LLVMGetNamedFunction(grp[to].m.mod, p->k[k].name);
      light = light && fn;
      if (light) LLVMAddTargetDependentFunctionAttr(fn, CG_QUICK_ATTR, "");
      keys[k] = fn ? kernel_key(fn, &p->k[k], false) : NULL;
      for (int j = 0; j < k && keys[k] && same[k] < 0; j++)
        if (keys[j] && !strcmp(keys[j], keys[k])) same[k] = j;
#ifdef KILN_TEST_BUILD
      /* two kernels the walk takes for the same must print the same: the
       * walk missed nothing. (The printer may take for the same two the
       * walk tells apart: a function's text names its loop metadata but
       * does not show it, which the walk reads; seed 80052 in C mode.) */
      if (fn && !(tkeys[k] = kernel_key(fn, &p->k[k], true))) goto oom_compile;
      for (int j = 0; j < k && keys[k]; j++) {
        if (!keys[j] || !tkeys[j]) continue;
        if (!strcmp(keys[j], keys[k]) && strcmp(tkeys[j], tkeys[k])) {
          snprintf(err, errn, "the keys of %s and %s are equal but their printed code is not", p->k[j].name, p->k[k].name);
          goto fail_compile;
        }
      }
#endif
#ifdef KILN_TEST_BUILD
      if (twin >= 0) {
        bool ok = keys[k] && !strcmp(keys[k], keys[twin]) && n_borrowed == p->k[k].n_param;
        for (int i = 0; ok && i < n_borrowed; i++) ok = sym_same(borrowed[i], p->k[k].param[i]);
        alloc_free(borrowed);
        if (!ok) {
          snprintf(err, errn, "%s has the signature of %s but not its code or sizes", p->k[k].name, p->k[twin].name);
          goto fail_compile;
        }
      }
#endif
      if (same[k] >= 0) {
        LLVMDeleteFunction(fn);
        n_same++;
        continue;
      }
      kern_code *c = &code[n_code++];
      c->k = k;
      n_quick += light;
      snprintf(c->sym, sizeof c->sym, "%s", p->k[k].name);
      /* a compile that dumps the code keeps the kernels' own names, and so
       * stays out of the cache (its symbols are the key's hash) */
      if (keys[k] && !dumping) {
        /* the key names the code generator: the text of a light kernel is the same either way */
        const char *gen = light ? "quick" : "full";
        size_t tl = strlen(target), pl = strlen(passes), gl = strlen(gen), kl = strlen(keys[k]);
        c->keylen = tl + pl + gl + kl + 3;
        if (!(c->key = alloc_malloc(c->keylen + 1))) goto oom_compile;
        snprintf(c->key, c->keylen + 1, "%s\n%s\n%s\n%s", target, passes, gen, keys[k]);
        kcache_symbol(c->key, c->keylen, c->sym);
        kern_obj o;
        uint64_t id;
        bool disk = false;
        if (kcache_get(c->key, c->keylen, held, n_objs, &o.obj, &o.len, &id, &disk)) {
          if (o.obj) held[n_objs] = id, objs[n_objs++] = o; /* else one of objs already */
          n_cached++, n_disk += disk;
          LLVMDeleteFunction(fn);
          continue;
        }
        /* weak: two objects linked into one variant may both hold it */
        LLVMSetValueName2(fn, c->sym, strlen(c->sym));
        LLVMSetLinkage(fn, LLVMWeakODRLinkage);
        grp[to].keys[grp[to].n_keys] = c->key;
        grp[to].keylens[grp[to].n_keys++] = c->keylen;
      } else {
        grp[to].keyless = true;
      }
      grp[to].n++;
      /* a costly op's polynomial is tens of instructions */
      grp[to].load += p->k[k].n_expr + 8 + 40 * costly;
    }
    if (pass == 0 && early) { /* the costly groups are whole */
      queue_ready(&gq, threads, false);
      queue_start(&gq, threads);
    }
  }
  double t1 = now_ms(), opt_ms = 0, cg_ms = 0;
  if (dump & KILN_DUMP_KERNELS) {
    if (e->own_g) { /* the kernels name the nodes of this graph, not of the `graph` dump's */
      fprintf(e->dump_to, "after the attention pass:\n");
      ir_print(g, e->dump_to);
    }
    fuse_dump(p, e->dump_to);
    fprintf(e->dump_to, "fusion and lowering: %.2f ms\n", t1 - t0);
  }
  /* each thread takes the next group not taken: the costly kernels' first
   * (each takes longest for its size), the light ones' then fill the gaps */
  queue_ready(&gq, groups, false);
  if (!early) queue_start(&gq, threads);
  group_queue_run(&gq);
  queue_join(&gq);
  bool failed = false;
  for (int q = 0; q < groups; q++) {
    opt_ms += grp[q].opt_ms;
    cg_ms += grp[q].cg_ms;
    if (grp[q].err[0] && !failed) snprintf(err, errn, "%s", grp[q].err), failed = true;
  }
  if (failed) goto fail_compile;
  double t2 = now_ms();
  if (!(e->jit = jit_new(err, errn))) goto fail_compile;
  for (int q = 0; q < groups; q++)
    if (grp[q].out.obj && jit_add(e->jit, grp[q].out.obj, grp[q].out.len, g->name, err, errn)) goto fail_compile;
  for (int i = 0; i < n_objs; i++)
    if (jit_add(e->jit, objs[i].obj, objs[i].len, g->name, err, errn)) goto fail_compile;
  for (int i = 0; i < n_code; i++)
    if (jit_expect(e->jit, code[i].sym, p->k[code[i].k].name)) goto oom_compile;
  if (jit_link(e->jit, err, errn)) goto fail_compile;
  for (int i = 0; i < n_code; i++) e->fn[code[i].k] = (kern_fn)jit_lookup(e->jit, code[i].sym);
  for (int k = 0; k < p->n_k; k++) {
    if (p->k[k].kind != CG_K_LOOP) continue;
    if (same[k] >= 0) e->fn[k] = e->fn[same[k]];
    if (!e->fn[k]) {
      snprintf(err, errn, "kernel %s not found after compiling", p->k[k].name);
      goto fail_compile;
    }
  }
  cg_ms += now_ms() - t2;
  if (dump & KILN_DUMP_KERNELS) {
    if (n_same) {
      fprintf(e->dump_to, "shared code: %d of %d loop kernels run another's (", n_same, loops);
      for (int k = 0, shown = 0; k < p->n_k; k++)
        if (same[k] >= 0 && shown++ < 12) fprintf(e->dump_to, "%s%s=%s", shown > 1 ? " " : "", p->k[k].name, p->k[same[k]].name);
      fprintf(e->dump_to, "%s)\n", n_same > 12 ? " ..." : "");
    }
    if (n_quick)
      fprintf(e->dump_to, "quick code generator: %d of %d distinct kernels (the light ones, %s)\n", n_quick, n_code,
              groups > threads ? "in modules of their own at level None" : "optnone in one module with the others");
    if (n_cached)
      fprintf(e->dump_to, "kernel cache: %d of %d distinct kernels compiled before (%d from KILN_CACHE_DIR)\n", n_cached,
              n_code, n_disk);
    fprintf(e->dump_to, "compile time: fuse+lower %.2f ms, LLVM optimize %.2f ms, machine code %.2f ms\n", t1 - t0, opt_ms,
            cg_ms);
  }
  compile_free(code, n_code, objs, held, n_objs, grp, groups, same, keys, sigs, p->n_k);
  /* the plan is printed at the first call, when the sizes are known; the
   * caller closes a dump file after compiling, so keep a handle of our own on
   * the same open file (appending) until then */
  if (e->dump_to != stderr) {
    int fd = (dump & KILN_DUMP_KERNELS) ? dup(fileno(e->dump_to)) : -1;
    e->dump_to = fd >= 0 ? fdopen(fd, "a") : NULL;
    if (!e->dump_to && fd >= 0) close(fd);
    e->own_dump = e->dump_to != NULL;
  }
  e->front_ms = t1 - t0;
  e->opt_ms = opt_ms;
  e->machine_ms = cg_ms;
  return e;
oom_compile:
  snprintf(err, errn, "out of memory");
fail_compile:
  queue_ready(&gq, 0, true); /* the threads started take no more groups */
  queue_join(&gq);
  compile_free(code, n_code, objs, held, n_objs, grp, groups, same, keys, sigs, p->n_k);
  goto fail;
oom:
  snprintf(err, errn, "out of memory");
fail:
  exec_free(e);
  return NULL;
}

/* ---- running ---- */

/* c = alpha * a @ b + beta * c for 2-D float views, c contiguous: a GEMM
 * with an epilogue folded in (fuse.c, fold_epilogues). 0 or -1. */
static int gemm_into(kiln_tensor *a, kiln_tensor *b, double alpha, double beta, kiln_tensor *c) {
  kiln_tensor *ca = NULL, *cb = NULL;
  int64_t m = a->shape[0], k = a->shape[1], n = b->shape[1], lda = 1, ldb = 1;
  CBLAS_TRANSPOSE ta = CblasNoTrans, tb = CblasNoTrans;
  if (cblas_layout(m, k, a->stride[0], a->stride[1], &ta, &lda)) {
    if (!(ca = op_run(OP_COPY, &a, 1, NULL, "", 0))) return -1;
    a = ca;
    cblas_layout(m, k, a->stride[0], a->stride[1], &ta, &lda);
  }
  if (cblas_layout(k, n, b->stride[0], b->stride[1], &tb, &ldb)) {
    if (!(cb = op_run(OP_COPY, &b, 1, NULL, "", 0))) {
      kiln_release(ca);
      return -1;
    }
    b = cb;
    cblas_layout(k, n, b->stride[0], b->stride[1], &tb, &ldb);
  }
  if (m > 0 && n > 0 && k > 0) {
    if (c->dtype == KILN_F32)
      gemm_sgemm(ta, tb, m, n, k, (float)alpha, tensor_data(a), lda, tensor_data(b), ldb, (float)beta, tensor_data(c), n);
    else
      cblas_dgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, alpha, tensor_data(a), (int)lda, tensor_data(b), (int)ldb,
                  beta, tensor_data(c), (int)n);
  }
  kiln_release(ca);
  kiln_release(cb);
  return 0;
}

/* A tensor header over memory the runtime owns (no refcount; never released). */
typedef struct tview {
  kiln_tensor t;
  storage st;
} tview;

/* Where a view of an empty buffer (NULL: no bytes, no arena place) points:
 * eager kernels take a storage's data as never NULL, as eager's own storage
 * is, and add offsets to it. Nothing is read or written there. */
static _Alignas(64) char empty_data[64];

static int make_view(tview *v, char *base, kiln_dtype dt, const ir_node *n, const cg_view *m, const int64_t *vals,
                     int nvals) {
  memset(v, 0, sizeof *v);
  v->st.data = base ? base : empty_data;
  v->st.bytes = 0;
  atomic_init(&v->st.refcount, 1 << 30);
  v->t.st = &v->st;
  v->t.dtype = dt;
  v->t.ndim = n->ndim;
  atomic_init(&v->t.refs, 1u << 30);
  if (sym_eval(m->off, vals, nvals, &v->t.offset)) return -1;
  for (int i = 0; i < n->ndim; i++)
    if (sym_eval(n->shape[i], vals, nvals, &v->t.shape[i]) || sym_eval(m->stride[i], vals, nvals, &v->t.stride[i])) return -1;
  return 0;
}

/* The bytes of working memory kernel k (an eager kernel that takes some)
 * needs at these symbol values: its op's, on its operands' shapes; with
 * prep, also the bytes of its prepared weight (prepare.c; 0: none) and its
 * working memory when it reads that. 0 or -1. */
static int scratch_size(const cg_program *p, const cg_kernel *k, const int64_t *vals, int nvals, size_t *bytes,
                        size_t *prep, size_t *prep_scratch) {
  const ir_graph *g = p->g;
  const ir_node *n = &g->nodes[k->node];
  tview tv[3];
  kiln_tensor *ins[3];
  op_attrs at;
  if (n->n_in > 3 || ir_attrs_eval(n, vals, nvals, &at)) return -1;
  for (int j = 0; j < n->n_in; j++) {
    const ir_node *x = &g->nodes[n->in[j]];
    if (make_view(&tv[j], NULL, x->dtype, x, &p->views[n->in[j]], vals, nvals)) return -1;
    ins[j] = &tv[j].t;
  }
  if (bytes) *bytes = conv_scratch_bytes((op_id)n->op, ins, &at);
  if (prep) {
    *prep = conv_prepared_bytes((op_id)n->op, ins, &at);
    *prep_scratch = *prep ? conv_prepared_scratch_bytes((op_id)n->op, ins, &at) : 0;
  }
  return 0;
}

/* The bytes of the values g's ops make at these sizes, one tensor each as
 * eager makes them (views make none): what an eager call holds at its end
 * while its scope keeps its results. */
static size_t values_bytes(const ir_graph *g, const int64_t *vals) {
  size_t total = 0;
  int64_t shape[MAXD];
  for (int i = 0; i < g->n_nodes; i++) {
    const ir_node *n = &g->nodes[i];
    if (n->op >= OP_COUNT || op_table[n->op].kind == KIND_VIEW || ir_node_shape(n, vals, g->n_syms, shape)) continue;
    total += (size_t)shape_numel(n->ndim, shape) * kiln_dtype_size(n->dtype);
  }
  return total;
}

static int64_t eval_or(sym_dim d, const int64_t *vals, int n) {
  int64_t v = 0;
  return sym_eval(d, vals, n, &v) ? -1 : v;
}

/* Compares kernel k's result buffer, just after it ran (the plan reuses
 * memory later), with the interpreter's value of its node; 1 and a report
 * when they differ. */
static int compare_kernel(backend_exec *e, const cg_kernel *k, char *const *bufs, const int64_t *vals,
                          kiln_tensor *const *all, char *report, size_t rn) {
  const ir_graph *g = e->g;
  if (k->out_buf < 0 || k->result_node < 0) return 0;
  /* the kernel's own node: the buffer may hold another's value before it (in-place reuse) */
  const ir_node *n = &g->nodes[k->result_node];
  tview v;
  cg_view whole = {k->out_buf, sym_const(0), {{0}}};
  sym_dim acc = sym_const(1);
  for (int d = n->ndim - 1; d >= 0; d--) {
    whole.stride[d] = acc;
    acc = sym_mul(g->sym, acc, n->shape[d]);
  }
  if (!all[k->result_node] || make_view(&v, bufs[k->out_buf], n->dtype, n, &whole, vals, g->n_syms)) return 0;
  int64_t cnt = kiln_numel(&v.t), worst_at = -1;
  double worst = 0, tol = dtype_check_tol(n->dtype);
  for (int64_t i = 0; i < cnt; i++) {
    double x = tensor_get(&v.t, i), y = tensor_get(all[k->result_node], i);
    if (x == y || (x != x && y != y)) continue;
    double d = fabs(x - y);
    if (!(d <= tol * (1 + fabs(y))) && !(d <= worst)) {
      worst = d != d ? INFINITY : d;
      worst_at = i;
    }
  }
  if (worst_at < 0) return 0;
  int w = snprintf(report, rn, "kernel %s differs from the interpreter: max abs error %g (element %lld); its nodes:", k->name,
                   worst, (long long)worst_at);
  for (int j = 0; j < k->n_nodes && w > 0 && (size_t)w < rn; j++) {
    const ir_node *m = &g->nodes[k->nodes[j]];
    w += snprintf(report + w, rn - (size_t)w, " %%%d %s", k->nodes[j], ir_op_name(m->op));
    if (m->file && *m->file && (size_t)w < rn) w += snprintf(report + w, rn - (size_t)w, " (%s:%d)", m->file, m->line);
  }
  return 1;
}

/* Allreduces in flight (dist.c) write their buffers until waited for: before
 * a kernel touches a buffer (reads it, or writes it: any overlap of bytes,
 * so aliases and reused arena space count), the ones on it complete. */
static int wait_buf(dist_pending *q, const cg_program *p, int b, char *const *bufs, kiln_tensor *const *tens,
                    const size_t *bytes) {
  if (!dist_busy(q) || b < 0 || !bufs[b]) return 0;
  size_t span = tens[b] ? (size_t)shape_numel(tens[b]->ndim, tens[b]->shape) * kiln_dtype_size(tens[b]->dtype)
                : p->buf[b].alias_of >= 0 ? bytes[p->buf[b].alias_of]
                                          : bytes[b];
  return dist_wait(q, bufs[b], span ? span : 1);
}

static int wait_kernel(dist_pending *q, const cg_program *p, const ir_graph *g, const cg_kernel *k, char *const *bufs,
                       kiln_tensor *const *tens, const size_t *bytes) {
  if (!dist_busy(q)) return 0;
  dist_poll(q); /* MPI moves them along only inside its calls: between kernels is when */
  int bad = 0;
  if (k->kind == CG_K_LOOP) {
    for (int a = 0; a < k->n_acc && !bad; a++) bad = wait_buf(q, p, k->acc[a].buf, bufs, tens, bytes);
    return bad;
  }
  const ir_node *n = &g->nodes[k->node];
  for (int j = 0; j < n->n_in && !bad; j++) bad = wait_buf(q, p, p->views[n->in[j]].buf, bufs, tens, bytes);
  if (!bad) bad = wait_buf(q, p, k->out_buf, bufs, tens, bytes);
  if (!bad) bad = wait_buf(q, p, k->scratch_buf, bufs, tens, bytes);
  return bad;
}

/* The output whose tensor into[] gives buffer b's memory: an output that is
 * b's whole value, contiguous, where into[] has a contiguous tensor of its
 * size; -1 none. */
static int into_output(const backend_exec *e, int b, kiln_tensor *const *into) {
  const cg_program *p = e->prog;
  const ir_graph *g = e->g;
  const cg_buf *bf = &p->buf[b];
  for (int i = 0; into && i < g->n_outputs; i++) {
    int o = g->outputs[i];
    const cg_view *m = &p->views[o];
    if (o != bf->node || m->buf != b || !sym_same(m->off, sym_const(0)) || !into[i]) continue;
    if (into[i]->dtype != bf->dtype || !tensor_contiguous(into[i])) continue;
    return i;
  }
  return -1;
}

/* The graph's writes, after every read: a grad write's condition is read
 * before any data write can change it. 0, -1 out of memory, -2 a size that
 * does not evaluate. */
static int apply_writes(const ir_graph *g, const cg_program *p, char *const *bufs, const int64_t *vals,
                        kiln_tensor *const *in, kiln_tensor *const *params) {
  int ns = g->n_syms, rc = 0;
  bool skip_small[64], *skip = g->n_writes <= 64 ? skip_small : alloc_calloc((size_t)g->n_writes, sizeof *skip);
  if (!skip) return -1;
  for (int i = 0; i < g->n_writes && !rc; i++) {
    const ir_write *w = &g->writes[i];
    tview c;
    if (w->has_cond && make_view(&c, bufs[p->views[w->cond].buf], g->nodes[w->cond].dtype, &g->nodes[w->cond],
                                 &p->views[w->cond], vals, ns))
      rc = -2;
    else skip[i] = ir_write_skipped(g, w, vals, w->has_cond ? &c.t : NULL);
  }
  for (int i = 0; i < g->n_writes && !rc; i++) {
    const ir_write *w = &g->writes[i];
    kiln_tensor *dst = ir_leaf_tensor(g, &g->nodes[w->target], in, params), *gv = NULL;
    if (skip[i] && !w->else_none) continue;
    if (!skip[i] && w->value >= 0) {
      const cg_view *m = &p->views[w->value];
      tview v;
      if (make_view(&v, bufs[m->buf], g->nodes[w->value].dtype, &g->nodes[w->value], m, vals, ns)) {
        rc = -2;
        break;
      }
      if (w->kind == IR_WRITE_DATA) {
        /* a GEMM that updated the argument in place left nothing to copy */
        if (tensor_data(dst) != tensor_data(&v.t) || !tensor_contiguous(dst)) pw_copy(dst, &v.t);
        atomic_fetch_add(&dst->st->version, 1);
        continue;
      }
      kiln_tensor *src = &v.t;
      if (!(gv = op_run(OP_COPY, &src, 1, NULL, w->file, w->line))) {
        rc = -1;
        break;
      }
    }
    kiln_release(dst->grad);
    dst->grad = gv; /* skipped with else_none: NULL */
  }
  if (skip != skip_small) alloc_free(skip);
  return rc;
}

/* The scans whose xs operand a matmul just before makes, row t of its
 * result from row t of its left operand alone (a weight on the right), in
 * a buffer only the scan reads: e->stream_j, streamed, stream_buf. 0, or
 * -1 out of memory. */
static int find_streams(backend_exec *e) {
  cg_program *p = e->prog;
  const ir_graph *g = e->g;
  e->stream_j = alloc_malloc(sizeof *e->stream_j * ((size_t)p->n_k + 1));
  e->streamed = alloc_calloc((size_t)p->n_k + 1, sizeof *e->streamed);
  e->stream_buf = alloc_calloc((size_t)p->n_buf + 1, sizeof *e->stream_buf);
  if (!e->stream_j || !e->streamed || !e->stream_buf) return -1;
  for (int ki = 0; ki < p->n_k; ki++) e->stream_j[ki] = -1;
  for (int si = 1; si < p->n_k; si++) {
    const cg_kernel *S = &p->k[si], *M = &p->k[si - 1];
    const ir_node *sn = &g->nodes[S->node];
    if (S->kind != CG_K_EAGER || sn->op != IR_SCAN || M->kind != CG_K_MATMUL || M->beta != 0 || M->alpha != 1 ||
        M->result_node != M->node || M->scratch_buf >= 0 || M->out_buf < 0)
      continue;
    const ir_node *mn = &g->nodes[M->node];
    const cg_buf *bf = &p->buf[M->out_buf];
    /* only the scan reads it (a reader after, an output or a buffer stored in place in it would extend last) */
    if (bf->kind != CG_BUF_TEMP || bf->alias_of >= 0 || bf->node != M->node || bf->first != si - 1 || bf->last != si ||
        p->views[M->node].buf != M->out_buf || !sym_same(p->views[M->node].off, sym_const(0)))
      continue;
    int j = -1, uses = 0;
    for (int q = 0; q < sn->n_in; q++)
      if (sn->in[q] == M->node) uses++, j = q;
    /* and no other operand is a view of it (it would read all T steps) */
    for (int q = 0; q < sn->n_in; q++)
      if (sn->in[q] != M->node && p->views[sn->in[q]].buf == M->out_buf) uses++;
    if (uses != 1 || j < sn->n_carry || j >= sn->n_carry + sn->n_xs || mn->op != OP_MATMUL) continue;
    const ir_node *a = &g->nodes[mn->in[0]], *w = &g->nodes[mn->in[1]];
    if (w->ndim != 2 || a->ndim < 2 || mn->ndim != a->ndim || !sym_same(a->shape[0], mn->shape[0])) continue;
    /* the matmul's operands are read inside the scan's kernel now: they live until it */
    for (int q = 0; q < 2; q++) {
      int b = p->views[mn->in[q]].buf;
      for (int hop = 0; b >= 0 && hop < 2; hop++, b = p->buf[b].alias_of) {
        if (p->buf[b].last >= 0 && p->buf[b].last < si) p->buf[b].last = si;
        if (e->adopt[b] && e->end_of[b] < si) e->end_of[b] = si;
      }
    }
    e->stream_j[si] = j;
    e->streamed[si - 1] = true;
    e->stream_buf[M->out_buf] = true;
  }
  return 0;
}

/* A streamed projection's next n rows, from step t: the matmul kernel mi
 * on rows [t, t + n) of its left operand, into rows 0 .. n-1 of its buffer. */
typedef struct stream_ctx {
  const backend_exec *e;
  int mi;
  char *const *bufs;
  const int64_t *vals;
} stream_ctx;

static int stream_fill(void *ctx, int64_t t, int64_t n) {
  const stream_ctx *c = ctx;
  const cg_program *p = c->e->prog;
  const ir_graph *g = c->e->g;
  const cg_kernel *M = &p->k[c->mi];
  const ir_node *mn = &g->nodes[M->node], *a = &g->nodes[mn->in[0]], *w = &g->nodes[mn->in[1]];
  int ns = g->n_syms;
  tview av, wv, ov;
  op_attrs at;
  if (make_view(&av, c->bufs[p->views[mn->in[0]].buf], a->dtype, a, &p->views[mn->in[0]], c->vals, ns) ||
      make_view(&wv, c->bufs[p->views[mn->in[1]].buf], w->dtype, w, &p->views[mn->in[1]], c->vals, ns) ||
      make_view(&ov, c->bufs[M->out_buf], mn->dtype, mn, &p->views[M->node], c->vals, ns) ||
      ir_attrs_eval(mn, c->vals, ns, &at))
    return err_set("", 0, "call", "%s: a size does not evaluate", g->name), -1;
  av.t.offset += t * av.t.stride[0];
  av.t.shape[0] = ov.t.shape[0] = n;
  kiln_tensor *ins[2] = {&av.t, &wv.t};
  if (op_kernel(OP_MATMUL, ins, 2, &at, &ov.t))
    return err_set(mn->file, mn->line, "matmul", "%s: %%%d: the kernel failed: %s", g->name, M->node, err_kernel_failed()),
           -1;
  return 0;
}

/* A call's peak at these sizes: the arena, plus the most that tensors
 * outside it hold at once (outputs from their first writer on; a
 * construct's results from its kernel to their last get, or, where a get
 * takes one as its buffer's memory, to that buffer's last reader). bytes:
 * this call's, 0 where a get takes its result; full: the buffers' own. */
static size_t call_peak(const backend_exec *e, const size_t *bytes, const size_t *full, size_t *off, int64_t *delta) {
  const cg_program *p = e->prog;
  const ir_graph *g = e->g;
  size_t arena = plan_arena(p, bytes, off);
  memset(delta, 0, sizeof *delta * ((size_t)p->n_k + 2));
  for (int b = 0; b < p->n_buf; b++)
    if (p->buf[b].kind == CG_BUF_OUTPUT && p->buf[b].first >= 0 && !e->adopt[b]) delta[p->buf[b].first] += (int64_t)full[b];
  for (int ki = 0; ki < p->n_k; ki++) {
    const cg_kernel *k = &p->k[ki];
    const ir_node *n = &g->nodes[k->node];
    if (k->kind != CG_K_EAGER || n->op != IR_GET) continue;
    int b = k->out_buf, c = e->cf_of[n->in[0]];
    bool taken = e->adopt[b] && (p->buf[b].kind == CG_BUF_OUTPUT || !bytes[b]);
    int end = !taken ? e->last_get[c] : p->buf[b].kind == CG_BUF_OUTPUT ? p->n_k : e->end_of[b];
    delta[e->cf_kernel[c]] += (int64_t)full[b];
    delta[end + 1] -= (int64_t)full[b];
  }
  int64_t live = 0, most = 0;
  for (int ki = 0; ki <= p->n_k; ki++) {
    live += delta[ki];
    if (live > most) most = live;
  }
  return arena + (size_t)most;
}

/* Whether each get's buffer in the arena is its construct's result itself
 * (bytes 0: no copy, no place in the arena) or a copy of it there:
 * whichever makes the call's peak (call_peak) lower, a copy where equal. A
 * copy costs nothing where the arena has room for it anyway (the place of
 * intermediates dead by then), and the result then dies at its last get;
 * the result itself saves the arena's place but lives as long as the
 * buffer. Decided once per sizes (under mu), one buffer at a time. */
static void choose_adoption(backend_exec *e, size_t *bytes) {
  const cg_program *p = e->prog;
  size_t n = (size_t)p->n_buf;
  if (e->adopt_key && !memcmp(e->adopt_key, bytes, n * sizeof *bytes)) {
    for (int i = 0; i < e->n_adopted; i++)
      if (e->adopt_zero[e->adopted[i]]) bytes[e->adopted[i]] = 0;
    return;
  }
  size_t *off = alloc_malloc(n * sizeof *off + 1);
  int64_t *delta = alloc_malloc(sizeof *delta * ((size_t)p->n_k + 2));
  if (!e->adopt_key) e->adopt_key = alloc_malloc(n * sizeof *bytes + 1);
  if (!e->adopt_zero) e->adopt_zero = alloc_calloc(n + 1, sizeof *e->adopt_zero);
  if (!off || !delta || !e->adopt_key || !e->adopt_zero) {
    /* no room to decide: the results themselves, which take no arena space */
    alloc_free(off), alloc_free(delta), alloc_free(e->adopt_key), alloc_free(e->adopt_zero);
    e->adopt_key = NULL, e->adopt_zero = NULL;
    for (int i = 0; i < e->n_adopted; i++)
      if (p->buf[e->adopted[i]].kind == CG_BUF_TEMP) bytes[e->adopted[i]] = 0;
    return;
  }
  memcpy(e->adopt_key, bytes, n * sizeof *bytes);
  size_t best = call_peak(e, bytes, e->adopt_key, off, delta);
  for (int i = 0; i < e->n_adopted; i++) {
    int b = e->adopted[i];
    size_t keep = bytes[b];
    e->adopt_zero[b] = false;
    if (p->buf[b].kind != CG_BUF_TEMP || !keep) continue;
    bytes[b] = 0;
    size_t t = call_peak(e, bytes, e->adopt_key, off, delta);
    if (t < best) best = t, e->adopt_zero[b] = true;
    else bytes[b] = keep;
  }
  alloc_free(off), alloc_free(delta);
}

/* Kernel ki, a get: its construct's result into its buffer. An adoptable
 * buffer (e->adopt) becomes the result itself where that is contiguous and
 * no other buffer took it (else a tensor of its own, copied into); any
 * other is copied into. The results are let go after their last get.
 * 0, or -1 with the error. */
static int run_get(const backend_exec *e, int ki, char **bufs, kiln_tensor **tens, kiln_tensor **own,
                   const size_t *bytes, const int64_t *vals, kiln_tensor ***res) {
  const cg_program *p = e->prog;
  const ir_graph *g = e->g;
  const cg_kernel *k = &p->k[ki];
  const ir_node *n = &g->nodes[k->node];
  int ns = g->n_syms, c = e->cf_of[n->in[0]], b = k->out_buf;
  kiln_tensor *src = c >= 0 && res[c] ? res[c][n->attrs.k] : NULL;
  tview ov;
  if (!src) return err_set(n->file, n->line, "get", "%s: %%%d: read before its construct ran", g->name, k->node), -1;
  if (make_view(&ov, bufs[b], n->dtype, n, &p->views[k->node], vals, ns))
    return err_set("", 0, "call", "%s: a size does not evaluate", g->name), -1;
  if (src->dtype != n->dtype || src->ndim != n->ndim || memcmp(src->shape, ov.t.shape, sizeof(int64_t) * (size_t)n->ndim))
    return err_set(n->file, n->line, "get", "%s: %%%d: the result's shape differs from the graph's", g->name, k->node), -1;
  if (e->adopt[b] && !tens[b] && (p->buf[b].kind == CG_BUF_OUTPUT || !bytes[b])) {
    /* results have storage of their own (interp_cf_run's own_results), but a
     * graph may get one result twice: one buffer takes it, and a kernel may
     * store in place into it, so the other copies */
    bool take = tensor_contiguous(src);
    for (int i = 0; i < e->n_adopted && take; i++) take = !own[e->adopted[i]] || own[e->adopted[i]]->st != src->st;
    own[b] = take ? kiln_retain(src) : tensor_new(n->dtype, n->ndim, ov.t.shape);
    if (!own[b]) return err_set(n->file, n->line, "get", "out of memory"), -1;
    if (!take) pw_copy(own[b], src);
    tens[b] = own[b];
    bufs[b] = tensor_data(own[b]);
    for (int x = 0; x < p->n_buf; x++)
      if (p->buf[x].alias_of == b) bufs[x] = bufs[b];
  } else {
    pw_copy(&ov.t, src);
  }
  if (ki == e->last_get[c]) {
    for (int i = 0; i < ir_cf_n_results(&g->nodes[n->in[0]]); i++) kiln_release(res[c][i]);
    alloc_free(res[c]);
    res[c] = NULL;
  }
  return 0;
}

/* Kernel k, a cond, while or scan: its branch or loop on its compiled
 * regions over views of its operands' buffers. Its results wait in
 * res[its index] for the gets that read them: tensors of their own, not
 * the arena's, which later kernels reuse. 0, or -1 with the error. */
static int run_construct(const backend_exec *e, int ki, char *const *bufs, const size_t *bytes, const int64_t *vals,
                         kiln_tensor ***res, struct interp_cache *cache, bool stream) {
  const cg_kernel *k = &e->prog->k[ki];
  const cg_program *p = e->prog;
  const ir_graph *g = e->g;
  const ir_node *n = &g->nodes[k->node];
  int ns = g->n_syms;
  int n_res = ir_cf_n_results(n), rc = 0;
  tview *tv = alloc_calloc((size_t)n->n_in + 1, sizeof *tv);
  kiln_tensor **x = alloc_calloc((size_t)n->n_in + 1, sizeof *x), **r = NULL;
  if (!tv || !x) {
    err_set(n->file, n->line, ir_op_name(n->op), "out of memory");
    rc = -1;
  }
  for (int j = 0; j < n->n_in && !rc; j++) {
    const cg_view *m = &p->views[n->in[j]];
    const ir_node *a = &g->nodes[n->in[j]];
    if (make_view(&tv[j], bufs[m->buf], a->dtype, a, m, vals, ns)) {
      err_set("", 0, "call", "%s: a size does not evaluate", g->name);
      rc = -1;
    }
    x[j] = &tv[j].t;
  }
  /* a streamed xs: its buffer holds a chunk of steps, made as the loop reaches them */
  int sj = stream && e->stream_j ? e->stream_j[ki] : -1;
  stream_ctx sc = {e, ki - 1, bufs, vals};
  cf_stream st = {sj, 1, stream_fill, &sc};
  if (!rc && sj >= 0 && x[sj]->shape[0] > 0) {
    /* the steps the plan gave its buffer room for */
    size_t row = (size_t)(kiln_numel(x[sj]) / x[sj]->shape[0]) * kiln_dtype_size(x[sj]->dtype);
    int64_t kc = row ? (int64_t)(bytes[e->prog->views[n->in[sj]].buf] / row) : 1;
    st.k = kc < 1 ? 1 : kc;
  }
  /* results of their own: one that is an operand or a view of one lies in
   * memory a later kernel may take, and two that share a storage would see
   * a kernel's in-place store into either */
  if (!rc) rc = interp_cf_run(g, k->node, x, vals, &e->rx, cache, sj >= 0 ? &st : NULL, true, &r);
  if (rc && r) {
    for (int i = 0; i < n_res; i++) kiln_release(r[i]);
    alloc_free(r);
    r = NULL;
  }
  res[e->cf_of[k->node]] = r;
  alloc_free(tv), alloc_free(x);
  return rc;
}

/* bound: a region's symbol values (its parent's), else they bind from the
 * inputs. into: when not NULL, out[i] are written into into[i] (a region's
 * loop passes the carry's other buffers and the stacked ys' rows, so a step
 * allocates nothing): the kernels store an output straight into its tensor
 * where it is a whole buffer, else it is copied there at the end. */
static int exec_run(backend_exec *e, kiln_tensor *const *in, kiln_tensor *const *params, kiln_tensor **out, char *report,
                    size_t rn, const int64_t *bound, kiln_tensor *const *into) {
  const ir_graph *g = e->g;
  if (e->driver)
    return report ? region_execs_check(g, in, params, bound, &e->rx, report, rn)
           : into ? interp_run_into(g, in, bound, &e->rx, into)
                  : interp_run_with(g, in, params, bound, &e->rx, out);
  cg_program *p = e->prog;
  int64_t vals[IR_MAX_SYMS];
  if (ir_bind_or(g, e->leaves, e->n_leaves, in, params, bound, vals)) return -1;
  int nb = p->n_buf, ns = g->n_syms, rc = -1;
  /* per buffer: its data, the tensor behind it (when there is one), ours to
   * release, its bytes and arena offset; on the stack for a small plan,
   * since a batch-1 call is a few microseconds */
  enum { STACK_BUFS = 32 };
  char *s_bufs[STACK_BUFS];
  kiln_tensor *s_tens[STACK_BUFS], *s_own[STACK_BUFS];
  size_t s_bytes[STACK_BUFS], s_off[STACK_BUFS];
  bool small = nb <= STACK_BUFS;
  if (small) { /* the nb in use only */
    memset(s_bufs, 0, sizeof *s_bufs * (size_t)nb), memset(s_tens, 0, sizeof *s_tens * (size_t)nb);
    memset(s_own, 0, sizeof *s_own * (size_t)nb), memset(s_bytes, 0, sizeof *s_bytes * (size_t)nb);
    memset(s_off, 0, sizeof *s_off * (size_t)nb);
  }
  char **bufs = small ? s_bufs : alloc_calloc((size_t)nb, sizeof *bufs);
  kiln_tensor **tens = small ? s_tens : alloc_calloc((size_t)nb, sizeof *tens);
  kiln_tensor **own = small ? s_own : alloc_calloc((size_t)nb, sizeof *own);
  size_t *bytes = small ? s_bytes : alloc_calloc((size_t)nb, sizeof *bytes);
  size_t *off = small ? s_off : alloc_calloc((size_t)nb, sizeof *off);
  char *arena = NULL;
  size_t arena_bytes = 0;
  bool shared_arena = false, kernels_ran = false;
  int n_out_done = 0, mismatch = 0;
  kiln_tensor **all = NULL; /* check mode: the interpreter's values */
  kiln_tensor **cfres_s[8], ***cfres = NULL; /* the constructs' results, by construct */
  struct interp_cache *cache = NULL;
  /* allreduces run on while later kernels do, except in check mode, which reads each kernel's result at once */
  /* the queue (kilobytes: zeroing it was a third of a batch-1 call's own
   * cost) only in a graph with an allreduce; bucket cap read on the first */
  dist_pending dq_mem, *dq = NULL;
  if (e->last_allreduce >= 0) dq_mem = (dist_pending){.cap = -1}, dq = &dq_mem;
  bool overlap = !report && dq && dist_overlap(); /* a getenv: only where an allreduce can use it */
  /* prepared weights (prepare.c): each candidate's bytes and working memory at this call, and whether it reads its entry */
  size_t want[CG_PREP_MAX], want_scratch[CG_PREP_MAX];
  bool use_prep[CG_PREP_MAX] = {false};
  if (!bufs || !tens || !own || !bytes || !off) goto oom;
  for (int b = 0; b < nb; b++) {
    const cg_buf *bf = &p->buf[b];
    const ir_node *n = &g->nodes[bf->node];
    int64_t shape[MAXD]; /* outputs' and temporaries': arguments and constants come with theirs */
    kiln_tensor *t = NULL;
    switch (bf->kind) {
    case CG_BUF_INPUT:
    case CG_BUF_GRAD:
      if (!(t = ir_leaf_tensor(g, n, in, params))) {
        err_set("", 0, "call", "%s: %%%d: the .grad it reads is NULL", g->name, bf->node);
        goto done;
      }
      if (!tensor_contiguous(t) || (report && bf->updated)) {
        /* kernels read their buffers as contiguous: copy a strided argument once; check mode
         * runs the kernels before the real call, so an argument they update in place is a copy */
        if (!(own[b] = op_run(OP_COPY, &t, 1, NULL, "", 0))) goto done;
        t = own[b];
      }
      break;
    case CG_BUF_CONST:
      t = e->consts[b];
      break;
    case CG_BUF_OUTPUT:
      if (ir_node_shape(n, vals, ns, shape)) goto bad_shape;
      bytes[b] = (size_t)shape_numel(bf->ndim, shape) * kiln_dtype_size(bf->dtype); /* for choose_adoption */
      {
        int io = into_output(e, b, into);
        if (io >= 0 && shape_numel(bf->ndim, shape) == kiln_numel(into[io])) {
          t = into[io];
          break;
        }
      }
      if ((e->adopt && e->adopt[b]) || bf->first >= 0) break; /* made by its get, or before its first writer */
      if (!(own[b] = t = tensor_new(bf->dtype, bf->ndim, shape))) goto oom;
      break;
    case CG_BUF_TEMP:
      if (bf->scratch_of >= 0) {
        /* a kernel's working memory: as much as its op takes at this call's sizes */
        if (scratch_size(p, &p->k[bf->scratch_of], vals, ns, &bytes[b], NULL, NULL)) goto bad_shape;
        break;
      }
      if (ir_node_shape(n, vals, ns, shape)) goto bad_shape;
      /* a buffer merged into another by the in-place reuse takes no space */
      bytes[b] = bf->alias_of >= 0 || bf->first < 0 ? 0 : (size_t)shape_numel(bf->ndim, shape) * kiln_dtype_size(bf->dtype);
      if (!report && e->stream_buf && e->stream_buf[b] && shape[0] > 0) /* a chunk of the steps */
        bytes[b] = bytes[b] / (size_t)shape[0] * (size_t)stream_rows(bytes[b] / (size_t)shape[0], shape[0]);
      break;
    }
    tens[b] = t;
    if (t) bufs[b] = tensor_data(t);
  }
  for (int i = 0; i < e->prep.n; i++)
    if (scratch_size(p, &p->k[e->prep.e[i].kernel], vals, ns, NULL, &want[i], &want_scratch[i])) goto bad_shape;
  /* a graph with no intermediates (a batch-1 matmul) has no arena to plan or lock */
  if (e->temps || (e->dump & KILN_DUMP_KERNELS)) {
    pthread_mutex_lock(&e->mu);
    /* top level only: a region's runs reuse storages without bumping their
     * versions (interp.c's per-step values, a loop's carry sets), so a weight
     * made inside a loop could look unchanged with new data */
    if (!e->arena_busy && e->prep.n && !bound && !into) {
      /* new sizes: admit prepared weights while they and the arena without them
       * take no more than eager's one tensor per intermediate (prepare.c) */
      if (!prep_decided(&e->prep, want, vals, ns)) {
        size_t full = plan_cached(e, bytes, off), made = values_bytes(g, vals);
        prep_admit(&e->prep, want, vals, ns, made > full ? made - full : 0);
      }
      for (int i = 0; i < e->prep.n; i++) {
        use_prep[i] = e->prep.e[i].admitted && e->prep.e[i].data;
        if (use_prep[i]) bytes[p->k[e->prep.e[i].kernel].scratch_buf] = want_scratch[i];
      }
    }
    if (e->n_adopted) choose_adoption(e, bytes);
    arena_bytes = plan_cached(e, bytes, off);
    if (!e->arena_busy) {
      e->arena_busy = shared_arena = true;
      if (arena_bytes > e->arena_cap) {
        /* the arena counts as tensor memory (kiln_mem_in_use), so peaks compare with eager's */
        if (e->arena) {
          alloc_aligned_free(e->arena, e->arena_cap);
          alloc_track(-(int64_t)e->arena_cap);
        }
        e->arena_cap = (arena_bytes + 63) / 64 * 64;
        e->arena = alloc_aligned(e->arena_cap);
        if (!e->arena) e->arena_cap = 0;
        alloc_track((int64_t)e->arena_cap);
      }
      arena = e->arena;
    }
    if ((e->dump & KILN_DUMP_KERNELS) && e->dump_to && !e->plan_dumped) {
      e->plan_dumped = true;
      fprintf(e->dump_to, "memory plan of %s at this call's sizes: arena %zu bytes\n", g->name, arena_bytes);
      for (int b = 0; b < nb; b++)
        if (p->buf[b].kind == CG_BUF_TEMP && p->buf[b].alias_of < 0 && bytes[b] > 0)
          fprintf(e->dump_to, "  b%d at %zu, %zu bytes\n", b, off[b], bytes[b]);
      if (e->dump_to != stderr) {
        fclose(e->dump_to);
        e->dump_to = NULL;
      } else {
        fflush(stderr);
      }
    }
    pthread_mutex_unlock(&e->mu);
  }
  if (!shared_arena) {
    /* another call holds the kept arena: this one gets its own */
    arena = arena_bytes ? alloc_aligned((arena_bytes + 63) / 64 * 64) : NULL;
    if (arena) alloc_track((int64_t)((arena_bytes + 63) / 64 * 64));
  }
  if (arena_bytes && !arena) goto oom;
  for (int b = 0; b < nb; b++)
    if (p->buf[b].kind == CG_BUF_TEMP) bufs[b] = arena ? arena + off[b] : NULL; /* all empty: no arena */
  for (int b = 0; b < nb; b++) {
    const cg_buf *bf = &p->buf[b];
    if (bf->kind != CG_BUF_TEMP || bf->alias_of < 0) continue;
    bufs[b] = bufs[bf->alias_of];
    if (report && p->buf[bf->alias_of].kind == CG_BUF_INPUT) {
      /* a GEMM updates this argument in place; check mode runs the kernels
       * again from the same start, so it updates a copy instead */
      kiln_tensor *src = tens[bf->alias_of];
      if (!(own[b] = op_run(OP_COPY, &src, 1, NULL, "", 0))) goto oom;
      bufs[b] = tensor_data(own[b]);
    }
  }

  if (report && e->n_cf) {
    /* each construct's first step through its region's kernels first, to name the kernel inside */
    rc = region_execs_check(g, in, params, bound, &e->rx, report, rn);
    if (rc) goto done;
    rc = -1;
  }
  if (e->n_cf) {
    cfres = e->n_cf <= 8 ? cfres_s : alloc_calloc((size_t)e->n_cf, sizeof *cfres);
    if (!cfres) goto oom;
    memset(cfres, 0, sizeof *cfres * (size_t)e->n_cf);
    if (bound) cache = interp_cache_take(e->rx.cache); /* a region's: its loops keep their buffers for the next step */
  }
  if (report) {
    /* check mode: the interpreter's value of every node, then each kernel against it */
    all = alloc_calloc((size_t)g->n_nodes + 1, sizeof *all);
    if (!all || (bound ? interp_values_bound(g, in, vals, all) : interp_values(g, in, params, all))) goto oom;
  }
  kernels_ran = true;
  /* A dot-product kernel splits finely (RT_STAGED_DOT) only where the
   * worker is awake (a kernel before it split) or in runs that come back
   * to back: a lone run would wake a sleeping worker, which costs a small
   * matvec more than the second core gives back. */
  int next_lazy = 0;
  bool hot = e->has_dot && now_ns() - atomic_load_explicit(&e->last_end, memory_order_relaxed) <
                              atomic_load_explicit(&hot_gap, memory_order_relaxed);
  for (int ki = 0; ki < p->n_k && !mismatch; ki++) {
    cg_kernel *k = &p->k[ki];
    if (ki > 0 && all && compare_kernel(e, &p->k[ki - 1], bufs, vals, all, report, rn)) {
      mismatch = 1;
      break;
    }
    for (; next_lazy < e->n_lazy && p->buf[e->lazy[next_lazy]].first == ki; next_lazy++) {
      int b = e->lazy[next_lazy];
      int64_t shape[MAXD];
      if (tens[b]) continue; /* the caller's (into) */
      if (ir_node_shape(&g->nodes[p->buf[b].node], vals, ns, shape)) goto bad_shape;
      if (!(own[b] = tens[b] = tensor_new(p->buf[b].dtype, p->buf[b].ndim, shape))) goto oom;
      bufs[b] = tensor_data(own[b]); /* no buffer is stored in place in an output */
    }
    for (int i = 0; i < e->n_adopted; i++) {
      /* a construct's result a get took: let go after its last reader, as the arena's place would be */
      int b = e->adopted[i];
      if (e->end_of[b] != ki - 1 || !own[b] || p->buf[b].kind != CG_BUF_TEMP) continue;
      kiln_release(own[b]);
      own[b] = tens[b] = NULL;
      bufs[b] = NULL;
    }
    if (dq && wait_kernel(dq, p, g, k, bufs, tens, bytes)) {
      err_set("", 0, "call", "%s: an allreduce failed: %s", g->name, err_kernel_failed());
      goto done;
    }
    if (!report && e->streamed && e->streamed[ki]) continue; /* the scan after it makes it, a chunk at a time */
    if (k->kind == CG_K_LOOP) {
      int64_t prm[256];
      for (int i = 0; i < k->n_param && i < 256; i++)
        if (sym_eval(k->param[i], vals, ns, &prm[i])) goto bad_shape;
      int staged = e->staged[ki] == RT_STAGED_DOT && !hot && !pool_workers_awake() ? RT_STAGED_DOT_COARSE : e->staged[ki];
      int64_t range = 1, inner = 1;
      for (int d = 0; d < k->ndim; d++) {
        int64_t v = eval_or(k->dim[d], vals, ns);
        if (v < 0) goto bad_shape;
        if (!staged || d < k->n_outer) range *= v;
        else inner *= v;
      }
      char *acc[65]; /* the kernel's accesses in its own order (lower.c), then a scratch */
      for (int a = 0; a < k->n_acc; a++) {
        int64_t shift = cg_pointer_shift(k, a); /* an empty buffer is NULL: nothing to add to it */
        char *base = bufs[k->acc[a].buf];
        acc[a] = shift ? base + shift * (int64_t)kiln_dtype_size(p->buf[k->acc[a].buf].dtype) : base;
      }
      acc[k->n_acc] = NULL;
      rt_run_loop(e->fn[ki], prm, acc, k->n_acc, range, inner, staged, k->split);
#ifdef KILN_TEST_BUILD
      /* fault injection: a miscompiled kernel, for check mode to find */
      const char *bad = getenv("KILN_TEST_CORRUPT_KERNEL");
      if (bad && !strcmp(bad, k->name) && k->out_buf >= 0 && p->buf[k->out_buf].dtype == KILN_F32 && range > 0)
        ((float *)bufs[k->out_buf])[0] += 1.0f;
#endif
      continue;
    }
    /* matmul and eager ops: run the eager kernel on views of the buffers */
    const ir_node *n = &g->nodes[k->node];
    if (ir_is_cf(n->op) || n->op == IR_GET) {
      if (n->op == IR_GET ? run_get(e, ki, bufs, tens, own, bytes, vals, cfres)
                          : run_construct(e, ki, bufs, bytes, vals, cfres, cache, !report))
        goto done;
      continue;
    }
    tview iv[3], ov;
    kiln_tensor *ins[3];
    int nin = n->n_in < 3 ? n->n_in : 3;
    kiln_tensor **many = NULL;
    tview *mv = NULL;
    if (n->n_in > 3) { /* cat of many */
      many = alloc_calloc((size_t)n->n_in, sizeof *many);
      mv = alloc_calloc((size_t)n->n_in, sizeof *mv);
      if (!many || !mv) {
        alloc_free(many), alloc_free(mv);
        goto oom;
      }
    }
    bool ok = true;
    for (int j = 0; j < n->n_in && ok; j++) {
      const cg_view *m = &p->views[n->in[j]];
      tview *tv = many ? &mv[j] : &iv[j];
      ok = make_view(tv, bufs[m->buf], g->nodes[n->in[j]].dtype, &g->nodes[n->in[j]], m, vals, ns) == 0;
      if (many) many[j] = &tv->t;
      else ins[j] = &tv->t;
    }
    cg_view self = p->views[k->node];
    ok = ok && make_view(&ov, bufs[k->out_buf], n->dtype, n, &self, vals, ns) == 0;
    op_attrs at;
    ok = ok && ir_attrs_eval(n, vals, ns, &at) == 0;
    /* values a kernel trusts (indices) come from the call's data: checked as eager checks them */
    check_fn chk = n->op < OP_COUNT ? op_table[n->op].check : NULL;
    if (ok && chk && chk((op_id)n->op, many ? many : ins, many ? n->n_in : nin, &at, n->file, n->line)) {
      alloc_free(many), alloc_free(mv);
      goto done;
    }
    bool start = ok && overlap && n->op == OP_ALLREDUCE && tensor_contiguous(&ov.t);
    if (start) pw_copy(&ov.t, ins[0]);
    int pi = e->prep.n ? e->prep.of_kernel[ki] : -1;
    if (ok && pi >= 0 && use_prep[pi]) {
      /* the prepared weight, made again when the weight changed since */
      cg_prep_entry *en = &e->prep.e[pi];
      const kiln_tensor *w = ir_leaf_tensor(g, &g->nodes[p->buf[en->wbuf].node], in, params);
      int r = 0;
      if (!prep_fresh(en, w)) {
        en->valid = false;
        r = conv_prepare_weight((op_id)n->op, ins, &at, en->data);
        if (!r) prep_made(en, w);
      }
      if (!r) r = conv_kernel_prepared((op_id)n->op, ins, &at, &ov.t, en->data, bufs[k->scratch_buf], bytes[k->scratch_buf]);
      alloc_free(many), alloc_free(mv);
      if (r) {
        err_set(n->file, n->line, ir_op_name(n->op), "%s: %%%d: the kernel failed: %s", g->name, k->node,
                err_kernel_failed());
        goto done;
      }
      continue;
    }
    int r = !ok ? -1
            : start ? dist_start(dq, &ov.t, at.flag, ki == e->last_allreduce)
            : k->kind == CG_K_MATMUL && k->beta != 0 ? gemm_into(ins[0], ins[1], k->alpha, k->beta, &ov.t)
            : k->scratch_buf >= 0 && !dtype_is_narrow(n->dtype) ? conv_kernel((op_id)n->op, ins, &at, &ov.t, bufs[k->scratch_buf], bytes[k->scratch_buf])
                                                     : op_kernel((op_id)n->op, many ? many : ins, many ? n->n_in : nin, &at, &ov.t);
    alloc_free(many), alloc_free(mv);
    if (r) {
      err_set(n->file, n->line, ir_op_name(n->op), "%s: %%%d: the kernel failed: %s", g->name, k->node,
              err_kernel_failed());
      goto done;
    }
  }
  if (e->has_dot) atomic_store_explicit(&e->last_end, now_ns(), memory_order_relaxed);

  if (dq && dist_wait(dq, NULL, 0)) {
    err_set("", 0, "call", "%s: an allreduce failed: %s", g->name, err_kernel_failed());
    goto done;
  }
  if (report) {
    if (!mismatch && p->n_k) mismatch = compare_kernel(e, &p->k[p->n_k - 1], bufs, vals, all, report, rn);
    rc = mismatch;
    goto done;
  }
  for (int i = 0; into && i < g->n_outputs; i++) {
    /* into the caller's tensors: what the kernels did not store there is copied */
    int o = g->outputs[i];
    const cg_view *m = &p->views[o];
    tview v;
    if (make_view(&v, bufs[m->buf], g->nodes[o].dtype, &g->nodes[o], m, vals, ns)) goto bad_shape;
    if (tensor_data(&v.t) != tensor_data(into[i]) || !tensor_contiguous(&v.t)) pw_copy(into[i], &v.t);
  }
  /* outputs: fresh tensors, or views of them and of the arguments, as in the graph */
  for (int i = 0; !into && i < g->n_outputs; i++) {
    int o = g->outputs[i];
    const cg_view *m = &p->views[o];
    const cg_buf *bf = &p->buf[m->buf];
    const ir_node *n = &g->nodes[o];
    tview v;
    if (make_view(&v, bufs[m->buf], n->dtype, n, m, vals, ns)) goto bad_shape;
    kiln_tensor *base = tens[m->buf];
    kiln_tensor *r = NULL;
    if (g->nodes[o].op == IR_INPUT || g->nodes[o].op == IR_PARAM) {
      /* an argument handed back as it came, strided or not */
      r = kiln_retain(g->nodes[o].op == IR_INPUT ? in[g->nodes[o].index] : params[g->nodes[o].index]);
    } else if (base && base->st != NULL && (bf->kind == CG_BUF_OUTPUT || (bf->kind != CG_BUF_CONST && !own[m->buf]))) {
      /* the same elements as base, seen through the view */
      bool same = base->ndim == v.t.ndim && v.t.offset == 0;
      for (int d = 0; same && d < v.t.ndim; d++) same = base->shape[d] == v.t.shape[d] && (base->shape[d] < 2 || base->stride[d] == v.t.stride[d]);
      r = same ? kiln_retain(base) : tensor_view(base, v.t.ndim, v.t.shape, v.t.stride, base->offset + v.t.offset);
    } else {
      kiln_tensor *src = &v.t;
      r = op_run(OP_COPY, &src, 1, NULL, "", 0);
    }
    if (!r) goto oom;
    out[n_out_done++] = r;
  }
  /* an argument's memory: its value when the call began, which the writes below change */
  if (!into && ir_outputs_before_writes(g, out, n_out_done, in, params)) goto oom;
  /* writes after every read */
  int wr = apply_writes(g, p, bufs, vals, in, params);
  if (wr == -2) goto bad_shape;
  if (wr) goto oom;
  rc = 0;
  goto done;
bad_shape:
  err_set("", 0, "call", "%s: a size does not evaluate", g->name);
  goto done;
oom:
  err_set("", 0, "call", "%s: out of memory", g->name);
done:
  if (dq) dist_end(dq); /* nothing may still write the arena (after an error: its error stands) */
  /* a kernel may have stored into an argument updated in place before a later one
   * failed: its data changed, so its version must say so (autograd, prepared weights) */
  for (int b = 0; rc && kernels_ran && !report && tens && b < nb; b++)
    if (p->buf[b].updated && tens[b]) atomic_fetch_add(&tens[b]->st->version, 1);
  if (rc)
    for (int i = 0; i < n_out_done; i++) kiln_release(out[i]), out[i] = NULL;
  if (shared_arena) {
    pthread_mutex_lock(&e->mu);
    e->arena_busy = false;
    pthread_mutex_unlock(&e->mu);
  } else if (arena) {
    alloc_aligned_free(arena, (arena_bytes + 63) / 64 * 64);
    alloc_track(-(int64_t)((arena_bytes + 63) / 64 * 64));
  }
  if (own)
    for (int b = 0; b < nb; b++) kiln_release(own[b]);
  if (all)
    for (int i = 0; i < g->n_nodes; i++) kiln_release(all[i]);
  alloc_free(all);
  for (int i = 0; cfres && i < g->n_nodes; i++) {
    int c = e->cf_of[i];
    if (c < 0 || !cfres[c]) continue;
    for (int j = 0; j < ir_cf_n_results(&g->nodes[i]); j++) kiln_release(cfres[c][j]);
    alloc_free(cfres[c]);
  }
  if (cfres != cfres_s) alloc_free(cfres);
  interp_cache_give(cache);
  if (!small) alloc_free(bufs), alloc_free(tens), alloc_free(own), alloc_free(bytes), alloc_free(off);
  return rc;
}

static int llvm_run(backend_exec *e, kiln_tensor *const *in, kiln_tensor *const *params, kiln_tensor **out) {
  return exec_run(e, in, params, out, NULL, 0, NULL, NULL);
}

static int llvm_check(backend_exec *e, kiln_tensor *const *in, kiln_tensor *const *params, char *report, size_t n) {
  return exec_run(e, in, params, NULL, report, n, NULL, NULL);
}

static int llvm_run_bound(backend_exec *e, kiln_tensor *const *in, const int64_t *vals, kiln_tensor **out) {
  return exec_run(e, in, NULL, out, NULL, 0, vals, NULL);
}

static int llvm_check_bound(backend_exec *e, kiln_tensor *const *in, const int64_t *vals, char *report, size_t n) {
  return exec_run(e, in, NULL, NULL, report, n, vals, NULL);
}

static int llvm_run_into(backend_exec *e, kiln_tensor *const *in, const int64_t *vals, kiln_tensor *const *into) {
  return exec_run(e, in, NULL, NULL, NULL, 0, vals, into);
}

static void llvm_times(const backend_exec *e, double *front, double *opt, double *machine) {
  *front = e->front_ms;
  *opt = e->opt_ms;
  *machine = e->machine_ms;
}

const backend backend_llvm = {"llvm",    llvm_compile,   llvm_run,        exec_free,    llvm_check,
                               llvm_times, llvm_run_bound, llvm_check_bound, llvm_run_into};
