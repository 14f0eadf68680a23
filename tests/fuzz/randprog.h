/* A random program generator over the eager API, shared by the codegen test
 * (tests/test_codegen.c, seeded) and the differential fuzzer
 * (tests/fuzz/fuzz_compile.c, driven by the fuzzer's bytes). random_body is
 * a kiln_body: the same prog makes the same program at every size and on
 * every call, so compiled calls can be checked against eager ones. Included
 * by one file per program (its functions are static). */
#ifndef KILN_RANDPROG_H
#define KILN_RANDPROG_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

typedef struct rng {
  uint64_t s;
  const uint8_t *bytes; /* when set, each choice is the next of these while they last */
  size_t n_bytes, at;
} rng;
static uint64_t next(rng *r) {
  r->s ^= r->s << 13;
  r->s ^= r->s >> 7;
  r->s ^= r->s << 17;
  if (r->bytes && r->at < r->n_bytes) return r->bytes[r->at++];
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
  int mode;      /* 0: the first set of ops; 1: the newer ops too (a mode of its own, so that the
                    programs of mode 0, kept seeds among them, stay as they were); 2: and
                    control flow (scan, cond, while_loop: regions in a compiled body) */
  const uint8_t *bytes; /* a fuzzer's input: the body's choices, then the seed's (NULL: the seed's only) */
  size_t n_bytes;
  /* C mode (off in prog_init, so the seeds' programs stay what they were):
   * C branches on sizes and on values read back, C numbers that change from
   * call to call (call_no, which the caller sets before each run), numbers
   * made from sizes, and dropout (the caller seeds the generator before each
   * run, so eager and compiled draw the same masks) */
  bool cmode;
  int call_no;
} prog;

static void prog_init(prog *p, uint64_t seed) {
  rng r = {.s = seed * 0x9E3779B97F4A7C15ull + 0x1234567};
  for (int i = 0; i < 4; i++) next(&r);
  static const int cs[] = {3, 4, 6, 8, 12};
  *p = (prog){.seed = seed};
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

/* Added where a program compares a computed value with another that can
 * equal it exactly but for rounding (a mean of values on a lattice, a sum of
 * a centred value): eager and compiled code round differently, and the
 * branch must not depend on how. */
#define TIE_OFF 0.0137

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

/* A step of mode 1: the newer ops on a. Ops whose result jumps with the last
 * bit of its input (floor, round, sign, topk, argmin, one_hot) take an input
 * of the body, whose values compiled and eager code share exactly. */
static int step_more(gen *g, val a) {
  rng *r = &g->r;
  int d[KILN_MAX_DIMS], nd;
  val x = g->v[pick(r, N_IN)];
  int last = a.nd - 1, xl = x.nd - 1;
  switch (pick(r, 16)) {
  case 0: { /* pointwise */
    kiln_tensor *o;
    switch (pick(r, 8)) {
    case 0: o = kiln_silu(a.t); break;
    case 1: o = kiln_softplus(kiln_mul_scalar(a.t, 8.0)); break;
    case 2: o = kiln_log1p(kiln_abs(a.t)); break;
    case 3: o = kiln_expm1(kiln_tanh(a.t)); break;
    case 4: o = kiln_clamp(a.t, -0.5, 0.7); break;
    case 5: o = kiln_leaky_relu(a.t, 0.1); break;
    case 6: o = kiln_div_scalar(kiln_sub_scalar(kiln_add_scalar(a.t, 1.5), 0.25), -4.0); break;
    default: o = kiln_mul_scalar(a.t, 3.0); break;
    }
    return push_like(g, o, &a);
  }
  case 1: { /* rounding of an input */
    kiln_tensor *o, *y = kiln_mul_scalar(x.t, 2.0);
    switch (pick(r, 4)) {
    case 0: o = kiln_floor(y); break;
    case 1: o = kiln_ceil(y); break;
    case 2: o = kiln_round(y); break;
    default: o = kiln_sign(y); break;
    }
    return push_like(g, o, &x);
  }
  case 2: { /* logsumexp over an axis */
    if (a.nd == 0) return 0;
    int ax = pick(r, a.nd);
    bool keep = chance(r, 2);
    nd = reduced(&a, 1u << ax, keep, d);
    return push(g, kiln_logsumexp(a.t, ax, keep), nd, d, -1, false);
  }
  case 3: return push(g, chance(r, 2) ? kiln_max_all(a.t) : kiln_min_all(a.t), 0, d, -1, false);
  case 4: { /* argmin of an input, as a float */
    if (x.nd == 0) return 0;
    int ax = pick(r, x.nd);
    nd = reduced(&x, 1u << ax, false, d);
    return push(g, kiln_cast(kiln_argmin(x.t, ax, false), g->ft), nd, d, -1, false);
  }
  case 5: /* masked_fill where a is above its mean (plus an offset: a value
            * of a rounding op can equal the mean but for its last bit) */
    return push_like(g, kiln_masked_fill(a.t, kiln_gt(a.t, kiln_add_scalar(kiln_mean_all(a.t), TIE_OFF)), -0.5), &a);
  case 6: /* rms_norm over the last dim, with the weight when it is C */
    if (a.nd == 0) return 0;
    return push_like(g, kiln_rms_norm(a.t, a.d[last] == g->p->C ? g->in[1] : NULL, 1e-5), &a);
  case 7: { /* group_norm over (N, C', ...) */
    if (a.nd < 2) return 0;
    int groups = a.d[1] > 0 && a.d[1] % 2 == 0 ? 2 : 1;
    return push_like(g, kiln_group_norm(a.t, groups, NULL, NULL, 1e-5), &a);
  }
  case 8: /* triangles */
    if (a.nd < 2) return 0;
    return push_like(g, chance(r, 2) ? kiln_tril(a.t, pick(r, 3) - 1) : kiln_triu(a.t, pick(r, 3) - 1), &a);
  case 9: { /* pad the last dim; a constant one may be cropped by 1 */
    if (a.nd == 0) return 0;
    int64_t lo = pick(r, 3), hi = a.d[last] > 1 ? pick(r, 3) - 1 : pick(r, 2);
    memcpy(d, a.d, sizeof(int) * (size_t)a.nd);
    d[last] = a.d[last] > 0 ? a.d[last] + (int)(lo + hi) : lo + hi == 0 ? a.d[last] : D_OPAQUE - ++g->opaque;
    return push(g, kiln_pad(a.t, 2, ((int64_t[]){lo, hi}), 0.5), a.nd, d, -1, false);
  }
  case 10: /* cumsum */
    if (a.nd == 0) return 0;
    return push_like(g, kiln_cumsum(a.t, pick(r, a.nd)), &a);
  case 11: { /* topk of an input along its constant last dim: the values, or scattered back into x */
    if (x.nd == 0 || x.d[xl] <= 0) return 0;
    int64_t k = 1 + pick(r, x.d[xl] < 3 ? x.d[xl] : 3);
    kiln_tensor *v, *i;
    if (kiln_topk(x.t, k, xl, chance(r, 2), &v, &i)) return push(g, NULL, 0, d, -1, false);
    if (chance(r, 2)) return push_like(g, kiln_scatter_add(x.t, xl, i, kiln_exp(v)), &x);
    memcpy(d, x.d, sizeof(int) * (size_t)x.nd);
    d[xl] = (int)k;
    return push(g, kiln_mul(v, kiln_gather(x.t, xl, i)), x.nd, d, -1, false);
  }
  case 12: { /* repeat one dim twice */
    int n = a.nd ? a.nd : 1, ax = pick(r, n);
    int64_t reps[KILN_MAX_DIMS];
    for (int i = 0; i < n; i++) reps[i] = i == ax ? 2 : 1, d[i] = a.nd ? a.d[i] : 1;
    d[ax] = d[ax] > 0 ? 2 * d[ax] : D_OPAQUE - ++g->opaque;
    return push(g, kiln_repeat(a.t, n, reps), n, d, -1, false);
  }
  case 13: { /* index_copy of rows picked from a back into a, along a constant dim */
    int ax = -1;
    for (int i = 0; i < a.nd; i++)
      if (a.d[i] > 0 && chance(r, 2)) ax = i;
    if (ax < 0) return 0;
    int64_t to[3], from[3];
    int n = 1 + pick(r, 3);
    for (int i = 0; i < n; i++) to[i] = pick(r, a.d[ax]), from[i] = pick(r, a.d[ax]);
    kiln_tensor *src = kiln_tanh(kiln_index_select(a.t, ax, kiln_tensor_from(KILN_I64, 1, ((int64_t[]){n}), from)));
    return push_like(g, kiln_index_copy(a.t, ax, kiln_tensor_from(KILN_I64, 1, ((int64_t[]){n}), to), src), &a);
  }
  case 14: { /* split a constant dim in pieces of 2 (at most 8 pieces), and cat them back in reverse */
    int ax = -1;
    for (int i = 0; i < a.nd; i++)
      if (a.d[i] > 1) ax = i;
    if (ax < 0) return 0;
    kiln_tensor *p[8], *q[8];
    int n = kiln_split_n(a.t, a.d[ax] > 16 ? (a.d[ax] + 7) / 8 : 2, ax, p, 8);
    if (n < 0) return push(g, NULL, 0, d, -1, false);
    for (int i = 0; i < n; i++) q[i] = p[n - 1 - i];
    return push_like(g, kiln_cat(q, n, ax), &a);
  }
  default: { /* one_hot of an input's argmax along its constant last dim, as a float */
    if (x.nd == 0 || x.d[xl] <= 0) return 0;
    nd = reduced(&x, 1u << xl, false, d);
    d[nd++] = x.d[xl];
    return push(g, kiln_cast(kiln_one_hot(kiln_argmax(x.t, xl, false), x.d[xl]), g->ft), nd, d, -1, false);
  }
  }
}

/* One random step: adds one value (or a few) to the pool. 0, or -1 when an op failed. */
/* A step of C around the ops (prog.cmode): what a tracer that saw only the
 * ops would get wrong. Every branch keeps a's shape. */
static int cstep(gen *g, const val *a) {
  rng *r = &g->r;
  switch (pick(r, 6)) {
  case 0: { /* a branch on a size */
    int64_t at = 1 + pick(r, 6), n = a->nd ? kiln_size(a->t, pick(r, a->nd)) : kiln_numel(a->t);
    int u = pick(r, 17), v = pick(r, 17);
    kiln_tensor *o = unary(g, n > at ? u : v, a->t);
    return push_like(g, o, a);
  }
  case 1: { /* a C number that changes from call to call */
    double c = 0.5 + 0.25 * (g->p->call_no % 3);
    return push_like(g, kiln_mul(a->t, kiln_scalar(g->ft, c)), a);
  }
  case 2: { /* a number made from sizes */
    double c = 1.0 / (double)(kiln_numel(a->t) + 1);
    return push_like(g, kiln_add(a->t, kiln_scalar(g->ft, c * (double)kiln_size(a->t, 0))), a);
  }
  case 3: { /* a branch on a value read back (a graph break) */
    double m = kiln_item(kiln_mean_all(a->t));
    /* a mean that is zero but for rounding (of a centred value) would pick
     * the branch by the order of its sum, which compiled code may change */
    if (!isfinite(m) || fabs(m) < 1e-3) m = 0;
    kiln_tensor *o = m > 0 ? kiln_relu(a->t) : kiln_mul(a->t, kiln_scalar(g->ft, 0.5));
    return push_like(g, o, a);
  }
  case 4: /* dropout from the default generator */
    return push_like(g, kiln_dropout(a->t, 0.25, true), a);
  default: { /* a loop whose trip count is a value read back */
    /* offset so that a mean of a softmax (1/K) or a rounding op's values
     * does not sit on a step, where rounding would choose the count */
    int n = (int)fmin(3, fabs(kiln_item(kiln_mean_all(a->t))) * 4 + 0.4137);
    kiln_tensor *o = a->t;
    for (int i = 0; i < n; i++) o = kiln_tanh(o);
    return push_like(g, o, a);
  }
  }
}

/* ---- control flow (mode 2): regions in a compiled body ---- */

static int rp_cell(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  gen *g = ctx; /* carry c, x[t]: c = c/2 + sin(x[t]); y[t] = c * x[t] */
  out[0] = kiln_add(kiln_mul(in[0], S(g, 0.5)), kiln_sin(in[1]));
  out[1] = kiln_mul(out[0], in[1]);
  return !out[0] || !out[1];
}
static int rp_then(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_exp(kiln_tanh(in[0])));
}
static int rp_else(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  return !(out[0] = kiln_mul(in[0], S(ctx, -0.5)));
}
/* while max |a| > 0.25, at most 8 times (a counter in the carry) */
static int rp_below(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  gen *g = ctx;
  kiln_tensor *small = kiln_cast(kiln_le(kiln_max_all(kiln_abs(in[0])), S(g, 0.25)), g->ft);
  return !(out[0] = kiln_lt(kiln_add(in[1], kiln_mul(small, S(g, 8))), S(g, 8)));
}
static int rp_halve(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  gen *g = ctx;
  out[0] = kiln_mul(in[0], S(g, 0.5));
  out[1] = kiln_add(in[1], S(g, 1));
  return !out[0] || !out[1];
}

static int step_region(gen *g, val *a) {
  rng *r = &g->r;
  switch (pick(r, 3)) {
  case 0: { /* a scan over a's dim 0; its carry starts at a[0] * 0 */
    if (a->nd < 1) break;
    kiln_tensor *init = kiln_mul(kiln_squeeze(kiln_slice(a->t, 0, 0, 1, 1), 0), S(g, 0)), *last = NULL, *ys = NULL;
    if (!init || kiln_scan(rp_cell, g, 1, &init, 1, &a->t, &last, 1, &ys)) return push(g, NULL, 0, NULL, -1, false);
    if (push(g, last, a->nd - 1, a->d + 1, -1, false)) return -1;
    return push_like(g, ys, a);
  }
  case 1: { /* a cond on a's sum */
    kiln_tensor *p = kiln_gt(kiln_sum_all(a->t), S(g, TIE_OFF)), *o = NULL; /* a centred a sums to 0 but for rounding */
    if (!p || kiln_cond(p, rp_then, rp_else, g, 1, &a->t, 1, &o)) return push(g, NULL, 0, NULL, -1, false);
    return push_like(g, o, a);
  }
  default: break;
  }
  /* while_loop is forward only: with grads, its result is a constant of the loss */
  kiln_tensor *init[2] = {a->t, S(g, 0)}, *fin[2] = {NULL, NULL};
  if (g->p->grad) kiln_no_grad_begin();
  int rc = kiln_while_loop(rp_below, rp_halve, g, 2, init, fin);
  if (g->p->grad) kiln_no_grad_end();
  if (rc) return push(g, NULL, 0, NULL, -1, false);
  return push_like(g, fin[0], a);
}

static int step(gen *g) {
  rng *r = &g->r;
  int ia = pick_float(g);
  val a = g->v[ia]; /* a copy: pushes may not move it, but keep it simple */
  if (g->p->cmode && chance(r, 3)) return cstep(g, &a);
  int d[KILN_MAX_DIMS], nd;
  int64_t s[KILN_MAX_DIMS];
  int C = g->p->C;
  if (g->p->mode == 2 && chance(r, 4)) return step_region(g, &a);
  if (g->p->mode >= 1 && chance(r, 2)) return step_more(g, a);
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
    /* eps 1e-3, not 1e-5: a row of equal values (a broadcast) normalizes to
     * rounding noise times rsqrt(eps), and any order of the sums is right */
    return push_like(g, kiln_layer_norm(a.t, w, b, 1e-3), &a);
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
        /* the argmax of a body's input (or its copy): of a computed value, two
         * entries equal but for rounding would pick the label by it */
        val *b = &g->v[pick(r, N_IN + 1)];
        if (kiln_type(b->t) == g->ft && b->nd == 2 && b->d[0] == l->d[0] && b->d[1] > 0 && b->d[1] <= l->d[1])
          lab = kiln_argmax(b->t, 1, false);
      }
      /* a row sum against its mean plus a margin: without one, a centered row
       * (x - mean(x)) compares two rounding errors, and eager and compiled,
       * summing in different orders, may pick different labels (seed 70152) */
      if (!lab) lab = kiln_cast(kiln_gt(kiln_sum(l->t, 1, false), kiln_add(kiln_mean(l->t, 1, false), S(g, 0.5 + TIE_OFF))), KILN_I64);
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
  case 22: { /* convolution, pooling, batch norm over (N, Cin, H, W): a 4-D value, or a 2-D or 3-D one with
               * dims of 1 put in; H keeps its dim (windows of 1 or 3 with padding 1), W is a constant */
    int cin, h, w;
    kiln_tensor *x4;
    if (a.nd == 4 && a.d[1] > 0 && a.d[3] > 0) {
      x4 = a.t, cin = a.d[1], h = a.d[2], w = a.d[3];
    } else if ((a.nd == 2 || a.nd == 3) && a.d[a.nd - 1] > 0) {
      x4 = a.nd == 3 ? kiln_unsqueeze(a.t, 1) : kiln_unsqueeze(kiln_unsqueeze(a.t, 1), 1);
      cin = 1, h = a.nd == 3 ? a.d[1] : 1, w = a.d[a.nd - 1];
    } else {
      return 0;
    }
    int kh = chance(r, 2) ? 1 : 3, kw = 1 + pick(r, w < 3 ? w : 3), sw = 1 + pick(r, 2), pw = pick(r, kw / 2 + 1);
    int hw[2] = {kh, kw}, st[2] = {1, sw}, pd[2] = {kh / 2, pw};
    int wo = (w + 2 * pw - kw) / sw + 1;
    kiln_tensor *o;
    switch (pick(r, 5)) {
    case 0: { /* conv2d, its weight cut from P (8,C) so that its gradient reaches an input */
      int cout = 1 + pick(r, 3), dil = kw > 1 && w + 2 * pw >= 2 * kw - 1 && chance(r, 3) ? 2 : 1;
      if (cin * kh * kw > C) return 0;
      kiln_tensor *wt = kiln_slice(kiln_slice(g->in[4], 0, 0, cout, 1), 1, 0, cin * kh * kw, 1);
      wt = kiln_reshape(wt, 4, ((int64_t[]){cout, cin, kh, kw}));
      wo = (w + 2 * pw - dil * (kw - 1) - 1) / sw + 1;
      o = kiln_conv2d(x4, wt, chance(r, 2) ? kiln_slice(g->in[1], 0, 0, cout, 1) : NULL, st, pd, ((int[]){1, dil}), 1);
      d[1] = cout;
      break;
    }
    case 1: o = kiln_max_pool2d(x4, hw, st, pd), d[1] = cin; break;
    case 2: o = kiln_avg_pool2d(x4, hw, st, pd), d[1] = cin; break;
    case 3: { /* adaptive: a constant output size */
      int ow = 1 + pick(r, 3);
      d[0] = a.d[0], d[1] = cin, d[2] = 2, d[3] = ow;
      return push(g, kiln_adaptive_avg_pool2d(x4, ((int[]){2, ow})), 4, d, -1, false);
    }
    default: /* batch norm, with the batch's statistics (more than one value per channel) or constant running ones */
      /* eps 1e-3, as layer norm's: statistics of equal values normalize rounding noise */
      o = w > 1 && chance(r, 2) ? kiln_batch_norm(x4, NULL, NULL, NULL, NULL, true, 0.1, 1e-3)
                       : kiln_batch_norm(x4, kiln_zeros(g->ft, 1, ((int64_t[]){cin})), kiln_full(g->ft, 1, ((int64_t[]){cin}), 2),
                                         NULL, NULL, false, 0.1, 1e-3);
      d[1] = cin, wo = w;
      break;
    }
    d[0] = a.d[0], d[2] = h, d[3] = wo;
    return push(g, o, 4, d, -1, false);
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
  g->r = (rng){.s = pg->seed * 2654435761u + 1, .bytes = pg->bytes, .n_bytes = pg->n_bytes};
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

/* max |x - y| / (1 + |y|) over the elements, at element *bad (NaN where
 * only one is NaN, or a failed read: infinite). */
static double maxdiff_rel(kiln_tensor *a, kiln_tensor *b, int64_t *bad) {
  kiln_scope_begin();
  int64_t n = kiln_numel(a);
  double *x = malloc(sizeof(double) * (size_t)(n + 1)), *y = malloc(sizeof(double) * (size_t)(n + 1)), m = 0;
  *bad = -1;
  if (!x || !y || kiln_read(kiln_cast(a, KILN_F64), x, sizeof(double) * (size_t)n) ||
      kiln_read(kiln_cast(b, KILN_F64), y, sizeof(double) * (size_t)n))
    m = INFINITY;
  for (int64_t i = 0; m != INFINITY && i < n; i++) {
    if ((isnan(x[i]) && isnan(y[i])) || x[i] == y[i]) continue;
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

#endif
