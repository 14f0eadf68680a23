/* The one dispatch point: every op, from the user or from a backward formula,
 * passes through op_dispatch, which checks inputs, promotes dtypes, applies
 * the shape rule, runs the kernel (or makes the view), records the op for
 * autograd and shows it to the tracer's hook. */
#include <stdlib.h>
#include <string.h>

#include "eager/eager.h"

_Static_assert(OP_COUNT == 78, "ops.def changed: update the op count here");

static KILN_TLS_HOT const trace_hooks *hooks;

void dispatch_set_hooks(const trace_hooks *h) { hooks = h; }
const trace_hooks *dispatch_hooks(void) { return hooks; }
bool dispatch_recording(void) { return hooks && hooks->record; }

void hook_read(const char *what, const kiln_tensor *t, const char *file, int line) {
  if (hooks && hooks->read) hooks->read(hooks->ctx, what, t, file, line);
}

static KILN_TLS_HOT int internal_depth, user_depth;
void internal_begin(void) { internal_depth++; }
void internal_end(void) { internal_depth--; }
void user_numbers_begin(void) { user_depth += internal_depth == 0; }
void user_numbers_end(void) { user_depth -= internal_depth == 0; }
bool user_numbers(void) { return user_depth > 0 && internal_depth == 0; }
bool in_internal(void) { return internal_depth > 0; }

/* A composite's op whose attributes are its caller's numbers (conv's stride
 * and padding, a pool's window), dispatched from inside the composite's
 * internal part: when user code called the composite, the recording must
 * see them as the user's numbers, or a body that passes them from C state
 * would take the guard-only path and keep the first call's values. by_user:
 * !in_internal() before the composite's internal_begin. */
kiln_tensor *op_dispatch_user(bool by_user, op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file,
                              int line) {
  if (!by_user) return op_dispatch(op, in, n, a, file, line);
  int depth = internal_depth;
  internal_depth = 0;
  kiln_tensor *y = op_dispatch(op, in, n, a, file, line);
  internal_depth = depth;
  return y;
}

kiln_tensor *numel_scalar(const kiln_tensor *x, const int *axes, int naxes, int64_t offset, kiln_dtype dt,
                          const char *file, int line) {
  int64_t n = 1;
  if (naxes == 0)
    for (int i = 0; i < x->ndim; i++) n *= x->shape[i];
  for (int i = 0; i < naxes; i++) n *= x->shape[axes[i]];
  bool record = hooks && hooks->record;
  kiln_tensor *t = record ? tensor_new_meta(dt, 0, NULL) : tensor_new(dt, 0, NULL);
  if (!t) return err_set(file, line, "numel", "out of memory");
  if (!record) pw_fill(t, (double)(n + offset));
  if (hooks && hooks->numel) hooks->numel(hooks->ctx, t, x, axes, naxes, offset, file, line);
  return scope_adopt(t);
}

/* A result whose byte count would not fit int64 (broadcasting two huge
 * expanded views): refused before anything multiplies its sizes. */
static bool too_many_elements(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] && n > INT64_MAX / 8 / shape[i]) return true;
    n *= shape[i];
  }
  return false;
}

kiln_tensor *view_result(op_id op, kiln_tensor *x, const op_attrs *a, bool record, bool *no_layout) {
  /* the layout is the shape rule of a view (and gives its strides too) */
  int ndim;
  int64_t shape[MAXD], stride[MAXD], off;
  int r = view_layout(op, x, a, &ndim, shape, stride, &off);
  *no_layout = r < 0;
  if (r < 0) return NULL;
  if (r == 0) return tensor_view(x, ndim, shape, stride, off);
  if (record) return tensor_new_meta(x->dtype, ndim, shape);
  /* a reshape of a layout that cannot be viewed: copy, then view the copy */
  kiln_tensor *c = tensor_new(x->dtype, x->ndim, x->shape), *out = NULL;
  if (c) {
    pw_copy(c, x);
    contiguous_strides(ndim, shape, stride);
    out = tensor_view(c, ndim, shape, stride, 0);
    kiln_release(c);
  }
  return out;
}

/* Like op_dispatch, but the result belongs to the caller, not to a scope. */
static kiln_tensor *dispatch_owned(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file,
                                   int line) {
  static const op_attrs none;
  if (!a) a = &none;
  const char *name = op_table[op].name;
  if (op_table[op].arity >= 0 && n != op_table[op].arity)
    return err_set(file, line, name, "takes %d inputs, got %d", op_table[op].arity, n);
  if (n < 1) return err_set(file, line, name, "needs at least one input");
  for (int i = 0; i < n; i++)
    if (!in[i]) return err_null(file, line, name, "input %d", i);
    else if (tensor_check_live(in[i], n > 1 ? "an input" : "its input", name, file, line)) return NULL;

  /* mixed dtypes: cast to the promoted type through the dispatcher, so autograd and the tracer see the casts */
  kiln_tensor *cast[3] = {0}, *args[3], *out = NULL;
  const dtype_rule *dr = &op_table[op].dt;
  if (dr->promote && n > dr->first + 1) {
    int first = dr->first;
    kiln_dtype dt = dtype_promote(in[first], in[first + 1]);
    for (int i = 0; i < n; i++) {
      args[i] = in[i];
      if (i >= first && in[i]->dtype != dt) {
        op_attrs ca = {.dtype = dt};
        cast[i] = dispatch_owned(OP_CAST, &in[i], 1, &ca, file, line);
        if (!cast[i]) goto fail;
        args[i] = cast[i];
      }
    }
    in = args;
  }
  if (hooks && hooks->replay && (out = hooks->replay(hooks->ctx, op, in, n, a, file, line))) {
    /* a replayed op's result gets history as a recorded one's would */
    if (ag_record(op, in, n, a, out, file, line)) goto fail;
    goto done;
  }

  kiln_dtype dt;
  int ndim;
  int64_t shape[MAXD];
  if (shape_rule(op, in, n, a, &dt, &ndim, shape, file, line)) goto fail;
  /* a recording computes nothing: its values' checks run when the values do */
  bool record = hooks && hooks->record;
  /* a value a recording never computed must not reach a kernel */
  for (int i = 0; i < n && !record; i++)
    if (in[i]->st->meta && op_table[op].kind != KIND_VIEW) {
      err_set(file, line, name, "input %d has no data: a value of a compiled call's recording that was not computed", i);
      goto fail;
    }
  if (!record && op_table[op].check && op_table[op].check(op, in, n, a, file, line)) goto fail;
  if (op_table[op].kind == KIND_VIEW) {
    bool no_layout = false;
    if (!(out = view_result(op, in[0], a, record, &no_layout))) {
      err_set(file, line, name, no_layout ? "no view layout" : "out of memory");
      goto fail;
    }
  } else {
    if (too_many_elements(ndim, shape)) {
      char b[SHAPE_BUF];
      err_set(file, line, name, "the result %s has too many elements", err_shape(b, ndim, shape));
      goto fail;
    }
    out = record ? tensor_new_meta(dt, ndim, shape) : tensor_new(dt, ndim, shape);
    if (!out) {
      err_set(file, line, name, "out of memory");
      goto fail;
    }
    if (!record && op_kernel(op, in, n, a, out)) {
      err_set(file, line, name, "%s", err_kernel_failed());
      goto fail;
    }
  }
  if (ag_record(op, in, n, a, out, file, line)) goto fail;
  if (hooks && hooks->op) hooks->op(hooks->ctx, op, in, n, a, out, file, line);
done:
  for (int i = 0; i < 3; i++) /* no call for the casts an op did not need (most) */
    if (cast[i]) kiln_release(cast[i]);
  return out;
fail:
  kiln_release(out);
  for (int i = 0; i < 3; i++)
    if (cast[i]) kiln_release(cast[i]);
  return NULL;
}

/* Narrow dtypes compute wide: f16 and bf16 inputs are copied to f32, i32 to
 * i64, the kernel runs on those, and a narrow result is rounded back to its
 * dtype once, as torch computes a bf16 op in f32. Casts and copies convert by
 * themselves. */
static int kernel_wide(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  kiln_tensor *small[4], **w = n <= 4 ? small : alloc_malloc(sizeof *w * (size_t)n), *wo = out;
  if (!w) return -1;
  int rc = 0;
  for (int i = 0; i < n; i++) {
    w[i] = in[i];
    if (rc || !dtype_is_narrow(in[i]->dtype)) continue;
    if (!(w[i] = tensor_new(dtype_wide(in[i]->dtype), in[i]->ndim, in[i]->shape))) rc = -1;
    else pw_copy(w[i], in[i]);
  }
  if (!rc && dtype_is_narrow(out->dtype) && !(wo = tensor_new(dtype_wide(out->dtype), out->ndim, out->shape))) rc = -1;
  if (!rc) rc = op_table[op].kernel(op, w, n, a, wo);
  if (!rc && wo != out) pw_copy(out, wo);
  if (wo != out) kiln_release(wo);
  for (int i = 0; i < n; i++)
    if (w[i] != in[i]) kiln_release(w[i]);
  if (w != small) alloc_free(w);
  return rc;
}

int op_kernel(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  static const op_attrs none;
  if (!op_table[op].kernel) return -1;
  if (!a) a = &none;
  bool narrow = dtype_is_narrow(out->dtype);
  for (int i = 0; i < n && !narrow; i++) narrow = dtype_is_narrow(in[i]->dtype);
  if (narrow && op != OP_CAST && op != OP_COPY) return kernel_wide(op, in, n, a, out);
  return op_table[op].kernel(op, in, n, a, out);
}

kiln_tensor *op_run(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line) {
  return dispatch_owned(op, in, n, a, file, line);
}

int op_run_into(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out, const char *file, int line) {
  static const op_attrs none;
  if (!a) a = &none;
  const op_info *oi = &op_table[op];
  if (oi->kind == KIND_VIEW || !oi->kernel || (oi->arity >= 0 && n != oi->arity) || n < 1) return 1;
  for (int i = oi->dt.first + 1; oi->dt.promote && i < n; i++)
    if (in[i]->dtype != in[oi->dt.first]->dtype) return 1;
  kiln_dtype dt;
  int ndim;
  int64_t shape[MAXD];
  if (shape_rule(op, in, n, a, &dt, &ndim, shape, file, line)) return -1;
  if (dt != out->dtype || ndim != out->ndim || memcmp(shape, out->shape, sizeof *shape * (size_t)ndim) ||
      !tensor_contiguous(out) || out->offset)
    return 1;
  if (oi->check && oi->check(op, in, n, a, file, line)) return -1;
  if (op_kernel(op, in, n, a, out)) return err_set(file, line, oi->name, "%s", err_kernel_failed()), -1;
  return 0;
}

kiln_tensor *op_dispatch(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line) {
  kiln_tensor *t = dispatch_owned(op, in, n, a, file, line);
  if (t && !(t = scope_adopt(t))) err_set(file, line, op_table[op].name, "out of memory");
  return t;
}

bool cpu_avx512_turned_off(void) {
  const char *f = getenv("KILN_JIT_FEATURES");
  return f && strstr(f, "-avx512f");
}
