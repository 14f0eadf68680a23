/* Internal header of the eager layer: tensors and storage, the op table,
 * dispatch, kernels, autograd. The tracer reads the op table and sets the
 * dispatch hook; nothing here knows about the tracer. Sectioned by file. */
#ifndef KILN_EAGER_H
#define KILN_EAGER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include <cblas.h>

#include "kiln.h"
#include "eager/sym.h"

#define MAXD KILN_MAX_DIMS

#ifdef KILN_TEST_BUILD
#define KILN_ASSERT(x) \
  ((x) ? (void)0 : (fprintf(stderr, "%s:%d: internal error: %s\n", __FILE__, __LINE__, #x), __builtin_trap()))
#else
#define KILN_ASSERT(x) ((void)0)
#endif

/* The hot eager loops (the pointwise and reduction inner loops, the small
 * GEMV) are KILN_HOT: built for x86-64-v4 (AVX-512), v3 (AVX2, FMA) and the
 * baseline, and the dynamic loader picks one for the CPU when the library
 * loads (GCC and clang target_clones: an ifunc). A library built without
 * -march=native (KILN_NATIVE=OFF, the default, what `make install` installs)
 * then runs everywhere and still uses the wide vectors of the CPU it runs on.
 * CMake defines KILN_CPU_DISPATCH where that works: not with -march=native
 * (nothing to choose), nor in the sanitizer builds (ThreadSanitizer
 * instruments the resolver, which runs before it is set up). */
/* KILN_JIT_FEATURES names "-avx512f": the code an AVX2 machine would run,
 * asked for on an AVX-512 one (to measure or test it there). The JIT's
 * kernels and the attention kernel's loops both follow it (dispatch.c). */
bool cpu_avx512_turned_off(void);

/* Thread-locals read on every op or call: the initial-exec model reaches
 * them with one load off the thread pointer, where a shared library's
 * default model calls __tls_get_addr for each. glibc keeps a little static
 * TLS for libraries loaded with dlopen, so only small ones take it. */
#define KILN_TLS_HOT _Thread_local __attribute__((tls_model("initial-exec")))

#ifdef KILN_CPU_DISPATCH
#define KILN_HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KILN_HOT
#endif

/* ---- alloc.c: the one allocator (fails on demand in the test build) ---- */

void *alloc_malloc(size_t n);
void *alloc_calloc(size_t n, size_t size);
void *alloc_realloc(void *p, size_t n);
void *alloc_aligned(size_t n); /* n a multiple of 64; free with alloc_aligned_free */
void alloc_aligned_free(void *p, size_t n);
void alloc_free(void *p);
/* A block of ALLOC_SMALL bytes (a storage header), from the thread's freed
 * ones when it has some; alloc_small_free keeps up to 64 a thread. */
enum { ALLOC_SMALL = 64 };
void *alloc_small(void);
void alloc_small_free(void *p);
/* Test build: make the n-th allocation from now fail (0 = never). Returns the
 * allocations the previous setting still had to go (0: it fired, or was off). */
int64_t alloc_fail_after(int64_t n);
/* Storage bytes accounting (tensor data only). */
void alloc_track(int64_t delta);
/* Grows the array *p (of *cap elements of size bytes) to hold need; 0 or -1.
 * Inline when there is room: a recording calls it a few times an op. */
int alloc_grow_slow(void **p, int *cap, int need, size_t size);
static inline int alloc_grow(void **p, int *cap, int need, size_t size) {
  return need <= *cap ? 0 : alloc_grow_slow(p, cap, need, size);
}
/* A 64-bit mix for hash tables keyed by serials and values. */
static inline uint64_t hash64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}
/* Handles: tensor and kiln_fn headers, whose memory is never freed (see
 * alloc.c), so that a released one can be told from a live one in every build.
 * A pool per kind of handle, defined with HANDLE_POOL. */
typedef struct handle_pool {
  pthread_mutex_t lock;
  struct parked *head, *tail; /* released handles, oldest first */
  size_t n_parked;
  size_t size; /* bytes of a handle */
  size_t live; /* its first bytes stay readable when parked: where it says it is released */
  size_t keep; /* parked handles that are not handed out again */
} handle_pool;
#define HANDLE_POOL(type, live_bytes, keep_n) \
  {PTHREAD_MUTEX_INITIALIZER, NULL, NULL, 0, sizeof(type), (live_bytes), (keep_n)}
/* A zeroed handle (NULL when out of memory); alloc_handle_park releases it. */
void *alloc_handle(handle_pool *p);
void alloc_handle_park(handle_pool *p, void *h);

/* ---- error.c ---------------------------------------------------------- */

/* Sets the thread's message to "file:line: kiln_<op>: <fmt>". Always returns NULL. */
void *err_set(const char *file, int line, const char *op, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* For a NULL argument: sets "<what> is NULL" unless an earlier error is pending. */
void *err_null(const char *file, int line, const char *op, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* How many errors this thread has set: unchanged across a call that set none. */
unsigned long err_count(void);
/* A failing kernel's reason (printf-style), and the message for a kernel that
 * returned nonzero: that reason once, else "out of memory". */
void err_kernel_why(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
const char *err_kernel_failed(void);
/* Gives a message set without a location (deep in a compiled call) the caller's file:line. */
void err_locate(const char *file, int line);
void err_restore(const char *text);
/* How BLAS reads a (rows, cols) matrix with strides (rs, cs): 0 with its
 * transpose flag and leading dim, or -1 when neither dim is unit-stride. */
int cblas_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, CBLAS_TRANSPOSE *tr, int64_t *ld);
/* Formats a shape as "[2,3]" into buf (at least 128 bytes). */
const char *err_shape(char *buf, int ndim, const int64_t *shape);
#define SHAPE_BUF 160

/* ---- tensor.c --------------------------------------------------------- */

typedef struct storage {
  atomic_long refcount;
  void *data;
  size_t bytes;
  atomic_ulong version; /* bumped by every in-place write, checked by autograd */
  uint64_t serial;      /* unique, like a tensor's */
  bool meta;            /* a recording's value: no data yet (data NULL) until the call materializes it */
  /* scratch of the recording that made this meta storage (record.c), so that
   * its end-of-segment scan is linear: the tensors it made over this storage,
   * whether it is listed live, the value covering it */
  int rec_count, rec_value;
  bool rec_listed;
  _Atomic(char *) name; /* kiln_param_name's, or NULL: saved graphs name their params by it */
} storage;

typedef struct ag_node ag_node;

struct kiln_tensor {
  /* The references (low 32 bits) and how many of them scopes hold (high 32
   * bits), in one word, so that a release sees both in one atomic step. 0
   * when released: the header is then parked (alloc_handle), never freed. */
  atomic_ullong refs;
  kiln_dtype dtype;
  int ndim;
  int64_t shape[MAXD];
  int64_t stride[MAXD]; /* in elements */
  int64_t offset;       /* in elements */
  storage *st;
  bool requires_grad;
  kiln_tensor *grad; /* leaves: accumulated gradient, owned */
  ag_node *grad_fn;  /* non-leaves: the node that made it */
  kiln_tensor *grad_if; /* a gradient that exists only where this holds (grad_if_kind): eagerly the
                           construct that reaches it ran no step, or not the branch (cfgrad.c) */
  uint8_t grad_if_kind; /* GRAD_IF_* bits */
  uint64_t serial;   /* unique for the process's life, unlike the address */
  uint64_t rec_call; /* the recording that made it (0: none), and its value there */
  int rec_id;
};

/* What grad_if says: dim 0 of it is not 0 (a scan's trip count), or it is a
 * one-element bool that is true (a cond's predicate, a flag that some step
 * took a branch); FROM_NULL (a .grad): the leaf had none before the term
 * the condition guards, so where it fails .grad is NULL. */
enum { GRAD_IF_DIM = 0, GRAD_IF_TRUE = 1, GRAD_IF_FROM_NULL = 2 };
/* g's grad_if as a 0-d bool tensor, true where g exists (NULL: out of memory). */
kiln_tensor *ag_grad_if_bool(const kiln_tensor *g, const char *file, int line);
/* Marks g as existing only where m holds (kind GRAD_IF_DIM or _TRUE); m NULL clears. */
void ag_set_grad_if(kiln_tensor *g, kiln_tensor *m, int kind);

#define REF_ONE 1ull                    /* a reference */
#define REF_SCOPED ((1ull << 32) | 1ull) /* a reference a scope holds */
/* All references to t, scopes' included; 0 once released. */
static inline uint32_t tensor_refs(const kiln_tensor *t) { return (uint32_t)atomic_load(&t->refs); }
/* Of those, the ones scopes hold. */
static inline uint32_t tensor_scope_refs(const kiln_tensor *t) { return (uint32_t)(atomic_load(&t->refs) >> 32); }
/* 0 when t is NULL or live; -1 when its last reference is gone, with
 * "<what> was already released" set (op's name, the caller's file:line). The
 * public functions call it before they read a tensor. */
int tensor_check_live(const kiln_tensor *t, const char *what, const char *op, const char *file, int line);
/* For an entry point's tensor argument: true, with the error set, when t is
 * NULL ("<what> is NULL", unless an earlier error is pending) or released. */
bool tensor_bad_arg(const kiln_tensor *t, const char *file, int line, const char *op, const char *what);

int64_t shape_numel(int ndim, const int64_t *shape);
/* The serial the next tensor made will get: every tensor made before now has a smaller one. */
uint64_t tensor_serial_now(void);
/* Storages with data made so far, by every thread (tests count what a call allocates). */
uint64_t storage_count(void);
/* New contiguous tensor with uninitialized data, owned by the caller (not by a scope). */
kiln_tensor *tensor_new(kiln_dtype dt, int ndim, const int64_t *shape);
/* New contiguous tensor over a meta storage (no data: a recording's value), owned by the caller. */
kiln_tensor *tensor_new_meta(kiln_dtype dt, int ndim, const int64_t *shape);
/* Gives a meta storage the data it was waiting for: data (alloc_aligned, of
 * st->bytes rounded up to 64) becomes its own. */
void storage_materialize(storage *st, void *data);
/* Drops a reference to a storage (freed with the last). */
void storage_release_ref(storage *s);
/* Moves src's data (of the same byte count) into the meta storage st; src keeps none. */
void storage_steal(storage *st, storage *src);
/* st's name; when it has none, a copy of name becomes it first (a param
 * named after its capture site). NULL out of memory. */
const char *storage_name_default(storage *st, const char *name);
/* New view of t's storage with the given layout, owned by the caller. */
kiln_tensor *tensor_view(kiln_tensor *t, int ndim, const int64_t *shape, const int64_t *stride, int64_t offset);
/* Registers a freshly made tensor with the innermost scope; returns it. */
kiln_tensor *scope_adopt(kiln_tensor *t);
static inline void *tensor_data(const kiln_tensor *t) {
  return (char *)t->st->data + t->offset * (int64_t)kiln_dtype_size(t->dtype);
}
/* t's layout and identity (dtype, shape, strides, offset, storage, serial)
 * as a local header that owns nothing. Not `= *t`: that would read t's
 * refcount, which another thread may be changing. */
static inline kiln_tensor tensor_header(const kiln_tensor *t) {
  kiln_tensor v = {.refs = REF_ONE, /* live, for the functions that check */
                   .dtype = t->dtype, .ndim = t->ndim, .offset = t->offset, .st = t->st,
                   .requires_grad = t->requires_grad, .serial = t->serial};
  for (int i = 0; i < MAXD; i++) v.shape[i] = t->shape[i], v.stride[i] = t->stride[i];
  return v;
}
bool tensor_contiguous(const kiln_tensor *t);
/* Whether t covers all of its storage, in order (offset 0, contiguous, every byte). */
bool tensor_covers_storage(const kiln_tensor *t);
/* Whether a and b read the same elements of one storage the same way
 * (dtype, offset, sizes and strides). */
bool tensor_same_view(const kiln_tensor *a, const kiln_tensor *b);
void contiguous_strides(int ndim, const int64_t *shape, int64_t *stride);
/* One element as a double (index in row-major order). */
double tensor_get(const kiln_tensor *t, int64_t linear);

/* ---- the op table (ops.def) -------------------------------------------- */

typedef enum op_kind { KIND_POINTWISE, KIND_REDUCE, KIND_MATMUL, KIND_VIEW, KIND_OTHER } op_kind;

typedef enum op_id {
#define X(id, name, arity, kind, attrs, dtype, shape, kernel, check, backward, saves, cg, cost, emit) OP_##id,
#include "ops.def"
#undef X
  OP_COUNT
} op_id;

/* Attribute fields. An op's schema is the set of fields it uses; hashing,
 * equality, evaluation, printing and parsing walk the schema, printing and
 * parsing in this order. */
enum attr_field {
  AF_NONE = 0,
  AF_AXES = 1 << 0,    /* naxes, axes[]: reduced axes, sorted, non-negative */
  AF_KEEPDIM = 1 << 1, /* keepdim */
  AF_SHAPE = 1 << 2,   /* ndim, shape[]: a target shape (reshape, expand) */
  AF_PERM = 1 << 3,    /* perm[]: as many entries as input 0 has dims */
  AF_DIM = 1 << 4,     /* dim: the dim an op works along */
  AF_START = 1 << 5,   /* start: a bound, normalized: 0 <= start <= end <= size */
  AF_END = 1 << 6,     /* end */
  AF_STEP = 1 << 7,    /* step >= 1 */
  AF_DTYPE = 1 << 8,   /* dtype: what a cast makes */
  AF_VALUE = 1 << 9,   /* value: a number (a fill value, a slope, a lower bound) */
  AF_VALUE2 = 1 << 10, /* value2: a second number (an upper bound) */
  AF_K = 1 << 11,      /* k: an integer (a diagonal, a count) */
  AF_FLAG = 1 << 12,   /* flag: a yes/no choice (largest, reverse) */
  AF_INTS = 1 << 13,   /* nints, ints[]: small integer parameters (pads, strides) */
  AF_RNG = 1 << 14,    /* seed, offset: where a draw starts in the counter-based generator's stream */
  AF_FIELDS = 15
};

/* Attributes are inline and fixed-size: they are part of a node's identity.
 * Sizes (shape, start, end) are dims: constants in eager, symbolic in a graph. */
typedef struct op_attrs {
  int ndim;                 /* AF_SHAPE */
  sym_dim shape[MAXD];
  int perm[MAXD];           /* AF_PERM */
  int naxes;                /* AF_AXES */
  int axes[MAXD];
  bool keepdim;             /* AF_KEEPDIM */
  int dim;                  /* AF_DIM */
  sym_dim start, end;       /* AF_START, AF_END */
  int64_t step;             /* AF_STEP */
  kiln_dtype dtype;         /* AF_DTYPE */
  double value, value2;     /* AF_VALUE, AF_VALUE2 */
  int64_t k;                /* AF_K */
  bool flag;                /* AF_FLAG */
  int nints;                /* AF_INTS */
  int64_t ints[2 * MAXD];
  sym_dim seed, offset;     /* AF_RNG: numbers the call passes (their bits; any int64) */
  /* What eager tells the tracer about the caller's numbers; not part of the
   * identity. reshape: 1 + the dim given as -1, else 0. slice: raw_start and
   * raw_end hold the caller's bounds before normalizing (raw set). */
  int infer;
  bool raw;
  int64_t raw_start, raw_end;
} op_attrs;

/* The dtype rule: what input `first` (and, for a promoting op, every input
 * from it on) may be, and what the result is. */
typedef enum dt_in { DT_IN_ANY, DT_IN_NUM, DT_IN_FLOAT } dt_in;
typedef enum dt_out { DT_OUT_SAME, DT_OUT_BOOL, DT_OUT_I64, DT_OUT_ATTR } dt_out;
typedef struct dtype_rule {
  dt_in in;
  dt_out out;
  bool promote; /* mixed dtypes are cast to the promoted one first */
  int first;    /* the first input the rule is about (where: 1, after the condition) */
} dtype_rule;

/* An input as a shape rule sees it. */
typedef struct shape_arg {
  kiln_dtype dtype;
  int ndim;
  sym_dim shape[MAXD];
} shape_arg;

/* What a shape rule decides with. Eager's dims are constants (sym NULL is
 * enough); the tracer's may be symbols, and its decide answers from the
 * bounds, the guards or the traced values (recording a guard). */
typedef struct dim_env dim_env;
struct dim_env {
  sym_ctx *sym;
  /* a op b: 1 true, 0 false, -1 cannot tell */
  int (*decide)(dim_env *env, sym_dim a, sym_cmp op, sym_dim b);
};
/* out's ndim and shape (dtype is set by the dtype rule first; a rule may
 * change it). 0, or -1 with why in err (no op name, no location). */
typedef int (*shape_fn)(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out,
                        char *err, size_t errn);

typedef int (*kernel_fn)(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out);

/* What the backward formula reads. */
enum { S_NONE = 0, S_IN0 = 1, S_IN1 = 2, S_IN2 = 4, S_IN3 = 8, S_OUT = 0x80 };

/* How codegen runs an op. */
typedef enum cg_class { CGC_FUSE, CGC_REDUCE, CGC_MATMUL, CGC_VIEW, CGC_EAGER } cg_class;

/* Checks input values before the kernel: 0, or -1 with the error set. */
typedef int (*check_fn)(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line);

typedef struct op_info {
  const char *name;
  int arity;          /* -1: one or more */
  op_kind kind;
  unsigned attrs;     /* AF_* bits */
  dtype_rule dt;
  shape_fn shape;
  kernel_fn kernel;   /* NULL for views */
  check_fn check;     /* NULL: none */
  const char *backward; /* the formula's name; "NONE": not differentiable */
  unsigned saves;     /* S_* bits */
  cg_class cg;
  int cost;           /* 0 cheap, 1 divide or root, 2 polynomial math */
  const char *emitter; /* the vector emitter's name; "NONE": none */
} op_info;
extern const op_info op_table[OP_COUNT];
bool op_differentiable(op_id op);
bool op_has_emitter(op_id op);

/* ---- optable.c: attributes, walked by their schema ------------------------- */

/* Hash and equality over the fields of a schema (AF_* bits; dims by identity). */
uint64_t attrs_hash(unsigned fields, const op_attrs *a);
bool attrs_equal(unsigned fields, const op_attrs *a, const op_attrs *b);
/* a with every dim of the schema's fields evaluated at the symbol values vals, into out; 0 or -1. */
int attrs_eval(unsigned fields, const op_attrs *a, const int64_t *vals, int nvals, op_attrs *out);
/* A field's name in the IR text ("axes", "keepdim", ...). */
const char *attr_field_name(unsigned field);

/* ---- dispatch.c: the one point every op passes through ----------------- */

/* Runs op on in[0..n) with attrs: checks, shape rule, kernel, autograd record,
 * then the hook. Returns a tensor owned by the innermost scope or NULL with the
 * error set. */
kiln_tensor *op_dispatch(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file,
                         int line);

/* Runs op's eager kernel into out (allocated, contiguous, the right shape and
 * dtype); inputs already promoted. No checks, no autograd, no hooks. 0 or -1. */
int op_kernel(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out);
/* Same, but the result belongs to the caller (no scope): the interpreter frees at last use. */
kiln_tensor *op_run(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line);
/* op_run into out, a tensor of a run before (contiguous, of its own storage):
 * 0; 1 where op_run must make a new one (a view, inputs to promote, another
 * result shape or dtype); -1 with the error set. */
int op_run_into(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out, const char *file, int line);

/* A control-flow construct as control.c offers it to a recording. */
typedef enum cf_kind { CF_COND, CF_WHILE, CF_SCAN } cf_kind;
typedef struct cf_call {
  cf_kind kind;
  kiln_tensor *const *in;  /* cond: pred, operands; while: init; scan: init, xs */
  int n_in, n_carry, n_xs;
  int n_args;              /* each region's arguments (cond: the operands; else the carry, then xs[t]) */
  int n_regions;           /* cond: then, else; while: cond, body; scan: body */
  int n_out[2];            /* each region's results */
  int n_results;
  /* Runs region i's body over args (their own scope): out[0..n_out[i]) set,
   * retained, each checked to be a live tensor. 0, or -1 with the error set. */
  int (*run)(const struct cf_call *c, int i, kiln_tensor *const *args, kiln_tensor **out);
  kiln_body fn[2];
  void *ctx;
  const char *file;
  int line;
} cf_call;

/* Set by the tracer while tracing (thread-local, so other threads run eager
 * ops untouched). op: after every dispatched op, with its result. inplace:
 * before an in-place write (op ADD/SUB/MUL/COPY with src, or OP_COUNT for
 * fill_ with value). read: the caller looked at the data (kiln_item, kiln_read,
 * kiln_print), so what it does next may depend on values. */
typedef struct trace_hooks {
  void *ctx;
  void (*op)(void *ctx, op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out,
             const char *file, int line);
  void (*inplace)(void *ctx, op_id op, kiln_tensor *dst, kiln_tensor *src, double value, const char *file, int line);
  void (*read)(void *ctx, const char *what, const kiln_tensor *t, const char *file, int line);
  void (*zero_grad)(void *ctx, kiln_tensor *t); /* before .grad is dropped or read: t becomes a leaf */
  /* Recording (record set): ops make meta tensors (no kernel runs) and the
   * factories below are asked first; a read of data a recording has not
   * computed yet makes the read hook compute it. */
  bool record;
  /* A factory call: kind FAC_FULL (value over shape), FAC_DATA (bytes copied),
   * FAC_RAND (seed; flag: normal). A new tensor owned by the caller, or NULL
   * with the error set. */
  kiln_tensor *(*factory)(void *ctx, int kind, kiln_dtype dt, int ndim, const int64_t *shape, double value,
                          uint64_t seed, bool flag, const void *data, const char *file, int line);
  /* out is a new 0-d tensor holding x's element count over axes plus offset (see numel_scalar) */
  void (*numel)(void *ctx, kiln_tensor *out, const kiln_tensor *x, const int *axes, int naxes, int64_t offset,
                const char *file, int line);
  /* the caller read a size (kiln_size) or other metadata C can branch on */
  void (*size_read)(void *ctx, const kiln_tensor *t, int dim);
  /* The shape the next reshape, expand or factory is given is that of the
   * tensor (serial, rec_call, rec_id): an autograd formula's input, whose
   * sizes the formula passes as numbers. serial 0: that op is over. */
  void (*shape_src)(void *ctx, uint64_t serial, uint64_t rec_call, int rec_id);
  /* kiln_cond, kiln_while_loop or kiln_scan (control.c): record its bodies
   * once, as regions. 1: recorded, results[0..c->n_results) set (new
   * references); 0: not recorded (run it as eager code); -1: error set. */
  int (*cf)(void *ctx, const struct cf_call *c, kiln_tensor **results);
  /* A replayed call (tracer/replay.c), asked before an op's rules run: the
   * op's result (the caller's reference), or NULL, and the op runs as usual
   * under the hooks installed by then (a replay that parts from its log
   * hands over to a recording). */
  kiln_tensor *(*replay)(void *ctx, op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line);
} trace_hooks;
enum { FAC_FULL, FAC_DATA, FAC_RAND };
/* The result of view op over x: a view of x's storage or, where the layout
 * cannot be viewed (a reshape of a strided tensor), a view of a copy of x's
 * elements, or in a recording a meta tensor. NULL: no layout (*no_layout)
 * or out of memory. */
kiln_tensor *view_result(op_id op, kiln_tensor *x, const op_attrs *a, bool record, bool *no_layout);
/* NULL clears. The hooks struct must outlive its use. */
void dispatch_set_hooks(const trace_hooks *h);
const trace_hooks *dispatch_hooks(void);
/* A recording is on: ops make values without data, and a tensor the body
 * wrote in place still holds its old data. A check of index data is then
 * an op of the graph (run on every call's data), not a loop here. */
bool dispatch_recording(void);
void hook_read(const char *what, const kiln_tensor *t, const char *file, int line);
/* A read of t's metadata (dim d's size, or -1 for the rest) that C can
 * branch on: a recording notes it, so the body records at every call.
 * META_LAYOUT: a choice kiln itself made by t's layout (kiln_contiguous's
 * view or copy), which the guard-only path checks too. */
enum { META_LAYOUT = -2 };
void meta_read(const kiln_tensor *t, int dim);
/* Where the numbers an op is given come from (thread-local): user code passes
 * its own (a reshape target, slice bounds), while kiln's formulas (autograd,
 * composite ops) pass sizes of real tensors. The tracer trusts the second kind
 * to be the sizes they equal; the first only where the caller read them. */
void internal_begin(void);
void internal_end(void);
void user_numbers_begin(void);
void user_numbers_end(void);
bool user_numbers(void); /* inside a user-facing op called by user code */
bool in_internal(void);  /* inside kiln's own formulas (autograd, composites) */
kiln_tensor *op_dispatch_user(bool by_user, op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file,
                              int line); /* dispatch.c */
/* A 0-d tensor of dtype dt holding the product of x's sizes over axes (all
 * when naxes is 0) plus offset: a count that formulas divide by (the mean's
 * gradient, var). The tracer records it as a function of x's symbolic shape,
 * where a kiln_scalar would freeze the traced number. Owned by the scope. */
kiln_tensor *numel_scalar(const kiln_tensor *x, const int *axes, int naxes, int64_t offset, kiln_dtype dt,
                          const char *file, int line);

/* ---- shape.c: shape and dtype rules ------------------------------------ */

/* The whole rule of op over in[0..n): the dtype rule, then the shape rule.
 * out, or -1 with why in err (no op name or location: the caller adds them). */
int shape_infer(dim_env *env, op_id op, const shape_arg *in, int n, const op_attrs *a, shape_arg *out, char *err,
                size_t errn);
/* The same on eager tensors: dtype, ndim and shape; 0 or -1 with the error set. */
int shape_rule(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_dtype *dt, int *ndim,
               int64_t *shape, const char *file, int line);
/* The same, its errors under another op's name (a public op written with op). */
int shape_rule_as(op_id op, const char *name, kiln_tensor *const *in, int n, const op_attrs *a, kiln_dtype *dt, int *ndim,
                  int64_t *shape, const char *file, int line);
int shape_broadcast(int na, const int64_t *sa, int nb, const int64_t *sb, int *nout, int64_t *out);
kiln_dtype dtype_promote(const kiln_tensor *a, const kiln_tensor *b);
/* Normalizes axis in [-ndim, ndim) to [0, ndim); -1 when out of range. */
int axis_norm(int axis, int ndim);
bool dtype_is_float(kiln_dtype dt);
/* A dtype the enum names. */
static inline bool dtype_valid(kiln_dtype dt) { return (unsigned)dt <= KILN_BF16; }
/* Stored narrow, computed wide: f16 and bf16 in f32, i32 in i64 (dtype_wide). */
static inline bool dtype_is_narrow(kiln_dtype dt) { return dt == KILN_F16 || dt == KILN_BF16 || dt == KILN_I32; }
/* Relative tolerance of check mode (compiled against eager): a few units in the last place. */
static inline double dtype_check_tol(kiln_dtype dt) {
  return dt == KILN_F32 ? 1e-4 : dt == KILN_F64 ? 1e-10 : dt == KILN_F16 ? 4e-3 : dt == KILN_BF16 ? 3e-2 : 0;
}
static inline kiln_dtype dtype_wide(kiln_dtype dt) { return dt == KILN_I32 ? KILN_I64 : dtype_is_narrow(dt) ? KILN_F32 : dt; }
/* The rules ops.def names. */
#define SHAPE_RULE(fn) int fn(dim_env *, op_id, const shape_arg *, int, const op_attrs *, shape_arg *, char *, size_t);
SHAPE_RULE(sh_pointwise) SHAPE_RULE(sh_where) SHAPE_RULE(sh_reduce) SHAPE_RULE(sh_matmul) SHAPE_RULE(sh_reshape)
SHAPE_RULE(sh_permute) SHAPE_RULE(sh_expand) SHAPE_RULE(sh_slice) SHAPE_RULE(sh_cat) SHAPE_RULE(sh_index_select)
SHAPE_RULE(sh_index_add) SHAPE_RULE(sh_slice_scatter) SHAPE_RULE(sh_gather) SHAPE_RULE(sh_scatter_add) SHAPE_RULE(sh_tri)
SHAPE_RULE(sh_pad) SHAPE_RULE(sh_along) SHAPE_RULE(sh_topk) SHAPE_RULE(sh_attention) SHAPE_RULE(sh_attention_grad)
#undef SHAPE_RULE
/* Indices (input 1, 1-D i64) within dim a->dim of input 0. */
int chk_indices(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line);
/* Input 0, i64, holds only values in [0, a->k). */
int chk_index_range(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line);
/* Indices (input 1, i64 of any shape) within dim a->dim of input 0. */
int chk_gather(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line);
/* dist.c: MPI is there and started (started here on first use). */
int chk_dist(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line);

/* ---- kernels: write out (allocated, contiguous) from in ---------------- */

int k_binary(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_unary(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_where(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_cast(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_copy(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_reduce(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_argmax(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
/* reduce.c: softmax (or log_softmax) of contiguous f32 or f64 x along its last
 * dim into out (x's shape, contiguous), bit for bit nn.c's composite. */
void red_softmax_rows(const kiln_tensor *x, kiln_tensor *out, bool log);
int k_matmul(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_cat(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
/* tensor.c: the generator's numbers from attrs seed and offset (element i is number offset + i) */
int k_rand(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
/* The default generator's state (check mode replays a call's draws eagerly). */
void gen_state_get(uint64_t *seed, uint64_t *offset);
void gen_state_set(uint64_t seed, uint64_t offset);
int k_index_select(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_index_add(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_index_add_to(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_slice_scatter(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_gather(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_scatter_add(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_index_copy(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_tri(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_pad(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_cumsum(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_topk(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
/* attention.c: softmax(scale * q @ k^T, masked) @ v, fused (flash attention) */
int k_attention(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
/* attention.c: its gradients dq, dk, dv, flattened into one (flash attention backward) */
int k_attention_grad(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
/* dist.c: the sum (or mean, attrs flag) of in[0] over the processes of MPI_COMM_WORLD */
int k_allreduce(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);

/* dist.c: allreduces in flight (MPI_Iallreduce), so that compiled code runs
 * on while they travel: runtime.c starts one where the graph has it and waits
 * for it only before a kernel touches its buffer. Consecutive small ones of
 * one dtype and op are packed into a bucket (a staging buffer) and go as one
 * collective when it is full, when a kernel needs a member, or after the
 * graph's last allreduce (docs/scaling.md). One queue per call. */
enum { DIST_MAX_PENDING = 64 };
typedef struct dist_member {
  char *dst; /* the tensor's buffer, written from the stage when done */
  int64_t count;
} dist_member;
typedef struct dist_coll {
  unsigned char req[16]; /* the MPI_Request, once issued */
  char *data;            /* what MPI reduces: the tensor in place, or stage */
  int64_t count;
  kiln_dtype dtype;
  bool mean;
  char *stage;      /* a bucket's staging buffer (NULL: in place) */
  dist_member *m;   /* a bucket's members, in the stage's order */
  char *lo, *hi;    /* the members' bytes lie in [lo, hi): most buffers are seen not to touch them at once */
  int n_m, cap_m;
  size_t stage_cap; /* bytes allocated at stage */
} dist_coll;
typedef struct dist_pending {
  int n;           /* issued: r[0, n) */
  double since;    /* when the queue last went from empty to not (ms) */
  int64_t cap;     /* bucket bytes; 0: none (each tensor alone); < 0: read KILN_DIST_BUCKET_KB on first use */
  dist_coll open;  /* the bucket being filled (open.n_m members), not issued yet */
  dist_coll r[DIST_MAX_PENDING];
} dist_pending;
/* Whether compiled code overlaps its allreduces (KILN_DIST_OVERLAP=0: it waits at once). */
bool dist_overlap(void);
/* Starts the sum (mean) of out's values (contiguous) over the processes, in
 * place: into the open bucket, or issued; last (no allreduce follows in the
 * graph) issues the open bucket at once. 0, or -1 and err_kernel_why. */
int dist_start(dist_pending *q, kiln_tensor *out, bool mean, bool last);
/* Waits for those whose data overlaps [lo, lo + bytes) (issuing the open
 * bucket when a member does), or all when lo is NULL. 0 or -1. */
int dist_wait(dist_pending *q, const char *lo, size_t bytes);
/* Lets MPI move the ones in flight along (it progresses them only inside its calls). */
void dist_poll(dist_pending *q);
/* After an error or at the end: drops the open bucket unissued, waits for
 * the rest (nothing may still write the caller's buffers), frees it all. */
void dist_end(dist_pending *q);
static inline bool dist_busy(const dist_pending *q) { return q->n > 0 || q->open.n_m > 0; }

/* pointwise.c: elementwise into an arbitrary (possibly strided) destination.
 * The in-place ops use these directly. All operands already have dtype dt
 * (dst may be bool for comparisons). */
void pw_binary(op_id op, kiln_tensor *dst, const kiln_tensor *a, const kiln_tensor *b);
void pw_unary(op_id op, kiln_tensor *dst, const kiln_tensor *a, const op_attrs *attrs);
/* A clamp bound as an i64 (saturating; the entry point keeps fractions off i64). */
static inline int64_t pw_bound_i64(double v) {
  return v != v ? 0 : v <= -0x1p63 ? INT64_MIN : v >= 0x1p63 ? INT64_MAX : (int64_t)v;
}
/* dst = src converted to dst's dtype, broadcasting src to dst's shape. */
void pw_copy(kiln_tensor *dst, const kiln_tensor *src);
void pw_fill(kiln_tensor *dst, double v);
/* Element i of a contiguous buffer of dtype dt, as a double; and the store
 * (rounded to nearest even for the narrow floats, saturated for integers). */
double elem_load(kiln_dtype dt, const void *base, int64_t i);
void elem_store(kiln_dtype dt, void *base, int64_t i, double v);

/* ---- views.c: view layouts (shared by dispatch and in-place checks) ----- */

/* Layout of op's view of t; 0 or -1 (reshape that needs a copy returns 1). */
int view_layout(op_id op, const kiln_tensor *t, const op_attrs *a, int *ndim, int64_t *shape,
                int64_t *stride, int64_t *offset);

/* ---- autograd.c -------------------------------------------------------- */

typedef int (*backward_fn)(ag_node *node, kiln_tensor *g, kiln_tensor **gin);
struct ag_node {
  atomic_int refcount;
  op_id op;
  op_attrs attrs;
  int n_in;
  kiln_tensor **in;       /* saved inputs (retained) */
  unsigned long *version; /* storage versions of the inputs when saved */
  kiln_dtype out_dtype;
  int out_ndim;
  int64_t out_shape[MAXD];
  const char *file; /* the forward op's caller: backward ops report it too */
  int line;
  bool freed;             /* saved tensors released by a backward */
  kiln_tensor *acc;       /* during backward: gradient of the output so far */
  int pending;            /* during backward: consumers not yet processed */
};
bool grad_mode(void);
/* Records out = op(in) for autograd when grad mode is on and an input requires grad. */
int ag_record(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out, const char *file,
              int line);
void ag_node_release(ag_node *node);
/* A node with several outputs (a control-flow construct recorded as one
 * region): backward gets every output's gradient (NULL where none flowed)
 * and sets gin[0..n_in) (NULL: no gradient for that input), scope-owned. */
typedef struct ag_multi_ops {
  int (*backward)(void *data, kiln_tensor *const *gout, kiln_tensor **gin, const char *file, int line);
  void (*free)(void *data);
} ag_multi_ops;
/* Around a reshape, expand or factory given shape: when an autograd formula
 * running now passes one of its inputs' shapes, tells the recording whose
 * (shape_src). Numbers alone cannot say which of two sizes of the same
 * value they are. */
void ag_shape_begin(const int64_t *shape);
void ag_shape_end(void);
/* Gives out[0..n_out) (their float ones) one node of ops over in[0..n_in),
 * which owns data from now on (freed by ops->free, on error too). 0 or -1. */
int ag_record_multi(const ag_multi_ops *ops, void *data, kiln_tensor *const *in, int n_in, kiln_tensor *const *out,
                    int n_out, const char *file, int line);
/* out[0..n_out) (their float ones) get a node whose backward is an error
 * naming file:line: kiln_while_loop is forward only. 0 or -1. */
int ag_forward_only(kiln_tensor *const *out, int n_out, const char *file, int line);
/* Gradients of out w.r.t. wrt[0..n), as kiln_grad_of, but a wrt tensor with
 * history is a leaf here: the walk stops at it; NULL for one out does not
 * reach, and a gradient keeps its grad_if. */
int ag_grad_of_stop(kiln_tensor *out, kiln_tensor *const *wrt, int n, kiln_tensor **grads, const char *file, int line);
/* The depth of kiln_no_grad_begin scopes open on this thread. */
int grad_depth(void);
/* Calls on this thread that set kiln's own state (kiln_manual_seed,
 * kiln_set_num_threads): settings_note counts one. */
unsigned long settings_count(void);
void settings_note(void);
/* How many times autograd's engine (kiln_backward, kiln_backward_with,
 * kiln_grad_of) ran on this thread. */
unsigned long ag_engine_runs(void);
/* Grad mode on whatever kiln_no_grad_begin said; the old depth, for grad_mode_restore. */
int grad_mode_force_on(void);
void grad_mode_restore(int depth);

/* ---- conv.c, pooling.c: convolution and pooling over NCHW ---------------- */

#define SHAPE_RULE(fn) int fn(dim_env *, op_id, const shape_arg *, int, const op_attrs *, shape_arg *, char *, size_t);
SHAPE_RULE(sh_conv2d) SHAPE_RULE(sh_conv2d_grad) SHAPE_RULE(sh_pool2d) SHAPE_RULE(sh_pool2d_grad)
#undef SHAPE_RULE
int k_conv2d(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_conv2d_grad_input(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_conv2d_grad_weight(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_pool2d(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
/* Bytes of working memory (im2col columns and the product of the images that
 * share a GEMM, or Winograd's U and blocks) the kernel of op (conv2d or one of its gradients) takes with
 * these operands: compiled code plans it like any intermediate. 0 for other ops. */
size_t conv_scratch_bytes(op_id op, kiln_tensor *const *in, const op_attrs *a);
/* That kernel on the caller's working memory (bytes of it, conv_scratch_bytes
 * at most; NULL: its own). 0, or -1 when out of memory. */
int conv_kernel(op_id op, kiln_tensor *const *in, const op_attrs *a, kiln_tensor *out, void *scratch, size_t bytes);
/* A conv2d's weight prepared once for many calls (compiled inference): the
 * bytes of it (0 where the conv has nothing to prepare: only a forward that
 * runs as Winograd does), conv_prepare_weight writing them from in[1] into
 * prep (64-byte aligned), and the kernel that reads prep instead of
 * transforming in[1], with conv_prepared_scratch_bytes of working memory.
 * The kernel's results are conv_kernel's, to the bit. 0, or -1. */
size_t conv_prepared_bytes(op_id op, kiln_tensor *const *in, const op_attrs *a);
size_t conv_prepared_scratch_bytes(op_id op, kiln_tensor *const *in, const op_attrs *a);
int conv_prepare_weight(op_id op, kiln_tensor *const *in, const op_attrs *a, void *prep);
int conv_kernel_prepared(op_id op, kiln_tensor *const *in, const op_attrs *a, kiln_tensor *out, const void *prep,
                         void *scratch, size_t bytes);
int k_pool2d_grad(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);

/* ---- winograd.c: 3x3 stride-1 f32 convolutions as Winograd F(2x2, 3x3) -- */

/* A 3x3 convolution of stride 1, dilation 1, one group (conv.c decides
 * which run here). flip: the weight is (C, O, 3, 3) and taken rotated by 180
 * degrees, as the input gradient of a convolution takes its weight. */
typedef struct wino_geom {
  int64_t n, c, h, w; /* input (N, C, H, W) */
  int64_t o, ph, pw;  /* output channels, padding */
  int64_t ho, wo;     /* output size: h + 2 ph - 2, w + 2 pw - 2 */
  bool flip;
} wino_geom;

/* Working memory wino_conv_f32 takes at the pool's thread count now. */
size_t wino_scratch_bytes(const wino_geom *q);
/* y (N, O, ho, wo) = conv(x, w), on scratch (bytes of it; NULL or too
 * little: its own). 0, or -1 when out of memory. */
int wino_conv_f32(const wino_geom *q, const float *x, const float *w, float *y, void *scratch, size_t bytes);
/* The transformed weight U = G w G^T of the forward (flip false) on its own,
 * for a caller that keeps it across calls while w is unchanged (compiled
 * inference): wino_weight_bytes of it (a multiple of 64), written by
 * wino_weight_prepare; wino_conv_prepared_f32 then skips the transform and
 * takes wino_prepared_scratch_bytes of working memory (the blocks alone).
 * Its results are wino_conv_f32's, to the bit. */
size_t wino_weight_bytes(const wino_geom *q);
void wino_weight_prepare(const wino_geom *q, const float *w, float *u);
size_t wino_prepared_scratch_bytes(const wino_geom *q);
int wino_conv_prepared_f32(const wino_geom *q, const float *x, const float *u, float *y, void *scratch, size_t bytes);
/* Working memory wino_grad_weight_f32 takes. */
size_t wino_grad_weight_scratch_bytes(const wino_geom *q);
/* gw (O, C, 3, 3), the gradient of conv(x, w) (flip false) for the output's
 * gradient gy (N, O, ho, wo), on scratch as wino_conv_f32's. 0, or -1 when
 * out of memory. */
int wino_grad_weight_f32(const wino_geom *q, const float *x, const float *gy, float *gw, void *scratch, size_t bytes);

/* ---- pool.h is separate (thread pool) ----------------------------------- */

#endif
