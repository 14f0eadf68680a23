/* Concurrency: several threads call one kiln_fn at sizes it has not seen
 * (retraces, the variant cache, the cap and its eager fallback) while other
 * threads run eager ops and autograd and read the function's counters and
 * graphs. Every result is checked against a single-threaded eager
 * reference computed before the threads start. Run under ThreadSanitizer by
 * `make test` (build-tsan). */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

enum { CALLERS = 4, CALLS = 40, EAGER_THREADS = 2, EAGER_ITERS = 20, SIZES = 6 };

/* The rows each call uses: thread t, call c. Several threads meet each size. */
static int64_t rows_of(int t, int c) { return 1 + (t * 5 + c * 3) % SIZES * 3; }

typedef struct model {
  kiln_tensor *w, *b;
} model;
static model M;

static int body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  kiln_tensor *h = kiln_gelu(kiln_add(kiln_matmul(in[0], m->w), m->b));
  out[0] = kiln_softmax(h, -1);
  out[1] = kiln_sum(kiln_mul(h, kiln_tanh(h)), 1, false);
  return out[0] && out[1] ? 0 : -1;
}

static kiln_tensor *input_of(int64_t rows) { return kiln_randn(KILN_F32, 2, ((int64_t[]){rows, 8}), (uint64_t)rows); }

/* Reference outputs per size (index rows), f32, computed eagerly on one thread. */
static float *ref[2][SIZES * 3 + 2];

static float *read_all(kiln_tensor *t) {
  size_t n = (size_t)kiln_numel(t);
  float *v = malloc((n + 1) * sizeof *v);
  if (kiln_read(t, v, n * sizeof *v)) {
    free(v);
    return NULL;
  }
  return v;
}

static int close_f(const float *got, const float *want, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!(fabsf(got[i] - want[i]) <= 1e-5f * (1 + fabsf(want[i])))) return 0;
  return 1;
}

typedef struct caller {
  kiln_fn *fn;
  int t;
  int bad, errors;
  char msg[256];
} caller;

static void *call_many(void *arg) {
  caller *c = arg;
  for (int k = 0; k < CALLS; k++) {
    int64_t rows = rows_of(c->t, k);
    kiln_scope_begin();
    kiln_tensor *x = input_of(rows), *y[2] = {NULL, NULL};
    if (kiln_call(c->fn, &x, y)) {
      if (!c->errors++) snprintf(c->msg, sizeof c->msg, "%s", kiln_last_error());
    } else {
      for (int o = 0; o < 2; o++) {
        float *v = read_all(y[o]);
        if (!v || !close_f(v, ref[o][rows], (size_t)kiln_numel(y[o]))) c->bad++;
        free(v);
      }
    }
    kiln_scope_end();
  }
  return NULL;
}

/* Eager and autograd: d/dw of sum(tanh(x w)^2) for its own w, against the reference. */
static float *grad_ref;

static float *eager_grad(void) {
  kiln_scope_begin();
  kiln_tensor *w = kiln_randn(KILN_F32, 2, ((int64_t[]){8, 5}), 77);
  kiln_requires_grad(w, true);
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){33, 8}), 78);
  kiln_tensor *h = kiln_tanh(kiln_matmul(x, w));
  kiln_tensor *loss = kiln_sum_all(kiln_mul(h, kiln_softmax(h, 0)));
  float *g = loss && !kiln_backward(loss) ? read_all(kiln_grad(w)) : NULL;
  kiln_scope_end();
  return g;
}

static kiln_fn *shared_fn; /* the function the callers share, inspected meanwhile */

static void *eager_many(void *arg) {
  int *bad = arg;
  for (int k = 0; k < EAGER_ITERS; k++) {
    float *g = eager_grad();
    if (!g || memcmp(g, grad_ref, 40 * sizeof *g)) (*bad)++; /* eager is deterministic: bit for bit */
    free(g);
    /* reading the cache while callers fill it */
    kiln_fn_stats st;
    if (kiln_fn_get_stats(shared_fn, &st) || st.variants < 0) (*bad)++;
    free(kiln_fn_graph(shared_fn, 0)); /* NULL (and an error) before the first variant */
    kiln_clear_error();
  }
  return NULL;
}

static void run_stress(const char *name, kiln_options o, int want_fallbacks) {
  kiln_fn *fn = shared_fn = kiln_compile(body, &M, &o);
  ck_assert_ptr_nonnull(fn);
  pthread_t th[CALLERS + EAGER_THREADS];
  caller cs[CALLERS];
  int eager_bad[EAGER_THREADS] = {0};
  for (int t = 0; t < CALLERS; t++) {
    cs[t] = (caller){.fn = fn, .t = t};
    ck_assert_int_eq(0, pthread_create(&th[t], NULL, call_many, &cs[t]));
  }
  for (int t = 0; t < EAGER_THREADS; t++) ck_assert_int_eq(0, pthread_create(&th[CALLERS + t], NULL, eager_many, &eager_bad[t]));
  for (int t = 0; t < CALLERS + EAGER_THREADS; t++) pthread_join(th[t], NULL);
  for (int t = 0; t < CALLERS; t++) {
    ck_assert_msg(cs[t].errors == 0, "%s: thread %d: %d calls failed: %s", name, t, cs[t].errors, cs[t].msg);
    ck_assert_msg(cs[t].bad == 0, "%s: thread %d: %d wrong outputs", name, t, cs[t].bad);
  }
  for (int t = 0; t < EAGER_THREADS; t++) ck_assert_msg(eager_bad[t] == 0, "eager thread %d: %d wrong results", t, eager_bad[t]);
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(CALLERS * CALLS, st.calls);
  ck_assert_int_eq(st.calls, st.hits + st.traces + st.fallbacks);
  ck_assert_int_ge(st.traces, 1);
  ck_assert_int_le(st.variants, o.max_variants ? o.max_variants : 8);
  if (want_fallbacks) ck_assert_int_ge(st.fallbacks, 1);
  printf("stress: %-8s %d threads x %d calls + %d eager threads x %d: %lld hits, %lld traces, %lld fallbacks, %lld variants\n",
         name, CALLERS, CALLS, EAGER_THREADS, EAGER_ITERS, (long long)st.hits, (long long)st.traces, (long long)st.fallbacks,
         (long long)st.variants);
  fflush(stdout);
  kiln_fn_free(fn);
}

static void setup(void) {
  M.w = kiln_randn(KILN_F32, 2, ((int64_t[]){8, 6}), 1);
  M.b = kiln_randn(KILN_F32, 1, ((int64_t[]){6}), 2);
  for (int s = 0; s < SIZES; s++) {
    int64_t rows = 1 + s * 3;
    kiln_scope_begin();
    kiln_tensor *x = input_of(rows), *y[2] = {NULL, NULL};
    ck_assert_int_eq(0, body(&M, &x, y));
    ref[0][rows] = read_all(y[0]);
    ref[1][rows] = read_all(y[1]);
    kiln_scope_end();
  }
  grad_ref = eager_grad();
  ck_assert_ptr_nonnull(grad_ref);
}

static void teardown(void) {
  for (int o = 0; o < 2; o++)
    for (int r = 0; r < SIZES * 3 + 2; r++) free(ref[o][r]), ref[o][r] = NULL;
  free(grad_ref);
  kiln_release(M.w), kiln_release(M.b);
}

/* Automatic dims: the second size makes rows symbolic; threads race to trace it. */
START_TEST(test_stress_auto) {
  run_stress("auto", (kiln_options){.name = "auto", .n_in = 1, .n_out = 2, .backend = KILN_BACKEND_LLVM}, 0);
}
END_TEST

/* Static dims and a cap of 3: new sizes fill the cache, then run eagerly. */
START_TEST(test_stress_cap) {
  run_stress("cap", (kiln_options){.name = "cap", .n_in = 1, .n_out = 2, .dynamic = KILN_DYNAMIC_STATIC, .max_variants = 3,
                                   .backend = KILN_BACKEND_LLVM}, 1);
}
END_TEST

/* Every call on the recording path: the threads record at once, and hand
 * the function's one set of spare recording buffers (rec_keep) between
 * them; a call that finds it taken records into buffers of its own. */
START_TEST(test_stress_record) {
  run_stress("record", (kiln_options){.name = "record", .n_in = 1, .n_out = 2, .capture = KILN_CAPTURE_RECORD,
                                      .backend = KILN_BACKEND_LLVM}, 0);
}
END_TEST

/* The interpreter backend under the same load. */
START_TEST(test_stress_interp) {
  run_stress("interp", (kiln_options){.name = "interp", .n_in = 1, .n_out = 2, .dynamic = KILN_DYNAMIC_STATIC, .max_variants = 4,
                                      .backend = KILN_BACKEND_INTERP}, 1);
}
END_TEST

int main(void) {
  Suite *s = suite_create("stress");
  TCase *tc = tcase_create("stress");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, test_stress_auto);
  tcase_add_test(tc, test_stress_cap);
  tcase_add_test(tc, test_stress_record);
  tcase_add_test(tc, test_stress_interp);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
