/* What the capture tests share: a function's counters (asserting the call
 * works), and the backends and capture modes each case runs on. Include
 * after <check.h> and "kiln.h". */
#ifndef KILN_TESTS_CAPTURE_HELPERS_H
#define KILN_TESTS_CAPTURE_HELPERS_H

static inline kiln_fn_stats stats(kiln_fn *fn) {
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  return st;
}

static const int backends[2] = {KILN_BACKEND_INTERP, KILN_BACKEND_LLVM};
static const int captures[2] = {KILN_CAPTURE_AUTO, KILN_CAPTURE_RECORD};

#endif
