/* The GPT of examples/gpt.h end to end on a tiny config: its training step
 * compiled (LLVM and the interpreter) against the same step run eagerly, its
 * AdamW against the formulas computed here in C, its gradients against
 * finite differences in f64, generation at growing lengths served by one
 * variant with the length symbolic, and generation through the KV caches. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../examples/gpt.h"
#include "kiln.h"

/* 1 layer, 2 heads, 16 channels, context 8, 64 symbols */
static gpt_config tiny(kiln_dtype dt) {
  return (gpt_config){.n_layer = 1, .n_head = 2, .n_embd = 16, .block_size = 8, .vocab_size = 64, .dtype = dt,
                      .opt = GPT_ADAMW_DEFAULT};
}

enum { B = 2 };

/* idx and targets (B,T) of pseudo-random symbols, in the open scope */
static void batch(const gpt_config *c, int64_t T, uint64_t seed, kiln_tensor **idx, kiln_tensor **tgt) {
  int64_t x[2 * B * 64];
  ck_assert_int_le(T, 64);
  for (int64_t i = 0; i < 2 * B * T; i++) x[i] = (int64_t)(gpt_rand(&seed) % (uint64_t)c->vocab_size);
  *idx = kiln_tensor_from(KILN_I64, 2, ((int64_t[]){B, T}), x);
  *tgt = kiln_tensor_from(KILN_I64, 2, ((int64_t[]){B, T}), x + B * T);
  ck_assert_ptr_nonnull(*idx);
  ck_assert_ptr_nonnull(*tgt);
}

/* The elements of t as doubles (malloc'ed). */
static double *values(kiln_tensor *t) {
  int64_t n = kiln_numel(t);
  double *v = malloc(sizeof(double) * (size_t)(n + 1));
  ck_assert_ptr_nonnull(v);
  kiln_scope_begin();
  ck_assert_int_eq(0, kiln_read(kiln_cast(t, KILN_F64), v, sizeof(double) * (size_t)n));
  kiln_scope_end();
  return v;
}

/* max |a - b| over two tensors of the same shape; reports the first worst index */
static double maxdiff(kiln_tensor *a, kiln_tensor *b, int64_t *where) {
  ck_assert_int_eq(kiln_numel(a), kiln_numel(b));
  double *x = values(a), *y = values(b), m = 0;
  *where = -1;
  for (int64_t i = 0; i < kiln_numel(a); i++) {
    double e = fabs(x[i] - y[i]);
    if (!(e <= m)) m = e, *where = i;
  }
  free(x), free(y);
  return m;
}

static int count(const char *s, const char *needle) {
  int n = 0;
  for (const char *p = s; (p = strstr(p, needle)); p++) n++;
  return n;
}

/* A few steps eagerly on model a, compiled on model b, from the same init:
 * the same losses and the same parameters, one trace. */
static void train_both(int backend) {
  gpt_config c = tiny(KILN_F32);
  gpt a, b;
  ck_assert_int_eq(0, gpt_init(&a, &c, 5));
  ck_assert_int_eq(0, gpt_init(&b, &c, 5));
  kiln_options o = {.name = "train", .n_in = 2, .n_out = 1, .backend = backend};
  kiln_fn *fn = kiln_compile(gpt_train_body, &b, &o);
  ck_assert_ptr_nonnull(fn);
  enum { STEPS = 4 };
  double first = 0, last = 0;
  for (int s = 0; s < STEPS; s++) {
    kiln_scope_begin();
    kiln_tensor *idx, *tgt, *lc = NULL;
    batch(&c, c.block_size, 100 + (uint64_t)s % 2, &idx, &tgt); /* two batches, alternating */
    kiln_tensor *le = gpt_train_step(&a, idx, tgt);
    ck_assert_msg(le != NULL, "eager step %d: %s", s, kiln_last_error());
    kiln_tensor *in[2] = {idx, tgt};
    ck_assert_msg(kiln_call(fn, in, &lc) == 0, "compiled step %d: %s", s, kiln_last_error());
    double ve = kiln_item(le), vc = kiln_item(lc);
    ck_assert_msg(fabs(ve - vc) <= 1e-5 * fabs(ve), "step %d: loss eager %.8f, compiled %.8f", s, ve, vc);
    if (s == 0) first = ve;
    last = ve;
    kiln_scope_end();
  }
  ck_assert_double_lt(last, first); /* the same two batches, seen twice: the loss falls */
  for (int i = 0; i < a.n_params; i++) {
    int64_t at;
    char name[32];
    double d = maxdiff(a.p[i], b.p[i], &at);
    ck_assert_msg(d <= 1e-5, "param %s differs by %g at %lld", gpt_param_name(&c, i, name, sizeof name), d, (long long)at);
    ck_assert_double_le(maxdiff(a.m[i], b.m[i], &at), 1e-6);
    ck_assert_double_le(maxdiff(a.v[i], b.v[i], &at), 1e-8);
    ck_assert_ptr_null(kiln_grad(b.p[i])); /* dropped inside the step */
  }
  ck_assert_double_eq(STEPS, kiln_item(b.step));
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.traces);
  ck_assert_int_eq(STEPS - 1, st.hits);
  ck_assert_int_eq(0, st.fallbacks);
  /* one graph writes every parameter, both moments of each, and the step count */
  char *text = kiln_fn_graph(fn, 0);
  ck_assert_ptr_nonnull(text);
  ck_assert_int_eq(3 * a.n_params + 1, count(text, "  write %"));
  free(text);
  kiln_fn_free(fn);
  gpt_free(&a);
  gpt_free(&b);
}

START_TEST(test_train_llvm_matches_eager) { train_both(KILN_BACKEND_LLVM); }
END_TEST

START_TEST(test_train_interp_matches_eager) { train_both(KILN_BACKEND_INTERP); }
END_TEST

/* Two AdamW steps against the update computed here from the gradients: the
 * formulas of gpt.h's header, in double. */
START_TEST(test_adamw_formula) {
  gpt_config c = tiny(KILN_F64);
  gpt g, ref;
  ck_assert_int_eq(0, gpt_init(&g, &c, 9));
  ck_assert_int_eq(0, gpt_init(&ref, &c, 9));
  const gpt_adamw *o = &c.opt;
  int n_params = g.n_params;
  double **p = calloc((size_t)n_params, sizeof *p), **m = calloc((size_t)n_params, sizeof *m),
         **v = calloc((size_t)n_params, sizeof *v);
  ck_assert_ptr_nonnull(p);
  ck_assert_ptr_nonnull(m);
  ck_assert_ptr_nonnull(v);
  for (int i = 0; i < n_params; i++) {
    int64_t n = kiln_numel(g.p[i]);
    p[i] = values(g.p[i]);
    m[i] = calloc((size_t)n, sizeof(double));
    v[i] = calloc((size_t)n, sizeof(double));
  }
  for (int t = 1; t <= 2; t++) {
    kiln_scope_begin();
    kiln_tensor *idx, *tgt;
    batch(&c, c.block_size, 7 + (uint64_t)t, &idx, &tgt);
    /* the gradients at the current weights, from a copy the update does not touch */
    ck_assert_int_eq(0, gpt_copy_state(&ref, &g));
    kiln_tensor *loss = gpt_loss(&ref, idx, tgt);
    ck_assert_int_eq(0, kiln_backward(loss));
    ck_assert_ptr_nonnull(gpt_train_step(&g, idx, tgt));
    double bc1 = 1 - pow(o->beta1, t), bc2 = 1 - pow(o->beta2, t);
    for (int i = 0; i < n_params; i++) {
      double *gr = values(kiln_grad(ref.p[i])), *got = values(g.p[i]);
      bool decay = kiln_ndim(g.p[i]) == 2;
      for (int64_t j = 0; j < kiln_numel(g.p[i]); j++) {
        if (decay) p[i][j] -= o->lr * o->weight_decay * p[i][j];
        m[i][j] = o->beta1 * m[i][j] + (1 - o->beta1) * gr[j];
        v[i][j] = o->beta2 * v[i][j] + (1 - o->beta2) * gr[j] * gr[j];
        p[i][j] -= o->lr / bc1 * m[i][j] / (sqrt(v[i][j]) / sqrt(bc2) + o->eps);
        ck_assert_msg(fabs(p[i][j] - got[j]) <= 1e-12, "step %d param %d [%lld]: expected %.15g, got %.15g", t, i,
                      (long long)j, p[i][j], got[j]);
      }
      free(gr), free(got);
      kiln_zero_grad(ref.p[i]);
    }
    kiln_scope_end();
  }
  for (int i = 0; i < n_params; i++) free(p[i]), free(m[i]), free(v[i]);
  free(p), free(m), free(v);
  gpt_free(&g);
  gpt_free(&ref);
}
END_TEST

/* Sets element j of t (f64) to x, outside autograd. */
static void set_elem(kiln_tensor *t, int64_t j, double x) {
  double *d = values(t);
  d[j] = x;
  int64_t shape[2] = {kiln_size(t, 0), kiln_ndim(t) > 1 ? kiln_size(t, 1) : 1};
  kiln_scope_begin();
  kiln_no_grad_begin();
  ck_assert_ptr_nonnull(kiln_copy_(t, kiln_tensor_from(KILN_F64, kiln_ndim(t), shape, d)));
  kiln_no_grad_end();
  kiln_scope_end();
  free(d);
}

static double loss_value(const gpt *g, kiln_tensor *idx, kiln_tensor *tgt) {
  kiln_scope_begin();
  kiln_no_grad_begin();
  double l = kiln_item(gpt_loss(g, idx, tgt));
  kiln_no_grad_end();
  kiln_scope_end();
  return l;
}

/* d loss / d w by central differences in f64, for elements of every kind of
 * parameter: the tied embedding (both of its uses), positions, attention,
 * the MLP, the layer norms. */
START_TEST(test_gradient_finite_differences) {
  gpt_config c = tiny(KILN_F64);
  gpt g;
  ck_assert_int_eq(0, gpt_init(&g, &c, 3));
  /* biases and layer norms start at 0 and 1: move them off, so that every
   * term of the gradient is exercised */
  kiln_scope_begin();
  kiln_no_grad_begin();
  for (int i = 0; i < g.n_params; i++)
    if (kiln_ndim(g.p[i]) == 1) {
      int64_t shape[1] = {kiln_size(g.p[i], 0)};
      ck_assert_ptr_nonnull(kiln_add_(g.p[i], kiln_mul(kiln_randn(KILN_F64, 1, shape, 50 + (uint64_t)i),
                                                         kiln_scalar(KILN_F64, 0.1))));
    }
  kiln_no_grad_end();
  kiln_scope_end();

  kiln_scope_begin();
  kiln_tensor *idx, *tgt;
  batch(&c, 6, 11, &idx, &tgt); /* T 6 < block_size: the mask and wpe are sliced */
  kiln_tensor *loss = gpt_loss(&g, idx, tgt);
  ck_assert_int_eq(0, kiln_backward(loss));
  int64_t first_sym = 0;
  ck_assert_int_eq(0, kiln_read(kiln_slice(kiln_reshape(idx, 1, ((int64_t[]){-1})), 0, 0, 1, 1), &first_sym, 8));
  int L0 = GPT_FIRST_LAYER;
  struct { int param; int64_t elem; } cases[] = {
      {GPT_WTE, first_sym * 16 + 3}, /* a row used by the input */
      {GPT_WTE, 63 * 16 + 5},        /* probably used by the head only */
      {GPT_WPE, 2 * 16 + 7},
      {GPT_WPE, 7 * 16 + 1}, /* position 7 is never used at T 6: gradient 0 */
      {L0 + GPT_LN1_W, 4},
      {L0 + GPT_ATTN_W, 3 * 48 + 5},  /* q */
      {L0 + GPT_ATTN_W, 9 * 48 + 20}, /* k */
      {L0 + GPT_ATTN_B, 40},          /* v */
      {L0 + GPT_PROJ_W, 17},
      {L0 + GPT_LN2_B, 11},
      {L0 + GPT_FC_W, 100},
      {L0 + GPT_FC2_W, 333},
      {L0 + GPT_FC2_B, 2},
      {g.n_params - 2, 6}, /* lnf_w */
      {g.n_params - 1, 0}, /* lnf_b */
  };
  const double h = 1e-5;
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
    kiln_tensor *p = g.p[cases[k].param];
    int64_t j = cases[k].elem;
    double *gr = values(kiln_grad(p)), *w = values(p), w0 = w[j];
    set_elem(p, j, w0 + h);
    double up = loss_value(&g, idx, tgt);
    set_elem(p, j, w0 - h);
    double down = loss_value(&g, idx, tgt);
    set_elem(p, j, w0);
    double fd = (up - down) / (2 * h);
    char name[32];
    ck_assert_msg(fabs(fd - gr[j]) <= 1e-7 + 1e-6 * fabs(fd), "%s[%lld]: backward %.10g, finite differences %.10g",
                  gpt_param_name(&c, cases[k].param, name, sizeof name), (long long)j, gr[j], fd);
    if (cases[k].param == GPT_WPE && j / 16 == 7) ck_assert_double_eq(0, gr[j]);
    else ck_assert_double_ne(0, gr[j]); /* a zero gradient would pass too easily */
    free(gr), free(w);
  }
  kiln_scope_end();
  gpt_free(&g);
}
END_TEST

/* The compiled next-byte logits at lengths 5, 6, 7, 8 (the context) equal
 * eager ones, from one variant whose length is the symbol s0; then greedy
 * generation past the context (the window slides) gives eager's text. */
START_TEST(test_generation_one_variant) {
  gpt_config c = tiny(KILN_F32);
  gpt g;
  ck_assert_int_eq(0, gpt_init(&g, &c, 8));
  kiln_options o = {.name = "next", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(gpt_next_body, &g, &o);
  ck_assert_ptr_nonnull(fn);
  ck_assert_int_eq(0, kiln_mark_dynamic(fn, 0, 1));
  for (int64_t T = 5; T <= c.block_size; T++) {
    kiln_scope_begin();
    int64_t x[8];
    uint64_t seed = 3;
    for (int64_t t = 0; t < T; t++) x[t] = (int64_t)(gpt_rand(&seed) % 64);
    kiln_tensor *idx = kiln_tensor_from(KILN_I64, 2, ((int64_t[]){1, T}), x), *got = NULL;
    ck_assert_msg(kiln_call(fn, &idx, &got) == 0, "T %lld: %s", (long long)T, kiln_last_error());
    kiln_tensor *want = gpt_next_logits(&g, idx);
    ck_assert_int_eq(2, kiln_ndim(got));
    ck_assert_int_eq(c.vocab_size, kiln_size(got, 1));
    int64_t at;
    double d = maxdiff(got, want, &at);
    ck_assert_msg(d <= 1e-5, "T %lld: logits differ by %g at %lld", (long long)T, d, (long long)at);
    kiln_scope_end();
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.traces);
  ck_assert_int_eq(1, st.variants);
  ck_assert_int_eq(3, st.hits);
  char *text = kiln_fn_graph(fn, 0);
  ck_assert_ptr_nonnull(text);
  ck_assert_msg(strstr(text, "i64[1,s0]") != NULL, "the length is not symbolic:\n%.300s", text);
  ck_assert_msg(strstr(text, "bool[s0,s0]") != NULL, "the mask is not sliced to (s0,s0)");
  free(text);

  uint8_t a[20] = {1, 2, 3, 4, 5}, b[20] = {1, 2, 3, 4, 5};
  int64_t la = 5, lb = 5;
  uint64_t ra = 1, rb = 1;
  ck_assert_int_eq(0, gpt_generate(&g, fn, a, &la, 15, 0, &ra));
  ck_assert_int_eq(0, gpt_generate(&g, NULL, b, &lb, 15, 0, &rb));
  ck_assert_int_eq(20, la);
  ck_assert_mem_eq(a, b, 20);
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.traces);
  kiln_fn_free(fn);
  gpt_free(&g);
}
END_TEST

/* Decoding through the KV caches (gpt_decode_body, one compiled variant
 * for every position, which is an input; calls skip the body): at every
 * position of the context the logits equal those of the uncached forward
 * over the bytes so far (gpt_next_logits, eager); generation that fits the
 * context gives gpt_generate's bytes; past it (a context shift) compiled
 * gives eager's. */
START_TEST(test_generation_kv_cache) {
  gpt_config c = tiny(KILN_F32);
  gpt g;
  ck_assert_int_eq(0, gpt_init(&g, &c, 9));
  ck_assert_int_eq(0, gpt_cache_init(&g));
  kiln_options o = {.name = "decode", .n_in = 2, .n_out = 1, .capture = KILN_CAPTURE_GUARDS};
  kiln_fn *fn = kiln_compile(gpt_decode_body, &g, &o);
  ck_assert_ptr_nonnull(fn);
  int64_t x[8];
  uint64_t seed = 5;
  for (int64_t t = 0; t < c.block_size; t++) x[t] = (int64_t)(gpt_rand(&seed) % 64);
  for (int64_t p = 0; p < c.block_size; p++) {
    kiln_scope_begin();
    kiln_tensor *in[2] = {kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &x[p]), kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &p)};
    kiln_tensor *got = NULL;
    ck_assert_msg(kiln_call(fn, in, &got) == 0, "pos %lld: %s", (long long)p, kiln_last_error());
    kiln_tensor *want = gpt_next_logits(&g, kiln_tensor_from(KILN_I64, 2, ((int64_t[]){1, p + 1}), x));
    ck_assert_int_eq(2, kiln_ndim(got));
    ck_assert_int_eq(c.vocab_size, kiln_size(got, 1));
    int64_t at;
    double d = maxdiff(got, want, &at);
    ck_assert_msg(d <= 1e-5, "pos %lld: logits differ by %g at %lld", (long long)p, d, (long long)at);
    kiln_scope_end();
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.traces);
  ck_assert_int_eq(1, st.variants);
  ck_assert_int_eq(0, st.fallbacks);
  ck_assert_int_eq(c.block_size - 1, st.guard_hits); /* every call after the first skipped the body */

  uint8_t a[20] = {1, 2, 3}, b[20] = {1, 2, 3}, e[20] = {1, 2, 3};
  int64_t la = 3, lb = 3, le = 3;
  uint64_t ra = 1, rb = 1, re = 1;
  ck_assert_int_eq(0, gpt_generate_cached(&g, fn, a, &la, 5, 0, &ra)); /* fills the context: 8 bytes */
  ck_assert_int_eq(0, gpt_generate(&g, NULL, b, &lb, 5, 0, &rb));
  ck_assert_int_eq(8, la);
  ck_assert_mem_eq(a, b, 8);
  la = 3;
  ck_assert_int_eq(0, gpt_generate_cached(&g, fn, a, &la, 17, 0, &ra)); /* past it: shifts */
  ck_assert_int_eq(0, gpt_generate_cached(&g, NULL, e, &le, 17, 0, &re));
  ck_assert_int_eq(20, la);
  ck_assert_mem_eq(a, e, 20);
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.variants);
  ck_assert_int_eq(0, st.fallbacks);
  kiln_fn_free(fn);
  gpt_free(&g);
}
END_TEST

/* The memory a compiled training step keeps between calls (its arena) is
 * bounded by what the backward needs, derived here by hand, not by the
 * model's size: each parameter's new value (and its moments') is stored in
 * place, and each gradient dies as the AdamW update that reads it runs. A
 * config whose parameters outweigh its activations, so that a plan that kept
 * every gradient (or a copy of every weight and moment) until the end fails. */
START_TEST(test_train_arena_bound) {
  const gpt_config c = {.n_layer = 4, .n_head = 2, .n_embd = 64, .block_size = 8, .vocab_size = 256, .dtype = KILN_F32,
                        .opt = GPT_ADAMW_DEFAULT};
  const int64_t L = c.n_layer, H = c.n_head, C = c.n_embd, T = c.block_size, V = c.vocab_size, BT = T; /* batch 1 */
  gpt g;
  ck_assert_int_eq(0, gpt_init(&g, &c, 3));
  int64_t n_params = 0;
  for (int i = 0; i < g.n_params; i++) n_params += kiln_numel(g.p[i]);
  kiln_options o = {.name = "train", .n_in = 2, .n_out = 1};
  kiln_fn *fn = kiln_compile(gpt_train_body, &g, &o);
  ck_assert_ptr_nonnull(fn);
  size_t before = kiln_mem_in_use(), kept[2];
  for (int s = 0; s < 2; s++) {
    kiln_scope_begin();
    int64_t x[2 * 8];
    uint64_t seed = 11 + (uint64_t)s;
    for (int i = 0; i < 2 * 8; i++) x[i] = (int64_t)(gpt_rand(&seed) % (uint64_t)V);
    kiln_tensor *in[2] = {kiln_tensor_from(KILN_I64, 2, ((int64_t[]){1, T}), x),
                          kiln_tensor_from(KILN_I64, 2, ((int64_t[]){1, T}), x + 8)},
                *loss = NULL;
    ck_assert_msg(kiln_call(fn, in, &loss) == 0, "step %d: %s", s, kiln_last_error());
    kiln_scope_end();
    kept[s] = kiln_mem_in_use() - before;
  }
  ck_assert_uint_eq(kept[0], kept[1]); /* the arena is made once */
  /* floats, per row of the batch and per layer: what the backward reads of
   * the forward (two layer norms' inputs and statistics, q, k, v, the
   * attention's output, the MLP's 4C before and after gelu, residuals) is
   * under 24 C, plus the attention probabilities and their gradient, 3 H T */
  int64_t acts = L * BT * (24 * C + 3 * H * T) + BT * (3 * V + 4 * C);
  /* the working set of one layer's backward: its weights' gradients */
  int64_t layer = 12 * C * C + 13 * C;
  /* the tied embedding: the head's gradient of wte and the embedding's,
   * both (V, C), meet at the end of the backward (the head's is made
   * there, sink_results) */
  int64_t tied = 2 * V * C;
  size_t bound = (size_t)(acts + layer + tied) * sizeof(float) + 64 * 64 * (size_t)(L + 1); /* 64-byte slots */
  fprintf(stderr, "gpt arena: %zu bytes kept, bound %zu, parameters %zu bytes\n", kept[1], bound,
          (size_t)n_params * sizeof(float));
  ck_assert_msg(kept[1] <= bound, "the step keeps %zu bytes between calls, over the %zu the backward needs", kept[1], bound);
  /* the bound is below what keeping every gradient would take */
  ck_assert_uint_lt(bound, (size_t)n_params * sizeof(float));
  kiln_fn_free(fn);
  gpt_free(&g);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("gpt");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, test_train_llvm_matches_eager);
  tcase_add_test(tc, test_train_interp_matches_eager);
  tcase_add_test(tc, test_adamw_formula);
  tcase_add_test(tc, test_gradient_finite_differences);
  tcase_add_test(tc, test_generation_one_variant);
  tcase_add_test(tc, test_generation_kv_cache);
  tcase_add_test(tc, test_train_arena_bound);
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
