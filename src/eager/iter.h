/* The strided iterator under every pointwise and reduction kernel: operands
 * broadcast to one shape, dims of size 1 dropped, dims that are contiguous
 * for every operand merged, then the innermost dim handed to a loop that has
 * fast paths for unit and zero strides. Internal to src/eager. */
#ifndef KILN_EAGER_ITER_H
#define KILN_EAGER_ITER_H

#include "eager/eager.h"

#define ITER_MAXOP 4

typedef struct iter {
  int nop;   /* operand 0 is the destination */
  int ndim;  /* after merging; >= 1 */
  int64_t shape[MAXD];
  int64_t stride[ITER_MAXOP][MAXD]; /* in elements; 0 where broadcast */
  char *base[ITER_MAXOP];
  int esize[ITER_MAXOP];
  int64_t numel;
} iter;

/* Inner loop: n elements, p[i] operand pointers, s[i] their element strides. */
typedef void (*iter_inner)(char **p, const int64_t *s, int64_t n, const void *ctx);

/* Builds the iterator of dst and ops[0..nops) broadcast to dst's shape. When
 * reduce is true, dst's shape is the input's with reduced dims of size 1 and
 * dst gets stride 0 there. */
void iter_build(iter *it, const kiln_tensor *dst, const kiln_tensor *const *ops, int nops);
/* Runs inner over the linear range [begin, end) of the iteration space. */
void iter_run_range(const iter *it, iter_inner fn, const void *ctx, int64_t begin, int64_t end);
/* Runs inner over everything, split across the pool when large. */
void iter_run(const iter *it, iter_inner fn, const void *ctx);
/* Reorders dims so operand `by` walks memory in increasing-stride order
 * (outermost = largest stride), then merges again. */
void iter_sort_by(iter *it, int by);

#define PARALLEL_GRAIN (1 << 15)

/* NaN-propagating max/min, as NumPy's maximum/minimum and max/min reductions. */
#define MAXNAN(x, y) (((x) > (y) || (x) != (x)) ? (x) : (y))
#define MINNAN(x, y) (((x) < (y) || (x) != (x)) ? (x) : (y))

#endif
