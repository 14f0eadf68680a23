/* vmath.h - elementwise math for the CPU kernels, written so that GCC and
 * Clang vectorize a loop that calls it: every f32 function is straight-line
 * arithmetic, selects on values and bit casts, with no libm calls and no
 * branches. The f64 versions call libm (they are the slow, careful path).
 *
 * Accuracy of the f32 functions against the exact result of the same float
 * input (measured over every float, see tests/test_vmath.c):
 *   expf, logf, sigmoidf, tanhf   <= 4 ulp everywhere; inf, nan, subnormal
 *                                 inputs, overflow to inf and underflow to 0
 *                                 handled exactly
 *   erff                          <= 4 ulp everywhere
 *   sinf, cosf                    <= 4 ulp for |x| <= 12800 (Cody-Waite
 *                                 reduction by pi/2 in five parts); beyond,
 *                                 the reduction loses bits and the error
 *                                 grows with |x|, though results stay in
 *                                 [-1, 1]; inf and nan give nan
 *   gelu_erff                     <= 4 ulp for normal results, including the
 *                                 far negative tail (an erfc form with x*x
 *                                 split exactly); subnormal results (x < -13)
 *                                 are within a few subnormal steps
 *   geluf (tanh form)             x / (1 + exp(-2u)), u = C*(x + A*x^3), in a
 *                                 stable sigmoid form so large negative x
 *                                 keeps its relative accuracy instead of
 *                                 cancelling to 0; the float error of u makes
 *                                 the relative error grow like |u| * 2^-23
 *                                 for x < -2 (about 1e-5 at x = -9)
 * The functions need IEEE semantics: do not build their callers with
 * -ffast-math or -ffinite-math-only (nan and inf selects would fold away). */
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

static inline float vm__abs(float x) { return vm__float(vm__bits(x) & 0x7fffffffu); }

/* x with the sign of s. */
static inline float vm__copysign(float x, float s) {
  return vm__float((vm__bits(x) & 0x7fffffffu) | (vm__bits(s) & 0x80000000u));
}

/* 1.5 * 2^23: adding it rounds a float of magnitude < 2^22 to an integer,
 * which then sits in the low mantissa bits. */
#define VM__ROUND 12582912.0f

/* exp(hi + mid + lo) for |mid|, |lo| small next to |hi| (-0.0f parts fold
 * away). The sum is reduced as hi - n*ln2 + mid + lo with n*ln2 in two
 * parts: hi - n*C1 is exact, and mid and lo join it only after it has
 * shrunk, so none of them is rounded at the magnitude of hi. */
static inline float vm__exp3(float hi, float mid, float lo) {
  float h = hi < 88.8f ? hi : 88.8f; /* nan -> 88.8, fixed by the caller */
  h = h > -104.0f ? h : -104.0f;
  float t = (h + mid) * 1.44269504f + VM__ROUND;
  float n = t - VM__ROUND;
  int32_t ni = (int32_t)(vm__bits(t) - vm__bits(VM__ROUND));
  float r = ((h - n * 0.693359375f + mid) + lo) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  /* 2^n in two factors so that n in [-152, 128] never leaves the normal
   * exponent range; the second product rounds once into subnormals. */
  int32_t n1 = ni / 2, n2 = ni - n1;
  float s1 = vm__float((uint32_t)(n1 + 127) << 23);
  float s2 = vm__float((uint32_t)(n2 + 127) << 23);
  return p * s1 * s2;
}

/* e^x. */
static inline float vm_expf(float x) {
  float r = vm__exp3(x, -0.0f, -0.0f);
  return x != x ? x : r;
}

/* Natural log: nan for x < 0, -inf at +-0. */
static inline float vm_logf(float x) {
  /* scale subnormals into the normal range (also harmless for 0 and x < 0) */
  int sub = x < 1.17549435e-38f;
  float xs = sub ? x * 8388608.0f : x;
  /* split xs = 2^k * m with m in [sqrt(1/2), sqrt(2)) */
  uint32_t ix = vm__bits(xs) + (0x3f800000u - 0x3f3504f3u);
  float k = (float)((int32_t)(ix >> 23) - 127 - (sub ? 23 : 0));
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
  r = x == INFINITY ? x : r;
  r = x == 0.0f ? -INFINITY : r;
  r = x < 0.0f ? NAN : r;
  return x != x ? x : r;
}

/* 1 / (1 + e^-x), computed from e^-|x| so neither tail overflows and the
 * negative tail keeps its relative accuracy down to subnormals. */
static inline float vm_sigmoidf(float x) {
  float e = vm_expf(-vm__abs(x));
  float d = 1.0f + e;
  return x >= 0.0f ? 1.0f / d : e / d; /* nan: e is nan, so is e / d */
}

/* Hyperbolic tangent: an odd polynomial near 0 (no cancellation), else
 * 1 - 2 / (e^2|x| + 1) with |x| capped where tanh rounds to 1. */
static inline float vm_tanhf(float x) {
  float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  float small = x + x * z * p;
  float a = vm__abs(x);
  a = a < 10.0f ? a : 10.0f; /* nan -> 10, fixed below */
  float big = vm__copysign(1.0f - 2.0f / (vm_expf(a + a) + 1.0f), x);
  float r = vm__abs(x) < 0.625f ? small : big;
  r = x == 0.0f ? x : r; /* keeps the sign of -0 */
  return x != x ? x : r;
}

/* erf(x) / x - 1 for x*x = z <= 0.25 (near-minimax, degree 4 in z). */
static inline float vm__erf_small(float z) {
  float p = 4.71908257e-3f;
  p = p * z - 2.67577327e-2f;
  p = p * z + 1.12828314e-1f;
  p = p * z - 3.76126090e-1f;
  p = p * z + 1.28379166e-1f;
  return p;
}

/* scale * erfc(t) for t >= 0.5, given t and t*t in f64 (t*t exact when t is
 * a float or a float over sqrt2). erfc(t) = u * exp(P(u) - t^2), u = 1 / (1 + t/2),
 * with P fitted near-minimax on t in [0.5, 10.5] (error 3e-9); t is capped
 * there, since erfc(10.5) is below every float. The exponent is formed in
 * f64 because u's rounding and P's magnitude would cost several ulp in f32;
 * it is handed to the f32 exp as an exact hi + lo pair. */
static inline float vm__erfc_tail(double t, double t2, double scale) {
  t = t < 10.5 ? t : 10.5;
  t2 = t2 < 110.25 ? t2 : 110.25;
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
  /* exp of the exponent raised by 64 ln2 stays normal; the 2^-64 and the
   * scale go in afterwards in f64, so a subnormal result rounds only once */
  double e = (p - t2) + 44.361419555836499803;
  float hi = (float)e;
  float lo = (float)(e - (double)hi);
  return (float)(scale * 0x1p-64 * u * (double)vm__exp3(hi, lo, -0.0f));
}

/* Error function. */
static inline float vm_erff(float x) {
  float a = vm__abs(x);
  float small = x + x * vm__erf_small(x * x);
  double ad = (double)a;
  float big = vm__copysign(1.0f - vm__erfc_tail(ad, ad * ad, 1.0), x);
  float r = a < 0.5f ? small : big;
  r = x == 0.0f ? x : r;
  return x != x ? x : r;
}

/* Reduce x by pi/2: returns r in about [-pi/4, pi/4] and the quadrant in *q.
 * pi/2 is split in five floats, the first four of 11 bits so that j * part
 * is exact for |j| < 2^13 (|x| <= 12800). */
static inline float vm__reduce_pio2(float x, uint32_t *q) {
  float t = x * 0.636619772f + VM__ROUND;
  float j = t - VM__ROUND;
  *q = vm__bits(t) - vm__bits(VM__ROUND);
  float r = x - j * 1.5703125f;
  r = r - j * 4.837512969970703125e-4f;
  r = r - j * 7.54953362047672271728515625e-8f;
  r = r - j * 2.5632829393076035194098949432373046875e-12f;
  r = r - j * 6.12323426292737821433955307425e-17f;
  /* past the exact range r is off; keep it where the polynomials stay in
   * [-1, 1] (nan passes through) */
  r = r > 0.786f ? 0.786f : r;
  r = r < -0.786f ? -0.786f : r;
  return r;
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

/* sin of quadrant q plus r: the quadrant picks sin or cos and the sign. */
static inline float vm__sin_quadrant(float r, uint32_t q) {
  float v = (q & 1u) ? vm__cos_poly(r) : vm__sin_poly(r);
  return vm__float(vm__bits(v) ^ ((q & 2u) << 30));
}

/* Sine; accurate for |x| <= 12800 (see the top of the file). */
static inline float vm_sinf(float x) {
  uint32_t q;
  float r = vm__reduce_pio2(x, &q);
  float s = vm__sin_quadrant(r, q);
  return x == 0.0f ? x : s; /* keeps the sign of -0 */
}

/* Cosine; accurate for |x| <= 12800. */
static inline float vm_cosf(float x) {
  uint32_t q;
  float r = vm__reduce_pio2(x, &q);
  return vm__sin_quadrant(r, q + 1u);
}

/* GELU, tanh form: 0.5*x*(1 + tanh(u)) = x * sigmoid(2u), u = C*(x + A*x^3),
 * with the sigmoid taken from e^-|2u| (see the top of the file). */
static inline float vm_geluf(float x) {
  float s = 1.5957691216f * (x + 0.044715f * x * x * x); /* 2u */
  float e = vm_expf(-vm__abs(s));
  float d = 1.0f + e;
  float g = s >= 0.0f ? x / d : x * e / d;
  g = x == -INFINITY ? -0.0f : g;
  return x != x ? x : g;
}

/* GELU, erf form: 0.5*x*(1 + erf(x/sqrt2)); for x < 0 as 0.5*x*erfc(|x|/sqrt2)
 * so the negative tail keeps its relative accuracy. */
static inline float vm_gelu_erff(float x) {
  float t = vm__abs(x) * 0.707106781f;
  float small = t * vm__erf_small(t * t) + t; /* erf(t) for t < 0.5 */
  double xd = (double)x;
  /* for x >= 0 this is erfc(t); for x < 0 it is the result, 0.5*x*erfc(t)
   * (x capped at -15, where it has long rounded to -0) */
  float tail = vm__erfc_tail(vm__abs(x) * 0.70710678118654752, 0.5 * xd * xd, x >= 0.0f ? 1.0 : (x > -15.0f ? 0.5 * xd : -7.5));
  /* 1 + erf(x/sqrt2) is 1 +- erf(t) near 0, else 2 - erfc(t) for x > 0 */
  float near0 = 0.5f * x * (x >= 0.0f ? 1.0f + small : 1.0f - small);
  float g = t < 0.5f ? near0 : (x >= 0.0f ? 0.5f * x * (2.0f - tail) : tail);
  g = x == -INFINITY ? -0.0f : g;
  return x != x ? x : g;
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
  return x >= 0.0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

static inline double vm_gelu(double x) {
  double s = 1.5957691216057308 * (x + 0.044715 * x * x * x);
  double e = exp(-fabs(s));
  double g = s >= 0.0 ? x / (1.0 + e) : x * e / (1.0 + e);
  return x == -INFINITY ? -0.0 : g;
}

static inline double vm_gelu_erf(double x) { return 0.5 * x * erfc(-x * 0.70710678118654752440); }

#endif
