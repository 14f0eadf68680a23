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

/* t has the n values want(i), to 1e-6 relative (any n) */
static void expect_fn(kiln_tensor *t, int64_t n, double (*want)(int64_t, const void *), const void *arg, const char *what) {
  ck_assert_msg(t != NULL, "%s: %s", what, kiln_last_error());
  ck_assert_int_eq(n, kiln_numel(t));
  double *got = malloc((size_t)n * sizeof *got);
  ck_assert_int_eq(0, kiln_read(kiln_cast(t, KILN_F64), got, (size_t)n * sizeof(double)));
  for (int64_t i = 0; i < n; i++) {
    double w = want(i, arg);
    ck_assert_msg(fabs(w - got[i]) <= 1e-6 * (1 + fabs(w)), "%s at %d (rank %d of %d): expected %.9g, got %.9g", what,
                  (int)i, R, P, w, got[i]);
  }
  free(got);
}

/* Buckets (KILN_DIST_BUCKET_KB): twelve allreduces in this order, of
 * base[0:n] + i where process r's base is (r + 1) * (e + 1). Their bytes
 * decide the buckets: with a 1 KiB cap, s0..s3 (256 bytes each) fill one
 * exactly; s4 s5 go when mid (768) does not fit with them; mid when big
 * (2 KiB, over the cap: alone, in place) comes; d0 d1 (f64) after the f32s;
 * m0 m1 (means: not with the sums) after the last allreduce: 6 collectives.
 * Uncapped: s0..big, d0 d1, m0 m1: 3. */
static const struct {
  kiln_dtype dt;
  int64_t n;
  bool mean;
} BUCKETED[] = {
  {KILN_F32, 64, false}, {KILN_F32, 64, false},  {KILN_F32, 64, false}, {KILN_F32, 64, false},
  {KILN_F32, 64, false}, {KILN_F32, 64, false},  {KILN_F32, 192, false}, {KILN_F32, 512, false},
  {KILN_F64, 32, false}, {KILN_F64, 32, false},  {KILN_F32, 64, true},   {KILN_F32, 64, true},
};
enum { N_BUCKETED = sizeof BUCKETED / sizeof BUCKETED[0] };

static int bucket_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  for (int i = 0; i < N_BUCKETED; i++) {
    kiln_tensor *x = kiln_add(kiln_cast(kiln_slice(in[0], 0, 0, BUCKETED[i].n, 1), BUCKETED[i].dt),
                              kiln_scalar(BUCKETED[i].dt, i));
    out[i] = kiln_allreduce(x, BUCKETED[i].mean ? KILN_REDUCE_MEAN : KILN_REDUCE_SUM);
    if (!out[i]) return -1;
  }
  return 0;
}

/* sum over r of (r + 1)(e + 1) + i, or that over P */
static double bucketed_want(int64_t e, const void *arg) {
  int i = *(const int *)arg;
  double sum = tri() * (double)(e + 1) + P * i;
  return BUCKETED[i].mean ? sum / P : sum;
}

/* The collectives one compiled call makes, its values checked */
static int64_t bucketed_call(kiln_fn *fn, const char *what) {
  double base[512];
  for (int e = 0; e < 512; e++) base[e] = (R + 1) * (e + 1);
  kiln_tensor *out[N_BUCKETED] = {0};
  int64_t before = kiln_dist_collectives();
  ck_assert_msg(kiln_call(fn, (kiln_tensor *[]){kiln_tensor_from(KILN_F64, 1, (int64_t[]){512}, base)}, out) == 0,
                "%s", kiln_last_error());
  int64_t n = kiln_dist_collectives() - before;
  for (int i = 0; i < N_BUCKETED; i++) {
    char w[96];
    snprintf(w, sizeof w, "%s: allreduce %d", what, i);
    ck_assert_int_eq(BUCKETED[i].dt, kiln_type(out[i]));
    expect_fn(out[i], BUCKETED[i].n, bucketed_want, &i, w);
  }
  return n;
}

START_TEST(test_buckets) {
  kiln_scope_begin();
  kiln_options o = {.name = "buckets", .n_in = 1, .n_out = N_BUCKETED};
  kiln_fn *fn = kiln_compile(bucket_body, NULL, &o);
  ck_assert_msg(fn != NULL, "%s", kiln_last_error());
  bucketed_call(fn, "traced");
  const struct {
    const char *cap, *overlap;
    int64_t colls;
  } runs[] = {
    {"0", NULL, N_BUCKETED}, {"1", NULL, 6}, {"1048576", NULL, 3}, {NULL, NULL, 3} /* the default, 1 MiB */,
    {"1", "0", N_BUCKETED} /* waiting at once: nothing to pack */,
  };
  for (size_t k = 0; k < sizeof runs / sizeof runs[0]; k++) {
    if (runs[k].cap) setenv("KILN_DIST_BUCKET_KB", runs[k].cap, 1);
    else unsetenv("KILN_DIST_BUCKET_KB");
    if (runs[k].overlap) setenv("KILN_DIST_OVERLAP", runs[k].overlap, 1);
    else unsetenv("KILN_DIST_OVERLAP");
    char what[96];
    snprintf(what, sizeof what, "KILN_DIST_BUCKET_KB=%s KILN_DIST_OVERLAP=%s", runs[k].cap ? runs[k].cap : "(unset)",
             runs[k].overlap ? runs[k].overlap : "(unset)");
    int64_t n = bucketed_call(fn, what);
    ck_assert_msg(n == runs[k].colls, "%s: %lld collectives, expected %lld", what, (long long)n, (long long)runs[k].colls);
  }
  unsetenv("KILN_DIST_OVERLAP");
  /* a cap that is not a number: the call fails on the first allreduce's line, before any collective */
  setenv("KILN_DIST_BUCKET_KB", "lots", 1);
  kiln_tensor *out[N_BUCKETED] = {0};
  int64_t before = kiln_dist_collectives();
  ck_assert_int_eq(-1, kiln_call(fn, (kiln_tensor *[]){kiln_zeros(KILN_F64, 1, (int64_t[]){512})}, out));
  ck_assert_msg(strstr(kiln_last_error(), "KILN_DIST_BUCKET_KB=lots is not a size") &&
                    strstr(kiln_last_error(), "test_dist.c:"),
                "%s", kiln_last_error());
  ck_assert_int_eq(before, kiln_dist_collectives());
  unsetenv("KILN_DIST_BUCKET_KB");
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* Caps that differ between the processes: checked at the first compiled
 * allreduce of the process (so this test runs first), until they agree. */
START_TEST(test_bucket_cap_differs) {
  kiln_scope_begin();
  kiln_fn *fn = kiln_compile(bucket_body, NULL, &(kiln_options){.name = "caps", .n_in = 1, .n_out = N_BUCKETED});
  ck_assert_msg(fn != NULL, "%s", kiln_last_error());
  kiln_tensor *out[N_BUCKETED] = {0};
  int64_t before = kiln_dist_collectives();
  /* every process's call fails, saying so */
  setenv("KILN_DIST_BUCKET_KB", R ? "2" : "1", 1);
  ck_assert_int_eq(-1, kiln_call(fn, (kiln_tensor *[]){kiln_zeros(KILN_F64, 1, (int64_t[]){512})}, out));
  ck_assert_msg(strstr(kiln_last_error(), "KILN_DIST_BUCKET_KB differs between the processes") &&
                    strstr(kiln_last_error(), "1 to 2 over all") && strstr(kiln_last_error(), "test_dist.c:"),
                "%s", kiln_last_error());
  /* one process's cap malformed: it says so, the others that the caps differ (none waits for it) */
  setenv("KILN_DIST_BUCKET_KB", R ? "1" : "1x", 1);
  ck_assert_int_eq(-1, kiln_call(fn, (kiln_tensor *[]){kiln_zeros(KILN_F64, 1, (int64_t[]){512})}, out));
  ck_assert_msg(strstr(kiln_last_error(), R ? "KILN_DIST_BUCKET_KB differs" : "KILN_DIST_BUCKET_KB=1x is not a size"),
                "%s", kiln_last_error());
  ck_assert_int_eq(before, kiln_dist_collectives());
  /* agreeing, the calls run */
  setenv("KILN_DIST_BUCKET_KB", "1", 1);
  ck_assert_int_eq(6, bucketed_call(fn, "agreed"));
  unsetenv("KILN_DIST_BUCKET_KB");
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* y reads the first allreduce's result while its bucket is still open (the
 * cap is far away and another allreduce follows): the bucket must go first,
 * and y see the sum. g1 = sum(x), y = 2 g1, g2 = sum(y + x) = (2P + 1) g1. */
static int flush_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *g1 = kiln_allreduce(kiln_mul(in[0], kiln_scalar(KILN_F64, 1)), KILN_REDUCE_SUM);
  out[0] = kiln_mul(g1, kiln_scalar(KILN_F64, 2));
  out[1] = kiln_allreduce(kiln_add(out[0], in[0]), KILN_REDUCE_SUM);
  return out[0] && out[1] ? 0 : -1;
}

START_TEST(test_bucket_flushed_when_read) {
  kiln_scope_begin();
  setenv("KILN_DIST_BUCKET_KB", "1048576", 1);
  kiln_fn *fn = kiln_compile(flush_body, NULL, &(kiln_options){.name = "flush", .n_in = 1, .n_out = 2});
  ck_assert_msg(fn != NULL, "%s", kiln_last_error());
  double y[6], g2[6];
  for (int i = 0; i < 6; i++) y[i] = 2 * tri() * (i + 1), g2[i] = (2 * P + 1) * tri() * (i + 1);
  for (int call = 0; call < 3; call++) {
    kiln_tensor *out[2] = {0};
    int64_t before = kiln_dist_collectives();
    ck_assert_msg(kiln_call(fn, (kiln_tensor *[]){mine(KILN_F64)}, out) == 0, "%s", kiln_last_error());
    expect(out[0], 6, y, call ? "compiled: y read from an open bucket" : "traced y");
    expect(out[1], 6, g2, call ? "compiled: the allreduce after" : "traced g2");
    ck_assert_int_eq(2, kiln_dist_collectives() - before);
  }
  unsetenv("KILN_DIST_BUCKET_KB");
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* Data-parallel training, compiled, against one process on the whole
 * batch (eager): pred = (x W + b) * s, the mean of (pred - t)^2 over 6 rows,
 * SGD; W and b f64, s f32 (a bucket of each dtype). Process r trains on rows
 * [6r/P, 6(r+1)/P), its loss scaled by its share, and sums the gradients. */
enum { ROWS = 6, STEPS = 4 };
typedef struct {
  kiln_tensor *p[3]; /* W, b, s */
  bool dist;
} lin_model;

static void lin_init(lin_model *m) {
  double w[12], b[3], s[3];
  for (int i = 0; i < 12; i++) w[i] = 0.1 * sin(i + 1.0);
  for (int i = 0; i < 3; i++) b[i] = 0.05 * i, s[i] = 1 + 0.1 * i;
  m->p[0] = kiln_keep(kiln_tensor_from(KILN_F64, 2, (int64_t[]){4, 3}, w));
  m->p[1] = kiln_keep(kiln_tensor_from(KILN_F64, 1, (int64_t[]){3}, b));
  m->p[2] = kiln_keep(kiln_cast(kiln_tensor_from(KILN_F64, 1, (int64_t[]){3}, s), KILN_F32));
  for (int i = 0; i < 3; i++) kiln_requires_grad(m->p[i], true);
}

static int lin_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  lin_model *m = ctx;
  kiln_scope_begin();
  kiln_tensor *pred = kiln_mul(kiln_add(kiln_matmul(in[0], m->p[0]), m->p[1]), kiln_cast(m->p[2], KILN_F64));
  kiln_tensor *d = kiln_sub(pred, in[1]);
  kiln_tensor *loss = kiln_mul(kiln_sum_axes(kiln_mul(d, d), NULL, 0, false), kiln_scalar(KILN_F64, 1.0 / ROWS));
  int bad = !loss || kiln_backward(loss) != 0;
  kiln_no_grad_begin();
  for (int i = 0; i < 3 && !bad; i++) {
    kiln_tensor *g = kiln_grad(m->p[i]);
    if (m->dist) bad = !kiln_allreduce_(g, KILN_REDUCE_SUM);
    bad = bad || !kiln_sub_(m->p[i], kiln_mul(g, kiln_scalar(kiln_type(g), 0.1)));
  }
  kiln_no_grad_end();
  out[0] = bad ? NULL : kiln_keep(loss);
  kiln_scope_end();
  return out[0] ? 0 : -1;
}

/* the batch's rows [lo, hi): x and t */
static void lin_data(int64_t lo, int64_t hi, kiln_tensor **x, kiln_tensor **t) {
  double xv[ROWS * 4], tv[ROWS * 3];
  for (int i = 0; i < ROWS * 4; i++) xv[i] = cos(0.7 * i);
  for (int i = 0; i < ROWS * 3; i++) tv[i] = sin(0.3 * i);
  *x = kiln_contiguous(kiln_slice(kiln_tensor_from(KILN_F64, 2, (int64_t[]){ROWS, 4}, xv), 0, lo, hi, 1));
  *t = kiln_contiguous(kiln_slice(kiln_tensor_from(KILN_F64, 2, (int64_t[]){ROWS, 3}, tv), 0, lo, hi, 1));
}

/* Trains m for STEPS, compiled when fn; returns the collectives of the last call */
static int64_t lin_train(lin_model *m, kiln_fn *fn, int64_t lo, int64_t hi) {
  int64_t colls = 0;
  for (int s = 0; s < STEPS; s++) {
    kiln_scope_begin();
    kiln_tensor *x, *t, *loss = NULL;
    lin_data(lo, hi, &x, &t);
    for (int i = 0; i < 3; i++) kiln_zero_grad(m->p[i]);
    int64_t before = kiln_dist_collectives();
    int rc = fn ? kiln_call(fn, (kiln_tensor *[]){x, t}, &loss) : lin_step(m, (kiln_tensor *[]){x, t}, &loss);
    ck_assert_msg(rc == 0, "%s", kiln_last_error());
    colls = kiln_dist_collectives() - before;
    kiln_scope_end();
  }
  return colls;
}

static double lin_diff(const lin_model *a, const lin_model *b, int i) {
  double x[12], y[12];
  int64_t n = kiln_numel(a->p[i]);
  kiln_scope_begin();
  ck_assert_int_eq(0, kiln_read(kiln_cast(a->p[i], KILN_F64), x, (size_t)n * sizeof(double)));
  ck_assert_int_eq(0, kiln_read(kiln_cast(b->p[i], KILN_F64), y, (size_t)n * sizeof(double)));
  kiln_scope_end();
  double worst = 0;
  for (int64_t e = 0; e < n; e++) worst = fmax(worst, fabs(x[e] - y[e]) / (1 + fabs(y[e])));
  return worst;
}

START_TEST(test_bucketed_training) {
  kiln_scope_begin();
  lin_model ref = {0};
  lin_init(&ref);
  lin_train(&ref, NULL, 0, ROWS);
  const char *caps[] = {"0", "1", NULL};
  lin_model runs[3] = {0};
  for (int k = 0; k < 3; k++) {
    if (caps[k]) setenv("KILN_DIST_BUCKET_KB", caps[k], 1);
    else unsetenv("KILN_DIST_BUCKET_KB");
    lin_model *m = &runs[k];
    lin_init(m);
    m->dist = true;
    kiln_fn *fn = kiln_compile(lin_step, m, &(kiln_options){.name = "lin", .n_in = 2, .n_out = 1});
    ck_assert_msg(fn != NULL, "%s", kiln_last_error());
    int64_t colls = lin_train(m, fn, ROWS * R / P, ROWS * (R + 1) / P);
    /* one per gradient unbucketed; with buckets, at most one per dtype change */
    if (k == 0) ck_assert_int_eq(3, colls);
    else ck_assert_msg(colls >= 2 && colls <= 3, "cap %s: %lld collectives", caps[k] ? caps[k] : "default", (long long)colls);
    kiln_fn_free(fn);
    /* f64 tightly; s is f32, its gradient summed in another order than one process sums it */
    for (int i = 0; i < 3; i++) {
      double tol = i == 2 ? 1e-5 : 1e-12;
      double d = lin_diff(m, &ref, i);
      ck_assert_msg(d <= tol, "cap %s, param %d: %.3g from one process (allowed %.0e)", caps[k] ? caps[k] : "default", i,
                    d, tol);
      if (k > 0) {
        d = lin_diff(m, &runs[0], i);
        ck_assert_msg(d <= tol, "cap %s, param %d: %.3g from unbucketed (allowed %.0e)", caps[k] ? caps[k] : "default",
                      i, d, tol);
      }
    }
  }
  unsetenv("KILN_DIST_BUCKET_KB");
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < 3; i++) kiln_release(runs[k].p[i]);
  for (int i = 0; i < 3; i++) kiln_release(ref.p[i]);
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
    if (P > 1) tcase_add_test(tc, test_bucket_cap_differs); /* first: see there */
    tcase_add_test(tc, test_sum_mean_eager);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_gradient);
    tcase_add_test(tc, test_compiled_llvm);
    tcase_add_test(tc, test_compiled_interp);
    tcase_add_test(tc, test_not_folded);
    tcase_add_test(tc, test_buckets);
    tcase_add_test(tc, test_bucket_flushed_when_read);
    tcase_add_test(tc, test_bucketed_training);
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
