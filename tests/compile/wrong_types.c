/* Calls that must not compile (tests/compile/run.sh builds this file once
 * per case, with -DCASE_<name>, and expects an error at the line marked
 * "case: <name>"), and, with no case defined, the same calls written right,
 * which must compile without a warning. */
#include <stdint.h>

#include "kiln.h"

kiln_tensor *calls(kiln_tensor *x);

kiln_tensor *calls(kiln_tensor *x) {
  int64_t shape[2] = {3, 4};
  int axes[1] = {0};
  int perm[2] = {1, 0};
  kiln_tensor *r = kiln_zeros(KILN_F32, 2, shape);
  r = kiln_randn(KILN_F32, 2, shape, 1);
  r = kiln_reshape(x, 2, (int64_t[]){3, 4});
  r = kiln_sum_axes(x, axes, 1, false);
  r = kiln_permute(x, perm);
  r = kiln_add(x, r);
  r = kiln_cat((kiln_tensor *[]){x, r}, 2, 0);
  r = kiln_zeros(KILN_F32, KILN_SHAPE(1, 1, 1, 1, 1, 1, 1, 1));
  r = kiln_zeros(KILN_F32, 2, (int64_t[]){3, 4});
#ifdef CASE_int_shape
  int ishape[2] = {3, 4};
  r = kiln_zeros(KILN_F32, 2, ishape); /* case: int_shape */
#endif
#ifdef CASE_int_shape_literal
  r = kiln_reshape(x, 2, (int[]){3, 4}); /* case: int_shape_literal */
#endif
#ifdef CASE_int_shape_not_last
  int ishape[2] = {3, 4};
  r = kiln_randn(KILN_F32, 2, ishape, 1); /* case: int_shape_not_last */
#endif
#ifdef CASE_i64_axes
  r = kiln_sum_axes(x, (int64_t[]){0}, 1, false); /* case: i64_axes */
#endif
#ifdef CASE_float_perm
  r = kiln_permute(x, (float[]){1, 0}); /* case: float_perm */
#endif
#ifdef CASE_number_for_tensor
  r = kiln_add(x, 1); /* case: number_for_tensor */
#endif
#ifdef CASE_tensor_for_list
  r = kiln_cat(x, 2, 0); /* case: tensor_for_list */
#endif
#ifdef CASE_rank_9
  r = kiln_zeros(KILN_F32, KILN_SHAPE(1, 1, 1, 1, 1, 1, 1, 1, 1)); /* case: rank_9 */
#endif
#ifdef CASE_ndim_past_array
  r = kiln_zeros(KILN_F32, 3, (int64_t[]){3, 4}); /* case: ndim_past_array */
#endif
  return r;
}
