/* View layouts: reshape, permute, expand and slice of a tensor as new shape,
 * strides and offset over the same storage. The attributes' dims are
 * constants here (eager). */
#include <string.h>

#include "eager/eager.h"

/* Strides for viewing t as (ndim, shape) without a copy, the way NumPy and
 * torch do it: each run of input dims that is contiguous among itself can be
 * split or merged freely. 0 on success, 1 when a copy is needed. */
static int reshape_strides(const kiln_tensor *t, int ndim, const int64_t *shape, int64_t *stride) {
  int64_t numel = shape_numel(t->ndim, t->shape);
  if (numel == 0 || tensor_contiguous(t)) {
    contiguous_strides(ndim, shape, stride);
    return 0;
  }
  int view_d = ndim - 1;
  int64_t chunk_base = t->stride[t->ndim - 1], tensor_numel = 1, view_numel = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    tensor_numel *= t->shape[d];
    if (d == 0 || (t->shape[d - 1] != 1 && t->stride[d - 1] != tensor_numel * chunk_base)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        stride[view_d] = view_numel * chunk_base;
        view_numel *= shape[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return 1;
      if (d > 0) {
        chunk_base = t->stride[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1 ? 0 : 1;
}

int view_layout(op_id op, const kiln_tensor *t, const op_attrs *a, int *ndim, int64_t *shape, int64_t *stride,
                int64_t *offset) {
  *offset = t->offset;
  switch (op) {
  case OP_RESHAPE:
    *ndim = a->ndim;
    for (int i = 0; i < a->ndim; i++) shape[i] = a->shape[i].c;
    return reshape_strides(t, a->ndim, shape, stride);
  case OP_PERMUTE:
    *ndim = t->ndim;
    for (int i = 0; i < t->ndim; i++) {
      shape[i] = t->shape[a->perm[i]];
      stride[i] = t->stride[a->perm[i]];
    }
    return 0;
  case OP_EXPAND: {
    *ndim = a->ndim;
    int lead = a->ndim - t->ndim;
    for (int i = 0; i < a->ndim; i++) {
      int j = i - lead;
      shape[i] = a->shape[i].c;
      stride[i] = (j < 0 || t->shape[j] != shape[i]) ? 0 : t->stride[j];
    }
    return 0;
  }
  case OP_SLICE: {
    *ndim = t->ndim;
    memcpy(shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
    memcpy(stride, t->stride, sizeof(int64_t) * (size_t)t->ndim);
    int d = a->dim;
    /* written so that a huge step cannot overflow: such a slice has one element, whose stride never applies */
    int64_t start = a->start.c, end = a->end.c;
    int64_t len = end > start ? 1 + (end - start - 1) / a->step : 0;
    shape[d] = len;
    if (__builtin_mul_overflow(t->stride[d], a->step, &stride[d])) stride[d] = t->stride[d];
    if (len > 0) *offset += start * t->stride[d];
    return 0;
  }
  default:
    return -1;
  }
}
