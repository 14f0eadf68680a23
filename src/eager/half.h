/* f16 (IEEE binary16) and bf16 (bfloat16) to and from f32, bit exact.
 * Narrowing rounds to nearest, ties to even; overflow gives Inf; NaN stays
 * NaN (quiet, sign kept); f16 subnormals are exact both ways. Written with
 * integer operations and one f32 add (which rounds to nearest even in the
 * default FP environment) so that codegen can emit the same steps as vector
 * IR (lower.c) and a compiled kernel rounds exactly as eager does. */
#ifndef KILN_HALF_H
#define KILN_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t half_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float half_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Exact: every f16 is an f32. Subnormals are renormalized by one f32
 * subtraction of 2^-14 from the bits with the exponent set to 2^-14's. */
static inline float half_to_float(uint16_t h) {
  uint32_t o = (uint32_t)(h & 0x7fff) << 13, exp = o & 0x0f800000u;
  o += (uint32_t)(127 - 15) << 23;
  if (exp == 0x0f800000u) o += (uint32_t)(128 - 16) << 23;              /* Inf, NaN */
  else if (exp == 0) o = half_f2u(half_u2f(o + (1u << 23)) - half_u2f(113u << 23)); /* zero, subnormal */
  return half_u2f(o | (uint32_t)(h & 0x8000) << 16);
}

/* Round to nearest even. Results below 2^-14 are made by adding 0.5 (whose
 * ulp is 2^-24, the f16 subnormal step): the f32 add rounds them. */
static inline uint16_t half_from_float(float f) {
  uint32_t u = half_f2u(f), sign = u & 0x80000000u, o;
  u ^= sign;
  if (u >= (uint32_t)(127 + 16) << 23) o = u > 0x7f800000u ? 0x7e00u | ((u >> 13) & 0x3ff) : 0x7c00u; /* Inf, NaN */
  else if (u < 113u << 23) o = half_f2u(half_u2f(u) + half_u2f(126u << 23)) - (126u << 23); /* subnormal, zero */
  else o = (u + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1)) >> 13;
  return (uint16_t)(o | sign >> 16);
}

static inline float bf16_to_float(uint16_t h) { return half_u2f((uint32_t)h << 16); }

static inline uint16_t bf16_from_float(float f) {
  uint32_t u = half_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN: quiet, top payload kept */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* f64 to f32 rounding to odd (truncate, then set the last bit when inexact):
 * narrowing that to f16 or bf16 then rounds once, correctly, as a direct
 * f64 -> f16 conversion would (f32 keeps more than two extra bits). */
static inline float half_f64_odd(double d) {
  float f = (float)d;
  if ((double)f == d || d != d) return f;
  uint32_t u = half_f2u(f);
  if ((f < 0 ? -(double)f : (double)f) > (d < 0 ? -d : d)) u -= 1; /* rounded away from zero: truncate */
  return half_u2f(u | 1);
}

#endif
