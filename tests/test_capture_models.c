/* Real model bodies compiled and called for many steps the way users call
 * them, each call against the same body run eagerly on a twin model from the
 * same init (weights, optimizer state, RNG seed): outputs, losses, every
 * weight, optimizer state and .grad after each call, on both backends and
 * capture modes, and in check mode.
 *
 * - GPT (examples/gpt.h) training: a warmup + cosine learning rate computed
 *   in C, gradient accumulation (backward every call, a step every k-th
 *   decided by a C counter), clipping by the global norm (a data read),
 *   dropout toggled by a C flag, eval calls in the same function, a smaller
 *   last batch; and the same split over two functions (forward-backward,
 *   then a step that clips the .grads in place, an escape);
 * - Llama (examples/llama.h) generation through the KV cache: prefill and
 *   decode with the position in C, a temperature per step, the next token
 *   picked by a data read inside the body (greedy or sampled), stopping on a
 *   token;
 * - LSTM (examples/lstm.h) over sequences of varying length, training and
 *   inference, and with its state carried across calls (truncated BPTT);
 * - a small CNN (conv2d, batch norm in train and eval mode, pooling)
 *   training with a schedule;
 * - GPT eval calls that replay, between training steps that update the
 *   weights in place. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../examples/gpt.h"
#include "../examples/llama.h"
#include "../examples/lstm.h"
#include "kiln.h"
#include "capture_helpers.h"

/* max |a - b|; inf for another shape, 0 for two NULLs */
static double mdiff(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b) return a == b ? 0 : INFINITY;
  if (kiln_ndim(a) != kiln_ndim(b)) return INFINITY;
  for (int d = 0; d < kiln_ndim(a); d++)
    if (kiln_size(a, d) != kiln_size(b, d)) return INFINITY;
  if (!kiln_numel(a)) return 0;
  kiln_scope_begin();
  kiln_no_grad_begin();
  kiln_tensor *d = kiln_max_axes(kiln_abs(kiln_sub(kiln_cast(a, KILN_F64), kiln_cast(b, KILN_F64))), NULL, 0, false);
  double r = d ? kiln_item(d) : INFINITY;
  kiln_no_grad_end();
  kiln_scope_end();
  return r != r ? INFINITY : r;
}

/* idx and targets (B,T) of pseudo-random symbols below V, in the open scope */
static void gpt_batch_of(int64_t Bn, int64_t T, uint64_t seed, int V, kiln_tensor **idx, kiln_tensor **tgt) {
  int64_t x[2 * 8 * 8];
  ck_assert_int_le(Bn * T, 64);
  for (int64_t i = 0; i < 2 * Bn * T; i++) x[i] = (int64_t)(gpt_rand(&seed) % (uint64_t)V);
  *idx = kiln_tensor_from(KILN_I64, 2, ((int64_t[]){Bn, T}), x);
  *tgt = kiln_tensor_from(KILN_I64, 2, ((int64_t[]){Bn, T}), x + Bn * T);
}

static gpt_config gpt_tiny(kiln_dtype dt) {
  return (gpt_config){.n_layer = 1, .n_head = 2, .n_embd = 16, .block_size = 8, .vocab_size = 32, .dtype = dt,
                      .opt = GPT_ADAMW_DEFAULT};
}

/* ---- GPT: schedule, accumulation, clipping, dropout, eval, last batch ---- */

typedef struct trainer {
  gpt g;
  int train;        /* 1: a training call (backward), 0: an eval call */
  int dropout_on;   /* dropout in training calls */
  int do_step;      /* the optimizer steps this call (the caller's counter) */
  int accum;        /* micro-batches per step */
  int self_count;   /* the body keeps the counters itself (micro, step) */
  int micro;
  int64_t step;     /* optimizer steps: the schedule's position */
  int total, warmup;
  double base_lr, max_norm;
  int inplace_clip; /* scale the .grads in place rather than in the update */
} trainer;

static double sched_lr(const trainer *t) {
  if (t->step < t->warmup) return t->base_lr * (double)(t->step + 1) / t->warmup;
  double q = (double)(t->step - t->warmup) / (double)(t->total - t->warmup);
  return 0.1 * t->base_lr + 0.45 * t->base_lr * (1 + cos(M_PI * fmin(q, 1.0)));
}

/* gpt_hidden with dropout after the embeddings and each residual branch */
static kiln_tensor *hidden_drop(const gpt *g, kiln_tensor *idx, bool training) {
  int64_t T = kiln_size(idx, 1);
  double p = 0.2;
  kiln_tensor *x = kiln_add(kiln_embedding(g->p[GPT_WTE], idx), kiln_slice(g->p[GPT_WPE], 0, 0, T, 1));
  x = kiln_dropout(x, p, training);
  for (int l = 0; l < g->cfg.n_layer; l++) {
    kiln_tensor *a = kiln_layer_norm(x, gpt_layer_param(g, l, GPT_LN1_W), gpt_layer_param(g, l, GPT_LN1_B), GPT_LN_EPS);
    x = kiln_add(x, kiln_dropout(gpt_attention(g, l, a), p, training));
    kiln_tensor *m = kiln_layer_norm(x, gpt_layer_param(g, l, GPT_LN2_W), gpt_layer_param(g, l, GPT_LN2_B), GPT_LN_EPS);
    kiln_tensor *f = kiln_gelu(gpt_linear(m, gpt_layer_param(g, l, GPT_FC_W), gpt_layer_param(g, l, GPT_FC_B)));
    x = kiln_add(x, kiln_dropout(gpt_linear(f, gpt_layer_param(g, l, GPT_FC2_W), gpt_layer_param(g, l, GPT_FC2_B)), p, training));
  }
  int last = g->n_params - 2;
  return kiln_layer_norm(x, g->p[last], g->p[last + 1], GPT_LN_EPS);
}

static kiln_tensor *loss_drop(const gpt *g, kiln_tensor *idx, kiln_tensor *tgt, bool training) {
  int64_t V = g->cfg.vocab_size;
  kiln_tensor *logits = gpt_head(g, hidden_drop(g, idx, training));
  return kiln_cross_entropy(kiln_reshape(logits, 2, ((int64_t[]){-1, V})), kiln_reshape(tgt, 1, ((int64_t[]){-1})));
}

/* gpt_adamw_step with the learning rate of the schedule and the .grads scaled by coef */
static int adamw_clipped(trainer *t, double coef) {
  gpt *g = &t->g;
  kiln_dtype dt = g->cfg.dtype;
  const gpt_adamw *o = &g->cfg.opt;
  double lr = sched_lr(t);
  int bad = 0;
  kiln_no_grad_begin();
  bad |= !kiln_add_(g->step, kiln_scalar(dt, 1));
  kiln_tensor *one = kiln_scalar(dt, 1);
  kiln_tensor *bc1 = kiln_sub(one, kiln_pow(kiln_scalar(dt, o->beta1), g->step));
  kiln_tensor *bc2 = kiln_sub(one, kiln_pow(kiln_scalar(dt, o->beta2), g->step));
  kiln_tensor *step_size = kiln_div(kiln_scalar(dt, lr), bc1), *bc2_sqrt = kiln_sqrt(bc2);
  kiln_tensor *c = kiln_scalar(dt, coef);
  kiln_tensor *decay = kiln_scalar(dt, 1 - lr * o->weight_decay), *eps = kiln_scalar(dt, o->eps);
  for (int i = 0; i < g->n_params && !bad; i++) {
    kiln_tensor *p = g->p[i], *m = g->m[i], *v = g->v[i], *gr = kiln_grad(p);
    if (!gr) return -1;
    if (t->inplace_clip) bad |= !kiln_mul_(gr, c);
    else gr = kiln_mul(gr, c);
    if (kiln_ndim(p) == 2) bad |= !kiln_mul_(p, decay);
    bad |= !kiln_mul_(m, kiln_scalar(dt, o->beta1)) || !kiln_add_(m, kiln_mul(gr, kiln_scalar(dt, 1 - o->beta1)));
    bad |= !kiln_mul_(v, kiln_scalar(dt, o->beta2)) || !kiln_add_(v, kiln_mul(kiln_mul(gr, gr), kiln_scalar(dt, 1 - o->beta2)));
    kiln_tensor *denom = kiln_add(kiln_div(kiln_sqrt(v), bc2_sqrt), eps);
    bad |= !kiln_sub_(p, kiln_mul(kiln_div(m, denom), step_size));
  }
  kiln_no_grad_end();
  for (int i = 0; i < g->n_params; i++) kiln_zero_grad(g->p[i]);
  return bad ? -1 : 0;
}

/* in: idx, targets (B,T); out: the loss (before the step) */
static int trainer_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  trainer *t = ctx;
  gpt *g = &t->g;
  kiln_dtype dt = g->cfg.dtype;
  if (!t->train) {
    kiln_no_grad_begin();
    out[0] = loss_drop(g, in[0], in[1], false);
    kiln_no_grad_end();
    return out[0] ? 0 : -1;
  }
  kiln_scope_begin();
  kiln_tensor *loss = loss_drop(g, in[0], in[1], t->dropout_on);
  int rc = loss && kiln_backward(kiln_mul(loss, kiln_scalar(dt, 1.0 / t->accum))) == 0 ? 0 : -1;
  if (rc == 0) kiln_keep(loss);
  kiln_scope_end();
  if (rc) return -1;
  int step = t->self_count ? ++t->micro % t->accum == 0 : t->do_step;
  if (step) {
    kiln_no_grad_begin();
    kiln_tensor *ss = kiln_scalar(dt, 0);
    for (int i = 0; i < g->n_params; i++) {
      kiln_tensor *gr = kiln_grad(g->p[i]);
      ss = kiln_add(ss, kiln_sum_all(kiln_mul(gr, gr)));
    }
    double norm = sqrt(kiln_item(ss)); /* a break */
    kiln_no_grad_end();
    if (adamw_clipped(t, fmin(1.0, t->max_norm / (norm + 1e-6)))) return -1;
    if (t->self_count) t->step++;
  }
  out[0] = loss;
  return 0;
}

static void trainer_init(trainer *t, kiln_dtype dt) {
  memset(t, 0, sizeof *t);
  gpt_config c = gpt_tiny(dt);
  ck_assert_int_eq(0, gpt_init(&t->g, &c, 7));
  t->accum = 2, t->total = 12, t->warmup = 3, t->base_lr = 3e-3, t->max_norm = 0.5, t->dropout_on = 1;
}

/* model state of a and e alike, after call `what` */
static void gpt_same(const gpt *a, const gpt *e, double tol, const char *what) {
  for (int i = 0; i < a->n_params; i++) {
    double dp = mdiff(a->p[i], e->p[i]), dm = mdiff(a->m[i], e->m[i]), dv = mdiff(a->v[i], e->v[i]);
    double dg = mdiff(kiln_grad(a->p[i]), kiln_grad(e->p[i]));
    ck_assert_msg(dp <= tol && dm <= tol && dv <= tol && dg <= tol, "%s: param %d: p %g m %g v %g .grad %g", what, i, dp, dm, dv, dg);
  }
  ck_assert_msg(mdiff(a->step, e->step) == 0, "%s: step count", what);
}

static void gpt_train_run(int backend, int capture, int check, int self_count, int inplace_clip, kiln_dtype dt) {
  trainer A, E;
  trainer_init(&A, dt), trainer_init(&E, dt);
  A.self_count = E.self_count = self_count;
  A.inplace_clip = E.inplace_clip = inplace_clip;
  kiln_options o = {.name = "gpt_train", .n_in = 2, .backend = backend, .capture = capture, .check = check};
  kiln_fn *fn = kiln_compile(trainer_body, &A, &o);
  ck_assert_ptr_nonnull(fn);
  double tol = dt == KILN_F32 ? 2e-5 : 1e-10;
  int counter = 0;
  /* 3 epochs of 5 batches, the last of each smaller and shorter; an eval call after batch 2; no dropout in epoch 1 */
  for (int ep = 0; ep < 3; ep++)
    for (int b = 0; b < 5; b++)
      for (int mode = 0; mode < 2; mode++) {
        if (mode == 1 && b != 2) continue;
        int64_t Bn = b == 4 ? 2 : 3, T = b == 4 ? 6 : 8;
        char what[64];
        snprintf(what, sizeof what, "epoch %d batch %d %s", ep, b, mode ? "eval" : "train");
        kiln_scope_begin();
        kiln_tensor *idx, *tgt, *lc = NULL, *le = NULL;
        gpt_batch_of(Bn, T, 100 + (uint64_t)(ep * 5 + b), 32, &idx, &tgt);
        kiln_tensor *in[2] = {idx, tgt};
        A.train = E.train = mode == 0;
        A.dropout_on = E.dropout_on = ep != 1;
        A.do_step = E.do_step = mode == 0 && counter % A.accum == A.accum - 1;
        uint64_t seed = 1000 + (uint64_t)counter * 7 + (uint64_t)mode;
        kiln_manual_seed(seed);
        ck_assert_msg(kiln_call(fn, in, &lc) == 0, "%s: %s", what, kiln_last_error());
        kiln_manual_seed(seed);
        ck_assert_msg(trainer_body(&E, in, &le) == 0, "%s: %s", what, kiln_last_error());
        ck_assert_msg(mdiff(lc, le) <= tol, "%s: loss %.9g compiled, %.9g eager", what, kiln_item(lc), kiln_item(le));
        kiln_scope_end();
        if (mode == 0) counter++;
        if (A.do_step && !self_count) A.step++, E.step++;
        gpt_same(&A.g, &E.g, tol, what);
        ck_assert_int_eq(A.step, E.step);
      }
  ck_assert_int_eq(0, stats(fn).check_fails);
  kiln_fn_free(fn);
  gpt_free(&A.g), gpt_free(&E.g);
}

START_TEST(test_gpt_train_llvm) { gpt_train_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 0, 0, 0, KILN_F32); }
END_TEST

START_TEST(test_gpt_train_llvm_record_counters_in_body) { gpt_train_run(KILN_BACKEND_LLVM, KILN_CAPTURE_RECORD, 0, 1, 0, KILN_F32); }
END_TEST

START_TEST(test_gpt_train_interp) { gpt_train_run(KILN_BACKEND_INTERP, KILN_CAPTURE_AUTO, 0, 0, 0, KILN_F32); }
END_TEST

/* the .grads scaled in place: a write into a .grad the call began with, past which the call runs eagerly */
START_TEST(test_gpt_train_inplace_clip) {
  gpt_train_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 0, 0, 1, KILN_F32);
  gpt_train_run(KILN_BACKEND_INTERP, KILN_CAPTURE_RECORD, 0, 1, 1, KILN_F64);
}
END_TEST

START_TEST(test_gpt_train_check_mode) {
  gpt_train_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 1, 0, 0, KILN_F32);
  gpt_train_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 1, 0, 1, KILN_F32);
}
END_TEST

/* ---- GPT over two functions: forward-backward k times, then a step ---- */

typedef struct split {
  gpt g;
  double lr, max_norm, scale;
  int inplace; /* clip the .grads in place, then gpt_adamw_step; else SGD on scaled copies */
} split;

/* in: idx, targets; out: the loss; leaves the .grads (accumulated) */
static int fb_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  split *o = ctx;
  kiln_scope_begin();
  kiln_tensor *loss = gpt_loss(&o->g, in[0], in[1]);
  int rc = loss && kiln_backward(kiln_mul(loss, kiln_scalar(o->g.cfg.dtype, o->scale))) == 0 ? 0 : -1;
  if (!rc) kiln_keep(loss);
  kiln_scope_end();
  out[0] = loss;
  return rc;
}

/* no inputs; out: the global norm of the .grads, which it clips and applies */
static int step_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)in;
  split *o = ctx;
  gpt *g = &o->g;
  kiln_dtype dt = g->cfg.dtype;
  kiln_no_grad_begin();
  kiln_tensor *ss = kiln_scalar(dt, 0);
  for (int i = 0; i < g->n_params; i++) ss = kiln_add(ss, kiln_sum_all(kiln_mul(kiln_grad(g->p[i]), kiln_grad(g->p[i]))));
  kiln_tensor *norm = kiln_sqrt(ss);
  double coef = fmin(1.0, o->max_norm / (kiln_item(norm) + 1e-6));
  for (int i = 0; i < g->n_params && o->inplace; i++) kiln_mul_(kiln_grad(g->p[i]), kiln_scalar(dt, coef));
  for (int i = 0; i < g->n_params && !o->inplace; i++)
    kiln_sub_(g->p[i], kiln_mul(kiln_mul(kiln_grad(g->p[i]), kiln_scalar(dt, coef)), kiln_scalar(dt, o->lr)));
  kiln_no_grad_end();
  g->cfg.opt.lr = o->lr;
  if (o->inplace) {
    if (gpt_adamw_step(g)) return -1;
  } else {
    for (int i = 0; i < g->n_params; i++) kiln_zero_grad(g->p[i]);
  }
  out[0] = norm;
  return 0;
}

static void split_run(int backend, int capture, int check, int inplace) {
  gpt_config c = gpt_tiny(KILN_F32);
  split A = {0}, E = {0};
  ck_assert_int_eq(0, gpt_init(&A.g, &c, 4));
  ck_assert_int_eq(0, gpt_init(&E.g, &c, 4));
  A.max_norm = E.max_norm = 0.3;
  A.inplace = E.inplace = inplace;
  kiln_fn *fb = kiln_compile(fb_body, &A, &(kiln_options){.name = "fb", .n_in = 2, .backend = backend, .capture = capture, .check = check});
  kiln_fn *st = kiln_compile(step_body, &A, &(kiln_options){.name = "st", .backend = backend, .capture = capture, .check = check});
  enum { K = 3 };
  for (int s = 0; s < 15; s++) {
    A.scale = E.scale = 1.0 / K;
    kiln_scope_begin();
    kiln_tensor *idx, *tgt, *lc = NULL, *le = NULL;
    gpt_batch_of(s % 5 == 4 ? 1 : 2, 8, 900 + (uint64_t)s, 32, &idx, &tgt);
    kiln_tensor *in[2] = {idx, tgt};
    ck_assert_msg(kiln_call(fb, in, &lc) == 0, "%s", kiln_last_error());
    ck_assert_msg(fb_body(&E, in, &le) == 0, "%s", kiln_last_error());
    ck_assert_msg(mdiff(lc, le) <= 1e-5, "call %d: loss differs by %g", s, mdiff(lc, le));
    if (s % K == K - 1) {
      A.lr = E.lr = 1e-2 * (1 + cos(s * 0.3));
      kiln_tensor *nc = NULL, *ne = NULL;
      ck_assert_msg(kiln_call(st, NULL, &nc) == 0, "%s", kiln_last_error());
      ck_assert_msg(step_body(&E, NULL, &ne) == 0, "%s", kiln_last_error());
      ck_assert_msg(mdiff(nc, ne) <= 1e-5, "call %d: norm differs by %g", s, mdiff(nc, ne));
    }
    kiln_scope_end();
    char what[32];
    snprintf(what, sizeof what, "call %d", s);
    gpt_same(&A.g, &E.g, 1e-5, what);
  }
  ck_assert_int_eq(0, stats(fb).check_fails);
  kiln_fn_free(fb), kiln_fn_free(st);
  gpt_free(&A.g), gpt_free(&E.g);
}

START_TEST(test_gpt_split_step) {
  split_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 0, 0);
  split_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 0, 1);
  split_run(KILN_BACKEND_INTERP, KILN_CAPTURE_RECORD, 0, 1);
  split_run(KILN_BACKEND_LLVM, KILN_CAPTURE_RECORD, 1, 0);
}
END_TEST

/* Check mode on a step that clips the .grads in place: the rest of each call
 * runs eagerly, and writes the moments, which the call's recording never
 * saw. The check's eager run must not apply the update a second time from
 * the call's results (it did, and returned those as "the eager results"). */
START_TEST(test_check_mode_call_that_escapes) { split_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 1, 1); }
END_TEST

/* ---- Llama: prefill and decode through the KV cache, the token picked in the body ---- */

typedef struct gen {
  llama m;
  double temp;  /* per step, from the caller */
  double u;     /* a uniform number for sampling, from the caller; < 0: greedy */
  int64_t next; /* the token the body picked */
  int self_pos; /* the body moves m.pos on */
  int tail;     /* after the pick, output 1 is made from the token: 1 by kiln_tensor_from, 2 by kiln_full */
} gen;

static const llama_config LTINY = {.dim = 16, .hidden_dim = 24, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2,
                                   .vocab_size = 40, .seq_len = 24, .dtype = KILN_F32};

/* in: tokens (T,) at positions m.pos..; out[0]: next-token probabilities (V,), out[1]: the logits (1,V) */
static int gen_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  gen *g = ctx;
  kiln_dtype dt = g->m.cfg.dtype;
  int64_t T = kiln_size(in[0], 0), V = g->m.cfg.vocab_size;
  kiln_no_grad_begin();
  kiln_tensor *logits = llama_forward(&g->m, in[0], g->m.pos, true, NULL);
  kiln_tensor *last = kiln_slice(logits, 0, T - 1, T, 1);
  kiln_tensor *probs = kiln_softmax(kiln_reshape(kiln_div(last, kiln_scalar(dt, g->temp)), 1, ((int64_t[]){V})), 0);
  if (g->u < 0) {
    g->next = (int64_t)kiln_item(kiln_argmax(probs, 0, false));
  } else {
    float p[64];
    kiln_read(probs, p, sizeof(float) * (size_t)V);
    double c = 0;
    g->next = V - 1;
    for (int64_t i = 0; i < V; i++)
      if ((c += p[i]) > g->u) {
        g->next = i;
        break;
      }
  }
  out[0] = probs, out[1] = last;
  if (g->tail) {
    kiln_tensor *tok = g->tail == 1 ? kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &g->next)
                                    : kiln_full(KILN_I64, 1, ((int64_t[]){1}), (double)g->next);
    out[1] = kiln_add(last, kiln_sum_all(kiln_embedding(g->m.tok_emb, tok)));
  }
  kiln_no_grad_end();
  if (g->self_pos) g->m.pos += T;
  return out[0] && out[1] ? 0 : -1;
}

static void gen_run(int backend, int capture, int check, int self_pos, int tail, int sample) {
  gen A = {0}, E = {0};
  ck_assert_int_eq(0, llama_init(&A.m, &LTINY, 3));
  ck_assert_int_eq(0, llama_init(&E.m, &LTINY, 3));
  A.self_pos = E.self_pos = self_pos;
  A.tail = E.tail = tail;
  kiln_options o = {.name = "gen", .n_in = 1, .n_out = 2, .backend = backend, .capture = capture, .check = check};
  kiln_fn *fn = kiln_compile(gen_body, &A, &o);
  uint64_t rng = 42;
  for (int round = 0; round < 3; round++) { /* three prompts, from position 0 each */
    int64_t toks[32], np = 2 + round * 2, len = np, stop = 7 + round;
    for (int i = 0; i < np; i++) toks[i] = 1 + (round * 7 + i * 3) % 39;
    A.m.pos = E.m.pos = 0;
    int64_t *feed = toks, nfeed = np;
    for (int step = 0; len < LTINY.seq_len; step++) {
      A.temp = E.temp = 0.5 + 0.25 * (step % 5);
      A.u = E.u = sample ? gpt_rand_unit(&rng) : -1;
      kiln_scope_begin();
      kiln_tensor *x = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){nfeed}), feed);
      kiln_tensor *oc[2] = {0}, *oe[2] = {0};
      ck_assert_msg(kiln_call(fn, &x, oc) == 0, "%s", kiln_last_error());
      ck_assert_msg(gen_body(&E, &x, oe) == 0, "%s", kiln_last_error());
      ck_assert_msg(mdiff(oc[0], oe[0]) <= 1e-5 && mdiff(oc[1], oe[1]) <= 1e-4, "round %d step %d: probs %g logits %g", round,
                    step, mdiff(oc[0], oe[0]), mdiff(oc[1], oe[1]));
      ck_assert_msg(A.next == E.next, "round %d step %d: token %lld compiled, %lld eager", round, step, (long long)A.next,
                    (long long)E.next);
      kiln_scope_end();
      for (int l = 0; l < LTINY.n_layers; l++)
        ck_assert_msg(mdiff(A.m.kc[l], E.m.kc[l]) <= 1e-5 && mdiff(A.m.vc[l], E.m.vc[l]) <= 1e-5, "round %d step %d: cache %d", round, step, l);
      if (!self_pos) A.m.pos += nfeed, E.m.pos += nfeed;
      ck_assert_int_eq(A.m.pos, E.m.pos);
      toks[len++] = E.next;
      feed = &toks[len - 1], nfeed = 1;
      if (E.next == stop) break;
    }
  }
  kiln_fn_stats st = stats(fn);
  ck_assert_int_eq(0, st.check_fails);
  if (tail != 1) ck_assert_int_le(st.traces, 8); /* a prefill length each, the decode step; no storm */
  kiln_fn_free(fn);
  llama_free(&A.m), llama_free(&E.m);
}

START_TEST(test_llama_generate) {
  gen_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 0, 0, 0, 0);
  gen_run(KILN_BACKEND_LLVM, KILN_CAPTURE_RECORD, 0, 1, 1, 0);
  gen_run(KILN_BACKEND_INTERP, KILN_CAPTURE_AUTO, 0, 0, 1, 1);
  gen_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 0, 0, 2, 1);
}
END_TEST

START_TEST(test_llama_generate_check_mode) {
  gen_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 1, 0, 1, 0);
  gen_run(KILN_BACKEND_INTERP, KILN_CAPTURE_RECORD, 1, 0, 2, 1);
}
END_TEST

/* ---- LSTM over sequences of varying length ---- */

enum { LI = 3, LH = 4 };

typedef struct rnn {
  lstm_cell_w c;
  kiln_tensor *wout, *bout; /* (H,2), (2) */
  kiln_tensor *mw[5];       /* momentum */
  int train, last_only;     /* last_only: the loss of the last step (a size read) */
  double lr, mom;
} rnn;

static void rnn_params(rnn *r, kiln_tensor **p) { p[0] = r->c.wx, p[1] = r->c.wh, p[2] = r->c.bias, p[3] = r->wout, p[4] = r->bout; }

static void rnn_init(rnn *r) {
  memset(r, 0, sizeof *r);
  r->c.hidden = LH;
  int64_t s[5][2] = {{LI, 4 * LH}, {LH, 4 * LH}, {4 * LH, 0}, {LH, 2}, {2, 0}};
  int nd[5] = {2, 2, 1, 2, 1};
  kiln_tensor *p[5];
  kiln_scope_begin();
  for (int i = 0; i < 5; i++) {
    p[i] = kiln_keep(kiln_mul(kiln_randn(KILN_F32, nd[i], s[i], 11 + (uint64_t)i), kiln_scalar(KILN_F32, 0.4)));
    kiln_requires_grad(p[i], true);
    r->mw[i] = kiln_keep(kiln_zeros(KILN_F32, nd[i], s[i]));
  }
  kiln_scope_end();
  r->c.wx = p[0], r->c.wh = p[1], r->c.bias = p[2], r->wout = p[3], r->bout = p[4];
}

static void rnn_free(rnn *r) {
  kiln_tensor *p[5];
  rnn_params(r, p);
  for (int i = 0; i < 5; i++) kiln_release(p[i]), kiln_release(r->mw[i]);
}

/* in: x (T,B,I), y (T,B,2) or (B,2); out: loss, predictions */
static int rnn_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  rnn *r = ctx;
  if (!r->train) kiln_no_grad_begin();
  kiln_scope_begin();
  kiln_tensor *hs = lstm_layer(&r->c, in[0]);
  if (r->last_only) {
    int64_t T = kiln_size(in[0], 0);
    hs = kiln_squeeze(kiln_slice(hs, 0, T - 1, T, 1), 0);
  }
  kiln_tensor *pred = kiln_add(kiln_matmul(hs, r->wout), r->bout);
  kiln_tensor *loss = kiln_mse_loss(pred, in[1]);
  int bad = !loss || (r->train && kiln_backward(loss) != 0);
  kiln_keep(loss), kiln_keep(pred);
  kiln_scope_end();
  if (!r->train) kiln_no_grad_end();
  if (bad) return -1;
  if (r->train) {
    kiln_tensor *p[5];
    rnn_params(r, p);
    kiln_no_grad_begin();
    for (int i = 0; i < 5; i++) {
      kiln_mul_(r->mw[i], kiln_scalar(KILN_F32, r->mom));
      kiln_add_(r->mw[i], kiln_grad(p[i]));
      kiln_sub_(p[i], kiln_mul(r->mw[i], kiln_scalar(KILN_F32, r->lr)));
    }
    kiln_no_grad_end();
    for (int i = 0; i < 5; i++) kiln_zero_grad(p[i]);
  }
  out[0] = loss, out[1] = pred;
  return 0;
}

static void rnn_run(int backend, int capture, int check, int last_only) {
  rnn A, E;
  rnn_init(&A), rnn_init(&E);
  A.last_only = E.last_only = last_only;
  kiln_options o = {.name = "lstm", .n_in = 2, .n_out = 2, .backend = backend, .capture = capture, .check = check};
  kiln_fn *fn = kiln_compile(rnn_body, &A, &o);
  int64_t Ts[] = {5, 3, 7, 1, 4, 6, 2, 5, 8, 3, 1, 7}, Bs[] = {2, 2, 3, 2, 1, 2, 3, 2, 2, 1, 2, 3};
  for (int s = 0; s < 24; s++) {
    int64_t T = Ts[s % 12], Bn = Bs[s % 12];
    A.train = E.train = s % 4 != 3;
    A.lr = E.lr = 0.05 * (1.0 - s / 60.0);
    A.mom = E.mom = s < 4 ? 0.0 : 0.9;
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 3, ((int64_t[]){T, Bn, LI}), 100 + (uint64_t)s);
    kiln_tensor *y = last_only ? kiln_randn(KILN_F32, 2, ((int64_t[]){Bn, 2}), 200 + (uint64_t)s)
                               : kiln_randn(KILN_F32, 3, ((int64_t[]){T, Bn, 2}), 200 + (uint64_t)s);
    kiln_tensor *in[2] = {x, y}, *oc[2] = {0}, *oe[2] = {0};
    ck_assert_msg(kiln_call(fn, in, oc) == 0, "%s", kiln_last_error());
    ck_assert_msg(rnn_body(&E, in, oe) == 0, "%s", kiln_last_error());
    ck_assert_msg(mdiff(oc[0], oe[0]) <= 1e-5 && mdiff(oc[1], oe[1]) <= 1e-5, "call %d (T %lld): loss %g, predictions %g", s,
                  (long long)T, mdiff(oc[0], oe[0]), mdiff(oc[1], oe[1]));
    kiln_scope_end();
    kiln_tensor *pa[5], *pe[5];
    rnn_params(&A, pa), rnn_params(&E, pe);
    for (int i = 0; i < 5; i++)
      ck_assert_msg(mdiff(pa[i], pe[i]) <= 1e-5 && mdiff(A.mw[i], E.mw[i]) <= 1e-5 && !kiln_grad(pa[i]) && !kiln_grad(pe[i]),
                    "call %d param %d: %g, momentum %g", s, i, mdiff(pa[i], pe[i]), mdiff(A.mw[i], E.mw[i]));
  }
  kiln_fn_stats st = stats(fn);
  ck_assert_int_eq(0, st.check_fails);
  ck_assert_int_le(st.traces, 10); /* the shapes and modes seen in the first 12 calls; the next 12 hit */
  kiln_fn_free(fn);
  rnn_free(&A), rnn_free(&E);
}

START_TEST(test_lstm_lengths) {
  rnn_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 0, 0);
  rnn_run(KILN_BACKEND_LLVM, KILN_CAPTURE_RECORD, 0, 1);
  rnn_run(KILN_BACKEND_INTERP, KILN_CAPTURE_AUTO, 0, 1);
  rnn_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 1, 0);
}
END_TEST

/* ---- LSTM with its state carried from call to call (truncated BPTT) ---- */

typedef struct tbptt {
  lstm_cell_w c;
  kiln_tensor *h, *cs, *wout; /* the state (B,H) from the last call, no history */
  double lr;
  int train;
} tbptt;

/* in: x (T,B,I), y (T,B,2); out: loss, the new h */
static int tbptt_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  tbptt *m = ctx;
  if (!m->train) kiln_no_grad_begin();
  kiln_tensor *init[2] = {m->h, m->cs}, *last[2], *hs;
  if (kiln_scan(lstm_cell, &m->c, 2, init, 1, &in[0], last, 1, &hs)) return -1;
  kiln_tensor *loss = kiln_mse_loss(kiln_matmul(hs, m->wout), in[1]);
  if (m->train && kiln_backward(loss)) return -1;
  if (!m->train) kiln_no_grad_end();
  kiln_release(m->h), kiln_release(m->cs);
  kiln_no_grad_begin();
  m->h = kiln_retain(kiln_mul(last[0], kiln_scalar(KILN_F32, 1)));
  m->cs = kiln_retain(kiln_mul(last[1], kiln_scalar(KILN_F32, 1)));
  kiln_no_grad_end();
  if (m->train) {
    kiln_tensor *p[4] = {m->c.wx, m->c.wh, m->c.bias, m->wout};
    kiln_no_grad_begin();
    for (int i = 0; i < 4; i++) kiln_sub_(p[i], kiln_mul(kiln_grad(p[i]), kiln_scalar(KILN_F32, m->lr)));
    kiln_no_grad_end();
    for (int i = 0; i < 4; i++) kiln_zero_grad(p[i]);
  }
  out[0] = loss, out[1] = m->h;
  return 0;
}

static void tbptt_init(tbptt *m) {
  memset(m, 0, sizeof *m);
  m->c.hidden = LH;
  kiln_scope_begin();
  m->c.wx = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 2, ((int64_t[]){LI, 4 * LH}), 1), kiln_scalar(KILN_F32, 0.4)));
  m->c.wh = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 2, ((int64_t[]){LH, 4 * LH}), 2), kiln_scalar(KILN_F32, 0.4)));
  m->c.bias = kiln_keep(kiln_zeros(KILN_F32, 1, ((int64_t[]){4 * LH})));
  m->wout = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 2, ((int64_t[]){LH, 2}), 3), kiln_scalar(KILN_F32, 0.4)));
  m->h = kiln_keep(kiln_zeros(KILN_F32, 2, ((int64_t[]){2, LH})));
  m->cs = kiln_keep(kiln_zeros(KILN_F32, 2, ((int64_t[]){2, LH})));
  kiln_scope_end();
  kiln_tensor *p[4] = {m->c.wx, m->c.wh, m->c.bias, m->wout};
  for (int i = 0; i < 4; i++) kiln_requires_grad(p[i], true);
}

static void tbptt_free(tbptt *m) {
  kiln_tensor *p[6] = {m->c.wx, m->c.wh, m->c.bias, m->wout, m->h, m->cs};
  for (int i = 0; i < 6; i++) kiln_release(p[i]);
}

/* (No check mode: the body swaps the state in its context, a C side effect
 * that the check's second run would repeat.) */
static void tbptt_run(int backend, int capture) {
  tbptt A, E;
  tbptt_init(&A), tbptt_init(&E);
  kiln_fn *fn = kiln_compile(tbptt_body, &A, &(kiln_options){.name = "tbptt", .n_in = 2, .n_out = 2, .backend = backend, .capture = capture});
  int64_t Ts[] = {4, 4, 3, 5, 4, 2, 4, 4, 6, 1};
  for (int s = 0; s < 20; s++) {
    int64_t T = Ts[s % 10];
    A.lr = E.lr = 0.1 / (1 + s);
    A.train = E.train = s % 6 != 5;
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 3, ((int64_t[]){T, 2, LI}), 40 + (uint64_t)s);
    kiln_tensor *y = kiln_randn(KILN_F32, 3, ((int64_t[]){T, 2, 2}), 80 + (uint64_t)s);
    kiln_tensor *in[2] = {x, y}, *oc[2] = {0}, *oe[2] = {0};
    ck_assert_msg(kiln_call(fn, in, oc) == 0, "%s", kiln_last_error());
    ck_assert_msg(tbptt_body(&E, in, oe) == 0, "%s", kiln_last_error());
    ck_assert_msg(mdiff(oc[0], oe[0]) <= 1e-5 && mdiff(oc[1], oe[1]) <= 1e-5, "call %d: %g %g", s, mdiff(oc[0], oe[0]), mdiff(oc[1], oe[1]));
    kiln_scope_end();
    ck_assert_msg(mdiff(A.h, E.h) <= 1e-5 && mdiff(A.cs, E.cs) <= 1e-5, "call %d: state", s);
    kiln_tensor *pa[4] = {A.c.wx, A.c.wh, A.c.bias, A.wout}, *pe[4] = {E.c.wx, E.c.wh, E.c.bias, E.wout};
    for (int i = 0; i < 4; i++) ck_assert_msg(mdiff(pa[i], pe[i]) <= 1e-5 && !kiln_grad(pa[i]), "call %d param %d", s, i);
  }
  kiln_fn_free(fn);
  tbptt_free(&A), tbptt_free(&E);
}

START_TEST(test_lstm_state_across_calls) {
  tbptt_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO);
  tbptt_run(KILN_BACKEND_LLVM, KILN_CAPTURE_RECORD);
  tbptt_run(KILN_BACKEND_INTERP, KILN_CAPTURE_AUTO);
}
END_TEST

/* ---- a small CNN: conv, batch norm in train and eval mode, pooling, a cosine schedule ---- */

enum { CNP = 8 };

typedef struct cnn {
  kiln_tensor *p[CNP];        /* w1 (4,1,3,3), b1, g1, be1 (4), w2 (4,4,3,3), g2, be2 (4), fc (4,3) */
  kiln_tensor *rm[2], *rv[2]; /* running statistics */
  int train, step, total, avg;
  double base_lr;
} cnn;

static void cnn_init(cnn *m) {
  memset(m, 0, sizeof *m);
  int64_t s[CNP][4] = {{4, 1, 3, 3}, {4}, {4}, {4}, {4, 4, 3, 3}, {4}, {4}, {4, 3}};
  int nd[CNP] = {4, 1, 1, 1, 4, 1, 1, 2};
  kiln_scope_begin();
  for (int i = 0; i < CNP; i++) {
    kiln_tensor *t = i == 2 || i == 5                ? kiln_ones(KILN_F32, nd[i], s[i])
                     : i == 1 || i == 3 || i == 6 ? kiln_zeros(KILN_F32, nd[i], s[i])
                                                  : kiln_mul(kiln_randn(KILN_F32, nd[i], s[i], 31 + (uint64_t)i), kiln_scalar(KILN_F32, 0.3));
    m->p[i] = kiln_keep(t);
    kiln_requires_grad(m->p[i], true);
  }
  for (int k = 0; k < 2; k++)
    m->rm[k] = kiln_keep(kiln_zeros(KILN_F32, 1, ((int64_t[]){4}))), m->rv[k] = kiln_keep(kiln_ones(KILN_F32, 1, ((int64_t[]){4})));
  kiln_scope_end();
  m->total = 20, m->base_lr = 0.1;
}

static void cnn_free(cnn *m) {
  for (int i = 0; i < CNP; i++) kiln_release(m->p[i]);
  for (int k = 0; k < 2; k++) kiln_release(m->rm[k]), kiln_release(m->rv[k]);
}

/* in: x (N,1,H,W), y (N,) i64; out: loss, logits */
static int cnn_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  cnn *m = ctx;
  bool tr = m->train;
  if (!tr) kiln_no_grad_begin();
  kiln_scope_begin();
  kiln_tensor *h = kiln_conv2d(in[0], m->p[0], m->p[1], NULL, ((int[]){1, 1}), NULL, 1);
  h = kiln_relu(kiln_batch_norm(h, m->rm[0], m->rv[0], m->p[2], m->p[3], tr, 0.1, 1e-5));
  h = m->avg ? kiln_avg_pool2d(h, ((int[]){2, 2}), NULL, NULL) : kiln_max_pool2d(h, ((int[]){2, 2}), NULL, NULL);
  h = kiln_conv2d(h, m->p[4], NULL, NULL, ((int[]){1, 1}), NULL, 1);
  h = kiln_relu(kiln_batch_norm(h, m->rm[1], m->rv[1], m->p[5], m->p[6], tr, 0.1, 1e-5));
  h = kiln_reshape(kiln_adaptive_avg_pool2d(h, ((int[]){1, 1})), 2, ((int64_t[]){kiln_size(in[0], 0), 4}));
  kiln_tensor *logits = kiln_matmul(h, m->p[7]);
  kiln_tensor *loss = kiln_cross_entropy(logits, in[1]);
  int bad = !loss || (tr && kiln_backward(loss) != 0);
  kiln_keep(loss), kiln_keep(logits);
  kiln_scope_end();
  if (!tr) kiln_no_grad_end();
  if (bad) return -1;
  if (tr) {
    double lr = m->base_lr * 0.5 * (1 + cos(M_PI * m->step / m->total));
    kiln_no_grad_begin();
    for (int i = 0; i < CNP; i++) {
      kiln_tensor *g = kiln_grad(m->p[i]);
      if (i == 0 || i == 4 || i == 7) g = kiln_add(g, kiln_mul(m->p[i], kiln_scalar(KILN_F32, 1e-3))); /* weight decay */
      kiln_sub_(m->p[i], kiln_mul(g, kiln_scalar(KILN_F32, lr)));
    }
    kiln_no_grad_end();
    for (int i = 0; i < CNP; i++) kiln_zero_grad(m->p[i]);
  }
  out[0] = loss, out[1] = logits;
  return 0;
}

static void cnn_run(int backend, int capture, int check, int avg) {
  cnn A, E;
  cnn_init(&A), cnn_init(&E);
  A.avg = E.avg = avg;
  kiln_options o = {.name = "cnn", .n_in = 2, .n_out = 2, .backend = backend, .capture = capture, .check = check};
  kiln_fn *fn = kiln_compile(cnn_body, &A, &o);
  for (int s = 0; s < 24; s++) {
    int64_t N = s % 4 == 3 ? 2 : 4, HW = s % 6 == 5 ? 6 : 8; /* a smaller last batch, now and then smaller images */
    A.train = E.train = s % 5 != 4;
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 4, ((int64_t[]){N, 1, HW, HW}), 300 + (uint64_t)s);
    int64_t yv[4];
    for (int i = 0; i < N; i++) yv[i] = (s + i) % 3;
    kiln_tensor *y = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){N}), yv);
    kiln_tensor *in[2] = {x, y}, *oc[2] = {0}, *oe[2] = {0};
    ck_assert_msg(kiln_call(fn, in, oc) == 0, "%s", kiln_last_error());
    ck_assert_msg(cnn_body(&E, in, oe) == 0, "%s", kiln_last_error());
    ck_assert_msg(mdiff(oc[0], oe[0]) <= 1e-5 && mdiff(oc[1], oe[1]) <= 1e-5, "call %d: loss %g logits %g", s, mdiff(oc[0], oe[0]),
                  mdiff(oc[1], oe[1]));
    kiln_scope_end();
    if (A.train) A.step++, E.step++;
    for (int i = 0; i < CNP; i++)
      ck_assert_msg(mdiff(A.p[i], E.p[i]) <= 1e-5 && !kiln_grad(A.p[i]), "call %d param %d: %g", s, i, mdiff(A.p[i], E.p[i]));
    for (int k = 0; k < 2; k++)
      ck_assert_msg(mdiff(A.rm[k], E.rm[k]) <= 1e-5 && mdiff(A.rv[k], E.rv[k]) <= 1e-5, "call %d: batch norm %d statistics", s, k);
  }
  kiln_fn_stats st = stats(fn);
  ck_assert_int_eq(0, st.check_fails);
  ck_assert_int_le(st.traces, 8);
  kiln_fn_free(fn);
  cnn_free(&A), cnn_free(&E);
}

START_TEST(test_cnn_batch_norm_schedule) {
  cnn_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 0, 0);
  cnn_run(KILN_BACKEND_LLVM, KILN_CAPTURE_RECORD, 0, 1);
  cnn_run(KILN_BACKEND_INTERP, KILN_CAPTURE_AUTO, 0, 1);
  cnn_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 1, 0);
}
END_TEST

/* ---- GPT eval calls that replay, between training steps, on one of two models ---- */

typedef struct evaler {
  gpt *models[2]; /* the trained one, and an average of it kept in place */
  int which;
  double temp, p; /* temperature; dropout p (0: none) */
} evaler;

/* in: idx (B,T); out: next-symbol probabilities (B,V) */
static int eval_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  evaler *e = ctx;
  gpt *g = e->models[e->which];
  out[0] = kiln_softmax(kiln_div(gpt_next_logits(g, in[0]), kiln_scalar(g->cfg.dtype, e->temp)), -1);
  if (e->p > 0) out[0] = kiln_dropout(out[0], e->p, true);
  return out[0] ? 0 : -1;
}

static void eval_run(int backend, int capture, int check, int caller_no_grad, int train_compiled) {
  gpt_config c = gpt_tiny(KILN_F32);
  gpt A, A2, E, E2;
  ck_assert_int_eq(0, gpt_init(&A, &c, 1));
  ck_assert_int_eq(0, gpt_init(&E, &c, 1));
  ck_assert_int_eq(0, gpt_init(&A2, &c, 2));
  ck_assert_int_eq(0, gpt_init(&E2, &c, 2));
  evaler ea = {{&A, &A2}, 0, 1.0, 0}, ee = {{&E, &E2}, 0, 1.0, 0};
  kiln_fn *fn = kiln_compile(eval_body, &ea, &(kiln_options){.name = "eval", .n_in = 1, .backend = backend, .capture = capture, .check = check});
  kiln_fn *tf = kiln_compile(gpt_train_body, &A, &(kiln_options){.name = "train", .n_in = 2, .backend = backend, .capture = capture});
  for (int s = 0; s < 30; s++) {
    kiln_scope_begin();
    kiln_tensor *idx, *tgt;
    gpt_batch_of(s % 7 == 6 ? 1 : 2, s % 5 == 4 ? 5 : 8, 500 + (uint64_t)s, 32, &idx, &tgt);
    if (s % 3 == 0) {
      kiln_tensor *in[2] = {idx, tgt}, *l = NULL;
      if (train_compiled) ck_assert_msg(kiln_call(tf, in, &l) == 0, "%s", kiln_last_error());
      else ck_assert_ptr_nonnull(gpt_train_step(&A, idx, tgt));
      ck_assert_ptr_nonnull(gpt_train_step(&E, idx, tgt));
    }
    if (s % 4 == 1) { /* the second model moves halfway to the first, in place */
      kiln_no_grad_begin();
      for (int i = 0; i < A.n_params; i++) {
        kiln_mul_(A2.p[i], kiln_scalar(KILN_F32, 0.5)), kiln_add_(A2.p[i], kiln_mul(A.p[i], kiln_scalar(KILN_F32, 0.5)));
        kiln_mul_(E2.p[i], kiln_scalar(KILN_F32, 0.5)), kiln_add_(E2.p[i], kiln_mul(E.p[i], kiln_scalar(KILN_F32, 0.5)));
      }
      kiln_no_grad_end();
    }
    ea.which = ee.which = (s / 2) % 2;
    ea.temp = ee.temp = s % 10 < 5 ? 1.0 : 0.7 + 0.05 * s;
    ea.p = ee.p = s > 20 && s % 2 ? 0.1 : 0;
    if (caller_no_grad) kiln_no_grad_begin();
    kiln_tensor *oc = NULL, *oe = NULL;
    kiln_manual_seed(77 + (uint64_t)s);
    ck_assert_msg(kiln_call(fn, &idx, &oc) == 0, "%s", kiln_last_error());
    kiln_manual_seed(77 + (uint64_t)s);
    ck_assert_msg(eval_body(&ee, &idx, &oe) == 0, "%s", kiln_last_error());
    if (caller_no_grad) kiln_no_grad_end();
    ck_assert_msg(mdiff(oc, oe) <= 1e-5, "call %d: %g", s, mdiff(oc, oe));
    kiln_scope_end();
  }
  for (int i = 0; i < A.n_params; i++) ck_assert_msg(mdiff(A.p[i], E.p[i]) <= 1e-5, "param %d", i);
  ck_assert_int_eq(0, stats(fn).check_fails);
  kiln_fn_free(fn), kiln_fn_free(tf);
  gpt_free(&A), gpt_free(&E), gpt_free(&A2), gpt_free(&E2);
}

START_TEST(test_gpt_eval_between_steps) {
  eval_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 0, 1, 1);
  eval_run(KILN_BACKEND_LLVM, KILN_CAPTURE_RECORD, 0, 1, 0);
  eval_run(KILN_BACKEND_INTERP, KILN_CAPTURE_AUTO, 0, 1, 0);
  eval_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 0, 0, 1);
  eval_run(KILN_BACKEND_LLVM, KILN_CAPTURE_AUTO, 1, 1, 1);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("capture_models");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, test_gpt_train_llvm);
  tcase_add_test(tc, test_gpt_train_llvm_record_counters_in_body);
  tcase_add_test(tc, test_gpt_train_interp);
  tcase_add_test(tc, test_gpt_train_inplace_clip);
  tcase_add_test(tc, test_gpt_train_check_mode);
  tcase_add_test(tc, test_gpt_split_step);
  tcase_add_test(tc, test_check_mode_call_that_escapes);
  tcase_add_test(tc, test_llama_generate);
  tcase_add_test(tc, test_llama_generate_check_mode);
  tcase_add_test(tc, test_lstm_lengths);
  tcase_add_test(tc, test_lstm_state_across_calls);
  tcase_add_test(tc, test_cnn_batch_norm_schedule);
  tcase_add_test(tc, test_gpt_eval_between_steps);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *r = srunner_create(suite());
  srunner_run_all(r, CK_NORMAL);
  int failed = srunner_ntests_failed(r);
  srunner_free(r);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
