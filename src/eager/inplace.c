/* In-place ops: add_ sub_ mul_ copy_ fill_ zero_ index_copy_. They write into dst's own
 * storage (bumping its version, which autograd checks), so they refuse what
 * would make the result depend on the order of writes (src overlapping dst
 * other than exactly, dst with repeated elements) and writes into tensors
 * autograd may still need. */
#include <inttypes.h>
#include <string.h>

#include "eager/eager.h"
#include "eager/pool.h"

/* The element range [lo, hi] that t touches in its storage. */
static void extent(const kiln_tensor *t, int64_t *lo, int64_t *hi) {
  *lo = *hi = t->offset;
  for (int i = 0; i < t->ndim; i++) {
    int64_t span = (t->shape[i] - 1) * t->stride[i];
    if (span < 0) *lo += span;
    else *hi += span;
  }
}

static bool has_repeats(const kiln_tensor *t) {
  for (int i = 0; i < t->ndim; i++)
    if (t->shape[i] > 1 && t->stride[i] == 0) return true;
  return false;
}

static bool same_layout(const kiln_tensor *a, const kiln_tensor *b) {
  return a->offset == b->offset && a->ndim == b->ndim && !memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim) &&
         !memcmp(a->stride, b->stride, sizeof(int64_t) * (size_t)a->ndim);
}

static int check_dst(const char *op, kiln_tensor *dst, const char *file, int line) {
  if (tensor_bad_arg(dst, file, line, op, "dst")) return -1;
  if (grad_mode() && dst->requires_grad)
    return err_set(file, line, op,
                   "dst requires grad: an in-place write would corrupt autograd; do it inside kiln_no_grad_begin/end"),
           -1;
  return 0;
}

static kiln_tensor *inplace(op_id op, const char *name, kiln_tensor *dst, kiln_tensor *src, const char *file,
                            int line) {
  if (check_dst(name, dst, file, line)) return NULL;
  if (tensor_bad_arg(src, file, line, name, "src")) return NULL;
  char b0[SHAPE_BUF], b1[SHAPE_BUF];
  int nd;
  int64_t shape[MAXD];
  if (shape_broadcast(dst->ndim, dst->shape, src->ndim, src->shape, &nd, shape) || nd != dst->ndim ||
      memcmp(shape, dst->shape, sizeof(int64_t) * (size_t)nd))
    return err_set(file, line, name, "src %s does not broadcast to dst %s", err_shape(b0, src->ndim, src->shape),
                   err_shape(b1, dst->ndim, dst->shape));
  if (grad_mode() && src->requires_grad)
    return err_set(file, line, name, "src requires grad: in-place ops do not record history; use the out-of-place op");
  if (has_repeats(dst)) return err_set(file, line, name, "dst %s has repeated elements (an expanded view)", err_shape(b0, dst->ndim, dst->shape));
  if (dst->dtype == KILN_BOOL && op != OP_COPY) return err_set(file, line, name, "dst is bool");
  if (src->st == dst->st && !same_layout(src, dst) && shape_numel(src->ndim, src->shape) && shape_numel(dst->ndim, dst->shape)) {
    int64_t l0, h0, l1, h1;
    extent(dst, &l0, &h0);
    extent(src, &l1, &h1);
    if (l0 <= h1 && l1 <= h0)
      return err_set(file, line, name, "src overlaps dst in memory; compute the result out of place, then copy_ it");
  }
  kiln_tensor *cast = NULL;
  if (src->dtype != dst->dtype && op != OP_COPY) {
    kiln_no_grad_begin();
    cast = kiln_cast_at(src, dst->dtype, file, line);
    kiln_no_grad_end();
    if (!cast) return NULL;
    kiln_retain(cast); /* ours until the end, whatever the scope */
    src = cast;
  }
  const trace_hooks *h = dispatch_hooks();
  if (h && h->inplace) h->inplace(h->ctx, op, dst, src, 0, file, line);
  /* a recording writes nothing: the write is one of its events. The hooks
   * are read again: a replay may have handed over to a recording, which
   * may have escaped at this write (then it is done here, eagerly) */
  h = dispatch_hooks();
  if (!(h && h->record)) {
    if (op == OP_COPY) pw_copy(dst, src);
    else pw_binary(op, dst, dst, src);
  }
  atomic_fetch_add(&dst->st->version, 1);
  kiln_release(cast);
  return dst;
}

kiln_tensor *kiln_add__at(kiln_tensor *d, kiln_tensor *s, const char *f, int l) { return inplace(OP_ADD, "add_", d, s, f, l); }
kiln_tensor *kiln_sub__at(kiln_tensor *d, kiln_tensor *s, const char *f, int l) { return inplace(OP_SUB, "sub_", d, s, f, l); }
kiln_tensor *kiln_mul__at(kiln_tensor *d, kiln_tensor *s, const char *f, int l) { return inplace(OP_MUL, "mul_", d, s, f, l); }
kiln_tensor *kiln_copy__at(kiln_tensor *d, kiln_tensor *s, const char *f, int l) { return inplace(OP_COPY, "copy_", d, s, f, l); }

kiln_tensor *kiln_fill__at(kiln_tensor *dst, double v, const char *file, int line) {
  if (check_dst("fill_", dst, file, line)) return NULL;
  const trace_hooks *h = dispatch_hooks();
  if (h && h->inplace) h->inplace(h->ctx, OP_COUNT, dst, NULL, v, file, line);
  h = dispatch_hooks(); /* as in inplace() */
  if (!(h && h->record)) pw_fill(dst, v);
  atomic_fetch_add(&dst->st->version, 1);
  return dst;
}

kiln_tensor *kiln_zero__at(kiln_tensor *dst, const char *file, int line) {
  if (tensor_bad_arg(dst, file, line, "zero_", "dst")) return NULL;
  return kiln_fill__at(dst, 0.0, file, line) ? dst : NULL;
}

/* index_copy_: the out-of-place index_copy written into dst, every check
 * made first, so that errors name index_copy_. */
kiln_tensor *kiln_index_copy__at(kiln_tensor *dst, int dim, kiln_tensor *idx, kiln_tensor *src, const char *file, int line) {
  const char *name = "index_copy_";
  if (check_dst(name, dst, file, line) || tensor_bad_arg(idx, file, line, name, "index") ||
      tensor_bad_arg(src, file, line, name, "src"))
    return NULL;
  char b[SHAPE_BUF];
  int d = axis_norm(dim, dst->ndim);
  if (d < 0 || dst->ndim == 0) return err_set(file, line, name, "dim %d is out of range for shape %s", dim, err_shape(b, dst->ndim, dst->shape));
  if (grad_mode() && src->requires_grad)
    return err_set(file, line, name, "src requires grad: in-place ops do not record history; use kiln_index_copy");
  op_attrs a = {.dim = d};
  kiln_tensor *in[3] = {dst, idx, src};
  kiln_dtype dt;
  int nd;
  int64_t shape[MAXD];
  if (shape_rule_as(OP_INDEX_COPY, name, in, 3, &a, &dt, &nd, shape, file, line)) return NULL;
  /* a recording's index_copy checks them when it runs (on every call's data) */
  for (int64_t i = 0; !dispatch_recording() && !idx->st->meta && i < idx->shape[0]; i++) {
    double k = tensor_get(idx, i);
    if (k < 0 || k >= (double)dst->shape[d])
      return err_set(file, line, name, "index %.0f at position %" PRId64 " is out of range [0, %" PRId64 ")", k, i, dst->shape[d]);
  }
  kiln_scope_begin();
  kiln_tensor *r = op_dispatch(OP_INDEX_COPY, in, 3, &a, file, line);
  kiln_tensor *y = r ? inplace(OP_COPY, name, dst, r, file, line) : NULL;
  kiln_scope_end();
  return y;
}

void kiln_set_num_threads(int n) {
  settings_note();
  pool_set_num_threads(n);
}
int kiln_get_num_threads(void) { return pool_num_threads(); }
