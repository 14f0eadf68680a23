/* Writes into views under kiln_compile: a cache (a param) written one row
 * per call at a position that changes every call, through slices, a
 * transpose and add_, then read back in the same body. Each case runs the
 * same body eagerly on a second cache and compares outputs and caches after
 * every step; one variant must serve every position. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kiln.h"

enum { T = 24, D = 8, STEPS = 20 };

typedef struct kv {
  kiln_tensor *cache;  /* (T,D) */
  kiln_tensor *cacheT; /* (D,T): written through a transpose */
  int64_t pos;
} kv;

static double maxdiff(kiln_tensor *a, kiln_tensor *b) {
  ck_assert_msg(a && b, "%s", kiln_last_error());
  ck_assert_int_eq(kiln_numel(a), kiln_numel(b));
  kiln_scope_begin();
  double r = kiln_item(kiln_max_axes(kiln_abs(kiln_sub(a, b)), NULL, 0, false));
  kiln_scope_end();
  return r;
}

/* Writes 2x+pos into row pos of cache and column pos of cacheT, adds x to
 * row pos again, then attends over rows [0, pos] (a read after the write). */
static int step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kv *c = ctx;
  kiln_tensor *x = in[0]; /* (1,D) */
  kiln_tensor *row = kiln_slice(c->cache, 0, c->pos, c->pos + 1, 1);
  if (!kiln_copy_(row, kiln_mul(x, kiln_scalar(KILN_F32, 2.0))) ||
      !kiln_add_(kiln_slice(c->cache, 0, c->pos, c->pos + 1, 1), x) ||
      !kiln_copy_(kiln_slice(kiln_transpose(c->cacheT, 0, 1), 0, c->pos, c->pos + 1, 1), x))
    return -1;
  kiln_tensor *keys = kiln_slice(c->cache, 0, 0, c->pos + 1, 1);              /* (pos+1,D) */
  kiln_tensor *vals = kiln_slice(c->cacheT, 1, 0, c->pos + 1, 1);             /* (D,pos+1) */
  kiln_tensor *att = kiln_softmax(kiln_matmul(x, kiln_transpose(keys, 0, 1)), -1); /* (1,pos+1) */
  out[0] = kiln_matmul(att, kiln_transpose(vals, 0, 1));                     /* (1,D) */
  return out[0] ? 0 : -1;
}

static kiln_tensor *rows(uint64_t seed) { return kiln_randn(KILN_F32, 2, ((int64_t[]){STEPS, D}), seed); }

START_TEST(test_cache_filled_over_steps) {
  kv e = {kiln_zeros(KILN_F32, 2, ((int64_t[]){T, D})), kiln_zeros(KILN_F32, 2, ((int64_t[]){D, T})), 0};
  kv c = {kiln_zeros(KILN_F32, 2, ((int64_t[]){T, D})), kiln_zeros(KILN_F32, 2, ((int64_t[]){D, T})), 0};
  kiln_tensor *xs = rows(7);
  kiln_options o = {.name = "kv_step", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(step, &c, &o);
  ck_assert_ptr_nonnull(fn);
  for (int64_t p = 0; p < STEPS; p++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_slice(xs, 0, p, p + 1, 1), *ye, *yc;
    e.pos = c.pos = p;
    ck_assert_int_eq(0, step(&e, &x, &ye));
    ck_assert_msg(kiln_call(fn, &x, &yc) == 0, "%s", kiln_last_error());
    ck_assert_msg(maxdiff(ye, yc) < 1e-5, "step %lld: output differs by %g", (long long)p, maxdiff(ye, yc));
    ck_assert_msg(maxdiff(e.cache, c.cache) == 0, "step %lld: cache differs by %g", (long long)p, maxdiff(e.cache, c.cache));
    ck_assert_msg(maxdiff(e.cacheT, c.cacheT) == 0, "step %lld: cacheT differs", (long long)p);
    kiln_scope_end();
  }
  /* row p is 3 x_p, independently of kiln's compiled code; rows after STEPS still zero */
  float got[T * D], x[STEPS * D];
  ck_assert_int_eq(0, kiln_read(c.cache, got, sizeof got));
  ck_assert_int_eq(0, kiln_read(xs, x, sizeof x));
  for (int i = 0; i < T * D; i++) ck_assert_float_eq_tol(i < STEPS * D ? 3 * x[i] : 0.0f, got[i], 1e-6);
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.variants);
  ck_assert_int_eq(STEPS, st.calls);
  ck_assert_int_le(st.traces, 2);
  ck_assert_int_ge(st.hits, STEPS - 2);
  ck_assert_int_eq(0, st.fallbacks);
  kiln_fn_free(fn);
  kiln_release(xs);
  kiln_release(e.cache), kiln_release(e.cacheT), kiln_release(c.cache), kiln_release(c.cacheT);
}
END_TEST

/* The graph holds the write as a slice_scatter written back to the param, never an eager escape. */
START_TEST(test_write_is_in_graph) {
  kv c = {kiln_zeros(KILN_F32, 2, ((int64_t[]){T, D})), kiln_zeros(KILN_F32, 2, ((int64_t[]){D, T})), 0};
  kiln_tensor *xs = rows(3);
  kiln_options o = {.name = "kv_graph", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(step, &c, &o);
  for (int64_t p = 0; p < 3; p++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_slice(xs, 0, p, p + 1, 1), *y;
    c.pos = p;
    ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
    kiln_scope_end();
  }
  char *g = kiln_fn_graph(fn, 0);
  ck_assert_ptr_nonnull(g);
  ck_assert_msg(strstr(g, "slice_scatter("), "%s", g);
  ck_assert_msg(strstr(g, "write %"), "%s", g);
  free(g);
  kiln_fn_free(fn);
  kiln_release(xs);
  kiln_release(c.cache), kiln_release(c.cacheT);
}
END_TEST

/* What fd 2 received between catch_begin and catch_end. */
static char caught[1 << 16];
static FILE *catch_log;
static int catch_saved;

static void catch_begin(void) {
  fflush(stderr);
  catch_log = tmpfile();
  ck_assert_ptr_nonnull(catch_log);
  catch_saved = dup(2);
  dup2(fileno(catch_log), 2);
}

static void catch_end(void) {
  fflush(stderr);
  dup2(catch_saved, 2);
  close(catch_saved);
  rewind(catch_log);
  caught[fread(caught, 1, sizeof caught - 1, catch_log)] = 0;
  fclose(catch_log);
}

static void run_steps_caught(kiln_fn *fn, kv *c, kiln_tensor *xs, int n) {
  catch_begin();
  for (int64_t p = 0; p < n; p++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_slice(xs, 0, p, p + 1, 1), *y;
    c->pos = p;
    ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
    kiln_scope_end();
  }
  catch_end();
}

/* The row writes into the param's own memory: the scatter's buffer is the
 * cache's (the plan says so), and check mode, which compares every kernel
 * against the interpreter, finds nothing wrong. */
START_TEST(test_scatter_in_place) {
  kv c = {kiln_zeros(KILN_F32, 2, ((int64_t[]){T, D})), kiln_zeros(KILN_F32, 2, ((int64_t[]){D, T})), 0};
  kiln_tensor *xs = rows(11);
  kiln_options o = {.name = "kv_inplace", .n_in = 1, .n_out = 1, .dump = KILN_DUMP_KERNELS, .check = 1};
  kiln_fn *fn = kiln_compile(step, &c, &o);
  run_steps_caught(fn, &c, xs, 6);
  const char *v2 = strstr(caught, "variant 2");
  ck_assert_msg(v2 && strstr(v2, "f32[24,8] stored in place in b"), "%s", caught);
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(0, st.check_fails);
  float got[T * D], x[STEPS * D];
  ck_assert_int_eq(0, kiln_read(c.cache, got, sizeof got));
  ck_assert_int_eq(0, kiln_read(xs, x, sizeof x));
  for (int i = 0; i < T * D; i++) ck_assert_float_eq_tol(i < 6 * D ? 3 * x[i] : 0.0f, got[i], 1e-6);
  kiln_fn_free(fn);
  kiln_release(xs);
  kiln_release(c.cache), kiln_release(c.cacheT);
}
END_TEST

/* The position as an input: index_copy_ writes row idx of the cache, and
 * the compiled write goes into the cache's own memory too (the plan says
 * so); check mode finds nothing wrong, and the cache holds each row 3x
 * where it was written, zeros elsewhere. */
static int step_at(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kv *c = ctx;
  if (!kiln_index_copy_(c->cache, 0, in[1], kiln_mul(in[0], kiln_scalar(KILN_F32, 3.0)))) return -1;
  out[0] = kiln_sum(c->cache, 0, true);
  return out[0] ? 0 : -1;
}

START_TEST(test_index_copy_in_place) {
  kv c = {kiln_zeros(KILN_F32, 2, ((int64_t[]){T, D})), NULL, 0};
  kiln_tensor *xs = rows(12);
  kiln_options o = {.name = "kv_at", .n_in = 2, .n_out = 1, .dump = KILN_DUMP_KERNELS, .check = 1,
                    .capture = KILN_CAPTURE_GUARDS};
  kiln_fn *fn = kiln_compile(step_at, &c, &o);
  catch_begin();
  for (int64_t p = 0; p < 6; p++) {
    kiln_scope_begin();
    int64_t at = 2 * p;
    kiln_tensor *in[2] = {kiln_slice(xs, 0, p, p + 1, 1), kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &at)}, *y;
    ck_assert_msg(kiln_call(fn, in, &y) == 0, "%s", kiln_last_error());
    kiln_scope_end();
  }
  catch_end();
  ck_assert_msg(strstr(caught, "f32[24,8] stored in place in b"), "%s", caught);
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(0, st.check_fails);
  ck_assert_int_eq(1, st.variants);
  float got[T * D], x[STEPS * D];
  ck_assert_int_eq(0, kiln_read(c.cache, got, sizeof got));
  ck_assert_int_eq(0, kiln_read(xs, x, sizeof x));
  for (int r = 0; r < T; r++)
    for (int j = 0; j < D; j++)
      ck_assert_float_eq_tol(r % 2 == 0 && r < 12 ? 3 * x[r / 2 * D + j] : 0.0f, got[r * D + j], 1e-6);
  kiln_fn_free(fn);
  kiln_release(xs);
  kiln_release(c.cache);
}
END_TEST

/* Reading the cache's old value after the write keeps the scatter out of
 * place: the old rows sum as they were. */
static int old_after(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kv *c = ctx;
  kiln_tensor *before = kiln_mul(c->cache, kiln_scalar(KILN_F32, 1.0)); /* the old value, computed */
  if (!kiln_copy_(kiln_slice(c->cache, 0, c->pos, c->pos + 1, 1), in[0])) return -1;
  out[0] = kiln_add(kiln_sum(before, 0, true), kiln_sum(c->cache, 0, true));
  return out[0] ? 0 : -1;
}

START_TEST(test_old_value_read_after_write) {
  kv e = {kiln_zeros(KILN_F32, 2, ((int64_t[]){T, D})), NULL, 0};
  kv c = {kiln_zeros(KILN_F32, 2, ((int64_t[]){T, D})), NULL, 0};
  kiln_tensor *xs = rows(13);
  kiln_options o = {.name = "kv_old", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(old_after, &c, &o);
  for (int64_t p = 0; p < 6; p++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_slice(xs, 0, p, p + 1, 1), *ye, *yc;
    e.pos = c.pos = p;
    ck_assert_int_eq(0, old_after(&e, &x, &ye));
    ck_assert_msg(kiln_call(fn, &x, &yc) == 0, "%s", kiln_last_error());
    ck_assert_msg(maxdiff(ye, yc) < 1e-5, "step %lld differs by %g", (long long)p, maxdiff(ye, yc));
    kiln_scope_end();
  }
  ck_assert(maxdiff(e.cache, c.cache) == 0);
  kiln_fn_free(fn);
  kiln_release(xs);
  kiln_release(e.cache), kiln_release(c.cache);
}
END_TEST

/* A write into a view of a tensor the body made (a temp), then read. */
static int made_base(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kv *c = ctx;
  kiln_tensor *buf = kiln_mul(c->cache, kiln_scalar(KILN_F32, 2.0));
  if (!kiln_copy_(kiln_slice(buf, 0, c->pos, c->pos + 1, 1), in[0]) ||
      !kiln_mul_(kiln_slice(kiln_transpose(buf, 0, 1), 1, 0, c->pos + 1, 1), kiln_scalar(KILN_F32, -1.0)))
    return -1;
  out[0] = kiln_sum(buf, 0, true);
  return out[0] ? 0 : -1;
}

START_TEST(test_write_into_made_tensor) {
  kv c = {kiln_randn(KILN_F32, 2, ((int64_t[]){T, D}), 2), NULL, 0};
  kiln_tensor *xs = rows(17);
  kiln_options o = {.name = "kv_made", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(made_base, &c, &o);
  for (int64_t p = 0; p < 6; p++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_slice(xs, 0, p, p + 1, 1), *ye, *yc;
    c.pos = p;
    ck_assert_int_eq(0, made_base(&c, &x, &ye));
    ck_assert_msg(kiln_call(fn, &x, &yc) == 0, "%s", kiln_last_error());
    ck_assert_msg(maxdiff(ye, yc) < 1e-5, "step %lld differs by %g", (long long)p, maxdiff(ye, yc));
    kiln_scope_end();
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.variants);
  ck_assert_int_ge(st.hits, 4);
  kiln_fn_free(fn);
  kiln_release(xs);
  kiln_release(c.cache);
}
END_TEST

/* A cache that requires grad: the write is refused as eagerly, naming copy_ and the line. */
START_TEST(test_grad_through_cache_refused) {
  kv c = {kiln_zeros(KILN_F32, 2, ((int64_t[]){T, D})), kiln_zeros(KILN_F32, 2, ((int64_t[]){D, T})), 0};
  kiln_requires_grad(c.cache, true);
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){1, D}), 1), *y = NULL;
  kiln_options o = {.name = "kv_grad", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(step, &c, &o);
  ck_assert_int_eq(-1, kiln_call(fn, &x, &y));
  const char *err = kiln_last_error();
  ck_assert_msg(strstr(err, "copy_") && strstr(err, "requires grad") && strstr(err, "test_kvcache.c"), "%s", err);
  kiln_fn_free(fn);
  kiln_release(x);
  kiln_release(c.cache), kiln_release(c.cacheT);
}
END_TEST

/* A view made before the write and used after it still runs eagerly, with the right answer. */
static int stale(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kv *c = ctx;
  kiln_tensor *all = kiln_slice(c->cache, 0, 0, T, 1);
  kiln_copy_(kiln_slice(c->cache, 0, c->pos, c->pos + 1, 1), in[0]);
  out[0] = kiln_sum(all, 0, true);
  return out[0] ? 0 : -1;
}

START_TEST(test_stale_view_after_write) {
  kv c = {kiln_zeros(KILN_F32, 2, ((int64_t[]){T, D})), NULL, 0};
  kiln_tensor *xs = rows(5);
  kiln_options o = {.name = "kv_stale", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(stale, &c, &o);
  float want[D] = {0}, x[STEPS * D];
  ck_assert_int_eq(0, kiln_read(xs, x, sizeof x));
  for (int64_t p = 0; p < 4; p++) {
    kiln_scope_begin();
    kiln_tensor *xp = kiln_slice(xs, 0, p, p + 1, 1), *y;
    c.pos = p;
    ck_assert_msg(kiln_call(fn, &xp, &y) == 0, "%s", kiln_last_error());
    float got[D];
    ck_assert_int_eq(0, kiln_read(y, got, sizeof got));
    for (int j = 0; j < D; j++) {
      want[j] += x[p * D + j];
      ck_assert_float_eq_tol(want[j], got[j], 1e-5);
    }
    kiln_scope_end();
  }
  kiln_fn_free(fn);
  kiln_release(xs);
  kiln_release(c.cache);
}
END_TEST

int main(void) {
  Suite *s = suite_create("kvcache");
  TCase *tc = tcase_create("writes into views");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_cache_filled_over_steps);
  tcase_add_test(tc, test_write_is_in_graph);
  tcase_add_test(tc, test_scatter_in_place);
  tcase_add_test(tc, test_index_copy_in_place);
  tcase_add_test(tc, test_old_value_read_after_write);
  tcase_add_test(tc, test_write_into_made_tensor);
  tcase_add_test(tc, test_grad_through_cache_refused);
  tcase_add_test(tc, test_stale_view_after_write);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
