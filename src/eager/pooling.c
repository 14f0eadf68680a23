/* The kernels of max_pool2d, avg_pool2d and adaptive_avg_pool2d and their
 * gradients, over NCHW tensors, one plane (n, c) at a time, planes split
 * across the thread pool.
 *
 * Windows follow torch: a max pool ignores the padding (as if it held
 * -inf; the shape rule keeps the padding at most half the window, so every
 * window holds an input element) and takes the first maximum, or a NaN; an
 * average pool counts the padding in its divisor (count_include_pad), which
 * without ceil mode is always kh*kw; an adaptive pool's window for output
 * row i is rows [floor(i*H/OH), ceil((i+1)*H/OH)). The max pool's gradient
 * finds each window's maximum again, from the input, rather than keeping
 * indices from the forward pass. */
#include <math.h>
#include <string.h>

#include "eager/eager.h"
#include "eager/pool.h"

typedef struct pool_geom {
  op_id op;               /* the forward op */
  int64_t planes, h, w;   /* N*C planes of (H, W) */
  int64_t ho, wo;
  int64_t kh, kw, sh, sw, ph, pw;
} pool_geom;

typedef struct pool_job {
  const pool_geom *q;
  const void *x, *g; /* input, and the output's gradient (backward) */
  void *out;
} pool_job;

/* An output's window, clipped to the input, and the divisor of its average. */
typedef struct window {
  int64_t h0, h1, w0, w1, count;
} window;

static window window_at(const pool_geom *q, int64_t oh, int64_t ow) {
  window v;
  if (q->op == OP_ADAPTIVE_AVG_POOL2D) {
    v.h0 = oh * q->h / q->ho, v.h1 = ((oh + 1) * q->h + q->ho - 1) / q->ho;
    v.w0 = ow * q->w / q->wo, v.w1 = ((ow + 1) * q->w + q->wo - 1) / q->wo;
    v.count = (v.h1 - v.h0) * (v.w1 - v.w0);
    return v;
  }
  v.h0 = oh * q->sh - q->ph, v.w0 = ow * q->sw - q->pw;
  v.h1 = v.h0 + q->kh < q->h ? v.h0 + q->kh : q->h;
  v.w1 = v.w0 + q->kw < q->w ? v.w0 + q->kw : q->w;
  if (v.h0 < 0) v.h0 = 0;
  if (v.w0 < 0) v.w0 = 0;
  v.count = q->kh * q->kw;
  return v;
}

#define T float
#define F(name) name##_f32
#include "eager/pooling_impl.h"
#undef T
#undef F
#define T double
#define F(name) name##_f64
#include "eager/pooling_impl.h"
#undef T
#undef F

/* The forward op of a pool or of its gradient. */
static op_id forward_of(op_id op) {
  return op == OP_MAX_POOL2D_GRAD ? OP_MAX_POOL2D
         : op == OP_AVG_POOL2D_GRAD ? OP_AVG_POOL2D
         : op == OP_ADAPTIVE_AVG_POOL2D_GRAD ? OP_ADAPTIVE_AVG_POOL2D
                                             : op;
}

static pool_geom geom_of(op_id op, const kiln_tensor *x, const op_attrs *a) {
  pool_geom q = {.op = forward_of(op), .planes = x->shape[0] * x->shape[1], .h = x->shape[2], .w = x->shape[3]};
  if (q.op == OP_ADAPTIVE_AVG_POOL2D) {
    q.ho = a->ints[0], q.wo = a->ints[1];
    return q;
  }
  q.kh = a->ints[0], q.kw = a->ints[1], q.sh = a->ints[2], q.sw = a->ints[3], q.ph = a->ints[4], q.pw = a->ints[5];
  q.ho = (q.h + 2 * q.ph - q.kh) / q.sh + 1;
  q.wo = (q.w + 2 * q.pw - q.kw) / q.sw + 1;
  return q;
}

/* t itself when contiguous, else a contiguous copy in *own (NULL when out of memory). */
static const kiln_tensor *dense(const kiln_tensor *t, kiln_tensor **own) {
  *own = NULL;
  if (tensor_contiguous(t)) return t;
  *own = tensor_new(t->dtype, t->ndim, t->shape);
  if (*own) pw_copy(*own, t);
  return *own;
}

/* The forward (g NULL) or the gradient, through contiguous copies where the
 * operands or the result are strided. */
static int pool_run(op_id op, const kiln_tensor *x, const kiln_tensor *g, const op_attrs *a, kiln_tensor *out) {
  pool_geom q = geom_of(op, x, a);
  kiln_tensor *ox, *og = NULL, *oo = NULL;
  const kiln_tensor *dx = dense(x, &ox), *dg = g ? dense(g, &og) : NULL;
  kiln_tensor *dst = out;
  if (!tensor_contiguous(out)) dst = oo = tensor_new(out->dtype, out->ndim, out->shape);
  int rc = -1;
  if (dx && (!g || dg) && dst) {
    pool_job j = {.q = &q, .x = tensor_data(dx), .g = dg ? tensor_data(dg) : NULL, .out = tensor_data(dst)};
    int64_t per = g ? q.h * q.w + q.ho * q.wo * q.kh * q.kw : q.ho * q.wo * (q.kh * q.kw + 1);
    int64_t grain = per >= 16384 ? 1 : 16384 / (per > 0 ? per : 1);
    bool f32 = out->dtype == KILN_F32;
    pool_parallel_for(q.planes, grain, g ? (f32 ? pool_bwd_chunk_f32 : pool_bwd_chunk_f64)
                                         : (f32 ? pool_fwd_chunk_f32 : pool_fwd_chunk_f64), &j);
    if (oo) pw_copy(out, oo);
    rc = 0;
  }
  kiln_release(ox);
  kiln_release(og);
  kiln_release(oo);
  return rc;
}

int k_pool2d(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)n;
  return pool_run(op, in[0], NULL, a, out);
}

/* in: the output's gradient, the forward's input */
int k_pool2d_grad(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)n;
  return pool_run(op, in[1], in[0], a, out);
}
