/* Compiled calls whose C numbers change between calls (op attributes,
 * scalars, seeds) or whose bodies break and branch on data: each checked
 * against the same body run eagerly on the same inputs, on both backends. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kiln.h"
#include "capture_helpers.h"
#include "stderr_catch.h"

static double maxdiff(kiln_tensor *a, kiln_tensor *b) {
  ck_assert_msg(a && b, "%s", kiln_last_error());
  ck_assert_int_eq(kiln_ndim(a), kiln_ndim(b));
  for (int d = 0; d < kiln_ndim(a); d++) ck_assert_int_eq(kiln_size(a, d), kiln_size(b, d));
  if (!kiln_numel(a)) return 0;
  kiln_scope_begin();
  kiln_tensor *d = kiln_max_axes(kiln_abs(kiln_sub(kiln_cast(a, KILN_F64), kiln_cast(b, KILN_F64))), NULL, 0, false);
  double r = kiln_item(d);
  kiln_scope_end();
  return r;
}

/* What fd 1 received while f ran. */
static char caught[65536];
static const char *catch_stdout(void (*f)(void *), void *arg) {
  int saved;
  FILE *log = fd_catch(1, &saved);
  f(arg);
  fd_release(1, log, saved, caught, sizeof caught);
  return caught;
}


/* ---- a convolution's and a pool's numbers from C state ---- */

typedef struct {
  kiln_tensor *w, *w1;
  int pad, stride, window;
} cnn;

static int cnn_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const cnn *m = ctx;
  int p[2] = {m->pad, m->pad}, s[2] = {m->stride, m->stride}, k[2] = {m->window, m->window}, z[2] = {0, 0};
  out[0] = kiln_conv2d(in[0], m->w, NULL, s, p, NULL, 1);
  out[1] = kiln_max_pool2d(in[0], k, s, z);
  out[2] = kiln_conv1d(in[1], m->w1, NULL, m->stride, m->pad, 1, 1);
  return out[0] && out[1] && out[2] ? 0 : -1;
}

/* conv's stride and padding and a pool's window are the caller's numbers,
 * though the composites dispatch them from their internal part: a body that
 * takes them from C state must not take the guard-only path, which kept the
 * first call's shapes and values. */
START_TEST(test_conv_and_pool_numbers_change) {
  for (int b = 0; b < 2; b++) {
    cnn m = {kiln_randn(KILN_F32, 4, ((int64_t[]){3, 4, 3, 3}), 3), kiln_randn(KILN_F32, 3, ((int64_t[]){3, 4, 3}), 4), 0, 1, 2};
    kiln_fn *fn = kiln_compile(cnn_body, &m, &(kiln_options){.name = "cnn", .n_in = 2, .n_out = 3, .backend = backends[b]});
    const int set[4][3] = {{0, 1, 2}, {1, 1, 3}, {1, 2, 2}, {2, 1, 3}};
    for (int i = 0; i < 4; i++) {
      kiln_scope_begin();
      m.pad = set[i][0], m.stride = set[i][1], m.window = set[i][2];
      kiln_tensor *x[2] = {kiln_randn(KILN_F32, 4, ((int64_t[]){2, 4, 6, 6}), 10 + (uint64_t)i),
                           kiln_randn(KILN_F32, 3, ((int64_t[]){2, 4, 9}), 20 + (uint64_t)i)};
      kiln_tensor *y[3], *ref[3];
      ck_assert_msg(kiln_call(fn, x, y) == 0, "%s", kiln_last_error());
      ck_assert_int_eq(0, cnn_body(&m, x, ref));
      for (int k = 0; k < 3; k++) ck_assert_msg(maxdiff(y[k], ref[k]) <= 1e-4, "call %d output %d", i, k);
      kiln_scope_end();
    }
    ck_assert_int_eq(0, stats(fn).guard_hits);
    kiln_fn_free(fn);
    kiln_release(m.w);
    kiln_release(m.w1);
  }
}
END_TEST

/* ---- fullgraph and a construct that must run step by step ---- */

static int reading_then(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  double s = kiln_item(kiln_sum_all(in[0])); /* data: the cond cannot be a region */
  out[0] = kiln_add_scalar(in[0], s);
  return out[0] ? 0 : -1;
}
static int negating_else(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_neg(in[0]);
  return out[0] ? 0 : -1;
}
static int cond_line;
static int reading_cond_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor *p = kiln_gt(kiln_sum_all(in[0]), kiln_scalar(KILN_F32, 0));
  cond_line = __LINE__ + 1;
  return kiln_cond(p, reading_then, negating_else, ctx, 1, in, 1, out);
}

/* A cond whose branch reads data runs step by step, and reading its
 * predicate is a break: under fullgraph the call fails with the break's
 * error at the kiln_cond line. The body then failed too (kiln_cond could
 * not read the predicate), and that later error replaced the break's:
 * "kiln_read: the tensor has no data", which says nothing of fullgraph. */
START_TEST(test_fullgraph_break_at_cond) {
  for (int b = 0; b < 2; b++) {
    kiln_fn *fn = kiln_compile(reading_cond_body, NULL,
                               &(kiln_options){.name = "rcond", .n_in = 1, .fullgraph = 1, .backend = backends[b]});
    kiln_scope_begin();
    kiln_tensor *x = kiln_ones(KILN_F32, 1, ((int64_t[]){4})), *y = NULL;
    ck_assert_int_eq(-1, kiln_call(fn, &x, &y));
    char where[64];
    snprintf(where, sizeof where, "test_capture_numbers.c:%d:", cond_line);
    const char *e = kiln_last_error();
    ck_assert_msg(strstr(e, where) && strstr(e, "fullgraph") && strstr(e, "kiln_cond") && !strstr(e, "no data"), "%s", e);
    kiln_scope_end();
    kiln_fn_free(fn);
    /* without fullgraph: the body's answer, the read counted as a break */
    fn = kiln_compile(reading_cond_body, NULL, &(kiln_options){.name = "rcond", .n_in = 1, .backend = backends[b]});
    for (int i = 0; i < 3; i++) {
      kiln_scope_begin();
      kiln_tensor *xi = kiln_randn(KILN_F32, 1, ((int64_t[]){4}), 30 + (uint64_t)i), *yi = NULL, *ref = NULL;
      ck_assert_msg(kiln_call(fn, &xi, &yi) == 0, "%s", kiln_last_error());
      ck_assert_int_eq(0, reading_cond_body(NULL, &xi, &ref));
      ck_assert_double_le(maxdiff(yi, ref), 1e-5);
      kiln_scope_end();
    }
    ck_assert_int_ge(stats(fn).breaks, 3);
    kiln_fn_free(fn);
  }
}
END_TEST

/* ---- kiln_print in a construct's body ---- */

static int printing_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_print(in[0]); /* the carry: data the region being recorded does not have */
  out[0] = kiln_add(in[0], in[1]);
  out[1] = out[0];
  return out[0] ? 0 : -1;
}
static int printing_scan(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor *h0 = kiln_ones(KILN_F32, 1, ((int64_t[]){3}));
  return kiln_scan(printing_step, ctx, 1, &h0, 1, &in[0], &out[0], 1, &out[1]);
}
typedef struct {
  kiln_fn *fn; /* NULL: eagerly */
  kiln_tensor *x;
} print_run;
static void run_printing(void *arg) {
  print_run *p = arg;
  for (int i = 0; i < 2; i++) {
    kiln_scope_begin();
    kiln_tensor *y[2];
    ck_assert_int_eq(0, p->fn ? kiln_call(p->fn, &p->x, y) : printing_scan(NULL, &p->x, y));
    kiln_scope_end();
  }
}

/* A scan whose step prints its carry runs step by step, printing each
 * step's values; the one recording of its body as a region (dropped for
 * the read) printed a line more on every call, a carry "(no data: ...)". */
START_TEST(test_print_in_scan_body) {
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 3}), 5);
  print_run eager = {NULL, x};
  char want[sizeof caught];
  snprintf(want, sizeof want, "%s", catch_stdout(run_printing, &eager));
  for (int b = 0; b < 2; b++) {
    print_run compiled = {kiln_compile(printing_scan, NULL, &(kiln_options){.name = "pscan", .n_in = 1, .n_out = 2, .backend = backends[b]}), x};
    const char *got = catch_stdout(run_printing, &compiled);
    ck_assert_msg(!strcmp(got, want), "compiled printed:\n%s\neagerly:\n%s", got, want);
    kiln_fn_free(compiled.fn);
  }
  kiln_release(x);
}
END_TEST

/* ---- slice bounds from C state, far out of range ---- */

typedef struct {
  int64_t start, end;
} bounds;

static int far_slice_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const bounds *bd = ctx;
  out[0] = kiln_mul_scalar(kiln_slice(in[0], 1, bd->start, bd->end, 1), 2);
  kiln_tensor *y = kiln_mul_scalar(in[0], 1);
  kiln_copy_(kiln_slice(y, 0, bd->start, bd->end, 1), kiln_scalar(KILN_F32, 9));
  out[1] = y;
  return out[0] && out[1] ? 0 : -1;
}

static int slice0_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const bounds *bd = ctx;
  out[0] = kiln_slice(in[0], 0, bd->start, bd->end, 1);
  return out[0] ? 0 : -1;
}

/* Bounds that change between calls are passed at run time; one far past
 * the end (INT64_MAX, "to the end", as the guide says) or before the start
 * after a call that lifted them made the graph's arithmetic overflow, and
 * the call failed ("could not decide a slice bound") where eager slices. */
START_TEST(test_far_slice_bounds_change) {
  const bounds set[] = {{0, 4}, {1, 5}, {2, INT64_MAX}, {-1, INT64_MAX}, {INT64_MIN + 1, 1}, {-INT64_MAX / 2, -2},
                        {3, INT64_MAX / 4}, {1, 3}, {INT64_MAX, INT64_MAX}};
  for (int b = 0; b < 2; b++) {
    bounds bd = set[0];
    kiln_fn *fn = kiln_compile(far_slice_body, &bd, &(kiln_options){.name = "far", .n_in = 1, .n_out = 2, .backend = backends[b]});
    for (int i = 0; i < (int)(sizeof set / sizeof set[0]); i++) {
      kiln_scope_begin();
      bd = set[i];
      kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){6, 5}), 40 + (uint64_t)i), *y[2], *ref[2];
      ck_assert_msg(kiln_call(fn, &x, y) == 0, "call %d: %s", i, kiln_last_error());
      ck_assert_int_eq(0, far_slice_body(&bd, &x, ref));
      for (int k = 0; k < 2; k++) ck_assert_msg(maxdiff(y[k], ref[k]) == 0, "call %d output %d", i, k);
      kiln_scope_end();
    }
    kiln_fn_free(fn);
    /* INT64_MAX at one length, then negative bounds at another: the size and
     * the bounds symbolic together */
    const bounds seq[] = {{3, INT64_MAX}, {-3, -1}, {2, INT64_MAX}, {-4, -2}};
    const int64_t len[] = {6, 7, 9, 8};
    bd = seq[0];
    fn = kiln_compile(slice0_body, &bd, &(kiln_options){.name = "far2", .n_in = 1, .backend = backends[b]});
    for (int i = 0; i < 4; i++) {
      kiln_scope_begin();
      bd = seq[i];
      kiln_tensor *x = kiln_arange(KILN_F32, 0, (double)len[i], 1), *y = NULL, *ref = NULL;
      ck_assert_msg(kiln_call(fn, &x, &y) == 0, "length %lld: %s", (long long)len[i], kiln_last_error());
      ck_assert_int_eq(0, slice0_body(&bd, &x, &ref));
      ck_assert_msg(maxdiff(y, ref) == 0, "length %lld", (long long)len[i]);
      kiln_scope_end();
    }
    kiln_fn_free(fn);
  }
}
END_TEST

/* ---- dropout's p from C state ---- */

typedef struct {
  double p;
} dropping;

static int dropout_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const dropping *d = ctx;
  out[0] = kiln_dropout(in[0], d->p, true);
  return out[0] ? 0 : -1;
}

/* Dropout at p = 0 draws nothing and makes no op: a first call there took
 * the guard-only path, and later calls at p = 0.5 ran that variant, with
 * no dropout and the generator not moved on. The draws and the stream after
 * each call must be eager's from the same seed. */
START_TEST(test_dropout_p_from_zero) {
  const double ps[] = {0, 0, 0.5, 0.9, 0, 0.3};
  enum { N = sizeof ps / sizeof ps[0] };
  for (int b = 0; b < 2; b++) {
    dropping d = {ps[0]};
    kiln_fn *fn = kiln_compile(dropout_body, &d, &(kiln_options){.name = "drop", .n_in = 1, .backend = backends[b]});
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){8, 5}), 2), *got[N], *want[N], *after[2][N];
    kiln_manual_seed(17);
    for (int i = 0; i < N; i++) {
      d.p = ps[i];
      ck_assert_msg(kiln_call(fn, &x, &got[i]) == 0, "%s", kiln_last_error());
      after[0][i] = kiln_rand_like(x);
    }
    kiln_manual_seed(17);
    for (int i = 0; i < N; i++) {
      d.p = ps[i];
      ck_assert_int_eq(0, dropout_body(&d, &x, &want[i]));
      after[1][i] = kiln_rand_like(x);
    }
    for (int i = 0; i < N; i++) {
      ck_assert_msg(maxdiff(got[i], want[i]) == 0, "call %d (p %g)", i, ps[i]);
      ck_assert_msg(maxdiff(after[0][i], after[1][i]) == 0, "the stream after call %d", i);
    }
    kiln_scope_end();
    kiln_fn_free(fn);
  }
}
END_TEST

/* ---- many draws in one call ---- */

static int many_draws_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *h = in[0];
  for (int layer = 0; layer < 40; layer++) /* a dropout per layer, and a noise draw every few */
    h = kiln_tanh(kiln_dropout(layer % 4 ? h : kiln_add(h, kiln_randn_like(h)), 0.25, true));
  out[0] = h;
  return out[0] ? 0 : -1;
}

/* Each draw passed its seed and offset as two symbols of the variant's 64:
 * a body of 33 draws or more (a dropout in each of many layers) failed
 * every call ("more than 64 symbolic sizes") where eager runs. The draws
 * and the stream after each call must be eager's from the same seed. */
START_TEST(test_many_draws) {
  for (int b = 0; b < 2; b++) {
    kiln_fn *fn = kiln_compile(many_draws_body, NULL, &(kiln_options){.name = "draws", .n_in = 1, .backend = backends[b]});
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 6}), 8), *got[3], *want[3], *after[2][3];
    kiln_manual_seed(23);
    for (int i = 0; i < 3; i++) {
      ck_assert_msg(kiln_call(fn, &x, &got[i]) == 0, "%s", kiln_last_error());
      after[0][i] = kiln_rand_like(x);
    }
    kiln_manual_seed(23);
    for (int i = 0; i < 3; i++) {
      ck_assert_int_eq(0, many_draws_body(NULL, &x, &want[i]));
      after[1][i] = kiln_rand_like(x);
    }
    for (int i = 0; i < 3; i++) {
      ck_assert_msg(maxdiff(got[i], want[i]) <= 1e-6, "call %d", i);
      ck_assert_msg(maxdiff(after[0][i], after[1][i]) == 0, "the stream after call %d", i);
    }
    kiln_scope_end();
    ck_assert_int_eq(2, stats(fn).hits);
    kiln_fn_free(fn);
  }
}
END_TEST

/* ---- two numbers that change on alternate calls ---- */

typedef struct {
  double scale, shift;
  int64_t at;
} two_numbers;

static int two_numbers_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const two_numbers *m = ctx;
  kiln_tensor *y = kiln_add(kiln_mul(in[0], kiln_scalar(KILN_F32, m->scale)), kiln_scalar(KILN_F32, m->shift));
  out[0] = kiln_slice(y, 1, m->at, m->at + 2, 1);
  return out[0] ? 0 : -1;
}

/* A scale and a shift (or a slice position) that change on alternate calls:
 * each new variant lifted only the number that changed since the variant
 * it followed and made the other a constant again, so every call compiled
 * (40 traces in 40 calls) and ran far slower than eager. A number that is
 * an argument of the variant followed stays one. */
START_TEST(test_numbers_change_on_alternate_calls) {
  enum { N = 24 };
  for (int b = 0; b < 2; b++) {
    two_numbers m = {1, 0, 0};
    kiln_fn *fn = kiln_compile(two_numbers_body, &m, &(kiln_options){.name = "alt", .n_in = 1, .backend = backends[b]});
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 8}), 5);
    long long settled = 0;
    for (int i = 0; i < N; i++) {
      if (i == N / 2) settled = stats(fn).traces;
      if (i % 3 == 0) m.scale = 0.5 + i;
      else if (i % 3 == 1) m.shift = -0.25 * i;
      else m.at = i % 6;
      kiln_tensor *got, *want;
      ck_assert_msg(kiln_call(fn, &x, &got) == 0, "%s", kiln_last_error());
      ck_assert_int_eq(0, two_numbers_body(&m, &x, &want));
      ck_assert_msg(maxdiff(got, want) == 0, "call %d (backend %d)", i, b);
    }
    kiln_scope_end();
    kiln_fn_stats st = stats(fn);
    /* the first call, one per number as it starts to change, and one for
     * the slice's end (start + 2, a constant while only other numbers changed) */
    ck_assert_msg(st.traces <= 5, "%lld traces in %d calls", (long long)st.traces, N);
    ck_assert_int_eq(settled, st.traces);
    ck_assert_int_eq(N, st.hits + st.traces);
    kiln_fn_free(fn);
  }
}
END_TEST

/* ---- C data turned into a tensor at every call ---- */

typedef struct {
  kiln_tensor *table;
  int64_t tokens[3];
  double w[2];
} from_data;

static int from_data_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const from_data *m = ctx;
  /* the tokens picked at the last step, fed back as C data (a decode loop) */
  kiln_tensor *idx = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){3}), m->tokens);
  kiln_tensor *w = kiln_tensor_from(KILN_F64, 1, ((int64_t[]){2}), m->w);
  kiln_tensor *e = kiln_embedding(m->table, idx);
  out[0] = kiln_add(kiln_mul(kiln_sum_axes(e, ((int[]){0}), 1, false), kiln_cast(kiln_sum_all(w), KILN_F32)), in[0]);
  return out[0] ? 0 : -1;
}

/* Each new token value was a new constant of the graph: a decode loop that
 * fed its picks back through kiln_tensor_from compiled at every call until
 * the cap, then ran on the interpreter. Data that changes at the same
 * place is a run-time input of the variant after its second value. */
START_TEST(test_data_changes_every_call) {
  enum { N = 12 };
  for (int b = 0; b < 2; b++) {
    from_data m = {kiln_randn(KILN_F32, 2, ((int64_t[]){10, 4}), 3), {1, 2, 3}, {0.5, 0.25}};
    kiln_fn *fn = kiln_compile(from_data_body, &m, &(kiln_options){.name = "data", .n_in = 1, .backend = backends[b]});
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 1, ((int64_t[]){4}), 4);
    for (int i = 0; i < N; i++) {
      for (int k = 0; k < 3; k++) m.tokens[k] = (i * 7 + k * 3) % 10;
      m.w[i % 2] = 0.125 * i;
      kiln_tensor *got, *want;
      ck_assert_msg(kiln_call(fn, &x, &got) == 0, "%s", kiln_last_error());
      ck_assert_int_eq(0, from_data_body(&m, &x, &want));
      ck_assert_msg(maxdiff(got, want) == 0, "call %d (backend %d)", i, b);
    }
    kiln_scope_end();
    kiln_fn_stats st = stats(fn);
    ck_assert_msg(st.traces <= 3, "%lld traces in %d calls", (long long)st.traces, N);
    ck_assert_int_eq(N, st.hits + st.traces);
    kiln_release(m.table);
    kiln_fn_free(fn);
  }
}
END_TEST

/* ---- what the dumps say ---- */

typedef struct {
  double slope;
  kiln_tensor *w;
} dump_model;

static int slope_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const dump_model *m = ctx;
  out[0] = kiln_leaky_relu(in[0], m->slope);
  return out[0] ? 0 : -1;
}

static int grad_write_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const dump_model *m = ctx;
  /* an in-place write into the .grad the call began with: an escape */
  kiln_mul_(kiln_grad(m->w), kiln_scalar(KILN_F32, 0.5));
  out[0] = kiln_sum_all(kiln_mul(in[0], m->w));
  return 0;
}

/* A recompile reason printed a number with %g: one that changed in its
 * seventh digit read "was 0.003, now 0.003". And the breaks dump named an
 * escape's line twice ("x.c:36: x.c:36: an in-place write ..."). */
START_TEST(test_dumps_say_it_once) {
  dump_model m = {0.003, kiln_randn(KILN_F32, 1, ((int64_t[]){4}), 5)};
  kiln_requires_grad(m.w, true);
  setenv("KILN_DUMP", "recompiles,breaks", 1);
  kiln_fn *f1 = kiln_compile(slope_body, &m, &(kiln_options){.name = "slope", .n_in = 1, .capture = KILN_CAPTURE_RECORD});
  kiln_fn *f2 = kiln_compile(grad_write_body, &m, &(kiln_options){.name = "gw", .n_in = 1});
  unsetenv("KILN_DUMP");
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 1, ((int64_t[]){4}), 6), *y;
  int saved;
  FILE *log = fd_catch(2, &saved);
  ck_assert_int_eq(0, kiln_call(f1, &x, &y));
  m.slope = 0.0030000001;
  ck_assert_int_eq(0, kiln_call(f1, &x, &y));
  ck_assert_int_eq(0, kiln_backward(kiln_sum_all(kiln_mul(x, m.w)))); /* a .grad to begin with */
  ck_assert_int_eq(0, kiln_call(f2, &x, &y));
  fd_release(2, log, saved, caught, sizeof caught);
  kiln_scope_end();
  ck_assert_msg(strstr(caught, "a number was 0.0030000000000000001 when variant 1 was made, now 0.0030000001000000001"), "%s", caught);
  const char *at = strstr(caught, "kiln break: gw: ");
  ck_assert_msg(at, "%s", caught);
  const char *line = at + strlen("kiln break: gw: ");
  const char *colon = strchr(line, ':');
  ck_assert_ptr_nonnull(colon);
  char loc[600];
  snprintf(loc, sizeof loc, "%.*s", (int)(strchr(colon + 1, ':') - line + 1), line);
  ck_assert_msg(!strstr(line + strlen(loc), loc), "the location twice: %s", line);
  kiln_fn_free(f1);
  kiln_fn_free(f2);
  kiln_release(m.w);
  /* the guards of a variant that takes C data at run time say so, not "a number" */
  from_data d = {kiln_randn(KILN_F32, 2, ((int64_t[]){10, 4}), 3), {1, 2, 3}, {0.5, 0.25}};
  setenv("KILN_DUMP", "guards", 1);
  kiln_fn *f3 = kiln_compile(from_data_body, &d, &(kiln_options){.name = "data", .n_in = 1});
  unsetenv("KILN_DUMP");
  kiln_scope_begin();
  kiln_tensor *x4 = kiln_randn(KILN_F32, 1, ((int64_t[]){4}), 4);
  log = fd_catch(2, &saved);
  for (int i = 0; i < 2; i++, d.tokens[0]++) ck_assert_int_eq(0, kiln_call(f3, &x4, &y));
  fd_release(2, log, saved, caught, sizeof caught);
  kiln_scope_end();
  ck_assert_msg(strstr(caught, "a tensor made from C data is argument"), "%s", caught);
  kiln_fn_free(f3);
  kiln_release(d.table);
}
END_TEST

/* ---- more C data than a call passes at run time ---- */

static double many_data_values[40];

static int many_data_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *h = in[0];
  for (int i = 0; i < 40; i++) h = kiln_add(h, kiln_tensor_from(KILN_F64, 1, ((int64_t[]){1}), &many_data_values[i]));
  out[0] = h;
  return out[0] ? 0 : -1;
}

/* Past the arguments a call passes, C data stays a constant of the
 * variant; two sets of values alternating then made a new variant in place
 * of the last at every call (the data's bytes were not a constant that
 * changed, to the check that keeps both). */
START_TEST(test_data_past_the_arguments_alternates) {
  enum { N = 12 };
  kiln_fn *fn = kiln_compile(many_data_body, NULL, &(kiln_options){.name = "manydata", .n_in = 1});
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F64, 1, ((int64_t[]){3}), 7);
  for (int i = 0; i < N; i++) {
    for (int k = 0; k < 40; k++) many_data_values[k] = (i % 2 ? 0.5 : -0.25) * (k + 1);
    kiln_tensor *got, *want;
    ck_assert_msg(kiln_call(fn, &x, &got) == 0, "%s", kiln_last_error());
    ck_assert_int_eq(0, many_data_body(NULL, &x, &want));
    ck_assert_msg(maxdiff(got, want) == 0, "call %d", i);
  }
  kiln_scope_end();
  kiln_fn_stats st = stats(fn);
  ck_assert_msg(st.traces <= 4, "%lld traces in %d calls", (long long)st.traces, N);
  kiln_fn_free(fn);
}
END_TEST

Suite *capture_numbers_suite(void);
Suite *capture_numbers_suite(void) {
  Suite *s = suite_create("capture_numbers");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_conv_and_pool_numbers_change);
  tcase_add_test(tc, test_fullgraph_break_at_cond);
  tcase_add_test(tc, test_print_in_scan_body);
  tcase_add_test(tc, test_far_slice_bounds_change);
  tcase_add_test(tc, test_dropout_p_from_zero);
  tcase_add_test(tc, test_many_draws);
  tcase_add_test(tc, test_numbers_change_on_alternate_calls);
  tcase_add_test(tc, test_data_changes_every_call);
  tcase_add_test(tc, test_dumps_say_it_once);
  tcase_add_test(tc, test_data_past_the_arguments_alternates);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *r = srunner_create(capture_numbers_suite());
  srunner_run_all(r, CK_NORMAL);
  int failed = srunner_ntests_failed(r);
  srunner_free(r);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
