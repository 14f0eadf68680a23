/* vmath.h - elementwise math for the CPU kernels, written so that GCC
 * vectorizes a loop that calls it: every f32 function is straight-line
 * arithmetic, bit casts and mask selects, with no libm calls and no branches.
 * The f64 versions call libm (they are the slow, careful path).
 *
 * Accuracy of the f32 functions against the exact result for the same float
 * input, checked over every float (worst case measured in brackets; the
 * test keeps a sweep). Below FLT_MIN an ulp is one subnormal step.
 *   expf [0.99] logf [0.83]       <= 4 ulp everywhere; inf, nan, subnormal
 *   tanhf [2.61] sigmoidf [2.40]  inputs, overflow to inf and underflow to 0
 *                                 all exact
 *   erff [1.26] gelu_erff [1.96]  <= 4 ulp everywhere, the far negative GELU
 *                                 tail included: it is 0.5*x*erfc(-x/sqrt2)
 *                                 with the exponent of erfc formed in f64
 *   geluf [3.40] (tanh form)      x * sigmoid(2u), u = C*(x + A*x^3), with
 *                                 2u in f64 so the tail keeps its accuracy:
 *                                 <= 4 ulp everywhere
 *   log1pf [1.44] expm1f [1.57]   <= 4 ulp everywhere
 *   siluf [3.24] softplusf [1.94] (softplus: torch's threshold of 20)
 *   sinf [2.47] cosf [2.39]       <= 4 ulp for |x| <= 12800 (Cody-Waite
 *                                 reduction by pi/2 in five parts); beyond
 *                                 that the reduction loses bits and the error
 *                                 grows with |x| (meaningless past ~25000),
 *                                 though results stay in [-1, 1]; inf and
 *                                 nan give nan
 * No FMA is assumed; with contraction (-ffp-contract=fast) the bounds hold
 * as well and the functions run about a quarter faster.
 * Selects are written as bit masks, not ?:, because GCC turns a ?: into a
 * branch that if-conversion refuses when an arm holds a float operation that
 * may trap (the default -ftrapping-math), and the loop then stays scalar.
 * Callers must keep IEEE semantics: no -ffast-math or -ffinite-math-only. */
#ifndef KILN_EAGER_VMATH_H
#define KILN_EAGER_VMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t vm__bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

static inline float vm__float(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

static inline uint64_t vm__bits64(double x) {
  uint64_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

static inline double vm__double(uint64_t u) {
  double x;
  memcpy(&x, &u, sizeof x);
  return x;
}

/* c ? a : b, on values. */
static inline float vm__sel(int c, float a, float b) {
  uint32_t m = 0u - (uint32_t)(c != 0);
  return vm__float((vm__bits(a) & m) | (vm__bits(b) & ~m));
}

static inline double vm__seld(int c, double a, double b) {
  uint64_t m = 0u - (uint64_t)(c != 0);
  return vm__double((vm__bits64(a) & m) | (vm__bits64(b) & ~m));
}

static inline float vm__abs(float x) { return vm__float(vm__bits(x) & 0x7fffffffu); }

/* |x| with the sign of s. */
static inline float vm__copysign(float x, float s) {
  return vm__float((vm__bits(x) & 0x7fffffffu) | (vm__bits(s) & 0x80000000u));
}

/* 1.5 * 2^23: adding it rounds a float of magnitude < 2^22 to an integer,
 * which then sits in the low mantissa bits. */
#define VM__ROUND 12582912.0f

/* P with e^r = 1 + r + r^2 P(r) for |r| <= ln2/2 */
static inline float vm__exp_poly(float r) {
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  return p * r + 5.0000001201e-1f;
}

/* exp(hi + lo) for |lo| small next to |hi| (a -0.0f lo folds away). The sum
 * is reduced as hi - n*ln2 + lo with ln2 in two parts: hi - n*C1 is exact,
 * and lo joins only after that difference has shrunk, so lo is never
 * rounded at the magnitude of hi. hi is clamped to [-104, 88.8] (callers
 * that pass a lo keep hi inside, where a dropped lo would matter). Nan
 * comes out as some number; callers put it back. */
static inline float vm__exp2(float hi, float lo) {
  /* Below -150 ln2, e^x rounds to 0. Such lanes compute e^0 and are zeroed
   * at the end: a product rounding into subnormals costs a microcode assist
   * of about 150 cycles on x86, and masked attention scores are all -inf. */
  int dead = hi < -103.9721f;
  float h = vm__sel(hi < 88.8f, hi, 88.8f);
  h = vm__sel(h > -104.0f, h, -104.0f);
  h = vm__sel(dead, 0.0f, h);
  float t = (h + lo) * 1.44269504f + VM__ROUND;
  float n = t - VM__ROUND;
  int32_t ni = (int32_t)(vm__bits(t) - vm__bits(VM__ROUND));
  float r = ((h - n * 0.693359375f) + lo) - n * -2.12194440e-4f;
  float p = vm__exp_poly(r) * (r * r) + r + 1.0f;
  /* 2^n in two factors so that n in [-152, 128] never leaves the normal
   * exponent range; the second product rounds once into subnormals. */
  int32_t n1 = ni / 2, n2 = ni - n1;
  float s1 = vm__float((uint32_t)(n1 + 127) << 23);
  float s2 = vm__float((uint32_t)(n2 + 127) << 23);
  return vm__sel(dead, 0.0f, p * s1 * s2);
}

/* e^x. */
static inline float vm_expf(float x) { return vm__sel(x != x, x, vm__exp2(x, -0.0f)); }

/* Natural log: nan for x < 0, -inf at +-0. */
static inline float vm_logf(float x) {
  /* scale subnormals into the normal range (harmless for 0 and x < 0) */
  int sub = x < 1.17549435e-38f;
  float xs = vm__sel(sub, x * 8388608.0f, x);
  /* xs = 2^k * (1 + f) with 1 + f in [sqrt(1/2), sqrt(2)) */
  uint32_t ix = vm__bits(xs) + (0x3f800000u - 0x3f3504f3u);
  int32_t ki = (int32_t)(ix >> 23) - 127 - (23 & -sub);
  float k = (float)ki;
  float f = vm__float((ix & 0x007fffffu) + 0x3f3504f3u) - 1.0f;
  float z = f * f;
  float p = 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  float y = f * z * p + k * -2.12194440e-4f - 0.5f * z;
  float r = (f + y) + k * 0.693359375f;
  r = vm__sel(x == INFINITY, x, r);
  r = vm__sel(x == 0.0f, -INFINITY, r);
  r = vm__sel(x < 0.0f, NAN, r);
  return vm__sel(x != x, x, r);
}

/* 1 / (1 + e^-x), from e^-|x| so that neither tail overflows and the
 * negative tail keeps its relative accuracy down to subnormals. */
static inline float vm_sigmoidf(float x) {
  float e = vm_expf(-vm__abs(x));
  return vm__sel(x >= 0.0f, 1.0f, e) / (1.0f + e); /* nan: e is nan */
}

/* e^2a - 1 for a in [0, 10] (tanh's |x|): 2a = n ln2 + r as in vm__exp2,
 * then 2^n (r + r^2 P(r)) + (2^n - 1) as in vm_expm1f, with P in Estrin's
 * order (pairs, then r^2 and r^4) rather than Horner's. The vector loop is
 * bound by how long its values wait on one another, so short chains matter:
 * n comes from a (a * 2log2e rounds as 2a * log2e does), and 2^n is t's bits
 * shifted, as rounding with 1.5 * 2^23 + 127 leaves n + 127 in them.
 * 2a - n*C1 is exact, as n <= 29. */
static inline float vm__expm1_2x(float a) {
  float t = a * 2.88539008f + (VM__ROUND + 127.0f);
  float n = t - (VM__ROUND + 127.0f);
  float r = ((a + a) - n * 0.693359375f) - n * -2.12194440e-4f;
  float r2 = r * r;
  float p01 = 4.9999997020e-1f + 1.6666543484e-1f * r;
  float p23 = 4.1667200625e-2f + 8.3665214479e-3f * r;
  float p = (p01 + r2 * p23) + (r2 * r2) * 1.3882510830e-3f;
  float s = vm__float(vm__bits(t) << 23);
  return s * (p * r2 + r) + (s - 1.0f);
}

/* Hyperbolic tangent: m / (m + 2) with m = e^2|x| - 1, one formula for the
 * whole line. Near 0, m keeps its relative accuracy (no 1 is added) and
 * tanh(x) ~ m/2; far out, m's error is damped by 2 / (m + 2). With no branch
 * for small |x| there is one chain to compute, not two to select from (the
 * vector loop is bound by its instruction count). |x| is capped at 10, where
 * tanh has rounded to 1; a nan passes the cap and comes out nan; -0 and
 * subnormals come out exact (m = 2|x| and m + 2 = 2). */
static inline float vm_tanhf(float x) {
  float a = vm__abs(x);
  float m = vm__expm1_2x(vm__sel(a > 10.0f, 10.0f, a));
  return vm__copysign(m / (m + 2.0f), x);
}

/* erf(x) / x - 1 for z = x*x <= 0.25 (near-minimax, degree 4 in z). */
static inline float vm__erf_small(float z) {
  float p = 4.71908257e-3f;
  p = p * z - 2.67577327e-2f;
  p = p * z + 1.12828314e-1f;
  p = p * z - 3.76126090e-1f;
  p = p * z + 1.28379166e-1f;
  return p;
}

/* scale * erfc(t) for t in [0.5, 10.5], given t and t*t in f64 (t*t exact
 * for t a float, or a float over sqrt2); callers cap t at 10.5, as
 * erfc(10.5) is below every float. erfc(t) = u * exp(P(u) - t^2) with
 * u = 1 / (1 + t/2) and P fitted near-minimax on that range (error 3e-9). The
 * exponent is formed in f64, since u's rounding and P's size would cost
 * several ulp in f32, and reaches the f32 exp as an exact hi + lo pair,
 * raised by 64 ln2 so that it stays normal: the 2^-64 and the scale go in
 * afterwards in f64, and a subnormal result rounds only once. */
static inline float vm__erfc_tail(double t, double t2, double scale) {
  double u = 1.0 / (1.0 + 0.5 * t);
  double p = 0.26450133617389646;
  p = p * u - 1.2395561333502182;
  p = p * u + 2.2845317557210112;
  p = p * u - 1.9830956021617332;
  p = p * u + 0.83156612999604854;
  p = p * u - 0.41351994969075458;
  p = p * u + 0.15535472974160286;
  p = p * u + 0.36500632299409769;
  p = p * u + 1.0007927710692577;
  p = p * u - 1.2655394594966286;
  double e = (p - t2) + 44.361419555836499803;
  float hi = (float)e;
  float lo = (float)(e - (double)hi);
  return (float)(scale * 0x1p-64 * u * (double)vm__exp2(hi, lo));
}

/* Error function. */
static inline float vm_erff(float x) {
  float a = vm__abs(x);
  float small = x + x * vm__erf_small(x * x);
  double ad = (double)vm__sel(a < 10.5f, a, 10.5f);
  float big = vm__copysign(1.0f - vm__erfc_tail(ad, ad * ad, 1.0), x);
  float r = vm__sel(a < 0.5f, small, big);
  r = vm__sel(x == 0.0f, x, r);
  return vm__sel(x != x, x, r);
}

/* Reduce x by pi/2: r in about [-pi/4, pi/4], the quadrant in *q. pi/2 is
 * split in five floats, the first four of 11 bits, so that j * part is
 * exact for |j| < 2^13 (|x| <= 12800). */
static inline float vm__reduce_pio2(float x, uint32_t *q) {
  float t = x * 0.636619772f + VM__ROUND;
  float j = t - VM__ROUND;
  *q = vm__bits(t) - vm__bits(VM__ROUND);
  float r = x - j * 1.5703125f;
  r = r - j * 4.837512969970703125e-4f;
  r = r - j * 7.54953362047672271728515625e-8f;
  r = r - j * 2.5632829393076035194098949432373046875e-12f;
  r = r - j * 6.12323426292737821433955307425e-17f;
  /* past the exact range r is off: keep it where the polynomials stay
   * within [-1, 1] (a nan passes through) */
  r = vm__sel(r > 0.8f, 0.8f, r);
  return vm__sel(r < -0.8f, -0.8f, r);
}

/* sin(r) and cos(r) for |r| <= pi/4. */
static inline float vm__sin_poly(float r) {
  float z = r * r;
  float p = -1.9515295891e-4f;
  p = p * z + 8.3321608736e-3f;
  p = p * z - 1.6666654611e-1f;
  return r + r * z * p;
}

static inline float vm__cos_poly(float r) {
  float z = r * r;
  float p = 2.443315711809948e-5f;
  p = p * z - 1.388731625493765e-3f;
  p = p * z + 4.166664568298827e-2f;
  return 1.0f - 0.5f * z + z * z * p;
}

/* sin(q*pi/2 + r): the quadrant picks sin or cos, and the sign. */
static inline float vm__sin_quadrant(float r, uint32_t q) {
  float v = vm__sel(q & 1u, vm__cos_poly(r), vm__sin_poly(r));
  return vm__float(vm__bits(v) ^ ((q & 2u) << 30));
}

/* Sine; accurate for |x| <= 12800 (see the top of the file). */
static inline float vm_sinf(float x) {
  uint32_t q;
  float r = vm__reduce_pio2(x, &q);
  return vm__sel(x == 0.0f, x, vm__sin_quadrant(r, q)); /* the sign of -0 */
}

/* Cosine; accurate for |x| <= 12800. */
static inline float vm_cosf(float x) {
  uint32_t q;
  float r = vm__reduce_pio2(x, &q);
  return vm__sin_quadrant(r, q + 1u);
}

/* x * sigmoid(s) for s of x's sign, s in f64: (x >= 0 ? x : x e) / (1 + e),
 * e = e^-|s|. The exponent is raised by 64 ln2 (and the 2^-64 put back after
 * the product with x) so that tiny results round only once. */
static inline float vm__x_sigmoid(float x, double s) {
  double ns = vm__double(vm__bits64(s) | 0x8000000000000000u) + 44.361419555836499803; /* 64 ln2 - |s| */
  float hi = (float)ns;
  float lo = (float)(ns - (double)hi);
  float e64 = vm__exp2(hi, lo); /* 2^64 e^-|s| */
  float e = e64 * 0x1p-64f;
  return vm__sel(x >= 0.0f, x, x * e64 * 0x1p-64f) / (1.0f + e);
}

/* GELU, tanh form: 0.5*x*(1 + tanh(u)) = x * sigmoid(2u), u = C*(x + A*x^3).
 * The sigmoid comes from e^-|2u| as in vm_sigmoidf. 2u is formed in f64: in
 * f32 its rounding alone would cost ~|2u| ulp in the tail, where e^-|2u|
 * magnifies it. The exponent is raised by 64 ln2 (and the 2^-64 put back
 * after the product with x) so that tiny results round only once. */
static inline float vm_geluf(float x) {
  /* past |x| = 20, e^-|2u| is 0 in f32; capping keeps the f64 part small */
  float xc = vm__sel(x < 20.0f, x, 20.0f);
  xc = vm__sel(xc > -20.0f, xc, -20.0f);
  double xd = (double)xc;
  double s = xd * (1.5957691216057308 + 0.07135481627260025 * (xd * xd)); /* 2u */
  float g = vm__x_sigmoid(x, s);
  g = vm__sel(x == -INFINITY, -0.0f, g);
  return vm__sel(x != x, x, g);
}

/* GELU, erf form: 0.5*x*(1 + erf(x/sqrt2)); for x < 0 it is taken as
 * 0.5*x*erfc(|x|/sqrt2), so the negative tail keeps its relative accuracy. */
static inline float vm_gelu_erff(float x) {
  float t = vm__abs(x) * 0.707106781f;
  float small = t * vm__erf_small(t * t) + t; /* erf(t) for t < 0.5 */
  /* |x| capped at 14.84 (t <= 10.5), where 0.5*x*erfc(t) has long rounded to
   * 0 and 2 - erfc(t) to 2 */
  float xc = vm__sel(x < 14.84f, x, 14.84f);
  xc = vm__sel(xc > -14.84f, xc, -14.84f);
  double xd = (double)xc;
  /* erfc(t) for x >= 0; for x < 0 the result itself, 0.5*x*erfc(t) */
  float scale = vm__sel(x >= 0.0f, 1.0f, 0.5f * xc);
  float tail = vm__erfc_tail((double)vm__abs(xc) * 0.70710678118654752, 0.5 * xd * xd, (double)scale);
  float near0 = 0.5f * x * (1.0f + vm__copysign(small, x));
  float far = vm__sel(x >= 0.0f, 0.5f * x * (2.0f - tail), tail);
  float g = vm__sel(t < 0.5f, near0, far);
  g = vm__sel(x == -INFINITY, -0.0f, g);
  return vm__sel(x != x, x, g);
}

/* log(1 + x): u = 1 + x rounded, then log(u) corrected by the rounding of
 * u, (x - (u - 1)) / u (Goldberg); exact where u is 1. */
static inline float vm_log1pf(float x) {
  float u = 1.0f + x;
  float r = vm_logf(u) + (x - (u - 1.0f)) / u;
  r = vm__sel(u == 1.0f, x, r); /* tiny x, -0 included */
  r = vm__sel(x == INFINITY, x, r);
  r = vm__sel(x == -1.0f, -INFINITY, r);
  r = vm__sel(x < -1.0f, NAN, r);
  return vm__sel(x != x, x, r);
}

/* e^x - 1: x = n ln2 + r as in vm__exp2, e^r - 1 = r + r^2 P(r) with exp's
 * polynomial (no 1 added, so no cancellation), then 2^n (e^r - 1) + (2^n - 1).
 * Past |x| = 20, e^x - 1 itself (-1 below, exp's overflow above). */
static inline float vm_expm1f(float x) {
  float xc = vm__sel(x < 20.0f, x, 20.0f);
  xc = vm__sel(xc > -20.0f, xc, -20.0f);
  float t = xc * 1.44269504f + VM__ROUND;
  float n = t - VM__ROUND;
  int32_t ni = (int32_t)(vm__bits(t) - vm__bits(VM__ROUND));
  float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float q = vm__exp_poly(r) * (r * r) + r;
  float s = vm__float((uint32_t)(ni + 127) << 23);
  float core = s * q + (s - 1.0f);
  float big = vm_expf(x) - 1.0f;
  float res = vm__sel(vm__abs(x) < 20.0f, core, big);
  res = vm__sel(x == 0.0f, x, res); /* the sign of -0 */
  return vm__sel(x != x, x, res);
}

/* x * sigmoid(x); silu(-inf) = -0. */
static inline float vm_siluf(float x) {
  float g = vm__x_sigmoid(x, (double)x);
  g = vm__sel(x == -INFINITY, -0.0f, g);
  return vm__sel(x != x, x, g);
}

/* log(1 + e^x) as torch's softplus (beta 1, threshold 20): x past 20, else
 * max(x, 0) + log1p(e^-|x|), which neither overflows nor cancels. */
static inline float vm_softplusf(float x) {
  float m = vm__sel(x > 0.0f, x, 0.0f);
  float r = m + vm_log1pf(vm_expf(-vm__abs(x)));
  r = vm__sel(x > 20.0f, x, r);
  return vm__sel(x != x, x, r);
}

/* f64: libm, with the same stable forms for sigmoid and the GELUs. */
static inline double vm_exp(double x) { return exp(x); }
static inline double vm_log(double x) { return log(x); }
static inline double vm_tanh(double x) { return tanh(x); }
static inline double vm_erf(double x) { return erf(x); }
static inline double vm_sin(double x) { return sin(x); }
static inline double vm_cos(double x) { return cos(x); }

static inline double vm_sigmoid(double x) {
  double e = exp(-fabs(x));
  return (x >= 0.0 ? 1.0 : e) / (1.0 + e);
}

static inline double vm_gelu(double x) {
  double s = 1.5957691216057308 * (x + 0.044715 * x * x * x);
  double e = exp(-fabs(s));
  double g = (s >= 0.0 ? x : x * e) / (1.0 + e);
  return x == -INFINITY ? -0.0 : g;
}

static inline double vm_silu(double x) {
  double e = exp(-fabs(x));
  double g = (x >= 0.0 ? x : x * e) / (1.0 + e);
  return x == -INFINITY ? -0.0 : g;
}

static inline double vm_softplus(double x) {
  if (x > 20.0 || x != x) return x;
  return (x > 0.0 ? x : 0.0) + log1p(exp(-fabs(x)));
}

static inline double vm_gelu_erf(double x) {
  return x == -INFINITY ? -0.0 : 0.5 * x * erfc(-x * 0.70710678118654752440);
}

#endif
