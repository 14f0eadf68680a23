/* test_vmath.c - accuracy of the vectorizable math in src/eager/vmath.h.
 * The reference is f64 libm (long double for the f64 functions): each f32
 * function is swept over every 1021st bit pattern of the whole float range
 * plus every float in the ranges where it is hardest, and its worst error in
 * ulp (of the correctly rounded result, subnormal steps below FLT_MIN) must
 * stay within the bound documented in vmath.h. Special values are checked
 * exactly. The sweeps run over arrays so that an optimized build tests the
 * vectorized loops, not only the scalar code. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "eager/vmath.h"

enum { BATCH = 1024, STRIDE = 1021 };

/* Error of y in units of the last place of the float nearest to ref.
 * Infinite results must match exactly; nan must meet nan. */
static double ulp_err(float y, double ref) {
  if (isnan(ref) || isnan(y)) return isnan(ref) && isnan(y) ? 0.0 : INFINITY;
  float rf = (float)ref;
  if (isinf(rf) || isinf(y)) return y == rf ? 0.0 : INFINITY;
  double a = fabs(ref);
  int e;
  frexp(a, &e);
  double ulp = a < 0x1p-126 ? 0x1p-149 : ldexp(1.0, e - 24);
  return fabs((double)y - ref) / ulp;
}

typedef struct worst {
  double ulp;        /* largest error seen */
  float x, got;      /* where, and what came out */
  double want;
  long n;            /* inputs checked */
} worst;

static void note(worst *w, float x, float got, double want) {
  double e = ulp_err(got, want);
  w->n++;
  if (e > w->ulp) *w = (worst){e, x, got, want, w->n};
}

static float from_bits(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

/* Independent f64 references for the composite functions. */
static double ref_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
/* 0.5*x*(1 + tanh(u)) rewritten as x / (1 + e^-2u), which does not cancel
 * for large negative x; both GELUs tend to -0 at -inf */
static double ref_gelu(double x) {
  double u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
  return x == -INFINITY ? -0.0 : x / (1.0 + exp(-2.0 * u));
}
/* x / (1 + e^-x), and log1p(e^x) with torch's threshold 20 */
static double ref_silu(double x) { return x == -INFINITY ? -0.0 : x / (1.0 + exp(-x)); }
static double ref_softplus(double x) { return x > 20.0 ? x : log1p(exp(x)); }
static double ref_gelu_erf(double x) { return x == -INFINITY ? -0.0 : 0.5 * x * erfc(-x / sqrt(2.0)); }

/* sweep_F(lo, hi, stride, w): F over the floats in [lo, hi] whose bit
 * pattern is a multiple of stride (stride 1: all of them), nan patterns
 * included when the range is the whole line. */
#define SWEEP(F, REF)                                                                  \
  static void sweep_##F(float lo, float hi, uint32_t stride, worst *w) {              \
    float in[BATCH], out[BATCH];                                                       \
    uint64_t b = 0;                                                                    \
    int whole = lo == -INFINITY && hi == INFINITY;                                     \
    while (b < (1ull << 32)) {                                                         \
      int k = 0;                                                                       \
      for (; k < BATCH && b < (1ull << 32); b += stride) {                             \
        float x = from_bits((uint32_t)b);                                              \
        if ((x >= lo && x <= hi) || (whole && x != x)) in[k++] = x;                    \
      }                                                                                \
      for (int i = 0; i < k; i++) out[i] = F(in[i]);                                   \
      for (int i = 0; i < k; i++) note(w, in[i], out[i], REF((double)in[i]));          \
    }                                                                                  \
  }                                                                                    \
  /* every float in [lo, hi] (both finite, same sign) */                               \
  static void dense_##F(float lo, float hi, worst *w) {                                \
    float in[BATCH], out[BATCH];                                                       \
    float x = lo;                                                                      \
    while (x <= hi) {                                                                  \
      int k = 0;                                                                       \
      for (; k < BATCH && x <= hi; x = nextafterf(x, INFINITY)) in[k++] = x;           \
      for (int i = 0; i < k; i++) out[i] = F(in[i]);                                   \
      for (int i = 0; i < k; i++) note(w, in[i], out[i], REF((double)in[i]));          \
    }                                                                                  \
  }

SWEEP(vm_expf, exp)
SWEEP(vm_logf, log)
SWEEP(vm_tanhf, tanh)
SWEEP(vm_sigmoidf, ref_sigmoid)
SWEEP(vm_erff, erf)
SWEEP(vm_sinf, sin)
SWEEP(vm_cosf, cos)
SWEEP(vm_geluf, ref_gelu)
SWEEP(vm_gelu_erff, ref_gelu_erf)
SWEEP(vm_log1pf, log1p)
SWEEP(vm_expm1f, expm1)
SWEEP(vm_siluf, ref_silu)
SWEEP(vm_softplusf, ref_softplus)

#define ASSERT_ULP(NAME, W, BOUND)                                                          \
  ck_assert_msg((W).ulp <= (BOUND), "%s: max %.3f ulp > %.1f at x = %a (%.9g): got %.9g, want %.9g (%ld inputs)", \
                NAME, (W).ulp, (double)(BOUND), (double)(W).x, (double)(W).x, (double)(W).got, (W).want, (W).n)

/* Exact special values: expected first; nan matches nan, zeros match sign. */
typedef struct special {
  float x, want;
} special;

static void check_specials(const char *name, float (*f)(float), const special *s, int n, int zero_sign) {
  for (int i = 0; i < n; i++) {
    float got = f(s[i].x);
    int ok = isnan(s[i].want) ? isnan(got)
                              : got == s[i].want && (!zero_sign || signbit(got) == signbit(s[i].want));
    ck_assert_msg(ok, "%s(%a) = %a, want %a", name, (double)s[i].x, (double)got, (double)s[i].want);
  }
}

#define NSPEC(a) ((int)(sizeof(a) / sizeof *(a)))

/* Plain functions for the special-value tables (the header's are inline). */
static float f_exp(float x) { return vm_expf(x); }
static float f_log(float x) { return vm_logf(x); }
static float f_tanh(float x) { return vm_tanhf(x); }
static float f_sigmoid(float x) { return vm_sigmoidf(x); }
static float f_erf(float x) { return vm_erff(x); }
static float f_sin(float x) { return vm_sinf(x); }
static float f_cos(float x) { return vm_cosf(x); }
static float f_gelu(float x) { return vm_geluf(x); }
static float f_gelu_erf(float x) { return vm_gelu_erff(x); }
static float f_log1p(float x) { return vm_log1pf(x); }
static float f_expm1(float x) { return vm_expm1f(x); }
static float f_silu(float x) { return vm_siluf(x); }
static float f_softplus(float x) { return vm_softplusf(x); }

static const float DMIN = 0x1p-149f; /* smallest subnormal */

START_TEST(test_expf) {
  worst w = {0};
  sweep_vm_expf(-INFINITY, INFINITY, STRIDE, &w);
  dense_vm_expf(88.0f, 89.0f, &w);      /* overflow edge */
  dense_vm_expf(-104.5f, -86.0f, &w);   /* subnormal results, underflow edge */
  dense_vm_expf(-0.35f, -0.3f, &w);
  ASSERT_ULP("vm_expf", w, 4.0);
  static const special s[] = {
      {0.0f, 1.0f}, {-0.0f, 1.0f}, {INFINITY, INFINITY}, {-INFINITY, 0.0f}, {NAN, NAN},
      {89.0f, INFINITY}, {1e30f, INFINITY}, {-1e30f, 0.0f}, {-104.0f, 0.0f} /* e^-104 < 2^-150 */,
      {DMIN, 1.0f}, {-DMIN, 1.0f}, {FLT_MAX, INFINITY}, {-FLT_MAX, 0.0f},
  };
  check_specials("vm_expf", f_exp, s, NSPEC(s), 1);
}
END_TEST

START_TEST(test_logf) {
  worst w = {0};
  sweep_vm_logf(-INFINITY, INFINITY, STRIDE, &w);
  dense_vm_logf(0.70f, 0.72f, &w);        /* around the sqrt(1/2) split */
  dense_vm_logf(1.40f, 1.43f, &w);        /* around the sqrt(2) split */
  dense_vm_logf(0.999f, 1.001f, &w);      /* log near 0 */
  dense_vm_logf(DMIN, 0x1p-140f, &w);     /* subnormal inputs */
  ASSERT_ULP("vm_logf", w, 4.0);
  static const special s[] = {
      {1.0f, 0.0f}, {0.0f, -INFINITY}, {-0.0f, -INFINITY}, {-1.0f, NAN}, {-DMIN, NAN},
      {-INFINITY, NAN}, {INFINITY, INFINITY}, {NAN, NAN},
  };
  check_specials("vm_logf", f_log, s, NSPEC(s), 1);
}
END_TEST

START_TEST(test_tanhf) {
  worst w = {0};
  sweep_vm_tanhf(-INFINITY, INFINITY, STRIDE, &w);
  dense_vm_tanhf(0.06f, 0.0625f, &w);     /* the worst measured (2.61 ulp at 0.0619) */
  dense_vm_tanhf(0.17f, 0.176f, &w);      /* n of e^2|x| goes 0 -> 1 at ln2/4 */
  dense_vm_tanhf(-0.176f, -0.17f, &w);
  dense_vm_tanhf(0.515f, 0.525f, &w);     /* n 1 -> 2 */
  dense_vm_tanhf(8.5f, 10.5f, &w);        /* where tanh rounds to 1, and the cap at 10 */
  dense_vm_tanhf(1e-4f, 2e-4f, &w);
  dense_vm_tanhf(0x1p-149f, 0x1p-140f, &w); /* subnormals */
  ASSERT_ULP("vm_tanhf", w, 3.0);
  static const special s[] = {
      {0.0f, 0.0f}, {-0.0f, -0.0f}, {INFINITY, 1.0f}, {-INFINITY, -1.0f}, {NAN, NAN}, {-NAN, NAN},
      {DMIN, DMIN}, {-DMIN, -DMIN}, {FLT_MIN, FLT_MIN}, {-FLT_MIN, -FLT_MIN}, {1e-30f, 1e-30f},
      {20.0f, 1.0f}, {-20.0f, -1.0f}, {10.0f, 1.0f}, {-10.0f, -1.0f}, {FLT_MAX, 1.0f}, {-FLT_MAX, -1.0f},
  };
  check_specials("vm_tanhf", f_tanh, s, NSPEC(s), 1);
}
END_TEST

START_TEST(test_sigmoidf) {
  worst w = {0};
  sweep_vm_sigmoidf(-INFINITY, INFINITY, STRIDE, &w);
  dense_vm_sigmoidf(-104.5f, -86.0f, &w); /* subnormal results */
  dense_vm_sigmoidf(-2.0f, -1.9f, &w);
  dense_vm_sigmoidf(15.0f, 18.0f, &w);    /* where it rounds to 1 */
  ASSERT_ULP("vm_sigmoidf", w, 4.0);
  static const special s[] = {
      {0.0f, 0.5f}, {-0.0f, 0.5f}, {INFINITY, 1.0f}, {-INFINITY, 0.0f}, {NAN, NAN},
      {DMIN, 0.5f}, {-DMIN, 0.5f}, {200.0f, 1.0f}, {-200.0f, 0.0f}, {-FLT_MAX, 0.0f},
  };
  check_specials("vm_sigmoidf", f_sigmoid, s, NSPEC(s), 0);
}
END_TEST

START_TEST(test_erff) {
  worst w = {0};
  sweep_vm_erff(-INFINITY, INFINITY, STRIDE, &w);
  dense_vm_erff(0.45f, 0.55f, &w);        /* polynomial / erfc switch */
  dense_vm_erff(-0.55f, -0.45f, &w);
  dense_vm_erff(3.5f, 4.2f, &w);          /* where erf rounds to 1 */
  ASSERT_ULP("vm_erff", w, 4.0);
  static const special s[] = {
      {0.0f, 0.0f}, {-0.0f, -0.0f}, {INFINITY, 1.0f}, {-INFINITY, -1.0f}, {NAN, NAN},
      {DMIN, DMIN}, {-DMIN, -DMIN}, {10.0f, 1.0f}, {-10.0f, -1.0f}, {FLT_MAX, 1.0f},
  };
  check_specials("vm_erff", f_erf, s, NSPEC(s), 1);
}
END_TEST

START_TEST(test_sinf_cosf) {
  worst ws = {0}, wc = {0};
  sweep_vm_sinf(-12800.0f, 12800.0f, STRIDE, &ws);
  sweep_vm_cosf(-12800.0f, 12800.0f, STRIDE, &wc);
  /* near multiples of pi/2, where r is tiny: 4.712389 (3pi/2) and
   * 252.898209 (161 pi/2) are among the closest floats below 1e4 */
  dense_vm_sinf(4.7123f, 4.71248f, &ws);
  dense_vm_cosf(4.7123f, 4.71248f, &wc);
  dense_vm_sinf(252.898f, 252.8984f, &ws);
  dense_vm_cosf(252.898f, 252.8984f, &wc);
  dense_vm_sinf(12700.0f, 12800.0f, &ws);
  dense_vm_cosf(12700.0f, 12800.0f, &wc);
  ASSERT_ULP("vm_sinf", ws, 4.0);
  ASSERT_ULP("vm_cosf", wc, 4.0);

  /* past the accurate range: still within [-1, 1], nan only for inf/nan */
  int bad = 0;
  float bad_x = 0;
  for (uint64_t b = 0; b < (1ull << 32); b += STRIDE) {
    float x = from_bits((uint32_t)b);
    if (!isfinite(x)) continue;
    float s = vm_sinf(x), c = vm_cosf(x);
    if (!(fabsf(s) <= 1.0f && fabsf(c) <= 1.0f)) bad++, bad_x = x;
  }
  ck_assert_msg(bad == 0, "vm_sinf/vm_cosf: %d results outside [-1, 1], e.g. at x = %a", bad, (double)bad_x);

  static const special s[] = {
      {0.0f, 0.0f}, {-0.0f, -0.0f}, {INFINITY, NAN}, {-INFINITY, NAN}, {NAN, NAN},
      {DMIN, DMIN}, {-DMIN, -DMIN},
  };
  check_specials("vm_sinf", f_sin, s, NSPEC(s), 1);
  static const special c[] = {
      {0.0f, 1.0f}, {-0.0f, 1.0f}, {INFINITY, NAN}, {-INFINITY, NAN}, {NAN, NAN}, {DMIN, 1.0f},
  };
  check_specials("vm_cosf", f_cos, c, NSPEC(c), 1);
}
END_TEST

START_TEST(test_geluf) {
  worst w = {0};
  sweep_vm_geluf(-INFINITY, INFINITY, STRIDE, &w);
  dense_vm_geluf(-11.0f, -9.5f, &w);      /* results near FLT_MIN and below */
  dense_vm_geluf(-3.0f, -2.9f, &w);
  dense_vm_geluf(1.0f, 1.01f, &w);
  ASSERT_ULP("vm_geluf", w, 4.0);
  static const special s[] = {
      {0.0f, 0.0f}, {INFINITY, INFINITY}, {-INFINITY, 0.0f}, {NAN, NAN}, {-1e30f, 0.0f},
      {1e30f, 1e30f}, {-20.0f, 0.0f}, {20.0f, 20.0f}, {FLT_MAX, FLT_MAX}, {-FLT_MAX, 0.0f},
  };
  check_specials("vm_geluf", f_gelu, s, NSPEC(s), 0);
}
END_TEST

START_TEST(test_gelu_erff) {
  worst w = {0};
  sweep_vm_gelu_erff(-INFINITY, INFINITY, STRIDE, &w);
  dense_vm_gelu_erff(-14.5f, -12.5f, &w); /* subnormal results */
  dense_vm_gelu_erff(-0.75f, -0.65f, &w); /* erf / erfc switch at |x| = 0.5 sqrt2 */
  dense_vm_gelu_erff(0.65f, 0.75f, &w);
  dense_vm_gelu_erff(-3.3f, -3.2f, &w);
  ASSERT_ULP("vm_gelu_erff", w, 4.0);
  static const special s[] = {
      {0.0f, 0.0f}, {INFINITY, INFINITY}, {-INFINITY, 0.0f}, {NAN, NAN}, {-1e30f, 0.0f},
      {1e30f, 1e30f}, {-20.0f, 0.0f}, {20.0f, 20.0f}, {FLT_MAX, FLT_MAX}, {-FLT_MAX, 0.0f},
  };
  check_specials("vm_gelu_erff", f_gelu_erf, s, NSPEC(s), 0);
}
END_TEST

START_TEST(test_log1pf) {
  worst w = {0};
  sweep_vm_log1pf(-INFINITY, INFINITY, STRIDE, &w);
  dense_vm_log1pf(-1e-7f, -1e-8f, &w);    /* where 1 + x rounds */
  dense_vm_log1pf(0.41f, 0.42f, &w);      /* 1 + x near the sqrt(2) split of log */
  dense_vm_log1pf(-0.30f, -0.29f, &w);    /* near sqrt(1/2) */
  dense_vm_log1pf(-1.0f, -0.9999f, &w);
  ASSERT_ULP("vm_log1pf", w, 4.0);
  static const special s[] = {{0.0f, 0.0f}, {-0.0f, -0.0f}, {-1.0f, -INFINITY}, {-2.0f, NAN},
                              {INFINITY, INFINITY}, {-INFINITY, NAN}, {NAN, NAN}, {DMIN, DMIN}};
  check_specials("vm_log1pf", f_log1p, s, NSPEC(s), 1);
}
END_TEST

START_TEST(test_expm1f) {
  worst w = {0};
  sweep_vm_expm1f(-INFINITY, INFINITY, STRIDE, &w);
  dense_vm_expm1f(0.34f, 0.36f, &w);      /* n = 0 / 1 switch */
  dense_vm_expm1f(-0.36f, -0.34f, &w);
  dense_vm_expm1f(1e-6f, 2e-6f, &w);
  dense_vm_expm1f(19.9f, 20.1f, &w);      /* the switch to e^x - 1 */
  dense_vm_expm1f(88.0f, 88.7f, &w);
  ASSERT_ULP("vm_expm1f", w, 4.0);
  static const special s[] = {{0.0f, 0.0f}, {-0.0f, -0.0f}, {INFINITY, INFINITY}, {-INFINITY, -1.0f},
                              {NAN, NAN}, {-30.0f, -1.0f}, {DMIN, DMIN}, {100.0f, INFINITY}};
  check_specials("vm_expm1f", f_expm1, s, NSPEC(s), 1);
}
END_TEST

START_TEST(test_siluf) {
  worst w = {0};
  sweep_vm_siluf(-INFINITY, INFINITY, STRIDE, &w);
  dense_vm_siluf(-100.0f, -99.0f, &w);    /* results near FLT_MIN and below */
  dense_vm_siluf(-6.0f, -5.9f, &w);
  dense_vm_siluf(0.5f, 0.51f, &w);
  ASSERT_ULP("vm_siluf", w, 4.0);
  static const special s[] = {{0.0f, 0.0f}, {INFINITY, INFINITY}, {-INFINITY, -0.0f}, {NAN, NAN},
                              {-1e30f, -0.0f}, {1e30f, 1e30f}, {FLT_MAX, FLT_MAX}};
  check_specials("vm_siluf", f_silu, s, NSPEC(s), 1);
}
END_TEST

START_TEST(test_softplusf) {
  worst w = {0};
  sweep_vm_softplusf(-INFINITY, INFINITY, STRIDE, &w);
  dense_vm_softplusf(-104.0f, -100.0f, &w); /* subnormal results */
  dense_vm_softplusf(19.9f, 20.1f, &w);     /* the threshold */
  dense_vm_softplusf(0.001f, 0.01f, &w);
  dense_vm_softplusf(-0.01f, -0.001f, &w);
  ASSERT_ULP("vm_softplusf", w, 4.0);
  static const special s[] = {{INFINITY, INFINITY}, {-INFINITY, 0.0f}, {NAN, NAN}, {21.0f, 21.0f},
                              {-200.0f, 0.0f}, {FLT_MAX, FLT_MAX}};
  check_specials("vm_softplusf", f_softplus, s, NSPEC(s), 1);
}
END_TEST

/* f64: against long double references on a grid, relative error. */
START_TEST(test_f64) {
  double worst_s = 0, worst_g = 0, worst_ge = 0, at_s = 0, at_g = 0, at_ge = 0;
  /* [-20, 20]: below -21 the f64 GELU tail is subnormal */
  for (int i = -80000; i <= 80000; i++) {
    double x = i / 4000.0;
    long double xl = x;
    long double rs = 1.0L / (1.0L + expl(-xl));
    long double ul = 0.7978845608028654L * (xl + 0.044715L * xl * xl * xl);
    long double rg = xl / (1.0L + expl(-2.0L * ul));
    long double rge = 0.5L * xl * erfcl(-xl / sqrtl(2.0L));
    double es = rs == 0 ? fabs(vm_sigmoid(x)) : fabsl((vm_sigmoid(x) - rs) / rs);
    double eg = rg == 0 ? fabs(vm_gelu(x)) : fabsl((vm_gelu(x) - rg) / rg);
    double ege = rge == 0 ? fabs(vm_gelu_erf(x)) : fabsl((vm_gelu_erf(x) - rge) / rge);
    /* the tails' exponents are ~|2u| or x^2/2: rounding x^3 and x/sqrt2 in
     * f64 costs a relative 1e-16 of those */
    double tol_g = 1e-15 * (1.0 + fabs((double)ul) * 2.0);
    double tol_ge = 1e-15 * (1.0 + x * x);
    if (es / 1e-15 > worst_s) worst_s = es / 1e-15, at_s = x;
    if (eg / tol_g > worst_g) worst_g = eg / tol_g, at_g = x;
    if (ege / tol_ge > worst_ge) worst_ge = ege / tol_ge, at_ge = x;
  }
  ck_assert_msg(worst_s <= 1.0, "vm_sigmoid: relative error %.3g of tolerance at x = %g", worst_s, at_s);
  ck_assert_msg(worst_g <= 1.0, "vm_gelu: relative error %.3g of tolerance at x = %g", worst_g, at_g);
  ck_assert_msg(worst_ge <= 1.0, "vm_gelu_erf: relative error %.3g of tolerance at x = %g", worst_ge, at_ge);
  ck_assert(vm_sigmoid(-INFINITY) == 0.0 && vm_sigmoid(INFINITY) == 1.0 && isnan(vm_sigmoid(NAN)));
  ck_assert(vm_gelu(-INFINITY) == 0.0 && vm_gelu(INFINITY) == INFINITY && isnan(vm_gelu(NAN)));
  ck_assert(vm_gelu_erf(-INFINITY) == 0.0 && vm_gelu_erf(INFINITY) == INFINITY);
  ck_assert(vm_exp(0.0) == 1.0 && vm_log(1.0) == 0.0 && vm_tanh(-0.0) == 0.0 && signbit(vm_tanh(-0.0)));
  ck_assert(vm_erf(INFINITY) == 1.0 && vm_sin(0.0) == 0.0 && vm_cos(0.0) == 1.0);
  /* silu and softplus: the stable forms against long double on [-60, 60] */
  double worst_si = 0, worst_sp = 0;
  for (int i = -240000; i <= 240000; i++) {
    double x = i / 4000.0;
    long double xl = x;
    long double rsi = xl / (1.0L + expl(-xl)), rsp = x > 20.0 ? xl : log1pl(expl(xl));
    double esi = rsi == 0 ? fabs(vm_silu(x)) : fabsl((vm_silu(x) - rsi) / rsi);
    double esp = fabsl((vm_softplus(x) - rsp) / rsp);
    if (esi > worst_si) worst_si = esi;
    if (esp > worst_sp) worst_sp = esp;
  }
  ck_assert_msg(worst_si <= 1e-15 && worst_sp <= 1e-15, "vm_silu %.3g, vm_softplus %.3g", worst_si, worst_sp);
  ck_assert(vm_silu(-INFINITY) == 0.0 && signbit(vm_silu(-INFINITY)) && isnan(vm_silu(NAN)));
  ck_assert(vm_softplus(INFINITY) == INFINITY && vm_softplus(-INFINITY) == 0.0 && isnan(vm_softplus(NAN)));
}
END_TEST

static Suite *vmath_suite(void) {
  Suite *s = suite_create("vmath");
  TCase *tc = tcase_create("f32");
  tcase_set_timeout(tc, 120); /* full-range sweeps under sanitizers */
  tcase_add_test(tc, test_expf);
  tcase_add_test(tc, test_logf);
  tcase_add_test(tc, test_tanhf);
  tcase_add_test(tc, test_sigmoidf);
  tcase_add_test(tc, test_erff);
  tcase_add_test(tc, test_sinf_cosf);
  tcase_add_test(tc, test_geluf);
  tcase_add_test(tc, test_gelu_erff);
  tcase_add_test(tc, test_log1pf);
  tcase_add_test(tc, test_expm1f);
  tcase_add_test(tc, test_siluf);
  tcase_add_test(tc, test_softplusf);
  suite_add_tcase(s, tc);
  TCase *td = tcase_create("f64");
  tcase_add_test(td, test_f64);
  suite_add_tcase(s, td);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(vmath_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed;
}
