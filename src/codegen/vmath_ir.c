/* vmath_ir.c - the vector math of src/eager/vmath.h, emitted as LLVM IR for
 * the lowering. The f32 functions are the same algorithms step for step (same
 * polynomials, range reductions, f64 steps and special-value selects), as
 * straight-line arithmetic, compares, selects, bit casts and integer ops: no
 * calls and no branches, so the loop vectorizer widens a loop that uses them,
 * and no fast-math flags, so compiled code matches eager to the last bit
 * (tests/test_jit.c checks both the accuracy and the match). The f64 functions
 * are the careful path, as in eager: LLVM's intrinsics for exp, log, sin, cos
 * and sqrt (libm underneath), libm's tanh, erf and erfc, and the same stable
 * forms for sigmoid and the GELUs. x may be a scalar or a fixed vector. */
#include <math.h>
#include <string.h>

#include "codegen/codegen.h"

/* Where the emitted code goes and the types shaped like x (vectors of as many
 * lanes as x when x is a vector). */
typedef struct vm {
  LLVMBuilderRef b;
  LLVMModuleRef mod;
  LLVMContextRef ctx;
  unsigned lanes; /* 0 for a scalar x */
  LLVMTypeRef f32, i32, f64, i64;
} vm;

static LLVMTypeRef shaped(const vm *v, LLVMTypeRef elem) { return v->lanes ? LLVMVectorType(elem, v->lanes) : elem; }

/* A constant with c in every lane. */
static LLVMValueRef splat(const vm *v, LLVMValueRef c) {
  if (!v->lanes) return c;
  LLVMValueRef lane[64];
  KILN_ASSERT(v->lanes <= 64);
  for (unsigned i = 0; i < v->lanes; i++) lane[i] = c;
  return LLVMConstVector(lane, v->lanes);
}

/* Float constants are passed as C floats, so the C compiler rounds their
 * literals exactly as it does in vmath.h. */
static LLVMValueRef kf(const vm *v, float c) { return splat(v, LLVMConstReal(LLVMFloatTypeInContext(v->ctx), c)); }
static LLVMValueRef kd(const vm *v, double c) { return splat(v, LLVMConstReal(LLVMDoubleTypeInContext(v->ctx), c)); }
static LLVMValueRef ki(const vm *v, uint32_t c) {
  return splat(v, LLVMConstInt(LLVMInt32TypeInContext(v->ctx), c, 0));
}
static LLVMValueRef kl(const vm *v, uint64_t c) {
  return splat(v, LLVMConstInt(LLVMInt64TypeInContext(v->ctx), c, 0));
}

static LLVMValueRef add(const vm *v, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildFAdd(v->b, a, b, ""); }
static LLVMValueRef sub(const vm *v, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildFSub(v->b, a, b, ""); }
static LLVMValueRef mul(const vm *v, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildFMul(v->b, a, b, ""); }
static LLVMValueRef fdiv(const vm *v, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildFDiv(v->b, a, b, ""); }
static LLVMValueRef neg(const vm *v, LLVMValueRef a) { return LLVMBuildFNeg(v->b, a, ""); }
/* p * x + c, the step of a Horner polynomial (two roundings, as in C) */
static LLVMValueRef horner(const vm *v, LLVMValueRef p, LLVMValueRef x, LLVMValueRef c) {
  return add(v, mul(v, p, x), c);
}

static LLVMValueRef lt(const vm *v, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildFCmp(v->b, LLVMRealOLT, a, b, ""); }
static LLVMValueRef gt(const vm *v, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildFCmp(v->b, LLVMRealOGT, a, b, ""); }
static LLVMValueRef ge(const vm *v, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildFCmp(v->b, LLVMRealOGE, a, b, ""); }
static LLVMValueRef eq(const vm *v, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildFCmp(v->b, LLVMRealOEQ, a, b, ""); }
static LLVMValueRef is_nan(const vm *v, LLVMValueRef a) { return LLVMBuildFCmp(v->b, LLVMRealUNO, a, a, ""); }
static LLVMValueRef sel(const vm *v, LLVMValueRef c, LLVMValueRef a, LLVMValueRef b) {
  return LLVMBuildSelect(v->b, c, a, b, "");
}

static LLVMValueRef bits(const vm *v, LLVMValueRef x) { return LLVMBuildBitCast(v->b, x, v->i32, ""); }
static LLVMValueRef flt(const vm *v, LLVMValueRef u) { return LLVMBuildBitCast(v->b, u, v->f32, ""); }
static LLVMValueRef to_f64(const vm *v, LLVMValueRef x) { return LLVMBuildFPExt(v->b, x, v->f64, ""); }
static LLVMValueRef to_f32(const vm *v, LLVMValueRef x) { return LLVMBuildFPTrunc(v->b, x, v->f32, ""); }

/* |x| and |x| with the sign of s, on the bits (vm__abs, vm__copysign) */
static LLVMValueRef abs_bits(const vm *v, LLVMValueRef x) {
  return flt(v, LLVMBuildAnd(v->b, bits(v, x), ki(v, 0x7fffffffu), ""));
}
static LLVMValueRef copysign_bits(const vm *v, LLVMValueRef x, LLVMValueRef s) {
  LLVMValueRef mag = LLVMBuildAnd(v->b, bits(v, x), ki(v, 0x7fffffffu), "");
  LLVMValueRef sign = LLVMBuildAnd(v->b, bits(v, s), ki(v, 0x80000000u), "");
  return flt(v, LLVMBuildOr(v->b, mag, sign, ""));
}

/* ---- f32: vmath.h, function by function ---------------------------------- */

#define ROUND 12582912.0f /* VM__ROUND, 1.5 * 2^23 */
#define ROUND_BITS 0x4b400000u

static LLVMValueRef exp2_core(const vm *v, LLVMValueRef h, LLVMValueRef lo);

/* vm__exp_poly: P with e^r = 1 + r + r^2 P(r) */
static LLVMValueRef exp_poly(const vm *v, LLVMValueRef r) {
  LLVMValueRef p = kf(v, 1.9875691500e-4f);
  p = horner(v, p, r, kf(v, 1.3981999507e-3f));
  p = horner(v, p, r, kf(v, 8.3334519073e-3f));
  p = horner(v, p, r, kf(v, 4.1665795894e-2f));
  p = horner(v, p, r, kf(v, 1.6666665459e-1f));
  return horner(v, p, r, kf(v, 5.0000001201e-1f));
}

/* vm__exp2: exp(hi + lo), hi clamped to [-104, 88.8]; lanes below -150 ln2
 * compute e^0 and give 0, with no subnormal product (a microcode assist). */
static LLVMValueRef exp2_hl(const vm *v, LLVMValueRef hi, LLVMValueRef lo) {
  LLVMValueRef dead = lt(v, hi, kf(v, -103.9721f));
  LLVMValueRef h = sel(v, lt(v, hi, kf(v, 88.8f)), hi, kf(v, 88.8f));
  h = sel(v, gt(v, h, kf(v, -104.0f)), h, kf(v, -104.0f));
  h = sel(v, dead, kf(v, 0.0f), h);
  return sel(v, dead, kf(v, 0.0f), exp2_core(v, h, lo));
}

/* The same steps on an h already within the clamps. */
static LLVMValueRef exp2_core(const vm *v, LLVMValueRef h, LLVMValueRef lo) {
  LLVMValueRef t = add(v, mul(v, add(v, h, lo), kf(v, 1.44269504f)), kf(v, ROUND));
  LLVMValueRef n = sub(v, t, kf(v, ROUND));
  LLVMValueRef ni = LLVMBuildSub(v->b, bits(v, t), ki(v, ROUND_BITS), "");
  LLVMValueRef r = sub(v, add(v, sub(v, h, mul(v, n, kf(v, 0.693359375f))), lo), mul(v, n, kf(v, -2.12194440e-4f)));
  LLVMValueRef p = add(v, add(v, mul(v, exp_poly(v, r), mul(v, r, r)), r), kf(v, 1.0f));
  /* 2^n as two normal factors */
  LLVMValueRef n1 = LLVMBuildSDiv(v->b, ni, ki(v, 2), "");
  LLVMValueRef n2 = LLVMBuildSub(v->b, ni, n1, "");
  LLVMValueRef s1 = flt(v, LLVMBuildShl(v->b, LLVMBuildAdd(v->b, n1, ki(v, 127), ""), ki(v, 23), ""));
  LLVMValueRef s2 = flt(v, LLVMBuildShl(v->b, LLVMBuildAdd(v->b, n2, ki(v, 127), ""), ki(v, 23), ""));
  return mul(v, mul(v, p, s1), s2);
}

static LLVMValueRef exp_f32(const vm *v, LLVMValueRef x) {
  return sel(v, is_nan(v, x), x, exp2_hl(v, x, kf(v, -0.0f)));
}

static LLVMValueRef log_f32(const vm *v, LLVMValueRef x) {
  LLVMValueRef subnormal = lt(v, x, kf(v, 1.17549435e-38f));
  LLVMValueRef xs = sel(v, subnormal, mul(v, x, kf(v, 8388608.0f)), x);
  LLVMValueRef ix = LLVMBuildAdd(v->b, bits(v, xs), ki(v, 0x3f800000u - 0x3f3504f3u), "");
  LLVMValueRef kint = LLVMBuildSub(v->b, LLVMBuildLShr(v->b, ix, ki(v, 23), ""), ki(v, 127), "");
  kint = LLVMBuildSub(v->b, kint, sel(v, subnormal, ki(v, 23), ki(v, 0)), "");
  LLVMValueRef k = LLVMBuildSIToFP(v->b, kint, v->f32, "");
  LLVMValueRef f =
      sub(v, flt(v, LLVMBuildAdd(v->b, LLVMBuildAnd(v->b, ix, ki(v, 0x007fffffu), ""), ki(v, 0x3f3504f3u), "")),
          kf(v, 1.0f));
  LLVMValueRef z = mul(v, f, f);
  LLVMValueRef p = kf(v, 7.0376836292e-2f);
  p = horner(v, p, f, kf(v, -1.1514610310e-1f));
  p = horner(v, p, f, kf(v, 1.1676998740e-1f));
  p = horner(v, p, f, kf(v, -1.2420140846e-1f));
  p = horner(v, p, f, kf(v, 1.4249322787e-1f));
  p = horner(v, p, f, kf(v, -1.6668057665e-1f));
  p = horner(v, p, f, kf(v, 2.0000714765e-1f));
  p = horner(v, p, f, kf(v, -2.4999993993e-1f));
  p = horner(v, p, f, kf(v, 3.3333331174e-1f));
  LLVMValueRef y = sub(v, add(v, mul(v, mul(v, f, z), p), mul(v, k, kf(v, -2.12194440e-4f))), mul(v, kf(v, 0.5f), z));
  LLVMValueRef r = add(v, add(v, f, y), mul(v, k, kf(v, 0.693359375f)));
  r = sel(v, eq(v, x, kf(v, INFINITY)), x, r);
  r = sel(v, eq(v, x, kf(v, 0.0f)), kf(v, -INFINITY), r);
  r = sel(v, lt(v, x, kf(v, 0.0f)), kf(v, NAN), r);
  return sel(v, is_nan(v, x), x, r);
}

static LLVMValueRef sigmoid_f32(const vm *v, LLVMValueRef x) {
  LLVMValueRef e = exp_f32(v, neg(v, abs_bits(v, x)));
  return fdiv(v, sel(v, ge(v, x, kf(v, 0.0f)), kf(v, 1.0f), e), add(v, kf(v, 1.0f), e));
}

/* vm__expm1_2x: e^2a - 1 for a in [0, 10], P in Estrin's order; t's bits
 * shifted are 2^n */
static LLVMValueRef expm1_2x(const vm *v, LLVMValueRef a) {
  LLVMValueRef t = add(v, mul(v, a, kf(v, 2.88539008f)), kf(v, ROUND + 127.0f));
  LLVMValueRef n = sub(v, t, kf(v, ROUND + 127.0f));
  LLVMValueRef r = sub(v, sub(v, add(v, a, a), mul(v, n, kf(v, 0.693359375f))), mul(v, n, kf(v, -2.12194440e-4f)));
  LLVMValueRef r2 = mul(v, r, r);
  LLVMValueRef p01 = add(v, kf(v, 4.9999997020e-1f), mul(v, kf(v, 1.6666543484e-1f), r));
  LLVMValueRef p23 = add(v, kf(v, 4.1667200625e-2f), mul(v, kf(v, 8.3665214479e-3f), r));
  LLVMValueRef p = add(v, add(v, p01, mul(v, r2, p23)), mul(v, mul(v, r2, r2), kf(v, 1.3882510830e-3f)));
  LLVMValueRef s = flt(v, LLVMBuildShl(v->b, bits(v, t), ki(v, 23), ""));
  return add(v, mul(v, s, add(v, mul(v, p, r2), r)), sub(v, s, kf(v, 1.0f)));
}

/* vm_tanhf: m / (m + 2), m = e^2|x| - 1, |x| capped at 10 (nan passes) */
static LLVMValueRef tanh_f32(const vm *v, LLVMValueRef x) {
  LLVMValueRef a = abs_bits(v, x);
  LLVMValueRef m = expm1_2x(v, sel(v, gt(v, a, kf(v, 10.0f)), kf(v, 10.0f), a));
  return copysign_bits(v, fdiv(v, m, add(v, m, kf(v, 2.0f))), x);
}

/* vm__erf_small: erf(x)/x - 1 for z = x*x <= 0.25 */
static LLVMValueRef erf_small(const vm *v, LLVMValueRef z) {
  LLVMValueRef p = kf(v, 4.71908257e-3f);
  p = horner(v, p, z, kf(v, -2.67577327e-2f));
  p = horner(v, p, z, kf(v, 1.12828314e-1f));
  p = horner(v, p, z, kf(v, -3.76126090e-1f));
  p = horner(v, p, z, kf(v, 1.28379166e-1f));
  return p;
}

/* vm__erfc_tail: scale * erfc(t) for t in [0.5, 10.5]; t, t2 = t*t and scale
 * in f64, the result in f32. */
static LLVMValueRef erfc_tail(const vm *v, LLVMValueRef t, LLVMValueRef t2, LLVMValueRef scale) {
  LLVMValueRef u = fdiv(v, kd(v, 1.0), add(v, kd(v, 1.0), mul(v, kd(v, 0.5), t)));
  LLVMValueRef p = kd(v, 0.26450133617389646);
  p = horner(v, p, u, kd(v, -1.2395561333502182));
  p = horner(v, p, u, kd(v, 2.2845317557210112));
  p = horner(v, p, u, kd(v, -1.9830956021617332));
  p = horner(v, p, u, kd(v, 0.83156612999604854));
  p = horner(v, p, u, kd(v, -0.41351994969075458));
  p = horner(v, p, u, kd(v, 0.15535472974160286));
  p = horner(v, p, u, kd(v, 0.36500632299409769));
  p = horner(v, p, u, kd(v, 1.0007927710692577));
  p = horner(v, p, u, kd(v, -1.2655394594966286));
  LLVMValueRef e = add(v, sub(v, p, t2), kd(v, 44.361419555836499803));
  LLVMValueRef hi = to_f32(v, e);
  LLVMValueRef lo = to_f32(v, sub(v, e, to_f64(v, hi)));
  LLVMValueRef s = mul(v, mul(v, mul(v, scale, kd(v, 0x1p-64)), u), to_f64(v, exp2_hl(v, hi, lo)));
  return to_f32(v, s);
}

static LLVMValueRef erf_f32(const vm *v, LLVMValueRef x) {
  LLVMValueRef a = abs_bits(v, x);
  LLVMValueRef small = add(v, x, mul(v, x, erf_small(v, mul(v, x, x))));
  LLVMValueRef ad = to_f64(v, sel(v, lt(v, a, kf(v, 10.5f)), a, kf(v, 10.5f)));
  LLVMValueRef big = copysign_bits(v, sub(v, kf(v, 1.0f), erfc_tail(v, ad, mul(v, ad, ad), kd(v, 1.0))), x);
  LLVMValueRef r = sel(v, lt(v, a, kf(v, 0.5f)), small, big);
  r = sel(v, eq(v, x, kf(v, 0.0f)), x, r);
  return sel(v, is_nan(v, x), x, r);
}

/* vm__reduce_pio2: r in about [-pi/4, pi/4], the quadrant in *q (i32) */
static LLVMValueRef reduce_pio2(const vm *v, LLVMValueRef x, LLVMValueRef *q) {
  LLVMValueRef t = add(v, mul(v, x, kf(v, 0.636619772f)), kf(v, ROUND));
  LLVMValueRef j = sub(v, t, kf(v, ROUND));
  *q = LLVMBuildSub(v->b, bits(v, t), ki(v, ROUND_BITS), "");
  LLVMValueRef r = sub(v, x, mul(v, j, kf(v, 1.5703125f)));
  r = sub(v, r, mul(v, j, kf(v, 4.837512969970703125e-4f)));
  r = sub(v, r, mul(v, j, kf(v, 7.54953362047672271728515625e-8f)));
  r = sub(v, r, mul(v, j, kf(v, 2.5632829393076035194098949432373046875e-12f)));
  r = sub(v, r, mul(v, j, kf(v, 6.12323426292737821433955307425e-17f)));
  r = sel(v, gt(v, r, kf(v, 0.8f)), kf(v, 0.8f), r);
  return sel(v, lt(v, r, kf(v, -0.8f)), kf(v, -0.8f), r);
}

static LLVMValueRef sin_poly(const vm *v, LLVMValueRef r) {
  LLVMValueRef z = mul(v, r, r);
  LLVMValueRef p = kf(v, -1.9515295891e-4f);
  p = horner(v, p, z, kf(v, 8.3321608736e-3f));
  p = horner(v, p, z, kf(v, -1.6666654611e-1f));
  return add(v, r, mul(v, mul(v, r, z), p));
}

static LLVMValueRef cos_poly(const vm *v, LLVMValueRef r) {
  LLVMValueRef z = mul(v, r, r);
  LLVMValueRef p = kf(v, 2.443315711809948e-5f);
  p = horner(v, p, z, kf(v, -1.388731625493765e-3f));
  p = horner(v, p, z, kf(v, 4.166664568298827e-2f));
  return add(v, sub(v, kf(v, 1.0f), mul(v, kf(v, 0.5f), z)), mul(v, mul(v, z, z), p));
}

/* sin(q*pi/2 + r) */
static LLVMValueRef sin_quadrant(const vm *v, LLVMValueRef r, LLVMValueRef q) {
  LLVMValueRef odd = LLVMBuildICmp(v->b, LLVMIntNE, LLVMBuildAnd(v->b, q, ki(v, 1), ""), ki(v, 0), "");
  LLVMValueRef s = sel(v, odd, cos_poly(v, r), sin_poly(v, r));
  LLVMValueRef sign = LLVMBuildShl(v->b, LLVMBuildAnd(v->b, q, ki(v, 2), ""), ki(v, 30), "");
  return flt(v, LLVMBuildXor(v->b, bits(v, s), sign, ""));
}

static LLVMValueRef sin_f32(const vm *v, LLVMValueRef x) {
  LLVMValueRef q;
  LLVMValueRef r = reduce_pio2(v, x, &q);
  return sel(v, eq(v, x, kf(v, 0.0f)), x, sin_quadrant(v, r, q));
}

static LLVMValueRef cos_f32(const vm *v, LLVMValueRef x) {
  LLVMValueRef q;
  LLVMValueRef r = reduce_pio2(v, x, &q);
  return sin_quadrant(v, r, LLVMBuildAdd(v->b, q, ki(v, 1), ""));
}

/* clamp x to [-c, c] the way vmath.h does (a nan becomes c) */
static LLVMValueRef clampf(const vm *v, LLVMValueRef x, float c) {
  LLVMValueRef r = sel(v, lt(v, x, kf(v, c)), x, kf(v, c));
  return sel(v, gt(v, r, kf(v, -c)), r, kf(v, -c));
}

/* vm__x_sigmoid: x * sigmoid(s), s (f64) of x's sign */
static LLVMValueRef x_sigmoid(const vm *v, LLVMValueRef x, LLVMValueRef s) {
  LLVMValueRef negabs = LLVMBuildOr(v->b, LLVMBuildBitCast(v->b, s, v->i64, ""), kl(v, 0x8000000000000000u), "");
  LLVMValueRef ns = add(v, LLVMBuildBitCast(v->b, negabs, v->f64, ""), kd(v, 44.361419555836499803));
  LLVMValueRef hi = to_f32(v, ns);
  LLVMValueRef lo = to_f32(v, sub(v, ns, to_f64(v, hi)));
  LLVMValueRef e64 = exp2_hl(v, hi, lo);
  LLVMValueRef e = mul(v, e64, kf(v, 0x1p-64f));
  LLVMValueRef num = sel(v, ge(v, x, kf(v, 0.0f)), x, mul(v, mul(v, x, e64), kf(v, 0x1p-64f)));
  return fdiv(v, num, add(v, kf(v, 1.0f), e));
}

static LLVMValueRef gelu_f32(const vm *v, LLVMValueRef x) {
  LLVMValueRef xd = to_f64(v, clampf(v, x, 20.0f));
  LLVMValueRef s = mul(v, xd, add(v, kd(v, 1.5957691216057308), mul(v, kd(v, 0.07135481627260025), mul(v, xd, xd))));
  LLVMValueRef g = sel(v, eq(v, x, kf(v, -INFINITY)), kf(v, -0.0f), x_sigmoid(v, x, s));
  return sel(v, is_nan(v, x), x, g);
}

static LLVMValueRef gelu_erf_f32(const vm *v, LLVMValueRef x) {
  LLVMValueRef t = mul(v, abs_bits(v, x), kf(v, 0.707106781f));
  LLVMValueRef small = add(v, mul(v, t, erf_small(v, mul(v, t, t))), t);
  LLVMValueRef xc = clampf(v, x, 14.84f);
  LLVMValueRef xd = to_f64(v, xc);
  LLVMValueRef pos = ge(v, x, kf(v, 0.0f));
  LLVMValueRef scale = sel(v, pos, kf(v, 1.0f), mul(v, kf(v, 0.5f), xc));
  LLVMValueRef tail = erfc_tail(v, mul(v, to_f64(v, abs_bits(v, xc)), kd(v, 0.70710678118654752)),
                                mul(v, mul(v, kd(v, 0.5), xd), xd), to_f64(v, scale));
  LLVMValueRef half_x = mul(v, kf(v, 0.5f), x);
  LLVMValueRef near0 = mul(v, half_x, add(v, kf(v, 1.0f), copysign_bits(v, small, x)));
  LLVMValueRef far = sel(v, pos, mul(v, half_x, sub(v, kf(v, 2.0f), tail)), tail);
  LLVMValueRef g = sel(v, lt(v, t, kf(v, 0.5f)), near0, far);
  g = sel(v, eq(v, x, kf(v, -INFINITY)), kf(v, -0.0f), g);
  return sel(v, is_nan(v, x), x, g);
}

/* vm_log1pf: log(u) + (x - (u - 1)) / u, u = 1 + x */
static LLVMValueRef log1p_f32(const vm *v, LLVMValueRef x) {
  LLVMValueRef one = kf(v, 1.0f);
  LLVMValueRef u = add(v, one, x);
  LLVMValueRef r = add(v, log_f32(v, u), fdiv(v, sub(v, x, sub(v, u, one)), u));
  r = sel(v, eq(v, u, one), x, r);
  r = sel(v, eq(v, x, kf(v, INFINITY)), x, r);
  r = sel(v, eq(v, x, kf(v, -1.0f)), kf(v, -INFINITY), r);
  r = sel(v, lt(v, x, kf(v, -1.0f)), kf(v, NAN), r);
  return sel(v, is_nan(v, x), x, r);
}

/* vm_expm1f: 2^n (e^r - 1) + (2^n - 1) for |x| < 20, else e^x - 1 */
static LLVMValueRef expm1_f32(const vm *v, LLVMValueRef x) {
  LLVMValueRef xc = clampf(v, x, 20.0f);
  LLVMValueRef t = add(v, mul(v, xc, kf(v, 1.44269504f)), kf(v, ROUND));
  LLVMValueRef n = sub(v, t, kf(v, ROUND));
  LLVMValueRef ni = LLVMBuildSub(v->b, bits(v, t), ki(v, ROUND_BITS), "");
  LLVMValueRef r = sub(v, sub(v, xc, mul(v, n, kf(v, 0.693359375f))), mul(v, n, kf(v, -2.12194440e-4f)));
  LLVMValueRef q = add(v, mul(v, exp_poly(v, r), mul(v, r, r)), r);
  LLVMValueRef s = flt(v, LLVMBuildShl(v->b, LLVMBuildAdd(v->b, ni, ki(v, 127), ""), ki(v, 23), ""));
  LLVMValueRef core = add(v, mul(v, s, q), sub(v, s, kf(v, 1.0f)));
  LLVMValueRef big = sub(v, exp_f32(v, x), kf(v, 1.0f));
  LLVMValueRef res = sel(v, lt(v, abs_bits(v, x), kf(v, 20.0f)), core, big);
  res = sel(v, eq(v, x, kf(v, 0.0f)), x, res);
  return sel(v, is_nan(v, x), x, res);
}

/* vm_siluf */
static LLVMValueRef silu_f32(const vm *v, LLVMValueRef x) {
  LLVMValueRef g = x_sigmoid(v, x, to_f64(v, x));
  g = sel(v, eq(v, x, kf(v, -INFINITY)), kf(v, -0.0f), g);
  return sel(v, is_nan(v, x), x, g);
}

/* vm_softplusf: x past 20, else max(x, 0) + log1p(e^-|x|) */
static LLVMValueRef softplus_f32(const vm *v, LLVMValueRef x) {
  LLVMValueRef m = sel(v, gt(v, x, kf(v, 0.0f)), x, kf(v, 0.0f));
  LLVMValueRef r = add(v, m, log1p_f32(v, exp_f32(v, neg(v, abs_bits(v, x)))));
  r = sel(v, gt(v, x, kf(v, 20.0f)), x, r);
  return sel(v, is_nan(v, x), x, r);
}

/* ---- f64 and sqrt: intrinsics and libm -------------------------------------- */

static LLVMValueRef intrinsic(const vm *v, const char *name, LLVMValueRef x) {
  unsigned id = LLVMLookupIntrinsicID(name, strlen(name));
  KILN_ASSERT(id != 0);
  LLVMTypeRef t = LLVMTypeOf(x);
  LLVMValueRef fn = LLVMGetIntrinsicDeclaration(v->mod, id, &t, 1);
  return LLVMBuildCall2(v->b, LLVMIntrinsicGetType(v->ctx, id, &t, 1), fn, &x, 1, "");
}

/* name(x) for a libm function double -> double, lane by lane for a vector
 * (declared without side effects: kiln observes neither errno nor traps). */
static LLVMValueRef libm(const vm *v, const char *name, LLVMValueRef x) {
  LLVMTypeRef d = LLVMDoubleTypeInContext(v->ctx);
  LLVMTypeRef ft = LLVMFunctionType(d, &d, 1, 0);
  LLVMValueRef fn = LLVMGetNamedFunction(v->mod, name);
  if (!fn) {
    fn = LLVMAddFunction(v->mod, name, ft);
    static const char *const attr[] = {"nounwind", "willreturn", "memory"};
    for (int i = 0; i < 3; i++) {
      unsigned kind = LLVMGetEnumAttributeKindForName(attr[i], strlen(attr[i]));
      /* memory(none) is the value 0 */
      LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex, LLVMCreateEnumAttribute(v->ctx, kind, 0));
    }
  }
  if (!v->lanes) return LLVMBuildCall2(v->b, ft, fn, &x, 1, "");
  LLVMValueRef r = LLVMGetPoison(LLVMTypeOf(x));
  for (unsigned i = 0; i < v->lanes; i++) {
    LLVMValueRef idx = LLVMConstInt(LLVMInt32TypeInContext(v->ctx), i, 0);
    LLVMValueRef xi = LLVMBuildExtractElement(v->b, x, idx, "");
    r = LLVMBuildInsertElement(v->b, r, LLVMBuildCall2(v->b, ft, fn, &xi, 1, ""), idx, "");
  }
  return r;
}

/* vm_sigmoid: (x >= 0 ? 1 : e) / (1 + e), e = exp(-|x|) */
static LLVMValueRef sigmoid_f64(const vm *v, LLVMValueRef x) {
  LLVMValueRef e = intrinsic(v, "llvm.exp", neg(v, intrinsic(v, "llvm.fabs", x)));
  return fdiv(v, sel(v, ge(v, x, kd(v, 0.0)), kd(v, 1.0), e), add(v, kd(v, 1.0), e));
}

/* vm_gelu: s = 2u; (s >= 0 ? x : x*e) / (1 + e), e = exp(-|s|); -0 at -inf */
static LLVMValueRef gelu_f64(const vm *v, LLVMValueRef x) {
  LLVMValueRef cube = mul(v, mul(v, mul(v, kd(v, 0.044715), x), x), x);
  LLVMValueRef s = mul(v, kd(v, 1.5957691216057308), add(v, x, cube));
  LLVMValueRef e = intrinsic(v, "llvm.exp", neg(v, intrinsic(v, "llvm.fabs", s)));
  LLVMValueRef g = fdiv(v, sel(v, ge(v, s, kd(v, 0.0)), x, mul(v, x, e)), add(v, kd(v, 1.0), e));
  return sel(v, eq(v, x, kd(v, -INFINITY)), kd(v, -0.0), g);
}

/* vm_silu: (x >= 0 ? x : x*e) / (1 + e), e = exp(-|x|); -0 at -inf */
static LLVMValueRef silu_f64(const vm *v, LLVMValueRef x) {
  LLVMValueRef e = intrinsic(v, "llvm.exp", neg(v, intrinsic(v, "llvm.fabs", x)));
  LLVMValueRef g = fdiv(v, sel(v, ge(v, x, kd(v, 0.0)), x, mul(v, x, e)), add(v, kd(v, 1.0), e));
  return sel(v, eq(v, x, kd(v, -INFINITY)), kd(v, -0.0), g);
}

/* vm_softplus: x past 20 (and nan), else max(x, 0) + log1p(exp(-|x|)) */
static LLVMValueRef softplus_f64(const vm *v, LLVMValueRef x) {
  LLVMValueRef m = sel(v, gt(v, x, kd(v, 0.0)), x, kd(v, 0.0));
  LLVMValueRef r = add(v, m, libm(v, "log1p", intrinsic(v, "llvm.exp", neg(v, intrinsic(v, "llvm.fabs", x)))));
  LLVMValueRef keep = LLVMBuildFCmp(v->b, LLVMRealUGT, x, kd(v, 20.0), ""); /* unordered: nan too */
  return sel(v, keep, x, r);
}

/* vm_gelu_erf: 0.5 * x * erfc(-x / sqrt2); -0 at -inf */
static LLVMValueRef gelu_erf_f64(const vm *v, LLVMValueRef x) {
  LLVMValueRef c = libm(v, "erfc", mul(v, neg(v, x), kd(v, 0.70710678118654752440)));
  LLVMValueRef g = mul(v, mul(v, kd(v, 0.5), x), c);
  return sel(v, eq(v, x, kd(v, -INFINITY)), kd(v, -0.0), g);
}

LLVMValueRef vmath_emit(LLVMBuilderRef b, int op, LLVMValueRef x) {
  LLVMTypeRef t = LLVMTypeOf(x);
  vm v = {.b = b, .ctx = LLVMGetTypeContext(t)};
  LLVMTypeRef elem = t;
  if (LLVMGetTypeKind(t) == LLVMVectorTypeKind) {
    elem = LLVMGetElementType(t);
    v.lanes = LLVMGetVectorSize(t);
    if (v.lanes > 64) return NULL;
  }
  LLVMTypeKind kind = LLVMGetTypeKind(elem);
  if (kind != LLVMFloatTypeKind && kind != LLVMDoubleTypeKind) return NULL;
  v.mod = LLVMGetGlobalParent(LLVMGetBasicBlockParent(LLVMGetInsertBlock(b)));
  v.f32 = shaped(&v, LLVMFloatTypeInContext(v.ctx));
  v.i32 = shaped(&v, LLVMInt32TypeInContext(v.ctx));
  v.f64 = shaped(&v, LLVMDoubleTypeInContext(v.ctx));
  v.i64 = shaped(&v, LLVMInt64TypeInContext(v.ctx));

  /* both dtypes: correctly rounded sqrt, and rsqrt as a divide after it */
  LLVMValueRef one = kind == LLVMFloatTypeKind ? kf(&v, 1.0f) : kd(&v, 1.0);
  if (op == OP_SQRT) return intrinsic(&v, "llvm.sqrt", x);
  if (op == OP_RSQRT) return fdiv(&v, one, intrinsic(&v, "llvm.sqrt", x));

  if (kind == LLVMFloatTypeKind) {
    switch (op) {
    case OP_EXP: return exp_f32(&v, x);
    case OP_LOG: return log_f32(&v, x);
    case OP_TANH: return tanh_f32(&v, x);
    case OP_SIGMOID: return sigmoid_f32(&v, x);
    case OP_GELU: return gelu_f32(&v, x);
    case OP_GELU_ERF: return gelu_erf_f32(&v, x);
    case OP_ERF: return erf_f32(&v, x);
    case OP_SIN: return sin_f32(&v, x);
    case OP_COS: return cos_f32(&v, x);
    case OP_SILU: return silu_f32(&v, x);
    case OP_SOFTPLUS: return softplus_f32(&v, x);
    case OP_LOG1P: return log1p_f32(&v, x);
    case OP_EXPM1: return expm1_f32(&v, x);
    default: return NULL;
    }
  }
  switch (op) {
  case OP_EXP: return intrinsic(&v, "llvm.exp", x);
  case OP_LOG: return intrinsic(&v, "llvm.log", x);
  case OP_SIN: return intrinsic(&v, "llvm.sin", x);
  case OP_COS: return intrinsic(&v, "llvm.cos", x);
  case OP_TANH: return libm(&v, "tanh", x);
  case OP_ERF: return libm(&v, "erf", x);
  case OP_SIGMOID: return sigmoid_f64(&v, x);
  case OP_GELU: return gelu_f64(&v, x);
  case OP_GELU_ERF: return gelu_erf_f64(&v, x);
  case OP_SILU: return silu_f64(&v, x);
  case OP_SOFTPLUS: return softplus_f64(&v, x);
  case OP_LOG1P: return libm(&v, "log1p", x);
  case OP_EXPM1: return libm(&v, "expm1", x);
  default: return NULL;
  }
}
