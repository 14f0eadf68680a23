/* Data movement kernels: cat, index_select, index_add, slice_scatter, gather,
 * scatter_add, index_copy, tril, triu, pad and cumsum. Most write through a
 * view of the output and the strided copy, so inputs may have any layout. */
#include <stdlib.h>
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

/* out = x with src's rows along dim added (index_add) or written (index_copy)
 * at the indices; sequential, so repeated indices add up in index order, or
 * the last write wins, the same on every run. */
/* Whether out is in[0] itself: compiled code may write into it in place (codegen's scatter_in_place). */
static bool same_tensor(const kiln_tensor *out, const kiln_tensor *in) {
  return tensor_data(out) == tensor_data(in) && out->ndim == in->ndim &&
         !memcmp(out->stride, in->stride, sizeof(int64_t) * (size_t)out->ndim);
}

static int index_rows(op_id op, kiln_tensor *const *in, const op_attrs *a, kiln_tensor *out) {
  if (!same_tensor(out, in[0])) pw_copy(out, in[0]);
  const kiln_tensor *idx = in[1], *src = in[2];
  for (int64_t i = 0; i < idx->shape[0]; i++) {
    kiln_tensor d = narrow(out, a->dim, index_at(idx, i), 1, 1);
    kiln_tensor s = narrow(src, a->dim, i, 1, 1);
    if (op == OP_INDEX_ADD) pw_binary(OP_ADD, &d, &d, &s);
    else pw_copy(&d, &s);
  }
  return 0;
}

int k_index_add(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)n;
  return index_rows(op, in, a, out);
}

int k_slice_scatter(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  if (!same_tensor(out, in[0])) pw_copy(out, in[0]);
  int64_t len = in[1]->shape[a->dim];
  if (len == 0) return 0;
  kiln_tensor v = narrow(out, a->dim, a->start.c, len, a->step);
  pw_copy(&v, in[1]);
  return 0;
}

/* out = x + index_add(zeros_like(x), dim, idx, src), bit for bit, without
 * the zeros: each row's sources are summed first, from 0 in index order, and
 * the sum added to x's row once; every other element gets x + 0 (so -0
 * becomes +0, as the sum would make it). The compiler makes this op from
 * that sum (passes.c): a tied embedding's gradient then adds into the
 * head's instead of needing a second buffer of the table's size. */
typedef struct row_pos {
  int64_t row, i;
} row_pos;

static int row_pos_cmp(const void *a, const void *b) {
  const row_pos *x = a, *y = b;
  return x->row != y->row ? (x->row > y->row) - (x->row < y->row) : (x->i > y->i) - (x->i < y->i);
}

int k_index_add_to(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  const kiln_tensor *idx = in[1], *src = in[2];
  int64_t m = idx->shape[0], one[MAXD];
  for (int d = 0; d < out->ndim; d++) one[d] = d == a->dim ? 1 : out->shape[d];
  kiln_tensor *acc = tensor_new(out->dtype, out->ndim, one);
  row_pos *ord = m ? malloc(sizeof *ord * (size_t)m) : NULL;
  if (!acc || (m && !ord)) {
    kiln_release(acc);
    free(ord);
    return -1;
  }
  pw_fill(acc, 0);
  kiln_tensor zero = *acc; /* acc's first element, broadcast: x + 0 everywhere */
  for (int d = 0; d < zero.ndim; d++) zero.shape[d] = out->shape[d], zero.stride[d] = 0;
  pw_binary(OP_ADD, out, in[0], &zero);
  for (int64_t i = 0; i < m; i++) ord[i] = (row_pos){index_at(idx, i), i};
  qsort(ord, (size_t)m, sizeof *ord, row_pos_cmp);
  for (int64_t g = 0; g < m;) {
    pw_fill(acc, 0);
    int64_t e = g;
    for (; e < m && ord[e].row == ord[g].row; e++) {
      kiln_tensor s = narrow(src, a->dim, ord[e].i, 1, 1);
      pw_binary(OP_ADD, acc, acc, &s);
    }
    kiln_tensor d = narrow(out, a->dim, ord[g].row, 1, 1);
    pw_binary(OP_ADD, &d, &d, acc);
    g = e;
  }
  free(ord);
  kiln_release(acc);
  return 0;
}

/* ---- gather, scatter_add, index_copy ---- */

/* Steps the row-major index pos over shape; false after the last. */
static bool next_pos(int ndim, const int64_t *shape, int64_t *pos) {
  for (int d = ndim - 1; d >= 0; d--) {
    if (++pos[d] < shape[d]) return true;
    pos[d] = 0;
  }
  return false;
}

static int64_t offset_of(const kiln_tensor *t, const int64_t *pos, int skip) {
  int64_t off = t->offset;
  for (int d = 0; d < t->ndim; d++)
    if (d != skip) off += pos[d] * t->stride[d];
  return off;
}

/* For every position p of the index (in row-major order): x's element at p
 * with dim replaced by the index's value there, and dst's (or src's) at p.
 * gather copies x's into out; scatter_add adds src's into out's at x's place. */
static void walk_index(const kiln_tensor *idx, int dim, const kiln_tensor *x, const kiln_tensor *y, bool add) {
  int64_t n = shape_numel(idx->ndim, idx->shape), pos[MAXD] = {0};
  size_t es = kiln_dtype_size(x->dtype);
  char *xb = x->st->data, *yb = y->st->data;
  const int64_t *ib = idx->st->data;
  for (int64_t i = 0; i < n; i++, next_pos(idx->ndim, idx->shape, pos)) {
    int64_t k = ib[offset_of(idx, pos, -1)];
    int64_t xo = offset_of(x, pos, dim) + k * x->stride[dim], yo = offset_of(y, pos, -1);
    if (!add) {
      memcpy(yb + yo * (int64_t)es, xb + xo * (int64_t)es, es);
      continue;
    }
    /* scatter_add: x is out (written), y the source; in index order, so repeats add up the same on every run */
    switch (x->dtype) {
    case KILN_F32: ((float *)xb)[xo] += ((const float *)yb)[yo]; break;
    case KILN_F64: ((double *)xb)[xo] += ((const double *)yb)[yo]; break;
    case KILN_I64: ((int64_t *)xb)[xo] = (int64_t)((uint64_t)((int64_t *)xb)[xo] + (uint64_t)((const int64_t *)yb)[yo]); break;
    default: break; /* bool is refused by the op; narrow dtypes arrive widened */
    }
  }
}

int k_gather(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  walk_index(in[1], a->dim, in[0], out, false);
  return 0;
}

int k_scatter_add(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  pw_copy(out, in[0]);
  walk_index(in[1], a->dim, out, in[2], true);
  return 0;
}

int k_index_copy(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)n;
  return index_rows(op, in, a, out);
}

/* ---- tril, triu, pad, cumsum ---- */

int k_tri(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)n;
  pw_copy(out, in[0]);
  int nd = out->ndim;
  int64_t rows = out->shape[nd - 2], cols = out->shape[nd - 1];
  if (!rows || !cols) return 0;
  /* row i keeps columns j with j - i <= k (tril) or j - i >= k (triu); the rest of the row is zeroed */
  for (int64_t i = 0; i < rows; i++) {
    kiln_tensor row = narrow(out, nd - 2, i, 1, 1);
    int64_t lo, hi; /* the columns to zero: [lo, hi) */
    if (op == OP_TRIL) {
      lo = a->k > cols - 1 - i ? cols : (i + a->k + 1 < 0 ? 0 : i + a->k + 1);
      hi = cols;
    } else {
      lo = 0;
      hi = a->k < -i ? 0 : (a->k > cols - i ? cols : i + a->k);
    }
    if (hi > lo) {
      kiln_tensor z = narrow(&row, nd - 1, lo, hi - lo, 1);
      pw_fill(&z, 0);
    }
  }
  return 0;
}

int k_pad(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  pw_fill(out, a->value);
  /* the part of x that stays, and where it goes: a negative pad crops */
  kiln_tensor src = *in[0], dst = *out;
  for (int i = 0; i < a->nints / 2; i++) {
    int d = out->ndim - 1 - i;
    int64_t l = a->ints[2 * i], s0 = l < 0 ? -l : 0, d0 = l > 0 ? l : 0;
    int64_t len = src.shape[d] - s0 < out->shape[d] - d0 ? src.shape[d] - s0 : out->shape[d] - d0;
    if (len <= 0) return 0;
    src = narrow(&src, d, s0, len, 1);
    dst = narrow(&dst, d, d0, len, 1);
  }
  if (shape_numel(src.ndim, src.shape)) pw_copy(&dst, &src);
  return 0;
}

/* The offset of row r of t along dim (r counts the other dims in row-major order). */
static int64_t row_offset(const kiln_tensor *t, int dim, int64_t r) {
  int64_t off = t->offset;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (d == dim) continue;
    off += (r % t->shape[d]) * t->stride[d];
    r /= t->shape[d];
  }
  return off;
}

int k_cumsum(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  const kiln_tensor *x = in[0];
  if (x->ndim == 0) {
    pw_copy(out, x);
    return 0;
  }
  int64_t len = x->shape[a->dim], total = shape_numel(x->ndim, x->shape);
  if (!len) return 0;
  int64_t xs = x->stride[a->dim], os = out->stride[a->dim];
  for (int64_t r = 0, rows = total / len; r < rows; r++) {
    int64_t xo = row_offset(x, a->dim, r), oo = row_offset(out, a->dim, r);
    if (x->dtype == KILN_I64) {
      const int64_t *p = (const int64_t *)x->st->data + xo;
      int64_t *o = (int64_t *)out->st->data + oo;
      uint64_t s = 0;
      for (int64_t i = 0; i < len; i++) o[i * os] = (int64_t)(s += (uint64_t)p[i * xs]);
    } else if (x->dtype == KILN_F32) {
      /* accumulated in f64: a long f32 running sum keeps its accuracy */
      const float *p = (const float *)x->st->data + xo;
      float *o = (float *)out->st->data + oo;
      double s = 0;
      for (int64_t i = 0; i < len; i++) o[i * os] = (float)(s += p[i * xs]);
    } else {
      const double *p = (const double *)x->st->data + xo;
      double *o = (double *)out->st->data + oo;
      double s = 0;
      for (int64_t i = 0; i < len; i++) o[i * os] = s += p[i * xs];
    }
  }
  return 0;
}

/* ---- topk: the indices, best first ---- */

typedef struct topk_row {
  const char *base; /* the row's first element */
  int64_t stride;   /* in elements */
  kiln_dtype dt;
  bool largest;
} topk_row;

static _Thread_local const topk_row *topk_cur;

static double topk_value(int64_t i) {
  const topk_row *r = topk_cur;
  switch (r->dt) {
  case KILN_F32: return ((const float *)r->base)[i * r->stride];
  case KILN_F64: return ((const double *)r->base)[i * r->stride];
  default: return 0;
  }
}

/* a before b: the better value (NaN the largest of all), then the lower index */
static int topk_cmp(const void *pa, const void *pb) {
  int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
  const topk_row *r = topk_cur;
  int c = 0;
  if (r->dt == KILN_I64) {
    int64_t x = ((const int64_t *)r->base)[a * r->stride], y = ((const int64_t *)r->base)[b * r->stride];
    c = x < y ? -1 : x > y;
  } else {
    double x = topk_value(a), y = topk_value(b);
    bool nx = x != x, ny = y != y;
    c = nx || ny ? (int)nx - (int)ny : (x < y ? -1 : x > y);
  }
  if (r->largest) c = -c;
  return c ? c : (a < b ? -1 : a > b);
}

int k_topk(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  const kiln_tensor *x = in[0];
  int dim = a->dim;
  int64_t len = x->ndim ? x->shape[dim] : 1, rows = len ? shape_numel(x->ndim, x->shape) / len : 0;
  if (!a->k || !rows) return 0;
  int64_t *order = alloc_malloc(sizeof *order * (size_t)len);
  if (!order) return -1;
  size_t es = kiln_dtype_size(x->dtype);
  for (int64_t r = 0; r < rows; r++) {
    topk_row row = {(const char *)x->st->data + (x->ndim ? row_offset(x, dim, r) : x->offset) * (int64_t)es,
                    x->ndim ? x->stride[dim] : 0, x->dtype, a->flag};
    for (int64_t i = 0; i < len; i++) order[i] = i;
    topk_cur = &row;
    qsort(order, (size_t)len, sizeof *order, topk_cmp);
    int64_t *o = (int64_t *)out->st->data + (out->ndim ? row_offset(out, dim, r) : out->offset);
    int64_t os = out->ndim ? out->stride[dim] : 0;
    for (int64_t i = 0; i < a->k; i++) o[i * os] = order[i];
  }
  topk_cur = NULL;
  alloc_free(order);
  return 0;
}
