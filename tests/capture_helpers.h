/* What the capture tests share: a function's counters (asserting the call
 * works), and the backends and capture modes each case runs on. Include
 * after <check.h> and "kiln.h". */
#ifndef KILN_TESTS_CAPTURE_HELPERS_H
#define KILN_TESTS_CAPTURE_HELPERS_H

#include <math.h>

static inline kiln_fn_stats stats(kiln_fn *fn) {
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  return st;
}

static const int backends[2] = {KILN_BACKEND_INTERP, KILN_BACKEND_LLVM};
static const int captures[2] = {KILN_CAPTURE_AUTO, KILN_CAPTURE_RECORD};

/* Max |a - b| over the elements; INFINITY for another shape or dtype. */
static inline double max_diff(kiln_tensor *a, kiln_tensor *b) {
  ck_assert_msg(a && b, "%s", kiln_last_error());
  if (kiln_ndim(a) != kiln_ndim(b) || kiln_type(a) != kiln_type(b)) return INFINITY;
  for (int d = 0; d < kiln_ndim(a); d++)
    if (kiln_size(a, d) != kiln_size(b, d)) return INFINITY;
  if (!kiln_numel(a)) return 0;
  kiln_scope_begin();
  double r = kiln_item(kiln_max_axes(kiln_abs(kiln_sub(kiln_cast(a, KILN_F64), kiln_cast(b, KILN_F64))), NULL, 0, false));
  kiln_scope_end();
  return r;
}

#endif
