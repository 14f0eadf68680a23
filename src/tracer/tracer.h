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
  /* Control flow: a node that owns region graphs (sub[]) and makes a tuple of
   * results, read by IR_GET nodes only (docs/ir.md, Control flow). */
  IR_COND,             /* in = pred, operands...: sub[0] then, sub[1] else, each over the operands */
  IR_WHILE,            /* in = init[n_carry], captures...: sub[0] cond -> one bool, sub[1] body -> new carry */
  IR_SCAN,             /* in = init[n_carry], xs[n_xs], captures...: sub[0] body over (carry, xs[t], captures)
                          -> (new carry, y[t]...); results: last carry, ys stacked along a new dim 0 */
  IR_GET,              /* result attrs.k of the control-flow node in[0] */
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
  const char *name;      /* IR_PARAM (and a loaded graph's IR_INPUT): kiln_param_name's, or NULL */
  struct ir_graph *sub[2]; /* IR_COND, IR_WHILE, IR_SCAN: the regions (reference counted: copies share them) */
  int n_carry, n_xs;     /* IR_WHILE, IR_SCAN: how in[] splits (the rest are captures) */
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
  /* IR_WRITE_GRAD made only where its gradient exists (eagerly: where the
   * construct that reaches the leaf ran): where the dim `when` is not 0 (a
   * scan's trip count), or where the one-element bool node `cond` is true (a
   * cond's predicate, a flag that some step took a branch). Skipped, the
   * .grad stays as it was, or becomes NULL with else_none. */
  bool has_when, has_cond, else_none;
  sym_dim when;
  int cond;
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
  int refs;              /* a region: the nodes that hold it (0: a top-level graph, one owner) */
  bool region;           /* a region: its symbols are its parent's (sym borrowed), its leaves inputs only */
  bool leaves_share;     /* two of its inputs and params share storage in the calls it serves (not in the text) */
} ir_graph;

enum { IR_MAX_SYMS = 64, IR_MAX_IN = 1 << 16 };

ir_graph *ir_new(const char *name);          /* NULL when out of memory */
void ir_free(ir_graph *g);                   /* a region: drops one reference */
/* An empty graph with src's name that takes over src's symbols (a region's
 * copy shares them, as a region does); NULL on OOM, src untouched then. */
ir_graph *ir_new_like(ir_graph *src);
void *ir_alloc(ir_graph *g, size_t n);       /* zeroed, freed with the graph */
const char *ir_str(ir_graph *g, const char *s); /* interned copy of s */

/* Declares symbol s<id> (id == g->n_syms) with bounds; 0 or -1. */
int ir_add_sym(ir_graph *g, int64_t lo, int64_t hi, sym_dim *out);

/* The tensor a leaf node (input, param, grad) stands for in a call (borrowed;
 * NULL for a grad that is not set). */
kiln_tensor *ir_leaf_tensor(const ir_graph *g, const ir_node *n, kiln_tensor *const *in, kiln_tensor *const *params);
/* Whether t is memory of an input or param that a data write of g changes:
 * an output that is (a view of) a leaf holds the leaf's value when the call
 * began (x * 1 simplified to x), so it is handed out as a copy made before
 * the writes. */
bool ir_written_storage(const ir_graph *g, const kiln_tensor *t, kiln_tensor *const *in, kiln_tensor *const *params);
/* The outputs out[0..n) (owned) as they were before g's writes: each over
 * memory the writes change is replaced by a copy of itself, or, where
 * several outputs are over one storage, by a view of one copy of that
 * storage, so that they still view each other. -1 on out of memory (out[]
 * still owned, some replaced). */
int ir_outputs_before_writes(const ir_graph *g, kiln_tensor **out, int n, kiln_tensor *const *in, kiln_tensor *const *params);
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
/* A grad write whose `when` is 0 at these sizes, or whose `cond` (its value:
 * cond, NULL when it has none) is false: it is not made (see ir_write). */
bool ir_write_skipped(const ir_graph *g, const ir_write *w, const int64_t *vals, const kiln_tensor *cond);
/* The node ids a write reads (its value, its cond) into ids[0..2): how many. */
int ir_write_reads(const ir_write *w, int ids[2]);
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
/* src's outputs, writes and guards into dst, src's node i being dst's
 * map[i]; 0 or -1 (out of memory). */
int ir_copy_tail(ir_graph *dst, const ir_graph *src, const int *map);
/* A fresh graph holding only the nodes with keep[i] (renumbered in order),
 * with outputs, writes, guards and symbols carried over. NULL on OOM. */
ir_graph *ir_compact(const ir_graph *g, const bool *keep);

/* ---- region.c: control-flow nodes and their regions ----------------------- */

static inline bool ir_is_cf(int op) { return op == IR_COND || op == IR_WHILE || op == IR_SCAN; }
/* How many regions a control-flow op owns (0 for other ops). */
int ir_n_sub(int op);
/* The name of region i of op as the text writes it ("then", "else", "cond", "body"). */
const char *ir_sub_name(int op, int i);
/* A new empty region of parent (its symbols shared), held once. NULL on OOM. */
ir_graph *ir_region_new(ir_graph *parent, const char *name);
/* Another reference to a region. */
ir_graph *ir_region_hold(ir_graph *r);
/* Copies parent's symbol count and bounds into region r and the regions in it. */
void ir_region_sync(ir_graph *r, const ir_graph *parent);
/* How many results control-flow node n makes (its regions' outputs). */
int ir_cf_n_results(const ir_node *n);
/* The type of result k of control-flow node id, into out's dtype, ndim and
 * shape; 0 or -1 (k out of range, or a region missing). */
int ir_cf_result_type(const ir_graph *g, int id, int k, ir_node *out);
/* The type region i of node id takes as argument j (as ir_cf_result_type). */
int ir_cf_arg_type(const ir_graph *g, int id, int i, int j, ir_node *out);
/* How many arguments region i of node id takes. */
int ir_cf_n_args(const ir_graph *g, int id, int i);

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

/* ---- record.c: a call's body run as a recording ---------------------------- */

/* While a recording runs, every op the body calls makes a meta tensor (a
 * shape and a dtype, no data, no kernel run) and appends an event to the
 * call's log; factories, in-place writes and counts do the same. Values are
 * numbered in the order they appear: the call's inputs first, then params,
 * .grads and results as the body reaches them. The log is what a variant is
 * matched against and what the build_state (build.c) turns into a graph. */

typedef enum rec_vkind {
  RV_INPUT,  /* the call's in[index] */
  RV_PARAM,  /* a tensor made before the call (a weight): the recording's params[index] */
  RV_GRAD,   /* the .grad, when the segment started, of the leaf value `index` */
  RV_CARRY,  /* a value of an earlier segment, computed at a break: value `index` */
  RV_MADE    /* made by event `event` */
} rec_vkind;

typedef struct rec_value {
  rec_vkind kind;
  kiln_dtype dtype;
  int ndim;
  int64_t shape[MAXD];
  int index;
  int event;
  int seg;           /* the segment whose value it is */
  unsigned long version; /* its storage's version when the value was made: a view older than a write is stale */
} rec_value;

typedef enum rec_ekind {
  EV_OP,      /* op over in[] with attrs a */
  EV_INPLACE, /* in[0] op= in[1] (OP_ADD, OP_SUB, OP_MUL, OP_COPY), or in[0] filled with a.value (op OP_COUNT) */
  EV_FULL,    /* a.value over the shape a.shape[0..a.ndim), dtype a.dtype */
  EV_DATA,    /* bytes of a tensor made from C data (tensor_from, arange) */
  EV_RAND,    /* numbers of the counter-based generator: seed a.k, normal when a.flag */
  EV_NUMEL,   /* 0-d count of in[0]'s elements over a.axes (all when none) plus a.start */
  EV_BREAK,   /* a data read: the events before it ran as a segment, and the live values have data */
  EV_ESCAPE,  /* something a graph cannot hold: the events before it ran, and the rest of the body ran eagerly */
  /* control flow recorded as regions: EV_CF (op IR_COND/IR_WHILE/IR_SCAN,
   * in = its operands, a.k carries, a.dim xs), then per region its EV_ARGs
   * (a.dim the region, a.k the argument), its body's events and an EV_YIELD
   * of its results (in); after the last region an EV_GET per result (a.k) */
  EV_CF,
  EV_ARG,
  EV_YIELD,
  EV_GET,
  EV_DEAD     /* a region recorded and then run as eager code instead (its values unused) */
} rec_ekind;

typedef struct rec_event {
  rec_ekind kind;
  int op;
  int n_in, in;      /* input value ids: ids[in .. in + n_in) */
  int out;           /* the value it makes (EV_INPLACE: the written tensor's new value); -1 for a break */
  op_attrs *a;       /* its attributes: the recording's (compile.c: the variant's), or rec_no_attrs */
  bool user;         /* the numbers in a came from user code, not from kiln's formulas */
  int src;           /* a reshape, expand or fill: the value whose shape it was given (an autograd
                        formula's input, ag_shape_begin), or -1 */
  const void *data;  /* EV_DATA: the bytes, owned by the recording */
  const char *file;
  int line;
} rec_event;

typedef struct recording recording;

/* Breaks a call may take: past them the rest of the body runs eagerly (an
 * escape), within the segments a call holds (64, with the escape's and the
 * last). */
enum { REC_MAX_BREAKS = 62 };

/* Called at a data read of a value that has none yet (and once at the end):
 * run the events since the last break, give the live values their data.
 * 0, or -1 with the error set (the read then fails). */
typedef int (*rec_run_fn)(recording *r, void *ctx, bool last);

struct recording {
  uint64_t id;             /* unique for the process: tags the tensors it makes */
  uint64_t alias_id;       /* a replay's that handed over to it: its tags name this recording's values
                              (the same log so far, numbered alike), as autograd's saved tags do; or 0 */
  kiln_tensor *const *in;
  int n_in;
  rec_event *ev;           /* the log */
  int n_ev, cap_ev;
  int *ids;
  int n_ids, cap_ids;
  rec_value *val;
  int n_val, cap_val;
  kiln_tensor **params;    /* retained */
  int n_params, cap_params;
  uint64_t in_had_grad;    /* bit i: input i had a .grad when the call began */
  struct rec_param_seen {
    bool had_grad;         /* it had a .grad when the call first reached it */
  } *param_seen;           /* per param */
  int cap_seen;
  uint32_t in_refs[64];    /* input i's references when the call began */
  int seg, seg_start;      /* the current segment and its first event */
  struct { int value, dim; } *reads; /* the sizes the body read (kiln_size), this segment */
  int n_reads, cap_reads;
  /* what the body did that C could branch on or that changes between calls */
  bool read_meta;          /* sizes, ranks, dtypes: kiln_size and its kind */
  bool c_numbers;          /* numbers from user code: factories, sizes and values in attributes */
  bool read_data;          /* kiln_item, kiln_read, kiln_print */
  uint64_t layout_in;      /* inputs (< 64) whose layout chose a view or a copy (a reshape, kiln_contiguous) */
  char why[512];           /* the first thing it could not record, or the error that failed it */
  bool failed;             /* an error (out of memory): the call fails */
  bool why_is_error;       /* why is a whole error message (a segment's run failed) */
  const char *reader;      /* the call that read data at the newest break ("kiln_item") */
  bool escaped;            /* the rest of the body ran eagerly after an EV_ESCAPE */
  int cf_depth;            /* regions being recorded around the current op */
  int scan_save;           /* kiln_options.scan_save (cfgrad.c) */
  bool cf_unfit;           /* a region body did what a region cannot hold (a data read, an in-place
                              write): the construct runs step by step instead */
  struct { int input, dim; } scan_dims[8]; /* inputs' dims a scan steps over: symbolic from the first trace */
  int n_scan_dims;
  int n_breaks;            /* EV_BREAKs so far (REC_MAX_BREAKS, then an escape) */
  int shape_src;           /* the value the next shape given is of (on_shape_src), or -1 */
  rec_run_fn run;
  void *run_ctx;
  struct rec_state *st;    /* the maps and lists behind the log (record.c) */
};

/* Starts recording on this thread: in[0..n_in) are the call's inputs.
 * run is called at breaks. spare: an earlier recording's buffers (rec_keep)
 * or NULL; the recording owns it from here, even when it fails. 0 or -1
 * (out of memory). */
int rec_begin(recording *r, kiln_tensor *const *in, int n_in, rec_run_fn run, void *run_ctx, struct rec_state *spare);
/* Stops the hooks (the log stays readable until rec_free). */
void rec_end(recording *r);
void rec_free(recording *r);
/* Like rec_free, but hands back the recording's buffers, emptied, for the
 * next rec_begin (a function's calls reuse them instead of allocating and
 * freeing a dozen lists each); NULL when it had none. */
struct rec_state *rec_keep(recording *r);
void rec_spare_free(struct rec_state *s);
/* The op hook and the size read hook, for a replay handing over (replay.c):
 * user says the op's numbers came from user code. */
void rec_op(recording *r, op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out, const char *file,
            int line, bool user);
void rec_size_read(recording *r, const kiln_tensor *t, int dim);
void rec_numel(recording *r, kiln_tensor *out, const kiln_tensor *x, const int *axes, int naxes, int64_t offset,
               const char *file, int line, bool user);
/* For a hand-over: leaf t's .grad had refs references (the recording's own
 * counted) when the body first reached t, which is when a recording takes
 * its .grad; the body may have taken more since. */
void rec_set_grad0_refs(recording *r, const kiln_tensor *t, uint32_t refs);
/* The in-place hook, called before dst's version is bumped (as inplace() does). */
void rec_inplace(recording *r, op_id op, kiln_tensor *dst, kiln_tensor *src, double value, const char *file, int line,
                 bool user);
/* The factory hook, for a tensor t (dtype and shape) made already. */
void rec_factory(recording *r, kiln_tensor *t, int kind, double value, uint64_t seed, bool flag, const void *data,
                 const char *file, int line, bool user);
/* by_value[0..n_val): the tensor the recording made for each value, or
 * NULL; -1 when two tensors have one value (an in-place write's). */
int rec_made_tensors(const recording *r, kiln_tensor **by_value);
/* The value id tensor t has in the recording, adding it as a leaf when new; -1 on failure. */
int rec_value_of(recording *r, kiln_tensor *t);
/* replay.c: a call on the recording path that follows the script an earlier
 * call left beside the variant it ran (see the file's comment). */
typedef struct rp_script rp_script;
typedef struct slot_rule slot_rule;
typedef struct rp_call {
  rp_script *s;
  recording *r;            /* the call's recording, which takes over if the body parts from the script */
  int at;                  /* the script's events the body did so far */
  bool on;                 /* replaying still */
  kiln_tensor *const *in;  /* the call's inputs */
  int src;                 /* the value the last shape source named (-1 none, -2 none of this call) */
  uint64_t serial0;        /* tensors made in the call have serials from here */
  double argf[IR_MAX_SYMS];/* the variant's float arguments at this call */
  trace_hooks hooks;
  const trace_hooks *saved;/* the recording's */
} rp_call;
/* The script of a finished call that ran one segment of a variant with
 * those slot rules, arguments and leaf writes, or NULL when its log holds
 * what a replay cannot check (the call is recorded as ever). */
struct build_write;
rp_script *rp_make(const recording *r, kiln_tensor *const *out, int n_out, const slot_rule *rules, const int *rule_at,
                   const int64_t *argi, const double *argf, int n_args, const struct build_write *writes, int n_writes);
void rp_free(rp_script *s);
bool rp_broken(const rp_script *s); /* a replay handed over: it has no tensors left */
bool rp_fits(const rp_script *s, kiln_tensor *const *in, int n_in);
/* Replays s on recording r (begun, not yet run): installs the replay hooks. */
void rp_begin(rp_call *p, rp_script *s, recording *r, kiln_tensor *const *in);
/* After the body (rc its return): whether it did the script's events and
 * returned its outputs; else the recording has taken over. */
bool rp_finished(rp_call *p, int rc, kiln_tensor *const *out, int n_out);
/* After the body's scope ended: whether the body kept none of the script's
 * tensors; else the recording has taken over. */
bool rp_nothing_kept(rp_call *p);
void rp_end(rp_call *p);
/* The .grads the variant sets back to the call's start (its run sets them,
 * or, should it fail, leaves them so, as a recorded call's does); the
 * tensor each was at the body's end is kept for rp_grad_seen. */
void rp_restore_grads(rp_call *p);
/* That tensor of param i (a reference of the caller's now), or NULL. */
kiln_tensor *rp_grad_seen(rp_call *p, int i);
const int64_t *rp_argi(const rp_call *p);
int rp_n_params(const rp_call *p);
kiln_tensor *rp_take_param(rp_call *p, int i);  /* the same, with the reference the replay holds */

/* cfgrad.c: reverse mode through a construct recorded as one region. From
 * the events of construct c (its EV_CF at first, its bodies logged): the
 * bodies as replayable programs, or NULL when they cannot be (a nested
 * construct, a draw) or out of memory. */
typedef struct cfg_grad cfg_grad;
cfg_grad *cfg_new(recording *r, const cf_call *c, int first);
void cfg_discard(cfg_grad *g);
/* A scan's per-step values its forward yields after the saved carries (the
 * matmuls kiln_options.scan_save keeps): how many, their value ids in *ids. */
int cfg_kept(const cfg_grad *g, const int **ids);
/* Gives results[0..c->n_results) the construct's autograd node, which owns
 * g from now on; saved: scan's stacked carries. 0 or -1. */
int cfg_attach(cfg_grad *g, kiln_tensor *const *results, kiln_tensor *const *saved);
/* The tensor whose value in this segment is value (made, a leaf, a .grad), or NULL. */
kiln_tensor *rec_tensor_of(recording *r, int value);
/* The live values whose data a segment must produce, in a stable order:
 * every storage a tensor of the call still holds (skip[0..n_skip) aside:
 * the body's outputs, which the caller gives data of their own), by its
 * current value. Fills an array (alloc_free it). */
typedef struct rec_live {
  int value;               /* the value that holds the storage's data */
  storage *st;             /* the meta storage to fill, or NULL for a written leaf */
  int leaf;                /* a written leaf's value (RV_INPUT/RV_PARAM), else -1 */
} rec_live;
int rec_live_values(recording *r, kiln_tensor *const *skip, int n_skip, rec_live **out, int *n);
/* Whether something took a reference to a .grad a leaf had when the call
 * reached it (the body kept it), after the call's writes. */
bool rec_grads_kept(const recording *r);
/* How many references the recording itself holds to t (made by it, or carried). */
int rec_holds(const recording *r, const kiln_tensor *t);
/* Whether the body keeps (beyond the call and any scope) a view it made of
 * memory with data, an input's or a param's, other than an output. */
bool rec_views_kept(const recording *r, kiln_tensor *const *out, int n_out);
/* The leaves the segment reached: an input, param or carried value, its value
 * when the segment began and now, its .grad then and now (value ids; -1 for
 * NULL or not reached). */
typedef struct rec_leaf {
  kiln_tensor *t;
  int base, now;
  kiln_tensor *grad0;      /* .grad when the segment began */
  kiln_tensor *grad;       /* .grad now */
  int grad_read;           /* the RV_GRAD value when the segment read .grad, else -1 */
} rec_leaf;
int rec_leaves(recording *r, rec_leaf **out, int *n);
/* Stops and restarts the hooks around a segment's run. */
void rec_pause(recording *r);
void rec_resume(recording *r);
/* After a segment ran: its meta storages got their data; the next segment
 * starts (leaves written are now their data again, values made so far are
 * carried). */
void rec_next_segment(recording *r);
/* Drops the autograd history of every tensor the call made that is still
 * alive (a compiled call's results carry none). */
void rec_strip_history(recording *r);
/* Each leaf's .grad at the start of the current segment: restores them
 * (the segment's run writes the new ones). */
void rec_restore_grads(recording *r);
/* The leaf's .grad when the segment started, and whether it was read. */
kiln_tensor *rec_grad0(recording *r, int leaf_value);

/* The numbers of event e that user code could change between calls (its
 * slots), in a fixed order: sizes as integers, values as doubles. */
typedef struct rec_slot {
  bool is_float;
  int64_t i;
  double f;
} rec_slot;
int rec_slots(const rec_event *e, rec_slot *out, int max);
/* Whether attributes a and b of op are the same but for its slots. */
bool rec_same_attrs(int op, const op_attrs *a, const op_attrs *b);
/* The bytes an EV_DATA event holds (numel of its shape times its dtype's size). */
static inline size_t rec_ev_bytes(const rec_event *e) {
  int64_t n = 1;
  for (int i = 0; i < e->a->ndim; i++) n *= e->a->shape[i].c;
  return (size_t)n * kiln_dtype_size(e->a->dtype);
}
/* Whether e may have slots: most ops (add, matmul, relu) carry no numbers. */
static inline bool rec_has_slots(const rec_event *e) {
  return e->kind != EV_OP ||
         (op_table[e->op].attrs & (AF_SHAPE | AF_START | AF_END | AF_VALUE | AF_VALUE2 | AF_K | AF_INTS | AF_RNG));
}
/* The attributes of every event that has none of its own (an add, a matmul,
 * a break): all zero, never written. Events keep a pointer, so that a log of
 * thousands of ops is not megabytes of mostly empty op_attrs. */
extern op_attrs rec_no_attrs;

/* ---- build.c: a graph from a recording's events ----------------------------- */

/* How a later call's number at a slot is held to the variant. */
typedef enum slot_kind {
  SLOT_CONST, /* it must equal v */
  SLOT_EXPR,  /* it must equal the size e (in the variant's rule context) at the call's symbols */
  SLOT_ARG    /* it is argument arg of the call: a symbol's value, or a scalar input */
} slot_kind;
typedef struct slot_rule {
  slot_kind kind;
  rec_slot v;
  sym_dim e;
  int arg;
} slot_rule;

/* A number a variant takes on every call: a size (binding symbol sym) or a value (a 0-d input of dtype). */
typedef struct build_arg {
  bool is_float;
  int sym;
  kiln_dtype dtype;
  /* a tensor made from C data (kiln_tensor_from) whose values change
   * between calls: passed at run time, of this dtype and shape */
  bool is_data;
  int ndim;
  int64_t shape[MAXD];
} build_arg;

/* A symbol of a variant: bound from an input's dim, or from an argument. */
typedef struct build_sym {
  int input, dim;  /* input -1: an argument's */
  int arg;
  int64_t lo, hi;
} build_sym;

/* An earlier call of the same body, to tell a literal from a size. */
typedef struct build_prev {
  const rec_event *ev;
  int n_ev;
  int aligned;     /* events before this one have the same structure as the new call's */
  int n_in;
  const int *in_ndim;
  const int64_t (*in_shape)[MAXD];
  const slot_rule *rules;  /* its slots' rules, rule_at[ev] the first of event ev's */
  const int *rule_at;
} build_prev;

/* What one segment's graph takes and gives, beyond the call's inputs. */
typedef struct build_seg {
  ir_graph *g;               /* before the passes */
  /* inputs after the call's, in order: a value of an earlier segment (its id),
   * or an argument a (as -1 - a) */
  int *extra, *extra_node, n_extra, cap_extra, cap_extra_node;
  int *params, n_params, cap_params; /* the recording's params, in the graph's order */
  int *out, n_out, cap_out;         /* the values it hands out, in output order */
  bool frozen;                      /* a param's data is a constant of it */
} build_seg;

typedef struct build_size {
  int64_t v;
  sym_dim d;
  bool used, ambiguous;
} build_size;

/* A control-flow construct being built: its regions' arguments (placeholder
 * nodes of the segment's graph) and results, until its last region ends and
 * cf_extract moves each region's nodes into a region graph. */
typedef struct build_cf {
  int op, n_carry, n_xs;
  int *in, n_in;             /* its operands' nodes */
  int first;                 /* nodes from here on may be its regions' */
  int *ph[2], n_args;        /* each region's argument placeholders */
  int *res[2], n_res[2];     /* each region's results */
  const char *file;
  int line;
} build_cf;

enum { BUILD_MAX_CF = 16 };

typedef struct build_state {
  recording *r;
  const char *at_file;     /* the event being built: where a param it reads is first used */
  int at_line;
  const uint8_t (*dynamic)[MAXD];
  bool freeze;
  const build_prev *prev;
  int aligned;
  char name[64];
  int n_in;
  /* the variant's symbols, arguments and slot rules, across its segments */
  build_sym sym[IR_MAX_SYMS];
  int n_syms;
  int64_t vals[IR_MAX_SYMS], prev_vals[IR_MAX_SYMS];
  bool has_prev[IR_MAX_SYMS];
  build_arg *args;
  int n_args, cap_args;
  slot_rule *rules;
  int n_rules, cap_rules;
  int *rule_at;              /* per event: its first rule */
  int cap_rule_at;
  sym_ctx *rsym;
  char **shape_text;         /* per value handed out: its symbolic shape, for later segments */
  int n_text, cap_text;
  /* the segment being built */
  ir_graph *g;
  int *node, *input_node;
  build_seg *seg;
  build_size *sizes;
  size_t sizes_cap;
  build_cf cf[BUILD_MAX_CF]; /* control flow open around the event being built */
  int n_cf;
  int cf_node;               /* the construct the next EV_GETs read */
  int n_placeholders;
  bool has_cf;
  bool failed;
  char why[512];
  /* the draws later draws of many follow, a uniform one and a normal one:
   * their seed and offset symbols and values (build.c) */
  bool rng_base[2];
  sym_dim rng_sym[2][2];
  int64_t rng_v[2][2];
} build_state;

/* A leaf a segment writes back: its data (now != base), its .grad (grad set:
 * to value grad, or to NULL when grad is -1). */
typedef struct build_write {
  int base, now;
  bool grad_set;
  int grad;
  int when;       /* the value the grad's existence hangs on (grad_if), or -1 */
  bool when_bool; /* when is a one-element bool that must be true, not a dim 0 that must not be 0 */
  bool else_none; /* where it does not hold, .grad becomes NULL (it was dropped in the call) */
} build_write;

int build_begin(build_state *b, recording *r, const uint8_t (*dynamic)[MAXD], bool freeze, const build_prev *prev);
/* The graph of events [from, to), handing out the values out[0..n_out) in
 * order and writing back the leaves of writes. 0, or -1 with b->why. */
int build_segment(build_state *b, int from, int to, const int *out, int n_out, const build_write *writes, int n_writes,
                  build_seg *seg);
void build_seg_free(build_seg *s);
void build_free(build_state *b);

/* ---- passes.c -------------------------------------------------------------- */

/* Each pass rewrites g in place or returns a new graph (the old one freed);
 * NULL on out of memory (g is freed then too). */
ir_graph *pass_dce(ir_graph *g);      /* drop nodes no output or write reaches */
ir_graph *pass_cse(ir_graph *g);      /* merge equal nodes (after other rewrites) */
ir_graph *pass_schedule(ir_graph *g); /* allreduces just after their inputs, to overlap what follows */
ir_graph *pass_fold(ir_graph *g);     /* evaluate nodes whose inputs are all constants (small results) */
ir_graph *pass_accumulate(ir_graph *g); /* x + index_add(zeros, dim, idx, src): index_add_to(x, dim, idx, src) */
ir_graph *pass_sums(ir_graph *g);     /* a scan carry that only accumulates carry + z(step) is summed after the loop */
ir_graph *pass_hoist(ir_graph *g);    /* work in a scan's or while's regions that reads only captures moves out */
ir_graph *pass_simplify(ir_graph *g); /* x*1, x+0, x-0, x/1, neg(neg x), transpose of transpose,
                                         reshape of reshape, identity views, cast to own type */
/* The pipeline: the passes in order, the verifier between them in test builds,
 * a dump after the pass named in dump_after (NULL: none). */
ir_graph *pass_pipeline(ir_graph *g, char *err, size_t errn);

/* ---- fuse_attention.c: the attention pass (the LLVM backend's) ---------- */

/* Each softmax(scale * q @ k^T [masked]) @ v spelled out in primitives, with
 * nothing else reading its intermediates, made one attention node. Returns
 * how many; when > 0, *out is a new graph that borrows g's symbols (free it
 * with pass_attention_free, before g). -1 on out of memory. */
int pass_attention(const ir_graph *g, ir_graph **out);
void pass_attention_free(ir_graph *g);

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
 * checked against the guards and bounds; 0, or -1 with why in err. leaves:
 * the ids of g's IR_INPUT and IR_PARAM nodes (ir_leaf_ids), or NULL to find
 * them among all the nodes. */
int ir_bind_syms(const ir_graph *g, const int *leaves, int n_leaves, kiln_tensor *const *in,
                 kiln_tensor *const *params, int64_t *vals, char *err, size_t errn);

/* The symbols' values: bound (a region's, its parent's: IR_MAX_SYMS of
 * them) when set, else bound from the inputs (leaves as for ir_bind_syms).
 * 0, or -1 with the error set. */
int ir_bind_or(const ir_graph *g, const int *leaves, int n_leaves, kiln_tensor *const *in,
               kiln_tensor *const *params, const int64_t *bound, int64_t *vals);

/* The ids of g's IR_INPUT and IR_PARAM nodes in order, in a new array
 * (alloc_free it) of *n; NULL when out of memory. */
int *ir_leaf_ids(const ir_graph *g, int *n);

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
  /* Runs a region's exec with its parent's symbol values vals (a region's
   * arguments need not bind them); out as in run. 0 or -1. */
  int (*run_bound)(backend_exec *e, kiln_tensor *const *in, const int64_t *vals, kiln_tensor **out);
  /* Check mode of a region's exec at vals (as check). */
  int (*check_bound)(backend_exec *e, kiln_tensor *const *in, const int64_t *vals, char *report, size_t n);
  /* Optional: run_bound writing output i into into[i] (contiguous, of its
   * dtype and shape, aliasing no input), allocating no output: a loop's
   * step writes the next carry and its ys' rows in place. 0 or -1. */
  int (*run_into)(backend_exec *e, kiln_tensor *const *in, const int64_t *vals, kiln_tensor *const *into);
} backend;

/* The compiled regions of a graph: sub[i][k] runs node i's region k on be. */
typedef struct region_execs {
  const backend *be;
  backend_exec *(*sub)[2];
  int n;
  struct interp_cache *cache; /* the graph's values kept between its runs as a region (interp.c) */
} region_execs;
/* The values a graph run as a region (once per step of a loop around it)
 * keeps for its next run, so that a step makes no storage; NULL when out of memory. */
struct interp_cache *interp_cache_new(const ir_graph *g);
void interp_cache_free(struct interp_cache *c);
/* c for this run alone, or NULL when another run holds it (or c is NULL);
 * interp_cache_give hands it back. */
struct interp_cache *interp_cache_take(struct interp_cache *c);
void interp_cache_give(struct interp_cache *c);
/* A scan's xs operand j made k steps at a time: x[j] holds steps
 * [t, t + k) of it at rows 0 .. k-1 after fill(ctx, t, n) made n of them
 * (n < k at the end); the scan calls fill before step t whenever t % k is
 * 0. The runtime's way to batch a loop's input projection by chunks. */
typedef struct cf_stream {
  int j;
  int64_t k;
  int (*fill)(void *ctx, int64_t t, int64_t n);
  void *ctx;
} cf_stream;
/* Runs control-flow node id of g over its operands x[0..n_in) at the
 * symbol values vals, its regions on rx's execs (NULL: interpreted) and
 * its loop buffers kept in cache (NULL: none kept); *res (alloc_calloc'ed)
 * gets its ir_cf_n_results results, references of the caller's, which may
 * be operands or views of them, or share a storage, unless own_results
 * (then such a result is a copy). st: a streamed xs operand, or NULL.
 * 0, or -1 with the error set. */
int interp_cf_run(const ir_graph *g, int id, kiln_tensor *const *x, const int64_t *vals, const region_execs *rx,
                  struct interp_cache *cache, const cf_stream *st, bool own_results, kiln_tensor ***res);
/* Compiles every region of g with be (a region with regions of its own is
 * be's business); 0, or -1 with err naming the region. */
int region_execs_compile(const ir_graph *g, const backend *be, unsigned dump, FILE *dump_to, region_execs *rx,
                         char *err, size_t errn);
void region_execs_free(region_execs *rx);
/* interp_run for a graph whose regions run through rx (NULL: the
 * interpreter), with the symbols' values bound (a region's) or, when
 * bound is NULL, bound from the inputs. */
int interp_run_with(const ir_graph *g, kiln_tensor *const *in, kiln_tensor *const *params, const int64_t *bound,
                    const region_execs *rx, kiln_tensor **out);
/* interp_run_with at bound, its outputs copied into into[i] (backend.run_into's contract). */
int interp_run_into(const ir_graph *g, kiln_tensor *const *in, const int64_t *bound, const region_execs *rx,
                    kiln_tensor *const *into);
/* Check mode through rx: each construct's first step (the branch taken,
 * a while's cond and first body, a scan's step 0) checked by its region's
 * exec; 0 all agree, 1 one differs (report names the region), -1 error. */
int region_execs_check(const ir_graph *g, kiln_tensor *const *in, kiln_tensor *const *params, const int64_t *bound,
                       const region_execs *rx, char *report, size_t n);

/* The graph text's format version: kiln_save writes `version N` first;
 * the parser reads texts without it (the format before versions) and with
 * N up to this, and says a newer N needs a newer kiln. */
#define IR_TEXT_VERSION 1

/* Ahead-of-time export (src/codegen/export.c, LLVM only): g as <prefix>.o
 * and <prefix>.h for libkiln_rt. 0, or -1 with why in err. */
typedef struct export_request {
  const char *name;               /* C identifier prefix of the entry points */
  const char *prefix;             /* path prefix of the two files */
  const char *target, *cpu;       /* LLVM triple and CPU; NULL: the host, a generic CPU */
  int variant;                    /* its number, for the header */
  bool params_as_inputs;          /* else the params' values are embedded */
  kiln_tensor *const *params;     /* the variant's */
} export_request;
int export_graph(const ir_graph *g, const export_request *rq, char *err, size_t errn);

extern const backend backend_interp;
extern const backend backend_llvm; /* src/codegen */
/* Runs node by node through the eager kernels (no autograd); out as in backend.run. */
int interp_run(const ir_graph *g, kiln_tensor *const *in, kiln_tensor *const *params, kiln_tensor **out);
/* Every node's value (all[i] retained, g->n_nodes of them), no writes. 0 or -1. */
int interp_values(const ir_graph *g, kiln_tensor *const *in, kiln_tensor *const *params, kiln_tensor **all);
/* The same for a region, at its parent's symbol values. */
int interp_values_bound(const ir_graph *g, kiln_tensor *const *in, const int64_t *vals, kiln_tensor **all);

#endif
