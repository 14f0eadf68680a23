/* Sound compiled calls where eager code decides something from the state of
 * the call that the first recording saw once (a tensor's autograd history,
 * an input's layout),
 * or where the body sets kiln's own state (a seed, the thread count, the
 * autograd mode): a call that skips the body (the guard-only path) must
 * still give the body's eager answer and leave eager's state. Each case
 * compares compiled calls with the same body run eagerly on a twin of the
 * state, on both backends and every capture mode. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"
#include "capture_helpers.h"

static const int all_captures[3] = {KILN_CAPTURE_AUTO, KILN_CAPTURE_RECORD, KILN_CAPTURE_GUARDS};

/* ---- an input with autograd history, after calls with a leaf ---- */

/* A part of a larger model: its input comes from eager ops (history back to
 * u), and the body's backward must reach u, as eagerly. A variant traced
 * with a leaf input took the guard-only path: a later input with history was
 * served as a leaf, its .grad set (a non-leaf's stays NULL) and u's never. */
typedef struct history_model {
  kiln_tensor *w;
} history_model;

static int history_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  history_model *m = ctx;
  kiln_tensor *loss = kiln_sum_all(kiln_tanh(kiln_mul(in[0], m->w)));
  if (!loss || kiln_backward(loss)) return -1;
  kiln_no_grad_begin();
  kiln_sub_(m->w, kiln_mul(in[1], kiln_grad(m->w)));
  kiln_no_grad_end();
  kiln_zero_grad(m->w);
  kiln_zero_grad(in[0]);
  out[0] = loss;
  return 0;
}

START_TEST(test_input_history_after_leaf) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 3; c++) {
      int64_t s[1] = {3};
      history_model m = {kiln_randn(KILN_F32, 1, s, 1)}, e = {kiln_randn(KILN_F32, 1, s, 1)};
      kiln_requires_grad(m.w, true), kiln_requires_grad(e.w, true);
      kiln_tensor *u = kiln_randn(KILN_F32, 1, s, 2), *ue = kiln_randn(KILN_F32, 1, s, 2), *lr = kiln_scalar(KILN_F32, 0.1);
      kiln_requires_grad(u, true), kiln_requires_grad(ue, true);
      kiln_options o = {.name = "history", .n_in = 2, .backend = backends[b], .capture = all_captures[c]};
      kiln_fn *fn = kiln_compile(history_step, &m, &o);
      const int leaf[7] = {1, 1, 1, 0, 0, 1, 0};
      for (int call = 0; call < 7; call++) {
        kiln_zero_grad(u), kiln_zero_grad(ue);
        kiln_scope_begin();
        kiln_tensor *x, *xe;
        if (leaf[call]) {
          x = kiln_randn(KILN_F32, 1, s, 10 + (uint64_t)call), xe = kiln_randn(KILN_F32, 1, s, 10 + (uint64_t)call);
          kiln_requires_grad(x, true), kiln_requires_grad(xe, true);
        } else {
          x = kiln_mul(u, kiln_scalar(KILN_F32, call)), xe = kiln_mul(ue, kiln_scalar(KILN_F32, call));
        }
        kiln_tensor *in[2] = {x, lr}, *ine[2] = {xe, lr}, *y = NULL, *ye = NULL;
        ck_assert_msg(kiln_call(fn, in, &y) == 0, "%s", kiln_last_error());
        ck_assert_int_eq(0, history_step(&e, ine, &ye));
        ck_assert_double_le(max_diff(y, ye), 1e-6);
        ck_assert_double_le(max_diff(m.w, e.w), 1e-6);
        ck_assert_msg((kiln_grad(u) != NULL) == (kiln_grad(ue) != NULL), "backend %d capture %d call %d: u.grad %s, eagerly %s", b, c,
                      call, kiln_grad(u) ? "set" : "NULL", kiln_grad(ue) ? "set" : "NULL");
        if (kiln_grad(ue)) ck_assert_double_le(max_diff(kiln_grad(u), kiln_grad(ue)), 1e-6);
        ck_assert_msg((kiln_grad(x) != NULL) == (kiln_grad(xe) != NULL), "backend %d capture %d call %d: x.grad", b, c, call);
        kiln_scope_end();
      }
      /* the leaf calls still take the guard-only path where the policy gives it */
      if (all_captures[c] != KILN_CAPTURE_RECORD) ck_assert_int_ge(stats(fn).guard_hits, 2);
      kiln_fn_free(fn);
      kiln_release(m.w), kiln_release(e.w), kiln_release(u), kiln_release(ue), kiln_release(lr);
    }
}
END_TEST

/* A weight with history (computed eagerly from u before the calls): the
 * first call's backward frees that history, so eagerly the second fails
 * ("already freed"); served without the body, it ran on. */
typedef struct history_weight {
  kiln_tensor *h;
} history_weight;

static int history_weight_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  history_weight *m = ctx;
  kiln_tensor *loss = kiln_sum_all(kiln_tanh(kiln_mul(in[0], m->h)));
  if (!loss || kiln_backward(loss)) return -1;
  out[0] = loss;
  return 0;
}

START_TEST(test_weight_history_freed) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 3; c++) {
      int64_t s[1] = {3};
      kiln_tensor *u = kiln_randn(KILN_F32, 1, s, 2), *ue = kiln_randn(KILN_F32, 1, s, 2);
      kiln_requires_grad(u, true), kiln_requires_grad(ue, true);
      kiln_scope_begin(); /* the weights alone outlive it */
      history_weight m = {kiln_retain(kiln_mul(u, kiln_scalar(KILN_F32, 3)))}, e = {kiln_retain(kiln_mul(ue, kiln_scalar(KILN_F32, 3)))};
      kiln_scope_end();
      kiln_options o = {.name = "history_weight", .n_in = 1, .backend = backends[b], .capture = all_captures[c]};
      kiln_fn *fn = kiln_compile(history_weight_step, &m, &o);
      for (int call = 0; call < 3; call++) {
        kiln_scope_begin();
        kiln_tensor *x = kiln_randn(KILN_F32, 1, s, 10 + (uint64_t)call), *y = NULL, *ye = NULL;
        kiln_clear_error();
        int rc = kiln_call(fn, &x, &y), rce = history_weight_step(&e, &x, &ye);
        ck_assert_msg(rc == rce, "backend %d capture %d call %d: compiled %d, eagerly %d", b, c, call, rc, rce);
        if (call) ck_assert_msg(strstr(kiln_last_error(), "already freed"), "%s", kiln_last_error());
        ck_assert_double_le(max_diff(kiln_grad(u), kiln_grad(ue)), 1e-6);
        kiln_scope_end();
      }
      kiln_fn_free(fn);
      kiln_release(m.h), kiln_release(e.h), kiln_release(u), kiln_release(ue);
    }
}
END_TEST

/* ---- a body that sets kiln's own state ---- */

/* kiln_manual_seed, kiln_set_num_threads and a no-grad scope left open (or
 * a caller's closed) change kiln's state for what follows the call. Such a
 * body reads nothing and draws nothing, so the guard-only path served later
 * calls without running it: the next draw after the call, the thread count
 * and the autograd mode were not eager's. */
static int sets_state_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  switch (*(const int *)ctx) {
  case 0: kiln_manual_seed(5); break;
  case 1: kiln_set_num_threads(1); break;
  case 2: kiln_no_grad_begin(); break;
  default: kiln_no_grad_end(); break;
  }
  out[0] = kiln_mul(in[0], in[0]);
  return out[0] ? 0 : -1;
}

/* Runs f (the compiled call or the body) from the same state: the generator
 * at (7 + call, a draw in), 2 threads, and for kind 3 inside a no-grad scope;
 * the state after comes back in *draw, *threads and *grad, and the scopes
 * are closed again. */
static int state_after(kiln_fn *fn, int kind, int call, kiln_tensor *x, kiln_tensor **y, kiln_tensor **draw, int *threads,
                       bool *grad) {
  kiln_manual_seed(7 + (uint64_t)call);
  kiln_rand_like(x);
  kiln_set_num_threads(2);
  if (kind == 3) kiln_no_grad_begin();
  int rc = fn ? kiln_call(fn, &x, y) : sets_state_body(&kind, &x, y);
  *draw = kiln_rand_like(x);
  *threads = kiln_get_num_threads();
  *grad = kiln_grad_enabled();
  if (!*grad) kiln_no_grad_end();
  return rc;
}

START_TEST(test_body_sets_kiln_state) {
  for (int kind = 0; kind < 4; kind++)
    for (int b = 0; b < 2; b++)
      for (int c = 0; c < 3; c++) {
        kiln_options o = {.name = "sets_state", .n_in = 1, .backend = backends[b], .capture = all_captures[c]};
        kiln_fn *fn = kiln_compile(sets_state_body, &kind, &o);
        for (int call = 0; call < 3; call++) {
          kiln_scope_begin();
          kiln_tensor *x = kiln_randn(KILN_F32, 1, ((int64_t[]){8}), 1 + (uint64_t)call), *y = NULL, *ye = NULL, *draw, *draw_e;
          int threads, threads_e;
          bool grad, grad_e;
          ck_assert_msg(state_after(fn, kind, call, x, &y, &draw, &threads, &grad) == 0, "%s", kiln_last_error());
          ck_assert_int_eq(0, state_after(NULL, kind, call, x, &ye, &draw_e, &threads_e, &grad_e));
          ck_assert_double_le(max_diff(y, ye), 0);
          ck_assert_msg(max_diff(draw, draw_e) == 0, "kind %d backend %d capture %d call %d: the draw after the call", kind, b, c, call);
          ck_assert_msg(threads == threads_e && grad == grad_e, "kind %d backend %d capture %d call %d: threads %d (eagerly %d), autograd %d (%d)",
                        kind, b, c, call, threads, threads_e, grad, grad_e);
          kiln_scope_end();
        }
        kiln_fn_free(fn);
      }
  kiln_set_num_threads(0);
}
END_TEST

/* ---- a view or a copy, by the input's layout ---- */

/* A reshape of an input (other than an unsqueeze or squeeze) and
 * kiln_contiguous view a contiguous input and copy another one, so a write
 * into the result, or the result handed out, reaches the input only in the
 * first case. KILN_CAPTURE_GUARDS took the guard-only path for these bodies,
 * whose sizes depend on the inputs' shapes alone, and served a call of the
 * other layout with the traced choice: a strided input written where eager
 * writes a copy, or a contiguous one left alone. */
static int layout_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  int kind = *(const int *)ctx;
  kiln_tensor *v = kind == 1 ? kiln_reshape(in[0], 1, ((int64_t[]){-1})) : kiln_contiguous(in[0]);
  if (kind < 2 && !kiln_add_(v, kiln_scalar(KILN_F32, 1))) return -1;
  out[0] = kind < 2 ? kiln_mul(in[0], kiln_scalar(KILN_F32, 2)) : v;
  return out[0] ? 0 : -1;
}

/* A (4,4) input over a base of its own: 0 every other column of a (4,8)
 * one (strided), 1 the whole base (contiguous), 2 the base transposed. */
static kiln_tensor *layout_of(int layout, uint64_t seed, kiln_tensor **base) {
  *base = kiln_randn(KILN_F32, 2, ((int64_t[]){4, layout ? 4 : 8}), seed);
  return layout == 0 ? kiln_slice(*base, 1, 0, 8, 2) : layout == 1 ? *base : kiln_transpose(*base, 0, 1);
}

START_TEST(test_view_or_copy_by_layout) {
  const int layouts[8] = {1, 0, 1, 1, 2, 0, 0, 1};
  for (int kind = 0; kind < 3; kind++)
    for (int b = 0; b < 2; b++)
      for (int c = 0; c < 3; c++) {
        kiln_options o = {.name = "layout", .n_in = 1, .backend = backends[b], .capture = all_captures[c]};
        kiln_fn *fn = kiln_compile(layout_body, &kind, &o);
        for (int call = 0; call < 8; call++) {
          kiln_scope_begin();
          kiln_tensor *base, *base_e, *y = NULL, *ye = NULL;
          kiln_tensor *x = layout_of(layouts[call], 10 + (uint64_t)call, &base), *xe = layout_of(layouts[call], 10 + (uint64_t)call, &base_e);
          ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
          ck_assert_int_eq(0, layout_body(&kind, &xe, &ye));
          ck_assert_msg(max_diff(y, ye) == 0 && max_diff(base, base_e) == 0, "kind %d backend %d capture %d call %d (layout %d): %s differs",
                        kind, b, c, call, layouts[call], max_diff(y, ye) ? "the output" : "the input");
          /* the output reaches the input as eagerly, or does not */
          kiln_no_grad_begin();
          kiln_fill_(y, 7), kiln_fill_(ye, 7);
          kiln_no_grad_end();
          ck_assert_msg(max_diff(base, base_e) == 0, "kind %d backend %d capture %d call %d (layout %d): a write into the output", kind, b, c,
                        call, layouts[call]);
          kiln_scope_end();
        }
        /* calls of the traced layout still skip the body */
        if (all_captures[c] == KILN_CAPTURE_GUARDS) ck_assert_msg(stats(fn).guard_hits >= 3, "kind %d backend %d: %d guard hits", kind, b, (int)stats(fn).guard_hits);
        kiln_fn_free(fn);
      }
}
END_TEST

Suite *capture_recordtime_suite(void);
Suite *capture_recordtime_suite(void) {
  Suite *s = suite_create("capture_recordtime");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_input_history_after_leaf);
  tcase_add_test(tc, test_weight_history_freed);
  tcase_add_test(tc, test_body_sets_kiln_state);
  tcase_add_test(tc, test_view_or_copy_by_layout);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *r = srunner_create(capture_recordtime_suite());
  srunner_run_all(r, CK_NORMAL);
  int failed = srunner_ntests_failed(r);
  srunner_free(r);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
