/* Neural-network ops written with the primitives: softmax, log_softmax,
 * layer_norm, embedding, cross_entropy, mse_loss. Being compositions, they get
 * their backward from the primitives and reach the tracer as primitives that
 * the compiler fuses. Each runs in a scope of its own and keeps its result. */
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "eager/eager.h"

static int check_float(const char *op, const kiln_tensor *t, int idx, const char *file, int line) {
  if (!t) return err_null(file, line, op, "input %d", idx), -1;
  if (tensor_check_live(t, "an input", op, file, line)) return -1;
  if (!dtype_is_float(t->dtype))
    return err_set(file, line, op, "dtype %s is not supported (floats only)", kiln_dtype_name(t->dtype)), -1;
  return 0;
}

static int check_axis(const char *op, const kiln_tensor *t, int axis, const char *file, int line) {
  int k = axis_norm(axis, t->ndim);
  char b[SHAPE_BUF];
  if (k < 0) return err_set(file, line, op, "axis %d is out of range for shape %s", axis, err_shape(b, t->ndim, t->shape)), -1;
  /* refused here, not by the max inside, so that the message names this op */
  if (t->shape[k] == 0) return err_set(file, line, op, "axis %d of shape %s has size 0", axis, err_shape(b, t->ndim, t->shape)), -1;
  return 0;
}

/* max over axis, without history: softmax is invariant to it, so its gradient is zero */
static kiln_tensor *row_max(kiln_tensor *x, int axis, const char *file, int line) {
  kiln_no_grad_begin();
  kiln_tensor *m = kiln_max_at(x, axis, true, file, line);
  kiln_no_grad_end();
  return m;
}

/* Softmax or log_softmax in one kernel (reduce.c) when nothing needs the
 * primitives: no tracer watching, no gradient to record, a contiguous x
 * along its last dim. false when it does not apply (the composite runs);
 * else true, with *y NULL and the error set when out of memory. */
static bool softmax_fused(kiln_tensor *x, int axis, bool log, const char *file, int line, kiln_tensor **y) {
  if (dispatch_hooks() || (x->requires_grad && grad_mode()) || x->st->meta || axis_norm(axis, x->ndim) != x->ndim - 1 ||
      !tensor_contiguous(x) || (x->dtype != KILN_F32 && x->dtype != KILN_F64))
    return false;
  kiln_tensor *t = tensor_new(x->dtype, x->ndim, x->shape);
  if (t) red_softmax_rows(x, t, log);
  if (!t || !(t = scope_adopt(t))) err_set(file, line, log ? "log_softmax" : "softmax", "out of memory");
  *y = t;
  return true;
}

kiln_tensor *kiln_softmax_at(kiln_tensor *x, int axis, const char *file, int line) {
  if (check_float("softmax", x, 0, file, line) || check_axis("softmax", x, axis, file, line)) return NULL;
  kiln_tensor *f;
  if (softmax_fused(x, axis, false, file, line, &f)) return f;
  kiln_scope_begin();
  kiln_tensor *e = kiln_exp_at(kiln_sub_at(x, row_max(x, axis, file, line), file, line), file, line);
  kiln_tensor *y = kiln_keep(kiln_div_at(e, kiln_sum_at(e, axis, true, file, line), file, line));
  kiln_scope_end();
  return y;
}

kiln_tensor *kiln_log_softmax_at(kiln_tensor *x, int axis, const char *file, int line) {
  if (check_float("log_softmax", x, 0, file, line) || check_axis("log_softmax", x, axis, file, line)) return NULL;
  kiln_tensor *f;
  if (softmax_fused(x, axis, true, file, line, &f)) return f;
  kiln_scope_begin();
  kiln_tensor *z = kiln_sub_at(x, row_max(x, axis, file, line), file, line);
  kiln_tensor *lse = kiln_log_at(kiln_sum_at(kiln_exp_at(z, file, line), axis, true, file, line), file, line);
  kiln_tensor *y = kiln_keep(kiln_sub_at(z, lse, file, line));
  kiln_scope_end();
  return y;
}

kiln_tensor *kiln_layer_norm_at(kiln_tensor *x, kiln_tensor *w, kiln_tensor *b, double eps, const char *file,
                                int line) {
  if (check_float("layer_norm", x, 0, file, line)) return NULL;
  char b0[SHAPE_BUF], b1[SHAPE_BUF];
  if (x->ndim == 0) return err_set(file, line, "layer_norm", "input must have at least one dim");
  int64_t c = x->shape[x->ndim - 1];
  kiln_tensor *wb[2] = {w, b};
  for (int i = 0; i < 2; i++)
    if (tensor_check_live(wb[i], i ? "bias" : "weight", "layer_norm", file, line)) return NULL;
    else if (wb[i] && (wb[i]->ndim != 1 || wb[i]->shape[0] != c))
      return err_set(file, line, "layer_norm", "%s %s does not match the last dim of %s", i ? "bias" : "weight",
                     err_shape(b0, wb[i]->ndim, wb[i]->shape), err_shape(b1, x->ndim, x->shape));
  kiln_scope_begin();
  kiln_tensor *mu = kiln_mean_at(x, -1, true, file, line);
  kiln_tensor *d = kiln_sub_at(x, mu, file, line);
  kiln_tensor *var = kiln_mean_at(kiln_mul_at(d, d, file, line), -1, true, file, line);
  kiln_tensor *r = kiln_rsqrt_at(kiln_add_at(var, kiln_scalar_at(x->dtype, eps, file, line), file, line), file, line);
  kiln_tensor *y = kiln_mul_at(d, r, file, line);
  if (w) y = kiln_mul_at(y, w, file, line);
  if (b) y = kiln_add_at(y, b, file, line);
  kiln_keep(y);
  kiln_scope_end();
  return y;
}

kiln_tensor *kiln_embedding_at(kiln_tensor *table, kiln_tensor *idx, const char *file, int line) {
  if (tensor_bad_arg(table, file, line, "embedding", "input 0") || tensor_bad_arg(idx, file, line, "embedding", "input 1"))
    return NULL;
  char b0[SHAPE_BUF];
  if (table->ndim != 2) return err_set(file, line, "embedding", "table must be (V,C), got %s", err_shape(b0, table->ndim, table->shape));
  if (idx->dtype != KILN_I64) return err_set(file, line, "embedding", "indices must be i64, got %s", kiln_dtype_name(idx->dtype));
  if (idx->ndim >= MAXD) return err_set(file, line, "embedding", "indices have too many dims (%d)", idx->ndim);
  /* a recording's index_select checks them when it runs (on every call's data) */
  for (int64_t i = 0, n = dispatch_recording() || idx->st->meta ? 0 : shape_numel(idx->ndim, idx->shape), v = table->shape[0];
       i < n; i++) {
    double k = tensor_get(idx, i); /* compared as a double: near 2^63 the cast itself would overflow */
    if (k < 0 || k >= (double)v)
      return err_set(file, line, "embedding", "index %.0f is out of range for a table of %" PRId64 " rows", k, v);
  }
  int64_t flat = -1, shape[MAXD];
  for (int i = 0; i < idx->ndim; i++) shape[i] = idx->shape[i];
  shape[idx->ndim] = table->shape[1];
  internal_begin(); /* the shapes below are idx's own */
  kiln_scope_begin();
  kiln_tensor *rows = kiln_index_select_at(table, 0, kiln_reshape_at(idx, 1, &flat, file, line), file, line);
  kiln_tensor *y = kiln_keep(kiln_reshape_at(rows, idx->ndim + 1, shape, file, line));
  kiln_scope_end();
  internal_end();
  return y;
}

kiln_tensor *kiln_cross_entropy_at(kiln_tensor *logits, kiln_tensor *targets, const char *file, int line) {
  if (check_float("cross_entropy", logits, 0, file, line)) return NULL;
  if (tensor_bad_arg(targets, file, line, "cross_entropy", "input 1")) return NULL;
  char b0[SHAPE_BUF], b1[SHAPE_BUF];
  if (logits->ndim != 2 || targets->ndim != 1 || targets->shape[0] != logits->shape[0] || targets->dtype != KILN_I64)
    return err_set(file, line, "cross_entropy", "expects logits (N,C) and i64 targets (N,), got %s and %s%s",
                   err_shape(b0, logits->ndim, logits->shape), kiln_dtype_name(targets->dtype),
                   err_shape(b1, targets->ndim, targets->shape));
  int64_t n = logits->shape[0], c = logits->shape[1];
  if (n == 0) return err_set(file, line, "cross_entropy", "no rows (N = 0)");
  kiln_scope_begin();
  /* the targets checked by an op: eagerly now, and in a compiled graph on every call's data */
  targets = op_dispatch(OP_INDEX_CHECK, &targets, 1, &(op_attrs){.k = c, .flag = true}, file, line);
  /* row i's log-probability at its target, picked by a one-hot mask made with
   * ops, so that a traced loss reads the targets of every call (indices
   * computed here in C would freeze the first call's labels) */
  kiln_tensor *classes = kiln_arange_at(KILN_I64, 0, (double)c, 1, file, line);                         /* (C,) */
  kiln_tensor *hot = kiln_eq_at(kiln_unsqueeze_at(targets, 1, file, line), classes, file, line);          /* (N,C) */
  kiln_tensor *mask = kiln_cast_at(hot, logits->dtype, file, line), *picked;
  if (!dispatch_hooks() && !(logits->requires_grad && grad_mode())) {
    /* eager without a gradient: log_softmax in one kernel, one (N,C) temporary */
    picked = kiln_sum_at(kiln_mul_at(kiln_log_softmax_at(logits, 1, file, line), mask, file, line), 1, false, file, line);
  } else {
    /* log_softmax's (x - max) - lse at the target, the same bits, but with the
     * target's x - max picked before the exponentials are made: compiled, the
     * logits are then last read where their exponentials are stored, which
     * can take the logits' memory (codegen's row kernels in place) */
    kiln_tensor *z = kiln_sub_at(logits, row_max(logits, 1, file, line), file, line);
    kiln_tensor *zt = kiln_sum_at(kiln_mul_at(z, mask, file, line), 1, false, file, line);
    kiln_tensor *lse = kiln_log_at(kiln_sum_at(kiln_exp_at(z, file, line), 1, false, file, line), file, line);
    picked = kiln_sub_at(zt, lse, file, line);
  }
  kiln_tensor *y = kiln_keep(kiln_neg_at(kiln_mean_at(picked, 0, false, file, line), file, line));
  kiln_scope_end();
  return y;
}

kiln_tensor *kiln_mse_loss_at(kiln_tensor *a, kiln_tensor *b, const char *file, int line) {
  if (check_float("mse_loss", a, 0, file, line) || check_float("mse_loss", b, 1, file, line)) return NULL;
  int nd;
  int64_t shape[MAXD];
  if (shape_broadcast(a->ndim, a->shape, b->ndim, b->shape, &nd, shape)) {
    char b0[SHAPE_BUF], b1[SHAPE_BUF];
    return err_set(file, line, "mse_loss", "shapes %s and %s do not broadcast", err_shape(b0, a->ndim, a->shape),
                   err_shape(b1, b->ndim, b->shape));
  }
  kiln_scope_begin();
  kiln_tensor *d = kiln_sub_at(a, b, file, line);
  kiln_tensor *y = kiln_keep(kiln_mean_axes_at(kiln_mul_at(d, d, file, line), NULL, 0, false, file, line));
  kiln_scope_end();
  return y;
}

kiln_tensor *kiln_dropout_at(kiln_tensor *x, double p, bool training, const char *file, int line) {
  if (check_float("dropout", x, 0, file, line)) return NULL;
  if (!(p >= 0 && p <= 1)) return err_set(file, line, "dropout", "p %g is outside [0, 1]", p);
  /* no draw and no op, but p is the caller's number: a recording must see
   * it again on every call (a later p draws), as a size C branched on */
  if (training && p == 0) meta_read(x, -1);
  if (!training || p == 0) return scope_adopt(kiln_retain(x));
  kiln_scope_begin();
  kiln_tensor *zero = kiln_scalar_at(x->dtype, 0, file, line), *y;
  if (p == 1) {
    y = kiln_mul_at(x, zero, file, line);
  } else {
    kiln_tensor *keep = kiln_ge_at(kiln_rand_like_at(x, file, line), kiln_scalar_at(x->dtype, p, file, line), file, line);
    y = kiln_where_at(keep, kiln_mul_at(x, kiln_scalar_at(x->dtype, 1 / (1 - p), file, line), file, line), zero, file, line);
  }
  kiln_keep(y);
  kiln_scope_end();
  return y;
}

/* log(sum(exp(x))) along axis: the row's max (without history: the result
 * does not depend on it) taken out first, and 0 in its place where it is
 * infinite, so that a row of -inf gives -inf and one holding +inf gives +inf. */
kiln_tensor *kiln_logsumexp_at(kiln_tensor *x, int axis, bool keepdim, const char *file, int line) {
  if (check_float("logsumexp", x, 0, file, line) || check_axis("logsumexp", x, axis, file, line)) return NULL;
  kiln_scope_begin();
  kiln_tensor *m = row_max(x, axis, file, line);
  kiln_tensor *inf = kiln_scalar_at(x->dtype, INFINITY, file, line), *zero = kiln_scalar_at(x->dtype, 0, file, line);
  m = kiln_where_at(kiln_eq_at(kiln_abs_at(m, file, line), inf, file, line), zero, m, file, line);
  kiln_tensor *s = kiln_sum_at(kiln_exp_at(kiln_sub_at(x, m, file, line), file, line), axis, true, file, line);
  kiln_tensor *y = kiln_add_at(kiln_log_at(s, file, line), m, file, line);
  if (!keepdim) y = kiln_squeeze_at(y, axis, file, line);
  kiln_keep(y);
  kiln_scope_end();
  return y;
}

static kiln_tensor *extreme_all(const char *op, bool max, kiln_tensor *x, const char *file, int line) {
  if (tensor_bad_arg(x, file, line, op, "input 0")) return NULL;
  char b[SHAPE_BUF];
  if (shape_numel(x->ndim, x->shape) == 0) return err_set(file, line, op, "input %s has no elements", err_shape(b, x->ndim, x->shape));
  if (x->dtype == KILN_BOOL) return err_set(file, line, op, "dtype bool is not supported");
  return (max ? kiln_max_axes_at : kiln_min_axes_at)(x, NULL, 0, false, file, line);
}

kiln_tensor *kiln_max_all_at(kiln_tensor *x, const char *file, int line) { return extreme_all("max_all", true, x, file, line); }
kiln_tensor *kiln_min_all_at(kiln_tensor *x, const char *file, int line) { return extreme_all("min_all", false, x, file, line); }

kiln_tensor *kiln_masked_fill_at(kiln_tensor *x, kiln_tensor *mask, double value, const char *file, int line) {
  if (tensor_bad_arg(x, file, line, "masked_fill", "input 0") || tensor_bad_arg(mask, file, line, "masked_fill", "mask"))
    return NULL;
  char b0[SHAPE_BUF], b1[SHAPE_BUF];
  if (mask->dtype != KILN_BOOL) return err_set(file, line, "masked_fill", "mask must be bool, got %s", kiln_dtype_name(mask->dtype));
  int nd;
  int64_t shape[MAXD];
  if (shape_broadcast(x->ndim, x->shape, mask->ndim, mask->shape, &nd, shape) || nd != x->ndim ||
      memcmp(shape, x->shape, sizeof(int64_t) * (size_t)nd))
    return err_set(file, line, "masked_fill", "mask %s does not broadcast to the input's shape %s",
                   err_shape(b0, mask->ndim, mask->shape), err_shape(b1, x->ndim, x->shape));
  kiln_scope_begin();
  kiln_tensor *y = kiln_keep(kiln_where_at(mask, kiln_scalar_at(x->dtype, value, file, line), x, file, line));
  kiln_scope_end();
  return y;
}

/* Checks an optional per-channel parameter: NULL, or 1-D of c elements. */
static int check_channels(const char *op, const char *what, const kiln_tensor *p, int64_t c, const kiln_tensor *x,
                          const char *file, int line) {
  char b0[SHAPE_BUF], b1[SHAPE_BUF];
  if (tensor_check_live(p, what, op, file, line)) return -1;
  if (p && (p->ndim != 1 || p->shape[0] != c))
    return err_set(file, line, op, "%s %s does not match %" PRId64 " channels of %s", what, err_shape(b0, p->ndim, p->shape),
                   c, err_shape(b1, x->ndim, x->shape)), -1;
  return 0;
}

kiln_tensor *kiln_rms_norm_at(kiln_tensor *x, kiln_tensor *w, double eps, const char *file, int line) {
  if (check_float("rms_norm", x, 0, file, line)) return NULL;
  if (x->ndim == 0) return err_set(file, line, "rms_norm", "input must have at least one dim");
  if (check_channels("rms_norm", "weight", w, x->shape[x->ndim - 1], x, file, line)) return NULL;
  kiln_scope_begin();
  kiln_tensor *ms = kiln_mean_at(kiln_mul_at(x, x, file, line), -1, true, file, line);
  kiln_tensor *y = kiln_mul_at(x, kiln_rsqrt_at(kiln_add_at(ms, kiln_scalar_at(x->dtype, eps, file, line), file, line), file, line),
                               file, line);
  if (w) y = kiln_mul_at(y, w, file, line);
  kiln_keep(y);
  kiln_scope_end();
  return y;
}

kiln_tensor *kiln_group_norm_at(kiln_tensor *x, int groups, kiln_tensor *w, kiln_tensor *b, double eps, const char *file,
                                int line) {
  if (check_float("group_norm", x, 0, file, line)) return NULL;
  char b0[SHAPE_BUF];
  if (x->ndim < 2) return err_set(file, line, "group_norm", "input must be (N,C,...), got %s", err_shape(b0, x->ndim, x->shape));
  int64_t n = x->shape[0], c = x->shape[1];
  if (groups < 1 || c % groups)
    return err_set(file, line, "group_norm", "%" PRId64 " channels of %s do not split into %d groups", c,
                   err_shape(b0, x->ndim, x->shape), groups);
  if (check_channels("group_norm", "weight", w, c, x, file, line) || check_channels("group_norm", "bias", b, c, x, file, line))
    return NULL;
  if (shape_numel(x->ndim, x->shape) == 0) return err_set(file, line, "group_norm", "input %s has no elements", err_shape(b0, x->ndim, x->shape));
  kiln_scope_begin();
  /* (N, G, C/G * rest): each group's statistics over its last dim, biased variance */
  kiln_tensor *g = kiln_reshape_at(x, 3, (int64_t[]){n, groups, -1}, file, line);
  kiln_tensor *mu = kiln_mean_at(g, -1, true, file, line);
  kiln_tensor *d = kiln_sub_at(g, mu, file, line);
  kiln_tensor *var = kiln_mean_at(kiln_mul_at(d, d, file, line), -1, true, file, line);
  kiln_tensor *r = kiln_rsqrt_at(kiln_add_at(var, kiln_scalar_at(x->dtype, eps, file, line), file, line), file, line);
  kiln_tensor *y = kiln_reshape_at(kiln_mul_at(d, r, file, line), x->ndim, x->shape, file, line);
  /* weight and bias per channel: (C, 1, ..., 1) against (N, C, ...) */
  int64_t cs[MAXD];
  cs[0] = c;
  for (int i = 1; i < x->ndim - 1; i++) cs[i] = 1;
  if (w) y = kiln_mul_at(y, kiln_reshape_at(w, x->ndim - 1, cs, file, line), file, line);
  if (b) y = kiln_add_at(y, kiln_reshape_at(b, x->ndim - 1, cs, file, line), file, line);
  kiln_keep(y);
  kiln_scope_end();
  return y;
}
