/* Compiled calls over state that lives between calls: .grads that
 * accumulate or are clipped, params written in place, weights the caller
 * replaces, inputs whose layout changes, saved and loaded graphs, threads,
 * and check mode. Each compared with the same body run eagerly on copies
 * of the same state, or with hand-derived values, on both backends. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"
#include "capture_helpers.h"


/* ---- a .grad handle borrowed before a break and written after it ---- */

typedef struct {
  kiln_tensor *w, *b;
} clip_model;

/* Gradient clipping as a user writes it: the handles taken once, the norm
 * read (a break), then the .grads scaled in place through the handles. */
static int clip_body_keep(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  clip_model *m = ctx;
  out[0] = kiln_sum_all(kiln_add(kiln_mul(in[0], m->w), m->b));
  if (!out[0] || kiln_backward(out[0])) return -1;
  kiln_no_grad_begin();
  kiln_tensor *gw = kiln_grad(m->w), *gb = kiln_grad(m->b);
  double n = kiln_item(kiln_sqrt(kiln_add(kiln_sum_all(kiln_mul(gw, gw)), kiln_sum_all(kiln_mul(gb, gb)))));
  kiln_mul_(gw, kiln_scalar(KILN_F32, 1 / n));
  kiln_mul_(gb, kiln_scalar(KILN_F32, 1 / n));
  kiln_no_grad_end();
  return 0;
}

/* ... then the SGD step with the clipped .grads, which it drops */
static int clip_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  clip_model *m = ctx;
  if (clip_body_keep(ctx, in, out)) return -1;
  kiln_no_grad_begin();
  kiln_sub_(m->w, kiln_grad(m->w));
  kiln_sub_(m->b, kiln_grad(m->b));
  kiln_no_grad_end();
  kiln_zero_grad(m->w), kiln_zero_grad(m->b);
  return 0;
}

/* The borrowed handles were the recording's tensors, which only the
 * recording held once the break restored the .grads: they got no data and
 * were dropped at the break, so the scaling went nowhere and .grad (and the
 * step) kept the unclipped values. Hand-derived: loss = sum(x w + b), so
 * .grad of w is x and of b is 1, both scaled by 1 / |(x, 1)|; at x = 2,
 * 2/sqrt(15) and 1/sqrt(15), and each step takes them off w and b. */

START_TEST(test_grad_handle_written_after_break) {
  for (int be = 0; be < 2; be++)
    for (int cap = 0; cap < 2; cap++) {
      clip_model m = {kiln_ones(KILN_F32, 1, ((int64_t[]){3})), kiln_zeros(KILN_F32, 1, ((int64_t[]){3}))};
      kiln_requires_grad(m.w, true);
      kiln_requires_grad(m.b, true);
      kiln_tensor *x = kiln_full(KILN_F32, 1, ((int64_t[]){3}), 2);
      kiln_options o = {.name = "clip", .n_in = 1, .backend = backends[be], .capture = captures[cap]};
      kiln_fn *fn = kiln_compile(clip_body_keep, &m, &o), *fz = kiln_compile(clip_body, &m, &o);
      for (int i = 0; i < 4; i++) {
        kiln_scope_begin();
        kiln_tensor *y = NULL;
        ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
        float gw[3], gb[3];
        kiln_read(kiln_grad(m.w), gw, sizeof gw);
        kiln_read(kiln_grad(m.b), gb, sizeof gb);
        for (int j = 0; j < 3; j++) {
          ck_assert_msg(fabsf(gw[j] - 2 / sqrtf(15)) < 1e-6f, "be %d cap %d call %d: w.grad %g", be, cap, i, (double)gw[j]);
          ck_assert_msg(fabsf(gb[j] - 1 / sqrtf(15)) < 1e-6f, "be %d cap %d call %d: b.grad %g", be, cap, i, (double)gb[j]);
        }
        kiln_zero_grad(m.w), kiln_zero_grad(m.b);
        kiln_scope_end();
      }
      for (int i = 0; i < 4; i++) {
        kiln_scope_begin();
        kiln_tensor *y = NULL;
        ck_assert_msg(kiln_call(fz, &x, &y) == 0, "%s", kiln_last_error());
        ck_assert_ptr_null(kiln_grad(m.w));
        float w[3], b[3];
        kiln_read(m.w, w, sizeof w);
        kiln_read(m.b, b, sizeof b);
        for (int j = 0; j < 3; j++) {
          ck_assert_msg(fabsf(w[j] - (1 - (float)(i + 1) * 2 / sqrtf(15))) < 1e-5f, "be %d cap %d step %d: w %g", be, cap, i, (double)w[j]);
          ck_assert_msg(fabsf(b[j] + (float)(i + 1) / sqrtf(15)) < 1e-5f, "be %d cap %d step %d: b %g", be, cap, i, (double)b[j]);
        }
        kiln_scope_end();
      }
      kiln_fn_free(fn);
      kiln_fn_free(fz);
      kiln_release(x), kiln_release(m.w), kiln_release(m.b);
    }
}
END_TEST

/* ---- check mode: the params a call reads, not the newest variant's ---- */

typedef struct {
  kiln_tensor *w[2];
  int pick;
} halving;

/* a weight picked by a C flag, read and halved in place */
static int halve_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  halving *m = ctx;
  kiln_tensor *w = m->w[m->pick];
  out[0] = kiln_add(in[0], w);
  kiln_no_grad_begin();
  kiln_mul_(w, kiln_scalar(KILN_F32, 0.5));
  kiln_no_grad_end();
  return out[0] ? 0 : -1;
}

/* Check mode put back only the inputs and the newest variant's params
 * before its eager run. A call that read another weight (the other one of
 * the flag, on the recording path; or the weight, where the variant was
 * traced with it passed as the input) left the compiled write in it: the
 * eager run halved it again and, differing, stood, so the caller got a
 * wrong output, a weight halved twice, and a false report. Hand-derived:
 * y = x + w, then w / 2. */
START_TEST(test_check_mode_params_of_the_call) {
  for (int be = 0; be < 2; be++)
    for (int as_input = 0; as_input < 2; as_input++) {
      float w0[2] = {8, 16}, want[2][2] = {{8, 16}, {8, 16}};
      halving m = {{kiln_tensor_from(KILN_F32, 1, ((int64_t[]){2}), w0), kiln_tensor_from(KILN_F32, 1, ((int64_t[]){2}), w0)}, 0};
      kiln_options o = {.name = "halve", .n_in = 1, .check = 1, .backend = backends[be],
                        .capture = as_input ? KILN_CAPTURE_AUTO : KILN_CAPTURE_RECORD};
      kiln_fn *fn = kiln_compile(halve_body, &m, &o);
      for (int i = 0; i < 6; i++) {
        kiln_scope_begin();
        /* as_input: the same weight, passed as x on the first call and every third */
        m.pick = as_input ? 0 : i % 2;
        bool x_is_w = as_input && i % 3 == 0;
        kiln_tensor *x = x_is_w ? m.w[0] : kiln_ones(KILN_F32, 1, ((int64_t[]){2})), *y = NULL;
        ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
        float got[2], w[2];
        kiln_read(y, got, sizeof got);
        kiln_read(m.w[m.pick], w, sizeof w);
        float *wp = want[m.pick];
        for (int j = 0; j < 2; j++) {
          float yj = (x_is_w ? wp[j] : 1) + wp[j];
          ck_assert_msg(got[j] == yj, "be %d as_input %d call %d: y %g, not %g", be, as_input, i, (double)got[j], (double)yj);
          wp[j] /= 2;
          ck_assert_msg(w[j] == wp[j], "be %d as_input %d call %d: w %g, not %g", be, as_input, i, (double)w[j], (double)wp[j]);
        }
        kiln_scope_end();
      }
      kiln_fn_stats st;
      ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
      ck_assert_int_eq(0, st.check_fails);
      kiln_fn_free(fn);
      kiln_release(m.w[0]), kiln_release(m.w[1]);
    }
}
END_TEST

Suite *capture_state_suite(void);
Suite *capture_state_suite(void) {
  Suite *s = suite_create("capture_state");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_grad_handle_written_after_break);
  tcase_add_test(tc, test_check_mode_params_of_the_call);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *r = srunner_create(capture_state_suite());
  srunner_run_all(r, CK_NORMAL);
  int failed = srunner_ntests_failed(r);
  srunner_free(r);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
