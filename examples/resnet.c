/* resnet: ResNet-18 (the CIFAR variant, 32x32 images) trained eagerly and
 * compiled side by side, then run for inference in eval mode.
 *
 * Two copies of the model start from the same weights. Each step, copy A
 * runs the training step (forward, cross entropy, backward, SGD, the batch
 * norms' running statistics) as a plain C function, and copy B runs the same
 * function through kiln_compile: the first call traces it, the later ones
 * run the compiled graph. Both see the same batches of a synthetic dataset
 * (examples/resnet.h) and their losses must agree and fall. Then copy A
 * switches to eval mode (running statistics) and classifies a batch of 1
 * and of 32, eagerly and compiled, which must agree too; the time of each
 * is printed. The program exits nonzero when anything is off, so it doubles
 * as a smoke test.
 *
 *   build/examples/resnet [--width 64] [--batch 32] [--steps 25]
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kiln.h"
#include "resnet.h"

/* |eager - compiled| allowed for a loss: RTOL * |eager| + ATOL. The two runs
 * round differently (fused reductions), a ReLU whose batch-normalized input
 * rounds to either side of 0 then passes a gradient in one run and not the
 * other, and the runs drift apart slowly, relatively most where the loss
 * comes near 0 */
static const double RTOL = 1e-2, ATOL = 2e-3;

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int fail(const char *what) {
  fprintf(stderr, "resnet: %s: %s\n", what, kiln_last_error());
  return 1;
}

/* Eval mode: batch n eagerly and compiled (fn, over the same model), compared; the median ms of each over `reps` calls. */
static int inference(resnet *eager, kiln_fn *fn, kiln_tensor *templates, int64_t n, int reps) {
  uint64_t rng = 99 + (uint64_t)n;
  kiln_scope_begin();
  kiln_tensor *x, *labels, *ye = NULL, *yc = NULL;
  int rc = rn_batch(templates, n, &rng, &x, &labels);
  double te[16], tc[16];
  for (int r = 0; r < reps && rc == 0; r++) {
    double t0 = now_ms();
    ye = resnet_forward(eager, x);
    double t1 = now_ms();
    rc = ye && kiln_call(fn, &x, &yc) == 0 ? 0 : -1;
    te[r] = t1 - t0, tc[r] = now_ms() - t1;
  }
  if (rc) {
    kiln_scope_end();
    return fail("inference");
  }
  int64_t k = kiln_numel(ye);
  float *a = malloc(sizeof(float) * (size_t)k), *b = malloc(sizeof(float) * (size_t)k);
  double worst = 0;
  if (a && b && kiln_read(ye, a, sizeof(float) * (size_t)k) == 0 && kiln_read(yc, b, sizeof(float) * (size_t)k) == 0)
    for (int64_t i = 0; i < k; i++) worst = fmax(worst, fabs(a[i] - b[i]) / (1 + fabs(a[i])));
  else
    worst = INFINITY;
  free(a), free(b);
  kiln_scope_end();
  /* the medians, by sorting the few samples */
  for (int i = 1; i < reps; i++)
    for (int j = i; j > 0 && te[j] < te[j - 1]; j--) { double t = te[j]; te[j] = te[j - 1]; te[j - 1] = t; }
  for (int i = 1; i < reps; i++)
    for (int j = i; j > 0 && tc[j] < tc[j - 1]; j--) { double t = tc[j]; tc[j] = tc[j - 1]; tc[j - 1] = t; }
  printf("inference, eval mode, batch %2lld: eager %8.2f ms, compiled %8.2f ms (%.2fx), max rel diff of the logits %.2g\n",
         (long long)n, te[reps / 2], tc[reps / 2], te[reps / 2] / tc[reps / 2], worst);
  if (!(worst < 1e-3)) {
    fprintf(stderr, "resnet: eager and compiled logits differ (%.3g)\n", worst);
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  int width = 64, batch = 32, steps = 25;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--width") && i + 1 < argc) width = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--batch") && i + 1 < argc) batch = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: %s [--width 64] [--batch 32] [--steps 25]\n", argv[0]);
      return 2;
    }
  }
  if (width < 1 || batch < 2 || steps < 2) return fprintf(stderr, "resnet: width >= 1, batch >= 2, steps >= 2\n"), 2;
  resnet a, b;
  if (resnet18_cifar_init(&a, width, 10, 1) || resnet18_cifar_init(&b, width, 10, 1)) return fail("init");
  printf("ResNet-18 (CIFAR variant), width %d, %d parameter tensors, batch %d, %d threads\n", width, a.n_params, batch,
         kiln_get_num_threads());
  kiln_tensor *templates = rn_templates(10, 32);
  kiln_options o = {.name = "resnet18_train", .n_in = 2, .n_out = 1};
  kiln_fn *train = kiln_compile(resnet_train_body, &b, &o);
  uint64_t rng = 5;
  double first = 0, last = 0, worst = 0, t_eager = 0, t_comp = 0;
  printf("%5s %12s %12s %10s %10s\n", "step", "eager loss", "compiled", "eager ms", "compiled ms");
  for (int s = 0; s < steps; s++) {
    kiln_scope_begin();
    kiln_tensor *x, *labels, *lb = NULL;
    if (rn_batch(templates, batch, &rng, &x, &labels)) return fail("data");
    double t0 = now_ms();
    kiln_tensor *la = resnet_train_step(&a, x, labels);
    double t1 = now_ms();
    if (!la) return fail("eager step");
    if (kiln_call(train, (kiln_tensor *[]){x, labels}, &lb)) return fail("compiled step");
    double t2 = now_ms();
    double va = kiln_item(la), vb = kiln_item(lb), rel = fabs(va - vb) / fabs(va);
    bool close = fabs(va - vb) <= RTOL * fabs(va) + ATOL;
    worst = fmax(worst, rel);
    if (s == 0) first = va;
    last = va;
    if (s > 0) t_eager += t1 - t0, t_comp += t2 - t1; /* the first compiled call traces and compiles */
    if (getenv("RN_ALL") || s % 5 == 0 || s == steps - 1) printf("%5d %12.6f %12.6f %10.1f %10.1f\n", s, va, vb, t1 - t0, t2 - t1);
    kiln_scope_end();
    if (!close) {
      fprintf(stderr, "resnet: step %d: eager loss %.8g, compiled %.8g\n", s, va, vb);
      return 1;
    }
  }
  kiln_fn_stats st;
  kiln_fn_get_stats(train, &st);
  printf("losses agree to %.2g (relative); mean step after the first: eager %.1f ms, compiled %.1f ms (%.2fx); "
         "compile %.0f ms\n", worst, t_eager / (steps - 1), t_comp / (steps - 1), t_eager / t_comp, st.compile_ms);
  if (!(last < 0.7 * first) || st.variants != 1 || st.fallbacks) {
    fprintf(stderr, "resnet: the loss went from %.4f to %.4f (%lld variants, %lld fallbacks)\n", first, last,
            (long long)st.variants, (long long)st.fallbacks);
    return 1;
  }

  /* eval mode: the running statistics; batch 1 is a variant of its own (a
   * dim of 1 is traced as a constant), the other sizes share a symbolic one */
  a.training = b.training = false;
  kiln_options oi = {.name = "resnet18_infer", .n_in = 1, .n_out = 1};
  kiln_fn *infer = kiln_compile(resnet_forward_body, &a, &oi); /* the eager copy's weights: eval mode changes nothing */
  kiln_mark_dynamic(infer, 0, 0);
  int rc = inference(&a, infer, templates, 1, 9) || inference(&a, infer, templates, batch, 5);
  kiln_fn_get_stats(infer, &st);
  if (!rc && st.fallbacks) {
    fprintf(stderr, "resnet: inference fell back to eager %lld times\n", (long long)st.fallbacks);
    rc = 1;
  }
  kiln_fn_free(infer);
  kiln_fn_free(train);
  kiln_release(templates);
  resnet_free(&a), resnet_free(&b);
  return rc;
}
