/* Convolutional networks compiled: a small CNN (conv, batch norm, relu, max
 * pool, a strided and a depthwise conv, a residual add, average pools, a
 * linear head) run three ways, eagerly, on the interpreter and on LLVM, in
 * training (the loss, every weight's gradient, and the running statistics
 * written back in place) and in inference, with the batch and the spatial
 * sizes symbolic; what fusion makes of a conv's epilogue and of a costly
 * value it would broadcast; and a graph of convs and pools saved as text and
 * loaded back. */
#define _POSIX_C_SOURCE 200809L /* mkstemp */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "codegen/codegen.h"
#include "kiln.h"

#pragma GCC diagnostic ignored "-Wunused-function" /* the generator itself is not used here */
#include "fuzz/randprog.h" /* maxdiff_rel and same_shape */

enum { N_W = 12 };

/* The weights (leaves, requiring grad) and the running statistics of one copy of the model. */
typedef struct model {
  kiln_tensor *w[N_W];
  kiln_tensor *rm, *rv;
  bool training;
  kiln_dtype dt;
} model;

static const int64_t w_shapes[N_W][4] = {
    {4, 3, 3, 3}, {4}, {4}, {4},  /* conv1 (with bias), bn1 weight and bias, conv2's bias */
    {6, 4, 3, 3}, {6, 1, 3, 3},   /* conv2 (stride 2), depthwise */
    {6, 6, 1, 1}, {6},            /* 1x1 conv and its bias */
    {6, 10}, {10}, {6, 4, 1, 1}, {6}, /* the linear head; the shortcut 1x1 and its bias */
};
static const int w_ndim[N_W] = {4, 1, 1, 1, 4, 4, 4, 1, 2, 1, 4, 1};

static void model_init(model *m, kiln_dtype dt, bool training) {
  m->dt = dt;
  m->training = training;
  for (int i = 0; i < N_W; i++) {
    m->w[i] = kiln_randn(dt, w_ndim[i], w_shapes[i], 100 + (uint64_t)i);
    if (i == 1) m->w[i] = kiln_add(kiln_mul(m->w[i], kiln_scalar(dt, 0.1)), kiln_scalar(dt, 1)); /* bn scale near 1 */
    m->w[i] = kiln_keep(kiln_mul(m->w[i], kiln_scalar(dt, 0.5)));
    kiln_requires_grad(m->w[i], true);
  }
  m->rm = kiln_keep(kiln_mul(kiln_randn(dt, 1, ((int64_t[]){4}), 7), kiln_scalar(dt, 0.1)));
  m->rv = kiln_keep(kiln_add(kiln_rand(dt, 1, ((int64_t[]){4}), 8), kiln_scalar(dt, 0.5)));
}

static void model_free(model *m) {
  for (int i = 0; i < N_W; i++) kiln_release(m->w[i]);
  kiln_release(m->rm);
  kiln_release(m->rv);
}

/* out[0] the head's output (training: the loss), then (training) the gradient of every weight. */
static int cnn_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  kiln_tensor **w = m->w, *x = in[0];
  kiln_tensor *h = kiln_conv2d(x, w[0], w[3], NULL, (int[]){1, 1}, NULL, 1);
  h = kiln_relu(kiln_batch_norm(h, m->rm, m->rv, w[1], w[2], m->training, 0.1, 1e-5));
  kiln_tensor *sc = kiln_conv2d(kiln_max_pool2d(h, (int[]){3, 3}, (int[]){2, 2}, (int[]){1, 1}), w[10], w[11], NULL, NULL, NULL, 1);
  h = kiln_relu(kiln_conv2d(h, w[4], NULL, (int[]){2, 2}, (int[]){1, 1}, NULL, 1));
  h = kiln_conv2d(h, w[5], NULL, NULL, (int[]){1, 1}, NULL, 6);                 /* depthwise */
  h = kiln_relu(kiln_add(kiln_conv2d(h, w[6], w[7], NULL, NULL, NULL, 1), sc)); /* the residual */
  h = kiln_avg_pool2d(h, (int[]){2, 2}, (int[]){1, 1}, (int[]){1, 1});
  h = kiln_adaptive_avg_pool2d(h, (int[]){1, 1});
  kiln_tensor *y = kiln_matmul(kiln_reshape(h, 2, ((int64_t[]){kiln_size(h, 0), 6})), w[8]);
  y = kiln_add(y, w[9]);
  if (!m->training) {
    out[0] = y;
    return y ? 0 : -1;
  }
  kiln_tensor *loss = kiln_mean_all(kiln_mul(y, y));
  out[0] = loss;
  return loss && kiln_grad_of(loss, w, N_W, out + 1) == 0 ? 0 : -1;
}

static void expect_close(kiln_tensor *a, kiln_tensor *b, double tol, const char *what, int call) {
  ck_assert_msg(a && b, "%s (call %d): missing", what, call);
  ck_assert_msg(same_shape(a, b), "%s (call %d): shapes differ", what, call);
  int64_t bad;
  double d = maxdiff_rel(a, b, &bad);
  ck_assert_msg(d <= tol, "%s (call %d): max rel diff %g at %lld (tolerance %g)", what, call, d, (long long)bad, tol);
}

/* Eager, the interpreter and LLVM from the same start, at several sizes;
 * every size but the first runs a variant whose batch, height and width are
 * symbols. */
static void three_ways(kiln_dtype dt, bool training) {
  kiln_scope_begin();
  model me, mi, ml;
  model_init(&me, dt, training), model_init(&mi, dt, training), model_init(&ml, dt, training);
  int n_out = training ? 1 + N_W : 1;
  kiln_options oi = {.name = "cnn_interp", .n_in = 1, .n_out = n_out, .dynamic = KILN_DYNAMIC_ALL, .backend = KILN_BACKEND_INTERP};
  kiln_options ol = {.name = "cnn_llvm", .n_in = 1, .n_out = n_out, .dynamic = KILN_DYNAMIC_ALL, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fi = kiln_compile(cnn_body, &mi, &oi), *fl = kiln_compile(cnn_body, &ml, &ol);
  /* the traced sizes (the first) differ from every constant size and from each
   * other all through the network: a size the backward passes that two dims
   * share is pinned by the tracer */
  static const int64_t sizes[][3] = {{2, 13, 22}, {7, 15, 9}, {3, 9, 4}, {4, 12, 12}, {5, 6, 7}};
  double tol = dt == KILN_F64 ? 1e-9 : 1e-4;
  for (int c = 0; c < 5; c++) {
    kiln_scope_begin();
    int64_t n = sizes[c][0], h = sizes[c][1], w = sizes[c][2];
    kiln_tensor *x = kiln_randn(dt, 4, ((int64_t[]){n, 3, h, w}), 40 + (uint64_t)c);
    kiln_tensor *ye[1 + N_W] = {0}, *yi[1 + N_W] = {0}, *yl[1 + N_W] = {0};
    ck_assert_msg(cnn_body(&me, &x, ye) == 0, "%s", kiln_last_error());
    ck_assert_msg(kiln_call(fi, &x, yi) == 0, "%s", kiln_last_error());
    ck_assert_msg(kiln_call(fl, &x, yl) == 0, "%s", kiln_last_error());
    for (int i = 0; i < n_out; i++) {
      char what[64];
      snprintf(what, sizeof what, "%s output %d, interpreter", training ? "training" : "inference", i);
      expect_close(yi[i], ye[i], tol, what, c);
      snprintf(what, sizeof what, "%s output %d, llvm", training ? "training" : "inference", i);
      expect_close(yl[i], ye[i], tol, what, c);
    }
    /* the running statistics moved the same way (training) or not at all */
    expect_close(mi.rm, me.rm, tol, "running mean, interpreter", c);
    expect_close(ml.rm, me.rm, tol, "running mean, llvm", c);
    expect_close(mi.rv, me.rv, tol, "running var, interpreter", c);
    expect_close(ml.rv, me.rv, tol, "running var, llvm", c);
    kiln_scope_end();
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fl, &st));
  ck_assert_int_eq(1, st.traces); /* every size served by the one symbolic variant */
  ck_assert_int_eq(4, st.hits);
  kiln_fn_free(fi), kiln_fn_free(fl);
  model_free(&me), model_free(&mi), model_free(&ml);
  kiln_scope_end();
}

START_TEST(test_training_three_ways) {
  three_ways(KILN_F32, true);
  three_ways(KILN_F64, true);
}
END_TEST

START_TEST(test_inference_three_ways) {
  three_ways(KILN_F32, false);
  three_ways(KILN_F64, false);
}
END_TEST

/* In training the running statistics are written back to the params at the
 * end of the graph, with no autograd history, and the loss does not depend
 * on them; in inference they are read, not written. */
START_TEST(test_running_stats_write_back) {
  kiln_scope_begin();
  model m;
  model_init(&m, KILN_F32, true);
  kiln_options o = {.name = "cnn", .n_in = 1, .n_out = 1 + N_W, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(cnn_body, &m, &o);
  kiln_tensor *x = kiln_randn(KILN_F32, 4, ((int64_t[]){2, 3, 8, 9}), 3), *y[1 + N_W];
  float before[4], after[4];
  for (int call = 0; call < 3; call++) {
    ck_assert_int_eq(0, kiln_read(m.rm, before, sizeof before));
    ck_assert_int_eq(0, kiln_call(fn, &x, y));
    ck_assert_int_eq(0, kiln_read(m.rm, after, sizeof after));
    ck_assert(memcmp(before, after, sizeof before) != 0);
    ck_assert(!kiln_get_requires_grad(m.rm) && !kiln_get_requires_grad(m.rv));
  }
  char *text = kiln_fn_graph(fn, 0);
  ck_assert_ptr_nonnull(text);
  ck_assert_ptr_nonnull(strstr(text, "conv2d_grad_weight"));
  ck_assert_ptr_nonnull(strstr(text, "max_pool2d_grad"));
  free(text);
  kiln_fn_free(fn);
  model_free(&m);
  kiln_scope_end();
}
END_TEST

/* The kernels of fn's newest variant after fusion (the graph freed with them by free_plan). */
static cg_program *plan_of(kiln_fn *fn) {
  char *text = kiln_fn_graph(fn, 0);
  ck_assert_ptr_nonnull(text);
  char err[256];
  ir_graph *g = ir_parse(text, err, sizeof err);
  free(text);
  ck_assert_msg(g != NULL, "%s", err);
  cg_program *p = fuse_graph(g, err, sizeof err);
  ck_assert_msg(p != NULL, "%s", err);
  return p;
}

static void free_plan(cg_program *p) {
  ir_graph *g = (ir_graph *)p->g;
  cg_program_free(p);
  ir_free(g);
}

typedef struct block_ctx {
  kiln_tensor *w, *rm, *rv, *g, *b;
} block_ctx;

/* relu(batch_norm(conv2d(x, w)) + x) in eval mode: a residual block's tail */
static int block_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  block_ctx *c = ctx;
  kiln_tensor *y = kiln_conv2d(in[0], c->w, NULL, NULL, (int[]){1, 1}, NULL, 1);
  y = kiln_batch_norm(y, c->rm, c->rv, c->g, c->b, false, 0.1, 1e-5);
  out[0] = kiln_relu(kiln_add(y, in[0]));
  return out[0] ? 0 : -1;
}

/* A conv and what follows it: the conv runs as its kernel on working memory
 * of its own in the arena, and the batch norm (scale and shift per channel,
 * folded), the residual add and the relu are one loop over the conv's output. */
START_TEST(test_conv_epilogue_plan) {
  kiln_scope_begin();
  block_ctx c = {kiln_randn(KILN_F32, 4, ((int64_t[]){8, 8, 3, 3}), 1), kiln_randn(KILN_F32, 1, ((int64_t[]){8}), 2),
                 kiln_add(kiln_rand(KILN_F32, 1, ((int64_t[]){8}), 3), kiln_scalar(KILN_F32, 0.5)),
                 kiln_randn(KILN_F32, 1, ((int64_t[]){8}), 4), kiln_randn(KILN_F32, 1, ((int64_t[]){8}), 5)};
  kiln_options o = {.name = "block", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(block_body, &c, &o);
  kiln_tensor *x = kiln_randn(KILN_F32, 4, ((int64_t[]){3, 8, 10, 9}), 6), *y = NULL, *ref = NULL;
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  ck_assert_int_eq(0, block_body(&c, &x, &ref));
  expect_close(y, ref, 1e-5, "block", 1);
  cg_program *p = plan_of(fn);
  int convs = 0, full = 0;
  for (int ki = 0; ki < p->n_k; ki++) {
    const cg_kernel *k = &p->k[ki];
    const ir_node *n = &p->g->nodes[k->node];
    if (k->kind == CG_K_EAGER && n->op == OP_CONV2D) {
      convs++;
      ck_assert_int_ge(k->scratch_buf, 0);
      ck_assert_int_eq(ki, p->buf[k->scratch_buf].scratch_of);
      ck_assert_int_eq(ki, p->buf[k->scratch_buf].first);
      ck_assert_int_eq(ki, p->buf[k->scratch_buf].last);
    }
    int64_t numel = 1;
    for (int d = 0; k->kind == CG_K_LOOP && d < k->ndim; d++) numel *= sym_is_const(k->dim[d]) ? k->dim[d].c : 0;
    full += k->kind == CG_K_LOOP && numel == 3 * 8 * 10 * 9;
  }
  ck_assert_int_eq(1, convs);
  ck_assert_int_eq(1, full); /* one pass over the conv's output */
  free_plan(p);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* x * exp(w), w broadcast over x's rows: exp(w) is stored by a kernel over
 * w's own elements and loaded, not computed once per element of x; the
 * statistics of a row kernel (layer norm's rsqrt of the row variance) stay
 * in the row kernel, where they are computed once per row anyway. */
static int bcast_exp_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_add(kiln_mul(in[0], kiln_exp(in[1])), kiln_layer_norm(in[0], NULL, NULL, 1e-5));
  return out[0] ? 0 : -1;
}

START_TEST(test_broadcast_costly_stored) {
  kiln_scope_begin();
  kiln_options o = {.name = "bexp", .n_in = 2, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(bcast_exp_body, NULL, &o);
  kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, ((int64_t[]){37, 24}), 1), kiln_randn(KILN_F32, 1, ((int64_t[]){24}), 2)};
  kiln_tensor *y = NULL, *ref = NULL;
  ck_assert_int_eq(0, kiln_call(fn, in, &y));
  ck_assert_int_eq(0, kiln_call(fn, in, &y));
  ck_assert_int_eq(0, bcast_exp_body(NULL, in, &ref));
  expect_close(y, ref, 1e-5, "x * exp(w)", 1);
  cg_program *p = plan_of(fn);
  ck_assert_int_eq(2, p->n_k);
  bool exp_alone = false;
  for (int ki = 0; ki < p->n_k; ki++) {
    const cg_kernel *k = &p->k[ki];
    bool has_exp = false;
    for (int j = 0; j < k->n_nodes; j++) has_exp |= p->g->nodes[k->nodes[j]].op == OP_EXP;
    if (has_exp) exp_alone = k->ndim == 1 && sym_is_const(k->dim[0]) && k->dim[0].c == 24;
  }
  ck_assert(exp_alone);
  free_plan(p);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* conv, batch norm, the three pools: eval mode, weights frozen into the graph */
static int pools_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  block_ctx *c = ctx;
  kiln_tensor *y = kiln_conv2d(in[0], c->w, NULL, (int[]){2, 1}, (int[]){1, 1}, (int[]){1, 2}, 1);
  y = kiln_relu(kiln_batch_norm(y, c->rm, c->rv, c->g, c->b, false, 0.1, 1e-5));
  y = kiln_max_pool2d(y, (int[]){3, 3}, (int[]){1, 2}, (int[]){1, 1});
  y = kiln_avg_pool2d(y, (int[]){2, 2}, NULL, NULL);
  out[0] = kiln_adaptive_avg_pool2d(y, (int[]){2, 3});
  return out[0] ? 0 : -1;
}

/* The graph written as text and loaded back (the conv's and the pools' ints
 * attributes among what the printer writes and the parser reads) computes
 * what the traced one does. */
START_TEST(test_save_load) {
  kiln_scope_begin();
  block_ctx c = {kiln_randn(KILN_F32, 4, ((int64_t[]){8, 8, 3, 3}), 1), kiln_randn(KILN_F32, 1, ((int64_t[]){8}), 2),
                 kiln_add(kiln_rand(KILN_F32, 1, ((int64_t[]){8}), 3), kiln_scalar(KILN_F32, 0.5)),
                 kiln_randn(KILN_F32, 1, ((int64_t[]){8}), 4), kiln_randn(KILN_F32, 1, ((int64_t[]){8}), 5)};
  kiln_options o = {.name = "pools", .n_in = 1, .n_out = 1, .freeze = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(pools_body, &c, &o);
  kiln_tensor *x = kiln_randn(KILN_F32, 4, ((int64_t[]){2, 8, 13, 14}), 6), *y = NULL, *z = NULL, *ref = NULL;
  ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
  char path[] = "/tmp/kiln_cnn_XXXXXX";
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  close(fd);
  ck_assert_msg(kiln_save(fn, path) == 0, "%s", kiln_last_error());
  kiln_fn *loaded = kiln_load(path);
  unlink(path);
  ck_assert_msg(loaded != NULL, "%s", kiln_last_error());
  ck_assert_msg(kiln_call(loaded, &x, &z) == 0, "%s", kiln_last_error());
  ck_assert_int_eq(0, pools_body(&c, &x, &ref));
  expect_close(y, ref, 1e-5, "traced", 1);
  expect_close(z, ref, 1e-5, "loaded", 1);
  kiln_fn_free(loaded);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST


/* ---- weights prepared once (src/codegen/prepare.c) ---- */

typedef struct prep_ctx {
  kiln_tensor *w1, *w2;
} prep_ctx;

/* Two 3x3 stride-1 convs at odd sizes (the second with unequal padding),
 * nothing fused after them that could round differently from eager. */
static int prep_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  prep_ctx *c = ctx;
  kiln_tensor *y = kiln_relu(kiln_conv2d(in[0], c->w1, NULL, NULL, (int[]){1, 1}, NULL, 1));
  out[0] = kiln_conv2d(y, c->w2, NULL, NULL, (int[]){0, 2}, NULL, 1);
  return out[0] ? 0 : -1;
}

/* The same with the weight an argument: in[1] */
static int prep_arg_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_conv2d(in[0], in[1], NULL, NULL, (int[]){1, 1}, NULL, 1);
  return out[0] ? 0 : -1;
}

/* A compiled update of the weight: w -= 0.25 * d */
static int prep_update_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  prep_ctx *c = ctx;
  out[0] = kiln_sub_(c->w1, kiln_mul(in[0], kiln_scalar(KILN_F32, 0.25)));
  return out[0] ? 0 : -1;
}

/* Whether conv2d(x, w) of padding (ph, pw) has a weight to prepare (it runs as Winograd). */
static bool prepares(kiln_tensor *x, kiln_tensor *w, int ph, int pw) {
  op_attrs a;
  memset(&a, 0, sizeof a);
  int ints[7] = {1, 1, ph, pw, 1, 1, 1};
  for (int i = 0; i < 7; i++) a.ints[i] = ints[i];
  kiln_tensor *in[2] = {x, w};
  return conv_prepared_bytes(OP_CONV2D, in, &a) > 0;
}

/* The compiled result is eager's to the bit (the same kernel on the same U). */
static void expect_same_bits(kiln_tensor *got, kiln_tensor *want, const char *what) {
  ck_assert_msg(got && want && same_shape(got, want), "%s: missing or shapes differ", what);
  int64_t n = kiln_numel(want);
  float *a = malloc(sizeof(float) * (size_t)n), *b = malloc(sizeof(float) * (size_t)n);
  ck_assert_int_eq(0, kiln_read(got, a, sizeof(float) * (size_t)n));
  ck_assert_int_eq(0, kiln_read(want, b, sizeof(float) * (size_t)n));
  int64_t bad = -1;
  for (int64_t i = 0; i < n && bad < 0; i++)
    if (memcmp(&a[i], &b[i], sizeof(float))) bad = i;
  ck_assert_msg(bad < 0, "%s: element %lld is %g, eager's %g", what, (long long)bad, bad < 0 ? 0 : a[bad], bad < 0 ? 0 : b[bad]);
  free(a), free(b);
}

/* A compiled inference graph transforms each Winograd conv's weight once and
 * keeps it, and transforms it again whenever the weight changes: written in
 * place eagerly (an optimizer's step), loaded from a file, updated by a
 * compiled call, or another tensor passed in its place. Every call is
 * compared with eager, bit for bit. */
START_TEST(test_prepared_weight) {
  setenv("KILN_PREPARE", "all", 1); /* past the memory bound, which a graph this small never leaves room under */
  kiln_scope_begin();
  prep_ctx c = {kiln_mul(kiln_randn(KILN_F32, 4, ((int64_t[]){16, 17, 3, 3}), 1), kiln_scalar(KILN_F32, 0.1)),
                kiln_mul(kiln_randn(KILN_F32, 4, ((int64_t[]){18, 16, 3, 3}), 2), kiln_scalar(KILN_F32, 0.1))};
  kiln_tensor *x = kiln_randn(KILN_F32, 4, ((int64_t[]){1, 17, 19, 15}), 3);
  kiln_tensor *y1 = kiln_randn(KILN_F32, 4, ((int64_t[]){1, 16, 19, 15}), 4);
  int expect = prepares(x, c.w1, 1, 1) + prepares(y1, c.w2, 0, 2);
  kiln_options o = {.name = "prep", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(prep_body, &c, &o);
  kiln_tensor *y = NULL, *ref = NULL;
  long made = prep_made_count();
  ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error()); /* the trace */
  for (int i = 0; i < 3; i++) {
    ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
    ck_assert_int_eq(0, prep_body(&c, &x, &ref));
    expect_same_bits(y, ref, "unchanged weights");
  }
  ck_assert_int_eq(expect, prep_made_count() - made); /* made once, then kept */

  /* an eager SGD step on w1: its transform is made again, w2's kept */
  made = prep_made_count();
  kiln_sub_(c.w1, kiln_mul(kiln_randn(KILN_F32, 4, ((int64_t[]){16, 17, 3, 3}), 5), kiln_scalar(KILN_F32, 0.05)));
  ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
  ck_assert_int_eq(0, prep_body(&c, &x, &ref));
  expect_same_bits(y, ref, "after an eager step");
  ck_assert_int_eq(prepares(x, c.w1, 1, 1), prep_made_count() - made);

  /* loaded from a file (load_state_dict) */
  char path[] = "/tmp/kiln_prep_XXXXXX";
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  close(fd);
  kiln_tensor *other = kiln_randn(KILN_F32, 4, ((int64_t[]){18, 16, 3, 3}), 6);
  const char *names[1] = {"w2"};
  ck_assert_int_eq(0, kiln_save_tensors(path, 1, names, &other));
  ck_assert_msg(kiln_load_tensors_into(path, 1, names, &c.w2) == 0, "%s", kiln_last_error());
  unlink(path);
  ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
  ck_assert_int_eq(0, prep_body(&c, &x, &ref));
  expect_same_bits(y, ref, "after a load");

  /* updated by a compiled call (its write-back) */
  kiln_options ou = {.name = "prep_update", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *upd = kiln_compile(prep_update_body, &c, &ou);
  for (int i = 0; i < 2; i++) {
    kiln_tensor *d = kiln_randn(KILN_F32, 4, ((int64_t[]){16, 17, 3, 3}), 7 + (uint64_t)i), *r = NULL;
    ck_assert_msg(kiln_call(upd, &d, &r) == 0, "%s", kiln_last_error());
    ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
    ck_assert_int_eq(0, prep_body(&c, &x, &ref));
    expect_same_bits(y, ref, "after a compiled update");
  }
  kiln_fn_free(upd);
  kiln_fn_free(fn);

  /* the weight an argument: another tensor each call, then the first again after it changed in place */
  kiln_options oa = {.name = "prep_arg", .n_in = 2, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fa = kiln_compile(prep_arg_body, NULL, &oa);
  kiln_tensor *wa = kiln_randn(KILN_F32, 4, ((int64_t[]){16, 17, 3, 3}), 9), *wb = kiln_randn(KILN_F32, 4, ((int64_t[]){16, 17, 3, 3}), 10);
  kiln_tensor *order[4] = {wa, wb, wa, wa};
  for (int i = 0; i < 4; i++) {
    if (i == 3) kiln_mul_(wa, kiln_scalar(KILN_F32, -2));
    kiln_tensor *in[2] = {x, order[i]};
    ck_assert_msg(kiln_call(fa, in, &y) == 0, "%s", kiln_last_error());
    ck_assert_int_eq(0, prep_arg_body(NULL, in, &ref));
    expect_same_bits(y, ref, "weight an argument");
  }
  kiln_fn_free(fa);

  /* one variant over many sizes: below 64 tiles the conv runs im2col and the entry is dropped, then made again */
  kiln_options od = {.name = "prep_dyn", .n_in = 1, .n_out = 1, .dynamic = KILN_DYNAMIC_ALL, .backend = KILN_BACKEND_LLVM};
  kiln_fn *dyn = kiln_compile(prep_body, &c, &od);
  static const int64_t sizes[][3] = {{3, 19, 15}, {2, 5, 6}, {2, 11, 30}, {4, 19, 15}, {2, 5, 6}, {3, 19, 15}};
  for (int i = 0; i < 6; i++) {
    kiln_tensor *xd = kiln_randn(KILN_F32, 4, ((int64_t[]){sizes[i][0], 17, sizes[i][1], sizes[i][2]}), 20 + (uint64_t)i);
    ck_assert_msg(kiln_call(dyn, &xd, &y) == 0, "%s", kiln_last_error());
    ck_assert_int_eq(0, prep_body(&c, &xd, &ref));
    expect_same_bits(y, ref, "sizes changing");
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(dyn, &st));
  ck_assert_int_eq(1, st.traces);
  kiln_fn_free(dyn);
  kiln_scope_end();
  unsetenv("KILN_PREPARE");
}
END_TEST

/* Under the memory bound, a prepared weight takes room only where eager's
 * intermediates leave it beside the arena: none in a graph this small,
 * whose working memory outweighs its values; the results stay eager's. */
START_TEST(test_prepared_bound) {
  kiln_scope_begin();
  prep_ctx c = {kiln_mul(kiln_randn(KILN_F32, 4, ((int64_t[]){16, 17, 3, 3}), 1), kiln_scalar(KILN_F32, 0.1)),
                kiln_mul(kiln_randn(KILN_F32, 4, ((int64_t[]){18, 16, 3, 3}), 2), kiln_scalar(KILN_F32, 0.1))};
  kiln_tensor *x = kiln_randn(KILN_F32, 4, ((int64_t[]){1, 17, 19, 15}), 3), *y = NULL, *ref = NULL;
  kiln_options o = {.name = "prep_bound", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(prep_body, &c, &o);
  long made = prep_made_count();
  for (int i = 0; i < 3; i++) {
    ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
    ck_assert_int_eq(0, prep_body(&c, &x, &ref));
    expect_same_bits(y, ref, "bounded");
  }
  ck_assert_int_eq(0, prep_made_count() - made);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* A conv inside a loop whose weight the enclosing loop's step computes: the
 * region's runs reuse that weight's storage with new data and no new
 * version, so a weight prepared there would be stale from the second outer
 * step on. Only top-level variants keep prepared weights; every step and
 * call is eager's to the bit, KILN_PREPARE=all included. */
typedef struct nested_ctx {
  kiln_tensor *x, *w, *dummy, *cur;
} nested_ctx;
static int nested_inner(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  nested_ctx *c = ctx;
  out[0] = kiln_add(in[0], in[1]);
  out[1] = kiln_conv2d(kiln_relu(kiln_conv2d(kiln_add(c->x, in[1]), c->cur, NULL, NULL, (int[]){1, 1}, NULL, 1)), c->cur,
                       NULL, NULL, (int[]){1, 1}, NULL, 1);
  return out[0] && out[1] ? 0 : -1;
}
static int nested_outer(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  nested_ctx *c = ctx;
  c->cur = kiln_mul(c->w, in[1]); /* this step's weight: w * s[t] */
  kiln_tensor *last, *ys;
  if (kiln_scan(nested_inner, c, 1, &in[0], 1, &c->dummy, &last, 1, &ys)) return -1;
  out[0] = last;
  out[1] = kiln_sum(ys, 0, false);
  return 0;
}
static int nested_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  nested_ctx *c = ctx;
  kiln_tensor *last;
  c->w = in[0];
  return kiln_scan(nested_outer, c, 1, &in[2], 1, &in[1], &last, 1, &out[0]);
}

START_TEST(test_prepared_not_in_loops) {
  kiln_scope_begin();
  setenv("KILN_PREPARE", "all", 1);
  nested_ctx c = {.x = kiln_randn(KILN_F32, 4, ((int64_t[]){2, 16, 12, 12}), 3),
                  .dummy = kiln_zeros(KILN_F32, 1, ((int64_t[]){2}))};
  kiln_tensor *in[3] = {kiln_mul(kiln_randn(KILN_F32, 4, ((int64_t[]){16, 16, 3, 3}), 1), kiln_scalar(KILN_F32, 0.1)),
                        kiln_tensor_from(KILN_F32, 1, ((int64_t[]){4}), ((float[]){1, 2, 3, 4})),
                        kiln_zeros(KILN_F32, 0, NULL)};
  kiln_options o = {.name = "prep_nested", .n_in = 3, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(nested_body, &c, &o);
  kiln_tensor *ref = NULL, *y = NULL;
  ck_assert_int_eq(0, nested_body(&c, in, &ref));
  for (int call = 0; call < 3; call++) {
    ck_assert_msg(kiln_call(fn, in, &y) == 0, "%s", kiln_last_error());
    expect_same_bits(y, ref, "nested");
  }
  kiln_fn_free(fn);
  unsetenv("KILN_PREPARE");
  kiln_scope_end();
}
END_TEST

static Suite *cnn_suite(void) {
  Suite *s = suite_create("cnn");
  TCase *tc = tcase_create("compiled");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_training_three_ways);
  tcase_add_test(tc, test_inference_three_ways);
  tcase_add_test(tc, test_running_stats_write_back);
  tcase_add_test(tc, test_conv_epilogue_plan);
  tcase_add_test(tc, test_broadcast_costly_stored);
  tcase_add_test(tc, test_save_load);
  tcase_add_test(tc, test_prepared_weight);
  tcase_add_test(tc, test_prepared_bound);
  tcase_add_test(tc, test_prepared_not_in_loops);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(cnn_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
