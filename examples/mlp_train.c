/* mlp_train: a two-layer MLP trained eagerly with plain SGD.
 *
 * The task is synthetic: inputs are standard normal, and each label is the
 * argmax of a fixed random "teacher" MLP's logits, so a student of the same
 * shape can learn it exactly. The program exits nonzero when the loss over
 * the whole data set does not at least halve, so it doubles as a smoke test.
 *
 *   build/examples/mlp_train
 */
#include <stdio.h>
#include <time.h>

#include "kiln.h"

enum { N = 2048, D = 64, H = 128, C = 10, B = 128, STEPS = 200, PRINT_EVERY = 20 };
enum { W1, B1, W2, B2, NPARAM };
static const double LR = 0.5;

/* Parameters, owned by the caller: made in a scope of their own and kept. */
static int mlp_init(kiln_tensor **p, uint64_t seed, double w2_scale) {
  int64_t s_w1[2] = {D, H}, s_b1[1] = {H}, s_w2[2] = {H, C}, s_b2[1] = {C};
  kiln_scope_begin();
  /* 1/sqrt(fan_in) keeps the hidden pre-activations near unit variance */
  p[W1] = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 2, s_w1, seed), kiln_scalar(KILN_F32, 0.125)));
  p[B1] = kiln_keep(kiln_zeros(KILN_F32, 1, s_b1));
  p[W2] = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 2, s_w2, seed + 1), kiln_scalar(KILN_F32, w2_scale)));
  p[B2] = kiln_keep(kiln_zeros(KILN_F32, 1, s_b2));
  kiln_scope_end();
  for (int i = 0; i < NPARAM; i++)
    if (!p[i]) return -1;
  return 0;
}

/* logits (n,C) = gelu(x @ w1 + b1) @ w2 + b2, for x (n,D) */
static kiln_tensor *forward(kiln_tensor **p, kiln_tensor *x) {
  kiln_tensor *h = kiln_gelu(kiln_add(kiln_matmul(x, p[W1]), p[B1]));
  return kiln_add(kiln_matmul(h, p[W2]), p[B2]);
}

/* One SGD step on rows [start, start+B); returns the loss before the update, or -1. */
static double train_step(kiln_tensor **p, kiln_tensor *x, kiln_tensor *y, int64_t start, kiln_tensor *lr) {
  double loss_v = -1;
  kiln_scope_begin();
  kiln_tensor *xb = kiln_slice(x, 0, start, start + B, 1); /* views: no copy */
  kiln_tensor *yb = kiln_slice(y, 0, start, start + B, 1);
  kiln_tensor *loss = kiln_cross_entropy(forward(p, xb), yb);
  if (loss && kiln_backward(loss) == 0) {
    loss_v = kiln_item(loss);
    kiln_no_grad_begin(); /* the update itself must not be recorded */
    for (int i = 0; i < NPARAM; i++) {
      if (!kiln_sub_(p[i], kiln_mul(lr, kiln_grad(p[i])))) loss_v = -1;
      kiln_zero_grad(p[i]);
    }
    kiln_no_grad_end();
  }
  kiln_scope_end(); /* frees the batch views, the activations and the loss */
  return loss_v;
}

/* Loss and accuracy over the whole data set, without recording a graph. */
static int evaluate(kiln_tensor **p, kiln_tensor *x, kiln_tensor *y, double *loss, double *acc) {
  kiln_scope_begin();
  kiln_no_grad_begin();
  kiln_tensor *logits = forward(p, x);
  kiln_tensor *l = kiln_cross_entropy(logits, y);
  kiln_tensor *a = kiln_mean_all(kiln_cast(kiln_eq(kiln_argmax(logits, 1, false), y), KILN_F32));
  int rc = l && a ? 0 : -1;
  if (rc == 0) {
    *loss = kiln_item(l);
    *acc = kiln_item(a);
  }
  kiln_no_grad_end();
  kiln_scope_end();
  return rc;
}

static double now_ms(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

int main(void) {
  printf("mlp_train: %d -> %d (gelu) -> %d MLP, cross entropy, SGD lr %g, batch %d, %d steps, %d threads\n", D,
         H, C, LR, B, STEPS, kiln_get_num_threads());
  printf("data: %d standard normal inputs labelled by a fixed random teacher MLP\n", N);
  kiln_tensor *teacher[NPARAM] = {0}, *p[NPARAM] = {0}, *x = NULL, *y = NULL, *lr = NULL;
  int status = 1;
  int64_t xs[2] = {N, D};

  /* the data set, owned by the caller like the parameters; the teacher's larger
   * w2 makes its argmax clear-cut, the student's is 1/sqrt(H) */
  if (mlp_init(teacher, 100, 0.3) != 0) goto fail;
  x = kiln_randn(KILN_F32, 2, xs, 1);
  kiln_scope_begin();
  y = kiln_keep(kiln_argmax(forward(teacher, x), 1, false)); /* i64 labels (N,) */
  kiln_scope_end();
  lr = kiln_scalar(KILN_F32, LR);
  if (!x || !y || !lr || mlp_init(p, 200, 0.088) != 0) goto fail;
  for (int i = 0; i < NPARAM; i++) kiln_requires_grad(p[i], true);

  double loss0, acc0, loss1, acc1;
  if (evaluate(p, x, y, &loss0, &acc0) != 0) goto fail;
  double t0 = now_ms();
  for (int step = 0; step < STEPS; step++) {
    double l = train_step(p, x, y, (int64_t)step * B % N, lr);
    if (l < 0) goto fail;
    if (step % PRINT_EVERY == 0 || step == STEPS - 1) printf("step %3d  loss %.4f\n", step, l);
  }
  double ms = (now_ms() - t0) / STEPS;
  if (evaluate(p, x, y, &loss1, &acc1) != 0) goto fail;

  printf("all %d rows: loss %.4f -> %.4f, accuracy %.1f%% -> %.1f%%\n", N, loss0, loss1, 100 * acc0, 100 * acc1);
  printf("%.3f ms per step\n", ms);
  status = loss1 <= loss0 / 2 ? 0 : 2;
  if (status) fprintf(stderr, "mlp_train: the loss did not halve (%.4f -> %.4f)\n", loss0, loss1);
  goto done;
fail:
  fprintf(stderr, "mlp_train: %s\n", kiln_last_error());
done:
  for (int i = 0; i < NPARAM; i++) {
    kiln_release(teacher[i]);
    kiln_release(p[i]);
  }
  kiln_release(x);
  kiln_release(y);
  kiln_release(lr);
  return status;
}
