/* A program built against an installed kiln (tests/install/check.sh): eager
 * ops, a backward pass and a compiled call, each checked against values
 * worked out by hand. Prints "ok <library version> <header version>". */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <kiln.h>

/* out[0] = 2 * x */
static int twice(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_mul(in[0], kiln_scalar(KILN_F32, 2));
  return out[0] ? 0 : -1;
}

int main(void) {
  int ok = 1;
  kiln_scope_begin();
  kiln_tensor *w = kiln_tensor_from(KILN_F32, KILN_SHAPE(3), (float[]){1, 2, 3});
  kiln_requires_grad(w, true);
  kiln_tensor *loss = kiln_sum_all(kiln_mul(w, w)); /* 1 + 4 + 9 */
  ok &= loss && kiln_item(loss) == 14 && kiln_backward(loss) == 0;
  float g[3] = {0};
  ok &= kiln_read(kiln_grad(w), g, sizeof g) == 0 && g[0] == 2 && g[1] == 4 && g[2] == 6; /* 2w */

  kiln_fn *fn = kiln_compile(twice, NULL, &(kiln_options){.name = "twice", .n_in = 1});
  for (int i = 0; i < 2; i++) { /* a trace, then compiled code */
    kiln_tensor *y = NULL;
    ok &= fn && kiln_call(fn, (kiln_tensor *[]){kiln_ones(KILN_F32, KILN_SHAPE(4))}, &y) == 0;
    ok &= y && kiln_item(kiln_sum_all(y)) == 8;
  }
  kiln_fn_free(fn);
  kiln_scope_end();
  if (!ok) {
    fprintf(stderr, "failed: %s\n", kiln_last_error());
    return 1;
  }
  printf("ok %s %s\n", kiln_version(), KILN_VERSION_STRING);
  return strcmp(kiln_version(), KILN_VERSION_STRING) != 0;
}
