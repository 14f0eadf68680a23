/* The narrow dtypes i32, f16 and bf16: the conversions against independent
 * references (the compiler's _Float16, exact rounding in double), casts that
 * round trip, torch's promotion, eager against the interpreter and LLVM at
 * narrow dtypes (a compiled cast rounds bit for bit as eager does), autograd
 * in f16, the IR text, and errors that name the op and the dtypes. The ops
 * against numpy are test_ops_ref's "narrow" family. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "eager/half.h"
#include "kiln.h"

static uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Low 13 (f16) or 16 (bf16) bits that make ties, near-ties and plain values. */
static const uint32_t lows16[] = {0, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000};
static const uint32_t lows13[] = {0, 1, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x0800, 0x17ff};

/* bf16 of f by exact arithmetic: f's value rounded to 8 significant bits, ties to even. */
static uint16_t bf16_ref(float f) {
  if (isnan(f)) return 0x7fc0;
  double x = f;
  if (x == 0 || isinf(x)) return (uint16_t)(bits_of(f) >> 16);
  int e = ilogb(x);
  if (e < -126) e = -126; /* f32's subnormals: bf16 has the same exponent range */
  double ulp = ldexp(1, e - 7), r = nearbyint(x / ulp) * ulp;
  if (fabs(r) >= 0x1p128) return signbit(x) ? 0xff80 : 0x7f80;
  return (uint16_t)(bits_of((float)r) >> 16);
}

START_TEST(test_f16_conversion_exhaustive) {
#ifdef __FLT16_MANT_DIG__
  /* every f16 to f32, and back */
  for (uint32_t h = 0; h < 65536; h++) {
    _Float16 r;
    uint16_t hb = (uint16_t)h;
    memcpy(&r, &hb, 2);
    float want = (float)r, got = half_to_float(hb);
    if (isnan(want)) {
      ck_assert_msg(isnan(got), "f16 %04x: want NaN", h);
      ck_assert_msg((half_from_float(got) & 0x7e00) == 0x7e00, "f16 %04x: NaN back as a quiet NaN", h);
      continue;
    }
    ck_assert_msg(bits_of(want) == bits_of(got), "f16 %04x: want %a got %a", h, (double)want, (double)got);
    ck_assert_msg(half_from_float(got) == hb, "f16 %04x does not round trip", h);
  }
  /* f32 to f16: every upper 19 bits with low bits at, around and between the ties */
  for (uint32_t hi = 0; hi < (1u << 19); hi++)
    for (int k = 0; k < 8; k++) {
      float f = float_of(hi << 13 | lows13[k]);
      if (isnan(f)) continue;
      _Float16 r = (_Float16)f;
      uint16_t want;
      memcpy(&want, &r, 2);
      ck_assert_msg(half_from_float(f) == want, "f32 %a: want f16 %04x got %04x", (double)f, want, half_from_float(f));
    }
#else
  ck_assert_msg(0, "this compiler has no _Float16 to check against");
#endif
}
END_TEST

START_TEST(test_bf16_conversion_exhaustive) {
  for (uint32_t h = 0; h < 65536; h++) {
    float f = bf16_to_float((uint16_t)h);
    ck_assert_uint_eq(h << 16, bits_of(f));
    if (!isnan(f)) ck_assert_uint_eq(h, bf16_from_float(f));
    else ck_assert_uint_eq(h | 0x40, bf16_from_float(f)); /* quieted, payload kept */
  }
  for (uint32_t hi = 0; hi < 65536; hi++)
    for (int k = 0; k < 8; k++) {
      float f = float_of(hi << 16 | lows16[k]);
      if (isnan(f)) continue;
      ck_assert_msg(bf16_from_float(f) == bf16_ref(f), "f32 %a: want bf16 %04x got %04x", (double)f, bf16_ref(f),
                    bf16_from_float(f));
    }
}
END_TEST

/* f64 to f16 rounds once: 1 + 2^-11 + 2^-40 is just above a tie (up), which
 * rounding to f32 first would turn into the tie itself (down to even). */
START_TEST(test_f64_narrows_once) {
  kiln_scope_begin();
  double v[2] = {1 + 0x1p-11 + 0x1p-40, 1 + 0x1p-8 + 0x1p-40};
  kiln_tensor *x = kiln_tensor_from(KILN_F64, KILN_SHAPE(2), v);
  uint16_t h[2], b[2];
  ck_assert_int_eq(0, kiln_read(kiln_cast(x, KILN_F16), h, sizeof h));
  ck_assert_int_eq(0, kiln_read(kiln_cast(x, KILN_BF16), b, sizeof b));
  ck_assert_uint_eq(0x3c01, h[0]); /* 1 + 2^-10 */
  ck_assert_uint_eq(0x3f81, b[1]); /* 1 + 2^-7 */
  /* a scalar made from a double rounds once too */
  ck_assert(kiln_item(kiln_scalar(KILN_F16, v[0])) == 1 + 0x1p-10);
  ck_assert(kiln_item(kiln_scalar(KILN_BF16, v[1])) == 1 + 0x1p-7);
  kiln_scope_end();
}
END_TEST

/* Every dtype to every other and back: the values that fit come back, ints
 * saturate or wrap as documented, item and read see the narrow values. */
START_TEST(test_casts_round_trip) {
  kiln_scope_begin();
  static const kiln_dtype all[] = {KILN_F32, KILN_F64, KILN_I64, KILN_I32, KILN_F16, KILN_BF16};
  double v[6] = {0, 1, -2, 3, 96, -128}; /* exact in every dtype */
  kiln_tensor *x = kiln_tensor_from(KILN_F64, KILN_SHAPE(6), v);
  for (int i = 0; i < 6; i++)
    for (int j = 0; j < 6; j++) {
      kiln_tensor *y = kiln_cast(kiln_cast(kiln_cast(x, all[i]), all[j]), KILN_F64);
      double got[6];
      ck_assert_int_eq(0, kiln_read(y, got, sizeof got));
      for (int k = 0; k < 6; k++)
        ck_assert_msg(got[k] == v[k], "%s -> %s: %g became %g", kiln_dtype_name(all[i]), kiln_dtype_name(all[j]), v[k],
                      got[k]);
    }
  ck_assert_uint_eq(2, kiln_dtype_size(KILN_F16));
  ck_assert_uint_eq(2, kiln_dtype_size(KILN_BF16));
  ck_assert_uint_eq(4, kiln_dtype_size(KILN_I32));
  ck_assert_str_eq("bf16", kiln_dtype_name(KILN_BF16));
  /* f16 overflows to Inf, i32 saturates from floats and wraps from i64 */
  ck_assert(isinf(kiln_item(kiln_cast(kiln_scalar(KILN_F32, 70000), KILN_F16))));
  ck_assert(kiln_item(kiln_cast(kiln_scalar(KILN_F32, 1e10), KILN_I32)) == 2147483647.0);
  ck_assert(kiln_item(kiln_cast(kiln_scalar(KILN_I64, 4294967297.0), KILN_I32)) == 1.0);
  ck_assert(kiln_item(kiln_scalar(KILN_BF16, 1.0 / 3)) == 0x1.56p-2); /* 8 significant bits */
  int32_t iv[3] = {-5, 0, 2147483647};
  int32_t back[3];
  ck_assert_int_eq(0, kiln_read(kiln_tensor_from(KILN_I32, KILN_SHAPE(3), iv), back, sizeof back));
  ck_assert(back[0] == -5 && back[2] == 2147483647);
  kiln_scope_end();
}
END_TEST

static kiln_dtype add_type(kiln_dtype a, int na, kiln_dtype b, int nb) {
  kiln_tensor *x = na ? kiln_zeros(a, KILN_SHAPE(2)) : kiln_scalar(a, 1);
  kiln_tensor *y = nb ? kiln_zeros(b, KILN_SHAPE(2)) : kiln_scalar(b, 1);
  kiln_tensor *z = kiln_add(x, y);
  ck_assert_msg(z != NULL, "%s", kiln_last_error());
  return kiln_type(z);
}

/* torch.result_type on the same pairs */
START_TEST(test_promotion) {
  kiln_scope_begin();
  ck_assert_int_eq(KILN_F16, add_type(KILN_F16, 1, KILN_F16, 1));
  ck_assert_int_eq(KILN_F32, add_type(KILN_BF16, 1, KILN_F32, 1));
  ck_assert_int_eq(KILN_F32, add_type(KILN_F16, 1, KILN_BF16, 1));
  ck_assert_int_eq(KILN_F64, add_type(KILN_F16, 1, KILN_F64, 1));
  ck_assert_int_eq(KILN_I64, add_type(KILN_I32, 1, KILN_I64, 1));
  ck_assert_int_eq(KILN_F16, add_type(KILN_I32, 1, KILN_F16, 1));
  ck_assert_int_eq(KILN_BF16, add_type(KILN_I64, 1, KILN_BF16, 1));
  ck_assert_int_eq(KILN_I32, add_type(KILN_BOOL, 1, KILN_I32, 1));
  /* a 0-d operand of the same kind does not widen */
  ck_assert_int_eq(KILN_BF16, add_type(KILN_BF16, 1, KILN_F32, 0));
  ck_assert_int_eq(KILN_I32, add_type(KILN_I32, 1, KILN_I64, 0));
  ck_assert_int_eq(KILN_F16, add_type(KILN_F16, 1, KILN_F64, 0));
  /* ... of a higher kind does */
  ck_assert_int_eq(KILN_F32, add_type(KILN_I32, 1, KILN_F32, 0));
  kiln_scope_end();
}
END_TEST

static void expect_error(const char *what, const char *a, const char *b) {
  const char *e = kiln_last_error();
  ck_assert_msg(e && strstr(e, what) && strstr(e, a) && (!b || strstr(e, b)) && strstr(e, "test_dtypes.c:"),
                "error '%s' should name %s, %s%s%s and the caller's line", e ? e : "(none)", what, a, b ? " and " : "",
                b ? b : "");
}

START_TEST(test_errors_name_op_and_dtype) {
  kiln_scope_begin();
  kiln_tensor *i = kiln_zeros(KILN_I32, KILN_SHAPE(3));
  ck_assert_ptr_null(kiln_exp(i));
  expect_error("exp", "i32", NULL);
  ck_assert_ptr_null(kiln_matmul(kiln_zeros(KILN_BF16, KILN_SHAPE(2, 3)), kiln_zeros(KILN_BF16, KILN_SHAPE(4, 2))));
  expect_error("matmul", "[2,3]", "[4,2]");
  kiln_requires_grad(i, true);
  expect_error("requires_grad", "i32", NULL);
  ck_assert_ptr_null(kiln_zeros((kiln_dtype)99, KILN_SHAPE(2)));
  expect_error("zeros", "unknown dtype 99", NULL);
  uint16_t small[2];
  ck_assert_int_eq(-1, kiln_read(kiln_zeros(KILN_F16, KILN_SHAPE(3)), small, sizeof small));
  expect_error("read", "f16[3]", "6 bytes");
  kiln_scope_end();
}
END_TEST

/* d(sum(x*x + x))/dx = 2x + 1, exact in f16 for these x; the gradient is f16 */
START_TEST(test_autograd_f16) {
  kiln_scope_begin();
  float v[4] = {0.5f, -1.25f, 3.0f, 100.0f};
  kiln_tensor *x = kiln_cast(kiln_tensor_from(KILN_F32, KILN_SHAPE(4), v), KILN_F16);
  kiln_requires_grad(x, true);
  kiln_tensor *loss = kiln_sum_all(kiln_add(kiln_mul(x, x), x));
  ck_assert_int_eq(KILN_F16, kiln_type(loss));
  ck_assert_int_eq(0, kiln_backward(loss));
  kiln_tensor *g = kiln_grad(x);
  ck_assert_int_eq(KILN_F16, kiln_type(g));
  float got[4];
  ck_assert_int_eq(0, kiln_read(kiln_cast(g, KILN_F32), got, sizeof got));
  for (int k = 0; k < 4; k++) ck_assert_msg(got[k] == 2 * v[k] + 1, "grad %d: %g", k, (double)got[k]);
  /* bf16 weights under an f32 input: the matmul is f32 and the weight's gradient bf16 */
  kiln_tensor *w = kiln_cast(kiln_randn(KILN_F32, KILN_SHAPE(3, 2), 1), KILN_BF16);
  kiln_requires_grad(w, true);
  kiln_tensor *in = kiln_ones(KILN_F32, KILN_SHAPE(1, 3));
  kiln_tensor *y = kiln_matmul(in, w);
  ck_assert_int_eq(KILN_F32, kiln_type(y));
  ck_assert_int_eq(0, kiln_backward(kiln_sum_all(y)));
  ck_assert_int_eq(KILN_BF16, kiln_type(kiln_grad(w)));
  ck_assert(kiln_item(kiln_sum_all(kiln_grad(w))) == 6.0); /* d/dw of sum(1*w): ones */
  kiln_scope_end();
}
END_TEST

/* ---- compiled ---- */

static int cast_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = kiln_cast(in[0], *(const kiln_dtype *)ctx);
  return out[0] ? 0 : -1;
}

static kiln_tensor *run_compiled(kiln_body body, void *ctx, int n_in, kiln_tensor *const *in, int backend) {
  kiln_options o = {.name = "narrow", .n_in = n_in, .n_out = 1, .backend = backend};
  kiln_fn *fn = kiln_compile(body, ctx, &o);
  ck_assert_ptr_nonnull(fn);
  kiln_tensor *y = NULL;
  ck_assert_msg(kiln_call(fn, in, &y) == 0, "%s", kiln_last_error()); /* the trace */
  ck_assert_msg(kiln_call(fn, in, &y) == 0, "%s", kiln_last_error()); /* compiled */
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(1, st.hits);
  kiln_fn_free(fn);
  return y;
}

static void expect_same_bits(kiln_tensor *a, kiln_tensor *b, const char *what) {
  size_t n = (size_t)kiln_numel(a) * kiln_dtype_size(kiln_type(a));
  ck_assert_int_eq(kiln_type(a), kiln_type(b));
  unsigned char *x = malloc(n), *y = malloc(n);
  ck_assert_int_eq(0, kiln_read(a, x, n));
  ck_assert_int_eq(0, kiln_read(b, y, n));
  size_t bad = n;
  for (size_t k = 0; k < n && bad == n; k++)
    if (x[k] != y[k]) bad = k;
  ck_assert_msg(bad == n, "%s: byte %zu differs", what, bad);
  free(x), free(y);
}

/* A compiled cast rounds exactly as eager: every f16 and bf16 pattern to f32
 * and back, and f32 values at, around and between the ties. */
START_TEST(test_compiled_casts_match_eager_bits) {
  kiln_scope_begin();
  uint16_t *all = malloc(65536 * 2);
  for (uint32_t h = 0; h < 65536; h++) all[h] = (uint16_t)h;
  uint32_t n = 1u << 16;
  float *f = malloc(sizeof(float) * n * 2);
  for (uint32_t k = 0; k < 2 * n; k++) f[k] = float_of((k / 2) * 0x10001u * 13u ^ (k & 1 ? 0x1000 : 0x8000));
  kiln_tensor *xf = kiln_tensor_from(KILN_F32, KILN_SHAPE(2 * n), f);
  for (int b = 0; b < 2; b++) {
    kiln_dtype dt = b ? KILN_BF16 : KILN_F16, f32 = KILN_F32;
    kiln_tensor *xh = kiln_tensor_from(dt, KILN_SHAPE(65536), all);
    for (int be = KILN_BACKEND_INTERP; be <= KILN_BACKEND_LLVM; be++) {
      expect_same_bits(kiln_cast(xh, f32), run_compiled(cast_body, &f32, 1, &xh, be), "to f32");
      expect_same_bits(kiln_cast(xf, dt), run_compiled(cast_body, &dt, 1, &xf, be), "from f32");
    }
  }
  free(all), free(f);
  kiln_scope_end();
}
END_TEST

/* y = sigmoid(x * w + b) - mean over rows, at each narrow dtype */
static int mix_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *y = kiln_add(kiln_mul(in[0], in[1]), in[2]);
  if (kiln_type(y) != KILN_I32) y = kiln_sigmoid(y);
  out[0] = kiln_sub(y, kiln_mean(kiln_cast(y, KILN_F32), 1, true));
  return out[0] ? 0 : -1;
}

static double max_rel_diff(kiln_tensor *a, kiln_tensor *b) {
  int64_t n = kiln_numel(a);
  double *x = malloc(sizeof(double) * (size_t)n), *y = malloc(sizeof(double) * (size_t)n), worst = 0;
  ck_assert_int_eq(0, kiln_read(kiln_cast(a, KILN_F64), x, sizeof(double) * (size_t)n));
  ck_assert_int_eq(0, kiln_read(kiln_cast(b, KILN_F64), y, sizeof(double) * (size_t)n));
  for (int64_t k = 0; k < n; k++) {
    double d = fabs(x[k] - y[k]) / (1 + fabs(y[k]));
    if (!(d <= worst)) worst = d;
  }
  free(x), free(y);
  return worst;
}

START_TEST(test_eager_interp_llvm_agree) {
  kiln_scope_begin();
  static const kiln_dtype dts[] = {KILN_F16, KILN_BF16, KILN_I32};
  for (int d = 0; d < 3; d++) {
    kiln_dtype dt = dts[d];
    kiln_tensor *in[3];
    for (int k = 0; k < 3; k++) {
      kiln_tensor *r = kiln_randn(KILN_F32, KILN_SHAPE(k == 2 ? 1 : 37, 53), (uint64_t)(10 * d + k));
      in[k] = kiln_cast(dt == KILN_I32 ? kiln_mul(r, kiln_scalar(KILN_F32, 100)) : r, dt);
    }
    kiln_tensor *want = NULL;
    ck_assert_int_eq(0, mix_body(NULL, in, &want));
    /* the narrow part rounds where eager rounds; the f32 mean may sum in another order */
    for (int be = KILN_BACKEND_INTERP; be <= KILN_BACKEND_LLVM; be++) {
      kiln_tensor *got = run_compiled(mix_body, NULL, 3, in, be);
      ck_assert_int_eq(kiln_type(want), kiln_type(got));
      double e = max_rel_diff(got, want);
      ck_assert_msg(e <= 1e-6, "%s, backend %d: %g", kiln_dtype_name(dt), be, e);
    }
  }
  kiln_scope_end();
}
END_TEST

/* The newer ops at f16 and bf16: eager computes wide and rounds once, so a
 * pointwise op equals the f32 op on the widened input, rounded; the data
 * movement ops move narrow values exactly; a composite rounds between its ops
 * (within a few narrow ulps of the f32 answer). The interpreter and LLVM
 * agree with eager. */
enum { N_NEWER = 16 };
static kiln_tensor *newer_op(int k, kiln_tensor *x) {
  kiln_tensor *idx = kiln_arange(KILN_I64, 4, -1, -1), *v = NULL, *w; /* 4 3 2 1 0 */
  switch (k) {
  case 0: return kiln_silu(x);
  case 1: return kiln_softplus(x);
  case 2: return kiln_log1p(kiln_abs(x));
  case 3: return kiln_expm1(x);
  case 4: return kiln_floor(x);
  case 5: return kiln_round(kiln_mul_scalar(x, 4));
  case 6: return kiln_sign(x);
  case 7: return kiln_clamp(x, -0.5, 0.75);
  case 8: return kiln_leaky_relu(x, 0.1);
  case 9: return kiln_tril(x, 0);
  case 10: return kiln_pad(x, 2, ((int64_t[]){1, 2}), 0.5);
  case 11: return kiln_gather(x, 1, kiln_expand(kiln_reshape(idx, KILN_SHAPE(1, 5)), KILN_SHAPE(kiln_size(x, 0), 5)));
  case 12: return kiln_topk(x, 3, 1, true, &v, NULL) ? NULL : v;
  case 13: return kiln_cumsum(x, 1);
  case 14: return kiln_logsumexp(x, 1, true);
  default:
    w = kiln_cast(kiln_ones(KILN_F32, KILN_SHAPE(kiln_size(x, 1))), kiln_type(x));
    return kiln_rms_norm(x, w, 1e-5);
  }
}

static int newer_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = newer_op(*(int *)ctx, in[0]);
  return out[0] ? 0 : -1;
}

START_TEST(test_newer_ops_narrow) {
  kiln_scope_begin();
  for (int d = 0; d < 2; d++) {
    kiln_dtype dt = d ? KILN_BF16 : KILN_F16;
    double ulp = d ? 0x1p-7 : 0x1p-10;
    kiln_tensor *x = kiln_cast(kiln_mul_scalar(kiln_randn(KILN_F32, KILN_SHAPE(6, 9), 40 + (uint64_t)d), 2), dt);
    for (int k = 0; k < N_NEWER; k++) {
      kiln_tensor *got = newer_op(k, x), *wide = newer_op(k, kiln_cast(x, KILN_F32));
      ck_assert_msg(got != NULL, "op %d at %s: %s", k, kiln_dtype_name(dt), kiln_last_error());
      ck_assert_int_eq(kiln_type(got), dt);
      double e = max_rel_diff(got, kiln_cast(wide, dt)), bound = k >= 13 ? 8 * ulp : 0;
      ck_assert_msg(e <= bound, "op %d at %s: %g from f32's rounded", k, kiln_dtype_name(dt), e);
      for (int be = KILN_BACKEND_INTERP; be <= KILN_BACKEND_LLVM; be++) {
        double c = max_rel_diff(run_compiled(newer_body, &k, 1, &x, be), got);
        ck_assert_msg(c <= (k >= 13 ? 2 * ulp : 0), "op %d at %s, backend %d: %g from eager", k, kiln_dtype_name(dt), be, c);
      }
    }
  }
  kiln_scope_end();
}
END_TEST

/* A decode step: (1,288) f32 activations times (288,288) bf16 weights. The
 * compiled matvec reads the weights as bf16 (the cast fuses into it: one
 * kernel, no f32 copy of the weights in the plan), and agrees with eager. */
static int decode_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor *w = ctx;
  out[0] = kiln_relu(kiln_matmul(in[0], w));
  return out[0] ? 0 : -1;
}

START_TEST(test_bf16_decode_step) {
  kiln_scope_begin();
  kiln_tensor *w = kiln_keep(kiln_cast(kiln_randn(KILN_F32, KILN_SHAPE(288, 288), 7), KILN_BF16));
  kiln_tensor *x = kiln_randn(KILN_F32, KILN_SHAPE(1, 288), 8), *want = NULL;
  ck_assert_int_eq(0, decode_body(w, &x, &want));
  char dir[] = "/tmp/kiln_dtypesXXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  setenv("KILN_DUMP_DIR", dir, 1);
  kiln_options o = {.name = "decode", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM, .dump = KILN_DUMP_KERNELS};
  kiln_fn *fn = kiln_compile(decode_body, w, &o);
  unsetenv("KILN_DUMP_DIR");
  kiln_tensor *got = NULL;
  for (int c = 0; c < 2; c++) ck_assert_int_eq(0, kiln_call(fn, &x, &got));
  ck_assert_double_le(max_rel_diff(got, want), 1e-5);
  char path[256], buf[8192] = "";
  snprintf(path, sizeof path, "%s/decode.1.kernels.txt", dir);
  FILE *f = fopen(path, "r");
  ck_assert_msg(f != NULL, "%s missing", path);
  buf[fread(buf, 1, sizeof buf - 1, f)] = 0;
  fclose(f);
  remove(path);
  rmdir(dir);
  ck_assert_msg(strstr(buf, "kernels of decode: 1\n") && strstr(buf, "matvec") && strstr(buf, "input %1 bf16[288,288]") &&
                    !strstr(buf, "f32[288,288]"),
                "%s", buf);
  kiln_fn_free(fn);
  kiln_release(w);
  kiln_scope_end();
}
END_TEST

/* The IR text names f16, bf16 and i32, and a saved graph loads and computes the same */
START_TEST(test_ir_text_round_trip) {
  kiln_scope_begin();
  kiln_tensor *in[3] = {kiln_cast(kiln_randn(KILN_F32, KILN_SHAPE(4, 5), 1), KILN_F16),
                        kiln_cast(kiln_randn(KILN_F32, KILN_SHAPE(4, 5), 2), KILN_F16),
                        kiln_cast(kiln_randn(KILN_F32, KILN_SHAPE(1, 5), 3), KILN_F16)};
  kiln_options o = {.name = "text", .n_in = 3, .n_out = 1};
  kiln_fn *fn = kiln_compile(mix_body, NULL, &o);
  kiln_tensor *want = NULL, *got = NULL;
  ck_assert_int_eq(0, kiln_call(fn, in, &want));
  char *text = kiln_fn_graph(fn, 0);
  ck_assert_ptr_nonnull(strstr(text, "f16[4,5]"));
  kiln_fn *back = kiln_load_string(text);
  ck_assert_msg(back != NULL, "%s\n%s", kiln_last_error(), text);
  ck_assert_int_eq(0, kiln_call(back, in, &got));
  expect_same_bits(want, got, "loaded graph");
  free(text);
  kiln_fn_free(back);
  kiln_fn_free(fn);
  const char *consts = "graph c(%0: bf16[2]) -> (%2)\n"
                       "  %1: bf16[2] = const(0x1.56p-2, -3)\n"
                       "  %2: bf16[2] = add(%0, %1)\n";
  kiln_fn *cf = kiln_load_string(consts);
  ck_assert_msg(cf != NULL, "%s", kiln_last_error());
  kiln_tensor *z = kiln_zeros(KILN_BF16, KILN_SHAPE(2)), *r = NULL;
  ck_assert_int_eq(0, kiln_call(cf, &z, &r));
  ck_assert(kiln_item(kiln_sum_all(kiln_cast(r, KILN_F64))) == 0x1.56p-2 - 3);
  kiln_fn_free(cf);
  kiln_scope_end();
}
END_TEST

int main(void) {
  Suite *s = suite_create("dtypes");
  TCase *tc = tcase_create("dtypes");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_f16_conversion_exhaustive);
  tcase_add_test(tc, test_bf16_conversion_exhaustive);
  tcase_add_test(tc, test_f64_narrows_once);
  tcase_add_test(tc, test_casts_round_trip);
  tcase_add_test(tc, test_promotion);
  tcase_add_test(tc, test_errors_name_op_and_dtype);
  tcase_add_test(tc, test_autograd_f16);
  tcase_add_test(tc, test_compiled_casts_match_eager_bits);
  tcase_add_test(tc, test_eager_interp_llvm_agree);
  tcase_add_test(tc, test_bf16_decode_step);
  tcase_add_test(tc, test_newer_ops_narrow);
  tcase_add_test(tc, test_ir_text_round_trip);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
