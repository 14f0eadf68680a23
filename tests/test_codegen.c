/* Codegen against eager: fusion asserted on the plan (GELU is one kernel,
 * softmax one row kernel, matmul+bias+relu a GEMM and one epilogue), the
 * three ways (eager, interpreter, LLVM) on every op, and a seeded random
 * program generator: pointwise chains, broadcasts, reductions, views and
 * matmuls over dynamic dims, compiled and compared with eager at several
 * sizes and thread counts. KILN_FUZZ_PROGRAMS=N runs N programs (default 300);
 * a failure prints its seed and the program's IR. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codegen/codegen.h"
#include "kiln.h"

static double maxdiff_rel(kiln_tensor *a, kiln_tensor *b, int64_t *bad) {
  kiln_scope_begin();
  int64_t n = kiln_numel(a);
  double *x = malloc(sizeof(double) * (size_t)(n + 1)), *y = malloc(sizeof(double) * (size_t)(n + 1)), m = 0;
  kiln_read(kiln_cast(a, KILN_F64), x, sizeof(double) * (size_t)n);
  kiln_read(kiln_cast(b, KILN_F64), y, sizeof(double) * (size_t)n);
  *bad = -1;
  for (int64_t i = 0; i < n; i++) {
    if (isnan(x[i]) && isnan(y[i])) continue;
    if (x[i] == y[i]) continue;
    double e = fabs(x[i] - y[i]) / (1 + fabs(y[i]));
    if (!(e <= m)) {
      m = isnan(e) ? INFINITY : e;
      *bad = i;
    }
  }
  free(x), free(y);
  kiln_scope_end();
  return m;
}

static bool same_shape(kiln_tensor *a, kiln_tensor *b) {
  if (kiln_ndim(a) != kiln_ndim(b)) return false;
  for (int d = 0; d < kiln_ndim(a); d++)
    if (kiln_size(a, d) != kiln_size(b, d)) return false;
  return true;
}

/* ---- the plan ---- */

/* The kernels of fn's newest variant after fusion. */
static cg_program *plan_of(kiln_fn *fn) {
  char *text = kiln_fn_graph(fn, 0);
  ck_assert_ptr_nonnull(text);
  char err[256];
  ir_graph *g = ir_parse(text, err, sizeof err);
  free(text);
  ck_assert_msg(g != NULL, "%s", err);
  cg_program *p = fuse_graph(g, err, sizeof err);
  ck_assert_msg(p != NULL, "%s", err);
  /* the program points at g: keep g alive as long as p; freed by the caller through free_plan */
  return p;
}

static void free_plan(cg_program *p) {
  ir_graph *g = (ir_graph *)p->g;
  cg_program_free(p);
  ir_free(g);
}

static int count_kind(const cg_program *p, cg_kernel_kind k) {
  int n = 0;
  for (int i = 0; i < p->n_k; i++) n += p->k[i].kind == k;
  return n;
}

static int gelu_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0];
  kiln_tensor *in3 = kiln_add(x, kiln_mul(kiln_scalar(KILN_F32, 0.044715), kiln_pow(x, kiln_scalar(KILN_F32, 3))));
  kiln_tensor *t = kiln_tanh(kiln_mul(kiln_scalar(KILN_F32, 0.7978845608), in3));
  out[0] = kiln_mul(kiln_mul(kiln_scalar(KILN_F32, 0.5), x), kiln_add(kiln_scalar(KILN_F32, 1), t));
  return 0;
}

static int softmax_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *e = kiln_exp(kiln_sub(in[0], kiln_max(in[0], -1, true)));
  out[0] = kiln_div(e, kiln_sum(e, -1, true));
  return 0;
}

static int layernorm_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_layer_norm(in[0], in[1], in[2], 1e-5);
  return 0;
}

static int linear_relu_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_relu(kiln_add(kiln_matmul(in[0], in[1]), in[2]));
  return 0;
}

/* two layers: the relu between them can run in place over the first GEMM's buffer */
static int two_layer_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *h = kiln_relu(kiln_add(kiln_matmul(in[0], in[1]), in[2]));
  out[0] = kiln_matmul(h, kiln_transpose(in[1], 0, 1));
  return 0;
}

typedef int (*body_fn)(void *, kiln_tensor *const *, kiln_tensor **);

static kiln_fn *compile_once(body_fn body, int n_in, kiln_tensor *const *in) {
  kiln_options o = {.name = "plan", .n_in = n_in, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(body, NULL, &o);
  kiln_tensor *y = NULL, *ref = NULL;
  ck_assert_int_eq(0, kiln_call(fn, in, &y));
  ck_assert_int_eq(0, kiln_call(fn, in, &y)); /* compiled */
  ck_assert_int_eq(0, body(NULL, in, &ref));
  int64_t bad;
  ck_assert(same_shape(y, ref));
  double d = maxdiff_rel(y, ref, &bad);
  ck_assert_msg(d <= 1e-5, "max rel diff %g at %lld", d, (long long)bad);
  /* compile time splits into its phases */
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_double_gt(st.llvm_opt_ms, 0);
  ck_assert_double_gt(st.llvm_codegen_ms, 0);
  ck_assert_double_le(st.passes_ms + st.fuse_ms + st.llvm_opt_ms + st.llvm_codegen_ms, st.compile_ms + 1e-6);
  return fn;
}

START_TEST(test_fusion_plans) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){33, 70}), 1);
  kiln_tensor *w = kiln_randn(KILN_F32, 1, ((int64_t[]){70}), 2), *b = kiln_randn(KILN_F32, 1, ((int64_t[]){70}), 3);
  kiln_tensor *m = kiln_randn(KILN_F32, 2, ((int64_t[]){70, 20}), 4), *c = kiln_randn(KILN_F32, 1, ((int64_t[]){20}), 5);

  kiln_fn *fn = compile_once(gelu_body, 1, &x);
  cg_program *p = plan_of(fn);
  ck_assert_int_eq(1, p->n_k); /* GELU: one loop */
  ck_assert_int_eq(CG_K_LOOP, p->k[0].kind);
  ck_assert_int_eq(p->k[0].ndim, p->k[0].n_outer); /* pointwise: no inner loop */
  free_plan(p);
  kiln_fn_free(fn);

  fn = compile_once(softmax_body, 1, &x);
  p = plan_of(fn);
  ck_assert_int_eq(1, p->n_k); /* softmax: one row kernel */
  int reduces = 0;
  for (int s = 0; s < p->k[0].n_stage; s++) reduces += p->k[0].stage[s].kind == CG_REDUCE;
  ck_assert_int_eq(2, reduces);
  free_plan(p);
  kiln_fn_free(fn);

  kiln_tensor *ln[3] = {x, w, b};
  fn = compile_once(layernorm_body, 3, ln);
  p = plan_of(fn);
  ck_assert_int_eq(1, p->n_k); /* layer norm: one row kernel */
  free_plan(p);
  kiln_fn_free(fn);

  kiln_tensor *lr[3] = {x, m, c};
  fn = compile_once(linear_relu_body, 3, lr);
  p = plan_of(fn);
  ck_assert_int_eq(2, p->n_k); /* a GEMM and one epilogue */
  ck_assert_int_eq(1, count_kind(p, CG_K_MATMUL));
  ck_assert_int_eq(CG_K_MATMUL, p->k[0].kind);
  ck_assert_int_eq(CG_K_LOOP, p->k[1].kind);
  free_plan(p);
  kiln_fn_free(fn);

  kiln_tensor *tl[3] = {x, kiln_randn(KILN_F32, 2, ((int64_t[]){70, 70}), 8), kiln_randn(KILN_F32, 1, ((int64_t[]){70}), 9)};
  fn = compile_once(two_layer_body, 3, tl);
  p = plan_of(fn);
  ck_assert_int_eq(3, p->n_k); /* GEMM, epilogue, GEMM */
  ck_assert_int_eq(CG_K_LOOP, p->k[1].kind);
  ck_assert_int_eq(p->k[0].out_buf, p->k[1].out_buf); /* the epilogue stores in place */
  free_plan(p);
  kiln_fn_free(fn);

  /* batch 1 (and up to 8 constant rows): the matmul is our own dot-product loop */
  kiln_tensor *row = kiln_randn(KILN_F32, 2, ((int64_t[]){1, 70}), 6);
  kiln_tensor *lr1[3] = {row, kiln_transpose(kiln_randn(KILN_F32, 2, ((int64_t[]){20, 70}), 7), 0, 1), c};
  fn = compile_once(linear_relu_body, 3, lr1);
  p = plan_of(fn);
  ck_assert_int_eq(0, count_kind(p, CG_K_MATMUL));
  ck_assert_int_eq(2, p->n_k); /* the dot products, then the epilogue */
  ck_assert(strstr(p->k[0].name, "matvec") != NULL);
  free_plan(p);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* ---- random programs ---- */

typedef struct rng {
  uint64_t s;
} rng;
static uint64_t next(rng *r) {
  r->s ^= r->s << 13;
  r->s ^= r->s >> 7;
  r->s ^= r->s << 17;
  return r->s;
}
static int pick(rng *r, int n) { return (int)(next(r) % (uint64_t)n); }

typedef struct prog {
  uint64_t seed;
} prog;

/* A random program over two inputs x (B,C) and y (C) [B dynamic]: a pool of
 * values grows by ops picked at random; the output combines the last few. */
static int random_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const prog *pg = ctx;
  rng r = {pg->seed * 2654435761u + 1};
  kiln_tensor *pool[24];
  int n = 0;
  pool[n++] = in[0];
  pool[n++] = in[1];
  pool[n++] = kiln_transpose(kiln_contiguous(kiln_transpose(in[0], 0, 1)), 0, 1); /* a strided view of a copy */
  int steps = 4 + pick(&r, 10);
  for (int s = 0; s < steps && n < 24; s++) {
    kiln_tensor *a = pool[pick(&r, n)], *b = pool[pick(&r, n)], *v = NULL;
    bool full_a = kiln_ndim(a) == 2 && kiln_size(a, 1) == kiln_size(in[0], 1);
    switch (pick(&r, 16)) {
    case 0: v = kiln_add(a, b); break;
    case 1: v = kiln_mul(a, b); break;
    case 2: v = kiln_sub(a, kiln_scalar(KILN_F32, 0.5)); break;
    case 3: v = kiln_tanh(a); break;
    case 4: v = kiln_exp(kiln_mul(a, kiln_scalar(KILN_F32, 0.25))); break;
    case 5: v = kiln_maximum(a, b); break;
    case 6: v = kiln_where(kiln_gt(a, b), a, kiln_neg(b)); break;
    case 7: v = full_a ? kiln_sum(a, 1, true) : kiln_relu(a); break;
    case 8: v = full_a ? kiln_mean(a, 0, true) : kiln_sigmoid(a); break;
    case 9: v = full_a ? kiln_max(a, -1, true) : kiln_abs(a); break;
    case 10: v = full_a ? kiln_softmax(a, 1) : kiln_gelu(a); break;
    case 11: v = full_a ? kiln_layer_norm(a, in[1], NULL, 1e-5) : kiln_sin(a); break;
    case 12:
      if (full_a) {
        kiln_tensor *w = kiln_reshape(kiln_mul(in[1], in[1]), 2, ((int64_t[]){kiln_size(in[1], 0), 1}));
        v = kiln_matmul(a, kiln_expand(w, 2, ((int64_t[]){kiln_size(in[1], 0), 3}))); /* (B,3) */
      } else {
        v = kiln_cos(a);
      }
      break;
    case 13: v = full_a ? kiln_reshape(kiln_mul(a, a), 2, ((int64_t[]){-1, kiln_size(a, 1)})) : kiln_log(kiln_add(kiln_abs(a), kiln_scalar(KILN_F32, 1))); break;
    case 14: v = full_a ? kiln_slice(a, 1, 1, -1, 2) : kiln_neg(a); break;
    case 15: v = full_a ? kiln_sum(kiln_transpose(a, 0, 1), 1, false) : kiln_sqrt(kiln_abs(a)); break;
    }
    if (!v) return -1;
    pool[n++] = v;
  }
  kiln_tensor *o = pool[n - 1];
  /* mix in one more value so that more than the last op matters */
  kiln_tensor *other = pool[n - 2];
  kiln_tensor *sum = kiln_add(o, kiln_mean_all(other));
  out[0] = sum ? sum : o;
  return out[0] ? 0 : -1;
}

static int run_program(uint64_t seed, int threads, char *why, size_t whyn) {
  prog pg = {seed};
  kiln_options o = {.name = "rand", .n_in = 2, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(random_body, &pg, &o);
  int64_t sizes[] = {5, 9, 1, 16, 7};
  int rc = 0;
  kiln_set_num_threads(threads);
  for (int i = 0; i < 5 && !rc; i++) {
    kiln_scope_begin();
    kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, ((int64_t[]){sizes[i], 6}), seed + (uint64_t)i),
                          kiln_randn(KILN_F32, 1, ((int64_t[]){6}), seed + 100)};
    kiln_tensor *y = NULL, *ref = NULL;
    int r1 = kiln_call(fn, in, &y);
    int r2 = random_body(&pg, in, &ref);
    if (r1 != r2) {
      snprintf(why, whyn, "size %lld: compiled returned %d, eager %d (%s)", (long long)sizes[i], r1, r2, kiln_last_error());
      rc = -1;
    } else if (r1 == 0) {
      int64_t bad;
      double d = same_shape(y, ref) ? maxdiff_rel(y, ref, &bad) : INFINITY;
      if (!(d <= 2e-5)) {
        snprintf(why, whyn, "size %lld: max rel diff %g at element %lld", (long long)sizes[i], d, (long long)bad);
        rc = -1;
      }
    }
    kiln_scope_end();
  }
  if (rc) {
    char *text = kiln_fn_graph(fn, 0);
    fprintf(stderr, "random program seed %llu (threads %d) failed: %s\nits graph:\n%s\n", (unsigned long long)seed, threads,
            why, text ? text : "(none)");
    free(text);
  }
  kiln_fn_free(fn);
  kiln_set_num_threads(0);
  return rc;
}

START_TEST(test_random_programs) {
  const char *env = getenv("KILN_FUZZ_PROGRAMS");
  int n = env ? atoi(env) : 300;
  int failed = 0;
  uint64_t first_bad = 0;
  for (int i = 0; i < n; i++) {
    char why[256];
    if (run_program(1000 + (uint64_t)i, 1 + i % 2, why, sizeof why)) {
      if (!failed) first_bad = 1000 + (uint64_t)i;
      failed++;
    }
  }
  ck_assert_msg(failed == 0, "%d of %d random programs differ from eager; the first is seed %llu", failed, n,
                (unsigned long long)first_bad);
}
END_TEST

/* compiled results are bitwise equal at 1 and 2 threads */
START_TEST(test_threads_bitwise) {
  body_fn bodies[] = {gelu_body, softmax_body, layernorm_body};
  for (int k = 0; k < 3; k++) {
    float out[2][64 * 300];
    for (int t = 1; t <= 2; t++) {
      kiln_set_num_threads(t);
      kiln_scope_begin();
      kiln_tensor *in[3] = {kiln_randn(KILN_F32, 2, ((int64_t[]){64, 300}), 7), kiln_randn(KILN_F32, 1, ((int64_t[]){300}), 8),
                            kiln_randn(KILN_F32, 1, ((int64_t[]){300}), 9)};
      kiln_options o = {.name = "bits", .n_in = k == 2 ? 3 : 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
      kiln_fn *fn = kiln_compile(bodies[k], NULL, &o);
      kiln_tensor *y;
      ck_assert_int_eq(0, kiln_call(fn, in, &y));
      ck_assert_int_eq(0, kiln_call(fn, in, &y));
      ck_assert_int_eq(0, kiln_read(y, out[t - 1], sizeof out[0]));
      kiln_fn_free(fn);
      kiln_scope_end();
    }
    ck_assert_msg(!memcmp(out[0], out[1], sizeof out[0]), "body %d differs between 1 and 2 threads", k);
  }
  kiln_set_num_threads(0);
}
END_TEST

#ifdef KILN_TEST_BUILD
/* Faults forced in the test build: LLVM refusing a graph falls back to the
 * interpreter with a warning and the right answer; a corrupted kernel is
 * named by check mode, with its nodes' lines, and eager's answer returned. */
START_TEST(test_forced_faults) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){33, 70}), 1), *y = NULL, *ref = NULL;
  ck_assert_int_eq(0, softmax_body(NULL, &x, &ref));
  int64_t bad;

  setenv("KILN_TEST_FAIL_LLVM", "1", 1);
  kiln_options o = {.name = "fallback", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(softmax_body, NULL, &o);
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  ck_assert_int_eq(0, kiln_call(fn, &x, &y)); /* the interpreter runs the variant */
  unsetenv("KILN_TEST_FAIL_LLVM");
  ck_assert_double_le(maxdiff_rel(y, ref, &bad), 1e-6);
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(1, st.hits);
  kiln_fn_free(fn);

  setenv("KILN_TEST_CORRUPT_KERNEL", "k0_row", 1);
  o = (kiln_options){.name = "checked", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM, .check = 1};
  fn = kiln_compile(softmax_body, NULL, &o);
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  unsetenv("KILN_TEST_CORRUPT_KERNEL");
  ck_assert_double_le(maxdiff_rel(y, ref, &bad), 1e-6); /* eager's answer, not the corrupted one */
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(1, st.check_fails);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST
#endif

static Suite *suite(void) {
  Suite *s = suite_create("codegen");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 900);
  tcase_add_test(tc, test_fusion_plans);
  tcase_add_test(tc, test_threads_bitwise);
  tcase_add_test(tc, test_random_programs);
#ifdef KILN_TEST_BUILD
  tcase_add_test(tc, test_forced_faults);
#endif
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *r = srunner_create(suite());
  srunner_run_all(r, CK_NORMAL);
  int failed = srunner_ntests_failed(r);
  srunner_free(r);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
