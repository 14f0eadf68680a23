/* kiln: tensors in C, eager by default.
 *
 * A worked example (eager forward and backward):
 *
 *   kiln_scope_begin();
 *   int64_t xs[2] = {32, 784}, ws[2] = {784, 10};
 *   kiln_tensor *x = kiln_randn(KILN_F32, 2, xs, 1);
 *   kiln_tensor *w = kiln_keep(kiln_randn(KILN_F32, 2, ws, 2));
 *   kiln_requires_grad(w, true);
 *   kiln_tensor *y = kiln_relu(kiln_matmul(x, w));
 *   kiln_tensor *loss = kiln_mean_all(kiln_mul(y, y));
 *   if (!loss || kiln_backward(loss) != 0)
 *     fprintf(stderr, "%s\n", kiln_last_error());  // "app.c:7: kiln_matmul: ..."
 *   kiln_scope_end();                              // frees x, y, loss; w was kept
 *   const kiln_tensor *gw = kiln_grad(w);          // d loss / d w, shape (784,10)
 *   kiln_release(w);
 *
 * Compiling: wrap a function; the first call traces it (and runs it eagerly),
 * later calls whose inputs pass the guards run fused native code.
 *
 *   static int step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
 *     model *m = ctx;                                // weights: captured by reference
 *     out[0] = kiln_relu(kiln_add(kiln_matmul(in[0], m->w), m->b));
 *     return out[0] ? 0 : -1;
 *   }
 *   kiln_options o = {.name = "step", .n_in = 1, .n_out = 1};
 *   kiln_fn *fn = kiln_compile(step, &m, &o);
 *   kiln_tensor *y;
 *   kiln_call(fn, &x, &y);   // batch 32: traced; a later new batch size: traced once more
 *                            // with the batch dim symbolic (s0), then that graph serves all
 *   kiln_fn_free(fn);        // KILN_DUMP=graph,guards,recompiles shows what happened
 *
 * Every op is a macro that passes the caller's __FILE__ and __LINE__, so an
 * error names the line of user code that caused it. Ops given NULL return NULL,
 * so one check at the end of a chain is enough.
 *
 * Lifetime: a tensor returned by kiln belongs to the innermost open scope, else
 * to the caller (who calls kiln_release). kiln_keep() hands a tensor out of the
 * innermost scope to the one around it (or to the caller when there is none).
 * Releasing a tensor twice, or one that a scope owns, is an error that names
 * the caller's line, in every build.
 *
 * Installed, a program builds with `pkg-config --cflags --libs kiln` or CMake's
 * find_package(kiln) and the target kiln::kiln (docs/install.md).
 */
#ifndef KILN_H
#define KILN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(KILN_BUILD)
#define KILN_API __attribute__((visibility("default")))
#else
#define KILN_API
#endif

/* The version of this header; kiln_version() gives the library's, which
 * may differ when the program runs against another build. */
#define KILN_VERSION_MAJOR 0
#define KILN_VERSION_MINOR 1
#define KILN_VERSION_PATCH 0
#define KILN_VERSION_STRING "0.1.0"
#define KILN_VERSION (KILN_VERSION_MAJOR * 10000 + KILN_VERSION_MINOR * 100 + KILN_VERSION_PATCH)

#define KILN_MAX_DIMS 8

/* ---- how a function that takes the caller's line is declared ------------
 *
 * Every op, and every other function whose errors should name the caller's
 * line, is a function kiln_NAME_at(..., const char *file, int line) and a
 * variadic macro kiln_NAME(...) that adds __FILE__ and __LINE__. A new op
 * copies these two lines:
 *
 *   KILN_API kiln_tensor *kiln_foo_at(kiln_tensor *a, int axis, const char *, int);
 *   #define kiln_foo(...) KILN_OP(kiln_foo_at, __VA_ARGS__)
 *
 * and adds a call of kiln_foo to tests/test_macros.c, which fails while a
 * macro of this header is not called there.
 *
 * KILN_OP is for a function that returns a tensor; KILN_CALL(type, f, ...)
 * for any other return type (KILN_CALL(int, kiln_backward_at, __VA_ARGS__)).
 * An argument that holds a comma (a compound literal) passes through:
 * kiln_zeros(KILN_F32, 2, (int64_t[]){3, 4}). Extra fixed arguments go after
 * __VA_ARGS__, as kiln_sum_all does.
 *
 * Under GCC and clang (C, not C++) the call is checked: a pointer of the wrong
 * type (an int[] shape, a float[] axis list) or an integer where a pointer
 * goes is a compile error at the caller's line, not a warning and a wrong
 * shape at run time. Other compilers give the warnings C requires. Define
 * KILN_NO_CHECKED_CALLS before including kiln.h to get plain calls. */
#if defined(__GNUC__) && !defined(__cplusplus) && !defined(KILN_NO_CHECKED_CALLS)
/* The condition turns the two warnings into errors for the call's tokens
 * only; the other arm restores them and is never taken. Statement
 * expressions because GCC refuses a _Pragma inside a plain expression. */
#define KILN__CHECKED(T, call)                                                             \
  (__extension__({                                                                         \
     _Pragma("GCC diagnostic push")                                                        \
     _Pragma("GCC diagnostic error \"-Wincompatible-pointer-types\"")                      \
     _Pragma("GCC diagnostic error \"-Wint-conversion\"") 1;                               \
   })                                                                                      \
       ? (call)                                                                            \
       : __extension__({ _Pragma("GCC diagnostic pop") (T)0; }))
#else
#define KILN__CHECKED(T, call) (call)
#endif
#define KILN_CALL(T, f, ...) KILN__CHECKED(T, f(__VA_ARGS__, __FILE__, __LINE__))
#define KILN_OP(f, ...) KILN_CALL(kiln_tensor *, f, __VA_ARGS__)

/* GCC: the pointer argument p holds n elements, n another argument, so a
 * constant n past the end of a known array warns (-Wstringop-overread):
 * kiln_zeros(KILN_F32, 3, (int64_t[]){3, 4}). */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define KILN_READS(p, n) __attribute__((access(read_only, p, n)))
#define KILN_WRITES(p, n) __attribute__((access(write_only, p, n)))
#else
#define KILN_READS(p, n)
#define KILN_WRITES(p, n)
#endif

/* Checked lists: each gives the pointer and the count, so the two cannot
 * disagree; a rank over KILN_MAX_DIMS does not compile.
 *
 *   kiln_zeros(KILN_F32, KILN_SHAPE(3, 4))          ndim 2, shape {3, 4}
 *   kiln_reshape(x, KILN_SHAPE(-1, 4))
 *   kiln_sum_axes(x, KILN_AXES(0, 2), false)        axes {0, 2}, naxes 2
 *   kiln_cat(KILN_TENSORS(a, b, c), 0)              ts {a, b, c}, n 3
 *
 * C only (compound literals). A 0-d shape is `0, NULL`. */
#define KILN__COUNT(T, ...) (int)(sizeof((T[]){__VA_ARGS__}) / sizeof(T))
#define KILN__AT_MOST(n, max) \
  ((n) + 0 * (int)sizeof(struct { int more_sizes_than_KILN_MAX_DIMS : (n) <= (max) ? 8 * (int)sizeof(int) : -1; }))
#define KILN_SHAPE(...) \
  KILN__AT_MOST(KILN__COUNT(int64_t, __VA_ARGS__), KILN_MAX_DIMS), (const int64_t[]){__VA_ARGS__}
#define KILN_AXES(...) (const int[]){__VA_ARGS__}, KILN__AT_MOST(KILN__COUNT(int, __VA_ARGS__), KILN_MAX_DIMS)
#define KILN_TENSORS(...) (kiln_tensor *const[]){__VA_ARGS__}, KILN__COUNT(kiln_tensor *, __VA_ARGS__)

typedef struct kiln_tensor kiln_tensor; /* opaque, reference counted */
/* f16 (IEEE binary16) and bf16 (bfloat16) are stored narrow and computed in f32:
 * an op loads them as f32, computes, and rounds its result to nearest even.
 * i32 computes in i64 and wraps on store, like torch's int32. */
typedef enum kiln_dtype { KILN_F32, KILN_F64, KILN_I64, KILN_BOOL, KILN_I32, KILN_F16, KILN_BF16 } kiln_dtype;

/* ---- make, inspect, read back ---------------------------------------- */

KILN_API KILN_READS(3, 2) kiln_tensor *kiln_tensor_from_at(kiln_dtype, int ndim, const int64_t *shape,
                                                           const void *data, const char *file, int line);
KILN_API KILN_READS(3, 2) kiln_tensor *kiln_zeros_at(kiln_dtype, int ndim, const int64_t *shape, const char *file, int line);
KILN_API KILN_READS(3, 2) kiln_tensor *kiln_ones_at(kiln_dtype, int ndim, const int64_t *shape, const char *file, int line);
KILN_API KILN_READS(3, 2) kiln_tensor *kiln_full_at(kiln_dtype, int ndim, const int64_t *shape, double value,
                                                    const char *file, int line);
KILN_API kiln_tensor *kiln_scalar_at(kiln_dtype, double value, const char *file, int line);
/* [start, stop) by step, 1-D. */
KILN_API kiln_tensor *kiln_arange_at(kiln_dtype, double start, double stop, double step,
                                     const char *file, int line);
/* Counter-based: element i depends only on (seed, i), the same on every machine
 * and every thread count. randn: standard normal; rand: uniform in [0, 1). */
KILN_API KILN_READS(3, 2) kiln_tensor *kiln_randn_at(kiln_dtype, int ndim, const int64_t *shape, uint64_t seed,
                                                     const char *file, int line);
KILN_API KILN_READS(3, 2) kiln_tensor *kiln_rand_at(kiln_dtype, int ndim, const int64_t *shape, uint64_t seed,
                                                    const char *file, int line);
#define kiln_tensor_from(...) KILN_OP(kiln_tensor_from_at, __VA_ARGS__)
#define kiln_zeros(...) KILN_OP(kiln_zeros_at, __VA_ARGS__)
#define kiln_ones(...) KILN_OP(kiln_ones_at, __VA_ARGS__)
#define kiln_full(...) KILN_OP(kiln_full_at, __VA_ARGS__)
#define kiln_scalar(...) KILN_OP(kiln_scalar_at, __VA_ARGS__)
#define kiln_arange(...) KILN_OP(kiln_arange_at, __VA_ARGS__)
#define kiln_randn(...) KILN_OP(kiln_randn_at, __VA_ARGS__)
#define kiln_rand(...) KILN_OP(kiln_rand_at, __VA_ARGS__)

/* The default generator: a seed and a count of the numbers drawn from it,
 * counter-based like kiln_rand (number i of the stream depends only on
 * (seed, i)), so neither the thread count nor compiling changes what a draw
 * gives. A compiled call draws what the body would have drawn at that point
 * of the stream: same seed, same numbers; every call new ones. */
KILN_API void kiln_manual_seed(uint64_t seed); /* and the count back to 0 */
/* New tensors of x's shape and (float) dtype from the default generator:
 * uniform in [0, 1), standard normal. Not differentiable. */
KILN_API kiln_tensor *kiln_rand_like_at(kiln_tensor *x, const char *file, int line);
KILN_API kiln_tensor *kiln_randn_like_at(kiln_tensor *x, const char *file, int line);
/* training: each element of x zeroed with probability p (from the default
 * generator), the others scaled by 1/(1-p), as torch's dropout; otherwise x. */
KILN_API kiln_tensor *kiln_dropout_at(kiln_tensor *x, double p, bool training, const char *file, int line);
#define kiln_rand_like(...) KILN_OP(kiln_rand_like_at, __VA_ARGS__)
#define kiln_randn_like(...) KILN_OP(kiln_randn_like_at, __VA_ARGS__)
#define kiln_dropout(...) KILN_OP(kiln_dropout_at, __VA_ARGS__)

KILN_API int kiln_ndim(const kiln_tensor *);
KILN_API int64_t kiln_size(const kiln_tensor *, int dim); /* dim < 0 counts from the end; -1 on error */
KILN_API int64_t kiln_numel(const kiln_tensor *);
KILN_API kiln_dtype kiln_type(const kiln_tensor *);
KILN_API int64_t kiln_stride(const kiln_tensor *, int dim); /* in elements */
KILN_API bool kiln_is_contiguous(const kiln_tensor *);
KILN_API size_t kiln_dtype_size(kiln_dtype);
KILN_API const char *kiln_dtype_name(kiln_dtype);
/* Row-major copy of the elements into dst (bytes must equal numel*dtype size). 0 or -1. */
KILN_API int kiln_read_at(const kiln_tensor *, void *dst, size_t bytes, const char *file, int line);
/* The value of a one-element tensor as a double; NaN and an error otherwise. */
KILN_API double kiln_item_at(const kiln_tensor *, const char *file, int line);
#define kiln_read(...) KILN_CALL(int, kiln_read_at, __VA_ARGS__)
#define kiln_item(...) KILN_CALL(double, kiln_item_at, __VA_ARGS__)
/* Writes a short description ("f32[2,3] strides [3,1]") into buf; returns buf. */
KILN_API char *kiln_describe(const kiln_tensor *, char *buf, size_t n);
/* Prints the tensor (shape and values, elided when large) to stdout. */
KILN_API void kiln_print_at(const kiln_tensor *, const char *file, int line);
#define kiln_print(...) KILN_CALL(void, kiln_print_at, __VA_ARGS__)

/* ---- lifetime --------------------------------------------------------- */

/* A reference of the caller's own to t; t itself, or NULL and an error. */
KILN_API kiln_tensor *kiln_retain_at(kiln_tensor *t, const char *file, int line);
/* Drops a reference the caller owns. Releasing a tensor again after its last
 * reference is gone, or one that only a scope holds, is an error (set, and
 * printed on stderr, naming the caller's line) and does nothing, in every
 * build. NULL does nothing. */
KILN_API void kiln_release_at(kiln_tensor *t, const char *file, int line);
/* Moves t from the innermost scope to the one around it, or to the caller
 * when there is none; returns t. */
KILN_API kiln_tensor *kiln_keep_at(kiln_tensor *t, const char *file, int line);
#define kiln_retain(...) KILN_OP(kiln_retain_at, __VA_ARGS__)
#define kiln_release(...) KILN_CALL(void, kiln_release_at, __VA_ARGS__)
#define kiln_keep(...) KILN_OP(kiln_keep_at, __VA_ARGS__)
/* The same three as plain functions, for a caller that needs an address (a
 * destructor callback) or was compiled before the _at forms; their errors
 * name no line. */
KILN_API kiln_tensor *(kiln_retain)(kiln_tensor *);
KILN_API void (kiln_release)(kiln_tensor *);
KILN_API kiln_tensor *(kiln_keep)(kiln_tensor *);
KILN_API void kiln_scope_begin(void);
KILN_API void kiln_scope_end(void);

/* ---- views (no copy) and layout -------------------------------------- */

KILN_API KILN_READS(3, 2) kiln_tensor *kiln_reshape_at(kiln_tensor *, int ndim, const int64_t *shape, const char *, int);
KILN_API kiln_tensor *kiln_transpose_at(kiln_tensor *, int d0, int d1, const char *, int);
KILN_API kiln_tensor *kiln_permute_at(kiln_tensor *, const int *perm, const char *, int);
KILN_API KILN_READS(3, 2) kiln_tensor *kiln_expand_at(kiln_tensor *, int ndim, const int64_t *shape, const char *, int);
KILN_API kiln_tensor *kiln_squeeze_at(kiln_tensor *, int dim, const char *, int);
KILN_API kiln_tensor *kiln_unsqueeze_at(kiln_tensor *, int dim, const char *, int);
/* Elements start, start+step, ... below end along dim (Python slice rules for
 * negative and out-of-range bounds; step >= 1). */
KILN_API kiln_tensor *kiln_slice_at(kiln_tensor *, int dim, int64_t start, int64_t end, int64_t step,
                                    const char *, int);
KILN_API kiln_tensor *kiln_contiguous_at(kiln_tensor *, const char *, int);
KILN_API KILN_READS(1, 2) kiln_tensor *kiln_cat_at(kiln_tensor *const *ts, int n, int dim, const char *, int);
KILN_API KILN_READS(1, 2) kiln_tensor *kiln_stack_at(kiln_tensor *const *ts, int n, int dim, const char *, int);
KILN_API kiln_tensor *kiln_cast_at(kiln_tensor *, kiln_dtype, const char *, int);
#define kiln_reshape(...) KILN_OP(kiln_reshape_at, __VA_ARGS__)
#define kiln_transpose(...) KILN_OP(kiln_transpose_at, __VA_ARGS__)
#define kiln_permute(...) KILN_OP(kiln_permute_at, __VA_ARGS__)
#define kiln_expand(...) KILN_OP(kiln_expand_at, __VA_ARGS__)
#define kiln_squeeze(...) KILN_OP(kiln_squeeze_at, __VA_ARGS__)
#define kiln_unsqueeze(...) KILN_OP(kiln_unsqueeze_at, __VA_ARGS__)
#define kiln_slice(...) KILN_OP(kiln_slice_at, __VA_ARGS__)
#define kiln_contiguous(...) KILN_OP(kiln_contiguous_at, __VA_ARGS__)
#define kiln_cat(...) KILN_OP(kiln_cat_at, __VA_ARGS__)
#define kiln_stack(...) KILN_OP(kiln_stack_at, __VA_ARGS__)
#define kiln_cast(...) KILN_OP(kiln_cast_at, __VA_ARGS__)

/* ---- pointwise ops (NumPy broadcasting; f32/f64/i64 where it makes sense) */

#define KILN_BINARY_OPS(X) X(add) X(sub) X(mul) X(div) X(pow) X(maximum) X(minimum) \
  X(eq) X(ne) X(lt) X(le) X(gt) X(ge)
#define KILN_UNARY_OPS(X) X(neg) X(abs) X(exp) X(log) X(sqrt) X(rsqrt) X(tanh) X(sigmoid) \
  X(relu) X(gelu) X(gelu_erf) X(erf) X(sin) X(cos) X(silu) X(softplus) X(log1p) X(expm1) X(floor) X(ceil) \
  X(round) X(sign)

#define KILN_DECL_BINARY(name) \
  KILN_API kiln_tensor *kiln_##name##_at(kiln_tensor *a, kiln_tensor *b, const char *, int);
#define KILN_DECL_UNARY(name) KILN_API kiln_tensor *kiln_##name##_at(kiln_tensor *a, const char *, int);
KILN_BINARY_OPS(KILN_DECL_BINARY)
KILN_UNARY_OPS(KILN_DECL_UNARY)
#undef KILN_DECL_BINARY
#undef KILN_DECL_UNARY

#define kiln_add(...) KILN_OP(kiln_add_at, __VA_ARGS__)
#define kiln_sub(...) KILN_OP(kiln_sub_at, __VA_ARGS__)
#define kiln_mul(...) KILN_OP(kiln_mul_at, __VA_ARGS__)
#define kiln_div(...) KILN_OP(kiln_div_at, __VA_ARGS__)
#define kiln_pow(...) KILN_OP(kiln_pow_at, __VA_ARGS__)
#define kiln_maximum(...) KILN_OP(kiln_maximum_at, __VA_ARGS__)
#define kiln_minimum(...) KILN_OP(kiln_minimum_at, __VA_ARGS__)
#define kiln_eq(...) KILN_OP(kiln_eq_at, __VA_ARGS__)
#define kiln_ne(...) KILN_OP(kiln_ne_at, __VA_ARGS__)
#define kiln_lt(...) KILN_OP(kiln_lt_at, __VA_ARGS__)
#define kiln_le(...) KILN_OP(kiln_le_at, __VA_ARGS__)
#define kiln_gt(...) KILN_OP(kiln_gt_at, __VA_ARGS__)
#define kiln_ge(...) KILN_OP(kiln_ge_at, __VA_ARGS__)
#define kiln_neg(...) KILN_OP(kiln_neg_at, __VA_ARGS__)
#define kiln_abs(...) KILN_OP(kiln_abs_at, __VA_ARGS__)
#define kiln_exp(...) KILN_OP(kiln_exp_at, __VA_ARGS__)
#define kiln_log(...) KILN_OP(kiln_log_at, __VA_ARGS__)
#define kiln_sqrt(...) KILN_OP(kiln_sqrt_at, __VA_ARGS__)
#define kiln_rsqrt(...) KILN_OP(kiln_rsqrt_at, __VA_ARGS__)
#define kiln_tanh(...) KILN_OP(kiln_tanh_at, __VA_ARGS__)
#define kiln_sigmoid(...) KILN_OP(kiln_sigmoid_at, __VA_ARGS__)
#define kiln_relu(...) KILN_OP(kiln_relu_at, __VA_ARGS__)
#define kiln_gelu(...) KILN_OP(kiln_gelu_at, __VA_ARGS__)         /* tanh form */
#define kiln_gelu_erf(...) KILN_OP(kiln_gelu_erf_at, __VA_ARGS__) /* exact (erf) form */
#define kiln_erf(...) KILN_OP(kiln_erf_at, __VA_ARGS__)
#define kiln_sin(...) KILN_OP(kiln_sin_at, __VA_ARGS__)
#define kiln_cos(...) KILN_OP(kiln_cos_at, __VA_ARGS__)
#define kiln_silu(...) KILN_OP(kiln_silu_at, __VA_ARGS__)         /* x * sigmoid(x) */
#define kiln_softplus(...) KILN_OP(kiln_softplus_at, __VA_ARGS__) /* log(1 + e^x); x past 20, as torch */
#define kiln_log1p(...) KILN_OP(kiln_log1p_at, __VA_ARGS__)
#define kiln_expm1(...) KILN_OP(kiln_expm1_at, __VA_ARGS__)
/* floor, ceil, round (half to even) and sign (nan gives 0) keep the dtype; on
 * i64 the first three return x; their gradient is zero. */
#define kiln_floor(...) KILN_OP(kiln_floor_at, __VA_ARGS__)
#define kiln_ceil(...) KILN_OP(kiln_ceil_at, __VA_ARGS__)
#define kiln_round(...) KILN_OP(kiln_round_at, __VA_ARGS__)
#define kiln_sign(...) KILN_OP(kiln_sign_at, __VA_ARGS__)

/* min(max(x, lo), hi) (so hi when lo > hi, as torch); +-INFINITY leaves a
 * side open. On i64 with a bound that is not whole, x is cast to f32 first.
 * The gradient passes where lo <= x <= hi. */
KILN_API kiln_tensor *kiln_clamp_at(kiln_tensor *x, double lo, double hi, const char *, int);
/* x > 0 ? x : slope * x, floats. */
KILN_API kiln_tensor *kiln_leaky_relu_at(kiln_tensor *x, double slope, const char *, int);
/* x op value, the number in x's dtype (a float value on i64 x: f32, as torch) */
KILN_API kiln_tensor *kiln_add_scalar_at(kiln_tensor *x, double value, const char *, int);
KILN_API kiln_tensor *kiln_sub_scalar_at(kiln_tensor *x, double value, const char *, int);
KILN_API kiln_tensor *kiln_mul_scalar_at(kiln_tensor *x, double value, const char *, int);
KILN_API kiln_tensor *kiln_div_scalar_at(kiln_tensor *x, double value, const char *, int);
#define kiln_clamp(...) KILN_OP(kiln_clamp_at, __VA_ARGS__)
#define kiln_leaky_relu(...) KILN_OP(kiln_leaky_relu_at, __VA_ARGS__)
#define kiln_add_scalar(...) KILN_OP(kiln_add_scalar_at, __VA_ARGS__)
#define kiln_sub_scalar(...) KILN_OP(kiln_sub_scalar_at, __VA_ARGS__)
#define kiln_mul_scalar(...) KILN_OP(kiln_mul_scalar_at, __VA_ARGS__)
#define kiln_div_scalar(...) KILN_OP(kiln_div_scalar_at, __VA_ARGS__)

/* cond ? a : b, all three broadcast; cond is bool. */
KILN_API kiln_tensor *kiln_where_at(kiln_tensor *cond, kiln_tensor *a, kiln_tensor *b, const char *, int);
#define kiln_where(...) KILN_OP(kiln_where_at, __VA_ARGS__)

/* ---- reductions ------------------------------------------------------- */

/* One axis (negative counts from the end). */
KILN_API kiln_tensor *kiln_sum_at(kiln_tensor *, int axis, bool keepdim, const char *, int);
KILN_API kiln_tensor *kiln_mean_at(kiln_tensor *, int axis, bool keepdim, const char *, int);
KILN_API kiln_tensor *kiln_max_at(kiln_tensor *, int axis, bool keepdim, const char *, int);
KILN_API kiln_tensor *kiln_min_at(kiln_tensor *, int axis, bool keepdim, const char *, int);
KILN_API kiln_tensor *kiln_var_at(kiln_tensor *, int axis, int correction, bool keepdim, const char *, int);
KILN_API kiln_tensor *kiln_argmax_at(kiln_tensor *, int axis, bool keepdim, const char *, int); /* i64 */
KILN_API kiln_tensor *kiln_argmin_at(kiln_tensor *, int axis, bool keepdim, const char *, int); /* i64 */
/* A list of axes; naxes == 0 reduces over every axis. */
KILN_API KILN_READS(2, 3) kiln_tensor *kiln_sum_axes_at(kiln_tensor *, const int *axes, int naxes, bool keepdim, const char *, int);
KILN_API KILN_READS(2, 3) kiln_tensor *kiln_mean_axes_at(kiln_tensor *, const int *axes, int naxes, bool keepdim, const char *, int);
KILN_API KILN_READS(2, 3) kiln_tensor *kiln_max_axes_at(kiln_tensor *, const int *axes, int naxes, bool keepdim, const char *, int);
KILN_API KILN_READS(2, 3) kiln_tensor *kiln_min_axes_at(kiln_tensor *, const int *axes, int naxes, bool keepdim, const char *, int);
KILN_API KILN_READS(2, 3) kiln_tensor *kiln_var_axes_at(kiln_tensor *, const int *axes, int naxes, int correction, bool keepdim,
                                                        const char *, int);
#define kiln_sum(...) KILN_OP(kiln_sum_at, __VA_ARGS__)
#define kiln_mean(...) KILN_OP(kiln_mean_at, __VA_ARGS__)
#define kiln_max(...) KILN_OP(kiln_max_at, __VA_ARGS__)
#define kiln_min(...) KILN_OP(kiln_min_at, __VA_ARGS__)
#define kiln_var(...) KILN_OP(kiln_var_at, __VA_ARGS__)
#define kiln_argmax(...) KILN_OP(kiln_argmax_at, __VA_ARGS__)
#define kiln_argmin(...) KILN_OP(kiln_argmin_at, __VA_ARGS__)
#define kiln_sum_axes(...) KILN_OP(kiln_sum_axes_at, __VA_ARGS__)
#define kiln_mean_axes(...) KILN_OP(kiln_mean_axes_at, __VA_ARGS__)
#define kiln_max_axes(...) KILN_OP(kiln_max_axes_at, __VA_ARGS__)
#define kiln_min_axes(...) KILN_OP(kiln_min_axes_at, __VA_ARGS__)
#define kiln_var_axes(...) KILN_OP(kiln_var_axes_at, __VA_ARGS__)
#define kiln_sum_all(...) KILN_OP(kiln_sum_axes_at, __VA_ARGS__, NULL, 0, false)
#define kiln_mean_all(...) KILN_OP(kiln_mean_axes_at, __VA_ARGS__, NULL, 0, false)

/* ---- matmul and NN ---------------------------------------------------- */

/* 1-D, 2-D and batched (broadcast batch dims), f32/f64 through OpenBLAS. */
KILN_API kiln_tensor *kiln_matmul_at(kiln_tensor *a, kiln_tensor *b, const char *, int);
KILN_API kiln_tensor *kiln_softmax_at(kiln_tensor *, int axis, const char *, int);
KILN_API kiln_tensor *kiln_log_softmax_at(kiln_tensor *, int axis, const char *, int);
/* Normalizes the last dim (biased variance); weight and bias (shape (C,)) may each be NULL. */
KILN_API kiln_tensor *kiln_layer_norm_at(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias, double eps,
                                         const char *, int);
/* Rows of table (V,C) picked by the i64 indices (any shape): shape idx.shape + (C,). */
KILN_API kiln_tensor *kiln_embedding_at(kiln_tensor *table, kiln_tensor *idx, const char *, int);
KILN_API kiln_tensor *kiln_index_select_at(kiln_tensor *a, int dim, kiln_tensor *idx, const char *, int);
/* out[p] = x[p with dim replaced by idx[p]]: idx i64 of x's rank, no larger
 * than x in the other dims; out has idx's shape (torch.gather). */
KILN_API kiln_tensor *kiln_gather_at(kiln_tensor *x, int dim, kiln_tensor *idx, const char *, int);
/* x with src[p] added at x[p with dim replaced by idx[p]], repeats adding
 * up; src has idx's shape and x's dtype (torch.scatter_add). */
KILN_API kiln_tensor *kiln_scatter_add_at(kiln_tensor *x, int dim, kiln_tensor *idx, kiln_tensor *src, const char *, int);
/* x with its entries along dim at the 1-D i64 idx replaced by src's, in
 * order (a repeated index: the last write wins); src is x's shape with
 * idx's length along dim. */
KILN_API kiln_tensor *kiln_index_copy_at(kiln_tensor *x, int dim, kiln_tensor *idx, kiln_tensor *src, const char *, int);
/* The lower (upper) triangle of the last two dims: entries (i, j) with
 * j - i <= k (>= k) kept, the rest 0. */
KILN_API kiln_tensor *kiln_tril_at(kiln_tensor *x, int64_t k, const char *, int);
KILN_API kiln_tensor *kiln_triu_at(kiln_tensor *x, int64_t k, const char *, int);
/* Constant padding in torch's order: pads[0], pads[1] widen the last dim
 * on the left and right, pads[2], pads[3] the one before, ...; n even, at
 * most 2 * ndim; a negative width crops. */
KILN_API KILN_READS(3, 2) kiln_tensor *kiln_pad_at(kiln_tensor *x, int n, const int64_t *pads, double value, const char *, int);
/* Running sum along dim (i64 wraps; f32 accumulates in f64). */
KILN_API kiln_tensor *kiln_cumsum_at(kiln_tensor *x, int dim, const char *, int);
/* The k largest (largest true) or smallest entries along dim, best first:
 * *values (x's dtype, a gather of x, so gradients reach x) and *indices
 * (i64); either pointer may be NULL. Ties: the lower index first; NaN is the
 * largest. 0, or -1 with both set to NULL. */
KILN_API int kiln_topk_at(kiln_tensor *x, int64_t k, int dim, bool largest, kiln_tensor **values, kiln_tensor **indices,
                          const char *, int);
/* Views of x in pieces of size along dim (the last may be shorter) into
 * outs[0..count), as torch.split; returns the count, or -1. outs NULL: only
 * the count. kiln_split's outs must hold the count; kiln_split_n takes the
 * room it has, max_outs, and a count above it is an error. */
KILN_API int kiln_split_at(kiln_tensor *x, int64_t size, int dim, kiln_tensor **outs, const char *, int);
KILN_API int kiln_split_n_at(kiln_tensor *x, int64_t size, int dim, kiln_tensor **outs, int max_outs, const char *, int);
/* i64 (idx.shape + (n,)): 1 at each index's class; n -1 takes the largest
 * index + 1 (a value read: a compiled body falls back to eager there). */
KILN_API kiln_tensor *kiln_one_hot_at(kiln_tensor *idx, int64_t n, const char *, int);
/* x tiled reps[i] times along dim i (torch's repeat): n >= ndim; extra
 * repeats add leading dims. */
KILN_API KILN_READS(3, 2) kiln_tensor *kiln_repeat_at(kiln_tensor *x, int n, const int64_t *reps, const char *, int);
/* Mean over rows of -log_softmax(logits)[target]; logits (N,C), targets i64 (N,). */
KILN_API kiln_tensor *kiln_cross_entropy_at(kiln_tensor *logits, kiln_tensor *targets, const char *, int);
KILN_API kiln_tensor *kiln_mse_loss_at(kiln_tensor *a, kiln_tensor *b, const char *, int);
/* log(sum(exp(x))) along axis, without overflow; floats, a non-empty axis. */
KILN_API kiln_tensor *kiln_logsumexp_at(kiln_tensor *x, int axis, bool keepdim, const char *, int);
/* The largest / smallest element, 0-d; refused for an empty tensor. */
KILN_API kiln_tensor *kiln_max_all_at(kiln_tensor *x, const char *, int);
KILN_API kiln_tensor *kiln_min_all_at(kiln_tensor *x, const char *, int);
/* x with value where the bool mask (broadcast to x's shape) is true. */
KILN_API kiln_tensor *kiln_masked_fill_at(kiln_tensor *x, kiln_tensor *mask, double value, const char *, int);
/* x / sqrt(mean(x^2 over the last dim) + eps) * weight; weight (C,) or NULL. */
KILN_API kiln_tensor *kiln_rms_norm_at(kiln_tensor *x, kiln_tensor *weight, double eps, const char *, int);
/* x (N,C,...): each of groups groups of C/groups channels normalized over
 * its channels and every later dim (biased variance), then weight and bias
 * (C,) per channel, each may be NULL. */
KILN_API kiln_tensor *kiln_group_norm_at(kiln_tensor *x, int groups, kiln_tensor *weight, kiln_tensor *bias, double eps,
                                         const char *, int);
#define kiln_matmul(...) KILN_OP(kiln_matmul_at, __VA_ARGS__)
#define kiln_softmax(...) KILN_OP(kiln_softmax_at, __VA_ARGS__)
#define kiln_log_softmax(...) KILN_OP(kiln_log_softmax_at, __VA_ARGS__)
#define kiln_layer_norm(...) KILN_OP(kiln_layer_norm_at, __VA_ARGS__)
#define kiln_logsumexp(...) KILN_OP(kiln_logsumexp_at, __VA_ARGS__)
#define kiln_max_all(...) KILN_OP(kiln_max_all_at, __VA_ARGS__)
#define kiln_min_all(...) KILN_OP(kiln_min_all_at, __VA_ARGS__)
#define kiln_masked_fill(...) KILN_OP(kiln_masked_fill_at, __VA_ARGS__)
#define kiln_rms_norm(...) KILN_OP(kiln_rms_norm_at, __VA_ARGS__)
#define kiln_group_norm(...) KILN_OP(kiln_group_norm_at, __VA_ARGS__)
#define kiln_embedding(...) KILN_OP(kiln_embedding_at, __VA_ARGS__)
#define kiln_index_select(...) KILN_OP(kiln_index_select_at, __VA_ARGS__)
#define kiln_gather(...) KILN_OP(kiln_gather_at, __VA_ARGS__)
#define kiln_scatter_add(...) KILN_OP(kiln_scatter_add_at, __VA_ARGS__)
#define kiln_index_copy(...) KILN_OP(kiln_index_copy_at, __VA_ARGS__)
#define kiln_tril(...) KILN_OP(kiln_tril_at, __VA_ARGS__)
#define kiln_triu(...) KILN_OP(kiln_triu_at, __VA_ARGS__)
#define kiln_pad(...) KILN_OP(kiln_pad_at, __VA_ARGS__)
#define kiln_cumsum(...) KILN_OP(kiln_cumsum_at, __VA_ARGS__)
#define kiln_topk(...) KILN_CALL(int, kiln_topk_at, __VA_ARGS__)
#define kiln_split(...) KILN_CALL(int, kiln_split_at, __VA_ARGS__)
#define kiln_split_n(...) KILN_CALL(int, kiln_split_n_at, __VA_ARGS__)
#define kiln_one_hot(...) KILN_OP(kiln_one_hot_at, __VA_ARGS__)
#define kiln_repeat(...) KILN_OP(kiln_repeat_at, __VA_ARGS__)
#define kiln_cross_entropy(...) KILN_OP(kiln_cross_entropy_at, __VA_ARGS__)
#define kiln_mse_loss(...) KILN_OP(kiln_mse_loss_at, __VA_ARGS__)

/* ---- convolution, pooling, normalization (NCHW) ---------------------- */

/* As torch.nn.functional's, on f32 and f64. Pairs of ints are (h, w); NULL
 * means the default: stride 1, padding 0, dilation 1, and a pool's stride
 * its kernel size. x is (N,C,H,W), or (C,H,W) for one image (the result then
 * has no batch dim either); w is (O, C/groups, kh, kw); bias (O,) or NULL. */
KILN_API kiln_tensor *kiln_conv2d_at(kiln_tensor *x, kiln_tensor *w, kiln_tensor *bias, const int *stride,
                                     const int *padding, const int *dilation, int groups, const char *, int);
/* x (N,C,L) or (C,L); w (O, C/groups, k). */
KILN_API kiln_tensor *kiln_conv1d_at(kiln_tensor *x, kiln_tensor *w, kiln_tensor *bias, int stride, int padding,
                                     int dilation, int groups, const char *, int);
KILN_API kiln_tensor *kiln_max_pool2d_at(kiln_tensor *x, const int *kernel, const int *stride, const int *padding,
                                         const char *, int);
/* Counts the padding in each window's divisor (torch's count_include_pad). */
KILN_API kiln_tensor *kiln_avg_pool2d_at(kiln_tensor *x, const int *kernel, const int *stride, const int *padding,
                                         const char *, int);
KILN_API kiln_tensor *kiln_adaptive_avg_pool2d_at(kiln_tensor *x, const int *out_hw, const char *, int);
/* x (N,C,...). training: normalizes with the batch's statistics over every
 * dim but C (biased variance) and updates running_mean and running_var (C,)
 * in place, without autograd history: r = (1 - momentum) r + momentum s, with
 * the unbiased variance; they may be NULL then. Otherwise normalizes with the
 * running statistics. weight and bias (C,) may be NULL (1 and 0). */
KILN_API kiln_tensor *kiln_batch_norm_at(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var,
                                         kiln_tensor *weight, kiln_tensor *bias, bool training, double momentum,
                                         double eps, const char *, int);
#define kiln_conv2d(...) KILN_OP(kiln_conv2d_at, __VA_ARGS__)
#define kiln_conv1d(...) KILN_OP(kiln_conv1d_at, __VA_ARGS__)
#define kiln_max_pool2d(...) KILN_OP(kiln_max_pool2d_at, __VA_ARGS__)
#define kiln_avg_pool2d(...) KILN_OP(kiln_avg_pool2d_at, __VA_ARGS__)
#define kiln_adaptive_avg_pool2d(...) KILN_OP(kiln_adaptive_avg_pool2d_at, __VA_ARGS__)
#define kiln_batch_norm(...) KILN_OP(kiln_batch_norm_at, __VA_ARGS__)

/* ---- in place (return dst, or NULL on error) -------------------------- */

/* Refused when src overlaps dst other than exactly, when dst is an expanded
 * view, and outside a no-grad scope when dst or src requires grad. */
KILN_API kiln_tensor *kiln_add__at(kiln_tensor *dst, kiln_tensor *src, const char *, int);
KILN_API kiln_tensor *kiln_sub__at(kiln_tensor *dst, kiln_tensor *src, const char *, int);
KILN_API kiln_tensor *kiln_mul__at(kiln_tensor *dst, kiln_tensor *src, const char *, int);
KILN_API kiln_tensor *kiln_copy__at(kiln_tensor *dst, kiln_tensor *src, const char *, int);
KILN_API kiln_tensor *kiln_fill__at(kiln_tensor *dst, double value, const char *, int);
KILN_API kiln_tensor *kiln_zero__at(kiln_tensor *dst, const char *, int);
/* kiln_index_copy written into dst (the last write wins where an index repeats). */
KILN_API kiln_tensor *kiln_index_copy__at(kiln_tensor *dst, int dim, kiln_tensor *idx, kiln_tensor *src, const char *, int);
#define kiln_add_(...) KILN_OP(kiln_add__at, __VA_ARGS__)
#define kiln_sub_(...) KILN_OP(kiln_sub__at, __VA_ARGS__)
#define kiln_mul_(...) KILN_OP(kiln_mul__at, __VA_ARGS__)
#define kiln_copy_(...) KILN_OP(kiln_copy__at, __VA_ARGS__)
#define kiln_fill_(...) KILN_OP(kiln_fill__at, __VA_ARGS__)
#define kiln_zero_(...) KILN_OP(kiln_zero__at, __VA_ARGS__)
#define kiln_index_copy_(...) KILN_OP(kiln_index_copy__at, __VA_ARGS__)

/* ---- collectives over MPI (docs/scaling.md) ------------------------------
 *
 * For data-parallel training: every process of MPI_COMM_WORLD runs the same
 * program on its slice of the batch, and the gradients are summed across
 * processes before the update. kiln initializes MPI on first use (when the
 * program has not) and finalizes what it initialized at exit. Every process
 * must make the same collective calls in the same order. In a compiled
 * function an allreduce is a node of the graph. Without MPI (built with
 * KILN_MPI=OFF) the calls are errors that say so. */
typedef enum kiln_reduce_op { KILN_REDUCE_SUM, KILN_REDUCE_MEAN } kiln_reduce_op;
/* A new tensor: op over t's values on every process (MEAN: floats only); the
 * same shape and dtype on every process. Differentiable: its gradient is the
 * same allreduce of the incoming gradient. */
KILN_API kiln_tensor *kiln_allreduce_at(kiln_tensor *t, kiln_reduce_op op, const char *, int);
/* In place: t = allreduce(t, op); t returned. Refused outside no-grad when t requires grad. */
KILN_API kiln_tensor *kiln_allreduce__at(kiln_tensor *t, kiln_reduce_op op, const char *, int);
/* This process's rank in MPI_COMM_WORLD and the number of processes; -1 on
 * error (kiln_last_error says why: no MPI, or MPI failed to start). */
KILN_API int kiln_dist_rank(void);
KILN_API int kiln_dist_size(void);
/* Milliseconds over the process's life: wall time with collectives in flight,
 * and of that what the program spent blocked waiting for them. A compiled
 * step overlaps its allreduces with the kernels after them, so blocked can be
 * less than in flight; an eager allreduce blocks throughout. A bucket is in
 * flight from when it is sent, not while it fills. 0s without MPI. */
KILN_API void kiln_dist_times(double *in_flight_ms, double *blocked_ms);
/* Collectives (MPI_Iallreduce calls) this process has issued. A compiled
 * step packs consecutive small allreduces of one dtype and op into buckets
 * of at most KILN_DIST_BUCKET_KB KiB (default 1024; 0: one per tensor), one
 * collective each (docs/scaling.md); an eager allreduce is one. Not counted:
 * the check, at the first compiled allreduce, that every process has the same
 * cap. 0 without MPI. */
KILN_API int64_t kiln_dist_collectives(void);
#define kiln_allreduce(...) KILN_OP(kiln_allreduce_at, __VA_ARGS__)
#define kiln_allreduce_(...) KILN_OP(kiln_allreduce__at, __VA_ARGS__)

/* ---- autograd --------------------------------------------------------- */

KILN_API void kiln_requires_grad_at(kiln_tensor *, bool, const char *file, int line);
#define kiln_requires_grad(...) KILN_CALL(void, kiln_requires_grad_at, __VA_ARGS__)
KILN_API bool kiln_get_requires_grad(const kiln_tensor *);
/* loss must have one element. Frees the graph behind it. 0 or -1. */
KILN_API int kiln_backward_at(kiln_tensor *loss, const char *, int);
/* Same, seeded with grad_out (the shape of out). */
KILN_API int kiln_backward_with_at(kiln_tensor *out, kiln_tensor *grad_out, const char *, int);
/* Gradients of out (one element) with respect to wrt[0..n): grads[i] is a new
 * tensor (zeros where wrt[i] does not reach out). Leaves .grad alone and keeps
 * the graph. 0 or -1. */
KILN_API KILN_READS(2, 3) KILN_WRITES(4, 3) int kiln_grad_of_at(kiln_tensor *out, kiln_tensor *const *wrt, int n, kiln_tensor **grads,
                                                                const char *, int);
#define kiln_backward(...) KILN_CALL(int, kiln_backward_at, __VA_ARGS__)
#define kiln_backward_with(...) KILN_CALL(int, kiln_backward_with_at, __VA_ARGS__)
#define kiln_grad_of(...) KILN_CALL(int, kiln_grad_of_at, __VA_ARGS__)
/* Borrowed; NULL before any backward reached the tensor. In a compiled body,
 * NULL exactly where it would be eagerly (a branch that did not run). */
KILN_API kiln_tensor *kiln_grad_at(const kiln_tensor *, const char *file, int line);
#define kiln_grad(...) KILN_CALL(kiln_tensor *, kiln_grad_at, __VA_ARGS__)
KILN_API void kiln_zero_grad_at(kiln_tensor *, const char *file, int line); /* drops .grad */
#define kiln_zero_grad(...) KILN_CALL(void, kiln_zero_grad_at, __VA_ARGS__)
/* kiln_requires_grad, kiln_zero_grad and kiln_grad as plain functions (their errors name no line). */
KILN_API void (kiln_requires_grad)(kiln_tensor *, bool);
KILN_API void (kiln_zero_grad)(kiln_tensor *);
KILN_API kiln_tensor *(kiln_grad)(const kiln_tensor *);
/* No-grad scopes nest; ops inside record nothing for autograd. */
KILN_API void kiln_no_grad_begin(void);
KILN_API void kiln_no_grad_end(void);
KILN_API bool kiln_grad_enabled(void);

/* ---- compile: trace once, run the graph after ---------------------------- */

/* The function a compiled kiln_fn wraps: reads in[0..n_in), sets out[0..n_out),
 * returns 0 (or nonzero for an error of its own, which kiln_call passes on). */
typedef int (*kiln_body)(void *ctx, kiln_tensor *const *in, kiln_tensor **out);

/* ---- structured control flow: cond, while_loop, scan ----------------------
 *
 * Bodies are kiln_body functions. Each returns 0 or -1 with the error set;
 * results are new references owned like op results. The bodies run as plain
 * C, so gradients flow through the ops they run; inside a compiled function
 * each predicate read is a graph break and loops unroll into the recording
 * (docs/guide.md, "Control flow"). */

/* pred: a one-element bool tensor. Runs then_fn or else_fn on in[0..n_in);
   both set out[0..n_out) with the same dtypes and shapes. 0 or -1. */
KILN_API int kiln_cond_at(kiln_tensor *pred, kiln_body then_fn, kiln_body else_fn, void *ctx, int n_in,
                          kiln_tensor *const *in, int n_out, kiln_tensor **out, const char *file, int line);
/* carry = init; while cond_fn(carry) sets out[0] to a true one-element bool,
   carry = body_fn(carry). Both read in[0..n_carry); body_fn sets
   out[0..n_carry) with the carry's dtypes and shapes. final: the last carry. */
KILN_API int kiln_while_loop_at(kiln_body cond_fn, kiln_body body_fn, void *ctx, int n_carry,
                                kiln_tensor *const *init, kiln_tensor **final, const char *file, int line);
/* For t in 0..T-1, T = size of dim 0 of every xs[j]: body_fn reads
   in = carry[0..n_carry), xs[0][t] ... xs[n_xs-1][t] and sets
   out = new carry[0..n_carry), y_0[t] ... y_{n_ys-1}[t]. carry_out: the last
   carry; ys[k]: the y_k[t] stacked along a new dim 0. T may be 0 (then the
   body runs once, without autograd, on zeros, to learn the shapes of ys). */
KILN_API int kiln_scan_at(kiln_body body_fn, void *ctx, int n_carry, kiln_tensor *const *init, int n_xs,
                          kiln_tensor *const *xs, kiln_tensor **carry_out, int n_ys, kiln_tensor **ys,
                          const char *file, int line);
#define kiln_cond(...) KILN_CALL(int, kiln_cond_at, __VA_ARGS__)
#define kiln_while_loop(...) KILN_CALL(int, kiln_while_loop_at, __VA_ARGS__)
#define kiln_scan(...) KILN_CALL(int, kiln_scan_at, __VA_ARGS__)

enum kiln_dynamic {
  KILN_DYNAMIC_AUTO = 0,   /* first trace static; a dim that later changes becomes a symbol */
  KILN_DYNAMIC_STATIC = 1, /* every dim static: a new size is a new variant */
  KILN_DYNAMIC_ALL = 2     /* every input dim a symbol from the first trace (sizes 0 stay static) */
};

/* Dump flags (opts.dump), ORed with the KILN_DUMP variable ("trace,graph,guards"). */
enum kiln_dump {
  KILN_DUMP_TRACE = 1 << 0,      /* the IR as traced */
  KILN_DUMP_GRAPH = 1 << 1,      /* the IR after the passes */
  KILN_DUMP_GUARDS = 1 << 2,     /* what a call must satisfy to run a variant */
  KILN_DUMP_RECOMPILES = 1 << 3, /* every retrace and fallback, with the reason */
  KILN_DUMP_KERNELS = 1 << 4,    /* codegen: fusion groups and the memory plan */
  KILN_DUMP_LLVM = 1 << 5,       /* codegen: the optimized LLVM module */
  KILN_DUMP_ASM = 1 << 6,        /* codegen: machine code */
  KILN_DUMP_BREAKS = 1 << 7,     /* each graph break (a data read inside the body), with its file:line */
  KILN_DUMP_ALL = 0xff
};

enum kiln_backend {
  KILN_BACKEND_DEFAULT = 0, /* KILN_BACKEND variable ("interp", "llvm"), else the best there is */
  KILN_BACKEND_INTERP = 1,  /* the IR interpreter: runs the graph through the eager kernels */
  KILN_BACKEND_LLVM = 2
};

/* How a call finds its variant. The body is C: what it does may depend on
 * sizes, numbers and data kiln cannot see, so by default every call runs the
 * body as a recording (ops make shapes, not data: no compute) and the
 * recording must match a variant; a body whose first recording read no size,
 * data or number it could branch on takes the guard-only path, where a call
 * that passes the guards runs compiled code without running the body. */
enum kiln_capture {
  KILN_CAPTURE_AUTO = 0,   /* the guard-only path where the first recording shows it is sound */
  KILN_CAPTURE_RECORD = 1, /* always record (KILN_CAPTURE=record) */
  KILN_CAPTURE_GUARDS = 2  /* always the guard-only path after the first call: the user vouches that
                              the body depends on nothing but its inputs' dtypes and shapes (KILN_CAPTURE=guards) */
};

/* Zero means default for every field, and opts = NULL means every default:
 * no inputs and one output. */
typedef struct kiln_options {
  const char *name;  /* shown in dumps and errors; default "fn" */
  int n_in, n_out;   /* tensors the body takes (0 to 64) and sets (1 to 64; 0 = 1) */
  int dynamic;       /* enum kiln_dynamic */
  unsigned dump;     /* enum kiln_dump bits */
  int max_variants;  /* cached graphs before eager fallback; 0 = 8 */
  int check;         /* also run eagerly on every compiled call and compare (KILN_CHECK=1 too) */
  int freeze;        /* implicit inputs (weights the body reaches) become constants */
  int backend;       /* enum kiln_backend */
  int capture;       /* enum kiln_capture (KILN_CAPTURE variable too) */
  int fullgraph;     /* a graph break is an error naming its line (KILN_FULLGRAPH=1 too) */
  int scan_save;     /* enum kiln_scan_save: what a differentiated kiln_scan keeps for its backward */
} kiln_options;

/* What the forward of a kiln_scan that autograd differentiates through, in
 * a compiled function, keeps of each step for the backward (as
 * jax.checkpoint's policies): the rest the backward recomputes. */
enum kiln_scan_save {
  KILN_SCAN_SAVE_DOTS = 0,    /* the default: each step's incoming carry and its matmuls' results */
  KILN_SCAN_SAVE_CARRIES = 1, /* the carry alone, T times its size: the backward recomputes each step */
};

typedef struct kiln_fn kiln_fn;

/* Counters of one kiln_fn since kiln_compile. */
typedef struct kiln_fn_stats {
  int64_t calls;         /* kiln_call */
  int64_t hits;          /* calls compiled code served wholly (every segment matched a variant) */
  int64_t traces;        /* calls that compiled something new */
  int64_t fallbacks;     /* calls that ran ops eagerly (the variant cap reached: the interpreter ran them) */
  int64_t guard_hits;    /* hits on the guard-only path (the body did not run) */
  int64_t breaks;        /* graph breaks: data reads inside the body that ran a segment */
  int64_t variants;      /* graphs cached now */
  int64_t check_fails;   /* check mode: calls whose compiled result differed from eager */
  double trace_ms;       /* total time spent running the body as a recording */
  double compile_ms;     /* total time in passes and backend compile, which splits into: */
  double passes_ms;      /*   the IR passes */
  double fuse_ms;        /*   fusion, planning and lowering to LLVM IR */
  double llvm_opt_ms;    /*   LLVM's optimization */
  double llvm_codegen_ms; /*  machine code */
  double guard_ns;       /* mean time to check guards on a hit (the first 16, then one call in 16) */
  int64_t replays;       /* hits whose body followed an earlier call's log step by step (no recording) */
} kiln_fn_stats;

KILN_API kiln_fn *kiln_compile_at(kiln_body body, void *ctx, const kiln_options *opts, const char *file, int line);
#define kiln_compile(...) KILN_CALL(kiln_fn *, kiln_compile_at, __VA_ARGS__)
/* Runs fn: a cached variant whose guards pass, else a new trace, else the body
 * eagerly. out[i] are new tensors (owned by the innermost scope, else the
 * caller's). 0, or -1 with the error set. */
KILN_API int kiln_call_at(kiln_fn *fn, kiln_tensor *const *in, kiln_tensor **out, const char *file, int line);
#define kiln_call(...) KILN_CALL(int, kiln_call_at, __VA_ARGS__)
KILN_API void kiln_fn_free_at(kiln_fn *fn, const char *file, int line);
#define kiln_fn_free(...) KILN_CALL(void, kiln_fn_free_at, __VA_ARGS__)
/* Makes input's dim symbolic in the traces after this call, whatever the
 * dynamic policy: call it before the first kiln_call to have the dim symbolic
 * from the first trace. Variants already cached stay as they were traced (a
 * call they fit still runs them). -1 for an input out of range or a loaded
 * function; a dim past the input's rank is accepted and changes nothing. */
KILN_API int kiln_mark_dynamic_at(kiln_fn *fn, int input, int dim, const char *file, int line);
#define kiln_mark_dynamic(...) KILN_CALL(int, kiln_mark_dynamic_at, __VA_ARGS__)
KILN_API int kiln_fn_get_stats_at(const kiln_fn *fn, kiln_fn_stats *stats, const char *file, int line);
#define kiln_fn_get_stats(...) KILN_CALL(int, kiln_fn_get_stats_at, __VA_ARGS__)
/* The text of variant i (newest last) after the passes; a malloc'ed string
 * (free() it), NULL when there is no such variant. */
KILN_API char *kiln_fn_graph_at(const kiln_fn *fn, int variant, const char *file, int line);
#define kiln_fn_graph(...) KILN_CALL(char *, kiln_fn_graph_at, __VA_ARGS__)
/* Writes the newest variant's graph as text (docs/ir.md), after a line
 * `version N` (the format's; kiln_load reads files with or without it and
 * refuses a newer N): 0 or -1. */
KILN_API int kiln_save_at(kiln_fn *fn, const char *path, const char *file, int line);
#define kiln_save(...) KILN_CALL(int, kiln_save_at, __VA_ARGS__)
/* Same for a chosen variant: 0 the newest, 1 .. n the cached ones oldest first (as kiln_export). */
KILN_API int kiln_save_variant_at(kiln_fn *fn, const char *path, int variant, const char *file, int line);
#define kiln_save_variant(...) KILN_CALL(int, kiln_save_variant_at, __VA_ARGS__)
/* A callable kiln_fn from a saved graph, without the C body: its inputs are
 * the graph's inputs, then its params in order. NULL with the error set (a
 * malformed file names its line and column). */
KILN_API kiln_fn *kiln_load_at(const char *path, const char *file, int line);
#define kiln_load(...) KILN_CALL(kiln_fn *, kiln_load_at, __VA_ARGS__)
/* Same, from text in memory. */
KILN_API kiln_fn *kiln_load_string_at(const char *text, const char *file, int line);
#define kiln_load_string(...) KILN_CALL(kiln_fn *, kiln_load_string_at, __VA_ARGS__)
/* Names the tensor's storage (views share it): a saved graph names the param
 * it captured so (`@param(wte)`), a function loaded from it refuses a
 * named tensor passed where another name is taken (params in the wrong
 * order), and an export's header uses the names. A param never named is
 * named after the call that first used it (`gpt_h_280`), docs/ir.md. 1 to
 * 128 of A-Z a-z 0-9 _ . : / -; naming again renames. 0 or -1. */
KILN_API int kiln_param_name_at(kiln_tensor *t, const char *name, const char *file, int line);
#define kiln_param_name(...) KILN_CALL(int, kiln_param_name_at, __VA_ARGS__)

/* Ahead-of-time export (docs/deploy.md): writes one compiled variant of fn
 * as <prefix>.o (its kernels, the plan that runs them, the params' values)
 * and <prefix>.h (its two entry points, documented with the inputs' and
 * outputs' dtypes and shapes, symbolic sizes included). A program links
 * them with libkiln_rt alone, no libkiln or LLVM:
 *
 *   kiln_export(fn, "build/mlp", &(kiln_export_options){.name = "mlp"});
 *   // app.c: #include "mlp.h"   cc app.c build/mlp.o -lkiln_rt -lopenblas -lm -lpthread
 *   kiln_rt_buffer in[1] = {{x, 2, {batch, 784}}}, out[1] = {{0}};
 *   if (mlp_run(in, out)) fprintf(stderr, "%s\n", mlp_error());
 *
 * Symbolic sizes stay arguments: one export serves every size the variant's
 * guards allow, and a call that breaks them is an error. Refused (-1, with
 * the op and its file:line): variants that write back to inputs (a training
 * step), read .grad, have graph breaks, or run an op through an eager kernel
 * that libkiln_rt does not have (argmax, cat, index_add, convolutions;
 * index_select, an embedding, runs). 0 or -1. */
typedef struct kiln_export_options {
  const char *name;     /* C identifier prefix of the generated functions; default fn's name */
  const char *target;   /* LLVM target triple ("aarch64-linux-gnu"); NULL = the host */
  const char *cpu;      /* target CPU; NULL = a generic CPU of that target; "native" = this machine's */
  int variant;          /* which cached variant: 0 = the newest, 1 .. n = the oldest first */
  int params_as_inputs; /* 0: the params' values now are embedded; 1: they are inputs after the graph's */
} kiln_export_options;
KILN_API int kiln_export_at(kiln_fn *fn, const char *prefix, const kiln_export_options *opts, const char *file, int line);
#define kiln_export(...) KILN_CALL(int, kiln_export_at, __VA_ARGS__)
/* The functions above as plain functions, for a caller that needs an address
 * or was compiled before the _at forms; their errors name no line. */
KILN_API void (kiln_fn_free)(kiln_fn *fn);
KILN_API int (kiln_mark_dynamic)(kiln_fn *fn, int input, int dim);
KILN_API int (kiln_fn_get_stats)(const kiln_fn *fn, kiln_fn_stats *stats);
KILN_API char *(kiln_fn_graph)(const kiln_fn *fn, int variant);
KILN_API int (kiln_save)(kiln_fn *fn, const char *path);
KILN_API int (kiln_save_variant)(kiln_fn *fn, const char *path, int variant);
KILN_API kiln_fn *(kiln_load)(const char *path);
KILN_API kiln_fn *(kiln_load_string)(const char *text);
KILN_API int (kiln_export)(kiln_fn *fn, const char *prefix, const kiln_export_options *opts);
KILN_API int (kiln_param_name)(kiln_tensor *t, const char *name);
/* Forgets the compiled kernels kept in memory for later compiles (the
 * kernel cache; KILN_CACHE_DIR's files stay). Compiled functions keep
 * their code; the next compile of any kernel runs LLVM again. */
KILN_API void kiln_cache_clear(void);

/* ---- errors and runtime ----------------------------------------------- */

/* The library's version, "0.1.0" (KILN_VERSION_STRING of the kiln.h it was built with). */
KILN_API const char *kiln_version(void);

/* The last error on this thread: "file.c:42: kiln_op: message". "" when none. */
KILN_API const char *kiln_last_error(void);
KILN_API void kiln_clear_error(void);
/* Threads of the compute pool (default: KILN_NUM_THREADS, else the core count).
 * Also sets OpenBLAS's count, so the two never oversubscribe the cores. */
KILN_API void kiln_set_num_threads(int n);
KILN_API int kiln_get_num_threads(void);
/* Bytes of tensor storage alive now, and the peak since the last reset. */
KILN_API size_t kiln_mem_in_use(void);
KILN_API size_t kiln_mem_peak(void);
KILN_API void kiln_mem_reset_peak(void);

/* ---- weights: safetensors files ------------------------------------------
 *
 * The format PyTorch and Hugging Face keep weights in
 * (safetensors.torch.save_file, load_file): a JSON header that names each
 * tensor with its dtype, shape and byte range, then the raw data, row-major
 * and little-endian. Files written here load there, and the other way round.
 * kiln's F32, F64, F16, BF16, I64, I32 and BOOL are the format's "F32",
 * "F64", "F16", "BF16", "I64", "I32" and "BOOL". A file may hold other
 * dtypes ("U8", "I16", ...): they are listed, and loading one is an error
 * that names it.
 *
 *   const char *names[] = {"fc.weight", "fc.bias"};
 *   kiln_tensor *params[] = {m.w, m.b};
 *   kiln_save_tensors("model.safetensors", 2, names, params);
 *   kiln_load_tensors_into("model.safetensors", 2, names, params);  // dtype and shape must match
 *
 * A file is data: a malformed or hostile one is an error that names the
 * file and what is wrong (docs/reliability.md lists the rules), never a
 * crash, and what kiln allocates follows the file's size, never the numbers
 * in its header. Errors return -1 or NULL with kiln_last_error() set. */

typedef struct kiln_tensor_file kiln_tensor_file; /* an open file, its header checked */

/* One entry of a file, as kiln_tensors_info describes it. Pointers are valid
 * until kiln_tensors_close. */
typedef struct kiln_tensor_info {
  const char *name;     /* UTF-8, as in the file */
  const char *dtype;    /* as the file spells it: "F32", "BF16", "U8", ... */
  bool loadable;        /* kiln has the dtype, and the rank is at most KILN_MAX_DIMS */
  kiln_dtype type;      /* the dtype it loads as (when loadable) */
  int ndim;
  const int64_t *shape; /* ndim sizes */
  int64_t offset;       /* its bytes are [offset, offset + nbytes) of the file */
  int64_t nbytes;
} kiln_tensor_info;

/* Writes tensors[i] under names[i], i < n: 0 or -1. Names are distinct,
 * non-empty UTF-8, and not "__metadata__"; views are written row-major. The
 * data is laid out as the reference writer lays it out (larger elements
 * first, the header padded to 8 bytes), and the file is written beside path,
 * then renamed over it, so a reader never sees half of it. */
KILN_API int kiln_save_tensors_at(const char *path, int n, const char *const *names, kiln_tensor *const *tensors,
                                  const char *file, int line);
/* Same, with the header's "__metadata__": meta lists key, value, key, value,
 * ... and ends with NULL ({"format", "pt", NULL} is what Hugging Face
 * transformers looks for). */
KILN_API int kiln_save_tensors_meta_at(const char *path, int n, const char *const *names,
                                       kiln_tensor *const *tensors, const char *const *meta, const char *file,
                                       int line);
/* out[i] = a new tensor holding the entry names[i] (owned as every returned
 * tensor: by the innermost scope, else the caller). 0, or -1 with every
 * out[i] NULL; a missing name is an error that lists names the file holds. */
KILN_API int kiln_load_tensors_at(const char *path, int n, const char *const *names, kiln_tensor **out,
                                  const char *file, int line);
/* Copies the entry names[i] into dst[i], whose dtype and shape must be the
 * entry's (model params: this is load_state_dict). Every entry is checked
 * before any is written; dst may require grad (the copy is not recorded, and
 * a backward through the old values is refused) or be a view, not an
 * expanded one. Not inside a function being traced. 0 or -1. */
KILN_API int kiln_load_tensors_into_at(const char *path, int n, const char *const *names, kiln_tensor *const *dst,
                                       const char *file, int line);
#define kiln_save_tensors(...) KILN_CALL(int, kiln_save_tensors_at, __VA_ARGS__)
#define kiln_save_tensors_meta(...) KILN_CALL(int, kiln_save_tensors_meta_at, __VA_ARGS__)
#define kiln_load_tensors(...) KILN_CALL(int, kiln_load_tensors_at, __VA_ARGS__)
#define kiln_load_tensors_into(...) KILN_CALL(int, kiln_load_tensors_into_at, __VA_ARGS__)

/* A file held open, as safetensors' safe_open: list its entries, get them
 * one by one (each read from the file when asked). The header is read and
 * checked whole by kiln_tensors_open; NULL with the error set. A handle may
 * be used from several threads at once. */
KILN_API kiln_tensor_file *kiln_tensors_open_at(const char *path, const char *file, int line);
/* Entries, in the order of their data in the file; -1 for NULL. */
KILN_API int kiln_tensors_count(const kiln_tensor_file *);
/* Describes entry i (0 <= i < count): 0 or -1. */
KILN_API int kiln_tensors_info_at(const kiln_tensor_file *, int i, kiln_tensor_info *info, const char *file,
                                  int line);
/* The index of the entry called name, or -1 (no error set). */
KILN_API int kiln_tensors_find(const kiln_tensor_file *, const char *name);
/* A new tensor holding the entry called name (owned as kiln_load_tensors' are), or NULL. */
KILN_API kiln_tensor *kiln_tensors_get_at(kiln_tensor_file *, const char *name, const char *file, int line);
/* The value "__metadata__" gives key, or NULL. Valid until kiln_tensors_close. */
KILN_API const char *kiln_tensors_metadata(const kiln_tensor_file *, const char *key);
KILN_API void kiln_tensors_close(kiln_tensor_file *);
#define kiln_tensors_open(...) KILN_CALL(kiln_tensor_file *, kiln_tensors_open_at, __VA_ARGS__)
#define kiln_tensors_info(...) KILN_CALL(int, kiln_tensors_info_at, __VA_ARGS__)
#define kiln_tensors_get(...) KILN_OP(kiln_tensors_get_at, __VA_ARGS__)

#ifdef __cplusplus
}
#endif
#endif
