/* gpt_app: a program that runs the GPT forward examples/export_gpt.c
 * exported (DIR/gpt_fwd.o and DIR/gpt_fwd.h), linked with libkiln_rt and
 * nothing of libkiln or LLVM:
 *
 *   cc -O2 -IDIR -Iinclude examples/deploy/gpt_app.c DIR/gpt_fwd.o build/libkiln_rt.a \
 *     -lopenblas -lm -lpthread -o DIR/gpt_app && DIR/gpt_app
 *
 * It prints its first call's time (the runtime's start included: its thread
 * pool, its arena), the best of 20 calls after, and the first logits, which
 * are export_gpt's (the same weights and tokens). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "gpt_fwd.h"

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int main(void) {
  int64_t ctx[64];
  for (int t = 0; t < 64; t++) ctx[t] = (t * 37 + 11) % 256; /* export_gpt's tokens */
  kiln_rt_buffer in[1] = {{ctx, 2, {1, 64}}}, out[1] = {{0}};
  double t0 = now_ms();
  if (gpt_fwd_run(in, out)) {
    fprintf(stderr, "%s\n", gpt_fwd_error());
    return 1;
  }
  double first = now_ms() - t0, best = 0;
  const float *logits = out[0].data;
  printf("first call (exported):              %8.2f ms\n", first);
  for (int i = 0; i < 20; i++) {
    t0 = now_ms();
    if (gpt_fwd_run(in, out)) {
      fprintf(stderr, "%s\n", gpt_fwd_error());
      return 1;
    }
    double t = now_ms() - t0;
    best = i == 0 || t < best ? t : best;
  }
  printf("per call (best of 20):              %8.2f ms\n", best);
  printf("logits[0..3]: %.6f %.6f %.6f %.6f\n", logits[0], logits[1], logits[2], logits[3]);
  free(out[0].data);
  return 0;
}
