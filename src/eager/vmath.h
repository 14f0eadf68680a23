/* Vectorizable math for the eager kernels. The f32 versions of exp, log,
 * tanh, sigmoid and gelu are branch-free (selects, bit tricks, polynomials),
 * so GCC vectorizes the loops that call them; a libm call would stop it.
 * Accuracy (tests/test_vmath.c, against f64 libm over the whole float range):
 * exp, log, sigmoid, tanh, gelu within a few ulp, inf/NaN/denormals exact.
 * erf, gelu_erf, sin and cos are rarely hot here: they go through f64 libm
 * for full accuracy. The f64 versions use libm. */
#ifndef KILN_EAGER_VMATH_H
#define KILN_EAGER_VMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float vm_f32_bits(int32_t i) {
  float f;
  memcpy(&f, &i, sizeof f);
  return f;
}
static inline int32_t vm_bits_f32(float f) {
  int32_t i;
  memcpy(&i, &f, sizeof i);
  return i;
}

/* e^x: x = n ln2 + r (Cody-Waite), e^r by its Taylor series to r^7
 * (|r| <= ln2/2: truncation below 2^-27), then 2^n in two steps so that
 * results down in the denormals round once. */
static inline float vm_expf(float x) {
  float xc = x > 88.72283935546875f ? 88.72283935546875f : (x < -103.97208404541015625f ? -103.97208404541015625f : x);
  float n = __builtin_rintf(xc * 1.44269504f);
  float r = xc - n * 0.693145752f;
  r = r - n * 1.42860677e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t ni = (int32_t)n, n1 = ni / 2, n2 = ni - n1;
  float y = p * vm_f32_bits((n1 + 127) << 23) * vm_f32_bits((n2 + 127) << 23);
  y = x > 88.72283935546875f ? INFINITY : y;
  y = x < -103.97208404541015625f ? 0.0f : y;
  return x != x ? x : y;
}

/* log x: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s) with
 * s = (m-1)/(m+1), |s| < 0.172, by its odd series to s^11. */
static inline float vm_logf(float x) {
  int sub = x < 1.17549435e-38f; /* denormals (and 0, negatives): scale first */
  float xs = sub ? x * 8388608.0f : x;
  int32_t ix = vm_bits_f32(xs);
  int32_t e = ((ix >> 23) & 0xff) - 127 - (sub ? 23 : 0);
  float m = vm_f32_bits((ix & 0x007fffff) | 0x3f800000);
  int big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e += big;
  float f = m - 1.0f, s = f / (2.0f + f), z = s * s;
  float q = 1.0f / 11.0f;
  q = q * z + 1.0f / 9.0f;
  q = q * z + 1.0f / 7.0f;
  q = q * z + 1.0f / 5.0f;
  q = q * z + 1.0f / 3.0f;
  float fe = (float)e;
  float lm = 2.0f * s + 2.0f * s * (z * q);
  float y = fe * 0.693145752f + (lm + fe * 1.42860677e-6f);
  y = x == 0.0f ? -INFINITY : y;
  y = x < 0.0f ? NAN : y;
  y = x == INFINITY ? INFINITY : y;
  return x != x ? x : y;
}

/* tanh: for |x| < 0.25 as expm1(2x)/(expm1(2x)+2) with expm1 by its Taylor
 * series (no cancellation near 0); above, (1-t)/(1+t) with t = e^(-2|x|) <= 0.61. */
static inline float vm_tanhf(float x) {
  float a = fabsf(x);
  float t = vm_expf(-2.0f * a);
  float big = (1.0f - t) / (1.0f + t);
  float u = 2.0f * a;
  float p = 1.0f / 40320.0f;
  p = p * u + 1.0f / 5040.0f;
  p = p * u + 1.0f / 720.0f;
  p = p * u + 1.0f / 120.0f;
  p = p * u + 1.0f / 24.0f;
  p = p * u + 1.0f / 6.0f;
  p = p * u + 0.5f;
  p = p * u + 1.0f;
  float em1 = p * u;
  float small = em1 / (em1 + 2.0f);
  float y = a < 0.25f ? small : big;
  return x != x ? x : copysignf(y, x);
}

/* 1/(1+e^-x), as t/(1+t) with t = e^x for x < 0 so that tiny results keep
 * their relative accuracy. */
static inline float vm_sigmoidf(float x) {
  float t = vm_expf(-fabsf(x));
  float d = 1.0f + t;
  return x >= 0.0f ? 1.0f / d : (x != x ? x : t / d);
}

/* gelu, tanh form: x/2 (1 + tanh u) with u = C (x + A x^3) is exactly
 * x * sigmoid(2u), which keeps its relative accuracy for large negative x
 * (where 1 + tanh u cancels). */
static inline float vm_geluf(float x) {
  float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x * vm_sigmoidf(2.0f * u);
}

static inline float vm_erff(float x) { return (float)erf((double)x); }
/* x Phi(x) = x/2 erfc(-x/sqrt 2): erfc keeps accuracy where 1 + erf cancels */
static inline float vm_gelu_erff(float x) { return (float)(0.5 * (double)x * erfc(-(double)x * M_SQRT1_2)); }
static inline float vm_sinf(float x) { return (float)sin((double)x); }
static inline float vm_cosf(float x) { return (float)cos((double)x); }

static inline double vm_sigmoid(double x) {
  double t = exp(-fabs(x));
  return x >= 0.0 ? 1.0 / (1.0 + t) : (x != x ? x : t / (1.0 + t));
}
static inline double vm_gelu(double x) {
  double u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
  return x * vm_sigmoid(2.0 * u);
}
static inline double vm_gelu_erf(double x) { return 0.5 * x * erfc(-x * M_SQRT1_2); }

#endif
