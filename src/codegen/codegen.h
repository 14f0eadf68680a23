/* Internal header of the codegen layer: fusion into kernels, the memory plan,
 * lowering to LLVM IR, vector math, the ORC JIT and the runtime that runs a
 * compiled graph. Only src/codegen includes LLVM's headers. Sectioned by file.
 *
 * The stages, in order (runtime.c lists them):
 *   fuse   graph -> kernels: each kernel a loop nest over symbolic sizes whose
 *          body is a small expression DAG over loads from buffers
 *   plan   buffers -> arena slots by liveness (sizes evaluated per call)
 *   lower  kernels -> one LLVM module (vector math inline)
 *   jit    optimize for the host CPU, compile with LLJIT, look the kernels up
 *   run    bind symbols, evaluate the kernels' parameters, run each kernel
 *          over the thread pool (or BLAS, or an eager kernel), write back */
#ifndef KILN_CODEGEN_H
#define KILN_CODEGEN_H

#include <llvm-c/Core.h>
#include <llvm-c/TargetMachine.h>

#include "rt/plan.h"
#include "tracer/tracer.h"

/* ---- fuse.c: kernels ------------------------------------------------------ */

/* A buffer: memory one node's value lives in. */
typedef enum cg_buf_kind {
  CG_BUF_INPUT,  /* an input or param tensor */
  CG_BUF_GRAD,   /* the .grad of a leaf */
  CG_BUF_CONST,  /* a constant of the graph */
  CG_BUF_TEMP,   /* an intermediate in the arena, contiguous */
  CG_BUF_OUTPUT  /* a graph output or write value: a fresh contiguous tensor */
} cg_buf_kind;

typedef struct cg_buf {
  cg_buf_kind kind;
  int node;             /* the graph node whose value it holds */
  kiln_dtype dtype;
  int ndim;
  sym_dim shape[MAXD];  /* of the node */
  int first, last;      /* kernels that write it first and read it last (liveness) */
  int alias_of;         /* TEMP reusing a dying input's memory in place, else -1 */
  int scratch_of;       /* TEMP: working memory of that kernel (a conv's im2col columns), sized by
                           its op at each call (conv_scratch_bytes); else -1 */
  bool updated;         /* INPUT: a kernel stores into it in place (its write-back's value); check mode
                           then runs the kernels on a copy */
} cg_buf;

/* How a kernel reads or writes a buffer: element offset and one stride per
 * loop dim (0 where it broadcasts), all symbolic, in the buffer's contiguous
 * row-major numbering (the runtime makes a strided input contiguous first). */
typedef struct cg_access {
  int buf;
  sym_dim offset;        /* elements, in the buffer's contiguous numbering */
  sym_dim stride[MAXD];  /* per loop dim, in the buffer's contiguous numbering */
} cg_access;

/* One scalar operation of a kernel body, evaluated per loop element. */
typedef enum cg_eop {
  CG_LOAD,   /* access index in a */
  CG_CONST,  /* value in c, dtype */
  CG_ACC,    /* the result of reduce stage a of this kernel (per outer element) */
  CG_SYM,    /* the symbolic size s, converted to dtype (a count: IR_NUMEL) */
  CG_OP      /* op (an eager op_id, pointwise) over in[0..n_in) */
} cg_eop;

typedef struct cg_expr {
  cg_eop kind;
  int op;           /* CG_OP: OP_ADD ... OP_CAST, OP_WHERE */
  kiln_dtype dtype; /* of the result */
  int n_in;
  int in[3];        /* expression ids, smaller than this one's */
  int a;            /* CG_LOAD: access id; CG_ACC: stage id */
  double c;         /* CG_CONST */
  sym_dim s;        /* CG_SYM */
  kiln_dtype cast_to; /* CG_OP with OP_CAST */
  double num[2];     /* CG_OP: the op's numbers (attrs value, value2: clamp's bounds, a slope);
                       part of the kernel's signature like any operand */
} cg_expr;

/* A stage of a kernel, run for each outer element in order:
 *   REDUCE: acc = reduce over the inner dims of expr (sum, max, min; mean is a sum then a divide)
 *   MAP:    for each inner element, store expr to the access (inner dims may be none) */
typedef enum cg_stage_kind { CG_REDUCE, CG_MAP } cg_stage_kind;

typedef struct cg_stage {
  cg_stage_kind kind;
  int op;           /* REDUCE: OP_SUM, OP_MAX, OP_MIN */
  int expr;         /* expression id */
  int store;        /* MAP: access id to write */
  bool inner;       /* MAP: loops over the inner dims (else once per outer element) */
} cg_stage;

/* Outer elements a dot-product kernel runs per pass of its inner loop
 * (lower.c); the runtime's blocks of staged kernels are multiples of it. */
enum { CG_JAM = RT_JAM };

typedef enum cg_kernel_kind {
  CG_K_LOOP,    /* a loop nest (lowered to LLVM): pointwise, reductions, row-wise */
  CG_K_MATMUL,  /* cblas gemm on buffers, then (optionally) a loop epilogue kernel */
  CG_K_EAGER    /* one graph node run through the eager kernel (cat, index ops, argmax ...) */
} cg_kernel_kind;

typedef struct cg_kernel {
  cg_kernel_kind kind;
  int id;
  /* loops: dims [0, n_outer) are outer (parallel, flattened), [n_outer, ndim) inner */
  int ndim, n_outer;
  sym_dim dim[MAXD];
  cg_access *acc;
  int n_acc;
  cg_expr *expr;
  int n_expr;
  cg_stage *stage;
  int n_stage;
  /* CG_K_MATMUL / CG_K_EAGER: the graph node and its operands' buffers */
  int node;
  int in_buf[3], out_buf;
  int *in_rest, n_in_rest; /* CG_K_EAGER: the buffers of operands past the third (a cat of many) */
  /* CG_K_MATMUL: out = alpha * a @ b + beta * out, with beta 1 when an
   * epilogue was folded in (out then holds result_node's value, not node's) */
  double alpha, beta;
  int result_node;   /* the node whose value out_buf holds after the kernel, -1 none (a prefill) */
  int scratch_buf;   /* CG_K_EAGER: the buffer of its working memory, or -1 */
  /* what it covers, for dumps and check mode */
  int *nodes;
  int n_nodes;
  char name[32];     /* "k3_pointwise", symbol in the module */
  sym_dim *param;    /* what p[i] holds when the kernel runs (filled by lowering) */
  int n_param;
  /* A reduction over every dim, split by lowering into CG_BLOCKS blocks of
   * its first dim: kN(p, bufs, b0, b1) leaves block b's partial in the
   * scratch bufs[n_acc] (f64 [CG_BLOCKS]); kN(p, bufs, -1, 0) then combines
   * them in block order and stores. The blocks do not depend on the thread
   * count, so neither do the bits. */
  bool split;
  /* Set before lowering for a light kernel: lowering may emit its loops as
   * vectors itself (lower.c, own_vectors_ok) */
  bool own_vectors;
} cg_kernel;

/* Where a node's value lives: a buffer read through an offset and strides
 * (per node dim), or buf -1 for a node inlined into kernels. */
typedef struct cg_view {
  int buf;
  sym_dim off;
  sym_dim stride[MAXD];
} cg_view;

typedef struct cg_program {
  const ir_graph *g;
  cg_buf *buf;
  int n_buf;
  int *node_buf;     /* graph node -> the buffer it is stored in, or -1 */
  cg_view *views;    /* graph node -> where its value is (buffers and views of them) */
  cg_kernel *k;
  int n_k;
} cg_program;

/* Partitions g into kernels; NULL with err on failure (the caller falls back). */
cg_program *fuse_graph(const ir_graph *g, char *err, size_t errn);
void cg_program_free(cg_program *p);
/* The kernels, their nodes with file:line, loops and buffers, as text. */
void fuse_dump(const cg_program *p, FILE *f);

/* ---- jit.c: LLVM target, optimization, ORC LLJIT ---------------------------- */

typedef struct cg_jit cg_jit;

/* One-time LLVM setup (thread safe); 0 or -1. */
int jit_init(char *err, size_t errn);
/* Whether kernels use 512-bit vectors (AVX-512, unless KILN_JIT_FEATURES turns it off). */
bool jit_wide_vectors(void);
/* A module to build into, for the host target, in a context of its own. */
typedef struct cg_module {
  LLVMContextRef ctx;
  LLVMModuleRef mod;
  bool own_ctx;
} cg_module;
int jit_module_new(cg_module *m, const char *name, char *err, size_t errn);
void jit_module_dispose(cg_module *m); /* only for a module not handed to jit_emit or jit_compile */
/* The pass pipeline kernels are optimized with (KILN_LLVM_PASSES, or the kernel passes). */
const char *jit_passes(void);
/* What compiled code depends on besides its IR: LLVM's version, the host
 * target, CPU and features, the code generator's options (a string kept for
 * the life of the process; part of every kernel cache key). */
const char *jit_target_id(void);
/* Verifies and optimizes m (consumed) for the host with the pass pipeline
 * passes (NULL: jit_passes()), dumps the optimized IR
 * (KILN_DUMP_LLVM) and machine code (KILN_DUMP_ASM) to dump_to, and emits an
 * object file into *obj (alloc_malloc'ed, *len bytes). Times the two phases.
 * 0, or -1 with err. */
int jit_emit(cg_module *m, const char *passes, unsigned dump, FILE *dump_to, double *opt_ms, double *codegen_ms,
             void **obj, size_t *len, char *err, size_t errn);
/* Exporting (export.c): a target machine for triple (NULL: the host's) and
 * cpu (NULL: a generic CPU of the target; "native": the host's CPU and
 * features), NULL with err; and mod (kept: the caller disposes it)
 * verified, optimized for tm and emitted as an object file, as jit_emit. */
LLVMTargetMachineRef jit_machine_for(const char *triple, const char *cpu, char *err, size_t errn);
int jit_emit_for(LLVMModuleRef mod, LLVMTargetMachineRef tm, void **obj, size_t *len, char *err, size_t errn);
/* An LLJIT for the host, empty; objects are added, their functions expected
 * by name, then linked. NULL with err. */
cg_jit *jit_new(char *err, size_t errn);
int jit_add(cg_jit *j, const void *obj, size_t len, const char *what, char *err, size_t errn); /* copies obj */
int jit_expect(cg_jit *j, const char *name, const char *display); /* display: perf's name, or NULL */
int jit_link(cg_jit *j, char *err, size_t errn); /* looks every expected function up */
/* jit_emit, jit_new, jit_add and jit_link for m's functions: NULL with err. */
cg_jit *jit_compile(cg_module *m, unsigned dump, FILE *dump_to, double *opt_ms, double *codegen_ms, char *err,
                    size_t errn);
/* Address of a linked function, or NULL. */
void *jit_lookup(cg_jit *j, const char *name);
void jit_free(cg_jit *j);

/* ---- kcache.c: compiled kernels by key ---------------------------------------- */

/* The kernel cache: object files by key (jit_target_id, the pipeline and a
 * kernel's unoptimized IR), kept in memory for the process and, when
 * KILN_CACHE_DIR names a directory, on disk for later processes. A kernel
 * is in the object as a weak_odr function named kcache_symbol(key); an
 * object may hold other kernels too. A hit gives the object's id (equal
 * ids, equal objects) and, unless the id is one of held[0..n_held), a copy
 * of it in *obj (alloc_malloc'ed; else *obj is NULL): true. Errors are
 * misses. kcache_put files obj under each of keys[0..n). */
bool kcache_get(const char *key, size_t keylen, const uint64_t *held, int n_held, void **obj, size_t *len, uint64_t *id,
                bool *from_disk);
void kcache_put(const char *const *keys, const size_t *keylens, int n, const void *obj, size_t len);
/* Empties the memory of the cache (the files stay). */
void kcache_forget(void);
/* KILN_CACHE_SIZE in bytes (default 1 GiB; 0: no limit). */
uint64_t kcache_size_limit(void);
/* Keeps KILN_CACHE_DIR under the limit now: temporaries older than an hour
 * go, then the files used least recently until the cache's files come to
 * three quarters of the limit. A put does this at a process's first write
 * and after every eighth of the limit written. */
void kcache_trim(void);
/* The symbol a kernel of this key is compiled under: "kiln_" and 32 hex digits of its hash. */
void kcache_symbol(const char *key, size_t keylen, char out[40]);

/* ---- vmath_ir.c: vector math emitted as IR ---------------------------------- */

/* Emits op (OP_EXP, OP_LOG, OP_TANH, OP_SIGMOID, OP_GELU, OP_GELU_ERF, OP_ERF,
 * OP_SIN, OP_COS, OP_SQRT, OP_RSQRT, OP_SILU, OP_SOFTPLUS, OP_LOG1P, OP_EXPM1) applied to x, a float or double scalar or
 * vector, with branch-free code (selects, no calls) that the loop vectorizer
 * can widen. Accuracy: the bounds of src/eager/vmath.h (tested). NULL when op
 * is not one of these. */
LLVMValueRef vmath_emit(LLVMBuilderRef b, int op, LLVMValueRef x);

/* ---- emit.c: an op's instructions from its operands' values ------------------- */

/* What an emitter gets: operands that are scalars, or vectors of one lane count. */
typedef struct cg_emit {
  LLVMBuilderRef b;
  int op;
  kiln_dtype it;         /* the operands' dtype (a where's: its branches') */
  kiln_dtype cast_to;    /* OP_CAST */
  LLVMValueRef v[3];
  bool b_const;          /* operand 1 is the constant b_value (pow by 2) */
  double b_value;
  double num[2];         /* the op's numbers (cg_expr.num) */
} cg_emit;
typedef LLVMValueRef (*cg_emit_fn)(const cg_emit *e);
/* The emitter ops.def names for op, NULL when it has none. */
cg_emit_fn cg_emitter(int op);
/* NaN-propagating max/min (eager's MAXNAN), and dtype conversion, on scalars or vectors. */
LLVMValueRef cg_maxnan(LLVMBuilderRef b, kiln_dtype dt, LLVMValueRef x, LLVMValueRef y, bool max);
LLVMValueRef cg_convert(LLVMBuilderRef b, LLVMValueRef v, kiln_dtype from, kiln_dtype to);
/* A narrow dtype's stored bits (i16 for f16 and bf16, i32 for i32) to the
 * value kernels compute with (float, i64), and back with eager's rounding
 * (eager/half.h: to nearest even, bit for bit; i32 wraps). */
LLVMValueRef cg_narrow_load(LLVMBuilderRef b, LLVMValueRef bits, kiln_dtype dt);
LLVMValueRef cg_narrow_store(LLVMBuilderRef b, LLVMValueRef v, kiln_dtype dt);
#ifdef KILN_TEST_BUILD
/* Test build: makes op look as if ops.def named no emitter for it (drop), or undoes that. */
void cg_test_drop_emitter(int op, bool drop);
#endif

/* ---- lower.c ------------------------------------------------------------------ */

#define CG_BLOCKS RT_BLOCKS

/* The first access of k to access a's buffer: accesses to one buffer share
 * its pointer (and alias scope) in the kernel's code. */
static inline int cg_first_access(const cg_kernel *k, int a) {
  int f = 0;
  while (k->acc[f].buf != k->acc[a].buf) f++;
  return f;
}
/* Elements the runtime adds to the pointer it passes for access a's buffer:
 * the first access's offset when it is a constant, so that kernels that
 * differ only in where in their buffers they start (the q, k and v slices
 * of one projection) have the same code. The code adds the rest. */
static inline int64_t cg_pointer_shift(const cg_kernel *k, int a) {
  sym_dim o = k->acc[cg_first_access(k, a)].offset;
  return sym_is_const(o) ? o.c : 0;
}

/* Does k run stages per outer element (a reduction, or a row-wise MAP)? */
static inline bool cg_staged(const cg_kernel *k) {
  for (int s = 0; s < k->n_stage; s++)
    if (k->stage[s].kind == CG_REDUCE || k->stage[s].inner) return true;
  return false;
}

/* A pointwise kernel of two or more dims whose last is a constant: its row
 * length. Its code loops over whole rows of that constant length (lower.c,
 * lower_flat). 0: another kernel. */
static inline int64_t cg_flat_row(const cg_kernel *k) {
  if (k->kind != CG_K_LOOP || k->ndim < 2 || !sym_is_const(k->dim[k->ndim - 1]) || k->dim[k->ndim - 1].c < 1) return 0;
  return cg_staged(k) ? 0 : k->dim[k->ndim - 1].c;
}

/* Adds kernel k (CG_K_LOOP) to module m as function k->name; 0, or -1 with why. */
int lower_kernel(const cg_program *p, cg_kernel *k, LLVMModuleRef m, char *why, size_t whyn);

/* The polynomial math (exp, log, tanh ...) k does per element. A kernel
 * without any is light: it is bound by memory, and LLVM's quick code
 * generator makes code for it as fast as the full one's (jit.c). */
int lower_costly_ops(const cg_kernel *k);
/* Does k run by the column schedule (reductions over the slow axes, a block of outer elements at a time)? */
bool lower_is_column(const cg_kernel *k);
/* Does k run by the jammed dot-product schedule (a matvec, row sums)? The
 * runtime splits a small one in fixed shares, and at a finer grain where
 * the pool's workers are awake or runs come back to back (rt/plan.h). */
bool lower_is_jammed(const cg_kernel *k);
#define CG_QUICK_ATTR "kiln-quick" /* a function attribute: compile with the quick code generator */

/* ---- kkey.c: kernel keys ------------------------------------------------------- */

/* The key of loop kernel k's unoptimized function fn (kkey.c says what it
 * holds); equal keys, equal code. text: from LLVM's printer, which the
 * test build compares with. NULL: no key (out of memory, or too large). */
char *kernel_key(LLVMValueRef fn, const cg_kernel *k, bool text);

/* ---- plan.c: memory ------------------------------------------------------------ */

/* Arena offsets for the TEMP buffers of p given their byte sizes this call:
 * first fit by liveness over the kernel order. Returns the arena bytes. */
size_t plan_arena(const cg_program *p, const size_t *bytes, size_t *offset);

/* ---- prepare.c: weights prepared once, kept across calls ---------------------- */

enum { CG_PREP_MAX = 64 }; /* candidates a variant keeps entries for (ResNet-50 has 53 convs) */

typedef struct cg_prep_entry {
  int kernel, wbuf;         /* the conv's kernel; its weight's buffer (an argument) */
  size_t decided;           /* the prepared bytes admission was last decided for (0: none wanted) */
  bool admitted;            /* this call's sizes keep a prepared weight */
  void *data;               /* the prepared weight, bytes of it (counted as tensor memory) */
  size_t bytes;
  bool valid;               /* data holds the weight with this key: */
  uint64_t serial;          /*   its storage's serial and version, */
  unsigned long version;
  int64_t offset, shape[MAXD], stride[MAXD]; /* its view */
  int ndim;
} cg_prep_entry;

typedef struct cg_prep {
  cg_prep_entry *e;
  int n;
  int *of_kernel;           /* kernel -> its entry, or -1 */
  bool unbounded;           /* KILN_PREPARE=all: admitted past the memory bound */
  int64_t vals[IR_MAX_SYMS]; /* the symbol values admission was decided at (the room follows the sizes) */
  int nvals;
} cg_prep;

/* The candidates of p (forward f32 convs reading an argument the graph
 * never writes as their weight), CG_PREP_MAX at most. 0, or -1 out of memory. */
int prep_init(cg_prep *c, const cg_program *p);
void prep_free(cg_prep *c);
/* Whether admission was decided at these symbol values for these wanted
 * sizes (want[i]: entry i's conv_prepared_bytes at this call, 0 where it
 * prepares nothing). */
bool prep_decided(const cg_prep *c, const size_t *want, const int64_t *vals, int nvals);
/* Admits entries in kernel order while their bytes fit room (at these
 * symbol values); allocates the admitted, frees the others. */
void prep_admit(cg_prep *c, const size_t *want, const int64_t *vals, int nvals, size_t room);
size_t prep_bytes(const cg_prep *c);
/* Whether en holds w's values as they are now; prep_made records that it does. */
bool prep_fresh(const cg_prep_entry *en, const kiln_tensor *w);
void prep_made(cg_prep_entry *en, const kiln_tensor *w);
/* Weights prepared in this process so far (tests: kept ones are not made again). */
long prep_made_count(void);

/* ---- runtime.c: the LLVM backend ------------------------------------------------ */

extern const backend backend_llvm;
/* Whether lowering emits vector loops of its own: light kernels' loops
 * (own_vectors_ok) and the column panels (lower.c), unless
 * KILN_VECTORIZE=llvm leaves every kernel to LLVM's vectorizer. */
bool runtime_own_vectors(void);
/* How soon after a run's kernels end the next run counts as back to back
 * (20 us; INT64_MAX: every run, for tests); returns the old value. */
int64_t runtime_set_hot_gap(int64_t ns);
/* The bytes a chunk of a scan's streamed input projection takes (256 KiB;
 * small ones for tests, to cross chunk boundaries); returns the old value. */
size_t runtime_set_stream_bytes(size_t n);

#endif
