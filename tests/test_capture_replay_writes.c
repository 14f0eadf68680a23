/* Replayed calls of bodies that write state in place across calls and change
 * what they do between calls: a key/value cache at a position from C, a
 * hand-written SGD step with momentum, batch norm's running statistics,
 * fills and writes across dtypes with numbers that change, a written tensor
 * the body keeps on some calls. Each call is compared with the same body run
 * eagerly on a twin state (outputs, every written tensor, the inputs), on
 * both backends and both capture modes (and with opts.check), and each test
 * says how many calls replayed, so that a replay that never happens fails. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"
#include "capture_helpers.h"

static kiln_tensor *sc(double v) { return kiln_scalar(KILN_F32, v); }

#define N_STATE 6

/* The state a body writes, and the C state it reads. */
typedef struct {
  kiln_tensor *t[N_STATE];
  kiln_tensor *kept;
  int kind;
  int call;
  int64_t pos;  /* a cache position from C */
  double c;     /* a number from C that changes every call */
  double mom;   /* a number from C that changes on some calls */
  bool flag;    /* a C flag set on some calls */
  int keep;     /* 1: keep the written tensor, 2: keep a view of it */
} state;

/* 0: a key/value cache written at a position from C and read through
 *    permuted views, with a mask from the same position, and a step counter;
 * 1: an SGD step with momentum in no_grad (the gradient passed in), the
 *    output read before and after the weight's write, the weight squared in
 *    place on flagged calls;
 * 2: batch norm in training (its running statistics written in place), the
 *    momentum changed and evaluation mode on some calls;
 * 3: fills of every dtype and writes from an f64 source into other dtypes,
 *    with fractional numbers that change;
 * 4: a tensor the body makes and writes, kept past the call on some calls. */
static int body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  state *m = ctx;
  kiln_tensor **s = m->t;
  int64_t n = kiln_size(in[0], 0);
  switch (m->kind) {
  case 0: {
    kiln_tensor *x = in[0]; /* (1,6) */
    kiln_tensor *idx = kiln_full(KILN_I64, 1, ((int64_t[]){1}), (double)m->pos);
    kiln_tensor *k = kiln_reshape(kiln_matmul(x, kiln_transpose(s[0], 0, 1)), 3, ((int64_t[]){1, 2, 3}));
    kiln_tensor *v = kiln_reshape(kiln_matmul(x, kiln_transpose(s[1], 0, 1)), 3, ((int64_t[]){1, 2, 3}));
    if (!kiln_index_copy_(s[2], 0, idx, k) || !kiln_index_copy_(s[3], 0, idx, v)) return -1;
    kiln_tensor *keys = kiln_permute(s[2], ((int[]){1, 0, 2})), *vals = kiln_permute(s[3], ((int[]){1, 0, 2}));
    kiln_tensor *q = kiln_reshape(x, 3, ((int64_t[]){2, 1, 3}));
    kiln_tensor *sco = kiln_matmul(q, kiln_transpose(keys, 1, 2)); /* (2,1,8) */
    sco = kiln_where(kiln_le(s[4], kiln_scalar(KILN_I64, (double)m->pos)), sco, sc(-1e9));
    out[0] = kiln_mul(kiln_reshape(kiln_matmul(kiln_softmax(sco, -1), vals), 2, ((int64_t[]){1, 6})), sc(1));
    if (!kiln_add_(s[5], kiln_scalar(KILN_I64, 1))) return -1;
    break;
  }
  case 1: {
    kiln_tensor *y = kiln_matmul(in[0], kiln_transpose(s[0], 0, 1));
    kiln_no_grad_begin();
    bool ok = kiln_mul_(s[1], sc(m->mom)) && kiln_add_(s[1], in[1]) && kiln_sub_(s[0], kiln_mul(s[1], sc(m->c)));
    if (ok && m->flag) ok = kiln_mul_(s[0], s[0]);
    kiln_no_grad_end();
    if (!ok) return -1;
    out[0] = kiln_add(y, kiln_matmul(in[0], kiln_transpose(s[0], 0, 1)));
    break;
  }
  case 2: {
    kiln_tensor *y = kiln_batch_norm(in[0], s[0], s[1], s[2], s[3], !m->flag, m->mom, 1e-5);
    if (!y || !kiln_add_(s[4], sc(1))) return -1;
    out[0] = kiln_relu(y);
    break;
  }
  case 3: {
    kiln_tensor *x = kiln_mul(in[2], kiln_scalar(KILN_F64, m->c)); /* f64 (6) */
    for (int k = 0; k < 5; k++)
      if (!kiln_fill_(s[k], m->c * (k + 1))) return -1;
    if (!kiln_add_(s[1], x) || !kiln_copy_(s[2], x) || !kiln_sub_(s[3], x) || !kiln_mul_(s[5], x) ||
        !kiln_add_(s[5], s[0]) || !kiln_copy_(s[0], x))
      return -1;
    out[0] = kiln_add(kiln_sum_all(kiln_cast(s[1], KILN_F64)), kiln_sum_all(x));
    break;
  }
  default: {
    kiln_tensor *t = kiln_mul(in[0], sc(2));
    if (!kiln_add_(t, sc(m->c)) || !kiln_add_(s[0], kiln_sum_all(t))) return -1;
    if (m->keep) {
      kiln_release(m->kept);
      m->kept = kiln_retain(m->keep == 1 ? t : kiln_reshape(t, 1, ((int64_t[]){-1})));
    }
    out[0] = kiln_relu(kiln_mul(t, sc((double)n)));
  }
  }
  return out[0] ? 0 : -1;
}

static void state_init(state *m, int kind) {
  memset(m, 0, sizeof *m);
  m->kind = kind;
  kiln_tensor **s = m->t;
  switch (kind) {
  case 0:
    s[0] = kiln_randn(KILN_F32, 2, ((int64_t[]){6, 6}), 1);
    s[1] = kiln_randn(KILN_F32, 2, ((int64_t[]){6, 6}), 2);
    s[2] = kiln_zeros(KILN_F32, 3, ((int64_t[]){8, 2, 3}));
    s[3] = kiln_zeros(KILN_F32, 3, ((int64_t[]){8, 2, 3}));
    s[4] = kiln_arange(KILN_I64, 0, 8, 1);
    s[5] = kiln_zeros(KILN_I64, 0, NULL);
    break;
  case 1:
    kiln_scope_begin();
    s[0] = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 2, ((int64_t[]){4, 4}), 3), sc(0.5)));
    kiln_scope_end();
    s[1] = kiln_zeros(KILN_F32, 2, ((int64_t[]){4, 4}));
    break;
  case 2:
    s[0] = kiln_zeros(KILN_F32, 1, ((int64_t[]){3}));
    s[1] = kiln_ones(KILN_F32, 1, ((int64_t[]){3}));
    s[2] = kiln_randn(KILN_F32, 1, ((int64_t[]){3}), 4);
    s[3] = kiln_randn(KILN_F32, 1, ((int64_t[]){3}), 5);
    s[4] = kiln_zeros(KILN_F32, 0, NULL);
    break;
  case 3: {
    static const kiln_dtype dts[N_STATE] = {KILN_BOOL, KILN_I32, KILN_I64, KILN_F16, KILN_BF16, KILN_F32};
    for (int k = 0; k < N_STATE; k++) s[k] = kiln_ones(dts[k], 1, ((int64_t[]){6}));
    break;
  }
  default:
    s[0] = kiln_zeros(KILN_F32, 0, NULL);
  }
}

static void state_free(state *m) {
  for (int k = 0; k < N_STATE; k++) kiln_release(m->t[k]);
  kiln_release(m->kept);
}

/* The C state of call i (the same for both twins). */
static void state_at(state *m, int i) {
  m->call = i;
  m->pos = i % 8;
  m->c = m->kind == 3 ? 0.3 + 0.37 * i : m->kind == 1 ? 0.1 / (1 + i) : 0.1 * i;
  m->mom = i == 5 || i == 6 ? 0.3 : m->kind == 1 ? 0.9 : 0.1;
  m->flag = i == 7 || i == 10;
  m->keep = i == 4 || i == 9 ? 1 : i == 6 ? 2 : 0;
}

/* The inputs of call i: x, a gradient for the SGD step, an f64 vector. */
static void inputs_at(int kind, int i, kiln_tensor **in) {
  int64_t rows = kind == 0 ? 1 : kind == 2 ? 4 : 3, cols = kind == 1 ? 4 : 6;
  if (kind == 2) {
    float xs[48];
    for (int k = 0; k < 48; k++) xs[k] = (float)sin(i * 1.1 + 0.37 * k);
    in[0] = kiln_tensor_from(KILN_F32, 4, ((int64_t[]){rows, 3, 2, 2}), xs);
  } else {
    float xs[18];
    for (int k = 0; k < rows * cols; k++) xs[k] = (float)sin(i + 0.7 * k);
    in[0] = kiln_tensor_from(KILN_F32, 2, ((int64_t[]){rows, cols}), xs);
  }
  in[1] = kiln_mul(kiln_randn(KILN_F32, 2, ((int64_t[]){4, 4}), 100 + (uint64_t)i), sc(0.1));
  double d[6] = {1.5 + i, -2.5 + i, 0.49, -0.51, 0, 3.99 * i};
  in[2] = kiln_tensor_from(KILN_F64, 1, ((int64_t[]){6}), d);
}

START_TEST(test_replay_stateful_bodies) {
  static const int min_replays[5] = {10, 6, 6, 10, 4};
  for (int kind = 0; kind < 5; kind++)
    for (int b = 0; b < 2; b++)
      for (int c = 0; c < 3; c++) {
        state m, e; /* compiled, eager */
        state_init(&m, kind);
        state_init(&e, kind);
        /* c == 2: the automatic policy with every call checked against eager */
        kiln_options o = {.name = "stateful", .n_in = 3, .backend = backends[b], .capture = captures[c % 2], .check = c == 2};
        kiln_fn *fn = kiln_compile(body, &m, &o);
        for (int i = 0; i < 14; i++) {
          state_at(&m, i);
          state_at(&e, i);
          kiln_scope_begin();
          kiln_tensor *ina[3], *inb[3], *got = NULL, *want = NULL;
          inputs_at(kind, i, ina);
          inputs_at(kind, i, inb);
          ck_assert_msg(kiln_call(fn, ina, &got) == 0, "kind %d call %d: %s", kind, i, kiln_last_error());
          ck_assert_int_eq(0, body(&e, inb, &want));
          ck_assert_msg(max_diff(got, want) <= 1e-4, "kind %d backend %d capture %d call %d: output differs by %g", kind, b, c, i,
                        max_diff(got, want));
          for (int k = 0; k < N_STATE; k++)
            if (m.t[k])
              ck_assert_msg(max_diff(m.t[k], e.t[k]) <= 1e-5, "kind %d backend %d capture %d call %d: state %d differs by %g",
                            kind, b, c, i, k, max_diff(m.t[k], e.t[k]));
          for (int k = 0; k < 3; k++)
            ck_assert_msg(max_diff(ina[k], inb[k]) == 0, "kind %d call %d: input %d", kind, i, k);
          if (kind == 4 && m.keep)
            ck_assert_msg(m.kept && max_diff(m.kept, e.kept) <= 1e-6, "kind %d call %d: the kept tensor", kind, i);
          kiln_scope_end();
        }
        ck_assert_msg(stats(fn).replays >= min_replays[kind], "kind %d backend %d capture %d: %lld replays of 14 calls", kind, b,
                      c, (long long)stats(fn).replays);
        kiln_fn_free(fn);
        state_free(&m);
        state_free(&e);
      }
}
END_TEST

Suite *capture_replay_writes_suite(void);
Suite *capture_replay_writes_suite(void) {
  Suite *s = suite_create("capture_replay_writes");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_replay_stateful_bodies);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(capture_replay_writes_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
