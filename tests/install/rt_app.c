/* Links an object kilnc made from tests/install/twice.kiln with the
 * installed libkiln_rt alone; prints "ok" when twice([1, 2, 3]) is [2, 4, 6]
 * and a length past the graph's bound is an error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "twice.h"

int main(void) {
  float x[3] = {1, 2, 3};
  kiln_rt_buffer in[1] = {{x, 1, {3}}}, out[1] = {{0}};
  if (twice_run(in, out)) return printf("error: %s\n", twice_error()), 1;
  const float *y = out[0].data;
  int good = out[0].ndim == 1 && out[0].shape[0] == 3 && y[0] == 2 && y[1] == 4 && y[2] == 6;
  free(out[0].data);
  in[0].shape[0] = 2000;
  float *big = calloc(2000, sizeof *big);
  in[0].data = big;
  int refused = twice_run(in, out) == -1 && strstr(twice_error(), "outside the bounds of s0");
  free(big);
  puts(good && refused ? "ok" : "wrong");
  return good && refused ? 0 : 1;
}
