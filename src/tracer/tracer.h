/* Internal header of the tracer layer: the IR (graph, node, symbolic shapes),
 * symbolic shape rules, capture, passes, the text printer and parser, the
 * verifier, the interpreter backend and the compile front. Sectioned by file.
 * The tracer reads the eager op table and sets the dispatch hooks; it talks
 * to backends through the table in the backend section. */
#ifndef KILN_TRACER_H
#define KILN_TRACER_H

#include "eager/eager.h"
#include "eager/sym.h"

/* ---- ir.c: graphs ------------------------------------------------------ */

/* Node ops: every eager op_id, plus the leaves below. */
enum {
  IR_INPUT = OP_COUNT, /* an argument of the call: in[index] */
  IR_PARAM,            /* an implicit input (a tensor the function reached, a weight): params[index] */
  IR_GRAD,             /* the .grad of the param node in[0] when the call starts */
  IR_CONST,            /* data inside the graph (scalars, tensors made in the trace, frozen params) */
  IR_NUMEL,            /* 0-d: the product of in[0]'s sizes over attrs.axes (all when naxes is 0) plus attrs.start */
  IR_OP_COUNT
};

typedef struct ir_node {
  int op;                /* op_id or IR_INPUT.. IR_CONST */
  kiln_dtype dtype;
  int ndim;
  sym_dim shape[MAXD];
  int n_in;
  int *in;               /* node ids, all smaller than this node's (graph arena) */
  op_attrs attrs;
  int index;             /* IR_INPUT / IR_PARAM: position in the call's inputs / params */
  void *data;            /* IR_CONST: numel * dtype size bytes, row-major (graph arena) */
  const char *file;      /* the user's call that made it (interned in the graph); "" when unknown */
  int line;
} ir_node;

/* After a call, each write copies a value into an input or param (a functionalized
 * in-place update) or sets a param's .grad (value -1: .grad becomes NULL). */
typedef enum ir_write_kind { IR_WRITE_DATA, IR_WRITE_GRAD } ir_write_kind;
typedef struct ir_write {
  ir_write_kind kind;
  int target;            /* node id of an IR_INPUT or IR_PARAM node */
  int value;             /* node id, or -1 for IR_WRITE_GRAD to NULL */
  const char *file;
  int line;
} ir_write;

typedef struct ir_graph {
  char name[64];
  sym_ctx *sym;          /* symbols and expressions of this graph */
  int n_syms;            /* symbols s0 .. s(n_syms-1) are declared */
  int64_t sym_lo[64], sym_hi[64]; /* their bounds (IR_MAX_SYMS) */
  ir_node *nodes;        /* topological order; a node's id is its index */
  int n_nodes, cap_nodes;
  int n_inputs, n_params; /* counts of IR_INPUT / IR_PARAM nodes */
  int *outputs;
  int n_outputs;
  ir_write *writes;
  int n_writes;
  sym_guard *guards;     /* relations the symbols must satisfy */
  int n_guards;
  struct ir_arena *arena; /* everything the graph owns but nodes/outputs/writes/guards arrays */
  struct ir_intern *intern; /* (op, dtype, inputs, attrs) -> node id */
} ir_graph;

enum { IR_MAX_SYMS = 64, IR_MAX_IN = 1 << 16 };

ir_graph *ir_new(const char *name);          /* NULL when out of memory */
void ir_free(ir_graph *g);
void *ir_alloc(ir_graph *g, size_t n);       /* zeroed, freed with the graph */
const char *ir_str(ir_graph *g, const char *s); /* interned copy of s */

/* Declares symbol s<id> (id == g->n_syms) with bounds; 0 or -1. */
int ir_add_sym(ir_graph *g, int64_t lo, int64_t hi, sym_dim *out);

/* The tensor a leaf node (input, param, grad) stands for in a call (borrowed;
 * NULL for a grad that is not set). */
kiln_tensor *ir_leaf_tensor(const ir_graph *g, const ir_node *n, kiln_tensor *const *in, kiln_tensor *const *params);
/* The id of symbol d when d is exactly one declared symbol, else -1. */
int ir_sym_id(const ir_graph *g, sym_dim d);
/* A new tensor (owned by the caller) holding an IR_CONST node's data; NULL on OOM. */
kiln_tensor *ir_const_tensor(const ir_node *n);
/* The value of an IR_NUMEL node as a symbolic size (the error dim on overflow). */
sym_dim ir_numel_value(const ir_graph *g, const ir_node *n);

/* Appends a node, or returns the id of an equal one (same op, dtype, shape,
 * inputs, attrs, index and data): CSE by construction. file/line of the first
 * one are kept. -1 when out of memory. Inputs and params are never merged
 * (index differs); consts merge when their data are equal. */
int ir_add(ir_graph *g, const ir_node *n);
/* Like ir_add but never merges (parser: ids must be what the text says). */
int ir_append(ir_graph *g, const ir_node *n);
int ir_add_output(ir_graph *g, int node);
int ir_add_write(ir_graph *g, ir_write w);
int ir_add_guard(ir_graph *g, sym_guard gd); /* drops duplicates */

const char *ir_op_name(int op);             /* "add", "input", "const" ... */
int ir_op_parse(const char *name, size_t n); /* op for a name, -1 when unknown */
int64_t ir_node_numel_const(const ir_node *n); /* -1 when some dim is symbolic */
/* The concrete shape of n for symbol values vals; 0 or -1. */
int ir_node_shape(const ir_node *n, const int64_t *vals, int nvals, int64_t *shape);
/* The attribute fields (AF_* bits) of op: the table's, or a leaf's. */
unsigned ir_attr_fields(int op);
/* n's attrs with every dim evaluated at the symbol values vals; 0 or -1. */
int ir_attrs_eval(const ir_node *n, const int64_t *vals, int nvals, op_attrs *out);
/* Number of users of every node (outputs and writes count); caller frees with alloc_free. */
int *ir_use_counts(const ir_graph *g);
/* A fresh graph holding only the nodes with keep[i] (renumbered in order),
 * with outputs, writes, guards and symbols carried over. NULL on OOM. */
ir_graph *ir_compact(const ir_graph *g, const bool *keep);

/* ---- symshape.c: shape rules over symbolic dims -------------------------- */

/* What a rule may use when it has to decide about a symbol: the traced values
 * (vals == NULL: only what the bounds prove, else it fails) and where to
 * record the guards it needs (NULL: none recorded). */
typedef struct shape_env {
  ir_graph *g;
  const int64_t *vals;
  int nvals;
  bool record;           /* add the guards a decision needed to g */
  dim_env dims;          /* what the op table's shape rules see (symshape_infer sets it) */
} shape_env;

/* Decides a op b under env: 1 true, 0 false, -1 undecidable. Records the
 * guard (or its negation) when the answer came from vals. */
int shape_decide(shape_env *env, sym_dim a, sym_cmp op, sym_dim b);

/* Output dtype and symbolic shape of node n (op, in, attrs set) from its
 * inputs; 0, or -1 with why in err. */
int symshape_infer(shape_env *env, ir_node *n, char *err, size_t errn);

/* ---- trace.c: capture ------------------------------------------------------ */

typedef enum trace_dyn { TRACE_STATIC, TRACE_DYNAMIC } trace_dyn;

/* What a trace is told about its inputs: which dims get a symbol. */
typedef struct trace_spec {
  int n_in;
  uint8_t (*dynamic)[MAXD];  /* [n_in][MAXD]: 1 = symbolic */
  bool freeze;               /* implicit inputs become constants */
} trace_spec;

/* Autograd state of a leaf (input or param) when the call started: a
 * variant runs only where it is the same. */
typedef struct trace_leaf {
  bool requires_grad;
  bool grad_present;
} trace_leaf;

/* A finished trace: the graph and what a call needs to bind it. */
typedef struct trace_result {
  ir_graph *g;               /* NULL when the trace could not make a graph */
  kiln_tensor **params;      /* the implicit inputs, retained, g->n_params of them */
  trace_leaf *in_leaf;       /* n_in of them */
  trace_leaf *param_leaf;    /* g->n_params of them */
  int64_t vals[IR_MAX_SYMS]; /* the traced value of each symbol */
  char why[512];             /* when g is NULL: why ("examples/x.c:12: kiln_item reads data ...") */
  bool value_dependent;      /* the function read tensor data: it runs eagerly from now on */
} trace_result;

/* Runs body once eagerly (its outputs are real results) while recording it.
 * Returns the body's return value; res->g is the graph when one could be made. */
int trace_run(kiln_body body, void *ctx, kiln_tensor *const *in, int n_in, kiln_tensor **out, int n_out,
              const trace_spec *spec, const char *name, trace_result *res);
void trace_result_free(trace_result *res);

/* ---- passes.c -------------------------------------------------------------- */

/* Each pass rewrites g in place or returns a new graph (the old one freed);
 * NULL on out of memory (g is freed then too). */
ir_graph *pass_dce(ir_graph *g);      /* drop nodes no output or write reaches */
ir_graph *pass_cse(ir_graph *g);      /* merge equal nodes (after other rewrites) */
ir_graph *pass_fold(ir_graph *g);     /* evaluate nodes whose inputs are all constants (small results) */
ir_graph *pass_simplify(ir_graph *g); /* x*1, x+0, x-0, x/1, neg(neg x), transpose of transpose,
                                         reshape of reshape, identity views, cast to own type */
/* The pipeline: the passes in order, the verifier between them in test builds,
 * a dump after the pass named in dump_after (NULL: none). */
ir_graph *pass_pipeline(ir_graph *g, char *err, size_t errn);

/* ---- verify.c -------------------------------------------------------------- */

/* Definitions before uses, arity, leaf kinds, dtypes and ranks by the op's
 * rule, dims the rule proves; 0 or -1 with "%N: why" in err. */
int ir_verify(const ir_graph *g, char *err, size_t errn);
/* Every op node checked at the concrete sizes vals (a loaded graph's dims that
 * ir_verify could not decide). 0, or -1 with why in err. */
int ir_verify_at(ir_graph *g, const int64_t *vals, char *err, size_t errn);

/* ---- print.c / parse.c: the text form (docs/ir.md) --------------------------- */

/* Writes the graph's text to f; 0 or -1. */
int ir_print(const ir_graph *g, FILE *f);
/* The text as a malloc'ed string (alloc_free it); NULL on OOM. */
char *ir_to_string(const ir_graph *g);
/* Parses one graph; NULL with "line L, col C: why" in err. */
ir_graph *ir_parse(const char *text, char *err, size_t errn);

/* ---- interp.c: the interpreter backend --------------------------------------- */

/* Concrete values of the graph's symbols bound from the inputs' shapes and
 * checked against the guards and bounds; 0, or -1 with why in err. */
int ir_bind_syms(const ir_graph *g, kiln_tensor *const *in, kiln_tensor *const *params, int64_t *vals,
                 char *err, size_t errn);

/* ---- backend.c: the interface every backend implements ----------------------- */

typedef struct backend_exec backend_exec; /* a compiled graph, backend-specific */
typedef struct backend {
  const char *name;
  /* Compiles g (still owned by the caller, alive as long as the exec). NULL with err. */
  backend_exec *(*compile)(const ir_graph *g, unsigned dump, FILE *dump_to, char *err, size_t errn);
  /* Runs: out[i] are new tensors owned by the caller; writes applied. 0 or -1 (error set). */
  int (*run)(backend_exec *e, kiln_tensor *const *in, kiln_tensor *const *params, kiln_tensor **out);
  void (*free)(backend_exec *e);
  /* Check mode, optional: runs e without writing back and compares each of
   * its kernels' results with the interpreter's value of the same node;
   * writes the first that differs (kernel, nodes with file:line, max error)
   * into report. 0 when all agree, 1 when one differs, -1 on error. */
  int (*check)(backend_exec *e, kiln_tensor *const *in, kiln_tensor *const *params, char *report, size_t n);
  /* Optional: how long compile spent in its front (fusion, lowering), optimization and machine code. */
  void (*times)(const backend_exec *e, double *front_ms, double *opt_ms, double *machine_ms);
} backend;

extern const backend backend_interp;
extern const backend backend_llvm; /* src/codegen */
/* Runs node by node through the eager kernels (no autograd); out as in backend.run. */
int interp_run(const ir_graph *g, kiln_tensor *const *in, kiln_tensor *const *params, kiln_tensor **out);
/* Every node's value (all[i] retained, g->n_nodes of them), no writes. 0 or -1. */
int interp_values(const ir_graph *g, kiln_tensor *const *in, kiln_tensor *const *params, kiln_tensor **all);

#endif
