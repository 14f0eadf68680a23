/* Sound compiled calls over inputs whose shapes, layouts and dtypes change
 * between calls: a symbolic dim that becomes 1, an input that is a view
 * (transposed, sliced, expanded), params read and written by reference.
 * Each case compares a compiled call with the same body run eagerly on the
 * same state, on both backends and both capture modes. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kiln.h"
#include "capture_helpers.h"

/* Max |a - b| over the elements, NaN where both are NaN counting as equal;
 * INFINITY for another shape. */
static double maxdiff(kiln_tensor *a, kiln_tensor *b) {
  ck_assert_msg(a && b, "%s", kiln_last_error());
  if (kiln_ndim(a) != kiln_ndim(b)) return INFINITY;
  for (int d = 0; d < kiln_ndim(a); d++)
    if (kiln_size(a, d) != kiln_size(b, d)) return INFINITY;
  int64_t n = kiln_numel(a);
  double *pa = malloc(sizeof(double) * (size_t)(n + 1)), *pb = malloc(sizeof(double) * (size_t)(n + 1)), r = 0;
  kiln_scope_begin();
  ck_assert_int_eq(0, kiln_read(kiln_cast(a, KILN_F64), pa, sizeof(double) * (size_t)n));
  ck_assert_int_eq(0, kiln_read(kiln_cast(b, KILN_F64), pb, sizeof(double) * (size_t)n));
  kiln_scope_end();
  for (int64_t i = 0; i < n; i++) {
    if (pa[i] == pb[i] || (isnan(pa[i]) && isnan(pb[i]))) continue;
    double d = fabs(pa[i] - pb[i]);
    if (!(d <= r)) r = d;
  }
  free(pa);
  free(pb);
  return r;
}


/* ---- squeeze of a symbolic dim ---- */

/* kiln_squeeze keeps a dim that is not 1 and drops one that is: traced at
 * batches 3 and 5 (the dim symbolic, the squeeze a no-op), batch 1 must
 * drop the dim as eagerly. The guard-only path ran the graph of batch 3 and
 * returned (1,4) for eager's (4,). */
static int squeeze_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_squeeze(kiln_relu(in[0]), 0);
  return out[0] ? 0 : -1;
}

START_TEST(test_squeeze_of_symbolic_dim) {
  const int64_t batch[] = {3, 5, 1, 7, 1};
  const int dyn[] = {KILN_DYNAMIC_AUTO, KILN_DYNAMIC_ALL};
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++)
      for (int k = 0; k < 2; k++) {
        kiln_options o = {.name = "squeeze", .n_in = 1, .backend = backends[b], .capture = captures[c], .dynamic = dyn[k]};
        kiln_fn *fn = kiln_compile(squeeze_body, NULL, &o);
        for (int call = 0; call < 5; call++) {
          kiln_scope_begin();
          kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){batch[call], 4}), (uint64_t)call), *y = NULL, *ye = NULL;
          ck_assert_msg(kiln_call(fn, &x, &y) == 0, "call %d: %s", call, kiln_last_error());
          ck_assert_int_eq(0, squeeze_body(NULL, &x, &ye));
          ck_assert_msg(maxdiff(y, ye) == 0, "backend %d capture %d dynamic %d call %d (batch %lld): rank %d, eager %d", b, c, k,
                        call, (long long)batch[call], kiln_ndim(y), kiln_ndim(ye));
          kiln_scope_end();
        }
        kiln_fn_free(fn);
      }
}
END_TEST

/* ---- an input written in place that is an expanded view ---- */

/* Eagerly a write into an expanded view (stride 0) is an error. Traced on a
 * plain input, the guard-only path ran the graph for an expanded one too,
 * stored its write-back into the repeated elements and returned 0. Slices
 * and transposes of the caller's tensor are written through as eagerly. */
static int mul_into_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  if (!kiln_mul_(in[0], in[1])) return -1;
  out[0] = kiln_sum(in[0], 0, false);
  return out[0] ? 0 : -1;
}

static kiln_tensor *layout_input(int kind, uint64_t seed) {
  switch (kind) {
  case 0: return kiln_randn(KILN_F32, 2, ((int64_t[]){4, 3}), seed);
  case 1: return kiln_transpose(kiln_randn(KILN_F32, 2, ((int64_t[]){3, 4}), seed), 0, 1);
  case 2: return kiln_slice(kiln_randn(KILN_F32, 2, ((int64_t[]){8, 3}), seed), 0, 1, 8, 2); /* offset and step */
  default: return kiln_expand(kiln_randn(KILN_F32, 2, ((int64_t[]){1, 3}), seed), 2, ((int64_t[]){4, 3}));
  }
}

START_TEST(test_write_into_expanded_input) {
  const int kinds[] = {0, 1, 2, 3, 0, 3};
  const int capture[3] = {KILN_CAPTURE_AUTO, KILN_CAPTURE_RECORD, KILN_CAPTURE_GUARDS};
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 3; c++) {
      kiln_options o = {.name = "mul_into", .n_in = 2, .backend = backends[b], .capture = capture[c]};
      kiln_fn *fn = kiln_compile(mul_into_body, NULL, &o);
      for (int call = 0; call < 6; call++) {
        kiln_scope_begin();
        kiln_tensor *x = layout_input(kinds[call], (uint64_t)call), *xe = layout_input(kinds[call], (uint64_t)call);
        kiln_tensor *m = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 3}), 100 + (uint64_t)call);
        kiln_tensor *in[2] = {x, m}, *ine[2] = {xe, m}, *y = NULL, *ye = NULL;
        int rc = kiln_call(fn, in, &y), rce = mul_into_body(NULL, ine, &ye);
        ck_assert_msg(rc == rce, "backend %d capture %d call %d (kind %d): compiled returned %d, eager %d", b, c, call, kinds[call], rc,
                      rce);
        if (rce) {
          ck_assert_msg(strstr(kiln_last_error(), "expanded"), "%s", kiln_last_error());
        } else {
          ck_assert_msg(maxdiff(y, ye) <= 1e-6, "backend %d capture %d call %d: output differs by %g", b, c, call, maxdiff(y, ye));
          ck_assert_msg(maxdiff(x, xe) <= 1e-6, "backend %d capture %d call %d: the input differs by %g", b, c, call, maxdiff(x, xe));
        }
        kiln_scope_end();
      }
      kiln_fn_free(fn);
    }
}
END_TEST

/* ---- kiln_contiguous of an input written through ---- */

/* kiln_contiguous hands back its input when that is contiguous, a copy
 * otherwise: a write into the result reaches the input only in the first
 * case. Traced on one layout, the guard-only path served the other: a
 * transposed input was written (or a plain one was not). */
static int contiguous_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *c = kiln_contiguous(in[0]);
  if (!c || !kiln_add_(c, in[1])) return -1;
  out[0] = kiln_mul(in[0], in[1]);
  out[1] = kiln_relu(c);
  return out[0] && out[1] ? 0 : -1;
}

START_TEST(test_contiguous_by_layout) {
  const int kinds[] = {0, 1, 0, 1, 1, 2, 0};
  for (int first = 0; first < 2; first++)
    for (int b = 0; b < 2; b++)
      for (int c = 0; c < 2; c++) {
        kiln_options o = {.name = "contiguous", .n_in = 2, .n_out = 2, .backend = backends[b], .capture = captures[c]};
        kiln_fn *fn = kiln_compile(contiguous_body, NULL, &o);
        for (int call = 0; call < 7; call++) {
          kiln_scope_begin();
          int kind = first && kinds[call] < 2 ? 1 - kinds[call] : kinds[call]; /* first: traced transposed */
          kiln_tensor *x = layout_input(kind, (uint64_t)call), *xe = layout_input(kind, (uint64_t)call);
          kiln_tensor *m = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 3}), 100 + (uint64_t)call);
          kiln_tensor *in[2] = {x, m}, *ine[2] = {xe, m}, *y[2] = {NULL, NULL}, *ye[2] = {NULL, NULL};
          ck_assert_msg(kiln_call(fn, in, y) == 0, "call %d: %s", call, kiln_last_error());
          ck_assert_int_eq(0, contiguous_body(NULL, ine, ye));
          for (int k = 0; k < 2; k++)
            ck_assert_msg(maxdiff(y[k], ye[k]) <= 1e-6, "backend %d capture %d first %d call %d (kind %d): output %d differs by %g", b,
                          c, first, call, kind, k, maxdiff(y[k], ye[k]));
          ck_assert_msg(maxdiff(x, xe) <= 1e-6, "backend %d capture %d first %d call %d (kind %d): the input differs by %g", b, c, first,
                        call, kind, maxdiff(x, xe));
          kiln_scope_end();
        }
        kiln_fn_free(fn);
      }
}
END_TEST

/* ---- two inputs over one storage: the same view, then another ---- */

/* Traced with x passed twice, the graph reads both inputs as one value.
 * Called with x and x transposed (the same storage, so the sharing guard
 * passed), the guard-only path computed x - x * z where eager computes
 * x - x^T * z; and a body that writes x with x^T as the source ran, where
 * eagerly the write is an error (src overlaps dst). */
static int views_read_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_sub(in[0], kiln_mul(in[1], in[2]));
  return out[0] ? 0 : -1;
}

static int views_write_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  if (!kiln_add_(in[0], in[1])) return -1;
  out[0] = kiln_mul(in[0], in[2]);
  return out[0] ? 0 : -1;
}

START_TEST(test_inputs_other_views_of_one_storage) {
  const int pattern[] = {1, 3, 0, 1, 3, 2, 3}; /* in[1]: 0 another tensor, 1 x, 2 a reshape of x, 3 x transposed */
  kiln_body bodies[2] = {views_read_body, views_write_body};
  for (int k = 0; k < 2; k++)
    for (int b = 0; b < 2; b++)
      for (int c = 0; c < 2; c++) {
        kiln_options o = {.name = "views", .n_in = 3, .backend = backends[b], .capture = captures[c]};
        kiln_fn *fn = kiln_compile(bodies[k], NULL, &o);
        for (int call = 0; call < 7; call++) {
          kiln_scope_begin();
          int64_t s[2] = {4, 4};
          kiln_tensor *x = kiln_randn(KILN_F32, 2, s, (uint64_t)call), *xe = kiln_randn(KILN_F32, 2, s, (uint64_t)call);
          kiln_tensor *in[3] = {x, NULL, kiln_randn(KILN_F32, 2, s, 200 + (uint64_t)call)}, *ine[3] = {xe, NULL, in[2]};
          switch (pattern[call]) {
          case 0: in[1] = ine[1] = kiln_randn(KILN_F32, 2, s, 100 + (uint64_t)call); break;
          case 1: in[1] = x, ine[1] = xe; break;
          case 2: in[1] = kiln_reshape(x, 2, s), ine[1] = kiln_reshape(xe, 2, s); break;
          default: in[1] = kiln_transpose(x, 0, 1), ine[1] = kiln_transpose(xe, 0, 1); break;
          }
          kiln_tensor *y = NULL, *ye = NULL;
          int rc = kiln_call(fn, in, &y), rce = bodies[k](NULL, ine, &ye);
          ck_assert_msg(rc == rce, "body %d backend %d capture %d call %d (pattern %d): compiled returned %d, eager %d", k, b, c, call,
                        pattern[call], rc, rce);
          if (!rce) {
            ck_assert_msg(maxdiff(y, ye) <= 1e-5, "body %d backend %d capture %d call %d (pattern %d): output differs by %g", k, b, c,
                          call, pattern[call], maxdiff(y, ye));
            ck_assert_msg(maxdiff(x, xe) <= 1e-5, "body %d backend %d capture %d call %d: x differs by %g", k, b, c, call, maxdiff(x, xe));
          }
          kiln_scope_end();
        }
        kiln_fn_free(fn);
      }
}
END_TEST

/* ---- casts at the edges of a dtype ---- */

/* Every element of a compiled result equals eager's, NaN for NaN. */
static void same_elements(kiln_tensor *got, kiln_tensor *want, const char *what) {
  int64_t n = kiln_numel(want);
  ck_assert_int_eq(n, kiln_numel(got));
  double *a = malloc(sizeof(double) * (size_t)(n + 1)), *e = malloc(sizeof(double) * (size_t)(n + 1));
  kiln_scope_begin();
  ck_assert_int_eq(0, kiln_read(kiln_cast(got, KILN_F64), a, sizeof(double) * (size_t)n));
  ck_assert_int_eq(0, kiln_read(kiln_cast(want, KILN_F64), e, sizeof(double) * (size_t)n));
  kiln_scope_end();
  for (int64_t i = 0; i < n; i++)
    ck_assert_msg(a[i] == e[i] || (isnan(a[i]) && isnan(e[i])), "%s: element %lld: compiled %.17g, eager %.17g", what, (long long)i, a[i], e[i]);
  free(a);
  free(e);
}

/* A float cast to i64 or i32 is eagerly truncated toward zero and saturated
 * at the integer's range, NaN 0. LLVM's fptosi is poison out of range: the
 * LLVM backend gave INT64_MIN for inf and NaN, and wrapped 3e9 cast to i32. */
static int float_to_int_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = kiln_mul(in[0], in[1]);
  out[0] = kiln_cast(x, KILN_I64);
  out[1] = kiln_cast(x, KILN_I32);
  out[2] = kiln_cast(kiln_cast(x, KILN_I64), KILN_I32); /* i64 to i32 wraps */
  return out[0] && out[1] && out[2] ? 0 : -1;
}

START_TEST(test_float_to_int_saturates) {
  const float v[] = {NAN, INFINITY, -INFINITY, 1e30f, -1e30f, 3e9f, -3e9f, 9.3e18f, -9.3e18f, 2.5f, -2.5f, -0.0f, 3.4e38f, 1e10f};
  const int64_t n = sizeof v / sizeof *v;
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      kiln_options o = {.name = "to_int", .n_in = 2, .n_out = 3, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(float_to_int_body, NULL, &o);
      for (int call = 0; call < 2; call++) {
        kiln_scope_begin();
        kiln_tensor *in[2] = {kiln_tensor_from(KILN_F32, 1, &n, v), kiln_full(KILN_F32, 1, &n, call ? -1.0 : 1.0)};
        kiln_tensor *y[3] = {NULL}, *ye[3] = {NULL};
        ck_assert_msg(kiln_call(fn, in, y) == 0, "%s", kiln_last_error());
        ck_assert_int_eq(0, float_to_int_body(NULL, in, ye));
        for (int k = 0; k < 3; k++) same_elements(y[k], ye[k], b ? "llvm" : "interp");
        kiln_scope_end();
      }
      kiln_fn_free(fn);
    }
}
END_TEST

/* f64 to f16 or bf16 rounds once in eager (through f32 rounded to odd):
 * 1 + 2^-11 + 2^-40 is just above the midpoint of two f16 values and
 * becomes 1 + 2^-10. The LLVM backend rounded to f32 first (to the exact
 * midpoint 1 + 2^-11) and then to even, 1; so did an f64 0-d number
 * promoted into an f16 product. */
static int f64_to_narrow_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = kiln_mul(in[0], in[1]);
  out[0] = kiln_cast(x, KILN_F16);
  out[1] = kiln_cast(x, KILN_BF16);
  out[2] = kiln_mul(in[2], in[3]); /* f16 tensor * f64 0-d: f16, the number rounded to f16 once */
  return out[0] && out[1] && out[2] ? 0 : -1;
}

START_TEST(test_f64_to_narrow_rounds_once) {
  const double v[] = {1 + 0x1p-11 + 0x1p-40, 1 + 0x1p-8 + 0x1p-40, 3 + 0x1p-10 + 0x1p-45, 65519.99, 1e-8, 1 + 0x1p-11, NAN, 1e300};
  const float h[] = {1, 3, 0.5f, 2049, 65504, -7};
  const int64_t n = sizeof v / sizeof *v, nh = sizeof h / sizeof *h;
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      kiln_options o = {.name = "to_narrow", .n_in = 4, .n_out = 3, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(f64_to_narrow_body, NULL, &o);
      for (int call = 0; call < 2; call++) {
        kiln_scope_begin();
        double sign = call ? -1.0 : 1.0;
        kiln_tensor *in[4] = {kiln_tensor_from(KILN_F64, 1, &n, v), kiln_full(KILN_F64, 1, &n, sign),
                              kiln_cast(kiln_tensor_from(KILN_F32, 1, &nh, h), KILN_F16), kiln_scalar(KILN_F64, sign * v[0])};
        kiln_tensor *y[3] = {NULL}, *ye[3] = {NULL};
        ck_assert_msg(kiln_call(fn, in, y) == 0, "%s", kiln_last_error());
        ck_assert_int_eq(0, f64_to_narrow_body(NULL, in, ye));
        for (int k = 0; k < 3; k++) same_elements(y[k], ye[k], b ? "llvm" : "interp");
        kiln_scope_end();
      }
      kiln_fn_free(fn);
    }
}
END_TEST

/* ---- calls that alternate between shared and distinct inputs ---- */

/* x * y with y another tensor, then y = x transposed (the same storage),
 * then another tensor again: the variant made for the shared storage
 * replaced the one for distinct inputs (it was taken for one whose numbers
 * differed, the events being the same), so every change of kind compiled
 * again. Two variants serve them all, with eager's answers. */
static int product_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_mul(in[0], in[1]);
  return out[0] ? 0 : -1;
}

START_TEST(test_shared_and_distinct_inputs_alternate) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      kiln_options o = {.name = "product", .n_in = 2, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(product_body, NULL, &o);
      for (int call = 0; call < 8; call++) {
        kiln_scope_begin();
        int64_t s[2] = {4, 4};
        kiln_tensor *x = kiln_randn(KILN_F32, 2, s, (uint64_t)call), *y = NULL, *ye = NULL;
        kiln_tensor *in[2] = {x, call % 2 ? kiln_transpose(x, 0, 1) : kiln_randn(KILN_F32, 2, s, 50 + (uint64_t)call)};
        ck_assert_msg(kiln_call(fn, in, &y) == 0, "%s", kiln_last_error());
        ck_assert_int_eq(0, product_body(NULL, in, &ye));
        ck_assert_msg(maxdiff(y, ye) == 0, "backend %d capture %d call %d: differs by %g", b, c, call, maxdiff(y, ye));
        kiln_scope_end();
      }
      kiln_fn_stats st;
      ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
      ck_assert_msg(st.traces == 2 && st.variants == 2, "backend %d capture %d: %lld traces, %lld variants", b, c, (long long)st.traces,
                    (long long)st.variants);
      kiln_fn_free(fn);
    }
}
END_TEST

/* ---- saving a variant traced with a tensor passed twice ---- */

/* The recording takes x passed twice for one value, so the variant's graph
 * is mul(%0, %0). Saved, it loaded as a function of two distinct inputs
 * that computed x * x for (x, z), where the body computes x * z; an export
 * did the same. Saving or exporting such a variant is an error now, and a
 * variant traced with distinct inputs saves and loads as before. */
START_TEST(test_save_refuses_shared_leaves) {
  char path[] = "/tmp/kiln_layouts_XXXXXX";
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  close(fd);
  kiln_options o = {.name = "product", .n_in = 2};
  kiln_fn *fn = kiln_compile(product_body, NULL, &o);
  kiln_scope_begin();
  int64_t s[1] = {4};
  kiln_tensor *x = kiln_randn(KILN_F32, 1, s, 1), *z = kiln_randn(KILN_F32, 1, s, 2), *y = NULL, *ye = NULL;
  kiln_tensor *twice[2] = {x, x}, *two[2] = {x, z};
  ck_assert_int_eq(0, kiln_call(fn, twice, &y));
  ck_assert_int_eq(-1, kiln_save(fn, path));
  ck_assert_msg(strstr(kiln_last_error(), "passed twice"), "%s", kiln_last_error());
  ck_assert_int_eq(-1, kiln_export(fn, path, NULL));
  ck_assert_msg(strstr(kiln_last_error(), "passed twice"), "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_call(fn, two, &y)); /* a variant of distinct inputs, the newest */
  ck_assert_msg(kiln_save(fn, path) == 0, "%s", kiln_last_error());
  kiln_fn *loaded = kiln_load(path);
  ck_assert_msg(loaded != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_call(loaded, two, &y));
  ck_assert_int_eq(0, product_body(NULL, two, &ye));
  ck_assert_msg(maxdiff(y, ye) == 0, "the loaded graph differs by %g", maxdiff(y, ye));
  kiln_scope_end();
  kiln_fn_free(loaded);
  kiln_fn_free(fn);
  unlink(path);
}
END_TEST

Suite *capture_layouts_suite(void);
Suite *capture_layouts_suite(void) {
  Suite *s = suite_create("capture_layouts");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_squeeze_of_symbolic_dim);
  tcase_add_test(tc, test_write_into_expanded_input);
  tcase_add_test(tc, test_contiguous_by_layout);
  tcase_add_test(tc, test_inputs_other_views_of_one_storage);
  tcase_add_test(tc, test_float_to_int_saturates);
  tcase_add_test(tc, test_f64_to_narrow_rounds_once);
  tcase_add_test(tc, test_shared_and_distinct_inputs_alternate);
  tcase_add_test(tc, test_save_refuses_shared_leaves);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *r = srunner_create(capture_layouts_suite());
  srunner_run_all(r, CK_NORMAL);
  int failed = srunner_ntests_failed(r);
  srunner_free(r);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
