/* Symbolic dims: canonical forms are shared pointers, the rewrite rules,
 * bounds, evaluation with overflow, the text form and its errors, guards and
 * static decisions. Random expressions are checked against a small evaluator
 * of the text written here, independent of the library's rewriting. */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eager/eager.h"
#include "eager/sym.h"

static sym_ctx *ctx;
static char errbuf[256];

static void setup(void) { ctx = sym_ctx_new(); }
static void teardown(void) { sym_ctx_free(ctx); }

static sym_dim C(int64_t c) { return sym_const(c); }

/* Declares s<id> in [lo, hi]. */
static sym_dim V(int id, int64_t lo, int64_t hi)
{
  sym_dim d = sym_var(ctx, id, lo, hi);
  ck_assert_msg(!sym_is_err(d), "s%d: %s", id, sym_ctx_error(ctx));
  return d;
}

static sym_dim P(const char *text)
{
  sym_dim d;
  int rc = sym_parse(ctx, text, &d, NULL, errbuf, sizeof errbuf);
  ck_assert_msg(rc == 0, "parse '%s': %s", text, errbuf);
  return d;
}

static const char *S(sym_dim d)
{
  static char buf[4][512];
  static int k;
  char *b = buf[k++ % 4];
  int n = sym_print(d, b, 512);
  ck_assert_msg(n >= 0 && n < 512, "print failed (%d)", n);
  return b;
}

#define ASSERT_SAME(want, got) \
  ck_assert_msg(sym_same(want, got), "expected %s, got %s", S(want), S(got))
#define ASSERT_TEXT(want, d) ck_assert_str_eq(want, S(d))
/* For hot loops: Check's passing asserts each write to a pipe. */
#define CHECK(cond, ...)                    \
  do {                                      \
    if (!(cond)) ck_abort_msg(__VA_ARGS__); \
  } while (0)

START_TEST(test_canonical_sharing)
{
  sym_dim s0 = V(0, 0, 100), s1 = V(1, 0, 100);
  /* equal forms are one pointer */
  ck_assert_ptr_eq(sym_add(ctx, s0, s1).e, sym_add(ctx, s1, s0).e);
  ck_assert_ptr_eq(sym_mul(ctx, s0, s1).e, sym_mul(ctx, s1, s0).e);
  ck_assert_ptr_eq(sym_sub(ctx, sym_mul(ctx, C(2), s0), s0).e, s0.e);
  ck_assert_ptr_eq(sym_floordiv(ctx, sym_mul(ctx, C(4), s0), C(4)).e, s0.e);
  sym_dim m = sym_mod(ctx, sym_mul(ctx, sym_mul(ctx, s0, s1), C(4)), C(4));
  ck_assert(sym_is_const(m));
  ck_assert_int_eq(0, m.c);
  /* identities */
  ck_assert_ptr_eq(s0.e, sym_add(ctx, s0, C(0)).e);
  ck_assert_ptr_eq(s0.e, sym_mul(ctx, s0, C(1)).e);
  ASSERT_SAME(C(0), sym_mul(ctx, s0, C(0)));
  ASSERT_SAME(C(0), sym_sub(ctx, s0, s0));
  /* (s0+s1) - s1 + 3 - 3 is s0 again */
  sym_dim t = sym_sub(ctx, sym_add(ctx, sym_add(ctx, s0, s1), C(3)), sym_add(ctx, s1, C(3)));
  ck_assert_ptr_eq(s0.e, t.e);
  /* the parser builds through the same ops */
  ck_assert_ptr_eq(sym_add(ctx, s0, s1).e, P("s1 + s0").e);
  ck_assert_ptr_eq(sym_mul(ctx, C(3), sym_mul(ctx, s0, s1)).e, P("s1*3*s0").e);
  /* distributivity: 2*(s0 + s1) == 2*s0 + 2*s1 */
  ck_assert_ptr_eq(sym_mul(ctx, C(2), sym_add(ctx, s0, s1)).e,
                   sym_add(ctx, sym_mul(ctx, C(2), s0), sym_mul(ctx, C(2), s1)).e);
  ck_assert(!sym_same(s0, s1));
  ck_assert(sym_same(C(5), C(5)));
  ck_assert(!sym_same(C(5), C(6)));
}
END_TEST

START_TEST(test_constant_folding)
{
  ASSERT_SAME(C(5), sym_add(ctx, C(2), C(3)));
  ASSERT_SAME(C(-1), sym_sub(ctx, C(2), C(3)));
  ASSERT_SAME(C(-12), sym_mul(ctx, C(-3), C(4)));
  /* floor semantics, as Python: -7 // 2 = -4, -7 % 2 = 1 */
  ASSERT_SAME(C(-4), sym_floordiv(ctx, C(-7), C(2)));
  ASSERT_SAME(C(1), sym_mod(ctx, C(-7), C(2)));
  ASSERT_SAME(C(3), sym_floordiv(ctx, C(7), C(2)));
  ASSERT_SAME(C(1), sym_mod(ctx, C(7), C(2)));
  ASSERT_SAME(C(42), P("(2 + 4) * 7"));
  ASSERT_SAME(C(-4), P("-7 // 2"));
  ASSERT_SAME(C(3), P("1 - 2 + 4"));
}
END_TEST

START_TEST(test_divmod_rules)
{
  sym_dim s0 = V(0, 0, 100), s1 = V(1, 0, 100), s2 = V(2, 0, 3), s4 = V(4, 4, 7), s5 = V(5, 2, 64);
  sym_dim four_s0 = sym_mul(ctx, C(4), s0);
  /* (4*s0 + 3)//4 = s0: 0 <= 3 < 4 */
  ck_assert_ptr_eq(s0.e, sym_floordiv(ctx, sym_add(ctx, four_s0, C(3)), C(4)).e);
  /* (4*s0 + 5)//4 = s0 + 1 */
  ck_assert_ptr_eq(sym_add(ctx, s0, C(1)).e, sym_floordiv(ctx, sym_add(ctx, four_s0, C(5)), C(4)).e);
  /* (4*s0 + s2)//4 = s0 as s2 is in [0, 3]; with s1 in [0, 100] it is s0 + s1//4 */
  ck_assert_ptr_eq(s0.e, sym_floordiv(ctx, sym_add(ctx, four_s0, s2), C(4)).e);
  ASSERT_TEXT("s0 + s1//4", sym_floordiv(ctx, sym_add(ctx, four_s0, s1), C(4)));
  /* x//k = 0 and x%k = x when 0 <= x < k */
  ASSERT_SAME(C(0), sym_floordiv(ctx, s2, C(4)));
  ck_assert_ptr_eq(s2.e, sym_mod(ctx, s2, C(4)).e);
  /* s4 in [4, 7]: s4//4 = 1, s4 % 4 = s4 - 4 */
  ASSERT_SAME(C(1), sym_floordiv(ctx, s4, C(4)));
  ASSERT_SAME(sym_sub(ctx, s4, C(4)), sym_mod(ctx, s4, C(4)));
  /* by one */
  ck_assert_ptr_eq(s0.e, sym_floordiv(ctx, s0, C(1)).e);
  ASSERT_SAME(C(0), sym_mod(ctx, s0, C(1)));
  /* (s0//2)//3 = s0//6 */
  ck_assert_ptr_eq(sym_floordiv(ctx, s0, C(6)).e, sym_floordiv(ctx, sym_floordiv(ctx, s0, C(2)), C(3)).e);
  /* (s0 % 8) % 4 = s0 % 4; (s0 % 4) % 8 = s0 % 4 */
  sym_dim m4 = sym_mod(ctx, s0, C(4));
  ck_assert_ptr_eq(m4.e, sym_mod(ctx, sym_mod(ctx, s0, C(8)), C(4)).e);
  ck_assert_ptr_eq(m4.e, sym_mod(ctx, m4, C(8)).e);
  /* common factors: (2*s0 + 2)//4 = (s0 + 1)//2; (2*s0) % 4 = 2*(s0 % 2) */
  sym_dim two_s0 = sym_mul(ctx, C(2), s0);
  ck_assert_ptr_eq(sym_floordiv(ctx, sym_add(ctx, s0, C(1)), C(2)).e,
                   sym_floordiv(ctx, sym_add(ctx, two_s0, C(2)), C(4)).e);
  ASSERT_TEXT("2*(s0 % 2)", sym_mod(ctx, two_s0, C(4)));
  /* coefficients reduce modulo k: (5*s0) % 4 = s0 % 4; (s0 + 9) % 4 = (s0 + 1) % 4 */
  ck_assert_ptr_eq(m4.e, sym_mod(ctx, sym_mul(ctx, C(5), s0), C(4)).e);
  ASSERT_TEXT("(s0 + 1) % 4", sym_mod(ctx, sym_add(ctx, s0, C(9)), C(4)));
  /* -s0 and 3*s0 agree modulo 4, so their remainders are one node */
  ck_assert_ptr_eq(sym_mod(ctx, sym_mul(ctx, C(3), s0), C(4)).e, sym_mod(ctx, sym_mul(ctx, C(-1), s0), C(4)).e);
  ASSERT_TEXT("3*(s0 % 4) + 1", sym_add(ctx, sym_mul(ctx, C(3), m4), C(1)));
  /* symbolic divisors */
  sym_dim s0s5 = sym_mul(ctx, s0, s5);
  ck_assert_ptr_eq(s0.e, sym_floordiv(ctx, s0s5, s5).e);
  ASSERT_SAME(sym_add(ctx, s0, C(3)), sym_floordiv(ctx, sym_add(ctx, s0s5, sym_mul(ctx, C(3), s5)), s5));
  ASSERT_SAME(C(0), sym_mod(ctx, s0s5, s5));
  /* 0 <= 1 < s5: (s0*s5 + 1)//s5 = s0 and (s0*s5 + 1) % s5 = 1 */
  ck_assert_ptr_eq(s0.e, sym_floordiv(ctx, sym_add(ctx, s0s5, C(1)), s5).e);
  ASSERT_SAME(C(1), sym_mod(ctx, sym_add(ctx, s0s5, C(1)), s5));
  ASSERT_SAME(C(1), sym_floordiv(ctx, s5, s5));
  /* (6*s0*s5)//(2*s5) = 3*s0 */
  ASSERT_SAME(sym_mul(ctx, C(3), s0),
              sym_floordiv(ctx, sym_mul(ctx, C(6), s0s5), sym_mul(ctx, C(2), s5)));
  ASSERT_TEXT("s0//s5", sym_floordiv(ctx, s0, s5));
  ASSERT_TEXT("s0 % s5", sym_mod(ctx, s0, s5));
}
END_TEST

START_TEST(test_divisor_must_be_positive)
{
  sym_dim s0 = V(0, 0, 100), s1 = V(1, 0, 100);
  ck_assert(sym_is_err(sym_floordiv(ctx, s0, C(0))));
  ck_assert_str_eq("divisor not provably positive", sym_ctx_error(ctx));
  ck_assert(sym_is_err(sym_mod(ctx, s0, C(-3))));
  ck_assert(sym_is_err(sym_floordiv(ctx, s0, s1))); /* s1 may be 0 */
  ck_assert(sym_is_err(sym_mod(ctx, C(5), s1)));
  ck_assert(sym_is_err(sym_floordiv(ctx, C(5), C(0))));
}
END_TEST

START_TEST(test_bounds)
{
  sym_dim s0 = V(0, 2, 10), s1 = V(1, -3, 5), s2 = V(2, 0, INT64_MAX), s3 = V(3, INT64_MIN, INT64_MAX);
  struct {
    sym_dim d;
    int64_t lo, hi;
  } cases[] = {
      {C(7), 7, 7},
      {s0, 2, 10},
      {sym_add(ctx, sym_mul(ctx, C(2), s0), C(3)), 7, 23},
      {sym_sub(ctx, s0, s1), -3, 13},
      {sym_mul(ctx, s0, s1), -30, 50}, /* corners 2*-3, 2*5, 10*-3, 10*5 */
      {sym_mul(ctx, s1, s1), -15, 25}, /* intervals: the two factors vary independently */
      {sym_floordiv(ctx, s0, C(4)), 0, 2},
      {sym_floordiv(ctx, s1, C(2)), -2, 2},
      {sym_mod(ctx, s0, C(4)), 0, 3},
      {sym_mod(ctx, s1, C(4)), 0, 3},
      {sym_mod(ctx, s0, C(64)), 2, 10}, /* 0 <= s0 < 64 so it is s0 */
      {sym_mul(ctx, C(2), s2), 0, INT64_MAX},
      {sym_mul(ctx, s2, s2), 0, INT64_MAX},
      {sym_sub(ctx, C(-5), s2), INT64_MIN, -5},
      {sym_mul(ctx, s3, s3), INT64_MIN, INT64_MAX},
      {sym_add(ctx, s3, C(1)), INT64_MIN + 1, INT64_MAX},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int64_t lo, hi;
    ck_assert_msg(!sym_is_err(cases[i].d), "case %zu: %s", i, sym_ctx_error(ctx));
    sym_bounds(cases[i].d, &lo, &hi);
    ck_assert_msg(lo == cases[i].lo && hi == cases[i].hi, "case %zu (%s): [%lld, %lld], expected [%lld, %lld]", i,
                  S(cases[i].d), (long long)lo, (long long)hi, (long long)cases[i].lo, (long long)cases[i].hi);
  }
  int64_t lo, hi;
  sym_bounds(sym_error(), &lo, &hi);
  ck_assert(lo == INT64_MIN && hi == INT64_MAX);
}
END_TEST

static int64_t ev(sym_dim d, const int64_t *vals, int n)
{
  int64_t v;
  ck_assert_msg(sym_eval(d, vals, n, &v) == 0, "eval of %s failed", S(d));
  return v;
}

START_TEST(test_eval)
{
  V(0, 0, 100), V(1, 0, 100), V(2, 0, INT64_MAX), V(5, 1, 64);
  int64_t vals[6] = {5, 7, 0, 0, 0, 3};
  ck_assert_int_eq(27, ev(P("2*s0 + 3*s1 - 4"), vals, 6)); /* 10 + 21 - 4 */
  ck_assert_int_eq(8, ev(P("s0*s1 // 4"), vals, 6));       /* 35 // 4 */
  ck_assert_int_eq(3, ev(P("s0*s1 % 4"), vals, 6));
  ck_assert_int_eq(-1, ev(P("(s0 - 7) // 3"), vals, 6)); /* floor(-2/3) */
  ck_assert_int_eq(1, ev(P("(s0 - 7) % 3"), vals, 6));   /* -2 mod 3 */
  ck_assert_int_eq(1, ev(P("s0 // s5"), vals, 6));
  ck_assert_int_eq(2, ev(P("s0 % s5"), vals, 6));
  ck_assert_int_eq(-7, ev(C(-7), NULL, 0));
  int64_t v;
  /* a missing symbol, a value out of bounds */
  ck_assert_int_eq(-1, sym_eval(P("s0 + s1"), vals, 1, &v));
  ck_assert_int_eq(-1, sym_eval(P("s0"), NULL, 0, &v));
  int64_t out_of_bounds[2] = {101, 0};
  ck_assert_int_eq(-1, sym_eval(P("s0"), out_of_bounds, 2, &v));
  /* overflow: (2^32)^2, INT64_MAX + 1; INT64_MAX - 1 + 1 is fine */
  int64_t big[3] = {0, 0, (int64_t)1 << 32};
  ck_assert_int_eq(-1, sym_eval(P("s2*s2"), big, 3, &v));
  ck_assert_int_eq(-1, sym_eval(P("3*s2*s2 + 1"), big, 3, &v));
  big[2] = INT64_MAX;
  ck_assert_int_eq(-1, sym_eval(P("s2 + 1"), big, 3, &v));
  ck_assert_int_eq(-1, sym_eval(P("2*s2"), big, 3, &v));
  big[2] = INT64_MAX - 1;
  ck_assert_int_eq(INT64_MAX, ev(P("s2 + 1"), big, 3));
  ck_assert_int_eq(-1, sym_eval(sym_error(), vals, 6, &v));
}
END_TEST

START_TEST(test_print)
{
  sym_dim s0 = V(0, 0, 100), s1 = V(1, 0, 100);
  ASSERT_TEXT("s0", s0);
  ASSERT_TEXT("-5", C(-5));
  ASSERT_TEXT("2*s0 + 3", sym_add(ctx, sym_mul(ctx, C(2), s0), C(3)));
  ASSERT_TEXT("s0*s1", sym_mul(ctx, s1, s0));
  ASSERT_TEXT("(s0*s1)//4", sym_floordiv(ctx, sym_mul(ctx, s0, s1), C(4)));
  ASSERT_TEXT("s0 % 4", sym_mod(ctx, s0, C(4)));
  ASSERT_TEXT("s0 - 2*s1 - 3", sym_sub(ctx, sym_sub(ctx, s0, sym_mul(ctx, C(2), s1)), C(3)));
  ASSERT_TEXT("-s0 + 1", sym_sub(ctx, C(1), s0));
  ASSERT_TEXT("2*(s0//4)", sym_mul(ctx, C(2), sym_floordiv(ctx, s0, C(4))));
  sym_dim p1 = sym_add(ctx, s0, C(1));
  ASSERT_TEXT("s0*s0 + 2*s0 + 1", sym_mul(ctx, p1, p1));
  ASSERT_TEXT("s1 + s0//4", sym_add(ctx, sym_floordiv(ctx, s0, C(4)), s1));
  /* snprintf contract: the needed length, a truncated NUL-terminated text */
  char small[4];
  ck_assert_int_eq(8, sym_print(sym_add(ctx, sym_mul(ctx, C(2), s0), C(3)), small, sizeof small));
  ck_assert_str_eq("2*s", small);
  ck_assert_int_eq(8, sym_print(sym_add(ctx, sym_mul(ctx, C(2), s0), C(3)), NULL, 0));
  ck_assert_int_eq(-1, sym_print(sym_error(), small, sizeof small));
}
END_TEST

START_TEST(test_parse_roundtrip)
{
  V(0, 0, 1000), V(1, 2, 64), V(2, 0, 1000);
  static const char *const cases[][2] = {
      {"s0", "s0"},
      {"s1 + s0", "s0 + s1"},
      {"3 + 2*s0", "2*s0 + 3"},
      {"s1*s0", "s0*s1"},
      {"(s0*s1)//4", "(s0*s1)//4"},
      {"s0*s1 // 4", "(s0*s1)//4"},
      {"s0 % 4", "s0 % 4"},
      {"s0*s1 % 4", "(s0*s1) % 4"},
      {"2*s0 - s0", "s0"},
      {"-(s0 - 3)", "-s0 + 3"},
      {"(s0 + 1)*(s0 - 1)", "s0*s0 - 1"},
      {"s0 % 3 + 2*(s0//4)", "2*(s0//4) + s0 % 3"},
      {"s0 % 3 - s0//4", "-(s0//4) + s0 % 3"},
      {"s0//2//3", "s0//6"},
      {"(s0 + 5)//4", "(s0 + 1)//4 + 1"},
      {"(s0 % 4)*(s2 % 4)", "(s0 % 4)*(s2 % 4)"},
      {"s2 // s1", "s2//s1"},
      {"(s0 + 1) // (s1 + 1)", "(s0 + 1)//(s1 + 1)"},
      {"7 % s1", "7 % s1"},
      {"-7 // s1", "(-7)//s1"},
      {"-9223372036854775808", "-9223372036854775808"},
      {"9223372036854775807", "9223372036854775807"},
      {"s0 - 9223372036854775807 - 1", "s0 + -9223372036854775808"},
      {"-9223372036854775808*s0 + s2", "-9223372036854775808*s0 + s2"},
      {"s0 - 9223372036854775807*s2 - s2", "s0 + -9223372036854775808*s2"},
      {"  s0 +\t2 ", "s0 + 2"},
      {"--s0", "s0"},
      {"s3", "s3"}, /* declared on first sight */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    sym_dim d = P(cases[i][0]);
    const char *text = S(d);
    ck_assert_msg(strcmp(cases[i][1], text) == 0, "'%s' printed '%s', expected '%s'", cases[i][0], text,
                  cases[i][1]);
    sym_dim back = P(text);
    ck_assert_msg(sym_same(d, back), "'%s' read back as '%s'", text, S(back));
  }
  /* an undeclared symbol gets the default bounds */
  int64_t lo, hi;
  sym_bounds(P("s3"), &lo, &hi);
  ck_assert(lo == SYM_DEFAULT_LO && hi == SYM_DEFAULT_HI);
  /* end: stops where the expression stops */
  sym_dim d;
  const char *end;
  ck_assert_int_eq(0, sym_parse(ctx, "s0 + 1, rest", &d, &end, errbuf, sizeof errbuf));
  ck_assert_str_eq(", rest", end);
  ASSERT_TEXT("s0 + 1", d);
}
END_TEST

START_TEST(test_parse_errors)
{
  V(0, 0, 100);
  static const char *const cases[][2] = {
      {"", "col 1: unexpected end of input"},
      {"s", "col 2: expected a symbol number after 's'"},
      {"2*", "col 3: unexpected end of input"},
      {"s0 +", "col 5: unexpected end of input"},
      {"((s0)", "col 6: expected ')'"},
      {"s0)", "col 3: unexpected ')'"},
      {"s0 // 0", "col 4: divisor not provably positive"},
      {"s0 % (s0 - s0)", "col 4: divisor not provably positive"},
      {"99999999999999999999", "col 1: number out of range"},
      {"9223372036854775808", "col 1: number out of range"},
      {"s0 + 9223372036854775808", "col 6: number out of range"},
      {"-9223372036854775809", "col 2: number out of range"},
      {"9223372036854775807 + 1", "col 21: integer overflow"},
      {"-(-9223372036854775808)", "col 1: integer overflow"},
      {"s0 s0", "col 4: unexpected 's'"},
      {"s0 / 2", "col 4: expected '//'"},
      {"s0 + #", "col 6: unexpected '#'"},
      {"\x01", "col 1: unexpected byte 0x01"},
      {"s99999999999", "col 1: symbol id out of range"},
      {"s0 ** 2", "col 5: unexpected '*'"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    sym_dim d = C(123);
    int rc = sym_parse(ctx, cases[i][0], &d, NULL, errbuf, sizeof errbuf);
    ck_assert_msg(rc == -1, "'%s' parsed", cases[i][0]);
    ck_assert(sym_is_err(d));
    ck_assert_msg(strcmp(cases[i][1], errbuf) == 0, "'%s': got '%s', expected '%s'", cases[i][0], errbuf,
                  cases[i][1]);
  }
  /* deep nesting is refused, not a stack overflow */
  char deep[1200];
  memset(deep, '(', 600);
  strcpy(deep + 600, "s0");
  memset(deep + 602, ')', 597);
  deep[1199] = '\0';
  sym_dim d;
  ck_assert_int_eq(-1, sym_parse(ctx, deep, &d, NULL, errbuf, sizeof errbuf));
  ck_assert_str_eq("col 201: nested too deeply", errbuf);
  memset(deep, '-', 600);
  strcpy(deep + 600, "s0");
  ck_assert_int_eq(-1, sym_parse(ctx, deep, &d, NULL, errbuf, sizeof errbuf));
  ck_assert_str_eq("col 201: nested too deeply", errbuf);
  /* a short error buffer is still terminated */
  char tiny[6];
  ck_assert_int_eq(-1, sym_parse(ctx, "s0 +", &d, NULL, tiny, sizeof tiny));
  ck_assert_str_eq("col 5", tiny);
  ck_assert_int_eq(-1, sym_parse(ctx, "s0 +", &d, NULL, NULL, 0));
}
END_TEST

START_TEST(test_vars)
{
  sym_dim s0 = V(0, 2, 100);
  ck_assert_ptr_eq(s0.e, sym_var(ctx, 0, 2, 100).e);
  ck_assert(sym_is_err(sym_var(ctx, 0, 0, 100)));
  ck_assert_str_eq("symbol declared again with other bounds", sym_ctx_error(ctx));
  ck_assert(sym_is_err(sym_var(ctx, 1, 5, 4)));
  ck_assert(sym_is_err(sym_var(ctx, -1, 0, 4)));
  ck_assert(sym_is_err(sym_var(ctx, SYM_MAX_ID, 0, 4)));
  ck_assert_ptr_eq(s0.e, P("s0").e);
}
END_TEST

START_TEST(test_errors_propagate)
{
  sym_dim s0 = V(0, 0, 100), s1 = V(1, 0, 100), e = sym_error();
  ck_assert(sym_is_err(sym_add(ctx, e, s0)));
  ck_assert(sym_is_err(sym_sub(ctx, s0, e)));
  ck_assert(sym_is_err(sym_mul(ctx, e, C(2))));
  ck_assert(sym_is_err(sym_floordiv(ctx, e, C(2))));
  ck_assert(sym_is_err(sym_mod(ctx, s0, e)));
  ck_assert(!sym_same(e, e));
  /* coefficient and constant overflow */
  ck_assert(sym_is_err(sym_mul(ctx, C(INT64_MAX), C(2))));
  ck_assert_str_eq("integer overflow", sym_ctx_error(ctx));
  sym_dim big = sym_mul(ctx, C(INT64_MAX), s0);
  ck_assert(!sym_is_err(big));
  ck_assert(sym_is_err(sym_mul(ctx, big, C(2))));
  ck_assert(sym_is_err(sym_add(ctx, big, s0)));
  ck_assert(sym_is_err(sym_sub(ctx, C(0), sym_mul(ctx, C(INT64_MIN), s0))));
  ck_assert(sym_is_err(sym_add(ctx, sym_add(ctx, s0, C(INT64_MAX)), C(1))));
  /* too many terms */
  sym_dim sum = C(0);
  for (int i = 0; i < SYM_MAX_TERMS; i++) sum = sym_add(ctx, sum, sym_var(ctx, 10 + i, 0, 9));
  ck_assert(!sym_is_err(sum));
  ck_assert(sym_is_err(sym_add(ctx, sum, sym_var(ctx, 10 + SYM_MAX_TERMS, 0, 9))));
  ck_assert_str_eq("expression too large", sym_ctx_error(ctx));
  /* too deep: each step nests one mod in a product in a sum */
  sym_dim x = s0;
  int steps = 0;
  while (!sym_is_err(x) && steps < 100) {
    x = sym_mod(ctx, sym_add(ctx, sym_mul(ctx, x, s1), C(1)), C(7));
    steps++;
  }
  ck_assert(sym_is_err(x));
  ck_assert_str_eq("expression nested too deeply", sym_ctx_error(ctx));
  ck_assert_int_gt(steps, 5);
}
END_TEST

static sym_guard G(sym_cmp op, sym_dim a, sym_dim b) { return (sym_guard){op, a, b}; }

START_TEST(test_guards)
{
  sym_dim s0 = V(0, 0, 100), s1 = V(1, 2, 100), s2 = V(2, 0, 100);
  struct {
    sym_guard g;
    const char *text;
  } cases[] = {
      {G(SYM_NE, s0, C(1)), "s0 != 1"},
      {G(SYM_EQ, s0, s2), "s0 == s2"},
      {G(SYM_GE, s0, C(2)), "s0 >= 2"},
      {G(SYM_LT, sym_mul(ctx, C(2), s0), sym_add(ctx, s1, C(3))), "2*s0 < s1 + 3"},
      {G(SYM_LE, s0, s1), "s0 <= s1"},
      {G(SYM_GT, s0, C(-1)), "s0 > -1"},
      {G(SYM_DIVIDES, sym_mul(ctx, s0, s1), C(4)), "s0*s1 % 4 == 0"},
      {G(SYM_DIVIDES, sym_add(ctx, s0, C(1)), C(4)), "(s0 + 1) % 4 == 0"},
      {G(SYM_DIVIDES, s0, s1), "s0 % s1 == 0"},
      {G(SYM_DIVIDES, sym_mul(ctx, C(-2), s0), C(3)), "-2*s0 % 3 == 0"},
      {G(SYM_DIVIDES, sym_mod(ctx, s0, C(6)), C(4)), "s0 % 6 % 4 == 0"},
      {G(SYM_EQ, sym_mod(ctx, s0, C(4)), C(0)), "(s0 % 4) == 0"},
      {G(SYM_NE, sym_mod(ctx, s0, C(4)), C(0)), "s0 % 4 != 0"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char buf[128];
    ck_assert_int_eq((int)strlen(cases[i].text), sym_guard_print(&cases[i].g, buf, sizeof buf));
    ck_assert_str_eq(cases[i].text, buf);
    sym_guard back;
    ck_assert_msg(0 == sym_guard_parse(ctx, buf, &back, NULL, errbuf, sizeof errbuf), "%s: %s", buf, errbuf);
    ck_assert_msg(back.op == cases[i].g.op && sym_same(back.lhs, cases[i].g.lhs) && sym_same(back.rhs, cases[i].g.rhs),
                  "'%s' read back differently (op %d)", buf, (int)back.op);
  }
  /* checking: s0 = 3, s1 = 4, s2 = 3 */
  int64_t vals[3] = {3, 4, 3};
  ck_assert_int_eq(1, sym_guard_check(&cases[0].g, vals, 3));
  ck_assert_int_eq(1, sym_guard_check(&cases[1].g, vals, 3));
  ck_assert_int_eq(1, sym_guard_check(&cases[2].g, vals, 3));
  ck_assert_int_eq(1, sym_guard_check(&cases[3].g, vals, 3)); /* 6 < 7 */
  vals[0] = 4;
  ck_assert_int_eq(0, sym_guard_check(&cases[3].g, vals, 3)); /* 8 < 7 */
  vals[0] = 3;
  ck_assert_int_eq(1, sym_guard_check(&cases[6].g, vals, 3)); /* 12 % 4 == 0 */
  vals[1] = 5;
  ck_assert_int_eq(0, sym_guard_check(&cases[6].g, vals, 3)); /* 15 % 4 == 3 */
  ck_assert_int_eq(1, sym_guard_check(&cases[7].g, vals, 3)); /* (3 + 1) % 4 == 0 */
  vals[0] = 4;
  ck_assert_int_eq(0, sym_guard_check(&cases[7].g, vals, 3)); /* 5 % 4 == 1 */
  ck_assert_int_eq(-1, sym_guard_check(&cases[1].g, vals, 2)); /* s2 missing */
  sym_guard bad = G(SYM_DIVIDES, s0, C(0));
  ck_assert_int_eq(-1, sym_guard_check(&bad, vals, 3));
  /* reading: the top-level % decides between a divisibility and a comparison */
  sym_guard g;
  ck_assert_int_eq(0, sym_guard_parse(ctx, "(s0*s1 % 4) == 0", &g, NULL, errbuf, sizeof errbuf));
  ck_assert_int_eq(SYM_EQ, g.op);
  ck_assert_int_eq(0, sym_guard_parse(ctx, "s0 % 4 + 1 == 0", &g, NULL, errbuf, sizeof errbuf));
  ck_assert_int_eq(SYM_EQ, g.op);
  ck_assert_int_eq(0, sym_guard_parse(ctx, "s0 % 4 == 1", &g, NULL, errbuf, sizeof errbuf));
  ck_assert_int_eq(SYM_EQ, g.op);
  ck_assert_int_eq(0, sym_guard_parse(ctx, "s1*s0 % 4 == 0", &g, NULL, errbuf, sizeof errbuf));
  ck_assert_int_eq(SYM_DIVIDES, g.op);
  ck_assert_ptr_eq(sym_mul(ctx, s0, s1).e, g.lhs.e);
  const char *end;
  ck_assert_int_eq(0, sym_guard_parse(ctx, "s0 >= 2; next", &g, &end, errbuf, sizeof errbuf));
  ck_assert_str_eq("; next", end);
  /* errors */
  static const char *const bad_text[][2] = {
      {"s0", "col 3: expected a comparison (==, !=, <, <=, >=, >)"},
      {"s0 = 1", "col 4: expected a comparison (==, !=, <, <=, >=, >)"},
      {"s0 <= ", "col 7: unexpected end of input"},
      {"s0 < 1 < 2", "col 8: unexpected '<'"},
      {"== 1", "col 1: unexpected '='"},
  };
  for (size_t i = 0; i < sizeof bad_text / sizeof bad_text[0]; i++) {
    ck_assert_int_eq(-1, sym_guard_parse(ctx, bad_text[i][0], &g, NULL, errbuf, sizeof errbuf));
    ck_assert_msg(strcmp(bad_text[i][1], errbuf) == 0, "'%s': got '%s'", bad_text[i][0], errbuf);
  }
  bad = G(SYM_EQ, sym_error(), C(0));
  char buf[16];
  ck_assert_int_eq(-1, sym_guard_print(&bad, buf, sizeof buf));
}
END_TEST

/* Runs one decision and checks (rc, result, needs_guard). */
static void decide(sym_dim a, sym_cmp op, sym_dim b, const int64_t *vals, int n, int want_rc, bool want, bool want_guard)
{
  bool r = !want, g = !want_guard;
  int rc = sym_decide(a, op, b, vals, n, &r, &g);
  ck_assert_msg(rc == want_rc, "%s op%d %s: rc %d", S(a), (int)op, S(b), rc);
  if (rc == 0)
    ck_assert_msg(r == want && g == want_guard, "%s op%d %s: result %d guard %d, expected %d %d", S(a), (int)op, S(b),
                  r, g, want, want_guard);
}

START_TEST(test_decide)
{
  sym_dim s0 = V(0, 2, 100), s1 = V(1, 0, 100), s2 = V(2, 1, 3);
  int64_t vals[3] = {5, 1, 2};
  /* proved by bounds: no guard */
  decide(s0, SYM_NE, C(1), vals, 3, 0, true, false);
  decide(s0, SYM_EQ, C(1), vals, 3, 0, false, false);
  decide(s0, SYM_GE, C(2), vals, 3, 0, true, false);
  decide(s0, SYM_LT, C(2), vals, 3, 0, false, false);
  decide(sym_add(ctx, s0, C(1)), SYM_GT, s0, vals, 3, 0, true, false);
  decide(s0, SYM_EQ, s0, vals, 3, 0, true, false);
  decide(sym_mul(ctx, C(2), s0), SYM_GE, s0, vals, 3, 0, true, false);
  decide(sym_mul(ctx, C(2), s0), SYM_LE, s0, vals, 3, 0, false, false);
  decide(C(3), SYM_LT, C(4), NULL, 0, 0, true, false);
  decide(C(6), SYM_DIVIDES, C(4), NULL, 0, 0, false, false);
  decide(sym_mul(ctx, C(4), s0), SYM_DIVIDES, C(2), vals, 3, 0, true, false);
  decide(sym_mul(ctx, s0, s2), SYM_DIVIDES, s2, vals, 3, 0, true, false);
  decide(s2, SYM_DIVIDES, C(4), vals, 3, 0, false, false); /* 0 < s2 < 4 */
  /* not provable: the traced values answer and a guard is needed */
  decide(s1, SYM_EQ, C(1), vals, 3, 0, true, true);
  decide(s1, SYM_NE, C(1), vals, 3, 0, false, true);
  decide(s0, SYM_LT, s1, vals, 3, 0, false, true);
  decide(s0, SYM_EQ, s1, vals, 3, 0, false, true);
  decide(s0, SYM_DIVIDES, C(4), vals, 3, 0, false, true); /* 5 % 4 */
  decide(s0, SYM_DIVIDES, C(5), vals, 3, 0, true, true);
  int64_t other[3] = {5, 3, 2};
  decide(s1, SYM_EQ, C(1), other, 3, 0, false, true);
  /* not provable and not evaluable */
  decide(s1, SYM_EQ, C(1), NULL, 0, -1, false, false);
  decide(sym_error(), SYM_EQ, C(1), vals, 3, -1, false, false);
}
END_TEST

/* ---- random expressions against an evaluator of the text ---------------- */

static uint64_t rng_state;
static uint64_t rnd(void)
{
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return rng_state >> 33;
}

/* Appends to the text being generated (always NUL-terminated). */
typedef struct gbuf {
  char *p, *end;
} gbuf;

static void put(gbuf *g, const char *s)
{
  size_t n = strlen(s), room = (size_t)(g->end - g->p) - 1;
  if (n > room) n = room;
  memcpy(g->p, s, n);
  g->p += n;
  *g->p = '\0';
}

static void put_int(gbuf *g, int v)
{
  char t[16];
  snprintf(t, sizeof t, "%d", v);
  put(g, t);
}

/* Text of a random expression over s0 [0,20], s1 [2,9], s2 [-5,5]; divisors
 * are constants 1..9 or s1, so every one is positive. Fully parenthesized. */
static void gen(gbuf *g, int depth)
{
  static const char *const binop[] = {" + ", " - ", " * "};
  int k = depth <= 0 ? (int)(rnd() % 2) : (int)(rnd() % 8);
  switch (k) {
  case 0:
    put(g, (const char *[]){"s0", "s1", "s2"}[rnd() % 3]);
    break;
  case 1:
    put_int(g, (int)(rnd() % 13) - 6);
    break;
  case 2:
  case 3:
  case 4:
    put(g, "(");
    gen(g, depth - 1);
    put(g, binop[k - 2]);
    gen(g, depth - 1);
    put(g, ")");
    break;
  case 5:
  case 6:
    put(g, "(");
    gen(g, depth - 1);
    put(g, k == 5 ? " // " : " % ");
    if (rnd() % 3 == 0) put(g, "s1");
    else put_int(g, 1 + (int)(rnd() % 9));
    put(g, ")");
    break;
  default:
    put(g, "-");
    gen(g, depth - 1);
    break;
  }
}

/* Evaluates the generated text directly (fully parenthesized, so a tiny
 * grammar), in 128-bit integers with floor semantics. */
static __int128 ref_eval(const char **p, const int64_t *vals)
{
  const char *s = *p;
  __int128 v;
  if (*s == '-') {
    *p = s + 1;
    return -ref_eval(p, vals);
  }
  if (*s == 's') {
    *p = s + 2;
    return vals[s[1] - '0'];
  }
  if (*s >= '0' && *s <= '9') {
    v = 0;
    while (*s >= '0' && *s <= '9') v = v * 10 + (*s++ - '0');
    *p = s;
    return v;
  }
  /* '(' a op b ')' */
  *p = s + 1;
  __int128 a = ref_eval(p, vals);
  s = *p + 1; /* the blank */
  char op = *s;
  s += op == '/' ? 3 : 2;
  *p = s;
  __int128 b = ref_eval(p, vals);
  (*p)++; /* ')' */
  switch (op) {
  case '+': return a + b;
  case '-': return a - b;
  case '*': return a * b;
  case '/': v = a / b; return (a % b != 0 && (a < 0) != (b < 0)) ? v - 1 : v;
  default: v = a % b; return v != 0 && (v < 0) != (b < 0) ? v + b : v;
  }
}

START_TEST(test_random_against_text)
{
  V(0, 0, 20), V(1, 2, 9), V(2, -5, 5);
  rng_state = 12345;
  char text[2048], out[8192];
  int checked = 0;
  for (int it = 0; it < 3000; it++) {
    gbuf g = {text, text + sizeof text};
    text[0] = '\0';
    gen(&g, 1 + (int)(rnd() % 3)); /* |value| <= 20^8: no overflow */
    sym_dim d;
    if (sym_parse(ctx, text, &d, NULL, errbuf, sizeof errbuf)) {
      /* only the size limits may refuse these */
      CHECK(strstr(errbuf, "too large") || strstr(errbuf, "too deeply"), "'%s': %s", text, errbuf);
      continue;
    }
    int n = sym_print(d, out, sizeof out);
    CHECK(n >= 0 && (size_t)n < sizeof out, "'%s' did not print", text);
    sym_dim back;
    CHECK(0 == sym_parse(ctx, out, &back, NULL, errbuf, sizeof errbuf), "'%s' -> '%s': %s", text, out, errbuf);
    CHECK(sym_same(d, back), "'%s' -> '%s' read back differently", text, out);
    int64_t lo, hi;
    sym_bounds(d, &lo, &hi);
    for (int t = 0; t < 8; t++) {
      int64_t vals[3] = {(int64_t)(rnd() % 21), 2 + (int64_t)(rnd() % 8), (int64_t)(rnd() % 11) - 5};
      const char *p = text;
      __int128 want = ref_eval(&p, vals);
      int64_t got;
      CHECK(0 == sym_eval(d, vals, 3, &got), "'%s' did not evaluate", text);
      CHECK(want == got, "'%s' = '%s' at (%lld,%lld,%lld): %lld, expected %lld", text, out,
                    (long long)vals[0], (long long)vals[1], (long long)vals[2], (long long)got, (long long)want);
      CHECK(lo <= got && got <= hi, "'%s' = %lld outside its bounds [%lld, %lld]", out, (long long)got,
                    (long long)lo, (long long)hi);
      checked++;
    }
  }
  ck_assert_int_gt(checked, 20000);
}
END_TEST

/* Random bytes from the grammar's alphabet: never a crash, and whatever
 * parses prints and reads back to the same dim. */
START_TEST(test_garbage)
{
  static const char alphabet[] = "s0123456789+-*/%()  =<>!\t#";
  rng_state = 777;
  char text[64], out[4096];
  for (int it = 0; it < 20000; it++) {
    int n = (int)(rnd() % 40);
    for (int i = 0; i < n; i++) text[i] = alphabet[rnd() % (sizeof alphabet - 1)];
    text[n] = '\0';
    sym_dim d;
    if (sym_parse(ctx, text, &d, NULL, errbuf, sizeof errbuf) == 0) {
      int len = sym_print(d, out, sizeof out);
      CHECK(len >= 0 && (size_t)len < sizeof out, "'%s' did not print", text);
      sym_dim back;
      CHECK(0 == sym_parse(ctx, out, &back, NULL, errbuf, sizeof errbuf), "'%s' -> '%s': %s", text, out, errbuf);
      CHECK(sym_same(d, back), "'%s' -> '%s'", text, out);
    } else {
      CHECK(strncmp(errbuf, "col ", 4) == 0, "'%s': '%s'", text, errbuf);
    }
    sym_guard g;
    if (sym_guard_parse(ctx, text, &g, NULL, errbuf, sizeof errbuf) == 0) {
      CHECK(sym_guard_print(&g, out, sizeof out) >= 0, "guard '%s' did not print", text);
      sym_guard back;
      CHECK(0 == sym_guard_parse(ctx, out, &back, NULL, errbuf, sizeof errbuf), "'%s' -> '%s'", text, out);
      CHECK(back.op == g.op && sym_same(back.lhs, g.lhs) && sym_same(back.rhs, g.rhs), "guard '%s' -> '%s'", text, out);
    }
  }
}
END_TEST

#ifdef KILN_TEST_BUILD
/* Every allocation failure gives an error, never a crash or a leak. */
START_TEST(test_out_of_memory)
{
  const char *text = "(s0 + s1)*(s0 - 2)//3 + s2 % 5 + s0*s1*s2";
  char want[256];
  sym_ctx *ok = sym_ctx_new();
  sym_dim d;
  ck_assert_int_eq(0, sym_parse(ok, text, &d, NULL, errbuf, sizeof errbuf));
  sym_print(d, want, sizeof want);
  sym_ctx_free(ok);
  int failed = 0;
  for (int n = 1; n < 200; n++) {
    alloc_fail_after(n);
    sym_ctx *c = sym_ctx_new();
    if (c) {
      char got[256];
      if (sym_parse(c, text, &d, NULL, errbuf, sizeof errbuf) == 0) {
        sym_print(d, got, sizeof got);
        ck_assert_str_eq(want, got);
      } else {
        ck_assert_msg(strstr(errbuf, "out of memory"), "n=%d: %s", n, errbuf);
        failed++;
      }
    }
    alloc_fail_after(0);
    sym_ctx_free(c);
  }
  ck_assert_int_gt(failed, 3);
}
END_TEST
#endif

/* Eager's shape rule takes int64 shortcuts for pointwise, matmul, permute,
 * the reductions, reshape, expand and slice: over random shapes and
 * attributes (bad ones included) each
 * must give what the general rule over constant dims gives, error or not. */
static int lcg(unsigned *seed)
{
  *seed = *seed * 1103515245u + 12345u;
  return (int)(*seed >> 16 & 0x7fff);
}

static void rand_shape(int nd, int64_t *sh, unsigned *seed)
{
  for (int i = 0; i < nd; i++) sh[i] = lcg(seed) % 4 == 0 ? 1 : lcg(seed) % 5; /* 0 sizes too */
}

START_TEST(test_shape_rule_const)
{
  static const op_id ops[] = {OP_ADD, OP_MUL,     OP_MATMUL, OP_PERMUTE, OP_SUM,   OP_MAX,
                              OP_ARGMAX, OP_MEAN, OP_RELU, OP_RESHAPE, OP_EXPAND, OP_SLICE};
  dim_env env = {NULL, NULL};
  unsigned seed = 18;
  int ok = 0, bad = 0;
  for (int iter = 0; iter < 20000; iter++) {
    op_id op = ops[lcg(&seed) % (sizeof ops / sizeof ops[0])];
    int n = op_table[op].arity;
    kiln_tensor *in[2] = {0};
    shape_arg args[2];
    for (int i = 0; i < n; i++) {
      int nd = lcg(&seed) % 5;
      int64_t sh[MAXD];
      rand_shape(nd, sh, &seed);
      if (i == 1 && op == OP_MATMUL && nd >= 1 && in[0]->ndim >= 1 && lcg(&seed) % 3) /* mostly matching k */
        sh[nd == 1 ? 0 : nd - 2] = in[0]->shape[in[0]->ndim - 1];
      if (i == 1 && op != OP_MATMUL && lcg(&seed) % 2) { /* mostly broadcastable */
        nd = in[0]->ndim;
        for (int d = 0; d < nd; d++) sh[d] = lcg(&seed) % 3 ? in[0]->shape[d] : 1;
      }
      in[i] = tensor_new_meta(lcg(&seed) % 8 ? KILN_F32 : KILN_I64, nd, sh);
      args[i].dtype = in[i]->dtype;
      args[i].ndim = nd;
      for (int d = 0; d < nd; d++) args[i].shape[d] = C(sh[d]);
    }
    op_attrs a = {0};
    int nd0 = in[0]->ndim;
    for (int d = 0; d < nd0; d++) a.perm[d] = d;
    for (int d = nd0 - 1; d > 0; d--) {
      int j = lcg(&seed) % (d + 1), t = a.perm[d];
      a.perm[d] = a.perm[j], a.perm[j] = t;
    }
    if (nd0 && lcg(&seed) % 6 == 0) a.perm[lcg(&seed) % nd0] = lcg(&seed) % (nd0 + 2) - 1; /* not a permutation */
    for (int d = 0; d < nd0 + 1; d++)
      if (lcg(&seed) % 2) a.axes[a.naxes++] = d; /* nd0 itself: out of range but for a 0-d input */
    if (lcg(&seed) % 8 == 0 && a.naxes) a.axes[0] = -1;
    a.keepdim = lcg(&seed) % 2;
    /* reshape and expand: a shape of the input's elements, or one a little off, or with a size 1 stretched */
    a.ndim = lcg(&seed) % 5;
    int64_t left = 1;
    for (int d = 0; d < nd0; d++) left *= in[0]->shape[d];
    for (int d = 0; d < a.ndim; d++) {
      int64_t v = d == a.ndim - 1 ? left : (left && left % 2 == 0 && lcg(&seed) % 2 ? 2 : 1);
      if (op == OP_EXPAND) v = d - (a.ndim - nd0) >= 0 && lcg(&seed) % 3 ? in[0]->shape[d - (a.ndim - nd0)] : lcg(&seed) % 4;
      if (op == OP_RESHAPE && v && left) left /= v;
      a.shape[d] = C(lcg(&seed) % 10 == 0 ? v + 1 : v);
    }
    /* slice: bounds within the dim mostly, sometimes past it or reversed */
    a.dim = nd0 ? lcg(&seed) % (nd0 + 1) : 0;
    int64_t size = a.dim < nd0 ? in[0]->shape[a.dim] : 3;
    a.start = C(lcg(&seed) % (size + 2) - (lcg(&seed) % 10 == 0));
    a.end = C(lcg(&seed) % (size + 2));
    a.step = lcg(&seed) % 4;
    kiln_dtype dt = KILN_BOOL;
    int nd = -1;
    int64_t sh[MAXD];
    int rc = shape_rule(op, in, n, &a, &dt, &nd, sh, "test_sym.c", 1);
    shape_arg out = {0};
    char err[512];
    int want = shape_infer(&env, op, args, n, &a, &out, err, sizeof err);
    ck_assert_msg(rc == want, "%s iter %d: rule %d, general rule %d (%s)", op_table[op].name, iter, rc, want,
                  want ? err : kiln_last_error());
    if (!rc) {
      ck_assert_int_eq(out.dtype, dt);
      ck_assert_int_eq(out.ndim, nd);
      for (int d = 0; d < nd; d++) ck_assert_msg(out.shape[d].c == sh[d], "%s iter %d dim %d: %lld, general rule %lld",
                                                 op_table[op].name, iter, d, (long long)sh[d], (long long)out.shape[d].c);
    }
    rc ? bad++ : ok++;
    for (int i = 0; i < n; i++) kiln_release(in[i]);
  }
  ck_assert_int_gt(ok, 5000); /* both sides seen often */
  ck_assert_int_gt(bad, 2000);
}
END_TEST

static Suite *sym_suite(void)
{
  Suite *s = suite_create("sym");
  TCase *tc = tcase_create("sym");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_canonical_sharing);
  tcase_add_test(tc, test_constant_folding);
  tcase_add_test(tc, test_divmod_rules);
  tcase_add_test(tc, test_divisor_must_be_positive);
  tcase_add_test(tc, test_bounds);
  tcase_add_test(tc, test_eval);
  tcase_add_test(tc, test_print);
  tcase_add_test(tc, test_parse_roundtrip);
  tcase_add_test(tc, test_parse_errors);
  tcase_add_test(tc, test_vars);
  tcase_add_test(tc, test_errors_propagate);
  tcase_add_test(tc, test_guards);
  tcase_add_test(tc, test_decide);
  tcase_add_test(tc, test_random_against_text);
  tcase_add_test(tc, test_garbage);
  tcase_add_test(tc, test_shape_rule_const);
#ifdef KILN_TEST_BUILD
  tcase_add_test(tc, test_out_of_memory);
#endif
  suite_add_tcase(s, tc);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(sym_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
