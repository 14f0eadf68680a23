/* Replayed calls: a call on the recording path whose body follows the log an
 * earlier call left runs the variant without recording (replay.c). Each
 * body here does what that log does not at some call (another branch, a
 * number, a kept tensor, a flag, a data read, more or fewer ops), before,
 * in the middle of, or after the steps the replay checks; each call is
 * compared with the same body run eagerly on the same state, on both
 * backends and both capture modes, and the tests say how many calls were
 * replayed, so that a replay that never happens fails too. */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"
#include "capture_helpers.h"

/* A model whose body reads a size (so that it records under the automatic
 * policy too) and does what the test sets before each call. */
typedef struct {
  kiln_tensor *w, *w2, *b;
  int branch;        /* 0: relu, 1: tanh after the first layer (a C branch in the middle) */
  int layers;        /* how many times the second layer runs */
  double slope;      /* a float number of an op */
  int64_t at;        /* an integer number of an op (a slice position) */
  bool keep;         /* store the hidden value in the model */
  bool mark;         /* mark the hidden value requires_grad */
  bool read;         /* read a value of the hidden layer */
  bool swap;         /* use w2 in place of w */
  bool wire;         /* the same ops, one of them over another value */
  bool keep_view;    /* store a view of the output in the model */
  bool out_mid;      /* return a value made in the middle */
  kiln_tensor *kept; /* what keep stored */
  double seen;       /* what read read */
} model;

static int model_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  int64_t batch = kiln_size(in[0], 0);
  kiln_tensor *h = kiln_matmul(in[0], kiln_transpose(m->swap ? m->w2 : m->w, 0, 1));
  h = m->branch ? kiln_tanh(h) : kiln_relu(h);
  if (m->mark) kiln_requires_grad(h, true);
  if (m->keep) {
    kiln_release(m->kept);
    m->kept = kiln_retain(h);
  }
  if (m->read) m->seen = kiln_item(kiln_sum_all(h));
  kiln_tensor *mid = h, *other = kiln_neg(h);
  for (int i = 0; i < m->layers; i++) h = kiln_add(kiln_matmul(m->wire ? other : h, kiln_transpose(m->w, 0, 1)), m->b);
  h = kiln_leaky_relu(h, m->slope);
  kiln_tensor *s = kiln_slice(h, 1, m->at, m->at + 2, 1);
  out[0] = batch > 1 ? kiln_add(s, s) : s;
  if (m->out_mid) out[0] = mid;
  if (m->keep_view && out[0]) {
    kiln_release(m->kept);
    m->kept = kiln_retain(kiln_reshape(out[0], 1, ((int64_t[]){-1})));
  }
  return out[0] ? 0 : -1;
}

static void model_init(model *m) {
  memset(m, 0, sizeof *m);
  m->w = kiln_randn(KILN_F32, 2, ((int64_t[]){6, 6}), 11);
  m->w2 = kiln_randn(KILN_F32, 2, ((int64_t[]){6, 6}), 12);
  m->b = kiln_randn(KILN_F32, 1, ((int64_t[]){6}), 13);
  m->layers = 1;
  m->slope = 0.1;
}

static void model_free(model *m) {
  kiln_release(m->w);
  kiln_release(m->w2);
  kiln_release(m->b);
  kiln_release(m->kept);
}

/* One call compiled and one eager on the same state; a kept or read value
 * compared too. */
static void body_call(kiln_fn *fn, kiln_body body, model *m, kiln_tensor *x, const char *what, int call) {
  kiln_scope_begin();
  kiln_tensor *got = NULL, *want = NULL;
  ck_assert_msg(kiln_call(fn, &x, &got) == 0, "%s call %d: %s", what, call, kiln_last_error());
  kiln_tensor *kept = m->kept ? kiln_retain(m->kept) : NULL;
  double seen = m->seen;
  ck_assert_int_eq(0, body(m, &x, &want));
  ck_assert_msg(max_diff(got, want) <= 1e-5, "%s call %d: compiled differs from eager by %g", what, call, max_diff(got, want));
  if (m->keep || m->keep_view) ck_assert_msg(kept && max_diff(kept, m->kept) <= 1e-5, "%s call %d: the kept tensor", what, call);
  if (m->read) ck_assert_msg(fabs(seen - m->seen) <= 1e-4, "%s call %d: read %g, eager %g", what, call, seen, m->seen);
  kiln_release(kept);
  kiln_scope_end();
}

static void model_call(kiln_fn *fn, model *m, kiln_tensor *x, const char *what, int call) {
  body_call(fn, model_body, m, x, what, call);
}

/* Each change is made at a call after replays began, and undone: every
 * call equals eager, and the calls that follow the script again replay. */
START_TEST(test_replay_parts_from_the_log) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      model m;
      model_init(&m);
      kiln_options o = {.name = "model", .n_in = 1, .backend = backends[b], .capture = captures[c], .max_variants = 32};
      kiln_fn *fn = kiln_compile(model_body, &m, &o);
      kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 14);
      char what[64];
      snprintf(what, sizeof what, "backend %d capture %d", b, c);
      int call = 0;
      for (int i = 0; i < 3; i++) model_call(fn, &m, x, what, call++);
      ck_assert_msg(stats(fn).replays == 2, "%s: %lld replays of 3 calls", what, (long long)stats(fn).replays);
      /* each step: a change, a call, the change undone, a call */
      for (int step = 0; step < 12; step++) {
        long long before = stats(fn).replays;
        switch (step) {
        case 0: m.branch = 1; break;                /* another op in the middle */
        case 1: m.layers = 2; break;                /* more ops */
        case 2: m.layers = 0; break;                /* fewer ops */
        case 3: m.keep = true; break;               /* a tensor kept past the call */
        case 4: m.read = true; break;               /* a data read: a break */
        case 5: m.swap = true; break;               /* another weight */
        case 6: m.at = 3; break;                    /* an integer number */
        case 7: m.slope = 0.25 + 0.01 * step; break; /* a float number (an argument once it changed) */
        case 8: m.mark = true; break;               /* a flag set on a tensor of the script */
        case 9: m.wire = true; break;               /* the same op over another value */
        case 10: m.keep_view = true; break;         /* a view of the output kept past the call */
        case 11: m.out_mid = true; break;           /* another value returned, the same ops done */
        }
        model_call(fn, &m, x, what, call++);
        model_call(fn, &m, x, what, call++);
        if (step == 8) {
          /* requires_grad marked: no replay (a flag the script's tensor must not keep) */
          ck_assert_msg(stats(fn).replays == before, "%s step %d: a replay with a marked tensor", what, step);
        }
        m.branch = 0, m.layers = 1, m.keep = false, m.read = false, m.swap = false, m.at = 0, m.mark = false;
        m.wire = false, m.keep_view = false, m.out_mid = false;
        kiln_release(m.kept);
        m.kept = NULL;
        model_call(fn, &m, x, what, call++);
        model_call(fn, &m, x, what, call++);
        /* back on the script's path: the last call replays (the one before
         * may make a new script) */
        ck_assert_msg(stats(fn).replays > before, "%s step %d: no replay after the change was undone", what, step);
      }
      kiln_release(x);
      kiln_fn_free(fn);
      model_free(&m);
    }
}
END_TEST

/* A number the body turns into a tensor (a learning rate, a temperature)
 * that changes at every call is an argument of the variant from its second
 * value on: later calls replay with each new value, and a factory of a
 * fixed value (kiln_ones) replays as it is. */
static int scale_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  int64_t n = kiln_size(in[0], 1);
  kiln_tensor *h = kiln_matmul(in[0], kiln_transpose(m->w, 0, 1));
  h = kiln_mul(h, kiln_scalar(KILN_F32, m->slope));
  out[0] = kiln_add(h, kiln_ones(KILN_F32, 1, ((int64_t[]){n})));
  if (m->branch) out[0] = kiln_add(out[0], kiln_full(KILN_F32, 0, NULL, m->slope * 2));
  /* a shape from C state */
  out[0] = kiln_add(out[0], kiln_sum_all(kiln_ones(KILN_F32, 1, ((int64_t[]){m->at + 1}))));
  return out[0] ? 0 : -1;
}

START_TEST(test_replay_number_changes) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      model m;
      model_init(&m);
      kiln_options o = {.name = "scale", .n_in = 1, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(scale_body, &m, &o);
      kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 15);
      for (int i = 0; i < 14; i++) {
        m.slope = 0.05 * (i + 1);
        m.branch = i == 10; /* one more factory once: a hand-over with the new value logged */
        m.at = i >= 12 ? 2 : 0;
        body_call(fn, scale_body, &m, x, "scale", i);
      }
      kiln_fn_stats st = stats(fn);
      ck_assert_msg(st.traces <= 4, "%lld traces", (long long)st.traces);
      ck_assert_msg(st.replays >= 9, "%lld replays of 14 calls", (long long)st.replays);
      kiln_release(x);
      kiln_fn_free(fn);
      model_free(&m);
    }
}
END_TEST

/* A variance (its divisor a count of the input's shape, which a replay
 * checks as it checks an op) with a correction from C state, and a layer
 * norm: calls replay, and a new correction or a branch after them hands
 * over. */
static int var_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  (void)kiln_size(in[0], 0);
  kiln_tensor *h = kiln_matmul(in[0], kiln_transpose(m->w, 0, 1));
  kiln_tensor *v = kiln_var(h, 1, (int)m->at, true);
  h = kiln_add(kiln_layer_norm(h, m->b, NULL, 1e-5), v);
  out[0] = m->branch ? kiln_tanh(h) : h;
  return out[0] ? 0 : -1;
}

START_TEST(test_replay_counts_of_shapes) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      model m;
      model_init(&m);
      m.at = 1;
      kiln_options o = {.name = "var", .n_in = 1, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(var_body, &m, &o);
      kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 21);
      for (int i = 0; i < 12; i++) {
        m.at = i >= 4 && i < 6 ? 0 : 1;
        m.branch = i == 8;
        body_call(fn, var_body, &m, x, "var", i);
      }
      ck_assert_msg(stats(fn).replays >= 6, "%lld replays of 12 calls", (long long)stats(fn).replays);
      kiln_release(x);
      kiln_fn_free(fn);
      model_free(&m);
    }
}
END_TEST

/* Inference over weights that require grad (a model trained elsewhere in
 * the program), under kiln_no_grad inside the body while autograd is on
 * outside: no op gives history, so calls replay (a script was refused for
 * the weights' flag alone, and a GPT forward recorded every call). */
static int no_grad_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  (void)kiln_size(in[0], 0);
  kiln_no_grad_begin();
  out[0] = kiln_relu(kiln_add(kiln_matmul(in[0], kiln_transpose(m->w, 0, 1)), m->b));
  kiln_no_grad_end();
  return out[0] ? 0 : -1;
}

START_TEST(test_replay_no_grad_inside) {
  for (int b = 0; b < 2; b++) {
    model m;
    model_init(&m);
    kiln_requires_grad(m.w, true);
    kiln_requires_grad(m.b, true);
    kiln_options o = {.name = "nograd", .n_in = 1, .backend = backends[b]};
    kiln_fn *fn = kiln_compile(no_grad_body, &m, &o);
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 22);
    for (int i = 0; i < 5; i++) body_call(fn, no_grad_body, &m, x, "no grad", i);
    ck_assert_int_eq(4, stats(fn).replays);
    kiln_release(x);
    kiln_fn_free(fn);
    model_free(&m);
  }
}
END_TEST

/* A weight released and another made in its place, of its shape or of
 * another: the replay checks the very tensor the body passes. */
static int replaced_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  (void)kiln_size(in[0], 0);
  out[0] = kiln_tanh(kiln_matmul(in[0], kiln_transpose(m->w, 0, 1)));
  return out[0] ? 0 : -1;
}

START_TEST(test_replay_weight_replaced) {
  for (int b = 0; b < 2; b++) {
    model m;
    model_init(&m);
    kiln_options o = {.name = "replaced", .n_in = 1, .backend = backends[b], .capture = KILN_CAPTURE_RECORD};
    kiln_fn *fn = kiln_compile(replaced_body, &m, &o);
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 16);
    for (int i = 0; i < 12; i++) {
      if (i >= 3) {
        int64_t rows = i % 2 ? 4 : 6;
        kiln_release(m.w);
        m.w = kiln_randn(KILN_F32, 2, ((int64_t[]){rows, 6}), 100 + (uint64_t)i);
      }
      body_call(fn, replaced_body, &m, x, "replaced", i);
    }
    kiln_release(x);
    kiln_fn_free(fn);
    model_free(&m);
  }
}
END_TEST

/* A weight the body lets go of after using it, in a call that replays (a
 * cache dropped at the end of a sequence): a recording would have held it
 * to the end of the call, and so must the replay (it was used after it was
 * freed). The weight is held by the caller alone: the variant was made with
 * another. */
static kiln_tensor *dropped_w;
static bool drop_w;

static int drop_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_mul(in[0], dropped_w);
  if (drop_w) {
    kiln_release(dropped_w);
    dropped_w = NULL;
  }
  return out[0] ? 0 : -1;
}

START_TEST(test_replay_weight_released_by_the_body) {
  for (int b = 0; b < 2; b++) {
    kiln_options o = {.name = "drop", .n_in = 1, .backend = backends[b], .capture = KILN_CAPTURE_RECORD};
    kiln_fn *fn = kiln_compile(drop_body, NULL, &o);
    kiln_tensor *x = kiln_randn(KILN_F32, 1, ((int64_t[]){4}), 1), *y, *want;
    drop_w = false;
    dropped_w = kiln_randn(KILN_F32, 1, ((int64_t[]){4}), 2);
    kiln_tensor *w2 = kiln_randn(KILN_F32, 1, ((int64_t[]){4}), 3);
    kiln_scope_begin();
    ck_assert_int_eq(0, kiln_call(fn, &x, &y));
    kiln_release(dropped_w);
    dropped_w = w2;
    ck_assert_int_eq(0, kiln_call(fn, &x, &y)); /* another weight: a script with it */
    ck_assert_int_eq(0, kiln_call(fn, &x, &y)); /* replays */
    want = kiln_mul(x, dropped_w);
    drop_w = true;
    ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
    ck_assert_msg(max_diff(y, want) == 0, "backend %d", b);
    ck_assert_int_eq(2, stats(fn).replays);
    kiln_scope_end();
    kiln_release(x);
    kiln_fn_free(fn);
  }
}
END_TEST

/* A weight swapped for another inside the body after its last use (new
 * weights loaded elsewhere, taken at a safe point of the step): the old
 * one's last reference goes while the call still runs. The replay must
 * hold it as a recording does, for the run and for a hand-over after the
 * body (here: the hidden value kept in the model at the same call). */
typedef struct {
  kiln_tensor *w, *pending, *kept;
  bool keep;
} swap_model;

static int swap_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  swap_model *m = ctx;
  (void)kiln_size(in[0], 0);
  kiln_tensor *h = kiln_matmul(in[0], m->w);
  if (m->pending) {
    kiln_release(m->w);
    m->w = m->pending;
    m->pending = NULL;
  }
  if (m->keep) {
    kiln_release(m->kept);
    m->kept = kiln_retain(h);
  }
  out[0] = kiln_relu(h);
  return out[0] ? 0 : -1;
}

START_TEST(test_replay_param_released_in_body) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++)
      for (int keep = 0; keep < 2; keep++) {
        /* the compiled model and an eager twin with the same weights */
        swap_model m[2];
        for (int k = 0; k < 2; k++) m[k] = (swap_model){kiln_randn(KILN_F32, 2, ((int64_t[]){6, 6}), 1), NULL, NULL, false};
        kiln_options o = {.name = "swap", .n_in = 1, .backend = backends[b], .capture = captures[c]};
        kiln_fn *fn = kiln_compile(swap_body, &m[0], &o);
        long long at_swap = -1;
        for (int i = 0; i < 8; i++) {
          for (int k = 0; k < 2; k++) {
            /* a weight replaced between calls: the script's param is the new one, which the variant does not hold */
            if (i == 1) {
              kiln_release(m[k].w);
              m[k].w = kiln_randn(KILN_F32, 2, ((int64_t[]){6, 6}), 2);
            }
            if (i == 4) m[k].pending = kiln_randn(KILN_F32, 2, ((int64_t[]){6, 6}), 3);
            m[k].keep = keep && i == 4;
          }
          if (i == 4) at_swap = stats(fn).replays;
          kiln_scope_begin();
          kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 6}), 10 + (uint64_t)i), *got = NULL, *want = NULL;
          ck_assert_msg(kiln_call(fn, &x, &got) == 0, "backend %d capture %d call %d: %s", b, c, i, kiln_last_error());
          ck_assert_int_eq(0, swap_body(&m[1], &x, &want));
          ck_assert_msg(max_diff(got, want) <= 1e-5, "backend %d capture %d call %d: compiled differs from eager", b, c, i);
          if (keep && i == 4) ck_assert_msg(max_diff(m[0].kept, m[1].kept) <= 1e-5, "call %d: the kept tensor", i);
          kiln_scope_end();
          /* the call with the swap replays up to it: a replay (or, with the keep, a hand-over after the body) */
          if (i == 4 && !keep) ck_assert_msg(stats(fn).replays == at_swap + 1, "backend %d capture %d: the swap call did not replay", b, c);
        }
        ck_assert_int_le(4, stats(fn).replays);
        kiln_fn_free(fn);
        for (int k = 0; k < 2; k++) {
          kiln_release(m[k].w);
          kiln_release(m[k].kept);
        }
      }
}
END_TEST

/* A step that trains at some calls (backward inside the body, as a
 * compiled training step does) after replays of calls that did not, under
 * the caller's kiln_no_grad_begin: the weight's gradient is eager's. */
static int grad_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  (void)kiln_size(in[0], 0);
  out[0] = kiln_sum_all(kiln_tanh(kiln_matmul(in[0], m->w)));
  if (out[0] && m->keep && kiln_backward(out[0])) return -1;
  return out[0] ? 0 : -1;
}

START_TEST(test_replay_then_autograd) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      model m;
      model_init(&m);
      kiln_requires_grad(m.w, true);
      kiln_options o = {.name = "grad", .n_in = 1, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(grad_body, &m, &o);
      kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 17);
      kiln_no_grad_begin();
      for (int i = 0; i < 3; i++) body_call(fn, grad_body, &m, x, "no grad", i);
      kiln_no_grad_end();
      ck_assert_int_eq(2, stats(fn).replays);
      m.keep = true;
      for (int i = 0; i < 3; i++) {
        kiln_tensor *g[2];
        for (int k = 0; k < 2; k++) {
          kiln_zero_grad(m.w);
          kiln_scope_begin();
          kiln_tensor *loss = NULL;
          if (k == 0) ck_assert_msg(kiln_call(fn, &x, &loss) == 0, "%s", kiln_last_error());
          else ck_assert_int_eq(0, grad_body(&m, &x, &loss));
          kiln_scope_end();
          g[k] = kiln_retain(kiln_grad(m.w));
        }
        ck_assert_msg(g[0] && g[1] && max_diff(g[0], g[1]) <= 1e-5, "backend %d capture %d call %d: the weight's gradient", b, c, i);
        kiln_release(g[0]);
        kiln_release(g[1]);
      }
      m.keep = false;
      kiln_release(x);
      kiln_fn_free(fn);
      model_free(&m);
    }
}
END_TEST

/* Outputs a replay cannot make anew (a view of the input, the input itself,
 * one tensor twice) and a view of an input used inside: still eager's. */
static int views_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  (void)kiln_size(in[0], 0);
  kiln_tensor *t = kiln_transpose(in[0], 0, 1); /* a view of this call's input */
  kiln_tensor *h = kiln_relu(kiln_matmul(m->w, t));
  out[0] = kiln_transpose(h, 0, 1);
  out[1] = m->layers == 1 ? in[0] : h;
  out[2] = m->keep ? out[1] : kiln_neg(h);
  return out[0] ? 0 : -1;
}

START_TEST(test_replay_views_and_outputs) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      model m;
      model_init(&m);
      kiln_options o = {.name = "views", .n_in = 1, .n_out = 3, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(views_body, &m, &o);
      for (int i = 0; i < 8; i++) {
        m.layers = i % 4 == 3 ? 1 : 0;
        m.keep = i % 3 == 2;
        kiln_scope_begin();
        /* a new input each call: a view kept from an earlier call's input would read old data */
        kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 20 + (uint64_t)i), *got[3], *want[3];
        ck_assert_msg(kiln_call(fn, &x, got) == 0, "%s", kiln_last_error());
        ck_assert_int_eq(0, views_body(&m, &x, want));
        for (int k = 0; k < 3; k++) ck_assert_msg(max_diff(got[k], want[k]) <= 1e-5, "call %d output %d", i, k);
        ck_assert_msg((got[1] == x) == (want[1] == x), "call %d: output 1 is the input eagerly", i);
        ck_assert_msg((got[2] == got[1]) == (want[2] == want[1]), "call %d: outputs 1 and 2 are one tensor eagerly", i);
        kiln_scope_end();
      }
      kiln_fn_free(fn);
      model_free(&m);
    }
}
END_TEST

/* A view of an input the body passes to an op and reads: each call's own
 * input's data, never a view of an earlier call's input. */
static int view_read_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  kiln_tensor *t = kiln_transpose(in[0], 0, 1);
  if (m->read) m->seen = kiln_item(kiln_sum_all(kiln_slice(t, 0, 0, 1, 1)));
  out[0] = kiln_relu(kiln_matmul(m->w, t));
  return out[0] ? 0 : -1;
}

START_TEST(test_replay_view_of_input_read) {
  for (int b = 0; b < 2; b++) {
    model m;
    model_init(&m);
    kiln_options o = {.name = "vread", .n_in = 1, .backend = backends[b], .capture = KILN_CAPTURE_RECORD};
    kiln_fn *fn = kiln_compile(view_read_body, &m, &o);
    for (int i = 0; i < 6; i++) {
      m.read = i >= 3;
      kiln_scope_begin();
      kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 40 + (uint64_t)i);
      body_call(fn, view_read_body, &m, x, "vread", i);
      kiln_scope_end();
    }
    ck_assert_int_le(2, stats(fn).replays);
    kiln_fn_free(fn);
    model_free(&m);
  }
}
END_TEST

/* A body whose only read is a size, parting from the script after it: the
 * variant made from the handed-over recording knows the body read a size,
 * so its calls still run the body (where a C branch shows), rather than
 * the guard-only path. */
static int size_read_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  int64_t n = kiln_size(in[0], 0);
  kiln_tensor *h = kiln_relu(kiln_matmul(in[0], kiln_transpose(m->w, 0, 1)));
  if (m->branch) h = kiln_tanh(h);
  out[0] = n > 0 ? h : kiln_neg(h);
  return out[0] ? 0 : -1;
}

START_TEST(test_replay_hands_over_size_reads) {
  const int branch[] = {0, 0, 0, 1, 1, 0, 1, 0};
  for (int b = 0; b < 2; b++) {
    model m;
    model_init(&m);
    kiln_options o = {.name = "sizes", .n_in = 1, .backend = backends[b]};
    kiln_fn *fn = kiln_compile(size_read_body, &m, &o);
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 18);
    for (int i = 0; i < 8; i++) {
      m.branch = branch[i];
      body_call(fn, size_read_body, &m, x, "sizes", i);
    }
    kiln_fn_stats st = stats(fn);
    ck_assert_int_eq(0, st.guard_hits);
    ck_assert_int_le(3, st.replays);
    kiln_release(x);
    kiln_fn_free(fn);
    model_free(&m);
  }
}
END_TEST

/* A body that takes one branch and the other at alternate calls: each
 * variant's script is taken by a call of the other branch and hands over,
 * and after some such calls no scripts are made for a while; every call is
 * eager's and two variants serve them all. */
START_TEST(test_replay_alternating_branches) {
  for (int b = 0; b < 2; b++) {
    model m;
    model_init(&m);
    kiln_options o = {.name = "alternate", .n_in = 1, .backend = backends[b], .capture = KILN_CAPTURE_RECORD};
    kiln_fn *fn = kiln_compile(size_read_body, &m, &o);
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 19);
    for (int i = 0; i < 80; i++) {
      m.branch = i % 2;
      body_call(fn, size_read_body, &m, x, "alternate", i);
    }
    /* a stretch of one branch replays again once scripts are made again */
    m.branch = 0;
    for (int i = 0; i < 40; i++) body_call(fn, size_read_body, &m, x, "one branch", i);
    kiln_fn_stats st = stats(fn);
    ck_assert_int_eq(2, st.traces);
    ck_assert_int_eq(118, st.hits);
    ck_assert_msg(st.replays >= 5, "%lld replays", (long long)st.replays);
    kiln_release(x);
    kiln_fn_free(fn);
    model_free(&m);
  }
}
END_TEST

/* A body that writes state in place as it goes (a cache row at a position
 * the call passes, a counter, a moving average with a decay from C, a fill
 * of a tensor it made with a number from C): calls replay the writes, and
 * each change hands over after some of them were replayed, where the
 * recording must see the writes as they came (a view made before a write
 * and read after it runs the rest eagerly, as in a recorded call). A twin
 * state run eagerly is compared after every call, written tensors too. */
typedef struct {
  kiln_tensor *w, *cache, *ema, *count;
  double decay, fill;
  int how;          /* 0: the script's steps; 1: read a view made before the writes; 2: one more op
                       after them; 3: no average; 4: write the input too */
} stateful;

static int stateful_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  stateful *m = ctx;
  int64_t n = kiln_size(in[0], 1);
  kiln_tensor *h = kiln_tanh(kiln_matmul(in[0], kiln_transpose(m->w, 0, 1))); /* (1,6) */
  kiln_tensor *before = kiln_reshape(m->cache, 1, ((int64_t[]){-1}));
  if (!kiln_index_copy_(m->cache, 0, in[1], h) || !kiln_add_(m->count, kiln_scalar(KILN_F32, 1))) return -1;
  if (m->how != 3 && (!kiln_mul_(m->ema, kiln_scalar(KILN_F32, m->decay)) ||
                      !kiln_add_(m->ema, kiln_mul(h, kiln_scalar(KILN_F32, 1 - m->decay)))))
    return -1;
  kiln_tensor *t = kiln_zeros(KILN_F32, 2, ((int64_t[]){1, n}));
  if (!kiln_fill_(t, m->fill) || !kiln_add_(t, h)) return -1;
  if (m->how == 4 && !kiln_mul_(in[0], kiln_scalar(KILN_F32, 0.5))) return -1;
  kiln_tensor *c = m->how == 1 ? before : kiln_reshape(m->cache, 1, ((int64_t[]){-1}));
  out[0] = kiln_add(kiln_matmul(t, kiln_transpose(m->w, 0, 1)), kiln_mul(kiln_sum_all(c), m->ema));
  if (m->how == 2) out[0] = kiln_relu(out[0]);
  return out[0] ? 0 : -1;
}

static void stateful_init(stateful *m) {
  m->w = kiln_randn(KILN_F32, 2, ((int64_t[]){6, 6}), 31);
  m->cache = kiln_randn(KILN_F32, 2, ((int64_t[]){8, 6}), 32);
  m->ema = kiln_randn(KILN_F32, 2, ((int64_t[]){1, 6}), 33);
  m->count = kiln_zeros(KILN_F32, 0, NULL);
}

static void stateful_free(stateful *m) {
  kiln_release(m->w);
  kiln_release(m->cache);
  kiln_release(m->ema);
  kiln_release(m->count);
}

START_TEST(test_replay_writes_in_place) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      stateful m, e; /* compiled, eager */
      stateful_init(&m);
      stateful_init(&e);
      kiln_options o = {.name = "stateful", .n_in = 2, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(stateful_body, &m, &o);
      for (int i = 0; i < 26; i++) {
        int how = i == 10 ? 1 : i == 13 ? 2 : i == 16 ? 3 : i == 19 ? 4 : 0;
        m.how = e.how = how;
        m.decay = e.decay = 0.9 + 0.002 * i;
        m.fill = e.fill = 0.1 * i;
        kiln_scope_begin();
        float xs[6];
        for (int k = 0; k < 6; k++) xs[k] = (float)sin(i + 0.7 * k);
        int64_t pos = i % 8;
        kiln_tensor *xa = kiln_tensor_from(KILN_F32, 2, ((int64_t[]){1, 6}), xs);
        kiln_tensor *xb = kiln_tensor_from(KILN_F32, 2, ((int64_t[]){1, 6}), xs);
        kiln_tensor *p = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &pos);
        kiln_tensor *ina[2] = {xa, p}, *inb[2] = {xb, p}, *got = NULL, *want = NULL;
        ck_assert_msg(kiln_call(fn, ina, &got) == 0, "call %d: %s", i, kiln_last_error());
        ck_assert_int_eq(0, stateful_body(&e, inb, &want));
        ck_assert_msg(max_diff(got, want) <= 1e-4, "backend %d capture %d call %d (how %d): output differs by %g", b, c, i,
                      how, max_diff(got, want));
        ck_assert_msg(max_diff(m.cache, e.cache) <= 1e-6, "call %d: the cache", i);
        ck_assert_msg(max_diff(m.ema, e.ema) <= 1e-6, "call %d: the average", i);
        ck_assert_msg(max_diff(m.count, e.count) == 0, "call %d: the counter", i);
        ck_assert_msg(max_diff(xa, xb) == 0, "call %d: the input", i);
        kiln_scope_end();
      }
      kiln_fn_stats st = stats(fn);
      ck_assert_msg(st.replays >= 10, "backend %d capture %d: %lld replays of 26 calls", b, c, (long long)st.replays);
      kiln_fn_free(fn);
      stateful_free(&m);
      stateful_free(&e);
    }
}
END_TEST

/* Hand-overs at or after replayed writes, where the recording escapes (the
 * rest of the body runs eagerly): the writes are all done, once each. Each
 * body runs the script's steps for a few calls, then does what the recorded
 * call would escape at: 0, a write through a view made before a replayed
 * write; 1, a write into an input that is a slice of a bigger tensor; 2,
 * inputs that share one storage, written and read; 3, a write through a
 * view of an input written before (each call's input is a new tensor); 4,
 * an input that is a view of the param, written, then the param read. */
typedef struct {
  kiln_tensor *p;
  int kind;
  bool odd; /* the call that parts from the script */
} parting;

static int parting_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  parting *m = ctx;
  (void)kiln_size(in[0], 1);
  kiln_tensor *one = kiln_scalar(KILN_F32, 1), *two = kiln_scalar(KILN_F32, 2);
  switch (m->kind) {
  case 0: {
    kiln_tensor *v = kiln_reshape(m->p, 1, ((int64_t[]){-1}));
    if (!kiln_add_(m->p, one) || (m->odd && !kiln_add_(v, one))) return -1;
    out[0] = kiln_mul(m->p, in[0]);
    break;
  }
  case 1:
  case 2:
    if (!kiln_add_(in[0], in[1])) return -1;
    out[0] = kiln_mul(in[1], two);
    if (m->kind == 2 && !kiln_add_(in[0], one)) return -1;
    if (m->kind == 1 && m->odd) out[0] = kiln_relu(out[0]);
    break;
  case 4:
    if (!kiln_add_(in[0], one)) return -1;
    out[0] = kiln_mul(m->p, two);
    break;
  default: {
    if (!kiln_add_(in[0], one)) return -1;
    kiln_tensor *u = kiln_reshape(in[0], 1, ((int64_t[]){-1}));
    if (m->odd && !kiln_fill_(u, 0.0)) return -1;
    out[0] = kiln_mul(u, two);
  }
  }
  return out[0] ? 0 : -1;
}

/* Inputs for call i: kind 1's odd call passes a row of a (2,6) tensor,
 * kind 2's passes two tensors over one storage, kind 4's a view of the param. */
static void parting_inputs(int kind, bool odd, int i, kiln_tensor **in, kiln_tensor **keep, kiln_tensor *p) {
  float a[12], b[6];
  for (int k = 0; k < 12; k++) a[k] = (float)cos(i + 0.3 * k);
  for (int k = 0; k < 6; k++) b[k] = (float)sin(i - 0.5 * k);
  keep[0] = kiln_tensor_from(KILN_F32, 2, ((int64_t[]){odd && kind == 1 ? 2 : 1, 6}), a);
  in[0] = odd && kind == 1 ? kiln_slice(keep[0], 0, 0, 1, 1) : odd && kind == 4 ? kiln_reshape(p, 2, ((int64_t[]){1, 6})) : keep[0];
  in[1] = odd && kind == 2 ? kiln_reshape(keep[0], 2, ((int64_t[]){1, 6})) : kiln_tensor_from(KILN_F32, 2, ((int64_t[]){1, 6}), b);
}

START_TEST(test_replay_hand_over_at_writes) {
  for (int kind = 0; kind < 5; kind++)
    for (int b = 0; b < 2; b++)
      for (int c = 0; c < 2; c++) {
        parting m = {kiln_randn(KILN_F32, 2, ((int64_t[]){1, 6}), 41), kind, false};
        parting e = {kiln_randn(KILN_F32, 2, ((int64_t[]){1, 6}), 41), kind, false};
        kiln_options o = {.name = "parting", .n_in = 2, .backend = backends[b], .capture = captures[c]};
        kiln_fn *fn = kiln_compile(parting_body, &m, &o);
        for (int i = 0; i < 8; i++) {
          m.odd = e.odd = i == 5;
          kiln_scope_begin();
          kiln_tensor *ina[2], *inb[2], *ka, *kb, *got = NULL, *want = NULL;
          parting_inputs(kind, m.odd, i, ina, &ka, m.p);
          parting_inputs(kind, m.odd, i, inb, &kb, e.p);
          ck_assert_msg(kiln_call(fn, ina, &got) == 0, "kind %d call %d: %s", kind, i, kiln_last_error());
          ck_assert_int_eq(0, parting_body(&e, inb, &want));
          ck_assert_msg(max_diff(got, want) <= 1e-5, "kind %d backend %d capture %d call %d: output differs by %g", kind, b, c,
                        i, max_diff(got, want));
          ck_assert_msg(max_diff(m.p, e.p) <= 1e-6, "kind %d backend %d capture %d call %d: the param differs by %g", kind, b,
                        c, i, max_diff(m.p, e.p));
          ck_assert_msg(max_diff(ka, kb) <= 1e-6 && max_diff(ina[1], inb[1]) <= 1e-6,
                        "kind %d backend %d capture %d call %d: an input differs", kind, b, c, i);
          kiln_scope_end();
        }
        ck_assert_msg(stats(fn).replays >= 3, "kind %d: %lld replays", kind, (long long)stats(fn).replays);
        kiln_fn_free(fn);
        kiln_release(m.p);
        kiln_release(e.p);
      }
}
END_TEST

/* Training steps: a forward with autograd history, a backward, a momentum
 * step in place and the .grads dropped at the end replay (the backward's
 * ops are checked as any). Calls that part from the script in the middle
 * of or after the backward hand over: .grads left set for the next call to
 * accumulate into, a value read after the backward, a weight frozen for two
 * calls, .grads dropped first and left set (torch's order). A twin run
 * eagerly is compared after every call: the loss, every weight, buffer and
 * .grad. */
typedef struct {
  kiln_tensor *p[3], *mom[3];
  double lr, seen;
  bool keep_grads, read, zero_first;
} trainer;

static int train_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  trainer *m = ctx;
  (void)kiln_size(in[0], 0);
  if (m->zero_first)
    for (int i = 0; i < 3; i++) kiln_zero_grad(m->p[i]);
  kiln_scope_begin();
  kiln_tensor *h = kiln_tanh(kiln_add(kiln_matmul(in[0], kiln_transpose(m->p[0], 0, 1)), m->p[1]));
  kiln_tensor *d = kiln_sub(kiln_matmul(h, kiln_transpose(m->p[2], 0, 1)), in[1]);
  kiln_tensor *loss = kiln_mean_all(kiln_mul(d, d));
  int rc = loss && kiln_backward(loss) == 0 ? 0 : -1;
  if (!rc) kiln_keep(loss);
  kiln_scope_end();
  if (rc) return -1;
  if (m->read) m->seen = kiln_item(loss);
  kiln_no_grad_begin();
  for (int i = 0; i < 3 && !rc; i++) {
    kiln_tensor *g = kiln_grad(m->p[i]);
    if (!g) continue; /* frozen */
    if (!kiln_mul_(m->mom[i], kiln_scalar(KILN_F32, 0.9)) || !kiln_add_(m->mom[i], g) ||
        !kiln_sub_(m->p[i], kiln_mul(m->mom[i], kiln_scalar(KILN_F32, m->lr))))
      rc = -1;
  }
  kiln_no_grad_end();
  if (!m->keep_grads)
    for (int i = 0; i < 3; i++) kiln_zero_grad(m->p[i]);
  out[0] = loss;
  return rc;
}

static void trainer_init(trainer *m) {
  memset(m, 0, sizeof *m);
  const int64_t shapes[3][2] = {{8, 6}, {8, 1}, {3, 8}};
  for (int i = 0; i < 3; i++) {
    int nd = i == 1 ? 1 : 2;
    m->p[i] = kiln_mul(kiln_randn(KILN_F32, nd, shapes[i], 70 + (uint64_t)i), kiln_scalar(KILN_F32, 0.5));
    kiln_keep(m->p[i]);
    kiln_requires_grad(m->p[i], true);
    m->mom[i] = kiln_keep(kiln_zeros(KILN_F32, nd, shapes[i]));
  }
}

static void trainer_free(trainer *m) {
  for (int i = 0; i < 3; i++) kiln_release(m->p[i]), kiln_release(m->mom[i]);
}

START_TEST(test_replay_training_steps) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      trainer m, e;
      kiln_scope_begin();
      trainer_init(&m);
      trainer_init(&e);
      kiln_scope_end();
      kiln_options o = {.name = "train", .n_in = 2, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(train_body, &m, &o);
      for (int i = 0; i < 40; i++) {
        /* each change a few calls apart: replays resume in between */
        m.lr = e.lr = 0.05 + 0.002 * i;
        m.keep_grads = e.keep_grads = i == 6 || i == 26;
        m.read = e.read = i == 12;
        m.zero_first = e.zero_first = i == 26 || i == 27;
        kiln_requires_grad(m.p[2], i < 18 || i > 19);
        kiln_requires_grad(e.p[2], i < 18 || i > 19);
        kiln_scope_begin();
        kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 6}), 90 + (uint64_t)i);
        kiln_tensor *t = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 3}), 120 + (uint64_t)i);
        kiln_tensor *in[2] = {x, t}, *got = NULL, *want = NULL;
        ck_assert_msg(kiln_call(fn, in, &got) == 0, "call %d: %s", i, kiln_last_error());
        double seen = m.seen;
        ck_assert_int_eq(0, train_body(&e, in, &want));
        ck_assert_msg(max_diff(got, want) <= 1e-5, "backend %d capture %d call %d: loss differs by %g", b, c, i,
                      max_diff(got, want));
        if (m.read) ck_assert_msg(fabs(seen - e.seen) <= 1e-5, "call %d: the loss read", i);
        for (int k = 0; k < 3; k++) {
          ck_assert_msg(max_diff(m.p[k], e.p[k]) <= 1e-5, "backend %d capture %d call %d: weight %d differs by %g", b, c, i,
                        k, max_diff(m.p[k], e.p[k]));
          ck_assert_msg(max_diff(m.mom[k], e.mom[k]) <= 1e-5, "call %d: buffer %d", i, k);
          kiln_tensor *gm = kiln_grad(m.p[k]), *ge = kiln_grad(e.p[k]);
          ck_assert_msg(!gm == !ge, "backend %d capture %d call %d: .grad %d is %s, eagerly %s", b, c, i, k,
                        gm ? "set" : "NULL", ge ? "set" : "NULL");
          if (gm) ck_assert_msg(max_diff(gm, ge) <= 1e-5, "call %d: .grad %d differs by %g", i, k, max_diff(gm, ge));
        }
        kiln_scope_end();
      }
      kiln_fn_stats st = stats(fn);
      ck_assert_msg(st.replays >= 20, "backend %d capture %d: %lld replays of 40 steps", b, c, (long long)st.replays);
      kiln_fn_free(fn);
      trainer_free(&m);
      trainer_free(&e);
    }
}
END_TEST

/* Steps in torch's order (the .grads dropped first, left set) replay, and
 * a replayed step whose compiled run fails on its data (a target out of
 * range, which a replay does not read) leaves each .grad as a tensor with
 * data (the one the call found, as a recorded call leaves it), never the
 * script's tensor that has none; the steps after it match eager's again. */
typedef struct {
  kiln_tensor *w, *b;
} classifier;

static int classifier_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  classifier *m = ctx;
  kiln_zero_grad(m->w), kiln_zero_grad(m->b);
  kiln_scope_begin();
  kiln_tensor *loss = kiln_cross_entropy(kiln_add(kiln_matmul(in[0], m->w), m->b), in[1]);
  int rc = loss && kiln_backward(loss) == 0 ? 0 : -1;
  if (!rc) kiln_keep(loss);
  kiln_scope_end();
  if (rc) return -1;
  kiln_no_grad_begin();
  if (!kiln_sub_(m->w, kiln_mul(kiln_grad(m->w), kiln_scalar(KILN_F32, 0.1))) ||
      !kiln_sub_(m->b, kiln_mul(kiln_grad(m->b), kiln_scalar(KILN_F32, 0.1))))
    rc = -1;
  kiln_no_grad_end();
  out[0] = loss;
  return rc;
}

START_TEST(test_replay_torch_order_failed_run) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      classifier m, e;
      kiln_scope_begin();
      classifier *both[2] = {&m, &e};
      for (int k = 0; k < 2; k++) {
        both[k]->w = kiln_keep(kiln_randn(KILN_F32, 2, ((int64_t[]){5, 4}), 3));
        both[k]->b = kiln_keep(kiln_zeros(KILN_F32, 1, ((int64_t[]){4})));
        kiln_requires_grad(both[k]->w, true), kiln_requires_grad(both[k]->b, true);
      }
      kiln_scope_end();
      kiln_options o = {.name = "clf", .n_in = 2, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(classifier_body, &m, &o);
      for (int i = 0; i < 12; i++) {
        kiln_scope_begin();
        int64_t t[3] = {i % 4, (i + 1) % 4, i == 7 ? 9 : 2};
        kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, ((int64_t[]){3, 5}), 40 + (uint64_t)i),
                              kiln_tensor_from(KILN_I64, 1, ((int64_t[]){3}), t)},
                    *got = NULL, *want = NULL;
        int rc = kiln_call(fn, in, &got), rc_e = classifier_body(&e, in, &want);
        ck_assert_int_eq(i == 7 ? -1 : 0, rc);
        ck_assert_int_eq(rc, rc_e);
        if (i == 7) {
          /* each .grad NULL or with data */
          kiln_tensor *g[2] = {kiln_grad(m.w), kiln_grad(m.b)};
          float buf[20];
          for (int k = 0; k < 2; k++)
            ck_assert_msg(!g[k] || kiln_read(g[k], buf, sizeof(float) * (size_t)kiln_numel(g[k])) == 0, "backend %d capture %d: %s", b, c,
                          kiln_last_error());
        } else {
          ck_assert_double_le(max_diff(got, want), 1e-5);
          ck_assert_double_le(max_diff(m.w, e.w), 1e-5);
          ck_assert_double_le(max_diff(kiln_grad(m.w), kiln_grad(e.w)), 1e-5);
          ck_assert_double_le(max_diff(kiln_grad(m.b), kiln_grad(e.b)), 1e-5);
        }
        kiln_scope_end();
      }
      ck_assert_msg(stats(fn).replays >= 6, "backend %d capture %d: %lld replays", b, c, (long long)stats(fn).replays);
      kiln_fn_free(fn);
      for (int k = 0; k < 2; k++) kiln_release(both[k]->w), kiln_release(both[k]->b);
    }
}
END_TEST

/* In torch's order the .grad a replayed step leaves is the tensor the body
 * saw there, as eagerly: a handle it borrowed (kiln_grad, no reference) is
 * the .grad after the call, with this step's values, and a .grad it
 * returns is the same tensor as the param's .grad (a write through one is
 * seen through the other). */
typedef struct {
  classifier c;
  kiln_tensor *seen_w; /* borrowed */
} grad_watcher;

static int grad_watcher_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  grad_watcher *m = ctx;
  if (classifier_body(&m->c, in, out)) return -1;
  m->seen_w = kiln_grad(m->c.w);
  out[1] = kiln_grad(m->c.b);
  return 0;
}

START_TEST(test_replay_torch_order_grad_handles) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      grad_watcher m = {0}, e = {0};
      kiln_scope_begin();
      grad_watcher *both[2] = {&m, &e};
      for (int k = 0; k < 2; k++) {
        both[k]->c.w = kiln_keep(kiln_randn(KILN_F32, 2, ((int64_t[]){5, 4}), 3));
        both[k]->c.b = kiln_keep(kiln_zeros(KILN_F32, 1, ((int64_t[]){4})));
        kiln_requires_grad(both[k]->c.w, true), kiln_requires_grad(both[k]->c.b, true);
      }
      kiln_scope_end();
      kiln_options o = {.name = "watch", .n_in = 2, .n_out = 2, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(grad_watcher_body, &m, &o);
      for (int i = 0; i < 8; i++) {
        kiln_scope_begin();
        int64_t t[3] = {i % 4, (i + 1) % 4, 2};
        kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, ((int64_t[]){3, 5}), 40 + (uint64_t)i),
                              kiln_tensor_from(KILN_I64, 1, ((int64_t[]){3}), t)},
                    *got[2] = {0}, *want[2] = {0};
        ck_assert_msg(kiln_call(fn, in, got) == 0, "%s", kiln_last_error());
        ck_assert_int_eq(0, grad_watcher_body(&e, in, want));
        ck_assert_msg(m.seen_w == kiln_grad(m.c.w), "backend %d capture %d call %d: the handle the body saw is not the .grad", b, c,
                      i);
        ck_assert_double_le(max_diff(m.seen_w, kiln_grad(e.c.w)), 1e-5);
        ck_assert_msg(got[1] == kiln_grad(m.c.b), "backend %d capture %d call %d: the .grad returned is not the .grad", b, c, i);
        ck_assert_double_le(max_diff(got[1], want[1]), 1e-5);
        /* a write through the returned one reaches the .grad, as eagerly */
        ck_assert_ptr_nonnull(kiln_mul_(got[1], kiln_scalar(KILN_F32, 2)));
        ck_assert_ptr_nonnull(kiln_mul_(want[1], kiln_scalar(KILN_F32, 2)));
        ck_assert_double_le(max_diff(kiln_grad(m.c.b), kiln_grad(e.c.b)), 1e-5);
        kiln_scope_end();
      }
      ck_assert_msg(stats(fn).replays >= 4, "backend %d capture %d: %lld replays", b, c, (long long)stats(fn).replays);
      kiln_fn_free(fn);
      for (int k = 0; k < 2; k++) kiln_release(both[k]->c.w), kiln_release(both[k]->c.b);
    }
}
END_TEST

/* A body that keeps a param's .grad when there is one: the first call
 * finds none; later the caller sets one, then replaces it. Each call must
 * keep the .grad of its own time (eagerly the body runs every call), so
 * the hand-over in the second call must count the .grad's references as a
 * recording from the start would (a reference the replay held made the
 * kept one look like the param's own, and a variant skipped the body). */
typedef struct {
  kiln_tensor *p, *keep;
} keeper;

static int keeper_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  keeper *m = ctx;
  kiln_tensor *y = kiln_mul(in[0], m->p);
  kiln_tensor *g = kiln_grad(m->p);
  if (g) {
    kiln_release(m->keep);
    m->keep = kiln_retain(g);
    y = kiln_neg(y);
  }
  out[0] = y;
  return out[0] ? 0 : -1;
}

START_TEST(test_replay_grad_kept_by_the_body) {
  for (int b = 0; b < 2; b++) {
    keeper m = {kiln_randn(KILN_F32, 1, ((int64_t[]){3}), 81), NULL};
    kiln_requires_grad(m.p, true);
    kiln_options o = {.name = "keeper", .n_in = 1, .backend = backends[b]};
    kiln_fn *fn = kiln_compile(keeper_body, &m, &o);
    for (int i = 0; i < 8; i++) {
      kiln_scope_begin();
      if (i >= 1) {
        /* a new .grad before each call from the second on */
        kiln_zero_grad(m.p);
        ck_assert_int_eq(0, kiln_backward(kiln_sum_all(kiln_mul(m.p, kiln_scalar(KILN_F32, (double)i)))));
      }
      kiln_tensor *x = kiln_randn(KILN_F32, 1, ((int64_t[]){3}), 82 + (uint64_t)i), *y = NULL;
      ck_assert_msg(kiln_call(fn, &x, &y) == 0, "call %d: %s", i, kiln_last_error());
      kiln_tensor *want = kiln_mul(x, m.p);
      if (i >= 1) want = kiln_neg(want);
      ck_assert_msg(max_diff(y, want) <= 1e-6, "backend %d call %d: output differs", b, i);
      if (i >= 1) ck_assert_msg(m.keep == kiln_grad(m.p), "backend %d call %d: the body kept an older .grad", b, i);
      kiln_scope_end();
    }
    kiln_fn_free(fn);
    kiln_release(m.keep);
    kiln_release(m.p);
  }
}
END_TEST

/* Threads calling one function at once: one replays, the others record
 * (the script serves one call at a time); every result is eager's. */
typedef struct {
  kiln_fn *fn;
  model *m;
  int id;
  int bad;
} worker;

static void *work(void *arg) {
  worker *w = arg;
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 60 + (uint64_t)w->id);
  for (int i = 0; i < 40; i++) {
    kiln_scope_begin();
    kiln_tensor *got = NULL, *want = NULL;
    if (kiln_call(w->fn, &x, &got) || model_body(w->m, &x, &want) || max_diff(got, want) > 1e-5) w->bad++;
    kiln_scope_end();
  }
  kiln_release(x);
  return NULL;
}

START_TEST(test_replay_threads) {
  model m;
  model_init(&m);
  kiln_options o = {.name = "threads", .n_in = 1, .capture = KILN_CAPTURE_RECORD};
  kiln_fn *fn = kiln_compile(model_body, &m, &o);
  pthread_t th[3];
  worker w[3];
  for (int i = 0; i < 3; i++) {
    w[i] = (worker){fn, &m, i, 0};
    ck_assert_int_eq(0, pthread_create(&th[i], NULL, work, &w[i]));
  }
  for (int i = 0; i < 3; i++) {
    pthread_join(th[i], NULL);
    ck_assert_int_eq(0, w[i].bad);
  }
  ck_assert_int_le(10, stats(fn).replays);
  kiln_fn_free(fn);
  model_free(&m);
}
END_TEST

Suite *capture_replay_suite(void);
Suite *capture_replay_suite(void) {
  Suite *s = suite_create("capture_replay");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_replay_parts_from_the_log);
  tcase_add_test(tc, test_replay_number_changes);
  tcase_add_test(tc, test_replay_counts_of_shapes);
  tcase_add_test(tc, test_replay_weight_replaced);
  tcase_add_test(tc, test_replay_then_autograd);
  tcase_add_test(tc, test_replay_no_grad_inside);
  tcase_add_test(tc, test_replay_weight_released_by_the_body);
  tcase_add_test(tc, test_replay_param_released_in_body);
  tcase_add_test(tc, test_replay_views_and_outputs);
  tcase_add_test(tc, test_replay_view_of_input_read);
  tcase_add_test(tc, test_replay_hands_over_size_reads);
  tcase_add_test(tc, test_replay_alternating_branches);
  tcase_add_test(tc, test_replay_writes_in_place);
  tcase_add_test(tc, test_replay_hand_over_at_writes);
  tcase_add_test(tc, test_replay_training_steps);
  tcase_add_test(tc, test_replay_grad_kept_by_the_body);
  tcase_add_test(tc, test_replay_torch_order_failed_run);
  tcase_add_test(tc, test_replay_torch_order_grad_handles);
  tcase_add_test(tc, test_replay_threads);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(capture_replay_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
