/* The public entry points of convolution, pooling and batch norm: the
 * defaults for NULL parameter pairs, torch's checks and messages, unbatched
 * inputs, the bias, conv1d as a conv2d over a height of 1, the adaptive pool
 * to 1x1 as a mean, and batch norm written with the primitives (so that it
 * differentiates, traces and fuses like any composite). The primitives are
 * the conv and pool rows of ops.def (kernels in conv.c and pooling.c). */
#include <inttypes.h>

#include "eager/eager.h"

/* p[0..2) into out, or the default d for both when p is NULL. */
static void pair(const int *p, int d, int out[2]) {
  out[0] = p ? p[0] : d;
  out[1] = p ? p[1] : d;
}

static int check_conv_params(const char *op, const int s[2], const int p[2], const int d[2], int groups,
                             const char *file, int line) {
  if (s[0] < 1 || s[1] < 1) return err_set(file, line, op, "non-positive stride is not supported (stride (%d, %d))", s[0], s[1]), -1;
  if (p[0] < 0 || p[1] < 0) return err_set(file, line, op, "negative padding is not supported (padding (%d, %d))", p[0], p[1]), -1;
  if (d[0] < 1 || d[1] < 1) return err_set(file, line, op, "dilation should be greater than zero (dilation (%d, %d))", d[0], d[1]), -1;
  if (groups < 1) return err_set(file, line, op, "non-positive groups is not supported (groups %d)", groups), -1;
  return 0;
}

/* t with `count` dims of 1 added at the end (a per-channel vector against (N,C,H,W)). */
static kiln_tensor *trailing_ones(kiln_tensor *t, int count, const char *file, int line) {
  for (int i = 0; i < count; i++) t = kiln_unsqueeze_at(t, -1, file, line);
  return t;
}

/* conv2d (sd 2) or conv1d (sd 1) on checked parameters; ints as conv2d's. */
static kiln_tensor *conv(const char *op, int sd, kiln_tensor *x, kiln_tensor *w, kiln_tensor *bias, const int64_t ints[7],
                         const char *file, int line) {
  char b0[SHAPE_BUF], b1[SHAPE_BUF];
  if (x->ndim != sd + 1 && x->ndim != sd + 2)
    return err_set(file, line, op, "Expected %dD (unbatched) or %dD (batched) input to %s, but got input of size: %s", sd + 1, sd + 2,
                   op, err_shape(b0, x->ndim, x->shape));
  if (w->ndim != sd + 2)
    return err_set(file, line, op, "expected %dD weight (out, in/groups, %s), but got weight of size %s", sd + 2,
                   sd == 2 ? "kh, kw" : "k", err_shape(b0, w->ndim, w->shape));
  if (bias && (bias->ndim != 1 || bias->shape[0] != w->shape[0]))
    return err_set(file, line, op, "Given weight of size %s, expected bias to be 1-dimensional with %" PRId64
                   " elements, but got bias of size %s instead", err_shape(b0, w->ndim, w->shape), w->shape[0],
                   err_shape(b1, bias->ndim, bias->shape));
  bool batched = x->ndim == sd + 2;
  if (sd == 1) {
    /* checked here, so that the message names conv1d and its shapes */
    int64_t groups = ints[6], c = x->shape[batched ? 1 : 0], len = x->shape[x->ndim - 1], k = w->shape[2];
    if (w->shape[0] % groups)
      return err_set(file, line, op, "Given groups=%" PRId64 ", expected weight to be divisible by %" PRId64
                     " at dimension 0, but got weight of size %s instead", groups, groups, err_shape(b0, w->ndim, w->shape));
    if (c != w->shape[1] * groups)
      return err_set(file, line, op, "Given groups=%" PRId64 ", weight of size %s, expected input%s to have %" PRId64
                     " channels, but got %" PRId64 " channels instead", groups, err_shape(b0, w->ndim, w->shape),
                     err_shape(b1, x->ndim, x->shape), w->shape[1] * groups, c);
    if (len + 2 * ints[3] < ints[5] * (k - 1) + 1)
      return err_set(file, line, op, "Calculated padded input size per channel: (%" PRId64 "). Kernel size: (%" PRId64
                     "). Kernel size can't be greater than actual input size", len + 2 * ints[3], ints[5] * (k - 1) + 1);
  }
  op_attrs a = {.nints = 7};
  for (int i = 0; i < 7; i++) a.ints[i] = ints[i];
  bool by_user = !in_internal();
  internal_begin(); /* the sizes below are the operands' own */
  kiln_scope_begin();
  kiln_tensor *x4 = batched ? x : kiln_unsqueeze_at(x, 0, file, line), *w4 = w;
  if (sd == 1) {
    x4 = kiln_unsqueeze_at(x4, 2, file, line);
    w4 = kiln_unsqueeze_at(w, 2, file, line);
  }
  kiln_tensor *in[2] = {x4, w4}, *y = x4 && w4 ? op_dispatch_user(by_user, OP_CONV2D, in, 2, &a, file, line) : NULL;
  if (sd == 1) y = kiln_squeeze_at(y, 2, file, line);
  if (bias) y = kiln_add_at(y, trailing_ones(bias, sd, file, line), file, line);
  if (!batched) y = kiln_squeeze_at(y, 0, file, line);
  kiln_keep(y);
  kiln_scope_end();
  internal_end();
  return y;
}

kiln_tensor *kiln_conv2d_at(kiln_tensor *x, kiln_tensor *w, kiln_tensor *bias, const int *stride, const int *padding,
                            const int *dilation, int groups, const char *file, int line) {
  if (!x || !w) return err_null(file, line, "conv2d", "%s", x ? "weight" : "input");
  int s[2], p[2], d[2];
  pair(stride, 1, s), pair(padding, 0, p), pair(dilation, 1, d);
  if (check_conv_params("conv2d", s, p, d, groups, file, line)) return NULL;
  return conv("conv2d", 2, x, w, bias, (const int64_t[7]){s[0], s[1], p[0], p[1], d[0], d[1], groups}, file, line);
}

kiln_tensor *kiln_conv1d_at(kiln_tensor *x, kiln_tensor *w, kiln_tensor *bias, int stride, int padding, int dilation,
                            int groups, const char *file, int line) {
  if (!x || !w) return err_null(file, line, "conv1d", "%s", x ? "weight" : "input");
  int s[2] = {1, stride}, p[2] = {0, padding}, d[2] = {1, dilation};
  if (check_conv_params("conv1d", s, p, d, groups, file, line)) return NULL;
  return conv("conv1d", 1, x, w, bias, (const int64_t[7]){1, stride, 0, padding, 1, dilation, groups}, file, line);
}

/* x (N,C,H,W) or (C,H,W) through op with attrs a; 3-D comes back 3-D. */
static kiln_tensor *pool(op_id op, const char *name, kiln_tensor *x, const op_attrs *a, const char *file, int line) {
  char b0[SHAPE_BUF];
  if (x->ndim != 3 && x->ndim != 4)
    return err_set(file, line, name, "Expected 3D (unbatched) or 4D (batched) input, but got input of size: %s",
                   err_shape(b0, x->ndim, x->shape));
  bool by_user = !in_internal();
  internal_begin();
  kiln_scope_begin();
  kiln_tensor *x4 = x->ndim == 4 ? x : kiln_unsqueeze_at(x, 0, file, line);
  kiln_tensor *y = x4 ? op_dispatch_user(by_user, op, &x4, 1, a, file, line) : NULL; /* its window is the caller's */
  if (x->ndim == 3) y = kiln_squeeze_at(y, 0, file, line);
  kiln_keep(y);
  kiln_scope_end();
  internal_end();
  return y;
}

static kiln_tensor *window_pool(op_id op, const char *name, kiln_tensor *x, const int *kernel, const int *stride,
                                const int *padding, const char *file, int line) {
  if (!x) return err_null(file, line, name, "input");
  if (!kernel) return err_set(file, line, name, "the kernel size is NULL");
  int k[2], s[2], p[2];
  pair(kernel, 0, k), pair(stride ? stride : kernel, 0, s), pair(padding, 0, p);
  if (k[0] < 1 || k[1] < 1) return err_set(file, line, name, "kernel size should be greater than zero, but got (%d, %d)", k[0], k[1]);
  if (s[0] < 1 || s[1] < 1) return err_set(file, line, name, "stride should be greater than zero, but got (%d, %d)", s[0], s[1]);
  op_attrs a = {.nints = 6, .ints = {k[0], k[1], s[0], s[1], p[0], p[1]}};
  return pool(op, name, x, &a, file, line);
}

kiln_tensor *kiln_max_pool2d_at(kiln_tensor *x, const int *kernel, const int *stride, const int *padding,
                                const char *file, int line) {
  return window_pool(OP_MAX_POOL2D, "max_pool2d", x, kernel, stride, padding, file, line);
}

kiln_tensor *kiln_avg_pool2d_at(kiln_tensor *x, const int *kernel, const int *stride, const int *padding,
                                const char *file, int line) {
  return window_pool(OP_AVG_POOL2D, "avg_pool2d", x, kernel, stride, padding, file, line);
}

kiln_tensor *kiln_adaptive_avg_pool2d_at(kiln_tensor *x, const int *out_hw, const char *file, int line) {
  const char *name = "adaptive_avg_pool2d";
  if (!x) return err_null(file, line, name, "input");
  if (!out_hw) return err_set(file, line, name, "the output size is NULL");
  op_attrs a = {.nints = 2, .ints = {out_hw[0], out_hw[1]}};
  char b0[SHAPE_BUF];
  if (out_hw[0] == 1 && out_hw[1] == 1 && (x->ndim == 3 || x->ndim == 4) && dtype_is_float(x->dtype)) {
    /* one window over the whole plane: a mean, which fuses with what feeds it */
    for (int d = x->ndim - 2; d < x->ndim; d++)
      if (x->shape[d] == 0)
        return err_set(file, line, name, "Expected input to have non-zero size for non-batch dimensions, but input has sizes %s "
                       "with dimension %d being empty", err_shape(b0, x->ndim, x->shape), d);
    return kiln_mean_axes_at(x, (const int[]){-2, -1}, 2, true, file, line);
  }
  return pool(OP_ADAPTIVE_AVG_POOL2D, name, x, &a, file, line);
}

/* ---- batch norm ---- */

/* A per-channel parameter: NULL, or a vector of c elements. */
static int check_channels(const char *what, const kiln_tensor *t, int64_t c, const char *file, int line) {
  if (!t) return 0;
  if (t->ndim != 1 || t->shape[0] != c) {
    char b[SHAPE_BUF];
    return err_set(file, line, "batch_norm", "%s should contain %" PRId64 " elements not %" PRId64 " (size %s)", what, c,
                   kiln_numel(t), err_shape(b, t->ndim, t->shape)),
           -1;
  }
  return 0;
}

/* r = (1 - m) r + m s, in place and without history (s (C,) or reshaped to it); 0 or -1. */
static int running_update(kiln_tensor *r, kiln_tensor *s, double m, const char *file, int line) {
  kiln_tensor *old = kiln_mul_at(r, kiln_scalar_at(r->dtype, 1 - m, file, line), file, line);
  kiln_tensor *now = kiln_mul_at(kiln_reshape_at(s, 1, r->shape, file, line), kiln_scalar_at(r->dtype, m, file, line), file, line);
  return kiln_copy__at(r, kiln_add_at(old, now, file, line), file, line) ? 0 : -1;
}

kiln_tensor *kiln_batch_norm_at(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var, kiln_tensor *weight,
                                kiln_tensor *bias, bool training, double momentum, double eps, const char *file, int line) {
  const char *op = "batch_norm";
  char b0[SHAPE_BUF];
  if (!x) return err_null(file, line, op, "input");
  if (!dtype_is_float(x->dtype)) return err_set(file, line, op, "dtype %s is not supported (floats only)", kiln_dtype_name(x->dtype));
  if (x->ndim < 2) return err_set(file, line, op, "expected 2D or higher input (N,C,...), but got input of size %s", err_shape(b0, x->ndim, x->shape));
  int64_t c = x->shape[1], per = c ? kiln_numel(x) / c : 0;
  if (check_channels("running_mean", running_mean, c, file, line) || check_channels("running_var", running_var, c, file, line) ||
      check_channels("weight", weight, c, file, line) || check_channels("bias", bias, c, file, line))
    return NULL;
  if (!training && (!running_mean || !running_var))
    return err_set(file, line, op, "running_mean and running_var must be given in evaluation mode");
  if (training && per <= 1)
    return err_set(file, line, op, "Expected more than 1 value per channel when training, got input size %s", err_shape(b0, x->ndim, x->shape));
  int axes[MAXD], nax = 0, trail = x->ndim - 2;
  for (int d = 0; d < x->ndim; d++)
    if (d != 1) axes[nax++] = d;
  internal_begin(); /* the sizes below are x's own */
  kiln_scope_begin();
  kiln_tensor *y;
  if (training) {
    kiln_tensor *mu = kiln_mean_axes_at(x, axes, nax, true, file, line);
    kiln_tensor *d = kiln_sub_at(x, mu, file, line);
    kiln_tensor *var = kiln_mean_axes_at(kiln_mul_at(d, d, file, line), axes, nax, true, file, line);
    kiln_tensor *scale = kiln_rsqrt_at(kiln_add_at(var, kiln_scalar_at(x->dtype, eps, file, line), file, line), file, line);
    if (weight) scale = kiln_mul_at(scale, trailing_ones(weight, trail, file, line), file, line);
    y = kiln_mul_at(d, scale, file, line);
    if (bias) y = kiln_add_at(y, trailing_ones(bias, trail, file, line), file, line);
    if (y && (running_mean || running_var)) {
      kiln_no_grad_begin();
      if (running_mean && running_update(running_mean, mu, momentum, file, line)) y = NULL;
      if (running_var && y) {
        /* the unbiased variance; the counts stay symbolic in a trace */
        kiln_tensor *n = numel_scalar(x, axes, nax, 0, x->dtype, file, line), *n1 = numel_scalar(x, axes, nax, -1, x->dtype, file, line);
        if (running_update(running_var, kiln_div_at(kiln_mul_at(var, n, file, line), n1, file, line), momentum, file, line)) y = NULL;
      }
      kiln_no_grad_end();
    }
  } else {
    /* y = x * scale + shift per channel: w / sqrt(var + eps) and b - mean * scale */
    kiln_tensor *scale = kiln_rsqrt_at(kiln_add_at(running_var, kiln_scalar_at(running_var->dtype, eps, file, line), file, line), file, line);
    if (weight) scale = kiln_mul_at(scale, weight, file, line);
    kiln_tensor *shift = kiln_neg_at(kiln_mul_at(running_mean, scale, file, line), file, line);
    if (bias) shift = kiln_add_at(shift, bias, file, line);
    y = kiln_add_at(kiln_mul_at(x, trailing_ones(scale, trail, file, line), file, line), trailing_ones(shift, trail, file, line),
                    file, line);
  }
  kiln_keep(y);
  kiln_scope_end();
  internal_end();
  return y;
}
