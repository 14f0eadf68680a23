/* Pointwise kernels: binary, unary, where, cast and copy, for every dtype.
 * Each inner loop has fast paths for unit and zero (broadcast) strides that
 * the compiler vectorizes, and a general strided path; the iterator splits
 * large tensors across the pool. */
#include <math.h>
#include <string.h>

#include "eager/half.h"
#include "eager/iter.h"
#include "eager/vmath.h"

/* ---- binary ---- */

/* The loop body with the three stride cases the compiler can vectorize. */
#define BIN_BODY(T, TO, EXPR)                                                     \
  do {                                                                            \
    TO *o = (TO *)p[0];                                                           \
    const T *xp = (const T *)p[1], *yp = (const T *)p[2];                         \
    int64_t so = s[0], sx = s[1], sy = s[2];                                      \
    if (so == 1 && sx == 1 && sy == 1) {                                          \
      for (int64_t i = 0; i < n; i++) { T x = xp[i], y = yp[i]; o[i] = (EXPR); }  \
    } else if (so == 1 && sx == 1 && sy == 0) {                                   \
      T y = yp[0];                                                                \
      for (int64_t i = 0; i < n; i++) { T x = xp[i]; o[i] = (EXPR); }             \
    } else if (so == 1 && sx == 0 && sy == 1) {                                   \
      T x = xp[0];                                                                \
      for (int64_t i = 0; i < n; i++) { T y = yp[i]; o[i] = (EXPR); }             \
    } else {                                                                      \
      for (int64_t i = 0; i < n; i++) {                                           \
        T x = xp[i * sx], y = yp[i * sy];                                         \
        o[i * so] = (EXPR);                                                       \
      }                                                                           \
    }                                                                             \
  } while (0)

#define BIN_FLOAT(T, SFX, POWF)                                                     \
  KILN_HOT static void add_##SFX(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(T, T, x + y); } \
  KILN_HOT static void sub_##SFX(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(T, T, x - y); } \
  KILN_HOT static void mul_##SFX(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(T, T, x * y); } \
  KILN_HOT static void div_##SFX(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(T, T, x / y); } \
  KILN_HOT static void max_##SFX(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(T, T, MAXNAN(x, y)); } \
  KILN_HOT static void min_##SFX(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(T, T, MINNAN(x, y)); } \
  KILN_HOT static void pow_##SFX(char **p, const int64_t *s, int64_t n, const void *c) {   \
    (void)c;                                                                      \
    if (s[2] == 0) { /* common exponents as products: exact and vectorized */     \
      T e = *(const T *)p[2];                                                     \
      if (e == 2) { BIN_BODY(T, T, x * x + 0 * y); return; }                      \
      if (e == 3) { BIN_BODY(T, T, x * x * x + 0 * y); return; }                  \
      if (e == 1) { BIN_BODY(T, T, x + 0 * y); return; }                          \
    }                                                                             \
    BIN_BODY(T, T, POWF(x, y));                                                   \
  }

BIN_FLOAT(float, f32, powf)
BIN_FLOAT(double, f64, pow)

KILN_HOT static void add_i64(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(int64_t, int64_t, (int64_t)((uint64_t)x + (uint64_t)y)); }
KILN_HOT static void sub_i64(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(int64_t, int64_t, (int64_t)((uint64_t)x - (uint64_t)y)); }
KILN_HOT static void mul_i64(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(int64_t, int64_t, (int64_t)((uint64_t)x * (uint64_t)y)); }
KILN_HOT static void max_i64(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(int64_t, int64_t, x > y ? x : y); }
KILN_HOT static void min_i64(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(int64_t, int64_t, x < y ? x : y); }

#define CMP_ALL(T, SFX)                                                                                          \
  KILN_HOT static void eq_##SFX(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(T, bool, x == y); } \
  KILN_HOT static void ne_##SFX(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(T, bool, x != y); } \
  KILN_HOT static void lt_##SFX(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(T, bool, x < y); }  \
  KILN_HOT static void le_##SFX(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(T, bool, x <= y); } \
  KILN_HOT static void gt_##SFX(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(T, bool, x > y); }  \
  KILN_HOT static void ge_##SFX(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; BIN_BODY(T, bool, x >= y); }
CMP_ALL(float, f32)
CMP_ALL(double, f64)
CMP_ALL(int64_t, i64)
CMP_ALL(bool, b8)

/* [op][dtype]; NULL where the shape rule refuses the combination */
static const iter_inner binary_loops[OP_COUNT][4] = {
    [OP_ADD] = {add_f32, add_f64, add_i64, NULL},
    [OP_SUB] = {sub_f32, sub_f64, sub_i64, NULL},
    [OP_MUL] = {mul_f32, mul_f64, mul_i64, NULL},
    [OP_DIV] = {div_f32, div_f64, NULL, NULL},
    [OP_POW] = {pow_f32, pow_f64, NULL, NULL},
    [OP_MAXIMUM] = {max_f32, max_f64, max_i64, NULL},
    [OP_MINIMUM] = {min_f32, min_f64, min_i64, NULL},
    [OP_EQ] = {eq_f32, eq_f64, eq_i64, eq_b8},
    [OP_NE] = {ne_f32, ne_f64, ne_i64, ne_b8},
    [OP_LT] = {lt_f32, lt_f64, lt_i64, lt_b8},
    [OP_LE] = {le_f32, le_f64, le_i64, le_b8},
    [OP_GT] = {gt_f32, gt_f64, gt_i64, gt_b8},
    [OP_GE] = {ge_f32, ge_f64, ge_i64, ge_b8},
};

void pw_binary(op_id op, kiln_tensor *dst, const kiln_tensor *a, const kiln_tensor *b) {
  if (dtype_is_narrow(a->dtype) || dtype_is_narrow(dst->dtype)) {
    /* in place into a narrow tensor: through op_kernel's wide copies */
    kiln_tensor *in[2] = {(kiln_tensor *)a, (kiln_tensor *)b};
    op_kernel(op, in, 2, NULL, dst);
    return;
  }
  iter it;
  const kiln_tensor *ops[2] = {a, b};
  iter_build(&it, dst, ops, 2);
  iter_inner fn = binary_loops[op][a->dtype];
  KILN_ASSERT(fn);
  if (fn) iter_run(&it, fn, NULL);
}

int k_binary(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)n, (void)a;
  pw_binary(op, out, in[0], in[1]);
  return 0;
}

/* ---- unary ---- */

#define UN_BODY(T, EXPR)                                                  \
  do {                                                                    \
    T *o = (T *)p[0];                                                     \
    const T *xp = (const T *)p[1];                                        \
    int64_t so = s[0], sx = s[1];                                         \
    if (so == 1 && sx == 1) {                                             \
      for (int64_t i = 0; i < n; i++) { T x = xp[i]; o[i] = (EXPR); }     \
    } else {                                                              \
      for (int64_t i = 0; i < n; i++) { T x = xp[i * sx]; o[i * so] = (EXPR); } \
    }                                                                     \
  } while (0)

#define UN(NAME, T, EXPR) \
  KILN_HOT static void NAME(char **p, const int64_t *s, int64_t n, const void *c) { (void)c; UN_BODY(T, EXPR); }

UN(neg_f32, float, -x)
UN(abs_f32, float, fabsf(x))
UN(exp_f32, float, vm_expf(x))
UN(log_f32, float, vm_logf(x))
UN(sqrt_f32, float, sqrtf(x))
UN(rsqrt_f32, float, 1.0f / sqrtf(x))
UN(tanh_f32, float, vm_tanhf(x))
UN(sigmoid_f32, float, vm_sigmoidf(x))
UN(relu_f32, float, x > 0.0f ? x : (x != x ? x : 0.0f))
UN(gelu_f32, float, vm_geluf(x))
UN(gelu_erf_f32, float, vm_gelu_erff(x))
UN(erf_f32, float, vm_erff(x))
UN(sin_f32, float, vm_sinf(x))
UN(cos_f32, float, vm_cosf(x))
UN(neg_f64, double, -x)
UN(abs_f64, double, fabs(x))
UN(exp_f64, double, exp(x))
UN(log_f64, double, log(x))
UN(sqrt_f64, double, sqrt(x))
UN(rsqrt_f64, double, 1.0 / sqrt(x))
UN(tanh_f64, double, tanh(x))
UN(sigmoid_f64, double, vm_sigmoid(x))
UN(relu_f64, double, x > 0.0 ? x : (x != x ? x : 0.0))
UN(gelu_f64, double, vm_gelu(x))
UN(gelu_erf_f64, double, vm_gelu_erf(x))
UN(erf_f64, double, erf(x))
UN(sin_f64, double, sin(x))
UN(cos_f64, double, cos(x))
UN(silu_f32, float, vm_siluf(x))
UN(softplus_f32, float, vm_softplusf(x))
UN(log1p_f32, float, vm_log1pf(x))
UN(expm1_f32, float, vm_expm1f(x))
UN(floor_f32, float, floorf(x))
UN(ceil_f32, float, ceilf(x))
UN(round_f32, float, rintf(x)) /* the default rounding mode: half to even */
UN(sign_f32, float, (float)((x > 0.0f) - (x < 0.0f))) /* nan: 0, as torch */
UN(silu_f64, double, vm_silu(x))
UN(softplus_f64, double, vm_softplus(x))
UN(log1p_f64, double, log1p(x))
UN(expm1_f64, double, expm1(x))
UN(floor_f64, double, floor(x))
UN(ceil_f64, double, ceil(x))
UN(round_f64, double, rint(x))
UN(sign_f64, double, (double)((x > 0.0) - (x < 0.0)))
UN(same_i64, int64_t, x)
UN(sign_i64, int64_t, (int64_t)((x > 0) - (x < 0)))

/* The ops with numbers: c is the op's attributes. clamp is max(x, lo), then
 * min with hi (hi wins when lo > hi, as torch); nan passes both compares. */
#define CLAMP(x, lo, hi) ((x) < (lo) ? (lo) : (x)) > (hi) ? (hi) : ((x) < (lo) ? (lo) : (x))
#define UN_ATTR(NAME, T, PRE, EXPR)                                                  \
  KILN_HOT static void NAME(char **p, const int64_t *s, int64_t n, const void *c) { \
    const op_attrs *a = c;                                                           \
    PRE;                                                                             \
    UN_BODY(T, EXPR);                                                                \
  }
UN_ATTR(clamp_f32, float, float lo = (float)a->value; float hi = (float)a->value2, CLAMP(x, lo, hi))
UN_ATTR(clamp_f64, double, double lo = a->value; double hi = a->value2, CLAMP(x, lo, hi))
UN_ATTR(clamp_i64, int64_t, int64_t lo = pw_bound_i64(a->value); int64_t hi = pw_bound_i64(a->value2),
        CLAMP(x, lo, hi))
UN_ATTR(leaky_relu_f32, float, float k = (float)a->value, x > 0.0f ? x : x * k)
UN_ATTR(leaky_relu_f64, double, double k = a->value, x > 0.0 ? x : x * k)
UN(neg_i64, int64_t, (int64_t)(0 - (uint64_t)x))
UN(abs_i64, int64_t, x < 0 ? (int64_t)(0 - (uint64_t)x) : x)
UN(relu_i64, int64_t, x > 0 ? x : 0)

static const iter_inner unary_loops[OP_COUNT][3] = {
    [OP_NEG] = {neg_f32, neg_f64, neg_i64},
    [OP_ABS] = {abs_f32, abs_f64, abs_i64},
    [OP_EXP] = {exp_f32, exp_f64, NULL},
    [OP_LOG] = {log_f32, log_f64, NULL},
    [OP_SQRT] = {sqrt_f32, sqrt_f64, NULL},
    [OP_RSQRT] = {rsqrt_f32, rsqrt_f64, NULL},
    [OP_TANH] = {tanh_f32, tanh_f64, NULL},
    [OP_SIGMOID] = {sigmoid_f32, sigmoid_f64, NULL},
    [OP_RELU] = {relu_f32, relu_f64, relu_i64},
    [OP_GELU] = {gelu_f32, gelu_f64, NULL},
    [OP_GELU_ERF] = {gelu_erf_f32, gelu_erf_f64, NULL},
    [OP_ERF] = {erf_f32, erf_f64, NULL},
    [OP_SIN] = {sin_f32, sin_f64, NULL},
    [OP_COS] = {cos_f32, cos_f64, NULL},
    [OP_SILU] = {silu_f32, silu_f64, NULL},
    [OP_SOFTPLUS] = {softplus_f32, softplus_f64, NULL},
    [OP_LOG1P] = {log1p_f32, log1p_f64, NULL},
    [OP_EXPM1] = {expm1_f32, expm1_f64, NULL},
    [OP_FLOOR] = {floor_f32, floor_f64, same_i64},
    [OP_CEIL] = {ceil_f32, ceil_f64, same_i64},
    [OP_ROUND] = {round_f32, round_f64, same_i64},
    [OP_SIGN] = {sign_f32, sign_f64, sign_i64},
    [OP_CLAMP] = {clamp_f32, clamp_f64, clamp_i64},
    [OP_LEAKY_RELU] = {leaky_relu_f32, leaky_relu_f64, NULL},
};

void pw_unary(op_id op, kiln_tensor *dst, const kiln_tensor *a, const op_attrs *attrs) {
  iter it;
  iter_build(&it, dst, &a, 1);
  iter_inner fn = a->dtype <= KILN_I64 ? unary_loops[op][a->dtype] : NULL;
  KILN_ASSERT(fn);
  if (fn) iter_run(&it, fn, attrs);
}

int k_unary(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)n;
  pw_unary(op, out, in[0], a);
  return 0;
}

/* ---- where ---- */

#define WHERE_LOOP(T, SFX)                                                                  \
  KILN_HOT static void where_##SFX(char **p, const int64_t *s, int64_t n, const void *c) {          \
    (void)c;                                                                                \
    T *o = (T *)p[0];                                                                       \
    const bool *cp = (const bool *)p[1];                                                    \
    const T *xp = (const T *)p[2], *yp = (const T *)p[3];                                   \
    if (s[0] == 1 && s[1] == 1 && s[2] == 1 && s[3] == 1) {                                 \
      for (int64_t i = 0; i < n; i++) o[i] = cp[i] ? xp[i] : yp[i];                         \
    } else {                                                                                \
      for (int64_t i = 0; i < n; i++) o[i * s[0]] = cp[i * s[1]] ? xp[i * s[2]] : yp[i * s[3]]; \
    }                                                                                       \
  }
WHERE_LOOP(float, f32)
WHERE_LOOP(double, f64)
WHERE_LOOP(int64_t, i64)
WHERE_LOOP(bool, b8)
static const iter_inner where_loops[4] = {where_f32, where_f64, where_i64, where_b8};

int k_where(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n, (void)a;
  iter it;
  const kiln_tensor *ops[3] = {in[0], in[1], in[2]};
  iter_build(&it, out, ops, 3);
  iter_run(&it, where_loops[out->dtype], NULL);
  return 0;
}

/* ---- cast and copy: dst = convert(src), src broadcast to dst ---- */

#define CVT_LOOP(TO, TI, NAME, EXPR)                                                   \
  KILN_HOT static void NAME(char **p, const int64_t *s, int64_t n, const void *c) {             \
    (void)c;                                                                           \
    TO *o = (TO *)p[0];                                                                \
    const TI *xp = (const TI *)p[1];                                                   \
    if (s[0] == 1 && s[1] == 1) {                                                      \
      for (int64_t i = 0; i < n; i++) { TI x = xp[i]; o[i] = (TO)(EXPR); }             \
    } else if (s[0] == 1 && s[1] == 0) {                                               \
      TI x = xp[0];                                                                    \
      TO v = (TO)(EXPR);                                                               \
      for (int64_t i = 0; i < n; i++) o[i] = v;                                        \
    } else {                                                                           \
      for (int64_t i = 0; i < n; i++) { TI x = xp[i * s[1]]; o[i * s[0]] = (TO)(EXPR); } \
    }                                                                                  \
  }

/* float -> i64 truncates toward zero; out-of-range and NaN saturate (defined, unlike C) */
static inline int64_t f2i(double x) {
  if (x != x) return 0;
  if (x >= 9.2233720368547758e18) return INT64_MAX;
  if (x <= -9.2233720368547758e18) return INT64_MIN;
  return (int64_t)x;
}

/* Loads widen the source to what C converts from (f16 and bf16 to float);
 * stores narrow with the destination's rule. */
#define LD_f32(x) (x)
#define LD_f64(x) (x)
#define LD_i64(x) (x)
#define LD_b8(x) (x)
#define LD_i32(x) (x)
#define LD_f16(x) half_to_float(x)
#define LD_bf16(x) bf16_to_float(x)
#define IS_FP(v) _Generic((v), float: 1, double: 1, default: 0)
#define ST_f32(v) ((float)(v))
#define ST_f64(v) ((double)(v))
#define ST_i64(v) (IS_FP(v) ? f2i((double)(v)) : (int64_t)(v))
#define ST_b8(v) ((v) != 0)
/* i64 -> i32 wraps, as torch's; floats saturate like f2i */
#define ST_i32(v) (IS_FP(v) ? f2i32((double)(v)) : (int32_t)(uint32_t)(uint64_t)(v))
#define TO_F32_ONCE(v) _Generic((v), double: half_f64_odd((double)(v)), default: (float)(v))
#define ST_f16(v) half_from_float(TO_F32_ONCE(v))
#define ST_bf16(v) bf16_from_float(TO_F32_ONCE(v))

static inline int32_t f2i32(double x) {
  if (x != x) return 0;
  if (x >= 2147483647.0) return INT32_MAX;
  if (x <= -2147483648.0) return INT32_MIN;
  return (int32_t)x;
}

#define CVT_FROM(SO, TO, SI, TI) __attribute__((unused)) CVT_LOOP(TO, TI, cvt_##SO##_##SI, ST_##SO(LD_##SI(x)))
#define CVT_ROW(SO, TO)                                                                                      \
  CVT_FROM(SO, TO, f32, float) CVT_FROM(SO, TO, f64, double) CVT_FROM(SO, TO, i64, int64_t)                 \
  CVT_FROM(SO, TO, b8, bool) CVT_FROM(SO, TO, i32, int32_t) CVT_FROM(SO, TO, f16, uint16_t) CVT_FROM(SO, TO, bf16, uint16_t)
CVT_ROW(f32, float)
CVT_ROW(f64, double)
CVT_ROW(i64, int64_t)
CVT_ROW(b8, bool)
CVT_ROW(i32, int32_t)
CVT_ROW(f16, uint16_t)
CVT_ROW(bf16, uint16_t)
/* same dtype: the bits, NaN payloads included */
CVT_LOOP(uint16_t, uint16_t, cvt_bits16, x)
CVT_LOOP(int32_t, int32_t, cvt_bits32, x)

#define CVT_PTRS(SO) {cvt_##SO##_f32, cvt_##SO##_f64, cvt_##SO##_i64, cvt_##SO##_b8, cvt_##SO##_i32, cvt_##SO##_f16, cvt_##SO##_bf16}
/* [dst][src] in kiln_dtype's order */
static const iter_inner cvt_loops[7][7] = {
    CVT_PTRS(f32), CVT_PTRS(f64), CVT_PTRS(i64), CVT_PTRS(b8),
    {cvt_i32_f32, cvt_i32_f64, cvt_i32_i64, cvt_i32_b8, cvt_bits32, cvt_i32_f16, cvt_i32_bf16},
    {cvt_f16_f32, cvt_f16_f64, cvt_f16_i64, cvt_f16_b8, cvt_f16_i32, cvt_bits16, cvt_f16_bf16},
    {cvt_bf16_f32, cvt_bf16_f64, cvt_bf16_i64, cvt_bf16_b8, cvt_bf16_i32, cvt_bf16_f16, cvt_bits16},
};

void pw_copy(kiln_tensor *dst, const kiln_tensor *src) {
  if (dst->dtype == src->dtype && tensor_contiguous(dst) && tensor_contiguous(src) &&
      shape_numel(dst->ndim, dst->shape) == shape_numel(src->ndim, src->shape)) {
    size_t bytes = (size_t)shape_numel(dst->ndim, dst->shape) * kiln_dtype_size(dst->dtype);
    if (bytes) memmove(tensor_data(dst), tensor_data(src), bytes);
    return;
  }
  iter it;
  iter_build(&it, dst, &src, 1);
  iter_run(&it, cvt_loops[dst->dtype][src->dtype], NULL);
}

void pw_fill(kiln_tensor *dst, double v) {
  union {
    float f;
    double d;
    int64_t i;
    bool b;
  } u;
  elem_store(dst->dtype, &u, 0, v);
  storage st = {.data = &u, .bytes = sizeof u};
  kiln_tensor one = {.dtype = dst->dtype, .ndim = 0, .st = &st};
  const kiln_tensor *src = &one;
  iter it;
  iter_build(&it, dst, &src, 1);
  iter_run(&it, cvt_loops[dst->dtype][dst->dtype], NULL);
}

int k_cast(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n, (void)a;
  pw_copy(out, in[0]);
  return 0;
}

int k_copy(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  return k_cast(op, in, n, a, out);
}
