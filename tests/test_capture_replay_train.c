/* Replayed training loops (issue 18): bodies that train a small model over
 * many calls, each call changing what the body does from C (gradient
 * accumulation, where the .grads are dropped, frozen params, eval calls,
 * several backwards, a kept loss, clipping by a read norm, learning rates
 * and weight decays, dropout), each call compared with a twin model
 * trained eagerly: every param, optimizer buffer, .grad (NULL or not, and
 * values), the loss and every output, on both backends and both capture
 * modes, with the replays each configuration must make. */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"
#include "capture_helpers.h"
#include "../examples/gpt.h"

/* Max |a - b| over the elements, relative to 1 + max |b| (training drifts
 * apart by rounding over the calls); INFINITY for another shape or dtype. */
static double maxdiff(kiln_tensor *a, kiln_tensor *b) {
  double r = max_diff(a, b);
  if (isinf(r) || !kiln_numel(a)) return r;
  kiln_scope_begin();
  r /= 1 + kiln_item(kiln_max_axes(kiln_abs(kiln_cast(b, KILN_F64)), NULL, 0, false));
  kiln_scope_end();
  return r;
}

#define NP 4

/* What a call does, set by the loop before it. */
typedef struct {
  double lr, wd;     /* from C, every call */
  bool step;         /* take an optimizer step (else accumulate .grads) */
  bool zero_first;   /* drop the .grads at the start */
  bool zero_end;     /* drop the .grads at the end (after a step) */
  bool eval;         /* no backward: the forward in kiln_no_grad */
  bool two_losses;   /* a second loss, backward on each */
  bool ret_pred;     /* return the prediction, not the loss */
  bool keep_loss;    /* keep the loss (with its history) in the model */
  bool keep_mid;     /* keep an intermediate with history in the model */
  bool clip;         /* clip the .grads by a norm read with kiln_item */
  bool dropout;      /* dropout in training mode on the hidden layer */
  bool freeze_in;    /* unset requires_grad of p[1] inside the body, set it back at the end */
  bool grad_in;      /* keep kiln_grad of the input (which requires grad) */
  int steps;         /* recurrence steps (an LSTM-like loop), 0: none */
} plan;

typedef struct {
  kiln_tensor *p[NP], *mom[NP];
  kiln_tensor *kept_loss, *kept_mid, *kept_gin;
  plan pl;
  double norm;
} net;

static int net_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  net *m = ctx;
  const plan *pl = &m->pl;
  (void)kiln_size(in[0], 0);
  /* the recurrent weight only where the recurrence runs (a .grad of a param no op took hands a replay over) */
  const int np = pl->steps ? NP : NP - 1;
  if (pl->zero_first)
    for (int i = 0; i < np; i++) kiln_zero_grad(m->p[i]);
  if (pl->freeze_in) kiln_requires_grad(m->p[1], false);
  if (pl->eval) kiln_no_grad_begin();
  kiln_scope_begin();
  kiln_tensor *h = kiln_add(kiln_matmul(in[0], kiln_transpose(m->p[0], 0, 1)), m->p[1]);
  h = kiln_tanh(h);
  kiln_tensor *h0 = h;
  for (int s = 0; s < pl->steps; s++)
    h = kiln_tanh(kiln_add(kiln_matmul(h, kiln_transpose(m->p[3], 0, 1)), kiln_mul(h0, kiln_scalar(KILN_F32, 0.5))));
  if (pl->dropout) h = kiln_dropout(h, 0.25, true);
  if (pl->keep_mid) {
    kiln_release(m->kept_mid);
    m->kept_mid = kiln_retain(h);
  }
  kiln_tensor *pred = kiln_matmul(h, kiln_transpose(m->p[2], 0, 1));
  kiln_tensor *d = kiln_sub(pred, in[1]);
  kiln_tensor *loss = kiln_mean_all(kiln_mul(d, d));
  int rc = loss ? 0 : -1;
  if (!pl->eval) {
    if (pl->two_losses) {
      /* its own graph: backward frees the graph behind a loss */
      kiln_tensor *z = kiln_matmul(in[0], kiln_transpose(m->p[0], 0, 1));
      kiln_tensor *l2 = kiln_mul(kiln_sum_all(kiln_mul(z, z)), kiln_scalar(KILN_F32, 0.01));
      if (!l2 || kiln_backward(l2)) rc = -1;
    }
    if (!rc && kiln_backward(loss)) rc = -1;
  }
  if (!rc && pl->keep_loss) {
    kiln_release(m->kept_loss);
    m->kept_loss = kiln_retain(loss);
  }
  kiln_keep(loss);
  kiln_keep(pred);
  kiln_scope_end();
  if (pl->eval) kiln_no_grad_end();
  if (rc) return -1;
  if (pl->grad_in) {
    kiln_release(m->kept_gin);
    m->kept_gin = kiln_retain(kiln_grad(in[0]));
  }
  if (pl->clip && !pl->eval) {
    kiln_no_grad_begin();
    kiln_tensor *sq = kiln_scalar(KILN_F32, 0.0);
    for (int i = 0; i < np; i++)
      if (kiln_grad(m->p[i])) sq = kiln_add(sq, kiln_sum_all(kiln_mul(kiln_grad(m->p[i]), kiln_grad(m->p[i]))));
    m->norm = sqrt(kiln_item(sq));
    if (m->norm > 0.5)
      for (int i = 0; i < np; i++) {
        kiln_tensor *g = kiln_grad(m->p[i]);
        if (g && !kiln_mul_(g, kiln_scalar(KILN_F32, 0.5 / m->norm))) rc = -1;
      }
    kiln_no_grad_end();
  }
  if (pl->step && !pl->eval) {
    kiln_no_grad_begin();
    for (int i = 0; i < np && !rc; i++) {
      kiln_tensor *g = kiln_grad(m->p[i]);
      if (!g) continue;
      if (pl->wd) g = kiln_add(g, kiln_mul(m->p[i], kiln_scalar(KILN_F32, pl->wd)));
      if (!kiln_mul_(m->mom[i], kiln_scalar(KILN_F32, 0.9)) || !kiln_add_(m->mom[i], g) ||
          !kiln_sub_(m->p[i], kiln_mul(m->mom[i], kiln_scalar(KILN_F32, pl->lr))))
        rc = -1;
    }
    kiln_no_grad_end();
  }
  if (pl->zero_end)
    for (int i = 0; i < np; i++) kiln_zero_grad(m->p[i]);
  if (pl->freeze_in) kiln_requires_grad(m->p[1], true);
  out[0] = pl->ret_pred ? pred : loss;
  return rc;
}

static void net_init(net *m) {
  memset(m, 0, sizeof *m);
  const int64_t shapes[NP][2] = {{8, 6}, {8, 1}, {3, 8}, {8, 8}};
  kiln_scope_begin();
  for (int i = 0; i < NP; i++) {
    int nd = i == 1 ? 1 : 2;
    m->p[i] = kiln_keep(kiln_mul(kiln_randn(KILN_F32, nd, shapes[i], 70 + (uint64_t)i), kiln_scalar(KILN_F32, 0.4)));
    kiln_requires_grad(m->p[i], true);
    m->mom[i] = kiln_keep(kiln_zeros(KILN_F32, nd, shapes[i]));
  }
  kiln_scope_end();
}

static void net_free(net *m) {
  for (int i = 0; i < NP; i++) kiln_release(m->p[i]), kiln_release(m->mom[i]);
  kiln_release(m->kept_loss), kiln_release(m->kept_mid), kiln_release(m->kept_gin);
}

/* What the caller does between calls, on both models. */
typedef struct {
  bool pre_backward;  /* an eager backward on the params before the call: a .grad at its start */
  bool pre_zero;      /* drop the .grads before the call */
  int frozen;         /* a param frozen for the call (-1 none) */
  bool x_grad;        /* the input requires grad */
  bool no_grad;       /* the call in kiln_no_grad */
} caller;

typedef void (*schedule_fn)(int i, plan *pl, caller *c);

static void check_same(net *m, net *e, int b, int c, int i, const char *what) {
  for (int k = 0; k < NP; k++) {
    ck_assert_msg(maxdiff(m->p[k], e->p[k]) <= 1e-4, "%s backend %d capture %d call %d: param %d differs by %g", what, b, c,
                  i, k, maxdiff(m->p[k], e->p[k]));
    ck_assert_msg(maxdiff(m->mom[k], e->mom[k]) <= 1e-4, "%s backend %d capture %d call %d: buffer %d differs by %g", what, b, c,
                  i, k, maxdiff(m->mom[k], e->mom[k]));
    ck_assert_msg(kiln_get_requires_grad(m->p[k]) == kiln_get_requires_grad(e->p[k]), "%s call %d: requires_grad %d", what,
                  i, k);
    kiln_tensor *gm = kiln_grad(m->p[k]), *ge = kiln_grad(e->p[k]);
    ck_assert_msg(!gm == !ge, "%s backend %d capture %d call %d: .grad %d is %s, eagerly %s", what, b, c, i, k,
                  gm ? "set" : "NULL", ge ? "set" : "NULL");
    if (gm)
      ck_assert_msg(maxdiff(gm, ge) <= 1e-4, "%s backend %d capture %d call %d: .grad %d differs by %g", what, b, c, i, k,
                    maxdiff(gm, ge));
  }
  ck_assert_msg(!m->kept_loss == !e->kept_loss && !m->kept_mid == !e->kept_mid && !m->kept_gin == !e->kept_gin,
                "%s call %d: kept tensors", what, i);
  if (m->kept_loss) {
    ck_assert_msg(maxdiff(m->kept_loss, e->kept_loss) <= 1e-4, "%s call %d: kept loss", what, i);
  }
  if (m->kept_mid) {
    ck_assert_msg(maxdiff(m->kept_mid, e->kept_mid) <= 1e-4, "%s call %d: kept mid", what, i);
  }
  if (m->kept_gin) ck_assert_msg(maxdiff(m->kept_gin, e->kept_gin) <= 1e-4, "%s call %d: kept input .grad", what, i);
  ck_assert_msg(fabs(m->norm - e->norm) <= 1e-4, "%s call %d: norm read", what, i);
}

/* Runs n calls of schedule on every backend and capture mode; the fewest replays any configuration made. */
static long long run_schedule(const char *what, schedule_fn sched, int n) {
  long long fewest = 1LL << 40;
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      net m, e;
      net_init(&m);
      net_init(&e);
      kiln_options o = {.name = what, .n_in = 2, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(net_body, &m, &o);
      for (int i = 0; i < n; i++) {
        plan pl = {0};
        caller cl = {.frozen = -1};
        sched(i, &pl, &cl);
        m.pl = e.pl = pl;
        kiln_scope_begin();
        net *both[2] = {&m, &e};
        for (int k = 0; k < 2; k++) {
          net *t = both[k];
          if (cl.pre_zero)
            for (int j = 0; j < NP; j++) kiln_zero_grad(t->p[j]);
          if (cl.pre_backward) {
            kiln_tensor *l = kiln_scalar(KILN_F32, 0.0);
            for (int j = 0; j < NP; j++)
              l = kiln_add(l, kiln_mul(kiln_sum_all(kiln_mul(t->p[j], t->p[j])), kiln_scalar(KILN_F32, 0.1 * (i + 1))));
            ck_assert_int_eq(0, kiln_backward(l));
          }
          for (int j = 0; j < NP; j++) kiln_requires_grad(t->p[j], j != cl.frozen);
        }
        kiln_tensor *x[2], *tg = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 3}), 120 + (uint64_t)i);
        for (int k = 0; k < 2; k++) {
          x[k] = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 6}), 90 + (uint64_t)i);
          if (cl.x_grad) kiln_requires_grad(x[k], true);
        }
        kiln_tensor *inm[2] = {x[0], tg}, *ine[2] = {x[1], tg}, *got = NULL, *want = NULL;
        kiln_manual_seed(1000 + (uint64_t)i);
        if (cl.no_grad) kiln_no_grad_begin();
        int rc = kiln_call(fn, inm, &got);
        if (cl.no_grad) kiln_no_grad_end();
        ck_assert_msg(rc == 0, "%s backend %d capture %d call %d: %s", what, b, c, i, kiln_last_error());
        kiln_manual_seed(1000 + (uint64_t)i);
        if (cl.no_grad) kiln_no_grad_begin();
        ck_assert_int_eq(0, net_body(&e, ine, &want));
        if (cl.no_grad) kiln_no_grad_end();
        ck_assert_msg(maxdiff(got, want) <= 1e-4, "%s backend %d capture %d call %d: output differs by %g", what, b, c, i,
                      maxdiff(got, want));
        kiln_tensor *gx0 = kiln_grad(x[0]), *gx1 = kiln_grad(x[1]);
        ck_assert_msg(!gx0 == !gx1, "%s backend %d capture %d call %d: input .grad", what, b, c, i);
        if (gx0) ck_assert_msg(maxdiff(gx0, gx1) <= 1e-4, "%s call %d: input .grad differs", what, i);
        check_same(&m, &e, b, c, i, what);
        kiln_scope_end();
      }
      kiln_fn_stats st = stats(fn);
      if (st.replays < fewest) fewest = st.replays;
      kiln_fn_free(fn);
      net_free(&m);
      net_free(&e);
    }
  return fewest;
}

/* A plain step most calls, lr and weight decay new each call. */
static void base(int i, plan *pl, caller *c) {
  (void)c;
  pl->lr = 0.02 + 0.0005 * i;
  pl->wd = 0.001 * (i % 3 + 1);
  pl->step = true;
  pl->zero_end = true;
}

/* Gradient accumulation over 3 calls, zero_grad only on step calls. */
static void accumulate(int i, plan *pl, caller *c) {
  base(i, pl, c);
  pl->step = i % 3 == 2;
  pl->zero_end = pl->step;
}
/* zero_grad at the start some calls, at the end others, .grads left set on some. */
static void zero_where(int i, plan *pl, caller *c) {
  base(i, pl, c);
  pl->zero_first = (i / 5) % 2 == 1;
  pl->zero_end = (i / 5) % 2 == 0 && i % 7 != 3;
}
/* freeze a param between calls and inside the body */
static void freezing(int i, plan *pl, caller *c) {
  base(i, pl, c);
  c->frozen = (i / 6) % 4 == 1 ? 2 : (i / 6) % 4 == 3 ? 0 : -1;
  pl->freeze_in = (i / 4) % 3 == 2;
}
/* eval calls among training ones */
static void evals(int i, plan *pl, caller *c) {
  base(i, pl, c);
  pl->eval = (i / 4) % 3 == 1;
  c->no_grad = pl->eval && i % 11 == 5;
  pl->ret_pred = pl->eval && i % 2;
}
static void two_losses(int i, plan *pl, caller *c) {
  base(i, pl, c);
  pl->two_losses = (i / 5) % 2 == 1;
  pl->ret_pred = (i / 3) % 2 == 1;
}
static void keeps(int i, plan *pl, caller *c) {
  base(i, pl, c);
  pl->keep_loss = (i / 6) % 3 == 1;
  pl->keep_mid = (i / 6) % 3 == 2;
}
static void input_grad(int i, plan *pl, caller *c) {
  base(i, pl, c);
  c->x_grad = (i / 5) % 2 == 1;
  pl->grad_in = c->x_grad && i % 2;
}
static void caller_backward(int i, plan *pl, caller *c) {
  base(i, pl, c);
  c->pre_backward = (i / 5) % 3 == 1;
  pl->zero_first = i % 4 == 0;
}
/* torch's order: the .grads dropped first and left set at the end (also
 * dropped at the end on some calls: the same ops), the caller's own
 * backward before some calls and a drop before others */
static void torch_order(int i, plan *pl, caller *c) {
  base(i, pl, c);
  pl->zero_first = true;
  pl->zero_end = i % 6 == 5;
  c->pre_backward = i % 9 == 4;
  c->pre_zero = i % 11 == 7;
}
/* no backward in the body, a .grad from the caller's before every call,
 * dropped at the end by some calls: one log, two ends of the .grads */
static void eval_drops(int i, plan *pl, caller *c) {
  base(i, pl, c);
  pl->eval = true;
  c->pre_backward = true;
  pl->zero_end = (i / 4) % 2 == 0;
}
static void clipping(int i, plan *pl, caller *c) {
  base(i, pl, c);
  pl->clip = (i / 5) % 2 == 1;
}
static void dropping(int i, plan *pl, caller *c) {
  base(i, pl, c);
  pl->dropout = (i / 5) % 2 == 1;
}
static void recurrent(int i, plan *pl, caller *c) {
  base(i, pl, c);
  pl->steps = 3 + (i / 8) % 2;
}
/* several things at once, each on some calls of a block of 6 */
static void mixed(int i, plan *pl, caller *c) {
  base(i, pl, c);
  int k = i % 6, blk = i / 6;
  pl->step = k != 1;
  pl->zero_end = pl->step;
  pl->two_losses = blk % 2 == 1;
  pl->clip = k == 3 && blk % 3 == 0;
  pl->keep_loss = k == 4 && blk % 2 == 0;
  pl->eval = k == 5 && blk % 3 == 2;
  pl->steps = blk % 4 == 3 ? 2 : 0;
  c->frozen = k == 2 && blk % 2 ? 2 : -1;
  c->pre_backward = k == 0 && blk % 3 == 1;
  c->x_grad = blk % 5 == 4;
  pl->grad_in = c->x_grad && k == 4;
}

/* Each schedule on every backend and capture mode, with the fewest replays
 * any configuration must make (accumulate: none, the calls that step find
 * the .grads the others left, a variant that writes .grads) */
#define SCHED(name, n, least)                                                                     \
  START_TEST(test_train_##name) {                                                                 \
    long long r = run_schedule(#name, name, n);                                                   \
    ck_assert_msg(r >= least, #name ": %lld replays at fewest", r);                               \
  }                                                                                               \
  END_TEST

SCHED(base, 24, 18)
SCHED(accumulate, 30, 0)
SCHED(zero_where, 30, 3)
SCHED(torch_order, 30, 16)
SCHED(eval_drops, 24, 8)
SCHED(freezing, 40, 12)
SCHED(evals, 36, 12)
SCHED(two_losses, 30, 10)
SCHED(keeps, 36, 6)
SCHED(input_grad, 30, 8)
SCHED(caller_backward, 30, 8)
SCHED(clipping, 30, 8)
SCHED(dropping, 30, 8)
SCHED(recurrent, 32, 20)
SCHED(mixed, 60, 1)

/* GPT training steps with a learning rate and weight decay from C that
 * change every call, the batch shape changing on some calls: every param,
 * AdamW moment, the step count and .grad against a twin trained eagerly. */
START_TEST(test_train_gpt_schedule) {
  for (int b = 0; b < 2; b++)
    for (int c = 0; c < 2; c++) {
      gpt_config cfg = {.n_layer = 1, .n_head = 2, .n_embd = 16, .block_size = 8, .vocab_size = 32, .dtype = KILN_F32,
                        .opt = GPT_ADAMW_DEFAULT};
      gpt A, E;
      ck_assert_int_eq(0, gpt_init(&A, &cfg, 3));
      ck_assert_int_eq(0, gpt_init(&E, &cfg, 3));
      kiln_options o = {.name = "gpt", .n_in = 2, .backend = backends[b], .capture = captures[c]};
      kiln_fn *fn = kiln_compile(gpt_train_body, &A, &o);
      uint64_t seed = 11;
      for (int i = 0; i < 16; i++) {
        A.cfg.opt.lr = E.cfg.opt.lr = 1e-3 * (1 + 0.25 * i);
        A.cfg.opt.weight_decay = E.cfg.opt.weight_decay = i % 4 == 3 ? 0.0 : 0.1;
        int64_t T = i % 6 == 5 ? 6 : 8, x[2 * 2 * 8];
        for (int k = 0; k < 2 * 2 * T; k++) x[k] = (int64_t)(gpt_rand(&seed) % 32);
        kiln_scope_begin();
        kiln_tensor *in[2] = {kiln_tensor_from(KILN_I64, 2, ((int64_t[]){2, T}), x),
                              kiln_tensor_from(KILN_I64, 2, ((int64_t[]){2, T}), x + 2 * T)};
        kiln_tensor *got = NULL, *want = NULL;
        ck_assert_msg(kiln_call(fn, in, &got) == 0, "call %d: %s", i, kiln_last_error());
        ck_assert_int_eq(0, gpt_train_body(&E, in, &want));
        ck_assert_msg(maxdiff(got, want) <= 1e-4, "backend %d capture %d call %d: loss differs by %g", b, c, i,
                      maxdiff(got, want));
        ck_assert_msg(maxdiff(A.step, E.step) == 0, "call %d: step count", i);
        for (int k = 0; k < A.n_params; k++) {
          ck_assert_msg(maxdiff(A.p[k], E.p[k]) <= 1e-4, "backend %d capture %d call %d: param %d differs by %g", b, c, i, k,
                        maxdiff(A.p[k], E.p[k]));
          ck_assert_msg(maxdiff(A.m[k], E.m[k]) <= 1e-4 && maxdiff(A.v[k], E.v[k]) <= 1e-4, "call %d: moments %d", i, k);
          ck_assert_msg(!kiln_grad(A.p[k]) && !kiln_grad(E.p[k]), "call %d: .grad %d left set", i, k);
        }
        kiln_scope_end();
      }
      long long r = stats(fn).replays;
      ck_assert_msg(r >= 8, "backend %d capture %d: %lld replays", b, c, r);
      kiln_fn_free(fn);
      gpt_free(&A);
      gpt_free(&E);
    }
}
END_TEST

/* Threads training models of their own, each with its own function, on
 * one schedule of its own: every call against its eager twin. */
typedef struct {
  schedule_fn sched;
  const char *what;
  long long fewest;
} job;

static void *train_thread(void *arg) {
  job *j = arg;
  j->fewest = run_schedule(j->what, j->sched, 24);
  return NULL;
}

START_TEST(test_train_threads) {
  job jobs[3] = {{base, "thread base", 0}, {two_losses, "thread two_losses", 0}, {recurrent, "thread recurrent", 0}};
  pthread_t th[3];
  for (int i = 0; i < 3; i++) ck_assert_int_eq(0, pthread_create(&th[i], NULL, train_thread, &jobs[i]));
  for (int i = 0; i < 3; i++) {
    pthread_join(th[i], NULL);
    ck_assert_msg(jobs[i].fewest >= 8, "%s: %lld replays", jobs[i].what, jobs[i].fewest);
  }
}
END_TEST

Suite *capture_replay_train_suite(void);
Suite *capture_replay_train_suite(void) {
  Suite *s = suite_create("capture_replay_train");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, test_train_base);
  tcase_add_test(tc, test_train_accumulate);
  tcase_add_test(tc, test_train_zero_where);
  tcase_add_test(tc, test_train_torch_order);
  tcase_add_test(tc, test_train_eval_drops);
  tcase_add_test(tc, test_train_freezing);
  tcase_add_test(tc, test_train_evals);
  tcase_add_test(tc, test_train_two_losses);
  tcase_add_test(tc, test_train_keeps);
  tcase_add_test(tc, test_train_input_grad);
  tcase_add_test(tc, test_train_caller_backward);
  tcase_add_test(tc, test_train_clipping);
  tcase_add_test(tc, test_train_dropping);
  tcase_add_test(tc, test_train_recurrent);
  tcase_add_test(tc, test_train_mixed);
  tcase_add_test(tc, test_train_gpt_schedule);
  tcase_add_test(tc, test_train_threads);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(capture_replay_train_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
