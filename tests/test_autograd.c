/* Autograd: every differentiable op's backward is checked against central
 * finite differences in float64, then the rules of the engine itself:
 * accumulation, freed graphs, backward_with, grad_of, no-grad scopes and
 * in-place updates of leaves.
 *
 * For an op f the check builds L = sum(f(x) * R) with a fixed random R, so
 * every output element matters, and compares dL/dx from kiln with
 * (L(x+e) - L(x-e)) / 2e, where L is evaluated in plain C from the read-back
 * output of fresh tensors. */
#include <check.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

#define FD_EPS 1e-6
#define RTOL 1e-5
#define ATOL 1e-7
#define MAX_IN 4

/* ---- deterministic test data (independent of kiln's generator) -------- */

static uint64_t splitmix(uint64_t *s)
{
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static double uniform01(uint64_t *s) { return (double)(splitmix(s) >> 11) * 0x1.0p-53; }

enum {
  D_ANY,      /* U(-1, 1) */
  D_POS,      /* U(0.5, 2): log, sqrt, pow base, divisors */
  D_NONZERO,  /* |x| in [0.2, 1.5]: abs, relu stay away from the kink */
  D_DISTINCT, /* values 0.1 apart, never 0: max/min without ties */
  D_WIDE,     /* |x| in [0.05, 4]: the tails of the activations */
};

static void fill(double *d, int64_t n, int dom, uint64_t seed)
{
  uint64_t s = seed * 0x2545f4914f6cdd1dull + 1;
  if (dom == D_DISTINCT) {
    for (int64_t i = 0; i < n; i++)
      d[i] = (double)i;
    for (int64_t i = n - 1; i > 0; i--) {
      int64_t j = (int64_t)(splitmix(&s) % (uint64_t)(i + 1));
      double t = d[i];
      d[i] = d[j];
      d[j] = t;
    }
    for (int64_t i = 0; i < n; i++)
      d[i] = (d[i] - (double)n / 2.0) * 0.1 + 0.025;
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    double u = uniform01(&s);
    switch (dom) {
    case D_ANY: d[i] = 2.0 * u - 1.0; break;
    case D_POS: d[i] = 0.5 + 1.5 * u; break;
    case D_WIDE: d[i] = (splitmix(&s) & 1 ? 1.0 : -1.0) * (0.05 + 3.95 * u); break;
    default: d[i] = (splitmix(&s) & 1 ? 1.0 : -1.0) * (0.2 + 1.3 * u); break;
    }
  }
}

static uint64_t hash_name(const char *s)
{
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++)
    h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

/* ---- the gradient check ----------------------------------------------- */

typedef struct {
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  int dom;
} in_t;

#define IN(dom, ...) {sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t), {__VA_ARGS__}, (dom)}
#define IN0(dom) {0, {1}, (dom)}

typedef kiln_tensor *(*fwd_fn)(kiln_tensor *const *x, const void *ctx);

enum { VIA_BACKWARD, VIA_GRAD_OF };

static int64_t numel_of(const in_t *in)
{
  int64_t n = 1;
  for (int d = 0; d < in->ndim; d++)
    n *= in->shape[d];
  return n;
}

/* L = sum(f(x) * r) from fresh tensors without requires_grad; false if the
 * forward failed. */
static bool eval_loss(fwd_fn f, const void *ctx, int n, const in_t *ins, double *const *data, const double *r,
                      int64_t rn, double *loss)
{
  kiln_scope_begin();
  kiln_tensor *x[MAX_IN];
  for (int i = 0; i < n; i++)
    x[i] = kiln_tensor_from(KILN_F64, ins[i].ndim, ins[i].shape, data[i]);
  kiln_tensor *y = f(x, ctx);
  bool ok = y && kiln_type(y) == KILN_F64 && kiln_numel(y) == rn;
  if (ok) {
    double *buf = malloc((size_t)(rn > 0 ? rn : 1) * sizeof(double));
    ok = kiln_read(y, buf, (size_t)rn * sizeof(double)) == 0;
    double acc = 0;
    for (int64_t k = 0; k < rn; k++)
      acc += buf[k] * r[k];
    *loss = acc;
    free(buf);
  }
  kiln_scope_end();
  return ok;
}

static void gradcheck_via(const char *name, fwd_fn f, const void *ctx, int n, const in_t *ins, int via)
{
  ck_assert_int_le(n, MAX_IN);
  uint64_t seed = hash_name(name);
  double *data[MAX_IN];
  int64_t cnt[MAX_IN];
  for (int i = 0; i < n; i++) {
    cnt[i] = numel_of(&ins[i]);
    data[i] = malloc((size_t)cnt[i] * sizeof(double));
    fill(data[i], cnt[i], ins[i].dom, seed + 7919u * (uint64_t)i);
  }

  kiln_scope_begin();
  kiln_tensor *x[MAX_IN];
  for (int i = 0; i < n; i++) {
    x[i] = kiln_tensor_from(KILN_F64, ins[i].ndim, ins[i].shape, data[i]);
    ck_assert_msg(x[i] != NULL, "%s: input %d: %s", name, i, kiln_last_error());
    kiln_requires_grad(x[i], true);
  }
  kiln_tensor *y = f(x, ctx);
  ck_assert_msg(y != NULL, "%s: forward failed: %s", name, kiln_last_error());
  ck_assert_msg(kiln_type(y) == KILN_F64, "%s: output dtype %s", name, kiln_dtype_name(kiln_type(y)));
  ck_assert_msg(kiln_get_requires_grad(y), "%s: output does not require grad", name);

  int ynd = kiln_ndim(y);
  int64_t ysh[KILN_MAX_DIMS] = {1};
  for (int d = 0; d < ynd; d++)
    ysh[d] = kiln_size(y, d);
  int64_t rn = kiln_numel(y);
  double *r = malloc((size_t)(rn > 0 ? rn : 1) * sizeof(double));
  fill(r, rn, D_ANY, seed ^ 0x5eedull);
  kiln_tensor *rt = kiln_tensor_from(KILN_F64, ynd, ysh, r);
  kiln_tensor *loss = kiln_sum_all(kiln_mul(y, rt));
  ck_assert_msg(loss != NULL, "%s: loss: %s", name, kiln_last_error());

  double l0 = 0;
  ck_assert_msg(eval_loss(f, ctx, n, ins, data, r, rn, &l0), "%s: forward on fresh inputs failed: %s", name,
                kiln_last_error());
  double lk = kiln_item(loss);
  ck_assert_msg(fabs(lk - l0) <= 1e-12 * (1 + fabs(l0)), "%s: loss %.17g, expected %.17g", name, lk, l0);

  kiln_tensor *grads[MAX_IN] = {0};
  if (via == VIA_BACKWARD) {
    ck_assert_msg(kiln_backward(loss) == 0, "%s: backward: %s", name, kiln_last_error());
    for (int i = 0; i < n; i++)
      grads[i] = kiln_grad(x[i]);
  } else {
    ck_assert_msg(kiln_grad_of(loss, x, n, grads) == 0, "%s: grad_of: %s", name, kiln_last_error());
    for (int i = 0; i < n; i++)
      ck_assert_msg(kiln_grad(x[i]) == NULL, "%s: grad_of touched .grad of input %d", name, i);
  }

  for (int i = 0; i < n; i++) {
    kiln_tensor *g = grads[i];
    ck_assert_msg(g != NULL, "%s: no gradient for input %d", name, i);
    ck_assert_msg(kiln_type(g) == KILN_F64, "%s: grad %d dtype %s", name, i, kiln_dtype_name(kiln_type(g)));
    ck_assert_msg(kiln_ndim(g) == ins[i].ndim, "%s: grad %d has ndim %d, input %d", name, i, kiln_ndim(g),
                  ins[i].ndim);
    for (int d = 0; d < ins[i].ndim; d++)
      ck_assert_msg(kiln_size(g, d) == ins[i].shape[d], "%s: grad %d dim %d is %lld, input %lld", name, i, d,
                    (long long)kiln_size(g, d), (long long)ins[i].shape[d]);
    double *ga = malloc((size_t)cnt[i] * sizeof(double));
    ck_assert(kiln_read(g, ga, (size_t)cnt[i] * sizeof(double)) == 0);

    int64_t nbad = 0, first = -1;
    double first_a = 0, first_n = 0, maxdiff = 0;
    for (int64_t j = 0; j < cnt[i]; j++) {
      double keep = data[i][j], lp = 0, lm = 0;
      data[i][j] = keep + FD_EPS;
      ck_assert_msg(eval_loss(f, ctx, n, ins, data, r, rn, &lp), "%s: perturbed forward failed", name);
      data[i][j] = keep - FD_EPS;
      ck_assert_msg(eval_loss(f, ctx, n, ins, data, r, rn, &lm), "%s: perturbed forward failed", name);
      data[i][j] = keep;
      double num = (lp - lm) / (2 * FD_EPS);
      double diff = fabs(ga[j] - num);
      if (diff > maxdiff)
        maxdiff = diff;
      if (!(diff <= ATOL + RTOL * fabs(num))) {
        if (nbad++ == 0) {
          first = j;
          first_a = ga[j];
          first_n = num;
        }
      }
    }
    free(ga);
    ck_assert_msg(nbad == 0,
                  "%s: d/d input %d: %lld of %lld elements off; first at %lld: analytic %.10g, numeric %.10g; "
                  "max diff %.3g",
                  name, i, (long long)nbad, (long long)cnt[i], (long long)first, first_a, first_n, maxdiff);
  }
  kiln_scope_end();
  free(r);
  for (int i = 0; i < n; i++)
    free(data[i]);
}

static void gradcheck(const char *name, fwd_fn f, const void *ctx, int n, const in_t *ins)
{
  gradcheck_via(name, f, ctx, n, ins, VIA_BACKWARD);
}

/* ---- forward functions ------------------------------------------------ */

#define UNARY_FN(op) \
  static kiln_tensor *f_##op(kiln_tensor *const *x, const void *c) \
  { \
    (void)c; \
    return kiln_##op(x[0]); \
  }
#define BINARY_FN(op) \
  static kiln_tensor *f_##op(kiln_tensor *const *x, const void *c) \
  { \
    (void)c; \
    return kiln_##op(x[0], x[1]); \
  }
BINARY_FN(add)
BINARY_FN(sub)
BINARY_FN(mul)
BINARY_FN(div)
BINARY_FN(pow)
BINARY_FN(maximum)
BINARY_FN(minimum)
BINARY_FN(matmul)
BINARY_FN(mse_loss)
UNARY_FN(neg)
UNARY_FN(abs)
UNARY_FN(exp)
UNARY_FN(log)
UNARY_FN(sqrt)
UNARY_FN(rsqrt)
UNARY_FN(tanh)
UNARY_FN(sigmoid)
UNARY_FN(relu)
UNARY_FN(gelu)
UNARY_FN(gelu_erf)
UNARY_FN(erf)
UNARY_FN(sin)
UNARY_FN(cos)
UNARY_FN(silu)
UNARY_FN(softplus)
UNARY_FN(log1p)
UNARY_FN(expm1)
UNARY_FN(floor)
UNARY_FN(ceil)
UNARY_FN(round)
UNARY_FN(sign)
static kiln_tensor *f_clamp(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_clamp(x[0], -0.5, 0.3);
}
static kiln_tensor *f_leaky_relu(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_leaky_relu(x[0], 0.1);
}
/* the scalar forms, chained so that each one's gradient reaches x */
static kiln_tensor *f_scalar_ops(kiln_tensor *const *x, const void *c)
{
  (void)c;
  kiln_tensor *y = kiln_mul_scalar(kiln_add_scalar(x[0], 0.5), -3.0);
  return kiln_div_scalar(kiln_sub_scalar(kiln_mul(y, x[0]), 2.0), 4.0);
}
/* softplus past its threshold of 20, where it is x itself */
static kiln_tensor *f_softplus_far(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_softplus(kiln_mul_scalar(x[0], 30.0));
}

/* maximum/minimum with b = a + offset, |offset| >= 0.2, so no ties. */
static kiln_tensor *f_maximum_apart(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_maximum(x[0], kiln_add(x[0], x[1]));
}
static kiln_tensor *f_minimum_apart(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_minimum(kiln_add(x[0], x[1]), x[0]);
}
/* x feeds three uses: gradients from each must add up. */
static kiln_tensor *f_fanout(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_add(kiln_mul(x[0], x[0]), kiln_mul(kiln_sin(x[0]), x[1]));
}

typedef struct {
  bool list; /* use the *_axes form */
  int axis;
  int axes[4];
  int naxes;
  bool keep;
  int corr;
} red_t;

#define RED_FN(op) \
  static kiln_tensor *f_##op(kiln_tensor *const *x, const void *c) \
  { \
    const red_t *r = c; \
    return r->list ? kiln_##op##_axes(x[0], r->axes, r->naxes, r->keep) : kiln_##op(x[0], r->axis, r->keep); \
  }
RED_FN(sum)
RED_FN(mean)
RED_FN(max)
RED_FN(min)
static kiln_tensor *f_var(kiln_tensor *const *x, const void *c)
{
  const red_t *r = c;
  return r->list ? kiln_var_axes(x[0], r->axes, r->naxes, r->corr, r->keep) : kiln_var(x[0], r->axis, r->corr, r->keep);
}
static kiln_tensor *f_sum_all(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_sum_all(kiln_mul(x[0], x[0]));
}
static kiln_tensor *f_mean_all(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_mean_all(kiln_exp(x[0]));
}

static kiln_tensor *f_matmul_ta(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_matmul(kiln_transpose(x[0], 0, 1), x[1]);
}
static kiln_tensor *f_matmul_tb(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_matmul(x[0], kiln_transpose(x[1], 0, 1));
}
static kiln_tensor *f_matmul_ta3(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_matmul(kiln_transpose(x[0], 1, 2), x[1]);
}
/* q @ k^T as in attention: the last two dims of a batched operand swapped. */
static kiln_tensor *f_matmul_qk(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_matmul(x[0], kiln_transpose(x[1], 1, 2));
}

typedef struct {
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
} shape_t;

static kiln_tensor *f_reshape(kiln_tensor *const *x, const void *c)
{
  const shape_t *s = c;
  return kiln_reshape(x[0], s->ndim, s->shape);
}
static kiln_tensor *f_reshape_of_transpose(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_reshape(kiln_transpose(x[0], 0, 1), 1, (int64_t[]){12});
}
static kiln_tensor *f_transpose01(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_transpose(x[0], 0, 1);
}
static kiln_tensor *f_transpose02(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_transpose(x[0], 0, 2);
}
static kiln_tensor *f_permute(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_permute(x[0], ((int[]){2, 0, 1}));
}
static kiln_tensor *f_expand(kiln_tensor *const *x, const void *c)
{
  const shape_t *s = c;
  return kiln_expand(x[0], s->ndim, s->shape);
}
static kiln_tensor *f_squeeze1(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_squeeze(x[0], 1);
}
static kiln_tensor *f_unsqueeze1(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_unsqueeze(x[0], 1);
}
static kiln_tensor *f_unsqueeze_last(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_unsqueeze(x[0], 2);
}
static kiln_tensor *f_slice_step2(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_slice(x[0], 0, 1, 7, 2);
}
static kiln_tensor *f_slice_negstart(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_slice(x[0], 1, -4, 100, 2);
}
static kiln_tensor *f_contiguous_t(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_contiguous(kiln_transpose(x[0], 0, 1));
}
static kiln_tensor *f_cat1(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_cat(x, 3, 1);
}
static kiln_tensor *f_cat0(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_cat(x, 2, 0);
}
static kiln_tensor *f_stack1(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_stack(x, 3, 1);
}
static kiln_tensor *f_stack0(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_stack(x, 2, 0);
}
static kiln_tensor *f_cast_f64(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_cast(x[0], KILN_F64);
}
/* A chain of views, then a nonlinearity so the view's grad is not just R. */
static kiln_tensor *f_view_chain(kiln_tensor *const *x, const void *c)
{
  (void)c;
  kiln_tensor *v = kiln_reshape(x[0], 3, ((int64_t[]){2, 3, 4}));
  v = kiln_permute(v, ((int[]){1, 2, 0}));
  v = kiln_slice(v, 1, 1, 4, 2);
  return kiln_mul(v, v);
}

/* Context holding a non-differentiable tensor (indices, condition, targets). */
typedef struct {
  kiln_tensor *t;
  int dim;
} aux_t;

static kiln_tensor *f_where(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  return kiln_where(a->t, x[0], x[1]);
}
static kiln_tensor *f_index_select(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  return kiln_index_select(x[0], a->dim, a->t);
}
static kiln_tensor *f_embedding(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  return kiln_embedding(x[0], a->t);
}
static kiln_tensor *f_cross_entropy(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  return kiln_cross_entropy(x[0], a->t);
}
static kiln_tensor *f_gather(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  return kiln_gather(x[0], a->dim, a->t);
}
static kiln_tensor *f_scatter_add(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  return kiln_scatter_add(x[0], a->dim, a->t, x[1]);
}
static kiln_tensor *f_index_copy(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  return kiln_index_copy(x[0], a->dim, a->t, x[1]);
}
static kiln_tensor *f_tri(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_add(kiln_tril(x[0], 1), kiln_mul(kiln_triu(x[0], -1), x[0]));
}
static kiln_tensor *f_pad(kiln_tensor *const *x, const void *c)
{
  (void)c;
  kiln_tensor *p = kiln_pad(x[0], 4, ((int64_t[]){1, -1, 2, 0}), 0.5);
  return kiln_mul(p, p);
}
static kiln_tensor *f_cumsum(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  kiln_tensor *s = kiln_cumsum(x[0], a->dim);
  return kiln_mul(s, s);
}
static kiln_tensor *f_topk(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  kiln_tensor *v = NULL;
  if (kiln_topk(x[0], 2, a->dim, a->dim == 1, &v, NULL))
    return NULL;
  return kiln_mul(v, v);
}
static kiln_tensor *f_repeat(kiln_tensor *const *x, const void *c)
{
  (void)c;
  kiln_tensor *r = kiln_repeat(x[0], 3, ((int64_t[]){2, 1, 3}));
  return kiln_mul(r, kiln_sin(r));
}
static kiln_tensor *f_split(kiln_tensor *const *x, const void *c)
{
  (void)c;
  kiln_tensor *p[3];
  if (kiln_split(x[0], 2, 1, p) != 3)
    return NULL;
  return kiln_cat(((kiln_tensor *[]){kiln_mul(p[2], p[2]), kiln_exp(p[0]), p[1]}), 3, 1);
}
static kiln_tensor *f_logsumexp(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  return kiln_logsumexp(x[0], a->dim, a->dim == 0);
}
static kiln_tensor *f_max_all(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_add(kiln_max_all(x[0]), kiln_min_all(x[0]));
}
static kiln_tensor *f_masked_fill(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  return kiln_masked_fill(x[0], a->t, 3.0);
}
static kiln_tensor *f_rms_norm(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_rms_norm(x[0], x[1], 1e-5);
}
static kiln_tensor *f_group_norm(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_group_norm(x[0], 2, x[1], x[2], 1e-5);
}
static kiln_tensor *f_softmax(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  return kiln_softmax(x[0], a->dim);
}
static kiln_tensor *f_log_softmax(kiln_tensor *const *x, const void *c)
{
  const aux_t *a = c;
  return kiln_log_softmax(x[0], a->dim);
}
static kiln_tensor *f_layer_norm(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_layer_norm(x[0], x[1], x[2], 1e-5);
}
static kiln_tensor *f_layer_norm_plain(kiln_tensor *const *x, const void *c)
{
  (void)c;
  return kiln_layer_norm(x[0], NULL, NULL, 1e-5);
}

/* convolution, pooling, batch norm */
typedef struct {
  int s[2], p[2], d[2], groups;
  bool bias;
  kiln_tensor *rm, *rv; /* batch norm: running statistics (eval), or NULL */
  bool training;
} cnn_aux;
static kiln_tensor *f_conv2d(kiln_tensor *const *x, const void *c)
{
  const cnn_aux *a = c;
  return kiln_conv2d(x[0], x[1], a->bias ? x[2] : NULL, a->s, a->p, a->d, a->groups);
}
static kiln_tensor *f_conv1d(kiln_tensor *const *x, const void *c)
{
  const cnn_aux *a = c;
  return kiln_conv1d(x[0], x[1], a->bias ? x[2] : NULL, a->s[1], a->p[1], a->d[1], a->groups);
}
static kiln_tensor *f_max_pool2d(kiln_tensor *const *x, const void *c)
{
  const cnn_aux *a = c;
  return kiln_max_pool2d(x[0], (int[]){3, 3}, a->s, a->p);
}
static kiln_tensor *f_avg_pool2d(kiln_tensor *const *x, const void *c)
{
  const cnn_aux *a = c;
  return kiln_avg_pool2d(x[0], (int[]){3, 2}, a->s, a->p);
}
static kiln_tensor *f_adaptive_avg_pool2d(kiln_tensor *const *x, const void *c)
{
  const cnn_aux *a = c;
  return kiln_adaptive_avg_pool2d(x[0], a->s);
}
static kiln_tensor *f_batch_norm(kiln_tensor *const *x, const void *c)
{
  const cnn_aux *a = c;
  return kiln_batch_norm(x[0], a->rm, a->rv, a->bias ? x[1] : NULL, a->bias ? x[2] : NULL, a->training, 0.1, 1e-5);
}

/* Loss from views of one leaf: a transposed, strided slice and two
 * overlapping slices; the base leaf must collect all of it. */
static kiln_tensor *f_through_transpose_slice(kiln_tensor *const *x, const void *c)
{
  (void)c;
  kiln_tensor *s = kiln_slice(kiln_transpose(x[0], 0, 1), 1, 0, 4, 2); /* (3,2) of (4,3) */
  return kiln_mul(s, kiln_exp(s));
}
static kiln_tensor *f_through_overlapping(kiln_tensor *const *x, const void *c)
{
  (void)c;
  kiln_tensor *a = kiln_slice(x[0], 0, 0, 3, 1);
  kiln_tensor *b = kiln_slice(x[0], 0, 1, 4, 1);
  return kiln_mul(kiln_tanh(a), b);
}

/* ---- op gradients ----------------------------------------------------- */

START_TEST(test_binary_pointwise)
{
  in_t same[2] = {IN(D_ANY, 3, 4), IN(D_ANY, 3, 4)};
  in_t den[2] = {IN(D_ANY, 3, 4), IN(D_POS, 3, 4)};
  in_t powin[2] = {IN(D_POS, 3, 4), IN(D_ANY, 3, 4)};
  in_t apart[2] = {IN(D_ANY, 3, 4), IN(D_NONZERO, 3, 4)};
  gradcheck("add", f_add, NULL, 2, same);
  gradcheck("sub", f_sub, NULL, 2, same);
  gradcheck("mul", f_mul, NULL, 2, same);
  gradcheck("div", f_div, NULL, 2, den);
  gradcheck("pow", f_pow, NULL, 2, powin);
  gradcheck("maximum", f_maximum, NULL, 2, same);
  gradcheck("minimum", f_minimum, NULL, 2, same);
  gradcheck("maximum(a, a+d)", f_maximum_apart, NULL, 2, apart);
  gradcheck("minimum(a+d, a)", f_minimum_apart, NULL, 2, apart);
  gradcheck("fanout", f_fanout, NULL, 2, same);
}
END_TEST

START_TEST(test_unary_pointwise)
{
  static const struct {
    const char *name;
    fwd_fn f;
    int dom;
  } cases[] = {
      {"neg", f_neg, D_ANY},         {"abs", f_abs, D_NONZERO},       {"exp", f_exp, D_ANY},
      {"log", f_log, D_POS},         {"sqrt", f_sqrt, D_POS},         {"rsqrt", f_rsqrt, D_POS},
      {"tanh", f_tanh, D_ANY},       {"sigmoid", f_sigmoid, D_ANY},   {"relu", f_relu, D_NONZERO},
      {"gelu", f_gelu, D_NONZERO},   {"gelu_erf", f_gelu_erf, D_NONZERO}, {"erf", f_erf, D_ANY},
      {"sin", f_sin, D_NONZERO},     {"cos", f_cos, D_NONZERO},       {"silu", f_silu, D_ANY},
      {"softplus", f_softplus, D_ANY}, {"log1p", f_log1p, D_POS},   {"expm1", f_expm1, D_ANY},
      {"floor", f_floor, D_WIDE},    {"ceil", f_ceil, D_WIDE},        {"round", f_round, D_WIDE},
      {"sign", f_sign, D_NONZERO},   {"clamp", f_clamp, D_ANY},       {"leaky_relu", f_leaky_relu, D_NONZERO},
      {"scalar forms", f_scalar_ops, D_ANY}, {"softplus past 20", f_softplus_far, D_NONZERO},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    in_t in[1] = {IN(cases[i].dom, 2, 3, 2)};
    gradcheck(cases[i].name, cases[i].f, NULL, 1, in);
  }
  /* Larger |x| for the activations, where their tails matter. */
  in_t wide[1] = {IN(D_WIDE, 40)};
  gradcheck("gelu wide", f_gelu, NULL, 1, wide);
  gradcheck("gelu_erf wide", f_gelu_erf, NULL, 1, wide);
  gradcheck("tanh wide", f_tanh, NULL, 1, wide);
  gradcheck("sigmoid wide", f_sigmoid, NULL, 1, wide);
  gradcheck("relu wide", f_relu, NULL, 1, wide);
  gradcheck("silu wide", f_silu, NULL, 1, wide);
  gradcheck("softplus wide", f_softplus, NULL, 1, wide);
  gradcheck("expm1 wide", f_expm1, NULL, 1, wide);
}
END_TEST

START_TEST(test_where)
{
  kiln_scope_begin();
  bool cv[12];
  for (int i = 0; i < 12; i++)
    cv[i] = (i * 7) % 3 == 0;
  aux_t a = {kiln_tensor_from(KILN_BOOL, 2, ((int64_t[]){3, 4}), cv), 0};
  ck_assert_ptr_nonnull(a.t);
  in_t same[2] = {IN(D_ANY, 3, 4), IN(D_ANY, 3, 4)};
  gradcheck("where", f_where, &a, 2, same);

  /* cond (4,), a (3,4), b (3,1): b's gradient sums over the broadcast. */
  bool cb[4] = {true, false, false, true};
  aux_t ab = {kiln_tensor_from(KILN_BOOL, 1, (int64_t[]){4}, cb), 0};
  in_t bc[2] = {IN(D_ANY, 3, 4), IN(D_ANY, 3, 1)};
  gradcheck("where broadcast", f_where, &ab, 2, bc);
  kiln_scope_end();
}
END_TEST

START_TEST(test_broadcast_grads)
{
  in_t outer[2] = {IN(D_ANY, 3, 1), IN(D_ANY, 1, 4)};
  gradcheck("add (3,1)+(1,4)", f_add, NULL, 2, outer);
  in_t trail[2] = {IN(D_ANY, 2, 3, 4), IN(D_ANY, 4)};
  gradcheck("mul (2,3,4)*(4)", f_mul, NULL, 2, trail);
  in_t scal[2] = {IN(D_ANY, 2, 3), IN0(D_ANY)};
  gradcheck("add (2,3)+()", f_add, NULL, 2, scal);
  in_t scal_l[2] = {IN0(D_ANY), IN(D_ANY, 2, 3)};
  gradcheck("mul ()*(2,3)", f_mul, NULL, 2, scal_l);
  in_t rank[2] = {IN(D_ANY, 4), IN(D_ANY, 3, 1)};
  gradcheck("sub (4)-(3,1)", f_sub, NULL, 2, rank);
  in_t dv[2] = {IN(D_ANY, 2, 1, 3), IN(D_POS, 4, 1)};
  gradcheck("div (2,1,3)/(4,1)", f_div, NULL, 2, dv);
  in_t pw[2] = {IN(D_POS, 2, 3), IN(D_ANY, 3)};
  gradcheck("pow (2,3)**(3)", f_pow, NULL, 2, pw);
  in_t both0[2] = {IN0(D_ANY), IN0(D_ANY)};
  gradcheck("mul ()*()", f_mul, NULL, 2, both0);
}
END_TEST

START_TEST(test_reductions)
{
  static const struct {
    const char *name;
    fwd_fn f;
    int corr;
  } ops[] = {
      {"sum", f_sum, 0}, {"mean", f_mean, 0}, {"max", f_max, 0},
      {"min", f_min, 0}, {"var0", f_var, 0},  {"var1", f_var, 1},
  };
  static const red_t cfgs[] = {
      {false, 0, {0}, 0, false, 0},        {false, 1, {0}, 0, true, 0},
      {false, -1, {0}, 0, false, 0},       {false, 2, {0}, 0, true, 0},
      {true, 0, {0, 2}, 2, false, 0},      {true, 0, {-1, 0}, 2, true, 0},
      {true, 0, {1}, 1, false, 0},         {true, 0, {0}, 0, false, 0},
      {true, 0, {0}, 0, true, 0},
  };
  in_t in[1] = {IN(D_DISTINCT, 3, 4, 5)};
  for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++) {
    for (size_t k = 0; k < sizeof cfgs / sizeof cfgs[0]; k++) {
      red_t r = cfgs[k];
      r.corr = ops[o].corr;
      char name[96];
      if (r.list)
        snprintf(name, sizeof name, "%s axes={%d,%d}[:%d] keepdim=%d", ops[o].name, r.axes[0], r.axes[1], r.naxes,
                 r.keep);
      else
        snprintf(name, sizeof name, "%s axis=%d keepdim=%d", ops[o].name, r.axis, r.keep);
      gradcheck(name, ops[o].f, &r, 1, in);
    }
  }
  in_t small[1] = {IN(D_ANY, 2, 3)};
  gradcheck("sum_all", f_sum_all, NULL, 1, small);
  gradcheck("mean_all", f_mean_all, NULL, 1, small);
}
END_TEST

START_TEST(test_matmul)
{
  in_t vv[2] = {IN(D_ANY, 4), IN(D_ANY, 4)};
  gradcheck("matmul (4)@(4)", f_matmul, NULL, 2, vv);
  in_t mm[2] = {IN(D_ANY, 3, 4), IN(D_ANY, 4, 5)};
  gradcheck("matmul (3,4)@(4,5)", f_matmul, NULL, 2, mm);
  in_t vm[2] = {IN(D_ANY, 4), IN(D_ANY, 4, 5)};
  gradcheck("matmul (4)@(4,5)", f_matmul, NULL, 2, vm);
  in_t mv[2] = {IN(D_ANY, 3, 4), IN(D_ANY, 4)};
  gradcheck("matmul (3,4)@(4)", f_matmul, NULL, 2, mv);
  in_t bb[2] = {IN(D_ANY, 2, 1, 3, 4), IN(D_ANY, 3, 4, 2)};
  gradcheck("matmul (2,1,3,4)@(3,4,2)", f_matmul, NULL, 2, bb);
  in_t b2[2] = {IN(D_ANY, 3, 4), IN(D_ANY, 2, 4, 5)};
  gradcheck("matmul (3,4)@(2,4,5)", f_matmul, NULL, 2, b2);
  in_t bv[2] = {IN(D_ANY, 2, 3, 4), IN(D_ANY, 4)};
  gradcheck("matmul (2,3,4)@(4)", f_matmul, NULL, 2, bv);
  /* a matrix shared by a batch: its gradient is one GEMM over the stacked rows */
  in_t bm[2] = {IN(D_ANY, 2, 3, 4), IN(D_ANY, 4, 5)};
  gradcheck("matmul (2,3,4)@(4,5)", f_matmul, NULL, 2, bm);
  in_t bm4[2] = {IN(D_ANY, 2, 2, 3, 4), IN(D_ANY, 4, 5)};
  gradcheck("matmul (2,2,3,4)@(4,5)", f_matmul, NULL, 2, bm4);
  in_t btb[2] = {IN(D_ANY, 2, 3, 4), IN(D_ANY, 5, 4)};
  gradcheck("matmul (2,3,4)@(5,4)^T", f_matmul_tb, NULL, 2, btb);
  /* a batched operand that is a transposed view: copied into rows (T=3 <= N=5),
   * or, when the copy would be larger (T=6 > N=2), B products summed */
  in_t bta[2] = {IN(D_ANY, 2, 4, 3), IN(D_ANY, 4, 5)};
  gradcheck("matmul (2,4,3)^T@(4,5)", f_matmul_ta3, NULL, 2, bta);
  in_t btl[2] = {IN(D_ANY, 2, 4, 6), IN(D_ANY, 4, 2)};
  gradcheck("matmul (2,4,6)^T@(4,2)", f_matmul_ta3, NULL, 2, btl);
  in_t ta[2] = {IN(D_ANY, 4, 3), IN(D_ANY, 4, 5)};
  gradcheck("matmul (4,3)^T@(4,5)", f_matmul_ta, NULL, 2, ta);
  in_t tb[2] = {IN(D_ANY, 3, 4), IN(D_ANY, 5, 4)};
  gradcheck("matmul (3,4)@(5,4)^T", f_matmul_tb, NULL, 2, tb);
  in_t qk[2] = {IN(D_ANY, 2, 3, 4), IN(D_ANY, 2, 5, 4)};
  gradcheck("matmul q@k^T", f_matmul_qk, NULL, 2, qk);
}
END_TEST

/* x (B,T,C) @ w (C,N) with B*T rows of width 16: w's gradient is one GEMM
 * of the stacked rows, so the backward never holds a (B,C,N) product per
 * batch element (64 of them here, 4 MiB); the gradient matches the sum in
 * double. */
START_TEST(test_shared_matrix_grad_one_gemm)
{
  enum { B = 64, T = 2, C = 128, N = 128 };
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 3, ((int64_t[]){B, T, C}), 31), *w = kiln_randn(KILN_F32, 2, ((int64_t[]){C, N}), 32);
  kiln_tensor *r = kiln_randn(KILN_F32, 3, ((int64_t[]){B, T, N}), 33);
  kiln_requires_grad(w, true);
  kiln_tensor *loss = kiln_sum_all(kiln_mul(kiln_matmul(x, w), r));
  size_t before = kiln_mem_in_use();
  kiln_mem_reset_peak();
  ck_assert_int_eq(0, kiln_backward(loss));
  size_t extra = kiln_mem_peak() - before, product = (size_t)B * C * N * sizeof(float);
  ck_assert_msg(extra < product / 4, "backward peaked %zu bytes above its start; a per-batch product is %zu", extra, product);
  static float xs[B * T * C], rs[B * T * N], gw[C * N];
  ck_assert_int_eq(0, kiln_read(x, xs, sizeof xs));
  ck_assert_int_eq(0, kiln_read(r, rs, sizeof rs));
  ck_assert_int_eq(0, kiln_read(kiln_grad(w), gw, sizeof gw));
  double worst = 0;
  for (int c = 0; c < C; c++)
    for (int n = 0; n < N; n++) {
      double want = 0, mag = 0;
      for (int i = 0; i < B * T; i++) want += (double)xs[i * C + c] * rs[i * N + n], mag += fabs((double)xs[i * C + c] * rs[i * N + n]);
      double err = fabs(gw[c * N + n] - want) / (mag + 1e-30);
      if (err > worst) worst = err;
    }
  ck_assert_msg(worst < 1e-5, "w's gradient: relative error %g", worst);
  /* a loss that sums the product directly: its gradient arrives expanded
   * (stride 0), and is copied into rows (T=2 <= C) rather than summed from
   * per-batch products */
  kiln_zero_grad(w);
  loss = kiln_sum_all(kiln_matmul(x, w));
  before = kiln_mem_in_use();
  kiln_mem_reset_peak();
  ck_assert_int_eq(0, kiln_backward(loss));
  extra = kiln_mem_peak() - before;
  ck_assert_msg(extra < product / 4, "expanded gradient: backward peaked %zu bytes above its start", extra);
  ck_assert_int_eq(0, kiln_read(kiln_grad(w), gw, sizeof gw));
  worst = 0;
  for (int c = 0; c < C; c++) {
    double want = 0, mag = 0;
    for (int i = 0; i < B * T; i++) want += xs[i * C + c], mag += fabs(xs[i * C + c]);
    for (int n = 0; n < N; n++) worst = fmax(worst, fabs(gw[c * N + n] - want) / (mag + 1e-30));
  }
  ck_assert_msg(worst < 1e-5, "w's gradient of the plain sum: relative error %g", worst);
  kiln_scope_end();
}
END_TEST

START_TEST(test_views)
{
  shape_t rs = {3, {2, -1, 3}};
  in_t m34[1] = {IN(D_ANY, 3, 4)};
  gradcheck("reshape (3,4)->(2,-1,3)", f_reshape, &rs, 1, m34);
  gradcheck("reshape of transpose", f_reshape_of_transpose, NULL, 1, m34);
  gradcheck("transpose 0,1", f_transpose01, NULL, 1, m34);
  in_t t234[1] = {IN(D_ANY, 2, 3, 4)};
  gradcheck("transpose 0,2", f_transpose02, NULL, 1, t234);
  gradcheck("permute 2,0,1", f_permute, NULL, 1, t234);
  shape_t es = {3, {2, 3, 4}};
  in_t e31[1] = {IN(D_ANY, 3, 1)};
  gradcheck("expand (3,1)->(2,3,4)", f_expand, &es, 1, e31);
  in_t s314[1] = {IN(D_ANY, 3, 1, 4)};
  gradcheck("squeeze 1", f_squeeze1, NULL, 1, s314);
  gradcheck("unsqueeze 1", f_unsqueeze1, NULL, 1, m34);
  gradcheck("unsqueeze last", f_unsqueeze_last, NULL, 1, m34);
  in_t s73[1] = {IN(D_ANY, 7, 3)};
  gradcheck("slice step 2", f_slice_step2, NULL, 1, s73);
  in_t s35[1] = {IN(D_ANY, 3, 5)};
  gradcheck("slice negative start", f_slice_negstart, NULL, 1, s35);
  gradcheck("contiguous of transpose", f_contiguous_t, NULL, 1, m34);
  in_t c1[3] = {IN(D_ANY, 2, 3), IN(D_ANY, 2, 1), IN(D_ANY, 2, 2)};
  gradcheck("cat dim 1", f_cat1, NULL, 3, c1);
  in_t c0[2] = {IN(D_ANY, 1, 3), IN(D_ANY, 2, 3)};
  gradcheck("cat dim 0", f_cat0, NULL, 2, c0);
  in_t st[3] = {IN(D_ANY, 2, 3), IN(D_ANY, 2, 3), IN(D_ANY, 2, 3)};
  gradcheck("stack dim 1", f_stack1, NULL, 3, st);
  gradcheck("stack dim 0", f_stack0, NULL, 2, st);
  gradcheck("cast f64->f64", f_cast_f64, NULL, 1, m34);
  in_t flat[1] = {IN(D_ANY, 24)};
  gradcheck("reshape/permute/slice chain", f_view_chain, NULL, 1, flat);
}
END_TEST

START_TEST(test_cast_roundtrip)
{
  /* f64 -> f32 -> f64 loses precision, so no finite differences: the grad of
   * sum(cast(cast(x)) * R) is R, up to f32 rounding. */
  kiln_scope_begin();
  double xv[5] = {0.1, -2.5, 3.25, 1e-3, 7.0}, rv[5] = {0.3, -1.1, 2.0, 0.7, -0.2};
  kiln_tensor *x = kiln_tensor_from(KILN_F64, 1, (int64_t[]){5}, xv);
  kiln_requires_grad(x, true);
  kiln_tensor *r = kiln_tensor_from(KILN_F64, 1, (int64_t[]){5}, rv);
  kiln_tensor *y = kiln_cast(kiln_cast(x, KILN_F32), KILN_F64);
  ck_assert_ptr_nonnull(y);
  ck_assert_int_eq(KILN_F64, kiln_type(y));
  ck_assert_int_eq(0, kiln_backward(kiln_sum_all(kiln_mul(y, r))));
  kiln_tensor *g = kiln_grad(x);
  ck_assert_ptr_nonnull(g);
  ck_assert_int_eq(KILN_F64, kiln_type(g));
  double gv[5];
  ck_assert_int_eq(0, kiln_read(g, gv, sizeof gv));
  for (int i = 0; i < 5; i++)
    ck_assert_msg(fabs(gv[i] - rv[i]) <= 1e-6 * fabs(rv[i]), "at %d: %g vs %g", i, gv[i], rv[i]);

  /* f32 leaves get f32 gradients: d sum(x*x) = 2x. */
  float fv[4] = {1.5f, -0.25f, 2.0f, 0.0f};
  kiln_tensor *xf = kiln_tensor_from(KILN_F32, 1, (int64_t[]){4}, fv);
  kiln_requires_grad(xf, true);
  ck_assert_int_eq(0, kiln_backward(kiln_sum_all(kiln_mul(xf, xf))));
  kiln_tensor *gf = kiln_grad(xf);
  ck_assert_ptr_nonnull(gf);
  ck_assert_int_eq(KILN_F32, kiln_type(gf));
  float gfv[4];
  ck_assert_int_eq(0, kiln_read(gf, gfv, sizeof gfv));
  for (int i = 0; i < 4; i++)
    ck_assert_msg(fabsf(gfv[i] - 2 * fv[i]) <= 1e-6f, "at %d: %g vs %g", i, gfv[i], 2 * fv[i]);
  kiln_scope_end();
}
END_TEST

START_TEST(test_index_ops)
{
  kiln_scope_begin();
  /* Repeated indices: the table rows they pick must sum their gradients. */
  int64_t iv[5] = {2, 0, 2, 3, 2};
  aux_t rows = {kiln_tensor_from(KILN_I64, 1, (int64_t[]){5}, iv), 0};
  in_t a43[1] = {IN(D_ANY, 4, 3)};
  gradcheck("index_select dim 0", f_index_select, &rows, 1, a43);
  int64_t jv[3] = {3, 3, 1};
  aux_t cols = {kiln_tensor_from(KILN_I64, 1, (int64_t[]){3}, jv), 1};
  in_t a34[1] = {IN(D_ANY, 3, 4)};
  gradcheck("index_select dim 1", f_index_select, &cols, 1, a34);
  int64_t ev[6] = {1, 3, 1, 4, 1, 0};
  aux_t emb = {kiln_tensor_from(KILN_I64, 2, ((int64_t[]){2, 3}), ev), 0};
  in_t table[1] = {IN(D_ANY, 5, 3)};
  gradcheck("embedding (2,3) idx", f_embedding, &emb, 1, table);

  /* gather with repeats (the gradient adds up), scatter_add into x and from src */
  int64_t gv[6] = {0, 3, 3, 1, 0, 0};
  aux_t gi = {kiln_tensor_from(KILN_I64, 2, ((int64_t[]){2, 3}), gv), 1};
  in_t g34[1] = {IN(D_ANY, 3, 4)};
  gradcheck("gather dim 1", f_gather, &gi, 1, g34);
  in_t sa[2] = {IN(D_ANY, 3, 4), IN(D_ANY, 2, 3)};
  gradcheck("scatter_add dim 1", f_scatter_add, &gi, 2, sa);
  int64_t cv[2] = {2, 0};
  aux_t ci = {kiln_tensor_from(KILN_I64, 1, (int64_t[]){2}, cv), 0};
  in_t ic[2] = {IN(D_ANY, 3, 4), IN(D_ANY, 2, 4)};
  gradcheck("index_copy dim 0", f_index_copy, &ci, 2, ic);
  in_t t345[1] = {IN(D_ANY, 2, 3, 4)};
  gradcheck("tril, triu", f_tri, NULL, 1, t345);
  gradcheck("pad, crop", f_pad, NULL, 1, t345);
  aux_t c1 = {NULL, 1}, c2 = {NULL, 2};
  gradcheck("cumsum dim 1", f_cumsum, &c1, 1, t345);
  gradcheck("cumsum dim 2", f_cumsum, &c2, 1, t345);
  in_t d45[1] = {IN(D_DISTINCT, 4, 5)};
  gradcheck("topk largest dim 1", f_topk, &c1, 1, d45);
  aux_t c0 = {NULL, 0};
  gradcheck("topk smallest dim 0", f_topk, &c0, 1, d45);
  in_t r23[1] = {IN(D_ANY, 2, 3)};
  gradcheck("repeat", f_repeat, NULL, 1, r23);
  in_t s35[1] = {IN(D_ANY, 3, 5)};
  gradcheck("split", f_split, NULL, 1, s35);
  kiln_scope_end();
}
END_TEST

START_TEST(test_nn_ops)
{
  kiln_scope_begin();
  aux_t ax1 = {NULL, 1}, ax0 = {NULL, 0};
  in_t m35[1] = {IN(D_ANY, 3, 5)};
  gradcheck("softmax axis 1", f_softmax, &ax1, 1, m35);
  gradcheck("softmax axis 0", f_softmax, &ax0, 1, m35);
  gradcheck("log_softmax axis 1", f_log_softmax, &ax1, 1, m35);
  gradcheck("log_softmax axis 0", f_log_softmax, &ax0, 1, m35);
  in_t t234[1] = {IN(D_ANY, 2, 3, 4)};
  gradcheck("softmax (2,3,4) axis 1", f_softmax, &ax1, 1, t234);

  in_t ln[3] = {IN(D_ANY, 3, 6), IN(D_POS, 6), IN(D_ANY, 6)};
  gradcheck("layer_norm x,w,b", f_layer_norm, NULL, 3, ln);
  in_t ln3[3] = {IN(D_ANY, 2, 3, 4), IN(D_POS, 4), IN(D_ANY, 4)};
  gradcheck("layer_norm (2,3,4)", f_layer_norm, NULL, 3, ln3);
  in_t lnp[1] = {IN(D_ANY, 3, 6)};
  gradcheck("layer_norm without affine", f_layer_norm_plain, NULL, 1, lnp);

  int64_t tv[4] = {1, 0, 4, 1};
  aux_t tg = {kiln_tensor_from(KILN_I64, 1, (int64_t[]){4}, tv), 0};
  in_t logits[1] = {IN(D_ANY, 4, 5)};
  gradcheck("cross_entropy", f_cross_entropy, &tg, 1, logits);
  in_t mse[2] = {IN(D_ANY, 3, 4), IN(D_ANY, 3, 4)};
  gradcheck("mse_loss", f_mse_loss, NULL, 2, mse);

  gradcheck("logsumexp axis 1", f_logsumexp, &ax1, 1, m35);
  gradcheck("logsumexp axis 0, keepdim", f_logsumexp, &ax0, 1, m35);
  in_t distinct[1] = {IN(D_DISTINCT, 3, 4)};
  gradcheck("max_all + min_all", f_max_all, NULL, 1, distinct);
  bool mv[4] = {true, false, false, true};
  aux_t mk = {kiln_tensor_from(KILN_BOOL, 1, (int64_t[]){4}, mv), 0};
  in_t x34[1] = {IN(D_ANY, 3, 4)};
  gradcheck("masked_fill", f_masked_fill, &mk, 1, x34);
  in_t rms[2] = {IN(D_ANY, 2, 3, 6), IN(D_POS, 6)};
  gradcheck("rms_norm", f_rms_norm, NULL, 2, rms);
  in_t gn[3] = {IN(D_ANY, 2, 4, 3), IN(D_POS, 4), IN(D_ANY, 4)};
  gradcheck("group_norm", f_group_norm, NULL, 3, gn);
  kiln_scope_end();
}
END_TEST

/* Every input of conv2d, conv1d, the pools and batch norm, against finite
 * differences: odd sizes, strides, dilations, groups (depthwise), 1x1, and
 * images that share a GEMM. */
START_TEST(test_cnn_ops)
{
  kiln_scope_begin();
  cnn_aux c1 = {.s = {1, 1}, .p = {1, 1}, .d = {1, 1}, .groups = 1, .bias = true};
  in_t k3[3] = {IN(D_ANY, 2, 3, 5, 4), IN(D_ANY, 4, 3, 3, 3), IN(D_ANY, 4)};
  gradcheck("conv2d 3x3 padding 1, bias", f_conv2d, &c1, 3, k3);
  cnn_aux c2 = {.s = {2, 1}, .p = {1, 2}, .d = {2, 1}, .groups = 2};
  in_t kg[2] = {IN(D_ANY, 1, 4, 7, 6), IN(D_ANY, 4, 2, 2, 3)};
  gradcheck("conv2d stride, dilation, groups 2", f_conv2d, &c2, 2, kg);
  cnn_aux c3 = {.s = {2, 1}, .p = {1, 0}, .d = {1, 1}, .groups = 3, .bias = true};
  in_t dw[3] = {IN(D_ANY, 2, 3, 5, 5), IN(D_ANY, 3, 1, 3, 3), IN(D_ANY, 3)};
  gradcheck("conv2d depthwise", f_conv2d, &c3, 3, dw);
  cnn_aux c4 = {.s = {1, 1}, .p = {0, 0}, .d = {1, 1}, .groups = 1};
  in_t pw[2] = {IN(D_ANY, 2, 3, 4, 4), IN(D_ANY, 5, 3, 1, 1)};
  gradcheck("conv2d 1x1", f_conv2d, &c4, 2, pw);
  cnn_aux c5 = {.s = {1, 1}, .p = {1, 1}, .d = {1, 1}, .groups = 2};
  in_t many[2] = {IN(D_ANY, 3, 8, 3, 3), IN(D_ANY, 8, 4, 3, 3)};
  gradcheck("conv2d images sharing a GEMM", f_conv2d, &c5, 2, many);
  cnn_aux c6 = {.s = {1, 2}, .p = {0, 1}, .d = {1, 2}, .groups = 1, .bias = true};
  in_t k1[3] = {IN(D_ANY, 2, 3, 9), IN(D_ANY, 4, 3, 3), IN(D_ANY, 4)};
  gradcheck("conv1d", f_conv1d, &c6, 3, k1);

  cnn_aux p1 = {.s = {2, 2}, .p = {1, 1}};
  in_t px[1] = {IN(D_DISTINCT, 2, 2, 5, 6)};
  gradcheck("max_pool2d 3x3 stride 2 padding 1", f_max_pool2d, &p1, 1, px);
  cnn_aux p2 = {.s = {1, 2}, .p = {1, 0}};
  in_t ax[1] = {IN(D_ANY, 2, 3, 5, 6)};
  gradcheck("avg_pool2d 3x2", f_avg_pool2d, &p2, 1, ax);
  cnn_aux p3 = {.s = {3, 2}}, p4 = {.s = {1, 1}};
  in_t ad[1] = {IN(D_ANY, 2, 2, 7, 5)};
  gradcheck("adaptive_avg_pool2d (3,2)", f_adaptive_avg_pool2d, &p3, 1, ad);
  gradcheck("adaptive_avg_pool2d (1,1)", f_adaptive_avg_pool2d, &p4, 1, ad);

  in_t bn[3] = {IN(D_ANY, 3, 2, 2, 3), IN(D_POS, 2), IN(D_ANY, 2)};
  cnn_aux b1 = {.bias = true, .training = true};
  gradcheck("batch_norm training, affine", f_batch_norm, &b1, 3, bn);
  cnn_aux b2 = {.training = true, .rm = kiln_zeros(KILN_F64, 1, (int64_t[]){2}), .rv = kiln_ones(KILN_F64, 1, (int64_t[]){2})};
  gradcheck("batch_norm training, running statistics", f_batch_norm, &b2, 1, bn);
  cnn_aux b3 = {.bias = true, .rm = kiln_tensor_from(KILN_F64, 1, (int64_t[]){2}, (double[]){0.3, -0.2}),
                .rv = kiln_tensor_from(KILN_F64, 1, (int64_t[]){2}, (double[]){0.5, 2})};
  gradcheck("batch_norm eval", f_batch_norm, &b3, 3, bn);
  kiln_scope_end();
}
END_TEST

START_TEST(test_through_views)
{
  in_t b43[1] = {IN(D_ANY, 4, 3)};
  gradcheck("transposed strided slice of a leaf", f_through_transpose_slice, NULL, 1, b43);
  in_t b4[1] = {IN(D_ANY, 4, 2)};
  gradcheck("overlapping slices of a leaf", f_through_overlapping, NULL, 1, b4);
}
END_TEST

START_TEST(test_grad_of_matches_fd)
{
  in_t mm[2] = {IN(D_ANY, 3, 4), IN(D_ANY, 4, 5)};
  gradcheck_via("grad_of matmul", f_matmul, NULL, 2, mm, VIA_GRAD_OF);
  in_t ln[3] = {IN(D_ANY, 3, 6), IN(D_POS, 6), IN(D_ANY, 6)};
  gradcheck_via("grad_of layer_norm", f_layer_norm, NULL, 3, ln, VIA_GRAD_OF);
  in_t trail[2] = {IN(D_ANY, 2, 3, 4), IN(D_ANY, 4)};
  gradcheck_via("grad_of mul broadcast", f_mul, NULL, 2, trail, VIA_GRAD_OF);
  aux_t ax1 = {NULL, 1};
  in_t m35[1] = {IN(D_ANY, 3, 5)};
  gradcheck_via("grad_of log_softmax", f_log_softmax, &ax1, 1, m35, VIA_GRAD_OF);
}
END_TEST

/* ---- engine rules ----------------------------------------------------- */

static void read_f64(kiln_tensor *t, double *dst, int64_t n)
{
  ck_assert_ptr_nonnull(t);
  ck_assert_int_eq(n, kiln_numel(t));
  ck_assert_int_eq(0, kiln_read(t, dst, (size_t)n * sizeof(double)));
}

static void assert_close(const double *want, const double *got, int n, double tol, const char *what)
{
  for (int i = 0; i < n; i++)
    ck_assert_msg(fabs(want[i] - got[i]) <= tol * (1 + fabs(want[i])), "%s at %d: expected %.12g, got %.12g", what,
                  i, want[i], got[i]);
}

static const double XV[4] = {0.5, -1.0, 2.0, 3.0};

static kiln_tensor *leaf4(void)
{
  kiln_tensor *x = kiln_tensor_from(KILN_F64, 1, (int64_t[]){4}, XV);
  ck_assert_ptr_nonnull(x);
  kiln_requires_grad(x, true);
  return x;
}

/* 0.5 * sum(x*x): gradient x. */
static kiln_tensor *half_sq(kiln_tensor *x) { return kiln_mul(kiln_scalar(KILN_F64, 0.5), kiln_sum_all(kiln_mul(x, x))); }

START_TEST(test_accumulate_and_zero_grad)
{
  kiln_scope_begin();
  kiln_tensor *x = leaf4();
  ck_assert_ptr_null(kiln_grad(x));
  ck_assert_int_eq(0, kiln_backward(half_sq(x)));
  ck_assert_int_eq(0, kiln_backward(half_sq(x)));
  double g[4], want[4];
  for (int i = 0; i < 4; i++)
    want[i] = 2 * XV[i];
  read_f64(kiln_grad(x), g, 4);
  assert_close(want, g, 4, 1e-12, "grad after two backward calls");

  kiln_zero_grad(x);
  ck_assert_ptr_null(kiln_grad(x));
  ck_assert_int_eq(0, kiln_backward(half_sq(x)));
  read_f64(kiln_grad(x), g, 4);
  assert_close(XV, g, 4, 1e-12, "grad after zero_grad and one backward");
  kiln_scope_end();
}
END_TEST

START_TEST(test_backward_twice_fails)
{
  kiln_scope_begin();
  kiln_tensor *x = leaf4();
  kiln_tensor *loss = half_sq(x);
  ck_assert_int_eq(0, kiln_backward(loss));
  kiln_clear_error();
  ck_assert_int_eq(-1, kiln_backward(loss));
  const char *e = kiln_last_error();
  ck_assert_msg(strstr(e, "backward") != NULL, "error \"%s\" does not mention backward", e);
  /* The failed call must not have added anything. */
  double g[4];
  read_f64(kiln_grad(x), g, 4);
  assert_close(XV, g, 4, 1e-12, "grad after a refused second backward");
  kiln_scope_end();
}
END_TEST

START_TEST(test_backward_nonscalar_fails)
{
  kiln_scope_begin();
  kiln_tensor *x = leaf4();
  kiln_tensor *y = kiln_mul(x, x);
  kiln_clear_error();
  ck_assert_int_eq(-1, kiln_backward(y));
  ck_assert_msg(strstr(kiln_last_error(), "kiln_backward") != NULL, "error: \"%s\"", kiln_last_error());
  ck_assert_ptr_null(kiln_grad(x));
  kiln_scope_end();
}
END_TEST

START_TEST(test_backward_with)
{
  kiln_scope_begin();
  double xv[6] = {0.5, -1, 2, 1.5, -0.25, 3}, gv[6] = {1, -2, 0.5, 3, 0, -1};
  kiln_tensor *x = kiln_tensor_from(KILN_F64, 2, ((int64_t[]){2, 3}), xv);
  kiln_requires_grad(x, true);
  kiln_tensor *gout = kiln_tensor_from(KILN_F64, 2, ((int64_t[]){2, 3}), gv);
  kiln_tensor *y = kiln_mul(x, kiln_sin(x)); /* dy/dx = sin x + x cos x */
  ck_assert_int_eq(0, kiln_backward_with(y, gout));
  double g[6], want[6];
  for (int i = 0; i < 6; i++)
    want[i] = gv[i] * (sin(xv[i]) + xv[i] * cos(xv[i]));
  read_f64(kiln_grad(x), g, 6);
  assert_close(want, g, 6, 1e-12, "backward_with");
  kiln_scope_end();
}
END_TEST

START_TEST(test_grad_of_rules)
{
  kiln_scope_begin();
  double wv[3] = {0.3, -1.2, 2.0}, xv[3] = {1.5, 2.0, -0.5};
  kiln_tensor *w = kiln_tensor_from(KILN_F64, 1, (int64_t[]){3}, wv);
  kiln_tensor *x = kiln_tensor_from(KILN_F64, 1, (int64_t[]){3}, xv);
  kiln_tensor *u = kiln_zeros(KILN_F64, 2, ((int64_t[]){2, 2}));
  kiln_requires_grad(w, true);
  kiln_requires_grad(u, true);
  kiln_tensor *out = kiln_sum_all(kiln_mul(kiln_sin(w), x));
  ck_assert_ptr_nonnull(out);

  double want[3];
  for (int i = 0; i < 3; i++)
    want[i] = cos(wv[i]) * xv[i];
  for (int rep = 0; rep < 2; rep++) { /* the graph is kept, and nothing accumulates */
    kiln_tensor *g[2] = {NULL, NULL};
    ck_assert_int_eq(0, kiln_grad_of(out, ((kiln_tensor *[]){w, u}), 2, g));
    double gw[3], gu[4];
    read_f64(g[0], gw, 3);
    assert_close(want, gw, 3, 1e-12, "grad_of w");
    ck_assert_int_eq(2, kiln_ndim(g[1]));
    ck_assert_int_eq(2, kiln_size(g[1], 0));
    ck_assert_int_eq(2, kiln_size(g[1], 1));
    read_f64(g[1], gu, 4);
    for (int i = 0; i < 4; i++)
      ck_assert_double_eq(0.0, gu[i]);
    ck_assert_ptr_null(kiln_grad(w));
    ck_assert_ptr_null(kiln_grad(u));
  }
  /* Still usable by backward afterwards. */
  ck_assert_int_eq(0, kiln_backward(out));
  double gw[3];
  read_f64(kiln_grad(w), gw, 3);
  assert_close(want, gw, 3, 1e-12, "backward after grad_of");
  kiln_scope_end();
}
END_TEST

START_TEST(test_no_grad)
{
  kiln_scope_begin();
  kiln_tensor *x = leaf4();
  ck_assert(kiln_grad_enabled());
  kiln_tensor *z = kiln_mul(x, x);
  ck_assert(kiln_get_requires_grad(z));
  ck_assert(!kiln_get_requires_grad(kiln_mul(kiln_ones(KILN_F64, 1, (int64_t[]){4}), kiln_scalar(KILN_F64, 2))));

  kiln_no_grad_begin();
  ck_assert(!kiln_grad_enabled());
  kiln_tensor *y = kiln_exp(kiln_mul(x, x));
  ck_assert_ptr_nonnull(y);
  ck_assert(!kiln_get_requires_grad(y));
  ck_assert(kiln_get_requires_grad(x)); /* the leaf keeps its flag */
  kiln_no_grad_begin();
  kiln_no_grad_end();
  ck_assert(!kiln_grad_enabled()); /* nested: still off */
  kiln_no_grad_end();
  ck_assert(kiln_grad_enabled());

  kiln_tensor *loss = kiln_sum_all(y);
  ck_assert(!kiln_get_requires_grad(loss));
  int rc = kiln_backward(loss);
  ck_assert_msg(rc == -1 || kiln_grad(x) == NULL, "backward through a no-grad result reached the leaf");
  kiln_scope_end();
}
END_TEST

START_TEST(test_inplace_on_leaf)
{
  kiln_scope_begin();
  kiln_tensor *w = leaf4();
  kiln_tensor *one = kiln_ones(KILN_F64, 1, (int64_t[]){4});
  kiln_clear_error();
  ck_assert_ptr_null(kiln_add_(w, one));
  ck_assert_msg(strstr(kiln_last_error(), "kiln_add_") != NULL, "error: \"%s\"", kiln_last_error());
  double v[4];
  read_f64(w, v, 4);
  assert_close(XV, v, 4, 0, "leaf after a refused add_");

  kiln_no_grad_begin();
  ck_assert_ptr_eq(w, kiln_add_(w, one));
  kiln_no_grad_end();
  double want[4];
  for (int i = 0; i < 4; i++)
    want[i] = XV[i] + 1;
  read_f64(w, v, 4);
  assert_close(want, v, 4, 0, "leaf after add_ under no-grad");
  ck_assert(kiln_get_requires_grad(w));
  kiln_scope_end();
}
END_TEST

START_TEST(test_sgd_step)
{
  kiln_scope_begin();
  kiln_tensor *w = leaf4();
  kiln_tensor *lr = kiln_scalar(KILN_F64, 0.1);
  double cur[4], want[4], v[4];
  memcpy(cur, XV, sizeof cur);
  for (int step = 0; step < 3; step++) {
    kiln_scope_begin();
    ck_assert_int_eq(0, kiln_backward(half_sq(w))); /* grad = w */
    kiln_no_grad_begin();
    ck_assert_ptr_eq(w, kiln_sub_(w, kiln_mul(lr, kiln_grad(w))));
    kiln_no_grad_end();
    kiln_zero_grad(w);
    kiln_scope_end();
    for (int i = 0; i < 4; i++)
      want[i] = cur[i] - 0.1 * cur[i];
    memcpy(cur, want, sizeof cur);
    read_f64(w, v, 4);
    assert_close(want, v, 4, 1e-12, "w after an SGD step");
    ck_assert_ptr_null(kiln_grad(w));
    ck_assert(kiln_get_requires_grad(w));
  }
  kiln_scope_end();
}
END_TEST

START_TEST(test_nondifferentiable_outputs)
{
  kiln_scope_begin();
  kiln_tensor *x = leaf4();
  kiln_tensor *y = kiln_full(KILN_F64, 1, (int64_t[]){4}, 1.0);
  kiln_tensor *cmp[] = {kiln_eq(x, y), kiln_ne(x, y), kiln_lt(x, y), kiln_le(x, y), kiln_gt(x, y), kiln_ge(x, y)};
  for (size_t i = 0; i < sizeof cmp / sizeof cmp[0]; i++) {
    ck_assert_ptr_nonnull(cmp[i]);
    ck_assert_int_eq(KILN_BOOL, kiln_type(cmp[i]));
    ck_assert_msg(!kiln_get_requires_grad(cmp[i]), "comparison %zu requires grad", i);
  }
  kiln_tensor *am = kiln_argmax(x, 0, false);
  ck_assert_ptr_nonnull(am);
  ck_assert_int_eq(KILN_I64, kiln_type(am));
  ck_assert(!kiln_get_requires_grad(am));
  ck_assert(kiln_get_requires_grad(kiln_max(x, 0, false)));
  kiln_scope_end();
}
END_TEST


/* A value saved for backward and then written in place makes backward fail
 * with a message naming the op that saved it and that op's line. */
START_TEST(test_saved_tensor_modified_in_place)
{
  kiln_scope_begin();
  int64_t n = 5;
  kiln_tensor *a = kiln_randn(KILN_F64, 1, &n, 7), *b = kiln_randn(KILN_F64, 1, &n, 8);
  kiln_requires_grad(a, true);
  int line = __LINE__ + 1;
  kiln_tensor *z = kiln_mul(a, b); /* saves b for d/da */
  ck_assert_ptr_nonnull(kiln_add_(b, kiln_scalar(KILN_F64, 1.0))); /* b needs no grad: allowed */
  ck_assert_int_eq(-1, kiln_backward(kiln_sum_all(z)));
  char where[64];
  snprintf(where, sizeof where, "test_autograd.c:%d: kiln_mul", line);
  ck_assert_msg(strstr(kiln_last_error(), where) && strstr(kiln_last_error(), "modified in place"), "got: %s",
                kiln_last_error());
  ck_assert_ptr_null(kiln_grad(a));

  /* an output saved for backward (exp keeps its result), written under no-grad */
  kiln_tensor *y = kiln_exp(a);
  kiln_no_grad_begin();
  ck_assert_ptr_nonnull(kiln_mul_(y, kiln_scalar(KILN_F64, 2.0)));
  kiln_no_grad_end();
  ck_assert_int_eq(-1, kiln_backward(kiln_sum_all(y)));
  ck_assert_msg(strstr(kiln_last_error(), "kiln_exp") != NULL, "got: %s", kiln_last_error());
  kiln_scope_end();
}
END_TEST

/* softmax and log_softmax of a tensor with no gradient to record run one row
 * kernel (reduce.c) instead of the composite; both must give the same bits,
 * -inf entries, fully masked rows and NaN included, on rows shorter and
 * longer than the pairwise sum's 512-element blocks. The composite runs
 * when x requires grad. Also a hand value: softmax(0, ln 3) = (1/4, 3/4). */
START_TEST(test_softmax_one_kernel_matches_composite)
{
  static const int64_t cols[] = {1, 7, 16, 513, 1500, 5000};
  for (int dt = 0; dt < 2; dt++)
    for (size_t c = 0; c < sizeof cols / sizeof cols[0]; c++)
      for (int lg = 0; lg < 2; lg++) {
        kiln_scope_begin();
        kiln_dtype d = dt ? KILN_F64 : KILN_F32;
        int64_t sh[2] = {5, cols[c]}, n = 5 * cols[c];
        double *v = malloc(sizeof(double) * (size_t)n);
        ck_assert_ptr_nonnull(v);
        kiln_tensor *r = kiln_randn(KILN_F64, 2, sh, 40 + (uint64_t)c);
        ck_assert_int_eq(0, kiln_read(r, v, sizeof(double) * (size_t)n));
        for (int64_t i = 0; i < n; i++) v[i] *= 8;
        v[0] = -INFINITY;                                           /* row 0: one masked entry */
        for (int64_t i = 0; i < cols[c]; i++) v[cols[c] + i] = -INFINITY; /* row 1: all masked */
        v[2 * cols[c] + cols[c] / 2] = NAN;                         /* row 2: a NaN */
        kiln_tensor *x = kiln_cast(kiln_tensor_from(KILN_F64, 2, sh, v), d);
        kiln_tensor *xg = kiln_cast(kiln_tensor_from(KILN_F64, 2, sh, v), d);
        kiln_requires_grad(xg, true);
        kiln_tensor *one = lg ? kiln_log_softmax(x, -1) : kiln_softmax(x, 1);
        kiln_tensor *comp = lg ? kiln_log_softmax(xg, 1) : kiln_softmax(xg, -1);
        ck_assert_msg(one && comp, "%s", kiln_last_error());
        ck_assert(!kiln_get_requires_grad(one));
        double *a = malloc(sizeof(double) * (size_t)n), *b = malloc(sizeof(double) * (size_t)n);
        ck_assert_int_eq(0, kiln_read(kiln_cast(one, KILN_F64), a, sizeof(double) * (size_t)n));
        ck_assert_int_eq(0, kiln_read(kiln_cast(comp, KILN_F64), b, sizeof(double) * (size_t)n));
        for (int64_t i = 0; i < n; i++)
          ck_assert_msg((a[i] != a[i] && b[i] != b[i]) || !memcmp(&a[i], &b[i], sizeof a[i]),
                        "%s %s cols %" PRId64 " at %" PRId64 ": %.17g against the composite's %.17g",
                        lg ? "log_softmax" : "softmax", dt ? "f64" : "f32", cols[c], i, a[i], b[i]);
        for (int64_t i = 0; i < cols[c]; i++) ck_assert(a[cols[c] + i] != a[cols[c] + i]); /* 0/0 */
        free(a), free(b), free(v);
        kiln_scope_end();
      }
  kiln_scope_begin();
  double h[2] = {0, log(3.0)}, y[2];
  kiln_tensor *p = kiln_softmax(kiln_tensor_from(KILN_F64, 1, ((int64_t[]){2}), h), 0);
  ck_assert_int_eq(0, kiln_read(p, y, sizeof y));
  ck_assert(fabs(y[0] - 0.25) < 1e-15 && fabs(y[1] - 0.75) < 1e-15);
  kiln_scope_end();
}
END_TEST

static Suite *autograd_suite(void)
{
  Suite *s = suite_create("autograd");
  TCase *ops = tcase_create("op gradients");
  tcase_set_timeout(ops, 300);
  tcase_add_test(ops, test_binary_pointwise);
  tcase_add_test(ops, test_unary_pointwise);
  tcase_add_test(ops, test_where);
  tcase_add_test(ops, test_broadcast_grads);
  tcase_add_test(ops, test_reductions);
  tcase_add_test(ops, test_matmul);
  tcase_add_test(ops, test_shared_matrix_grad_one_gemm);
  tcase_add_test(ops, test_views);
  tcase_add_test(ops, test_cast_roundtrip);
  tcase_add_test(ops, test_index_ops);
  tcase_add_test(ops, test_nn_ops);
  tcase_add_test(ops, test_cnn_ops);
  tcase_add_test(ops, test_through_views);
  tcase_add_test(ops, test_grad_of_matches_fd);
  suite_add_tcase(s, ops);

  TCase *eng = tcase_create("engine");
  tcase_set_timeout(eng, 60);
  tcase_add_test(eng, test_accumulate_and_zero_grad);
  tcase_add_test(eng, test_backward_twice_fails);
  tcase_add_test(eng, test_backward_nonscalar_fails);
  tcase_add_test(eng, test_backward_with);
  tcase_add_test(eng, test_grad_of_rules);
  tcase_add_test(eng, test_no_grad);
  tcase_add_test(eng, test_inplace_on_leaf);
  tcase_add_test(eng, test_sgd_step);
  tcase_add_test(eng, test_nondifferentiable_outputs);
  tcase_add_test(eng, test_saved_tensor_modified_in_place);
  tcase_add_test(eng, test_softmax_one_kernel_matches_composite);
  suite_add_tcase(s, eng);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(autograd_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
