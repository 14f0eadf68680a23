/* Codegen against eager: fusion asserted on the plan (GELU is one kernel,
 * softmax one row kernel, matmul+bias+relu a GEMM and one epilogue), the
 * three ways (eager, interpreter, LLVM) on every op, and a seeded random
 * program generator: 2-D and 3-D inputs with lower-rank operands, pointwise
 * chains, compare/where/cast, reductions over one, several or all axes (keepdim
 * or not, broadcast back), views and reshapes sized from kiln_size, matmuls
 * (GEMM, batched, a few constant rows), softmax, layer_norm, cross_entropy,
 * in-place ops on tensors made in the body, several outputs (views, inputs
 * as they are) and sometimes the gradients w.r.t. the inputs; f32 or f64;
 * compiled and compared with eager at several sizes (1, and sizes equal to C
 * and to each other) and thread counts. KILN_FUZZ_PROGRAMS=N runs N programs
 * (default 100), from seed KILN_FUZZ_FIRST (default 1000); a failure prints
 * its seed, sizes, output, error and the program's IR. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codegen/codegen.h"
#include "kiln.h"

static double maxdiff_rel(kiln_tensor *a, kiln_tensor *b, int64_t *bad) {
  kiln_scope_begin();
  int64_t n = kiln_numel(a);
  double *x = malloc(sizeof(double) * (size_t)(n + 1)), *y = malloc(sizeof(double) * (size_t)(n + 1)), m = 0;
  kiln_read(kiln_cast(a, KILN_F64), x, sizeof(double) * (size_t)n);
  kiln_read(kiln_cast(b, KILN_F64), y, sizeof(double) * (size_t)n);
  *bad = -1;
  for (int64_t i = 0; i < n; i++) {
    if (isnan(x[i]) && isnan(y[i])) continue;
    if (x[i] == y[i]) continue;
    double e = fabs(x[i] - y[i]) / (1 + fabs(y[i]));
    if (!(e <= m)) {
      m = isnan(e) ? INFINITY : e;
      *bad = i;
    }
  }
  free(x), free(y);
  kiln_scope_end();
  return m;
}

static bool same_shape(kiln_tensor *a, kiln_tensor *b) {
  if (kiln_ndim(a) != kiln_ndim(b)) return false;
  for (int d = 0; d < kiln_ndim(a); d++)
    if (kiln_size(a, d) != kiln_size(b, d)) return false;
  return true;
}

/* ---- the plan ---- */

/* The kernels of fn's newest variant after fusion. */
static cg_program *plan_of(kiln_fn *fn) {
  char *text = kiln_fn_graph(fn, 0);
  ck_assert_ptr_nonnull(text);
  char err[256];
  ir_graph *g = ir_parse(text, err, sizeof err);
  free(text);
  ck_assert_msg(g != NULL, "%s", err);
  cg_program *p = fuse_graph(g, err, sizeof err);
  ck_assert_msg(p != NULL, "%s", err);
  /* the program points at g: keep g alive as long as p; freed by the caller through free_plan */
  return p;
}

static void free_plan(cg_program *p) {
  ir_graph *g = (ir_graph *)p->g;
  cg_program_free(p);
  ir_free(g);
}

static int count_kind(const cg_program *p, cg_kernel_kind k) {
  int n = 0;
  for (int i = 0; i < p->n_k; i++) n += p->k[i].kind == k;
  return n;
}

static int gelu_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0];
  kiln_tensor *in3 = kiln_add(x, kiln_mul(kiln_scalar(KILN_F32, 0.044715), kiln_pow(x, kiln_scalar(KILN_F32, 3))));
  kiln_tensor *t = kiln_tanh(kiln_mul(kiln_scalar(KILN_F32, 0.7978845608), in3));
  out[0] = kiln_mul(kiln_mul(kiln_scalar(KILN_F32, 0.5), x), kiln_add(kiln_scalar(KILN_F32, 1), t));
  return 0;
}

static int softmax_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *e = kiln_exp(kiln_sub(in[0], kiln_max(in[0], -1, true)));
  out[0] = kiln_div(e, kiln_sum(e, -1, true));
  return 0;
}

static int layernorm_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_layer_norm(in[0], in[1], in[2], 1e-5);
  return 0;
}

static int linear_relu_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_relu(kiln_add(kiln_matmul(in[0], in[1]), in[2]));
  return 0;
}

/* two layers: the relu between them can run in place over the first GEMM's buffer */
static int two_layer_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *h = kiln_relu(kiln_add(kiln_matmul(in[0], in[1]), in[2]));
  out[0] = kiln_matmul(h, kiln_transpose(in[1], 0, 1));
  return 0;
}

typedef int (*body_fn)(void *, kiln_tensor *const *, kiln_tensor **);

static kiln_fn *compile_once(body_fn body, int n_in, kiln_tensor *const *in) {
  kiln_options o = {.name = "plan", .n_in = n_in, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(body, NULL, &o);
  kiln_tensor *y = NULL, *ref = NULL;
  ck_assert_int_eq(0, kiln_call(fn, in, &y));
  ck_assert_int_eq(0, kiln_call(fn, in, &y)); /* compiled */
  ck_assert_int_eq(0, body(NULL, in, &ref));
  int64_t bad;
  ck_assert(same_shape(y, ref));
  double d = maxdiff_rel(y, ref, &bad);
  ck_assert_msg(d <= 1e-5, "max rel diff %g at %lld", d, (long long)bad);
  /* compile time splits into its phases */
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_double_gt(st.llvm_opt_ms, 0);
  ck_assert_double_gt(st.llvm_codegen_ms, 0);
  ck_assert_double_le(st.passes_ms + st.fuse_ms + st.llvm_opt_ms + st.llvm_codegen_ms, st.compile_ms + 1e-6);
  return fn;
}

START_TEST(test_fusion_plans) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){33, 70}), 1);
  kiln_tensor *w = kiln_randn(KILN_F32, 1, ((int64_t[]){70}), 2), *b = kiln_randn(KILN_F32, 1, ((int64_t[]){70}), 3);
  kiln_tensor *m = kiln_randn(KILN_F32, 2, ((int64_t[]){70, 20}), 4), *c = kiln_randn(KILN_F32, 1, ((int64_t[]){20}), 5);

  kiln_fn *fn = compile_once(gelu_body, 1, &x);
  cg_program *p = plan_of(fn);
  ck_assert_int_eq(1, p->n_k); /* GELU: one loop */
  ck_assert_int_eq(CG_K_LOOP, p->k[0].kind);
  ck_assert_int_eq(p->k[0].ndim, p->k[0].n_outer); /* pointwise: no inner loop */
  free_plan(p);
  kiln_fn_free(fn);

  fn = compile_once(softmax_body, 1, &x);
  p = plan_of(fn);
  ck_assert_int_eq(1, p->n_k); /* softmax: one row kernel */
  int reduces = 0;
  for (int s = 0; s < p->k[0].n_stage; s++) reduces += p->k[0].stage[s].kind == CG_REDUCE;
  ck_assert_int_eq(2, reduces);
  free_plan(p);
  kiln_fn_free(fn);

  kiln_tensor *ln[3] = {x, w, b};
  fn = compile_once(layernorm_body, 3, ln);
  p = plan_of(fn);
  ck_assert_int_eq(1, p->n_k); /* layer norm: one row kernel */
  free_plan(p);
  kiln_fn_free(fn);

  kiln_tensor *lr[3] = {x, m, c};
  fn = compile_once(linear_relu_body, 3, lr);
  p = plan_of(fn);
  ck_assert_int_eq(2, p->n_k); /* a GEMM and one epilogue */
  ck_assert_int_eq(1, count_kind(p, CG_K_MATMUL));
  ck_assert_int_eq(CG_K_MATMUL, p->k[0].kind);
  ck_assert_int_eq(CG_K_LOOP, p->k[1].kind);
  free_plan(p);
  kiln_fn_free(fn);

  kiln_tensor *tl[3] = {x, kiln_randn(KILN_F32, 2, ((int64_t[]){70, 70}), 8), kiln_randn(KILN_F32, 1, ((int64_t[]){70}), 9)};
  fn = compile_once(two_layer_body, 3, tl);
  p = plan_of(fn);
  ck_assert_int_eq(3, p->n_k); /* GEMM, epilogue, GEMM */
  ck_assert_int_eq(CG_K_LOOP, p->k[1].kind);
  ck_assert_int_eq(p->k[0].out_buf, p->k[1].out_buf); /* the epilogue stores in place */
  free_plan(p);
  kiln_fn_free(fn);

  /* batch 1 (and up to 8 constant rows): the matmul is our own dot-product loop */
  kiln_tensor *row = kiln_randn(KILN_F32, 2, ((int64_t[]){1, 70}), 6);
  kiln_tensor *lr1[3] = {row, kiln_transpose(kiln_randn(KILN_F32, 2, ((int64_t[]){20, 70}), 7), 0, 1), c};
  fn = compile_once(linear_relu_body, 3, lr1);
  p = plan_of(fn);
  ck_assert_int_eq(0, count_kind(p, CG_K_MATMUL));
  ck_assert_int_eq(2, p->n_k); /* the dot products, then the epilogue */
  ck_assert(strstr(p->k[0].name, "matvec") != NULL);
  free_plan(p);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* ---- random programs ---- */

typedef struct rng {
  uint64_t s;
} rng;
static uint64_t next(rng *r) {
  r->s ^= r->s << 13;
  r->s ^= r->s >> 7;
  r->s ^= r->s << 17;
  return r->s;
}
static int pick(rng *r, int n) { return (int)(next(r) % (uint64_t)n); }
static bool chance(rng *r, int one_in) { return pick(r, one_in) == 0; }

/* The generator decides everything from the seed and the symbolic shapes it
 * tracks, never from a concrete size, so one program is valid (and the same)
 * at every size it runs. A dim is a constant (>= 1, C among them), B, T, B*T,
 * or an opaque size (a strided slice of B, a flattening) that only matches
 * itself. */
enum { D_B = -1, D_T = -2, D_BT = -3, D_OPAQUE = -10 };
enum { N_IN = 5, POOL = 64 };

typedef struct prog {
  uint64_t seed;
  int C;         /* the constant last dim of x */
  int nd_x;      /* x is (B,C) or (B,T,C) */
  bool f64;      /* every float is f64 */
  bool grad;     /* inputs require grad; the gradients w.r.t. them are outputs too */
  int n_val;     /* value outputs; n_out = n_val (+ N_IN gradients) */
  int n_out;
  int rot;       /* where in the sizes list the calls start */
} prog;

static void prog_init(prog *p, uint64_t seed) {
  rng r = {seed * 0x9E3779B97F4A7C15ull + 0x1234567};
  for (int i = 0; i < 4; i++) next(&r);
  static const int cs[] = {3, 4, 6, 8, 12};
  p->seed = seed;
  p->C = cs[pick(&r, 5)];
  p->nd_x = 2 + pick(&r, 2);
  p->f64 = chance(&r, 6);
  p->grad = chance(&r, 4);
  p->n_val = 1 + pick(&r, 3);
  p->n_out = p->n_val + (p->grad ? N_IN : 0);
  p->rot = pick(&r, 5);
}

typedef struct val {
  kiln_tensor *t;
  int nd;
  int d[KILN_MAX_DIMS];
  int stor;      /* storage id: views share their base's */
  bool writable; /* made in the body (kiln_zeros ...) or a plain view of such: an in-place target */
} val;

typedef struct gen {
  rng r;
  const prog *p;
  kiln_dtype ft;
  kiln_tensor *const *in;
  val v[POOL];
  int n, opaque, stor;
  char err[200];
} gen;

static kiln_tensor *S(gen *g, double c) { return kiln_scalar(g->ft, c); }

/* The concrete size a symbolic dim must have now. */
static int64_t dim_now(gen *g, int d) {
  int64_t b = kiln_size(g->in[0], 0), t = g->p->nd_x == 3 ? kiln_size(g->in[0], 1) : 1;
  return d == D_B ? b : d == D_T ? t : d == D_BT ? b * t : d;
}

/* Adds t with shape dims to the pool; checks the tracked shape against the
 * tensor (a generator bug otherwise). -1 when t is NULL (an op failed). */
static int push(gen *g, kiln_tensor *t, int nd, const int *d, int stor, bool writable) {
  if (!t) {
    if (!g->err[0]) snprintf(g->err, sizeof g->err, "op failed: %s", kiln_last_error());
    return -1;
  }
  if (kiln_ndim(t) != nd) {
    snprintf(g->err, sizeof g->err, "generator: tracked rank %d, tensor rank %d", nd, kiln_ndim(t));
    return -1;
  }
  for (int i = 0; i < nd; i++)
    if (d[i] > D_OPAQUE && kiln_size(t, i) != dim_now(g, d[i])) {
      snprintf(g->err, sizeof g->err, "generator: dim %d tracked %d (= %lld), tensor %lld", i, d[i], (long long)dim_now(g, d[i]),
               (long long)kiln_size(t, i));
      return -1;
    }
  if (g->n == POOL) return 0;
  val *v = &g->v[g->n++];
  v->t = t, v->nd = nd, v->stor = stor < 0 ? ++g->stor : stor, v->writable = writable;
  memcpy(v->d, d, sizeof(int) * (size_t)nd);
  return 0;
}

static int push_like(gen *g, kiln_tensor *t, const val *a) { return push(g, t, a->nd, a->d, -1, false); }

/* A random float value of the pool (there always is one: the inputs). */
static int pick_float(gen *g) {
  for (int tries = 0; tries < 16; tries++) {
    int i = pick(&g->r, g->n);
    if (kiln_type(g->v[i].t) == g->ft) return i;
  }
  return 0;
}

/* The broadcast of two tracked shapes, or false. */
static bool bcast(const val *a, const val *b, int *nd, int *d) {
  int n = a->nd > b->nd ? a->nd : b->nd;
  for (int i = 0; i < n; i++) {
    int ia = a->nd - n + i, ib = b->nd - n + i;
    int x = ia >= 0 ? a->d[ia] : 1, y = ib >= 0 ? b->d[ib] : 1;
    if (x == y) d[i] = x;
    else if (x == 1) d[i] = y;
    else if (y == 1) d[i] = x;
    else return false;
  }
  *nd = n;
  return true;
}

static bool same_dims(const val *a, const val *b) {
  if (a->nd != b->nd) return false;
  for (int i = 0; i < a->nd; i++)
    if (a->d[i] != b->d[i]) return false;
  return true;
}

/* A float partner of a that broadcasts with it (want_same: of a's very shape), or -1. */
static int partner(gen *g, const val *a, bool want_same) {
  for (int tries = 0; tries < 12; tries++) {
    int i = pick(&g->r, g->n), nd, d[KILN_MAX_DIMS];
    if (kiln_type(g->v[i].t) != g->ft) continue;
    if (want_same ? same_dims(a, &g->v[i]) : bcast(a, &g->v[i], &nd, d)) return i;
  }
  return -1;
}

/* The sizes of a as an array, from kiln_size (symbolic in the trace). */
static void sizes_of(const val *a, int64_t *s) {
  for (int i = 0; i < a->nd; i++) s[i] = kiln_size(a->t, i);
}

static int bin(gen *g, int op, kiln_tensor *a, kiln_tensor *b, kiln_tensor **out) {
  switch (op) {
  case 0: *out = kiln_add(a, b); break;
  case 1: *out = kiln_sub(a, b); break;
  case 2: *out = kiln_mul(a, b); break;
  case 3: *out = kiln_div(a, kiln_add(kiln_abs(b), S(g, 0.5))); break;
  case 4: *out = kiln_maximum(a, b); break;
  default: *out = kiln_minimum(a, b); break;
  }
  return 0;
}

static kiln_tensor *unary(gen *g, int op, kiln_tensor *a) {
  switch (op) {
  case 0: return kiln_tanh(a);
  case 1: return kiln_exp(kiln_tanh(a));
  case 2: return kiln_exp(kiln_mul(a, S(g, -0.25)));
  case 3: return kiln_log(kiln_add(kiln_abs(a), S(g, 1)));
  case 4: return kiln_sqrt(kiln_add(kiln_abs(a), S(g, 0.1)));
  case 5: return kiln_rsqrt(kiln_add(kiln_abs(a), S(g, 1)));
  case 6: return kiln_sigmoid(a);
  case 7: return kiln_relu(a);
  case 8: return kiln_gelu(a);
  case 9: return kiln_gelu_erf(a);
  case 10: return kiln_erf(a);
  case 11: return kiln_sin(a);
  case 12: return kiln_cos(a);
  case 13: return kiln_neg(a);
  case 14: return kiln_abs(a);
  case 15: return kiln_pow(kiln_add(kiln_abs(a), S(g, 0.5)), S(g, 1.5));
  default: return kiln_pow(a, S(g, 2));
  }
}

static kiln_tensor *compare(int op, kiln_tensor *a, kiln_tensor *b) {
  switch (op) {
  case 0: return kiln_gt(a, b);
  case 1: return kiln_lt(a, b);
  case 2: return kiln_ge(a, b);
  case 3: return kiln_le(a, b);
  case 4: return kiln_eq(a, b);
  default: return kiln_ne(a, b);
  }
}

/* The dims of a reduced over the axes in mask. */
static int reduced(const val *a, unsigned mask, bool keepdim, int *d) {
  int nd = 0;
  for (int i = 0; i < a->nd; i++) {
    if (!(mask >> i & 1)) d[nd++] = a->d[i];
    else if (keepdim) d[nd++] = 1;
  }
  return nd;
}

/* The merge of two adjacent dims. */
static int merged(gen *g, int x, int y) {
  if (x == 1) return y;
  if (y == 1) return x;
  if (x > 0 && y > 0) return x * y;
  if (x == D_B && y == D_T) return D_BT;
  return D_OPAQUE - ++g->opaque;
}

/* In-place ops write to body-made tensors; outside a no-grad scope they are
 * refused when src requires grad, so grad programs run them in one. */
static void ng_begin(gen *g) {
  if (g->p->grad) kiln_no_grad_begin();
}
static void ng_end(gen *g) {
  if (g->p->grad) kiln_no_grad_end();
}

/* One random step: adds one value (or a few) to the pool. 0, or -1 when an op failed. */
static int step(gen *g) {
  rng *r = &g->r;
  int ia = pick_float(g);
  val a = g->v[ia]; /* a copy: pushes may not move it, but keep it simple */
  int d[KILN_MAX_DIMS], nd;
  int64_t s[KILN_MAX_DIMS];
  int C = g->p->C;
  switch (pick(r, 24)) {
  case 0:
  case 1: { /* binary pointwise with a broadcasting partner (lower rank, size-1 dims) */
    int ib = partner(g, &a, false);
    kiln_tensor *o;
    if (ib < 0 || !bcast(&a, &g->v[ib], &nd, d)) {
      bin(g, pick(r, 6), a.t, S(g, 0.5 + pick(r, 3)), &o);
      return push_like(g, o, &a);
    }
    if (chance(r, 2)) bin(g, pick(r, 6), a.t, g->v[ib].t, &o);
    else bin(g, pick(r, 6), g->v[ib].t, a.t, &o);
    return push(g, o, nd, d, -1, false);
  }
  case 2:
  case 3: return push_like(g, unary(g, pick(r, 17), a.t), &a);
  case 4: { /* compare, where, cast with bool */
    int ib = partner(g, &a, false);
    if (ib < 0) ib = ia;
    if (!bcast(&a, &g->v[ib], &nd, d)) return 0;
    kiln_tensor *c = compare(pick(r, 6), a.t, g->v[ib].t);
    if (push(g, c, nd, d, -1, false)) return -1;
    switch (pick(r, 3)) {
    case 0: return push(g, kiln_where(c, a.t, kiln_neg(g->v[ib].t)), nd, d, -1, false);
    case 1: return push(g, kiln_where(c, S(g, 0.25), g->v[ib].t), nd, d, -1, false);
    default: return push(g, kiln_mul(kiln_cast(c, g->ft), a.t), nd, d, -1, false);
    }
  }
  case 5: { /* where with a bool from the pool; casts between dtypes */
    for (int tries = 0; tries < 8; tries++) {
      int ic = pick(r, g->n);
      if (kiln_type(g->v[ic].t) == KILN_BOOL && bcast(&a, &g->v[ic], &nd, d)) {
        if (chance(r, 2)) return push(g, kiln_where(g->v[ic].t, a.t, kiln_sin(a.t)), nd, d, -1, false);
        return push(g, kiln_add(kiln_cast(g->v[ic].t, g->ft), a.t), nd, d, -1, false);
      }
      if (kiln_type(g->v[ic].t) == KILN_I64 && bcast(&a, &g->v[ic], &nd, d))
        return push(g, kiln_mul(a.t, kiln_cast(g->v[ic].t, g->ft)), nd, d, -1, false);
    }
    kiln_dtype other = g->ft == KILN_F32 ? KILN_F64 : KILN_F32;
    return push_like(g, kiln_cast(kiln_exp(kiln_cast(kiln_tanh(a.t), other)), g->ft), &a);
  }
  case 6:
  case 7: { /* a reduction over one axis, keepdim or not, sometimes broadcast back */
    if (a.nd == 0) return 0;
    int ax = pick(r, a.nd), op = pick(r, 5);
    bool keep = chance(r, 2);
    int axarg = chance(r, 2) ? ax : ax - a.nd;
    kiln_tensor *o;
    switch (op) {
    case 0: o = kiln_sum(a.t, axarg, keep); break;
    case 1: o = kiln_mean(a.t, axarg, keep); break;
    case 2: o = kiln_max(a.t, axarg, keep); break;
    case 3: o = kiln_min(a.t, axarg, keep); break;
    default: o = kiln_var(a.t, axarg, a.d[ax] > 1 ? pick(r, 2) : 0, keep); break;
    }
    nd = reduced(&a, 1u << ax, keep, d);
    if (push(g, o, nd, d, -1, false)) return -1;
    if (chance(r, 2)) {
      val *rv = &g->v[g->n - 1];
      int nd2, d2[KILN_MAX_DIMS];
      if (!bcast(&a, rv, &nd2, d2)) {
        /* put the axis back */
        o = kiln_unsqueeze(rv->t, ax);
        nd = reduced(&a, 1u << ax, true, d);
        if (push(g, o, nd, d, rv->stor, false)) return -1;
        rv = &g->v[g->n - 1];
        if (!bcast(&a, rv, &nd2, d2)) return 0;
      }
      kiln_tensor *b = rv->t;
      o = chance(r, 2) ? kiln_sub(a.t, b) : kiln_mul(a.t, kiln_exp(kiln_neg(kiln_abs(b))));
      return push(g, o, nd2, d2, -1, false);
    }
    return 0;
  }
  case 8: { /* several axes (or all) */
    if (a.nd < 2) return 0;
    unsigned mask = 0;
    int axes[2], n = 0;
    if (!chance(r, 4)) {
      int x = pick(r, a.nd), y = (x + 1 + pick(r, a.nd - 1)) % a.nd;
      axes[n++] = x, axes[n++] = y, mask = 1u << x | 1u << y;
    } else {
      mask = (1u << a.nd) - 1;
    }
    bool keep = chance(r, 2);
    kiln_tensor *o;
    switch (pick(r, 5)) {
    case 0: o = kiln_sum_axes(a.t, axes, n, keep); break;
    case 1: o = kiln_mean_axes(a.t, axes, n, keep); break;
    case 2: o = kiln_max_axes(a.t, axes, n, keep); break;
    case 3: o = kiln_min_axes(a.t, axes, n, keep); break;
    default: o = kiln_var_axes(a.t, axes, n, 0, keep); break;
    }
    nd = reduced(&a, mask, keep, d);
    if (push(g, o, nd, d, -1, false)) return -1;
    val *rv = &g->v[g->n - 1];
    int nd2, d2[KILN_MAX_DIMS];
    if (chance(r, 2) && bcast(&a, rv, &nd2, d2)) return push(g, kiln_sub(a.t, rv->t), nd2, d2, -1, false);
    return 0;
  }
  case 9: { /* argmax: i64, used as a float or kept */
    if (a.nd == 0) return 0;
    int ax = pick(r, a.nd);
    bool keep = chance(r, 2);
    nd = reduced(&a, 1u << ax, keep, d);
    kiln_tensor *o = kiln_argmax(a.t, ax, keep);
    if (push(g, o, nd, d, -1, false)) return -1;
    return push(g, kiln_cast(o, g->ft), nd, d, -1, false);
  }
  case 10: { /* softmax, log_softmax, layer_norm over the last dim */
    if (a.nd == 0) return 0;
    int k = pick(r, 4);
    if (k == 0) return push_like(g, kiln_softmax(a.t, chance(r, 4) ? 0 : -1), &a);
    if (k == 1) return push_like(g, kiln_log_softmax(a.t, a.nd - 1), &a);
    kiln_tensor *w = NULL, *b = NULL;
    if (a.d[a.nd - 1] == C) {
      if (chance(r, 2)) w = g->in[1];
      if (chance(r, 2)) b = kiln_squeeze(kiln_slice(g->in[2], 0, 0, 1, 1), 0);
    }
    return push_like(g, kiln_layer_norm(a.t, w, b, 1e-5), &a);
  }
  case 11:
  case 12: { /* matmuls */
    kiln_tensor *P = g->in[4]; /* (8, C) */
    int k = 1 + pick(r, 8);
    /* (k, C): a few constant rows. The bound counts from P's end: a literal
     * that equals a size the body read would be taken for that size (C has
     * no symbolic ints; docs/guide.md says so) */
    kiln_tensor *rows = kiln_slice(P, 0, 0, k == 8 ? INT64_MAX : k - 8, 1);
    int last = a.nd ? a.d[a.nd - 1] : 0;
    switch (pick(r, 7)) {
    case 0: /* (..., C) @ (C, k) */
      if (last != C) return 0;
      memcpy(d, a.d, sizeof(int) * (size_t)a.nd), d[a.nd - 1] = k;
      return push(g, kiln_matmul(a.t, kiln_transpose(rows, 0, 1)), a.nd, d, -1, false);
    case 1: /* (..., C) @ (C,) */
      if (last != C) return 0;
      return push(g, kiln_matmul(a.t, g->in[1]), a.nd - 1, a.d, -1, false);
    case 2: { /* (k, C) @ (..., C, R): constant rows, batch dims broadcast */
      if (last != C || a.nd < 2) return 0;
      memcpy(d, a.d, sizeof(int) * (size_t)a.nd);
      d[a.nd - 2] = k, d[a.nd - 1] = a.d[a.nd - 2];
      kiln_tensor *o = kiln_matmul(rows, kiln_transpose(a.t, -1, -2));
      if (push(g, o, a.nd, d, -1, false)) return -1;
      int t = d[a.nd - 2];
      d[a.nd - 2] = d[a.nd - 1], d[a.nd - 1] = t;
      return push(g, kiln_transpose(o, -1, -2), a.nd, d, g->v[g->n - 1].stor, false);
    }
    case 3: { /* a Gram matrix over the last dim: (..., R, K) @ (..., K, R) */
      if (a.nd < 2) return 0;
      int ib = partner(g, &a, true);
      if (ib < 0) ib = ia;
      memcpy(d, a.d, sizeof(int) * (size_t)a.nd), d[a.nd - 1] = a.d[a.nd - 2];
      return push(g, kiln_matmul(a.t, kiln_transpose(g->v[ib].t, -1, -2)), a.nd, d, -1, false);
    }
    case 4: { /* a contraction over the first dim of 2-D values: (K, R)ᵀ @ (R, K') */
      if (a.nd != 2) return 0;
      for (int tries = 0; tries < 8; tries++) {
        int ib = pick(r, g->n);
        val *b = &g->v[ib];
        if (kiln_type(b->t) == g->ft && b->nd == 2 && b->d[0] == a.d[0]) {
          d[0] = a.d[1], d[1] = b->d[1];
          return push(g, kiln_matmul(kiln_transpose(a.t, 0, 1), b->t), 2, d, -1, false);
        }
      }
      return 0;
    }
    case 5: { /* batched with an expanded batch dim: (X, Y, C) @ (X, C, k) */
      if (a.nd != 3 || last != C) return 0;
      kiln_tensor *m = kiln_expand(kiln_unsqueeze(kiln_transpose(rows, 0, 1), 0), 3, ((int64_t[]){kiln_size(a.t, 0), C, k}));
      d[0] = a.d[0], d[1] = a.d[1], d[2] = k;
      return push(g, kiln_matmul(a.t, m), 3, d, -1, false);
    }
    default: { /* a 1-D vector times a matrix: (C,) @ (..., C, R) */
      if (a.nd < 2 || a.d[a.nd - 2] != C) return 0;
      memcpy(d, a.d, sizeof(int) * (size_t)a.nd);
      for (int i = a.nd - 2; i + 1 < a.nd; i++) d[i] = d[i + 1];
      return push(g, kiln_matmul(g->in[1], a.t), a.nd - 1, d, -1, false);
    }
    }
  }
  case 13:
  case 14: { /* views */
    memcpy(d, a.d, sizeof(int) * (size_t)a.nd);
    nd = a.nd;
    kiln_tensor *o = NULL;
    bool plain = true; /* a view an in-place op may write through */
    switch (pick(r, 8)) {
    case 0: { /* transpose / permute */
      if (a.nd < 2) return 0;
      if (a.nd == 3 && chance(r, 2)) {
        int perms[6][3] = {{0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}, {0, 1, 2}};
        int *pm = perms[pick(r, 6)];
        for (int i = 0; i < 3; i++) d[i] = a.d[pm[i]];
        o = kiln_permute(a.t, pm);
      } else {
        int x = pick(r, a.nd), y = (x + 1 + pick(r, a.nd - 1)) % a.nd;
        d[x] = a.d[y], d[y] = a.d[x];
        o = kiln_transpose(a.t, x, y);
      }
      break;
    }
    case 1: { /* slice with a step */
      if (a.nd == 0) return 0;
      int ax = pick(r, a.nd);
      int64_t st = 1 + pick(r, 3);
      if (a.d[ax] > 0) {
        int64_t n = a.d[ax], start = pick(r, (int)n), end = start + 1 + pick(r, (int)(n - start));
        if (chance(r, 3)) end = INT64_MAX / 2; /* past the end */
        int64_t e = end > n ? n : end;
        d[ax] = (int)((e - start + st - 1) / st);
        o = kiln_slice(a.t, ax, chance(r, 4) ? start - n : start, chance(r, 4) && end < n ? end - n : end, st);
      } else if (chance(r, 2)) {
        d[ax] = 1; /* the first one */
        o = kiln_slice(a.t, ax, 0, 1, 1);
      } else {
        d[ax] = st == 1 ? a.d[ax] : D_OPAQUE - ++g->opaque;
        o = kiln_slice(a.t, ax, 0, INT64_MAX / 2, st);
      }
      break;
    }
    case 2: { /* unsqueeze, then maybe expand the new dim */
      if (a.nd >= 5) return 0;
      int ax = pick(r, a.nd + 1);
      for (int i = a.nd; i > ax; i--) d[i] = d[i - 1];
      d[ax] = 1, nd = a.nd + 1;
      o = kiln_unsqueeze(a.t, ax);
      if (chance(r, 2)) {
        val u = {.t = o, .nd = nd};
        memcpy(u.d, d, sizeof d);
        sizes_of(&u, s);
        int w = pick(r, 3);
        d[ax] = w == 0 ? C : w == 1 ? 2 : D_B;
        s[ax] = w == 2 ? kiln_size(g->in[0], 0) : d[ax];
        o = kiln_expand(o, nd, s);
        plain = false;
      }
      break;
    }
    case 3: { /* squeeze a size-1 dim, or expand one */
      int ax = -1;
      for (int i = 0; i < a.nd; i++)
        if (a.d[i] == 1) ax = i;
      if (ax < 0) return 0;
      if (chance(r, 2)) {
        for (int i = ax; i + 1 < a.nd; i++) d[i] = d[i + 1];
        nd = a.nd - 1;
        o = kiln_squeeze(a.t, ax);
      } else {
        sizes_of(&a, s);
        d[ax] = chance(r, 2) ? C : D_B;
        s[ax] = d[ax] == C ? C : kiln_size(g->in[0], 0);
        o = kiln_expand(a.t, a.nd, s);
        plain = false;
      }
      break;
    }
    case 4: /* contiguous: a copy */
      o = kiln_contiguous(a.t);
      return push(g, o, nd, d, -1, false);
    case 5: { /* merge two adjacent dims: sizes from kiln_size, or -1 */
      if (a.nd < 2) return 0;
      int ax = pick(r, a.nd - 1);
      sizes_of(&a, s);
      int m = merged(g, a.d[ax], a.d[ax + 1]);
      s[ax] *= s[ax + 1];
      d[ax] = m;
      for (int i = ax + 1; i + 1 < a.nd; i++) d[i] = d[i + 1], s[i] = s[i + 1];
      nd = a.nd - 1;
      if (chance(r, 2)) s[ax] = -1;
      o = kiln_reshape(a.t, nd, s);
      plain = false;
      break;
    }
    case 6: { /* split: B*T back into (B, T), or a constant dim in two */
      if (a.nd == 0 || a.nd >= 5) return 0;
      int ax = -1;
      for (int i = 0; i < a.nd; i++)
        if (a.d[i] == D_BT || (a.d[i] > 0 && a.d[i] % 2 == 0)) ax = i;
      if (ax < 0) return 0;
      sizes_of(&a, s);
      for (int i = a.nd; i > ax + 1; i--) d[i] = d[i - 1], s[i] = s[i - 1];
      if (a.d[ax] == D_BT) {
        d[ax] = D_B, d[ax + 1] = D_T;
        s[ax] = kiln_size(g->in[0], 0), s[ax + 1] = chance(r, 2) ? -1 : kiln_size(g->in[0], 1);
      } else {
        d[ax] = a.d[ax] / 2, d[ax + 1] = 2;
        s[ax] = d[ax], s[ax + 1] = 2;
      }
      nd = a.nd + 1;
      o = kiln_reshape(a.t, nd, s);
      plain = false;
      break;
    }
    default: { /* flatten */
      int m = 1;
      for (int i = 0; i < a.nd; i++) m = merged(g, m, a.d[i]);
      d[0] = m, nd = 1;
      o = kiln_reshape(a.t, 1, ((int64_t[]){-1}));
      plain = false;
      break;
    }
    }
    return push(g, o, nd, d, a.stor, a.writable && plain);
  }
  case 15: { /* factories sized from kiln_size inside the body */
    sizes_of(&a, s);
    kiln_tensor *f;
    switch (pick(r, 3)) {
    case 0: f = kiln_ones(g->ft, a.nd, s); break;
    case 1: f = kiln_full(g->ft, a.nd, s, 0.5 + pick(r, 4)); break;
    default: /* (B*T, C) made before any node has that shape */
      if (g->p->nd_x != 3) return 0;
      f = kiln_full(g->ft, 2, ((int64_t[]){kiln_size(g->in[0], 0) * kiln_size(g->in[0], 1), C}), 1.5);
      if (push(g, f, 2, ((int[]){D_BT, C}), -1, true)) return -1;
      return push(g, kiln_mul(f, kiln_reshape(g->in[0], 2, ((int64_t[]){-1, C}))), 2, ((int[]){D_BT, C}), -1, false);
    }
    if (push(g, f, a.nd, a.d, -1, true)) return -1;
    return push_like(g, kiln_mul(f, a.t), &a);
  }
  case 16:
  case 17: { /* in place: on a fresh kiln_zeros, or on a body-made value (or a view of one) */
    int idst = -1;
    for (int tries = 0; tries < 6 && idst < 0; tries++) {
      int i = pick(r, g->n);
      if (g->v[i].writable && kiln_type(g->v[i].t) == g->ft) idst = i;
    }
    /* with grads, a tensor an earlier op saved for backward must not change: a fresh one only */
    if (idst < 0 || chance(r, 3) || g->p->grad) {
      sizes_of(&a, s);
      kiln_tensor *z = kiln_zeros(g->ft, a.nd, s);
      if (push(g, z, a.nd, a.d, -1, true)) return -1;
      idst = g->n - 1;
    }
    val dst = g->v[idst];
    int isrc = -1;
    for (int tries = 0; tries < 8 && isrc < 0; tries++) {
      int i = pick(r, g->n);
      if (kiln_type(g->v[i].t) != g->ft || g->v[i].stor == dst.stor) continue;
      if (bcast(&dst, &g->v[i], &nd, d) && nd == dst.nd && !memcmp(d, dst.d, sizeof(int) * (size_t)nd)) isrc = i;
    }
    kiln_tensor *src = isrc >= 0 ? g->v[isrc].t : S(g, 0.75);
    kiln_tensor *o;
    ng_begin(g);
    switch (pick(r, 5)) {
    case 0: o = kiln_add_(dst.t, src); break;
    case 1: o = kiln_sub_(dst.t, src); break;
    case 2: o = kiln_mul_(kiln_add_(dst.t, S(g, 1)), src); break;
    case 3: o = kiln_copy_(dst.t, src); break;
    default: o = kiln_add_(kiln_fill_(dst.t, 0.25), src); break;
    }
    ng_end(g);
    if (!o) return push(g, NULL, 0, d, -1, false);
    /* a value computed from dst after the write */
    return push(g, kiln_add(dst.t, S(g, 0.125)), dst.nd, dst.d, -1, false);
  }
  case 18: { /* cross_entropy on (N, K) logits, labels from an argmax or a comparison */
    for (int tries = 0; tries < 8; tries++) {
      int i = pick(r, g->n);
      val *l = &g->v[i];
      if (kiln_type(l->t) != g->ft || l->nd != 2 || l->d[1] < 2) continue;
      kiln_tensor *lab = NULL;
      for (int t2 = 0; t2 < 6 && !lab; t2++) {
        val *b = &g->v[pick(r, g->n)];
        if (kiln_type(b->t) == g->ft && b->nd == 2 && b->d[0] == l->d[0] && b->d[1] > 0 && b->d[1] <= l->d[1])
          lab = kiln_argmax(b->t, 1, false);
      }
      if (!lab) lab = kiln_cast(kiln_gt(kiln_sum(l->t, 1, false), kiln_mean(l->t, 1, false)), KILN_I64);
      return push(g, kiln_cross_entropy(l->t, lab), 0, d, -1, false);
    }
    return 0;
  }
  case 19: { /* mse_loss, a scalar broadcast into a value */
    int ib = partner(g, &a, true);
    kiln_tensor *o = ib >= 0 ? kiln_mse_loss(a.t, g->v[ib].t) : kiln_mean_all(a.t);
    if (push(g, o, 0, d, -1, false)) return -1;
    return push_like(g, kiln_sub(a.t, g->v[g->n - 1].t), &a);
  }
  case 20: { /* cat and stack */
    if (a.nd == 0 || a.nd >= 5) return 0;
    int ib = partner(g, &a, true);
    if (ib < 0) ib = ia;
    if (chance(r, 2)) {
      int ax = pick(r, a.nd + 1);
      for (int i = 0, j = 0; i <= a.nd; i++) d[i] = i == ax ? 2 : a.d[j++];
      return push(g, kiln_stack(((kiln_tensor *[]){a.t, g->v[ib].t}), 2, ax), a.nd + 1, d, -1, false);
    }
    int ax = pick(r, a.nd);
    memcpy(d, a.d, sizeof(int) * (size_t)a.nd);
    d[ax] = a.d[ax] > 0 ? 2 * a.d[ax] : D_OPAQUE - ++g->opaque;
    return push(g, kiln_cat(((kiln_tensor *[]){a.t, g->v[ib].t}), 2, ax), a.nd, d, -1, false);
  }
  case 21: { /* index_select with constant indices on a constant dim */
    int ax = -1;
    for (int i = 0; i < a.nd; i++)
      if (a.d[i] > 0 && chance(r, 2)) ax = i;
    if (ax < 0) return 0;
    int64_t idx[4];
    int n = 1 + pick(r, 4);
    for (int i = 0; i < n; i++) idx[i] = pick(r, a.d[ax]);
    memcpy(d, a.d, sizeof(int) * (size_t)a.nd), d[ax] = n;
    return push(g, kiln_index_select(a.t, ax, kiln_tensor_from(KILN_I64, 1, ((int64_t[]){n}), idx)), a.nd, d, -1, false);
  }
  default: /* the mean of another value added */
    return push_like(g, kiln_add(a.t, kiln_mean_all(g->v[pick_float(g)].t)), &a);
  }
}

/* A random program over x (B,C) or (B,T,C), w (C,), m (1,C) or (T,C), u (B,1)
 * or (B,1,C), P (8,C): a pool of values grows by random steps; the outputs
 * mix the last values, and may be views, inputs returned as they are, and the
 * gradients of a loss w.r.t. every input. */
static char body_err[256]; /* why the last body failed */

static int random_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const prog *pg = ctx;
  gen *g = calloc(1, sizeof *g);
  if (!g) return -1;
  g->r = (rng){pg->seed * 2654435761u + 1};
  g->p = pg;
  g->ft = pg->f64 ? KILN_F64 : KILN_F32;
  g->in = in;
  int C = pg->C, rc = -1;
  if (pg->nd_x == 2) {
    push(g, in[0], 2, ((int[]){D_B, C}), -1, false);
    push(g, in[1], 1, ((int[]){C}), -1, false);
    push(g, in[2], 2, ((int[]){1, C}), -1, false);
    push(g, in[3], 2, ((int[]){D_B, 1}), -1, false);
  } else {
    push(g, in[0], 3, ((int[]){D_B, D_T, C}), -1, false);
    push(g, in[1], 1, ((int[]){C}), -1, false);
    push(g, in[2], 2, ((int[]){D_T, C}), -1, false);
    push(g, in[3], 3, ((int[]){D_B, 1, C}), -1, false);
  }
  push(g, in[4], 2, ((int[]){8, C}), -1, false);
  /* a strided view of a copy */
  val *x = &g->v[0];
  if (push(g, kiln_transpose(kiln_contiguous(kiln_transpose(in[0], 0, 1)), 0, 1), x->nd, x->d, -1, false)) goto done;
  int steps = 5 + pick(&g->r, 14);
  for (int s = 0; s < steps; s++)
    if (step(g)) goto done;
  /* out[0]: the last float value plus the mean of another, so more than the last op matters */
  int last = g->n - 1;
  while (last > 0 && kiln_type(g->v[last].t) != g->ft) last--;
  kiln_tensor *o0 = kiln_add(g->v[last].t, kiln_mean_all(g->v[pick_float(g)].t));
  if (!o0) goto done;
  out[0] = o0;
  for (int i = 1; i < pg->n_val; i++) {
    val *v = &g->v[pick(&g->r, g->n)];
    switch (pick(&g->r, 5)) {
    case 0: out[i] = in[pick(&g->r, N_IN)]; break; /* an input as it is */
    case 1: out[i] = v->nd >= 2 ? kiln_transpose(v->t, 0, v->nd - 1) : v->t; break; /* a view */
    case 2: out[i] = v->nd >= 2 ? kiln_reshape(kiln_transpose(v->t, 0, 1), 1, ((int64_t[]){-1})) : v->t; break; /* a view that needs a copy */
    default: out[i] = v->t; break;
    }
    if (!out[i]) goto done;
  }
  if (pg->grad) {
    kiln_tensor *loss = kiln_sum_all(kiln_mul(o0, o0));
    val *v = &g->v[pick_float(g)];
    loss = kiln_add(loss, kiln_mean_all(kiln_mul(v->t, v->t)));
    loss = kiln_add(loss, kiln_mean_all(in[pick(&g->r, N_IN)])); /* so that the loss requires grad */
    if (!loss || kiln_grad_of(loss, in, N_IN, out + pg->n_val)) goto done;
  }
  rc = 0;
done:
  if (rc) snprintf(body_err, sizeof body_err, "%s", g->err[0] ? g->err : kiln_last_error());
  free(g);
  return rc;
}

static int run_program(uint64_t seed, int threads, char *why, size_t whyn) {
  prog pg;
  prog_init(&pg, seed);
  kiln_options o = {.name = "rand", .n_in = N_IN, .n_out = pg.n_out, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(random_body, &pg, &o);
  int C = pg.C;
  /* sizes of (B, T): 1, and sizes equal to C and to each other; the first call traces */
  int64_t sz2[5][2] = {{5, 1}, {C, 1}, {1, 1}, {16, 1}, {7, 1}};
  int64_t sz3[5][2] = {{3, 5}, {C, 2}, {1, C}, {5, 1}, {4, 4}};
  int64_t(*sz)[2] = pg.nd_x == 3 ? sz3 : sz2;
  kiln_dtype ft = pg.f64 ? KILN_F64 : KILN_F32;
  int rc = 0, bad_out = -1;
  int64_t bt[2] = {0, 0};
  kiln_set_num_threads(threads);
  for (int k = 0; k < 5 && !rc; k++) {
    int i = (k + pg.rot) % 5;
    int64_t b = sz[i][0], t = sz[i][1];
    bt[0] = b, bt[1] = t;
    kiln_scope_begin();
    uint64_t sd = seed * 16 + (uint64_t)i;
    kiln_tensor *in[N_IN];
    if (pg.nd_x == 2) {
      in[0] = kiln_randn(ft, 2, ((int64_t[]){b, C}), sd);
      in[2] = kiln_randn(ft, 2, ((int64_t[]){1, C}), seed + 101);
      in[3] = kiln_randn(ft, 2, ((int64_t[]){b, 1}), sd + 7);
    } else {
      in[0] = kiln_randn(ft, 3, ((int64_t[]){b, t, C}), sd);
      in[2] = kiln_randn(ft, 2, ((int64_t[]){t, C}), sd + 5);
      in[3] = kiln_randn(ft, 3, ((int64_t[]){b, 1, C}), sd + 7);
    }
    in[1] = kiln_randn(ft, 1, ((int64_t[]){C}), seed + 100);
    in[4] = kiln_randn(ft, 2, ((int64_t[]){8, C}), seed + 102);
    if (pg.grad)
      for (int j = 0; j < N_IN; j++) kiln_requires_grad(in[j], true);
    kiln_tensor *y[16] = {0}, *ref[16] = {0};
    int r2 = random_body(&pg, in, ref);
    if (r2) {
      snprintf(why, whyn, "B=%lld T=%lld: the program fails eagerly (a generator bug): %s", (long long)b, (long long)t,
               body_err);
      rc = -1;
    }
    int r1 = rc ? 0 : kiln_call(fn, in, y);
    if (!rc && r1) {
      snprintf(why, whyn, "B=%lld T=%lld: compiled call failed: %s", (long long)b, (long long)t, kiln_last_error());
      rc = -1;
    }
    for (int j = 0; j < pg.n_out && !rc; j++) {
      int64_t bad = -1;
      bool grad_out = j >= pg.n_val;
      double tol = pg.f64 ? (grad_out ? 1e-8 : 1e-9) : (grad_out ? 1e-4 : 2e-5);
      if (!same_shape(y[j], ref[j])) {
        char s1[128], s2[128];
        snprintf(why, whyn, "B=%lld T=%lld: output %d%s has shape %s, eager %s", (long long)b, (long long)t, j,
                 grad_out ? " (a gradient)" : "", kiln_describe(y[j], s1, sizeof s1), kiln_describe(ref[j], s2, sizeof s2));
        rc = -1, bad_out = j;
        break;
      }
      double dd = maxdiff_rel(y[j], ref[j], &bad);
      if (!(dd <= tol)) {
        snprintf(why, whyn, "B=%lld T=%lld: output %d%s: max rel diff %g (tolerance %g) at element %lld", (long long)b,
                 (long long)t, j, grad_out ? " (a gradient)" : "", dd, tol, (long long)bad);
        rc = -1, bad_out = j;
      }
    }
    kiln_scope_end();
  }
  (void)bad_out;
  if (rc) {
    int nv = 0;
    while (1) {
      char *t = kiln_fn_graph(fn, nv);
      if (!t) break;
      free(t), nv++;
    }
    char *text = nv ? kiln_fn_graph(fn, nv - 1) : NULL;
    fprintf(stderr,
            "random program seed %llu failed (threads %d, C=%d, x %s, %s%s, %d outputs, sizes from #%d): %s\n"
            "its graph (variant %d of %d):\n%s\n",
            (unsigned long long)seed, threads, C, pg.nd_x == 3 ? "(B,T,C)" : "(B,C)", pg.f64 ? "f64" : "f32",
            pg.grad ? ", with grads" : "", pg.n_out, pg.rot, why, nv - 1, nv, text ? text : "(none)");
    free(text);
  }
  (void)bt;
  kiln_fn_free(fn);
  kiln_set_num_threads(0);
  return rc;
}

START_TEST(test_random_programs) {
  const char *env = getenv("KILN_FUZZ_PROGRAMS");
  const char *first = getenv("KILN_FUZZ_FIRST"); /* the first seed (to rerun one: KILN_FUZZ_FIRST=seed KILN_FUZZ_PROGRAMS=1) */
  int n = env ? atoi(env) : 100;
  uint64_t base = first ? strtoull(first, NULL, 10) : 1000;
  int failed = 0;
  uint64_t first_bad = 0;
  for (int i = 0; i < n; i++) {
    char why[512];
    uint64_t seed = base + (uint64_t)i;
    if (run_program(seed, 1 + (int)(seed % 2), why, sizeof why)) {
      if (!failed) first_bad = seed;
      failed++;
    }
  }
  ck_assert_msg(failed == 0, "%d of %d random programs differ from eager; the first is seed %llu", failed, n,
                (unsigned long long)first_bad);
}
END_TEST


/* compiled results are bitwise equal at 1 and 2 threads */
START_TEST(test_threads_bitwise) {
  body_fn bodies[] = {gelu_body, softmax_body, layernorm_body};
  for (int k = 0; k < 3; k++) {
    static float out[2][512 * 300];
    for (int t = 1; t <= 2; t++) {
      kiln_set_num_threads(t);
      kiln_scope_begin();
      kiln_tensor *in[3] = {kiln_randn(KILN_F32, 2, ((int64_t[]){512, 300}), 7), kiln_randn(KILN_F32, 1, ((int64_t[]){300}), 8),
                            kiln_randn(KILN_F32, 1, ((int64_t[]){300}), 9)};
      kiln_options o = {.name = "bits", .n_in = k == 2 ? 3 : 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
      kiln_fn *fn = kiln_compile(bodies[k], NULL, &o);
      kiln_tensor *y;
      ck_assert_int_eq(0, kiln_call(fn, in, &y));
      ck_assert_int_eq(0, kiln_call(fn, in, &y));
      ck_assert_int_eq(0, kiln_read(y, out[t - 1], sizeof out[0]));
      kiln_fn_free(fn);
      kiln_scope_end();
    }
    ck_assert_msg(!memcmp(out[0], out[1], sizeof out[0]), "body %d differs between 1 and 2 threads", k);
  }
  kiln_set_num_threads(0);
}
END_TEST

#ifdef KILN_TEST_BUILD
/* Faults forced in the test build: LLVM refusing a graph falls back to the
 * interpreter with a warning and the right answer; a corrupted kernel is
 * named by check mode, with its nodes' lines, and eager's answer returned. */
START_TEST(test_forced_faults) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){33, 70}), 1), *y = NULL, *ref = NULL;
  ck_assert_int_eq(0, softmax_body(NULL, &x, &ref));
  int64_t bad;

  setenv("KILN_TEST_FAIL_LLVM", "1", 1);
  kiln_options o = {.name = "fallback", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(softmax_body, NULL, &o);
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  ck_assert_int_eq(0, kiln_call(fn, &x, &y)); /* the interpreter runs the variant */
  unsetenv("KILN_TEST_FAIL_LLVM");
  ck_assert_double_le(maxdiff_rel(y, ref, &bad), 1e-6);
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(1, st.hits);
  kiln_fn_free(fn);

  setenv("KILN_TEST_CORRUPT_KERNEL", "k0_row", 1);
  o = (kiln_options){.name = "checked", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM, .check = 1};
  fn = kiln_compile(softmax_body, NULL, &o);
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  unsetenv("KILN_TEST_CORRUPT_KERNEL");
  ck_assert_double_le(maxdiff_rel(y, ref, &bad), 1e-6); /* eager's answer, not the corrupted one */
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(1, st.check_fails);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST
#endif

static Suite *suite(void) {
  Suite *s = suite_create("codegen");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 900);
  tcase_add_test(tc, test_fusion_plans);
  tcase_add_test(tc, test_threads_bitwise);
  tcase_add_test(tc, test_random_programs);
#ifdef KILN_TEST_BUILD
  tcase_add_test(tc, test_forced_faults);
#endif
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
