/* The strided iterator: see iter.h. */
#include <string.h>

#include "eager/iter.h"
#include "eager/pool.h"

static void merge_dims(iter *it) {
  /* drop size-1 dims, then merge neighbours that are contiguous for every operand */
  int k = 0;
  for (int d = 0; d < it->ndim; d++) {
    if (it->shape[d] == 1) continue;
    it->shape[k] = it->shape[d];
    for (int o = 0; o < it->nop; o++) it->stride[o][k] = it->stride[o][d];
    k++;
  }
  it->ndim = k;
  if (k == 0) {
    it->ndim = 1;
    it->shape[0] = 1;
    for (int o = 0; o < it->nop; o++) it->stride[o][0] = 0;
    return;
  }
  int w = 0;
  for (int d = 1; d < it->ndim; d++) {
    bool can = true;
    for (int o = 0; o < it->nop && can; o++) can = it->stride[o][w] == it->stride[o][d] * it->shape[d];
    if (can) {
      it->shape[w] *= it->shape[d];
      for (int o = 0; o < it->nop; o++) it->stride[o][w] = it->stride[o][d];
    } else {
      w++;
      it->shape[w] = it->shape[d];
      for (int o = 0; o < it->nop; o++) it->stride[o][w] = it->stride[o][d];
    }
  }
  it->ndim = w + 1;
}

void iter_build(iter *it, const kiln_tensor *dst, const kiln_tensor *const *ops, int nops) {
  memset(it, 0, sizeof *it);
  it->nop = nops + 1;
  it->ndim = dst->ndim;
  const kiln_tensor *all[ITER_MAXOP];
  all[0] = dst;
  for (int i = 0; i < nops; i++) all[i + 1] = ops[i];
  /* the iteration shape is the largest of dst and operands (dst is smaller only for reductions) */
  int nd = dst->ndim;
  for (int i = 1; i < it->nop; i++) nd = all[i]->ndim > nd ? all[i]->ndim : nd;
  it->ndim = nd;
  for (int d = 0; d < nd; d++) {
    int64_t s = 1;
    for (int i = 0; i < it->nop; i++) {
      int j = d - (nd - all[i]->ndim);
      if (j >= 0 && all[i]->shape[j] != 1) s = all[i]->shape[j];
    }
    it->shape[d] = s;
  }
  for (int i = 0; i < it->nop; i++) {
    const kiln_tensor *t = all[i];
    it->base[i] = tensor_data(t);
    it->esize[i] = (int)kiln_dtype_size(t->dtype);
    for (int d = 0; d < nd; d++) {
      int j = d - (nd - t->ndim);
      it->stride[i][d] = (j < 0 || t->shape[j] == 1) ? 0 : t->stride[j];
    }
  }
  it->numel = shape_numel(nd, it->shape);
  merge_dims(it);
}

void iter_sort_by(iter *it, int by) {
  /* insertion sort of dims by decreasing |stride| of operand `by`; stable */
  for (int i = 1; i < it->ndim; i++) {
    for (int j = i; j > 0 && it->stride[by][j] > it->stride[by][j - 1]; j--) {
      int64_t t = it->shape[j];
      it->shape[j] = it->shape[j - 1];
      it->shape[j - 1] = t;
      for (int o = 0; o < it->nop; o++) {
        t = it->stride[o][j];
        it->stride[o][j] = it->stride[o][j - 1];
        it->stride[o][j - 1] = t;
      }
    }
  }
  merge_dims(it);
}

void iter_run_range(const iter *it, iter_inner fn, const void *ctx, int64_t begin, int64_t end) {
  int nd = it->ndim, last = nd - 1;
  int64_t idx[MAXD];
  int64_t rem = begin;
  for (int d = last; d >= 0; d--) {
    idx[d] = rem % it->shape[d];
    rem /= it->shape[d];
  }
  char *p[ITER_MAXOP];
  int64_t s[ITER_MAXOP];
  for (int o = 0; o < it->nop; o++) s[o] = it->stride[o][last];
  int64_t cur = begin;
  while (cur < end) {
    for (int o = 0; o < it->nop; o++) {
      int64_t off = 0;
      for (int d = 0; d < nd; d++) off += idx[d] * it->stride[o][d];
      p[o] = it->base[o] + off * it->esize[o];
    }
    int64_t n = it->shape[last] - idx[last];
    if (n > end - cur) n = end - cur;
    fn(p, s, n, ctx);
    cur += n;
    idx[last] += n;
    for (int d = last; d > 0 && idx[d] >= it->shape[d]; d--) {
      idx[d] = 0;
      idx[d - 1]++;
    }
  }
}

typedef struct run_job {
  const iter *it;
  iter_inner fn;
  const void *ctx;
} run_job;

static void run_chunk(void *c, int64_t b, int64_t e) {
  run_job *j = c;
  iter_run_range(j->it, j->fn, j->ctx, b, e);
}

void iter_run(const iter *it, iter_inner fn, const void *ctx) {
  if (it->numel == 0) return;
  run_job j = {it, fn, ctx};
  pool_parallel_for(it->numel, PARALLEL_GRAIN, run_chunk, &j);
}
