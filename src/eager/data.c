/* Data movement kernels: cat, index_select, index_add and slice_scatter. Each
 * writes through a view of the output and the strided copy, so inputs may
 * have any layout. */
#include <string.h>

#include "eager/eager.h"
#include "eager/pool.h"

/* out's elements [start, start+len) along dim, as a view (no refcount). */
static kiln_tensor narrow(const kiln_tensor *t, int dim, int64_t start, int64_t len, int64_t step) {
  kiln_tensor v = *t;
  v.shape[dim] = len;
  v.stride[dim] = t->stride[dim] * step;
  if (len > 0) v.offset = t->offset + start * t->stride[dim];
  return v;
}

int k_cat(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op;
  int64_t at = 0;
  for (int i = 0; i < n; i++) {
    int64_t len = in[i]->shape[a->dim];
    if (len == 0) continue;
    kiln_tensor v = narrow(out, a->dim, at, len, 1);
    pw_copy(&v, in[i]);
    at += len;
  }
  return 0;
}

static int64_t index_at(const kiln_tensor *idx, int64_t i) {
  return ((const int64_t *)idx->st->data)[idx->offset + i * idx->stride[0]];
}

typedef struct gather_job {
  const kiln_tensor *src, *idx;
  kiln_tensor *out;
  int dim;
} gather_job;

static void gather_chunk(void *c, int64_t b, int64_t e) {
  gather_job *j = c;
  for (int64_t i = b; i < e; i++) {
    kiln_tensor dst = narrow(j->out, j->dim, i, 1, 1);
    kiln_tensor src = narrow(j->src, j->dim, index_at(j->idx, i), 1, 1);
    pw_copy(&dst, &src);
  }
}

int k_index_select(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  gather_job j = {in[0], in[1], out, a->dim};
  int64_t row = shape_numel(out->ndim, out->shape) / (out->shape[a->dim] ? out->shape[a->dim] : 1);
  pool_parallel_for(in[1]->shape[0], 4096 / (row ? row : 1) + 1, gather_chunk, &j);
  return 0;
}

int k_index_add(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  pw_copy(out, in[0]);
  const kiln_tensor *idx = in[1], *src = in[2];
  /* sequential: repeated indices add up in index order, the same on every run */
  for (int64_t i = 0; i < idx->shape[0]; i++) {
    kiln_tensor d = narrow(out, a->dim, index_at(idx, i), 1, 1);
    kiln_tensor s = narrow(src, a->dim, i, 1, 1);
    pw_binary(OP_ADD, &d, &d, &s);
  }
  return 0;
}

int k_slice_scatter(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  /* compiled code may scatter into in[0] itself (codegen's scatter_in_place) */
  bool same = tensor_data(out) == tensor_data(in[0]) && out->ndim == in[0]->ndim &&
              !memcmp(out->stride, in[0]->stride, sizeof(int64_t) * (size_t)out->ndim);
  if (!same) pw_copy(out, in[0]);
  int64_t len = in[1]->shape[a->dim];
  if (len == 0) return 0;
  kiln_tensor v = narrow(out, a->dim, a->start.c, len, a->step);
  pw_copy(&v, in[1]);
  return 0;
}
