/* The attention pass and the fused attention kernel in compiled code: each
 * way of writing attention (a scale by mul or div, no mask, where with a
 * bool mask kept, masked_fill, an additive mask; 3-D and 4-D) compiled with
 * the LLVM backend fuses (asserted on the kernels) and agrees with the body
 * run eagerly, with the interpreter (which runs the unfused ops) and with
 * the LLVM backend unfused (KILN_FUSE_ATTENTION=0), at sizes around the
 * kernel's blocks, f32 and f64; the pass keeps off graphs that read the
 * probabilities elsewhere (a second output); check mode passes; one variant
 * serves symbolic sizes; the GPT's forward fuses. The backward: the fused
 * op's gradients (attention_grad) against the unfused ops' and finite
 * differences, the same bits at 1 to 3 threads; training steps fuse forward
 * and backward and agree with eager, the interpreter and LLVM unfused; a
 * graph holding the fused op runs bit for bit the same three ways; the
 * GPT's training step fuses. The kernels' values against numpy are
 * test_ops_ref's "attention" family. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codegen/codegen.h"
#include "kiln.h"

#include "../examples/gpt.h"

enum { M_NONE, M_KEEP, M_DROP, M_ADD };

/* max |a - b| / (1 + |b|) over the elements (NaN in both counts as equal); *bad its index. */
static double maxdiff_rel(kiln_tensor *a, kiln_tensor *b, int64_t *bad) {
  int64_t n = kiln_numel(a);
  ck_assert_int_eq(n, kiln_numel(b));
  double *x = malloc(sizeof(double) * (size_t)(n + 1)), *y = malloc(sizeof(double) * (size_t)(n + 1)), m = 0;
  kiln_scope_begin();
  ck_assert(x && y && !kiln_read(kiln_cast(a, KILN_F64), x, sizeof(double) * (size_t)n) &&
            !kiln_read(kiln_cast(b, KILN_F64), y, sizeof(double) * (size_t)n));
  kiln_scope_end();
  *bad = -1;
  for (int64_t i = 0; i < n; i++) {
    if ((isnan(x[i]) && isnan(y[i])) || x[i] == y[i]) continue;
    double e = fabs(x[i] - y[i]) / (1 + fabs(y[i]));
    if (!(e <= m)) m = isnan(e) ? INFINITY : e, *bad = i;
  }
  free(x), free(y);
  return m;
}

static bool same_shape(const kiln_tensor *a, const kiln_tensor *b) {
  if (kiln_ndim(a) != kiln_ndim(b)) return false;
  for (int d = 0; d < kiln_ndim(a); d++)
    if (kiln_size(a, d) != kiln_size(b, d)) return false;
  return true;
}

typedef struct att_ctx {
  kiln_dtype dt;
  int mask;          /* M_* */
  bool by_div;       /* the scale as a divide (W7), else a multiply (the GPT) */
  bool probs_out;    /* the probabilities are a second output */
  bool scores_out;   /* the scaled scores are a second output */
  kiln_tensor *keep; /* (TMAX,TMAX) bool: col <= row */
  kiln_tensor *drop; /* its negation */
  kiln_tensor *add;  /* 0 where keep, -inf elsewhere */
} att_ctx;

enum { TMAX = 160 };

/* out[0] = softmax(q @ k^T / sqrt(D) [masked]) @ v for q, k, v (..., T, D|E). */
static int att_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  att_ctx *c = ctx;
  int nd = kiln_ndim(in[0]);
  int64_t T = kiln_size(in[0], -2), S = kiln_size(in[1], -2), D = kiln_size(in[0], -1);
  kiln_tensor *s = kiln_matmul(in[0], kiln_transpose(in[1], nd - 2, nd - 1));
  s = c->by_div ? kiln_div(s, kiln_scalar(c->dt, sqrt((double)D))) : kiln_mul(s, kiln_scalar(c->dt, 1 / sqrt((double)D)));
  if (c->mask == M_KEEP)
    s = kiln_where(kiln_slice(kiln_slice(c->keep, 0, 0, T, 1), 1, 0, S, 1), s, kiln_scalar(c->dt, -INFINITY));
  else if (c->mask == M_DROP)
    s = kiln_masked_fill(s, kiln_slice(kiln_slice(c->drop, 0, 0, T, 1), 1, 0, S, 1), -INFINITY);
  else if (c->mask == M_ADD)
    s = kiln_add(kiln_slice(kiln_slice(c->add, 0, 0, T, 1), 1, 0, S, 1), s);
  kiln_tensor *p = kiln_softmax(s, -1);
  out[0] = kiln_matmul(p, in[2]);
  if (c->probs_out) out[1] = p;
  if (c->scores_out) out[1] = s;
  return 0;
}

static void ctx_init(att_ctx *c, kiln_dtype dt, int mask) {
  *c = (att_ctx){.dt = dt, .mask = mask};
  kiln_tensor *pos = kiln_arange(KILN_I64, 0, TMAX, 1);
  c->keep = kiln_keep(kiln_le(kiln_unsqueeze(pos, 0), kiln_unsqueeze(pos, 1)));
  c->drop = kiln_keep(kiln_gt(kiln_unsqueeze(pos, 0), kiln_unsqueeze(pos, 1)));
  c->add = kiln_keep(kiln_where(c->keep, kiln_scalar(dt, 0), kiln_scalar(dt, -INFINITY)));
  ck_assert(c->keep && c->drop && c->add);
}

static void ctx_free(att_ctx *c) {
  kiln_release(c->keep);
  kiln_release(c->drop);
  kiln_release(c->add);
}

/* Whether the newest variant of fn, compiled by the LLVM backend, has a kernel named *_<what>. */
static bool has_kernel(kiln_fn *fn, const char *what) {
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  char *text = kiln_fn_graph(fn, (int)st.variants - 1), err[256], *dump = NULL;
  ck_assert_ptr_nonnull(text);
  ir_graph *g = ir_parse(text, err, sizeof err);
  ck_assert_msg(g != NULL, "%s", err);
  size_t dn = 0;
  FILE *f = open_memstream(&dump, &dn);
  backend_exec *e = backend_llvm.compile(g, KILN_DUMP_KERNELS, f, err, sizeof err);
  ck_assert_msg(e != NULL, "%s", err);
  backend_llvm.free(e);
  fclose(f);
  ir_free(g);
  char needle[64];
  snprintf(needle, sizeof needle, "_%s ->", what);
  bool r = strstr(dump, needle) != NULL;
  free(dump);
  free(text);
  return r;
}

static bool has_attention_kernel(kiln_fn *fn) { return has_kernel(fn, "attention"); }

static kiln_tensor *randn(kiln_dtype dt, int nd, const int64_t *shape, uint64_t seed) {
  return kiln_randn(dt, nd, shape, seed);
}

/* out = the body compiled on backend (fused or not), called twice. */
static kiln_fn *compiled(att_ctx *c, int be, int n_out, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_options o = {.name = "att", .n_in = 3, .n_out = n_out, .backend = be};
  kiln_fn *fn = kiln_compile(att_body, c, &o);
  ck_assert_int_eq(0, kiln_call(fn, in, out));
  ck_assert_int_eq(0, kiln_call(fn, in, out));
  return fn;
}

static double tol_of(kiln_dtype dt) { return dt == KILN_F32 ? 2e-5 : 1e-11; }

/* One case: eager, interpreter, LLVM fused and LLVM unfused agree; the fused
 * one has an attention kernel and the unfused one none. */
static void case_three_ways(kiln_dtype dt, int mask, bool by_div, int nd, const int64_t *qs, int64_t S, int64_t E) {
  kiln_scope_begin();
  att_ctx c;
  ctx_init(&c, dt, mask);
  c.by_div = by_div;
  int64_t ks[4], vs[4];
  for (int d = 0; d < nd; d++) ks[d] = vs[d] = qs[d];
  ks[nd - 2] = vs[nd - 2] = S;
  vs[nd - 1] = E;
  kiln_tensor *in[3] = {randn(dt, nd, qs, 11), randn(dt, nd, ks, 12), randn(dt, nd, vs, 13)};
  kiln_tensor *ref, *y, *yi, *yu;
  ck_assert_int_eq(0, att_body(&c, in, &ref));
  kiln_fn *fn = compiled(&c, KILN_BACKEND_LLVM, 1, in, &y);
  kiln_fn *fi = compiled(&c, KILN_BACKEND_INTERP, 1, in, &yi);
  ck_assert_int_eq(0, setenv("KILN_FUSE_ATTENTION", "0", 1));
  kiln_fn *fu = compiled(&c, KILN_BACKEND_LLVM, 1, in, &yu);
  ck_assert_msg(!has_attention_kernel(fu), "fused with KILN_FUSE_ATTENTION=0");
  unsetenv("KILN_FUSE_ATTENTION");
  ck_assert_msg(has_attention_kernel(fn), "mask %d, T %lld, S %lld: not fused", mask, (long long)qs[nd - 2], (long long)S);
  int64_t bad;
  double d = maxdiff_rel(y, ref, &bad), di = maxdiff_rel(yi, ref, &bad), du = maxdiff_rel(yu, ref, &bad);
  double df = maxdiff_rel(y, yu, &bad);
  ck_assert(same_shape(y, ref));
  ck_assert_msg(d <= tol_of(dt) && di <= tol_of(dt) && du <= tol_of(dt) && df <= tol_of(dt),
                "%s mask %d nd %d T %lld S %lld D %lld E %lld: fused %g (at %lld), interpreter %g, unfused %g from eager; "
                "fused %g from unfused",
                dt == KILN_F32 ? "f32" : "f64", mask, nd, (long long)qs[nd - 2], (long long)S, (long long)qs[nd - 1],
                (long long)E, d, (long long)bad, di, du, df);
  kiln_fn_free(fn);
  kiln_fn_free(fi);
  kiln_fn_free(fu);
  ctx_free(&c);
  kiln_scope_end();
}

START_TEST(test_fused_three_ways) {
  /* (T, S, D, E): a row, odd sizes about the 64-row blocks and the 128 (f32)
   * or 64 (f64) column tiles, head dims 1 to 128 */
  static const int64_t sizes[][4] = {{1, 1, 1, 1},    {1, 9, 8, 8},     {5, 5, 3, 7},     {63, 63, 16, 16},
                                     {65, 65, 17, 33}, {130, 130, 64, 64}, {7, 70, 128, 5}, {100, 33, 2, 128},
                                     {150, 150, 8, 8}};
  for (int dti = 0; dti < 2; dti++) {
    kiln_dtype dt = dti ? KILN_F64 : KILN_F32;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
      for (int mask = M_NONE; mask <= M_ADD; mask++) {
        const int64_t *z = sizes[i];
        /* masks are sliced from (TMAX,TMAX): causal from the top left, so S <= T keeps a column per row */
        if (mask != M_NONE && z[1] > z[0]) continue;
        int64_t q3[3] = {2, z[0], z[2]};
        case_three_ways(dt, mask, mask == M_NONE, 3, q3, z[1], z[3]);
      }
    int64_t q4[4] = {2, 3, 37, 24}, q2[2] = {70, 8};
    case_three_ways(dt, M_KEEP, false, 4, q4, 37, 24);
    case_three_ways(dt, M_NONE, true, 4, q4, 50, 24);
    case_three_ways(dt, M_DROP, false, 2, q2, 70, 8);
  }
}
END_TEST

/* The probabilities (or the scaled scores) read elsewhere, as a second output: not fused, and right. */
static void case_read_elsewhere(bool probs) {
  kiln_scope_begin();
  att_ctx c;
  ctx_init(&c, KILN_F32, M_KEEP);
  c.probs_out = probs;
  c.scores_out = !probs;
  int64_t sh[3] = {2, 40, 16};
  kiln_tensor *in[3] = {randn(KILN_F32, 3, sh, 1), randn(KILN_F32, 3, sh, 2), randn(KILN_F32, 3, sh, 3)};
  kiln_tensor *y[2], *ref[2];
  kiln_fn *fn = compiled(&c, KILN_BACKEND_LLVM, 2, in, y);
  ck_assert(!has_attention_kernel(fn));
  ck_assert_int_eq(0, att_body(&c, in, ref));
  int64_t bad;
  for (int i = 0; i < 2; i++) ck_assert_double_le(maxdiff_rel(y[i], ref[i], &bad), 2e-5);
  kiln_fn_free(fn);
  ctx_free(&c);
  kiln_scope_end();
}

START_TEST(test_read_elsewhere) {
  case_read_elsewhere(true);
  case_read_elsewhere(false);
}
END_TEST

/* ---- the fused op's backward (attention_grad) ---- */

/* The fused op itself, as the attention pass makes it: through dispatch, with autograd. */
static kiln_tensor *fused_op(kiln_tensor *q, kiln_tensor *k, kiln_tensor *v, kiln_tensor *mask, double scale, bool drop) {
  kiln_tensor *in[4] = {q, k, v, mask};
  op_attrs a = {.value = scale, .flag = drop};
  return op_dispatch(OP_ATTENTION, in, mask ? 4 : 3, &a, __FILE__, __LINE__);
}

/* The same spelled out in primitives (the GPT's way: a multiply, where with a kept bool mask). */
static kiln_tensor *unfused_op(kiln_tensor *q, kiln_tensor *k, kiln_tensor *v, kiln_tensor *keep, double scale) {
  int nd = kiln_ndim(q);
  kiln_tensor *s = kiln_mul(kiln_matmul(q, kiln_transpose(k, nd - 2, nd - 1)), kiln_scalar(kiln_type(q), scale));
  if (keep) s = kiln_where(keep, s, kiln_scalar(kiln_type(q), -INFINITY));
  return kiln_matmul(kiln_softmax(s, -1), v);
}

/* dq, dk, dv of sum(attention(q, k, v) * w), fused or not, into g[0..3) (kept). */
static void grads_of(bool fused, kiln_tensor *const *qkv, kiln_tensor *w, kiln_tensor *keep, double scale,
                     kiln_tensor **g) {
  kiln_scope_begin();
  kiln_tensor *x[3];
  for (int i = 0; i < 3; i++) {
    x[i] = kiln_contiguous(qkv[i]);
    x[i] = kiln_mul(x[i], kiln_scalar(kiln_type(x[i]), 1)); /* a fresh leaf */
    kiln_requires_grad(x[i], true);
  }
  kiln_tensor *o = fused ? fused_op(x[0], x[1], x[2], keep, scale, false) : unfused_op(x[0], x[1], x[2], keep, scale);
  ck_assert_ptr_nonnull(o);
  ck_assert_int_eq(0, kiln_backward(kiln_sum_all(kiln_mul(o, w))));
  for (int i = 0; i < 3; i++) {
    ck_assert_ptr_nonnull(kiln_grad(x[i]));
    g[i] = kiln_keep(kiln_contiguous(kiln_grad(x[i])));
  }
  kiln_scope_end();
}

/* max |a - b| over max |b| (NaN anywhere: infinity). */
static double maxdiff_scaled(kiln_tensor *a, kiln_tensor *b) {
  int64_t n = kiln_numel(a);
  ck_assert_int_eq(n, kiln_numel(b));
  double *x = malloc(sizeof(double) * (size_t)(n + 1)), *y = malloc(sizeof(double) * (size_t)(n + 1)), m = 0, big = 0;
  kiln_scope_begin();
  ck_assert(x && y && !kiln_read(kiln_cast(a, KILN_F64), x, sizeof(double) * (size_t)n) &&
            !kiln_read(kiln_cast(b, KILN_F64), y, sizeof(double) * (size_t)n));
  kiln_scope_end();
  for (int64_t i = 0; i < n; i++) {
    double e = fabs(x[i] - y[i]);
    if (!(e <= m)) m = isnan(e) ? INFINITY : e;
    if (fabs(y[i]) > big) big = fabs(y[i]);
  }
  free(x), free(y);
  return m / (big > 0 ? big : 1);
}

/* Bitwise equality of two tensors' values. */
static bool same_bits(kiln_tensor *a, kiln_tensor *b) {
  int64_t n = kiln_numel(a);
  if (n != kiln_numel(b) || kiln_type(a) != kiln_type(b)) return false;
  size_t bytes = (size_t)n * (kiln_type(a) == KILN_F64 ? 8 : 4);
  char *x = malloc(bytes + 1), *y = malloc(bytes + 1);
  kiln_scope_begin();
  bool ok = x && y && !kiln_read(kiln_contiguous(a), x, bytes) && !kiln_read(kiln_contiguous(b), y, bytes) &&
            memcmp(x, y, bytes) == 0;
  kiln_scope_end();
  free(x), free(y);
  return ok;
}

/* The tolerance of the fused gradients against the unfused ones, relative to
 * the largest gradient: both sum the same terms in other orders, the longest
 * sums of n = S + D + E terms (dq: S terms of ds k, each ds from a dot of E
 * and a softmax over S; dk and dv: T terms), so each is within about n u of
 * the sum of |terms|, which a softmax keeps within a small factor of the
 * largest gradient on these random inputs: 4 n u, u = 2^-24 or 2^-53. */
static double grad_tol(kiln_dtype dt, int64_t T, int64_t S, int64_t D, int64_t E) {
  int64_t n = (S > T ? S : T) + D + E;
  return 4.0 * (double)n * (dt == KILN_F32 ? 0x1p-24 : 0x1p-53);
}

/* A training step through attention: q, k and v projected by weights, those
 * of `need` (bits 1 q, 2 k, 4 v) trained. The LLVM backend fuses the forward
 * and the backward (attention_grad); eager, the interpreter and LLVM with
 * the pass off run the primitives. */
typedef struct train_ctx {
  att_ctx a;
  kiln_tensor *w[3]; /* (D,D) each */
  int need;
} train_ctx;

static int train_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  train_ctx *t = ctx;
  kiln_tensor *qkv[3], *y;
  for (int i = 0; i < 3; i++) qkv[i] = kiln_matmul(in[i], t->w[i]);
  att_body(&t->a, qkv, &y);
  kiln_tensor *loss = kiln_sum_all(kiln_mul(y, y));
  if (kiln_backward(loss)) return -1;
  out[0] = loss;
  for (int i = 0, o = 1; i < 3; i++)
    if (t->need >> i & 1) {
      out[o++] = kiln_mul((kiln_tensor *)kiln_grad(t->w[i]), kiln_scalar(t->a.dt, 1));
      kiln_zero_grad(t->w[i]);
    }
  return 0;
}

static void case_training(kiln_dtype dt, int mask, bool by_div, int need, int64_t T, int64_t D) {
  kiln_scope_begin();
  train_ctx t = {.need = need};
  ctx_init(&t.a, dt, mask);
  t.a.by_div = by_div;
  int64_t sh[3] = {2, T, D}, w[2] = {D, D};
  int n_out = 1;
  for (int i = 0; i < 3; i++) {
    t.w[i] = kiln_keep(kiln_mul(randn(dt, 2, w, 5 + i), kiln_scalar(dt, 0.5)));
    if (need >> i & 1) kiln_requires_grad(t.w[i], true), n_out++;
  }
  kiln_tensor *in[3] = {randn(dt, 3, sh, 1), randn(dt, 3, sh, 2), randn(dt, 3, sh, 3)};
  kiln_tensor *ref[4], *y[3][4];
  ck_assert_int_eq(0, train_body(&t, in, ref));
  kiln_fn *fn[3];
  for (int b = 0; b < 3; b++) { /* LLVM fused (at any length), the interpreter, LLVM unfused */
    ck_assert_int_eq(0, setenv("KILN_FUSE_ATTENTION", b == 2 ? "0" : "1", 1));
    kiln_options o = {.name = "train", .n_in = 3, .n_out = n_out, .backend = b == 1 ? KILN_BACKEND_INTERP : KILN_BACKEND_LLVM};
    fn[b] = kiln_compile(train_body, &t, &o);
    ck_assert_int_eq(0, kiln_call(fn[b], in, y[b]));
    ck_assert_int_eq(0, kiln_call(fn[b], in, y[b]));
  }
  ck_assert_msg(!has_kernel(fn[2], "attention_grad"), "fused with KILN_FUSE_ATTENTION=0");
  ck_assert_int_eq(0, setenv("KILN_FUSE_ATTENTION", "1", 1));
  ck_assert_msg(has_kernel(fn[0], "attention") && has_kernel(fn[0], "attention_grad"),
                "mask %d need %d: the training step did not fuse", mask, need);
  /* by default a training graph fuses from 256 x 256 scores on (fuse_attention.c, train_pays) */
  unsetenv("KILN_FUSE_ATTENTION");
  ck_assert_msg(has_kernel(fn[0], "attention_grad") == (T * T >= 256 * 256), "T %lld: fused %d by default",
                (long long)T, (int)has_kernel(fn[0], "attention_grad"));
  /* the weights' gradients sum T rows of dq (dk, dv) times the inputs: D more terms */
  double tol = grad_tol(dt, T, T, 2 * D, D);
  for (int i = 0; i < n_out; i++) {
    double d0 = maxdiff_scaled(y[0][i], ref[i]), d1 = maxdiff_scaled(y[1][i], ref[i]), d2 = maxdiff_scaled(y[2][i], ref[i]);
    ck_assert_msg(d0 <= tol && d1 <= tol && d2 <= tol,
                  "%s mask %d need %d T %lld out %d: fused %g, interpreter %g, unfused %g from eager (tol %g)",
                  dt == KILN_F32 ? "f32" : "f64", mask, need, (long long)T, i, d0, d1, d2, tol);
  }
  for (int b = 0; b < 3; b++) kiln_fn_free(fn[b]);
  for (int i = 0; i < 3; i++) kiln_release(t.w[i]);
  ctx_free(&t.a);
  kiln_scope_end();
}

START_TEST(test_training_fuses) {
  for (int dti = 0; dti < 2; dti++) {
    kiln_dtype dt = dti ? KILN_F64 : KILN_F32;
    for (int mask = M_NONE; mask <= M_ADD; mask++) case_training(dt, mask, mask == M_DROP, 7, 33, 8);
    case_training(dt, M_KEEP, false, 1, 20, 8); /* q's gradient only */
    case_training(dt, M_KEEP, false, 4, 7, 24); /* v's only */
    case_training(dt, M_DROP, true, 6, 130, 24);
    case_training(dt, M_NONE, false, 3, 2, 64);
    case_training(dt, M_NONE, false, 4, 1, 64); /* T 1: dq and dk are 0 but for rounding, nothing to compare */
    if (dt == KILN_F32) case_training(dt, M_NONE, false, 7, 256, 8); /* long enough to fuse by default */
  }
}
END_TEST

/* A body that calls the fused op itself (as the pass makes it) on q, k and
 * v (the context's, trained), traced with its backward of sum(y * w): eager,
 * the interpreter and LLVM run the same kernels on the same operands (the
 * interpreter and LLVM call attention and attention_grad eagerly), so y,
 * dq, dk and dv agree to the bit. */
static int fused_train_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  train_ctx *t = ctx;
  int64_t T = kiln_size(t->w[0], -2);
  kiln_tensor *keep = kiln_slice(kiln_slice(t->a.keep, 0, 0, T, 1), 1, 0, T, 1);
  kiln_tensor *y = fused_op(t->w[0], t->w[1], t->w[2], keep, 0.3, false);
  if (kiln_backward(kiln_sum_all(kiln_mul(y, in[0])))) return -1;
  out[0] = y;
  for (int i = 0; i < 3; i++) {
    out[1 + i] = kiln_contiguous((kiln_tensor *)kiln_grad(t->w[i]));
    kiln_zero_grad(t->w[i]);
  }
  return 0;
}

START_TEST(test_fused_op_three_ways_bitwise) {
  for (int dti = 0; dti < 2; dti++) {
    kiln_dtype dt = dti ? KILN_F64 : KILN_F32;
    kiln_scope_begin();
    train_ctx t = {.need = 7};
    ctx_init(&t.a, dt, M_KEEP);
    int64_t sh[3] = {3, 70, 24};
    for (int i = 0; i < 3; i++) {
      t.w[i] = kiln_keep(randn(dt, 3, sh, 5 + i));
      kiln_requires_grad(t.w[i], true);
    }
    kiln_tensor *in[1] = {randn(dt, 3, sh, 1)}, *ref[4], *y[4];
    ck_assert_int_eq(0, fused_train_body(&t, in, ref));
    for (int b = 0; b < 2; b++) {
      kiln_options o = {.name = "fused", .n_in = 1, .n_out = 4, .backend = b ? KILN_BACKEND_INTERP : KILN_BACKEND_LLVM};
      kiln_fn *fn = kiln_compile(fused_train_body, &t, &o);
      ck_assert_int_eq(0, kiln_call(fn, in, y));
      ck_assert_int_eq(0, kiln_call(fn, in, y));
      if (!b) ck_assert(has_kernel(fn, "attention_grad"));
      for (int i = 0; i < 4; i++)
        ck_assert_msg(same_bits(y[i], ref[i]), "%s: output %d differs from eager", b ? "interpreter" : "LLVM", i);
      kiln_fn_free(fn);
    }
    for (int i = 0; i < 3; i++) kiln_release(t.w[i]);
    ctx_free(&t.a);
    kiln_scope_end();
  }
}
END_TEST

/* Bad input: attention_grad's shapes checked (the error names the op and the
 * shapes); an additive mask that needs a gradient is refused by the backward. */
START_TEST(test_grad_errors) {
  kiln_scope_begin();
  int64_t sh[3] = {2, 5, 4}, bad[3] = {2, 5, 3}, ms[2] = {5, 5};
  kiln_tensor *q = randn(KILN_F32, 3, sh, 1), *o = randn(KILN_F32, 3, sh, 2), *d = randn(KILN_F32, 3, bad, 3);
  kiln_tensor *in[5] = {q, q, q, o, d};
  op_attrs a = {.value = 0.5};
  ck_assert_ptr_null(op_dispatch(OP_ATTENTION_GRAD, in, 5, &a, __FILE__, __LINE__));
  ck_assert_msg(strstr(kiln_last_error(), "attention_grad") && strstr(kiln_last_error(), "do [2,5,3]"), "%s",
                kiln_last_error());
  ck_assert_ptr_null(op_dispatch(OP_ATTENTION_GRAD, in, 3, &a, __FILE__, __LINE__));
  kiln_tensor *add = randn(KILN_F32, 2, ms, 4), *x = kiln_mul(q, kiln_scalar(KILN_F32, 1));
  kiln_requires_grad(add, true);
  kiln_requires_grad(x, true);
  kiln_tensor *y = fused_op(x, x, x, add, 0.5, false);
  ck_assert_ptr_nonnull(y);
  ck_assert_int_eq(-1, kiln_backward(kiln_sum_all(y)));
  ck_assert_msg(strstr(kiln_last_error(), "no gradient for the mask"), "%s", kiln_last_error());
  kiln_scope_end();
}
END_TEST

/* The GPT's training step (W8's, examples/gpt.h) compiled: forward and
 * backward attention fuse, and the losses of three steps follow eager's. */
START_TEST(test_gpt_training_fuses) {
  gpt_config cfg = {.n_layer = 2, .n_head = 2, .n_embd = 32, .block_size = 80, .vocab_size = 64, .dtype = KILN_F32,
                    .opt = GPT_ADAMW_DEFAULT};
  gpt ge, gc;
  ck_assert_int_eq(0, gpt_init(&ge, &cfg, 7));
  ck_assert_int_eq(0, gpt_init(&gc, &cfg, 7));
  kiln_scope_begin();
  int64_t sh[2] = {2, 70};
  kiln_tensor *idx = kiln_cast(kiln_mul(kiln_rand(KILN_F32, 2, sh, 3), kiln_scalar(KILN_F32, 63.9)), KILN_I64);
  kiln_tensor *tgt = kiln_cast(kiln_mul(kiln_rand(KILN_F32, 2, sh, 4), kiln_scalar(KILN_F32, 63.9)), KILN_I64);
  kiln_options o = {.name = "gpt_step", .n_in = 2, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(gpt_train_body, &gc, &o);
  ck_assert_ptr_nonnull(fn);
  ck_assert_int_eq(0, setenv("KILN_FUSE_ATTENTION", "1", 1)); /* T 70: fused only when asked */
  for (int step = 0; step < 3; step++) {
    kiln_tensor *in[2] = {idx, tgt}, *lc, *le = gpt_train_step(&ge, idx, tgt);
    ck_assert_int_eq(0, kiln_call(fn, in, &lc));
    double a, b;
    ck_assert_ptr_nonnull(le);
    kiln_scope_begin();
    ck_assert(!kiln_read(kiln_cast(le, KILN_F64), &a, sizeof a) && !kiln_read(kiln_cast(lc, KILN_F64), &b, sizeof b));
    kiln_scope_end();
    ck_assert_msg(fabs(a - b) <= 1e-5 * fabs(a), "step %d: eager loss %.9g, compiled %.9g", step, a, b);
  }
  ck_assert(has_kernel(fn, "attention") && has_kernel(fn, "attention_grad"));
  unsetenv("KILN_FUSE_ATTENTION");
  kiln_fn_free(fn);
  kiln_scope_end();
  gpt_free(&ge);
  gpt_free(&gc);
}
END_TEST

/* Check mode compares the fused call with the body run eagerly: no failures. */
START_TEST(test_check_mode) {
  kiln_scope_begin();
  att_ctx c;
  ctx_init(&c, KILN_F32, M_DROP);
  int64_t sh[3] = {3, 70, 32};
  kiln_tensor *in[3] = {randn(KILN_F32, 3, sh, 1), randn(KILN_F32, 3, sh, 2), randn(KILN_F32, 3, sh, 3)};
  kiln_options o = {.name = "checked", .n_in = 3, .n_out = 1, .backend = KILN_BACKEND_LLVM, .check = 1};
  kiln_fn *fn = kiln_compile(att_body, &c, &o);
  kiln_tensor *y;
  for (int i = 0; i < 3; i++) ck_assert_int_eq(0, kiln_call(fn, in, &y));
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(0, st.check_fails);
  ck_assert(has_attention_kernel(fn));
  kiln_fn_free(fn);
  ctx_free(&c);
  kiln_scope_end();
}
END_TEST

/* T changes from call to call: the second variant has T symbolic, fuses, and
 * serves the sizes after it. */
START_TEST(test_symbolic_sizes) {
  kiln_scope_begin();
  att_ctx c;
  ctx_init(&c, KILN_F32, M_KEEP);
  kiln_options o = {.name = "sym", .n_in = 3, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(att_body, &c, &o);
  static const int64_t ts[] = {40, 70, 1, 129, 64};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) {
    int64_t sh[3] = {2, ts[i], 16};
    kiln_tensor *in[3] = {randn(KILN_F32, 3, sh, 1 + i), randn(KILN_F32, 3, sh, 2 + i), randn(KILN_F32, 3, sh, 3 + i)};
    kiln_tensor *y, *ref;
    ck_assert_int_eq(0, kiln_call(fn, in, &y));
    ck_assert_int_eq(0, att_body(&c, in, &ref));
    int64_t bad;
    ck_assert_msg(maxdiff_rel(y, ref, &bad) <= 2e-5, "T %lld", (long long)ts[i]);
    ck_assert_msg(has_attention_kernel(fn), "T %lld", (long long)ts[i]);
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(2, st.variants);
  kiln_fn_free(fn);
  ctx_free(&c);
  kiln_scope_end();
}
END_TEST

/* The GPT's next-byte logits (examples/gpt.h) compiled: its causal attention fuses. */
static int gpt_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = gpt_next_logits(ctx, in[0]);
  return 0;
}

START_TEST(test_gpt_forward_fuses) {
  gpt_config cfg = {.n_layer = 2, .n_head = 2, .n_embd = 32, .block_size = 80, .vocab_size = 64, .dtype = KILN_F32,
                    .opt = GPT_ADAMW_DEFAULT};
  gpt g;
  ck_assert_int_eq(0, gpt_init(&g, &cfg, 7));
  kiln_scope_begin();
  int64_t sh[2] = {2, 70};
  kiln_tensor *idx = kiln_cast(kiln_mul(kiln_rand(KILN_F32, 2, sh, 3), kiln_scalar(KILN_F32, 63.9)), KILN_I64);
  kiln_options o = {.name = "gpt", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(gpt_body, &g, &o);
  kiln_tensor *y, *ref;
  ck_assert_int_eq(0, kiln_call(fn, &idx, &y));
  ck_assert_int_eq(0, kiln_call(fn, &idx, &y));
  ck_assert(has_attention_kernel(fn));
  ck_assert_int_eq(0, gpt_body(&g, &idx, &ref));
  int64_t bad;
  ck_assert_double_le(maxdiff_rel(y, ref, &bad), 1e-4);
  kiln_fn_free(fn);
  kiln_scope_end();
  gpt_free(&g);
}
END_TEST

/* ---- decoding through a KV cache, as examples/llama.h's llama_step_body writes it ---- */

enum { DEC_ROWS = 6 }; /* rows of the mask table dec_ctx.table */

typedef struct dec_ctx {
  kiln_dtype dt;
  int64_t H, G, hs, S;       /* kv heads, query heads a kv head serves, head size, cache rows */
  kiln_tensor *kc, *vc;      /* (S, H*hs) caches, read by the body as captured tensors */
  kiln_tensor *table;        /* (DEC_ROWS, S) bool: the mask row each position selects */
} dec_ctx;

/* in: q (T, H*G, hs) and at (T,) i64, rows of the table; out: (H, G*T, hs),
 * attention over every row of the caches with the table's rows as the mask:
 * the heads as llama_attention lays them out ((S,H,hs) caches permuted, the
 * (H,G*T,S) scores seen as (H,G,T,S) for the (T,S) mask). */
static int dec_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  dec_ctx *c = ctx;
  int64_t T = kiln_size(in[0], 0), H = c->H, G = c->G, hs = c->hs, S = c->S;
  kiln_tensor *keys = kiln_permute(kiln_reshape(c->kc, 3, ((int64_t[]){S, H, hs})), ((int[]){1, 0, 2}));
  kiln_tensor *vals = kiln_permute(kiln_reshape(c->vc, 3, ((int64_t[]){S, H, hs})), ((int[]){1, 0, 2}));
  kiln_tensor *qg = kiln_reshape(kiln_permute(in[0], ((int[]){1, 0, 2})), 3, ((int64_t[]){H, G * T, hs}));
  kiln_tensor *att = kiln_mul(kiln_matmul(qg, kiln_transpose(keys, 1, 2)), kiln_scalar(c->dt, 1 / sqrt((double)hs)));
  kiln_tensor *mask = kiln_index_select(c->table, 0, in[1]); /* (T,S) */
  att = kiln_reshape(att, 4, ((int64_t[]){H, G, T, S}));
  att = kiln_softmax(kiln_where(mask, att, kiln_scalar(c->dt, -INFINITY)), -1);
  out[0] = kiln_matmul(kiln_reshape(att, 3, ((int64_t[]){H, G * T, S})), vals);
  return out[0] ? 0 : -1;
}

/* The mask table: rows keep none (row 0), the first column, about half, all,
 * and (row 4) random columns but none in columns 16..47 (whole 16-column
 * blocks of the kernel's mask test dropped between kept ones), row 5 the last column alone. */
static kiln_tensor *dec_table(int64_t S) {
  bool *t = calloc((size_t)(DEC_ROWS * S), 1);
  uint64_t x = 88172645463325252ull;
  for (int64_t c = 0; c < S; c++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    t[1 * S + c] = c == 0;
    t[2 * S + c] = c <= S / 2;
    t[3 * S + c] = true;
    t[4 * S + c] = c == 0 || ((c < 16 || c >= 48) && (x & 1));
    t[5 * S + c] = c == S - 1;
  }
  kiln_tensor *r = kiln_tensor_from(KILN_BOOL, 2, ((int64_t[]){DEC_ROWS, S}), t);
  free(t);
  return r;
}

/* out = dec_body compiled on backend be (fused unless KILN_FUSE_ATTENTION=0), called at each row set in ats. */
static kiln_fn *dec_compiled(dec_ctx *c, int be, kiln_tensor *q, kiln_tensor *const *ats, int n, kiln_tensor **out) {
  kiln_options o = {.name = "decode", .n_in = 2, .n_out = 1, .backend = be};
  kiln_fn *fn = kiln_compile(dec_body, c, &o);
  for (int i = 0; i < n; i++) {
    kiln_tensor *in[2] = {q, ats[i]};
    ck_assert_msg(kiln_call(fn, in, &out[i]) == 0, "%s", kiln_last_error());
  }
  return fn;
}

/* One shape: every row of the table (T 1) or sets of rows (T 2, 3), eager,
 * the interpreter, LLVM fused and LLVM unfused agree (a row that keeps
 * nothing is NaN in all four); it fuses exactly when the (T,S) mask means
 * the same over the (H,G*T,S) scores (T 1 or G 1); 1, 2 and 3 threads give
 * the fused kernel's bits. */
static void case_decode(kiln_dtype dt, int64_t H, int64_t G, int64_t hs, int64_t S, int64_t T) {
  kiln_scope_begin();
  dec_ctx c = {.dt = dt, .H = H, .G = G, .hs = hs, .S = S};
  c.kc = randn(dt, 2, ((int64_t[]){S, H * hs}), 21);
  c.vc = randn(dt, 2, ((int64_t[]){S, H * hs}), 22);
  c.table = dec_table(S);
  kiln_tensor *q = randn(dt, 3, ((int64_t[]){T, H * G, hs}), 23), *ats[DEC_ROWS];
  for (int r = 0; r < DEC_ROWS; r++) {
    int64_t at[3] = {r, (r + 1) % DEC_ROWS, (r + 3) % DEC_ROWS};
    ats[r] = kiln_tensor_from(KILN_I64, 1, &T, at);
  }
  kiln_tensor *y[DEC_ROWS], *yi[DEC_ROWS], *yu[DEC_ROWS], *yt[DEC_ROWS];
  kiln_fn *fn = dec_compiled(&c, KILN_BACKEND_LLVM, q, ats, DEC_ROWS, y);
  kiln_fn *fi = dec_compiled(&c, KILN_BACKEND_INTERP, q, ats, DEC_ROWS, yi);
  ck_assert_int_eq(0, setenv("KILN_FUSE_ATTENTION", "0", 1));
  kiln_fn *fu = dec_compiled(&c, KILN_BACKEND_LLVM, q, ats, DEC_ROWS, yu);
  unsetenv("KILN_FUSE_ATTENTION");
  ck_assert_msg(has_attention_kernel(fn) == (T == 1 || G == 1), "H %lld G %lld T %lld: fused %d", (long long)H,
                (long long)G, (long long)T, has_attention_kernel(fn));
  for (int r = 0; r < DEC_ROWS; r++) {
    kiln_tensor *ref, *in[2] = {q, ats[r]};
    ck_assert_int_eq(0, dec_body(&c, in, &ref));
    int64_t bad;
    double d = maxdiff_rel(y[r], ref, &bad), di = maxdiff_rel(yi[r], ref, &bad), du = maxdiff_rel(yu[r], ref, &bad);
    ck_assert_msg(same_shape(y[r], ref) && d <= tol_of(dt) && di <= tol_of(dt) && du <= tol_of(dt),
                  "%s H %lld G %lld hs %lld S %lld T %lld table row %d: fused %g (at %lld), interpreter %g, unfused %g",
                  dt == KILN_F32 ? "f32" : "f64", (long long)H, (long long)G, (long long)hs, (long long)S, (long long)T,
                  r, d, (long long)bad, di, du);
  }
  int before = kiln_get_num_threads();
  for (int th = 1; th <= 3; th++) {
    kiln_set_num_threads(th);
    kiln_fn *ft = dec_compiled(&c, KILN_BACKEND_LLVM, q, ats, DEC_ROWS, yt);
    for (int r = 0; r < DEC_ROWS; r++) ck_assert_msg(same_bits(yt[r], y[r]), "%d threads, table row %d: other bits", th, r);
    kiln_fn_free(ft);
  }
  kiln_set_num_threads(before);
  kiln_fn_free(fn), kiln_fn_free(fi), kiln_fn_free(fu);
  kiln_scope_end();
}

/* Decoding attention (one query row, or two or three) over a KV cache whose
 * mask row comes from index_select: the pattern fuses through llama.h's
 * permuted keys and reshaped scores, f32 and f64, odd head sizes. */
START_TEST(test_decode_fuses) {
  for (int dti = 0; dti < 2; dti++) {
    kiln_dtype dt = dti ? KILN_F64 : KILN_F32;
    case_decode(dt, 6, 1, 48, 256, 1); /* stories15M's layer */
    case_decode(dt, 2, 3, 7, 70, 1);   /* grouped queries */
    case_decode(dt, 3, 1, 33, 50, 2);
    case_decode(dt, 1, 1, 1, 17, 3);
    case_decode(dt, 2, 2, 5, 40, 2);   /* a (T,S) mask over G*T rows: not the same mask, not fused */
  }
}
END_TEST

START_TEST(test_grad_vs_unfused) {
  static const int64_t ts[] = {1, 7, 33, 130}, ds[] = {8, 24, 64};
  for (int dti = 0; dti < 2; dti++) {
    kiln_dtype dt = dti ? KILN_F64 : KILN_F32;
    kiln_scope_begin();
    att_ctx c;
    ctx_init(&c, dt, M_KEEP);
    for (size_t ti = 0; ti < 4; ti++)
      for (size_t di = 0; di < 3; di++)
        for (int causal = 0; causal < 2; causal++)
          for (int cross = 0; cross < 2; cross++) {
            kiln_scope_begin();
            int64_t T = ts[ti], D = ds[di], S = cross ? (causal ? (T + 1) / 2 : T + 5) : T, E = cross ? D + 3 : D;
            int64_t qs[4] = {2, 3, T, D}, ks[4] = {2, 3, S, D}, vs[4] = {2, 3, S, E}, os[4] = {2, 3, T, E};
            uint64_t seed = 100 * ti + 10 * di + 2 * causal + cross;
            kiln_tensor *qkv[3] = {randn(dt, 4, qs, seed), randn(dt, 4, ks, seed + 1000), randn(dt, 4, vs, seed + 2000)};
            kiln_tensor *w = randn(dt, 4, os, seed + 3000);
            kiln_tensor *keep = causal ? kiln_slice(kiln_slice(c.keep, 0, 0, T, 1), 1, 0, S, 1) : NULL;
            kiln_tensor *gf[3], *gu[3];
            grads_of(true, qkv, w, keep, 1 / sqrt((double)D), gf);
            grads_of(false, qkv, w, keep, 1 / sqrt((double)D), gu);
            for (int i = 0; i < 3; i++) {
              double d = maxdiff_scaled(gf[i], gu[i]), tol = grad_tol(dt, T, S, D, E);
              if (getenv("ATT_SHOW")) printf("%s T %lld D %lld causal %d cross %d d%c %.3g tol %.3g\n", dti ? "f64" : "f32", (long long)T, (long long)D, causal, cross, "qkv"[i], d, tol);
              ck_assert_msg(d <= tol, "%s T %lld S %lld D %lld E %lld causal %d: d%c off by %g of the largest (tol %g)",
                            dti ? "f64" : "f32", (long long)T, (long long)S, (long long)D, (long long)E, causal,
                            "qkv"[i], d, tol);
            }
            kiln_scope_end();
          }
    ctx_free(&c);
    kiln_scope_end();
  }
}
END_TEST

/* f64 gradients of the fused op against central differences of its forward. */
START_TEST(test_grad_finite_differences) {
  static const int64_t cases[][5] = {{7, 7, 8, 8, 1}, {5, 9, 3, 4, 0}, {1, 1, 2, 2, 1}, {66, 66, 2, 3, 1}};
  kiln_scope_begin();
  att_ctx c;
  ctx_init(&c, KILN_F64, M_KEEP);
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    kiln_scope_begin();
    int64_t T = cases[ci][0], S = cases[ci][1], D = cases[ci][2], E = cases[ci][3];
    int64_t qs[3] = {2, T, D}, ks[3] = {2, S, D}, vs[3] = {2, S, E}, os[3] = {2, T, E};
    kiln_tensor *qkv[3] = {randn(KILN_F64, 3, qs, 1 + ci), randn(KILN_F64, 3, ks, 2 + ci), randn(KILN_F64, 3, vs, 3 + ci)};
    kiln_tensor *w = randn(KILN_F64, 3, os, 4 + ci), *g[3];
    kiln_tensor *keep = cases[ci][4] ? kiln_slice(kiln_slice(c.keep, 0, 0, T, 1), 1, 0, S, 1) : NULL;
    double scale = 0.7;
    grads_of(true, qkv, w, keep, scale, g);
    for (int i = 0; i < 3; i++) {
      int64_t n = kiln_numel(qkv[i]);
      double *x = malloc(sizeof(double) * (size_t)n), *gr = malloc(sizeof(double) * (size_t)n), worst = 0;
      ck_assert(x && gr && !kiln_read(qkv[i], x, sizeof(double) * (size_t)n) &&
                !kiln_read(g[i], gr, sizeof(double) * (size_t)n));
      /* a few elements of big tensors: every one of small ones */
      for (int64_t e = 0; e < n; e += n > 64 ? n / 29 : 1) {
        double f[2], h = 1e-6, keepx = x[e];
        for (int side = 0; side < 2; side++) {
          x[e] = keepx + (side ? -h : h);
          kiln_scope_begin();
          kiln_tensor *in[3] = {qkv[0], qkv[1], qkv[2]};
          in[i] = kiln_tensor_from(KILN_F64, 3, i == 0 ? qs : i == 1 ? ks : vs, x);
          kiln_tensor *o = fused_op(in[0], in[1], in[2], keep, scale, false);
          ck_assert(!kiln_read(kiln_sum_all(kiln_mul(o, w)), &f[side], sizeof(double)));
          kiln_scope_end();
        }
        x[e] = keepx;
        double fd = (f[0] - f[1]) / (2 * h), err = fabs(fd - gr[e]) / (1 + fabs(gr[e]));
        if (err > worst) worst = err;
      }
      ck_assert_msg(worst <= 1e-7, "case %zu d%c: %g from finite differences", ci, "qkv"[i], worst);
      free(x), free(gr);
    }
    kiln_scope_end();
  }
  ctx_free(&c);
  kiln_scope_end();
}
END_TEST

/* 1, 2 and 3 threads give the same bits (a task is a whole batch entry). */
START_TEST(test_grad_threads) {
  int before = kiln_get_num_threads();
  for (int dti = 0; dti < 2; dti++) {
    kiln_dtype dt = dti ? KILN_F64 : KILN_F32;
    kiln_scope_begin();
    att_ctx c;
    ctx_init(&c, dt, M_KEEP);
    int64_t sh[4] = {3, 5, 130, 24};
    kiln_tensor *qkv[3] = {randn(dt, 4, sh, 1), randn(dt, 4, sh, 2), randn(dt, 4, sh, 3)}, *w = randn(dt, 4, sh, 4);
    kiln_tensor *keep = kiln_slice(kiln_slice(c.keep, 0, 0, 130, 1), 1, 0, 130, 1), *g1[3], *g[3];
    kiln_set_num_threads(1);
    grads_of(true, qkv, w, keep, 0.2, g1);
    for (int th = 2; th <= 3; th++) {
      kiln_set_num_threads(th);
      grads_of(true, qkv, w, keep, 0.2, g);
      for (int i = 0; i < 3; i++) {
        ck_assert_msg(same_bits(g[i], g1[i]), "%d threads: d%c differs", th, "qkv"[i]);
      }
    }
    ctx_free(&c);
    kiln_scope_end();
  }
  kiln_set_num_threads(before);
}
END_TEST

static Suite *attention_suite(void) {
  Suite *s = suite_create("codegen_attention");
  TCase *tc = tcase_create("attention");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_fused_three_ways);
  tcase_add_test(tc, test_read_elsewhere);
  tcase_add_test(tc, test_training_fuses);
  tcase_add_test(tc, test_fused_op_three_ways_bitwise);
  tcase_add_test(tc, test_gpt_training_fuses);
  tcase_add_test(tc, test_check_mode);
  tcase_add_test(tc, test_symbolic_sizes);
  tcase_add_test(tc, test_gpt_forward_fuses);
  tcase_add_test(tc, test_decode_fuses);
  tcase_add_test(tc, test_grad_vs_unfused);
  tcase_add_test(tc, test_grad_finite_differences);
  tcase_add_test(tc, test_grad_threads);
  tcase_add_test(tc, test_grad_errors);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(attention_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
