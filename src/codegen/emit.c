/* Emitters: for each op ops.def runs as an expression in a loop kernel
 * (cg FUSE), the LLVM instructions that make its value from its operands'.
 * Operands are scalars, or vectors when the kernel's loop is emitted in
 * vectors of its own (lower.c); an emitter makes its constants and types
 * in the shape of its operands, so it serves both. ops.def names each op's
 * emitter; an op whose row says NONE has none, and lowering a kernel that
 * holds it fails (the variant then runs on the interpreter). */
#include <string.h>

#include <llvm-c/Core.h>

#include "codegen/codegen.h"

static bool is_float(kiln_dtype dt) { return dtype_is_float(dt); }

/* Element type t in the shape of v (a scalar, or a vector of v's lanes). */
static LLVMTypeRef shaped(LLVMValueRef v, LLVMTypeRef t) {
  LLVMTypeRef vt = LLVMTypeOf(v);
  return LLVMGetTypeKind(vt) == LLVMVectorTypeKind ? LLVMVectorType(t, LLVMGetVectorSize(vt)) : t;
}

/* The type a kernel computes dt in: f16 and bf16 as float, i32 as i64 (lower.c
 * loads and stores them narrow). */
static LLVMTypeRef elem_of(LLVMContextRef c, kiln_dtype dt) {
  switch (dtype_wide(dt)) {
  case KILN_F32: return LLVMFloatTypeInContext(c);
  case KILN_F64: return LLVMDoubleTypeInContext(c);
  case KILN_I64: return LLVMInt64TypeInContext(c);
  case KILN_BOOL: return LLVMInt8TypeInContext(c);
  default: break;
  }
  return LLVMFloatTypeInContext(c);
}

static LLVMContextRef ctx_of(LLVMValueRef v) { return LLVMGetTypeContext(LLVMTypeOf(v)); }

/* The constant c of dtype dt in the shape of v. */
static LLVMValueRef const_like(LLVMValueRef v, kiln_dtype dt, double c) {
  LLVMTypeRef e = elem_of(ctx_of(v), dt);
  LLVMValueRef s = is_float(dt) ? LLVMConstReal(e, c) : LLVMConstInt(e, (unsigned long long)(int64_t)c, 1);
  LLVMTypeRef vt = LLVMTypeOf(v);
  if (LLVMGetTypeKind(vt) != LLVMVectorTypeKind) return s;
  unsigned n = LLVMGetVectorSize(vt);
  LLVMValueRef lanes[64];
  for (unsigned i = 0; i < n && i < 64; i++) lanes[i] = s;
  return LLVMConstVector(lanes, n);
}

static LLVMValueRef intrinsic(const cg_emit *e, const char *name, LLVMTypeRef t, LLVMValueRef *args, int n) {
  unsigned id = LLVMLookupIntrinsicID(name, strlen(name));
  LLVMModuleRef m = LLVMGetGlobalParent(LLVMGetBasicBlockParent(LLVMGetInsertBlock(e->b)));
  LLVMValueRef f = LLVMGetIntrinsicDeclaration(m, id, &t, 1);
  return LLVMBuildCall2(e->b, LLVMIntrinsicGetType(LLVMGetTypeContext(t), id, &t, 1), f, args, (unsigned)n, "");
}

/* NaN-propagating max/min, as eager's MAXNAN/MINNAN. */
LLVMValueRef cg_maxnan(LLVMBuilderRef b, kiln_dtype dt, LLVMValueRef x, LLVMValueRef y, bool max) {
  if (!is_float(dt)) return LLVMBuildSelect(b, LLVMBuildICmp(b, max ? LLVMIntSGT : LLVMIntSLT, x, y, ""), x, y, "");
  LLVMValueRef c = LLVMBuildFCmp(b, max ? LLVMRealOGT : LLVMRealOLT, x, y, "");
  LLVMValueRef nan = LLVMBuildFCmp(b, LLVMRealUNO, x, x, "");
  return LLVMBuildSelect(b, LLVMBuildOr(b, c, nan, ""), x, y, "");
}

/* The integer constant u in the shape and type of v. */
static LLVMValueRef uconst_of(LLVMValueRef v, unsigned long long u) {
  LLVMTypeRef vt = LLVMTypeOf(v), et = LLVMGetTypeKind(vt) == LLVMVectorTypeKind ? LLVMGetElementType(vt) : vt;
  LLVMValueRef s = LLVMConstInt(et, u, 0);
  if (LLVMGetTypeKind(vt) != LLVMVectorTypeKind) return s;
  unsigned n = LLVMGetVectorSize(vt);
  LLVMValueRef lanes[64];
  for (unsigned i = 0; i < n && i < 64; i++) lanes[i] = s;
  return LLVMConstVector(lanes, n);
}

/* A call of the intrinsic name, overloaded on the types tys, with the one argument v. */
static LLVMValueRef call_overloaded(LLVMBuilderRef b, const char *name, LLVMTypeRef *tys, int n_tys, LLVMValueRef v) {
  unsigned id = LLVMLookupIntrinsicID(name, strlen(name));
  LLVMModuleRef m = LLVMGetGlobalParent(LLVMGetBasicBlockParent(LLVMGetInsertBlock(b)));
  LLVMValueRef f = LLVMGetIntrinsicDeclaration(m, id, tys, (size_t)n_tys);
  return LLVMBuildCall2(b, LLVMIntrinsicGetType(LLVMGetTypeContext(tys[0]), id, tys, (size_t)n_tys), f, &v, 1, "");
}

/* A float to integer type t as eager's casts do it (pointwise.c, f2i and
 * f2i32): toward zero, saturated at t's range, NaN to 0. LLVM's fptosi is
 * poison out of range (x86 gives INT64_MIN for inf, and wraps a float past
 * i32 taken through i64). */
static LLVMValueRef fptosi_sat(LLVMBuilderRef b, LLVMValueRef v, LLVMTypeRef t) {
  return call_overloaded(b, "llvm.fptosi.sat", (LLVMTypeRef[]){t, LLVMTypeOf(v)}, 2, v);
}

/* f64 to f32 rounding to odd, as eager's half_f64_odd: the f32 that f16 or
 * bf16 then rounds once, as a direct f64 -> f16 conversion would (rounding
 * to nearest twice rounds 1 + 2^-11 + 2^-40 to 1 where eager gives
 * 1 + 2^-10). Truncate, then set the last bit where inexact. */
static LLVMValueRef f64_to_f32_odd(LLVMBuilderRef b, LLVMValueRef d, LLVMTypeRef f32) {
  LLVMContextRef c = ctx_of(d);
  LLVMTypeRef i32 = shaped(d, LLVMInt32TypeInContext(c));
  LLVMValueRef f = LLVMBuildFPTrunc(b, d, f32, ""), back = LLVMBuildFPExt(b, f, LLVMTypeOf(d), "");
  LLVMValueRef keep = LLVMBuildFCmp(b, LLVMRealUEQ, back, d, ""); /* exact, or NaN */
  LLVMTypeRef dt = LLVMTypeOf(d);
  LLVMValueRef away = LLVMBuildFCmp(b, LLVMRealOGT, call_overloaded(b, "llvm.fabs", &dt, 1, back),
                                    call_overloaded(b, "llvm.fabs", &dt, 1, d), "");
  LLVMValueRef u = LLVMBuildSub(b, LLVMBuildBitCast(b, f, i32, ""), LLVMBuildZExt(b, away, i32, ""), "");
  u = LLVMBuildOr(b, u, uconst_of(u, 1), "");
  return LLVMBuildSelect(b, keep, f, LLVMBuildBitCast(b, u, f32, ""), "");
}

LLVMValueRef cg_convert(LLVMBuilderRef b, LLVMValueRef v, kiln_dtype from, kiln_dtype to) {
  /* to a narrow dtype: the node's value is rounded to it where lower.c emits it */
  if (dtype_wide(from) == dtype_wide(to)) return v;
  LLVMTypeRef t = shaped(v, elem_of(ctx_of(v), to));
  if (to == KILN_BOOL) {
    LLVMValueRef nz = is_float(from) ? LLVMBuildFCmp(b, LLVMRealUNE, v, const_like(v, from, 0), "")
                                     : LLVMBuildICmp(b, LLVMIntNE, v, const_like(v, from, 0), "");
    return LLVMBuildZExt(b, nz, t, "");
  }
  if (from == KILN_BOOL) return is_float(to) ? LLVMBuildUIToFP(b, v, t, "") : LLVMBuildZExt(b, v, t, "");
  if (from == KILN_F64 && (to == KILN_F16 || to == KILN_BF16)) return f64_to_f32_odd(b, v, t);
  if (is_float(from) && is_float(to)) return to == KILN_F64 ? LLVMBuildFPExt(b, v, t, "") : LLVMBuildFPTrunc(b, v, t, "");
  /* i32, computed as i64: saturated at i32's range, then widened */
  if (is_float(from) && to == KILN_I32)
    return LLVMBuildSExt(b, fptosi_sat(b, v, shaped(v, LLVMInt32TypeInContext(ctx_of(v)))), t, "");
  if (is_float(from)) return fptosi_sat(b, v, t);
  return LLVMBuildSIToFP(b, v, t, "");
}

/* ---- f16 and bf16 bits, the steps of eager/half.h ---- */

/* Unsigned constant u of integer type t in the shape of v. */
static LLVMValueRef uconst(LLVMValueRef v, LLVMTypeRef t, unsigned long long u) {
  LLVMValueRef s = LLVMConstInt(t, u, 0);
  LLVMTypeRef vt = LLVMTypeOf(v);
  if (LLVMGetTypeKind(vt) != LLVMVectorTypeKind) return s;
  unsigned n = LLVMGetVectorSize(vt);
  LLVMValueRef lanes[64];
  for (unsigned i = 0; i < n && i < 64; i++) lanes[i] = s;
  return LLVMConstVector(lanes, n);
}

LLVMValueRef cg_narrow_load(LLVMBuilderRef b, LLVMValueRef h, kiln_dtype dt) {
  LLVMContextRef c = ctx_of(h);
  LLVMTypeRef i32 = LLVMInt32TypeInContext(c), f32 = LLVMFloatTypeInContext(c);
  if (dt == KILN_I32) return LLVMBuildSExt(b, h, shaped(h, LLVMInt64TypeInContext(c)), "");
  LLVMValueRef x = LLVMBuildZExt(b, h, shaped(h, i32), "");
#define K(u) uconst(x, i32, (u))
  if (dt == KILN_BF16) return LLVMBuildBitCast(b, LLVMBuildShl(b, x, K(16), ""), shaped(h, f32), "");
  LLVMValueRef o = LLVMBuildShl(b, LLVMBuildAnd(b, x, K(0x7fff), ""), K(13), "");
  LLVMValueRef exp = LLVMBuildAnd(b, o, K(0x0f800000u), "");
  o = LLVMBuildAdd(b, o, K(112u << 23), "");
  LLVMValueRef infnan = LLVMBuildAdd(b, o, K(112u << 23), "");
  LLVMValueRef magic = LLVMBuildBitCast(b, K(113u << 23), shaped(h, f32), "");
  LLVMValueRef den = LLVMBuildFSub(b, LLVMBuildBitCast(b, LLVMBuildAdd(b, o, K(1u << 23), ""), shaped(h, f32), ""), magic, "");
  den = LLVMBuildBitCast(b, den, shaped(h, i32), "");
  LLVMValueRef r = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntEQ, exp, K(0), ""), den, o, "");
  r = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntEQ, exp, K(0x0f800000u), ""), infnan, r, "");
  r = LLVMBuildOr(b, r, LLVMBuildShl(b, LLVMBuildAnd(b, x, K(0x8000), ""), K(16), ""), "");
  return LLVMBuildBitCast(b, r, shaped(h, f32), "");
#undef K
}

LLVMValueRef cg_narrow_store(LLVMBuilderRef b, LLVMValueRef v, kiln_dtype dt) {
  LLVMContextRef c = ctx_of(v);
  LLVMTypeRef i32 = LLVMInt32TypeInContext(c), i16 = LLVMInt16TypeInContext(c), f32 = LLVMFloatTypeInContext(c);
  if (dt == KILN_I32) return LLVMBuildTrunc(b, v, shaped(v, i32), "");
  LLVMValueRef u = LLVMBuildBitCast(b, v, shaped(v, i32), "");
#define K(x) uconst(u, i32, (x))
  if (dt == KILN_BF16) {
    LLVMValueRef nan = LLVMBuildICmp(b, LLVMIntUGT, LLVMBuildAnd(b, u, K(0x7fffffffu), ""), K(0x7f800000u), "");
    LLVMValueRef hi = LLVMBuildLShr(b, u, K(16), "");
    LLVMValueRef rn = LLVMBuildLShr(b, LLVMBuildAdd(b, LLVMBuildAdd(b, u, K(0x7fff), ""), LLVMBuildAnd(b, hi, K(1), ""), ""), K(16), "");
    return LLVMBuildTrunc(b, LLVMBuildSelect(b, nan, LLVMBuildOr(b, hi, K(0x40), ""), rn, ""), shaped(v, i16), "");
  }
  LLVMValueRef sign = LLVMBuildAnd(b, u, K(0x80000000u), ""), a = LLVMBuildXor(b, u, sign, "");
  LLVMValueRef big = LLVMBuildOr(b, K(0x7e00), LLVMBuildAnd(b, LLVMBuildLShr(b, a, K(13), ""), K(0x3ff), ""), "");
  big = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntUGT, a, K(0x7f800000u), ""), big, K(0x7c00), "");
  LLVMValueRef half = LLVMBuildBitCast(b, K(126u << 23), shaped(v, f32), "");
  LLVMValueRef small = LLVMBuildFAdd(b, LLVMBuildBitCast(b, a, shaped(v, f32), ""), half, "");
  small = LLVMBuildSub(b, LLVMBuildBitCast(b, small, shaped(v, i32), ""), K(126u << 23), "");
  LLVMValueRef odd = LLVMBuildAnd(b, LLVMBuildLShr(b, a, K(13), ""), K(1), "");
  LLVMValueRef norm = LLVMBuildAdd(b, LLVMBuildAdd(b, a, K(((uint32_t)(15 - 127) << 23) + 0xfffu), ""), odd, "");
  norm = LLVMBuildLShr(b, norm, K(13), "");
  LLVMValueRef o = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntULT, a, K(113u << 23), ""), small, norm, "");
  o = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntUGE, a, K(143u << 23), ""), big, o, "");
  o = LLVMBuildOr(b, o, LLVMBuildLShr(b, sign, K(16), ""), "");
  return LLVMBuildTrunc(b, o, shaped(v, i16), "");
#undef K
}

/* ---- the emitters ops.def names ---- */

#define A (e->v[0])
#define B (e->v[1])
#define FL is_float(e->it)

static LLVMValueRef em_add(const cg_emit *e) { return FL ? LLVMBuildFAdd(e->b, A, B, "") : LLVMBuildAdd(e->b, A, B, ""); }
static LLVMValueRef em_sub(const cg_emit *e) { return FL ? LLVMBuildFSub(e->b, A, B, "") : LLVMBuildSub(e->b, A, B, ""); }
static LLVMValueRef em_mul(const cg_emit *e) { return FL ? LLVMBuildFMul(e->b, A, B, "") : LLVMBuildMul(e->b, A, B, ""); }
static LLVMValueRef em_div(const cg_emit *e) { return LLVMBuildFDiv(e->b, A, B, ""); }

static LLVMValueRef em_pow(const cg_emit *e) {
  /* small constant exponents as products: exact, as eager computes them */
  if (e->b_const && e->b_value == 2.0) return LLVMBuildFMul(e->b, A, A, "");
  if (e->b_const && e->b_value == 3.0) return LLVMBuildFMul(e->b, LLVMBuildFMul(e->b, A, A, ""), A, "");
  if (e->b_const && e->b_value == 1.0) return A;
  return intrinsic(e, "llvm.pow", LLVMTypeOf(A), (LLVMValueRef[]){A, B}, 2);
}

static LLVMValueRef em_maximum(const cg_emit *e) { return cg_maxnan(e->b, e->it, A, B, true); }
static LLVMValueRef em_minimum(const cg_emit *e) { return cg_maxnan(e->b, e->it, A, B, false); }

static LLVMValueRef em_compare(const cg_emit *e) {
  static const LLVMRealPredicate fp[] = {LLVMRealOEQ, LLVMRealUNE, LLVMRealOLT, LLVMRealOLE, LLVMRealOGT, LLVMRealOGE};
  static const LLVMIntPredicate ip[] = {LLVMIntEQ, LLVMIntNE, LLVMIntSLT, LLVMIntSLE, LLVMIntSGT, LLVMIntSGE};
  int k;
  switch (e->op) {
  case OP_EQ: k = 0; break;
  case OP_NE: k = 1; break;
  case OP_LT: k = 2; break;
  case OP_LE: k = 3; break;
  case OP_GT: k = 4; break;
  default: k = 5; break;
  }
  LLVMValueRef c = FL ? LLVMBuildFCmp(e->b, fp[k], A, B, "") : LLVMBuildICmp(e->b, ip[k], A, B, "");
  return LLVMBuildZExt(e->b, c, shaped(A, elem_of(ctx_of(A), KILN_BOOL)), "");
}

static LLVMValueRef em_where(const cg_emit *e) {
  LLVMValueRef c = LLVMBuildICmp(e->b, LLVMIntNE, e->v[0], const_like(e->v[0], KILN_BOOL, 0), "");
  return LLVMBuildSelect(e->b, c, e->v[1], e->v[2], "");
}

static LLVMValueRef em_neg(const cg_emit *e) { return FL ? LLVMBuildFNeg(e->b, A, "") : LLVMBuildNeg(e->b, A, ""); }

static LLVMValueRef em_abs(const cg_emit *e) {
  if (FL) return intrinsic(e, "llvm.fabs", LLVMTypeOf(A), (LLVMValueRef[]){A}, 1);
  return LLVMBuildSelect(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, A, const_like(A, e->it, 0), ""), LLVMBuildNeg(e->b, A, ""), A, "");
}

static LLVMValueRef em_relu(const cg_emit *e) {
  LLVMValueRef zero = const_like(A, e->it, 0);
  if (FL) return LLVMBuildSelect(e->b, LLVMBuildFCmp(e->b, LLVMRealUGT, A, zero, ""), A, zero, "");
  return LLVMBuildSelect(e->b, LLVMBuildICmp(e->b, LLVMIntSGT, A, zero, ""), A, zero, "");
}

/* floor, ceil, round (half to even); integers are whole already */
static LLVMValueRef em_rounding(const cg_emit *e) {
  if (!FL) return A;
  const char *name = e->op == OP_FLOOR ? "llvm.floor" : e->op == OP_CEIL ? "llvm.ceil" : "llvm.roundeven";
  return intrinsic(e, name, LLVMTypeOf(A), (LLVMValueRef[]){A}, 1);
}

/* (x > 0) - (x < 0): nan gives 0, as eager */
static LLVMValueRef em_sign(const cg_emit *e) {
  LLVMValueRef zero = const_like(A, e->it, 0);
  LLVMValueRef pos = FL ? LLVMBuildFCmp(e->b, LLVMRealOGT, A, zero, "") : LLVMBuildICmp(e->b, LLVMIntSGT, A, zero, "");
  LLVMValueRef neg = FL ? LLVMBuildFCmp(e->b, LLVMRealOLT, A, zero, "") : LLVMBuildICmp(e->b, LLVMIntSLT, A, zero, "");
  return LLVMBuildSelect(e->b, pos, const_like(A, e->it, 1), LLVMBuildSelect(e->b, neg, const_like(A, e->it, -1), zero, ""), "");
}

/* y = max(x, lo), then min(y, hi) (hi wins when lo > hi, as torch; nan passes), the bounds in x's dtype as eager converts them */
static LLVMValueRef em_clamp(const cg_emit *e) {
  if (!FL) {
    LLVMTypeRef t = LLVMInt64TypeInContext(ctx_of(A));
    LLVMValueRef lo = LLVMConstInt(t, (unsigned long long)pw_bound_i64(e->num[0]), 1);
    LLVMValueRef hi = LLVMConstInt(t, (unsigned long long)pw_bound_i64(e->num[1]), 1);
    if (LLVMGetTypeKind(LLVMTypeOf(A)) == LLVMVectorTypeKind) {
      unsigned n = LLVMGetVectorSize(LLVMTypeOf(A));
      LLVMValueRef l[64], h[64];
      for (unsigned i = 0; i < n && i < 64; i++) l[i] = lo, h[i] = hi;
      lo = LLVMConstVector(l, n), hi = LLVMConstVector(h, n);
    }
    LLVMValueRef y = LLVMBuildSelect(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, A, lo, ""), lo, A, "");
    return LLVMBuildSelect(e->b, LLVMBuildICmp(e->b, LLVMIntSGT, y, hi, ""), hi, y, "");
  }
  /* f32 bounds rounded to f32 first, as the eager loop does */
  double lo = e->it == KILN_F32 ? (double)(float)e->num[0] : e->num[0];
  double hi = e->it == KILN_F32 ? (double)(float)e->num[1] : e->num[1];
  LLVMValueRef l = const_like(A, e->it, lo), h = const_like(A, e->it, hi);
  LLVMValueRef y = LLVMBuildSelect(e->b, LLVMBuildFCmp(e->b, LLVMRealOLT, A, l, ""), l, A, "");
  return LLVMBuildSelect(e->b, LLVMBuildFCmp(e->b, LLVMRealOGT, y, h, ""), h, y, "");
}

static LLVMValueRef em_leaky_relu(const cg_emit *e) {
  double k = e->it == KILN_F32 ? (double)(float)e->num[0] : e->num[0];
  LLVMValueRef pos = LLVMBuildFCmp(e->b, LLVMRealOGT, A, const_like(A, e->it, 0), "");
  return LLVMBuildSelect(e->b, pos, A, LLVMBuildFMul(e->b, A, const_like(A, e->it, k), ""), "");
}

static LLVMValueRef em_cast(const cg_emit *e) { return cg_convert(e->b, A, e->it, e->cast_to); }
static LLVMValueRef em_copy(const cg_emit *e) { return A; }
static LLVMValueRef em_vmath(const cg_emit *e) { return vmath_emit(e->b, e->op, A); }

#undef A
#undef B
#undef FL

#define NONE NULL
static const cg_emit_fn emitters[OP_COUNT] = {
#define X(id, name, arity, kind, attrs, dtype, shape, kernel, check, backward, saves, cg, cost, emit) [OP_##id] = emit,
#include "eager/ops.def"
#undef X
};
#undef NONE

#ifdef KILN_TEST_BUILD
static _Atomic bool dropped[OP_COUNT];
void cg_test_drop_emitter(int op, bool drop) {
  if (op >= 0 && op < OP_COUNT) dropped[op] = drop;
}
#endif

cg_emit_fn cg_emitter(int op) {
  if (op < 0 || op >= OP_COUNT) return NULL;
#ifdef KILN_TEST_BUILD
  if (dropped[op]) return NULL;
#endif
  return emitters[op];
}
