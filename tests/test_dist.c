/* The collectives (src/eager/dist.c) over however many processes run this:
 * ctest runs it alone, and under mpirun with 2 and 3 processes when kiln has
 * MPI. Process r contributes values made from r, so every expected value is
 * a sum over r = 0..P-1 written out by hand. Without MPI every call must be
 * an error that says so (KILN_TEST_MPI, from CMake, says which to expect). */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

static int P, R; /* processes, this one's rank */

/* t has the n values want (to 1e-6 relative). */
static void expect(kiln_tensor *t, int64_t n, const double *want, const char *what) {
  ck_assert_msg(t != NULL, "%s: %s", what, kiln_last_error());
  ck_assert_int_eq(n, kiln_numel(t));
  double got[16];
  ck_assert(n <= 16);
  ck_assert_int_eq(0, kiln_read(kiln_cast(t, KILN_F64), got, (size_t)n * sizeof(double)));
  for (int64_t i = 0; i < n; i++)
    ck_assert_msg(fabs(want[i] - got[i]) <= 1e-6 * (1 + fabs(want[i])), "%s at %d (rank %d of %d): expected %.9g, got %.9g",
                  what, (int)i, R, P, want[i], got[i]);
}

/* sum over r of (r + 1) */
static double tri(void) { return P * (P + 1) / 2.0; }

/* process r holds (r + 1) * [1, 2, 3, 4, 5, 6] in a 2x3 */
static kiln_tensor *mine(kiln_dtype dt) {
  double v[6];
  for (int i = 0; i < 6; i++) v[i] = (R + 1) * (i + 1);
  return kiln_cast(kiln_tensor_from(KILN_F64, 2, (int64_t[]){2, 3}, v), dt);
}

START_TEST(test_sum_mean_eager) {
  kiln_scope_begin();
  const kiln_dtype dts[] = {KILN_F32, KILN_F64, KILN_I64};
  for (int d = 0; d < 3; d++) {
    kiln_tensor *x = mine(dts[d]);
    double sum[6], mean[6], own[6];
    for (int i = 0; i < 6; i++) sum[i] = tri() * (i + 1), mean[i] = sum[i] / P, own[i] = (R + 1) * (i + 1);
    kiln_tensor *s = kiln_allreduce(x, KILN_REDUCE_SUM);
    ck_assert_int_eq(dts[d], kiln_type(s));
    expect(s, 6, sum, "sum");
    expect(x, 6, own, "the input, untouched");
    if (dts[d] != KILN_I64) {
      expect(kiln_allreduce(x, KILN_REDUCE_MEAN), 6, mean, "mean");
      ck_assert_ptr_eq(x, kiln_allreduce_(x, KILN_REDUCE_MEAN));
      expect(x, 6, mean, "mean in place");
    }
  }
  /* a strided view: reduced in its own order of elements */
  kiln_tensor *t = kiln_transpose(mine(KILN_F32), 0, 1);
  double want[6] = {1, 4, 2, 5, 3, 6};
  for (int i = 0; i < 6; i++) want[i] *= tri();
  expect(kiln_allreduce(t, KILN_REDUCE_SUM), 6, want, "sum of a transposed view");
  kiln_scope_end();
}
END_TEST

START_TEST(test_bad_input) {
  kiln_scope_begin();
  ck_assert_ptr_null(kiln_allreduce(NULL, KILN_REDUCE_SUM));
  ck_assert_ptr_nonnull(strstr(kiln_last_error(), "kiln_allreduce"));
  ck_assert_ptr_null(kiln_allreduce(mine(KILN_I64), KILN_REDUCE_MEAN));
  ck_assert_ptr_nonnull(strstr(kiln_last_error(), "test_dist.c:"));
  ck_assert_ptr_nonnull(strstr(kiln_last_error(), "a mean needs a float type"));
  ck_assert_ptr_null(kiln_allreduce(mine(KILN_F32), (kiln_reduce_op)7));
  ck_assert_ptr_nonnull(strstr(kiln_last_error(), "op 7"));
  /* a leaf that requires grad is not overwritten outside no-grad */
  kiln_tensor *w = mine(KILN_F32);
  kiln_requires_grad(w, true);
  ck_assert_ptr_null(kiln_allreduce_(w, KILN_REDUCE_SUM));
  kiln_scope_end();
}
END_TEST

/* y = allreduce_sum(x); each process's loss sum(y * (r + 1)); the objective is
 * the sum of the losses, so dx = sum over r of (r + 1), on every process. */
START_TEST(test_gradient) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_keep(mine(KILN_F64));
  kiln_requires_grad(x, true);
  kiln_tensor *y = kiln_allreduce(x, KILN_REDUCE_SUM);
  kiln_tensor *loss = kiln_sum_axes(kiln_mul(y, kiln_scalar(KILN_F64, R + 1)), NULL, 0, false);
  ck_assert_int_eq(0, kiln_backward(loss));
  double g[6];
  for (int i = 0; i < 6; i++) g[i] = tri();
  expect(kiln_grad(x), 6, g, "d sum(allreduce_sum(x) * (r+1)) / dx");
  /* the mean's gradient is the mean of the seeds: (P + 1) / 2 */
  kiln_zero_grad(x);
  y = kiln_allreduce(x, KILN_REDUCE_MEAN);
  ck_assert_int_eq(0, kiln_backward(kiln_sum_axes(kiln_mul(y, kiln_scalar(KILN_F64, R + 1)), NULL, 0, false)));
  for (int i = 0; i < 6; i++) g[i] = tri() / P;
  expect(kiln_grad(x), 6, g, "through the mean");
  kiln_release(x);
  kiln_scope_end();
}
END_TEST

/* out = allreduce_sum(2 x) + 1, and w.grad of sum(x * w) summed in place:
 * the second call runs the compiled graph (interpreter and LLVM). */
typedef struct {
  kiln_tensor *w;
} body_ctx;

static int body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  body_ctx *c = ctx;
  kiln_scope_begin();
  kiln_tensor *loss = kiln_sum_axes(kiln_mul(in[0], c->w), NULL, 0, false);
  int rc = loss && kiln_backward(loss) == 0 ? 0 : -1;
  kiln_scope_end();
  /* traced between the gradient and its allreduce, which the schedule moves up past it */
  out[0] = kiln_add(kiln_allreduce(kiln_mul(in[0], kiln_scalar(KILN_F32, 2)), KILN_REDUCE_SUM), kiln_scalar(KILN_F32, 1));
  kiln_no_grad_begin();
  if (rc == 0 && !kiln_allreduce_(kiln_grad(c->w), KILN_REDUCE_SUM)) rc = -1;
  kiln_no_grad_end();
  return rc == 0 && out[0] ? 0 : -1;
}

static void run_compiled(int backend) {
  kiln_scope_begin();
  body_ctx c = {kiln_keep(kiln_zeros(KILN_F32, 2, (int64_t[]){2, 3}))};
  kiln_requires_grad(c.w, true);
  kiln_options o = {.name = "dist", .n_in = 1, .n_out = 1, .backend = backend};
  kiln_fn *fn = kiln_compile(body, &c, &o);
  ck_assert_msg(fn != NULL, "%s", kiln_last_error());
  double want[6], grad[6];
  for (int i = 0; i < 6; i++) want[i] = 2 * tri() * (i + 1) + 1, grad[i] = tri() * (i + 1);
  for (int call = 0; call < 3; call++) {
    kiln_tensor *x = mine(KILN_F32), *out = NULL;
    kiln_zero_grad(c.w);
    ck_assert_msg(kiln_call(fn, (kiln_tensor *[]){x}, &out) == 0, "%s", kiln_last_error());
    expect(out, 6, want, call ? "compiled out" : "traced out");
    expect(kiln_grad(c.w), 6, grad, call ? "compiled w.grad" : "traced w.grad");
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.traces);
  ck_assert_int_eq(2, st.hits);
  /* each allreduce right after the line that makes its input (pass_schedule), to overlap what follows */
  char *g = kiln_fn_graph(fn, 0);
  ck_assert_msg(g != NULL, "%s", kiln_last_error());
  int n_ar = 0;
  for (const char *a = g; (a = strstr(a, "= allreduce(%")); a++, n_ar++) {
    int in = atoi(a + strlen("= allreduce(%"));
    const char *line = a;
    while (line > g && line[-1] != '\n') line--;
    const char *prev = line - 1;
    while (prev > g && prev[-1] != '\n') prev--;
    char def[32];
    snprintf(def, sizeof def, "%%%d:", in);
    ck_assert_msg(line > g && !strncmp(strchr(prev, '%'), def, strlen(def)), "allreduce of %%%d not right after it:\n%s", in, g);
  }
  ck_assert_int_eq(2, n_ar);
  free(g);
  kiln_fn_free(fn);
  kiln_release(c.w);
  kiln_scope_end();
}

START_TEST(test_compiled_llvm) { run_compiled(KILN_BACKEND_LLVM); }
END_TEST
START_TEST(test_compiled_interp) { run_compiled(KILN_BACKEND_INTERP); }
END_TEST

/* An allreduce of a constant stays in the graph: folding it would make the
 * collective at compile time, once, instead of on every call. */
static int const_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_add(in[0], kiln_allreduce(kiln_scalar(KILN_F64, R + 1), KILN_REDUCE_SUM));
  return out[0] ? 0 : -1;
}

START_TEST(test_not_folded) {
  kiln_scope_begin();
  kiln_fn *fn = kiln_compile(const_body, NULL, &(kiln_options){.name = "const", .n_in = 1, .n_out = 1});
  ck_assert_ptr_nonnull(fn);
  for (int call = 0; call < 2; call++) {
    kiln_tensor *out = NULL;
    ck_assert_msg(kiln_call(fn, (kiln_tensor *[]){kiln_scalar(KILN_F64, 10)}, &out) == 0, "%s", kiln_last_error());
    expect(out, 1, (double[]){10 + tri()}, "10 + sum of r + 1");
  }
  char *g = kiln_fn_graph(fn, 0);
  ck_assert_msg(g && strstr(g, "= allreduce("), "%s", g ? g : kiln_last_error());
  free(g);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* Without MPI: every call is an error that says so. */
START_TEST(test_without_mpi) {
  kiln_scope_begin();
  ck_assert_int_eq(-1, kiln_dist_size());
  ck_assert_ptr_nonnull(strstr(kiln_last_error(), "built without MPI"));
  ck_assert_int_eq(-1, kiln_dist_rank());
  kiln_tensor *x = mine(KILN_F32);
  ck_assert_ptr_null(kiln_allreduce(x, KILN_REDUCE_SUM));
  ck_assert_ptr_nonnull(strstr(kiln_last_error(), "test_dist.c:"));
  ck_assert_ptr_nonnull(strstr(kiln_last_error(), "kiln_allreduce: kiln was built without MPI"));
  ck_assert_ptr_null(kiln_allreduce_(x, KILN_REDUCE_SUM));
  kiln_scope_end();
}
END_TEST

int main(void) {
  const char *want = getenv("KILN_TEST_MPI");
  bool mpi = !want || strcmp(want, "OFF") != 0;
  Suite *s = suite_create("dist");
  TCase *tc = tcase_create("dist");
  tcase_set_timeout(tc, 120);
  if (mpi) {
    P = kiln_dist_size(), R = kiln_dist_rank();
    if (P < 1 || R < 0) {
      fprintf(stderr, "test_dist: %s\n", kiln_last_error());
      return EXIT_FAILURE;
    }
    const char *np = getenv("KILN_TEST_NP"); /* what mpirun was asked for */
    if (np && atoi(np) != P) {
      fprintf(stderr, "test_dist: %d processes, expected %s\n", P, np);
      return EXIT_FAILURE;
    }
    tcase_add_test(tc, test_sum_mean_eager);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_gradient);
    tcase_add_test(tc, test_compiled_llvm);
    tcase_add_test(tc, test_compiled_interp);
    tcase_add_test(tc, test_not_folded);
  } else {
    tcase_add_test(tc, test_without_mpi);
  }
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  /* MPI does not survive fork: the collectives run in this process */
  srunner_set_fork_status(sr, CK_NOFORK);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
