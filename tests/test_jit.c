/* test_jit.c - the ORC JIT (src/codegen/jit.c) and the vector math emitted as
 * IR (src/codegen/vmath_ir.c).
 *
 * jit: a loop kernel built here compiles, runs and vectorizes for the host; a
 * broken module or a missing symbol gives NULL and LLVM's message; modules
 * compile in several threads at once.
 * vmath: each op is a loop kernel out[i] = op(in[i]), JIT-compiled, and swept
 * like tests/test_vmath.c (every 1021st bit pattern of the float line, the
 * hard ranges dense) against f64 references with the bounds of vmath.h, and
 * against the eager kernels (kiln_exp ...) on the same array. The same op
 * emitted on explicit <8 x float> vectors must agree bit for bit with the
 * loop the vectorizer widened. f64 goes against libm and vmath.h's f64 forms. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if __has_include(<llvm-c/Core.h>)

#include "codegen/codegen.h"
#include "eager/vmath.h"

/* ---- building kernels ------------------------------------------------------ */

typedef LLVMValueRef (*body_fn)(LLVMBuilderRef b, int op, LLVMValueRef x);
typedef void (*jit_kernel)(void *out, const void *in, int64_t n);

/* Adds void name(T *out, const T *in, int64_t n) to m, out[i] = body(op,
 * in[i]) for i < n, where T is float or double. lanes > 0: the body works on
 * <lanes x T> vectors (n a multiple of lanes); 0: on scalars, for the loop
 * vectorizer to widen. */
static void add_kernel(cg_module *m, const char *name, bool f64, unsigned lanes, body_fn body, int op) {
  LLVMContextRef c = m->ctx;
  LLVMTypeRef t = f64 ? LLVMDoubleTypeInContext(c) : LLVMFloatTypeInContext(c);
  LLVMTypeRef vt = lanes ? LLVMVectorType(t, lanes) : t;
  LLVMTypeRef ptr = LLVMPointerTypeInContext(c, 0), i64 = LLVMInt64TypeInContext(c);
  LLVMTypeRef params[3] = {ptr, ptr, i64};
  LLVMValueRef fn = LLVMAddFunction(m->mod, name, LLVMFunctionType(LLVMVoidTypeInContext(c), params, 3, 0));
  unsigned noalias = LLVMGetEnumAttributeKindForName("noalias", 7);
  LLVMAddAttributeAtIndex(fn, 1, LLVMCreateEnumAttribute(c, noalias, 0));
  LLVMAddAttributeAtIndex(fn, 2, LLVMCreateEnumAttribute(c, noalias, 0));
  LLVMValueRef out = LLVMGetParam(fn, 0), in = LLVMGetParam(fn, 1), n = LLVMGetParam(fn, 2);

  LLVMBasicBlockRef entry = LLVMAppendBasicBlockInContext(c, fn, "entry");
  LLVMBasicBlockRef loop = LLVMAppendBasicBlockInContext(c, fn, "loop");
  LLVMBasicBlockRef done = LLVMAppendBasicBlockInContext(c, fn, "done");
  LLVMBuilderRef b = LLVMCreateBuilderInContext(c);
  LLVMPositionBuilderAtEnd(b, entry);
  LLVMValueRef zero = LLVMConstInt(i64, 0, 0);
  LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSGT, n, zero, ""), loop, done);

  LLVMPositionBuilderAtEnd(b, loop);
  LLVMValueRef i = LLVMBuildPhi(b, i64, "i");
  LLVMValueRef x = LLVMBuildLoad2(b, vt, LLVMBuildGEP2(b, t, in, &i, 1, ""), "x");
  LLVMSetAlignment(x, f64 ? 8 : 4);
  LLVMValueRef y = body(b, op, x);
  LLVMValueRef st = LLVMBuildStore(b, y, LLVMBuildGEP2(b, t, out, &i, 1, ""));
  LLVMSetAlignment(st, f64 ? 8 : 4);
  LLVMValueRef next = LLVMBuildNUWAdd(b, i, LLVMConstInt(i64, lanes ? lanes : 1, 0), "");
  LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, next, n, ""), loop, done);
  LLVMValueRef inc[2] = {zero, next};
  LLVMBasicBlockRef from[2] = {entry, loop};
  LLVMAddIncoming(i, inc, from, 2);

  LLVMPositionBuilderAtEnd(b, done);
  LLVMBuildRetVoid(b);
  LLVMDisposeBuilder(b);
}

/* x * 2 + 1 */
static LLVMValueRef affine(LLVMBuilderRef b, int op, LLVMValueRef x) {
  (void)op;
  LLVMTypeRef t = LLVMTypeOf(x);
  return LLVMBuildFAdd(b, LLVMBuildFMul(b, x, LLVMConstReal(t, 2.0), ""), LLVMConstReal(t, 1.0), "");
}

static jit_kernel lookup(cg_jit *j, const char *name) {
  void *p = jit_lookup(j, name);
  jit_kernel f = NULL;
  if (p) memcpy(&f, &p, sizeof f);
  return f;
}

/* One kernel "k" in a module of its own; the optimized IR in *dump (to
 * free) when dump is not NULL. NULL with err. */
static cg_jit *compile_kernel(bool f64, unsigned lanes, body_fn body, int op, char **dump, char *err, size_t errn) {
  cg_module m;
  if (jit_module_new(&m, "test", err, errn) != 0) return NULL;
  add_kernel(&m, "k", f64, lanes, body, op);
  size_t len = 0;
  FILE *f = dump ? open_memstream(dump, &len) : NULL;
  cg_jit *j = jit_compile(&m, f ? KILN_DUMP_LLVM : 0, f, NULL, NULL, err, errn);
  if (f) fclose(f);
  return j;
}

static bool has_avx(void) { return __builtin_cpu_supports("avx"); }

/* ---- jit ---------------------------------------------------------------------- */

START_TEST(test_compile_run) {
  char err[512] = "";
  /* the first compile in a process pays for LLVM's setup, so compile twice */
  cg_jit *j = NULL;
  char *dump = NULL;
  for (int round = 0; round < 2; round++) {
    jit_free(j);
    free(dump);
    dump = NULL;
    cg_module m;
    ck_assert_int_eq(0, jit_module_new(&m, "basic", err, sizeof err));
    ck_assert_str_ne("", LLVMGetDataLayoutStr(m.mod)); /* the lowering needs it */
    add_kernel(&m, "f", false, 0, affine, 0);
    size_t len = 0;
    FILE *f = open_memstream(&dump, &len);
    double opt_ms = -1, cg_ms = -1;
    j = jit_compile(&m, KILN_DUMP_LLVM | KILN_DUMP_ASM, f, &opt_ms, &cg_ms, err, sizeof err);
    fclose(f);
    ck_assert_msg(j != NULL, "jit_compile: %s", err);
    ck_assert_ptr_null(m.mod); /* consumed */
    ck_assert(opt_ms >= 0 && cg_ms >= 0);
    printf("test_jit: small module (%s compile): optimize %.2f ms, codegen %.2f ms\n", round ? "second" : "first",
           opt_ms, cg_ms);
  }

  jit_kernel fn = lookup(j, "f");
  ck_assert_ptr_nonnull(fn);
  ck_assert_ptr_null(jit_lookup(j, "g"));
  enum { N = 1003 }; /* not a multiple of any vector width */
  float in[N], out[N + 1];
  for (int i = 0; i < N; i++) in[i] = (float)i * 0.25f - 7.0f;
  out[N] = 42.0f;
  fn(out, in, N);
  for (int i = 0; i < N; i++) ck_assert_msg(in[i] * 2.0f + 1.0f == out[i], "out[%d] = %g", i, (double)out[i]);
  ck_assert_float_eq(42.0f, out[N]); /* no write past n */
  fn(out, in, 0);

  /* the optimized IR, then the machine code */
  ck_assert_ptr_nonnull(strstr(dump, "define void @f("));
  if (has_avx()) {
    ck_assert_msg(strstr(dump, "x float>") != NULL, "the loop did not vectorize:\n%s", dump);
    ck_assert_msg(strstr(dump, "ymm") || strstr(dump, "zmm"), "no AVX registers in the machine code");
  }
  ck_assert_ptr_nonnull(strstr(dump, "f:"));
  free(dump);
  jit_free(j);
  jit_free(NULL);
}
END_TEST

START_TEST(test_module_dispose) {
  char err[256];
  cg_module m;
  ck_assert_int_eq(0, jit_module_new(&m, "unused", err, sizeof err));
  add_kernel(&m, "f", true, 0, affine, 0);
  jit_module_dispose(&m); /* never compiled: freed without leaks (ASan) */
  ck_assert_ptr_null(m.mod);
  ck_assert_int_eq(0, jit_init(err, sizeof err));
}
END_TEST

START_TEST(test_invalid_module) {
  char err[512] = "";
  cg_module m;
  ck_assert_int_eq(0, jit_module_new(&m, "bad", err, sizeof err));
  LLVMTypeRef vt = LLVMFunctionType(LLVMVoidTypeInContext(m.ctx), NULL, 0, 0);
  LLVMValueRef g = LLVMAddFunction(m.mod, "g", vt);
  LLVMAppendBasicBlockInContext(m.ctx, g, "entry"); /* no terminator */
  cg_jit *j = jit_compile(&m, KILN_DUMP_LLVM, stderr, NULL, NULL, err, sizeof err);
  ck_assert_ptr_null(j);
  ck_assert_ptr_null(m.mod);
  ck_assert_msg(strstr(err, "invalid LLVM module") && strstr(err, "terminator"), "message: %s", err);

  /* a call to a function nobody defines: the JIT's lookup fails, with the name */
  ck_assert_int_eq(0, jit_module_new(&m, "unresolved", err, sizeof err));
  vt = LLVMFunctionType(LLVMVoidTypeInContext(m.ctx), NULL, 0, 0); /* types belong to a context */
  LLVMValueRef missing = LLVMAddFunction(m.mod, "kiln_test_no_such_symbol", vt);
  LLVMValueRef h = LLVMAddFunction(m.mod, "h", vt);
  LLVMBuilderRef b = LLVMCreateBuilderInContext(m.ctx);
  LLVMPositionBuilderAtEnd(b, LLVMAppendBasicBlockInContext(m.ctx, h, "entry"));
  LLVMBuildCall2(b, vt, missing, NULL, 0, "");
  LLVMBuildRetVoid(b);
  LLVMDisposeBuilder(b);
  err[0] = '\0';
  j = jit_compile(&m, 0, NULL, NULL, NULL, err, sizeof err);
  ck_assert_ptr_null(j);
  ck_assert_msg(strstr(err, "kiln_test_no_such_symbol") != NULL, "message: %s", err);

  /* err may be NULL */
  ck_assert_int_eq(0, jit_module_new(&m, "bad2", err, sizeof err));
  vt = LLVMFunctionType(LLVMVoidTypeInContext(m.ctx), NULL, 0, 0);
  g = LLVMAddFunction(m.mod, "g", vt);
  LLVMAppendBasicBlockInContext(m.ctx, g, "entry");
  ck_assert_ptr_null(jit_compile(&m, 0, NULL, NULL, NULL, NULL, 0));
}
END_TEST

#ifdef KILN_TEST_BUILD
/* Every allocation failure in jit_compile gives "out of memory", never a
 * crash or a leak. */
START_TEST(test_out_of_memory) {
  char err[512];
  int failed = 0;
  for (int n = 1;; n++) {
    cg_module m;
    ck_assert_int_eq(0, jit_module_new(&m, "oom", err, sizeof err));
    add_kernel(&m, "f", false, 0, affine, 0);
    add_kernel(&m, "g", true, 0, affine, 0);
    alloc_fail_after(n);
    cg_jit *j = jit_compile(&m, 0, NULL, NULL, NULL, err, sizeof err);
    alloc_fail_after(0);
    if (j) {
      ck_assert_ptr_nonnull(jit_lookup(j, "f"));
      ck_assert_ptr_nonnull(jit_lookup(j, "g"));
      jit_free(j);
      break;
    }
    ck_assert_msg(strstr(err, "out of memory") != NULL, "n=%d: %s", n, err);
    failed++;
  }
  ck_assert_int_ge(failed, 3);
}
END_TEST
#endif

/* Several threads each build, compile, run and free modules of their own. */
enum { THREADS = 4, PER_THREAD = 5, TN = 4099 };

typedef struct job {
  int id;
  int failures;
  char err[512];
} job;

static void *compile_many(void *arg) {
  job *jb = arg;
  static _Thread_local float in[TN], out[TN];
  for (int r = 0; r < PER_THREAD; r++) {
    cg_module m;
    if (jit_module_new(&m, "threaded", jb->err, sizeof jb->err) != 0) {
      jb->failures++;
      continue;
    }
    add_kernel(&m, "affine", false, 0, affine, 0);
    add_kernel(&m, "exp", false, 0, vmath_emit, OP_EXP);
    add_kernel(&m, "tanh64", true, 0, vmath_emit, OP_TANH);
    cg_jit *j = jit_compile(&m, 0, NULL, NULL, NULL, jb->err, sizeof jb->err);
    if (!j) {
      jb->failures++;
      continue;
    }
    jit_kernel fa = lookup(j, "affine"), fe = lookup(j, "exp"), ft = lookup(j, "tanh64");
    if (!fa || !fe || !ft) {
      jb->failures++;
      jit_free(j);
      continue;
    }
    for (int i = 0; i < TN; i++) in[i] = (float)(i - TN / 2) * (0.01f + 0.001f * (float)jb->id);
    fa(out, in, TN);
    for (int i = 0; i < TN; i++)
      if (out[i] != in[i] * 2.0f + 1.0f) jb->failures++;
    fe(out, in, TN);
    for (int i = 0; i < TN; i++)
      if (memcmp(&out[i], &(float){vm_expf(in[i])}, sizeof(float)) != 0) jb->failures++;
    double din[64], dout[64];
    for (int i = 0; i < 64; i++) din[i] = (i - 32) * 0.3;
    ft(dout, din, 64);
    for (int i = 0; i < 64; i++)
      if (dout[i] != tanh(din[i])) jb->failures++;
    jit_free(j);
  }
  return NULL;
}

START_TEST(test_threads) {
  pthread_t t[THREADS];
  job jobs[THREADS];
  for (int i = 0; i < THREADS; i++) {
    jobs[i] = (job){.id = i};
    ck_assert_int_eq(0, pthread_create(&t[i], NULL, compile_many, &jobs[i]));
  }
  for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < THREADS; i++)
    ck_assert_msg(jobs[i].failures == 0, "thread %d: %d failures (%s)", i, jobs[i].failures, jobs[i].err);
}
END_TEST

/* ---- vector math: measures, as in test_vmath.c ------------------------------- */

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

/* The same for doubles, against a long double reference. */
static double ulp_err64(double y, long double ref) {
  if (isnan(ref) || isnan(y)) return isnan(ref) && isnan(y) ? 0.0 : INFINITY;
  double rd = (double)ref;
  if (isinf(rd) || isinf(y)) return y == rd ? 0.0 : INFINITY;
  long double a = fabsl(ref);
  int e;
  frexpl(a, &e);
  long double ulp = a < 0x1p-1022L ? 0x1p-1074L : ldexpl(1.0L, e - 53);
  return (double)(fabsl((long double)y - ref) / ulp);
}

typedef struct worst {
  double ulp;   /* largest error seen */
  double x;     /* where, and what came out */
  double got, want;
  long n;       /* inputs checked */
} worst;

static void note(worst *w, double e, double x, double got, double want) {
  w->n++;
  if (e > w->ulp) w->ulp = e, w->x = x, w->got = got, w->want = want;
}

#define ASSERT_ULP(NAME, W, BOUND)                                                                             \
  ck_assert_msg((W).ulp <= (BOUND), "%s: max %.3f ulp > %.2f at x = %a (%.17g): got %.17g, want %.17g (%ld inputs)", \
                NAME, (W).ulp, (double)(BOUND), (W).x, (W).x, (W).got, (W).want, (W).n)

static float from_bits(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

static uint32_t to_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

/* the same value, nan meeting nan */
static bool same_float(float a, float b) { return (isnan(a) && isnan(b)) || to_bits(a) == to_bits(b); }
static bool same_double(double a, double b) {
  uint64_t ua, ub;
  memcpy(&ua, &a, sizeof ua);
  memcpy(&ub, &b, sizeof ub);
  return (isnan(a) && isnan(b)) || ua == ub;
}

/* Independent f64 references for the composite functions (test_vmath.c's). */
static double ref_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static double ref_gelu(double x) {
  double u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
  return x == -INFINITY ? -0.0 : x / (1.0 + exp(-2.0 * u));
}
static double ref_gelu_erf(double x) { return x == -INFINITY ? -0.0 : 0.5 * x * erfc(-x / sqrt(2.0)); }
static double ref_rsqrt(double x) { return 1.0 / sqrt(x); }
static double ref_silu(double x) { return x == -INFINITY ? -0.0 : x / (1.0 + exp(-x)); }
static double ref_softplus(double x) { return x > 20.0 ? x : log1p(exp(x)); }

/* f64 oracles: what eager computes (libm, vmath.h's stable forms) */
static double d_exp(double x) { return exp(x); }
static double d_log(double x) { return log(x); }
static double d_tanh(double x) { return tanh(x); }
static double d_erf(double x) { return erf(x); }
static double d_sin(double x) { return sin(x); }
static double d_cos(double x) { return cos(x); }
static double d_sqrt(double x) { return sqrt(x); }
static double d_rsqrt(double x) { return 1.0 / sqrt(x); }
static double d_sigmoid(double x) { return vm_sigmoid(x); }
static double d_gelu(double x) { return vm_gelu(x); }
static double d_gelu_erf(double x) { return vm_gelu_erf(x); }
static double d_silu(double x) { return vm_silu(x); }
static double d_softplus(double x) { return vm_softplus(x); }
static double d_log1p(double x) { return log1p(x); }
static double d_expm1(double x) { return expm1(x); }

/* Exact special values (test_vmath.c's tables): expected first. */
typedef struct special {
  float x, want;
} special;

typedef struct range {
  float lo, hi; /* every float in [lo, hi], both finite, same sign */
} range;

static const float DMIN = 0x1p-149f; /* smallest subnormal */

#define NSPEC(a) ((int)(sizeof(a) / sizeof *(a)))

static const special s_exp[] = {
    {0.0f, 1.0f}, {-0.0f, 1.0f}, {INFINITY, INFINITY}, {-INFINITY, 0.0f}, {NAN, NAN},
    {89.0f, INFINITY}, {1e30f, INFINITY}, {-1e30f, 0.0f}, {-104.0f, 0.0f},
    {DMIN, 1.0f}, {-DMIN, 1.0f}, {FLT_MAX, INFINITY}, {-FLT_MAX, 0.0f},
};
static const special s_log[] = {
    {1.0f, 0.0f}, {0.0f, -INFINITY}, {-0.0f, -INFINITY}, {-1.0f, NAN}, {-DMIN, NAN},
    {-INFINITY, NAN}, {INFINITY, INFINITY}, {NAN, NAN},
};
static const special s_tanh[] = {
    {0.0f, 0.0f}, {-0.0f, -0.0f}, {INFINITY, 1.0f}, {-INFINITY, -1.0f}, {NAN, NAN},
    {DMIN, DMIN}, {-DMIN, -DMIN}, {FLT_MIN, FLT_MIN}, {-FLT_MIN, -FLT_MIN}, {1e-30f, 1e-30f},
    {20.0f, 1.0f}, {-20.0f, -1.0f}, {10.0f, 1.0f}, {-10.0f, -1.0f}, {FLT_MAX, 1.0f}, {-FLT_MAX, -1.0f},
};
static const special s_sigmoid[] = {
    {0.0f, 0.5f}, {-0.0f, 0.5f}, {INFINITY, 1.0f}, {-INFINITY, 0.0f}, {NAN, NAN},
    {DMIN, 0.5f}, {-DMIN, 0.5f}, {200.0f, 1.0f}, {-200.0f, 0.0f}, {-FLT_MAX, 0.0f},
};
static const special s_erf[] = {
    {0.0f, 0.0f}, {-0.0f, -0.0f}, {INFINITY, 1.0f}, {-INFINITY, -1.0f}, {NAN, NAN},
    {DMIN, DMIN}, {-DMIN, -DMIN}, {10.0f, 1.0f}, {-10.0f, -1.0f}, {FLT_MAX, 1.0f},
};
static const special s_sin[] = {
    {0.0f, 0.0f}, {-0.0f, -0.0f}, {INFINITY, NAN}, {-INFINITY, NAN}, {NAN, NAN}, {DMIN, DMIN}, {-DMIN, -DMIN},
};
static const special s_cos[] = {
    {0.0f, 1.0f}, {-0.0f, 1.0f}, {INFINITY, NAN}, {-INFINITY, NAN}, {NAN, NAN}, {DMIN, 1.0f},
};
static const special s_gelu[] = {
    {0.0f, 0.0f}, {INFINITY, INFINITY}, {-INFINITY, 0.0f}, {NAN, NAN}, {-1e30f, 0.0f},
    {1e30f, 1e30f}, {-20.0f, 0.0f}, {20.0f, 20.0f}, {FLT_MAX, FLT_MAX}, {-FLT_MAX, 0.0f},
};
static const special s_silu[] = {
    {0.0f, 0.0f}, {INFINITY, INFINITY}, {-INFINITY, -0.0f}, {NAN, NAN}, {-1e30f, -0.0f}, {1e30f, 1e30f},
};
static const special s_softplus[] = {
    {INFINITY, INFINITY}, {-INFINITY, 0.0f}, {NAN, NAN}, {21.0f, 21.0f}, {-200.0f, 0.0f},
};
static const special s_log1p[] = {
    {0.0f, 0.0f}, {-0.0f, -0.0f}, {-1.0f, -INFINITY}, {-2.0f, NAN}, {INFINITY, INFINITY}, {NAN, NAN}, {DMIN, DMIN},
};
static const special s_expm1[] = {
    {0.0f, 0.0f}, {-0.0f, -0.0f}, {INFINITY, INFINITY}, {-INFINITY, -1.0f}, {NAN, NAN}, {-30.0f, -1.0f}, {DMIN, DMIN},
};
static const special s_sqrt[] = {
    {0.0f, 0.0f}, {-0.0f, -0.0f}, {INFINITY, INFINITY}, {-INFINITY, NAN}, {NAN, NAN},
    {-1.0f, NAN}, {4.0f, 2.0f}, {0x1p-148f, 0x1p-74f},
};
static const special s_rsqrt[] = {
    {0.0f, INFINITY}, {-0.0f, -INFINITY}, {INFINITY, 0.0f}, {-INFINITY, NAN}, {NAN, NAN},
    {-1.0f, NAN}, {4.0f, 0.5f}, {0x1p-148f, 0x1p74f},
};

/* the dense ranges of test_vmath.c, where each function is hardest */
static const range d_exp_r[] = {{88.0f, 89.0f}, {-104.5f, -86.0f}, {-0.35f, -0.3f}};
static const range d_log_r[] = {{0.70f, 0.72f}, {1.40f, 1.43f}, {0.999f, 1.001f}, {0x1p-149f, 0x1p-140f}};
static const range d_tanh_r[] = {{0.06f, 0.0625f}, {0.17f, 0.176f},  {-0.176f, -0.17f}, {0.515f, 0.525f},
                                 {8.5f, 10.5f},    {1e-4f, 2e-4f},    {0x1p-149f, 0x1p-140f}};
static const range d_sigmoid_r[] = {{-104.5f, -86.0f}, {-2.0f, -1.9f}, {15.0f, 18.0f}};
static const range d_erf_r[] = {{0.45f, 0.55f}, {-0.55f, -0.45f}, {3.5f, 4.2f}};
static const range d_sin_r[] = {{4.7123f, 4.71248f}, {252.898f, 252.8984f}, {12700.0f, 12800.0f}};
static const range d_gelu_r[] = {{-11.0f, -9.5f}, {-3.0f, -2.9f}, {1.0f, 1.01f}};
static const range d_gelu_erf_r[] = {{-14.5f, -12.5f}, {-0.75f, -0.65f}, {0.65f, 0.75f}, {-3.3f, -3.2f}};
static const range d_sqrt_r[] = {{0.999f, 1.001f}, {3.99f, 4.01f}};
static const range d_silu_r[] = {{-100.0f, -99.0f}, {-6.0f, -5.9f}};
static const range d_softplus_r[] = {{-104.0f, -100.0f}, {19.9f, 20.1f}};
static const range d_log1p_r[] = {{-1e-7f, -1e-8f}, {0.41f, 0.42f}, {-0.30f, -0.29f}};
static const range d_expm1_r[] = {{0.34f, 0.36f}, {-0.36f, -0.34f}, {19.9f, 20.1f}};

typedef kiln_tensor *(*eager_fn)(kiln_tensor *, const char *, int);

typedef struct vcase {
  const char *name;
  int op;
  eager_fn eager;
  double (*ref)(double); /* f32 accuracy reference */
  double bound;          /* ulp, vmath.h's documented bound */
  float acc_lim;         /* accuracy checked for |x| <= acc_lim */
  double (*oracle64)(double);
  const special *spec;
  int nspec;
  bool zero_sign;
  const range *dense;
  int ndense;
} vcase;

#define SPEC(s) s, NSPEC(s)
static const vcase cases[] = {
    {"exp", OP_EXP, kiln_exp_at, exp, 4.0, INFINITY, d_exp, SPEC(s_exp), true, SPEC(d_exp_r)},
    {"log", OP_LOG, kiln_log_at, log, 4.0, INFINITY, d_log, SPEC(s_log), true, SPEC(d_log_r)},
    {"tanh", OP_TANH, kiln_tanh_at, tanh, 3.0, INFINITY, d_tanh, SPEC(s_tanh), true, SPEC(d_tanh_r)},
    {"sigmoid", OP_SIGMOID, kiln_sigmoid_at, ref_sigmoid, 4.0, INFINITY, d_sigmoid, SPEC(s_sigmoid), false,
     SPEC(d_sigmoid_r)},
    {"erf", OP_ERF, kiln_erf_at, erf, 4.0, INFINITY, d_erf, SPEC(s_erf), true, SPEC(d_erf_r)},
    {"sin", OP_SIN, kiln_sin_at, sin, 4.0, 12800.0f, d_sin, SPEC(s_sin), true, SPEC(d_sin_r)},
    {"cos", OP_COS, kiln_cos_at, cos, 4.0, 12800.0f, d_cos, SPEC(s_cos), true, SPEC(d_sin_r)},
    {"gelu", OP_GELU, kiln_gelu_at, ref_gelu, 4.0, INFINITY, d_gelu, SPEC(s_gelu), false, SPEC(d_gelu_r)},
    {"gelu_erf", OP_GELU_ERF, kiln_gelu_erf_at, ref_gelu_erf, 4.0, INFINITY, d_gelu_erf, SPEC(s_gelu), false,
     SPEC(d_gelu_erf_r)},
    /* correctly rounded sqrt; 1/sqrt rounds twice */
    {"sqrt", OP_SQRT, kiln_sqrt_at, sqrt, 0.5001, INFINITY, d_sqrt, SPEC(s_sqrt), true, SPEC(d_sqrt_r)},
    {"rsqrt", OP_RSQRT, kiln_rsqrt_at, ref_rsqrt, 1.5, INFINITY, d_rsqrt, SPEC(s_rsqrt), true, SPEC(d_sqrt_r)},
    {"silu", OP_SILU, kiln_silu_at, ref_silu, 4.0, INFINITY, d_silu, SPEC(s_silu), true, SPEC(d_silu_r)},
    {"softplus", OP_SOFTPLUS, kiln_softplus_at, ref_softplus, 4.0, INFINITY, d_softplus, SPEC(s_softplus), true,
     SPEC(d_softplus_r)},
    {"log1p", OP_LOG1P, kiln_log1p_at, log1p, 4.0, INFINITY, d_log1p, SPEC(s_log1p), true, SPEC(d_log1p_r)},
    {"expm1", OP_EXPM1, kiln_expm1_at, expm1, 4.0, INFINITY, d_expm1, SPEC(s_expm1), true, SPEC(d_expm1_r)},
};
enum { NCASES = sizeof cases / sizeof *cases };

/* ---- vector math: inputs ---------------------------------------------------- */

typedef struct fbuf {
  float *x;
  size_t n, cap;
} fbuf;

static void push(fbuf *b, float x) {
  if (b->n == b->cap) {
    b->cap = b->cap ? 2 * b->cap : 1 << 20;
    b->x = realloc(b->x, b->cap * sizeof *b->x);
    ck_assert_ptr_nonnull(b->x);
  }
  b->x[b->n++] = x;
}

/* Floats in [lo, hi] (same sign, or 0 at one end) whose magnitude's bit
 * pattern steps by step from the end nearest 0. */
static void push_range(fbuf *b, float lo, float hi, uint32_t step) {
  float s = lo >= 0.0f ? 1.0f : -1.0f;
  uint64_t a = to_bits(s > 0 ? lo : -hi), z = to_bits(s > 0 ? hi : -lo);
  for (uint64_t u = a; u <= z; u += step) push(b, s * from_bits((uint32_t)u));
}

/* The test inputs of one op: the sweep of test_vmath.c (every 1021st bit
 * pattern, nans included), the hard ranges and the op's dense ranges. */
static fbuf inputs(const vcase *c) {
  fbuf b = {0};
  for (uint64_t u = 0; u < (1ull << 32); u += 1021) push(&b, from_bits((uint32_t)u));
  for (int sign = -1; sign <= 1; sign += 2) {
    float s = (float)sign;
    push_range(&b, fminf(s * FLT_MIN, 0), fmaxf(s * 0x1p-7f, 0), 1999);    /* near 0 */
    push_range(&b, fminf(s * DMIN, 0), fmaxf(s * FLT_MIN, 0), 61);        /* subnormals */
    push_range(&b, fminf(s * 1e4f, s * FLT_MAX), fmaxf(s * 1e4f, s * FLT_MAX), 2003); /* large */
  }
  bool gelu = c->op == OP_GELU || c->op == OP_GELU_ERF;
  push_range(&b, -20.0f, -4.0f, gelu ? 7 : 101); /* the GELU far negative tail */
  for (int i = 0; i < c->ndense; i++) push_range(&b, c->dense[i].lo, c->dense[i].hi, 1);
  static const float more[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, DMIN, -DMIN, FLT_MIN, -FLT_MIN,
                               FLT_MAX, -FLT_MAX, 1.0f, -1.0f};
  for (int i = 0; i < NSPEC(more); i++) push(&b, more[i]);
  for (int i = 0; i < c->nspec; i++) push(&b, c->spec[i].x);
  while (b.n % 8) push(&b, 0.5f); /* the <8 x float> kernel */
  return b;
}

/* ---- vector math: f32 --------------------------------------------------------- */

START_TEST(test_vmath_f32) {
  const vcase *c = &cases[_i];
  char err[512] = "";
  char *dump = NULL;
  cg_jit *jl = compile_kernel(false, 0, vmath_emit, c->op, &dump, err, sizeof err);
  ck_assert_msg(jl != NULL, "%s: %s", c->name, err);
  /* straight-line code: the vectorizer widened the loop */
  if (has_avx()) ck_assert_msg(strstr(dump, "x float>") != NULL, "%s: the loop did not vectorize:\n%s", c->name, dump);
  free(dump);
  cg_jit *jv = compile_kernel(false, 8, vmath_emit, c->op, NULL, err, sizeof err);
  ck_assert_msg(jv != NULL, "%s <8 x float>: %s", c->name, err);

  fbuf in = inputs(c);
  int64_t n = (int64_t)in.n;
  float *y = malloc(in.n * sizeof *y), *yv = malloc(in.n * sizeof *yv), *ye = malloc(in.n * sizeof *ye);
  ck_assert(y && yv && ye);
  lookup(jl, "k")(y, in.x, n);
  lookup(jv, "k")(yv, in.x, n);
  kiln_tensor *t = kiln_tensor_from(KILN_F32, 1, &n, in.x);
  kiln_tensor *te = c->eager(t, __FILE__, __LINE__);
  ck_assert_msg(te != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_read(te, ye, in.n * sizeof *ye));
  kiln_release(te);
  kiln_release(t);

  worst acc = {0}, vs_eager = {0};
  long differ = 0, vec_differ = 0, out_of_range = 0;
  int64_t first_vec = -1;
  for (int64_t i = 0; i < n; i++) {
    float x = in.x[i];
    if (fabsf(x) <= c->acc_lim || isnan(x) || c->acc_lim == INFINITY)
      note(&acc, ulp_err(y[i], c->ref(x)), x, y[i], c->ref(x));
    else if (!(fabsf(y[i]) <= 1.0f) && isfinite(x)) /* sin, cos far out: in [-1, 1] still */
      out_of_range++;
    note(&vs_eager, ulp_err(y[i], (double)ye[i]), x, y[i], ye[i]);
    if (!same_float(y[i], ye[i])) differ++;
    if (!same_float(y[i], yv[i])) {
      if (first_vec < 0) first_vec = i;
      vec_differ++;
    }
  }
  printf("test_jit: f32 %-8s max %.3f ulp (bound %g), vs eager max %.3f ulp, %ld of %ld differ\n", c->name,
         acc.ulp, c->bound, vs_eager.ulp, differ, (long)n);
  ASSERT_ULP(c->name, acc, c->bound);
  ASSERT_ULP(c->name, vs_eager, 4.0);
  /* vmath_ir.c follows vmath.h step for step: the same bits, not only close */
  ck_assert_msg(differ == 0, "%s: compiled and eager differ at %ld inputs (max %.3f ulp at x = %a)", c->name, differ,
                vs_eager.ulp, vs_eager.x);
  ck_assert_msg(out_of_range == 0, "%s: %ld results outside [-1, 1]", c->name, out_of_range);
  ck_assert_msg(vec_differ == 0, "%s: <8 x float> and the vectorized loop differ at %ld inputs, first x = %a: %a vs %a",
                c->name, vec_differ, first_vec < 0 ? 0.0 : (double)in.x[first_vec],
                first_vec < 0 ? 0.0 : (double)yv[first_vec], first_vec < 0 ? 0.0 : (double)y[first_vec]);

  /* special values, exact (zeros with their sign where test_vmath.c asks) */
  float sx[16], sy[16];
  ck_assert_int_le(c->nspec, 16);
  for (int i = 0; i < c->nspec; i++) sx[i] = c->spec[i].x;
  lookup(jl, "k")(sy, sx, c->nspec);
  for (int i = 0; i < c->nspec; i++) {
    float want = c->spec[i].want;
    bool ok = isnan(want) ? isnan(sy[i]) : sy[i] == want && (!c->zero_sign || signbit(sy[i]) == signbit(want));
    ck_assert_msg(ok, "%s(%a) = %a, want %a", c->name, (double)sx[i], (double)sy[i], (double)want);
  }
  free(in.x);
  free(y);
  free(yv);
  free(ye);
  jit_free(jl);
  jit_free(jv);
}
END_TEST

/* ---- vector math: f64 --------------------------------------------------------- */

START_TEST(test_vmath_f64) {
  const vcase *c = &cases[_i];
  char err[512] = "";
  cg_jit *jl = compile_kernel(true, 0, vmath_emit, c->op, NULL, err, sizeof err);
  ck_assert_msg(jl != NULL, "%s: %s", c->name, err);
  cg_jit *jv = compile_kernel(true, 4, vmath_emit, c->op, NULL, err, sizeof err);
  ck_assert_msg(jv != NULL, "%s <4 x double>: %s", c->name, err);

  /* a sweep of the double line by bit pattern, a grid over [-40, 40], and
   * specials; padded to the <4 x double> kernel */
  enum { GRID = 320000 };
  size_t cap = (1u << 20) + GRID + 64, n = 0;
  double *x = malloc(cap * sizeof *x);
  ck_assert_ptr_nonnull(x);
  for (uint64_t u = 12345; n < (1u << 20); u += (1ull << 44) + 0x9e3779b9ull) memcpy(&x[n++], &u, sizeof u);
  for (int i = -GRID / 2; i < GRID / 2; i++) x[n++] = i / 4000.0;
  static const double more[] = {0.0, -0.0, INFINITY, -INFINITY, NAN, -NAN, 0x1p-1074, -0x1p-1074, DBL_MIN,
                                -DBL_MIN, DBL_MAX, -DBL_MAX, 710.0, -745.5, 1e300, -1e300, 40.0, -40.0};
  for (int i = 0; i < NSPEC(more); i++) x[n++] = more[i];
  while (n % 4) x[n++] = 0.5;

  double *y = malloc(n * sizeof *y), *yv = malloc(n * sizeof *yv), *ye = malloc(n * sizeof *ye);
  ck_assert(y && yv && ye);
  lookup(jl, "k")(y, x, (int64_t)n);
  lookup(jv, "k")(yv, x, (int64_t)n);
  int64_t nn = (int64_t)n;
  kiln_tensor *t = kiln_tensor_from(KILN_F64, 1, &nn, x);
  kiln_tensor *te = c->eager(t, __FILE__, __LINE__);
  ck_assert_msg(te != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_read(te, ye, n * sizeof *ye));
  kiln_release(te);
  kiln_release(t);

  worst w = {0}, we = {0};
  long vec_differ = 0;
  for (size_t i = 0; i < n; i++) {
    double want = c->oracle64(x[i]);
    note(&w, ulp_err64(y[i], want), x[i], y[i], want);
    note(&we, ulp_err64(y[i], ye[i]), x[i], y[i], ye[i]);
    if (!same_double(y[i], yv[i])) vec_differ++;
  }
  printf("test_jit: f64 %-8s max %.3f ulp vs libm/vmath.h, %.3f vs eager\n", c->name, w.ulp, we.ulp);
  ASSERT_ULP(c->name, w, 1.0);
  ASSERT_ULP(c->name, we, 1.0);
  ck_assert_msg(vec_differ == 0, "%s: <4 x double> and the loop differ at %ld inputs", c->name, vec_differ);

  /* the composite forms against long double, with test_vmath.c's tolerances */
  double worst_rel = 0, at = 0;
  for (int i = -80000; i <= 80000; i++) {
    double xi = i / 4000.0;
    long double xl = xi, want;
    double tol = 1e-15;
    if (c->op == OP_SIGMOID) {
      want = 1.0L / (1.0L + expl(-xl));
    } else if (c->op == OP_GELU) {
      long double ul = 0.7978845608028654L * (xl + 0.044715L * xl * xl * xl);
      want = xl / (1.0L + expl(-2.0L * ul));
      tol = 1e-15 * (1.0 + fabs((double)ul) * 2.0);
    } else if (c->op == OP_GELU_ERF) {
      want = 0.5L * xl * erfcl(-xl / sqrtl(2.0L));
      tol = 1e-15 * (1.0 + xi * xi);
    } else {
      break;
    }
    double gi = y[(size_t)(1u << 20) + (size_t)(GRID / 2 + i)]; /* the grid starts at -40 */
    double rel = want == 0 ? fabs(gi) : (double)fabsl((gi - want) / want);
    if (rel / tol > worst_rel) worst_rel = rel / tol, at = xi;
  }
  ck_assert_msg(worst_rel <= 1.0, "%s: relative error %.3g of tolerance at x = %g", c->name, worst_rel, at);
  free(x);
  free(y);
  free(yv);
  free(ye);
  jit_free(jl);
  jit_free(jv);
}
END_TEST

START_TEST(test_vmath_other_ops) {
  /* ops vmath does not emit, and non-float types, give NULL */
  char err[256];
  cg_module m;
  ck_assert_int_eq(0, jit_module_new(&m, "other", err, sizeof err));
  LLVMTypeRef ft = LLVMFunctionType(LLVMVoidTypeInContext(m.ctx), NULL, 0, 0);
  LLVMValueRef fn = LLVMAddFunction(m.mod, "g", ft);
  LLVMBuilderRef b = LLVMCreateBuilderInContext(m.ctx);
  LLVMPositionBuilderAtEnd(b, LLVMAppendBasicBlockInContext(m.ctx, fn, "entry"));
  LLVMValueRef one = LLVMConstReal(LLVMFloatTypeInContext(m.ctx), 1.0);
  ck_assert_ptr_null(vmath_emit(b, OP_ADD, one));
  ck_assert_ptr_null(vmath_emit(b, OP_RELU, one));
  ck_assert_ptr_null(vmath_emit(b, OP_EXP, LLVMConstInt(LLVMInt64TypeInContext(m.ctx), 1, 0)));
  ck_assert_ptr_nonnull(vmath_emit(b, OP_EXP, one));
  LLVMDisposeBuilder(b);
  jit_module_dispose(&m);
}
END_TEST

static Suite *jit_suite(void) {
  Suite *s = suite_create("jit");
  TCase *tj = tcase_create("jit");
  tcase_set_timeout(tj, 120);
  tcase_add_test(tj, test_compile_run);
  tcase_add_test(tj, test_module_dispose);
  tcase_add_test(tj, test_invalid_module);
  tcase_add_test(tj, test_threads);
#ifdef KILN_TEST_BUILD
  tcase_add_test(tj, test_out_of_memory);
#endif
  suite_add_tcase(s, tj);
  TCase *tv = tcase_create("vmath_ir");
  tcase_set_timeout(tv, 300); /* sweeps of ~10M inputs per op under sanitizers */
  tcase_add_loop_test(tv, test_vmath_f32, 0, NCASES);
  tcase_add_loop_test(tv, test_vmath_f64, 0, NCASES);
  tcase_add_test(tv, test_vmath_other_ops);
  suite_add_tcase(s, tv);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(jit_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed;
}

#else /* the test build does not see LLVM's headers */

int main(void) {
  fprintf(stderr, "test_jit: <llvm-c/Core.h> is not on the include path of the tests: CMakeLists.txt must give "
                  "tests/test_jit.c LLVM's include directories, as it does src/codegen/*.c\n");
  return 1;
}

#endif
