/* Lowering: each loop kernel becomes one LLVM function
 *
 *   void kN(const int64_t *p, char *const *bufs, int64_t begin, int64_t end)
 *
 * p holds the kernel's symbolic sizes, offsets and strides evaluated for this
 * call (the kernel lists which, in k->param); a size or stride that is a
 * constant in the graph is emitted as a constant, so unit-stride inner loops
 * vectorize. bufs are the base addresses of the kernel's accesses, in the
 * order of k->acc (then the scratch of a split reduction): nothing in the
 * code names a program buffer, so kernels of one shape share their code.
 * Pointwise kernels run the flat element range [begin, end) as rows of the
 * last dim; staged kernels (row-wise, reductions) run the outer range, and
 * for each outer element their stages in order: REDUCE loops that leave a
 * scalar, then the MAP that stores; reductions over the leading dims run
 * the same stages over blocks of outer elements instead (lower_column).
 * f32 sums accumulate in f32 over short known rows, else in f64
 * (short_rows). The loops are scalar, for LLVM's vectorizer; a light
 * kernel's innermost ones are vectors already (own_vectors_ok). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <llvm-c/Core.h>
#include <llvm-c/DebugInfo.h>

#include "codegen/codegen.h"

typedef struct lctx {
  LLVMContextRef c;
  LLVMModuleRef m;
  LLVMBuilderRef b;
  LLVMValueRef fn;
  LLVMBuilderRef eb;       /* positioned in the entry block: parameter loads and allocas */
  LLVMValueRef pval[256];  /* loaded parameters, by index */
  LLVMTypeRef i64, i8, f32, f64, ptr;
  cg_kernel *k;
  const cg_program *prog;
  LLVMValueRef p, bufs;
  LLVMValueRef base[64];   /* per access: element offset of the current outer point */
  LLVMValueRef ptrs[64];   /* per access: its buffer's base address */
  LLVMValueRef accv[16];   /* per stage: the REDUCE result */
  LLVMValueRef *memo;      /* per expr: value in the current loop body */
  int reuse_expr, reuse_acc; /* a reduced expression kept in the output for the MAP, or -1 */
  LLVMValueRef first_lo, first_hi; /* a split reduction: the bounds of dim 0 for this block */
  int inner_interleave;            /* the innermost reduced loop's interleave count, 0: LLVM's choice */
  LLVMValueRef scope[64], noalias[64]; /* per access: alias scope metadata of its buffer, and of the others */
  unsigned scope_kind, noalias_kind, loop_kind;
  const char *failed;      /* why lowering gave up (the module is then discarded) */
  int cap_param;
  /* own vectors (own_vectors_ok): lanes a vector has, lanes the values
   * being emitted have (0: scalars), and which of a pass's vectors (copy) */
  int lanes, vw, vcopy;
  int vdim;   /* the dim the lanes run along: the last, or a column kernel's fastest outer one */
  int copies; /* vectors a pass of the next vector loop takes */
  LLVMValueRef mask; /* in a masked tail: the lanes before the end */
} lctx;

static LLVMValueRef ci64(lctx *L, int64_t v) { return LLVMConstInt(L->i64, (unsigned long long)v, 1); }

static bool const_is(sym_dim d, int64_t v) { return sym_is_const(d) && d.c == v; }

static LLVMValueRef sym_val(lctx *L, sym_dim d);

/* Access a's offset from the pointer the runtime passes (cg_pointer_shift). */
static LLVMValueRef access_offset(lctx *L, int a) {
  sym_dim o = L->k->acc[a].offset;
  int64_t shift = cg_pointer_shift(L->k, a);
  if (sym_is_const(o)) return ci64(L, o.c - shift);
  LLVMValueRef v = sym_val(L, o);
  return shift ? LLVMBuildSub(L->b, v, ci64(L, shift), "") : v;
}

/* A symbolic value: a constant, or p[k] with k registered in the kernel. */
static LLVMValueRef sym_val(lctx *L, sym_dim d) {
  if (sym_is_const(d)) return ci64(L, d.c);
  cg_kernel *k = L->k;
  int idx = -1;
  for (int i = 0; i < k->n_param; i++)
    if (sym_same(k->param[i], d)) idx = i;
  if (idx < 0) {
    if (k->n_param == L->cap_param) {
      int cap = L->cap_param ? L->cap_param * 2 : 16;
      sym_dim *np = alloc_realloc(k->param, sizeof *np * (size_t)cap);
      if (!np) {
        L->failed = "out of memory";
        return ci64(L, 0);
      }
      k->param = np;
      L->cap_param = cap;
    }
    idx = k->n_param++;
    k->param[idx] = d;
  }
  if (idx >= 256) {
    L->failed = "more than 256 symbolic sizes";
    return ci64(L, 0);
  }
  if (!L->pval[idx]) {
    /* in the entry block, so loops see it as invariant */
    LLVMValueRef gep = LLVMBuildGEP2(L->eb, L->i64, L->p, (LLVMValueRef[]){ci64(L, idx)}, 1, "");
    L->pval[idx] = LLVMBuildLoad2(L->eb, L->i64, gep, "");
  }
  return L->pval[idx];
}

/* The type dt is computed in: f16 and bf16 as f32, i32 as i64. */
static LLVMTypeRef elem_type(lctx *L, kiln_dtype dt) {
  switch (dtype_wide(dt)) {
  case KILN_F32: return L->f32;
  case KILN_F64: return L->f64;
  case KILN_I64: return L->i64;
  case KILN_BOOL: return L->i8;
  default: break;
  }
  return L->f32;
}

static bool is_float(kiln_dtype dt) { return dtype_is_float(dt); }

/* The type dt is stored in: i16 for f16 and bf16, i32 for i32. */
static LLVMTypeRef mem_type(lctx *L, kiln_dtype dt) {
  if (dt == KILN_F16 || dt == KILN_BF16) return LLVMInt16TypeInContext(L->c);
  return dt == KILN_I32 ? LLVMInt32TypeInContext(L->c) : elem_type(L, dt);
}

static LLVMValueRef call_intrinsic(lctx *L, const char *name, LLVMTypeRef t, LLVMValueRef *args, int n) {
  unsigned id = LLVMLookupIntrinsicID(name, strlen(name));
  LLVMValueRef f = LLVMGetIntrinsicDeclaration(L->m, id, &t, 1);
  LLVMTypeRef ft = LLVMIntrinsicGetType(L->c, id, &t, 1);
  return LLVMBuildCall2(L->b, ft, f, args, (unsigned)n, "");
}

/* t, or a vector of t when the values being emitted are vectors. */
static LLVMTypeRef vty(lctx *L, LLVMTypeRef t) { return L->vw ? LLVMVectorType(t, (unsigned)L->vw) : t; }

static LLVMTypeRef val_type(lctx *L, kiln_dtype dt) { return vty(L, elem_type(L, dt)); }

/* Scalar s in every lane when the values being emitted are vectors. */
static LLVMValueRef splat(lctx *L, LLVMValueRef s) {
  if (!L->vw) return s;
  if (LLVMIsConstant(s)) {
    LLVMValueRef e[64];
    for (int i = 0; i < L->vw; i++) e[i] = s;
    return LLVMConstVector(e, (unsigned)L->vw);
  }
  LLVMTypeRef i32 = LLVMInt32TypeInContext(L->c);
  LLVMValueRef v = LLVMBuildInsertElement(L->b, LLVMGetPoison(vty(L, LLVMTypeOf(s))), s, LLVMConstInt(i32, 0, 0), "");
  return LLVMBuildShuffleVector(L->b, v, LLVMGetPoison(LLVMTypeOf(v)), LLVMConstNull(LLVMVectorType(i32, (unsigned)L->vw)), "");
}

static LLVMValueRef const_of(lctx *L, kiln_dtype dt, double v) {
  if (is_float(dt)) return splat(L, LLVMConstReal(elem_type(L, dt), v));
  return splat(L, LLVMConstInt(elem_type(L, dt), (unsigned long long)(int64_t)v, 1));
}

static LLVMValueRef tag(lctx *L, LLVMValueRef inst, int a);

static unsigned elem_bytes(kiln_dtype dt) { return (unsigned)kiln_dtype_size(dt); }

/* A vector load or store of f32 or f64 elements (t) is aligned as its elements only. */
static LLVMValueRef vec_aligned(lctx *L, LLVMValueRef inst, LLVMTypeRef t) {
  if (L->vw) LLVMSetAlignment(inst, t == L->f64 ? 8 : 4);
  return inst;
}

/* llvm.masked.load or .store of vector type vt: the lanes L->mask leaves out are not touched. */
static LLVMValueRef masked(lctx *L, bool store, LLVMTypeRef vt, LLVMValueRef *args, int n) {
  const char *name = store ? "llvm.masked.store" : "llvm.masked.load";
  unsigned id = LLVMLookupIntrinsicID(name, strlen(name));
  LLVMTypeRef tys[2] = {vt, L->ptr};
  LLVMValueRef f = LLVMGetIntrinsicDeclaration(L->m, id, tys, 2);
  return LLVMBuildCall2(L->b, LLVMIntrinsicGetType(L->c, id, tys, 2), f, args, (unsigned)n, "");
}

/* Access a's element (or, in own vectors, its L->vw elements) at ptr. */
static LLVMValueRef load_at(lctx *L, LLVMValueRef ptr, kiln_dtype dt, int a) {
  LLVMTypeRef t = vty(L, mem_type(L, dt));
  LLVMTypeRef i32 = LLVMInt32TypeInContext(L->c);
  LLVMValueRef v;
  if (L->vw && L->mask) {
    v = tag(L, masked(L, false, t, (LLVMValueRef[]){ptr, LLVMConstInt(i32, elem_bytes(dt), 0), L->mask, LLVMConstNull(t)}, 4), a);
  } else {
    v = tag(L, LLVMBuildLoad2(L->b, t, ptr, ""), a);
    if (L->vw) LLVMSetAlignment(v, elem_bytes(dt)); /* a vector is aligned as its elements only */
  }
  return dtype_is_narrow(dt) ? cg_narrow_load(L->b, v, dt) : v;
}

static void store_at(lctx *L, LLVMValueRef v, LLVMValueRef ptr, kiln_dtype dt, int a) {
  LLVMTypeRef i32 = LLVMInt32TypeInContext(L->c);
  if (dtype_is_narrow(dt)) v = cg_narrow_store(L->b, v, dt);
  if (L->vw && L->mask) {
    tag(L, masked(L, true, vty(L, mem_type(L, dt)), (LLVMValueRef[]){v, ptr, LLVMConstInt(i32, elem_bytes(dt), 0), L->mask}, 4), a);
    return;
  }
  LLVMValueRef st = tag(L, LLVMBuildStore(L->b, v, ptr), a);
  if (L->vw) LLVMSetAlignment(st, elem_bytes(dt));
}

static LLVMValueRef maxnan(lctx *L, kiln_dtype dt, LLVMValueRef x, LLVMValueRef y, bool max) {
  return cg_maxnan(L->b, dt, x, y, max);
}

static LLVMValueRef emit(lctx *L, int e, LLVMValueRef *off);

/* Distinct buffers of a kernel never overlap in memory (the plan keeps the
 * live ones apart; an in-place store uses its input's buffer id), so each
 * buffer is an alias scope: the vectorizer then needs no run-time overlap
 * checks and no second, scalar copy of the loop for them. */
static void alias_scopes(lctx *L) {
  cg_kernel *k = L->k;
  LLVMContextRef c = L->c;
  L->scope_kind = LLVMGetMDKindIDInContext(c, "alias.scope", 11);
  L->noalias_kind = LLVMGetMDKindIDInContext(c, "noalias", 7);
  L->loop_kind = LLVMGetMDKindIDInContext(c, "llvm.loop", 9);
  LLVMMetadataRef dom_name = LLVMMDStringInContext2(c, "kiln.buffers", 12);
  LLVMMetadataRef dom = LLVMMDNodeInContext2(c, &dom_name, 1);
  LLVMMetadataRef scope_of[64];
  for (int a = 0; a < k->n_acc; a++) {
    char name[32];
    /* named by the first access to the same buffer, not the buffer: kernels
     * of the same shape then print the same, and share code (runtime.c) */
    int n = snprintf(name, sizeof name, "kiln.a%d", cg_first_access(k, a));
    LLVMMetadataRef ops[2] = {LLVMMDStringInContext2(c, name, (size_t)n), dom};
    scope_of[a] = LLVMMDNodeInContext2(c, ops, 2); /* uniqued: one node per buffer */
  }
  for (int a = 0; a < k->n_acc; a++) {
    LLVMMetadataRef others[64];
    int n = 0;
    for (int b = 0; b < k->n_acc; b++) {
      bool seen = k->acc[b].buf == k->acc[a].buf;
      for (int q = 0; q < b && !seen; q++) seen = k->acc[q].buf == k->acc[b].buf;
      if (!seen) others[n++] = scope_of[b];
    }
    L->scope[a] = LLVMMetadataAsValue(c, LLVMMDNodeInContext2(c, &scope_of[a], 1));
    L->noalias[a] = n ? LLVMMetadataAsValue(c, LLVMMDNodeInContext2(c, others, (size_t)n)) : NULL;
  }
}

/* A load or store through access a, tagged with its buffer's scope. */
static LLVMValueRef tag(lctx *L, LLVMValueRef inst, int a) {
  LLVMSetMetadata(inst, L->scope_kind, L->scope[a]);
  if (L->noalias[a]) LLVMSetMetadata(inst, L->noalias_kind, L->noalias[a]);
  return inst;
}

/* An op's value through its emitter (emit.c); an op without one fails the kernel. */
static LLVMValueRef emit_op(lctx *L, const cg_expr *x, LLVMValueRef *off) {
  cg_emit_fn fn = cg_emitter(x->op);
  if (!fn) {
    static _Thread_local char why[96];
    snprintf(why, sizeof why, "codegen has no emitter for the op '%s'", ir_op_name(x->op));
    L->failed = why;
    return NULL;
  }
  cg_emit e = {.b = L->b, .op = x->op, .cast_to = x->cast_to, .num = {x->num[0], x->num[1]}};
  for (int i = 0; i < x->n_in; i++)
    if (!(e.v[i] = emit(L, x->in[i], off))) return NULL;
  /* the operands' dtype: a where's branches, else the first operand's (binary ops have equal types) */
  e.it = L->k->expr[x->in[x->op == OP_WHERE ? 1 : 0]].dtype;
  if (x->n_in > 1) {
    const cg_expr *ex = &L->k->expr[x->in[1]];
    e.b_const = ex->kind == CG_CONST;
    e.b_value = ex->c;
  }
  return fn(&e);
}

/* The value of expression e at the current loop point (off: per access element offset). */
static LLVMValueRef emit(lctx *L, int e, LLVMValueRef *off) {
  if (L->memo[e]) return L->memo[e];
  const cg_expr *x = &L->k->expr[e];
  LLVMValueRef v = NULL;
  switch (x->kind) {
  case CG_LOAD: {
    LLVMTypeRef t = mem_type(L, x->dtype);
    LLVMValueRef ptr = LLVMBuildGEP2(L->b, t, L->ptrs[x->a], &off[x->a], 1, "");
    /* in own vectors an access moves by 1 along the vector's dim, or by 0 (one value for every lane) */
    if (L->vw && const_is(L->k->acc[x->a].stride[L->vdim], 0)) {
      int vw = L->vw;
      L->vw = 0;
      v = load_at(L, ptr, x->dtype, x->a);
      L->vw = vw;
      v = splat(L, v);
    } else {
      v = load_at(L, ptr, x->dtype, x->a);
    }
    break;
  }
  case CG_CONST:
    v = const_of(L, x->dtype, x->c);
    break;
  case CG_ACC: /* a column kernel's results are vectors already */
    v = LLVMGetTypeKind(LLVMTypeOf(L->accv[x->a])) == LLVMVectorTypeKind ? L->accv[x->a] : splat(L, L->accv[x->a]);
    break;
  case CG_SYM: {
    LLVMValueRef s = sym_val(L, x->s);
    v = splat(L, is_float(x->dtype) ? LLVMBuildSIToFP(L->b, s, elem_type(L, x->dtype), "") : s);
    break;
  }
  case CG_OP:
    v = emit_op(L, x, off);
    break;
  }
  /* a narrow value is rounded to its dtype where it is made, as eager stores it */
  if (v && x->kind != CG_LOAD && dtype_is_narrow(x->dtype)) v = cg_narrow_load(L->b, cg_narrow_store(L->b, v, x->dtype), x->dtype);
  L->memo[e] = v;
  return v;
}

/* ---- loops ---- */

typedef struct loop {
  LLVMBasicBlockRef head, body, exit;
  LLVMValueRef i, phi_acc;
  bool masked; /* ask the vectorizer for a masked tail instead of a scalar one */
  int interleave; /* the vectorizer's interleave count, or 0 for its own choice */
  bool vectorized; /* own vectors, or their rest: the vectorizer leaves it */
  int64_t step;
} loop;

/* An inner loop of n iterations gets a masked vector tail when n is not
 * known, or known and not a multiple of the widest vector step: the
 * vectorizer's step is up to 4 vectors of 16, so a row of 40 would run
 * entirely in the scalar remainder (attention rows of a growing sequence). */
static bool want_masked_tail(sym_dim n) { return !sym_is_const(n) || (n.c % 64 != 0 && n.c < 4096); }

/* for (i = from; i < to; i++): leaves the builder in the body; i is the index. */
static void loop_open(lctx *L, loop *lp, LLVMValueRef from, LLVMValueRef to, const char *name) {
  LLVMBasicBlockRef pre = LLVMGetInsertBlock(L->b);
  lp->head = LLVMAppendBasicBlockInContext(L->c, L->fn, name);
  lp->body = LLVMAppendBasicBlockInContext(L->c, L->fn, "body");
  lp->exit = LLVMAppendBasicBlockInContext(L->c, L->fn, "exit");
  lp->masked = false;
  lp->interleave = 0;
  lp->vectorized = false;
  lp->step = 1;
  LLVMBuildBr(L->b, lp->head);
  LLVMPositionBuilderAtEnd(L->b, lp->head);
  lp->i = LLVMBuildPhi(L->b, L->i64, "i");
  LLVMAddIncoming(lp->i, &from, &pre, 1);
  LLVMBuildCondBr(L->b, LLVMBuildICmp(L->b, LLVMIntSLT, lp->i, to, ""), lp->body, lp->exit);
  LLVMPositionBuilderAtEnd(L->b, lp->body);
}

static void loop_close(lctx *L, loop *lp) {
  LLVMValueRef next = LLVMBuildAdd(L->b, lp->i, ci64(L, lp->step), "");
  LLVMBasicBlockRef end = LLVMGetInsertBlock(L->b);
  LLVMAddIncoming(lp->i, &next, &end, 1);
  LLVMValueRef br = LLVMBuildBr(L->b, lp->head);
  LLVMMetadataRef ops[4];
  int n = 1;
  if (lp->masked) {
    /* !{"llvm.loop.vectorize.predicate.enable", true} */
    LLVMMetadataRef hint[2] = {LLVMMDStringInContext2(L->c, "llvm.loop.vectorize.predicate.enable", 36),
                               LLVMValueAsMetadata(LLVMConstInt(LLVMInt1TypeInContext(L->c), 1, 0))};
    ops[n++] = LLVMMDNodeInContext2(L->c, hint, 2);
  }
  if (lp->interleave) {
    LLVMMetadataRef hint[2] = {LLVMMDStringInContext2(L->c, "llvm.loop.interleave.count", 26),
                               LLVMValueAsMetadata(LLVMConstInt(LLVMInt32TypeInContext(L->c), (unsigned)lp->interleave, 0))};
    ops[n++] = LLVMMDNodeInContext2(L->c, hint, 2);
  }
  if (lp->vectorized) {
    LLVMMetadataRef hint[2] = {LLVMMDStringInContext2(L->c, "llvm.loop.isvectorized", 22),
                               LLVMValueAsMetadata(LLVMConstInt(LLVMInt32TypeInContext(L->c), 1, 0))};
    ops[n++] = LLVMMDNodeInContext2(L->c, hint, 2);
  }
  if (n > 1) {
    /* !llvm.loop !{self, hints...}: a loop id refers to itself, made through a temporary node */
    LLVMMetadataRef tmp = LLVMTemporaryMDNode(L->c, NULL, 0);
    ops[0] = tmp;
    LLVMMetadataRef id = LLVMMDNodeInContext2(L->c, ops, (size_t)n);
    LLVMMetadataReplaceAllUsesWith(tmp, id);
    LLVMSetMetadata(br, L->loop_kind, LLVMMetadataAsValue(L->c, id));
  }
  LLVMPositionBuilderAtEnd(L->b, lp->exit);
}

static void clear_memo(lctx *L) { memset(L->memo, 0, sizeof *L->memo * (size_t)L->k->n_expr); }

/* Per access offsets at inner point idx[] added to the outer bases. */
static void inner_offsets(lctx *L, LLVMValueRef *idx, LLVMValueRef *off) {
  cg_kernel *k = L->k;
  for (int a = 0; a < k->n_acc; a++) {
    LLVMValueRef o = L->base[a];
    for (int d = k->n_outer; d < k->ndim; d++) {
      if (sym_is_const(k->acc[a].stride[d]) && k->acc[a].stride[d].c == 0) continue;
      o = LLVMBuildAdd(L->b, o, LLVMBuildMul(L->b, idx[d], sym_val(L, k->acc[a].stride[d]), ""), "");
    }
    off[a] = o;
  }
}

/* Own vectors: the loop over [from, to) of the last dim in steps of
 * `copies` vectors, then what is left as one vector under a mask (none when
 * the count is a constant multiple of the step; copies is 1 when it may not
 * be). point(L, i, ctx) emits the body at index i, with L->vw lanes,
 * L->vcopy the vector's place in its pass and L->mask the tail's lanes. */
typedef void (*vec_point)(lctx *L, LLVMValueRef i, void *ctx);

static void vec_loop(lctx *L, LLVMValueRef from, LLVMValueRef to, int copies, vec_point point, void *ctx) {
  bool known = LLVMIsAConstantInt(from) && LLVMIsAConstantInt(to);
  int64_t count = known ? LLVMConstIntGetSExtValue(to) - LLVMConstIntGetSExtValue(from) : 0;
  if (!known || count % ((int64_t)L->lanes * copies)) copies = 1; /* the tail is one vector */
  int64_t step = (int64_t)L->lanes * copies;
  bool whole = known && count % step == 0;
  LLVMValueRef end = to;
  if (!whole) {
    LLVMValueRef n = LLVMBuildSDiv(L->b, LLVMBuildSub(L->b, to, from, ""), ci64(L, step), "");
    end = LLVMBuildAdd(L->b, from, LLVMBuildMul(L->b, n, ci64(L, step), ""), "");
  }
  loop lp;
  loop_open(L, &lp, from, end, "vec");
  lp.step = step;
  lp.vectorized = true;
  L->vw = L->lanes;
  for (int c = 0; c < copies; c++) {
    L->vcopy = c;
    point(L, c ? LLVMBuildAdd(L->b, lp.i, ci64(L, c * L->lanes), "") : lp.i, ctx);
  }
  L->vw = L->vcopy = 0;
  loop_close(L, &lp);
  if (whole) return;
  LLVMBasicBlockRef tail = LLVMAppendBasicBlockInContext(L->c, L->fn, "tail"),
                    done = LLVMAppendBasicBlockInContext(L->c, L->fn, "taildone");
  LLVMBuildCondBr(L->b, LLVMBuildICmp(L->b, LLVMIntSLT, end, to, ""), tail, done);
  LLVMPositionBuilderAtEnd(L->b, tail);
  LLVMValueRef lane[64];
  for (int j = 0; j < L->lanes; j++) lane[j] = ci64(L, j);
  L->vw = L->lanes;
  L->mask = LLVMBuildICmp(L->b, LLVMIntSLT, LLVMConstVector(lane, (unsigned)L->lanes), splat(L, LLVMBuildSub(L->b, to, end, "")), "");
  point(L, end, ctx);
  L->vw = 0;
  L->mask = NULL;
  LLVMBuildBr(L->b, done);
  LLVMPositionBuilderAtEnd(L->b, done);
}

/* Emits the inner loop nest over dims [d, ndim), running body at the innermost point. */
typedef void (*inner_body)(lctx *L, LLVMValueRef *off, void *ctx);

typedef struct nest_ctx {
  LLVMValueRef *idx;
  inner_body body;
  void *ctx;
} nest_ctx;

static void nest_point(lctx *L, LLVMValueRef i, void *vctx) {
  nest_ctx *n = vctx;
  n->idx[L->k->ndim - 1] = i;
  LLVMValueRef off[64];
  inner_offsets(L, n->idx, off);
  n->body(L, off, n->ctx);
}

static void inner_nest(lctx *L, int d, LLVMValueRef *idx, inner_body body, void *ctx) {
  cg_kernel *k = L->k;
  if (d == k->ndim) {
    LLVMValueRef off[64];
    inner_offsets(L, idx, off);
    body(L, off, ctx);
    return;
  }
  if (L->lanes && d == k->ndim - 1) {
    nest_ctx n = {idx, body, ctx};
    vec_loop(L, ci64(L, 0), sym_val(L, k->dim[d]), L->copies, nest_point, &n);
    return;
  }
  loop lp;
  if (d == 0 && L->first_lo) loop_open(L, &lp, L->first_lo, L->first_hi, "inner");
  else loop_open(L, &lp, ci64(L, 0), sym_val(L, k->dim[d]), "inner");
  lp.masked = d == k->ndim - 1 && want_masked_tail(k->dim[d]);
  if (d == k->ndim - 1) lp.interleave = L->inner_interleave;
  idx[d] = lp.i;
  inner_nest(L, d + 1, idx, body, ctx);
  loop_close(L, &lp);
}

typedef struct reduce_ctx {
  const cg_stage *st;
  int keep_in;            /* access to store the reduced values to (a later MAP reads them back), or -1 */
  LLVMValueRef acc_ptr;   /* an alloca holding the accumulator */
  LLVMTypeRef acc_t;
  kiln_dtype dt;
  bool ordered;           /* no reassoc: the column schedule adds in the reduced index's order */
  LLVMValueRef vacc[4];   /* own vectors: an accumulator per vector of a pass */
  bool column;            /* own vectors: acc_ptr is the block's accumulators at the vector's first */
} reduce_ctx;

static void reduce_body(lctx *L, LLVMValueRef *off, void *vctx) {
  reduce_ctx *r = vctx;
  clear_memo(L);
  LLVMValueRef v = emit(L, r->st->expr, off);
  if (!v) return;
  if (r->keep_in >= 0)
    store_at(L, v, LLVMBuildGEP2(L->b, mem_type(L, r->dt), L->ptrs[r->keep_in], &off[r->keep_in], 1, ""), r->dt, r->keep_in);
  LLVMValueRef acc_ptr = L->vw && !r->column ? r->vacc[L->vcopy] : r->acc_ptr;
  LLVMTypeRef acc_t = vty(L, r->acc_t);
  LLVMValueRef acc = LLVMBuildLoad2(L->b, acc_t, acc_ptr, "");
  if (r->column) vec_aligned(L, acc, r->acc_t);
  LLVMValueRef nv;
  if (r->st->op == OP_SUM || r->st->op == OP_MEAN) {
    if (dtype_wide(r->dt) == KILN_F32 && r->acc_t == L->f64) v = LLVMBuildFPExt(L->b, v, acc_t, "");
    if (is_float(r->dt)) {
      nv = LLVMBuildFAdd(L->b, acc, v, "");
      if (!r->ordered) LLVMSetFastMathFlags(nv, LLVMFastMathAllowReassoc);
      /* a sum of products (matvec, x.y, a variance) adds each product with
       * one rounding (an FMA): half the vector ops of a dot product, whose
       * loads then bound it; the lanes' order is the same as without */
      if (!r->ordered && LLVMIsAInstruction(v) && LLVMGetInstructionOpcode(v) == LLVMFMul) {
        LLVMSetFastMathFlags(v, LLVMGetFastMathFlags(v) | LLVMFastMathAllowContract);
        LLVMSetFastMathFlags(nv, LLVMFastMathAllowReassoc | LLVMFastMathAllowContract);
      }
    } else {
      nv = LLVMBuildAdd(L->b, acc, v, "");
    }
  } else if (is_float(r->dt)) {
    /* llvm.maximum propagates NaN like eager and is a reduction the vectorizer knows
     * (eager's select form is not); they differ only on which zero max(-0, +0) is */
    nv = call_intrinsic(L, r->st->op == OP_MAX ? "llvm.maximum" : "llvm.minimum", acc_t, (LLVMValueRef[]){acc, v}, 2);
  } else {
    nv = maxnan(L, r->dt, v, acc, r->st->op == OP_MAX);
  }
  /* a masked tail's lanes past the end keep their sums */
  if (L->vw && L->mask) nv = LLVMBuildSelect(L->b, L->mask, nv, acc, "");
  LLVMValueRef st = LLVMBuildStore(L->b, nv, acc_ptr);
  if (r->column) vec_aligned(L, st, r->acc_t);
}

static void map_body(lctx *L, LLVMValueRef *off, void *vctx) {
  const cg_stage *st = vctx;
  clear_memo(L);
  if (L->reuse_expr >= 0 && st->store == L->reuse_acc) {
    /* an earlier REDUCE stage left this value where this stage stores: read it back */
    kiln_dtype dt = L->k->expr[L->reuse_expr].dtype;
    LLVMTypeRef t = mem_type(L, dt);
    LLVMValueRef ptr = LLVMBuildGEP2(L->b, t, L->ptrs[st->store], &off[st->store], 1, "");
    L->memo[L->reuse_expr] = load_at(L, ptr, dt, st->store);
  }
  LLVMValueRef v = emit(L, st->expr, off);
  if (!v) return;
  const cg_access *a = &L->k->acc[st->store];
  kiln_dtype dt = L->prog->buf[a->buf].dtype;
  LLVMValueRef ptr = LLVMBuildGEP2(L->b, mem_type(L, dt), L->ptrs[st->store], &off[st->store], 1, "");
  store_at(L, v, ptr, dt, st->store);
}

/* Outer bases at flat outer index o (dims [0, n_outer) split by div/mod). */
static void outer_bases(lctx *L, LLVMValueRef o, int n_outer) {
  cg_kernel *k = L->k;
  LLVMValueRef rem = o;
  LLVMValueRef idx[MAXD];
  for (int d = n_outer - 1; d >= 0; d--) {
    if (d == 0) {
      idx[d] = rem;
    } else {
      LLVMValueRef n = sym_val(L, k->dim[d]);
      idx[d] = LLVMBuildSRem(L->b, rem, n, "");
      rem = LLVMBuildSDiv(L->b, rem, n, "");
    }
  }
  for (int a = 0; a < k->n_acc; a++) {
    LLVMValueRef b = access_offset(L, a);
    for (int d = 0; d < n_outer; d++) {
      if (sym_is_const(k->acc[a].stride[d]) && k->acc[a].stride[d].c == 0) continue;
      b = LLVMBuildAdd(L->b, b, LLVMBuildMul(L->b, idx[d], sym_val(L, k->acc[a].stride[d]), ""), "");
    }
    L->base[a] = b;
  }
}

static bool uses_expr(const cg_kernel *k, int e, int want) {
  if (e == want) return true;
  const cg_expr *x = &k->expr[e];
  if (x->kind != CG_OP) return false;
  for (int i = 0; i < x->n_in; i++)
    if (uses_expr(k, x->in[i], want)) return true;
  return false;
}

/* Expression e reads the result of stage s (CG_ACC). */
static bool uses_acc(const cg_kernel *k, int e, int s) {
  const cg_expr *x = &k->expr[e];
  if (x->kind == CG_ACC) return x->a == s;
  if (x->kind != CG_OP) return false;
  for (int i = 0; i < x->n_in; i++)
    if (uses_acc(k, x->in[i], s)) return true;
  return false;
}

static bool costly_op(int op) { return op >= 0 && op < OP_COUNT && op_table[op].cost >= 2; }

static bool costly(const cg_kernel *k, int e) {
  const cg_expr *x = &k->expr[e];
  if (x->kind != CG_OP) return false;
  if (costly_op(x->op)) return true;
  for (int i = 0; i < x->n_in; i++)
    if (costly(k, x->in[i])) return true;
  return false;
}

int lower_costly_ops(const cg_kernel *k) {
  int n = 0;
  for (int e = 0; e < k->n_expr; e++) n += k->expr[e].kind == CG_OP && costly_op(k->expr[e].op);
  return n;
}

/* Row kernels like softmax sum a costly value (exp) that their MAP needs again:
 * the REDUCE stage stores it where the MAP will store (same loops, same
 * offsets, same dtype) and the MAP loads it instead of computing it twice. */
static void plan_reuse(lctx *L) {
  const cg_kernel *k = L->k;
  L->reuse_expr = L->reuse_acc = -1;
  const cg_stage *map = &k->stage[k->n_stage - 1];
  if (map->kind != CG_MAP || !map->inner) return;
  const cg_access *sa = &k->acc[map->store];
  for (int s = 0; s < k->n_stage - 1; s++) {
    const cg_stage *st = &k->stage[s];
    if (st->kind != CG_REDUCE || !costly(k, st->expr)) continue;
    if (k->expr[st->expr].dtype != L->prog->buf[sa->buf].dtype || !uses_expr(k, map->expr, st->expr)) continue;
    /* nothing else in the kernel may read the output buffer */
    bool alone = true;
    for (int a = 0; a < k->n_acc; a++)
      if (a != map->store && k->acc[a].buf == sa->buf) alone = false;
    if (!alone) continue;
    L->reuse_expr = st->expr;
    L->reuse_acc = map->store;
  }
}

/* f32 sums accumulate in f32 (one vector of lanes, 4 interleaved: 32 or 64 partial sums) when
 * the rows are short and known, which keeps them within a few ulp of
 * eager's pairwise sums and twice as fast; long or symbolic rows sum in f64. */
static bool short_rows(const cg_kernel *k) {
  int64_t n = 1;
  for (int d = k->n_outer; d < k->ndim; d++) {
    if (!sym_is_const(k->dim[d])) return false;
    n *= k->dim[d].c;
  }
  return n <= 8192;
}

/* Own vectors: a REDUCE stage's accumulators. A row that is a constant
 * multiple of four vectors keeps four vectors of partial results (two
 * vectors: two), as LLVM's vectorizer would; others one, which the masked
 * tail adds to: lane j of vector c takes the elements at j + c * lanes
 * modulo the pass. iv, the start value, goes in lane 0 of vector 0, the
 * other lanes start at the op's identity. */
static void vec_accumulators(lctx *L, reduce_ctx *r, LLVMValueRef iv) {
  sym_dim n = L->k->dim[L->k->ndim - 1];
  int64_t pass = 4 * (int64_t)L->lanes;
  L->copies = !sym_is_const(n) ? 1 : n.c % pass == 0 ? 4 : n.c % (pass / 2) == 0 ? 2 : 1;
  double id = r->st->op == OP_MAX ? -INFINITY : r->st->op == OP_MIN ? INFINITY : -0.0;
  LLVMValueRef idv = LLVMConstReal(r->acc_t, id), lane[64];
  LLVMTypeRef vt = LLVMVectorType(r->acc_t, (unsigned)L->lanes);
  for (int c = 0; c < L->copies; c++) {
    for (int j = 0; j < L->lanes; j++) lane[j] = c == 0 && j == 0 ? iv : idv;
    r->vacc[c] = LLVMBuildAlloca(L->eb, vt, "vacc");
    LLVMBuildStore(L->b, LLVMConstVector(lane, (unsigned)L->lanes), r->vacc[c]);
  }
}

/* The value of r's accumulators: the vectors combined as LLVM's vectorizer
 * does (((v1 + v0) + v2) + v3), then their lanes in a tree (sums through
 * llvm.vector.reduce.fadd, which x86 also reduces as a tree). */
static LLVMValueRef vec_reduced(lctx *L, reduce_ctx *r) {
  bool sum = r->st->op == OP_SUM || r->st->op == OP_MEAN;
  const char *mm = r->st->op == OP_MAX ? "llvm.maximum" : "llvm.minimum";
  LLVMTypeRef vt = LLVMVectorType(r->acc_t, (unsigned)L->lanes);
  LLVMValueRef v = LLVMBuildLoad2(L->b, vt, r->vacc[0], "");
  for (int c = 1; c < L->copies; c++) {
    LLVMValueRef w = LLVMBuildLoad2(L->b, vt, r->vacc[c], "");
    if (sum) {
      v = LLVMBuildFAdd(L->b, w, v, "");
      LLVMSetFastMathFlags(v, LLVMFastMathAllowReassoc);
    } else {
      v = call_intrinsic(L, mm, vt, (LLVMValueRef[]){w, v}, 2);
    }
  }
  LLVMValueRef x;
  if (sum) {
    x = call_intrinsic(L, "llvm.vector.reduce.fadd", vt, (LLVMValueRef[]){LLVMConstReal(r->acc_t, -0.0), v}, 2);
    LLVMSetFastMathFlags(x, LLVMFastMathAllowReassoc);
  } else {
    LLVMTypeRef i32 = LLVMInt32TypeInContext(L->c);
    for (int w = L->lanes / 2; w >= 1; w /= 2) {
      LLVMValueRef lo[32], hi[32];
      for (int j = 0; j < w; j++) lo[j] = LLVMConstInt(i32, (unsigned)j, 0), hi[j] = LLVMConstInt(i32, (unsigned)(j + w), 0);
      LLVMValueRef a = LLVMBuildShuffleVector(L->b, v, LLVMGetPoison(LLVMTypeOf(v)), LLVMConstVector(lo, (unsigned)w), "");
      LLVMValueRef b = LLVMBuildShuffleVector(L->b, v, LLVMGetPoison(LLVMTypeOf(v)), LLVMConstVector(hi, (unsigned)w), "");
      v = call_intrinsic(L, mm, LLVMTypeOf(a), (LLVMValueRef[]){a, b}, 2);
    }
    x = LLVMBuildExtractElement(L->b, v, LLVMConstInt(i32, 0, 0), "");
  }
  return x;
}

/* A REDUCE stage's value from its accumulator r: a mean divides by the
 * inner count, and a wider accumulator rounds back to the stage's dtype. */
static LLVMValueRef reduced_value(lctx *L, const cg_stage *st, LLVMTypeRef acc_t, LLVMValueRef r) {
  cg_kernel *k = L->k;
  kiln_dtype dt = k->expr[st->expr].dtype;
  if (st->op == OP_MEAN) {
    LLVMValueRef cnt = ci64(L, 1);
    for (int d = k->n_outer; d < k->ndim; d++) cnt = LLVMBuildMul(L->b, cnt, sym_val(L, k->dim[d]), "");
    r = LLVMBuildFDiv(L->b, r, splat(L, LLVMBuildSIToFP(L->b, cnt, acc_t, "")), "");
  }
  return acc_t != elem_type(L, dt) ? LLVMBuildFPTrunc(L->b, r, val_type(L, dt), "") : r;
}

/* Dot-product kernels (one sum over one inner dim, then a store per outer
 * element: a matvec, row sums) run CG_JAM outer elements per pass of the
 * inner loop: an operand the CG_JAM share (the vector of a matvec) loads
 * once, and their sums overlap. Groups start at multiples of CG_JAM (the
 * runtime's blocks are multiples of it), so which elements run grouped, and
 * so the bits, do not depend on the thread count. A sum of a costly term
 * (a log, an exp) is not grouped: its polynomial has work enough to
 * overlap within one row, and four copies of it are only more to compile. */
enum { CG_JAM_STAGES = 8 }; /* stages a jammed kernel may have */

static bool jammable(const cg_kernel *k) {
  if (k->n_stage < 2 || k->n_stage > CG_JAM_STAGES || k->n_outer < 1 || k->ndim != k->n_outer + 1) return false;
  int sums = 0;
  for (int s = 0; s < k->n_stage; s++) {
    const cg_stage *st = &k->stage[s];
    if (st->kind == CG_REDUCE) {
      if ((st->op != OP_SUM && st->op != OP_MEAN) || !is_float(k->expr[st->expr].dtype) || costly(k, st->expr)) return false;
      sums++;
      continue;
    }
    if (st->inner) return false;
    if (s + 1 == k->n_stage || st->store < 0) continue;
    /* a value stored before a later sum: the group runs that sum for all
     * its elements first, so nothing in the kernel may read it back */
    for (int e = 0; e < k->n_expr; e++)
      if (k->expr[e].kind == CG_LOAD && k->acc[k->expr[e].a].buf == k->acc[st->store].buf) return false;
  }
  return sums > 0 && k->stage[k->n_stage - 1].kind == CG_MAP;
}

/* Outer elements [begin, begin + n*CG_JAM) of a jammable kernel, stage by
 * stage: a sum for the CG_JAM elements of the group at once (one pass of
 * the inner loop), a once-per-element MAP for each of them in turn. Two
 * matvecs of one vector (SwiGLU's w1 and w3) are two such sums; a later
 * sum may read an earlier one, as a variance reads its mean. */
static void lower_jammed(lctx *L, LLVMValueRef begin, LLVMValueRef groups, LLVMValueRef (*acc_ptr)[CG_JAM],
                         const LLVMTypeRef *acc_t) {
  cg_kernel *k = L->k;
  LLVMValueRef base[CG_JAM][64], val[CG_JAM_STAGES][CG_JAM];
  loop lg;
  loop_open(L, &lg, ci64(L, 0), groups, "groups");
  LLVMValueRef o = LLVMBuildAdd(L->b, begin, LLVMBuildMul(L->b, lg.i, ci64(L, CG_JAM), ""), "");
  for (int r = 0; r < CG_JAM; r++) {
    outer_bases(L, LLVMBuildAdd(L->b, o, ci64(L, r), ""), k->n_outer);
    memcpy(base[r], L->base, sizeof(LLVMValueRef) * (size_t)k->n_acc);
  }
  for (int s = 0; s < k->n_stage; s++) {
    const cg_stage *st = &k->stage[s];
    if (st->kind == CG_MAP) {
      for (int r = 0; r < CG_JAM; r++) {
        for (int q = 0; q < s; q++)
          if (k->stage[q].kind == CG_REDUCE) L->accv[q] = val[q][r];
        memcpy(L->base, base[r], sizeof(LLVMValueRef) * (size_t)k->n_acc);
        LLVMValueRef off[64];
        memcpy(off, base[r], sizeof(LLVMValueRef) * (size_t)k->n_acc);
        map_body(L, off, (void *)st);
      }
      continue;
    }
    kiln_dtype dt = k->expr[st->expr].dtype;
    for (int r = 0; r < CG_JAM; r++)
      LLVMBuildStore(L->b, acc_t[s] == L->f64 ? LLVMConstReal(L->f64, 0) : const_of(L, dt, 0), acc_ptr[s][r]);
    loop in;
    loop_open(L, &in, ci64(L, 0), sym_val(L, k->dim[k->n_outer]), "inner");
    in.masked = want_masked_tail(k->dim[k->n_outer]);
    /* the CG_JAM sums are the independent chains that interleaving would
     * add: one vector per output keeps the loads of a matvec's rows, which
     * bound it, in order (W6: 9.1 to 8.3 us a call) */
    in.interleave = 1;
    LLVMValueRef idx[MAXD];
    idx[k->n_outer] = in.i;
    for (int r = 0; r < CG_JAM; r++) {
      memcpy(L->base, base[r], sizeof(LLVMValueRef) * (size_t)k->n_acc);
      for (int q = 0; q < s; q++)
        if (k->stage[q].kind == CG_REDUCE) L->accv[q] = val[q][r];
      LLVMValueRef off[64];
      inner_offsets(L, idx, off);
      reduce_ctx rc = {st, -1, acc_ptr[s][r], acc_t[s], dt, false, {0}, false};
      reduce_body(L, off, &rc);
    }
    loop_close(L, &in);
    for (int r = 0; r < CG_JAM; r++)
      val[s][r] = reduced_value(L, st, acc_t[s], LLVMBuildLoad2(L->b, acc_t[s], acc_ptr[s][r], ""));
  }
  loop_close(L, &lg);
}

/* The column schedule, for reductions over the slow (outer-in-memory) axes
 * such as a bias gradient sum(dy, 0) of (B,C): per outer element, the
 * reduced loop would stride through memory, which LLVM vectorizes with
 * gathers (slow to run and to compile). Instead, a block of CG_COLUMN
 * consecutive outer elements keeps one accumulator each in a stack array;
 * the reduced dims are the outer loops and the block the innermost,
 * unit-stride loop. Each element still adds in the reduced index's order
 * (eager's order for such a reduction), so neither the blocks nor the
 * threads' ranges change any bits. */
enum { CG_COLUMN = 256, CG_COLUMN_STAGES = 4 }; /* stack: at most 4 KB per reduce stage */

/* Conservative: float REDUCEs and MAPs stored once per outer element; the
 * outer dims collapse into one range for every access (constant strides
 * when there are several), so outer element c + j is at offset(c) + j *
 * stride; and of the loads the reductions make, at least one is contiguous
 * along that range and none that varies along it is contiguous along the
 * innermost reduced dim (that is a row reduction, better as it is). */
static bool column_ok(const cg_kernel *k) {
  int t = k->n_outer - 1; /* the fastest outer dim */
  if (t < 0 || k->ndim == k->n_outer) return false;
  int reduces = 0;
  for (int s = 0; s < k->n_stage; s++) {
    const cg_stage *st = &k->stage[s];
    if (st->kind == CG_MAP ? st->inner : !is_float(k->expr[st->expr].dtype)) return false;
    reduces += st->kind == CG_REDUCE;
  }
  if (reduces == 0 || reduces > CG_COLUMN_STAGES) return false;
  for (int a = 0; a < k->n_acc; a++)
    for (int d = 0; d < t; d++) {
      const sym_dim *st = k->acc[a].stride;
      if (!sym_is_const(st[d]) || !sym_is_const(st[d + 1]) || !sym_is_const(k->dim[d + 1]) ||
          st[d].c != st[d + 1].c * k->dim[d + 1].c)
        return false;
    }
  /* the loads under the REDUCE expressions: expressions only refer to smaller ids */
  bool *used = alloc_calloc((size_t)k->n_expr, sizeof *used);
  if (!used) return false;
  for (int s = 0; s < k->n_stage; s++)
    if (k->stage[s].kind == CG_REDUCE) used[k->stage[s].expr] = true;
  bool along_outer = false, along_inner = false;
  for (int e = k->n_expr - 1; e >= 0; e--) {
    const cg_expr *x = &k->expr[e];
    if (!used[e]) continue;
    if (x->kind == CG_OP)
      for (int i = 0; i < x->n_in; i++) used[x->in[i]] = true;
    if (x->kind != CG_LOAD) continue;
    const sym_dim *st = k->acc[x->a].stride;
    along_outer |= sym_is_const(st[t]) && st[t].c == 1;
    /* a load the block shares (a layer norm's per-row statistics) is one value per reduced point, not a row */
    bool per_block = sym_is_const(st[t]) && st[t].c == 0;
    along_inner |= sym_is_const(st[k->ndim - 1]) && st[k->ndim - 1].c == 1 && !per_block;
  }
  alloc_free(used);
  return along_outer && !along_inner;
}

bool lower_is_column(const cg_kernel *k) { return column_ok(k); }

bool lower_is_jammed(const cg_kernel *k) {
  return !k->split && !column_ok(k) && jammable(k) && is_float(k->expr[k->stage[0].expr].dtype);
}

typedef struct column {
  int t;                      /* the fastest outer dim */
  LLVMValueRef base[64];      /* per access: its offset at the block's first outer element */
  LLVMValueRef n;             /* outer elements in this block */
  bool masked;                /* the block loops get a masked vector tail */
  LLVMValueRef acc[16];       /* per REDUCE stage: its accumulators */
  LLVMTypeRef acc_t[16];
  LLVMValueRef val[16];       /* per REDUCE stage a later one reads: its values, finished once (a mean divided), or NULL */
} column;

static LLVMValueRef block_load(lctx *L, LLVMTypeRef t, LLVMValueRef arr, LLVMValueRef j);

/* At block element j: the accesses' bases, and the values of the REDUCE
 * stages before stage upto (a variance reads its mean). */
static void column_point(lctx *L, const column *cl, LLVMValueRef j, int upto) {
  cg_kernel *k = L->k;
  for (int a = 0; a < k->n_acc; a++) {
    sym_dim s = k->acc[a].stride[cl->t];
    L->base[a] = sym_is_const(s) && s.c == 0 ? cl->base[a]
                                             : LLVMBuildAdd(L->b, cl->base[a], LLVMBuildMul(L->b, j, sym_val(L, s), ""), "");
  }
  for (int s = 0; s < upto; s++) {
    const cg_stage *st = &k->stage[s];
    if (st->kind != CG_REDUCE) continue;
    if (cl->val[s]) {
      LLVMTypeRef t = elem_type(L, k->expr[st->expr].dtype);
      L->accv[s] = block_load(L, t, cl->val[s], j);
    } else {
      L->accv[s] = reduced_value(L, st, cl->acc_t[s], block_load(L, cl->acc_t[s], cl->acc[s], j));
    }
  }
}

/* Own vectors in a column kernel: the lane-th element of every array a
 * block keeps (accumulators, finished values) is its column's. A masked
 * tail reads and writes whole vectors there too: the arrays hold
 * CG_COLUMN elements and a tail starts at a multiple of the lanes below
 * the block's count, so it stays inside; its lanes past the count are not
 * used. */
static LLVMValueRef block_load(lctx *L, LLVMTypeRef t, LLVMValueRef arr, LLVMValueRef j) {
  return vec_aligned(L, LLVMBuildLoad2(L->b, vty(L, t), LLVMBuildGEP2(L->b, t, arr, &j, 1, ""), ""), t);
}

static void block_store(lctx *L, LLVMTypeRef t, LLVMValueRef v, LLVMValueRef arr, LLVMValueRef j) {
  vec_aligned(L, LLVMBuildStore(L->b, v, LLVMBuildGEP2(L->b, t, arr, &j, 1, "")), t);
}

typedef struct col_ctx {
  column *cl;
  int s;
  LLVMValueRef *idx;
} col_ctx;

/* Stage s's REDUCE at block element j. */
static void column_reduce_point(lctx *L, LLVMValueRef j, void *vctx) {
  col_ctx *c = vctx;
  cg_kernel *k = L->k;
  const cg_stage *st = &k->stage[c->s];
  column_point(L, c->cl, j, c->s);
  LLVMValueRef off[64];
  inner_offsets(L, c->idx, off);
  reduce_ctx rc = {st, -1, LLVMBuildGEP2(L->b, c->cl->acc_t[c->s], c->cl->acc[c->s], &j, 1, ""), c->cl->acc_t[c->s],
                   k->expr[st->expr].dtype, true, {0}, true};
  reduce_body(L, off, &rc);
}

/* Stage s's accumulators at j start at its op's identity (max, min). */
static void column_init_point(lctx *L, LLVMValueRef j, void *vctx) {
  col_ctx *c = vctx;
  LLVMTypeRef t = c->cl->acc_t[c->s];
  block_store(L, t, splat(L, LLVMConstReal(t, L->k->stage[c->s].op == OP_MAX ? -INFINITY : INFINITY)), c->cl->acc[c->s], j);
}

/* Stage s's value at j, finished (a mean divided, rounded back). */
static void column_finish_point(lctx *L, LLVMValueRef j, void *vctx) {
  col_ctx *c = vctx;
  const cg_stage *st = &L->k->stage[c->s];
  LLVMTypeRef t = c->cl->acc_t[c->s];
  LLVMValueRef r = reduced_value(L, st, t, block_load(L, t, c->cl->acc[c->s], j));
  block_store(L, elem_type(L, L->k->expr[st->expr].dtype), r, c->cl->val[c->s], j);
}

/* Stage s's MAP at j. */
static void column_store_point(lctx *L, LLVMValueRef j, void *vctx) {
  col_ctx *c = vctx;
  column_point(L, c->cl, j, c->s);
  LLVMValueRef off[64];
  memcpy(off, L->base, sizeof(LLVMValueRef) * (size_t)L->k->n_acc);
  map_body(L, off, (void *)&L->k->stage[c->s]);
}

/* The reduced dims [d, ndim) as loops around the block's loop, which adds
 * each element's expression into its accumulator. */
static void column_nest(lctx *L, column *cl, int s, int d, LLVMValueRef *idx) {
  cg_kernel *k = L->k;
  loop lp;
  if (d < k->ndim) {
    loop_open(L, &lp, ci64(L, 0), sym_val(L, k->dim[d]), "reduced");
    idx[d] = lp.i;
    column_nest(L, cl, s, d + 1, idx);
    loop_close(L, &lp);
    return;
  }
  col_ctx c = {cl, s, idx};
  if (L->lanes) {
    vec_loop(L, ci64(L, 0), cl->n, 1, column_reduce_point, &c);
    return;
  }
  loop_open(L, &lp, ci64(L, 0), cl->n, "column");
  lp.masked = cl->masked;
  column_reduce_point(L, lp.i, &c);
  loop_close(L, &lp);
}

/* Outer elements [begin, end) of a column kernel, in blocks of CG_COLUMN;
 * the stages run in order over each block. */
static void lower_column(lctx *L, LLVMValueRef begin, LLVMValueRef end) {
  cg_kernel *k = L->k;
  column cl = {.t = k->n_outer - 1};
  int64_t total = 1;
  for (int d = 0; d < k->n_outer && !cl.masked; d++) {
    if (sym_is_const(k->dim[d])) total *= k->dim[d].c;
    else cl.masked = true;
  }
  if (!cl.masked) cl.masked = want_masked_tail(sym_const(total));
  for (int s = 0; s < k->n_stage; s++) {
    const cg_stage *st = &k->stage[s];
    if (st->kind != CG_REDUCE) continue;
    kiln_dtype dt = k->expr[st->expr].dtype;
    /* the row rule: f32 sums widen to f64 unless the reduced count is small and known */
    bool sum = st->op == OP_SUM || st->op == OP_MEAN;
    cl.acc_t[s] = sum && dtype_wide(dt) == KILN_F32 && !short_rows(k) ? L->f64 : elem_type(L, dt);
    cl.acc[s] = LLVMBuildArrayAlloca(L->eb, L->f64, ci64(L, CG_COLUMN), "colacc");
    /* a value a later REDUCE reads at every reduced point is finished once, not there */
    bool read_later = false;
    for (int q = s + 1; q < k->n_stage; q++)
      read_later |= k->stage[q].kind == CG_REDUCE && uses_acc(k, k->stage[q].expr, s);
    if (read_later && (st->op == OP_MEAN || cl.acc_t[s] != elem_type(L, dt)))
      cl.val[s] = LLVMBuildArrayAlloca(L->eb, L->f64, ci64(L, CG_COLUMN), "colval");
  }
  LLVMValueRef span = LLVMBuildSub(L->b, end, begin, "");
  LLVMValueRef blocks = LLVMBuildSDiv(L->b, LLVMBuildAdd(L->b, span, ci64(L, CG_COLUMN - 1), ""), ci64(L, CG_COLUMN), "");
  loop lb;
  loop_open(L, &lb, ci64(L, 0), blocks, "blocks");
  LLVMValueRef c = LLVMBuildAdd(L->b, begin, LLVMBuildMul(L->b, lb.i, ci64(L, CG_COLUMN), ""), "");
  LLVMValueRef left = LLVMBuildSub(L->b, end, c, "");
  cl.n = LLVMBuildSelect(L->b, LLVMBuildICmp(L->b, LLVMIntSLT, left, ci64(L, CG_COLUMN), ""), left, ci64(L, CG_COLUMN), "");
  outer_bases(L, c, k->n_outer);
  memcpy(cl.base, L->base, sizeof(LLVMValueRef) * (size_t)k->n_acc);
  LLVMValueRef idx[MAXD];
  for (int s = 0; s < k->n_stage; s++) {
    const cg_stage *st = &k->stage[s];
    col_ctx cc = {&cl, s, idx};
    loop lp;
    if (st->kind == CG_REDUCE) {
      if (st->op == OP_SUM || st->op == OP_MEAN) {
        /* +0.0 is all zero bits: a memset, not one more loop to vectorize */
        LLVMValueRef bytes = LLVMBuildMul(L->b, cl.n, LLVMSizeOf(cl.acc_t[s]), "");
        LLVMBuildMemSet(L->b, cl.acc[s], LLVMConstInt(L->i8, 0, 0), bytes, 8);
      } else if (L->lanes) {
        vec_loop(L, ci64(L, 0), cl.n, 1, column_init_point, &cc);
      } else {
        loop_open(L, &lp, ci64(L, 0), cl.n, "init");
        column_init_point(L, lp.i, &cc);
        loop_close(L, &lp);
      }
      column_nest(L, &cl, s, k->n_outer, idx);
      if (cl.val[s] && L->lanes) {
        vec_loop(L, ci64(L, 0), cl.n, 1, column_finish_point, &cc);
      } else if (cl.val[s]) {
        loop_open(L, &lp, ci64(L, 0), cl.n, "finish");
        lp.masked = cl.masked;
        column_finish_point(L, lp.i, &cc);
        loop_close(L, &lp);
      }
    } else if (L->lanes) {
      vec_loop(L, ci64(L, 0), cl.n, 1, column_store_point, &cc);
    } else {
      loop_open(L, &lp, ci64(L, 0), cl.n, "store");
      lp.masked = cl.masked;
      column_store_point(L, lp.i, &cc);
      loop_close(L, &lp);
    }
  }
  loop_close(L, &lb);
}

/* The column schedule in registers, for a sum of one REDUCE stage then one
 * MAP whose accumulator is the stage's own type (f64, or f32 over short
 * known rows): a batch-1 matvec against (in,out) weights, y = x @ W with W
 * (K,N), is one. A panel of up to CG_PANEL vectors of consecutive outer
 * elements keeps its sums in registers while the reduced loops run (per
 * reduced point: one broadcast of x[k] and a vector load of W's row piece
 * per vector), then stores them through the MAP; what is left after the
 * panels runs a vector at a time, the last one under a mask. Each element
 * adds in the reduced index's order, as the column schedule and eager do
 * (no FMA: bitwise eager's column sums and its (in,out) gemv), whichever
 * panel or vector it falls in, so the bits depend neither on the runtime's
 * blocks nor on the thread count. */
enum { CG_PANEL = 8, CG_PANEL_WHOLE = 24 };

static bool vec_reads_ok(const cg_kernel *k, int e, int d, const int *stored, int n_stored);

static bool panel_ok(const cg_kernel *k) {
  if (!runtime_own_vectors() || !column_ok(k) || k->n_stage != 2 || k->split) return false;
  const cg_stage *r = &k->stage[0], *m = &k->stage[1];
  if (r->kind != CG_REDUCE || (r->op != OP_SUM && r->op != OP_MEAN) || m->kind != CG_MAP) return false;
  kiln_dtype dt = dtype_wide(k->expr[r->expr].dtype);
  if (dt != KILN_F64 && !(dt == KILN_F32 && short_rows(k))) return false;
  int t = k->n_outer - 1;
  return const_is(k->acc[m->store].stride[t], 1) && vec_reads_ok(k, r->expr, t, NULL, 0) &&
         vec_reads_ok(k, m->expr, t, &m->store, 1);
}

typedef struct panel {
  int t, lanes;
  LLVMValueRef base[64];  /* per access: its offset at the panel's first outer element */
  LLVMValueRef acc[CG_PANEL_WHOLE]; /* allocas of one vector each, promoted to registers */
  LLVMTypeRef vt;
} panel;

/* The accesses' bases at element j of the panel (j a multiple of the lanes). */
static void panel_point(lctx *L, const panel *pn, int j) {
  cg_kernel *k = L->k;
  for (int a = 0; a < k->n_acc; a++) {
    sym_dim s = k->acc[a].stride[pn->t];
    L->base[a] = const_is(s, 0) ? pn->base[a] : LLVMBuildAdd(L->b, pn->base[a], LLVMBuildMul(L->b, ci64(L, j), sym_val(L, s), ""), "");
  }
}

/* The reduced dims [d, ndim) as loops; at the innermost point, each of the
 * panel's n vectors adds its term. */
static void panel_nest(lctx *L, panel *pn, int n, int d, LLVMValueRef *idx) {
  cg_kernel *k = L->k;
  if (d < k->ndim) {
    loop lp;
    loop_open(L, &lp, ci64(L, 0), sym_val(L, k->dim[d]), "reduced");
    lp.vectorized = true; /* vectors already: LLVM's vectorizer would widen along the strided dim */
    idx[d] = lp.i;
    panel_nest(L, pn, n, d + 1, idx);
    loop_close(L, &lp);
    return;
  }
  /* the offsets at the panel's first vector, and each later vector's a
   * constant distance on from those: LLVM then addresses all the panel's
   * loads from one register (offsets taken from each vector's own base were
   * a register per vector, spilled past six) */
  LLVMValueRef off0[64];
  panel_point(L, pn, 0);
  inner_offsets(L, idx, off0);
  for (int v = 0; v < n; v++) {
    panel_point(L, pn, v * pn->lanes);
    LLVMValueRef off[64];
    for (int a = 0; a < k->n_acc; a++) {
      sym_dim st = k->acc[a].stride[pn->t];
      off[a] = v == 0 || const_is(st, 0) ? off0[a]
                                         : LLVMBuildAdd(L->b, off0[a], LLVMBuildMul(L->b, ci64(L, v * pn->lanes), sym_val(L, st), ""), "");
    }
    clear_memo(L);
    LLVMValueRef e = emit(L, k->stage[0].expr, off);
    if (!e) return;
    LLVMBuildStore(L->b, LLVMBuildFAdd(L->b, LLVMBuildLoad2(L->b, pn->vt, pn->acc[v], ""), e, ""), pn->acc[v]);
  }
}

/* n vectors of outer elements from c (under L->mask when it is set): sums, then stores. */
static void panel_run(lctx *L, panel *pn, LLVMValueRef c, int n) {
  cg_kernel *k = L->k;
  outer_bases(L, c, k->n_outer);
  memcpy(pn->base, L->base, sizeof(LLVMValueRef) * (size_t)k->n_acc);
  L->vw = pn->lanes;
  for (int v = 0; v < n; v++) LLVMBuildStore(L->b, LLVMConstNull(pn->vt), pn->acc[v]);
  LLVMValueRef idx[MAXD];
  panel_nest(L, pn, n, k->n_outer, idx);
  for (int v = 0; v < n; v++) {
    L->accv[0] = reduced_value(L, &k->stage[0], LLVMGetElementType(pn->vt), LLVMBuildLoad2(L->b, pn->vt, pn->acc[v], ""));
    panel_point(L, pn, v * pn->lanes);
    LLVMValueRef off[64];
    memcpy(off, L->base, sizeof(LLVMValueRef) * (size_t)k->n_acc);
    map_body(L, off, (void *)&k->stage[1]);
  }
  L->vw = 0;
}

/* Outer elements [begin, end) of a panel kernel: panels, single vectors, a masked one. */
static void lower_panels(lctx *L, LLVMValueRef begin, LLVMValueRef end) {
  cg_kernel *k = L->k;
  panel pn = {.t = k->n_outer - 1, .lanes = jit_wide_vectors() ? 16 : 8};
  L->vdim = pn.t;
  pn.vt = LLVMVectorType(elem_type(L, k->expr[k->stage[0].expr].dtype), (unsigned)pn.lanes);
  /* a known count of vectors takes the widest panel that divides it, so no single vectors are left */
  int width = CG_PANEL;
  int64_t total = 1;
  for (int d = 0; d < k->n_outer && total; d++) total = sym_is_const(k->dim[d]) ? total * k->dim[d].c : 0;
  for (int w = CG_PANEL; total && total % pn.lanes == 0 && w >= CG_PANEL / 2; w--)
    if (total / pn.lanes % w == 0) {
      width = w;
      break;
    }
  /* a whole row of outputs in one panel when the registers hold it (32 of
   * 16 lanes) and the kernel is too small to be split over threads (one
   * call runs all its outputs): W is then read row after row, one stream,
   * as eager's gemv reads it; (288) outputs are one panel of 18 vectors */
  int64_t inner = 1; /* rt_run_loop's test, at this kernel's sizes */
  for (int d = k->n_outer; d < k->ndim && inner; d++) inner = sym_is_const(k->dim[d]) ? inner * k->dim[d].c : 0;
  bool one_block = inner > 0 && total < 2 * (inner >= RT_GRAIN ? 1 : RT_GRAIN / inner);
  if (pn.lanes == 16 && total && total % pn.lanes == 0 && total / pn.lanes <= CG_PANEL_WHOLE && one_block)
    width = (int)(total / pn.lanes);
  for (int v = 0; v < width; v++) pn.acc[v] = LLVMBuildAlloca(L->eb, pn.vt, "panel");
  int64_t step = (int64_t)width * pn.lanes;
  LLVMValueRef span = LLVMBuildSub(L->b, end, begin, "");
  LLVMValueRef n_panels = LLVMBuildSDiv(L->b, span, ci64(L, step), "");
  loop lp;
  loop_open(L, &lp, ci64(L, 0), n_panels, "panels");
  lp.vectorized = true;
  panel_run(L, &pn, LLVMBuildAdd(L->b, begin, LLVMBuildMul(L->b, lp.i, ci64(L, step), ""), ""), width);
  loop_close(L, &lp);
  LLVMValueRef from = LLVMBuildAdd(L->b, begin, LLVMBuildMul(L->b, n_panels, ci64(L, step), ""), "");
  LLVMValueRef n_vec = LLVMBuildSDiv(L->b, LLVMBuildSub(L->b, end, from, ""), ci64(L, pn.lanes), "");
  loop lv;
  loop_open(L, &lv, ci64(L, 0), n_vec, "vectors");
  lv.vectorized = true;
  panel_run(L, &pn, LLVMBuildAdd(L->b, from, LLVMBuildMul(L->b, lv.i, ci64(L, pn.lanes), ""), ""), 1);
  loop_close(L, &lv);
  LLVMValueRef last = LLVMBuildAdd(L->b, from, LLVMBuildMul(L->b, n_vec, ci64(L, pn.lanes), ""), "");
  LLVMBasicBlockRef tail = LLVMAppendBasicBlockInContext(L->c, L->fn, "tail"), done = LLVMAppendBasicBlockInContext(L->c, L->fn, "taildone");
  LLVMBuildCondBr(L->b, LLVMBuildICmp(L->b, LLVMIntSLT, last, end, ""), tail, done);
  LLVMPositionBuilderAtEnd(L->b, tail);
  LLVMValueRef lane[64];
  for (int j = 0; j < pn.lanes; j++) lane[j] = ci64(L, j);
  L->vw = pn.lanes;
  L->mask = LLVMBuildICmp(L->b, LLVMIntSLT, LLVMConstVector(lane, (unsigned)pn.lanes), splat(L, LLVMBuildSub(L->b, end, last, "")), "");
  panel_run(L, &pn, last, 1);
  L->mask = NULL;
  LLVMBuildBr(L->b, done);
  LLVMPositionBuilderAtEnd(L->b, done);
}

/* Staged kernels: for o in [begin, end): stages. */
static void lower_staged(lctx *L, LLVMValueRef begin, LLVMValueRef end) {
  cg_kernel *k = L->k;
  if (panel_ok(k)) {
    lower_panels(L, begin, end);
    return;
  }
  if (column_ok(k)) {
    lower_column(L, begin, end);
    return;
  }
  /* accumulators live in allocas in the entry block, promoted to registers by mem2reg */
  LLVMValueRef acc_ptr[16];
  LLVMTypeRef acc_t[16];
  for (int s = 0; s < k->n_stage; s++) {
    if (k->stage[s].kind != CG_REDUCE) continue;
    kiln_dtype dt = k->expr[k->stage[s].expr].dtype;
    acc_t[s] = dtype_wide(dt) == KILN_F32 && !short_rows(k) ? L->f64 : elem_type(L, dt);
    acc_ptr[s] = LLVMBuildAlloca(L->eb, L->f64, "acc"); /* f64 is the widest accumulator */
  }
  plan_reuse(L);
  if (jammable(k) && is_float(k->expr[k->stage[0].expr].dtype)) {
    LLVMValueRef jam_ptr[CG_JAM_STAGES][CG_JAM];
    for (int s = 0; s < k->n_stage; s++)
      for (int r = 0; r < CG_JAM && k->stage[s].kind == CG_REDUCE; r++) jam_ptr[s][r] = LLVMBuildAlloca(L->eb, L->f64, "jam");
    LLVMValueRef groups = LLVMBuildSDiv(L->b, LLVMBuildSub(L->b, end, begin, ""), ci64(L, CG_JAM), "");
    lower_jammed(L, begin, groups, jam_ptr, acc_t);
    /* the runtime runs a staged kernel in blocks of a multiple of CG_JAM
     * outer elements, the last one cut at the end: with a constant count of
     * them that is a multiple too, no call has a rest to run */
    int64_t n_outer = 1;
    for (int d = 0; d < k->n_outer && n_outer; d++) n_outer = sym_is_const(k->dim[d]) ? n_outer * k->dim[d].c : 0;
    if (n_outer && n_outer % CG_JAM == 0) return;
    begin = LLVMBuildAdd(L->b, begin, LLVMBuildMul(L->b, groups, ci64(L, CG_JAM), ""), "");
    /* the rest runs at most CG_JAM - 1 rows a call: a short row then gets
     * one copy of its loop's body, not LLVM's four (less to compile) */
    const sym_dim *row = &k->dim[k->n_outer];
    if (sym_is_const(*row) && row->c <= 1024) L->inner_interleave = 1;
  }
  loop outer;
  loop_open(L, &outer, begin, end, "outer");
  outer_bases(L, outer.i, k->n_outer);
  LLVMValueRef idx[MAXD];
  for (int s = 0; s < k->n_stage; s++) {
    const cg_stage *st = &k->stage[s];
    if (st->kind == CG_REDUCE) {
      kiln_dtype dt = k->expr[st->expr].dtype;
      double init = st->op == OP_MAX ? -INFINITY : st->op == OP_MIN ? INFINITY : 0.0;
      LLVMValueRef iv = acc_t[s] == L->f64 ? LLVMConstReal(L->f64, init) : const_of(L, dt, init);
      if (!is_float(dt) && st->op == OP_MAX) iv = ci64(L, INT64_MIN);
      if (!is_float(dt) && st->op == OP_MIN) iv = ci64(L, INT64_MAX);
      if (dtype_wide(dt) == KILN_F32 && st->op != OP_SUM && st->op != OP_MEAN) {
        /* max/min of f32 stay in f32 */
        acc_t[s] = L->f32;
        iv = LLVMConstReal(L->f32, init);
      }
      reduce_ctx rc = {st, -1, acc_ptr[s], acc_t[s], dt, false, {0}, false};
      if (L->reuse_expr == st->expr) rc.keep_in = L->reuse_acc;
      if (L->lanes) {
        vec_accumulators(L, &rc, iv);
        inner_nest(L, k->n_outer, idx, reduce_body, &rc);
        L->accv[s] = reduced_value(L, st, acc_t[s], vec_reduced(L, &rc));
        L->copies = 1;
        continue;
      }
      LLVMBuildStore(L->b, iv, acc_ptr[s]);
      inner_nest(L, k->n_outer, idx, reduce_body, &rc);
      L->accv[s] = reduced_value(L, st, acc_t[s], LLVMBuildLoad2(L->b, acc_t[s], acc_ptr[s], ""));
    } else if (st->inner) {
      int il = L->inner_interleave;
      if (costly(k, st->expr)) L->inner_interleave = 1; /* as flat_run's */
      inner_nest(L, k->n_outer, idx, map_body, (void *)st);
      L->inner_interleave = il;
    } else {
      LLVMValueRef off[64];
      for (int a = 0; a < k->n_acc; a++) off[a] = L->base[a];
      map_body(L, off, (void *)st);
    }
  }
  loop_close(L, &outer);
}

/* A full reduction in blocks (cg_kernel.split): begin >= 0 reduces blocks
 * [begin, end) of dim 0 into the scratch; begin < 0 combines the scratch in
 * block order (f64 sums, no reassociation) and runs the MAP. */
static void lower_split(lctx *L, LLVMValueRef begin, LLVMValueRef end) {
  cg_kernel *k = L->k;
  const cg_stage *st = &k->stage[0];
  kiln_dtype dt = k->expr[st->expr].dtype;
  bool sum = st->op == OP_SUM || st->op == OP_MEAN;
  LLVMTypeRef acc_t = dtype_wide(dt) == KILN_F32 && !(sum && !short_rows(k)) ? L->f32 : L->f64;
  double init = st->op == OP_MAX ? -INFINITY : st->op == OP_MIN ? INFINITY : 0.0;
  LLVMValueRef acc_ptr = LLVMBuildAlloca(L->eb, L->f64, "acc");
  LLVMValueRef scratch = LLVMBuildLoad2(
      L->eb, L->ptr, LLVMBuildGEP2(L->eb, L->ptr, L->bufs, (LLVMValueRef[]){ci64(L, L->k->n_acc)}, 1, ""), "scratch");
  for (int a = 0; a < k->n_acc; a++) L->base[a] = access_offset(L, a);
  LLVMBasicBlockRef blocks = LLVMAppendBasicBlockInContext(L->c, L->fn, "blocks"),
                    combine = LLVMAppendBasicBlockInContext(L->c, L->fn, "combine"),
                    done = LLVMAppendBasicBlockInContext(L->c, L->fn, "alldone");
  LLVMBuildCondBr(L->b, LLVMBuildICmp(L->b, LLVMIntSLT, begin, ci64(L, 0), ""), combine, blocks);
  /* phase 1: block b covers dim 0 in [b * n / B, (b + 1) * n / B) */
  LLVMPositionBuilderAtEnd(L->b, blocks);
  LLVMValueRef n0 = sym_val(L, k->dim[0]);
  loop lb;
  loop_open(L, &lb, begin, end, "block");
  L->first_lo = LLVMBuildSDiv(L->b, LLVMBuildMul(L->b, lb.i, n0, ""), ci64(L, CG_BLOCKS), "");
  L->first_hi = LLVMBuildSDiv(L->b, LLVMBuildMul(L->b, LLVMBuildAdd(L->b, lb.i, ci64(L, 1), ""), n0, ""), ci64(L, CG_BLOCKS), "");
  LLVMBuildStore(L->b, LLVMConstReal(acc_t, init), acc_ptr);
  reduce_ctx rc = {st, -1, acc_ptr, acc_t, dt, false, {0}, false};
  LLVMValueRef idx[MAXD];
  inner_nest(L, 0, idx, reduce_body, &rc);
  L->first_lo = L->first_hi = NULL;
  LLVMValueRef part = LLVMBuildLoad2(L->b, acc_t, acc_ptr, "");
  if (acc_t != L->f64) part = LLVMBuildFPExt(L->b, part, L->f64, "");
  LLVMBuildStore(L->b, part, LLVMBuildGEP2(L->b, L->f64, scratch, &lb.i, 1, ""));
  loop_close(L, &lb);
  LLVMBuildBr(L->b, done);
  /* phase 2: the partials in block order, then the MAP */
  LLVMPositionBuilderAtEnd(L->b, combine);
  LLVMBuildStore(L->b, LLVMConstReal(L->f64, init), acc_ptr);
  loop lc;
  loop_open(L, &lc, ci64(L, 0), ci64(L, CG_BLOCKS), "combine");
  LLVMValueRef acc = LLVMBuildLoad2(L->b, L->f64, acc_ptr, "");
  LLVMValueRef v = LLVMBuildLoad2(L->b, L->f64, LLVMBuildGEP2(L->b, L->f64, scratch, &lc.i, 1, ""), "");
  LLVMValueRef nv = sum ? LLVMBuildFAdd(L->b, acc, v, "")
                        : call_intrinsic(L, st->op == OP_MAX ? "llvm.maximum" : "llvm.minimum", L->f64, (LLVMValueRef[]){acc, v}, 2);
  LLVMBuildStore(L->b, nv, acc_ptr);
  loop_close(L, &lc);
  LLVMValueRef r = LLVMBuildLoad2(L->b, L->f64, acc_ptr, "");
  if (st->op == OP_MEAN) {
    LLVMValueRef cnt = ci64(L, 1);
    for (int d = 0; d < k->ndim; d++) cnt = LLVMBuildMul(L->b, cnt, sym_val(L, k->dim[d]), "");
    r = LLVMBuildFDiv(L->b, r, LLVMBuildSIToFP(L->b, cnt, L->f64, ""), "");
  }
  if (dtype_wide(dt) == KILN_F32) r = LLVMBuildFPTrunc(L->b, r, L->f32, "");
  L->accv[0] = r;
  LLVMValueRef off[64];
  memcpy(off, L->base, sizeof(LLVMValueRef) * (size_t)k->n_acc);
  map_body(L, off, (void *)&k->stage[1]);
  LLVMBuildBr(L->b, done);
  LLVMPositionBuilderAtEnd(L->b, done);
}

/* The pointwise stage at index i of dim d, from the bases in L->base. */
static void flat_point(lctx *L, LLVMValueRef i, void *vctx) {
  cg_kernel *k = L->k;
  int d = *(const int *)vctx;
  LLVMValueRef off[64];
  for (int a = 0; a < k->n_acc; a++) {
    sym_dim s = k->acc[a].stride[d];
    off[a] = const_is(s, 0) ? L->base[a] : LLVMBuildAdd(L->b, L->base[a], LLVMBuildMul(L->b, i, sym_val(L, s), ""), "");
  }
  map_body(L, off, (void *)&k->stage[0]);
}

/* A pointwise kernel's loop over [from, to) of its dim d, from the bases in L->base. */
static void flat_run(lctx *L, LLVMValueRef from, LLVMValueRef to, int d) {
  cg_kernel *k = L->k;
  if (L->lanes) {
    vec_loop(L, from, to, 1, flat_point, &d);
    return;
  }
  loop in;
  loop_open(L, &in, from, to, "inner");
  in.masked = want_masked_tail(k->dim[d]);
  /* one vector a pass when the body is polynomial math: it has work enough
   * to overlap in one vector, and a second interleaved copy doubled the
   * machine code time of such kernels (GELU ran no slower without it) */
  if (costly(k, k->stage[0].expr)) in.interleave = 1;
  flat_point(L, in.i, &d);
  loop_close(L, &in);
}

/* Pointwise kernels: flat elements [begin, end) as runs along the last dim. */
static void lower_flat(lctx *L, LLVMValueRef begin, LLVMValueRef end) {
  cg_kernel *k = L->k;
  const cg_stage *st = &k->stage[0];
  if (k->ndim <= 1) {
    for (int a = 0; a < k->n_acc; a++) L->base[a] = access_offset(L, a);
    if (k->ndim == 1) {
      /* one run, and no size in the code: kernels over contiguous ranges of
       * different lengths share it */
      flat_run(L, begin, end, 0);
    } else {
      LLVMValueRef off[64];
      memcpy(off, L->base, sizeof(LLVMValueRef) * (size_t)k->n_acc);
      map_body(L, off, (void *)st);
    }
    return;
  }
  int last = k->ndim - 1;
  int64_t row_len = cg_flat_row(k);
  if (row_len) {
    /* whole rows: [begin, end) runs rows [begin / len, end / len). The
     * ranges a call is split into follow one another over a multiple of
     * len, so each row goes to exactly one of them; and a loop of the
     * constant length needs no rest when it is a multiple of the vector step */
    loop rows;
    loop_open(L, &rows, LLVMBuildSDiv(L->b, begin, ci64(L, row_len), ""), LLVMBuildSDiv(L->b, end, ci64(L, row_len), ""),
              "rows");
    outer_bases(L, rows.i, last);
    flat_run(L, ci64(L, 0), ci64(L, row_len), last);
    loop_close(L, &rows);
    return;
  }
  LLVMValueRef len = sym_val(L, k->dim[last]);
  /* pos walks [begin, end); each run covers the rest of one row */
  LLVMValueRef pos_ptr = LLVMBuildAlloca(L->eb, L->i64, "pos");
  LLVMBuildStore(L->b, begin, pos_ptr);
  LLVMBasicBlockRef head = LLVMAppendBasicBlockInContext(L->c, L->fn, "run"), body = LLVMAppendBasicBlockInContext(L->c, L->fn, "runbody"),
                    exit = LLVMAppendBasicBlockInContext(L->c, L->fn, "done");
  LLVMBuildBr(L->b, head);
  LLVMPositionBuilderAtEnd(L->b, head);
  LLVMValueRef pos = LLVMBuildLoad2(L->b, L->i64, pos_ptr, "");
  LLVMBuildCondBr(L->b, LLVMBuildICmp(L->b, LLVMIntSLT, pos, end, ""), body, exit);
  LLVMPositionBuilderAtEnd(L->b, body);
  LLVMValueRef row = LLVMBuildSDiv(L->b, pos, len, ""), col = LLVMBuildSRem(L->b, pos, len, "");
  LLVMValueRef n = LLVMBuildSub(L->b, len, col, "");
  LLVMValueRef left = LLVMBuildSub(L->b, end, pos, "");
  n = LLVMBuildSelect(L->b, LLVMBuildICmp(L->b, LLVMIntSLT, left, n, ""), left, n, "");
  outer_bases(L, row, last);
  flat_run(L, col, LLVMBuildAdd(L->b, col, n, ""), last);
  LLVMBuildStore(L->b, LLVMBuildAdd(L->b, pos, n, ""), pos_ptr);
  LLVMBuildBr(L->b, head);
  LLVMPositionBuilderAtEnd(L->b, exit);
}

/* Whether the loads of expression e move by 0 or 1 element along dim d,
 * and read a buffer that stored (an access of the loop's stores) only
 * where the store writes. */
static bool vec_reads_ok(const cg_kernel *k, int e, int d, const int *stored, int n_stored) {
  const cg_expr *x = &k->expr[e];
  if (x->kind == CG_LOAD) {
    const cg_access *a = &k->acc[x->a];
    if (!const_is(a->stride[d], 0) && !const_is(a->stride[d], 1)) return false;
    for (int i = 0; i < n_stored; i++) {
      const cg_access *w = &k->acc[stored[i]];
      if (w->buf != a->buf || stored[i] == x->a) continue;
      if (!sym_same(w->offset, a->offset)) return false;
      for (int q = 0; q < k->ndim; q++)
        if (!sym_same(w->stride[q], a->stride[q])) return false;
    }
    return true;
  }
  if (x->kind != CG_OP) return true;
  for (int i = 0; i < x->n_in; i++)
    if (!vec_reads_ok(k, x->in[i], d, stored, n_stored)) return false;
  return true;
}

/* Light kernels (the quick code generator's, k->own_vectors) get vector
 * code of our own, which LLVM's vectorizer (half of their optimization
 * time) then leaves alone: in their loops over the last dim, or over the
 * block of a column kernel. Taken when each such loop reads through
 * accesses that move by 0 or 1 element along it, stores through ones that
 * move by 1, reads what it stores only where it stores it, and reduces
 * floats; split and jammed schedules keep their scalar loops. */
static bool own_vectors_ok(lctx *L) {
  cg_kernel *k = L->k;
  if (!k->own_vectors || k->ndim == 0 || k->split || k->n_stage < 1) return false;
  bool staged = cg_staged(k);
  bool by_column = staged && column_ok(k);
  if (staged && (k->n_outer >= k->ndim || (!by_column && jammable(k) && is_float(k->expr[k->stage[0].expr].dtype))))
    return false;
  /* a column kernel's lanes are its block's outer elements */
  int d = L->vdim = by_column ? k->n_outer - 1 : k->ndim - 1;
  for (int s = 0; s < k->n_stage; s++) {
    const cg_stage *st = &k->stage[s];
    if (staged && !by_column && st->kind == CG_MAP && !st->inner) continue; /* once per outer element: scalar */
    int stored[2], n_stored = 0;
    if (st->kind == CG_REDUCE) {
      if (!is_float(k->expr[st->expr].dtype)) return false;
      if (L->reuse_expr == st->expr) stored[n_stored++] = L->reuse_acc;
    } else {
      stored[n_stored++] = st->store;
    }
    for (int i = 0; i < n_stored; i++)
      if (!const_is(k->acc[stored[i]].stride[d], 1)) return false;
    if (!vec_reads_ok(k, st->expr, d, stored, n_stored)) return false;
  }
  return true;
}

int lower_kernel(const cg_program *prog, cg_kernel *k, LLVMModuleRef m, char *why, size_t whyn) {
  lctx L = {.m = m, .k = k, .prog = prog, .reuse_expr = -1, .reuse_acc = -1};
  L.c = LLVMGetModuleContext(m);
  L.i64 = LLVMInt64TypeInContext(L.c);
  L.i8 = LLVMInt8TypeInContext(L.c);
  L.f32 = LLVMFloatTypeInContext(L.c);
  L.f64 = LLVMDoubleTypeInContext(L.c);
  L.ptr = LLVMPointerTypeInContext(L.c, 0);
  if (k->n_acc > 64 || k->n_stage > 16) {
    snprintf(why, whyn, "%s has %d accesses and %d stages (at most 64 and 16)", k->name, k->n_acc, k->n_stage);
    return -1;
  }
  L.memo = alloc_calloc((size_t)k->n_expr + 1, sizeof *L.memo);
  if (!L.memo) return -1;
  LLVMTypeRef params[4] = {L.ptr, L.ptr, L.i64, L.i64};
  LLVMTypeRef ft = LLVMFunctionType(LLVMVoidTypeInContext(L.c), params, 4, 0);
  L.fn = LLVMAddFunction(m, k->name, ft);
  /* LLVM keeps to 256-bit vectors on AVX-512 hosts unless told; our loops gain from the full width */
  if (jit_wide_vectors()) LLVMAddTargetDependentFunctionAttr(L.fn, "prefer-vector-width", "512");
  L.b = LLVMCreateBuilderInContext(L.c);
  L.eb = LLVMCreateBuilderInContext(L.c);
  LLVMBasicBlockRef entry = LLVMAppendBasicBlockInContext(L.c, L.fn, "entry");
  LLVMBasicBlockRef start = LLVMAppendBasicBlockInContext(L.c, L.fn, "start");
  LLVMPositionBuilderAtEnd(L.eb, entry);
  LLVMPositionBuilderAtEnd(L.b, start);
  L.p = LLVMGetParam(L.fn, 0);
  L.bufs = LLVMGetParam(L.fn, 1);
  for (int a = 0; a < k->n_acc; a++) {
    /* accesses to one buffer (an in-place store) use one pointer: LLVM then
     * knows they are the same, and vectorizes the loop without overlap checks */
    int first = cg_first_access(k, a);
    if (first < a) {
      L.ptrs[a] = L.ptrs[first];
      continue;
    }
    LLVMValueRef g = LLVMBuildGEP2(L.eb, L.ptr, L.bufs, (LLVMValueRef[]){ci64(&L, a)}, 1, "");
    L.ptrs[a] = LLVMBuildLoad2(L.eb, L.ptr, g, "");
  }
  alias_scopes(&L);
  bool staged = cg_staged(k);
  /* a float sum, mean, max or min over every dim, then one store: split into blocks */
  k->split = k->n_outer == 0 && k->ndim >= 1 && k->n_stage == 2 && k->stage[0].kind == CG_REDUCE &&
             k->stage[1].kind == CG_MAP && !k->stage[1].inner && is_float(k->expr[k->stage[0].expr].dtype);
  plan_reuse(&L);
  /* 512-bit vectors where the CPU has them (prefer-vector-width above) */
  if (own_vectors_ok(&L)) L.lanes = jit_wide_vectors() ? 16 : 8;
  L.copies = 1;
  if (k->split) lower_split(&L, LLVMGetParam(L.fn, 2), LLVMGetParam(L.fn, 3));
  else if (staged) lower_staged(&L, LLVMGetParam(L.fn, 2), LLVMGetParam(L.fn, 3));
  else lower_flat(&L, LLVMGetParam(L.fn, 2), LLVMGetParam(L.fn, 3));
  LLVMBuildRetVoid(L.b);
  LLVMBuildBr(L.eb, start);
  LLVMDisposeBuilder(L.b);
  LLVMDisposeBuilder(L.eb);
  alloc_free(L.memo);
  if (L.failed) {
    snprintf(why, whyn, "%s: %s", k->name, L.failed);
    return -1;
  }
  return 0;
}
