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
/* Test build: make the n-th allocation from now fail (0 = never). Returns the
 * allocations the previous setting still had to go (0: it fired, or was off). */
int64_t alloc_fail_after(int64_t n);
/* Storage bytes accounting (tensor data only). */
void alloc_track(int64_t delta);
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
/* Gives a message set without a location (deep in a compiled call) the caller's file:line. */
void err_locate(const char *file, int line);
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
  uint64_t serial;   /* unique for the process's life, unlike the address */
};

#define REF_ONE 1ull                    /* a reference */
#define REF_SCOPED ((1ull << 32) | 1ull) /* a reference a scope holds */
/* All references to t, scopes' included; 0 once released. */
static inline uint32_t tensor_refs(const kiln_tensor *t) { return (uint32_t)atomic_load(&t->refs); }
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
/* New contiguous tensor with uninitialized data, owned by the caller (not by a scope). */
kiln_tensor *tensor_new(kiln_dtype dt, int ndim, const int64_t *shape);
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
void contiguous_strides(int ndim, const int64_t *shape, int64_t *stride);
/* One element as a double (index in row-major order). */
double tensor_get(const kiln_tensor *t, int64_t linear);

/* ---- ops.def expanded ------------------------------------------------- */

typedef enum op_kind { KIND_POINTWISE, KIND_REDUCE, KIND_MATMUL, KIND_VIEW, KIND_OTHER } op_kind;

typedef enum op_id {
#define X(id, name, arity, kind, kernel, backward) OP_##id,
#include "ops.def"
#undef X
  OP_COUNT
} op_id;

/* Attributes are inline and fixed-size: they are part of a node's identity. */
typedef struct op_attrs {
  int ndim;                 /* reshape/expand target rank */
  int64_t shape[MAXD];      /* reshape/expand target; index_add/slice_scatter: none */
  int perm[MAXD];           /* permute */
  int naxes;                /* reductions: sorted, non-negative */
  int axes[MAXD];
  bool keepdim;
  int dim;                  /* slice, cat, index_select, index_add, slice_scatter */
  int64_t start, end, step; /* slice, slice_scatter */
  kiln_dtype dtype;         /* cast */
  int infer;                /* reshape: 1 + the dim the caller gave as -1, else 0 (for the tracer) */
  bool raw;                 /* slice: raw_start/raw_end hold the caller's bounds before normalizing */
  int64_t raw_start, raw_end;
} op_attrs;

typedef struct op_info {
  const char *name;
  int arity; /* -1: variadic */
  op_kind kind;
} op_info;
extern const op_info op_table[OP_COUNT];

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
  void (*zero_grad)(void *ctx, kiln_tensor *t); /* before .grad is dropped */
  /* out is a new 0-d tensor holding x's element count over axes plus offset (see numel_scalar) */
  void (*numel)(void *ctx, kiln_tensor *out, const kiln_tensor *x, const int *axes, int naxes, int64_t offset,
                const char *file, int line);
  /* the caller read a size (kiln_size): numbers it passes later may be made from it */
  void (*size_read)(void *ctx, const kiln_tensor *t, int dim);
} trace_hooks;
/* NULL clears. The hooks struct must outlive its use. */
void dispatch_set_hooks(const trace_hooks *h);
const trace_hooks *dispatch_hooks(void);
void hook_read(const char *what, const kiln_tensor *t, const char *file, int line);
/* Where the numbers an op is given come from (thread-local): user code passes
 * its own (a reshape target, slice bounds), while kiln's formulas (autograd,
 * composite ops) pass sizes of real tensors. The tracer trusts the second kind
 * to be the sizes they equal; the first only where the caller read them. */
void internal_begin(void);
void internal_end(void);
void user_numbers_begin(void);
void user_numbers_end(void);
bool user_numbers(void); /* inside a user-facing op called by user code */
/* A 0-d tensor of dtype dt holding the product of x's sizes over axes (all
 * when naxes is 0) plus offset: a count that formulas divide by (the mean's
 * gradient, var). The tracer records it as a function of x's symbolic shape,
 * where a kiln_scalar would freeze the traced number. Owned by the scope. */
kiln_tensor *numel_scalar(const kiln_tensor *x, const int *axes, int naxes, int64_t offset, kiln_dtype dt,
                          const char *file, int line);

/* ---- shape.c: shape and dtype rules ------------------------------------ */

/* Fills out dtype/ndim/shape; 0 or -1 with the error set (file/line for it). */
int shape_rule(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_dtype *dt, int *ndim,
               int64_t *shape, const char *file, int line);
int shape_broadcast(int na, const int64_t *sa, int nb, const int64_t *sb, int *nout, int64_t *out);
kiln_dtype dtype_promote(const kiln_tensor *a, const kiln_tensor *b);
/* Normalizes axis in [-ndim, ndim) to [0, ndim); -1 when out of range. */
int axis_norm(int axis, int ndim);
bool dtype_is_float(kiln_dtype dt);

/* ---- kernels: write out (allocated, contiguous) from in ---------------- */

typedef int (*kernel_fn)(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out);
int k_binary(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_unary(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_where(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_cast(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_copy(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_reduce(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_argmax(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_matmul(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_cat(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_index_select(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_index_add(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);
int k_slice_scatter(op_id, kiln_tensor *const *, int, const op_attrs *, kiln_tensor *);

/* pointwise.c: elementwise into an arbitrary (possibly strided) destination.
 * The in-place ops use these directly. All operands already have dtype dt
 * (dst may be bool for comparisons). */
void pw_binary(op_id op, kiln_tensor *dst, const kiln_tensor *a, const kiln_tensor *b);
void pw_unary(op_id op, kiln_tensor *dst, const kiln_tensor *a);
/* dst = src converted to dst's dtype, broadcasting src to dst's shape. */
void pw_copy(kiln_tensor *dst, const kiln_tensor *src);
void pw_fill(kiln_tensor *dst, double v);

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

/* ---- pool.h is separate (thread pool) ----------------------------------- */

#endif
